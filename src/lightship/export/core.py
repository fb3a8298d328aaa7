from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightship import __version__
from lightship.config import DataConfig, load_config, parse_choices
from lightship.data import DataSpec, check_as_trained, load_splits
from lightship.errors import ConfigError, DataError, LightshipError, ParityError, RunError
from lightship.export import onnx as onnx_export
from lightship.export import pt2 as pt2_export
from lightship.export import torchscript as ts_export
from lightship.export.failure import reason
from lightship.export.parity import Parity, check_parity, check_reference, compare, run_batched
from lightship.models import module_file, spec_pythonpath, unusable_logits
from lightship.models.checkpoint import LoadedCheckpoint, load_checkpoint
from lightship.runs import (
    REPORT_FILES,
    RunDir,
    RunLike,
    as_run,
    atomic_path,
    check_space,
    check_writable,
    interrupted,
    lock_run,
    note_interrupt,
    sha256_file,
    stage_on,
    then_held,
)
from lightship.runtime import load_predictor
from lightship.runtime.base import META_INPUT_SPEC, META_LABELS, LoadError, caller_state_kept

log = logging.getLogger(__name__)

FORMATS = ("onnx", "torchscript", "pt2")
FILENAMES = {"onnx": "model.onnx", "torchscript": "model.ts", "pt2": "model.pt2"}
# Manifest keys are the variant names the report and `serve --variant` use.
VARIANT_OF = {"onnx": "onnx-fp32", "torchscript": "torchscript", "pt2": "pt2"}


@dataclass
class Artifact:
    variant: str
    format: str
    path: Path
    parity: Parity
    info: dict[str, Any] = field(default_factory=dict)
    on_test_split: bool = True  # parity checked on the test split (else random images)


def parse_formats(formats: Sequence[str] | str | None) -> list[str]:
    return parse_choices(formats, FORMATS, "export format", ConfigError)


def metadata(loaded: LoadedCheckpoint, source_sha: str) -> dict[str, str]:
    """Key/values stored inside each artifact, so a lone file can be served."""
    return {
        "lightship.version": __version__,
        META_LABELS: json.dumps(loaded.labels),
        META_INPUT_SPEC: json.dumps(loaded.input_spec),
        "lightship.model": json.dumps(loaded.model_spec["name"]),
        "lightship.source_checkpoint_sha256": source_sha,
    }


def parity_inputs(
    loaded: LoadedCheckpoint, fallback: int = 256
) -> tuple[np.ndarray, np.ndarray | None]:
    """The held-out test split's images and labels when its data is still reachable, else
    seeded random pixels and None: an export needs no labels, so a run copied without its data
    still exports; quantize and report do need them, which the warning says (and the CLI's
    `next:` line)."""
    try:
        spec = DataSpec.from_dict(loaded.data_spec)
        splits = load_splits(spec, recorded=True, only=("test",))
        return splits.test_x, splits.test_y
    except DataError as exc:
        log.warning(
            "parity checked on %d random images, not the test split: %s. Quantize and report "
            "measure accuracy on that split, and refuse until the data is back",
            fallback,
            str(exc).rstrip("."),
        )
        c, h, w = loaded.input_spec["shape"][1:]
        rng = np.random.default_rng(0)
        return rng.integers(0, 256, size=(fallback, c, h, w), dtype=np.uint8), None


def eager_logits(
    model: torch.nn.Module, x: np.ndarray, batches: Sequence[int]
) -> dict[int, np.ndarray]:
    """The eager model's logits over `x` at each batch size, run in chunks of that size as the
    artifacts are: each chunk is compared with the same chunk through the artifact (a model
    whose output depends on its batch differs between batch sizes), and no forward pass holds
    more than one chunk's activations."""

    def predict(chunk: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(chunk)).numpy()

    return {b: run_batched(predict, x, b) for b in batches}


