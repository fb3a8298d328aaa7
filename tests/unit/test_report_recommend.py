"""Which variant the report recommends, and how report.md states it, the gate and the setup."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from lightship.quantize.fallback import DEFAULT_GATE, passes_gate
from lightship.report import render
from lightship.report.core import recommend
from lightship.report.measure import Timing

# Within-round img/s of the digits run's int8 variants (15 rounds of a report made alone):
# QAT ran 1.011x static (middle half 0.965-1.022), faster in 9 rounds of 15.
STATIC = [34500.0] * 15
RATIOS = "0.93 0.95 0.96 0.965 0.97 0.99 1.011 1.011 1.015 1.02 1.02 1.022 1.03 1.04 1.05"
QAT = [float(v) * 34500.0 for v in RATIOS.split()]


def row(name: str, sqnr: float | None, size: int, **kw: Any) -> dict[str, Any]:
    return {
        "name": name,
        "sqnr_db": sqnr,
        "bytes": size,
        "gate_passed": True,
        "recommendable": True,
        **kw,
    }


def test_variants_whose_within_round_ratio_straddles_one_tie_and_the_closer_to_fp32_wins() -> None:
    rows = [row("onnx-int8-static", 49.1, 166_000), row("onnx-int8-qat", 10.6, 174_000)]
    timings = {
        "onnx-int8-static": Timing(throughput=STATIC),
        "onnx-int8-qat": Timing(throughput=QAT),
    }
    assert timings["onnx-int8-qat"].speedup_over(timings["onnx-int8-static"]) > 1  # the fastest
    best, by = recommend(rows, timings, 64)
    assert best == "onnx-int8-static"
    assert by["fastest"] == "onnx-int8-qat"
    assert by["tied"] == ["onnx-int8-qat", "onnx-int8-static"] and by["tie_break"] == "sqnr"
    assert by["over"]["onnx-int8-static"]["ratio"] == pytest.approx(1.011)
    assert by["over"]["onnx-int8-static"]["iqr"] == pytest.approx([0.9675, 1.021], abs=5e-4)
    assert "then the smaller file" in by["rule"]


def test_a_variant_faster_in_most_rounds_wins_whatever_its_sqnr_or_its_median_img_s() -> None:
    # b ran 1.1x a in every round but one, where a slow patch of the machine fell on b alone;
    # the machine ran 3x faster in the last three rounds, and a's median img/s is the higher
    a = Timing(throughput=[1000.0, 1000.0, 3000.0, 3000.0, 3000.0])
    b = Timing(throughput=[1100.0, 1100.0, 1100.0, 3300.0, 3300.0])
    assert a.throughput_per_s > b.throughput_per_s
    rows = [row("a", 120.0, 100), row("b", 10.0, 200)]
    best, by = recommend(rows, {"a": a, "b": b}, 64)
    assert best == "b" and by["fastest"] == "b"
    assert by["tied"] == [] and by["tie_break"] is None


def test_a_tie_is_judged_on_the_spread_report_json_gives() -> None:
    # the fastest's ratio over b was 1.0004 at the 25th percentile: report.json showed
    # [1.0, ...], a tie by the rule it states, and the report had recommended no tie (CI once)
    a = Timing(throughput=[1000.4, 1000.4, 1000.4, 1100.0])
    b = Timing(throughput=[1000.0, 1000.0, 1000.0, 1000.0])
    rows = [row("a", 10.0, 100), row("b", 40.0, 100)]
    best, by = recommend(rows, {"a": a, "b": b}, 64)
    assert by["fastest"] == "a" and by["over"]["b"]["iqr"][0] == 1.0
    assert by["tied"] == ["a", "b"] and best == "b"  # the higher SQNR


def test_a_tie_at_the_same_sqnr_goes_to_the_smaller_file() -> None:
    rows = [row("torchscript", 120.0, 571_000), row("onnx-fp32", 120.0, 582_000)]
    same = Timing(throughput=[1000.0, 1010.0, 990.0, 1000.0])
    other = Timing(throughput=[1005.0, 1000.0, 1000.0, 995.0])
    best, by = recommend(rows, {"torchscript": other, "onnx-fp32": same}, 64)
    assert best == "torchscript" and by["tie_break"] == "bytes"


def test_a_size_tie_break_names_only_the_sizes_it_compared() -> None:
    # three tied: torchscript lost on SQNR, then onnx-fp32 won on size against static int8 of
    # the same SQNR; the note listed torchscript's size too, as if it had been compared
    rows = [
        row("onnx-int8-static", 120.0, 3_000_000),
        row("onnx-fp32", 120.0, 2_000_000),
        row("torchscript", 100.0, 1_000_000),
    ]
    even = Timing(throughput=[1000.0, 1010.0, 990.0, 1000.0])
    timings = {name: even for name in ("onnx-int8-static", "onnx-fp32", "torchscript")}
    best, by = recommend(rows, timings, 64)
    assert best == "onnx-fp32" and by["tie_break"] == "bytes"
    note = render.tie_note({"recommended": best, "recommended_by": by, "variants": rows})
    assert note.endswith(
        "chosen for the smaller file of those with its SQNR (torchscript: lower SQNR) "
        "(onnx-fp32 2.00 MB, onnx-int8-static 3.00 MB)"
    )


def test_only_variants_that_pass_the_gate_and_can_be_served_are_candidates() -> None:
    rows = [
        row("eager", None, 1, recommendable=False),
        row("fast", 30.0, 1, gate_passed=False),
        row("slow", 40.0, 1),
    ]
    timings = {
        "eager": Timing(throughput=[9000.0] * 3),
        "fast": Timing(throughput=[5000.0] * 3),
        "slow": Timing(throughput=[100.0] * 3),
    }
    assert recommend(rows, timings, 64)[0] == "slow"
    best, by = recommend(rows[:2], timings, 64)
    assert best is None and by["fastest"] is None and by["rule"]


def report_dict(**kw: Any) -> dict[str, Any]:
    """A report.json of two ONNX variants, for `render.markdown`."""
    variants = [
        {
            "name": name,
            "bytes": 166_000,
            "accuracy": 0.99,
            "delta_vs_fp32": 0.0,
            "sqnr_db": sqnr,
            "int8_share": 0.8,
            "latency_ms": {"p50": 0.06, "p90": 0.07, "p99": 0.1},
            "throughput_per_s": 34000.0,
            "gate_passed": True,
            "recommendable": True,
            "recommended": name == "onnx-int8-static",
            "nodes_fp32": [],
            "lanes": 2,
            "split_rows": 8,
            "batch1_threads": 1,
        }
        for name, sqnr in (("onnx-int8-static", 49.1), ("onnx-int8-qat", 10.6))
    ]
    return {
        "run": "runs/default",
        "cpu": {"model": "Xeon", "arch": "x86_64", "int8_flags": ["avx512_vnni"], "target": "vnni"},
        "threads": 2,
        "versions": {"lightship": "0.1.0"},
        "test_images": 269,
        "batch": 64,
        "rounds": 15,
        "gate": 0.99,
        "fp32_accuracy": 0.9963,
        "variants": variants,
        "recommended": "onnx-int8-static",
        "recommended_by": {
            "rule": "the rule",
            "fastest": "onnx-int8-qat",
            "over": {"onnx-int8-static": {"ratio": 1.011, "iqr": [0.965, 1.022]}},
            "tied": ["onnx-int8-qat", "onnx-int8-static"],
            "tie_break": "sqnr",
        },
        **kw,
    }


def test_report_md_states_the_rule_and_the_tie_it_broke() -> None:
    md = render.markdown(report_dict())
    assert (
        "Recommended (the rule): **onnx-int8-static** ★, tied in speed with onnx-int8-qat "
        "(within-round ratio onnx-int8-qat over onnx-int8-static 1.01 (0.96–1.02)), chosen for "
        "the higher SQNR vs fp32 (onnx-int8-static 49.1 dB, onnx-int8-qat 10.6 dB)\n"
    ) in md
    untied = report_dict()
    untied["recommended_by"] = {**untied["recommended_by"], "tied": [], "tie_break": None}
    assert "Recommended (the rule): **onnx-int8-static** ★\n" in render.markdown(untied)


@pytest.mark.parametrize(
    ("gate", "shown"),
    [(0.99, "99%"), (0.995, "99.5%"), (0.999, "99.9%"), (1.004, "100.4%"), (1.0, "100%")],
)
def test_the_gate_prints_as_given(gate: float, shown: str) -> None:
    assert render.gate_percent(gate) == shown
    assert f"a variant keeps >= {shown} of fp32 accuracy" in render.markdown(report_dict(gate=gate))


def test_a_variant_exactly_at_the_gate_passes() -> None:
    # 104 test images, fp32 100 right, int8 99: 99/104 >= 0.99 x 100/104 to the image, where
    # in floats 99/104 = 0.95192307692307687 < 0.99 * (100/104) = 0.95192307692307698
    assert 99 / 104 < 0.99 * (100 / 104)
    assert passes_gate(99 / 104, 100 / 104, 0.99, 104)
    assert not passes_gate(98 / 104, 100 / 104, 0.99, 104)
    # 0.1 is a hair over 1/10 as a float: one right of ten keeps a tenth of ten right
    assert passes_gate(1 / 10, 10 / 10, 0.1, 10)
    assert passes_gate(269 / 269, 268 / 269, 1.0, 269) and not passes_gate(0.5, 1.0, 1.0, 2)


def test_report_md_says_which_variants_answer_one_image_on_one_thread() -> None:
    r = report_dict()
    r["variants"][1]["batch1_threads"] = 2
    md = render.markdown(r)
    assert (
        "- threads at batch 1: fewer than 2 for onnx-int8-static (1): ONNX Runtime answered "
        "one image sooner on one thread than on all of them"
    ) in md
    r["variants"][0]["batch1_threads"] = 2
    assert "threads at batch 1" not in render.markdown(r)


def at_batch_4() -> dict[str, Any]:
    """The digits run's int8 variants reported at --batch 4, under the 8 rows they split from:
    the batch ran on their one-thread session, where ONNX fp32 (split from 4) ran two lanes."""
    r = report_dict(batch=4)
    for v in r["variants"]:
        v.update(batch_threads=1, batch_lanes=1)
    return r


def test_report_md_says_the_threads_a_batch_shorter_than_the_split_ran_on() -> None:
    """It said "every longer batch" used the report's threads: int8's batch-4 img/s, and its
    x ONNX fp32, came from one thread."""
    md = render.markdown(at_batch_4())
    assert (
        "- threads at batch 1: fewer than 2 for onnx-int8-static (1), onnx-int8-qat (1): ONNX "
        "Runtime answered one image sooner on one thread than on all of them when the model "
        "loaded, and runs it so here as in `serve`; the other variants use 2\n"
        "- threads at batch 4: fewer than 2 for onnx-int8-static (1), onnx-int8-qat (1): ONNX "
        "Runtime splits a batch over one-thread lanes only from its split size and runs a "
        "shorter one as it runs one image, so their img/s and speed-ups at batch 4 are on those "
        "threads; the other variants use 2\n"
    ) in md
    assert "longer batch" not in md
    long = report_dict()  # batch 64: both split over two lanes
    for v in long["variants"]:
        v.update(batch_threads=2, batch_lanes=2)
    md = render.markdown(long)
    assert "the other variants use 2, and every variant 2 at batch 64\n" in md
    assert "threads at batch 64" not in md


def test_calibration_peak_rss_is_in_mib() -> None:
    cal = {"samples": 256, "method": "minmax", "chunk": 64, "seconds": 0.13}
    cal["scales_sha256"] = "c60050341897bc46"
    md = render.markdown(report_dict(calibration={**cal, "peak_rss_mib": 521.07}))
    assert "peak RSS 521 MiB (the process's), scales c60050341897\n" in md
    # manifests before the field was named for its unit held MiB under peak_rss_mb
    md = render.markdown(report_dict(calibration={**cal, "peak_rss_mb": 521.07}))
    assert "peak RSS 521 MiB (the process's)," in md
    # not measured (the peak could not be reset: the process's lifetime's): not said
    md = render.markdown(report_dict(calibration={**cal, "peak_rss_mib": None}))
    assert "0.13 s, scales c60050341897\n" in md and "peak RSS" not in md


def test_report_md_says_how_busy_other_processes_kept_the_machine() -> None:
    md = render.markdown(report_dict(machine_busy_share=0.003))
    assert "- other processes used 0.3% of the CPU while variants were timed\n" in md
    assert "other processes" not in render.markdown(report_dict(machine_busy_share=None))
    # on a virtual machine, how much of it was its host's (steal): no process to look for
    md = render.markdown(report_dict(machine_busy_share=0.12, machine_steal_share=0.1))
    assert (
        "- other processes used 12.0% of the CPU while variants were timed, 10.0% of it the "
        "virtual machine's host (steal)\n"
    ) in md
    md = render.markdown(report_dict(machine_busy_share=0.003, machine_steal_share=0.0))
    assert "- other processes used 0.3% of the CPU while variants were timed\n" in md


def test_report_md_says_why_qat_is_far_from_fp32_in_sqnr() -> None:
    # QAT fine-tunes the weights: its SQNR against fp32's logits read as a broken model
    r = report_dict()
    r["variants"][1]["sqnr_db"] = -3.2
    r["variants"][1]["answers_changed"] = 3  # and a report made before it counted them: –
    md = render.markdown(r)
    assert "| onnx-int8-qat | 166 kB | 0.9900 | +0.00 pt | 3/269 | -3.2 | 80% |" in md
    assert "| +0.00 pt | – | 49.1 |" in md
    assert (
        "\n\nSQNR dB: how close a variant's logits are to eager fp32's on the test images "
        "(signal over difference; higher is closer). onnx-int8-qat is fine-tuned "
        "(quantization-aware training), so its logits differ from fp32's by design: a low or "
        "negative SQNR there is expected, and its accuracy is what to judge it by.\n\n"
    ) in md
    r["variants"] = r["variants"][:1]
    r["recommended_by"] = {**r["recommended_by"], "tied": [], "tie_break": None}
    assert "SQNR dB:" not in render.markdown(r)


def test_a_gate_decided_by_one_image_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # 4 test images: one image is 25 points, where the 0.99 gate allows 1 point below fp32's
    from lightship.data import sources
    from lightship.quantize import fallback

    monkeypatch.setattr(sources, "_noted", set())
    warning = (
        "the accuracy gate is decided on 4 images: one image is 25 points of accuracy and the "
        "gate lets a variant lose at most 1 point below fp32's, so a single image decides pass "
        "or FAIL"
    )
    with caplog.at_level("WARNING", logger=fallback.__name__):
        assert not passes_gate(3 / 4, 4 / 4, 0.99, 4)
        assert passes_gate(4 / 4, 4 / 4, 0.99, 4)
        assert passes_gate(268 / 269, 268 / 269, 0.99, 269)  # 2.7 images allowed: no word
    assert caplog.messages == [warning]
    assert f"\n- **warning:** {warning}\n" in render.markdown(
        report_dict(test_images=4, fp32_accuracy=1.0)
    )
    assert "**warning:**" not in render.markdown(report_dict())  # 269 images
    # a gate of 1 or above allows no image on purpose (it forces the fallback)
    assert fallback.few_images_warning(1.0, 1.0, 4) is None


CPU = "Xeon (x86_64; avx512_vnni), this CPU's int8 target vnni"  # report_dict's, as `isa.describe` says it


def test_report_md_names_the_cpu_with_its_int8_flags_and_target() -> None:
    assert f"\n- CPU: {CPU}, 2 threads\n" in render.markdown(report_dict())


def scheme_check(cpu: dict[str, Any] | None) -> dict[str, Any]:
    """Quantize's check of both schemes, as the report copies it from the static entry."""
    error = {"accuracy": 0.9926, "max_abs_diff": 0.08, "argmax_agreement": 268 / 269}
    return {
        "chosen": {"target": "vnni", **error},
        "alternative": {"target": "avx2", **error, "argmax_agreement": 1.0},
        "cpu": cpu,
    }


