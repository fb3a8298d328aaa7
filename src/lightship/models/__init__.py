"""Model zoo and registry: `create(spec)` builds any model by name or `package.module:Class`.

Every model built here starts with `Normalize`, so it takes raw uint8 pixels `[N, C, H, W]`
and every exported artifact does too.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import pkgutil
import shlex
import sys
import sysconfig
import traceback
from collections.abc import Callable, Mapping
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightship.errors import ConfigError, first_line
from lightship.models.layers import Normalize
from lightship.models.zoo import MLP, DigitsCNN, ResNet18

Builder = Callable[..., nn.Module]

REGISTRY: dict[str, Builder] = {
    "digits_cnn": DigitsCNN,
    "resnet": ResNet18,
    "mlp": MLP,
}

# Keys of a model spec: the dict stored in every checkpoint, enough to rebuild the network.
# A user model's spec also holds `module_file`, where its module was at training: the folder
# to put on PYTHONPATH when a later stage cannot import it.
SPEC_KEYS = ("name", "kwargs", "in_channels", "num_classes", "image_size", "mean", "std")


class UnknownModelArguments(ConfigError):
    """model.kwargs names arguments the model's __init__ does not take."""

    def __init__(self, name: str, unknown: list[str], accepted: list[str]) -> None:
        self.name, self.unknown, self.accepted = name, unknown, accepted
        super().__init__(
            f"model '{name}' takes no argument {', '.join(map(repr, unknown))} (it takes "
            f"{', '.join(accepted) or 'none'}); check model.kwargs"
        )


def import_root(module_name: str, file: str | Path) -> Path:
    """The folder that puts `module_name`, found at `file`, on the import path (PYTHONPATH):
    the one holding its top-level package."""
    path = Path(file)
    return path.parents[module_name.count(".") + (path.name == "__init__.py")]


def shown_path(path: Path) -> str:
    """`path` for a command line run here: relative when it lies below this folder, quoted."""
    here = Path.cwd().resolve()
    resolved = path.resolve()
    shown = str(resolved.relative_to(here)) if resolved.is_relative_to(here) else str(resolved)
    return shlex.quote(shown)


def _import_fix(module_name: str, module_file: str | None, missing: str) -> str:
    """How to make `module_name` importable: install it, or put its folder on PYTHONPATH (the
    one it was trained from, when the checkpoint recorded it and it is still there; this one,
    when it is here); or, where a module of a close name is on the path, that name. `missing`:
    the module Python did not find, `module_name` or a package above it; a module of a package
    that imported is named among that package's own."""
    parent, _, last = missing.rpartition(".")
    package = sys.modules.get(parent) if parent else None
    if package is not None and hasattr(package, "__path__"):
        names = sorted({m.name for m in pkgutil.iter_modules(package.__path__)})
        near = difflib.get_close_matches(last, names, n=1, cutoff=0.75)
        if near:
            return f"did you mean '{parent}.{near[0]}' (a module of {parent})?"
        return f"{parent} has no module {last} (it has: {', '.join(names) or 'none'})"
    if package is not None:  # `mod.Class:...`: the class goes after the colon
        return (
            f"{parent} is a module, not a package: its class goes after a colon ({parent}:{last})"
        )
    top = module_name.partition(".")[0]
    if module_file and Path(module_file).is_file():
        folder = f"{shown_path(import_root(module_name, module_file))} (its folder at training)"
    elif (Path(top + ".py") if top == module_name else Path(top)).exists():
        folder = "."
    else:
        near = difflib.get_close_matches(top, _importable_names(), n=1, cutoff=0.75)
        if near:
            return f"did you mean '{near[0]}' (a module on the import path)?"
        folder = f"<folder of {top}.py>" if top == module_name else f"<folder holding {top}/>"
    return f"install it, or run with PYTHONPATH={folder}"


def _importable_names() -> list[str]:
    """The top-level modules and packages of PYTHONPATH's folders and this one: the places a
    user's own model module is put (not site-packages: thousands of names, none of them it)."""
    folders = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + ["."]
    return sorted({m.name for m in pkgutil.iter_modules(folders)})


