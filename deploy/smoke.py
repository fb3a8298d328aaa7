"""Replay the CPU image without a container engine, serve a model as the container would, check it.

    python deploy/smoke.py                 # serve a handmade model whose logits are known exactly
    python deploy/smoke.py --run runs/default --keep

What it does, reading the Dockerfile rather than repeating it:
1. lists the build context through `.dockerignore` (Docker's matching rules, reimplemented):
   COPY takes files from it only, so a file the context lacks fails here as in `docker build`;
2. runs the `builder` stage: its ENV, WORKDIR and COPY, and its RUN lines verbatim under
   `/bin/sh -c`, with the image's absolute paths (`/opt/...`, `/src`, `/model`) moved under a
   temporary root, so the virtualenv is built by exactly the commands `docker build` runs.
   `python` is a copy of this machine's Python 3.11 as python:*-slim ships its own: the
   standard library without its bytecode (the image deletes every .pyc) and no site-packages;
   each stage starts from it afresh, and the final stage's RUN lines that only run `python`
   are replayed too;
3. checks that virtualenv: exactly the pinned packages of deploy/requirements-serve.txt plus
   lightship, no torch, no Lightning, no pip; measures its size on disk; sets its file times
   as a reproducible build does (BuildKit's rewrite-timestamp); and that the server, importing,
   compiles no module of the standard library or the virtualenv (its USER cannot write their
   bytecode: each start would compile them all);
4. mounts the run directory at `/model`, runs the final stage's ENTRYPOINT + CMD with its ENV
   (as its numeric USER when this runs as root), host and port moved to loopback and a free
   port as `docker run -e` would; its HEALTHCHECK must fail before the server listens and pass
   once it is ready;
5. asks for predictions over the V2 and the `/v1/predict` routes and compares them with the
   expected logits; sends SIGTERM and expects exit code 0.

Only the standard library is needed here; the handmade model needs `onnx` (the project venv).
Other RUN lines of the final stages (useradd) need a real container and are listed as not
replayed.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))
from lock import canonical, read_pins  # noqa: E402  (the sibling script that writes the pins)

# python:3.11-slim's own environment, before the Dockerfile adds to it.
BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
# Paths that exist on this machine as they do in the image; every other absolute path of the
# image (/opt, /src, /model, ...) is moved under the replay's root.
SYSTEM_DIRS = {"usr", "bin", "sbin", "lib", "lib64", "etc", "tmp", "dev", "proc", "sys", "var"}
# How this machine reaches the package index, handed to the replayed RUN lines.
PASS_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")
FORBIDDEN = ("torch", "pytorch-lightning", "lightning")
MODEL_MOUNT = "/model"


class SmokeError(AssertionError):
    pass


# --------------------------------------------------------------------------------------------
# .dockerignore: moby/patternmatcher's rules (`**`, `*`, `?`, `[...]`, `!` exceptions, the last
# matching pattern wins, a pattern that matches a parent directory matches what is inside it).


@dataclass(frozen=True)
class Pattern:
    text: str
    exclusion: bool
    regex: re.Pattern[str]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out, i = "^", 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):  # `**/` matches zero or more directories
                i += 1
                out += "(?:.*/)?"
            else:
                out += ".*"
            continue
        if ch == "*":
            out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                raise ValueError(f"unterminated [ in .dockerignore pattern {pattern!r}")
            body = pattern[i + 1 : end]
            out += "[" + ("^" + body[1:] if body.startswith("^") else body) + "]"
            i = end
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(ch)
        i += 1
    return re.compile(out + "$")


def read_dockerignore(path: Path) -> list[Pattern]:
    patterns = []
    for raw in path.read_text().splitlines() if path.is_file() else []:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exclusion = line.startswith("!")
        text = line[1:].strip() if exclusion else line
        text = os.path.normpath(text).lstrip("/")  # Docker cleans the pattern the same way
        if text in ("", "."):
            continue
        patterns.append(Pattern(text, exclusion, _pattern_regex(text)))
    return patterns


def ignored(rel: str, patterns: list[Pattern]) -> bool:
    parts = rel.split("/")
    parents = ["/".join(parts[: i + 1]) for i in range(len(parts) - 1)]
    matched = False
    for pattern in patterns:
        if pattern.exclusion != matched:  # only a pattern that would change the answer
            continue
        hit = bool(pattern.regex.match(rel)) or any(pattern.regex.match(p) for p in parents)
        if hit:
            matched = not pattern.exclusion
    return matched


def _may_reinclude(rel_dir: str, patterns: list[Pattern]) -> bool:
    """Whether an exception pattern could match something below the ignored directory REL_DIR."""
    dparts = rel_dir.split("/")
    for pattern in patterns:
        if not pattern.exclusion:
            continue
        pparts = pattern.text.split("/")
        for i, dpart in enumerate(dparts):
            if i >= len(pparts) or "**" in pparts[i]:
                return i < len(pparts)
            if not fnmatch.fnmatchcase(dpart, pparts[i]):
                break
        else:
            return True
    return False


def context_files(root: Path, patterns: list[Pattern]) -> list[str]:
    """Relative paths of the files `docker build ROOT` sends as its context."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir
        keep = []
        for name in sorted(dirnames):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if not ignored(rel, patterns) or _may_reinclude(rel, patterns):
                keep.append(name)
        dirnames[:] = keep
        for name in sorted(filenames):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if not ignored(rel, patterns):
                files.append(rel)
    return files


