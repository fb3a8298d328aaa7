"""ONNX through the dynamo exporter (dynamic batch), with the legacy exporter as a fallback."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Iterator
from numbers import Integral
from pathlib import Path
from typing import Any

import onnx
import onnx.defs
import torch

from lightship.errors import ConfigError
from lightship.export.failure import printout_on_failure_to_debug, reason, warn_frozen
from lightship.runs import interrupted

log = logging.getLogger(__name__)

INPUT_NAME = "input"
OUTPUT_NAME = "logits"
# torch's exporter writes opset 18 and converts down (to 17 reliably); above the installed onnx's
# newest opset the exporter silently falls back to 18.
MIN_OPSET = 17
# The dynamo exporter's Python stack of each node: absolute paths of torch's and the model's
# source files and their line numbers, so the file's bytes (its sha256 in the manifest) would
# change with the install path and with any edit to those files. The node's module path and
# class (`namespace`, `pkg.torch.onnx.class_hierarchy`) still say where it came from.
PATH_METADATA = "pkg.torch.onnx.stack_trace"


def opset_range() -> tuple[int, int]:
    return MIN_OPSET, onnx.defs.onnx_opset_version()


def check_opset(opset: int) -> None:
    """ConfigError for an opset this torch cannot write; an integer of any kind (numpy's too),
    as 18.0 or "18" from Python failed deep in the exporter, blamed on the model."""
    low, high = opset_range()
    if isinstance(opset, bool) or not isinstance(opset, Integral):
        raise ConfigError(
            f"export's opset must be a whole number, got {opset!r}: choose an ONNX opset from "
            f"{low} to {high}"
        )
    if not low <= opset <= high:
        raise ConfigError(
            f"export --opset {opset} is not supported: choose an ONNX opset from {low} to {high}"
        )


def file_opset(proto: onnx.ModelProto) -> int | None:
    """The default-domain (ai.onnx) opset the model really imports."""
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)


def _nodes(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.NodeProto]:
    """`nodes` and those of their subgraphs (If, Loop, Scan bodies), depth first."""
    for node in nodes:
        yield node
        for attr in node.attribute:
            for graph in [attr.g] if attr.HasField("g") else attr.graphs:
                yield from _nodes(graph.node)


def strip_paths(proto: onnx.ModelProto) -> None:
    """Drop `PATH_METADATA` from every node, so the file's bytes depend on the model alone."""
    for node in _nodes([*proto.graph.node, *(n for f in proto.functions for n in f.node)]):
        kept = [p for p in node.metadata_props if p.key != PATH_METADATA]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)


def _dynamo(model: torch.nn.Module, example: torch.Tensor, path: Path, opset: int) -> None:
    batch = torch.export.Dim("batch")
    with printout_on_failure_to_debug(log, "the dynamo ONNX exporter"):
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
    with (
        warnings.catch_warnings(record=True) as caught,
        printout_on_failure_to_debug(log, "the legacy ONNX exporter"),
    ):
        warnings.simplefilter("always")
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
    warn_frozen(log, caught, "the legacy ONNX exporter", len(example))


def write(
    model: torch.nn.Module, example: torch.Tensor, path: Path, meta: dict[str, str], opset: int = 18
) -> dict[str, Any]:
    """Export, add metadata, run `onnx.checker`. Returns manifest fields (exporter, opset).

    Raises ConfigError when the file's opset is not the requested one (a failed conversion).
    """
    check_opset(opset)
    model = model.eval()
    exporter = "dynamo"
    try:
        _dynamo(model, example, path, opset)
    except Exception as exc:  # dynamo raises many types; the legacy exporter may still work
        if interrupted():  # Ctrl-C, caught and re-raised as something else inside torch
            raise KeyboardInterrupt from None
        log.warning("dynamo ONNX export failed (%s); trying the legacy exporter", reason(exc))
        exporter = "legacy"
        _legacy(model, example, path, opset)
    proto = onnx.load(str(path))
    actual = file_opset(proto)
    if actual != opset:
        low, high = opset_range()
        raise ConfigError(
            f"the {exporter} ONNX exporter wrote opset {actual}, not the requested --opset "
            f"{opset}: choose another opset from {low} to {high} (18 is the default)"
        )
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    del proto.metadata_props[:]
    for key, value in meta.items():
        proto.metadata_props.add(key=key, value=value)
    proto.producer_name = "lightship"
    strip_paths(proto)
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(path))
    return {"exporter": exporter, "opset": actual}
