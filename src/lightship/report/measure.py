"""Latency and throughput, measured fairly: fixed threads, warm-up, variants interleaved.

Each round times every variant one after the other, in an order shuffled per round (seeded), so
a slow patch of the machine (another process, frequency change, a noisy neighbour) touches all
variants alike and no variant always follows the same one. Speed-ups are the median of ratios
taken within a round: on the machines we measured, speed drifts by 10-20 % within seconds, and
many short rounds gave ratios that repeat within a few per cent where three long ones spread by
a third (`lightship report --rounds` trades time for spread). Other work on the cores spreads
them far wider, or, where torch and ONNX Runtime slow unequally beside it, shifts every round's
ratio alike: `Timing.noise` says when, from the spread and from the CPU other processes used.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lightship.runtime import Predictor
from lightship.runtime.base import allowed_cpus, glibc, trim_heap

# A variant's timings are noisy (`Timing.noise`) past limits no quiet machine reached. On 2
# shared cores (Xeon, AVX-512 VNNI), the digits run's reports made alone (15 rounds) kept the
# middle half of every variant's rounds (img/s, and speed-ups within a round) within 5.2 % of
# their median and batch-1 p90 within 1.3x p50; the test suite's 2-round reports, made beside
# other tests, within 16 % and 2.2x. Reports made while other work ran on the cores reached
# 22 % and up or 20-350x, and one of them put int8 at "54x eager" (6.9x on a quiet machine).
NOISY_SPREAD = 0.2
NOISY_TAIL = 3.0
# Past this share of the machine's CPU used by other processes while a variant was timed, its
# timings are noisy however steady its rounds look: torch's OpenMP threads, which spin at their
# barriers, slow far more beside other work than ONNX Runtime does, so every round's ratio
# shifts alike. The digits run's 5-round reports on the same 2 cores, others' share measured
# beside them: alone, 0.2-0.3 % (no variant over 2 %), int8 6.9-7.0x eager; beside a loop busy
# a quarter of the time, 14 % (ONNX fp32 at 1.98x eager against 2.31-2.38x); half the time,
# 19 % (dynamic int8 1.39x against 1.09-1.12x); a loop always busy, 42 % (int8 23x); other
# workers' jobs, 57 %, int8 at 16.2x (15.4-17.0) with no spread or tail to tell.
NOISY_BUSY = 0.1
# What `Timing.noise`'s short reasons mean, for a message to say once
NOISE_RULE = (
    f"other processes using over {NOISY_BUSY:.0%} of the CPU, batch-1 p90 over "
    f"{NOISY_TAIL:g}x p50, or the middle half of the rounds over ±{NOISY_SPREAD:.0%} from "
    "their median"
)


def machine_cpu_s() -> tuple[float, float] | None:
    """The busy and total CPU seconds so far (`machine_cpu_s_with_steal`'s first two)."""
    machine = machine_cpu_s_with_steal()
    return None if machine is None else machine[:2]


def machine_cpu_s_with_steal() -> tuple[float, float, float] | None:
    """The busy, total and steal CPU seconds so far of the CPUs this process may run on (its
    affinity, where the report's threads run), from Linux's /proc/stat; None where there is
    none (not Linux). Other processes on cores outside the set do not slow the report, and
    counted they warned of a busy machine where `taskset` had kept the report apart from them.

    A cgroup CPU quota (`docker run --cpus`) is not taken in: it throttles this process on any
    core of its set without binding it to some, so which others' CPU time stood in its way
    cannot be told from /proc/stat; a quota far below the set can then warn of others' load
    on cores the report had no share of.

    Steal is a virtual machine's time its host ran something else (another guest) while it had
    work: busy for the report, which waited, but no process in it; 0 where the kernel counts
    none (before Linux 2.6.11 the line ends sooner)."""
    try:
        tick = os.sysconf("SC_CLK_TCK")  # no os.sysconf on Windows
        busy = total = steal = 0
        for line in cpu_lines(Path("/proc/stat").read_text(), allowed_cpus()):
            # user nice system idle iowait irq softirq steal (guest time is counted in user)
            jiffies = [int(v) for v in line.split()[1:9]]
            total += sum(jiffies)
            busy += sum(jiffies) - jiffies[3] - jiffies[4]
            steal += jiffies[7] if len(jiffies) > 7 else 0
    except (AttributeError, OSError, ValueError, IndexError):
        return None
    return busy / tick, total / tick, steal / tick


def cpu_lines(stat: str, allowed: set[int]) -> list[str]:
    """The lines of /proc/stat (`stat`) that count the CPUs in `allowed`: its first, the kernel's
    sum of every CPU, where `allowed` takes in every CPU it lists (the figures, to the tick, of
    before the affinity was read) or names one it does not list; else the `cpuN` line of each
    CPU in it."""
    lines = stat.splitlines()
    per_cpu = {int(m[1]): line for line in lines[1:] if (m := re.match(r"cpu(\d+)\s", line))}
    # every CPU allowed, or some not listed: a container's /proc/stat (lxcfs) numbers its CPUs
    # from 0 where the affinity names the host's, and a line of another CPU would be read
    if set(per_cpu) <= allowed or not allowed <= set(per_cpu):
        return lines[:1]
    return [line for cpu, line in per_cpu.items() if cpu in allowed]


@dataclass(frozen=True)
class CpuClock:
    """CPU seconds at one moment: this process's, all its threads together, and the machine's
    busy, total and steal (busy includes it), the CPUs this process may run on together
    (`machine_cpu_s_with_steal`)."""

    own_s: float
    busy_s: float
    total_s: float
    steal_s: float = 0.0

    @staticmethod
    def now() -> CpuClock | None:
        """None where there is no /proc/stat (not Linux): the busy share is then left out."""
        machine = machine_cpu_s_with_steal()
        return None if machine is None else CpuClock(time.process_time(), *machine)

    def steal_since(self, start: CpuClock) -> float:
        """CPU seconds the virtual machine's host took since `start` (steal), which
        `others_since` counts among other processes'."""
        return self.steal_s - start.steal_s

    def others_since(self, start: CpuClock) -> tuple[float, float]:
        """CPU seconds other processes used since `start` (the machine's busy time less this
        process's), and the machine's CPU seconds in all (elapsed x the CPUs this process may
        run on). The machine counts in clock ticks (10 ms), this process to the nanosecond:
        over one short interval the first can come out below zero, over many they even out."""
        others = (self.busy_s - start.busy_s) - (self.own_s - start.own_s)
        return others, self.total_s - start.total_s


def spread(values: Sequence[float] | np.ndarray) -> float:
    """How far the middle half of `values` reaches from their median, as a share of it: 0.05
    when the 25th and 75th percentiles both lie within 5 % of the median; 0 for one value."""
    low, mid, high = np.percentile(values, [25, 50, 75])
    return float(max(mid - low, high - mid) / mid)


@dataclass
class Timing:
    latency_ms: list[float] = field(default_factory=list)  # batch-1 calls, all rounds
    throughput: list[float] = field(default_factory=list)  # images/s, large batch, per round
    # CPU seconds other processes used while this variant was timed, and the machine's CPU
    # seconds over the same intervals (0: not measured, no /proc/stat)
    others_cpu_s: float = 0.0
    machine_cpu_s: float = 0.0
    # of others_cpu_s, the seconds a virtual machine's host took (steal): no process here
    steal_cpu_s: float = 0.0

    def summary(self) -> dict[str, float]:
        lat = np.asarray(self.latency_ms)
        return {
            "p50": float(np.percentile(lat, 50)),
            "p90": float(np.percentile(lat, 90)),
            "p99": float(np.percentile(lat, 99)),
        }

    @property
    def busy_share(self) -> float | None:
        """The share of the machine's CPU that other processes used while this variant was
        timed; None where it was not measured."""
        return busy_share([self])

    @property
    def throughput_per_s(self) -> float:
        return float(np.median(self.throughput))

    def speedup_over(self, base: Timing) -> float:
        """Median over rounds of this variant's throughput / `base`'s in the same round."""
        return float(np.median(self._ratios(base)))

    def speedup_noise(self, base: Timing) -> float:
        """`spread` of the within-round ratios over `base`: past `NOISY_SPREAD`, noisy."""
        return spread(self._ratios(base))

    def speedup_spread(self, base: Timing) -> list[float]:
        """The middle half (25th and 75th percentiles) of the within-round ratios: how far one
        figure of `speedup_over` can be trusted on a machine whose speed drifts."""
        low, high = np.percentile(self._ratios(base), [25, 75])
        return [float(low), float(high)]

    def noise(
        self, base: Timing | None = None, base_name: str = "base", *, own_rounds: bool = True
    ) -> list[str]:
        """What says this variant was timed on a busy machine, [] when nothing does (reasons as
        short as `other processes used 48% of the CPU`, `p90 102x p50`, `img/s ±31%`, `x eager
        ±26%`; `NOISE_RULE` says what they mean): other processes using more than `NOISY_BUSY`
        of the machine's CPU while it was timed, its batch-1 p90 over `NOISY_TAIL` times its
        p50 (another process held the core during some calls), or the middle half of its
        rounds' img/s, or of its within-round speed-ups over `base`, more than `NOISY_SPREAD`
        from their median (some rounds slowed and not others). `own_rounds=False` leaves out
        its own img/s, for a choice made on the speed-up alone: interleaving keeps that steady
        where every variant of a round slows alike."""
        busy = busy_reason(self.busy_share)
        found = [busy] if busy else []
        if self.latency_ms:
            lat = self.summary()
            if lat["p90"] > NOISY_TAIL * lat["p50"]:
                found.append(f"p90 {lat['p90'] / lat['p50']:.0f}x p50")
        rounds = [("img/s", self.throughput)] if own_rounds else []
        if base is not None:
            rounds.append((f"x {base_name}", list(self._ratios(base))))
        for what, values in rounds:
            wide = spread(values)
            if wide > NOISY_SPREAD:
                found.append(f"{what} ±{wide:.0%}")
        return found

    def speedup_bounds(self, base: Timing) -> tuple[float, float]:
        """Where the median of the within-round ratios over `base` lies, with ~95 % confidence
        and no assumption on their distribution: two of the sorted ratios, by the sign test's
        ranks (n/2 ∓ 0.98 √n). 8 rounds: the lowest and the highest; 32: the 10th and 23rd."""
        ratios = np.sort(self._ratios(base))
        n = len(ratios)
        low = max(math.floor((n - 1.96 * math.sqrt(n)) / 2), 1)
        high = min(math.ceil(1 + (n + 1.96 * math.sqrt(n)) / 2), n)
        return float(ratios[low - 1]), float(ratios[high - 1])

    def extend(self, other: Timing) -> None:
        """`other`'s calls and rounds added to this one's, as if timed in the same run."""
        self.latency_ms.extend(other.latency_ms)
        self.throughput.extend(other.throughput)
        self.others_cpu_s += other.others_cpu_s
        self.machine_cpu_s += other.machine_cpu_s
        self.steal_cpu_s += other.steal_cpu_s

    def _ratios(self, base: Timing) -> np.ndarray:
        return np.asarray(self.throughput) / np.asarray(base.throughput)


def busy_reason(share: float | None) -> str | None:
    """`other processes used 48% of the CPU` where `share` is over `NOISY_BUSY`, else None."""
    if share is None or share <= NOISY_BUSY:
        return None
    return f"other processes used {share:.0%} of the CPU"


def noise_cause(timings: Sequence[Timing], during: str = "measuring") -> str:
    """Why timings `Timing.noise` found noisy spread, as far as what was measured beside them
    says, as a sentence to go on with ", so ...": the machine was busy where other processes
    used over `NOISY_BUSY` of the CPU while some of `timings` ran; where their share was
    measured and stayed below that, the machine's own speed. A report made alone on a 2-core
    KVM guest (other processes at 0.4 %) had eager's rounds ±23 %, and its warning called the
    machine busy below report.md's line of that 0.4 %. Where a virtual machine's host took a
    good part of the CPU (steal, which /proc/stat counts as busy), that is said: `top` shows
    no process to look for."""
    if any(busy_reason(t.busy_share) for t in timings):
        host = steal_share(timings)
        if host is not None and host >= NOISY_BUSY / 2:  # no process to look for: say so
            return (
                f"The machine was busy while {during}: its virtual machine's host took "
                f"{host:.0%} of the CPU (steal), for other guests"
            )
        return f"The machine was busy while {during}"
    share = busy_share(timings)
    if share is None:  # not measured (no /proc/stat): either may be
        return f"The machine was busy, or its speed moved, while {during}"
    return (
        f"Other processes used only {share:.1%} of the CPU while {during}: the rounds varied "
        "on their own (the CPU's clock, a virtual machine's host)"
    )


def steal_share(timings: Sequence[Timing]) -> float | None:
    """The share of the machine's CPU a virtual machine's host took (steal) while `timings`
    were measured, part of `busy_share`; None where it was not measured."""
    return _cpu_share(timings, sum(t.steal_cpu_s for t in timings))


def busy_share(timings: Sequence[Timing]) -> float | None:
    """The share of the machine's CPU other processes used while `timings` were measured, all
    of them together; None where it was not measured (no /proc/stat)."""
    return _cpu_share(timings, sum(t.others_cpu_s for t in timings))


def _cpu_share(timings: Sequence[Timing], seconds: float) -> float | None:
    """`seconds` as a share of the machine's CPU seconds over `timings`, within 0..1 (clock
    ticks can put one short interval's below zero); None where none were measured."""
    total = sum(t.machine_cpu_s for t in timings)
    if total <= 0:
        return None
    return min(max(seconds / total, 0.0), 1.0)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # the largest glibc takes on 64-bit


def keep_freed_memory() -> bool:
    """Let glibc keep freed blocks up to 32 MiB in the heap instead of handing them back to the
    OS, so a model's activations are not page-faulted in again on every call; True if set.

    Eager PyTorch allocates its activations per call (6 MiB a layer for digits at batch 64): with
    glibc's defaults they are mmapped and unmapped each time, and eager digits ran at 2.1-3.2k
    img/s across five fresh processes, 3.6-3.9k with this (AVX-512 VNNI machine). ONNX Runtime
    keeps its own arena and is unaffected. Without it the report's eager baseline, and every
    speed-up over it, depended on the process's heap history. No-op off glibc.
    """
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    )


