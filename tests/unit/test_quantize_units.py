from __future__ import annotations

import logging
import sys
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import onnx
import pytest
import pytorch_lightning as pl
import torch
from onnx import TensorProto, helper

from lightship.callbacks import LatestBestCheckpoint
from lightship.data import Splits
from lightship.errors import ConfigError
from lightship.quantize import core as quantize_core
from lightship.quantize import isa, ptq, qat
from lightship.quantize.core import parse_methods
from lightship.report import evaluate
from lightship.report.render import pareto_front
from lightship.runtime import Predictor


def cpu(arch: str, *flags: str) -> isa.CpuInfo:
    return isa.CpuInfo("test CPU", arch, frozenset(flags))


@pytest.mark.parametrize(
    ("info", "target"),
    [
        (cpu("x86_64", "avx2", "fma"), "avx2"),
        (cpu("x86_64", "avx2", "avx512f", "avx512_vnni"), "vnni"),
        (cpu("x86_64", "avx2", "avx_vnni"), "vnni"),
        (cpu("x86_64", "avx2", "amx_int8"), "vnni"),
        (cpu("aarch64", "asimd", "asimddp"), "arm64"),
    ],
)
def test_target_follows_the_cpu_flags(info: isa.CpuInfo, target: str) -> None:
    assert info.target == target


