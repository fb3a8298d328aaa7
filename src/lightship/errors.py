"""User-facing errors: the CLI prints their message as one line and exits non-zero.

Raise these for mistakes a user can fix (bad config, missing run, corrupt file); the message
says what is wrong and how to fix it. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import dataclasses
from numbers import Integral, Real
from typing import Any

import numpy as np


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


# A settings dataclass's annotations (strings, under `from __future__ import annotations`), as
# the values they take: numpy's integers, floats and bools too; a bool only where it says bool.
_KINDS: dict[str, tuple[type, ...]] = {
    "int": (Integral,),
    "float": (Real,),
    "bool": (bool, np.bool_),
    "str": (str,),
}


def check_settings(settings: Any, cls: Any, what: str) -> None:
    """ConfigError unless `settings` is a `cls` (a settings dataclass) whose fields hold values
    of their annotated kinds: a dict, or `rounds=2.5`, ran into Python's AttributeError or
    TypeError deep in a stage, past a caller's `except LightshipError`."""
    if not isinstance(settings, cls):
        example = ", ".join(f"{f.name}=..." for f in dataclasses.fields(cls)[:2])
        raise ConfigError(
            f"{what}'s settings must be a {cls.__name__}, got {type(settings).__name__}: e.g. "
            f"{cls.__name__}({example})"
        )
    for f in dataclasses.fields(settings):
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", f.type)
        names = [name.strip() for name in str(annotation).split("|")]
        value = getattr(settings, f.name)
        kinds = [_KINDS[name] for name in names if name in _KINDS]
        if (value is None and "None" in names) or len(kinds) < len(names) - ("None" in names):
            continue  # None where allowed; a kind not read here
        wrong_bool = isinstance(value, bool | np.bool_) and "bool" not in names
        if wrong_bool or not isinstance(value, tuple(t for kind in kinds for t in kind)):
            raise ConfigError(f"{what}'s {f.name} must be {' or '.join(names)}, got {value!r}")
