from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lightship.config import DataConfig
from lightship.data import DataSpec, Splits, load_splits, sources
from lightship.data.module import ImageDataModule, spec_from_config
from lightship.data.sources import _folder, resize_uint8, stratified_split
from lightship.errors import DataError
from lightship.serve import v1


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test a fresh process as far as the once-a-process notes about the data go."""
    monkeypatch.setattr(sources, "_noted", set())


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


def test_digits_are_sklearns_read_without_importing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from sklearn's own CSV, the same arrays as `load_digits` gives, without importing
    `sklearn.datasets` (SciPy and most of sklearn: 2.2 s of every command that loads the data
    on a 2-core EPYC); sklearn's way where its CSV is not there."""
    import sys

    from tests.conftest import ROOT

    code = "from lightship.data import sources; import sys; sources._digits(); " + (
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out.strip() == "[]"
    from sklearn.datasets import load_digits

    bunch = load_digits()
    expected = np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None]
    with monkeypatch.context() as patched:  # its CSV elsewhere: sklearn's way
        patched.setattr(sources, "_digits_csv", lambda: None)
        fallback = sources._digits()
    for x, y, labels in (sources._digits(), fallback):
        assert x.dtype == np.uint8 and np.array_equal(x, expected)
        assert y.dtype == np.int64 and np.array_equal(y, bunch.target)
        assert labels == [str(t) for t in bunch.target_names]


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


@pytest.mark.parametrize("source", ["folder", "digits"])
def test_the_test_split_alone_is_the_whole_loads_and_decodes_only_its_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """Export and report read the test split alone: an image folder's other images were
    decoded for nothing, at each stage. Its fingerprint still covers every file."""
    make_folder(tmp_path / "imgs", per_class=10)
    path = str(tmp_path / "imgs") if source == "folder" else None
    spec = DataSpec(source=source, path=path, image_size=8, channels=3, test_fraction=0.2)
    whole = load_splits(spec)
    decoded: list[str] = []
    real_decode = sources.images.decode

    def counted(data: bytes, chw: tuple[int, int, int], name: str, *a: object) -> object:
        decoded.append(name)
        return real_decode(data, chw, name, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(sources.images, "decode", counted)
    alone = load_splits(spec, only=("test",))
    np.testing.assert_array_equal(alone.test_x, whole.test_x)
    np.testing.assert_array_equal(alone.test_y, whole.test_y)
    assert alone.fingerprint == whole.fingerprint and alone.labels == whole.labels
    for x, y in ((alone.train_x, alone.train_y), (alone.val_x, alone.val_y)):
        assert x.shape == (0, 3, 8, 8) and y.shape == (0,)
    if source == "folder":
        assert len(decoded) == len(whole.test_y) == 4  # of 20
        # a training image changed since: still refused, though not decoded
        recorded = DataSpec(**{**spec.to_dict(), "fingerprint": whole.fingerprint})
        load_splits(recorded, recorded=True, only=("test",))
        test_images = {tuple(x.ravel()) for x in whole.test_x}
        for f in sorted((tmp_path / "imgs" / "cat").glob("*.png")):
            pixels, _ = real_decode(f.read_bytes(), (3, 8, 8), f.name)
            if tuple(pixels.ravel()) not in test_images:  # one of the training split
                Image.new("RGB", (12, 10), (1, 2, 3)).save(f)
                break
        with pytest.raises(DataError, match="changed since this run trained on it"):
            load_splits(recorded, recorded=True, only=("test",))
    both = load_splits(spec, only=("val", "test"))
    np.testing.assert_array_equal(both.val_x, whole.val_x)
    np.testing.assert_array_equal(both.test_x, whole.test_x)
    assert len(both.train_x) == 0


def test_an_empty_class_folder_added_since_training_is_to_be_removed(tmp_path: Path) -> None:
    """Quantize said to add images to it, which the fingerprint then refused as changed data."""
    make_folder(tmp_path / "imgs")
    spec = DataSpec(source="folder", path=str(tmp_path / "imgs"), image_size=8)
    recorded = DataSpec(**{**spec.to_dict(), "fingerprint": load_splits(spec).fingerprint})
    (tmp_path / "imgs" / "emu").mkdir()
    said = (
        "1 of 3 classes have no images ('emu'): the run trained with none empty: put the data "
        "back as it was when the run trained (remove those added since; images added would "
        "change the data, and be refused)"
    )
    for trained in ({"recorded": True}, {"resumed": True}):  # later stages, and --resume
        with pytest.raises(DataError) as err:
            load_splits(recorded, **trained)  # type: ignore[arg-type]
        assert str(err.value).endswith(said)
    (tmp_path / "imgs" / "emu").rmdir()
    assert load_splits(recorded, recorded=True).labels == ["cat", "dog"]
    # its classes moved into a folder of their own: put back, not pointed at (later stages
    # take no --set data.path)
    (tmp_path / "imgs" / "set").mkdir()
    for cls in ("cat", "dog"):
        (tmp_path / "imgs" / cls).rename(tmp_path / "imgs" / "set" / cls)
    with pytest.raises(DataError) as err:
        load_splits(recorded, recorded=True, only=("test",))
    assert str(err.value).endswith(
        "has a single class ('set'): a classifier needs at least 2: the run trained on more; "
        "put the data back as it was when the run trained"
    )


def test_npz_data_a_run_trained_on_is_to_be_put_back_not_renumbered(tmp_path: Path) -> None:
    """Renumbering y, as the message said, was then refused as changed data."""
    x = np.zeros((9, 1, 4, 4), np.uint8)
    path = tmp_path / "d.npz"
    np.savez(path, x=x, y=np.array([0, 0, 0, 1, 1, 1, 1, 1, 1]), labels=np.array(["a", "b", "c"]))
    spec = DataSpec(source="npz", path=str(path), image_size=4)
    with pytest.raises(DataError, match=r"renumber y"):
        load_splits(spec)
    for trained in ({"recorded": True}, {"resumed": True}):
        with pytest.raises(DataError) as err:
            load_splits(spec, **trained)  # type: ignore[arg-type]
        assert str(err.value).endswith(
            "1 of 3 classes have no images ('c'): the run trained with none empty: put the data "
            "back as it was when the run trained (remove those added since; images added would "
            "change the data, and be refused)"
        )


def test_missing_and_empty_folder_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"{tmp_path / 'absent'} does not exist"):
        load_splits(DataSpec(source="folder", path=str(tmp_path / "absent")))
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    with pytest.raises(DataError, match=f"{tmp_path / 'empty'} has no images"):
        load_splits(DataSpec(source="folder", path=str(tmp_path / "empty")))