def test_the_cpu_is_named_by_cpuinfo_not_by_uname(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import platform

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test Xeon\nflags\t\t: fpu avx2\n")
    monkeypatch.setattr(platform, "processor", lambda: "x86_64")  # `uname -p` on Ubuntu
    host_cpu = isa.host_cpu.__wrapped__  # uncached: read afresh each call
    assert host_cpu(cpuinfo).model == "Test Xeon"
    assert host_cpu(tmp_path / "none").model == "x86_64"  # no cpuinfo: uname's word
    monkeypatch.setattr(platform, "processor", lambda: "")  # Debian's
    assert host_cpu(tmp_path / "none").model == "unknown CPU"


def test_avx2_scheme_uses_seven_bit_weights() -> None:
    assert isa.SCHEMES["avx2"].reduce_range is True
    assert isa.SCHEMES["vnni"].reduce_range is False
    assert isa.SCHEMES["tensorrt"].symmetric_activations is True
    assert isa.SCHEMES["tensorrt"].activation_type == "QInt8"


def test_compatibility_warns_about_saturation() -> None:
    avx2 = cpu("x86_64", "avx2")
    assert isa.compatibility("avx2", avx2) is None
    assert isa.compatibility("vnni", cpu("x86_64", "avx512_vnni")) is None
    msg = isa.compatibility("vnni", avx2)
    assert msg is not None and "saturates" in msg and "--target avx2" in msg
    assert "TensorRT" in (isa.compatibility("tensorrt", avx2) or "")


def test_unknown_target_and_method() -> None:
    with pytest.raises(ValueError, match="unknown target 'sse'"):
        isa.resolve_target("sse")
    with pytest.raises(ConfigError, match="unknown quantization method 'fp4': choose from"):
        parse_methods("static,fp4")
    assert parse_methods("qat, static,static") == ["qat", "static"]
    with pytest.raises(ConfigError, match=r"^no quantization method given: choose from static,"):
        parse_methods(" , ")  # `--methods ''` said "unknown quantization method []"


def test_pareto_front() -> None:
    # (latency, accuracy): (2.0, 98.0) is slower and less accurate than (1.0, 99.0)
    points = [(1.0, 99.0), (2.0, 98.0), (0.5, 97.0), (3.0, 99.5)]
    assert pareto_front(points) == [2, 0, 3]


def _conv_net(path: Path, first_in_channels: int) -> Path:
    """input -> Cast -> Conv(k=3) -> Relu -> MaxPool -> Conv -> output, as ONNX."""
    c = first_in_channels
    w1 = helper.make_tensor("w1", TensorProto.FLOAT, [4, c, 3, 3], [0.1] * (4 * c * 9))
    w2 = helper.make_tensor("w2", TensorProto.FLOAT, [4, 4, 3, 3], [0.1] * (4 * 4 * 9))
    nodes = [
        helper.make_node("Cast", ["input"], ["xf"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Conv", ["xf", "w1"], ["c1"], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2]),
        helper.make_node("Conv", ["p1", "w2"], ["logits"], name="conv2"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input", TensorProto.UINT8, [1, c, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
        [w1, w2],
    )
    onnx.save(helper.make_model(graph), str(path))
    return path


def test_a_thin_first_conv_is_offered_to_fp32_with_its_input_chain_relu_and_pool(
    tmp_path: Path,
) -> None:
    thin = ptq.thin_first_conv(_conv_net(tmp_path / "thin.onnx", 1))
    assert sorted(thin) == ["cast", "conv1", "pool1", "relu1"]
    assert ptq.thin_first_conv(_conv_net(tmp_path / "wide.onnx", 16)) == []


def _flatten_gemm(
    path: Path, hw: int, trans_b: int, op: str = "Reshape", channels: int = 3, conv: bool = True
) -> None:
    """input [N, C, hw, hw] -> 1x1 conv (or none) -> flatten -> Gemm -> 5 logits, shapes
    inferred (as after `ptq.preprocess`)."""
    import numpy as np
    from onnx import numpy_helper

    k = channels * hw * hw
    rng = np.random.default_rng(0)
    w = rng.normal(size=(5, k) if trans_b else (k, 5)).astype(np.float32)
    conv_w = rng.normal(size=(channels, channels, 1, 1)).astype(np.float32)
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(np.ones(5, np.float32), "b"),
        numpy_helper.from_array(conv_w, "conv_w"),
    ]
    nodes = [helper.make_node("Conv", ["x", "conv_w"], ["map"], name="conv")] if conv else []
    map_ = "map" if conv else "x"
    if op == "Reshape":
        inits.append(numpy_helper.from_array(np.array([-1, k], np.int64), "shape"))
        nodes.append(helper.make_node("Reshape", [map_, "shape"], ["flat"], name="flatten"))
    else:
        nodes.append(helper.make_node("Flatten", [map_], ["flat"], name="flatten", axis=1))
    nodes.append(helper.make_node("Gemm", ["flat", "w", "b"], ["y"], name="head", transB=trans_b))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", channels, hw, hw])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(onnx.shape_inference.infer_shapes(model), str(path))


def test_ort_warnings_during_quantization_come_once_and_its_preprocessing_advice_never(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A model whose pre-processing failed: ORT's advice before and after every quantization,
    # and a per-channel warning on each of static int8's up to four quantizations.
    # (a line new to this process: the filter remembers lines for the whole process)
    axis = f"Axis 1 is out-of-range for weight 'norm.weight' with rank 1 ({uuid.uuid4().hex})"
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with ptq._quiet():
                logging.warning("Please consider to run pre-processing before quantization.")
                logging.warning(axis)
                logging.warning("Please consider pre-processing before quantization. See ...")
        logging.warning(axis)  # outside a quantization: not ORT's to say once
    assert [r.getMessage() for r in caplog.records] == [axis, axis]


def test_ort_logging_leaves_the_root_logger_as_it_found_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ORT logs with logging.info(), whose basicConfig gave a handler-less root logger one for
    # good: a script's own logging.basicConfig(level=INFO) then did nothing
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    with ptq._quiet():
        logging.info("calibration cache: x")
        assert root.handlers  # basicConfig's, for the warnings ORT logs meanwhile
    assert root.handlers == []


def test_quantizing_in_one_thread_silences_that_thread_alone(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """redirect_stdout swapped sys.stdout for every thread: a quantize run from a notebook's
    background thread swallowed what the main thread printed meanwhile (25 of 65 lines)."""
    inside, go_on = threading.Event(), threading.Event()

    def quantizing() -> None:
        with ptq._quiet():
            print("ORT's progress")
            logging.info("ORT's calibration line")
            inside.set()
            go_on.wait(5)

    worker = threading.Thread(target=quantizing)
    with caplog.at_level(logging.INFO):
        worker.start()
        assert inside.wait(5)
        print("the caller's line")
        logging.info("the caller's log")
        go_on.set()
        worker.join(5)
        print("after")
    assert capsys.readouterr().out == "the caller's line\nafter\n"
    assert [r.getMessage() for r in caplog.records] == ["the caller's log"]
    assert sys.stdout is sys.__stdout__ or not isinstance(sys.stdout, ptq._StdoutBut)


class _UpsampledResidual(torch.nn.Module):
    """conv, a stride-2 conv upsampled back and added to it: onnxruntime's symbolic shape
    inference cannot tell the two shapes are the same."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(4, 4, 3, padding=1, stride=2)
        self.fc = torch.nn.Linear(4 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        y = torch.nn.functional.interpolate(self.conv2(x), scale_factor=2.0, mode="bilinear")
        return self.fc(torch.flatten(y + x, 1))


def test_preprocess_leaves_nothing_where_it_was_run_when_shape_inference_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # onnxruntime saves sym_shape_infer_temp.onnx and a <uuid>.data into the current folder
    from lightship.export import onnx as onnx_export
    from lightship.models import Classifier, Normalize

    model = Classifier(Normalize([0.5], [0.2]), _UpsampledResidual()).eval()
    fp32, work, here = tmp_path / "model.onnx", tmp_path / "work", tmp_path / "here"
    work.mkdir()
    here.mkdir()
    onnx_export.write(model, torch.zeros(2, 1, 16, 16, dtype=torch.uint8), fp32, {})
    monkeypatch.chdir(here)
    with caplog.at_level(logging.WARNING, "lightship.quantize.ptq"):
        pre = ptq.preprocess(Path("../model.onnx"), work / "pre.onnx")  # relative, as given
    assert "Incomplete symbolic shape inference" in caplog.text  # the case this is about
    assert list(here.iterdir()) == []
    assert sorted(p.name for p in work.iterdir()) == ["pre.onnx"]
    onnx.checker.check_model(onnx.load(str(pre)))


@pytest.mark.parametrize(("trans_b", "op"), [(1, "Reshape"), (0, "Reshape"), (1, "Flatten")])
def test_flatten_channels_last_keeps_the_function(tmp_path: Path, trans_b: int, op: str) -> None:
    import numpy as np
    import onnxruntime as ort

    src, out = tmp_path / "pre.onnx", tmp_path / "nhwc.onnx"
    _flatten_gemm(src, 4, trans_b, op)
    assert ptq.flatten_channels_last(src, out) == ["flatten"]
    graph = onnx.load(str(out)).graph
    transpose = next(n for n in graph.node if n.op_type == "Transpose")
    assert list(transpose.attribute[0].ints) == [0, 2, 3, 1]
    x = np.random.default_rng(1).normal(size=(7, 3, 4, 4)).astype(np.float32)
    want, got = (ort.InferenceSession(str(p)).run(None, {"x": x})[0] for p in (src, out))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case",
    [
        {"hw": 1},  # after a global pool: NCHW and NHWC order are the same
        {"hw": 4, "channels": 1},  # one channel: the same order too
        {"hw": 4, "conv": False},  # an MLP's flatten of its input: nothing runs channels-last
    ],
)
def test_flatten_channels_last_leaves_alone_what_it_cannot_speed_up(
    tmp_path: Path, case: dict
) -> None:
    src, out = tmp_path / "pre.onnx", tmp_path / "nhwc.onnx"
    _flatten_gemm(src, trans_b=1, **case)
    assert ptq.flatten_channels_last(src, out) == []
    assert "Transpose" not in [n.op_type for n in onnx.load(str(out)).graph.node]


def test_quantize_gemm_bias_gives_each_gemm_its_own_int32_bias(tmp_path: Path) -> None:
    """Two Gemms on one dequantized input, per-channel int8 weights, sharing one float bias
    (QAT's export leaves biases float): each gets an int32 bias, ORT runs both as QGemm, and
    the outputs move by at most half a bias step."""
    import numpy as np
    import onnxruntime as ort
    from onnx import numpy_helper

    from lightship.quantize.core import int8_share

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.array(0.05, np.float32), "x_scale"),
        numpy_helper.from_array(np.array(128, np.uint8), "x_zp"),
        numpy_helper.from_array(rng.normal(size=5).astype(np.float32), "bias"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["xd"]),
    ]
    for i in (1, 2):
        # 7-bit weights, as QAT makes them for AVX2: that CPU's u8 x s8 GEMM sums pairs in int16,
        # where full-range ones saturate (6 of 40 outputs off by up to 14.6 on an AVX2 EPYC)
        w = rng.integers(-64, 64, size=(5, 4)).astype(np.int8)
        inits += [
            numpy_helper.from_array(w, f"w{i}"),
            numpy_helper.from_array(rng.uniform(0.01, 0.02, 5).astype(np.float32), f"w{i}_s"),
            numpy_helper.from_array(np.zeros(5, np.int8), f"w{i}_zp"),
        ]
        nodes += [
            helper.make_node(
                "DequantizeLinear", [f"w{i}", f"w{i}_s", f"w{i}_zp"], [f"w{i}d"], axis=0
            ),
            helper.make_node("Gemm", ["xd", f"w{i}d", "bias"], [f"y{i}"], name=f"g{i}", transB=1),
        ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["batch", 5]) for i in (1, 2)],
        inits,
    )
    src, out = tmp_path / "float-bias.onnx", tmp_path / "int32-bias.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    out.write_bytes(src.read_bytes())
    assert ptq.quantize_gemm_bias(out) == ["g1", "g2"]
    model = onnx.load(str(out))
    onnx.checker.check_model(model)
    types = {t.name: t.data_type for t in model.graph.initializer}
    assert "bias" not in types and list(types.values()).count(TensorProto.INT32) == 4  # q + zp
    assert int8_share(out)["int8_op_types"] == ["QGemm"] and int8_share(out)["float_nodes"] == 0
    x = rng.uniform(-6, 6, size=(8, 4)).astype(np.float32)
    want, got = (ort.InferenceSession(str(p)).run(None, {"x": x}) for p in (src, out))
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(b, a, atol=0.5 * 0.05 * 0.02 + 1e-5)


def test_route_convs_to_gemm_rewrites_only_deep_convs_and_keeps_every_output_bit(
    tmp_path: Path,
) -> None:
    """Three QDQ convs on one uint8-quantized input, symmetric per-channel int8 weights: the
    deep one (K = 64 x 3 x 3) is stored as q - 1 with zero point -1 and ORT's QLinearConv gives
    the same bits; the shallow one (K = 36) and one holding -128 (no room for q - 1) stay, the
    latter with the zero-point initializer it shared with the deep one (QAT's export shares
    them)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import numpy_helper

    from lightship.quantize.core import int8_share

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.array(0.05, np.float32), "x_s"),
        numpy_helper.from_array(np.array(128, np.uint8), "x_zp"),
        numpy_helper.from_array(np.array(0.2, np.float32), "y_s"),
        numpy_helper.from_array(np.array(128, np.uint8), "y_zp"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_s", "x_zp"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "x_s", "x_zp"], ["xd"]),
    ]
    weights = {}
    for name, cin in [("deep", 64), ("shallow", 4), ("full", 64)]:
        # |q - 1| <= 64: exact on AVX2 too, whose u8 x s8 GEMM sums pairs in int16
        w = rng.integers(-63, 64, size=(8, cin, 3, 3)).astype(np.int8)
        if name == "full":
            w[0, 0, 0, 0] = -128
        weights[name] = w
        inits += [
            numpy_helper.from_array(w, f"{name}_w"),
            numpy_helper.from_array(rng.uniform(0.001, 0.002, 8).astype(np.float32), f"{name}_s"),
        ]
        zp = "deep_zp" if name == "full" else f"{name}_zp"  # shared, as QAT's export does
        if name != "full":
            inits.append(numpy_helper.from_array(np.zeros(8, np.int8), zp))
        src = "xd" if cin == 64 else "xd4"
        nodes += [
            helper.make_node(
                "DequantizeLinear", [f"{name}_w", f"{name}_s", zp], [f"{name}_wd"], axis=0
            ),
            helper.make_node("Conv", [src, f"{name}_wd"], [f"{name}_c"], name=name, pads=[1] * 4),
            helper.make_node("QuantizeLinear", [f"{name}_c", "y_s", "y_zp"], [f"{name}_q"]),
            helper.make_node("DequantizeLinear", [f"{name}_q", "y_s", "y_zp"], [f"{name}_y"]),
        ]
    nodes.insert(2, helper.make_node("Slice", ["xd", "zero", "four", "one"], ["xd4"]))
    inits += [
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([4], np.int64), "four"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64, 8, 8])],
        [
            helper.make_tensor_value_info(f"{n}_y", TensorProto.FLOAT, ["batch", 8, 8, 8])
            for n in weights
        ],
        inits,
    )
    src_path, out = tmp_path / "direct.onnx", tmp_path / "gemm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src_path))
    assert ptq.route_convs_to_gemm(src_path, out, min_k=512) == ["deep"]
    routed = onnx.load(str(out)).graph
    onnx.checker.check_model(onnx.load(str(out)))
    stored = {t.name: numpy_helper.to_array(t) for t in routed.initializer}
    zero_point = {n.input[0]: stored[n.input[2]] for n in routed.node if n.input[0] in stored}
    np.testing.assert_array_equal(stored["deep_w"], weights["deep"].astype(np.int16) - 1)
    np.testing.assert_array_equal(zero_point["deep_w"], np.full(8, -1, np.int8))
    for name in ("shallow", "full"):
        np.testing.assert_array_equal(stored[f"{name}_w"], weights[name])
        assert not zero_point[f"{name}_w"].any()
    assert int8_share(out)["int8_op_types"] == ["QLinearConv"]  # ORT fused every conv
    x = rng.uniform(-6, 6, size=(4, 64, 8, 8)).astype(np.float32)
    want, got = (ort.InferenceSession(str(p)).run(None, {"x": x}) for p in (src_path, out))
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile"])
def test_calibration_takes_every_image_whatever_their_number(tmp_path: Path, method: str) -> None:
    """300 images: four chunks of two 32-image runs, then 44 = 32 + 12, two runs ORT's
    histogram calibrators could not stack into one array (a traceback, for entropy and
    percentile). The largest pixel is in the last image, the one after the last whole batch."""
    import numpy as np
    from onnxruntime.quantization.calibrate import load_tensors_data

    model, cache = tmp_path / "pre.onnx", tmp_path / "calibration.json"
    _flatten_gemm(model, hw=2, trans_b=1)
    images = np.random.default_rng(0).uniform(0, 1, size=(300, 3, 2, 2)).astype(np.float32)
    images[-1, 0, 0, 0] = 2.0
    ptq.calibrate(model, images, method, cache, input_name="x", batch=32, chunk=64)
    x = load_tensors_data(cache).data["x"]
    assert float(np.max(x.range_value[0])) == images.min()
    if method == "minmax":
        assert float(np.max(x.range_value[1])) == 2.0
    if method == "entropy":  # every input value counted, once
        assert int(np.sum(x.hist)) == images.size


class _Recording(Predictor):
    """Right answers (the class is the pixel value), and a record of each run's rows."""

    kind = "test"

    def __init__(self) -> None:
        self.path = Path("recording")
        self.labels = ["0", "1"]
        self.input_spec = {"name": "input", "dtype": "uint8", "shape": ["batch", 1, 1, 1]}
        self.runs: list[int] = []

    def _run(self, x: np.ndarray) -> np.ndarray:
        self.runs.append(len(x))
        return np.eye(2, dtype=np.float32)[x[:, 0, 0, 0]]


def test_quantize_runs_the_test_images_as_the_report_does() -> None:
    """A dynamic int8 model scales activations per run, so its accuracy moves with the rows
    each run gets: quantize (which gated and recorded 269 images in one run, split over the
    lanes) must batch them as the report does, or the two figures differ."""
    x = (np.arange(269) % 2).astype(np.uint8).reshape(-1, 1, 1, 1)
    predictor = _Recording()
    evaluate.logits(predictor, x)
    report_runs, predictor.runs = predictor.runs, []
    accuracy, _ = quantize_core._accuracy(predictor, x, x[:, 0, 0, 0])
    assert predictor.runs == report_runs == [256, 13] and accuracy == 1.0


def _dynamic_int8(path: Path) -> Path:
    """A uint8 image [N, 1, 2, 2] times a 4x2 matrix, dynamically quantized: each run
    quantizes its whole input with one scale, that of its brightest pixel."""
    weights = np.array([[1.0, -0.5], [0.25, 2.0], [-1.5, 0.75], [0.5, 1.0]], np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["input"], ["xf"], to=TensorProto.FLOAT),
            helper.make_node("Flatten", ["xf"], ["flat"]),
            helper.make_node("MatMul", ["flat", "w"], ["logits"]),
        ],
        "dynamic",
        [helper.make_tensor_value_info("input", TensorProto.UINT8, ["batch", 1, 2, 2])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2])],
        initializer=[onnx.numpy_helper.from_array(weights, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    fp32 = path.with_suffix(".fp32.onnx")
    onnx.save(model, str(fp32))
    ptq.quantize_dynamic_onnx(fp32, path, isa.SCHEMES["vnni"], conv_heavy=False)
    return path


@pytest.mark.parametrize(
    ("target", "conv_heavy", "weights", "why"),
    [
        ("vnni", True, "QUInt8", "uint8 weights: ONNX Runtime's ConvInteger ran"),
        ("avx2", False, "QUInt8", "uint8 weights: without VNNI"),
        ("vnni", False, "QInt8", isa.SCHEMES["vnni"].why),  # the static scheme's, as it is
    ],
)
def test_a_dynamic_models_scheme_says_why_its_weights_have_their_type(
    tmp_path: Path, target: str, conv_heavy: bool, weights: str, why: str
) -> None:
    """The manifest's dynamic entry gave the static scheme's why ("full-range weights are
    exact", of int8 ones) beside its uint8 weights."""
    fp32 = _dynamic_int8(tmp_path / "m.onnx").with_suffix(".fp32.onnx")
    scheme = isa.SCHEMES[target]
    made = ptq.quantize_dynamic_onnx(fp32, tmp_path / "d.onnx", scheme, conv_heavy)
    assert made == weights
    assert ptq.dynamic_weights(scheme, conv_heavy)[1].startswith(why)


def test_accuracy_of_a_dynamic_int8_model_is_the_same_on_any_core_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Served, a long batch runs as one slice per core, and each slice of a dynamic int8 model
    gets its own activation scale: evaluated so, its accuracy, SQNR and agreement would move
    with the core count. Here the dim images are in the first slice, the bright ones in the
    second: two lanes quantize the dim ones finer than one run does."""
    from lightship.runtime import ort as ort_module

    model = _dynamic_int8(tmp_path / "m.onnx")
    x = np.concatenate([np.full((128, 1, 2, 2), 3), np.full((128, 1, 2, 2), 250)])
    x = x.astype(np.uint8) - np.arange(4, dtype=np.uint8).reshape(1, 1, 2, 2)
    served = ort_module.OrtPredictor(model, threads=2)
    assert served.lanes == 2 and served.split_rows <= len(x)  # the server splits this batch
    one_core = ort_module.OrtPredictor(model, threads=1)
    np.testing.assert_array_equal(evaluate.logits(served, x), evaluate.logits(one_core, x))

    y = np.zeros(len(x), np.int64)
    recorded = []  # what quantize records, with one core, then two
    for cores in (1, 2):
        monkeypatch.setattr(ort_module, "physical_cores", lambda cores=cores: cores)
        recorded.append(quantize_core._accuracy(model, x, y)[1])
    np.testing.assert_array_equal(recorded[0], recorded[1])


@pytest.mark.parametrize(
    ("name", "file", "command"),
    [
        ("eager", "best.ckpt", "`make train RESUME=1 RUN={run}`"),
        (
            "torchscript",
            "export/model.ts",
            "`make export RUN={run} EXPORT_ARGS='--formats torchscript'`",
        ),
        ("pt2", "export/model.pt2", "`make export RUN={run} EXPORT_ARGS='--formats pt2'`"),
        ("onnx-fp32", "export/model.onnx", "`make export RUN={run} EXPORT_ARGS='--formats onnx'`"),
        (
            "onnx-int8-dynamic",
            "quantize/model.int8-dynamic.onnx",
            "`make quantize RUN={run} QUANTIZE_ARGS='--methods dynamic'`",
        ),
        (
            "onnx-int8-qat",
            "quantize/model.int8-qat.onnx",
            "`make quantize RUN={run} QUANTIZE_ARGS='--methods qat'`",
        ),
    ],
)
def test_a_variant_changed_after_it_was_recorded_names_the_command_that_remakes_it(
    tmp_path: Path, name: str, file: str, command: str
) -> None:
    from lightship.errors import RunError
    from lightship.runs import RunDir

    run = RunDir(tmp_path / "run")
    (run.root / file).parent.mkdir(parents=True, exist_ok=True)
    (run.root / file).write_bytes(b"edited by hand")
    (run.checkpoints / "last.ckpt").parent.mkdir()
    (run.checkpoints / "last.ckpt").write_bytes(b"")  # trained before: resuming restores it
    run.record(evaluate.MANIFEST_KEY.get(name, name), {"file": file, "sha256": "0" * 64})
    if name == "eager":  # the reference: no report without it
        with pytest.raises(RunError) as err:
            evaluate.candidates(run, threads=1)
        assert str(err.value) == (
            f"{run.root / file} differs from its manifest entry (sha256): it changed after "
            f"`lightship` wrote it; re-run {command.format(run=run.root)}"
        )
        return
    left_out: dict[str, str] = {}  # any other is left out, its fix said
    evaluate.candidates(run, threads=1, left_out=left_out)
    assert left_out == {
        name: f"{file} differs from its manifest entry (sha256): it changed after `lightship` "
        f"wrote it; {command.format(run=run.root)} makes it again"
    }


@pytest.mark.parametrize(
    ("current", "candidate", "warned"),
    [
        ([1000.0] * 4, [1000.0, 1010.0, 990.0, 1005.0], None),
        # every variant of a round slowed alike: the speed-up the choice rests on holds
        ([1000.0, 500.0, 1000.0, 1600.0], [2000.0, 1000.0, 2000.0, 3200.0], None),
        (
            [1000.0] * 4,
            [600.0, 800.0, 1300.0, 1600.0],
            "candidate x current ±31%",
        ),
    ],
)
def test_an_ab_timing_too_noisy_to_trust_is_a_warning(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    current: list[float],
    candidate: list[float],
    warned: str | None,
) -> None:
    from lightship.report.measure import Timing
    from lightship.runs import RunDir

    q = quantize_core.Quantizer.__new__(quantize_core.Quantizer)  # only what the A/B reads
    q.run = RunDir(tmp_path)
    q.methods = ["static", "dynamic"]  # asked for: the command to repeat names them, not QAT
    q.repeat = ["--gate", "0.98"]  # and the options given
    val_x = np.zeros((4, 1, 2, 2), np.uint8)
    q.splits = cast(Splits, SimpleNamespace(val_x=val_x, test_x=np.ones((4, 1, 2, 2), np.uint8)))
    timings = {
        "current": Timing(throughput=[1000.0] * 4),
        "candidate": Timing(throughput=candidate),
    }
    timed: list[np.ndarray] = []

    def measure(predictors: object, images: np.ndarray, **kwargs: object) -> dict[str, Timing]:
        timed.append(images)
        return timings

    monkeypatch.setattr(quantize_core, "measure", measure)
    model = cast(Predictor, _Recording())
    with caplog.at_level(logging.WARNING, "lightship.quantize"):
        before, after = q._time_candidate("first conv in fp32", model, model, latency=False)
    # the validation images, where quantize makes its choices; timed again while the gain
    # may lie either side of 1.05x (the third), and warned of once, on all the rounds
    assert timed and all(images is val_x for images in timed)
    assert before.throughput == timings["current"].throughput * len(timed)
    assert after.throughput == timings["candidate"].throughput * len(timed)
    assert caplog.messages == (
        []
        if warned is None
        else [
            "first conv in fp32: timings are noisy (other processes using over 10% of the CPU, "
            "batch-1 p90 over 3x p50, or the middle half of the rounds over ±20% from their "
            f"median): {warned}. The machine was busy, or its speed moved, "
            "while quantize timed it, so whether it is kept may be wrong: quantize again when "
            f"it is quiet (`{quantize_core._command(q.run, 'quantize', q.methods, q.repeat)}`)"
        ]
    )
    assert warned is None or "--methods static,dynamic --gate 0.98" in caplog.messages[0]


@pytest.mark.parametrize(
    ("gains", "rounds"),
    [
        ([1.2] * 8, 8),  # clear at once
        ([1.0] * 8, 8),
        ([1.0, 1.1] * 4, 32),  # half each side of 1.05x: never clear, 32 rounds at most
        ([1.0] + [1.1] * 15, 16),  # the 4th of 16 over: the median's lower bound
    ],
)
def test_an_ab_near_the_bar_is_timed_again_until_it_is_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gains: list[float], rounds: int
) -> None:
    """One run of 8 rounds measured the first conv's ~1.09x gain at 1.049x, under the bar, and
    quantize recommended another model than the runs before and after."""
    from lightship.report.measure import Timing
    from lightship.runs import RunDir

    q = quantize_core.Quantizer.__new__(quantize_core.Quantizer)
    q.run, q.methods, q.repeat = RunDir(tmp_path), list(quantize_core.METHODS), []
    q.splits = cast(Splits, SimpleNamespace(val_x=np.zeros((4, 1, 2, 2), np.uint8)))
    runs = iter(gains[i : i + 8] for i in range(0, 64, 8))

    def measure(predictors: object, images: np.ndarray, **kwargs: Any) -> dict[str, Timing]:
        assert kwargs["rounds"] == 8
        ratios = next(runs, None) or [1.0, 1.1] * 4
        return {
            "current": Timing(throughput=[1000.0] * len(ratios)),
            "candidate": Timing(throughput=[1000.0 * r for r in ratios]),
        }

    monkeypatch.setattr(quantize_core, "measure", measure)
    model = cast(Predictor, _Recording())
    before, after = q._time_candidate("first conv in fp32", model, model, latency=False)
    assert len(before.throughput) == len(after.throughput) == rounds


def test_an_ab_timing_on_a_busy_machine_is_a_warning_however_steady(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from lightship.report.measure import Timing
    from lightship.runs import RunDir

    q = quantize_core.Quantizer.__new__(quantize_core.Quantizer)
    q.run = RunDir(tmp_path)
    q.methods, q.repeat = list(quantize_core.METHODS), []
    q.splits = cast(Splits, SimpleNamespace(val_x=np.zeros((4, 1, 2, 2), np.uint8)))
    timings = {  # others used 45 % of the machine while either was timed
        "current": Timing(throughput=[1000.0] * 4, others_cpu_s=0.9, machine_cpu_s=2.0),
        "candidate": Timing(throughput=[1500.0] * 4, others_cpu_s=0.9, machine_cpu_s=2.0),
    }
    monkeypatch.setattr(quantize_core, "measure", lambda *args, **kwargs: timings)
    model = cast(Predictor, _Recording())
    with caplog.at_level(logging.WARNING, "lightship.quantize"):
        q._time_candidate("first conv in fp32", model, model, latency=False)
    (message,) = caplog.messages
    assert (
        ": current other processes used 45% of the CPU, candidate other processes used 45% of "
        "the CPU. The machine was busy"
    ) in message


def bare_quantizer(tmp_path: Path) -> quantize_core.Quantizer:
    """A Quantizer of what its choices read: 104 test images of which fp32 gets 100 right, and
    100 validation images of which it gets all."""
    q = quantize_core.Quantizer.__new__(quantize_core.Quantizer)
    q.settings = quantize_core.QuantizeSettings(gate=0.99)
    q.splits = cast(
        Splits,
        SimpleNamespace(
            val_x=np.zeros((100, 1, 2, 2), np.uint8),
            val_y=np.zeros(100, np.int64),
            test_x=np.ones((104, 1, 2, 2), np.uint8),
            test_y=np.ones(104, np.int64),
        ),
    )
    q.fp32_acc = 100 / 104
    q.fp32_logits = np.zeros((104, 2), np.float32)
    q.__dict__["fp32_val_acc"] = 1.0  # the cached property, as fp32 scored
    q.work = tmp_path
    q.fp32 = tmp_path / "model.onnx"
    q.pre_static = tmp_path / "pre-static.onnx"
    q.target, q.scheme = "vnni", isa.SCHEMES["vnni"]
    return q


def test_the_gate_passes_a_variant_exactly_at_it(tmp_path: Path) -> None:
    q = bare_quantizer(tmp_path)
    # 99 of 104 right against fp32's 100 at gate 0.99: in floats 0.95192307692307687 fell
    # short of 0.99 * 0.96153846153846156 = 0.95192307692307698
    assert q._gate(99 / 104) and not q._gate(98 / 104)
    assert q._gate(0.99, "validation") and not q._gate(0.98, "validation")


def split_accuracy(q: quantize_core.Quantizer, val: float, test: float) -> object:
    """`_accuracy` that scores any model `val` on the validation split, `test` on the test."""

    def accuracy(model: object, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
        return (val if y is q.splits.val_y else test), np.zeros((len(y), 2), np.float32)

    return accuracy


def first_conv_ab(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, val: float, test: float, img_per_s: float
) -> tuple[quantize_core.Quantizer, Path]:
    """A quantizer whose thin first conv in fp32 scores `val` on the validation split and
    `test` on the test split, timed at `img_per_s` against 1000 all-int8; and the all-int8
    model's file (`current`), which a kept candidate replaces."""
    from lightship.report.measure import Timing

    q = bare_quantizer(tmp_path)
    current = tmp_path / "current.onnx"
    current.write_bytes(b"all int8")
    monkeypatch.setattr(ptq, "thin_first_conv", lambda model: ["conv0"])
    monkeypatch.setattr(ptq, "copy_metadata", lambda *args: None)
    monkeypatch.setattr(q, "_static", lambda out, scheme, exclude: out.write_bytes(b"fp32 conv"))
    monkeypatch.setattr(quantize_core, "load_predictor", lambda *a, **kw: _Recording())
    monkeypatch.setattr(quantize_core, "_accuracy", split_accuracy(q, val=val, test=test))
    timed = (Timing(throughput=[1000.0] * 4), Timing(throughput=[img_per_s] * 4))
    monkeypatch.setattr(q, "_time_candidate", lambda *args, **kwargs: timed)
    return q, current


def test_the_thin_first_conv_is_kept_on_the_validation_split_not_the_test(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as accurate as fp32 on validation; a test split that would fail the gate decides nothing
    q, current = first_conv_ab(tmp_path, monkeypatch, val=1.0, test=0.5, img_per_s=1200.0)
    speed = q._first_conv_in_fp32(current, [], val_acc=1.0)
    assert speed is not None and speed["kept"] and current.read_bytes() == b"fp32 conv"
    assert speed["accuracy"] == speed["accuracy_all_int8"] == speed["accuracy_fp32"] == 1.0
    assert speed["accuracy_split"] == "validation"


@pytest.mark.parametrize(
    ("val", "after", "why"),
    [
        (0.5, 1200.0, "not kept (validation accuracy 0.5000 fails the gate)"),
        (1.0, 1040.0, "not kept (1.040x is not over 1.05x)"),
    ],
)
def test_a_thin_first_conv_not_kept_says_why(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    val: float,
    after: float,
    why: str,
) -> None:
    # "not kept" alone, of a model 1.2x faster that failed the gate
    q, current = first_conv_ab(tmp_path, monkeypatch, val=val, test=1.0, img_per_s=after)
    with caplog.at_level(logging.INFO, "lightship.quantize.core"):
        speed = q._first_conv_in_fp32(current, [], val_acc=1.0)
    assert speed is not None and not speed["kept"] and current.read_bytes() == b"all int8"
    assert caplog.messages[-1] == (
        f"int8-static's first conv in fp32: {after:.0f} img/s against 1000 all-int8 at batch "
        f"64, {after / 1000:.3f}x within rounds (4): {why}"
    )


def test_the_static_fallback_stops_when_the_validation_split_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback moves nodes to fp32 until the validation accuracy passes the gate; the test
    accuracy, failing here, is what the manifest states and gates, and decided nothing."""
    from lightship.quantize.fallback import NodeError

    q = bare_quantizer(tmp_path)
    recorded: dict[str, dict] = {}
    q.run = cast(
        "quantize_core.RunDir",
        SimpleNamespace(quantize_dir=tmp_path, record=recorded.__setitem__, artifact=recorded.get),
    )
    q.settings = quantize_core.QuantizeSettings(gate=0.99, fallback_budget=3)
    q.calibration, q.flattens_channels_last, q.input_name = {}, [], "input"
    q.__dict__["calib"] = np.zeros((4, 1, 2, 2), np.uint8)
    rounds = iter([0.97, 0.99, 0.995, 1.0])  # validation accuracy, round by round
    monkeypatch.setattr(q, "_val_accuracy", lambda model: next(rounds))
    monkeypatch.setattr(quantize_core, "_accuracy", split_accuracy(q, val=1.0, test=0.5))
    monkeypatch.setattr(q, "_static", lambda out, scheme, exclude: out.write_bytes(b"int8"))
    worst = NodeError("conv1", "Conv", 30.0, 20.0)
    monkeypatch.setattr(quantize_core.fallback, "rank_nodes", lambda *args: [worst])
    monkeypatch.setattr(ptq, "fp32_island", lambda model, node: [node])
    monkeypatch.setattr(q, "_first_conv_in_fp32", lambda *args: None)
    monkeypatch.setattr(q, "_gemm_convs", lambda *args: None)
    monkeypatch.setattr(ptq, "copy_metadata", lambda *args: None)
    monkeypatch.setattr(ptq, "scales_digest", lambda model: "0" * 64)
    monkeypatch.setattr(quantize_core, "int8_share", lambda model: {})
    monkeypatch.setattr(q, "_entry", lambda tmp, final, method, acc: {"accuracy": acc})
    v = q.static()
    kept = v.entry["nodes_fp32_by_fallback"]
    assert [k["accuracy_before"] for k in kept] == [0.97]  # one node, then 0.99 passed
    assert kept[0]["accuracy_split"] == "validation"
    assert v.accuracy == 0.5 and not v.gate_passed  # on test
    assert recorded["onnx-int8-static"]["accuracy"] == 0.5


class _Flat(pl.LightningModule):
    """val_acc 1.0 at every epoch: early stopping's patience runs out after the third."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.net = (
            torch.nn.Identity()
        )  # what FreezeLate looks at: no ExportedNet, nothing to freeze
        self.epochs: list[int] = []

    def training_step(self, batch: list[torch.Tensor], i: int) -> torch.Tensor:
        return (self.w - 1).pow(2).sum()

    def validation_step(self, batch: list[torch.Tensor], i: int) -> None:
        self.log("val_acc", 1.0 if self.current_epoch < 3 else 0.5)  # freezing costs accuracy

    def on_train_epoch_start(self) -> None:
        self.epochs.append(self.current_epoch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("epochs", [4, 6])
def test_qat_early_stopping_runs_the_frozen_epoch_before_it_stops(
    epochs: int, tmp_path: Path
) -> None:
    # A 4-epoch QAT whose val_acc was 1.0 at once stopped after epoch 2, the observers never off;
    # and the best checkpoint, by val_acc, was an epoch from before the freeze
    checkpoint = LatestBestCheckpoint(dirpath=tmp_path, monitor="val_acc", mode="max", save_top_k=1)
    freeze = qat.FreezeLate(epochs - 1, checkpoint)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(2, 1)))
    model = _Flat()
    trainer = pl.Trainer(
        max_epochs=epochs,
        callbacks=[checkpoint, qat.StopAfterFreezing(freeze), freeze],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, loader, loader)
    # patience 2: epochs 0-2 see no improvement after the first; epoch 3 runs frozen, then stop
    assert model.epochs == [0, 1, 2, 3]
    assert freeze.at == 3
    assert Path(checkpoint.best_model_path).name.startswith("epoch=3-"), checkpoint.best_model_path


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_quantize_stopped_names_what_it_kept_the_rest_and_the_report_it_took(
    exported_run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    signal_handlers: None,
    sig: str,
) -> None:
    """Its last line was a bare "interrupted", where the replaced variant had taken the report
    with it: what was kept, and what to run, was left to guess."""
    import os
    import shutil
    import signal

    from lightship import cli
    from lightship.runs import RunDir, stage_command

    run = tmp_path / "run"
    shutil.copytree(exported_run, run)
    rd = RunDir(run)
    rd.record("onnx-int8-dynamic", {"file": "quantize/model.int8-dynamic.onnx", "sha256": "old"})
    (run / "report").mkdir()
    (run / "report" / "report.json").write_text("{}")

    def dynamic(self: quantize_core.Quantizer) -> quantize_core.Variant:  # a new model, kept
        path = run / "quantize" / "model.int8-dynamic.onnx"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"int8")
        self.run.record("onnx-int8-dynamic", {"file": self.run.relative(path), "sha256": "new"})
        return quantize_core.Variant("dynamic", path, 1.0, True)

    def static(self: quantize_core.Quantizer) -> quantize_core.Variant:
        os.kill(os.getpid(), getattr(signal, sig))
        raise AssertionError("not stopped")

    monkeypatch.setattr(quantize_core.Quantizer, "dynamic", dynamic)
    monkeypatch.setattr(quantize_core.Quantizer, "static", static)
    # the options given come again in the command that makes the rest: a QAT model of other
    # settings than the static one beside it would be a mixed run
    given = ["--target", "avx2", "--no-per-channel", "--gate", "0.98", "--qat-epochs", "5"]
    argv = ["quantize", "--run", str(run), "--methods", "dynamic,static,qat", *given]
    assert cli._invoke(argv) == 128 + getattr(signal, sig)
    again = "--methods static,qat " + " ".join(given)
    assert capsys.readouterr().err.splitlines()[-1] == (
        "interrupted: dynamic made and kept; make the rest with `"
        + stage_command(
            f"make quantize RUN={run} QUANTIZE_ARGS='{again}'",
            f"lightship quantize --run {run} {again}",
            run,
        )
        + f"`; {run / 'report'} went with the variants it measured: write it again with `"
        + stage_command(f"make report RUN={run}", f"lightship report --run {run}", run)
        + "`"
    )
    assert rd.artifact("onnx-int8-dynamic") == {
        "file": "quantize/model.int8-dynamic.onnx",
        "sha256": "new",
    }

    # stopped before any method made its model: all of them again, with no --methods
    monkeypatch.setattr(quantize_core.Quantizer, "dynamic", static)
    assert cli._invoke(["quantize", "--run", str(run)]) == 128 + getattr(signal, sig)
    assert capsys.readouterr().err.splitlines()[-1] == (
        "interrupted: quantize again with `"
        + stage_command(f"make quantize RUN={run}", f"lightship quantize --run {run}", run)
        + "`"
    )