# --------------------------------------------------------------------------------------------
# Dockerfile


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, continuation lines joined and comments dropped."""
    logical: list[tuple[int, str]] = []
    buf, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and buf):
            continue  # comments inside a continued instruction are dropped, as Docker does
        if not buf:
            start = number
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        buf += raw
        if buf.strip():
            logical.append((start, buf.strip()))
        buf = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for number, line in logical:
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(expand(words[0], global_args), name))
        elif not stages:
            if keyword == "ARG":
                key, _, default = args.partition("=")
                global_args[key] = default
        else:
            stages[-1].instructions.append(Instruction(keyword, args, number))
    return global_args, stages


_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def expand(text: str, env: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m[1] or m[3]
        value = env.get(name, "")
        return value if value or m[2] is None else m[2]

    return _VAR.sub(sub, text)


def exec_form(args: str) -> list[str] | None:
    if args.startswith("["):
        value = json.loads(args)
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise SmokeError(f"not an exec-form JSON array: {args}")
        return value
    return None


@dataclass
class Image:
    """What `docker run` would start: the final stage's config, paths already on this machine."""

    root: Path
    env: dict[str, str]  # as the image declares it
    host_env: dict[str, str]  # the same with image paths moved under root
    argv: list[str]
    user: str | None
    exposed: list[int]
    healthcheck: list[str] | None
    workdir: str
    venv: Path
    python: Path  # the interpreter the base image's stand-in is a copy of (USER must reach it)
    not_replayed: list[str]
    build_seconds: float


def world_reachable(path: Path) -> bool:
    """Whether any user may run PATH: it and every folder above it are executable by others."""
    path = path.resolve()
    return all(p.stat().st_mode & 0o001 for p in [path, *path.parents])


def base_python() -> Path:
    """The Python 3.11 that plays the base image's `python`.

    The server runs as the image's non-root USER, so the interpreter the virtualenv links to
    must be reachable by that user (a pyenv build under /root is not): prefer one that is.
    """
    here = Path(getattr(sys, "_base_executable", sys.executable))
    candidates = [here, Path("/usr/local/bin/python3.11"), Path("/usr/bin/python3.11")]
    for candidate in candidates:
        if candidate.is_file() and (os.geteuid() != 0 or world_reachable(candidate)):
            return candidate
    return here


def stand_in_base(python: Path, into: Path) -> Path:
    """PYTHON as python:*-slim ships its Python, copied under INTO: the executable and the
    standard library without bytecode (the image deletes every .pyc, and the tests, for size)
    and without site-packages. This machine's own Python has the bytecode, and with it would
    hide a start that compiles the standard library every time. Returns the executable."""
    where = "import sys, sysconfig; print(sys.prefix); print(sysconfig.get_path('stdlib'))"

    def paths(exe: Path) -> list[Path]:
        out = subprocess.run(
            [str(exe), "-B", "-c", where], capture_output=True, text=True, check=True, timeout=60
        )
        return [Path(line) for line in out.stdout.splitlines()]

    prefix, stdlib = paths(python)
    exe = into / "bin" / stdlib.name  # python3.11: it finds the library next to it
    exe.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(python.resolve(), exe)
    skip = shutil.ignore_patterns(
        *("__pycache__", "*.pyc", "site-packages", "dist-packages", "test", "tests"),
        *("idle_test", "config-*"),  # config-*: libpython to link against, not to run
    )
    lib = into / stdlib.relative_to(prefix)  # lib/python3.11 (lib64/ on some distributions)
    shutil.copytree(stdlib, lib, ignore=skip)  # links' files: a relative one would dangle
    (lib / "site-packages").mkdir()
    if paths(exe)[1] != lib:  # one that took its compiled-in prefix would check nothing
        raise SmokeError(f"a copy of {python} does not use the library copied next to it")
    return exe


