"""`lightship serve` as a real uvicorn process, driven by the official tritonclient and httpx.

Each server is started with `python -m lightship serve` on a free port and is ready when
/v2/health/ready answers 200; it is stopped with SIGTERM and must exit 0.
"""

from __future__ import annotations

import contextlib
import email.utils
import gzip
import hashlib
import http.client
import io
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import httpx
import numpy as np
import onnxruntime
import pytest
import tritonclient.http as triton
from PIL import Image
from tritonclient.utils import InferenceServerException

from lightship.runtime import load_predictor
from lightship.serve import memory
from tests.conftest import ROOT, SPAWNED, last_line, run_cli
from tests.handmade import expected_logits, handmade_onnx

X = np.array([[[[1, 2], [3, 4]]], [[[255, 255], [255, 255]]]], np.uint8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`lightship serve ARGS` in a subprocess; its log goes to a file (a pipe could fill up)."""

    def __init__(self, *args: str, log: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.log = log
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if "LIGHTSHIP_PORT" not in (env or {}):
            args = (*args, "--port", str(self.port))
        else:
            self.port = int(full_env["LIGHTSHIP_PORT"])
            self.url = f"http://127.0.0.1:{self.port}"
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lightship", "serve", *args],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
            )
        SPAWNED.append(self.proc)  # killed after the test if it is left running
        self.started = time.monotonic()
        # For its polls: each `httpx.get` makes a client of its own, and its SSL context (55 ms
        # of CPU, 2-core AVX2 EPYC) took a core from the server starting or under test.
        self.client = httpx.Client(timeout=5)

    def wait_ready(self, timeout: float = 60) -> Server:
        """Poll readiness (another process: there is no event to wait on)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.output()}")
            try:
                if self.client.get(f"{self.url}/v2/health/ready", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text()

    def cpu_seconds(self) -> float:
        """utime + stime of the whole process (all threads), from /proc."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def metrics(self) -> dict[str, float]:
        text = self.client.get(f"{self.url}/metrics").text
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }

    def close(self) -> None:
        """Stop it if it still runs (`contextlib.closing`: a test that fails leaves none)."""
        self.client.close()
        self.stop()

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def hand_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return handmade_onnx(tmp_path_factory.mktemp("hand") / "hand.onnx")


@pytest.fixture(scope="module")
def hand(hand_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "hand.log"
    server = Server("--run", str(hand_model), "--max-wait-ms", "5", log=log).wait_ready()
    yield server
    assert server.stop() == 0, server.output()


def client(server: Server) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url=f"127.0.0.1:{server.port}")


def test_tritonclient_reads_metadata_and_readiness(hand: Server) -> None:
    c = client(hand)
    assert c.is_server_live() and c.is_server_ready()
    assert c.is_model_ready("hand") and not c.is_model_ready("other")
    assert c.get_server_metadata()["name"] == "lightship"
    meta = c.get_model_metadata("hand")
    assert meta["inputs"] == [{"name": "input", "datatype": "UINT8", "shape": [-1, 1, 2, 2]}]
    assert [o["name"] for o in meta["outputs"]] == ["logits", "probabilities"]
    assert c.get_model_metadata("hand", model_version="1")["name"] == "hand"
    config = c.get_model_config("hand")  # Triton's model configuration, as perf_analyzer reads it
    assert config["max_batch_size"] == 64 and config["input"][0]["dims"] == [1, 2, 2]
    assert config["dynamic_batching"] == {"max_queue_delay_microseconds": 5000}


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_gets_exact_predictions(hand: Server, binary: bool) -> None:
    c = client(hand)
    inp = triton.InferInput("input", list(X.shape), "UINT8")
    inp.set_data_from_numpy(X, binary_data=binary)
    outputs = [
        triton.InferRequestedOutput("logits", binary_data=binary),
        triton.InferRequestedOutput("probabilities", binary_data=binary, class_count=2),
    ]
    result = c.infer("hand", [inp], outputs=outputs, request_id="req-1")
    np.testing.assert_array_equal(result.as_numpy("logits"), [[10, 90], [1020, -920]])
    assert result.get_response()["id"] == "req-1"
    top = [
        [v.decode() if isinstance(v, bytes) else v for v in row]
        for row in result.as_numpy("probabilities")
    ]
    assert len(top) == 2 and len(top[0]) == 2  # "score:index:label", best first
    assert top[0][0].endswith(":1:dark") and top[0][1].endswith(":0:bright")
    assert top[1][0].startswith("1.000000:0:bright")
    # no outputs named: tritonclient asks for all of them in binary
    result = c.infer("hand", [inp])
    np.testing.assert_array_equal(result.as_numpy("logits"), expected_logits(X))
    np.testing.assert_allclose(result.as_numpy("probabilities").sum(1), [1, 1], rtol=1e-6)


def test_tritonclient_fp32_compressed_and_errors(hand: Server) -> None:
    c = client(hand)
    inp = triton.InferInput("input", list(X.shape), "FP32")
    inp.set_data_from_numpy(X.astype(np.float32))
    result = c.infer("hand", [inp], request_compression_algorithm="gzip", model_version="1")
    np.testing.assert_array_equal(result.as_numpy("logits"), expected_logits(X))
    with pytest.raises(InferenceServerException, match="unknown model 'nope'") as info:
        c.infer("nope", [inp])
    assert info.value.status() == "404"
    bad = triton.InferInput("input", [1, 1, 3, 3], "UINT8")
    bad.set_data_from_numpy(np.zeros((1, 1, 3, 3), np.uint8))
    with pytest.raises(InferenceServerException, match=r"expected shape \[N, 1, 2, 2\]") as info:
        c.infer("hand", [bad])
    assert info.value.status() == "400"
    nan = triton.InferInput("input", [1, 1, 2, 2], "FP32")
    nan.set_data_from_numpy(np.full((1, 1, 2, 2), np.nan, np.float32))
    with pytest.raises(InferenceServerException, match="NaN"):
        c.infer("hand", [nan])


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_compresses_requests_and_answers(hand: Server, algorithm: str) -> None:
    c = client(hand)
    x = np.random.default_rng(6).integers(0, 256, (64, 1, 2, 2), dtype=np.uint8)
    inp = triton.InferInput("input", list(x.shape), "UINT8")
    inp.set_data_from_numpy(x)
    result = c.infer(
        "hand",
        [inp],
        request_compression_algorithm=algorithm,
        response_compression_algorithm=algorithm,
    )
    np.testing.assert_array_equal(result.as_numpy("logits"), expected_logits(x))
    # The answer came compressed (tritonclient reads an uncompressed one too), in the layout
    # tritonclient's own parser reads: the header length counts the JSON before compression.
    body, json_size = triton.InferenceServerClient.generate_request_body([inp])
    headers = {"Inference-Header-Content-Length": str(json_size), "Accept-Encoding": algorithm}
    url = f"{hand.url}/v2/models/hand/infer"
    with httpx.stream("POST", url, content=body, headers=headers) as r:
        raw = b"".join(r.iter_raw())
    assert r.status_code == 200 and r.headers["content-encoding"] == algorithm
    parsed = triton.InferenceServerClient.parse_response_body(
        raw,
        header_length=int(r.headers["inference-header-content-length"]),
        content_encoding=algorithm,
    )
    np.testing.assert_array_equal(parsed.as_numpy("logits"), expected_logits(x))


def test_tritonclient_timeout_0_is_no_timeout_and_other_parameters_pass(hand: Server) -> None:
    # Triton reads timeout 0 as none; sequence, priority and custom parameters change nothing
    # for a model without sequences or priority levels.
    c = client(hand)
    inp = triton.InferInput("input", list(X.shape), "UINT8")
    inp.set_data_from_numpy(X)
    for kwargs in (
        {"timeout": 0},
        {"timeout": 5_000_000, "priority": 2},
        {"sequence_id": 7, "sequence_start": True, "sequence_end": True},
        {"parameters": {"note": "x", "n": 1}, "headers": {"x-request-timeout-ms": "5000"}},
    ):
        result = c.infer("hand", [inp], **kwargs)
        np.testing.assert_array_equal(result.as_numpy("logits"), expected_logits(X))


def test_a_64_mb_body_is_refused_with_413_json(hand: Server) -> None:
    body = b"0" * (64 * 1024 * 1024)
    r = httpx.post(f"{hand.url}/v2/models/hand/infer", content=body, timeout=30)
    assert r.status_code == 413
    assert "limit of 16777216 bytes" in r.json()["error"]
    # http.client (under `requests`) sends the whole body before it reads: it gets the answer
    host, port = hand.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v2/models/hand/infer", body=body)
    answer = conn.getresponse()
    assert answer.status == 413 and "limit of 16777216 bytes" in json.loads(answer.read())["error"]
    conn.close()
    # refused by its Content-Length before any route matched it: counted under its route
    metrics = hand.metrics()
    assert metrics['lightship_requests_total{route="/v2/models/{model_name}/infer",status="413"}']
    assert 'lightship_requests_total{route="unmatched",status="413"}' not in metrics
    # no `_created` twin of every counter and histogram: half the series a scrape stores
    assert not [name for name in metrics if "_created" in name], metrics


def declared_png(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header declares width x height: what Pillow reads before any pixel."""
    buf = io.BytesIO()
    Image.new("1", (1, 1)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = struct.pack(">II", width, height)  # IHDR's data, then its CRC
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def test_images_past_pillows_limits_are_refused_by_the_servers_quietly(hand: Server) -> None:
    """Pillow warns past 89 MP and refuses past 179 MP; the server's limit is 40 MP."""
    answers = [
        httpx.post(
            f"{hand.url}/v1/predict/image",
            files={"files": ("big.png", declared_png(side, side), "image/png")},
        )
        for side in (10_000, 20_000)
    ]
    assert [(r.status_code, r.json()["error"]) for r in answers] == [
        (413, "big.png: 10000x10000 pixels is too large (limit 40,000,000)"),
        (413, "big.png: 400,000,000 pixels is too large (limit 40,000,000)"),
    ]
    assert "DecompressionBombWarning" not in hand.output()


def test_a_request_uvicorn_cannot_parse_gets_a_json_400(hand: Server) -> None:
    # the app never sees it: the HTTP protocol answers, in this server's error format
    with socket.create_connection(("127.0.0.1", hand.port), timeout=5) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 400 Bad Request"
    assert "content-type: application/json" in lines and "connection: close" in lines
    assert json.loads(body) == {"error": "malformed HTTP request: Invalid method encountered"}
    assert httpx.get(f"{hand.url}/v2/health/ready").status_code == 200  # and it serves on
    # the log says from whom and why, not uvicorn's "Invalid HTTP request received.", and
    # when (UTC) and from which logger, as every line of the server's log does
    out = hand.output()
    stamp = r"(?m)^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
    malformed = r"malformed HTTP request from 127\.0\.0\.1:\d+: Invalid method encountered"
    assert re.search(rf"{stamp} WARNING uvicorn: {malformed}", out), out
    assert re.search(rf"{stamp} INFO uvicorn: Started server process \[\d+\]$", out), out
    assert re.search(rf"{stamp} INFO lightship\.serve\.app: ready: model '", out), out


def test_a_request_head_over_64_kib_gets_a_json_431(hand: Server) -> None:
    with socket.create_connection(("127.0.0.1", hand.port), timeout=5) as sock:
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * 100_000)
        answer = b""
        # the server answers and closes mid-header: the rest of ours, unread, can make its
        # kernel reset the connection once the answer is sent, which ends it as EOF would
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(4096):
                answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert json.loads(body) == {
        "error": "request URL and headers over 65536 bytes: send them shorter"
    }
    assert httpx.get(f"{hand.url}/v2/health/ready").status_code == 200  # and it serves on


def test_head_is_answered_like_get_without_a_body(hand: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", hand.port, timeout=5)
    try:
        answers = []
        # one connection: a body sent after a HEAD would be read as the next answer's head
        for method, path in [
            ("HEAD", "/v2/health/ready"),
            ("GET", "/v2/health/ready"),
            ("HEAD", "/v2/models/hand"),
            ("HEAD", "/v2/models/hand/infer"),
            ("GET", "/v2/health/live"),
        ]:
            conn.request(method, path)
            r = conn.getresponse()
            answers.append(
                (r.status, r.getheader("content-length"), r.getheader("allow"), r.read())
            )
    finally:
        conn.close()
    assert answers[0] == (200, "14", None, b"")
    assert answers[1] == (200, "14", None, b'{"ready":true}')
    assert answers[2][0] == 200 and int(answers[2][1] or 0) > 100 and answers[2][3] == b""
    assert answers[3][:3] == (405, answers[3][1], "POST") and answers[3][3] == b""
    assert answers[4] == (200, "13", None, b'{"live":true}')
    head_ready = 'lightship_requests_total{route="/v2/health/ready",status="200"}'
    assert hand.metrics()[head_ready] >= 2


def test_corrupt_image_and_v1_against_the_real_server(hand: Server) -> None:
    r = httpx.post(
        f"{hand.url}/v1/predict/image", files={"files": ("x.png", b"not an image", "image/png")}
    )
    assert r.status_code == 400 and "x.png" in r.json()["error"]
    r = httpx.post(f"{hand.url}/v1/predict", content=b'{"instances": [[[1, 2], [3, 4]]]')
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]
    r = httpx.post(f"{hand.url}/v1/predict", json={"instances": X.tolist()})
    assert [p["label"] for p in r.json()["predictions"]] == ["dark", "bright"]


def test_bad_uploads_are_json_4xx_and_the_connection_serves_on(hand: Server) -> None:
    # Answered before the body is read, or before all of it: uvicorn must skip the rest and
    # read the next request on the same connection.
    image = Image.new("L", (2, 2), 250)
    buf = io.BytesIO()
    image.save(buf, "PNG")
    one = [("files", ("a.png", buf.getvalue(), "image/png"))]
    form = httpx.Request("POST", hand.url, files=one)
    url = f"{hand.url}/v1/predict/image"
    with httpx.Client(limits=httpx.Limits(max_connections=1)) as c:
        answers = [
            c.post(url, data={"file": "a.png"}),
            c.post(url, files=[("files", (f"{i}.png", b"x", "image/png")) for i in range(1001)]),
            c.post(url, files=one * 64 + [("file", ("b.png", b"x", "image/png"))]),
            c.post(url, content=form.read(), headers={"content-type": "multipart/form-data"}),
            c.post(
                url,
                content=gzip.compress(form.read()),
                headers={"content-type": form.headers["content-type"], "content-encoding": "gzip"},
            ),
            c.post(url, files=one),
        ]
    send = 'send one or more images as multipart form field "files"'
    assert [(r.status_code, r.json().get("error")) for r in answers] == [
        (400, send),
        (
            413,
            "request has more than 64 images; this server takes at most 64 per request: split it",
        ),
        (400, f'form field "file" holds a file: {send}'),
        (
            400,
            "multipart Content-Type without a boundary (let the client write that header): "
            f"{send}, e.g. `curl -F files=@digit.png URL`",
        ),
        (
            415,
            "Content-Encoding gzip is not supported: send the body uncompressed (PNG and JPEG "
            "are compressed already)",
        ),
        (200, None),
    ]
    assert answers[-1].json()["predictions"][0]["label"] == "bright"
    assert [r.headers.get("connection") for r in answers] == [None] * 6  # none closes it


# An event loop that only wakes 10 times a second, as uvicorn's main loop does to check
# whether to stop: what any idle uvicorn server costs this machine.
def wakeups(pid: int) -> int:
    """Context switches of every thread of `pid` so far: how often it woke."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            for line in (task / "status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    total += int(line.split()[1])
    return total


def test_idle_server_uses_under_one_percent_of_a_core(hand: Server) -> None:
    """Under 1 % of a core over 10 s, asleep: it does not wake at all. uvicorn's own loop woke
    10 times a second, and lightship's once (for the Date header): some VMs charge a task
    milliseconds for each wake-up from idle (this one ~6 ms: a server waking once a second
    read 0.8-1.5 % of a core, one waking 10 times 1.8-2.5 %)."""
    httpx.post(f"{hand.url}/v1/predict", json={"instances": X.tolist()})  # after some work
    # Idle, that is once the heap a burst took has been handed back: trimmed once, QUIET_S
    # after the last answer (`memory.trim_when_quiet`).
    time.sleep(2 * memory.QUIET_S + 0.5)
    before, t0 = hand.cpu_seconds(), time.monotonic()
    woke = wakeups(hand.proc.pid)
    time.sleep(10)  # measuring idleness, not waiting for anything
    seconds = time.monotonic() - t0
    woke = wakeups(hand.proc.pid) - woke
    used = (hand.cpu_seconds() - before) / seconds
    assert woke <= 2, f"idle server woke {woke} times in {seconds:.1f} s"
    assert used < 0.01, f"idle server used {used:.1%} of a core"


def test_answers_carry_the_date_of_the_second_they_leave_in(hand: Server) -> None:
    """The Date header is made when an answer reads it, not by a loop renewing it: it is
    this second's on the tensor routes and through ASGI, and moves on with the clock."""

    def dates() -> list[float]:
        answers = [
            httpx.post(f"{hand.url}/v1/predict", json={"instances": X.tolist()}),
            httpx.get(f"{hand.url}/v2/health/ready"),
        ]
        return [email.utils.parsedate_to_datetime(a.headers["date"]).timestamp() for a in answers]

    before = time.time()
    first, now = dates(), time.time()
    assert all(int(before) <= d <= now for d in first), (before, first, now)  # whole seconds
    time.sleep(2.1)
    later = dates()
    assert all(d >= max(first) + 2 for d in later), (first, later)


# Schemathesis with the hooks that keep its client deadlines to a second or more: a shorter one
# can pass on a loaded machine, answered 504 as it should be (`tests/schemathesis_hooks.py`)
SCHEMATHESIS_ENV = {
    **os.environ,
    "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
}


def test_schemathesis_finds_no_server_errors(hand: Server, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "schemathesis.cli", "run", f"{hand.url}/openapi.json",
            "--checks", "not_a_server_error", "--max-examples", "10", "--phases", "examples,coverage,fuzzing",
            "--seed", "7", "--request-timeout", "10", "--report-dir", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=SCHEMATHESIS_ENV,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert "No issues found" in proc.stdout or " passed" in proc.stdout, proc.stdout[-2000:]
    assert hand.proc.poll() is None  # and the server is still up


@pytest.mark.parametrize("late", [False, True], ids=["under-way", "sent-after-sigterm"])
@pytest.mark.parametrize(
    "path", ["/v2/models/hand/infer", "/v2/models/h%61nd/infer"], ids=["protocol", "asgi"]
)
def test_a_body_still_arriving_at_sigterm_is_answered_503_before_the_drain_ends(
    hand_model: Path, tmp_path: Path, path: str, late: bool
) -> None:
    """A slow upload within its allowance (64 KiB/s past the deadline) may take longer than
    the drain uvicorn gives a stopping server (--timeout-ms plus 5 s), after which it cancels
    the request: the client got a reset and no status. It is answered 503 while the drain
    can still deliver it (here, --timeout-ms 1000: 1 s after SIGTERM), and the server exits
    0; so is one a kept-alive connection sends just after SIGTERM (`late`)."""
    server = Server(
        "--run", str(hand_model), "--timeout-ms", "1000", "--threads", "1", log=tmp_path / "log"
    ).wait_ready()  # fmt: skip
    core = b'{"inputs":[{"name":"input","shape":[1,1,2,2],"datatype":"UINT8","data":[1,2,3,4]}]}'
    body = core + b" " * (2_000_000 - len(core))  # 10 s at 200 KB/s
    head = f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-length: {len(body)}\r\n\r\n"
    answer = b""
    with (
        contextlib.closing(server),
        socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock,
    ):
        signalled = False
        if late:  # a kept-alive connection, idle at SIGTERM, sends within DRAIN_IDLE_S
            sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nhost: t\r\n\r\n")
            assert b" 200 " in sock.recv(4096)
            server.proc.send_signal(signal.SIGTERM)
            signalled = True
            time.sleep(0.3)
        sock.sendall(head.encode())
        t0, sent = time.monotonic(), 0
        while sent < len(body) and time.monotonic() - t0 < 20:
            sock.sendall(body[sent : sent + 20_000])
            sent += 20_000
            if time.monotonic() - t0 > 0.5 and not signalled:
                server.proc.send_signal(signal.SIGTERM)
                signalled = True
            time.sleep(0.1)
            if select.select([sock], [], [], 0)[0]:  # an answer before the body's end: read it
                break
        while chunk := sock.recv(65536):
            answer += chunk
            if b"\r\n\r\n" in answer and answer.endswith(b"}"):
                break
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 503 Service Unavailable", answer[:500]
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error.startswith("the server is stopping and could not wait for the rest of the body")
    assert sent < len(body)  # answered while the body was still arriving
    assert server.proc.wait(30) == 0, server.output()
    assert "Cancel" not in server.output()  # nothing left for uvicorn to cut off
    # the drain said, with its limit: a grace period shorter than it ends in SIGKILL
    assert re.search(
        r"stopping: not ready, no new connections; answering the \d+ queued rows "
        r"and the requests under way, for [67] s at most",
        server.output(),
    )


# `serve` from Python, with a SIGTERM to itself at its "serving '...'" log line: after the
# handler `_serve_on` installs for SIGTERM, before uvicorn's own
SIGTERM_WHILE_STARTING = """
import logging, os, signal, sys
from lightship.serve.app import serve
from lightship.serve.settings import ServeSettings

class StopAtServing(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("serving '"):
            os.kill(os.getpid(), signal.SIGTERM)

log = logging.getLogger("lightship.serve.app")
log.setLevel(logging.INFO)
log.addHandler(StopAtServing())
serve(ServeSettings(run=sys.argv[1], port=int(sys.argv[2]), threads=1))
print("serve returned", flush=True)
"""


def test_a_sigterm_while_the_server_starts_stops_it(hand_model: Path) -> None:
    """A SIGTERM between `_serve_on`'s own handler and uvicorn's was swallowed: the server
    turned ready and served until a second signal (Kubernetes: the SIGKILL, exit 137)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_WHILE_STARTING, str(hand_model), str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        try:
            ready = httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2).status_code
        finally:
            proc.kill()
            proc.wait()
        pytest.fail(f"still running 30 s after its SIGTERM; /v2/health/ready {ready}")
    assert proc.returncode == 0 and "serve returned" in out, out
    assert "Shutting down" in out, out  # uvicorn's graceful shutdown, at once


def test_sigterm_drains_queued_requests_and_exits_zero(hand_model: Path, tmp_path: Path) -> None:
    # Batches wait up to a minute for company, so the requests are still queued at SIGTERM;
    # draining must run them at once instead of waiting out max_wait.
    server = Server(
        "--run", str(hand_model), "--max-wait-ms", "60000", "--timeout-ms", "120000",
        "--max-batch-rows", "64", log=tmp_path / "log",
    ).wait_ready()  # fmt: skip
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 256, (1, 1, 2, 2), dtype=np.uint8) for _ in range(24)]

    def send(x: np.ndarray) -> httpx.Response:
        doc = {
            "inputs": [
                {
                    "name": "input",
                    "shape": [1, 1, 2, 2],
                    "datatype": "UINT8",
                    "data": x.ravel().tolist(),
                }
            ]
        }
        return httpx.post(f"{server.url}/v2/models/hand/infer", json=doc, timeout=30)

    def upload(x: np.ndarray) -> httpx.Response:  # through ASGI, not the tensor routes' way
        buf = io.BytesIO()
        Image.fromarray(x[0, 0]).save(buf, "PNG")
        files = {"files": ("x.png", buf.getvalue(), "image/png")}
        return httpx.post(f"{server.url}/v1/predict/image", files=files, timeout=30)

    with ThreadPoolExecutor(len(rows)) as pool:
        futures = [pool.submit(send if i % 6 else upload, x) for i, x in enumerate(rows)]
        deadline = time.monotonic() + 30
        while server.metrics()["lightship_queue_rows"] < len(rows):  # all accepted and queued
            assert time.monotonic() < deadline, "requests never reached the queue"
            time.sleep(0.02)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        answers = [f.result() for f in futures]
    assert time.monotonic() - t0 < 10  # drained at once, not after max_wait
    for i, (x, r) in enumerate(zip(rows, answers, strict=True)):
        assert r.status_code == 200, r.text
        if i % 6:
            out = {o["name"]: o for o in r.json()["outputs"]}["logits"]
            np.testing.assert_array_equal(np.reshape(out["data"], (1, 2)), expected_logits(x))
        else:
            assert r.json()["predictions"][0]["index"] == int(np.argmax(expected_logits(x)))
        # a kept-alive client learns to reconnect elsewhere: the answers of the queue ran at
        # SIGTERM went out kept alive, their connections closed half a second later
        assert r.headers.get("connection") == "close", (i, r.headers)
    assert server.stop() == 0, server.output()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/v2/health/live", timeout=2)  # no longer accepting


def slow_model(path: Path, size: int = 192, matmuls: int = 3) -> Path:
    """handmade_onnx's answers plus 0 x a chain of `matmuls` (size x size) matmuls per row:
    ~ms of compute a row (2 x matmuls x size**3 flops)."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(handmade_onnx(path, chw=(1, size, size))))
    g = model.graph
    w = np.random.default_rng(0).standard_normal((size, size)).astype(np.float32) / size
    g.initializer.extend(
        [
            onnx.numpy_helper.from_array(w, "w"),
            helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
            helper.make_tensor("all", TensorProto.INT64, [3], [1, 2, 3]),
        ]
    )
    logits = g.output[0].name
    g.node[-1].output[0] = "fast"
    chain = ["xf", *(f"m{i}" for i in range(1, matmuls + 1))]
    g.node.extend(helper.make_node("MatMul", [a, "w"], [b]) for a, b in pairwise(chain))
    g.node.extend(
        [
            helper.make_node("ReduceSum", [chain[-1], "all"], ["r"], keepdims=0),
            helper.make_node("Mul", ["r", "zero"], ["r0"]),
            helper.make_node("Unsqueeze", ["r0", "one"], ["r1"]),
            helper.make_node("Add", ["fast", "r1"], [logits]),
        ]
    )
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_overload_is_answered_with_200_429_or_504_and_memory_stays_flat(tmp_path: Path) -> None:
    size = 192
    # ~170 MFLOP a row: a few ms on one thread of any of our CPUs, so the 48 clients outrun the
    # model. With 3 matmuls a row, an AVX-512 Xeon served every request before the queue filled.
    model = slow_model(tmp_path / "slow.onnx", size, matmuls=12)
    server = Server(
        "--run", str(model), "--max-batch-rows", "8", "--max-queue-rows", "16",
        "--timeout-ms", "1500", "--threads", "1", log=tmp_path / "log",
    ).wait_ready()  # fmt: skip
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (1, 1, size, size), dtype=np.uint8)
    raw = x.tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": list(x.shape),
                    "datatype": "UINT8",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": "logits", "parameters": {"binary_data": False}}],
        }
    ).encode()
    statuses: list[int] = []
    lock = threading.Lock()

    def hammer(n: int) -> None:
        with httpx.Client(timeout=15) as c:  # a hang would raise here and fail the test
            for _ in range(n):
                r = c.post(
                    f"{server.url}/v2/models/slow/infer",
                    content=header + raw,
                    headers={"Inference-Header-Content-Length": str(len(header))},
                )
                if r.status_code == 200:
                    out = r.json()["outputs"][0]
                    np.testing.assert_array_equal(
                        np.reshape(out["data"], (1, 2)), expected_logits(x)
                    )
                else:
                    # 408: this process's 48 threads share 2 cores with the server, and one
                    # can wait past the 1.5 s deadline between writing its head and its body
                    # (httpx writes them apart); the server then answers it at that deadline
                    # (once in CI on a slow AVX2-only EPYC: 0 bytes of the body had arrived)
                    late_body = r.status_code == 408 and "body incomplete" in r.text
                    assert r.status_code in (429, 504) or late_body, r.text
                    assert "error" in r.json()
                    if r.status_code == 429:
                        assert int(r.headers["retry-after"]) >= 1
                with lock:
                    statuses.append(r.status_code)

    rss = []
    for _ in range(3):  # waves of 48 clients against a queue of 16 rows
        with ThreadPoolExecutor(48) as pool:
            list(pool.map(hammer, [8] * 48))
        rss.append(server.rss_mb())
    counts = {s: statuses.count(s) for s in set(statuses)}
    assert len(statuses) == 3 * 48 * 8
    assert counts.get(200, 0) > 0 and counts.get(429, 0) > 0, counts
    assert rss[2] - rss[0] < 15, f"RSS grew {rss} MB"
    m = server.metrics()
    assert m['lightship_rejections_total{reason="queue_full"}'] == counts[429]
    assert m["lightship_queue_rows"] == 0
    assert server.stop() == 0, server.output()