def _location(exc: BaseException) -> str:
    """Where an exception raised importing a module points: a SyntaxError's own line, else
    the innermost frame of its traceback in the user's code (not Python's or a library's)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}, line {exc.lineno}"
    libraries = tuple(sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib"))
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if not f.filename.startswith(("<", *libraries))] or frames
    return f"{own[-1].filename}, line {own[-1].lineno}" if own else "its module"


def pythonpath_prefix(name: str, file: str | None) -> str:
    """'PYTHONPATH=DIR ' for a command that loads user model `name` (its module at `file`) when
    that module is importable only through PYTHONPATH or this folder, or not at all: a shell
    without them cannot load it. '' otherwise (installed, or a registry model)."""
    if not file or ":" not in name:
        return ""
    module_name = name.partition(":")[0]
    try:
        found = importlib.util.find_spec(module_name.partition(".")[0])
    except (ImportError, ValueError):
        found = None
    if found is None:  # not importable here: the folder it was trained from is the best guess
        return f"PYTHONPATH={shown_path(import_root(module_name, file).resolve())} "
    # Where it is found now, not where it was at training: its folder may have moved since.
    root = _spec_root(found)
    given = {Path(p).resolve() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    if root is not None and (root in given or root == Path.cwd().resolve()):
        return f"PYTHONPATH={shown_path(root)} "
    return ""


def _spec_root(found: ModuleSpec) -> Path | None:
    """The folder a top-level module or package is imported from (None: not from a folder)."""
    if found.origin and Path(found.origin).is_file():
        return import_root(found.name, found.origin).resolve()
    locations = list(found.submodule_search_locations or [])  # a namespace package
    return Path(locations[0]).resolve().parent if locations else None


def spec_pythonpath(spec: Mapping[str, Any]) -> str:
    """`pythonpath_prefix` of a model spec (a checkpoint's `model_spec`, a manifest entry's
    `model`): its name and the module file it was trained from."""
    return pythonpath_prefix(str(spec.get("name", "")), spec.get("module_file"))


def resolve(name: str, module_file: str | None = None) -> Builder:
    """The builder `name` stands for; `module_file`, where a user model's module was at
    training, says where to find it when it cannot be imported."""
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" not in name:
        known = ", ".join(sorted(REGISTRY))
        raise ConfigError(f"unknown model '{name}': use one of {known} or 'package.module:Class'")
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:  # `:Net` read as a module of no name, in lightship's frames
        raise ConfigError(
            f"model '{name}' needs a module and a class, as 'package.module:Class' (e.g. "
            "mymodels:Net, with mymodels.py on PYTHONPATH)"
        )
    if module_name.endswith(".py") or "/" in module_name:  # a file's path, not a module's name
        dotted = module_name.removesuffix(".py").strip("/").replace("/", ".")
        raise ConfigError(
            f"model '{name}' names a file: give its module's name, model.name={dotted}:{attr}, "
            "and run with PYTHONPATH set to the folder it is in"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        if missing and f"{module_name}.".startswith(f"{missing}."):
            fix = _import_fix(module_name, module_file, missing)
        else:  # found, but what it imports is missing or broken
            fix = f"install what {module_name} needs, or fix its imports"
        raise ConfigError(f"model '{name}': cannot import {module_name} ({exc}): {fix}") from None
    except Exception as exc:  # the module's own code: a SyntaxError, a NameError at its top
        reason = exc.msg if isinstance(exc, SyntaxError) else first_line(exc)
        raise ConfigError(
            f"model '{name}': importing {module_name} failed: {type(exc).__name__}: "
            f"{reason} ({_location(exc)}): fix the module"
        ) from None
    builder = getattr(module, attr, None)
    if builder is None:
        classes = sorted(
            n
            for n, v in vars(module).items()
            if inspect.isclass(v)
            and issubclass(v, nn.Module)
            and getattr(v, "__module__", None) == module.__name__
        )
        near = difflib.get_close_matches(attr, classes, n=1)
        has = f"; did you mean '{near[0]}'?" if near else ""
        if not near:
            has = f": it has {', '.join(classes)}" if classes else ": it has no torch module"
        raise ConfigError(f"model '{name}': {module_name} has no class '{attr}'{has}")
    # Only torch modules: a model name also comes from checkpoints, which may come from anyone,
    # and "os:system" with kwargs would otherwise run a command when the checkpoint is loaded.
    if not (inspect.isclass(builder) and issubclass(builder, nn.Module)):
        raise ConfigError(
            f"model '{name}' is not a torch.nn.Module class: name a class, 'package.module:Net'"
        )
    return builder


def module_file(name: str) -> str | None:
    """The file of a user model's module (None for a registry model), recorded at training."""
    if name in REGISTRY:
        return None
    resolve(name)  # imports the module, or says why it cannot
    return getattr(importlib.import_module(name.partition(":")[0]), "__file__", None)


def _arguments(builder: Builder) -> tuple[list[str] | None, bool]:
    """The keyword arguments `builder` takes (None: it has no signature to read), and whether
    it takes any (**kwargs)."""
    try:
        params = inspect.signature(builder).parameters.values()
    except (TypeError, ValueError):
        return None, False
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return (
        [p.name for p in params if p.kind in named],
        any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params),
    )


