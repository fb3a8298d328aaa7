"""`lightship bench train`: training steps/s for the data-loading choices of DESIGN.md §3.

Each setting runs the same model, optimizer and batch size for a fixed number of steps after a
warm-up, in this process, one after another, so the figures compare as ratios on one machine:

- input: ``float32`` (the Dataset normalises every item in ``__getitem__``, the usual
  torchvision-style pipeline) against ``uint8`` (raw pixels through the DataLoader,
  ``Normalize`` as the model's first layer);
- ``num_workers`` 0 against 2;
- precision ``32`` against ``bf16-mixed`` (CPU autocast, as Lightning does it).
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightship import models
from lightship.config import Config
from lightship.data.module import spec_from_config, tensors
from lightship.data.sources import load_splits
from lightship.errors import ConfigError
from lightship.runs import atomic_write_text, check_writable


class NormalizingDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The float32 baseline: every item is converted and normalised on the CPU, per image."""

    def __init__(self, x: np.ndarray, y: np.ndarray, mean: list[float], std: list[float]) -> None:
        self.x, self.y = x, y
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = torch.from_numpy(self.x[i]).to(torch.float32)
        return (img - self.mean) / self.std, torch.tensor(int(self.y[i]))


@dataclass
class BenchRow:
    input: str
    num_workers: int
    precision: str
    steps: int
    seconds: float
    steps_per_s: float
    images_per_s: float
    bytes_per_batch: int


def _time_setting(
    spec: dict[str, Any],
    loader: DataLoader[Any],
    precision: str,
    steps: int,
    warmup: int,
    float_input: bool,
) -> tuple[float, int]:
    torch.manual_seed(0)
    model = models.create(spec)
    if float_input:  # the Dataset already normalised: drop the in-model Normalize
        model.normalize = torch.nn.Identity()  # type: ignore[assignment]
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    autocast = precision == "bf16-mixed"
    batches = itertools.cycle(loader) if len(loader) else iter(())
    batch_bytes = 0
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        x: torch.Tensor
        y: torch.Tensor
        x, y = next(batches)
        batch_bytes = x.numel() * x.element_size()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return time.perf_counter() - start, batch_bytes


def bench_training(
    cfg: Config, steps: int = 30, out: Path | None = None, warmup: int = 5
) -> list[BenchRow]:
    from rich.console import Console
    from rich.table import Table

    if steps < 1:
        raise ConfigError(f"bench train --steps must be at least 1, got {steps}")
    if warmup < 0:
        raise ConfigError(f"bench train warm-up steps must be at least 0, got {warmup}")
    if out is not None:
        check_writable(out)
    splits = load_splits(spec_from_config(cfg.data))
    mean, std = splits.pixel_stats()
    norm_mean, norm_std = cfg.model.mean or mean, cfg.model.std or std
    spec = {
        "name": cfg.model.name,
        "kwargs": dict(cfg.model.kwargs),
        "in_channels": cfg.data.channels,
        "num_classes": len(splits.labels),
        "image_size": cfg.data.image_size,
        "mean": norm_mean,
        "std": norm_std,
    }
    bs = cfg.data.batch_size
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    rows: list[BenchRow] = []
    console = Console(stderr=True)
    settings = [
        (inp, w, p) for inp in ("float32", "uint8") for w in (0, 2) for p in ("32", "bf16-mixed")
    ]
    with console.status("") as status:
        for inp, workers, precision in settings:
            status.update(f"bench train: input {inp}, num_workers {workers}, precision {precision}")
            ds: Dataset[Any]
            if inp == "float32":
                ds = NormalizingDataset(splits.train_x, splits.train_y, norm_mean, norm_std)
            else:
                ds = tensors(splits.train_x, splits.train_y)
            loader = DataLoader(
                ds,
                batch_size=bs,
                shuffle=True,
                drop_last=True,
                num_workers=workers,
                persistent_workers=workers > 0,
            )
            secs, nbytes = _time_setting(
                spec, loader, precision, steps, warmup, float_input=inp == "float32"
            )
            del loader
            rows.append(
                BenchRow(
                    inp, workers, precision, steps, secs, steps / secs, steps * bs / secs, nbytes
                )
            )

    base = rows[0].steps_per_s
    table = Table(
        title=f"training speed, {cfg.model.name}, batch {bs}, {torch.get_num_threads()} threads"
    )
    for col in ("input", "workers", "precision", "steps/s", "images/s", "batch bytes", "vs first"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r.input,
            str(r.num_workers),
            r.precision,
            f"{r.steps_per_s:.1f}",
            f"{r.images_per_s:.0f}",
            f"{r.bytes_per_batch:,}",
            f"{r.steps_per_s / base:.2f}x",
        )
    Console().print(table)
    if out is not None:
        payload = {
            "model": cfg.model.name,
            "batch_size": bs,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "rows": [asdict(r) for r in rows],
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(payload, indent=2) + "\n")
        Console(stderr=True).print(f"wrote {out}")
    return rows
