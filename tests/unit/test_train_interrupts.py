"""What a train or export stopped by a signal leaves: SIGTERM as Ctrl-C, and after kill -9 the
next stage on the run cleans up (temporary files) or puts back (a training's set-aside files)."""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from lightship import cli, runs
from lightship.runs import RunDir, lock_run, sha256_file, stage_command
from tests.conftest import CONFIGS, last_line, run_cli
from tests.failing_models import SmallCNN

TINY = str(CONFIGS / "tiny.yaml")
MODEL = f"{__name__}:SignalledWhileFitting"


class SignalledWhileFitting(SmallCNN):
    """Its `steps`-th forward pass in training mode sends its own process `signal` (by name)."""

    def __init__(
        self, in_channels: int, num_classes: int, image_size: int, steps: int, signal: str
    ) -> None:
        super().__init__(in_channels, num_classes, image_size)
        self.steps, self.signal, self.calls = steps, signal, 0

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.steps:
                os.kill(os.getpid(), getattr(signal, self.signal))
        return super().forward(x)


def signalled(steps: int, sig: str) -> list[str]:
    return [
        "--set",
        f"model.name={MODEL}",
        "--set",
        f"model.kwargs={{steps: {steps}, signal: {sig}}}",
    ]


def test_sigterm_stops_a_command_as_ctrl_c_does_with_exit_143(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    signal_handlers: None,
) -> None:
    import lightship.train

    def terminated(*_: object, **__: object) -> None:
        runs.note_interrupt("resume with it")
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(lightship.train, "fit", terminated)
    monkeypatch.setattr(sys, "argv", ["lightship", "train", "--run", str(tmp_path)])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 143
    assert capsys.readouterr().err == "interrupted: resume with it\n"


def test_sigterm_during_export_leaves_no_temporary_file(
    tiny_run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    signal_handlers: None,
) -> None:
    from lightship.export import core

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)

    def writer(model: object, x: object, path: Path, meta: object) -> dict[str, object]:
        path.write_bytes(b"half an onnx file")
        os.kill(os.getpid(), signal.SIGTERM)
        return {}

    monkeypatch.setattr(core, "_writers", lambda opset: {"onnx": writer})
    assert cli._invoke(["export", "--run", str(run), "--formats", "onnx"]) == 143
    assert list((run / "export").iterdir()) == []
    assert "onnx-fp32" not in RunDir(run).manifest()["artifacts"]


def test_an_export_stopped_between_formats_keeps_and_names_those_done(
    tiny_run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    signal_handlers: None,
) -> None:
    from lightship.export import core

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    real = core._writers(18)

    def stopped(model: object, x: object, path: Path, meta: object) -> dict[str, object]:
        raise KeyboardInterrupt  # Ctrl-C while torch traces

    monkeypatch.setattr(core, "_writers", lambda opset: {**real, "torchscript": stopped})
    # the export's own options are kept in the command (it dropped --opset and --atol)
    argv = ["export", "--run", str(run), "--formats", "onnx,torchscript", "--opset", "17"]
    assert cli._invoke([*argv, "--atol", "0.001"]) == 130
    # it ended with a bare "interrupted"
    assert capsys.readouterr().err.splitlines()[-1] == (
        "interrupted: onnx exported and kept; export the rest with `"
        + stage_command(
            f"make export RUN={run} EXPORT_ARGS='--formats torchscript --opset 17 --atol 0.001'",
            f"lightship export --run {run} --formats torchscript --opset 17 --atol 0.001",
            run,
        )
        + "`"
    )
    entry = RunDir(run).manifest()["artifacts"]["onnx-fp32"]
    assert entry["sha256"] == sha256_file(run / entry["file"])
    assert [p.name for p in (run / "export").iterdir()] == ["model.onnx"]


def test_a_stage_deletes_the_temporary_files_a_killed_one_left(tmp_path: Path) -> None:
    left = [
        tmp_path / "export" / ".model.k2x_9abc.tmp.onnx",
        tmp_path / "checkpoints" / ".last.q1w2e3r4.tmp.ckpt",
        tmp_path / ".manifest.a1b2c3d4.tmp.json",
    ]
    kept = [tmp_path / "export" / "model.onnx", tmp_path / "checkpoints" / "last.ckpt"]
    for path in [*left, *kept]:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x")
    with lock_run(tmp_path, "lightship export"):
        assert [p for p in left if p.exists()] == []
        assert all(p.exists() for p in kept)


