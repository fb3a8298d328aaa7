"""The app in-process (httpx over ASGI, lifespan run by hand) on a model with known answers.

`tests.handmade`: logits = [sum(pixels), 100 - sum(pixels)], labels bright/dark, input 1x2x2.
A gate can hold the inference thread, so queue-full, deadline and disconnect cases are exact.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import gzip
import io
import json
import logging
import platform
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import onnx
import onnxruntime
import pytest
from fastapi import FastAPI
from PIL import Image, PngImagePlugin
from starlette.types import Message

import lightship
from lightship.data.images import decode as _decode
from lightship.data.sources import _folder
from lightship.runtime import load_predictor
from lightship.runtime.base import trim_heap
from lightship.serve import app as serve_app
from lightship.serve import memory, v1, v2
from lightship.serve.app import Service, create_app
from lightship.serve.metrics import Metrics
from lightship.serve.model import ServedModel
from lightship.serve.protocol import MAX_PIPELINED, READ_AHEAD_BYTES
from lightship.serve.settings import ServeSettings
from tests.handmade import batch_rows, expected_logits, handmade_onnx

INFER = "/v2/models/hand/infer"
HAND = "/v2/models/hand"


class Crash(BaseException):
    """Escapes `except Exception`: stands for a bug that kills the inference worker."""


class Gate:
    """Wraps a predictor's hot path; while closed, the inference thread waits in it.

    With `crash` set, the thread raises it when the gate opens."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.open = threading.Event()
        self.entered = threading.Event()
        self.rows: list[np.ndarray] = []
        self.crash: BaseException | None = None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.entered.set()
        assert self.open.wait(10), "test never opened the gate"
        if self.crash is not None:
            raise self.crash
        self.rows.append(x.copy())
        return np.asarray(self.run(x))


def make_app(tmp_path: Path, gate: bool = False, **settings: Any) -> tuple[FastAPI, Gate | None]:
    path = handmade_onnx(tmp_path / "hand.onnx")
    predictor = load_predictor(path)
    g = None
    if gate:
        g = Gate(predictor._run)
        predictor._run = g  # type: ignore[method-assign]
    defaults: dict[str, Any] = {"run": path, "max_wait_ms": 1}
    app = create_app(
        predictor, ServedModel("hand", "file", path, None), ServeSettings(**(defaults | settings))
    )
    return app, g


@asynccontextmanager
async def serving(
    app: FastAPI, wait_ready: bool = True, via: str = "asgi"
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app: through ASGI (`via="asgi"`), or over HTTP to the server's own
    protocol on a loopback port (`via="http"`), which answers the tensor routes without ASGI."""
    async with app.router.lifespan_context(app):
        if wait_ready:
            await asyncio.wait_for(service(app).settled.wait(), 10)
        if via == "http":
            async with (
                over_http(app) as (url, _),
                httpx.AsyncClient(base_url=url, timeout=30) as client,
            ):
                yield client
            return
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


class CountingApp:
    """The ASGI app as the protocol calls it, counting the requests that reach it."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.paths: list[str] = []
        self.connections: set[Any] = set()  # the server's open connections (`over_http`)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


@asynccontextmanager
async def over_http(app: FastAPI, **config: Any) -> AsyncIterator[tuple[str, CountingApp]]:
    """The server's HTTP protocol (as `serve` sets it up, lifespan aside) on a loopback port:
    its URL, and the ASGI app behind it, counting what reaches ASGI."""
    import uvicorn
    from uvicorn.server import ServerState

    from lightship.serve.protocol import http_protocol

    counting = CountingApp(app)
    settings: dict[str, Any] = {"lifespan": "off", "log_level": "warning", "access_log": False}
    settings |= config
    protocol = http_protocol(app.state.tensor_routes)
    uv = uvicorn.Config(counting, http=protocol, **settings)
    uv.load()
    state = ServerState()
    counting.connections = state.connections
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: uv.http_protocol_class(config=uv, server_state=state, app_state={}),  # type: ignore[call-arg]
        "127.0.0.1",
        0,
    )
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", counting
    finally:
        server.close()
        for connection in list(state.connections):
            connection.shutdown()
        while state.tasks:
            await asyncio.sleep(0.01)


@pytest.fixture(params=["asgi", "http"])
def via(request: pytest.FixtureRequest) -> str:
    """Both ways into the tensor routes: through ASGI, and the server's own protocol."""
    return str(request.param)


def service(app: FastAPI) -> Service:
    s = app.state.service
    assert isinstance(s, Service)
    return s


def v2_json(x: np.ndarray, datatype: str = "UINT8", **extra: Any) -> dict[str, Any]:
    doc = {
        "inputs": [
            {
                "name": "input",
                "shape": list(x.shape),
                "datatype": datatype,
                "data": x.ravel().tolist(),
            }
        ]
    }
    return doc | extra


def v2_binary(x: np.ndarray, datatype: str = "UINT8") -> tuple[bytes, dict[str, str]]:
    raw = x.tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": list(x.shape),
                    "datatype": datatype,
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
        }
    ).encode()
    return header + raw, {"Inference-Header-Content-Length": str(len(header))}


def v2_logits(body: bytes) -> np.ndarray:
    """The logits of a V2 answer with JSON tensors, in the shape it gives them."""
    out = {o["name"]: o for o in json.loads(body)["outputs"]}["logits"]
    return np.array(out["data"], np.float32).reshape(out["shape"])


def logits_of(response: httpx.Response) -> np.ndarray:
    header_length = response.headers.get("inference-header-content-length")
    if header_length is None:
        return v2_logits(response.content)
    n = int(header_length)
    (out,) = json.loads(response.content[:n])["outputs"]
    return np.frombuffer(response.content[n:], np.float32).reshape(out["shape"])


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in metrics")


def run(coro: Any, loop: str = "uvloop") -> Any:
    """`coro` to its end on uvloop, the event loop `lightship serve` runs on (uvicorn's
    loop="auto"), or on asyncio's own. They differ where it shows: uvloop reads a socket
    before the callbacks of its turn, and a socket paused then went unnoticed by every test."""
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    return asyncio.run(coro)


X = np.array([[[[1, 2], [3, 4]]], [[[255, 255], [255, 255]]]], np.uint8)
HELD = np.full((1, 1, 2, 2), 9, np.uint8)


async def hold_inference(client: httpx.AsyncClient, gate: Gate) -> asyncio.Future[httpx.Response]:
    """Close the gate and park one request (HELD) in it: the inference thread is busy until the
    gate opens, so the next requests queue (inference is refused until the warm-up is back, so
    the warm-up batch cannot be the one that holds it)."""
    gate.open.clear()
    gate.entered.clear()
    held = asyncio.ensure_future(client.post(INFER, json=v2_json(HELD)))
    await asyncio.to_thread(gate.entered.wait, 10)
    return held


async def until_rejected(client: httpx.AsyncClient, reason: str, seconds: float = 3.0) -> None:
    """Poll /metrics until a rejection for `reason` is counted, `seconds` at most (a request
    held in the gate meanwhile gives up after 5 s, httpx's default)."""
    name = f'lightship_rejections_total{{reason="{reason}"}}'
    for _ in range(int(seconds / 0.01)):
        if metric((await client.get("/metrics")).text, name):
            return
        await asyncio.sleep(0.01)


def test_v2_json_and_binary_give_exact_logits_and_echo_the_id(tmp_path: Path, via: str) -> None:
    app, _ = make_app(tmp_path)

    async def main() -> None:
        async with serving(app, via=via) as client:
            r = await client.post(INFER, json=v2_json(X, id="req-7"))
            assert r.status_code == 200 and r.json()["id"] == "req-7"
            np.testing.assert_array_equal(logits_of(r), [[10, 90], [1020, -920]])
            probs = {o["name"]: o for o in r.json()["outputs"]}["probabilities"]["data"]
            assert probs[1] == pytest.approx(1.0) and probs[2] == pytest.approx(1.0)
            body, headers = v2_binary(X)
            r = await client.post(INFER, content=body, headers=headers)
            assert r.status_code == 200
            assert r.headers["content-type"] == "application/octet-stream"
            np.testing.assert_array_equal(logits_of(r), expected_logits(X))
            # float pixels are accepted and rounded; gzip bodies are decompressed
            r = await client.post(
                "/v2/models/hand/versions/1/infer",
                content=gzip.compress(
                    json.dumps(v2_json(X.astype(np.float32) - 0.2, "FP32")).encode()
                ),
                headers={"Content-Encoding": "gzip"},
            )
            np.testing.assert_array_equal(logits_of(r), expected_logits(X))

    run(main())


def test_a_raw_tensor_body_is_tritons_raw_binary_request(tmp_path: Path, via: str) -> None:
    """Inference-Header-Content-Length: 0 (Triton's binary data extension, which /v2 names):
    no JSON header, the body is the input's tensor; answered 400 "is 0 but the body has 8
    bytes" before."""
    app, _ = make_app(tmp_path)
    raw = {"inference-header-content-length": "0", "content-type": "application/octet-stream"}

    async def main() -> None:
        async with serving(app, via=via) as client:
            r = await client.post(INFER, content=X.tobytes(), headers=raw)
            assert r.status_code == 200, r.text
            assert r.headers["content-type"] == "application/octet-stream"
            n = int(r.headers["inference-header-content-length"])
            at, got = n, {}
            for out in json.loads(r.content[:n])["outputs"]:  # every output, binary
                size = out["parameters"]["binary_data_size"]
                got[out["name"]] = np.frombuffer(r.content[at : at + size], np.float32)
                at += size
            assert at == len(r.content) and list(got) == ["logits", "probabilities"]
            np.testing.assert_array_equal(got["logits"].reshape(2, 2), expected_logits(X))
            odd = await client.post(INFER, content=X.tobytes()[:-1], headers=raw)
            assert odd.status_code == 400
            assert odd.json()["error"].startswith(
                "Inference-Header-Content-Length is 0, so the body is the input tensor, UINT8 "
                "[N, 1, 2, 2]: 4 bytes an image, and the body has 7"
            )

    run(main())


def test_compressed_bodies_that_inflate_large_are_inflated_one_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    """Inflated as they arrived, 100 gzip bodies of 16 KB each held 16 MiB apiece while they
    waited for the one parse slot: 5 GB from 1.6 MB sent. A body that inflates large is
    inflated in that slot, and parsed there."""
    real = serve_app._decode_content
    inflating, most = 0, 0

    def counted(body: bytes, encoding: str, limit: int) -> bytes:
        nonlocal inflating, most
        if limit < serve_app.LARGE_BODY_BYTES:  # the first look, bounded: not counted
            return real(body, encoding, limit)
        inflating += 1
        most = max(most, inflating)
        try:
            time.sleep(0.05)
            return real(body, encoding, limit)
        finally:
            inflating -= 1

    monkeypatch.setattr(serve_app, "_decode_content", counted)
    app, _ = make_app(tmp_path)
    large = json.dumps({"instances": X.tolist()}).encode() + b" " * serve_app.LARGE_BODY_BYTES
    small = json.dumps(v2_json(X)).encode()

    async def main() -> list[httpx.Response]:
        async with serving(app, via=via) as client:
            zipped = {"Content-Encoding": "gzip"}
            sent = [
                client.post("/v1/predict", content=gzip.compress(large), headers=zipped)
                for _ in range(4)
            ]
            sent.append(client.post(INFER, content=gzip.compress(small), headers=zipped))
            return list(await asyncio.gather(*sent))

    answers = run(main())
    assert [r.status_code for r in answers] == [200] * 5, [r.text for r in answers]
    assert [p["label"] for p in answers[0].json()["predictions"]] == ["dark", "bright"]
    np.testing.assert_array_equal(logits_of(answers[-1]), expected_logits(X))
    assert most == 1


def test_a_large_body_refused_after_parsing_leaves_nothing_it_parsed(
    tmp_path: Path, via: str
) -> None:
    """Its error's traceback held the parse's frames, and the document in them, in a
    reference cycle only the collector's rare full pass broke: 32 16-MiB bodies of the wrong
    shape, one after another, held 3 GB."""
    app, _ = make_app(tmp_path)
    flat = json.dumps({"instances": [0] * 300_000}).encode()  # parsed, then the wrong shape
    assert len(flat) > serve_app.LARGE_BODY_BYTES

    def parsed_lists() -> int:
        return sum(type(o) is list and len(o) >= 300_000 for o in gc.get_objects())

    async def main() -> list[int]:
        async with serving(app, via=via) as client:
            statuses = [(await client.post("/v1/predict", content=flat)).status_code]
            for _ in range(2):
                zipped = gzip.compress(flat)  # inflated in its parse slot, then parsed
                r = await client.post(
                    "/v1/predict", content=zipped, headers={"content-encoding": "gzip"}
                )
                statuses.append(r.status_code)
            return statuses

    gc.collect()
    gc.disable()
    try:
        assert run(main()) == [400] * 3
        assert parsed_lists() == 0
    finally:
        gc.enable()


def test_v1_predict_labels_scores_and_top_k(tmp_path: Path, via: str) -> None:
    app, _ = make_app(tmp_path)

    async def main() -> None:
        async with serving(app, via=via) as client:
            r = await client.post("/v1/predict", json={"instances": X.tolist(), "top_k": 1})
            assert r.status_code == 200
            dark, bright = r.json()["predictions"]
            assert dark["label"] == "dark" and dark["score"] == pytest.approx(1.0)  # 10 vs 90
            assert bright["label"] == "bright" and bright["index"] == 0
            assert len(dark["top_k"]) == 1
            even = np.full((1, 2, 2), 12, np.uint8)  # sum 48 vs 52: close call, both classes
            r = await client.post("/v1/predict", json={"instances": even.tolist()})
            (pred,) = r.json()["predictions"]
            p = 1 / (1 + np.exp(-4))
            assert [t["label"] for t in pred["top_k"]] == ["dark", "bright"]
            assert pred["top_k"][0]["probability"] == pytest.approx(p)
            # ?top_k as the image route takes it (it was ignored here); the body's wins
            r = await client.post("/v1/predict?top_k=1", json={"instances": even.tolist()})
            assert [len(p["top_k"]) for p in r.json()["predictions"]] == [1]
            body = {"instances": even.tolist(), "top_k": 2}
            r = await client.post("/v1/predict?top_k=1", json=body)
            assert [len(p["top_k"]) for p in r.json()["predictions"]] == [2]
            r = await client.post("/v1/predict?top_k=x", json=body)
            assert (r.status_code, r.json()) == (
                400,
                {"error": "top_k must be a positive integer, got 'x'"},
            )

    run(main())


def png(pixels: np.ndarray | Image.Image, fmt: str = "PNG") -> bytes:
    image = pixels if isinstance(pixels, Image.Image) else Image.fromarray(pixels)
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


def test_image_upload_one_or_more_files(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)
    bright = png(np.full((2, 2), 250, np.uint8))
    dark = png(Image.new("RGB", (8, 8), (0, 0, 0)), "JPEG")  # converted to gray, resized to 2x2

    async def main() -> None:
        async with serving(app) as client:
            files = [
                ("files", ("b.png", bright, "image/png")),
                ("files", ("d.jpg", dark, "image/jpeg")),
            ]
            r = await client.post("/v1/predict/image", files=files)
            assert r.status_code == 200, r.text
            b, d = r.json()["predictions"]
            assert (b["file"], b["label"]) == ("b.png", "bright")
            assert (d["file"], d["label"]) == ("d.jpg", "dark")
            assert b["top_k"][0]["probability"] == pytest.approx(1.0)
            r = await client.post(
                "/v1/predict/image", files=[("files", ("x.png", b"\x89PNG broken", "image/png"))]
            )
            assert r.status_code == 400 and "x.png: not a readable PNG or JPEG" in r.json()["error"]

    run(main())


@pytest.mark.parametrize(
    ("query", "kept"),
    [
        ("top_k=1", 1),
        ("top_k=2&x=y", 2),
        *[(f"top_k={bad}", None) for bad in ("%202", "2.0", "%2B2", "1&top_k=2", "9" * 101)],
    ],
)
def test_both_v1_routes_take_a_top_k_query_alike(
    tmp_path: Path, query: str, kept: int | None
) -> None:
    """The image route's `?top_k` was FastAPI's int: " 2", "2.0" and "+2" passed, as did the
    last of two and a number of 101 digits, where /v1/predict refused each with a 400."""
    app, _ = make_app(tmp_path)
    image = np.full((2, 2), 12, np.uint8)  # both classes close: two to keep

    async def main() -> list[httpx.Response]:
        async with serving(app) as client:
            files = [("files", ("a.png", png(image), "image/png"))]
            body = {"instances": image[None].tolist()}
            return [
                await client.post(f"/v1/predict/image?{query}", files=files),
                await client.post(f"/v1/predict?{query}", json=body),
            ]

    answers = run(main())
    if kept is None:
        assert [r.status_code for r in answers] == [400, 400]
        assert answers[0].json() == answers[1].json()
        assert answers[0].json()["error"].startswith("top_k ")
    else:
        assert [len(r.json()["predictions"][0]["top_k"]) for r in answers] == [kept, kept]


def test_uploads_over_a_request_s_pixel_budget_are_refused_before_any_is_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 PNGs of 116 KB declaring 40 MP each held a decode slot for 10 s, every other upload
    waiting, and ended in 504. The budget reads the headers; a JPEG counts as its decoder
    shrinks it for the model's input (400x400 for 2x2: by 8 a side, 2,500 pixels), but a
    progressive one at its full size, which its decoder works through whatever the shrink."""
    monkeypatch.setattr(v1, "MAX_REQUEST_PIXELS", 3000, raising=False)
    decoded: list[str] = []

    def decode(data: bytes, chw: tuple[int, int, int], name: str, limit: int) -> Any:
        decoded.append(name)
        return _decode(data, chw, name, limit)

    monkeypatch.setattr(v1.images, "decode", decode)
    app, _ = make_app(tmp_path)
    photo = png(Image.new("RGB", (400, 400), (250, 250, 250)), "JPEG")
    small, large = png(np.full((20, 20), 250, np.uint8)), png(np.full((40, 40), 250, np.uint8))
    buf = io.BytesIO()
    Image.new("RGB", (400, 400), (250, 250, 250)).save(buf, "JPEG", progressive=True)

    async def main() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with serving(app) as client:
            within = await client.post(
                "/v1/predict/image",
                files=[("files", ("p.jpg", photo, "image/jpeg")), ("files", ("s.png", small))],
            )
            over = await client.post(
                "/v1/predict/image",
                files=[("files", ("a.png", large)), ("files", ("b.png", large))],
            )
            progressive = await client.post(
                "/v1/predict/image",
                files=[("files", (f"q{i}.jpg", buf.getvalue(), "image/jpeg")) for i in range(2)],
            )
            return within, over, progressive

    within, over, progressive = run(main())
    assert within.status_code == 200, within.text
    assert [p["label"] for p in within.json()["predictions"]] == ["bright", "bright"]
    assert over.status_code == 413
    assert over.json()["error"] == (
        "the 2 images hold 3,200 pixels to decode, over the limit of 3,000 a request: send "
        "fewer or smaller images (each is resized to 2x2), or spread them over several requests"
    )
    assert decoded == ["p.jpg", "s.png"]
    # a progressive JPEG counts at its full size (its decoder holds every coefficient so)
    assert progressive.status_code == 413, progressive.text
    assert "the 2 images hold 320,000 pixels to decode" in progressive.json()["error"]


def test_uploads_over_a_megabyte_need_no_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only root with no writable /tmp: Starlette spooled an upload over 1 MB to disk,
    and the request got a 500, "a bug"."""
    app, _ = make_app(tmp_path)
    noise = np.random.default_rng(0).integers(0, 256, (640, 640, 3), dtype=np.uint8)
    photo = png(noise)
    assert len(photo) > 1024 * 1024
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "nowhere"))

    async def main() -> httpx.Response:
        async with serving(app) as client:
            return await client.post("/v1/predict/image", files=[("files", ("n.png", photo))])

    r = run(main())
    assert r.status_code == 200, r.text
    assert [p["file"] for p in r.json()["predictions"]] == ["n.png"]


def test_uploads_reach_the_model_as_the_image_folder_trains_on_them(tmp_path: Path) -> None:
    """The same file, the same pixels: a 16-bit PNG (not clipped to 255) and a JPEG stored
    sideways with EXIF orientation 6 (turned upright), uploaded, give the model what the image
    folder loader read from them for training."""
    deep, turned = tmp_path / "imgs" / "a" / "deep.png", tmp_path / "imgs" / "b" / "turned.jpg"
    deep.parent.mkdir(parents=True)
    turned.parent.mkdir()
    Image.fromarray(np.linspace(0, 65535, 1024).reshape(32, 32).astype(np.uint16)).save(deep)
    stored = Image.new("L", (16, 8), 0)
    stored.paste(255, (0, 0, 8, 8))  # the left half white as stored: the top half as seen
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(turned, exif=exif, quality=95)
    trained, _, _ = _folder(tmp_path / "imgs", 1, 2)  # the model's input: 1x2x2
    assert 120 < trained[0].mean() < 135  # a ramp 0..65535: mid-gray, not 255
    assert trained[1, 0, 0].min() > 200 and trained[1, 0, 1].max() < 40  # white on top
    app, gate = make_app(tmp_path, gate=True)
    assert gate is not None
    gate.open.set()

    async def main() -> None:
        async with serving(app) as client:
            seen = len(gate.rows)  # after the warm-up batch
            files = [
                ("files", (f.name, f.read_bytes(), f"image/{f.suffix[1:]}")) for f in (deep, turned)
            ]
            r = await client.post("/v1/predict/image", files=files)
            assert r.status_code == 200, r.text
            np.testing.assert_array_equal(np.concatenate(gate.rows[seen:]), trained)

    run(main())


