"""report.md (a table people can scan) and pareto.png (accuracy against latency)."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

from lightship.quantize import isa
from lightship.quantize.fallback import SQNR_CAP_DB, few_images_warning

# What a size in the table is where it is not the model file alone: best.ckpt also holds the
# optimizer's state (AdamW: twice the weights) and the EMA weights
_SIZE_OF = {"eager": " (training checkpoint)"}


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def speedup(v: dict[str, Any], base: str) -> str:
    """`5.58 (5.21-5.94)`: a variant's speed-up over `base` with the middle half of its rounds,
    or a dash where the report has no such baseline."""
    value = v.get(f"speedup_vs_{base}")
    if value is None:
        return "—"
    spread = v.get(f"speedup_vs_{base}_iqr")
    return f"{value:.2f}" + (f" ({spread[0]:.2f}–{spread[1]:.2f})" if spread else "")


def gate_percent(gate: float) -> str:
    """`99.5%` for 0.995: the gate as given, never rounded (0.995, 0.999 and 1.004 all printed
    as 100 % once)."""
    return f"{(Decimal(str(float(gate))) * 100).normalize():f}%"


def fewer_threads(r: dict[str, Any], key: str = "batch1_threads") -> str:
    """`onnx-fp32 (1), onnx-int8-static (1)`: the variants whose `key` (`batch1_threads`, or
    `batch_threads` at the throughput batch) is fewer threads than the report's: ONNX
    Runtime's `short_batch_threads` (one, where that measured sooner as the model loaded),
    which also runs a batch shorter than its split; "" where none is."""
    fewer = [v for v in r["variants"] if v.get(key, r["threads"]) < r["threads"]]
    return ", ".join(f"{v['name']} ({v[key]})" for v in fewer)


def _fewer_by_batch(r: dict[str, Any]) -> list[tuple[int, str]]:
    """(batch, `fewer_threads`) at batch 1 (latency) and at the throughput batch, where any
    variant ran on fewer threads than the report's."""
    found = [(1, fewer_threads(r, "batch1_threads"))]
    if r["batch"] != 1:
        found.append((r["batch"], fewer_threads(r, "batch_threads")))
    return [(batch, names) for batch, names in found if names]


def threads_note(r: dict[str, Any]) -> str:
    """`; at batch 1 on fewer threads: onnx-fp32 (1)`, after "2 threads" in the plot's and the
    CLI's titles: each measured batch that some variant ran on fewer threads; "" if none."""
    return "".join(f"; at batch {b} on fewer threads: {names}" for b, names in _fewer_by_batch(r))


def _threads_line(r: dict[str, Any]) -> list[str]:
    """What report.md says of the threads each measured batch ran on, true of each: a line per
    batch some variant ran on fewer threads than the report's."""
    n, batch = r["threads"], r["batch"]
    fewer = dict(_fewer_by_batch(r))
    lines = []
    if 1 in fewer:
        every = "" if batch == 1 or batch in fewer else f", and every variant {n} at batch {batch}"
        lines.append(
            f"- threads at batch 1: fewer than {n} for {fewer[1]}: ONNX Runtime answered one "
            "image sooner on one thread than on all of them when the model loaded, and runs it "
            f"so here as in `serve`; the other variants use {n}{every}"
        )
    if batch in fewer and batch != 1:
        lines.append(
            f"- threads at batch {batch}: fewer than {n} for {fewer[batch]}: ONNX Runtime "
            "splits a batch over one-thread lanes only from its split size and runs a shorter "
            f"one as it runs one image, so their img/s and speed-ups at batch {batch} are on "
            f"those threads; the other variants use {n}"
        )
    return lines