def test_sigterm_while_fitting_before_a_checkpoint_leaves_the_run_as_it_was(
    tiny_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()}
    proc = run_cli("train", "--run", str(run), "--config", TINY, *signalled(3, "SIGTERM"))
    assert proc.returncode == 143, proc.stderr
    assert last_line(proc.stderr) == (
        f"interrupted: {run} is as it was (no checkpoint was written yet)"
    )
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()} == before
    assert not list(run.glob(".previous.*"))


def test_a_training_killed_before_its_first_checkpoint_is_undone_by_the_next_train(
    tiny_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()}
    config = (run / "config.yaml").read_text()
    proc = run_cli("train", "--run", str(run), "--config", TINY, *signalled(3, "SIGKILL"))
    assert proc.returncode == -signal.SIGKILL
    assert list(run.glob(".previous.*"))  # what kill -9 leaves: nothing runs after it
    # config.yaml still describes best.ckpt and its exports: the killed training's is written
    # only with its first checkpoint (it used to be written at once and stay until a train put
    # back the old one)
    assert (run / "config.yaml").read_text() == config

    proc = run_cli("train", "--run", str(run), "--resume", check=True)
    assert proc.stdout.startswith(
        f"{run}: put back the checkpoints and config.yaml that a training stopped before its "
        "first checkpoint had set aside\n"
    )
    assert "nothing to train" in proc.stdout
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()} == before
    assert (run / "config.yaml").read_text() == config
    assert not list(run.glob(".previous.*"))


def test_a_training_killed_after_its_first_checkpoint_resumes_and_drops_the_old_files(
    tiny_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    steps = 2 * 10 + 2  # tiny: 10 steps an epoch, so two epochs' checkpoints are written
    proc = run_cli("train", "--run", str(run), "--config", TINY, *signalled(steps, "SIGKILL"))
    assert proc.returncode == -signal.SIGKILL
    new_last = sha256_file(run / "checkpoints" / "last.ckpt")
    assert MODEL in (run / "config.yaml").read_text()  # what --resume continues: the new one

    # the resumed epochs take 20 forward passes, fewer than `steps`: no kill this time
    proc = run_cli("train", "--run", str(run), "--resume", check=True)
    assert proc.stdout.startswith(
        f"{run}: deleted the old checkpoints a stopped training had set aside\n"
    )
    assert f"resuming {run} from {run / 'checkpoints' / 'last.ckpt'} (global step 20)" in (
        proc.stdout
    )
    assert not list(run.glob(".previous.*"))
    assert sha256_file(run / "checkpoints" / "last.ckpt") != new_last
    best = torch.load(run / "best.ckpt", weights_only=True)
    assert best["hyper_parameters"]["model_spec"]["name"] == MODEL


def test_training_afresh_over_an_unfinished_training_says_how_to_keep_it(tmp_path: Path) -> None:
    """A new run killed after two epochs (out of memory, say), then its command again: it
    started over without a word, and the killed one's epochs went with its first checkpoint."""
    run = tmp_path / "fresh"
    proc = run_cli("train", "--run", str(run), "--config", TINY, *signalled(22, "SIGKILL"))
    assert proc.returncode == -signal.SIGKILL
    assert (run / "checkpoints" / "last.ckpt").is_file() and not (run / "best.ckpt").exists()
    proc = run_cli("train", "--run", str(run), "--config", TINY, check=True)
    (note,) = [line for line in proc.stderr.splitlines() if line.startswith("note: ")]
    assert note.startswith(f"note: {run} holds an unfinished training (checkpoints/last.ckpt")
    assert note.endswith(f"resume it: `make train RESUME=1 RUN={run}`"), note
    # a finished run trained again is what was asked: no note
    proc = run_cli("train", "--run", str(run), "--config", TINY, check=True)
    assert "unfinished training" not in proc.stderr


def test_sigterm_while_fitting_a_new_run_says_to_train_it_again(tmp_path: Path) -> None:
    # it said "runs/fresh is as it was", of a folder it had made, with a config.yaml in it
    run = tmp_path / "fresh"
    proc = run_cli("train", "--run", str(run), "--config", TINY, *signalled(3, "SIGTERM"))
    assert proc.returncode == 143, proc.stderr
    assert last_line(proc.stderr) == (  # MODEL is in this folder's tests: PYTHONPATH=.
        f"interrupted: no checkpoint was written yet: train {run} again with "
        f"`PYTHONPATH=. make train RUN={run} CONFIG={run / 'config.yaml'}`"
    )
    assert "Received SIGTERM" not in proc.stderr  # Lightning's own line for the same stop
    assert list((run / "checkpoints").iterdir()) == []
    assert not list(run.glob(".previous.*"))


def test_a_first_checkpoint_that_cannot_be_written_leaves_the_old_config(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # config.yaml changes as the first checkpoint is saved, just before its file is written:
    # a full disk then puts back the old one with the old checkpoints
    from lightship.callbacks import AtomicCheckpointIO

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()}
    config = (run / "config.yaml").read_text()
    written: list[str] = []

    def full(
        self: object, checkpoint: object, path: object, storage_options: object = None
    ) -> None:
        written.append((run / "config.yaml").read_text())
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", full)
    argv = ["train", "--run", str(run), "--config", TINY, "--set", "trainer.max_epochs=1"]
    with pytest.raises(OSError, match="No space left"):  # main() says it in one line
        cli._invoke([*argv, "--set", "optim.lr=0.001"])
    assert "lr: 0.001" in written[0] and "lr: 0.001" not in config  # the new one, for a moment
    assert (run / "config.yaml").read_text() == config
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()} == before
    assert not list(run.glob(".previous.*"))


