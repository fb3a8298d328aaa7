"""The serving benchmark's pieces that need no server: request bodies, metrics, the table."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, cast

import click
import numpy as np
import pytest
import typer

from lightship.cli import app
from lightship.errors import ConfigError, LightshipError, RunError
from lightship.runs import RunDir
from lightship.runtime.base import physical_cores
from lightship.serve import bench, v2
from tests.conftest import ROOT
from tests.handmade import batch_rows, handmade_onnx


def test_benchmark_bodies_are_valid_v2_requests_for_the_same_image() -> None:
    bodies = bench.request_bodies((1, 8, 8), "pixels")
    as_json = v2.decode_request(bodies["json"][0], None, "pixels")
    binary_body, header_length = bodies["binary"]
    as_binary = v2.decode_request(binary_body, str(header_length), "pixels")
    assert as_json.x.shape == as_binary.x.shape == (1, 1, 8, 8)
    np.testing.assert_array_equal(as_json.x, as_binary.x)
    assert [o.binary for o in as_binary.outputs] == [True]
    assert [o.binary for o in as_json.outputs] == [False]


def test_batch_rows_are_read_from_the_metrics_exposition() -> None:
    text = (
        "# TYPE lightship_batch_rows histogram\n"
        'lightship_batch_rows_bucket{le="1.0"} 3.0\n'
        "lightship_batch_rows_count 7.0\n"
        "lightship_batch_rows_sum 41.0\n"
    )
    assert bench._batch_rows(text) == (41.0, 7.0)
    assert bench._batch_rows("") == (0.0, 0.0)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc only")
def test_cpu_sample_tells_the_main_thread_from_the_others() -> None:
    import os
    import threading
    import time

    def burn(seconds: float) -> None:
        start = time.thread_time()
        while time.thread_time() - start < seconds:
            pass

    first = bench.cpu_sample(os.getpid())
    worker = threading.Thread(target=burn, args=(0.4,))
    worker.start()
    worker.join()
    second = bench.cpu_sample(os.getpid())
    burn(0.3)
    third = bench.cpu_sample(os.getpid())
    assert first is not None and second is not None and third is not None

    # /proc counts in clock ticks (10 ms): allow two of them either way, counted in ticks (as
    # seconds, 31.31 - 30.93 is 0.3799999..., and exactly two ticks short failed)
    def ticks(seconds: float) -> int:
        return round(seconds * os.sysconf("SC_CLK_TCK"))

    assert ticks(second.others_s - first.others_s) >= ticks(0.4) - 2
    assert second.main_s - first.main_s < 0.2  # the main thread only waited
    assert ticks(third.main_s - second.main_s) >= ticks(0.3) - 2
    # the machine's busy and total seconds: equal on a machine busy throughout (as under a
    # loaded CI run), where the float differences may then part in their last bit
    assert 0 < third.busy - first.busy <= third.total - first.total + 1e-6
    assert bench.cpu_sample(2**22 + 7) is None  # no such process


def test_each_cell_reports_its_median_cpu_figures_and_the_table_shows_them() -> None:
    cells = []
    for r, (loop_us, cores, busy) in enumerate([(200.0, 1.7, 0.96), (260.0, 1.8, 0.98)]):
        for endpoint, loop in (
            (bench.SERVER, loop_us),
            (bench.SAME_PATH, loop_us / 4),
            (bench.FASTAPI, loop_us / 2),
        ):
            cell = _cell(endpoint, "binary", 16, r, 600.0)
            cell.loop_us_per_request = loop
            cell.other_threads_cores = cores if endpoint == bench.SERVER else 0.0
            cell.machine_busy = busy
            cells.append(cell)
    load, _, _ = bench.summarise(cells, [700.0, 700.0], [16])
    server = next(x for x in load if x["endpoint"] == bench.SERVER)
    assert server["loop_us_per_request"] == 230.0
    assert server["other_threads_cores"] == 1.75
    assert server["machine_busy"] == 0.97
    # event loop: server / same path / FastAPI
    assert "| 0.86 | 230 / 58 / 115 | 1.75 | 97% |" in _table(cells, [700.0, 700.0], 2)
    # figures that could not be measured (no /proc) print as a dash
    unmeasured = [
        _cell(bench.SERVER, "binary", 16, 0, 600.0),
        _cell(bench.SAME_PATH, "binary", 16, 0, 1200.0),
        _cell(bench.FASTAPI, "binary", 16, 0, 900.0),
    ]
    assert "| 0.86 | - / - / - | - | - |" in _table(unmeasured, [700.0], 1)


# as report.json's `cpu`
TEST_CPU = {
    "model": "Test CPU",
    "arch": "x86_64",
    "int8_flags": ["avx2", "avx512_vnni", "amx_int8"],
    "target": "vnni",
}


def _table(cells: list[bench.LoadResult], in_process: list[float], rounds: int) -> str:
    """The benchmark's markdown for one ResNet-18 model measured as `cells` at 16 connections."""
    load, ratios, ranges = bench.summarise(cells, in_process, [16])
    model = {
        "model": "resnet18",
        "variant": "onnx-int8-static",
        "in_process_ceiling": {"rows_per_s": in_process[0], "best_batch": 64},
        "load": load,
        "ratios": ratios,
        "ratio_ranges": ranges,
    }
    return bench.markdown(
        {"cpu": TEST_CPU, "cores": 2, "duration_s": 4.0, "rounds": rounds, "models": [model]}
    )


def _cell(endpoint: str, protocol: str, c: int, r: int, rps: float) -> bench.LoadResult:
    batch = 12.0 + r if endpoint == bench.SERVER else None
    return bench.LoadResult(
        "digits", endpoint, protocol, c, r, int(rps * 4), rps, 1.0 + r, 2.0, 2.5 + r, 0, 0, batch
    )


