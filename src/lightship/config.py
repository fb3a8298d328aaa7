"""Configuration: one pydantic model per section, loaded from YAML plus dotted overrides.

Defaults live here and only here; `configs/*.yaml` are small overrides of them. Every section
forbids unknown keys, so a typo fails loudly with the list of keys that are allowed.
"""

from __future__ import annotations

import copy
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from lightship.errors import ConfigError, LightshipError, first_line


class Section(BaseModel):
    # allow_inf_nan=False: `--set optim.lr=.inf` would train a model that only outputs NaN.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic takes YAML's true as the number 1 (`--set trainer.max_epochs=true` trained
        one epoch): a number or a name is not a yes or no."""
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            if _is_section(annotation):
                return value  # a section: refused as one (`_explain`)
            if bool not in (annotation, *get_args(annotation)):
                names = _choices(annotation)
                if names:  # `progress_bar: false`: a word YAML reads as a yes or no
                    raise PydanticCustomError(
                        "bool_type",
                        "Input should be {names}, not true/false (YAML reads true/false, yes/no "
                        "and on/off as such)",
                        {"names": _either(names)},
                    )
                # the types a union allows (a dict[str, Any]'s arguments are no choice)
                union = get_origin(annotation) in (Union, UnionType)
                kinds = set(get_args(annotation)) if union else {annotation}
                if any(k is dict or get_origin(k) is dict for k in kinds):
                    raise PydanticCustomError(
                        "bool_type", "Input should be a mapping {key: value}, not true/false"
                    )
                if kinds & {str, Path} and not kinds & {int, float}:
                    # `model.name=no`, `data.path=off`: it was said to want a number
                    raise PydanticCustomError(
                        "bool_type",
                        "Input should be text, not true/false (YAML reads true/false, yes/no and "
                        "on/off as such): quote the word to keep it text, as \"'off'\"",
                    )
                raise PydanticCustomError("bool_type", "Input should be a number, not true/false")
        return value


def _either(names: list[Any]) -> str:
    """'a', 'b' or 'c'."""
    shown = [repr(n) for n in names]
    return f"{', '.join(shown[:-1])} or {shown[-1]}" if len(shown) > 1 else shown[0]


def _choices(annotation: Any) -> list[Any]:
    """The values a Literal annotation (or a union holding one) allows; [] for any other."""
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    return [c for arg in get_args(annotation) for c in _choices(arg)]


class DataConfig(Section):
    source: Literal["digits", "folder", "npz"] = "digits"
    path: Path | None = Field(None, description="image folder root or .npz file")
    image_size: int = Field(28, ge=4, le=4096, description="images are resized to this square")
    channels: Literal[1, 3] = 1
    val_fraction: float = Field(0.15, gt=0, lt=0.5)
    test_fraction: float = Field(0.15, gt=0, lt=0.5)
    split_seed: int = Field(0, ge=0)  # numpy's generators take no negative seed
    batch_size: int = Field(64, ge=1)
    eval_batch_size: int = Field(256, ge=1)
    num_workers: int = Field(0, ge=0)
    pin_memory: bool | None = Field(None, description="None: on when CUDA is used")
    persistent_workers: bool = False
    prefetch_factor: int | None = Field(None, ge=1)
    augment: bool = Field(True, description="random rotation, scale and shift while training")


class ModelConfig(Section):
    name: str = Field("digits_cnn", description="registry name or `package.module:Class`")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    mean: list[float] | None = Field(None, description="pixel mean per channel; None: from data")
    std: list[float] | None = Field(None, description="pixel std per channel; None: from data")

    @field_validator("std")
    @classmethod
    def _std_positive(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and not all(s > 0 for s in v):
            raise ValueError("every std must be > 0 (pixels are divided by it)")
        return v


class OptimConfig(Section):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(3e-3, ge=0)
    weight_decay: float = Field(1e-4, ge=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    scheduler: Literal["none", "cosine", "onecycle"] = "onecycle"
    ema_decay: float | None = Field(
        0.98, gt=0, lt=1, description="validate and checkpoint an EMA of the weights; None: off"
    )


class TrainerConfig(Section):
    max_epochs: int = Field(25, ge=1)
    min_epochs: int = Field(1, ge=0)
    max_time_s: float | None = Field(None, gt=0, description="stop fitting after this many s")
    # What lightship's checks and its CUDA/CPU code paths know; Lightning's others (tpu, mps,
    # hpu) would fail later, e.g. asking for torch_xla.
    accelerator: Literal["auto", "cpu", "gpu", "cuda"] = "auto"
    devices: int | str = 1
    strategy: str = "auto"
    num_nodes: int = Field(1, ge=1)
    precision: Literal["32", "bf16-mixed", "16-mixed"] = "32"
    accumulate_grad_batches: int = Field(1, ge=1)
    gradient_clip_val: float | None = Field(None, gt=0)
    deterministic: bool = False
    compile: bool = Field(False, description="torch.compile the model (opt-in)")
    profiler: Literal["simple", "advanced", "pytorch"] | None = None
    progress_bar: Literal["auto", "rich", "none"] = "auto"
    log_every_n_steps: int = Field(10, ge=1)
    # > 0: checkpoints and early stopping read validation metrics every epoch
    limit_train_batches: float | int | None = Field(None, gt=0)
    limit_val_batches: float | int | None = Field(None, gt=0)

    @field_validator("precision", mode="before")
    @classmethod
    def _precision_as_text(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) else v

    @model_validator(mode="after")
    def _epochs_in_order(self) -> TrainerConfig:
        # Lightning takes it and trains max_epochs, silently: the minimum was not what ran
        if self.min_epochs > self.max_epochs:
            raise ConfigError(
                f"trainer.min_epochs={self.min_epochs} is more than trainer.max_epochs="
                f"{self.max_epochs}: raise max_epochs to at least {self.min_epochs}, or lower "
                "min_epochs"
            )
        return self


# The epoch-level metrics the training module logs; Lightning would only find a typo once the
# first validation ended, after the run directory had changed.
Monitor = Literal["val_acc", "val_loss"]


# Which way each monitored metric improves
BETTER: dict[str, Literal["max", "min"]] = {"val_acc": "max", "val_loss": "min"}


class _Monitored(Section):
    """A monitor and its mode, which follows it unless given (None). A mode given against the
    metric is refused: `checkpoint.monitor=val_loss` alone kept mode max, and best.ckpt was the
    epoch of the *highest* loss; `early_stopping.monitor=val_acc` alone stopped a training whose
    accuracy rose, as not improving."""

    if TYPE_CHECKING:  # each section's own fields, in its own order (config.yaml's)
        monitor: Monitor
        mode: Literal["max", "min"] | None

    @property
    def direction(self) -> Literal["max", "min"]:
        return self.mode or BETTER[self.monitor]

    @model_validator(mode="after")
    def _mode_fits_monitor(self) -> _Monitored:
        better = BETTER[self.monitor]
        if self.mode is not None and self.mode != better:
            name = "checkpoint" if isinstance(self, CheckpointConfig) else "early_stopping"
            raise ConfigError(
                f"{name}.mode={self.mode} with {name}.monitor={self.monitor}, which is better "
                f"{'higher' if better == 'max' else 'lower'}: set {name}.mode={better}, or leave "
                "mode out (it follows the monitor)"
            )
        return self


class CheckpointConfig(_Monitored):
    monitor: Monitor = "val_acc"
    mode: Literal["max", "min"] | None = None  # None: the monitor's (`BETTER`)
    save_top_k: int = Field(2, ge=-1)  # -1: every one

    @field_validator("save_top_k")
    @classmethod
    def _keeps_one(cls, value: int) -> int:
        if value == 0:  # Lightning then keeps none, and best.ckpt was last.ckpt, not the best
            raise ConfigError(
                "checkpoint.save_top_k=0 keeps no checkpoint to take the best from (best.ckpt "
                "would be the last epoch's): set it to 1 or more, or -1 to keep every one"
            )
        return value


class EarlyStoppingConfig(_Monitored):
    enabled: bool = True
    # val_loss, not val_acc: accuracy on a small validation split saturates long before training
    # has converged, and stopping on it cuts the learning-rate schedule short.
    monitor: Monitor = "val_loss"
    mode: Literal["max", "min"] | None = None
    patience: int = Field(6, ge=0)
    min_delta: float = Field(0.0, ge=0)


_MISSING = object()


def _lookup(tree: Any, parts: Sequence[str]) -> Any:
    """The value at `parts` in a nested dict, or _MISSING."""
    for part in parts:
        if not isinstance(tree, dict):
            return _MISSING
        # a key YAML read as a number (`1: 2`) is named "1" by an error's location
        found = next((k for k in tree if k == part or str(k) == part), _MISSING)
        if found is _MISSING:
            return _MISSING
        tree = tree[found]
    return tree


@dataclass(frozen=True, eq=False)
class Sources:
    """Where a config's values came from: its YAML file (as written) and each --set key."""

    file: str | None = None
    tree: dict[str, Any] = field(default_factory=dict)
    overrides: tuple[tuple[str, ...], ...] = ()
    # what was read other than as written (a run's older config.yaml), a line each to print
    notes: tuple[str, ...] = ()

    # Configs compare their private attributes too: two with the same values are equal,
    # wherever the values came from.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sources)

    def __hash__(self) -> int:
        return 0

    def of(self, key: str) -> str:
        """`key`'s source, for a message: the --set that gave it, the file, or the defaults."""
        parts = tuple(key.split("."))
        given = [o for o in self.overrides if parts[: len(o)] == o]
        if given:
            return "--set"
        below = any(o[: len(parts)] == parts for o in self.overrides)  # e.g. model.kwargs.x
        if self.file is not None and _lookup(self.tree, parts) is not _MISSING:
            return f"{self.file} + --set" if below else self.file
        return "--set" if below else "defaults"

    def in_file(self, key: str, default: Any = None) -> Any:
        """What the file wrote for `key` (`default` where it wrote nothing)."""
        value = _lookup(self.tree, key.split("."))
        return default if value is _MISSING else value