def _required_beyond(builder: Builder, given: dict[str, Any]) -> list[str]:
    """The arguments `builder` requires that `given` lacks ([] where its signature is not
    read): those without a default that a keyword can give (a positional-only one cannot be
    given in model.kwargs: Python's own error says it lacks)."""
    try:
        params = inspect.signature(builder).parameters.values()
    except (TypeError, ValueError):
        return []
    required = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        p.name
        for p in params
        if p.kind in required and p.default is inspect.Parameter.empty and p.name not in given
    ]


def takes_argument(name: str, argument: str) -> bool:
    """Whether model `name` is called with `argument` (one of the standard ones)."""
    named, takes_any = _arguments(resolve(name))
    return takes_any or argument in (named or [])


def _call_with_known(
    name: str, builder: Builder, standard: dict[str, Any], extra: dict[str, Any]
) -> nn.Module:
    """Pass the standard arguments a builder accepts (user models may take fewer)."""
    named, takes_any = _arguments(builder)
    if named is not None and not takes_any:
        unknown = [k for k in extra if k not in named]
        if unknown:
            raise UnknownModelArguments(name, unknown, named)
    kwargs = {k: v for k, v in standard.items() if takes_any or k in (named or [])}
    kwargs.update(extra)
    needed = _required_beyond(builder, kwargs)
    if needed:
        # called, it failed in lightship's own call, which the message named as the line to fix
        them = "it" if len(needed) == 1 else "them"
        raise ConfigError(
            f"model {name} requires {', '.join(repr(n) for n in needed)}, which lightship does "
            f"not pass (it passes {', '.join(standard)} to a model that takes them, and "
            f"model.kwargs): give {them} in model.kwargs, e.g. --set "
            f"model.kwargs.{needed[0]}=VALUE, or a default in the model"
        )
    try:
        model = builder(**kwargs)
    except Exception as exc:  # a value the model refuses (an assert, a format of it...)
        reason = first_line(exc)
        where = "" if name in REGISTRY else f" ({_location(exc)})"  # the line in a user's model
        given = f"model.kwargs {extra}, and " if extra else ""
        # a built-in model given no kwargs refused the data's (image_size 4): data.image_size
        # is what to change; a user's model may fail for its own reasons (its line is named)
        fix = (
            "check data.image_size and data.channels (the model's image_size and "
            "in_channels), or choose another model.name"
            if not extra and name in REGISTRY
            else "check model.kwargs"
            if extra
            else "fix the model there, or data.image_size / data.channels if it refuses those"
        )
        raise ConfigError(
            f"cannot build model {name} with {given}{sorted(set(kwargs) - set(extra))}: "
            f"{type(exc).__name__}: {reason}{where}; {fix}"
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model builder returned {type(model).__name__}, not a torch.nn.Module")
    return model


class Classifier(nn.Sequential):
    """`Normalize` followed by the network: raw uint8 pixels in, logits out."""

    def __init__(self, normalize: Normalize, net: nn.Module) -> None:
        super().__init__()
        self.normalize = normalize
        self.net = net


def create(spec: dict[str, Any]) -> Classifier:
    """Build a classifier from a spec (see SPEC_KEYS); the weights are fresh."""
    missing = [k for k in SPEC_KEYS if k not in spec]
    if missing:
        raise ConfigError(f"model spec lacks {missing}; it must carry {list(SPEC_KEYS)}")
    builder = resolve(spec["name"], spec.get("module_file"))
    standard = {
        "in_channels": spec["in_channels"],
        "num_classes": spec["num_classes"],
        "image_size": spec["image_size"],
    }
    net = _call_with_known(spec["name"], builder, standard, dict(spec["kwargs"]))
    return Classifier(Normalize(spec["mean"], spec["std"]), net)


def unusable_logits(out: Tensor) -> str | None:
    """What is wrong with a model's logits that no exported model or server can give back
    (bfloat16, which numpy cannot hold; whole numbers), or None: float16 and float64 are read
    as float32."""
    if out.dtype == torch.bfloat16 or not out.is_floating_point():
        return (
            f"{str(out.dtype).removeprefix('torch.')} logits, which the runtimes cannot give back"
        )
    return None


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "REGISTRY",
    "SPEC_KEYS",
    "Classifier",
    "Normalize",
    "UnknownModelArguments",
    "count_parameters",
    "create",
    "import_root",
    "module_file",
    "pythonpath_prefix",
    "resolve",
    "takes_argument",
]
