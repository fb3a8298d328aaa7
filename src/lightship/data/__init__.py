"""Data: uint8 image arrays `[N, C, H, W]` split into train/val/test.

`sources` needs only numpy and Pillow (scikit-learn for the built-in digits), so export,
quantize and report can rebuild the same splits without Lightning; `module` wraps them in a
LightningDataModule for training.
"""

from lightship.data.sources import DataSpec, Splits, check_as_trained, load_splits

__all__ = ["DataSpec", "Splits", "check_as_trained", "load_splits"]
