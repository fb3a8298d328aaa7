"""Corrupt files in a run: the error's fix must work on the run as it is."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from lightship import cli
from lightship.config import Config, load_config
from lightship.errors import DataError, RunError
from lightship.runs import RunDir
from lightship.train.fit import _check_resume_schedule, _resume_checkpoint
from tests.conftest import CONFIGS


def test_a_corrupt_last_ckpt_is_answered_with_a_fresh_training_not_a_resume(
    tiny_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    last = run / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])
    with pytest.raises(RunError) as err:
        _resume_checkpoint(RunDir(run))
    newest = max((run / "checkpoints").glob("epoch=*.ckpt"), key=lambda p: p.stat().st_mtime)
    # or on from the newest top-k checkpoint, as for a lost last.ckpt: not from zero only
    assert str(err.value).endswith(
        f"delete it and train again (`make train RUN={run} CONFIG={run}/config.yaml`), or "
        f"resume from its newest checkpoint: `cp {newest} {last}`, then resume again"
    )
    shutil.copy(newest, last)  # as it says
    assert _resume_checkpoint(RunDir(run))["hyper_parameters"]["labels"]


def test_a_checkpoint_without_optimizer_settings_resumes_without_a_keyerror(
    tmp_path: Path,
) -> None:
    """A lightship checkpoint whose hyper-parameters lack `optim` (written by hand, or by a
    LitClassifier made without one): the schedule check raised KeyError: 'optim', a traceback
    where the optimizer check beside it takes the settings as absent."""
    cfg = load_config(CONFIGS / "tiny.yaml", ["optim.scheduler=cosine"])
    ckpt = {"hyper_parameters": {"labels": ["a", "b"]}}
    assert _check_resume_schedule(cfg, ckpt, RunDir(tmp_path / "run")) is True


@pytest.mark.parametrize(
    ("was", "settings", "refused"),
    [
        # cosine's T_max restored: the rate hit 0 at epoch 3 and rose again, config.yaml said 8
        ("cosine", ["trainer.max_epochs=8"], "schedule was made for 3 epochs, and past them"),
        ("cosine", ["trainer.max_epochs=2"], None),  # fewer: it stops early, as onecycle's
        ("cosine", ["trainer.max_epochs=3"], None),
        # the checkpoint's schedule restored over the config's: changed, it was not used
        ("cosine", ["optim.scheduler=none"], "optim.scheduler cosine -> none would not be used"),
        ("none", ["optim.scheduler=cosine"], "optim.scheduler none -> cosine would not be used"),
        ("none", ["trainer.max_epochs=8"], None),  # no schedule: more epochs at the same rate
    ],
)
def test_a_resume_refuses_a_schedule_it_would_not_run(
    tmp_path: Path, was: str, settings: list[str], refused: str | None
) -> None:
    cfg = load_config(CONFIGS / "tiny.yaml", [f"optim.scheduler={was}", *settings])
    ckpt: dict[str, object] = {"hyper_parameters": {"optim": {"scheduler": was}}}
    if was == "cosine":  # as CosineAnnealingLR's state_dict holds it, made for 3 epochs
        ckpt["lr_schedulers"] = [{"T_max": 3, "last_epoch": 3, "eta_min": 0}]
    run = RunDir(tmp_path / "run")
    said = _refusal(_check_resume_schedule, cfg, ckpt, run)
    if refused is None:
        assert said is None
        return
    assert said is not None and refused in said and said.startswith(f"cannot resume {run.root}")


def _refusal(check: Callable[..., object], cfg: Config, ckpt: dict, run: RunDir) -> str | None:
    """A resume check's ConfigError, as the CLI says it; None where it lets the resume go on."""
    from lightship.errors import ConfigError

    try:
        check(cfg, ckpt, run)
    except ConfigError as exc:
        return str(exc)
    return None


