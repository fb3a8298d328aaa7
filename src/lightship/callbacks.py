"""Lightning pieces shared by training and quantization-aware fine-tuning.

They live outside `lightship.train` because `lightship.quantize` must not import training code
(a test imports it in a subprocess and reads `sys.modules`) yet fine-tunes with the same
checkpointing and progress reporting.
"""

from __future__ import annotations

import functools
import io
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import (
    Callback,
    EarlyStopping,
    ModelCheckpoint,
    RichProgressBar,
    WeightAveraging,
)
from pytorch_lightning.callbacks.early_stopping import EarlyStoppingReason
from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from lightship.errors import ConfigError
from lightship.runs import atomic_path


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary file, fsync, then rename: never half-written.

    torch.save serialises into memory first and Python writes the bytes: writing a file itself,
    torch reports a full disk as a RuntimeError ("unexpected pos"), where Python's write raises
    the OSError (ENOSPC) that the CLI answers with what to free."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        try:
            with atomic_path(Path(path)) as tmp, open(tmp, "wb") as f:
                f.write(buffer.getbuffer())
        except OSError as exc:  # a write error names no file: name the checkpoint
            raise OSError(exc.errno, exc.strerror, str(path)) from None


class RandomState(Callback):
    """The random generators' state in each checkpoint, put back on resume. `seed_everything`
    at a resume started the generators over: the resumed epoch shuffled and augmented as the
    first epoch had (its first indices the same), so a run stopped and resumed trained on
    other batches than one that was not. Torch's generators are the ones training draws on
    (the sampler's shuffle, the augmentation); each checkpoint holds them as the epoch left
    them, so the epoch after draws what it would have."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # the current device's alone: rank 0 saves the checkpoint, and its list of every
            # device's had the others' as seeded (rank 1's cuda:1 was never drawn on there),
            # which each rank would have put back; seeded alike, every rank's own device
            # draws what rank 0's does
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        cpu = state_dict.get("torch")
        if isinstance(cpu, torch.Tensor) and cpu.dtype == torch.uint8:
            torch.set_rng_state(cpu)
        cuda = state_dict.get("cuda")
        if isinstance(cuda, torch.Tensor) and torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda)


class StaysStopped(Callback):
    """A resumed run that early stopping ended stays ended. Lightning puts the stop back with
    the callback's state (`stopping_reason`) but does not act on it: the resume trained one
    epoch more, which (ties going to the later epoch) made a new best.ckpt and deleted every
    export, int8 model and report made from the old one. Training on takes
    `early_stopping.enabled=false`."""

    def __init__(self, early: EarlyStopping) -> None:
        self.early = early

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if early_stopped(self.early):
            trainer.should_stop = True


def early_stopped(early: EarlyStopping) -> bool:
    """Whether `early` stopped its training, as run or as put back from a checkpoint: by its
    reason, or by the epoch it stopped at, which checkpoints of a Lightning before
    `stopping_reason` hold alone."""
    return early.stopping_reason != EarlyStoppingReason.NOT_STOPPED or early.stopped_epoch > 0


def warmup_ema(
    decay: float, averaged: torch.Tensor, current: torch.Tensor, n_averaged: torch.Tensor
) -> torch.Tensor:
    """One EMA update whose decay ramps up with the updates done so far, `n_averaged`:
    min(decay, (1 + n) / (10 + n)), as TensorFlow's ExponentialMovingAverage(num_updates=...)."""
    d = torch.clamp((1 + n_averaged) / (10 + n_averaged), max=decay)
    return d * averaged + (1 - d) * current


class WarmupEMA(WeightAveraging):
    """An exponential moving average of the weights, validated and checkpointed in their place,
    with a warm-up: early updates follow the weights (decay 0.18 at the 2nd, 0.5 at the 9th) and
    the full `decay` applies from update (10 * decay - 1) / (1 - decay) on (440 for 0.98).

    Lightning's EMAWeightAveraging uses `decay` from the first step: after 24 steps (8 epochs of
    240 images) a 0.98 average is still 62 % the first step's weights, and validation, the
    checkpoints and best.ckpt would hold a barely trained model. The update count lives in the
    averaged model's state, so a resumed run continues the ramp where it stopped.
    """

    def __init__(self, decay: float) -> None:
        super().__init__(avg_fn=functools.partial(warmup_ema, decay))


