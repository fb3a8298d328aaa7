"""`quantize_aware_train(run, scheme, out)`: fine-tune best.ckpt with fake quantization and
export a real int8 ONNX model (the PT2E recipe for torch 2.13 + torchao 0.18; the README's
"Quantization-aware training").

`torch.export` -> `prepare_qat_pt2e` (X86InductorQuantizer, weights in the target's range) ->
a few Lightning epochs at a small learning rate, observers and batch-norm statistics frozen for
the last -> `convert_pt2e` -> ONNX (QDQ) -> checked: ORT runs it as int8 and agrees with torch.
Imports no training code: the shared Lightning pieces live in `lightship.callbacks`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import Callback, EarlyStopping, ModelCheckpoint
from torchao.quantization.pt2e import (
    FusedMovingAvgObsFakeQuantize,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    disable_observer,
    enable_observer,
    move_exported_model_to_eval,
    move_exported_model_to_train,
)
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e
from torchao.quantization.pt2e.quantizer import (
    QuantizationConfig,
    QuantizationSpec,
    SharedQuantizationSpec,
)
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import X86InductorQuantizer

from lightship.callbacks import (
    AtomicCheckpointIO,
    LatestBestCheckpoint,
    evaluate,
    fit_trainer,
    progress,
)
from lightship.config import load_config
from lightship.data import DataSpec
from lightship.data.module import ImageDataModule, config_from_spec
from lightship.errors import LightshipError, QuantizeError, first_line
from lightship.export import onnx as onnx_export
from lightship.export.failure import printout_on_failure_to_debug
from lightship.models.checkpoint import LoadedCheckpoint, load_checkpoint, read_checkpoint
from lightship.quantize import isa, ptq
from lightship.quantize.core import QAT_CKPT, MethodFailed, int8_share, made_here
from lightship.runs import SCRATCH_PREFIXES, RunDir, atomic_paths
from lightship.runtime import load_predictor
from lightship.runtime.ort import DISABLED_OPTIMIZERS, QUANTIZATION, TARGET

log = logging.getLogger(__name__)

PARITY_MIN_AGREEMENT = 0.995
EPS = 2**-12  # smallest scale an observer may choose (as torchao's x86 defaults)
ADVICE = "quantize this model with `--methods static,dynamic` instead"


def weight_range(scheme: isa.Scheme) -> tuple[int, int]:
    """7-bit weights where u8 x s8 pair sums saturate in int16 (AVX2 without VNNI); otherwise
    -127..127, symmetric as static PTQ's (ORT's quantizer) and TensorRT's: -128 would leave no
    room for the exact q - 1 that sends a conv to ORT's AMX GEMM (`ptq.route_convs_to_gemm`)."""
    return (-64, 63) if scheme.reduce_range else (-127, 127)


def qat_config(scheme: isa.Scheme, per_channel: bool = True) -> QuantizationConfig:
    """Fake-quant config: uint8 affine activations, symmetric int8 weights in the target's range.

    torchao's `get_default_x86_inductor_quantization_config(reduce_range=True)` narrows the
    *activations* to 7 bits (fbgemm's old fix); ORT's AVX2 kernels need 7-bit *weights*.
    """
    fq = FusedMovingAvgObsFakeQuantize
    act = QuantizationSpec(
        dtype=torch.uint8,
        quant_min=0,
        quant_max=255,
        qscheme=torch.per_tensor_affine,
        is_dynamic=False,
        observer_or_fake_quant_ctr=fq.with_args(observer=MovingAverageMinMaxObserver, eps=EPS),
    )
    wmin, wmax = weight_range(scheme)
    observer = MovingAveragePerChannelMinMaxObserver if per_channel else MovingAverageMinMaxObserver
    weight = QuantizationSpec(
        dtype=torch.int8,
        quant_min=wmin,
        quant_max=wmax,
        qscheme=torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric,
        ch_axis=0 if per_channel else None,
        is_dynamic=False,
        observer_or_fake_quant_ctr=fq.with_args(observer=observer, eps=EPS),
    )
    return QuantizationConfig(act, act, weight, None, is_qat=True)


