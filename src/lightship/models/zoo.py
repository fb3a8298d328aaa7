"""The built-in networks. Each takes normalised float input; `models.create` adds `Normalize`."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn


def _widths(name: str, value: object, example: str, allow_empty: bool = False) -> list[int]:
    """`value` as a list of positive ints, or a ValueError naming the setting and an example
    (a typo in `--set model.kwargs...` would otherwise surface as a torch error deep inside)."""
    if (
        isinstance(value, (list, tuple))
        and (allow_empty or len(value) > 0)
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        return list(value)
    raise ValueError(
        f"{name} must be a list of positive whole numbers, e.g. {example}; got {value!r}"
    )


def _dropout(value: object) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1:
        return float(value)
    raise ValueError(f"dropout must be a number in [0, 1), e.g. 0.1; got {value!r}")


def conv_bn_relu(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class DigitsCNN(nn.Sequential):
    """VGG-style CNN: stages of 3x3 conv-BN-ReLU, each closed by a 2x2 max-pool, then one
    linear layer over the flattened map (the layout matters for digits: 6 vs 9).

    The default, ((32,), (64, 64), (128,)), has 141k parameters and 14.7 MMAC at 28x28. Most of
    its work is in the 64-channel 3x3 convolutions, which is what int8 kernels speed up; a
    1-channel first convolution gains nothing from int8 on AVX2 (measured: 4x slower than fp32).
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: int = 28,
        stages: Sequence[Sequence[int]] = ((32,), (64, 64), (128,)),
        dropout: float = 0.1,
    ) -> None:
        example = "[[32], [64, 64], [128]]"
        if not isinstance(stages, (list, tuple)) or not stages:
            raise ValueError(
                f"stages must be a list of lists of widths, e.g. {example}; got {stages!r}"
            )
        stages = [_widths("each of stages", stage, example) for stage in stages]
        dropout = _dropout(dropout)
        layers: list[nn.Module] = []
        cin, size = in_channels, image_size
        for stage in stages:
            for width in stage:
                layers.append(conv_bn_relu(cin, width))
                cin = width
            layers.append(nn.MaxPool2d(2))
            size //= 2
        if size < 1:
            raise ValueError(
                f"image_size {image_size} is too small for {len(stages)} pooling stages"
            )
        layers += [nn.Flatten(), nn.Dropout(dropout), nn.Linear(cin * size * size, num_classes)]
        super().__init__(*layers)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        # Two ReLU modules, not one used twice: PT2E's quantizer annotates a module called from
        # two places as one partition with two outputs, and QAT preparation refuses it.
        self.relu1 = nn.ReLU(inplace=True)
        self.relu2 = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR-style ResNet-18: 3x3 stride-1 stem, no max-pool, [2, 2, 2, 2] basic blocks.

    11.2M parameters and ~0.56 GMAC at 3x32x32; global pooling makes any input size work.
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        width: int = 64,
        blocks: Sequence[int] = (2, 2, 2, 2),
    ) -> None:
        super().__init__()
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise ValueError(f"width must be a positive whole number, e.g. 64; got {width!r}")
        blocks = _widths("blocks", blocks, "[2, 2, 2, 2]")
        self.stem = conv_bn_relu(in_channels, width)
        stages: list[nn.Module] = []
        cin = width
        for i, n in enumerate(blocks):
            cout = width * 2**i
            for j in range(n):
                stages.append(BasicBlock(cin, cout, stride=2 if (i > 0 and j == 0) else 1))
                cin = cout
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool(self.stages(self.stem(x)))
        return self.fc(x.flatten(1))


class MLP(nn.Sequential):
    """Flatten, then fully connected layers: nearly all FLOPs in MatMul (dynamic int8 suits it)."""

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: int = 28,
        hidden: Sequence[int] = (256, 256),
        dropout: float = 0.1,
    ) -> None:
        hidden = _widths("hidden", hidden, "[256, 256]", allow_empty=True)
        dropout = _dropout(dropout)
        layers: list[nn.Module] = [nn.Flatten()]
        cin = in_channels * image_size * image_size
        for h in hidden:
            layers += [nn.Linear(cin, h), nn.ReLU(inplace=True), nn.Dropout(dropout)]
            cin = h
        layers.append(nn.Linear(cin, num_classes))
        super().__init__(*layers)
