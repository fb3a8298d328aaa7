"""The simple protocol: `{"instances": [...]}` pixels or uploaded images -> labels and top-k.

No model and no web framework here, like `v2.py`.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

import numpy as np
import orjson

from lightship.data import images
from lightship.runtime.base import softmax
from lightship.serve.batcher import TooManyRows
from lightship.serve.v2 import ProtocolError, holds_bool, json_error, not_json_at_all

# Width x height above which an upload is refused before decoding (a small PNG can declare a
# huge canvas: a decompression bomb). Far above any classifier's input. A JPEG its decoder
# shrinks a row at a time goes up to Pillow's limit, as training reads it (images.decode).
MAX_IMAGE_PIXELS = 40_000_000
# The pixels one request's uploads may take to decode together (such a JPEG counts as its
# decoder shrinks it: a 12 MP photo, 0.19 MP; a progressive one in full). 64 PNGs of 116 KB
# declaring 40 MP each held a decode slot for 10 s, every other upload waiting, and ended in
# 504; this is ~0.8 s of decoding.
MAX_REQUEST_PIXELS = 100_000_000
# Where image files go, and the multipart form field that holds them.
IMAGE_ROUTE = "/v1/predict/image"
IMAGES_FIELD = "files"


# JSON's names of what orjson reads a document as, by its exact type (a bool is no number)
_JSON_KINDS: dict[type, str] = {
    type(None): "null",
    bool: "boolean",
    int: "number",
    float: "number",
    str: "string",
    list: "array",
}


def query_top_k(query: str | None, default: int) -> int:
    """`top_k` from /v1/predict's query string (`?top_k=3`), else `default`; 400 for a value
    that is no positive integer, or given twice. Other parameters are let be, as on the image
    route."""
    if not query:
        return default
    given = urllib.parse.parse_qs(query, keep_blank_values=True).get("top_k")
    if given is None:
        return default
    if len(given) > 1:
        raise ProtocolError(f"top_k is given {len(given)} times in the query: give it once")
    value = given[0]
    # int() of thousands of digits raises ValueError (a 500); no answer has that many classes
    if not (value.isascii() and value.isdigit()) or len(value) > 100 or int(value) < 1:
        shown = value if len(value) <= 20 else value[:19] + "..."
        raise ProtocolError(f"top_k must be a positive integer, got {shown!r}")
    return int(value)


def decode_instances(
    body: bytes, chw: tuple[int, int, int], default_top_k: int, max_rows: int | None = None
) -> tuple[np.ndarray, int]:
    """(pixels `[N, C, H, W]` as sent, top_k) from `{"instances": [...], "top_k": k}`; more
    than `max_rows` instances are refused (`TooManyRows`) before they become an array."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        error = json_error(exc)
        if not_json_at_all(exc):  # an image posted here, as a form or as the body
            raise ProtocolError(
                f'{error}: send {{"instances": [image, ...]}} here; image files (PNG, JPEG) go '
                f'to {IMAGE_ROUTE} as multipart form field "{IMAGES_FIELD}"'
            ) from None
        raise error from None
    if not isinstance(doc, dict) or "instances" not in doc:
        v2_hint = (
            '; a V2 body ({"inputs": [...]}) goes to /v2/models/{name}/infer'
            if isinstance(doc, dict) and "inputs" in doc
            else ""
        )
        what = (
            'the body has no "instances"'
            if isinstance(doc, dict)
            else f"the body is a JSON {_JSON_KINDS.get(type(doc), 'value')}"
        )
        raise ProtocolError(f'{what}: send {{"instances": [image, ...]}}{v2_hint}')
    instances = doc["instances"]
    if not isinstance(instances, list):
        raise ProtocolError("instances must be a list of images (nested lists of pixels)")
    if not instances:
        raise ProtocolError("empty batch: send at least one instance")
    if max_rows is not None and len(instances) > max_rows:
        # Before numpy builds them all (16 MiB of digits instances: 0.4 s, 65 MB) only to be
        # refused: the first instance tells a batch too long from instances of a wrong shape.
        first = _leading_shape(instances[0])
        if len(first) == 2 and chw[0] == 1:
            first = [1, *first]
        if tuple(first) != chw:
            raise ProtocolError(_wrong_shape(first, chw))
        raise TooManyRows.of(len(instances), max_rows)
    top_k = doc.get("top_k")
    if top_k is None:  # absent or null, as V2 reads its parameters
        top_k = default_top_k
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ProtocolError(f"top_k must be a positive integer, got {top_k!r}")
    if holds_bool(instances):  # numpy would take true/false as pixels 1/0
        raise ProtocolError("instances hold true/false: send pixel values 0..255")
    try:
        x = np.asarray(instances)
    except ValueError:
        raise ProtocolError("instances are ragged: each must be a full [C, H, W] image") from None
    if x.dtype.kind not in "iuf":
        raise ProtocolError("instances must hold numbers (pixel values 0..255)")
    if x.ndim == 3 and chw[0] == 1:  # one-channel images may leave out the channel axis
        x = x[:, None]
    # Checked here rather than by Predictor.check, which would read a 3-D array as one image
    # and speaks of batches: the client sent instances.
    if x.ndim != 4 or x.shape[1:] != chw:
        raise ProtocolError(_wrong_shape(list(x.shape[1:]), chw))
    return x, top_k