def test_recorded_data_that_moved_is_to_be_put_back(tmp_path: Path) -> None:
    # export, quantize and report read the run's recorded spec: they take no --set data.path
    make_folder(tmp_path / "moved")
    spec = DataSpec(source="folder", path=str(tmp_path / "imgs"), image_size=8)
    with pytest.raises(DataError) as err:
        load_splits(spec, recorded=True)
    assert str(err.value) == (
        f"image folder {tmp_path / 'imgs'}, which this run was trained on, does not exist: put "
        "the data back at that path (a symlink to its new place will do) and run again"
    )
    (tmp_path / "imgs").symlink_to(tmp_path / "moved")
    assert load_splits(spec, recorded=True).labels == ["cat", "dog"]
    with pytest.raises(DataError, match=r"npz file .*gone\.npz, which this run was trained on"):
        load_splits(DataSpec(source="npz", path=str(tmp_path / "gone.npz")), recorded=True)


def test_data_changed_since_training_is_refused(tmp_path: Path) -> None:
    # the split is drawn anew over what is there: images the model trained on would be tested
    root = tmp_path / "imgs"
    make_folder(root)
    trained = dataclasses.replace(
        spec := DataSpec(source="folder", path=str(root), image_size=8),
        fingerprint=load_splits(spec).fingerprint,
    )
    assert load_splits(trained, recorded=True).fingerprint == trained.fingerprint
    # the files' bytes, not the pixels they decode to at some size
    assert load_splits(dataclasses.replace(spec, image_size=6)).fingerprint == trained.fingerprint
    shutil.copy(root / "cat" / "1.png", root / "cat" / "copy.png")
    with pytest.raises(DataError) as err:
        load_splits(trained, recorded=True)
    assert str(err.value) == (
        f"folder data {root} changed since this run trained on it (12 images then, 13 now): its "
        "test split would no longer be the images held out from training; put the data back as "
        "it was, or "
        "train a new run on it"
    )
    (root / "cat" / "copy.png").unlink()
    # a .jfif an older lightship skipped (its fingerprint counts none): the likely cause, said
    Image.fromarray(np.zeros((12, 10, 3), np.uint8)).save(root / "cat" / "2.jfif", "JPEG")
    with pytest.raises(DataError) as err:
        load_splits(trained, recorded=True)
    assert "(12 images then, 13 now) (or, if nothing changed, an older lightship trained the " in (
        str(err.value)
    )
    assert "which this one reads: move them out of the folder to use the run)" in str(err.value)
    (root / "cat" / "2.jfif").unlink()
    Image.fromarray(np.zeros((12, 10, 3), np.uint8)).save(root / "cat" / "1.png")
    with pytest.raises(DataError, match=r"\(12 images, not the same\)"):
        load_splits(trained, recorded=True)
    # a file damaged since: changed data, to put back ("remove or replace those files" was
    # then refused as changed data), where data of no run is told to remove it
    (root / "cat" / "1.png").write_bytes(b"garbage")
    with pytest.raises(DataError, match=r"\(12 images, not the same\): .* put the data back"):
        load_splits(trained, recorded=True)
    with pytest.raises(DataError, match=r"cannot read 1 of 12 images: .*remove or replace those"):
        load_splits(spec)
    Image.fromarray(np.zeros((12, 10, 3), np.uint8)).save(root / "cat" / "1.png")
    # a run recorded before fingerprints were kept is not checked
    assert load_splits(spec, recorded=True).labels == ["cat", "dog"]


def test_the_data_module_records_what_it_read(tmp_path: Path) -> None:
    np.savez(
        tmp_path / "d.npz",
        x=np.arange(20 * 36, dtype=np.uint8).reshape(20, 1, 6, 6),
        y=np.repeat([0, 1], 10),
    )
    dm = ImageDataModule(DataConfig(source="npz", path=tmp_path / "d.npz", image_size=6))
    assert dm.spec.fingerprint is None
    splits = dm.splits
    assert dm.spec.fingerprint == splits.fingerprint == load_splits(dm.spec).fingerprint
    assert splits.fingerprint.startswith("20:")
    assert DataSpec.from_dict(dm.spec.to_dict()) == dm.spec  # as the manifest keeps it


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


def test_npz_rgba_nhwc_drops_the_alpha(tmp_path: Path) -> None:
    x = np.zeros((20, 20, 20, 4), dtype=np.uint8)  # NHWC, RGBA: H=20 is no channel count
    x[10:, ..., 0] = 200
    x[..., 3] = 255
    y = np.repeat([0, 1], 10)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    for channels, on in ((3, [200, 0, 0]), (1, [60])):  # 0.299 * 200: red's luma
        s = load_splits(DataSpec(source="npz", path=str(tmp_path / "d.npz"), channels=channels))
        assert s.test_x.shape[1:] == (channels, 28, 28)
        assert (s.test_x[s.test_y == 1] == np.array(on, np.uint8)[:, None, None]).all()


def test_a_data_path_from_home_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    np.savez(tmp_path / "d.npz", x=X20, y=np.repeat([0, 1], 10))
    spec = spec_from_config(DataConfig(source="npz", path=Path("~/d.npz")))
    assert spec.path == str(tmp_path / "d.npz")  # as recorded for export, quantize, report
    s = load_splits(DataSpec(source="npz", path="~/d.npz", val_fraction=0.2, test_fraction=0.2))
    assert s.labels == ["0", "1"]


def test_npz_bad_dtype(tmp_path: Path) -> None:
    np.savez(tmp_path / "f.npz", x=np.zeros((4, 1, 4, 4), dtype=np.float32), y=np.zeros(4))
    with pytest.raises(DataError, match="uint8"):
        load_splits(DataSpec(source="npz", path=str(tmp_path / "f.npz")))


def load_npz(path: Path, **arrays: np.ndarray) -> Splits:
    np.savez(path, allow_pickle=False, **arrays)
    spec = DataSpec(source="npz", path=str(path), image_size=6, val_fraction=0.2, test_fraction=0.2)
    return load_splits(spec)


# 20 images 1x6x6: 10 black, then 10 at 200
X20 = np.repeat(np.array([0, 200], dtype=np.uint8), 10 * 36).reshape(20, 1, 6, 6)


def test_npz_string_labels_are_sorted_class_names(tmp_path: Path) -> None:
    s = load_npz(tmp_path / "d.npz", x=X20, y=np.repeat(["on", "off"], 10))
    assert s.labels == ["off", "on"]
    assert (s.test_x[s.test_y == 0] == 200).all() and (s.test_x[s.test_y == 1] == 0).all()
    with pytest.raises(DataError, match=r"class names \['maybe'\] that are not in 'labels'"):
        load_npz(
            tmp_path / "e.npz",
            x=X20,
            y=np.repeat(["on", "maybe"], 10),
            labels=np.array(["off", "on"]),
        )


def test_npz_label_column_is_flattened_other_shapes_refused(tmp_path: Path) -> None:
    s = load_npz(tmp_path / "d.npz", x=X20, y=np.repeat([0, 1], 10)[:, None])
    assert s.labels == ["0", "1"] and s.test_y.shape == (len(s.test_x),)
    with pytest.raises(DataError, match=r"y \[N\] \(one class per image\), got .* and \(20, 2\)"):
        load_npz(tmp_path / "e.npz", x=X20, y=np.eye(2)[np.repeat([0, 1], 10)])


