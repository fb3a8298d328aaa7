"""`lightship` command line: a thin layer over the stage functions.

Heavy imports (torch, Lightning, onnxruntime) happen inside each command, so `--help` is quick
and `lightship serve` on an ONNX model never imports torch.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from lightship.errors import LightshipError

app = typer.Typer(
    help="Train, export, quantize, report and serve image classifiers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
bench_app = typer.Typer(
    help="Benchmarks: they print and save what they measured.", no_args_is_help=True
)
app.add_typer(bench_app, name="bench")

RunOpt = Annotated[Path, typer.Option("--run", "-r", help="run directory", show_default=True)]
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML config (default: built-in defaults)")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", "-s", help="override a config key, e.g. --set trainer.max_epochs=3 (repeatable)"
    ),
]


@app.callback()
def _root(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")] = False,
) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not verbose:  # the ONNX exporter narrates every optimisation pass at INFO
        for name in ("onnxscript", "onnx_ir", "torch.onnx"):
            logging.getLogger(name).setLevel(logging.WARNING)


@app.command()
def train(
    run: RunOpt = Path("runs/default"),
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="continue from RUN/checkpoints/last.ckpt")
    ] = False,
) -> None:
    """Train a model with Lightning; writes RUN/best.ckpt, checkpoints/, logs/ and manifest.json."""
    from lightship.config import load_config
    from lightship.runs import RunDir

    cfg = load_config(config, overrides)
    from lightship.train import fit

    fit(cfg, RunDir(run), resume=resume)


@app.command()
def export(
    run: RunOpt = Path("runs/default"),
    formats: Annotated[
        str, typer.Option("--formats", "-f", help="comma-separated: onnx,torchscript,pt2")
    ] = "onnx,torchscript,pt2",
    opset: Annotated[int, typer.Option(help="ONNX opset version")] = 18,
    atol: Annotated[
        float, typer.Option(help="parity limit: max |logit difference| against eager")
    ] = 1e-4,
) -> None:
    """Export RUN/best.ckpt to RUN/export/ (ONNX, TorchScript, .pt2), each checked for parity."""
    from lightship.export import export as export_run
    from lightship.runs import RunDir

    artifacts = export_run(RunDir(run), formats, opset=opset, atol=atol)
    for a in artifacts:
        print(f"{a.variant:12s} {a.path}  parity: {a.parity.summary()}")
    print(f"next: make quantize RUN={run}   (or `lightship quantize --run {run}`)")


@bench_app.command("train")
def bench_train(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    steps: Annotated[int, typer.Option(help="timed optimizer steps per setting")] = 30,
    out: Annotated[Path, typer.Option(help="JSON file for the results")] = Path(
        "runs/bench/train.json"
    ),
) -> None:
    """Training speed for data choices: float32 vs uint8 input, workers, precision."""
    from lightship.config import load_config
    from lightship.train.bench import bench_training

    bench_training(load_config(config, overrides), steps=steps, out=out)


def main() -> None:
    try:
        app()
    except LightshipError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
