"""`lightship bench train`: training steps/s for the ways data can be fed (listed below).

Each setting runs the same model, optimizer and batch size for a fixed number of steps after a
warm-up, in this process. Rounds interleave the settings (every setting once a round, the order
reversed every other round), so a slow patch of the machine touches them all alike, and each is
compared with the first within its round; the figures compare as ratios on one machine:

- input: ``float32`` (the Dataset normalises every item in ``__getitem__``, the usual
  torchvision-style pipeline) against ``uint8`` (raw pixels through the DataLoader,
  ``Normalize`` as the model's first layer);
- ``num_workers`` 0 against 2;
- precision ``32`` against ``bf16-mixed`` (CPU autocast, as Lightning does it).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
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
from lightship.quantize.isa import host_cpu
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
    steps: int  # timed steps in each round
    seconds: float  # median over the rounds, as are the rates
    steps_per_s: float
    images_per_s: float
    bytes_per_batch: int
    vs_first: float = 1.0  # steps/s over the first setting's in the same round, median
    steps_per_s_by_round: list[float] = field(default_factory=list)
    vs_first_by_round: list[float] = field(default_factory=list)


SETTINGS = [
    (inp, w, p) for inp in ("float32", "uint8") for w in (0, 2) for p in ("32", "bf16-mixed")
]


def batches(loader: DataLoader[Any]) -> Iterator[Any]:
    """The loader's batches for as long as they are asked for, each pass a new iteration of
    it, as training's epochs are: every step loads its batch (in the workers, when there are
    any). `itertools.cycle` would replay the first pass's batches from memory, and every step
    after it would load nothing."""
    while True:
        yield from loader


def round_orders(rounds: int) -> list[list[tuple[str, int, str]]]:
    """The settings in the order each round measures them: every other round reversed, so that
    none always runs just after the same neighbour or at the same point of a round."""
    return [SETTINGS if r % 2 == 0 else SETTINGS[::-1] for r in range(rounds)]


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
    stream = batches(loader)
    batch_bytes = 0
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        x: torch.Tensor
        y: torch.Tensor
        x, y = next(stream)
        batch_bytes = x.numel() * x.element_size()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return time.perf_counter() - start, batch_bytes


def bench_training(
    cfg: Config, steps: int = 30, out: Path | None = None, warmup: int = 5, rounds: int = 3
) -> list[BenchRow]:
    from rich.console import Console
    from rich.table import Table

    if steps < 1:
        raise ConfigError(f"bench train --steps must be at least 1, got {steps}")
    if warmup < 0:
        raise ConfigError(f"bench train warm-up steps must be at least 0, got {warmup}")
    if rounds < 1:
        raise ConfigError(f"bench train rounds must be at least 1, got {rounds}")
    if out is not None:
        check_writable(out)
    splits = load_splits(spec_from_config(cfg.data), only=("train",))
    bs = cfg.data.batch_size
    if len(splits.train_x) < bs:
        raise ConfigError(
            f"the training split has {len(splits.train_x)} images, fewer than one batch of {bs}: "
            "lower data.batch_size, e.g. --set data.batch_size=16"
        )
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
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    measured: dict[tuple[str, int, str], list[tuple[float, int]]] = {s: [] for s in SETTINGS}
    console = Console(stderr=True)
    with console.status("") as status:
        for r, order in enumerate(round_orders(rounds)):
            for inp, workers, precision in order:
                status.update(
                    f"bench train, round {r + 1}/{rounds}: input {inp}, num_workers {workers}, "
                    f"precision {precision}"
                )
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
                measured[(inp, workers, precision)].append(
                    _time_setting(
                        spec, loader, precision, steps, warmup, float_input=inp == "float32"
                    )
                )
                del loader
    rows = summarise(measured, steps, bs)

    cpu = host_cpu()
    table = Table(
        title=f"training speed, {cfg.model.name}, batch {bs}, {torch.get_num_threads()} threads, "
        f"{steps} steps x {rounds} interleaved rounds (medians), on {cpu.describe()}"
    )
    for col in ("input", "workers", "precision", "steps/s", "images/s", "batch bytes", "vs first"):
        table.add_column(col, justify="right")
    for row in rows:
        low, high = min(row.vs_first_by_round), max(row.vs_first_by_round)
        spread = f" ({low:.2f}–{high:.2f})" if low != high else ""
        table.add_row(
            row.input,
            str(row.num_workers),
            row.precision,
            f"{row.steps_per_s:.1f}",
            f"{row.images_per_s:.0f}",
            f"{row.bytes_per_batch:,}",
            f"{row.vs_first:.2f}x{spread}",
        )
    # A log or a pipe has no width: rich's 80 columns cut the ranges ("2.13x (1.60–3.…")
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    if out is not None:
        payload = {
            "model": cfg.model.name,
            "cpu": cpu.as_dict(),
            "batch_size": bs,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "rounds": rounds,
            "warmup_steps": warmup,
            "rows": [asdict(row) for row in rows],
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(payload, indent=2) + "\n")
        Console(stderr=True).print(f"wrote {out}")
    return rows


def summarise(
    measured: dict[tuple[str, int, str], list[tuple[float, int]]], steps: int, batch_size: int
) -> list[BenchRow]:
    """One row per setting from its (seconds, batch bytes) of each round: medians, and its
    steps/s over the first setting's within each round, then the median of those."""
    first = [steps / secs for secs, _ in next(iter(measured.values()))]
    rows = []
    for (inp, workers, precision), runs in measured.items():
        rates = [steps / secs for secs, _ in runs]
        vs_first = [rate / base for rate, base in zip(rates, first, strict=True)]
        secs = float(np.median([s for s, _ in runs]))
        rows.append(
            BenchRow(
                inp,
                workers,
                precision,
                steps,
                round(secs, 4),
                round(float(np.median(rates)), 2),
                round(float(np.median(rates)) * batch_size, 1),
                runs[-1][1],
                round(float(np.median(vs_first)), 3),
                [round(x, 2) for x in rates],
                [round(x, 3) for x in vs_first],
            )
        )
    return rows