@pytest.mark.parametrize(
    ("gate", "guess"),
    [(5, "0.95"), (49, "0.51"), (80, "0.8"), (99, "0.99"), (100, "1"), (101, None)],
)
def test_a_gate_given_in_points_or_percent_gets_its_guess(gate: float, guess: str | None) -> None:
    """From 50 up (to 100) a gate reads as a percentage kept, below as points lost
    (at 50 the two readings agree)."""
    from lightship.quantize import fallback

    with pytest.raises(ConfigError) as err:
        fallback.check_gate(gate, "quantize")
    message = str(err.value)
    if guess is None:
        assert "did you mean" not in message
    else:
        assert message.endswith(f"got {gate:g}: did you mean {guess}?"), message


def test_repeated_options_keep_every_digit_given() -> None:
    # `:g` kept six significant digits: a repeated --qat-lr 0.0001234567 made the rest of a
    # run with 0.000123457, another setting than the models beside it
    settings = quantize_core.QuantizeSettings(qat_lr=0.0001234567, gate=0.995, qat_epochs=5)
    flags = settings.flags()
    assert flags == ["--gate", "0.995", "--qat-epochs", "5", "--qat-lr", "0.0001234567"]
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    assert float(given["--qat-lr"]) == settings.qat_lr and float(given["--gate"]) == 0.995


