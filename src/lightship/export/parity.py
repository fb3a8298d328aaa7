"""Parity: an artifact must give the eager model's logits on held-out images."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from lightship.errors import ParityError


@dataclass(frozen=True)
class Parity:
    max_abs_diff: float
    agreement: float
    samples: int
    batches: tuple[int, ...]
    atol: float
    min_agreement: float

    def as_dict(self) -> dict[str, object]:
        return {
            "max_abs_diff": self.max_abs_diff,
            "argmax_agreement": self.agreement,
            "samples": self.samples,
            "batch_sizes": list(self.batches),
            "atol": self.atol,
            "min_agreement": self.min_agreement,
        }

    def summary(self) -> str:
        # a count: as a percentage, 19,999 of 20,000 reads 100.00%
        right = round(self.agreement * self.samples)
        return (
            f"max |Δlogit| {self.max_abs_diff:.2e}, argmax agreement {right:,}/{self.samples:,} "
            "images"
        )


def run_batched(
    predict: Callable[[np.ndarray], np.ndarray], x: np.ndarray, batch: int
) -> np.ndarray:
    return np.concatenate([predict(x[i : i + batch]) for i in range(0, len(x), batch)])


def non_finite(logits: np.ndarray) -> int:
    """How many entries are NaN or infinite."""
    return int(logits.size - np.count_nonzero(np.isfinite(logits)))


def compare(reference: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
    """(max |Δ logit|, share of rows with the same argmax)."""
    diff = float(np.max(np.abs(reference.astype(np.float64) - logits.astype(np.float64))))
    agreement = float(np.mean(reference.argmax(1) == logits.argmax(1)))
    return diff, agreement


def check_reference(references: Mapping[int, np.ndarray], samples: int) -> None:
    """ParityError when the eager model itself gives a NaN or infinite logit."""
    for reference in references.values():
        bad = non_finite(reference)
        if bad:
            raise ParityError(
                f"the eager model gives {bad} non-finite logits (NaN/inf) of {reference.size} on "
                f"{samples} images: the checkpoint is unusable and nothing was written — train "
                "again (e.g. with a lower optim.lr)"
            )


def check_parity(
    predict: Callable[[np.ndarray], np.ndarray],
    references: Mapping[int, np.ndarray],
    x: np.ndarray,
    atol: float,
    min_agreement: float,
    what: str,
    fix: str,
) -> Parity:
    """Run `predict` over `x` at each batch size of `references` (batch size -> the eager model's
    logits, run in the same chunks) and compare each chunk with eager's on the same images: a
    model whose output depends on its batch (batch statistics, a branch on the batch) is held to
    what eager gives at that batch. Raise ParityError past the limits or when the artifact gives
    a NaN or infinite logit (which no |Δ| limit would catch); `fix` says how to go on without
    this artifact."""
    worst_diff, worst_agree = 0.0, 1.0
    for b, reference in references.items():
        logits = run_batched(predict, x, b)
        bad = non_finite(logits)
        if bad:
            raise ParityError(
                f"{what} gives {bad} non-finite logits (NaN/inf) of {logits.size} at batch {b} "
                f"where the eager model's are finite: it was not written — {fix}"
            )
        diff, agree = compare(reference, logits)
        worst_diff, worst_agree = max(worst_diff, diff), min(worst_agree, agree)
    parity = Parity(worst_diff, worst_agree, len(x), tuple(references), atol, min_agreement)
    if worst_diff > atol or worst_agree < min_agreement:
        raise ParityError(
            f"{what} disagrees with the eager model: {parity.summary()} (limits |Δ| <= "
            f"{atol:g}, agreement >= {100 * min_agreement:g}%); it was not written — loosen "
            f"with --atol if the difference is expected, or {fix}"
        )
    return parity