def test_ratios_are_taken_within_each_round_then_the_median() -> None:
    # Round 1 is a slow patch for everything; in round 2 only the FastAPI cell is slow.
    server_json, fastapi_json = [900.0, 450.0, 900.0], [1000.0, 900.0, 500.0]
    cells = []
    for r in range(3):
        k = 0.5 if r == 1 else 1.0
        cells += [
            _cell(bench.SERVER, "json", 16, r, server_json[r]),
            _cell(bench.SAME_PATH, "json", 16, r, 2000 * k),
            _cell(bench.FASTAPI, "json", 16, r, fastapi_json[r]),
            _cell(bench.SERVER, "binary", 16, r, 1200 * k),
            _cell(bench.SAME_PATH, "binary", 16, r, 3000 * k),
            _cell(bench.FASTAPI, "binary", 16, r, 1500 * k),
        ]
    in_process = [1000.0, 500.0, 1000.0]
    load, ratios, ranges = bench.summarise(cells, in_process, [16])
    # Per round 0.9, 0.5, 1.8: the median is 0.9 (a ratio of the medians would say 1.0).
    assert ratios["server_vs_fastapi"]["json"]["16"] == 0.9
    assert ranges["server_vs_fastapi"]["json"]["16"] == [0.5, 1.8]
    assert ranges["server_vs_in_process"]["json"]["16"] == [0.9, 0.9]
    assert ratios["server_vs_fastapi"]["binary"]["16"] == 0.8
    # Per round 0.45, 0.45, 0.45 and 0.4: each ceiling has its own ratio.
    assert ratios["server_vs_same_path"] == {
        "json": {"16": 0.45, "peak": 0.45},
        "binary": {"16": 0.4, "peak": 0.4},
    }
    assert ratios["server_vs_in_process"] == {"json": {"16": 0.9}, "binary": {"16": 1.2}}
    assert ratios["binary_vs_json"][bench.SERVER] == {"16": 1.333}
    assert ratios["binary_vs_json"][bench.SAME_PATH] == {"16": 1.5}
    assert ratios["binary_vs_json"][bench.FASTAPI] == {"16": 1.5}
    # Each cell reports its median over the rounds and keeps every round's figure.
    json_cell = next(x for x in load if x["endpoint"] == bench.SERVER and x["protocol"] == "json")
    assert json_cell["req_per_s"] == 900.0
    assert json_cell["req_per_s_by_round"] == [900.0, 450.0, 900.0]
    assert json_cell["rounds"] == 3
    assert json_cell["p50_ms"] == 2.0  # median of 1, 2, 3
    assert json_cell["p99_ms_max"] == 4.5
    assert json_cell["mean_batch_rows"] == 13.0
    assert json_cell["served"] == 4 * (900 + 450 + 900)
    assert json_cell["failed"] == 0


def test_the_server_is_held_to_the_in_process_ceiling_measured_just_before_its_cell() -> None:
    # Round 1's in-process figure came in a slow patch that had passed by the binary cell
    cells = []
    for r, (json_beside, binary_beside) in enumerate([(1000.0, 1000.0), (500.0, 1000.0)]):
        for protocol, beside in (("json", json_beside), ("binary", binary_beside)):
            cell = _cell(bench.SERVER, protocol, 16, r, 900.0)
            cell.in_process_rows_per_s = beside
            cells.append(cell)
    cells.append(_cell(bench.SERVER, "json", 64, 0, 800.0))  # none measured: its round's
    load, ratios, ranges = bench.summarise(cells, [1000.0, 500.0], [16, 64])
    assert ranges["server_vs_in_process"]["binary"]["16"] == [0.9, 0.9]  # not 0.9 and 1.8
    assert ranges["server_vs_in_process"]["json"]["16"] == [0.9, 1.8]
    assert ratios["server_vs_in_process"]["json"]["64"] == 0.8
    binary = next(x for x in load if x["protocol"] == "binary")
    assert binary["in_process_rows_per_s"] == 1000.0  # the median of the cell's own figures


def test_a_missing_round_is_left_out_of_the_ratio_not_counted_as_zero() -> None:
    cells = [
        _cell(bench.SERVER, "json", 1, 0, 500.0),
        _cell(bench.FASTAPI, "json", 1, 0, 1000.0),
        _cell(bench.SERVER, "json", 1, 1, 600.0),
        _cell(bench.FASTAPI, "json", 1, 1, 0.0),  # wrk got nothing through
    ]
    _, ratios, ranges = bench.summarise(cells, [1000.0, 1000.0], [1])
    assert ratios["server_vs_fastapi"]["json"]["1"] == 0.5
    assert ranges["server_vs_fastapi"]["json"]["1"] == [0.5, 0.5]
    assert ratios["server_vs_in_process"]["json"]["1"] == 0.55


def test_peak_ratio_is_each_endpoints_best_concurrency_within_a_round() -> None:
    # Round 0: the server peaks at 64 connections (900), the no-model endpoint at 16 (1000).
    # Round 1: both at 16; the no-model endpoint is slow that round. A missing cell is skipped.
    rates = {
        (bench.SERVER, 16): [800.0, 700.0],
        (bench.SERVER, 64): [900.0, 600.0],
        (bench.FASTAPI, 16): [1000.0, 800.0],
        (bench.FASTAPI, 64): [700.0, math.nan],
    }
    cells = [
        _cell(endpoint, protocol, c, r, rps[r])
        for (endpoint, c), rps in rates.items()
        for protocol in ("json", "binary")
        for r in range(2)
        if not math.isnan(rps[r])
    ]
    _, ratios, ranges = bench.summarise(cells, [1000.0, 1000.0], [16, 64])
    # per round 900/1000 and 700/800: the median of 0.9 and 0.875
    assert ratios["server_vs_fastapi"]["json"]["peak"] == 0.887
    assert ratios["server_vs_fastapi"]["binary"]["peak"] == 0.887
    assert ratios["server_vs_fastapi"]["json"]["16"] == 0.838  # 0.8 and 0.875
    assert ranges["server_vs_fastapi"]["json"]["peak"] == [0.875, 0.9]


def test_in_process_sweep_stays_within_the_servers_batch_limit(tmp_path: Path) -> None:
    from lightship.runtime import load_predictor

    predictor = load_predictor(handmade_onnx(tmp_path / "m.onnx"), threads=1)
    sweep = bench.in_process_sweep(predictor, max_batch_rows=20, seconds=0.05)
    assert sorted(sweep) == [1, 8, 16, 20]
    assert all(v > 0 for v in sweep.values())


