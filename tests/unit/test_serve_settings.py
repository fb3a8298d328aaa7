"""Settings from env and flags; which artifact `serve` picks; the sha256 and CPU ISA checks."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from lightship.errors import ConfigError, RunError
from lightship.quantize.isa import CpuInfo
from lightship.runs import RunDir, sha256_file
from lightship.serve.command import _settings
from lightship.serve.model import choose, verify
from lightship.serve.settings import ServeSettings
from tests.conftest import last_line, run_cli
from tests.handmade import handmade_onnx

AVX2 = CpuInfo("test AVX2 CPU", "x86_64", frozenset({"avx2"}))
VNNI = CpuInfo("test VNNI CPU", "x86_64", frozenset({"avx2", "avx512_vnni"}))


def test_environment_fills_settings_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTSHIP_RUN", "/models/x")
    monkeypatch.setenv("LIGHTSHIP_PORT", "9000")
    monkeypatch.setenv("LIGHTSHIP_MAX_BATCH_ROWS", "8")
    monkeypatch.setenv("LIGHTSHIP_MODEL_NAME", "from-env")
    monkeypatch.setenv("LIGHTSHIP_TRT_CACHE", "/tmp/x")  # another component's variable: ignored
    s = _settings(port=None, model_name="from-flag", host="0.0.0.0")
    assert s.run == Path("/models/x") and s.port == 9000 and s.max_batch_rows == 8
    assert s.model_name == "from-flag" and s.host == "0.0.0.0"
    assert s.variant == "auto" and s.device == "cpu" and s.isa_check == "refuse"


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"max_batch_rows": 0}, "--max-batch-rows 0: Input should be greater than"),
        ({"max_batch_rows": 64, "max_queue_rows": 8}, "one full batch"),
        ({"device": "gpu"}, "cpu, cuda or cuda:N"),
        ({"model_name": "a/b"}, "model name"),
        ({"isa_check": "maybe"}, "--isa-check maybe: Input should be 'refuse' or 'warn'"),
        ({"instances": 0}, "--instances 0"),
        ({"host": ""}, "--host '': String should have at least 1 character"),
        ({"run": " "}, r"run is empty: give a run directory or a model file"),
        ({"threads": 100_000}, "--threads 100000: Input should be less than or equal to 256"),
        ({"timeout_ms": float("inf")}, "--timeout-ms inf: Input should be a finite number"),
        ({"max_wait_ms": float("inf")}, "--max-wait-ms inf"),  # it killed the batcher thread
        (
            {"compress_min_bytes": -1},
            "--compress-min-bytes -1: Input should be greater than or equal to 0",
        ),
        (
            {"max_wait_ms": 20_000},
            r"--max-wait-ms / LIGHTSHIP_MAX_WAIT_MS \(20000\) must be less than --timeout-ms",
        ),
    ],
)
def test_bad_settings_are_a_config_error(
    given: dict[str, object], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=message):
        _settings(**given)
    if "run" in given:  # LIGHTSHIP_RUN=" " counts as unset, as an empty one, and is warned of
        monkeypatch.setenv("LIGHTSHIP_RUN", " ")
        assert _settings().run == Path("runs/default")
    with pytest.raises(ValidationError):
        ServeSettings(**given)  # type: ignore[arg-type]


def test_a_bad_value_is_named_as_it_was_given_flag_or_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError) as err:
        _settings(max_batch_rows=0)
    assert str(err.value) == (
        "invalid serve settings (--max-batch-rows 0: Input should be greater than or equal to 1)"
    )
    monkeypatch.setenv("LIGHTSHIP_MAX_BATCH_ROWS", "0")
    monkeypatch.setenv("LIGHTSHIP_THREADS", "many")
    monkeypatch.setenv("lightship_threads", "2")  # not read (upper case only), and warned of
    with pytest.raises(ConfigError) as err:
        _settings()
    assert str(err.value) == (
        "invalid serve settings (LIGHTSHIP_MAX_BATCH_ROWS=0: Input should be greater than or "
        "equal to 1; LIGHTSHIP_THREADS=many: Input should be a valid integer, unable to parse "
        "string as an integer)"
    )
    monkeypatch.delenv("LIGHTSHIP_THREADS")
    monkeypatch.delenv("LIGHTSHIP_MAX_BATCH_ROWS")
    monkeypatch.delenv("lightship_threads")
    monkeypatch.setenv("LIGHTSHIP_MAX_QUEUE_ROWS", "8")  # a conflict: either may be the fix
    with pytest.raises(ConfigError) as err:
        _settings(max_batch_rows=16)
    assert str(err.value) == (
        "invalid serve settings (--max-queue-rows / LIGHTSHIP_MAX_QUEUE_ROWS (8) must be at "
        "least --max-batch-rows / LIGHTSHIP_MAX_BATCH_ROWS (16): the queue has to hold one full "
        "batch)"
    )


def test_an_unknown_variant_is_named_as_it_was_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    choices = (
        "choose from auto, onnx-fp32, onnx-int8-static, onnx-int8-dynamic, onnx-int8-qat, "
        "torchscript, pt2, checkpoint"
    )
    with pytest.raises(ConfigError) as err:
        _settings(run=tmp_path, variant="torchscipt")
    assert str(err.value) == f"unknown --variant 'torchscipt'; {choices}"
    monkeypatch.setenv("LIGHTSHIP_VARIANT", "torchscipt")
    with pytest.raises(ConfigError) as err:
        _settings(run=tmp_path)
    assert str(err.value) == f"unknown LIGHTSHIP_VARIANT 'torchscipt'; {choices}"
    assert _settings(run=tmp_path, variant="pt2").variant == "pt2"  # the flag wins


def test_an_empty_variable_is_unset_as_templates_leave_it(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = ServeSettings().model_dump()
    for name in ServeSettings.model_fields:  # docker-compose's ${VAR:-}, a k8s template's ""
        monkeypatch.setenv(f"LIGHTSHIP_{name.upper()}", "")
    assert _settings().model_dump() == defaults
    assert _settings(threads=3).threads == 3


def test_names_of_levels_devices_and_checks_take_any_case(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTSHIP_LOG_LEVEL", "ERROR")  # as logging's own constants are written
    monkeypatch.setenv("LIGHTSHIP_ISA_CHECK", "Warn")
    settings = _settings(device="CUDA:1")
    assert (settings.log_level, settings.isa_check, settings.device) == ("error", "warn", "cuda:1")


def test_help_lists_every_variable_serve_reads(capsys: pytest.CaptureFixture[str]) -> None:
    from lightship import cli
    from lightship.serve.settings import OTHER_VARIABLES

    assert cli._invoke(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for name in [f"LIGHTSHIP_{field.upper()}" for field in ServeSettings.model_fields]:
        assert name in out, name
    for name in OTHER_VARIABLES:
        assert name in out, name


def test_help_gives_each_settings_variable_and_its_default() -> None:
    # `--variant auto (the default)` in the README, no default in --help; and "; cpu" beside
    # "; default 8000": each option now says "(env LIGHTSHIP_X; default Y)", Y the setting's
    import re

    import typer

    from lightship import cli

    serve = typer.main.get_command(cli.app).commands["serve"]  # type: ignore[attr-defined]
    helps = {p.name: p.help or "" for p in serve.params}

    def shown(value: object) -> str:
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, int) and value and value % 2**20 == 0:
            return f"{value // 2**20} MiB"
        return "none" if value == "" else f"{value:g}" if isinstance(value, float) else str(value)

    for name, field in ServeSettings.model_fields.items():
        found = re.search(rf"\(env LIGHTSHIP_{name.upper()}; default (.+)\)", helps[name])
        assert found, (name, helps[name])
        if field.default is not None:  # else made at start (threads, model name): said in words
            assert found.group(1).split(")")[0] == shown(field.default), name


def test_the_compression_threshold_comes_from_the_flag_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightship import cli

    seen: list[ServeSettings] = []
    monkeypatch.setattr("lightship.serve.app.serve", seen.append)
    assert cli._invoke(["serve", "--run", str(tmp_path)]) == 0
    assert cli._invoke(["serve", "--run", str(tmp_path), "--compress-min-bytes", "0"]) == 0
    monkeypatch.setenv("LIGHTSHIP_COMPRESS_MIN_BYTES", "4096")
    assert cli._invoke(["serve", "--run", str(tmp_path)]) == 0
    assert cli._invoke(["serve", "--run", str(tmp_path), "--compress-min-bytes", "100"]) == 0
    assert [s.compress_min_bytes for s in seen] == [1024, 0, 4096, 100]
    with pytest.raises(ConfigError) as err:
        cli._invoke(["serve", "--run", str(tmp_path), "--compress-min-bytes", "-5"])
    assert str(err.value) == (
        "invalid serve settings (--compress-min-bytes -5: Input should be greater than or equal "
        "to 0)"
    )
    for value, problem in (("-1", "greater than or equal to 0"), ("1k", "a valid integer")):
        monkeypatch.setenv("LIGHTSHIP_COMPRESS_MIN_BYTES", value)
        with pytest.raises(ConfigError) as err:
            _settings()
        assert str(err.value).startswith(
            f"invalid serve settings (LIGHTSHIP_COMPRESS_MIN_BYTES={value}: Input should be "
            f"{problem}"
        )


@pytest.fixture
def lightship_log_level() -> Iterator[logging.Logger]:
    logger = logging.getLogger("lightship")
    level = logger.level
    yield logger
    logger.setLevel(level)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_log_level_applies_to_lightships_own_loggers_too(
    how: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    lightship_log_level: logging.Logger,
) -> None:
    from lightship import cli

    seen: list[ServeSettings] = []

    def fake_serve(settings: ServeSettings) -> None:  # what the server would log
        logging.getLogger("lightship.serve.app").info("serving")
        logging.getLogger("lightship.serve.model").warning("a warning")
        logging.getLogger("lightship.serve.app").error("an error")
        seen.append(settings)

    monkeypatch.setattr("lightship.serve.app.serve", fake_serve)
    monkeypatch.setenv("LIGHTSHIP_ZZZ", "1")  # warned about at start-up, a warning like others
    caplog.set_level(logging.DEBUG)
    argv = ["serve", "--run", str(tmp_path)]
    assert cli._invoke(argv) == 0
    assert [r.getMessage() for r in caplog.records] == [
        "LIGHTSHIP_ZZZ is not a serve setting and is ignored",
        "serving",
        "a warning",
        "an error",
    ]
    caplog.clear()
    if how == "flag":
        argv += ["--log-level", "error"]
    else:
        monkeypatch.setenv("LIGHTSHIP_LOG_LEVEL", "error")
    assert cli._invoke(argv) == 0
    assert seen[-1].log_level == "error"
    assert [r.getMessage() for r in caplog.records] == ["an error"]


def test_instances_share_the_cores_unless_threads_are_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("lightship.runtime.base.physical_cores", lambda: 8)
    monkeypatch.setenv("LIGHTSHIP_INSTANCES", "2")
    assert _settings().instances == 2
    assert _settings().model_threads() == 4
    assert _settings(instances=3).model_threads() == 2
    assert _settings(instances=16).model_threads() == 1
    assert _settings(threads=6).model_threads() == 6
    assert _settings(instances=1).model_threads() == 8


def test_a_torch_model_on_a_gpu_gets_one_cpu_thread_unless_threads_are_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("lightship.runtime.base.physical_cores", lambda: 8)
    for model in ("model.ts", "model.pt2", "best.ckpt"):
        assert _settings(device="cuda").model_threads(Path(model)) == 1
        assert _settings(device="cuda:1").model_threads(Path(model)) == 1
        assert _settings(device="cuda", threads=3).model_threads(Path(model)) == 3
        assert _settings().model_threads(Path(model)) == 8  # on the CPU, the cores
    assert _settings(device="cuda").model_threads(Path("model.onnx")) == 8  # ORT's: as before


def make_run(tmp_path: Path, variants: dict[str, dict[str, Any]]) -> Path:
    """A run directory whose manifest lists handmade ONNX files under the given variants."""
    run = tmp_path / "my-run"
    (run / "export").mkdir(parents=True)
    for variant, extra in variants.items():
        path = handmade_onnx(run / "export" / f"{variant}.onnx", bias=float(len(variant)))
        RunDir(run).record(
            variant,
            {
                "file": f"export/{variant}.onnx",
                "format": "onnx",
                "sha256": sha256_file(path),
                **extra,
            },
        )
    return run


def test_auto_takes_the_report_recommendation_else_fp32(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = make_run(tmp_path, {"onnx-fp32": {}, "onnx-int8-static": {"target": "avx2"}})
    chosen = choose(ServeSettings(run=run))
    assert (chosen.variant, chosen.name, chosen.path, chosen.chosen_by) == (
        "onnx-fp32",
        "my-run",
        run / "export/onnx-fp32.onnx",
        "the default without a report",
    )
    # the int8 model is left unserved out loud, with how to have it chosen
    assert f"no report to choose between them: serving onnx-fp32; `make report RUN={run}`" in (
        caplog.text
    )
    (run / "report").mkdir()
    (run / "report" / "report.json").write_text(
        json.dumps({"recommended": "onnx-int8-static", "variants": []})
    )
    chosen = choose(ServeSettings(run=run, model_name="digits"))
    assert (chosen.variant, chosen.name) == ("onnx-int8-static", "digits")
    assert chosen.entry is not None and chosen.entry["target"] == "avx2"
    assert chosen.chosen_by == "the report's recommendation"
    named = choose(ServeSettings(run=run, variant="onnx-fp32"))
    assert (named.variant, named.chosen_by) == ("onnx-fp32", "")
    # on a GPU, fp32: the report timed the CPU, its int8 pick is tuned for the CPU's ISA
    gpu = choose(ServeSettings(run=run, device="cuda:1"))
    assert (gpu.variant, gpu.chosen_by) == (
        "onnx-fp32",
        "the default on a GPU: the report measured the CPU",
    )
    int8 = choose(ServeSettings(run=run, device="cuda", variant="onnx-int8-static"))
    assert int8.variant == "onnx-int8-static"  # named, it is served


def measured(run: Path, **bytes_of: int) -> list[dict[str, Any]]:
    """report.json's rows for the variants named, as `lightship report` measured them."""
    return [{"name": n, "file": f"export/{n}.onnx", "bytes": b} for n, b in bytes_of.items()]