def test_images_over_the_pixel_limits_are_413(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app, _ = make_app(tmp_path)
    big = png(np.zeros((20, 20), np.uint8))

    files = [("files", ("big.png", big, "image/png"))]

    async def main() -> None:
        async with serving(app) as client:
            monkeypatch.setattr(v1, "MAX_IMAGE_PIXELS", 399)
            r = await client.post("/v1/predict/image", files=files)
            assert r.status_code == 413
            assert r.json()["error"] == "big.png: 20x20 pixels is too large (limit 399)"
            # a JPEG its decoder shrinks a row at a time: up to Pillow's limit, as training
            photo = [("files", ("big.jpg", png(Image.new("L", (20, 20), 250), "JPEG")))]
            r = await client.post("/v1/predict/image", files=photo)
            assert r.status_code == 200, r.text
            assert r.json()["predictions"][0]["label"] == "bright"
            # past twice Pillow's own limit Pillow will not open it: too large, not unreadable,
            # said as the server's own limit says it, with the limit that refused it
            monkeypatch.setattr(v1, "MAX_IMAGE_PIXELS", 10**6)
            monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
            r = await client.post("/v1/predict/image", files=files)
            assert r.status_code == 413
            assert r.json()["error"] == "big.png: 400 pixels is too large (limit 200)"
            monkeypatch.setattr(v1, "MAX_IMAGE_PIXELS", 150)
            r = await client.post("/v1/predict/image", files=files)
            assert r.json()["error"] == "big.png: 400 pixels is too large (limit 150)"

    run(main())


SEND_IMAGES = 'send one or more images as multipart form field "files"'
BAD_FORMS: list[tuple[str, dict[str, Any], str]] = [
    ("no body", {}, SEND_IMAGES),
    (
        "a file in another field",
        {"files": [("file", ("a.png", b"x", "image/png"))]},
        f'form field "file" holds a file: {SEND_IMAGES}',
    ),
    (
        "a file beside the images",
        {
            "files": [
                ("files", ("a.png", b"x", "image/png")),
                ("other", ("b.png", b"x", "image/png")),
            ]
        },
        f'form field "other" holds a file: {SEND_IMAGES}',
    ),
    ("url-encoded fields", {"data": {"nothing": "here"}}, SEND_IMAGES),
    ("JSON", {"json": {"files": ["a.png"]}}, SEND_IMAGES),
    (
        "a text field",
        {"data": {"files": "a.png"}, "files": [("other", ("a.png", b"x", "image/png"))]},
        f'form field "files" holds text, a part with no filename: {SEND_IMAGES}, each part '
        'with a filename (Content-Disposition: form-data; name="files"; filename="a.png"), as '
        "`curl -F files=@a.png` sends it",
    ),
    (
        "top_k not a number",
        {"params": {"top_k": "two"}, "files": [("files", ("a.png", b"x", "image/png"))]},
        "top_k must be a positive integer, got 'two'",
    ),
]


@pytest.mark.parametrize(
    ("case", "request_kwargs", "message"), BAD_FORMS, ids=[c[0] for c in BAD_FORMS]
)
def test_an_upload_that_is_no_form_of_images_is_400_saying_what_to_send(
    tmp_path: Path, case: str, request_kwargs: dict[str, Any], message: str
) -> None:
    app, _ = make_app(tmp_path)

    async def main() -> httpx.Response:
        async with serving(app) as client:
            return await client.post("/v1/predict/image", **request_kwargs)

    r = run(main())
    assert (r.status_code, r.json()) == (400, {"error": message})


def multipart(*parts: str, boundary: str = "b0undary") -> bytes:
    """A multipart body of `parts`, each its headers, a blank line and its content."""
    return "".join(f"--{boundary}\r\n{part}\r\n" for part in parts).encode() + (
        f"--{boundary}--\r\n".encode()
    )


FORM_TYPE = "multipart/form-data; boundary=b0undary"
IMAGE_PART = 'Content-Disposition: form-data; name="files"; filename="a.png"\r\n\r\nx'
CURL_IMAGES = f"{SEND_IMAGES}, e.g. `curl -F files=@digit.png URL`"
# The error as a pattern: "not multipart data" holds python-multipart's own words on the fault.
UNPARSED_FORMS: list[tuple[str, str, bytes, int, str]] = [
    (
        "no boundary",
        "multipart/form-data",
        multipart(IMAGE_PART),
        400,
        re.escape(
            "multipart Content-Type without a boundary (let the client write that header): "
            + CURL_IMAGES
        ),
    ),
    (
        "not multipart data",
        FORM_TYPE,
        b"not a form at all",
        400,
        r"body is not a valid multipart form \(.+\): " + re.escape(CURL_IMAGES),
    ),
    (
        "a part without a name",
        FORM_TYPE,
        multipart('Content-Disposition: form-data; filename="a.png"\r\n\r\nx'),
        400,
        re.escape(
            "a part of the form has no name in its Content-Disposition header: " + CURL_IMAGES
        ),
    ),
    (
        "1,001 text fields",
        FORM_TYPE,
        multipart(*[f'Content-Disposition: form-data; name="f{i}"\r\n\r\nx' for i in range(1001)]),
        413,
        re.escape("form has more than 1000 text fields: " + CURL_IMAGES),
    ),
    (
        "a text field over 1 MiB",
        FORM_TYPE,
        multipart('Content-Disposition: form-data; name="note"\r\n\r\n' + "x" * 2**20 + "x"),
        413,
        re.escape("a text field is over 1024 KiB: " + CURL_IMAGES),
    ),
    (  # the files were sent: "send one or more images" said otherwise
        "cut short",
        FORM_TYPE,
        multipart(IMAGE_PART, IMAGE_PART).removesuffix(b"--b0undary--\r\n")[:-3],
        400,
        re.escape(
            "the form ends inside its file part 2, before the boundary that closes it: send "
            f"the whole form ({SEND_IMAGES})"
        ),
    ),
]


@pytest.mark.parametrize(
    ("case", "content_type", "body", "status", "pattern"),
    UNPARSED_FORMS,
    ids=[c[0] for c in UNPARSED_FORMS],
)
def test_a_form_the_parser_refuses_is_answered_with_what_to_send(
    tmp_path: Path, case: str, content_type: str, body: bytes, status: int, pattern: str
) -> None:
    """Starlette's own words ("Invalid multipart data.") never reach the client."""
    app, _ = make_app(tmp_path)

    async def main() -> httpx.Response:
        async with serving(app) as client:
            headers = {"content-type": content_type}
            return await client.post("/v1/predict/image", content=body, headers=headers)

    r = run(main())
    assert r.status_code == status and re.fullmatch(pattern, r.json()["error"]), r.text


def test_the_documented_answers_are_the_ones_given(tmp_path: Path) -> None:
    """No route answers FastAPI's 422 `{"detail": [...]}`, so none documents it; the image
    route documents its form and how many files it takes."""
    app, _ = make_app(tmp_path, max_batch_rows=3)

    async def main() -> dict[str, Any]:
        async with serving(app) as client:
            return dict((await client.get("/openapi.json")).json())

    schema = run(main())
    text = json.dumps(schema)
    assert '"422"' not in text and "HTTPValidationError" not in text and "detail" not in text
    image = schema["paths"]["/v1/predict/image"]["post"]
    assert {"400", "413", "415"} <= set(image["responses"])
    form = image["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["required"] == ["files"] and form["properties"]["files"]["maxItems"] == 3
    infer = schema["paths"]["/v2/models/{model_name}/infer"]["post"]
    v2_request = infer["requestBody"]["content"]["application/json"]["schema"]
    assert v2_request["properties"]["parameters"]["properties"]["timeout"]["minimum"] == 0


BAD_V2: list[tuple[str, dict[str, Any], int, str]] = [
    ("malformed JSON", {"content": b'{"inputs": [', "headers": {}}, 400, "malformed JSON"),
    (
        "wrong shape",
        {"json": v2_json(np.zeros((1, 1, 3, 3), np.uint8))},
        400,
        r"expected shape [N, 1, 2, 2], got [1, 1, 3, 3]",
    ),
    (
        "channels last",
        {"json": v2_json(np.zeros((1, 2, 2, 1), np.uint8))},
        400,
        "got [1, 2, 2, 1] (this looks like NHWC: transpose to NCHW)",
    ),
    (
        "v1 body",
        {"json": {"instances": X.tolist()}},
        400,
        'the body has no "inputs" list (V2 format: ',
    ),
    (
        "data/shape mismatch",
        {
            "json": {
                "inputs": [
                    {"name": "input", "shape": [1, 1, 2, 2], "datatype": "UINT8", "data": [1, 2, 3]}
                ]
            }
        },
        400,
        "holds 4 values but data has 3",
    ),
    ("wrong datatype", {"json": v2_json(X, "BYTES")}, 400, "'BYTES' is not supported"),
    ("out of range", {"json": v2_json(np.full((1, 1, 2, 2), 300), "INT32")}, 400, "0..255"),
    (
        "booleans",
        {"json": v2_json(X > 3)},
        400,
        "input data holds true/false but its datatype is UINT8: send numbers",
    ),
    (
        "beyond INT64",
        {"json": v2_json(np.array([[[[2**63, 0], [0, 0]]]], np.uint64), "INT64")},
        400,
        "input data value 9223372036854775808 is out of range for INT64 "
        "(-9223372036854775808..9223372036854775807)",
    ),
    ("empty batch", {"json": v2_json(np.zeros((0, 1, 2, 2), np.uint8))}, 400, "empty batch"),
    (
        "unknown output",
        {"json": v2_json(X, outputs=[{"name": "embedding"}])},
        400,
        "unknown output",
    ),
    (
        "bad timeout header",
        {"json": v2_json(X), "headers": {"X-Request-Timeout-Ms": "soon"}},
        400,
        "x-request-timeout-ms",
    ),
    *(
        (
            f"timeout header {value}",
            {"json": v2_json(X), "headers": {"X-Request-Timeout-Ms": value}},
            400,
            f"x-request-timeout-ms must be a positive decimal number of milliseconds (digits and a point: 250, 1.5), got '{value}'",
        )
        for value in ("1_000", "inf", "1e400", "1e9", "0")
    ),
    (
        "unknown encoding",
        {"content": b"{}", "headers": {"Content-Encoding": "br"}},
        415,
        "Content-Encoding br",
    ),
    # numpy refuses these shapes with its own errors: they were 500s
    (
        "101 dimensions",
        {"json": v2_json(X) | {"inputs": [v2_json(X)["inputs"][0] | {"shape": [1] * 101}]}},
        400,
        "of 101 dimensions is not an image batch",
    ),
    (
        "empty but huge",
        {
            "json": {
                "inputs": [
                    {"name": "input", "shape": [0, 2**62, 2**62], "datatype": "UINT8", "data": []}
                ]
            }
        },
        400,
        "is too large to be an image batch",
    ),
    (
        "a trillion rows",
        {"json": v2_json(X) | {"inputs": [v2_json(X)["inputs"][0] | {"shape": [10**12, 1, 2, 2]}]}},
        413,
        "request has 1000000000000 rows; this server takes at most 64 per request: split it",
    ),
    ("parameters 0", {"json": v2_json(X, parameters=0)}, 400, "parameters must be a JSON object"),
    (
        "binary_data_output yes",
        {"json": v2_json(X, parameters={"binary_data_output": "yes"})},
        400,
        "binary_data_output must be true or false",
    ),
]


@pytest.mark.parametrize(
    ("case", "request_kwargs", "status", "message"), BAD_V2, ids=[c[0] for c in BAD_V2]
)
def test_bad_v2_requests_get_4xx_json(
    tmp_path: Path, case: str, request_kwargs: dict[str, Any], status: int, message: str, via: str
) -> None:
    app, _ = make_app(tmp_path)

    async def main() -> httpx.Response:
        async with serving(app, via=via) as client:
            return await client.post(INFER, **request_kwargs)

    r = run(main())
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert message in r.json()["error"]


def test_nan_unknown_model_oversized_and_too_many_rows(tmp_path: Path, via: str) -> None:
    app, _ = make_app(tmp_path, max_body_bytes=4096, max_batch_rows=4)

    async def main() -> None:
        async with serving(app, via=via) as client:
            nan = np.full((1, 1, 2, 2), np.nan, np.float32)
            body, headers = v2_binary(nan, "FP32")
            r = await client.post(INFER, content=body, headers=headers)
            assert r.status_code == 400 and "NaN" in r.json()["error"]
            r = await client.post("/v2/models/other/infer", json=v2_json(X))
            assert r.status_code == 404 and "unknown model 'other'" in r.json()["error"]
            r = await client.get("/v2/models/other")
            assert r.status_code == 404 and "serves 'hand'" in r.json()["error"]
            r = await client.get("/v2/models/hand/versions/2")
            assert r.status_code == 404 and "version" in r.json()["error"]
            r = await client.post(INFER, content=b"x" * 5000)
            assert r.status_code == 413 and "limit of 4096 bytes" in r.json()["error"]

            async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it streams
                for _ in range(5):
                    yield b" " * 1000

            r = await client.post(INFER, content=chunks())
            assert r.status_code == 413
            r = await client.post(INFER, json=v2_json(np.zeros((5, 1, 2, 2), np.uint8)))
            assert r.status_code == 413 and "at most 4 per request" in r.json()["error"]
            r = await client.get("/v2/nowhere")
            assert r.status_code == 404 and r.json() == {
                "error": "no route /v2/nowhere: the routes are listed at /docs (GET /v2 "
                "describes the server)"
            }
            # a trailing slash: a 404 that names the route, on every route alike (a FastAPI
            # route's was a 307 to a URL made of the Host header, a tensor route's a 404)
            for method, path in [
                ("GET", "/v2/health/live/"),
                ("POST", "/v1/predict/image/"),
                ("POST", "/v1/predict/"),
                ("POST", f"{INFER}/"),
            ]:
                r = await client.request(method, path)
                assert r.status_code == 404 and r.json() == {
                    "error": f"no route {path}: the routes take no trailing slash ({path[:-1]})"
                }, path
            # the router's 405 says which method, as the tensor routes' does
            r = await client.get("/v1/predict/image")
            assert r.status_code == 405 and r.json() == {"error": "use POST for /v1/predict/image"}
            r = await client.post("/v2/health/live")
            assert r.status_code == 405 and r.json() == {"error": "use GET for /v2/health/live"}
            r = await client.get("/v1/predict")
            assert r.status_code == 405 and r.json() == {"error": "use POST for /v1/predict"}
            # tritonclient's calls of the V2 extensions this server lacks: what to use instead
            for method, path, what in [
                ("GET", "/v2/models/hand/stats", "statistics extension"),
                ("GET", "/v2/models/stats", "statistics extension"),
                ("POST", "/v2/repository/index", "model repository extension"),
                ("GET", "/v2/systemsharedmemory/status", "shared-memory extensions"),
                ("POST", "/v2/cudasharedmemory/region/r/unregister", "shared-memory extensions"),
                ("GET", "/v2/trace/setting", "trace extension"),
                ("POST", "/v2/models/hand/trace/setting", "trace extension"),
                ("GET", "/v2/logging", "logging extension"),
            ]:
                r = await client.request(method, path)
                assert r.status_code == 404, path
                assert r.json()["error"].startswith(f"the {what} "), path
                assert " not served here: " in r.json()["error"], path
            text = (await client.get("/metrics")).text
            assert metric(text, 'lightship_rejections_total{reason="body_too_large"}') == 2
            assert (
                metric(
                    text,
                    'lightship_requests_total{route="/v2/models/{model_name}/infer",status="404"}',
                )
                == 1
            )

    run(main())


@pytest.mark.parametrize("instances", [1, 2])
def test_concurrent_requests_are_batched_and_each_row_answers_as_if_alone(
    tmp_path: Path, instances: int, via: str
) -> None:
    app, _ = make_app(tmp_path, max_wait_ms=50, max_batch_rows=64, instances=instances)
    assert len(service(app).batcher._threads) == 0 and service(app).batcher.instances == instances
    rng = np.random.default_rng(0)
    requests = [
        rng.integers(0, 256, (int(n), 1, 2, 2), dtype=np.uint8) for n in rng.integers(1, 4, 40)
    ]

    async def main() -> tuple[list[np.ndarray], list[np.ndarray], str]:
        async with serving(app, via=via) as client:
            together = await asyncio.gather(
                *(client.post(INFER, json=v2_json(x)) for x in requests)
            )
            text = (await client.get("/metrics")).text
            # each alone waits max_wait_ms for company: a few are enough to compare
            alone = [logits_of(await client.post(INFER, json=v2_json(x))) for x in requests[:6]]
            return [logits_of(r) for r in together], alone, text

    together, alone, text = run(main())
    for x, a in zip(requests, together, strict=True):
        np.testing.assert_array_equal(a, expected_logits(x))  # the answer written down
    for a, b in zip(together, alone, strict=False):
        np.testing.assert_array_equal(a, b)  # and the answer to the same rows sent alone
    rows = sum(len(x) for x in requests)
    batches = metric(text, "lightship_batch_rows_count")  # requests' only: no warm-up batch
    assert metric(text, "lightship_batch_rows_sum") == rows
    assert batches < len(requests) / 2, f"{batches} batches for {len(requests)} requests"
    assert metric(text, 'lightship_batch_rows_bucket{le="1.0"}') == 0  # no request went alone


def test_queue_full_is_429_with_retry_after_and_deadline_is_504(tmp_path: Path, via: str) -> None:
    app, gate = make_app(tmp_path, gate=True, max_batch_rows=2, max_queue_rows=3, max_wait_ms=0)
    assert gate is not None
    gate.open.set()

    async def main() -> None:
        async with serving(app, via=via) as client:
            held = await hold_inference(client, gate)
            queued = [asyncio.ensure_future(client.post(INFER, json=v2_json(X))) for _ in range(1)]
            while service(app).batcher.queued_rows < 2:
                await asyncio.sleep(0)  # let the request reach the queue
            r = await client.post(INFER, json=v2_json(X))  # 2 + 2 rows > 3
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert "server busy" in r.json()["error"]
            one = np.zeros((1, 1, 2, 2), np.uint8)
            r = await client.post(INFER, json=v2_json(one), headers={"X-Request-Timeout-Ms": "30"})
            assert r.status_code == 504 and "deadline" in r.json()["error"]
            gate.open.set()
            (ok,) = await asyncio.gather(*queued)
            np.testing.assert_array_equal(logits_of(ok), expected_logits(X))
            np.testing.assert_array_equal(logits_of(await held), expected_logits(HELD))
            text = (await client.get("/metrics")).text
            assert metric(text, 'lightship_rejections_total{reason="queue_full"}') == 1
            assert metric(text, 'lightship_rejections_total{reason="deadline"}') == 1

    run(main())
    computed = np.concatenate(gate.rows[2:]) if len(gate.rows) > 2 else np.zeros((0, 1, 2, 2))
    assert len(computed) == 2  # after warm-up and HELD: the 504 row was dropped before compute


def test_disconnected_client_is_dropped_before_compute(tmp_path: Path) -> None:
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0)
    assert gate is not None
    gate.open.set()
    marked = np.full((1, 1, 2, 2), 77, np.uint8)
    body = json.dumps(v2_json(marked)).encode()

    async def main() -> list[Message]:
        async with serving(app) as client:
            held = await hold_inference(client, gate)
            left = asyncio.Event()
            sent: list[Message] = []
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> Message:
                if messages:
                    return messages.pop()
                await left.wait()
                return {"type": "http.disconnect"}

            async def send(message: Message) -> None:
                sent.append(message)

            scope = {
                "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                "scheme": "http", "path": INFER, "raw_path": INFER.encode(), "query_string": b"",
                "root_path": "", "headers": [(b"content-length", str(len(body)).encode())],
                "client": ("test", 1), "server": ("test", 80),
            }  # fmt: skip
            call = asyncio.ensure_future(app(scope, receive, send))
            while service(app).batcher.queued_rows < 1:
                await asyncio.sleep(0)
            left.set()  # the client goes away while its request waits for the model
            await call
            gate.open.set()
            np.testing.assert_array_equal(logits_of(await held), expected_logits(HELD))
            r = await client.post(INFER, json=v2_json(X))  # the server carries on
            np.testing.assert_array_equal(logits_of(r), expected_logits(X))
            text = (await client.get("/metrics")).text
            assert metric(text, 'lightship_rejections_total{reason="disconnected"}') == 1
            return sent

    sent = run(main())
    assert sent[0]["status"] == 499
    assert not any((rows == 77).all() for batch in gate.rows for rows in batch)


def test_ready_and_inference_only_after_the_warm_up_batch(tmp_path: Path) -> None:
    app, gate = make_app(tmp_path, gate=True)
    assert gate is not None

    async def main() -> None:
        async with serving(app, wait_ready=False) as client:
            await asyncio.to_thread(gate.entered.wait, 10)
            assert (await client.get("/v2/health/live")).status_code == 200
            r = await client.get("/v2/health/ready")
            assert r.status_code == 503 and r.json() == {"error": "not ready"}
            assert (await client.get("/v2/models/hand/ready")).status_code == 503
            r = await client.post(INFER, json=v2_json(X))
            assert r.status_code == 503 and "warm-up batch is not back" in r.json()["error"]
            assert r.headers["retry-after"] == "1"
            r = await client.post("/v1/predict", json={"instances": X[:, 0].tolist()})
            assert r.status_code == 503
            gate.open.set()
            await service(app).settled.wait()
            assert (await client.get("/v2/health/ready")).json() == {"ready": True}
            model_ready = await client.get("/v2/models/hand/versions/1/ready")
            assert model_ready.json() == {"name": "hand", "ready": True}  # the protocol's form
            r = await client.post(INFER, json=v2_json(X))
            assert r.status_code == 200
            np.testing.assert_array_equal(logits_of(r), expected_logits(X))
            service(app).begin_shutdown()  # what SIGTERM does
            assert (await client.get("/v2/health/ready")).status_code == 503

    run(main())


def test_gzip_encoding_name_is_case_insensitive(tmp_path: Path, via: str) -> None:
    app, _ = make_app(tmp_path)

    async def main() -> httpx.Response:
        async with serving(app, via=via) as client:
            body = gzip.compress(json.dumps(v2_json(X)).encode())
            return await client.post(INFER, content=body, headers={"Content-Encoding": "GZIP"})

    r = run(main())
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(logits_of(r), expected_logits(X))


TOO_MANY_IMAGES = (
    "request has more than 2 images; this server takes at most 2 per request: split it"
)


def test_image_uploads_are_counted_before_decoding_and_limited_while_streaming(
    tmp_path: Path,
) -> None:
    app, _ = make_app(tmp_path, max_batch_rows=2, max_body_bytes=4096)

    async def main() -> None:
        async with serving(app) as client:
            # Three corrupt files: counted first (413), not decoded (which would say 400).
            files = [("files", (f"{i}.png", b"\x89PNG broken", "image/png")) for i in range(3)]
            r = await client.post("/v1/predict/image", files=files)
            assert (r.status_code, r.json()) == (413, {"error": TOO_MANY_IMAGES}), r.text
            boundary = "b0undary"
            head = (
                f'--{boundary}\r\nContent-Disposition: form-data; name="files"; '
                'filename="a.png"\r\nContent-Type: image/png\r\n\r\n'
            ).encode()

            async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it streams
                yield head
                for _ in range(8):
                    yield b"x" * 1000

            r = await client.post(
                "/v1/predict/image",
                content=chunks(),
                headers={"content-type": f"multipart/form-data; boundary={boundary}"},
            )
            assert r.status_code == 413 and "limit of 4096 bytes" in r.json()["error"], r.text

    run(main())


def test_more_files_than_starlettes_own_limit_are_too_many_images_too(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path, max_batch_rows=2)  # its parser stopped at 1,000 with a 400

    async def main() -> httpx.Response:
        async with serving(app) as client:
            files = [("files", (f"{i}.png", b"x", "image/png")) for i in range(1001)]
            return await client.post("/v1/predict/image", files=files)

    r = run(main())
    assert (r.status_code, r.json()) == (413, {"error": TOO_MANY_IMAGES})


def test_only_images_count_towards_the_limit(tmp_path: Path) -> None:
    """A file in another field is refused by its name, not counted as a third image; text
    fields beside the images are no images and are let be."""
    app, _ = make_app(tmp_path, max_batch_rows=2)
    image = ("a.png", png(np.full((2, 2), 250, np.uint8)), "image/png")

    async def main() -> list[httpx.Response]:
        async with serving(app) as client:
            images = [("files", image), ("files", image)]
            return [
                await client.post("/v1/predict/image", files=[*images, ("other", image)]),
                await client.post("/v1/predict/image", files=images, data={"note": "two"}),
            ]

    other, noted = run(main())
    assert (other.status_code, other.json()) == (
        400,
        {"error": f'form field "other" holds a file: {SEND_IMAGES}'},
    )
    assert noted.status_code == 200 and len(noted.json()["predictions"]) == 2, noted.text


def test_client_leaving_mid_body_is_counted_499_not_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app, _ = make_app(tmp_path)
    sent: list[Message] = []

    async def main() -> str:
        async with serving(app) as client:
            messages: Iterator[Message] = iter(
                [
                    {"type": "http.request", "body": b'{"inst', "more_body": True},
                    {"type": "http.disconnect"},
                ]
            )

            async def receive() -> Message:
                return next(messages)

            async def send(message: Message) -> None:
                sent.append(message)

            scope = {
                "type": "http",
                "asgi": {"version": "3.0"},
                "http_version": "1.1",
                "method": "POST",
                "scheme": "http",
                "path": "/v1/predict",
                "raw_path": b"/v1/predict",
                "root_path": "",
                "query_string": b"",
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"500")],
                "client": ("127.0.0.1", 1),
                "server": ("test", 80),
            }
            await app(scope, receive, send)
            return (await client.get("/metrics")).text

    text = run(main())
    assert sent[0]["status"] == 499
    assert metric(text, 'lightship_requests_total{route="/v1/predict",status="499"}') == 1
    assert metric(text, 'lightship_rejections_total{reason="disconnected"}') == 1
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


@pytest.mark.parametrize("path", ["/v1/predict", "/v1/predict/image"])
def test_a_client_leaving_mid_body_over_http_is_counted_gone(tmp_path: Path, path: str) -> None:
    """499, and a `disconnected` rejection: the 499 alone had no reason, so the rejections
    summed short of the requests given up."""
    app, _ = make_app(tmp_path)
    headers, body = [], b'{"instances": [' + b" " * 4000
    if "image" in path:
        headers = ["content-type: multipart/form-data; boundary=b"]
        part = b'--b\r\ncontent-disposition: form-data; name="files"; filename="a.png"\r\n\r\n'
        body = part + png(X[0, 0]) * 100

    async def main() -> str:
        async with raw_http(app) as (connect, _, client):
            _, writer = await connect()
            writer.write(post(path, body, *headers)[:-3900])
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.close()
            await until_rejected(client, "disconnected")
            await asyncio.sleep(0.05)
            return (await client.get("/metrics")).text

    text = run(main())
    assert metric(text, f'lightship_requests_total{{route="{path}",status="499"}}') == 1
    assert metric(text, 'lightship_rejections_total{reason="disconnected"}') == 1


def test_failed_warm_up_is_never_ready(tmp_path: Path) -> None:
    path = handmade_onnx(tmp_path / "hand.onnx")
    predictor = load_predictor(path)
    predictor.labels = ["only-one"]  # the model answers two classes: warm-up must catch it
    app = create_app(predictor, ServedModel("hand", "file", path, None), ServeSettings(run=path))

    async def main() -> None:
        async with serving(app) as client:
            r = await client.get("/v2/health/ready")
            assert r.status_code == 503 and "warm-up" in r.json()["error"]
            assert (await client.get("/v2/health/live")).status_code == 503
            r = await client.post(INFER, json=v2_json(X))
            assert r.status_code == 503 and "warm-up" in r.json()["error"]

    run(main())


def test_a_warm_up_back_after_sigterm_leaves_the_server_not_ready(tmp_path: Path) -> None:
    """SIGTERM while the warm-up batch runs, then the batch comes back: the server, stopping,
    stayed not ready (it had turned ready 0.15 s after SIGTERM)."""
    app, gate = make_app(tmp_path, gate=True)
    assert gate is not None

    async def main() -> tuple[bool, int, int]:
        async with serving(app, wait_ready=False) as client:
            await asyncio.to_thread(gate.entered.wait, 10)
            service(app).begin_shutdown()  # what _Server.handle_exit calls
            gate.open.set()
            await asyncio.wait_for(service(app).settled.wait(), 10)
            ready = await client.get("/v2/health/ready")
            model = await client.get("/v2/models/hand/ready")
            return service(app).ready, ready.status_code, model.status_code

    assert run(main()) == (False, 503, 503)


def test_the_heap_is_trimmed_once_the_server_is_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app, gate = make_app(tmp_path, gate=True)
    assert gate is not None
    trims: list[bool] = []
    monkeypatch.setattr(serve_app, "trim_heap", lambda: trims.append(service(app).ready))

    async def main() -> None:
        async with serving(app, wait_ready=False):
            await asyncio.to_thread(gate.entered.wait, 10)
            assert trims == []  # loading is not over until the warm-up batch is back
            gate.open.set()
            await service(app).settled.wait()

    run(main())
    assert trims == [False]  # once, just before the server turned ready


