"""The dynamic batcher on its own: exact values, batch boundaries, drops, back-pressure, drain.

The model is `rows -> row sums`, so every answer can be written down; a gate (threading.Event)
holds the inference thread where a test needs the queue to fill.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest

from lightship.serve.batcher import (
    Batcher,
    Closed,
    DeadlineExceeded,
    InferenceFailed,
    QueueFull,
    TooManyRows,
    WorkerDied,
)


class SumModel:
    """y = sum of each row's pixels; records every batch it ran."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.batches: list[np.ndarray] = []
        self.gate = gate
        self.entered = threading.Event()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10), "test never opened the gate"
        self.batches.append(x.copy())
        return x.reshape(len(x), -1).sum(1, keepdims=True).astype(np.float32)

    @property
    def sizes(self) -> list[int]:
        return [len(b) for b in self.batches]


class Recorder:
    def __init__(self) -> None:
        self.rejections: list[str] = []
        self.batch_rows: list[int] = []
        self.waits: list[float] = []
        self.depths: list[int] = []

    def queue_depth(self, rows: int) -> None:
        self.depths.append(rows)

    def batch(self, rows: int, waits: Any, compute_s: float) -> None:
        self.batch_rows.append(rows)
        self.waits.extend(waits)

    def rejected(self, reason: str) -> None:
        self.rejections.append(reason)


def rows(*values: int) -> np.ndarray:
    """One [1, 1, 1] image per value."""
    return np.array(values, np.int64).reshape(-1, 1, 1, 1)


