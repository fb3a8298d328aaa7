"""The report's timing method: every variant once per round, order shuffled, paired ratios."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from lightship.report import measure as measure_module
from lightship.report.measure import (
    CpuClock,
    Timing,
    busy_share,
    measure,
    noise_cause,
    spread,
    steal_share,
)
from lightship.report.render import speedup
from lightship.runtime import Predictor
from tests.conftest import ROOT, last_line, run_cli


class Recorder:
    """Stands in for a Predictor: records which variant ran, at what batch, and sleeps."""

    def __init__(self, name: str, calls: list[tuple[str, int]], seconds: float) -> None:
        self.name, self.calls, self.seconds = name, calls, seconds

    def _run(self, x: np.ndarray) -> np.ndarray:
        self.calls.append((self.name, len(x)))
        time.sleep(self.seconds)
        return x


def test_speedup_is_the_median_of_within_round_ratios() -> None:
    fast = Timing(throughput=[100.0, 300.0, 120.0])
    base = Timing(throughput=[50.0, 200.0, 40.0])
    # ratios 2.0, 1.5, 3.0: median 2.0, where the ratio of medians would say 2.4
    assert fast.speedup_over(base) == pytest.approx(2.0)
    assert fast.throughput_per_s / base.throughput_per_s == pytest.approx(2.4)


def test_speedup_spread_is_the_middle_half_of_the_within_round_ratios() -> None:
    fast = Timing(throughput=[100.0, 300.0, 120.0, 90.0, 200.0])
    base = Timing(throughput=[50.0, 200.0, 40.0, 90.0, 50.0])
    # ratios 2.0, 1.5, 3.0, 1.0, 4.0: 25th percentile 1.5, 75th 3.0 (numpy's linear rule)
    assert fast.speedup_spread(base) == pytest.approx([1.5, 3.0])
    assert base.speedup_spread(base) == pytest.approx([1.0, 1.0])


def test_speedup_bounds_are_the_sign_tests_ranks_of_the_within_round_ratios() -> None:
    base = Timing(throughput=[100.0] * 32)
    ratios = np.linspace(1.0, 1.31, 32)  # 1.00, 1.01, ... 1.31
    rng = np.random.default_rng(0)
    fast = Timing(throughput=list(100.0 * rng.permutation(ratios)))  # in any order
    assert fast.speedup_bounds(base) == pytest.approx((1.09, 1.22))  # the 10th and 23rd
    eight = Timing(throughput=fast.throughput[:8])
    assert eight.speedup_bounds(Timing(throughput=[100.0] * 8)) == pytest.approx(
        (min(eight.throughput) / 100, max(eight.throughput) / 100)
    )
    one = Timing(throughput=[150.0])
    assert one.speedup_bounds(Timing(throughput=[100.0])) == pytest.approx((1.5, 1.5))


def test_a_timing_extended_holds_both_runs() -> None:
    a = Timing([1.0], [100.0], others_cpu_s=0.1, machine_cpu_s=2.0, steal_cpu_s=0.05)
    a.extend(Timing([2.0, 3.0], [200.0], others_cpu_s=0.3, machine_cpu_s=2.0))
    assert a == Timing(
        [1.0, 2.0, 3.0], [100.0, 200.0], others_cpu_s=0.4, machine_cpu_s=4.0, steal_cpu_s=0.05
    )
    assert a.busy_share == pytest.approx(0.1)


def test_speedups_print_with_their_spread_or_a_dash() -> None:
    v = {"speedup_vs_eager": 5.584, "speedup_vs_eager_iqr": [5.214, 5.936]}
    assert speedup(v, "eager") == "5.58 (5.21–5.94)"
    assert speedup({"speedup_vs_eager": 2.0}, "eager") == "2.00"  # a report from before spreads
    assert speedup({"speedup_vs_onnx_fp32": None}, "onnx_fp32") == "—"


def test_spread_is_how_far_the_middle_half_reaches_from_the_median() -> None:
    assert spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(1 / 3)  # 2 and 4 about 3
    assert spread([10.0, 10.0, 10.0, 13.0]) == pytest.approx(0.075)  # 75th percentile 10.75
    assert spread([5.0]) == 0.0


def latencies(p50: float, p90: float) -> list[float]:
    """Batch-1 latencies (ms) with these percentiles."""
    return [p50] * 85 + [p90] * 15


def rounds(text: str) -> list[float]:
    return [float(v) for v in text.split()]


# Rounds of two reports of the digits run on the same 2 cores: made alone (eager and static
# int8, 15 rounds), and while other work ran on them (1 round: static int8 "54x eager").
QUIET_EAGER = Timing(
    latencies(0.512, 0.595),
    rounds(
        "4811.7 4805.9 4784.8 4692.7 5227.2 5353.8 5324.1 5114.5 5103.8 5091.0 5081.1 5152.3 "
        "5224.8 5041.4 4939.2"
    ),
)
QUIET_STATIC = Timing(
    latencies(0.0613, 0.0696),
    rounds(
        "33283.8 33881.8 34132.9 34852.8 34405.2 34493.8 37505.8 36840.4 34756.2 34244.0 "
        "35078.4 35497.6 37107.9 33642.3 35192.4"
    ),
)
BUSY_EAGER = Timing(latencies(0.975, 99.928), [338.1])


def test_timings_of_a_quiet_machine_are_not_noisy_and_of_a_busy_one_are() -> None:
    assert QUIET_EAGER.noise(QUIET_EAGER, "eager") == []
    assert QUIET_STATIC.noise(QUIET_EAGER, "eager") == []
    assert BUSY_EAGER.noise(BUSY_EAGER, "eager") == ["p90 102x p50"]
    # some rounds slowed and not others: the variant's own, or the baseline's in its ratios
    slowed = Timing(throughput=[600.0, 800.0, 1000.0, 1300.0, 1600.0])
    steady = Timing(throughput=[1000.0] * 5)
    assert steady.noise(slowed, "eager") == ["x eager ±25%"]
    assert slowed.noise(steady, "eager") == ["img/s ±30%", "x eager ±30%"]
    assert slowed.noise() == ["img/s ±30%"]
    assert slowed.noise(steady, "eager", own_rounds=False) == ["x eager ±30%"]
    assert BUSY_EAGER.noise(own_rounds=False) == ["p90 102x p50"]


def test_timings_taken_while_other_processes_used_the_cpu_are_noisy_however_steady() -> None:
    # A report made beside a test run on the same 2 cores: ratios shifted alike in every round
    # (QAT "63.70 (62.28-64.04) x eager", 9x too high), so no spread or tail tells
    steady = Timing(latencies(0.06, 0.07), [34000.0, 34500.0, 34200.0, 34400.0, 34100.0])
    base = Timing(latencies(0.5, 0.6), [540.0, 545.0, 538.0, 541.0, 543.0])
    assert steady.noise(base, "eager") == []
    busy = Timing(steady.latency_ms, steady.throughput, others_cpu_s=4.8, machine_cpu_s=10.0)
    assert busy.busy_share == pytest.approx(0.48)
    assert busy.noise(base, "eager") == ["other processes used 48% of the CPU"]
    assert busy.noise(own_rounds=False) == ["other processes used 48% of the CPU"]
    # a quiet machine's share (reports made alone: 0.2-0.3 %, no variant over 2 %)
    quiet = Timing(steady.latency_ms, steady.throughput, others_cpu_s=0.02, machine_cpu_s=10.0)
    assert quiet.noise(base, "eager") == []
    assert steady.busy_share is None  # not measured (no /proc/stat): no reason either way
    # several variants' together; clock ticks can put one short interval below zero
    assert busy_share([busy, quiet]) == pytest.approx(4.82 / 20)
    assert busy_share([Timing(others_cpu_s=-0.01, machine_cpu_s=1.0)]) == 0.0
    assert busy_share([steady]) is None


def test_a_noisy_timing_is_put_down_to_a_busy_machine_only_where_others_were_measured_busy() -> (
    None
):
    """A report made alone on a 2-core KVM guest: other processes at 0.4 % of the CPU, eager's
    rounds ±23 %. Its warning said the machine was busy, below report.md's line of the 0.4 %."""
    spread_out = [600.0, 800.0, 1000.0, 1300.0, 1600.0]
    alone = Timing(throughput=spread_out, others_cpu_s=0.04, machine_cpu_s=10.0)
    assert alone.noise() == ["img/s ±30%"]
    assert noise_cause([alone, Timing(others_cpu_s=0.0, machine_cpu_s=10.0)]) == (
        "Other processes used only 0.2% of the CPU while measuring: the rounds varied on their "
        "own (the CPU's clock, a virtual machine's host)"
    )
    # others busy while one variant was timed, though not over the whole measurement
    busy = Timing(throughput=spread_out, others_cpu_s=4.8, machine_cpu_s=10.0)
    quiet = Timing(throughput=spread_out, others_cpu_s=0.0, machine_cpu_s=90.0)
    assert busy_share([busy, quiet]) == pytest.approx(0.048)
    assert noise_cause([busy, quiet], "quantize timed it") == (
        "The machine was busy while quantize timed it"
    )
    # most of it the virtual machine's host's (steal): top shows no process to look for
    guests = Timing(throughput=spread_out, others_cpu_s=4.8, machine_cpu_s=10.0, steal_cpu_s=4.0)
    assert noise_cause([guests]) == (
        "The machine was busy while measuring: its virtual machine's host took 40% of the CPU "
        "(steal), for other guests"
    )
    # no /proc/stat: nothing says which
    assert noise_cause([Timing(throughput=spread_out)]) == (
        "The machine was busy, or its speed moved, while measuring"
    )


