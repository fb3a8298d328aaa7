"""Post-training int8 quantization with onnxruntime.quantization (QDQ, static and dynamic).

Calibration runs once per method and its ranges are cached, so the scheme check and every
fallback round re-quantize without re-running the model over the calibration set. Memory is
bounded: the calibrator sees `chunk` images at a time (histogram methods otherwise hold every
activation of every calibration image at once).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper, shape_inference
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)
from onnxruntime.quantization.calibrate import create_calibrator, save_tensors_data
from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry
from onnxruntime.quantization.shape_inference import quant_pre_process

from lightship.errors import QuantizeError
from lightship.quantize.isa import Scheme

log = logging.getLogger(__name__)

CALIBRATION_METHODS = {
    "minmax": CalibrationMethod.MinMax,
    "entropy": CalibrationMethod.Entropy,
    "percentile": CalibrationMethod.Percentile,
}
COMPUTE_OPS = ("Conv", "Gemm", "MatMul")


class ImageReader(CalibrationDataReader):
    """Calibration batches of uint8 images."""

    def __init__(self, images: np.ndarray, input_name: str, batch: int = 32) -> None:
        self._it = iter(
            [
                {input_name: np.ascontiguousarray(images[i : i + batch])}
                for i in range(0, len(images), batch)
            ]
        )

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)


# ORT's per-channel quantizer on a 1-D weight, which it quantizes per tensor instead
_ONE_D_WEIGHT = re.compile(r"Axis -?\d+ is out-of-range for weight '.*' with rank 1")


class _OnceEach(logging.Filter):
    """ORT's quantizers warn through the root logger, the same line on every quantization of a
    model (static int8 quantizes up to `fallback_budget` + 1 times): each line passes once in
    a process. ORT's "Please consider (to run) pre-processing" passes never: it comes before
    and after each quantization of a model whose pre-processing failed, which `preprocess`
    has said once, with the reason. Nor does "Axis 1 is out-of-range for weight ... with rank
    1", per-channel quantization's word on each 1-D weight (a LayerNorm's scale, 5 lines for a
    small ViT), which it then quantizes per tensor, as it should: nothing to act on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "pre-processing before quantization" in message or message in self.seen:
            return False
        if _ONE_D_WEIGHT.fullmatch(message):
            return False
        self.seen.add(message)
        return True


_ONCE_EACH = _OnceEach()


class _QuietThread(logging.Filter):
    """Root-logger records below WARNING from one thread (the quantizing one) dropped; other
    threads' pass."""

    def __init__(self, ident: int) -> None:
        super().__init__()
        self.ident = ident

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.ident or record.levelno >= logging.WARNING


class _StdoutBut:
    """sys.stdout, less what one thread writes to it (`ident`; None once it is done: then it
    passes all, wherever another thread's stand-in still holds it). A plain
    `redirect_stdout` swaps it for every thread: a quantize run from a notebook's background
    thread swallowed what the main thread printed meanwhile."""

    def __init__(self, stream: Any, ident: int) -> None:
        self.stream: Any = stream
        self.ident: int | None = ident

    def write(self, text: str) -> int:
        if threading.get_ident() == self.ident:
            return len(text)
        return int(self.stream.write(text))

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno, ...: the stream's
        return getattr(self.stream, name)


@contextlib.contextmanager
def _quiet() -> Any:
    """ORT's quantizers print() progress and log INFO lines per tensor; keep our output readable,
    dropping only what the quantizing thread prints and logs below WARNING. They log through
    `logging.info()`, which gives a root logger without handlers one (`basicConfig`): it goes
    again afterwards, or a caller's own `basicConfig` would do nothing."""
    root = logging.getLogger()
    handlers = list(root.handlers)
    quiet = _QuietThread(threading.get_ident())
    root.addFilter(quiet)
    root.addFilter(_ONCE_EACH)
    stdout = _StdoutBut(sys.stdout, threading.get_ident())
    sys.stdout = stdout
    try:
        yield
    finally:
        stdout.ident = None
        if sys.stdout is stdout:
            sys.stdout = stdout.stream
        root.removeFilter(_ONCE_EACH)
        root.removeFilter(quiet)
        for added in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(added)


