"""Where no progress bar is drawn (CI logs, pipes), the report says what it measures."""

from __future__ import annotations

import shutil
from pathlib import Path

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
