"""`report(run)`: every variant's accuracy, error and speed on this machine, one table."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import math
import platform
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightship import __version__
from lightship.data import DataSpec, check_as_trained, load_splits
from lightship.errors import ConfigError, RunError, check_settings
from lightship.quantize import isa
from lightship.quantize.fallback import (
    DEFAULT_GATE,
    GATE_MAX,
    check_gate,
    passes_gate,
    sqnr_db,
)
from lightship.report import render
from lightship.report.evaluate import FP32_VARIANTS, candidates, logits
from lightship.report.measure import (
    NOISE_RULE,
    NOISY_SPREAD,
    Timing,
    busy_reason,
    busy_share,
    give_back_freed_memory,
    keep_freed_memory,
    measure,
    noise_cause,
    steal_share,
)
from lightship.runs import (
    REPORT_FILES,
    RunDir,
    RunLike,
    as_run,
    atomic_paths,
    check_space,
    check_writable,
    lock_run,
    note_interrupt,
    stage_on,
)
from lightship.runtime import Predictor, physical_cores
from lightship.runtime.base import caller_state_kept
from lightship.runtime.ort import OrtPredictor

log = logging.getLogger(__name__)


@dataclass
class ReportSettings:
    threads: int | None = None  # None: physical cores
    rounds: int = 15
    batch: int = 64
    seconds: float = 0.1  # per variant and round, batch-1 latency and batch throughput each
    gate: float | None = None  # None: the gate quantize judged the int8 variants by

    def __post_init__(self) -> None:
        check_settings(self, ReportSettings, "report")
        # Above these, onnxruntime crashes (more threads than any CPU has) or memory runs out.
        for name, low, high in (("rounds", 1, None), ("batch", 1, 4096), ("threads", 1, 256)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ConfigError(f"report --{name} must be at least {low}, got {value}")
            if value is not None and high is not None and value > high:
                raise ConfigError(f"report --{name} must be at most {high}, got {value}")
        if self.gate is not None:
            check_gate(self.gate, "report")
        if not self.seconds > 0:
            raise ConfigError(f"report seconds per round must be positive, got {self.seconds}")

    def again(self, run: RunDir) -> str:
        """The command that reports `run` again with these settings, quoted for a message: the
        options given (`make report REPORT_ARGS='--gate 0.95'`); without them another gate
        could judge and another variant be chosen."""
        defaults = ReportSettings()
        flags = [
            word
            for name in ("threads", "rounds", "batch", "gate")
            if (value := getattr(self, name)) is not None and value != getattr(defaults, name)
            for word in (f"--{name}", f"{value:g}" if isinstance(value, float) else str(value))
        ]
        return f"`{stage_on(run.root, 'report', run.pythonpath(), flags=flags)}`"


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"lightship": __version__, "python": platform.python_version()}
    for pkg in ("onnxruntime", "torch", "onnx"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[pkg] = md.version(pkg)
    return out


@contextlib.contextmanager
def _progress(names: list[str], rounds: int) -> Iterator[Callable[[str, int], None]]:
    """`measure`'s on_step: rich's bar on a terminal; elsewhere (CI logs, pipes), where no bar is
    drawn, a line per round on stderr, as training prints one per epoch."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    if console.is_terminal and not console.is_dumb_terminal:  # TERM=dumb: rich draws no bar
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("measuring variants", total=len(names) * rounds)
            yield lambda name, r: bar.update(task, advance=1, description=f"round {r + 1}: {name}")
        return
    what = f"{len(names)} variant{'s' if len(names) != 1 else ''}"
    print(f"measuring {what}, {rounds} rounds: {', '.join(names)}", file=sys.stderr)
    steps = itertools.count(1)

    def on_step(name: str, r: int) -> None:
        if next(steps) % len(names) == 0:  # the round's last variant
            print(f"measured round {r + 1}/{rounds}", file=sys.stderr)

    yield on_step