def run(coro_fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(coro_fn())


async def started(model: Callable[[np.ndarray], np.ndarray], **kwargs: Any) -> Batcher:
    b = Batcher(model, **kwargs)
    b.start()
    return b


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows() -> None:
    gate = threading.Event()
    model = SumModel(gate)
    rec = Recorder()

    async def main() -> list[np.ndarray]:
        b = await started(
            model, max_batch_rows=8, max_wait_ms=5000, max_queue_rows=64, observer=rec
        )
        # A full first batch runs at once and blocks in the model at the gate; ten requests
        # (15 rows) queue behind it. A request is never split, so they come out as 7 + 8 rows.
        first = b.submit(rows(*range(8)), 10)
        await asyncio.to_thread(model.entered.wait, 10)
        tickets = [b.submit(rows(i, 100 + i) if i % 2 else rows(i), 10) for i in range(10)]
        gate.set()
        out = [await t.future for t in [first, *tickets]]
        await b.aclose()
        return out

    out = run(main)
    np.testing.assert_array_equal(out[0].ravel(), range(8))
    for i, y in enumerate(out[1:]):
        expected = [[i], [100 + i]] if i % 2 else [[i]]
        np.testing.assert_array_equal(y, expected)
    assert model.sizes == [8, 7, 8]
    assert rec.batch_rows == model.sizes and len(rec.waits) == 11
    # every row computed once, in arrival order
    assert np.concatenate(model.batches).ravel().tolist()[8:] == [
        v for i in range(10) for v in ((i, 100 + i) if i % 2 else (i,))
    ]


def test_a_batch_closes_max_wait_after_its_oldest_request() -> None:
    model = SumModel()

    async def main() -> float:
        b = await started(model, max_batch_rows=64, max_wait_ms=80)
        t0 = time.monotonic()
        first = b.submit(rows(3), 10)
        await asyncio.sleep(0.03)  # a second request arrives later: it must not restart the wait
        second = b.submit(rows(4), 10)
        a, c = await first.future, await second.future
        elapsed = time.monotonic() - t0
        assert a[0, 0] == 3 and c[0, 0] == 4
        await b.aclose()
        return elapsed

    elapsed = run(main)
    assert model.sizes == [2]
    assert 0.075 <= elapsed < 0.5, elapsed  # waited for the oldest's 80 ms, not 30 + 80


def test_a_full_batch_runs_without_waiting() -> None:
    model = SumModel()

    async def main() -> float:
        b = await started(model, max_batch_rows=4, max_wait_ms=10_000)
        t0 = time.monotonic()
        out = await b.infer(rows(1, 2, 3, 4), 10)
        elapsed = time.monotonic() - t0
        np.testing.assert_array_equal(out.ravel(), [1, 2, 3, 4])
        await b.aclose()
        return elapsed

    assert run(main) < 1.0  # a 10 s max_wait would show
    assert model.sizes == [4]


def test_idle_worker_sleeps_without_polling() -> None:
    async def main() -> tuple[int, int]:
        b = await started(SumModel(), max_batch_rows=4, max_wait_ms=1)
        await b.infer(rows(1), 10)
        before = b.wakeups
        await asyncio.sleep(0.3)  # idle: a polling worker would wake every few ms
        after = b.wakeups
        await b.aclose()
        return before, after

    before, after = run(main)
    assert after == before


def test_queue_is_bounded_in_rows_and_full_means_queue_full() -> None:
    gate = threading.Event()
    model = SumModel(gate)
    rec = Recorder()

    async def main() -> None:
        b = await started(model, max_batch_rows=4, max_wait_ms=0, max_queue_rows=6, observer=rec)
        busy = b.submit(rows(1), 10)  # taken by the worker, which blocks in the model
        await asyncio.to_thread(model.entered.wait, 10)
        queued = [b.submit(rows(1, 1, 1), 10), b.submit(rows(2, 2), 10)]  # 5 of 6 rows
        with pytest.raises(QueueFull) as info:
            b.submit(rows(5, 5), 10)  # 7 > 6
        assert info.value.retry_after_s >= 1
        assert b.queued_rows == 5
        b.submit(rows(9), 10)  # exactly full is fine
        with pytest.raises(TooManyRows):
            b.submit(rows(*range(5)), 10)  # more than one batch may hold
        gate.set()
        await busy.future
        assert [float(y.sum()) for y in [await t.future for t in queued]] == [3.0, 4.0]
        await b.aclose()

    run(main)
    assert rec.rejections == ["queue_full"]


def test_deadline_passed_in_the_queue_is_dropped_before_compute() -> None:
    gate = threading.Event()
    model = SumModel(gate)
    rec = Recorder()

    async def main() -> None:
        b = await started(model, max_batch_rows=8, max_wait_ms=0, observer=rec)
        busy = b.submit(rows(1), 10)
        await asyncio.to_thread(model.entered.wait, 10)
        late = b.submit(rows(7), 0.05)
        keep = b.submit(rows(8), 10)
        with pytest.raises(DeadlineExceeded):
            await late.future  # answered at its deadline, while the model is still busy
        gate.set()
        await busy.future
        assert (await keep.future)[0, 0] == 8
        await b.aclose()
        assert b.dropped_rows == 1

    run(main)
    ran = np.concatenate(model.batches).ravel().tolist()
    assert 7 not in ran and ran == [1, 8]
    assert rec.rejections == ["deadline"]


def test_a_deadline_its_batch_cannot_meet_is_dropped_before_compute() -> None:
    # Batches of one row have taken 0.3 s (held at the gate), so a batch of two takes no less:
    # taken at 0.3 s, `short` (deadline 0.5 s) would be answered after its client had its 504.
    # It is not computed, and `keep` runs alone.
    gate = threading.Event()
    model = SumModel(gate)
    rec = Recorder()

    async def main() -> None:
        b = await started(model, max_batch_rows=8, max_wait_ms=0, observer=rec)
        busy = b.submit(rows(1), 10)
        await asyncio.to_thread(model.entered.wait, 10)
        short = b.submit(rows(7), 0.5)
        keep = b.submit(rows(2), 10)
        await asyncio.sleep(0.3)
        gate.set()
        await busy.future
        assert (await keep.future)[0, 0] == 2
        with pytest.raises(DeadlineExceeded):
            await short.future
        await b.aclose()
        assert b.dropped_rows == 1

    run(main)
    assert np.concatenate(model.batches).ravel().tolist() == [1, 2]
    assert rec.rejections == ["deadline"]


def test_only_batches_no_longer_than_this_one_bound_its_time() -> None:
    # A batch of 8 rows took 0.3 s: one of 2 may take less, so 2 rows due in 0.2 s are
    # computed; 8 rows due in 0.2 s are not. 4 rows are bound by the fast batches of 1 and 2
    # rows, not by the slow one of 8: due in 0.25 s, they are computed.
    gate = threading.Event()
    model = SumModel(gate)

    async def main() -> None:
        b = await started(model, max_batch_rows=8, max_wait_ms=0)
        busy = b.submit(rows(*range(8)), 10)
        await asyncio.to_thread(model.entered.wait, 10)
        await asyncio.sleep(0.3)
        gate.set()
        await busy.future
        assert (await b.infer(rows(5, 6), 0.2)).ravel().tolist() == [5, 6]
        with pytest.raises(DeadlineExceeded):
            await b.infer(rows(*range(8)), 0.2)
        assert (await b.infer(rows(9), 0.2)).ravel().tolist() == [9]  # fast now: 1 row
        assert (await b.infer(rows(1, 2, 3, 4), 0.25)).ravel().tolist() == [1, 2, 3, 4]
        await b.aclose()
        assert b.dropped_rows == 8

    run(main)
    assert model.sizes == [8, 2, 1, 4]


def test_abandoned_request_is_not_computed_and_others_are() -> None:
    gate = threading.Event()
    model = SumModel(gate)
    rec = Recorder()

    async def main() -> None:
        b = await started(model, max_batch_rows=8, max_wait_ms=0, observer=rec)
        busy = b.submit(rows(1), 10)
        await asyncio.to_thread(model.entered.wait, 10)
        gone = b.submit(rows(5), 10)
        stays = b.submit(rows(6), 10)
        gone.abandon()  # the client disconnected while queued
        gate.set()
        await busy.future
        assert (await stays.future)[0, 0] == 6
        assert gone.future.done()
        await b.aclose()

    run(main)
    assert np.concatenate(model.batches).ravel().tolist() == [1, 6]
    assert rec.rejections == ["disconnected"]


def test_rows_answered_without_the_model_leave_the_queue_count_at_once() -> None:
    """A request abandoned or past its deadline stays queued until a worker pops it; its rows
    counted until then, so the gauge said 8 rows waiting where 3 were, and a request that fit
    beside the live ones got 429."""
    gate = threading.Event()
    model = SumModel(gate)
    rec = Recorder()

    async def main() -> None:
        b = await started(model, max_batch_rows=4, max_wait_ms=0, max_queue_rows=8, observer=rec)
        busy = b.submit(rows(1), 10)  # taken by the worker, which blocks in the model
        await asyncio.to_thread(model.entered.wait, 10)
        gone = b.submit(rows(5, 5, 5), 10)
        late = b.submit(rows(7, 7), 0.02)
        kept = b.submit(rows(3, 3, 3), 10)
        assert b.queued_rows == 8 and rec.depths[-1] == 8
        gone.abandon()
        with pytest.raises(DeadlineExceeded):
            await late.future
        assert b.queued_rows == 3 and rec.depths[-1] == 3
        fits = b.submit(rows(4, 4, 4, 4), 10)  # 3 + 4 <= 8: no queue_full
        assert b.queued_rows == 7
        gate.set()
        await busy.future
        assert (await kept.future).ravel().tolist() == [3, 3, 3]
        assert (await fits.future).ravel().tolist() == [4, 4, 4, 4]
        await b.aclose()
        assert b.queued_rows == 0 and rec.depths[-1] == 0
        assert b.dropped_rows == 5

    run(main)
    assert np.concatenate(model.batches).ravel().tolist() == [1, 3, 3, 3, 4, 4, 4, 4]
    assert rec.rejections == ["disconnected", "deadline"]


def test_results_go_only_to_futures_still_waiting() -> None:
    gate = threading.Event()
    model = SumModel(gate)
    errors: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        b = await started(model, max_batch_rows=8, max_wait_ms=0)
        a = b.submit(rows(1), 10)
        await asyncio.to_thread(model.entered.wait, 10)
        a.abandon()  # left while its batch was computing: the result must not be set on it
        gate.set()
        c = await b.infer(rows(2), 10)
        assert c[0, 0] == 2
        await b.aclose()

    run(main)
    assert model.sizes == [1, 1]  # it was already running: computed, then discarded
    assert errors == []  # no InvalidStateError from set_result on a done future


def test_model_failure_answers_its_batch_and_the_worker_lives_on() -> None:
    calls = []

    def flaky(x: np.ndarray) -> np.ndarray:
        calls.append(len(x))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return x.reshape(len(x), -1).sum(1, keepdims=True)

    async def main() -> None:
        b = await started(flaky, max_batch_rows=8, max_wait_ms=0)
        with pytest.raises(InferenceFailed, match="RuntimeError: boom"):
            await b.infer(rows(1), 10)
        assert (await b.infer(rows(4), 10))[0, 0] == 4
        await b.aclose()

    run(main)


def test_a_request_given_nan_logits_fails_alone_and_its_batch_mates_get_theirs() -> None:
    # served as 200 with label "0" and score null, made up from NaN
    gate = threading.Event()
    model = SumModel(gate)

    def nan_on_13(x: np.ndarray) -> np.ndarray:
        y = model(x)
        y[x.reshape(len(x), -1)[:, 0] == 13] = np.nan
        return y

    async def main() -> None:
        b = await started(nan_on_13, max_batch_rows=8, max_wait_ms=5000)
        first = b.submit(rows(*range(8)), 10)  # holds the model while the next three queue
        await asyncio.to_thread(model.entered.wait, 10)
        ok, bad, after = (b.submit(r, 10) for r in (rows(1, 2), rows(3, 13, 5), rows(6)))
        gate.set()
        await first.future
        np.testing.assert_array_equal(await ok.future, [[1], [2]])
        with pytest.raises(InferenceFailed) as failed:
            await bad.future
        assert str(failed.value) == (
            "the model gave NaN or infinite logits for 1 of the request's 3 rows: no label can "
            "be read from them (the model fails on such input; the run's export checked it on "
            "its test images only)"
        )
        np.testing.assert_array_equal(await after.future, [[6]])
        assert model.sizes == [8, 6]  # the three ran together
        await b.aclose()

    run(main)


def test_drain_runs_the_queue_at_once_and_close_refuses_new_work() -> None:
    model = SumModel()

    async def main() -> None:
        b = await started(model, max_batch_rows=64, max_wait_ms=60_000)
        queued = [b.submit(rows(i), 100) for i in range(5)]
        t0 = time.monotonic()
        b.drain()  # SIGTERM: nothing new is coming, do not wait the minute for stragglers
        out = [await t.future for t in queued]
        assert time.monotonic() - t0 < 5
        assert [int(y[0, 0]) for y in out] == [0, 1, 2, 3, 4]
        await b.aclose()
        with pytest.raises(Closed):
            b.submit(rows(1), 10)

    run(main)
    assert model.sizes == [5]


def test_close_finishes_queued_requests() -> None:
    gate = threading.Event()
    model = SumModel(gate)

    async def main() -> None:
        b = await started(model, max_batch_rows=2, max_wait_ms=60_000)
        queued = [b.submit(rows(i), 100) for i in range(5)]
        closing = asyncio.ensure_future(b.aclose())
        gate.set()
        out = [await t.future for t in queued]
        await closing
        assert [int(y[0, 0]) for y in out] == [0, 1, 2, 3, 4]

    run(main)
    assert model.sizes == [2, 2, 1]


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_queue_rows"):
        Batcher(SumModel(), max_batch_rows=8, max_queue_rows=4)


def test_a_request_that_must_not_wait_closes_its_batch_at_once() -> None:
    model = SumModel()

    async def main() -> float:
        b = await started(model, max_batch_rows=64, max_wait_ms=60_000)
        t0 = time.monotonic()
        y = await b.infer(rows(5), 10, wait=False)  # the warm-up: a minute's wait would show
        assert y[0, 0] == 5
        await b.aclose()
        return time.monotonic() - t0

    assert run(main) < 5


class OverlapModel(SumModel):
    """SumModel that records how many batches run at the same time; each batch holds its
    thread until a second one joins it (or a timeout), so instances overlap when they can."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.pair = threading.Barrier(2)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            self.pair.wait(0.5)
        except threading.BrokenBarrierError:
            pass
        finally:
            with self.lock:
                self.running -= 1
        return super().__call__(x)


@pytest.mark.parametrize("instances", [1, 2])
def test_instances_run_batches_side_by_side_and_every_row_keeps_its_answer(
    instances: int,
) -> None:
    model = OverlapModel()

    async def main() -> list[np.ndarray]:
        b = await started(model, max_batch_rows=4, max_wait_ms=0, instances=instances)
        tickets = [b.submit(rows(i, 1000 + i), 10) for i in range(6)]
        out = [await t.future for t in tickets]
        await b.aclose()
        assert all(not t.is_alive() for t in b._threads)
        return out

    out = run(main)
    for i, y in enumerate(out):
        np.testing.assert_array_equal(y, [[i], [1000 + i]])
    assert sum(model.sizes) == 12 and max(model.sizes) <= 4
    assert model.most == instances  # two instances compute two batches at once; one never


def test_close_with_instances_finishes_the_queue_and_stops_every_worker() -> None:
    gate = threading.Event()
    model = SumModel(gate)

    async def main() -> list[np.ndarray]:
        b = await started(model, max_batch_rows=2, max_wait_ms=5000, instances=3)
        tickets = [b.submit(rows(i), 10) for i in range(7)]
        await asyncio.to_thread(model.entered.wait, 10)
        closing = asyncio.ensure_future(b.aclose())
        await asyncio.sleep(0.05)
        with pytest.raises(Closed):
            b.submit(rows(99), 10)
        gate.set()
        await closing
        assert len(b._threads) == 3 and all(not t.is_alive() for t in b._threads)
        return [await t.future for t in tickets]

    out = run(main)
    assert [int(y[0, 0]) for y in out] == list(range(7))
    assert sorted(np.concatenate(model.batches).ravel().tolist()) == list(range(7))


class Crash(BaseException):
    """Escapes `except Exception`: stands for a bug that kills an inference worker."""


def test_a_dead_worker_fails_its_batch_and_the_queue_and_refuses_new_requests() -> None:
    gate = threading.Event()
    model = SumModel(gate)
    recorder = Recorder()

    def dying(x: np.ndarray) -> np.ndarray:
        model(x)
        raise Crash("bug in the worker")

    async def main() -> None:
        b = await started(dying, max_batch_rows=2, max_wait_ms=0, observer=recorder)
        assert b.failure is None
        first = b.submit(rows(1), 60)
        await asyncio.to_thread(model.entered.wait, 10)
        queued = [b.submit(rows(i), 60) for i in (2, 3, 4)]
        gate.set()
        message = "inference worker died (Crash: bug in the worker): the server must be restarted"
        for ticket in [first, *queued]:  # at once, not at their deadline a minute away
            with pytest.raises(WorkerDied) as info:
                await asyncio.wait_for(ticket.future, 5)
            assert str(info.value) == message
        assert b.failure == message and b.queued_rows == 0
        with pytest.raises(WorkerDied, match=re.escape(message)):
            b.submit(rows(5), 60)
        await b.aclose()

    run(main)
    assert model.sizes == [1]  # the queued requests never ran
    assert recorder.rejections == ["worker_died"] * 5


def test_an_error_outside_the_model_call_kills_the_worker_and_stops_its_peers() -> None:
    class BrokenObserver(Recorder):
        def batch(self, rows: int, waits: Any, compute_s: float) -> None:
            raise RuntimeError("observer broke")

    async def main() -> None:
        b = await started(
            SumModel(), max_batch_rows=2, max_wait_ms=0, observer=BrokenObserver(), instances=2
        )
        with pytest.raises(WorkerDied, match=re.escape("(RuntimeError: observer broke)")):
            await asyncio.wait_for(b.infer(rows(1), 60), 5)
        assert b.failure is not None
        await asyncio.wait_for(b.aclose(), 5)
        assert len(b._threads) == 2 and all(not t.is_alive() for t in b._threads)

    run(main)


def test_a_later_request_does_not_push_back_the_close_of_its_batch() -> None:
    # max_wait 400 ms; the second request comes 300 ms after the first. Closing at the oldest's
    # due time runs the batch at ~400 ms, when the second has waited ~100 ms; closing at the
    # newest's (300 + 400 ms) would make it wait the full 400 ms. 250 ms of margin each way.
    model = SumModel()
    rec = Recorder()

    async def main() -> None:
        b = await started(model, max_batch_rows=64, max_wait_ms=400, observer=rec)
        first = b.submit(rows(3), 10)
        await asyncio.sleep(0.3)
        second = b.submit(rows(4), 10)
        assert (await first.future)[0, 0] == 3 and (await second.future)[0, 0] == 4
        await b.aclose()

    run(main)
    assert model.sizes == [2]
    oldest_wait, newest_wait = rec.waits
    assert 0.39 <= oldest_wait < 0.65, oldest_wait  # the oldest's 400 ms, not 300 + 400
    assert newest_wait < 0.35, newest_wait


def test_a_deadline_shorter_than_max_wait_closes_the_batch_in_time() -> None:
    # max_wait 2 s, the client allows 0.4 s: alone on an idle batcher, waiting out max_wait
    # would answer 504 at 0.4 s; the batch closes at half the time its deadline leaves.
    model = SumModel()

    async def main() -> float:
        b = await started(model, max_batch_rows=8, max_wait_ms=2000)
        t0 = time.monotonic()
        assert (await b.infer(rows(3), 0.4))[0, 0] == 3
        elapsed = time.monotonic() - t0
        b._rows_per_s = 10.0  # a full batch (8 rows) takes 0.8 s: 0.2 s of 1.2 left to wait
        assert b._wait_s(1.2) == pytest.approx(0.2) and b._wait_s(0.5) == 0.0
        assert b._wait_s(100) == 2.0
        await b.aclose()
        return elapsed

    elapsed = run(main)
    assert 0.15 <= elapsed < 0.38, elapsed
    assert model.sizes == [1]


def test_a_request_answered_without_the_model_no_longer_sets_its_batchs_close() -> None:
    # The first request (due at 300 ms) is abandoned at once; the second, 200 ms later, opens
    # the batch: it closes 300 ms after the second arrived, not at the first's due time.
    model = SumModel()
    rec = Recorder()

    async def main() -> None:
        b = await started(model, max_batch_rows=8, max_wait_ms=300, observer=rec)
        b.submit(rows(1), 10).abandon()
        await asyncio.sleep(0.2)
        assert (await b.infer(rows(2), 10))[0, 0] == 2
        await b.aclose()

    run(main)
    assert model.sizes == [1] and rec.rejections == ["disconnected"]
    (wait,) = rec.waits
    assert 0.28 <= wait < 0.6, wait  # its own 300 ms, not the 100 ms the first's due left


def test_a_deadline_that_passed_before_the_loop_could_answer_it_is_still_not_computed() -> None:
    # The event loop is blocked, so the deadline timer cannot answer `late`: the worker itself
    # must see that its deadline passed and drop it (README: dropped before compute).
    gate = threading.Event()
    model = SumModel(gate)
    rec = Recorder()

    async def main() -> None:
        b = await started(model, max_batch_rows=8, max_wait_ms=0, observer=rec)
        busy = b.submit(rows(1), 10)
        await asyncio.to_thread(model.entered.wait, 10)
        late = b.submit(rows(7), 0.05)
        keep = b.submit(rows(8), 10)
        time.sleep(0.1)  # blocks the loop past late's deadline: its timer has not run
        gate.set()
        t0 = time.monotonic()
        while len(model.batches) < 2 and time.monotonic() - t0 < 5:
            time.sleep(0.005)  # the loop still blocked while the worker takes the next batch
        await busy.future
        assert (await keep.future)[0, 0] == 8
        assert 7 not in np.concatenate(model.batches).ravel().tolist()  # late was not computed
        with pytest.raises(DeadlineExceeded):
            await late.future
        await b.aclose()
        assert b.dropped_rows == 1

    run(main)
    ran = np.concatenate(model.batches).ravel().tolist()
    assert ran == [1, 8], ran  # 7 was not computed
    assert rec.rejections == ["deadline"]


def test_retry_after_estimates_how_long_the_queue_takes() -> None:
    # One row takes >= 0.2 s, so the worker's rate is <= 5 rows/s and 20 queued rows take
    # >= 4 s: Retry-After must say so, not a constant 1 s.
    gate = threading.Event()

    class Slow(SumModel):
        def __call__(self, x: np.ndarray) -> np.ndarray:
            y = super().__call__(x)
            time.sleep(0.2)
            return y

    model = Slow(gate)

    async def main() -> int:
        b = await started(model, max_batch_rows=1, max_wait_ms=0, max_queue_rows=20)
        gate.set()
        await b.infer(rows(1), 10)  # measures the rate
        gate.clear()
        model.entered.clear()
        held = b.submit(rows(2), 30)
        await asyncio.to_thread(model.entered.wait, 10)
        queued = [b.submit(rows(i), 30) for i in range(20)]
        with pytest.raises(QueueFull) as info:
            b.submit(rows(99), 30)
        gate.set()
        await held.future
        for t in queued:
            await t.future
        await b.aclose()
        return info.value.retry_after_s

    retry = run(main)
    assert 4 <= retry <= 60, retry