def _moved_state(state: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """ModelCheckpoint's `state` saved in folder `old`, re-rooted in `new`: a path in `old`
    becomes the same name in `new`; a top-k entry whose file is not in `new` is dropped."""

    def here(path: str) -> str:
        if not path or os.path.dirname(path) != old:
            return path
        return os.path.join(new, os.path.basename(path))

    best_k = {here(p): v for p, v in (state.get("best_k_models") or {}).items()}
    best_k = {p: v for p, v in best_k.items() if os.path.isfile(p)}
    kth = here(state.get("kth_best_model_path") or "")
    return {
        **state,
        "dirpath": new,
        "best_model_path": here(state.get("best_model_path") or ""),
        "last_model_path": here(state.get("last_model_path") or ""),
        "best_k_models": best_k,
        # the worst kept; Lightning picks it again once the top k is full
        "kth_best_model_path": kth if kth in best_k else "",
    }


# `epoch=03-val_acc=0.9963.ckpt`, `-v1` too; `qat-epoch=00.ckpt`
_EPOCH_IN_NAME = re.compile(r"(?:^|-)epoch=(\d+)(?:-.*)?\.ckpt$")


class LatestBestCheckpoint(ModelCheckpoint):
    """ModelCheckpoint where a tie with the best score goes to the newer checkpoint, and
    last.ckpt (with `save_last`) is written at the end of every epoch.

    Accuracy on a few hundred validation images saturates (often at 1.0) halfway through a
    decaying learning-rate schedule; the stock callback keeps the *first* checkpoint with the
    top score, a noisier model than the later, annealed ones that tie with it.

    Lightning 2.6 writes last.ckpt only in a step that also saved a top-k checkpoint, and at the
    end of training only if it never wrote one: after the last improving epoch last.ckpt would
    stay behind, and `--resume` would re-train the epochs since (all of them, on a finished run).

    An epoch trained again (a resume from a last.ckpt older than the newest top-k checkpoint:
    a kill -9 between the two writes, or a top-k file copied over a corrupt last.ckpt) replaces
    its earlier attempt's checkpoint: the file of the same name is overwritten (no version
    counter: Lightning wrote `-v1` beside it), and one of another name (another score) is
    removed, so `save_top_k` files stay `save_top_k`. A resume trains bit for bit as before, so
    the new file is the old one's equal.
    """

    _last_saved_step = -1  # the global step last.ckpt holds

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"enable_version_counter": False, **kwargs})

    def _save_topk_checkpoint(
        self, trainer: pl.Trainer, monitor_candidates: dict[str, torch.Tensor]
    ) -> None:
        super()._save_topk_checkpoint(trainer, monitor_candidates)
        if self.save_top_k and trainer.is_global_zero and not trainer.sanity_checking:
            self._drop_earlier_attempts(int(monitor_candidates["epoch"]))

    def _drop_earlier_attempts(self, epoch: int) -> None:
        """Removes this epoch's checkpoints that the top k does not hold: an earlier attempt's,
        which the restored state never knew."""
        if not self.dirpath or not os.path.isdir(self.dirpath):
            return
        kept = {os.path.abspath(p) for p in (*self.best_k_models, self.last_model_path) if p}
        for name in os.listdir(self.dirpath):
            path = os.path.abspath(os.path.join(self.dirpath, name))
            found = _EPOCH_IN_NAME.search(name)
            if found and int(found[1]) == epoch and path not in kept and os.path.isfile(path):
                os.remove(path)

    def _save_last_checkpoint(
        self, trainer: pl.Trainer, monitor_candidates: dict[str, torch.Tensor]
    ) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        if self.save_last:
            self._last_saved_step = trainer.global_step

    def _save_last_if_behind(self, trainer: pl.Trainer) -> None:
        if (
            self.save_last
            and self._last_saved_step != trainer.global_step
            and not trainer.sanity_checking
            and trainer.state.fn == TrainerFn.FITTING
        ):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_behind(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_behind(trainer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A run copied or moved (`cp -r`) resumes with its checkpoints where they are now.

        Lightning keeps only `best_model_path` of a state saved in another folder: it forgot
        the top-k it kept, so the old ones were never deleted (four files for top 2), and its
        last.ckpt, so the new one went to last-v1.ckpt while the next `--resume` read the stale
        last.ckpt and trained the same epochs again. The state's paths in its old folder are
        taken as the same names in this one, where those files are."""
        old, new = state_dict.get("dirpath"), self.dirpath
        if old and new and old != new:
            state_dict = _moved_state(state_dict, str(old), str(new))
        super().load_state_dict(state_dict)

    def check_monitor_top_k(self, trainer: pl.Trainer, current: torch.Tensor | None = None) -> bool:
        if current is None or self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return super().check_monitor_top_k(trainer, current)
        op = torch.ge if self.mode == "max" else torch.le
        better_or_tie = bool(op(current, self.best_k_models[self.kth_best_model_path]))
        return trainer.strategy.reduce_boolean_decision(better_or_tie)

    def _update_best_and_save(
        self,
        current: torch.Tensor,
        trainer: pl.Trainer,
        monitor_candidates: dict[str, torch.Tensor],
    ) -> None:
        super()._update_best_and_save(current, trainer, monitor_candidates)
        pick = max if self.mode == "max" else min
        top = pick(self.best_k_models.values())
        self.best_model_path = [p for p, s in self.best_k_models.items() if s == top][-1]  # newest
        self.best_model_score = top


class EpochSummary(Callback):
    """One line per epoch where no progress bar is drawn (CI logs, pipes), epochs counted as
    `EpochBar` counts them: "epoch 4/4" for the last of max_epochs=4 (it said "epoch 3")."""

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        m = trainer.callback_metrics
        parts = [
            f"{k} {float(v):.4f}"
            for k, v in sorted(m.items())
            if k in ("train_loss", "val_loss", "val_acc")
        ]
        of = f"/{trainer.max_epochs}" if trainer.max_epochs not in (None, -1) else ""
        epoch = f"{trainer.current_epoch + 1}{of}"
        print(f"epoch {epoch:>7}  step {trainer.global_step:6d}  " + "  ".join(parts), flush=True)


class EpochBar(RichProgressBar):
    """Lightning's rich bar, epochs counted as people count them: "Epoch 3/3" for the last of
    max_epochs=3, where Lightning shows "Epoch 2/2" (its zero-based index)."""

    def _get_train_description(self, current_epoch: int) -> str:
        of = f"/{self.trainer.max_epochs}" if self.trainer.max_epochs is not None else ""
        # padded to the validation bar's label, as Lightning does: no flicker between the two
        return f"{f'Epoch {current_epoch + 1}{of}':{len(self.validation_description)}}"


def progress(mode: str) -> tuple[bool, list[Callback]]:
    """(enable Lightning's bar, callbacks): rich on a terminal, one line per epoch elsewhere."""
    if mode == "auto":  # TERM=dumb: rich draws no bar there, and the log had no epoch lines
        dumb = os.environ.get("TERM", "").lower() in ("dumb", "unknown")
        mode = "rich" if sys.stderr.isatty() and not dumb else "none"
    if mode == "rich":
        return True, [EpochBar()]
    return False, [EpochSummary()]


def evaluate(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, batch: int = 256) -> float:
    """Top-1 accuracy of an eager model on uint8 images."""
    correct = 0
    with torch.inference_mode():
        for i in range(0, len(x), batch):
            logits = model(torch.from_numpy(x[i : i + batch]))
            correct += int((logits.argmax(1).numpy() == y[i : i + batch]).sum())
    return correct / max(len(x), 1)


def fit_trainer(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
    """`trainer.fit`, with Ctrl-C a KeyboardInterrupt again: exit 130, and the CLI's last line
    `interrupted`, followed by what to do next where the caller said it (`note_interrupt`).

    Lightning catches the interrupt, tears down and calls `sys.exit(1)`: a bare exit code 1 that
    looks like a crash. A setting only Lightning checks (it does so as fitting starts) is a
    one-line ConfigError instead of a traceback.
    """
    try:
        with warnings.catch_warnings():  # for this fit only: not a user's own Trainers
            # Images live in RAM as uint8 tensors: worker processes only add IPC (see
            # `lightship bench train`).
            warnings.filterwarnings("ignore", ".*does not have many workers.*")
            # checkpoints/ keeps a run's earlier checkpoints on purpose: a resumed run continues
            # from them, and a retrained one keeps them until its own first checkpoint is written.
            warnings.filterwarnings("ignore", "Checkpoint directory .* exists and is not empty")
            # A run trained before WarmupEMA saved its EMA under Lightning's callback's name;
            # WarmupEMA restores that state all the same (`on_load_checkpoint` reads it whatever
            # the name), so "Please add the following callbacks" asks for nothing to do.
            warnings.filterwarnings(
                "ignore", r".*Please add the following callbacks: \['EMAWeightAveraging'\]"
            )
            trainer.fit(*args, **kwargs)
    except SystemExit:
        if trainer.interrupted:
            raise KeyboardInterrupt from None
        raise
    except MisconfigurationException as exc:
        raise ConfigError(f"Lightning refused the settings: {exc}") from None