def test_a_real_run_is_served_under_its_name_with_the_predictors_answers(
    exported_run: Path, tmp_path: Path
) -> None:
    server = Server("--run", str(exported_run), log=tmp_path / "log").wait_ready()
    c = client(server)
    meta = c.get_model_metadata("tiny-digits")  # the run directory's name
    assert meta["platform"] == "onnxruntime_onnx" and meta["inputs"][0]["shape"] == [-1, 1, 16, 16]
    x = np.random.default_rng(3).integers(0, 256, (5, 1, 16, 16), dtype=np.uint8)
    inp = triton.InferInput("input", list(x.shape), "UINT8")
    inp.set_data_from_numpy(x)
    served = c.infer("tiny-digits", [inp]).as_numpy("logits")
    local = load_predictor(exported_run / "export" / "model.onnx").predict(x)
    np.testing.assert_allclose(served, local, atol=1e-5)
    assert server.stop() == 0, server.output()
    assert "onnx-fp32" in server.output()  # auto without a report: the fp32 ONNX


def test_torchscript_variant_is_served_too(exported_run: Path, tmp_path: Path) -> None:
    server = Server(
        "--run", str(exported_run), "--variant", "torchscript", "--model-name", "ts",
        log=tmp_path / "log",
    ).wait_ready(120)  # fmt: skip
    x = np.random.default_rng(4).integers(0, 256, (3, 1, 16, 16), dtype=np.uint8)
    r = httpx.post(f"{server.url}/v1/predict", json={"instances": x.tolist(), "top_k": 10})
    assert r.status_code == 200, r.text
    local = load_predictor(exported_run / "export" / "model.onnx").predict(x)
    for pred, logits in zip(r.json()["predictions"], local, strict=True):
        assert pred["index"] == int(logits.argmax())
    meta = httpx.get(f"{server.url}/v2/models/ts").json()
    assert meta["platform"] == "pytorch_libtorch"
    import torch  # the export made this run

    metrics = httpx.get(f"{server.url}/metrics").text
    assert f'runtime="torch",runtime_version="{torch.__version__}"' in metrics
    assert server.stop() == 0, server.output()