def test_others_cpu_is_the_machines_busy_time_less_this_process() -> None:
    start = CpuClock(own_s=10.0, busy_s=100.0, total_s=400.0)
    end = CpuClock(own_s=10.9, busy_s=101.4, total_s=402.0)  # 1 s on 2 cores
    others, machine = end.others_since(start)
    assert others == pytest.approx(0.5) and machine == pytest.approx(2.0)


def test_measure_counts_the_cpu_others_used_while_each_variant_was_timed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each variant's share is taken over its own slices of each round (read before and after
    it): others busy while one variant ran show in that variant's share alone."""
    clock = {"own": 0.0, "busy": 0.0, "total": 0.0, "steal": 0.0}

    class Busy(Recorder):
        def _run(self, x: np.ndarray) -> np.ndarray:  # 1 ms on 2 cores, others' share `busy`
            clock["total"] += 0.002
            clock["own"] += 0.001
            clock["busy"] += 0.001 + 0.002 * (0.6 if self.name == "b" else 0.0)
            clock["steal"] += 0.002 * (0.5 if self.name == "b" else 0.0)  # of it, the host's
            return x

    # own, busy, total and steal, in CpuClock's order
    monkeypatch.setattr(CpuClock, "now", staticmethod(lambda: CpuClock(*clock.values())))
    calls: list[tuple[str, int]] = []
    predictors = {n: cast(Predictor, Busy(n, calls, 0.0)) for n in "ab"}
    images = np.zeros((3, 1, 2, 2), np.uint8)
    timings = measure(predictors, images, rounds=3, seconds=0.0, warmup=1)
    assert timings["a"].busy_share == pytest.approx(0.0, abs=1e-9)
    assert timings["b"].busy_share == pytest.approx(0.6)
    assert timings["b"].machine_cpu_s == pytest.approx(3 * 21 * 0.002)  # 20 + 1 calls a round
    assert timings["b"].noise(own_rounds=False) == ["other processes used 60% of the CPU"]
    assert steal_share([timings["a"]]) == pytest.approx(0.0, abs=1e-9)
    assert steal_share([timings["b"]]) == pytest.approx(0.5)
    assert steal_share(list(timings.values())) == pytest.approx(0.25)