class _Quantizer(X86InductorQuantizer):
    """X86InductorQuantizer that also quantizes what ORT needs quantized to run int8 kernels.

    The x86 quantizer annotates for Inductor, which fuses a Linear, or a conv with the residual
    add after it, and takes their float outputs. ORT forms QLinearConv / QGemm only when a
    QuantizeLinear follows the op (or, for Gemm, when its bias is dequantized too), so without
    the additions below the classifier head and every conv that feeds a residual add (9 of
    ResNet-18's 20) stay fp32 in ORT:
    - each Linear's output is quantized, but for the model's output: logits stay float (as in
      static PTQ, `ptq.float_outputs`) and `export_onnx` gives their Gemm an int32 bias instead;
    - each annotated residual add quantizes all its inputs, not only the shortcut;
    - a Linear fed through flatten / view / dropout by a quantized op (the last pool) shares that
      op's output scale, as static PTQ's graph does: else ORT requantizes between them
      (DequantizeLinear -> Reshape -> QuantizeLinear, ~1 % of digits' int8 time).
    """

    def __init__(self, config: QuantizationConfig, float_first_conv: bool = False) -> None:
        super().__init__()
        self.set_global(config)
        self.config = config
        self.float_first_conv = float_first_conv
        self.annotated = 0

    def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        model = super().annotate(model)
        if self.float_first_conv:
            _unannotate_first_conv(model)
        for node in model.graph.nodes:
            a = node.meta.get("quantization_annotation")
            if a is None:
                continue
            self.annotated += 1
            if node.target == torch.ops.aten.linear.default:
                if a.output_qspec is None and all(user.op != "output" for user in node.users):
                    a.output_qspec = self.config.output_activation
                _share_input_scale(node, a)
            elif node.target == torch.ops.aten.add.Tensor:
                for arg in node.args:
                    if isinstance(arg, torch.fx.Node) and arg not in a.input_qspec_map:
                        a.input_qspec_map[arg] = self.config.input_activation
        return model


# Ops that move or drop values without changing the ones that pass: a quantized tensor can
# go through them with its scale.
_RESHAPES = (
    torch.ops.aten.flatten.using_ints,
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.dropout.default,
)


def _share_input_scale(linear: torch.fx.Node, annotation: Any) -> None:
    """Give `linear`'s input the output scale of the quantized op that feeds it through
    `_RESHAPES` only. (Training's dropout scales kept values by 1/(1-p): the shared observer
    widens its range by that much at most.)"""
    x = linear.args[0]
    if not isinstance(x, torch.fx.Node) or x not in annotation.input_qspec_map:
        return
    source = x
    while source.target in _RESHAPES and isinstance(source.args[0], torch.fx.Node):
        if len(source.users) != 1:
            return
        source = source.args[0]
    if source is x:
        return
    producer = source.meta.get("quantization_annotation")
    if producer is not None and producer.output_qspec is not None:
        annotation.input_qspec_map[x] = SharedQuantizationSpec(source)


CONV_OPS = (torch.ops.aten.conv2d.default, torch.ops.aten.linear.default)


def _unannotate_first_conv(model: torch.fx.GraphModule) -> None:
    """Leave the first conv and its single-use ReLU/pool chain in float: quantization starts
    at the next conv's input (as static PTQ's thin-first-conv island, `ptq.thin_first_conv`)."""
    node = next((n for n in model.graph.nodes if n.target in CONV_OPS), None)
    while node is not None:
        node.meta.pop("quantization_annotation", None)
        users = list(node.users)
        if len(users) != 1 or users[0].target in CONV_OPS:
            break
        node = users[0]


