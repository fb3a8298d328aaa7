"""Load the built-in digits, an image folder or an .npz as uint8 NCHW arrays, split by seed."""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import os
import re
import shlex
import warnings
import zipfile
import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from lightship.config import set_arg
from lightship.data import images
from lightship.errors import DataError, RunError

log = logging.getLogger(__name__)

# Notes already logged by this process: export, quantize (twice: PTQ and QAT) and report each
# rebuild the splits from the same data (and gate on them), and a note is news once.
_noted: set[str] = set()


def note_once(level: int, message: str, logger: logging.Logger = log) -> None:
    """Log `message` on `logger`, the first time this process is told it only."""
    if message not in _noted:
        _noted.add(message)
        logger.log(level, message)


def _some(items: list[str], most: int = 5, sep: str = ", ") -> str:
    """`a, b, c` or, past `most` items, `a, b, c, d, e and 7 more`."""
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return sep.join(items[:most]) + more


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
    # "N:sha256" of the images and labels the run trained on (`fingerprint`): later stages
    # refuse data that changed since, whose split would mix trained-on images into the test.
    # None before the data is read, and in runs recorded before it was kept.
    fingerprint: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataSpec:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


# Pixels of one channel per histogram in `Splits.pixel_stats`: np.bincount takes them as int64
# (8 MB a chunk)
_STATS_CHUNK = 1 << 20


@dataclass(frozen=True)
class Splits:
    """Each split's uint8 NCHW images and labels; a split not asked of `load_splits` (`only`)
    is empty, images and labels."""

    train_x: np.ndarray
    train_y: np.ndarray
    val_x: np.ndarray
    val_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    labels: list[str]
    fingerprint: str

    def pixel_stats(self) -> tuple[list[float], list[float]]:
        """Per-channel mean and std of the training images, in pixel units (0..255).

        Counted as a histogram of the uint8 values, a chunk of images at a time, and summed in
        exact integers: a float64 copy of the images (and numpy's temporary for the std) took
        16 times their own memory, 3 GB for 226 MB of 224-pixel photos."""
        x = self.train_x
        counts = np.zeros((x.shape[1], 256), dtype=np.int64)
        step = max(1, _STATS_CHUNK // max(1, x.shape[2] * x.shape[3]))
        for start in range(0, len(x), step):
            chunk = x[start : start + step]
            for c in range(x.shape[1]):
                counts[c] += np.bincount(chunk[:, c].ravel(), minlength=256)
        values = np.arange(256, dtype=np.int64)
        means, stds = [], []
        for row in counts:
            n, total = int(row.sum()), int(row @ values)
            squares = int(row @ (values * values))
            n = max(n, 1)
            means.append(round(total / n, 4))
            # the variance as one exact fraction, (n * sum x^2 - (sum x)^2) / n^2
            stds.append(round(max(math.sqrt((n * squares - total * total) / (n * n)), 1e-3), 4))
        return means, stds


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
    """sklearn's digits (it ships them: no download), 8x8 in 0..255. Read from its CSV as
    `load_digits` reads it, without importing `sklearn.datasets`, which imports SciPy and
    most of sklearn: 2.2 s of every command that loads the data, on a 2-core AVX2 EPYC."""
    data = _digits_csv()
    if data is None:  # not where sklearn keeps it (another version): sklearn's own way
        from sklearn.datasets import load_digits

        bunch = load_digits()
        data = np.column_stack([bunch.data, bunch.target])
    flat, target = data[:, :-1], data[:, -1].astype(np.int64)
    images = np.rint(flat.reshape(-1, 8, 8) * (255.0 / 16.0)).astype(np.uint8)[:, None]
    return images, target, [str(t) for t in range(10)]


def _digits_csv() -> np.ndarray | None:
    """sklearn's digits.csv.gz (64 pixels and the label a row, as float64), found without
    importing sklearn; None where it is not there."""
    import gzip
    from importlib.util import find_spec

    spec = find_spec("sklearn")  # a top-level package: found, not imported
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        return None
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data: np.ndarray = np.loadtxt(f, delimiter=",")
    return data if data.ndim == 2 and data.shape[1] == 65 else None


def _files_below(folder: Path) -> list[Path]:
    """Every file below `folder`, in sub-folders and linked folders too (as torchvision's
    ImageFolder reads a class folder), hidden ones left out, in a fixed order."""

    def refused(exc: OSError) -> None:  # os.walk would pass over a folder it may not read
        raise exc

    found: list[Path] = []
    # The folders above it too: a link to the data root (`cat/all -> ..`) read every other
    # class's images again as this one's. Above it as named (a class folder that is itself a
    # link has the data root there) and as it lies on disk.
    above = {*Path(os.path.abspath(folder)).parents, *Path(folder).resolve().parents}
    walked = {(s.st_dev, s.st_ino) for s in map(os.stat, above)}
    for top, dirs, names in os.walk(folder, onerror=refused, followlinks=True):
        stat = os.stat(top)
        if (stat.st_dev, stat.st_ino) in walked:  # a link back up the tree
            dirs.clear()
            continue
        walked.add((stat.st_dev, stat.st_ino))
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(top, n) for n in sorted(names) if not n.startswith(".")]
    _refuse_dangling(folder.parent, [f for f in found if f.is_symlink() and not f.exists()])
    return [f for f in found if f.is_file()]