def test_qat_from_python_imports_torchao_without_its_cuda_noise() -> None:
    """torchao's import logs "Failed to load .../_C_mxfp8...so" on a CPU-only install: the CLI
    muted it, a script calling quantize() printed it. Each import in a fresh interpreter."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    def python(code: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    # the two at once: each is mostly importing torch and torchao (11 s on a 2-core EPYC)
    bare = python("import torchao.quantization.pt2e")
    ours = python(
        "import logging; from lightship.quantize import core; core._import_qat(); "
        "print(logging.getLogger('torchao').level, end='')"
    )
    (_, noise), (out, err) = (proc.communicate(timeout=300) for proc in (bare, ours))
    assert bare.returncode == 0 and ours.returncode == 0, (noise, err)
    if "Failed to load" not in noise:
        pytest.skip("this torchao install loads its kernels: nothing to mute")
    assert err == ""
    assert out == "0"  # the caller's logging as it was


@pytest.mark.parametrize("conv", ["conv2d", "none"])
def test_qat_tries_torchaos_conv_batch_norm_patterns_only_for_the_convs_in_the_model(
    monkeypatch: pytest.MonkeyPatch, conv: str
) -> None:
    """torchao's fold of batch norm into conv (in `convert_pt2e`; the fuse in prepare alike)
    exports the pattern graphs of four convs, 96 `torch.export`s: 30 s of a 58 s QAT of the
    tiny CNN. Only the model's own conv is tried; a graph with none of the four gets all."""
    import torch.nn.functional as F
    from torchao.quantization.pt2e import qat_utils

    tried: list[tuple[str, bool]] = []

    def helper(m: torch.fx.GraphModule, conv_fn: object, inputs: object, is_cuda: bool) -> object:
        tried.append((getattr(conv_fn, "__name__", ""), is_cuda))
        return m

    monkeypatch.setattr(qat_utils, "_fold_conv_bn_qat_helper", helper)
    monkeypatch.setattr(qat_utils, "_fuse_conv_bn_qat_helper", helper)
    first = torch.nn.Conv2d(1, 4, 3) if conv == "conv2d" else torch.nn.Flatten(0, 0)
    model = torch.nn.Sequential(first, torch.nn.BatchNorm2d(4 if conv == "conv2d" else 1)).train()
    graph = torch.export.export(model, (torch.randn(2, 1, 5, 5),)).module()
    cudas = [True, False] if torch.cuda.is_available() else [False]
    for rewrite in (qat_utils._fold_conv_bn_qat, qat_utils._fuse_conv_bn_qat):
        tried.clear()
        with qat._conv_bn_patterns_present():
            rewrite(graph)
        if conv == "conv2d":
            assert tried == [("conv2d", cuda) for cuda in cudas]
        else:
            convs = [F.conv1d, F.conv2d, F.conv_transpose1d, F.conv_transpose2d]
            assert tried == [(f.__name__, cuda) for cuda in cudas for f in convs]
    # and torchao's own helpers are back
    assert qat_utils._fold_conv_bn_qat_helper is helper