class Config(Section):
    seed: int = Field(0, ge=0, le=2**32 - 1)  # what Lightning's seed_everything takes
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    early_stopping: EarlyStoppingConfig = Field(default_factory=EarlyStoppingConfig)
    _sources: Sources = PrivateAttr(default_factory=Sources)

    @property
    def sources(self) -> Sources:
        return self._sources

    @model_validator(mode="after")
    def _source_and_path_agree(self) -> Config:
        # Checked here, not guessed from the disk: the source is recorded with the run and its
        # checkpoints, and configs/digits.yaml names it, so it must read as the user meant it.
        # With the whole config, not the data section's own validator: that one runs on every
        # assignment, and `cfg.data.source = "folder"` then `cfg.data.path = ...` in Python (or
        # the other way round) was refused at the first line; `fit` checks the whole again.
        data = self.data
        if data.source == "digits" and data.path is not None:
            kind = "npz" if data.path.suffix.lower() == ".npz" else "folder"
            raise ConfigError(
                f"data.path={data.path} is set but data.source is digits (the built-in images), "
                f"which reads no path: add --set data.source={kind}, or drop data.path"
            )
        if data.source != "digits" and (data.path is None or not str(data.path).strip()):
            raise ConfigError(f"data.source={data.source} needs data.path (--set data.path=...)")
        return self

    @model_validator(mode="after")
    def _worker_settings_need_workers(self) -> Config:
        # DataLoader takes them only with worker processes: they were dropped without a word
        data = self.data
        given = [
            f"data.{key}={value}"
            for key, value in (
                ("persistent_workers", "true" if data.persistent_workers else None),
                ("prefetch_factor", data.prefetch_factor),
            )
            if value is not None
        ]
        if given and data.num_workers == 0:
            them = "apply" if len(given) > 1 else "applies"
            raise ConfigError(
                f"{' and '.join(given)} {them} to worker processes, and data.num_workers=0 "
                "loads in the training process: set data.num_workers (e.g. 2), or leave "
                f"{'them' if len(given) > 1 else 'it'} out"
            )
        return self

    @model_validator(mode="after")
    def _stats_per_channel(self) -> Config:
        for key in ("mean", "std"):
            values = getattr(self.model, key)
            if values is not None and len(values) != self.data.channels:
                raise ConfigError(
                    f"model.{key} has {len(values)} values but data.channels is "
                    f"{self.data.channels}: give one per channel, e.g. --set 'model.{key}="
                    f"{[values[0] if values else 0.5] * self.data.channels}'"
                )
        given = [v for key in ("mean", "std") for v in getattr(self.model, key) or []]
        if given and all(v <= 1 for v in given) and any(0 < v < 1 for v in given):
            # ImageNet's 0..1 statistics: x / 0.229 on 0..255 pixels saturates every layer
            scaled = " ".join(
                f"--set 'model.{key}={[float(f'{v * 255:.6g}') for v in values]}'"
                for key in ("mean", "std")
                if (values := getattr(self.model, key)) is not None
            )
            raise ConfigError(
                "model.mean/std are in pixel units 0..255 (the model normalises uint8 images), "
                "but every value given is at most 1, as for images scaled to 0..1: multiply "
                f"them by 255 ({scaled}), or leave them out to measure them on the training images"
            )
        return self


