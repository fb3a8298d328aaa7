"""`report` against what goes wrong: a variant that cannot load, Ctrl-C, a failing disk."""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from lightship.errors import RunBusyError, RunError
from lightship.report import ReportSettings, report
from lightship.report import core as report_core
from lightship.report.evaluate import candidates
from lightship.report.measure import Timing
from lightship.runs import RunDir, interrupt_exit_code, interrupt_message, sha256_file

FAST = ReportSettings(threads=1, rounds=1, seconds=0.01)


@pytest.fixture
def run(exported_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(exported_run, copy)
    return copy


def test_a_variant_its_runtime_cannot_load_is_left_out_with_the_command_to_remake_it(
    run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    onnx = run / "export" / "model.onnx"
    onnx.write_bytes(b"not an onnx model")
    rd = RunDir(run)
    entry = rd.artifact("onnx-fp32")
    assert entry is not None
    rd.record("onnx-fp32", {**entry, "sha256": sha256_file(onnx)})  # recorded, yet unloadable

    left_out: dict[str, str] = {}
    with caplog.at_level(logging.WARNING):
        found = candidates(rd, threads=1, left_out=left_out)

    assert [c.name for c in found] == ["eager", "torchscript"]
    warning = caplog.text
    assert "onnx-fp32: onnxruntime cannot load export/model.onnx" in warning, warning
    assert f"make export RUN={run} EXPORT_ARGS='--formats onnx'" in warning, warning
    assert list(left_out) == ["onnx-fp32"]  # for report.json and report.md to name
    assert left_out["onnx-fp32"].startswith("onnxruntime cannot load export/model.onnx (")


def test_a_variant_changed_since_its_stage_wrote_it_is_left_out_and_its_old_figures_go(
    run: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A model file cut short after export recorded it: the report ended (exit 4) on it, and
    the old report, the old file's figures, stayed for `serve` to recommend from."""
    monkeypatch.setattr(report_core, "measure", quiet_timings)
    report(RunDir(run), FAST)  # the old report, onnx-fp32 in it
    onnx = run / "export" / "model.onnx"
    onnx.write_bytes(onnx.read_bytes()[:-100])  # its manifest entry as it was

    with caplog.at_level(logging.WARNING):
        result = report(RunDir(run), FAST)

    why = (
        "export/model.onnx differs from its manifest entry (sha256): it changed after "
        f"`lightship` wrote it; `make export RUN={run} EXPORT_ARGS='--formats onnx'` makes it again"
    )
    assert result["not_measured"] == {"onnx-fp32": why}
    on_disk = json.loads((run / "report" / "report.json").read_text())
    assert [v["name"] for v in on_disk["variants"]] == ["eager", "torchscript"]
    assert on_disk["not_measured"] == {"onnx-fp32": why}
    # its file as it was left out, which `serve` tells one made again since by
    assert on_disk["not_measured_files"] == {"onnx-fp32": sha256_file(onnx)}
    md = (run / "report" / "report.md").read_text()
    assert f"Not measured: onnx-fp32, {why}." in md and "| onnx-fp32 |" not in md
    assert f"onnx-fp32: {why} (not measured)" in caplog.text


def test_a_checkpoint_changed_since_it_was_recorded_still_stops_the_report(run: Path) -> None:
    """best.ckpt is the reference every variant is compared with: no report without it."""
    ckpt = run / "best.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[:-100])
    with pytest.raises(RunError, match=r"best\.ckpt differs from its manifest entry \(sha256\)"):
        report(RunDir(run), FAST)


def test_interrupted_while_measuring_says_the_old_report_stands_and_how_to_report_again(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("lightship.runs._interrupt_note", [])

    def stopped(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(report_core, "measure", stopped)
    with pytest.raises(KeyboardInterrupt):
        report(RunDir(run), FAST)

    message = interrupt_message()
    assert message.startswith(f"interrupted: {run / 'report'} is as it was"), message
    assert message.endswith(f"report again with `make report RUN={run} REPORT_ARGS='{FAST_FLAGS}'`")


def test_a_sync_that_fails_leaves_the_old_report_whole(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = run / "report"
    folder.mkdir()
    for name in ("report.json", "report.md", "pareto.png"):
        (folder / name).write_text("old")
    calls = []
    real_fsync = os.fsync

    def full_disk(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:  # the second of the three files
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        report(RunDir(run), FAST)

    # no new plot beside the old report, and no temporaries
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == {
        "report.json": b"old",
        "report.md": b"old",
        "pareto.png": b"old",
    }


REPORT = ("report.json", "report.md", "pareto.png")


def _old_report(run: Path) -> dict[str, bytes]:
    folder = run / "report"
    folder.mkdir()
    for name in REPORT:
        (folder / name).write_bytes(b"old")
    return dict.fromkeys(REPORT, b"old")


def _report_files(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (run / "report").iterdir()}


def _all_new(run: Path) -> bool:
    files = _report_files(run)
    return (
        sorted(files) == sorted(REPORT)
        and json.loads(files["report.json"])["run"] == str(run)
        and files["report.md"].startswith(b"# lightship report")
        and files["pareto.png"].startswith(b"\x89PNG")
    )


@pytest.mark.usefixtures("signal_handlers")
def test_a_stop_signal_while_the_report_is_renamed_lands_after_it(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _old_report(run)
    renamed = _stopped_at_the_first_rename(run, monkeypatch, [signal.SIGTERM])
    with pytest.raises(KeyboardInterrupt):
        report(RunDir(run), FAST)
    # onnxruntime's and torch's threads take the signal as well as this one: held all the same
    assert len(renamed) == 3 and _all_new(run)
    # the CLI's last line: it said "report is as it was (nothing measured is kept)"
    assert interrupt_message() == f"interrupted: the new report was written to {run / 'report'}"


def _stopped_at_the_first_rename(
    run: Path, monkeypatch: pytest.MonkeyPatch, signals: list[int]
) -> list[str]:
    """Send `signals` to this process just after the first of the report's renames (`docker
    stop`, Ctrl-C); returns the names renamed, as they are."""
    real_replace = os.replace
    renamed: list[str] = []

    def replace_then_stopped(src: str | Path, dst: str | Path) -> None:
        real_replace(src, dst)
        if Path(dst).parent == run / "report" and not Path(dst).name.startswith("."):
            renamed.append(Path(dst).name)
            if len(renamed) == 1:
                for signum in signals:
                    os.kill(os.getpid(), signum)

    monkeypatch.setattr(os, "replace", replace_then_stopped)
    return renamed


@pytest.mark.usefixtures("signal_handlers")
def test_ctrl_c_then_sigterm_while_the_report_is_renamed_exits_143_saying_it_is_written(
    run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightship import cli

    _old_report(run)
    renamed = _stopped_at_the_first_rename(run, monkeypatch, [signal.SIGINT, signal.SIGTERM])
    code = cli._invoke(["report", "--run", str(run), "--threads", "1", "--rounds", "1"])
    assert len(renamed) == 3 and _all_new(run)
    # the later signal decides, as it does outside the renames: it exited 130
    assert code == interrupt_exit_code() == 143
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"interrupted: the new report was written to {run / 'report'}"


def test_report_called_from_python_takes_the_runs_lock(run: Path) -> None:
    # as `lightship report` and quantize do: a stage of another process must not replace a
    # variant while it is measured
    holder = os.open(run / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file description: another process's
    try:
        with pytest.raises(RunBusyError, match="is in use by another lightship process"):
            report(RunDir(run), FAST)
    finally:
        os.close(holder)
    assert not (run / "report").exists()


def busy(predictors: dict[str, object], *args: object, **kwargs: object) -> dict[str, Timing]:
    """`measure` on a machine others kept busy: every variant timed while they used 48 % of
    it, the eager baseline stalled in some calls, torchscript slowed in some rounds."""
    timings = {
        name: Timing([0.5] * 10, [1000.0] * 5, others_cpu_s=4.8, machine_cpu_s=10.0)
        for name in predictors
    }
    timings["eager"].latency_ms[8:] = [100.0, 100.0]  # stalled calls: p90 200x p50
    timings["torchscript"].throughput = [600.0, 800.0, 1000.0, 1300.0, 1600.0]
    return timings


BUSY_WARNING = (
    "timings are noisy (other processes using over 10% of the CPU, batch-1 p90 over 3x p50, or "
    "the middle half of the rounds over ±20% from their median): other processes used 48% of "
    "the CPU while measuring, eager (p90 200x p50), torchscript (img/s ±30%; x eager ±30%). "
    "The machine was busy while measuring, so the speed figures and the recommendation may be "
    "off: re-run `make report RUN={run} REPORT_ARGS='{flags}'` when it is quiet"
)
FAST_FLAGS = "--threads 1 --rounds 1"  # FAST's, as the command to report again gives them


def test_a_busy_machine_is_a_warning_in_report_md_and_report_json(
    run: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(report_core, "measure", busy)
    with caplog.at_level(logging.WARNING, "lightship.report"):
        result = report(RunDir(run), FAST)

    busy_reason = "other processes used 48% of the CPU"
    assert {v["name"]: v["timing_noise"] for v in result["variants"]} == {
        "eager": [busy_reason, "p90 200x p50"],
        "torchscript": [busy_reason, "img/s ±30%", "x eager ±30%"],
        "onnx-fp32": [busy_reason],
    }
    assert result["machine_busy_share"] == 0.48
    assert all(v["machine_busy_share"] == 0.48 for v in result["variants"])
    warning = BUSY_WARNING.format(run=run, flags=FAST_FLAGS)
    assert result["timing_warning"] == warning
    on_disk = json.loads((run / "report" / "report.json").read_text())
    assert on_disk["timing_warning"] == warning and on_disk["machine_busy_share"] == 0.48
    md = (run / "report" / "report.md").read_text()
    assert f"\n**Warning:** {warning}.\n" in md
    assert "- other processes used 48.0% of the CPU while variants were timed\n" in md
    assert caplog.messages == []  # the caller shows it: the CLI below its table


def test_the_cli_prints_the_timing_warning_once_below_its_table(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightship import cli

    monkeypatch.setattr(report_core, "measure", busy)
    out = io.StringIO()  # stdout and stderr as a terminal interleaves them
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", out)
    cli.report(run=run, threads=1, rounds=1, batch=64, gate=0.99)
    lines = out.getvalue().splitlines()
    # the options given, in the command to report again: without them another gate judges
    warning = f"warning: {BUSY_WARNING.format(run=run, flags=FAST_FLAGS + ' --gate 0.99')}"
    assert lines.count(warning) == 1 and out.getvalue().count("timings are noisy") == 1
    table_end = max(i for i, line in enumerate(lines) if line.startswith("└"))
    recommended = next(i for i, line in enumerate(lines) if line.startswith("recommended:"))
    assert table_end < recommended < lines.index(warning)
    assert lines[-1].startswith("next: ")


def test_report_json_says_how_the_recommendation_was_made_and_on_how_many_threads(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def tied(predictors: dict[str, object], *args: object, **kwargs: object) -> dict[str, Timing]:
        timings = {name: Timing([0.5] * 10, [1000.0, 1000.0, 1000.0]) for name in predictors}
        timings["torchscript"].throughput = [1010.0, 990.0, 1000.0]  # as fast as ONNX fp32
        return timings

    monkeypatch.setattr(report_core, "measure", tied)
    result = report(RunDir(run), ReportSettings(threads=2, rounds=3, seconds=0.01))
    rows = {v["name"]: v for v in result["variants"]}
    # both exact to fp32 (SQNR at its cap): the smaller file wins the tie
    assert rows["torchscript"]["sqnr_db"] == rows["onnx-fp32"]["sqnr_db"]
    smaller = min(("torchscript", "onnx-fp32"), key=lambda n: rows[n]["bytes"])
    by = result["recommended_by"]
    assert result["recommended"] == smaller and by["tie_break"] == "bytes"
    assert sorted(by["tied"]) == ["onnx-fp32", "torchscript"]
    assert json.loads((run / "report" / "report.json").read_text())["recommended_by"] == by
    md = (run / "report" / "report.md").read_text()
    assert f"**{smaller}** ★, tied in speed with " in md and "chosen for the smaller file" in md
    # torch runs every batch on the report's threads; ONNX Runtime, one image on whichever
    # session answered it sooner as the model loaded
    assert rows["eager"]["batch1_threads"] == rows["torchscript"]["batch1_threads"] == 2
    assert rows["onnx-fp32"]["batch1_threads"] in (1, 2)


@pytest.mark.parametrize(("batch", "threads", "lanes"), [(4, 1, 1), (6, 2, 2), (64, 2, 2)])
def test_report_json_says_the_threads_the_throughput_batch_ran_on(
    run: Path, monkeypatch: pytest.MonkeyPatch, batch: int, threads: int, lanes: int
) -> None:
    """ONNX Runtime splits a batch over one-thread lanes from `split_rows` (here 6, with one
    image sooner on one thread, as the digits CNN timed): a shorter batch ran on one thread,
    which report.md and report.json said was the report's two."""
    from lightship.runtime import ort

    def fastest(session: Any, name: str, x: Any, runs: int = 3) -> float:
        one_thread = session.get_session_options().intra_op_num_threads == 1
        return 200e-6 if len(x) == 4 else 65e-6 if one_thread else 90e-6

    monkeypatch.setattr(ort, "_fastest", fastest)
    monkeypatch.setattr(report_core, "measure", quiet_timings)
    settings = ReportSettings(threads=2, rounds=3, batch=batch, seconds=0.01)
    rows = {v["name"]: v for v in report(RunDir(run), settings)["variants"]}
    fp32 = rows["onnx-fp32"]
    assert (fp32["split_rows"], fp32["batch1_threads"]) == (6, 1)
    assert (fp32["batch_threads"], fp32["batch_lanes"]) == (threads, lanes)
    assert rows["torchscript"]["batch_threads"] == 2 and rows["torchscript"]["batch_lanes"] == 1
    md = (run / "report" / "report.md").read_text()
    assert (f"- threads at batch {batch}: fewer than 2 for onnx-fp32 (1):" in md) == (threads == 1)


def test_a_quiet_machine_is_no_warning(
    run: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def quiet(predictors: dict[str, object], *args: object, **kwargs: object) -> dict[str, Timing]:
        return {name: Timing([0.5] * 9 + [1.4], [1000.0, 1150.0, 950.0]) for name in predictors}

    monkeypatch.setattr(report_core, "measure", quiet)
    with caplog.at_level(logging.WARNING, "lightship.report"):
        result = report(RunDir(run), FAST)
    assert result["timing_warning"] is None
    assert all(v["timing_noise"] == [] for v in result["variants"])
    assert "Warning" not in (run / "report" / "report.md").read_text()
    assert caplog.messages == []


def test_a_noisy_report_on_a_quiet_machine_says_its_speed_moved_not_that_it_was_busy(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README's first command in a fresh clone, other processes at 0.4 % of the CPU: eager's
    rounds spread ±23 %, and the warning said the machine was busy."""

    def alone(predictors: dict[str, object], *args: object, **kwargs: object) -> dict[str, Timing]:
        timings = {
            name: Timing([0.5] * 10, [1000.0] * 5, others_cpu_s=0.04, machine_cpu_s=10.0)
            for name in predictors
        }
        timings["eager"].throughput = [600.0, 800.0, 1000.0, 1300.0, 1600.0]
        return timings

    monkeypatch.setattr(report_core, "measure", alone)
    result = report(RunDir(run), FAST)
    assert result["machine_busy_share"] == 0.004
    assert result["timing_warning"].startswith("timings are noisy (")
    assert result["timing_warning"].endswith(
        ": eager (img/s ±30%), torchscript (x eager ±25%), onnx-fp32 (x eager ±25%). Other "
        "processes used only 0.4% of the CPU while measuring: the rounds varied on their own "
        "(the CPU's clock, a virtual machine's host), so the speed figures may be off, though "
        "not the recommendation (the within-round ratios between the variants it chose from "
        f"stayed within ±20%): re-run {FAST.again(RunDir(run))} when it is quiet"
    )
    assert "busy" not in result["timing_warning"].split("):", 1)[1]


@pytest.mark.parametrize(
    ("slowed", "doubted"),
    [
        # rounds that slowed eager alone: the × eager figures, not the choice between the rest
        ({"eager": [600.0, 800.0, 1000.0, 1300.0, 1600.0]}, False),
        # every variant's rounds slowed alike: their ratios, which the choice rests on, held
        ({n: [600.0, 800.0, 1000.0, 1300.0, 1600.0] for n in ("torchscript", "onnx-fp32")}, False),
        # one of the variants it chose between slowed alone in some rounds
        ({"onnx-fp32": [600.0, 800.0, 1000.0, 1300.0, 1600.0]}, True),
    ],
)
def test_the_warning_doubts_the_recommendation_only_where_what_it_rests_on_was_noisy(
    run: Path, monkeypatch: pytest.MonkeyPatch, slowed: dict[str, list[float]], doubted: bool
) -> None:
    """A report on the AVX2 EPYC warned of dynamic int8's ±48 % (the machine slowed in 4
    rounds of 15) and said the recommendation may be off: static int8 against QAT, the
    closest pair it chose from, had stayed at 0.99-1.03 in the middle half of the rounds."""

    def measured(predictors: dict[str, object], *a: object, **kw: object) -> dict[str, Timing]:
        timings = {name: Timing([0.5] * 10, [1000.0] * 5) for name in predictors}
        timings["torchscript"].throughput = [2000.0] * 5  # the fastest, by 2x
        for name, rounds in slowed.items():
            timings[name].throughput = [v * timings[name].throughput[0] / 1000 for v in rounds]
        return timings

    monkeypatch.setattr(report_core, "measure", measured)
    result = report(RunDir(run), FAST)
    assert result["recommended"] == "torchscript"
    warning = result["timing_warning"]
    assert warning is not None and warning.startswith("timings are noisy (")
    assert ("so the speed figures and the recommendation may be off" in warning) == doubted
    assert ("so the speed figures may be off, though not the recommendation" in warning) == (
        not doubted
    )


def test_the_report_syncs_each_file_once_before_any_rename(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("sync folder" if os.path.isdir(f"/proc/self/fd/{fd}") else "sync")
        real_fsync(fd)

    def replace(src: str | Path, dst: str | Path) -> None:
        if Path(dst).parent == run / "report" and not Path(dst).name.startswith("."):
            events.append(f"rename {Path(dst).name}")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    report(RunDir(run), FAST)
    # report.json last: `serve` reads it; then report/ itself, where the renames are
    renames = ["rename pareto.png", "rename report.md", "rename report.json"]
    assert events == ["sync"] * 3 + renames + ["sync folder"]


def test_the_scheme_check_keeps_the_cpu_quantize_measured_it_on(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report_core, "measure", quiet_timings)
    error = {"accuracy": 0.99, "max_abs_diff": 0.1, "argmax_agreement": 1.0}
    elsewhere = {"model": "EPYC", "arch": "x86_64", "int8_flags": ["avx2"]}
    static = run / "quantize" / "model.int8-static.onnx"
    static.parent.mkdir()
    shutil.copy(run / "export" / "model.onnx", static)  # a model of the run's, to measure
    RunDir(run).record(
        "onnx-int8-static",
        {
            "file": "quantize/model.int8-static.onnx",
            "sha256": sha256_file(static),
            "cpu": elsewhere,
            "calibration": {
                "samples": 256,
                "method": "minmax",
                "chunk": 64,
                "seconds": 1.0,
                "scales_sha256": "ab" * 32,
            },
            "scheme_check": {
                "chosen": {"target": "avx2", **error},
                "alternative": {"target": "vnni", **error},
            },
        },
    )
    result = report(RunDir(run), FAST)
    assert result["scheme_check"]["cpu"] == elsewhere
    md = (run / "report" / "report.md").read_text()
    assert (
        "Scheme check (static int8, real kernels), measured by quantize on EPYC (x86_64; avx2), "
        "not this report's CPU: its figures may differ here:\n"
    ) in md
    assert "- calibration: 256 training images, minmax" in md

    # the model gone, its calibration and scheme check describe nothing the report measured
    static.unlink()
    result = report(RunDir(run), FAST)
    assert "onnx-int8-static" in result["not_measured"]
    assert result["scheme_check"] is None and result["calibration"] is None
    md = (run / "report" / "report.md").read_text()
    assert "Scheme check" not in md and "calibration:" not in md


def quiet_timings(
    predictors: dict[str, object], *args: object, **kwargs: object
) -> dict[str, Timing]:
    return {name: Timing([0.5] * 10, [1000.0, 1000.0, 1000.0]) for name in predictors}


def _stages_refuse_run() -> list[str]:
    """The errors report and quantize give for ./run, which must refuse it."""
    from lightship.quantize.core import quantize

    said = []
    for stage in (lambda rd: report(rd, FAST), lambda rd: quantize(rd, "dynamic")):
        with pytest.raises(RunError) as err:
            stage(RunDir(Path("run")))
        said.append(str(err.value))
    return said


def test_a_trained_run_whose_manifest_lost_its_checkpoint_is_told_to_resume_not_retrain(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest deleted (as a malformed one's message says): report and quantize said to
    `train` the run, which trains make's default model over it, the run's own lost."""
    monkeypatch.chdir(run.parent)  # outside lightship's checkout: the lightship commands
    (run / "manifest.json").unlink()
    expected = (
        "run/manifest.json does not record best.ckpt: run `lightship train --run run --resume` "
        "(a finished run trains nothing more), then `lightship export --run run`, then "
        "`lightship quantize --run run`"
    )
    assert _stages_refuse_run() == [expected, expected]  # report, quantize
    for ckpt in (run / "checkpoints").glob("*.ckpt"):
        ckpt.unlink()
    (run / "best.ckpt").unlink()  # nothing trained: a training of its own
    with pytest.raises(RunError, match=r"^no trained run in run: run `lightship train --run run`"):
        report(RunDir(Path("run")), FAST)


def test_a_run_that_lost_only_its_checkpoint_entry_is_told_the_resume_keeps_its_exports(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exports' entries stay and record the best.ckpt the resume records again, which
    keeps them (`RunDir.made_from`): the message said to export and quantize again after it."""
    monkeypatch.chdir(run.parent)
    data = json.loads((run / "manifest.json").read_text())
    del data["artifacts"]["checkpoint"]
    (run / "manifest.json").write_text(json.dumps(data))
    expected = (
        "run/manifest.json does not record best.ckpt: run `lightship train --run run --resume` "
        "(a finished run trains nothing more and keeps what manifest.json records was made "
        "from its best.ckpt; it names what to run next)"
    )
    assert _stages_refuse_run() == [expected, expected]  # report, quantize


@pytest.mark.parametrize("other", ["shape", "checkpoint"])
def test_another_models_file_recorded_in_the_run_is_left_out_of_the_report(
    run: Path, caplog: pytest.LogCaptureFixture, other: str
) -> None:
    """Another model's model.onnx recorded as the run's. Of another shape (3x8x8 for the run's
    1x16x16 images): the report measured it, and onnxruntime's InvalidArgument ended it in a
    traceback. Of the same input, copied in with its manifest entry: measured as this run's
    ONNX fp32 (0.90 against 0.99, FAIL), and the baseline of every x ONNX fp32; its entry says
    it was exported from another checkpoint."""
    from tests.handmade import handmade_onnx

    rd = RunDir(run)
    entry = rd.artifact("onnx-fp32")
    assert entry is not None and entry["source_checkpoint_sha256"]
    if other == "shape":
        onnx = handmade_onnx(run / "export" / "model.onnx", chw=(3, 8, 8))
        rd.record("onnx-fp32", {**entry, "sha256": sha256_file(onnx)})
        why = "is not this run's model (it takes [N,3,8,8], the run's images are [N,1,16,16])"
    else:
        rd.record("onnx-fp32", {**entry, "source_checkpoint_sha256": "b" * 64})
        why = (
            "was made from another checkpoint than the run's best.ckpt (its "
            "source_checkpoint_sha256 is not checkpoint's sha256)"
        )

    left_out: dict[str, str] = {}
    with caplog.at_level(logging.WARNING):
        found = candidates(rd, threads=1, left_out=left_out)

    assert [c.name for c in found] == ["eager", "torchscript"]
    assert left_out == {
        "onnx-fp32": f"export/model.onnx {why}; `make export RUN={run} EXPORT_ARGS='--formats "
        "onnx'` makes it again"
    }
    assert f"onnx-fp32: {left_out['onnx-fp32']} (not measured)" in caplog.text


def test_a_report_that_fails_before_measuring_leaves_no_empty_folder(
    run: Path, tmp_path: Path
) -> None:
    from lightship.errors import DataError

    rd = RunDir(run)
    entry = rd.artifact("checkpoint")
    assert entry is not None and not (run / "report").exists()
    gone = {**entry["data_spec"], "source": "folder", "path": str(tmp_path / "gone")}
    rd.record("checkpoint", {**entry, "data_spec": gone})  # its data moved away
    with pytest.raises(DataError, match="put the data back"):
        report(rd, FAST)
    assert not (run / "report").exists()


def test_report_gives_the_callers_allocator_back_measured_or_not(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a notebook that called report() kept its peak for good: glibc's thresholds stayed raised
    calls: list[str] = []

    def keep() -> bool:
        calls.append("kept")
        return True

    monkeypatch.setattr(report_core, "keep_freed_memory", keep)
    monkeypatch.setattr(report_core, "give_back_freed_memory", lambda: calls.append("given back"))
    report(RunDir(run), FAST)
    assert calls == ["kept", "given back"]

    def fails(*args: object, **kwargs: object) -> dict[str, Timing]:
        raise KeyboardInterrupt

    monkeypatch.setattr(report_core, "measure", fails)
    with pytest.raises(KeyboardInterrupt):
        report(RunDir(run), FAST)
    assert calls == ["kept", "given back"] * 2


def test_a_full_disk_is_said_before_the_timing_not_after_it(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report timed every variant (a minute), then failed on "no space left ... writing a
    file"."""
    from lightship import runs

    usage = shutil.disk_usage(run)
    monkeypatch.setattr(runs.shutil, "disk_usage", lambda _: usage._replace(free=40_000))
    timed: list[str] = []
    monkeypatch.setattr(report_core, "measure", lambda *a, **k: timed.append("timed"))
    with pytest.raises(RunError) as err:
        report(run)
    assert str(err.value) == (
        f"report needs about 2 MB in {run} but 40 kB are free: make room and run again"
    )
    assert not timed


def test_a_gate_above_one_fails_no_fp32_format_and_torch_formats_count_no_int8_ops(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # above 1, quantize's way to force its fallback: eager failed against itself, every fp32
    # export with it, and nothing was recommended; and the torch formats read "0 %" int8 ops,
    # a count ONNX Runtime never made of them
    monkeypatch.setattr(report_core, "measure", quiet_timings)
    result = report(RunDir(run), ReportSettings(threads=1, rounds=1, seconds=0.01, gate=1.01))
    rows = {v["name"]: v for v in result["variants"]}
    assert set(rows) == {"eager", "torchscript", "onnx-fp32"}
    assert all(v["gate_passed"] for v in rows.values())
    assert result["recommended"] in ("torchscript", "onnx-fp32")
    assert [rows[n]["int8_share"] for n in ("eager", "torchscript", "onnx-fp32")] == [
        None,
        None,
        0.0,
    ]
    table = (run / "report" / "report.md").read_text()
    assert "| eager | " in table and "FAIL" not in table
    assert (
        "compared as counts of test images right, or is an fp32 format that scores as eager does"
        in table
    )
    assert [line.split(" | ")[6] for line in table.splitlines() if line.startswith("| ")][1:] == [
        "—",
        "—",
        "0%",
    ]
