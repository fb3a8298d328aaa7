"""Load the built-in digits, an image folder or an .npz as uint8 NCHW arrays, split by seed."""

from __future__ import annotations

import logging
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from lightship.errors import DataError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}


@dataclass(frozen=True)
class DataSpec:
    """What identifies a data set and its split; stored in checkpoints so later stages can
    rebuild the same held-out test split without the training config."""

    source: str = "digits"
    path: str | None = None
    image_size: int = 28
    channels: int = 1
    val_fraction: float = 0.15
    test_fraction: float = 0.15
    split_seed: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataSpec:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Splits:
    train_x: np.ndarray
    train_y: np.ndarray
    val_x: np.ndarray
    val_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    labels: list[str]

    def pixel_stats(self) -> tuple[list[float], list[float]]:
        """Per-channel mean and std of the training images, in pixel units (0..255)."""
        x = self.train_x.astype(np.float64)
        mean = x.mean(axis=(0, 2, 3))
        std = x.std(axis=(0, 2, 3))
        return [round(float(m), 4) for m in mean], [round(max(float(s), 1e-3), 4) for s in std]


def resize_uint8(images: np.ndarray, size: int, channels: int) -> np.ndarray:
    """NCHW uint8 -> NCHW uint8 at `size`x`size` with `channels` (gray <-> RGB as needed)."""
    n, c, h, w = images.shape
    if c != channels:
        if c == 1 and channels == 3:
            images = np.repeat(images, 3, axis=1)
        elif c == 3 and channels == 1:
            gray = images.astype(np.float32).transpose(0, 2, 3, 1) @ np.array([0.299, 0.587, 0.114])
            images = np.clip(np.rint(gray), 0, 255).astype(np.uint8)[:, None]
        else:
            raise DataError(f"cannot convert {c}-channel images to {channels} channels")
    if (h, w) == (size, size):
        return np.ascontiguousarray(images)
    out = np.empty((n, channels, size, size), dtype=np.uint8)
    for i in range(n):
        for ch in range(channels):
            img = Image.fromarray(images[i, ch])
            out[i, ch] = np.asarray(img.resize((size, size), Image.Resampling.BILINEAR))
    return out


def _digits() -> tuple[np.ndarray, np.ndarray, list[str]]:
    from sklearn.datasets import load_digits  # ships with scikit-learn: no download

    bunch = load_digits()
    images = np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None]  # 8x8, 0..16
    return images, bunch.target.astype(np.int64), [str(t) for t in bunch.target_names]


