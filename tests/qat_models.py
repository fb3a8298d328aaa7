"""Models and checkpoint edits for the QAT tests.

`outlier_channel` makes a run where static int8 with per-tensor weight scales loses accuracy:
one filter of a conv-BN-ReLU block gets `factor` times larger weights and a batch-norm shift so
negative that ReLU always outputs 0. The float model computes the same logits, but one
per-tensor weight scale must now span the outlier and the live filters.

`Guarded` checks its features for NaN with Python control flow that depends on the data:
eager, TorchScript tracing and ONNX export handle it, `torch.export` (hence PT2E QAT) cannot.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def outlier_channel(ckpt: Path, factor: float, channel: int = 0, block: int = 0) -> None:
    """Make `channel` of a conv-BN-ReLU block an outlier filter: weights `factor` times larger,
    its batch-norm shift so negative that ReLU always outputs 0 (a dead, exploded filter)."""
    data = torch.load(ckpt, map_location="cpu", weights_only=True)
    sd = data["state_dict"]
    sd[f"model.net.{block}.1.weight"][channel] *= factor
    sd[f"model.net.{block}.1.bias"][channel] = -1e4
    torch.save(data, ckpt)


class Guarded(nn.Module):
    """A small CNN with a NaN guard: data-dependent control flow."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.head = nn.Linear(8 * (image_size // 2) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x).flatten(1)
        if torch.isnan(h).any():  # a Python branch on tensor values: torch.export refuses it
            h = torch.nan_to_num(h)
        return self.head(h)
