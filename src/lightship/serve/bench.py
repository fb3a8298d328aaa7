"""`lightship bench serve`: requests/s and latency of a real server under wrk, beside ceilings.

For each model (digits, a ResNet-18) the server runs as a separate process (`lightship serve`),
and wrk drives one-image V2 infer requests, JSON and binary, at each concurrency. Measured in the
same run, on the same machine, beside it (`lightship.serve.ceiling`):

- **in-process ceiling**: the served Predictor called directly, rows/s at its best batch size —
  what the model can do with no HTTP at all;
- **same-path no-model ceiling**: `lightship serve` itself with a batcher that answers each
  request at once with zero logits (no queue, no inference thread) — the server's own request
  path, parsing, checks and answer encoding included: what batching and the model cost on top
  of it is the gap;
- **FastAPI no-model endpoint**: a FastAPI route that parses the same request and answers a
  response of the same shape without a model, the endpoint the serving issue's target names.
  The server answers its tensor routes in its own HTTP protocol, without ASGI or FastAPI,
  which costs its event loop less per request than this route: the server can beat it, so it
  is no ceiling of the server's path, only the issue's yardstick.

Throughput counts 2xx answers only: wrk's own count includes error answers (a 429 from a full
queue is quick), and drops requests that failed on the socket or timed out. Every cell that had
a failure is marked and warned about.

wrk and the server share the machine's cores: on a 2-core box the figures are a floor. Where
the time goes is measured too (Linux): the CPU each endpoint's event loop spends per request,
the cores its other threads (the model's) use, and how busy the whole machine was.

The table ends with the serving issue's five performance targets, each judged met or missed on
the figures the run measured (`goals`, also in the JSON).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightship.config import parse_choices
from lightship.errors import ConfigError, LightshipError, RunError
from lightship.quantize.isa import describe
from lightship.report.measure import machine_cpu_s, time_calls
from lightship.runs import RunDir, atomic_write_text, check_writable
from lightship.runtime import DEVICE, Predictor
from lightship.runtime.base import allowed_cpus, physical_cores
from lightship.serve.model import VARIANTS

log = logging.getLogger(__name__)

WRK_HINT = "install wrk: `sudo apt-get install -y wrk` (Debian/Ubuntu) or `brew install wrk`"
# Prints one JSON line at the end of a wrk run: requests, errors, latency percentiles (µs).
WRK_LUA = """
local f = assert(io.open(os.getenv("BENCH_BODY"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/octet-stream"
local hlen = os.getenv("BENCH_HEADER_LENGTH")
if hlen and hlen ~= "" then wrk.headers["Inference-Header-Content-Length"] = hlen end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH {"requests": %d, "duration_us": %d, "non2xx": %d, "socket_errors": %d, '
    .. '"p50_us": %d, "p90_us": %d, "p99_us": %d}\\n',
    summary.requests, summary.duration, e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99)))
end
"""


SERVER = "server"
SAME_PATH = "same-path no-model"
FASTAPI = "FastAPI no-model"
ENDPOINTS = (SERVER, SAME_PATH, FASTAPI)
# The ratio of the server to each no-model endpoint, by its key in the results
CEILINGS = {"server_vs_same_path": SAME_PATH, "server_vs_fastapi": FASTAPI}
PROTOCOLS = ("json", "binary")


@dataclass
class LoadResult:
    model: str
    endpoint: str  # one of ENDPOINTS
    protocol: str  # "json" or "binary"
    concurrency: int
    round: int
    served: int  # 2xx answers
    req_per_s: float  # 2xx answers per second
    p50_ms: float  # latencies are of every answer, failed ones included (wrk's)
    p90_ms: float
    p99_ms: float
    non2xx: int  # error answers (wrk counts status >= 400)
    socket_errors: int  # connect, read, write errors and timeouts: no answer at all
    mean_batch_rows: float | None = None
    loop_us_per_request: float | None = None  # the endpoint's event loop (main thread) CPU
    other_threads_cores: float | None = None  # its other threads: inference, ORT's pool
    machine_busy: float | None = None  # share of all cores busy (wrk, server, anything else)
    # The server's cells only: the in-process ceiling measured just before the cell
    in_process_rows_per_s: float | None = None

    @property
    def failed(self) -> int:
        return self.non2xx + self.socket_errors


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds a process's main thread and its other threads have used, and the machine's
    busy and total CPU seconds (`machine_cpu_s`), at one moment."""

    main_s: float
    others_s: float
    busy: float
    total: float


def cpu_sample(pid: int) -> CpuSample | None:
    """From Linux's /proc; None where there is none (the benchmark then leaves it out)."""

    def ticks(stat_file: str) -> int:  # utime + stime; the name in (...) may hold spaces
        stat = Path(stat_file).read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return int(fields[11]) + int(fields[12])

    try:
        tick = os.sysconf("SC_CLK_TCK")  # no os.sysconf on Windows
        # The process's figure includes threads that have ended: the others are the rest.
        process, main = ticks(f"/proc/{pid}/stat"), ticks(f"/proc/{pid}/task/{pid}/stat")
    except (AttributeError, OSError, ValueError, IndexError):
        return None
    machine = machine_cpu_s()
    return None if machine is None else CpuSample(main / tick, (process - main) / tick, *machine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lightship(*args: str) -> None:
    cmd = [sys.executable, "-m", "lightship", *args]
    print("+ lightship " + " ".join(args), file=sys.stderr, flush=True)
    if subprocess.run(cmd, check=False).returncode != 0:
        raise RunError(f"`lightship {' '.join(args)}` failed (see above)")


def ensure_run(run: Path, config: str, *overrides: str, variant: str = "auto") -> RunDir:
    """A run directory that has what the benchmark serves, made here where it lacks it: for
    `auto`, the report's recommendation (the ONNX export, static int8 and the report); for a
    named variant, just the stages that make it."""
    if not (run / "best.ckpt").is_file():
        sets = [a for o in overrides for a in ("--set", o)]
        _lightship("train", "--run", str(run), "--config", config, *sets)
    rd = RunDir(run)
    artifacts = rd.manifest()["artifacts"]  # as found: what the steps below add is not read
    if variant in ("checkpoint", *artifacts) and variant != "auto":
        return rd
    if "onnx-fp32" not in artifacts and (variant == "auto" or variant.startswith("onnx-")):
        _lightship("export", "--run", str(run), "--formats", "onnx")
    if variant == "auto":
        if not (rd.report_dir / "report.json").is_file():
            if "onnx-int8-static" not in artifacts:
                _lightship("quantize", "--run", str(run), "--methods", "static")
            _lightship("report", "--run", str(run))
    elif variant.startswith("onnx-int8-"):
        _lightship("quantize", "--run", str(run), "--methods", variant.removeprefix("onnx-int8-"))
    elif variant != "onnx-fp32":
        _lightship("export", "--run", str(run), "--formats", variant)
    return rd


def bench_image(chw: tuple[int, int, int]) -> np.ndarray:
    """The one image every benchmark request carries: `[1, C, H, W]` uint8, fixed seed."""
    return np.random.default_rng(0).integers(0, 256, (1, *chw), dtype=np.uint8)


def request_bodies(chw: tuple[int, int, int], input_name: str) -> dict[str, tuple[bytes, int]]:
    """One-image V2 infer bodies: JSON, and binary (JSON header + raw pixels)."""
    x = bench_image(chw)
    shape = list(x.shape)
    json_body = json.dumps(
        {
            "inputs": [
                {
                    "name": input_name,
                    "shape": shape,
                    "datatype": "UINT8",
                    "data": x.ravel().tolist(),
                }
            ],
            "outputs": [{"name": "logits"}],
        }
    ).encode()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": input_name,
                    "shape": shape,
                    "datatype": "UINT8",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
        }
    ).encode()
    return {"json": (json_body, 0), "binary": (header + x.tobytes(), len(header))}