def test_a_slow_patch_during_the_in_process_sweep_lowers_no_batch_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sizes are timed in rounds that take them in turn, and the median kept: timed one
    after another, the sizes a slow patch of the machine fell on read slow (ResNet-18 on the
    AVX2 EPYC: 151 rows/s at batch 8, then 270-285 at every size swept again)."""
    from lightship.runtime import load_predictor

    predictor = load_predictor(handmade_onnx(tmp_path / "m.onnx"), threads=1)
    timed: list[tuple[int, float]] = []

    def rows_per_s(_: Any, x: np.ndarray, seconds: float, *args: Any, **kwargs: Any) -> float:
        timed.append((len(x), seconds))
        return 400.0 if 2 <= len(timed) <= 4 else 1000.0  # three timings in a slow patch

    monkeypatch.setattr(bench, "_rows_per_s", rows_per_s)
    sweep = bench.in_process_sweep(predictor, max_batch_rows=20, seconds=0.6)
    assert sweep == {1: 1000.0, 8: 1000.0, 16: 1000.0, 20: 1000.0}
    assert timed == [(b, pytest.approx(0.2)) for _ in range(3) for b in (1, 8, 16, 20)]


def test_the_in_process_sweep_runs_the_batches_the_server_runs_padding_included(
    tmp_path: Path,
) -> None:
    """It times `logits`, the batcher's call: on a GPU, where batches are padded to powers of
    two, a batch of --max-batch-rows 12 rows runs as 16, in the server and in the ceiling."""
    from lightship.runtime import load_predictor

    predictor = load_predictor(handmade_onnx(tmp_path / "m.onnx"), threads=1)
    predictor.pads = True
    seen = batch_rows(predictor)
    sweep = bench.in_process_sweep(predictor, max_batch_rows=12, seconds=0.03, rounds=1)
    assert sorted(sweep) == [1, 8, 12]
    assert set(seen) == {1, 8, 16}


def _results(cells: list[bench.LoadResult], **model: Any) -> dict[str, Any]:
    """What `bench` hands `markdown`: one digits model measured as `cells` at 16 connections."""
    load, ratios, ranges = bench.summarise(cells, [9000.0], [16])
    digits = {
        "model": "digits",
        "variant": "onnx-int8-static",
        "in_process_ceiling": {"rows_per_s": 9000.0, "best_batch": 64},
        "load": load,
        "ratios": ratios,
        "ratio_ranges": ranges,
        "startup": {"seconds": 0.81, "correct": True},
    }
    return {
        "cpu": TEST_CPU,
        "cores": 2,
        "duration_s": 5.0,
        "rounds": 1,
        "models": [digits | model],
    }


def test_markdown_shows_each_server_row_beside_both_no_model_endpoints_and_the_ratios() -> None:
    cells = [
        _cell(bench.SERVER, "binary", 16, 0, 1500.0),
        _cell(bench.SAME_PATH, "binary", 16, 0, 6000.0),
        _cell(bench.FASTAPI, "binary", 16, 0, 4000.0),
        _cell(bench.SERVER, "json", 16, 0, 1200.0),
        _cell(bench.SAME_PATH, "json", 16, 0, 4000.0),
        _cell(bench.FASTAPI, "json", 16, 0, 3000.0),
    ]
    table = bench.markdown(_results(cells))
    # the CPU as report.md names it, int8 flags and all: the model served may be int8
    assert table.startswith(
        "CPU: Test CPU (x86_64; avx2 avx512_vnni amx_int8), this CPU's int8 target vnni, 2 cores; one "
        "image per request;"
    )
    header = table.splitlines()[2]
    assert "| × same-path no-model | × FastAPI no-model | × in-process |" in header
    assert "× no-model |" not in header  # no endpoint goes by that name alone any more
    # server req/s, failed, p50, p99, mean batch, no-model req/s (same path / FastAPI), ratios
    assert (
        "| digits (onnx-int8-static) | binary | 16 | 1500 | 0 | 1.00 | 2.50 | 12.0 "
        "| 6000 / 4000 | 0.25 | 0.38 | 0.17 |" in table
    )
    assert "9000 rows/s at batch 64" in table
    assert "c=16: 1.25 (same path 1.50, FastAPI 1.33)" in table
    assert (
        "against each no-model endpoint's best: same path JSON 0.30, binary 0.25; "
        "FastAPI JSON 0.40, binary 0.38" in table
    )
    assert "first answer 0.81 s" in table
    assert "parsed off the event loop" not in table


def test_markdown_says_when_a_body_is_parsed_off_the_loop_by_the_server_only() -> None:
    cells = [_cell(e, "json", 16, 0, 1000.0) for e in bench.ENDPOINTS]
    table = bench.markdown(_results(cells, bodies_parsed_off_loop=["json"]))
    assert "json bodies are large enough to be parsed off the event loop by the server" in table
    # The benchmark's own one-image bodies are not, for either model: like for like.
    from lightship.serve.app import LARGE_BODY_BYTES

    for chw in ((1, 28, 28), (3, 32, 32)):
        assert all(len(b) < LARGE_BODY_BYTES for b, _ in bench.request_bodies(chw, "x").values())


def test_markdown_counts_and_names_each_cell_with_failed_requests() -> None:
    cells = [_cell(e, p, 16, 0, 1000.0) for e in bench.ENDPOINTS for p in bench.PROTOCOLS]
    failing = next(c for c in cells if (c.endpoint, c.protocol) == (bench.SERVER, "json"))
    failing.non2xx, failing.socket_errors = 120, 3
    table = bench.markdown(_results(cells))
    assert "| digits (onnx-int8-static) | json | 16 | 1000 | 123 |" in table
    assert "| digits (onnx-int8-static) | binary | 16 | 1000 | 0 |" in table
    assert (
        "- **digits, server, json at 16 connections: 123 requests failed** (120 error answers, "
        "3 socket errors or timeouts, over 1 round(s)); its req/s counts 2xx answers only, "
        "its p50/p99 every answer (wrk times error answers too)" in table
    )
    assert table.count("requests failed") == 1


def test_markdown_gives_each_ratio_the_range_of_its_rounds() -> None:
    cells = []
    for r, (server, no_model) in enumerate([(1000.0, 2000.0), (900.0, 1000.0), (800.0, 1000.0)]):
        for protocol in ("json", "binary"):
            cells += [
                _cell(bench.SERVER, protocol, 16, r, server),
                _cell(bench.SAME_PATH, protocol, 16, r, 2 * no_model),
                _cell(bench.FASTAPI, protocol, 16, r, no_model),
            ]
    table = _table(cells, [1000.0, 1000.0, 1000.0], 3)
    # × same path per round 0.25, 0.45, 0.4; × FastAPI 0.5, 0.9, 0.8; × in-process 1.0, 0.9, 0.8
    assert "| 0.40 (0.25–0.45) | 0.80 (0.50–0.90) | 0.90 (0.80–1.00) |" in table
    assert "c=16: 1.00 (same path 1.00, FastAPI 1.00)" in table  # the same every round: no range


def _model(
    name: str, rates: dict[tuple[str, str, int], list[float]], in_process: list[float], **more: Any
) -> dict[str, Any]:
    """A model's entry in the results, measured at `rates` ((endpoint, protocol, concurrency):
    req/s by round), its p99 in ms the round's number x 100 + the concurrency."""
    cells = []
    for (endpoint, protocol, c), by_round in rates.items():
        for r, rps in enumerate(by_round):
            cell = _cell(endpoint, protocol, c, r, rps)
            cell.model, cell.p99_ms = name, 100.0 * r + c
            cells.append(cell)
    concurrency = sorted({c for _, _, c in rates})
    load, ratios, ranges = bench.summarise(cells, in_process, concurrency)
    return {
        "model": name,
        "variant": "onnx-int8-static",
        "in_process_ceiling": {"rows_per_s": in_process[0], "best_batch": 64},
        "load": load,
        "ratios": ratios,
        "ratio_ranges": ranges,
    } | more