def test_npz_float_labels_whole_only(tmp_path: Path) -> None:
    s = load_npz(tmp_path / "d.npz", x=X20, y=np.repeat([0.0, 1.0], 10))
    assert s.labels == ["0", "1"] and (s.test_x[s.test_y == 1] == 200).all()
    with pytest.raises(DataError, match=r"non-integer labels such as \[1\.5, 1\.5, 1\.5\]"):
        load_npz(tmp_path / "e.npz", x=X20, y=np.repeat([0.0, 1.5], 10))


def test_single_class_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"single class \('0'\): a classifier needs at least 2"):
        load_npz(tmp_path / "d.npz", x=X20, y=np.zeros(20, dtype=np.int64))
    make_folder(tmp_path / "imgs")
    shutil.rmtree(tmp_path / "imgs" / "dog")
    with pytest.raises(DataError, match=r"single class \('cat'\).*own sub-folder"):
        load_splits(DataSpec(source="folder", path=str(tmp_path / "imgs"), image_size=8))


def test_classes_without_images_are_refused(tmp_path: Path) -> None:
    # y in {1, 2}: class '0' would be an output the model never sees an image of
    with pytest.raises(DataError) as err:
        load_npz(tmp_path / "d.npz", x=X20, y=np.repeat([1, 2], 10))
    assert str(err.value) == (
        f"npz data {tmp_path / 'd.npz'}: 1 of 3 classes have no images ('0'): renumber y, "
        "e.g. y = np.unique(y, return_inverse=True)[1], or drop those names from 'labels'"
    )
    with pytest.raises(DataError, match=r"999999 of 1000001 classes have no images \('1', "):
        load_npz(tmp_path / "e.npz", x=X20, y=np.repeat([0, 1_000_000], 10))
    make_folder(tmp_path / "imgs")
    (tmp_path / "imgs" / "emu").mkdir()
    with pytest.raises(DataError, match=r"1 of 3 classes have no images \('emu'\): add images"):
        load_splits(DataSpec(source="folder", path=str(tmp_path / "imgs"), image_size=8))
    # with two classes, one empty: name the empty one, not "a single class ('cat')"
    shutil.rmtree(tmp_path / "imgs" / "dog")
    with pytest.raises(DataError) as err:
        load_splits(DataSpec(source="folder", path=str(tmp_path / "imgs"), image_size=8))
    assert str(err.value) == (
        f"folder data {tmp_path / 'imgs'}: 1 of 2 classes have no images ('emu'): add images to "
        "those sub-folders or remove them"
    )


def test_integer_pixels_that_fit_are_taken(tmp_path: Path) -> None:
    s = load_npz(tmp_path / "d.npz", x=X20.astype(np.int64), y=np.repeat([0, 1], 10))
    assert s.test_x.dtype == np.uint8 and set(np.unique(s.test_x)) == {0, 200}


def test_folder_names_the_files_it_skips_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_folder(tmp_path / "imgs")
    Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / "cat" / "x.webp")
    (tmp_path / "imgs" / "dog" / "notes.txt").write_text("")
    (tmp_path / "imgs" / "dog" / ".DS_Store").write_text("")
    spec = DataSpec(source="folder", path=str(tmp_path / "imgs"), image_size=8)
    with caplog.at_level("WARNING", logger="lightship.data.sources"):
        load_splits(spec)
        load_splits(spec)  # as quantize does (PTQ, then QAT): said once a process
    assert caplog.messages == [
        f"image folder {tmp_path / 'imgs'}: skipped 2 files that are not PNG/JPEG (.txt, .webp): "
        "cat/x.webp, dog/notes.txt"
    ]
    caplog.clear()
    for i in range(6):
        (tmp_path / "imgs" / "dog" / f"{i}.gif").write_text("")
    with caplog.at_level("WARNING", logger="lightship.data.sources"):
        load_splits(spec)
    assert caplog.messages == [
        f"image folder {tmp_path / 'imgs'}: skipped 8 files that are not PNG/JPEG (.gif, .txt, "
        ".webp): cat/x.webp, dog/0.gif, dog/1.gif, dog/2.gif, dog/3.gif and 3 more"
    ]


def test_images_in_sub_folders_belong_to_the_class(tmp_path: Path) -> None:
    # root/<class>/2024/*.png: read, as torchvision's ImageFolder reads them (os.walk)
    make_folder(tmp_path / "imgs", per_class=2)
    for cls in ("cat", "dog"):
        make_folder(tmp_path / "more", per_class=8)
        (tmp_path / "more" / cls).rename(tmp_path / "imgs" / cls / "2024")
        shutil.rmtree(tmp_path / "more")
    hidden = tmp_path / "imgs" / "cat" / ".thumbs"
    hidden.mkdir()
    Image.new("RGB", (8, 8)).save(hidden / "t.png")
    (tmp_path / "imgs" / "dog" / "2024" / "loop").symlink_to(tmp_path / "imgs" / "dog")
    (tmp_path / "imgs" / "dog" / "elsewhere").symlink_to(tmp_path / "imgs" / "cat" / "2024")
    x, y, labels = _folder(tmp_path / "imgs", 3, 8)
    # cat: 2 + 8 (the hidden folder left out); dog: 2 + 8 + the 8 cats linked into it
    assert labels == ["cat", "dog"] and np.bincount(y).tolist() == [10, 18]
    assert x[y == 0].mean() < 60 and x[y == 1][:10].mean() > 190


def test_links_to_nothing_are_refused_not_dropped(tmp_path: Path) -> None:
    # a class folder on a disk not mounted: trained without that class, and without a word
    make_folder(tmp_path / "imgs", per_class=2)
    root = tmp_path / "imgs"
    (root / "fish").symlink_to(tmp_path / "not_mounted" / "fish")
    with pytest.raises(DataError) as err:
        _folder(root, 3, 8)
    assert str(err.value) == (
        f"image folder {root}: a link points to nothing (fish -> {tmp_path}/not_mounted/fish): "
        "mount or restore what they point to, or remove the links"
    )
    (root / "fish").unlink()
    (root / "cat" / "2024").mkdir()
    (root / "cat" / "2024" / "x.png").symlink_to(tmp_path / "gone.png")  # an image, below
    with pytest.raises(DataError, match=r"a link points to nothing \(cat/2024/x\.png -> "):
        _folder(root, 3, 8)