def strip_bytecode(python: Path) -> None:
    """The stand-in's standard library as the base image has it again: a stage that ran
    Python wrote bytecode that the next stage, FROM the base image afresh, does not have."""
    for cache in list(python.parent.parent.rglob("__pycache__")):
        shutil.rmtree(cache)


def runs_only_python(command: str) -> bool:
    """A RUN line of the final stage that runs the base image's Python and nothing else, which
    the stand-in can replay (`useradd` and the like need a container)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    words = list(lexer)  # quoted words whole; outside them ;, &&, | ... are words of their own
    return (
        bool(words)
        and words[0] in ("python", "python3")
        and not any(set(w) <= set(lexer.punctuation_chars) for w in words)
    )


class Replay:
    def __init__(self, dockerfile: Path, context: Path, root: Path, log: Path | None = None):
        self.dockerfile = dockerfile
        self.context = context
        self.root = root
        self.log = log
        self.patterns = read_dockerignore(context / ".dockerignore")
        self.allowed = set(context_files(context, self.patterns))
        self.python = base_python()
        self.stand_in = root / ".smoke-python"
        # first on PATH, as the base image's /usr/local/bin; a venv made by its `python` finds
        # the standard library next to it (linked from another folder, a venv took the
        # compiled-in prefix's, this machine's own)
        self.shim = self.stand_in / "bin"
        self.not_replayed: list[str] = []

    def host(self, path: str) -> str:
        """Where the image's absolute PATH lives on this machine."""
        if not path.startswith("/"):
            return path
        first = PurePosixPath(path).parts[1] if path != "/" else ""
        if first in SYSTEM_DIRS:
            return path
        return str(self.root) + (path if path != "/" else "")

    def host_env(self, env: dict[str, str]) -> dict[str, str]:
        out = {k: ":".join(self.host(p) for p in v.split(":")) for k, v in env.items()}
        out["PATH"] = f"{self.shim}:{out.get('PATH', '')}"
        out["HOME"] = "/nonexistent"
        out.update({k: v for k, v in os.environ.items() if k.startswith("PIP_") or k in PASS_ENV})
        return out

    def copy(self, args: str, env: dict[str, str], workdir: str) -> None:
        words = shlex.split(expand(args, env))
        flags = {w.split("=", 1)[0]: w.partition("=")[2] for w in words if w.startswith("--")}
        paths = [w for w in words if not w.startswith("--")]
        sources, dest = paths[:-1], paths[-1]
        dest_abs = dest if dest.startswith("/") else f"{workdir.rstrip('/')}/{dest}"
        into_dir = dest.endswith("/") or len(sources) > 1
        target = Path(self.host(dest_abs))
        for src in sources:
            if "--from" in flags:
                origin = Path(self.host(src))
                if not origin.exists():
                    stage = flags["--from"]
                    raise SmokeError(f"COPY --from={stage} {src}: not built by the replay")
                if origin.resolve() != target.resolve():
                    shutil.copytree(origin, target, symlinks=True, dirs_exist_ok=True)
                continue
            rel = os.path.normpath(src).lstrip("/")
            rel = "" if rel == "." else rel
            if rel in self.allowed:
                out = target / Path(rel).name if into_dir else target
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(self.context / rel, out)
                continue
            below = [f for f in self.allowed if not rel or f.startswith(rel + "/")]
            if not below:
                raise SmokeError(f"COPY {src}: nothing in the build context (see .dockerignore)")
            for f in below:
                out = target / (f[len(rel) + 1 :] if rel else f)
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(self.context / f, out)

    def run(self, command: str, env: dict[str, str], workdir: str, number: int) -> None:
        for path in re.findall(r"(?:^|(?<=[\s\"'=]))(/[\w.+-][\w./+-]*)", command):
            if PurePosixPath(path).parts[1] not in SYSTEM_DIRS:
                raise SmokeError(
                    f"Dockerfile:{number}: RUN uses the absolute path {path}: write it with an ENV "
                    "variable or relative to WORKDIR so that the replay can move it"
                )
        cwd = Path(self.host(workdir))
        cwd.mkdir(parents=True, exist_ok=True)
        with open(self.log or os.devnull, "a") as out:
            print(f"$ {command}", file=out, flush=True)
            started = time.monotonic()
            try:
                proc = subprocess.run(
                    ["/bin/sh", "-c", command],
                    cwd=cwd,
                    env=self.host_env(env),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=900,
                    check=False,
                )
            finally:
                print(f"# {time.monotonic() - started:.1f} s", file=out, flush=True)
        if proc.returncode != 0:
            raise SmokeError(f"Dockerfile:{number}: RUN failed ({proc.returncode}): {command}")

    def base_image(self) -> Path:
        """The base image's Python (`stand_in_base`), first on PATH as `python` and `python3`."""
        if self.stand_in.exists():
            shutil.rmtree(self.stand_in)
        python = stand_in_base(self.python, self.stand_in)
        for name in ("python", "python3"):
            (self.shim / name).symlink_to(python.name)
        return python

    def build(self, target: str | None = None, build_args: dict[str, str] | None = None) -> Image:
        """Replay the stages TARGET (default: the last) needs; what `docker run` would start."""
        global_args, stages = parse_dockerfile(self.dockerfile.read_text())
        global_args.update(build_args or {})
        by_name = {s.name: s for s in stages if s.name}
        chain = stage_chain(stages, target)
        started = time.monotonic()
        python = self.base_image()
        built: set[str] = set()
        for stage in chain:  # first the stages the final one copies from, RUN lines and all
            for inst in stage.instructions:
                match = re.search(r"--from=(\S+)", inst.args) if inst.keyword == "COPY" else None
                if match and match[1] in by_name and match[1] not in built:
                    walk_stage(by_name[match[1]], global_args, new_config(), self, run_lines=True)
                    built.add(match[1])
        strip_bytecode(python)  # what the builder's pip wrote stays in the builder
        config = new_config()
        for stage in chain:
            walk_stage(stage, global_args, config, self, run_lines=False)
        env = config["env"]
        venv = env.get("VIRTUAL_ENV")
        if not venv:
            raise SmokeError("the final stage sets no VIRTUAL_ENV: where is the install?")
        return Image(
            root=self.root,
            env=env,
            host_env=self.host_env(env),
            argv=config["entrypoint"] + config["cmd"],
            user=config["user"],
            exposed=config["exposed"],
            healthcheck=config["health"],
            workdir=config["workdir"],
            venv=Path(self.host(venv)),
            python=self.python,
            not_replayed=self.not_replayed,
            build_seconds=time.monotonic() - started,
        )