def test_serving_onnx_imports_neither_torch_nor_lightning(hand_model: Path) -> None:
    # The `lightship serve` path up to a warmed-up, ready app, in a fresh interpreter.
    code = f"""
import asyncio, sys
from lightship.cli import app  # the CLI module with every command registered
from lightship.serve.app import create_app
from lightship.serve.command import _settings
from lightship.serve.model import choose, verify

settings = _settings(run={str(hand_model)!r})
served = choose(settings)
verify(served, settings.isa_check)
application = create_app(served.load(), served, settings)

async def main():
    async with application.router.lifespan_context(application):
        await application.state.service.settled.wait()
        assert application.state.service.ready
asyncio.run(main())
# onnx (not onnxruntime) is no serving dependency: the serving image lacks it
heavy = ("torch", "pytorch_lightning", "lightning", "onnx")
print(sorted(m for m in sys.modules if m.split(".")[0] in heavy))
# nor is the training config (its pydantic models and YAML: 75 ms of every start), nor the
# data sets' loading (uploads are decoded by `lightship.data.images` alone)
print(sorted(m for m in sys.modules if m in ("lightship.config", "yaml", "lightship.data.sources")))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-2:] == ["[]", "[]"]


# `lightship serve` as `python -m lightship` runs it, in an interpreter where torch cannot be
# imported: the serving install (and its Docker images) has none.
NO_TORCH = "import sys; sys.modules['torch'] = None; from lightship.cli import main; main()"


def test_torch_models_without_torch_are_one_line_naming_the_fix(tmp_path: Path) -> None:
    from lightship.runs import RunDir, sha256_file

    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    for variant, name in [("torchscript", "export/model.ts"), ("checkpoint", "best.ckpt")]:
        (run / name).write_bytes(b"never read: torch is needed first")
        RunDir(run).record(variant, {"file": name, "sha256": sha256_file(run / name)})
    (tmp_path / "model.pt2").write_bytes(b"")
    (tmp_path / "model.ts").write_bytes(b"")
    cases = [
        (["--run", str(run), "--variant", "torchscript"], run / "export/model.ts", "TorchScript"),
        (["--run", str(run), "--variant", "checkpoint"], run / "best.ckpt", "checkpoint"),
        (["--run", str(tmp_path / "model.pt2")], tmp_path / "model.pt2", "torch.export (.pt2)"),
        (["--run", str(tmp_path / "model.ts")], tmp_path / "model.ts", "TorchScript"),
    ]
    for args, path, kind in cases:
        proc = subprocess.run(
            [sys.executable, "-c", NO_TORCH, "serve", *args, "--port", str(free_port())],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=60,
        )
        assert proc.returncode == 4, proc.stderr
        assert proc.stderr.strip() == (
            f"error: {path} is a {kind} model, which needs torch, and this install has none: "
            "`pip install torch==2.13.0` (or lightship's train extra, `pip install "
            "'lightship[train]'`), or serve an ONNX variant (--variant onnx-fp32, or an .onnx "
            "file)"
        )


def test_cli_errors_are_one_line_with_the_fix(tmp_path: Path, hand_model: Path) -> None:
    r = run_cli("serve", "--run", str(tmp_path / "missing"))
    assert r.returncode == 4 and "error: " in r.stderr and "neither a run directory" in r.stderr
    r = run_cli("serve", "--run", str(hand_model), env={"LIGHTSHIP_MAX_BATCH_ROWS": "0"})
    assert r.returncode == 2 and "LIGHTSHIP_MAX_BATCH_ROWS=0" in r.stderr
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    shutil.copy(hand_model, run / "export" / "model.onnx")
    (run / "manifest.json").write_text(json.dumps({"schema": 1, "artifacts": {}}))
    r = run_cli("serve", "--run", str(run), "--variant", "onnx-int8-static")
    assert r.returncode == 4 and "make quantize" in r.stderr


def test_a_model_that_fails_its_warm_up_stops_the_server_with_one_line(
    tmp_path: Path,
) -> None:
    # It stayed up, never ready, liveness 503: `lightship serve` in a shell never returned.
    nan = handmade_onnx(tmp_path / "nan.onnx", bias=float("nan"))  # NaN logits for any image
    r = run_cli("serve", "--run", str(nan), timeout=120)
    assert r.returncode == 4, r.stderr
    assert last_line(r.stderr) == (
        "error: model failed its warm-up batch: the model gave NaN or infinite logits for 1 "
        "of the request's 1 row: no label can be read from them (the model fails on such "
        "input; the run's export checked it on its test images only); the server stopped: "
        "serve another model file, or export or quantize this one again"
    )
    assert "Traceback" not in r.stderr


SERVE_FROM_PYTHON = """
import asyncio, gc, os, signal, sys, threading
from pathlib import Path
from lightship.errors import ConfigError
from lightship.serve.app import serve
from lightship.serve.settings import ServeSettings

