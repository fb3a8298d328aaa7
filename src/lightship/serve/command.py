"""`lightship serve` and `lightship bench serve`.

Only the standard library and typer at module level: `lightship --help` and the other commands
import this file, and must not pay for FastAPI, onnxruntime or torch.
"""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any

import typer

from lightship.runs import results_file, run_dir_parser, run_path

ENV = "env LIGHTSHIP_"


def _settings(**given: Any) -> Any:
    """ServeSettings from the flags given; the environment fills the rest (flags win). A bad
    value is named as it was given: by its flag, or by its variable."""
    from pydantic import ValidationError

    from lightship.errors import ConfigError
    from lightship.serve.settings import ServeSettings, unread_hidden

    flags = {k: v for k, v in given.items() if v is not None}
    try:
        with unread_hidden():
            settings = ServeSettings(**flags)
    except ValidationError as exc:
        _warn_unknown_variables(flags)  # a misspelt variable may be why
        problems = "; ".join(_problem(e, flags) for e in exc.errors())
        raise ConfigError(f"invalid serve settings ({problems})") from None
    _check_variant(settings.variant, "--variant" if "variant" in flags else "LIGHTSHIP_VARIANT")
    return settings


def _problem(error: Any, flags: dict[str, Any]) -> str:
    """One pydantic error, said of the flag or variable that gave the value."""
    from lightship.serve.settings import ENV_PREFIX, flag, names

    message = str(error["msg"]).removeprefix("Value error, ")
    if not error["loc"]:  # a check across settings: its message names each both ways
        return message
    field = str(error["loc"][0])
    if field in flags:
        return f"{flag(field)} {shlex.quote(str(error['input']))}: {message}"
    variable = ENV_PREFIX + field.upper()
    if os.environ.get(variable, "").strip():
        return f"{variable}={shlex.quote(os.environ[variable])}: {message}"
    return f"{names(field)}: {message}"


def _check_variant(variant: str, given_as: str) -> None:
    """Before the run is read, so that the error names `given_as`, flag or variable."""
    from lightship.errors import ConfigError
    from lightship.serve.model import VARIANTS

    if variant == "auto" or variant in VARIANTS:
        return
    served_as = ": the report's eager row, best.ckpt, is --variant checkpoint"
    raise ConfigError(
        f"unknown {given_as} '{variant}'{served_as if variant == 'eager' else ''}; choose from "
        f"auto, {', '.join(VARIANTS)}"
    )


def _shadowed(flags: dict[str, Any]) -> list[str]:
    """`shadowed_invalid`'s warnings, and an unknown LIGHTSHIP_VARIANT beside --variant (the
    variant is checked here, not by pydantic)."""
    from lightship.errors import ConfigError
    from lightship.serve.settings import shadowed_invalid

    warnings = shadowed_invalid(flags)
    variable = os.environ.get("LIGHTSHIP_VARIANT", "").strip()
    if "variant" in flags and variable:
        try:
            _check_variant(variable, "LIGHTSHIP_VARIANT")
        except ConfigError as exc:  # the server would stop on it without --variant
            warnings.append(f"{exc}; --variant is used instead")
    return warnings


def _warn_unknown_variables(flags: Collection[str]) -> None:
    """Each LIGHTSHIP_* variable that is no setting, or is not read; `flags`: the settings
    given as flags, which a variable's value would not have set anyway."""
    from lightship.serve.settings import unknown_variables

    for warning in unknown_variables(os.environ, flags):
        logging.getLogger("lightship.serve").warning(warning)