def test_qat_loads_its_data_as_the_run_trained(tiny_run: Path, tmp_path: Path) -> None:
    """QAT fine-tuned in DataConfig's batches of 64 whatever the run trained with (tiny.yaml:
    128; a batch lowered to fit memory), over the checkpoint's split."""
    import shutil

    from lightship.data import DataSpec
    from lightship.runs import RunDir

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    entry = RunDir(run).artifact("checkpoint")
    assert entry is not None
    spec = DataSpec.from_dict(entry["data_spec"])
    dm = qat._data_module(spec, RunDir(run))
    assert (dm.cfg.batch_size, dm.cfg.image_size) == (128, 16)  # tiny.yaml's
    (run / "config.yaml").unlink()
    assert qat._data_module(spec, RunDir(run)).cfg.batch_size == 64  # the default, without it


class _Random(torch.nn.Module):
    """A linear layer, then `how` in training mode: a way to draw random numbers (or not)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.linear, self.how = torch.nn.Linear(4, 4), how
        self.layer = {
            "dropout2d": torch.nn.Dropout2d(0.1),
            "alpha": torch.nn.AlphaDropout(0.1),
            "rrelu": torch.nn.RReLU(),
            "dropout": torch.nn.Dropout(0.1),
        }.get(how, torch.nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer(self.linear(x))
        if self.how in ("drop path", "gated drop path"):
            if self.how == "drop path" or not torch.compiler.is_exporting():
                x = x * x.new_empty(x.shape[0], 1).bernoulli_(0.9) / 0.9  # timm's drop path
        elif self.how.startswith("attention"):
            q = x.view(x.shape[0], 1, 2, 2)
            p = 0.1 if self.how == "attention dropout" else 0.0
            x = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=p).flatten(1)
        elif self.how == "noise under no_grad":
            with torch.no_grad():
                noise = torch.randn_like(x)
            x = x + noise
        return x


@pytest.mark.parametrize(
    ("how", "drawn"),
    [
        ("drop path", "aten.bernoulli_.float"),
        ("dropout2d", "aten.feature_dropout.default"),
        ("alpha", "aten.alpha_dropout.default"),
        ("rrelu", "aten.rrelu.default"),
        ("attention dropout", "aten.scaled_dot_product_attention.default"),
        ("noise under no_grad", "aten.randn_like.default"),  # in a submodule's graph
        ("dropout", None),  # nn.Dropout: turned off for the QAT model
        ("gated drop path", None),  # as the refusal says to
        ("attention", None),
    ],
)
def test_qat_refuses_a_model_that_draws_random_numbers_with_what_to_do(
    how: str, drawn: str | None
) -> None:
    """Its drop path was captured in training mode and stayed in the int8 model: QAT failed
    on "disagrees with torch: argmax agreement 187/269", which named no cause. So did any
    dropout but nn.Dropout's, which `move_exported_model_to_eval` leaves on."""
    from lightship.quantize import qat
    from lightship.quantize.core import MethodFailed

    batch = torch.export.Dim("batch")
    model = _Random(how).train()
    gm = torch.export.export(model, (torch.randn(2, 4),), dynamic_shapes=({0: batch},))
    if drawn is None:
        qat._refuse_random_ops(gm.graph_module, "mine")
        return
    with pytest.raises(MethodFailed) as err:
        qat._refuse_random_ops(gm.graph_module, "mine")
    assert str(err.value) == (
        f"QAT failed (model 'mine' draws random numbers in training mode ({drawn}: stochastic "
        "depth, drop path or a dropout other than nn.Dropout, most likely), which the QAT "
        "model would keep: have it skip them while torch.compiler.is_exporting() is true); "
        "quantize this model with `--methods static,dynamic` instead"
    )