settings = ServeSettings(run=Path(sys.argv[1]), port=0)

async def in_a_loop():  # a notebook's cell
    try:
        serve(settings)
    except ConfigError as exc:
        print("refused:", exc)

asyncio.run(in_a_loop())
before = (signal.getsignal(signal.SIGTERM), sys.getswitchinterval(), gc.get_freeze_count())
threading.Timer(5, os.kill, (os.getpid(), signal.SIGTERM)).start()
serve(settings)
after = (signal.getsignal(signal.SIGTERM), sys.getswitchinterval(), gc.get_freeze_count())
print("restored:", after == before, "" if after == before else (before, after))
from lightship.runtime import OrtPredictor
models = [p for p in gc.get_objects() if isinstance(p, OrtPredictor)]
print("models let go:", len(models), all("session" not in vars(p) for p in models))

import socket, time, urllib.request
with socket.socket() as s:  # a free port, to ask the threaded server on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
failed = []
def in_a_thread():  # as the refusal above advises
    try:
        serve(ServeSettings(run=Path(sys.argv[1]), port=port))
    except BaseException as exc:
        failed.append(repr(exc))
threading.Thread(target=in_a_thread, daemon=True).start()
for _ in range(600):
    if failed:
        break
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready") as r:
            print("from a thread:", r.status)
            break
    except OSError:
        time.sleep(0.1)
