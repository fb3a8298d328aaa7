"""`quantize(run, methods, target)`: int8 variants of RUN/export/model.onnx, each gated.

Reads the exported fp32 ONNX model and the data spec recorded in the manifest (never the
training code), writes `RUN/quantize/model.int8-<method>.onnx` atomically, and records each
variant in the manifest with its scheme, the CPU it was made for, calibration settings,
accuracy against fp32 and the nodes kept in fp32.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnxruntime as ort
from google.protobuf.message import DecodeError
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidProtobuf

from lightship import __version__
from lightship.config import parse_choices
from lightship.data import DataSpec, Splits, check_as_trained, load_splits
from lightship.errors import (
    ConfigError,
    LightshipError,
    QuantizeError,
    RunError,
    check_settings,
    first_line,
)
from lightship.quantize import fallback, isa, ptq
from lightship.report.evaluate import logits, other_input
from lightship.report.measure import NOISE_RULE, Timing, measure, noise_cause
from lightship.runs import (
    REPORT_FILES,
    SCRATCH_PREFIXES,
    RunDir,
    RunLike,
    as_run,
    atomic_path,
    atomic_paths,
    check_recorded,
    check_space,
    check_the_name,
    check_writable,
    lock_run,
    note_interrupt,
    sha256_file,
    stage_on,
    then_held,
)
from lightship.runtime import Predictor, load_predictor
from lightship.runtime.base import LoadError, caller_state_kept, quiet_loggers
from lightship.runtime.ort import (
    DISABLED_OPTIMIZERS,
    QUANTIZATION,
    SPIN_IN_RUN,
    TARGET,
    OrtPredictor,
    create_session,
)

log = logging.getLogger(__name__)
# Below this SQNR of static int8's logits against fp32's, a clipping calibration is warned of
# (minmax's digits: 50 dB; entropy's: 3.6 and 11)
LOW_SQNR_DB = 20.0

METHODS = ("static", "dynamic", "qat")
FILENAMES = {m: f"model.int8-{m}.onnx" for m in METHODS}
QAT_CKPT = "qat.ckpt"  # in RUN/quantize/, beside its int8 model
INT8_OPS = {
    "QLinearConv",
    "QLinearMatMul",
    "ConvInteger",
    "MatMulInteger",
    "QGemm",
    "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat",
}
# Threads spinning inside a run pay only when a run is long against the HTTP work between runs
# (docs/PERFORMANCE.md, "ONNX Runtime's AMX kernels"): ResNet-18 at 1.6 ms gained 18 % served
# one request at a time, digits at 0.1 ms lost 30 %. Only a multi-thread session has threads
# to spin: a model whose short batches run on one thread (`OrtPredictor.short_batch_threads`)
# needs no floor.
SPIN_MIN_RUN_MS = 0.5
AB_BATCH = 64  # the batch at which a candidate model is timed against the current one
# A candidate is kept only where it measures over this much faster than the current model
AB_MIN_GAIN = 1.05
# Rounds of an A/B, and of each more that it gets while the median speed-up's ~95 % bounds
# (`Timing.speedup_bounds`) hold AB_MIN_GAIN, up to AB_MAX_ROUNDS. On the AVX2 EPYC the thin
# first conv's gain, ~1.09x, measured 1.049x in one run of 8 rounds, under the bar, and the
# run then recommended another int8 model than the runs before and after it.
AB_ROUNDS = 8
AB_MAX_ROUNDS = 32
FLOAT_OPS = {"Conv", "FusedConv", "MatMul", "FusedMatMul", "Gemm", "FusedGemm"}
# Room quantize needs free (`_check_room`), in multiples of export/model.onnx and best.ckpt. On
# the digits CNN, static and dynamic peaked at 3.0x the model in the run folder and 1.1x in the
# temporary folder (where onnxruntime's pre-processing keeps up to three copies at once), 3.3x
# with both on one disk; QAT alone at 1.4x best.ckpt, pre-processing included.
ROOM_PER_MODEL, ROOM_PER_CKPT, TEMP_ROOM_PER_MODEL = 4, 2, 3
ROOM_MARGIN = 4_000_000


@dataclass
class QuantizeSettings:
    calibration_samples: int = 256
    calibration_method: str = "minmax"
    calibration_chunk: int = 64  # images held by the calibrator at once (bounds memory)
    per_channel: bool = True
    gate: float = fallback.DEFAULT_GATE  # an int8 variant keeps >= gate x fp32 accuracy
    fallback_budget: int = 3  # at most this many nodes are moved back to fp32
    qat_epochs: int = 3
    qat_lr: float = 1e-4
    seed: int = 0

    def flags(self) -> list[str]:
        """`lightship quantize` options that give these settings where they are not the
        defaults: for a command that repeats this quantize (calibration_chunk and seed have
        no option)."""
        default = QuantizeSettings()
        out: list[str] = []
        for name in (f.name for f in fields(self)):
            value = getattr(self, name)
            if name in ("calibration_chunk", "seed") or value == getattr(default, name):
                continue
            option = name.replace("_", "-")
            if isinstance(value, bool | np.bool_):
                out.append(f"--{option}" if value else f"--no-{option}")
            else:
                out += [f"--{option}", repr(value) if isinstance(value, float) else str(value)]
        return out

    def __post_init__(self) -> None:
        check_settings(self, QuantizeSettings, "quantize")
        fallback.check_gate(self.gate, "quantize")
        for name, low in (("fallback_budget", 0), ("qat_epochs", 1)):
            value = getattr(self, name)
            if value < low:
                option = name.replace("_", "-")
                raise ConfigError(f"quantize --{option} must be at least {low}, got {value}")
        if not (math.isfinite(self.qat_lr) and self.qat_lr > 0):
            raise ConfigError(
                f"quantize --qat-lr must be a finite number > 0 (e.g. 1e-4), got {self.qat_lr}"
            )


class MethodFailed(QuantizeError):
    """One method cannot handle this model: `cause` says why, `fix` what to do instead. Kept
    apart so the CLI can word it as a warning when the other methods made their variants."""

    def __init__(self, method: str, cause: str, fix: str) -> None:
        super().__init__(f"{method.upper()} failed ({cause}); {fix}")
        self.cause = cause
        self.fix = fix


class Unloadable(MethodFailed):
    """onnxruntime cannot load an int8 model quantize has just made (`made_here`): the fault
    is the method's, not a file for the user to make again, which `LoadError` would advise."""