def test_the_readme_says_what_each_round_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """It said "0.1 s or one call per variant and round": each round times each variant at
    batch 1 for 0.1 s and 20 calls at the least, then at its batch for 0.1 s and 1 call."""
    from lightship.report import ReportSettings

    seconds = ReportSettings().seconds
    said = (
        f"(each variant in each round: batch-1 calls for at least {seconds:g} s and "
        f"{measure_module.MIN_LATENCY_CALLS} calls, then batch calls for at least {seconds:g} s "
        f"and {measure_module.MIN_BATCH_CALLS} call; order shuffled per round)"
    )
    assert said in " ".join((ROOT / "README.md").read_text().split())
    calls: list[tuple[str, int]] = []
    p = cast(Predictor, Recorder("a", calls, 0.0))
    measure({"a": p}, np.zeros((3, 1, 2, 2), np.uint8), rounds=1, batch=8, warmup=0, seconds=0)
    assert calls == [("a", 1)] * 20 + [("a", 8)]


# /proc/stat on 2 CPUs (jiffies: user nice system idle iowait irq softirq steal guest guest_nice):
# cpu1 busy 330 of 530 (30 of them steal: its host ran another guest), cpu0 100 of 500
PROC_STAT = """cpu  300 0 100 580 20 0 0 30 0 0
cpu0 100 0 0 400 0 0 0 0 0 0
cpu1 200 0 100 180 20 0 0 30 0 0
intr 12345 0 0
ctxt 678
"""