class _Process:
    """A server process on a free port, ready when `ready_path` answers 200; SIGTERM to stop."""

    def __init__(self, cmd: list[str], log: Path, ready_path: str = "/v2/health/ready") -> None:
        import httpx

        # One client for every call: httpx builds an SSL context for each client it makes (55
        # ms of CPU on the AVX2 EPYC, for http:// too), so a readiness poll every 20 ms with
        # `httpx.get` kept most of a core busy beside the server starting on the other.
        self.client = httpx.Client()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.spawned = time.monotonic()
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [*cmd, "--port", str(self.port)], stdout=out, stderr=subprocess.STDOUT
            )
        try:
            self._wait(ready_path)
        except BaseException:  # a Ctrl-C or SIGTERM while it starts too: not left serving
            self.stop()
            raise

    def _wait(self, path: str, timeout: float = 120) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # the log's folder goes with the bench: its last lines, not its path
                raise RunError(f"server exited {self.proc.returncode}: {self._log_tail()}")
            try:
                if self.client.get(self.url + path, timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RunError(f"server not ready after {timeout:.0f} s: {self._log_tail()}")

    def _log_tail(self, lines: int = 3) -> str:
        """The last lines the server wrote, one line, for an error."""
        try:
            said = [line.strip() for line in self.log.read_text(errors="replace").splitlines()]
        except OSError:
            return "it wrote no log"
        said = [line for line in said if line][-lines:]
        return " / ".join(said)[-600:] if said else "it wrote nothing"

    def get(self, path: str) -> str:
        return self.client.get(self.url + path, timeout=5).text

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _wrk(
    url: str, body: Path, header_length: int, concurrency: int, duration: float
) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_LUA)
    env = {**os.environ, "BENCH_BODY": str(body), "BENCH_HEADER_LENGTH": str(header_length or "")}
    threads = max(1, min(concurrency, len(allowed_cpus())))  # those it may run on (taskset)
    cmd = ["wrk", "-t", str(threads), "-c", str(concurrency), "-d", f"{duration:g}s"]
    cmd += ["--timeout", "10s", "-s", script.name, url]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    finally:
        os.unlink(script.name)
    match = re.search(r"^BENCH (\{.*\})$", out.stdout, re.M)
    if out.returncode != 0 or match is None:
        raise LightshipError(f"wrk failed ({out.returncode}): {out.stderr.strip() or out.stdout}")
    return dict(json.loads(match.group(1)))


# How far the server's logits may be from the in-process ones and still be the same answer. On a
# GPU two processes run the same model differently: torch lets cuDNN convolve in TF32 (10-bit
# mantissa) and each process picks its own algorithms. An H200 gave a TorchScript ResNet-18
# answer that missed 1e-4, same model and image, in two runs out of three.
FIRST_ANSWER_ATOL = {"cpu": 1e-4, "cuda": 1e-2}