def preprocess(fp32: Path, out: Path) -> Path:
    """Shape inference + ORT graph optimisation before quantization (ORT's advice).

    Run from a scratch folder beside `out`: where symbolic shape inference is incomplete (a
    Resize whose output meets another tensor, say), onnxruntime saves
    `sym_shape_infer_temp.onnx` and its external data into the current folder, and leaves them
    there."""
    fp32, out = fp32.absolute(), out.absolute()
    try:
        with (
            _quiet(),
            tempfile.TemporaryDirectory(dir=out.parent) as scratch,
            contextlib.chdir(scratch),
        ):
            quant_pre_process(str(fp32), str(out), skip_symbolic_shape=False)
    except (OSError, DecodeError):  # a full disk (a model it wrote, cut short), not the graph
        raise
    except Exception as exc:  # pre-processing is an optimisation; quantization still works
        log.warning("quant_pre_process failed (%s): quantizing the exported graph as is", exc)
        onnx.save(onnx.load(str(fp32)), str(out))
    return out


# Entropy needs many more histogram bins than quantized levels to search a threshold: with
# ORT's default (128 and 128) its only candidate is the full range and it equals MinMax.
HISTOGRAM_OPTIONS: dict[str, dict[str, Any]] = {
    "minmax": {},
    "entropy": {"num_bins": 2048, "num_quantized_bins": 255},
    "percentile": {"num_bins": 2048, "percentile": 99.99, "symmetric": False},
}


def calibration_calls(n: int, batch: int = 32, chunk: int = 64) -> list[tuple[int, int]]:
    """(start, stop) of the images of each `collect_data` call, for `n` images run `batch` at a
    time, about `chunk` a call. ORT's histogram calibrators stack the runs of one call into one
    array (`np.asarray`), which fails unless every run has as many rows: each call holds whole
    batches, and the images left after the last whole batch get a call of their own."""
    batch = min(batch, chunk)
    per_call = chunk - chunk % batch
    whole = n - n % batch
    calls = [(i, min(i + per_call, whole)) for i in range(0, whole, per_call)]
    return [*calls, (whole, n)] if whole < n else calls


def calibrate(
    pre: Path,
    images: np.ndarray,
    method: str,
    cache: Path,
    *,
    input_name: str = "input",
    batch: int = 32,
    chunk: int = 64,
) -> None:
    """Activation ranges of every quantizable tensor, saved to `cache` for `quantize_static`.

    The calibrator is fed `chunk` images per pass and folds them into its running min/max or
    histograms, so memory is bounded by `chunk` x activation sizes, not by the sample count.
    """
    if len(images) == 0:
        raise QuantizeError(
            "empty calibration set: static quantization needs images; "
            "set --calibration-samples to a positive number"
        )
    op_types = sorted(set(QLinearOpsRegistry) | set(QDQRegistry))
    with tempfile.TemporaryDirectory(dir=pre.parent) as tmp, _quiet():
        calibrator = create_calibrator(
            pre,
            op_types,
            augmented_model_path=str(Path(tmp) / "augmented.onnx"),
            calibrate_method=CALIBRATION_METHODS[method],
            extra_options=HISTOGRAM_OPTIONS[method],
        )
        for start, stop in calibration_calls(len(images), batch, chunk):
            part = images[start:stop]
            calibrator.collect_data(ImageReader(part, input_name, min(batch, chunk)))
        ranges = calibrator.compute_data()
    save_tensors_data(ranges, cache)