def test_names_that_are_not_utf8_train_or_say_which_class_to_rename(tmp_path: Path) -> None:
    # what unzip leaves of an archive made on Windows: Latin-1 bytes in a name
    make_folder(tmp_path / "imgs", per_class=3)
    root = tmp_path / "imgs"
    os.rename(root / "cat" / "0.jpg", os.fsdecode(bytes(root / "cat") + b"/caf\xe9.jpg"))
    spec = DataSpec(
        source="folder", path=str(root), image_size=8, val_fraction=0.34, test_fraction=0.34
    )
    splits = load_splits(spec)  # it used to raise UnicodeEncodeError, from the fingerprint
    every = np.concatenate([splits.train_y, splits.val_y, splits.test_y])
    assert np.bincount(every).tolist() == [3, 3]  # café.jpg too
    # the fingerprint reads back: later stages check it
    again = load_splits(dataclasses.replace(spec, fingerprint=splits.fingerprint))
    assert again.fingerprint == splits.fingerprint
    os.rename(root / "dog", os.fsdecode(bytes(root) + b"/d\xf6g"))
    with pytest.raises(DataError) as err:
        load_splits(spec)
    assert str(err.value) == (
        f"image folder {root}: class folder names must be UTF-8 text, and d\\xf6g is not: "
        f"rename it (`convmv -f latin1 -t utf8 -r --notest {root}` converts names from Latin-1)"
    )
    str(err.value).encode()  # printable: no lone surrogates


def test_jpegs_named_jfif_or_jpe_are_images(tmp_path: Path) -> None:
    make_folder(tmp_path / "imgs", per_class=2)
    for i, suffix in enumerate((".jfif", ".JPE")):
        Image.new("RGB", (8, 8), (30, 30, 30)).save(
            tmp_path / "imgs" / "cat" / f"w{i}{suffix}", "JPEG"
        )
    _, y, _ = _folder(tmp_path / "imgs", 3, 8)
    assert np.bincount(y).tolist() == [4, 2]


@pytest.mark.parametrize(
    ("splits", "train"),
    [
        (("train", "val"), "train"),
        (("training_set", "test_set"), "training_set"),  # Kaggle's layout
        (("Val2017", "train2017"), "train2017"),
        (("seg_train", "seg_test"), "seg_train"),  # Kaggle's Intel Image Classification
        (("images_train", "images_val"), "images_train"),
        (("train.v1", "test.v1"), "train.v1"),
        (("train", "eval"), "train"),
        (("TrainingSet", "TestSet"), "TrainingSet"),
        (("trainset", "testset"), "trainset"),
    ],
)
def test_a_folder_already_split_into_train_and_val_is_refused(
    tmp_path: Path, splits: tuple[str, str], train: str
) -> None:
    """root/{train,val}/<class>/: read as it is, a train-versus-val classifier, which trained
    and exited 0 past a warning (and Kaggle's training_set/test_set with none)."""
    for split in splits:
        make_folder(tmp_path / "imgs" / split, per_class=4)
    with pytest.raises(DataError) as err:
        _folder(tmp_path / "imgs", 3, 8)
    shown = ", ".join(sorted(splits))
    (other,) = (s for s in sorted(splits) if s != train)
    assert str(err.value) == (
        f"image folder {tmp_path / 'imgs'}: its classes would be {shown}, which are the splits "
        f"of a data set ({train}/ holds cat, dog): lightship splits the data itself "
        f"(data.val_fraction, data.test_fraction), so move the images of {other}/ into the "
        f"class folders of {train}/ to use them too, and point data.path at its folder of class "
        f"folders: --set data.path={tmp_path / 'imgs' / train}"
    )
    # a run trained on it before the refusal: its later stages read it as they did
    assert _folder(tmp_path / "imgs", 3, 8, check_layout=False)[2] == sorted(splits)


def test_a_refused_split_layout_names_the_folder_of_class_folders_to_give(
    tmp_path: Path,
) -> None:
    """Kaggle's cats and dogs: training_set/training_set/{cats,dogs}. Named training_set/,
    one class (training_set) was all the pasted fix gave; and a path with a space, unquoted."""
    root = tmp_path / "my data"
    for split in ("training_set", "test_set"):
        make_folder(root / split / split, per_class=3)
    with pytest.raises(DataError) as err:
        _folder(root, 3, 8)
    fixed = root / "training_set" / "training_set"
    assert str(err.value).endswith(
        f"(training_set/ holds training_set): lightship splits the data itself "
        f"(data.val_fraction, data.test_fraction), so move the images of test_set/ into the "
        "class folders of training_set/training_set/ to use them too, and point data.path at its "
        f"folder of class folders: --set 'data.path={fixed}'"
    )
    assert _folder(fixed, 3, 8)[2] == ["cat", "dog"]  # as pasted
    # Intel's Image Classification: seg_train/seg_train/<class>, seg_test/..., and the
    # unlabelled images to predict in seg_pred/seg_pred/
    intel = tmp_path / "intel"
    for split in ("seg_train", "seg_test"):
        make_folder(intel / split / split, per_class=2)
    (intel / "seg_pred" / "seg_pred").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(intel / "seg_pred" / "seg_pred" / "0.jpg")
    with pytest.raises(DataError, match="data.path=.*seg_train/seg_train$") as err:
        _folder(intel, 3, 8)
    # its labelled split is to be moved in; the unlabelled images to predict cannot be
    assert "move the images of seg_test/ into the class folders of seg_train/seg_train/" in str(
        err.value
    )


def test_a_split_folder_beside_one_of_loose_images_is_refused(tmp_path: Path) -> None:
    """root/train/<class>/ beside root/test/*.png (unlabelled): no warning, and a
    train-versus-test classifier."""
    make_folder(tmp_path / "imgs" / "train", per_class=4)
    (tmp_path / "imgs" / "test").mkdir()
    for i in range(3):
        Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / "test" / f"{i}.png")
    with pytest.raises(DataError, match=r"\(train/ holds cat, dog\)"):
        _folder(tmp_path / "imgs", 3, 8)


