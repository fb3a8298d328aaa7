"""The HTTP server: routes, error bodies, readiness and shutdown around one batched `Predictor`.

Knows the `Predictor` interface, not the runtime behind it; knows the batcher's exceptions, not
its threads. Every error is JSON `{"error": "..."}` with a 4xx (the caller's fault) or 5xx status.
Hot routes read the raw body (orjson, `np.frombuffer`) instead of a pydantic model: cheaper, and
`tritonclient` sends no `Content-Type`, which a pydantic body would answer with 422.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import gc
import json
import logging
import math
import pathlib
import platform
import re
import signal
import socket
import sys
import threading
import time
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from email.utils import formatdate
from types import FrameType
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np
import uvicorn
from fastapi import FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.logging import AccessFormatter

from lightship import __version__
from lightship.errors import ConfigError, LightshipError, RunError
from lightship.quantize.isa import host_cpu
from lightship.runs import RunDir
from lightship.runtime import InputError, Predictor
from lightship.runtime.base import bucket, physical_cores, trim_heap
from lightship.runtime.ort import QUANTIZATION, file_metadata
from lightship.serve import openapi, v1, v2
from lightship.serve.accept import Acceptor
from lightship.serve.batcher import (
    Batcher,
    ClientGone,
    Closed,
    DeadlineExceeded,
    InferenceFailed,
    QueueFull,
    TooManyRows,
    WorkerDied,
)
from lightship.serve.memory import trim_when_quiet
from lightship.serve.metrics import (
    CLIENT_CLOSED,
    CONTENT_TYPE,
    REFUSED,
    Metrics,
    MetricsMiddleware,
)
from lightship.serve.model import ServedModel
from lightship.serve.protocol import (
    BODY_STOPPED,
    BUG,
    LINGER_S,
    QUERY,
    STOP_BODY,
    WRITE_TIMEOUT_S,
    http_protocol,
)
from lightship.serve.settings import ServeSettings
from lightship.serve.v2 import ProtocolError, error_body

log = logging.getLogger(__name__)
T = TypeVar("T")

TIMEOUT_HEADER: str = openapi.TIMEOUT_PARAM["name"]
TIMEOUT_HEADER_BYTES = TIMEOUT_HEADER.encode()
HEADER_LENGTH_BYTES = v2.HEADER_LENGTH.lower().encode()
PLATFORMS = {
    "onnxruntime": "onnxruntime_onnx",
    "torchscript": "pytorch_libtorch",
    "pt2": "pytorch_pt2",
    "eager": "pytorch",
}
# A body still arriving at the server's request deadline gets one more second for every
# MIN_BODY_RATE bytes that arrived (Apache's mod_reqtimeout MinRate): a phone photo over a slow
# uplink (5.8 MB at 4 Mbit/s: 12 s) was refused 408 at 10 s, 90 % of it in, while a client
# that trickles bytes still goes at the deadline. A client's own deadline is not extended.
MIN_BODY_RATE = 64 * 1024
# Requests whose uploaded images are decoded at once. A PNG may declare up to
# v1.MAX_IMAGE_PIXELS and decode to ~190 MB (40 MP RGBA, measured): unbounded, 16 requests of
# 8 such 150 KB files took the server to 5 GB. More decoders than cores is no faster.
DECODE_SLOTS = min(physical_cores(), 4)
# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms). An
# inference thread back from the model waits that long for the busy event loop before it can
# hand its batch over, and every request in the batch waits with it. At 1 ms the digits model
# at concurrency 16 answered 20-40 % more requests per second (in-process and over HTTP, same
# runs); a model releases the GIL while it computes, so the shorter slice costs little else.
GIL_SWITCH_INTERVAL_S = 0.001


class BodyTooLarge(Exception):
    """A body over the limit. `whole`: read to its end (a compressed one inflating past the
    limit, a last chunk in the read that passed it), so its 413 keeps the connection; one still
    arriving closes it, the rest read only to be thrown away."""

    def __init__(self, message: str, whole: bool = False) -> None:
        super().__init__(message)
        self.whole = whole

    @classmethod
    def of(cls, limit: int, path: str = "", whole: bool = False) -> BodyTooLarge:
        """A body past `limit` bytes, sent to `path` (counted in the rejections where
        answered): the error says what to send instead."""
        fix = (
            "send fewer files per request, or smaller ones (each is resized to the model's input)"
            if path == IMAGE_ROUTE
            else "send fewer rows per request"
        )
        return cls(f"request body over the limit of {limit} bytes (--max-body-bytes): {fix}", whole)


class BodyTimeout(Exception):
    """The deadline passed while the body was still arriving: 408 when it was the server's
    own timeout (the client stalled), 504 when it was the client's shorter one."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class NotReady(Exception):
    pass


class EncodingRefused(ProtocolError):
    """415 for a Content-Encoding the route does not take; the answer names those it does in
    `Accept-Encoding` (RFC 9110, 12.5.3), as Triton's does."""

    def __init__(self, message: str, accepted: str) -> None:
        super().__init__(message, 415)
        self.accepted = accepted


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(message), status, headers, media_type="application/json")


_DECIMAL = re.compile(rb"[0-9]+(\.[0-9]+)?")


def _client_timeout_s(header: bytes) -> float | None:
    """The `x-request-timeout-ms` header in seconds; None unless a positive decimal number
    (float() would also take "1_000", "inf" and "1e400")."""
    if not _DECIMAL.fullmatch(header):
        return None
    value = float(header) / 1000
    return value if value > 0 else None


class Service:
    """The model behind the routes: predictor, batcher, readiness, deadlines."""

    def __init__(self, predictor: Predictor, served: ServedModel, settings: ServeSettings) -> None:
        self.predictor = predictor
        self.served = served
        self.settings = settings
        self.name = served.name
        self.labels = list(predictor.labels)
        self.chw = predictor.chw
        self.input_name = str(predictor.input_spec.get("name", "input"))
        # The longest a request may take: its deadline, its body's allowance past it, the
        # deadline again from the body's end (`body_arrived`), then the wait for a client slow
        # to read its answer (`protocol.WRITE_TIMEOUT_S`)
        timeout_s = settings.timeout_ms / 1000
        longest = 2 * timeout_s + settings.max_body_bytes / MIN_BODY_RATE + WRITE_TIMEOUT_S
        self.metrics = Metrics(settings.max_batch_rows, longest)
        self.metrics.model_info.labels(
            self.name, served.variant, predictor.kind, predictor.device
        ).set(1)
        # torch is in sys.modules when it runs the model; an ONNX server never imports it
        runtime = "onnxruntime" if predictor.kind == "onnxruntime" else "torch"
        self.metrics.build_info.labels(
            __version__,
            runtime,
            str(getattr(sys.modules.get(runtime), "__version__", "unknown")),
            platform.python_version(),
        ).set(1)
        # `logits` runs the model unchecked (`_run`) and checks only its output's shape: every
        # request was checked on the event loop (Predictor.check) before it was queued, so a
        # bad row never reaches a batch. The metrics observe it from the end of the warm-up
        # batch (`warm_up`): served traffic only.
        self.batcher = Batcher(
            predictor.logits,
            max_batch_rows=settings.max_batch_rows,
            max_wait_ms=settings.max_wait_ms,
            max_queue_rows=settings.max_queue_rows,
            instances=settings.instances,
        )
        self.ready = False
        self.stopping = False  # SIGTERM came: never ready again
        self.failed: str | None = None
        self.settled = asyncio.Event()  # set when the warm-up ended, ready or failed
        # called when the warm-up failed: `serve` stops the server, which then exits non-zero
        self.on_failed: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.batcher.start()

    async def warm_up(self) -> None:
        """One batch through the whole path; ready only if it answers as the labels say. On a
        GPU, a second of --max-batch-rows rows: TensorRT builds its engine for the batch sizes
        it has seen, and built it again, in the batcher's thread, for the first batch past
        them, while the server was ready and queued requests waited out their deadlines.
        With the smallest and the largest seen, every batch to come is within the engine's
        range. A predictor that pads its batches to powers of two (`Predictor.pads`, every one
        on a GPU) runs each of those sizes too: cuDNN picks its kernels at each new shape,
        17-24 ms a size for a TorchScript ResNet-18 on an H200, which live batches paid."""
        top = self.settings.max_batch_rows
        rows = min(self.settings.warmup_rows, top)
        sizes = [rows]
        if self.predictor.device != "cpu":  # one row too: --warmup-rows 4 left 1 to rebuild at
            # every size a batch of 1 to `top` rows reaches the model at, sent as `top` at most
            shapes = {min(bucket(n), top) for n in range(1, top + 1)} if self.predictor.pads else ()
            # the smallest and the largest first, then the sizes between, within the engine's
            # range: in rising order, TensorRT would build its engine again at each
            sizes = list(dict.fromkeys([1, top, *sorted({rows, *shapes})]))
        # Generous: a TensorRT engine is built on the first batch and may take minutes. Its
        # shape is checked as it runs (`Predictor.logits`), its values as the batcher delivers
        # them (NaN or infinite logits fail the request)
        timeout_s = max(self.settings.timeout_ms / 1000, 900.0)
        try:
            for n in sizes:
                await self.batcher.infer(np.zeros((n, *self.chw), np.uint8), timeout_s, wait=False)
        except Exception as exc:
            self.failed = f"model failed its warm-up batch: {exc}"
            log.error("%s; not ready", self.failed)
            if self.on_failed is not None:
                self.on_failed()
        else:
            # Everything made so far (modules, routes, the model session) lives as long as the
            # process: move it out of the garbage collector's generations, so the collections
            # that per-request garbage triggers stop re-scanning it.
            gc.freeze()
            # and give back the heap that loading freed: a served ResNet-18's resident memory
            # after 300 requests is 15-23 % lower (int8), 28-43 % (fp32); digits' unchanged
            trim_heap()
            # The warm-up batch was observed (and its wait and compute timed) before its answer
            # came back: from here on the batcher reports requests only.
            self.batcher.observer = self.metrics
            if self.stopping:  # a warm-up back after SIGTERM: the server is stopping
                log.info("warm-up batch done, but the server is stopping: not ready")
                return
            self.ready = True
            log.info(
                "ready: model '%s' (%s, %s on %s), input '%s' uint8 %s",
                self.name,
                self.served.variant,
                self.predictor.kind,
                self.predictor.device,
                self.input_name,
                list(self.chw),
            )
        finally:
            self.settled.set()

    def begin_shutdown(self) -> None:
        """On SIGTERM (from a signal handler): not ready; the queue runs without waiting."""
        self.stopping = True
        self.ready = False
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.batcher.drain)

    async def stop(self) -> None:
        self.stopping = True
        self.ready = False
        await self.batcher.aclose()

    @property
    def broken(self) -> str | None:
        """Why this process will never serve (restart it), or None."""
        return self.batcher.failure or self.failed

    def check_model(self, name: str, version: str | None = None) -> None:
        if name != self.name:
            if name == "stats":  # GET /v2/models/stats: tritonclient's get_inference_statistics
                raise ProtocolError(STATISTICS, 404)
            raise ProtocolError(f"unknown model '{name}': this server serves '{self.name}'", 404)
        if version is not None and version != v2.VERSION:
            raise ProtocolError(
                f"unknown version '{version}' of model '{name}': it has version {v2.VERSION}", 404
            )

    def timeout_s(self, head: Head | None, requested_s: float | None = None) -> float:
        """Seconds left until the request's deadline: the server's, shortened by the client's
        header or V2 parameter, counted from the request's arrival (`Head`)."""
        now = time.monotonic()
        if head is None:  # a request that came in by no way that reads its head (none here)
            return self.settings.timeout_ms / 1000
        if head.bad_timeout is not None:
            raise ProtocolError(
                f"{TIMEOUT_HEADER} must be a positive decimal number of milliseconds (digits "
                f"and a point: 250, 1.5), got {head.bad_timeout!r}"
            )
        deadline = head.deadline
        if requested_s is not None:  # from arrival too, as the header's: `deadline - timeout_s`
            deadline = min(deadline, head.deadline - head.timeout_s + requested_s)
        # What is left of it: reading and parsing the body took some (<= 0: already passed).
        return deadline - now

    async def predict(self, x: np.ndarray, timeout_s: float, watch: Watch) -> np.ndarray:
        """Logits for checked input through the batcher; drops the request if its client left
        (`watch` tells the ticket when it does)."""
        if not self.ready and (self.failed is not None or not self.settled.is_set()):
            # Starting (the warm-up batch is not back) or failed. While shutting down the
            # server is not ready either, but requests it already read are still answered.
            raise NotReady(self.failed or "starting: the model's warm-up batch is not back yet")
        x = self.predictor.check(x)
        ticket = self.batcher.submit(x, timeout_s)
        stop = watch(ticket)
        try:
            return await ticket.future
        except DeadlineExceeded as exc:  # the batcher's, which knows nothing of HTTP
            raise DeadlineExceeded(
                f"{exc}: the server had more to answer than it could in time; retry, or allow "
                f"more time where the {TIMEOUT_HEADER} header or V2 parameters.timeout "
                f"shortened the server's own {self.settings.timeout_ms:g} ms "
                "(`lightship serve --timeout-ms`)"
            ) from None
        finally:
            stop()


