"""Rebuild a model from a checkpoint alone (hyper-parameters, labels and input spec inside)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightship.errors import ConfigError, RunError
from lightship.models import Classifier, create, spec_pythonpath
from lightship.runs import RunDir, enclosing_run


@dataclass
class LoadedCheckpoint:
    model: Classifier
    hparams: dict[str, Any]

    @property
    def labels(self) -> list[str]:
        return list(self.hparams["labels"])

    @property
    def input_spec(self) -> dict[str, Any]:
        return dict(self.hparams["input_spec"])

    @property
    def data_spec(self) -> dict[str, Any]:
        return dict(self.hparams["data_spec"])

    @property
    def model_spec(self) -> dict[str, Any]:
        return dict(self.hparams["model_spec"])


def _reason(exc: Exception) -> str:
    """torch's error in a few words: its first sentence, after the weights-only preamble (which
    is about trusting a file, not about what is wrong with this one)."""
    text = str(exc).rpartition("WeightsUnpickler error:")[2].strip()
    first = re.split(r"(?<=\.)\s|\n", text, maxsplit=1)[0].rstrip(".")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def model_state(ckpt: dict[str, Any]) -> dict[str, Any]:
    """The classifier's weights in a Lightning checkpoint: its `model.` entries, unprefixed."""
    prefix = "model."
    return {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}


def state_mismatch(exc: RuntimeError) -> str:
    """torch's refusal to load a state_dict into a model, in a line: its first problem (a
    missing key, a size), and how many more. Its first line names only the model's class."""
    problems = [line.strip() for line in str(exc).splitlines()[1:] if line.strip()]
    if not problems:
        return _reason(exc)
    more = f"; and {len(problems) - 1} more" if len(problems) > 1 else ""
    return problems[0][:300].rstrip(". ") + more


def _fix(path: Path, then: str) -> str:
    """How to get a good checkpoint at `path`: `then` around the command that trains its run
    again, or, outside any run, where a good one comes from."""
    run = enclosing_run(path)
    if run is None:
        return "give a checkpoint `lightship train` wrote (RUN/best.ckpt)"
    rd = RunDir(run)
    # a resume would read this very file again
    return then.format(rd.train_command(afresh=path.resolve() == rd.last_ckpt.resolve()))


def read_checkpoint(path: Path) -> dict[str, Any]:
    """`torch.load(weights_only=True)` with a user-facing error for missing or corrupt files."""
    if not path.is_file():
        raise RunError(f"checkpoint {path} not found: {_fix(path, 'run {} first')}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        raise RunError(
            f"checkpoint {path} is corrupt or not a lightship checkpoint ({_reason(exc)}): "
            + _fix(path, "delete it and train again ({})")
        ) from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise RunError(
            f"checkpoint {path} has no state_dict: is it a lightship/Lightning checkpoint?"
        )
    return ckpt


def load_checkpoint(path: Path) -> LoadedCheckpoint:
    ckpt = read_checkpoint(path)
    hparams = ckpt.get("hyper_parameters") or {}
    if "qat" in hparams and "source" in hparams:  # quantize's QAT checkpoint (`LitQAT`)
        raise RunError(
            f"checkpoint {path} is quantization-aware training's, a step of `lightship "
            "quantize`, not a trained model: load what QAT made, "
            f"{path.with_name('model.int8-qat.onnx')}, or the run's best.ckpt"
        )
    for key in ("model_spec", "labels", "input_spec", "data_spec"):
        if key not in hparams:
            raise RunError(
                f"checkpoint {path} lacks '{key}' in its hyper-parameters: train it with lightship"
            )
    try:
        model = create(hparams["model_spec"])
    except ConfigError as exc:  # said as it is: the eager loader (report, serve) would put
        # any error but a RunError in a "re-export it", which no export fixes
        raise RunError(f"checkpoint {path}: {exc}") from None
    try:
        model.load_state_dict(model_state(ckpt))
    except RuntimeError as exc:
        run = enclosing_run(path)
        env = spec_pythonpath(hparams["model_spec"])
        again = f", or train it afresh: {RunDir(run).train_command(True, env)}" if run else ""
        raise RunError(
            f"checkpoint {path} does not fit model {hparams['model_spec'].get('name')} as its "
            f"code builds it now ({state_mismatch(exc)}): put back the model code it trained "
            f"with{again}"
        ) from None
    model.eval()
    return LoadedCheckpoint(model=model, hparams=dict(hparams))