def test_a_stop_while_the_new_best_is_evaluated_keeps_best_ckpt_beside_its_entry(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signal_handlers: None
) -> None:
    # best.ckpt was renamed into place, then evaluated, then recorded: a stop in between left
    # the new file beside the old file's manifest entry
    fit = importlib.import_module("lightship.train.fit")  # the package exports fit()

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    old = (run / "best.ckpt").read_bytes()

    def stopped(*_: object, **__: object) -> float:
        raise KeyboardInterrupt

    monkeypatch.setattr(fit, "evaluate", stopped)
    argv = ["train", "--run", str(run), "--config", TINY, "--set", "trainer.max_epochs=1"]
    assert cli._invoke([*argv, "--set", "optim.lr=0.001"]) == 130  # other weights: a new best
    assert (run / "best.ckpt").read_bytes() == old
    entry = RunDir(run).artifact("checkpoint")
    assert entry is not None and entry["sha256"] == sha256_file(run / "best.ckpt")


def test_fit_called_from_python_puts_back_what_a_killed_training_set_aside(
    tiny_run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # only the CLI did: a training started from Python found the run without its checkpoints
    from lightship.config import load_config

    fit = importlib.import_module("lightship.train.fit")
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()}
    stash = run / f"{runs.SET_ASIDE_PREFIX}killed"  # as a training kill -9'd at once leaves it
    stash.mkdir()
    for ckpt in (run / "checkpoints").iterdir():
        os.replace(ckpt, stash / ckpt.name)
    seen: list[set[str]] = []
    monkeypatch.setattr(
        fit, "_fit", lambda cfg, rd, resume: seen.append({p.name for p in rd.checkpoints.iterdir()})
    )
    fit.fit(load_config(Path(TINY)), RunDir(run))
    assert seen == [set(before)]
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()} == before
    assert not stash.exists()
    assert "put back the checkpoints and config.yaml" in capsys.readouterr().out