def _refuse_dangling(root: Path, links: list[Path]) -> None:
    """Links to nothing (an unmounted disk, a moved folder): their images belong to the data
    set, and training on the rest would quietly drop them, or a whole class."""
    if links:
        shown = [f"{shown_name(str(f.relative_to(root)))} -> {os.readlink(f)}" for f in links]
        raise DataError(
            f"image folder {root}: "
            + (f"{len(links)} links point" if len(links) > 1 else "a link points")
            + f" to nothing ({_some(shown, 3)}): "
            "mount or restore what they point to, or remove the links"
        )


def shown_name(name: str) -> str:
    """A file name for a message: bytes that are not UTF-8 (an archive unzipped from another
    system) shown as \\xNN, where printing them would fail."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _wrapped_classes(root: Path, labels: list[str], counts: np.ndarray) -> Path | None:
    """The folder of class folders inside the one class folder that holds images, where the
    data came in a wrapper (Kaggle's training_set/training_set/{cats,dogs}, EuroSAT's
    2750/<class>, Food-101's images/<class> beside meta/): else None."""
    holding = [label for label, n in zip(labels, counts, strict=True) if n]
    if len(holding) != 1:
        return None
    found = _class_folders_below(root / holding[0])
    return found if len(_folders_in(found)) > 1 else None


def _check_classes(
    source: str, path: str, y: np.ndarray, labels: list[str], trained: bool = False
) -> None:
    """Every class has images, and there are at least two. `trained`: data a run has trained
    on (its later stages, or a resume), which had both then (training refuses others): what
    is there now changed since, and is to be put back as it was, not mended otherwise."""
    counts = np.bincount(y, minlength=len(labels))
    inside = ""
    if source == "folder" and not trained:
        wrapped = _wrapped_classes(Path(path), labels, counts)
        if wrapped is not None:
            inside = (
                f"the folders in {wrapped} ({_some(_folders_in(wrapped), 5)}): point data.path "
                f"at it, {set_arg('data.path', str(wrapped))}"
            )
    back = "put the data back as it was when the run trained"
    if empty := [labels[i] for i in np.flatnonzero(counts == 0)]:
        # the model would get an output per class, and never see an image of these
        if trained:
            fix = (
                f"the run trained with none empty: {back} (remove those added since; images "
                "added would change the data, and be refused)"
            )
        elif source == "folder":
            fix = "add images to those sub-folders or remove them"
            fix += f"; or, if the classes are {inside}" if inside else ""
        else:
            fix = (
                "renumber y, e.g. y = np.unique(y, return_inverse=True)[1], or drop those names "
                "from 'labels'"
            )
        raise DataError(
            f"{source} data {path}: {len(empty)} of {len(labels)} classes have no "
            f"images ({', '.join(map(repr, empty[:5]))}{', ...' if len(empty) > 5 else ''}): {fix}"
        )
    if len(labels) < 2:
        if trained:
            hint = f": the run trained on more; {back}"
        elif source == "folder":
            hint = (
                f": the classes are {inside}"
                if inside
                else ": put each class in its own sub-folder"
            )
        else:
            hint = ""
        raise DataError(
            f"{source} data {path} has a single class ({labels[0]!r}): "
            f"a classifier needs at least 2{hint}"
        )


def _note_gray(colour: int) -> None:
    if colour:
        note_once(
            logging.INFO,
            f"data.channels=1: {colour} colour images converted to grayscale; "
            "set data.channels=3 to keep colour",
        )


# The words that name a data set's splits, by kind (the unlabelled images to predict, Intel's
# seg_pred, are a test split's kind)
_SPLIT_KINDS = {
    "train": {"train", "training", "trainval"},
    "val": {"val", "valid", "validation", "validate", "dev", "eval", "holdout"},
    "test": {"test", "testing", "pred", "predict", "prediction", "unlabeled", "unlabelled"},
}
# A word of a split's name with one of these glued on: trainset, testdata, TrainImages
_SPLIT_SUFFIX = re.compile(r"(set|data|images|imgs|split)$")


def _split_kinds(name: str) -> set[str]:
    """The kinds of split a folder's name names by its words (split at non-letters and at
    camelCase, `set` or `data` glued on taken off): `training_set`, `TrainingSet`, `trainset`,
    `seg_train`, `train.v1` and `val2017` are splits' names; `not_valid` and `test_pass` too,
    one kind each, where `_refuse_split_layout` requires two kinds."""
    words = re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])", name)
    words = [w.lower() for w in words]
    words += [_SPLIT_SUFFIX.sub("", w) for w in words]
    return {kind for kind, names in _SPLIT_KINDS.items() if names.intersection(words)}