def fold_thin_first_conv(model: torch.nn.Module) -> bool:
    """Fold the batch norm of a thin first conv (`ptq.THIN_CONV_K`) into it, in place.

    A thin first conv runs faster as fp32 than as int8 on x86 (see `ptq.thin_first_conv`), so
    QAT leaves it unquantized; but PT2E only folds batch norm back into *quantized* convs, and an
    unfolded conv -> div -> batch-norm chain costs more than int8 saves. Folded here, with the
    checkpoint's running statistics, the conv fine-tunes as a plain conv. Handles a conv followed
    by its BatchNorm2d in the same nn.Sequential (digits_cnn); returns False for other layouts.
    """
    for parent in model.modules():
        if not isinstance(parent, torch.nn.Sequential):
            continue
        children = list(parent.children())
        for i, child in enumerate(children[:-1]):
            if isinstance(child, torch.nn.Conv2d):
                first_conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
                bn = children[i + 1]
                k = child.in_channels * child.kernel_size[0] * child.kernel_size[1]
                if child is not first_conv or not isinstance(bn, torch.nn.BatchNorm2d):
                    return False
                if k > ptq.THIN_CONV_K:
                    return False
                fused = torch.nn.utils.fusion.fuse_conv_bn_eval(child.eval(), bn.eval())
                parent[i] = fused
                parent[i + 1] = torch.nn.Identity()
                return True
    return False


class ExportedNet(torch.nn.Module):
    """An exported (prepared or converted) GraphModule that Lightning may call .train()/.eval()
    on: `GraphModule.train()` raises, and only rewriting the graph switches dropout and batch
    norm (`move_exported_model_to_train/eval`).

    Observers learn ranges from training batches only. After `freeze()` (observers off,
    batch-norm statistics fixed) training runs the eval form of the graph: batch norm normalises
    with its running statistics, as the converted model will, while its weights still learn.
    """

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm
        self.frozen = False

    def train(self, mode: bool = True) -> ExportedNet:
        self.training = mode
        if mode and not self.frozen:
            move_exported_model_to_train(self.gm)
            self.gm.apply(enable_observer)
        else:
            move_exported_model_to_eval(self.gm)
            self.gm.apply(disable_observer)
        return self

    def freeze(self) -> None:
        self.frozen = True
        self.train(self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gm(x)


class LitQAT(pl.LightningModule):
    """Fine-tunes an `ExportedNet`; hyper-parameters are plain types (weights_only checkpoints)
    and carry the source checkpoint's specs, so `qat.ckpt` says what it was made from."""

    def __init__(self, net: ExportedNet, source: dict[str, Any], qat: dict[str, Any]) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net"])
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["qat"]["lr"], weight_decay=0)


class FreezeLate(Callback):
    """From epoch `at` on: observers off and batch-norm statistics frozen, so the last epoch
    fine-tunes the weights against the scales and statistics the int8 model will use. The
    `checkpoint` forgets the epochs before it: the best of the frozen epochs is handed on, even
    where an earlier one, trained with the observers on, scored higher."""

    def __init__(self, at: int, checkpoint: ModelCheckpoint | None = None) -> None:
        self.at = at
        self.checkpoint = checkpoint
        self.frozen = False

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch < self.at or self.frozen:
            return
        self.frozen = True
        if self.checkpoint is not None:
            self.checkpoint.best_k_models = {}
            self.checkpoint.kth_best_model_path = ""
            self.checkpoint.best_model_path = ""
            self.checkpoint.best_model_score = None
        net = pl_module.net
        if isinstance(net, ExportedNet) and not net.frozen:
            # counted from 1, as the epoch lines and the progress bar count them
            log.info("QAT epoch %d: observers off, batch-norm statistics frozen", self.at + 1)
            net.freeze()


class StopAfterFreezing(EarlyStopping):
    """EarlyStopping on val_acc (patience 2) that, where it would stop before `freeze`'s epoch,
    moves that epoch up and runs it first: the model QAT hands on has always been fine-tuned
    against the scales the int8 model will use. On a small validation split val_acc reaches
    1.0 at once, and a 4-epoch QAT stopped after its third with the observers still on."""

    def __init__(self, freeze: FreezeLate | None) -> None:
        super().__init__(monitor="val_acc", mode="max", patience=2)
        self.freeze = freeze

    def _run_early_stopping_check(self, trainer: pl.Trainer) -> None:
        asked_before = trainer.should_stop  # another's stop is not ours to cancel
        super()._run_early_stopping_check(trainer)
        if (
            trainer.should_stop
            and not asked_before
            and self.freeze is not None
            and trainer.current_epoch < self.freeze.at
        ):
            trainer.should_stop = False
            self.freeze.at = trainer.current_epoch + 1
            log.info(
                "QAT: val_acc has not improved for %d epochs: a last epoch with observers off",
                self.patience,
            )


