"""`fit(cfg, run)`: train, keep the best checkpoint, evaluate it on the test split, record it."""

from __future__ import annotations

import ast
import contextlib
import copy
import logging
import math
import os
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.callbacks import Callback, EarlyStopping, Timer
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from pytorch_lightning.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from lightship import __version__, models
from lightship.callbacks import (
    AtomicCheckpointIO,
    LatestBestCheckpoint,
    RandomState,
    StaysStopped,
    WarmupEMA,
    early_stopped,
    evaluate,
    fit_trainer,
    progress,
)
from lightship.config import (
    Config,
    ModelConfig,
    dump_config,
    load_config,
    revalidated,
    without_unread_path,
)
from lightship.data.module import ImageDataModule, drops_last, process_share, spec_from_config
from lightship.data.sources import Splits, older_reader_cause
from lightship.errors import ConfigError, DataError, LightshipError, RunError, first_line
from lightship.models.checkpoint import (
    load_checkpoint,
    model_state,
    read_checkpoint,
    state_mismatch,
)
from lightship.runs import (
    MAKE_GOALS,
    REPORT_FILES,
    SET_ASIDE_DONE,
    RunDir,
    RunLike,
    as_run,
    atomic_path,
    atomic_write_text,
    check_the_name,
    check_writable,
    distributed_worker,
    held_stop_signals,
    lock_run,
    made_next_by_make,
    next_command,
    note_interrupt,
    sha256_file,
    stage_command,
    then_held,
    variant_of,
)
from lightship.runtime.base import caller_state_kept, random_state_kept
from lightship.train.module import LitClassifier

log = logging.getLogger(__name__)


def _input_spec(cfg: Config, mean: list[float], std: list[float]) -> dict[str, Any]:
    size = cfg.data.image_size
    return {
        "name": "input",
        "dtype": "uint8",
        "shape": ["batch", cfg.data.channels, size, size],
        "layout": "NCHW",
        "mean": mean,
        "std": std,
    }


_WORKERS_PER_CPU = 4  # data loader processes per CPU, at most


# Lightning's strategies that train in processes they start, not in this one
_SPAWNING = ("spawn", "fork", "notebook")
# What a multi-node launch sets on each node (torchrun, SLURM, by hand as Lightning documents)
_LAUNCHED = ("MASTER_ADDR", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "WORLD_SIZE")


def _check_runtime_config(cfg: Config) -> None:
    t = cfg.trainer
    cuda = torch.cuda.is_available() and t.accelerator in ("auto", "gpu", "cuda")
    if t.precision == "16-mixed" and not cuda:
        raise ConfigError(
            "trainer.precision=16-mixed needs a CUDA GPU: use bf16-mixed or 32 on CPU"
        )
    if t.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.accelerator={t.accelerator} but no CUDA device is visible: use cpu or auto"
        )
    strategy = t.strategy.lower()
    if any(word in strategy for word in _SPAWNING):
        # The processes it starts train; this one's trainer, which records the run, saw none
        # of it: "trained in 4.4 s (0 epochs, step 0)", val_acc null in the manifest
        raise ConfigError(
            f"trainer.strategy={t.strategy} trains in processes it starts, and the run would "
            "be recorded as trained for 0 epochs: use trainer.strategy=ddp (Lightning then "
            "runs this command once a device)"
        )
    if strategy == "single_device" and str(t.devices) not in ("1", "auto"):
        raise ConfigError(  # it trained on one, and the manifest said devices 2
            f"trainer.strategy=single_device trains on one device, not trainer.devices="
            f"{t.devices}: set trainer.devices=1, or use trainer.strategy=ddp"
        )
    if t.num_nodes > 1 and not any(os.environ.get(k) for k in _LAUNCHED):
        # it waits for the other nodes for ever, in C++, where SIGTERM and Ctrl-C do nothing
        raise ConfigError(
            f"trainer.num_nodes={t.num_nodes} needs the command started on every node by a "
            "launcher (torchrun, SLURM's srun) or with MASTER_ADDR, MASTER_PORT and NODE_RANK "
            "set on each: alone, it would wait for the other nodes for ever; on one machine, "
            "use trainer.devices"
        )
    # each worker is a process holding a copy of the data set: thousands exhaust the memory
    # and leave orphans when the kernel kills the run
    cpus = os.cpu_count() or 1
    if cfg.data.num_workers > _WORKERS_PER_CPU * cpus:
        raise ConfigError(
            f"data.num_workers={cfg.data.num_workers} starts that many processes on a {cpus}-CPU "
            f"machine: use 0 to {_WORKERS_PER_CPU * cpus} (0 loads in the training process)"
        )


# What a checkpoint records about the model and data, and what the user calls each; resuming
# needs them all unchanged. Data first: a data setting is what the user changed, and the model
# spec follows from it.
_RESUME_HPARAMS = {
    "data_spec": "data",
    "labels": "labels",
    "model_spec": "model",
    "input_spec": "input",
}