def stage_chain(stages: list[Stage], target: str | None = None) -> list[Stage]:
    """TARGET's stage (default: the last) preceded by the stages it is built FROM."""
    by_name = {s.name: s for s in stages if s.name}
    if target is not None and target not in by_name:
        raise SmokeError(f"no stage named {target!r}")
    chain = [by_name[target] if target else stages[-1]]
    while chain[0].base in by_name:
        chain.insert(0, by_name[chain[0].base])
    return chain


def python_runs(dockerfile: Path, target: str | None = None) -> list[tuple[int, str]]:
    """(line, command) of the RUN lines of TARGET's stages (default: the last) that the
    replay runs with the base image's stand-in (`runs_only_python`)."""
    _, stages = parse_dockerfile(dockerfile.read_text())
    return [
        (inst.line, inst.args)
        for stage in stage_chain(stages, target)
        for inst in stage.instructions
        if inst.keyword == "RUN" and runs_only_python(inst.args)
    ]


def new_config() -> dict[str, Any]:
    return {
        "env": dict(BASE_ENV),
        "workdir": "/",
        "user": None,
        "exposed": [],
        "health": None,
        "entrypoint": [],
        "cmd": [],
    }


def image_config(
    dockerfile: Path, target: str | None = None, build_args: dict[str, str] | None = None
) -> dict[str, Any]:
    """The config `docker build --target TARGET` gives the image: env, user, ports, entrypoint..."""
    global_args, stages = parse_dockerfile(dockerfile.read_text())
    global_args.update(build_args or {})
    config = new_config()
    for stage in stage_chain(stages, target):
        walk_stage(stage, global_args, config, None, run_lines=False)
    config["global_args"] = global_args
    return config