def tie_note(r: dict[str, Any]) -> str:
    """Where the recommended variant won a tie in speed (`core.recommend`), with whom and by
    what, for report.md's and the CLI's line; "" where it was the fastest alone."""
    best, by = r["recommended"], r.get("recommended_by")  # absent from reports before it
    if best is None or not by or not by["tied"]:
        return ""
    rows = {v["name"]: v for v in r["variants"]}
    fastest = by["fastest"]
    ratios = "; ".join(
        f"{fastest} over {n} {by['over'][n]['ratio']:.2f} "
        f"({by['over'][n]['iqr'][0]:.2f}–{by['over'][n]['iqr'][1]:.2f})"
        for n in by["tied"]
        if n != fastest
    )
    others = [n for n in by["tied"] if n != best]
    if by["tie_break"] == "sqnr":
        why = "the higher SQNR vs fp32"
        figures = [f"{n} {_sqnr(rows[n]['sqnr_db'])} dB" for n in [best, *others]]
    else:  # among those of the best SQNR; the others lost on SQNR first
        same = [n for n in others if rows[n]["sqnr_db"] == rows[best]["sqnr_db"]]
        lower = [n for n in others if n not in same]
        why = "the smaller file" + (
            f" of those with its SQNR ({', '.join(lower)}: lower SQNR)" if lower else ""
        )
        figures = [f"{n} {_fmt_bytes(rows[n]['bytes'])}" for n in [best, *same]]
    return (
        f"tied in speed with {', '.join(others)} (within-round ratio {ratios}), chosen for "
        f"{why} ({', '.join(figures)})"
    )


def _sqnr(db: float | None) -> str:
    if db is None:
        return "—"
    return f"≥ {SQNR_CAP_DB:.0f}" if db >= SQNR_CAP_DB else f"{db:.1f}"  # exact, or as good as


def _share(share: float | None) -> str:
    """The int8 ops' share; none for a torch format, which ONNX Runtime did not count."""
    return "—" if share is None else f"{share:.0%}"


def _split_line(variants: list[dict[str, Any]]) -> list[str]:
    """Which variants ran long batches as one slice per thread (`OrtPredictor`), from when."""
    split = [v for v in variants if v.get("lanes", 1) > 1]
    if not split:
        return []
    rows = ", ".join(f"{v['name']} {v['split_rows']}+" for v in split)
    return [
        f"- ONNX Runtime on CPU splits a long batch into one slice per thread, each on a "
        f"one-thread session ({split[0]['lanes']} lanes); split from (rows): {rows}"
    ]


def _changed(variant: dict[str, Any], images: int | None) -> str:
    """Test answers unlike eager fp32's, of the test images; – in a report made before."""
    changed = variant.get("answers_changed")
    if changed is None:
        return "–"
    return f"{changed}/{images}" if images else str(changed)


def _sqnr_note(variants: list[dict[str, Any]]) -> list[str]:
    """Below the table where it lists QAT, whose SQNR reads as a broken model: fine-tuned, its
    logits differ from fp32's by design."""
    qat = [v["name"] for v in variants if v["name"].endswith("-qat")]
    if not qat:
        return []
    return [
        f"SQNR dB: how close a variant's logits are to eager fp32's on the test images (signal "
        f"over difference; higher is closer). {', '.join(qat)} is fine-tuned (quantization-aware "
        "training), so its logits differ from fp32's by design: a low or negative SQNR there is "
        "expected, and its accuracy is what to judge it by.",
        "",
    ]