@contextlib.contextmanager
def made_here(method: str, made: Path, scratch: Path | None = None) -> Iterator[None]:
    """Loads of the int8 model `made` (the temporary file of `FILENAMES[method]`) or of a
    candidate in the `scratch` folder inside this block fail as `Unloadable`, naming the model
    rather than temporary paths gone by the time the user reads them."""
    name = FILENAMES[method]
    try:
        yield
    except LoadError as exc:
        names = {str(made): name, **({f"{scratch}{os.sep}": ""} if scratch else {})}
        reason = exc.reason(names)
        others = ",".join(m for m in METHODS if m != method)
        raise Unloadable(
            method,
            f"{exc.runtime} cannot load the int8 model it has just made: {reason}",
            f"{name} was not written; leave {method} out (--methods {others})",
        ) from None


@dataclass
class Variant:
    method: str
    path: Path
    accuracy: float
    gate_passed: bool
    entry: dict[str, Any] = field(default_factory=dict)


def parse_methods(methods: Sequence[str] | str | None) -> list[str]:
    return parse_choices(methods, METHODS, "quantization method", ConfigError)


def int8_share(path: Path, threads: int | None = None) -> dict[str, Any]:
    """Conv/MatMul nodes ORT actually runs in int8 after its graph optimisation."""
    with tempfile.TemporaryDirectory() as tmp:
        optimized = os.path.join(tmp, "optimized.onnx")

        def options(spin_in_run: bool) -> ort.SessionOptions:
            so = ort.SessionOptions()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            so.optimized_model_filepath = optimized
            so.intra_op_num_threads = threads or 1
            so.log_severity_level = 3
            return so

        try:
            create_session(path, options)
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/... types
            raise LoadError(path, "ONNX", "onnxruntime", exc, "quantize it again") from None
        import onnx

        ops = [n.op_type for n in onnx.load(optimized).graph.node]
    n_int8 = sum(op in INT8_OPS for op in ops)
    n_float = sum(op in FLOAT_OPS for op in ops)
    return {
        "int8_nodes": n_int8,
        "float_nodes": n_float,
        "share": n_int8 / max(n_int8 + n_float, 1),
        "int8_op_types": sorted({op for op in ops if op in INT8_OPS}),
    }


def mostly_float(method: str, entry: dict[str, Any]) -> str | None:
    """A warning when ORT runs under half of a variant's Conv/MatMul/Gemm nodes in int8 (QAT
    of a model whose convs feed SiLU or Hardswish, say): an "int8" model at fp32 speed or
    slower, which only the report's int8-ops column said."""
    ops = entry.get("int8_ops") or {}
    n_int8, n_float = int(ops.get("int8_nodes", 0)), int(ops.get("float_nodes", 0))
    if n_int8 + n_float == 0 or n_int8 >= n_float:
        return None
    return (
        f"int8-{method} runs {n_int8} of its {n_int8 + n_float} Conv/MatMul/Gemm nodes in int8 "
        "(onnxruntime keeps the others in float): expect little speed-up over fp32, or none; "
        "`lightship report` times it"
    )


def _share(fraction: float) -> str:
    """A fraction as a whole percentage, but not rounded to 100 % or 0 % unless it is so
    (0.99922 is 99.9 %, not 100 %)."""
    digits, said = 0, f"{fraction:.0%}"
    while float(said[:-1]) in (0.0, 100.0) and fraction not in (0.0, 1.0) and digits < 4:
        digits += 1
        said = f"{fraction:.{digits}%}"
    return said


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM
        return True
    except OSError:
        return False


def _peak_rss_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB, which Linux means as KiB
    except OSError:
        pass
    return None


def calibration_images(splits: Splits, n: int, seed: int) -> np.ndarray:
    """`n` training images, the same for every method; classes mixed by a seeded shuffle."""
    if n <= 0:
        raise QuantizeError(
            "empty calibration set: --calibration-samples must be positive (default 256)"
        )
    if len(splits.train_x) == 0:
        raise QuantizeError("empty calibration set: the run's training split has no images")
    if n > len(splits.train_x):
        log.warning(
            "--calibration-samples %d: the training split has %d images, all of them used",
            n,
            len(splits.train_x),
        )
    idx = np.random.default_rng(seed).permutation(len(splits.train_x))[:n]
    return np.ascontiguousarray(splits.train_x[np.sort(idx)])


def _check_room(run: RunDir, qat: bool) -> None:
    """RunError unless the run's disk, and the temporary folder where onnxruntime writes its
    own copies of the model, have the room quantize needs: onnx and onnxruntime write models
    from C++, which a full disk cuts short without an error, and the next load of such a
    model fails with a protobuf DecodeError instead of the disk's ENOSPC."""
    model = (run.export_dir / "model.onnx").stat().st_size
    ckpt = run.best_ckpt.stat().st_size if qat else 0
    check_space(run.root, ROOM_PER_MODEL * model + ROOM_PER_CKPT * ckpt + ROOM_MARGIN, "quantize")
    temp = Path(tempfile.gettempdir())
    check_space(temp, TEMP_ROOM_PER_MODEL * model + ROOM_MARGIN, "quantize")


