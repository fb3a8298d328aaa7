"""Requests whose heads RFC 9112 refuses and llhttp takes, refused by the server's HTTP protocol.

Each goes to a tensor route answered by the protocol itself (`INFER`) and to one answered
through ASGI (the same route, percent-encoded), and reaches neither: its answer is a JSON error,
the connection closes, and the metrics count one `bad_http` rejection.
"""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from lightship.serve import protocol
from tests.handmade import expected_logits
from tests.unit.test_serve_app import (
    INFER,
    Exchange,
    X,
    exchange,
    make_app,
    metric,
    raw_http,
    read_answer,
    run,
    serving,
    v2_binary,
    v2_json,
)

ASGI_INFER = "/v2/models/h%61nd/infer"
WAYS = pytest.mark.parametrize("path", [INFER, ASGI_INFER], ids=["protocol", "asgi"])
BAD_HTTP = 'lightship_rejections_total{reason="bad_http"}'
BODY = json.dumps(v2_json(X)).encode()
SEND_HTTP11 = "send HTTP/1.1 (curl: --http1.1)"


def request(path: str, *headers: str, version: str = "HTTP/1.1", body: bytes = BODY) -> bytes:
    """A POST of `body` with exactly `headers` (no Host unless among them)."""
    head = [f"POST {path} {version}", "content-type: application/json", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def length(body: bytes = BODY) -> str:
    return f"content-length: {len(body)}"


def refused(tmp_path: Path, data: bytes) -> tuple[Exchange, list[str], float]:
    """The answer to `data` on a new connection, the paths that reached ASGI, and the count of
    `bad_http` rejections."""
    app, _ = make_app(tmp_path)

    async def main() -> tuple[Exchange, list[str], float]:
        async with raw_http(app) as (connect, counting, http):
            answer = await exchange(connect, data)
            reached = list(counting.paths)
            return answer, reached, metric((await http.get("/metrics")).text, BAD_HTTP)

    return run(main())


def assert_refused(answer: Exchange, status: int, error: str) -> None:
    code, headers, body, rest = answer
    assert (code, headers["connection"], rest) == (status, "close", b""), body
    assert headers["content-type"] == "application/json"
    assert json.loads(body) == {"error": error}


def logits(body: bytes) -> list[float]:
    out = {o["name"]: o for o in json.loads(body)["outputs"]}["logits"]
    return list(out["data"])


LOGITS = expected_logits(X).ravel().tolist()


HOSTS = [
    (
        "HTTP/1.1 without",
        [],
        "HTTP/1.1",
        "no Host header, which an HTTP/1.1 request needs (RFC 9112 3.2): send one naming the "
        "server and its port, as HTTP clients do",
    ),
    (
        "HTTP/1.1, two",
        ["host: a", "host: b"],
        "HTTP/1.1",
        "2 Host headers (RFC 9112 3.2): send one",
    ),
    (
        "HTTP/1.0, two",
        ["host: a", "host: a"],
        "HTTP/1.0",
        "2 Host headers (RFC 9112 3.2): send one",
    ),
]


@WAYS
@pytest.mark.parametrize(
    ("hosts", "version", "error"), [h[1:] for h in HOSTS], ids=[h[0] for h in HOSTS]
)
def test_a_host_header_missing_from_http11_or_repeated_is_refused_400(
    tmp_path: Path, path: str, hosts: list[str], version: str, error: str
) -> None:
    """RFC 9112 3.2. An HTTP/1.0 request without Host is still answered."""
    app, _ = make_app(tmp_path)
    data = request(path, *hosts, length(), version=version)

    async def main() -> tuple[Exchange, list[str], Exchange, float]:
        async with raw_http(app) as (connect, counting, http):
            answer = await exchange(connect, data)
            reached = list(counting.paths)
            old = await exchange(connect, request(path, length(), version="HTTP/1.0"))
            return answer, reached, old, metric((await http.get("/metrics")).text, BAD_HTTP)

    answer, reached, old, rejections = run(main())
    assert_refused(answer, 400, error)
    assert reached == [] and rejections == 1
    assert old[0] == 200 and logits(old[2]) == LOGITS


@WAYS
@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("HTTP/2.0", "HTTP/2.0"),  # llhttp takes these two
        ("HTTP/0.9", "HTTP/0.9"),
        ("HTTP/1.2", "the request's HTTP version"),  # and refuses this one itself
    ],
)
def test_an_http_version_but_11_and_10_is_refused_505(
    tmp_path: Path, path: str, line: str, said: str
) -> None:
    answer, reached, rejections = refused(
        tmp_path, request(path, "host: t", length(), version=line)
    )
    assert_refused(answer, 505, f"{said} is not supported, only HTTP/1.1 and 1.0: {SEND_HTTP11}")
    assert reached == [] and rejections == 1


