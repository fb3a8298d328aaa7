"""Each stage, called from Python, takes the run's lock as the CLI does (quantize and report:
tests/unit/test_report_faults.py, tests/unit/test_runs.py)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightship.errors import RunBusyError
from lightship.runs import RunDir
from tests.conftest import CONFIGS

BUSY = "is in use by another lightship process"


@contextlib.contextmanager
def held_by_another(run: Path) -> Iterator[None]:
    """RUN/.lock held through another open file description, as another process holds it."""
    fd = os.open(run / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def test_export_called_from_python_takes_the_runs_lock(exported_run: Path, tmp_path: Path) -> None:
    from lightship.export import export

    run = tmp_path / "run"
    shutil.copytree(exported_run, run)
    # a training of another process may be replacing best.ckpt, or a report measuring model.onnx
    with held_by_another(run):
        before = _tree(run)
        with pytest.raises(RunBusyError, match=BUSY):
            export(RunDir(run), "onnx")
        assert _tree(run) == before


def test_fit_called_from_python_takes_the_runs_lock(tmp_path: Path) -> None:
    from lightship.config import load_config
    from lightship.train import fit

    run = tmp_path / "run"
    run.mkdir()
    # an export of another process may be reading best.ckpt, which this training would replace
    with held_by_another(run), pytest.raises(RunBusyError, match=BUSY):
        fit(load_config(CONFIGS / "tiny.yaml", ["trainer.max_epochs=1"]), RunDir(run))
    assert [p.name for p in run.iterdir()] == [".lock"]
