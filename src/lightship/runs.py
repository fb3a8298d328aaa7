"""The run directory: every stage reads and writes files here, never another stage's code.

```
runs/<name>/config.yaml  checkpoints/  best.ckpt  logs/  export/  quantize/  report/  manifest.json
```
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import fcntl
import glob
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightship import __version__
from lightship.errors import ConfigError, RunBusyError, RunError

log = logging.getLogger(__name__)

MANIFEST_SCHEMA = 1

# The report measures every listed artifact: it is removed when any of them is unlisted or
# replaced by another file. report.json goes first: `serve` reads it for its recommendation.
REPORT_FILES = ("report/report.json", "report/report.md", "report/pareto.png")
# What of an entry the report judges a variant by, beside its file: quantize's gate (the
# report's own unless told otherwise), whether it may be recommended, the CPU it was made for.
JUDGED = ("sha256", "gate", "recommendable", "target")
# Everything export, quantize and report make from best.ckpt, listed in the manifest or not (a
# run made by an older lightship may hold int8 models a re-export unlisted but kept on disk).
DERIVED_FILES = (
    *REPORT_FILES,
    "export/model.onnx",
    "export/model.ts",
    "export/model.pt2",
    "quantize/model.int8-*.onnx",
    "quantize/qat.ckpt",
)
# What the Dockerfiles' `model` stage copies of a run into an image (.dockerignore): its
# manifest.json, ONNX files and report.json; no best.ckpt, so no stage can make a variant there.
IN_AN_IMAGE = "a model image holds only a run's manifest, ONNX files and report"


def _file_mode() -> int:
    """The mode `open()` gives a new file under this process's umask (0o644 under 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


# mkstemp makes 0600 files: renamed into place, a run would be unreadable to anyone else, e.g.
# the serving image's own user reading a run mounted into it.
FILE_MODE = _file_mode()
_interrupted = threading.Event()
_stopped_by: list[int] = []  # the signal that interrupted this process


def _on_stop_signal(signum: int, frame: object) -> None:
    _interrupted.set()
    _stopped_by[:] = [signum]
    raise KeyboardInterrupt


def watch_interrupts() -> None:
    """Ctrl-C raises KeyboardInterrupt as usual, and is remembered: a library that swallows the
    exception (a lazy import half done, a fallback that catches everything) can no longer turn
    it into a different artifact; `atomic_path` refuses to rename anything after it. SIGTERM
    (`kill`, `docker stop`, a CI timeout) does the same: by default it ends the process on the
    spot, leaving temporary files, and a training's set-aside checkpoints, behind."""
    signal.signal(signal.SIGINT, _on_stop_signal)
    signal.signal(signal.SIGTERM, _on_stop_signal)


def interrupted() -> bool:
    return _interrupted.is_set()


def interrupt_exit_code() -> int:
    """128 + the signal that stopped this process, as a shell reports one: 130 for Ctrl-C,
    143 for SIGTERM."""
    return 128 + (_stopped_by[0] if _stopped_by else signal.SIGINT)


_interrupt_note: list[str] = []


def note_interrupt(note: str) -> None:
    """What to do after Ctrl-C stopped this process (e.g. how to resume): the CLI's last line,
    `interrupted: <note>`. A stage sets it where it is stopped, once it knows."""
    _interrupt_note[:] = [note]


def interrupt_note() -> str | None:
    """What the running stage last said to do after a stop (`note_interrupt`), if anything:
    true after any failure from that point on, as the CLI's full-disk line gives it."""
    return _interrupt_note[0] if _interrupt_note else None


