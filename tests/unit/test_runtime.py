from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

from lightship.errors import ConfigError, RunError
from lightship.runtime import InputError, base, load_predictor, softmax
from lightship.runtime.base import LoadError, cgroup_cpu_limit, physical_cores
from lightship.runtime.ort import (
    DISABLED_OPTIMIZERS,
    SPIN_IN_RUN,
    OrtPredictor,
    file_metadata,
    providers_for,
)
from tests.handmade import batch_rows, expected_logits, handmade_onnx


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
    # all-black float images and 0/1 integers are pixels as sent
    np.testing.assert_allclose(predictor.predict(np.zeros((1, 1, 2, 2), np.float32)), [[0, 100]])
    np.testing.assert_allclose(predictor.predict(np.ones((1, 1, 2, 2), np.int64)), [[4, 96]])


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (np.zeros((1, 1, 3, 3), np.uint8), r"expected shape \[N, 1, 2, 2\], got \[1, 1, 3, 3\]$"),
        # channels last, as PIL and numpy images come (V2 infer sends the shape as it is)
        (
            np.zeros((1, 2, 2, 1), np.uint8),
            re.escape(
                "expected shape [N, 1, 2, 2], got [1, 2, 2, 1] "
                "(this looks like NHWC: transpose to NCHW)"
            ),
        ),
        # grey images without a channel axis, as MNIST-style arrays come: said to be [1, 5, 2, 2]
        (
            np.zeros((5, 2, 2), np.uint8),
            re.escape(
                "expected shape [N, 1, 2, 2], got [5, 2, 2] (images without a channel axis: "
                "send x[:, None])"
            )
            + "$",
        ),
        (np.zeros((0, 1, 2, 2), np.uint8), "empty batch"),
        (np.full((1, 1, 2, 2), np.nan, np.float32), "NaN"),
        (np.full((1, 1, 2, 2), 300.0), r"0\.\.255"),
        (np.full((1, 1, 2, 2), -1, np.int32), r"0\.\.255"),
        (np.array([[[["a", "b"], ["c", "d"]]]]), "dtype"),
        # a 0..1 image rounds to black: answered with confidence, wrongly
        (
            np.array([[[[0.0, 0.5], [0.99, 1.0]]]], np.float32),
            r"look scaled to 0\.\.1 \(largest 1\); .* send the pixels times 255",
        ),
        (np.full((1, 1, 2, 2), 0.2, np.float64), r"scaled to 0\.\.1 \(largest 0\.2\)"),
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


def _onnx(
    path: Path,
    inputs: list[tuple[str, int, list[Any]]],
    output: tuple[int, list[Any]] = (TensorProto.FLOAT, ["N", 2]),
    meta: dict[str, str] | None = None,
) -> Path:
    """A graph whose first input is cast, flattened and reshaped into the output; other inputs
    pass through, so the graph is valid whatever their type or shape."""
    name = inputs[0][0]
    out_type, out_shape = output
    nodes = [
        helper.make_node("Cast", [name], ["xf"], to=out_type),
        helper.make_node("Flatten", ["xf"], ["f"], axis=1),
        helper.make_node("Reshape", ["f", "target"], ["y"]),
    ]
    nodes += [helper.make_node("Identity", [n], [f"{n}_out"]) for n, _, _ in inputs[1:]]
    target = [0 if d == "N" else -1 if isinstance(d, str) else d for d in out_shape]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, e, s) for n, e, s in inputs],
        [helper.make_tensor_value_info("y", out_type, out_shape)]
        + [helper.make_tensor_value_info(f"{n}_out", e, s) for n, e, s in inputs[1:]],
        initializer=[helper.make_tensor("target", TensorProto.INT64, [len(target)], target)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    for key, value in (meta or {}).items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))
    return path


IMAGE = ("x", TensorProto.UINT8, ["N", 1, 2, 2])


def test_a_foreign_graph_with_one_dynamic_image_input_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    p = load_predictor(_onnx(tmp_path / "ok.onnx", [IMAGE], (TensorProto.FLOAT, ["N", 4])))
    assert p.chw == (1, 2, 2) and p.labels == ["0", "1", "2", "3"]
    np.testing.assert_allclose(p.predict(np.ones((3, 1, 2, 2), np.uint8)), np.ones((3, 4)))
    assert not caplog.messages  # uint8 in: raw pixels are what it takes
    path = _onnx(tmp_path / "f.onnx", [("x", TensorProto.FLOAT, ["N", 1, 2, 2])])
    load_predictor(path)
    assert caplog.messages == [
        f"{path} carries no lightship metadata: its float32 input is fed raw pixels 0..255, "
        "unscaled; a model trained on 0..1 or normalised input answers wrongly (models exported "
        "by lightship normalise inside the graph)"
    ]


@pytest.mark.parametrize("batch", [1, 4])
def test_a_fixed_batch_dimension_is_refused(tmp_path: Path, batch: int) -> None:
    path = _onnx(tmp_path / "m.onnx", [("x", TensorProto.UINT8, [batch, 1, 2, 2])])
    with pytest.raises(
        RunError, match=f"m.onnx has a fixed batch dimension of {batch}: re-export it with a dyn"
    ):
        load_predictor(path)