@contextlib.contextmanager
def _cut_short_by_a_full_disk(run: RunDir, qat: bool) -> Iterator[None]:
    """A model that fails to load as protobuf was cut short by a full disk where the disk
    lacks room now: `_check_room`'s error says so. Otherwise it is a bug: its traceback stays."""
    try:
        yield
    except (DecodeError, InvalidProtobuf):
        _check_room(run, qat)
        raise


def _settle(candidate: Path, current: Path, kept: bool) -> None:
    """A timed candidate replaces `current` when it is kept, and is deleted when not."""
    if kept:
        os.replace(candidate, current)
    else:
        candidate.unlink()


def _accuracy(model: Path | Predictor, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Accuracy and logits on `x` run exactly as the report runs them (`evaluate.logits`): a
    dynamic int8 model scales its activations per run, so its accuracy moves with the rows
    each run gets, and the figure recorded here must be the one the report shows. A path is
    loaded unsplit (`split=False`): `logits` would load it again otherwise; without the ISA
    warning, which `Quantizer` gives once for all its models."""
    predictor = (
        model
        if isinstance(model, Predictor)
        else load_predictor(model, split=False, isa_check=False)
    )
    out = logits(predictor, x)
    return float(np.mean(out.argmax(1) == y)), out


def _import_qat() -> Callable[..., dict[str, Any]]:
    """`qat.quantize_aware_train`, imported on first use (torch, torchao). torchao logs on import
    that its CUDA kernels (`_C_mxfp8...so`) do not load, and torch a deprecation of torchao's:
    muted for a caller in Python too, as the CLI mutes them."""
    with quiet_loggers("torchao", "torch.utils._pytree", level=logging.ERROR):
        from lightship.quantize.qat import quantize_aware_train
    return quantize_aware_train


def _check_qat_can_load(run: RunDir, checkpoint: dict[str, Any]) -> None:
    """QAT builds best.ckpt's model in torch: a user model whose module this process cannot
    import (run without its PYTHONPATH), or a best.ckpt that is not the one trained (cut
    short, replaced), is said now, not as a warning after static and dynamic, exit 0."""
    from lightship.models import resolve  # torch: QAT imports it anyway

    ckpt = run.require_checkpoint()
    run.check_checkpoint(checkpoint, stage="quantize")
    spec = checkpoint.get("model") or {}
    if isinstance(spec, dict) and ":" in str(spec.get("name", "")):
        try:
            resolve(str(spec["name"]), spec.get("module_file"))
        except ConfigError as exc:
            raise RunError(f"checkpoint {ckpt}: {exc}") from None


class Quantizer:
    """One quantization session over a run: shared inputs for every method."""

    def __init__(
        self,
        run: RunDir,
        target: str,
        settings: QuantizeSettings,
        methods: Sequence[str] = METHODS,
    ) -> None:
        self.run = run
        self.settings = settings
        self.methods = list(methods)
        self.repeat = _repeat_flags(target, settings)  # for a command that quantizes again
        self.fp32 = run.export_dir / "model.onnx"
        if not run.root.is_dir():
            raise RunError(
                f"run directory {run.root} does not exist: run {run.command('train', 'export')}"
                f"{check_the_name(run.root)}"
            )
        checkpoint = run.artifact("checkpoint")
        if checkpoint is None:  # its data spec says which images to calibrate and test on
            raise run.unrecorded("export", "quantize")
        entry = run.artifact("onnx-fp32")
        if entry is None or not self.fp32.is_file():
            raise RunError(
                f"no exported ONNX model in {run.root}: run {run.command('export')} first"
            )
        check_recorded(
            self.fp32,
            entry,
            f"it changed after `lightship export` wrote it; re-run {run.command('export')}",
        )
        self.fp32_entry = entry
        try:
            self.target = isa.resolve_target(target)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        cpu_only = [m for m in self.methods if m != "static"]
        if self.target == "tensorrt" and cpu_only:
            # dynamic int8 is ConvInteger, which TensorRT does not run; QAT's activations are
            # asymmetric uint8 (X86InductorQuantizer), not the S8S8 TensorRT takes
            raise ConfigError(
                f"--target tensorrt makes static int8 only ({', '.join(cpu_only)} int8 would be "
                "a CPU model labelled for TensorRT): quantize with "
                f"`{_command(run, 'quantize', ['static'], self.repeat)}`"
            )
        self.scheme = isa.SCHEMES[self.target]
        if "qat" in methods:  # QAT fine-tunes best.ckpt: said before any method runs
            try:
                _check_qat_can_load(run, checkpoint)
            except RunError as exc:
                others = ",".join(m for m in methods if m != "qat")
                if not others:
                    raise
                raise RunError(f"{exc}, or quantize without QAT: --methods {others}") from None
        _check_room(run, qat="qat" in methods)
        # before its work folder goes into the run: a read-only run is this one line
        check_writable(run.manifest_path)
        self.cpu = isa.host_cpu()
        if isa.compatibility(self.target, self.cpu) is not None:
            log.warning(
                "quantizing for %s on %s, which computes such a model differently: the "
                "accuracies quantize gates on and the speeds it measures are this CPU's, not "
                "those of the machine it is for",
                self.target,
                self.cpu.describe(),
            )
        self.splits = load_splits(DataSpec.from_dict(run.data_spec()), recorded=True)
        spec = entry.get("input_spec")
        self.input_name = str(spec.get("name", "input") if isinstance(spec, dict) else "input")
        fp32 = load_predictor(self.fp32, split=False)  # unsplit: see `_accuracy`
        other = other_input(fp32, checkpoint)
        if other is not None:  # another model's file: its first batch would fail deep in ORT
            raise RunError(
                f"{self.fp32} is not this run's model ({other}): {run.remake_hint('onnx-fp32')}"
            )
        source = entry.get("source_checkpoint_sha256")
        if source and source != checkpoint.get("sha256"):  # its accuracy is another model's
            raise RunError(
                f"{self.fp32} was exported from another checkpoint than the run's best.ckpt: "
                f"re-run {run.command('export')}"
            )
        self.fp32_acc, self.fp32_logits = _accuracy(fp32, self.splits.test_x, self.splits.test_y)
        check_as_trained(checkpoint, self.splits.test_y, self.fp32_acc, "the ONNX model")
        self.work = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIXES["quantize"], dir=run.root))
        try:
            self.pre = ptq.preprocess(self.fp32, self.work / "pre.onnx")
            # what static int8 quantizes (and the fallback compares against): see its docstring
            self.pre_static = self.work / "pre-static.onnx"
            self.flattens_channels_last = ptq.flatten_channels_last(self.pre, self.pre_static)
        except BaseException:
            self.close()
            raise
        self.cache = self.work / f"calibration.{settings.calibration_method}.json"
        self.calibration: dict[str, Any] = {}

    @cached_property
    def calib(self) -> np.ndarray:
        """The calibration images, taken when static int8 first needs them: dynamic and QAT
        calibrate nothing, so `--calibration-samples` means nothing to them."""
        s = self.settings
        return calibration_images(self.splits, s.calibration_samples, s.seed)

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)

    @cached_property
    def fp32_val_acc(self) -> float:
        """fp32's accuracy on the validation split, which the choices made while quantizing
        are judged on (`_gate(..., "validation")`), so that the test split's accuracy, which
        the manifest and the report state, decided nothing."""
        return self._val_accuracy(self.fp32)

    def _val_accuracy(self, model: Path | Predictor) -> float:
        return _accuracy(model, self.splits.val_x, self.splits.val_y)[0]

    def _gate(self, accuracy: float, split: Literal["test", "validation"] = "test") -> bool:
        """Whether `accuracy`, measured on `split`, passes the gate against fp32's on it."""
        if split == "validation":
            fp32, images = self.fp32_val_acc, len(self.splits.val_y)
        else:
            fp32, images = self.fp32_acc, len(self.splits.test_y)
        return fallback.passes_gate(accuracy, fp32, self.settings.gate, images)

    def _static(self, out: Path, scheme: isa.Scheme, exclude: Sequence[str]) -> None:
        s = self.settings
        first = not self.cache.exists()
        if first:
            # where VmHWM cannot be reset, the peak is the process's whole life's: not recorded
            measured_rss = _reset_peak_rss()
            t0 = time.perf_counter()
        ptq.quantize_static_onnx(
            self.pre_static,
            out,
            self.calib,
            scheme,
            input_name=self.input_name,
            method=s.calibration_method,
            per_channel=s.per_channel,
            nodes_to_exclude=exclude,
            cache=self.cache,
            chunk=s.calibration_chunk,
        )
        if first:
            self.calibration = {
                "samples": len(self.calib),
                "method": s.calibration_method,
                # the most one pass of the calibrator held: whole batches of 32 a pass
                "chunk": max(
                    stop - start
                    for start, stop in ptq.calibration_calls(
                        len(self.calib), chunk=s.calibration_chunk
                    )
                ),
                "seconds": round(time.perf_counter() - t0, 2),
                # the process's peak while it calibrated, the libraries and data loaded too
                "peak_rss_mib": _peak_rss_mib() if measured_rss else None,
            }

    def _scheme_error(self, path: Path) -> dict[str, float]:
        acc, out = _accuracy(path, self.splits.test_x, self.splits.test_y)
        return {
            "accuracy": acc,
            "max_abs_diff": float(np.abs(out - self.fp32_logits).max()),
            "argmax_agreement": float(np.mean(out.argmax(1) == self.fp32_logits.argmax(1))),
            "sqnr_db": fallback.sqnr_db(self.fp32_logits, out),
        }

    def static(self) -> Variant:
        t0 = time.perf_counter()
        s = self.settings
        exclude: list[str] = []
        fallback_nodes: list[dict[str, Any]] = []
        final = self.run.quantize_dir / FILENAMES["static"]
        # Everything the entry records, the other scheme's error included, is measured before
        # the file is renamed into place, and recorded with stop signals held from the rename
        # (`then_held`): an interrupt in between would leave a model its manifest entry does not
        # describe, which the report refuses.
        with then_held() as then, atomic_path(final) as tmp, made_here("static", tmp, self.work):
            # Every choice below is made on the validation split; the test split only measures
            # the model they made.
            best = (-1.0, 0, 0)  # the most accurate round's accuracy, fallback nodes, exclude
            for round_ in range(s.fallback_budget + 1):
                self._static(tmp, self.scheme, exclude)
                val_acc = self._val_accuracy(tmp)
                log.info(
                    "static int8 round %d: validation accuracy %.4f (fp32 %.4f)",
                    round_,
                    val_acc,
                    self.fp32_val_acc,
                )
                if val_acc > best[0]:  # a tie keeps the earlier round: fewer nodes in fp32
                    best = (val_acc, len(fallback_nodes), len(exclude))
                if self._gate(val_acc, "validation") or round_ == s.fallback_budget:
                    break
                ranked = fallback.rank_nodes(
                    self.pre_static, tmp, self.calib[:64], self.input_name, frozenset(exclude)
                )
                if not ranked:
                    break
                worst = ranked[0]
                island = ptq.fp32_island(self.pre_static, worst.node)
                log.info("gate failed: keeping %s in fp32 (%s)", island, worst.as_dict())
                exclude.extend(n for n in island if n not in exclude)
                fallback_nodes.append(
                    {
                        **worst.as_dict(),
                        "island": island,
                        "accuracy_before": val_acc,
                        "accuracy_split": "validation",
                    }
                )
            if best[1] < len(fallback_nodes):
                # Failed the gate, and the last rounds' fp32 islands gained nothing over an
                # earlier round's model: they would only slow it down.
                log.info(
                    "the fallback's last %d round(s) gained no validation accuracy over %.4f: "
                    "their %d node(s) go back to int8",
                    len(fallback_nodes) - best[1],
                    best[0],
                    len(exclude) - best[2],
                )
                # both only grew, round by round: that round's are their first entries
                fallback_nodes, exclude = fallback_nodes[: best[1]], exclude[: best[2]]
                self._static(tmp, self.scheme, exclude)
                val_acc = best[0]
            speed = self._first_conv_in_fp32(tmp, exclude, val_acc)
            if speed is not None and speed["kept"]:
                exclude.extend(speed["island"])
                val_acc = speed["accuracy"]
            gemm = self._gemm_convs(tmp, val_acc)
            meta = self._meta("static")
            if exclude:
                meta[DISABLED_OPTIMIZERS] = "QDQPropagationTransformer"
            if gemm is not None and gemm["kept"]:
                meta[SPIN_IN_RUN] = "1"
            ptq.copy_metadata(self.fp32, tmp, meta)
            chosen = self._scheme_error(tmp)
            acc = chosen["accuracy"]  # on the test split: the model as it is written
            self._warn_clipped(chosen)
            scales = ptq.scales_digest(tmp)
            share = int8_share(tmp)
            seconds = time.perf_counter() - t0
            entry = {
                **self._entry(tmp, final, "static", acc),
                "per_channel": s.per_channel,
                "flattens_channels_last": self.flattens_channels_last,
                "calibration": {**self.calibration, "scales_sha256": scales},
                "nodes_fp32_by_fallback": fallback_nodes,
                "first_conv_fp32": speed,
                "gemm_convs": gemm,
                "int8_ops": share,
                "scheme_check": {"chosen": {"target": self.target, **chosen}},
                "quantize_seconds": round(seconds, 2),
            }
            alt = "vnni" if self.scheme.reduce_range else "avx2"
            with tempfile.TemporaryDirectory(dir=self.work) as tmpdir:
                alt_path = Path(tmpdir) / "alt.onnx"
                self._static(alt_path, isa.SCHEMES[alt], exclude)
                if exclude:  # run as the chosen model runs, so that only the scheme differs
                    ptq.copy_metadata(
                        self.fp32, alt_path, {DISABLED_OPTIMIZERS: meta[DISABLED_OPTIMIZERS]}
                    )
                entry["scheme_check"]["alternative"] = {
                    "target": alt,
                    **self._scheme_error(alt_path),
                }
            then(self._record, "static", entry)
        return Variant("static", final, acc, self._gate(acc), entry)

    def _warn_clipped(self, chosen: dict[str, float]) -> None:
        """A calibration that clips activations (entropy, percentile) can leave a model far
        from fp32 that the accuracy gate, on a few hundred images, lets through: entropy's
        int8 digits, 3.6 dB SQNR and 4 answers changed, passed on validation (minmax: 50 dB,
        none changed). Said, with the default to try."""
        method = self.settings.calibration_method
        if method == "minmax" or chosen["sqnr_db"] >= LOW_SQNR_DB:
            return
        n = len(self.splits.test_y)
        changed = round((1 - chosen["argmax_agreement"]) * n)
        log.warning(
            "static int8 with %s calibration: its logits are %.1f dB SQNR from fp32's on the "
            "test images, %d of %d answers changed; %s calibration clips activations, and the "
            "accuracy gate may let such a model through: compare --calibration-method minmax "
            "(the default, no clipping)",
            method,
            chosen["sqnr_db"],
            changed,
            n,
            method,
        )

    def _first_conv_in_fp32(
        self, current: Path, exclude: list[str], val_acc: float
    ) -> dict[str, Any] | None:
        """Keep a thin first conv in fp32 if that measures faster here (and passes the gate).

        Kept when it is > 5 % faster at batch 64, passes the gate, and is as accurate as the
        all-int8 model (`val_acc`) or as fp32, whichever is lower, all on the validation split:
        an all-int8 model that happens to beat fp32 by an image (the tiny model, on an AVX-512
        Xeon) must not veto a model 1.5x faster that scores as fp32 does. Replaces `current`
        with that model when it is kept; None when the model has no thin first conv
        (`ptq.thin_first_conv`).
        """
        island = [n for n in ptq.thin_first_conv(self.pre_static) if n not in exclude]
        if not island:
            return None
        candidate = self.work / "first-conv-fp32.onnx"
        self._static(candidate, self.scheme, [*exclude, *island])
        # timed as it would be served: with the metadata that keeps its fp32 pool fast
        ptq.copy_metadata(self.fp32, candidate, {DISABLED_OPTIMIZERS: "QDQPropagationTransformer"})
        model = load_predictor(candidate, isa_check=False)
        cand_acc = self._val_accuracy(model)
        before, after = self._time_candidate(
            "int8-static's first conv in fp32",
            load_predictor(current, isa_check=False),
            model,
            latency=False,
        )
        all_int8, first_fp32 = before.throughput_per_s, after.throughput_per_s
        gain = after.speedup_over(before)
        # the first rule this candidate breaks; "" when it is kept (the log said "not kept"
        # alone, of a model 1.29x faster that failed the gate)
        if not self._gate(cand_acc, "validation"):
            not_kept = f"validation accuracy {cand_acc:.4f} fails the gate"
        elif cand_acc < (floor := min(val_acc, self.fp32_val_acc)):
            not_kept = f"validation accuracy {cand_acc:.4f} against {floor:.4f}"
        elif gain <= AB_MIN_GAIN:
            not_kept = f"{gain:.3f}x is not over {AB_MIN_GAIN:g}x"
        else:
            not_kept = ""
        kept = not not_kept
        _settle(candidate, current, kept)
        log.info(
            "int8-static's first conv in fp32: %.0f img/s against %.0f all-int8 at batch 64, "
            "%.3fx within rounds (%d): %s",
            first_fp32,
            all_int8,
            gain,
            len(after.throughput),
            "kept" if kept else f"not kept ({not_kept})",
        )
        return {
            "island": island,
            "batch": AB_BATCH,
            "img_per_s": {"all_int8": round(all_int8, 1), "first_conv_fp32": round(first_fp32, 1)},
            "speedup": round(gain, 3),  # the median of the within-round ratios
            "speedup_bounds": [round(b, 3) for b in after.speedup_bounds(before)],
            "rounds": len(after.throughput),
            "accuracy": cand_acc,
            "accuracy_all_int8": val_acc,
            "accuracy_fp32": self.fp32_val_acc,
            "accuracy_split": "validation",  # what the choice was made on
            "kept": kept,
        }

    def _time_candidate(
        self, step: str, current: Predictor, candidate: Predictor, latency: bool
    ) -> tuple[Timing, Timing]:
        """`current` and `candidate` timed interleaved on the validation images, where quantize
        makes its choices, at batch `AB_BATCH` (and batch 1 with `latency`): the A/B of every
        `step` that keeps a candidate model only where it measures faster here. AB_ROUNDS
        rounds, and AB_ROUNDS more while the speed-up may lie either side of AB_MIN_GAIN, up
        to AB_MAX_ROUNDS: a gain near the bar is measured until it is clear. Timings too
        noisy to trust (`Timing.noise`, as the report judges its own: the CPU other processes
        used, the spread of the rounds) are a warning: the machine was busy or its speed moved
        (`noise_cause` says which), and the choice may be wrong."""
        before, after = Timing(), Timing()
        while True:
            timings = measure(
                {"current": current, "candidate": candidate},
                self.splits.val_x,
                rounds=AB_ROUNDS,
                batch=AB_BATCH,
                seconds=0.05,
                warmup=1,
                latency=latency,
            )
            before.extend(timings["current"])
            after.extend(timings["candidate"])
            low, high = after.speedup_bounds(before)
            if not low <= AB_MIN_GAIN <= high or len(before.throughput) >= AB_MAX_ROUNDS:
                break
            log.debug(
                "%s: %.3fx to %.3fx after %d rounds, either side of %gx: timing %d more",
                step,
                low,
                high,
                len(before.throughput),
                AB_MIN_GAIN,
                AB_ROUNDS,
            )
        # what the choice rests on: the within-round speed-up, and batch-1 p50s
        noise = [
            *(f"current {n}" for n in before.noise(own_rounds=False)),
            *(f"candidate {n}" for n in after.noise(before, "current", own_rounds=False)),
        ]
        if noise:
            log.warning(
                "%s: timings are noisy (%s): %s. %s, so whether it is kept may be wrong: "
                "quantize again when it is quiet (%s)",
                step,
                NOISE_RULE,
                ", ".join(noise),
                noise_cause([before, after], "quantize timed it"),
                f"`{_command(self.run, 'quantize', self.methods, self.repeat)}`",  # as asked
            )
        return before, after

    def _gemm_convs(
        self, current: Path, val_acc: float, method: str = "static"
    ) -> dict[str, Any] | None:
        """Send the deep convs to ORT's AMX GEMM (`ptq.route_convs_to_gemm`) if that measures
        faster here, with the model's threads spinning inside each run, which it needs.

        Tried only on an AMX CPU for the vnni scheme. Kept when > 5 % faster at batch 64, no
        slower at batch 1 and as accurate on the validation split as `current` (`val_acc`: the
        rewrite is exact), and, where short batches run on a multi-thread session whose threads
        would spin, when its batch-1 run takes at least `SPIN_MIN_RUN_MS`: spinning made the
        digits model (0.1 ms) 30 % slower served one request at a time. Replaces `current` when
        kept; None when not tried.
        """
        if self.target != "vnni" or "amx_int8" not in self.cpu.flags:
            return None
        candidate = self.work / "gemm-convs.onnx"
        routed = ptq.route_convs_to_gemm(current, candidate, ptq.GEMM_CONV_MIN_K)
        if not routed:
            candidate.unlink()
            return None
        ptq.copy_metadata(current, candidate, {SPIN_IN_RUN: "1"})
        routed_model = load_predictor(candidate, isa_check=False)
        assert isinstance(routed_model, OrtPredictor)  # an .onnx file
        short_threads = routed_model.short_batch_threads
        direct, gemm = self._time_candidate(
            f"int8-{method}'s deep convs on ORT's GEMM",
            load_predictor(current, isa_check=False),
            routed_model,
            latency=True,
        )
        run_ms, gemm_ms = direct.summary()["p50"], gemm.summary()["p50"]
        cand_acc = self._val_accuracy(routed_model)
        gain = gemm.speedup_over(direct)
        # the first rule this candidate breaks; "" when it is kept
        if run_ms < SPIN_MIN_RUN_MS and short_threads > 1:
            not_kept = (
                f"a batch-1 run takes {run_ms:.3f} ms, under {SPIN_MIN_RUN_MS} ms, on "
                f"{short_threads} threads that would spin"
            )
        elif gain <= AB_MIN_GAIN:
            not_kept = f"{gain:.3f}x is not over {AB_MIN_GAIN:g}x"
        elif gemm_ms > run_ms:
            not_kept = f"slower at batch 1: {gemm_ms:.3f} against {run_ms:.3f} ms"
        elif cand_acc != val_acc:
            not_kept = f"validation accuracy {cand_acc:.4f} against {val_acc:.4f}"
        else:
            not_kept = ""
        kept = not not_kept
        _settle(candidate, current, kept)
        log.info(
            "int8-%s's deep convs on ORT's GEMM: %.0f img/s against %.0f direct at batch 64, "
            "%.3fx within rounds (%d): %s",
            method,
            gemm.throughput_per_s,
            direct.throughput_per_s,
            gain,
            len(gemm.throughput),
            "kept" if kept else f"not kept ({not_kept})",
        )
        return {
            "convs": routed,
            "batch1_p50_ms": {"direct": round(run_ms, 4), "gemm": round(gemm_ms, 4)},
            "short_batch_threads": short_threads,
            "img_per_s": {
                "direct": round(direct.throughput_per_s, 1),
                "gemm": round(gemm.throughput_per_s, 1),
            },
            "speedup": round(gain, 3),
            "speedup_bounds": [round(b, 3) for b in gemm.speedup_bounds(direct)],
            "rounds": len(gemm.throughput),
            "accuracy": cand_acc,
            "accuracy_split": "validation",
            "kept": kept,
            **({"not_kept": not_kept} if not_kept else {}),
        }

    def dynamic(self) -> Variant:
        t0 = time.perf_counter()
        final = self.run.quantize_dir / FILENAMES["dynamic"]
        flops = ptq.flop_share(self.pre)
        suits = flops["matmul"] >= 0.5
        conv_heavy = flops["conv"] > 0.5
        with then_held() as then, atomic_path(final) as tmp, made_here("dynamic", tmp):
            weights = ptq.quantize_dynamic_onnx(self.pre, tmp, self.scheme, conv_heavy=conv_heavy)
            ptq.copy_metadata(self.fp32, tmp, self._meta("dynamic"))
            acc, _ = _accuracy(tmp, self.splits.test_x, self.splits.test_y)
            made = self._entry(tmp, final, "dynamic", acc)
            entry = {
                **made,
                # what the file holds: uint8 weights for a conv net on every target, and
                # activations quantized to uint8 as it runs (DynamicQuantizeLinear); and why
                # (it said the static scheme's why of int8 weights beside uint8 ones)
                "scheme": {
                    **made["scheme"],
                    "weight_type": weights,
                    "activation_type": "QUInt8",
                    "why": ptq.dynamic_weights(self.scheme, conv_heavy)[1],
                },
                "flop_share": flops,
                "int8_ops": int8_share(tmp),
                "recommendable": suits,
                "why": (
                    "most multiply-adds are in MatMul/Gemm: dynamic quantization suits it"
                    if suits
                    else f"{_share(flops['conv'])} of multiply-adds are in convolutions: dynamic "
                    "quantization (ConvInteger) was measured slower than fp32 on conv nets; "
                    "reported, not recommended"
                ),
                "quantize_seconds": round(time.perf_counter() - t0, 2),
            }
            then(self._record, "dynamic", entry)
        return Variant("dynamic", final, acc, self._gate(acc), entry)

    def qat(self) -> Variant:
        quantize_aware_train = _import_qat()

        s = self.settings
        final = self.run.quantize_dir / FILENAMES["qat"]
        recorded = self.run.artifact("checkpoint")
        # a damaged or replaced best.ckpt says how to get it back, as export says it (export
        # again would refuse it). This method's failure, not the run's: the other methods are
        # still made. That model.onnx was exported from the recorded best.ckpt, which QAT
        # fine-tunes and is gated against, the Quantizer checked as it started.
        if recorded and self.run.best_ckpt.is_file():
            try:
                self.run.check_checkpoint(recorded, stage="quantize")
            except RunError as exc:
                raise QuantizeError(str(exc)) from None
        # the model is measured before it is renamed into place (see `static`), together with
        # the checkpoint it was converted from: a new qat.ckpt never lands beside the old model
        with (
            then_held() as then,
            atomic_paths(self.run.quantize_dir / QAT_CKPT, final) as (tmp_ckpt, tmp),
            made_here("qat", tmp, self.work),
        ):
            try:
                info = quantize_aware_train(
                    self.run,
                    self.scheme,
                    tmp,
                    tmp_ckpt,
                    epochs=s.qat_epochs,
                    lr=s.qat_lr,
                    seed=s.seed,
                    per_channel=s.per_channel,
                )
            except (LightshipError, KeyboardInterrupt):
                raise  # a mistake the user can fix (no best.ckpt, unreadable data) says its fix
            except Exception as exc:  # a library failure inside QAT must not cost the others
                log.debug("QAT failed", exc_info=True)
                raise MethodFailed(
                    "qat",
                    f"{type(exc).__name__}: {first_line(exc)}; `--verbose` shows where",
                    "quantize this model with `--methods static,dynamic` instead",
                ) from None
            gemm = self._gemm_convs(tmp, self._val_accuracy(tmp), "qat")
            acc, _ = _accuracy(tmp, self.splits.test_x, self.splits.test_y)
            entry = {
                **self._entry(tmp, final, "qat", acc),
                **info,
                "gemm_convs": gemm,
                "int8_ops": int8_share(tmp),
            }
            then(self._record, "qat", entry)
        return Variant("qat", final, acc, self._gate(acc), entry)

    def _record(self, method: str, entry: dict[str, Any]) -> None:
        """Record `method`'s variant; a warning where it fails the gate and the model it
        replaces passed, with the command that made that one (a calibration method tried and
        found worse must not lose the good model without a word)."""
        name = f"onnx-int8-{method}"
        old = self.run.artifact(name) or {}
        if (old.get("gate") or {}).get("passed") and not entry["gate"]["passed"]:
            flags = old.get("flags")
            again = (
                f"quantize again as it was made to get it back: "
                f"{_command(self.run, 'quantize', [method], flags)}"
                if isinstance(flags, list) and all(isinstance(f, str) for f in flags)
                else "quantize again with the settings that made it to get it back"
            )
            was, now = (old.get("gate") or {}).get("min_ratio"), entry["gate"]["min_ratio"]
            # the same accuracy under a stricter --gate read as a worse model: say the gate
            moved = isinstance(was, (int, float)) and was != now
            log.warning(
                "%s fails the gate (test accuracy %.4f) where the model it replaces passed "
                "(%.4f%s): %s",
                name,
                entry["accuracy"],
                old.get("accuracy", float("nan")),
                f"; the gate was {was:g}, now {now:g}" if moved else "",
                again,
            )
        self.run.record(name, entry)

    def _meta(self, method: str) -> dict[str, str]:
        return {
            QUANTIZATION: method,
            TARGET: self.target,
            "lightship.reduce_range": str(self.scheme.reduce_range).lower(),
        }

    def _entry(self, written: Path, final: Path, method: str, acc: float) -> dict[str, Any]:
        """The manifest entry of `final`, whose content is `written` (its temporary file, or
        itself once renamed)."""
        return {
            "file": self.run.relative(final),
            "format": "onnx",
            "quantization": method,
            "sha256": sha256_file(written),
            "bytes": written.stat().st_size,
            "input_spec": self.fp32_entry["input_spec"],
            "labels": self.fp32_entry["labels"],
            "source_sha256": self.fp32_entry["sha256"],
            "target": self.target,
            "scheme": self.scheme.as_dict(),
            "cpu": self.cpu.as_dict(),
            "accuracy": acc,
            "fp32_accuracy": self.fp32_acc,
            "gate": {"min_ratio": self.settings.gate, "passed": self._gate(acc)},
            "flags": self.repeat,  # the options that make it again
            "versions": {"lightship": __version__, "onnxruntime": ort.__version__},
            # export found the fp32 model's logits moving with its batch: quantized, it still
            # computes the same batch statistics, and `serve` warns of it from this entry
            **{k: v for k, v in self.fp32_entry.items() if k == "batch_dependent"},
        }


@contextlib.contextmanager
def _noted_when_stopped(
    run: RunDir, chosen: Sequence[str], repeat: Sequence[str] = ()
) -> Iterator[None]:
    """Stopped (Ctrl-C, SIGTERM), the CLI's last line says which of the `chosen` methods were
    made and kept (a variant is kept once its entry is recorded: `then_held`), the command
    that makes the rest (with the options of this one, `repeat`) and, where a replaced
    variant took the report with it
    (`RunDir.record`), that the report must be written again."""

    def variants() -> dict[str, Any]:
        return {m: run.artifact(f"onnx-int8-{m}") for m in chosen}

    report = run.root / REPORT_FILES[0]
    before, had_report = variants(), report.is_file()
    try:
        yield
    except KeyboardInterrupt:
        with contextlib.suppress(LightshipError, OSError):  # else a bare "interrupted"
            after = variants()
            made = [m for m in chosen if after[m] is not None and after[m] != before[m]]
            rest = [m for m in chosen if m not in made]
            notes = [f"{', '.join(made)} made and kept"] if made else []
            if rest:
                again = "make the rest with" if made else "quantize again with"
                notes.append(f"{again} `{_command(run, 'quantize', rest, repeat)}`")
            if had_report and not report.is_file():
                notes.append(
                    f"{run.report_dir} went with the variants it measured: write it again "
                    f"with `{_command(run, 'report')}`"
                )
            note_interrupt("; ".join(notes))
        raise


def _command(
    run: RunDir, stage: str, methods: Sequence[str] = (), flags: Sequence[str] = ()
) -> str:
    """`stage` on `run` as a command that runs from here, with the PYTHONPATH its model's
    module needs (QAT and the report import it); for quantize, `methods` when they are not
    all of them, and `flags`."""
    return stage_on(run.root, stage, run.pythonpath(), "methods", methods, METHODS, flags)


def _repeat_flags(target: str, settings: QuantizeSettings) -> list[str]:
    """The options a quantize was given that a command repeating it must give again."""
    return [*(["--target", target] if target != "auto" else []), *settings.flags()]


def quantize(
    run: RunLike,
    methods: Sequence[str] | str | None = None,
    target: str = "auto",
    settings: QuantizeSettings | None = None,
    on_error: Callable[[str, LightshipError], None] | None = None,
) -> list[Variant]:
    """Make every requested int8 variant; a method that cannot handle the model is reported
    through `on_error` (default: logged) and the others are still produced. Without
    `on_error`, a quantize that made none raises: the one method's error, or a QuantizeError
    naming them all (a script would otherwise go on as if it had quantized)."""
    run = as_run(run)
    chosen = parse_methods(methods)
    settings = QuantizeSettings() if settings is None else settings  # `{}` is no settings
    check_settings(settings, QuantizeSettings, "quantize")
    if settings.calibration_method not in ptq.CALIBRATION_METHODS:
        raise ConfigError(
            f"unknown calibration method '{settings.calibration_method}': "
            f"choose from {', '.join(ptq.CALIBRATION_METHODS)}"
        )
    if "static" in chosen and settings.calibration_samples <= 0:
        raise ConfigError(
            "empty calibration set: --calibration-samples must be positive (default 256)"
        )
    variants: list[Variant] = []
    failed: dict[str, QuantizeError] = {}
    # The run lock, for the CLI and a call from Python alike: no other stage may see these
    # writes half done, and lock_run deletes the scratch folders a killed quantize left
    # (`runs.sweep_temporaries`)
    with (
        lock_run(run.root, "lightship quantize"),
        caller_state_kept(),
        _cut_short_by_a_full_disk(run, "qat" in chosen),
        _noted_when_stopped(run, chosen, _repeat_flags(target, settings)),
    ):
        q = Quantizer(run, target, settings, chosen)
        try:
            check_writable(*(run.quantize_dir / FILENAMES[m] for m in chosen))
            for method in chosen:
                try:
                    variants.append(getattr(q, method)())
                except QuantizeError as exc:
                    if isinstance(exc, Unloadable):  # cut short by a full disk: it says so
                        _check_room(run, qat="qat" in chosen)
                    failed[method] = exc
                    if on_error is None:
                        log.error("%s: %s", method, exc)
                    else:
                        on_error(method, exc)
        finally:
            q.close()
    if on_error is None and failed and not variants:
        if len(failed) == 1:
            raise next(iter(failed.values()))
        raise QuantizeError(
            f"no int8 variant was made: {', '.join(failed)} failed (logged above); fix that or "
            "choose other methods"
        )
    return variants
