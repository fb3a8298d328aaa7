"""`lightship bench train`: every timed step loads its batch, and the settings take turns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightship.config import load_config
from lightship.errors import ConfigError
from lightship.quantize.isa import host_cpu
from lightship.train import bench
from tests.conftest import CONFIGS


class Counted(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Four 1x4x4 uint8 images; counts the items loaded."""

    def __init__(self) -> None:
        self.loaded = 0

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loaded += 1
        return torch.full((1, 4, 4), i, dtype=torch.uint8), torch.tensor(i % 2)


def test_every_step_loads_its_batch_past_the_first_pass() -> None:
    spec = {
        "name": "mlp",
        "kwargs": {},
        "in_channels": 1,
        "num_classes": 2,
        "image_size": 4,
        "mean": [0.0],
        "std": [1.0],
    }
    data = Counted()
    loader = DataLoader(data, batch_size=2, shuffle=True, drop_last=True)
    # two batches a pass; 1 warm-up step and 5 timed ones go through it three times
    bench._time_setting(spec, loader, "32", steps=5, warmup=1, float_input=False)
    assert data.loaded == 6 * 2


def test_the_rounds_interleave_the_settings_and_compare_within_each_round(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[str, int, str]] = []
    # The machine slows down in the second round: every setting takes twice as long there.
    speed = {s: 10.0 + i for i, s in enumerate(bench.SETTINGS)}  # steps/s in round 1

    def timed(
        spec: dict[str, Any],
        loader: DataLoader[Any],
        precision: str,
        steps: int,
        warmup: int,
        float_input: bool,
    ) -> tuple[float, int]:
        setting = ("float32" if float_input else "uint8", loader.num_workers, precision)
        calls.append(setting)
        slow = 2.0 if len(calls) > len(bench.SETTINGS) else 1.0
        return slow * steps / speed[setting], 100

    monkeypatch.setattr(bench, "_time_setting", timed)
    cfg = load_config(CONFIGS / "tiny.yaml")
    rows = bench.bench_training(cfg, steps=3, out=tmp_path / "t.json", rounds=2)
    n = len(bench.SETTINGS)
    # each round measures every setting once before any is measured again, and the second
    # round in the reverse order
    assert calls[:n] == bench.SETTINGS
    assert calls[n:] == bench.SETTINGS[::-1]
    last = rows[-1]
    assert last.steps_per_s_by_round == [17.0, 8.5]
    assert last.steps_per_s == 12.75  # the median of its rounds
    # against the first setting in the same round: 17 / 10 both times, the slow round cancels
    assert last.vs_first_by_round == [1.7, 1.7]
    assert last.vs_first == 1.7
    assert rows[0].vs_first == 1.0
    # the CPU the figures were measured on, in the table's title and the JSON
    cpu = host_cpu()
    assert f"on {cpu.describe()}" in " ".join(capsys.readouterr().out.split())
    assert json.loads((tmp_path / "t.json").read_text())["cpu"] == cpu.as_dict()


def test_bad_rounds_and_a_split_smaller_than_a_batch_say_what_to_do() -> None:
    cfg = load_config(CONFIGS / "tiny.yaml")
    with pytest.raises(ConfigError, match="rounds must be at least 1"):
        bench.bench_training(cfg, rounds=0)
    big = load_config(CONFIGS / "tiny.yaml", ["data.batch_size=100000"])
    with pytest.raises(ConfigError, match="fewer than one batch of 100000: lower"):
        bench.bench_training(big)
