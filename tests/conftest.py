from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightship import runs

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

# What `make test` sets for the stages it runs (`make -C DIR test` from elsewhere: -C in every
# command a message gives): the tests' own stages are no make's
for _name in (runs.MAKE_GOALS, runs.MAKE_FROM, runs.MAKE_THEN):
    os.environ.pop(_name, None)


def run_cli(
    *args: str,
    cwd: Path | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    check: bool = False,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `python -m lightship ARGS` as a user would, capturing output: a process forked from
    `cli_forkserver` (torch and Lightning imported), or a fresh interpreter where `env` sets
    what is read at import time (but PYTHONPATH, which the fork server sets), or `fresh`."""
    # `serve` checks its port before it loads the model: a test that expects a model's error
    # must not get "address in use" because something on this machine holds 8000
    port = {"LIGHTSHIP_PORT": "0"} if args[:1] == ("serve",) else {}
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **port, **(env or {})}
    if fresh or any(not k.startswith("LIGHTSHIP_") and k != "PYTHONPATH" for k in env or {}):
        proc = subprocess.run(
            [sys.executable, "-m", "lightship", *args],
            cwd=cwd or ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
        )
    else:
        proc = _FORKSERVER.run(list(args), cwd or ROOT, full_env, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"lightship {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


class _ForkServer:
    """The parent's end of `cli_forkserver`: started at the first command, one command at a
    time (the tests run one at a time), and ended with the test session."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def _server(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "cli_forkserver.py")],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        return self._proc

    def _reply(self, server: subprocess.Popen[str], until: float | None) -> str:
        """The server's next line, read a byte at a time from its pipe: a buffered reader
        could take the "exit" line with the "pid" one, and `select` would then wait for it."""
        assert server.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            wait = None if until is None else max(until - time.monotonic(), 0)
            if not select.select([server.stdout], [], [], wait)[0]:
                raise TimeoutError
            byte = os.read(server.stdout.fileno(), 1)
            if not byte:
                raise RuntimeError(f"cli_forkserver.py exited ({server.wait()})")
            line += byte
        return line.split()[1].decode()

    def run(
        self, args: list[str], cwd: Path, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        with self._lock, tempfile.TemporaryDirectory(prefix="lightship-cli-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            server = self._server()
            assert server.stdin is not None
            request = {"argv": args, "cwd": str(cwd), "env": env, "out": str(out), "err": str(err)}
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            pid = int(self._reply(server, time.monotonic() + 120))
            try:
                code = int(self._reply(server, time.monotonic() + timeout))
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self._reply(server, None)
                raise subprocess.TimeoutExpired(
                    args, timeout, out.read_text(errors="replace"), err.read_text(errors="replace")
                ) from None
            except BaseException:  # pytest-timeout, Ctrl-C: the server's next line would be
                os.kill(pid, signal.SIGKILL)  # this command's, read as the next one's
                server.kill()
                self._proc = None
                raise
            return subprocess.CompletedProcess(
                ["lightship", *args], code, out.read_text(), err.read_text()
            )

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            self._proc.wait(timeout=30)


_FORKSERVER = _ForkServer()


@pytest.fixture(scope="session", autouse=True)
def _forkserver_ends_with_the_session() -> Iterator[None]:
    yield
    _FORKSERVER.close()


@pytest.fixture(autouse=True)
def _no_stop_note_from_another_test() -> Iterator[None]:
    """What a stage said to do after a stop (`runs.note_interrupt`) is the process's, as one
    CLI command runs one stage: a test's stages left theirs for the next test's CLI line."""
    from lightship import runs

    runs._interrupt_note.clear()
    yield


# Servers a test starts (`tests.integration.test_serve.Server`): one a failed assertion left
# running (before its test's `stop()`) went on serving after the session, holding its port.
SPAWNED: list[subprocess.Popen[bytes]] = []


@pytest.fixture(autouse=True)
def _no_server_outlives_its_test() -> Iterator[None]:
    """Kill what the test started and left running; a module's server, started before the
    test's own fixtures, is its module's to stop."""
    before = len(SPAWNED)
    yield
    for proc in SPAWNED[before:]:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    del SPAWNED[before:]


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
    """After a test edits RUN/best.ckpt on purpose: record its new sha256 and, where it loads,
    its test accuracy, as `train` would (export refuses a model that scores other than the
    one trained: a forward edited since)."""
    from lightship.callbacks import evaluate
    from lightship.data import DataSpec, load_splits
    from lightship.errors import LightshipError
    from lightship.models.checkpoint import load_checkpoint
    from lightship.runs import RunDir, sha256_file

    rd = RunDir(run)
    entry = rd.artifact("checkpoint")
    assert entry is not None
    entry = {**entry, "sha256": sha256_file(rd.best_ckpt)}
    try:
        loaded = load_checkpoint(rd.best_ckpt)
        splits = load_splits(DataSpec.from_dict(entry["data_spec"]), recorded=True, only=("test",))
    except LightshipError:  # a checkpoint made not to load: its sha256 is what counts
        pass
    else:
        entry["test_acc"] = round(evaluate(loaded.model, splits.test_x, splits.test_y), 6)
    rd.record("checkpoint", entry)


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