def test_a_second_required_input_is_refused(tmp_path: Path) -> None:
    path = _onnx(tmp_path / "m.onnx", [IMAGE, ("b", TensorProto.FLOAT, ["N", 2])])
    with pytest.raises(RunError, match=r"needs 2 inputs \(x uint8 \[N, 1, 2, 2\], b float32"):
        load_predictor(path)


@pytest.mark.parametrize(
    ("kind", "said"), [(TensorProto.DOUBLE, "float64"), (TensorProto.INT8, "int8")]
)
def test_an_unsupported_input_type_is_refused(tmp_path: Path, kind: int, said: str) -> None:
    # int8 was fed pixels cast from uint8: 200 became -56, and the answers were another image's
    path = _onnx(tmp_path / "m.onnx", [("x", kind, ["N", 1, 2, 2])])
    with pytest.raises(
        RunError, match=rf"input x is {said} .*; lightship feeds images as uint8, float32, float16:"
    ):
        load_predictor(path)


def test_an_output_that_does_not_follow_the_batch_is_an_error_not_an_answer(
    tmp_path: Path,
) -> None:
    """Logits summed over the batch ([1, 4] for any batch): 3 images got one row, and the
    server's batches of several requests answered all but the first with no prediction."""
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
            helper.make_node("Flatten", ["xf"], ["f"], axis=1),
            helper.make_node("ReduceSum", ["f", "axes"], ["y"], keepdims=1),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, ["N", 1, 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        initializer=[helper.make_tensor("axes", TensorProto.INT64, [1], [0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "m.onnx"))
    p = load_predictor(tmp_path / "m.onnx")
    np.testing.assert_array_equal(p.predict(np.ones((1, 1, 2, 2), np.uint8)), [[1, 1, 1, 1]])
    with pytest.raises(base.OutputError, match=r"m.onnx gave logits \[1, 4\] for 3 images, ex"):
        p.predict(np.ones((3, 1, 2, 2), np.uint8))
    with pytest.raises(base.OutputError, match=r"expected \[2, 4\] \(one row an image, one col"):
        p.logits(np.ones((2, 1, 2, 2), np.uint8))  # what the server's batches run


def test_metadata_whose_image_size_the_graph_refuses_is_refused_at_load(tmp_path: Path) -> None:
    """Loaded, it refused every image: the metadata's size at the graph, the graph's at check."""
    spec = json.dumps({"shape": ["batch", 3, 2, 2]})
    path = _onnx(tmp_path / "m.onnx", [IMAGE], meta={"lightship.input_spec": spec})
    with pytest.raises(
        RunError,
        match=r"input_spec says images \[3, 2, 2\] but its graph takes uint8 \[N, 1, 2, 2\]: re-",
    ):
        load_predictor(path)
    # a graph open in H and W takes the metadata's size
    spec = json.dumps({"shape": ["batch", 1, 2, 2]})
    path = _onnx(
        tmp_path / "open.onnx",
        [("x", TensorProto.UINT8, ["N", 1, "h", "w"])],
        (TensorProto.FLOAT, ["N", 4]),
        meta={"lightship.input_spec": spec},
    )
    assert load_predictor(path).chw == (1, 2, 2)
    # without it, nothing says what size to resize to
    path = _onnx(tmp_path / "bare.onnx", [("x", TensorProto.UINT8, ["N", 1, "h", "w"])])
    with pytest.raises(RunError, match=r"\[N, 1, h, w\] has no fixed C, H, W, and no lightship.in"):
        load_predictor(path)


@pytest.mark.parametrize("hw", [[2, 2], ["h", "w"]])
def test_an_open_output_width_without_labels_is_found_by_a_blank_image(
    tmp_path: Path, hw: list[Any]
) -> None:
    """Its labels were [] and the server stopped at warm-up on "expected finite logits [1, 0]".
    The graph's width is 4 columns sliced off by a count computed from the pixels (x times 0,
    plus 4), which onnxruntime cannot fold: it leaves the width open."""
    tensor, node = helper.make_tensor, helper.make_node
    graph = helper.make_graph(
        [
            node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
            node("Flatten", ["xf"], ["f"], axis=1),
            node("ReduceMin", ["xf"], ["low"], keepdims=0),
            node("Mul", ["low", "zero"], ["nothing"]),
            node("Add", ["nothing", "four"], ["width"]),
            node("Cast", ["width"], ["whole"], to=TensorProto.INT64),
            node("Reshape", ["whole", "one"], ["ends"]),
            node("Slice", ["f", "starts", "ends", "axes"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, ["N", 1, *hw])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "classes"])],
        initializer=[
            tensor("zero", TensorProto.FLOAT, [], [0.0]),
            tensor("four", TensorProto.FLOAT, [], [4.0]),
            tensor("one", TensorProto.INT64, [1], [1]),
            tensor("starts", TensorProto.INT64, [1], [0]),
            tensor("axes", TensorProto.INT64, [1], [1]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    # open in H and W too, the metadata's size is what the blank image has (it crashed on
    # int('h'))
    spec = json.dumps({"shape": ["batch", 1, 2, 2]})
    model.metadata_props.add(key="lightship.input_spec", value=spec)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    p = load_predictor(path)
    assert isinstance(p, OrtPredictor)
    assert p.session.get_outputs()[0].shape == ["N", "classes"]  # open, as meant
    assert p.labels == ["0", "1", "2", "3"]
    np.testing.assert_array_equal(p.predict(np.full((2, 1, 2, 2), 2, np.uint8)), [[2] * 4] * 2)


def test_a_float16_input_is_fed_float16(tmp_path: Path) -> None:
    path = _onnx(
        tmp_path / "m.onnx",
        [("x", TensorProto.FLOAT16, ["N", 1, 2, 2])],
        (TensorProto.FLOAT, ["N", 4]),
    )
    p = load_predictor(path)
    np.testing.assert_allclose(p.predict(np.full((2, 1, 2, 2), 255, np.uint8)), [[255] * 4] * 2)


@pytest.mark.parametrize(
    ("output", "described"),
    [
        ((TensorProto.INT64, ["N", 1]), r"int64 \[N, 1\]"),
        ((TensorProto.FLOAT, ["N", 1, 2, 2]), r"float32 \[N, 1, 2, 2\]"),
        ((TensorProto.FLOAT, ["N"]), r"float32 \[N\]"),
    ],
)
def test_an_output_that_is_not_logits_is_refused(
    tmp_path: Path, output: tuple[int, list[Any]], described: str
) -> None:
    path = _onnx(tmp_path / "m.onnx", [IMAGE], output)
    with pytest.raises(
        RunError, match=rf"m.onnx's first output is {described}; lightship serves logits \[N, cl"
    ):
        load_predictor(path)


def test_labels_that_do_not_match_the_output_are_refused(tmp_path: Path) -> None:
    meta = {"lightship.labels": json.dumps(["a", "b", "c"])}
    path = _onnx(tmp_path / "m.onnx", [IMAGE], meta=meta)
    with pytest.raises(RunError, match="has 3 labels in its metadata but its output has 2 class"):
        load_predictor(path)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "input_spec is not valid JSON: re-export it"),
        ('{"shape": [1, 2]}', r"input_spec is not valid \(needs a shape \[N, C, H, W\]"),
        ('["x"]', "input_spec is not valid"),
    ],
)
def test_malformed_metadata_is_refused(tmp_path: Path, value: str, message: str) -> None:
    path = _onnx(tmp_path / "m.onnx", [IMAGE], meta={"lightship.input_spec": value})
    with pytest.raises(RunError, match=message):
        load_predictor(path)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04truncated"])
def test_a_corrupt_pt2_gives_one_error_and_no_torch_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    pytest.importorskip("torch")
    path = tmp_path / "model.pt2"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING), pytest.raises(RunError, match="cannot load pt2 model"):
        load_predictor(path)
    assert not [r for r in caplog.records if r.name.startswith("torch")]


