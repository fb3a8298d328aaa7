"""What `serve` says of a --run that holds nothing to serve, and the CPU check of a lone file."""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
import pytest

from lightship.errors import RunError
from lightship.quantize.isa import CpuInfo
from lightship.runs import RunDir, sha256_file
from lightship.serve.model import choose, verify
from lightship.serve.settings import ServeSettings
from tests.handmade import handmade_onnx

AVX2 = CpuInfo("test AVX2 CPU", "x86_64", frozenset({"avx2"}))
VNNI = CpuInfo("test VNNI CPU", "x86_64", frozenset({"avx2", "avx512_vnni"}))
FILES = "(.onnx, .ts, .pt2, .ckpt)"


def refusal(run: Path) -> str:
    with pytest.raises(RunError) as err:
        choose(ServeSettings(run=run))
    return str(err.value)


@pytest.fixture(autouse=True)
def outside_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # lightship's own make targets are not here: lightship commands


def test_a_path_that_does_not_exist_is_said_to_be_missing(tmp_path: Path) -> None:
    assert refusal(tmp_path / "model") == (
        f"{tmp_path}/model does not exist: neither a run directory nor a model file is there; "
        "give --run (LIGHTSHIP_RUN) a run directory (one `lightship train` and `lightship "
        f"export` made) or a model file {FILES}"
    )
    assert refusal(tmp_path / "lone" / "missing.onnx") == (
        f"no such model file: {tmp_path}/lone/missing.onnx does not exist: check the path"
    )
    run = tmp_path / "run"
    RunDir(run).record("checkpoint", {"file": "best.ckpt"})
    (run / "best.ckpt").write_bytes(b"weights")
    assert refusal(run / "export" / "model.ts") == (
        f"no such model file: {run}/export/model.ts does not exist: check the path; "
        f"run `lightship export --run {run}` first"
    )


def test_a_folder_without_a_run_in_it_is_not_a_run(tmp_path: Path) -> None:
    empty = tmp_path / "model"  # what `docker run -v` mounts for a host path that is not there
    empty.mkdir()
    assert refusal(empty) == (
        f"{empty} is not a lightship run (no manifest.json, no best.ckpt): mount or copy a run "
        "directory there (one `lightship train` and `lightship export` made), or train one "
        f"there: `lightship train --run {empty}`"
    )
    (empty / "checkpoints").mkdir()  # training stopped before its best checkpoint
    assert refusal(empty) == (
        f"{empty} has no best.ckpt yet: run `lightship train --run {empty}`, then "
        f"`lightship export --run {empty}`"
    )


def test_a_trained_run_without_an_export_still_says_export(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "best.ckpt").write_bytes(b"weights")
    assert refusal(run) == (
        f"{run} has no 'onnx-fp32' artifact (it has: none): run `lightship export --run {run}` "
        "first; or choose another --variant"
    )


IN_AN_IMAGE = "a model image holds only a run's manifest, ONNX files and report"
REBUILD = "rebuild the image from a run that has it: `make {} docker-model RUN=runs/NAME`"
TORCH = (
    "serve an ONNX variant, e.g. --variant onnx-fp32, or mount the whole run at /model in an "
    "image with torch (Dockerfile.gpu, --build-arg TORCH_VERSION=...)"
)


def test_a_run_in_a_model_image_says_to_rebuild_the_image_not_to_export_in_it(
    tmp_path: Path,
) -> None:
    """The Dockerfile's `model` stage copies a run's manifest, ONNX files and report, never
    best.ckpt: what is missing there cannot be exported or quantized in the container."""
    run = tmp_path / "model"  # as at /model in the image
    (run / "export").mkdir(parents=True)
    RunDir(run).record("checkpoint", {"file": "best.ckpt"})  # trained, never exported
    no_ckpt = f"{run} has no best.ckpt to make it from ({IN_AN_IMAGE}): "
    assert refusal(run) == (
        f"{run} has no 'onnx-fp32' artifact (it has: checkpoint): {no_ckpt}"
        f"{REBUILD.format('export')}; or choose another --variant"
    )
    handmade_onnx(run / "export" / "model.onnx")
    RunDir(run).record("onnx-fp32", {"file": "export/model.onnx"})
    RunDir(run).record("onnx-int8-static", {"file": "quantize/model.int8-static.onnx"})
    RunDir(run).record("torchscript", {"file": "export/model.ts"})  # never copied in

    def refused(variant: str) -> str:
        with pytest.raises(RunError) as err:
            choose(ServeSettings(run=run, variant=variant))
        return str(err.value)

    assert refused("onnx-int8-static") == (
        f"{run}/quantize/model.int8-static.onnx is in the manifest but missing: {no_ckpt}"
        + REBUILD.format("quantize")
    )
    assert refused("torchscript") == (
        f"{run}/export/model.ts is in the manifest but missing: {no_ckpt}{TORCH}"
    )
    # training cannot give it back there: it said `lightship train --run /model`
    assert refused("checkpoint") == (
        f"{run}/best.ckpt is in the manifest but missing: {run} has no best.ckpt "
        f"({IN_AN_IMAGE}): {TORCH}"
    )
    assert refused("onnx-int8-dynamic").endswith(
        f"{no_ckpt}{REBUILD.format('quantize')}; or choose another --variant"
    )
    assert refusal(run / "export" / "model.pt2") == (
        f"no such model file: {run}/export/model.pt2 does not exist: check the path; "
        f"{no_ckpt}{TORCH}"
    )
    assert refusal(run / "quantize" / "model.int8-qat.onnx").endswith(
        f"check the path; {no_ckpt}{REBUILD.format('quantize')}"
    )
    # a file there but changed since it was recorded: it said to re-run export there
    RunDir(run).record("onnx-fp32", {"file": "export/model.onnx", "sha256": "0" * 64})
    with pytest.raises(RunError) as err:
        verify(choose(ServeSettings(run=run, variant="onnx-fp32")))
    assert str(err.value) == (
        f"{run}/export/model.onnx differs from its manifest entry (sha256): it changed after it "
        f"was recorded; {no_ckpt}{REBUILD.format('export')}"
    )
    # With its checkpoint the run can make them: the stage's command is the fix again.
    (run / "best.ckpt").write_bytes(b"weights")
    assert refused("onnx-int8-static") == (
        f"{run}/quantize/model.int8-static.onnx is in the manifest but missing: re-run "
        f"`lightship quantize --run {run} --methods static`"
    )
    assert refused("torchscript").endswith(
        f"missing: re-run `lightship export --run {run} --formats torchscript`"
    )
    with pytest.raises(RunError) as err:
        verify(choose(ServeSettings(run=run, variant="onnx-fp32")))
    assert str(err.value).endswith(
        f"it changed after it was recorded; re-run `lightship export --run {run} --formats onnx`"
    )


