"""Schemathesis hooks for the runs against the server's OpenAPI schema
(`SCHEMATHESIS_HOOKS=tests.schemathesis_hooks`).

A deadline a client sets itself (`x-request-timeout-ms`, V2 `parameters.timeout` in µs) of
well under a second can pass while the request's body is still on its way or its batch runs,
on a loaded machine more so, and the server then answers 504, as it documents: that client's
deadline passed. The `not_a_server_error` check counts every 5xx as the server's failure, so
generated deadlines under a second get one second added: still sent, still the server's to
read, and a value that is no number still tests its 400.
"""

from __future__ import annotations

from typing import Any

import schemathesis

HEADER = "x-request-timeout-ms"


@schemathesis.hook
def before_call(ctx: Any, case: Any, **kwargs: Any) -> None:
    """On every request it sends, in every phase: `map_headers` and `map_body` missed the
    coverage phase's, whose `x-request-timeout-ms: 1.0` on an upload of one valid PNG was
    answered 504, as it should be, and failed the run."""
    headers = case.headers
    if headers and HEADER in headers:
        ms = _number(headers[HEADER])
        if ms is not None and 0 < ms < 1000:
            headers[HEADER] = f"{ms + 1000:g}"
    body = case.body
    parameters = body.get("parameters") if isinstance(body, dict) else None
    if isinstance(parameters, dict):
        timeout = parameters.get("timeout")
        if isinstance(timeout, int) and not isinstance(timeout, bool) and 0 < timeout < 10**6:
            parameters["timeout"] = timeout + 10**6


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