def test_ctrl_c_in_fit_called_from_python_ends_its_traceback_with_how_to_resume(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signal_handlers: None
) -> None:
    # the CLI's last line said it; from Python (a notebook) the KeyboardInterrupt said nothing
    from lightship.config import load_config

    fit = importlib.import_module("lightship.train.fit")
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)

    def stopped(*_: object, **__: object) -> float:
        raise KeyboardInterrupt

    monkeypatch.setattr(runs, "_interrupt_note", [])
    cfg = load_config(Path(TINY), ["trainer.max_epochs=1", "optim.lr=0.001"])
    with monkeypatch.context() as m:
        m.setattr(fit, "fit_trainer", stopped)  # before its first checkpoint
        with pytest.raises(KeyboardInterrupt) as err:
            fit.fit(cfg, RunDir(run))
    assert err.value.__notes__ == [
        f"interrupted: {run} is as it was (no checkpoint was written yet)"
    ]
    monkeypatch.setattr(fit, "evaluate", stopped)  # trained: last.ckpt is written
    with pytest.raises(KeyboardInterrupt) as err:
        fit.fit(cfg, RunDir(run))
    assert err.value.__notes__ == [
        f"interrupted: the training finished; resume with {RunDir(run).train_command()} to "
        "evaluate it and write best.ckpt"
    ]


def _old_run(tmp_path: Path) -> tuple[RunDir, dict[str, bytes]]:
    """A run with three checkpoints and a config.yaml, each file its own bytes."""
    run = RunDir(tmp_path / "run")
    run.checkpoints.mkdir(parents=True)
    for name in ("epoch=02.ckpt", "epoch=03.ckpt", "last.ckpt"):
        (run.checkpoints / name).write_bytes(name.encode())
    run.config.write_text("old: config\n")
    return run, {**{p.name: p.read_bytes() for p in run.checkpoints.iterdir()}, "config": b""}


def _contents(run: RunDir) -> dict[str, bytes]:
    return {**{p.name: p.read_bytes() for p in run.checkpoints.iterdir()}, "config": b""}


@pytest.mark.usefixtures("signal_handlers")  # SIGINT ignored where CI starts it
@pytest.mark.parametrize("at", [1, 2, 3])
def test_a_stop_while_the_old_checkpoints_are_set_aside_keeps_every_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: int
) -> None:
    """Ctrl-C between two of the moves: those not moved yet were deleted as a failed
    training's own, and the run was said to be "as it was" with last.ckpt alone left."""
    fit = importlib.import_module("lightship.train.fit")  # `lightship.train.fit` is the function
    run, before = _old_run(tmp_path)
    moves = 0
    replace = os.replace

    def stopped(src: object, dst: object) -> None:
        nonlocal moves
        replace(src, dst)  # type: ignore[arg-type]
        moves += 1
        if moves == at:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(fit.os, "replace", stopped)
    with pytest.raises(KeyboardInterrupt), fit._replacing_previous(run, keep=False):
        raise AssertionError("the stop is raised once the checkpoints are all set aside")
    monkeypatch.setattr(fit.os, "replace", replace)
    assert _contents(run) == before
    assert run.config.read_text() == "old: config\n"
    assert not list(run.root.glob(".previous.*"))


def test_what_a_kill_left_half_set_aside_or_half_put_back_goes_back_whole(
    tmp_path: Path,
) -> None:
    """kill -9 while a stash was filled (or emptied): the next training's recovery deleted
    the old checkpoints still beside it as if a training had written them."""
    run, before = _old_run(tmp_path)
    # filled as far as last.ckpt: the other checkpoints were still beside it
    stash = run.set_aside()
    os.replace(run.last_ckpt, stash / "last.ckpt")
    assert run.recover_set_aside() is not None
    assert _contents(run) == before and not stash.exists()
    # put back as far as one checkpoint: last.ckpt goes back last
    stash = run.set_aside()
    for name in ("last.ckpt", "epoch=03.ckpt"):
        os.replace(run.checkpoints / name, stash / name)
    os.replace(run.config, stash / "config.yaml")
    assert run.recover_set_aside() is not None
    assert _contents(run) == before and run.config.read_text() == "old: config\n"
    # filled whole, and the training wrote a checkpoint of its own but no last.ckpt: it goes
    stash = run.set_aside()
    for old in list(run.checkpoints.iterdir()):
        os.replace(old, stash / old.name)
    (stash / runs.SET_ASIDE_DONE).touch()
    (run.checkpoints / "epoch=00.ckpt").write_bytes(b"new")
    assert run.recover_set_aside() is not None
    assert _contents(run) == before and not list(run.root.glob(".previous.*"))