def quantize_static_onnx(
    pre: Path,
    out: Path,
    images: np.ndarray,
    scheme: Scheme,
    *,
    input_name: str = "input",
    method: str = "minmax",
    per_channel: bool = True,
    nodes_to_exclude: Sequence[str] = (),
    cache: Path,
    batch: int = 32,
    chunk: int = 64,
) -> None:
    """Static QDQ quantization from the ranges in `cache` (calibrated first when missing)."""
    if not cache.exists():
        calibrate(pre, images, method, cache, input_name=input_name, batch=batch, chunk=chunk)
    extra: dict[str, Any] = {"ActivationSymmetric": scheme.symmetric_activations}
    with _quiet():
        quantize_static(
            str(pre),
            str(out),
            None,
            quant_format=QuantFormat.QDQ,
            per_channel=per_channel,
            reduce_range=scheme.reduce_range,
            activation_type=QuantType[scheme.activation_type],
            weight_type=QuantType[scheme.weight_type],
            calibrate_method=CALIBRATION_METHODS[method],
            nodes_to_exclude=list(nodes_to_exclude),
            calibration_cache_path=str(cache),
            extra_options=extra,
        )
    float_outputs(out)


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """Each tensor's producing node, by tensor name."""
    return {out: n for n in graph.node for out in n.output}


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """Each tensor's consuming nodes (once per use), by tensor name."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for name in n.input:
            consumers.setdefault(name, []).append(n)
    return consumers


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    """A node's attributes as Python values, by name."""
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def float_outputs(path: Path) -> list[str]:
    """Drop the QuantizeLinear -> DequantizeLinear pair on each graph output fed by a Gemm or
    MatMul, so the logits leave the model in float; returns the outputs changed.

    ORT still runs that node as QGemm (int8 inputs, float output), at the same speed. Quantized,
    the logits were clipped to the range seen in calibration and rounded to 256 levels: on digits
    (VNNI) max |Δlogit| against fp32 fell from 2.34 to 0.08 and output SQNR rose from 42 to
    50 dB (the report's figures), and a clipped max error hid the difference between 7-bit and
    full-range weights.
    Not the quantizer's `OpTypesToExcludeOutputQuantization`: that leaves every Gemm/MatMul
    output in float, an MLP's hidden layers included, not only the logits.
    """
    model = onnx.load(str(path))
    graph = model.graph
    producer, users = _producers(graph), _consumers(graph)
    changed, unused = [], set()
    for output in graph.output:
        dq = producer.get(output.name)
        q = producer.get(dq.input[0]) if dq is not None else None
        if (
            dq is None
            or q is None
            or (dq.op_type, q.op_type) != ("DequantizeLinear", "QuantizeLinear")
        ):
            continue
        node = producer.get(q.input[0])
        if node is None or node.op_type not in ("Gemm", "MatMul"):
            continue
        if len(users.get(q.input[0], [])) != 1 or len(users.get(q.output[0], [])) != 1:
            continue  # the quantized tensor feeds something else too: keep the pair
        node.output[list(node.output).index(q.input[0])] = output.name
        graph.node.remove(q)
        graph.node.remove(dq)
        unused.update([*q.input[1:], *dq.input[1:]])
        changed.append(output.name)
    if not changed:
        return []
    still_used = {name for n in graph.node for name in n.input}
    kept = [t for t in graph.initializer if t.name not in unused or t.name in still_used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    onnx.save(model, str(path))
    return changed


def _dims(value: onnx.ValueInfoProto) -> list[int]:
    """A tensor's inferred shape, -1 for a symbolic or unknown dimension."""
    dims = value.type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else -1 for d in dims]


