"""Training through the CLI, as a user runs it, on the tiny config (seconds)."""

from __future__ import annotations

import functools
import importlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightship.config import load_config
from lightship.runs import RunDir, sha256_file
from tests.conftest import CONFIGS, ROOT, last_line, run_cli, swap_checkpoint

TINY = str(CONFIGS / "tiny.yaml")


def manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())["artifacts"]


def test_tiny_run_writes_the_run_directory(tiny_run: Path) -> None:
    assert (tiny_run / "config.yaml").is_file()
    assert (tiny_run / "checkpoints" / "last.ckpt").is_file()
    assert list((tiny_run / "logs" / "csv").glob("version_*/metrics.csv"))
    ckpt = torch.load(tiny_run / "best.ckpt", weights_only=True)  # plain types only
    hp = ckpt["hyper_parameters"]
    assert hp["labels"] == [str(i) for i in range(10)]
    assert hp["input_spec"]["dtype"] == "uint8"
    assert hp["input_spec"]["shape"] == ["batch", 1, 16, 16]
    assert hp["model_spec"]["kwargs"] == {"stages": [[8], [16]]}
    entry = manifest(tiny_run)["checkpoint"]
    assert entry["labels"] == hp["labels"]
    assert entry["parameters"] > 1000
    assert 0.5 < entry["test_acc"] <= 1.0  # a learned model, far above chance (0.1)
    import hashlib

    assert entry["sha256"] == hashlib.sha256((tiny_run / "best.ckpt").read_bytes()).hexdigest()


def test_train_prints_where_and_what_next(tmp_path: Path) -> None:
    run = tmp_path / "r"
    proc = run_cli(
        "train", "--run", str(run), "--config", TINY, "--set", "trainer.max_epochs=1", check=True
    )
    assert f"run directory: {run}" in proc.stdout
    assert f"make export RUN={run}" in proc.stdout


def test_early_stopping_stops_on_a_plateau(tmp_path: Path) -> None:
    run = tmp_path / "plateau"
    # lr=0 freezes the weights, so val_acc cannot improve by min_delta: patience 2 ends it at epoch 3.
    run_cli(
        "train",
        "--run",
        str(run),
        "--config",
        TINY,
        "--set",
        "optim.lr=0",
        "--set",
        "trainer.max_epochs=30",
        "--set",
        "early_stopping.patience=2",
        "--set",
        "early_stopping.min_delta=0.05",
        check=True,
    )
    entry = manifest(run)["checkpoint"]
    assert entry["stopped_early"] is True
    assert entry["epochs"] == 3 < entry["max_epochs"]


def test_killed_run_resumes_from_last_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "resume"
    cmd = [
        sys.executable,
        "-m",
        "lightship",
        "train",
        "--run",
        str(run),
        "--config",
        TINY,
        "--set",
        "trainer.max_epochs=100",
        "--set",
        "early_stopping.enabled=false",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = run / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 120
    killed_epoch = -1
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if last.is_file() and torch.load(last, weights_only=True)["epoch"] >= 1:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()
    saved = torch.load(last, weights_only=True)
    killed_step, killed_epoch = saved["global_step"], saved["epoch"]
    assert killed_step > 0
    assert not (run / "best.ckpt").exists()  # it really died mid-training

    resumed = run_cli(
        "train",
        "--run",
        str(run),
        "--config",
        TINY,
        "--resume",
        "--set",
        f"trainer.max_epochs={killed_epoch + 3}",
        "--set",
        "early_stopping.enabled=false",
        check=True,
    )
    assert f"global step {killed_step}" in resumed.stdout
    entry = manifest(run)["checkpoint"]
    steps_per_epoch = killed_step // (killed_epoch + 1)
    # this session's seconds, beside the steps it trained, not the run's totals alone
    assert f"from step {killed_step} to {entry['global_step']} in " in resumed.stdout
    assert f"({killed_epoch + 3} epochs in all)" in resumed.stdout
    assert entry["resumed_from_step"] == killed_step
    assert entry["global_step"] == killed_step + 2 * steps_per_epoch  # continued, not restarted
    assert entry["epochs"] == killed_epoch + 3


def test_make_maps_resume_flag() -> None:
    for yes in ("1", "yes", "true"):
        out = make_n("train", f"RESUME={yes}", "RUN=runs/x")
        assert "lightship train --run runs/x" in out and "--resume" in out
    for no in ("0", "no", "false", ""):  # any word at all resumed
        out = make_n("train", f"RESUME={no}", "RUN=runs/x")
        assert "lightship train --run runs/x" in out and "--resume" not in out, no
    # resumed with the run's own config.yaml, unless CONFIG is given on make's command line: one
    # left in the shell's environment (a generic name) was passed, and its settings refused
    env = {**os.environ, "MAKEFLAGS": "", "PWD": str(ROOT), "CONFIG": "configs/tiny.yaml"}
    out = subprocess.run(
        ["make", "-n", "train", "RESUME=1", "RUN=runs/x"],
        cwd=ROOT, capture_output=True, text=True, check=True, env=env,
    ).stdout  # fmt: skip
    assert "--resume" in out and "--config" not in out, out
    out = make_n("train", "RESUME=1", "RUN=runs/x", "CONFIG=configs/tiny.yaml")
    assert "--config configs/tiny.yaml --resume" in out, out


def test_make_help_lists_every_args_variable_and_stages_say_where_args_go() -> None:
    makefile = (ROOT / "Makefile").read_text()
    variables = re.findall(r"^([A-Z_]*ARGS) *\?=", makefile, re.M)
    assert {"ARGS", "EXPORT_ARGS", "QUANTIZE_ARGS", "REPORT_ARGS", "SERVE_ARGS"} <= set(variables)
    lines = subprocess.run(
        ["make", "help"], cwd=ROOT, capture_output=True, text=True, check=True,
        env={**os.environ, "MAKEFLAGS": "", "PWD": str(ROOT)},  # make run in the checkout
    ).stdout.splitlines()  # fmt: skip
    lines = lines[lines.index("variables:") :]
    for var in variables:
        assert sum(f" {var}=" in line for line in lines) == 1, var
    proc = subprocess.run(
        ["make", "-n", "quantize", "RUN=runs/x", "ARGS=--methods static",
         "QUANTIZE_ARGS=--methods dynamic"],
        cwd=ROOT, capture_output=True, text=True, check=True, env={**os.environ, "MAKEFLAGS": ""},
    )  # fmt: skip
    assert "lightship quantize --run runs/x --methods dynamic" in proc.stdout
    assert "ARGS is passed to training only" in proc.stderr
    assert "quantize takes QUANTIZE_ARGS" in proc.stderr
    proc = subprocess.run(  # with train among the goals, where ARGS goes is plain: no note
        ["make", "-n", "train", "export", "quantize", "RUN=runs/x", "ARGS=--set seed=1"],
        cwd=ROOT, capture_output=True, text=True, check=True, env={**os.environ, "MAKEFLAGS": ""},
    )  # fmt: skip
    assert "lightship train --run runs/x --config configs/digits.yaml --set seed=1" in proc.stdout
    assert "note:" not in proc.stderr, proc.stderr


def stand_in_make(
    tmp_path: Path, script: str
) -> tuple[Path, Callable[..., subprocess.CompletedProcess[str]]]:
    """A trained and exported RUN (empty files) and `make ARGS` on it, whose recipes run
    `script` (sh) as lightship."""
    bin_dir, run = tmp_path / "bin", tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "best.ckpt").touch()
    (run / "export/model.onnx").touch()
    bin_dir.mkdir()
    stand_in = bin_dir / "lightship"
    stand_in.write_text(f"#!/bin/sh\n{script}\n")
    stand_in.chmod(0o755)
    env = {**os.environ, "MAKEFLAGS": "", "PYTHONPATH": str(ROOT / "src"), "PWD": str(ROOT)}

    def make(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["make", "-s", *args, f"BIN={bin_dir}", f"STAMP={stand_in}", f"RUN={run}"],
            cwd=ROOT, capture_output=True, text=True, env=env,
        )  # fmt: skip

    return run, make


def test_make_stages_next_line_names_no_stage_make_runs_after_them(tmp_path: Path) -> None:
    # each recipe's lightship (a stand-in printing the `next:` line the real stage would) sees
    # which stages the same make runs after it
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(
        "import os, sys\nfrom pathlib import Path\nfrom lightship.runs import next_command\n"
        "from lightship.serve.settings import unknown_variables\n"
        "print(*unknown_variables(os.environ), sep='\\n')  # make's own variable is no typo\n"
        "after = {'train': 'export', 'export': 'quantize', 'quantize': 'report'}\n"
        "if sys.argv[1] in after:\n"
        "    print(sys.argv[1], 'next:', next_command(after[sys.argv[1]], Path(sys.argv[3])))\n"
    )
    run, run_make = stand_in_make(tmp_path, f'exec {sys.executable} {stand_in} "$@"')

    def make(*args: str) -> list[str]:
        proc = run_make(*args)
        assert proc.returncode == 0, proc.stderr
        return [line for line in proc.stdout.splitlines() if line]

    ahead = f"make quantize RUN={run}   (or `lightship quantize --run {run}`)"
    assert make("export") == [f"export next: {ahead}"]
    assert make("export", "quantize") == [
        "export next: quantize, which make runs now",
        "quantize next: report, which make runs now",  # the report in quantize's recipe
    ]
    assert make("serve") == []  # the server warned of LIGHTSHIP_MAKE_GOALS as a typo
    (run / "best.ckpt").unlink()  # trained and exported first, then quantized
    (run / "export/model.onnx").unlink()
    assert make("quantize", "CONFIG=configs/tiny.yaml") == [
        "train next: export, which make runs now",
        "export next: quantize, which make runs now",
        "quantize next: report, which make runs now",
    ]