def markdown(r: dict[str, Any]) -> str:
    lines = [
        f"# lightship report: {r['run']}",
        "",
        f"- CPU: {isa.describe(r['cpu'])}, {r['threads']} threads",
        f"- versions: {', '.join(f'{k} {v}' for k, v in r['versions'].items())}",
        f"- test images: {r['test_images']}; latency at batch 1, throughput at batch {r['batch']};"
        f" variants interleaved over {r['rounds']} rounds (order shuffled per round), median"
        " throughput; a speed-up is the median of its within-round ratios (in brackets: their"
        " middle half, 25th to 75th percentile)"
        + (
            "; freed memory kept in the heap (glibc), so eager PyTorch is not slowed by page faults"
            if r.get("malloc_keeps_freed_memory")
            else ""
        ),
        *_threads_line(r),
        *_split_line(r["variants"]),
        f"- accuracy gate: a variant keeps >= {gate_percent(r['gate'])} of fp32 accuracy "
        f"({r['fp32_accuracy']:.4f}), compared as counts of test images right"
        + (", or is an fp32 format that scores as eager does" if r["gate"] > 1 else ""),
    ]
    few = few_images_warning(r["fp32_accuracy"], r["gate"], r["test_images"])
    if few is not None:
        lines.append(f"- **warning:** {few}")
    busy = r.get("machine_busy_share")  # absent from reports before it, None off Linux
    if busy is not None:
        steal = r.get("machine_steal_share") or 0.0  # absent before it
        host = f", {steal:.1%} of it the virtual machine's host (steal)" if steal >= 5e-4 else ""
        timed = "while variants were timed"
        lines.append(f"- other processes used {busy:.1%} of the CPU {timed}{host}")
    cal = r.get("calibration")
    if cal:
        # peak_rss_mb before it was named for its unit: MiB too (VmHWM KiB / 1024)
        rss = cal.get("peak_rss_mib") or cal.get("peak_rss_mb")
        lines.append(
            f"- calibration: {cal['samples']} training images, {cal['method']}, "
            f"{cal['chunk']} images held at once, {cal['seconds']} s, "
            + (f"peak RSS {rss:.0f} MiB (the process's), " if rss else "")
            + f"scales {cal['scales_sha256'][:12]}"
        )
    lines += [
        "",
        "| variant | size | accuracy | Δ vs fp32 | answers changed | SQNR dB | int8 ops | p50 ms "
        f"| p90 ms | p99 ms | img/s @{r.get('batch', 'batch')} | × eager | × ONNX fp32 | gate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    images = r.get("test_images")
    for v in r["variants"]:
        name = f"**{v['name']}** ★" if v["recommended"] else v["name"]
        sqnr = _sqnr(v["sqnr_db"])
        lat = v["latency_ms"]
        lines.append(
            f"| {name} | {_fmt_bytes(v['bytes'])}{_SIZE_OF.get(v['name'], '')} | "
            f"{v['accuracy']:.4f} | "
            f"{100 * v['delta_vs_fp32']:+.2f} pt | {_changed(v, images)} | {sqnr} | "
            f"{_share(v.get('int8_share'))} | "
            f"{lat['p50']:.3f} | {lat['p90']:.3f} | {lat['p99']:.3f} | "
            f"{v['throughput_per_s']:.0f} | {speedup(v, 'eager')} | {speedup(v, 'onnx_fp32')} | "
            f"{'pass' if v['gate_passed'] else 'FAIL'}"
            f"{'' if v['recommendable'] else ' (not recommended)'} |"
        )
    lines.append("")
    lines += _sqnr_note(r["variants"])
    if r.get("timing_warning"):  # absent from reports before it
        lines += [f"**Warning:** {r['timing_warning']}.", ""]
    by = r.get("recommended_by")  # absent from reports before it
    rule = by["rule"] if by else f"fastest at batch {r['batch']} that passes the gate"
    tie = tie_note(r)
    lines.append(
        f"Recommended ({rule}): **{r['recommended'] or 'none'}** ★" + (f", {tie}" if tie else "")
    )
    if r["recommended"] is None:
        lines.append(f"\nWhy none: {why_none(r)}.")
    for name, why in r.get("not_measured", {}).items():  # absent from reports before it
        lines.append(f"\nNot measured: {name}, {why}.")
    for v in r["variants"]:
        if v.get("held_back"):  # absent from reports before it
            lines.append(f"\nNot recommended: {v['name']}: {v['held_back']}.")
        if v.get("refused_here"):  # absent from reports before it
            lines.append(
                f"\nNot recommended: {v['name']}, which `lightship serve` refuses on this CPU: "
                f"{v['refused_here']}."
            )
    kept = [(v["name"], v["nodes_fp32"]) for v in r["variants"] if v["nodes_fp32"]]
    for name, nodes in kept:
        lines.append(f"\nNodes kept in fp32 by the accuracy fallback in {name}: {', '.join(nodes)}")
    sc = r.get("scheme_check")
    if sc and "alternative" in sc:
        c, a = sc["chosen"], sc["alternative"]
        n = r["test_images"]  # quantize's test split: the run's recorded split, as here
        lines += [
            "",
            f"Scheme check (static int8, real kernels), {_measured_by_quantize(sc, r['cpu'])}:",
            "",
            "| scheme | accuracy | max abs Δlogit vs fp32 | argmax agreement |",
            "|---|---|---|---|",
            f"| {c['target']} (chosen) | {c['accuracy']:.4f} | {c['max_abs_diff']:.3f} | "
            f"{round(c['argmax_agreement'] * n):,}/{n:,} |",
            f"| {a['target']} (the other) | {a['accuracy']:.4f} | {a['max_abs_diff']:.3f} | "
            f"{round(a['argmax_agreement'] * n):,}/{n:,} |",
        ]
    lines += ["", "![accuracy vs latency](pareto.png)", ""]
    return "\n".join(lines)


def _measured_by_quantize(sc: dict[str, Any], cpu: dict[str, Any]) -> str:
    """Where the scheme check was measured: by quantize, on the CPU of its manifest entry,
    which need not be the one this report timed on."""
    theirs = sc.get("cpu")
    if theirs is None:  # entries before it
        return "measured by quantize on a CPU it did not record"
    here = {k: v for k, v in cpu.items() if k != "target"}
    other = "" if theirs == here else ", not this report's CPU: its figures may differ here"
    return f"measured by quantize on {isa.describe(theirs)}{other}"


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats on both lower latency and higher accuracy."""
    front = []
    for i, (lat, acc) in enumerate(points):
        dominated = any(
            (lat2 <= lat and acc2 >= acc) and (lat2 < lat or acc2 > acc)
            for j, (lat2, acc2) in enumerate(points)
            if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def pareto(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    variants = r["variants"]
    points = [(v["latency_ms"]["p50"], 100 * v["accuracy"]) for v in variants]
    front = pareto_front(points)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for v, (lat, acc) in zip(variants, points, strict=True):
        color = "tab:green" if v["gate_passed"] else "tab:red"
        marker = "*" if v["recommended"] else "o"
        ax.scatter(
            lat,
            acc,
            s=160 if v["recommended"] else 50,
            c=color,
            marker=marker,
            zorder=3,
            clip_on=False,  # whole at 100 %, the top of the axis
        )
    fx = [points[i][0] for i in front]
    fy = [points[i][1] for i in front]
    ax.step(fx, fy, where="post", color="tab:blue", alpha=0.6)
    ax.scatter(
        fx, fy, s=260, facecolors="none", edgecolors="tab:blue", label="Pareto front", clip_on=False
    )
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    # minor ticks labelled too (a span under a decade may hold no major one), but not 9 x 10^k,
    # whose label would run into the decade's beside it
    ax.xaxis.set_minor_formatter(
        FuncFormatter(lambda x, _: "" if f"{x:e}".startswith("9") else f"{x:g}")
    )
    ax.tick_params(axis="x", which="minor", labelsize=7)
    accs = [a for _, a in points]
    # half a point at least above the top point for its label, a point where that stays at or
    # below 100 %, and no tick above 100 % (no accuracy is)
    limits = min(accs) - 1.0, max(min(max(accs) + 1.0, 100.0), max(accs) + 0.5)
    ax.set_ylim(*limits)
    ax.set_yticks([t for t in ax.get_yticks() if limits[0] <= t < 100.001])  # 100.00000000000001
    ax.set_ylim(*limits)  # as set_yticks left them
    ax.set_xlabel("latency p50 at batch 1 (ms, log scale, lower is better)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(
        f"{isa.describe(r['cpu'])}\n{r['threads']} threads{threads_note(r)}",
        fontsize=8,
        wrap=True,  # a long CPU name or many variants
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)  # where the fewest points are: not over the slowest
    fig.tight_layout()
    _thin_minor_ticks(fig, ax)
    _label(fig, ax, [v["name"] for v in variants], points)
    fig.savefig(path, format="png")
    plt.close(fig)


# The least room between two labels, in pixels at the plot's 120 dpi (a letter and a half at
# 8 pt): one space apart, "torchscript" and "eager" on one row read as one name
LABEL_GAP_PX = 8.0


def _thin_minor_ticks(fig: Any, ax: Any) -> None:
    """Leave unlabelled the minor latency ticks whose labels would come within LABEL_GAP_PX of
    a label beside them ("0.70.8" on a narrow span): the decades' labels stay, and of the
    minor ones, those met first from the left."""
    from matplotlib.ticker import FuncFormatter

    renderer = fig.canvas.get_renderer()
    axis = ax.xaxis
    low, high = sorted(ax.get_xlim())

    def shown(ticks: Any) -> list[tuple[float, Any]]:
        return [
            (t.get_loc(), t.label1.get_window_extent(renderer).padded(LABEL_GAP_PX / 2, 0))
            for t in ticks
            if low <= t.get_loc() <= high and t.label1.get_visible() and t.label1.get_text()
        ]

    kept = [box for _, box in shown(axis.get_major_ticks())]
    dropped: set[float] = set()
    for loc, box in sorted(shown(axis.get_minor_ticks()), key=lambda tick: tick[0]):
        if any(box.overlaps(other) for other in kept):
            dropped.add(loc)
        else:
            kept.append(box)
    if dropped:
        minor = axis.get_minor_formatter()

        def thinned(x: float, pos: int | None) -> str:
            return "" if any(abs(x - d) <= 1e-9 * d for d in dropped) else minor(x, pos)

        axis.set_minor_formatter(FuncFormatter(thinned))


def _label(fig: Any, ax: Any, names: list[str], points: list[tuple[float, float]]) -> None:
    """Each point's name above it, on the lowest row (12 pt apart) where it overlaps no label
    placed before it, in order of latency: variants often tie in accuracy and sit close in
    latency (`onnx-int8-dynamic` and `pt2` were drawn over each other on three fixed rows).
    A row that would run into the title or off the figure is not taken; where every row above
    would, the name goes below its point the same way."""
    from matplotlib.text import Text

    renderer = fig.canvas.get_renderer()
    right = ax.get_window_extent(renderer).x1
    top = fig.bbox.y1
    title = ax.title.get_window_extent(renderer) if ax.get_title() else None
    placed: list[Any] = []

    def annotate(i: int, row: int, side: int) -> tuple[Any, Any]:
        above = row >= 0  # row -1 is the first below the point
        text = ax.annotate(
            names[i],
            points[i],
            textcoords="offset points",
            xytext=(4 * side, 6 + 12 * row if above else -6 + 12 * (row + 1)),
            ha="left" if side > 0 else "right",
            va="baseline" if above else "top",
            fontsize=8,
            arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.5} if row else None,
        )
        text.update_positions(renderer)
        return text, Text.get_window_extent(text, renderer)  # the words, not the leader line

    def clear(box: Any) -> bool:
        return (
            box.y1 <= top
            and box.y0 >= fig.bbox.y0
            and not (title is not None and box.overlaps(title))
            and not any(box.padded(LABEL_GAP_PX, 0).overlaps(other) for other in placed)
        )

    rows = [*range(len(points)), *range(-1, -len(points) - 1, -1)]
    for i in sorted(range(len(points)), key=lambda i: points[i]):
        for n, row in enumerate(rows):
            text, box = annotate(i, row, 1)
            if box.x1 > right:  # past the axes' right edge: written to the left of its point
                text.remove()
                text, box = annotate(i, row, -1)
            if n == len(rows) - 1 or clear(box):
                placed.append(box)
                break
            text.remove()


def why_none(r: dict[str, Any]) -> str:
    """Why a report recommends no variant, for report.md and the CLI."""
    servable = [v["name"] for v in r["variants"] if v["recommendable"]]
    if not servable:
        return (
            "nothing that can be served was measured (eager PyTorch is only the reference): "
            "export the run, then report again"
        )
    return f"none of {', '.join(servable)} kept {r['gate']} of fp32's accuracy (the gate)"