def _class_folders_below(folder: Path) -> Path:
    """`folder`, or the one folder it alone holds, down to one that holds images or several
    folders (Kaggle's cats and dogs come as training_set/training_set/{cats,dogs})."""
    while True:
        entries = [p for p in folder.iterdir() if not p.name.startswith(".")]
        inside = [p for p in entries if p.is_dir()]
        if len(inside) != 1 or any(p.is_file() for p in entries):
            return folder
        folder = inside[0]


def _folders_in(folder: Path) -> list[str]:
    """The names of the folders in `folder` that are read, sorted: a hidden one (Jupyter's
    .ipynb_checkpoints) holds no class."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _holds_classes(folder: Path) -> bool:
    """Whether `folder`, or the one folder it alone holds, holds class folders (two or more)."""
    return len(_folders_in(_class_folders_below(folder))) > 1


def _refuse_split_layout(root: Path, classes: list[str]) -> None:
    """root/{train,val}/<class>/, the layout many downloaded data sets come in (Kaggle's
    training_set/test_set too): read as classes, it trained a train-versus-val classifier, and
    exited 0. Every class named as a split, of two kinds at least (train and test), and one
    holding folders of its own: refused (a warning was read past, and root/{train/<class>/,
    test/} went unwarned). Only as a run trains: one trained on it before stays usable."""
    kinds = {c: _split_kinds(c) for c in classes}
    if len(classes) < 2 or not all(kinds.values()) or len(set().union(*kinds.values())) < 2:
        return  # classes valid/not_valid or test_pass/test_fail: one kind, a data set's classes
    inside = {c: _folders_in(root / c) for c in classes}
    holding = [c for c in classes if inside[c]]
    if not holding:
        _refuse_classes_in_file_names(root, classes, kinds)
        return
    train = next((c for c in holding if "train" in kinds[c]), holding[0])
    found = _class_folders_below(root / train)
    # the other labelled splits' images are not read then: said, not dropped without a word
    # (a split of loose images, Intel's seg_pred/seg_pred/*.jpg, is unlabelled: nothing to move)
    others = ", ".join(f"{c}/" for c in holding if c != train and _holds_classes(root / c))
    move = (
        f"move the images of {others} into the class folders of {found.relative_to(root)}/ "
        "to use them too, and "
        if others
        else ""
    )
    fix = (
        f"{move}point data.path at its folder of class folders: {set_arg('data.path', str(found))}"
        if len(_folders_in(found)) > 1
        else "point data.path at a folder holding one sub-folder per class"
    )
    raise DataError(
        f"image folder {root}: its classes would be {', '.join(classes)}, which are the "
        f"splits of a data set ({train}/ holds {_some(inside[train], 3)}): lightship splits "
        f"the data itself (data.val_fraction, data.test_fraction), so {fix}"
    )


# An image file named by its class, a dot and a number: Kaggle's dogs-vs-cats train/cat.1.jpg
# (not a camera's IMG_0001.jpg, DSC_0001.JPG)
_NAMED_BY_CLASS = re.compile(r"([A-Za-z][A-Za-z0-9_-]*)\.\d+\.[A-Za-z]+")


def _refuse_classes_in_file_names(
    root: Path, classes: list[str], kinds: dict[str, set[str]]
) -> None:
    """root/{train,test1}/ holding cat.1.jpg, dog.1.jpg (Kaggle's dogs-vs-cats): every class a
    split's name, and the training split's files named by two classes or more. Read as
    classes, it trained a train-versus-test classifier and exited 0. Classes named so whose
    files are not (train/0.png, test/0.png) stay classes."""
    train = next((c for c in classes if "train" in kinds[c]), None)
    if train is None:
        return
    named: dict[str, int] = {}
    for i, f in enumerate((root / train).iterdir()):
        if i == 2000:  # enough to tell, in a folder of 25,000
            break
        if (match := _NAMED_BY_CLASS.fullmatch(f.name)) and f.suffix.lower() in images.SUFFIXES:
            named[match[1]] = named.get(match[1], 0) + 1
    if len(named) < 2:
        return
    words = sorted(named, key=lambda w: (-named[w], w))[:5]
    moves = " && ".join(  # each word letters, digits, _ and -: safe in a shell as it is
        f"mkdir -p DEST/{w} && mv {shlex.quote(str(root / train))}/{w}.* DEST/{w}/"
        for w in words[:2]
    )
    more = ", and so on for the others" if len(named) > 2 else ""
    raise DataError(
        f"image folder {root}: its classes would be {', '.join(classes)}, which are the "
        f"splits of a data set, and {train}/ names its images by class "
        f"({', '.join(words)}: e.g. {words[0]}.1.jpg): lightship reads an image's class from "
        f"its folder and splits the data itself, so move each class's images into a folder of "
        f"its own ({moves}{more}) and set data.path=DEST; leave out the unlabelled ones"
    )


def _sibling_folders(root: Path) -> bool:
    """Whether a folder beside `root` holds images of its own, as another class's would (the
    first 20 folders, 50 entries of each, looked at)."""
    try:
        itself = root.resolve()  # and not a link to it (pytest's `...current`)
        siblings = [
            p
            for p in itertools.islice(Path(os.path.abspath(root)).parent.iterdir(), 200)
            if p.resolve() != itself and not p.name.startswith(".")  # as `_image_files` skips
        ]
        return any(
            f.suffix.lower() in images.SUFFIXES and f.is_file()
            for folder in [p for p in siblings if p.is_dir()][:20]
            for f in itertools.islice(folder.iterdir(), 50)
        )
    except OSError:
        return False


def _image_files(
    root: Path,
) -> tuple[list[str], list[tuple[Path, int]], list[Path], list[Path]]:
    """An image folder's classes, its (image file, class index) pairs, the other files, and the
    images lying directly in the root, which belong to no class."""
    entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    _refuse_dangling(root, [p for p in entries if p.is_symlink() and not p.exists()])
    classes = [p.name for p in entries if p.is_dir()]
    if odd := [shown_name(c) for c in classes if shown_name(c) != c]:
        # a label goes into JSON, YAML and the model files' metadata, which take UTF-8 only
        raise DataError(
            f"image folder {root}: class folder names must be UTF-8 text, and "
            f"{_some(odd, 3)} is not: rename it (`convmv -f latin1 -t utf8 -r --notest "
            f"{root}` converts names from Latin-1)"
        )
    loose = [p for p in entries if p.is_file() and p.suffix.lower() in images.SUFFIXES]
    files: list[tuple[Path, int]] = []
    skipped: list[Path] = []
    for idx, name in enumerate(classes):
        for f in _files_below(root / name):
            if f.suffix.lower() in images.SUFFIXES:
                files.append((f, idx))
            else:
                skipped.append(f)
    return classes, files, skipped, loose


def _folder_files(
    root: Path, check_layout: bool = True, trained: bool = False
) -> tuple[list[tuple[Path, int]], np.ndarray, list[str]]:
    """The folder's (image file, class index) pairs, their labels and the class names, from the
    folder's listing alone. `check_layout`: refuse a folder already split
    (`_refuse_split_layout`); not the data a run trained on, so that a run trained before that
    refusal stays usable. `trained`: data a run has trained on (`_check_classes`)."""
    if root.is_file():
        fix = (
            "set data.source=npz for an .npz file"
            if root.suffix.lower() == ".npz"
            else "set data.path to a folder of <class>/*.png|jpg"
        )
        raise DataError(f"data.source=folder needs an image folder, but {root} is a file: {fix}")
    if not root.is_dir():
        raise DataError(
            f"image folder {root} does not exist: set data.path to a folder of <class>/*.png"
        )
    classes, files, skipped, loose = _image_files(root)
    if check_layout:
        _refuse_split_layout(root, classes)
    if loose and files:
        note_once(
            logging.WARNING,
            f"image folder {root}: left out {len(loose)} images that lie directly in it, in no "
            f"class sub-folder ({_some([shown_name(f.name) for f in loose], 3)}): move them "
            "into class sub-folders to train on them",
        )
    if skipped:
        kinds = sorted({f.suffix.lower() or f.name for f in skipped})
        note_once(
            logging.WARNING,
            f"image folder {root}: skipped {len(skipped)} files that are not PNG/JPEG "
            f"({', '.join(kinds[:5])}{', ...' if len(kinds) > 5 else ''}): "
            + _some([shown_name(str(f.relative_to(root))) for f in skipped]),
        )
    if not files:
        there = (
            f"; {len(loose)} images lie directly in it: move them into class sub-folders"
            if loose
            else ""
        )
        if loose and _sibling_folders(root):  # `data.path=shapes/circle`: one class's folder
            where = Path(os.path.abspath(root))  # `.` has no name, and its parent is `.`
            there += (
                f", or, if {where.name} is one class, set data.path to the folder of the "
                f"classes, {where.parent}"
            )
        raise DataError(
            f"image folder {root} has no images: expected {root}/<class>/*.png|jpg "
            f"(found classes: {classes}){there}"
        )
    y = np.array([label for _, label in files], dtype=np.int64)
    _check_classes("folder", str(root), y, classes, trained)  # before the slow part: decoding
    return files, y, classes


def _decode_folder(
    root: Path,
    files: list[tuple[Path, int]],
    classes: list[str],
    channels: int,
    size: int,
    rows: np.ndarray,
    digest: hashlib._Hash | None = None,
    unchanged: Callable[[], None] | None = None,
) -> np.ndarray:
    """The images of `files` at `rows` (sorted indices), decoded in that order. `digest` (a
    hashlib object) takes every image file's path, class and the sha256 of its bytes, those
    not decoded too: the fingerprint is of the whole data set. `unchanged` runs before files
    that cannot be read are refused: a run's recorded data damaged since is said to have
    changed, with the fix to put it back, not to remove the files (then refused as changed)."""
    x = np.empty((len(rows), channels, size, size), dtype=np.uint8)
    wanted = np.zeros(len(files), dtype=bool)
    wanted[rows] = True
    unreadable: list[images.ImageError] = []
    colour = 0
    i = 0
    first_of: dict[bytes, tuple[str, int]] = {}  # a file's sha256: where it was first read
    twins: list[str] = []  # the same bytes under another class
    with warnings.catch_warnings():
        # a small file can decode to gigapixels: past Pillow's warning size, refuse it at once
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        for (f, idx), decode in zip(files, wanted, strict=True):
            name = str(f.relative_to(root))
            data = f.read_bytes()
            if digest is not None:  # the name's bytes as on disk, UTF-8 or not
                sha = hashlib.sha256(data).digest()
                digest.update(os.fsencode(f"{name}\0{classes[idx]}\0"))
                digest.update(sha)
                first, first_class = first_of.setdefault(sha, (name, idx))
                if first_class != idx:
                    twins.append(f"{shown_name(name)} is {shown_name(first)}")
            if not decode:
                continue
            try:
                x[i], is_colour = images.decode(data, (channels, size, size), shown_name(name))
            except images.ImageError as exc:
                unreadable.append(exc)  # every bad file in one run, not one run per file
                continue
            finally:
                i += 1
            colour += is_colour
    if twins:
        # a class folder linked into another (cat/more -> ../dog, puppy -> dog) or copied:
        # one image under two labels, and in the training split under one, the test under
        # the other
        note_once(
            logging.WARNING,
            f"image folder {root}: {len(twins)} images are the same file as one of another "
            f"class ({_some(twins, 3, '; ')}): each is read under both labels; remove the "
            "copies, or the link that makes them",
        )
    if unreadable:
        if unchanged is not None:
            unchanged()
        if len(unreadable) > 3:  # the error names 3: every one, to remove them in one go
            for bad in unreadable:
                log.warning("cannot read %s", bad)
        named = " (each named above)" if len(unreadable) > 3 else ""
        raise DataError(
            f"image folder {root}: cannot read {len(unreadable)} of {len(rows)} images{named}: "
            + _some([str(e) for e in unreadable], 3, "; ")
            + ": remove or replace those files"
        )
    if channels == 1:
        _note_gray(colour)
    return x


def _folder(
    root: Path,
    channels: int,
    size: int,
    digest: hashlib._Hash | None = None,
    check_layout: bool = True,
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The whole folder: its images, their labels and the class names."""
    files, y, classes = _folder_files(root, check_layout)
    rows = np.arange(len(files))
    return _decode_folder(root, files, classes, channels, size, rows, digest), y, classes


