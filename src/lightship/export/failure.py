"""When torch cannot export a model: its reason in one line, and its printout kept for debugging."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import torch

_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def reason(exc: BaseException, limit: int = 200) -> str:
    """`Type: first line` of the innermost cause. torch's exporters wrap the error that names the
    operator or the guard in ones that only say which step failed ("step 1/3 of exporting the
    model to ONNX", in colour), and some messages start with a blank line."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = (" ".join(line.split()) for line in _COLOUR.sub("", str(exc)).splitlines())
    first = next((line for line in lines if line), "")
    return f"{type(exc).__name__}: {first[:limit]}" if first else type(exc).__name__


@contextlib.contextmanager
def _captured(name: str, into: IO[str]) -> Iterator[None]:
    """`sys.<name>` ("stdout" or "stderr") and its file descriptor both write to `into` for the
    block: what C++ prints, and what handlers holding the real stream (torch's logging, made
    at import) write, land there too."""
    stream, fd = getattr(sys, name), {"stdout": 1, "stderr": 2}[name]
    stream.flush()
    saved = os.dup(fd)
    os.dup2(into.fileno(), fd)
    setattr(sys, name, into)
    try:
        yield
    finally:
        into.flush()
        setattr(sys, name, stream)
        os.dup2(saved, fd)
        os.close(saved)


@contextlib.contextmanager
def printout_on_failure_to_debug(log: logging.Logger, what: str) -> Iterator[None]:
    """What the block prints, to stdout or stderr, from Python or C++: passed on when it
    succeeds, sent to `log`'s debug level (`lightship --verbose`) when it raises. Before they
    raise, torch.export prints the partial graph (hundreds of lines) and logs a warning from
    `symbolic_shapes`, and the legacy ONNX exporter prints its TorchScript graph from C++ (a
    line per node); the error, or the fallback that follows, says why."""
    with (
        tempfile.TemporaryFile("w+", buffering=1) as out,
        tempfile.TemporaryFile("w+", buffering=1) as err,
    ):
        try:
            with _captured("stdout", out), _captured("stderr", err):
                yield
        except BaseException:
            log.debug("%s printed:\n%s%s", what, _read(out), _read(err))
            raise
        sys.stdout.write(_read(out))
        sys.stderr.write(_read(err))


def _read(file: IO[str]) -> str:
    file.seek(0)
    return file.read()


def warn_frozen(
    log: logging.Logger, caught: list[warnings.WarningMessage], what: str, batch: int
) -> None:
    """One warning line for the TracerWarnings among `caught`: the tracer turned a tensor into a
    Python value (an `if` on a tensor, a size), so the file does there what the example batch
    did, whatever the input. The other warnings are passed on as they came (deprecations
    dropped: torch's, not the user's)."""
    # torch's own (the trace checker's "Output nr 1. of the traced function does not match")
    # name a line of torch's, not a branch of the model's: passed on as they came
    torch_dir = Path(torch.__file__).parent
    frozen = [
        w
        for w in caught
        if issubclass(w.category, torch.jit.TracerWarning)
        and not Path(w.filename).is_relative_to(torch_dir)
    ]
    for w in caught:
        if (
            w not in frozen
            and not issubclass(w.category, DeprecationWarning)
            and not _size_check(w.filename, w.lineno)
        ):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if frozen:
        where = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in frozen})
        log.warning(
            "%s froze Python control flow on tensors at %s (%s): the file takes the branch its "
            "example batch of %d took, for every input",
            what,
            ", ".join(where),
            str(frozen[0].message).split(". ")[0],
            batch,
        )


@functools.cache
def _size_checks() -> tuple[tuple[str, int, int], ...]:
    """(file, first line, last line) of torch.nn.functional's size checks: BatchNorm without
    running statistics (and InstanceNorm) test the batch's size to raise a clearer error on one
    value per channel. The tracer warns there of a tensor made a Python bool, but the graph does
    not branch on it: three blocks of torch's text beside nothing of the model's."""
    import torch.nn.functional as F

    found = []
    for name in ("_verify_batch_size", "_verify_spatial_size"):
        try:
            check = getattr(F, name)
            lines, first = inspect.getsourcelines(check)
            found.append((inspect.getsourcefile(check) or "", first, first + len(lines)))
        except (AttributeError, OSError, TypeError):  # renamed or gone in another torch
            continue
    return tuple(found)


def _size_check(filename: str, lineno: int) -> bool:
    return any(filename == file and first <= lineno < last for file, first, last in _size_checks())
