from __future__ import annotations

import ctypes
import json
import logging
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache, partial
from pathlib import Path
from typing import Any, Self

import numpy as np

from lightship.errors import RunError, first_line

# Keys every lightship artifact carries (ONNX metadata_props; an extra JSON file in .ts/.pt2).
META_LABELS = "lightship.labels"
META_INPUT_SPEC = "lightship.input_spec"
META_FILE = "lightship.json"


@contextmanager
def quiet_loggers(*names: str, level: int = logging.CRITICAL) -> Iterator[None]:
    """The loggers `names` let through only `level` and above for a moment, then as before:
    a library's noise around one call, without changing a caller's logging for good."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, before in zip(loggers, levels, strict=True):
            logger.setLevel(before)


def read_metadata(
    meta: dict[str, str], source: Path | str
) -> tuple[list[str] | None, dict[str, Any] | None]:
    """(labels, input spec) from artifact metadata; None where absent (a foreign model).

    RunError when present but malformed: a spec that is not `{"shape": [N, C, H, W]}` would
    otherwise fail at the first request, long after the server said it was ready.
    """
    labels = _json_meta(meta, META_LABELS, source)
    spec = _json_meta(meta, META_INPUT_SPEC, source)
    if labels is not None and not (
        isinstance(labels, list) and all(isinstance(x, str) for x in labels)
    ):
        raise RunError(
            f"{source}: metadata {META_LABELS} is not valid (not a list of strings): re-export it"
        )
    if spec is not None and not valid_input_spec(spec):
        raise RunError(
            f"{source}: metadata {META_INPUT_SPEC} is not valid "
            "(needs a shape [N, C, H, W] with positive integer C, H, W): re-export it"
        )
    return labels, spec


def _json_meta(meta: dict[str, str], key: str, source: Path | str) -> Any:
    if key not in meta:
        return None
    try:
        return json.loads(meta[key])
    except json.JSONDecodeError:
        raise RunError(f"{source}: metadata {key} is not valid JSON: re-export it") from None


def valid_input_spec(spec: Any) -> bool:
    """Whether `spec` has a shape [N, C, H, W] with positive integer C, H, W."""
    shape = spec.get("shape") if isinstance(spec, dict) else None
    return (
        isinstance(shape, list)
        and len(shape) == 4
        and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape[1:])
    )


class LoadError(RunError):
    """A model file its runtime cannot open. `runtime` and the runtime's first line are kept
    apart from the advice to make the file again, for a stage that has just made it."""

    def __init__(self, path: Path, kind: str, runtime: str, exc: Exception, fix: str) -> None:
        self.runtime = runtime
        self.path, self.kind = path, kind
        self._line = first_line(exc, limit=1000) or type(exc).__name__
        super().__init__(self._said(fix))

    def _said(self, fix: str) -> str:
        return f"cannot load {self.kind} model {self.path} ({self.reason()}): {fix}"

    def with_fix(self, fix: str) -> LoadError:
        """The same error with the fix of a caller that knows more (the run and variant)."""
        again = LoadError.__new__(LoadError)
        again.__dict__.update(self.__dict__)
        RunError.__init__(again, self._said(fix))
        return again

    def reason(self, names: dict[str, str] | None = None) -> str:
        """The runtime's first line, each key of `names` (a temporary path) replaced by its
        value before it is cut to 200 characters, which a long path would otherwise fill: at
        a word, marked (torch's "...your checkpoint file is" read as the whole of it)."""
        line = self._line
        for old, new in (names or {}).items():
            line = line.replace(old, new)
        if len(line) <= 200:
            return line
        cut = line[:199]
        return (cut.rsplit(" ", 1)[0] if " " in cut[100:] else cut) + "…"


class InputError(ValueError):
    """The caller's input does not fit the model (shape, dtype, values); a 4xx in a server."""


class OutputError(RuntimeError):
    """The model's output does not fit its batch or labels (`Predictor.logits`): the model's
    fault, not the caller's; a 5xx in a server."""


@contextmanager
def torch_threads_kept() -> Iterator[None]:
    """torch's intra-op thread count as the caller had it, after a stage that loads torch
    predictors (each sets the process's one pool: `torch_backends.load`): `export` and
    `report` from a script left a caller's `torch.set_num_threads(1)` at the core count."""
    import sys

    torch = sys.modules.get("torch")  # never imported here: an ONNX-only caller has none
    before = torch.get_num_threads() if torch is not None else None
    try:
        yield
    finally:
        if torch is not None and before is not None and torch.get_num_threads() != before:
            torch.set_num_threads(before)


@contextmanager
def random_state_kept() -> Iterator[None]:
    """Python's, numpy's and torch's (CPU) random generators as they were, after what runs
    inside draws from them or seeds them: seeded, a stage left a caller's generators at the
    run's seed, its "random" shuffles the same in every session after it; a Dropout in
    training mode, run once to check a model, moved every later draw of a training."""
    import random
    import sys

    state, np_state = random.getstate(), np.random.get_state()
    torch = sys.modules.get("torch")  # never imported here: an ONNX-only caller has none
    torch_state = torch.random.get_rng_state() if torch is not None else None
    try:
        yield
    finally:
        random.setstate(state)
        np.random.set_state(np_state)
        if torch is not None and torch_state is not None:
            torch.random.set_rng_state(torch_state)


# What Lightning's seed_everything and a deterministic Trainer set for the rest of a process
_STAGE_ENVIRONMENT = ("CUBLAS_WORKSPACE_CONFIG", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@contextmanager
def caller_state_kept() -> Iterator[None]:
    """What a stage called from Python (`fit`, `export`, `quantize`, `report`) leaves as the
    caller had it: the random generators (`random_state_kept`), torch's thread count
    (`torch_threads_kept`), its grad and deterministic-algorithm modes (Lightning turns grad
    on, and `trainer.deterministic` deterministic algorithms and CUBLAS_WORKSPACE_CONFIG, for
    the rest of a notebook), and the PL_GLOBAL_SEED and PL_SEED_WORKERS that seed_everything
    leaves for a caller's own Trainer to read."""
    import sys

    torch = sys.modules.get("torch")
    modes = (
        (
            torch.is_grad_enabled(),
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        if torch is not None
        else None
    )
    env = {name: os.environ.get(name) for name in _STAGE_ENVIRONMENT}
    try:
        with torch_threads_kept(), random_state_kept():
            yield
    finally:
        if torch is not None and modes is not None:
            grad, deterministic, warn_only = modes
            torch.set_grad_enabled(grad)
            # only where the stage changed it: the call imports torch._inductor, which a stop
            # during dynamo's import of sympy left unimportable
            if (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ) != (deterministic, warn_only):
                torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity: `taskset`, a cpuset), every CPU where the
    OS has no affinity call (not Linux)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


@cache
def physical_cores() -> int:
    """Cores this process may use, counting SMT siblings once (the right ORT/torch thread
    count), and no more than its cgroup's CPU quota (`cgroup_cpu_limit`) allows."""
    allowed = allowed_cpus()
    siblings: set[tuple[str, str]] = set()
    try:
        for cpu in allowed:
            topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
            siblings.add(
                ((topo / "physical_package_id").read_text(), (topo / "core_id").read_text())
            )
        cores = len(siblings)
    except OSError:
        cores = len(allowed)
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, math.ceil(limit))
    return max(cores, 1)


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(
    root: Path = CGROUP_ROOT, membership: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPUs this process's cgroup may use (its CFS quota over its period: 1.5 for
    `docker run --cpus 1.5` or a Kubernetes limit of 1500m), the smallest along its cgroup's
    path; None when there is none. A quota is no cpuset: the kernel lets the process run on
    every core and throttles it, so threads sized to the host's cores (ONNX Runtime's default)
    spend the quota in a fraction of each period and then wait. cgroup v2 (`cpu.max`) or v1
    (`cpu.cfs_quota_us` / `cpu.cfs_period_us`); inside a container its own cgroup is the root."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        fields = line.split(":", 2)  # hierarchy-ID:controllers:path
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        files: tuple[str, ...]
        base: Path | None
        if controllers == "":  # cgroup v2 (unified): "0::/path"
            base, files = root, ("cpu.max",)
        elif "cpu" in controllers.split(","):  # v1: "4:cpu,cpuacct:/path"
            base = next((root / n for n in ("cpu", "cpu,cpuacct") if (root / n).is_dir()), None)
            files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        if base is None:
            continue
        folder = base / path.lstrip("/")
        # a container sees its own cgroup at the root, under a path that names the host's
        folders = [folder, *folder.parents] if folder.is_dir() else [base]
        for d in folders:
            limits.append(_quota(d, files))
            if d == base:
                break
    quotas = [limit for limit in limits if limit is not None]
    return min(quotas) if quotas else None


