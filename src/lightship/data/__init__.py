"""Data: uint8 image arrays `[N, C, H, W]` split into train/val/test.

`sources` needs only numpy and Pillow (scikit-learn for the built-in digits), so export,
quantize and report can rebuild the same splits without Lightning; `module` wraps them in a
LightningDataModule for training. The names below are imported from `sources` when first
used: the server decodes uploads with `images` alone and pays for none of the folder loading.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightship.data.sources import DataSpec, Splits, check_as_trained, load_splits

__all__ = ["DataSpec", "Splits", "check_as_trained", "load_splits"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from lightship.data import sources

        return getattr(sources, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