def _command(
    run: RunDir,
    loaded: LoadedCheckpoint,
    stage: str,
    formats: Sequence[str] = (),
    flags: Sequence[str] = (),
) -> str:
    """`stage` on this run as a command that runs from here, with the PYTHONPATH its model's
    module needs; for export, `formats` when they are not all of them, and `flags` (the
    options this export was given: `_flags`)."""
    env = spec_pythonpath(loaded.model_spec)
    return stage_on(run.root, stage, env, "formats", formats, FORMATS, flags)


def _flags(opset: int, atol: float) -> list[str]:
    """`lightship export`'s options that give `opset` and `atol` where they are not the
    defaults: an export said again (after a Ctrl-C, without a format) keeps them."""
    return [
        *(["--opset", str(opset)] if opset != DEFAULT_OPSET else []),
        *(["--atol", repr(atol)] if atol != DEFAULT_ATOL else []),  # exact: :g dropped digits
    ]


def _fix(
    run: RunDir,
    loaded: LoadedCheckpoint,
    fmt: str,
    chosen: Sequence[str],
    flags: Sequence[str] = (),
) -> str:
    """How to go on without `fmt`, as a command that runs from here. What this export wrote
    before `fmt` stays: the export of the formats asked for after it, or, when none is left and
    model.onnx is written, the next stage; else the export of the other formats asked for (all
    the others when `fmt` was the only one)."""
    written = list(chosen[: chosen.index(fmt)])
    rest = list(chosen[chosen.index(fmt) + 1 :])
    files = [FILENAMES[f] for f in written]
    done = f"{' and '.join(files)} {'are' if len(files) > 1 else 'is'} written"
    if "onnx" in written and not rest:
        return f"leave {fmt} out: {done}; go on with `{_command(run, loaded, 'quantize')}`"
    others = rest or written or [f for f in FORMATS if f != fmt]
    return f"leave {fmt} out: `{_command(run, loaded, 'export', others, flags)}`" + (
        f" ({done})" if files else ""
    )


@contextmanager
def _failure(what: str, fix: str) -> Iterator[None]:
    """A library's exception inside the block becomes one ParityError line: `what`, torch's
    reason and `fix`; the traceback goes to the debug log (`lightship --verbose`). Our own
    errors, Ctrl-C and the OS's errors (a full disk) pass through."""
    try:
        yield
    except (LightshipError, KeyboardInterrupt):
        raise
    except Exception as exc:
        if interrupted():  # Ctrl-C, caught and re-raised as something else inside torch
            raise KeyboardInterrupt from None
        if isinstance(exc, OSError) and exc.errno is not None:
            raise
        log.debug("%s", what, exc_info=True)
        raise ParityError(
            f"{what}: {reason(exc)} — {fix}, or change the model's forward "
            "(`lightship --verbose export` shows the traceback)"
        ) from None


Writer = Callable[[torch.nn.Module, torch.Tensor, Path, dict[str, str]], dict[str, Any]]


def _writers(opset: int) -> dict[str, Writer]:
    return {
        "onnx": lambda m, x, p, meta: onnx_export.write(m, x, p, meta, opset=opset),
        "torchscript": ts_export.write,
        "pt2": pt2_export.write,
    }


def _discard_quantized_from_another(run: RunDir, onnx_sha256: str) -> None:
    """int8 variants made from a model.onnx this export replaced with a different one are
    unlisted, and their files deleted so the disk matches the manifest: report and serve would
    otherwise take them as current."""
    stale = [
        name
        for name, entry in run.manifest()["artifacts"].items()
        if entry.get("source_sha256") not in (None, onnx_sha256)
    ]
    if stale:
        # the report measured them: it goes with them (`RunDir.discard`), and is made again
        had_report = any((run.root / f).is_file() for f in REPORT_FILES)
        run.discard(*stale)
        gone = [*stale, *(["the report"] if had_report else [])]
        again = run.command("quantize", *(["report"] if had_report else []))
        print(
            f"the new model.onnx outdates {', '.join(gone)} of this run: deleted; re-run {again}",
            flush=True,
        )