def test_the_heap_a_burst_took_is_trimmed_once_the_server_is_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once per burst, QUIET_S after its last answer; idle, the watcher waits for an answer
    without waking (an idle server woke for it once a period)."""
    monkeypatch.setattr(memory, "QUIET_S", 0.2)
    metrics = Metrics(8)
    trims: list[float] = []
    monkeypatch.setattr(memory, "trim_heap", lambda: trims.append(time.monotonic()))

    async def main() -> tuple[float, float]:
        watcher = asyncio.create_task(memory.trim_when_quiet(metrics))
        await asyncio.sleep(0.5)  # idle from the start: nothing to trim
        assert trims == [] and metrics.next_answer is not None
        assert not metrics.next_answer.done()  # asleep until an answer

        async def trimmed(count: int) -> None:  # generous: a loaded CI machine stalls
            for _ in range(100):
                if len(trims) >= count:
                    return
                await asyncio.sleep(0.05)

        for _ in range(4):  # a burst longer than QUIET_S
            metrics.request("/v1/predict", 200, 0.001)
            await asyncio.sleep(0.1)
        last = time.monotonic()
        await trimmed(1)
        await asyncio.sleep(0.5)  # and no second trim while nothing is answered
        assert len(trims) == 1, trims
        # probes and scrapes more often than QUIET_S, as a Kubernetes probe every 5 s: no
        # traffic, so neither a new trim nor one held off (counted, a burst's heap was kept for
        # good behind them)
        for _ in range(4):
            metrics.request("/metrics", 200, 0.001)
            metrics.request("/v2/health/ready", 200, 0.001)
            await asyncio.sleep(0.1)
        assert len(trims) == 1, trims
        for _ in range(4):  # a burst, with probes all through it and after
            metrics.request("/v2/models/{model_name}/infer", 200, 0.001)
            metrics.request("/v2/health/ready", 200, 0.001)
            await asyncio.sleep(0.1)
        burst = time.monotonic()
        for _ in range(40):  # probes on, every 0.1 s: the trim comes all the same
            metrics.request("/v2/health/ready", 200, 0.001)
            await asyncio.sleep(0.1)
            if len(trims) == 2:
                break
        assert len(trims) == 2, "the probes held the trim off"
        watcher.cancel()
        with suppress(asyncio.CancelledError):
            await watcher
        return last, burst

    last, burst = run(main())
    assert len(trims) == 2, trims
    assert trims[0] - last > 0.05 and trims[1] - burst > 0.15  # QUIET_S after each burst


def test_the_routes_probes_poll_are_the_servers(tmp_path: Path) -> None:
    """Metrics.POLLED names routes by their templates: one renamed would count again."""
    from lightship.serve.metrics import POLLED

    app, _ = make_app(tmp_path)
    assert {getattr(r, "path", None) for r in app.router.routes} >= POLLED


def test_the_server_trims_the_heap_after_a_burst(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app, _ = make_app(tmp_path)
    trims: list[int] = []
    monkeypatch.setattr(memory, "QUIET_S", 0.2)
    monkeypatch.setattr(memory, "trim_heap", lambda: trims.append(service(app).metrics.answered))

    async def main() -> None:
        async with serving(app) as client:
            await asyncio.sleep(0.5)
            assert trims == []  # nothing answered yet
            for _ in range(3):
                assert (await client.post(INFER, json=v2_json(X))).status_code == 200
            for _ in range(50):
                if trims:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)

    run(main())
    assert trims == [3]


def test_trimming_the_heap_hands_freed_memory_back() -> None:
    """What glibc keeps of memory a thread freed (ONNX Runtime loads a model in its own
    threads' arenas) goes back to the OS: resident memory falls."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_trim"):
        pytest.skip("not glibc: nothing to trim")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    kept: list[int] = []

    def load() -> None:  # 32 MiB of small blocks, all freed but the last, which pins the heap
        blocks = [libc.malloc(4096) for _ in range(8192)]
        for b in blocks[:-1]:
            libc.free(b)
        kept.append(blocks[-1])

    def rss_mib() -> float:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]

    thread = threading.Thread(target=load)
    thread.start()
    thread.join()
    before = rss_mib()
    trim_heap()
    assert before - rss_mib() > 16
    libc.free(kept[0])


def test_metadata_metrics_and_docs(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)

    async def main() -> None:
        async with serving(app) as client:
            assert (await client.get("/v2")).json()["extensions"] == [
                "binary_tensor_data",
                "classification",
                "model_configuration",
            ]
            meta = (await client.get("/v2/models/hand")).json()
            assert meta["inputs"] == [
                {"name": "input", "datatype": "UINT8", "shape": [-1, 1, 2, 2]}
            ]
            assert meta["parameters"]["labels"] == ["bright", "dark"]
            assert meta["parameters"]["max_batch_size"] == 64
            for path in ("/v2/models/hand/config", "/v2/models/hand/versions/1/config"):
                config = (await client.get(path)).json()
                assert config["max_batch_size"] == 64, path
                assert config["input"][0]["dims"] == [1, 2, 2]
                assert config["instance_group"] == [{"count": 1, "kind": "KIND_CPU"}]
            missing = await client.get("/v2/models/other/config")
            assert missing.status_code == 404 and "unknown model 'other'" in missing.json()["error"]
            stats = await client.get("/v2/models/stats")  # tritonclient's statistics call
            assert stats.status_code == 404 and "/metrics" in stats.json()["error"]
            await client.post(INFER, json=v2_json(X))
            text = (await client.get("/metrics")).text
            for name in (
                "lightship_request_duration_seconds_bucket",
                "lightship_queue_wait_seconds_count",
                "lightship_compute_seconds_count",
                "lightship_queue_rows",
            ):
                assert name in text
            assert (
                metric(
                    text,
                    'lightship_requests_total{route="/v2/models/{model_name}/infer",status="200"}',
                )
                == 1
            )
            assert metric(text, "lightship_queue_wait_seconds_count") == 1  # not the warm-up
            assert (
                'lightship_model_info{backend="onnxruntime",device="cpu",name="hand",variant="file"} 1.0'
                in text
            )
            assert (
                f'lightship_build_info{{python="{platform.python_version()}",runtime="onnxruntime",'
                f'runtime_version="{onnxruntime.__version__}",version="{lightship.__version__}"}} 1.0'
                in text
            )
            assert (await client.get("/docs")).status_code == 200
            paths = (await client.get("/openapi.json")).json()["paths"]
            for route in (
                "/v1/predict",
                "/v1/predict/image",
                "/v2/models/{model_name}/infer",
                "/v2/health/ready",
            ):
                assert route in paths
            # what the infer route takes is the served model's, as the server checks it
            infer = paths["/v2/models/{model_name}/infer"]["post"]
            schema = infer["requestBody"]["content"]["application/json"]["schema"]
            tensor = schema["properties"]["inputs"]
            assert (tensor["minItems"], tensor["maxItems"]) == (1, 1)
            assert "BOOL" not in tensor["items"]["properties"]["datatype"]["enum"]
            shape = tensor["items"]["properties"]["shape"]["description"]
            assert shape.startswith("[N, 1, 2, 2] with N from 1 to 64")
            headers = {p["name"] for p in infer["parameters"] if p["in"] == "header"}
            assert headers == {"Inference-Header-Content-Length", "x-request-timeout-ms"}
            # an upload /docs can send: Swagger UI draws a file picker for `format: binary`
            image = paths["/v1/predict/image"]["post"]
            form = image["requestBody"]["content"]["multipart/form-data"]["schema"]
            assert form["properties"]["files"]["items"] == {"type": "string", "format": "binary"}
            assert image["description"].startswith("Each file becomes one 1 x 2 x 2 input the way")
            answer = image["responses"]["200"]["content"]["application/json"]["schema"]
            prediction = answer["properties"]["predictions"]["items"]["properties"]
            assert set(prediction) == {"label", "index", "score", "top_k", "file"}
            meta = paths["/v2/models/{model_name}"]["get"]["responses"]["200"]
            meta_schema = meta["content"]["application/json"]["schema"]
            assert "max_batch_size" in meta_schema["properties"]["parameters"]["properties"]

    run(main())


def test_a_dead_inference_worker_is_neither_live_nor_ready_and_answers_503(
    tmp_path: Path,
) -> None:
    app, gate = make_app(tmp_path, gate=True, timeout_ms=60_000)
    assert gate is not None
    gate.open.set()
    died = "inference worker died (Crash: bug): the server must be restarted"

    async def main() -> str:
        async with serving(app) as client:
            held = await hold_inference(client, gate)
            queued = asyncio.ensure_future(client.post(INFER, json=v2_json(X)))
            while service(app).batcher.queued_rows < 2:
                await asyncio.sleep(0)
            gate.crash = Crash("bug")
            gate.open.set()
            # answered at once, not when their deadline a minute away passes
            for r in await asyncio.wait_for(asyncio.gather(held, queued), 5):
                assert r.status_code == 503 and r.json() == {"error": died}
            for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/hand/ready"):
                r = await client.get(path)
                assert r.status_code == 503 and r.json() == {"error": died}, path
            r = await client.post("/v1/predict", json={"instances": X[:, 0].tolist()})
            assert r.status_code == 503 and r.json() == {"error": died}
            return (await client.get("/metrics")).text

    text = run(main())
    assert metric(text, 'lightship_rejections_total{reason="worker_died"}') == 3
    assert metric(text, 'lightship_rejections_total{reason="not_ready"}') == 0


def post_scope(path: str, content_type: str, content_length: int, timeout_ms: int | None) -> Any:
    """The ASGI scope of a POST, for tests that drive the body's arrival themselves."""
    timeout = [] if timeout_ms is None else [(b"x-request-timeout-ms", str(timeout_ms).encode())]
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("test", 1), "server": ("test", 80),
        "headers": [
            (b"content-type", content_type.encode()),
            (b"content-length", str(content_length).encode()),
            *timeout,
        ],
    }  # fmt: skip


BOUNDARY = "b0undary"
STALLED = [
    (INFER, "application/json", b'{"inputs": ['),
    ("/v1/predict", "application/json", b'{"instances": ['),
    (
        "/v1/predict/image",
        f"multipart/form-data; boundary={BOUNDARY}",
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="files"; filename="a.png"\r\n'
        "Content-Type: image/png\r\n\r\n\x89PNG".encode(),
    ),
]


@pytest.mark.parametrize("deadline", ["server's", "client's"])
@pytest.mark.parametrize(("path", "content_type", "part"), STALLED, ids=[s[0] for s in STALLED])
def test_a_body_still_arriving_at_the_deadline_is_answered_at_once(
    tmp_path: Path, path: str, content_type: str, part: bytes, deadline: str
) -> None:
    """408 when the server's own timeout ran out on a slow client, 504 when the client's
    shorter deadline passed (under overload the server may not have read the body yet)."""
    servers = deadline == "server's"
    app, _ = make_app(tmp_path, timeout_ms=50 if servers else 10_000)
    sent: list[Message] = []

    async def main() -> str:
        async with serving(app) as client:
            messages = [{"type": "http.request", "body": part, "more_body": True}]

            async def receive() -> Message:
                if messages:
                    return messages.pop()
                await asyncio.Event().wait()  # the rest of the body never comes
                raise AssertionError("unreachable")

            async def send(message: Message) -> None:
                sent.append(message)

            scope = post_scope(path, content_type, 5000, timeout_ms=None if servers else 50)
            await asyncio.wait_for(app(scope, receive, send), 5)
            return (await client.get("/metrics")).text

    text = run(main())
    start, body = sent[0], json.loads(sent[1]["body"])
    assert (b"connection", b"close") in start["headers"]  # the rest of the body is not read
    if servers:
        assert start["status"] == 408
        assert re.fullmatch(
            rf"request body incomplete after 0\.05\d* s \({len(part)} bytes arrived\): past "
            r"the server's request deadline \(0\.05 s\) a body must keep arriving at 64 KiB/s; "
            r"send it faster, or serve with a longer --timeout-ms \(LIGHTSHIP_TIMEOUT_MS\)",
            body["error"],
        ), body
    else:
        assert start["status"] == 504
        assert body == {
            "error": "deadline of 50 ms (x-request-timeout-ms) passed before the whole body "
            f"was read ({len(part)} bytes arrived)"
        }
    rejections = {"body_timeout": 1 if servers else 0, "deadline": 0 if servers else 1}
    for reason, count in rejections.items():
        assert metric(text, f'lightship_rejections_total{{reason="{reason}"}}') == count