def _npz(path: Path, trained: bool = False) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """An .npz file's images, labels and class names; `trained`: data a run has trained on
    (`_check_classes`)."""
    if path.is_dir():
        raise DataError(
            f"data.source=npz needs an .npz file, but {path} is a folder: set data.source=folder "
            "for an image folder of <class>/*.png|jpg"
        )
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
        raise DataError(
            f"{path}: x has dtype {x.dtype}; store images as uint8 pixels 0..255{_uint8_hint(x)}"
        )
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        x = x.transpose(0, 3, 1, 2)  # NHWC -> NCHW
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]  # a column of labels
    if x.ndim != 4 or y.ndim != 1 or len(x) != len(y) or len(x) == 0:
        raise DataError(
            f"{path}: need x [N,C,H,W] or [N,H,W,C] and y [N] (one class per image), "
            f"got {x.shape} and {y.shape}"
        )
    if x.shape[1] not in (1, 3, 4):
        # neither axis 1 nor the last is a channel count read: say what both would be
        held = (
            f"{x.shape[1]}-channel images as [N,C,H,W], or {x.shape[-1]}-channel ones as [N,H,W,C]"
            if x.shape[-1] != x.shape[1]
            else f"{x.shape[1]}-channel images"
        )
        raise DataError(
            f"{path}: x {x.shape} holds {held}; store gray (1), RGB (3) or RGBA (4) images as "
            "[N,C,H,W] or [N,H,W,C]"
        )
    if x.shape[1] == 4:
        x = x[:, :3]  # RGBA: the alpha goes, as the image folder's convert("RGB") drops it
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
    _check_classes("npz", str(path), y, labels, trained)
    return x, y, labels


