"""Corrupt files in a run: the error's fix must work on the run as it is."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lightship.errors import RunError
from lightship.runs import RunDir
from lightship.train.fit import _resume_checkpoint


def test_a_corrupt_last_ckpt_is_answered_with_a_fresh_training_not_a_resume(
    tiny_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    last = run / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])
    with pytest.raises(RunError) as err:
        _resume_checkpoint(RunDir(run))
    assert str(err.value).endswith(
        f"delete it and train again (`make train RUN={run} CONFIG={run}/config.yaml`)"
    )