def serve(
    run: Annotated[
        Path | None,
        typer.Option(
            "--run",
            "-r",
            help="run directory, or one model file (.onnx, .ts, .pt2, .ckpt) "
            f"({ENV}RUN; default runs/default)",
            parser=run_path,
            metavar="DIR|FILE",
        ),
    ] = None,
    variant: Annotated[
        str | None,
        typer.Option(
            help="auto (the report's recommendation; onnx-fp32 without a report or on a GPU), "
            "onnx-fp32, "
            "onnx-int8-static, onnx-int8-dynamic, onnx-int8-qat, torchscript, pt2, checkpoint "
            f"(best.ckpt, the report's eager) ({ENV}VARIANT; default auto)"
        ),
    ] = None,
    device: Annotated[
        str | None, typer.Option(help=f"cpu, cuda or cuda:N ({ENV}DEVICE; default cpu)")
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(
            help=f"address to listen on; 0.0.0.0 for every interface, as in a container "
            f"({ENV}HOST; default 127.0.0.1)"
        ),
    ] = None,
    port: Annotated[
        # as given, for ServeSettings' digits-only check: click's int reads `8241.0` as 8241,
        # which the image's HEALTHCHECK put in its URL, calling a serving container unhealthy
        str | None,
        typer.Option(help=f"TCP port to listen on ({ENV}PORT; default 8000)", metavar="<int>"),
    ] = None,
    model_name: Annotated[
        str | None,
        typer.Option(
            help=f"name under /v2/models/ ({ENV}MODEL_NAME; default the run directory's name, or "
            "the model file's less its suffix)"
        ),
    ] = None,
    max_batch_rows: Annotated[
        int | None,
        typer.Option(help=f"a batch closes at this many rows ({ENV}MAX_BATCH_ROWS; default 64)"),
    ] = None,
    max_wait_ms: Annotated[
        float | None,
        typer.Option(
            help="a batch not full closes this long after its oldest request arrived; 0: it "
            f"takes what queued while the model ran the last batch ({ENV}MAX_WAIT_MS; default 0)"
        ),
    ] = None,
    max_queue_rows: Annotated[
        int | None,
        typer.Option(
            help=f"rows queued at most; a request past them gets 429 ({ENV}MAX_QUEUE_ROWS; "
            "default 1024)"
        ),
    ] = None,
    timeout_ms: Annotated[
        float | None,
        typer.Option(help=f"request deadline; then 504 ({ENV}TIMEOUT_MS; default 10000)"),
    ] = None,
    max_body_bytes: Annotated[
        int | None,
        typer.Option(help=f"larger bodies get 413 ({ENV}MAX_BODY_BYTES; default 16 MiB)"),
    ] = None,
    compress_min_bytes: Annotated[
        int | None,
        typer.Option(
            help="answers this large or larger go gzip/deflate compressed when the client's "
            "Accept-Encoding asks; 0: never, for clients on localhost or a fast LAN "
            f"({ENV}COMPRESS_MIN_BYTES; default 1024)"
        ),
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(
            help=f"threads per model instance ({ENV}THREADS; default the physical cores, no "
            "more than a container's CPU limit, over --instances; 1 for a torch model on a GPU)"
        ),
    ] = None,
    instances: Annotated[
        int | None,
        typer.Option(help=f"model instances computing batches at once ({ENV}INSTANCES; default 1)"),
    ] = None,
    split_batches: Annotated[
        bool | None,
        typer.Option(
            "--split-batches/--no-split-batches",
            help=f"long batches as one slice per thread on one-thread ONNX Runtime sessions "
            f"({ENV}SPLIT_BATCHES; default on)",
        ),
    ] = None,
    isa_check: Annotated[
        str | None,
        typer.Option(
            help=f"int8 model made for another CPU: refuse or warn ({ENV}ISA_CHECK; default refuse)"
        ),
    ] = None,
    warmup_rows: Annotated[
        int | None,
        typer.Option(
            help=f"rows of the warm-up batch ({ENV}WARMUP_ROWS; default 1); on a GPU, which pads "
            "batches to powers of two, every power of two up to --max-batch-rows runs too"
        ),
    ] = None,
    top_k: Annotated[
        int | None,
        typer.Option(help=f"top-k of /v1/predict when not asked ({ENV}TOP_K; default 5)"),
    ] = None,
    cors_origins: Annotated[
        str | None,
        typer.Option(
            help="origins a web page may call the server from, comma-separated "
            f"(http://localhost:3000), or * ({ENV}CORS_ORIGINS; default none)"
        ),
    ] = None,
    access_log: Annotated[
        bool | None,
        typer.Option(
            "--access-log/--no-access-log",
            help=f"a log line per request, uvicorn's ({ENV}ACCESS_LOG; default off)",
        ),
    ] = None,
    log_level: Annotated[
        str | None,
        typer.Option(
            help="critical, error, warning, info or debug: uvicorn's and lightship's lines "
            f"below it are dropped ({ENV}LOG_LEVEL; default info)"
        ),
    ] = None,
) -> None:
    """Serve a run's model over HTTP: KServe V2 (/v2), JSON and images (/v1), /metrics, /docs.

    Every flag is also an environment variable, LIGHTSHIP_<FLAG> (upper case); a flag wins
    over it, and an empty or blank variable counts as unset. With --device cuda, ONNX Runtime
    reads two more:
    LIGHTSHIP_TENSORRT=0 turns its TensorRT provider off, and LIGHTSHIP_TRT_CACHE is the folder
    of the engines TensorRT builds (default /tmp/lightship-trt-cache).
    """
    given = dict(
        run=run,
        variant=variant,
        device=device,
        host=host,
        port=port,
        model_name=model_name,
        max_batch_rows=max_batch_rows,
        max_wait_ms=max_wait_ms,
        max_queue_rows=max_queue_rows,
        timeout_ms=timeout_ms,
        max_body_bytes=max_body_bytes,
        compress_min_bytes=compress_min_bytes,
        threads=threads,
        instances=instances,
        split_batches=split_batches,
        isa_check=isa_check,
        warmup_rows=warmup_rows,
        top_k=top_k,
        cors_origins=cors_origins,
        access_log=access_log,
        log_level=log_level,
    )
    settings = _settings(**given)
    if "log_level" in settings.model_fields_set:  # else `lightship -v`'s debug lines stay on
        logging.getLogger("lightship").setLevel(settings.log_level.upper())
    from lightship.serve.app import LogFormatter

    for handler in logging.getLogger().handlers:  # a server's lines say when (uvicorn's too)
        handler.setFormatter(LogFormatter())
    _warn_unknown_variables([k for k, v in given.items() if v is not None])
    for warning in _shadowed({k: v for k, v in given.items() if v is not None}):
        logging.getLogger("lightship.serve").warning(warning)
    # Every counter and histogram also exported a `_created` timestamp series, doubling the
    # families a scrape stores (prometheus_client's default; Prometheus reads none of them).
    # Process-wide, so here, where the process is the server's.
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
    from lightship.serve.app import serve as run_server

    run_server(settings)