def _quota(folder: Path, files: tuple[str, ...]) -> float | None:
    try:
        if len(files) == 1:  # "max 100000" or "150000 100000"
            quota, period = (folder / files[0]).read_text().split()[:2]
        else:  # "-1" for none
            quota, period = ((folder / f).read_text().strip() for f in files)
        if quota in ("max", "-1"):
            return None
        return int(quota) / int(period) if int(period) > 0 and int(quota) > 0 else None
    except (OSError, ValueError):
        return None


@cache
def glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc, whose allocator `mallopt` tunes and
    `malloc_trim` empties; None elsewhere (musl has neither; macOS, Windows)."""
    try:
        libc = ctypes.CDLL(None)  # the symbols the process has loaded: libc's
        libc.mallopt, libc.malloc_trim  # noqa: B018 (AttributeError off glibc)
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def trim_heap() -> None:
    """Hand the free memory glibc's heap keeps back to the OS (`malloc_trim(0)`), as after a
    burst of requests or a report's timings; no-op off glibc."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


def bucket(rows: int) -> int:
    """The batch size a padding predictor (`Predictor.pads`) runs `rows` rows at: the power of
    two at or above it."""
    return 1 << (rows - 1).bit_length()


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return np.asarray(e / e.sum(axis=1, keepdims=True))


def _closed(name: str, x: np.ndarray) -> np.ndarray:
    raise RuntimeError(f"{name} was closed: load the model again to predict")


