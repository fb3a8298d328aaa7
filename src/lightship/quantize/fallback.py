"""Accuracy-gate fallback: find the quantized nodes that hurt most, keep them in fp32.

Each compute node's output is compared between the fp32 model and the int8 (QDQ) model on
calibration images as a signal-to-quantization-noise ratio (SQNR, dB). Error accumulates with
depth, so a node is ranked by the noise it *adds*: its output's noise-to-signal power ratio
(NSR = 10^(-SQNR/10)) minus that of the compute output(s) feeding it (`ptq.walk_back`).
That span is what keeping the node in fp32 takes out (`ptq.fp32_island`): its weights'
quantization and the Q/DQ on its input, where an activation is rounded and clipped.
Measured from the node's own (already quantized) input instead, that clipping was charged to
no node: entropy calibration's digits model lost 43 -> 21 dB at one Q/DQ and 12 -> 4 dB at
the one before the Gemm, and the fallback kept the first conv in fp32, which lost least and
gained nothing (validation 0.9926 before and after; the Gemm kept instead: 0.9963).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from lightship.data.sources import note_once
from lightship.errors import ConfigError
from lightship.quantize.ptq import COMPUTE_OPS, walk_back

log = logging.getLogger(__name__)

DEFAULT_GATE = 0.99  # an int8 variant keeps >= 99 % of fp32 accuracy
GATE_MAX = 1.1  # above 1 forces the fallback (tests use 1.01); far above is a typo


def check_gate(gate: float, command: str) -> None:
    """The accuracy gate is a fraction of fp32 accuracy; `--gate 5` (meant as 5 points, or
    95 %) would fail every variant and replace good int8 models with failed ones."""
    if math.isfinite(gate) and 0 < gate <= GATE_MAX:
        return
    # 99 reads as a percentage kept (0.99), 5 as points lost (0.95)
    guess = gate / 100 if 50 <= gate <= 100 else 1 - gate / 100
    hint = f": did you mean {guess:g}?" if 1 < gate <= 100 else ""
    raise ConfigError(
        f"{command} --gate is the fraction of fp32 accuracy an int8 variant keeps, "
        f"in (0, {GATE_MAX:g}] (e.g. 0.99), got {gate:g}{hint}"
    )


def passes_gate(accuracy: float, fp32_accuracy: float, gate: float, images: int) -> bool:
    """Whether a variant with `accuracy` keeps `gate` x `fp32_accuracy`, both measured on the
    same `images`: compared exactly, as counts of right answers against the gate as written
    (0.99 is 99/100). In floats, 99 right of 104 against fp32's 100 at gate 0.99 failed:
    99/104 = 0.95192307692307687 < 0.99 * (100/104) = 0.95192307692307698."""
    right, fp32_right = round(accuracy * images), round(fp32_accuracy * images)
    warning = few_images_warning(fp32_accuracy, gate, images)
    if warning is not None:  # quantize gates every round and variant, report every variant
        note_once(logging.WARNING, warning, log)
    return right >= Fraction(str(float(gate))) * fp32_right


def few_images_warning(fp32_accuracy: float, gate: float, images: int) -> str | None:
    """Where one image is more accuracy than the gate lets a variant lose below fp32 (a tiny
    split, or a gate close to 1), a single image decides pass or FAIL: said so, on one line.
    None where the gate allows an image or more, or allows nothing on purpose (gate >= 1)."""
    fp32_right = round(fp32_accuracy * images)
    allowed = (1 - Fraction(str(float(gate)))) * fp32_right  # images a variant may lose
    if images <= 0 or not 0 < allowed < 1:
        return None
    points = f"{float(100 * allowed / images):.2g}"
    return (
        f"the accuracy gate is decided on {images} images: one image is {100 / images:.2g} "
        f"points of accuracy and the gate lets a variant lose at most {points} "
        f"point{'' if points == '1' else 's'} below fp32's, so a single image decides pass or FAIL"
    )


SQNR_CAP_DB = 120.0  # an exact tensor has infinite SQNR; cap it so differences stay finite


def sqnr_db(reference: np.ndarray, approx: np.ndarray) -> float:
    ref = reference.astype(np.float64).ravel()
    noise = float(np.linalg.norm(ref - approx.astype(np.float64).ravel()))
    signal = float(np.linalg.norm(ref))
    if noise == 0.0:
        return SQNR_CAP_DB
    if signal == 0.0:
        return -SQNR_CAP_DB
    return min(20.0 * math.log10(signal / noise), SQNR_CAP_DB)


def nsr(sqnr: float) -> float:
    """Noise-to-signal power ratio of an SQNR in dB: adds up along a chain, where dB do not
    (an exact input's 120 dB minus a first conv's 43 dB is no loss of 77 dB)."""
    return 10.0 ** (-sqnr / 10.0)


@dataclass(frozen=True)
class NodeError:
    node: str
    op_type: str
    sqnr_in_db: float  # of the compute output(s) feeding the node (the noisiest); exact: cap
    sqnr_out_db: float

    @property
    def noise_added(self) -> float:
        """NSR of the node's output minus that of its input before its Q/DQ."""
        return nsr(self.sqnr_out_db) - nsr(self.sqnr_in_db)

    def as_dict(self) -> dict[str, object]:
        return {
            "node": self.node,
            "op_type": self.op_type,
            "sqnr_in_db": round(self.sqnr_in_db, 2),
            "sqnr_out_db": round(self.sqnr_out_db, 2),
            "noise_added": float(f"{self.noise_added:.3g}"),
        }