def walk_stage(
    stage: Stage,
    global_args: dict[str, str],
    config: dict[str, Any],
    replay: Replay | None,
    run_lines: bool,
) -> None:
    """Apply STAGE's instructions to CONFIG; with REPLAY, also its COPY (and RUN if RUN_LINES)."""
    env = config["env"]
    args: dict[str, str] = {}
    for inst in stage.instructions:
        scope = {**args, **env}
        kw = inst.keyword
        if kw == "ARG":
            key, _, default = inst.args.partition("=")
            args[key] = global_args.get(key, expand(default, scope))
        elif kw == "ENV":
            for word in shlex.split(inst.args):
                key, _, value = word.partition("=")
                env[key] = expand(value, scope)
        elif kw == "WORKDIR":
            path = expand(inst.args, scope)
            config["workdir"] = path if path.startswith("/") else f"{config['workdir']}/{path}"
            if replay:
                Path(replay.host(config["workdir"])).mkdir(parents=True, exist_ok=True)
        elif kw == "COPY" and replay:
            replay.copy(inst.args, scope, config["workdir"])
        elif kw == "RUN" and replay and (run_lines or runs_only_python(inst.args)):
            replay.run(inst.args, scope, config["workdir"], inst.line)
        elif kw == "RUN" and replay:
            replay.not_replayed.append(f"Dockerfile:{inst.line}: RUN {inst.args}")
        elif kw == "USER":
            config["user"] = expand(inst.args, scope)
        elif kw == "EXPOSE":
            ports = expand(inst.args, scope).split()
            config["exposed"] += [int(p.split("/")[0]) for p in ports]
        elif kw == "HEALTHCHECK":
            command = re.sub(r"^(--\S+\s+)*", "", inst.args)
            if not command.startswith("CMD "):
                raise SmokeError(f"Dockerfile:{inst.line}: HEALTHCHECK without CMD")
            body = command[4:].strip()
            config["health"] = exec_form(body) or ["/bin/sh", "-c", body]
        elif kw in ("ENTRYPOINT", "CMD"):
            argv = exec_form(inst.args)
            if argv is None:
                raise SmokeError(f"Dockerfile:{inst.line}: {kw} must be exec form (JSON)")
            if kw == "ENTRYPOINT":
                config["entrypoint"], config["cmd"] = argv, []
            else:
                config["cmd"] = argv


# --------------------------------------------------------------------------------------------
# Checks on the built image and the running server


def disk_mib(path: Path) -> float:
    """Allocated size like `du -s`: every inode once, symlinks not followed."""
    seen, total = set(), 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return (total + os.lstat(path).st_blocks * 512) / 2**20


def installed(venv: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json;"
        "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
    )
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-B", "-c", code],  # -B: no bytecode the image lacks
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return {canonical(k): v for k, v in json.loads(out).items()}


def check_install(image: Image, lock: Path) -> dict[str, str]:
    have = installed(image.venv)
    for name in FORBIDDEN:
        if name in have:
            raise SmokeError(f"{name} {have[name]} is installed in the serving image")
    want = {**read_pins(lock), "lightship": have.get("lightship", "<missing>")}
    if have != want:
        extra = sorted(set(have.items()) - set(want.items()))
        missing = sorted(set(want.items()) - set(have.items()))
        raise SmokeError(f"image venv != {lock.name} + lightship: extra {extra}, missing {missing}")
    return have


# What `lightship serve` imports before its first answer: its command line, the app, uvicorn.
SERVER_IMPORTS = ("lightship.cli", "lightship.serve.app", "uvicorn.server", "uvicorn.lifespan.on")
# Every module imported from source because its bytecode is missing or stale: the import
# system compiles exactly those through SourceFileLoader.source_to_code. The few imported as
# Python starts (encodings, sitecustomize) are asked for their code again.
COMPILED = f"""
import _frozen_importlib_external as external, sys
compiled = []
to_code = external.SourceFileLoader.source_to_code
def counted(self, data, path, *args, **kwargs):
    compiled.append(path)
    return to_code(self, data, path, *args, **kwargs)
external.SourceFileLoader.source_to_code = counted
for module in list(sys.modules.values()):
    spec = getattr(module, "__spec__", None)
    if isinstance(getattr(spec, "loader", None), external.SourceFileLoader):
        spec.loader.get_code(spec.name)
for name in {SERVER_IMPORTS!r}:
    __import__(name)
print("\\n".join(sorted(set(compiled))))
"""