def report(run: RunLike, settings: ReportSettings | None = None) -> dict[str, Any]:
    """Measure every variant of `run`, write its report's files and return report.json's
    content; timings too noisy to trust are `timing_warning` in it (and in report.md), for the
    caller to show where its reader looks (the CLI: after its table)."""
    # The run lock, for the CLI and a call from Python alike: no other stage may replace a
    # variant while it is measured, and the report's files would then describe the old one.
    run = as_run(run)
    settings = ReportSettings() if settings is None else settings  # `{}` is no settings
    check_settings(settings, ReportSettings, "report")
    with lock_run(run.root, "lightship report"), caller_state_kept():
        made = not run.report_dir.exists()  # by `check_writable`, before the measuring
        try:
            return _report(run, settings)
        except BaseException:  # a report that failed (its data gone, say) leaves no empty folder
            if made:
                with contextlib.suppress(OSError):  # not empty: not ours to remove
                    run.report_dir.rmdir()
            raise


def _recorded_gate(entries: list[dict[str, Any]]) -> float:
    """The gate quantize judged the int8 variants by (its --gate, in each entry), so that the
    report judges them alike: the strictest where they were quantized with different gates
    (said), quantize's default where none was recorded."""
    recorded = [e["gate"].get("min_ratio") for e in entries if isinstance(e.get("gate"), dict)]
    numbers = [float(g) for g in recorded if type(g) in (float, int)]
    gates = sorted({g for g in numbers if math.isfinite(g) and 0 < g <= GATE_MAX})
    if odd := [g for g in numbers if g not in gates]:  # an edited manifest's (inf: a traceback)
        log.warning(
            "the manifest records int8 gates quantize never writes (%s): ignored",
            ", ".join(f"{g:g}" for g in odd),
        )
    if len(gates) > 1:
        log.warning(
            "the int8 variants were quantized with different --gate values (%s): the report "
            "judges them all by the strictest, %g (report --gate to choose another)",
            ", ".join(f"{g:g}" for g in gates),
            gates[-1],
        )
    return gates[-1] if gates else DEFAULT_GATE


# Room the report's files need, with a margin: report.json and report.md grow with the
# variants, pareto.png with nothing
REPORT_ROOM = 2_000_000


