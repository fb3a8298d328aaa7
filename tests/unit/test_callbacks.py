"""Lightning callbacks of lightship's own, driven by hand: hand-set weights, known answers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightship.callbacks import EpochBar, EpochSummary, StaysStopped, WarmupEMA


class One(pl.LightningModule):
    """A single weight."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))


def test_ema_follows_the_weights_early_and_keeps_its_decay_later() -> None:
    # Lightning's EMAWeightAveraging(decay=0.98) kept 0.98 of the old average from step 2 on:
    # after a jump of the weight from 0 to 1 the average read 0.02, here 9/11
    module = One()
    ema = WarmupEMA(decay=0.98)
    ema.setup(None, module, "fit")  # type: ignore[arg-type]  # (unused)

    def step(global_step: int, weight: float) -> float:
        module.w.data.fill_(weight)
        trainer = SimpleNamespace(global_step=global_step)
        ema.on_train_batch_end(trainer, module, None, None, 0)  # type: ignore[arg-type]
        assert ema._average_model is not None
        return float(next(ema._average_model.module.parameters()).detach())

    assert step(1, 0.0) == 0.0  # the first update copies the weights
    assert step(2, 1.0) == pytest.approx(1 - 2 / 11)  # decay (1 + 1) / (10 + 1)
    for s in range(3, 500):
        step(s, 1.0)
    assert step(500, 2.0) == pytest.approx(1.02)  # long past its warm-up: decay 0.98


def test_the_progress_bar_counts_epochs_from_one() -> None:
    # Lightning's bar read "Epoch 2/2" in the last epoch of max_epochs=3
    bar = EpochBar()
    bar._trainer = SimpleNamespace(max_epochs=3)  # type: ignore[assignment]
    assert bar._get_train_description(2) == "Epoch 3/3 "  # padded to "Validation"


def test_a_moved_checkpoint_state_is_taken_in_its_new_folder(tmp_path: Path) -> None:
    """Paths in the old folder become the same names in the new one; a top-k file
    missing there is dropped, and with it a kth_best_model_path that named it."""
    from lightship.callbacks import _moved_state

    old, new = "/elsewhere/run/checkpoints", tmp_path / "checkpoints"
    new.mkdir()
    (new / "epoch=2.ckpt").write_bytes(b"x")  # epoch=1.ckpt was deleted by hand
    state = {
        "dirpath": old,
        "monitor": "val/acc",
        "best_model_path": f"{old}/epoch=2.ckpt",
        "last_model_path": f"{old}/last.ckpt",
        "best_k_models": {f"{old}/epoch=2.ckpt": 0.9, f"{old}/epoch=1.ckpt": 0.8},
        "kth_best_model_path": f"{old}/epoch=1.ckpt",
    }
    assert _moved_state(state, old, str(new)) == {
        "dirpath": str(new),
        "monitor": "val/acc",
        "best_model_path": str(new / "epoch=2.ckpt"),
        "last_model_path": str(new / "last.ckpt"),
        "best_k_models": {str(new / "epoch=2.ckpt"): 0.9},
        "kth_best_model_path": "",
    }
    # a path outside the old folder is left as it is
    assert _moved_state({"best_model_path": "/x/a.ckpt"}, old, str(new))["best_model_path"] == (
        "/x/a.ckpt"
    )


def test_resuming_a_run_from_before_warmup_ema_asks_for_no_callback() -> None:
    """A run trained with Lightning's EMAWeightAveraging, resumed: Lightning asked to "add the
    following callbacks: ['EMAWeightAveraging']", which WarmupEMA restores the state of anyway.
    Other callbacks it names are still said, and only within lightship's own fit."""
    import warnings

    from lightship.callbacks import fit_trainer

    prefix = "Be aware that when using `ckpt_path`, callbacks used to create the checkpoint "

    def fit(names: str) -> Any:
        def run(*_: object) -> None:
            warnings.warn(f"{prefix}Please add the following callbacks: [{names}].", stacklevel=1)

        return SimpleNamespace(fit=run, interrupted=False)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_trainer(fit("'EMAWeightAveraging'"))
        fit_trainer(fit("'MyCallback'"))
        fit("'EMAWeightAveraging'").fit()  # a user's own Trainer
    assert [str(w.message).removeprefix(prefix) for w in caught] == [
        "Please add the following callbacks: ['MyCallback'].",
        "Please add the following callbacks: ['EMAWeightAveraging'].",
    ]


def test_the_epoch_lines_count_epochs_as_the_progress_bar_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A log's last epoch of max_epochs=4 said "epoch   3", where the bar says "Epoch 4/4"."""
    trainer = SimpleNamespace(
        sanity_checking=False,
        is_global_zero=True,
        current_epoch=3,
        max_epochs=4,
        global_step=12,
        callback_metrics={"val_acc": torch.tensor(0.5), "train_loss": torch.tensor(1.25)},
    )
    EpochSummary().on_validation_epoch_end(trainer, None)  # type: ignore[arg-type]
    assert (
        capsys.readouterr().out == "epoch     4/4  step     12  train_loss 1.2500  val_acc 0.5000\n"
    )


def test_a_dumb_terminal_gets_the_epoch_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """TERM=dumb on a terminal: rich draws its bar as one line at the end, and the log had no
    line while it trained."""
    import sys

    from lightship.callbacks import progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setenv("TERM", "xterm")
    assert isinstance(progress("auto")[1][0], EpochBar)
    monkeypatch.setenv("TERM", "dumb")
    show, (callback,) = progress("auto")
    assert not show and isinstance(callback, EpochSummary)


@pytest.mark.parametrize(
    ("state", "stops"),
    [
        ({"stopping_reason": 3, "stopped_epoch": 22}, True),
        ({"stopped_epoch": 22}, True),  # a Lightning before stopping_reason saved none
        ({"stopping_reason": 0, "stopped_epoch": 0}, False),
    ],
)
def test_a_resumed_run_early_stopping_ended_stays_stopped(
    state: dict[str, int], stops: bool
) -> None:
    early = pl.callbacks.EarlyStopping(monitor="val_loss", patience=6)
    early.load_state_dict({"wait_count": 6, "best_score": torch.tensor(0.1), "patience": 6,
                           **state})  # fmt: skip
    trainer = SimpleNamespace(should_stop=False)
    StaysStopped(early).on_train_start(trainer, None)  # type: ignore[arg-type]
    assert trainer.should_stop is stops
