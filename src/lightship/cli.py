"""`lightship` command line: a thin layer over the stage functions.

Heavy imports (torch, Lightning, onnxruntime) happen inside each command, so `--help` is quick
and `lightship serve` on an ONNX model never imports torch.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shlex
import signal
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer

from lightship import __version__
from lightship.errors import LightshipError, QuantizeError, first_line
from lightship.runs import (
    interrupt_exit_code,
    interrupt_message,
    interrupt_note,
    interrupted,
    lock_run,
    next_command,
    results_file,
    run_dir_parser,
    stage_command,
    watch_interrupts,
)

# A bare `lightship` (or `lightship bench`) prints its help and exits 0, as `--help` does, and
# as kubectl and docker do: asking what there is is no error (`_help_when_bare`).
# -h as well as --help, as most command lines take it
HELP = {"help_option_names": ["-h", "--help"]}
app = typer.Typer(
    help="Train, export, quantize, report and serve image classifiers.",
    invoke_without_command=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # click's plain help: typer's panels show every flag as `<bool>`
    context_settings=HELP,
)
bench_app = typer.Typer(
    help="Benchmarks: they print and save what they measured.",
    invoke_without_command=True,
    rich_markup_mode=None,
    context_settings=HELP,
)
app.add_typer(bench_app, name="bench")


RunOpt = Annotated[
    Path,
    typer.Option(
        "--run",
        "-r",
        help="run directory",
        show_default=True,
        parser=run_dir_parser("--run"),
        metavar="DIR",
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="YAML config (default: built-in defaults)", metavar="FILE"),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="override a config key, e.g. --set trainer.max_epochs=3 (repeatable)",
        metavar="KEY=VALUE",
    ),
]


def _help_when_bare(ctx: typer.Context) -> None:
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
        raise typer.Exit()


bench_app.callback()(_help_when_bare)


def _print_version(asked: bool) -> None:
    if asked:
        print(f"lightship {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="debug logging, and tracebacks")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="print lightship's version", callback=_print_version, is_eager=True
        ),
    ] = False,
) -> None:
    _help_when_bare(ctx)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not verbose:  # the ONNX exporter narrates every optimisation pass at INFO; torch's
        # own INFO lines are its developers' (fake_tensor's came after a Ctrl-C's last line)
        for name in ("onnxscript", "onnx_ir", "torch"):
            logging.getLogger(name).setLevel(logging.WARNING)
        # Noise that says nothing about the user's run: torchao's optional CUDA/Triton kernels
        # (absent on CPU), the exporter skipping torchvision ops, Lightning's accelerator and
        # marketing lines, pytree deprecations inside the libraries.
        for name in (
            "torchao",
            "torch.onnx._internal.exporter._registration",
            "torch.utils._pytree",
        ):
            logging.getLogger(name).setLevel(logging.ERROR)
        logging.getLogger("pytorch_lightning.utilities.rank_zero").setLevel(logging.WARNING)
        # "[rank: 0] Received SIGTERM: 15" above our own last line for the same stop
        logging.getLogger("pytorch_lightning.trainer.connectors.signal_connector").setLevel(
            logging.WARNING
        )
        warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\).*")


@app.command()
def train(
    run: RunOpt = Path("runs/default"),
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="continue from RUN/checkpoints/last.ckpt")
    ] = False,
) -> None:
    """Train a model with Lightning; writes RUN/best.ckpt, checkpoints/, logs/ and manifest.json.

    With --resume and no --config, the run's own config.yaml is the starting point."""
    from lightship.config import load_config
    from lightship.runs import RunDir

    with lock_run(run, "lightship train", create=True):
        recovered = RunDir(run).recover_set_aside()  # before the run's config.yaml is read
        if recovered:
            print(f"{run}: {recovered}", flush=True)
        unusable_fix = None
        recorded = resume and config is None and RunDir(run).config.is_file()
        if recorded:
            config = RunDir(run).config
            resume_with = stage_command(
                f"make train RESUME=1 RUN={_q(run)} CONFIG=...",
                f"lightship train --run {_q(run)} --resume --config ...",
                run,
            )
            afresh = stage_command(
                f"make train RUN={_q(run)} CONFIG=...",
                f"lightship train --run {_q(run)} --config ...",
                run,
            )
            unusable_fix = (
                f"restore it, resume with the config the run was trained with (`{resume_with}`), "
                f"or train afresh (`{afresh}`)"
            )
        cfg = load_config(config, overrides, unusable_fix, recorded=recorded)
        from lightship.train import fit

        fit(cfg, RunDir(run), resume=resume)


