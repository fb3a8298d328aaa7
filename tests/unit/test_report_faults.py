"""`report` against what goes wrong: a variant that cannot load, Ctrl-C, a failing disk."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from lightship.report import ReportSettings, report
from lightship.report import core as report_core
from lightship.report.evaluate import candidates
from lightship.runs import RunDir, interrupt_message, sha256_file

FAST = ReportSettings(threads=1, rounds=1, seconds=0.01)


@pytest.fixture
def run(exported_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(exported_run, copy)
    return copy


def test_a_variant_its_runtime_cannot_load_is_left_out_with_the_command_to_remake_it(
    run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    onnx = run / "export" / "model.onnx"
    onnx.write_bytes(b"not an onnx model")
    rd = RunDir(run)
    entry = rd.artifact("onnx-fp32")
    assert entry is not None
    rd.record("onnx-fp32", {**entry, "sha256": sha256_file(onnx)})  # recorded, yet unloadable

    left_out: dict[str, str] = {}
    with caplog.at_level(logging.WARNING):
        found = candidates(rd, threads=1, left_out=left_out)

    assert [c.name for c in found] == ["eager", "torchscript"]
    warning = caplog.text
    assert "onnx-fp32: onnxruntime cannot load export/model.onnx" in warning, warning
    assert f"lightship export --run {run} --formats onnx" in warning, warning
    assert list(left_out) == ["onnx-fp32"]  # for report.json and report.md to name
    assert left_out["onnx-fp32"].startswith("onnxruntime cannot load export/model.onnx (")


def test_interrupted_while_measuring_says_the_old_report_stands_and_how_to_report_again(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("lightship.runs._interrupt_note", [])

    def stopped(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(report_core, "measure", stopped)
    with pytest.raises(KeyboardInterrupt):
        report(RunDir(run), FAST)

    message = interrupt_message()
    assert message.startswith(f"interrupted: {run / 'report'} is as it was"), message
    assert f"lightship report --run {run}" in message or f"make report RUN={run}" in message


def test_a_sync_that_fails_leaves_the_old_report_whole(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = run / "report"
    folder.mkdir()
    for name in ("report.json", "report.md", "pareto.png"):
        (folder / name).write_text("old")
    calls = []
    real_fsync = os.fsync

    def full_disk(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:  # the second of the three files
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        report(RunDir(run), FAST)

    # no new plot beside the old report, and no temporaries
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == {
        "report.json": b"old",
        "report.md": b"old",
        "pareto.png": b"old",
    }
