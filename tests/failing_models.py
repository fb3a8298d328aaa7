"""A model that trains for a few steps and then fails, as a run does that Lightning stops midway
(a bad setting found late, a full disk, Ctrl-C) — on cue, for the tests of what is left behind."""

from __future__ import annotations

from torch import Tensor, nn


class FailsWhileFitting(nn.Sequential):
    """A small CNN whose `steps`-th forward pass in training mode raises `error`
    (`interrupt`: KeyboardInterrupt, as Ctrl-C does; anything else: RuntimeError)."""

    def __init__(
        self, in_channels: int, num_classes: int, image_size: int, steps: int, error: str
    ) -> None:
        super().__init__(
            nn.Conv2d(in_channels, 4, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * image_size * image_size, num_classes),
        )
        self.steps, self.error, self.calls = steps, error, 0

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.calls += 1
            if self.calls >= self.steps:
                if self.error == "interrupt":
                    raise KeyboardInterrupt
                raise RuntimeError(f"failed on purpose at training step {self.calls}")
        return super().forward(x)
