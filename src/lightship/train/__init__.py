"""Training with Lightning: `fit(cfg, run)` writes checkpoints, best.ckpt and the manifest."""

from lightship.train.fit import fit

__all__ = ["fit"]
