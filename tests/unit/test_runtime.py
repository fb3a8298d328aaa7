from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lightship.errors import RunError
from lightship.runtime import InputError, load_predictor, softmax
from lightship.runtime.ort import OrtPredictor
from tests.handmade import expected_logits, handmade_onnx


@pytest.fixture
def predictor(tmp_path: Path) -> OrtPredictor:
    p = load_predictor(handmade_onnx(tmp_path / "m.onnx"))
    assert isinstance(p, OrtPredictor)
    return p


def test_metadata_and_exact_values(predictor: OrtPredictor) -> None:
    assert predictor.labels == ["bright", "dark"]
    assert predictor.chw == (1, 2, 2)
    x = np.array([[[[1, 2], [3, 4]]], [[[255, 255], [255, 255]]]], np.uint8)
    np.testing.assert_allclose(predictor.predict(x), [[10, 90], [1020, -920]])
    np.testing.assert_allclose(predictor.predict(x), expected_logits(x))


def test_float_and_int_pixels_are_cast(predictor: OrtPredictor) -> None:
    x = np.full((1, 1, 2, 2), 2.4, np.float32)  # rounds to 2
    np.testing.assert_allclose(predictor.predict(x), [[8, 92]])
    np.testing.assert_allclose(predictor.predict(np.full((1, 2, 2), 3, np.int64)), [[12, 88]])


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (np.zeros((1, 1, 3, 3), np.uint8), r"expected shape \[N, 1, 2, 2\], got \[1, 1, 3, 3\]"),
        (np.zeros((0, 1, 2, 2), np.uint8), "empty batch"),
        (np.full((1, 1, 2, 2), np.nan, np.float32), "NaN"),
        (np.full((1, 1, 2, 2), 300.0), r"0\.\.255"),
        (np.full((1, 1, 2, 2), -1, np.int32), r"0\.\.255"),
        (np.array([[[["a", "b"], ["c", "d"]]]]), "dtype"),
    ],
)
def test_bad_input_is_an_input_error(predictor: OrtPredictor, x: np.ndarray, message: str) -> None:
    with pytest.raises(InputError, match=message):
        predictor.predict(x)


def test_softmax_rows_sum_to_one() -> None:
    p = softmax(np.array([[0.0, 0.0], [1000.0, 0.0]]))
    np.testing.assert_allclose(p, [[0.5, 0.5], [1.0, 0.0]])


def test_unknown_or_corrupt_artifacts(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="unknown model file type"):
        load_predictor(tmp_path / "model.tflite")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    with pytest.raises(RunError, match="bad.onnx"):
        load_predictor(bad)