def test_a_request_cancelled_while_its_body_arrives_is_not_a_body_timeout(tmp_path: Path) -> None:
    # The body's deadline cancels the task reading it; a cancel from elsewhere (uvicorn's
    # shutdown, the client's task group) must stay a cancel, not turn into a 408.
    app, _ = make_app(tmp_path)
    reading = asyncio.Event()

    async def main() -> str:
        async with serving(app) as client:
            messages = [{"type": "http.request", "body": b'{"inputs": [', "more_body": True}]

            async def receive() -> Message:
                if messages:
                    return messages.pop()
                reading.set()
                await asyncio.Event().wait()
                raise AssertionError("unreachable")

            async def send(message: Message) -> None:
                raise AssertionError(f"nothing is sent for a cancelled request: {message}")

            scope = post_scope(INFER, "application/json", content_length=5000, timeout_ms=60000)
            task = asyncio.ensure_future(app(scope, receive, send))
            await asyncio.wait_for(reading.wait(), 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return (await client.get("/metrics")).text

    text = run(main())
    assert metric(text, 'lightship_rejections_total{reason="body_timeout"}') == 0


@pytest.mark.parametrize("by", ["header", "parameter"])
def test_the_deadline_counts_from_arrival_not_from_the_end_of_the_body(
    tmp_path: Path, by: str
) -> None:
    """The client's 0.6 s, as x-request-timeout-ms or V2's parameters.timeout (which counted
    from the end of the body)."""
    app, gate = make_app(tmp_path, gate=True)
    assert gate is not None
    gate.open.set()
    extra: dict[str, Any] = {"parameters": {"timeout": 600_000}} if by == "parameter" else {}
    body = json.dumps(v2_json(X, **extra)).encode()
    sent: list[Message] = []

    async def main() -> float:
        async with serving(app) as client:
            held = await hold_inference(client, gate)  # the request below can only queue
            parts = [body[:10], body[10:]]

            async def receive() -> Message:
                if parts:
                    if len(parts) == 1:
                        await asyncio.sleep(0.45)  # the body takes 0.45 s of the 0.6 s
                    part = parts.pop(0)
                    return {"type": "http.request", "body": part, "more_body": bool(parts)}
                await asyncio.Event().wait()  # the client stays connected
                raise AssertionError("unreachable")

            async def send(message: Message) -> None:
                sent.append(message)

            timeout_ms = 600 if by == "header" else None
            scope = post_scope(INFER, "application/json", len(body), timeout_ms=timeout_ms)
            started = time.monotonic()
            await asyncio.wait_for(app(scope, receive, send), 5)
            answered = time.monotonic() - started
            gate.open.set()
            assert (await held).status_code == 200
            return answered

    answered = run(main())
    assert sent[0]["status"] == 504
    error = json.loads(sent[1]["body"])["error"]
    assert error.startswith("deadline passed before the answer was ready: ")
    assert "allow more time where the x-request-timeout-ms header or V2 parameters.timeout" in error
    assert error.endswith(" ms (`lightship serve --timeout-ms`)"), error
    # 0.6 s after it began, not 0.6 s after its body was read (1.05 s)
    assert 0.55 < answered < 0.95, answered


def test_a_bug_is_a_500_with_a_json_error_body_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, via: str
) -> None:
    """tritonclient reads every error as `{"error": ...}`: a bug answered Starlette's text
    "Internal Server Error", which it reports as a failure to decode the answer."""
    app, _ = make_app(tmp_path)

    def bug(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(serve_app.v2, "encode_response", bug)
    monkeypatch.setattr(serve_app.v2, "model_metadata", bug)

    async def main() -> list[httpx.Response]:
        if via == "http":  # the protocol answers the tensor route itself, and logs the bug
            async with serving(app, via=via) as client:
                return [await client.post(INFER, json=v2_json(X)), await client.get(HAND)]
        async with app.router.lifespan_context(app):
            await asyncio.wait_for(service(app).settled.wait(), 10)
            # as a server does: the app's exception reaches uvicorn (which logs it), the
            # client gets the answer sent before
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return [await client.post(INFER, json=v2_json(X)), await client.get(HAND)]

    for r in run(main()):
        assert r.status_code == 500
        assert r.headers["content-type"] == "application/json"
        assert r.json() == {"error": "internal server error (a bug: see the server's log)"}
    if via == "http":
        (logged,) = [r for r in caplog.records if r.name == "lightship.serve.app"]
        assert logged.exc_info is not None and str(logged.exc_info[1]) == "a bug"


def test_tensor_routes_answer_other_methods_405_and_label_each_route(
    tmp_path: Path, via: str
) -> None:
    app, _ = make_app(tmp_path)

    async def main() -> None:
        async with serving(app, via=via) as client:
            for path in (INFER, "/v2/models/hand/versions/1/infer", "/v1/predict"):
                r = await client.get(path)
                assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
                assert "use POST" in r.json()["error"]
            r = await client.post("/v2/models/hand/versions/1/infer", json=v2_json(X))
            assert r.status_code == 200
            r = await client.post("/v2/models/hand/versions/2/infer", json=v2_json(X))
            assert r.status_code == 404 and "version" in r.json()["error"]
            text = (await client.get("/metrics")).text
            versioned = "/v2/models/{model_name}/versions/{version}/infer"
            assert (
                metric(text, f'lightship_requests_total{{route="{versioned}",status="200"}}') == 1
            )
            assert (
                metric(text, f'lightship_requests_total{{route="{versioned}",status="404"}}') == 1
            )
            assert (
                metric(text, f'lightship_requests_total{{route="{versioned}",status="405"}}') == 1
            )

    run(main())


class _RecordingTransport(asyncio.Transport):
    """Records each write; enough of a socket transport for uvicorn's protocol."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(
            name, default
        )

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_a_response_head_and_body_leave_in_one_write() -> None:
    """uvicorn's own protocol writes the head and the body apart; the server's writes each
    answer once, whole, at the end of the event loop's turn."""
    import uvicorn
    from uvicorn.server import ServerState

    from lightship.serve.protocol import http_protocol as _http_protocol

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"11")]}
        )
        await send({"type": "http.response.body", "body": b'{"ok":true}'})

    async def main() -> list[bytes]:
        config = uvicorn.Config(app, lifespan="off", log_level="warning")
        protocol = _http_protocol()(config=config, server_state=ServerState(), app_state={})
        transport = _RecordingTransport()
        protocol.connection_made(transport)
        protocol.data_received(b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n")
        for _ in range(20):  # the request's task, then the turn that sends
            await asyncio.sleep(0)
        protocol.connection_lost(None)
        return transport.writes

    writes = asyncio.run(main())
    assert len(writes) == 1, writes
    head, _, body = writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: 11" in head
    assert body == b'{"ok":true}'


def test_held_writes_go_out_before_close_and_never_after_abort() -> None:
    from lightship.serve.protocol import _CoalescingTransport

    async def main() -> tuple[_RecordingTransport, _RecordingTransport]:
        loop = asyncio.get_running_loop()
        closed, aborted = _RecordingTransport(), _RecordingTransport()
        a = _CoalescingTransport(closed, loop)
        a.write(b"head ")
        a.writelines([b"body", b""])
        assert closed.writes == [] and a.get_write_buffer_size() == 9  # held in this turn
        a.close()  # sends first, then closes
        b = _CoalescingTransport(aborted, loop)
        b.write(b"lost")
        b.abort()
        await asyncio.sleep(0)  # the turn ends: nothing is left to send
        return closed, aborted

    closed, aborted = asyncio.run(main())
    assert closed.writes == [b"head body"] and closed.closed
    assert aborted.writes == [] and aborted.aborted


def _feed(chunks: list[bytes]) -> tuple[_RecordingTransport, list[bytes], bool]:
    """`chunks` as they would arrive on one connection of the server's HTTP protocol: what
    it wrote back, the bodies the app read, and whether the server closed the connection."""
    import uvicorn
    from uvicorn.server import ServerState

    from lightship.serve.protocol import http_protocol as _http_protocol

    bodies: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        bodies.append(body)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def main() -> tuple[_RecordingTransport, bool]:
        config = uvicorn.Config(app, lifespan="off", log_level="warning")
        protocol = _http_protocol()(config=config, server_state=ServerState(), app_state={})
        transport = _RecordingTransport()
        protocol.connection_made(transport)
        for chunk in chunks:
            if transport.is_closing():
                break  # a closed transport reads no more
            protocol.data_received(chunk)
            for _ in range(20):
                await asyncio.sleep(0)
        closed = transport.is_closing()
        protocol.connection_lost(None)
        return transport, closed

    transport, closed = asyncio.run(main())
    return transport, bodies, closed


def test_a_request_head_over_64_kib_is_refused_with_431_as_it_arrives() -> None:
    from lightship.serve.protocol import MAX_HEAD_BYTES

    huge = b"x-big: " + b"a" * (3 * MAX_HEAD_BYTES)
    pieces = [b"GET /x HTTP/1.1\r\nhost: t\r\n" + huge[:40_000], huge[40_000:80_000]]
    pieces += [huge[80_000:], b"\r\n\r\n"]
    transport, bodies, closed = _feed(pieces)
    assert bodies == [] and closed
    assert len(transport.writes) == 1
    head, _, body = transport.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert json.loads(body) == {
        "error": f"request URL and headers over {MAX_HEAD_BYTES} bytes: send them shorter"
    }


@pytest.mark.parametrize("where", ["url", "header"])
def test_a_head_over_64_kib_in_one_read_is_refused_with_431(where: str) -> None:
    """Counted only across reads, a 70 KB URL in one read reached uvicorn's URL parser,
    which raised: a 500, "a bug", and a traceback in the log for each."""
    from lightship.serve.protocol import MAX_HEAD_BYTES

    long = "a" * (MAX_HEAD_BYTES + 10)
    line = f"GET /v2/health/ready?{long} HTTP/1.1\r\nhost: t\r\n"
    if where == "header":
        line = f"GET /x HTTP/1.1\r\nhost: t\r\nx-big: {long}\r\n"
    transport, bodies, closed = _feed([f"{line}\r\n".encode()])
    assert bodies == [] and closed
    head, _, body = transport.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert json.loads(body)["error"].startswith("request URL and headers over")


def test_heads_under_the_limit_and_bodies_of_any_size_are_not_counted_as_head() -> None:
    from lightship.serve.protocol import MAX_HEAD_BYTES

    # a head just under the limit, in pieces; then a 300 KB body in the same chunk as its
    # head; then two pipelined requests in one chunk: none of it is a long head
    long_header = b"x-long: " + b"b" * (MAX_HEAD_BYTES - 200) + b"\r\n"
    first = b"GET /a HTTP/1.1\r\nhost: t\r\n" + long_header + b"\r\n"
    body = b"z" * 300_000
    second = b"POST /b HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    small = b"POST /c HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\nok"
    transport, bodies, closed = _feed([first[:30_000], first[30_000:], second, small + small])
    assert bodies == [b"", body, b"ok", b"ok"]
    assert [w.split(b"\r\n", 1)[0] for w in transport.writes] == [b"HTTP/1.1 204 No Content"] * 4
    assert not closed


def test_images_are_decoded_a_few_requests_at_a_time_and_waiting_counts_to_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightship.serve.app as app_module

    monkeypatch.setattr(app_module, "DECODE_SLOTS", 2)
    app, _ = make_app(tmp_path)
    decoding, most = 0, 0
    lock = threading.Lock()
    real_decode = app_module.v1.decode_image

    def slow_decode(data: bytes, chw: tuple[int, int, int], name: str = "image") -> np.ndarray:
        nonlocal decoding, most
        with lock:
            decoding += 1
            most = max(most, decoding)
        time.sleep(0.2)  # a large PNG takes this long
        with lock:
            decoding -= 1
        return real_decode(data, chw, name)

    monkeypatch.setattr(app_module.v1, "decode_image", slow_decode)
    png = io.BytesIO()
    Image.fromarray(np.full((2, 2), 255, np.uint8), "L").save(png, "PNG")
    files = [("files", ("a.png", png.getvalue(), "image/png"))]

    async def main() -> tuple[list[httpx.Response], httpx.Response, str]:
        async with serving(app) as client:
            answers = await asyncio.gather(
                *(client.post("/v1/predict/image", files=files) for _ in range(6))
            )
            # both slots taken for 0.2 s: a request allowed 50 ms never gets one
            busy = [client.post("/v1/predict/image", files=files) for _ in range(2)]
            late = client.post(
                "/v1/predict/image", files=files, headers={"x-request-timeout-ms": "50"}
            )
            *_, hurried = await asyncio.gather(*busy, late)
            return answers, hurried, (await client.get("/metrics")).text

    answers, hurried, text = run(main())
    assert most == 2  # six requests, never more than two decoding
    assert [r.json()["predictions"][0]["label"] for r in answers] == ["bright"] * 6
    assert hurried.status_code == 504
    assert "deadline passed waiting to decode the images" in hurried.json()["error"]
    assert metric(text, 'lightship_rejections_total{reason="deadline"}') == 1
    # the eight that decoded waited their turns: of the six, two at once, two 0.2 s and two
    # 0.4 s where all came at once (1.2 s in all); the two after them, at once
    assert metric(text, 'lightship_slot_wait_seconds_count{slot="decode"}') == 8
    assert metric(text, 'lightship_slot_wait_seconds_sum{slot="decode"}') >= 0.6
    assert metric(text, 'lightship_slot_wait_seconds_bucket{le="0.1",slot="decode"}') >= 2
    assert metric(text, 'lightship_slot_wait_seconds_count{slot="parse"}') == 0


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_an_upload_whose_client_left_stops_decoding_at_the_next_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    """Eight large photos take seconds to decode: a client that leaves during the first is
    seen leaving, and the rest are not decoded for no one (they all were)."""
    import lightship.serve.app as app_module

    app, _ = make_app(tmp_path)
    decoded: list[str] = []
    started = threading.Event()
    real_decode = app_module.v1.decode_image

    def slow_decode(data: bytes, chw: tuple[int, int, int], name: str = "image") -> np.ndarray:
        decoded.append(name)
        started.set()
        time.sleep(0.2)  # a large photo takes longer
        return real_decode(data, chw, name)

    monkeypatch.setattr(app_module.v1, "decode_image", slow_decode)
    image = png(np.full((2, 2), 77, np.uint8))
    upload = httpx.Request(
        "POST", "http://t/", files=[("files", (f"{i}.png", image)) for i in range(8)]
    )
    kind = f"content-type: {upload.headers['content-type']}"

    async def main() -> str:
        async with raw_http(app) as (connect, _, client):
            _, writer = await connect()
            writer.write(post("/v1/predict/image", upload.read(), kind))
            await asyncio.to_thread(started.wait, 10)
            writer.close()  # the client leaves while its first photo decodes
            await until_rejected(client, "disconnected")
            await asyncio.sleep(0.5)  # two more photos' time
            return (await client.get("/metrics")).text

    text = run(main(), loop)
    assert len(decoded) <= 2, decoded  # the one decoding as it left, perhaps the next
    assert metric(text, 'lightship_rejections_total{reason="disconnected"}') == 1
    route = 'route="/v1/predict/image",status='
    assert metric(text, f'lightship_requests_total{{{route}"499"}}') == 1
    assert f'{route}"200"' not in text


def test_large_json_bodies_are_parsed_one_at_a_time_and_waiting_counts_to_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    """orjson's parse of a large body peaks at many times its size, and holds the GIL: parses
    side by side are no faster, only larger."""
    import lightship.serve.app as app_module

    app, _ = make_app(tmp_path)
    parsing, most = 0, 0
    lock = threading.Lock()
    real_decode = app_module.v1.decode_instances

    def slow_decode(*args: Any) -> Any:
        nonlocal parsing, most
        with lock:
            parsing += 1
            most = max(most, parsing)
        time.sleep(0.1)  # a 16 MiB body takes longer
        with lock:
            parsing -= 1
        return real_decode(*args)

    monkeypatch.setattr(app_module.v1, "decode_instances", slow_decode)
    large = json.dumps({"instances": X.tolist()}).encode() + b" " * app_module.LARGE_BODY_BYTES

    async def main() -> tuple[list[httpx.Response], httpx.Response, str]:
        async with serving(app, via=via) as client:
            # a V2 header on /v1 (which reads none) must not pass a body off as small
            sly = {"inference-header-content-length": "0"}
            busy = [client.post("/v1/predict", content=large, headers=sly) for _ in range(3)]
            late = client.post("/v1/predict", content=large, headers={"x-request-timeout-ms": "50"})
            *answers, hurried = await asyncio.gather(*busy, late)
            return answers, hurried, (await client.get("/metrics")).text

    answers, hurried, text = run(main())
    assert most == 1
    assert [r.json()["predictions"][0]["label"] for r in answers] == ["dark"] * 3
    assert hurried.status_code == 504
    assert "deadline passed waiting to parse the JSON body" in hurried.json()["error"]
    # the three parsed waited their turns, 0.1 s a parse before them: 0 + 0.1 + 0.2 where all
    # came at once
    assert metric(text, 'lightship_slot_wait_seconds_count{slot="parse"}') == 3
    assert metric(text, 'lightship_slot_wait_seconds_sum{slot="parse"}') >= 0.15
    assert metric(text, 'lightship_rejections_total{reason="deadline"}') == 1


def test_a_v2_batch_of_the_wrong_layout_is_told_its_layout_not_to_split(
    tmp_path: Path, via: str
) -> None:
    app, _ = make_app(tmp_path, max_batch_rows=4)

    def nhwc(n: int) -> bytes:  # the model takes [N, 1, 2, 2]
        inputs = [
            {"name": "input", "shape": [n, 2, 2, 1], "datatype": "UINT8", "data": [0] * 4 * n}
        ]
        return json.dumps({"inputs": inputs}).encode()

    async def main() -> list[httpx.Response]:
        async with serving(app, via=via) as client:
            return [await client.post(INFER, content=nhwc(n)) for n in (3, 5)]

    for answer in run(main()):  # 5 rows: splitting it would only bring the layout's 400
        assert answer.status_code == 400, answer.text
        assert "NHWC" in answer.json()["error"]


def test_gzip_members_are_read_in_pieces_and_counted() -> None:
    """A body of many gzip members was copied whole once a member: 4 MiB of empty members held
    a core for 27 s, past every deadline. Members are read a piece at a time, a body of several
    pieces and members is one body, and more than MAX_GZIP_MEMBERS are refused."""
    limit = 16 * 2**20
    large = np.random.default_rng(0).bytes(5 * serve_app.INFLATE_PIECE)  # incompressible
    small = [bytes([i % 256]) * 10 for i in range(serve_app.MAX_GZIP_MEMBERS - 2)]
    parts = [*small[:500], large, *small[500:], b""]  # MAX_GZIP_MEMBERS members in all
    body = b"".join(gzip.compress(part, mtime=0) for part in parts)
    assert serve_app._decode_content(body, "gzip", limit) == b"".join(parts)

    empty = gzip.compress(b"", mtime=0)
    with pytest.raises(serve_app.ProtocolError) as refused:
        serve_app._decode_content(body + empty, "gzip", limit)
    assert str(refused.value) == (
        f"body has more than {serve_app.MAX_GZIP_MEMBERS} gzip members: compress it as one stream"
    )
    # a larger body limit takes bgzip's members for it (one every 65,280 bytes of data)
    assert serve_app._decode_content(body + empty, "gzip", 2**30) == b"".join(parts)
    with pytest.raises(serve_app.ProtocolError, match="^body is gzip data cut short"):
        serve_app._decode_content(body[:-30], "gzip", limit)
    # a gzip member whose data is damaged is said so, not "bytes that are not a member"
    damaged = gzip.compress(b"ok", mtime=0) + gzip.compress(b"x" * 100, mtime=0)[:-8] + b"\0" * 8
    with pytest.raises(serve_app.ProtocolError, match=r"^member 2 of the body is not valid gzip"):
        serve_app._decode_content(damaged, "gzip", limit)


def test_gzip_bodies_are_decoded_whole_or_refused(tmp_path: Path, via: str) -> None:
    app, _ = make_app(tmp_path, max_body_bytes=4096)
    body = json.dumps(v2_json(X)).encode()
    cases = {
        "two members": (gzip.compress(body[:20]) + gzip.compress(body[20:]), "gzip"),
        "garbage after": (gzip.compress(body) + b"junk", "gzip"),
        "cut short": (gzip.compress(body)[:-12], "gzip"),
        "deflate, bytes after": (zlib.compress(body) + b"junk", "deflate"),
        "bomb": (gzip.compress(b" " * 100_000), "gzip"),
    }

    async def main() -> tuple[dict[str, httpx.Response], str]:
        async with serving(app, via=via) as client:
            answers = {
                name: await client.post(INFER, content=data, headers={"content-encoding": enc})
                for name, (data, enc) in cases.items()
            }
            return answers, (await client.get("/metrics")).text

    answers, text = run(main())
    assert answers["two members"].status_code == 200, answers["two members"].text
    np.testing.assert_array_equal(logits_of(answers["two members"]), expected_logits(X))
    errors = {
        n: (r.status_code, r.json()["error"]) for n, r in answers.items() if n != "two members"
    }
    assert errors["garbage after"] == (
        400,
        "body has 4 bytes after its gzip data that are not a gzip member: send the compressed "
        "stream alone",
    )
    assert errors["cut short"] == (400, "body is gzip data cut short: send the whole stream")
    assert errors["deflate, bytes after"] == (400, "body has 4 bytes after its deflate data")
    assert errors["bomb"] == (413, "decompressed body over the limit of 4096 bytes")
    assert "connection" not in answers["bomb"].headers  # read whole: the connection stays
    assert metric(text, 'lightship_rejections_total{reason="body_too_large"}') == 1


def test_answers_are_compressed_as_accept_encoding_asks(tmp_path: Path, via: str) -> None:
    """As Triton (tritonclient's response_compression_algorithm): gzip or deflate as the
    header ranks them, the first listed on a tie; answers under 1 KiB and errors as they are."""
    app, _ = make_app(tmp_path, max_batch_rows=256)
    rows = np.tile(X, (128, 1, 1, 1))  # a JSON answer of ~7 KB, a binary one of ~2 KB
    as_json = json.dumps(v2_json(rows)).encode()
    as_binary, binary_headers = v2_binary(rows)
    cases = [
        ("gzip", as_json, {}, "gzip"),
        ("deflate", as_binary, binary_headers, "deflate"),
        ("gzip;q=0, deflate", as_json, {}, "deflate"),
        ("deflate;q=0.5, x-gzip;q=0.8", as_json, {}, "gzip"),
        ("deflate, gzip", as_binary, binary_headers, "deflate"),
        ("br, *;q=0.1", as_json, {}, "gzip"),
        ("identity, gzip;q=0.5", as_json, {}, None),
        ("br", as_json, {}, None),
        ("gzip;q=0", as_json, {}, None),
        ("gzip;q=2", as_json, {}, None),  # no valid weight: not asked for
        ("gzip", json.dumps(v2_json(X)).encode(), {}, None),  # 2 rows: under 1 KiB
    ]

    async def main() -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
        async with serving(app, via=via) as client:
            answers = [
                await client.post(INFER, content=body, headers={"accept-encoding": ae} | headers)
                for ae, body, headers, _ in cases
            ]
            gzip_please = {"accept-encoding": "gzip"}
            error = await client.post(INFER, content=b"{" * 2000, headers=gzip_please)
            v1_rows = {"instances": rows.tolist()}
            v1_answer = await client.post("/v1/predict", json=v1_rows, headers=gzip_please)
            return answers, error, v1_answer

    answers, error, v1_answer = run(main())
    for (accept, body, _, coding), r in zip(cases, answers, strict=True):
        assert r.status_code == 200, r.text
        assert r.headers.get("content-encoding") == coding, (accept, r.headers)
        # compressed or not, an answer that would go compressed to a client that asked says
        # it varies by Accept-Encoding; one under 1 KiB does not vary
        large = len(body) > 1000
        assert r.headers.get("vary") == ("accept-encoding" if large else None), accept
        # content-length counts the bytes sent; httpx decoded them into r.content
        assert (int(r.headers["content-length"]) < len(r.content)) == (coding is not None)
        x = rows if large else X
        np.testing.assert_array_equal(logits_of(r), expected_logits(x))
    assert error.status_code == 400 and "content-encoding" not in error.headers
    assert "vary" not in error.headers
    assert v1_answer.headers["content-encoding"] == "gzip"
    assert len(v1_answer.json()["predictions"]) == 256


def test_the_compression_threshold_is_a_setting_and_0_turns_it_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    """`compress_min_bytes`: an answer of that many bytes goes compressed, one a byte shorter
    as it is; 0 (from the flag or LIGHTSHIP_COMPRESS_MIN_BYTES) compresses none, however large
    (httpx asks for gzip on localhost too). /docs says which."""
    rows = np.tile(X, (128, 1, 1, 1))
    body = json.dumps(v2_json(rows)).encode()
    gzip_please = {"accept-encoding": "gzip"}
    infer_doc = "/v2/models/{model_name}/infer"

    async def answers(app: FastAPI) -> tuple[httpx.Response, httpx.Response, str]:
        async with serving(app, via=via) as client:
            v2_answer = await client.post(INFER, content=body, headers=gzip_please)
            v1_rows = {"instances": rows.tolist()}
            v1_answer = await client.post("/v1/predict", json=v1_rows, headers=gzip_please)
            paths = (await client.get("/openapi.json")).json()["paths"]
            v1_doc = paths["/v1/predict"]["post"]["description"]
            assert paths[infer_doc]["post"]["description"].endswith(". " + v1_doc)
            return v2_answer, v1_answer, paths[infer_doc]["post"]["description"]

    def coding(r: httpx.Response) -> str | None:
        assert r.status_code == 200, r.text
        return r.headers.get("content-encoding")

    monkeypatch.setenv("LIGHTSHIP_COMPRESS_MIN_BYTES", "0")
    off, off_v1, doc = run(answers(make_app(tmp_path, max_batch_rows=256)[0]))
    size = int(off.headers["content-length"])  # ~7 KB of JSON, sent as it is
    assert size > 4096 and coding(off) is None and coding(off_v1) is None
    assert "vary" not in off.headers and "vary" not in off_v1.headers  # never compressed
    np.testing.assert_array_equal(logits_of(off), expected_logits(rows))
    assert doc.endswith(
        ". Answers go uncompressed whatever Accept-Encoding asks (--compress-min-bytes 0)."
    )
    monkeypatch.setenv("LIGHTSHIP_COMPRESS_MIN_BYTES", "4096")  # the environment's value...
    *_, doc = run(answers(make_app(tmp_path, max_batch_rows=256)[0]))
    assert doc.endswith(
        ". Answers of 4 KiB or more go gzip or deflate compressed when Accept-Encoding asks "
        "(--compress-min-bytes)."
    )
    for threshold, compressed in ((size, "gzip"), (size + 1, None)):  # ...or the flag's
        app, _ = make_app(tmp_path, max_batch_rows=256, compress_min_bytes=threshold)
        v2_answer, _, doc = run(answers(app))
        assert coding(v2_answer) == compressed, threshold
        assert (int(v2_answer.headers["content-length"]) < size) == (compressed is not None)
        np.testing.assert_array_equal(logits_of(v2_answer), expected_logits(rows))
        assert f"Answers of {threshold} bytes or more go gzip" in doc


def test_large_answers_are_compressed_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    app, _ = make_app(tmp_path, max_batch_rows=256)
    monkeypatch.setattr(serve_app, "COMPRESS_IN_THREAD_BYTES", 4096)
    threads: list[tuple[int, str]] = []
    real = serve_app._compress

    def recording(body: bytes, coding: str) -> bytes:
        threads.append((len(body), threading.current_thread().name))
        return real(body, coding)

    monkeypatch.setattr(serve_app, "_compress", recording)
    rows = np.tile(X, (128, 1, 1, 1))
    as_binary, headers = v2_binary(rows)

    async def main() -> str:
        async with serving(app, via=via) as client:
            for body, extra in ((json.dumps(v2_json(rows)).encode(), {}), (as_binary, headers)):
                r = await client.post(
                    INFER, content=body, headers={"accept-encoding": "gzip"} | extra
                )
                np.testing.assert_array_equal(logits_of(r), expected_logits(rows))
            return threading.current_thread().name

    loop_thread = run(main())
    (large, large_thread), (small, small_thread) = threads
    assert large >= 4096 > small
    assert large_thread != loop_thread and small_thread == loop_thread


def test_uploads_must_come_uncompressed_and_tensor_routes_take_gzip_by_any_name(
    tmp_path: Path, via: str
) -> None:
    app, _ = make_app(tmp_path)
    upload = httpx.Request(
        "POST", "http://test", files=[("files", ("a.png", png(np.zeros((2, 2), np.uint8))))]
    )
    form, form_type = upload.read(), upload.headers["content-type"]
    v2_body = json.dumps(v2_json(X)).encode()

    async def main() -> list[httpx.Response]:
        async with serving(app, via=via) as client:
            return [
                await client.post(
                    path, content=body, headers={"content-type": kind, "content-encoding": enc}
                )
                for path, body, kind, enc in [
                    ("/v1/predict/image", gzip.compress(form), form_type, "gzip"),
                    ("/v1/predict/image", form, form_type, "br"),
                    ("/v1/predict/image", form, form_type, "identity"),
                    (INFER, gzip.compress(v2_body), "application/json", "x-gzip"),
                    (INFER, v2_body, "application/json", ""),
                    (INFER, v2_body, "application/json", "br"),
                ]
            ]

    gzipped, br, identity, x_gzip, empty, v2_br = run(main())
    # a 415 for its Content-Encoding says which it takes (RFC 9110, 12.5.3; Triton does too)
    assert gzipped.headers["accept-encoding"] == br.headers["accept-encoding"] == "identity"
    assert v2_br.status_code == 415 and v2_br.headers["accept-encoding"] == "gzip, deflate"
    refused = "is not supported: send the body uncompressed (PNG and JPEG are compressed already)"
    assert (gzipped.status_code, gzipped.json()) == (
        415,
        {"error": f"Content-Encoding gzip {refused}"},
    )
    assert (br.status_code, br.json()) == (415, {"error": f"Content-Encoding br {refused}"})
    assert identity.status_code == 200, identity.text
    for r in (x_gzip, empty):
        assert r.status_code == 200, r.text
        np.testing.assert_array_equal(logits_of(r), expected_logits(X))


def test_large_bodies_are_parsed_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    import lightship.serve.app as app_module

    app, _ = make_app(tmp_path)
    threads: list[str] = []
    real = app_module.v2.decode_request

    def recording(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(app_module.v2, "decode_request", recording)
    small = json.dumps(v2_json(X)).encode()
    large = small + b" " * app_module.LARGE_BODY_BYTES  # still valid JSON

    async def main() -> tuple[list[httpx.Response], str]:
        async with serving(app, via=via) as client:
            loop_thread = threading.current_thread().name
            answers = [await client.post(INFER, content=body) for body in (small, large)]
            return answers, loop_thread

    answers, loop_thread = run(main())
    for r in answers:
        np.testing.assert_array_equal(logits_of(r), expected_logits(X))
    assert threads[0] == loop_thread and threads[1] != loop_thread


def test_fastapis_own_pages_are_counted_under_their_paths(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)

    async def main() -> str:
        async with serving(app) as client:
            for path in ("/docs", "/openapi.json", "/redoc", "/v2/nowhere"):
                await client.get(path)
            return (await client.get("/metrics")).text

    text = run(main())
    for route, status in (("/docs", 200), ("/openapi.json", 200), ("/redoc", 200)):
        assert metric(text, f'lightship_requests_total{{route="{route}",status="{status}"}}') == 1
    assert metric(text, 'lightship_requests_total{route="unmatched",status="404"}') == 1


def test_docs_pages_load_everything_from_the_server_itself(tmp_path: Path) -> None:
    # An edge box is often offline: a page that pulls Swagger UI from a CDN is blank there.
    app, _ = make_app(tmp_path)
    link = r"""(?:src|href|spec-url)=["']([^"']+)["']|url: '([^']+)'"""

    async def main() -> tuple[dict[str, str], dict[str, tuple[int, str, int]], str, str]:
        async with serving(app) as client:
            pages = {p: (await client.get(p)).text for p in ("/docs", "/redoc")}
            linked = {
                url
                for page in pages.values()
                for found in re.findall(link, page)
                for url in found
                if url
            }
            files = {}
            for url in sorted(linked):
                r = await client.get(url)
                files[url] = (r.status_code, r.headers["content-type"], len(r.content))
            missing = await client.get("/docs/nowhere.js")
            return pages, files, missing.text, (await client.get("/metrics")).text

    pages, files, missing, text = run(main())
    assert all("//" not in url for url in files), files  # nothing from another host
    assert set(files) == {
        "/openapi.json",
        "/docs/swagger-ui-bundle.js",
        "/docs/swagger-ui.css",
        "/docs/redoc.standalone.js",
        "/docs/favicon.png",
    }
    for url, (status, _, size) in files.items():
        assert status == 200 and size > 1000, url
    assert files["/docs/swagger-ui-bundle.js"][1].startswith("text/javascript")
    assert files["/docs/swagger-ui.css"][1].startswith("text/css")
    assert "SwaggerUIBundle(" in pages["/docs"] and "<redoc " in pages["/redoc"]
    assert json.loads(missing) == {
        "error": "no file 'nowhere.js' here: the docs are at /docs and /redoc"
    }
    # one label for every file, not one per name asked for
    assert metric(text, 'lightship_requests_total{route="/docs/{name}",status="200"}') == 4
    assert metric(text, 'lightship_requests_total{route="/docs/{name}",status="404"}') == 1


def start_up_log(
    settings: ServeSettings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> list[str]:
    """What `serve` logs up to uvicorn's start, which is skipped (and so are its process-wide
    signal handler and GIL switch interval)."""
    monkeypatch.setattr(serve_app._Server, "run", lambda self, sockets=None: None)
    monkeypatch.setattr(sys, "setswitchinterval", lambda interval: None)
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    caplog.clear()
    with caplog.at_level(logging.INFO, "lightship"):
        serve_app.serve(settings)
    return [r.getMessage() for r in caplog.records if r.name == "lightship.serve.app"]


def test_the_start_up_log_says_what_is_served_on_which_cpu_and_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from lightship.quantize.isa import host_cpu
    from lightship.runs import RunDir, sha256_file

    run = tmp_path / "my-run"
    (run / "export").mkdir(parents=True)
    path = handmade_onnx(run / "export" / "m.onnx")
    RunDir(run).record(
        "onnx-fp32", {"file": "export/m.onnx", "format": "onnx", "sha256": sha256_file(path)}
    )
    monkeypatch.setattr(serve_app, "physical_cores", lambda: 2)
    cpu = f"CPU: {host_cpu().describe()}, this CPU's int8 target {host_cpu().target}; 2 cores for this process"
    served = rf"serving 'my-run' \(onnx-fp32{{}}: {re.escape(str(path))}; 1 instance x 1 thread\)"

    lines = start_up_log(ServeSettings(run=run, host="::", port=0, threads=1), monkeypatch, caplog)
    assert lines[0] == cpu
    assert re.fullmatch(
        served.format(", the default without a report")
        + r" at http://\[::\]:\d+  \(docs at /docs\)",
        lines[1],
    ), lines
    (run / "report").mkdir()
    (run / "report" / "report.json").write_text(
        json.dumps({"recommended": "onnx-fp32", "variants": []})
    )
    lines = start_up_log(ServeSettings(run=run, port=0, threads=1), monkeypatch, caplog)
    assert re.fullmatch(
        served.format(", the report's recommendation") + r" at http://127\.0\.0\.1:\d+ .*", lines[1]
    ), lines
    settings = ServeSettings(run=run, variant="onnx-fp32", port=0, threads=1)
    lines = start_up_log(settings, monkeypatch, caplog)
    assert re.fullmatch(served.format("") + " at .*", lines[1]), lines


def test_a_lone_int8_file_is_loaded_once_after_its_cpu_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The CPU an int8 file was made for (`lightship.target` in its own metadata, no manifest
    to say it) is read off the file: onnxruntime builds the served session and no other, and
    a file made for another CPU is refused before any session is built."""
    import onnx
    import onnxruntime

    from lightship.errors import RunError
    from lightship.quantize.isa import CpuInfo

    path = tmp_path / "model.int8-static.onnx"
    model = onnx.load(str(handmade_onnx(path)))
    model.metadata_props.add(key="lightship.target", value="vnni")
    onnx.save(model, str(path))
    built: list[str] = []

    class Counted(onnxruntime.InferenceSession):
        def __init__(self, path: str, *args: Any, **kwargs: Any) -> None:
            built.append(path)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", Counted)
    vnni = CpuInfo("test VNNI CPU", "x86_64", frozenset({"avx2", "avx512_vnni"}))
    monkeypatch.setattr("lightship.serve.model.host_cpu", lambda: vnni)
    settings = ServeSettings(run=path, port=0, threads=1)  # one thread: no lanes to build
    start_up_log(settings, monkeypatch, caplog)
    assert built == [str(path)]
    built.clear()
    avx2 = CpuInfo("test AVX2 CPU", "x86_64", frozenset({"avx2"}))
    monkeypatch.setattr("lightship.serve.model.host_cpu", lambda: avx2)
    with pytest.raises(RunError, match="model was quantized for vnni .* but this CPU has no VNNI"):
        start_up_log(settings, monkeypatch, caplog)
    assert built == []


@pytest.mark.parametrize(
    ("threads", "instances", "warning"),
    [
        (8, 1, "1 instance x 8 threads = 8 inference threads on 2 cores: "
         "the threads beyond the cores take turns on them and slow every batch; "
         "serve with --threads unset (cores / instances)"),
        (None, 3, "3 instances x 1 thread = 3 inference threads on 2 cores: "
         "the threads beyond the cores take turns on them and slow every batch; "
         "serve with --instances 2 or fewer"),
        (2, 1, None),
        (None, 2, None),
    ],
)  # fmt: skip
def test_more_inference_threads_than_cores_are_warned_about(
    threads: int | None,
    instances: int,
    warning: str | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(serve_app, "physical_cores", lambda: 2)
    monkeypatch.setattr("lightship.runtime.base.physical_cores", lambda: 2)
    path = handmade_onnx(tmp_path / "hand.onnx")
    settings = ServeSettings(run=path, port=0, threads=threads, instances=instances)
    start_up_log(settings, monkeypatch, caplog)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ([warning] if warning else [])


@pytest.mark.parametrize(
    ("quantization", "max_batch_rows", "warned"),
    [
        ("dynamic", 64, True),
        ("dynamic", 1, False),  # no other client's rows in its batch
        ("static", 64, False),  # scales fixed at calibration
    ],
)
def test_dynamic_int8_with_batching_is_warned_about(
    quantization: str,
    max_batch_rows: int,
    warned: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Dynamic int8 computes its activation scales from each batch, and a batch holds several
    clients' rows: one client's logits move with the others' (digits: by up to 0.1)."""
    monkeypatch.setattr(serve_app, "physical_cores", lambda: 2)
    # a lone file copied out of its run under a name that says nothing: its metadata does
    path = handmade_onnx(tmp_path / "digits-int8.onnx")
    model = onnx.load(str(path))
    model.metadata_props.add(key="lightship.quantization", value=quantization)
    onnx.save(model, str(path))
    settings = ServeSettings(run=path, port=0, threads=1, max_batch_rows=max_batch_rows)
    start_up_log(settings, monkeypatch, caplog)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == (
        [
            "digits-int8.onnx is dynamic int8: it scales activations per batch, so a "
            "request's logits shift slightly with the other requests batched with it "
            "(--max-batch-rows 64); for answers independent of traffic serve a static, QAT or "
            "fp32 model file"
        ]
        if warned
        else []
    )


def test_dynamic_int8_is_known_by_its_variant_or_its_manifest_entry(tmp_path: Path) -> None:
    settings = ServeSettings(run=tmp_path)
    warning = serve_app._batch_dependent
    named = ServedModel("d", "onnx-int8-dynamic", tmp_path / "model.int8-dynamic.onnx", {})
    assert (warning(named, settings) or "").startswith("onnx-int8-dynamic is dynamic int8: ")
    renamed = ServedModel("d", "file", tmp_path / "d.onnx", {"quantization": "dynamic"})
    assert (warning(renamed, settings) or "").startswith("d.onnx is dynamic int8: ")
    static = ServedModel("d", "onnx-int8-static", tmp_path / "model.int8-static.onnx", {})
    assert warning(static, settings) is None


def test_a_model_export_found_batch_dependent_is_warned_about_where_it_batches(
    tmp_path: Path,
) -> None:
    """BatchNorm without running statistics: export measured an image's logits moving with
    its batch and recorded it; the server, which batches clients together, says so again."""
    measured = {"batches": [1, 64], "max_abs_logit_diff": 0.1234, "label_agreement": 0.9}
    static = ServedModel(
        "d", "onnx-int8-static", tmp_path / "m.onnx", {"quantization": "static",
        "batch_dependent": measured},
    )  # fmt: skip
    assert serve_app._batch_dependent(static, ServeSettings(run=tmp_path, max_batch_rows=8)) == (
        "onnx-int8-static's logits for an image depend on the other images in its batch "
        "(export measured max |Δlogit| 1.23e-01 between batch 1 and 64): served, a request's "
        "answer changes with the requests batched with it (--max-batch-rows 8); serve with "
        "--max-batch-rows 1 for answers independent of traffic"
    )
    alone = ServeSettings(run=tmp_path, max_batch_rows=1)
    assert serve_app._batch_dependent(static, alone) is None  # no other client's rows
    # a lone file of a run, named by its file; an entry edited by hand, without the figures
    lone = ServedModel("d", "file", tmp_path / "d.ts", {"batch_dependent": {"batches": "x"}})
    assert serve_app._batch_dependent(lone, ServeSettings(run=tmp_path)) == (
        "d.ts's logits for an image depend on the other images in its batch: served, a "
        "request's answer changes with the requests batched with it (--max-batch-rows 64); "
        "serve with --max-batch-rows 1 for answers independent of traffic"
    )


ONE_ROW = np.full((1, 1, 2, 2), 3, np.uint8)


@pytest.mark.parametrize(
    "how",
    [
        {"headers": {"X-Request-Timeout-Ms": "60000"}},  # 60 s against the server's 0.2 s
        {"json": v2_json(ONE_ROW, parameters={"timeout": 60_000_000})},  # 60 s in µs
    ],
    ids=["header", "v2-parameter"],
)
def test_a_client_cannot_lengthen_the_servers_deadline(
    tmp_path: Path, how: dict[str, Any], via: str
) -> None:
    app, gate = make_app(tmp_path, gate=True, timeout_ms=200, max_wait_ms=0)
    assert gate is not None
    gate.open.set()
    kwargs = {"json": v2_json(ONE_ROW)} | how

    async def main() -> tuple[int, Any]:
        async with serving(app, via=via) as client:
            held = await hold_inference(client, gate)  # the model is busy until the gate opens
            request = asyncio.ensure_future(client.post(INFER, **kwargs))
            done, _ = await asyncio.wait([request], timeout=3)  # 15x the server's 0.2 s
            gate.open.set()
            await held
            r = await request
            return r.status_code, (r.json() if done else None)

    status, body = run(main())
    # answered 504 at the server's 0.2 s deadline, not held for the client's 60 s
    assert status == 504, f"status {status}: the client's longer deadline was honoured"
    assert body is not None and "deadline" in body["error"]
    computed = [rows for batch in gate.rows for rows in batch]
    assert not any((rows == 3).all() for rows in computed)  # dropped before compute


def test_a_longer_client_deadline_is_still_answered_by_a_free_model(
    tmp_path: Path, via: str
) -> None:
    # the control for the test above: a longer header by itself changes nothing
    app, _ = make_app(tmp_path, timeout_ms=200, max_wait_ms=0)

    async def main() -> Any:
        async with serving(app, via=via) as client:
            return await client.post(
                INFER, json=v2_json(ONE_ROW), headers={"X-Request-Timeout-Ms": "60000"}
            )

    r = run(main())
    assert r.status_code == 200
    np.testing.assert_array_equal(logits_of(r), expected_logits(ONE_ROW))


# -- the server's own protocol: tensor routes answered without ASGI ---------------------------


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP answer off a raw connection: status, headers (lower-case names), body."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    fields = (line.partition(":") for line in head[1:] if line)
    headers = {name.lower(): value.strip() for name, _, value in fields}
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return int(head[0].split()[1]), headers, body


@asynccontextmanager
async def raw_http(
    app: FastAPI, **config: Any
) -> AsyncIterator[tuple[Callable[[], Awaitable[Any]], CountingApp, httpx.AsyncClient]]:
    """The app served and ready behind the server's protocol: a function that opens a raw
    connection to it (reader, writer), the ASGI app as the protocol calls it, and a client."""
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(service(app).settled.wait(), 10)
        async with over_http(app, **config) as (url, counting):
            host, port = url.removeprefix("http://").split(":")

            def connect() -> Awaitable[Any]:
                return asyncio.open_connection(host, int(port))

            async with httpx.AsyncClient(base_url=url) as client:
                yield connect, counting, client


def post(path: str, body: bytes, *headers: str, version: str = "1.1") -> bytes:
    head = [f"POST {path} HTTP/{version}", "host: t", f"content-length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


Exchange = tuple[int, dict[str, str], bytes, bytes]


async def write_in_a_stall(writer: asyncio.StreamWriter, data: bytes, seconds: float = 0.6) -> None:
    """`data` sent as the event loop stalls `seconds` (`in_a_stall`): it lies in the server's
    socket buffer until the loop's next turn."""
    await in_a_stall(lambda: writer.write(data), seconds)


async def in_a_stall(begin: Callable[[], None], seconds: float = 0.6) -> None:
    """The event loop stalled `seconds` where a busy server's does, in its reading of sockets,
    `begin()` called as the stall begins: what the client does meanwhile (send, read) the
    server's loop sees only on its next turn, which on uvloop runs the timers that came due
    meanwhile first."""
    loop = asyncio.get_running_loop()
    waker, woken = socket.socketpair()
    stalled = loop.create_future()

    def stall() -> None:
        loop.remove_reader(woken.fileno())
        begin()
        time.sleep(seconds)
        stalled.set_result(None)

    loop.add_reader(woken.fileno(), stall)
    waker.send(b"!")
    try:
        await stalled
    finally:
        waker.close()
        woken.close()


async def exchange(connect: Callable[[], Awaitable[Any]], *data: bytes) -> Exchange:
    """Send `data` on a new connection; the answer, then what follows it until the server
    closes (b"" when it closes right after the answer)."""
    reader, writer = await connect()
    writer.writelines(data)
    await asyncio.wait_for(writer.drain(), 10)  # all of it sent, none of it read
    status, headers, body = await asyncio.wait_for(read_answer(reader), 5)
    rest = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return status, headers, body, rest


def test_cors_lets_a_page_of_a_listed_origin_call_every_route_and_no_other(
    tmp_path: Path,
) -> None:
    """A demo page on :3000 calling the server on :8000: the browser's preflight (OPTIONS) is
    answered, and every answer carries the headers, the tensor routes' too (answered by the
    protocol without ASGI for a client that is no browser). Off by default."""
    page = "http://localhost:3000"
    app, _ = make_app(tmp_path, cors_origins=f" {page} ,https://app.example.com")
    binary, binary_headers = v2_binary(X)
    preflight = {
        "origin": page,
        "access-control-request-method": "POST",
        "access-control-request-headers": "content-type,inference-header-content-length",
    }

    async def main() -> tuple[list[httpx.Response], list[list[str]]]:
        async with raw_http(app) as (_, counting, client):
            answers = [
                await client.options(INFER, headers=preflight),
                await client.post(
                    INFER, content=binary, headers={**binary_headers, "origin": page}
                ),
                await client.post(
                    "/v1/predict", json={"instances": [[[[1]]]]}, headers={"origin": page}
                ),
                await client.post(
                    "/v1/predict/image",
                    files=[("files", ("b.png", png(np.full((2, 2), 250, np.uint8))))],
                    headers={"origin": page},
                ),
                await client.post(
                    INFER, json=v2_json(X), headers={"origin": "http://evil.example"}
                ),
                await client.options(INFER, headers={**preflight, "origin": "http://evil.example"}),
            ]
            before = list(counting.paths)
            plain = await client.post(INFER, json=v2_json(X))  # no browser: the protocol's
            return [*answers, plain], [before, list(counting.paths)]

    answers, (before, after) = run(main())
    ok, infer, bad_rows, upload, other, other_preflight, plain = answers
    assert ok.status_code == 200, ok.text
    assert ok.headers["access-control-allow-origin"] == page
    assert "POST" in ok.headers["access-control-allow-methods"]
    allowed = ok.headers["access-control-allow-headers"].lower()
    assert "inference-header-content-length" in allowed and "x-request-timeout-ms" in allowed
    assert infer.status_code == 200
    np.testing.assert_array_equal(logits_of(infer), expected_logits(X))
    assert infer.headers["access-control-allow-origin"] == page
    assert (
        "inference-header-content-length" in infer.headers["access-control-expose-headers"].lower()
    )
    assert bad_rows.status_code == 400 and bad_rows.headers["access-control-allow-origin"] == page
    assert upload.status_code == 200 and upload.headers["access-control-allow-origin"] == page
    assert upload.json()["predictions"][0]["label"] == "bright"
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    assert other_preflight.status_code == 400
    assert plain.status_code == 200 and before == after  # not through ASGI
    assert INFER in before  # the browser's were

    (tmp_path / "default").mkdir()
    default, _ = make_app(tmp_path / "default")

    async def off() -> httpx.Response:
        async with serving(default) as client:
            return await client.options(INFER, headers=preflight)

    assert run(off()).status_code == 405


def test_a_cors_origin_that_is_no_origin_is_refused_with_what_to_give() -> None:
    with pytest.raises(ValueError, match="cors_origins lists 'http://localhost:3000/', which"):
        ServeSettings(run=Path("m.onnx"), cors_origins="http://localhost:3000/")
    assert ServeSettings(run=Path("m.onnx"), cors_origins="*").origins == ["*"]
    assert ServeSettings(run=Path("m.onnx")).origins == []


@pytest.mark.parametrize("path", [INFER, "/v2/models/hand"], ids=["protocol's", "ASGI's"])
def test_a_request_sent_as_the_server_stops_on_a_kept_alive_connection_is_answered(
    tmp_path: Path, path: str
) -> None:
    """SIGTERM closed every idle kept-alive connection at once (uvicorn's shutdown): a request
    the client had sent already met a reset and no answer (pooled clients lost up to 11 of 16
    at a rolling update). Now it is answered with Connection: close; a connection that sends
    nothing is closed once DRAIN_IDLE_S has passed."""
    app, _ = make_app(tmp_path)
    body = json.dumps(v2_json(X)).encode()
    request = (
        post(path, body) if path == INFER else f"GET {path} HTTP/1.1\r\nhost: t\r\n\r\n".encode()
    )

    async def main() -> tuple[Exchange, Exchange, bytes, float]:
        async with raw_http(app) as (connect, counting, _):
            reader, writer = await connect()
            idle_reader, idle_writer = await connect()
            writer.write(request)
            first = await asyncio.wait_for(read_answer(reader), 5)
            assert first[1].get("connection") != "close"
            while len(counting.connections) < 2:
                await asyncio.sleep(0.01)
            for connection in list(counting.connections):  # what SIGTERM does to each
                connection.shutdown()
            await asyncio.sleep(0.05)  # the next request arrives as the server stops
            writer.write(request)
            second = await asyncio.wait_for(read_answer(reader), 5)
            rest = await asyncio.wait_for(reader.read(), 5)
            start = time.monotonic()
            idle = await asyncio.wait_for(idle_reader.read(), 5)  # closed, after a while
            waited = time.monotonic() - start
            writer.close()
            idle_writer.close()
            return (*first, b""), (*second, rest), idle, waited

    first, second, idle, waited = run(main())
    assert first[0] == second[0] == 200
    assert second[1]["connection"] == "close" and second[3] == b""  # answered, then closed
    assert idle == b"" and waited < 1.5


def test_tensor_routes_over_http_are_answered_without_asgi(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)
    binary, binary_headers = v2_binary(X)

    async def main() -> tuple[list[httpx.Response], list[str], str]:
        async with raw_http(app) as (_, counting, client):
            answers = [
                await client.post(INFER, json=v2_json(X)),
                await client.post(
                    f"{HAND}/versions/1/infer", content=binary, headers=binary_headers
                ),
                await client.post("/v1/predict", json={"instances": X.tolist()}),
            ]
            tensors = list(counting.paths)
            # uvicorn decodes a percent-encoded path: that one goes through ASGI
            answers.append(await client.post("/v2/models/h%61nd/infer", json=v2_json(X)))
            answers.append(await client.get(HAND))
            return answers, tensors, (await client.get("/metrics")).text

    answers, tensors, text = run(main())
    assert tensors == []  # no tensor route reached the ASGI app
    for r in (answers[0], answers[1], answers[3]):
        assert r.status_code == 200
        np.testing.assert_array_equal(logits_of(r), expected_logits(X))
    assert [p["label"] for p in answers[2].json()["predictions"]] == ["dark", "bright"]
    assert answers[4].json()["name"] == "hand"
    routes = {"/v2/models/{model_name}/infer": 2, "/v1/predict": 1}
    routes["/v2/models/{model_name}/versions/{version}/infer"] = 1
    for route, count in routes.items():
        assert metric(text, f'lightship_requests_total{{route="{route}",status="200"}}') == count


@pytest.mark.parametrize("path", [INFER, "/v2/models/h%61nd/infer"], ids=["protocol", "asgi"])
def test_whitespace_after_a_header_value_is_not_part_of_it(tmp_path: Path, path: str) -> None:
    """RFC 9110 5.5; httptools trims it before a value only. A Content-Length of "N " was
    refused as over the limit (413), the other two headers as malformed (400)."""
    app, _ = make_app(tmp_path)
    binary, headers = v2_binary(X)
    (length,) = headers.values()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-length: {len(binary)} \r\n"
        f"inference-header-content-length: {length}\t\r\nx-request-timeout-ms: 5000 \r\n"
        "connection: close\r\n\r\n"
    )

    async def main() -> Exchange:
        async with raw_http(app) as (connect, _, _):
            return await exchange(connect, head.encode(), binary)

    status, answer_headers, answer, _ = run(main())
    assert status == 200, answer
    split = int(answer_headers["inference-header-content-length"])
    np.testing.assert_array_equal(
        np.frombuffer(answer[split:], "<f4").reshape(2, 2), expected_logits(X)
    )


def test_a_head_that_never_ends_is_answered_408_and_a_silent_connection_closed(
    tmp_path: Path,
) -> None:
    """A partial head at the server's request deadline, a connection that sent nothing at the
    keep-alive timeout, as one idle between requests. uvicorn's keep-alive timer stops at the
    first byte and starts only after an answer: either held its socket for good."""
    app, _ = make_app(tmp_path, timeout_ms=300)
    request = post(INFER, json.dumps(v2_json(X)).encode(), "content-type: application/json")

    async def main() -> tuple[Exchange, bytes, list[int], float, str]:
        async with raw_http(app, timeout_keep_alive=1) as (connect, _, http):
            partial = await exchange(connect, f"POST {INFER} HTTP/1.1\r\nhost: t\r\nx-a: ".encode())
            reader, writer = await connect()  # sends nothing
            t0 = time.monotonic()
            silent = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            took = time.monotonic() - t0
            reader, writer = await connect()  # two requests 0.5 s apart: both answered
            statuses = []
            for _ in range(2):
                writer.write(request)
                statuses.append((await asyncio.wait_for(read_answer(reader), 5))[0])
                await asyncio.sleep(0.5)
            writer.close()
            return partial, silent, statuses, took, (await http.get("/metrics")).text

    (status, headers, answer, rest), silent, statuses, took, text = run(main())
    assert status == 408 and headers["connection"] == "close" and rest == b""
    assert metric(text, 'lightship_rejections_total{reason="head_timeout"}') == 1
    assert json.loads(answer)["error"].startswith("request head incomplete after 0.3 s")
    assert silent == b"" and 0.9 < took < 3  # the keep-alive's second, not the deadline's 0.3
    assert statuses == [200, 200]


def test_a_new_connection_may_stay_silent_past_the_request_deadline(tmp_path: Path) -> None:
    """Until the keep-alive timeout, where that is longer. A fresh connection is idle until its
    first byte; closed at the request deadline, a client that opened it and was slow to write
    (one of 48 threads sharing 2 cores with the server, at a 1.5 s deadline) read "Server
    disconnected without sending a response"."""
    app, _ = make_app(tmp_path, timeout_ms=300)
    request = post(INFER, json.dumps(v2_json(X)).encode(), "content-type: application/json")

    async def main() -> int:
        async with raw_http(app, timeout_keep_alive=2) as (connect, _, _):
            reader, writer = await connect()
            await asyncio.sleep(0.9)  # three deadlines
            writer.write(request)
            status, _, _ = await asyncio.wait_for(read_answer(reader), 5)
            writer.close()
            return status

    assert run(main()) == 200


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize(
    "before", ["nothing", "half a head", "an answer", "an early answer", "an answer and SIGTERM"]
)
def test_a_request_in_the_sockets_buffer_when_a_timer_goes_off_is_read_first(
    tmp_path: Path, before: str, loop: str
) -> None:
    """After the event loop stalls (a 2-core machine under overload), uvloop runs the timers
    that came due before it reads the sockets: a connection whose request waited in the
    kernel's buffer was closed unanswered as silent, at its keep-alive timeout, or as still
    sending the body of a request answered before it came (a GET with a body), or as idle
    while the server stops (SIGTERM), or answered 408 at the request deadline as a head that
    never ended. Each looks once more first."""
    app, _ = make_app(tmp_path, timeout_ms=300)
    request = post(INFER, json.dumps(v2_json(X)).encode(), "content-type: application/json")

    stopping = before == "an answer and SIGTERM"  # its keep-alive (5 s) not due in the stall

    async def main() -> tuple[int, str]:
        async with raw_http(app, timeout_keep_alive=5 if stopping else 0.3) as (
            connect,
            counting,
            http,
        ):
            reader, writer = await connect()
            rest = request
            if before == "half a head":
                writer.write(request[:20])
                rest = request[20:]
            elif before.startswith("an answer"):
                writer.write(request)
                await asyncio.wait_for(read_answer(reader), 5)
                for connection in list(counting.connections) if stopping else []:
                    connection.shutdown()  # what SIGTERM does to each: idle, closed in 0.5 s
            elif before == "an early answer":
                writer.write(
                    b"GET /v2/health/ready HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\n\r\n"
                )
                await asyncio.wait_for(read_answer(reader), 5)
                await asyncio.sleep(0.05)
                writer.write(b"ab")  # 2 of the 5 bytes, after the answer
                rest = b"cde" + request
            await asyncio.sleep(0.05)  # the server has it: its timer is armed
            await write_in_a_stall(writer, rest)  # the server's timer comes due meanwhile
            status, _, _ = await asyncio.wait_for(read_answer(reader), 5)
            writer.close()
            return status, (await http.get("/metrics")).text

    status, text = run(main(), loop)
    assert status == 200
    assert metric(text, 'lightship_rejections_total{reason="head_timeout"}') == 0


@pytest.mark.parametrize("path", [INFER, "/v2/models/h%61nd/infer"], ids=["protocol", "asgi"])
@pytest.mark.parametrize("bad", ["garbage", "head too large"])
def test_a_request_that_cannot_be_read_is_answered_after_those_pipelined_ahead_of_it(
    tmp_path: Path, path: str, bad: str
) -> None:
    """RFC 9112 9.3.2: answers in the order of the requests. The 400 (or 431) used to be
    written at once and the connection closed, cutting off the answers still being computed."""
    app, _ = make_app(tmp_path, max_wait_ms=200)  # the two requests ahead are still queued
    request = post(path, json.dumps(v2_json(X)).encode(), "content-type: application/json")
    after = (
        b"\x00garbage\r\n\r\n" if bad == "garbage" else b"GET / HTTP/1.1\r\nx-a: " + b"a" * 70_000
    )

    async def main() -> tuple[list[tuple[int, dict[str, str], bytes]], bytes, str]:
        async with raw_http(app) as (connect, _, http):
            reader, writer = await connect()
            writer.write(request + request)
            await writer.drain()
            await asyncio.sleep(0.05)  # read apart: the server counts a head from a read's start
            writer.write(after)
            answers = [await asyncio.wait_for(read_answer(reader), 5) for _ in range(3)]
            rest = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return answers, rest, (await http.get("/metrics")).text

    answers, rest, text = run(main())
    reason = "bad_http" if bad == "garbage" else "head_too_large"
    assert metric(text, f'lightship_rejections_total{{reason="{reason}"}}') == 1
    for status, _, answer in answers[:2]:
        assert status == 200
        out = {o["name"]: o for o in json.loads(answer)["outputs"]}["logits"]
        assert out["data"] == expected_logits(X).ravel().tolist()
    status, headers, answer = answers[2]
    assert (status, headers["connection"], rest) == (400 if bad == "garbage" else 431, "close", b"")
    assert "error" in json.loads(answer)


@pytest.mark.parametrize(
    ("path", "route"),
    [
        (INFER, "/v2/models/{model_name}/infer"),
        ("/v2/models/h%61nd/infer", "/v2/models/{model_name}/infer"),
        ("/nowhere", "unmatched"),
    ],
    ids=["protocol", "asgi", "no route"],
)
def test_a_malformed_chunked_body_is_answered_400_at_once(
    tmp_path: Path, path: str, route: str
) -> None:
    """The error is the request's own, still arriving: not held for it to be answered. It is
    counted once, under its route with the 400 it got: it was also counted 499 (or the 404
    its route answered into the closed connection) and a bad_http rejection."""
    app, _ = make_app(tmp_path)
    head = f"POST {path} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
    counted = f'lightship_requests_total{{route="{route}",status="400"}}'

    async def main() -> tuple[Exchange, float, str]:
        async with raw_http(app) as (connect, _, client):
            t0 = time.monotonic()
            answer = await exchange(connect, head.encode(), b"2\r\n{}\r\nzz\r\n")
            took = time.monotonic() - t0
            for _ in range(200):  # the request's task ends after the answer
                text = (await client.get("/metrics")).text
                if counted in text:
                    break
                await asyncio.sleep(0.01)
            return answer, took, text

    (status, headers, answer, rest), took, text = run(main())
    assert (status, headers["connection"], rest) == (400, "close", b"")
    assert json.loads(answer)["error"].startswith("malformed HTTP request")
    assert took < 2  # not the 10 s deadline
    assert metric(text, counted) == 1
    assert metric(text, 'lightship_rejections_total{reason="bad_http"}') == 0
    served = [line for line in text.splitlines() if line.startswith("lightship_requests_total{")]
    assert served == [f"{counted} 1.0"], served  # the /metrics scrapes count after they answer


@pytest.mark.parametrize("path", [INFER, "/v1/predict/image"])
def test_a_chunked_body_over_the_limit_is_answered_413_closing(tmp_path: Path, path: str) -> None:
    """Kept alive, the rest of the body was read to be thrown away: 100 MiB taken after the
    413 of a 16 MiB limit."""
    app, _ = make_app(tmp_path, max_body_bytes=4096)
    head = f"POST {path} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n"
    if "image" in path:
        head += "content-type: multipart/form-data; boundary=b\r\n"

    async def main() -> tuple[int, dict[str, str]]:
        async with raw_http(app) as (connect, _, _client):
            reader, writer = await connect()
            writer.write(head.encode() + b"\r\n" + b"1388\r\n" + b" " * 5000 + b"\r\n")
            status, headers, _ = await asyncio.wait_for(read_answer(reader), 5)
            writer.close()
            return status, headers

    status, headers = run(main())
    assert (status, headers.get("connection")) == (413, "close")


def test_a_body_in_tiny_chunks_is_held_at_about_its_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept as the pieces it came in, a body sent in 2-byte chunks took some 20x its size (an
    object and a list slot a piece): 16 MiB held 300 MB of the server's memory. Measured as
    the body is handed to the parser (orjson's own buffer, sized by the body, comes after)."""
    import tracemalloc

    app, _ = make_app(tmp_path)
    peaks: list[int] = []
    decode = v2.decode_request

    def measured(body: bytes, *args: Any) -> Any:
        if tracemalloc.is_tracing():
            peaks.append(tracemalloc.get_traced_memory()[1])
        return decode(body, *args)

    monkeypatch.setattr(v2, "decode_request", measured)
    body = json.dumps(v2_json(X)).encode().ljust(512 * 1024)  # JSON allows the spaces after
    request = b"".join(
        [
            f"POST {INFER} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n".encode(),
            *(b"2\r\n" + body[i : i + 2] + b"\r\n" for i in range(0, len(body), 2)),
            b"0\r\n\r\n",
        ]
    )

    def exchange(port: int) -> bytes:  # a blocking socket, in a thread: its writes allocate
        with socket.create_connection(("127.0.0.1", port)) as sock:  # nothing tracemalloc sees
            sock.sendall(request)
            answer = b""
            while not answer.endswith(b"}"):
                answer += sock.recv(65536)
            return answer

    async def main() -> bytes:
        async with raw_http(app) as (_connect, _, client):
            port = int(str(client.base_url).rsplit(":", 1)[1].strip("/"))
            tracemalloc.start()
            try:
                return await asyncio.wait_for(asyncio.to_thread(exchange, port), 60)
            finally:
                tracemalloc.stop()

    answer = run(main())
    head, _, content = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), answer
    np.testing.assert_array_equal(v2_logits(content), expected_logits(X))
    # the body, and the copy of it handed on (2.4x); kept as pieces, 20x
    assert len(peaks) == 1 and peaks[0] < 4 * len(body), f"{peaks[0] / len(body):.1f}x the body"


@pytest.mark.parametrize("origin", [False, True], ids=["protocol", "asgi"])
def test_a_body_over_the_limit_read_whole_keeps_the_connection(
    tmp_path: Path, origin: bool
) -> None:
    """Its last chunk came with it: closing lost the request pipelined behind it, read and
    never answered."""
    app, _ = make_app(tmp_path, max_body_bytes=4096, cors_origins="*")
    extra = "origin: http://a.example\r\n" if origin else ""  # through ASGI (CORS)
    head = f"POST {INFER} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n{extra}\r\n"
    body = b"1388\r\n" + b" " * 5000 + b"\r\n0\r\n\r\n"
    probe = b"GET /v2/health/ready HTTP/1.1\r\nhost: t\r\n\r\n"

    async def main() -> list[tuple[int, str | None]]:
        async with raw_http(app) as (connect, _, _client):
            reader, writer = await connect()
            writer.write(head.encode() + body + probe)
            answers = []
            for _ in range(2):
                status, headers, _ = await asyncio.wait_for(read_answer(reader), 5)
                answers.append((status, headers.get("connection")))
            writer.close()
            return answers

    assert run(main()) == [(413, None), (200, None)]


def test_a_chunked_body_that_breaks_off_after_its_answer_gets_no_second_answer(
    tmp_path: Path,
) -> None:
    """A route that answers before reading the body (no route: 404); a malformed chunk after
    that closes the connection. It was answered a second time, a 400 to no request, and counted
    as a bad_http rejection beside the 404."""
    app, _ = make_app(tmp_path)
    head = b"POST /nowhere HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"

    async def main() -> tuple[int, bytes, str]:
        async with raw_http(app) as (connect, _, client):
            reader, writer = await connect()
            writer.write(head + b"2\r\n{}\r\n")
            status, _, _ = await asyncio.wait_for(read_answer(reader), 5)
            writer.write(b"zz\r\n")
            rest = await asyncio.wait_for(reader.read(), 5)  # b"": closed, nothing more
            writer.close()
            return status, rest, (await client.get("/metrics")).text

    status, rest, text = run(main())
    assert (status, rest) == (404, b"")
    assert metric(text, 'lightship_requests_total{route="unmatched",status="404"}') == 1
    assert metric(text, 'lightship_rejections_total{reason="bad_http"}') == 0


H2C = ("connection: Upgrade, HTTP2-Settings", "upgrade: h2c", "http2-settings: AAMAAABkAARAAAAA")


@pytest.mark.parametrize("path", [INFER, "/v2/models/h%61nd/infer"], ids=["protocol", "asgi"])
@pytest.mark.parametrize("writes", ["one write", "head, then body"])
def test_an_upgrade_to_http2_is_ignored_and_the_request_answered_over_http1(
    tmp_path: Path, path: str, writes: str
) -> None:
    """As `curl --http2 http://...` sends it. llhttp reads no body after an Upgrade head:
    uvicorn answered the request as empty (400) and read its body as the next request. Here a
    GET with the same Upgrade (no body) and a GET behind it follow on the connection."""
    app, _ = make_app(tmp_path)
    binary, headers = v2_binary(X)
    (length,) = headers.values()
    infer = post(path, binary, f"inference-header-content-length: {length}", *H2C)
    split = len(infer) - len(binary) if writes == "head, then body" else len(infer)
    get = ("\r\n".join(["GET /v2/health/ready HTTP/1.1", "host: t", *H2C]) + "\r\n\r\n").encode()
    last = b"GET /v2/models/hand HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n"

    async def main() -> list[tuple[int, dict[str, str], bytes]]:
        async with raw_http(app) as (connect, _, _):
            reader, writer = await connect()
            writer.write(infer[:split])
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(infer[split:] + get + last)
            answers = [await asyncio.wait_for(read_answer(reader), 5) for _ in range(3)]
            assert await asyncio.wait_for(reader.read(), 5) == b""  # and nothing more
            writer.close()
            return answers

    (status, answer_headers, answer), ready, meta = run(main())
    assert status == 200, answer
    header_length = int(answer_headers["inference-header-content-length"])
    logits = np.frombuffer(answer[header_length:], "<f4").reshape(2, 2)
    np.testing.assert_array_equal(logits, expected_logits(X))
    assert ready[0] == 200 and json.loads(ready[2]) == {"ready": True}
    assert meta[0] == 200 and json.loads(meta[2])["name"] == "hand"


@pytest.mark.parametrize("path", [INFER, "/v1/predict/image"], ids=["protocol", "asgi"])
def test_a_websocket_upgrade_on_a_post_is_refused_in_json(tmp_path: Path, path: str) -> None:
    """uvicorn handed it to its WebSocket protocol, which never answered a POST."""
    app, _ = make_app(tmp_path)
    ws = ("connection: Upgrade", "upgrade: websocket", "sec-websocket-version: 13")
    key = "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ=="

    async def main() -> Exchange:
        async with raw_http(app) as (connect, _, _):
            return await exchange(connect, post(path, b"{}", *ws, key))

    status, headers, answer, rest = run(main())
    assert (status, headers["connection"], rest) == (400, "close", b"")
    assert "WebSocket handshake is a GET" in json.loads(answer)["error"]


def test_an_upgrade_with_a_chunked_body_is_refused_in_json(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)
    head = "\r\n".join([f"POST {INFER} HTTP/1.1", "host: t", "transfer-encoding: chunked", *H2C])

    async def main() -> Exchange:
        async with raw_http(app) as (connect, _, _):
            return await exchange(connect, (head + "\r\n\r\n2\r\n{}\r\n0\r\n\r\n").encode())

    status, headers, answer, rest = run(main())
    assert status == 400 and headers["connection"] == "close" and rest == b""
    assert "Upgrade and a chunked body" in json.loads(answer)["error"]


def _slow_bodies() -> dict[str, tuple[str, str, bytes]]:
    """A 96 KiB body for each way in: (path, content type, body), the answer "bright"."""
    padding = b" " * (96 * 1024)  # JSON takes any whitespace
    tensor = json.dumps(v2_json(np.full((1, 1, 2, 2), 250, np.uint8))).encode() + padding
    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "x" * 96 * 1024)  # a PNG as large as a photo, the pixels 2x2
    image = io.BytesIO()
    Image.fromarray(np.full((2, 2), 250, np.uint8)).save(image, "PNG", pnginfo=info)
    part = 'Content-Disposition: form-data; name="files"; filename="b.png"\r\n\r\n'
    upload = multipart("MARK").replace(b"MARK", part.encode() + image.getvalue())
    return {
        "tensor": (INFER, "application/json", tensor),
        "upload": ("/v1/predict/image", FORM_TYPE, upload),
    }


@pytest.mark.parametrize("way", ["tensor", "upload"])
def test_a_body_still_arriving_fast_enough_at_the_deadline_is_answered_and_a_trickle_is_not(
    tmp_path: Path, way: str
) -> None:
    """Apache's mod_reqtimeout MinRate: past the server's deadline a body gets one more second
    for every 64 KiB that arrived, and then its request the whole deadline again for the queue
    and the model. A 5.8 MB photo over a 4 Mbit/s uplink was refused 408 at 10 s with 5.2 MB
    in; a client trickling its body still goes at the deadline. Both ways in: the tensor route
    answered by the protocol, the upload by ASGI's BodyLimit."""
    app, _ = make_app(tmp_path, timeout_ms=300)
    path, content_type, body = _slow_bodies()[way]

    async def send(
        connect: Callable[[], Awaitable[Any]], chunk: int, pause_s: float
    ) -> tuple[int, bytes, float]:
        reader, writer = await connect()
        start = time.monotonic()
        writer.write(
            post(path, b"", f"content-type: {content_type}").replace(
                b"length: 0", b"length: %d" % len(body)
            )
        )

        async def dribble() -> None:
            with suppress(ConnectionError):
                for i in range(0, len(body), chunk):
                    writer.write(body[i : i + chunk])
                    await writer.drain()
                    await asyncio.sleep(pause_s)

        sending = asyncio.ensure_future(dribble())
        status, _, answer = await asyncio.wait_for(read_answer(reader), 10)
        took = time.monotonic() - start
        sending.cancel()
        writer.close()
        return status, answer, took

    async def main() -> list[tuple[int, bytes, float]]:
        async with raw_http(app) as (connect, _, _):
            # 8 KiB every 60 ms (~130 KiB/s): 0.7 s for the body, past the 0.3 s deadline;
            # then 100 bytes every 20 ms (5 KB/s)
            return [await send(connect, 8 * 1024, 0.06), await send(connect, 100, 0.02)]

    (status, answer, took), trickled = run(main())
    assert status == 200 and took > 0.6, (status, answer, took)
    if way == "tensor":
        outputs = {o["name"]: o["data"] for o in json.loads(answer)["outputs"]}
        assert outputs["probabilities"] == pytest.approx([1.0, 0.0], abs=1e-3)
    else:
        assert json.loads(answer)["predictions"][0]["label"] == "bright"
    status, answer, took = trickled  # refused at about the deadline
    assert status == 408 and 0.29 < took < 0.6, (status, answer, took)
    assert json.loads(answer)["error"].startswith("request body incomplete after 0.3")


@pytest.mark.parametrize("way", ["tensor", "asgi"])
def test_a_body_that_arrived_while_the_event_loop_stalled_past_the_deadline_is_read(
    tmp_path: Path, way: str
) -> None:
    """The body came in time, but the loop was held (a 2-core machine under overload) past the
    request's deadline: uvloop runs its due timers before it reads the sockets, and the body
    waiting in the kernel's buffer was answered 408, "0 bytes arrived" (CI, the overload test).
    The timer takes one turn of the loop to read it first. Both ways in: the tensor route
    answered by the protocol, and through ASGI (BodyLimit; CORS sends it there)."""
    app, _ = make_app(tmp_path, timeout_ms=200, cors_origins="*")
    body = json.dumps(v2_json(X[:1])).encode()
    extra = ("origin: http://a.example",) if way == "asgi" else ()
    head, _, body = post(INFER, body, *extra).partition(b"\r\n\r\n")

    async def main() -> tuple[int, bytes]:
        async with raw_http(app) as (connect, _, _):
            reader, writer = await connect()
            writer.write(head + b"\r\n\r\n")
            await asyncio.sleep(0.05)  # the head read: the body's wait begun
            writer.write(body)  # sent at once (the socket takes it): in the server's buffer
            time.sleep(0.4)  # the loop held past the deadline, as a stall holds it
            status, _, answer = await asyncio.wait_for(read_answer(reader), 5)
            writer.close()
            return status, answer

    status, answer = run(main())
    assert status == 200, answer
    np.testing.assert_array_equal(v2_logits(answer), expected_logits(X[:1]))


@pytest.mark.parametrize("deadline", ["server's", "client's"])
def test_a_body_stalled_over_http_is_answered_at_the_deadline_and_the_connection_closed(
    tmp_path: Path, deadline: str
) -> None:
    servers = deadline == "server's"
    app, _ = make_app(tmp_path, timeout_ms=50 if servers else 10_000)
    part = b'{"inputs": ['
    timeout = [] if servers else ["x-request-timeout-ms: 50"]

    async def main() -> tuple[Exchange, str]:
        async with raw_http(app) as (connect, _, client):
            head = post(INFER, b"", *timeout).replace(b"length: 0", b"length: 5000")
            answered = await exchange(connect, head, part)
            return answered, (await client.get("/metrics")).text

    (status, headers, body, rest), text = run(main())
    assert headers["connection"] == "close" and rest == b""
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    if servers:
        # the time it took: 0.05 s, a little more on a loaded machine
        assert status == 408 and re.match(
            r"request body incomplete after 0\.05\d* s \(12 bytes", error
        )
    else:
        assert status == 504 and error.startswith("deadline of 50 ms (x-request-timeout-ms)")
    rejections = {"body_timeout": 1 if servers else 0, "deadline": 0 if servers else 1}
    for reason, count in rejections.items():
        assert metric(text, f'lightship_rejections_total{{reason="{reason}"}}') == count
    route = f'route="/v2/models/{{model_name}}/infer",status="{status}"'
    assert metric(text, f"lightship_requests_total{{{route}}}") == 1


def test_a_client_leaving_over_http_is_dropped_from_the_queue_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The protocol sees the connection close: its queued request is abandoned then, not when
    the ASGI way in would have started watching (`_DisconnectWatch`, turned off here)."""
    monkeypatch.setattr(serve_app._DisconnectWatch, "WATCH_AFTER_S", 3600)
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0)
    assert gate is not None
    gate.open.set()
    marked = np.full((1, 1, 2, 2), 77, np.uint8)

    async def main() -> str:
        async with raw_http(app) as (connect, _, client):
            held = await hold_inference(client, gate)
            _, writer = await connect()
            writer.write(post(INFER, json.dumps(v2_json(marked)).encode()))
            while service(app).batcher.queued_rows < 1:
                await asyncio.sleep(0.001)
            writer.close()  # the client goes away while its request waits for the model
            await until_rejected(client, "disconnected")
            gate.open.set()
            np.testing.assert_array_equal(logits_of(await held), expected_logits(HELD))
            r = await client.post(INFER, json=v2_json(X))  # the server carries on
            np.testing.assert_array_equal(logits_of(r), expected_logits(X))
            return (await client.get("/metrics")).text

    text = run(main())
    assert metric(text, 'lightship_rejections_total{reason="disconnected"}') == 1
    route = 'route="/v2/models/{model_name}/infer",status="499"'
    assert metric(text, f"lightship_requests_total{{{route}}}") == 1
    assert not any((rows == 77).all() for batch in gate.rows for rows in batch)


def test_an_upload_whose_client_left_is_dropped_from_the_queue_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image route comes in through ASGI, whose watch starts late for the other routes
    (turned off here): an upload is watched from the start. It was computed and counted 200
    when its client left within 50 ms."""
    monkeypatch.setattr(serve_app._DisconnectWatch, "WATCH_AFTER_S", 3600)
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0)
    assert gate is not None
    gate.open.set()
    upload = httpx.Request(
        "POST", "http://t/", files=[("files", ("m.png", png(np.full((2, 2), 77, np.uint8))))]
    )
    form = upload.read()
    kind = f"content-type: {upload.headers['content-type']}"

    async def main() -> str:
        async with raw_http(app) as (connect, _, client):
            held = await hold_inference(client, gate)
            _, writer = await connect()
            writer.write(post("/v1/predict/image", form, kind))
            while service(app).batcher.queued_rows < 1:
                await asyncio.sleep(0.001)
            writer.close()  # the client goes away while its upload waits for the model
            await until_rejected(client, "disconnected")
            gate.open.set()
            await held
            return (await client.get("/metrics")).text

    text = run(main())
    assert metric(text, 'lightship_rejections_total{reason="disconnected"}') == 1
    route = 'route="/v1/predict/image",status='
    assert metric(text, f'lightship_requests_total{{{route}"499"}}') == 1
    assert f'{route}"200"' not in text
    assert not any((rows == 77).all() for batch in gate.rows for rows in batch)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("first", ["tensor", "upload"])
def test_a_client_leaving_with_a_request_pipelined_is_seen_leaving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str, loop: str
) -> None:
    """A second request pipelined behind the first stopped the server reading the connection
    (answered in order, the second waits), so the client's leaving went unseen: the first was
    computed for nobody and counted 200, the second started after it and dropped. The
    connection is still read: both are given up before compute, each counted 499."""
    monkeypatch.setattr(serve_app._DisconnectWatch, "WATCH_AFTER_S", 3600)
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0)
    assert gate is not None
    gate.open.set()
    if first == "tensor":
        path = INFER
        request = post(INFER, json.dumps(v2_json(np.full((1, 1, 2, 2), 77, np.uint8))).encode())
    else:
        path = "/v1/predict/image"
        upload = httpx.Request(
            "POST", "http://t/", files=[("files", ("m.png", png(np.full((2, 2), 77, np.uint8))))]
        )
        kind = f"content-type: {upload.headers['content-type']}"
        request = post(path, upload.read(), kind)
    behind = b"".join(  # two: the last one read is not the only one waiting
        post(INFER, json.dumps(v2_json(np.full((1, 1, 2, 2), v, np.uint8))).encode())
        for v in (78, 79)
    )

    async def main() -> str:
        async with raw_http(app) as (connect, _, client):
            held = await hold_inference(client, gate)
            _, writer = await connect()
            writer.write(request + behind)  # two pipelined behind the first
            while service(app).batcher.queued_rows < 1:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)  # the second read and queued behind it
            writer.close()  # the client goes away while its first request waits
            await until_rejected(client, "disconnected")
            gate.open.set()
            np.testing.assert_array_equal(logits_of(await held), expected_logits(HELD))
            await asyncio.sleep(0.1)  # a second request started after the first would be seen
            return (await client.get("/metrics")).text

    text = run(main(), loop)
    # each one a client gone while it waited: the first in the queue, the two behind it to be
    # parsed (the two counted 499 alone before)
    assert metric(text, 'lightship_rejections_total{reason="disconnected"}') == 3
    infer = 'route="/v2/models/{model_name}/infer",status='
    route = infer if first == "tensor" else f'route="{path}",status='
    # each counted 499 where it was sent: the second, never started, too
    sent = [route, infer, infer]
    for counted in (route, infer):
        assert metric(text, f'lightship_requests_total{{{counted}"499"}}') == sent.count(counted)
    if first == "tensor":  # HELD's alone
        assert metric(text, f'lightship_requests_total{{{route}"200"}}') == 1
    else:
        assert f'{route}"200"' not in text
    assert not any(np.isin(rows, (77, 78, 79)).all() for batch in gate.rows for rows in batch)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("route", ["tensor", "upload"])
