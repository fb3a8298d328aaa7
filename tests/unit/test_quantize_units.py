from __future__ import annotations

import pytest

from lightship.errors import QuantizeError
from lightship.quantize import isa
from lightship.quantize.core import parse_methods
from lightship.report.render import pareto_front


def cpu(arch: str, *flags: str) -> isa.CpuInfo:
    return isa.CpuInfo("test CPU", arch, frozenset(flags))


@pytest.mark.parametrize(
    ("info", "target"),
    [
        (cpu("x86_64", "avx2", "fma"), "avx2"),
        (cpu("x86_64", "avx2", "avx512f", "avx512_vnni"), "vnni"),
        (cpu("x86_64", "avx2", "avx_vnni"), "vnni"),
        (cpu("x86_64", "avx2", "amx_int8"), "vnni"),
        (cpu("aarch64", "asimd", "asimddp"), "arm64"),
    ],
)
def test_target_follows_the_cpu_flags(info: isa.CpuInfo, target: str) -> None:
    assert info.target == target


def test_avx2_scheme_uses_seven_bit_weights() -> None:
    assert isa.SCHEMES["avx2"].reduce_range is True
    assert isa.SCHEMES["vnni"].reduce_range is False
    assert isa.SCHEMES["tensorrt"].symmetric_activations is True
    assert isa.SCHEMES["tensorrt"].activation_type == "QInt8"


def test_compatibility_warns_about_saturation() -> None:
    avx2 = cpu("x86_64", "avx2")
    assert isa.compatibility("avx2", avx2) is None
    assert isa.compatibility("vnni", cpu("x86_64", "avx512_vnni")) is None
    msg = isa.compatibility("vnni", avx2)
    assert msg is not None and "saturates" in msg and "--target avx2" in msg
    assert "TensorRT" in (isa.compatibility("tensorrt", avx2) or "")


def test_unknown_target_and_method() -> None:
    with pytest.raises(ValueError, match="unknown target 'sse'"):
        isa.resolve_target("sse")
    with pytest.raises(QuantizeError, match=r"unknown quantization method \['fp4'\]"):
        parse_methods("static,fp4")
    assert parse_methods("qat, static,static") == ["qat", "static"]


def test_pareto_front() -> None:
    # (latency, accuracy): (2.0, 98.0) is slower and less accurate than (1.0, 99.0)
    points = [(1.0, 99.0), (2.0, 98.0), (0.5, 97.0), (3.0, 99.5)]
    assert pareto_front(points) == [2, 0, 3]