print("failed:", failed)
sys.stdout.flush()
os._exit(0)  # the threaded server serves until the process ends
"""


def test_serve_called_from_python_leaves_the_process_as_it_found_it(hand_model: Path) -> None:
    # it left SIGTERM a no-op (kill and docker stop no longer stopped the process), the GIL
    # switch interval at 1 ms and every object frozen out of the garbage collector (a
    # caller's cyclic garbage never freed); in a running loop it failed with RuntimeError
    proc = subprocess.run(
        [sys.executable, "-c", SERVE_FROM_PYTHON, str(hand_model)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "refused: serve() runs its own event loop and this thread is in one (a notebook's): "
        "call it from a thread of its own or a script, or run `lightship serve`",
        "restored: True ",
        "models let go: 1 True",  # the app still held by FastAPI's cache, its model closed
        "from a thread: 200",  # only the main thread can take signals: it failed there
        "failed: []",
    ]


def test_int8_made_for_another_cpu_is_refused_unless_told_to_warn(
    hand_model: Path, tmp_path: Path
) -> None:
    from lightship.runs import RunDir, sha256_file

    run = tmp_path / "int8run"
    (run / "quantize").mkdir(parents=True)
    shutil.copy(hand_model, run / "quantize" / "model.int8-static.onnx")
    RunDir(run).record(
        "onnx-int8-static",
        {
            "file": "quantize/model.int8-static.onnx",
            "format": "onnx",
            "sha256": sha256_file(run / "quantize" / "model.int8-static.onnx"),
            "target": "tensorrt",  # S8S8 for TensorRT: wrong on any CPU
        },
    )
    r = run_cli("serve", "--run", str(run), "--variant", "onnx-int8-static")
    assert r.returncode == 4 and "quantized for TensorRT" in r.stderr
    server = Server(
        "--run", str(run), "--variant", "onnx-int8-static", log=tmp_path / "log",
        env={"LIGHTSHIP_ISA_CHECK": "warn"},
    ).wait_ready()  # fmt: skip
    assert "serving it anyway" in server.output()
    assert server.stop() == 0


def test_settings_from_the_environment(hand_model: Path, tmp_path: Path) -> None:
    port = free_port()
    server = Server(
        log=tmp_path / "log",
        env={
            "LIGHTSHIP_RUN": str(hand_model),
            "LIGHTSHIP_PORT": str(port),
            "LIGHTSHIP_MODEL_NAME": "from-env",
            "LIGHTSHIP_MAX_BATCH_ROWS": "3",
        },
    ).wait_ready()
    assert server.port == port
    assert httpx.get(f"{server.url}/v2/models/from-env").status_code == 200
    four = {"instances": np.zeros((4, 1, 2, 2), np.uint8).tolist()}
    r = httpx.post(f"{server.url}/v1/predict", json=four)
    assert r.status_code == 413 and "at most 3" in r.json()["error"]
    assert server.stop() == 0


def needs_a_gpu() -> None:
    """Skip without a CUDA device: onnxruntime-gpu lists its CUDA provider on any host."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