def test_an_answer_made_after_its_client_left_is_counted_as_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str, loop: str
) -> None:
    """A client that leaves as its batch finishes (the answer made before the leave was seen,
    so too late to abandon it: here the queue is never told) gets nothing. That answer was
    counted 200; it is a 499 and a `disconnected`, as a leave seen first is. On either way in:
    the server's own protocol, and ASGI (an upload)."""
    from lightship.serve.protocol import _TensorCycle

    monkeypatch.setattr(_TensorCycle, "watch", lambda self, ticket: lambda: None)
    monkeypatch.setattr(
        serve_app, "asgi_watch", lambda receive, after_s=None: lambda t: lambda: None
    )
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0)
    assert gate is not None
    gate.open.set()
    if route == "tensor":
        path, request = INFER, post(INFER, json.dumps(v2_json(HELD)).encode())
    else:
        path = "/v1/predict/image"
        upload = httpx.Request("POST", "http://t/", files=[("files", ("h.png", png(HELD[0, 0])))])
        kind = f"content-type: {upload.headers['content-type']}"
        request = post(path, upload.read(), kind)

    async def main() -> tuple[bytes, str]:
        async with raw_http(app) as (connect, _, client):
            gate.open.clear()
            gate.entered.clear()
            reader, writer = await connect()
            writer.write(request)
            await asyncio.to_thread(gate.entered.wait, 10)  # its batch runs
            writer.close()  # and its client leaves
            await asyncio.sleep(0.1)  # seen leaving
            gate.open.set()
            await asyncio.sleep(0.1)  # the answer made, and written to no one
            text = (await client.get("/metrics")).text
            return await reader.read(), text

    got, text = run(main(), loop)
    assert got == b""
    counted = (
        'route="/v2/models/{model_name}/infer",status='
        if route == "tensor"
        else (f'route="{path}",status=')
    )
    assert metric(text, f'lightship_requests_total{{{counted}"499"}}') == 1
    assert f'{counted}"200"' not in text
    assert metric(text, 'lightship_rejections_total{reason="disconnected"}') == 1
    assert metric(text, "lightship_batch_rows_count") == 1  # computed: the leave came too late


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_get_whose_client_left_counts_as_answered_only_where_it_was(
    tmp_path: Path, loop: str
) -> None:
    """A GET sent with a FIN after it: its answer, made as it was parsed, waited for the end of
    the turn's one write, and the FIN read meanwhile (uvloop) closed the connection first: the
    client got nothing, counted 200. What the turn holds is written as the FIN is read, and an
    answer made after it counts 499: the count says what the client got."""
    app, _ = make_app(tmp_path)
    path = "/v2/health/ready"

    async def main() -> tuple[list[bytes], str]:
        async with raw_http(app) as (connect, _, client):
            got = []
            for _ in range(10):
                reader, writer = await connect()
                writer.write(f"GET {path} HTTP/1.1\r\nhost: t\r\n\r\n".encode())
                writer.write_eof()
                got.append(await reader.read())
                writer.close()
            await asyncio.sleep(0.05)
            return got, (await client.get("/metrics")).text

    got, text = run(main(), loop)

    def count(name: str) -> float:
        return metric(text, name) if f"{name} " in text else 0

    answered = sum(g.startswith(b"HTTP/1.1 200") for g in got)
    assert answered + got.count(b"") == len(got)
    route = f'route="{path}",status='
    assert count(f'lightship_requests_total{{{route}"200"}}') == answered
    assert count(f'lightship_requests_total{{{route}"499"}}') == len(got) - answered
    assert count('lightship_rejections_total{reason="disconnected"}') == len(got) - answered


