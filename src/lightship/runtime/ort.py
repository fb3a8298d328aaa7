"""ONNX Runtime predictor: imports onnxruntime and numpy, never torch."""

from __future__ import annotations

import functools
import logging
import math
import mmap
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from lightship.errors import ConfigError, RunError
from lightship.quantize.isa import compatibility, requantize_in_its_run
from lightship.runs import RunDir, enclosing_run, export_hint, sha256_file, variant_of
from lightship.runtime.base import (
    META_INPUT_SPEC,
    META_LABELS,
    LoadError,
    Predictor,
    physical_cores,
    read_metadata,
    valid_input_spec,
)

log = logging.getLogger(__name__)

# The input types pixels 0..255 are fed as (int8 is not one: 200 wrapped to -56)
_ORT_DTYPES = {
    "tensor(uint8)": np.uint8,
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
}
_LOGIT_TYPES = {"tensor(float)", "tensor(float16)", "tensor(double)"}
# Graph transformers a model asks onnxruntime to skip (comma-separated names in its
# metadata_props). Static int8 models with an fp32 first conv set QDQPropagationTransformer:
# it moves the QuantizeLinear after the fp32 MaxPool in front of it, turning a fast fp32 pool
# into a slow uint8 NCHW one (measured 2.9 ms of a 6 ms batch on the digits model).
DISABLED_OPTIMIZERS = "lightship.ort.disabled_optimizers"


# A model that asks its pool's threads to spin inside each run ("1"), and stop when it returns.
# lightship's quantizer sets it where it measured it paying (`Quantizer._gemm_convs`).
SPIN_IN_RUN = "lightship.ort.spin_in_run"

# The CPU an int8 model was quantized for (`lightship.quantize.isa.TARGETS`), in its metadata:
# `serve` checks it against this CPU for a lone file, which has no manifest entry to say it.
TARGET = "lightship.target"
QUANTIZATION = "lightship.quantization"  # static, dynamic or qat, on an int8 model

# A batch is split across one-thread sessions only when each lane's share takes at least this
# long on one thread: below it, handing rows to the other lane (a future, a thread wake-up)
# costs more than the second core gives. On the Xeon, two one-thread lanes beat one two-thread
# session from 8 rows for the digits CNN (about 50 us a row) and from 2 rows for ResNet-18
# (about 1 ms a row), and this rule puts the split at 8 and 2.
SPLIT_MIN_LANE_S = 150e-6


def session_options(
    threads: int | None = None, spinning: bool = False, spin_in_run: bool = False
) -> ort.SessionOptions:
    """Threads = physical cores, one inter-op thread, all graph optimisations.

    Spinning is off by default: in a server, spinning workers burn idle CPU and under
    contention pushed p99 from 0.3 ms to 4-8 ms (measured on ORT 1.32); benchmarks may turn it on.
    `spin_in_run` lets them spin inside a run only (`session.force_spinning_stop`): a pool
    that sleeps between the parallel sections of one run wakes through the kernel for each.
    That cost ResNet-18 on ORT's AMX GEMM a quarter of its served throughput, yet made the
    tiny digits model 30 % slower served one request at a time, where the spinning worker
    takes the core the HTTP side needs between short runs (docs/PERFORMANCE.md, "ONNX
    Runtime's AMX kernels").
    """
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or physical_cores()
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    spin = spinning or spin_in_run
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if spin_in_run and not spinning:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    return so


def create_session(
    path: Path | str,
    options: Callable[[bool], ort.SessionOptions],
    providers: list[Any] | None = None,
) -> ort.InferenceSession:
    """An InferenceSession that honours the model's own `lightship.ort.disabled_optimizers`
    and `lightship.ort.spin_in_run`; `options(spin_in_run)` makes its SessionOptions."""
    providers = providers or ["CPUExecutionProvider"]
    session = None
    meta = _metadata_props(Path(path))
    if meta is None:  # not readable off the file: from a session, built again if it asks
        session = ort.InferenceSession(str(path), options(False), providers=providers)
        meta = session.get_modelmeta().custom_metadata_map
    names = [n.strip() for n in meta.get(DISABLED_OPTIMIZERS, "").split(",") if n.strip()]
    spin = meta.get(SPIN_IN_RUN) == "1"
    if session is None or names or spin:
        session = ort.InferenceSession(
            str(path), options(spin), providers=providers, disabled_optimizers=names or None
        )
    return session


GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")


def device_index(device: str) -> int:
    """The GPU `cuda:N` names (N), and 0 for `cuda`: torch's reading of the same names."""
    _, _, index = device.partition(":")
    return int(index or 0)


def file_metadata(path: Path) -> dict[str, str]:
    """An ONNX file's metadata_props, read off the file without loading its graph (int8
    ResNet-18: 0.04 ms, where a session without optimisations took 12); LoadError when
    onnxruntime cannot open it."""
    props = _metadata_props(path)
    if props is not None:
        return props
    so = ort.SessionOptions()  # a file the reader does not take: onnxruntime reads it, or says why
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    try:
        session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/... types
        raise _load_error(path, exc) from None
    return dict(session.get_modelmeta().custom_metadata_map)


# ModelProto's fields in onnx.proto: its graph, and metadata_props, a list of
# StringStringEntryProto (key 1, value 2).
_GRAPH_FIELD = 7
_METADATA_FIELD = 14


def _metadata_props(path: Path) -> dict[str, str] | None:
    """ModelProto.metadata_props from the file's top-level protobuf fields, stepping over the
    graph instead of parsing it (a mapped file: the graph's pages are never read), the last of
    a repeated key winning as in onnxruntime's custom_metadata_map. None for a file that is
    no model this can read (no graph, a field cut short, not protobuf): onnxruntime says why."""
    props: dict[str, str] = {}
    graph = False
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            for field, start, end in _length_delimited(buf, 0, len(buf)):
                graph |= field == _GRAPH_FIELD
                if field == _METADATA_FIELD:
                    entry = {k: buf[a:b].decode() for k, a, b in _length_delimited(buf, start, end)}
                    props[entry.get(1, "")] = entry.get(2, "")
    except (OSError, ValueError, IndexError, UnicodeDecodeError):  # empty: mmap's ValueError
        return None
    return props if graph else None


