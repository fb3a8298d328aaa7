"""The benchmark's two no-model ceilings: what serving costs without batching and inference.

- **same-path no-model** (`python -m lightship.serve.ceiling serve ARGS`): `lightship serve
  ARGS` itself, the real server process (uvicorn with lightship's HTTP protocol, which answers
  the tensor routes without ASGI: body limit, metrics, V2 and v1 parsing and checks,
  deadlines, the error table, the answer's encoding), with one part replaced: its `Batcher` by
  `InstantBatcher`, which answers each request at once on the event loop with zero logits, no
  queue and no inference thread. The gap between it and `lightship serve` is what batching and
  the model cost on top of the same request path.
- **FastAPI no-model** (`python -m lightship.serve.ceiling --input-name input --classes 10`):
  a FastAPI V2 infer route that parses the same request with `v2.decode_request` and answers
  with `v2.encode_response`, no model. The serving issue's target is stated against it ("the
  digits model over JSON reaches ≥ 90 % of the no-model FastAPI ceiling"). The server answers
  its tensor routes in its HTTP protocol, without FastAPI (`TensorRoutes`), which costs its
  event loop less per request than this route does: it is no ceiling of the server's request
  path, and the server can beat it.

Each listens on the `--port` given.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from lightship.serve import v2
from lightship.serve.batcher import Batcher, Ticket, _Item


def create_app(input_name: str, classes: int) -> FastAPI:
    app = FastAPI(title="lightship FastAPI no-model ceiling")
    labels = [str(i) for i in range(classes)]

    @app.post("/v2/models/{model_name}/infer")
    async def infer(request: Request, model_name: str) -> Response:
        body = await request.body()
        req = v2.decode_request(body, request.headers.get(v2.HEADER_LENGTH), input_name)
        logits = np.zeros((len(req.x), classes), np.float32)
        content, headers = v2.encode_response(logits, req.outputs, labels, model_name, req.id)
        return Response(content, headers=headers)

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(b'{"ready":true}', media_type="application/json")

    return app


class InstantBatcher(Batcher):
    """The model stand-in of the same-path ceiling: every request is answered as it is
    submitted, with zero logits, on the event loop; no queue, no timer, no inference thread.

    The model runs once, on the server's warm-up batch: that answer is the warm-up's (so the
    server turns ready only on a model that answers), and its width is the zero logits'.
    """

    _classes: int | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    def submit(self, x: np.ndarray, timeout_s: float, wait: bool = True) -> Ticket:
        assert self._loop is not None, "batcher not started"
        if self._classes is None:
            y = self._run(x)
            self._classes = int(y.shape[1])
        else:
            y = np.zeros((len(x), self._classes), np.float32)
        future = self._loop.create_future()
        future.set_result(y)
        now = time.monotonic()
        return Ticket(self, _Item(x, len(x), now, now, now + timeout_s, future))


def serve_without_model(argv: list[str]) -> None:
    """`lightship serve` with these arguments, its batcher an `InstantBatcher`."""
    from lightship import cli
    from lightship.serve import app

    app.Batcher = InstantBatcher  # type: ignore[misc]  # this process serves no model
    # its log says "serving" the model like the server's: say first what this process is
    print("no-model ceiling: `lightship serve` answering every request at once", file=sys.stderr)
    sys.argv = ["lightship", *argv]
    cli.main()


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        serve_without_model(sys.argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--input-name", default="input")
    parser.add_argument("--classes", type=int, default=10)
    args = parser.parse_args()
    uvicorn.run(
        create_app(args.input_name, args.classes),
        host=args.host,
        port=args.port,
        workers=1,
        access_log=False,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
