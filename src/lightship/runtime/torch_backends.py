"""TorchScript, torch.export (.pt2) and eager-checkpoint predictors (import torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightship.errors import RunError
from lightship.runs import export_hint
from lightship.runtime.base import (
    META_FILE,
    LoadError,
    Predictor,
    physical_cores,
    quiet_loggers,
    read_metadata,
)


class TorchPredictor(Predictor):
    def __init__(
        self, path: Path, module: Any, meta: dict[str, Any], kind: str, device: str
    ) -> None:
        self.path = path
        self.kind = kind
        self.device = device
        self.labels = list(meta["labels"])
        self.input_spec = dict(meta["input_spec"])
        self.module = module
        self.pinned = self.pads = device.startswith("cuda")

    def _run(self, x: np.ndarray) -> np.ndarray:
        if not x.flags.writeable:  # np.frombuffer's, a read-only memmap's: torch warns of it
            x = x.copy()
        with torch.inference_mode():
            t = torch.from_numpy(x)
            if self.pinned:
                t = t.pin_memory().to(self.device, non_blocking=True)
            return np.asarray(self.module(t).float().cpu().numpy())

    def close(self) -> None:
        super().close()
        vars(self).pop("module", None)
        if self.pinned:
            torch.cuda.empty_cache()  # torch's allocator keeps freed GPU memory for itself


def _device(device: str) -> str:
    """`device` as torch names it with its index (`cuda` is `cuda:0`, the current one): a
    .pt2 program checks its input's device against the one it was moved to, and `cuda` (index
    -1) is not `cuda:0`."""
    if not device.startswith("cuda"):
        return device
    if not torch.cuda.is_available():
        raise RunError(f"device={device} but torch sees no CUDA device: use --device cpu")
    index = torch.device(device).index
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise RunError(
            f"device={device} but torch sees {count} CUDA device{'s' * (count != 1)} "
            f"(cuda:0..cuda:{count - 1}): name one of them"
        )
    return f"cuda:{torch.cuda.current_device() if index is None else index}"


def on_device(program: Any, device: str) -> Any:
    """An exported program (.pt2) moved to `device`. `.module().to(device)` moves its weights
    but not the device its graph asserts its input is on (`_assert_tensor_metadata`, the CPU
    it was exported on): every batch on a GPU failed 'Tensor device mismatch'."""
    if device == "cpu":
        return program
    from torch.export.passes import move_to_device_pass

    return move_to_device_pass(program, device)


def _read_meta(extra: dict[str, Any], path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(extra.get(META_FILE) or "{}")
    except json.JSONDecodeError:
        raise RunError(f"{path}: its {META_FILE} is not valid JSON: re-export it") from None
    labels, spec = read_metadata(meta if isinstance(meta, dict) else {}, path)
    if labels is None or spec is None:
        raise RunError(
            f"{path} carries no {META_FILE} with labels and input spec: export it with lightship"
        )
    return {"labels": labels, "input_spec": spec}


def load(path: Path, kind: str, device: str = "cpu", threads: int | None = None) -> TorchPredictor:
    device = _device(device)
    if not path.is_file():
        raise RunError(f"{path} not found: {export_hint(path)}")
    # torch has one intra-op pool per process: every torch model in it runs on this many
    torch.set_num_threads(threads or physical_cores())
    try:
        if kind == "torchscript":
            extra = {META_FILE: ""}
            module = torch.jit.load(str(path), map_location=device, _extra_files=extra)
            module.eval()
            meta = _read_meta(extra, path)
        elif kind == "pt2":
            extra = {META_FILE: ""}
            # torch.export logs a long warning traceback for a corrupt .pt2 before raising,
            # which would bury the one-line error we print for it
            with quiet_loggers("torch.export"):
                program = torch.export.load(str(path), extra_files=extra)
            module = on_device(program, device).module()
            meta = _read_meta(extra, path)
        else:
            from lightship.models.checkpoint import load_checkpoint

            loaded = load_checkpoint(path)
            module = loaded.model.to(device).eval()
            meta = {"labels": loaded.labels, "input_spec": loaded.input_spec}
    except RunError:
        raise
    except Exception as exc:
        raise LoadError(path, kind, "torch", exc, "re-export it") from None
    return TorchPredictor(path, module, meta, kind, device)
