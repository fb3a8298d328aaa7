"""OpenAPI descriptions of the raw-body routes (they parse bytes themselves, not pydantic models),
and the /docs and /redoc pages that show them.

Shapes, names and datatypes are the served model's, so /docs shows what to send and schemathesis
generates requests that can succeed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, Response
from starlette.exceptions import HTTPException

from lightship.serve import v2

ERROR: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}},
}


def _pixels(dims: tuple[int, ...]) -> dict[str, Any]:
    """Nested arrays of exactly `dims`, innermost integers 0..255."""
    schema: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": 255}
    for n in reversed(dims):
        schema = {"type": "array", "minItems": n, "maxItems": n, "items": schema}
    return schema


def v1_request(chw: tuple[int, int, int], max_rows: int) -> dict[str, Any]:
    image = _pixels(chw)
    image["description"] = f"one image: [{chw[0]}][{chw[1]}][{chw[2]}] pixel values 0..255"
    if chw[0] == 1:
        image = {"anyOf": [image, _pixels(chw[1:])], "description": "[1][H][W] or [H][W]"}
    return {
        "type": "object",
        "required": ["instances"],
        "properties": {
            "instances": {"type": "array", "minItems": 1, "maxItems": max_rows, "items": image},
            "top_k": {"type": "integer", "minimum": 1, "description": "classes per image"},
        },
    }


def v2_request(input_name: str, chw: tuple[int, int, int], max_rows: int) -> dict[str, Any]:
    c, h, w = chw
    tensor = {
        "type": "object",
        "required": ["name", "shape", "datatype"],
        "properties": {
            "name": {"type": "string", "enum": [input_name]},
            "shape": {
                "type": "array",
                "minItems": 3,
                "maxItems": 4,
                "items": {"type": "integer", "minimum": 0},
                "description": f"[N, {c}, {h}, {w}] with N from 1 to {max_rows}; "
                f"[{c}, {h}, {w}] is one image",
            },
            "datatype": {
                "type": "string",
                "enum": list(v2.DATATYPES),
                "description": "any numeric type holding pixel values 0..255 (the model "
                "takes UINT8); BOOL, BYTES and BF16 are refused",
            },
            "parameters": {
                "type": "object",
                "properties": {"binary_data_size": {"type": "integer", "minimum": 0}},
            },
            "data": {"type": "array", "description": "row-major values, flat or nested"},
        },
    }
    output = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "enum": list(v2.OUTPUTS)},
            "parameters": {
                "type": "object",
                "properties": {
                    "binary_data": {"type": "boolean"},
                    "classification": {"type": "integer", "minimum": 0},
                },
            },
        },
    }
    return {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {
                "type": "object",
                "properties": {
                    "binary_data_output": {"type": "boolean"},
                    "timeout": {
                        "type": "integer",
                        "minimum": 0,
                        "description": "microseconds; 0: none of the request's own",
                    },
                },
            },
            "inputs": {"type": "array", "minItems": 1, "maxItems": 1, "items": tensor},
            "outputs": {"type": "array", "items": output},
        },
    }


def body(schema: dict[str, Any], binary: bool = False) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its body itself."""
    content: dict[str, Any] = {"application/json": {"schema": schema}}
    if binary:
        content["application/octet-stream"] = {
            "schema": {"type": "string", "format": "binary"},
            "description": "binary tensor extension: a JSON header of "
            f"{v2.HEADER_LENGTH} bytes, then the raw tensors ({v2.HEADER_LENGTH} 0: no "
            "header, the body is the input tensor, UINT8 [N, C, H, W])",
        }
    return {"requestBody": {"required": True, "content": content}}


# `?top_k=N` of both /v1 routes, which read it with `v1.query_top_k` (one rule for both)
TOP_K_QUERY: dict[str, Any] = {
    "name": "top_k",
    "in": "query",
    "required": False,
    "description": "classes per image",
    "schema": {"type": "integer", "minimum": 1},
}

# Every route that runs the model takes it (app.TIMEOUT_HEADER).
TIMEOUT_PARAM: dict[str, Any] = {
    "name": "x-request-timeout-ms",
    "in": "header",
    "required": False,
    "description": "shortens the server's deadline for this request (504 past it)",
    "schema": {"type": "number", "exclusiveMinimum": 0},
}


def image_body(field: str, max_files: int) -> dict[str, Any]:
    """`openapi_extra` of the image route, which parses its form and query itself."""
    files = {
        "type": "array",
        "minItems": 1,
        "maxItems": max_files,
        # `format: binary` (OpenAPI 3.0's way) is what Swagger UI draws a file picker for: with
        # 3.1's `contentMediaType` alone /docs showed text boxes, and Execute sent text (400)
        "items": {"type": "string", "format": "binary"},
        "description": "one or more PNG or JPEG images",
    }
    schema = {"type": "object", "required": [field], "properties": {field: files}}
    return {
        "parameters": [TOP_K_QUERY, TIMEOUT_PARAM],
        "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}},
    }