def test_orts_word_on_each_1d_weight_quantized_per_tensor_is_not_passed_on() -> None:
    """A LayerNorm's scale under per-channel static int8: ORT warned "Axis 1 is out-of-range
    for weight ... with rank 1" (5 lines for a small ViT) in its own format, and quantizes it
    per tensor, as it should."""
    from lightship.quantize import ptq

    def passes(message: str) -> bool:
        record = logging.LogRecord("root", logging.WARNING, __file__, 1, message, None, None)
        return ptq._OnceEach().filter(record)

    assert not passes("Axis 1 is out-of-range for weight 'net.blocks.0.n1.weight' with rank 1")
    assert passes("Axis 1 is out-of-range for weight 'w' with rank 0")  # only the 1-D case
    assert passes("some other warning")


def test_a_share_is_not_rounded_to_all_or_none() -> None:
    """A dynamic variant's reason said "100% of multiply-adds are in convolutions" of a model
    whose manifest recorded 0.99922."""
    from lightship.quantize.core import _share

    said = [_share(f) for f in (0.99922, 1.0, 0.0, 0.875, 0.004, 0.1)]
    assert said == ["99.9%", "100%", "0%", "88%", "0.4%", "10%"]


def test_more_calibration_samples_than_training_images_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from lightship.data import load_splits
    from lightship.data.sources import DataSpec
    from lightship.quantize.core import calibration_images

    splits = load_splits(DataSpec(image_size=8))
    with caplog.at_level("WARNING", logger="lightship.quantize.core"):
        images = calibration_images(splits, 5000, seed=0)
    assert len(images) == len(splits.train_x) == 1259
    assert caplog.messages == [
        "--calibration-samples 5000: the training split has 1259 images, all of them used"
    ]


