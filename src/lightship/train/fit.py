"""`fit(cfg, run)`: train, keep the best checkpoint, evaluate it on the test split, record it."""

from __future__ import annotations

import logging
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import (
    Callback,
    EarlyStopping,
    EMAWeightAveraging,
    ModelCheckpoint,
    RichProgressBar,
)
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from pytorch_lightning.plugins.io import TorchCheckpointIO

from lightship import __version__, models
from lightship.config import Config, dump_config
from lightship.data.module import ImageDataModule
from lightship.errors import ConfigError, RunError
from lightship.models.checkpoint import load_checkpoint, read_checkpoint
from lightship.runs import RunDir, atomic_path, atomic_write_text, sha256_file
from lightship.train.module import LitClassifier

log = logging.getLogger(__name__)

# Images live in RAM as uint8 tensors: worker processes only add IPC (see `lightship bench train`).
warnings.filterwarnings("ignore", ".*does not have many workers.*")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary file, fsync, then rename: never half-written."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        final = Path(path)
        with atomic_path(final) as tmp:
            torch.save(checkpoint, tmp)


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


def _resume_path(run: RunDir) -> Path:
    if not run.last_ckpt.is_file():
        raise RunError(
            f"cannot resume: no {run.last_ckpt}; train without RESUME=1 / --resume to start the run"
        )
    read_checkpoint(run.last_ckpt)  # a corrupt file fails here with a one-line error
    return run.last_ckpt


def _progress(cfg: Config) -> tuple[bool, list[Callback]]:
    mode = cfg.trainer.progress_bar
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


def fit(cfg: Config, run: RunDir, resume: bool = False) -> RunDir:
    _check_runtime_config(cfg)
    ckpt_path = _resume_path(run) if resume else None
    pl.seed_everything(cfg.seed, workers=True, verbose=False)

    use_cuda = torch.cuda.is_available() and cfg.trainer.accelerator in ("auto", "gpu", "cuda")
    dm = ImageDataModule(cfg.data, pin_memory=use_cuda)
    splits = dm.splits  # data errors surface here, before anything is written
    mean, std = cfg.model.mean, cfg.model.std
    if mean is None or std is None:
        data_mean, data_std = splits.pixel_stats()
        mean, std = mean or data_mean, std or data_std
    model_spec = {
        "name": cfg.model.name,
        "kwargs": dict(cfg.model.kwargs),
        "in_channels": cfg.data.channels,
        "num_classes": len(splits.labels),
        "image_size": cfg.data.image_size,
        "mean": list(mean),
        "std": list(std),
    }
    input_spec = _input_spec(cfg, list(mean), list(std))
    lit = LitClassifier(
        model_spec=model_spec,
        labels=list(splits.labels),
        input_spec=input_spec,
        data_spec=dm.spec.to_dict(),
        optim=cfg.optim.model_dump(),
        augment=cfg.data.augment,
    )
    if cfg.trainer.compile:
        lit.model.compile()

    run.root.mkdir(parents=True, exist_ok=True)
    if not resume:
        for old in run.checkpoints.glob("*.ckpt"):
            old.unlink()
    atomic_write_text(run.config, dump_config(cfg))

    t = cfg.trainer
    checkpoint = LatestBestCheckpoint(
        dirpath=run.checkpoints,
        filename="epoch={epoch:02d}-val_acc={val_acc:.4f}",
        auto_insert_metric_name=False,
        monitor=cfg.checkpoint.monitor,
        mode=cfg.checkpoint.mode,
        save_top_k=cfg.checkpoint.save_top_k,
        save_last=True,
    )
    callbacks: list[Callback] = [checkpoint]
    if cfg.optim.ema_decay is not None:
        # Validation, checkpoints and best.ckpt see the averaged weights: a smoother trajectory,
        # so the val_acc-selected checkpoint is not a lucky noisy step.
        callbacks.append(EMAWeightAveraging(decay=cfg.optim.ema_decay))
    early: EarlyStopping | None = None
    if cfg.early_stopping.enabled:
        early = EarlyStopping(
            monitor=cfg.early_stopping.monitor,
            mode=cfg.early_stopping.mode,
            patience=cfg.early_stopping.patience,
            min_delta=cfg.early_stopping.min_delta,
        )
        callbacks.append(early)
    show_bar, bar_callbacks = _progress(cfg)
    callbacks += bar_callbacks
    trainer = pl.Trainer(
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
    resumed_from_step = 0
    if ckpt_path is not None:
        resumed_from_step = int(read_checkpoint(ckpt_path).get("global_step", 0))
        print(f"resuming {run.root} from {ckpt_path} (global step {resumed_from_step})", flush=True)
    started = time.perf_counter()
    trainer.fit(lit, datamodule=dm, ckpt_path=ckpt_path)
    train_seconds = time.perf_counter() - started
    if not trainer.is_global_zero:
        return run  # DDP workers stop here; rank 0 writes best.ckpt and the manifest

    best = Path(checkpoint.best_model_path) if checkpoint.best_model_path else run.last_ckpt
    if not best.is_file():
        raise RunError(
            f"training wrote no checkpoint in {run.checkpoints}: check the trainer settings"
        )
    with atomic_path(run.best_ckpt) as tmp:
        tmp.write_bytes(best.read_bytes())
    loaded = load_checkpoint(run.best_ckpt)
    test_acc = evaluate(loaded.model, splits.test_x, splits.test_y, cfg.data.eval_batch_size)
    best_score = checkpoint.best_model_score
    entry = {
        "file": "best.ckpt",
        "format": "lightning-checkpoint",
        "sha256": sha256_file(run.best_ckpt),
        "bytes": run.best_ckpt.stat().st_size,
        "source_checkpoint": run.relative(best),
        "model": {"name": cfg.model.name, "kwargs": dict(cfg.model.kwargs)},
        "parameters": models.count_parameters(loaded.model),
        "input_spec": input_spec,
        "labels": list(splits.labels),
        "data_spec": dm.spec.to_dict(),
        "test_acc": round(test_acc, 6),
        "test_samples": len(splits.test_y),
        "val_acc": round(float(best_score), 6) if best_score is not None else None,
        "epochs": trainer.current_epoch,
        "max_epochs": t.max_epochs,
        "stopped_early": bool(early is not None and early.stopped_epoch > 0),
        "global_step": trainer.global_step,
        "resumed_from_step": resumed_from_step,
        "train_seconds": round(train_seconds, 2),
        "precision": t.precision,
        "devices": t.devices,
        "strategy": t.strategy,
        "versions": {
            "lightship": __version__,
            "torch": torch.__version__,
            "pytorch_lightning": pl.__version__,
        },
    }
    run.record("checkpoint", entry)
    print(
        f"\ntrained {cfg.model.name} in {train_seconds:.1f} s ({trainer.current_epoch} epochs, "
        f"step {trainer.global_step}): test_acc {test_acc:.4f} on {len(splits.test_y)} images\n"
        f"run directory: {run.root}  (best.ckpt, checkpoints/, logs/, manifest.json)\n"
        f"next: make export RUN={run.root}   (or `lightship export --run {run.root}`)",
        flush=True,
    )
    return run