def _first_answer(
    proc: _Process, url: str, body: bytes, expected: np.ndarray, atol: float = 1e-4
) -> dict[str, Any]:
    """Seconds from spawning the server to its first answer, whether the answer is right (the
    same label, logits within `atol`) and how far its logits are from `expected`. Asked with
    the client that polled: a new one's 55 ms of set-up counted in the time."""
    response = proc.client.post(url, content=body, timeout=30)
    seconds = time.monotonic() - proc.spawned
    result: dict[str, Any] = {"seconds": round(seconds, 3), "status": response.status_code}
    result["correct"] = False
    if response.status_code == 200:
        out = {o["name"]: o for o in response.json()["outputs"]}
        logits = np.asarray(out["logits"]["data"], np.float32).reshape(expected.shape)
        result["max_abs_logit_diff"] = float(np.abs(logits - expected).max())
        result["correct"] = bool(
            logits.argmax(-1) == expected.argmax(-1) and np.allclose(logits, expected, atol=atol)
        )
    return result


def _batch_rows(metrics_text: str) -> tuple[float, float]:
    """(sum, count) of the server's batch-size histogram."""
    values = {}
    for name in ("lightship_batch_rows_sum", "lightship_batch_rows_count"):
        m = re.search(rf"^{name} (\S+)$", metrics_text, re.M)
        values[name] = float(m.group(1)) if m else 0.0
    return values["lightship_batch_rows_sum"], values["lightship_batch_rows_count"]


def _rows_per_s(
    predictor: Predictor, x: np.ndarray, seconds: float, instances: int = 1, min_calls: int = 5
) -> float:
    """Rows/s of the predictor's hot path (`logits`, what the server's batcher calls: on a GPU
    with its padding), from `instances` threads calling it at once as the server's instances
    do."""
    calls = [0] * instances

    def caller(i: int) -> None:
        calls[i] = len(time_calls(lambda: predictor.logits(x), seconds, min_calls))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(instances)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(x) * sum(calls) / (time.perf_counter() - start)


def in_process_sweep(
    predictor: Predictor,
    max_batch_rows: int,
    seconds: float = 1.0,
    instances: int = 1,
    rounds: int = 3,
) -> dict[int, float]:
    """Rows/s of the Predictor called directly at each batch size the server may run (up to
    its `max_batch_rows`): the best is the in-process ceiling. `seconds` a size, in `rounds`
    that take the sizes in turn, and the median: timed one after another, a slow patch of the
    machine lowered the sizes it fell on (ResNet-18 on the AVX2 EPYC: 151 rows/s at batch 8
    and 247 at 32, then 270-285 at every size from 8 to 64 swept again)."""
    rng = np.random.default_rng(0)
    sizes = sorted({b for b in (1, 8, 16, 32, 64, 128, 256) if b < max_batch_rows})
    batches = {
        batch: rng.integers(0, 256, (batch, *predictor.chw), dtype=np.uint8)
        for batch in [*sizes, max_batch_rows]
    }
    for x in batches.values():
        for _ in range(3):
            predictor.logits(x)
    measured: dict[int, list[float]] = {batch: [] for batch in batches}
    for _ in range(rounds):
        for batch, x in batches.items():
            rate = _rows_per_s(predictor, x, seconds / rounds, instances, min_calls=2)
            measured[batch].append(rate)
    return {batch: _median(rates) for batch, rates in measured.items()}


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else math.nan


def _median_of(runs: list[LoadResult], key: str, digits: int = 3) -> float | None:
    """The median of a per-run figure over the runs that have it, or None."""
    values = [v for r in runs if (v := getattr(r, key)) is not None]
    return round(_median(values), digits) if values else None


