"""Bad options and unwritable paths end in one `error:` line and a non-zero exit (seconds)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightship import cli, runs
from lightship.errors import ConfigError, LightshipError, RunBusyError, RunError
from tests.conftest import (
    CONFIGS,
    ROOT,
    last_line,
    rerecord_checkpoint,
    run_cli,
    swap_checkpoint,
)


@pytest.mark.parametrize(("value", "shown"), [(".inf", "inf"), (".nan", "nan"), ("-.inf", "-inf")])
def test_config_rejects_non_finite_floats(value: str, shown: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_cli("train", "--run", str(run), "--set", f"optim.lr={value}")
    assert proc.returncode == 2
    assert last_line(proc.stderr) == (
        f"error: --set: 'optim.lr' = {shown}: Input should be a finite number; "
        "fix it with --set optim.lr=..."
    )
    assert not run.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--qat-epochs", "0"], "quantize --qat-epochs must be at least 1, got 0"),
        (["--qat-lr", "-1"], "quantize --qat-lr must be a finite number > 0 (e.g. 1e-4), got -1.0"),
        (["--qat-lr", "nan"], "quantize --qat-lr must be a finite number > 0 (e.g. 1e-4), got nan"),
        (
            ["--gate", "nan"],
            "quantize --gate is the fraction of fp32 accuracy an int8 variant keeps, in (0, 1.1] (e.g. 0.99), got nan",
        ),
        (
            ["--gate", "-1"],
            "quantize --gate is the fraction of fp32 accuracy an int8 variant keeps, in (0, 1.1] (e.g. 0.99), got -1",
        ),
        (
            ["--gate", "0"],
            "quantize --gate is the fraction of fp32 accuracy an int8 variant keeps, in (0, 1.1] (e.g. 0.99), got 0",
        ),
        (
            ["--gate", "inf"],
            "quantize --gate is the fraction of fp32 accuracy an int8 variant keeps, in (0, 1.1] (e.g. 0.99), got inf",
        ),
        (
            ["--gate", "5"],
            "quantize --gate is the fraction of fp32 accuracy an int8 variant keeps, in (0, 1.1] (e.g. 0.99), got 5: did you mean 0.95?",
        ),
        (  # a percentage kept, not 99 points lost (that guess was 0.01)
            ["--gate", "99"],
            "quantize --gate is the fraction of fp32 accuracy an int8 variant keeps, in (0, 1.1] (e.g. 0.99), got 99: did you mean 0.99?",
        ),
        (
            ["--gate", "1.5"],
            "quantize --gate is the fraction of fp32 accuracy an int8 variant keeps, in (0, 1.1] (e.g. 0.99), got 1.5: did you mean 0.985?",
        ),
        (["--fallback-budget", "-1"], "quantize --fallback-budget must be at least 0, got -1"),
    ],
)
def test_bad_quantize_options_exit_with_one_line(
    args: list[str], message: str, tmp_path: Path
) -> None:
    run = tmp_path / "run"  # checked before the run is even looked at
    proc = run_cli("quantize", "--run", str(run), "--methods", "qat", *args)
    assert proc.returncode == 2 and last_line(proc.stderr) == f"error: {message}"
    assert not run.exists()


def test_a_swapped_checkpoint_stops_qat_before_any_method(
    exported_run: Path, tmp_path: Path
) -> None:
    """QAT found a best.ckpt other than the one trained only after the other methods: a
    warning and exit 0, which make took for done. (Every method failing is exit 6: test_qat.)"""
    run = tmp_path / "swapped"
    shutil.copytree(exported_run, run)
    swap_checkpoint(run)
    differs = (
        f"error: {run / 'best.ckpt'} differs from its manifest entry (sha256): it is not the "
        f"checkpoint `lightship train` wrote for this run; train it again (`make train "
        f"RESUME=1 RUN={run}`), or quantize the run that made it"
    )
    proc = run_cli("quantize", "--run", str(run), "--methods", "qat")
    assert proc.returncode == 4, proc.stderr
    assert last_line(proc.stderr) == differs
    proc = run_cli("quantize", "--run", str(run), "--methods", "dynamic,qat")
    assert proc.returncode == 4, proc.stderr
    assert last_line(proc.stderr) == f"{differs}, or quantize without QAT: --methods dynamic"
    assert "next:" not in proc.stdout
    manifest = json.loads((run / "manifest.json").read_text())["artifacts"]
    assert "onnx-int8-dynamic" not in manifest and not (run / "quantize").exists()


def quantized_run(tmp_path: Path) -> tuple[runs.RunDir, dict[str, Any]]:
    """A run with a checkpoint entry of 269 test images, and the entry fields quantize's
    summary reads of each variant it made (a Xeon with VNNI, quantized for avx2)."""
    run = runs.RunDir(tmp_path / "run")
    run.root.mkdir()
    run.record("checkpoint", {"file": "best.ckpt", "test_samples": 269})
    cpu = {"model": "Xeon", "arch": "x86_64", "int8_flags": ["avx2", "avx512_vnni"]}
    return run, {"cpu": cpu, "fp32_accuracy": 0.9963, "target": "avx2"}


def test_quantize_names_the_cpu_and_the_split_its_accuracy_is_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightship.quantize import core as quantize_core

    run, entry = quantized_run(tmp_path)
    made = quantize_core.Variant("static", run.root / "m.onnx", 0.9926, True, entry)
    monkeypatch.setattr(quantize_core, "quantize", lambda *args, **kwargs: [made])
    cli.quantize(run=run.root)
    lines = capsys.readouterr().out.splitlines()
    # the CPU quantize measured on, not only the scheme it asked for
    assert lines[0] == "CPU: Xeon (x86_64; avx2 avx512_vnni); accuracy on 269 test images"
    assert lines[1] == (
        f"int8-static   {run.root / 'm.onnx'}  test accuracy 0.9926 (fp32 0.9963, gate pass), "
        "quantized for target avx2"
    )


def test_quantize_warns_of_a_variant_mostly_left_in_float(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # QAT of a MobileNet-like model: 1 of 8 convs int8, 0.27x ONNX fp32, and no word of it
    from lightship.quantize import core as quantize_core

    run, entry = quantized_run(tmp_path)
    made = [
        quantize_core.Variant(method, run.root / f"{method}.onnx", 0.99, True, {**entry, **ops})
        for method, ops in [
            ("static", {"int8_ops": {"int8_nodes": 4, "float_nodes": 1}}),  # first conv fp32
            ("dynamic", {"int8_ops": {"int8_nodes": 4, "float_nodes": 4}}),  # half: no warning
            ("qat", {"int8_ops": {"int8_nodes": 1, "float_nodes": 7}}),
        ]
    ]
    monkeypatch.setattr(quantize_core, "quantize", lambda *args, **kwargs: made)
    cli.quantize(run=run.root)
    assert capsys.readouterr().err == (
        "warning: int8-qat runs 1 of its 8 Conv/MatMul/Gemm nodes in int8 (onnxruntime keeps "
        "the others in float): expect little speed-up over fp32, or none; `lightship report` "
        "times it\n"
    )


@pytest.mark.parametrize("recorded", [True, False])
def test_qat_refuses_a_checkpoint_the_export_was_not_made_from(
    exported_run: Path, tmp_path: Path, recorded: bool
) -> None:
    run = tmp_path / "swapped"
    shutil.copytree(exported_run, run)
    swap_checkpoint(run)
    if recorded:  # a checkpoint train wrote since the export: export it
        rerecord_checkpoint(run)
    proc = run_cli("quantize", "--run", str(run), "--methods", "qat")
    if recorded:  # before any method: model.onnx's accuracy is not the run's model's
        assert proc.returncode == 4, proc.stderr
        assert last_line(proc.stderr) == (
            f"error: {run / 'export' / 'model.onnx'} was exported from another checkpoint than "
            f"the run's best.ckpt: re-run `make export RUN={run}`"
        )
    else:  # one copied in or damaged: export refuses it too, so that was no fix; as export says
        assert proc.returncode == 4, proc.stderr
        assert last_line(proc.stderr) == (
            f"error: {run / 'best.ckpt'} differs from its manifest entry (sha256): it is not "
            "the checkpoint `lightship train` wrote for this run; train it again "
            f"(`make train RESUME=1 RUN={run}`), or quantize the run that made it"
        )
    assert not (run / "quantize" / "model.int8-qat.onnx").exists()


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_bench_train_needs_a_step(steps: str, tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    proc = run_cli("bench", "train", "--steps", steps, "--out", str(out))
    assert proc.returncode == 2
    assert last_line(proc.stderr) == f"error: bench train --steps must be at least 1, got {steps}"
    assert not out.exists()


@pytest.mark.parametrize(
    "exc",
    [
        PermissionError(13, "Permission denied", "runs/x/export/model.onnx"),
        IsADirectoryError(21, "Is a directory", "runs/x/.model.tmp.onnx", None, "runs/x/m.onnx"),
        NotADirectoryError(20, "Not a directory", "runs/x/export"),
        FileExistsError(17, "File exists", "runs/x/export"),
    ],
)
def test_unwritable_paths_are_one_line(
    exc: OSError, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def invoke() -> int:
        raise exc

    monkeypatch.setattr(cli, "_invoke", invoke)
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 1
    name = exc.filename2 or exc.filename
    who = f" to uid {os.getuid()}" if isinstance(exc, PermissionError) else ""
    assert capsys.readouterr().err == (
        f"error: cannot write/read {name}: {exc.strerror}{who}: check the path and its "
        "permissions\n"
    )


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (
            OSError(errno.ENOSPC, "No space left on device", "runs/x/report/.pareto.tmp.png"),
            "error: no space left on the device writing runs/x/report/.pareto.tmp.png: "
            "make room and run again\n",
        ),
        (  # what a write past `ulimit -f` raises (Python ignores SIGXFSZ)
            OSError(errno.EFBIG, "File too large", "runs/x/checkpoints/.last.ckpt.tmp"),
            "error: writing runs/x/checkpoints/.last.ckpt.tmp went past the largest file this "
            "process may write: raise the limit (`ulimit -f unlimited`) and run again\n",
        ),
    ],
    ids=["full disk", "file size limit"],
)
def test_a_disk_that_takes_no_more_is_one_line(
    error: OSError,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _said_failing_with(error, monkeypatch, capsys) == message


def _said_failing_with(
    error: BaseException, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> str:
    """What the CLI prints on stderr when its command raises `error`, having exited 1."""

    def invoke() -> int:
        raise error

    monkeypatch.setattr(cli, "_invoke", invoke)
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 1
    return capsys.readouterr().err


@pytest.mark.usefixtures("signal_handlers")
def test_any_error_after_a_stop_signal_is_the_stop(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Ctrl-C while dynamo imported sympy: the next import of it raised AttributeError over the
    # KeyboardInterrupt, and export exited 1 with a 125-line traceback
    def invoke() -> int:
        runs.note_interrupt("export again with `lightship export --run r`")
        with contextlib.suppress(KeyboardInterrupt):  # raised in an import it left half done
            os.kill(os.getpid(), signal.SIGINT)
        raise AttributeError("module 'sympy' has no attribute 'core'")

    monkeypatch.setattr(cli, "_invoke", invoke)
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 130
    assert capsys.readouterr().err == (
        "interrupted: export again with `lightship export --run r`\n"
    )


def test_an_error_without_a_stop_signal_keeps_its_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def invoke() -> int:
        raise AttributeError("a bug")

    monkeypatch.setattr(cli, "_invoke", invoke)
    with pytest.raises(AttributeError, match="a bug"):
        cli.main()


def test_other_os_errors_keep_their_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def invoke() -> int:
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(cli, "_invoke", invoke)
    with pytest.raises(ConnectionResetError):
        cli.main()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["report", "--bogus"], "No such option: --bogus (Possible options: --rounds)"),
        (
            ["report", "--rounds", "x"],
            "Invalid value for '--rounds': Input should be a valid integer, "
            "unable to parse string as an integer",
        ),
        (["nosuch"], "No such command 'nosuch'"),
        # the README's `lightship --verbose export`, typed after the command: click's hint was
        # "(Possible options: --opset)"
        (
            ["export", "--verbose", "--run", "r"],
            "No such option: --verbose: it goes before the command, `lightship --verbose export "
            "...`",
        ),
        (["quantize", "-v"], "No such option: -v: it goes before the command, `lightship -v q"),
        # an option without its value: its fix named `lightship --help`
        (["quantize", "--gate"], "Option '--gate' requires an argument"),
        (["bench", "serve", "--out"], "Option '--out' requires an argument"),
    ],
)
def test_usage_errors_are_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli._invoke(argv) == 2
    where = "lightship" if argv == ["nosuch"] else f"lightship {argv[0]}"
    where += " serve" if argv[0] == "bench" else ""
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.endswith(f"; see `{where} --help`\n")
    assert err.count("\n") == 1


def test_help_still_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli._invoke(["report", "--help"]) == 0
    assert "--rounds" in capsys.readouterr().out
    assert cli._invoke(["report", "-h"]) == 0  # as most command lines take it
    assert "--rounds" in capsys.readouterr().out


def test_version_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    from lightship import __version__

    assert cli._invoke(["--version"]) == 0
    assert capsys.readouterr().out == f"lightship {__version__}\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--run", ""],
        ["export", "--run", " "],
        ["quantize", "--run", ""],
        ["report", "-r", ""],
        ["serve", "--run", ""],
        ["bench", "serve", "--digits-run", ""],
    ],
)
def test_empty_run_directory_is_refused(argv: list[str]) -> None:
    # Path("") is the current folder: a run would be written (or looked for) there.
    with pytest.raises(RunError, match="^a run directory cannot be empty: give one, e.g. --run"):
        cli._invoke(argv)


@pytest.mark.parametrize("stage", ["train", "export", "quantize", "report"])
def test_a_run_directory_named_in_bytes_that_are_no_utf8_is_refused_by_name(stage: str) -> None:
    # `--run $'runs/r\xff'`: Python decodes the byte to a lone surrogate, which TensorBoard's
    # writer then failed to encode, a traceback after the data had loaded
    with pytest.raises(RunError) as err:
        cli._invoke([stage, "--run", "runs/r\udcff"])
    assert str(err.value) == (
        "run directory runs/r\\xff is not UTF-8 text: TensorBoard's logs and manifest.json keep "
        "its path as UTF-8; name it in UTF-8, e.g. --run runs/default"
    )


def test_bench_train_checks_out_before_measuring(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "train.json"
    proc = run_cli("bench", "train", "--steps", "1", "--out", str(out))
    assert proc.returncode == 4
    assert last_line(proc.stderr) == (
        f"error: cannot write {out}: {out.parent} is a file, not a folder: move it away and "
        "run again"
    )
    assert "float32" not in proc.stderr + proc.stdout  # no benchmark row was measured


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["report"],
            "no trained run in runs/default: run `lightship train --run runs/default`, then "
            "`lightship export --run runs/default`",
        ),
        (
            ["export"],
            "run directory runs/default does not exist: run `lightship train --run runs/default`",
        ),
    ],
)
def test_the_default_run_directory_is_used(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # outside lightship's checkout the fix is the lightship command: make has no such target
    monkeypatch.chdir(tmp_path)  # no runs/ here
    with pytest.raises(RunError) as err:
        cli._invoke(argv)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    ("variant", "why"),
    [
        ("eager", ": the report's eager row, best.ckpt, is --variant checkpoint"),
        ("onnx", ""),
    ],
)
def test_serve_names_the_variants_it_has_for_an_unknown_one(
    variant: str, why: str, tmp_path: Path
) -> None:
    # `--variant eager` said to run `make export`, which never makes a variant of that name
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": 1, "artifacts": {}}))
    with pytest.raises(ConfigError) as err:
        cli._invoke(["serve", "--run", str(tmp_path), "--variant", variant])
    assert str(err.value) == (
        f"unknown --variant '{variant}'{why}; choose from auto, onnx-fp32, onnx-int8-static, "
        "onnx-int8-dynamic, onnx-int8-qat, torchscript, pt2, checkpoint"
    )


@pytest.mark.parametrize("command", ["train", "export", "quantize", "report"])
def test_a_file_given_as_run_names_its_run(command: str, tmp_path: Path) -> None:
    run = tmp_path / "r1"
    (run / "export").mkdir(parents=True)
    (run / "manifest.json").write_text("{}")
    (run / "export" / "model.onnx").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(RunError) as err:
        cli._invoke([command, "--run", str(run / "export" / "model.onnx")])
    assert str(err.value) == (
        f"--run takes a run directory, not a file ({run}/export/model.onnx): give --run {run}"
    )
    with pytest.raises(RunError) as err:
        cli._invoke([command, "--run", str(tmp_path / "notes.txt")])
    assert str(err.value) == (
        f"--run takes a run directory, not a file ({tmp_path}/notes.txt): "
        "give a run directory, e.g. --run runs/default"
    )


def test_a_config_given_as_run_says_where_it_goes(tmp_path: Path) -> None:
    (tmp_path / "tiny.yaml").write_text("")
    with pytest.raises(RunError) as err:
        cli._invoke(["train", "--run", str(tmp_path / "tiny.yaml")])
    assert str(err.value) == (
        f"--run takes a run directory, not a file ({tmp_path}/tiny.yaml): give a run "
        "directory, e.g. --run runs/default (a config goes to `lightship train --config`)"
    )


def test_serve_still_takes_a_model_file(tmp_path: Path) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(b"")
    # --run is accepted: the next check, on the settings, is the one that fails
    with pytest.raises(ConfigError, match="^invalid serve settings \\(--port 70000:"):
        cli._invoke(["serve", "--run", str(model), "--port", "70000"])


def test_a_corrupt_checkpoint_says_how_to_train_it_again(tiny_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "corrupt"
    shutil.copytree(tiny_run, run)
    (run / "best.ckpt").write_bytes(b"not a checkpoint")
    rerecord_checkpoint(run)  # recorded as it is: the load, not the sha256 check, refuses it
    proc = run_cli("export", "--run", str(run), "--formats", "onnx")
    assert proc.returncode == 4, proc.stderr
    assert last_line(proc.stderr) == (
        f"error: checkpoint {run}/best.ckpt is corrupt or not a lightship checkpoint "
        "(UnpicklingError: Unsupported operand 110): delete it and train again "
        f"(`make train RESUME=1 RUN={run}`)"
    )


@pytest.mark.parametrize("argv", [[], ["bench"]])
def test_no_command_shows_the_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli._invoke(argv) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"Usage: {' '.join(['lightship', *argv])} [OPTIONS] COMMAND")
    assert "Commands:" in out and err == ""


def test_bench_serve_refuses_a_file_as_a_run(tmp_path: Path) -> None:
    model = tmp_path / "run" / "export" / "model.onnx"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"")
    (tmp_path / "run" / "manifest.json").write_text("{}")
    with pytest.raises(RunError) as err:
        cli._invoke(["bench", "serve", "--digits-run", str(model)])
    assert str(err.value) == (
        f"--digits-run takes a run directory, not a file ({model}): "
        f"give --digits-run {tmp_path / 'run'}"
    )


@pytest.mark.parametrize("stage", ["train", "export", "quantize", "report"])
def test_a_stage_on_a_run_in_use_is_one_line(stage: str, tmp_path: Path) -> None:
    # a retrain deleting what quantize was about to record, or FileNotFoundError tracebacks
    run = tmp_path / "busy"
    run.mkdir()
    with runs.lock_run(run, "lightship quantize"):  # this process: another one to the stage
        proc = run_cli(stage, "--run", str(run))
    assert proc.returncode == RunBusyError.exit_code, proc.stderr
    assert proc.stderr == (
        f"error: {run} is in use by another lightship process (pid {os.getpid()}, lightship "
        "quantize): wait for it to finish, or stop it\n"
    )
    others: set[type[LightshipError]] = {LightshipError, *LightshipError.__subclasses__()}
    others.remove(RunBusyError)
    assert RunBusyError.exit_code not in {e.exit_code for e in others} | {130}
    assert list(run.iterdir()) == []  # nothing touched; the holder's lock went with it


@pytest.mark.parametrize("stage", ["export", "quantize", "report"])
def test_a_stage_given_an_empty_folder_leaves_it_empty(stage: str, tmp_path: Path) -> None:
    # a folder that is no run: the stage fails, and no .lock is left behind in it
    with pytest.raises(RunError):
        cli._invoke([stage, "--run", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_run_still_says_it_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def refuse_lock(path: Path, *args: int) -> int:  # root ignores chmod: simulated
        if Path(path).name == ".lock":
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *args)

    def refuse(**_: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(runs.os, "open", refuse_lock)
    monkeypatch.setattr("tempfile.TemporaryFile", refuse)
    with pytest.raises(RunError) as err:
        cli._invoke(["train", "--run", str(tmp_path), "--config", str(CONFIGS / "tiny.yaml")])
    assert str(err.value) == (
        f"cannot write {tmp_path / 'config.yaml'}: Read-only file system: "
        "check the path and its permissions"
    )


def test_an_empty_or_garbled_run_config_on_resume_points_at_the_run(tmp_path: Path) -> None:
    # it said "... or leave out --config for the defaults", to a user who gave no --config
    fix = (
        f"restore it, resume with the config the run was trained with (`make train RESUME=1 "
        f"RUN={tmp_path} CONFIG=...`), or train afresh (`make train RUN={tmp_path} CONFIG=...`)"
    )
    (tmp_path / "config.yaml").write_text("")
    with pytest.raises(ConfigError) as err:
        cli._invoke(["train", "--run", str(tmp_path), "--resume"])
    assert str(err.value) == f"{tmp_path}/config.yaml is empty: {fix}"
    (tmp_path / "config.yaml").write_text("data: {source: [\n")  # garbled: no fix was given
    with pytest.raises(ConfigError) as err:
        cli._invoke(["train", "--run", str(tmp_path), "--resume"])
    assert str(err.value).startswith(f"{tmp_path}/config.yaml is not valid YAML: ")
    assert str(err.value).endswith(f"line 2, column 1: {fix}")


def test_the_last_line_after_ctrl_c_says_how_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import lightship.train

    def stopped(*_: object, **__: object) -> None:
        print("a line printed after the note", file=sys.stderr)
        raise KeyboardInterrupt

    def noted(*_: object, **__: object) -> None:
        runs.note_interrupt(f"resume with `make train RESUME=1 RUN={tmp_path}`")
        stopped()

    monkeypatch.setattr(runs, "_interrupt_note", [])
    monkeypatch.setattr(lightship.train, "fit", stopped)
    assert cli._invoke(["train", "--run", str(tmp_path)]) == 130
    assert capsys.readouterr().err.endswith("a line printed after the note\ninterrupted\n")
    monkeypatch.setattr(lightship.train, "fit", noted)
    assert cli._invoke(["train", "--run", str(tmp_path)]) == 130
    assert capsys.readouterr().err.endswith(
        f"\ninterrupted: resume with `make train RESUME=1 RUN={tmp_path}`\n"
    )
    # Ctrl-C outside a command (main's own handler) ends the same way
    monkeypatch.setattr(cli, "_invoke", noted)
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 130
    assert capsys.readouterr().err.endswith(
        f"\ninterrupted: resume with `make train RESUME=1 RUN={tmp_path}`\n"
    )


@pytest.mark.usefixtures("signal_handlers")  # restores SIGINT and SIGTERM afterwards
def test_a_finished_command_leaves_ctrl_c_ignored_and_sigterm_at_its_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the command returned, the teardown ignores Ctrl-C and SIGTERM
    kills it as by default: not lightship's handler, whose KeyboardInterrupt would land in
    the teardown. The command's own code is the exit code."""
    import signal

    monkeypatch.setattr(cli, "_invoke", lambda argv=None: 3)
    with pytest.raises(SystemExit) as done:
        cli.main()
    assert done.value.code == 3
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (RuntimeError("\n  Error(s) in loading:\n\tmissing key"), "Error(s) in loading:"),
        (ValueError("x" * 300), "x" * 200),
        (KeyError(), ""),
    ],
)
def test_first_line_quotes_a_several_line_error_in_one(exc: BaseException, line: str) -> None:
    from lightship.errors import first_line

    assert first_line(exc) == line