@pytest.mark.usefixtures("signal_handlers")  # SIGINT ignored where CI starts it
def test_a_second_stop_before_the_put_back_keeps_the_old_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C, then another as the failure was handled, before the put-back began: the stash
    was deleted on the way out, every old checkpoint with it."""
    fit = importlib.import_module("lightship.train.fit")
    run, before = _old_run(tmp_path)
    is_file = Path.is_file

    def second_stop(path: Path) -> bool:
        if path == run.last_ckpt and list(run.root.glob(".previous.*/.done")):
            signal.raise_signal(signal.SIGINT)  # as the handler asks whether one was written
        return is_file(path)

    with pytest.raises(KeyboardInterrupt), fit._replacing_previous(run, keep=False):
        monkeypatch.setattr(Path, "is_file", second_stop)
        raise KeyboardInterrupt
    monkeypatch.setattr(Path, "is_file", is_file)
    assert _contents(run) == before and run.config.read_text() == "old: config\n"
    assert not list(run.root.glob(".previous.*"))


def test_an_outdated_stash_deleted_halfway_is_never_put_back(tmp_path: Path) -> None:
    """A kill -9 while the old checkpoints were deleted after the new training finished: the
    rest of them was put back over the new run by the next training (its config.yaml too)."""
    run, _ = _old_run(tmp_path)
    stash = run.set_aside()
    for old in list(run.checkpoints.iterdir()):
        os.replace(old, stash / old.name)
    os.replace(run.config, stash / "config.yaml")
    (stash / runs.SET_ASIDE_DONE).touch()
    run.last_ckpt.write_bytes(b"new")
    run.config.write_text("new: config\n")
    removed: list[str] = []

    def killed_halfway(path: Any, *args: Any, **kwargs: Any) -> None:
        (Path(path) / "last.ckpt").unlink()  # what rmtree had deleted when the kill came
        removed.append(Path(path).name)
        raise SystemExit("killed")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(runs.shutil, "rmtree", killed_halfway)
        with pytest.raises(SystemExit):
            run.drop_set_aside(stash)
    assert removed[0].startswith(".outdated.")  # renamed before any file went
    assert run.recover_set_aside() is None  # nothing of it is a stash to put back
    assert runs.sweep_temporaries(run.root)  # and the next stage's lock deletes it
    assert _contents(run) == {"last.ckpt": b"new", "config": b""}
    assert run.config.read_text() == "new: config\n"
    assert not [p for p in run.root.iterdir() if p.name.startswith(".")]


def test_a_diverged_trainings_put_back_removes_its_last_ckpt_first(tmp_path: Path) -> None:
    """Stopped after deleting another of its checkpoints but not last.ckpt, the next
    training's recovery took the diverged last.ckpt for a finished training and deleted the
    old run."""
    run, before = _old_run(tmp_path)
    stash = run.set_aside()
    for old in [run.last_ckpt, *run.checkpoints.iterdir()]:
        if old.exists():
            os.replace(old, stash / old.name)
    (stash / runs.SET_ASIDE_DONE).touch()
    for name in ("epoch=00.ckpt", "last.ckpt", "epoch=01.ckpt"):
        (run.checkpoints / name).write_bytes(b"diverged")
    unlinked: list[str] = []
    unlink = Path.unlink

    def first_only(path: Path, missing_ok: bool = False) -> None:
        if path.suffix == ".ckpt" and unlinked:
            raise PermissionError(13, "Permission denied", str(path))
        if path.suffix == ".ckpt":
            unlinked.append(path.name)
        unlink(path, missing_ok=missing_ok)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Path, "unlink", first_only)
        with pytest.raises(PermissionError):
            run.put_back(stash)
    assert unlinked == ["last.ckpt"]
    assert run.recover_set_aside() is not None  # being put back: put back, not deleted
    assert _contents(run) == before
    # and where even its last.ckpt could not go, the marker made first says so all the same
    stash = run.set_aside()
    for old in list(run.checkpoints.iterdir()):
        os.replace(old, stash / old.name)
    (stash / runs.SET_ASIDE_DONE).touch()
    run.last_ckpt.write_bytes(b"diverged")

    def refused(path: Path, missing_ok: bool = False) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Path, "unlink", refused)
        with pytest.raises(PermissionError):
            run.put_back(stash)
    assert run.recover_set_aside() is not None
    assert _contents(run) == before


def test_a_new_training_of_a_run_without_last_ckpt_is_kept_after_a_kill(tmp_path: Path) -> None:
    """The old run had no last.ckpt (deleted by hand): a kill -9 after the new training's
    first last.ckpt had the next training put the old checkpoints back over the new ones."""
    run, _ = _old_run(tmp_path)
    run.last_ckpt.unlink()
    stash = run.set_aside()
    for old in list(run.checkpoints.iterdir()):
        os.replace(old, stash / old.name)
    (stash / runs.SET_ASIDE_DONE).touch()
    for name in ("epoch=00.ckpt", "last.ckpt"):
        (run.checkpoints / name).write_bytes(b"new")
    assert run.recover_set_aside() == (
        "deleted the old checkpoints a stopped training had set aside"
    )
    assert _contents(run) == {"epoch=00.ckpt": b"new", "last.ckpt": b"new", "config": b""}


def test_a_stash_that_cannot_be_renamed_to_go_stays_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was deleted file by file in place, and what a kill left of it was put back over the
    new run."""
    run, _ = _old_run(tmp_path)
    stash = run.set_aside()
    for old in list(run.checkpoints.iterdir()):
        os.replace(old, stash / old.name)
    (stash / runs.SET_ASIDE_DONE).touch()
    replace = os.replace

    def busy(src: Any, dst: Any) -> None:
        if Path(src) == stash:
            raise OSError(16, "Device or resource busy")
        replace(src, dst)

    monkeypatch.setattr(runs.os, "replace", busy)
    run.drop_set_aside(stash)
    whole = [".done", "epoch=02.ckpt", "epoch=03.ckpt", "last.ckpt"]
    assert sorted(p.name for p in stash.iterdir()) == whole