def _check_logits_dtype(loaded: LoadedCheckpoint, example: torch.Tensor) -> None:
    """ParityError, before anything is exported, for a model whose logits no runtime of
    lightship's gives back (`models.unusable_logits`: bfloat16 from a cast in its forward;
    float16 and float64 are read as float32)."""
    with torch.inference_mode():
        why = unusable_logits(loaded.model(example))
    if why is not None:
        raise ParityError(
            f"the model outputs {why}: end its forward with `.float()` (the weights need no "
            "new training); nothing was written"
        )


def _accuracy_as_trained(
    run: RunDir,
    loaded: LoadedCheckpoint,
    x: np.ndarray,
    y: np.ndarray,
    references: dict[int, np.ndarray],
) -> float:
    """The eager model's test accuracy in the batches training measured `test_acc` in (the run's
    data.eval_batch_size): a model whose labels change with its batch (batch statistics in eval)
    scores otherwise at the parity batch. One that gives the same labels at batch 1 and at the
    parity batch is taken to give them at any, and is not run again."""
    labels = [r.argmax(1) for r in references.values()]
    if all(np.array_equal(labels[0], other) for other in labels[1:]):
        return float(np.mean(labels[0] == y))
    try:
        batch = load_config(run.config, recorded=True).data.eval_batch_size
    except (LightshipError, OSError):  # the accuracy is checked all the same, at the default
        batch = DataConfig().eval_batch_size
    return float(np.mean(eager_logits(loaded.model, x, (batch,))[batch].argmax(1) == y))


def _batch_dependence(references: dict[int, np.ndarray], atol: float) -> dict[str, Any] | None:
    """A warning, and what was measured for each artifact's manifest entry (`serve` repeats
    the warning from it), when the eager model's logits for an image depend on the others in
    its batch (batch statistics in eval: BatchNorm without running statistics): each format is
    held to eager at the same batch and passes, but the server batches requests of different
    clients together, so an answer would change with the traffic. None when they do not."""
    batches = list(references)  # batch 1, then the parity batch (alone where that is 1)
    if len(batches) < 2:
        return None
    one, many = batches[0], batches[-1]
    diff, agree = compare(references[one], references[many])
    # past float noise (another kernel at another batch: ~1e-6 for a ResNet-18), whatever --atol
    if diff > max(atol, 1e-3):
        log.warning(
            "the model's logits for an image depend on the other images in its batch: max "
            "|Δlogit| %.2e between batch %d and %d on the same images (labels agree on %.1f%%); "
            "served, an answer changes with the requests batched with it (`lightship serve "
            "--max-batch-rows 1` for answers independent of traffic)",
            diff,
            one,
            many,
            100 * agree,
        )
        return {"batches": [one, many], "max_abs_logit_diff": diff, "label_agreement": agree}
    return None


def _warn_unfinished_training(run: RunDir, recorded: dict[str, Any]) -> None:
    """A warning when checkpoints/ holds a later training than best.ckpt's entry, one stopped
    before it chose and recorded its best checkpoint (`RunDir.later_training`)."""
    if (what := run.later_training(recorded)) is not None:
        log.warning(
            "best.ckpt is from a training that %s: a later training of this run stopped before "
            "it chose its best checkpoint; exporting the earlier best.ckpt (%s finishes that "
            "training and writes best.ckpt from it)",
            what,
            run.train_command(),
        )


def _check_deterministic(
    loaded: LoadedCheckpoint, x: np.ndarray, reference: np.ndarray, atol: float
) -> None:
    """ParityError when the eager model gives other logits for the same images a second time
    (dropout left on with `training=True`, `torch.rand` in forward): each format would be
    blamed in turn for what no export can match."""
    again = eager_logits(loaded.model, x, (len(x),))[len(x)]
    diff, _ = compare(reference, again)
    if diff > atol:
        raise ParityError(
            f"the eager model gives other logits for the same {len(x)} images when run again "
            f"(max |Δlogit| {diff:.2e}, --atol {atol:g}): its forward draws random numbers in "
            "eval mode (F.dropout(..., training=True), torch.rand), which no exported format "
            "can match; make it deterministic in eval mode (`training=self.training`); nothing "
            "was written"
        )