def test_a_variant_made_again_to_the_same_size_is_not_the_one_the_report_measured(
    tmp_path: Path,
) -> None:
    """Told by name and size alone, an int8 model quantized again (other calibration: other
    scales, the same 165,950 bytes) was served as the report's recommendation, the report's
    figures belonging to the file before it."""
    run = make_run(tmp_path, {"onnx-fp32": {"bytes": 100}, "onnx-int8-static": {"bytes": 50}})
    entries = RunDir(run).manifest()["artifacts"]
    report = run / "report" / "report.json"
    report.parent.mkdir()
    rows = measured(run, **{"onnx-fp32": 100, "onnx-int8-static": 50})
    for row in rows:
        row["sha256"] = entries[row["name"]]["sha256"]
    report.write_text(json.dumps({"recommended": "onnx-int8-static", "variants": rows}))
    assert choose(ServeSettings(run=run)).variant == "onnx-int8-static"

    rows[1]["sha256"] = "0" * 64  # the file it measured, before the one listed now
    report.write_text(json.dumps({"recommended": "onnx-int8-static", "variants": rows}))
    with pytest.raises(RunError, match="recommends onnx-int8-static, made again after it was"):
        choose(ServeSettings(run=run))


def test_a_report_older_than_the_manifest_says_what_changed_and_how_to_serve(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = make_run(tmp_path, {"onnx-fp32": {"bytes": 100}, "onnx-int8-static": {"bytes": 50}})
    report = run / "report" / "report.json"
    report.parent.mkdir()
    fix = (
        f"re-run `make report RUN={run}` (or `lightship report --run {run}`), or serve without "
        "it: --variant onnx-fp32"
    )
    out_of_date: list[tuple[str | None, list[dict[str, Any]], str]] = [
        # reported before export: nothing to recommend then
        (None, [], "recommends no variant, but it is older than onnx-fp32, onnx-int8-static "
         f"(made or replaced since): {fix}"),
        ("onnx-int8-qat", measured(run, **{"onnx-fp32": 100, "onnx-int8-static": 50}),
         f"is out of date: it recommends onnx-int8-qat, which the manifest no longer lists: {fix}"),
        ("onnx-int8-static", measured(run, **{"onnx-fp32": 100, "onnx-int8-static": 49}),
         "is out of date: it recommends onnx-int8-static, made again after it was measured: "
         f"{fix}"),
        (None, measured(run, **{"onnx-fp32": 100, "onnx-int8-static": 50}),
         "recommends no variant: each one it measured failed the accuracy gate or is not one to "
         "recommend (see report.md): serve one with --variant, e.g. --variant onnx-fp32"),
    ]  # fmt: skip
    for recommended, rows, message in out_of_date:
        report.write_text(json.dumps({"recommended": recommended, "variants": rows}))
        with pytest.raises(RunError) as err:
            choose(ServeSettings(run=run))
        assert str(err.value) == f"{report} {message}"
        assert choose(ServeSettings(run=run, variant="onnx-fp32")).variant == "onnx-fp32"
    # A listed variant whose file is gone was never measurable: no warning, and no refusal.
    (run / "export" / "onnx-int8-static.onnx").unlink()
    report.write_text(
        json.dumps({"recommended": "onnx-fp32", "variants": measured(run, **{"onnx-fp32": 100})})
    )
    caplog.clear()
    assert choose(ServeSettings(run=run)).variant == "onnx-fp32"
    assert "older than" not in caplog.text
    handmade_onnx(run / "export" / "onnx-int8-static.onnx", bias=16.0)
    # Older than a variant it does not recommend: its recommendation is served, with a warning.
    report.write_text(
        json.dumps({"recommended": "onnx-fp32", "variants": measured(run, **{"onnx-fp32": 100})})
    )
    assert choose(ServeSettings(run=run)).variant == "onnx-fp32"
    assert f"{report} is older than onnx-int8-static: serving its recommendation" in caplog.text


def test_a_variant_the_report_left_out_is_not_taken_for_one_made_since(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A report that left out a changed file (`not_measured`): serve warned the report was
    older than it, or refused, with "re-run the report" as the fix, which changed nothing.
    Told by the file's sha256 as it was left out (not by mtimes, which `cp -r` reorders)."""
    run = make_run(tmp_path, {"onnx-fp32": {"bytes": 100}, "onnx-int8-static": {"bytes": 50}})
    report = run / "report" / "report.json"
    report.parent.mkdir()
    int8 = run / "export" / "onnx-int8-static.onnx"
    good = int8.read_bytes()
    int8.write_bytes(good[:-10])  # changed after it was recorded
    why = "export/onnx-int8-static.onnx differs from its manifest entry (sha256): make it again"
    left = {
        "not_measured": {"onnx-int8-static": why},
        "not_measured_files": {"onnx-int8-static": sha256_file(int8)},
    }
    rows = measured(run, **{"onnx-fp32": 100})
    report.write_text(json.dumps({"recommended": "onnx-fp32", "variants": rows, **left}))
    assert choose(ServeSettings(run=run)).variant == "onnx-fp32"
    assert "older than" not in caplog.text
    fp32 = run / "export" / "onnx-fp32.onnx"
    report.write_text(
        json.dumps(
            {
                "recommended": None,
                "variants": [],
                "not_measured": {"onnx-fp32": "unloadable", "onnx-int8-static": why},
                "not_measured_files": {
                    "onnx-fp32": sha256_file(fp32),
                    "onnx-int8-static": sha256_file(int8),
                },
            }
        )
    )
    with pytest.raises(RunError) as err:
        choose(ServeSettings(run=run))
    assert str(err.value) == (
        f"{report} recommends no variant, having left out onnx-fp32, onnx-int8-static: "
        "onnx-fp32: unloadable"
    )
    # its file made again since (here restored, to the bytes recorded): made since, as before
    int8.write_bytes(good)
    report.write_text(json.dumps({"recommended": "onnx-fp32", "variants": rows, **left}))
    assert choose(ServeSettings(run=run)).variant == "onnx-fp32"
    assert f"{report} is older than onnx-int8-static" in caplog.text


def test_a_stale_report_s_fix_runs_where_it_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lightship alternative beside make's target: with the PYTHONPATH= the report needs
    to load a model of the run's own module, and none under `make -C` (the run's path is
    the checkout's there), as a next: line has it."""
    run = make_run(tmp_path, {"onnx-fp32": {"bytes": 100}})
    (run / "report").mkdir()
    (run / "report" / "report.json").write_text(json.dumps({"recommended": None, "variants": []}))
    monkeypatch.setattr(RunDir, "pythonpath", lambda self: "PYTHONPATH=/m ")
    with pytest.raises(RunError) as err:
        choose(ServeSettings(run=run))
    assert (
        f"re-run `PYTHONPATH=/m make report RUN={run}` (or `PYTHONPATH=/m lightship report --run "
        f"{run}`), or serve without it"
    ) in str(err.value)
    monkeypatch.setenv("LIGHTSHIP_MAKE_FROM", str(tmp_path))  # `make -C CHECKOUT` from there
    with pytest.raises(RunError) as err:
        choose(ServeSettings(run=run))
    assert f"re-run `PYTHONPATH=/m make -C {Path.cwd()} report RUN={run}`, or serve" in str(
        err.value
    )


def test_missing_or_broken_things_say_how_to_fix(tmp_path: Path) -> None:
    run = make_run(tmp_path, {"onnx-fp32": {}})
    with pytest.raises(
        RunError, match=r"no 'onnx-int8-static' artifact \(it has: onnx-fp32\).*make quantize"
    ):
        choose(ServeSettings(run=run, variant="onnx-int8-static"))
    with pytest.raises(RunError, match="neither a run directory nor a model file"):
        choose(ServeSettings(run=tmp_path / "nothing"))
    (run / "report" / "report.json").mkdir(parents=True)  # served onnx-fp32, as if no report
    with pytest.raises(RunError, match="report.json is unreadable .*Is a directory"):
        choose(ServeSettings(run=run))
    (run / "report" / "report.json").rmdir()
    (run / "report" / "report.json").write_text("{oops")
    with pytest.raises(RunError, match="report.json is unreadable"):
        choose(ServeSettings(run=run))
    (run / "report" / "report.json").write_text("{}")
    with pytest.raises(RunError) as err:
        choose(ServeSettings(run=run))
    assert str(err.value).startswith(
        f"{run}/report/report.json is unreadable (it lists no measured variants): re-run "
    )
    recommends = {"recommended": "torchscript", "variants": []}
    (run / "report" / "report.json").write_text(json.dumps(recommends))
    with pytest.raises(RunError, match="recommends torchscript, which the manifest no longer"):
        choose(ServeSettings(run=run))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(RunError) as err:
        choose(ServeSettings(run=tmp_path / "notes.txt"))
    assert str(err.value) == (
        f"{tmp_path}/notes.txt: cannot serve a .txt file; give a run directory or a model file "
        "(.onnx, .ts, .pt2, .ckpt)"
    )
    (run / "config.yaml").write_text("")
    with pytest.raises(RunError) as err:  # inside a run: its run is the fix
        choose(ServeSettings(run=run / "config.yaml"))
    assert str(err.value) == (
        f"{run}/config.yaml: cannot serve a .yaml file; give its run, --run {run}, or a model "
        "file (.onnx, .ts, .pt2, .ckpt)"
    )


def test_a_lone_file_is_served_under_its_stem_and_finds_its_manifest_entry(tmp_path: Path) -> None:
    run = make_run(tmp_path, {"onnx-int8-static": {"target": "vnni"}})
    inside = choose(ServeSettings(run=run / "export" / "onnx-int8-static.onnx"))
    assert inside.name == "onnx-int8-static" and inside.variant == "file"
    assert inside.entry is not None and inside.entry["target"] == "vnni"  # the ISA check applies
    alone = tmp_path / "alone.onnx"
    shutil.copy(run / "export" / "onnx-int8-static.onnx", alone)
    assert choose(ServeSettings(run=alone)).entry is None
    # beside a manifest.json that is not lightship's (a web app's), in a folder that is no run:
    # it stopped on it, "malformed ...: delete it and re-run the stages"
    site = tmp_path / "site"
    (site / "models").mkdir(parents=True)
    (site / "manifest.json").write_text('{"name": "My PWA", "icons": []}')
    (site / "export").mkdir()  # a folder named as a run's is
    for model in (site / "m.onnx", site / "models" / "m.onnx", site / "export" / "m.onnx"):
        shutil.copy(alone, model)
        assert choose(ServeSettings(run=model)).entry is None
    # a run's own manifest, damaged, is still said to be
    for damaged in ('{"schema": 1, "artifacts": []}', '{"schema": 1, "artifa'):
        (run / "manifest.json").write_text(damaged)
        with pytest.raises(RunError, match="manifest.json is (malformed|unreadable)"):
            choose(ServeSettings(run=run / "export" / "onnx-int8-static.onnx"))


def test_int8_for_another_cpu_is_refused_or_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = make_run(
        tmp_path, {"onnx-int8-static": {"target": "vnni"}, "onnx-int8-qat": {"target": "avx2"}}
    )
    vnni_model = choose(ServeSettings(run=run, variant="onnx-int8-static"))
    with pytest.raises(RunError, match="no VNNI.*--target avx2.*--isa-check warn"):
        verify(vnni_model, "refuse", cpu=AVX2)
    verify(vnni_model, "warn", cpu=AVX2)
    assert "serving it anyway" in caplog.text
    verify(vnni_model, "refuse", cpu=VNNI)  # made for this CPU
    verify(
        choose(ServeSettings(run=run, variant="onnx-int8-qat")), "refuse", cpu=VNNI
    )  # 7-bit: anywhere


def test_the_fix_for_int8_made_for_another_cpu_requantizes_the_served_run(tmp_path: Path) -> None:
    """`lightship quantize --target auto`, the fix it gave, quantized runs/default (--run's
    default), not the run served, replacing that one's int8 models and report."""
    run = make_run(
        tmp_path,
        {
            "onnx-int8-static": {
                "target": "tensorrt",
                "flags": ["--target", "tensorrt", "--calibration-samples", "64"],
            },
            "onnx-int8-dynamic": {"target": "vnni", "flags": []},
        },
    )
    (run / "best.ckpt").write_bytes(b"weights")  # a trained run: quantize can run on it
    with pytest.raises(RunError) as err:
        verify(choose(ServeSettings(run=run, variant="onnx-int8-static")), "refuse", cpu=VNNI)
    assert str(err.value) == (
        "onnx-int8-static: model was quantized for TensorRT (S8S8); for this CPU re-quantize "
        f"it: `make quantize RUN={run} QUANTIZE_ARGS='--methods static --calibration-samples "
        "64'` (or start with --isa-check warn to serve it)"
    )
    with pytest.raises(RunError) as err:
        verify(choose(ServeSettings(run=run, variant="onnx-int8-dynamic")), "refuse", cpu=AVX2)
    assert str(err.value).endswith(
        f"answers drift; re-quantize it: `make quantize RUN={run} QUANTIZE_ARGS='--methods "
        "dynamic --target avx2'` (or start with --isa-check warn to serve it)"
    )
    (run / "best.ckpt").unlink()  # a model image: quantized where its run is
    with pytest.raises(RunError) as err:
        verify(choose(ServeSettings(run=run, variant="onnx-int8-dynamic")), "refuse", cpu=AVX2)
    assert (
        "`make quantize docker-model RUN=runs/NAME QUANTIZE_ARGS='--methods dynamic --target "
        "avx2'`" in str(err.value)
    )


def test_a_file_changed_after_the_manifest_is_refused(tmp_path: Path) -> None:
    run = make_run(tmp_path, {"onnx-fp32": {}})
    handmade_onnx(run / "export" / "onnx-fp32.onnx", bias=5.0)  # rewritten behind the manifest
    (run / "best.ckpt").write_bytes(b"weights")  # a trained run: export can make it again
    with pytest.raises(RunError, match="differs from its manifest entry") as err:
        verify(choose(ServeSettings(run=run)))
    assert str(err.value).endswith(f"re-run `make export RUN={run} EXPORT_ARGS='--formats onnx'`")


def test_a_folder_name_that_is_no_model_name_is_made_one(tmp_path: Path) -> None:
    run = make_run(tmp_path, {"onnx-fp32": {}})
    spaced = run.rename(tmp_path / "my run (v2)")
    assert choose(ServeSettings(run=spaced)).name == "my-run-v2"
    odd = spaced.rename(tmp_path / "###")
    with pytest.raises(ConfigError, match="'###' cannot be a model name.*pass --model-name"):
        choose(ServeSettings(run=odd))


def test_a_lightship_variable_that_is_no_setting_is_warned_about() -> None:
    from lightship.runs import MAKE_FROM, MAKE_GOALS
    from lightship.serve.settings import unknown_variables

    env = {"LIGHTSHIP_MAX_BATCH_ROW": "8", "LIGHTSHIP_PORT": "1", "LIGHTSHIP_TRT_CACHE": "/c",
           "LIGHTSHIP_ZZZ": "1", "PATH": "/bin", MAKE_GOALS: "serve", MAKE_FROM: "/"}  # fmt: skip
    assert unknown_variables(env) == [
        "LIGHTSHIP_MAX_BATCH_ROW is not a serve setting and is ignored "
        "(did you mean LIGHTSHIP_MAX_BATCH_ROWS?)",
        "LIGHTSHIP_ZZZ is not a serve setting and is ignored",
    ]


def test_an_empty_lightship_variable_is_said_to_leave_the_default_in_force() -> None:
    # compose's `${BIND:-}` replaced the image's LIGHTSHIP_HOST=0.0.0.0 with nothing: the server
    # listened on 127.0.0.1, unreachable, and the image's healthcheck still said healthy
    from lightship.serve.settings import unknown_variables

    env = {"LIGHTSHIP_HOST": "", "LIGHTSHIP_THREADS": " ", "LIGHTSHIP_PORT": "9000"}
    assert unknown_variables(env) == [
        "LIGHTSHIP_HOST is set but empty, which counts as unset: the default 127.0.0.1 is used "
        "(from inside this host or container only); give it a value or leave it out",
        "LIGHTSHIP_THREADS is set but empty, which counts as unset: its default is used; give "
        "it a value or leave it out",
    ]


@pytest.mark.parametrize(
    ("variable", "value", "warning"),
    [
        # blank was read as a value after the warning said the default was used: exit 2,
        # "cannot listen on host ' '"
        ("LIGHTSHIP_HOST", "  ", "LIGHTSHIP_HOST is set but empty, which counts as unset"),
        ("LIGHTSHIP_THREADS", " ", "LIGHTSHIP_THREADS is set but empty, which counts as unset"),
        # read in any case, where the images' healthcheck reads LIGHTSHIP_PORT: it knocked at
        # 8000 while the server listened at 9000, and called it unhealthy
        ("lightship_port", "9000", "lightship_port is not read: lightship's variables are upper"),
        # what Kubernetes sets in every pod of a namespace with a Service named lightship: the
        # pods started after it stopped on "LIGHTSHIP_PORT=tcp://...: not a valid integer"
        ("LIGHTSHIP_PORT", "tcp://10.96.0.50:80", "LIGHTSHIP_PORT=tcp://10.96.0.50:80 is the l"),
    ],
)
def test_a_variable_serve_does_not_read_leaves_the_default_and_says_so(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, warning: str
) -> None:
    from lightship.serve.command import _settings
    from lightship.serve.settings import unknown_variables

    for name in list(os.environ):
        if name.upper().startswith("LIGHTSHIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv(variable, value)
    if value.startswith("tcp://"):  # Kubernetes sets it beside LIGHTSHIP_PORT
        monkeypatch.setenv("LIGHTSHIP_SERVICE_HOST", "10.96.0.50")
    settings = _settings()
    assert (settings.host, settings.threads, settings.port) == ("127.0.0.1", None, 8000)
    assert os.environ[variable] == value  # hidden only while the settings were read
    (said,) = unknown_variables(os.environ)
    assert said.startswith(warning) and said.endswith(
        "the pod's spec, or LIGHTSHIP_PORT in its container's env"
        if value.startswith("tcp://")
        else "give it a value or leave it out"
        if not value.strip()
        else "(LIGHTSHIP_PORT); the default 8000 is used"
    )
    # given as a flag, the flag's value is what is used instead
    field = variable.upper().removeprefix("LIGHTSHIP_").lower()
    (said,) = unknown_variables(os.environ, [field])
    assert f"--{field} is used" in said
    if variable != variable.upper():  # and the variable in upper case, where it is set too
        monkeypatch.setenv(variable.upper(), "9001")
        (said,) = unknown_variables(os.environ)
        assert said.endswith("(LIGHTSHIP_PORT); LIGHTSHIP_PORT is used")
        assert _settings().port == 9001


@pytest.mark.parametrize("port", ["8241.0", "8_241", "+8241"])
def test_a_port_is_digits_as_the_healthcheck_reads_it(
    monkeypatch: pytest.MonkeyPatch, port: str
) -> None:
    """pydantic read 8241.0 as 8241; the image's HEALTHCHECK put it in a URL as written, and
    called a serving container unhealthy for good."""
    monkeypatch.setenv("LIGHTSHIP_PORT", port)
    with pytest.raises(ConfigError) as err:
        _settings()
    assert str(err.value) == (
        f"invalid serve settings (LIGHTSHIP_PORT={port}: port must be a whole number 0..65535)"
    )
    monkeypatch.setenv("LIGHTSHIP_PORT", " 8241 ")
    assert _settings().port == 8241
    # the flag as the variable: click's int read `--port 8241.0` as 8241 before pydantic saw it
    monkeypatch.delenv("LIGHTSHIP_PORT")
    proc = run_cli("serve", "--run", "nowhere", "--port", port)
    assert proc.returncode == 2, proc.stderr
    assert last_line(proc.stderr) == (
        f"error: invalid serve settings (--port {port}: port must be a whole number 0..65535)"
    )


def test_a_port_written_as_a_url_by_hand_is_a_bad_value() -> None:
    """Only beside the LIGHTSHIP_SERVICE_HOST it names is tcp://IP:PORT a Service's link: one
    written by hand was replaced by 8000, warned as Kubernetes' link."""
    from lightship.serve.settings import unread_variables

    for given in ({}, {"LIGHTSHIP_SERVICE_HOST": "10.0.0.9"}):
        assert unread_variables({"LIGHTSHIP_PORT": "tcp://0.0.0.0:9000", **given}) == {}
    linked = {"LIGHTSHIP_PORT": "tcp://[fd00::5]:80", "LIGHTSHIP_SERVICE_HOST": "fd00::5"}
    assert list(unread_variables(linked)) == ["LIGHTSHIP_PORT"]


def test_tensorrts_variables_in_another_case_are_warned_of() -> None:
    from lightship.serve.settings import unknown_variables

    assert unknown_variables({"lightship_tensorrt": "0", "LIGHTSHIP_TRT_CACHE": "/c"}) == [
        "lightship_tensorrt is not read: lightship's variables are upper case (LIGHTSHIP_TENSORRT); "
        "its default is used"
    ]


def test_another_services_links_are_no_typos() -> None:
    from lightship.serve.settings import unknown_variables

    env = {"LIGHTSHIP_SERVICE_HOST": "10.96.0.50", "LIGHTSHIP_SERVICE_PORT": "80",
           "LIGHTSHIP_SERVICE_PORT_HTTP": "80", "LIGHTSHIP_PORT_80_TCP": "tcp://10.96.0.50:80",
           "LIGHTSHIP_PORT_80_TCP_PROTO": "tcp", "LIGHTSHIP_PORT_80_TCP_PORT": "80",
           "LIGHTSHIP_PORT_80_TCP_ADDR": "10.96.0.50", "LIGHTSHIP_GPU_PORT": "tcp://10.0.0.7:80",
           "LIGHTSHIP_GPU_SERVICE_HOST": "10.0.0.7", "LIGHTSHIP_PORTS": "80"}  # fmt: skip
    assert unknown_variables(env) == [
        "LIGHTSHIP_PORTS is not a serve setting and is ignored (did you mean LIGHTSHIP_PORT?)"
    ]


def test_a_model_routed_to_the_amx_gemm_is_served_elsewhere_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    routed = {"target": "vnni", "gemm_convs": {"convs": ["c"], "kept": True}}
    run = make_run(tmp_path, {"onnx-int8-static": routed})
    model = choose(ServeSettings(run=run, variant="onnx-int8-static"))
    verify(model, "refuse", cpu=VNNI)  # correct everywhere: a warning, not a refusal
    assert "no AMX" in caplog.text and "`lightship quantize` on this machine" in caplog.text
    caplog.clear()
    amx = CpuInfo("test AMX CPU", "x86_64", VNNI.flags | {"amx_int8"})
    verify(model, "refuse", cpu=amx)
    assert "AMX" not in caplog.text


def test_a_report_with_nothing_to_serve_says_export_first(tmp_path: Path) -> None:
    run = make_run(tmp_path, {})
    (run / "report").mkdir()
    (run / "report" / "report.json").write_text(json.dumps({"recommended": None, "variants": []}))
    with pytest.raises(RunError) as err:  # no best.ckpt to export: a model image's copy
        choose(ServeSettings(run=run))
    assert str(err.value).endswith(
        "has none to serve yet, and no best.ckpt to make one from (a model image holds only a "
        "run's manifest, ONNX files and report): rebuild the image from a run that has it: "
        "`make export report docker-model RUN=runs/NAME`"
    )
    (run / "best.ckpt").write_bytes(b"weights")
    with pytest.raises(RunError) as err:
        choose(ServeSettings(run=run))
    assert str(err.value).endswith(
        f"has none to serve yet: run `make export RUN={run}`, then `make report RUN={run}`"
    )


def test_an_invalid_variable_a_flag_overrides_is_warned_of(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The flag wins, so the variable was never read: without a word, the server stopped on it
    the day the flag was dropped."""
    from lightship.serve.command import _settings
    from lightship.serve.settings import shadowed_invalid

    for name in list(os.environ):
        if name.upper().startswith("LIGHTSHIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("LIGHTSHIP_TOP_K", "notanint")
    monkeypatch.setenv("LIGHTSHIP_MAX_BATCH_ROWS", "32")  # valid: nothing to say
    monkeypatch.setenv("LIGHTSHIP_MAX_QUEUE_ROWS", "8")  # alone valid; its conflict is beside
    assert _settings(top_k=1, max_batch_rows=4, max_queue_rows=64).top_k == 1
    (said,) = shadowed_invalid({"top_k": 1, "max_batch_rows": 4, "max_queue_rows": 64})
    assert said.startswith("LIGHTSHIP_TOP_K='notanint' is not a valid value (Input should be a")
    assert said.endswith(
        "--top-k is used instead, and the server would stop on it without that flag"
    )
    assert shadowed_invalid({"max_batch_rows": 4, "max_queue_rows": 64}) == []
    monkeypatch.setenv("LIGHTSHIP_TOP_K", "")  # empty counts as unset, warned of elsewhere
    assert shadowed_invalid({"top_k": 1}) == []
    # valid alone, at odds with another setting: the server stopped on it without the flag
    monkeypatch.delenv("LIGHTSHIP_MAX_BATCH_ROWS")
    (said,) = shadowed_invalid({"max_queue_rows": 128})
    assert said == (
        "without --max-queue-rows, the server would stop on its variable: --max-queue-rows / "
        "LIGHTSHIP_MAX_QUEUE_ROWS (8) must be at least --max-batch-rows / "
        "LIGHTSHIP_MAX_BATCH_ROWS (64): the queue has to hold one full batch"
    )
    with pytest.raises(ConfigError):  # as it would
        _settings()
    # the variant, checked by serve rather than pydantic
    from lightship.serve.command import _shadowed

    monkeypatch.delenv("LIGHTSHIP_MAX_QUEUE_ROWS")
    monkeypatch.setenv("LIGHTSHIP_VARIANT", "bogus")
    (said,) = _shadowed({"variant": "auto"})
    assert said.startswith("unknown LIGHTSHIP_VARIANT 'bogus'; choose from auto, onnx-fp32")
    assert said.endswith("; --variant is used instead")
    monkeypatch.setenv("LIGHTSHIP_VARIANT", "torchscript")
    assert _shadowed({"variant": "auto"}) == []
