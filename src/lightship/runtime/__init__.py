"""One `Predictor` interface over ONNX Runtime, TorchScript, torch.export (.pt2) and eager.

`predict(x) -> logits` on uint8 `[N, C, H, W]`; `labels` and `input_spec` come from the
artifact itself. Only the ORT predictor is imported eagerly: it needs onnxruntime and numpy,
so a server of ONNX models never imports torch (torch predictors import it when built).
"""

from __future__ import annotations

import re
from pathlib import Path

from lightship.errors import ConfigError, RunError
from lightship.runtime.base import InputError, OutputError, Predictor, physical_cores, softmax
from lightship.runtime.ort import OrtPredictor

TORCH_SUFFIXES = {".ts": "torchscript", ".pt2": "pt2", ".ckpt": "eager"}
TORCH_KINDS = {"torchscript": "TorchScript", "pt2": "torch.export (.pt2)", "eager": "checkpoint"}


# The devices a model is loaded on: the CPU, or a GPU by torch's names (serve's settings,
# which import no runtime, check the same).
DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def load_predictor(
    path: Path | str,
    device: str = "cpu",
    threads: int | None = None,
    split: bool = True,
    isa_check: bool = True,
) -> Predictor:
    """The predictor for an artifact, chosen by its file type. `split`: an ONNX model on CPU
    runs long batches as one slice per thread on one-thread sessions (`OrtPredictor`).
    `isa_check`: warn when an int8 ONNX model was quantized for a CPU that computes it
    differently from this one (its answers here drift). A torch model (.ts, .pt2, .ckpt) sets
    torch's thread count for the process to `threads` (None: one per physical core), as
    torch has one."""
    path = Path(path)
    if not isinstance(device, str) or not DEVICE.fullmatch(device):
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    # bool is an int; 2.0 reached onnxruntime, whose TypeError blamed the model file
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise ConfigError(
            f"threads must be a whole number >= 1 (None: one per core), got {threads!r}"
        )
    if path.suffix == ".onnx":
        return OrtPredictor(path, device=device, threads=threads, split=split, isa_check=isa_check)
    if path.suffix in TORCH_SUFFIXES:
        kind = TORCH_SUFFIXES[path.suffix]
        try:
            from lightship.runtime import torch_backends
        except ModuleNotFoundError as exc:
            if exc.name != "torch":
                raise
            # The serving install (and its Docker image) has no torch: a user's choice of model
            # to fix, not a bug to show a traceback for.
            raise RunError(
                f"{path} is a {TORCH_KINDS[kind]} model, which needs torch, and this install has "
                "none: `pip install torch==2.13.0` (or lightship's train extra, "
                "`pip install 'lightship[train]'`), or serve an ONNX variant "
                "(--variant onnx-fp32, or an .onnx file)"
            ) from None
        return torch_backends.load(path, kind, device=device, threads=threads)
    raise RunError(f"{path}: unknown model file type; expected .onnx, .ts, .pt2 or .ckpt")


__all__ = [
    "InputError",
    "OrtPredictor",
    "OutputError",
    "Predictor",
    "load_predictor",
    "physical_cores",
    "softmax",
]