def flatten_channels_last(src: Path, out: Path) -> list[str]:
    """Write `src` to `out` with each NCHW -> (N, C*H*W) flatten feeding a Gemm done in NHWC
    order, the Gemm's weight columns permuted to match; returns the flattens changed.

    ONNX Runtime runs int8 convolutions and pools channels-last and, before an NCHW flatten,
    transposes their uint8 output back with a slow generic kernel. An explicit NHWC transpose
    there cancels against it: measured on digits (VNNI, batch 64) +2.6 % img/s, same accuracy.
    The function is unchanged (same products, summed in another order). For int8 graphs only
    (in fp32 or dynamic int8 the transpose would be real work): an fp32 graph about to be
    statically quantized, or a QDQ graph (QAT), where a per-tensor QuantizeLinear ->
    DequantizeLinear may sit between flatten and Gemm and the weight may be dequantized.
    """
    model = shape_inference.infer_shapes(onnx.load(str(src)))
    graph = model.graph
    shapes = {v.name: _dims(v) for v in [*graph.value_info, *graph.input, *graph.output]}
    inits = {t.name: t for t in graph.initializer}
    producer, users = _producers(graph), _consumers(graph)

    def only_user(name: str) -> onnx.NodeProto | None:
        found = users.get(name, [])
        return found[0] if len(found) == 1 else None

    def per_tensor(node: onnx.NodeProto) -> bool:
        scale = inits.get(node.input[1])
        return scale is not None and int(np.prod(scale.dims)) == 1

    def after_a_conv(name: str) -> bool:
        """Whether a Conv runs upstream of `name` (else ORT has no NHWC tensor to transpose)."""
        todo, seen = [name], set()
        while todo:
            node = producer.get(todo.pop())
            if node is None or node.output[0] in seen:
                continue
            if node.op_type == "Conv":
                return True
            seen.add(node.output[0])
            todo.extend(node.input)
        return False

    changed = []
    for node in list(graph.node):
        if node.op_type not in ("Flatten", "Reshape"):
            continue
        in_shape = shapes.get(node.input[0], [])
        if len(in_shape) != 4 or min(in_shape[1:]) < 1 or in_shape[2] * in_shape[3] == 1:
            continue
        _, c, h, w = in_shape
        if c == 1 or not after_a_conv(node.input[0]):
            continue  # the same order either way, or nothing channels-last to cancel
        attrs = _attrs(node)
        if node.op_type == "Flatten" and attrs.get("axis", 1) != 1:
            continue
        if node.op_type == "Reshape":
            target = inits.get(node.input[1])
            dims = numpy_helper.to_array(target).tolist() if target is not None else []
            if len(dims) != 2 or dims[0] not in (-1, 0) or dims[1] != c * h * w:
                continue
        flat = node.output[0]  # the Gemm's A: the flatten's output, or that requantized
        gemm = only_user(flat)
        if gemm is not None and gemm.op_type == "QuantizeLinear" and per_tensor(gemm):
            dq = only_user(gemm.output[0])
            ok = dq is not None and dq.op_type == "DequantizeLinear" and per_tensor(dq)
            flat = dq.output[0] if dq is not None and ok else ""
            gemm = only_user(flat) if flat else None
        if gemm is None or gemm.op_type != "Gemm" or gemm.input[0] != flat:
            continue
        g_attrs = _attrs(gemm)
        trans_b = bool(g_attrs.get("transB", 0))
        weight = inits.get(gemm.input[1])
        if weight is None and (w_dq := producer.get(gemm.input[1])) is not None:
            # a dequantized weight: per-tensor, or per-channel along the outputs
            axis = _attrs(w_dq).get("axis", 1)
            if w_dq.op_type == "DequantizeLinear" and (per_tensor(w_dq) or axis == 1 - trans_b):
                weight = inits.get(w_dq.input[0])
        if g_attrs.get("transA", 0) or weight is None or len(users[weight.name]) != 1:
            continue
        wt = numpy_helper.to_array(weight)
        w_nk = wt if trans_b else wt.T  # [outputs, c*h*w]
        w_nk = w_nk.reshape(-1, c, h, w).transpose(0, 2, 3, 1).reshape(len(w_nk), -1)
        permuted = w_nk if trans_b else w_nk.T
        weight.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(permuted), weight.name))
        transpose = onnx.helper.make_node(
            "Transpose",
            [node.input[0]],
            [f"{node.input[0]}_nhwc"],
            name=f"{node.name or node.output[0]}_nhwc",
            perm=[0, 2, 3, 1],
        )
        graph.node.insert(list(graph.node).index(node), transpose)
        node.input[0] = transpose.output[0]
        changed.append(node.name or node.output[0])
    onnx.save(model, str(out))
    return changed


