"""Where no progress bar is drawn (CI logs, pipes), the report says what it measures."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import run_cli


def test_report_prints_one_line_per_round_without_a_terminal(
    exported_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(exported_run, run)
    proc = run_cli("report", "--run", str(run), "--rounds", "2", check=True)  # stderr: no terminal
    lines = proc.stderr.splitlines()
    assert "measuring 3 variants, 2 rounds: eager, torchscript, onnx-fp32" in lines, proc.stderr
    assert [line for line in lines if line.startswith("measured round")] == [
        "measured round 1/2",
        "measured round 2/2",
    ]
    # the next: line as every stage's, the lightship command beside make's (it had only make's)
    assert proc.stdout.splitlines()[-1] == (
        f"next: make serve RUN={run}   (or `lightship serve --run {run}`)"
    ), proc.stdout


def test_a_dumb_terminal_gets_the_lines_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """TERM=dumb on a terminal: rich draws no bar there, and the report showed nothing until
    its table."""
    from rich.console import Console

    from lightship.report.core import _progress

    monkeypatch.setenv("TERM", "dumb")
    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    with _progress(["a", "b"], 2) as on_step:
        for r in range(2):
            on_step("a", r)
            on_step("b", r)
    assert capsys.readouterr().err.splitlines() == [
        "measuring 2 variants, 2 rounds: a, b",
        "measured round 1/2",
        "measured round 2/2",
    ]
    with _progress(["eager"], 3) as on_step:  # a run with nothing exported yet
        for r in range(3):
            on_step("eager", r)
    assert capsys.readouterr().err.splitlines()[0] == "measuring 1 variant, 3 rounds: eager"
