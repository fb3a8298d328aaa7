"""User-facing errors: the CLI prints their message as one line and exits non-zero.

Raise these for mistakes a user can fix (bad config, missing run, corrupt file); the message
says what is wrong and how to fix it. Anything else is a bug and keeps its traceback.
"""


class LightshipError(Exception):
    exit_code = 1


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of text of `exc`'s message, cut at `limit` characters ('' if it has
    none): what a one-line error quotes of a library's several-line one."""
    lines = (line.strip() for line in str(exc).splitlines())
    return next((line for line in lines if line), "")[:limit]


class ConfigError(LightshipError):
    exit_code = 2


class DataError(LightshipError):
    exit_code = 3


class RunError(LightshipError):
    """A run directory, checkpoint or artifact is missing or unusable."""

    exit_code = 4


class ParityError(LightshipError):
    exit_code = 5


class QuantizeError(LightshipError):
    """Quantization could not produce a model (unsupported op, empty calibration set, ...)."""

    exit_code = 6


class RunBusyError(LightshipError):
    """Another process holds the run directory's lock (a stage is writing it)."""

    exit_code = 7
