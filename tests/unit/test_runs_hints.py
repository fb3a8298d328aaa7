"""What a message says to run to make a variant of a run: the stage's command where it has
best.ckpt, and where it has none (the copy of a run a model image holds), how to have it
all the same instead of a stage that cannot run there."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightship.errors import RunError
from lightship.runs import IN_AN_IMAGE, RunDir, export_hint
from lightship.runtime import load_predictor

REBUILD = "rebuild the image from a run that has it: `make {} docker-model RUN=runs/NAME`"
TORCH = (
    "serve an ONNX variant, e.g. --variant onnx-fp32, or mount the whole run at /model in an "
    "image with torch (Dockerfile.gpu, --build-arg TORCH_VERSION=...)"
)


@pytest.fixture(autouse=True)
def outside_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # lightship's own make targets are not here: lightship commands


def image_run(root: Path) -> RunDir:
    """A run as a model image holds it: manifest.json, export/ and quantize/, no best.ckpt."""
    run = RunDir(root)
    (root / "export").mkdir(parents=True)
    (root / "quantize").mkdir()
    run.record("checkpoint", {"file": "best.ckpt"})
    return run


def test_a_missing_model_of_a_trained_run_names_the_stage_that_writes_it(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.record("checkpoint", {"file": "best.ckpt"})
    run.best_ckpt.write_bytes(b"weights")
    assert export_hint(run.export_dir / "model.onnx") == (
        f"run `lightship export --run {run.root}` first"
    )
    assert export_hint(run.export_dir / "model.ts") == (
        f"run `lightship export --run {run.root}` first"
    )
    # quantize writes the int8 models, not export
    assert export_hint(run.quantize_dir / "model.int8-static.onnx") == (
        f"run `lightship quantize --run {run.root}` first"
    )
    assert export_hint(tmp_path / "model.onnx") == "export it first"  # in no run
    assert run.remake_hint("onnx-int8-static") == (
        f"re-run `lightship quantize --run {run.root} --methods static`"
    )
    assert run.remake_hint("checkpoint") == f"re-run `lightship train --run {run.root}`"


def test_the_command_that_remakes_a_variant_of_a_user_model_carries_its_pythonpath(
    tmp_path: Path,
) -> None:
    # followed as printed, it failed: "cannot import mynet ... run with PYTHONPATH=..."
    module = tmp_path / "mods" / "lightship_test_mynet.py"
    run = RunDir(tmp_path / "run")
    model = {"name": "lightship_test_mynet:Net", "module_file": str(module)}
    run.record("checkpoint", {"file": "best.ckpt", "model": model})
    run.best_ckpt.write_bytes(b"weights")
    env = "PYTHONPATH=mods "  # the folder it trained from, from here
    assert run.remake_hint("onnx-fp32") == (
        f"re-run `{env}lightship export --run {run.root} --formats onnx`"
    )
    assert run.remake_hint("onnx-int8-qat") == (
        f"re-run `{env}lightship quantize --run {run.root} --methods qat`"
    )
    assert run.remake_hint("checkpoint") == f"re-run `{env}lightship train --run {run.root}`"
    # a variant not made yet, and the stages named after a missing export: the same import
    assert run.make_hint("onnx-int8-static") == (
        f"run `{env}lightship quantize --run {run.root}` first"
    )
    assert run.command("export", "quantize") == (
        f"`{env}lightship export --run {run.root}`, then `{env}lightship quantize --run {run.root}`"
    )
    run.best_ckpt.unlink()
    with pytest.raises(RunError) as err:
        run.require_checkpoint()
    assert str(err.value) == (
        f"no best.ckpt in {run.root}: run `{env}lightship train --run {run.root}` first"
    )


def test_a_run_without_best_ckpt_says_how_to_have_a_variant_not_to_run_a_stage_there(
    tmp_path: Path,
) -> None:
    run = image_run(tmp_path / "model")
    no_ckpt = f"{run.root} has no best.ckpt to make it from ({IN_AN_IMAGE}): "
    assert export_hint(run.export_dir / "model.onnx") == no_ckpt + REBUILD.format("export")
    assert export_hint(run.quantize_dir / "model.int8-qat.onnx") == (
        no_ckpt + REBUILD.format("quantize")
    )
    assert export_hint(run.export_dir / "model.pt2") == no_ckpt + TORCH
    # a file there but not the one recorded: made again in the run the image was built from
    assert run.remake_hint("onnx-fp32") == no_ckpt + REBUILD.format("export")
    assert run.remake_hint("onnx-int8-static") == no_ckpt + REBUILD.format("quantize")
    assert run.remake_hint("checkpoint") == f"{run.root} has no best.ckpt ({IN_AN_IMAGE}): {TORCH}"
    # a run whose best.ckpt is gone but that trained there: training puts it back
    run.checkpoints.mkdir()
    assert export_hint(run.export_dir / "model.onnx") == (
        f"run `lightship export --run {run.root}` first"
    )


@pytest.mark.parametrize(
    ("name", "fix"),
    [("model.onnx", REBUILD.format("export")), ("model.ts", TORCH)],
)
def test_a_runtime_missing_a_model_of_an_image_says_so(tmp_path: Path, name: str, fix: str) -> None:
    # onnxruntime's and torch's loaders take their fix from `export_hint`
    run = image_run(tmp_path / "model")
    with pytest.raises(RunError) as err:
        load_predictor(run.export_dir / name)
    assert str(err.value).endswith(
        f"{run.export_dir / name} not found: {run.root} has no best.ckpt to make it from "
        f"({IN_AN_IMAGE}): {fix}"
    )


def test_a_run_that_does_not_exist_names_the_runs_beside_it(tmp_path: Path) -> None:
    """`lightship export --run runs/defualt` said to train runs/defualt, the typo; make's own
    check lists the trained runs, and now lightship's stages do too."""
    from lightship.runs import check_the_name

    for name, made in [("default", "best.ckpt"), ("r1", "manifest.json"), ("r2", "checkpoints")]:
        (tmp_path / name / made).mkdir(parents=True)
    (tmp_path / "notes").mkdir()  # no run
    typo = tmp_path / "defualt"
    named = (
        f" (or check the name: did you mean {tmp_path}/default? {tmp_path}/ holds: default, r1, r2)"
    )
    assert check_the_name(typo) == named
    assert (
        check_the_name(tmp_path / "zzz")
        == f" (or check the name: {tmp_path}/ holds: default, r1, r2)"
    )
    assert check_the_name(tmp_path / "notes" / "x") == ""  # nothing to list
    with pytest.raises(RunError) as err:
        RunDir(typo).require_checkpoint()
    assert str(err.value).endswith(named)


