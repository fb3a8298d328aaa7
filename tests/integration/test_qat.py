"""Quantization-aware training (PT2E) on the tiny run: the variant, where it matters, and
models it cannot handle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import numpy_helper

from lightship.data import DataSpec, load_splits
from lightship.errors import LightshipError, QuantizeError, RunError
from lightship.export.core import export
from lightship.quantize import isa
from lightship.quantize.core import QuantizeSettings, quantize
from lightship.quantize.qat import qat_config, quantize_aware_train
from lightship.runs import RunDir
from lightship.runtime import load_predictor
from tests.conftest import CONFIGS, last_line, rerecord_checkpoint, run_cli
from tests.qat_models import outlier_channel


def entries(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())["artifacts"]


def no_leftovers(run: Path) -> None:
    assert not list(run.glob(".qat.*")) and not list(run.glob(".quantize.*"))
    assert not list((run / "quantize").glob(".*"))


def int8_weights(path: Path) -> list[np.ndarray]:
    """The int8 tensors DequantizeLinear reads from initializers (the quantized weights)."""
    graph = onnx.load(str(path)).graph
    inits = {i.name: i for i in graph.initializer}
    return [
        numpy_helper.to_array(inits[n.input[0]])
        for n in graph.node
        if n.op_type == "DequantizeLinear"
        and n.input[0] in inits
        and inits[n.input[0]].data_type == onnx.TensorProto.INT8
    ]


def test_qat_config_follows_the_target() -> None:
    avx2 = qat_config(isa.SCHEMES["avx2"]).weight
    vnni = qat_config(isa.SCHEMES["vnni"], per_channel=False).weight
    assert avx2 is not None and vnni is not None
    assert (avx2.quant_min, avx2.quant_max, avx2.qscheme) == (-64, 63, torch.per_channel_symmetric)
    assert (vnni.quant_min, vnni.quant_max, vnni.qscheme) == (-127, 127, torch.per_tensor_symmetric)


def test_qat_variant_through_the_cli(exported_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "tiny"
    shutil.copytree(exported_run, run)
    proc = run_cli(
        "quantize", "--run", str(run), "--methods", "qat", "--target", "avx2", check=True
    )
    assert "int8-qat" in proc.stdout
    e = entries(run)
    v, fp32 = e["onnx-int8-qat"], e["onnx-fp32"]
    path = run / v["file"]
    assert v["file"] == "quantize/model.int8-qat.onnx" and path.is_file()
    assert v["quantization"] == "qat" and v["target"] == "avx2"
    # ORT runs it in int8: every conv and the classifier head after graph optimisation, but
    # the thin 1-channel first conv, which stays float (its batch norm folded) as in static PTQ
    assert v["first_conv_fp32"] is True
    assert set(v["int8_ops"]["int8_op_types"]) == {"QLinearConv", "QGemm"}
    assert v["int8_ops"]["float_nodes"] == 1
    # 7-bit weights for AVX2 (u8 x s8 pair sums must not saturate in int16)
    weights = int8_weights(path)
    assert weights and all(w.min() >= -64 and w.max() <= 63 for w in weights)
    assert v["scheme"]["weight_range"] == [-64, 63] and v["per_channel"] is True
    parity = v["parity"]
    assert parity["argmax_agreement"] >= 0.995 and 0 <= parity["max_abs_logit_diff"] < 1.0
    x = load_splits(DataSpec.from_dict(e["checkpoint"]["data_spec"])).test_x
    assert parity["samples"] == len(x)
    # float logits from the int8 head, as static PTQ's: the Gemm feeds the output directly
    # (no QuantizeLinear -> DequantizeLinear) and ORT runs it as QGemm with an int32 bias
    graph = onnx.load(str(path)).graph
    producer = {o: n for n in graph.node for o in n.output}
    head = producer[graph.output[0].name]
    assert head.op_type == "Gemm"
    bias = producer[head.input[2]]
    assert bias.op_type == "DequantizeLinear"
    assert {t.name: t.data_type for t in graph.initializer}[bias.input[0]] == onnx.TensorProto.INT32
    assert len(np.unique(load_predictor(path).predict(x))) > 256  # quantized: <= 256 values
    # flattened channels-last, as static int8: ORT transposes once, into the first int8 conv
    (flatten,) = v["flattens_channels_last"]
    assert flatten.startswith("node_Reshape"), flatten
    so = onnxruntime.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    onnxruntime.InferenceSession(str(path), so)
    ops = [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]
    assert ops.count("Transpose") == 1 and ops.index("Transpose") < ops.index("QLinearConv")
    # the classifier's input keeps the last pool's scale, as static's: no requantizing in between
    assert "DequantizeLinear" not in ops and ops[ops.index("QGemm") - 1] == "Reshape", ops
    assert 1 <= v["epochs"] <= 3 and v["lr"] == 1e-4 and v["fine_tune_seconds"] > 0
    assert v["accuracy"] >= 0.99 * v["fp32_accuracy"] and v["gate"]["passed"]
    assert abs(v["fake_quant_accuracy"] - v["accuracy"]) <= 0.02
    # a lone file serves: labels, input spec and the scheme travel in its metadata
    p = load_predictor(path)
    assert p.labels == fp32["labels"] and p.chw == (1, 16, 16)
    meta = {m.key: m.value for m in onnx.load(str(path)).metadata_props}
    assert meta["lightship.quantization"] == "qat" and meta["lightship.reduce_range"] == "true"
    assert meta["lightship.ort.disabled_optimizers"] == "QDQPropagationTransformer"
    ckpt = torch.load(run / v["file_ckpt"], weights_only=True)
    assert ckpt["hyper_parameters"]["source"]["labels"] == fp32["labels"]
    assert ckpt["hyper_parameters"]["qat"]["weight_range"] == [-64, 63]
    no_leftovers(run)


def test_qat_recovers_where_static_per_tensor_fails(exported_run: Path, tmp_path: Path) -> None:
    """A dead filter with exploded weights: harmless in fp32, but one per-tensor weight scale
    must span it and the live filters, which then round to a few levels. Static int8 fails
    the gate; QAT with the same per-tensor scheme fine-tunes the live filters around it."""
    run = tmp_path / "outlier"
    shutil.copytree(exported_run, run)
    outlier_channel(run / "best.ckpt", factor=64, channel=0, block=2)
    rerecord_checkpoint(run)
    # what training measured is not this edited model's (off by 4 images at one seed)
    entry = RunDir(run).artifact("checkpoint") or {}
    RunDir(run).record("checkpoint", {k: v for k, v in entry.items() if k != "test_acc"})
    export(RunDir(run), "onnx")
    per_tensor = QuantizeSettings(per_channel=False, fallback_budget=0)
    (static,) = quantize(RunDir(run), "static", target="avx2", settings=per_tensor)
    fp32 = static.entry["fp32_accuracy"]
    assert not static.gate_passed, (static.accuracy, fp32)
    (per_channel,) = quantize(
        RunDir(run), "static", target="avx2", settings=QuantizeSettings(fallback_budget=0)
    )
    assert per_channel.gate_passed  # per-channel scales isolate the outlier filter
    out = run / "quantize" / "model.int8-qat.onnx"
    # 1e-3, not the default 1e-4: the live filters must move by a few coarse weight steps
    info = quantize_aware_train(
        RunDir(run), isa.SCHEMES["avx2"], out, epochs=3, lr=1e-3, seed=0, per_channel=False
    )
    x, y = held_out(run)
    acc = float(np.mean(load_predictor(out).predict(x).argmax(1) == y))
    print(
        f"fp32 {fp32:.4f}, static per-tensor {static.accuracy:.4f}, per-channel "
        f"{per_channel.accuracy:.4f}, QAT per-tensor {acc:.4f}"
    )
    assert acc >= 0.99 * fp32 and acc > static.accuracy + 0.03, (acc, fp32, static.accuracy)
    assert info["per_channel"] is False and info["parity"]["argmax_agreement"] >= 0.995


def held_out(run: Path) -> tuple[np.ndarray, np.ndarray]:
    s = load_splits(DataSpec.from_dict(entries(run)["checkpoint"]["data_spec"]))
    return s.test_x, s.test_y


def test_a_model_qat_cannot_export(tmp_path: Path) -> None:
    run = tmp_path / "guarded"
    run_cli(
        "train",
        "--run",
        str(run),
        "--config",
        str(CONFIGS / "tiny.yaml"),
        "--set",
        "model.name=tests.qat_models:Guarded",
        "--set",
        "model.kwargs={}",
        "--set",
        "trainer.max_epochs=1",
        check=True,
    )
    export(RunDir(run), "onnx")
    errors: dict[str, LightshipError] = {}
    variants = quantize(
        RunDir(run),
        "static,dynamic,qat",
        settings=QuantizeSettings(calibration_samples=64),
        on_error=errors.__setitem__,
    )
    assert [v.method for v in variants] == ["static", "dynamic"]
    assert all(v.path.is_file() for v in variants)
    message = str(errors["qat"])
    assert isinstance(errors["qat"], QuantizeError) and "\n" not in message
    assert "torch.export" in message and "--methods static,dynamic" in message
    assert "onnx-int8-qat" not in entries(run)
    assert not (run / "quantize" / "model.int8-qat.onnx").exists()
    assert not (run / "quantize" / "qat.ckpt").exists()
    no_leftovers(run)

    # QAT alone, and it fails: nothing made, exit 6
    proc = run_cli("quantize", "--run", str(run), "--methods", "qat")
    assert proc.returncode == 6, proc.stderr
    assert last_line(proc.stderr) == (
        "error: no int8 variant was made: qat failed (see above); fix that or choose other "
        "--methods"
    )
    assert "error: qat: " in proc.stderr and "still produced" not in proc.stderr
    assert "next:" not in proc.stdout

    # dynamic made, QAT not: the run goes on to the report (exit 0), so no `error:` line
    proc = run_cli("quantize", "--run", str(run), "--methods", "dynamic,qat")
    assert proc.returncode == 0, proc.stderr
    assert "error:" not in proc.stderr and "int8-dynamic" in proc.stdout
    line = last_line(proc.stderr)
    assert line.startswith(
        "warning: qat failed (cannot trace model 'tests.qat_models:Guarded' with torch.export: "
    )
    assert line.endswith(
        "): quantize this model with `--methods static,dynamic` instead "
        "(the other variants are still produced)"
    )
    # torch.export's partial graph (tens of lines) and its symbolic_shapes warning go to
    # `--verbose` only, as export's do
    assert "def forward(" not in proc.stdout + proc.stderr
    assert "symbolic_shapes" not in proc.stderr


def test_folding_a_thin_first_conv_keeps_the_function_and_skips_wide_ones() -> None:
    from lightship.models import zoo
    from lightship.quantize.qat import fold_thin_first_conv

    torch.manual_seed(0)
    thin = zoo.DigitsCNN(stages=((8,), (16,))).eval()
    for m in thin.modules():  # non-trivial batch-norm statistics
        if isinstance(m, torch.nn.BatchNorm2d):
            assert m.running_mean is not None and m.running_var is not None
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    x = torch.randn(4, 1, 28, 28)
    before = thin(x)
    assert fold_thin_first_conv(thin) is True
    assert isinstance(thin.get_submodule("0.1"), torch.nn.Identity)  # its batch norm is gone ...
    torch.testing.assert_close(thin(x), before, rtol=1e-4, atol=1e-4)  # ... into the conv
    wide = zoo.DigitsCNN(in_channels=4, stages=((8,), (16,)))
    assert fold_thin_first_conv(wide) is False  # 4x3x3 = 36 inputs per output: not thin


def test_qat_resnet_runs_every_conv_in_int8_in_onnxruntime(tmp_path: Path) -> None:
    """Residual blocks: a ReLU module called twice per block made PT2E refuse ResNet ("Input
    partition has more than one output node"), and the x86 quantizer leaves the conv before
    each residual add with a float output, which ORT then runs as an fp32 conv. Both fixed:
    prepared, fine-tuned a few steps, converted and exported, every conv is QLinearConv and
    ORT agrees with the converted torch model."""
    from types import SimpleNamespace

    from torchao.quantization.pt2e import move_exported_model_to_eval

    from lightship import models
    from lightship.quantize.core import int8_share
    from lightship.quantize.qat import convert, export_onnx, prepare

    torch.manual_seed(0)
    spec = {"name": "resnet", "kwargs": {"width": 8, "blocks": [1, 1]}, "in_channels": 3}
    spec |= {"num_classes": 10, "image_size": 16, "mean": [128.0] * 3, "std": [64.0] * 3}
    net = models.create(spec)
    loaded = SimpleNamespace(model_spec={"name": "resnet"}, model=net)
    x = torch.randint(0, 256, (16, 3, 16, 16), dtype=torch.uint8)
    prepared = prepare(loaded, x[:2], isa.SCHEMES["avx2"], per_channel=True)  # type: ignore[arg-type]
    opt = torch.optim.SGD(prepared.parameters(), lr=0.01)
    for _ in range(3):  # fake-quant training steps: observers see data, gradients flow
        loss = prepared(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    move_exported_model_to_eval(prepared)
    converted = convert(prepared)
    path = tmp_path / "qat.onnx"
    export_onnx(converted, x[:2], path)

    share = int8_share(path)
    # stem (fp32: thin), 2 blocks x 2 convs, 1 projection shortcut, the classifier
    assert share["int8_nodes"] == 6 and share["float_nodes"] == 1, share
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with torch.inference_mode():
        want = converted(x).numpy()
    np.testing.assert_array_equal(got.argmax(1), want.argmax(1))
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


def test_a_library_error_inside_qat_costs_only_the_qat_variant(
    exported_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightship.quantize.qat as qat_module

    def broken(*args: object, **kwargs: object) -> dict:
        raise RuntimeError("expected scalar type Float but found Long\nat some deep frame")

    monkeypatch.setattr(qat_module, "quantize_aware_train", broken)
    run = tmp_path / "broken"
    shutil.copytree(exported_run, run)
    errors: dict[str, LightshipError] = {}
    variants = quantize(RunDir(run), "dynamic,qat", on_error=errors.__setitem__)
    assert [v.method for v in variants] == ["dynamic"] and variants[0].path.is_file()
    message = str(errors["qat"])
    assert isinstance(errors["qat"], QuantizeError) and "\n" not in message
    assert "RuntimeError: expected scalar type Float" in message
    assert "--methods static,dynamic" in message
    # from Python without on_error, a quantize that made nothing raises: it returned []
    with pytest.raises(QuantizeError, match="RuntimeError: expected scalar type Float"):
        quantize(RunDir(run), "qat")


def test_qat_without_best_ckpt_says_how_to_get_it_back(exported_run: Path, tmp_path: Path) -> None:
    """No best.ckpt is the user's to fix, with the run's own command: not a "QAT failed" whose
    advice is to leave QAT out, and said before the other methods spend their minutes."""
    run = tmp_path / "no_ckpt"
    shutil.copytree(exported_run, run)
    (run / "best.ckpt").unlink()
    proc = run_cli("quantize", "--run", str(run), "--methods", "dynamic,qat")
    assert proc.returncode == 4, proc.stderr
    assert last_line(proc.stderr) == (
        f"error: no best.ckpt in {run}: run `make train RESUME=1 RUN={run}` first, "
        "or quantize without QAT: --methods dynamic"
    )
    assert "QAT failed" not in proc.stderr and "next:" not in proc.stdout
    assert not (run / "quantize").exists() or not list((run / "quantize").iterdir())
    no_leftovers(run)


def test_qat_of_a_model_this_shell_cannot_import_is_said_before_the_other_methods(
    exported_run: Path, tmp_path: Path
) -> None:
    """A user model's run quantized without its PYTHONPATH: QAT cannot build the model, which
    used to be found after static and dynamic had spent their minutes."""
    run = tmp_path / "elsewhere"
    shutil.copytree(exported_run, run)
    manifest = json.loads((run / "manifest.json").read_text())
    gone = tmp_path / "gone" / "lightship_gone_model.py"
    manifest["artifacts"]["checkpoint"]["model"] = {
        "name": "lightship_gone_model:Net",
        "module_file": str(gone),
    }
    (run / "manifest.json").write_text(json.dumps(manifest))
    proc = run_cli("quantize", "--run", str(run), "--methods", "dynamic,qat")
    assert proc.returncode == 4, proc.stderr
    assert last_line(proc.stderr) == (
        f"error: checkpoint {run}/best.ckpt: model 'lightship_gone_model:Net': cannot import "
        "lightship_gone_model (No module named 'lightship_gone_model'): install it, or run "
        "with PYTHONPATH=<folder of lightship_gone_model.py>, or quantize without QAT: "
        "--methods dynamic"
    )
    assert not (run / "quantize").exists() or not list((run / "quantize").iterdir())
    no_leftovers(run)


def test_a_run_error_inside_qat_keeps_its_own_fix(
    exported_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightship.quantize.qat as qat_module

    refused = RunError("checkpoint best.ckpt is corrupt: delete it and train again")

    def corrupt(*args: object, **kwargs: object) -> dict:
        raise refused

    monkeypatch.setattr(qat_module, "quantize_aware_train", corrupt)
    run = tmp_path / "corrupt"
    shutil.copytree(exported_run, run)
    with pytest.raises(RunError) as err:
        quantize(RunDir(run), "qat", on_error=lambda method, exc: pytest.fail(f"{method}: {exc}"))
    assert err.value is refused
    no_leftovers(run)