def test_a_diverged_training_whose_put_back_fails_still_says_it_diverged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint the put-back could not delete raised its PermissionError in place of
    "training diverged": the user was told of a file, not of the learning rate to lower."""
    fit = importlib.import_module("lightship.train.fit")
    run, before = _old_run(tmp_path)
    unlink = Path.unlink

    def refused(path: Path, missing_ok: bool = False) -> None:
        if path.suffix == ".ckpt":
            raise PermissionError(13, "Permission denied", str(path))
        unlink(path, missing_ok=missing_ok)

    with (
        pytest.MonkeyPatch.context() as m,
        pytest.raises(fit.Diverged, match="training diverged"),
        fit._replacing_previous(run, keep=False),
    ):
        run.last_ckpt.write_bytes(b"diverged")
        m.setattr(Path, "unlink", refused)
        raise fit.Diverged("training diverged (train_loss nan)")
    err = capsys.readouterr().err
    assert "could not put back" in err and "Permission denied" in err
    assert f"the next training of {run.root} puts them back first" in err
    assert run.recover_set_aside() is not None  # and so it does
    assert _contents(run) == before and run.config.read_text() == "old: config\n"


@pytest.mark.usefixtures("signal_handlers")  # SIGINT ignored where CI starts it
def test_a_stop_whose_put_back_fails_does_not_say_the_run_is_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C before the first checkpoint, and the old ones could not be moved back (a full
    disk): the last line said the run "is as it was" with its checkpoints/ empty."""
    fit = importlib.import_module("lightship.train.fit")
    run, before = _old_run(tmp_path)
    replace = os.replace

    def full(src: Any, dst: Any) -> None:
        if ".previous." in str(src):
            raise OSError(28, "No space left on device", str(src))
        replace(src, dst)

    with (
        pytest.MonkeyPatch.context() as m,
        pytest.raises(KeyboardInterrupt),
        fit._replacing_previous(run, keep=False),
    ):
        m.setattr(os, "replace", full)
        raise KeyboardInterrupt
    stash = next(run.root.glob(".previous.*"))
    assert runs.interrupt_note() == (
        f"no checkpoint was written yet, and the old ones wait in {stash.name}/ for the next "
        f"training of {run.root} to put back first"
    )
    assert "could not put back" in capsys.readouterr().err
    assert run.recover_set_aside() is not None  # and so it does
    assert _contents(run) == before and run.config.read_text() == "old: config\n"