def test_a_run_given_without_run_says_where_it_goes(capsys: pytest.CaptureFixture[str]) -> None:
    # `lightship serve runs/default`: click's "unexpected extra argument" and nothing more
    assert cli._invoke(["serve", "runs/default"]) == 2
    assert capsys.readouterr().err == (
        "error: Got unexpected extra argument(s) (runs/default): a run goes after --run, "
        "`lightship serve --run runs/default`; see `lightship serve --help`\n"
    )
    # a setting without its --set was given as the run to use
    assert cli._invoke(["train", "--run", "r", "data.image_size=32"]) == 2
    assert capsys.readouterr().err == (
        "error: Got unexpected extra argument(s) (data.image_size=32): a setting goes after "
        "--set, `--set data.image_size=32`; see `lightship train --help`\n"
    )
    # a stray word beside --run given: the run goes nowhere else
    assert cli._invoke(["export", "--run", "r", "opset=18"]) == 2
    assert capsys.readouterr().err == (
        "error: Got unexpected extra argument(s) (opset=18); see `lightship export --help`\n"
    )
    assert cli._invoke(["export", "runs/default", "x"]) == 2  # two: no guess
    assert capsys.readouterr().err == (
        "error: Got unexpected extra argument(s) (runs/default x); see `lightship export --help`\n"
    )