def drop_validation_errors(schema: dict[str, Any]) -> None:
    """Remove the 422 `{"detail": [...]}` FastAPI documents on every route with parameters:
    this server answers a request it cannot validate 400 `{"error": ...}`, as each route says."""
    for item in schema["paths"].values():
        for operation in item.values():
            operation.get("responses", {}).pop("422", None)
    schemas = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    if schema.get("components") == {"schemas": {}}:
        del schema["components"]


def response(schema: dict[str, Any], description: str) -> dict[int | str, dict[str, Any]]:
    """`responses` of a route whose 200 is a plain dict: documented by `schema`."""
    return {200: {"description": description, "content": {"application/json": {"schema": schema}}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {
        s: {"description": "error", "content": {"application/json": {"schema": ERROR}}}
        for s in statuses
    }


V1_RESPONSE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "predictions": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "label": {"type": "string"},
                    "index": {"type": "integer"},
                    "score": {"type": "number"},
                    "top_k": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "label": {"type": "string"},
                                "index": {"type": "integer"},
                                "probability": {"type": "number"},
                            },
                        },
                    },
                },
            },
        },
    },
}
# The image route's answer: /v1/predict's, each prediction naming the file it is for.
V1_IMAGE_RESPONSE: dict[str, Any] = {
    **V1_RESPONSE,
    "properties": {
        **V1_RESPONSE["properties"],
        "predictions": {
            "type": "array",
            "items": {
                **V1_RESPONSE["properties"]["predictions"]["items"],
                "properties": {
                    **V1_RESPONSE["properties"]["predictions"]["items"]["properties"],
                    "file": {"type": "string", "description": "the uploaded file's name"},
                },
            },
        },
    },
}
V2_RESPONSE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "model_name": {"type": "string"},
        "model_version": {"type": "string"},
        "id": {"type": "string"},
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "datatype": {"type": "string"},
                    "shape": {"type": "array", "items": {"type": "integer"}},
                    "data": {"type": "array"},
                    "parameters": {"type": "object"},
                },
            },
        },
    },
}


def _tensors(datatype: str) -> dict[str, Any]:
    return {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "datatype": {"type": "string", "enum": [datatype]},
                "shape": {
                    "type": "array",
                    "items": {"type": "integer"},
                    "description": "-1: the batch dimension",
                },
            },
        },
    }


V2_MODEL_METADATA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "versions", "platform", "inputs", "outputs"],
    "properties": {
        "name": {"type": "string"},
        "versions": {"type": "array", "items": {"type": "string"}},
        "platform": {"type": "string", "description": "onnxruntime_onnx, pytorch_libtorch, ..."},
        "inputs": {**_tensors("UINT8"), "description": "the image batch [-1, C, H, W]"},
        "outputs": {
            **_tensors("FP32"),
            "description": "logits and probabilities (their softmax), [-1, classes]",
        },
        "parameters": {
            "type": "object",
            "properties": {
                "labels": {"type": "array", "items": {"type": "string"}},
                "max_batch_size": {"type": "integer", "description": "rows one request may carry"},
            },
        },
    },
}
V2_MODEL_CONFIG: dict[str, Any] = {
    "type": "object",
    "description": "the subset of Triton's model configuration this server can state",
    "properties": {
        "name": {"type": "string"},
        "platform": {"type": "string"},
        "backend": {"type": "string"},
        "max_batch_size": {"type": "integer", "description": "rows one request may carry"},
        "input": {"type": "array", "items": {"type": "object"}},
        "output": {"type": "array", "items": {"type": "object"}},
        "dynamic_batching": {"type": "object"},
        "instance_group": {"type": "array", "items": {"type": "object"}},
    },
}


def _compressed_answers(min_bytes: int) -> str:
    """What the server's `compress_min_bytes` makes of a client's Accept-Encoding, said."""
    if min_bytes == 0:
        return "Answers go uncompressed whatever Accept-Encoding asks (--compress-min-bytes 0)."
    if min_bytes % 1024 == 0:
        size = f"{min_bytes // 1024} KiB"
    else:
        size = f"{min_bytes} byte{'' if min_bytes == 1 else 's'}"
    return (
        f"Answers of {size} or more go gzip or deflate compressed when Accept-Encoding asks "
        "(--compress-min-bytes)."
    )