@pytest.mark.skipif(
    "CUDAExecutionProvider" not in onnxruntime.get_available_providers(),
    reason="needs onnxruntime-gpu and a CUDA device",
)
def test_onnx_on_cuda(hand_model: Path, tmp_path: Path) -> None:
    needs_a_gpu()
    cache = tmp_path / "trt"  # not the shared default: engines of earlier runs stay out
    server = Server(
        "--run", str(hand_model), "--device", "cuda", log=tmp_path / "log",
        env={"LIGHTSHIP_TRT_CACHE": str(cache)},
    ).wait_ready(300)  # fmt: skip
    inp = triton.InferInput("input", list(X.shape), "UINT8")
    inp.set_data_from_numpy(X)
    np.testing.assert_array_equal(
        client(server).infer("hand", [inp]).as_numpy("logits"), expected_logits(X)
    )
    assert 'device="cuda"' in httpx.get(f"{server.url}/metrics").text
    assert server.stop() == 0
    assert "runs on cuda (" in server.output()  # the providers that ran it, logged
    if "TensorrtExecutionProvider" in server.output():  # its engines, by the model's content
        assert [p.name for p in cache.iterdir()] == [
            hashlib.sha256(hand_model.read_bytes()).hexdigest()[:32]
        ]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["torchscript", "pt2", "checkpoint"])
