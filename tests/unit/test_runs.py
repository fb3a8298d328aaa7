from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lightship import __version__, runs
from lightship.errors import RunBusyError, RunError
from lightship.runs import (
    RunDir,
    atomic_path,
    atomic_paths,
    check_space,
    check_writable,
    interrupt_exit_code,
    interrupt_message,
    lock_run,
    sha256_file,
)
from tests.handmade import handmade_onnx


def test_atomic_path_leaves_old_file_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half-writ")
        raise RuntimeError("crash mid-write")
    assert target.read_bytes() == b"old"
    assert list(tmp_path.iterdir()) == [target]  # no temp file left behind


def test_atomic_path_replaces_on_success(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "model.bin"
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new"


def test_atomic_path_files_get_the_umask_mode_not_mkstemps_0600(tmp_path: Path) -> None:
    # a run mounted read-only into the serving image is read by another user
    mask = os.umask(0o022)
    os.umask(mask)
    target = tmp_path / "model.onnx"
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"x")
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~mask


def test_nothing_is_renamed_into_place_after_ctrl_c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as if a library swallowed the KeyboardInterrupt and finished writing something else
    monkeypatch.setattr(runs, "_interrupted", threading.Event())
    target = tmp_path / "model.onnx"
    target.write_bytes(b"old")
    runs._interrupted.set()
    with pytest.raises(KeyboardInterrupt), atomic_path(target) as tmp:
        tmp.write_bytes(b"made after the interrupt")
    assert target.read_bytes() == b"old" and list(tmp_path.iterdir()) == [target]


SET = ("pareto.png", "report.md", "report.json")  # the report's, in the order it commits them


def _commit(folder: Path, text: str, done: str = "") -> None:
    with atomic_paths(*(folder / name for name in SET), done=done) as temporaries:
        for tmp in temporaries:
            tmp.write_text(text)


def _texts(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir()}


def test_files_committed_together_are_synced_once_each_before_any_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = _sync_events(monkeypatch)
    # the folder last: a rename is on disk once its folder is, and once will do for all three
    _commit(tmp_path, "new")
    assert events == ["sync"] * 3 + [f"rename {name}" for name in SET] + [f"sync {tmp_path}"]
    for name in SET:
        (tmp_path / name).write_text("old")
    events.clear()
    _commit(tmp_path, "new")
    assert events == ["sync"] * 3 + [f"rename {name}" for name in SET] + [f"sync {tmp_path}"]


def _sync_events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What `os.fsync` and `os.replace` are called on, in order, from now on: a file's sync is
    `sync`, a folder's `sync FOLDER`, a rename `rename NAME`."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        folder = stat.S_ISDIR(os.fstat(fd).st_mode)
        events.append(f"sync {os.readlink(f'/proc/self/fd/{fd}')}" if folder else "sync")
        real_fsync(fd)

    def replace(src: str | Path, dst: str | Path) -> None:
        events.append(f"rename {Path(dst).name}")
        real_replace(src, dst)

    monkeypatch.setattr(runs.os, "fsync", fsync)
    monkeypatch.setattr(runs.os, "replace", replace)
    return events


