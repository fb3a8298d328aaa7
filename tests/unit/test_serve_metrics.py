"""What /metrics exports: served traffic only, buckets that resolve it, the process beside it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lightship.serve.metrics import LATENCY_BUCKETS, Metrics, latency_buckets, rows_buckets
from tests.unit.test_serve_app import INFER, make_app, metric, run, serving, v2_json


def test_the_warm_up_batch_is_not_counted_as_traffic(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path, warmup_rows=3, max_wait_ms=0)

    async def main() -> tuple[str, str]:
        async with serving(app) as client:  # ready: the warm-up batch is back
            fresh = (await client.get("/metrics")).text
            for rows in (1, 2, 4):  # one at a time: one batch each
                x = np.zeros((rows, 1, 2, 2), np.uint8)
                assert (await client.post(INFER, json=v2_json(x))).status_code == 200
            return fresh, (await client.get("/metrics")).text

    fresh, served = run(main())
    for name in (
        "lightship_batch_rows_count",
        "lightship_compute_seconds_count",
        "lightship_queue_wait_seconds_count",
        "lightship_batch_rows_sum",
    ):
        assert metric(fresh, name) == 0, name
    assert metric(served, "lightship_batch_rows_count") == 3
    assert metric(served, "lightship_batch_rows_sum") == 7
    assert metric(served, "lightship_compute_seconds_count") == 3
    assert metric(served, "lightship_queue_wait_seconds_count") == 3


def test_latency_buckets_resolve_tens_of_microseconds_to_seconds() -> None:
    assert 15 <= len(LATENCY_BUCKETS) <= 20
    assert LATENCY_BUCKETS[0] <= 0.0001 and LATENCY_BUCKETS[-1] >= 5
    # digits' compute (~0.37 ms) and a no-model request (~60 µs) fall in buckets of their own,
    # with more below them: a quantile between two bounds is not the first bucket's
    below = [sum(b < seconds for b in LATENCY_BUCKETS) for seconds in (0.00006, 0.00037, 0.004)]
    assert below[0] >= 1 and below[0] < below[1] < below[2]


def test_latency_buckets_reach_the_longest_a_request_may_take() -> None:
    """They ended at 10 s: a 12 s upload over a slow link, or any request under a longer
    --timeout-ms, fell in +Inf, and every quantile there read as 10 s."""
    assert latency_buckets(10) == LATENCY_BUCKETS
    assert latency_buckets(266)[len(LATENCY_BUCKETS) :] == (25, 50, 100, 250, 500)
    assert latency_buckets(3600 + 256)[-1] == 5000
    text = Metrics(max_batch_rows=8, longest_s=12).exposition().decode()
    assert 'lightship_request_duration_seconds_bucket{le="25.0",route=' not in text  # no child
    metrics = Metrics(max_batch_rows=8, longest_s=12)
    metrics.request("/v1/predict/image", 200, 12.2)
    text = metrics.exposition().decode()
    bucket = 'lightship_request_duration_seconds_bucket{{le="{}",route="/v1/predict/image",'
    bucket += 'status_class="2xx"}} '
    assert bucket.format("10.0") + "0.0" in text and bucket.format("25.0") + "1.0" in text
    assert 'lightship_queue_wait_seconds_bucket{le="25.0"} 0.0' in text


def test_rows_buckets_end_at_the_largest_batch_and_single_out_full_ones() -> None:
    assert rows_buckets(64) == (1, 2, 4, 8, 16, 32, 63, 64)
    assert rows_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 99, 100)
    assert rows_buckets(2) == (1, 2)
    assert rows_buckets(1) == (1,)
    text = Metrics(max_batch_rows=8).exposition().decode()
    assert 'lightship_batch_rows_bucket{le="8.0"}' in text
    assert 'lightship_batch_rows_bucket{le="16.0"}' not in text


def test_process_and_python_metrics_are_exported_beside_the_servers() -> None:
    text = Metrics(max_batch_rows=64).exposition().decode()
    for name in (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "python_info",
        "python_gc_collections_total",
    ):
        assert f"\n{name}" in text, name


def test_a_body_refused_by_its_content_length_is_counted_under_its_route(tmp_path: Path) -> None:
    """The 413 from Content-Length comes before any route is matched; it is still labelled
    with the route the request was sent to, as the same 413 while the body streams is."""
    app, _ = make_app(tmp_path, max_body_bytes=4096)
    too_large = b"x" * 5000
    routes = {
        INFER: "/v2/models/{model_name}/infer",
        "/v2/models/hand/versions/1/infer": "/v2/models/{model_name}/versions/{version}/infer",
        "/v1/predict": "/v1/predict",
        "/v1/predict/image": "/v1/predict/image",
        "/v2/models/hand": "/v2/models/{model_name}",  # GET only: its 405, had it been read
        "/v2/nowhere": "unmatched",
    }

    async def main() -> str:
        async with serving(app) as client:
            for path in routes:
                r = await client.post(path, content=too_large)
                assert r.status_code == 413, (path, r.text)
            r = await client.request("GET", "/v2/health/ready", content=too_large)
            assert r.status_code == 413
            return (await client.get("/metrics")).text

    text = run(main())
    for route in [*routes.values(), "/v2/health/ready"]:
        assert metric(text, f'lightship_requests_total{{route="{route}",status="413"}}') == 1, route


def test_request_latency_tells_refusals_from_answers(tmp_path: Path) -> None:
    """429s and 400s take ~0.1 ms, answers milliseconds: in one series, an overload read as a
    faster server. The latency histogram is labelled by status class."""
    app, _ = make_app(tmp_path, max_wait_ms=0)

    async def main() -> str:
        async with serving(app) as client:
            for _ in range(2):
                assert (
                    await client.post(INFER, json=v2_json(np.zeros((1, 1, 2, 2), np.uint8)))
                ).is_success
            assert (await client.post(INFER, content=b"{")).status_code == 400
            return (await client.get("/metrics")).text

    text = run(main())
    series = 'lightship_request_duration_seconds_count{route="/v2/models/{model_name}/infer",'
    assert metric(text, series + 'status_class="2xx"}') == 2
    assert metric(text, series + 'status_class="4xx"}') == 1