@pytest.mark.parametrize(
    ("allowed", "busy", "total", "steal"),
    [
        ({0, 1}, 430, 1030, 30),
        ({0, 1, 2}, 430, 1030, 30),
        ({1}, 330, 530, 30),
        ({0}, 100, 500, 0),
        # a CPU it does not list: a container's /proc/stat (lxcfs) numbers from 0 where the
        # affinity names the host's CPUs, and cpu0's line is some other CPU's: the sum
        ({0, 7}, 430, 1030, 30),
    ],
)
def test_the_cpu_others_use_is_counted_on_the_cpus_this_process_may_run_on(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    allowed: set[int],
    busy: int,
    total: int,
    steal: int,
) -> None:
    """The report's threads run on its affinity set: others busy on the other cores warned
    of a busy machine (taskset -c 1 beside a loop on cpu 0). With every CPU in the set, the
    kernel's own sum, as before."""
    stat = tmp_path / "stat"
    stat.write_text(PROC_STAT)
    monkeypatch.setattr(measure_module, "Path", lambda _: stat)
    monkeypatch.setattr(measure_module, "allowed_cpus", lambda: allowed)
    tick = os.sysconf("SC_CLK_TCK")
    assert measure_module.machine_cpu_s() == pytest.approx((busy / tick, total / tick))
    with_steal = measure_module.machine_cpu_s_with_steal()
    assert with_steal == pytest.approx((busy / tick, total / tick, steal / tick))
    # a kernel that counts no steal (before 2.6.11: seven columns): none, the rest as read
    stat.write_text("cpu  300 0 100 580 20 0 0\n")
    monkeypatch.setattr(measure_module, "allowed_cpus", lambda: {0})
    assert measure_module.machine_cpu_s_with_steal() == pytest.approx((400 / tick, 1000 / tick, 0))


def test_without_proc_stat_the_share_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure_module, "Path", lambda _: Path("/nonexistent/stat"))
    assert CpuClock.now() is None
    calls: list[tuple[str, int]] = []
    p = cast(Predictor, Recorder("a", calls, 0.0))
    timings = measure({"a": p}, np.zeros((3, 1, 2, 2), np.uint8), rounds=2, seconds=0.0)
    assert timings["a"].busy_share is None and timings["a"].noise() == []


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="Linux's /proc/stat")
def test_a_busy_child_process_counts_as_others_and_this_process_does_not() -> None:
    """Real clocks: a child spinning for 0.4 s is others' CPU (at least its own CPU time, less
    a clock tick per core); this process spinning as long is not, whatever else runs here."""
    import resource

    cpus = sum(line[3:4].isdigit() for line in Path("/proc/stat").read_text().splitlines())
    slack = 2 * cpus / os.sysconf("SC_CLK_TCK")  # a clock tick per core at either end
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0, start = time.perf_counter(), CpuClock.now()
    subprocess.run([sys.executable, "-c", SPIN, "0.4"], check=True)
    end, wall = CpuClock.now(), time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert start is not None and end is not None
    child_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    others, machine = end.others_since(start)
    assert machine == pytest.approx(wall * cpus, abs=slack)  # every core's seconds
    assert others >= child_s - slack, (others, child_s)

    start = CpuClock.now()
    deadline = time.process_time() + 0.4
    while time.process_time() < deadline:
        pass
    end = CpuClock.now()
    assert start is not None and end is not None
    assert end.own_s - start.own_s >= 0.4
    others, machine = end.others_since(start)
    assert others <= machine - 0.4 + slack


SPIN = """
import sys, time
deadline = time.process_time() + float(sys.argv[1])
while time.process_time() < deadline:
    pass
"""