# glibc's own thresholds (its dynamic mmap threshold starts here; it stays off once set)
_DEFAULT_THRESHOLD = 128 * 1024


def give_back_freed_memory() -> None:
    """Undo `keep_freed_memory` (glibc's default thresholds) and hand the kept heap back to the
    OS: `report()` from a script or notebook left the process keeping its peak for good (400
    MiB of freed arrays stayed resident). No-op off glibc."""
    libc = glibc()
    if libc is None:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _DEFAULT_THRESHOLD)
    libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_THRESHOLD)
    trim_heap()


def time_calls(fn: Callable[[], object], seconds: float, min_calls: int) -> list[float]:
    out: list[float] = []
    start = time.perf_counter()
    while len(out) < min_calls or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


# Calls each variant gets at the least in each round, whatever `seconds` allows: enough
# batch-1 calls for a p90 (on a slow model, 0.1 s holds a few), and one batch for an img/s
MIN_LATENCY_CALLS = 20
MIN_BATCH_CALLS = 1


def measure(
    predictors: dict[str, Predictor],
    images: np.ndarray,
    rounds: int = 15,
    batch: int = 64,
    seconds: float = 0.1,
    warmup: int = 3,
    on_step: Callable[[str, int], None] | None = None,
    latency: bool = True,
) -> dict[str, Timing]:
    """Batch-1 latency (unless `latency` is False) and batch-`batch` throughput of each
    predictor (the hot path, no checks), each timed per round for at least `seconds` and
    `MIN_LATENCY_CALLS` or `MIN_BATCH_CALLS` calls."""
    one = np.ascontiguousarray(images[:1])
    big = np.ascontiguousarray(np.resize(images, (batch, *images.shape[1:])))
    timings = {name: Timing() for name in predictors}
    for p in predictors.values():
        for _ in range(warmup):
            p._run(one)
            p._run(big)
    names = list(predictors)
    order = np.random.default_rng(0)
    for r in range(rounds):
        for i in order.permutation(len(names)):
            name, p = names[i], predictors[names[i]]
            start = CpuClock.now()
            if latency:
                lat = time_calls(lambda p=p: p._run(one), seconds, MIN_LATENCY_CALLS)  # type: ignore[misc]
                timings[name].latency_ms.extend(1000 * t for t in lat)
            big_calls = time_calls(lambda p=p: p._run(big), seconds, MIN_BATCH_CALLS)  # type: ignore[misc]
            timings[name].throughput.append(batch * len(big_calls) / sum(big_calls))
            end = CpuClock.now()
            if start is not None and end is not None:
                others, machine = end.others_since(start)
                timings[name].others_cpu_s += others
                timings[name].machine_cpu_s += machine
                timings[name].steal_cpu_s += end.steal_since(start)
            if on_step is not None:
                on_step(name, r)
    return timings