def test_the_http2_preface_is_refused_505(tmp_path: Path) -> None:
    """`curl --http2-prior-knowledge`: llhttp refused it as malformed (400)."""
    answer, _, rejections = refused(tmp_path, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    assert_refused(answer, 505, f"HTTP/2 is not supported, only HTTP/1.1 and 1.0: {SEND_HTTP11}")
    assert rejections == 1


CHUNKED_BODY = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
NOT_CHUNKED_ALONE = (
    "is not supported, only chunked alone: send the body with a Content-Length, or chunked "
    "(compressed: Content-Encoding gzip)"
)


@WAYS
@pytest.mark.parametrize(
    ("codings", "status", "error"),
    [
        (["gzip, chunked"], 501, f"Transfer-Encoding 'gzip, chunked' {NOT_CHUNKED_ALONE}"),
        (["gzip", "chunked"], 501, f"Transfer-Encoding 'gzip, chunked' {NOT_CHUNKED_ALONE}"),
        (
            ["gzip"],  # llhttp refused it too, after the head, as malformed
            400,
            "Transfer-Encoding 'gzip' does not end with chunked, so the body has no known length "
            "(RFC 9112 6.3): send it with a Content-Length, or chunked",
        ),
    ],
    ids=["one line", "two lines", "not chunked"],
)
def test_a_transfer_coding_but_chunked_is_refused_not_ignored(
    tmp_path: Path, path: str, codings: list[str], status: int, error: str
) -> None:
    """RFC 9112 6.1, 9110 15.6.2: the gzip was dropped, the body read as if only chunked.
    `Chunked` alone, in any case, is still taken."""
    app, _ = make_app(tmp_path)
    coded = [f"transfer-encoding: {c}" for c in codings]

    async def main() -> tuple[Exchange, list[str], Exchange, float]:
        async with raw_http(app) as (connect, counting, http):
            answer = await exchange(connect, request(path, "host: t", *coded, body=CHUNKED_BODY))
            reached = list(counting.paths)
            chunked = request(
                path,
                "host: t",
                "transfer-encoding: Chunked",
                "connection: close",
                body=CHUNKED_BODY,
            )
            taken = await exchange(connect, chunked)
            return answer, reached, taken, metric((await http.get("/metrics")).text, BAD_HTTP)

    answer, reached, taken, rejections = run(main())
    assert_refused(answer, status, error)
    assert reached == [] and rejections == 1
    assert taken[0] == 200 and logits(taken[2]) == LOGITS


@WAYS
def test_100_continue_goes_to_http11_clients_only(tmp_path: Path, path: str) -> None:
    """RFC 9110 10.1.1. The body never comes: the request's deadline answers it (408), after
    the server has waited for the body, which is when it sends 100 (Continue)."""
    app, _ = make_app(tmp_path, timeout_ms=200)

    async def answer(connect: Callable[[], Awaitable[Any]], version: str) -> bytes:
        reader, writer = await connect()
        writer.write(
            request(path, "host: t", length(), "expect: 100-continue", version=version, body=b"")
        )
        answer = await asyncio.wait_for(reader.read(), 5)  # until the server closes
        writer.close()
        return answer

    async def main() -> tuple[bytes, bytes]:
        async with raw_http(app) as (connect, _, _):
            return await asyncio.gather(answer(connect, "HTTP/1.0"), answer(connect, "HTTP/1.1"))

    old, new = run(main())
    timeout = b"HTTP/1.1 408 Request Timeout\r\n"
    assert old.startswith(timeout), old[:80]
    assert new.startswith(b"HTTP/1.1 100 Continue\r\n\r\n" + timeout), new[:80]


@WAYS
@pytest.mark.parametrize("name", ["Content-Encoding", "Inference-Header-Content-Length"])
def test_a_repeated_header_read_once_is_refused_400(tmp_path: Path, path: str, name: str) -> None:
    """Its last line was taken: here both say the same, and the request would be answered."""
    binary, headers = v2_binary(X)
    body = gzip.compress(binary)
    both = {"Content-Encoding": "gzip", **headers}
    lines = [f"{k}: {v}" for k, v in both.items()] + [f"{name}: {both[name]}"]
    data = request(path, "host: t", length(body), *lines, body=body)
    answer, reached, rejections = refused(tmp_path, data)
    assert_refused(answer, 400, f"2 {name} headers: send one")
    assert reached == [] and rejections == 1


@pytest.mark.parametrize(
    ("name", "status", "error"),
    [
        (
            "Content-Encoding",
            415,
            "Content-Encoding gzip, gzip is not supported: use gzip or deflate",
        ),
        (
            "Inference-Header-Content-Length",
            400,
            "Inference-Header-Content-Length must be the JSON header's length in bytes (0 or more), "
            "got '{0}, {0}'",
        ),
    ],
)
def test_a_repeated_header_joins_the_first_through_asgi(
    tmp_path: Path, name: str, status: int, error: str
) -> None:
    """Without the server's protocol (in-process ASGI, uvicorn's h11) the lines are joined
    (RFC 9110 5.3), not the last taken."""
    app, _ = make_app(tmp_path)
    binary, headers = v2_binary(X)
    both = {"Content-Encoding": "gzip", **headers}
    lines = [*both.items(), (name, both[name])]

    async def main() -> httpx.Response:
        async with serving(app) as client:
            return await client.post(INFER, content=gzip.compress(binary), headers=lines)

    r = run(main())
    assert r.status_code == status
    assert r.json() == {"error": error.format(headers["Inference-Header-Content-Length"])}


def test_a_websocket_handshake_is_refused_in_json(tmp_path: Path) -> None:
    """A GET: uvicorn's WebSocket protocol answered a bare text/plain 403."""
    ws = (
        "GET /v2/health/ready HTTP/1.1\r\nhost: t\r\nconnection: Upgrade\r\nupgrade: websocket\r\n"
        "sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    answer, reached, rejections = refused(tmp_path, ws.encode())
    error = "this server has no WebSocket routes: send the request without Upgrade, as plain HTTP"
    assert_refused(answer, 403, error)
    assert reached == [] and rejections == 1


@WAYS
def test_a_refused_head_pipelined_is_answered_in_order_and_ends_the_connection(
    tmp_path: Path, path: str
) -> None:
    """The refusal stops the parser: neither the refused request's body nor a request behind
    it is read."""
    app, _ = make_app(tmp_path)
    good = request(path, "host: t", length())
    version = request(path, "host: t", length(), version="HTTP/2.0")

    async def main() -> tuple[list[tuple[int, dict[str, str], bytes]], bytes, list[str]]:
        async with raw_http(app) as (connect, counting, _):
            reader, writer = await connect()
            writer.write(good + version + good)
            answers = [await asyncio.wait_for(read_answer(reader), 5) for _ in range(2)]
            rest = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return answers, rest, list(counting.paths)

    (first, second), rest, reached = run(main())
    assert first[0] == 200 and logits(first[2]) == LOGITS
    assert (second[0], second[1]["connection"], rest) == (505, "close", b"")
    assert json.loads(second[2])["error"].startswith("HTTP/2.0 is not supported")
    assert reached == ([] if path == INFER else [INFER])  # the first, decoded by uvicorn


@WAYS
def test_a_broken_body_pipelined_is_answered_after_the_requests_ahead_of_it(
    tmp_path: Path, path: str
) -> None:
    """A request whose chunked body does not parse, queued behind one not answered yet, was
    answered at once: its 400 went out in the first request's place, whose own answer the
    close then dropped. It never starts; its 400 follows the first answer, as a refused
    head's does."""
    app, _ = make_app(tmp_path)
    good = request(path, "host: t", length())
    broken = request(path, "host: t", "transfer-encoding: chunked", body=b"2\r\n{}\r\nZZ\r\n")

    async def main() -> tuple[list[tuple[int, dict[str, str], bytes]], bytes, list[str], float]:
        async with raw_http(app) as (connect, counting, http):
            reader, writer = await connect()
            writer.write(good + broken)
            answers = [await asyncio.wait_for(read_answer(reader), 5) for _ in range(2)]
            rest = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            reached = list(counting.paths)
            rejections = metric((await http.get("/metrics")).text, BAD_HTTP)
            return answers, rest, reached, rejections

    (first, second), rest, reached, rejections = run(main())
    assert first[0] == 200 and logits(first[2]) == LOGITS
    assert (second[0], second[1]["connection"], rest) == (400, "close", b"")
    assert json.loads(second[2]) == {
        "error": "malformed HTTP request: Invalid character in chunk size"
    }
    assert reached == ([] if path == INFER else [INFER])  # the first only
    assert rejections == 1


def test_an_answered_request_leaves_its_body_with_nobody_on_a_kept_alive_connection(
    tmp_path: Path,
) -> None:
    """The answered request stays the connection's cycle until the next one: 8 pooled
    clients idle after bodies of 8 MiB held 64 MiB for the keep-alive's seconds."""
    app, _ = make_app(tmp_path)
    body = json.dumps(v2_json(X)).encode() + b" " * (1 << 20)  # JSON allows trailing spaces

    def cycles() -> list[protocol._TensorCycle]:
        return [c for c in gc.get_objects() if isinstance(c, protocol._TensorCycle)]

    earlier = cycles()  # other tests' connections, not collected yet (kept: ids get reused)

    async def main() -> list[int]:
        async with raw_http(app) as (connect, _, _):
            reader, writer = await connect()
            writer.write(request(INFER, "host: t", length(body), body=body))
            code, _, answer = await asyncio.wait_for(read_answer(reader), 5)
            assert code == 200 and logits(answer) == LOGITS
            held = [len(c._data) for c in cycles() if not any(c is e for e in earlier)]
            writer.close()
            return held

    held = run(main())
    assert held == [0]  # the one cycle, its body handed over


def test_an_error_in_our_own_parser_callback_is_a_logged_500_not_the_clients_fault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """llhttp wraps an exception raised in one of our callbacks (a bug here) as a parse error:
    it was answered 400 'malformed' and logged as the client's, its traceback dropped."""

    def broken(self: protocol._TensorCycle, body: bytes) -> None:
        raise RuntimeError("a bug in feed")

    monkeypatch.setattr(protocol._TensorCycle, "feed", broken)
    with caplog.at_level(logging.ERROR, logger="lightship.serve.protocol"):
        (code, headers, body, _), _, bad_http = refused(
            tmp_path, request(INFER, "host: t", length())
        )
    assert (code, headers["connection"]) == (500, "close")
    assert json.loads(body) == {"error": protocol.BUG}
    assert bad_http == 0  # not counted as a bad request
    [record] = [r for r in caplog.records if "callback of the HTTP parser" in r.getMessage()]
    assert record.exc_info is not None and "a bug in feed" in str(record.exc_info[1])


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_an_upload_read_slowly_is_read_ahead_a_bounded_amount(loop: str) -> None:
    """ASGI body back-pressure: an app slower than the network slows the client down, and the
    connection keeps READ_AHEAD_BYTES and two reads ahead of the app at most. With the socket
    left reading between a release and its feed, uvloop (up to 32 reads of 256 KB a turn)
    kept 8.4 MB a connection, and a 64 MiB upload no longer waited for the app."""
    import threading

    import uvicorn
    from uvicorn.server import ServerState

    total = 16 << 20
    most = {"held": 0}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen, more = 0, True
        while more:
            message = await receive()
            seen += len(message.get("body", b""))
            more = message.get("more_body", False)
            await asyncio.sleep(0.002)  # slower than loopback
        answer = str(seen).encode()
        length = [(b"content-length", b"%d" % len(answer))]
        await send({"type": "http.response.start", "status": 200, "headers": length})
        await send({"type": "http.response.body", "body": answer})

    class Probe(protocol.http_protocol(None)):  # type: ignore[misc]
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            most["held"] = max(most["held"], len(self._held or b""))

    def upload(port: int, answers: list[bytes]) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /u HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % total)
            piece = b"x" * 65536
            for _ in range(total // len(piece)):
                sock.sendall(piece)
            sock.settimeout(30)
            data = b""
            while not data.endswith(b"\r\n\r\n%d" % total):
                if not (chunk := sock.recv(65536)):
                    break
                data += chunk
            answers.append(data)

    async def main() -> list[bytes]:
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False)
        config.load()
        state = ServerState()
        server = await asyncio.get_running_loop().create_server(
            lambda: Probe(config=config, server_state=state, app_state={}), "127.0.0.1", 0
        )
        answers: list[bytes] = []
        client = threading.Thread(target=upload, args=(server.sockets[0].getsockname()[1], answers))
        client.start()
        while client.is_alive():
            await asyncio.sleep(0.01)
        server.close()
        return answers

    answers = run(main(), loop)
    assert answers and answers[0].endswith(b"\r\n\r\n%d" % total)  # the body came whole
    # two of uvloop's reads (256,000 bytes each): the one that crossed the mark while the app
    # was behind, and one more as reading resumed, before the kept bytes were fed
    assert most["held"] <= protocol.READ_AHEAD_BYTES + 2 * 256_000, most


IMAGES = "/v1/predict/image"


@pytest.mark.parametrize("path", [INFER, ASGI_INFER, IMAGES], ids=["protocol", "asgi", "images"])
def test_a_broken_chunked_body_counts_as_refused_not_as_a_client_that_left(
    tmp_path: Path, path: str
) -> None:
    """The server answers 400 and closes; the routes also counted the request's body, cut off
    by that close, as a client gone (`disconnected`), though the client never left."""
    app, _ = make_app(tmp_path)
    if path == IMAGES:  # an upload's part begun, then the chunk that does not parse
        part = b'--b\r\ncontent-disposition: form-data; name="files"; filename="a.png"\r\n\r\n'
        head = f"POST {path} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n"
        head += "content-type: multipart/form-data; boundary=b\r\n\r\n"
        broken = head.encode() + b"%x\r\n%s\r\nZZ\r\n" % (len(part), part)
    else:
        broken = request(path, "host: t", "transfer-encoding: chunked", body=b"2\r\n{}\r\nZZ\r\n")

    async def main() -> tuple[int, str]:
        async with raw_http(app) as (connect, _, http):
            reader, writer = await connect()
            writer.write(broken)
            status, _, _ = await asyncio.wait_for(read_answer(reader), 5)
            await asyncio.wait_for(reader.read(), 5)  # the server's close
            writer.close()
            await asyncio.sleep(0.1)
            return status, (await http.get("/metrics")).text

    status, text = run(main())
    assert status == 400
    template = IMAGES if path == IMAGES else "/v2/models/{model_name}/infer"
    assert metric(text, f'lightship_requests_total{{route="{template}",status="400"}}') == 1
    assert metric(text, 'lightship_rejections_total{reason="disconnected"}') == 0


TARGETS = [
    ("port out of range", request(f"http://x:99999{INFER}", "host: x", length())),
    ("GET, port out of range", b"GET http://x:99999/v2 HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("GET, unclosed IPv6", b"GET http://[::1/v2 HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("CONNECT", b"CONNECT x:443 HTTP/1.1\r\nhost: x:443\r\n\r\n"),
]


@pytest.mark.parametrize("data", [t[1] for t in TARGETS], ids=[t[0] for t in TARGETS])
def test_a_request_target_the_url_parser_refuses_is_a_400_not_a_bug(
    tmp_path: Path, data: bytes
) -> None:
    """llhttp takes these request lines and httptools' URL parser does not: they were a 500
    with "a bug" in the log, counted nowhere."""
    answer, reached, bad_http = refused(tmp_path, data)
    said = data.split(b" ")[1].decode()
    assert_refused(
        answer,
        400,
        f"malformed request target {said!r}: send a path, such as /v2/health/ready",
    )
    assert (reached, bad_http) == ([], 1)
