"""The serving benchmark's pieces that need no server: request bodies, metrics, the table."""

from __future__ import annotations

import numpy as np

from lightship.serve import bench, v2


def test_benchmark_bodies_are_valid_v2_requests_for_the_same_image() -> None:
    bodies = bench.request_bodies((1, 8, 8), "pixels")
    as_json = v2.decode_request(bodies["json"][0], None, "pixels")
    binary_body, header_length = bodies["binary"]
    as_binary = v2.decode_request(binary_body, str(header_length), "pixels")
    assert as_json.x.shape == as_binary.x.shape == (1, 1, 8, 8)
    np.testing.assert_array_equal(as_json.x, as_binary.x)
    assert [o.binary for o in as_binary.outputs] == [True]
    assert [o.binary for o in as_json.outputs] == [False]


def test_batch_rows_are_read_from_the_metrics_exposition() -> None:
    text = (
        "# TYPE lightship_batch_rows histogram\n"
        'lightship_batch_rows_bucket{le="1.0"} 3.0\n'
        "lightship_batch_rows_count 7.0\n"
        "lightship_batch_rows_sum 41.0\n"
    )
    assert bench._batch_rows(text) == (41.0, 7.0)
    assert bench._batch_rows("") == (0.0, 0.0)


def test_markdown_pairs_each_server_row_with_the_no_model_row_of_the_same_load() -> None:
    def row(endpoint: str, protocol: str, c: int, rps: float, batch: float | None) -> dict:
        return {
            "endpoint": endpoint,
            "protocol": protocol,
            "concurrency": c,
            "req_per_s": rps,
            "p50_ms": 1.0,
            "p99_ms": 2.5,
            "mean_batch_rows": batch,
        }

    results = {
        "cpu": "Test CPU",
        "cores": 2,
        "duration_s": 5.0,
        "models": [
            {
                "model": "digits",
                "variant": "onnx-int8-static",
                "in_process_ceiling": {"rows_per_s": 9000.0, "best_batch": 64},
                "load": [
                    row("server", "binary", 16, 1500.0, 12.5),
                    row("no-model ceiling", "binary", 16, 4000.0, None),
                ],
            }
        ],
    }
    table = bench.markdown(results)
    assert "Test CPU" in table
    assert (
        "| digits (onnx-int8-static) | binary | 16 | 1500 | 1.00 | 2.50 | 12.5 | 4000 | 2.50 "
        "| 9000 rows/s (batch 64) |" in table
    )
