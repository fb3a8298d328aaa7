"""When torch cannot export a model: its reason in one line, and its printout kept for debugging."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
from collections.abc import Iterator

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
def printout_on_failure_to_debug(log: logging.Logger, what: str) -> Iterator[None]:
    """What the block prints to sys.stderr: passed on when it succeeds, sent to `log`'s debug
    level when it raises. torch.export prints the partial graph of an export it cannot finish
    (hundreds of lines) before raising; the error, or the fallback that follows, says why."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            yield
    except BaseException:
        log.debug("%s printed:\n%s", what, printed.getvalue())
        raise
    sys.stderr.write(printed.getvalue())