def test_pipelined_requests_over_http_are_answered_in_order(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)
    binary, binary_headers = v2_binary(X[::-1])
    (length,) = binary_headers.values()
    requests = [
        post(INFER, json.dumps(v2_json(X)).encode()),
        b"GET /v2/health/ready HTTP/1.1\r\nhost: t\r\n\r\n",
        post(INFER, binary, f"inference-header-content-length: {length}"),
        post("/v1/predict", json.dumps({"instances": X[:1].tolist()}).encode()),
        post(INFER, b"{}"),
    ]

    async def main() -> list[tuple[int, dict[str, str], bytes]]:
        async with raw_http(app) as (connect, _, _):
            reader, writer = await connect()
            writer.write(b"".join(requests))  # all at once, on one connection
            answers = [await asyncio.wait_for(read_answer(reader), 5) for _ in requests]
            writer.close()
            return answers

    answers = run(main())
    assert [status for status, _, _ in answers] == [200, 200, 200, 200, 400]
    assert json.loads(answers[0][2])["outputs"][0]["data"] == [10, 90, 1020, -920]
    assert answers[1][2] == b'{"ready":true}'
    n = int(answers[2][1]["inference-header-content-length"])
    np.testing.assert_array_equal(
        np.frombuffer(answers[2][2][n:], np.float32).reshape(2, 2), expected_logits(X[::-1])
    )
    assert json.loads(answers[3][2])["predictions"][0]["label"] == "dark"
    assert 'no "inputs" list' in json.loads(answers[4][2])["error"]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_requests_pipelined_in_pieces_while_one_runs_are_answered_in_order(
    tmp_path: Path, loop: str
) -> None:
    """What arrives while a pipelined request waits is kept and parsed once the one ahead is
    answered, in the order sent, the socket paused past READ_AHEAD_BYTES kept (a padded body
    of 3x that here) and read on after."""
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0)
    assert gate is not None
    gate.open.set()
    second = post(INFER, json.dumps(v2_json(X[::-1])).encode())
    padded = json.dumps(v2_json(X[:1])).encode() + b" " * (3 * READ_AHEAD_BYTES)
    third = post(INFER, padded)

    async def main() -> list[tuple[int, dict[str, str], bytes]]:
        async with raw_http(app) as (connect, _, client):
            held = await hold_inference(client, gate)  # the first batch waits in the gate
            reader, writer = await connect()
            writer.write(post(INFER, json.dumps(v2_json(X)).encode()) + second[:30])
            while service(app).batcher.queued_rows < 2:
                await asyncio.sleep(0.001)
            writer.write(second[30:] + third[:-10])  # read on while the first waits
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(third[-10:])
            await asyncio.sleep(0.05)
            gate.open.set()
            await held
            answers = [await asyncio.wait_for(read_answer(reader), 5) for _ in range(3)]
            writer.close()
            return answers

    answers = run(main(), loop)
    assert [status for status, _, _ in answers] == [200, 200, 200]
    for (_, _, body), x in zip(answers, [X, X[::-1], X[:1]], strict=True):
        np.testing.assert_array_equal(v2_logits(body), expected_logits(x))


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_long_body_pipelined_behind_a_waiting_request_is_read_whole(
    tmp_path: Path, loop: str
) -> None:
    """A tensor body of 1 MiB pipelined behind a request waiting for the model: its first
    bytes are kept and the socket paused; once the first is answered, the rest is read, and
    so is a request sent after both on the same connection. On uvloop, which reads a resumed
    socket before the turn's callbacks, the socket stayed paused: the body never came whole
    (408 after the deadline) or, kept whole, the next request was never read (a reset)."""
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0, timeout_ms=3000)
    assert gate is not None
    gate.open.set()
    first = post(INFER, json.dumps(v2_json(X)).encode())
    padded = json.dumps(v2_json(X[:1])).encode() + b" " * (1 << 20)
    second = post(INFER, padded)

    async def main() -> list[tuple[int, dict[str, str], bytes]]:
        async with raw_http(app) as (connect, _, client):
            held = await hold_inference(client, gate)
            reader, writer = await connect()
            writer.write(first + second[:200])  # the second's head read while the first waits
            while service(app).batcher.queued_rows < 2:
                await asyncio.sleep(0.001)
            writer.write(second[200:])
            await asyncio.sleep(0.2)  # READ_AHEAD_BYTES kept, the socket paused
            gate.open.set()
            await held
            answers = [await asyncio.wait_for(read_answer(reader), 5) for _ in range(2)]
            writer.write(first)  # and the connection reads on
            answers.append(await asyncio.wait_for(read_answer(reader), 5))
            writer.close()
            return answers

    answers = run(main(), loop)
    assert [status for status, _, _ in answers] == [200, 200, 200]
    for (_, _, body), x in zip(answers, [X, X[:1], X], strict=True):
        np.testing.assert_array_equal(v2_logits(body), expected_logits(x))


def test_get_requests_pipelined_behind_a_client_that_left_are_not_run(tmp_path: Path) -> None:
    """Requests to the ASGI app pipelined behind a client that left are not run, as uvicorn
    drops them: started at once for nobody, hundreds from one write ran the app in one turn of
    the loop (250 KB of GET /metrics held a probe for 4.8 s) and were counted 200. Dropped
    without a count, they were in no metric at all: each counts 499, `disconnected`."""
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0)
    assert gate is not None
    gate.open.set()
    probes = b"GET /v2/health/ready HTTP/1.1\r\nhost: t\r\n\r\n" * 100

    async def main() -> str:
        async with raw_http(app) as (connect, _, client):
            held = await hold_inference(client, gate)
            _, writer = await connect()
            writer.write(post(INFER, json.dumps(v2_json(X)).encode()) + probes)
            while service(app).batcher.queued_rows < 1:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)  # the probes read and queued behind it
            writer.close()
            await until_rejected(client, "disconnected")
            gate.open.set()
            await held
            await asyncio.sleep(0.1)
            return (await client.get("/metrics")).text

    text = run(main())
    # each one a request given up, counted where it was sent; none run (in no time)
    assert metric(text, 'lightship_rejections_total{reason="disconnected"}') == 101
    ready = 'route="/v2/health/ready",'
    assert metric(text, f'lightship_requests_total{{{ready}status="499"}}') == 100
    assert f'{ready}status="200"' not in text
    assert metric(text, f'lightship_request_duration_seconds_sum{{{ready}status_class="4xx"}}') == 0


@pytest.mark.parametrize("third", ["whole", "body arriving"])
def test_a_request_read_during_the_drain_is_answered_and_closes_the_connection(
    tmp_path: Path, third: str
) -> None:
    """At SIGTERM the request under way is marked to close its connection; one read behind it
    during the drain takes the mark over, and is answered: it was read, then dropped with the
    close (not counted 499: its client had not left). With its body still arriving, it is
    answered 503 when the drain stops bodies, as any body still arriving is."""
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0)
    assert gate is not None
    gate.open.set()
    body = json.dumps(v2_json(X[:1])).encode()

    async def main() -> tuple[list[Any], str]:
        # a drain of 7 s stops bodies still arriving 1 s after it begins (LINGER_S 5, 1 s kept)
        async with raw_http(app, timeout_graceful_shutdown=7) as (connect, counting, client):
            held = await hold_inference(client, gate)
            reader, writer = await connect()
            writer.write(post(INFER, body) + post(INFER, body))
            while service(app).batcher.queued_rows < 1:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)
            rest = post(INFER, body)  # a third, kept while the first two are pending
            writer.write(rest if third == "whole" else rest[:-5])
            await asyncio.sleep(0.05)
            sigterm_for(counting, writer)
            gate.open.set()
            await held
            answers = [await asyncio.wait_for(read_answer(reader), 5) for _ in range(3)]
            left = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            await asyncio.sleep(0.1)
            got = [(status, headers.get("connection")) for status, headers, _ in answers]
            return [*got, left], (await client.get("/metrics")).text

    answers, text = run(main())
    last = (200, "close") if third == "whole" else (503, "close")
    assert answers == [(200, None), (200, None), last, b""]
    infer = 'lightship_requests_total{route="/v2/models/{model_name}/infer",status='
    assert metric(text, f'{infer}"200"}}') == (4 if third == "whole" else 3)
    assert f'{infer}"499"}}' not in text