def _length_delimited(buf: mmap.mmap, pos: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(field number, start, end) of each length-delimited field of the protobuf message in
    buf[pos:end], the others stepped over; ValueError or IndexError where it is malformed."""
    while pos < end:
        key, pos = _varint(buf, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
        elif wire in (1, 5):  # fixed 64 or 32 bits
            pos += 8 if wire == 1 else 4
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > end:
                raise ValueError("field cut short")
            yield key >> 3, pos, pos + size
            pos += size
        else:  # groups (3, 4) are not in onnx.proto
            raise ValueError(f"wire type {wire}")
    if pos != end:
        raise ValueError("message cut short")


def _varint(buf: mmap.mmap, pos: int) -> tuple[int, int]:
    """The protobuf varint at `pos`, and the position after it."""
    value = shift = 0
    while shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise ValueError("varint over 64 bits")


# Int8 files already warned of, by resolved path: report and evaluation load a file more than once.
_WARNED_ISA: set[Path] = set()


def _warn_if_made_for_another_cpu(path: Path, made_for: str | None) -> None:
    """A warning, once per file, when an int8 model's metadata says it was quantized for a CPU
    that computes it differently from this one (`isa.compatibility`): its answers here drift.
    The server checks this itself, by its `--isa-check` policy, before it loads anything."""
    if not made_for or path.resolve() in _WARNED_ISA:
        return
    root = enclosing_run(path)
    redo = requantize_in_its_run
    if root is not None:
        run, variant = RunDir(root), variant_of(path)
        try:
            flags = (run.artifact(variant) or {}).get("flags")
        except RunError:  # a malformed manifest: the stage that reads it says so
            flags = None
        redo = functools.partial(run.requantize, variant, flags=flags)
    problem = compatibility(made_for, redo=redo)
    if problem is None:
        return
    _WARNED_ISA.add(path.resolve())
    log.warning("%s: %s", path, problem)


def _load_error(path: Path, exc: Exception) -> LoadError:
    return LoadError(
        path,
        "ONNX",
        "onnxruntime",
        exc,
        "make it again (`lightship export`, or `lightship quantize` for an int8 model)",
    )


def providers_for(
    device: str, cache_dir: Path | None = None, model: Path | None = None
) -> list[Any]:
    """TensorRT, then CUDA, then CPU on a GPU host, both on the GPU `device` names; CPU alone
    otherwise. TensorRT's engines are cached in a folder of `model`'s own (`engine_folder`)."""
    if device == "cpu":
        return ["CPUExecutionProvider"]
    available = ort.get_available_providers()
    gpu = device_index(device)
    chosen: list[Any] = []
    if "TensorrtExecutionProvider" in available and _tensorrt_wanted():
        cache = Path(
            cache_dir
            or os.environ.get("LIGHTSHIP_TRT_CACHE", "").strip()
            or "/tmp/lightship-trt-cache"
        )  # empty or blank: the default, as for every LIGHTSHIP_ variable
        if model is not None:
            cache = engine_folder(cache, model)
        chosen.append(
            (
                "TensorrtExecutionProvider",
                {
                    "device_id": gpu,
                    "trt_engine_cache_enable": True,
                    "trt_engine_cache_path": str(cache),
                    "trt_fp16_enable": True,
                },
            )
        )
    if "CUDAExecutionProvider" in available:
        chosen.append(("CUDAExecutionProvider", {"device_id": gpu}))
    if not chosen:
        raise RunError(
            f"device={device} but this onnxruntime has no CUDA provider (has {available}): "
            "install onnxruntime-gpu or serve with --device cpu"
        )
    return [*chosen, "CPUExecutionProvider"]


def engine_folder(cache: Path, model: Path) -> Path:
    """The folder of `cache` that holds TensorRT's engines for `model`: named by the file's
    sha256. onnxruntime names an engine by the graph's name, its input, initializer and node
    names and the versions, never the weights: a model trained again (the same names, other
    weights) was served with the engine of the one before, without a word, and so was
    another run of the same architecture sharing the cache (a volume)."""
    folder = cache / sha256_file(model)[:32]
    try:  # onnxruntime makes only the last folder of its cache path
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunError(
            f"cannot make TensorRT's engine cache {folder} ({exc.strerror}): set "
            "LIGHTSHIP_TRT_CACHE to a folder this user can write, or LIGHTSHIP_TENSORRT=0"
        ) from None
    return folder


def _tensorrt_wanted() -> bool:
    """LIGHTSHIP_TENSORRT as the server's own switches are read (0/1, false/true, no/yes,
    off/on; empty: the default, on). Only "0" turned it off: `false` left TensorRT on, and
    any other word passed without a word."""
    given = os.environ.get("LIGHTSHIP_TENSORRT", "")
    value = given.strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("", "1", "true", "yes", "on"):
        return True
    raise ConfigError(
        f"LIGHTSHIP_TENSORRT={given!r} is neither on nor off: set it to 0 to run without "
        "TensorRT, or 1 (the default) to use it where onnxruntime has it"
    )


def _is_tensorrt(provider: Any) -> bool:
    return isinstance(provider, tuple) and provider[0] == "TensorrtExecutionProvider"


def _gpu_ids(session: ort.InferenceSession) -> set[str]:
    """The device_id of each GPU provider `session` runs on; empty when it runs on none."""
    options = session.get_provider_options()
    return {
        str(options.get(name, {}).get("device_id", "0"))
        for name in session.get_providers()
        if name in GPU_PROVIDERS
    }


def _describe(arg: Any) -> str:
    """`float32 [N, 10]` for an input or output, as a user would write it."""
    kind = _describe_type(str(arg.type))
    dims = ", ".join("?" if d is None else str(d) for d in (arg.shape or []))
    return f"{kind} [{dims}]"


def _check_graph(path: Path, session: ort.InferenceSession) -> tuple[Any, Any]:
    """The image input and logits output, or RunError: what the graph shows is wrong is
    refused at load, not found by the first request (or never, for an int64 argmax output)."""
    inputs = session.get_inputs()  # initializers are not listed: only what must be fed
    if len(inputs) != 1:
        names = ", ".join(f"{i.name} {_describe(i)}" for i in inputs)
        raise RunError(
            f"{path} needs {len(inputs)} inputs ({names}); lightship serves models with one "
            "image input [N, C, H, W]"
        )
    inp = inputs[0]
    if inp.type not in _ORT_DTYPES:
        accepted = ", ".join(_describe_type(t) for t in _ORT_DTYPES)
        raise RunError(
            f"{path}'s input {inp.name} is {_describe(inp)}; lightship feeds images as "
            f"{accepted}: re-export it with one of those input types"
        )
    shape = inp.shape or []
    if len(shape) != 4:
        raise RunError(f"{path}: input {inp.name} {_describe(inp)} is not [N, C, H, W]")
    if isinstance(shape[0], int):
        raise RunError(
            f"{path} has a fixed batch dimension of {shape[0]}: re-export it with a dynamic "
            "batch (lightship export does)"
        )
    out = session.get_outputs()[0]
    if out.type not in _LOGIT_TYPES or len(out.shape or []) != 2:
        raise RunError(
            f"{path}'s first output is {_describe(out)}; lightship serves logits [N, classes]"
        )
    return inp, out


def _describe_type(ort_type: str) -> str:
    name = ort_type.removeprefix("tensor(").removesuffix(")")
    return {"float": "float32", "double": "float64"}.get(name, name)


class OrtPredictor(Predictor):
    """Logits from ONNX Runtime.

    On CPU with more than one thread, a batch long enough (`split_rows`) is split into one
    slice per thread, each run at the same time on a one-thread session (`lanes` of them):
    data parallelism across the batch instead of ONNX Runtime's parallelism inside each
    operator, whose hand-offs between threads at every operator cost a small model much of
    its second core. Two one-thread lanes ran batch 64 of the Xeon's int8 ResNet-18 1.39x and
    of the digits CNN 1.10x as fast as one two-thread session. Shorter batches run on whichever
    of the multi-threaded session and one lane was faster at batch 1 when the model loaded.
    The lanes hold a second copy of the model in memory; `split=False` keeps one session.
    `isa_check`: warn when an int8 model was quantized for a CPU that computes it differently
    (full-range weights on a CPU without VNNI), as the server refuses it.
    """

    kind = "onnxruntime"

    def __init__(
        self,
        path: Path | str,
        device: str = "cpu",
        threads: int | None = None,
        spinning: bool = False,
        split: bool = True,
        isa_check: bool = True,
    ) -> None:
        self.path = Path(path)
        self.device = device
        # cuDNN under the CUDA provider searches every algorithm at each new shape (its default,
        # exhaustive search), and TensorRT sizes its engine to the shapes seen: on a GPU, the
        # few batch sizes the warm-up runs (`Predictor.pads`)
        self.pads = device != "cpu"
        if not self.path.is_file():
            raise RunError(f"ONNX model {self.path} not found: {export_hint(self.path)}")
        threads = threads or physical_cores()
        if device == "cpu":
            self.session = self._open(threads, spinning, providers_for(device))
        else:
            self.session = self._open_gpu(threads, spinning, device)
        inp, out = _check_graph(self.path, self.session)
        self.input_name = inp.name
        self.output_name = out.name
        self.input_dtype = _ORT_DTYPES[inp.type]
        meta = self.session.get_modelmeta().custom_metadata_map
        if isa_check and device == "cpu":
            _warn_if_made_for_another_cpu(self.path, meta.get(TARGET))
        labels, spec = read_metadata(meta, self.path)
        if spec is None:  # a foreign ONNX file: take what the graph says
            if not all(isinstance(d, int) for d in inp.shape[1:]):
                raise RunError(
                    f"{self.path}: input {inp.name} {_describe(inp)} has no fixed C, H, W, and "
                    f"no {META_INPUT_SPEC} metadata says the size images are resized to: add "
                    "it, or re-export the model with fixed sizes and a dynamic batch"
                )
            dims = [d if isinstance(d, int) else "batch" for d in inp.shape]
            spec = {"name": inp.name, "dtype": "uint8", "shape": dims, "layout": "NCHW"}
            if not valid_input_spec(spec):
                raise RunError(f"{self.path}: input {inp.name} {inp.shape} is not [N, C, H, W]")
            if self.input_dtype != np.uint8:
                log.warning(
                    "%s carries no lightship metadata: its %s input is fed raw pixels 0..255, "
                    "unscaled; a model trained on 0..1 or normalised input answers wrongly "
                    "(models exported by lightship normalise inside the graph)",
                    self.path,
                    _describe_type(inp.type),
                )
        elif any(
            isinstance(d, int) and d != want
            for d, want in zip(inp.shape[1:], spec["shape"][1:], strict=True)
        ):
            # `check` takes images of the metadata's size only, and the graph refuses them
            raise RunError(
                f"{self.path}: its metadata {META_INPUT_SPEC} says images "
                f"{spec['shape'][1:]} but its graph takes {_describe(inp)}: re-export it"
            )
        self.input_spec = spec
        width = out.shape[1]
        if labels is None and not isinstance(width, int):
            width = self._output_width()  # the classes, from a blank image's logits
        if labels is None:
            labels = [str(i) for i in range(width)]
        elif isinstance(width, int) and len(labels) != width:
            raise RunError(
                f"{self.path} has {len(labels)} labels in its metadata but its output has "
                f"{width} classes: re-export it"
            )
        self.labels = labels
        self.providers = self.session.get_providers()
        self._lane: ort.InferenceSession | None = None
        self._pool: ThreadPoolExecutor | None = None
        # Not a dynamic int8 model: it scales its activations by the batch it is given, so
        # slices of a batch gave other logits than the batch whole (up to 0.008 for digits),
        # and where a batch was cut depended on timings taken at load.
        dynamic = meta.get(QUANTIZATION) == "dynamic"
        if split and threads > 1 and self.providers == ["CPUExecutionProvider"] and not dynamic:
            self._plan_lanes(threads, spinning)

    def _output_width(self) -> int:
        """The classes of a model whose output width the graph leaves open and whose
        metadata names no labels: its logits' width for one blank image of `input_spec`'s
        size (the graph's may be open too)."""
        x = np.zeros((1, *self.chw), dtype=self.input_dtype)
        try:
            out = self.session.run([self.output_name], {self.input_name: x})[0]
        except Exception as exc:  # onnxruntime raises its own types
            raise RunError(
                f"{self.path}: its output's width (the classes) is not fixed and a blank "
                f"image could not be run to find it ({str(exc).splitlines()[0][:200]}): add "
                f"{META_LABELS} to its metadata, or re-export it with a fixed output width"
            ) from None
        if out.ndim != 2 or out.shape[0] != 1 or out.shape[1] < 1:
            raise RunError(
                f"{self.path} gave logits {list(out.shape)} for one image: lightship serves "
                "logits [N, classes]"
            )
        return int(out.shape[1])

    def _open(self, threads: int, spinning: bool, providers: list[Any]) -> ort.InferenceSession:
        try:
            return create_session(
                self.path,
                lambda spin: session_options(threads, spinning, spin_in_run=spin),
                providers,
            )
        except RunError:
            raise
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/... types
            raise _load_error(self.path, exc) from None

    def _open_gpu(self, threads: int, spinning: bool, device: str) -> ort.InferenceSession:
        """A session on the GPU `device` names, or RunError. onnxruntime does not fail when
        it cannot use a GPU: it logs "Failed to create CUDAExecutionProvider" and runs on the
        CPU. Nor does it keep the GPU asked for when TensorRT fails to load (its libraries
        missing): it retries on CUDA without the provider options, so on GPU 0; then the
        session is made again without TensorRT, on the GPU asked for."""
        providers = providers_for(device, model=self.path)
        session = self._open(threads, spinning, providers)
        wanted = {str(device_index(device))}
        if _gpu_ids(session) not in (set(), wanted):
            log.warning(
                "%s: TensorRT could not be used (onnxruntime's log above says why): running on "
                "CUDA alone",
                self.path,
            )
            cuda = [p for p in providers if not _is_tensorrt(p)]
            session = self._open(threads, spinning, cuda)
        if not _gpu_ids(session):
            raise RunError(
                f"device={device} but onnxruntime could not use the GPU and fell back to the CPU "
                "(its log above says why): run the container with `--gpus all` and check the "
                "NVIDIA driver and CUDA libraries (`nvidia-smi`), or serve with --device cpu"
            )
        # A run that fails in TensorRT or CUDA (EP_FAIL) would rebuild the session on CUDA
        # without its provider options, so on GPU 0 whatever `device` says, while other
        # threads run it: such a run fails instead, and the batch's requests get their 500.
        session.disable_fallback()
        log.info("%s runs on %s (%s)", self.path, device, ", ".join(session.get_providers()))
        return session

    def _plan_lanes(self, threads: int, spinning: bool) -> None:
        """Open the one-thread session the lanes share (ORT runs one session from several
        threads at once) and time it here, on blank images, to set `split_rows` and to pick
        the session for short batches; the timed runs also warm both sessions up."""
        lane = self._open(1, spinning, ["CPUExecutionProvider"])
        one = np.zeros((1, *self.chw), dtype=self.input_dtype)
        four = np.zeros((4, *self.chw), dtype=self.input_dtype)
        try:
            alone = _fastest(self.session, self.input_name, one)
            lane_one = _fastest(lane, self.input_name, one)
            # Four images take no less than one: where a quarter of one image's time already
            # reaches SPLIT_MIN_LANE_S, timing four could only find a row a lane (ResNet-18 on
            # an AVX2 EPYC: 0.13 s of the server's start)
            if lane_one / 4 >= SPLIT_MIN_LANE_S:
                per_row = lane_one / 4
            else:
                per_row = _fastest(lane, self.input_name, four) / 4
        except Exception:  # a model that cannot run blank images fails where it runs: unsplit
            log.debug("%s: not split (it failed on blank input)", self.path, exc_info=True)
            return
        rows_per_lane = min(64, max(1, math.ceil(SPLIT_MIN_LANE_S / max(per_row, 1e-9))))
        self.lanes, self.split_rows = threads, threads * rows_per_lane
        self._lane = lane
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="lightship-lane")
        if lane_one <= alone:  # one thread alone answers one image sooner: drop the pool
            self.session = lane
        log.debug(
            "%s: batches of %d+ rows split over %d one-thread lanes; one image %.3f ms on "
            "%d threads, %.3f ms on one",
            self.path,
            self.split_rows,
            threads,
            alone * 1e3,
            threads,
            lane_one * 1e3,
        )

    @property
    def short_batch_threads(self) -> int:
        """Intra-op threads of the session that runs batches too short to split."""
        return int(self.session.get_session_options().intra_op_num_threads)

    def threads_at(self, rows: int) -> int:
        """The threads a batch of `rows` runs on, as `_run` routes it: one per lane where it
        is split, else the short-batch session's."""
        return self.lanes if self.splits(rows) else self.short_batch_threads

    def _run(self, x: np.ndarray) -> np.ndarray:
        if self.input_dtype is not np.uint8:
            x = x.astype(self.input_dtype)
        lane, pool = self._lane, self._pool
        if lane is None or pool is None or not self.splits(len(x)):
            return self._infer(self.session, x)
        first, *rest = np.array_split(x, self.lanes)
        others = [pool.submit(self._infer, lane, part) for part in rest]
        try:
            head = self._infer(lane, first)
        finally:  # every lane is done with `x` before this returns, even on an error
            tails = [f.result() for f in others]
        return np.concatenate([head, *tails])

    def _infer(self, session: ort.InferenceSession, x: np.ndarray) -> np.ndarray:
        out = session.run([self.output_name], {self.input_name: x})[0]
        return np.asarray(out, dtype=np.float32)

    def close(self) -> None:
        super().close()
        if self._pool is not None:
            self._pool.shutdown()  # its lanes' threads end here
        self._pool = self._lane = None
        vars(self).pop("session", None)  # ORT frees a session's memory when its last reference goes


def _fastest(session: ort.InferenceSession, name: str, x: np.ndarray, runs: int = 3) -> float:
    """The shortest of `runs` timed runs, after one untimed: what the session can do here."""
    session.run(None, {name: x})
    best = math.inf
    for _ in range(runs):
        t0 = time.perf_counter()
        session.run(None, {name: x})
        best = min(best, time.perf_counter() - t0)
    return best
