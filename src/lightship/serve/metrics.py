"""Prometheus metrics of the server: HTTP requests, the queue, batches, rejections, and the
process (CPU, memory, file descriptors, garbage collector) beside them.

One registry per app (not the global one), so several apps in a test process do not collide.
The server is one process (uvicorn `workers=1`): no multiprocess mode. `Metrics` is also the
batcher's `Observer`, attached after the warm-up batch so that only served traffic counts;
`MetricsMiddleware` times every HTTP request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Seconds, 1-2.5-5 steps from 50 µs to 10 s (the default deadline): a request that never
# reaches a model takes ~50 µs, the digits model computes a batch in ~0.4 ms, ResNet-18 a batch
# of 64 in hundreds; 17 buckets (Prometheus' default has 14, from 5 ms).
LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1, 2.5, 5, 10,
)  # fmt: skip
REJECTION_REASONS = (
    "queue_full",
    "deadline",
    "disconnected",
    "body_too_large",
    "body_timeout",
    "not_ready",
    "worker_died",
    # refused by the HTTP protocol before there was a request to route (`protocol.py`)
    "bad_http",
    "head_too_large",
    "head_timeout",
    "pipeline_full",
    # a client that read none of its answers for a while (`protocol.WRITE_TIMEOUT_S`): dropped
    "write_timeout",
)
# What a request may wait its turn for before it is queued: `lightship_slot_wait_seconds`
SLOTS = ("parse", "decode")
CONTENT_TYPE = CONTENT_TYPE_LATEST
# Scope key: the status the HTTP protocol answered a request with while its app still ran (a
# malformed chunked body): counted in its place, since the app's answer never left
REFUSED = "lightship.refused"
# Scope key: the client left before the answer was written (the server's HTTP protocol sets
# it): an answer the app makes after that reaches no one, and counts 499 and `disconnected`
LEFT = "lightship.left"
# Scope key: when (time.perf_counter()) a request read while another on its connection was
# still being answered (HTTP pipelining) was read: its latency counts from then, not from its
# turn (the protocol sets it; uvicorn starts a pipelined request's task only at its turn)
ARRIVED = "lightship.arrived"
# Routes that probes and scrapes call every few seconds: their answers grow no heap to speak of,
# and counted as traffic, a Kubernetes readiness probe every 5 s (deploy/kubernetes) or a
# Prometheus scrape kept the server from ever being quiet, and the heap a burst grew was never
# handed back (`memory.trim_when_quiet` watches `Metrics.answered`, which leaves them out)
POLLED = frozenset(
    {
        "/metrics",
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/{model_name}/ready",
        "/v2/models/{model_name}/versions/{version}/ready",
    }
)
# Status for a client that left before its answer (nginx's convention); only metrics see it.
CLIENT_CLOSED = 499


def latency_buckets(longest_s: float) -> tuple[float, ...]:
    """LATENCY_BUCKETS, then on in 1-2.5-5 steps to the longest a request may take (an upload
    over a slow link has its body's allowance past the deadline: `app.Service`): past the last
    bound every latency is +Inf, and a quantile there reads as the last bound. 10 s and a
    16 MiB body (306 s at most): 5 more buckets, to 500 s."""
    buckets = list(LATENCY_BUCKETS)
    step = 0
    while buckets[-1] < longest_s:
        buckets.append(buckets[-1] * (2.5, 2, 2)[step % 3])  # 10 -> 25 -> 50 -> 100 ...
        step += 1
    return tuple(buckets)


def rows_buckets(max_batch_rows: int) -> tuple[int, ...]:
    """Powers of two below the largest batch, then one row short of it and the largest batch
    itself: `le=max` minus `le=max-1` counts the full batches (if most are, a larger
    --max-batch-rows may pay)."""
    powers = [2**i for i in range(max_batch_rows.bit_length()) if 2**i < max_batch_rows - 1]
    return (*powers, *range(max(max_batch_rows - 1, 1), max_batch_rows + 1))


class Metrics:
    def __init__(self, max_batch_rows: int, longest_s: float = LATENCY_BUCKETS[-1]) -> None:
        self.registry = CollectorRegistry()
        seconds = latency_buckets(longest_s)  # `longest_s`: the longest a request may take
        r = self.registry
        # process_* and python_*, as the global registry has them: read when scraped, not
        # per request (GC statistics are gc.get_stats(), no callbacks)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.request_seconds = Histogram(
            "lightship_request_duration_seconds",
            "HTTP request latency, from its head read to its answer handed to the socket (body "
            "upload included), by route and status class (2xx, 4xx, 5xx: 2xx apart from quick "
            "refusals, a 429 in ~0.1 ms; 4xx mixes those with slow ones, 408 and 499; "
            "lightship_requests_total counts each status)",
            ["route", "status_class"],
            buckets=seconds,
            registry=r,
        )
        self.requests = Counter(
            "lightship_requests",
            "HTTP requests by route and status: 200 is an answer handed to the socket; 499, "
            "never sent, a request whose client left before its answer (or was dropped, "
            "write_timeout, reading none); requests the HTTP protocol refused before routing "
            "are counted only in lightship_rejections_total",
            ["route", "status"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "lightship_queue_wait_seconds",
            "time a request waited for its batch to start (requests that reached the model)",
            buckets=seconds,
            registry=r,
        )
        self.slot_wait = Histogram(
            "lightship_slot_wait_seconds",
            "time a request waited for its turn to parse a large JSON body (slot=parse) or to "
            "decode its uploaded images (slot=decode), before any queue wait (requests that got "
            "their turn)",
            ["slot"],
            buckets=seconds,
            registry=r,
        )
        self._slot_waits = {slot: self.slot_wait.labels(slot) for slot in SLOTS}
        self.compute = Histogram(
            "lightship_compute_seconds", "model time per batch", buckets=seconds, registry=r
        )
        self.batch_rows = Histogram(
            "lightship_batch_rows",
            "rows per batch run by the model (le=max_batch_rows minus le=max_batch_rows-1: "
            "full batches)",
            buckets=rows_buckets(max_batch_rows),
            registry=r,
        )
        self.queue_rows = Gauge("lightship_queue_rows", "rows waiting for a batch", registry=r)
        self.rejections = Counter(
            "lightship_rejections",
            "requests refused or given up, by reason: one per request, which "
            "lightship_requests_total counts too, for queue_full, deadline, disconnected, "
            "body_too_large, body_timeout, not_ready and worker_died (a deadline or a client "
            "gone while its batch ran comes after the model); one per connection closed, in no "
            "route's count, for bad_http, head_too_large, head_timeout, pipeline_full and "
            "write_timeout",
            ["reason"],
            registry=r,
        )
        for reason in REJECTION_REASONS:  # export zeros, so a rate() has a series from the start
            self.rejections.labels(reason)
        self.model_info = Gauge(
            "lightship_model_info",
            "the model served (value 1)",
            ["name", "variant", "backend", "device"],
            registry=r,
        )
        self.build_info = Gauge(
            "lightship_build_info",
            "versions of lightship, the runtime that runs the model, and Python (value 1)",
            ["version", "runtime", "runtime_version", "python"],
            registry=r,
        )
        self._children: dict[tuple[str, int], tuple[Any, Any]] = {}
        # requests answered over HTTP but the probes' and scrapes' (POLLED):
        # `memory.trim_when_quiet` watches it
        self.answered = 0
        # `memory.trim_when_quiet`'s, while the server is quiet: the next answer resolves it
        self.next_answer: asyncio.Future[None] | None = None

    # Observer of the batcher (called from the inference thread; prometheus-client is thread-safe)
    def queue_depth(self, rows: int) -> None:
        self.queue_rows.set(rows)

    def batch(self, rows: int, waits: Sequence[float], compute_s: float) -> None:
        self.batch_rows.observe(rows)
        self.compute.observe(compute_s)
        for wait in waits:
            self.queue_wait.observe(wait)

    def slot_waited(self, slot: str, seconds: float) -> None:
        self._slot_waits[slot].observe(seconds)

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def request(self, route: str, status: int, seconds: float) -> None:
        key = (route, status)
        children = self._children.get(key)
        if children is None:  # labels() takes a lock and builds a tuple: cache the children
            children = (
                self.requests.labels(route, str(status)),
                self.request_seconds.labels(route, f"{status // 100}xx"),
            )
            self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)
        if route in POLLED:
            return
        self.answered += 1
        if (waiting := self.next_answer) is not None:
            self.next_answer = None
            if not waiting.done():  # cancelled as the server stops
                waiting.set_result(None)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts and times each HTTP request under its route template (bounded label values).

    Plain ASGI, not Starlette's BaseHTTPMiddleware, which costs a task per request. FastAPI
    puts its routes in `scope["route"]`; `HotRoutes` (the tensor routes through ASGI) puts its
    handler's name in `scope["endpoint"]`, which `paths` maps to the route template. A request
    answered before either (a body too large by its Content-Length) or by no route is labelled
    by `route_of` (the template of the route its path matches; None: "unmatched").
    """

    def __init__(
        self,
        app: ASGIApp,
        metrics: Metrics,
        paths: dict[Any, str] | None = None,
        route_of: Callable[[Scope], str | None] | None = None,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths if paths is not None else {}
        self.route_of = route_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = scope
        if scope["method"] == "HEAD":
            # Answered as GET would be, without the body: FastAPI routes GET only, and `curl -I`
            # or a load balancer's HEAD probe got 405. The app sees a copy saying GET; uvicorn
            # keeps its own scope saying HEAD, so it sends the head and drops the body. Here,
            # not in a middleware of its own: that layer cost every request, 4 % of binary
            # digits requests per second at 16 connections (same-run A/B, 4 rounds).
            scope = {**scope, "method": "GET"}
        start = given.get(ARRIVED) or time.perf_counter()
        status = 500  # an exception escaping the app becomes a 500 further out

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            endpoint = scope.get("endpoint")
            path = (
                getattr(scope.get("route"), "path", None)
                or self.paths.get(endpoint)
                # FastAPI's own /docs, /redoc, /openapi.json: plain routes, fixed paths
                or (scope["path"] if endpoint is not None else self._unrouted(scope))
            )
            status = given.get(REFUSED) or status
            if status < 400 and given.get(LEFT):
                self.metrics.rejected("disconnected")
                status = CLIENT_CLOSED
            self.metrics.request(path, status, time.perf_counter() - start)

    def _unrouted(self, scope: Scope) -> str:
        """The label of a request that reached no route: answered on the way in, or a 404."""
        return (self.route_of(scope) if self.route_of is not None else None) or "unmatched"