class Abandonable(Protocol):
    """What a `Watch` abandons when the client leaves: a queued `Ticket`, or a `_Departure`."""

    @property
    def future(self) -> asyncio.Future[Any]: ...

    def abandon(self) -> None: ...


# Starts watching for the client of a queued request (or one waiting for a slot) to leave,
# abandoning its ticket if it does; returns the function that stops watching.
Watch = Callable[[Abandonable], Callable[[], None]]


class _Departure:
    """A request's stand-in ticket while it waits for a slot (to parse, to decode): its `Watch`
    abandons it when the client leaves, which ends the wait."""

    __slots__ = ("future",)

    def __init__(self) -> None:
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def abandon(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


async def acquire_unless_gone(
    slots: asyncio.Semaphore, slot: str, timeout_s: float, watch: Watch, metrics: Metrics
) -> None:
    """One of `slots` for a request, waited for until its deadline (`timeout_s` from now:
    TimeoutError) or until its client leaves (`ClientGone`, counted `disconnected`): a request
    whose client left held its body while it waited, and 8 clients that sent large bodies
    and closed took the server to 5 GB, each kept to its deadline, then parsed for no one.
    The wait for one it got is observed as `slot`'s (metrics.SLOTS)."""
    start = time.perf_counter()
    gone = _Departure()
    stop = watch(gone)
    acquire = asyncio.ensure_future(slots.acquire())
    waited = False
    try:
        await asyncio.wait(
            (acquire, gone.future), timeout=max(timeout_s, 0), return_when=asyncio.FIRST_COMPLETED
        )
        waited = True
    finally:  # cancelled too (shutdown): the slot is given back, never kept by no one
        stop()
        if not acquire.done():
            acquire.cancel()
            await asyncio.wait((acquire,))  # cancelled, or it took the slot just before
        acquired = not acquire.cancelled() and acquire.exception() is None
        if acquired and (not waited or gone.future.done()):
            slots.release()
    if gone.future.done():
        metrics.rejected("disconnected")
        raise ClientGone()
    if not acquired:
        raise TimeoutError
    metrics.slot_waited(slot, time.perf_counter() - start)


def _bare(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, an error a request is answered with raised without its traceback, or the
    error it was raised from (a JSON decode error's holds the same frames)."""
    try:
        return fn(*args)
    except (ProtocolError, TooManyRows, BodyTooLarge, InputError, DeadlineExceeded) as exc:
        exc.__context__ = None
        raise exc.with_traceback(None) from None


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a worker thread. An error raised there held, in its traceback, the frames
    that raised it and what they had parsed (a 16 MiB JSON body of the wrong shape: 128 MB),
    in a reference cycle through the awaited future that only the garbage collector's rare
    full pass breaks: 32 such bodies one after another held 3 GB. Raised bare, it holds none;
    an unforeseen one (a 500, logged) keeps its traceback."""
    return await run_in_threadpool(_bare, fn, *args)


def asgi_watch(receive: Receive, after_s: float | None = None) -> Watch:
    """The `Watch` of a request that came in through ASGI: `receive()` says when it left.
    Watching starts `after_s` (default `_DisconnectWatch.WATCH_AFTER_S`) after the request is
    queued."""

    def watch(ticket: Abandonable) -> Callable[[], None]:
        return _DisconnectWatch(asyncio.get_running_loop(), ticket, receive, after_s).close

    return watch


class _DisconnectWatch:
    """Abandons a queued request when its client disconnects.

    After the body, an ASGI `receive()` returns only on disconnect, but awaiting it takes a task
    (tens of µs to make, run and cancel: a fifth of a small model's request on the event loop).
    Requests are answered within a few batches, so the task starts only for one still waiting
    after `WATCH_AFTER_S`: those are the ones a backlog holds, where dropping them saves compute.
    At 5 ms most requests of the digits model at concurrency 16 (p50 ~8 ms) paid for a watch;
    at 50 ms, measured in-process, the event loop spends ~50 µs less per request.
    """

    WATCH_AFTER_S = 0.05
    __slots__ = ("_handle", "_receive", "_task", "_ticket")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        ticket: Abandonable,
        receive: Receive,
        after_s: float | None = None,
    ) -> None:
        self._ticket = ticket
        self._receive = receive
        self._task: asyncio.Task[None] | None = None
        self._handle: asyncio.TimerHandle | None = None
        after_s = self.WATCH_AFTER_S if after_s is None else after_s
        if after_s > 0:
            self._handle = loop.call_later(after_s, self._start)
        else:
            self._start()

    def _start(self) -> None:
        if not self._ticket.future.done():
            self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._ticket.abandon()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        if self._task is not None:
            self._task.cancel()


@dataclass(slots=True)
class Head:
    """What the server reads of a request's head before its body (`read_head`): its deadline,
    counted from arrival, and the headers the tensor routes take."""

    deadline: float  # time.monotonic() at which the request's deadline passes
    timeout_s: float  # the deadline's length: the server's, or the client's shorter one
    clients: bool  # the deadline is the client's (x-request-timeout-ms), not the server's
    bad_timeout: str | None  # an x-request-timeout-ms that is no positive number (400 later)
    too_large: bool  # Content-Length over the limit, or not a number: 413 before the body
    encoding: str | None  # Content-Encoding
    header_length: str | None  # Inference-Header-Content-Length
    accept: str | None  # Accept-Encoding


_OWS = (b" ", b"\t")


def read_head(headers: Iterable[tuple[bytes, bytes]], limit: int, timeout_s: float) -> Head:
    """The `Head` of a request whose (lower-case) headers are `headers`, arriving now, on a
    server that takes bodies of up to `limit` bytes and waits `timeout_s` for an answer."""
    arrived = time.monotonic()
    clients = too_large = False
    bad_timeout = encoding = header_length = accept = None
    for key, value in headers:
        # httptools trims the whitespace before a value, not after it (RFC 9110 5.5: neither
        # is part of it); a "Content-Length: 12 " was refused as too large
        if value[-1:] in _OWS:
            value = value.rstrip(b" \t")
        if key == TIMEOUT_HEADER_BYTES:
            client_s = _client_timeout_s(value)
            if client_s is None:
                bad_timeout = value.decode("latin-1")
            elif client_s < timeout_s:
                timeout_s, clients = client_s, True
        elif key == b"content-length":
            too_large = not value.isdigit() or int(value) > limit
        # A repeated line joins the ones before it (RFC 9110 5.3), not replaces them: "gzip,
        # gzip" is no encoding taken (415), "12, 12" no length (400). The server's own HTTP
        # protocol refuses a repeat before (400, `protocol.py`); in-process ASGI and h11 do not.
        elif key == b"content-encoding":
            text = value.decode("latin-1")
            encoding = text if encoding is None else f"{encoding}, {text}"
        elif key == HEADER_LENGTH_BYTES:
            text = value.decode("latin-1")
            header_length = text if header_length is None else f"{header_length}, {text}"
        elif key == b"accept-encoding":
            accept = value.decode("latin-1")
    return Head(
        arrived + timeout_s, timeout_s, clients, bad_timeout, too_large, encoding, header_length,
        accept,
    )  # fmt: skip


def head_of(scope: Scope) -> Head | None:
    """The `Head` that `BodyLimit` read of an ASGI request."""
    head: Head | None = scope.get("state", {}).get("head")
    return head


def too_large_by_length(limit: int, metrics: Metrics, path: str = "") -> Response:
    """The answer to a Content-Length over `limit`, sent before the body and closing the
    connection: reading the rest would only cost. `path`: the route it was sent to."""
    metrics.rejected("body_too_large")
    return _error(413, str(BodyTooLarge.of(limit, path)), {"connection": "close"})


def body_allowed_until(head: Head, seen: int) -> float:
    """When (time.monotonic()) a body must have arrived, `seen` bytes in: the request's
    deadline, and past the server's own one more second for every MIN_BODY_RATE bytes."""
    return head.deadline if head.clients else head.deadline + seen / MIN_BODY_RATE


def body_arrived(head: Head) -> None:
    """A body in whole after the server's deadline, within its allowance: the request gets
    the server's deadline again, counted from now, for its queue and compute."""
    now = time.monotonic()
    if now > head.deadline and not head.clients:
        head.deadline = now + head.timeout_s


def body_stopped(seen: int, metrics: Metrics) -> BodyTimeout:
    """The error of a body still arriving, `seen` bytes in, when the stopping server's drain
    cannot wait for the rest (`protocol.body_stop_after_s`): an answer the client can retry
    on, not a connection cut off without one."""
    metrics.rejected("not_ready")
    return BodyTimeout(
        f"the server is stopping and could not wait for the rest of the body ({seen} bytes "
        "arrived): send the request again (to another instance)",
        503,
    )


def body_timeout(head: Head, seen: int, metrics: Metrics) -> BodyTimeout:
    """The error of a body still incomplete, `seen` bytes in, when its time ran out."""
    if head.clients:
        metrics.rejected("deadline")
        return BodyTimeout(
            f"deadline of {head.timeout_s * 1000:g} ms ({TIMEOUT_HEADER}) passed before "
            f"the whole body was read ({seen} bytes arrived)",
            504,
        )
    metrics.rejected("body_timeout")
    took = time.monotonic() - (head.deadline - head.timeout_s)
    took_s = f"{took:.1f}" if took >= 1 else f"{took:.2g}"
    return BodyTimeout(
        f"request body incomplete after {took_s} s ({seen} bytes arrived): past the "
        f"server's request deadline ({head.timeout_s:g} s) a body must keep arriving at "
        f"{MIN_BODY_RATE // 1024} KiB/s; send it faster, or serve with a longer --timeout-ms "
        "(LIGHTSHIP_TIMEOUT_MS)",
        408,
    )


class BodyLimit:
    """413 for a body over `limit` bytes: at once from Content-Length, else while it streams.
    A body still incomplete when the request's deadline passes is answered at once, and the
    connection closed: a client that stalls mid-body would hold its handler for good. 408 when
    the deadline is the server's `timeout_s`: the server's patience with a slow client ran
    out. 504 when the client's header shortened it: the client's own deadline passed, as it
    does in the queue; under overload the event loop may simply not have read the body yet.
    The server's HTTP protocol does the same for the tensor routes it answers without ASGI
    (`protocol.py`).
    """

    def __init__(self, app: ASGIApp, limit: int, metrics: Metrics, timeout_s: float) -> None:
        self.app = app
        self.limit = limit
        self.metrics = metrics
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = read_head(scope["headers"], self.limit, self.timeout_s)
        if head.too_large:
            await too_large_by_length(self.limit, self.metrics, scope["path"])(scope, receive, send)
            return
        # The deadline counts from arrival, body reading included; the routes read it here.
        scope.setdefault("state", {})["head"] = head
        loop = asyncio.get_running_loop()
        clock = loop.time() - time.monotonic()  # the loop's clock, from time.monotonic()'s
        deadline = clock + head.deadline
        seen = 0
        body_done = False
        expired = False
        # the server is stopping and cannot wait for the rest of the body (stopped already
        # while this request was queued, `protocol._stop_body`, where it is still arriving)
        stopped = bool((arriving := scope.get(BODY_STOPPED)) is not None and arriving())
        receiving: asyncio.Task[Any] | None = None
        timer: asyncio.TimerHandle | None = None

        def stop_body() -> None:  # the protocol's, at SIGTERM (`protocol.body_stop_after_s`)
            nonlocal stopped, expired
            if body_done or stopped:
                return
            stopped = True
            if receiving is not None and not expired:  # waiting for the body now (else the
                expired = True  # next wait raises); not cancelled twice, by `expire` too
                receiving.cancel()

        scope[STOP_BODY] = stop_body

        def expire(task: asyncio.Task[Any]) -> None:
            nonlocal expired, deadline, timer
            if expired:  # `stop_body` cancelled the wait in this same loop iteration
                return
            later = clock + body_allowed_until(head, seen)  # still arriving fast enough
            if later > loop.time():
                deadline = later
                timer = loop.call_at(deadline, expire, task)
                return
            expired = True
            task.cancel()

        async def counted() -> Message:
            nonlocal seen, body_done, timer, receiving, expired
            if body_done:  # after the body only a disconnect comes, whenever it comes
                return await receive()
            # asyncio.timeout_at() does the same with a context object per call; this is the
            # hot path of every request (20-40 µs less per request, measured in-process).
            task = asyncio.current_task()
            assert task is not None
            looked = False
            while True:
                if stopped:
                    raise body_stopped(seen, self.metrics)
                timer = loop.call_at(deadline, expire, task)
                receiving = task
                try:
                    message = await receive()
                    break
                except asyncio.CancelledError:
                    if not expired or task.uncancel():  # cancelled by someone else too
                        raise
                    if stopped:
                        raise body_stopped(seen, self.metrics) from None
                    if looked:
                        raise body_timeout(head, seen, self.metrics) from None
                finally:
                    receiving = None
                    timer.cancel()
                # One turn of the loop first, to read what came in time: after a stall (a
                # 2-core machine under overload) uvloop runs its due timers before it reads
                # the sockets, and a body that had arrived in the kernel's buffer was
                # answered 408 (uvicorn keeps what it reads meanwhile for the next receive)
                looked, expired = True, False
                await asyncio.sleep(0)
            body_done = not message.get("more_body", False)
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise BodyTooLarge.of(self.limit, scope["path"], whole=body_done)
            if body_done:
                body_arrived(head)
            return message

        await self.app(scope, counted, send)


# A gzip body is read this many bytes at a time. zlib copies what a member leaves unread
# (`unused_data`), and a body of many members fed whole was copied once a member: 4 MiB of
# empty 20-byte members took 27 s of a core. In pieces each copy is at most a piece.
INFLATE_PIECE = 16 * 1024
# gzip members one body may hold, at the least: more than any compressor writes (bgzip, which
# starts one every 65,280 bytes of data, writes 257 for a 16 MiB body), few enough that their
# setup is cheap; a larger body limit allows bgzip's count for it (`_most_members`).
MAX_GZIP_MEMBERS = 1024
BGZIP_BLOCK = 65_280


def _most_members(limit: int) -> int:
    return max(MAX_GZIP_MEMBERS, limit // BGZIP_BLOCK + 2)


def content_coding(encoding: str) -> str:
    """The Content-Encoding of a tensor route's body, as `_decode_content` undoes it: gzip,
    deflate or identity; EncodingRefused (415) for any other."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):  # an empty header lists no encoding
        return "identity"
    if encoding == "x-gzip":  # the same as gzip (RFC 9110, 8.4.1.3)
        return "gzip"
    if encoding not in ("gzip", "deflate"):
        raise EncodingRefused(
            f"Content-Encoding {encoding} is not supported: use gzip or deflate", "gzip, deflate"
        )
    return encoding


def _decode_content(body: bytes, encoding: str, limit: int) -> bytes:
    """Undo Content-Encoding gzip/deflate (tritonclient can compress), bounded by `limit`.
    gzip members one after another are one body (RFC 1952); a stream cut short, or bytes
    after the last one, are refused rather than answered from part of the body. Linear in
    the body's size, whatever its members."""
    encoding = content_coding(encoding)
    if encoding == "identity":
        return body
    wbits = 31 if encoding == "gzip" else 15
    view = memoryview(body)
    out: list[bytes] = []
    size = 0
    pos = start = 0  # bytes of `body` given to zlib; where this member began
    members = 1
    d = zlib.decompressobj(wbits=wbits)
    while True:
        piece = view[pos : pos + INFLATE_PIECE]
        pos += len(piece)
        try:
            inflated = d.decompress(piece, limit + 1 - size)
        except zlib.error as exc:
            if members > 1 and body[start : start + 2] != b"\x1f\x8b":  # no gzip header
                raise ProtocolError(
                    f"body has {len(body) - start} bytes after its gzip data that are not a "
                    "gzip member: send the compressed stream alone"
                ) from None
            which = f"member {members} of the " if members > 1 else ""
            raise ProtocolError(f"{which}body is not valid {encoding} data ({exc})") from None
        out.append(inflated)
        size += len(inflated)
        if size > limit or d.unconsumed_tail:
            raise BodyTooLarge(f"decompressed body over the limit of {limit} bytes", whole=True)
        if not d.eof:
            if pos < len(body):
                continue
            raise ProtocolError(f"body is {encoding} data cut short: send the whole stream")
        pos -= len(d.unused_data)  # where this member ended
        if pos == len(body):
            return out[0] if len(out) == 1 else b"".join(out)
        if encoding == "deflate":
            raise ProtocolError(f"body has {len(body) - pos} bytes after its deflate data")
        members += 1
        if members > (most := _most_members(limit)):
            raise ProtocolError(
                f"body has more than {most} gzip members: compress it as one stream"
            )
        start = pos
        d = zlib.decompressobj(wbits=wbits)


# Answers under `compress_min_bytes` (a setting: why 1 KiB by default is said there) go out
# uncompressed even to a client that asks for gzip or deflate.
# zlib's level for answers: on the JSON logits of 64-512 rows of 10 classes, level 1 took a
# quarter to a seventh of the time of zlib's default (6), for answers 6-9 % larger.
COMPRESS_LEVEL = 1
# Answers this large or larger are compressed in a worker thread (zlib lets go of the GIL). At
# level 1, JSON took 8-9 µs a KiB, binary float32 (which shrinks by 5 %) up to 30: a 64 KiB
# binary answer held the event loop for 1.8 ms. A thread costs the loop some 50 µs.
COMPRESS_IN_THREAD_BYTES = 16 * 1024
_QVALUE = re.compile(r"q=(0(\.[0-9]{0,3})?|1(\.0{0,3})?)")


@functools.lru_cache(maxsize=64)  # a client sends the same header with every request
def response_coding(accept: str) -> str | None:
    """The coding of an answer to `Accept-Encoding: accept`: gzip or deflate as the client ranks
    them, the first listed of equal weight (as Triton chooses); None for none (identity ranked
    higher, or neither acceptable)."""
    weights: dict[str, float] = {}  # in the order listed; a coding's first weight counts
    for item in accept.split(","):
        coding, *params = (part.strip() for part in item.split(";"))
        coding = coding.lower()
        weight = 1.0
        for param in params:
            if param[:2].lower() == "q=":
                valid = _QVALUE.fullmatch(param.lower())
                weight = float(valid.group(1)) if valid else 0.0  # invalid: not asked for
        weights.setdefault("gzip" if coding == "x-gzip" else coding, weight)
    for coding in ("gzip", "deflate"):  # "*" stands for those not listed, after those listed
        weights.setdefault(coding, weights.get("*", 0.0))
    best, best_weight = None, 0.0
    for coding, weight in weights.items():
        if coding in ("gzip", "deflate", "identity") and weight > best_weight:
            best, best_weight = coding, weight
    return None if best == "identity" else best


def _compress(body: bytes, coding: str) -> bytes:
    """`body` as gzip or deflate (zlib format: RFC 9110, 8.4.1.2; what tritonclient decodes)."""
    z = zlib.compressobj(COMPRESS_LEVEL, zlib.DEFLATED, 31 if coding == "gzip" else 15)
    return z.compress(body) + z.flush()


# Bodies this large or larger are parsed in a worker thread. orjson and numpy take 6-20 ns a
# byte (2-5 ms for a 64-row digits request); a 16 MB body of small nested lists held the event
# loop, and with it every other request, for 0.5-1.6 s. The thread hands the GIL back to the
# loop every switch interval.
LARGE_BODY_BYTES = 256 * 1024
# Large JSON bodies parsed at once. orjson's parse of a body of small numbers peaks at ~14 times
# its size (16 MiB of digits instances: 230 MB), before its rows can be counted; and orjson
# and numpy hold the GIL as they parse, so a second parse beside it would run no sooner. Eight
# such bodies at once peaked at 480-600 MB one at a time, 700-920 MB unbounded (2-core box).
PARSE_SLOTS = 1


_V2_INFER = re.compile(r"/v2/models/(?P<model_name>[^/]+)/(?:versions/(?P<version>[^/]+)/)?infer")


def hot_route(path: str) -> tuple[str, dict[str, str]] | None:
    """The `TensorRoutes` handler of `path` and its path parameters; None for FastAPI's."""
    if path == "/v1/predict":
        return "v1_predict", {}
    if path.startswith("/v2/models/") and (match := _V2_INFER.fullmatch(path)):
        model_name, version = match.group("model_name", "version")
        if version is None:
            return "v2_infer", {"model_name": model_name}
        return "v2_infer_version", {"model_name": model_name, "version": version}
    return None


@dataclass(slots=True)
class HotRequest:
    """What a tensor route's handler gets: the whole (decoded) body and the little it reads."""

    head: Head
    params: dict[str, str]
    body: bytes
    watch: Watch  # tells a queued request when its client leaves


HotHandler = Callable[[HotRequest], Awaitable[tuple[bytes, dict[str, str]]]]


class TensorRoutes:
    """The POST routes that carry tensors (V2 infer, /v1/predict), answered ahead of FastAPI:
    its routing, request and response objects and exception middleware cost more than all the
    rest of a small model's request. A bare ASGI V2 endpoint with no model under uvicorn spent
    44 µs of event loop per binary request (66 JSON), the same endpoint in FastAPI 123 (143):
    digits bodies, wrk at 16 connections, 2-core Xeon.

    Two ways in share this one implementation: `HotRoutes`, plain ASGI inside `BodyLimit` and
    the metrics middleware (any ASGI server, the in-process tests), and the server's own HTTP
    protocol (`protocol.py`), which answers these routes with no ASGI at all. Errors are
    answered from the same table as FastAPI's exception handlers (`_error_answers`).
    """

    # the route template of each handler, as the metrics label it
    PATHS: ClassVar[dict[str, str]] = {
        "v2_infer": "/v2/models/{model_name}/infer",
        "v2_infer_version": "/v2/models/{model_name}/versions/{version}/infer",
        "v1_predict": "/v1/predict",
    }
    route = staticmethod(hot_route)

    def __init__(
        self,
        handlers: dict[str, HotHandler],
        answers: dict[type[Exception], ErrorAnswer],
        metrics: Metrics,
        body_limit: int,
        timeout_s: float,
        compress_min_bytes: int,
        route_of: Callable[[Scope], str | None],
        cors: bool = False,
        check_head: Callable[[str, dict[str, str], Head], None] = lambda name, params, head: None,
    ) -> None:
        self.handlers = handlers
        # CORS is on: a request with an Origin (a browser's) goes through ASGI, whose
        # middleware gives its answer the headers
        self.cors = cors
        self.answers = answers
        self.metrics = metrics
        self.body_limit = body_limit
        self.timeout_s = timeout_s
        self.compress_min_bytes = compress_min_bytes  # 0: never
        # the route template of a request answered before routing (`count_gone`)
        self.route_of = route_of
        # raises what the route would answer from its path and headers alone (an unknown
        # model's 404, a bad x-request-timeout-ms, a Content-Encoding it does not take), for a
        # client that waits for 100 Continue before it sends the body
        self.check_head = check_head

    def read_head(self, headers: Iterable[tuple[bytes, bytes]]) -> Head:
        return read_head(headers, self.body_limit, self.timeout_s)

    def too_large_by_length(self) -> Response:
        return too_large_by_length(self.body_limit, self.metrics)

    def too_large(self, whole: bool = False) -> BodyTooLarge:
        return BodyTooLarge.of(self.body_limit, whole=whole)

    def body_timeout(self, head: Head, seen: int) -> BodyTimeout:
        return body_timeout(head, seen, self.metrics)

    def body_stopped(self, seen: int) -> BodyTimeout:
        return body_stopped(seen, self.metrics)

    body_allowed_until = staticmethod(body_allowed_until)
    body_arrived = staticmethod(body_arrived)

    async def answer(
        self, name: str, params: dict[str, str], head: Head, body: bytes, watch: Watch
    ) -> tuple[bytes, dict[str, str]]:
        """The 200 answer's body and headers; raises what `error` answers otherwise. A
        compressed body is inflated by the handler, as it parses it (`parse_body`)."""
        hot = HotRequest(head, params, body, watch)
        content, headers = await self.handlers[name.removesuffix("_version")](hot)
        if not 0 < self.compress_min_bytes <= len(content):
            return content, headers
        # an answer this long goes compressed to a client that asks: a cache keeps it apart
        # by Accept-Encoding, asked or not (RFC 9110 12.5.5)
        headers["vary"] = "accept-encoding"
        accept = head.accept
        if accept is not None and (coding := response_coding(accept)) is not None:
            if len(content) >= COMPRESS_IN_THREAD_BYTES:
                content = await run_in_threadpool(_compress, content, coding)
            else:
                content = _compress(content, coding)
            # Inference-Header-Content-Length still counts the JSON before compression
            headers["content-encoding"] = coding
        return content, headers

    def error(self, exc: BaseException) -> Response | None:
        """The answer to a route's error; None for a bug (see `bug`)."""
        return _answer_for(self.answers, exc)

    def bug(self, exc: BaseException) -> Response:
        """A 500 for an error no answer is made for, logged with its traceback (the ASGI way
        in leaves both to Starlette and uvicorn)."""
        log.error("exception answering a tensor route", exc_info=exc)
        return _error(500, BUG)

    def count(self, name: str, status: int, seconds: float) -> None:
        """The request's metrics, labelled with the template of its route."""
        self.metrics.request(self.PATHS[name], status, seconds)

    def count_gone(self, scope: Scope) -> None:
        """An ASGI request read and never started, its client gone (pipelined behind
        another): 499 and `disconnected`, without running the app, under its route's template
        (`route_of`)."""
        self.metrics.rejected("disconnected")
        self.metrics.request(self.route_of(scope) or "unmatched", CLIENT_CLOSED, 0.0)


class HotRoutes:
    """`TensorRoutes` as plain ASGI, ahead of the router: inside `BodyLimit` (size, deadline)
    and the metrics middleware. Every other request goes on to FastAPI."""

    def __init__(self, app: ASGIApp, routes: TensorRoutes) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if (matched := hot_route(path)) is None:
            await self.app(scope, receive, send)
            return
        name, params = matched
        if query := scope.get("query_string"):
            params = {**params, QUERY: query.decode("latin-1")}
        scope["endpoint"] = name  # the metrics middleware labels the request with its route
        if scope["method"] != "POST":
            allow = {"allow": "POST"}
            await _error(405, f"use POST for {path}", allow)(scope, receive, send)
            return
        routes = self.routes
        unread = False  # refused before the body was read: the connection closes
        try:
            head = head_of(scope) or routes.read_head(scope["headers"])
            if any(k == b"expect" and v.lower() == b"100-continue" for k, v in scope["headers"]):
                # what the path and headers alone refuse is answered now, before uvicorn's
                # first receive() sends 100 Continue, not after the body
                unread = True
                routes.check_head(name, params, head)
                unread = False
            body = await self._read(scope, receive)
            content, headers = await routes.answer(name, params, head, body, asgi_watch(receive))
        except Exception as exc:
            if (response := routes.error(exc)) is None:
                raise  # a bug: a 500 from Starlette's ServerErrorMiddleware
            if unread:
                response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        raw = [(b"content-length", b"%d" % len(content))]
        raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        await send({"type": "http.response.body", "body": content})

    @staticmethod
    async def _read(scope: Scope, receive: Receive) -> bytes:
        """The whole body."""
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                # refused by the HTTP protocol (a malformed chunk), which closed: counted as
                # that refusal, not as a client that left
                raise ClientGone() if REFUSED in scope else ClientDisconnect()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def create_app(predictor: Predictor, served: ServedModel, settings: ServeSettings) -> FastAPI:
    service = Service(predictor, served, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        # Warm up in the background: the port answers /v2/health/live at once and
        # /v2/health/ready turns 200 when the batch is back (a TensorRT build may take minutes).
        warm = asyncio.create_task(service.warm_up())
        release = asyncio.create_task(trim_when_quiet(service.metrics))
        yield
        warm.cancel()
        release.cancel()
        await service.stop()

    app = FastAPI(
        title="lightship",
        version=__version__,
        summary=f"Image classifier '{served.name}' ({served.variant}) with dynamic batching",
        description="KServe V2 / Open Inference Protocol (with the binary tensor extension) "
        "under /v2, a simple JSON and image API under /v1, Prometheus metrics at /metrics. "
        f"Clients may shorten the deadline with the `{TIMEOUT_HEADER}` header.",
        lifespan=lifespan,
        docs_url=None,  # openapi.add_docs: the pages' files from this server, not a CDN
        redoc_url=None,
        # /v2/health/live/ was a 307 to an absolute URL made of the Host header (http:// behind
        # a TLS proxy), where /v1/predict/ was a 404: a 404 that names the path to use instead
        redirect_slashes=False,
    )
    app.state.service = service
    answers = _error_answers(service)
    hot_handlers: dict[str, HotHandler] = {}  # filled below

    def route_of(scope: Scope) -> str | None:
        """The route template of a request answered before routing (a 413 from its
        Content-Length): as HotRoutes and FastAPI's router would match it."""
        if (hot := hot_route(scope["path"])) is not None:
            return TensorRoutes.PATHS[hot[0]]
        for route in app.router.routes:
            if route.matches(scope)[0] is not Match.NONE:  # PARTIAL: its 405
                return getattr(route, "path", None)
        return None

    def check_head(name: str, params: dict[str, str], head: Head) -> None:
        if name.startswith("v2_infer"):
            service.check_model(params["model_name"], params.get("version"))
        else:
            v1.query_top_k(params.get(QUERY), settings.top_k)
        service.timeout_s(head)  # a bad x-request-timeout-ms: 400
        content_coding(head.encoding or "")

    tensor_routes = TensorRoutes(
        hot_handlers,
        answers,
        service.metrics,
        body_limit=settings.max_body_bytes,
        timeout_s=settings.timeout_ms / 1000,
        compress_min_bytes=settings.compress_min_bytes,
        route_of=route_of,
        cors=bool(settings.origins),
        check_head=check_head,
    )
    app.state.tensor_routes = tensor_routes  # the server's HTTP protocol answers them too
    app.add_middleware(HotRoutes, routes=tensor_routes)
    app.add_middleware(
        BodyLimit,
        limit=settings.max_body_bytes,
        metrics=service.metrics,
        timeout_s=settings.timeout_ms / 1000,
    )
    raw_routes: dict[Any, str] = {}  # filled below, read per request

    if settings.origins:
        # Inside the metrics (a preflight is counted as any request), outside the body limit
        # (its 413 and 408 reach the page). The server's protocol hands a request with an
        # Origin to ASGI, so the tensor routes get the headers too (`TensorRoutes.cors`).
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.origins,
            allow_methods=["GET", "HEAD", "POST"],
            allow_headers=[
                "content-type",
                "content-encoding",
                TIMEOUT_HEADER,
                v2.HEADER_LENGTH,
            ],
            expose_headers=[v2.HEADER_LENGTH, "retry-after"],
            max_age=600,
        )
    app.add_middleware(
        MetricsMiddleware, metrics=service.metrics, paths=raw_routes, route_of=route_of
    )
    _add_error_handlers(app, answers)
    openapi.add_docs(app)

    # Documented as the one name and version served (schemathesis then reaches the model);
    # other values are still accepted by the router and answered 404 with a V2 error body.
    name_param = Path(description="the served model", json_schema_extra={"enum": [service.name]})
    version_param = Path(description="model version", json_schema_extra={"enum": [v2.VERSION]})

    # -- the routes that carry tensors: KServe V2 infer and /v1/predict ---------------------
    # Answered ahead of FastAPI (`TensorRoutes`), described in the OpenAPI schema by hand
    # (`openapi.raw_paths`) with the served model's names.
    max_rows, chw = settings.max_batch_rows, service.chw  # rows refused before decoding
    parse_slots = asyncio.Semaphore(PARSE_SLOTS)
    body_limit = settings.max_body_bytes

    async def parse_slot(hot: HotRequest) -> None:
        try:
            await acquire_unless_gone(
                parse_slots, "parse", service.timeout_s(hot.head), hot.watch, service.metrics
            )
        except TimeoutError:
            service.metrics.rejected("deadline")
            raise DeadlineExceeded(
                "deadline passed waiting to parse the JSON body: the server is busy parsing "
                "other large ones; retry, or send binary tensors to /v2/models/{name}/infer"
            ) from None

    def inflated(hot: HotRequest, limit: int) -> bytes:
        encoding = hot.head.encoding
        return hot.body if encoding is None else _decode_content(hot.body, encoding, limit)

    async def parse_body(
        hot: HotRequest, parse: Callable[[bytes], T], json_bytes: Callable[[bytes], int]
    ) -> T:
        """`parse(body)`: at once for a small body; in a worker thread for one of
        LARGE_BODY_BYTES or more, in one of PARSE_SLOTS where `json_bytes(body)` of JSON are
        that large. A compressed body is inflated first, in the slot where it inflates that
        large: inflated outside it, 100 gzip bodies of 16 KB each held 16 MiB as they waited
        for the slot, and took the server to 5 GB."""
        body = hot.body
        if hot.head.encoding is not None:  # rare: tritonclient's compression
            first = min(LARGE_BODY_BYTES - 1, body_limit)
            try:
                body = await in_thread(inflated, hot, first)
            except BodyTooLarge:  # inflates large: again, in a slot, and parsed there
                if first == body_limit:
                    raise
                await parse_slot(hot)
                try:
                    return await in_thread(lambda: parse(inflated(hot, body_limit)))
                finally:
                    parse_slots.release()
        if len(body) < LARGE_BODY_BYTES:  # no thread, no coroutine for a small body
            return parse(body)
        if json_bytes(body) < LARGE_BODY_BYTES:  # V2's binary tensors are read with no parse
            return await in_thread(parse, body)
        await parse_slot(hot)
        try:
            return await in_thread(parse, body)
        finally:
            parse_slots.release()

    async def v2_infer(hot: HotRequest) -> tuple[bytes, dict[str, str]]:
        service.check_model(hot.params["model_name"], hot.params.get("version"))
        length = hot.head.header_length

        def decode(body: bytes) -> v2.InferRequest:
            return v2.decode_request(body, length, service.input_name, v2.OUTPUTS, max_rows, chw)

        req = await parse_body(hot, decode, lambda body: v2.json_length(body, length))
        logits = await service.predict(req.x, service.timeout_s(hot.head, req.timeout_s), hot.watch)
        return v2.encode_response(logits, req.outputs, service.labels, service.name, req.id)

    async def v1_predict(hot: HotRequest) -> tuple[bytes, dict[str, str]]:
        # ?top_k=N as the image route takes it (it was ignored here); the body's wins
        top_k = v1.query_top_k(hot.params.get(QUERY), settings.top_k)

        def decode(body: bytes) -> tuple[np.ndarray, int]:
            return v1.decode_instances(body, chw, top_k, max_rows)

        x, top_k = await parse_body(hot, decode, len)
        logits = await service.predict(x, service.timeout_s(hot.head), hot.watch)
        content = v1.encode_predictions(logits, service.labels, top_k, service.name)
        return content, {"content-type": "application/json"}

    hot_handlers.update(v2_infer=v2_infer, v1_predict=v1_predict)
    raw_routes.update(TensorRoutes.PATHS)  # the metrics' route label, by handler name
    raw_paths = openapi.raw_paths(
        service.name,
        service.input_name,
        service.chw,
        settings.max_batch_rows,
        settings.compress_min_bytes,
    )
    fastapi_openapi = app.openapi

    def openapi_with_raw_routes() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = fastapi_openapi()  # FastAPI caches it in openapi_schema
            schema["paths"].update(raw_paths)
            openapi.drop_validation_errors(schema)
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi_with_raw_routes  # type: ignore[method-assign]

    @app.get("/v2", tags=["v2"], summary="Server metadata")
    async def v2_server() -> dict[str, Any]:
        return {
            "name": "lightship",
            "version": __version__,
            "extensions": ["binary_tensor_data", "classification", "model_configuration"],
        }

    @app.get("/v2/health/live", tags=["v2"], responses=openapi.errors(503))
    async def v2_live() -> Response:
        if broken := service.broken:
            return _error(503, broken)
        return Response(b'{"live":true}', media_type="application/json")

    # the model's answer names it, as the protocol's model ready response does
    model_ready = json.dumps({"name": service.name, "ready": True}, separators=(",", ":")).encode()

    def ready_response(ready: bytes = b'{"ready":true}') -> Response:
        broken = service.broken
        if service.ready and not broken:
            return Response(ready, media_type="application/json")
        return _error(503, broken or "not ready", {"retry-after": "1"})

    @app.get("/v2/health/ready", tags=["v2"], responses=openapi.errors(503))
    async def v2_ready() -> Response:
        return ready_response()

    platform = PLATFORMS.get(predictor.kind, predictor.kind)

    def metadata() -> dict[str, Any]:
        return v2.model_metadata(
            service.name,
            platform,
            service.input_name,
            service.chw,
            service.labels,
            settings.max_batch_rows,
        )

    def config() -> dict[str, Any]:
        return v2.model_config(
            service.name,
            platform,
            service.input_name,
            service.chw,
            len(service.labels),
            settings.max_batch_rows,
            settings.max_wait_ms,
            settings.instances,
            predictor.device.startswith("cuda"),
        )

    model_doc = openapi.response(openapi.V2_MODEL_METADATA, "inputs, outputs and labels")
    config_doc = openapi.response(openapi.V2_MODEL_CONFIG, "Triton's model configuration")

    @app.get(
        "/v2/models/{model_name}",
        tags=["v2"],
        summary="Model metadata",
        responses={**model_doc, **openapi.errors(404)},
    )
    async def v2_model(model_name: str = name_param) -> dict[str, Any]:
        service.check_model(model_name)
        return metadata()

    @app.get(
        "/v2/models/{model_name}/versions/{version}",
        tags=["v2"],
        summary="Model metadata",
        responses={**model_doc, **openapi.errors(404)},
    )
    async def v2_model_version(
        model_name: str = name_param, version: str = version_param
    ) -> dict[str, Any]:
        service.check_model(model_name, version)
        return metadata()

    @app.get(
        "/v2/models/{model_name}/config",
        tags=["v2"],
        summary="Model configuration (Triton's extension: max_batch_size, dims)",
        responses={**config_doc, **openapi.errors(404)},
    )
    async def v2_model_config(model_name: str = name_param) -> dict[str, Any]:
        service.check_model(model_name)
        return config()

    @app.get(
        "/v2/models/{model_name}/versions/{version}/config",
        tags=["v2"],
        summary="Model configuration (Triton's extension: max_batch_size, dims)",
        responses={**config_doc, **openapi.errors(404)},
    )
    async def v2_model_version_config(
        model_name: str = name_param, version: str = version_param
    ) -> dict[str, Any]:
        service.check_model(model_name, version)
        return config()

    @app.get("/v2/models/{model_name}/ready", tags=["v2"], responses=openapi.errors(404, 503))
    async def v2_model_ready(model_name: str = name_param) -> Response:
        service.check_model(model_name)
        return ready_response(model_ready)

    @app.get(
        "/v2/models/{model_name}/versions/{version}/ready",
        tags=["v2"],
        responses=openapi.errors(404, 503),
    )
    async def v2_model_version_ready(
        model_name: str = name_param, version: str = version_param
    ) -> Response:
        service.check_model(model_name, version)
        return ready_response(model_ready)

    # -- simple JSON and images ------------------------------------------------------------
    decode_slots = asyncio.Semaphore(DECODE_SLOTS)

    @app.post(
        IMAGE_ROUTE,
        tags=["v1"],
        summary="Labels and top-k probabilities for uploaded PNG/JPEG files",
        description=IMAGE_ROUTE_DOC.format(c=service.chw[0], h=service.chw[1], w=service.chw[2]),
        responses={
            **openapi.response(openapi.V1_IMAGE_RESPONSE, "one prediction per file, in order"),
            **openapi.errors(400, 408, 413, 415, 429, 503, 504),
        },
        openapi_extra=openapi.image_body(IMAGES_FIELD, settings.max_batch_rows),
    )
    async def v1_predict_image(request: Request) -> Response:
        # read as /v1/predict reads it: FastAPI's int took " 2", "2.0", "+2" and the last of two
        top_k = v1.query_top_k(request.url.query, settings.top_k)
        contents = await _uploaded_images(request, settings.max_batch_rows)
        # read after the upload: one that arrived past the deadline, within its allowance,
        # has the deadline again from its end (`body_arrived`)
        deadline = time.monotonic() + service.timeout_s(head_of(request.scope))

        def decode_all(gone: _Departure) -> np.ndarray | None:
            """The images stacked, or None once the client has left (between two images: one
            photo takes up to ~0.6 s, and 8 of them decoded on for no one)."""
            images: list[np.ndarray] = []
            for data, name in contents:
                if gone.future.done():  # a read of a flag the event loop sets: no lock needed
                    return None
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(
                        f"deadline passed while decoding the images ({len(images)} of "
                        f"{len(contents)} done): send smaller images or allow more time"
                    )
                images.append(v1.decode_image(data, service.chw, name))
            return np.stack(images)

        # Decoding a large photo takes milliseconds: keep it off the event loop, and decode
        # only as many requests' images at once as there are slots (memory, see DECODE_SLOTS),
        # each request's within a budget of pixels, so that it holds its slot briefly (one
        # image is within it: over v1.MAX_IMAGE_PIXELS it is refused as it opens).
        if len(contents) > 1:
            await in_thread(v1.check_decode_budget, [data for data, _ in contents], service.chw)
        # the upload was read whole: a client that closed is seen now, not at its deadline
        watch = asgi_watch(request.receive, after_s=0)
        try:
            await acquire_unless_gone(
                decode_slots, "decode", deadline - time.monotonic(), watch, service.metrics
            )
        except TimeoutError:
            service.metrics.rejected("deadline")
            raise DeadlineExceeded(
                "deadline passed waiting to decode the images: the server is busy decoding "
                "others; retry, or send tensors to /v1/predict"
            ) from None
        gone = _Departure()
        stop = watch(gone)
        try:
            x = await in_thread(decode_all, gone)
        except DeadlineExceeded:
            service.metrics.rejected("deadline")
            raise
        finally:
            stop()
            decode_slots.release()
        if x is None or gone.future.done():
            service.metrics.rejected("disconnected")
            raise ClientGone()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            service.metrics.rejected("deadline")
            raise DeadlineExceeded("deadline passed while decoding the images")
        # Watched from the start: an upload costs milliseconds to decode, where a watch costs
        # tens of µs, and a client that left while its images decoded is dropped before compute
        logits = await service.predict(x, remaining, watch)
        return Response(
            v1.encode_predictions(
                logits,
                service.labels,
                top_k,
                service.name,
                [name for _, name in contents],
            ),
            media_type="application/json",
        )

    @app.get(
        "/metrics",
        tags=["metrics"],
        summary="Prometheus metrics",
        response_class=PlainTextResponse,
        responses={200: {"content": {CONTENT_TYPE.split(";")[0]: {}}}},
    )
    async def metrics() -> Response:
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)

    return app


ErrorAnswer = Callable[[Any], Response]


def _error_answers(service: Service) -> dict[type[Exception], ErrorAnswer]:
    """How each error a route raises is answered: status, `{"error": ...}` body, headers. One
    table for FastAPI's exception handlers and for `TensorRoutes`."""

    def answer(
        status: int | Callable[[Any], int], headers: Callable[[Any], dict[str, str]] | None = None
    ) -> ErrorAnswer:
        def respond(exc: Any) -> Response:
            code = status(exc) if callable(status) else status
            return _error(code, str(exc), headers(exc) if headers else None)

        return respond

    def not_ready(exc: Any) -> dict[str, str]:
        service.metrics.rejected("not_ready")
        return {"retry-after": "1"}

    def too_large(exc: Any) -> Response:
        # closing: the rest of a body still arriving would be read only to be thrown away
        service.metrics.rejected("body_too_large")
        closing = None if exc.whole else {"connection": "close"}
        return _error(413, str(exc), closing)

    def client_disconnect(exc: Any) -> Response:
        # Nobody reads this answer; it exists for the metrics (status 499, like nginx).
        service.metrics.rejected("disconnected")
        return _error(CLIENT_CLOSED, "client disconnected before sending the whole body")

    return {
        ProtocolError: answer(lambda e: e.status),
        EncodingRefused: answer(415, lambda e: {"accept-encoding": e.accepted}),
        InputError: answer(400),
        TooManyRows: answer(413),
        BodyTooLarge: too_large,
        QueueFull: answer(429, lambda e: {"retry-after": str(e.retry_after_s)}),
        DeadlineExceeded: answer(504),
        ClientGone: answer(CLIENT_CLOSED),
        Closed: answer(503, not_ready),
        WorkerDied: answer(503),  # counted by the batcher
        BodyTimeout: answer(lambda e: e.status, lambda e: {"connection": "close"}),
        NotReady: answer(503, not_ready),
        InferenceFailed: answer(500),
        ClientDisconnect: client_disconnect,
    }


def _answer_for(answers: dict[type[Exception], ErrorAnswer], exc: BaseException) -> Response | None:
    """The answer to `exc` by its most specific class in `answers`, as Starlette looks it up."""
    for cls in type(exc).__mro__:
        if (respond := answers.get(cls)) is not None:
            return respond(exc)
    return None


def _add_error_handlers(app: FastAPI, answers: dict[type[Exception], ErrorAnswer]) -> None:
    def handler(respond: ErrorAnswer) -> Callable[[Request, Any], Awaitable[Response]]:
        async def handle(request: Request, exc: Any) -> Response:
            if isinstance(exc, ClientDisconnect) and REFUSED in request.scope:
                # the protocol refused the body (a malformed chunk) and closed: no client left
                return answers[ClientGone](ClientGone())
            return respond(exc)

        return handle

    for cls, respond in answers.items():
        app.add_exception_handler(cls, handler(respond))

    async def http_error(request: Request, exc: Any) -> Response:
        detail = str(exc.detail)
        headers = getattr(exc, "headers", None)
        if exc.status_code == 404 and detail == "Not Found":  # the router's: no such route
            detail = not_found(request.url.path)
        elif exc.status_code == 405 and detail == "Method Not Allowed" and headers:
            # the router's, as the tensor routes say it: which method the path takes
            allow = next((v for k, v in headers.items() if k.lower() == "allow"), "")
            allowed = " or ".join(m.strip() for m in allow.split(","))
            detail = f"use {allowed} for {request.url.path}"
        return _error(exc.status_code, detail, headers)

    async def validation_error(request: Request, exc: Any) -> Response:
        # 400 like every other bad input here, not FastAPI's 422 (openapi.py drops the 422
        # FastAPI documents for every route with parameters).
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()
        )
        return _error(400, f"invalid request: {problems}")

    async def server_error(request: Request, exc: Exception) -> Response:
        # Starlette's outermost middleware sends this, then re-raises for uvicorn to log; its
        # own answer is text, which tritonclient fails to decode.
        return _error(500, BUG)

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, server_error)


# Triton's other V2 extensions, which tritonclient has calls for: what to use here instead.
STATISTICS = (
    "the statistics extension is not served here: this server's request, queue and batch "
    "figures are Prometheus metrics at /metrics"
)
_EXTENSIONS = (
    (re.compile(r"/v2/models/[^/]+(/versions/[^/]+)?/stats/?"), STATISTICS),
    (
        re.compile(r"/v2/repository(/.*)?"),
        "the model repository extension is not served here: the server serves the one model "
        "it started with (GET /v2/models/{name} describes it)",
    ),
    (
        re.compile(r"/v2/(system|cuda)sharedmemory(/.*)?"),
        "the shared-memory extensions are not served here: send the tensors in the request, "
        "as JSON or binary data (binary_tensor_data)",
    ),
    (
        re.compile(r"/v2(/models/[^/]+(/versions/[^/]+)?)?/trace(/.*)?"),
        "the trace extension is not served here: --access-log logs each request, and /metrics "
        "has their latency",
    ),
    (
        re.compile(r"/v2/logging/?"),
        "the logging extension is not served here: the server's --log-level sets it at start",
    ),
)


def not_found(path: str) -> str:
    """The 404 of a path no route has: a V2 extension this server lacks says what to use."""
    for pattern, message in _EXTENSIONS:
        if pattern.fullmatch(path):
            return message
    if len(path) > 1 and path.endswith("/"):
        return f"no route {path}: the routes take no trailing slash ({path.rstrip('/')})"
    return f"no route {path}: the routes are listed at /docs (GET /v2 describes the server)"


IMAGE_ROUTE = v1.IMAGE_ROUTE
IMAGES_FIELD = v1.IMAGES_FIELD
IMAGE_ROUTE_DOC = (
    "Each file becomes one {c} x {h} x {w} input the way training reads an image file: turned "
    "upright by its EXIF orientation, converted to gray or RGB with any alpha dropped, and "
    "resized to {h} x {w}: no crop, no inversion. Send images like the training data. The "
    "embedded digits model learnt light strokes on a dark background, the digit filling the "
    "frame: a dark digit on white paper, a small digit in a large frame, or strokes on a "
    "transparent canvas (a blank image once the alpha is dropped) get a wrong label with a high "
    "score."
)
SEND_IMAGES = f'send one or more images as multipart form field "{IMAGES_FIELD}"'


async def _uploaded_images(request: Request, limit: int) -> list[tuple[bytes, str]]:
    """(bytes, file name) of each file in the form field IMAGES_FIELD, at most `limit`.

    The route parses its form itself, not FastAPI: a form that is not what it takes is answered
    400 with what to send (FastAPI: 422 and its own wording), and the parser stops at the file
    after `limit`, where FastAPI's would spool 1,000 files before the route could count them.
    """
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):  # the parser would read the compressed bytes as a form
        raise EncodingRefused(
            f"Content-Encoding {encoding} is not supported: send the body uncompressed "
            "(PNG and JPEG are compressed already)",
            "identity",
        )
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "multipart/form-data":
        raise ProtocolError(SEND_IMAGES)
    async with aclosing(request.stream()) as stream:
        form = _ImageForm(request.headers, stream, limit)
        images = await form.images()
    if len(images) < form.count:  # a part begun and never closed: the body was cut short
        raise ProtocolError(
            f"the form ends inside its file part {form.count}, before the boundary that closes "
            f"it: send the whole form ({SEND_IMAGES})"
        )
    if not images:
        raise ProtocolError(SEND_IMAGES)
    return images


class _ImageForm(MultiPartParser):
    """Starlette's multipart parser, refusing as its part begins: text in IMAGES_FIELD, the
    image after `limit`, and a file in any other field (skipped, the client's image would be
    lost unsaid; counted, it would take an image's place under the limit)."""

    # Files kept in memory, never spooled to disk past Starlette's 1 MB: each is read back
    # whole (`images`) and the body is within --max-body-bytes, so the disk bought nothing,
    # and with no writable temporary directory (a read-only root) an upload over 1 MB was a
    # 500, "a bug".
    spool_max_size = sys.maxsize

    def __init__(self, headers: Headers, stream: AsyncGenerator[bytes, None], limit: int) -> None:
        super().__init__(headers, stream, max_files=math.inf)
        self.limit = limit
        self.count = 0

    def on_headers_finished(self) -> None:
        super().on_headers_finished()
        name = self._current_part.field_name
        if self._current_part.file is None:
            if name == IMAGES_FIELD:
                raise ProtocolError(
                    f'form field "{name}" holds text, a part with no filename: {SEND_IMAGES}, '
                    'each part with a filename (Content-Disposition: form-data; name="files"; '
                    'filename="a.png"), as `curl -F files=@a.png` sends it'
                )
            return
        if name != IMAGES_FIELD:
            raise ProtocolError(f'form field "{name}" holds a file: {SEND_IMAGES}')
        self.count += 1
        if self.count > self.limit:
            raise TooManyRows(
                f"request has more than {self.limit} images; this server takes at most "
                f"{self.limit} per request: split it"
            )

    async def images(self) -> list[tuple[bytes, str]]:
        try:
            form = await self.parse()
        except MultiPartException as exc:
            raise self.refusal(exc) from None
        try:
            files = [f for f in form.getlist(IMAGES_FIELD) if isinstance(f, UploadFile)]
            return [(await f.read(), f.filename or f"file {i}") for i, f in enumerate(files)]
        finally:
            await form.close()

    def refusal(self, exc: MultiPartException) -> ProtocolError:
        """Starlette's error for a form it cannot parse, said as what was wrong and what to send
        (its messages: starlette/formparsers.py)."""
        wrong, status = exc.message.rstrip("."), 400
        if wrong.startswith("Missing boundary"):
            wrong = "multipart Content-Type without a boundary (let the client write that header)"
        elif wrong.startswith("Invalid multipart data"):
            wrong = f"body is not a valid multipart form ({exc.__cause__})"
        elif wrong.startswith("The Content-Disposition"):
            wrong = "a part of the form has no name in its Content-Disposition header"
        elif wrong.startswith("Too many fields"):
            wrong, status = f"form has more than {self.max_fields} text fields", 413
        elif wrong.startswith("Part exceeded"):
            wrong, status = f"a text field is over {self.max_part_size // 1024} KiB", 413
        return ProtocolError(
            f"{wrong}: {SEND_IMAGES}, e.g. `curl -F {IMAGES_FIELD}=@digit.png URL`", status
        )


class LogFormatter(logging.Formatter):
    """A server's log line: `2026-11-29T04:50:01.123Z INFO lightship.serve.app: ready: ...`.

    A line read from a file, or beside a client's or another server's log, says when it was
    written (UTC, to the millisecond) and by what; uvicorn's lines said neither ("INFO:
    Started server process"). `lightship serve` gives lightship's lines this form too."""

    FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

    def __init__(self, fmt: str | None = None) -> None:
        super().__init__(fmt or self.FORMAT)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{when}.{int(record.msecs):03d}Z"


class AccessLogFormatter(AccessFormatter):
    """uvicorn's access line (its formatter reads the request from the record's arguments), at
    the time and in the form of `LogFormatter`'s."""

    formatTime = LogFormatter.formatTime


# uvicorn's own logging (its defaults: its lines on stderr, the access log on stdout), in the
# form of lightship's lines and with their time.
LOG_CONFIG: dict[str, Any] = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "default": {
            "()": f"{__name__}.LogFormatter",
            "fmt": "%(asctime)s %(levelname)s uvicorn: %(message)s",
        },
        "access": {
            "()": f"{__name__}.AccessLogFormatter",
            "fmt": '%(asctime)s %(levelname)s %(name)s: %(client_addr)s - "%(request_line)s" '
            "%(status_code)s",
            "use_colors": False,
        },
    },
    "handlers": {
        "default": {
            "formatter": "default",
            "class": "logging.StreamHandler",
            "stream": "ext://sys.stderr",
        },
        "access": {
            "formatter": "access",
            "class": "logging.StreamHandler",
            "stream": "ext://sys.stdout",
        },
    },
    "loggers": {
        "uvicorn": {"handlers": ["default"], "level": "INFO", "propagate": False},
        "uvicorn.error": {"level": "INFO"},
        "uvicorn.access": {"handlers": ["access"], "level": "INFO", "propagate": False},
    },
}