def _report(run: RunDir, s: ReportSettings) -> dict[str, Any]:
    threads = s.threads or physical_cores()
    ckpt = run.artifact("checkpoint")
    if not run.root.is_dir() or ckpt is None:
        raise run.unrecorded("export", "quantize")
    outputs = [run.root / f for f in REPORT_FILES]  # json, md, png: what a new artifact removes
    check_writable(*outputs)
    # Before minutes of timing, not after them ("no space left ... writing a file"): the
    # files take ~50 kB (digits), each written beside the old one before it replaces it
    check_space(run.root, REPORT_ROOM, "report")
    left_out: dict[str, str] = {}
    found = candidates(run, threads, left_out)
    gate = s.gate if s.gate is not None else _recorded_gate([c.entry for c in found])
    if not any(c.name == "eager" for c in found):
        raise RunError(f"{run.root}/best.ckpt is missing: run {run.train_command()}")
    splits = load_splits(DataSpec.from_dict(run.data_spec()), recorded=True, only=("test",))
    x, y = splits.test_x, splits.test_y
    ref = logits(next(c for c in found if c.name == "eager").predictor, x)
    ref_acc = float(np.mean(ref.argmax(1) == y))
    from lightship.models import module_file  # torch's, which eager has loaded

    name = (ckpt.get("model") or {}).get("name")  # its module as it is now ran best.ckpt
    check_as_trained(ckpt, y, ref_acc, "best.ckpt", module_file(name) if name else None)

    # Stopped from here on, the report's files are as they were: say so, and how to start over.
    note_interrupt(
        f"{run.root / 'report'} is as it was (nothing measured is kept); "
        f"report again with {s.again(run)}"
    )
    kept = keep_freed_memory()  # a steady eager baseline: see its docstring
    try:
        with _progress([c.name for c in found], s.rounds) as on_step:
            timings = measure(
                {c.name: c.predictor for c in found},
                x,
                rounds=s.rounds,
                batch=s.batch,
                seconds=s.seconds,
                on_step=on_step,
            )
    finally:  # the caller's process (a notebook) gets its allocator back as it was
        give_back_freed_memory()
    eager = timings["eager"]
    # The other baseline the targets are stated against: what int8 adds over the fp32 runtime.
    fp32 = timings.get("onnx-fp32")
    rows: list[dict[str, Any]] = []
    for c in found:
        out = logits(c.predictor, x)
        acc = float(np.mean(out.argmax(1) == y))
        t = timings[c.name]
        recommendable = bool(c.entry.get("recommendable", True)) and c.name not in ("eager",)
        # an int8 model made for another CPU (or TensorRT): the server here refuses it
        target = c.entry.get("target")
        redo = functools.partial(run.requantize, c.name, flags=c.entry.get("flags"))
        refused = isa.compatibility(target, redo=redo) if isinstance(target, str) else None
        if refused is not None:
            recommendable = False
            log.warning("%s is not recommended: serve refuses it on this CPU: %s", c.name, refused)
        rows.append(
            {
                "name": c.name,
                "file": c.entry["file"],
                "bytes": c.path.stat().st_size,
                # the file measured (`candidates` checked it against its entry): `serve` tells
                # a file made again since, even to the same size, by it
                "sha256": c.entry.get("sha256"),
                "accuracy": acc,
                "delta_vs_fp32": acc - ref_acc,
                # answers unlike eager fp32's: a net +1 image can hide 3 changed (entropy
                # calibration's int8 digits: 11 dB SQNR, +0.37 pt, recommended)
                "answers_changed": int(np.sum(out.argmax(1) != ref.argmax(1))),
                "sqnr_db": sqnr_db(ref, out) if c.name != "eager" else None,
                "max_abs_diff": float(np.abs(out - ref).max()),
                # ONNX Runtime's own count; an fp32 ONNX file has none, a torch one no count
                "int8_share": (c.entry.get("int8_ops") or {}).get(
                    "share", 0.0 if c.entry.get("format") == "onnx" else None
                ),
                "latency_ms": t.summary(),
                "throughput_per_s": t.throughput_per_s,
                "throughput_rounds": [round(v, 1) for v in t.throughput],
                "speedup_vs_eager": t.speedup_over(eager),
                "speedup_vs_eager_iqr": t.speedup_spread(eager),
                "speedup_vs_onnx_fp32": t.speedup_over(fp32) if fp32 else None,
                "speedup_vs_onnx_fp32_iqr": t.speedup_spread(fp32) if fp32 else None,
                "timing_noise": t.noise(eager, "eager"),
                "machine_busy_share": _share(t.busy_share),
                "machine_steal_share": _share(steal_share([t])),
                # the fp32 model in another format keeps all of fp32's accuracy when it scores
                # as eager does, whatever the gate (above 1, quantize's way to force its
                # fallback, it failed eager against itself and left nothing to recommend)
                "gate_passed": (c.name in FP32_VARIANTS and acc >= ref_acc)
                or passes_gate(acc, ref_acc, gate, len(y)),
                "recommendable": recommendable,
                # why quantize held it back however fast (dynamic int8 on a conv net)
                "held_back": None
                if c.entry.get("recommendable", True)
                else str(c.entry.get("why") or "quantize marked it not recommendable"),
                "refused_here": refused,
                "target": c.entry.get("target"),
                # ONNX on CPU: batches of `split_rows`+ rows run as one slice per lane
                "lanes": c.predictor.lanes,
                "split_rows": c.predictor.split_rows,
                # ONNX Runtime answers one image on one thread where that measured sooner
                "batch1_threads": threads_at(c.predictor, 1, threads),
                # the threads the throughput batch ran on, and the one-thread lanes it was
                # split over (1: one session): below `split_rows`, the batch-1 session's
                "batch_threads": threads_at(c.predictor, s.batch, threads),
                "batch_lanes": c.predictor.lanes if c.predictor.splits(s.batch) else 1,
                "nodes_fp32": [n["node"] for n in c.entry.get("nodes_fp32_by_fallback", [])],
            }
        )
    best, recommended_by = recommend(rows, timings, s.batch)
    for r in rows:
        r["recommended"] = r["name"] == best
    # measured here, not left out: a file gone or changed has no calibration or check to show
    static = next((c.entry for c in found if c.name == "onnx-int8-static"), {})
    scheme_check = static.get("scheme_check")
    if scheme_check:  # measured by quantize, on the CPU its entry names: not always this one
        scheme_check = {**scheme_check, "cpu": static.get("cpu")}
    cpu = isa.host_cpu()
    result: dict[str, Any] = {
        "schema": 1,
        "run": str(run.root),
        "model": ckpt.get("model"),
        "cpu": cpu.as_dict(target=True),
        "threads": threads,
        "batch": s.batch,
        "rounds": s.rounds,
        "test_images": len(x),
        "malloc_keeps_freed_memory": kept,
        "machine_busy_share": _share(busy_share(list(timings.values()))),
        # of it, a virtual machine's host's (steal): no process on this machine
        "machine_steal_share": _share(steal_share(list(timings.values()))),
        "gate": gate,
        "fp32_accuracy": ref_acc,
        "versions": _versions(),
        "calibration": static.get("calibration"),
        "scheme_check": scheme_check,
        "recommended": best,
        "recommended_by": recommended_by,
        "timing_warning": _noise_warning(s.again(run), rows, timings, recommended_by["fastest"]),
        "variants": rows,
        "not_measured": left_out,  # listed in the manifest, left out: why and the fix
        # the sha256 of each one's file as it was left out (null: gone): `serve` tells a file
        # made again since (restored, or made anew, even to the same bytes) by its own
        "not_measured_files": {name: run.file_sha256(name) for name in left_out},
    }
    report_json, report_md, pareto_png = outputs
    # Committed together (`atomic_paths`): the old set or the new one, never a new report.json
    # beside an old plot. report.json, which `serve` reads, is renamed last. Stopped during the
    # renames, the stop takes effect after them: the new report is what is then said to stand.
    written = f"the new report was written to {run.report_dir}"
    with atomic_paths(pareto_png, report_md, report_json, done=written) as temporaries:
        tmp_png, tmp_md, tmp_json = temporaries
        tmp_json.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")  # strict JSON
        tmp_md.write_text(render.markdown(result))
        render.pareto(result, tmp_png)
    return result