def test_fit_from_python_takes_a_config_or_its_file_and_says_how_to_make_one(
    tmp_path: Path,
) -> None:
    # a dict or a path reached pydantic's model_dump: AttributeError, no lightship error
    from lightship.train import fit

    with pytest.raises(ConfigError, match=r"got dict: build one with lightship.config.load_conf"):
        fit({"trainer": {"max_epochs": 1}}, tmp_path / "run")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="nothing.yaml"):  # a path is loaded as a config
        fit(str(tmp_path / "nothing.yaml"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_cli_turns_onnx_runtimes_telemetry_off_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ORT 1.32 looked up mobile.events.data.microsoft.com from every lightship process
    monkeypatch.delenv("ORT_DISABLE_TELEMETRY", raising=False)
    monkeypatch.setattr(sys, "argv", ["lightship", "--help"])
    with pytest.raises(SystemExit):
        cli.main()
    assert os.environ["ORT_DISABLE_TELEMETRY"] == "1"
    monkeypatch.setenv("ORT_DISABLE_TELEMETRY", "0")  # a user's choice stands
    with pytest.raises(SystemExit):
        cli.main()
    assert os.environ["ORT_DISABLE_TELEMETRY"] == "0"


EARLY_SIGTERM = """
import importlib.abc, os, signal, sys
import lightship._start as start

class SignalDuringImport(importlib.abc.MetaPathFinder):  # SIGTERM as the CLI is imported
    def find_spec(self, name, path, target=None):
        if name == "lightship.cli":
            os.kill(os.getpid(), signal.SIGTERM)
        return None

sys.meta_path.insert(0, SignalDuringImport())
start.main()
print("went on")
"""


def test_sigterm_while_the_cli_is_imported_ends_it_at_once() -> None:
    # As PID 1 of a container a process drops a signal it has no handler for: a server told to
    # stop while it started ignored SIGTERM and went on to serve. Exit 143 is the handler's;
    # the default action would show as -15.
    proc = subprocess.run(
        [sys.executable, "-c", EARLY_SIGTERM], capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout) == (143, ""), proc.stderr
    assert 'lightship = "lightship._start:main"' in (ROOT / "pyproject.toml").read_text()


SIGTERM_INSIDE_EXEC = """
import importlib.abc, sys

class SignalInsideExec(importlib.abc.MetaPathFinder):  # as dataclasses' exec runs in FastAPI's
    def find_spec(self, name, path, target=None):
        if name == "fastapi":
            sys.meta_path.remove(self)
            exec("import os, signal; os.kill(os.getpid(), signal.SIGTERM); sum(range(10**6))")
        return None

sys.meta_path.insert(0, SignalInsideExec())
"""


def test_python_m_lightship_stopped_inside_an_exec_exits_as_the_script_does(
    tmp_path: Path,
) -> None:
    # CPython 3.11 ended `python -m` with SIGINT (130) after a KeyboardInterrupt had left an
    # exec of a string anywhere, though the CLI had caught it and exited 143
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    serve = [sys.executable, "-m", "lightship", "serve", "--run", str(tmp_path / "absent")]
    (tmp_path / "sitecustomize.py").write_text(SIGTERM_INSIDE_EXEC)
    stopped = subprocess.run(serve, capture_output=True, text=True, timeout=120, env=env)
    assert (stopped.returncode, stopped.stderr.strip()) == (143, "interrupted")
    (tmp_path / "sitecustomize.py").unlink()  # and without the stop, its own error
    plain = subprocess.run(serve, capture_output=True, text=True, timeout=120, env=env)
    assert plain.returncode == 4 and "does not exist" in plain.stderr


@pytest.mark.parametrize("argv", [["bench", "train"], ["bench", "serve"]])
def test_a_benchmarks_out_given_a_folder_asks_for_a_file(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # "/tmp is a folder where a file goes: move it away and run again"
    from lightship.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        cli._invoke([*argv, "--out", str(tmp_path)])
    assert str(err.value) == (
        f"--out takes a file for the results, and {tmp_path} is a folder: give a file in it, "
        f"e.g. --out {tmp_path / 'results.json'}"
    )


def test_the_cli_has_each_stage_and_nothing_else_as_a_command() -> None:
    """A helper written between `@app.command()` and the function it decorated took the
    decorator: `lightship report` was "No such command" and a helper was a command."""
    import typer.main

    from lightship.cli import app

    group = typer.main.get_command(app)
    assert sorted(group.commands) == [  # type: ignore[attr-defined]
        "bench", "export", "quantize", "report", "serve", "train",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("error", "said"),
    [
        # numpy's, for data.image_size=4096 on 1,797 digits (the config takes up to 4096)
        (
            MemoryError(
                "Unable to allocate 28.1 GiB for an array with shape (1797, 1, 4096, "
                "4096) and data type uint8"
            ),
            " (Unable to allocate 28.1 GiB for an array with shape (1797, 1, 4096, 4096) and "
            "data type uint8)",
        ),
        (MemoryError(), ""),
    ],
)
def test_running_out_of_memory_is_one_line_not_a_traceback(
    error: MemoryError,
    said: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _said_failing_with(error, monkeypatch, capsys) == (
        f"error: out of memory{said}: use smaller settings (data.image_size, data.batch_size, "
        "--calibration-samples, --batch) or a machine with more memory\n"
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda s: s.ReportSettings(rounds=2.5), "report's rounds must be int, got 2.5"),
        (lambda s: s.ReportSettings(batch=True), "report's batch must be int, got True"),
        (lambda s: s.ReportSettings(gate="x"), "report's gate must be float or None, got 'x'"),
        (lambda s: s.QuantizeSettings(gate="0.9"), "quantize's gate must be float, got '0.9'"),
        (lambda s: s.QuantizeSettings(per_channel=1), "quantize's per_channel must be bool, got 1"),
    ],
)
def test_settings_of_the_wrong_kind_from_python_are_config_errors(make: Any, message: str) -> None:
    # `ReportSettings(rounds=2.5)` was a TypeError from range() deep in the report
    from lightship.quantize import core as quantize_core
    from lightship.report import core as report_core

    module = report_core if "report" in message else quantize_core
    with pytest.raises(ConfigError) as err:
        make(module)
    assert str(err.value) == message


def test_settings_given_as_a_dict_say_which_class_makes_them(tmp_path: Path) -> None:
    # report(run, {"rounds": 3}): AttributeError 'dict' object has no attribute 'threads'
    import numpy as np

    from lightship.quantize.core import QuantizeSettings, quantize
    from lightship.report.core import ReportSettings, report

    with pytest.raises(ConfigError) as err:
        report(tmp_path, {"rounds": 3})  # type: ignore[arg-type]
    assert str(err.value) == (
        "report's settings must be a ReportSettings, got dict: e.g. ReportSettings(threads=..., "
        "rounds=...)"
    )
    with pytest.raises(ConfigError, match="quantize's settings must be a QuantizeSettings, got"):
        quantize(tmp_path, "dynamic", settings={"gate": 0.9})  # type: ignore[arg-type]
    empties: list[Any] = [{}, []]
    for empty in empties:  # no settings, not the defaults
        with pytest.raises(ConfigError, match=r"report's settings must be a ReportSettings, got"):
            report(tmp_path, empty)
        with pytest.raises(ConfigError, match="quantize's settings must be a QuantizeSettings"):
            quantize(tmp_path, "dynamic", settings=empty)
    # a field's annotation given as the type itself (no `from __future__ import annotations`)
    from lightship.errors import check_settings

    typed = dataclasses.make_dataclass("Typed", [("rounds", int, 1), ("gate", float | None, None)])
    check_settings(typed(rounds=np.int64(2), gate=None), typed, "x")
    with pytest.raises(ConfigError, match=r"^x's rounds must be int, got 2.5$"):
        check_settings(typed(rounds=2.5), typed, "x")
    with pytest.raises(ConfigError, match=r"^x's gate must be float or None, got 'a'$"):
        check_settings(typed(gate="a"), typed, "x")
    # numpy's numbers are numbers
    assert ReportSettings(rounds=np.int64(3), seconds=np.float32(0.5)).rounds == 3  # type: ignore[arg-type]
    assert QuantizeSettings(gate=np.float64(0.9)).gate == 0.9
    numpy_bool = QuantizeSettings(per_channel=np.bool_(False))  # type: ignore[arg-type]
    assert numpy_bool.flags() == ["--no-per-channel"]  # the command that repeats it
    with pytest.raises(ConfigError, match=r"^report's rounds must be int, got np.True_$"):
        ReportSettings(rounds=np.bool_(True))  # type: ignore[arg-type]