def _wrong_shape(shape: list[int], chw: tuple[int, int, int]) -> str:
    c, h, w = chw
    channels_last = tuple(shape) == (h, w, c)
    return (
        f"each instance must be [{', '.join(map(str, chw))}] pixels; "
        f"got instances of shape {shape}"
        + (" (this looks like HWC: transpose each to CHW)" if channels_last else "")
    )


def _leading_shape(value: Any) -> list[int]:
    """The shape of nested lists by their first items: [1, 28, 28] for one digit image."""
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        value = value[0] if value else None
    return shape


def encode_predictions(
    logits: np.ndarray,
    labels: list[str],
    top_k: int,
    model_name: str,
    files: list[str] | None = None,
) -> bytes:
    probabilities = softmax(logits)
    k = min(top_k, probabilities.shape[1])
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
    predictions: list[dict[str, Any]] = []
    for row, (p, idx) in enumerate(zip(probabilities, order, strict=True)):
        best = int(idx[0])
        pred: dict[str, Any] = {
            "label": labels[best],
            "index": best,
            "score": float(p[best]),
            "top_k": [
                {"label": labels[int(i)], "index": int(i), "probability": float(p[i])} for i in idx
            ],
        }
        if files is not None:
            pred["file"] = files[row]
        predictions.append(pred)
    return orjson.dumps({"model": model_name, "predictions": predictions})


# HTTP status for each way an upload fails to decode
_STATUS = {"unreadable": 400, "exif": 400, "format": 415, "size": 413}


def check_decode_budget(datas: list[bytes], chw: tuple[int, int, int]) -> None:
    """413 for uploads that would take more than MAX_REQUEST_PIXELS to decode together, read
    from their headers before any is decoded."""
    total = sum(images.pixels_to_decode(data, chw) for data in datas)
    if total > MAX_REQUEST_PIXELS:
        raise ProtocolError(
            f"the {len(datas)} images hold {total:,} pixels to decode, over the limit of "
            f"{MAX_REQUEST_PIXELS:,} a request: send fewer or smaller images (each is resized "
            f"to {chw[2]}x{chw[1]}), or spread them over several requests",
            413,
        )


def decode_image(data: bytes, chw: tuple[int, int, int], filename: str = "image") -> np.ndarray:
    """A PNG/JPEG as uint8 `[C, H, W]`: the pixels training reads from the same file
    (`lightship.data.images.decode`), converted to the model's channels and H x W."""
    c = chw[0]
    if c not in (1, 3):
        raise ProtocolError(
            f"this model takes {c}-channel input, which no image format holds: "
            "send tensors to /v1/predict or /v2/models/{name}/infer"
        )
    try:
        pixels, _ = images.decode(data, chw, filename, MAX_IMAGE_PIXELS)
    except images.ImageError as exc:
        raise ProtocolError(str(exc), _STATUS[exc.problem]) from None
    return pixels