def test_a_training_diverged_after_its_best_checkpoint_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its loss went NaN in epoch 2: best.ckpt (epoch 1's) was kept with no word of it, and a
    `--resume` with more epochs went on from last.ckpt's NaN weights, every step NaN."""
    run = tmp_path / "run"
    args = ["--run", str(run), "--config", str(CONFIGS / "tiny.yaml")]
    model = ["--set", "model.name=tests.failing_models:DivergesAfter"]
    model += ["--set", "model.kwargs={steps: 15}", "--set", "optim.ema_decay=null"]
    assert cli._invoke(["train", *args, *model]) == 0
    err = capsys.readouterr().err
    best = RunDir(run).artifact("checkpoint")
    assert best is not None and best["source_checkpoint"].startswith("checkpoints/epoch=00")
    assert (
        "warning: the training diverged after its best checkpoint (train_loss nan): best.ckpt "
        f"is {best['source_checkpoint']}, and checkpoints/last.ckpt holds the diverged weights, "
        "so training on from it cannot help: to train further, train afresh with a lower "
        "optim.lr (now "
    ) in err


def test_a_run_trained_on_a_folder_since_refused_as_split_still_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trained on root/{train,test}/<class>/ before such folders were refused: its resume was
    refused, and the data.path the refusal gave, by the resume's own check."""
    import numpy as np
    from PIL import Image

    from lightship.data import sources

    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for cls, value in (("cat", 40), ("dog", 200)):
            (tmp_path / "imgs" / split / cls).mkdir(parents=True)
            for i in range(12):
                pixels = np.clip(rng.normal(value, 5, (8, 8)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(tmp_path / "imgs" / split / cls / f"{i}.png")
    run = tmp_path / "run"
    args = ["--run", str(run), "--config", str(CONFIGS / "tiny.yaml")]
    data = ["--set", "data.source=folder", "--set", f"data.path={tmp_path / 'imgs'}"]
    data += ["--set", "data.image_size=8", "--set", "trainer.max_epochs=1"]
    with monkeypatch.context() as m:  # as an older lightship trained it
        m.setattr(sources, "_refuse_split_layout", lambda root, classes: None)
        assert cli._invoke(["train", *args, *data]) == 0
    with pytest.raises(DataError, match="which are the splits of a data set"):
        cli._invoke(["train", "--run", str(tmp_path / "new"), *args[2:], *data])
    (run / "best.ckpt").unlink()  # a finished run's resume writes it again from its data
    assert cli._invoke(["train", "--run", str(run), "--resume"]) == 0
    assert (run / "best.ckpt").is_file()


def test_a_best_checkpoint_of_another_run_is_not_made_best_ckpt(tiny_run: Path) -> None:
    """Another run's file copied over a top-k checkpoint became best.ckpt on resume, its
    manifest entry describing last.ckpt's model, and every export was discarded for it."""
    import torch

    from lightship.train.fit import _check_same_run

    run = RunDir(tiny_run)
    last = torch.load(run.last_ckpt, weights_only=False)["hyper_parameters"]
    top = run.checkpoints / "epoch=02-val_acc=0.8513.ckpt"
    _check_same_run(dict(last), last, run, top)  # its own: nothing to say
    moved = {**last, "model_spec": {**last["model_spec"], "module_file": "/elsewhere/m.py"}}
    _check_same_run(moved, last, run, top)  # where a model's module lies is no part of it
    other = {**last, "model_spec": {**last["model_spec"], "kwargs": {"stages": [[4], [8]]}}}
    with pytest.raises(RunError) as err:
        _check_same_run(other, last, run, top)
    assert str(err.value).startswith(
        f"checkpoints/epoch=02-val_acc=0.8513.ckpt, the best checkpoint of {tiny_run}, is not "
        "this run's model (model.kwargs.stages [[8], [16]] -> [[4], [8]], against "
        f"checkpoints/last.ckpt): move it out of {run.checkpoints} and resume again"
    )
    assert str(err.value).endswith(": best.ckpt is then made from last.ckpt")


def test_a_resume_whose_config_yaml_is_gone_is_not_told_to_use_it(tmp_path: Path) -> None:
    """The built-in defaults stood in for a deleted config.yaml, and the refusal said to
    resume with that config.yaml."""
    from lightship.runs import stage_command
    from lightship.train.fit import _other_model_data

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    said = str(_other_model_data(run, ["data.image_size 16 -> 28"], False, own_config=False))
    assert said.endswith(
        "its config.yaml is missing: resume with the config it trained with (`"
        + stage_command(
            f"make train RESUME=1 RUN={run.root} CONFIG=...",
            f"lightship train --run {run.root} --resume --config ...",
            run.root,
        )
        + "`), or train without --resume"
    )
    (run.root / "config.yaml").write_text("seed: 0\n")
    said = str(_other_model_data(run, ["data.image_size 16 -> 28"], False, own_config=False))
    assert said.endswith(f"resume with the run's config ({run.config})")


def test_a_resume_of_a_run_without_checkpoints_is_not_taken_for_a_mistyped_name(
    tmp_path: Path,
) -> None:
    """A run with best.ckpt and its manifest but no checkpoints/ was told to check its name,
    with the runs beside it; a name that is no run there still is."""
    (tmp_path / "other" / "checkpoints").mkdir(parents=True)
    run = RunDir(tmp_path / "kept")
    run.root.mkdir()
    run.best_ckpt.write_bytes(b"weights")
    with pytest.raises(RunError) as err:
        _resume_checkpoint(run)
    assert "check the name" not in str(err.value)
    with pytest.raises(RunError) as err:
        _resume_checkpoint(RunDir(tmp_path / "othr"))
    assert str(err.value).endswith(
        f" (or check the name: did you mean {tmp_path / 'other'}? {tmp_path}/ holds: kept, other)"
    )


def test_an_older_runs_best_checkpoint_is_its_own_without_a_fingerprint_or_with_a_digits_path(
    tiny_run: Path,
) -> None:
    """An older lightship's checkpoints hold no data fingerprint, or a path beside digits:
    the best checkpoint a resume wrote was refused as not the run's own."""
    import torch

    from lightship.train.fit import _check_same_run

    run = RunDir(tiny_run)
    last = torch.load(run.last_ckpt, weights_only=False)["hyper_parameters"]
    top = run.checkpoints / "epoch=02-val_acc=0.8513.ckpt"
    old = {k: v for k, v in last["data_spec"].items() if k != "fingerprint"}
    for data_spec in (old, {**last["data_spec"], "path": "data/whatever"}):
        _check_same_run({**last, "data_spec": data_spec}, last, run, top)
        _check_same_run(last, {**last, "data_spec": data_spec}, run, top)


@pytest.mark.parametrize(
    ("was", "now", "refused"),
    [
        # Lightning loads the checkpoint's state_dict, the average, without the callback
        (0.9, None, "optim.ema_decay 0.9 -> null turns weight averaging off mid-run (its "),
        (None, 0.9, "optim.ema_decay null -> 0.9 turns weight averaging on mid-run (its "),
        (0.9, 0.99, None),  # the average goes on, at the new rate
        (None, None, None),
    ],
)
def test_a_resume_cannot_turn_weight_averaging_off_or_on(
    tmp_path: Path, was: float | None, now: float | None, refused: str | None
) -> None:
    from lightship.train.fit import _check_resume_averaging

    cfg = load_config(CONFIGS / "tiny.yaml", [f"optim.ema_decay={'null' if now is None else now}"])
    ckpt = {"hyper_parameters": {"optim": {"ema_decay": was}}}
    run = RunDir(tmp_path / "run")
    said = _refusal(_check_resume_averaging, cfg, ckpt, run)
    if refused is None:
        assert said is None
        return
    assert said is not None and said.startswith(f"cannot resume {run.root}: {refused}")
    assert said.endswith(
        f"keep optim.ema_decay={'null' if was is None else was}, or train afresh without --resume"
    )
    no_setting: dict = {"hyper_parameters": {"optim": {}}}  # a checkpoint written by hand
    assert _refusal(_check_resume_averaging, cfg, no_setting, run) is None


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        (["checkpoint.monitor=val_loss"], "checkpoint.monitor val_acc -> val_loss: the run's kept"),
        (["early_stopping.monitor=val_acc"], "early_stopping.monitor val_loss -> val_acc: the"),
        (["early_stopping.enabled=false"], None),  # no state to go on with
        (["checkpoint.mode=max"], None),  # the same as it followed
    ],
)
def test_a_resume_keeps_the_metrics_its_checkpoints_and_patience_were_judged_on(
    tmp_path: Path, overrides: list[str], refused: str | None
) -> None:
    """Lightning keys a callback's state by its monitor: the changed one started afresh, and
    the kept top-k files, chosen on the other metric, stayed beside the new ones for good."""
    from lightship.train.fit import _check_resume_monitors

    states = (  # as Lightning keys them in a checkpoint
        "EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}",
        "LatestBestCheckpoint{'monitor': 'val_acc', 'mode': 'max', 'every_n_train_steps': 0, "
        "'every_n_epochs': 1, 'train_time_interval': None}",
        "RandomState",
    )
    ckpt: dict = {"callbacks": {state: {} for state in states}}
    run = RunDir(tmp_path / "run")
    said = _refusal(_check_resume_monitors, load_config(None, overrides), ckpt, run)
    if refused is None:
        assert said is None
        return
    assert said is not None and said.startswith(f"cannot resume {run.root}: {refused}")
    assert said.endswith("or train afresh without --resume")


def test_a_manifest_link_that_leads_nowhere_stops_training_before_it_begins(
    tiny_run: Path, tmp_path: Path
) -> None:
    """Found only when best.ckpt was recorded, after every epoch: by then the new training's
    checkpoints had replaced the run's, and its best.ckpt was the old one."""
    from tests.conftest import last_line, run_cli

    run = tmp_path / "linked"
    shutil.copytree(tiny_run, run)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    (run / "manifest.json").unlink()
    (run / "manifest.json").symlink_to(tmp_path / "gone" / "manifest.json")
    config = shutil.copy(run / "config.yaml", tmp_path / "again.yaml")  # a training again
    proc = run_cli(
        "train", "--run", str(run), "--config", str(config), "--set", "trainer.max_epochs=1"
    )
    assert proc.returncode == 4, proc.stderr
    assert last_line(proc.stderr) == (
        f"error: {run / 'manifest.json'} is a symbolic link to {tmp_path / 'gone' / 'manifest.json'}, "
        "which cannot be read (gone, or a loop): put the run's manifest.json back in its place"
    )
    assert "Epoch" not in proc.stdout + proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
