"""Server settings: CLI flags, else `LIGHTSHIP_*` environment variables, else these defaults.

An empty variable counts as unset (pydantic-settings' `env_ignore_empty`): docker-compose's
`${VAR:-}` and Helm or Kubernetes templates write `LIGHTSHIP_THREADS=` for "not given".
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# A model name goes into URL paths and metric labels: keep it to safe characters.
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ENV_PREFIX = "LIGHTSHIP_"
# An origin as a browser's Origin header gives it (RFC 6454): scheme://host[:port].
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s,:]+(:\d{1,5})?")


def flag(field: str) -> str:
    """The `lightship serve` flag of a setting: max_batch_rows -> --max-batch-rows."""
    return "--" + field.replace("_", "-")


def names(field: str) -> str:
    """Both ways to give a setting, for a message that cannot tell which one was used."""
    return f"{flag(field)} / {ENV_PREFIX}{field.upper()}"


class ServeSettings(BaseSettings):
    """Everything `lightship serve` reads; each field is also `LIGHTSHIP_<FIELD>` in the env."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_ignore_empty=True,
        extra="ignore",
        validate_default=True,
        frozen=True,
    )

    run: Path = Field(Path("runs/default"), description="run directory, or one .onnx/.ts/.pt2 file")
    variant: str = Field(
        "auto",
        description=(
            "manifest variant to serve; auto = the report's recommendation (onnx-fp32 without a "
            "report or on a GPU)"
        ),
    )
    device: str = Field("cpu", description="cpu, cuda or cuda:N")
    host: str = Field("127.0.0.1", min_length=1, description="address to listen on")
    port: int = Field(8000, ge=0, le=65535)
    model_name: str | None = Field(
        None, description="name in /v2/models/{name} (default: the run directory's name)"
    )
    max_batch_rows: int = Field(64, ge=1, description="a batch closes at this many rows")
    # 0 as in Triton: a batch takes whatever queued while the model ran the previous one. Under
    # load that still makes batches (mean 13-31 rows at 16-64 connections, digits); alone, a
    # request does not wait for company (digits at 1 connection: 0.66 ms p50 against 2.9 ms
    # with 2 ms). A wait raises mean batch size at high concurrency, for latency.
    max_wait_ms: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="...or this long after its oldest request arrived (less than timeout_ms)",
    )
    max_queue_rows: int = Field(1024, ge=1, description="rows waiting beyond this are answered 429")
    timeout_ms: float = Field(
        10_000,
        gt=0,
        le=3_600_000,
        allow_inf_nan=False,
        description="default request deadline: 504 after it, 408 if the body is still arriving; "
        "clients may shorten it (then 504 either way)",
    )
    max_body_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, le=2**31, description="larger request bodies are answered 413"
    )
    # Answers smaller than this go out as they are even to a client that takes gzip or deflate
    # (Triton compresses every one): under 1 KiB they fit one TCP segment either way, and
    # compressing one costs ~5 µs. nginx and Starlette's GZipMiddleware keep a minimum of this
    # kind. httpx, requests and aiohttp ask for gzip by default, so on localhost or a fast LAN
    # compression is CPU spent for nothing (~0.16 ms per 1000-class JSON answer): 0 turns it off.
    compress_min_bytes: int = Field(
        1024,
        ge=0,
        description="answers of /v1/predict and V2 infer this large or larger are compressed "
        "when the client's Accept-Encoding asks for gzip or deflate; 0: never",
    )
    threads: int | None = Field(
        None,
        ge=1,
        le=256,
        description="intra-op threads per model instance (default: physical cores / instances; 1 "
        "for a torch model on a GPU)",
    )
    # Triton's instance count. Two one-thread instances served the routed ResNet-18 on the Xeon
    # 28 % faster than one two-thread instance at 16 connections, but one request alone then
    # gets one thread (-12 % at 1 connection); `split_batches` gets that throughput inside one
    # instance and keeps the two threads for a lone request (docs/PERFORMANCE.md, "Two
    # one-thread instances").
    instances: int = Field(
        1, ge=1, le=64, description="model instances: batches computed at the same time"
    )
    # Inside one instance: a long batch as one slice per thread, each on a one-thread ONNX
    # Runtime session (README, "Long batches are split across threads"): int8 ResNet-18 at
    # batch 64 ran 1.39x as fast as on one two-thread session; costs a second model copy.
    split_batches: bool = Field(
        True, description="split long batches across one-thread sessions, one per thread (ONNX)"
    )
    isa_check: Literal["refuse", "warn"] = Field(
        "refuse", description="an int8 model made for another CPU: refuse to start, or warn"
    )
    warmup_rows: int = Field(1, ge=1, description="rows in the warm-up batch run before ready")
    top_k: int = Field(5, ge=1, description="default top-k of /v1/predict")
    # Browsers call a server of another origin only where its answers allow it (a demo page
    # on :3000 calling :8000): off by default, as Triton and TorchServe have it.
    cors_origins: str = Field(
        "",
        description="origins a web page may call the server from, comma-separated "
        "(https://app.example.com,http://localhost:3000), or *; empty: none",
    )
    access_log: bool = False
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="uvicorn's and lightship's log lines below this level are dropped"
    )

    @field_validator("run", mode="before")
    @classmethod
    def _run(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():  # Path("") would be the current folder
            raise ValueError(
                "run is empty: give a run directory or a model file, e.g. runs/default"
            )
        from lightship.runs import home_expanded

        # LIGHTSHIP_RUN=~/x in an env file, as --run=~/x: no shell expands it
        return home_expanded(value) if isinstance(value, (str, Path)) else value

    @field_validator("port", mode="before")
    @classmethod
    def _port(cls, value: object) -> object:
        """Digits only: pydantic reads `8241.0` and `8_241` as 8241, which the image's
        HEALTHCHECK (deploy/healthcheck.py) put in a URL, and called the server unhealthy."""
        if isinstance(value, str) and not value.strip().isdigit():
            raise ValueError("port must be a whole number 0..65535")
        return value

    @field_validator("log_level", "device", "isa_check", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        """`LIGHTSHIP_LOG_LEVEL=ERROR`, `--device CUDA`: names as logging and torch take them."""
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {value!r}")
        return value

    @field_validator("model_name")
    @classmethod
    def _model_name(cls, value: str | None) -> str | None:
        if value is not None and not MODEL_NAME.match(value):
            raise ValueError(
                f"model name {value!r} must be letters, digits, '.', '_' or '-' (at most 128)"
            )
        return value

    @field_validator("cors_origins")
    @classmethod
    def _cors_origins(cls, value: str) -> str:
        origins = [o.strip() for o in value.split(",") if o.strip()]
        for origin in origins:
            if origin != "*" and not ORIGIN.fullmatch(origin):
                raise ValueError(
                    f"cors_origins lists {origin!r}, which is no origin: give scheme://host"
                    "[:port] as a browser sends it, no path or trailing slash (e.g. "
                    "http://localhost:3000), or *"
                )
        return ",".join(origins)

    @property
    def origins(self) -> list[str]:
        """The origins `cors_origins` lists; [] for none."""
        return self.cors_origins.split(",") if self.cors_origins else []

    def model_threads(self, model: Path | None = None) -> int:
        """Intra-op threads for each instance: the setting, else the cores shared out; but one
        for a torch `model` (.ts, .pt2, .ckpt) on a GPU. Its CPU work there is the copy of a
        batch into pinned memory: with 16 threads a batch over ~10 ResNet-18 images was copied
        by all 16, which then spun (11 cores busy), and req/s fell to 0.62 of one thread's
        (docs/PERFORMANCE.md, "A torch model on a GPU")."""
        from lightship.runtime import TORCH_SUFFIXES
        from lightship.runtime.base import physical_cores

        if self.threads:
            return self.threads
        if self.device != "cpu" and model is not None and model.suffix in TORCH_SUFFIXES:
            return 1
        return max(1, physical_cores() // self.instances)

    @model_validator(mode="after")
    def _consistent(self) -> ServeSettings:
        if self.max_queue_rows < self.max_batch_rows:
            raise ValueError(
                f"{names('max_queue_rows')} ({self.max_queue_rows}) must be at least "
                f"{names('max_batch_rows')} ({self.max_batch_rows}): the queue has to hold one "
                "full batch"
            )
        if self.max_wait_ms >= self.timeout_ms:
            raise ValueError(
                f"{names('max_wait_ms')} ({self.max_wait_ms:g}) must be less than "
                f"{names('timeout_ms')} ({self.timeout_ms:g}): a request alone would wait out "
                "its deadline"
            )
        return self


# Read elsewhere (lightship.runtime.ort, with --device cuda), not settings of the server; the
# help of `lightship serve` says what they do.
OTHER_VARIABLES = {"LIGHTSHIP_TENSORRT", "LIGHTSHIP_TRT_CACHE"}
# Set by the Makefile for the stages it runs (`runs.MAKE_GOALS`, `runs.MAKE_FROM`,
# `runs.MAKE_THEN`), `make serve` included: no user's typo to warn of.
MAKES_OWN = {"LIGHTSHIP_MAKE_GOALS", "LIGHTSHIP_MAKE_FROM", "LIGHTSHIP_MAKE_THEN"}


# Kubernetes gives each pod variables for every Service in its namespace (`enableServiceLinks`,
# on by default), named after the Service: one named `lightship` sets LIGHTSHIP_SERVICE_HOST to
# its cluster IP and LIGHTSHIP_PORT to tcp://CLUSTER-IP:80, which a pod started after the
# Service read as its port and stopped on.
SERVICE_LINK = re.compile(r"(?:tcp|udp|sctp)://(\[[0-9A-Fa-f:.]+\]|[0-9.]+):\d+")
_LINK_NAME = re.compile(
    r"LIGHTSHIP_(?:[A-Z0-9_]+_)?(?:SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9_]+)?"
    r"|PORT_\d+_(?:TCP|UDP|SCTP)(?:_PROTO|_PORT|_ADDR)?)"
)


def _is_link(name: str, value: str, environ: Mapping[str, str]) -> bool:
    """Whether `name` is one of the variables Kubernetes sets for a Service (`lightship`,
    `lightship-gpu`, ...), not a setting: X_PORT only beside the X_SERVICE_HOST it names (a
    port written tcp://0.0.0.0:9000 by hand is a bad value, said as one)."""
    if _LINK_NAME.fullmatch(name):
        return True
    link = SERVICE_LINK.fullmatch(value.strip()) if name.endswith("_PORT") else None
    host = environ.get(name.removesuffix("_PORT") + "_SERVICE_HOST", "").strip()
    return link is not None and link.group(1).strip("[]") == host.strip("[]") != ""


def unread_variables(environ: Mapping[str, str], flags: Collection[str] = ()) -> dict[str, str]:
    """The `LIGHTSHIP_*` variables of settings that `lightship serve` does not read, and why:
    pydantic-settings would. An empty or blank one (`${VAR:-}` in compose, an unset Helm value)
    counts as unset; blank, it was read as a value (LIGHTSHIP_HOST=" ": "cannot listen on ' '"),
    after the warning said the default was used. A name not in upper case: pydantic-settings
    reads names in any case, the images' healthcheck and the docs in upper case, so
    `-e lightship_port=9000` moved the server and its healthcheck knocked at 8000. And a
    Service's link (`_is_link`) where a setting's name is. `flags`: the settings given as
    flags, whose value is said to be used instead of the default."""
    fields = ServeSettings.model_fields
    unread = {}
    for name, value in environ.items():
        upper = name.upper()
        key = upper.removeprefix(ENV_PREFIX)
        setting = upper.startswith(ENV_PREFIX) and key.lower() in fields
        if not setting and not (name != upper and upper in OTHER_VARIABLES):
            continue
        default = fields[key.lower()].default if setting else None
        used = (
            f"{flag(key.lower())} is used"
            if key.lower() in flags
            else f"{upper} is used"
            if name != upper and upper in environ
            else "its default is used"
            if default is None
            else f"the default {default} is used"
        )
        if name != upper:  # those read elsewhere (OTHER_VARIABLES) too
            unread[name] = (
                f"{name} is not read: lightship's variables are upper case ({upper}); {used}"
            )
            continue
        if _is_link(name, value, environ):
            unread[name] = (
                f"{name}={value} is the link Kubernetes sets for a Service named lightship, "
                f"not a setting: ignored, {used}; set `enableServiceLinks: false` in the pod's "
                f"spec, or {name} in its container's env"
            )
        elif not value.strip():
            # `${BIND:-}` in compose, an unset Helm value: it replaces an image's own value
            # (LIGHTSHIP_HOST=0.0.0.0), and the server listened on 127.0.0.1, unreachable
            where = (
                " (from inside this host or container only)"
                if key == "HOST" and key.lower() not in flags
                else ""
            )
            unread[name] = (
                f"{name} is set but empty, which counts as unset: {used}{where}; give it a "
                "value or leave it out"
            )
    return unread


@contextlib.contextmanager
def unread_hidden() -> Iterator[None]:
    """The process's environment without the variables serve does not read
    (`unread_variables`) while ServeSettings reads it (pydantic-settings would read them), and
    as it was afterwards."""
    hidden = {name: os.environ.pop(name) for name in unread_variables(os.environ)}
    try:
        yield
    finally:
        os.environ.update(hidden)


def unknown_variables(environ: Mapping[str, str], flags: Collection[str] = ()) -> list[str]:
    """A warning for each `LIGHTSHIP_*` variable that is no setting, or a setting's that is not
    read (`unread_variables`): pydantic-settings ignores the first, so a typo in a container's
    environment would silently leave the default in force."""
    prefix = ENV_PREFIX
    known = {name.upper() for name in ServeSettings.model_fields}
    known |= {name.removeprefix(prefix) for name in OTHER_VARIABLES | MAKES_OWN}
    unread = unread_variables(environ, flags)
    warnings = []
    for name in sorted(environ):
        key = name.upper().removeprefix(prefix)
        if name in unread:
            warnings.append(unread[name])
        elif name.upper().startswith(prefix) and key not in known:
            if _is_link(name, environ[name], environ):
                continue  # another Service's link (lightship-gpu): no typo
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            warnings.append(f"{name} is not a serve setting and is ignored{hint}")
    return warnings


def shadowed_invalid(flags: Mapping[str, Any]) -> list[str]:
    """A warning for each setting given as a flag (`flags`: field to value) whose `LIGHTSHIP_*`
    variable holds a value the server would stop on: one the setting cannot take, or one at
    odds with another setting (LIGHTSHIP_MAX_QUEUE_ROWS=8 with the batch's 64). The flag wins,
    so nothing read it, and the server stopped on it only once the flag was dropped (a
    container's command edited, its env kept): `LIGHTSHIP_TOP_K=notanint` beside `--top-k 1`
    went unsaid. (An unknown LIGHTSHIP_VARIANT is `lightship serve`'s to check.)"""
    from pydantic import ValidationError

    unread = unread_variables(os.environ)
    shadowed = {
        field
        for field in flags
        if os.environ.get(ENV_PREFIX + field.upper(), "").strip()
        and ENV_PREFIX + field.upper() not in unread
    }
    if not shadowed:
        return []
    try:
        with unread_hidden():
            ServeSettings(**{k: v for k, v in flags.items() if k not in shadowed})
    except ValidationError as exc:
        said = []
        for error in exc.errors():
            message = str(error["msg"]).removeprefix("Value error, ")
            if not error["loc"]:  # at odds with another setting: its message names both
                given = ", ".join(flag(f) for f in sorted(shadowed))
                said.append(f"without {given}, the server would stop on its variable: {message}")
            elif (field := str(error["loc"][0])) in shadowed:
                variable = ENV_PREFIX + field.upper()
                said.append(
                    f"{variable}={os.environ[variable]!r} is not a valid value ({message}); "
                    f"{flag(field)} is used instead, and the server would stop on it without "
                    "that flag"
                )
        return said
    return []