class _Loader(yaml.SafeLoader):
    """yaml.safe_load, but a key written twice in one mapping is an error: YAML keeps the last
    one silently, so `lr: 0.1` lower down in a section would quietly undo an edit above it."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue  # `<<: *base` merges may be overridden by the keys beside them
            key = (key_node.tag, key_node.value)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key '{key_node.value}' appears twice in one section (keep one)",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # a SafeLoader: no arbitrary objects


def set_arg(key: str, value: str) -> str:
    """`--set KEY=VALUE` for a message's fix, as a shell and then `--set`'s YAML read it back:
    a value YAML reads otherwise (a path with ' #' or ': ' in it) in YAML's double quotes."""
    try:
        same = _load_yaml(value) == value
    except yaml.YAMLError:
        same = False
    # YAML's own double-quoted form: JSON's escapes split a character past U+FFFF in two
    raw = (
        value
        if same
        else yaml.safe_dump(value, default_style='"', allow_unicode=True, width=1 << 30).strip()
    )
    return f"--set {shlex.quote(f'{key}={raw}')}"


def _set_dotted(tree: dict[str, Any], dotted: str) -> tuple[str, ...]:
    """Apply one `--set KEY=VALUE` to `tree`; returns KEY's parts."""
    key, sep, raw = dotted.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {dotted!r}: expected KEY=VALUE, e.g. --set trainer.max_epochs=3")
    parts = key.strip().split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted!r}: {part!r} is a value, not a section")
        node = child
    try:
        node[parts[-1]] = _load_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"--set {dotted!r}: the value is not valid YAML ({_yaml_problem(exc)}); "
            "quote it or fix the brackets, e.g. --set 'model.kwargs={x: 1}'"
        ) from None
    return tuple(parts)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """The problem and where it is, on one line (yaml's own message spans several)."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem is None:
        return first_line(exc, limit=1000) or type(exc).__name__
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"


def _is_section(annotation: Any) -> TypeGuard[type[BaseModel]]:
    """Whether a field's type is a section of settings (a model of keys of its own)."""
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _section_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The pydantic model that holds the field at `loc` (for listing the keys it allows)."""
    parts, annotation = _field_at(loc[:-1])
    if len(parts) < len(loc) - 1:
        return None
    return Config if not parts else annotation if _is_section(annotation) else None


def _explain(err: ValidationError, sources: Sources) -> str:
    """The first problem, named by the source of its key (the file, --set or the defaults)."""
    first = err.errors()[0]
    loc = tuple(first["loc"])
    key = ".".join(str(p) for p in loc)
    source = sources.of(key)
    if first["type"] == "extra_forbidden":
        section = _section_at(loc)
        allowed = ", ".join(section.model_fields) if section else "?"
        where = ".".join(str(p) for p in loc[:-1]) or "top level"
        return f"{source}: unknown key '{key}'; allowed in {where}: {allowed}"
    # pydantic's location goes on past the field: a union's arm (`trainer.devices.int`), a
    # list's index (`model.mean.0`), which are no keys to --set
    parts, annotation = _field_at(loc)
    if parts:
        key = ".".join(parts)
        source = sources.of(key)
    if first["type"] == "invalid_key":  # `7: x` in a section: YAML read the key as a number
        section = _section_at(loc)
        allowed = ", ".join(section.model_fields) if section else "?"
        where = key if parts else "top level"
        return (
            f"{sources.of('.'.join(str(p) for p in loc))}: unknown key {loc[-1]!r} in {where} "
            f"(YAML read it as a number); allowed in {where}: {allowed}"
        )
    if _is_section(annotation) and len(parts) == len(loc):
        keys = list(annotation.model_fields)
        return (
            f"{source}: '{key}' is a section of settings, not a value ({first.get('input')!r}): "
            f"set its keys, e.g. --set {key}.{keys[0]}=... (it has: {', '.join(keys)})"
        )
    here = [e for e in err.errors() if _field_at(tuple(e["loc"]))[0] == parts] or [first]
    said = list(dict.fromkeys(e["msg"] for e in here))  # each union arm's, once
    message = " or ".join([said[0], *(m.removeprefix("Input should be ") for m in said[1:])])
    others = len(err.errors()) - len(here)
    more = f" (and {others} more)" if others else ""
    where = f"in {sources.file} or " if sources.file and sources.file in source else ""
    given = first.get("input")
    fix = f"{key}=..."
    if first["type"] == "list_type" and isinstance(given, int | float | str):
        fix = f"'{key}=[{given}]'"  # `model.mean=0.5`: a list, one value per channel
    elif first["type"] == "string_type" and isinstance(given, dict) and len(given) == 1:
        # `model.name=mynet:`: YAML read the colon as a mapping's key, {'mynet': None}
        (name, value), *_ = given.items()
        text = f"{name}:" if value is None else f"{name}: {value}"
        message += f" (YAML read {text!r} as a mapping: quote it, --set '{key}=\"{text}\"')"
    return f"{source}: '{key}' = {given!r}: {message}{more}; fix it {where}with --set {fix}"


def _field_at(loc: tuple[int | str, ...]) -> tuple[tuple[str, ...], Any]:
    """The config keys at the start of a pydantic error's `loc`, and the last one's type."""
    model: type[BaseModel] | None = Config
    parts: list[str] = []
    annotation: Any = None
    for part in loc:
        fields = model.model_fields if model is not None else {}
        if str(part) not in fields:
            break
        parts.append(str(part))
        annotation = fields[str(part)].annotation
        model = annotation if _is_section(annotation) else None
    return tuple(parts), annotation


def without_unread_path(data: dict[str, Any]) -> dict[str, Any]:
    """A data section or spec that a run trained before data.path needed its source recorded:
    a path beside digits, which reads none, as None (what the run trained on is digits). The
    same dict where there is none."""
    if data.get("source", "digits") == "digits" and data.get("path") is not None:
        return {**data, "path": None}
    return data


def _drop_digits_path(tree: dict[str, Any], file: str) -> tuple[str, ...]:
    """A run's config.yaml from before data.path needed its source may hold a path beside
    digits (`without_unread_path`): left out, said in a note."""
    data = tree.get("data")
    if not isinstance(data, dict) or (read := without_unread_path(data)) is data:
        return ()
    path, tree["data"] = data["path"], read
    return (
        f"note: {file} records data.path={path} beside data.source digits, as older lightship "
        "versions allowed; digits reads no path, so it is left out",
    )


def _drop_mode_against_monitor(tree: dict[str, Any], file: str) -> tuple[str, ...]:
    """A run's config.yaml from before a monitor's mode followed it may hold a mode against it
    (`monitor: val_loss` beside the `mode: max` it kept, the highest loss then counted best):
    left out, so that the mode follows the monitor, said in a note."""
    notes = []
    for name, section in (
        ("checkpoint", CheckpointConfig),
        ("early_stopping", EarlyStoppingConfig),
    ):
        written = tree.get(name)
        if not isinstance(written, dict) or written.get("mode") not in ("max", "min"):
            continue
        monitor = written.get("monitor", section.model_fields["monitor"].default)
        better = BETTER.get(monitor) if isinstance(monitor, str) else None
        if better is None or written["mode"] == better:
            continue
        notes.append(
            f"note: {file} records {name}.mode={written['mode']} with {name}.monitor={monitor}, "
            f"as older lightship versions left it (the {'highest' if better == 'min' else 'lowest'}"
            f" {monitor} counted as the best); the mode follows the monitor now ({better})"
        )
        tree[name] = {**written, "mode": None}
    return tuple(notes)


def load_config(
    path: Path | str | None = None,
    overrides: Sequence[str] | str | None = None,
    unusable_fix: str | None = None,
    recorded: bool = False,
) -> Config:
    """Load a YAML file (or the defaults) and apply `key.sub=value` overrides (a list, or one
    string), validated.
    `unusable_fix` says what to do about an empty file or one that is no YAML (a run's own
    config.yaml is no --config to edit). `recorded`: the file is a run's own config.yaml, maybe
    written by an older lightship; what is read differently is in `cfg.sources.notes`."""
    tree: dict[str, Any] = {}
    file = None
    if path is not None:
        path = Path(path)
        file = str(path)
        if path.is_dir():
            raise ConfigError(
                f"config {path} is a folder, not a YAML file: "
                "pass a file, e.g. --config configs/digits.yaml"
            )
        if path.exists() and not path.is_file():  # /dev/null, a FIFO: reading could block
            raise ConfigError(
                f"config {path} is not a regular file: pass a YAML file, e.g. --config "
                "configs/digits.yaml"
            )
        if not path.is_file():
            # (configs/ is the checkout's: a relative path to it means nothing elsewhere)
            raise ConfigError(
                f"config file {path} not found: pass an existing YAML file, or leave --config "
                "out for the defaults (configs/digits.yaml's)"
            )
        try:
            loaded = _load_yaml(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{path} is not UTF-8 text (byte {exc.start}): save it as UTF-8 YAML"
            ) from None
        except yaml.YAMLError as exc:
            fix = f": {unusable_fix}" if unusable_fix else ""  # else the line it names is the fix
            raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(exc)}{fix}") from None
        if loaded is None:
            fix = unusable_fix or (
                "write the sections to change (data:, model:, ...), "
                "or leave out --config for the defaults"
            )
            raise ConfigError(f"{path} is empty: {fix}")
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a mapping of sections (data:, model:, ...)")
        tree = loaded
    notes: tuple[str, ...] = ()
    if recorded and file is not None:
        notes = _drop_digits_path(tree, str(file)) + _drop_mode_against_monitor(tree, str(file))
    written = copy.deepcopy(tree)
    if isinstance(overrides, str):  # one override: its characters were read as many
        overrides = [overrides]
    keys = tuple(_set_dotted(tree, item) for item in overrides or [])
    sources = Sources(file, written, keys, notes)
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_explain(err, sources)) from None
    cfg._sources = sources
    return cfg


def revalidated(cfg: Config) -> Config:
    """`cfg` checked whole again: set by assignment in Python (`cfg.model.mean = [0.13]`), a
    value is checked only against its field, not against the rest (the channel count, the
    0..255 scale), which `fit` would then train with and write to config.yaml."""
    try:
        again = Config.model_validate(cfg.model_dump())
    except ValidationError as err:
        raise ConfigError(_explain(err, cfg.sources)) from None
    again._sources = cfg.sources
    return again


def dump_config(cfg: Config) -> str:
    """The config as a run's config.yaml: data.path absolute, as the checkpoints record it, so
    that `--resume` reads the same data from any folder (it read `data` from the one it is in,
    and refused the checkpoints as another run's)."""
    tree = cfg.model_dump(mode="json")
    if cfg.data.path is not None:
        tree["data"]["path"] = str(cfg.data.path.expanduser().absolute())
    return yaml.safe_dump(tree, sort_keys=False)


def parse_choices(
    value: Sequence[str] | str | None,
    allowed: Sequence[str],
    what: str,
    error: type[LightshipError],
) -> list[str]:
    """A comma-separated list (or sequence) of names from `allowed`, in order, without repeats;
    None means all of them. Anything else raises `error` naming `what` and the choices."""
    if value is None:
        return list(allowed)
    items = value.split(",") if isinstance(value, str) else list(value)
    items = [i.strip() for i in items if i.strip()]
    unknown = [i for i in items if i not in allowed]
    if not items:
        raise error(f"no {what} given: choose from {','.join(allowed)}")
    if unknown:
        listed = ", ".join(map(repr, unknown))  # not a Python list: ['tflite']
        raise error(f"unknown {what} {listed}: choose from {','.join(allowed)}")
    return list(dict.fromkeys(items))
