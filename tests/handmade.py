"""A model whose answers can be written down: logits = [sum(pixels), -sum(pixels) + bias].

Built directly with `onnx.helper` (no torch), carries lightship metadata like an exported model,
so runtime and serving tests check exact values rather than "some output came back".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper


def handmade_onnx(path: Path, chw: tuple[int, int, int] = (1, 2, 2), bias: float = 100.0) -> Path:
    c, h, w = chw
    nodes = [
        helper.make_node("Cast", ["input"], ["xf"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["xf", "axes"], ["s"], keepdims=0),
        helper.make_node("Unsqueeze", ["s", "one"], ["s1"]),
        helper.make_node("Neg", ["s1"], ["n1"]),
        helper.make_node("Add", ["n1", "bias"], ["n2"]),
        helper.make_node("Concat", ["s1", "n2"], ["logits"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "handmade",
        [helper.make_tensor_value_info("input", TensorProto.UINT8, ["batch", c, h, w])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2])],
        initializer=[
            helper.make_tensor("axes", TensorProto.INT64, [3], [1, 2, 3]),
            helper.make_tensor("one", TensorProto.INT64, [1], [1]),
            helper.make_tensor("bias", TensorProto.FLOAT, [], [bias]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    for key, value in {
        "lightship.labels": json.dumps(["bright", "dark"]),
        "lightship.input_spec": json.dumps(
            {"name": "input", "dtype": "uint8", "shape": ["batch", c, h, w]}
        ),
    }.items():
        model.metadata_props.add(key=key, value=value)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def expected_logits(x: np.ndarray, bias: float = 100.0) -> np.ndarray:
    s = x.reshape(len(x), -1).astype(np.float64).sum(1)
    return np.stack([s, bias - s], 1).astype(np.float32)


def batch_rows(predictor: Any) -> list[int]:
    """The rows of each batch that reaches `predictor`'s model from now on (padding included):
    its `_run`, wrapped."""
    run = predictor._run
    seen: list[int] = []

    def counted(x: np.ndarray) -> np.ndarray:
        seen.append(len(x))
        return run(x)

    predictor._run = counted
    return seen