def quantize_gemm_bias(path: Path) -> list[str]:
    """Replace the float bias of each Gemm whose input and weight are dequantized by an int32
    bias, its scale the input scale times the weight scale (the QDQ convention); returns the
    Gemms changed.

    ONNX Runtime fuses DQ -> Gemm into QGemm only when every input is dequantized: a Gemm with a
    float bias runs in fp32 unless a QuantizeLinear follows it. PyTorch's PT2E flow (QAT) leaves
    a Linear's bias in float, so without this its classifier could be int8 only with quantized
    logits. The rounding moves each logit by at most half a bias step (input scale x weight
    scale, ~1e-4 on digits).
    """
    model = onnx.load(str(path))
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = _producers(graph)

    def constant(name: str) -> np.ndarray | None:
        if name in inits:
            return numpy_helper.to_array(inits[name])
        node = producer.get(name)
        if node is not None and node.op_type == "Constant" and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    changed = []
    for node in list(graph.node):
        if node.op_type != "Gemm" or len(node.input) < 3:
            continue
        attrs = _attrs(node)
        if attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            continue
        dq_a, dq_w = producer.get(node.input[0]), producer.get(node.input[1])
        bias = inits.get(node.input[2])
        if (
            dq_a is None
            or dq_w is None
            or bias is None
            or {dq_a.op_type, dq_w.op_type} != {"DequantizeLinear"}
            or bias.data_type != onnx.TensorProto.FLOAT
        ):
            continue
        scale_a, scale_w = constant(dq_a.input[1]), constant(dq_w.input[1])
        b = numpy_helper.to_array(bias).astype(np.float64)
        if scale_a is None or scale_w is None or scale_a.size != 1 or b.ndim != 1:
            continue
        w_axis = _attrs(dq_w).get("axis", 1)
        out_axis = 0 if attrs.get("transB", 0) else 1
        if scale_w.size != 1 and (scale_w.size != b.size or w_axis != out_axis):
            continue  # per-channel along the reduced axis: no single scale per output
        scale = np.broadcast_to(scale_a.astype(np.float64) * scale_w.astype(np.float64), b.shape)
        q = np.clip(np.round(b / scale), -(2**31), 2**31 - 1).astype(np.int32)
        stem = f"{node.output[0]}_bias_int32"  # per Gemm: two Gemms may share a bias
        graph.initializer.extend(
            [
                numpy_helper.from_array(q, stem),
                numpy_helper.from_array(scale.astype(np.float32), f"{stem}_scale"),
                numpy_helper.from_array(np.zeros_like(q), f"{stem}_zero_point"),
            ]
        )
        dq = onnx.helper.make_node(
            "DequantizeLinear",
            [stem, f"{stem}_scale", f"{stem}_zero_point"],
            [f"{stem}_dequantized"],
            name=f"{stem}_DequantizeLinear",
            axis=0,
        )
        graph.node.insert(list(graph.node).index(node), dq)
        node.input[2] = dq.output[0]
        changed.append(node.name or node.output[0])
        if not any(bias.name in n.input for n in graph.node):
            graph.initializer.remove(bias)
    if changed:
        onnx.save(model, str(path))
    return changed


def quantize_dynamic_onnx(pre: Path, out: Path, scheme: Scheme, conv_heavy: bool) -> str:
    """Dynamic quantization: int8 weights, activations quantized per batch at run time.

    Weights are uint8 on AVX2 (as before) and for conv-heavy models everywhere: ONNX Runtime's
    ConvInteger ran the digits CNN 2.3x faster with uint8 than with int8 weights on an AVX-512
    VNNI CPU (2,747 against 1,184 img/s at batch 64; fp32 7,696). MatMul-heavy models keep
    int8 weights on VNNI/ARM, the u8 x s8 kernels those CPUs accelerate.
    """
    weight_type, _ = dynamic_weights(scheme, conv_heavy)
    with _quiet():
        quantize_dynamic(
            str(pre),
            str(out),
            per_channel=False,
            reduce_range=scheme.reduce_range,
            weight_type=weight_type,
        )
    return weight_type.name  # for the manifest: the target's scheme names its static one


def dynamic_weights(scheme: Scheme, conv_heavy: bool) -> tuple[QuantType, str]:
    """The type `quantize_dynamic_onnx` gives the weights, and why, for the manifest's scheme:
    the target's static scheme says why it has int8 weights, which uint8 ones are not."""
    if conv_heavy:
        return QuantType.QUInt8, (
            "uint8 weights: ONNX Runtime's ConvInteger ran a conv net 2.3x faster with them "
            "than with int8 weights (digits, AVX-512 VNNI)"
        )
    if scheme.target == "avx2":
        return QuantType.QUInt8, (
            "uint8 weights: without VNNI, u8 x s8 pairs sum in int16 and can saturate; "
            "u8 x u8 products do not"
        )
    return QuantType.QInt8, scheme.why


