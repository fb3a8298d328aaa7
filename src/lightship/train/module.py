"""The LightningModule: a classifier over uint8 images with accuracy metrics."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy

from lightship import models


def random_affine(
    x: torch.Tensor, degrees: float = 10.0, scale: float = 0.1, shift: float = 0.07
) -> torch.Tensor:
    """Rotate, scale and shift each uint8 image at random (zero fill), staying uint8.

    Shift is a fraction of the image size (0.07 ~ 2 px at 28x28). One `affine_grid` +
    `grid_sample` for the whole batch, on whatever device the batch is on.
    """
    n = x.shape[0]
    dev = x.device

    def uniform(limit: float) -> torch.Tensor:
        return (torch.rand(n, device=dev) * 2 - 1) * limit

    angle = uniform(degrees) * (torch.pi / 180)
    inv_scale = 1.0 / (1.0 + uniform(scale))
    cos, sin = torch.cos(angle) * inv_scale, torch.sin(angle) * inv_scale
    theta = torch.stack(
        [
            torch.stack([cos, -sin, uniform(2 * shift)], 1),
            torch.stack([sin, cos, uniform(2 * shift)], 1),
        ],
        1,
    )
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out.round_().clamp_(0, 255).to(x.dtype)


class LitClassifier(pl.LightningModule):
    """Hyper-parameters are plain types only, so checkpoints load with `weights_only=True`
    and carry everything needed to rebuild the model (spec, labels, input and data spec)."""

    def __init__(
        self,
        model_spec: dict[str, Any],
        labels: list[str],
        input_spec: dict[str, Any],
        data_spec: dict[str, Any],
        optim: dict[str, Any],
        augment: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = models.create(model_spec)
        num_classes = len(labels)
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        if self.hparams["augment"]:
            x = random_affine(x)
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> Any:
        o = self.hparams["optim"]
        params = self.model.parameters()
        opt: torch.optim.Optimizer
        if o["name"] == "sgd":
            opt = torch.optim.SGD(
                params,
                lr=o["lr"],
                momentum=o["momentum"],
                weight_decay=o["weight_decay"],
                nesterov=True,
            )
        else:
            opt = torch.optim.AdamW(params, lr=o["lr"], weight_decay=o["weight_decay"])
        if o["scheduler"] == "none" or o["lr"] == 0:
            return opt
        if o["scheduler"] == "onecycle":
            total = int(self.trainer.estimated_stepping_batches)
            sched: Any = torch.optim.lr_scheduler.OneCycleLR(
                opt, max_lr=o["lr"], total_steps=max(total, 1)
            )
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, T_max=max(self.trainer.max_epochs or 1, 1)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