def _uint8_hint(x: np.ndarray) -> str:
    """How to make uint8 pixels of `x`, judged by its values."""
    if x.dtype.kind not in "iuf" or x.size == 0:
        return ""
    if not np.isfinite(x).all():
        return " (x holds NaN or infinite values)"
    low, high = x.min(), x.max()
    if x.dtype.kind == "f" and 0 <= low <= high <= 1:
        return " (images in 0..1: x = np.round(x * 255).astype(np.uint8))"
    if 0 <= low <= high <= 255:
        return " (its values are within 0..255: x = np.round(x).astype(np.uint8))"
    return f" (its values run from {low:g} to {high:g}: scale them to 0..255)"


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


# Read since bb964de: a run trained before it skipped them, and its fingerprint counts none
LATER_SUFFIXES = (".jfif", ".jpe")


def older_reader_cause(then: str, now: str, source: str | None, path: str | None) -> str:
    """Where an image folder's (`source`, `path`: a data spec's) fingerprint counts more
    images `now` than `then` and the folder holds files of `LATER_SUFFIXES`, the other cause
    of the change, for its refusal; else ""."""
    was, now_n = then.partition(":")[0], now.partition(":")[0]
    folder = Path(path).expanduser() if source == "folder" and path else None
    later = (
        folder is not None
        and was.isdigit()
        and now_n.isdigit()
        and int(was) < int(now_n)
        and any(p.suffix.lower() in LATER_SUFFIXES for p in folder.rglob("*") if p.is_file())
    )
    return (
        " (or, if nothing changed, an older lightship trained the run and skipped its .jfif "
        "and .jpe files, which this one reads: move them out of the folder to use the run)"
        if later
        else ""
    )