def scales_digest(path: Path) -> str:
    """sha256 over every quantization scale in a QDQ model: equal digests, equal quantization."""
    model = onnx.load(str(path))
    digest = hashlib.sha256()
    for init in sorted(model.graph.initializer, key=lambda t: t.name):
        if init.name.endswith("_scale"):
            digest.update(init.name.encode())
            digest.update(numpy_helper.to_array(init).tobytes())
    return digest.hexdigest()


def flop_share(path: Path) -> dict[str, float]:
    """Share of multiply-accumulates in convolutions vs matrix products, at batch 1."""
    model = onnx.load(str(path))
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if dims and dims[0].dim_param:
            dims[0].dim_value = 1
    model = shape_inference.infer_shapes(model)
    shapes: dict[str, list[int]] = {}
    for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        shapes[v.name] = [d.dim_value for d in v.type.tensor_type.shape.dim]
    for init in model.graph.initializer:
        shapes[init.name] = list(init.dims)
    macs = {"conv": 0.0, "matmul": 0.0}
    for node in model.graph.node:
        out_shape = shapes.get(node.output[0], [])
        if node.op_type == "Conv" and node.input[1] in shapes and out_shape:
            w = shapes[node.input[1]]  # [Cout, Cin/groups, kh, kw]
            macs["conv"] += float(np.prod(out_shape)) * float(np.prod(w[1:]))
        elif node.op_type in ("Gemm", "MatMul") and out_shape:
            a = shapes.get(node.input[0], [])
            k = a[-1] if a else 0
            if node.op_type == "Gemm" and any(
                attr.name == "transA" and attr.i for attr in node.attribute
            ):
                k = a[0]
            macs["matmul"] += float(np.prod(out_shape)) * float(k)
    total = sum(macs.values()) or 1.0
    return {k: v / total for k, v in macs.items()}


def fp32_island(path: Path, node: str) -> list[str]:
    """`node` plus the non-compute nodes feeding it back to the previous compute node.

    Excluding a Conv alone is not enough: with a quantized input and output, ORT's
    WeightBiasQuantization transformer quantizes its float weights itself (full-range,
    per-tensor, so it saturates on AVX2) and still runs QLinearConv. With a float input the
    node stays a float Conv.
    """
    graph = onnx.load(str(path)).graph
    by_name = {n.name: n for n in graph.node}
    return [node, *walk_back(graph, by_name[node])[0]] if node in by_name else [node]


def walk_back(graph: onnx.GraphProto, node: onnx.NodeProto) -> tuple[list[str], list[str]]:
    """From `node`'s inputs back to the compute nodes feeding it: the names of the non-compute
    nodes on the way (pooling, flatten, a residual Add: `fp32_island`) and of those compute
    nodes, whose outputs are what the island reads (`fallback.rank_nodes`). Every input, not
    the first alone: a MatMul's activation may be its second (`W @ x`, attention's `a @ b`);
    weights are initializers, which no node produces."""
    producer = _producers(graph)
    between: list[str] = []
    feeding: list[str] = []
    seen, stack = {node.name}, [i for i in node.input if i in producer]
    while stack:
        prev = producer.get(stack.pop())
        if prev is None or prev.name in seen:
            continue
        seen.add(prev.name)
        if prev.op_type in COMPUTE_OPS:
            feeding.append(prev.name)
        else:
            between.append(prev.name)
            stack.extend(i for i in prev.input if i in producer)
    return between, feeding


# A first conv this thin (input channels x kernel area, e.g. 1x3x3 on grey digits) does too
# little work per output for the int8 kernels: measured 6x slower than its fp32 (NCHWc) kernel.
THIN_CONV_K = 27