@app.command()
def export(
    run: RunOpt = Path("runs/default"),
    formats: Annotated[
        str, typer.Option("--formats", "-f", help="comma-separated: onnx,torchscript,pt2")
    ] = "onnx,torchscript,pt2",
    opset: Annotated[
        int,
        typer.Option(
            help="ONNX opset version (17 to 28 with the pinned torch and onnx; others are checked)"
        ),
    ] = 18,
    atol: Annotated[
        float, typer.Option(help="parity limit: max |logit difference| against eager")
    ] = 1e-4,
) -> None:
    """Export RUN/best.ckpt to RUN/export/ (ONNX, TorchScript, .pt2), each checked for parity."""
    from lightship.export import export as export_run
    from lightship.runs import RunDir

    artifacts = export_run(RunDir(run), formats, opset=opset, atol=atol)  # takes the run lock
    for a in artifacts:
        print(f"{a.variant:12s} {a.path}  parity: {a.parity.summary()}")
    then = next_command("quantize", run, RunDir(run).pythonpath())
    if not all(a.on_test_split for a in artifacts):  # the warning above says where it was
        then = f"put the run's training data back (see the warning above), then {then}"
    print(f"next: {then}")


@app.command()
def quantize(
    run: RunOpt = Path("runs/default"),
    methods: Annotated[
        str, typer.Option("--methods", "-m", help="comma-separated: static,dynamic,qat")
    ] = "static,dynamic,qat",
    target: Annotated[
        str,
        typer.Option(help="CPU/accelerator the int8 model is for: auto|avx2|vnni|arm64|tensorrt"),
    ] = "auto",
    calibration_samples: Annotated[
        int,
        typer.Option(
            help="training images to calibrate static int8 with (dynamic and QAT take none)"
        ),
    ] = 256,
    calibration_method: Annotated[
        str, typer.Option(help="minmax | entropy | percentile")
    ] = "minmax",
    per_channel: Annotated[bool, typer.Option(help="per-channel weight scales")] = True,
    gate: Annotated[float, typer.Option(help="int8 keeps >= GATE x fp32 accuracy")] = 0.99,
    fallback_budget: Annotated[
        int, typer.Option(help="most nodes moved back to fp32 to pass the gate")
    ] = 3,
    qat_epochs: Annotated[int, typer.Option(help="quantization-aware fine-tuning epochs")] = 3,
    qat_lr: Annotated[float, typer.Option(help="QAT learning rate")] = 1e-4,
) -> None:
    """Quantize RUN/export/model.onnx to int8 (static, dynamic, QAT) behind an accuracy gate."""
    from lightship.quantize.core import MethodFailed, QuantizeSettings, mostly_float
    from lightship.quantize.core import quantize as quantize_run
    from lightship.quantize.isa import describe
    from lightship.runs import RunDir

    # Printed once every method has run: a failed method is an error only when no other made
    # its variant; beside one that did, quantize exits 0 and `make` goes on to the report, so
    # its line must not say `error:`.
    failed: dict[str, LightshipError] = {}

    def print_errors() -> None:
        for method, exc in failed.items():
            print(f"error: {method}: {exc}", file=sys.stderr)

    settings = QuantizeSettings(
        calibration_samples=calibration_samples,
        calibration_method=calibration_method,
        per_channel=per_channel,
        gate=gate,
        fallback_budget=fallback_budget,
        qat_epochs=qat_epochs,
        qat_lr=qat_lr,
    )
    try:
        variants = quantize_run(  # takes the run lock
            RunDir(run), methods, target, settings, on_error=failed.__setitem__
        )
    except BaseException:  # what stopped the run is the last line; what failed before it stays
        print_errors()
        raise
    if failed and not variants:
        print_errors()
        raise QuantizeError(
            f"no int8 variant was made: {', '.join(failed)} failed (see above); "
            "fix that or choose other --methods"
        )
    for method, exc in failed.items():
        why = f" ({exc.cause}): {exc.fix}" if isinstance(exc, MethodFailed) else f": {exc}"
        print(
            f"warning: {method} failed{why} (the other variants are still produced)",
            file=sys.stderr,
        )
    if variants:  # measured where quantize ran: the CPU each entry records
        images = (RunDir(run).artifact("checkpoint") or {}).get("test_samples", "the")
        print(f"CPU: {describe(variants[0].entry['cpu'])}; accuracy on {images} test images")
    for v in variants:
        kept = v.entry.get("nodes_fp32_by_fallback") or []
        note = f", {len(kept)} node(s) kept in fp32" if kept else ""
        print(
            f"int8-{v.method:8s} {v.path}  test accuracy {v.accuracy:.4f} "
            f"(fp32 {v.entry['fp32_accuracy']:.4f}, gate {'pass' if v.gate_passed else 'FAIL'}"
            f"{note}), quantized for target {v.entry['target']}"
        )
    for v in variants:
        if warning := mostly_float(v.method, v.entry):
            print(f"warning: {warning}", file=sys.stderr)
    print(f"next: {next_command('report', run, RunDir(run).pythonpath())}")


