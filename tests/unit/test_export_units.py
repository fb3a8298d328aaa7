"""The exporters' writers and their printout capture, on models of a few weights (seconds)."""

from __future__ import annotations

import logging
import os
import pickle
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from lightship.export import core
from lightship.export import onnx as onnx_export
from lightship.export import pt2 as pt2_export
from lightship.export import torchscript as ts_export
from lightship.export.failure import printout_on_failure_to_debug
from lightship.runs import RunDir
from tests.conftest import ROOT

WRITERS = {"onnx": onnx_export.write, "ts": ts_export.write, "pt2": pt2_export.write}


class Tiny(torch.nn.Sequential):
    """Defined here, under the checkout: its file's path would be in a stack trace."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(8, 3))


def contents(path: Path) -> list[bytes]:
    """The file's bytes; a zip archive's members decompressed (TorchScript deflates some)."""
    if not zipfile.is_zipfile(path):
        return [path.read_bytes()]
    with zipfile.ZipFile(path) as z:
        return [name.encode() for name in z.namelist()] + [z.read(n) for n in z.namelist()]


def test_torchscript_traced_again_in_one_process_is_the_same_bytes(tmp_path: Path) -> None:
    """torch numbers a class type traced again under a taken name (`___torch_mangle_N`) by all
    the types the process made: a notebook's second export got another sha256, which dropped
    the report. The names are numbered from 0 in the file, which loads and runs as before."""
    model, x = Tiny().eval(), torch.rand(2, 1, 4, 4)
    paths = [tmp_path / f"{i}.ts" for i in range(3)]
    for path in paths:
        ts_export.write(model, x, path, {"lightship.labels": "[]"})
    assert len({p.read_bytes() for p in paths}) == 1
    (names,) = {tuple(zipfile.ZipFile(p).namelist()) for p in paths}
    (mangled,) = [n for n in names if "mangle" in n]
    assert mangled.endswith("/___torch_mangle_0.py"), names
    with torch.no_grad():
        torch.testing.assert_close(torch.jit.load(paths[-1])(x), model(x))


def test_mangled_names_are_left_where_a_pickle_holds_them_as_strings() -> None:
    """Only a GLOBAL opcode's text may change length: a name in a pickled string keeps the
    whole archive as torch wrote it."""
    records = {
        "data.pkl": b"\x80\x02c__torch__.___torch_mangle_7\nM\nq\x00.",
        "code/__torch__/___torch_mangle_7.py": b"def f(self: __torch__.___torch_mangle_7.M): ...",
        "constants/0": b"___torch_mangle_7",  # tensor bytes: never read as names
    }
    renamed = ts_export.canonical_names(records)
    assert renamed == {
        "data.pkl": b"\x80\x02c__torch__.___torch_mangle_0\nM\nq\x00.",
        "code/__torch__/___torch_mangle_0.py": b"def f(self: __torch__.___torch_mangle_0.M): ...",
        "constants/0": b"___torch_mangle_7",
    }
    in_a_string = {**records, "constants.pkl": pickle.dumps("__torch__.___torch_mangle_7")}
    assert ts_export.canonical_names(in_a_string) == in_a_string
    unreadable = {**records, "data.pkl": b"no pickle: ___torch_mangle_7"}
    assert ts_export.canonical_names(unreadable) == unreadable


@pytest.mark.parametrize("suffix", list(WRITERS))
def test_an_exported_file_names_no_install_path_nor_its_temporary_name(
    tmp_path: Path, suffix: str
) -> None:
    path = tmp_path / f".model.k3x9q2.tmp.{suffix}"  # as `atomic_path` names it
    WRITERS[suffix](Tiny().eval(), torch.rand(2, 1, 4, 4), path, {"lightship.labels": "[]"})
    site_packages = Path(torch.__file__).parents[1]
    for part in contents(path):
        for text in (str(ROOT), str(site_packages), "k3x9q2"):
            assert text.encode() not in part


def test_stack_traces_are_stripped_from_subgraphs_and_functions() -> None:
    def node(op: str, inputs: list[str], output: str, **attrs: Any) -> onnx.NodeProto:
        n = helper.make_node(op, inputs, [output], **attrs)
        n.metadata_props.add(key=onnx_export.PATH_METADATA, value='File "/src/m.py", line 1')
        n.metadata_props.add(key="namespace", value="net.0")
        return n

    def branch(name: str) -> onnx.GraphProto:
        out = helper.make_tensor_value_info(name, TensorProto.FLOAT, [1])
        return helper.make_graph([node("Identity", ["x"], name)], name, [], [out])

    cond = node("If", ["c"], "y", then_branch=branch("a"), else_branch=branch("b"))
    function = helper.make_function("f", "g", ["x"], ["z"], [node("Neg", ["x"], "z")], [])
    graph = helper.make_graph([cond], "g", [], [])
    proto = helper.make_model(graph, functions=[function])  # copies of the nodes above
    onnx_export.strip_paths(proto)
    (top,) = proto.graph.node
    nodes = [top, *(n for a in top.attribute for n in a.g.node), *proto.functions[0].node]
    keys = [[p.key for p in n.metadata_props] for n in nodes]
    assert keys == [["namespace"]] * 4


def test_what_a_failing_block_prints_goes_to_the_debug_log_even_from_cpp(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    log = logging.getLogger("test.exporter")
    with (
        caplog.at_level(logging.DEBUG),
        pytest.raises(RuntimeError),
        printout_on_failure_to_debug(log, "the exporter"),
    ):
        os.write(1, b"graph(%0 : Float)\n")  # as C++ (std::cout) writes, below sys.stdout
        print("def forward(self):")
        os.write(2, b"W symbolic_shapes.py] Unable to find user code\n")
        raise RuntimeError("cannot export")
    assert capfd.readouterr() == ("", "")
    assert caplog.messages == [
        "the exporter printed:\ngraph(%0 : Float)\ndef forward(self):\n"
        "W symbolic_shapes.py] Unable to find user code\n"
    ]


def test_what_a_block_that_succeeds_prints_is_passed_on(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with printout_on_failure_to_debug(logging.getLogger("test.exporter"), "the exporter"):
        os.write(1, b"from C++\n")
        print("from Python")
        os.write(2, b"a warning\n")
    assert capfd.readouterr() == ("from C++\nfrom Python\n", "a warning\n")


@pytest.mark.parametrize(
    ("fmt", "chosen", "fix"),
    [
        # what is left of the request, never what is already written
        ("onnx", ["onnx", "torchscript", "pt2"], "`make export RUN=r EXPORT_ARGS='--formats "
         "torchscript,pt2'`"),
        ("torchscript", ["onnx", "torchscript", "pt2"], "`make export RUN=r EXPORT_ARGS="
         "'--formats pt2'` (model.onnx is written)"),
        # nothing left and model.onnx written: the stage that comes next
        ("pt2", ["onnx", "torchscript", "pt2"], "model.onnx and model.ts are written; go on "
         "with `make quantize RUN=r`"),
        ("pt2", ["onnx", "pt2"], "model.onnx is written; go on with `make quantize RUN=r`"),
        # no model.onnx: the other formats
        ("pt2", ["pt2"], "`make export RUN=r EXPORT_ARGS='--formats onnx,torchscript'`"),
        ("onnx", ["pt2", "onnx"], "`make export RUN=r EXPORT_ARGS='--formats pt2'` (model.pt2 "
         "is written)"),
    ],
)  # fmt: skip
def test_a_failed_format_says_how_to_go_on_from_what_is_written(
    fmt: str, chosen: list[str], fix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # in the checkout: make's targets
    loaded: Any = SimpleNamespace(model_spec={"name": "digits_cnn"})
    assert core._fix(RunDir(Path("r")), loaded, fmt, chosen) == f"leave {fmt} out: {fix}"


def test_parity_counts_the_images_that_agree_where_a_percentage_rounds_to_100() -> None:
    import numpy as np

    from lightship.errors import ParityError
    from lightship.export.parity import Parity, check_parity

    parity = Parity(1e-5, 19_999 / 20_000, 20_000, (1, 64), 1e-4, 1.0)
    assert parity.summary() == "max |Δlogit| 1.00e-05, argmax agreement 19,999/20,000 images"
    # one of three images flips its argmax: 2/3 agree, against a limit of 99.995 %
    reference = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]], dtype=np.float32)
    flipped = reference.copy()
    flipped[2] = [0.0, 1.0]
    with pytest.raises(ParityError) as failed:
        check_parity(
            lambda x: flipped[: len(x)], {64: reference}, reference, 2.0, 0.99995, "m", "f"
        )
    assert str(failed.value) == (
        "m disagrees with the eager model: max |Δlogit| 1.00e+00, argmax agreement 2/3 images "
        "(limits |Δ| <= 2, agreement >= 99.995%); it was not written — loosen with --atol if the "
        "difference is expected, or f"
    )


def test_int8_models_a_new_onnx_outdates_are_named_with_a_command_that_runs_from_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # it said `make quantize RUN=...` outside the checkout too, where there is no Makefile
    run = RunDir(tmp_path / "r")
    (run.root / "quantize").mkdir(parents=True)
    (run.root / "quantize" / "model.int8-static.onnx").write_bytes(b"old")
    run.record(
        "onnx-int8-static", {"file": "quantize/model.int8-static.onnx", "source_sha256": "a"}
    )
    monkeypatch.chdir(tmp_path)
    core._discard_quantized_from_another(run, "b")
    assert capsys.readouterr().out == (
        "the new model.onnx outdates onnx-int8-static of this run: deleted; re-run "
        f"`lightship quantize --run {run.root}`\n"
    )
    assert run.artifact("onnx-int8-static") is None
    assert not (run.root / "quantize" / "model.int8-static.onnx").exists()
    # the report measured it and goes too: said, and made again (lightship quantize does not)
    (run.root / "quantize").mkdir()  # the folder went, left empty
    (run.root / "quantize" / "model.int8-static.onnx").write_bytes(b"old")
    run.record(
        "onnx-int8-static", {"file": "quantize/model.int8-static.onnx", "source_sha256": "a"}
    )
    (run.root / "report").mkdir()
    (run.root / "report" / "report.json").write_text("{}")
    core._discard_quantized_from_another(run, "b")
    assert capsys.readouterr().out == (
        "the new model.onnx outdates onnx-int8-static, the report of this run: deleted; re-run "
        f"`lightship quantize --run {run.root}`, then `lightship report --run {run.root}`\n"
    )
    assert not (run.root / "report").exists()


def test_a_command_of_quantize_then_report_leaves_the_report_to_makes_quantize(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)  # in the checkout: make's quantize runs the report after it
    run = RunDir(Path("runs/r"))
    assert run.command("quantize", "report") == "`make quantize RUN=runs/r`"
    assert run.command("export", "quantize", "report") == "`make export quantize RUN=runs/r`"
    assert run.command("report") == "`make report RUN=runs/r`"


def test_parity_without_the_runs_data_is_on_random_images_and_says_what_follows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a run copied without its data exports, but the `next:` quantize will refuse: say so
    from lightship.export.core import parity_inputs

    gone = tmp_path / "gone"
    loaded = SimpleNamespace(
        data_spec={"source": "folder", "path": str(gone), "image_size": 8, "channels": 3},
        input_spec={"shape": ["batch", 3, 8, 8]},
    )
    with caplog.at_level(logging.WARNING, "lightship.export.core"):
        x, y = parity_inputs(loaded, fallback=16)  # type: ignore[arg-type]
    assert x.shape == (16, 3, 8, 8) and x.dtype == "uint8" and x.std() > 50
    assert y is None
    assert caplog.messages == [
        f"parity checked on 16 random images, not the test split: image folder {gone}, which "
        "this run was trained on, does not exist: put the data back at that path (a symlink to "
        "its new place will do) and run again. Quantize and report measure accuracy on that "
        "split, and refuse until the data is back"
    ]


def test_parity_on_the_test_split_holds_no_more_than_it(tmp_path: Path) -> None:
    """The split was a view of every image loaded: kept as it was, export held the whole data
    set in memory while it checked parity on 15 % of it. Only the test split is loaded now."""
    from lightship.export.core import parity_inputs

    loaded = SimpleNamespace(
        data_spec={"source": "digits", "image_size": 8, "channels": 1},
        input_spec={"shape": ["batch", 1, 8, 8]},
    )
    x, y = parity_inputs(loaded)  # type: ignore[arg-type]
    held = x if x.base is None else x.base  # a view of the test split's images alone
    assert y is not None and len(x) == len(y) == 269 and held.nbytes == x.nbytes


def test_torchs_batch_size_check_in_a_trace_is_not_passed_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """BatchNorm without running statistics checks its batch's size in torch.nn.functional;
    the tracer warned there, in three blocks of torch's text, of nothing in the model."""
    import warnings as w

    import torch

    from lightship.export.failure import warn_frozen

    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4, track_running_stats=False)
    ).eval()
    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        torch.jit.trace(model, torch.randn(2, 1, 8, 8))
    checks = [m for m in caught if issubclass(m.category, torch.jit.TracerWarning)]
    assert checks and all(Path(m.filename).name == "functional.py" for m in checks)
    with caplog.at_level(logging.WARNING), w.catch_warnings(record=True) as passed:
        w.simplefilter("always")
        warn_frozen(logging.getLogger("test.frozen"), caught, "torch.jit.trace", 2)
    assert [str(m.message) for m in passed] == [] and caplog.messages == []


