"""Which variants a run has, and how accurate each is on the held-out test split."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightship.errors import RunError
from lightship.runs import RunDir, check_recorded
from lightship.runtime import Predictor, load_predictor
from lightship.runtime.base import LoadError, valid_input_spec

# Report order; `eager` is the fp32 PyTorch reference every other variant is compared with.
VARIANTS = (
    "eager",
    "torchscript",
    "pt2",
    "onnx-fp32",
    "onnx-int8-static",
    "onnx-int8-dynamic",
    "onnx-int8-qat",
)
# The trained fp32 model in each format: not quantized, so no accuracy gate is theirs to fail.
FP32_VARIANTS = VARIANTS[:4]
MANIFEST_KEY = {"eager": "checkpoint"}
log = logging.getLogger(__name__)


def other_input(predictor: Predictor, checkpoint: dict[str, Any]) -> str | None:
    """How `predictor`'s model takes other images than the run's (its `checkpoint` entry's
    input spec): another model's file recorded in the run, whose first batch would fail deep
    in its runtime. None when it takes the run's, or the entry states none."""
    spec: Any = checkpoint.get("input_spec")
    if not valid_input_spec(spec):
        return None
    runs = tuple(spec["shape"][1:])
    if predictor.chw == runs:
        return None

    def shape(chw: tuple[int, ...]) -> str:
        return f"[N,{','.join(map(str, chw))}]"

    return f"it takes {shape(predictor.chw)}, the run's images are {shape(runs)}"


@dataclass
class Candidate:
    name: str
    path: Path
    entry: dict[str, Any]
    predictor: Predictor


def candidates(
    run: RunDir, threads: int, left_out: dict[str, str] | None = None
) -> list[Candidate]:
    """Every variant of VARIANTS whose file exists, loaded with `threads` threads. A listed
    variant whose file is gone, is not the file its manifest entry recorded (sha256: changed
    or cut short since its stage wrote it), whose runtime cannot load it (made by another
    onnxruntime or torch), or that takes other images than the run's (another model's file)
    is left out with a warning that says how to make it again, as quantize leaves out a
    method that fails: one bad variant does not cost the report of all the others, and the
    new report, which replaces the old one, no longer shows the old file's figures.
    `left_out`, when given, gets each such variant's reason, for the report to print."""
    artifacts = run.manifest()["artifacts"]
    left_out = {} if left_out is None else left_out
    found = []
    for name in VARIANTS:
        entry = artifacts.get(MANIFEST_KEY.get(name, name))
        if entry is None:
            continue
        path = run.root / entry["file"]
        if not path.is_file():
            left_out[name] = (
                f"listed in the manifest but {run.relative(path)} is gone; "
                f"{run.remake_command(name)} makes it again"
            )
            log.warning("%s is %s (not measured)", name, left_out[name])
            continue
        fix = f"it changed after `lightship` wrote it; re-run {run.remake_command(name)}"
        try:
            check_recorded(path, entry, fix)
        except RunError:
            if name == "eager":  # the reference: no report without it
                raise
            changed = f"{run.relative(path)} differs from its manifest entry (sha256): it changed"
            why = f"{changed} after `lightship` wrote it; {run.remake_command(name)} makes it again"
            _leave_out(left_out, name, why)
            continue
        elsewhere = run.made_elsewhere(MANIFEST_KEY.get(name, name), artifacts)
        if elsewhere is not None:  # another run's model of the same input: its figures lie
            why = f"{run.relative(path)} was {elsewhere}; {run.remake_command(name)} makes it again"
            _leave_out(left_out, name, why)
            continue
        try:
            # an int8 model made for another CPU: the report says it, by the entry's target
            predictor = load_predictor(path, threads=threads, isa_check=False)
        except LoadError as exc:
            if name == "eager":  # the reference: no report without it
                raise
            why = (
                f"{exc.runtime} cannot load {run.relative(path)} ({exc.reason()}); "
                f"{run.remake_command(name)} makes it again"
            )
            _leave_out(left_out, name, why)
            continue
        other = other_input(predictor, artifacts.get("checkpoint") or {})
        if other is not None:
            why = f"{run.relative(path)} is not this run's model ({other})"
            if name == "eager":  # the reference: no report without it
                raise RunError(f"{why}: {run.remake_hint(name)}")
            _leave_out(left_out, name, f"{why}; {run.remake_command(name)} makes it again")
            continue
        found.append(Candidate(name, path, entry, predictor))
    return found


def _leave_out(left_out: dict[str, str], name: str, why: str) -> None:
    """Keep `why` `name` is not measured, for report.json and report.md, and warn of it."""
    left_out[name] = why
    log.warning("%s: %s (not measured)", name, why)


def logits(predictor: Predictor, x: np.ndarray, batch: int = 256) -> np.ndarray:
    """Logits for `x`, `batch` rows per run, each run whole (`unsplit`): a dynamic int8 model
    scales its activations per run, so its accuracy depends on how the images are batched.
    `quantize` records its accuracies through this function too, so its figures and the
    report's agree, on any number of cores."""
    whole = unsplit(predictor)
    return np.concatenate([whole.predict(x[i : i + batch]) for i in range(0, len(x), batch)])


def unsplit(predictor: Predictor) -> Predictor:
    """`predictor`, or its model loaded again with `split=False` when it splits long batches
    over one lane per core: each lane of a dynamic int8 model takes its own activation scale,
    so accuracy evaluated on lanes would change with the core count. Timing keeps the lanes."""
    if predictor.lanes == 1:
        return predictor
    # loaded again: its first load, or the report, said if it was made for another CPU
    return load_predictor(predictor.path, device=predictor.device, split=False, isa_check=False)