def test_the_serving_targets_are_judged_on_the_figures_the_run_measured() -> None:
    s, f = bench.SERVER, bench.FASTAPI
    resnet = _model(
        "resnet18",
        {(s, "json", 16): [800.0, 850.0], (s, "binary", 16): [920.0, 900.0]}
        | {(s, p, 64): [950.0, 950.0] for p in bench.PROTOCOLS},
        [1000.0, 1000.0],
        startup={"seconds": 1.9, "correct": True},
    )
    digits = _model(
        "digits",
        {
            (s, "json", 16): [1000.0, 1000.0],
            (s, "json", 64): [1200.0, 1100.0],
            (s, "binary", 16): [1400.0, 1200.0],
            (s, "binary", 64): [1500.0, 1400.0],
            (f, "json", 16): [1300.0, 1000.0],
            (f, "json", 64): [1250.0, 1500.0],
        },
        [9000.0, 9000.0],
        startup={"seconds": 0.7, "correct": True},
    )
    results = {"cpu": TEST_CPU, "cores": 2, "duration_s": 4, "rounds": 2}
    judged = {
        g["goal"].split(":")[0]: g for g in bench.goals(results | {"models": [resnet, digits]})
    }
    assert list(judged) == [
        "ResNet-18 at 16 connections",
        "p99 at 64 connections ≤ 800 ms",
        "digits over JSON",
        "digits",
        "first correct answer ≤ 2 s after the server process starts",
    ]
    # the better protocol: binary 0.92 and 0.90 (median 0.91), JSON 0.825
    resnet_16 = judged["ResNet-18 at 16 connections"]
    assert (resnet_16["value"], resnet_16["bound"], resnet_16["met"]) == (0.91, 0.9, True)
    assert resnet_16["figures"] == "json 0.82 (0.80–0.85), binary 0.91 (0.90–0.92)"
    # the worst round of any model and protocol at 64 connections: round 1, 164 ms
    p99 = judged["p99 at 64 connections ≤ 800 ms"]
    assert (p99["value"], p99["met"]) == (164.0, True)
    # best against best in each round: 1200 / 1300 and 1100 / 1500, median 0.83
    fastapi = judged["digits over JSON"]
    assert (fastapi["value"], fastapi["bound"], fastapi["met"]) == (0.828, 0.9, False)
    assert fastapi["figures"] == "0.83 (0.73–0.92), best against best"
    # binary / JSON: 1.3 at 16 connections (1.4 and 1.2), 1.26 at 64: the best concurrency
    binary = judged["digits"]
    assert (binary["value"], binary["bound"], binary["met"]) == (1.3, 1.3, True)
    assert binary["figures"] == "c=16: 1.30 (1.20–1.40), c=64: 1.26 (1.25–1.27)"
    first = judged["first correct answer ≤ 2 s after the server process starts"]
    assert (first["value"], first["met"]) == (1.9, True)
    assert first["figures"] == "resnet18 1.90 s, digits 0.70 s"
    # a wrong first answer misses it, however soon
    digits["startup"] = {"seconds": 0.7, "correct": False}
    first = bench.goals(results | {"models": [resnet, digits]})[-1]
    assert not first["met"] and "(a WRONG answer: digits)" in first["figures"]
    table = bench.markdown(results | {"models": [resnet, digits]})
    assert "| digits over JSON: req/s ≥ 0.90 of the FastAPI no-model endpoint's " in table
    assert "| 0.83 (0.73–0.92), best against best | **missed**: 0.828 < 0.9 |" in table
    assert "| c=16: 1.30 (1.20–1.40), c=64: 1.26 (1.25–1.27) | met: 1.3 ≥ 1.3 |" in table
    assert "; the worst round) | met: 164 ≤ 800 |" in table
    assert (
        "| resnet18 1.90 s, digits 0.70 s (a WRONG answer: digits) | **missed**: a wrong" in table
    )
    # a figure the table rounds to its bound still shows the side it fell on
    near = {"value": 0.8974, "bound": 0.9, "rule": ">=", "right": True, "met": False}
    assert bench._verdict(near) == "**missed**: 0.897 < 0.9"
    # and one three figures round onto it, with as many more as it takes
    for value, shown in [(1.299, "1.299"), (1.2996, "1.2996"), (0.89996, "0.89996")]:
        near = {"value": value, "bound": round(value, 1), "rule": ">=", "right": True}
        assert bench._verdict(near | {"met": False}) == f"**missed**: {shown} < {near['bound']:g}"
    at = {"value": 1.3, "bound": 1.3, "rule": ">=", "right": True, "met": True}
    assert bench._verdict(at) == "met: 1.3 ≥ 1.3"