def serve(settings: ServeSettings) -> None:
    """Choose and check the artifact, load it, run uvicorn until SIGTERM/SIGINT. Called from
    Python, it leaves the process's SIGTERM handler and GIL switch interval as they were."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # none: uvicorn runs its own
    else:
        raise ConfigError(
            "serve() runs its own event loop and this thread is in one (a notebook's): call it "
            "from a thread of its own or a script, or run `lightship serve`"
        )
    sock = _listen(settings.host, settings.port)  # a taken port fails before the model loads
    try:
        service, served = _serve_on(sock, settings)
    finally:  # uvicorn closed it, unless the model failed to load first
        sock.close()
    if service.failed is not None:
        other = "another model file" if served.variant == "file" else "another --variant"
        raise RunError(
            f"{service.failed}; the server stopped: serve {other}, or export or quantize this "
            "one again"
        )


def _serve_on(sock: socket.socket, settings: ServeSettings) -> tuple[Service, ServedModel]:
    """`serve`'s work once its socket listens: the model chosen, checked and loaded, then
    uvicorn until SIGTERM/SIGINT (from a thread other than the main one, until the process
    ends: only the main thread can take signals)."""
    from lightship.serve.model import choose, verify

    served = choose(settings)
    verify(served, settings.isa_check, device=settings.device)
    cores = physical_cores()
    threads = settings.model_threads(served.path)
    if warning := _oversubscribed(settings, cores, threads):  # before the sessions open them
        log.warning("%s", warning)
    if warning := _batch_dependent(served, settings):
        log.warning("%s", warning)
    predictor = served.load(settings.device, threads, settings.split_batches)
    if served.entry is not None:
        # hashed by `verify`, then opened again to load: a stage that renamed a new file in
        # meanwhile (quantize, export) had its file served under the old entry, never checked
        from lightship.runs import check_recorded

        check_recorded(
            served.path, served.entry, "it was replaced while it loaded; start the server again"
        )
    app = create_app(predictor, served, settings)
    service: Service = app.state.service
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=http_protocol(app.state.tensor_routes),
        workers=1,
        log_config=LOG_CONFIG,
        access_log=settings.access_log,
        log_level=settings.log_level,
        # Accepted requests finish within their deadline; give shutdown that long, then go
        # (and, under a second's deadline, time for a 503's lingering close: body_stop_after_s).
        timeout_graceful_shutdown=max(int(settings.timeout_ms / 1000) + 5, int(LINGER_S) + 2),
    )
    server = _Server(config, service)
    # A model that fails its warm-up will never serve: said and gone, as Triton's
    # --exit-on-error does, not a process up forever with liveness 503 (`lightship serve` in a
    # shell would never return; an orchestrator restarts it either way).
    service.on_failed = server.stop_failed
    switch_interval = sys.getswitchinterval()

    # uvicorn re-raises SIGTERM after its graceful shutdown, so that the previous handler runs:
    # by default, death by signal (status 143). A drained server has done its job: that
    # handler does nothing then, and the process exits 0. A SIGTERM before uvicorn takes the
    # signal (the lines below, asyncio making its loop) stops the server as uvicorn's own
    # handler would: a no-op here had swallowed it, and the server went on to serve until a
    # second signal. Only the main thread takes signals (uvicorn handles none in another).
    def stop_unless_stopping(signum: int, frame: FrameType | None) -> None:
        if not server.should_exit:
            server.handle_exit(signum, frame)

    main = threading.current_thread() is threading.main_thread()
    on_sigterm = signal.signal(signal.SIGTERM, stop_unless_stopping) if main else None
    frozen = gc.get_freeze_count()  # the warm-up freezes what the process holds (`warm_up`)
    try:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        cpu = host_cpu()  # what the int8 ISA check (`verify`) compared the model with
        log.info(
            "CPU: %s, this CPU's int8 target %s; %d cores for this process",
            cpu.describe(),
            cpu.target,
            cores,
        )
        log.info(
            "serving '%s' (%s%s: %s; %s) at %s  (docs at /docs)",
            served.name,
            served.variant,
            f", {served.chosen_by}" if served.chosen_by else "",
            served.path,
            _count(settings.instances, "instance") + " x " + _count(threads, "thread"),
            _url(settings.host, sock.getsockname()[1]),
        )
        server.run(sockets=[sock])
    finally:  # the SIGTERM uvicorn re-raised has met a server stopping by now
        if main:
            signal.signal(signal.SIGTERM, on_sigterm)
        sys.setswitchinterval(switch_interval)
        if not frozen:  # a caller's cyclic garbage, frozen with the rest, was never freed
            gc.unfreeze()
        # The model goes with the server: FastAPI's cache of route callables keeps each app
        # made in a process, and its model with it, after serve() returns.
        if not service.batcher.running:
            predictor.close()
    return service, served


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _url(host: str, port: int) -> str:
    """The server's URL: an IPv6 address in brackets (RFC 3986), http://[::]:8000."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _oversubscribed(settings: ServeSettings, cores: int, threads: int) -> str | None:
    """A warning when the model instances, `threads` each, run more threads than there are
    cores: a batch's parallel work ends with its last thread, and a thread left waiting for a
    core holds it up."""
    total = settings.instances * threads
    if total <= cores:
        return None
    fixes = []
    if settings.threads is not None and settings.threads > max(1, cores // settings.instances):
        fixes.append("--threads unset (cores / instances)")
    if settings.instances > cores:
        fixes.append(f"--instances {cores} or fewer")
    return (
        f"{_count(settings.instances, 'instance')} x {_count(threads, 'thread')} = {total} "
        f"inference threads on {cores} cores: the threads beyond the cores take turns on them "
        f"and slow every batch; serve with {' and '.join(fixes)}"
    )


def _batch_dependent(served: ServedModel, settings: ServeSettings) -> str | None:
    """A warning when the answers depend on the batch: dynamic int8 quantizes activations with
    a scale computed from each batch, and the batcher puts requests of different clients in
    one (digits: logits moved by up to 0.1 beside other clients' rows; no label changed); a
    model that computes batch statistics in eval, which export measured and recorded in the
    entry (`batch_dependent`), does so at any precision."""
    if settings.max_batch_rows == 1:
        return None
    lone = served.variant == "file"  # --variant is ignored then
    what = served.path.name if lone else served.variant
    entry = served.entry or {}
    measured = entry.get("batch_dependent")
    if measured is None and entry.get("format") == "lightning-checkpoint":
        measured = _measured_by_export(served.path, entry.get("sha256"))
    if isinstance(measured, dict):
        try:
            one, many = (int(b) for b in measured["batches"])
            diff = float(measured["max_abs_logit_diff"])
        except (KeyError, TypeError, ValueError):  # an entry edited by hand: said without figures
            moved = ""
        else:
            moved = f" (export measured max |Δlogit| {diff:.2e} between batch {one} and {many})"
        return (
            f"{what}'s logits for an image depend on the other images in its batch{moved}: "
            "served, a request's answer changes with the requests batched with it "
            f"(--max-batch-rows {settings.max_batch_rows}); serve with --max-batch-rows 1 for "
            "answers independent of traffic"
        )
    if served.entry is not None:
        dynamic = (
            served.entry.get("quantization") == "dynamic" or served.variant == "onnx-int8-dynamic"
        )
    else:  # a lone file, by any name: an ONNX file's own metadata says
        dynamic = (
            served.path.suffix == ".onnx"
            and file_metadata(served.path).get(QUANTIZATION) == "dynamic"
        )
    if not dynamic:
        return None
    return (
        f"{what} is dynamic int8: it scales activations "
        "per batch, so a request's logits shift slightly with the other requests batched with "
        f"it (--max-batch-rows {settings.max_batch_rows}); for answers independent of traffic "
        + (
            "serve a static, QAT or fp32 model file"
            if lone
            else "serve --variant onnx-int8-static, onnx-int8-qat or onnx-fp32"
        )
    )


def _measured_by_export(checkpoint: pathlib.Path, sha256: object) -> Any:
    """What export measured of the batch dependence of a run's best.ckpt (`--variant
    checkpoint`, or the file itself): export records it in the entries of the files it made
    from that checkpoint, not in the checkpoint's own. None where none says so."""
    try:
        artifacts = RunDir(checkpoint.resolve().parent).manifest()["artifacts"]
    except (LightshipError, OSError):
        return None
    for entry in artifacts.values():
        made_from_it = isinstance(entry, dict) and entry.get("source_checkpoint_sha256") == sha256
        if made_from_it and entry.get("batch_dependent") is not None:
            return entry["batch_dependent"]
    return None


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn listens on it); ConfigError in one line if not."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(
            f"cannot listen on host {host!r} ({exc}): pass --host 127.0.0.1, 0.0.0.0 or an "
            "address of this machine"
        ) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        fix = (
            "pass --host 127.0.0.1, 0.0.0.0 or an address of this machine"
            if exc.errno == errno.EADDRNOTAVAIL
            else "pass a free --port, or stop what holds it"
        )
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}): {fix}"
        ) from None
    sock.set_inheritable(True)
    return sock