def test_kaggles_flat_layout_with_classes_in_file_names_is_refused_with_the_moves(
    tmp_path: Path,
) -> None:
    """Kaggle's dogs-vs-cats: train/cat.1.jpg, train/dog.1.jpg, test1/1.jpg. Read as classes
    train and test1, it trained a train-versus-test classifier and exited 0."""
    root = tmp_path / "dogs-vs-cats"
    for folder, names in (("train", ["cat.0", "cat.1", "dog.0", "dog.1"]), ("test1", ["0", "1"])):
        (root / folder).mkdir(parents=True)
        for name in names:
            Image.new("RGB", (8, 8)).save(root / folder / f"{name}.jpg")
    with pytest.raises(DataError) as err:
        _folder(root, 3, 8)
    assert str(err.value) == (
        f"image folder {root}: its classes would be test1, train, which are the splits of a "
        "data set, and train/ names its images by class (cat, dog: e.g. cat.1.jpg): lightship "
        "reads an image's class from its folder and splits the data itself, so move each "
        f"class's images into a folder of its own (mkdir -p DEST/cat && mv {root}/train/cat.* "
        f"DEST/cat/ && mkdir -p DEST/dog && mv {root}/train/dog.* DEST/dog/) and set "
        "data.path=DEST; leave out the unlabelled ones"
    )
    # the moves it gives, run by a shell as printed (DEST in the current folder), make a
    # folder that trains; so for capitalised words and a path with a space
    for path, word in ((root, "cat"), (tmp_path / "my data", "Golden_retriever")):
        if word != "cat":
            for folder, name in (("train", f"{word}.1"), ("train", "Pug.1"), ("test1", "1")):
                (path / folder).mkdir(parents=True, exist_ok=True)
                Image.new("RGB", (8, 8)).save(path / folder / f"{name}.jpg")
        with pytest.raises(DataError) as err:
            _folder(path, 3, 8)
        moves = re.search(
            r"own \((.*?)(?:, and so on.*?)?\) and set data.path=DEST", str(err.value)
        )
        assert moves is not None, str(err.value)
        work = tmp_path / f"work-{word}"
        work.mkdir()
        subprocess.run(["bash", "-c", moves[1]], cwd=work, check=True)
        classes = sorted(p.name for p in (work / "DEST").iterdir())
        assert _folder(work / "DEST", 3, 8)[2] == classes and len(classes) == 2
    # classes named as splits whose files are one word's, or a camera's, stay classes
    for cls in ("train", "test"):
        (tmp_path / "one" / cls).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (8, 8)).save(tmp_path / "one" / cls / f"img_{i}.png")
        Image.new("RGB", (8, 8)).save(tmp_path / "one" / cls / "IMG_0001.jpg")
        Image.new("RGB", (8, 8)).save(tmp_path / "one" / cls / "DSC_0001.JPG")
    assert _folder(tmp_path / "one", 3, 8)[2] == ["test", "train"]


def test_a_data_set_in_a_wrapper_folder_is_told_the_folder_of_its_classes(tmp_path: Path) -> None:
    """Kaggle's training_set/training_set/{cats,dogs} and Food-101's images/<class> beside
    meta/: told to put each class in its own sub-folder (they were), or to add images to meta/
    or remove it (then the first)."""
    for wrapper in ("wrap/training_set", "food/images"):
        for cls in ("cats", "dogs"):
            (tmp_path / wrapper / cls).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(tmp_path / wrapper / cls / "0.png")
    (tmp_path / "food" / "meta").mkdir()
    (tmp_path / "food" / "meta" / "classes.txt").write_text("cats\ndogs\n")

    def refusal(root: Path) -> str:
        with pytest.raises(DataError) as err:
            _folder(root, 3, 8)
        return str(err.value)

    assert refusal(tmp_path / "wrap").endswith(
        "has a single class ('training_set'): a classifier needs at least 2: the classes are the "
        f"folders in {tmp_path / 'wrap' / 'training_set'} (cats, dogs): point data.path at it, "
        f"--set data.path={tmp_path / 'wrap' / 'training_set'}"
    )
    assert refusal(tmp_path / "food").endswith(
        "1 of 2 classes have no images ('meta'): add images to those sub-folders or remove them; "
        f"or, if the classes are the folders in {tmp_path / 'food' / 'images'} (cats, dogs): "
        f"point data.path at it, --set data.path={tmp_path / 'food' / 'images'}"
    )
    assert _folder(tmp_path / "food" / "images", 3, 8)[2] == ["cats", "dogs"]
    # one class holding images directly: no folder of classes to point at
    (tmp_path / "one" / "cats").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "one" / "cats" / "0.png")
    with pytest.raises(DataError, match=r"at least 2: put each class in its own sub-folder$"):
        _folder(tmp_path / "one", 3, 8)


