"""Small models that fail on cue, for the tests of what is left behind: one that a run stops
training midway (a bad setting found late, a full disk, Ctrl-C), and ones that an exporter cannot
follow or that a parity check against eager must get right.

All share `SmallCNN`'s layers, so one training's weights load into any of them."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class SmallCNN(nn.Sequential):
    """conv 3x3 (4 channels), ReLU, flatten, linear."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__(
            nn.Conv2d(in_channels, 4, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * image_size * image_size, num_classes),
        )


class FailsWhileFitting(SmallCNN):
    """Its `steps`-th forward pass in training mode raises `error` (`interrupt`:
    KeyboardInterrupt, as Ctrl-C does; anything else: RuntimeError)."""

    def __init__(
        self, in_channels: int, num_classes: int, image_size: int, steps: int, error: str
    ) -> None:
        super().__init__(in_channels, num_classes, image_size)
        self.steps, self.error, self.calls = steps, error, 0

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.calls += 1
            if self.calls >= self.steps:
                if self.error == "interrupt":
                    raise KeyboardInterrupt
                raise RuntimeError(f"failed on purpose at training step {self.calls}")
        return super().forward(x)


class DivergesAfter(SmallCNN):
    """From its `steps`-th forward pass in training mode on, its weights are NaN: a learning
    rate that blows up after some good epochs."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int, steps: int) -> None:
        super().__init__(in_channels, num_classes, image_size)
        self.steps, self.calls = steps, 0

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.calls += 1
            if self.calls >= self.steps:
                with torch.no_grad():
                    for p in self.parameters():
                        p.fill_(float("nan"))
        return super().forward(x)


class BatchNormHead(nn.Sequential):
    """Conv, global average pool, BatchNorm1d, linear: in training mode BatchNorm1d refuses a
    batch of one image (not SmallCNN's layers: its weights load into no other model here)."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__(
            nn.Conv2d(in_channels, 4, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.BatchNorm1d(4),
            nn.Linear(4, num_classes),
        )


class SubtractsBatchMean(SmallCNN):
    """Its logits minus their mean over the batch, as batch norm in training mode does: an
    image's logits depend on the other images in its batch (at batch 1 they are all 0). Every
    exporter follows it; eager on the whole test split at once gives other logits."""

    def forward(self, x: Tensor) -> Tensor:
        logits = super().forward(x)
        return logits - logits.mean(0, keepdim=True)


class ShiftsBatches(SmallCNN):
    """Adds 1 to its logits in batches of more than one image: a Python `if` on the batch's
    size, which the exporters freeze at their example batch of 2. The artifact then adds 1 at
    batch 1 too, where eager does not; on the whole test split at once both add it."""

    def forward(self, x: Tensor) -> Tensor:
        logits = super().forward(x)
        return logits + 1 if len(x) > 1 else logits


class ChecksForNaN(SmallCNN):
    """Raises on a NaN in its features: a Python `if` on a tensor's value, which tracing (the
    legacy ONNX exporter, TorchScript) records as the branch taken, here never the raise, and
    which torch.export cannot follow (GuardOnDataDependentSymNode): its .pt2 export fails."""

    def forward(self, x: Tensor) -> Tensor:
        h = self[2](self[1](self[0](x)))
        if torch.isnan(h).any():
            raise ValueError("NaN in the features")
        return self[3](h)


class Bessel(SmallCNN):
    """Features through `torch.special.bessel_j0`, an operator neither ONNX exporter knows:
    its ONNX export fails (TorchScript and .pt2 take it)."""

    def forward(self, x: Tensor) -> Tensor:
        return self[3](torch.special.bessel_j0(self[2](self[1](self[0](x)))))


class Squeezes(SmallCNN):
    """`squeeze()` where `flatten(1)` belongs: right for 2 images, [classes] for one."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).squeeze()


class KeepsSpatialAxes(SmallCNN):
    """Logits as [N, classes, 1, 1], as a conv head without a flatten gives them."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x)[:, :, None, None]


class AuxWhileTraining(SmallCNN):
    """(logits, aux) in training mode, logits in eval mode, as torchvision's Inception."""

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        logits = super().forward(x)
        return (logits, logits) if self.training else logits


class AssertsItsWidth(SmallCNN):
    """Its __init__ asserts on a keyword argument."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int, width: int) -> None:
        assert width % 4 == 0, f"width must be a multiple of 4, got {width}"
        super().__init__(in_channels, num_classes, image_size)


class Bfloat16Logits(SmallCNN):
    """Its logits cast to bfloat16, as a cast left at the end of forward gives them."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).bfloat16()


class Float64Logits(SmallCNN):
    """Its logits cast to float64: every runtime gives them back as float32."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).double()


class RandomInEval(SmallCNN):
    """Dropout on its features in eval mode too (`training=True`, a common slip): the same
    image gets other logits each time, which no exported format can match."""

    def forward(self, x: Tensor) -> Tensor:
        h = self[2](self[1](self[0](x)))
        return self[3](nn.functional.dropout(h, 0.5, training=True))
