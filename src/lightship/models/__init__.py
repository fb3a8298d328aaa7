"""Model zoo and registry: `create(spec)` builds any model by name or `package.module:Class`.

Every model built here starts with `Normalize`, so it takes raw uint8 pixels `[N, C, H, W]`
and every exported artifact does too.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from lightship.errors import ConfigError
from lightship.models.layers import Normalize
from lightship.models.zoo import MLP, DigitsCNN, ResNet18

Builder = Callable[..., nn.Module]

REGISTRY: dict[str, Builder] = {
    "digits_cnn": DigitsCNN,
    "resnet": ResNet18,
    "mlp": MLP,
}

# Keys of a model spec: the dict stored in every checkpoint, enough to rebuild the network.
SPEC_KEYS = ("name", "kwargs", "in_channels", "num_classes", "image_size", "mean", "std")


def resolve(name: str) -> Builder:
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" not in name:
        known = ", ".join(sorted(REGISTRY))
        raise ConfigError(f"unknown model '{name}': use one of {known} or 'package.module:Class'")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"model '{name}': cannot import {module_name} ({exc}); is it installed?"
        ) from None
    builder = getattr(module, attr, None)
    if builder is None:
        raise ConfigError(f"model '{name}': {module_name} has no class '{attr}'")
    # Only torch modules: a model name also comes from checkpoints, which may come from anyone,
    # and "os:system" with kwargs would otherwise run a command when the checkpoint is loaded.
    if not (inspect.isclass(builder) and issubclass(builder, nn.Module)):
        raise ConfigError(
            f"model '{name}' is not a torch.nn.Module class: name a class, 'package.module:Net'"
        )
    return builder


def _call_with_known(
    builder: Builder, standard: dict[str, Any], extra: dict[str, Any]
) -> nn.Module:
    """Pass the standard arguments a builder accepts (user models may take fewer)."""
    try:
        params = dict(inspect.signature(builder).parameters)
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in standard.items() if takes_any or k in params}
    kwargs.update(extra)
    try:
        model = builder(**kwargs)
    except (TypeError, ValueError) as exc:  # unknown argument, or a value the model refuses
        raise ConfigError(
            f"cannot build model with {sorted(kwargs)}: {exc}; check model.kwargs"
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model builder returned {type(model).__name__}, not a torch.nn.Module")
    return model


class Classifier(nn.Sequential):
    """`Normalize` followed by the network: raw uint8 pixels in, logits out."""

    def __init__(self, normalize: Normalize, net: nn.Module) -> None:
        super().__init__()
        self.normalize = normalize
        self.net = net


def create(spec: dict[str, Any]) -> Classifier:
    """Build a classifier from a spec (see SPEC_KEYS); the weights are fresh."""
    missing = [k for k in SPEC_KEYS if k not in spec]
    if missing:
        raise ConfigError(f"model spec lacks {missing}; it must carry {list(SPEC_KEYS)}")
    builder = resolve(spec["name"])
    standard = {
        "in_channels": spec["in_channels"],
        "num_classes": spec["num_classes"],
        "image_size": spec["image_size"],
    }
    net = _call_with_known(builder, standard, dict(spec["kwargs"]))
    return Classifier(Normalize(spec["mean"], spec["std"]), net)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "REGISTRY",
    "SPEC_KEYS",
    "Classifier",
    "Normalize",
    "count_parameters",
    "create",
    "resolve",
]