def _check_unchanged(spec: DataSpec, now: str) -> None:
    """Data that changed since the run trained on it: the split is drawn anew over what is
    there now, so its test images would no longer be the ones the model never saw."""
    if spec.fingerprint is None or spec.fingerprint == now:
        return
    was, now_n = spec.fingerprint.partition(":")[0], now.partition(":")[0]
    counts = f"{was} images then, {now_n} now" if was != now_n else f"{now_n} images, not the same"
    where = f"{spec.source} data {spec.path}" if spec.path else f"the {spec.source} data"
    raise DataError(
        f"{where} changed since this run trained on it ({counts})"
        f"{older_reader_cause(spec.fingerprint, now, spec.source, spec.path)}: its test split "
        "would no longer be the images held out from training; put the data back as it was, "
        "or train a new run on it"
    )


def check_as_trained(
    entry: dict[str, Any],
    test_y: np.ndarray,
    accuracy: float,
    what: str,
    code: str | None = None,
) -> None:
    """DataError when the test split is not what training measured the model on: its size, or
    the model's accuracy (`what` measured it) off by more than an image or 1 %, against the
    run's checkpoint `entry`. It catches what the fingerprint cannot: a run trained by an
    older lightship (no fingerprint; image folders read otherwise: not recursively, without
    the EXIF turn), whose every figure measured now would be some other split's; and, where
    `what` ran the model's code as it is now (`code`: its module's file, for a user's
    model), a forward edited since training, which loads the same weights."""
    then_n, then_acc = entry.get("test_samples"), entry.get("test_acc")
    if not (isinstance(then_n, int) and isinstance(then_acc, float | int)):
        return  # an entry from before they were recorded
    if not (0 <= then_acc <= 1 and then_n >= 0):  # NaN too: not "the data changed"
        raise RunError(
            f"the manifest's checkpoint entry is malformed: it records test_acc {then_acc!r} "
            f"on {then_n} images, which training never writes: put manifest.json back as "
            "lightship wrote it"
        )
    n = len(test_y)
    if then_n == n and abs(accuracy - then_acc) * n <= max(1.0, 0.01 * n):
        return
    if code is not None and then_n == n:  # the same images: an edited forward is as likely
        raise DataError(
            f"{what} scores {accuracy:.4f} on the {n} test images, where training measured "
            f"{then_acc:.4f}: the model's code in {code} changed since training (the weights "
            "load, the forward is another one), or the data changed, or an older lightship "
            "trained the run and read it otherwise: put the code and the data back as they "
            "were, or train a new run with them"
        )
    raise DataError(
        f"the test split is not what this run trained on: {what} scores {accuracy:.4f} on "
        f"{n} test images, where training measured {then_acc:.4f} on {then_n}; the data "
        "changed, or an older lightship trained the run and read it otherwise, so no figure "
        "measured on it would be this model's: put the data back as it was, or train a new run "
        "on it"
    )


