"""Batched prediction over HTTP: FastAPI + uvicorn, the KServe V2 protocol, Prometheus metrics.

`settings` (what to serve and how), `model` (which artifact, checked), `batcher` (the dynamic
batcher, no HTTP), `v1` / `v2` (request and response formats, no model), `metrics`, `app`
(routes and lifecycle), `command` (the CLI), `bench` (the benchmark).

Importing this package imports nothing heavy: the CLI reads it for `lightship --help`.
"""