def _from_kept(run: RunDir) -> str:
    """The other way on, where last.ckpt is lost or corrupt: a top-k checkpoint holds the same
    training state, as of its epoch. "" where there is none."""
    kept = sorted(run.checkpoints.glob("epoch=*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not kept:
        return ""
    return (
        f", or resume from its newest checkpoint: `cp {shlex.quote(str(kept[-1]))} "
        f"{shlex.quote(str(run.last_ckpt))}`, then resume again"
    )


def _resume_checkpoint(run: RunDir) -> dict[str, Any]:
    """last.ckpt, read and checked to be a lightship Lightning checkpoint, for `--resume`."""
    if not run.last_ckpt.is_file():
        raise RunError(
            f"cannot resume: no {run.last_ckpt}: train afresh with "
            f"{run.train_command(afresh=True)}{_from_kept(run)}"
            # a mistyped name: no such run there (one with best.ckpt or a manifest is a run)
            + (
                check_the_name(run.root)
                if not any(p.exists() for p in (run.checkpoints, run.best_ckpt, run.manifest_path))
                else ""
            )
        )
    try:
        ckpt = read_checkpoint(run.last_ckpt)  # a corrupt file fails here with a one-line error
    except RunError as exc:  # training again from zero is not the only way on
        raise RunError(f"{exc}{_from_kept(run)}") from None
    hparams = ckpt.get("hyper_parameters")
    lightning_keys = ("pytorch-lightning_version", "loops", "hyper_parameters")
    missing = [k for k in lightning_keys if k not in ckpt]
    missing += [k for k in _RESUME_HPARAMS if not isinstance(hparams, dict) or k not in hparams]
    if missing:
        raise RunError(
            f"cannot resume: {run.last_ckpt} is not a lightship training checkpoint "
            f"(it lacks {', '.join(missing)}): delete it and train without --resume"
            f"{_from_kept(run)}"
        )
    return ckpt


def _changes(old: Any, new: Any, key: str) -> list[str]:
    """Dotted 'key old -> new' for each leaf where two plain-typed trees differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in dict.fromkeys([*old, *new]):
            out += _changes(old.get(k), new.get(k), f"{key}.{k}")
        return out
    return [] if old == new else [f"{key} {old!r} -> {new!r}"]


def _as_compared(key: str, value: Any) -> Any:
    """A checkpoint's hyper-parameter `key` as resumes compare it: where a model's module lies
    is no part of the model; a path an older lightship recorded beside digits reads none
    (`without_unread_path`). A copy, for the caller to take the fingerprint out of."""
    if isinstance(value, dict) and key == "model_spec":
        return {k: v for k, v in value.items() if k != "module_file"}
    if isinstance(value, dict) and key == "data_spec":
        return dict(without_unread_path(value))
    return value


def _check_resume_matches(
    hparams: dict[str, Any], lit: LitClassifier, run: RunDir, own_config: bool = False
) -> None:
    """Refuse a resume whose model or data differ from the checkpoint's (weights would not fit,
    or would silently continue on other data). `own_config`: the config is the run's own
    config.yaml as it is, so that is no fix to offer."""
    diffs: list[str] = []
    data_changed, cause = False, ""
    for key, name in _RESUME_HPARAMS.items():
        old, new = _as_compared(key, hparams[key]), _as_compared(key, lit.hparams[key])
        if key == "data_spec":  # the images themselves, when the run recorded them
            was, now = old.pop("fingerprint", None), new.pop("fingerprint", None)
            # (read at another size or channel count, the same files give other pixels)
            data_changed = was is not None and was != now and old == new
            if data_changed:
                counts = [str(f).partition(":")[0] for f in (was, now)]
                diffs.append(f"data images {counts[0]} -> {counts[1]}, or changed")
                cause = older_reader_cause(str(was), str(now), new.get("source"), new.get("path"))
        if key == "labels" and old != new:
            diffs.append(f"labels {len(old)} classes -> {len(new)}, or renamed")
        else:
            diffs += _changes(old, new, name)
    if data_changed:  # the normalisation measured on the data follows it: no news of its own
        diffs = [d for d in diffs if not d.startswith(_MEASURED_ON_DATA)]
    if diffs:
        raise _other_model_data(run, diffs, data_changed, own_config, cause)


def _check_same_run(hparams: dict[str, Any], last: dict[str, Any], run: RunDir, best: Path) -> None:
    """A best checkpoint a resume did not write (`best`, a top-k file of before) is the same
    model on the same data as last.ckpt (`last`: its hyper-parameters, checked against the
    config). Another run's file copied there became best.ckpt, its manifest entry describing
    the model last.ckpt holds, and every export was discarded for it."""
    diffs: list[str] = []
    for key, name in _RESUME_HPARAMS.items():
        # as `_check_resume_matches` compares them; an older lightship's hold no fingerprint
        old, new = _as_compared(key, last.get(key)), _as_compared(key, hparams.get(key))
        both = key == "data_spec" and isinstance(old, dict) and isinstance(new, dict)
        if both and None in (old.get("fingerprint"), new.get("fingerprint")):
            old.pop("fingerprint", None)
            new.pop("fingerprint", None)
        diffs += _changes(old, new, name)
    if diffs:
        shown = "; ".join(diffs[:3]) + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")
        raise RunError(
            f"{run.relative(best)}, the best checkpoint of {run.root}, is not this run's model "
            f"({shown}, against checkpoints/last.ckpt): move it out of {run.checkpoints} and "
            f"resume again ({run.train_command()}): best.ckpt is then made from last.ckpt"
        )


# What training measures on the data when the config does not set it: the pixel mean and std
_MEASURED_ON_DATA = ("model.mean ", "model.std ", "input.mean ", "input.std ")


def _other_model_data(
    run: RunDir, diffs: list[str], data_changed: bool, own_config: bool, cause: str = ""
) -> LightshipError:
    """The refusal of a resume whose model or data differ (`diffs`), by its cause: the data
    changed (with `cause`, `sources.older_reader_cause`), or reads otherwise, or the config."""
    shown = "; ".join(diffs[:3]) + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")
    # on the data as it is now, with the run's own config (make's target in the checkout)
    afresh = f"train afresh with {run.train_command(afresh=True)}"
    if data_changed:  # a data error (exit 3), as quantize and report say it
        return DataError(
            f"cannot resume {run.root}: its data changed since it trained ({shown}){cause}: "
            f"put the data back as it was, or {afresh}"
        )
    if own_config and all(d.startswith(_MEASURED_ON_DATA) for d in diffs):
        # The run's own config, and only the mean/std measured on its data moved: the data
        # reads otherwise (a run with no fingerprint, which an older lightship trained)
        return DataError(
            f"cannot resume {run.root}: the pixel mean/std measured on its data moved since it "
            f"trained ({shown}): the data changed, or an older lightship trained the run and "
            f"read it otherwise; put the data back as it was, or {afresh}"
        )
    return ConfigError(
        f"cannot resume {run.root}: it was trained with a different model/data ({shown}): "
        + (
            f"its {run.config.name} and checkpoints/last.ckpt disagree: put back the "
            f"config.yaml or last.ckpt the run trained with, or {afresh}"
            if own_config
            else f"train without --resume, or resume with the run's config ({run.config})"
            if run.config.is_file()
            # deleted: the built-in defaults stood in for it
            else f"its {run.config.name} is missing: resume with the config it trained with "
            f"(`{_resume_with_config(run)}`), or train without --resume"
        )
    )


def _resume_with_config(run: RunDir) -> str:
    """The command that resumes `run` with a config given (its own config.yaml lost)."""
    q = shlex.quote(str(run.root))
    return stage_command(
        f"make train RESUME=1 RUN={q} CONFIG=...",
        f"lightship train --run {q} --resume --config ...",
        run.root,
    )


def _check_resume_config(
    cfg: Config, hparams: dict[str, Any], run: RunDir, own_config: bool
) -> None:
    """What `_check_resume_matches` refuses that the config alone shows (the data's settings,
    the model's name and size), checked before the epochs and the schedule: resumed with
    another model's config, the first refusal was of its max_epochs, and the next, once that
    was changed as told, of the model."""
    data = spec_from_config(cfg.data).to_dict()
    model = {
        "name": cfg.model.name,
        "kwargs": dict(cfg.model.kwargs),
        "in_channels": cfg.data.channels,
        "image_size": cfg.data.image_size,
    }
    was_data = dict(without_unread_path(hparams["data_spec"]))
    was_model = hparams["model_spec"]
    diffs = [
        *_changes(
            {k: was_data.get(k) for k in data if k != "fingerprint"},
            {k: v for k, v in data.items() if k != "fingerprint"},
            "data",
        ),
        *_changes({k: was_model.get(k) for k in model}, model, "model"),
    ]
    if diffs:
        raise _other_model_data(run, diffs, False, own_config)


def _check_resume_weights(ckpt: dict[str, Any], lit: LitClassifier, run: RunDir) -> None:
    """Weights the model, as its code builds it now, cannot take: its code changed since the
    run trained (the config, checked before, did not). Lightning's own load was a traceback.
    Loaded here, they are what fitting restores anyway."""
    try:
        lit.model.load_state_dict(model_state(ckpt))
    except RuntimeError as exc:
        raise RunError(
            f"cannot resume {run.root}: checkpoints/last.ckpt does not fit model "
            f"{lit.hparams['model_spec']['name']} as its code builds it now "
            f"({state_mismatch(exc)}): put back the model code it trained with, or train "
            f"afresh: {run.train_command(True, models.spec_pythonpath(lit.hparams['model_spec']))}"
        ) from None


def _check_resume_epochs(cfg: Config, ckpt: dict[str, Any], run: RunDir) -> None:
    """A max_epochs below the epochs the checkpoint finished: Lightning refuses it only as
    fitting starts, with no fix (or, one epoch below, trains nothing). Said here, before
    anything is written; equal, nothing is trained."""
    try:  # what Lightning counts against max_epochs
        done = int(ckpt["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"])
    except (KeyError, TypeError, ValueError):
        return  # another Lightning's layout: its own check still stands
    if cfg.trainer.max_epochs < done:
        raise ConfigError(
            f"cannot resume {run.root}: it already finished {done} epochs, more than "
            f"trainer.max_epochs={cfg.trainer.max_epochs}: resume with trainer.max_epochs={done} "
            "or more, or train afresh without --resume"
        )


# Settings that fix how many optimizer steps `trainer.fit` plans (onecycle's total_steps).
_SCHEDULE_KEYS = (
    ("trainer", "max_epochs"),
    ("trainer", "accumulate_grad_batches"),
    ("trainer", "limit_train_batches"),
    ("trainer", "devices"),
    ("trainer", "num_nodes"),
    ("data", "batch_size"),
)


# What a resume restores from the checkpoint's optimizer state, whatever the config says
_OPTIMIZER_KEYS = ("name", "lr", "weight_decay", "momentum")


def _check_resume_optimizer(
    cfg: Config, ckpt: dict[str, Any], run: RunDir, own_config: bool
) -> None:
    """A resume restores the optimizer as the checkpoint saved it (its learning rate, weight
    decay and momentum in its state): `--resume --set optim.lr=...` trained on at the old rate
    and wrote the new one to config.yaml, which then said what was not done. Momentum is SGD's
    alone, and OneCycleLR sets it as it goes: compared only where it is used. `own_config`: the
    config is the run's own config.yaml (edited since), which the fix names."""
    was = ckpt["hyper_parameters"].get("optim") or {}
    keys = list(_OPTIMIZER_KEYS)
    if was.get("name") != "sgd" or was.get("scheduler") == "onecycle":
        keys.remove("momentum")
    diffs = [
        f"optim.{key} {was[key]!r} -> {getattr(cfg.optim, key)!r}"
        for key in keys
        if key in was and was[key] != getattr(cfg.optim, key)
    ]
    if not diffs:
        return
    kept = ", ".join(f"optim.{key}: {was[key]!r}" for key in keys if key in was)
    fix = (
        f"put back the checkpoint's values in {run.config} ({kept}), or train afresh without "
        "--resume"
        if own_config
        else f"resume with the run's own config ({run.train_command()}), or train "
        "afresh without --resume"
    )
    raise ConfigError(
        f"cannot resume {run.root}: a resume goes on with the optimizer as "
        f"checkpoints/last.ckpt saved it, so {'; '.join(diffs)} would not be used: {fix}"
    )


def _check_resume_averaging(cfg: Config, ckpt: dict[str, Any], run: RunDir) -> None:
    """Weight averaging (`optim.ema_decay`) cannot be turned off or on by a resume. Off: the
    checkpoint's `state_dict` is the average, which Lightning loads without the callback, so
    training went on from the averaged weights, not from those it trained, and its optimizer
    state no longer matched them. On: the average starts at the resume, and the run's
    checkpoints before and after it validated different things. Either while config.yaml said
    the new value. Another decay is taken: the average goes on, at the new rate."""
    optim = ckpt["hyper_parameters"].get("optim") or {}
    if "ema_decay" not in optim:  # a checkpoint without the setting (written by hand)
        return
    was, now = optim["ema_decay"], cfg.optim.ema_decay
    if (was is None) == (now is None):
        return
    said = {v: "null" if v is None else f"{v!r}" for v in (was, now)}  # as --set takes them
    why = (
        "its checkpoints hold the averaged weights, and training would go on from them "
        "rather than from the weights it trained"
        if now is None
        else "its checkpoints so far validated the trained weights, and an average would "
        "start from the resume"
    )
    raise ConfigError(
        f"cannot resume {run.root}: optim.ema_decay {said[was]} -> {said[now]} turns weight "
        f"averaging {'off' if now is None else 'on'} mid-run ({why}): keep "
        f"optim.ema_decay={said[was]}, or "
        "train afresh without --resume"
    )


def _check_resume_monitors(cfg: Config, ckpt: dict[str, Any], run: RunDir) -> None:
    """The metric the checkpoints and early stopping judge by cannot change on a resume:
    Lightning keys each callback's state by its monitor, so the changed one started afresh
    while the kept top-k files, chosen on the other metric, stayed beside the new ones and were
    never deleted. Read from the state keys of the checkpoint's callbacks. A mode alone may
    differ (an older config.yaml's mode against its monitor, now following it)."""
    for key in ckpt.get("callbacks") or {}:
        name, brace, rest = str(key).partition("{")
        if name not in ("LatestBestCheckpoint", "ModelCheckpoint", "EarlyStopping") or not brace:
            continue
        try:
            was = ast.literal_eval(brace + rest).get("monitor")
        except (ValueError, SyntaxError, AttributeError):
            continue
        section = "early_stopping" if name == "EarlyStopping" else "checkpoint"
        now = getattr(cfg, section)
        if was is None or was == now.monitor or (section == "early_stopping" and not now.enabled):
            continue
        judged = "kept checkpoints were chosen" if section == "checkpoint" else "patience counted"
        raise ConfigError(
            f"cannot resume {run.root}: {section}.monitor {was} -> {now.monitor}: the run's "
            f"{judged} on {was}, which a resume goes on with: keep {section}.monitor={was}, or "
            "train afresh without --resume"
        )


def _check_resume_schedule(cfg: Config, ckpt: dict[str, Any], run: RunDir) -> bool:
    """OneCycleLR stores its total_steps; a resume planning more steps fails mid-run, fewer
    would cut the cycle short. Compare with the run's previous config, read before it is
    overwritten. False where that config.yaml is missing or unreadable (the user gave the
    config with --config): `_check_resume_steps` then checks the schedule's own length.
    Any schedule: Lightning restores the checkpoint's scheduler over the one the config makes,
    so a changed `optim.scheduler` was not used (cosine to none kept annealing, none to cosine
    counted from the resume), nor more epochs under cosine (its T_max restored: the rate hit 0
    and climbed back up), while config.yaml said otherwise."""
    was = (ckpt["hyper_parameters"].get("optim") or {}).get("scheduler")
    if was is not None and was != cfg.optim.scheduler:
        raise ConfigError(
            f"cannot resume {run.root}: a resume goes on with the learning-rate schedule "
            f"checkpoints/last.ckpt saved, so optim.scheduler {was} -> {cfg.optim.scheduler} "
            f"would not be used: keep optim.scheduler={was}, or train afresh without --resume"
        )
    t_max = _cosine_epochs(ckpt) if cfg.optim.scheduler == "cosine" else None
    if t_max is not None and cfg.trainer.max_epochs > t_max:
        raise ConfigError(
            f"cannot resume {run.root}: its cosine learning-rate schedule was made for {t_max} "
            f"epochs, and past them (trainer.max_epochs {cfg.trainer.max_epochs}) the rate "
            f"would rise again: keep trainer.max_epochs at {t_max} at most, or train afresh "
            "without --resume"
        )
    if cfg.optim.scheduler != "onecycle" and was != "onecycle":
        return True
    try:
        prev = load_config(run.config, recorded=True)
    except ConfigError:
        return False
    # Fewer epochs is allowed: the restored schedule runs on as planned and stops early
    # (a killed 100-epoch run finished at 10). More would step past its end.
    diffs = []
    for section, key in _SCHEDULE_KEYS:
        old, new = getattr(getattr(prev, section), key), getattr(getattr(cfg, section), key)
        if old != new and not (key == "max_epochs" and new < old):
            diffs.append(f"{section}.{key} {old!r} -> {new!r}")
    if prev.optim.scheduler != cfg.optim.scheduler:
        diffs.append(f"optim.scheduler {prev.optim.scheduler} -> {cfg.optim.scheduler}")
    if diffs:
        raise ConfigError(
            f"cannot resume {run.root}: the onecycle learning-rate schedule cannot be stretched "
            f"or changed on resume ({'; '.join(diffs)}): keep the run's values, "
            "or train afresh without --resume"
        )
    return True


def _cosine_epochs(ckpt: dict[str, Any]) -> int | None:
    """The T_max (epochs) of the checkpoint's CosineAnnealingLR; None where it has none."""
    try:
        return int(ckpt["lr_schedulers"][0]["T_max"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _check_resume_steps(
    cfg: Config, ckpt: dict[str, Any], run: RunDir, batches_per_epoch: int
) -> None:
    """The onecycle check of a run without a readable config.yaml: the steps these settings
    plan (as Lightning counts them for the schedule) against the total_steps the checkpoint's
    OneCycleLR was made for. More would step past its end, mid-run."""
    try:
        planned = int(ckpt["lr_schedulers"][0]["total_steps"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise ConfigError(
            f"cannot resume {run.root}: its {run.config.name} is missing or invalid and "
            "checkpoints/last.ckpt holds no onecycle schedule, so the schedule length cannot "
            "be checked: restore config.yaml, or train without --resume"
        ) from None
    t = cfg.trainer
    steps = math.ceil(batches_per_epoch / t.accumulate_grad_batches) * max(t.max_epochs, 1)
    if cfg.optim.scheduler != "onecycle" or steps > planned:
        raise ConfigError(
            f"cannot resume {run.root}: its onecycle learning-rate schedule was made for "
            f"{planned} steps, and these settings plan {steps} with optim.scheduler="
            f"{cfg.optim.scheduler}: resume with the config the run trained with (its "
            "trainer.max_epochs, data.batch_size, trainer.accumulate_grad_batches and "
            "optim.scheduler), or train afresh without --resume"
        )


def _say_data(source: str, path: Path | None, splits: Splits) -> None:
    """One line of what training reads: its images and classes, the splits' sizes and the
    smallest classes (a class of .webp files, skipped, shows here)."""
    y = np.concatenate([splits.train_y, splits.val_y, splits.test_y])
    per_class = np.bincount(y, minlength=len(splits.labels))
    fewest = ", ".join(
        f"'{splits.labels[i]}' {per_class[i]:,}" for i in np.argsort(per_class, kind="stable")[:3]
    )
    log.info(
        "data %s%s: %s images, %d classes: train %s, val %s, test %s (fewest: %s)",
        source,
        f" {path}" if path else "",
        f"{len(y):,}",
        len(splits.labels),
        f"{len(splits.train_y):,}",
        f"{len(splits.val_y):,}",
        f"{len(splits.test_y):,}",
        fewest,
    )


def _check_run_outside_data(cfg: Config, run: RunDir) -> None:
    """A run in the image folder it trains on (`--run imgs --set data.path=imgs`) wrote its
    checkpoints/ and logs/ among the class folders: the next training read them as classes
    with no images, and refused the data."""
    if cfg.data.source != "folder" or cfg.data.path is None:
        return
    data, root = cfg.data.path.expanduser().resolve(), run.root.resolve()
    if root == data or data in root.parents:
        if any(part.startswith(".") for part in root.relative_to(data).parts):
            return  # under a hidden folder (imgs/.runs/r1), which the image loader skips
        raise ConfigError(
            f"the run directory {run.root} lies in the image folder it would train on "
            f"(data.path={cfg.data.path}): its checkpoints/ and logs/ would be read as classes; "
            "give a run directory outside the data, e.g. --run "
            f"{shlex.quote(str(data.parent / 'runs' / root.name))} (or in a hidden folder of "
            f"it, which is not read: --run {shlex.quote(str(cfg.data.path / '.runs' / root.name))})"
        )


def _check_model_trains(model: torch.nn.Module, cfg: Config, num_classes: int) -> None:
    """A model that builds may still be unable to train: catch it before anything is written.
    It runs on 2 images and on 1 (a `squeeze()` drops the batch axis of one image only:
    export's and the server's batches of one) in eval mode, and on 2 in training mode, on a
    copy (BatchNorm's running statistics move), where a model may return more than logits."""
    what = f"model.name={cfg.model.name} model.kwargs={dict(cfg.model.kwargs)}"
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"{what} has no trainable parameters: choose a model that can learn")
    was_training = model.training
    try:
        with random_state_kept():  # a Dropout's mask drawn would move the training's draws
            _probe(model, what, cfg, num_classes)
    finally:
        model.train(was_training)


def _probe(model: torch.nn.Module, what: str, cfg: Config, num_classes: int) -> None:
    """`_check_model_trains`' runs of the model, each refused with its fix."""
    size, channels = cfg.data.image_size, cfg.data.channels
    # trained in batches of data.batch_size: of one, BatchNorm cannot (a traceback mid-fit)
    for n, training in ((2, False), (1, False), (min(2, cfg.data.batch_size), True)):
        x = torch.zeros(n, channels, size, size, dtype=torch.uint8)
        probe = copy.deepcopy(model) if training else model
        probe.train(training)
        mode = " in training mode" if training else ""
        try:
            with torch.no_grad():
                out = probe(x)
        except Exception as exc:  # any failure of user code: its message, on one line
            reason = first_line(exc) or type(exc).__name__
            fix = "fix the model, model.kwargs or data.image_size/channels"
            if training and n == 1:
                fix = "it cannot train in batches of one image: set data.batch_size=2 or more"
            raise ConfigError(
                f"{what} fails on a [{n}, {channels}, {size}, {size}] input{mode}: "
                f"{type(exc).__name__}: {reason}; {fix}"
            ) from None
        if not isinstance(out, torch.Tensor) or list(out.shape) != [n, num_classes]:
            raise _wrong_output(what, cfg, out, n, num_classes, mode)
        if not training and (why := models.unusable_logits(out)) is not None:
            raise ConfigError(f"{what} outputs {why}: end its forward with `.float()`")


def _wrong_output(
    what: str, cfg: Config, out: object, n: int, num_classes: int, mode: str
) -> ConfigError:
    """What is wrong with a model's output for `n` images, and how to fix it."""
    images = f"{n} image" + ("s" if n > 1 else "")
    shape = list(out.shape) if isinstance(out, torch.Tensor) else None
    if shape is None:
        fix = "return one tensor of logits" + (
            ", in training too (an auxiliary output has no loss here)" if mode else ""
        )
    elif math.prod(shape) == n * num_classes:
        fix = (
            "flatten it to [N, classes] with torch.flatten(x, 1) (squeeze() also drops the "
            "batch axis of one image)"
        )
    elif "num_classes" in cfg.model.kwargs:
        fix = "drop num_classes from model.kwargs: lightship passes the data's class count"
    elif models.takes_argument(cfg.model.name, "num_classes"):
        fix = f"it was given num_classes={num_classes}: make its output width follow it"
    else:
        fix = (
            f"it takes no num_classes argument, so it must output {num_classes} logits (the "
            f"data has {num_classes} classes) itself: make its output {num_classes} wide, "
            "or give its __init__ a num_classes argument"
        )
    return ConfigError(
        f"{what} outputs {shape or type(out).__name__} for {images}{mode}, expected "
        f"[{n}, {num_classes}] (one logit per class): {fix}"
    )


def _unknown_kwargs(cfg: Config, exc: models.UnknownModelArguments) -> ConfigError:
    """model.kwargs the model does not take, said with where they came from: a config file's
    kwargs are for the model that file names, not for a model.name given beside it."""
    source = cfg.sources.of("model.kwargs")
    kept = {k: v for k, v in cfg.model.kwargs.items() if k not in exc.unknown}
    flow = yaml.safe_dump(kept, default_flow_style=True, width=1 << 16).strip()
    fix = f"--set {shlex.quote(f'model.kwargs={flow}')}"
    written_for = cfg.sources.in_file("model.name", ModelConfig.model_fields["name"].default)
    if cfg.sources.file == source and written_for != cfg.model.name:
        origin = f"model.kwargs come from {source}, written for model {written_for}"
    else:
        origin = f"model.kwargs come from {source}"
    todo = f"drop {', '.join(exc.unknown)} with" if kept else "clear them with"
    return ConfigError(
        f"{exc.args[0].removesuffix('; check model.kwargs')}: {origin}; {todo} {fix}"
    )


def _train_batches(cfg: Config, images: int, processes: int = 1) -> int:
    """Training batches an epoch in each of `processes` (Lightning's count): under DDP each
    reads its share of the images, ceil(images / processes) as DistributedSampler pads them,
    less a last batch of one image (`drops_last`)."""
    share, size = process_share(images, processes), cfg.data.batch_size
    batches = share // size if drops_last(share, size) else math.ceil(share / size)
    limit = cfg.trainer.limit_train_batches
    if isinstance(limit, float):
        batches = int(batches * limit)
    elif isinstance(limit, int):
        batches = min(batches, limit)
    return max(batches, 1)


def _trainer(**kwargs: Any) -> pl.Trainer:
    """pl.Trainer, its refusals (devices=0, an unknown accelerator...) as one-line ConfigErrors."""
    try:
        trainer = pl.Trainer(**kwargs)
    except (MisconfigurationException, ValueError, TypeError, ImportError) as exc:
        # ImportError: a strategy whose package is missing (deepspeed)
        raise ConfigError(f"Lightning refused the trainer settings: {exc}; fix trainer.*") from None
    if isinstance(getattr(trainer.strategy, "launcher", None), _MultiProcessingLauncher):
        # strategy=auto on several devices in a notebook or `python -i` is Lightning's ddp_fork
        # (`_check_runtime_config` refuses it by name): "0 epochs, step 0" in the manifest
        raise ConfigError(
            f"trainer.strategy={kwargs.get('strategy')} with trainer.devices="
            f"{kwargs.get('devices')} trains in processes Lightning starts (it picks that in an "
            "interactive session), and the run would be recorded as trained for 0 epochs: run "
            "`lightship train` from a shell with trainer.strategy=ddp, or set trainer.devices=1"
        )
    return trainer


def _discard_derived(
    run: RunDir, new_best: bool = True, keep: Sequence[str] = ()
) -> dict[str, str] | None:
    """A new best.ckpt outdates every artifact made from the old one: unlist them and delete
    their files, the report's and any unlisted leftover, so the disk matches the manifest.
    Not `new_best`: best.ckpt stays, but the manifest that said what they were made from is
    gone, less the entries in `keep`, which record it themselves (`RunDir.made_from`). Where
    some are kept and others go, returns the stages that make only those again, with their
    options (`RunDir.remake_flags`): the next line's; None where all go or none."""
    unlisted = run.unlisted_derived()  # the report's files among them: never listed
    exports = [f for f in unlisted if f not in REPORT_FILES]
    keys = run.discard_derived(keep)
    gone = [*keys, *exports]
    reported = len(exports) < len(unlisted)
    gone += (
        ["the report"]
        if reported and not any((run.root / f).exists() for f in REPORT_FILES)
        else []
    )
    if not gone:
        return None
    # an unlisted qat.ckpt: what QAT's int8 model is made from, and made again with it
    made = [
        *keys,
        *(variant_of(Path(f.replace("qat.ckpt", "model.int8-qat.onnx"))) for f in exports),
    ]
    flags = run.remake_flags(made) if keep else None
    why = (
        f"the new best.ckpt outdates {', '.join(gone)} of this run"
        if new_best
        else f"manifest.json does not record what {', '.join(gone)} of this run were made from"
    )
    again = run.command(*flags, flags=flags) if flags else run.command("export", "quantize")
    print(f"{why}: deleted; re-run {again}", flush=True)
    return flags


def _said_kept(run: RunDir, keep: Sequence[str]) -> str:
    """The entries `keep` names, and the report where it stayed with them."""
    report = ["the report"] if (run.report_dir / "report.json").is_file() else []
    return _listed([*keep, *report])


def _listed(words: Sequence[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return ", ".join(words[:-1]) + f" and {words[-1]}" if len(words) > 1 else words[0]


def _best_state(run: RunDir, best_sha256: str) -> tuple[bool, bool]:
    """(unchanged, in_place): whether the new best checkpoint (its sha256) is the one the
    manifest records, from which its exports, quantized models and report were made, so they
    stay valid; and whether RUN/best.ckpt already is it (it may be missing, or another file)."""
    recorded = (run.artifact("checkpoint") or {}).get("sha256")
    if recorded != best_sha256:
        return False, False
    return True, run.best_ckpt.is_file() and sha256_file(run.best_ckpt) == recorded


class _ConfigAtFirstCheckpoint(Callback):
    """Writes the run's config.yaml as the training saves its first checkpoint, just before
    the file. Until then config.yaml still describes the run's best.ckpt and what was made from
    it, also after a training killed outright (kill -9); from then on it describes the
    checkpoints that `--resume` continues."""

    def __init__(self, path: Path, text: str) -> None:
        self.path, self.text, self.written = path, text, False

    def write(self) -> None:
        if not self.written:
            atomic_write_text(self.path, self.text)
            self.written = True

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.is_global_zero:
            self.write()


def _unfinished_training(run: RunDir) -> str | None:
    """What tells that the run's checkpoints/ hold a training that never chose its best
    checkpoint: last.ckpt without best.ckpt, or beside the best.ckpt of an earlier training
    (`RunDir.later_training`); None where they hold none."""
    if not run.last_ckpt.is_file():
        return None
    if not run.best_ckpt.is_file():
        return "checkpoints/last.ckpt, no best.ckpt"
    try:
        recorded = run.artifact("checkpoint")
    except RunError:  # a malformed manifest.json: its own error says so where it is read
        return None
    later = run.later_training(recorded) if recorded is not None else None
    return (
        None
        if later is None
        else f"checkpoints/last.ckpt; best.ckpt is from a training that {later}"
    )


@contextlib.contextmanager
def _replacing_previous(run: RunDir, keep: bool, env: str = "") -> Iterator[bool]:
    """A new training replaces the run's checkpoints and config.yaml, but only once it has a
    checkpoint of its own (`_ConfigAtFirstCheckpoint` writes config.yaml then): until then the
    old ones wait in a hidden folder, config.yaml's copy in its place, and a failure (a setting
    Lightning refuses as fitting starts, Ctrl-C, a full disk) puts them back. A failure after
    the first checkpoint keeps the new ones, so `--resume` continues the new training. `keep`
    (resuming): nothing is replaced. DDP workers leave the files to rank 0. What the user can
    do next is said on stderr, or, after Ctrl-C, in the CLI's last line; its command starts
    with `env`, the PYTHONPATH a user's model needs.

    Yields whether the run is new (nothing was set aside): its config.yaml is written at once,
    for the command that trains it again to name.
    """
    if distributed_worker():
        yield False
        return
    stash = None
    if not keep:
        run.checkpoints.mkdir(parents=True, exist_ok=True)
        if (unfinished := _unfinished_training(run)) is not None:
            # a training that never finished (killed, out of memory): rerunning its command
            # started over without a word, and its epochs went with the first new checkpoint
            print(
                f"note: {run.root} holds an unfinished training ({unfinished}); this new one "
                "replaces it at its first checkpoint. To keep it, stop now (Ctrl-C puts it "
                f"back) and resume it: {run.train_command(env=env)}",
                file=sys.stderr,
                flush=True,
            )
        stash = run.set_aside()
    restored = False  # put back, or to be (left for `recover_set_aside` where that failed)
    try:
        new_run = False
        try:
            if stash is not None:
                # One move with Ctrl-C and SIGTERM held: stopped halfway, the old checkpoints
                # were split between the two folders, and putting back deleted those not
                # moved yet. last.ckpt first: what `RunDir.recover_set_aside` tells a stash
                # being filled by, after a kill -9; SET_ASIDE_DONE once it is full.
                with held_stop_signals():
                    for old in [run.last_ckpt, *run.checkpoints.glob("*.ckpt"), run.config]:
                        if old.is_file():
                            os.replace(old, stash / old.name)
                    new_run = not any(stash.iterdir())
                    (stash / SET_ASIDE_DONE).touch()
                    kept = stash / run.config.name
                    if kept.is_file():  # and config.yaml back in its place until then (a copy)
                        with atomic_path(run.config) as tmp:
                            tmp.write_bytes(kept.read_bytes())
            yield new_run
        except Diverged:
            # its checkpoints are of no use, even to resume: the run is put back as it was. Held
            # from the first line: a second Ctrl-C before the put-back had the stash deleted.
            with held_stop_signals():
                if stash is not None:
                    restored = True
                    _put_back(run, stash)
            raise
        except BaseException as exc:
            with held_stop_signals():  # a second Ctrl-C (or SIGTERM) halfway lost them
                if stash is not None and not run.last_ckpt.is_file():
                    restored = True
                    # a new run keeps its folder and config.yaml: nothing was there to put back
                    what = (
                        "no checkpoint was written yet: {fixed}train {run} again with {command}"
                        if new_run
                        else "{run} is as it was (no checkpoint was written yet)"
                    )
                    if not _put_back(run, stash):
                        what = (
                            "no checkpoint was written yet, and the old ones wait in "
                            f"{stash.name}/ for the next training of {{run}} to put back first"
                        )
                else:
                    what = "{fixed}resume with {command}"
                command = run.train_command(env=env)
                # the CLI's last line after a stop, or after a full disk (`interrupt_note`)
                note_interrupt(what.format(fixed="", run=run.root, command=command))
                if not isinstance(exc, KeyboardInterrupt):
                    # after an error, not a stop: the same command fails the same way until then
                    fixed = "once the error below is fixed, "
                    said = what.format(fixed=fixed, run=run.root, command=command)
                    print(f"training stopped: {said}", file=sys.stderr, flush=True)
            raise
    finally:
        # replaced by the new training's checkpoints (it wrote its last.ckpt); one put back is
        # gone already, and any other stays for the next training to put back
        if stash is not None and not restored and run.last_ckpt.is_file():
            run.drop_set_aside(stash)


def _put_back(run: RunDir, stash: Path) -> bool:
    """`run.put_back(stash)` as a training fails: where that fails too (a file it cannot
    delete or move), a line says so and the stash stays for the next training's
    `recover_set_aside`, and the training's own error, not the put-back's, is the one raised
    (an OSError here had replaced "training diverged"). Whether they were put back."""
    try:
        run.put_back(stash)
    except OSError as exc:
        print(
            f"training stopped: could not put back the checkpoints set aside in {stash} "
            f"({exc}); the next training of {run.root} puts them back first",
            file=sys.stderr,
            flush=True,
        )
        return False
    return True


def _out_of_time(trainer: pl.Trainer) -> bool:
    """Whether fitting stopped at trainer.max_time_s (Lightning's Timer, whose elapsed time a
    resumed run restores from its checkpoint)."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    timer = next((c for c in callbacks if isinstance(c, Timer)), None)
    remaining = timer.time_remaining() if timer is not None else None
    return remaining is not None and remaining <= 0


def _kept(run: RunDir) -> tuple[str, str]:
    """What a run whose best.ckpt stays as it was keeps, said for the line that says so, and
    the stage that comes next: the first of export, quantize, report that it lacks, or serve
    (a run never exported had been told it kept "exports, quantized models and report")."""
    artifacts = run.manifest()["artifacts"]
    exported = "onnx-fp32" in artifacts
    quantized = any(k.startswith("onnx-int8-") for k in artifacts)
    reported = (run.report_dir / "report.json").is_file()
    kept = ["best.ckpt"]
    kept += ["exports"] if any(k in artifacts for k in ("onnx-fp32", "torchscript", "pt2")) else []
    kept += ["quantized models"] if quantized else []
    kept += ["report"] if reported else []
    said = _listed(kept)
    after = (
        "export"
        if not exported
        else "quantize"
        if not quantized
        else "report"
        if not reported
        else "serve"
    )
    # Run by make for another stage's sake (`make report` on a run whose best.ckpt was put
    # back), the stage make runs next is the goal's, whatever the run lacks: named, as made now
    goals = [g for g in os.environ.get(MAKE_GOALS, "").split() if g in _STAGES_AFTER]
    return said, after if made_next_by_make(after) or not goals else goals[0]


_STAGES_AFTER = ("export", "quantize", "report", "serve")


class Diverged(ConfigError):
    """The training's loss went non-finite and its best checkpoint with it: refused before it
    replaces anything (`_replacing_previous` puts the run's checkpoints back)."""


def _losses_finite(trainer: pl.Trainer) -> bool:
    """Whether the last logged losses are finite (NaN weights stay NaN: a training whose best
    checkpoint diverged ends with non-finite losses)."""
    losses = [v for k, v in trainer.callback_metrics.items() if k in ("train_loss", "val_loss")]
    return all(bool(torch.isfinite(v).all()) for v in losses)


def _check_finite(model: torch.nn.Module, x: np.ndarray, cfg: Config, trainer: pl.Trainer) -> None:
    """Refuse a training that diverged (a learning rate too high: its loss NaN) before its best
    checkpoint replaces anything. Lightning's early stopping ends it at the first non-finite
    validation loss without a word, and it said it had trained, exit 0, with a best.ckpt whose
    logits are all NaN (export refused it, 2,690 of 2,690), which had deleted the run's
    exports. One evaluation batch of the test images: NaN weights make every logit NaN."""
    with torch.inference_mode():
        x = x[: cfg.data.eval_batch_size]
        finite = bool(torch.isfinite(model(torch.from_numpy(x))).all()) if len(x) else True
    if finite:
        return
    raise Diverged(
        f"training diverged{_last_loss(trainer)}: its best checkpoint gives non-finite logits, "
        f"so it is not made best.ckpt (what the run had is kept): train again with "
        f"{_lower_lr(cfg)}"
    )


def _last_loss(trainer: pl.Trainer) -> str:
    """' (train_loss nan)', the loss a diverged training ended on, for its message."""
    loss = trainer.callback_metrics.get("train_loss")
    return f" (train_loss {float(loss):g})" if loss is not None else ""


def _lower_lr(cfg: Config) -> str:
    """What a diverged training is to be trained again with."""
    return f"a lower optim.lr (now {cfg.optim.lr:g}; --set optim.lr=...)"


def _warn_diverged_after_best(run: RunDir, best: Path, cfg: Config, trainer: pl.Trainer) -> None:
    """A training whose loss went non-finite after its best checkpoint keeps that one, and
    said nothing: its last.ckpt holds the non-finite weights, and a resume with more epochs
    went on from them, NaN at every step. (A resume is not refused: after a stop it is what
    writes best.ckpt, and a model's own buffers may hold inf.)"""
    print(
        f"warning: the training diverged after its best checkpoint{_last_loss(trainer)}: "
        f"best.ckpt is {run.relative(best)}, and checkpoints/last.ckpt holds the diverged "
        f"weights, so training on from it cannot help: to train further, train afresh with "
        f"{_lower_lr(cfg)}",
        file=sys.stderr,
        flush=True,
    )


def _own_best(run: RunDir, best_model_path: str) -> Path:
    """The best checkpoint in this run's own folder, or last.ckpt.

    Resuming a copied or moved run restores the best path recorded in the old place; the copy
    of that file here, under the same name, is the one to use (never the old run's file). One
    deleted since (by hand, in a run that finished) leaves last.ckpt.
    """
    if not best_model_path:
        return run.last_ckpt
    here = run.checkpoints / Path(best_model_path).name
    return here if here.is_file() else run.last_ckpt  # deleted since: last.ckpt


def fit(cfg: Config | str | os.PathLike[str], run: RunLike, resume: bool = False) -> RunDir:
    """Train `cfg` into the run directory `run` (a path or a RunDir) and return its RunDir.

    `cfg`: a Config (`lightship.config.load_config(path, ["trainer.max_epochs=3"])`), or the
    path of a YAML config. Writes RUN/config.yaml, checkpoints/ (last.ckpt and the best k),
    logs/, best.ckpt and its manifest.json entry, whose `test_acc` is the test split's
    accuracy (`RunDir(run).artifact("checkpoint")`). Training a run again replaces what was
    made from its old best.ckpt. `resume`: go on from RUN/checkpoints/last.ckpt (the
    config, when it is a Config, must agree with the run's own config.yaml).

    Raises a `lightship.errors.LightshipError` with a one-line fix: ConfigError (the config),
    DataError (the data), RunError (the run, its checkpoint), RunBusyError (another stage
    holds the run). Ctrl-C raises KeyboardInterrupt; the run stays resumable. The caller's
    random generators, torch's modes and thread count are as they were afterwards."""
    if isinstance(cfg, (str, os.PathLike)):
        cfg = load_config(Path(cfg))
    elif not isinstance(cfg, Config):
        raise ConfigError(
            f"fit takes a lightship Config or a YAML file's path, got {type(cfg).__name__}: "
            "build one with lightship.config.load_config(path, ['key=value', ...])"
        )
    # Held already by the CLI (re-entrant); taken here for a call from Python, as quantize and
    # report take it: no other stage may read the checkpoints, or export best.ckpt, while they
    # are replaced. Under DDP, rank 0 holds it for its workers (`runs.lock_run`).
    run = as_run(run)
    with lock_run(run.root, "lightship train", create=True):
        # What a training killed outright set aside goes back first. The CLI has done this
        # already, before reading config.yaml; a call from Python has not.
        recovered = run.recover_set_aside()
        if recovered:
            print(f"{run.root}: {recovered}", flush=True)
        # Ctrl-C while the data is read or the model checked (seconds for an image folder):
        # the CLI's last line was a bare `interrupted`
        note_interrupt(f"{run.root} is as it was (stopped before training began)")
        with caller_state_kept():
            return _fit(cfg, run, resume)


def _fit(cfg: Config, run: RunDir, resume: bool) -> RunDir:
    cfg = revalidated(cfg)  # a config changed in Python since it was loaded
    for note in cfg.sources.notes:
        print(note, flush=True)
    _check_runtime_config(cfg)
    _check_run_outside_data(cfg, run)
    resumed = _resume_checkpoint(run) if resume else None
    schedule_checked = True
    own = False  # resumed with the run's own config.yaml, as it is
    if resumed is not None:
        given = cfg.sources
        own = given.file is not None and not given.overrides and run.config.is_file()
        own = own and Path(str(given.file)).resolve() == run.config.resolve()
        _check_resume_config(cfg, resumed["hyper_parameters"], run, own)
        _check_resume_epochs(cfg, resumed, run)
        _check_resume_optimizer(cfg, resumed, run, own)
        _check_resume_averaging(cfg, resumed, run)
        _check_resume_monitors(cfg, resumed, run)
        schedule_checked = _check_resume_schedule(cfg, resumed, run)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)

    use_cuda = torch.cuda.is_available() and cfg.trainer.accelerator in ("auto", "gpu", "cuda")
    dm = ImageDataModule(
        cfg.data, pin_memory=use_cuda, check_layout=resumed is None, resumed=resumed is not None
    )
    splits = dm.splits  # data errors surface here, before anything is written
    if not distributed_worker():  # said once, by rank 0 (a DDP worker runs this too)
        _say_data(cfg.data.source, cfg.data.path, splits)
    mean, std = cfg.model.mean, cfg.model.std
    if mean is None or std is None:
        data_mean, data_std = splits.pixel_stats()
        mean, std = mean or data_mean, std or data_std
    # A user model's module file: a later stage that cannot import it says which folder to put
    # on PYTHONPATH.
    module_file = models.module_file(cfg.model.name)
    model_source = {"module_file": module_file} if module_file else {}
    model_spec = {
        "name": cfg.model.name,
        "kwargs": dict(cfg.model.kwargs),
        "in_channels": cfg.data.channels,
        "num_classes": len(splits.labels),
        "image_size": cfg.data.image_size,
        "mean": list(mean),
        "std": list(std),
        **model_source,
    }
    input_spec = _input_spec(cfg, list(mean), list(std))
    try:
        lit = LitClassifier(
            model_spec=model_spec,
            labels=list(splits.labels),
            input_spec=input_spec,
            data_spec=dm.spec.to_dict(),
            optim=cfg.optim.model_dump(),
            augment=cfg.data.augment,
        )
    except models.UnknownModelArguments as exc:
        raise _unknown_kwargs(cfg, exc) from None
    _check_model_trains(lit.model, cfg, len(splits.labels))
    if resumed is not None:
        _check_resume_matches(resumed["hyper_parameters"], lit, run, own_config=own)
        _check_resume_weights(resumed, lit, run)
    if cfg.trainer.compile:
        lit.model.compile()

    # Fail now, not after the last epoch, when an output cannot be written, or the manifest
    # that records best.ckpt cannot be read (a link to a file gone: the epochs were trained,
    # then refused, the run's checkpoints already replaced)
    run.manifest()
    check_writable(
        run.config,
        run.manifest_path,
        run.best_ckpt,
        run.last_ckpt,
        run.logs / "tensorboard" / "events",
        run.logs / "csv" / "metrics.csv",
    )
    t = cfg.trainer
    checkpoint = LatestBestCheckpoint(
        dirpath=run.checkpoints,
        filename="epoch={epoch:02d}-val_acc={val_acc:.4f}",
        auto_insert_metric_name=False,
        monitor=cfg.checkpoint.monitor,
        mode=cfg.checkpoint.direction,
        save_top_k=cfg.checkpoint.save_top_k,
        save_last=True,
    )
    config_file = _ConfigAtFirstCheckpoint(run.config, dump_config(cfg))
    callbacks: list[Callback] = [checkpoint, config_file, RandomState()]
    if cfg.optim.ema_decay is not None:
        # Validation, checkpoints and best.ckpt see the averaged weights: a smoother trajectory,
        # so the val_acc-selected checkpoint is not a lucky noisy step. Warmed up: a short or
        # small training would otherwise validate and keep mostly its initial weights.
        callbacks.append(WarmupEMA(cfg.optim.ema_decay))
    early: EarlyStopping | None = None
    if cfg.early_stopping.enabled:
        early = EarlyStopping(
            monitor=cfg.early_stopping.monitor,
            mode=cfg.early_stopping.direction,
            patience=cfg.early_stopping.patience,
            min_delta=cfg.early_stopping.min_delta,
        )
        callbacks += [early, StaysStopped(early)]
    show_bar, bar_callbacks = progress(cfg.trainer.progress_bar)
    callbacks += bar_callbacks
    trainer = _trainer(
        default_root_dir=run.root,
        max_epochs=t.max_epochs,
        min_epochs=t.min_epochs,
        max_time=timedelta(seconds=t.max_time_s) if t.max_time_s else None,
        accelerator=t.accelerator,
        devices=t.devices,
        strategy=t.strategy,
        num_nodes=t.num_nodes,
        precision=t.precision,
        accumulate_grad_batches=t.accumulate_grad_batches,
        gradient_clip_val=t.gradient_clip_val,
        deterministic=t.deterministic,
        profiler=t.profiler,
        logger=[
            TensorBoardLogger(run.logs, name="tensorboard", default_hp_metric=False),
            CSVLogger(run.logs, name="csv"),
        ],
        callbacks=callbacks,
        enable_progress_bar=show_bar,
        enable_model_summary=show_bar,
        log_every_n_steps=t.log_every_n_steps,
        limit_train_batches=t.limit_train_batches,
        limit_val_batches=t.limit_val_batches,
        plugins=[AtomicCheckpointIO()],
    )
    # At most one epoch of a process's batches, known once the trainer counts its processes:
    # Lightning warns of a longer interval on every small data set. (A plain attribute that
    # Lightning sets from its argument and reads as it logs, untyped.)
    batches_per_epoch = _train_batches(cfg, len(splits.train_y), trainer.world_size)
    trainer.log_every_n_steps = min(  # type: ignore[attr-defined]
        t.log_every_n_steps, batches_per_epoch
    )
    if resumed is not None and not schedule_checked:
        _check_resume_steps(cfg, resumed, run, batches_per_epoch)
    resumed_from_step = 0
    ckpt_path = None
    if resumed is not None:
        ckpt_path = run.last_ckpt
        resumed_from_step = int(resumed.get("global_step", 0))
        print(f"resuming {run.root} from {ckpt_path} (global step {resumed_from_step})", flush=True)
    started = time.perf_counter()
    # Only now, with the settings accepted, does the run directory change.
    pythonpath = models.pythonpath_prefix(cfg.model.name, module_file)
    with _replacing_previous(run, keep=resume, env=pythonpath) as new_run:
        if new_run:
            config_file.write()
        # the top-k files of before a resume: a best one of them is checked to be this run's
        kept_before = (
            {p: p.stat().st_mtime_ns for p in run.checkpoints.glob("epoch=*.ckpt")}
            if resumed is not None
            else {}
        )
        fit_trainer(trainer, lit, datamodule=dm, ckpt_path=ckpt_path)
        checked = None  # the best checkpoint, loaded to check a training that diverged
        if trainer.is_global_zero and not _losses_finite(trainer):
            best = _own_best(run, checkpoint.best_model_path)
            if best.is_file():
                checked = best, load_checkpoint(best)
                _check_finite(checked[1].model, splits.test_x, cfg, trainer)
    train_seconds = time.perf_counter() - started
    if not trainer.is_global_zero:
        return run  # DDP workers stop here; rank 0 writes best.ckpt and the manifest
    if checked is not None:  # diverged after its best checkpoint, which is kept
        _warn_diverged_after_best(run, checked[0], cfg, trainer)
    # Stopped from here on (evaluating, copying best.ckpt), the epochs are done: resuming
    # trains none again (one that early stopping ended too: `StaysStopped`) and writes best.ckpt
    # early stopping ended it before its last epoch: training on is then possible
    stopped = early is not None and early_stopped(early) and trainer.current_epoch < t.max_epochs
    note_interrupt(
        f"the training finished; resume with {run.train_command(env=pythonpath)} to evaluate "
        "it and write best.ckpt"
    )

    best = _own_best(run, checkpoint.best_model_path)
    if not best.is_file():
        raise RunError(
            f"training wrote no checkpoint in {run.checkpoints}: check the trainer settings"
        )
    # RUN/best.ckpt is, or becomes below, a copy of `best`: one hash serves the check and entry
    best_sha256 = sha256_file(best)
    unchanged, in_place = _best_state(run, best_sha256)
    restored = f"best.ckpt restored from {run.relative(best)}"
    trained_nothing = resumed is not None and trainer.global_step == resumed_from_step
    epochs = f"{trainer.current_epoch} epoch{'' if trainer.current_epoch == 1 else 's'}"
    finished = (
        f"nothing to train: {run.root} already finished {epochs} (step {trainer.global_step})"
    )
    if trained_nothing and stopped:  # `StaysStopped`: said, with how to train on
        finished = (
            f"nothing to train: early stopping ended {run.root} after {epochs} (step "
            f"{trainer.global_step}; to train on, resume with --set "
            "early_stopping.enabled=false)"
        )
    elif trained_nothing and _out_of_time(trainer):  # not finished: its time limit came first
        finished = (
            f"nothing to train: {run.root} used up its trainer.max_time_s={t.max_time_s:g} by "
            f"step {trainer.global_step} (to train on, resume with --set trainer.max_time_s= a "
            "longer time, or null)"
        )
    if unchanged and trained_nothing:  # its manifest entry stands: only the file comes back
        if not in_place:
            with atomic_path(run.best_ckpt) as tmp:
                tmp.write_bytes(best.read_bytes())
            print(restored, flush=True)
        kept, after = _kept(run)
        print(
            f"{finished}; {kept} kept\nnext: {next_command(after, run.root, pythonpath)}",
            flush=True,
        )
        return run
    # RUN/best.ckpt already this file (a finished run whose manifest lost its entry), or made
    # again from it below (its best.ckpt lost as well): what the last line says
    was_there = in_place or (
        trained_nothing and run.best_ckpt.is_file() and sha256_file(run.best_ckpt) == best_sha256
    )
    # Evaluated from its source in checkpoints/, before RUN/best.ckpt is replaced, so that
    # the copy and its manifest entry land together below. Loaded before anything made from
    # the old best.ckpt goes: a corrupt checkpoint fails here and loses nothing.
    if checked is not None and checked[0] == best:
        loaded = checked[1]  # loaded and checked as the training ended
    else:
        loaded = load_checkpoint(best)
        if resumed is not None and kept_before.get(best) == best.stat().st_mtime_ns:
            # a top-k file of before the resume (loaded: it is there), not one it wrote: this
            # run's, as last.ckpt is
            _check_same_run(loaded.hparams, resumed["hyper_parameters"], run, best)
        _check_finite(loaded.model, splits.test_x, cfg, trainer)  # one resumed, trained no further
    # what a finished run whose manifest lost only the checkpoint's entry keeps: the entries
    # that record being made from this very best.ckpt
    keep = run.made_from(best_sha256) if was_there and not unchanged else []
    remake = None
    if not unchanged:
        # The old artifacts go before the new best.ckpt arrives: never listed beside it.
        remake = _discard_derived(run, new_best=not was_there, keep=keep)
    test_acc = evaluate(loaded.model, splits.test_x, splits.test_y, cfg.data.eval_batch_size)
    best_score = checkpoint.best_model_score
    entry = {
        "file": "best.ckpt",
        "format": "lightning-checkpoint",
        "sha256": best_sha256,
        "bytes": best.stat().st_size,
        "source_checkpoint": run.relative(best),
        "model": {"name": cfg.model.name, "kwargs": dict(cfg.model.kwargs), **model_source},
        "parameters": models.count_parameters(loaded.model),
        "input_spec": input_spec,
        "labels": list(splits.labels),
        "data_spec": dm.spec.to_dict(),
        "test_acc": round(test_acc, 6),
        "test_samples": len(splits.test_y),
        # the score best.ckpt was chosen by, under the metric's own name
        cfg.checkpoint.monitor: round(float(best_score), 6) if best_score is not None else None,
        "epochs": trainer.current_epoch,
        "max_epochs": t.max_epochs,
        "stopped_early": bool(early is not None and early.stopped_epoch > 0),
        "global_step": trainer.global_step,
        "resumed_from_step": resumed_from_step,
        # a finished run's entry made again: its training time is not known here
        "train_seconds": None if trained_nothing else round(train_seconds, 2),
        "precision": t.precision,
        "devices": t.devices,
        "strategy": t.strategy,
        "versions": {
            "lightship": __version__,
            "torch": torch.__version__,
            "pytorch_lightning": pl.__version__,
        },
    }
    # Renamed into place and recorded with stop signals held (`then_held`): never a new
    # best.ckpt beside the old one's entry.
    with then_held() as then:
        if in_place:
            then(run.record, "checkpoint", entry)
        else:
            with atomic_path(run.best_ckpt) as tmp:
                tmp.write_bytes(best.read_bytes())
                then(run.record, "checkpoint", entry)
    if unchanged and not in_place:
        print(restored, flush=True)
    kept, after = _kept(run) if unchanged or keep else ("", "export")
    # what went of a run that keeps the rest is made again by name, not the whole stage
    after, flag = next(iter(remake.items())) if remake else (after, "")
    if unchanged:
        print(f"best.ckpt is unchanged (no better checkpoint): {kept} kept", flush=True)
    if keep:
        print(f"{_said_kept(run, keep)} kept: their entries record this best.ckpt", flush=True)
    if trained_nothing:  # a finished run whose best.ckpt, or its manifest entry, was lost
        done = (
            f"{finished}; its best.ckpt is recorded in manifest.json again"
            if was_there
            else f"{finished}; best.ckpt made again from {run.relative(best)} and recorded"
        )
    elif resumed is None:
        done = (
            f"trained {cfg.model.name} in {train_seconds:.1f} s ({epochs}, step "
            f"{trainer.global_step})"
        )
    else:  # the seconds are this session's; the epochs and step count from the run's start
        done = (
            f"trained {cfg.model.name} from step {resumed_from_step} to {trainer.global_step} "
            f"in {train_seconds:.1f} s ({epochs} in all)"
        )
    print(
        f"\n{done}: test_acc {test_acc:.4f} on {len(splits.test_y)} images\n"
        f"run directory: {run.root}  (best.ckpt, checkpoints/, config.yaml, logs/, manifest.json)\n"
        f"next: {next_command(after, run.root, pythonpath, flag)}",
        flush=True,
    )
    return run