def test_a_torch_model_on_cuda(
    request: pytest.FixtureRequest, tmp_path: Path, variant: str
) -> None:
    """TorchScript passed on an H200; a .pt2 model failed every batch there ("Tensor device
    mismatch": its graph asserts the CPU it was exported on) until it was moved whole."""
    needs_a_gpu()
    exported_run: Path = request.getfixturevalue("exported_run")  # only now: export takes seconds
    run = tmp_path / "tiny-digits"
    shutil.copytree(exported_run, run)
    if variant == "pt2":
        run_cli("export", "--run", str(run), "--formats", "pt2", check=True)
    server = Server(
        "--run", str(run), "--variant", variant, "--device", "cuda", log=tmp_path / "log",
    ).wait_ready(300)  # fmt: skip
    x = np.random.default_rng(5).integers(0, 256, (4, 1, 16, 16), dtype=np.uint8)
    inp = triton.InferInput("input", list(x.shape), "UINT8")
    inp.set_data_from_numpy(x)
    served = client(server).infer("tiny-digits", [inp]).as_numpy("logits")
    local = load_predictor(run / "export" / "model.onnx").predict(x)
    np.testing.assert_allclose(served, local, atol=1e-3)
    assert server.stop() == 0


def test_a_taken_port_or_unknown_host_is_one_line_before_the_model_loads(
    hand_model: Path, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # a missing model would fail the load: the port is checked first
        proc = run_cli("serve", "--run", str(tmp_path / "none.onnx"), "--port", str(port))
    assert proc.returncode == 2, proc.stderr
    assert last_line(proc.stderr) == (
        f"error: cannot listen on 127.0.0.1:{port} (Address already in use): pass a free "
        "--port, or stop what holds it"
    )
    proc = run_cli("serve", "--run", str(hand_model), "--host", "no.such.host.invalid")
    assert proc.returncode == 2 and "cannot listen on host 'no.such.host.invalid'" in last_line(
        proc.stderr
    )
    # an address that is not this machine's: the host is the problem, not the port
    proc = run_cli("serve", "--run", str(hand_model), "--host", "10.255.255.1", "--port", "8000")
    assert proc.returncode == 2
    assert last_line(proc.stderr) == (
        "error: cannot listen on 10.255.255.1:8000 (Cannot assign requested address): "
        "pass --host 127.0.0.1, 0.0.0.0 or an address of this machine"
    )