@pytest.mark.parametrize("given", [None, 3, "", " "])
def test_a_run_that_is_no_path_is_a_lightship_error(given: object) -> None:
    # export(None) was pathlib's TypeError, past a caller's `except LightshipError`
    from lightship.runs import as_run

    with pytest.raises(RunError, match=r"a run is its directory's path or a RunDir, got "):
        as_run(given)  # type: ignore[arg-type]


def test_a_run_given_from_python_is_checked_as_the_cli_checks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fit(cfg, "~/x")` made a folder named `~` (Lightning expanded it for the checkpoints
    alone), and `fit(cfg, "runs/r/export")` trained a run inside a run, which `--run` refuses."""
    from lightship.runs import as_run

    monkeypatch.setenv("HOME", str(tmp_path))
    assert as_run("~/x").root == tmp_path / "x"
    run = tmp_path / "r"
    (run / "export").mkdir(parents=True)
    (run / "manifest.json").write_text('{"schema": 1, "artifacts": {}}')
    (run / "export" / "model.onnx").write_bytes(b"onnx")
    with pytest.raises(RunError) as err:
        as_run(run / "export")
    assert str(err.value) == (
        f"run takes a run directory: {run / 'export'} is run {run}'s export folder; give run {run}"
    )
    with pytest.raises(RunError) as err:
        as_run(str(run / "export" / "model.onnx"))
    assert str(err.value) == (
        f"run takes a run directory, not a file ({run / 'export' / 'model.onnx'}): give run {run}"
    )
    assert as_run(run).root == run