async def one_queued(
    app: FastAPI,
    connect: Callable[[], Awaitable[Any]],
    client: httpx.AsyncClient,
    gate: Gate,
    request: bytes,
) -> tuple[asyncio.Future[httpx.Response], asyncio.StreamReader, asyncio.StreamWriter]:
    """The inference thread held in the gate, and `request` sent on a new connection and
    queued behind it: the held request, and the connection's reader and writer."""
    held = await hold_inference(client, gate)
    reader, writer = await connect()
    writer.write(request)
    while service(app).batcher.queued_rows < 1:
        await asyncio.sleep(0.001)
    return held, reader, writer


def sigterm_for(counting: CountingApp, writer: asyncio.StreamWriter) -> None:
    """What `_Server.handle_exit` does at SIGTERM, to the one connection `writer` is on."""
    port = writer.get_extra_info("sockname")[1]
    for connection in list(counting.connections):
        if connection.client[1] == port:
            connection.shutdown()


def sigterm_here(counting: CountingApp) -> None:
    """What `_Server.handle_exit` does to the connections at SIGTERM, on `over_http`'s."""
    state = next(iter(counting.connections)).server_state
    state.stopping = True
    serve_app._Server._close_after_answers(SimpleNamespace(server_state=state))  # type: ignore[arg-type]


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("origin", [False, True], ids=["protocol", "asgi"])
def test_a_request_pipelined_around_sigterm_is_answered_and_the_last_closes(
    tmp_path: Path, after: bool, origin: bool
) -> None:
    """SIGTERM marks the request under way to close its connection. One pipelined behind it
    after the signal was read, then lost when that answer closed the connection: the close
    passes on to the last request read."""
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0, cors_origins="*")
    assert gate is not None
    gate.open.set()
    extra = ("origin: http://a.example",) if origin else ()  # through ASGI (CORS)
    request = post(INFER, json.dumps(v2_json(X[:1])).encode(), *extra)

    async def main() -> list[tuple[int, str | None]]:
        async with raw_http(app) as (connect, counting, client):
            held, reader, writer = await one_queued(app, connect, client, gate, request)
            if after:
                sigterm_here(counting)
            writer.write(request)  # pipelined behind the queued one
            await asyncio.sleep(0.05)
            if not after:
                sigterm_here(counting)
            gate.open.set()
            await held
            answers = [await asyncio.wait_for(read_answer(reader), 5) for _ in range(2)]
            writer.close()
            return [(status, headers.get("connection")) for status, headers, _ in answers]

    assert run(main()) == [(200, None), (200, "close")]


@pytest.mark.parametrize("origin", [False, True], ids=["protocol", "asgi"])
def test_a_pipelined_requests_latency_counts_from_when_it_was_read(
    tmp_path: Path, origin: bool
) -> None:
    """A request read behind another on its connection waits for that one's answer before its
    task starts: its latency counted from then left out the wait (0.4 s here counted ~1 ms).
    Both ways in: the tensor route answered by the protocol, and through ASGI (CORS)."""
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0, cors_origins="*")
    assert gate is not None
    gate.open.set()
    extra = ("origin: http://a.example",) if origin else ()
    request = post(INFER, json.dumps(v2_json(X[:1])).encode(), *extra)

    async def main() -> str:
        async with raw_http(app) as (connect, _, client):
            held, reader, writer = await one_queued(app, connect, client, gate, request)
            writer.write(request)  # pipelined behind the queued one
            await asyncio.sleep(0.4)
            gate.open.set()
            await held
            for _ in range(2):
                status, _, _ = await asyncio.wait_for(read_answer(reader), 5)
                assert status == 200
            writer.close()
            return (await client.get("/metrics")).text

    text = run(main())
    infer = 'route="/v2/models/{model_name}/infer",status_class="2xx"'
    # three answered: the one holding the model, the one queued, the one pipelined behind it
    assert metric(text, f"lightship_request_duration_seconds_count{{{infer}}}") == 3
    # each waited the 0.4 s the model was held
    assert metric(text, f'lightship_request_duration_seconds_bucket{{le="0.25",{infer}}}') == 0


def test_a_client_pipelining_through_the_drain_is_closed_after_a_bound(tmp_path: Path) -> None:
    """Each request read took over the close from the one before: a client that kept two in
    flight was answered kept-alive to the end of the drain, and its request under way then
    cancelled unanswered. The close is taken back MAX_PIPELINED times at most."""
    from lightship.serve.protocol import MAX_PIPELINED

    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0)
    assert gate is not None
    gate.open.set()
    request = post(INFER, json.dumps(v2_json(X[:1])).encode())

    async def main() -> tuple[list[tuple[int, str | None]], bytes]:
        async with raw_http(app) as (connect, counting, client):
            held = await hold_inference(client, gate)
            reader, writer = await connect()
            writer.write(request * 3)
            while service(app).batcher.queued_rows < 1:
                await asyncio.sleep(0.001)
            sigterm_here(counting)
            gate.open.set()
            await held
            seen = []
            for _ in range(MAX_PIPELINED + 10):
                status, headers, _ = await asyncio.wait_for(read_answer(reader), 5)
                seen.append((status, headers.get("connection")))
                if headers.get("connection") == "close":
                    break
                writer.write(request)  # one more, keeping the pipeline full
            left = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return seen, left

    seen, left = run(main())
    assert seen[-1] == (200, "close") and len(seen) <= MAX_PIPELINED + 3, len(seen)
    assert {status for status, _ in seen} == {200} and left == b""


def test_an_answer_that_closes_with_a_request_pipelined_behind_it_unread_is_not_reset(
    tmp_path: Path,
) -> None:
    """The answer that closes the connection as the server stops, requests pipelined behind
    it partly unread (in the kernel's buffer): closed at once, the kernel reset the
    connection, and a client that had not yet read that answer could lose it (CI: about one
    run in six of the drain test above). Closed lingering: a FIN after the answer."""
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0)
    assert gate is not None
    gate.open.set()
    first = post(INFER, json.dumps(v2_json(X[:1])).encode())
    # one read whole, then one past what the server reads ahead of requests it has not begun
    # to answer (the rest in the kernel's buffer)
    behind = [first, post(INFER, b" " * 1_000_000, "content-type: application/json")]

    async def main() -> tuple[list[tuple[int, dict[str, str], bytes]], bytes]:
        # a drain of 5 s stops bodies at once (LINGER_S 5): the close stays on the first
        async with raw_http(app, timeout_graceful_shutdown=5) as (connect, counting, client):
            held, reader, writer = await one_queued(app, connect, client, gate, first)
            sigterm_for(counting, writer)
            for data in behind:  # read apart: the second held back, not parsed
                writer.write(data)
                await asyncio.sleep(0.2)
            gate.open.set()
            await held
            answers = [await asyncio.wait_for(read_answer(reader), 5)]
            try:
                rest = await asyncio.wait_for(reader.read(), 10)
            except ConnectionResetError:
                rest = b"reset"
            writer.close()
            return answers, rest

    [(status, headers, answer)], rest = run(main())
    assert (status, headers.get("connection")) == (200, "close"), answer
    np.testing.assert_array_equal(v2_logits(answer), expected_logits(X[:1]))
    assert rest == b"", rest[:200]


def test_a_streamed_answer_under_way_at_sigterm_leaves_no_request_behind_it_unanswered() -> None:
    """Its head had gone out saying keep-alive when SIGTERM marked it to close, so the close
    stayed on it: a request read behind it was dropped when it closed the connection."""
    import uvicorn
    from uvicorn.server import ServerState

    from lightship.serve.protocol import http_protocol

    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        start = {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", b"4")],
        }
        await send(start)
        if scope["path"] == "/stream":
            await release.wait()
        await send({"type": "http.response.body", "body": b"done"})

    async def main() -> tuple[bytes, bytes]:
        config = uvicorn.Config(
            app, http=http_protocol(None), lifespan="off", log_level="warning", access_log=False
        )
        config.load()
        state = ServerState()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: config.http_protocol_class(config=config, server_state=state, app_state={}),  # type: ignore[call-arg]
            "127.0.0.1",
            0,
        )
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", server.sockets[0].getsockname()[1]
            )
            writer.write(b"GET /stream HTTP/1.1\r\nhost: t\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)  # kept alive
            state.stopping = True  # type: ignore[attr-defined]  # SIGTERM
            serve_app._Server._close_after_answers(SimpleNamespace(server_state=state))  # type: ignore[arg-type]
            writer.write(b"GET /fast HTTP/1.1\r\nhost: t\r\n\r\n")
            await asyncio.sleep(0.1)
            release.set()
            rest = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return head, rest
        finally:
            server.close()
            for connection in list(state.connections):
                connection.shutdown()

    head, rest = run(main())
    assert b"connection: close" not in head.lower()
    # the stream's body, then /fast's answer, which closes
    assert rest.startswith(b"done") and rest.count(b"HTTP/1.1 200") == 1, rest
    assert b"connection: close" in rest.lower() and rest.endswith(b"done")


def test_a_head_refused_behind_the_request_sigterm_marked_is_answered(tmp_path: Path) -> None:
    """Its 400 waits for the answer ahead of it, which the server had marked to close: the
    connection closed with it, and the 400 never went out."""
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0)
    assert gate is not None
    gate.open.set()
    request = post(INFER, json.dumps(v2_json(X[:1])).encode())

    async def main() -> bytes:
        async with raw_http(app) as (connect, counting, client):
            held, reader, writer = await one_queued(app, connect, client, gate, request)
            sigterm_here(counting)
            writer.write(b"GET /v2/health/live HTTP/1.1\r\n\r\n")  # no Host: a 400
            await asyncio.sleep(0.05)
            gate.open.set()
            await held
            data = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return data

    data = run(main())
    first, _, second = data.partition(b"HTTP/1.1 400 Bad Request")
    assert first.startswith(b"HTTP/1.1 200 OK") and b"connection: close" not in first.lower()
    assert b"connection: close" in second.lower() and b"Host" in second


@pytest.mark.parametrize("expect", [False, True], ids=["", "expect-100"])
def test_a_body_still_arriving_queued_through_asgi_gets_the_drains_503(
    tmp_path: Path, expect: bool
) -> None:
    """Queued behind another answer when the drain stopped bodies, its BodyLimit had not begun
    to be told: it waited for its body to the drain's end, then was cancelled unanswered. (The
    tensor routes' own way in was stopped as it began.) No 100 Continue comes before it."""
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0, cors_origins="*")
    assert gate is not None
    gate.open.set()
    body = json.dumps(v2_json(X[:1])).encode()

    async def main() -> list[tuple[int, str | None]]:
        # a drain of 7 s stops bodies still arriving 1 s after it begins (LINGER_S 5, 1 s kept)
        async with raw_http(app, timeout_graceful_shutdown=7) as (connect, counting, client):
            held, reader, writer = await one_queued(app, connect, client, gate, post(INFER, body))
            extra = ("expect: 100-continue",) if expect else ()
            writer.write(post(INFER, body, "origin: http://a.example", *extra)[:-5])  # ASGI
            await asyncio.sleep(0.05)
            sigterm_for(counting, writer)
            await asyncio.sleep(1.5)  # past the body stop, the second still queued
            gate.open.set()
            await held
            answers = [await asyncio.wait_for(read_answer(reader), 3) for _ in range(2)]
            writer.close()
            return [(status, headers.get("connection")) for status, headers, _ in answers]

    assert run(main()) == [(200, None), (503, "close")]


# 1.5 MB an answer: a few fill the socket's buffers of a client that reads slowly or not at all
DOCS_BUNDLE = b"GET /docs/swagger-ui-bundle.js HTTP/1.1\r\nhost: t\r\n\r\n"


async def unread_answers(
    counting: CountingApp, client: httpx.AsyncClient, requests: int, data: bytes = DOCS_BUNDLE
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Any]:
    """A connection with a small receive buffer that sent `requests` requests (`data` each,
    DOCS_BUNDLE's by default): its reader and writer, and the server's protocol of it once its
    writes are paused."""
    before = set(counting.connections)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = str(client.base_url).removeprefix("http://").rstrip("/").split(":")
    sock.connect((host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(data * requests)
    while not (mine := set(counting.connections) - before):
        await asyncio.sleep(0.01)
    (connection,) = mine
    while not connection.flow.write_paused:
        await asyncio.sleep(0.01)
    return reader, writer, connection


async def until_closed(counting: CountingApp, connection: Any, seconds: float) -> float:
    """Seconds until the server's protocol of `connection` is gone, `seconds` at most."""
    start = time.monotonic()
    while connection in counting.connections and time.monotonic() - start < seconds:
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def test_a_client_that_reads_none_of_its_answers_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its answers waited for it without end: the connection, and every answer queued on it,
    held for good (50 such: 720 MB)."""
    from lightship.serve import protocol

    monkeypatch.setattr(protocol, "WRITE_TIMEOUT_S", 0.5)
    app, _ = make_app(tmp_path)

    async def main() -> tuple[float, str]:
        async with raw_http(app) as (_, counting, client):
            _, writer, connection = await unread_answers(counting, client, 20)  # never read
            took = await until_closed(counting, connection, 10)
            writer.close()
            return took, (await client.get("/metrics")).text

    took, text = run(main())
    assert took < 5, took
    assert metric(text, 'lightship_rejections_total{reason="write_timeout"}') == 1
    # Every request it sent is counted: 200 for an answer handed to the socket, 499 and
    # `disconnected` for those the drop left unanswered (counted nowhere, 18 of 20)
    by_status = {
        status: metric(
            text, f'lightship_requests_total{{route="/docs/{{name}}",status="{status}"}}'
        )
        for status in ("200", "499")
    }
    assert sum(by_status.values()) == 20 and by_status["499"] > 0, by_status
    assert metric(text, 'lightship_rejections_total{reason="disconnected"}') == by_status["499"]


def test_a_tensor_answer_a_write_timeout_drop_kept_from_the_socket_counts_499(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer made while the client's socket was full waits for it to drain; the drop
    (`stalled`) ends that wait unsent, and the request was counted 200, as for an answer the
    server itself closed on. It counts 499 and `disconnected`, as its pipelined ones do."""
    from lightship.serve import protocol

    monkeypatch.setattr(protocol, "WRITE_TIMEOUT_S", 0.5)
    undelivered = protocol._TensorCycle._undelivered
    counted: list[int] = []  # the status of each answer made and not handed to the socket

    def recording(self: Any) -> int:
        counted.append(undelivered(self))
        return counted[-1]

    monkeypatch.setattr(protocol._TensorCycle, "_undelivered", recording)
    rows = 40_000  # ~1.6 MB an answer: the socket's buffers fill after a few
    app, _ = make_app(tmp_path, max_batch_rows=rows, max_queue_rows=2 * rows)
    body = json.dumps(v2_json(np.full((rows, 1, 2, 2), 7, np.uint8))).encode()
    head = f"POST {INFER} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
    post = f"{head}content-length: {len(body)}\r\n\r\n".encode() + body

    async def main() -> str:
        async with raw_http(app) as (_, counting, client):
            _, writer, connection = await unread_answers(counting, client, 8, post)  # never read
            await until_closed(counting, connection, 10)
            writer.close()
            return (await client.get("/metrics")).text

    text = run(main())
    assert counted and set(counted) == {499}, counted
    assert metric(text, 'lightship_rejections_total{reason="write_timeout"}') == 1
    infer = 'lightship_requests_total{route="/v2/models/{model_name}/infer",status="499"}'
    assert metric(text, infer) >= len(counted)


def test_a_client_not_reading_at_sigterm_is_dropped_before_the_drain_ends(
    tmp_path: Path,
) -> None:
    """Its answer waited out the drain, and uvicorn then cancelled it, with a traceback in the
    log: it is dropped a second before the drain ends."""
    app, _ = make_app(tmp_path)

    async def main() -> tuple[float, str]:
        async with raw_http(app, timeout_graceful_shutdown=3) as (_, counting, client):
            _, writer, connection = await unread_answers(counting, client, 20)  # never read
            connection.shutdown()  # SIGTERM, for this connection: 3 s of drain
            took = await until_closed(counting, connection, 10)
            writer.close()
            return took, (await client.get("/metrics")).text

    took, text = run(main())
    assert 1.5 < took < 3.5, took  # a second before the drain's end, not WRITE_TIMEOUT_S
    assert metric(text, 'lightship_rejections_total{reason="write_timeout"}') == 1


def test_a_client_reading_slowly_at_sigterm_gets_its_answers(tmp_path: Path) -> None:
    """Dropped when a body still arriving is answered 503 (1 s into a 7 s drain), it lost
    answers it was reading (~5 s of them here): it has until a second before the drain ends."""
    app, _ = make_app(tmp_path)

    async def main() -> tuple[int, str]:
        async with raw_http(app, timeout_graceful_shutdown=7) as (_, counting, client):
            reader, writer, connection = await unread_answers(counting, client, 2)
            connection.shutdown()  # SIGTERM, for this connection: 7 s of drain
            got = 0
            while chunk := await asyncio.wait_for(reader.read(65536), 5):
                got += len(chunk)
                await asyncio.sleep(0.1)  # slow, never stopped: seconds in all
            writer.close()
            return got, (await client.get("/metrics")).text

    got, text = run(main())
    assert got > 2 * 1_526_593  # both answers whole (the file and its head), then the close
    assert metric(text, 'lightship_rejections_total{reason="write_timeout"}') == 0


def read_answers(sock: socket.socket, answers: int) -> list[int]:
    """The statuses of `answers` HTTP answers read off a blocking socket (fewer where it ends
    first)."""
    data = b""
    statuses: list[int] = []
    with suppress(OSError):  # a reset: the server dropped the connection
        while len(statuses) < answers:
            head, found, rest = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", head) if found else None
            if length and len(rest) >= int(length[1]):
                statuses.append(int(head.split()[1]))
                data = rest[int(length[1]) :]
            elif chunk := sock.recv(1 << 20):
                data += chunk
            else:
                break
    return statuses


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("timer", ["write timeout", "drain's end"])
def test_a_client_that_reads_its_answers_as_a_stall_hides_it_keeps_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, timer: str, loop: str
) -> None:
    """A client that had read none of its answers read them as the event loop stalled, as the
    write timeout (or the drain's end after SIGTERM) came due: uvloop ran the timer before it
    polled the socket, took the client for one that reads nothing and dropped it. The timers
    look once more first."""
    from lightship.serve import protocol

    monkeypatch.setattr(protocol, "WRITE_TIMEOUT_S", 1.0 if timer == "write timeout" else 30.0)
    # The write timeout: a second answer waits for the first to drain. The drain's end: the
    # first's rest unsent (a second, written after it, would be unsent at the drain's end too)
    requests = 2 if timer == "write timeout" else 1
    app, _ = make_app(tmp_path)

    async def main() -> tuple[list[int], str]:
        async with raw_http(app, timeout_graceful_shutdown=3) as (_, counting, client):
            host, port = str(client.base_url).removeprefix("http://").rstrip("/").split(":")
            sock = socket.socket()  # blocking, read by a thread: not by this loop
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            sock.settimeout(10)
            while not counting.connections:
                await asyncio.sleep(0.01)
            (connection,) = counting.connections
            # The kernel takes 1 MiB of the first answer (1.5 MB), and the rest waits in the
            # server: paused, yet all sent in the one write after the client reads
            server_sock = connection.transport.get_extra_info("socket")
            server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 512 * 1024)
            if server_sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < 1024 * 1024:
                pytest.skip("this kernel caps a socket's send buffer below 1 MiB (wmem_max)")
            sock.sendall(DOCS_BUNDLE * requests)
            while not connection.flow.write_paused:
                await asyncio.sleep(0.01)
            unsent = connection.transport.get_write_buffer_size()
            assert unsent < 1_526_593 - unsent, "the kernel took less than the rest: see above"
            due = 1.0  # WRITE_TIMEOUT_S, or the drain's end 1 s before its 2 s
            if timer == "drain's end":
                connection.shutdown()  # SIGTERM, for this connection
                due = 2.0
            await asyncio.sleep(due - 0.3)
            reading: list[list[int]] = []
            reader = threading.Thread(target=lambda: reading.append(read_answers(sock, requests)))
            await in_a_stall(reader.start)  # the timer comes due in it
            await asyncio.to_thread(reader.join, 10)
            sock.close()
            return reading[0], (await client.get("/metrics")).text

    statuses, text = run(main(), loop)
    assert statuses == [200] * requests
    assert metric(text, 'lightship_rejections_total{reason="write_timeout"}') == 0


@pytest.mark.parametrize("expect", ["", "expect: 100-continue\r\n"])
def test_a_connection_answered_before_its_body_ended_closes_when_idle(
    tmp_path: Path, expect: str
) -> None:
    """A 404 sent before the body came: the body's reads stopped the keep-alive timer its
    answer armed, and the connection stayed open for good; 185 of them took every file
    descriptor, and the server accepted no one."""
    app, _ = make_app(tmp_path)
    head = f"POST /nope HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\n{expect}\r\n"

    async def main() -> tuple[int, bytes, float]:
        async with raw_http(app, timeout_keep_alive=1) as (connect, _, _client):
            reader, writer = await connect()
            writer.write(head.encode())
            status, _, _ = await asyncio.wait_for(read_answer(reader), 5)
            start = time.monotonic()
            await asyncio.sleep(0.2)
            writer.write(b"hello")  # the body, then nothing
            rest = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return status, rest, time.monotonic() - start

    status, rest, idle = run(main())
    assert status == 404
    assert rest == b"" and idle < 2.5  # closed at the keep-alive's second, not never


def test_a_request_read_with_the_late_body_before_it_runs_past_the_keep_alive(
    tmp_path: Path,
) -> None:
    """The timer the late body armed again was still armed for the request read in the same
    segment: it closed the connection under it at the keep-alive's second."""
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0)
    assert gate is not None
    gate.open.set()

    async def main() -> tuple[int, int]:
        async with raw_http(app, timeout_keep_alive=1) as (connect, _, client):
            reader, writer = await connect()
            writer.write(b"POST /nope HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\n\r\n")
            first, _, _ = await asyncio.wait_for(read_answer(reader), 5)
            held = await hold_inference(client, gate)  # the model busy past the keep-alive
            writer.write(b"hello" + post(INFER, json.dumps(v2_json(X)).encode()))
            await asyncio.sleep(1.6)
            gate.open.set()
            await held
            second, _, _ = await asyncio.wait_for(read_answer(reader), 5)
            writer.close()
            return first, second

    assert run(main()) == (404, 200)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_blank_line_after_a_request_leaves_the_connection_idle(tmp_path: Path, when: str) -> None:
    """A CRLF after a body (RFC 9112 2.2: some clients send one; a server ignores it) is no
    request begun: the idle connection closes quietly at its keep-alive, not answered 408 for
    an incomplete head at the request deadline and counted `head_timeout`."""
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0, timeout_ms=3000)
    assert gate is not None
    gate.open.set()

    async def main() -> tuple[int, bytes, float, str]:
        async with raw_http(app, timeout_keep_alive=1) as (connect, _, client):
            held = await hold_inference(client, gate)
            reader, writer = await connect()
            writer.write(post(INFER, json.dumps(v2_json(X)).encode()))
            while service(app).batcher.queued_rows < 1:
                await asyncio.sleep(0.001)
            if when == "before":
                await asyncio.sleep(0.05)
                writer.write(b"\r\n")  # in a segment of its own, while the request waits
                await asyncio.sleep(0.05)
            gate.open.set()
            await held
            status, _, _ = await asyncio.wait_for(read_answer(reader), 5)
            start = time.monotonic()
            if when == "after":
                writer.write(b"\r\n")
            rest = await asyncio.wait_for(reader.read(), 5)
            took = time.monotonic() - start
            writer.close()
            return status, rest, took, (await client.get("/metrics")).text

    status, rest, took, text = run(main())
    assert status == 200 and rest == b""  # closed, no 408
    assert took < 2.5  # at the keep-alive's second, not the request deadline's three
    assert metric(text, 'lightship_rejections_total{reason="head_timeout"}') == 0


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_body_in_the_sockets_buffer_when_the_drain_stops_bodies_is_read_first(
    tmp_path: Path, loop: str
) -> None:
    """The drain stops a body still arriving 1 s after SIGTERM (with a 7 s drain), answered
    503. After a stall, uvloop ran that stop before it read a body that had come whole: a
    request answered 503 where it could be answered. It looks once more first, as the
    connection's other timers do."""
    app, _ = make_app(tmp_path, timeout_ms=3000)
    request = post(INFER, json.dumps(v2_json(X)).encode(), "content-type: application/json")
    split = request.index(b"\r\n\r\n") + 10  # the head and 6 bytes of the body

    async def main() -> int:
        async with raw_http(app, timeout_graceful_shutdown=7) as (connect, counting, _):
            reader, writer = await connect()
            writer.write(request[:split])
            await asyncio.sleep(0.05)
            for connection in list(counting.connections):  # what SIGTERM does to each
                connection.shutdown()
            await asyncio.sleep(0.7)  # the stop comes due at 1 s, in the stall below
            await write_in_a_stall(writer, request[split:])
            status, _, _ = await asyncio.wait_for(read_answer(reader), 5)
            writer.close()
            return status

    assert run(main(), loop) == 200


def test_a_connection_holds_at_most_max_pipelined_requests_waiting(tmp_path: Path) -> None:
    """llhttp parses every request of a read: a client pipelining without reading its answers
    queued 182,000 requests in 3 s. Past MAX_PIPELINED waiting, the next is answered 429 after
    those ahead of it, and the connection closes; what followed it is not read."""
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0)
    assert gate is not None
    gate.open.set()
    probe = b"GET /v2/health/ready HTTP/1.1\r\nhost: t\r\n\r\n"

    async def main() -> tuple[list[tuple[int, dict[str, str], bytes]], bytes, str]:
        async with raw_http(app) as (connect, _, client):
            held = await hold_inference(client, gate)
            reader, writer = await connect()
            first = post(INFER, json.dumps(v2_json(X)).encode())
            writer.write(first + probe * (MAX_PIPELINED + 50))
            while service(app).batcher.queued_rows < 1:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)
            gate.open.set()
            await held
            answers = [
                await asyncio.wait_for(read_answer(reader), 5) for _ in range(MAX_PIPELINED + 2)
            ]
            rest = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return answers, rest, (await client.get("/metrics")).text

    answers, rest, text = run(main())
    assert [status for status, _, _ in answers] == [200] * (MAX_PIPELINED + 1) + [429]
    assert all(body == b'{"ready":true}' for _, _, body in answers[1:-1])
    assert "read answers before sending more" in json.loads(answers[-1][2])["error"]
    assert answers[-1][1]["connection"] == "close" and rest == b""
    assert metric(text, 'lightship_rejections_total{reason="pipeline_full"}') == 1
    ready = 'lightship_requests_total{route="/v2/health/ready",status="200"}'
    assert metric(text, ready) == MAX_PIPELINED