@pytest.mark.parametrize("signal_or_code", ["-9", "3"])
def test_make_says_why_a_stage_killed_outright_printed_nothing(
    tmp_path: Path, signal_or_code: str
) -> None:
    """An out-of-memory kill leaves no word from lightship itself: make's `Error 137` was all. A
    stage that failed on its own (exit 3, its error printed) gets no such line."""
    end = "kill -9 $$" if signal_or_code == "-9" else f"exit {signal_or_code}"
    _, make = stand_in_make(tmp_path, end)
    said = {}
    for target in ("train", "export", "quantize", "report", "serve"):
        proc = make(target)
        assert proc.returncode == 2, proc.stderr  # make's own failure, as before
        said[target] = [line for line in proc.stderr.splitlines() if "killed (SIGKILL)" in line]
    if signal_or_code == "3":
        assert not any(said.values()), said
        return
    for target, lines in said.items():
        assert len(lines) == 1 and lines[0].startswith(f"make: lightship {target} was killed")
        assert "out-of-memory killer" in lines[0] and "then make again" in lines[0]
    assert "--set data.batch_size=32" in said["train"][0] and "RESUME=1" in said["train"][0]


def test_make_stages_build_what_they_need(exported_run: Path, tmp_path: Path) -> None:
    # a fresh RUN given with its CONFIG: report and serve train and export first
    fresh = tmp_path / "fresh"
    for target in ("report", "serve"):
        out = make_n(target, f"RUN={fresh}", "CONFIG=configs/tiny.yaml")
        assert f"lightship train --run {fresh}" in out, out
        assert f"lightship export --run {fresh}" in out, out
    # an exported run is never exported again by file times: `cp -r` gives best.ckpt a newer
    # one, and a re-export would delete the run's int8 models and report. A new best.ckpt from
    # training deletes model.onnx itself, and a missing model.onnx is exported.
    run = tmp_path / "exported"
    shutil.copytree(exported_run, run)
    onnx, best = run / "export" / "model.onnx", run / "best.ckpt"
    for offset in (-(10**9), 10**9):
        os.utime(best, ns=(onnx.stat().st_mtime_ns + offset,) * 2)
        for target in ("quantize", "report", "serve"):
            assert "lightship export" not in make_n(target, f"RUN={run}"), (target, offset)
    onnx.unlink()
    for target in ("quantize", "report", "serve"):
        out = make_n(target, f"RUN={run}")
        assert f"lightship export --run {run}" in out and "lightship train" not in out, target


def test_bad_inputs_exit_with_one_line(tmp_path: Path) -> None:
    cases = [
        (
            ["--set", "trainer.max_epoch=3"],
            2,
            "unknown key 'trainer.max_epoch'; allowed in trainer:",
        ),
        (["--set", "data.batch_size=big"], 2, "'data.batch_size' = 'big'"),
        (
            ["--set", "data.source=folder", "--set", f"data.path={tmp_path}/missing"],
            3,
            f"image folder {tmp_path}/missing does not exist",
        ),
        (["--resume"], 4, "cannot resume: no"),
    ]
    for extra, code, message in cases:
        proc = run_cli("train", "--run", str(tmp_path / "bad"), "--config", TINY, *extra)
        assert proc.returncode == code, (extra, proc.stderr)
        assert last_line(proc.stderr).startswith("error: ")
        assert message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_unwritable_output_fails_before_training(tmp_path: Path) -> None:
    run = tmp_path / "blocked"
    (run / "best.ckpt").mkdir(parents=True)  # written after the last epoch
    proc = run_cli("train", "--run", str(run), "--config", TINY)
    assert proc.returncode == 4, proc.stderr
    assert last_line(proc.stderr) == (
        f"error: {run / 'best.ckpt'} is a folder where a file goes: move it away and run again"
    )
    assert not list(run.glob("checkpoints/*.ckpt")) and not (run / "logs").exists()


def test_corrupt_checkpoint_for_resume(tmp_path: Path) -> None:
    run = tmp_path / "corrupt"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"PK\x03\x04 truncated zip")
    proc = run_cli("train", "--run", str(run), "--config", TINY, "--resume")
    assert proc.returncode == 4
    line = last_line(proc.stderr)
    assert line.startswith(f"error: checkpoint {run}/checkpoints/last.ckpt is corrupt")
    assert "delete it and train again" in line
    assert "Traceback" not in proc.stderr


