"""Dynamic batching: requests arrive on the event loop, inference threads run them in batches.

    submit(x) ──> queue (bounded in rows) ──> worker thread: wait, take a batch, run, deliver
        │                                                                    │
        └── asyncio future <── call_soon_threadsafe(set_result) ─────────────┘

- The queue is counted in rows; a request that would overflow it raises `QueueFull` at once.
- A batch opens with the oldest queued request and closes when it holds `max_batch_rows` rows
  or `max_wait_ms` after that request arrived, whichever comes first; sooner where a request's
  deadline is near (`Batcher._wait_s`).
- The worker sleeps on a condition variable while the queue is empty (no polling) and only
  wakes early during the wait when the batch fills, so an idle server costs no CPU.
- `instances` workers (Triton's instance count) may each run a batch at the same time, on one
  shared model: its `run` must be thread-safe (ONNX Runtime sessions and TorchScript are).
- Requests whose deadline passed or whose client left are dropped before compute, and their
  rows leave the queue's count at once (room for others, the gauge); results go only to
  futures still waiting. So is a request whose deadline would pass before its batch could be
  computed, going by the shortest time any batch as long or shorter has taken
  (`_unanswerable`): its client gets 504 at the deadline either way, and the model's time goes
  to requests that can still be answered.
- A model error fails its batch only. A worker that dies anyway (an error outside that, a bug)
  fails every queued request and all later ones with `WorkerDied`, and `alive` turns false:
  nothing would run them, and the process should be restarted.

Nothing here knows HTTP: `app.py` maps these exceptions to status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue holds `max_queue_rows`; retry after `retry_after_s` (an estimate)."""

    def __init__(self, queued_rows: int, retry_after_s: int) -> None:
        super().__init__(
            f"server busy: {queued_rows} rows queued; retry in about {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s


class DeadlineExceeded(Exception):
    """The request's deadline passed before its answer was ready."""


class ClientGone(Exception):
    """The client disconnected; nobody reads this answer."""


class Closed(Exception):
    """The batcher is shutting down and takes no more requests."""


class WorkerDied(Closed):
    """An inference worker died: this batcher runs nothing any more."""


class TooManyRows(ValueError):
    """One request holds more rows than a batch may."""

    @classmethod
    def of(cls, rows: int, max_rows: int) -> TooManyRows:
        return cls(
            f"request has {rows} rows; this server takes at most {max_rows} per request: split it"
        )


def _non_finite(bad: int, rows: int) -> str:
    return (
        f"the model gave NaN or infinite logits for {bad} of the request's {rows} "
        f"row{'' if rows == 1 else 's'}: no label can be read from them (the model fails on "
        "such input; the run's export checked it on its test images only)"
    )


class InferenceFailed(RuntimeError):
    """The model raised while running a batch this request was in, or gave NaN or infinite
    logits for a row of this request (a 500 that says so, not a label made up from them)."""


class Observer(Protocol):
    """Where the batcher reports what it does (Prometheus metrics in the server)."""

    def queue_depth(self, rows: int) -> None: ...

    def batch(self, rows: int, waits: Sequence[float], compute_s: float) -> None: ...

    def rejected(self, reason: str) -> None: ...


class NullObserver:
    def queue_depth(self, rows: int) -> None:
        pass

    def batch(self, rows: int, waits: Sequence[float], compute_s: float) -> None:
        pass

    def rejected(self, reason: str) -> None:
        pass


@dataclass(eq=False, slots=True)
class _Item:
    x: np.ndarray
    rows: int
    arrival: float  # time.monotonic()
    due: float  # when the batch this request opens must close: arrival + max_wait, or now
    deadline: float  # time.monotonic()
    future: asyncio.Future[np.ndarray]
    timer: asyncio.TimerHandle | None = None
    queued: bool = True  # its rows are counted in the queue's (under the batcher's lock)


class Ticket:
    """One queued request: await `future` for its logits; `abandon()` when the client left."""

    __slots__ = ("_batcher", "_item")

    def __init__(self, batcher: Batcher, item: _Item) -> None:
        self._batcher = batcher
        self._item = item

    @property
    def future(self) -> asyncio.Future[np.ndarray]:
        return self._item.future

    def abandon(self) -> None:
        self._batcher._resolve_without_model(self._item, ClientGone(), "disconnected")
        # Whoever abandons wants no answer: mark the exception seen, or asyncio logs
        # "Future exception was never retrieved" when nothing awaits the future.
        if not self._item.future.cancelled():
            self._item.future.exception()


class Batcher:
    """Batches rows for `run(x) -> y` (y has one row per row of x) in a dedicated thread."""

    def __init__(
        self,
        run: Callable[[np.ndarray], np.ndarray],
        *,
        max_batch_rows: int = 64,
        max_wait_ms: float = 2.0,
        max_queue_rows: int = 1024,
        observer: Observer | None = None,
        instances: int = 1,
    ) -> None:
        if max_batch_rows < 1 or max_queue_rows < max_batch_rows:
            raise ValueError(
                f"need 1 <= max_batch_rows ({max_batch_rows}) <= max_queue_rows ({max_queue_rows})"
            )
        if instances < 1:
            raise ValueError(f"need at least one model instance, got {instances}")
        self.instances = instances
        self._run = run
        self.max_batch_rows = max_batch_rows
        self.max_wait_s = max_wait_ms / 1000
        self.max_queue_rows = max_queue_rows
        # Read per batch and per rejection, so it may be replaced while running: the server
        # attaches its metrics once the warm-up batch is back, which is no served traffic.
        self.observer: Observer = observer or NullObserver()
        self._cond = threading.Condition()
        self._queue: deque[_Item] = deque()
        # rows in _queue of requests still waiting for an answer: one answered without the
        # model (deadline, client gone) stays in _queue until a worker pops it, but its rows
        # no longer count against max_queue_rows, the queue-depth gauge or a batch's fill
        self._rows = 0
        self._draining = False  # no waiting for more rows: nothing new is coming
        self._closed = False  # no new requests; the worker exits once the queue is empty
        self._rows_per_s = 0.0  # moving average of one instance's speed, for Retry-After
        # the shortest compute seen for each batch length, in rows, and from it the least a
        # batch of n rows takes: the longest of those for n rows or fewer (`_unanswerable`)
        self._least_s: dict[int, float] = {}
        self._bound_s = [0.0] * (max_batch_rows + 1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self.failure: str | None = None  # why a worker died (then `WorkerDied`); None: all run
        # For tests: how often the worker woke up, and what it dropped unrun.
        self.wakeups = 0
        self.dropped_rows = 0

    # -- event-loop side -------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers; call from the event loop that will await the results."""
        if self._threads:
            raise RuntimeError("batcher already started")
        self._loop = asyncio.get_running_loop()
        for i in range(self.instances):
            name = "lightship-infer" + (f"-{i}" if self.instances > 1 else "")
            thread = threading.Thread(target=self._work, name=name, daemon=True)
            self._threads.append(thread)
            thread.start()

    @property
    def queued_rows(self) -> int:
        return self._rows

    def submit(self, x: np.ndarray, timeout_s: float, wait: bool = True) -> Ticket:
        """Queue `x` (rows first) with a deadline `timeout_s` from now; on the event loop.

        `wait=False` closes its batch without waiting for company (the warm-up batch).
        """
        loop = self._loop
        if loop is None:
            raise RuntimeError("batcher not started")
        rows = len(x)
        if rows > self.max_batch_rows:
            raise TooManyRows.of(rows, self.max_batch_rows)
        now = time.monotonic()
        due = now + self._wait_s(timeout_s) if wait else now
        item = _Item(x, rows, now, due, now + timeout_s, loop.create_future())
        with self._cond:
            if self.failure is not None:
                self.observer.rejected("worker_died")
                raise WorkerDied(self.failure)
            if self._closed:
                raise Closed("server is shutting down")
            if self._rows + rows > self.max_queue_rows:
                queued, retry = self._rows, self._retry_after()
                self.observer.rejected("queue_full")
                raise QueueFull(queued, retry)
            was_empty = not self._queue
            self._queue.append(item)
            self._rows += rows
            depth = self._rows
            # Wake a worker only when that changes what it does: it sleeps on an empty queue,
            # or it waits for a batch to fill. Otherwise it picks the request up on its own
            # (and a worker that takes a batch wakes a peer for any rows it leaves).
            if was_empty or depth >= self.max_batch_rows or self._draining or not wait:
                self._cond.notify()
            # under the lock, as every change of the count: set outside it, two setters (this
            # loop and a worker) could leave the older count on the gauge
            self.observer.queue_depth(depth)
        item.timer = loop.call_later(timeout_s, self._expire, item)
        return Ticket(self, item)

    def _wait_s(self, timeout_s: float) -> float:
        """How long a request with `timeout_s` to go may hold its batch open for company:
        max_wait, or half of what its deadline leaves once a full batch is computed (at the
        speed measured so far), whichever is shorter. A client's short deadline
        (x-request-timeout-ms) closes its batch in time to be answered, where waiting out
        max_wait on an idle server let the deadline pass."""
        rate = self._rows_per_s
        compute_s = self.max_batch_rows / rate if rate > 0 else 0.0
        return max(0.0, min(self.max_wait_s, (timeout_s - compute_s) / 2))

    async def infer(self, x: np.ndarray, timeout_s: float, wait: bool = True) -> np.ndarray:
        """Submit and await; raises TooManyRows, QueueFull, DeadlineExceeded, Closed (and its
        WorkerDied), InferenceFailed."""
        return await self.submit(x, timeout_s, wait).future

    def drain(self) -> None:
        """Run what is queued without waiting for batches to fill (no new requests coming)."""
        with self._cond:
            self._draining = True
            self._cond.notify_all()

    @property
    def running(self) -> bool:
        """Whether a worker thread is still alive (it may be in the model)."""
        return any(thread.is_alive() for thread in self._threads)

    async def aclose(self) -> None:
        """Refuse new requests, finish the queued ones, stop the worker."""
        with self._cond:
            self._closed = self._draining = True
            self._cond.notify_all()
        for thread in self._threads:
            await asyncio.to_thread(thread.join)
        await asyncio.sleep(0)  # let the last call_soon_threadsafe deliveries run

    def _expire(self, item: _Item) -> None:
        self._resolve_without_model(
            item, DeadlineExceeded("deadline passed before the answer was ready"), "deadline"
        )

    def _resolve_without_model(self, item: _Item, exc: Exception, reason: str) -> None:
        if item.future.done():
            return
        if item.timer is not None:
            item.timer.cancel()
        item.future.set_exception(exc)
        self.observer.rejected(reason)
        with self._cond:
            if item.queued:  # a worker has not taken it yet: its rows leave the count now
                item.queued = False
                self._rows -= item.rows
                self.observer.queue_depth(self._rows)

    def _deliver(
        self,
        items: list[_Item],
        y: np.ndarray | None,
        error: str | None,
        bad: np.ndarray | None = None,
    ) -> None:
        """Each item's rows of `y`, or `error`; an item with a row in `bad` (NaN or infinite
        logits, from which a label and score would be made up) fails alone."""
        offset = 0
        for item in items:
            if item.timer is not None:
                item.timer.cancel()
            # The future may be done already: deadline passed or client left during compute.
            if not item.future.done():
                failed = None if bad is None else int(bad[offset : offset + item.rows].sum())
                if y is None:
                    item.future.set_exception(InferenceFailed(error))
                elif failed:
                    item.future.set_exception(InferenceFailed(_non_finite(failed, item.rows)))
                else:
                    item.future.set_result(y[offset : offset + item.rows])
            offset += item.rows

    # -- worker thread ---------------------------------------------------------------------

    def _retry_after(self) -> int:
        rate = self._rows_per_s * self.instances
        return 1 if rate <= 0 else min(60, max(1, math.ceil(self._rows / rate)))

    def _next_batch(self) -> list[_Item] | None:
        """Block until a batch is due and take it; None when closed and empty."""
        with self._cond:
            while True:
                while not self._queue:
                    if self._closed:
                        return None
                    self._cond.wait()  # idle: sleeps until submit() notifies
                    self.wakeups += 1
                while self._queue and self._rows < self.max_batch_rows and not self._draining:
                    # The oldest request still waiting sets the close time (one answered without
                    # the model no longer does); a later one may bring it forward.
                    due = min((item.due for item in self._queue if item.queued), default=0.0)
                    remaining = due - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                    self.wakeups += 1
                if self._queue:  # else another instance took the batch while this one waited
                    break
            batch: list[_Item] = []
            rows = 0
            while self._queue and rows + self._queue[0].rows <= self.max_batch_rows:
                item = self._queue.popleft()
                if not item.queued:  # answered without the model, its rows uncounted already
                    self.dropped_rows += item.rows
                    continue
                item.queued = False
                self._rows -= item.rows
                batch.append(item)
                rows += item.rows
            if self._queue and self.instances > 1:
                self._cond.notify()  # rows left behind: an idle instance may take them
            self.observer.queue_depth(self._rows)
        return batch

    def _work(self) -> None:
        loop = self._loop
        assert loop is not None
        batch: list[_Item] | None = None
        try:
            while (batch := self._next_batch()) is not None:
                now = time.monotonic()
                # A done future was answered without the model (deadline, client gone, awaiting
                # task cancelled). done() only reads the future's state: safe from this thread.
                live = [it for it in batch if not it.future.done() and it.deadline > now]
                live = self._unanswerable(live, now)
                if dropped := sum(it.rows for it in batch) - sum(it.rows for it in live):
                    with self._cond:  # instances may drop at the same time
                        self.dropped_rows += dropped
                if not live:
                    continue
                x = live[0].x if len(live) == 1 else np.concatenate([it.x for it in live])
                start = time.perf_counter()
                y: np.ndarray | None = None
                error: str | None = None
                try:
                    y = self._run(x)
                except Exception as exc:  # a model failure answers this batch, the worker lives on
                    log.exception("inference failed on a batch of %d rows", len(x))
                    error = f"inference failed: {type(exc).__name__}: {exc}"
                compute_s = time.perf_counter() - start
                # rows of NaN or infinite logits, found here, off the event loop (None: none)
                finite = None if y is None else np.isfinite(y).all(axis=1)
                bad = None if finite is None or finite.all() else ~finite
                if y is not None and compute_s > 0:
                    rate = len(x) / compute_s
                    self._rows_per_s = (
                        rate if self._rows_per_s == 0 else (0.8 * self._rows_per_s + 0.2 * rate)
                    )
                if compute_s < self._least_s.get(len(x), math.inf):
                    self._shortest(len(x), compute_s)
                self.observer.batch(len(x), [now - it.arrival for it in live], compute_s)
                try:
                    loop.call_soon_threadsafe(self._deliver, live, y, error, bad)
                except RuntimeError:  # the loop closed under us: nobody is waiting any more
                    return
        except BaseException as crash:  # not the model's error (answered above): a bug
            self._die(crash, batch or [])

    def _unanswerable(self, live: list[_Item], now: float) -> list[_Item]:
        """`live` less the requests whose deadline passes before the batch left could be
        computed: an answer past its deadline reaches nobody (the timer has answered 504), and
        under overload with short deadlines computing them spent the model on answers thrown
        away. A batch takes at least the shortest time seen for any batch of as many rows or
        fewer: a lower bound, so that a slow batch (the first one, a busy machine) or a first
        long batch (faster a row than those seen) never drops a request that could be
        answered."""
        bound = self._bound_s  # replaced whole, never changed in place: read without the lock
        while live:
            done_by = now + bound[sum(it.rows for it in live)]
            kept = [it for it in live if it.deadline > done_by]
            if len(kept) == len(live):
                break
            live = kept  # fewer rows compute sooner: look again at what is left
        return live

    def _shortest(self, rows: int, compute_s: float) -> None:
        """A batch of `rows` ran faster than any before it of that length."""
        with self._cond:  # instances may set it at the same time
            self._least_s[rows] = compute_s
            least = (self._least_s.get(n, 0.0) for n in range(self.max_batch_rows + 1))
            self._bound_s = list(itertools.accumulate(least, max))

    def _die(self, exc: BaseException, batch: list[_Item]) -> None:
        """Fail the batch in hand and the queue, refuse new requests, stop the other workers."""
        log.critical("inference worker died; restart the server", exc_info=exc)
        with self._cond:
            if self.failure is None:
                self.failure = (
                    f"inference worker died ({type(exc).__name__}: {exc}): the server must be "
                    "restarted"
                )
            failure = self.failure
            self._closed = self._draining = True
            # A batch already handed to _deliver keeps its answers: the loop runs them first.
            items = [*batch, *self._queue]
            for item in self._queue:
                item.queued = False
            self._queue.clear()
            self._rows = 0
            self.observer.queue_depth(0)
            self._cond.notify_all()
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(self._fail, items, failure)

    def _fail(self, items: list[_Item], failure: str) -> None:
        for item in items:
            self._resolve_without_model(item, WorkerDied(failure), "worker_died")
