"""Pin the serving images' Python packages.

Resolves `lightship[serve]` from scratch with `pip install --dry-run --ignore-installed --report`
and writes the pins the Dockerfiles install:

  deploy/requirements-serve.txt   CPU image (Dockerfile): exactly what `.[serve]` resolves to
  deploy/requirements-gpu.txt     GPU image (Dockerfile.gpu): the same pins, onnxruntime-gpu in
                                  place of onnxruntime (both own the `onnxruntime` package),
                                  and any dependency of its own, resolved held to them

    python deploy/lock.py                               # re-resolve and rewrite both files
    python deploy/lock.py --onnxruntime-gpu 1.31.1      # also move the GPU runtime's pin

onnxruntime-gpu is published later than onnxruntime and its wheels are CUDA 13 builds, so its
version is chosen by hand (kept from the current file unless given) and matched to the CUDA base
image in Dockerfile.gpu. Only the standard library is used: run it with any Python 3.11.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVE_LOCK = ROOT / "deploy" / "requirements-serve.txt"
GPU_LOCK = ROOT / "deploy" / "requirements-gpu.txt"
GPU_PYTHON = "3.12"  # Ubuntu 24.04's python3.12, the interpreter of Dockerfile.gpu
ARCHES = ("x86_64", "aarch64")  # linux/amd64 and linux/arm64
# glibc of the base images: Debian bookworm 2.36 (CPU), Ubuntu 24.04 2.39 (GPU), by pins file.
GLIBC_MINOR = {SERVE_LOCK.name: 36, GPU_LOCK.name: 39}
HEADER = """\
# {what}
# Written by deploy/lock.py from `pip install --dry-run --ignore-installed '.[serve]'`
# (resolved on Python {python}); do not edit by hand. Every pin has wheels for Python {target}
# on linux/amd64 and linux/arm64.
"""
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)\s*$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_report(*args: str, cwd: Path = ROOT) -> list[dict]:
    """What `pip install --dry-run --ignore-installed --report ARGS` would install."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed"]
        cmd += ["--quiet", "--report", str(report), *args]
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            tail = proc.stderr[-4000:]
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{tail}")
        return json.loads(report.read_text())["install"]


def resolve(*constraints: Path) -> dict[str, str]:
    """name -> version of everything `.[serve]` installs (lightship itself included)."""
    args: list[str] = []
    for path in constraints:
        args += ["--constraint", str(path)]
    items = pip_report(*args, ".[serve]")
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def read_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = PIN.match(line)
        if not match:
            raise ValueError(f"{path}: {line!r} is not a `name==version` pin")
        pins[canonical(match[1])] = match[2]
    return pins


def write_pins(path: Path, pins: dict[str, str], what: str, python: str, target: str) -> None:
    """`target`: the Python of the image (the GPU image's is not the one resolving)."""
    body = "".join(f"{name}=={pins[name]}\n" for name in sorted(pins))
    path.write_text(HEADER.format(what=what, python=python, target=target) + body)


def wheel_platforms(arch: str, glibc_minor: int) -> list[str]:
    """--platform tags a Linux with glibc 2.GLIBC_MINOR on ARCH accepts (pip lists no others)."""
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(17, glibc_minor + 1)]
    return [*tags, f"manylinux2014_{arch}", f"linux_{arch}"]


def check_wheels(path: Path, arch: str, python: str) -> list[str]:
    """Wheel file names pip picks for every pin in PATH on ARCH (raises when one has none)."""
    with tempfile.TemporaryDirectory() as target:
        args = ["--no-deps", "--only-binary=:all:", "--target", target, "--implementation", "cp"]
        args += ["--python-version", python]
        for tag in wheel_platforms(arch, GLIBC_MINOR[path.name]):
            args += ["--platform", tag]
        items = pip_report(*args, "--requirement", str(path))
    return [i["download_info"]["url"].rsplit("/", 1)[-1] for i in items]