def test_a_target_whose_cells_the_run_left_out_is_not_judged() -> None:
    # digits alone, JSON at one connection: no ResNet-18, nothing at 64 connections, no
    # FastAPI cell, no binary one, no first answer
    s = bench.SERVER
    digits = _model("digits", {(s, "json", 1): [500.0]}, [9000.0])
    results = {"cpu": TEST_CPU, "cores": 2, "duration_s": 4, "rounds": 1, "models": [digits]}
    assert bench.goals(results) == []
    assert "performance targets" not in bench.markdown(results)


def test_markdown_names_the_gpu_beside_the_cpu_when_the_model_ran_on_one() -> None:
    results = _results([_cell(bench.SERVER, "json", 16, 0, 1200.0)])
    assert "GPU" not in bench.markdown(results).splitlines()[0]  # a CPU run, as before
    gpu = bench.markdown(results | {"device": "cuda", "gpu": "NVIDIA H200"}).splitlines()[0]
    assert ", 2 cores; GPU: NVIDIA H200; one image per request" in gpu
    unnamed = bench.markdown(results | {"device": "cuda:1", "gpu": None}).splitlines()[0]
    assert "; GPU: cuda:1; " in unnamed  # nvidia-smi could not tell


def test_the_first_answer_is_right_by_label_and_logits_within_the_devices_tolerance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import types

    import httpx

    expected = np.array([0.5, 2.0, -1.0], np.float32)
    served: list[float] = []
    answer = lambda *args, **kwargs: httpx.Response(  # noqa: E731
        200, json={"outputs": [{"name": "logits", "data": served}]}
    )
    client = types.SimpleNamespace(post=answer)  # the client that polled the server
    proc = cast(bench._Process, types.SimpleNamespace(spawned=time.monotonic(), client=client))

    def first(logits: list[float], atol: float) -> dict[str, Any]:
        served[:] = logits
        return bench._first_answer(proc, "http://x/infer", b"{}", expected, atol)

    near = [0.505, 2.0, -1.0]  # TF32 on a GPU: off by 5e-3
    assert first(near, bench.FIRST_ANSWER_ATOL["cpu"])["correct"] is False
    tf32 = first(near, bench.FIRST_ANSWER_ATOL["cuda"])
    assert tf32["correct"] is True and tf32["max_abs_logit_diff"] == pytest.approx(5e-3, abs=1e-6)
    assert first([2.0, 0.5, -1.0], 10.0)["correct"] is False  # another label: wrong at any atol
    assert first([0.5, 2.0, -1.0], 1e-4) == {
        "seconds": pytest.approx(0, abs=5),
        "status": 200,
        "correct": True,
        "max_abs_logit_diff": 0.0,
    }


def test_the_gpu_is_named_by_nvidia_smi_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\n[ "$2" = 1 ] && exit 6\necho "NVIDIA Test $2"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert bench.gpu_name("cuda") == "NVIDIA Test 0"  # -i 0
    assert bench.gpu_name("cuda:2") == "NVIDIA Test 2"
    assert bench.gpu_name("cuda:1") is None  # nvidia-smi failed: no name, no error
    assert bench.gpu_name("cpu") is None
    # CUDA's cuda:0 is the first GPU listed, which nvidia-smi numbers among them all
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 2")
    assert bench.gpu_name("cuda") == "NVIDIA Test 3"
    assert bench.gpu_name("cuda:1") == "NVIDIA Test 2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f2c")
    assert bench.gpu_name("cuda:0") == "NVIDIA Test GPU-8f2c"  # a UUID, as nvidia-smi takes it
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CUDA sees no GPU
    assert bench.gpu_name("cuda") is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,foo,3")  # CUDA stops at foo
    assert (bench.gpu_name("cuda:0"), bench.gpu_name("cuda:1")) == ("NVIDIA Test 2", None)


def test_a_ceiling_not_measured_prints_as_a_dash() -> None:
    cells = [_cell(bench.SERVER, "json", 16, 0, 1000.0), _cell(bench.FASTAPI, "json", 16, 0, 2e3)]
    assert "| - / 2000 | - | 0.50 |" in _table(cells, [1000.0], 1)


def test_each_round_alternates_the_protocol_measured_first_and_rotates_the_endpoints() -> None:
    rounds = bench.schedule(4, [1, 16])
    for cells in rounds:  # every cell of every endpoint, once a round
        assert sorted(cells) == sorted(
            (e, p, c) for e in bench.ENDPOINTS for p in bench.PROTOCOLS for c in (1, 16)
        )
    assert [cells[0][1] for cells in rounds] == ["json", "binary", "json", "binary"]
    # within each protocol and connection count, the endpoints take turns at going first
    assert [cells[0][0] for cells in rounds] == [*bench.ENDPOINTS, bench.SERVER]
    assert rounds[1][:3] == [
        (bench.SAME_PATH, "binary", 1),
        (bench.FASTAPI, "binary", 1),
        (bench.SERVER, "binary", 1),
    ]


# An HTTP/1.1 server (keep-alive, as wrk expects) that answers every other POST 429.
HALF_BUSY = """
import itertools, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

count, lock = itertools.count(), threading.Lock()

class HalfBusy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.answer(200)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        with lock:
            n = next(count)
        self.answer(429 if n % 2 else 200)

    def answer(self, status):
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[-1])), HalfBusy).serve_forever()
"""