@pytest.mark.parametrize("asks", [False, True])
def test_a_model_asking_to_spin_inside_runs_gets_a_pool_that_stops_after_each(
    tmp_path: Path, asks: bool
) -> None:
    """`lightship.ort.spin_in_run` = 1 (set by the quantizer where it measured it paying):
    the pool's threads spin inside a run and stop when it returns; any other model's never
    spin, so an idle server burns no CPU."""
    meta = {SPIN_IN_RUN: "1"} if asks else {}
    path = _onnx(tmp_path / "m.onnx", [IMAGE], (TensorProto.FLOAT, ["N", 4]), meta=meta)
    p = OrtPredictor(path, threads=2, split=False)  # one session, with its two-thread pool
    options = p.session.get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == str(int(asks))
    if asks:
        assert options.get_session_config_entry("session.force_spinning_stop") == "1"
    np.testing.assert_array_equal(p.predict(np.ones((1, 1, 2, 2), np.uint8)), [[1, 1, 1, 1]])


def test_a_models_own_session_settings_are_read_off_the_file_in_one_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The metadata that asks for other session options is read without a session: the model
    is built once with them, not once to read them and again to apply them."""
    meta = {SPIN_IN_RUN: "1", DISABLED_OPTIMIZERS: "QDQPropagationTransformer"}
    path = _onnx(tmp_path / "m.onnx", [IMAGE], (TensorProto.FLOAT, ["N", 4]), meta=meta)
    built: list[dict[str, Any]] = []

    class Counted(onnxruntime.InferenceSession):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", Counted)
    p = OrtPredictor(path, threads=2, split=False)
    assert [b.get("disabled_optimizers") for b in built] == [["QDQPropagationTransformer"]]
    options = p.session.get_session_options()
    assert options.get_session_config_entry("session.force_spinning_stop") == "1"
    built.clear()
    OrtPredictor(handmade_onnx(tmp_path / "plain.onnx"), threads=2, split=False)
    assert [b.get("disabled_optimizers") for b in built] == [None]


def test_file_metadata_reads_what_onnxruntime_reads_and_refuses_what_it_refuses(
    tmp_path: Path,
) -> None:
    meta = {"lightship.target": "vnni", "ünï": "cödé", "empty": ""}
    path = _onnx(tmp_path / "m.onnx", [IMAGE], meta=meta)
    model = onnx.load(str(path))
    model.metadata_props.add(key="lightship.target", value="avx2")  # repeated: the last counts
    onnx.save(model, str(path))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert file_metadata(path) == dict(session.get_modelmeta().custom_metadata_map)
    assert file_metadata(path)["lightship.target"] == "avx2"
    assert file_metadata(handmade_onnx(tmp_path / "plain.onnx"))["lightship.labels"]
    for name, content in (
        ("empty.onnx", b""),
        ("text.onnx", b"not a model"),
        ("cut.onnx", path.read_bytes()[:-7]),
        ("no-graph.onnx", b"\x08\x0a"),  # ir_version 10 and nothing else
    ):
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(LoadError, match=f"cannot load ONNX model {bad} \\(") as err:
            file_metadata(bad)
        with pytest.raises(LoadError) as as_served:
            OrtPredictor(bad)
        assert str(err.value) == str(as_served.value)


def _spy_runs(p: OrtPredictor) -> list[tuple[str, int]]:
    """Record (thread, rows) for each run of a session: one per slice of a split batch."""
    calls: list[tuple[str, int]] = []
    infer = p._infer

    def spy(session: Any, x: np.ndarray) -> np.ndarray:
        calls.append((threading.current_thread().name, len(x)))
        return infer(session, x)

    p._infer = spy  # type: ignore[method-assign]
    return calls


def test_a_long_batch_is_split_across_one_thread_lanes_in_order(tmp_path: Path) -> None:
    """Two threads: a batch of `split_rows`+ rows runs as two slices at once, on two threads,
    and the logits come back in the caller's row order; a shorter batch is not split."""
    p = OrtPredictor(handmade_onnx(tmp_path / "m.onnx"), threads=2)
    assert p.lanes == 2 and p.split_rows >= 2
    calls = _spy_runs(p)
    rng = np.random.default_rng(0)
    long = rng.integers(0, 256, (p.split_rows + 3, 1, 2, 2), dtype=np.uint8)
    np.testing.assert_array_equal(p.predict(long), expected_logits(long))
    assert sorted(rows for _, rows in calls) == sorted(
        len(part) for part in np.array_split(long, 2)
    )
    assert len({thread for thread, _ in calls}) == 2  # both slices ran, each on its own thread
    calls.clear()
    short = long[: p.split_rows - 1]
    np.testing.assert_array_equal(p.predict(short), expected_logits(short))
    assert calls == [(threading.current_thread().name, len(short))]  # one run, unsplit