@pytest.mark.parametrize(
    ("n", "chunk", "calls"),
    [
        (40, 64, [(0, 32), (32, 40)]),  # the report said 40 held at once: 32 were
        (256, 50, [(i, i + 32) for i in range(0, 256, 32)]),  # 50 said, 32 held
        (256, 100, [(0, 96), (96, 192), (192, 256)]),
        (16, 64, [(0, 16)]),
        (20, 8, [(0, 8), (8, 16), (16, 20)]),
    ],
)
def test_calibration_passes_hold_whole_batches_and_the_most_held_is_recorded(
    n: int, chunk: int, calls: list[tuple[int, int]]
) -> None:
    from lightship.quantize.ptq import calibration_calls

    assert calibration_calls(n, chunk=chunk) == calls


def _two_matmuls(path: Path, w1: float, clip_scale: float | None) -> Path:
    """x -> MatMul(w1 * I) -> Relu -> Add(x) -> [Q/DQ at `clip_scale`] -> MatMul(ones) -> y.

    Tensor names differ between the two models, as Q/DQ insertion renames them; node names
    match, as ORT keeps them."""
    tag = "f" if clip_scale is None else "q"
    into = f"s_{tag}"
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], [f"h_{tag}"], name="mm1"),
        helper.make_node("Relu", [f"h_{tag}"], [f"r_{tag}"], name="relu"),
        helper.make_node("Add", [f"r_{tag}", "x"], [f"s_{tag}"], name="add"),
    ]
    inits = [
        helper.make_tensor("w1", TensorProto.FLOAT, [4, 4], (w1 * np.eye(4)).ravel().tolist()),
        helper.make_tensor("w2", TensorProto.FLOAT, [4, 1], [1.0] * 4),
    ]
    if clip_scale is not None:  # uint8 from 0: clips the sum at 255 x scale
        into = "s_dq"
        nodes += [
            helper.make_node("QuantizeLinear", ["s_q", "sc", "zp"], ["s_int"], name="q"),
            helper.make_node("DequantizeLinear", ["s_int", "sc", "zp"], ["s_dq"], name="dq"),
        ]
        inits += [
            helper.make_tensor("sc", TensorProto.FLOAT, [], [clip_scale]),
            helper.make_tensor("zp", TensorProto.UINT8, [], [0]),
        ]
    nodes.append(helper.make_node("MatMul", [into, "w2"], ["y"], name="mm2"))
    graph = helper.make_graph(
        nodes,
        "two",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    onnx.save(model, str(path))
    return path


def test_the_fallback_charges_a_clipping_q_dq_to_the_node_reading_it(tmp_path: Path) -> None:
    """Keeping a node in fp32 takes out the Q/DQ on its input too: a node reading a clipped
    activation is the one to keep, though its own input-to-output loss is nil. Measured from
    its already-clipped input, the clip was charged to no node and the first MatMul (1 % off
    in its weights, an exact input) ranked first."""
    from lightship.quantize import fallback

    fp32 = _two_matmuls(tmp_path / "fp32.onnx", w1=1.0, clip_scale=None)
    int8 = _two_matmuls(tmp_path / "int8.onnx", w1=1.01, clip_scale=0.01)  # clips at 2.55
    x = np.random.default_rng(0).uniform(0, 2, (64, 4)).astype(np.float32)
    ranked = fallback.rank_nodes(fp32, int8, x, input_name="x")
    assert [e.node for e in ranked] == ["mm2", "mm1"]
    # by hand: mm1 is 1 % off an exact input; mm2 reads (1.01 x + x) clipped at 2.55
    h = x.astype(np.float64)
    s_ref, s_q = 2 * h, np.clip(np.round(2.01 * h / 0.01), 0, 255) * 0.01
    sqnr_h = 10 * np.log10(np.sum(h**2) / np.sum((0.01 * h) ** 2))  # 40 dB
    y_ref, y_q = s_ref.sum(1), s_q.sum(1)
    sqnr_y = 10 * np.log10(np.sum(y_ref**2) / np.sum((y_ref - y_q) ** 2))
    mm2, mm1 = ranked
    assert mm1.sqnr_in_db == fallback.SQNR_CAP_DB and mm1.sqnr_out_db == pytest.approx(40, abs=0.01)
    assert mm2.sqnr_in_db == pytest.approx(sqnr_h, abs=0.01)  # fed by mm1, through Relu and Add
    assert mm2.sqnr_out_db == pytest.approx(sqnr_y, abs=0.01)
    assert mm2.noise_added == pytest.approx(10 ** (-sqnr_y / 10) - 1e-4, rel=1e-3)
    assert mm2.as_dict()["noise_added"] == float(f"{mm2.noise_added:.3g}")
    # a node already in fp32 is not ranked, but still feeds the others
    (only,) = fallback.rank_nodes(fp32, int8, x, input_name="x", excluded=frozenset({"mm1"}))
    assert only.node == "mm2" and only.sqnr_in_db == pytest.approx(sqnr_h, abs=0.01)


def test_the_walk_back_follows_a_matmuls_activation_in_either_input() -> None:
    """`W @ x`: a MatMul's activation may be its second input; followed from the first alone,
    the node was taken to read the model's exact input and charged all the noise before it."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Transpose", ["h"], ["t"], name="tr", perm=[1, 0]),
        helper.make_node("MatMul", ["w2", "t"], ["y"], name="mm2"),
    ]
    eye = np.eye(4).ravel().tolist()
    graph = helper.make_graph(
        nodes,
        "w_at_x",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, "n"])],
        initializer=[helper.make_tensor(w, TensorProto.FLOAT, [4, 4], eye) for w in ("w1", "w2")],
    )
    assert ptq.walk_back(graph, nodes[2]) == (["tr"], ["mm1"])
    assert ptq.walk_back(graph, nodes[0]) == ([], [])  # the model's input, weights: no nodes