def test_classes_named_as_splits_without_folders_of_their_own_are_classes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing in them but images, and a class named like a split among others: classes."""
    for cls in ("train", "test"):
        (tmp_path / "a" / cls).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "a" / cls / "0.png")
    for cls in ("train", "test"):  # Jupyter's checkpoints of a notebook opened in one
        (tmp_path / "e" / cls).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "e" / cls / "0.png")
    (tmp_path / "e" / "train" / ".ipynb_checkpoints").mkdir()
    for cls in ("bus", "train"):  # a vehicle's name, beside another holding folders
        (tmp_path / "b" / cls / "2024").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "b" / cls / "2024" / "0.png")
    # split words in class names, one kind of split in each data set
    for root, cls in [("c", "valid"), ("c", "not_valid"), ("d", "test_pass"), ("d", "test_fail")]:
        (tmp_path / root / cls / "batch1").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / root / cls / "batch1" / "0.png")
    with caplog.at_level("WARNING", logger="lightship.data.sources"):
        assert _folder(tmp_path / "a", 3, 8)[2] == ["test", "train"]
        assert _folder(tmp_path / "b", 3, 8)[2] == ["bus", "train"]
        assert _folder(tmp_path / "c", 3, 8)[2] == ["not_valid", "valid"]
        assert _folder(tmp_path / "d", 3, 8)[2] == ["test_fail", "test_pass"]
        assert _folder(tmp_path / "e", 3, 8)[2] == ["test", "train"]
    assert caplog.messages == []


def test_the_same_file_under_two_classes_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """cat/more -> ../dog and puppy -> dog read each dog image under three labels, silently:
    one image both trained on and tested on, under two answers."""
    make_folder(tmp_path / "imgs", per_class=3)
    (tmp_path / "imgs" / "cat" / "more").symlink_to("../dog")
    with caplog.at_level("WARNING", logger="lightship.data.sources"):
        load_splits(DataSpec(source="folder", path=str(tmp_path / "imgs"), image_size=8))
    (said,) = [m for m in caplog.messages if "same file" in m]
    assert said.startswith(
        f"image folder {tmp_path / 'imgs'}: 3 images are the same file as one of another class "
        "(dog/0.jpg is cat/more/0.jpg; "
    )
    assert said.endswith("remove the copies, or the link that makes them")
    caplog.clear()
    (tmp_path / "imgs" / "cat" / "more").unlink()
    sources._noted.clear()
    shutil.copy(tmp_path / "imgs" / "cat" / "0.jpg", tmp_path / "imgs" / "cat" / "again.jpg")
    with caplog.at_level("WARNING", logger="lightship.data.sources"):  # in one class: no twins
        load_splits(DataSpec(source="folder", path=str(tmp_path / "imgs"), image_size=8))
    assert not [m for m in caplog.messages if "same file" in m]


def test_a_link_to_the_data_root_in_a_class_folder_reads_nothing_twice(tmp_path: Path) -> None:
    """cat/all -> .. read every dog image again as a cat."""
    make_folder(tmp_path / "imgs", per_class=3)
    (tmp_path / "imgs" / "cat" / "all").symlink_to("..")
    (tmp_path / "imgs" / "cat" / "up").symlink_to(tmp_path)
    _, y, labels = _folder(tmp_path / "imgs", 3, 8)
    assert labels == ["cat", "dog"] and np.bincount(y).tolist() == [3, 3]
    # a class folder that is itself a link, holding a link back to the data root
    shutil.move(tmp_path / "imgs" / "cat", tmp_path / "cats")
    (tmp_path / "imgs" / "cat").symlink_to(tmp_path / "cats")
    (tmp_path / "cats" / "all").unlink()
    (tmp_path / "cats" / "all").symlink_to(tmp_path / "imgs")
    _, y, labels = _folder(tmp_path / "imgs", 3, 8)
    assert labels == ["cat", "dog"] and np.bincount(y).tolist() == [3, 3]


@pytest.mark.parametrize(
    ("fractions", "unseen_by", "message"),
    [
        (  # 2 images of a class: 15 % of them rounds to none, and test_acc never sees it
            (0.15, 0.15),
            "test_y",
            "1 of 3 classes have too few images for both a validation and a test image ('rare': "
            "2 images): accuracy, the best checkpoint and the quantize gate are measured without "
            "them; add images to them",
        ),
        (  # val and test fractions of 0.3: one each, none to train on, and no word
            (0.3, 0.3),
            "train_y",
            "1 of 3 classes have no training image, all theirs went to validation and test "
            "('rare': 2 images): the model never learns them; add images to them, or lower "
            "data.val_fraction and data.test_fraction",
        ),
    ],
    ids=["no test image", "no training image"],
)
def test_classes_too_small_for_a_split_are_warned_of(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    fractions: tuple[float, float],
    unseen_by: str,
    message: str,
) -> None:
    make_folder(tmp_path / "imgs", per_class=20)
    (tmp_path / "imgs" / "rare").mkdir()
    for i in range(2):
        Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / "rare" / f"{i}.png")
    val, test = fractions
    spec = DataSpec(
        source="folder",
        path=str(tmp_path / "imgs"),
        image_size=8,
        val_fraction=val,
        test_fraction=test,
    )
    with caplog.at_level("WARNING", logger="lightship.data.sources"):
        splits = load_splits(spec)
    assert 2 not in getattr(splits, unseen_by)
    assert caplog.messages == [message]


def test_train_and_serve_read_a_file_as_the_same_pixels(tmp_path: Path) -> None:
    """The folder loader and the server's upload decode each file the same way: 16-bit PNGs
    scaled (not clipped to 255), EXIF orientation applied, the same JPEG draft shrink."""
    rng = np.random.default_rng(0)
    root = tmp_path / "imgs"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    noise = rng.integers(0, 256, (24, 20, 4), dtype=np.uint8)
    Image.fromarray(noise[..., 0]).save(root / "a" / "gray.png")
    Image.fromarray(noise[..., :3]).save(root / "a" / "rgb.png")
    Image.fromarray(noise).save(root / "a" / "rgba.png")
    Image.fromarray(noise[..., :3]).quantize(16).save(root / "a" / "palette.png")
    ramp = np.linspace(0, 65535, 1024).reshape(32, 32).astype(np.uint16)
    Image.fromarray(ramp).save(root / "a" / "deep.png")
    stored = Image.new("L", (16, 8), 0)
    stored.paste(255, (0, 0, 8, 8))  # the left half white as stored: the top half as seen
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(root / "b" / "turned.jpg", exif=exif, quality=95)
    for i in range(4):  # large: the decoder's draft mode shrinks them by 8 for 16x16
        photo = rng.integers(0, 256, (300, 400 + 40 * i, 3), dtype=np.uint8)
        Image.fromarray(photo).resize((800 + 80 * i, 600)).save(root / "b" / f"big{i}.jpg")
    files = sorted((root / "a").iterdir()) + sorted((root / "b").iterdir())
    for channels in (1, 3):
        x, _, _ = _folder(root, channels, 16)
        for trained, f in zip(x, files, strict=True):
            served = v1.decode_image(f.read_bytes(), (channels, 16, 16), f.name)
            np.testing.assert_array_equal(trained, served, err_msg=f"{f.name}, C={channels}")
        deep = x[files.index(root / "a" / "deep.png")]
        assert 120 < deep.mean() < 135  # a ramp 0..65535: mid-gray, not saturated at 255
        turned = x[files.index(root / "b" / "turned.jpg")]
        assert turned[:, :8].mean() > 240 and turned[:, 8:].mean() < 15  # upright


def test_unreadable_files_are_named_together_after_empty_classes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_folder(tmp_path / "imgs")
    (tmp_path / "imgs" / "cat" / "broken.png").write_bytes(b"\x89PNG not really")
    (tmp_path / "imgs" / "dog" / "cut.jpg").write_bytes(b"\xff\xd8\xff garbage")
    (tmp_path / "imgs" / "emu").mkdir()
    spec = DataSpec(source="folder", path=str(tmp_path / "imgs"), image_size=8)
    # an empty class is found before any image is decoded
    with pytest.raises(DataError, match=r"1 of 3 classes have no images \('emu'\)"):
        load_splits(spec)
    (tmp_path / "imgs" / "emu").rmdir()
    with pytest.raises(DataError) as err:
        load_splits(spec)
    assert str(err.value) == (
        f"image folder {tmp_path / 'imgs'}: cannot read 2 of 14 images: cat/broken.png: not a "
        "readable PNG or JPEG image (unrecognised data); dog/cut.jpg: not a readable PNG or JPEG "
        "image (unrecognised data): remove or replace those files"
    )
    for i in range(3):
        (tmp_path / "imgs" / "dog" / f"z{i}.png").write_bytes(b"")
    caplog.clear()
    with pytest.raises(DataError, match=r"read 5 of 17 images \(each named above\): .* 2 more: "):
        load_splits(spec)
    # past the three the error names, every one on a line of its own: all removed in one go
    assert sorted(m.split(":")[0] for m in caplog.messages if m.startswith("cannot read")) == [
        "cannot read cat/broken.png", "cannot read dog/cut.jpg",
        "cannot read dog/z0.png", "cannot read dog/z1.png", "cannot read dog/z2.png",
    ]  # fmt: skip


@pytest.mark.parametrize("source", ["folder", "npz"])
def test_colour_read_as_gray_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, source: str
) -> None:
    for cls, colour in (("cat", (200, 30, 30)), ("dog", (30, 30, 200))):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (8, 8), colour).save(tmp_path / "imgs" / cls / f"{i}.png")
    Image.new("L", (8, 8), 30).save(tmp_path / "imgs" / "cat" / "gray.png")  # no colour
    x, y, _ = _folder(tmp_path / "imgs", 3, 8)
    colour = (x[:, 0] != x[:, 2]).any(axis=(1, 2))
    np.savez(tmp_path / "d.npz", x=x[colour], y=y[colour])  # without the gray one
    path = tmp_path / ("imgs" if source == "folder" else "d.npz")
    with caplog.at_level("INFO", logger="lightship.data.sources"):
        load_splits(DataSpec(source=source, path=str(path), image_size=8, channels=3))
        assert caplog.messages == []
        load_splits(DataSpec(source=source, path=str(path), image_size=8, channels=1))
    assert caplog.messages == [
        "data.channels=1: 12 colour images converted to grayscale; set data.channels=3 to keep "
        "colour"
    ]
    caplog.clear()


def write_half(path: Path) -> None:
    np.savez(path, x=X20, y=np.repeat([0, 1], 10))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def write_long_extra_field(path: Path) -> None:
    # A flipped bit in the first member's extra-field length: the reader skips past the data
    # and zipfile raises EOFError with no message ("cannot read d.npz: ; write it again").
    np.savez(path, x=X20, y=np.repeat([0, 1], 10))
    data = bytearray(path.read_bytes())
    data[29] ^= 0b10
    path.write_bytes(bytes(data))


def write_npy(path: Path) -> None:
    with path.open("wb") as f:  # a bare .npy, named .npz
        np.save(f, X20)


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (write_half, r"not an \.npz archive \(truncated"),
        (lambda p: p.write_text("x,y\n1,2\n"), r"not an \.npz archive"),
        (write_npy, r"not an \.npz archive"),
        (write_long_extra_field, r"cannot read .*d\.npz: it ends before its data \(EOFError\); "),
        (lambda p: np.savez(p, images=X20), r"arrays 'x' .* and 'y' .*found \['images'\]"),
        (
            lambda p: np.savez(p, x=X20, y=np.zeros(19, dtype=np.int64)),
            r"got \(20, 1, 6, 6\) and \(19,\)",
        ),
        (
            lambda p: np.savez(p, x=X20, y=np.repeat([-1, 1], 10)),
            r"negative labels \(min -1\).*renumber",
        ),
        (
            lambda p: np.savez(p, x=X20, y=np.repeat([0, 2], 10), labels=np.array(["a", "b"])),
            r"class index 2 but 'labels' names only 2 classes",
        ),
        (
            lambda p: np.savez(p, x=np.full(X20.shape, np.nan), y=np.repeat([0, 1], 10)),
            r"x has dtype float64; store images as uint8 pixels 0\.\.255 \(x holds NaN or "
            r"infinite values\)$",
        ),
        (
            lambda p: np.savez(p, x=X20 / np.float32(255), y=np.repeat([0, 1], 10)),
            r"x has dtype float32; store images as uint8 pixels 0\.\.255 \(images in 0\.\.1: "
            r"x = np\.round\(x \* 255\)\.astype\(np\.uint8\)\)$",
        ),
        (
            # * 255 would wrap these: 200 * 255 % 256 = 56
            lambda p: np.savez(p, x=X20.astype(np.float32), y=np.repeat([0, 1], 10)),
            r"x has dtype float32; store images as uint8 pixels 0\.\.255 \(its values are within "
            r"0\.\.255: x = np\.round\(x\)\.astype\(np\.uint8\)\)$",
        ),
        (
            lambda p: np.savez(p, x=X20 / 100 - 1, y=np.repeat([0, 1], 10)),
            r"x has dtype float64; store images as uint8 pixels 0\.\.255 \(its values run from "
            r"-1 to 1: scale them to 0\.\.255\)$",
        ),
        (
            lambda p: np.savez(p, x=X20.astype(np.int64) * 2, y=np.repeat([0, 1], 10)),
            r"x has dtype int64; store images as uint8 pixels 0\.\.255 \(its values run from 0 to "
            r"400: scale them to 0\.\.255\)$",
        ),
        (
            lambda p: np.savez(p, x=np.zeros((20, 6, 6, 5), np.uint8), y=np.repeat([0, 1], 10)),
            r"x \(20, 6, 6, 5\) holds 6-channel images as \[N,C,H,W\], or 5-channel ones as "
            r"\[N,H,W,C\]; store gray \(1\), RGB \(3\) or RGBA \(4\) images as \[N,C,H,W\] or "
            r"\[N,H,W,C\]",
        ),
        (  # two channels last: it said 32-channel images
            lambda p: np.savez(p, x=np.zeros((20, 8, 8, 2), np.uint8), y=np.repeat([0, 1], 10)),
            r"x \(20, 8, 8, 2\) holds 8-channel images as \[N,C,H,W\], or 2-channel ones as "
            r"\[N,H,W,C\]; store gray",
        ),
        (
            lambda p: np.savez(p, x=X20, y=np.repeat([0, 1], 10), labels=np.array("a")),
            r"'labels' must be a list of distinct class names, got shape \(\) with 1 distinct",
        ),
        (
            lambda p: np.savez(p, x=X20, y=np.repeat([0, 1], 10), labels=np.array(["a", "a"])),
            r"'labels' must be a list of distinct class names, got shape \(2,\) with 1 distinct",
        ),
    ],
    ids=[
        "truncated",
        "text",
        "npy",
        "short-member",
        "no-x",
        "lengths",
        "negative",
        "beyond-labels",
        "nan-x",
        "float-x-0-1",
        "float-x-0-255",
        "float-x-normalised",
        "int-x-beyond-255",
        "five-channels",
        "two-channels-last",
        "labels-scalar",
        "labels-twice",
    ],
)
def test_bad_npz_says_what_to_fix(
    tmp_path: Path, write: Callable[[Path], None], message: str
) -> None:
    path = tmp_path / "d.npz"
    write(path)
    with pytest.raises(DataError, match=message):
        load_splits(DataSpec(source="npz", path=str(path)))


@pytest.mark.parametrize("side", [40, 50])  # over Pillow's warning size, and over twice it
def test_decompression_bomb_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, side: int
) -> None:
    # a 1000-pixel limit stands for Pillow's ~89M: the same check, without the slow huge file
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    make_folder(tmp_path / "imgs")
    Image.new("1", (side, side)).save(tmp_path / "imgs" / "cat" / "huge.png")
    with pytest.raises(
        DataError, match=r"cannot read 1 of 13 images: cat/huge\.png: .*bomb.*: downscale it"
    ):
        load_splits(DataSpec(source="folder", path=str(tmp_path / "imgs"), image_size=8))


def test_too_few_images_for_the_split(tmp_path: Path) -> None:
    x, y = X20[[0, 10, 11]], np.array([0, 1, 1])
    with pytest.raises(
        DataError, match=r"3 images leaves an empty split \(train 3, val 0, test 0\)"
    ):
        load_npz(tmp_path / "d.npz", x=x, y=y)


def test_a_relative_data_path_is_recorded_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # quantize and report rebuild the split from the recorded spec, from any folder
    monkeypatch.chdir(tmp_path)
    spec = spec_from_config(DataConfig(source="npz", path=Path("data/d.npz")))
    assert spec.path == str(tmp_path / "data" / "d.npz")


def test_images_beside_the_class_folders_are_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # they were left out without a word: a 2-class model trained on the rest
    make_folder(tmp_path / "imgs")
    for i in range(4):
        Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / f"loose{i}.png")
    (tmp_path / "imgs" / "readme.txt").write_text("")
    spec = DataSpec(source="folder", path=str(tmp_path / "imgs"), image_size=8)
    with caplog.at_level("WARNING", logger="lightship.data.sources"):
        assert load_splits(spec).labels == ["cat", "dog"]
        load_splits(spec)
    assert caplog.messages == [
        f"image folder {tmp_path / 'imgs'}: left out 4 images that lie directly in it, in no "
        "class sub-folder (loose0.png, loose1.png, loose2.png and 1 more): move them into "
        "class sub-folders to train on them"
    ]


def test_a_flat_folder_of_images_is_told_to_make_class_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(3):
        Image.new("RGB", (8, 8)).save(tmp_path / f"{i}.jpg")
    with pytest.raises(DataError) as err:
        load_splits(DataSpec(source="folder", path=str(tmp_path)))
    assert str(err.value) == (
        f"image folder {tmp_path} has no images: expected {tmp_path}/<class>/*.png|jpg (found "
        "classes: []); 3 images lie directly in it: move them into class sub-folders"
    )
    # one class's folder given, beside the others: its parent is the likelier fix
    (tmp_path / "square").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "square" / "0.png")
    circle = tmp_path / "circle"
    circle.mkdir()
    for i in range(3):
        Image.new("RGB", (8, 8)).save(circle / f"{i}.png")
    with pytest.raises(DataError) as err:
        load_splits(DataSpec(source="folder", path=str(circle)))
    assert str(err.value).endswith(
        "3 images lie directly in it: move them into class sub-folders, or, if circle is one "
        f"class, set data.path to the folder of the classes, {tmp_path}"
    )
    monkeypatch.chdir(circle)  # given as `.`: named as it is
    with pytest.raises(DataError) as err:
        load_splits(DataSpec(source="folder", path="."))
    assert str(err.value).endswith(
        f"if circle is one class, set data.path to the folder of the classes, {tmp_path}"
    )


def test_a_folder_given_a_file_or_npz_a_folder_names_the_other_source(tmp_path: Path) -> None:
    # they said "image folder ... does not exist" of a file that exists
    make_folder(tmp_path / "imgs")
    np.savez(tmp_path / "d.npz", x=np.zeros((4, 8, 8), np.uint8), y=np.arange(4))
    with pytest.raises(DataError) as err:
        load_splits(DataSpec(source="folder", path=str(tmp_path / "d.npz")))
    assert str(err.value) == (
        f"data.source=folder needs an image folder, but {tmp_path / 'd.npz'} is a file: "
        "set data.source=npz for an .npz file"
    )
    with pytest.raises(DataError) as err:
        load_splits(DataSpec(source="npz", path=str(tmp_path / "imgs")))
    assert str(err.value) == (
        f"data.source=npz needs an .npz file, but {tmp_path / 'imgs'} is a folder: "
        "set data.source=folder for an image folder of <class>/*.png|jpg"
    )


def test_an_empty_image_file_is_said_to_be_empty(tmp_path: Path) -> None:
    # it said "not a readable PNG or JPEG image (unrecognised data)"
    make_folder(tmp_path / "imgs")
    (tmp_path / "imgs" / "cat" / "0.png").write_bytes(b"")
    with pytest.raises(DataError, match="cannot read 1 of 13 images: cat/0.png: empty file \\("):
        load_splits(DataSpec(source="folder", path=str(tmp_path / "imgs")))


def test_pixel_stats_are_numpys_figures_without_a_float_copy_of_the_images() -> None:
    """mean/std of the training images took a float64 copy of them and a temporary as large
    for the std: 16 times their memory (3 GB for 226 MB of 224-pixel photos)."""
    import tracemalloc

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(240, 3, 224, 224), dtype=np.uint8)
    x[:, 2] //= 7  # a channel far from the others'
    empty = np.zeros((0, 3, 224, 224), dtype=np.uint8)
    labels = np.zeros(len(x), dtype=np.int64)
    splits = Splits(x, labels, empty, labels[:0], empty, labels[:0], ["a"], "")
    tracemalloc.start()
    try:
        mean, std = splits.pixel_stats()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < x.nbytes / 2  # of 36 MB; 16 times that before
    for c in range(3):  # numpy's figures, a channel at a time, rounded as they are recorded
        channel = x[:, c].astype(np.float64)
        assert mean[c] == round(float(channel.mean()), 4)
        assert std[c] == round(float(channel.std()), 4)


def test_splits_are_drawn_without_a_second_copy_of_the_images(tmp_path: Path) -> None:
    """x[train], x[val] and x[test] were copied while x was held: twice the data's memory."""
    import tracemalloc

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(1200, 3, 48, 48), dtype=np.uint8)
    y = np.arange(len(x)) % 4
    np.savez(tmp_path / "d.npz", x=x, y=y)
    spec = DataSpec(source="npz", path=str(tmp_path / "d.npz"), channels=3, image_size=48)
    tracemalloc.start()
    try:
        splits = load_splits(spec)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.3 * x.nbytes
    train, val, test = stratified_split(y, spec.val_fraction, spec.test_fraction, spec.split_seed)
    for got, want in ((splits.train_x, x[train]), (splits.val_x, x[val]), (splits.test_x, x[test])):
        assert got.flags.c_contiguous and np.array_equal(got, want)
    assert np.array_equal(splits.test_y, y[test])


