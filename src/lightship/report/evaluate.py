"""Which variants a run has, and how accurate each is on the held-out test split."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightship.runs import RunDir, check_recorded
from lightship.runtime import Predictor, load_predictor

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
MANIFEST_KEY = {"eager": "checkpoint"}


@dataclass
class Candidate:
    name: str
    path: Path
    entry: dict[str, Any]
    predictor: Predictor


def candidates(run: RunDir, threads: int) -> list[Candidate]:
    """Every variant of VARIANTS whose file exists, loaded with `threads` threads."""
    artifacts = run.manifest()["artifacts"]
    found = []
    for name in VARIANTS:
        entry = artifacts.get(MANIFEST_KEY.get(name, name))
        if entry is None or not (run.root / entry["file"]).is_file():
            continue
        path = run.root / entry["file"]
        fix = f"it changed after `lightship` wrote it; re-run the stage that makes {name}"
        check_recorded(path, entry, fix)
        found.append(Candidate(name, path, entry, load_predictor(path, threads=threads)))
    return found


def logits(predictor: Predictor, x: np.ndarray, batch: int = 256) -> np.ndarray:
    """Logits for `x`, `batch` rows per `predict` call: a dynamic int8 model scales its
    activations per run, so its accuracy depends on how the images are batched. `quantize`
    records its accuracies through this function too, so its figures and the report's agree."""
    return np.concatenate([predictor.predict(x[i : i + batch]) for i in range(0, len(x), batch)])