def _one_line(exc: BaseException) -> str:
    return first_line(exc) or type(exc).__name__


# The convs torchao's conv + batch-norm rewrites try (`_conv_bn_patterns_present`), by their
# aten op's name
_CONVS = frozenset({"conv1d", "conv2d", "conv_transpose1d", "conv_transpose2d"})


@contextlib.contextmanager
def _conv_bn_patterns_present() -> Iterator[None]:
    """torchao's conv + batch-norm rewrites, the fuse in `prepare_qat_pt2e` and the fold in
    `convert_pt2e`, try their patterns for four convs each (1d, 2d and both transposed),
    every pattern graph made by a `torch.export` of its own: 96 in the fold alone, 30 s of a
    58 s QAT of the tiny CNN on the AVX2 EPYC, twice that where CUDA is present. Here a
    conv that is not in the graph is not tried, since none of its patterns can match there;
    a graph with none of the four gets torchao's own passes whole (each pass also reshapes
    the graph's dequantize nodes, which one conv's pass still does)."""
    from torchao.quantization.pt2e import qat_utils

    def only_present(helper: Callable[..., torch.fx.GraphModule]) -> Any:
        @functools.wraps(helper)
        def tried(m: torch.fx.GraphModule, conv_fn: Any, *args: Any, **kwargs: Any) -> Any:
            ops = {getattr(n.target, "_opname", None) for n in m.graph.nodes}  # aten's names
            if ops.isdisjoint(_CONVS) or conv_fn.__name__ in ops:
                return helper(m, conv_fn, *args, **kwargs)
            return m

        return tried

    names = ("_fuse_conv_bn_qat_helper", "_fold_conv_bn_qat_helper")
    helpers = {name: getattr(qat_utils, name) for name in names}
    try:
        for name, helper in helpers.items():
            setattr(qat_utils, name, only_present(helper))
        yield
    finally:
        for name, helper in helpers.items():
            setattr(qat_utils, name, helper)


# Ops that draw random numbers: captured in training mode, they stay in the int8 model
# (`move_exported_model_to_eval` turns off aten.dropout alone)
_RANDOM_OPS = re.compile(
    r"aten\.(_?(bernoulli|rand|randn|randint|randperm|normal|uniform|multinomial|random"
    r"|exponential|cauchy|geometric|log_normal|poisson|binomial|standard_gamma|sample_dirichlet"
    r"|philox)|native_dropout|_fused_dropout)"
)
# Random where their argument says so (its position, its name): a dropout other than
# nn.Dropout's (Dropout2d, AlphaDropout) by its rate, RReLU by its training flag, attention by
# its dropout_p
_RANDOM_IF = {
    re.compile(r"aten\.(feature_dropout|alpha_dropout|feature_alpha_dropout)\."): (1, "p"),
    re.compile(r"aten\.rrelu\."): (3, "training"),
    re.compile(r"aten\.scaled_dot_product_attention\."): (4, "dropout_p"),
}


def _draws(node: torch.fx.Node) -> bool:
    """Whether `node` draws random numbers as it was captured (in training mode)."""
    target = str(node.target)
    if _RANDOM_OPS.match(target):
        return True
    for op, (at, key) in _RANDOM_IF.items():
        if op.match(target):
            value = node.kwargs.get(key, node.args[at] if len(node.args) > at else 0)
            return bool(value) if isinstance(value, (bool, int, float)) else True
    return False


def _refuse_random_ops(gm: torch.fx.GraphModule, name: str) -> None:
    """A model whose training-mode forward draws random numbers other than nn.Dropout's
    (timm's drop path: `bernoulli_`; Dropout2d; attention's dropout_p) is captured with them,
    and its int8 model answered at random: refused before the fine-tuning, where its parity
    check had said only that the QAT model disagreed with torch (187 of 269 images). Every
    graph in it: a `torch.no_grad()` block is a submodule's."""
    drawn = sorted(
        {
            str(n.target)
            for module in gm.modules()
            if isinstance(module, torch.fx.GraphModule)
            for n in module.graph.nodes
            if n.op == "call_function" and _draws(n)
        }
    )
    if drawn:
        raise MethodFailed(
            "qat",
            f"model '{name}' draws random numbers in training mode ({', '.join(drawn)}: "
            "stochastic depth, drop path or a dropout other than nn.Dropout, most likely), "
            "which the QAT model would keep: have it skip them while "
            "torch.compiler.is_exporting() is true",
            ADVICE,
        )