def _folder(root: Path, channels: int, size: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    if not root.is_dir():
        raise DataError(
            f"image folder {root} does not exist: set data.path to a folder of <class>/*.png"
        )
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    files: list[tuple[Path, int]] = []
    skipped: list[Path] = []
    for idx, name in enumerate(classes):
        for f in sorted((root / name).iterdir()):
            if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file():
                files.append((f, idx))
            elif f.is_file() and not f.name.startswith("."):
                skipped.append(f)
    if skipped:
        kinds = sorted({f.suffix.lower() or f.name for f in skipped})
        log.warning(
            "image folder %s: skipped %d files that are not PNG/JPEG (%s), e.g. %s",
            root,
            len(skipped),
            ", ".join(kinds[:5]),
            skipped[0],
        )
    if not files:
        raise DataError(
            f"image folder {root} has no images: expected {root}/<class>/*.png|jpg "
            f"(found classes: {classes})"
        )
    mode = "L" if channels == 1 else "RGB"
    x = np.empty((len(files), channels, size, size), dtype=np.uint8)
    with warnings.catch_warnings():
        # a small file can decode to gigapixels: past Pillow's warning size, refuse it at once
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        for i, (f, _) in enumerate(files):
            try:
                with Image.open(f) as img:
                    arr = np.asarray(
                        img.convert(mode).resize((size, size), Image.Resampling.BILINEAR)
                    )
            except (OSError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
                raise DataError(
                    f"cannot read image {f}: {str(exc).rstrip('.')}; remove or replace the file"
                ) from None
            x[i] = arr[None] if channels == 1 else arr.transpose(2, 0, 1)
    y = np.array([label for _, label in files], dtype=np.int64)
    return x, y, classes


def _npz(path: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    if not path.is_file():
        raise DataError(
            f"npz file {path} does not exist: set data.path to a .npz with arrays x and y"
        )
    if not zipfile.is_zipfile(path):  # else np.load would try it as a pickle or a bare .npy
        raise DataError(
            f"{path} is not an .npz archive (truncated, or another format): "
            "write it with np.savez(path, x=uint8_images, y=labels)"
        )
    try:  # zipfile raises RuntimeError for an encrypted member or an unknown compression method
        with np.load(path, allow_pickle=False) as npz:
            if "x" not in npz or "y" not in npz:
                raise DataError(
                    f"{path} must hold arrays 'x' (uint8 images) and 'y' (class per image), "
                    f"found {npz.files}"
                )
            x, y = npz["x"], npz["y"]
            names = npz.get("labels")
    except (OSError, ValueError, EOFError, RuntimeError, zipfile.BadZipFile, zlib.error) as exc:
        # zipfile's EOFError has no message: say what it means
        reason = str(exc) or (
            "it ends before its data (EOFError)" if isinstance(exc, EOFError) else repr(exc)
        )
        raise DataError(
            f"cannot read {path}: {reason}; "
            "write it again with np.savez(path, x=uint8_images, y=labels)"
        ) from None
    labels = None
    if names is not None:
        labels = [str(v) for v in names.ravel()]
        if names.ndim != 1 or len(set(labels)) != len(labels):
            raise DataError(
                f"{path}: 'labels' must be a list of distinct class names, got shape "
                f"{names.shape} with {len(set(labels))} distinct of {len(labels)}"
            )
    if x.dtype.kind in "iu" and x.dtype != np.uint8 and x.size and 0 <= x.min() <= x.max() <= 255:
        x = x.astype(np.uint8)  # integer pixels that fit: the same image
    if x.dtype != np.uint8:
        hint = " (images in 0..1: x = np.round(x * 255).astype(np.uint8))" * (x.dtype.kind == "f")
        raise DataError(f"{path}: x has dtype {x.dtype}; store images as uint8 pixels 0..255{hint}")
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
        x = x.transpose(0, 3, 1, 2)  # NHWC -> NCHW
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]  # a column of labels
    if x.ndim != 4 or y.ndim != 1 or len(x) != len(y) or len(x) == 0:
        raise DataError(
            f"{path}: need x [N,C,H,W] or [N,H,W,C] and y [N] (one class per image), "
            f"got {x.shape} and {y.shape}"
        )
    if y.dtype.kind == "U":  # class names: indexed in sorted order, like the folder's class dirs
        names = labels if labels is not None else sorted(set(y.tolist()))
        index = {name: i for i, name in enumerate(names)}
        unknown = sorted(set(y.tolist()) - index.keys())
        if unknown:
            raise DataError(f"{path}: y has class names {unknown[:5]} that are not in 'labels'")
        y, labels = np.array([index[v] for v in y.tolist()], dtype=np.int64), names
    elif y.dtype.kind not in "biuf":
        raise DataError(
            f"{path}: y has dtype {y.dtype}; store class indices 0..K-1 (int) or class names (str)"
        )
    if y.dtype.kind == "f":
        whole = np.isfinite(y) & (y == np.round(y))
        if not whole.all():  # never truncate 1.5 to class 1: these are not class labels
            raise DataError(
                f"{path}: y holds non-integer labels such as {y[~whole][:3].tolist()}; "
                "y must be class indices 0..K-1 (or class names)"
            )
    y = y.astype(np.int64)
    if y.min() < 0:
        raise DataError(
            f"{path}: y has negative labels (min {y.min()}); class indices must be 0..K-1: "
            "renumber them, e.g. y = np.unique(y, return_inverse=True)[1]"
        )
    if labels is None:
        labels = [str(i) for i in range(int(y.max()) + 1)]
    if y.max() >= len(labels):
        raise DataError(
            f"{path}: y has class index {y.max()} but 'labels' names only {len(labels)} classes"
        )
    return x, y, labels


def stratified_split(
    y: np.ndarray, val_fraction: float, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices (train, val, test): each class split in the same proportions, fixed by `seed`."""
    rng = np.random.default_rng(seed)
    parts: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] = ([], [], [])
    for cls in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == cls))
        n_test = round(len(idx) * test_fraction)
        n_val = round(len(idx) * val_fraction)
        parts[2].append(idx[:n_test])
        parts[1].append(idx[n_test : n_test + n_val])
        parts[0].append(idx[n_test + n_val :])
    train, val, test = (np.sort(np.concatenate(p)) for p in parts)
    return train, val, test


def load_splits(spec: DataSpec, recorded: bool = False) -> Splits:
    """The splits of `spec`. `recorded`: the spec a run recorded when it trained, which the
    later stages (export, quantize, report) read and take no --set to change: data no longer at
    its path is to be put back there."""
    if spec.source == "digits":
        x, y, labels = _digits()
    elif spec.source in ("folder", "npz"):
        if not spec.path:
            raise DataError(f"data.source={spec.source} needs data.path (--set data.path=...)")
        path = Path(spec.path)
        folder = spec.source == "folder"
        if recorded and not (path.is_dir() if folder else path.is_file()):
            raise DataError(
                f"{'image folder' if folder else 'npz file'} {path}, which this run was trained "
                "on, does not exist: put the data back at that path (a symlink to its new place "
                "will do) and run again"
            )
        if folder:
            x, y, labels = _folder(path, spec.channels, spec.image_size)
        else:
            x, y, labels = _npz(path)
    else:
        raise DataError(f"unknown data.source '{spec.source}': use digits, folder or npz")
    if len(np.unique(y)) < 2:
        hint = ": put each class in its own sub-folder" if spec.source == "folder" else ""
        raise DataError(
            f"{spec.source} data {spec.path} has a single class ({labels[int(y[0])]!r}): "
            f"a classifier needs at least 2{hint}"
        )
    if empty := [labels[i] for i in np.flatnonzero(np.bincount(y, minlength=len(labels)) == 0)]:
        # the model would get an output per class, and never see an image of these
        fix = (
            "add images to those sub-folders or remove them"
            if spec.source == "folder"
            else "renumber y, e.g. y = np.unique(y, return_inverse=True)[1], or drop those names "
            "from 'labels'"
        )
        raise DataError(
            f"{spec.source} data {spec.path}: {len(empty)} of {len(labels)} classes have no "
            f"images ({', '.join(map(repr, empty[:5]))}{', ...' if len(empty) > 5 else ''}): {fix}"
        )
    x = resize_uint8(x, spec.image_size, spec.channels)
    train, val, test = stratified_split(y, spec.val_fraction, spec.test_fraction, spec.split_seed)
    if min(len(train), len(val), len(test)) == 0:
        raise DataError(
            f"{spec.source} data with {len(y)} images leaves an empty split (train {len(train)}, "
            f"val {len(val)}, test {len(test)}): add images or change data.val_fraction / "
            "data.test_fraction"
        )
    log.debug("data %s: train %d, val %d, test %d", spec.source, len(train), len(val), len(test))
    return Splits(x[train], y[train], x[val], y[val], x[test], y[test], labels)