class Predictor(ABC):
    """Logits for a batch of images. Subclasses set `kind`, `path`, `labels`, `input_spec`."""

    kind: str
    path: Path
    labels: list[str]
    input_spec: dict[str, Any]
    device: str = "cpu"
    lanes: int = 1  # sessions a long batch is split across (`OrtPredictor`)
    split_rows: int = 0  # the shortest batch that is split; 0: none is
    # Pad each batch with zero images to a power of two of rows (`bucket`), the padding's
    # logits dropped. On a GPU, cuDNN and cuBLAS pick their kernels for each new input shape:
    # a TorchScript ResNet-18 on an H200 took 17-24 ms at the first batch of each size against
    # ~1 ms after, and a server's batches come in every size up to --max-batch-rows. Padded,
    # there are few enough sizes for the warm-up to run them all, for a little more compute.
    pads: bool = False

    @property
    def chw(self) -> tuple[int, int, int]:
        c, h, w = self.input_spec["shape"][1:]
        return int(c), int(h), int(w)

    def splits(self, rows: int) -> bool:
        """Whether a batch of `rows` runs as one slice per lane (`OrtPredictor`), which the
        report says of each batch it measures."""
        return self.lanes > 1 and rows >= self.split_rows

    def check(self, x: np.ndarray) -> np.ndarray:
        """Validate and convert to contiguous uint8 NCHW; float pixels (0..255) are rounded,
        and refused when they look scaled to 0..1."""
        if not isinstance(x, np.ndarray):
            raise InputError(f"expected a numpy array, got {type(x).__name__}")
        given = list(x.shape)  # as sent: a single image gains its batch axis below
        if x.ndim == 3:
            x = x[None]
        if x.ndim != 4 or tuple(x.shape[1:]) != self.chw:
            c, h, w = self.chw
            nhwc = x.ndim == 4 and tuple(x.shape[1:]) == (h, w, c)
            # [N, H, W] grey images, as MNIST-style arrays come, were said to be [1, N, H, W]
            no_channel = c == 1 and len(given) == 3 and tuple(given[1:]) == (h, w)
            raise InputError(
                f"expected shape [N, {', '.join(map(str, self.chw))}], got {given}"
                + (" (this looks like NHWC: transpose to NCHW)" if nhwc else "")
                + (" (images without a channel axis: send x[:, None])" if no_channel else "")
            )
        if x.shape[0] == 0:
            raise InputError("empty batch: send at least one image")
        if x.dtype != np.uint8:
            if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
                raise InputError(
                    f"expected uint8 pixels (or float/int 0..255), got dtype {x.dtype}"
                )
            if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
                raise InputError(
                    "input contains NaN or infinity: pixels must be finite values in 0..255"
                )
            low, high = x.min(), x.max()
            if low < 0 or high > 255:
                raise InputError(f"pixel values must be in 0..255, got {low}..{high}")
            if np.issubdtype(x.dtype, np.floating):
                if 0 < high <= 1:  # rounded, 0..1 becomes a black image with confident answers
                    raise InputError(
                        f"pixel values look scaled to 0..1 (largest {high:g}); this model takes "
                        "0..255, and normalises inside: send the pixels times 255"
                    )
                x = np.rint(x).astype(np.uint8)
            else:
                x = x.astype(np.uint8)
        return np.ascontiguousarray(x)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """float32 logits `[N, classes]` for uint8 `[N, C, H, W]` (validated)."""
        return self.logits(self.check(x))

    def logits(self, x: np.ndarray) -> np.ndarray:
        """`_run`, and OutputError unless it gave one row of logits per image and one column
        per label: a model whose output rows follow anything but its batch (a sum over it, a
        width that depends on the pixels) had its answers cut to the rows asked for, or
        missing, under a 200. For input `check` has validated; what the server's batches run."""
        rows = len(x)
        if self.pads and (size := bucket(rows)) != rows:
            x = np.concatenate([x, np.zeros((size - rows, *x.shape[1:]), x.dtype)])
        y = self._run(x)
        if y.shape != (len(x), len(self.labels)):
            raise OutputError(
                f"{self.path} gave logits {list(y.shape)} for {len(x)} image"
                f"{'' if len(x) == 1 else 's'}, expected [{len(x)}, {len(self.labels)}] (one "
                f"row an image, one column a label): its output does not follow its batch or "
                f"its labels; fix the model, or its lightship.labels metadata"
            )
        return y if len(x) == rows else y[:rows]

    @abstractmethod
    def _run(self, x: np.ndarray) -> np.ndarray:
        """Logits for already validated uint8 NCHW input (the hot path, no checks)."""

    def close(self) -> None:
        """Let go of the model now: its sessions or module, its threads, its GPU memory; not
        when the garbage collector gets to it. `predict` raises RuntimeError after this.
        `with load_predictor(path) as model:` closes it on the way out. Closing twice is fine."""
        # a function of its name, not a bound method: no cycle keeps the closed predictor
        self._run = partial(_closed, repr(self))  # type: ignore[method-assign]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path}, device={self.device})"
