"""LightningDataModule over uint8 tensors (normalisation happens inside the model)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightship.config import DataConfig
from lightship.data.sources import DataSpec, Splits, load_splits


def spec_from_config(cfg: DataConfig) -> DataSpec:
    return DataSpec(
        source=cfg.source,
        # absolute: later stages (quantize, report) may run from another folder
        path=str(cfg.path.expanduser().absolute()) if cfg.path else None,
        image_size=cfg.image_size,
        channels=cfg.channels,
        val_fraction=cfg.val_fraction,
        test_fraction=cfg.test_fraction,
        split_seed=cfg.split_seed,
    )


def config_from_spec(spec: DataSpec) -> DataConfig:
    """The data section that reproduces a recorded spec (same source, size and split)."""
    return DataConfig(
        source=spec.source,
        # digits reads no path (older runs recorded one given beside it)
        path=Path(spec.path) if spec.path and spec.source != "digits" else None,
        image_size=spec.image_size,
        channels=spec.channels,
        val_fraction=spec.val_fraction,
        test_fraction=spec.test_fraction,
        split_seed=spec.split_seed,
    )


def process_share(images: int, processes: int) -> int:
    """The training images each of `processes` reads an epoch: under DDP, DistributedSampler
    pads the data set to a multiple of the processes."""
    return math.ceil(images / processes)


def drops_last(images: int, batch_size: int) -> bool:
    """Whether an epoch of `images` leaves out its last batch: only when that batch would
    hold one image, on which BatchNorm cannot compute a batch statistic in training mode (a
    ValueError mid-epoch); it is reshuffled into the next epoch."""
    return images > batch_size and images % batch_size == 1


def tensors(x: np.ndarray, y: np.ndarray) -> TensorDataset:
    return TensorDataset(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y))


class ImageDataModule(pl.LightningDataModule):
    def __init__(
        self,
        cfg: DataConfig,
        pin_memory: bool = False,
        check_layout: bool = True,
        resumed: bool = False,
    ) -> None:
        """`check_layout`: refuse an image folder already split (False to resume a run
        trained on one before that refusal). `resumed`: the data of a run resumed."""
        super().__init__()
        self.cfg = cfg
        self.check_layout = check_layout
        self.resumed = resumed
        self.spec = spec_from_config(cfg)
        self.pin_memory = cfg.pin_memory if cfg.pin_memory is not None else pin_memory
        self._splits: Splits | None = None

    @property
    def splits(self) -> Splits:
        if self._splits is None:
            self._splits = load_splits(
                self.spec, check_layout=self.check_layout, resumed=self.resumed
            )
            # recorded with the run: later stages check the data is still what it trained on
            self.spec = dataclasses.replace(self.spec, fingerprint=self._splits.fingerprint)
        return self._splits

    def _loader(
        self, ds: TensorDataset, batch_size: int, shuffle: bool, drop_last: bool = False
    ) -> DataLoader[Any]:
        workers = self.cfg.num_workers
        return DataLoader(
            ds,
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.cfg.persistent_workers and workers > 0,
            prefetch_factor=self.cfg.prefetch_factor if workers > 0 else None,
            drop_last=drop_last,
        )

    def train_dataloader(self) -> DataLoader[Any]:
        s = self.splits
        processes = self.trainer.world_size if self.trainer is not None else 1
        share = process_share(len(s.train_y), processes)  # as `train.fit` counts its batches
        return self._loader(
            tensors(s.train_x, s.train_y),
            self.cfg.batch_size,
            shuffle=True,
            drop_last=drops_last(share, self.cfg.batch_size),
        )

    def val_dataloader(self) -> DataLoader[Any]:
        s = self.splits
        return self._loader(tensors(s.val_x, s.val_y), self.cfg.eval_batch_size, shuffle=False)
