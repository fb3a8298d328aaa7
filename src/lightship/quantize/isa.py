"""Which int8 scheme a CPU (or TensorRT) runs without saturating (README, "Which CPU it is for").

On x86 without VNNI, int8 convolutions multiply u8 activations by s8 weights with
`vpmaddubsw`, which adds pairs of products into int16 and saturates: full-range weights give
wrong answers. 7-bit weights (`reduce_range`) keep every pair sum in range. With AVX-512 VNNI,
AVX-VNNI or AMX the products are accumulated in int32 and full-range s8 weights are exact.
ARM64 with the dot-product extension accumulates in int32 too. TensorRT wants symmetric S8S8.

Pure standard library: the server imports this to re-check a model at start-up without torch.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

TARGETS = ("avx2", "vnni", "arm64", "tensorrt")


@dataclass(frozen=True)
class Scheme:
    """How weights and activations are quantized for a target."""

    target: str
    activation_type: str  # "QUInt8" or "QInt8"
    weight_type: str  # "QInt8" or "QUInt8"
    reduce_range: bool  # 7-bit weights
    symmetric_activations: bool
    why: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


SCHEMES = {
    "avx2": Scheme(
        "avx2",
        "QUInt8",
        "QInt8",
        reduce_range=True,
        symmetric_activations=False,
        why="no VNNI: u8 x s8 pairs sum in int16 and saturate; 7-bit weights keep them exact",
    ),
    "vnni": Scheme(
        "vnni",
        "QUInt8",
        "QInt8",
        reduce_range=False,
        symmetric_activations=False,
        why="VNNI/AMX accumulate u8 x s8 in int32: full-range weights are exact",
    ),
    "arm64": Scheme(
        "arm64",
        "QUInt8",
        "QInt8",
        reduce_range=False,
        symmetric_activations=False,
        why="ARM64 dot-product instructions accumulate in int32",
    ),
    "tensorrt": Scheme(
        "tensorrt",
        "QInt8",
        "QInt8",
        reduce_range=False,
        symmetric_activations=True,
        why="TensorRT runs symmetric S8S8 QDQ",
    ),
}


@dataclass(frozen=True)
class CpuInfo:
    model: str
    arch: str
    flags: frozenset[str]

    @property
    def target(self) -> str:
        """The scheme this CPU runs without saturation."""
        if self.arch in ("aarch64", "arm64"):
            return "arm64"
        if self.flags & {"avx512_vnni", "avx_vnni", "amx_int8"}:
            return "vnni"
        return "avx2"

    @property
    def int8_flags(self) -> list[str]:
        wanted = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8", "asimddp")
        return [f for f in wanted if f in self.flags]

    def describe(self) -> str:
        return f"{self.model} ({self.arch}; {' '.join(self.int8_flags) or 'no int8 flags'})"

    def as_dict(self, target: bool = False) -> dict[str, Any]:
        """The CPU as a manifest entry records it; `target`: with its int8 target, as
        report.json and `bench serve` do."""
        cpu = {"model": self.model, "arch": self.arch, "int8_flags": self.int8_flags}
        return {**cpu, "target": self.target} if target else cpu

    @classmethod
    def from_dict(cls, cpu: dict[str, Any]) -> CpuInfo:
        """`as_dict`'s record read back (its int8 flags, the ones a description names)."""
        return cls(cpu["model"], cpu["arch"], frozenset(cpu["int8_flags"]))


def describe(cpu: dict[str, Any]) -> str:
    """`Xeon (x86_64; avx2 avx512_vnni), this CPU's int8 target vnni`: a recorded CPU
    (`CpuInfo.as_dict`) as `CpuInfo.describe` says it, with the target it would quantize for
    where the record has one (not what the models measured were made for), for every line
    that prints an int8 figure."""
    target = f", this CPU's int8 target {cpu['target']}" if "target" in cpu else ""
    return CpuInfo.from_dict(cpu).describe() + target


@cache
def host_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    """This machine's CPU: the model /proc/cpuinfo names, else `platform.processor()` (which is
    `uname -p`: "x86_64" on Ubuntu, empty on Debian), and its flags."""
    model, flags = "", set[str]()
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model", "CPU part") and not model:
                model = value.strip()
            elif key in ("flags", "Features"):  # x86 / ARM
                flags.update(value.split())
    except OSError:
        pass
    model = model or platform.processor() or "unknown CPU"
    return CpuInfo(model, platform.machine().lower(), frozenset(flags))


def resolve_target(target: str) -> str:
    """`auto` becomes this machine's target; anything else must be a known target."""
    if target == "auto":
        return host_cpu().target
    if target not in TARGETS:
        raise ValueError(f"unknown target '{target}': choose auto or one of {', '.join(TARGETS)}")
    return target


def requantize_in_its_run(target: str) -> str:
    """The fix of `compatibility` for a model whose run is not known (a lone file)."""
    option = "" if target == "auto" else f" --target {target}"
    return f"re-quantize it in the run it came from: `lightship quantize --run RUN{option}`"


def compatibility(
    made_for: str,
    cpu: CpuInfo | None = None,
    redo: Callable[[str], str] = requantize_in_its_run,
) -> str | None:
    """None when a model quantized for `made_for` runs correctly on `cpu` (default: this host),
    else one sentence on what goes wrong and how to fix it: `redo(target)`, the command that
    quantizes it again for `target` (auto: this machine), naming its run (`RunDir.requantize`)."""
    here = (cpu or host_cpu()).target
    if made_for == "avx2" or made_for == here:
        return None  # 7-bit weights are exact everywhere
    if made_for == "tensorrt":
        return f"model was quantized for TensorRT (S8S8); for this CPU {redo('auto')}"
    if here == "avx2":
        return (
            f"model was quantized for {made_for} (full-range int8 weights) but this CPU has no "
            f"VNNI: int16 accumulation saturates and answers drift; {redo('avx2')}"
        )
    return None