def threads_at(predictor: Predictor, rows: int, threads: int) -> int:
    """The threads `predictor` runs a batch of `rows` on: ONNX Runtime's as it routes the
    batch (`OrtPredictor.threads_at`); torch, `threads`. The report says each batch's own:
    int8 digits split from 8 rows, so at --batch 4 its img/s was measured on one thread beside
    ONNX fp32's two lanes, where report.md said two."""
    return predictor.threads_at(rows) if isinstance(predictor, OrtPredictor) else threads


def _share(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def recommend(
    rows: list[dict[str, Any]], timings: dict[str, Timing], batch: int
) -> tuple[str | None, dict[str, Any]]:
    """The variant to serve (None when no variant passes the gate and can be served) and how
    it was chosen (`rule`), report.json's `recommended_by`.

    Compared pairwise, within rounds: absolute img/s drift between rounds by more than the
    int8 variants differ (two reports of one run put QAT and static 21 % apart, where within
    rounds QAT ran 1.03x static). The fastest is the variant whose smallest median ratio over
    another is largest: the one that beats every other, where one does. A variant the fastest
    does not beat in at least three rounds of four (the 25th percentile of its ratio over it
    at or below 1.0) is as fast, and the tie goes to what is closer to fp32: QAT digits ran as
    fast as static int8 with SQNR 10.6 dB against 49.1, and `serve --variant auto` flipped
    between them from one report to the next."""
    rule = (
        f"fastest at batch {batch} of those that pass the gate, by within-round speed ratios; "
        "one whose ratio to it has a middle half reaching 1.0 ties with it, and a tie goes to "
        "the higher SQNR vs fp32 (closer to the model trained), then the smaller file"
    )
    eligible = [r for r in rows if r["gate_passed"] and r["recommendable"]]
    if not eligible:
        return None, {"rule": rule, "fastest": None, "over": {}, "tied": [], "tie_break": None}

    def ratio(a: str, b: str) -> float:
        return timings[a].speedup_over(timings[b])

    names = [r["name"] for r in eligible]
    fastest = max(
        names, key=lambda a: min((ratio(a, b) for b in names if b != a), default=math.inf)
    )
    others = [b for b in names if b != fastest]
    # as report.json gives them, and judged so: a spread of 1.0004 shown as 1.0 was no tie
    spreads = {
        b: [round(v, 3) for v in timings[fastest].speedup_spread(timings[b])] for b in others
    }
    tied = [fastest, *(b for b in others if spreads[b][0] <= 1.0)]
    over = {b: {"ratio": round(ratio(fastest, b), 3), "iqr": spreads[b]} for b in others}
    by_row = {r["name"]: r for r in eligible}

    def closeness(name: str) -> tuple[float, int]:  # higher SQNR, then fewer bytes
        sqnr = by_row[name]["sqnr_db"]
        return (-math.inf if sqnr is None else sqnr, -by_row[name]["bytes"])

    best = max(tied, key=closeness)
    tie_break = None
    if len(tied) > 1:
        top = [n for n in tied if by_row[n]["sqnr_db"] == by_row[best]["sqnr_db"]]
        tie_break = "sqnr" if len(top) == 1 else "bytes"
    return best, {
        "rule": rule,
        "fastest": fastest,
        "over": over,  # the fastest's within-round ratio over each other one: median, IQR
        "tied": tied if len(tied) > 1 else [],
        "tie_break": tie_break,
    }


def _noise_warning(
    again: str, rows: list[dict[str, Any]], timings: dict[str, Timing], fastest: str | None
) -> str | None:
    """What report.md, report.json and the terminal say when some variant's timings are noisy
    (each row's `timing_noise`); None when none is. Where other processes were busy over the
    whole measurement, that is said once rather than for every variant. The recommendation is
    called into doubt only where what it rests on was noisy (`_pick_in_doubt`)."""
    whole = busy_reason(busy_share(list(timings.values())))
    found = [f"{whole} while measuring"] if whole else []
    for r in rows:
        own = busy_reason(timings[r["name"]].busy_share)
        reasons = [n for n in r["timing_noise"] if not (whole and n == own)]
        if reasons:
            found.append(f"{r['name']} ({'; '.join(reasons)})")
    if not found:
        return None
    off = (
        "the speed figures and the recommendation may be off"
        if _pick_in_doubt(rows, timings, fastest)
        else f"the speed figures may be off, though not the recommendation (the within-round "
        f"ratios between the variants it chose from stayed within ±{NOISY_SPREAD:.0%})"
    )
    return (
        f"timings are noisy ({NOISE_RULE}): {', '.join(found)}. "
        f"{noise_cause(list(timings.values()))}, so {off}: re-run {again} "
        "when it is quiet"
    )


def _pick_in_doubt(
    rows: list[dict[str, Any]], timings: dict[str, Timing], fastest: str | None
) -> bool:
    """Whether what the recommendation rests on was noisy: other processes busy while one of
    the variants it chose from was timed, or the fastest one's within-round speed-up over
    another spread past `NOISY_SPREAD`. Eager and the variants it does not recommend do not
    count, nor does a spread that slowed every variant of a round alike: a report on the AVX2
    EPYC warned of dynamic int8's rounds (±48 %: the machine slowed in 4 of 15, and dynamic
    int8 most) and said the recommendation may be off, where static int8's ratio over QAT, the
    closest it chose between, had its middle half at 0.99-1.03."""
    if fastest is None:
        return False
    names = [r["name"] for r in rows if r["gate_passed"] and r["recommendable"]]
    if any(busy_reason(timings[n].busy_share) for n in names):
        return True
    return any(
        timings[fastest].speedup_noise(timings[b]) > NOISY_SPREAD for b in names if b != fastest
    )