def test_close_lets_go_of_sessions_and_lane_threads_at_once(tmp_path: Path) -> None:
    """A library user loading models one after another lets go of each with `with`; not when
    the garbage collector gets to it (a predictor in a reference cycle kept its lanes)."""
    before = set(threading.enumerate())  # earlier tests' predictors may not be collected yet
    with load_predictor(handmade_onnx(tmp_path / "m.onnx"), threads=2) as p:
        assert isinstance(p, OrtPredictor) and p.lanes == 2
        x = np.full((p.split_rows, 1, 2, 2), 7, np.uint8)
        np.testing.assert_array_equal(p.predict(x), expected_logits(x))  # the lane thread starts
        lanes = [t for t in set(threading.enumerate()) - before if t.name.startswith("lightship")]
        session = weakref.ref(p.session)
    assert lanes and not any(t.is_alive() for t in lanes)
    assert session() is None
    with pytest.raises(RuntimeError, match=r"OrtPredictor\(.*m\.onnx.*was closed: load the"):
        p.predict(x)
    p.close()  # twice is fine


def test_a_closed_torch_predictor_drops_its_module(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from lightship.runtime.torch_backends import TorchPredictor

    module = torch.nn.Flatten()
    meta = {"labels": ["a", "b"], "input_spec": {"shape": ["batch", 1, 1, 2]}}
    p = TorchPredictor(tmp_path / "m.ts", module, meta, "torchscript", "cpu")
    x = np.array([[[[1, 2]]]], np.uint8)
    np.testing.assert_array_equal(p.predict(x), [[1, 2]])
    dropped = weakref.ref(module)
    del module
    with p:
        pass
    assert dropped() is None
    with pytest.raises(RuntimeError, match="was closed"):
        p.predict(x)


def test_a_padding_predictor_runs_powers_of_two_and_answers_only_the_rows_sent(
    tmp_path: Path,
) -> None:
    """On a GPU a model pads its batches to a power of two of rows (cuDNN picks its kernels
    at each new shape): the padding's logits never reach an answer."""
    p = load_predictor(handmade_onnx(tmp_path / "hand.onnx"))
    seen = batch_rows(p)
    x = np.random.default_rng(3).integers(1, 256, (9, *p.chw), dtype=np.uint8)
    p.pads = True
    for n in (1, 2, 3, 5, 8, 9):
        np.testing.assert_array_equal(p.predict(x[:n]), expected_logits(x[:n]))
    assert seen == [1, 2, 4, 8, 8, 16]
    p.pads = False
    np.testing.assert_array_equal(p.predict(x[:5]), expected_logits(x[:5]))
    assert seen[-1] == 5


def test_a_model_pads_its_batches_on_a_gpu_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    from lightship.runtime.torch_backends import TorchPredictor

    meta = {"labels": ["a", "b"], "input_spec": {"shape": ["batch", 1, 1, 2]}}
    made = {d: TorchPredictor(tmp_path / "m.ts", torch.nn.Flatten(), meta, "torchscript", d)
            for d in ("cpu", "cuda:0")}  # fmt: skip
    assert [p.pads for p in made.values()] == [False, True]
    # an ONNX model's GPU session, here a CPU one
    monkeypatch.setattr(
        OrtPredictor,
        "_open_gpu",
        lambda self, threads, spinning, device: self._open(
            threads, spinning, ["CPUExecutionProvider"]
        ),
    )
    path = handmade_onnx(tmp_path / "hand.onnx")
    assert [OrtPredictor(path, device=d).pads for d in ("cpu", "cuda:0")] == [False, True]


def test_a_dynamic_int8_model_is_never_split(tmp_path: Path) -> None:
    """It scales its activations by the batch it is given: slices of a batch gave other logits
    than the batch whole (up to 0.008 for digits), cut where load-time timings said."""
    path = handmade_onnx(tmp_path / "m.onnx")
    model = onnx.load(str(path))
    model.metadata_props.add(key="lightship.quantization", value="dynamic")
    onnx.save(model, str(path))
    p = OrtPredictor(path, threads=2)
    assert (p.lanes, p.split_rows, p._pool) == (1, 0, None)
    assert p.short_batch_threads == 2  # one session with both threads
    static = handmade_onnx(tmp_path / "s.onnx")
    model = onnx.load(str(static))
    model.metadata_props.add(key="lightship.quantization", value="static")
    onnx.save(model, str(static))
    assert OrtPredictor(static, threads=2).lanes == 2  # per-tensor scales fixed: split


@pytest.mark.parametrize("threads, split", [(1, True), (2, False)])
def test_one_thread_or_split_off_keeps_one_session(
    tmp_path: Path, threads: int, split: bool
) -> None:
    p = OrtPredictor(handmade_onnx(tmp_path / "m.onnx"), threads=threads, split=split)
    assert (p.lanes, p.split_rows, p._pool) == (1, 0, None)
    x = np.full((64, 1, 2, 2), 7, np.uint8)
    np.testing.assert_array_equal(p.predict(x), expected_logits(x))


@pytest.mark.parametrize(
    "one_image_s, lane_one_s, four_rows_s, split_rows, short_on_lane, timed_four",
    [
        # the digits CNN's shape: 50 us a row, one image faster on one thread
        (90e-6, 65e-6, 200e-6, 6, True, True),
        # a row a lane, found by timing four: a quarter of one image is under 150 us
        (600e-6, 500e-6, 1.2e-3, 2, True, True),
        # ResNet-18's: 1 ms a row, one image faster on the two-thread pool; four images take
        # no less than one, so a row a lane without timing them (0.13 s of a slow CPU's start)
        (1.2e-3, 1.3e-3, 4.4e-3, 2, False, False),
    ],
)
def test_split_rows_and_the_short_batch_session_follow_the_timings_at_load(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    one_image_s: float,
    lane_one_s: float,
    four_rows_s: float,
    split_rows: int,
    short_on_lane: bool,
    timed_four: bool,
) -> None:
    """Each lane gets at least `SPLIT_MIN_LANE_S` of work (rows x one-thread time per row);
    short batches go to whichever session ran one image sooner."""
    from lightship.runtime import ort as ort_module

    timed: list[int] = []

    def fastest(session: Any, name: str, x: np.ndarray, runs: int = 3) -> float:
        timed.append(len(x))
        threads = session.get_session_options().intra_op_num_threads
        if len(x) == 4:
            return four_rows_s
        return lane_one_s if threads == 1 else one_image_s

    monkeypatch.setattr(ort_module, "_fastest", fastest)
    p = OrtPredictor(handmade_onnx(tmp_path / "m.onnx"), threads=2)
    assert p.split_rows == split_rows
    assert (p.session is p._lane) == short_on_lane
    assert p.short_batch_threads == (1 if short_on_lane else 2)
    assert timed == ([1, 1, 4] if timed_four else [1, 1])


@pytest.mark.parametrize("name", ["model.onnx", "model.ts"])
def test_a_missing_export_names_the_command_that_makes_it(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "r"
    (run / "export").mkdir(parents=True)
    (run / "manifest.json").write_text("{}")
    (run / "best.ckpt").write_bytes(b"weights")  # a trained run: export can make the file
    monkeypatch.chdir(tmp_path)  # outside lightship's checkout: its make targets are not here
    with pytest.raises(RunError) as err:
        load_predictor(run / "export" / name)
    assert str(err.value).endswith(
        f"{run}/export/{name} not found: run `lightship export --run {run}` first"
    )
    with pytest.raises(RunError) as err:
        load_predictor(tmp_path / name)  # in no run
    assert str(err.value).endswith(f"{tmp_path / name} not found: export it first")


def test_a_cuda_device_gives_trt_and_cuda_the_gpu_it_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: gpu)
    monkeypatch.delenv("LIGHTSHIP_TENSORRT", raising=False)
    providers = providers_for("cuda:1", cache_dir=Path("/cache"))
    assert providers == [
        (
            "TensorrtExecutionProvider",
            {
                "device_id": 1,
                "trt_engine_cache_enable": True,
                "trt_engine_cache_path": "/cache",
                "trt_fp16_enable": True,
            },
        ),
        ("CUDAExecutionProvider", {"device_id": 1}),
        "CPUExecutionProvider",
    ]
    assert providers_for("cuda")[1] == ("CUDAExecutionProvider", {"device_id": 0})
    # LIGHTSHIP_TENSORRT as the server's switches are read: `false` had left TensorRT on
    for off in ("0", "false", "Off", " no "):
        monkeypatch.setenv("LIGHTSHIP_TENSORRT", off)
        assert providers_for("cuda") == [("CUDAExecutionProvider", {"device_id": 0}), gpu[2]]
    for on in ("", "1", "true", "YES"):
        monkeypatch.setenv("LIGHTSHIP_TENSORRT", on)
        assert providers_for("cuda")[0][0] == "TensorrtExecutionProvider"
    monkeypatch.setenv("LIGHTSHIP_TRT_CACHE", " ")  # blank: unset (the cache was the folder " ")
    assert providers_for("cuda")[0][1]["trt_engine_cache_path"] == "/tmp/lightship-trt-cache"
    monkeypatch.setenv("LIGHTSHIP_TENSORRT", "banana")
    with pytest.raises(ConfigError, match="LIGHTSHIP_TENSORRT='banana' is neither on nor off: set"):
        providers_for("cuda")


@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider'")
def test_cuda_that_falls_back_to_the_cpu_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # onnxruntime-gpu without a usable GPU lists CUDA, then runs the session on the CPU: here
    # the CPU build is told CUDA is there, and its session runs on the CPU as that one does.
    monkeypatch.setattr(
        onnxruntime,
        "get_available_providers",
        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"],
    )
    with pytest.raises(RunError) as err:
        OrtPredictor(handmade_onnx(tmp_path / "m.onnx"), device="cuda")
    assert str(err.value) == (
        "device=cuda but onnxruntime could not use the GPU and fell back to the CPU (its log "
        "above says why): run the container with `--gpus all` and check the NVIDIA driver and "
        "CUDA libraries (`nvidia-smi`), or serve with --device cpu"
    )


class TensorrtMissing(onnxruntime.InferenceSession):
    """onnxruntime-gpu where TensorRT's libraries are missing: a session asked for TensorRT
    falls back to CUDA without the provider options it was given, so on GPU 0 (onnxruntime's
    `_fallback_providers`); one asked for CUDA alone runs on the GPU its options name. It runs
    on the CPU here, reporting what onnxruntime-gpu would."""

    asked: ClassVar[list[list[Any]]] = []

    def __init__(self, path: str, options: Any = None, providers: Any = (), **kw: Any) -> None:
        self.asked.append(list(providers))
        given: dict[str, dict[str, Any]] = dict(p for p in providers if isinstance(p, tuple))
        trt = "TensorrtExecutionProvider" in given
        self.gpu = "0" if trt else str(given["CUDAExecutionProvider"]["device_id"])
        super().__init__(path, options, providers=["CPUExecutionProvider"], **kw)

    def get_providers(self) -> list[str]:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        return {"CUDAExecutionProvider": {"device_id": self.gpu}, "CPUExecutionProvider": {}}


def test_cuda_n_stays_on_gpu_n_when_tensorrt_cannot_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: gpu)
    monkeypatch.setattr(onnxruntime, "InferenceSession", TensorrtMissing)
    monkeypatch.setattr(TensorrtMissing, "asked", [])
    monkeypatch.delenv("LIGHTSHIP_TENSORRT", raising=False)
    caplog.set_level(logging.INFO, "lightship")
    p = OrtPredictor(handmade_onnx(tmp_path / "m.onnx"), device="cuda:1")
    assert p.session.get_provider_options()["CUDAExecutionProvider"]["device_id"] == "1"
    assert TensorrtMissing.asked[-1] == [
        ("CUDAExecutionProvider", {"device_id": 1}),
        "CPUExecutionProvider",
    ]
    assert "TensorRT could not be used" in caplog.text
    x = np.array([[[[1, 2], [3, 4]]]], np.uint8)
    np.testing.assert_array_equal(p.predict(x), expected_logits(x))
    # a run failing in CUDA would rebuild the session on GPU 0, options dropped: it fails
    assert p.session._enable_fallback is False
    # what runs it is logged, not the setting only
    assert (
        f"{tmp_path / 'm.onnx'} runs on cuda:1 (CUDAExecutionProvider, CPUExecutionProvider)"
        in (caplog.text)
    )