def test_a_head_begun_before_the_answer_is_not_cut_off_by_the_keep_alive_timer(
    tmp_path: Path,
) -> None:
    """The first bytes of a second request arrived before the first was answered: uvicorn then
    armed its keep-alive timer (for an idle connection) and closed the connection mid-head
    when it fired. A head under way has the head's own time (`_head_late`, a 408)."""
    app, gate = make_app(tmp_path, gate=True, max_wait_ms=0)
    assert gate is not None
    gate.open.set()
    second = post(INFER, json.dumps(v2_json(X[:1])).encode())

    async def main() -> list[tuple[int, dict[str, str], bytes]]:
        async with raw_http(app, timeout_keep_alive=1) as (connect, _, client):
            held = await hold_inference(client, gate)
            reader, writer = await connect()
            writer.write(post(INFER, json.dumps(v2_json(X)).encode()) + second[:20])
            while service(app).batcher.queued_rows < 1:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.1)  # the second's first bytes read
            gate.open.set()
            await held
            answers = [await asyncio.wait_for(read_answer(reader), 5)]
            await asyncio.sleep(1.5)  # past the keep-alive's second
            writer.write(second[20:])
            answers.append(await asyncio.wait_for(read_answer(reader), 5))
            writer.close()
            return answers

    answers = run(main())
    assert [status for status, _, _ in answers] == [200, 200]
    np.testing.assert_array_equal(v2_logits(answers[1][2]), expected_logits(X[:1]))


@pytest.mark.parametrize(
    ("version", "extra"), [("1.0", []), ("1.1", ["connection: close"])], ids=["1.0", "close"]
)
def test_http_1_0_and_connection_close_end_the_connection_after_the_answer(
    tmp_path: Path, version: str, extra: list[str]
) -> None:
    app, _ = make_app(tmp_path)

    async def main() -> Exchange:
        async with raw_http(app) as (connect, _, _):
            request = post(INFER, json.dumps(v2_json(X)).encode(), *extra, version=version)
            return await exchange(connect, request)

    status, headers, body, rest = run(main())
    assert status == 200 and headers["connection"] == "close" and rest == b""
    assert json.loads(body)["outputs"][0]["data"] == [10, 90, 1020, -920]


def test_expect_100_continue_over_http_is_answered_before_the_body(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)
    body = json.dumps(v2_json(X)).encode()

    async def main() -> tuple[bytes, int, bytes]:
        async with raw_http(app) as (connect, _, _):
            reader, writer = await connect()
            writer.write(post(INFER, body, "expect: 100-continue")[: -len(body)])  # head only
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.write(body)
            status, _, answer = await asyncio.wait_for(read_answer(reader), 5)
            writer.close()
            return interim, status, answer

    interim, status, answer = run(main())
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [10, 90, 1020, -920]


@pytest.mark.parametrize(
    ("path", "origin", "error"),
    [
        ("/v2/models/nope/infer", False, "unknown model 'nope': this server serves 'hand'"),
        ("/v2/models/nope/infer", True, "unknown model 'nope': this server serves 'hand'"),
        ("/v1/predict?top_k=x", False, "top_k must be a positive integer, got 'x'"),
        ("/v1/predict?top_k=x", True, "top_k must be a positive integer, got 'x'"),
        # the headers alone refuse these too
        (f"{INFER}|x-request-timeout-ms: abc", False, "x-request-timeout-ms must be a positive"),
        ("/v1/predict|x-request-timeout-ms: abc", True, "x-request-timeout-ms must be a positive"),
        (f"{INFER}|content-encoding: br", False, "Content-Encoding br is not supported: use gzip"),
        (
            "/v1/predict|content-encoding: br",
            True,
            "Content-Encoding br is not supported: use gzip",
        ),
    ],
    ids=[
        f"{what}{way}"
        for what in ("model", "top_k", "timeout", "encoding")
        for way in ("", "-asgi")
    ],
)
def test_expect_100_continue_to_a_path_refused_is_answered_at_once(
    tmp_path: Path, path: str, origin: bool, error: str
) -> None:
    """It got 100 Continue, then its 404 (or 400, 415) only after the body it was asked for.
    The path or a header alone says it: answered at once, both ways in, and the connection
    closes, the body never read."""
    app, _ = make_app(tmp_path, cors_origins="*")
    body = json.dumps(v2_json(X)).encode()
    path, *header = path.split("|")
    extra = (*header, *(("origin: http://a.example",) if origin else ()))  # ASGI (CORS)

    async def main() -> tuple[int, dict[str, str], bytes, bytes]:
        async with raw_http(app) as (connect, _, _):
            reader, writer = await connect()
            head = post(path, body, "expect: 100-continue", *extra)[: -len(body)]
            writer.write(head)
            status, headers, answer = await asyncio.wait_for(read_answer(reader), 5)
            writer.write(body)  # as a client may send it anyway: read and thrown away
            writer.write_eof()
            rest = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return status, headers, answer, rest

    status, headers, answer, rest = run(main())
    expected = 404 if "nope" in path else 415 if "Encoding" in error else 400
    assert (status, headers.get("connection")) == (expected, "close")
    assert json.loads(answer)["error"].startswith(error)
    assert rest == b""


def test_tensor_routes_over_http_are_in_the_access_log_when_it_is_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger("uvicorn.access"), "propagate", True)
    app, _ = make_app(tmp_path)

    async def main() -> None:
        async with raw_http(app, access_log=True, log_config=None, log_level=None) as (
            _,
            _,
            client,
        ):
            assert (await client.post(f"{INFER}?trace=1", json=v2_json(X))).status_code == 200
            assert (await client.post("/v2/models/other/infer", json=v2_json(X))).status_code == 404

    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        run(main())
    # formatted as `lightship serve` formats them (`LOG_CONFIG`): uvicorn's AccessFormatter,
    # which reads the record's arguments by position (four instead of five was a traceback for
    # each request), with the time in front
    config = serve_app.LOG_CONFIG["formatters"]["access"]
    formatter = serve_app.AccessLogFormatter(config["fmt"], use_colors=False)
    lines = [formatter.format(r) for r in caplog.records if r.name == "uvicorn.access"]
    assert any(
        re.fullmatch(
            r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO uvicorn\.access: 127\.0\.0\.1:\d+ - "
            r'"POST /v2/models/hand/infer\?trace=1 HTTP/1\.1" 200 OK',
            line,
        )
        for line in lines
    ), lines
    assert any(
        line.endswith('"POST /v2/models/other/infer HTTP/1.1" 404 Not Found') for line in lines
    )


def test_the_servers_log_lines_say_when_in_utc_to_the_millisecond(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TZ", "America/New_York")  # the machine's zone does not show
    time.tzset()
    try:
        record = logging.LogRecord(
            "lightship.serve.app", logging.WARNING, __file__, 1, "ready: %s", ("hand",), None
        )
        record.created, record.msecs = 1796000000.25, 250.0
        line = serve_app.LogFormatter().format(record)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert line == "2026-11-30T00:53:20.250Z WARNING lightship.serve.app: ready: hand"


@pytest.mark.parametrize(
    ("allowed", "client"),
    [("127.0.0.1", "203.0.113.7"), ("10.0.0.1", "127.0.0.1")],
    ids=["from a trusted proxy", "from an untrusted one"],
)
def test_the_access_log_names_a_trusted_proxys_client_on_both_ways_in(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    allowed: str,
    client: str,
) -> None:
    """As uvicorn's proxy-headers middleware does for ASGI: the tensor route (answered by the
    protocol) and the ASGI one name the same client."""
    monkeypatch.setattr(logging.getLogger("uvicorn.access"), "propagate", True)
    app, _ = make_app(tmp_path)
    forwarded = {"x-forwarded-for": "198.51.100.2, 203.0.113.7"}

    async def main() -> None:
        config = {"access_log": True, "log_config": None, "log_level": None}
        async with raw_http(app, forwarded_allow_ips=allowed, **config) as (_, _, http):
            r = await http.post(INFER, json=v2_json(X), headers=forwarded)
            assert r.status_code == 200
            assert (await http.get("/v2/health/live", headers=forwarded)).status_code == 200

    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    hosts = {line.split(" - ")[1].split('"')[1]: line.split(":")[0] for line in lines}
    assert hosts == {
        "POST /v2/models/hand/infer HTTP/1.1": client,
        "GET /v2/health/live HTTP/1.1": client,
    }


LONG = 8 * 1024 * 1024  # far more than the sockets' buffers hold


@pytest.mark.parametrize(
    ("path", "sent"),
    [(INFER, 0), (INFER, LONG), ("/v1/predict/image", LONG)],
    ids=["head only", "whole body", "whole upload"],
)
def test_a_body_too_large_by_its_length_is_refused_and_the_client_reads_the_413(
    tmp_path: Path, path: str, sent: int
) -> None:
    """Answered from the head, before the body is read. A client that sends its whole body
    before it reads (Python's http.client, `requests`) must get that answer, not a reset: the
    server reads and drops the rest before it closes. Both ways in: the tensor route answered
    by the protocol, the upload by ASGI's BodyLimit."""
    app, _ = make_app(tmp_path, max_body_bytes=4096)
    head = post(path, b"", "content-type: application/octet-stream")

    async def main() -> Exchange:
        async with raw_http(app) as (connect, _, _):
            length = b"length: %d" % (sent or 10**9)
            return await exchange(connect, head.replace(b"length: 0", length), b"0" * sent)

    status, headers, answer, rest = run(main())
    assert status == 413 and headers["connection"] == "close" and rest == b""
    fix = (
        "send fewer files per request, or smaller ones (each is resized to the model's input)"
        if path == "/v1/predict/image"
        else "send fewer rows per request"
    )
    assert (
        f"request body over the limit of 4096 bytes (--max-body-bytes): {fix}"
        == json.loads(answer)["error"]
    )


# -- mutation review: tests for behaviours no test pinned -------------------------------------


def test_an_h2c_upgrade_whose_content_length_has_trailing_whitespace_is_answered(
    tmp_path: Path,
) -> None:
    """`_ignore_upgrade` reads Content-Length itself; "N " is legal."""
    app, _ = make_app(tmp_path)
    binary, headers = v2_binary(X)
    (length,) = headers.values()
    head = "\r\n".join(
        [f"POST {INFER} HTTP/1.1", "host: t", f"content-length: {len(binary)} ",
         f"inference-header-content-length: {length}", "connection: close", *H2C]
    )  # fmt: skip

    async def main() -> Exchange:
        async with raw_http(app) as (connect, _, _):
            return await exchange(connect, (head + "\r\n\r\n").encode(), binary)

    status, answer_headers, answer, _ = run(main())
    assert status == 200, answer
    split = int(answer_headers["inference-header-content-length"])
    np.testing.assert_array_equal(
        np.frombuffer(answer[split:], "<f4").reshape(2, 2), expected_logits(X)
    )


def test_an_h2c_upgrade_to_a_tensor_route_is_answered_without_asgi(tmp_path: Path) -> None:
    """The protocol answers the tensor route itself, its Upgrade ignored."""
    app, _ = make_app(tmp_path)
    body = json.dumps(v2_json(X)).encode()
    request = post(INFER, body, "content-type: application/json", "connection: close", *H2C)

    async def main() -> tuple[Exchange, list[str]]:
        async with raw_http(app) as (connect, counting, _):
            answer = await exchange(connect, request)
            return answer, list(counting.paths)

    (status, _, answer, _), paths = run(main())
    assert status == 200, answer
    assert paths == []  # not through ASGI


def test_a_later_head_that_never_ends_on_a_kept_alive_connection_is_answered_408(
    tmp_path: Path,
) -> None:
    """The timer is armed again when a later request's head spans reads, not only
    at connection_made (whose timer the first request's head cancelled)."""
    app, _ = make_app(tmp_path, timeout_ms=300)
    request = post(INFER, json.dumps(v2_json(X)).encode(), "content-type: application/json")

    async def main() -> tuple[int, int, bytes, str]:
        async with raw_http(app) as (connect, _, http):
            reader, writer = await connect()
            writer.write(request)
            first = (await asyncio.wait_for(read_answer(reader), 5))[0]
            writer.write(f"POST {INFER} HTTP/1.1\r\nhost: t\r\nx-a: ".encode())
            second, _, answer = await asyncio.wait_for(read_answer(reader), 3)
            writer.close()
            return first, second, answer, (await http.get("/metrics")).text

    first, second, answer, text = run(main())
    assert (first, second) == (200, 408)
    assert json.loads(answer)["error"].startswith("request head incomplete after 0.3 s")
    assert metric(text, 'lightship_rejections_total{reason="head_timeout"}') == 1


@pytest.mark.parametrize("kind", ["websocket post", "upgrade chunked"])
def test_refused_upgrades_count_as_bad_http(tmp_path: Path, kind: str) -> None:
    """Every request refused before routing counts under its reason."""
    app, _ = make_app(tmp_path)
    if kind == "websocket post":
        ws = ("connection: Upgrade", "upgrade: websocket", "sec-websocket-version: 13")
        data = post(INFER, b"{}", *ws, "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==")
    else:
        head = "\r\n".join(
            [f"POST {INFER} HTTP/1.1", "host: t", "transfer-encoding: chunked", *H2C]
        )
        data = (head + "\r\n\r\n2\r\n{}\r\n0\r\n\r\n").encode()

    async def main() -> tuple[Exchange, str]:
        async with raw_http(app) as (connect, _, http):
            answer = await exchange(connect, data)
            return answer, (await http.get("/metrics")).text

    (status, _, _, _), text = run(main())
    assert status == 400
    assert metric(text, 'lightship_rejections_total{reason="bad_http"}') == 1


def test_the_protocols_rejection_reasons_are_exported_from_the_start(tmp_path: Path) -> None:
    """A rate() over them needs a series before the first refusal."""
    app, _ = make_app(tmp_path)

    async def main() -> str:
        async with serving(app) as client:
            return (await client.get("/metrics")).text

    text = run(main())
    for reason in ("bad_http", "head_too_large", "head_timeout"):
        assert metric(text, f'lightship_rejections_total{{reason="{reason}"}}') == 0


def test_the_config_route_checks_the_version_and_says_gpu_instances(tmp_path: Path) -> None:
    """`versions/{version}/config` refuses another version, as the metadata route does;
    instance_group says KIND_GPU for a model served on a GPU."""
    path = handmade_onnx(tmp_path / "hand.onnx")
    predictor = load_predictor(path)
    predictor.device = "cuda:0"  # as the GPU predictor says it; nothing runs in this test
    settings = ServeSettings(run=path, max_wait_ms=1, instances=2)
    app = create_app(predictor, ServedModel("hand", "file", path, None), settings)

    async def main() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with serving(app, wait_ready=False) as client:
            return (
                await client.get(f"{HAND}/versions/2/config"),
                await client.get(f"{HAND}/versions/2"),
                await client.get(f"{HAND}/config"),
            )

    config_v2, meta_v2, config = run(main())
    assert config_v2.status_code == meta_v2.status_code == 404
    assert config_v2.json() == meta_v2.json()
    assert config.json()["instance_group"] == [{"count": 2, "kind": "KIND_GPU"}]


def test_the_docs_state_the_infer_shape_and_headers_on_both_infer_routes(tmp_path: Path) -> None:
    """Shape [N, C, H, W] or [C, H, W]; the versioned route names the headers too."""
    app, _ = make_app(tmp_path)

    async def main() -> dict[str, Any]:
        async with serving(app) as client:
            return dict((await client.get("/openapi.json")).json()["paths"])

    paths = run(main())
    for route in (
        "/v2/models/{model_name}/infer",
        "/v2/models/{model_name}/versions/{version}/infer",
    ):
        infer = paths[route]["post"]
        schema = infer["requestBody"]["content"]["application/json"]["schema"]
        shape = schema["properties"]["inputs"]["items"]["properties"]["shape"]
        assert (shape["minItems"], shape["maxItems"]) == (3, 4), route
        headers = {p["name"] for p in infer["parameters"] if p["in"] == "header"}
        assert headers == {"Inference-Header-Content-Length", "x-request-timeout-ms"}, route
    # /v1's routes honour the header too (400 for a bad one, 504 past it): the docs said not
    for route in ("/v1/predict", "/v1/predict/image"):
        params = {(p["in"], p["name"]) for p in paths[route]["post"]["parameters"]}
        assert params == {("query", "top_k"), ("header", serve_app.TIMEOUT_HEADER)}, route


@pytest.mark.parametrize("route", ["/v1/predict", "/v1/predict/image"])
def test_a_request_whose_client_left_stops_waiting_for_its_parse_or_decode_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """A large JSON body waits for the one parse slot, an upload for a decode slot. One whose
    client left waited on, holding its body, until the slot came (then was parsed for no one)
    or its deadline passed: 8 clients that sent large bodies and closed took a server to 5 GB.
    It now leaves the wait when its client does, counted 499 `disconnected`."""
    import lightship.serve.app as app_module

    monkeypatch.setattr(serve_app._DisconnectWatch, "WATCH_AFTER_S", 3600)  # the protocol's
    monkeypatch.setattr(app_module, "DECODE_SLOTS", 1)
    app, _ = make_app(tmp_path)
    release, entered, calls = threading.Event(), threading.Event(), []
    image = route.endswith("image")
    name = "decode_image" if image else "decode_instances"
    real = getattr(app_module.v1, name)

    def held(*args: Any) -> Any:  # the first request keeps the slot until released
        calls.append(args)
        if len(calls) == 1:
            entered.set()
            release.wait(10)
        return real(*args)

    monkeypatch.setattr(app_module.v1, name, held)
    headers: list[str] = []
    if image:
        upload = httpx.Request("POST", "http://t/", files=[("files", ("a.png", png(X[0, 0])))])
        body = upload.read()
        headers.append(f"content-type: {upload.headers['content-type']}")
    else:
        body = json.dumps({"instances": X.tolist()}).encode() + b" " * app_module.LARGE_BODY_BYTES

    async def main() -> tuple[float, str, bytes]:
        async with raw_http(app) as (connect, _, client):
            reader, writer = await connect()
            writer.write(post(route, body, *headers))
            await asyncio.to_thread(entered.wait, 10)  # the slot is taken
            _, leaver = await connect()
            leaver.write(post(route, body, *headers))
            await leaver.drain()
            await asyncio.sleep(0.2)  # its body is read, and it waits for the slot
            leaver.close()
            start = time.monotonic()
            for _ in range(300):
                text = (await client.get("/metrics")).text
                if metric(text, 'lightship_rejections_total{reason="disconnected"}'):
                    break
                await asyncio.sleep(0.01)
            waited = time.monotonic() - start
            release.set()
            answer = await reader.readuntil(b"}")
            writer.close()
            return waited, (await client.get("/metrics")).text, answer

    waited, text, answer = run(main())
    assert answer.startswith(b"HTTP/1.1 200 OK"), answer
    assert waited < 2, waited  # while the slot was still taken: not at the 10 s deadline
    assert len(calls) == 1  # the leaver's body was never parsed or decoded
    assert metric(text, 'lightship_rejections_total{reason="disconnected"}') == 1
    assert metric(text, 'lightship_rejections_total{reason="deadline"}') == 0
    template = route if image else "/v1/predict"
    assert metric(text, f'lightship_requests_total{{route="{template}",status="499"}}') == 1


def test_waiting_for_a_slot_never_keeps_it_for_no_one() -> None:
    from lightship.serve.app import acquire_unless_gone
    from lightship.serve.batcher import ClientGone
    from lightship.serve.metrics import Metrics

    metrics = Metrics(4)
    watched: list[Any] = []

    def watch(ticket: Any) -> Callable[[], None]:
        watched.append(ticket)
        return lambda: None

    async def main() -> None:
        slots = asyncio.Semaphore(1)
        await acquire_unless_gone(slots, "parse", 1, watch, metrics)  # free: taken at once
        assert slots.locked()
        with pytest.raises(TimeoutError):  # the deadline passes while another holds it
            await acquire_unless_gone(slots, "parse", 0.05, watch, metrics)
        waiting = asyncio.ensure_future(acquire_unless_gone(slots, "parse", 5, watch, metrics))
        await asyncio.sleep(0.01)
        waiting.cancel()  # shutdown: the waiter is cancelled, the slot not taken
        await asyncio.wait((waiting,))
        slots.release()
        assert not slots.locked()  # nothing holds it
        # the client leaves as the slot frees: it is handed back, and the request dropped
        await slots.acquire()
        waiting = asyncio.ensure_future(acquire_unless_gone(slots, "decode", 5, watch, metrics))
        await asyncio.sleep(0.01)
        slots.release()
        watched[-1].abandon()
        with pytest.raises(ClientGone):
            await waiting
        assert not slots.locked()
        # one that waits its turn and gets it: its wait is observed
        await slots.acquire()
        waiting = asyncio.ensure_future(acquire_unless_gone(slots, "decode", 5, watch, metrics))
        await asyncio.sleep(0.2)
        slots.release()
        await waiting

    asyncio.run(main())
    text = metrics.exposition().decode()
    assert metric(text, 'lightship_rejections_total{reason="disconnected"}') == 1
    # only the two that got a slot: not the one timed out, cancelled or gone
    assert metric(text, 'lightship_slot_wait_seconds_count{slot="parse"}') == 1
    assert metric(text, 'lightship_slot_wait_seconds_sum{slot="parse"}') < 0.05
    assert metric(text, 'lightship_slot_wait_seconds_count{slot="decode"}') == 1
    assert 0.2 <= metric(text, 'lightship_slot_wait_seconds_sum{slot="decode"}') < 1


def test_a_request_answered_before_its_body_cannot_hold_its_connection(tmp_path: Path) -> None:
    """A GET with a body is answered before the body arrives. uvicorn's keep-alive timer stops
    at every read and comes back only with the next answer: a client that sent one more byte
    then nothing held its connection for good (still open after 120 s). The rest of the body
    must now come within the head's time; and a head that starts in the read that ends such
    a body is timed as any other (it got no 408, and was held too)."""
    app, _ = make_app(tmp_path, timeout_ms=300)
    head = b"GET /v2/health/ready HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\n\r\n"

    async def held(connect: Callable[[], Awaitable[Any]], rest: bytes) -> tuple[bytes, float]:
        reader, writer = await connect()
        writer.write(head)
        status, _, _ = await asyncio.wait_for(read_answer(reader), 5)
        assert status == 200
        writer.write(rest)  # then nothing more
        start = time.monotonic()
        after = await asyncio.wait_for(reader.read(), 5)  # b"": the server closed
        writer.close()
        return after, time.monotonic() - start

    async def main() -> list[tuple[bytes, float]]:
        async with raw_http(app) as (connect, _, _client):
            return [
                await held(connect, b"ab"),  # 2 of its 5 body bytes
                await held(connect, b"abcdeGET /v2/health/live HTTP/1.1\r\nho"),  # next head
            ]

    (trickled, waited), (late, late_waited) = run(main())
    assert trickled == b"" and waited < 2, waited
    assert late.startswith(b"HTTP/1.1 408 Request Timeout") and late_waited < 2, late
    assert b"request head incomplete after 0.3 s" in late


def test_a_model_whose_output_does_not_follow_its_batch_is_a_500_not_a_short_answer(
    tmp_path: Path, via: str
) -> None:
    """A model that sums its logits over the batch ([1, 2] for any batch): the rows of a batch
    past the first were answered 200 with no prediction (or another request's)."""
    path = handmade_onnx(tmp_path / "hand.onnx")
    predictor = load_predictor(path)
    whole = predictor._run

    def summed(x: np.ndarray) -> np.ndarray:
        y = whole(x)
        return y if len(x) == 1 else y.sum(axis=0, keepdims=True)

    predictor._run = summed  # type: ignore[method-assign]
    app = create_app(predictor, ServedModel("hand", "file", path, None), ServeSettings(run=path))

    async def main() -> list[httpx.Response]:
        async with serving(app, via=via) as client:
            return [
                await client.post(INFER, json=v2_json(X[:1])),
                await client.post(INFER, json=v2_json(X)),
                await client.post("/v1/predict", json={"instances": X[:, 0].tolist()}),
            ]

    one, two, v1_two = run(main())
    assert one.status_code == 200
    np.testing.assert_allclose(logits_of(one), expected_logits(X[:1]))
    for r in (two, v1_two):
        assert r.status_code == 500, r.text
        assert "gave logits [1, 2] for 2 images, expected [2, 2]" in r.json()["error"]


@pytest.mark.parametrize(
    ("device", "pads", "rows", "top", "sizes"),
    [
        ("cpu", False, 1, 8, [1]),
        ("cuda:0", False, 1, 8, [1, 8]),
        ("cpu", False, 4, 8, [4]),
        ("cuda:0", False, 4, 8, [1, 8, 4]),  # within the range of the first two
        ("cpu", True, 1, 8, [1]),
        ("cuda:0", True, 1, 8, [1, 8, 2, 4]),
        ("cuda:0", True, 3, 12, [1, 16, 2, 4, 4, 8]),  # 12 and 3 rows run as 16 and 4
        ("cuda:0", True, 1, 1, [1]),
    ],
)
def test_on_a_gpu_the_warm_up_runs_the_largest_batch_too(
    tmp_path: Path, device: str, pads: bool, rows: int, top: int, sizes: list[int]
) -> None:
    """TensorRT builds its engine for the batch sizes it has seen: warmed up on one row, it
    built again in the batcher's thread for the first larger batch, the server ready and its
    queue waiting past deadlines; so the smallest and the largest come first, and every size
    after them is within its range. A padding predictor meets every power of two up to the
    largest batch's: cuDNN picks its kernels at each new shape, ~20 ms a size on an H200.
    (A CPU model here, said to be on the GPU.)"""
    path = handmade_onnx(tmp_path / "hand.onnx")
    predictor = load_predictor(path)
    predictor.device = device
    predictor.pads = pads
    seen = batch_rows(predictor)
    settings = ServeSettings(run=path, max_batch_rows=top, warmup_rows=rows)
    app = create_app(predictor, ServedModel("hand", "file", path, None), settings)

    async def main() -> bool:
        async with app.router.lifespan_context(app):
            await asyncio.wait_for(service(app).settled.wait(), 10)
            return service(app).ready

    assert run(main()) is True
    assert seen == sizes