def test_bench_train_measures_every_setting(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = run_cli(
        "bench",
        "train",
        "--config",
        str(CONFIGS / "tiny.yaml"),
        "--steps",
        "2",
        "--out",
        str(out),
        check=True,
    )
    rows = json.loads(out.read_text())["rows"]
    settings = {(r["input"], r["num_workers"], r["precision"]) for r in rows}
    assert len(settings) == 8  # float32/uint8 x workers 0/2 x precision 32/bf16-mixed
    by_input = {r["input"]: r["bytes_per_batch"] for r in rows}
    assert by_input["float32"] == 4 * by_input["uint8"]  # the uint8 contract moves 4x fewer bytes
    assert all(r["steps"] == 2 and r["steps_per_s"] > 0 for r in rows)
    # in a log (no terminal) the table keeps each row whole: 80 columns cut "2.13x (1.60–3.…"
    for r in rows:
        assert f"{r['vs_first']:.2f}x" in proc.stdout, proc.stdout
    assert "…" not in proc.stdout, proc.stdout


def test_ddp_on_two_cpu_processes(tmp_path: Path) -> None:
    run = tmp_path / "ddp"
    proc = run_cli(
        "train", "--run", str(run), "--config", TINY,
        "--set", "trainer.devices=2", "--set", "trainer.strategy=ddp",
        "--set", "trainer.log_every_n_steps=10",
        check=True,
    )  # fmt: skip
    entry = manifest(run)["checkpoint"]
    # ~1,260 training images, batch 128: 10 batches an epoch on one process, 5 on each of two.
    assert entry["global_step"] == 4 * 5, proc.stdout
    # logging every 10 steps was cut to an epoch of one process's batches, not of all of them
    assert "log_every_n_steps" not in proc.stderr
    assert entry["test_acc"] > 0.3  # learned something, far above chance (0.1)
    assert (run / "best.ckpt").is_file()


def test_the_logging_interval_is_cut_to_an_epoch_of_each_ddp_process() -> None:
    from lightship.train.fit import _train_batches

    cfg = load_config(TINY)  # batch 128
    assert _train_batches(cfg, 1260) == 10
    assert _train_batches(cfg, 1260, processes=2) == 5  # DistributedSampler: 630 images each
    assert _train_batches(cfg, 1290, processes=2) == 6  # 645 each
    # 641 each, one of them padded: a last batch of one image is left out (`drops_last`)
    assert _train_batches(cfg, 1281, processes=2) == 5


def fake_downstream(run: Path) -> list[Path]:
    """As if exported, quantized and reported from RUN/best.ckpt: listed files, a QAT entry
    with a second file, the report's three files and an int8 model an export unlisted."""
    data = json.loads((run / "manifest.json").read_text())
    data["artifacts"]["onnx-fp32"] = {"file": "export/model.onnx"}
    data["artifacts"]["onnx-int8-qat"] = {
        "file": "quantize/model.int8-qat.onnx",
        "file_ckpt": "quantize/qat.ckpt",
    }
    (run / "manifest.json").write_text(json.dumps(data))
    files = [
        run / "export" / "model.onnx",
        run / "quantize" / "model.int8-qat.onnx",
        run / "quantize" / "qat.ckpt",
        run / "quantize" / "model.int8-static.onnx",  # unlisted by a re-export, still on disk
        run / "report" / "report.json",
        run / "report" / "report.md",
        run / "report" / "pareto.png",
    ]
    for f in files:
        f.parent.mkdir(exist_ok=True)
        f.write_text('{"recommended": "onnx-int8-qat"}' if f.name == "report.json" else "old")
    return files


def make_n(*args: str) -> str:
    return subprocess.run(
        ["make", "-n", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MAKEFLAGS": "", "PWD": str(ROOT)},  # make run in the checkout
    ).stdout


def test_refused_settings_change_nothing_and_a_new_best_deletes_old_artifacts(
    tiny_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "again"
    shutil.copytree(tiny_run, run)
    downstream = fake_downstream(run)
    old_sha = manifest(run)["checkpoint"]["sha256"]
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    config = (run / "config.yaml").read_text()

    proc = run_cli("train", "--run", str(run), "--config", TINY, "--set", "trainer.devices=0")
    assert proc.returncode == 2, proc.stderr
    line = last_line(proc.stderr)
    assert (
        line.startswith("error: Lightning refused the trainer settings") and "fix trainer.*" in line
    )
    # refused before anything was touched: the old checkpoints (resume!) and config stay
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == checkpoints
    assert (run / "config.yaml").read_text() == config

    proc = run_cli(
        "train", "--run", str(run), "--config", TINY, "--set", "trainer.max_epochs=1", check=True
    )
    assert (  # the int8 model a re-export unlisted, named as it goes
        "the new best.ckpt outdates onnx-fp32, onnx-int8-qat, quantize/model.int8-static.onnx, "
        "the report of this run: deleted; re-run"
    ) in proc.stdout
    assert list(manifest(run)) == ["checkpoint"]
    new_sha = manifest(run)["checkpoint"]["sha256"]
    assert new_sha != old_sha and new_sha == sha256_file(run / "best.ckpt")
    # the disk matches the manifest: no old model or report left for make or a reader to take,
    # nor the folders that held them
    assert [f for f in downstream if f.exists()] == []
    assert not {"export", "quantize", "report"} & {p.name for p in run.iterdir()}
    assert (run / "best.ckpt").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    assert "lightship export --run" in make_n("quantize", f"RUN={run}")


def test_a_new_best_checkpoint_is_hashed_once(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a checkpoint can be hundreds of MB: RUN/best.ckpt is a copy of the file already hashed
    fit_module = importlib.import_module("lightship.train.fit")  # the package exports fit()
    run = tmp_path / "hashed"
    shutil.copytree(tiny_run, run)
    hashed: list[Path] = []

    def counting(path: Path) -> str:
        hashed.append(path)
        return sha256_file(path)

    monkeypatch.setattr(fit_module, "sha256_file", counting)
    fit_module.fit(load_config(TINY, ["trainer.max_epochs=1"]), RunDir(run))
    assert len(hashed) == 1, hashed
    assert manifest(run)["checkpoint"]["sha256"] == sha256_file(run / "best.ckpt")


def test_resuming_a_finished_run_without_its_manifest_records_it_and_trains_nothing(
    tiny_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "lost_manifest"
    shutil.copytree(tiny_run, run)
    entry = manifest(run)["checkpoint"]
    (run / "manifest.json").unlink()
    proc = run_cli("train", "--run", str(run), "--resume", check=True)
    assert f"nothing to train: {run} already finished 4 epochs (step 40); its best.ckpt is " in (
        proc.stdout
    )
    assert "trained digits_cnn" not in proc.stdout
    again = manifest(run)["checkpoint"]
    assert (again["sha256"], again["global_step"]) == (entry["sha256"], entry["global_step"])
    assert again["train_seconds"] is None  # the manifest that knew it is gone


def test_resuming_a_finished_run_keeps_its_exports_and_report(
    exported_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "finished"
    shutil.copytree(exported_run, run)
    downstream = fake_downstream(run)
    before = {p: p.read_bytes() for p in [run / "manifest.json", run / "best.ckpt", *downstream]}
    best_mtime = (run / "best.ckpt").stat().st_mtime_ns
    proc = run_cli("train", "--run", str(run), "--resume", check=True)
    assert proc.stdout.splitlines()[-2:] == [
        f"nothing to train: {run} already finished 4 epochs (step 40); best.ckpt, exports, "
        "quantized models and report kept",
        # all made: what is left is to serve it
        f"next: make serve RUN={run}   (or `lightship serve --run {run}`)",
    ], proc.stdout
    assert "outdates" not in proc.stdout
    assert "is not empty" not in proc.stderr  # Lightning's warning about the kept checkpoints
    assert {p: p.read_bytes() for p in before} == before  # manifest, best.ckpt, exports, report
    assert (run / "best.ckpt").stat().st_mtime_ns == best_mtime  # make re-exports nothing
    assert {"onnx-fp32", "torchscript", "onnx-int8-qat"} <= set(manifest(run))
    assert manifest(run)["checkpoint"]["sha256"] == sha256_file(run / "best.ckpt")


@pytest.mark.parametrize("damage", ["deleted", "swapped"])
def test_resuming_puts_back_a_lost_best_checkpoint_and_keeps_what_was_made_from_it(
    damage: str, exported_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / damage
    shutil.copytree(exported_run, run)
    downstream = fake_downstream(run)
    before = {p: p.read_bytes() for p in [run / "manifest.json", run / "best.ckpt", *downstream]}
    if damage == "deleted":
        (run / "best.ckpt").unlink()
    else:
        swap_checkpoint(run)
    # as `make report` runs it for a run without best.ckpt: report is what make runs next, not
    # the serve the run would come to (the line said "next: make serve RUN=..."); the export
    # make runs only where the run lacks it is not (`make docker-model`: no stage next)
    goal = "report" if damage == "deleted" else "docker-model"
    goals = {"LIGHTSHIP_MAKE_GOALS": goal, "LIGHTSHIP_MAKE_THEN": "export"}
    proc = run_cli("train", "--run", str(run), "--resume", env=goals, check=True)
    assert "best.ckpt restored from checkpoints/" in proc.stdout, proc.stdout
    assert f"nothing to train: {run} already finished 4 epochs" in proc.stdout
    assert proc.stdout.splitlines()[-1] == (
        "next: report, which make runs now"
        if goal == "report"
        else f"next: make serve RUN={run}   (or `lightship serve --run {run}`)"
    ), proc.stdout
    assert "outdates" not in proc.stdout
    assert {p: p.read_bytes() for p in before} == before  # best.ckpt as it was, exports, report


def test_a_resume_that_cannot_load_its_best_checkpoint_loses_nothing(
    exported_run: Path, tmp_path: Path
) -> None:
    """best.ckpt gone and the top-k checkpoint it came from corrupt: the resume fails, and
    exports, int8 models and report stay (they were deleted before the load failed)."""
    run = tmp_path / "corrupt-top"
    shutil.copytree(exported_run, run)
    downstream = fake_downstream(run)
    before = {p: p.read_bytes() for p in [run / "manifest.json", *downstream]}
    (run / "best.ckpt").unlink()
    top = run / manifest(run)["checkpoint"]["source_checkpoint"]
    top.write_bytes(top.read_bytes()[:1000])
    proc = run_cli("train", "--run", str(run), "--resume")
    assert proc.returncode == 4, proc.stderr
    assert "is corrupt" in last_line(proc.stderr) and "outdates" not in proc.stdout
    assert {p: p.read_bytes() for p in before} == before


def test_a_finished_run_that_lost_best_ckpt_and_its_source_makes_it_from_last_ckpt(
    exported_run: Path, tmp_path: Path
) -> None:
    """The same weights, maybe, but another file than the exports were made from: they go,
    named, and the last line says where best.ckpt came from."""
    run = tmp_path / "from-last"
    shutil.copytree(exported_run, run)
    fake_downstream(run)
    (run / "best.ckpt").unlink()
    for top in (run / "checkpoints").glob("epoch=*.ckpt"):
        top.unlink()
    last = run / "checkpoints" / "last.ckpt"  # tiny's best is its last epoch: made another file
    torch.save({**torch.load(last, weights_only=False), "note": "rewritten"}, last)
    proc = run_cli("train", "--run", str(run), "--resume", check=True)
    assert "the new best.ckpt outdates onnx-fp32, " in proc.stdout, proc.stdout
    assert "best.ckpt made again from checkpoints/last.ckpt and recorded" in proc.stdout
    entry = manifest(run)["checkpoint"]
    assert entry["sha256"] == sha256_file(run / "best.ckpt") and entry["train_seconds"] is None


def test_a_finished_run_that_lost_its_manifest_says_what_its_resume_deletes(
    exported_run: Path, tmp_path: Path
) -> None:
    """Nothing records what the exports were made from any more, so they go: said, file by
    file, not silently."""
    run = tmp_path / "no-manifest"
    shutil.copytree(exported_run, run)
    fake_downstream(run)
    (run / "manifest.json").unlink()
    proc = run_cli("train", "--run", str(run), "--resume", check=True)
    said = next(line for line in proc.stdout.splitlines() if "were made from" in line)
    assert said.startswith("manifest.json does not record what export/model.onnx, "), said
    for gone in ("export/model.onnx", "quantize/model.int8-static.onnx"):
        assert gone in said and not (run / gone).exists(), said
    assert "the report" in said and not (run / "report" / "report.json").exists()
    assert "its best.ckpt is recorded in manifest.json again" in proc.stdout, proc.stdout
    assert manifest(run)["checkpoint"]["train_seconds"] is None  # not this session's 0.2 s


@pytest.mark.parametrize("foreign", [False, True])
def test_a_finished_run_that_lost_its_checkpoint_entry_keeps_what_records_its_source(
    foreign: bool, exported_run: Path, tmp_path: Path
) -> None:
    """Exports record the sha256 of the checkpoint they came from, int8 models that of their
    model.onnx: where only the checkpoint's entry was lost, the resume keeps those made from
    the best.ckpt it records again, with the report. An export of another checkpoint goes,
    and the report, which measured it, with it."""
    run = tmp_path / "lost-entry"
    shutil.copytree(exported_run, run)
    data = json.loads((run / "manifest.json").read_text())
    artifacts = data["artifacts"]
    best = artifacts.pop("checkpoint")
    assert artifacts["onnx-fp32"]["source_checkpoint_sha256"] == best["sha256"]
    int8 = run / "quantize" / "model.int8-static.onnx"
    int8.parent.mkdir()
    int8.write_text("int8")
    artifacts["onnx-int8-static"] = {
        "file": "quantize/model.int8-static.onnx",
        "source_sha256": artifacts["onnx-fp32"]["sha256"],
    }
    if foreign:
        artifacts["torchscript"]["source_checkpoint_sha256"] = "0" * 64
    (run / "manifest.json").write_text(json.dumps(data))
    (run / "report").mkdir()
    (run / "report" / "report.json").write_text('{"recommended": "onnx-int8-static"}')
    files = [run / "export" / "model.onnx", int8, run / "report" / "report.json"]
    before = {p: p.read_bytes() for p in files}
    proc = run_cli("train", "--run", str(run), "--resume", check=True)
    kept = manifest(run)
    assert kept["checkpoint"]["sha256"] == best["sha256"]
    assert {"onnx-fp32", "onnx-int8-static"} <= set(kept)
    assert all(p.read_bytes() == before[p] for p in files[:2])  # model.onnx, the int8 model
    said = proc.stdout.splitlines()
    if foreign:
        assert "torchscript" not in kept and not (run / "export" / "model.ts").exists()
        assert not (run / "report" / "report.json").exists()
        # what to run makes only what went again: not the kept ones, whose int8 model a new
        # model.onnx would outdate
        flag = "--formats torchscript"
        assert (
            "manifest.json does not record what torchscript, the report of this run were "
            f"made from: deleted; re-run `make export report RUN={run} EXPORT_ARGS='{flag}'`"
        ) in said, proc.stdout
        assert said[-1] == (
            f"next: make export RUN={run} EXPORT_ARGS='{flag}'   "
            f"(or `lightship export --run {run} {flag}`)"
        )
        run_cli("export", "--run", str(run), *flag.split(), check=True)
        assert (run / "export" / "model.ts").is_file() and "torchscript" in manifest(run)
        assert all(p.read_bytes() == before[p] for p in files[:2])
    else:
        assert "torchscript" in kept and (run / "export" / "model.ts").is_file()
        assert (run / "report" / "report.json").read_bytes() == before[files[2]]
        assert not any("were made from" in line for line in said), proc.stdout
        assert (
            "onnx-fp32, torchscript, onnx-int8-static and the report kept: their entries "
            "record this best.ckpt"
        ) in said, proc.stdout
        assert "its best.ckpt is recorded in manifest.json again: test_acc" in proc.stdout
        assert said[-1] == f"next: make serve RUN={run}   (or `lightship serve --run {run}`)"


def test_a_run_whose_config_yaml_is_broken_resumes_with_the_config_it_trained_with(
    tiny_run: Path, tmp_path: Path
) -> None:
    """As the error about the broken file advises. The onecycle check compared with
    config.yaml, so that advice was refused too; the schedule's own length is checked now."""
    run = tmp_path / "broken-config"
    shutil.copytree(tiny_run, run)
    with (run / "config.yaml").open("a") as f:
        f.write("trainer: [\n")
    refused = run_cli("train", "--run", str(run), "--resume")
    assert refused.returncode == 2
    assert "resume with the config the run was trained with" in last_line(refused.stderr)
    proc = run_cli("train", "--run", str(run), "--resume", "--config", TINY, check=True)
    assert f"nothing to train: {run} already finished 4 epochs" in proc.stdout, proc.stdout
    longer = ["--resume", "--config", TINY, "--set", "trainer.max_epochs=5"]
    proc = run_cli("train", "--run", str(run), *longer)
    assert proc.returncode == 2, proc.stderr
    assert re.search(r"schedule was made for (\d+) steps, and these settings plan", proc.stderr)


def test_a_broken_config_resume_counts_accumulated_steps_and_checks_the_scheduler(
    tmp_path: Path,
) -> None:
    """Without config.yaml, the steps these settings plan (batches / accumulation x
    epochs) are held to the checkpoint's OneCycleLR total_steps, and a resume that drops
    onecycle is refused as well."""
    run = tmp_path / "accumulated"
    acc = ["--config", TINY, "--set", "trainer.accumulate_grad_batches=2"]
    run_cli("train", "--run", str(run), *acc, check=True)
    with (run / "config.yaml").open("a") as f:
        f.write("trainer: [\n")
    proc = run_cli("train", "--run", str(run), "--resume", *acc, check=True)
    assert "nothing to train" in proc.stdout, proc.stdout
    cosine = run_cli(
        "train", "--run", str(run), "--resume", *acc, "--set", "optim.scheduler=cosine"
    )
    assert cosine.returncode == 2, cosine.stdout + cosine.stderr
    assert "optim.scheduler onecycle -> cosine would not be used" in last_line(cosine.stderr)
    assert "keep optim.scheduler=onecycle" in last_line(cosine.stderr)


def test_a_resume_without_last_ckpt_offers_the_newest_checkpoint(
    tiny_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "no-last"
    shutil.copytree(tiny_run, run)
    (run / "checkpoints" / "last.ckpt").unlink()
    proc = run_cli("train", "--run", str(run), "--resume")
    assert proc.returncode == 4, proc.stderr
    line = last_line(proc.stderr)
    assert "train afresh with `" in line and "RESUME=1 / --resume" not in line, line
    newest = max((run / "checkpoints").glob("epoch=*.ckpt"), key=lambda p: p.stat().st_mtime)
    cp = f"`cp {newest} {run / 'checkpoints' / 'last.ckpt'}`"
    assert cp in line, line
    # afresh with the run's own config, not make's default (which may be another model)
    afresh = line.partition("train afresh with `")[2].partition("`")[0]
    assert f"{run / 'config.yaml'}" in afresh, line
    subprocess.run(shlex.split(cp.strip("`")), check=True)  # as said: it resumes
    again = run_cli("train", "--run", str(run), "--resume", check=True)
    assert "resuming" in again.stdout


def test_make_resumes_a_run_that_lost_its_best_checkpoint(tiny_run: Path) -> None:
    # training anew with make's default config would replace the run with another model
    out = make_n("export", f"RUN={tiny_run}/nowhere", "CONFIG=configs/digits.yaml")
    assert f"lightship train --run {tiny_run}/nowhere --config configs/digits.yaml" in out
    out = make_n("export", f"RUN={tiny_run}", "-B")
    assert re.search(rf"lightship train --run {tiny_run} +--resume", out), out
    out = make_n("export", f"RUN={tiny_run}", "CONFIG=configs/tiny.yaml", "-B")
    assert f"lightship train --run {tiny_run} --config configs/tiny.yaml --resume" in out, out


def test_resume_with_other_model_data_or_schedule_is_refused_untouched(
    tiny_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "resume-changed"
    shutil.copytree(tiny_run, run)
    config = (run / "config.yaml").read_text()
    cases = [
        (["--set", "data.image_size=20"], "different model/data (data.image_size 16 -> 20;"),
        (["--set", "data.split_seed=3"], "different model/data (data.split_seed 0 -> 3):"),
        (["--set", "model.kwargs.stages=[[4]]"], "model.kwargs.stages [[8], [16]] -> [[4]]"),
        # another model's config: its model is what is wrong, not the max_epochs it also sets
        (
            ["--set", "trainer.max_epochs=1", "--set", "data.image_size=20"],
            "different model/data (data.image_size 16 -> 20; model.image_size 16 -> 20):",
        ),
        (
            ["--set", "trainer.max_epochs=6"],
            "the onecycle learning-rate schedule cannot be stretched or changed on resume "
            "(trainer.max_epochs 4 -> 6)",
        ),
        # below the epochs done: Lightning's refusal as fitting started (after config.yaml took
        # the new value), or, one below, nothing trained
        *(
            (
                ["--set", f"trainer.max_epochs={n}"],
                f"it already finished 4 epochs, more than trainer.max_epochs={n}: resume with "
                "trainer.max_epochs=4 or more, or train afresh without --resume",
            )
            for n in (1, 3)
        ),
    ]
    for extra, message in cases:
        proc = run_cli("train", "--run", str(run), "--config", TINY, "--resume", *extra)
        assert proc.returncode == 2, (extra, proc.stderr)
        line = last_line(proc.stderr)
        assert line.startswith(f"error: cannot resume {run}") and message in line, line
        assert "Traceback" not in proc.stderr and "training stopped" not in proc.stderr
        assert (run / "config.yaml").read_text() == config


def test_resuming_a_run_out_of_time_says_so_not_finished(tmp_path: Path) -> None:
    # it said "already finished 0 epochs": the time limit, restored with the checkpoint, stops
    # the resumed run at once, and only a longer one trains on
    run = tmp_path / "timed"
    limit = ["--set", "trainer.max_time_s=0.0001"]
    run_cli("train", "--run", str(run), "--config", TINY, *limit, check=True)
    proc = run_cli("train", "--run", str(run), "--resume", check=True)
    step = manifest(run)["checkpoint"]["global_step"]
    # it said "best.ckpt, exports, quantized models and report kept" of a run never exported,
    # and gave no next: line
    assert proc.stdout.splitlines()[-2:] == [
        f"nothing to train: {run} used up its trainer.max_time_s=0.0001 by step {step} (to "
        "train on, resume with --set trainer.max_time_s= a longer time, or null); best.ckpt "
        "kept",
        f"next: make export RUN={run}   (or `lightship export --run {run}`)",
    ]
    more = ["--set", "trainer.max_time_s=null"]
    proc = run_cli("train", "--run", str(run), "--resume", *more, check=True)
    assert manifest(run)["checkpoint"]["global_step"] > step


def test_resume_on_data_that_changed_is_refused(tiny_run: Path, tmp_path: Path) -> None:
    from lightship.errors import ConfigError, DataError
    from lightship.train.fit import _check_resume_matches

    hparams = torch.load(tiny_run / "best.ckpt", weights_only=False)["hyper_parameters"]
    # the run's own config on the data as it is: make's target here, in the checkout
    afresh = f"train afresh with `make train RUN={tiny_run} CONFIG={tiny_run}/config.yaml`"
    spec, model = hparams["data_spec"], hparams["model_spec"]
    n = spec["fingerprint"].partition(":")[0]
    # the mean and std measured on the changed data moved with it: not news of their own
    changed = SimpleNamespace(
        hparams={
            **hparams,
            "data_spec": {**spec, "fingerprint": "9:0"},
            "model_spec": {**model, "mean": [1.0], "std": [2.0]},
            "input_spec": {**hparams["input_spec"], "mean": [1.0], "std": [2.0]},
        }
    )
    with pytest.raises(DataError) as changed_err:  # exit 3, as quantize and report refuse it
        _check_resume_matches(hparams, changed, RunDir(tiny_run))  # type: ignore[arg-type]
    assert str(changed_err.value) == (
        f"cannot resume {tiny_run}: its data changed since it trained (data images {n} -> 9, "
        f"or changed): put the data back as it was, or {afresh}"
    )
    # more images in a folder holding .jfif files, which an older lightship skipped: that
    # cause is named too, as quantize and report name it
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "1.jfif").touch()
    folder = {**spec, "source": "folder", "path": str(tmp_path)}
    then = {**hparams, "data_spec": {**folder, "fingerprint": "5:a"}}
    now = SimpleNamespace(hparams={**hparams, "data_spec": {**folder, "fingerprint": "6:b"}})
    with pytest.raises(DataError) as later_err:
        _check_resume_matches(then, now, RunDir(tiny_run))  # type: ignore[arg-type]
    assert str(later_err.value) == (
        f"cannot resume {tiny_run}: its data changed since it trained (data images 5 -> 6, or "
        "changed) (or, if nothing changed, an older lightship trained the run and skipped its "
        ".jfif and .jpe files, which this one reads: move them out of the folder to use the "
        f"run): put the data back as it was, or {afresh}"
    )
    # resumed with the run's own config.yaml, which the checkpoint disagrees with: to offer
    # "resume with the run's config" would be to offer what was just refused
    wider = SimpleNamespace(hparams={**hparams, "data_spec": {**spec, "image_size": 20}})
    with pytest.raises(ConfigError) as err:
        _check_resume_matches(hparams, wider, RunDir(tiny_run), own_config=True)  # type: ignore[arg-type]
    assert str(err.value).endswith(
        "its config.yaml and checkpoints/last.ckpt disagree: put back the config.yaml or "
        f"last.ckpt the run trained with, or {afresh}"
    )
    with pytest.raises(ConfigError, match=r"resume with the run's config \("):
        _check_resume_matches(hparams, wider, RunDir(tiny_run))  # type: ignore[arg-type]
    # a run recorded before fingerprints were kept resumes on the data as it is
    old = {**hparams, "data_spec": {k: v for k, v in spec.items() if k != "fingerprint"}}
    _check_resume_matches(old, SimpleNamespace(hparams=hparams), RunDir(tiny_run))  # type: ignore[arg-type]
    # ... unless its own config.yaml measures another mean/std on it: the data reads otherwise
    # (an older lightship read image folders without recursion or the EXIF turn), and neither
    # file it blamed ("config.yaml and last.ckpt disagree") was touched
    moved = {k: changed.hparams[k] for k in ("model_spec", "input_spec")}
    with pytest.raises(DataError) as moved_err:
        read_otherwise = SimpleNamespace(hparams={**old, **moved})
        _check_resume_matches(old, read_otherwise, RunDir(tiny_run), own_config=True)  # type: ignore[arg-type]
    assert str(moved_err.value).startswith(
        f"cannot resume {tiny_run}: the pixel mean/std measured on its data moved since it "
        "trained (model.mean "
    )
    assert str(moved_err.value).endswith(
        "an older lightship trained the run and read it otherwise; put the data back as it "
        f"was, or {afresh}"
    )


def test_resume_from_a_checkpoint_lightning_did_not_write(tmp_path: Path) -> None:
    run = tmp_path / "foreign"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"state_dict": {}}, run / "checkpoints" / "last.ckpt")
    proc = run_cli("train", "--run", str(run), "--config", TINY, "--resume")
    assert proc.returncode == 4, proc.stderr
    line = last_line(proc.stderr)
    assert line.startswith(f"error: cannot resume: {run}/checkpoints/last.ckpt is not a lightship")
    assert "pytorch-lightning_version" in line and "Traceback" not in proc.stderr


def test_resume_a_copied_run_keeps_to_its_own_checkpoints(tiny_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "copied"
    shutil.copytree(tiny_run, run)
    # max_epochs already reached: no new epoch, the best path restored is the old run's
    run_cli("train", "--run", str(run), "--config", TINY, "--resume", check=True)
    source = manifest(run)["checkpoint"]["source_checkpoint"]
    assert source.startswith("checkpoints/epoch="), source
    assert (run / "best.ckpt").read_bytes() == (run / source).read_bytes()


def test_a_copied_run_resumes_into_its_own_last_ckpt_and_top_k(tmp_path: Path) -> None:
    """Lightning forgot a moved run's top k and last.ckpt: the old top-k files stayed beside
    the new ones, the new state went to last-v1.ckpt, and the next --resume read the stale
    last.ckpt and trained the same epoch again."""
    first, run = tmp_path / "first", tmp_path / "copy"
    plain = ["--set", "optim.scheduler=none"]  # onecycle's schedule cannot be lengthened
    run_cli("train", "--run", str(first), "--config", TINY, *plain, "--set",
            "trainer.max_epochs=2", "--set", "checkpoint.save_top_k=1", check=True)  # fmt: skip
    shutil.copytree(first, run)
    more = ["--resume", "--set", "trainer.max_epochs=3"]
    proc = run_cli("train", "--run", str(run), *more, check=True)
    assert "dirpath has changed" not in proc.stderr
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(names) == 2 and names[-1] == "last.ckpt", names  # top 1 and last.ckpt
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["epoch"] == 2
    again = run_cli("train", "--run", str(run), *more, check=True)
    assert "nothing to train" in again.stdout, again.stdout


def test_a_run_early_stopping_ended_resumes_to_nothing_and_keeps_its_best(
    tmp_path: Path,
) -> None:
    """Lightning put the stop back but trained an epoch more: its tie to the old best made a new
    best.ckpt, and the exports, int8 models and report made from the old one were deleted (the
    default digits run stops at 23 of 25 epochs)."""
    run = tmp_path / "stopped"
    never_better = ["--set", "early_stopping.patience=1", "--set", "early_stopping.min_delta=100",
                    "--set", "trainer.max_epochs=6"]  # fmt: skip
    run_cli("train", "--run", str(run), "--config", TINY, *never_better, check=True)
    entry = RunDir(run).artifact("checkpoint")
    assert entry is not None and entry["stopped_early"] and entry["epochs"] == 2
    best = (run / "best.ckpt").read_bytes()
    made = run / "export" / "model.onnx"  # what the resume used to delete
    made.parent.mkdir()
    made.write_bytes(b"an export")
    RunDir(run).record("onnx-fp32", {"file": "export/model.onnx"})

    proc = run_cli("train", "--run", str(run), "--resume", check=True)
    assert (
        f"nothing to train: early stopping ended {run} after 2 epochs (step 20; to train on, "
        "resume with --set early_stopping.enabled=false); best.ckpt and exports kept"
    ) in proc.stdout
    assert (run / "best.ckpt").read_bytes() == best and made.read_bytes() == b"an export"
    assert RunDir(run).artifact("checkpoint") == entry

    proc = run_cli("train", "--run", str(run), "--resume", "--set",
                   "early_stopping.enabled=false", check=True)  # fmt: skip
    assert "trained digits_cnn from step 20 to 60" in proc.stdout, proc.stdout
    assert not made.exists()  # a new best.ckpt: what was made from the old one goes

    # stopped at its last epoch: finished, with no advice to train on that would train nothing
    last = tmp_path / "last"
    run_cli("train", "--run", str(last), "--config", TINY, *never_better[:4],
            "--set", "trainer.max_epochs=2", check=True)  # fmt: skip
    proc = run_cli("train", "--run", str(last), "--resume", check=True)
    assert f"nothing to train: {last} already finished 2 epochs (step 20)" in proc.stdout


def test_models_that_cannot_train_are_refused_before_writing(tmp_path: Path) -> None:
    run = tmp_path / "untrainable"
    models_file = ROOT / "tests" / "failing_models.py"
    asserts = next(  # the line of AssertsItsWidth's assert, which its error points at
        n
        for n, line in enumerate(models_file.read_text().splitlines(), 1)
        if "assert width" in line
    )
    cases = [
        (["--set", "model.name=torch.nn:Identity"], "has no trainable parameters"),
        (
            ["--set", "model.name=mlp", "--set", "model.kwargs={num_classes: 3}"],
            "model.name=mlp model.kwargs={'num_classes': 3} outputs [2, 3] for 2 images, "
            "expected [2, 10]",
        ),
        (
            [
                "--set",
                "model.name=torch.nn:Linear",
                "--set",
                "model.kwargs={in_features: 5, out_features: 10}",
            ],
            "fails on a [2, 1, 16, 16] input: RuntimeError: ",
        ),
        # right for 2 images in eval mode only: export and the server failed on them later
        (
            ["--set", "model.name=tests.failing_models:Squeezes", "--set", "model.kwargs={}"],
            "outputs [10] for 1 image, expected [1, 10] (one logit per class): flatten it to "
            "[N, classes] with torch.flatten(x, 1)",
        ),
        (
            [
                "--set",
                "model.name=tests.failing_models:KeepsSpatialAxes",
                "--set",
                "model.kwargs={}",
            ],
            "outputs [2, 10, 1, 1] for 2 images, expected [2, 10] (one logit per class): "
            "flatten it",
        ),
        (
            [
                "--set",
                "model.name=tests.failing_models:AuxWhileTraining",
                "--set",
                "model.kwargs={}",
            ],
            "outputs tuple for 2 images in training mode, expected [2, 10] (one logit per "
            "class): return one tensor of logits, in training too",
        ),
        (  # trained, then export's ONNX gave bfloat16 logits no runtime of ours returns
            [
                "--set",
                "model.name=tests.failing_models:Bfloat16Logits",
                "--set",
                "model.kwargs={}",
            ],
            "outputs bfloat16 logits, which the runtimes cannot give back: end its forward "
            "with `.float()`",
        ),
        (
            [
                "--set",
                "model.name=tests.failing_models:AssertsItsWidth",
                "--set",
                "model.kwargs={width: 6}",
            ],
            "AssertionError: width must be a multiple of 4, got 6 ("
            f"{models_file}, line {asserts}); check model.kwargs",
        ),
        (  # BatchNorm in batches of one: a traceback once fitting began
            [
                "--set",
                "model.name=resnet",
                "--set",
                "model.kwargs={}",
                "--set",
                "data.image_size=8",
                "--set",
                "data.batch_size=1",
            ],
            "fails on a [1, 1, 8, 8] input in training mode: ValueError: Expected more than 1 "
            "value per channel when training, got input size torch.Size([1, 512, 1, 1]); it "
            "cannot train in batches of one image: set data.batch_size=2 or more",
        ),
    ]
    for extra, message in cases:
        proc = run_cli("train", "--run", str(run), "--config", TINY, *extra)
        assert proc.returncode == 2, (extra, proc.stderr)
        assert message in last_line(proc.stderr), proc.stderr
        assert "Traceback" not in proc.stderr
        assert not run.exists()


def test_a_training_that_fails_before_its_first_checkpoint_leaves_the_run_as_it_was(
    tiny_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "again"
    shutil.copytree(tiny_run, run)
    before = {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()}
    config = (run / "config.yaml").read_text()
    fails = ["--set", "model.name=tests.failing_models:FailsWhileFitting"]

    # Ctrl-C before fitting (the model checked on its first images): it said `interrupted` alone
    proc = run_cli("train", "--run", str(run), "--config", TINY, *fails,
                   "--set", "model.kwargs={steps: 1, error: interrupt}")  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    assert last_line(proc.stderr) == (
        f"interrupted: {run} is as it was (stopped before training began)"
    )
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()} == before

    # Ctrl-C while fitting (Lightning catches it and calls sys.exit(1)): exit 130, one line
    proc = run_cli("train", "--run", str(run), "--config", TINY, *fails,
                   "--set", "model.kwargs={steps: 3, error: interrupt}")  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    assert last_line(proc.stderr) == (
        f"interrupted: {run} is as it was (no checkpoint was written yet)"
    )
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()} == before
    assert (run / "config.yaml").read_text() == config
    assert not list(run.glob(".previous.*"))

    # an error: its traceback (a bug), and the same promise kept
    proc = run_cli("train", "--run", str(run), "--config", TINY, *fails,
                   "--set", "model.kwargs={steps: 3, error: runtime}")  # fmt: skip
    assert proc.returncode == 1 and "failed on purpose at training step 3" in proc.stderr
    assert f"training stopped: {run} is as it was (no checkpoint was written yet)" in proc.stderr
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()} == before
    assert (run / "config.yaml").read_text() == config

    # after its first checkpoint the new training is what a --resume continues
    steps = 3 * 7 + 2  # past the first epoch's checkpoint (tiny: 1259 images, batch 128)
    proc = run_cli("train", "--run", str(run), "--config", TINY, *fails,
                   "--set", f"model.kwargs={{steps: {steps}, error: interrupt}}")  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    # the last line, not one above `interrupted`, says how to go on
    assert last_line(proc.stderr) == (  # with the PYTHONPATH the model's module needs
        f"interrupted: resume with `PYTHONPATH=. make train RESUME=1 RUN={run}`"
    )
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["hyper_parameters"]["model_spec"]["name"].endswith("FailsWhileFitting")
    assert "FailsWhileFitting" in (run / "config.yaml").read_text()
    assert manifest(run)["checkpoint"] == manifest(tiny_run)["checkpoint"]  # best.ckpt: the old


def test_a_new_run_stopped_by_an_error_says_to_train_again_once_it_is_fixed(
    tmp_path: Path,
) -> None:
    # It said "train RUN again with `...`": the command that had just failed, and without the
    # PYTHONPATH the model's module needs (here the tests' folder, this one).
    run = tmp_path / "new"
    proc = run_cli("train", "--run", str(run), "--config", TINY,
                   "--set", "model.name=tests.failing_models:FailsWhileFitting",
                   "--set", "model.kwargs={steps: 3, error: runtime}")  # fmt: skip
    assert proc.returncode == 1 and "failed on purpose at training step 3" in proc.stderr
    assert (
        f"training stopped: no checkpoint was written yet: once the error below is fixed, train "
        f"{run} again with `PYTHONPATH=. make train RUN={run} CONFIG={run / 'config.yaml'}`\n"
    ) in proc.stderr


def test_a_batch_norm_head_trains_where_an_epoch_would_end_in_one_image(tmp_path: Path) -> None:
    # tiny: 1259 training images; in batches of 629 the last holds one, which BatchNorm1d
    # refuses in training mode (a ValueError traceback mid-epoch). That batch is left out.
    from lightship.data.module import drops_last

    assert drops_last(1259, 629) and not drops_last(1259, 128) and not drops_last(1, 128)
    run = tmp_path / "bn"
    proc = run_cli("train", "--run", str(run), "--config", TINY,
                   "--set", "model.name=tests.failing_models:BatchNormHead",
                   "--set", "model.kwargs={}", "--set", "data.batch_size=629",
                   "--set", "trainer.max_epochs=1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "(1 epoch, step 2)" in proc.stdout  # two batches of 629: the last one image is out


def test_resuming_an_older_run_that_recorded_a_path_beside_digits(
    tiny_run: Path, tmp_path: Path
) -> None:
    # before data.path needed its source, `--set data.path=...` alone trained digits and
    # recorded the path in config.yaml and the checkpoints: resuming refused such runs
    run = tmp_path / "older"
    shutil.copytree(tiny_run, run)
    path = "/home/u/mydata.npz"
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("path: null", f"path: {path}", 1))
    assert load_config(config, recorded=True).sources.notes  # the path is in its data section
    for file in (run / "checkpoints").glob("*.ckpt"):
        ckpt = torch.load(file, weights_only=True)
        ckpt["hyper_parameters"]["data_spec"]["path"] = path
        torch.save(ckpt, file)
    entry = manifest(run)["checkpoint"]
    shutil.copyfile(run / entry["source_checkpoint"], run / "best.ckpt")
    entry["data_spec"]["path"] = path
    RunDir(run).record("checkpoint", {**entry, "sha256": sha256_file(run / "best.ckpt")})

    proc = run_cli("train", "--run", str(run), "--config", TINY, "--resume", check=True)
    assert f"nothing to train: {run} already finished 4 epochs" in proc.stdout
    # resumed with its own config.yaml (no --config): the path is left out with a note
    proc = run_cli("train", "--run", str(run), "--resume", check=True)
    assert f"records data.path={path} beside data.source digits" in proc.stdout + proc.stderr
    assert f"nothing to train: {run} already finished 4 epochs" in proc.stdout


def test_resume_without_a_config_continues_with_the_runs_own(tmp_path: Path) -> None:
    run = tmp_path / "own"
    # (no schedule: a cosine one's epochs cannot be added to on resume)
    run_cli("train", "--run", str(run), "--config", TINY, "--set", "trainer.max_epochs=2",
            "--set", "optim.scheduler=none", check=True)  # fmt: skip
    # built-in defaults (batch 64, 28x28 digits) would be refused as a different data spec
    proc = run_cli("train", "--run", str(run), "--resume", "--set", "trainer.max_epochs=3",
                   check=True)  # fmt: skip
    assert manifest(run)["checkpoint"]["epochs"] == 3, proc.stdout


USER_MODELS = """
from torch import nn


class Net(nn.Sequential):
    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__(nn.Flatten(), nn.Linear(in_channels * image_size**2, num_classes))


class Fixed4(nn.Sequential):
    def __init__(self, in_channels: int) -> None:
        super().__init__(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, 4))
"""


def test_a_user_model_run_outside_the_checkout_is_led_by_hints_that_work_there(
    tmp_path: Path,
) -> None:
    # A user with their own model, in their own folder: every hint and fix must be runnable
    # there (no `make`, whose targets live in lightship's checkout) and name the PYTHONPATH
    # every stage that loads the checkpoint needs (report too: its eager baseline).
    (tmp_path / "mm").mkdir()
    (tmp_path / "mm" / "mymodels.py").write_text(USER_MODELS)
    with_path = {"PYTHONPATH": "mm"}
    net = ["--run", "runs/m", "--config", TINY, "--set", "model.name=mymodels:Net"]

    proc = run_cli("train", *net, cwd=tmp_path, env=with_path)
    assert proc.returncode == 2
    assert last_line(proc.stderr) == (
        "error: model 'mymodels:Net' takes no argument 'stages' (it takes in_channels, "
        f"num_classes, image_size): model.kwargs come from {TINY}, written for model "
        "digits_cnn; clear them with --set 'model.kwargs={}'"
    )
    net += ["--set", "model.kwargs={}", "--set", "trainer.max_epochs=1"]  # as the fix says
    proc = run_cli("train", *net, cwd=tmp_path, env=with_path, check=True)
    assert last_line(proc.stdout) == "next: PYTHONPATH=mm lightship export --run runs/m"

    proc = run_cli("report", "--run", "runs/m", "--rounds", "1", cwd=tmp_path)
    assert proc.returncode == 4
    assert last_line(proc.stderr) == (
        "error: checkpoint runs/m/best.ckpt: model 'mymodels:Net': cannot import mymodels "
        "(No module named 'mymodels'): install it, or run with PYTHONPATH=mm (its folder at "
        "training)"
    )
    proc = run_cli("export", "--run", "runs/m", "--formats", "onnx", cwd=tmp_path, env=with_path)
    assert last_line(proc.stdout) == "next: PYTHONPATH=mm lightship quantize --run runs/m"
    proc = run_cli("report", "--run", "runs/m", "--rounds", "1", cwd=tmp_path, env=with_path)
    assert proc.returncode == 0, proc.stderr
    assert last_line(proc.stdout) == "next: lightship serve --run runs/m"  # ONNX: no module


def test_a_model_without_num_classes_is_told_how_many_logits_to_output(tmp_path: Path) -> None:
    # it said "fix model.kwargs (num_classes?)", and num_classes in model.kwargs was refused
    (tmp_path / "mymodels.py").write_text(USER_MODELS)
    fixed = ["train", "--run", str(tmp_path / "f"), "--config", TINY, "--set", "model.kwargs={}"]
    proc = run_cli(*fixed, "--set", "model.name=mymodels:Fixed4", env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 2
    assert last_line(proc.stderr) == (
        "error: model.name=mymodels:Fixed4 model.kwargs={} outputs [2, 4] for 2 images, expected "
        "[2, 10] (one logit per class): it takes no num_classes argument, so it must output 10 "
        "logits (the data has 10 classes) itself: make its output 10 wide, or give its __init__ "
        "a num_classes argument"
    )
    assert not (tmp_path / "f").exists()


class ForgetsAfter(torch.nn.Sequential):
    """A linear classifier whose evaluation, once it has trained `steps` steps in this process,
    answers class 0 for every image: each validation after that scores worse than those before."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int, steps: int) -> None:
        super().__init__(
            torch.nn.Flatten(), torch.nn.Linear(in_channels * image_size**2, num_classes)
        )
        self.steps, self.calls = steps, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += self.training
        out = super().forward(x)
        if not self.training and self.calls > self.steps:
            return torch.zeros_like(out) + torch.arange(out.shape[1], 0, -1)  # class 0 wins
        return out


def test_last_ckpt_holds_the_last_epoch_though_it_did_not_improve(tmp_path: Path) -> None:
    # Lightning 2.6 left last.ckpt at the last epoch that saved a top-k checkpoint: here the
    # 2nd of 4, and `--resume` trained epochs 2 and 3 again
    run = tmp_path / "worse"
    forgets = f"model.name={__name__}:ForgetsAfter"
    steps = 2 * 10  # tiny: 10 steps an epoch, so epochs 2 and 3 validate worse than 0 and 1
    args = ["--set", forgets, "--set", f"model.kwargs={{steps: {steps}}}"]
    args += ["--set", "checkpoint.save_top_k=1", "--set", "early_stopping.enabled=false"]
    longer = ["--set", "trainer.log_every_n_steps=50"]  # than an epoch: Lightning warned of it
    proc = run_cli("train", "--run", str(run), "--config", TINY, *args, *longer, check=True)
    assert "log_every_n_steps" not in proc.stderr
    entry = manifest(run)["checkpoint"]
    assert entry["source_checkpoint"].startswith("checkpoints/epoch=01-")  # the last better one
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert (last["epoch"], last["global_step"]) == (3, 4 * 10)

    proc = run_cli("train", "--run", str(run), "--resume", check=True)
    assert f"nothing to train: {run} already finished 4 epochs (step 40)" in proc.stdout
    assert manifest(run)["checkpoint"] == entry


def test_a_model_whose_code_changed_since_training_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    # The module's layer grew after training: resume was Lightning's 65-line traceback, export
    # "does not fit its model spec: Error(s) in loading state_dict for Classifier:", no more.
    (tmp_path / "mm").mkdir()
    module = tmp_path / "mm" / "mymodels.py"
    module.write_text(USER_MODELS)
    with_path = {"PYTHONPATH": "mm"}
    net = ["--run", "runs/m", "--config", TINY, "--set", "model.name=mymodels:Net"]
    net += ["--set", "model.kwargs={}", "--set", "trainer.max_epochs=1"]
    run_cli("train", *net, cwd=tmp_path, env=with_path, check=True)
    module.write_text(
        USER_MODELS.replace(
            "nn.Linear(in_channels * image_size**2, num_classes)",
            "nn.Linear(in_channels * image_size**2, 8), nn.Linear(8, num_classes)",
        )
    )
    afresh = "`PYTHONPATH=mm lightship train --run runs/m --config runs/m/config.yaml`"
    proc = run_cli("train", "--run", "runs/m", "--resume", cwd=tmp_path, env=with_path)
    assert proc.returncode == 4, proc.stderr
    assert "Traceback" not in proc.stderr
    assert last_line(proc.stderr) == (
        "error: cannot resume runs/m: checkpoints/last.ckpt does not fit model mymodels:Net as "
        'its code builds it now (Missing key(s) in state_dict: "net.2.weight", '
        '"net.2.bias"; and 2 more): put back the model code it trained with, or train '
        f"afresh: {afresh}"
    )
    proc = run_cli("export", "--run", "runs/m", cwd=tmp_path, env=with_path)
    assert proc.returncode == 4, proc.stderr
    assert last_line(proc.stderr).startswith(
        "error: checkpoint runs/m/best.ckpt does not fit model mymodels:Net as its code builds "
        "it now (Missing key(s) in state_dict: "
    )
    assert last_line(proc.stderr).endswith(f"or train it afresh: {afresh}")


def test_the_stages_from_python_leave_torchs_modes_as_they_found_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    # Lightning turned grad on, and trainer.deterministic deterministic algorithms, for the
    # rest of the session (a notebook's later cells)
    from lightship.export.core import export
    from lightship.quantize.core import quantize
    from lightship.report.core import ReportSettings, report
    from lightship.train import fit

    for name in ("CUBLAS_WORKSPACE_CONFIG", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(TINY, ["trainer.max_epochs=1", "trainer.deterministic=true"])
    # importing lightship.train silenced two Lightning warnings for every Trainer
    assert not [f for f in warnings.filters if f[1] is not None and "workers" in f[1].pattern]
    # the caller's generators and threads: fit seeded all three (its "random" shuffles the same
    # in every session after a fit), left PL_GLOBAL_SEED and PL_SEED_WORKERS for the caller's
    # own Trainer, and export and report set the thread count
    request.addfinalizer(functools.partial(torch.set_num_threads, torch.get_num_threads()))
    torch.set_num_threads(1)
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(cfg, tmp_path / "run")
        assert not torch.is_grad_enabled()
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert "PL_GLOBAL_SEED" not in os.environ and "PL_SEED_WORKERS" not in os.environ
    assert torch.get_num_threads() == 1
    # the other stages too: export and report drew from torch's generator, and QAT seeded all
    # three and left PL_GLOBAL_SEED and PL_SEED_WORKERS
    for stage in (
        functools.partial(export, tmp_path / "run", formats="onnx,torchscript"),
        functools.partial(quantize, tmp_path / "run", methods="static,qat"),
        functools.partial(report, tmp_path / "run", ReportSettings(rounds=1, seconds=0.01)),
    ):
        random.seed(7), np.random.seed(7), torch.manual_seed(7)
        with torch.no_grad():
            stage()
            assert not torch.is_grad_enabled()
        assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected, stage
        assert "PL_GLOBAL_SEED" not in os.environ and "PL_SEED_WORKERS" not in os.environ
        assert torch.get_num_threads() == 1
    # the two Lightning warnings lightship's own fit has no use for stay out of it
    assert not [w for w in caught if "many workers" in str(w.message)]
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert (tmp_path / "run" / "best.ckpt").is_file()


def test_a_training_that_diverges_is_refused_and_keeps_the_runs_model(
    exported_run: Path, tmp_path: Path
) -> None:
    """A learning rate far too high: the loss goes NaN, Lightning's early stopping ends the
    training at its first validation without a word, and train said it had trained (exit 0)
    with a best.ckpt of NaN logits, which export then refused. Now an error that says what to
    change, and the run's model and what was made from it stay."""
    run = tmp_path / "diverged"
    shutil.copytree(exported_run, run)
    kept = [run / "best.ckpt", run / "export" / "model.onnx", run / "config.yaml"]
    before = {p: p.read_bytes() for p in [*kept, *(run / "checkpoints").iterdir()]}
    entry = manifest(run)["checkpoint"]
    proc = run_cli("train", "--run", str(run), "--config", str(TINY), "--set", "optim.lr=1e9")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert last_line(proc.stderr) == (
        "error: training diverged (train_loss nan): its best checkpoint gives non-finite logits, "
        "so it is not made best.ckpt (what the run had is kept): train again with a lower "
        "optim.lr (now 1e+09; --set optim.lr=...)"
    )
    # checkpoints/ and config.yaml too: a resume puts best.ckpt back from them
    assert {p: p.read_bytes() for p in [*kept, *(run / "checkpoints").iterdir()]} == before
    assert not list(run.glob(".previous.*"))
    assert manifest(run)["checkpoint"] == entry
    assert "onnx-fp32" in manifest(run)
    # a new run gets no best.ckpt
    proc = run_cli(
        "train", "--run", str(tmp_path / "new"), "--config", str(TINY), "--set", "optim.lr=1e9"
    )
    assert proc.returncode == 2 and not (tmp_path / "new" / "best.ckpt").exists()
    assert not list((tmp_path / "new" / "checkpoints").iterdir())  # nothing to resume from


def test_a_resume_refuses_optimizer_settings_it_would_not_use(
    tiny_run: Path, tmp_path: Path
) -> None:
    """Lightning restores the optimizer's state, its learning rate with it: a resume with
    `--set optim.lr=...` trained on at the old rate and wrote the new one to config.yaml."""
    run = tmp_path / "resumed"
    shutil.copytree(tiny_run, run)
    config = (run / "config.yaml").read_text()
    proc = run_cli("train", "--run", str(run), "--resume", "--set", "optim.lr=0.5")
    assert proc.returncode == 2, proc.stderr
    said = (
        f"error: cannot resume {run}: a resume goes on with the optimizer as "
        "checkpoints/last.ckpt saved it, so optim.lr 0.003 -> 0.5 would not be used: "
    )
    assert last_line(proc.stderr) == (
        f"{said}resume with the run's own config (`make train RESUME=1 RUN={run}`), or train "
        "afresh without --resume"
    )
    assert (run / "config.yaml").read_text() == config
    # momentum is SGD's alone (and OneCycleLR's to set): AdamW's run resumes with another
    proc = run_cli("train", "--run", str(run), "--resume", "--set", "optim.momentum=0.95")
    assert proc.returncode == 0, proc.stderr
    # the run's own config.yaml edited since: the fix names the file and what to put back
    (run / "config.yaml").write_text(config.replace("lr: 0.003", "lr: 0.5"))
    proc = run_cli("train", "--run", str(run), "--resume")
    assert proc.returncode == 2, proc.stderr
    assert last_line(proc.stderr) == (
        f"{said}put back the checkpoint's values in {run / 'config.yaml'} (optim.name: 'adamw', "
        "optim.lr: 0.003, optim.weight_decay: 0.0001), or train afresh without --resume"
    )


def test_a_run_stopped_and_resumed_trains_as_one_that_was_not(tmp_path: Path) -> None:
    """The resume seeded the generators afresh: its first epoch shuffled and augmented as the
    run's first had, and the weights came out otherwise (max difference 0.025 after 3 epochs).
    With the generators' state in each checkpoint they come out the same, bit for bit."""
    plain = ["--config", TINY, "--set", "optim.scheduler=none"]  # epochs may be added
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_cli("train", "--run", str(whole), *plain, "--set", "trainer.max_epochs=3", check=True)
    run_cli("train", "--run", str(resumed), *plain, "--set", "trainer.max_epochs=1", check=True)
    more = ["--resume", "--set", "trainer.max_epochs=3"]
    run_cli("train", "--run", str(resumed), *more, check=True)
    a, b = (
        torch.load(run / "checkpoints" / "last.ckpt", weights_only=True) for run in (whole, resumed)
    )
    assert a["epoch"] == b["epoch"] == 2
    for name, weights in a["state_dict"].items():
        assert torch.equal(weights, b["state_dict"][name]), name


@pytest.mark.parametrize("earlier_score", ["same", "other"])
def test_an_epoch_trained_again_replaces_its_earlier_checkpoint(
    tiny_run: Path, tmp_path: Path, earlier_score: str
) -> None:
    """A resume from a last.ckpt older than the newest top-k checkpoint (kill -9 between the two
    writes; a top-k file copied over a corrupt last.ckpt) trains that epoch again. Its new
    checkpoint went to `-v1` beside the old one, or under another score's name: three top-k
    files for `save_top_k: 2`, and the stale one never removed."""
    run = tmp_path / "again"
    shutil.copytree(tiny_run, run)
    checkpoints = run / "checkpoints"
    top_k = sorted(p.name for p in checkpoints.glob("epoch=*.ckpt"))
    assert len(top_k) == 2, top_k
    older, newest = top_k
    shutil.copy(checkpoints / older, checkpoints / "last.ckpt")  # last.ckpt never got further
    if earlier_score == "other":  # the earlier attempt scored otherwise
        (checkpoints / newest).rename(
            checkpoints / (newest.split("-val_acc=")[0] + "-val_acc=0.0001.ckpt")
        )
    run_cli("train", "--run", str(run), "--resume", check=True)
    assert sorted(p.name for p in checkpoints.iterdir()) == [*top_k, "last.ckpt"]
    assert torch.load(checkpoints / newest, weights_only=True)["epoch"] == int(newest[6:8])


def test_a_run_monitoring_the_loss_keeps_the_lowest_and_records_it_by_name(tmp_path: Path) -> None:
    """`checkpoint.monitor=val_loss` kept mode max: best.ckpt was the epoch of the highest
    loss, recorded in the manifest as its `val_acc`."""
    import csv

    run = tmp_path / "loss"
    run_cli("train", "--run", str(run), "--config", TINY, "--set", "checkpoint.monitor=val_loss",
            "--set", "early_stopping.enabled=false", check=True)  # fmt: skip
    entry = manifest(run)["checkpoint"]
    (log,) = (run / "logs" / "csv").glob("*/metrics.csv")
    rows = csv.DictReader(log.read_text().splitlines())
    losses = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    assert len(losses) == 4 and losses[0] != min(losses)  # it learned: the first is no best
    assert entry["val_loss"] == pytest.approx(min(losses), abs=1e-6) and "val_acc" not in entry
