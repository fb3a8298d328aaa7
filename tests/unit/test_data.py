from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lightship.data import DataSpec, load_splits
from lightship.data.sources import resize_uint8, stratified_split
from lightship.errors import DataError


def test_digits_are_uint8_nchw_and_split_stratified() -> None:
    s = load_splits(DataSpec())
    assert s.train_x.dtype == np.uint8 and s.train_x.shape[1:] == (1, 28, 28)
    assert len(s.train_x) + len(s.val_x) + len(s.test_x) == 1797
    assert s.labels == [str(i) for i in range(10)]
    assert s.train_x.max() == 255  # scaled from 0..16
    # every class in every split, in about the same share
    for y in (s.train_y, s.val_y, s.test_y):
        counts = np.bincount(y, minlength=10) / len(y)
        assert counts.min() > 0.08 and counts.max() < 0.12


def test_split_is_fixed_by_seed_and_disjoint() -> None:
    y = np.repeat(np.arange(5), 40)
    a = stratified_split(y, 0.2, 0.2, seed=3)
    b = stratified_split(y, 0.2, 0.2, seed=3)
    c = stratified_split(y, 0.2, 0.2, seed=4)
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    assert not np.array_equal(a[2], c[2])
    everything = np.concatenate(a)
    assert len(np.unique(everything)) == len(y) == len(everything)
    assert len(a[2]) == 40 and len(a[1]) == 40


def test_resnet_shape_digits() -> None:
    s = load_splits(DataSpec(image_size=32, channels=3))
    assert s.test_x.shape[1:] == (3, 32, 32)
    assert np.array_equal(s.test_x[:, 0], s.test_x[:, 2])  # gray repeated to RGB


def test_resize_rgb_to_gray() -> None:
    x = np.zeros((1, 3, 2, 2), dtype=np.uint8)
    x[0, 0] = 100
    out = resize_uint8(x, 2, 1)
    assert out.shape == (1, 1, 2, 2) and out[0, 0, 0, 0] == 30  # 0.299 * 100


def make_folder(root: Path, per_class: int = 6) -> None:
    rng = np.random.default_rng(0)
    for cls, value in (("cat", 30), ("dog", 220)):
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            arr = np.clip(rng.normal(value, 5, (12, 10, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(arr).save(root / cls / f"{i}.{'png' if i % 2 else 'jpg'}")


def test_image_folder(tmp_path: Path) -> None:
    make_folder(tmp_path / "imgs")
    (tmp_path / "imgs" / "cat" / "notes.txt").write_text("not an image")
    s = load_splits(
        DataSpec(
            source="folder",
            path=str(tmp_path / "imgs"),
            image_size=8,
            channels=3,
            val_fraction=0.2,
            test_fraction=0.2,
        )
    )
    assert s.labels == ["cat", "dog"]
    assert s.train_x.shape[1:] == (3, 8, 8)
    assert len(s.train_x) + len(s.val_x) + len(s.test_x) == 12
    # class content survives loading and resizing
    all_x = np.concatenate([s.train_x, s.val_x, s.test_x])
    all_y = np.concatenate([s.train_y, s.val_y, s.test_y])
    assert all_x[all_y == 0].mean() < 60 and all_x[all_y == 1].mean() > 190


def test_missing_and_empty_folder_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"{tmp_path / 'absent'} does not exist"):
        load_splits(DataSpec(source="folder", path=str(tmp_path / "absent")))
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    with pytest.raises(DataError, match=f"{tmp_path / 'empty'} has no images"):
        load_splits(DataSpec(source="folder", path=str(tmp_path / "empty")))


def test_corrupt_image_names_the_file(tmp_path: Path) -> None:
    make_folder(tmp_path / "imgs")
    bad = tmp_path / "imgs" / "dog" / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match="broken.png"):
        load_splits(DataSpec(source="folder", path=str(tmp_path / "imgs"), image_size=8))


def test_npz_nhwc_with_labels(tmp_path: Path) -> None:
    x = np.zeros((20, 6, 6, 3), dtype=np.uint8)
    x[10:] = 200
    y = np.repeat([0, 1], 10)
    np.savez(tmp_path / "d.npz", x=x, y=y, labels=np.array(["off", "on"]))
    s = load_splits(
        DataSpec(
            source="npz",
            path=str(tmp_path / "d.npz"),
            image_size=6,
            channels=3,
            val_fraction=0.2,
            test_fraction=0.2,
        )
    )
    assert s.labels == ["off", "on"] and s.test_x.shape[1:] == (3, 6, 6)
    assert (s.test_x[s.test_y == 1] == 200).all()


def test_npz_bad_dtype(tmp_path: Path) -> None:
    np.savez(tmp_path / "f.npz", x=np.zeros((4, 1, 4, 4), dtype=np.float32), y=np.zeros(4))
    with pytest.raises(DataError, match="uint8"):
        load_splits(DataSpec(source="npz", path=str(tmp_path / "f.npz")))