def prepare(
    loaded: LoadedCheckpoint, example: torch.Tensor, scheme: isa.Scheme, per_channel: bool
) -> torch.fx.GraphModule:
    """The model as a fake-quantized GraphModule (dynamic batch), or QuantizeError."""
    name = loaded.model_spec["name"]
    float_first_conv = fold_thin_first_conv(loaded.model)
    model = loaded.model.train()  # QAT folds batch norm into conv from the training graph
    try:
        # a capture that fails prints its partial graph first: `--verbose` shows it
        with printout_on_failure_to_debug(log, "torch.export of the model for QAT"):
            ep = torch.export.export(
                model, (example,), dynamic_shapes=({0: torch.export.Dim("batch")},)
            )
    except Exception as exc:  # torch.export raises many types (UserError, guard errors, ...)
        raise MethodFailed(
            "qat", f"cannot trace model '{name}' with torch.export: {_one_line(exc)}", ADVICE
        ) from None
    _refuse_random_ops(ep.graph_module, name)
    quantizer = _Quantizer(qat_config(scheme, per_channel), float_first_conv)
    try:
        with _conv_bn_patterns_present():
            prepared = prepare_qat_pt2e(ep.module(), quantizer)
    except Exception as exc:
        raise MethodFailed(
            "qat", f"cannot prepare model '{name}': {_one_line(exc)}", ADVICE
        ) from None
    if quantizer.annotated == 0:
        raise MethodFailed(
            "qat",
            f"nothing to quantize in model '{name}': no conv or linear the x86 quantizer supports",
            ADVICE,
        )
    prepared.meta["float_first_conv"] = float_first_conv
    return prepared


def convert(prepared: torch.fx.GraphModule) -> ExportedNet:
    """The fake-quantized model (`prepare`), fine-tuned, as the int8 model (eval mode)."""
    with _conv_bn_patterns_present():
        return ExportedNet(convert_pt2e(prepared)).eval()


# What the run's config.yaml says of loading its data, which QAT fine-tunes with as training
# did (a batch size lowered to fit memory, workers); the split comes from the checkpoint.
LOADER_KEYS = (
    "batch_size",
    "eval_batch_size",
    "num_workers",
    "pin_memory",
    "persistent_workers",
    "prefetch_factor",
)


def _data_module(spec: DataSpec, run: RunDir) -> ImageDataModule:
    """Training's data module over the checkpoint's split (same data, same held-out test),
    loading it as the run's config.yaml says (DataConfig's defaults without one)."""
    data = config_from_spec(spec)
    try:
        trained = load_config(run.config, recorded=True).data if run.config.is_file() else None
    except LightshipError as exc:  # quantize takes no --set: a run's own file to fix
        log.warning("QAT loads its data with the defaults: %s", first_line(exc))
        trained = None
    if trained is not None:
        data = data.model_copy(update={k: getattr(trained, k) for k in LOADER_KEYS})
    return ImageDataModule(data, check_layout=False)  # the run's data, as it trained on it


def fine_tune(
    lit: LitQAT, dm: ImageDataModule, workdir: Path, epochs: int
) -> tuple[pl.Trainer, Path]:
    """Lightning fit with atomic checkpoints; returns the trainer and the best checkpoint."""
    checkpoint = LatestBestCheckpoint(
        dirpath=workdir,
        filename="qat-{epoch:02d}",
        monitor="val_acc",
        mode="max",
        save_top_k=1,
    )
    # With one epoch there is no "late": freezing would leave the observers nothing to see.
    freeze = [FreezeLate(epochs - 1, checkpoint)] if epochs > 1 else []
    early = StopAfterFreezing(freeze[0] if freeze else None)
    show_bar, bars = progress("auto")
    trainer = pl.Trainer(
        default_root_dir=workdir,
        max_epochs=epochs,
        accelerator="cpu",  # the graph was exported on CPU tensors and targets a CPU runtime
        devices=1,
        logger=False,
        callbacks=[checkpoint, early, *freeze, *bars],
        enable_progress_bar=show_bar,
        enable_model_summary=False,
        num_sanity_val_steps=0,  # observers have seen no batch yet: the scales are meaningless
        plugins=[AtomicCheckpointIO()],
    )
    fit_trainer(trainer, lit, datamodule=dm)
    if not checkpoint.best_model_path:
        raise QuantizeError(f"QAT fine-tuning wrote no checkpoint in {workdir}")
    return trainer, Path(checkpoint.best_model_path)