class _DatedState(uvicorn.server.ServerState):
    """uvicorn's server state, whose default headers (Date, and `--header`s) are made when an
    answer reads them in a new second, not renewed by a loop waking once a second for them."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._config = config
        self._second = -1
        self._headers: list[tuple[bytes, bytes]] = []
        # SIGTERM came: every answer from now on closes its connection (`closing_answers`)
        self.stopping = False
        super().__init__()

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]:
        now = time.time()
        if int(now) != self._second:
            self._second = int(now)
            date = [(b"date", formatdate(now, usegmt=True).encode())]
            self._headers = (date if self._config.date_header else []) + list(
                self._config.encoded_headers
            )
        return self._headers

    @default_headers.setter
    def default_headers(self, value: list[tuple[bytes, bytes]]) -> None:
        """uvicorn sets them (`Server.on_tick`); they are made above instead."""


class _Server(uvicorn.Server):
    """uvicorn's server, which on SIGTERM also turns not-ready and lets the batcher drain."""

    server_state: _DatedState

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service
        self.server_state = _DatedState(config)

    # Connections accepted just before SIGTERM may not have delivered their request yet, and
    # uvicorn's shutdown closes every connection without one: give them this long to arrive.
    ACCEPTED_GRACE_S = 0.25

    # uvicorn's main loop wakes 10 times a second to see whether it should stop and to renew
    # the Date header, which an idle server pays for: on VMs that charge each wake-up from
    # idle, 1.5-1.9 % of a core (one waking once a second: ~0.8 %). This one sleeps until told
    # to stop (`_wake`; the minute is a backstop), and the Date header is made when read.
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: asyncio.Event | None = None
    STOP_BACKSTOP_S = 60.0

    async def main_loop(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        counter = 1  # on_tick's every-10th work is the Date header's, done in _DatedState
        while not await self.on_tick(counter):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.STOP_BACKSTOP_S)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, but each listening socket takes every connection waiting at a turn of
        the loop (`Acceptor`), where uvloop's server takes one."""
        if sockets is None or sys.platform == "win32":  # a proactor loop has no add_reader
            await super().startup(sockets)
            return
        await super().startup([])  # the lifespan's start-up and its failure exit, no listener
        config = self.config

        def create_protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state
            )

        loop = asyncio.get_running_loop()
        self.servers = [Acceptor(loop, sock, create_protocol, config.backlog) for sock in sockets]  # type: ignore[misc]

    def _wake(self) -> None:
        """Wake `main_loop` at once: from a signal handler, through the loop's self-pipe."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.server_state.stopping = True
        self.service.begin_shutdown()
        super().handle_exit(sig, frame)
        self._wake()
        if (loop := self._loop) is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._close_after_answers)

    def _close_after_answers(self) -> None:
        """The requests under way at SIGTERM (queued for their batch, say) are answered with
        Connection: close, as those read from now on are: the queue ran at once, and their
        answers went out kept alive, their connections closed idle half a second later. A
        connection's last request read, as `shutdown` does: those pipelined before it are
        answered first, kept alive."""
        for connection in self.server_state.connections:
            cycle = getattr(connection, "cycle", None)
            if cycle is not None and not cycle.response_complete:
                mark = getattr(connection, "mark_closing", None)  # the server's own protocol
                if mark is not None:
                    mark(cycle)
                else:
                    cycle.keep_alive = False

    def stop_failed(self) -> None:
        """Stop serving a model that failed its warm-up: no request was taken (not ready)."""
        self.should_exit = True
        self._wake()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if not self.service.failed:  # a drain, said with its limit (a grace period shorter
            # than it ends in SIGKILL, the requests still under way cut off)
            log.info(
                "stopping: not ready, no new connections; answering the %d queued rows and "
                "the requests under way, for %d s at most",
                self.service.batcher.queued_rows,
                self.config.timeout_graceful_shutdown or 0,
            )
        for server in self.servers:  # stop accepting first
            server.close()
        await asyncio.sleep(self.ACCEPTED_GRACE_S)
        await super().shutdown(sockets)