def test_tensorrt_engines_are_cached_by_the_models_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """onnxruntime names a cached engine by the graph's names and the versions, not its
    weights: a model trained again was served with the engine of the one before."""
    gpu = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: gpu)
    monkeypatch.delenv("LIGHTSHIP_TENSORRT", raising=False)
    for name in "abc":
        (tmp_path / name).mkdir()
    first = handmade_onnx(tmp_path / "a" / "model.onnx", bias=1.0)
    again = handmade_onnx(tmp_path / "b" / "model.onnx", bias=2.0)  # same names, other weights
    twin = handmade_onnx(tmp_path / "c" / "model.onnx", bias=1.0)

    cache = tmp_path / "cache" / "tensorrt"  # its parent too is made: onnxruntime makes one

    def folder(model: Path) -> str:
        options = providers_for("cuda", cache_dir=cache, model=model)[0][1]
        return str(options["trt_engine_cache_path"])

    assert folder(first) == f"{cache}/{hashlib.sha256(first.read_bytes()).hexdigest()[:32]}"
    assert folder(again) != folder(first) and folder(twin) == folder(first)
    assert Path(folder(first)).is_dir()


# -- threads under a CPU quota -------------------------------------------------------------------


def _cgroup(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "sys-fs-cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    (tmp_path / "cgroup").write_text(membership)
    return root, tmp_path / "cgroup"


@pytest.mark.parametrize(
    ("membership", "files", "expected"),
    [
        # cgroup v2 in a container (its own cgroup is the root): docker run --cpus 1.5
        ("0::/\n", {"cpu.max": "150000 100000\n"}, 1.5),
        ("0::/\n", {"cpu.max": "max 100000\n"}, None),
        # v2 on a host: the smallest quota along the path (the pod's 2 CPUs, its container's 3)
        (
            "0::/kubepods/pod1/ctr\n",
            {
                "cpu.max": "max 100000\n",
                "kubepods/pod1/cpu.max": "200000 100000\n",
                "kubepods/pod1/ctr/cpu.max": "300000 100000\n",
            },
            2.0,
        ),
        # v2 in a container whose membership names the host's path, absent here
        ("0::/system.slice/docker-1.scope\n", {"cpu.max": "50000 100000\n"}, 0.5),
        # cgroup v1 (hybrid, as on this machine): quota -1 is none
        (
            "4:memory:/x\n1:cpu,cpuacct:/\n0::/\n",
            {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
            None,
        ),
        (
            "1:cpu,cpuacct:/docker/abc\n",
            {"cpu/cpu.cfs_quota_us": "250000\n", "cpu/cpu.cfs_period_us": "100000\n"},
            2.5,
        ),
        ("0::/\n", {}, None),  # no cpu controller files: no limit known
    ],
)
def test_cgroup_cpu_limit_reads_the_quota_of_v1_and_v2(
    tmp_path: Path, membership: str, files: dict[str, str], expected: float | None
) -> None:
    root, member = _cgroup(tmp_path, membership, files)
    assert cgroup_cpu_limit(root, member) == expected


def test_threads_default_to_the_cpu_quota_not_the_hosts_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ONNX Runtime sizes its pool to the host's cores; lightship's default is the quota,
    # rounded up (1.5 CPUs: 2 threads), and never more than the cores
    def cores_under(limit: float | None) -> int:
        monkeypatch.setattr(base, "cgroup_cpu_limit", lambda: limit)
        physical_cores.cache_clear()  # read once per process
        return physical_cores()

    try:
        cores = cores_under(None)
        assert cores_under(0.5) == 1
        assert cores_under(1.5) == min(2, cores)
        assert cores_under(64.0) == cores
    finally:
        physical_cores.cache_clear()


def test_a_read_only_array_reaches_torch_without_its_warning(exported_run: Path) -> None:
    # np.frombuffer and read-only memmaps: torch.from_numpy warned of undefined behaviour
    from lightship.runtime import load_predictor

    ts = load_predictor(exported_run / "export" / "model.ts")
    x = np.zeros((2, *ts.chw), np.uint8)
    frozen = np.frombuffer(x.tobytes(), np.uint8).reshape(x.shape)
    assert not frozen.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ts.predict(frozen)
    np.testing.assert_array_equal(got, ts.predict(x))


@pytest.mark.parametrize("threads", [0, -1, 2.0, "2"])
def test_a_thread_count_below_one_is_refused_before_anything_changes(
    tmp_path: Path, threads: Any
) -> None:
    # threads=0 meant all cores and -1 opened a session; a torch model's load set the process's
    # thread count before it found its file missing; 2.0 reached onnxruntime, whose TypeError
    # was said as a model to export again, and "2" a bare TypeError
    import torch

    from lightship.runtime import load_predictor

    before = torch.get_num_threads()
    for name in ("m.onnx", "m.ts"):
        with pytest.raises(
            ConfigError, match=re.escape(f"whole number >= 1 (None: one per core), got {threads!r}")
        ):
            load_predictor(tmp_path / name, threads=threads)
    assert torch.get_num_threads() == before
    with pytest.raises(RunError, match="not found"):
        load_predictor(tmp_path / "m.ts", threads=before + 1)
    assert torch.get_num_threads() == before  # a missing file changes nothing either


@pytest.mark.parametrize("device", ["gpu", "gpu0", "cuda0", "CPU", ""])
def test_a_device_name_torch_does_not_take_is_refused_as_such(tmp_path: Path, device: str) -> None:
    # "gpu0" on a .ts said "re-export it"; "gpu" on an .onnx, "install onnxruntime-gpu"
    from lightship.runtime import load_predictor

    for name in ("m.onnx", "m.ts"):
        with pytest.raises(ConfigError) as err:
            load_predictor(tmp_path / name, device=device)
        assert str(err.value) == f"device must be cpu, cuda or cuda:N, got {device!r}"


def test_an_int8_model_made_for_another_cpu_is_warned_of_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`load_predictor` says what the server refuses: full-range int8 weights (quantized for
    VNNI) on a CPU without VNNI, whose int16 sums saturate. Once a file: the report loads a
    model twice. The server passes isa_check=False, having checked by its own policy."""
    from lightship.quantize import isa

    avx2 = isa.CpuInfo("test AVX2 CPU", "x86_64", frozenset({"avx2"}))
    vnni = isa.CpuInfo("test VNNI CPU", "x86_64", frozenset({"avx2", "avx512_vnni"}))
    made_for_vnni = handmade_onnx(tmp_path / "vnni.onnx")
    model = onnx.load(str(made_for_vnni))
    model.metadata_props.add(key="lightship.target", value="vnni")
    onnx.save(model, str(made_for_vnni))
    caplog.set_level(logging.WARNING, logger="lightship.runtime.ort")
    monkeypatch.setattr(isa, "host_cpu", lambda: vnni)
    load_predictor(made_for_vnni)  # the CPU it was made for
    assert caplog.records == []
    monkeypatch.setattr(isa, "host_cpu", lambda: avx2)
    load_predictor(made_for_vnni, isa_check=False)
    assert caplog.records == []
    for _ in range(2):
        load_predictor(made_for_vnni, split=False)
    assert [r.getMessage() for r in caplog.records] == [
        f"{made_for_vnni}: model was quantized for vnni (full-range int8 weights) but this CPU "
        "has no VNNI: int16 accumulation saturates and answers drift; re-quantize it in the "
        "run it came from: `lightship quantize --run RUN --target avx2`"
    ]
    load_predictor(handmade_onnx(tmp_path / "fp32.onnx"))  # no target: runs anywhere
    assert len(caplog.records) == 1


def test_qats_own_checkpoint_is_named_with_what_to_load_instead(tmp_path: Path) -> None:
    # quantize/qat.ckpt "lacks 'model_spec' in its hyper-parameters: train it with lightship",
    # though lightship made it
    torch = pytest.importorskip("torch")
    path = tmp_path / "quantize" / "qat.ckpt"
    path.parent.mkdir()
    hparams = {"source": {"model_spec": {"name": "digits_cnn"}}, "qat": {"lr": 1e-4}}
    torch.save({"state_dict": {}, "hyper_parameters": hparams}, path)
    with pytest.raises(RunError) as err:
        load_predictor(path)
    assert str(err.value) == (
        f"checkpoint {path} is quantization-aware training's, a step of `lightship quantize`, "
        f"not a trained model: load what QAT made, {path.parent / 'model.int8-qat.onnx'}, or "
        "the run's best.ckpt"
    )


def test_a_runtimes_long_line_is_cut_at_a_word_and_marked() -> None:
    """torch's 300-character error was cut mid-sentence at 200 ("...your checkpoint file is"),
    read as the whole of it."""
    from lightship.runtime.base import LoadError

    words = "PytorchStreamReader failed reading zip archive: failed finding central directory "
    err = LoadError(Path("m.ts"), "TorchScript", "torch", RuntimeError(words * 5), "re-export")
    reason = err.reason()
    assert len(reason) <= 200 and reason.endswith("…") and reason[:-1] == reason[:-1].rstrip()
    assert (words * 5).startswith(reason[:-1] + " ")  # whole words, then the mark
    short = LoadError(Path("m.ts"), "TorchScript", "torch", RuntimeError("bad file"), "fix")
    assert short.reason() == "bad file"
    assert (
        str(short.with_fix("re-run it"))
        == "cannot load TorchScript model m.ts (bad file): re-run it"
    )


def test_a_pt2_program_is_moved_to_a_gpu_with_the_device_its_graph_asserts() -> None:
    """`.module().to("cuda")` moved the weights only: the graph still asserted its input was on
    the CPU it was exported on, and every batch on a GPU failed "Tensor device mismatch". The
    pass that moves both is shown here with the meta device, which a CPU build has."""
    import torch

    from lightship.runtime.torch_backends import on_device

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.to(torch.float32).flatten(1))

    program = torch.export.export(Net(), (torch.zeros(2, 1, 2, 2, dtype=torch.uint8),))

    def asserted(ep: Any) -> set[str]:
        return {
            str(node.kwargs["device"])
            for node in ep.graph_module.graph.nodes
            if node.target == torch.ops.aten._assert_tensor_metadata.default
        }

    assert asserted(program) == {"cpu"}
    assert on_device(program, "cpu") is program
    moved = on_device(program, "meta")
    assert asserted(moved) == {"meta"}
    assert {p.device.type for p in moved.module().parameters()} == {"meta"}


def test_a_cuda_device_is_named_with_its_index_and_checked_against_the_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from lightship.runtime.torch_backends import _device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert [_device(d) for d in ("cpu", "cuda", "cuda:0", "cuda:1")] == [
        "cpu",
        "cuda:1",
        "cuda:0",
        "cuda:1",
    ]
    with pytest.raises(RunError) as err:
        _device("cuda:2")  # was found as a load error that said to re-export the model
    assert str(err.value) == (
        "device=cuda:2 but torch sees 2 CUDA devices (cuda:0..cuda:1): name one of them"
    )