DEFAULT_OPSET = 18
DEFAULT_ATOL = 1e-4


def export(
    run: RunLike,
    formats: Sequence[str] | str | None = None,
    opset: int = DEFAULT_OPSET,
    atol: float = DEFAULT_ATOL,
    min_agreement: float = 1.0,
    parity_batch: int = 64,
) -> list[Artifact]:
    """Export `run`'s best.ckpt (a path or a RunDir) and return one Artifact per format (its
    `path`, and `parity`: how its logits compared with the checkpoint's).

    `formats`: "onnx", "torchscript", "pt2" (a list, or a comma-separated string; default:
    all), written to RUN/export/ (model.onnx, model.ts, model.pt2; ONNX at `opset`) and
    recorded in RUN/manifest.json only when, on the test images at batch 1 and
    `parity_batch`, its logits are within `atol` of the checkpoint's and at least
    `min_agreement` of its labels agree.

    Raises a `lightship.errors.LightshipError` with a one-line fix: RunError (no trained
    run), ParityError (a format that disagrees: none of it is kept), ConfigError."""
    # The run lock, for the CLI and a call from Python alike: no other stage may replace the
    # checkpoint or read the run meanwhile
    run = as_run(run)
    with lock_run(run.root, "lightship export"), caller_state_kept():
        return _export(run, formats, opset, atol, min_agreement, parity_batch)