def _path_param(name: str, value: str, description: str) -> dict[str, Any]:
    # Documented as the one value served; others are answered 404 with a V2 error body.
    schema = {"type": "string", "enum": [value]}
    return {
        "name": name,
        "in": "path",
        "required": True,
        "schema": schema,
        "description": description,
    }


def raw_paths(
    model_name: str,
    input_name: str,
    chw: tuple[int, int, int],
    max_rows: int,
    compress_min_bytes: int,
) -> dict[str, Any]:
    """Path items of the routes that parse their own bodies (not visible to FastAPI)."""
    compressed = _compressed_answers(compress_min_bytes)
    name = _path_param("model_name", model_name, "the served model")
    version = _path_param("version", v2.VERSION, "model version")
    infer_responses = {
        "200": {
            "description": "outputs (binary ones after a JSON header, as in the request): "
            "logits and probabilities, or with parameters.classification k, the top k as "
            'BYTES "score:index:label"',
            "headers": {
                v2.HEADER_LENGTH: {
                    "description": "bytes of JSON before the binary outputs, when there are any",
                    "schema": {"type": "integer", "minimum": 0},
                }
            },
            "content": {
                "application/json": {"schema": V2_RESPONSE},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            },
        },
        **errors(400, 404, 408, 413, 415, 429, 503, 504),
    }
    infer = {
        "tags": ["v2"],
        "summary": "Run the model (JSON or binary tensors)",
        "description": "KServe V2 inference. Shorten the deadline with x-request-timeout-ms "
        "or parameters.timeout (µs). Bodies may come gzip or deflate compressed "
        f"(Content-Encoding). {compressed}",
        **body(v2_request(input_name, chw, max_rows), binary=True),
        "responses": infer_responses,
    }
    headers = [
        {
            "name": v2.HEADER_LENGTH,
            "in": "header",
            "required": False,
            "description": "binary tensor extension: bytes of JSON before the binary tensors "
            "(required with an application/octet-stream body; 0: the body is the input tensor, "
            "UINT8 [N, C, H, W], and every output comes back binary)",
            "schema": {"type": "integer", "minimum": 0},
        },
        TIMEOUT_PARAM,
    ]
    return {
        "/v2/models/{model_name}/infer": {
            "post": {**infer, "operationId": "v2_infer", "parameters": [name, *headers]}
        },
        "/v2/models/{model_name}/versions/{version}/infer": {
            "post": {
                **infer,
                "operationId": "v2_infer_version",
                "parameters": [name, version, *headers],
            }
        },
        "/v1/predict": {
            "post": {
                "tags": ["v1"],
                "operationId": "v1_predict",
                "summary": "Labels and top-k probabilities for images given as pixel arrays",
                "description": compressed,
                "parameters": [
                    TOP_K_QUERY
                    | {"description": "classes per image, as the body's top_k (which wins)"},
                    TIMEOUT_PARAM,
                ],
                **body(v1_request(chw, max_rows)),
                "responses": {
                    "200": {
                        "description": "one prediction per instance",
                        "content": {"application/json": {"schema": V1_RESPONSE}},
                    },
                    **errors(400, 408, 413, 415, 429, 503, 504),
                },
            }
        },
    }


# The pages' scripts and styles, from fastapi-offline's copy of the CDN files FastAPI links to
# (Swagger UI 5, ReDoc 2): served by the server itself, /docs works on an edge box offline.
DOCS_FILES = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
    "favicon.png": "image/png",
}


def add_docs(app: FastAPI) -> None:
    """GET /docs (Swagger UI), /redoc and /docs/<file>; make the app with docs_url=None and
    redoc_url=None. The files' route has a fixed path, so the metrics see one label for it."""
    spec = importlib.util.find_spec("fastapi_offline")
    assert spec is not None and spec.origin is not None, "fastapi-offline is a serve dependency"
    static = Path(spec.origin).parent / "static"
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}/docs/swagger-ui-bundle.js",
            swagger_css_url=f"{root}/docs/swagger-ui.css",
            swagger_favicon_url=f"{root}/docs/favicon.png",
            oauth2_redirect_url=None,
            swagger_ui_parameters=app.swagger_ui_parameters,
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}/docs/redoc.standalone.js",
            redoc_favicon_url=f"{root}/docs/favicon.png",
            with_google_fonts=False,
        )

    @app.get("/docs/{name}", include_in_schema=False)
    async def docs_file(name: str) -> Response:
        if name not in DOCS_FILES:
            raise HTTPException(404, f"no file {name!r} here: the docs are at /docs and /redoc")
        return FileResponse(
            static / name,
            media_type=DOCS_FILES[name],
            headers={"cache-control": "public, max-age=86400"},
        )