@pytest.mark.skipif(shutil.which("wrk") is None, reason="needs wrk")
def test_error_answers_are_counted_as_failed_not_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import sys

    (tmp_path / "stub.py").write_text(HALF_BUSY)
    body = tmp_path / "body"
    body.write_bytes(bench.request_bodies((1, 2, 2), "input")["json"][0])
    proc = bench._Process([sys.executable, str(tmp_path / "stub.py")], tmp_path / "log", "/")
    try:
        cell = bench._cell(
            "digits", bench.FASTAPI, "json", 2, 0, proc, proc.url + "/infer", body, 0, 1.0
        )
    finally:
        proc.stop()
    # every other answer was a 429: about as many failed as were served, give or take the
    # requests in flight when wrk stopped
    assert cell.non2xx > 50 and cell.socket_errors == 0
    assert abs(cell.served - cell.non2xx) <= 2
    assert cell.failed == cell.non2xx
    assert cell.req_per_s == pytest.approx(cell.served, rel=0.2)  # in 1 s
    assert f"{cell.non2xx} requests failed ({cell.non2xx} error answers" in caplog.text
    assert "FAILED" in bench._cell_line(cell)


def test_the_same_path_ceiling_is_the_server_answering_without_its_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    import httpx

    from lightship.runtime import load_predictor
    from lightship.serve import app as serve_app
    from lightship.serve.ceiling import InstantBatcher
    from lightship.serve.model import ServedModel
    from lightship.serve.settings import ServeSettings

    path = handmade_onnx(tmp_path / "hand.onnx")
    predictor = load_predictor(path)
    runs: list[np.ndarray] = []
    model_run = predictor._run

    def counted(x: np.ndarray) -> np.ndarray:
        runs.append(x)
        return model_run(x)

    predictor._run = counted  # type: ignore[method-assign]
    monkeypatch.setattr(serve_app, "Batcher", InstantBatcher)
    app = serve_app.create_app(
        predictor, ServedModel("hand", "file", path, None), ServeSettings(run=path)
    )
    service = app.state.service
    x = np.array([[[[1, 2], [3, 4]]]], np.uint8)

    async def main() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            await asyncio.wait_for(service.settled.wait(), 10)
            assert service.ready
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                infer = "/v2/models/hand/infer"
                good = {"inputs": [{"name": "input", "shape": [1, 1, 2, 2], "datatype": "UINT8"}]}
                good["inputs"][0]["data"] = x.ravel().tolist()
                bad = {"inputs": [{"name": "input", "shape": [1, 1, 2, 3], "datatype": "UINT8"}]}
                bad["inputs"][0]["data"] = list(range(6))
                return [
                    await client.post(infer, json=good),
                    await client.post(infer, json=bad),
                    await client.post("/v2/models/other/infer", json=good),
                    await client.get("/metrics"),
                ]

    ok, wrong_shape, unknown, metrics = asyncio.run(main())
    assert isinstance(service.batcher, InstantBatcher) and service.batcher._threads == []
    # the model ran once, on the warm-up batch; the request got zeros of its logits' shape
    assert len(runs) == 1
    assert ok.status_code == 200
    assert ok.json()["outputs"][0]["shape"] == [1, 2]
    assert ok.json()["outputs"][0]["data"] == [0.0, 0.0]
    # the server's own checks and error answers, its metrics
    assert wrong_shape.status_code == 400 and "expected shape" in wrong_shape.json()["error"]
    assert unknown.status_code == 404
    assert 'route="/v2/models/{model_name}/infer",status="200"} 1.0' in metrics.text
    assert "lightship_batch_rows_count 0.0" in metrics.text


def test_the_same_path_ceiling_runs_as_lightship_serve_takes_its_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    import httpx

    made: list[httpx.Client] = []
    client_init = httpx.Client.__init__

    def counted(self: httpx.Client, *args: Any, **kwargs: Any) -> None:
        made.append(self)
        client_init(self, *args, **kwargs)

    monkeypatch.setattr(httpx.Client, "__init__", counted)
    path = handmade_onnx(tmp_path / "hand.onnx")
    cmd = [sys.executable, "-m", "lightship.serve.ceiling", "serve", "--run", str(path)]
    proc = bench._Process([*cmd, "--model-name", "hand"], tmp_path / "log")
    try:
        metrics = proc.get("/metrics")
        # polled until ready, and asked, with one client: a client a poll took 55 ms of CPU
        # each (an SSL context), from the server starting beside it
        assert len(made) == 1
        body, _ = bench.request_bodies((1, 2, 2), "input")["json"]
        answer = httpx.post(f"{proc.url}/v2/models/hand/infer", content=body, timeout=5)
    finally:
        proc.stop()
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [0.0, 0.0]
    assert bench._batch_rows(metrics) == (0.0, 0.0)


def test_bad_benchmark_arguments_get_one_line_that_says_how_to_fix() -> None:
    from tests.conftest import last_line, run_cli

    proc = run_cli("bench", "serve", "--concurrency", "1,sixteen")
    assert proc.returncode == 2
    assert last_line(proc.stderr) == (
        "error: --concurrency must list connection counts, e.g. 1,16,64; got '1,sixteen'"
    )
    assert "Traceback" not in proc.stderr
    with pytest.raises(LightshipError, match="--models.*choose from digits,resnet18"):
        bench.bench(Path("d"), Path("r"), 1.0, [1], Path("o.json"), models="digits,vgg")
    with pytest.raises(LightshipError, match="--rounds and --instances must be at least 1"):
        bench.bench(Path("d"), Path("r"), 1.0, [1], Path("o.json"), rounds=0)
    with pytest.raises(LightshipError, match="--duration must be a whole number of seconds"):
        bench.bench(Path("d"), Path("r"), 0.5, [1], Path("o.json"))  # wrk would refuse it
    for endless in (float("nan"), float("inf")):  # were int()'s traceback
        with pytest.raises(LightshipError, match=f"--duration must .* got {endless:g}"):
            bench.bench(Path("d"), Path("r"), endless, [1], Path("o.json"))
    with pytest.raises(LightshipError, match="unknown --variant 'int4'; choose from auto, "):
        bench.bench(Path("d"), Path("r"), 1.0, [1], Path("o.json"), variant="int4")
    with pytest.raises(LightshipError, match="--device must be cpu, cuda or cuda:N, got 'gpu'"):
        bench.bench(Path("d"), Path("r"), 1.0, [1], Path("o.json"), device="gpu")
    # checked before the benchmark trains the runs it lacks (minutes), not after
    proc = run_cli("bench", "serve", "--threads", "0", "--digits-run", "/nonexistent/run")
    assert proc.returncode == 2 and last_line(proc.stderr) == (
        "error: --threads must be 1 to 256 (default: cores / instances), got 0"
    )