def test_training_says_what_it_reads_and_its_smallest_classes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A class of .webp files (skipped: PNG and JPEG only) trained on its few others, and only a
    debug line counted the images: the smallest classes are said."""
    from lightship.train.fit import _say_data

    make_folder(tmp_path / "imgs", per_class=10)
    for i in range(3):  # an emu with 3 images
        (tmp_path / "imgs" / "emu").mkdir(exist_ok=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / "emu" / f"{i}.png")
    splits = load_splits(DataSpec(source="folder", path=str(tmp_path / "imgs"), image_size=8))
    with caplog.at_level("INFO", logger="lightship.train.fit"):
        _say_data("folder", tmp_path / "imgs", splits)
    assert [r.getMessage() for r in caplog.records if r.name == "lightship.train.fit"] == [
        f"data folder {tmp_path / 'imgs'}: 23 images, 3 classes: train 15, val 4, test 4 "
        "(fewest: 'emu' 3, 'cat' 10, 'dog' 10)"
    ]


@pytest.mark.parametrize("acc", [-1.0, 1.5, float("nan")])
def test_a_recorded_accuracy_no_training_writes_is_a_malformed_manifest(acc: float) -> None:
    """An edited test_acc of -1 (or NaN) was said to be changed data: "put the data back"."""
    from lightship.data.sources import check_as_trained
    from lightship.errors import RunError

    y = np.zeros(10, np.int64)
    with pytest.raises(RunError, match=r"^the manifest's checkpoint entry is malformed: it "):
        check_as_trained({"test_samples": 10, "test_acc": acc}, y, 1.0, "best.ckpt")
    check_as_trained({"test_samples": 10, "test_acc": 1.0}, y, 1.0, "best.ckpt")  # as trained