def summarise(
    cells: list[LoadResult], in_process: list[float], concurrency: list[int]
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """Median of each (endpoint, protocol, concurrency) cell over the rounds, the ratios, and
    each ratio's range (least and greatest of its rounds, keyed as the ratios are).

    A ratio is taken within each round (the server beside the no-model endpoints, the
    in-process ceiling and the other protocol measured minutes apart at most), then the median
    over rounds: on a noisy machine that is steadier than a ratio of medians.
    """
    by_key: dict[tuple[str, str, int], list[LoadResult]] = {}
    for cell in cells:
        by_key.setdefault((cell.endpoint, cell.protocol, cell.concurrency), []).append(cell)
    load = []
    for (endpoint, protocol, c), runs in by_key.items():
        load.append(
            {
                "model": runs[0].model,
                "endpoint": endpoint,
                "protocol": protocol,
                "concurrency": c,
                "rounds": len(runs),
                "served": sum(r.served for r in runs),
                "failed": sum(r.failed for r in runs),
                "req_per_s": round(_median([r.req_per_s for r in runs]), 1),
                "req_per_s_by_round": [r.req_per_s for r in runs],
                "p50_ms": round(_median([r.p50_ms for r in runs]), 3),
                "p90_ms": round(_median([r.p90_ms for r in runs]), 3),
                "p99_ms": round(_median([r.p99_ms for r in runs]), 3),
                "p99_ms_max": max(r.p99_ms for r in runs),
                "non2xx": sum(r.non2xx for r in runs),
                "socket_errors": sum(r.socket_errors for r in runs),
                "mean_batch_rows": _median_of(runs, "mean_batch_rows", 2),
                **{
                    key: _median_of(runs, key)
                    for key in (
                        "loop_us_per_request",
                        "other_threads_cores",
                        "machine_busy",
                        "in_process_rows_per_s",
                    )
                },
            }
        )

    rounds = sorted({cell.round for cell in cells})
    series: dict[Any, list[float]] = {"in-process": [in_process[r] for r in rounds]}
    for key, runs in by_key.items():
        per_round = {x.round: x.req_per_s for x in runs}
        series[key] = [per_round.get(r, math.nan) for r in rounds]
        if key[0] == SERVER:  # the ceiling measured beside the cell, else beside its round
            beside = {x.round: x.in_process_rows_per_s for x in runs}
            series[("in-process", *key[1:])] = [beside.get(r) or in_process[r] for r in rounds]

    kinds = ("server_vs_in_process", *CEILINGS, "binary_vs_json")
    ratios: dict[str, dict[str, dict[str, float]]] = {k: {} for k in kinds}
    ranges: dict[str, dict[str, dict[str, list[float]]]] = {k: {} for k in kinds}

    def ratio(kind: str, group: str, cell: str, num: Any, den: Any) -> None:
        pairs = zip(series.get(num, []), series.get(den, []), strict=False)
        values = [n / d for n, d in pairs if d > 0 and math.isfinite(n / d)]
        ratios[kind].setdefault(group, {})[cell] = round(_median(values), 3)
        spread = [round(min(values), 3), round(max(values), 3)] if values else []
        ranges[kind].setdefault(group, {})[cell] = spread

    for c in concurrency:
        for protocol in PROTOCOLS:
            server = (SERVER, protocol, c)
            ratio("server_vs_in_process", protocol, str(c), server, ("in-process", protocol, c))
            for kind, ceiling in CEILINGS.items():
                ratio(kind, protocol, str(c), server, (ceiling, protocol, c))
        for endpoint in ENDPOINTS:
            ratio(
                "binary_vs_json", endpoint, str(c), (endpoint, "binary", c), (endpoint, "json", c)
            )
    # A no-model endpoint's ceiling is its best rate at any concurrency, and the server's best
    # may come at another (batching grows with connections): peak against peak, per round.
    for protocol in PROTOCOLS:
        for endpoint in ENDPOINTS:
            cells_of = [
                series[key] for c in concurrency if (key := (endpoint, protocol, c)) in series
            ]
            series[(endpoint, protocol, "peak")] = [
                max((v[i] for v in cells_of if math.isfinite(v[i])), default=math.nan)
                for i in range(len(rounds))
            ]
        for kind, ceiling in CEILINGS.items():
            ratio(kind, protocol, "peak", (SERVER, protocol, "peak"), (ceiling, protocol, "peak"))
    return load, ratios, ranges


def schedule(rounds: int, concurrency: list[int]) -> list[list[tuple[str, str, int]]]:
    """The cells of each round in the order they are measured: (endpoint, protocol, connections).

    Every cell of every endpoint in each round, so that a slow patch of the machine touches the
    server and its ceilings alike. Which protocol goes first alternates between rounds, and the
    endpoints take turns at going first: measured always in the same order, one of them would
    always follow the other's load (a warmer cache, a hotter CPU) and the ratio between them
    would say so.
    """
    order = []
    for r in range(rounds):
        turn = r % len(ENDPOINTS)
        endpoint_order = ENDPOINTS[turn:] + ENDPOINTS[:turn]
        protocols = PROTOCOLS if r % 2 == 0 else PROTOCOLS[::-1]
        order.append([(e, p, c) for p in protocols for c in concurrency for e in endpoint_order])
    return order


def bench_model(
    label: str,
    run: RunDir,
    variant: str,
    concurrency: list[int],
    duration: float,
    rounds: int,
    work: Path,
    threads: int | None,
    instances: int = 1,
    device: str = "cpu",
) -> dict[str, Any]:
    """One model: the server and both no-model endpoints up side by side, every cell measured
    once per round."""
    from rich.console import Console

    from lightship.serve.app import LARGE_BODY_BYTES
    from lightship.serve.command import _settings as _serve_settings
    from lightship.serve.model import choose

    console = Console(stderr=True, soft_wrap=True)
    # as `lightship serve`, which it starts, reads them: an invalid LIGHTSHIP_* variable is
    # the same one-line error (it was a pydantic traceback)
    settings = _serve_settings(
        run=run.root, variant=variant, threads=threads, instances=instances, device=device
    )
    served = choose(settings)
    spec = (served.entry or {})["input_spec"]
    c, h, w = (int(d) for d in spec["shape"][1:])
    chw = (c, h, w)
    labels = (served.entry or {}).get("labels") or []
    console.print(
        f"[bold]{label}[/]: {served.variant} ({served.path}) on {device}, input {list(chw)}"
    )
    threads_per_instance = settings.model_threads(served.path)
    predictor = served.load(device=device, threads=threads_per_instance)
    expected = predictor.predict(bench_image(chw))[0]
    sweep = in_process_sweep(predictor, settings.max_batch_rows, instances=instances)
    best = max(sweep, key=lambda b: sweep[b])
    best_x = np.resize(bench_image(chw), (best, *chw))
    console.print(f"  in-process: best batch {best} ({sweep[best]:.0f} rows/s)")
    bodies = {}
    body_bytes = {}
    for protocol, (body, hlen) in request_bodies(chw, spec.get("name", "input")).items():
        path = work / f"{label}-{protocol}.body"
        path.write_bytes(body)
        bodies[protocol] = (path, hlen)
        body_bytes[protocol] = len(body)

    serve_args = ["serve", "--run", str(run.root), "--variant", served.variant]
    serve_args += ["--model-name", label, "--threads", str(threads_per_instance)]
    serve_args += ["--instances", str(instances), "--device", device]
    commands = {
        SERVER: [sys.executable, "-m", "lightship", *serve_args],
        SAME_PATH: [sys.executable, "-m", "lightship.serve.ceiling", *serve_args],
        FASTAPI: [
            sys.executable,
            "-m",
            "lightship.serve.ceiling",
            "--input-name",
            spec.get("name", "input"),
            "--classes",
            str(len(labels)),
        ],
    }
    procs: dict[str, _Process] = {}
    url: dict[str, str] = {}
    cells: list[LoadResult] = []
    in_process: list[float] = []
    order = schedule(rounds, concurrency)
    try:
        # All endpoints stay up for the whole model: an idle one costs nothing.
        for endpoint, cmd in commands.items():
            log_file = work / f"{label}-{endpoint.replace(' ', '-')}.log"
            procs[endpoint] = _Process(cmd, log_file)
            url[endpoint] = f"{procs[endpoint].url}/v2/models/{label}/infer"
            if endpoint == SERVER:
                startup = _first_answer(
                    procs[SERVER],
                    url[SERVER],
                    bodies["json"][0].read_bytes(),
                    expected,
                    FIRST_ANSWER_ATOL[device.partition(":")[0]],
                )
                console.print(
                    f"  first answer {startup['seconds']:.2f} s after start, "
                    f"{'correct' if startup['correct'] else 'WRONG'} (max |Δlogit| "
                    f"{startup.get('max_abs_logit_diff', float('nan')):.1e})"
                )
        for endpoint in procs:
            for body_path, hlen in bodies.values():
                _wrk(url[endpoint], body_path, hlen, 4, min(duration, 1.0))  # warm-up
        for r, cells_of_round in enumerate(order):
            in_process.append(_rows_per_s(predictor, best_x, 1.0, instances))
            console.print(f"  round {r + 1}/{rounds}: in-process {in_process[-1]:.0f} rows/s")
            for endpoint, protocol, conc in cells_of_round:
                body_path, hlen = bodies[protocol]
                beside = None
                if endpoint == SERVER:  # the ceiling just before: a machine's pace drifts
                    beside = round(_rows_per_s(predictor, best_x, 1.0, instances), 1)
                cell = _cell(
                    label,
                    endpoint,
                    protocol,
                    conc,
                    r,
                    procs[endpoint],
                    url[endpoint],
                    body_path,
                    hlen,
                    duration,
                )
                cell.in_process_rows_per_s = beside
                cells.append(cell)
                console.print("    " + _cell_line(cell))
    finally:
        for proc in procs.values():
            proc.stop()
    load, ratios, ranges = summarise(cells, in_process, concurrency)
    return {
        "model": label,
        "variant": served.variant,
        "device": device,
        "instances": instances,
        "threads_per_instance": threads_per_instance,
        "file": str(served.path),
        "input_shape": list(chw),
        "body_bytes": body_bytes,
        # Bodies this large are parsed off the event loop by the server and the same-path
        # endpoint (the same code), on it by the FastAPI one: its loop column is then no match.
        "bodies_parsed_off_loop": [p for p, n in body_bytes.items() if n >= LARGE_BODY_BYTES],
        "protocol_order_by_round": [
            list(dict.fromkeys(p for _, p, _ in cells_of_round)) for cells_of_round in order
        ],
        "in_process_ceiling": {
            "rows_per_s_by_batch": {str(b): round(v, 1) for b, v in sweep.items()},
            "best_batch": best,
            "rows_per_s_by_round": [round(v, 1) for v in in_process],
            "rows_per_s": round(_median(in_process), 1),
        },
        "startup": startup,
        "load": load,
        "ratios": ratios,
        "ratio_ranges": ranges,
    }


def _cell_line(cell: LoadResult) -> str:
    """One console line for a measured cell; its failures, when it had any, in red."""
    line = (
        f"{cell.endpoint:18} {cell.protocol:6} c={cell.concurrency:<3} {cell.req_per_s:8.0f} "
        f"req/s  p50 {cell.p50_ms:7.2f} ms  p99 {cell.p99_ms:7.2f} ms"
    )
    if cell.mean_batch_rows:
        line += f"  mean batch {cell.mean_batch_rows}"
    if cell.loop_us_per_request is not None:
        line += f"  event loop {cell.loop_us_per_request:.0f} µs/req"
    if cell.failed:
        line += (
            f"  [red]FAILED {cell.failed} ({cell.non2xx} error answers, "
            f"{cell.socket_errors} socket errors)[/]"
        )
    return line


def _cell(
    label: str,
    endpoint: str,
    protocol: str,
    concurrency: int,
    round_: int,
    proc: _Process,
    url: str,
    body: Path,
    header_length: int,
    duration: float,
) -> LoadResult:
    """One wrk run against one endpoint: its 2xx answers per second, the requests that failed
    apart (a warning when any did), the server's mean batch from its metrics, and the CPU the
    endpoint's threads and the machine used while wrk ran."""
    server = endpoint == SERVER
    before = _batch_rows(proc.get("/metrics")) if server else None
    cpu_before = cpu_sample(proc.proc.pid)
    r = _wrk(url, body, header_length, concurrency, duration)
    cpu_after = cpu_sample(proc.proc.pid)
    mean_rows = None
    if before is not None:
        after = _batch_rows(proc.get("/metrics"))
        batches = after[1] - before[1]
        mean_rows = round((after[0] - before[0]) / batches, 2) if batches else None
    # wrk's "requests" are the answers it read, error answers (status 400 or more) included;
    # the rest are 2xx here (nothing redirects)
    answered = r["requests"]
    served = answered - r["non2xx"]
    loop_us = others = busy = None
    seconds = r["duration_us"] / 1e6
    if cpu_before is not None and cpu_after is not None and answered and seconds > 0:
        loop_us = round(1e6 * (cpu_after.main_s - cpu_before.main_s) / answered, 1)
        others = round((cpu_after.others_s - cpu_before.others_s) / seconds, 3)
        total = cpu_after.total - cpu_before.total
        busy = round((cpu_after.busy - cpu_before.busy) / total, 3) if total else None
    if r["non2xx"] or r["socket_errors"]:
        log.warning(
            "%s, %s %s at %d connections, round %d: %d requests failed (%d error answers, "
            "%d socket errors or timeouts); its req/s counts 2xx answers only, its p50/p99 "
            "every answer (wrk times error answers too)",
            label,
            endpoint,
            protocol,
            concurrency,
            round_ + 1,
            r["non2xx"] + r["socket_errors"],
            r["non2xx"],
            r["socket_errors"],
        )
    return LoadResult(
        label,
        endpoint,
        protocol,
        concurrency,
        round_,
        served,
        round(served / seconds, 1) if seconds > 0 else 0.0,
        r["p50_us"] / 1000,
        r["p90_us"] / 1000,
        r["p99_us"] / 1000,
        r["non2xx"],
        r["socket_errors"],
        mean_rows,
        loop_us,
        others,
        busy,
    )


def _ratio(m: dict[str, Any], kind: str, group: str, cell: str) -> str:
    """`0.86 (0.81-0.90)`: a ratio's median and, over more than one round, its range; `-` for
    one that was not measured."""
    value = m["ratios"].get(kind, {}).get(group, {}).get(cell, math.nan)
    if not math.isfinite(value):
        return "-"
    text = f"{value:.2f}"
    spread = m.get("ratio_ranges", {}).get(kind, {}).get(group, {}).get(cell)
    if spread and spread[0] != spread[1]:
        text += f" ({spread[0]:.2f}–{spread[1]:.2f})"
    return text


def _finite(cells: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in cells.items() if isinstance(v, int | float) and math.isfinite(v)}


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The serving issue's five performance targets, judged on what this run measured: each
    with the value judged, its bound, whether it holds, and the figures behind it as the table
    prints them. A target whose cells the run left out (a model, a concurrency) is left out.

    Where the issue names no protocol or concurrency, the server's best is judged and every
    figure shown: ResNet-18 at 16 connections by its better protocol, binary / JSON for digits
    at its best concurrency; the FastAPI no-model endpoint's ceiling is its best rate at any
    concurrency, against the server's best (`peak`); p99 at 64 connections is the worst round
    of any model and protocol, and the first answer the slowest model's, which must be right.
    """
    models = {m["model"]: m for m in results["models"]}
    found: list[dict[str, Any]] = []

    def judge(
        goal: str,
        figures: str,
        value: float,
        at_least: float = -math.inf,
        at_most: float = math.inf,
        right: bool = True,
    ) -> None:
        lower = math.isfinite(at_least)
        bound = at_least if lower else at_most
        met = right and at_least <= value <= at_most
        found.append(
            {
                "goal": goal,
                "value": value,
                "bound": bound,
                "rule": ">=" if lower else "<=",
                "right": right,
                "met": met,
                "figures": figures,
            }
        )

    if (resnet := models.get("resnet18")) is not None:
        kind = "server_vs_in_process"
        at_16 = _finite({p: resnet["ratios"].get(kind, {}).get(p, {}).get("16") for p in PROTOCOLS})
        if at_16:
            judge(
                "ResNet-18 at 16 connections: req/s ≥ 0.90 of its in-process rows/s",
                ", ".join(f"{p} {_ratio(resnet, kind, p, '16')}" for p in at_16),
                max(at_16.values()),
                at_least=0.9,
            )
    worst = [
        (cell.get("p99_ms_max", cell["p99_ms"]), m["model"], cell["protocol"])
        for m in results["models"]
        for cell in m["load"]
        if cell["endpoint"] == SERVER and cell["concurrency"] == 64
    ]
    if worst:
        p99, model, protocol = max(worst)
        judge(
            "p99 at 64 connections ≤ 800 ms",
            f"{p99:.0f} ms at most ({model}, {protocol}; the worst round)",
            p99,
            at_most=800.0,
        )
    if (digits := models.get("digits")) is not None:
        kind = "server_vs_fastapi"
        peak = _finite({"peak": digits["ratios"].get(kind, {}).get("json", {}).get("peak")})
        if peak:
            judge(
                "digits over JSON: req/s ≥ 0.90 of the FastAPI no-model endpoint's",
                f"{_ratio(digits, kind, 'json', 'peak')}, best against best",
                peak["peak"],
                at_least=0.9,
            )
        by_c = _finite(digits["ratios"].get("binary_vs_json", {}).get(SERVER, {}))
        if by_c:
            judge(
                "digits: binary V2 req/s ≥ 1.3x JSON",
                ", ".join(f"c={c}: {_ratio(digits, 'binary_vs_json', SERVER, c)}" for c in by_c),
                max(by_c.values()),
                at_least=1.3,
            )
    starts = [(m["startup"], m["model"]) for m in results["models"] if m.get("startup")]
    if starts:
        slowest = max(start["seconds"] for start, _ in starts)
        wrong = [model for start, model in starts if not start["correct"]]
        judge(
            "first correct answer ≤ 2 s after the server process starts",
            ", ".join(f"{model} {start['seconds']:.2f} s" for start, model in starts)
            + (f" (a WRONG answer: {', '.join(wrong)})" if wrong else ""),
            slowest,
            at_most=2.0,
            right=not wrong,
        )
    return found


def _judged(value: float, bound: float) -> str:
    """`value` to three figures, or as many more as it takes not to read as `bound` where it
    is not: binary / JSON at 1.299 read "missed: 1.3 < 1.3" (the AVX2 EPYC, 287a7b8)."""
    for figures in range(3, 10):
        shown = f"{value:.{figures}g}"
        if value == bound or float(shown) != bound:
            return shown
    return repr(value)


def _verdict(goal: dict[str, Any]) -> str:
    """`met: 0.912 ≥ 0.9`, `**missed**: 0.897 < 0.9`: the value judged, to three figures (more
    where those round it onto its bound), so that one the table rounds to its bound (0.90)
    still shows which side it fell."""
    met = goal["met"]
    if goal["right"]:  # then `met` is the comparison itself: its sign, or the one against
        sign = {">=": ("<", "≥"), "<=": (">", "≤")}[goal["rule"]][met]
        why = f"{_judged(goal['value'], goal['bound'])} {sign} {goal['bound']:g}"
    else:
        why = "a wrong answer"
    return f"{'met' if met else '**missed**'}: {why}"


def markdown(results: dict[str, Any]) -> str:
    device = results.get("device", "cpu")
    gpu = f"GPU: {results.get('gpu') or device}; " if device != "cpu" else ""
    lines = [
        f"CPU: {describe(results['cpu'])}, {results['cores']} cores; {gpu}"
        "one image per request; wrk "
        f"{results['duration_s']:g} s per cell, {results['rounds']} interleaved rounds (the "
        "protocol measured first alternating, the endpoints taking turns), medians; req/s "
        "counts 2xx answers only, and failed is the requests that got an error answer or none "
        "(all rounds). Ratios taken within each round, then the median (in brackets: the least"
        " and greatest round). Same-path no-model: this server with a batcher that answers at"
        " once, no model; FastAPI no-model: a FastAPI route that parses the same request (the"
        " serving issue's yardstick; the server's tensor routes skip FastAPI, so it is no"
        " ceiling of the server's path). × in-process: against the model's in-process rate at"
        " its best batch, measured for 1 s just before the cell. Event loop: CPU its thread"
        " spent per answered request,"
        " server / same path / FastAPI; model threads: cores the server's other threads used;"
        " machine: share of all cores busy while wrk ran.",
        "",
        "| model | protocol | conc. | server req/s | failed | p50 ms | p99 ms | mean batch "
        "| no-model req/s: same path / FastAPI | × same-path no-model | × FastAPI no-model "
        "| × in-process | event loop µs/req | model threads | machine |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- |",
    ]

    def figure(value: float | None, spec: str, suffix: str = "") -> str:
        return "-" if value is None or not math.isfinite(value) else f"{value:{spec}}{suffix}"

    failures = []
    for m in results["models"]:
        by_key = {(r["endpoint"], r["protocol"], r["concurrency"]): r for r in m["load"]}
        for (endpoint, protocol, c), r in by_key.items():
            if r.get("failed"):
                failures.append(
                    f"- **{m['model']}, {endpoint}, {protocol} at {c} connections: "
                    f"{r['failed']} requests failed** ({r['non2xx']} error answers, "
                    f"{r['socket_errors']} socket errors or timeouts, over {r['rounds']} "
                    "round(s)); its req/s counts 2xx answers only, its p50/p99 every answer "
                    "(wrk times error answers too)"
                )
            if endpoint != SERVER:
                continue
            same = by_key.get((SAME_PATH, protocol, c), {})
            fastapi = by_key.get((FASTAPI, protocol, c), {})
            loops = " / ".join(
                figure(x.get("loop_us_per_request"), ".0f") for x in (r, same, fastapi)
            )
            lines.append(
                f"| {m['model']} ({m['variant']}) | {protocol} | {c} | {r['req_per_s']:.0f} "
                f"| {r.get('failed', 0)} "
                f"| {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['mean_batch_rows'] or '-'} "
                f"| {figure(same.get('req_per_s'), '.0f')} "
                f"/ {figure(fastapi.get('req_per_s'), '.0f')} "
                f"| {_ratio(m, 'server_vs_same_path', protocol, str(c))} "
                f"| {_ratio(m, 'server_vs_fastapi', protocol, str(c))} "
                f"| {_ratio(m, 'server_vs_in_process', protocol, str(c))} "
                f"| {loops} "
                f"| {figure(r.get('other_threads_cores'), '.2f')} "
                f"| {figure(r.get('machine_busy'), '.0%')} |"
            )
    lines.append("")
    lines += failures
    for m in results["models"]:
        ceiling = m["in_process_ceiling"]
        binary = m["ratios"]["binary_vs_json"]
        per_c = ", ".join(
            f"c={c}: {_ratio(m, 'binary_vs_json', SERVER, c)} (same path "
            f"{_ratio(m, 'binary_vs_json', SAME_PATH, c)}, FastAPI "
            f"{_ratio(m, 'binary_vs_json', FASTAPI, c)})"
            for c in binary[SERVER]
        )
        setup = ""
        if "instances" in m:
            setup = f" ({m['instances']} instance(s) x {m['threads_per_instance']} threads)"
        lines.append(
            f"- {m['model']}{setup}: in-process ceiling {ceiling['rows_per_s']:.0f} rows/s at "
            f"batch {ceiling['best_batch']}; binary V2 / JSON req/s {per_c}"
        )
        if "peak" in m["ratios"]["server_vs_fastapi"].get("json", {}):
            peaks = "; ".join(
                f"{name} JSON {_ratio(m, kind, 'json', 'peak')}, "
                f"binary {_ratio(m, kind, 'binary', 'peak')}"
                for name, kind in (
                    ("same path", "server_vs_same_path"),
                    ("FastAPI", "server_vs_fastapi"),
                )
            )
            lines.append(
                f"- {m['model']}: best server req/s at any concurrency against each no-model "
                f"endpoint's best: {peaks}"
            )
        if off_loop := m.get("bodies_parsed_off_loop"):
            lines.append(
                f"- {m['model']}: {' and '.join(off_loop)} bodies are large enough to be parsed "
                "off the event loop by the server and the same-path endpoint, on it by the "
                "FastAPI one: its event loop column counts the parsing, theirs do not"
            )
        if start := m.get("startup"):
            verdict = "correct" if start["correct"] else "WRONG"
            lines.append(
                f"- {m['model']}: first answer {start['seconds']:.2f} s after the server process "
                f"was started ({verdict})"
            )
    if judged := goals(results):
        lines += [
            "",
            "The serving issue's performance targets, judged on this run:",
            "",
            "| target | measured | |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {g['goal']} | {g['figures']} | {_verdict(g)} |" for g in judged]
    return "\n".join(lines) + "\n"


MODELS = ("digits", "resnet18")


def gpu_name(device: str) -> str | None:
    """The name nvidia-smi gives the GPU `device` names (cuda:N), None on the CPU or where
    nvidia-smi cannot tell."""
    if device == "cpu" or shutil.which("nvidia-smi") is None:
        return None
    index = device.partition(":")[2] or "0"
    # CUDA numbers only the GPUs CUDA_VISIBLE_DEVICES lists, in its order; nvidia-smi numbers
    # them all (it takes the listed index or UUID as they are)
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        visible = [v.strip() for v in listed.split(",")]
        # CUDA reads the list up to its first entry that names no GPU
        usable = list(
            itertools.takewhile(lambda v: v.isdigit() or v.startswith(("GPU-", "MIG-")), visible)
        )
        if not index.isdigit() or int(index) >= len(usable):
            return None  # no GPU of that number for CUDA
        index = usable[int(index)]
    query = ["nvidia-smi", "-i", index, "--query-gpu=name", "--format=csv,noheader"]
    try:
        done = subprocess.run(query, capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def bench(
    digits_run: Path,
    resnet_run: Path,
    duration: float,
    concurrency: list[int],
    out: Path,
    rounds: int = 3,
    models: str | None = None,
    variant: str = "auto",
    threads: int | None = None,
    instances: int = 1,
    device: str = "cpu",
) -> dict[str, Any]:
    # usage errors (exit 2), before wrk is looked for or any run is trained
    if not concurrency or min(concurrency) < 1:
        raise ConfigError("--concurrency must list positive connection counts, e.g. 1,16,64")
    if rounds < 1 or instances < 1:
        raise ConfigError("--rounds and --instances must be at least 1, e.g. 3 and 1")
    # wrk's -d takes whole seconds only; nan and inf have no int()
    if not math.isfinite(duration) or duration < 1 or duration != int(duration):
        raise ConfigError(f"--duration must be a whole number of seconds, e.g. 4; got {duration:g}")
    if threads is not None and not 1 <= threads <= 256:
        raise ConfigError(f"--threads must be 1 to 256 (default: cores / instances), got {threads}")
    labels = parse_choices(models, MODELS, "--models", ConfigError)
    if variant != "auto" and variant not in VARIANTS:
        raise ConfigError(f"unknown --variant '{variant}'; choose from auto, {', '.join(VARIANTS)}")
    if not DEVICE.fullmatch(device):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if shutil.which("wrk") is None:
        raise LightshipError(f"wrk not found: {WRK_HINT}")
    from lightship.quantize.isa import host_cpu

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per readiness poll

    if out.suffix.lower() == ".md":  # the table goes beside it as .md: it took its place
        out = out.with_suffix(".json")
    check_writable(out, out.with_suffix(".md"))
    cpu = host_cpu()
    made = {
        "digits": lambda: ensure_run(digits_run, "configs/digits.yaml", variant=variant),
        "resnet18": lambda: ensure_run(
            resnet_run, "configs/resnet.yaml", "trainer.max_epochs=1", variant=variant
        ),
    }
    runs = {label: made[label]() for label in labels}
    with tempfile.TemporaryDirectory(prefix="lightship-bench-") as tmp:
        measured = [
            bench_model(
                label,
                rd,
                variant,
                concurrency,
                duration,
                rounds,
                Path(tmp),
                threads,
                instances,
                device,
            )
            for label, rd in runs.items()
        ]
    results = {
        "cpu": cpu.as_dict(target=True),  # as report.json names it
        # those the bench may use (taskset, a container's CPU quota), as the server counts them
        "cores": physical_cores(),
        "device": device,
        "gpu": gpu_name(device),
        "python": platform.python_version(),
        "duration_s": duration,
        "rounds": rounds,
        "concurrency": concurrency,
        "models": measured,
    }
    results["goals"] = goals(results)
    atomic_write_text(out, json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    atomic_write_text(out.with_suffix(".md"), table)
    print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}", file=sys.stderr)
    return results