def compiled_at_start(python: Path, env: dict[str, str], under: Path) -> list[str]:
    """The files under UNDER that PYTHON, in ENV, compiles from source as it imports what the
    server does: at every start, when it cannot write their bytecode (the image's USER,
    PYTHONDONTWRITEBYTECODE). Nothing is written here either."""
    proc = subprocess.run(
        [str(python), "-c", COMPILED],
        env={**env, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise SmokeError(f"importing the server failed:\n{proc.stderr[-2000:]}")
    return [path for path in proc.stdout.splitlines() if Path(path).is_relative_to(under)]


def _listed(paths: list[str], most: int = 4) -> str:
    """PATHS as the library names them (PIL/Image.py, json/decoder.py), the first few."""
    short = []
    for path in paths[:most]:
        parts = Path(path).parts
        tops = [i for i, part in enumerate(parts) if part == "site-packages" or "python3" in part]
        short.append("/".join(parts[max(tops, default=-1) + 1 :]))
    return ", ".join(short) + (", ..." if len(paths) > most else "") if paths else "none"


# A reproducible build's SOURCE_DATE_EPOCH (its commit's time): 2000-01-01, before every file.
SOURCE_DATE_EPOCH = 946_684_800


def rewrite_timestamps(path: Path, epoch: int) -> int:
    """What BuildKit's `rewrite-timestamp=true` does, with SOURCE_DATE_EPOCH, to the files of
    the layers a build makes (the base image's are as pulled): every time after EPOCH is set to
    it. Bytecode that names its source by mtime is stale afterwards. The number of files set."""
    count = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [*dirnames, *filenames]:
            entry = os.path.join(dirpath, name)
            if os.lstat(entry).st_mtime > epoch:
                os.utime(entry, (epoch, epoch), follow_symlinks=False)
                count += 1
    return count


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: Any = None, timeout: float = 10) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    if data:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    env: dict[str, str]
    log: Path
    user: str
    ready_seconds: float = 0.0

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


def _as_user(user: str | None, python: Path) -> dict[str, Any]:
    """Popen arguments that run the server as the image's numeric USER, when we may."""
    if not user or os.geteuid() != 0 or not world_reachable(python):
        return {}
    uid, _, gid = user.partition(":")
    if not uid.isdigit():
        raise SmokeError(f"USER {user}: use a numeric uid so Kubernetes can check runAsNonRoot")
    return {"user": int(uid), "group": int(gid or uid), "extra_groups": []}


@contextlib.contextmanager
def serve(image: Image, run_dir: Path, timeout: float = 90) -> Iterator[Server]:
    """Start the image's entrypoint with RUN_DIR at /model, as `docker run -v RUN_DIR:/model`."""
    mount = Path(image.root / MODEL_MOUNT.lstrip("/"))
    if mount.exists():
        shutil.rmtree(mount)
    shutil.copytree(run_dir, mount)
    for path in [image.root, *image.root.rglob("*")]:  # world-readable, as a mounted volume is
        path.chmod(path.stat().st_mode | 0o444 | (0o111 if path.is_dir() else 0))
    port = free_port()
    # `docker run -e`: loopback instead of 0.0.0.0 (nothing leaves this machine), a free port.
    env = {**image.host_env, "LIGHTSHIP_HOST": "127.0.0.1", "LIGHTSHIP_PORT": str(port)}
    if not image.healthcheck:
        raise SmokeError("the image has no HEALTHCHECK")
    health = subprocess.run(image.healthcheck, env=env, capture_output=True, timeout=30)
    if health.returncode == 0:
        raise SmokeError("HEALTHCHECK passes with no server running: it checks nothing")
    exe = shutil.which(image.argv[0], path=env["PATH"])
    if not exe:
        raise SmokeError(f"ENTRYPOINT {image.argv[0]!r} is not on the image's PATH")
    log = image.root / "server.log"
    as_user = _as_user(image.user, image.python) if world_reachable(image.root) else {}
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [exe, *image.argv[1:]],
            env=env,
            cwd=Path(image.root / image.workdir.lstrip("/")),
            stdout=out,
            stderr=subprocess.STDOUT,
            **as_user,
        )
    user = f"{as_user['user']}:{as_user['group']}" if as_user else f"{os.geteuid()} (this user)"
    server = Server(f"http://127.0.0.1:{port}", proc, env, log, user)
    try:
        while True:
            if proc.poll() is not None:
                raise SmokeError(f"server exited with {proc.returncode}:\n{server.output()}")
            with contextlib.suppress(OSError):
                if http(server.url + "/v2/health/ready", timeout=2)[0] == 200:
                    break
            if time.monotonic() - started > timeout:
                raise SmokeError(f"server not ready after {timeout:.0f} s:\n{server.output()}")
            time.sleep(0.1)
        server.ready_seconds = time.monotonic() - started
        health = subprocess.run(image.healthcheck, env=env, capture_output=True, timeout=30)
        if health.returncode != 0:
            raise SmokeError(f"HEALTHCHECK fails on a ready server: {health.stderr.decode()}")
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def stop(server: Server) -> int:
    """SIGTERM, as `docker stop` sends; the exit code."""
    server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(timeout=30)
    except subprocess.TimeoutExpired as exc:
        raise SmokeError(f"no exit 30 s after SIGTERM:\n{server.output()}") from exc


def softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(v - top) for v in row]
    return [e / sum(exps) for e in exps]


def check_predictions(
    server: Server, name: str, x: list[Any], expected: list[list[float]] | None = None
) -> dict[str, Any]:
    """V2 metadata and infer, then /v1/predict, on images X (each [C][H][W] pixels).

    With EXPECTED (the logits, computed by hand) every value must match exactly; without, the
    two protocols must agree with each other.
    """
    status, meta = http(f"{server.url}/v2/models/{name}")
    if status != 200:
        raise SmokeError(f"GET /v2/models/{name}: {status} {meta}")
    (spec,) = meta["inputs"]
    shape = [len(x), *spec["shape"][1:]]
    flat = _flatten(x)
    request = {
        "id": "smoke-1",
        "inputs": [{"name": spec["name"], "shape": shape, "datatype": "UINT8", "data": flat}],
        "outputs": [{"name": "logits"}],
    }
    status, reply = http(f"{server.url}/v2/models/{name}/infer", request)
    if status != 200:
        raise SmokeError(f"POST /v2/models/{name}/infer: {status} {reply}")
    if reply.get("id") != "smoke-1":
        raise SmokeError(f"V2 reply does not echo the request id: {reply}")
    (out,) = [o for o in reply["outputs"] if o["name"] == "logits"]
    labels = meta["parameters"]["labels"]
    if out["shape"] != [len(x), len(labels)] or out["datatype"] != "FP32":
        raise SmokeError(
            f"V2 logits are {out['datatype']} {out['shape']}, expected FP32 {[len(x), len(labels)]}"
        )
    logits = [out["data"][i * len(labels) : (i + 1) * len(labels)] for i in range(len(x))]
    if expected is not None and logits != expected:
        raise SmokeError(f"V2 logits {logits} != expected {expected}")
    if not all(math.isfinite(v) for row in logits for v in row):
        raise SmokeError(f"V2 logits are not finite: {logits}")

    status, reply = http(f"{server.url}/v1/predict", {"instances": x})
    if status != 200:
        raise SmokeError(f"POST /v1/predict: {status} {reply}")
    got = [(p["label"], p["score"]) for p in reply["predictions"]]
    want = []
    for row in logits:
        probabilities = softmax(row)
        best = max(range(len(row)), key=lambda i: (probabilities[i], -i))
        want.append((labels[best], probabilities[best]))
    if len(got) != len(want):
        raise SmokeError(f"/v1/predict answered {len(got)} predictions for {len(want)} images")
    close = all(
        math.isclose(g[1], w[1], rel_tol=1e-6, abs_tol=1e-12)
        for g, w in zip(got, want, strict=True)
    )
    if [g[0] for g in got] != [w[0] for w in want] or not close:
        raise SmokeError(f"/v1/predict gave {got}, expected {want} from the logits")
    return {"logits": logits, "labels": [g[0] for g in got]}


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, list):
        return [v for item in value for v in _flatten(item)]
    return [value]


