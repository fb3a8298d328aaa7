from collections.abc import Sequence

import torch
from torch import nn


class Normalize(nn.Module):
    """`(x - mean) / std` per channel, on raw pixels (uint8 or float, 0..255).

    Being the first layer keeps uint8 from disk to device (4x fewer bytes through the DataLoader)
    and bakes normalisation into every exported artifact. Written as one multiply-add so that
    ONNX gets Cast -> Mul -> Add, which graph optimisers fold into the first convolution.
    """

    scale: torch.Tensor
    shift: torch.Tensor

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        if len(mean) != len(std) or not mean:
            raise ValueError(f"mean {list(mean)} and std {list(std)} need one value per channel")
        if any(s <= 0 for s in std):
            raise ValueError(f"std must be positive, got {list(std)}")
        m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.register_buffer("scale", 1.0 / s)
        self.register_buffer("shift", -m / s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32) * self.scale + self.shift
