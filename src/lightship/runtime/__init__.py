"""One `Predictor` interface over ONNX Runtime, TorchScript, torch.export (.pt2) and eager.

`predict(x) -> logits` on uint8 `[N, C, H, W]`; `labels` and `input_spec` come from the
artifact itself. Only the ORT predictor is imported eagerly: it needs onnxruntime and numpy,
so a server of ONNX models never imports torch (torch predictors import it when built).
"""

from __future__ import annotations

from pathlib import Path

from lightship.runtime.base import InputError, Predictor, physical_cores, softmax
from lightship.runtime.ort import OrtPredictor

TORCH_SUFFIXES = {".ts": "torchscript", ".pt2": "pt2", ".ckpt": "eager"}


def load_predictor(
    path: Path | str, device: str = "cpu", threads: int | None = None, split: bool = True
) -> Predictor:
    """The predictor for an artifact, chosen by its file type. `split`: an ONNX model on CPU
    runs long batches as one slice per thread on one-thread sessions (`OrtPredictor`)."""
    path = Path(path)
    if path.suffix == ".onnx":
        return OrtPredictor(path, device=device, threads=threads, split=split)
    if path.suffix in TORCH_SUFFIXES:
        from lightship.runtime import torch_backends

        return torch_backends.load(
            path, TORCH_SUFFIXES[path.suffix], device=device, threads=threads
        )
    from lightship.errors import RunError

    raise RunError(f"{path}: unknown model file type; expected .onnx, .ts, .pt2 or .ckpt")


__all__ = ["InputError", "OrtPredictor", "Predictor", "load_predictor", "physical_cores", "softmax"]
