"""The benchmark's no-model ceiling: a FastAPI V2 infer route that parses and answers, no model.

It decodes the request with the server's own `v2.decode_request` and encodes a response of the
same shape with `v2.encode_response`, on the same uvicorn settings, so the gap between it and
`lightship serve` is what batching, checks, metrics and the model cost.

    python -m lightship.serve.ceiling --port 8001 --input-name input --classes 10
"""

from __future__ import annotations

import argparse

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from lightship.serve import v2


def create_app(input_name: str, classes: int) -> FastAPI:
    app = FastAPI(title="lightship no-model ceiling")
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


def main() -> None:
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