def test_each_folder_renamed_into_is_synced_once_where_its_file_system_can(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    finals = [tmp_path / "a" / "x.json", tmp_path / "b" / "y.json", tmp_path / "a" / "z.json"]
    events = _sync_events(monkeypatch)
    with atomic_paths(*finals) as temporaries:
        for tmp in temporaries:
            tmp.write_text("new")
    renames = ["rename x.json", "rename y.json", "rename z.json"]
    assert events == ["sync"] * 3 + renames + [f"sync {tmp_path / 'a'}", f"sync {tmp_path / 'b'}"]

    # a file system that cannot sync a folder (EINVAL), or open one (EACCES): the files stand
    real_fsync, real_open = os.fsync, os.open

    def refuse_folders(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    def refuse_to_open_folders(path: Path, flags: int, *args: int) -> int:
        if flags & os.O_DIRECTORY:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(runs.os, "fsync", refuse_folders)
    _commit(tmp_path / "c", "synced but not its folder")
    assert _texts(tmp_path / "c") == dict.fromkeys(SET, "synced but not its folder")
    monkeypatch.setattr(runs.os, "open", refuse_to_open_folders)
    _commit(tmp_path / "c", "new")
    assert _texts(tmp_path / "c") == dict.fromkeys(SET, "new")


@pytest.mark.parametrize(
    ("signals", "code"),
    [
        ([signal.SIGINT], 130),
        ([signal.SIGTERM], 143),
        # the later one decides, as outside the renames, where each handler records its own
        ([signal.SIGINT, signal.SIGTERM], 143),
        ([signal.SIGTERM, signal.SIGINT], 130),
    ],
)
@pytest.mark.usefixtures("signal_handlers")
def test_a_stop_signal_during_a_commit_lands_after_its_last_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signals: list[int], code: int
) -> None:
    for name in SET:
        (tmp_path / name).write_text("old")
    real_replace = os.replace

    def replace_then_stopped(src: str | Path, dst: str | Path) -> None:
        real_replace(src, dst)
        if Path(dst).name == SET[0]:  # Ctrl-C, or `docker stop`, just after the first rename
            for signum in signals:
                os.kill(os.getpid(), signum)

    monkeypatch.setattr(runs.os, "replace", replace_then_stopped)
    with pytest.raises(KeyboardInterrupt):
        _commit(tmp_path, "new", done="the new set was written")
    assert _texts(tmp_path) == dict.fromkeys(SET, "new")
    assert runs._stopped_by == [signals[-1]] and interrupt_exit_code() == code
    # the CLI's last line says what stands: the new set, not the note from before the commit
    assert interrupt_message() == "interrupted: the new set was written"
    assert {signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} == {runs._on_stop_signal}


@pytest.mark.usefixtures("signal_handlers")
def test_a_commit_that_fails_before_its_renames_keeps_the_note_that_nothing_is_written(
    tmp_path: Path,
) -> None:
    runs.note_interrupt("the old set is as it was")
    with (
        pytest.raises(RuntimeError),
        atomic_paths(tmp_path / "a.json", done="the new set was written"),
    ):
        raise RuntimeError("the writer failed")
    assert interrupt_message() == "interrupted: the old set is as it was"


@pytest.mark.usefixtures("signal_handlers")
def test_qat_commits_its_two_files_together_and_leaves_only_what_the_sweep_takes(
    exported_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightship.quantize import isa, qat

    run, onnx, ckpt = _run_with_old_qat(exported_run, tmp_path)
    before = _tree(run)
    _qat_stand_ins(monkeypatch)  # committed from QAT's scratch folder
    killed = tmp_path / "killed"  # the run as a kill -9 at the first rename would leave it
    real_replace = os.replace

    def replace_then_stopped(src: str | Path, dst: str | Path) -> None:
        first = Path(dst).parent == onnx.parent and not killed.exists()
        if first:
            shutil.copytree(run, killed, symlinks=True)
        real_replace(src, dst)
        if first:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(runs.os, "replace", replace_then_stopped)
    with pytest.raises(KeyboardInterrupt):
        qat.quantize_aware_train(RunDir(run), isa.SCHEMES["avx2"], onnx, epochs=1, lr=1e-4, seed=0)
    assert onnx.read_bytes() != b"old" and ckpt.read_bytes() != b"old"  # both new
    # QAT's scratch folder and temporary files are all named as the sweep knows them
    assert runs.sweep_temporaries(killed) and _tree(killed) == before


def _run_with_old_qat(exported_run: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of the exported run whose QAT model and checkpoint are b"old": (run, onnx, ckpt)."""
    run = tmp_path / "run"
    shutil.copytree(exported_run, run)
    onnx, ckpt = run / "quantize" / "model.int8-qat.onnx", run / "quantize" / "qat.ckpt"
    onnx.parent.mkdir()
    onnx.write_bytes(b"old")
    ckpt.write_bytes(b"old")
    return run, onnx, ckpt


def _qat_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fine-tuning, the int8 conversion and their checks are test_qat's: here a checkpoint of
    the model as it is, and a stand-in int8 model, are what QAT writes."""
    import torch

    from lightship.quantize import qat

    def fine_tune(lit: Any, dm: object, workdir: Path, epochs: int) -> tuple[Any, Path]:
        torch.save({"state_dict": lit.state_dict()}, workdir / "best.ckpt")
        return SimpleNamespace(current_epoch=epochs), workdir / "best.ckpt"

    monkeypatch.setattr(qat, "fine_tune", fine_tune)
    monkeypatch.setattr(qat, "convert_pt2e", lambda prepared: prepared)
    monkeypatch.setattr(qat, "export_onnx", lambda model, x, path: handmade_onnx(path) and {})
    monkeypatch.setattr(qat, "int8_share", lambda path: {"int8_nodes": 1, "float_nodes": 0})
    monkeypatch.setattr(qat, "_parity", lambda *args: {})


@pytest.mark.usefixtures("signal_handlers")
def test_a_stop_while_quantize_measures_the_qat_model_keeps_the_old_qat_ckpt_too(
    exported_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightship.quantize.core import Quantizer, quantize

    run, onnx, ckpt = _run_with_old_qat(exported_run, tmp_path)
    _qat_stand_ins(monkeypatch)

    def stopped(self: Quantizer, model: Path) -> float:  # `docker stop` as it measures it
        os.kill(os.getpid(), signal.SIGTERM)
        return 1.0

    monkeypatch.setattr(Quantizer, "_val_accuracy", stopped)
    with pytest.raises(KeyboardInterrupt):
        quantize(RunDir(run), "qat", target="avx2")
    # the checkpoint goes with the int8 model it was converted from: both as they were
    assert onnx.read_bytes() == b"old" and ckpt.read_bytes() == b"old"
    assert sorted(p.name for p in onnx.parent.iterdir()) == ["model.int8-qat.onnx", "qat.ckpt"]


@pytest.mark.usefixtures("signal_handlers")
def test_a_stop_during_quantizes_rename_lands_after_the_manifest_records_the_new_model(
    exported_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightship.quantize.core import quantize

    run = tmp_path / "run"
    shutil.copytree(exported_run, run)
    model = run / "quantize" / "model.int8-dynamic.onnx"
    model.parent.mkdir()
    model.write_bytes(b"old")
    old = {"file": "quantize/model.int8-dynamic.onnx", "sha256": sha256_file(model)}
    RunDir(run).record("onnx-int8-dynamic", old)
    real_replace = os.replace

    def replace_then_stopped(src: str | Path, dst: str | Path) -> None:
        real_replace(src, dst)
        if Path(dst) == model:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(runs.os, "replace", replace_then_stopped)
    with pytest.raises(KeyboardInterrupt):
        quantize(RunDir(run), "dynamic", target="avx2")
    entry = RunDir(run).artifact("onnx-int8-dynamic")
    # the new model, and the entry that describes it
    assert entry is not None and model.read_bytes() != b"old"
    assert entry["sha256"] == sha256_file(model) and entry["bytes"] == model.stat().st_size
    assert interrupt_exit_code() == 143


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_check_space_says_how_much_is_needed(tmp_path: Path) -> None:
    check_space(tmp_path / "not" / "yet", 1, "export")
    with pytest.raises(RunError, match=r"export needs about \d+ MB in .* MB are free: make room"):
        check_space(tmp_path, 1 << 60, "export")


def test_check_space_says_kilobytes_below_a_megabyte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = shutil.disk_usage(tmp_path)._replace(free=200_000)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    with pytest.raises(RunError, match=r"needs about 400 kB in .* but 200 kB are free"):
        check_space(tmp_path, 400_000, "export")  # it said "0 MB are free"


def test_manifest_record_and_sha(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    run.root.mkdir()
    f = run.root / "a.txt"
    f.write_text("hello")
    assert sha256_file(f) == hashlib.sha256(b"hello").hexdigest()
    run.record("a", {"file": "a.txt"})
    run.record("b", {"file": "b.txt"})
    run.record("a", {"file": "a2.txt"})
    assert run.manifest()["artifacts"] == {"a": {"file": "a2.txt"}, "b": {"file": "b.txt"}}
    assert run.discard("a", "c") == ["a"]
    assert run.artifact("a") is None and run.artifact("b") == {"file": "b.txt"}


@pytest.mark.parametrize(
    "text",
    [
        "[1, 2]",
        "null",
        '{"artifacts": []}',
        '{"artifacts": {"onnx-fp32": {}}}',
        '{"artifacts": {"onnx-fp32": "x"}}',
    ],
)
def test_malformed_manifest_is_a_run_error(tmp_path: Path, text: str) -> None:
    run = RunDir(tmp_path)
    run.manifest_path.write_text(text)
    with pytest.raises(RunError, match="manifest.json is malformed"):
        run.manifest()


@pytest.mark.parametrize("target", ["manifest.json", "../elsewhere/manifest.json"])
def test_a_manifest_link_that_leads_nowhere_is_no_missing_manifest(
    tmp_path: Path, target: str
) -> None:
    """Taken for no manifest, a link to itself or to a file gone had every stage say to train
    again, which made a new manifest and deleted the run's exports and report."""
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.manifest_path.symlink_to(target)
    for call in (run.manifest, lambda: run.record("onnx-fp32", {"file": "export/model.onnx"})):
        with pytest.raises(RunError) as err:
            call()
        assert str(err.value) == (
            f"{run.manifest_path} is a symbolic link to {target}, which cannot be read (gone, "
            "or a loop): put the run's manifest.json back in its place"
        )
    assert run.manifest_path.is_symlink()  # left as it was


def test_an_entry_that_names_itself_as_its_source_is_no_loop(tmp_path: Path) -> None:
    """An edited onnx-fp32 entry with a source_sha256 of its own sha256 recursed forever."""
    artifacts = {
        "checkpoint": {"sha256": "c" * 64},
        "onnx-fp32": {"sha256": "a" * 64, "source_sha256": "a" * 64},
        "onnx-int8-static": {"sha256": "b" * 64, "source_sha256": "a" * 64},
    }
    run = RunDir(tmp_path)
    assert run.made_elsewhere("onnx-fp32", artifacts) is None
    assert run.made_elsewhere("onnx-int8-static", artifacts) is None


def test_check_writable_makes_missing_folders(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "out.json"
    check_writable(out)
    assert out.parent.is_dir() and list(out.parent.iterdir()) == []  # the probe file is gone


def test_check_writable_refuses_a_folder_in_place_of_the_file(tmp_path: Path) -> None:
    (tmp_path / "pareto.png").mkdir()
    with pytest.raises(RunError, match=r"pareto.png is a folder where a file goes: move it away"):
        check_writable(tmp_path / "report.json", tmp_path / "pareto.png")


def test_check_writable_names_a_file_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "runs").write_text("")
    with pytest.raises(
        RunError, match=r"runs is a file, not a folder: move it away and run again$"
    ):
        check_writable(tmp_path / "runs" / "r" / "manifest.json")


def test_check_writable_reports_the_os_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(**_: object) -> None:  # root ignores chmod, so the OS refusal is simulated
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.TemporaryFile", refuse)
    with pytest.raises(RunError) as err:
        check_writable(tmp_path / "model.onnx")
    assert str(err.value) == (
        f"cannot write {tmp_path / 'model.onnx'}: Permission denied: "
        "check the path and its permissions"
    )


def test_a_checkpoint_entry_without_its_data_spec_is_a_run_error(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    (tmp_path / "manifest.json").write_text(
        '{"schema": 1, "artifacts": {"checkpoint": {"file": "b"}}}'
    )
    with pytest.raises(RunError) as err:
        run.data_spec()
    assert str(err.value) == (
        f"{run.manifest_path} is malformed (no data_spec in its checkpoint entry): delete it "
        f"and re-run the stages, from `make train RUN={tmp_path}`"
    )


@pytest.mark.parametrize(
    ("spec", "what"),
    [
        ({"source": "bogus"}, "data_spec.source = 'bogus': Input should be 'digits', 'folder' or"),
        ({"image_size": "big"}, "data_spec.image_size = 'big': Input should be a valid integer"),
    ],
)
def test_a_corrupt_data_spec_is_the_manifests_fault(
    tmp_path: Path, spec: dict[str, object], what: str
) -> None:
    # it said "unknown data.source 'bogus': use digits, folder or npz", as if the config were
    # wrong: the config is right, the manifest (read by quantize and report) is not
    run = RunDir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_text("")
    run.record("checkpoint", {"file": "best.ckpt", "data_spec": {"source": "digits", **spec}})
    with pytest.raises(RunError) as err:
        run.data_spec()
    assert str(err.value).startswith(f"{run.manifest_path} is malformed (its checkpoint's {what}")
    # deleted, resuming records the checkpoint entry again (a finished run trains nothing)
    assert str(err.value).endswith(
        f"): delete it and re-run the stages, from `make train RESUME=1 RUN={tmp_path}`"
    )


def test_an_older_run_that_recorded_a_path_beside_digits_still_reads(tmp_path: Path) -> None:
    # before data.path needed its source, `--set data.path=...` alone trained digits and
    # recorded the path: report, quantize and QAT refused such runs once the config did
    from lightship.data import DataSpec
    from lightship.data.module import config_from_spec

    run = RunDir(tmp_path)
    spec = {"source": "digits", "path": "/home/u/mydata.npz", "image_size": 8, "channels": 1}
    run.record("checkpoint", {"file": "best.ckpt", "data_spec": spec})
    assert run.data_spec()["path"] == "/home/u/mydata.npz"  # the record, as it was written
    data = config_from_spec(DataSpec.from_dict(run.data_spec()))
    assert (data.source, data.path) == ("digits", None)


@pytest.mark.parametrize(
    ("field", "name"),
    [
        ("file", "/etc/passwd"),
        ("file", "../outside.onnx"),
        ("file", "export/../../outside.onnx"),
        ("file_ckpt", "/tmp/qat.ckpt"),
    ],
)
def test_a_manifest_listing_a_file_outside_its_run_is_refused(
    tmp_path: Path, field: str, name: str
) -> None:
    # report and serve hashed and loaded it: a run names only its own files
    run = RunDir(tmp_path / "r")
    run.root.mkdir()
    run.manifest_path.write_text(
        json.dumps({"schema": 1, "artifacts": {"odd": {"file": "x.onnx", field: name}}})
    )
    with pytest.raises(RunError) as err:
        run.manifest()
    assert str(err.value) == (
        f"{run.manifest_path} is malformed (odd {field} {name!r} lies outside the run "
        f"directory): delete it and re-run the stages, from `make train RUN={run.root}`"
    )


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            99,
            "was written by a newer lightship (manifest schema 99; lightship "
            f"{__version__} reads schema 1): upgrade lightship to use this run",
        ),
        (0, "is malformed (schema 0, expected 1): delete it and re-run the stages, from"),
        ("1", "is malformed (schema '1', expected 1): delete it"),
        (True, "is malformed (schema True, expected 1): delete it"),
        (None, "is malformed (schema None, expected 1): delete it"),
    ],
)
def test_a_manifest_of_another_schema_is_refused(
    tmp_path: Path, schema: object, message: str
) -> None:
    run = RunDir(tmp_path)
    run.manifest_path.write_text(json.dumps({"schema": schema, "artifacts": {}}))
    with pytest.raises(RunError) as err:
        run.manifest()
    assert str(err.value).startswith(f"{run.manifest_path} {message}")


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ('{"schema": 1}', 'is malformed (expected {"artifacts": {name: {"file": ...}}})'),
        ('{"schema": 1, "artifacts"', "is unreadable (Expecting ':' delimiter"),
    ],
)
def test_a_manifest_without_its_artifacts_says_where_to_start_again(
    tmp_path: Path, text: str, what: str
) -> None:
    # no "artifacts" was a KeyError traceback in every stage; an unreadable one said to "re-run
    # the stages" without the first: resuming, which records the checkpoint and trains nothing
    run = RunDir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_text("")
    run.manifest_path.write_text(text)
    with pytest.raises(RunError) as err:
        run.artifact("checkpoint")
    assert str(err.value).startswith(f"{run.manifest_path} {what}")
    assert str(err.value).endswith(
        f": delete it and re-run the stages, from `make train RESUME=1 RUN={tmp_path}`"
    )


def _run_with_artifacts(root: Path) -> RunDir:
    """A run as train, export, quantize and report leave it (files are stand-ins)."""
    run = RunDir(root)
    files = {
        "best.ckpt": "ckpt",
        "checkpoints/last.ckpt": "last",
        "config.yaml": "seed: 0",
        "export/model.onnx": "fp32",
        "quantize/model.int8-qat.onnx": "int8",
        "quantize/qat.ckpt": "qat",
        "quantize/model.int8-static.onnx": "unlisted by a re-export",
        "report/report.json": '{"recommended": "onnx-int8-qat"}',
        "report/report.md": "| onnx-int8-qat |",
        "report/pareto.png": "png",
        "export/notes.txt": "the user's",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    run.record("checkpoint", {"file": "best.ckpt", "sha256": sha256_file(root / "best.ckpt")})
    run.record("onnx-fp32", {"file": "export/model.onnx"})
    run.record(
        "onnx-int8-qat", {"file": "quantize/model.int8-qat.onnx", "file_ckpt": "quantize/qat.ckpt"}
    )
    return run


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_discard_takes_the_files_and_the_report_with_the_artifacts(tmp_path: Path) -> None:
    run = _run_with_artifacts(tmp_path)
    assert run.discard("onnx-int8-static") == []  # not listed: nothing changes
    assert (tmp_path / "report" / "report.json").is_file()
    # a re-export discards the int8 models of the old model.onnx: serve must not follow a report
    # that recommends one of them, nor report.md and pareto.png show them
    assert run.discard("onnx-int8-qat") == ["onnx-int8-qat"]
    assert list(run.manifest()["artifacts"]) == ["checkpoint", "onnx-fp32"]
    assert not (tmp_path / "report").exists()  # emptied, so gone
    # both of its files go; the unlisted one stays (discard_derived's DERIVED_FILES take it)
    assert [p.name for p in (tmp_path / "quantize").iterdir()] == ["model.int8-static.onnx"]


def test_replacing_an_artifact_with_another_file_takes_the_report_with_it(tmp_path: Path) -> None:
    run = _run_with_artifacts(tmp_path)
    run.record("checkpoint", {"file": "best.ckpt", "sha256": sha256_file(tmp_path / "best.ckpt")})
    run.record("onnx-fp32", {"file": "export/model.onnx"})  # the same file, re-recorded
    run.record("onnx-int8-static", {"file": "quantize/model.int8-static.onnx"})  # a new one
    assert (tmp_path / "report" / "report.json").is_file()
    # a re-export wrote a different model.onnx: the report's figures are the old one's
    run.record("onnx-fp32", {"file": "export/model.onnx", "sha256": "0" * 64})
    assert not (tmp_path / "report").exists()
    assert run.artifact("onnx-fp32") == {"file": "export/model.onnx", "sha256": "0" * 64}


def test_the_same_file_judged_by_another_gate_takes_the_report_with_it(tmp_path: Path) -> None:
    # quantized again to the same bytes under --gate 1.001: the manifest said gate FAIL, the
    # report kept saying pass (and serve kept following it)
    run = _run_with_artifacts(tmp_path)
    entry = {"file": "quantize/model.int8-static.onnx", "sha256": "1" * 64}
    run.record("onnx-int8-static", {**entry, "gate": {"min_ratio": 0.99, "passed": True}})
    (tmp_path / "report").mkdir(exist_ok=True)
    (tmp_path / "report" / "report.json").write_text("{}")
    run.record("onnx-int8-static", {**entry, "gate": {"min_ratio": 0.99, "passed": True}})
    assert (tmp_path / "report" / "report.json").is_file()  # the same entry again: it stands
    run.record("onnx-int8-static", {**entry, "gate": {"min_ratio": 1.001, "passed": False}})
    assert not (tmp_path / "report").exists()


def test_discard_derived_leaves_only_the_checkpoint_on_disk_and_listed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.onnx"
    outside.write_text("not the run's")
    run = _run_with_artifacts(tmp_path / "r")
    (run.root / "logs").mkdir()  # empty before: not the discard's to remove
    (run.root / "model.int8-static.onnx").symlink_to(outside)  # a link out of the run
    run.record("odd", {"file": "model.int8-static.onnx"})
    assert run.discard_derived() == ["onnx-fp32", "onnx-int8-qat", "odd"]
    assert list(run.manifest()["artifacts"]) == ["checkpoint"]
    assert _files(run.root) == [
        "best.ckpt",
        "checkpoints/last.ckpt",
        "config.yaml",
        "export/notes.txt",
        "manifest.json",
    ]  # the link went, not what it points at: left, it stood unlisted where quantize writes
    # the folders it emptied go, not export/ with the user's file in it, nor empty logs/
    assert sorted(p.name for p in run.root.iterdir() if p.is_dir()) == [
        "checkpoints",
        "export",
        "logs",
    ]
    assert outside.is_file()  # never a file outside the run
    assert run.discard_derived() == []  # nothing left to discard


def test_discard_never_deletes_in_a_folder_linked_in_from_outside(tmp_path: Path) -> None:
    """A file inside the run's tree through a linked folder is another's: left, with the link."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "model.int8-static.onnx").write_text("someone's")
    run = RunDir(tmp_path / "r")
    run.root.mkdir()
    (run.root / "quantize").symlink_to(shared, target_is_directory=True)
    run.record("onnx-int8-static", {"file": "quantize/model.int8-static.onnx"})
    assert run.discard_derived() == ["onnx-int8-static"]
    assert (shared / "model.int8-static.onnx").read_text() == "someone's"
    assert (run.root / "quantize").is_symlink()


def test_a_checkpoint_that_cannot_be_written_raises_the_os_error(tmp_path: Path) -> None:
    # torch.save writing a file itself turns a full disk into RuntimeError("unexpected pos"),
    # which the CLI cannot tell from a bug; Python's own write raises the OSError it answers.
    import resource
    import signal

    import torch

    from lightship.callbacks import AtomicCheckpointIO

    final = tmp_path / "last.ckpt"
    final.write_bytes(b"the previous checkpoint")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file over the limit: EFBIG
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limit[1]))
        with pytest.raises(OSError) as err:
            AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(100_000)}, final)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    assert err.value.errno == errno.EFBIG and err.value.filename == str(final)
    assert final.read_bytes() == b"the previous checkpoint"  # never half-written
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary left


HOLD_LOCK = """
import os, signal, sys
from pathlib import Path
from lightship.runs import lock_run
with lock_run(Path(sys.argv[1]), "lightship quantize"):
    print("held", flush=True)
    sys.stdin.readline()  # until the test says
    os.kill(os.getpid(), signal.SIGKILL)  # dies holding it
"""


def _free(root: Path) -> bool:
    """Whether a new open file description of RUN/.lock can take the lock now."""
    fd = os.open(root / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_run_locked_by_another_process_is_refused_at_once_naming_it(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(RunBusyError) as err, lock_run(tmp_path, "lightship train"):
            pass
        assert str(err.value) == (
            f"{tmp_path} is in use by another lightship process (pid {holder.pid}, lightship "
            "quantize): wait for it to finish, or stop it"
        )
        # another user's holder, which locked the file read-only and could not write it: the
        # file names the process before, and the kernel's list the one that holds it
        (tmp_path / ".lock").write_text(json.dumps({"pid": 1, "command": "lightship x"}))
        with pytest.raises(RunBusyError) as err, lock_run(tmp_path, "lightship train"):
            pass
        assert f"(pid {holder.pid}, {sys.executable} -c " in str(err.value)
        assert "lightship x" not in str(err.value)
    finally:
        holder.communicate("go\n", timeout=30)
    assert holder.returncode == -signal.SIGKILL
    # the OS released the lock of the process that died holding it
    with lock_run(tmp_path, "lightship train"):
        assert json.loads((tmp_path / ".lock").read_text())["command"] == "lightship train"


FORK_HOLDING = """
import os, sys, time
from pathlib import Path
from lightship.runs import lock_run
with lock_run(Path(sys.argv[1]), "lightship x"):
    child = os.fork()
    if child == 0:  # a DataLoader worker: holds the lock's file on after its parent
        os.close(1)
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    os._exit(0)
"""


def test_a_lock_held_on_by_the_child_of_a_process_gone_names_that_process(
    tmp_path: Path,
) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", FORK_HOLDING, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        assert parent.wait(timeout=30) == 0
        with pytest.raises(RunBusyError) as err, lock_run(tmp_path, "lightship train"):
            pass
        assert f"(pid {parent.pid}, lightship x, now exiting): wait for it" in str(err.value)
    finally:
        os.kill(child, signal.SIGKILL)


def test_the_lock_is_reentrant_and_released_on_the_way_out(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("{}")  # a run: its lock file stays
    with pytest.raises(RuntimeError), lock_run(tmp_path, "lightship quantize"):
        with lock_run(tmp_path, "lightship report"):  # quantize writing the report
            assert not _free(tmp_path)
        assert not _free(tmp_path)  # the outer holder still has it
        raise RuntimeError("a stage crashed")
    assert _free(tmp_path)


def test_another_thread_of_the_process_is_refused_as_another_process_is(
    tmp_path: Path,
) -> None:
    # the re-entry meant for a stage running another went to any thread: a report in one
    # thread measured a .pt2 an export in another was writing
    errors: list[BaseException] = []

    def report_meanwhile() -> None:
        try:
            with lock_run(tmp_path, "lightship report"):
                pass
        except RunBusyError as exc:
            errors.append(exc)

    with lock_run(tmp_path, "lightship export"):
        other = threading.Thread(target=report_meanwhile)
        other.start()
        other.join(30)
        with lock_run(tmp_path, "lightship quantize"):  # this thread's own stage: re-entered
            pass
    assert [str(e) for e in errors] == [
        f"{tmp_path} is in use by another thread of this process (lightship export): wait for "
        "it to finish"
    ]
    other = threading.Thread(target=report_meanwhile)  # released: the other thread takes it
    other.start()
    other.join(30)
    assert len(errors) == 1


def test_taking_the_lock_deletes_what_a_killed_stage_left_and_nothing_else(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    # as tempfile names them: a prefix, 8 random characters of [a-z0-9_], a suffix
    scratch = [run / ".quantize.k1ll3d_0", run / ".qat.k1ll3d_0"]  # `Quantizer.work`, QAT's
    temporaries = [run / ".manifest.a1b2c3d4.tmp.json", run / "export" / ".model.k2x_9abc.tmp.onnx"]
    users = [run / ".quantize.notes", elsewhere]  # folders of names alike; a link's target
    users_files = [run / ".qat.k1ll3d_0.bak", run / ".draft.tmp.md", run / "export" / "a.tmp.txt"]
    for folder in [*scratch, *users, run / "export"]:
        folder.mkdir(parents=True)
    for path in [*temporaries, *users_files, scratch[0] / "pre.onnx", elsewhere / "data.npz"]:
        path.write_bytes(b"x")
    link = run / ".quantize.1inked_0"
    link.symlink_to(elsewhere, target_is_directory=True)

    with caplog.at_level(logging.INFO, "lightship.runs"), lock_run(run, "lightship export"):
        assert [p for p in [*scratch, *temporaries] if p.exists()] == []
        kept = [*users, *users_files, link, elsewhere / "data.npz"]
        assert [p for p in kept if not p.exists()] == []
        # a stage run in-process by this one takes the lock again: nothing of a live stage goes
        (run / ".quantize.l1ve0000").mkdir()
        with lock_run(run, "lightship quantize"):
            assert (run / ".quantize.l1ve0000").is_dir()
    assert f"removing {scratch[0]}, left by a lightship stage that was killed" in caplog.messages


def test_a_new_run_made_for_the_lock_goes_again_when_nothing_else_went_in(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "new"
    with lock_run(run, "lightship train", create=True):
        assert (run / ".lock").is_file()  # a config error, say: nothing written
    assert not (tmp_path / "runs").exists()
    with lock_run(run, "lightship train", create=True):
        (run / "config.yaml").write_text("")
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.yaml"]


def test_a_folder_left_with_nothing_but_the_lock_loses_it(tmp_path: Path) -> None:
    # `lightship export --run` given an empty folder that is no run: no .lock left in it
    with pytest.raises(RunError), lock_run(tmp_path, "lightship export"):
        raise RunError(f"no best.ckpt in {tmp_path}")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "manifest.json").write_text("{}")  # a run keeps it: a file like its others
    with lock_run(tmp_path, "lightship export"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "manifest.json"]


def test_a_lock_file_removed_before_it_was_locked_is_locked_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # its holder removed it on the way out just after this process opened it: the lock taken
    # must be on the file now there, which another process would open, not on the removed one
    real_open = os.open
    removed: list[str] = []

    def open_then_removed(path: Path, *args: int) -> int:
        fd = real_open(path, *args)
        if Path(path).name == ".lock" and not removed:
            os.unlink(path)
            removed.append(str(path))
        return fd

    monkeypatch.setattr(runs.os, "open", open_then_removed)
    with lock_run(tmp_path, "lightship export"):
        monkeypatch.undo()
        assert removed and not _free(tmp_path)


def test_no_lock_where_none_can_be_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a read-only run: reading needs no lock, and a writing stage's own check says what is wrong
    real_open = os.open

    def refuse(path: Path, *args: int) -> int:
        if Path(path).name == ".lock":
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args)

    with lock_run(tmp_path / "missing", "lightship export"):
        pass
    assert not (tmp_path / "missing").exists()
    monkeypatch.setattr(runs.os, "open", refuse)
    with lock_run(tmp_path, "lightship report"):
        pass
    assert not (tmp_path / ".lock").exists()


def test_ddp_workers_leave_the_lock_to_rank_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lightning re-runs `lightship train` for each worker while rank 0 holds the lock
    holder = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("LOCAL_RANK", "1")
        with lock_run(tmp_path, "lightship train"):
            pass
        monkeypatch.setenv("LOCAL_RANK", "0")
        with pytest.raises(RunBusyError), lock_run(tmp_path, "lightship train"):
            pass
        # a RANK of another use, with no rendezvous to join: no worker, so it locks
        monkeypatch.delenv("MASTER_ADDR")
        monkeypatch.setenv("RANK", "3")
        with pytest.raises(RunBusyError), lock_run(tmp_path, "lightship quantize"):
            pass
    finally:
        os.close(holder)


def test_a_lock_file_that_is_a_symbolic_link_is_not_written_through(tmp_path: Path) -> None:
    """The pid written into RUN/.lock went into whatever file the link named, truncated."""
    run, theirs = tmp_path / "run", tmp_path / "notes.txt"
    run.mkdir()
    theirs.write_text("a user's file")
    (run / ".lock").symlink_to(theirs)
    with pytest.raises(RunError) as err, lock_run(run, "lightship quantize"):
        pass
    assert str(err.value) == (
        f"{run / '.lock'} is a symbolic link, which lightship will not write through: "
        f"remove it (`rm {run / '.lock'}`; each stage makes its own)"
    )
    assert theirs.read_text() == "a user's file"


ROOT = Path(__file__).resolve().parents[2]


def test_next_names_no_stage_the_running_make_runs_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `make quantize` writes the report after quantize: "next: make report" would tell the user
    # to run what make is about to run (the Makefile sets the variable)
    run = Path("runs/x")
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv(runs.MAKE_GOALS, "quantize report")
    assert runs.next_command("report", run) == "report, which make runs now"
    assert runs.next_command("serve", run).startswith("make serve RUN=runs/x")
    monkeypatch.setenv(runs.MAKE_GOALS, "reports")  # a word, not a part of one
    assert runs.next_command("report", run).startswith("make report RUN=runs/x")


def test_make_run_from_another_folder_is_named_with_its_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `make -C CHECKOUT export` from elsewhere printed `next: make quantize RUN=runs/x`, which
    # finds no Makefile there (the Makefile sets MAKE_FROM to the folder make was run from)
    run = Path("runs/x")
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv(runs.MAKE_FROM, str(tmp_path))
    checkout = shlex.quote(str(ROOT))
    assert runs.next_command("quantize", run) == f"make -C {checkout} quantize RUN=runs/x"
    assert runs.RunDir(run).command("export", "quantize") == (
        f"`make -C {checkout} export quantize RUN=runs/x`"
    )
    assert runs.stage_on(run, "export", "PYTHONPATH=mm ") == (
        f"PYTHONPATH=mm make -C {checkout} export RUN=runs/x"
    )
    monkeypatch.setenv(runs.MAKE_FROM, str(ROOT))  # make run from the checkout itself
    assert runs.next_command("quantize", run).startswith("make quantize RUN=runs/x   (or `")


def test_commands_in_messages_run_from_where_the_user_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # outside lightship's checkout `make export` is no target (and `make export RUN=../x` run
    # from the checkout would train a new model in another folder): the lightship command
    run = RunDir(Path("runs/no-such-run-here"))
    monkeypatch.chdir(ROOT)
    assert runs.next_command("export", run.root) == (
        f"make export RUN={run.root}   (or `lightship export --run {run.root}`)"
    )
    assert run.train_command() == f"`make train RUN={run.root}`"
    assert run.command("report") == f"`make report RUN={run.root}`"

    monkeypatch.chdir(tmp_path)
    assert runs.next_command("export", run.root, "PYTHONPATH=mm ") == (
        f"PYTHONPATH=mm lightship export --run {run.root}"
    )
    assert run.command("report") == f"`lightship report --run {run.root}`"
    assert run.train_command() == f"`lightship train --run {run.root}`"
    run.root.mkdir(parents=True)
    run.config.write_text("")
    assert run.train_command() == (
        f"`lightship train --run {run.root} --config {run.root}/config.yaml`"
    )
    run.checkpoints.mkdir()
    run.last_ckpt.write_text("")
    assert run.train_command() == f"`lightship train --run {run.root} --resume`"
    assert run.remake_command("checkpoint") == run.remake_command("eager") == run.train_command()
    assert RunDir(Path("my run")).command("export") == "`lightship export --run 'my run'`"
    spaced = RunDir(Path("my run"))  # a path a shell splits is quoted in every command
    assert spaced.remake_command("onnx-fp32") == "`lightship export --run 'my run' --formats onnx`"
    assert spaced.remake_command("onnx-int8-qat") == (
        "`lightship quantize --run 'my run' --methods qat`"
    )


def test_what_went_of_a_run_is_made_again_by_name_and_the_report_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a resume that kept some exports said `make export quantize`, which made the kept ones again
    run = RunDir(Path("runs/r"))
    flags = run.remake_flags(["pt2", "onnx-int8-qat", "onnx-fp32", "onnx-int8-dynamic"])
    assert flags == {
        "export": "--formats pt2,onnx",
        "quantize": "--methods qat,dynamic",
        "report": "",
    }
    assert list(flags) == ["export", "quantize", "report"]  # the stages' order
    assert run.remake_flags(["onnx-int8-static"]) == {"quantize": "--methods static", "report": ""}
    assert run.remake_flags(["torchscript", "notes"]) is None  # no stage makes it by name
    monkeypatch.chdir(ROOT)  # one make call; make's quantize writes the report
    assert run.command(*flags, flags=flags) == (
        "`make export quantize RUN=runs/r EXPORT_ARGS='--formats pt2,onnx' "
        "QUANTIZE_ARGS='--methods qat,dynamic'`"
    )
    assert runs.next_command("export", run.root, "", flags["export"]) == (
        "make export RUN=runs/r EXPORT_ARGS='--formats pt2,onnx'   "
        "(or `lightship export --run runs/r --formats pt2,onnx`)"
    )
    monkeypatch.chdir(tmp_path)  # a lightship command each
    assert run.command(*flags, flags=flags) == (
        "`lightship export --run runs/r --formats pt2,onnx`, then "
        "`lightship quantize --run runs/r --methods qat,dynamic`, then "
        "`lightship report --run runs/r`"
    )


def test_the_stages_take_a_run_as_its_path_too(tmp_path: Path) -> None:
    # a script passing "runs/x" got AttributeError: 'str' object has no attribute 'root'
    from lightship.export.core import export
    from lightship.quantize.core import quantize
    from lightship.report import report

    missing = tmp_path / "missing"
    for stage in (export, quantize, report):
        for given in (str(missing), missing):
            with pytest.raises(RunError, match=str(missing)):
                stage(given)
    assert not missing.exists()


def test_ctrl_c_out_of_a_stage_called_from_python_carries_how_to_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI prints a stage's note as its last line; called from Python (a notebook), the
    KeyboardInterrupt's traceback ends with it. A note left by an earlier stage of the same
    process is not the next one's."""
    monkeypatch.setattr(runs, "_interrupt_note", [])
    with pytest.raises(KeyboardInterrupt) as stopped, lock_run(tmp_path, "lightship train"):
        runs.note_interrupt("resume with `lightship train --run x --resume`")
        raise KeyboardInterrupt
    assert stopped.value.__notes__ == [
        "interrupted: resume with `lightship train --run x --resume`"
    ]
    with pytest.raises(KeyboardInterrupt) as stopped, lock_run(tmp_path, "lightship export"):
        raise KeyboardInterrupt  # stopped before it knew what to say
    assert not hasattr(stopped.value, "__notes__")
    assert interrupt_message() == "interrupted"


def test_a_runs_own_folder_given_as_a_run_names_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`quantize --run R/export` said to train R/export, and `train --run R/checkpoints`
    trained a whole run among R's checkpoints."""
    from lightship.serve.model import choose
    from lightship.serve.settings import ServeSettings

    run = tmp_path / "r1"
    for folder in ("checkpoints", "export"):
        (run / folder).mkdir(parents=True)
    (run / "manifest.json").write_text('{"schema": 1, "artifacts": {}}')
    parse = runs.run_dir_parser("--run")
    for folder in ("checkpoints", "export"):
        with pytest.raises(RunError) as err:
            parse(str(run / folder))
        assert str(err.value) == (
            f"--run takes a run directory: {run / folder} is run {run}'s {folder} folder; give "
            f"--run {run}"
        )
    with pytest.raises(RunError, match=f"is run {run}'s export folder: give --run .LIGHTSHIP"):
        choose(ServeSettings(run=run / "export"))
    # one not made yet, and `.` from inside one (said relative, as given)
    with pytest.raises(RunError, match=f"is run {run}'s report folder; give --run {run}$"):
        parse(str(run / "report"))
    monkeypatch.chdir(run / "export")
    with pytest.raises(RunError, match=r"\. is run \.\.'s export folder; give --run \.\.$"):
        parse(".")
    # a run named so in a folder of runs, and one of a run's folders that is a run itself
    (tmp_path / "export").mkdir()
    assert parse(str(tmp_path / "export")) == tmp_path / "export"
    (run / "export" / "checkpoints").mkdir()
    assert parse(str(run / "export")) == run / "export"
    # a project folder with an empty checkpoints/ is no run: its logs/ may be one
    project = tmp_path / "project"
    (project / "checkpoints").mkdir(parents=True)
    assert parse(str(project / "logs")) == project / "logs"


def test_a_run_given_with_a_tilde_is_the_home_folders(monkeypatch: pytest.MonkeyPatch) -> None:
    # `--run=~/x`: bash expands no ~ after `=`, and a folder named `~` was made in the cwd
    monkeypatch.setenv("HOME", "/home/someone")
    assert runs.run_path("~/runs/a") == Path("/home/someone/runs/a")
    assert runs.run_dir_parser("--run")("~/runs/a") == Path("/home/someone/runs/a")
    assert runs.run_path("runs/~a") == Path("runs/~a")
    # a user with no home: as written (a traceback, "Could not determine home directory")
    assert runs.run_path("~nosuchuser-x/a") == Path("~nosuchuser-x/a")
    # LIGHTSHIP_RUN=~/x in an env file, as --run
    from lightship.serve.settings import ServeSettings

    monkeypatch.setenv("LIGHTSHIP_RUN", "~/runs/a")
    assert ServeSettings().run == Path("/home/someone/runs/a")


def test_a_run_inside_the_image_folder_it_trains_on_is_refused(tmp_path: Path) -> None:
    """Its checkpoints/ and logs/ went among the class folders: the next training refused the
    data, "2 of 12 classes have no images ('checkpoints', 'logs')"."""
    from lightship.config import load_config
    from lightship.errors import ConfigError
    from lightship.runs import RunDir
    from lightship.train.fit import _check_run_outside_data

    images = tmp_path / "imgs"
    (images / "cat").mkdir(parents=True)
    cfg = load_config(None, ["data.source=folder", f"data.path={images}"])
    for run in (images, images / "run"):
        with pytest.raises(ConfigError, match="lies in the image folder it would train on") as e:
            _check_run_outside_data(cfg, RunDir(run))
        # both runs it suggests are taken (`--run runs/NAME` from inside the data was not)
        outside, hidden = re.findall(r"--run (\S+?)\)?(?: |$)", str(e.value))
        assert Path(outside) == tmp_path / "runs" / run.name
        assert Path(hidden) == images / ".runs" / run.name
        for suggested in (outside, hidden):
            _check_run_outside_data(cfg, RunDir(Path(suggested)))
    # a path with a space, quoted for the shell that runs the suggestion
    spaced = tmp_path / "my photos"
    (spaced / "cat").mkdir(parents=True)
    cfg = load_config(None, ["data.source=folder", f"data.path={spaced}"])
    with pytest.raises(ConfigError) as e:
        _check_run_outside_data(cfg, RunDir(spaced / "r1"))
    said = str(e.value)
    for suggested in (tmp_path / "runs" / "r1", spaced / ".runs" / "r1"):
        assert f"--run {shlex.quote(str(suggested))}" in said
    _check_run_outside_data(cfg, RunDir(tmp_path / "runs" / "a"))  # beside it: fine
    _check_run_outside_data(cfg, RunDir(images / ".runs" / "a"))  # hidden: the loader skips it
    _check_run_outside_data(cfg, RunDir(tmp_path))  # the data inside the run: fine


def test_a_lock_file_this_user_cannot_write_still_locks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's .lock (0644) in a shared run: it could not be opened for writing, and the
    stage ran unlocked, beside another that read and wrote the same manifest."""
    run = tmp_path / "run"
    run.mkdir()
    (run / runs.LOCK_FILE).write_text("")
    opened = os.open

    def not_for_writing(path: Any, flags: int, *args: Any) -> int:
        if str(path).endswith(runs.LOCK_FILE) and flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(13, "Permission denied", str(path))
        return opened(path, flags, *args)

    monkeypatch.setattr(runs.os, "open", not_for_writing)
    with runs.lock_run(run, "lightship export"):
        other = opened(run / runs.LOCK_FILE, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)


def test_a_full_disk_in_an_atomic_write_names_the_file_being_made(tmp_path: Path) -> None:
    """A write to an open file raises ENOSPC without a file name: the CLI said "no space left
    on the device writing a file" for best.ckpt, a quantized model or the report."""
    target = tmp_path / "best.ckpt"
    with pytest.raises(OSError) as err, atomic_path(target):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert err.value.filename == str(target)
    # the report's three files: their folder
    pair = (tmp_path / "report" / "report.md", tmp_path / "report" / "report.json")
    with pytest.raises(OSError) as err, atomic_paths(*pair):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    assert err.value.filename == str(tmp_path / "report")
    # a name the error has already (an inner write's) is kept, as is any other error's
    with pytest.raises(OSError) as err, atomic_path(target):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "manifest.json"))
    assert err.value.filename == str(tmp_path / "manifest.json")
    with pytest.raises(OSError) as err, atomic_path(target):
        raise OSError(errno.EIO, "Input/output error")
    assert err.value.filename is None


def test_a_run_directory_named_by_a_string_is_a_path() -> None:
    # RunDir("runs/x") from Python: fit() failed with "'str' object has no attribute 'resolve'"
    run = RunDir("runs/x")  # type: ignore[arg-type]
    assert run.root == Path("runs/x") and run == RunDir(Path("runs/x"))
    assert run.config == Path("runs/x/config.yaml")
