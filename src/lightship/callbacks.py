"""Lightning pieces shared by training and quantization-aware fine-tuning.

They live outside `lightship.train` because `lightship.quantize` must not import training code
(DESIGN.md §2) yet fine-tunes with the same checkpointing and progress reporting.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint, RichProgressBar
from pytorch_lightning.plugins.io import TorchCheckpointIO
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


class LatestBestCheckpoint(ModelCheckpoint):
    """ModelCheckpoint where a tie with the best score goes to the newer checkpoint.

    Accuracy on a few hundred validation images saturates (often at 1.0) halfway through a
    decaying learning-rate schedule; the stock callback keeps the *first* checkpoint with the
    top score, a noisier model than the later, annealed ones that tie with it.
    """

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
    """One line per epoch where no progress bar is drawn (CI logs, pipes)."""

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        m = trainer.callback_metrics
        parts = [
            f"{k} {float(v):.4f}"
            for k, v in sorted(m.items())
            if k in ("train_loss", "val_loss", "val_acc")
        ]
        print(
            f"epoch {trainer.current_epoch:3d}  step {trainer.global_step:6d}  " + "  ".join(parts),
            flush=True,
        )


def progress(mode: str) -> tuple[bool, list[Callback]]:
    """(enable Lightning's bar, callbacks): rich on a terminal, one line per epoch elsewhere."""
    if mode == "auto":
        mode = "rich" if sys.stderr.isatty() else "none"
    if mode == "rich":
        return True, [RichProgressBar()]
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
        trainer.fit(*args, **kwargs)
    except SystemExit:
        if trainer.interrupted:
            raise KeyboardInterrupt from None
        raise
    except MisconfigurationException as exc:
        raise ConfigError(f"Lightning refused the settings: {exc}") from None