def test_a_lone_file_of_a_run_that_changed_names_the_stage_that_remakes_it(
    tmp_path: Path,
) -> None:
    # served by its path, its variant is "file": it said `lightship export --formats file`
    run = tmp_path / "run"
    (run / "quantize").mkdir(parents=True)
    path = handmade_onnx(run / "quantize" / "model.int8-static.onnx")
    RunDir(run).record(
        "onnx-int8-static", {"file": "quantize/model.int8-static.onnx", "sha256": "0" * 64}
    )
    (run / "best.ckpt").write_bytes(b"weights")
    link = run / "current.onnx"  # a link's name says nothing: the file it points at does
    link.symlink_to(path)
    for served in (path, link):
        model = choose(ServeSettings(run=served))
        assert (model.variant, model.entry) == ("file", RunDir(run).artifact("onnx-int8-static"))
        with pytest.raises(RunError) as err:
            verify(model)
        assert str(err.value).endswith(
            f"it changed after it was recorded; re-run `lightship quantize --run {run} "
            "--methods static`"
        )


def int8_file(path: Path, target: str) -> Path:
    """A lone ONNX file whose metadata says what quantize writes: the CPU it was made for."""
    model = onnx.load(str(handmade_onnx(path)))
    model.metadata_props.add(key="lightship.target", value=target)
    onnx.save(model, str(path))
    return path