def gpu_runtime_installs(arch: str, pins: dict[str, str]) -> dict[str, str]:
    """name -> version of what the GPU pins' onnxruntime-gpu installs in the GPU image on ARCH,
    held to their other pins. It takes onnxruntime's place, so `.[serve]` never resolved its
    dependencies: one it has of its own would be installed unpinned, or not be installable."""
    with tempfile.TemporaryDirectory() as tmp:
        held = Path(tmp) / "constraints.txt"
        held.write_text("".join(f"{n}=={v}\n" for n, v in pins.items() if n != "onnxruntime-gpu"))
        args = ["--only-binary=:all:", "--implementation", "cp", "--python-version", GPU_PYTHON]
        for tag in wheel_platforms(arch, GLIBC_MINOR[GPU_LOCK.name]):
            args += ["--platform", tag]
        items = pip_report(
            *args, "--constraint", str(held), f"onnxruntime-gpu=={pins['onnxruntime-gpu']}"
        )
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def gpu_runtime_installs_by_arch(pins: dict[str, str]) -> dict[str, dict[str, str]]:
    """`gpu_runtime_installs` on every arch of ARCHES (resolved at once), by arch."""
    with ThreadPoolExecutor(len(ARCHES)) as pool:
        installs = pool.map(lambda arch: gpu_runtime_installs(arch, pins), ARCHES)
        return dict(zip(ARCHES, installs, strict=True))


def unpinned_for_gpu_runtime(
    path: Path = GPU_LOCK, installs: dict[str, dict[str, str]] | None = None
) -> list[str]:
    """What onnxruntime-gpu installs that PATH does not pin, as `name==version (arch)`
    (`installs`: `gpu_runtime_installs_by_arch` of its pins, resolved here unless given)."""
    pins = read_pins(path)
    return [
        f"{name}=={version} ({arch})"
        for arch, installed in (installs or gpu_runtime_installs_by_arch(pins)).items()
        for name, version in installed.items()
        if pins.get(name) != version
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--onnxruntime-gpu", help="version of onnxruntime-gpu for the GPU image")
    args = parser.parse_args()
    ort_gpu = args.onnxruntime_gpu or read_pins(GPU_LOCK).get("onnxruntime-gpu")
    if not ort_gpu:
        parser.error(f"{GPU_LOCK} has no onnxruntime-gpu pin: pass --onnxruntime-gpu VERSION")
    pins = resolve()
    pins.pop("lightship")
    for forbidden in ("torch", "pytorch-lightning", "lightning"):
        if forbidden in pins:
            raise SystemExit(f"`.[serve]` pulls {forbidden}: the serving image must not")
    python = ".".join(map(str, sys.version_info[:2]))
    with tempfile.TemporaryDirectory(dir=SERVE_LOCK.parent, prefix=".lock-") as tmp:
        # Both files are written here and checked, then put in place together: a failure on
        # the way (a resolution, a missing wheel, Ctrl-C) leaves the pins as they were.
        serve_lock, gpu_lock = Path(tmp) / SERVE_LOCK.name, Path(tmp) / GPU_LOCK.name
        write_pins(serve_lock, pins, "Pins of the CPU serving image (Dockerfile).", python, python)
        gpu = {name: version for name, version in pins.items() if name != "onnxruntime"}
        gpu["onnxruntime-gpu"] = ort_gpu
        # and onnxruntime-gpu's own dependencies, which `.[serve]` (onnxruntime's) never resolved
        for arch, installed in gpu_runtime_installs_by_arch(gpu).items():
            for name, version in installed.items():
                if gpu.setdefault(name, version) != version:  # held to `.[serve]`: another arch's
                    raise SystemExit(
                        f"onnxruntime-gpu {ort_gpu} installs {name} {version} on {arch} but "
                        f"{gpu[name]} on another arch: pin {name} in `.[serve]`, or choose "
                        "another --onnxruntime-gpu"
                    )
        what = "Pins of the GPU serving image (Dockerfile.gpu)."
        write_pins(gpu_lock, gpu, what, python, GPU_PYTHON)
        for path, py in ((serve_lock, python), (gpu_lock, GPU_PYTHON)):
            for arch in ARCHES:
                check_wheels(path, arch, py)
        serve_lock.replace(SERVE_LOCK)
        gpu_lock.replace(GPU_LOCK)
    print(f"wrote {SERVE_LOCK.name} and {GPU_LOCK.name}: {len(pins)} pins, wheels for {ARCHES}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