def _note_unseen_classes(
    labels: list[str], y: np.ndarray, train: np.ndarray, val: np.ndarray, test: np.ndarray
) -> None:
    """A warning for classes too small to have a validation or test image (a share of 2 images
    rounds to 0): test_acc, the checkpoint choice and the quantize gate never see them. And for
    those left no training image (2 images, with val and test fractions of 0.3 each): the model
    never learns them."""
    counts = np.bincount(y, minlength=len(labels))
    untrained = np.flatnonzero(np.bincount(train, minlength=len(labels)) == 0)
    if untrained.size:
        shown = [f"'{labels[i]}': {counts[i]} images" for i in untrained]
        note_once(
            logging.WARNING,
            f"{len(shown)} of {len(labels)} classes have no training image, all theirs went to "
            f"validation and test ({_some(shown, 5)}): the model never learns them; add images "
            "to them, or lower data.val_fraction and data.test_fraction",
        )
    seen = np.bincount(val, minlength=len(labels)).astype(bool) & np.bincount(
        test, minlength=len(labels)
    ).astype(bool)
    if unseen := [f"'{labels[i]}': {counts[i]} images" for i in np.flatnonzero(~seen)]:
        note_once(
            logging.WARNING,
            f"{len(unseen)} of {len(labels)} classes have too few images for both a validation "
            f"and a test image ({_some(unseen, 5)}): accuracy, the best checkpoint and the "
            "quantize gate are measured without them; add images to them",
        )


SPLITS = ("train", "val", "test")