def handmade_run(path: Path) -> tuple[Path, list[Any], list[list[float]]]:
    """A run directory whose one model answers logits [sum(pixels), 100 - sum(pixels)].

    Returns (run, images, their logits worked out by hand).
    """
    sys.path.insert(0, str(ROOT))
    from tests.handmade import handmade_onnx  # needs onnx: the project venv has it

    (path / "export").mkdir(parents=True)
    handmade_onnx(path / "export" / "model.onnx", chw=(1, 2, 2))
    spec = {"name": "input", "dtype": "uint8", "shape": ["batch", 1, 2, 2]}
    entry = {
        "file": "export/model.onnx",
        "format": "onnx",
        "input_spec": spec,
        "labels": ["bright", "dark"],
    }
    (path / "manifest.json").write_text(
        json.dumps({"schema": 1, "artifacts": {"onnx-fp32": entry}}, indent=2)
    )
    images = [[[[1, 2], [3, 4]]], [[[255, 255], [255, 250]]]]
    # sums 10 and 1015: logits [10, 100 - 10] and [1015, 100 - 1015]
    return path, images, [[10.0, 90.0], [1015.0, -915.0]]


def smoke(
    root: Path,
    run: Path | None = None,
    dockerfile: Path = ROOT / "Dockerfile",
    lock: Path = ROOT / "deploy" / "requirements-serve.txt",
) -> dict[str, Any]:
    """Build under ROOT, check, serve RUN, predict, stop; the figures measured on the way."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)  # the server runs as the image's USER and must reach the files
    report: dict[str, Any] = {"root": str(root)}
    started = time.monotonic()
    replay = Replay(dockerfile, ROOT, root / "image", log=root / "build.log")
    try:
        image = replay.build()
    except SmokeError as exc:
        tail = (root / "build.log").read_text()[-4000:] if (root / "build.log").exists() else ""
        raise SmokeError(f"{exc}\n--- build log (tail) ---\n{tail}") from None
    report["build_s"] = round(image.build_seconds, 1)
    report["not_replayed"] = image.not_replayed
    packages = check_install(image, lock)
    site = next(image.venv.glob("lib/python3*/site-packages"))
    report["venv_mib"] = round(disk_mib(image.venv), 1)
    report["site_packages_mib"] = round(disk_mib(site), 1)
    report["packages"] = len(packages)
    report["rewritten_times"] = rewrite_timestamps(image.venv, SOURCE_DATE_EPOCH)
    compiled = compiled_at_start(image.venv / "bin" / "python", image.host_env, image.root)
    if compiled:
        venv = [p for p in compiled if Path(p).is_relative_to(image.venv)]
        stdlib = [p for p in compiled if p not in venv]
        raise SmokeError(
            f"the server compiles {len(compiled)} modules at every start, {len(stdlib)} of the "
            f"standard library ({_listed(stdlib)}) and {len(venv)} of the virtualenv "
            f"({_listed(venv)}): python:*-slim ships the library without bytecode, and times "
            "rewritten for a reproducible build make pip's stale; compile both in the image "
            "(python -m compileall --invalidation-mode checked-hash)"
        )
    if run is None:
        run, images, expected = handmade_run(root / "handmade")
    else:
        images, expected = None, None
    name = Path(MODEL_MOUNT).name
    with serve(image, run) as server:
        report["ready_s"] = round(server.ready_seconds, 2)
        report["ran_as"] = server.user
        if images is None:
            meta = http(f"{server.url}/v2/models/{name}")[1]
            c, h, w = meta["inputs"][0]["shape"][1:]
            images = [
                [
                    [[(7 * n + 3 * i + j) % 256 for j in range(w)] for i in range(h)]
                    for _ in range(c)
                ]
                for n in range(2)
            ]
        report.update(check_predictions(server, name, images, expected))
        code = stop(server)
        if code != 0:
            raise SmokeError(f"exit code {code} after SIGTERM, expected 0:\n{server.output()}")
    report["exit_code"] = code
    report["total_s"] = round(time.monotonic() - started, 1)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--run",
        type=Path,
        help="run directory to serve (default: a handmade "
        "model whose logits are known, checked exactly)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary image root")
    parser.add_argument("--json", type=Path, help="write the measured figures here")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lightship-smoke-"))
    try:
        report = smoke(root, args.run)
    except SmokeError as exc:
        print(f"docker-smoke: FAILED: {exc}\n(build log and server log kept in {root})")
        return 1
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"docker-smoke: ok in {report['total_s']} s (install {report['build_s']} s, ready "
        f"{report['ready_s']} s); serve-only venv {report['venv_mib']} MiB "
        f"(site-packages {report['site_packages_mib']} MiB, {report['packages']} packages, "
        f"no torch); ran as uid {report['ran_as']}; predictions {report['labels']}; "
        f"exit {report['exit_code']} on SIGTERM"
    )
    for line in report["not_replayed"]:
        print(f"  not replayed (needs a container): {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