def test_the_scheme_check_names_the_cpu_quantize_measured_it_on_and_counts_agreement() -> None:
    here = {"model": "Xeon", "arch": "x86_64", "int8_flags": ["avx512_vnni"]}
    md = render.markdown(report_dict(scheme_check=scheme_check(here)))
    assert (
        "\nScheme check (static int8, real kernels), measured by quantize on Xeon (x86_64; "
        "avx512_vnni):\n"
    ) in md
    # counts, where 268/269 would print 99.63% and 19,999/20,000 100.00%
    assert "| vnni (chosen) | 0.9926 | 0.080 | 268/269 |\n" in md
    assert "| avx2 (the other) | 0.9926 | 0.080 | 269/269 |\n" in md

    elsewhere = {"model": "EPYC", "arch": "x86_64", "int8_flags": ["avx2"]}
    md = render.markdown(report_dict(scheme_check=scheme_check(elsewhere)))
    assert (
        "\nScheme check (static int8, real kernels), measured by quantize on EPYC (x86_64; "
        "avx2), not this report's CPU: its figures may differ here:\n"
    ) in md
    md = render.markdown(report_dict(scheme_check=scheme_check(None)))  # not recorded
    assert "measured by quantize on a CPU it did not record:\n" in md


def plotted(r: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The axes `render.pareto` draws for `r` (its figure kept from being closed)."""
    import matplotlib.pyplot as plt

    figures: list[Any] = []
    monkeypatch.setattr(plt, "close", figures.append)
    render.pareto(r, tmp_path / "pareto.png")
    assert (tmp_path / "pareto.png").stat().st_size > 0
    return figures[0].axes[0]


def test_the_plot_names_the_cpu_and_the_threads_batch_one_ran_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = report_dict()
    r["variants"][1]["batch1_threads"] = 2
    ax = plotted(r, tmp_path, monkeypatch)
    assert ax.get_title() == (
        f"{CPU}\n2 threads; at batch 1 on fewer threads: onnx-int8-static (1)"
    )
    r["variants"][0]["batch1_threads"] = 2
    assert plotted(r, tmp_path, monkeypatch).get_title() == f"{CPU}\n2 threads"
    assert plotted(at_batch_4(), tmp_path, monkeypatch).get_title() == (
        f"{CPU}\n2 threads; at batch 1 on fewer threads: onnx-int8-static (1), onnx-int8-qat "
        "(1); at batch 4 on fewer threads: onnx-int8-static (1), onnx-int8-qat (1)"
    )


@pytest.mark.parametrize("top", [0.99, 0.998, 1.0])
def test_the_plot_has_no_accuracy_tick_above_100_percent(
    top: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = report_dict()
    r["variants"][0]["accuracy"] = top
    ax = plotted(r, tmp_path, monkeypatch)
    ticks = [t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
    assert ticks and max(ticks) < 100.001  # 100.00000000000001 is matplotlib's 100
    assert ax.get_ylim()[1] >= 100 * top + 0.5  # room for the top point's label


def test_the_cli_table_names_the_cpu_and_the_fp32_it_compares_with(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import lightship.report
    from lightship import cli

    r = report_dict(timing_warning=None)
    for v in r["variants"]:
        v.update(speedup_vs_eager=20.0, speedup_vs_onnx_fp32=2.0)
    monkeypatch.setattr(lightship.report, "report", lambda *args, **kwargs: r)
    cli.report(run=Path("runs/default"), threads=2, rounds=1, batch=64, gate=0.99)
    out = capsys.readouterr().out
    assert (  # the title, wrapped at the table's width
        f"runs/default on {CPU}, 2 threads; at batch 1 on fewer threads: onnx-int8-static (1), "
        "onnx-int8-qat (1)"
    ) in " ".join(out.split())
    # the column of speed-ups over ONNX fp32 (eager fp32 reads 0.08 of it), on two lines
    header = [
        [cell.strip() for cell in line.split("┃")] for line in out.splitlines() if "┃" in line
    ]
    assert [cells[6] for cells in header] == ["x ONNX", "fp32"]
    short = {**at_batch_4(), "timing_warning": None}
    for v in short["variants"]:
        v.update(speedup_vs_eager=20.0, speedup_vs_onnx_fp32=0.6)
    monkeypatch.setattr(lightship.report, "report", lambda *args, **kwargs: short)
    cli.report(run=Path("runs/default"), threads=2, rounds=1, batch=4, gate=0.99)
    title = " ".join(capsys.readouterr().out.split())
    assert "(1); at batch 4 on fewer threads: onnx-int8-static (1), onnx-int8-qat (1)" in title


def test_the_plots_latency_labels_leave_out_the_one_beside_each_decade(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 0.09 ran into 0.10 (a larger font, another format): one size, one format, 0.09 unsaid
    r = report_dict()
    for v, p50 in zip(r["variants"], [0.06, 0.16, 0.31, 0.7], strict=False):
        v["latency_ms"] = {"p50": p50, "p90": p50, "p99": p50}
    ax = plotted(r, tmp_path, monkeypatch)
    minor = ax.xaxis.get_minor_formatter()
    labels = {x: minor(x) for x in (0.06, 0.07, 0.09, 0.3, 0.9)}
    assert labels == {0.06: "0.06", 0.07: "0.07", 0.09: "", 0.3: "0.3", 0.9: ""}
    assert ax.xaxis.get_major_formatter()(0.1) == "0.1"


@pytest.mark.parametrize("accuracy", [0.97, 1.0])
def test_no_two_labels_of_the_plot_overlap(
    accuracy: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seven variants at one accuracy, four within 25 % in latency (ResNet-18's eager, .pt2,
    TorchScript and dynamic int8): on three fixed rows `onnx-int8-dynamic` and `pt2` were
    drawn over each other. A label that would cross the axes' right edge goes to the left.
    At 100 %, the top of the axis, the upper rows ran into the title: they go below."""
    from matplotlib.text import Text

    r = report_dict()
    template = {**r["variants"][0], "accuracy": accuracy}
    latencies = {
        "onnx-int8-static": 1.29,
        "onnx-int8-qat": 1.36,
        "onnx-fp32": 4.44,
        "torchscript": 6.9,
        "onnx-int8-dynamic": 6.95,
        "eager": 8.2,
        "pt2": 8.6,
    }
    r["variants"] = [
        {**template, "name": name, "recommended": False, "latency_ms": {"p50": p50}}
        for name, p50 in latencies.items()
    ]
    r["variants"][-1]["accuracy"] = accuracy - 0.1  # the axis 10 points high: rows are tall
    ax = plotted(r, tmp_path, monkeypatch)
    renderer = ax.figure.canvas.get_renderer()
    labels = {t.get_text(): Text.get_window_extent(t, renderer) for t in ax.texts}
    assert set(labels) == set(latencies)
    boxes = list(labels.values())
    for i, a in enumerate(boxes):
        assert not any(a.overlaps(b) for b in boxes[i + 1 :]), list(labels)[i]
    right = ax.get_window_extent(renderer).x1
    assert all(box.x1 <= right + 1 for box in boxes)
    title, figure = ax.title.get_window_extent(renderer), ax.figure.bbox
    assert not any(box.overlaps(title) for box in boxes)
    assert all(figure.y0 <= box.y0 and box.y1 <= figure.y1 for box in boxes)


# Two reports of one digits run (an independent check): "torchscript" and "eager" on one row,
# one space apart, read as one name; the minor latency ticks ran together as "0.70.8"
TRUTH_CHECK = {
    "close names": {
        "eager": (0.9045, 0.9963),
        "torchscript": (0.6449, 0.9963),
        "pt2": (1.857, 0.9963),
        "onnx-fp32": (0.2175, 0.9963),
        "onnx-int8-static": (0.0978, 0.9963),
        "onnx-int8-dynamic": (0.4068, 0.9926),
        "onnx-int8-qat": (0.0917, 0.9926),
    },
    "crowded ticks": {
        "eager": (1.331, 0.9963),
        "torchscript": (0.6583, 0.9963),
        "pt2": (5.282, 0.9963),
        "onnx-fp32": (0.2446, 0.9963),
        "onnx-int8-static": (0.0867, 0.9963),
        "onnx-int8-dynamic": (0.3998, 0.9926),
        "onnx-int8-qat": (0.0872, 0.9926),
    },
}


@pytest.mark.parametrize("case", list(TRUTH_CHECK))
def test_the_plots_names_and_latency_labels_keep_apart(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from matplotlib.text import Text

    from lightship.report.render import LABEL_GAP_PX

    r = report_dict()
    template = r["variants"][0]
    r["variants"] = [
        {**template, "name": name, "recommended": False, "accuracy": acc, "latency_ms": {"p50": p}}
        for name, (p, acc) in TRUTH_CHECK[case].items()
    ]
    ax = plotted(r, tmp_path, monkeypatch)
    fig = ax.figure
    fig.canvas.draw()  # as savefig drew it: the tick labels the formatters gave
    renderer = fig.canvas.get_renderer()
    names = [Text.get_window_extent(t, renderer) for t in ax.texts]
    for i, a in enumerate(names):
        assert not any(a.padded(LABEL_GAP_PX / 2, 0).overlaps(b.padded(LABEL_GAP_PX / 2, 0))
                       for b in names[i + 1 :]), ax.texts[i].get_text()  # fmt: skip
    low, high = sorted(ax.get_xlim())
    ticks = [
        t.label1
        for t in [*ax.xaxis.get_major_ticks(), *ax.xaxis.get_minor_ticks()]
        if low <= t.get_loc() <= high and t.label1.get_text()
    ]
    boxes = [t.get_window_extent(renderer).padded(LABEL_GAP_PX / 2, 0) for t in ticks]
    for i, a in enumerate(boxes):
        crowded = [ticks[j].get_text() for j, b in enumerate(boxes) if j > i and a.overlaps(b)]
        assert not crowded, (ticks[i].get_text(), crowded)
    assert len(ticks) >= 6  # thinned, not emptied


def test_report_md_heads_its_throughput_with_the_batch_it_was_timed_at() -> None:
    # "img/s @batch", where the terminal's table and the README say @64
    assert "| img/s @64 |" in render.markdown(report_dict())
    assert "| img/s @16 |" in render.markdown(report_dict(batch=16))


def test_the_console_marks_a_variant_held_back_but_not_the_eager_reference() -> None:
    """Every report's console table marked eager `pass*`, with the footnote, though eager is
    the reference measured to compare with, not a variant to serve."""
    from lightship.cli import _held_back

    def variant(name: str, recommendable: bool) -> dict[str, Any]:
        return {"name": name, "recommendable": recommendable}

    assert not _held_back(variant("eager", False))
    assert _held_back(variant("onnx-int8-dynamic", False))
    assert not _held_back(variant("onnx-int8-static", True))


def test_report_md_says_why_a_variant_that_passes_is_held_back() -> None:
    """The console's footnote says "report.md says why": it gave only "(not recommended)",
    and the reason lay in manifest.json alone."""
    r = report_dict()
    why = "99.9% of multiply-adds are in convolutions: reported, not recommended"
    dynamic = {**r["variants"][1], "name": "onnx-int8-dynamic", "recommendable": False}
    r["variants"].append(dynamic | {"held_back": why, "recommended": False})
    md = render.markdown(r)
    assert f"\nNot recommended: onnx-int8-dynamic: {why}.\n" in md
    assert md.count("Not recommended:") == 1  # the others are recommendable


def test_the_cli_table_keeps_a_variants_name_on_its_row_in_80_columns() -> None:
    """Squeezed into 80 columns (a log; `pass*` widening the gate column), the variant column
    wrapped: the star stood alone beside the figures and the name on a row of its own."""
    import io

    from rich.console import Console

    from lightship.cli import report_table

    r = report_dict()
    r["cpu"]["model"] = "AMD EPYC"
    for v, eager in zip(r["variants"], (7.62, 7.40), strict=True):
        v |= {"speedup_vs_eager": eager, "speedup_vs_onnx_fp32": eager / 2.6}
    dynamic = {**r["variants"][1], "name": "onnx-int8-dynamic", "recommendable": False}
    r["variants"].append(dynamic)  # its gate column says pass*
    out = io.StringIO()
    Console(file=out, width=80).print(report_table(r, Path("runs/default"), 64))
    rows = [line for line in out.getvalue().splitlines() if "0.9900" in line]
    assert len(rows) == 3, out.getvalue()
    assert "★ onnx-int8-static" in rows[0] and "onnx-int8-dynamic" in rows[2], out.getvalue()
    assert rows[2].rstrip().endswith("pass* │")
    # narrower, no figure cut to "0.99…" nor folded ("340" over "00"): whole, the lines run on
    narrow = io.StringIO()
    Console(file=narrow, width=50).print(report_table(r, Path("runs/default"), 64), crop=False)
    rows = [line for line in narrow.getvalue().splitlines() if "0.9900" in line]
    assert len(rows) == 3 and "…" not in narrow.getvalue(), narrow.getvalue()
    assert "★ onnx-int8-static" in rows[0] and "34000" in rows[0] and "pass*" in rows[2]


def test_a_recorded_gate_quantize_never_writes_is_ignored_out_loud(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An edited manifest's gate of inf (or 1e400) ended the report in a traceback after all
    its timing; one of 50 would have failed every int8 variant without a word."""
    from lightship.report.core import _recorded_gate

    entries = [{"gate": {"min_ratio": g}} for g in (math.inf, 50.0, 0.98, -1, "0.5")]
    assert _recorded_gate(entries) == 0.98
    assert "int8 gates quantize never writes (inf, 50, -1): ignored" in caplog.text
    assert _recorded_gate([{"gate": {"min_ratio": math.inf}}]) == DEFAULT_GATE
