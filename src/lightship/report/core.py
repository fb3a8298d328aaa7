"""`report(run)`: every variant's accuracy, error and speed on this machine, one table."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import platform
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightship import __version__
from lightship.data import DataSpec, load_splits
from lightship.errors import ConfigError, RunError
from lightship.quantize import isa
from lightship.quantize.fallback import check_gate, sqnr_db
from lightship.report import render
from lightship.report.evaluate import candidates, logits
from lightship.report.measure import NOISE_RULE, keep_freed_memory, measure
from lightship.runs import REPORT_FILES, RunDir, atomic_paths, check_writable, note_interrupt
from lightship.runtime import physical_cores

log = logging.getLogger(__name__)


@dataclass
class ReportSettings:
    threads: int | None = None  # None: physical cores
    rounds: int = 15
    batch: int = 64
    seconds: float = 0.1  # per variant and round, batch-1 latency and batch throughput each
    gate: float = 0.99

    def __post_init__(self) -> None:
        # Above these, onnxruntime crashes (more threads than any CPU has) or memory runs out.
        for name, low, high in (("rounds", 1, None), ("batch", 1, 4096), ("threads", 1, 256)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ConfigError(f"report --{name} must be at least {low}, got {value}")
            if value is not None and high is not None and value > high:
                raise ConfigError(f"report --{name} must be at most {high}, got {value}")
        check_gate(self.gate, "report")
        if not self.seconds > 0:
            raise ConfigError(f"report seconds per round must be positive, got {self.seconds}")


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
    if console.is_terminal:
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("measuring variants", total=len(names) * rounds)
            yield lambda name, r: bar.update(task, advance=1, description=f"round {r + 1}: {name}")
        return
    print(f"measuring {len(names)} variants, {rounds} rounds: {', '.join(names)}", file=sys.stderr)
    steps = itertools.count(1)

    def on_step(name: str, r: int) -> None:
        if next(steps) % len(names) == 0:  # the round's last variant
            print(f"measured round {r + 1}/{rounds}", file=sys.stderr)

    yield on_step


def report(run: RunDir, settings: ReportSettings | None = None) -> dict[str, Any]:
    s = settings or ReportSettings()
    threads = s.threads or physical_cores()
    ckpt = run.artifact("checkpoint")
    if not run.root.is_dir() or ckpt is None:
        todo = run.command("train", "export", "quantize")
        raise RunError(f"no trained run in {run.root}: run {todo}")
    outputs = [run.root / f for f in REPORT_FILES]  # json, md, png: what a new artifact removes
    check_writable(*outputs)
    left_out: dict[str, str] = {}
    found = candidates(run, threads, left_out)
    if not any(c.name == "eager" for c in found):
        raise RunError(f"{run.root}/best.ckpt is missing: run {run.train_command()}")
    splits = load_splits(DataSpec.from_dict(run.data_spec()), recorded=True)
    x, y = splits.test_x, splits.test_y
    ref = logits(next(c for c in found if c.name == "eager").predictor, x)
    ref_acc = float(np.mean(ref.argmax(1) == y))

    # Stopped from here on, the report's files are as they were: say so, and how to start over.
    note_interrupt(
        f"{run.root / 'report'} is as it was (nothing measured is kept); "
        f"report again with {run.command('report')}"
    )
    kept = keep_freed_memory()  # a steady eager baseline: see its docstring
    with _progress([c.name for c in found], s.rounds) as on_step:
        timings = measure(
            {c.name: c.predictor for c in found},
            x,
            rounds=s.rounds,
            batch=s.batch,
            seconds=s.seconds,
            on_step=on_step,
        )
    eager = timings["eager"]
    # The other baseline the targets are stated against: what int8 adds over the fp32 runtime.
    fp32 = timings.get("onnx-fp32")
    rows: list[dict[str, Any]] = []
    for c in found:
        out = logits(c.predictor, x)
        acc = float(np.mean(out.argmax(1) == y))
        t = timings[c.name]
        recommendable = bool(c.entry.get("recommendable", True)) and c.name not in ("eager",)
        rows.append(
            {
                "name": c.name,
                "file": c.entry["file"],
                "bytes": c.path.stat().st_size,
                "accuracy": acc,
                "delta_vs_fp32": acc - ref_acc,
                "sqnr_db": sqnr_db(ref, out) if c.name != "eager" else None,
                "max_abs_diff": float(np.abs(out - ref).max()),
                "int8_share": (c.entry.get("int8_ops") or {}).get("share", 0.0),
                "latency_ms": t.summary(),
                "throughput_per_s": t.throughput_per_s,
                "throughput_rounds": [round(v, 1) for v in t.throughput],
                "speedup_vs_eager": t.speedup_over(eager),
                "speedup_vs_eager_iqr": t.speedup_spread(eager),
                "speedup_vs_onnx_fp32": t.speedup_over(fp32) if fp32 else None,
                "speedup_vs_onnx_fp32_iqr": t.speedup_spread(fp32) if fp32 else None,
                "timing_noise": t.noise(eager, "eager"),
                "gate_passed": acc >= s.gate * ref_acc,
                "recommendable": recommendable,
                "target": c.entry.get("target"),
                # ONNX on CPU: batches of `split_rows`+ rows run as one slice per lane
                "lanes": c.predictor.lanes,
                "split_rows": c.predictor.split_rows,
                "nodes_fp32": [n["node"] for n in c.entry.get("nodes_fp32_by_fallback", [])],
            }
        )
    eligible = [r for r in rows if r["gate_passed"] and r["recommendable"]]
    best = max(eligible, key=lambda r: r["throughput_per_s"]) if eligible else None
    for r in rows:
        r["recommended"] = best is not None and r["name"] == best["name"]
    static = run.artifact("onnx-int8-static") or {}
    cpu = isa.host_cpu()
    result: dict[str, Any] = {
        "schema": 1,
        "run": str(run.root),
        "model": ckpt.get("model"),
        "cpu": {**cpu.as_dict(), "target": cpu.target},
        "threads": threads,
        "batch": s.batch,
        "rounds": s.rounds,
        "test_images": len(x),
        "malloc_keeps_freed_memory": kept,
        "gate": s.gate,
        "fp32_accuracy": ref_acc,
        "versions": _versions(),
        "calibration": static.get("calibration"),
        "scheme_check": static.get("scheme_check"),
        "recommended": best["name"] if best else None,
        "timing_warning": _noise_warning(run, rows),
        "variants": rows,
        "not_measured": left_out,  # listed in the manifest, left out: why and the fix
    }
    report_json, report_md, pareto_png = outputs
    # Committed together (`atomic_paths`): the old set or the new one, never a new report.json
    # beside an old plot. report.json, which `serve` reads, is renamed last.
    with atomic_paths(pareto_png, report_md, report_json) as (tmp_png, tmp_md, tmp_json):
        tmp_json.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")  # strict JSON
        tmp_md.write_text(render.markdown(result))
        render.pareto(result, tmp_png)
    if result["timing_warning"]:
        log.warning("%s", result["timing_warning"])
    return result


def _noise_warning(run: RunDir, rows: list[dict[str, Any]]) -> str | None:
    """What report.md, report.json and the terminal say when some variant's timings are noisy
    (`Timing.noise`); None when none is."""
    noisy = [f"{r['name']} ({'; '.join(r['timing_noise'])})" for r in rows if r["timing_noise"]]
    if not noisy:
        return None
    return (
        f"timings are noisy ({NOISE_RULE}): {', '.join(noisy)}. The machine was busy while "
        "measuring, so the speed figures and the recommendation may be off: re-run "
        f"`lightship report --run {shlex.quote(str(run.root))}` when it is quiet"
    )