def quantize_aware_train(
    run: RunDir,
    scheme: isa.Scheme,
    out_path: Path,
    ckpt_path: Path | None = None,
    *,
    epochs: int,
    lr: float,
    seed: int,
    per_channel: bool = True,
) -> dict[str, Any]:
    """Write `out_path` (int8 ONNX) and RUN/quantize/qat.ckpt; return their manifest fields.
    The two are renamed into place together here; given `ckpt_path`, they are temporary files
    that the caller renames into place together (`Quantizer.qat`, which measures the model
    first), and are written as they are.

    Raises QuantizeError, leaving no file behind, when the model cannot be exported or
    quantized, when ORT would not run the result in int8, or when ORT and torch disagree.
    """
    if epochs < 1:
        raise QuantizeError(f"QAT needs at least one epoch (--qat-epochs {epochs})")
    t_start = time.perf_counter()
    pl.seed_everything(seed, workers=True, verbose=False)
    loaded = load_checkpoint(run.require_checkpoint())
    dm = _data_module(DataSpec.from_dict(loaded.data_spec), run)
    log.info(
        "QAT: fine-tuning %s for up to %d epochs at lr %g, batches of %d",
        run.relative(run.best_ckpt),
        epochs,
        lr,
        dm.cfg.batch_size,
    )
    splits = dm.splits
    example = torch.from_numpy(np.ascontiguousarray(splits.train_x[:2]))  # batch >= 2 stays free
    prepared = prepare(loaded, example, scheme, per_channel)
    float_first = bool(prepared.meta.get("float_first_conv"))

    net = ExportedNet(prepared)
    settings = {
        "epochs": epochs,
        "lr": lr,
        "seed": seed,
        "per_channel": per_channel,
        "target": scheme.target,
        "weight_range": list(weight_range(scheme)),
    }
    source = {k: loaded.hparams[k] for k in ("model_spec", "labels", "input_spec", "data_spec")}
    lit = LitQAT(net, source, settings)
    ckpt_final = run.quantize_dir / QAT_CKPT
    with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIXES["qat"], dir=run.root) as tmpdir:
        t0 = time.perf_counter()
        trainer, best = fine_tune(lit, dm, Path(tmpdir), epochs)
        fine_tune_seconds = time.perf_counter() - t0
        best_ckpt = read_checkpoint(best)  # weights_only: the file we publish must load so
        lit.load_state_dict(best_ckpt["state_dict"])
        net.frozen = True
        net.eval()
        fq_acc = evaluate(net, splits.test_x, splits.test_y)
        try:
            converted = convert(prepared)
        except Exception as exc:
            raise MethodFailed("qat", f"convert_pt2e: {_one_line(exc)}", ADVICE) from None
        # committed together: a stop signal between two commits of their own would leave a
        # new qat.ckpt beside the old int8 model
        committed = (
            atomic_paths(ckpt_final, out_path)
            if ckpt_path is None
            else contextlib.nullcontext((ckpt_path, out_path))
        )
        with committed as (tmp_ckpt, tmp_onnx):
            try:
                exported = export_onnx(converted, example, tmp_onnx)
            except Exception as exc:
                raise MethodFailed(
                    "qat", f"cannot export the int8 model to ONNX: {_one_line(exc)}", ADVICE
                ) from None
            ptq.copy_metadata(
                run.export_dir / "model.onnx",
                tmp_onnx,
                {
                    QUANTIZATION: "qat",
                    TARGET: scheme.target,
                    "lightship.reduce_range": str(scheme.reduce_range).lower(),
                    # keep ORT from moving the Quantize in front of the float max-pool
                    **({DISABLED_OPTIMIZERS: "QDQPropagationTransformer"} if float_first else {}),
                },
            )
            with made_here("qat", tmp_onnx):
                share = int8_share(tmp_onnx)
            if share["int8_nodes"] == 0:
                raise MethodFailed(
                    "qat",
                    f"the int8 model runs no int8 kernel in ONNX Runtime: {share['float_nodes']} "
                    "float Conv/MatMul nodes after optimisation",
                    ADVICE,
                )
            with made_here("qat", tmp_onnx):
                parity = _parity(converted, tmp_onnx, splits.test_x)
            tmp_ckpt.write_bytes(best.read_bytes())
    log.info(
        "QAT: %d epochs in %.1f s, fake-quant accuracy %.4f, parity %s",
        trainer.current_epoch,
        fine_tune_seconds,
        fq_acc,
        parity,
    )
    return {
        "file_ckpt": run.relative(ckpt_final),
        "epochs": trainer.current_epoch,
        "max_epochs": epochs,
        "freeze_epoch": epochs - 1 if epochs > 1 else None,
        "lr": lr,
        "seed": seed,
        "per_channel": per_channel,
        "first_conv_fp32": float_first,
        "scheme": {
            **scheme.as_dict(),
            "weight_range": list(weight_range(scheme)),
            "weights": "int8 symmetric " + ("per-channel" if per_channel else "per-tensor"),
            "activations": "uint8 affine per-tensor",
        },
        "best_val_acc": _best_score(best_ckpt),
        "fake_quant_accuracy": fq_acc,
        "fine_tune_seconds": round(fine_tune_seconds, 2),
        "parity": parity,
        **exported,
        "quantize_seconds": round(time.perf_counter() - t_start, 2),
    }


