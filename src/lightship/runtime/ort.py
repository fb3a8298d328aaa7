"""ONNX Runtime predictor: imports onnxruntime and numpy, never torch."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from lightship.errors import RunError
from lightship.runtime.base import Predictor, physical_cores, read_metadata

log = logging.getLogger(__name__)

_ORT_DTYPES = {"tensor(uint8)": np.uint8, "tensor(float)": np.float32, "tensor(int8)": np.int8}
# Graph transformers a model asks onnxruntime to skip (comma-separated names in its
# metadata_props). Static int8 models with an fp32 first conv set QDQPropagationTransformer:
# it moves the QuantizeLinear after the fp32 MaxPool in front of it, turning a fast fp32 pool
# into a slow uint8 NCHW one (measured 2.9 ms of a 6 ms batch on the digits model).
DISABLED_OPTIMIZERS = "lightship.ort.disabled_optimizers"


def session_options(threads: int | None = None, spinning: bool = False) -> ort.SessionOptions:
    """Threads = physical cores, one inter-op thread, all graph optimisations.

    Spinning is off by default: in a server, spinning workers burn idle CPU and under
    contention pushed p99 from 0.3 ms to 4-8 ms (DESIGN.md §4); benchmarks may turn it on.
    """
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or physical_cores()
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return so


def create_session(
    path: Path | str, options: ort.SessionOptions, providers: list[Any] | None = None
) -> ort.InferenceSession:
    """An InferenceSession that honours the model's own `lightship.ort.disabled_optimizers`."""
    providers = providers or ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(path), options, providers=providers)
    skip = session.get_modelmeta().custom_metadata_map.get(DISABLED_OPTIMIZERS, "")
    names = [n.strip() for n in skip.split(",") if n.strip()]
    if names:  # the metadata is only readable from a session: build it again without them
        session = ort.InferenceSession(
            str(path), options, providers=providers, disabled_optimizers=names
        )
    return session


def providers_for(device: str, cache_dir: Path | None = None) -> list[Any]:
    """TensorRT, then CUDA, then CPU on a GPU host; CPU alone otherwise."""
    if device == "cpu":
        return ["CPUExecutionProvider"]
    available = ort.get_available_providers()
    chosen: list[Any] = []
    if (
        "TensorrtExecutionProvider" in available
        and os.environ.get("LIGHTSHIP_TENSORRT", "1") != "0"
    ):
        cache = str(cache_dir or os.environ.get("LIGHTSHIP_TRT_CACHE", "/tmp/lightship-trt-cache"))
        chosen.append(
            (
                "TensorrtExecutionProvider",
                {
                    "trt_engine_cache_enable": True,
                    "trt_engine_cache_path": cache,
                    "trt_fp16_enable": True,
                },
            )
        )
    if "CUDAExecutionProvider" in available:
        chosen.append("CUDAExecutionProvider")
    if not chosen:
        raise RunError(
            f"device={device} but this onnxruntime has no CUDA provider (has {available}): "
            "install onnxruntime-gpu or serve with --device cpu"
        )
    return [*chosen, "CPUExecutionProvider"]


class OrtPredictor(Predictor):
    kind = "onnxruntime"

    def __init__(
        self,
        path: Path | str,
        device: str = "cpu",
        threads: int | None = None,
        spinning: bool = False,
    ) -> None:
        self.path = Path(path)
        self.device = device
        if not self.path.is_file():
            raise RunError(f"ONNX model {self.path} not found: run `make export` first")
        try:
            self.session = create_session(
                self.path, session_options(threads, spinning), providers_for(device)
            )
        except RunError:
            raise
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/... types
            first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            raise RunError(f"cannot load ONNX model {self.path} ({first}): re-export it") from None
        inp = self.session.get_inputs()[0]
        self.input_name = inp.name
        self.output_name = self.session.get_outputs()[0].name
        self.input_dtype = _ORT_DTYPES.get(inp.type, np.float32)
        labels, spec = read_metadata(self.session.get_modelmeta().custom_metadata_map)
        if spec is None:  # a foreign ONNX file: take what the graph says
            dims = [d if isinstance(d, int) else "batch" for d in inp.shape]
            if len(dims) != 4 or not all(isinstance(d, int) for d in dims[1:]):
                raise RunError(f"{self.path}: input {inp.name} {inp.shape} is not [N, C, H, W]")
            spec = {"name": inp.name, "dtype": "uint8", "shape": dims, "layout": "NCHW"}
        self.input_spec = spec
        if labels is None:
            n = self.session.get_outputs()[0].shape[-1]
            labels = [str(i) for i in range(n if isinstance(n, int) else 0)]
        self.labels = labels
        self.providers = self.session.get_providers()

    def _run(self, x: np.ndarray) -> np.ndarray:
        if self.input_dtype is not np.uint8:
            x = x.astype(self.input_dtype)
        out = self.session.run([self.output_name], {self.input_name: x})[0]
        return np.asarray(out, dtype=np.float32)
