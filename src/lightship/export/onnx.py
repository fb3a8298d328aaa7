"""ONNX through the dynamo exporter (dynamic batch), with the legacy exporter as a fallback."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import onnx
import torch

log = logging.getLogger(__name__)

INPUT_NAME = "input"
OUTPUT_NAME = "logits"


def _dynamo(model: torch.nn.Module, example: torch.Tensor, path: Path, opset: int) -> None:
    batch = torch.export.Dim("batch")
    torch.onnx.export(
        model,
        (example,),
        str(path),
        dynamo=True,
        dynamic_shapes=({0: batch},),
        input_names=[INPUT_NAME],
        output_names=[OUTPUT_NAME],
        external_data=False,
        opset_version=opset,
        verbose=False,
    )


def _legacy(model: torch.nn.Module, example: torch.Tensor, path: Path, opset: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            model,
            (example,),
            str(path),
            dynamo=False,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            opset_version=opset,
        )


def write(
    model: torch.nn.Module, example: torch.Tensor, path: Path, meta: dict[str, str], opset: int = 18
) -> dict[str, Any]:
    """Export, add metadata, run `onnx.checker`. Returns manifest fields (exporter, opset)."""
    model = model.eval()
    exporter = "dynamo"
    try:
        _dynamo(model, example, path, opset)
    except Exception as exc:  # dynamo raises many types; the legacy exporter may still work
        log.warning(
            "dynamo ONNX export failed (%s); trying the legacy exporter",
            str(exc).splitlines()[0][:200],
        )
        exporter = "legacy"
        _legacy(model, example, path, opset)
    proto = onnx.load(str(path))
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    del proto.metadata_props[:]
    for key, value in meta.items():
        proto.metadata_props.add(key=key, value=value)
    proto.producer_name = "lightship"
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(path))
    return {"exporter": exporter, "opset": opset}
