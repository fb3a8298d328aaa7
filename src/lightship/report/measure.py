"""Latency and throughput, measured fairly: fixed threads, warm-up, variants interleaved.

Each round times every variant one after the other, in an order shuffled per round (seeded), so
a slow patch of the machine (another process, frequency change, a noisy neighbour) touches all
variants alike and no variant always follows the same one. Speed-ups are the median of ratios
taken within a round: on the machines we measured, speed drifts by 10-20 % within seconds, and
many short rounds gave ratios that repeat within a few per cent where three long ones spread by
a third (`lightship report --rounds` trades time for spread). Other work on the cores spreads
them far wider: `Timing.noise` says when.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from lightship.runtime import Predictor

# A variant's timings are noisy (`Timing.noise`) past limits no quiet machine reached. On 2
# shared cores (Xeon, AVX-512 VNNI), the digits run's reports made alone (15 rounds) kept the
# middle half of every variant's rounds (img/s, and speed-ups within a round) within 5.2 % of
# their median and batch-1 p90 within 1.3x p50; the test suite's 2-round reports, made beside
# other tests, within 16 % and 2.2x. Reports made while other work ran on the cores reached
# 22 % and up or 20-350x, and one of them put int8 at "54x eager" (6.9x on a quiet machine).
NOISY_SPREAD = 0.2
NOISY_TAIL = 3.0
# What `Timing.noise`'s short reasons mean, for a message to say once
NOISE_RULE = (
    f"batch-1 p90 over {NOISY_TAIL:g}x p50, or the middle half of the rounds over "
    f"±{NOISY_SPREAD:.0%} from their median"
)


def spread(values: Sequence[float] | np.ndarray) -> float:
    """How far the middle half of `values` reaches from their median, as a share of it: 0.05
    when the 25th and 75th percentiles both lie within 5 % of the median; 0 for one value."""
    low, mid, high = np.percentile(values, [25, 50, 75])
    return float(max(mid - low, high - mid) / mid)


@dataclass
class Timing:
    latency_ms: list[float] = field(default_factory=list)  # batch-1 calls, all rounds
    throughput: list[float] = field(default_factory=list)  # images/s, large batch, per round

    def summary(self) -> dict[str, float]:
        lat = np.asarray(self.latency_ms)
        return {
            "p50": float(np.percentile(lat, 50)),
            "p90": float(np.percentile(lat, 90)),
            "p99": float(np.percentile(lat, 99)),
        }

    @property
    def throughput_per_s(self) -> float:
        return float(np.median(self.throughput))

    def speedup_over(self, base: Timing) -> float:
        """Median over rounds of this variant's throughput / `base`'s in the same round."""
        return float(np.median(self._ratios(base)))

    def speedup_spread(self, base: Timing) -> list[float]:
        """The middle half (25th and 75th percentiles) of the within-round ratios: how far one
        figure of `speedup_over` can be trusted on a machine whose speed drifts."""
        low, high = np.percentile(self._ratios(base), [25, 75])
        return [float(low), float(high)]

    def noise(
        self, base: Timing | None = None, base_name: str = "base", *, own_rounds: bool = True
    ) -> list[str]:
        """What says this variant was timed on a busy machine, [] when nothing does (reasons as
        short as `p90 102x p50`, `img/s ±31%`, `x eager ±26%`; `NOISE_RULE` says what they
        mean): its batch-1 p90 over `NOISY_TAIL` times its p50 (another process held the core
        during some calls), or the middle half of its rounds' img/s, or of its within-round
        speed-ups over `base`, more than `NOISY_SPREAD` from their median (some rounds slowed
        and not others). `own_rounds=False` leaves out its own img/s, for a choice made on the
        speed-up alone: interleaving keeps that steady where every variant of a round slows
        alike."""
        found = []
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

    def _ratios(self, base: Timing) -> np.ndarray:
        return np.asarray(self.throughput) / np.asarray(base.throughput)


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
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt; macOS, Windows)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    )


def time_calls(fn: Callable[[], object], seconds: float, min_calls: int) -> list[float]:
    out: list[float] = []
    start = time.perf_counter()
    while len(out) < min_calls or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


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
    predictor (the hot path, no checks), each timed for at least `seconds` per round."""
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
            if latency:
                lat = time_calls(lambda p=p: p._run(one), seconds, 20)  # type: ignore[misc]
                timings[name].latency_ms.extend(1000 * t for t in lat)
            big_calls = time_calls(lambda p=p: p._run(big), seconds, 1)  # type: ignore[misc]
            timings[name].throughput.append(batch * len(big_calls) / sum(big_calls))
            if on_step is not None:
                on_step(name, r)
    return timings