def thin_first_conv(path: Path) -> list[str]:
    """Nodes to keep fp32 so the model's first Conv runs as a float kernel, or [] if not thin.

    The island is the conv, the input chain feeding it (see `fp32_island`) and the single-use
    element-wise/pooling nodes after it up to the next compute node, so that its ReLU and
    pooling stay fused with it in fp32 and quantization starts at the next conv's input.
    """
    graph = onnx.load(str(path)).graph
    compute = [n for n in graph.node if n.op_type in COMPUTE_OPS]
    if not compute or compute[0].op_type != "Conv":
        return []
    conv = compute[0]
    weights = {t.name: list(t.dims) for t in graph.initializer}
    shape = weights.get(conv.input[1])
    if shape is None or len(shape) != 4 or shape[1] * shape[2] * shape[3] > THIN_CONV_K:
        return []
    island = fp32_island(path, conv.name)
    consumers = _consumers(graph)
    out = conv.output[0]
    while len(users := consumers.get(out, [])) == 1 and users[0].op_type not in COMPUTE_OPS:
        island.append(users[0].name)
        out = users[0].output[0]
    return island


# The depth (input channels x kernel area) from which a conv gains from ORT's im2col + GEMM path
# on an AMX CPU: ResNet-18's 3x3 convs from 64 channels (K = 576) up. Below it the direct
# VNNI conv kernels win (measured with every conv of the digits model routed: 0.73x).
GEMM_CONV_MIN_K = 512


def route_convs_to_gemm(src: Path, dst: Path, min_k: int = GEMM_CONV_MIN_K) -> list[str]:
    """Write `src` to `dst` with its deep int8 convs sent to ORT's u8 x s8 GEMM; returns them.

    QLinearConv runs its direct VNNI conv kernels when the int8 weights' zero point is 0, as
    lightship's symmetric per-channel weights have it, and im2col plus MLAS's quantized GEMM,
    which has the AMX kernels, when one non-zero zero point serves every channel. Storing each
    weight as q - 1 with zero point -1 changes no product, (q - 1) - (-1) = q, so the outputs
    are bit-identical; it needs every weight >= -127 (symmetric int8 weights are) and weights
    used by this conv alone.
    """
    model = onnx.load(str(src))
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers, consumers = _producers(graph), _consumers(graph)
    routed: list[str] = []
    for conv in graph.node:
        dq = producers.get(conv.input[1]) if conv.op_type == "Conv" else None
        if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) < 3:
            continue
        weight, zero = inits.get(dq.input[0]), inits.get(dq.input[2])
        if weight is None or zero is None or weight.data_type != onnx.TensorProto.INT8:
            continue
        if any(len(consumers.get(t, [])) != 1 for t in (dq.input[0], dq.output[0])):
            continue
        q, zp = numpy_helper.to_array(weight), numpy_helper.to_array(zero)
        if q.ndim != 4 or zp.any() or q.min() < -127 or int(np.prod(q.shape[1:])) < min_k:
            continue
        shifted = (q.astype(np.int16) - 1).astype(np.int8)
        weight.CopyFrom(numpy_helper.from_array(shifted, weight.name))
        minus_one = numpy_helper.from_array(np.full_like(zp, -1), f"{dq.input[0]}_gemm_zero_point")
        graph.initializer.append(minus_one)  # its own: QAT's export shares zero points
        dq.input[2] = minus_one.name
        routed.append(conv.name)
    used = {name for n in graph.node for name in n.input}
    used |= {v.name for v in (*graph.input, *graph.output)}
    kept = [t for t in graph.initializer if t.name in used]
    if len(kept) < len(graph.initializer):  # the zero points no node reads any more
        del graph.initializer[:]
        graph.initializer.extend(kept)
    onnx.save(model, str(dst))
    return routed


def copy_metadata(src: Path, dst: Path, extra: dict[str, str]) -> None:
    """Carry the exported model's metadata_props (labels, input spec) into a quantized file."""
    source = onnx.load(str(src))
    model = onnx.load(str(dst))
    props = {p.key: p.value for p in source.metadata_props}
    props.update(extra)
    del model.metadata_props[:]
    for key, value in props.items():
        model.metadata_props.add(key=key, value=value)
    model.producer_name = "lightship"
    onnx.save(model, str(dst))
