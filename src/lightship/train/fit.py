"""`fit(cfg, run)`: train, keep the best checkpoint, evaluate it on the test split, record it."""

from __future__ import annotations

import logging
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import (
    Callback,
    EarlyStopping,
    EMAWeightAveraging,
)
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from lightship import __version__, models
from lightship.callbacks import AtomicCheckpointIO, LatestBestCheckpoint, evaluate, progress
from lightship.config import Config, dump_config
from lightship.data.module import ImageDataModule
from lightship.errors import ConfigError, RunError
from lightship.models.checkpoint import load_checkpoint, read_checkpoint
from lightship.runs import RunDir, atomic_path, atomic_write_text, check_writable, sha256_file
from lightship.train.module import LitClassifier

log = logging.getLogger(__name__)

# Images live in RAM as uint8 tensors: worker processes only add IPC (see `lightship bench train`).
warnings.filterwarnings("ignore", ".*does not have many workers.*")


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


def _trainer(**kwargs: Any) -> pl.Trainer:
    """pl.Trainer, its refusals (devices=0, an unknown accelerator...) as one-line ConfigErrors."""
    try:
        return pl.Trainer(**kwargs)
    except (MisconfigurationException, ValueError, TypeError) as exc:
        raise ConfigError(f"Lightning refused the trainer settings: {exc}; fix trainer.*") from None


def _forget_derived(run: RunDir) -> None:
    """A new best.ckpt outdates every artifact made from the old one: unlist them, drop the report.

    The files stay on disk; the manifest no longer offers them to report, serve or quantize.
    """
    derived = [k for k in run.manifest()["artifacts"] if k != "checkpoint"]
    report = run.report_dir / "report.json"
    if not derived and not report.is_file():
        return
    run.forget(*derived)
    report.unlink(missing_ok=True)
    print(
        f"the new best.ckpt outdates {', '.join(derived) or 'the report'} of this run: "
        f"re-run `make export quantize RUN={run.root}`",
        flush=True,
    )


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

    # Fail now, not after the last epoch, when an output cannot be written.
    check_writable(run.config, run.manifest_path, run.best_ckpt, run.last_ckpt)
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
    # Only now, with the settings accepted, does the run directory change.
    if not resume:
        for old in run.checkpoints.glob("*.ckpt"):
            old.unlink()
    atomic_write_text(run.config, dump_config(cfg))
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
    _forget_derived(run)
    print(
        f"\ntrained {cfg.model.name} in {train_seconds:.1f} s ({trainer.current_epoch} epochs, "
        f"step {trainer.global_step}): test_acc {test_acc:.4f} on {len(splits.test_y)} images\n"
        f"run directory: {run.root}  (best.ckpt, checkpoints/, logs/, manifest.json)\n"
        f"next: make export RUN={run.root}   (or `lightship export --run {run.root}`)",
        flush=True,
    )
    return run
