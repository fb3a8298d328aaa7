"""Which artifact to serve, checked before it is loaded: variant, report, sha256, CPU ISA.

Reads only files (manifest.json, report/report.json): serving never imports the stage code.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightship.errors import ConfigError, RunError
from lightship.quantize.isa import CpuInfo, compatibility, host_cpu, requantize_in_its_run
from lightship.runs import (
    IN_AN_IMAGE,
    RunDir,
    check_recorded,
    check_the_name,
    enclosing_run,
    export_hint,
    make_elsewhere,
    run_of_folder,
    variant_of,
)
from lightship.runtime import Predictor, load_predictor
from lightship.runtime.base import LoadError
from lightship.runtime.ort import TARGET, file_metadata
from lightship.serve.settings import MODEL_NAME, ServeSettings

log = logging.getLogger(__name__)

DEFAULT_VARIANT = "onnx-fp32"
# What `--variant` names (besides auto): the manifest's keys. The checkpoint is the report's
# "eager" row.
VARIANTS = (
    "onnx-fp32",
    "onnx-int8-static",
    "onnx-int8-dynamic",
    "onnx-int8-qat",
    "torchscript",
    "pt2",
    "checkpoint",
)
MODEL_SUFFIXES = (".onnx", ".ts", ".pt2", ".ckpt")
# What the stages write in a run directory: a folder holding none of it is no run.
RUN_CONTENTS = ("manifest.json", "best.ckpt", "export", "quantize", "report")


@dataclass(frozen=True)
class ServedModel:
    """The artifact chosen for serving and what the manifest says about it."""

    name: str
    variant: str  # manifest key; "file" for a lone file without a manifest entry
    path: Path
    entry: dict[str, Any] | None
    chosen_by: str = ""  # why `--variant auto` chose `variant`, for the log; "" when named

    def load(
        self, device: str = "cpu", threads: int | None = None, split: bool = True
    ) -> Predictor:
        # `verify` checked the CPU it was quantized for, by the --isa-check policy
        try:
            predictor = load_predictor(
                self.path, device=device, threads=threads, split=split, isa_check=False
            )
        except LoadError as exc:  # its fix knows no run: "make it again (`lightship export`"
            root = enclosing_run(self.path) if self.entry is not None else None
            if root is None:
                raise
            variant = variant_of(self.path.resolve()) if self.variant == "file" else self.variant
            raise exc.with_fix(RunDir(root).remake_hint(variant)) from None
        log.info(
            "loaded %s (%s) from %s on %s%s",
            self.name,
            self.variant,
            self.path,
            device,
            f"; batches of {predictor.split_rows}+ rows split over {predictor.lanes} "
            "one-thread sessions"
            if predictor.lanes > 1
            else "",
        )
        return predictor


def recommended_variant(run: RunDir, artifacts: dict[str, Any]) -> str:
    """The report's recommendation, or onnx-fp32 when there is no report yet. RunError when it
    recommends nothing (saying why, where it left variants out), or a variant that the
    manifest's `artifacts` no longer list or list made again since; a warning when it only
    predates other variants."""
    path = run.report_dir / "report.json"
    if not path.exists():  # a folder in its place is unreadable below, not no report
        if any(name.startswith("onnx-int8-") for name in artifacts):
            log.warning(
                "%s has int8 variants but no report to choose between them: serving %s; "
                "%s measures them and recommends one",
                run.root,
                DEFAULT_VARIANT,
                run.command("report"),
            )
        return DEFAULT_VARIANT
    try:
        report = json.loads(path.read_text())
        recommended = report.get("recommended")
        if "variants" not in report:  # `{}`: not "older than" every variant, as it was called
            raise ValueError("it lists no measured variants")
        # a report older than its sha256 (None) tells a file by its name and size alone
        measured = {(str(v["file"]), v["bytes"], v.get("sha256")) for v in report["variants"]}
        left_out = report.get("not_measured")  # why each listed variant was not measured
        left_out = left_out if isinstance(left_out, dict) else {}
        left_as = report.get("not_measured_files")  # their files' sha256 as left out
        left_as = left_as if isinstance(left_as, dict) else {}
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as exc:
        raise RunError(
            f"{path} is unreadable ({exc}): re-run {run.command('report')} "
            "or serve an explicit --variant"
        ) from None
    report = run.command("report")
    cli = f"{run.pythonpath()}lightship report --run {shlex.quote(str(run.root))}"
    # beside make's target, as a next: line has it (not from another folder: `make -C`, where
    # the run's path is the checkout's)
    if report != f"`{cli}`" and not make_elsewhere():
        report += f" (or `{cli}`)"
    fix = f"re-run {report}, or serve without it: --variant {DEFAULT_VARIANT}"
    # Recorded after the report: no variant it measured had their file, size and sha256 (a
    # file made again to the same size was taken for the one measured). (A file that differs
    # from its manifest entry is for `verify` to say.)
    unmeasured = [  # (a listed file that is gone cannot be measured, nor served)
        name
        for name, entry in artifacts.items()
        if "bytes" in entry
        and not {
            (str(entry.get("file")), entry["bytes"], entry.get("sha256")),
            (str(entry.get("file")), entry["bytes"], None),
        }
        & measured
        and (run.root / str(entry.get("file"))).is_file()
    ]
    # Left out by the report (its file gone, changed, or unloadable), and its file as it was
    # then: not made since, and re-running the report, as said, changes nothing. Its file made
    # again (restored, or remade, even to the same bytes) is made since. By the file's sha256,
    # not by mtimes, which `cp -r` reorders; a report without them (older) names none.
    left_out = {
        name: why
        for name, why in left_out.items()
        if name in artifacts and name in left_as and left_as[name] == run.file_sha256(name)
    }
    unmeasured = [name for name in unmeasured if name not in left_out]
    if not isinstance(recommended, str) or not recommended:
        if unmeasured:
            raise RunError(
                f"{path} recommends no variant, but it is older than {', '.join(unmeasured)} "
                f"(made or replaced since): {fix}"
            )
        if left_out:
            name, why = next(iter(left_out.items()))
            raise RunError(
                f"{path} recommends no variant, having left out {', '.join(left_out)}: "
                f"{name}: {why}"
            )
        if DEFAULT_VARIANT not in artifacts:
            if not run.can_make():
                raise RunError(
                    f"{path} recommends no variant: {run.root} has none to serve yet, and no "
                    f"best.ckpt to make one from ({IN_AN_IMAGE}): "
                    f"{run.rebuild_hint(DEFAULT_VARIANT, 'report')}"
                )
            raise RunError(
                f"{path} recommends no variant: {run.root} has none to serve yet: run "
                f"{run.command('export')}, then {run.command('report')}"
            )
        raise RunError(
            f"{path} recommends no variant: each one it measured failed the accuracy gate or "
            f"is not one to recommend (see report.md): serve one with --variant, e.g. --variant "
            f"{DEFAULT_VARIANT}"
        )
    if recommended not in artifacts or recommended in unmeasured:
        why = (
            "which the manifest no longer lists"
            if recommended not in artifacts
            else "made again after it was measured"
        )
        raise RunError(f"{path} is out of date: it recommends {recommended}, {why}: {fix}")
    if unmeasured:
        log.warning(
            "%s is older than %s: serving its recommendation %s, which may no longer be the "
            "best; %s",
            path,
            ", ".join(unmeasured),
            recommended,
            fix,
        )
    return recommended


def _manifest_entry_for(path: Path) -> dict[str, Any] | None:
    """The manifest entry of a lone file that lies inside a run directory, if any. A
    manifest.json that is not lightship's (a web app's, beside its model: JSON with neither
    `schema` nor `artifacts`, or in a folder that is no run) is none: serving the file stopped
    on it, with the fix to delete it."""
    resolved = path.resolve()
    for root in (resolved.parent, resolved.parent.parent):
        listed = root / "manifest.json"
        if not (listed.is_file() or listed.is_symlink()):  # a link to nowhere: the run's, said
            continue
        run = RunDir(root)
        try:
            artifacts = run.manifest()["artifacts"]
        except RunError:
            if _foreign_manifest(run) or not any(
                (root / name).exists() for name in ("checkpoints", *RUN_CONTENTS[1:])
            ):
                log.debug("%s: not a lightship run's manifest, ignored", run.manifest_path)
                continue
            raise  # a run's own manifest, damaged: what it says to do stands
        for entry in artifacts.values():
            if (
                isinstance(entry, dict)
                and (root / str(entry.get("file", ""))).resolve() == resolved
            ):
                return dict(entry)
    return None


def _foreign_manifest(run: RunDir) -> bool:
    """Whether the run's manifest.json is JSON that no lightship wrote (an object with neither
    of its keys); one cut short or garbled may be the run's own."""
    try:
        data = json.loads(run.manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return not (isinstance(data, dict) and {"schema", "artifacts"} & data.keys())


def choose(settings: ServeSettings) -> ServedModel:
    """Resolve `settings.run` + `settings.variant` to one artifact; RunError if unusable."""
    target = settings.run
    if target.is_file():
        if target.suffix not in MODEL_SUFFIXES:
            inside = enclosing_run(target)
            raise RunError(
                f"{target}: cannot serve a {target.suffix or 'suffix-less'} file; give "
                + (f"its run, --run {inside}, or " if inside else "a run directory or ")
                + f"a model file ({', '.join(MODEL_SUFFIXES)})"
            )
        if settings.variant != "auto":
            log.warning("--variant %s ignored: serving the file %s", settings.variant, target)
        entry = _manifest_entry_for(target)
        name = settings.model_name or _safe_name(target.stem)
        return ServedModel(name, "file", target, entry)
    if not target.exists():
        raise RunError(_missing(target))
    if not target.is_dir():
        raise RunError(
            f"{target} is neither a run directory nor a model file: give --run (LIGHTSHIP_RUN) "
            f"a run directory or a model file ({', '.join(MODEL_SUFFIXES)})"
        )
    run = RunDir(target)
    trained = run.manifest_path.is_file() or run.best_ckpt.is_file()
    if not trained and run.checkpoints.is_dir():  # training stopped before its best checkpoint
        raise RunError(
            f"{target} has no best.ckpt yet: run {run.train_command()}, then "
            f"{run.command('export')}"
        )
    owner = run_of_folder(target)
    if owner is not None:
        raise RunError(
            f"{target} is run {owner}'s {Path(os.path.abspath(target)).name} folder: give --run "
            f"(LIGHTSHIP_RUN) the run, {owner}, or one model file in it"
        )
    if not any((target / name).exists() for name in RUN_CONTENTS):
        # e.g. the empty folder Docker mounts for a -v host path that does not exist
        raise RunError(
            f"{target} is not a lightship run (no manifest.json, no best.ckpt): mount or copy "
            f"a run directory there (one `lightship train` and `lightship export` made), or "
            f"train one there: {run.train_command()}"
        )
    artifacts = run.manifest()["artifacts"]
    chosen_by = ""
    if settings.variant != "auto":
        variant = settings.variant
    elif settings.device != "cpu":
        # The report times variants on this CPU: its int8 pick is tuned for the CPU's ISA, and
        # on a GPU the CUDA provider leaves int8 (QDQ) nodes it lacks to the CPU. fp32 is what
        # TensorRT builds its (fp16) engines from.
        variant, chosen_by = DEFAULT_VARIANT, "the default on a GPU: the report measured the CPU"
    elif (run.report_dir / "report.json").is_file():
        variant, chosen_by = recommended_variant(run, artifacts), "the report's recommendation"
    else:
        variant, chosen_by = recommended_variant(run, artifacts), "the default without a report"
    if variant not in VARIANTS:
        eager = variant == "eager"
        served_as = ": the report's eager row, best.ckpt, is --variant checkpoint" if eager else ""
        raise ConfigError(
            f"unknown --variant '{variant}'{served_as}; choose from auto, {', '.join(VARIANTS)}"
        )
    entry = artifacts.get(variant)
    if entry is None:
        have = ", ".join(sorted(artifacts)) or "none"
        raise RunError(
            f"{target} has no '{variant}' artifact (it has: {have}): {run.make_hint(variant)}; "
            "or choose another --variant"
        )
    path = run.root / str(entry["file"])
    if not path.is_file():
        raise RunError(f"{path} is in the manifest but missing: {run.remake_hint(variant)}")
    name = settings.model_name or _safe_name(run.name)
    return ServedModel(name, variant, path, dict(entry), chosen_by)


def _missing(target: Path) -> str:
    """What to say of a --run that does not exist: a model file is not made by training it."""
    if target.suffix in MODEL_SUFFIXES:
        made = ""
        if enclosing_run(target) and target.suffix != ".ckpt":  # made by export or quantize
            made = f"; {export_hint(target)}"
        return f"no such model file: {target} does not exist: check the path{made}"
    return (
        f"{target} does not exist: neither a run directory nor a model file is there; give "
        "--run (LIGHTSHIP_RUN) a run directory (one `lightship train` and `lightship export` "
        f"made) or a model file ({', '.join(MODEL_SUFFIXES)}){check_the_name(target)}"
    )


def _safe_name(name: str) -> str:
    """The model name a folder or file name gives: other characters become '-' ("my run" is
    served as "my-run", a name a URL and the V2 protocol take as it is)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("._-")[:128]
    if MODEL_NAME.match(safe):
        return safe
    raise ConfigError(
        f"'{name}' cannot be a model name (ASCII letters, digits, '.', '_', '-'): pass --model-name"
    )


def verify(
    model: ServedModel, isa_check: str = "refuse", cpu: CpuInfo | None = None, device: str = "cpu"
) -> None:
    """The file is the one the manifest describes, and an int8 model suits this CPU, or on a
    GPU `device`, TensorRT: the target it was made for is its manifest entry's, or for a lone
    ONNX file its own metadata's."""
    entry = model.entry
    redo = requantize_in_its_run
    if entry is None:
        what = str(model.path)
        made_for = file_metadata(model.path).get(TARGET) if model.path.suffix == ".onnx" else None
        gemm = None
    else:
        what = model.variant
        root = enclosing_run(model.path)
        # a lone file's variant ("file") is no stage's: the name of the file its manifest entry
        # lists says which it is (a link's own name may say nothing)
        variant = variant_of(model.path.resolve()) if model.variant == "file" else model.variant
        remake = RunDir(root).remake_hint(variant) if root else "re-run the stage that wrote it"
        check_recorded(model.path, entry, f"it changed after it was recorded; {remake}")
        if root is not None and (elsewhere := RunDir(root).made_elsewhere(variant)) is not None:
            said = model.path if model.variant == "file" else what  # not "file is not ..."
            raise RunError(f"{said} is not this run's model: it was {elsewhere}; {remake}")
        made_for = entry.get("target")
        gemm = entry.get("gemm_convs")
        if root is not None:
            redo = functools.partial(RunDir(root).requantize, variant, flags=entry.get("flags"))
    if not made_for:
        return
    if device != "cpu":  # the GPU runs it: this CPU's instructions are no matter
        if made_for != "tensorrt":
            log.warning(
                "%s was quantized for a CPU (%s: asymmetric int8, which TensorRT does not run): "
                "on %s its int8 nodes run as CUDA's quantize/dequantize pairs, correct but "
                "slower than fp32 may be; serve --variant onnx-fp32 on a GPU, or quantize "
                "with --target tensorrt",
                what,
                made_for,
                device,
            )
        return
    cpu = cpu or host_cpu()  # read once, for both checks
    if isinstance(gemm, dict) and gemm.get("kept") and "amx_int8" not in cpu.flags:
        log.warning(
            "%s: its deep convs were sent to ONNX Runtime's AMX int8 GEMM, measured faster on "
            "the AMX CPU it was quantized on; this CPU has no AMX, so they may run slower than "
            "they could: `lightship quantize` on this machine measures again",
            what,
        )
    problem = compatibility(str(made_for), cpu, redo)
    if problem is None:
        return
    if isa_check == "refuse":
        raise RunError(f"{what}: {problem} (or start with --isa-check warn to serve it)")
    log.warning("%s: %s; serving it anyway (--isa-check warn)", what, problem)