def test_a_lone_int8_file_is_checked_against_this_cpu_by_its_metadata(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = int8_file(tmp_path / "model.int8-static.onnx", "vnni")
    model = choose(ServeSettings(run=path))
    assert model.entry is None  # outside any run: no manifest says what it is
    with pytest.raises(RunError) as err:
        verify(model, "refuse", cpu=AVX2)
    assert str(err.value) == (
        f"{path}: model was quantized for vnni (full-range int8 weights) but this CPU has no "
        "VNNI: int16 accumulation saturates and answers drift; re-quantize it in the run it "
        "came from: `lightship quantize --run RUN --target avx2` (or start with --isa-check warn "
        "to serve it)"
    )
    with caplog.at_level(logging.WARNING):
        verify(model, "warn", cpu=AVX2)
    assert f"{path}: model was quantized for vnni" in caplog.text
    assert "serving it anyway (--isa-check warn)" in caplog.text
    verify(model, "refuse", cpu=VNNI)  # the CPU it was made for
    fp32 = choose(ServeSettings(run=handmade_onnx(tmp_path / "fp32.onnx")))
    verify(fp32, "refuse", cpu=AVX2)  # no target in its metadata: runs anywhere


def test_on_a_gpu_an_int8_model_is_judged_by_tensorrt_not_this_cpu(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On --device cuda the CPU check refused a model quantized for TensorRT ("re-quantize it
    for this CPU"), and passed one made for a CPU, whose asymmetric int8 TensorRT does not run."""
    trt = choose(ServeSettings(run=int8_file(tmp_path / "trt.onnx", "tensorrt")))
    with pytest.raises(RunError, match="quantized for TensorRT"):
        verify(trt, "refuse", cpu=VNNI)  # on the CPU: refused, as before
    with caplog.at_level(logging.WARNING):
        verify(trt, "refuse", cpu=AVX2, device="cuda:0")
        assert caplog.text == ""
        cpu_made = choose(ServeSettings(run=int8_file(tmp_path / "vnni.onnx", "vnni")))
        verify(cpu_made, "refuse", cpu=AVX2, device="cuda")  # not refused for this CPU's sake
    assert "was quantized for a CPU (vnni: asymmetric int8, which TensorRT does not run)" in (
        caplog.text
    )


def test_a_model_replaced_while_it_loads_is_not_served(
    exported_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file was hashed, then opened again to load: one a stage renamed in meanwhile was
    served under the old manifest entry, never checked."""
    import shutil
    import socket

    from lightship.serve import app as serve_app
    from lightship.serve.model import ServedModel

    run = tmp_path / "run"
    shutil.copytree(exported_run, run)
    real_load = ServedModel.load

    def load_replaced(self: ServedModel, *args: object, **kwargs: object) -> object:
        predictor = real_load(self, *args, **kwargs)  # type: ignore[arg-type]
        self.path.write_bytes(self.path.read_bytes() + b"\0")  # a quantize's rename, say
        return predictor

    monkeypatch.setattr(ServedModel, "load", load_replaced)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        with pytest.raises(RunError) as err:
            serve_app._serve_on(sock, ServeSettings(run=run, variant="onnx-fp32"))
    finally:
        sock.close()
    assert str(err.value) == (
        f"{run}/export/model.onnx differs from its manifest entry (sha256): it was replaced "
        "while it loaded; start the server again"
    )


def test_a_variant_made_from_another_runs_model_is_not_served(tmp_path: Path) -> None:
    """Another run's model.onnx of the same input, copied in with its manifest entry, passed
    every check (the sha256 is its entry's, the shape the run's) and was served as this run's.
    Its entry says what it was made from, which is not this run's best.ckpt."""
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "quantize").mkdir()
    model = handmade_onnx(run / "export" / "model.onnx")
    rd = RunDir(run)
    rd.record("checkpoint", {"file": "best.ckpt", "sha256": "a" * 64})
    entry = {"file": "export/model.onnx", "sha256": sha256_file(model), "format": "onnx"}
    rd.record("onnx-fp32", {**entry, "source_checkpoint_sha256": "a" * 64})
    verify(choose(ServeSettings(run=run, variant="onnx-fp32")))  # this run's: served
    int8 = handmade_onnx(run / "quantize" / "model.int8-static.onnx", bias=1.0)
    rd.record(
        "onnx-int8-static",
        {"file": "quantize/model.int8-static.onnx", "sha256": sha256_file(int8),
         "source_sha256": "c" * 64},
    )  # fmt: skip
    rd.record("onnx-fp32", {**entry, "source_checkpoint_sha256": "b" * 64})
    for variant, made_from in (
        ("onnx-fp32", "another checkpoint than the run's best.ckpt (its source_checkpoint_sha256 "
         "is not checkpoint's sha256)"),
        ("onnx-int8-static", "another model.onnx than the run's (its source_sha256 is not "
         "onnx-fp32's sha256)"),
    ):  # fmt: skip
        with pytest.raises(RunError) as err:
            verify(choose(ServeSettings(run=run, variant=variant)))
        assert str(err.value).startswith(
            f"{variant} is not this run's model: it was made from {made_from}; "
        ), str(err.value)
    # both copied in: the int8 model was made from the model.onnx listed, another run's
    entries = rd.manifest()["artifacts"]
    rd.record("onnx-int8-static", {**entries["onnx-int8-static"], "source_sha256": entry["sha256"]})
    with pytest.raises(RunError) as err:
        verify(choose(ServeSettings(run=run, variant="onnx-int8-static")))
    assert str(err.value).startswith(
        "onnx-int8-static is not this run's model: it was made from onnx-fp32, which was made "
        "from another checkpoint than the run's best.ckpt"
    ), str(err.value)
    # served as a lone file of the run, it is said by its path, not as "file"
    with pytest.raises(RunError) as err:
        verify(choose(ServeSettings(run=int8)))
    assert str(err.value).startswith(f"{int8} is not this run's model: "), str(err.value)
    # nor does a manifest.json link that leads nowhere let the lone file go unchecked
    (run / "manifest.json").unlink()
    (run / "manifest.json").symlink_to(tmp_path / "gone.json")
    with pytest.raises(RunError, match="manifest.json is a symbolic link to .*gone.json"):
        choose(ServeSettings(run=int8))


def test_a_run_model_onnxruntime_cannot_load_names_the_runs_command(tmp_path: Path) -> None:
    """Its fix was the runtime's, which knows no run: "make it again (`lightship export`, or
    `lightship quantize` for an int8 model)", with no --run and no format."""
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "best.ckpt").write_bytes(b"weights")
    (run / "export" / "model.onnx").write_bytes(b"\x08\x01garbage" * 300)
    RunDir(run).record("onnx-fp32", {"file": "export/model.onnx", "format": "onnx"})
    with pytest.raises(RunError) as err:
        choose(ServeSettings(run=run, variant="onnx-fp32")).load()
    message = str(err.value)
    assert message.startswith(f"cannot load ONNX model {run}/export/model.onnx (")
    assert message.endswith(f"): re-run `lightship export --run {run} --formats onnx`")