def bench_serve(
    digits_run: Annotated[
        Path,
        typer.Option(
            help="digits run (trained and exported here when missing)",
            parser=run_dir_parser("--digits-run"),
            metavar="<path>",  # as the other paths' (a parser's type would say <Path>)
        ),
    ] = Path("runs/bench/digits"),
    resnet_run: Annotated[
        Path,
        typer.Option(
            help="ResNet-18 run (1 epoch, exported here when missing)",
            parser=run_dir_parser("--resnet-run"),
            metavar="<path>",  # as the other paths' (a parser's type would say <Path>)
        ),
    ] = Path("runs/bench/resnet"),
    duration: Annotated[
        int, typer.Option(help="seconds per wrk measurement, whole (wrk takes no fractions)")
    ] = 4,
    rounds: Annotated[
        int, typer.Option(help="interleaved rounds over every cell; medians are reported")
    ] = 3,
    concurrency: Annotated[str, typer.Option(help="comma-separated connection counts")] = "1,16,64",
    models: Annotated[
        str, typer.Option(help="comma-separated: digits,resnet18")
    ] = "digits,resnet18",
    threads: Annotated[
        int | None, typer.Option(help="threads per model instance (default: cores / instances)")
    ] = None,
    instances: Annotated[
        int, typer.Option(help="model instances in the server (and in-process callers)")
    ] = 1,
    variant: Annotated[
        str,
        typer.Option(
            help="variant to serve and time in-process (made in the run when missing); auto: "
            "the report's recommendation, onnx-fp32 on a GPU"
        ),
    ] = "auto",
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N, for both")] = "cpu",
    out: Annotated[
        Path,
        typer.Option(help="JSON file for the results", parser=results_file, metavar="<file>"),
    ] = Path("runs/bench/serve.json"),
) -> None:
    """Serving throughput and latency with wrk, beside in-process and no-model ceilings.

    The server, a same-path no-model ceiling (the server with a batcher that answers at once)
    and a FastAPI no-model endpoint run as their own processes; every cell is measured once per
    round, endpoints and protocols taking turns at going first; the table gives medians and
    within-round ratios, and req/s counts 2xx answers only.
    """
    from lightship.errors import ConfigError
    from lightship.serve.bench import bench

    try:
        connections = [int(c) for c in concurrency.split(",") if c.strip()]
    except ValueError:
        raise ConfigError(
            f"--concurrency must list connection counts, e.g. 1,16,64; got {concurrency!r}"
        ) from None
    bench(
        digits_run=digits_run,
        resnet_run=resnet_run,
        duration=duration,
        concurrency=connections,
        out=out,
        rounds=rounds,
        models=models,
        threads=threads,
        instances=instances,
        variant=variant,
        device=device,
    )