def _export(
    run: RunDir,
    formats: Sequence[str] | str | None,
    opset: int,
    atol: float,
    min_agreement: float,
    parity_batch: int,
) -> list[Artifact]:
    chosen = parse_formats(formats)
    if not (math.isfinite(atol) and atol >= 0):
        raise ConfigError(f"export --atol must be a finite number >= 0 (e.g. 1e-4), got {atol}")
    if not 0 <= min_agreement <= 1:  # NaN too
        raise ConfigError(
            f"export's min_agreement is a share of images, 0..1 (e.g. 0.99), got {min_agreement}"
        )
    if isinstance(parity_batch, bool) or not isinstance(parity_batch, Integral) or parity_batch < 1:
        raise ConfigError(f"export's parity_batch must be an integer >= 1, got {parity_batch!r}")
    parity_batch = int(parity_batch)  # numpy's too
    if "onnx" in chosen:
        onnx_export.check_opset(opset)
        opset = int(opset)  # numpy's too
    ckpt = run.require_checkpoint()
    recorded = run.artifact("checkpoint")
    if recorded is None:  # quantize and report read its data split from that entry
        raise run.unrecorded("export")
    source_sha = run.check_checkpoint(recorded)
    _warn_unfinished_training(run, recorded)
    loaded = load_checkpoint(ckpt)
    x_test, y_test = parity_inputs(loaded)
    on_test_split = y_test is not None
    # A batch of >= 2 keeps the batch dimension symbolic in torch.export / dynamo (a test
    # split of one image is taken twice: of one, pt2 failed as if the model fixed its batch)
    example = torch.from_numpy(x_test[np.arange(2) % len(x_test)])
    _check_logits_dtype(loaded, example)
    references = eager_logits(loaded.model, x_test, tuple(dict.fromkeys((1, parity_batch))))
    reference = references[parity_batch]
    width = int(np.prod(reference.shape[1:]))
    if reference.ndim != 2 or width != len(loaded.labels):
        raise RunError(
            f"checkpoint {ckpt} is inconsistent: {len(loaded.labels)} labels but the model gives "
            f"{width} logits per image: train the run again ({run.train_command()})"
        )
    check_reference(references, len(x_test))
    _check_deterministic(loaded, x_test[:parity_batch], reference[:parity_batch], atol)
    batch_dependent = _batch_dependence(references, atol)
    if y_test is not None:  # the code that trained: else every format matches another model
        accuracy = _accuracy_as_trained(run, loaded, x_test, y_test, references)
        code = module_file(loaded.model_spec["name"])
        check_as_trained(recorded, y_test, accuracy, "best.ckpt", code=code)
    meta = metadata(loaded, source_sha)
    writers = _writers(opset)
    check_writable(run.manifest_path, *(run.export_dir / FILENAMES[fmt] for fmt in chosen))
    # torch's C++ writers abort the process on a full disk; each artifact is about a third of
    # the checkpoint (which also holds the optimizer's state)
    check_space(run.export_dir, len(chosen) * ckpt.stat().st_size // 3 + 4_000_000, "export")
    artifacts: list[Artifact] = []
    try:
        for i, fmt in enumerate(chosen, 1):
            # a ResNet-18's three exports with their parity checks take minutes together
            log.info(
                "exporting %s (%d of %d) and checking it against eager on %d images",
                fmt,
                i,
                len(chosen),
                len(x_test),
            )
            final = run.export_dir / FILENAMES[fmt]
            fix = _fix(run, loaded, fmt, chosen, _flags(opset, atol))
            if final.exists():  # a failure keeps an earlier export: say so, not just "not written"
                fix = f"{fix} (the earlier {final.name} stays as it was)"
            with then_held() as then, atomic_path(final) as tmp:
                with _failure(f"torch cannot export this model to {fmt}", fix):
                    info = writers[fmt](loaded.model, example, tmp, meta)
                # outside `_failure`: a bug of our own keeps its traceback
                try:
                    # unsplit: a batch of 64 cut into one slice per lane, where the load's timing
                    # splits that early, is not the batch eager ran (a model whose output
                    # depends on its batch then failed parity under load alone)
                    predictor = load_predictor(tmp, split=False)
                except LoadError as exc:  # whose advice, to make the file again, is no use here;
                    # onnxruntime's reason names the file it read: the temporary one
                    raise ParityError(
                        f"{final.name} was exported but {exc.runtime} cannot load it "
                        f"({exc.reason({str(tmp): final.name})}): it was not written — {fix}"
                    ) from None
                with _failure(f"{final.name} was exported but fails when run", fix):
                    parity = check_parity(
                        predictor.predict,
                        references,
                        x_test,
                        atol=atol,
                        min_agreement=min_agreement,
                        what=f"{fmt} ({final.name})",
                        fix=fix,
                    )
                # measured before the rename, recorded right after it with stop signals held
                # (`then_held`): an interrupt between the two would leave a file that its
                # manifest entry does not describe
                entry = {
                    "file": run.relative(final),
                    "format": fmt,
                    "sha256": sha256_file(tmp),
                    "bytes": tmp.stat().st_size,
                    "input_spec": loaded.input_spec,
                    "labels": loaded.labels,
                    "source_checkpoint_sha256": source_sha,
                    "parity": parity.as_dict(),
                    **({"batch_dependent": batch_dependent} if batch_dependent else {}),
                    **info,
                    "versions": {"lightship": __version__, "torch": torch.__version__},
                }
                if fmt == "onnx":
                    # before the new entry: killed in between, the int8 models of the old
                    # model.onnx were listed as made from the new one (the report recommended
                    # one); this way the old entry stays beside the new file, which the stages
                    # refuse as changed behind its manifest
                    then(_discard_quantized_from_another, run, entry["sha256"])
                then(run.record, VARIANT_OF[fmt], entry)
                # the caller prints the artifacts with their parity, once (`lightship export`)
                made = Artifact(VARIANT_OF[fmt], fmt, final, parity, info, on_test_split)
                then(artifacts.append, made)
    except KeyboardInterrupt:  # the last line says what is kept and how to go on
        done = [a.format for a in artifacts]
        rest = [f for f in chosen if f not in done]
        kept = f"{', '.join(done)} exported and kept; " if done else ""
        again = "export the rest with" if done else "export again with"
        again += f" `{_command(run, loaded, 'export', rest, _flags(opset, atol))}`"
        note_interrupt(f"{kept}{again}")
        raise
    return artifacts