def report_table(r: dict[str, Any], run: Path, batch: int) -> Any:
    """`report`'s table of report.json `r`, a rich Table: p50 is at batch 1, img/s at
    `batch`, each on the threads it ran on."""
    from rich.table import Table

    from lightship.quantize.isa import describe
    from lightship.report.render import threads_note

    table = Table(title=f"{run} on {describe(r['cpu'])}, {r['threads']} threads{threads_note(r)}")
    rows = [
        [
            ("★ " if v["recommended"] else "") + v["name"],
            f"{v['accuracy']:.4f}",
            f"{v['latency_ms']['p50']:.3f}",
            f"{v['throughput_per_s']:.0f}",
            f"{v['speedup_vs_eager']:.2f}",
            "—" if v.get("speedup_vs_onnx_fp32") is None else f"{v['speedup_vs_onnx_fp32']:.2f}",
            ("pass*" if _held_back(v) else "pass") if v["gate_passed"] else "FAIL",
        ]
        for v in r["variants"]
    ]
    # Every cell stays whole, at its widest: squeezed into 80 columns (a log, `pass*` in the
    # gate column) the star stood alone beside the figures and the name below them, and
    # narrower a figure was cut ("0.99…" hid 0.9963 from 0.9901) or folded ("340" over "00").
    # Headers fold instead; past the terminal's width the lines run on (`crop=False`).
    for i, col in enumerate(
        (
            "variant",
            "accuracy",
            "p50 ms",
            f"img/s @{batch}",
            "x eager",
            "x ONNX\nfp32",  # two lines: the table fits 80 columns
            "gate",
        )
    ):
        widest = max((len(row[i]) for row in rows), default=1)
        table.add_column(col, justify="right", min_width=widest, no_wrap=i == 0, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def _held_back(variant: dict[str, Any]) -> bool:
    """A variant never recommended however fast (dynamic int8 on a conv net), not the eager
    reference, which is measured to compare with and is no served variant."""
    return not variant["recommendable"] and variant["name"] != "eager"


@app.command()
def report(
    run: RunOpt = Path("runs/default"),
    threads: Annotated[
        int | None, typer.Option(help="threads per model (default: physical cores)")
    ] = None,
    rounds: Annotated[
        int, typer.Option(help="interleaved timing rounds (medians; more rounds, less spread)")
    ] = 15,
    batch: Annotated[int, typer.Option(help="batch size for throughput")] = 64,
    gate: Annotated[
        float | None,
        typer.Option(
            help="a variant keeps >= GATE x fp32 accuracy (default: quantize's --gate, 0.99)",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Measure every variant of RUN; write report/report.md, report.json and pareto.png."""
    from lightship.report import ReportSettings
    from lightship.report import report as report_run
    from lightship.report.render import speedup, tie_note, why_none
    from lightship.runs import RunDir

    r = report_run(  # takes the run lock
        RunDir(run), ReportSettings(threads=threads, rounds=rounds, batch=batch, gate=gate)
    )
    from rich.console import Console

    Console().print(report_table(r, run, batch), crop=False)
    if any(v["gate_passed"] and _held_back(v) for v in r["variants"]):
        print("* passes the gate, and is not recommended (report.md says why)")
    print(f"report: {run}/report/report.md (+ report.json, pareto.png)")
    best = next((v for v in r["variants"] if v["recommended"]), None)
    if best is None:
        print("recommended: none")
    else:  # its speed-ups with their spread over the rounds (too wide for the table)
        print(
            f"recommended: {best['name']}: x eager {speedup(best, 'eager')}, x ONNX fp32 "
            f"{speedup(best, 'onnx_fp32')} (medians; in brackets the middle half of the rounds)"
        )
        tie = tie_note(r)
        if tie:
            print(f"  {tie}")
    if r["timing_warning"]:  # below the figures it speaks of
        print(f"warning: {r['timing_warning']}", file=sys.stderr)
    if best is None:  # `serve`'s auto would refuse this report
        print(f"why none: {why_none(r)}")
        if any(v["recommendable"] for v in r["variants"]):
            by_name = stage_command(
                f"make serve RUN={_q(run)} SERVE_ARGS='--variant ...'",
                f"lightship serve --run {_q(run)} --variant ...",
                run,
            )
            print(f"next: serve one by name: {by_name}")
        else:
            env = RunDir(run).pythonpath()  # both load the checkpoint
            print(
                "next: "
                + stage_command(
                    f"{env}make export RUN={_q(run)}, then {env}make report RUN={_q(run)}",
                    f"{env}lightship export --run {_q(run)}, then {env}lightship report --run "
                    f"{_q(run)}",
                    run,
                )
            )
    else:  # as every stage's next: line, with the lightship command beside make's
        print(f"next: {next_command('serve', run)}")


@bench_app.command("train")
def bench_train(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    steps: Annotated[int, typer.Option(help="timed optimizer steps per setting")] = 30,
    out: Annotated[
        Path,
        typer.Option(help="JSON file for the results", parser=results_file, metavar="<file>"),
    ] = Path("runs/bench/train.json"),
) -> None:
    """Training speed for data choices: float32 vs uint8 input, workers, precision."""
    from lightship.config import load_config
    from lightship.train.bench import bench_training

    bench_training(load_config(config, overrides), steps=steps, out=out)


from lightship.serve.command import bench_serve, serve  # noqa: E402  (commands first, then main)

app.command()(serve)
# What the options do not say: the second file, the time the defaults take (per model: 3
# endpoints x 2 protocols x 3 connection counts, each --duration long, every round, and 1 s
# in-process before each server cell) and the runs it makes for itself.
bench_app.command(
    "serve",
    epilog="Writes OUT and a Markdown table beside it (OUT with .md). The defaults measure for "
    "about 8 minutes: 4 s x 3 rounds x 18 cells (the server, its same-path no-model ceiling and "
    "the FastAPI no-model endpoint; JSON and binary; 3 connection counts) for each of the two "
    "models, and before each of the server's cells 1 s of the in-process ceiling it is held to. "
    "On first use it also makes its own runs, "
    "runs/bench/digits (configs/digits.yaml) and runs/bench/resnet (configs/resnet.yaml, 1 "
    "epoch): training, ONNX export, static int8 and the report, a few minutes more on 2 cores. "
    "Needs wrk.",
)(bench_serve)


def _q(path: Path) -> str:
    """A path as a shell word: the hints printed after a stage can be pasted as they are."""
    return shlex.quote(str(path))


def _invoke(argv: list[str] | None = None) -> int:
    """Run the command line and return its exit code. A usage error (unknown option, bad value)
    is one `error:` line, like every other error, instead of click's boxed panel."""
    command = typer.main.get_command(app)
    try:
        code = command.main(argv, prog_name="lightship", standalone_mode=False)
    except typer.TyperException as exc:  # click's usage errors derive from it
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else _command_path(argv)
        message = exc.format_message().rstrip(".")
        option = re.match(r"No such option: (-v|--verbose)\b", message)
        if option and where != "lightship":
            # the README's `lightship --verbose export`, typed after the command
            message = (  # not click's "Possible options: --opset"
                f"No such option: {option.group(1)}: it goes before the command, "
                f"`lightship {option.group(1)} {where.removeprefix('lightship ')} ...`"
            )
        extra = re.fullmatch(r"Got unexpected extra argument(?:\(s\)|s)? \((\S+)\)", message)
        takes = {o for p in ctx.command.params for o in p.opts} if ctx is not None else set()
        if extra and "--set" in takes and re.fullmatch(r"[A-Za-z_][\w.]*=.*", extra.group(1)):
            # `lightship train --run r data.image_size=32`: an override without its --set
            message += f": a setting goes after --set, `--set {shlex.quote(extra.group(1))}`"
        elif (
            extra
            and "--run" in takes
            and not extra.group(1).startswith("-")
            and not any(a == "--run" or a.startswith("--run=") for a in argv or sys.argv[1:])
        ):
            # `lightship serve runs/default`: the run is an option's value
            message += f": a run goes after --run, `{where} --run {shlex.quote(extra.group(1))}`"
        print(f"error: {message}; see `{where} --help`", file=sys.stderr)
        return exc.exit_code
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 1
    if code == 130:  # Ctrl-C or SIGTERM inside a command: typer turns it into this code
        print(interrupt_message(), file=sys.stderr)
        return interrupt_exit_code()
    return code if isinstance(code, int) else 0


def _command_path(argv: list[str] | None) -> str:
    """`lightship quantize` (or `lightship bench serve`) from the command line, for a usage
    error click raises without a context (an option missing its value): its fix named the
    top-level help."""
    words = [w for w in (sys.argv[1:] if argv is None else argv) if not w.startswith("-")]
    path = ["lightship"]
    group: Any = typer.main.get_command(app)
    for word in words:
        commands = getattr(group, "commands", None)
        if not commands or word not in commands:
            break
        path.append(word)
        group = commands[word]
    return " ".join(path)


def _done() -> None:
    """The command has finished, its output written: Ctrl-C from now on is ignored. The
    interpreter's teardown after a stage takes about a second, and a Ctrl-C in it raised
    KeyboardInterrupt in the middle of it (a traceback under a finished export) or, later in
    it, killed the process (exit 130 under its `next:` line). A Python handler would not do:
    finalization puts the default one back before its slow part. SIGTERM keeps its default,
    which stops a teardown that hangs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ONNX Runtime's telemetry (1.32, Linux too) looks up mobile.events.data.microsoft.com from the
# serving process and keeps an event store under ~/.cache/Microsoft: off unless a user turns it
# on. Set before onnxruntime is imported, which the CLI does only in a command.
TELEMETRY_OFF = ("ORT_DISABLE_TELEMETRY", "1")


def main() -> None:
    os.environ.setdefault(*TELEMETRY_OFF)
    watch_interrupts()
    try:
        code = _invoke()
        _done()
        sys.exit(code)
    except LightshipError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except (PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError) as exc:
        # an output (or input) path the user can fix; other OSErrors keep their traceback
        name = exc.filename2 if exc.filename2 is not None else exc.filename
        # whose permissions: a container's user is seldom the files' owner
        who = f" to uid {os.getuid()}" if isinstance(exc, PermissionError) else ""
        print(
            f"error: cannot write/read {name}: {exc.strerror}{who}: check the path and its "
            "permissions",
            file=sys.stderr,
        )
        sys.exit(1)
    except OSError as exc:
        written = exc.filename or "a file"
        if exc.errno == errno.EFBIG:
            print(
                f"error: writing {written} went past the largest file this process may write: "
                "raise the limit (`ulimit -f unlimited`) and run again",
                file=sys.stderr,
            )
            sys.exit(1)
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise  # anything else is a bug: keep its traceback
        # the stage's own note where it set one (a training that finished its epochs resumes
        # to write best.ckpt: run again, it trained them all again)
        note = interrupt_note()
        fix = f"make room; {note}" if note else "make room and run again"
        print(f"error: no space left on the device writing {written}: {fix}", file=sys.stderr)
        sys.exit(1)
    except MemoryError as exc:  # numpy's "Unable to allocate 28.1 GiB" for image_size 4096
        said = f" ({first_line(exc)})" if str(exc) else ""
        print(
            f"error: out of memory{said}: use smaller settings (data.image_size, "
            "data.batch_size, --calibration-samples, --batch) or a machine with more memory",
            file=sys.stderr,
        )
        sys.exit(1)
    except KeyboardInterrupt:
        print(interrupt_message(), file=sys.stderr)
        sys.exit(interrupt_exit_code())
    except Exception:  # after a Ctrl-C or SIGTERM: a stop, not a bug. One in a C extension's
        # import is numpy's "initialization failed" ImportError; one while dynamo imported sympy
        # left it half-imported, and the next import of it (torch's, as the stage restored its
        # caller's state) raised AttributeError over the KeyboardInterrupt: exit 1, a traceback
        if not interrupted():
            raise
        print(interrupt_message(), file=sys.stderr)
        sys.exit(interrupt_exit_code())


if __name__ == "__main__":
    main()