def test_rounds_time_every_variant_once_in_shuffled_orders() -> None:
    calls: list[tuple[str, int]] = []
    names = ["a", "b", "c", "d"]
    predictors = {n: cast(Predictor, Recorder(n, calls, 0.001)) for n in names}
    steps: list[tuple[str, int]] = []
    rounds = 6
    timings = measure(
        predictors,
        np.zeros((3, 1, 2, 2), np.uint8),
        rounds=rounds,
        batch=8,
        seconds=0.0,
        warmup=1,
        latency=False,
        on_step=lambda name, r: steps.append((name, r)),
    )
    assert calls[: 2 * len(names)] == [(n, b) for n in names for b in (1, 8)]  # warm-up
    orders = [[n for n, r in steps if r == i] for i in range(rounds)]
    assert all(sorted(o) == names for o in orders)  # each variant once per round ...
    assert len({tuple(o) for o in orders}) > 1  # ... not always in the same order
    timed = [n for n, b in calls[2 * len(names) :]]
    assert timed == [n for o in orders for n in o]  # one batch-8 call each (seconds=0)
    for t in timings.values():
        assert len(t.throughput) == rounds and t.latency_ms == []
        # 8 rows per call of >= 1 ms
        assert all(0 < v <= 8 / 0.001 for v in t.throughput)


def test_latency_calls_are_batch_one_and_at_least_twenty() -> None:
    calls: list[tuple[str, int]] = []
    p = cast(Any, Recorder("a", calls, 0.0))
    timings = measure({"a": p}, np.zeros((3, 1, 2, 2), np.uint8), rounds=2, seconds=0.0, warmup=0)
    assert len(timings["a"].latency_ms) == 40
    assert calls.count(("a", 1)) == 40 and calls.count(("a", 64)) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rounds", "0"], "report --rounds must be at least 1, got 0"),
        (["--batch", "0"], "report --batch must be at least 1, got 0"),
        (["--threads", "0"], "report --threads must be at least 1, got 0"),
        (
            ["--gate", "-1"],
            "report --gate is the fraction of fp32 accuracy an int8 variant keeps, in (0, 1.1] (e.g. 0.99), got -1",
        ),
        (
            ["--gate", "5"],
            "report --gate is the fraction of fp32 accuracy an int8 variant keeps, in (0, 1.1] (e.g. 0.99), got 5: did you mean 0.95?",
        ),
        (["--threads", "100000"], "report --threads must be at most 256, got 100000"),
        (["--batch", "1000000000000"], "report --batch must be at most 4096, got 1000000000000"),
    ],
)
def test_bad_report_options_exit_with_one_line(
    args: list[str], message: str, tmp_path: Path
) -> None:
    proc = run_cli("report", "--run", str(tmp_path), *args)
    assert proc.returncode == 2 and last_line(proc.stderr) == f"error: {message}"
    assert not (tmp_path / "report").exists()


# Page faults of the median eager forward pass of the digits CNN at batch 64, after warm-up: the
# median, since the kernel's page reclaim (kdamond runs here) can fault a few pages back into any
# one call (78 a call on average over 10 calls once in CI, against 0 usually).
FAULTS_PER_CALL = """
import resource, sys, torch
from lightship.models.zoo import DigitsCNN
from lightship.report.measure import give_back_freed_memory, keep_freed_memory
if sys.argv[1] in ("keep", "given back"):
    assert keep_freed_memory()
if sys.argv[1] == "given back":  # after a report: the caller's allocator as it was
    give_back_freed_memory()
torch.set_num_threads(1)
model, x = DigitsCNN().eval(), torch.zeros(64, 1, 28, 28)
counts = []
with torch.inference_mode():
    for _ in range(3):
        model(x)
    for _ in range(15):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model(x)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(counts)[len(counts) // 2])
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_freed_memory_stops_eager_faulting_its_activations_in_on_every_call() -> None:
    modes = ["default"] * 5 + ["keep", "given back"]
    # at once: each process counts its own faults, and most of its time is importing torch
    # (seven in a row took 40 s of the suite on a 2-core AVX2 EPYC)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FAULTS_PER_CALL, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for mode in modes
    ]
    faults = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        faults.append(int(out))
    # glibc's defaults: 3,100-7,600 faults a call, measured (6 MiB activations unmapped on
    # free); about one process in seven faults none (glibc's mmap threshold moves with the
    # order of the first frees), which failed CI: the median of five processes
    assert statistics.median(faults[:5]) > 1000, faults
    keep, given_back = faults[5:]
    assert keep < 50 and given_back > 1000, faults
