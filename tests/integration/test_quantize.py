"""PTQ, the accuracy gate with its fallback, and the report, on the tiny run (seconds)."""

from __future__ import annotations

import json
import logging
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import onnx
import onnxruntime
import pytest

from lightship.data import DataSpec, load_splits
from lightship.errors import DataError, RunError
from lightship.quantize.core import (
    Quantizer,
    QuantizeSettings,
    _command,
    int8_share,
    quantize,
)
from lightship.quantize.fallback import passes_gate
from lightship.report import ReportSettings, report
from lightship.report.evaluate import logits
from lightship.runs import RunDir, sha256_file
from lightship.runtime import load_predictor
from lightship.runtime.ort import DISABLED_OPTIMIZERS, file_metadata
from tests.conftest import ROOT, last_line, run_cli

FAST = ReportSettings(rounds=2, seconds=0.05, batch=16)


@pytest.fixture(scope="module")
def quantized(exported_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("quantized") / "tiny"
    shutil.copytree(exported_run, run)
    proc = run_cli("quantize", "--run", str(run), "--methods", "static,dynamic", check=True)
    assert "next: make report" in proc.stdout
    return run


def entries(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())["artifacts"]


def test_static_and_dynamic_variants_are_recorded(quantized: Path) -> None:
    e = entries(quantized)
    fp32 = e["onnx-fp32"]
    for key, name in [("onnx-int8-static", "static"), ("onnx-int8-dynamic", "dynamic")]:
        v = e[key]
        path = quantized / v["file"]
        assert v["file"] == f"quantize/model.int8-{name}.onnx" and path.is_file()
        assert v["source_sha256"] == fp32["sha256"] and v["bytes"] == path.stat().st_size
        assert v["target"] == "avx2" or v["target"] in ("vnni", "arm64")  # this host's scheme
        assert v["scheme"]["reduce_range"] == (v["target"] == "avx2")
        assert v["cpu"]["model"] and v["fp32_accuracy"] > 0.5
        p = load_predictor(path)  # metadata carried into the quantized file
        assert p.labels == fp32["labels"] and p.chw == (1, 16, 16)
    static = e["onnx-int8-static"]
    assert static["gate"]["passed"] and static["accuracy"] >= 0.99 * static["fp32_accuracy"]
    assert "QLinearConv" in static["int8_ops"]["int8_op_types"]
    # The tiny model's first conv (1 channel, 3x3) is thin: measured both ways, kept if faster
    # and no less accurate than the all-int8 model or fp32, whichever is lower, on the
    # validation split (the test split's accuracy, which the entry states, decides nothing).
    speed = static["first_conv_fp32"]
    assert speed["island"][0].startswith("node_Conv") and speed["batch"] == 64
    assert set(speed["img_per_s"]) == {"all_int8", "first_conv_fp32"}
    assert speed["accuracy_split"] == "validation"
    splits = load_splits(DataSpec.from_dict(RunDir(quantized).data_spec()), recorded=True)

    def accuracy(file: str, x: np.ndarray, y: np.ndarray) -> float:
        return float(np.mean(logits(load_predictor(quantized / file), x).argmax(1) == y))

    assert speed["accuracy_fp32"] == accuracy("export/model.onnx", splits.val_x, splits.val_y)
    accurate = speed["accuracy"] >= min(speed["accuracy_all_int8"], speed["accuracy_fp32"])
    passes = passes_gate(speed["accuracy"], speed["accuracy_fp32"], 0.99, len(splits.val_y))
    assert speed["kept"] == (speed["speedup"] > 1.05 and accurate and passes)
    assert static["accuracy"] == accuracy(static["file"], splits.test_x, splits.test_y)
    assert static["int8_ops"]["float_nodes"] == (1 if speed["kept"] else 0)
    meta = onnxruntime.InferenceSession(str(quantized / static["file"])).get_modelmeta()
    skipped = meta.custom_metadata_map.get("lightship.ort.disabled_optimizers")
    assert skipped == ("QDQPropagationTransformer" if speed["kept"] else None)
    cal = static["calibration"]
    assert cal["samples"] == 256 and cal["method"] == "minmax" and len(cal["scales_sha256"]) == 64
    assert "peak_rss_mb" not in cal  # named for its unit: VmHWM's KiB / 1024
    assert cal["peak_rss_mib"] is None or cal["peak_rss_mib"] > 10
    check = static["scheme_check"]
    assert {check["chosen"]["target"], check["alternative"]["target"]} <= {"avx2", "vnni"}
    dyn = e["onnx-int8-dynamic"]
    assert dyn["flop_share"]["conv"] > 0.9 and dyn["recommendable"] is False
    assert "ConvInteger" in dyn["int8_ops"]["int8_op_types"]
    # conv-heavy: uint8 weights, ConvInteger's faster path on every x86 CPU we measured
    graph = onnx.load(str(quantized / dyn["file"])).graph
    weights = {t.name: t.data_type for t in graph.initializer}
    convs = [n for n in graph.node if n.op_type == "ConvInteger"]
    assert convs and all(weights[n.input[1]] == onnx.TensorProto.UINT8 for n in convs)
    # and the manifest says so (it said the target's static scheme: QInt8 on VNNI)
    assert (dyn["scheme"]["weight_type"], dyn["scheme"]["activation_type"]) == ("QUInt8", "QUInt8")
    assert dyn["scheme"]["why"].startswith("uint8 weights: ONNX Runtime's ConvInteger ran")
    assert not list((quantized / "quantize").glob(".*"))  # no temporary files left
    assert not list(quantized.glob(".quantize.*"))


def test_static_int8_logits_leave_the_model_in_float(quantized: Path) -> None:
    e = entries(quantized)
    path = quantized / e["onnx-int8-static"]["file"]
    graph = onnx.load(str(path)).graph
    producer = {o: n for n in graph.node for o in n.output}
    assert producer[graph.output[0].name].op_type in ("Gemm", "MatMul")  # no Q -> DQ after it
    assert "QGemm" in int8_share(path)["int8_op_types"]  # still an int8 kernel in ORT
    x = load_splits(DataSpec.from_dict(e["checkpoint"]["data_spec"])).test_x
    int8 = load_predictor(path).predict(x)
    # A quantized output takes at most 256 values and is clipped to the calibration range.
    assert len(np.unique(int8)) > 256
    fp32 = load_predictor(quantized / e["onnx-fp32"]["file"]).predict(x)
    assert np.abs(int8 - fp32).max() < 0.05 * np.abs(fp32).max()


def test_static_int8_flattens_channels_last_so_onnxruntime_transposes_once(
    quantized: Path, tmp_path: Path
) -> None:
    static = entries(quantized)["onnx-int8-static"]
    (flatten,) = static["flattens_channels_last"]
    assert flatten.startswith("node_Reshape"), flatten  # the exporter's name for the flatten
    so = onnxruntime.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    onnxruntime.InferenceSession(str(quantized / static["file"]), so)
    ops = [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]
    # ORT's channels-last int8 convs need one transpose in (NCHW -> NHWC); the one it put
    # back before the NCHW flatten now cancels against lightship's explicit NHWC transpose
    assert ops.count("Transpose") == 1 and ops.index("Transpose") < ops.index("QLinearConv")


def test_calibration_method_changes_the_scales(
    exported_run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from lightship.quantize import core

    # every model counts as far from fp32: a clipping calibration's is warned of
    monkeypatch.setattr(core, "LOW_SQNR_DB", 1000.0)
    digests, warned = {}, {}
    for method in ("minmax", "entropy", "percentile"):
        run = tmp_path / method
        shutil.copytree(exported_run, run)
        s = QuantizeSettings(calibration_samples=64, calibration_method=method)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=core.__name__):
            (v,) = quantize(RunDir(run), "static", settings=s)
        digests[method] = v.entry["calibration"]["scales_sha256"]
        assert v.entry["calibration"]["samples"] == 64
        chosen = v.entry["scheme_check"]["chosen"]
        warned[method] = [m for m in caplog.messages if "SQNR from fp32's" in m]
        if method != "minmax":
            assert warned[method] == [
                f"static int8 with {method} calibration: its logits are "
                f"{chosen['sqnr_db']:.1f} dB SQNR from fp32's on the test images, "
                f"{round((1 - chosen['argmax_agreement']) * 269)} of 269 answers changed; "
                f"{method} calibration clips activations, and the accuracy gate may let such a "
                "model through: compare --calibration-method minmax (the default, no clipping)"
            ]
    assert len(set(digests.values())) == 3, digests
    assert warned["minmax"] == []  # what the warning points to, not warned of


def test_failed_gate_keeps_the_worst_nodes_in_fp32(
    exported_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "strict"
    shutil.copytree(exported_run, run)
    measured = []  # the ORT setting each scheme_check model ran under
    scheme_error = Quantizer._scheme_error

    def recording(self: Quantizer, path: Path) -> dict[str, float]:
        measured.append(file_metadata(path).get(DISABLED_OPTIMIZERS))
        return scheme_error(self, path)

    monkeypatch.setattr(Quantizer, "_scheme_error", recording)
    # each node back in fp32 buys validation accuracy (a round that buys none is undone)
    val_accuracy = Quantizer._val_accuracy

    def rewarded(self: Quantizer, model: Path | Any) -> float:
        path = model if isinstance(model, Path) else model.path
        return val_accuracy(self, model) + 0.001 * int8_share(path)["float_nodes"]

    monkeypatch.setattr(Quantizer, "_val_accuracy", rewarded)
    # A gate no int8 model can pass (> 100 % of fp32) forces every fallback round.
    s = QuantizeSettings(gate=1.01, fallback_budget=2)
    (v,) = quantize(RunDir(run), "static", settings=s)
    # the other scheme's error is measured as the chosen model runs (fp32 islands kept so)
    assert measured == ["QDQPropagationTransformer"] * 2
    kept = v.entry["nodes_fp32_by_fallback"]
    assert len(kept) == 2 and not v.gate_passed
    assert all(k["op_type"] in ("Conv", "Gemm", "MatMul") for k in kept)
    assert kept[0]["noise_added"] > 0  # ranked by the noise each node adds
    # the kept nodes really run in fp32 in ORT (no weight DequantizeLinear feeds them) ...
    graph = onnx.load(str(v.path)).graph
    producers = {o: n for n in graph.node for o in n.output}
    for k in kept:
        node = next(n for n in graph.node if n.name == k["node"])
        assert producers.get(node.input[1]) is None, "weights must stay float"
    share = int8_share(v.path)
    assert share["float_nodes"] == 2 and share["int8_nodes"] == 1
    # ... and the report lists them
    r = report(RunDir(run), FAST)
    row = next(x for x in r["variants"] if x["name"] == "onnx-int8-static")
    assert row["nodes_fp32"] == [k["node"] for k in kept]
    assert kept[0]["node"] in (run / "report" / "report.md").read_text()


def test_report_ranks_every_variant(quantized: Path) -> None:
    r = report(RunDir(quantized), FAST)
    names = [v["name"] for v in r["variants"]]
    assert names == ["eager", "torchscript", "onnx-fp32", "onnx-int8-static", "onnx-int8-dynamic"]
    for v in r["variants"]:
        assert set(v) >= {"name", "file", "bytes", "accuracy", "latency_ms", "throughput_per_s"}
        assert set(v) >= {"speedup_vs_eager", "gate_passed"}
        lat = v["latency_ms"]
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"]
        assert v["throughput_per_s"] > 0
    recorded = entries(quantized)
    for v in r["variants"][3:]:  # what quantize recorded (and gated) is what the report shows
        assert v["accuracy"] == recorded[v["name"]]["accuracy"], v["name"]
    for v in r["variants"][1:]:  # the file measured, which `serve` tells a remade one by
        assert v["sha256"] == recorded[v["name"]]["sha256"] == sha256_file(quantized / v["file"])
    eager = r["variants"][0]
    assert eager["speedup_vs_eager"] == pytest.approx(1.0) and eager["delta_vs_fp32"] == 0.0
    n = r["test_images"]
    assert eager["answers_changed"] == 0
    for v in r["variants"]:  # a net change in right answers is at most the answers changed
        assert abs(round(v["delta_vs_fp32"] * n)) <= v["answers_changed"] <= n, v["name"]
    fp32 = r["variants"][2]
    assert fp32["speedup_vs_onnx_fp32"] == pytest.approx(1.0)
    for v in r["variants"]:  # each ratio: median of the within-round ratios of the throughputs
        rounds = np.asarray(v["throughput_rounds"])
        assert len(rounds) == FAST.rounds and np.median(rounds) == pytest.approx(
            v["throughput_per_s"], rel=1e-3
        )
        assert v["speedup_vs_onnx_fp32"] == pytest.approx(
            np.median(rounds / fp32["throughput_rounds"]), rel=1e-3
        )
        assert v["speedup_vs_eager"] == pytest.approx(
            np.median(rounds / eager["throughput_rounds"]), rel=1e-3
        )
        for base, key in ((eager, "speedup_vs_eager"), (fp32, "speedup_vs_onnx_fp32")):
            ratios = rounds / np.asarray(base["throughput_rounds"])
            low, high = v[f"{key}_iqr"]
            assert [low, high] == pytest.approx(np.percentile(ratios, [25, 75]), rel=1e-3)
            assert low <= v[key] <= high
    assert fp32["max_abs_diff"] < 1e-3 and fp32["sqnr_db"] > 60
    # the fastest by within-round ratios; a tie (middle half reaching 1.0) to the higher SQNR
    eligible = {v["name"]: v for v in r["variants"] if v["gate_passed"] and v["recommendable"]}
    by = r["recommended_by"]

    def within_round(a: str, b: str) -> float:  # the median of a's img/s over b's
        rounds = np.asarray(eligible[a]["throughput_rounds"]) / eligible[b]["throughput_rounds"]
        return float(np.median(rounds))

    def slowest_lead(a: str) -> float:  # the fastest has the largest
        return min((within_round(a, b) for b in eligible if b != a), default=np.inf)

    assert slowest_lead(by["fastest"]) == pytest.approx(max(map(slowest_lead, eligible)), rel=1e-2)
    for other in set(eligible) - {by["fastest"]}:
        assert by["over"][other]["ratio"] == pytest.approx(
            within_round(by["fastest"], other), rel=1e-2
        )
    tied = by["tied"] or [by["fastest"]]
    assert set(tied) == {by["fastest"]} | {
        n for n in eligible if n != by["fastest"] and by["over"][n]["iqr"][0] <= 1.0
    }
    best = max((eligible[n] for n in tied), key=lambda v: (v["sqnr_db"], -v["bytes"]))
    assert r["recommended"] == best["name"] and best["recommended"]
    assert r["recommended"] not in ("eager", "onnx-int8-dynamic")  # dynamic: conv net
    md = (quantized / "report" / "report.md").read_text()
    # why, from quantize's entry: the console's footnote sends the reader to report.md for it
    (dynamic,) = [v for v in r["variants"] if v["name"] == "onnx-int8-dynamic"]
    assert dynamic["held_back"] == entries(quantized)["onnx-int8-dynamic"]["why"]
    assert f"Not recommended: onnx-int8-dynamic: {dynamic['held_back']}." in md
    assert "of multiply-adds are in convolutions" in dynamic["held_back"]
    assert r["cpu"]["model"] in md and "★" in md and "Scheme check" in md
    low, high = best["speedup_vs_eager_iqr"]
    assert f"{best['speedup_vs_eager']:.2f} ({low:.2f}–{high:.2f})" in md
    assert r["malloc_keeps_freed_memory"] == (platform.libc_ver()[0] == "glibc")
    png = (quantized / "report" / "pareto.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    def not_json(constant: str) -> None:
        raise AssertionError(f"report.json holds {constant}, which JSON does not have")

    on_disk = json.loads(
        (quantized / "report" / "report.json").read_text(), parse_constant=not_json
    )
    assert on_disk["recommended"] == r["recommended"]


def test_an_exact_variant_has_a_finite_sqnr_that_json_can_hold() -> None:
    from lightship.report import core

    x = np.linspace(-3, 3, 40, dtype=np.float32).reshape(4, 10)
    assert core.sqnr_db(x, x.copy()) == 120.0  # was inf: report.json said Infinity
    assert json.loads(json.dumps({"sqnr_db": core.sqnr_db(x, x)}, allow_nan=False))


def test_wrong_scheme_error_is_measured(quantized: Path) -> None:
    static = entries(quantized)["onnx-int8-static"]
    check = static["scheme_check"]
    chosen, other = check["chosen"], check["alternative"]
    x = np.asarray(chosen["max_abs_diff"]), np.asarray(other["max_abs_diff"])
    assert all(np.isfinite(v) and v >= 0 for v in x)
    assert chosen["target"] != other["target"]
    # On an AVX2 host full-range weights saturate where u8 activations span their whole range:
    # in the raw-pixel first conv. When that conv was kept in fp32 there is nothing to show.
    if chosen["target"] == "avx2" and not static["first_conv_fp32"]["kept"]:
        assert other["max_abs_diff"] >= chosen["max_abs_diff"]


def test_quantize_does_not_import_training_code() -> None:
    code = (
        "import sys, lightship.quantize.core, lightship.report; "
        "print([m for m in sys.modules if m.startswith('lightship.train')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_bad_inputs_exit_with_one_line(tiny_run: Path, exported_run: Path, tmp_path: Path) -> None:
    proc = run_cli("quantize", "--run", str(tiny_run))  # trained, never exported
    assert proc.returncode == 4 and "make export" in last_line(proc.stderr)
    cases = [
        (["--calibration-samples", "0"], "empty calibration set"),
        (["--methods", "static,fp4"], "unknown quantization method 'fp4'"),
        (["--target", "sse"], "unknown target 'sse'"),
        (["--calibration-method", "mse"], "unknown calibration method 'mse'"),
        # a CPU model labelled for TensorRT, which the report then recommended
        (
            ["--target", "tensorrt"],
            "--target tensorrt makes static int8 only (dynamic, qat int8 would be a CPU model "
            "labelled for TensorRT): quantize with `make quantize RUN=RUN QUANTIZE_ARGS='--methods "
            "static --target tensorrt'`",
        ),
    ]
    for args, message in cases:
        run = tmp_path / args[1].replace(",", "_")
        shutil.copytree(exported_run, run)
        proc = run_cli("quantize", "--run", str(run), *args)
        assert proc.returncode == 2, (args, proc.stderr)  # usage, as the README says
        message = message.replace("RUN=RUN", f"RUN={run}")  # the run quantized, named
        assert message in last_line(proc.stderr) and last_line(proc.stderr).startswith("error:")
        assert not (run / "quantize").exists() or not list((run / "quantize").iterdir())


def test_data_moved_after_training_says_to_put_it_back(exported_run: Path, tmp_path: Path) -> None:
    # quantize and report take no --set: "set data.path" would name a fix they cannot take
    run = tmp_path / "moved"
    shutil.copytree(exported_run, run)
    gone = tmp_path / "gone.npz"
    rd = RunDir(run)
    entry = rd.artifact("checkpoint")
    assert entry is not None
    spec = {**entry["data_spec"], "source": "npz", "path": str(gone)}
    rd.record("checkpoint", {**entry, "data_spec": spec})
    for stage in ("quantize", "report"):
        proc = run_cli(stage, "--run", str(run))
        assert proc.returncode == 3, proc.stderr
        assert last_line(proc.stderr) == (
            f"error: npz file {gone}, which this run was trained on, does not exist: put the "
            "data back at that path (a symlink to its new place will do) and run again"
        )


def test_data_changed_since_training_is_refused(exported_run: Path, tmp_path: Path) -> None:
    # a split drawn anew over other data would test the model on images it trained on
    run = tmp_path / "changed"
    shutil.copytree(exported_run, run)
    rd = RunDir(run)
    entry = rd.artifact("checkpoint")
    assert entry is not None
    now = str(entry["data_spec"]["fingerprint"])
    rd.record("checkpoint", {**entry, "data_spec": {**entry["data_spec"], "fingerprint": "9:0"}})
    for stage in ("quantize", "report"):
        proc = run_cli(stage, "--run", str(run))
        assert proc.returncode == 3, proc.stderr
        assert last_line(proc.stderr) == (
            f"error: the digits data changed since this run trained on it (9 images then, "
            f"{now.partition(':')[0]} now): its test split would no longer be the images held out "
            "from training; put the data back as it was, or train a new run on it"
        )


def test_report_leaves_out_an_artifact_changed_after_it_was_recorded(
    quantized: Path, tmp_path: Path
) -> None:
    run = tmp_path / "changed"
    shutil.copytree(quantized, run)
    # the fp32 model copied over the int8 one: it would be measured and reported as int8
    shutil.copy(run / "export" / "model.onnx", run / "quantize" / "model.int8-static.onnx")
    proc = run_cli("report", "--run", str(run), "--rounds", "2", check=True)
    why = (
        "quantize/model.int8-static.onnx differs from its manifest entry (sha256): it changed "
        f"after `lightship` wrote it; `make quantize RUN={run} QUANTIZE_ARGS='--methods static'` "
        "makes it again"
    )
    assert f"onnx-int8-static: {why} (not measured)" in proc.stderr
    result = json.loads((run / "report" / "report.json").read_text())
    names = [v["name"] for v in result["variants"]]
    assert "onnx-int8-static" not in names and "onnx-int8-dynamic" in names
    assert result["not_measured"] == {"onnx-int8-static": why}


def test_quantize_on_a_read_only_run_is_one_line(
    exported_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only file system (root ignores chmod, so simulated): the run's own writability
    check speaks before quantize makes its work folder there (an OSError traceback before)."""
    import errno
    import tempfile

    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    run = tmp_path / "ro"
    shutil.copytree(exported_run, run)
    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    with pytest.raises(RunError) as err:
        quantize(RunDir(run), "static")
    assert str(err.value) == (
        f"cannot write {run / 'manifest.json'}: Read-only file system: check the path and its "
        "permissions"
    )


def test_a_report_that_recommends_nothing_says_how_to_serve_anyway(
    tiny_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "not_exported"  # eager alone: nothing to recommend, so auto would refuse
    shutil.copytree(tiny_run, run)
    proc = run_cli("report", "--run", str(run), "--rounds", "2", check=True)
    lines = proc.stdout.splitlines()
    why = (
        "nothing that can be served was measured (eager PyTorch is only the reference): export "
        "the run, then report again"
    )
    assert lines[-3:] == [
        "recommended: none",
        f"why none: {why}",
        f"next: make export RUN={run}, then make report RUN={run}",
    ]
    assert f"Why none: {why}." in (run / "report" / "report.md").read_text()


def test_a_report_names_a_listed_variant_whose_file_is_gone(
    exported_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "gone"
    shutil.copytree(exported_run, run)
    (run / "export" / "model.ts").unlink()
    proc = run_cli("report", "--run", str(run), "--rounds", "2", check=True)
    why = (
        "listed in the manifest but export/model.ts is gone; "
        f"`make export RUN={run} EXPORT_ARGS='--formats torchscript'` makes it again"
    )
    assert f"torchscript is {why} (not measured)" in proc.stderr
    result = json.loads((run / "report/report.json").read_text())
    names = [v["name"] for v in result["variants"]]
    assert "torchscript" not in names and "onnx-fp32" in names
    # the report says so too, not only the terminal
    assert result["not_measured"] == {"torchscript": why}
    assert f"Not measured: torchscript, {why}." in (run / "report/report.md").read_text()


def test_a_report_where_nothing_passes_the_gate_says_so(exported_run: Path, tmp_path: Path) -> None:
    # an int8 variant alone (model.onnx's bytes under its name), held to a gate above 1: the
    # fp32 formats, which keep all of fp32's accuracy whatever the gate, are taken out
    run = tmp_path / "gate"
    shutil.copytree(exported_run, run)
    rd = RunDir(run)
    (run / "quantize").mkdir()
    shutil.copy(run / "export" / "model.onnx", run / "quantize" / "model.int8-static.onnx")
    entry = rd.artifact("onnx-fp32")
    assert entry is not None
    rd.record("onnx-int8-static", {**entry, "file": "quantize/model.int8-static.onnx"})
    rd.discard("onnx-fp32", "torchscript")
    proc = run_cli("report", "--run", str(run), "--rounds", "2", "--gate", "1.1", check=True)
    assert proc.stdout.splitlines()[-2:] == [
        "why none: none of onnx-int8-static kept 1.1 of fp32's accuracy (the gate)",
        f"next: serve one by name: make serve RUN={run} SERVE_ARGS='--variant ...'",
    ]


def test_report_command_names_the_recommendation_with_its_spread(
    quantized: Path, tmp_path: Path
) -> None:
    run = tmp_path / "again"
    shutil.copytree(quantized, run)
    proc = run_cli("report", "--run", str(run), "--rounds", "4", "--batch", "16", check=True)
    r = json.loads((run / "report" / "report.json").read_text())
    best = next(v for v in r["variants"] if v["recommended"])
    (low, high), (fp32_low, fp32_high) = (
        best["speedup_vs_eager_iqr"],
        best["speedup_vs_onnx_fp32_iqr"],
    )
    assert (
        f"recommended: {best['name']}: x eager {best['speedup_vs_eager']:.2f} ({low:.2f}–"
        f"{high:.2f}), x ONNX fp32 {best['speedup_vs_onnx_fp32']:.2f} ({fp32_low:.2f}–"
        f"{fp32_high:.2f})" in proc.stdout
    ), proc.stdout


def test_report_checks_its_outputs_before_measuring(quantized: Path, tmp_path: Path) -> None:
    run = tmp_path / "blocked"
    shutil.copytree(quantized, run)
    shutil.rmtree(run / "report", ignore_errors=True)
    (run / "report" / "pareto.png").mkdir(parents=True)  # written last, after a minute of timing
    proc = run_cli("report", "--run", str(run))
    assert proc.returncode == 4, proc.stderr
    assert last_line(proc.stderr) == (
        f"error: {run / 'report' / 'pareto.png'} is a folder where a file goes: "
        "move it away and run again"
    )
    assert "measuring" not in proc.stderr  # failed before the progress bar started
    assert [p.name for p in (run / "report").iterdir()] == ["pareto.png"]


def test_quantize_refuses_an_export_changed_after_it_was_recorded(
    exported_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "swapped"
    shutil.copytree(exported_run, run)
    (run / "export" / "model.onnx").write_bytes(b"not the exported model")
    proc = run_cli("quantize", "--run", str(run), "--methods", "static")
    assert proc.returncode == 4, proc.stderr
    assert last_line(proc.stderr) == (
        f"error: {run}/export/model.onnx differs from its manifest entry (sha256): it changed "
        f"after `lightship export` wrote it; re-run `make export RUN={run}`"
    )
    assert not (run / "quantize").exists() or not list((run / "quantize").iterdir())


def test_a_report_that_fails_to_write_leaves_the_old_one_whole(
    quantized: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "full"
    shutil.copytree(quantized, run)
    report(RunDir(run), FAST)
    old = {p.name: p.read_bytes() for p in (run / "report").iterdir()}

    def disk_full(result: dict, path: Path) -> None:
        path.write_bytes(b"\x89PNG half")
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr("lightship.report.render.pareto", disk_full)
    with pytest.raises(OSError, match="No space left"):
        report(RunDir(run), FAST)
    # not a new report.json beside the old plot: the old set, and no temporary files
    assert {p.name: p.read_bytes() for p in (run / "report").iterdir()} == old


def test_a_failed_quantization_leaves_no_scratch_folder(
    exported_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "scratch"
    shutil.copytree(exported_run, run)

    def disk_full(fp32: Path, out: Path) -> Path:
        out.write_bytes(b"half")
        raise OSError(28, "No space left on device", str(out))

    monkeypatch.setattr("lightship.quantize.ptq.preprocess", disk_full)
    with pytest.raises(OSError, match="No space left"):
        quantize(RunDir(run), "static")
    assert not list(run.glob(".quantize.*")) and not (run / "quantize").exists()


def _free_space(monkeypatch: pytest.MonkeyPatch, free: Callable[[], int]) -> None:
    """Every folder's file system has `free()` bytes free, as `check_space` reads it."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=free()))


def test_quantize_on_a_nearly_full_disk_says_so_before_writing(
    exported_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """onnx and onnxruntime write models from C++: a full disk cut them short without an error,
    and quantize ended in a protobuf DecodeError traceback."""
    run = tmp_path / "nearly_full"
    shutil.copytree(exported_run, run)
    _free_space(monkeypatch, lambda: 1_000_000)
    with pytest.raises(RunError) as err:
        quantize(RunDir(run), "static,dynamic,qat")
    model, ckpt = (run / "export" / "model.onnx").stat().st_size, (run / "best.ckpt").stat().st_size
    need = 4 * model + 2 * ckpt + 4_000_000
    assert str(err.value) == (
        f"quantize needs about {need / 1e6:.0f} MB in {run} but 1 MB are free: "
        "make room and run again"
    )
    assert not list(run.glob(".quantize.*")) and not (run / "quantize").exists()


@pytest.mark.parametrize("room", [False, True])
def test_a_model_cut_short_is_a_full_disk_only_when_the_disk_is_full(
    exported_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, room: bool
) -> None:
    """The disk fills while quantize runs: the model a C++ writer cut short fails to load."""
    from google.protobuf.message import DecodeError

    run = tmp_path / "filled"
    shutil.copytree(exported_run, run)
    filled: list[Path] = []
    _free_space(monkeypatch, lambda: 10**12 if room or not filled else 0)

    def cut_short(pre: Path, out: Path) -> list[str]:
        filled.append(out)
        raise DecodeError("Error parsing message with type 'onnx.ModelProto'")

    monkeypatch.setattr("lightship.quantize.ptq.flatten_channels_last", cut_short)
    with pytest.raises(RunError if not room else DecodeError) as err:
        quantize(RunDir(run), "dynamic")
    if not room:
        assert str(err.value).startswith("quantize needs about 4 MB in ")
        assert str(err.value).endswith("but 0 kB are free: make room and run again")
    assert filled and not list(run.glob(".quantize.*"))


def test_deep_convs_go_to_ort_gemm_only_where_it_measures_faster(
    quantized: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The AMX step on the tiny model, every conv made "deep" and its 0.05 ms run "long": the
    rewrite is exact, it is timed both ways, and the model on disk is the one the rule keeps,
    with the spin-inside-runs metadata exactly when routed. With the real run-time floor the
    tiny model is never routed where its short batches run on a spinning multi-thread pool;
    on a CPU without AMX the step is not tried."""
    import dataclasses
    import functools

    from lightship.quantize import core, ptq
    from lightship.quantize.core import Quantizer
    from lightship.runtime import physical_cores
    from lightship.runtime.ort import SPIN_IN_RUN

    def rule(e: dict[str, Any]) -> bool:
        t = e["batch1_p50_ms"]
        long_enough = t["direct"] >= core.SPIN_MIN_RUN_MS or e["short_batch_threads"] == 1
        return bool(long_enough and e["speedup"] > 1.05 and t["gemm"] <= t["direct"])

    run = tmp_path / "run"
    shutil.copytree(quantized, run)
    q = Quantizer(RunDir(run), "auto", QuantizeSettings())
    try:
        q.target = "vnni"
        q.cpu = dataclasses.replace(q.cpu, flags=q.cpu.flags - {"amx_int8"})
        static = run / "quantize/model.int8-static.onnx"
        acc = q._val_accuracy(static)  # the choice is made on the validation split
        assert q._gemm_convs(static, acc) is None
        if q.scheme.reduce_range:  # this host made 7-bit weights (AVX2): never routed for real
            pytest.skip("q - 1 leaves 7 bits and AVX2 sums u8 x s8 pairs in int16: no exact A/B")
        q.cpu = dataclasses.replace(q.cpu, flags=q.cpu.flags | {"amx_int8"})
        monkeypatch.setattr(ptq, "GEMM_CONV_MIN_K", 1)
        trial = tmp_path / "trial.onnx"  # `_gemm_convs` replaces the file it keeps
        shutil.copy(static, trial)
        real = q._gemm_convs(trial, acc)
        assert real is not None and real["kept"] == rule(real)
        if physical_cores() > 1:  # one session with a pool for every batch: the floor holds
            with monkeypatch.context() as m:
                m.setattr(core, "load_predictor", functools.partial(load_predictor, split=False))
                shutil.copy(static, trial)
                pooled = q._gemm_convs(trial, acc)
            assert pooled is not None and pooled["short_batch_threads"] > 1
            assert pooled["kept"] is False  # its runs are far below the floor, and it says so
            assert pooled["not_kept"].startswith("a batch-1 run takes"), pooled
            assert pooled["batch1_p50_ms"]["direct"] < core.SPIN_MIN_RUN_MS
        monkeypatch.setattr(core, "SPIN_MIN_RUN_MS", 0.0)
        before = onnx.load(str(static)).graph
        dequantized = {o for n in before.node if n.op_type == "DequantizeLinear" for o in n.output}
        convs = [n.name for n in before.node if n.op_type == "Conv" and n.input[1] in dequantized]
        e = q._gemm_convs(static, acc)
    finally:
        q.close()
    assert e is not None and e["convs"] == convs and e["accuracy"] == acc  # bit-exact rewrite
    assert e["accuracy_split"] == "validation"
    assert e["kept"] == rule(e) and ("not_kept" in e) != e["kept"]
    model = onnx.load(str(static))
    zero_points = [
        onnx.numpy_helper.to_array(t)
        for t in model.graph.initializer
        if t.name.endswith("_zero_point")
    ]
    assert any((z == -1).all() for z in zero_points) == e["kept"]
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta.get(SPIN_IN_RUN) == ("1" if e["kept"] else None)
    assert load_predictor(static).predict(np.zeros((1, 1, 16, 16), np.uint8)).shape == (1, 10)


def test_an_int8_model_onnxruntime_cannot_load_fails_its_method_alone(
    exported_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not `LoadError`'s advice for a user's file ("make it again") naming a temporary path
    that is gone: the method that made the model failed, the others are still produced."""
    from lightship.quantize.core import MethodFailed

    def unloadable(pre: Path, out: Path, *args: object, **kwargs: object) -> None:
        model = onnx.load(str(pre))  # a model onnx reads whose op onnxruntime does not know
        model.graph.node[0].op_type = "NoSuchOp"
        onnx.save(model, str(out))

    monkeypatch.setattr("lightship.quantize.ptq.quantize_dynamic_onnx", unloadable)
    run = tmp_path / "unloadable"
    shutil.copytree(exported_run, run)
    errors: dict[str, Exception] = {}
    variants = quantize(RunDir(run), "dynamic,static", on_error=errors.__setitem__)
    assert [v.method for v in variants] == ["static"]
    err = errors["dynamic"]
    assert isinstance(err, MethodFailed)
    assert err.cause.startswith(
        "onnxruntime cannot load the int8 model it has just made: [ONNXRuntimeError]"
    )
    assert "model.int8-dynamic.onnx" in err.cause and ".tmp" not in err.cause
    assert str(tmp_path) not in err.cause
    assert err.fix == (
        "model.int8-dynamic.onnx was not written; leave dynamic out (--methods static,qat)"
    )
    assert "onnx-int8-dynamic" not in entries(run)
    assert sorted(p.name for p in (run / "quantize").iterdir()) == ["model.int8-static.onnx"]
    assert not list(run.glob(".quantize.*"))


def test_an_interrupt_while_static_measures_leaves_the_manifest_true_to_the_files(
    quantized: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during the last measurement (the other scheme's error) left the new model in
    place beside the old manifest entry: the report then refused it as "changed after
    `lightship` wrote it"."""
    from lightship.quantize.core import Quantizer

    run = tmp_path / "interrupted"
    shutil.copytree(quantized, run)
    before = {p.name: p.read_bytes() for p in (run / "quantize").iterdir()}
    measured = Quantizer._scheme_error

    def ctrl_c_on_the_other_scheme(self: Quantizer, path: Path) -> dict[str, float]:
        if path.name == "alt.onnx":
            raise KeyboardInterrupt
        return measured(self, path)

    monkeypatch.setattr(Quantizer, "_scheme_error", ctrl_c_on_the_other_scheme)
    with pytest.raises(KeyboardInterrupt):  # other scales than the fixture's: another file
        quantize(RunDir(run), "static", settings=QuantizeSettings(calibration_method="entropy"))
    entry = entries(run)["onnx-int8-static"]
    assert sha256_file(run / entry["file"]) == entry["sha256"]
    assert {p.name: p.read_bytes() for p in (run / "quantize").iterdir()} == before
    assert not list(run.glob(".quantize.*"))


def test_quantize_removes_the_scratch_a_killed_quantize_left(
    exported_run: Path, tmp_path: Path
) -> None:
    """kill -9 runs no `finally`: its scratch folders (model copies, QAT checkpoints) stayed in
    the run for good. The next quantize, taking the run's lock, removes them: called from
    Python as here, without the CLI's lock, too."""
    run = tmp_path / "killed"
    shutil.copytree(exported_run, run)
    for folder, file in ((".quantize.k1ll3d_0", "pre.onnx"), (".qat.k1ll3d_0", "epoch=0.ckpt")):
        (run / folder).mkdir()
        (run / folder / file).write_bytes(b"left by kill -9")
    quantize(RunDir(run), "dynamic")
    assert not list(run.glob(".quantize.*")) and not list(run.glob(".qat.*"))
    assert entries(run)["onnx-int8-dynamic"]["file"] == "quantize/model.int8-dynamic.onnx"


def test_calibration_samples_mean_nothing_to_dynamic_int8(
    exported_run: Path, tmp_path: Path
) -> None:
    """quantize() checks --calibration-samples only when static is asked for; the images were
    taken for every method anyway, and `--methods dynamic --calibration-samples 0` failed."""
    run = tmp_path / "no_calibration"
    shutil.copytree(exported_run, run)
    variants = quantize(RunDir(run), "dynamic", settings=QuantizeSettings(calibration_samples=0))
    assert [v.method for v in variants] == ["dynamic"] and variants[0].path.is_file()


def test_quantize_refuses_a_model_of_another_shape_recorded_as_the_runs(
    exported_run: Path, tmp_path: Path
) -> None:
    """Another model's model.onnx (3x8x8 for the run's 1x16x16 images), its entry without a
    sha256 (taken as it is): quantize ended in an InputError traceback from its first batch."""
    from tests.handmade import handmade_onnx

    run = tmp_path / "other"
    shutil.copytree(exported_run, run)
    handmade_onnx(run / "export" / "model.onnx", chw=(3, 8, 8))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["artifacts"]["onnx-fp32"].pop("sha256")
    (run / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RunError) as err:
        quantize(RunDir(run), "dynamic")
    assert str(err.value) == (
        f"{run}/export/model.onnx is not this run's model (it takes [N,3,8,8], the run's images "
        f"are [N,1,16,16]): re-run `make export RUN={run} EXPORT_ARGS='--formats onnx'`"
    )
    assert "onnx-int8-dynamic" not in entries(run) and not list(run.glob(".quantize.*"))


def test_quantizing_for_a_cpu_that_computes_it_differently_is_warned_of(
    exported_run: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`--target vnni` on a CPU without VNNI: the accuracies the gate judges are this CPU's
    saturated ones, said once before quantizing (its candidates' loads say nothing more)."""
    from lightship.quantize import isa

    avx2 = isa.CpuInfo("test AVX2 CPU", "x86_64", frozenset({"avx2"}))
    monkeypatch.setattr(isa, "host_cpu", lambda: avx2)
    caplog.set_level(logging.WARNING)
    for target in ("avx2", "vnni"):
        Quantizer(RunDir(exported_run), target, QuantizeSettings()).close()
    assert [r.getMessage() for r in caplog.records] == [
        "quantizing for vnni on test AVX2 CPU (x86_64; avx2), which computes such a model "
        "differently: the accuracies quantize gates on and the speeds it measures are this "
        "CPU's, not those of the machine it is for"
    ]


def test_the_report_judges_by_the_gate_quantize_used(
    quantized: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`quantize --gate 0.95` passed a variant that the report, at its own 0.99, failed: not
    recommended, not served by `auto`. The report now takes the gate recorded in the entries
    (the strictest, said, where they differ); its own --gate still chooses another."""
    run = tmp_path / "gated"
    shutil.copytree(quantized, run)
    rd = RunDir(run)

    def quantized_with(gates: dict[str, float]) -> None:
        for name, gate in gates.items():
            entry = rd.artifact(name)
            assert entry is not None
            rd.record(name, {**entry, "gate": {"min_ratio": gate, "passed": True}})

    int8 = ["onnx-int8-static", "onnx-int8-dynamic"]
    quantized_with(dict.fromkeys(int8, 1.1))  # no int8 variant keeps 1.1 of fp32's accuracy
    r = report(rd, FAST)
    assert r["gate"] == 1.1
    assert [v["gate_passed"] for v in r["variants"] if v["name"] in int8] == [False, False]
    assert report(rd, ReportSettings(rounds=2, seconds=0.05, batch=16, gate=0.5))["gate"] == 0.5
    quantized_with({"onnx-int8-static": 0.5})
    caplog.set_level(logging.WARNING, logger="lightship.report.core")
    assert report(rd, FAST)["gate"] == 1.1
    assert caplog.messages == [
        "the int8 variants were quantized with different --gate values (0.5, 1.1): the report "
        "judges them all by the strictest, 1.1 (report --gate to choose another)"
    ]


def test_the_report_recommends_no_variant_the_server_here_refuses(
    quantized: Path, tmp_path: Path
) -> None:
    """`quantize --target tensorrt`: the report recommended its int8 model, which `serve`
    then refused on the same CPU (exit 4). Now it is not recommended, and the report says why."""
    run = tmp_path / "trt"
    shutil.copytree(quantized, run)
    rd = RunDir(run)
    for name in ("onnx-int8-static", "onnx-int8-dynamic"):
        entry = rd.artifact(name)
        assert entry is not None
        rd.record(name, {**entry, "target": "tensorrt"})
    r = report(rd, FAST)
    refused = {v["name"]: v["refused_here"] for v in r["variants"] if v["refused_here"]}
    assert set(refused) == {"onnx-int8-static", "onnx-int8-dynamic"}
    assert refused["onnx-int8-static"].startswith("model was quantized for TensorRT (S8S8)")
    assert r["recommended"] in ("onnx-fp32", "torchscript")
    md = (run / "report" / "report.md").read_text()
    assert (
        "\nNot recommended: onnx-int8-static, which `lightship serve` refuses on this CPU: " in md
    )
    # best.ckpt holds the optimizer's state and EMA weights too: not the model's size
    eager = next(line for line in md.splitlines() if line.startswith("| eager |"))
    assert eager.split(" | ")[1].endswith(" (training checkpoint)"), eager


@pytest.mark.parametrize("recorded", [{"test_acc": 0.25}, {"test_samples": 54}])
def test_a_test_split_that_is_not_what_training_measured_is_refused(
    quantized: Path, tmp_path: Path, recorded: dict[str, Any]
) -> None:
    """A run trained by an older lightship, before the data fingerprint, on an image folder
    read otherwise then (not recursively; no EXIF turn): report and quantize measured another
    split, 41 of its 78 test images from the training split, and printed its figures."""
    run = tmp_path / "older"
    shutil.copytree(quantized, run)
    rd = RunDir(run)
    entry = rd.artifact("checkpoint")
    assert entry is not None
    rd.record("checkpoint", {**entry, **recorded})
    with pytest.raises(DataError, match="^the test split is not what this run trained on: "):
        report(rd, FAST)
    proc = run_cli("quantize", "--run", str(run), "--methods", "static")
    assert proc.returncode == 3, proc.stderr
    assert last_line(proc.stderr).startswith(
        "error: the test split is not what this run trained on: the ONNX model scores "
    )
    assert last_line(proc.stderr).endswith("put the data back as it was, or train a new run on it")


def test_fallback_nodes_that_gain_no_accuracy_stay_int8(
    exported_run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """ResNet-18 with entropy calibration: three fallback rounds at 0.9591 each, and all three
    fp32 islands kept in a model about 10 % slower for nothing. Rounds that gain nothing over
    an earlier one are undone; the model is the earlier round's, exactly."""
    run = tmp_path / "flat"
    shutil.copytree(exported_run, run)
    val_accuracy = Quantizer._val_accuracy
    flat: dict[str, float] = {}  # every int8 model alike: the fallback never helps

    def no_gain(self: Quantizer, model: Path | Any) -> float:
        path = model if isinstance(model, Path) else model.path
        if path == self.fp32:
            return val_accuracy(self, model)
        return flat.setdefault("acc", val_accuracy(self, model))

    monkeypatch.setattr(Quantizer, "_val_accuracy", no_gain)
    caplog.set_level(logging.INFO, "lightship.quantize.core")
    (v,) = quantize(RunDir(run), "static", settings=QuantizeSettings(gate=1.01, fallback_budget=2))
    assert not v.gate_passed and v.entry["nodes_fp32_by_fallback"] == []
    islands: list[list[str]] = [  # each round's island, as the rounds logged them
        cast(tuple[Any, ...], r.args)[0]
        for r in caplog.records
        if r.getMessage().startswith("gate failed: keeping")
    ]
    undone = f"their {sum(map(len, islands))} node(s) go back to int8"  # not "2 node(s)"
    assert len(islands) == 2 and any(
        r.getMessage().startswith("the fallback's last 2 round(s) gained no validation")
        and r.getMessage().endswith(undone)
        for r in caplog.records
    ), caplog.text
    first_conv = v.entry["first_conv_fp32"] or {}
    kept = len(first_conv.get("island", [])) if first_conv.get("kept") else 0
    assert int8_share(v.path)["float_nodes"] == kept  # no fallback island left in fp32


def test_a_failing_model_that_replaces_a_passing_one_says_how_to_get_it_back(
    quantized: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Trying another calibration method that fails the gate replaced the static model that
    passed it, exit 0, with only `gate FAIL` in the summary: the good model was gone."""
    run = tmp_path / "tried"
    shutil.copytree(quantized, run)
    rd = RunDir(run)
    settings = QuantizeSettings(calibration_method="percentile", fallback_budget=0)
    (made,) = quantize(rd, "static", settings=settings)
    flags = ["--calibration-method", "percentile", "--fallback-budget", "0"]
    assert made.gate_passed and made.entry["flags"] == flags
    caplog.set_level(logging.WARNING, logger="lightship.quantize.core")
    (v,) = quantize(rd, "static", settings=QuantizeSettings(gate=1.01, fallback_budget=0))
    assert not v.gate_passed
    (warning,) = [m for m in caplog.messages if "where the model it replaces passed" in m]
    assert warning.startswith("onnx-int8-static fails the gate (test accuracy ")
    assert warning.endswith(
        f"): quantize again as it was made to get it back: {_command(rd, 'quantize', ['static'], flags)}"
    )
    assert "--methods static --calibration-method percentile --fallback-budget 0" in warning
    # a stricter --gate, not a worse model, is why it fails here: said
    assert "; the gate was 0.99, now 1.01): quantize again" in warning
