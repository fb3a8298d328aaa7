"""What `serve` says of a --run that holds nothing to serve, and the CPU check of a lone file."""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
import pytest

from lightship.errors import RunError
from lightship.quantize.isa import CpuInfo
from lightship.runs import RunDir
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
    assert refusal(run / "export" / "model.ts") == (
        f"no such model file: {run}/export/model.ts does not exist: check the path, or make it: "
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
        "first, or choose another --variant"
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
        "VNNI: int16 accumulation saturates and answers drift; re-quantize with `lightship "
        "quantize --target avx2` (or auto on this machine) (or start with --isa-check warn to "
        "serve it)"
    )
    with caplog.at_level(logging.WARNING):
        verify(model, "warn", cpu=AVX2)
    assert f"{path}: model was quantized for vnni" in caplog.text
    assert "serving it anyway (--isa-check warn)" in caplog.text
    verify(model, "refuse", cpu=VNNI)  # the CPU it was made for
    fp32 = choose(ServeSettings(run=handmade_onnx(tmp_path / "fp32.onnx")))
    verify(fp32, "refuse", cpu=AVX2)  # no target in its metadata: runs anywhere