def interrupt_message() -> str:
    """The CLI's last line after Ctrl-C."""
    note = interrupt_note()
    return f"interrupted: {note}" if note else "interrupted"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_recorded(path: Path, entry: dict[str, Any], fix: str) -> str:
    """The sha256 of `path`; RunError when it is not the file its manifest `entry` recorded
    (`fix` says what to re-run). Entries without a sha256 are taken as they are."""
    actual = sha256_file(path)
    expected = entry.get("sha256")
    if expected and actual != expected:
        raise RunError(f"{path} differs from its manifest entry (sha256): {fix}")
    return actual


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside `final`; on success fsync and rename it into place.

    A reader never sees a half-written file, and a crash leaves the old file (or none) behind.
    """
    with atomic_paths(final) as (tmp,):
        yield tmp


@contextlib.contextmanager
def atomic_paths(*finals: Path, done: str = "") -> Iterator[tuple[Path, ...]]:
    """`atomic_path` for files that go together (the report's three): yield a temporary path
    beside each of `finals`; on success sync each once, then rename them all into place, in the
    order given, and sync their folders, so that they are all new or all as they were:

    - a failure before the renames (the writer's, or a full disk's on a sync) leaves the old set;
    - SIGINT and SIGTERM are held back during the renames: Ctrl-C raises KeyboardInterrupt
      between any two of them otherwise (`watch_interrupts`), and an unhandled SIGTERM ends the
      process there. The signal takes effect after the last rename;
    - once every file is in place, `done` (what now stands) is the note the CLI's last line
      gives after a stop (`note_interrupt`), in place of one that says nothing was written.

    Only a process killed outright (kill -9, a crash) or a rename that fails (renames within a
    folder fail only when the folder itself goes or turns read-only) can leave the set mixed.
    """
    temporaries: list[Path] = []
    try:
        for final in finals:
            temporaries.append(_temporary_beside(final))
        try:
            yield tuple(temporaries)
            for tmp in temporaries:
                with open(tmp, "rb+") as fh:
                    os.fsync(fh.fileno())
                os.chmod(tmp, FILE_MODE)
        except OSError as exc:
            # A write to an open file raises ENOSPC without a file name, and the CLI said "no
            # space left on the device writing a file": the file being made is named instead.
            if exc.filename is None and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                exc.filename = str(finals[0] if len(finals) == 1 else finals[0].parent)
            raise
        if interrupted():
            raise KeyboardInterrupt
        _replace_all(list(zip(temporaries, finals, strict=True)), done)
    finally:
        for tmp in temporaries:
            tmp.unlink(missing_ok=True)


def _temporary_beside(final: Path) -> Path:
    """A new empty file beside `final`, named as `sweep_temporaries` knows it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    # The temporary name keeps the suffix: loaders that pick a format by suffix can check it.
    fd, name = tempfile.mkstemp(
        prefix=f".{final.stem}.", suffix=f".tmp{final.suffix}", dir=final.parent
    )
    os.close(fd)
    return Path(name)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def held_stop_signals() -> Iterator[None]:
    """SIGINT and SIGTERM held back until the block ends, then the last one raised: each stop
    signal's handler records its own outside (`interrupt_exit_code`), so SIGINT, then SIGTERM,
    exits 143 here too. Nested, the inner block's signal is raised into the outer's hold.

    Held by a handler of our own, not by a blocked signal mask: a signal blocked in this thread
    still goes to another (onnxruntime's, torch's), and Python then runs the handler here all
    the same. Python runs handlers in the main thread only: elsewhere, none can land in between.
    """
    held: list[int] = []  # the stop signals that came meanwhile
    handlers: dict[signal.Signals, Any] = {}
    try:
        if threading.current_thread() is threading.main_thread():
            for signum in _STOP_SIGNALS:
                if signal.getsignal(signum) is not None:  # None: not Python's to restore
                    handlers[signum] = signal.signal(signum, lambda n, _: held.append(n))
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        if held:  # now that the block is done: Ctrl-C's KeyboardInterrupt comes from here
            signal.raise_signal(held[-1])


def _replace_all(pairs: list[tuple[Path, Path]], done: str = "") -> None:
    """Rename each (temporary, final) pair into place, in order, and sync their folders, with
    SIGINT and SIGTERM held back until the last is in place, and `done` noted for the CLI."""
    with held_stop_signals():
        for tmp, final in pairs:
            os.replace(tmp, final)
        if done:  # before the sync, which may fail: the files are in place all the same
            note_interrupt(done)
        for folder in dict.fromkeys(final.parent for _, final in pairs):
            _sync_folder(folder)


@contextlib.contextmanager
def then_held() -> Iterator[Callable[..., None]]:
    """For files renamed into place (`atomic_path`, entered after this in the same `with`) and
    their manifest entry, which must land together: `then(run.record, key, entry)`, as the last
    line of the rename's block, calls it once the rename is done, with SIGINT and SIGTERM held
    back from that line on; they take effect after. Recorded after the block instead, a stop
    held during the rename would be raised right after it, before `record`: a new file beside
    the entry of the old one. A failure before the rename calls nothing."""
    calls: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
    with contextlib.ExitStack() as stack:

        def then(call: Callable[..., None], *args: Any) -> None:
            if not calls:
                stack.enter_context(held_stop_signals())
            calls.append((call, args))

        yield then
        for call, args in calls:  # only once the block, and so the renames, succeeded
            call(*args)


def _sync_folder(folder: Path) -> None:
    """Sync `folder`: a rename is on disk only once the folder it was made in is. Where a file
    system refuses (some network and FUSE ones cannot sync a folder, or open one to), the
    renames stand all the same: the files themselves were synced before them."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES):
            raise
    finally:
        os.close(fd)


# The prefixes of the scratch folders quantize makes in a run with tempfile (`Quantizer.work`
# and QAT's Lightning folder): model copies and checkpoints, megabytes each.
SCRATCH_PREFIXES = {"quantize": ".quantize.", "qat": ".qat.", "outdated": ".outdated."}
# What a stage killed outright (kill -9, out of memory) leaves in a run, matched by the names
# tempfile gives (a prefix, 8 random characters of [a-z0-9_], a suffix) so that a user's file
# of a like name is never taken: `atomic_path`'s temporary files, in the run and its folders,
# and the scratch folders, in the run.
_RANDOM = "[a-z0-9_]{8}"
_TEMPORARY = re.compile(rf"\..+\.{_RANDOM}\.tmp.*")
_SCRATCH = re.compile(rf"({'|'.join(map(re.escape, SCRATCH_PREFIXES.values()))}){_RANDOM}")


def sweep_temporaries(root: Path) -> list[Path]:
    """Delete what a killed stage left in the run `root` (temporary files, scratch folders),
    saying so, and return it. Only with the run's lock held: then no live process is writing
    them (`lock_run` calls it as it takes the lock)."""
    folders = [root, *(d for d in sorted(root.iterdir()) if d.is_dir())]
    files = [
        p
        for d in folders
        for p in sorted(d.iterdir())
        if _TEMPORARY.fullmatch(p.name) and p.is_file() and not p.is_symlink()
    ]
    scratch = [
        p
        for p in sorted(root.iterdir())
        if _SCRATCH.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
    ]
    for path in [*files, *scratch]:
        log.info("removing %s, left by a lightship stage that was killed", path)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return [*files, *scratch]


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def _entry_files(entries: Iterable[dict[str, Any]]) -> list[str]:
    """The run-relative files manifest entries list (every `file*` field)."""
    return [
        value
        for entry in entries
        for field, value in entry.items()
        if field.startswith("file") and isinstance(value, str)
    ]


def check_writable(*paths: Path) -> None:
    """RunError unless each output path can be written: not a folder, and its folder exists (or
    can be made) and takes a new file. Stages call it before their long work, so an unwritable
    output fails in seconds instead of after minutes of training or timing, half-written."""
    for path in paths:
        if path.is_dir():
            raise RunError(f"{path} is a folder where a file goes: move it away and run again")
        blocker = next((p for p in path.parents if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise RunError(
                f"cannot write {path}: {blocker} is a file, not a folder: move it away and run "
                "again"
            )
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=path.parent):
                pass
        except OSError as exc:
            raise RunError(
                f"cannot write {path}: {exc.strerror}: check the path and its permissions"
            ) from None


def check_space(folder: Path, needed: int, what: str) -> None:
    """RunError unless `folder`'s file system has `needed` bytes free: some writers (torch's C++
    ones) abort the process on a full disk instead of raising."""
    probe = next((p for p in [folder, *folder.parents] if p.exists()), Path("."))
    free = shutil.disk_usage(probe).free
    if free < needed:

        def size(n: int) -> str:  # a tiny run's needs are kilobytes: not "0 MB"
            return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"

        raise RunError(
            f"{what} needs about {size(needed)} in {folder} but {size(free)} are free: make "
            "room and run again"
        )


def home_expanded(value: str | Path) -> Path:
    """`value` with a leading `~` or `~user` expanded, as a shell would have: `--run=~/x` (bash
    expands no ~ after `=`) and LIGHTSHIP_RUN=~/x in an env file made a folder named `~`, and
    the fix printed, pasted, made it again. A user with no home is left as written (said
    missing where it is looked for)."""
    path = Path(value)
    if not str(value).startswith("~"):
        return path
    try:
        return path.expanduser()
    except RuntimeError:  # "Could not determine home directory"
        return path


def run_path(value: str | Path) -> Path:
    """Typer parser for run-directory options (given as text, or the default Path): an empty
    string would silently mean the current folder, so it is refused."""
    if isinstance(value, str) and not value.strip():
        raise RunError("a run directory cannot be empty: give one, e.g. --run runs/default")
    value = home_expanded(value)
    try:
        str(value).encode("utf-8")
    except UnicodeEncodeError:  # bytes that are no UTF-8, as Python decodes argv
        shown = str(value).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise RunError(
            f"run directory {shown} is not UTF-8 text: TensorBoard's logs and manifest.json keep "
            "its path as UTF-8; name it in UTF-8, e.g. --run runs/default"
        ) from None
    return Path(value)


def makefile_here() -> bool:
    """Whether this folder is lightship's own checkout, whose Makefile runs the stages. Only
    there may a message say `make export RUN=...`: elsewhere make has no such target, and from
    the checkout a run path relative to here would name another folder."""
    try:
        here = Path.cwd()
    except OSError:  # the folder was deleted under us: no checkout here either
        return False
    return (here / "Makefile").is_file() and (here / "src" / "lightship").is_dir()


# What the Makefile refuses in RUN (its `unsafe_chars`, and whitespace): make reads RUN in a
# rule's target, where these mean other things, and bash reads its recipes
NOT_FOR_MAKE = re.compile(r"""[\s:%;*?\[\]\\|'"`&<>{}()$]""")


def make_takes(run: Path | str) -> bool:
    """Whether a message may give make's target for `run`: in lightship's checkout, for a path
    the Makefile takes as RUN."""
    return makefile_here() and NOT_FOR_MAKE.search(str(run)) is None


# The folder make was run from (the Makefile sets it): `make -C CHECKOUT` runs the stages in
# the checkout, and a message's `make ...` must say -C for the user's own folder
MAKE_FROM = "LIGHTSHIP_MAKE_FROM"


def make_elsewhere() -> str:
    """'-C CHECKOUT ' where make was run from another folder than this one (`make -C`), else
    ''. Harmless where that folder is stale: the command runs from anywhere."""
    came_from = os.environ.get(MAKE_FROM)
    try:
        if not came_from or Path(came_from).resolve() == Path.cwd().resolve():
            return ""
        return f"-C {shlex.quote(str(Path.cwd()))} "
    except OSError:  # a folder deleted under us
        return ""


def stage_command(make: str, lightship: str, run: Path | str) -> str:
    """A command on `run` for a message that runs from here: `make` in lightship's checkout
    (its targets chain the stages; with -C where make ran from elsewhere), else, or for a run
    path make cannot take, the lightship command."""
    if not make_takes(run):
        return lightship
    elsewhere = make_elsewhere()
    return re.sub(r"(^|\s)make ", lambda m: f"{m.group(1)}make {elsewhere}", make)


def stage_on(
    run: Path,
    stage: str,
    env: str = "",
    option: str = "",
    some: Sequence[str] = (),
    every: Sequence[str] = (),
    flags: Sequence[str] = (),
) -> str:
    """`stage` on `run` as a command that runs from here, `env` (PYTHONPATH=...) first; with
    `--option a,b` (make: `STAGE_ARGS='--option a,b'`) when `some` is not all of `every`,
    then `flags` (plain words: options and numbers)."""
    q = shlex.quote(str(run))
    chosen = ",".join(some) if some and set(some) != set(every) else ""
    flag = " ".join([*([f"--{option}", chosen] if chosen else []), *flags])
    return stage_command(
        f"{env}make {stage} RUN={q}" + (f" {stage.upper()}_ARGS='{flag}'" if flag else ""),
        f"{env}lightship {stage} --run {q}" + (f" {flag}" if flag else ""),
        run,
    )


# The stages the make that runs a stage runs after it (the Makefile sets it): a `next:` line that
# named one would tell the user to run what make is about to run.
MAKE_GOALS = "LIGHTSHIP_MAKE_GOALS"
# The stage make runs after this one where the run lacks it: export, after the training that
# make runs for a run without best.ckpt (export/model.onnx is made when it is missing)
MAKE_THEN = "LIGHTSHIP_MAKE_THEN"


def made_next_by_make(stage: str) -> bool:
    """Whether the make running this stage runs `stage` next (`MAKE_GOALS`, `MAKE_THEN`)."""
    return stage in os.environ.get(MAKE_GOALS, "").split() or stage == os.environ.get(MAKE_THEN)


def next_command(stage: str, run: Path, env: str = "", flag: str = "") -> str:
    """What a `next:` line says to run after a stage: `stage` on `run`, `env` (PYTHONPATH=...)
    first, with the options `flag` (make: `STAGE_ARGS='...'`): make's target and the lightship
    command in the checkout, else the latter; only `stage`'s name where the make running this
    stage runs it next (`made_next_by_make`)."""
    if made_next_by_make(stage):  # `make quantize`: the report comes
        return f"{stage}, which make runs now"
    q = shlex.quote(str(run))
    cli = f"{env}lightship {stage} --run {q}" + (f" {flag}" if flag else "")
    args = f" {stage.upper()}_ARGS='{flag}'" if flag else ""
    # the lightship command's run path is the checkout's: no alternative from elsewhere
    also = "" if make_elsewhere() else f"   (or `{cli}`)"
    return stage_command(f"{env}make {stage} RUN={q}{args}{also}", cli, run)


def check_the_name(root: Path) -> str:
    """For the error of a run directory that does not exist: the runs beside it, the closest
    first when it looks mistyped (" (or check the name: did you mean runs/default? runs/
    holds: default, r1)"); "" where there are none. Training the mistyped name is the fix a
    message would otherwise give."""
    parent = root.parent
    try:
        runs = sorted(
            p.name
            for p in parent.iterdir()
            if p.is_dir()
            and p != root
            and any((p / f).exists() for f in ("manifest.json", "best.ckpt", "checkpoints"))
        )
    except OSError:
        return ""
    if not runs:
        return ""
    close = difflib.get_close_matches(root.name, runs, n=1)
    guess = f"did you mean {parent / close[0]}? " if close else ""
    shown = ", ".join(runs[:8]) + (", ..." if len(runs) > 8 else "")
    return f" (or check the name: {guess}{parent}/ holds: {shown})"


def enclosing_run(path: Path) -> Path | None:
    """The run directory a file lies in (the nearest parent with manifest.json or checkpoints/),
    for a message that names it in its fix; None outside any run."""
    return next(
        (
            p
            for p in path.parents
            if (p / "manifest.json").is_file() or (p / "checkpoints").is_dir()
        ),
        None,
    )


def variant_of(model: Path) -> str:
    """The manifest key of a run's model file, by its name (model.int8-static.onnx:
    onnx-int8-static)."""
    if ".int8-" in model.name:
        return "onnx-int8-" + model.name.split(".int8-", 1)[1].removesuffix(".onnx")
    suffixes = {".ts": "torchscript", ".pt2": "pt2", ".ckpt": "checkpoint"}
    return suffixes.get(model.suffix, "onnx-fp32")


# The manifest keys of the exports, and the `--formats` names that make them
_FORMAT_OF = {"onnx-fp32": "onnx", "torchscript": "torchscript", "pt2": "pt2"}


def _stage_of(variant: str) -> str:
    """The stage that makes `variant` of a run (the report's and the manifest's names)."""
    if variant in ("eager", "checkpoint"):
        return "train"
    return "quantize" if variant.startswith("onnx-int8") else "export"


def export_hint(model: Path) -> str:
    """How to make a missing exported or quantized `model`: the stage that writes it, on the
    run it lies in (`RunDir.make_hint`)."""
    run = enclosing_run(model)
    return RunDir(run).make_hint(variant_of(model)) if run else "export it first"


def results_file(value: str | Path) -> Path:
    """Typer parser of a benchmark's --out, a JSON file: a folder given for it was "a folder
    where a file goes: move it away", the folder being /tmp."""
    path = home_expanded(value)
    if path.is_dir():
        raise ConfigError(
            f"--out takes a file for the results, and {path} is a folder: give a file in it, "
            f"e.g. --out {shlex.quote(str(path / 'results.json'))}"
        )
    return path


# The folders a run's stages make in it
RUN_FOLDERS = ("checkpoints", "logs", "export", "quantize", "report")


def run_of_folder(path: Path) -> Path | None:
    """The run whose own folder `path` is (RUN/export, RUN/checkpoints, ... made or not yet),
    where given as a run it was taken for a new one: `quantize --run R/export` said to train
    R/export, and `train --run R/checkpoints` trained a whole run among R's checkpoints. `.`
    from inside R/export too; said relative where `path` was."""
    whole = Path(os.path.abspath(path))  # `.`, `x/..`: the folder they name
    if whole.name not in RUN_FOLDERS:
        return None
    if (whole / "manifest.json").is_file() or (whole / "checkpoints").is_dir():
        return None  # a run of its own, named so
    parent = whole.parent
    # a run: trained (best.ckpt, its manifest), or stopped before its best (last.ckpt)
    marks = ("manifest.json", "best.ckpt", "checkpoints/last.ckpt")
    if not any((parent / mark).is_file() for mark in marks):
        return None
    return parent if path.is_absolute() else Path(os.path.relpath(parent))


def run_dir_parser(option: str) -> Callable[[str | Path], Path]:
    """Typer parser of a stage's run-directory `option`: as `run_path`, and a file (a model, a
    config) or a run's own folder is refused, naming the run it lies in, where it would be
    taken for a run directory not made yet. Not for `serve --run`, which serves a lone model
    file (and says the same of a run's folder itself)."""

    def parse(value: str | Path) -> Path:
        path = run_path(value)
        owner = run_of_folder(path)
        if owner is not None:
            raise RunError(
                f"{option} takes a run directory: {path} is run {owner}'s "
                f"{Path(os.path.abspath(path)).name} folder; "
                f"give {option} {shlex.quote(str(owner))}"
            )
        if not path.is_file():
            return path
        run = enclosing_run(path)
        fix = (
            f"give {option} {shlex.quote(str(run))}"
            if run
            else f"give a run directory, e.g. {option} runs/default"
        )
        if path.suffix in (".yaml", ".yml"):
            fix += " (a config goes to `lightship train --config`)"
        raise RunError(f"{option} takes a run directory, not a file ({path}): {fix}")

    return parse


def _inside_run(name: object) -> bool:
    """Whether a manifest's file name is a path inside its run (relative, without `..`)."""
    return isinstance(name, str) and not (Path(name).is_absolute() or ".." in Path(name).parts)


LOCK_FILE = ".lock"
SET_ASIDE_PREFIX = ".previous."
# In a set-aside folder once all it holds has been moved there, and while the checkpoints
# beside it are deleted to put it back (`RunDir.put_back`)
SET_ASIDE_DONE = ".done"
SET_ASIDE_BACK = ".back"
# The run directories this process holds locked, each with the thread holding it and its
# command: a stage that runs another in-process (same thread) takes the lock again without
# waiting on itself; another thread of the process is refused, as another process is.
_locked: dict[Path, tuple[int, str]] = {}


def distributed_worker() -> bool:
    """A DDP worker: Lightning re-runs the command line with LOCAL_RANK=1.., torchrun sets RANK.
    Rank 0 holds the run's lock and writes its files; the workers write none. Both set
    MASTER_ADDR, as a multi-node run needs it set: a RANK of some other use in a container's
    environment made every stage run unlocked, and training leave its stash alone."""
    if not os.environ.get("MASTER_ADDR"):
        return False
    return any(os.environ.get(k, "0") != "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def _flock_pid(fd: int) -> int | None:
    """The pid the kernel lists as holding an flock on `fd`'s file (Linux's /proc/locks);
    None where it lists none, or cannot be read."""
    try:
        st = os.fstat(fd)
        listed = Path("/proc/locks").read_text()
    except OSError:
        return None
    here = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in listed.splitlines():
        fields = line.replace("->", "").split()  # "1: FLOCK ADVISORY WRITE pid maj:min:ino ..."
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == here:
            with contextlib.suppress(ValueError):  # 0: a pid gone (in some kernels' lists)
                return int(fields[4]) if int(fields[4]) > 0 else None
    return None


def _lock_holder(fd: int) -> str:
    """' (pid 1234, lightship quantize)' from a held lock file; '' when it cannot be read
    (the holder may not have written it yet). A holder that locked the file read-only (another
    user's .lock) could not write its own: the file still names the one before, so the pid
    the kernel lists, where that differs, is named instead, with its command line."""
    try:
        info = json.loads(os.pread(fd, 4096, 0))
        pid = int(info["pid"])
    except (OSError, ValueError, TypeError, KeyError):
        info, pid = {}, None
    locker = _flock_pid(fd)
    if locker is not None and locker != pid:
        try:
            argv = Path(f"/proc/{locker}/cmdline").read_bytes().split(b"\0")
            command = " ".join(a.decode(errors="replace") for a in argv if a)
        except OSError:
            command = ""
        return f" (pid {locker}{', ' + command[:120] if command else ''})"
    if pid is None:
        return ""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:  # its forked workers (DataLoader) still hold the lock's file
        return f" (pid {pid}, {info.get('command')}, now exiting)"
    except OSError:
        pass
    return f" (pid {pid}, {info.get('command')})"


def _acquire(root: Path, create: bool) -> int | None:
    """The open, locked RUN/.lock; None where it cannot be made. RunBusyError when another
    process holds it."""
    path = root / LOCK_FILE
    while True:
        try:
            if create:
                root.mkdir(parents=True, exist_ok=True)
            # not through a symbolic link: the pid written into the lock would overwrite the
            # file it points to
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
        except OSError:
            if path.is_symlink():
                raise RunError(
                    f"{path} is a symbolic link, which lightship will not write through: "
                    f"remove it (`rm {shlex.quote(str(path))}`; each stage makes its own)"
                ) from None
            try:  # another user's .lock (0644 in a shared run): flock takes a read-only one
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:  # none, and none can be made: a read-only run, or no run at all
                return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise RunBusyError(
                f"{root} is in use by another lightship process{holder}: "
                "wait for it to finish, or stop it"
            ) from None
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)  # its holder removed it (see lock_run) before we locked it: lock anew


@contextlib.contextmanager
def lock_run(root: Path, command: str, create: bool = False) -> Iterator[None]:
    """Hold RUN/.lock (an exclusive flock) while a stage writes the run, so that no other
    stage reads or writes it meanwhile: RunBusyError at once when another process holds it.
    The lock file records this process's pid and `command` for that message; the OS releases
    the lock when the process dies. Re-entrant within a process. `create`: make a missing run
    directory to lock it (train). A folder left holding nothing but the lock (a stage that
    failed on a folder that is no run) loses it again, and the folders made for it go. Taking
    it, this deletes what a stage killed outright left in the run (`sweep_temporaries`): the
    one moment no live stage can be writing there. Not locked where the lock file cannot be
    made (no run directory, a read-only one): reading needs no lock, and a writing stage's own
    checks say what is wrong. A KeyboardInterrupt out of the stage carries its
    `note_interrupt` (what is kept, how to go on) as a note, for a caller in Python."""
    key = root.resolve()
    holder = _locked.get(key)
    if holder is not None and holder[0] != threading.get_ident():
        raise RunBusyError(
            f"{root} is in use by another thread of this process ({holder[1]}): wait for it "
            "to finish"
        )
    if holder is not None or distributed_worker():
        yield
        return
    made = [p for p in [root, *root.parents] if not p.exists()] if create else []
    fd = _acquire(root, create)
    if fd is None:
        yield
        return
    _locked[key] = (threading.get_ident(), command)
    _interrupt_note.clear()  # an earlier stage's, in this process (Python's, a notebook's)
    try:
        with contextlib.suppress(OSError):  # best effort: only the busy message reads it
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "command": command}).encode(), 0)
        with contextlib.suppress(OSError):  # best effort: a leftover only takes room
            sweep_temporaries(root)
        yield
    except KeyboardInterrupt as exc:
        # Called from Python, the stage's note (what is kept, how to resume) is the last line
        # of the traceback; the CLI prints it as its own last line instead.
        if _interrupt_note:
            exc.add_note(interrupt_message())
        raise
    finally:
        with contextlib.suppress(OSError):
            if [p.name for p in root.iterdir()] == [LOCK_FILE]:
                # Still locked, so no one else wrote meanwhile; a process that opened the file
                # meanwhile finds it gone once it locks it, and locks anew (`_acquire`).
                (root / LOCK_FILE).unlink()
                for folder in made:  # the run directory, then the folders made for it
                    folder.rmdir()
        _locked.pop(key, None)
        os.close(fd)


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __post_init__(self) -> None:
        # RunDir("runs/x") from Python: every path below was a str's, `.resolve()` an error
        object.__setattr__(self, "root", Path(self.root))

    @property
    def name(self) -> str:
        return self.root.resolve().name

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def last_ckpt(self) -> Path:
        return self.checkpoints / "last.ckpt"

    @property
    def best_ckpt(self) -> Path:
        return self.root / "best.ckpt"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def export_dir(self) -> Path:
        return self.root / "export"

    @property
    def quantize_dir(self) -> Path:
        return self.root / "quantize"

    @property
    def report_dir(self) -> Path:
        return self.root / "report"

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    def train_command(self, afresh: bool = False, env: str | None = None) -> str:
        """The command that gives this run its best.ckpt again, quoted for a message. A run that
        trained before resumes: that puts back the best checkpoint it wrote (keeping what was
        made from it) and finishes the epochs left. Else, or `afresh` (its last.ckpt is what is
        broken), the run's own config, when it has one: make's default may be another model.
        `env` (PYTHONPATH=...) goes first; by default, what the run's model needs."""
        env = self.pythonpath() if env is None else env
        run = shlex.quote(str(self.root))
        if self.last_ckpt.is_file() and not afresh:
            command = stage_command(
                f"make train RESUME=1 RUN={run}",
                f"lightship train --run {run} --resume",
                self.root,
            )
        elif self.config.is_file():
            config = shlex.quote(str(self.config))
            command = stage_command(
                f"make train RUN={run} CONFIG={config}",
                f"lightship train --run {run} --config {config}",
                self.root,
            )
        else:
            command = stage_command(
                f"make train RUN={run}", f"lightship train --run {run}", self.root
            )
        return f"`{env}{command}`"

    def unrecorded(self, *then: str) -> RunError:
        """The error of a stage that needs the run's checkpoint entry (data spec, input spec)
        where manifest.json has none; `then`: the stages to run after training. A folder with
        best.ckpt or checkpoints/last.ckpt was trained, and its manifest lost the entry
        (deleted, as a malformed one's message says): the run's own training records it again,
        resumed where it can be. A plain `train` would train make's default model over it."""
        if self.best_ckpt.is_file() or self.last_ckpt.is_file():
            lost = f"{self.manifest_path} does not record {self.best_ckpt.name}: run "
            if self.last_ckpt.is_file() and self._lists_derived():  # only its entry was lost
                return RunError(
                    f"{lost}{self.train_command()} (a finished run trains nothing more and "
                    "keeps what manifest.json records was made from its best.ckpt; it names "
                    "what to run next)"
                )
            resumed = " (a finished run trains nothing more)" if self.last_ckpt.is_file() else ""
            return RunError(f"{lost}{self.train_command()}{resumed}, then {self.command(*then)}")
        named = "" if self.root.is_dir() else check_the_name(self.root)
        return RunError(f"no trained run in {self.root}: run {self.command('train', *then)}{named}")

    def _lists_derived(self) -> bool:
        """Whether manifest.json lists anything made from best.ckpt (read, never raising: the
        caller is already an error's message)."""
        try:
            return any(k != "checkpoint" for k in self.manifest()["artifacts"])
        except RunError:  # unreadable or malformed: manifest() checked its shape
            return False

    def pythonpath(self) -> str:
        """'PYTHONPATH=DIR ' where a stage must import the run's own model module from a folder
        only PYTHONPATH gives it (`models.pythonpath_prefix`), else ''. Read as it is, never
        raising: the fix in the message of a malformed manifest asks for it."""
        try:
            entry = json.loads(self.manifest_path.read_text())["artifacts"]["checkpoint"]
            spec = dict(entry["model"])
        except (OSError, ValueError, LookupError, TypeError):  # not there, or malformed
            return ""
        if ":" not in str(spec.get("name", "")):  # a registry model: nothing to import
            return ""
        try:
            from lightship.models import spec_pythonpath  # imports torch: only when asked
        except ImportError:  # a serving install without torch, where no stage can run
            return ""
        return spec_pythonpath(spec)

    def command(self, *stages: str, flags: Mapping[str, str] | None = None) -> str:
        """`stages` on this run, in order, as a command that runs from here, quoted for a
        message: one make call in the checkout, else a lightship command per stage; each with
        the PYTHONPATH= the run's model needs (`pythonpath`), and the options `flags` gives it
        (make: `STAGE_ARGS='...'`). make's quantize writes the report after it: a report that
        follows quantize is left to it, not run twice."""
        run, env, flags = shlex.quote(str(self.root)), self.pythonpath(), flags or {}
        targets = [
            s for i, s in enumerate(stages) if s != "report" or stages[i - 1 : i] != ("quantize",)
        ]
        args = "".join(f" {s.upper()}_ARGS='{flags[s]}'" for s in stages if flags.get(s))
        make = f"{env}make {' '.join(targets)} RUN={run}{args}"
        cli = "`, then `".join(
            f"{env}lightship {s} --run {run}" + (f" {flags[s]}" if flags.get(s) else "")
            for s in stages
        )
        return f"`{stage_command(make, cli, self.root)}`"

    def remake_flags(self, variants: Iterable[str]) -> dict[str, str] | None:
        """The stages that make `variants` of this run again, in order, each with the option
        that makes only those (`--formats onnx,pt2`, `--methods dynamic`), and the report after
        them, for `command(*flags, flags=flags)`; None where one of them is not a variant a
        stage makes by name."""
        formats: list[str] = []
        methods: list[str] = []
        for variant in variants:
            if variant in _FORMAT_OF:
                formats.append(_FORMAT_OF[variant])
            elif variant.startswith("onnx-int8-"):
                methods.append(variant.removeprefix("onnx-int8-"))
            else:
                return None
        flags = {"export": f"--formats {','.join(dict.fromkeys(formats))}"} if formats else {}
        flags |= {"quantize": f"--methods {','.join(dict.fromkeys(methods))}"} if methods else {}
        return flags | {"report": ""}

    def can_make(self) -> bool:
        """Whether a stage can make this run's variants here: not where it has no best.ckpt,
        nor checkpoints/ to train it back from, as in the copy of a run a model image holds."""
        return self.best_ckpt.is_file() or self.checkpoints.is_dir()

    def make_command(self, variant: str) -> str:
        """The stage that makes `variant` of this run, as a command quoted for a message."""
        stage = _stage_of(variant)
        return self.train_command() if stage == "train" else self.command(stage)

    def remake_command(self, variant: str) -> str:
        """The command that makes just `variant` of this run again, quoted for a message.
        Where no stage can run (`can_make`), `remake_hint` says what to do instead."""
        stage = _stage_of(variant)
        if stage == "train":
            return self.train_command()  # with the run's PYTHONPATH itself
        env = self.pythonpath()
        if stage == "quantize":
            method = variant.removeprefix("onnx-int8-")
            return f"`{stage_on(self.root, stage, env, 'methods', [method])}`"
        fmt = variant.removesuffix("-fp32")
        return f"`{stage_on(self.root, stage, env, 'formats', [fmt])}`"

    def requantize(self, variant: str, target: str, flags: object = ()) -> str:
        """How to make int8 `variant` of this run again for `target` (auto: this machine), with
        the other options it was made with (its entry's `flags`, as the manifest has them: a
        list of words, else none), for a message's fix."""
        kept = [str(f) for f in flags] if isinstance(flags, (list, tuple)) else []
        if "--target" in kept[:-1]:  # the option and its value: the new target replaces them
            at = kept.index("--target")
            del kept[at : at + 2]
        if target != "auto":
            kept += ["--target", target]
        method = variant.removeprefix("onnx-int8-")
        if not self.can_make():  # a model image: quantized where its run is, for this CPU
            return (
                f"{self.root} has no best.ckpt to make it from ({IN_AN_IMAGE}): rebuild the "
                "image from a run quantized for this CPU: `make quantize docker-model "
                f"RUN=runs/NAME QUANTIZE_ARGS='{' '.join(['--methods', method, *kept])}'`"
            )
        command = stage_on(self.root, "quantize", self.pythonpath(), "methods", [method], (), kept)
        return f"re-quantize it: `{command}`"

    def make_hint(self, variant: str) -> str:
        """How to make a missing `variant` of this run, for a message's fix: run its stage,
        or where none can run here (`can_make`), why, and how to have it all the same."""
        if self.can_make():
            return f"run {self.make_command(variant)} first"
        return self._elsewhere(variant)

    def remake_hint(self, variant: str) -> str:
        """`make_hint` for a `variant` that is there but wrong: re-run the stage that makes it."""
        if self.can_make():
            return f"re-run {self.remake_command(variant)}"
        return self._elsewhere(variant)

    def _elsewhere(self, variant: str) -> str:
        made = "" if _stage_of(variant) == "train" else " to make it from"
        return f"{self.root} has no best.ckpt{made} ({IN_AN_IMAGE}): {self.rebuild_hint(variant)}"

    def rebuild_hint(self, variant: str, *then: str) -> str:
        """How to have `variant` in a model image, whose run no stage can make it of: make it
        (and `then` stages) in the run the image was built from, and build the image again."""
        if variant in ("torchscript", "pt2", "eager", "checkpoint"):  # torch's: .dockerignore
            return (  # lets none into an image
                "serve an ONNX variant, e.g. --variant onnx-fp32, or mount the whole run at "
                "/model in an image with torch (Dockerfile.gpu, --build-arg TORCH_VERSION=...)"
            )
        stages = " ".join((_stage_of(variant), *then))
        return (
            f"rebuild the image from a run that has it: `make {stages} docker-model RUN=runs/NAME`"
        )

    def require_checkpoint(self) -> Path:
        if not self.root.is_dir():
            raise RunError(
                f"run directory {self.root} does not exist: run {self.train_command()} first"
                f"{check_the_name(self.root)}"
            )
        if not self.best_ckpt.is_file():
            raise RunError(f"no best.ckpt in {self.root}: run {self.train_command()} first")
        return self.best_ckpt

    def check_checkpoint(self, recorded: dict[str, Any], stage: str = "export") -> str:
        """best.ckpt's sha256, where it is the file its manifest entry `recorded` says; else a
        RunError that says how to get it back (a truncated or replaced checkpoint), or to run
        `stage` on the run that made it."""
        return check_recorded(
            self.best_ckpt,
            recorded,
            "it is not the checkpoint `lightship train` wrote for this run; train it again "
            f"({self.train_command()}), or {stage} the run that made it",
        )

    def manifest(self) -> dict[str, Any]:
        path = self.manifest_path
        if not path.exists():
            if path.is_symlink():  # not "no manifest": its fix, training again, lost the run
                raise RunError(
                    f"{path} is a symbolic link to {os.readlink(path)}, which cannot be read "
                    "(gone, or a loop): put the run's manifest.json back in its place"
                )
            return {"schema": MANIFEST_SCHEMA, "artifacts": {}}
        try:
            data = json.loads(path.read_text())
        except PermissionError as exc:  # deleting it, as below, would lose the run's record
            raise RunError(
                f"{path} is unreadable ({exc.strerror}): check its permissions"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RunError(
                f"{path} is unreadable ({exc}): delete it and re-run the stages, from "
                f"{self.train_command()}"
            ) from None
        if not isinstance(data, dict):
            raise self._malformed('expected {"schema": 1, "artifacts": {name: {"file": ...}}}')
        schema = data.get("schema")
        if type(schema) is int and schema > MANIFEST_SCHEMA:  # not bool: True == 1
            raise RunError(
                f"{path} was written by a newer lightship (manifest schema {schema}; lightship "
                f"{__version__} reads schema {MANIFEST_SCHEMA}): upgrade lightship to use this run"
            )
        artifacts = data.get("artifacts")
        if not isinstance(artifacts, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("file"), str) for e in artifacts.values()
        ):
            raise self._malformed('expected {"artifacts": {name: {"file": ...}}}')
        if type(schema) is not int or schema != MANIFEST_SCHEMA:
            raise self._malformed(f"schema {schema!r}, expected {MANIFEST_SCHEMA}")
        for key, entry in artifacts.items():
            for field, value in entry.items():
                # a path it lists outside the run would be hashed, loaded, served or deleted
                if field.startswith("file") and not _inside_run(value):
                    raise self._malformed(f"{key} {field} {value!r} lies outside the run directory")
        return data

    def _malformed(self, what: str) -> RunError:
        """A manifest.json that no lightship wrote as it is. Deleted, the stages write it anew:
        training (resumed, if it can be) records the checkpoint again, export the rest."""
        return RunError(
            f"{self.manifest_path} is malformed ({what}): delete it and re-run the stages, "
            f"from {self.train_command()}"
        )

    def later_training(self, recorded: dict[str, Any]) -> str | None:
        """How checkpoints/ tells of a later training than the one whose best.ckpt the entry
        `recorded` describes, stopped before it chose and recorded its best checkpoint (killed,
        Ctrl-C, a crash): its last.ckpt trained past the step that entry ended at (a resume,
        more epochs), or, for a new training stopped at any step, the top-k file best.ckpt was
        copied from is gone or another file and last.ckpt was written after best.ckpt (an
        edited best.ckpt, or a run copied in another order, is no sign of one). Said as what
        follows "best.ckpt is from a training that"; None where there is no such training.
        last.ckpt is read with mmap: its step alone, not the weights."""
        import torch  # a stage's: never on a serving path

        try:
            ended = int(recorded["global_step"])
            last = torch.load(self.last_ckpt, map_location="cpu", weights_only=True, mmap=True)
            step = int(last["global_step"])
        except Exception:  # no last.ckpt, or one unreadable: nothing to say of it here
            return None
        last_name = self.relative(self.last_ckpt)
        if step > ended:
            return f"ended at step {ended}, but {last_name} reached step {step}"
        try:
            newer = self.last_ckpt.stat().st_mtime_ns > self.best_ckpt.stat().st_mtime_ns
        except OSError:
            return None
        source = recorded.get("source_checkpoint")
        if not newer or not isinstance(source, str) or not source or Path(source).is_absolute():
            return None
        path = self.root / source
        if self.root.resolve() not in path.resolve().parents:
            return None
        try:
            same = path.stat().st_size == recorded.get("bytes") and (
                sha256_file(path) == recorded.get("sha256")
            )
        except OSError:  # gone
            same = False
        if same:
            return None
        return (
            f"was copied from {source}, which a later training has replaced ({last_name} is at "
            f"step {step})"
        )

    def artifact(self, key: str) -> dict[str, Any] | None:
        entry = self.manifest()["artifacts"].get(key)
        return dict(entry) if entry is not None else None

    def made_elsewhere(self, key: str, artifacts: dict[str, Any] | None = None) -> str | None:
        """What `key`'s entry says its file was made from where that is not this run's model
        (an entry copied in from another run with its file; export and train drop the ones
        they outdate): an export of another checkpoint than best.ckpt's, an int8 model
        quantized from another model.onnx. None where it is this run's, or does not say."""
        artifacts = self.manifest()["artifacts"] if artifacts is None else artifacts
        entry = artifacts.get(key)
        if not isinstance(entry, dict):
            return None
        for field, parent, what in (
            (
                "source_checkpoint_sha256",
                "checkpoint",
                "another checkpoint than the run's best.ckpt",
            ),
            ("source_sha256", "onnx-fp32", "another model.onnx than the run's"),
        ):
            made_from = entry.get(field)
            recorded = (artifacts.get(parent) or {}).get("sha256")
            if made_from and recorded and made_from != recorded:
                return f"made from {what} (its {field} is not {parent}'s sha256)"
            # made from this run's model.onnx as listed, which is another run's: both came in
            if (
                made_from
                and recorded
                and parent not in ("checkpoint", key)  # an edited entry naming itself: no loop
                and (parents := self.made_elsewhere(parent, artifacts)) is not None
            ):
                return f"made from {parent}, which was {parents}"
        return None

    def file_sha256(self, key: str) -> str | None:
        """The sha256 of the file the manifest lists for `key` as it is now (not as recorded);
        None where it lists none, or that is not a file."""
        file = (self.artifact(key) or {}).get("file")
        path = self.root / str(file)
        return sha256_file(path) if file and path.is_file() else None

    def data_spec(self) -> dict[str, Any]:
        """The data set and split training used (the checkpoint entry's `data_spec`), checked
        as the config checks its `data` section: the data module trusts it."""
        from pydantic import ValidationError

        # here: serving reads manifests, never this
        from lightship.config import DataConfig, without_unread_path

        spec = (self.artifact("checkpoint") or {}).get("data_spec")
        if not isinstance(spec, dict):
            raise self._malformed("no data_spec in its checkpoint entry")
        try:
            DataConfig.model_validate(
                {k: v for k, v in without_unread_path(spec).items() if k in DataConfig.model_fields}
            )
        except ValidationError as err:
            first = err.errors()[0]
            key = ".".join(str(p) for p in first["loc"])
            raise self._malformed(
                f"its checkpoint's data_spec.{key} = {first.get('input')!r}: {first['msg']}"
            ) from None
        return spec

    def record(self, key: str, entry: dict[str, Any]) -> None:
        """Add or replace one manifest entry (read-modify-write, atomically replaced). An entry
        replaced by one of another file (sha256), or judged otherwise (`JUDGED`: quantized
        again to the same bytes under another gate), takes the report with it: its figures
        and its recommendation are the old entry's."""
        data = self.manifest()
        old = data["artifacts"].get(key)
        if old is not None and any(old.get(k) != entry.get(k) for k in JUDGED):
            self._remove(*REPORT_FILES)
        data["artifacts"][key] = entry
        self._save(data)

    def discard(self, *keys: str) -> list[str]:
        """Unlist `keys` and delete their files (every `file*` field). The report measured them,
        so when any was listed the report's files go too: a report.json left behind would
        recommend a variant the manifest no longer has, and report.md and pareto.png would show
        its figures. Returns the keys that were listed."""
        data = self.manifest()
        listed = [k for k in keys if k in data["artifacts"]]
        if listed:
            files = _entry_files(data["artifacts"][k] for k in listed)
            # Files first: interrupted here, the manifest still lists what is missing, which the
            # stages report and `make` rebuilds; never a stale file left on disk unlisted.
            self._remove(*REPORT_FILES, *(glob.escape(f) for f in files))
            for k in listed:
                data["artifacts"].pop(k)
            self._save(data)
        return listed

    def unlisted_derived(self) -> list[str]:
        """Run-relative files that `discard_derived` deletes without a manifest entry naming
        them: the report's, and what export or quantize left unlisted (a run whose
        manifest.json was lost)."""
        listed = set(_entry_files(self.manifest()["artifacts"].values()))
        return [
            rel
            for pattern in DERIVED_FILES
            for path in sorted(self.root.glob(pattern))
            if path.is_file() and (rel := path.relative_to(self.root).as_posix()) not in listed
        ]

    def discard_derived(self, keep: Collection[str] = ()) -> list[str]:
        """Everything made from best.ckpt goes, before a new best.ckpt replaces it: every entry
        but the checkpoint is discarded, with any unlisted leftover of export, quantize or report
        (DERIVED_FILES), so the disk matches the manifest and `make`, which sees files, rebuilds
        them. Entries in `keep` stay with their files (`made_from`: the best.ckpt they record is
        the one that stays), and the report with them where nothing else goes. Returns the
        unlisted keys."""
        artifacts = self.manifest()["artifacts"]
        keys = [k for k in artifacts if k != "checkpoint" and k not in keep]
        kept = set(_entry_files(artifacts[k] for k in keep if k in artifacts))
        leftovers = [
            rel
            for pattern in DERIVED_FILES
            for path in sorted(self.root.glob(pattern))
            if (rel := path.relative_to(self.root).as_posix()) not in kept
            and rel not in REPORT_FILES
        ]
        # the report measured what goes, or nothing is kept that it could speak for
        report = REPORT_FILES if leftovers or keys or not kept else ()
        self._remove(*report, *(glob.escape(rel) for rel in leftovers))
        return self.discard(*keys)

    def made_from(self, checkpoint_sha256: str) -> list[str]:
        """The keys of the entries that record being made from the checkpoint whose sha256 is
        given: exports by their `source_checkpoint_sha256`, int8 models by their
        `source_sha256`, that of such an onnx-fp32. What a finished run's resume keeps where
        its manifest lost the checkpoint's entry but not theirs."""
        artifacts = self.manifest()["artifacts"]  # every entry a dict: manifest() checks
        exports = [
            k
            for k, e in artifacts.items()
            if e.get("source_checkpoint_sha256") == checkpoint_sha256
        ]
        if "onnx-fp32" not in exports:
            return exports
        onnx = artifacts["onnx-fp32"].get("sha256")
        quantized = [
            k for k, e in artifacts.items() if e.get("source_sha256") == onnx and k not in exports
        ]
        return exports + quantized

    def _save(self, data: dict[str, Any]) -> None:
        data["schema"] = MANIFEST_SCHEMA
        atomic_write_text(self.manifest_path, json.dumps(data, indent=2) + "\n")

    def _remove(self, *patterns: str) -> None:
        """Delete the files matching each run-relative pattern, and the folders that leaves
        empty (export/, quantize/, report/ after a retrain); never outside the run (a folder
        linked in from elsewhere), never a folder holding anything. A link in the run is
        deleted, not what it points at: left, it stood unlisted where its stage writes, said
        to be deleted, and `make`, which sees files, took the stage for done."""
        root = self.root.resolve()
        for pattern in patterns:
            if not pattern or Path(pattern).is_absolute():
                continue
            for path in sorted(self.root.glob(pattern)):
                folder = path.parent.resolve()
                inside = folder == root or root in folder.parents
                if inside and (path.is_symlink() or path.is_file()) and not path.is_dir():
                    path.unlink(missing_ok=True)
                    for parent in (folder, *folder.parents):
                        if parent == root:
                            break
                        try:
                            parent.rmdir()  # refused unless empty
                        except OSError:
                            break

    def set_aside(self) -> Path:
        """A new hidden folder for the checkpoints and config.yaml a new training replaces,
        kept until it has a checkpoint of its own (see `put_back`)."""
        return Path(tempfile.mkdtemp(prefix=SET_ASIDE_PREFIX, dir=self.root))

    def put_back(self, folder: Path) -> None:
        """The checkpoints and config.yaml set aside in `folder` replace the ones a training
        wrote since, and the folder goes: the run is as it was before that training.

        The folder's markers say where a stop left it (`recover_set_aside` reads them): filled
        whole (SET_ASIDE_DONE), the checkpoints beside it are the new training's; being put
        back (SET_ASIDE_BACK, made first), those are still being deleted, the new last.ckpt
        first; neither, the old ones are going back (last.ckpt last) or were still being set
        aside, and the checkpoints beside them are old: they stay."""
        done, back = folder / SET_ASIDE_DONE, folder / SET_ASIDE_BACK
        if done.is_file() or back.is_file():
            back.touch()
            done.unlink(missing_ok=True)
            for new in sorted(self.checkpoints.glob("*.ckpt"), key=lambda p: p != self.last_ckpt):
                new.unlink()
            back.unlink()
        kept = sorted(folder.iterdir(), key=lambda old: old.name == self.last_ckpt.name)
        for old in kept:
            os.replace(old, self.config if old.suffix == ".yaml" else self.checkpoints / old.name)
        folder.rmdir()

    def drop_set_aside(self, folder: Path) -> None:
        """Delete a set-aside folder that newer checkpoints outdate: renamed first, in one step,
        to a scratch name (`sweep_temporaries` deletes what is left of it after a kill). Deleted
        file by file under its own name, one stopped halfway was put back by the next training
        over the new checkpoints: where it cannot be renamed it stays, whole, for the next
        training's `recover_set_aside`."""
        outdated = folder.with_name(
            SCRATCH_PREFIXES["outdated"] + folder.name.removeprefix(SET_ASIDE_PREFIX)
        )
        try:
            os.replace(folder, outdated)
        except OSError:
            log.warning("%s: cannot rename it to delete it; the next training will", folder)
            return
        shutil.rmtree(outdated, ignore_errors=True)

    def recover_set_aside(self) -> str | None:
        """What a training killed outright (kill -9, out of memory) set aside: put back when it
        wrote no checkpoint of its own (no last.ckpt), or was being put back, else outdated by
        its checkpoints and deleted (`put_back` says what each marker means). Call with the
        run's lock held. Returns what was done, for a line to print."""
        if distributed_worker():
            # a DDP worker re-runs the command line while rank 0 fills its own stash: it put
            # back, or tried to delete, what rank 0 had just set aside
            return None
        done = None
        for folder in sorted(self.root.glob(f"{SET_ASIDE_PREFIX}*")):
            if not folder.is_dir() or folder.is_symlink():
                continue
            if all(p.name in (SET_ASIDE_DONE, SET_ASIDE_BACK) for p in folder.iterdir()):
                # a new run's: nothing was set aside, so nothing to say was put back or deleted
                self.drop_set_aside(folder)
                continue
            if (folder / SET_ASIDE_BACK).is_file():
                outdated = False  # a diverged training's, or one's stopped before its checkpoint
            elif (folder / SET_ASIDE_DONE).is_file():
                outdated = self.last_ckpt.is_file()  # the new training's: it had one
            else:
                # being filled (last.ckpt first: the one beside a folder without it is the old
                # one), being put back (last.ckpt last), or an older lightship's
                outdated = self.last_ckpt.is_file() and (
                    (folder / "last.ckpt").is_file() or not any(folder.glob("*.ckpt"))
                )
            if outdated:
                self.drop_set_aside(folder)
                done = done or "deleted the old checkpoints a stopped training had set aside"
            else:
                self.put_back(folder)
                done = (
                    "put back the checkpoints and config.yaml that a training stopped before "
                    "its first checkpoint had set aside"
                )
        return done

    def relative(self, path: Path) -> str:
        return str(path.resolve().relative_to(self.root.resolve()))


RunLike = RunDir | str | os.PathLike[str]


def as_run(run: RunLike) -> RunDir:
    """A stage's run given as a RunDir or as its path (a str or a Path, as a script passes it),
    checked as the CLI's --run is (`run_dir_parser`): a `~` expanded (Lightning expanded it
    for the checkpoints alone, and a folder named `~` got the rest), and a file or a run's own
    folder refused, naming the run it lies in, where a stage would make a run inside a run."""
    if isinstance(run, RunDir):
        return run
    if not isinstance(run, (str, os.PathLike)) or not str(run).strip():
        raise RunError(  # not pathlib's TypeError, which no `except LightshipError` catches
            f"a run is its directory's path or a RunDir, got {run!r}: e.g. 'runs/default'"
        )
    return RunDir(run_dir_parser("run")(Path(run)))