def test_a_full_disk_after_the_epochs_says_to_resume_not_to_train_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """best.ckpt written, then no room for manifest.json: the CLI said "make room and run
    again", which trained every epoch again, where a resume writes the entry at once."""
    import errno

    run = tmp_path / "run"
    record = RunDir.record

    def full(self: RunDir, key: str, entry: dict[str, Any]) -> None:
        if key == "checkpoint":
            raise OSError(errno.ENOSPC, "No space left on device")
        record(self, key, entry)

    monkeypatch.setattr(RunDir, "record", full)
    monkeypatch.setattr(sys, "argv", ["lightship", "train", "--run", str(run), "--config", TINY])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 1
    resume = RunDir(run).train_command()
    assert "--resume" in resume or "RESUME=1" in resume
    assert last_line(capsys.readouterr().err) == (
        "error: no space left on the device writing a file: make room; the training "
        f"finished; resume with {resume} to evaluate it and write best.ckpt"
    )
    # ended by early stopping: the resume trains no epoch more either (`StaysStopped`); it
    # said it would, when Lightning's resume did
    stopped = tmp_path / "stopped"
    args = ["--run", str(stopped), "--config", TINY, "--set", "early_stopping.patience=0"]
    args += ["--set", "early_stopping.min_delta=10"]
    monkeypatch.setattr(sys, "argv", ["lightship", "train", *args])
    monkeypatch.setattr(runs.RunDir, "train_command", lambda *a, **k: "`resume`")
    with pytest.raises(SystemExit):
        cli.main()
    assert last_line(capsys.readouterr().err).endswith(
        "resume with `resume` to evaluate it and write best.ckpt"
    )
    monkeypatch.undo()
    monkeypatch.setattr(RunDir, "record", record)
    assert cli._invoke(["train", "--run", str(run), "--resume"]) == 0
    assert "recorded in manifest.json again" in capsys.readouterr().out
    entry = RunDir(run).artifact("checkpoint")
    assert entry is not None and entry["sha256"] == sha256_file(run / "best.ckpt")


@pytest.mark.parametrize("variable", ["LOCAL_RANK", "RANK"])
def test_a_ddp_worker_leaves_rank_zeros_stash_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    """Lightning's rank 1 re-runs the command line as rank 0 fills its stash: it put back,
    or tried to delete, what rank 0 had just set aside ("cannot rename it to delete it")."""
    run, _ = _old_run(tmp_path)
    stash = run.set_aside()
    os.replace(run.last_ckpt, stash / "last.ckpt")  # rank 0, filling it
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # as Lightning and torchrun set it
    monkeypatch.setenv(variable, "1")
    assert run.recover_set_aside() is None
    assert (stash / "last.ckpt").is_file() and not run.last_ckpt.exists()
    monkeypatch.setenv(variable, "0")  # rank 0 itself, in a later training: its own to put back
    assert run.recover_set_aside() is not None and run.last_ckpt.is_file()


def test_a_new_runs_empty_stash_goes_without_a_word(tmp_path: Path) -> None:
    """A brand-new run killed outright left a stash holding only its marker: the next training
    said it "deleted the old checkpoints a stopped training had set aside", of none."""
    run = RunDir(tmp_path / "new")
    run.checkpoints.mkdir(parents=True)
    stash = run.set_aside()
    (stash / runs.SET_ASIDE_DONE).touch()
    run.last_ckpt.write_bytes(b"its own")  # the killed training's first checkpoint
    assert run.recover_set_aside() is None
    assert not stash.exists() and run.last_ckpt.read_bytes() == b"its own"


def test_a_rank_variable_without_a_rendezvous_still_sets_the_old_checkpoints_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's rank_zero_only read RANK=3 from a container's environment: a fresh training
    over a run left the old checkpoints beside its new ones, as a DDP worker would."""
    fit = importlib.import_module("lightship.train.fit")
    run, _ = _old_run(tmp_path)
    from pytorch_lightning.utilities.rank_zero import rank_zero_only

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(rank_zero_only, "rank", 3)  # as Lightning reads it at its import
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with fit._replacing_previous(run, keep=False):
        assert list(run.checkpoints.iterdir()) == []  # set aside for the new training
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # a worker's, beside rank 0: left alone
    before = _contents(run)
    with fit._replacing_previous(run, keep=False):
        assert _contents(run) == before