def export_onnx(converted: torch.nn.Module, example: torch.Tensor, path: Path) -> dict[str, Any]:
    """Write the converted model as QDQ ONNX whose classifier ORT runs as QGemm with float
    logits (its Gemm gets an int32 bias: `ptq.quantize_gemm_bias`), flattening channels-last
    as static int8 does (`ptq.flatten_channels_last`)."""
    exported = onnx_export.write(converted, example, path, {})
    ptq.quantize_gemm_bias(path)
    exported["flattens_channels_last"] = ptq.flatten_channels_last(path, path)
    return exported


def _best_score(ckpt: dict[str, Any]) -> float:
    for key, state in ckpt.get("callbacks", {}).items():
        if key.startswith("LatestBestCheckpoint") and state.get("best_model_score") is not None:
            return float(state["best_model_score"])
    return float("nan")


def _parity(converted: torch.nn.Module, onnx_path: Path, x: np.ndarray) -> dict[str, Any]:
    """The converted torch model and the ORT session on the test split, or QuantizeError."""
    with torch.inference_mode():
        ref = np.concatenate(
            [converted(torch.from_numpy(x[i : i + 256])).numpy() for i in range(0, len(x), 256)]
        )
    # unsplit, as accuracy is measured (`evaluate.unsplit`)
    got = load_predictor(onnx_path, split=False, isa_check=False).predict(x)
    # A pick that ties torch's top logit agrees: an exact tie in torch's logits is no error.
    picked = ref[np.arange(len(ref)), got.argmax(1)]
    agreement = float(np.mean(picked >= ref.max(1) - 1e-6))
    strict = float(np.mean(ref.argmax(1) == got.argmax(1)))
    max_diff = float(np.abs(ref - got).max())
    if agreement < PARITY_MIN_AGREEMENT:
        raise QuantizeError(
            # counts: as a percentage, 0.99499 would read 99.50% < 99.5%
            f"QAT ONNX model disagrees with torch: argmax agreement "
            f"{round(agreement * len(x)):,}/{len(x):,} test images < "
            f"{100 * PARITY_MIN_AGREEMENT:g}%, max |Δlogit| {max_diff:.3g}"
        )
    return {
        "argmax_agreement": agreement,
        "argmax_agreement_strict": strict,
        "max_abs_logit_diff": max_diff,
        "samples": len(x),
    }