def test_torchs_own_trace_warnings_are_not_called_frozen_control_flow(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the trace checker's "Output nr 1. ... does not match" (a model random in eval) was said to
    # be control flow frozen "at _trace.py:1232", a line of torch's
    import warnings as w

    import torch

    from lightship.export.failure import warn_frozen

    theirs = w.WarningMessage(
        torch.jit.TracerWarning("Output nr 1. of the traced function does not match"),
        torch.jit.TracerWarning,
        str(Path(torch.__file__).parent / "jit" / "_trace.py"),
        1232,
    )
    ours = w.WarningMessage(
        torch.jit.TracerWarning("Converting a tensor to a Python boolean. It might be wrong"),
        torch.jit.TracerWarning,
        "/src/models/net.py",
        12,
    )
    log = logging.getLogger("test.frozen")
    with (
        caplog.at_level(logging.WARNING, "test.frozen"),
        pytest.warns(torch.jit.TracerWarning, match="Output nr 1"),
    ):
        warn_frozen(log, [theirs, ours], "torch.jit.trace", 2)
    assert caplog.messages == [
        "torch.jit.trace froze Python control flow on tensors at net.py:12 (Converting a tensor "
        "to a Python boolean): the file takes the branch its example batch of 2 took, for every "
        "input"
    ]