def fake_stages(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """`bench._lightship` replaced by stages that only record what they would make: the
    arguments of each call, in order, are in the list returned."""
    from lightship.runs import RunDir

    calls: list[tuple[str, ...]] = []

    def fake(*args: str) -> None:
        calls.append(args)
        run = RunDir(Path(args[2]))
        if args[0] == "train":
            run.root.mkdir(parents=True)
            (run.root / "best.ckpt").write_bytes(b"x")
        elif args[0] == "export":
            name = {"onnx": "onnx-fp32"}.get(args[4], args[4])
            run.record(name, {"file": f"export/{name}"})
        elif args[0] == "quantize":
            run.record(f"onnx-int8-{args[4]}", {"file": f"quantize/{args[4]}.onnx"})
        elif args[0] == "report":
            run.report_dir.mkdir(parents=True, exist_ok=True)
            (run.report_dir / "report.json").write_text("{}")

    monkeypatch.setattr(bench, "_lightship", fake)
    return calls


def test_the_benchmark_makes_what_its_runs_lack_so_auto_serves_the_recommendation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = fake_stages(monkeypatch)
    run = tmp_path / "r"
    bench.ensure_run(run, "configs/resnet.yaml", "trainer.max_epochs=1")
    assert [c[0] for c in calls] == ["train", "export", "quantize", "report"]
    assert calls[0][3:] == ("--config", "configs/resnet.yaml", "--set", "trainer.max_epochs=1")
    assert calls[2][3:] == ("--methods", "static")
    calls.clear()
    bench.ensure_run(run, "configs/resnet.yaml")  # complete: nothing to make
    assert calls == []
    (run / "report" / "report.json").unlink()
    bench.ensure_run(run, "configs/resnet.yaml")  # quantized already: only the report
    assert [c[0] for c in calls] == ["report"]


def test_a_named_variant_gets_just_the_stages_that_make_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = fake_stages(monkeypatch)
    run = tmp_path / "r"
    run.mkdir()
    (run / "best.ckpt").write_bytes(b"x")
    bench.ensure_run(run, "configs/resnet.yaml", variant="torchscript")  # no ONNX, no report
    assert calls == [("export", "--run", str(run), "--formats", "torchscript")]
    calls.clear()
    bench.ensure_run(run, "configs/resnet.yaml", variant="torchscript")
    bench.ensure_run(run, "configs/resnet.yaml", variant="checkpoint")  # best.ckpt itself
    assert calls == []
    bench.ensure_run(run, "configs/resnet.yaml", variant="onnx-int8-dynamic")
    assert [c[4] for c in calls] == ["onnx", "dynamic"]  # the ONNX export it quantizes first
    assert [c[0] for c in calls] == ["export", "quantize"]
    calls.clear()
    bench.ensure_run(run, "configs/resnet.yaml", variant="onnx-fp32")
    assert calls == []
    assert not (run / "report").exists()


def test_the_benchmark_names_the_cpu_with_the_reports_int8_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from lightship.quantize import isa

    flags = frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni", "fma", "sse4_2"})
    monkeypatch.setattr(isa, "host_cpu", lambda: isa.CpuInfo("Test CPU", "x86_64", flags))
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(bench, "ensure_run", lambda run, *args, **kwargs: run)
    digits = _results([_cell(bench.SERVER, "json", 16, 0, 1200.0)])["models"][0]
    monkeypatch.setattr(bench, "bench_model", lambda *args: digits)
    out = tmp_path / "serve.json"
    bench.bench(tmp_path / "d", tmp_path / "r", 1.0, [16], out, rounds=1, models="digits")
    # `--out X.md`: the table went to X.md over the JSON, which was lost
    bench.bench(tmp_path / "d", tmp_path / "r", 1.0, [16], tmp_path / "t.md", 1, models="digits")
    assert json.loads((tmp_path / "t.json").read_text())["models"][0]["model"] == "digits"
    assert (tmp_path / "t.md").read_text().startswith("CPU: Test CPU")
    cpu = {
        "model": "Test CPU",
        "arch": "x86_64",
        "int8_flags": ["avx2", "avx512f", "avx512bw", "avx512_vnni"],
        "target": "vnni",
    }
    assert json.loads(out.read_text())["cpu"] == cpu  # report.json's `cpu`, flags and all
    header = out.with_suffix(".md").read_text().splitlines()[0]
    assert header.startswith(
        "CPU: Test CPU (x86_64; avx2 avx512f avx512bw avx512_vnni), this CPU's int8 target vnni, "
        f"{physical_cores()} cores;"  # those it may use (taskset, a CPU quota)
    )


def bench_serve_command() -> Any:
    group = typer.main.get_command(app)
    return group.commands["bench"].commands["serve"]  # type: ignore[attr-defined]


def test_bench_serve_help_says_what_it_writes_how_long_and_where_it_trains() -> None:
    command = bench_serve_command()
    text = " ".join(command.get_help(click.Context(command, info_name="serve")).split())
    defaults = {p.name: p.default for p in command.params}
    assert "a Markdown table beside it (OUT with .md)" in text, text
    # the time it states follows from the defaults: every cell of every model, every round
    cells = len(bench.ENDPOINTS) * len(bench.PROTOCOLS) * len(defaults["concurrency"].split(","))
    per_model = defaults["duration"] * defaults["rounds"] * cells
    per_model += 1.0 * defaults["rounds"] * cells / len(bench.ENDPOINTS)  # in-process, 1 s
    assert f"{defaults['duration']:g} s x {defaults['rounds']} rounds x {cells} cells" in text
    minutes = round(len(defaults["models"].split(",")) * per_model / 60)
    assert f"about {minutes} minutes" in text, text
    for run in (defaults["digits_run"], defaults["resnet_run"]):
        assert str(run) in text, run


def test_make_bench_serve_passes_bench_serve_args_and_only_its_options() -> None:
    env = {**os.environ, "MAKEFLAGS": ""}
    proc = subprocess.run(
        ["make", "-n", "bench-serve", "ARGS=--set trainer.max_epochs=3",
         "BENCH_SERVE_ARGS=--rounds 1"],
        cwd=ROOT, capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    (line,) = [x for x in proc.stdout.splitlines() if "lightship bench serve" in x]
    assert line.endswith("lightship bench serve --rounds 1"), line
    assert "bench-serve takes BENCH_SERVE_ARGS" in proc.stderr, proc.stderr
    # what `make help` shows for it is made of bench serve's own options
    help_text = subprocess.run(
        ["make", "help"], cwd=ROOT, capture_output=True, text=True, check=True, env=env
    ).stdout
    (shown,) = re.findall(r"BENCH_SERVE_ARGS='([^']*)'", help_text)
    options = {opt for param in bench_serve_command().params for opt in param.opts}
    assert {w for w in shown.split() if w.startswith("--")} <= options, shown
    (args_line,) = [x for x in help_text.splitlines() if x.startswith("  ARGS=")]
    assert "bench-serve" not in args_line, args_line


def test_a_broken_or_hanging_nvidia_smi_leaves_the_gpu_unnamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An nvidia-smi that cannot be run (OSError) or that hangs (TimeoutExpired) is
    no name, not an error that stops the benchmark."""
    smi = tmp_path / "nvidia-smi"
    smi.write_bytes(b"\x7fELF broken")  # executable, but no program: Exec format error
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert bench.gpu_name("cuda") is None

    def hangs(*args: Any, **kwargs: Any) -> Any:
        raise subprocess.TimeoutExpired(args[0], kwargs.get("timeout", 30))

    monkeypatch.setattr(subprocess, "run", hangs)
    assert bench.gpu_name("cuda:0") is None


def test_each_server_cell_carries_the_in_process_rate_measured_just_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench_model` measures the in-process ceiling right before each of the server's
    cells and keeps it on the cell; the no-model endpoints' cells get none. Servers, wrk and
    timing are faked: only the order of the measurements is under test."""
    from types import SimpleNamespace

    from lightship.runs import RunDir
    from lightship.runtime import load_predictor
    from lightship.serve import model as serve_model

    path = handmade_onnx(tmp_path / "hand.onnx")
    predictor = load_predictor(path, threads=1)
    spec = {"name": "input", "shape": ["batch", 1, 2, 2]}
    served = SimpleNamespace(
        variant="onnx-fp32",
        path=path,
        entry={"input_spec": spec, "labels": ["bright", "dark"]},
        load=lambda device, threads: predictor,
    )
    monkeypatch.setattr(serve_model, "choose", lambda settings: served)

    class Process:
        def __init__(self, cmd: list[str], log: Path) -> None:
            self.url = "http://127.0.0.1:1"

        def stop(self) -> None:
            pass

    events: list[tuple[str, Any]] = []
    rates = iter(float(n) for n in range(1, 1000))

    def rows_per_s(*args: Any, **kwargs: Any) -> float:
        events.append(("rate", rate := next(rates)))
        return rate

    def cell(label: str, endpoint: str, protocol: str, c: int, r: int, *rest: Any) -> Any:
        made = _cell(endpoint, protocol, c, r, 50.0)
        events.append(("cell", made))
        return made

    monkeypatch.setattr(bench, "_Process", Process)
    monkeypatch.setattr(bench, "_first_answer", lambda *a, **k: {"seconds": 0.1, "correct": True})
    monkeypatch.setattr(bench, "_wrk", lambda *a, **k: {})
    monkeypatch.setattr(bench, "in_process_sweep", lambda *a, **k: {1: 100.0})
    monkeypatch.setattr(bench, "_rows_per_s", rows_per_s)
    monkeypatch.setattr(bench, "_cell", cell)
    bench.bench_model("hand", RunDir(tmp_path), "onnx-fp32", [1], 0.1, 2, tmp_path, 1)

    cells = [(i, x) for i, (kind, x) in enumerate(events) if kind == "cell"]
    assert len(cells) == 2 * len(bench.ENDPOINTS) * len(bench.PROTOCOLS)
    for i, made in cells:
        if made.endpoint == bench.SERVER:
            assert events[i - 1] == ("rate", made.in_process_rows_per_s), events[i - 1]
        else:
            assert made.in_process_rows_per_s is None


NEVER_READY = """
import time
while True:
    time.sleep(1)
"""


def test_a_server_stopped_while_it_starts_is_not_left_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C or SIGTERM to the bench while a server started left it serving, adopted by
    init: it was recorded only once ready."""
    import sys

    (tmp_path / "stub.py").write_text(NEVER_READY)
    started: list[bench._Process] = []

    def interrupted(self: bench._Process, path: str, timeout: float = 120) -> None:
        started.append(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(bench._Process, "_wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench._Process([sys.executable, str(tmp_path / "stub.py")], tmp_path / "log")
    (proc,) = started
    assert proc.proc.poll() is not None  # stopped


def test_a_server_that_exits_says_what_it_wrote_not_a_log_since_deleted(tmp_path: Path) -> None:
    import sys

    (tmp_path / "stub.py").write_text(
        "import sys\nprint('error: port taken', flush=True)\nsys.exit(2)\n"
    )
    with pytest.raises(RunError) as err:
        bench._Process([sys.executable, str(tmp_path / "stub.py")], tmp_path / "log")
    assert str(err.value) == "server exited 2: error: port taken"


def test_an_invalid_serve_variable_is_one_line_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTSHIP_MAX_BATCH_ROWS", "abc")
    with pytest.raises(ConfigError) as err:
        bench.bench_model("digits", RunDir(tmp_path), "auto", [1], 1.0, 1, tmp_path, None)
    assert str(err.value).startswith(
        "invalid serve settings (LIGHTSHIP_MAX_BATCH_ROWS=abc: Input should be a valid integer"
    )
