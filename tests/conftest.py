from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightship import runs

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def run_cli(
    *args: str,
    cwd: Path | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `python -m lightship ARGS` as a user would, capturing output."""
    # `serve` checks its port before it loads the model: a test that expects a model's error
    # must not get "address in use" because something on this machine holds 8000
    port = {"LIGHTSHIP_PORT": "0"} if args[:1] == ("serve",) else {}
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **port, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "lightship", *args],
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"lightship {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny training run shared by the tests that only read its outputs."""
    run = tmp_path_factory.mktemp("runs") / "tiny"
    run_cli("train", "--run", str(run), "--config", str(CONFIGS / "tiny.yaml"), check=True)
    return run


@pytest.fixture(scope="session")
def exported_run(tiny_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny run exported to ONNX and TorchScript, shared read-only: copy it to change it.

    Served, it is the model 'tiny-digits' (the run directory's name)."""
    run = tmp_path_factory.mktemp("exported") / "tiny-digits"
    shutil.copytree(tiny_run, run)
    run_cli("export", "--run", str(run), "--formats", "onnx,torchscript", check=True)
    return run


def rerecord_checkpoint(run: Path) -> None:
    """After a test edits RUN/best.ckpt on purpose: record its new sha256, as `train` would."""
    from lightship.runs import RunDir, sha256_file

    rd = RunDir(run)
    entry = rd.artifact("checkpoint")
    assert entry is not None
    rd.record("checkpoint", {**entry, "sha256": sha256_file(rd.best_ckpt)})


def swap_checkpoint(run: Path) -> None:
    """Put another model's weights in RUN/best.ckpt by hand (one weight changed), unrecorded:
    what a user does when copying a checkpoint into a run."""
    import torch

    ckpt = torch.load(run / "best.ckpt", weights_only=True)
    next(v for v in ckpt["state_dict"].values() if v.is_floating_point()).add_(1)
    torch.save(ckpt, run / "best.ckpt")


@pytest.fixture
def signal_handlers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`runs.watch_interrupts` in this process, with fresh interrupt state, undone afterwards."""
    monkeypatch.setattr(runs, "_interrupted", threading.Event())
    monkeypatch.setattr(runs, "_stopped_by", [])
    monkeypatch.setattr(runs, "_interrupt_note", [])
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    runs.watch_interrupts()
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)