def _run_with_outputs(path: Path, names: list[str], feeds: list[dict[str, np.ndarray]]) -> list:
    model = onnx.load(str(path))
    existing = {o.name for o in model.graph.output}
    for name in names:
        if name not in existing:
            model.graph.output.append(onnx.ValueInfoProto(name=name))
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep names
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    per_batch = [sess.run(names, feed) for feed in feeds]
    return [np.concatenate([b[i] for b in per_batch]) for i in range(len(names))]


def rank_nodes(
    fp32: Path,
    int8: Path,
    images: np.ndarray,
    input_name: str = "input",
    excluded: frozenset[str] = frozenset(),
    batch: int = 32,
) -> list[NodeError]:
    """Quantized compute nodes, worst first (most noise added, see the module's doc)."""
    fp32_graph, int8_graph = onnx.load(str(fp32)).graph, onnx.load(str(int8)).graph
    # Node names survive quantization; tensor names do not (Q/DQ pairs are inserted), so each
    # model's own output of a node is read by the node's name. Outputs are compared, not
    # inputs: ORT folds a Relu after a conv into the Q/DQ that follows, so the int8 model's
    # tensor of a Relu's name can hold the conv's output, negatives and all.
    in_int8 = {n.name: n for n in int8_graph.node}
    compute = [n for n in fp32_graph.node if n.op_type in COMPUTE_OPS and n.name in in_int8]
    nodes = [n for n in compute if n.name not in excluded]
    if not nodes:
        return []
    feeds = [{input_name: images[i : i + batch]} for i in range(0, len(images), batch)]
    ref = _run_with_outputs(fp32, [n.output[0] for n in compute], feeds)
    got = _run_with_outputs(int8, [in_int8[n.name].output[0] for n in compute], feeds)
    out_db = {n.name: sqnr_db(r, g) for n, r, g in zip(compute, ref, got, strict=True)}
    ranked = []
    for n in nodes:
        # the model's input is exact (before its own Q/DQ); fed by several: the noisiest
        sqnr_in = min((out_db[f] for f in walk_back(fp32_graph, n)[1] if f in out_db), default=None)
        ranked.append(
            NodeError(
                n.name, n.op_type, SQNR_CAP_DB if sqnr_in is None else sqnr_in, out_db[n.name]
            )
        )
    return sorted(ranked, key=lambda e: e.noise_added, reverse=True)
