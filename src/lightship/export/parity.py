"""Parity: an artifact must give the eager model's logits on held-out images."""

from __future__ import annotations

from collections.abc import Callable
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
        return (
            f"max |Δlogit| {self.max_abs_diff:.2e}, argmax agreement {self.agreement:.2%} "
            f"on {self.samples} images"
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


def check_parity(
    predict: Callable[[np.ndarray], np.ndarray],
    reference: np.ndarray,
    x: np.ndarray,
    atol: float,
    min_agreement: float,
    batch: int,
    what: str,
) -> Parity:
    """Run `predict` at batch 1 and at `batch` over `x`; raise ParityError past the limits
    or when either side gives a NaN or infinite logit (which no |Δ| limit would catch)."""
    bad = non_finite(reference)
    if bad:
        raise ParityError(
            f"the eager model gives {bad} non-finite logits (NaN/inf) of {reference.size} on "
            f"{len(x)} images: the checkpoint is unusable and nothing was written — train again "
            "(e.g. with a lower optim.lr)"
        )
    worst_diff, worst_agree = 0.0, 1.0
    for b in (1, batch):
        logits = run_batched(predict, x, b)
        bad = non_finite(logits)
        if bad:
            raise ParityError(
                f"{what} gives {bad} non-finite logits (NaN/inf) of {logits.size} at batch {b} "
                "where the eager model's are finite: nothing was written — try another format "
                "or --opset"
            )
        diff, agree = compare(reference, logits)
        worst_diff, worst_agree = max(worst_diff, diff), min(worst_agree, agree)
    parity = Parity(worst_diff, worst_agree, len(x), (1, batch), atol, min_agreement)
    if worst_diff > atol or worst_agree < min_agreement:
        raise ParityError(
            f"{what} disagrees with the eager model: {parity.summary()} "
            f"(limits |Δ| <= {atol:g}, agreement >= {min_agreement:.2%}); "
            "nothing was written — loosen with --atol if the difference is expected"
        )
    return parity