def load_splits(
    spec: DataSpec,
    recorded: bool = False,
    check_layout: bool | None = None,
    only: Collection[str] = SPLITS,
    resumed: bool = False,
) -> Splits:
    """The splits of `spec`. `recorded`: the spec a run recorded when it trained, which the
    later stages (export, quantize, report) read and take no --set to change: data no longer at
    its path is to be put back there. `check_layout`: refuse an image folder already split
    into train/ and test/ (by default, where not `recorded`; a resumed training passes False).
    `resumed`: the data of a run that trained on it, read to train on again (`--resume`): one
    of its classes emptied since is to be put back, as for `recorded`. `only`: the splits
    wanted; the others are empty (export and report read the test split
    alone, and an image folder's other 85 % were decoded for nothing, each stage again).
    A spec with a fingerprint refuses data that changed: Splits.fingerprint is 'N:sha256' of
    the data as it is on disk, N its images (each image file's path, class and bytes; the .npz
    file; the built-in digits' arrays), not the pixels a Pillow version decodes from them."""
    if unknown := set(only) - set(SPLITS):
        raise ValueError(f"unknown splits {sorted(unknown)}: choose from {SPLITS}")
    digest = hashlib.sha256()
    folder_files = None
    if spec.source == "digits":
        x, y, labels = _digits()
        digest.update(np.ascontiguousarray(x).data)
        digest.update(y.astype("<i8").tobytes())
    elif spec.source in ("folder", "npz"):
        if not spec.path:
            raise DataError(f"data.source={spec.source} needs data.path (--set data.path=...)")
        path = Path(spec.path).expanduser()
        folder = spec.source == "folder"
        if recorded and not (path.is_dir() if folder else path.is_file()):
            raise DataError(
                f"{'image folder' if folder else 'npz file'} {path}, which this run was trained "
                "on, does not exist: put the data back at that path (a symlink to its new place "
                "will do) and run again"
            )
        if folder:
            layout = not recorded if check_layout is None else check_layout
            folder_files, y, labels = _folder_files(path, layout, recorded or resumed)
        else:
            x, y, labels = _npz(path, recorded or resumed)
            with path.open("rb") as fh:
                digest.update(hashlib.file_digest(fh, "sha256").digest())
            if spec.channels == 1 and x.shape[1] == 3:
                _note_gray(len(x))
    else:
        raise DataError(f"unknown data.source '{spec.source}': use digits, folder or npz")
    parts = stratified_split(y, spec.val_fraction, spec.test_fraction, spec.split_seed)
    train, val, test = parts
    # An image folder's files are hashed as they are read, below; but one whose split is empty
    # is not read: for a run's recorded data, that is data changed since (training refuses an
    # empty split), said as such by its count
    if folder_files is None or min(map(len, parts)) == 0:
        _check_unchanged(spec, f"{len(y)}:{digest.hexdigest()}")
    if min(len(train), len(val), len(test)) == 0:
        raise DataError(
            f"{spec.source} data with {len(y)} images leaves an empty split (train {len(train)}, "
            f"val {len(val)}, test {len(test)}): add images or change data.val_fraction / "
            "data.test_fraction"
        )
    _note_unseen_classes(labels, y, y[train], y[val], y[test])
    log.debug("data %s: train %d, val %d, test %d", spec.source, len(train), len(val), len(test))
    wanted = [idx if name in only else idx[:0] for name, idx in zip(SPLITS, parts, strict=True)]
    rows = np.concatenate(wanted)
    sorted_rows = np.sort(rows)  # x holds the rows wanted only, in file order
    if folder_files is not None:  # decoded so

        def unchanged() -> None:  # once the whole folder is hashed, unreadable files or not
            _check_unchanged(spec, f"{len(y)}:{digest.hexdigest()}")

        x = _decode_folder(
            Path(str(spec.path)).expanduser(),
            folder_files,
            labels,
            spec.channels,
            spec.image_size,
            sorted_rows,
            digest,
            unchanged,
        )
        unchanged()
    else:
        x = resize_uint8(x, spec.image_size, spec.channels)
        if len(rows) < len(x):
            x = x[sorted_rows]  # a copy: not a view keeping them all
    # the rows in split order: where each row wanted lies in x (every row: its own)
    order = rows if len(rows) == len(y) else np.searchsorted(sorted_rows, rows)
    # The images in split order, in place, and each split a view of its block: x[train],
    # x[val] and x[test] copied them all while x was held, 2.2 times the data set's memory
    _reorder_rows(x, order)
    cut = np.cumsum([len(wanted[0]), len(wanted[1])])
    train_x, val_x, test_x = np.split(x, cut)
    train_y, val_y, test_y = (y[idx] for idx in wanted)
    now = f"{len(y)}:{digest.hexdigest()}"
    return Splits(train_x, train_y, val_x, val_y, test_x, test_y, labels, now)


def _reorder_rows(x: np.ndarray, order: np.ndarray) -> None:
    """x[:] = x[order] without a copy of x: each cycle of the permutation moved along, one
    row held aside."""
    placed = np.zeros(len(order), dtype=bool)
    for start in range(len(order)):
        if placed[start]:
            continue
        held, i = x[start].copy(), start
        while True:
            placed[i] = True
            j = int(order[i])
            if j == start:
                x[i] = held
                break
            x[i] = x[j]
            i = j
