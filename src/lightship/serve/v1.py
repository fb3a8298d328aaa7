"""The simple protocol: `{"instances": [...]}` pixels or uploaded images -> labels and top-k.

No model and no web framework here, like `v2.py`.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import orjson
from PIL import Image, UnidentifiedImageError

from lightship.runtime.base import softmax
from lightship.serve.v2 import ProtocolError, holds_bool

# MPO: a JPEG with extra pictures appended (many phone cameras); the first is the photo.
IMAGE_FORMATS = ("PNG", "JPEG", "MPO")
# Width x height above which an upload is refused before decoding (a small PNG can declare a
# huge canvas: a decompression bomb). Far above any classifier's input.
MAX_IMAGE_PIXELS = 40_000_000


def decode_instances(
    body: bytes, chw: tuple[int, int, int], default_top_k: int
) -> tuple[np.ndarray, int]:
    """(pixels `[N, C, H, W]` as sent, top_k) from `{"instances": [...], "top_k": k}`."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"malformed JSON: {exc}") from None
    if not isinstance(doc, dict) or "instances" not in doc:
        raise ProtocolError('body must be a JSON object {"instances": [image, ...]}')
    instances = doc["instances"]
    if not isinstance(instances, list):
        raise ProtocolError("instances must be a list of images (nested lists of pixels)")
    if not instances:
        raise ProtocolError("empty batch: send at least one instance")
    top_k = doc.get("top_k", default_top_k)
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
    if x.ndim != 4:  # Predictor.check would read a 3-D array as one image: say it here
        raise ProtocolError(
            f"each instance must be [{', '.join(map(str, chw))}] pixels; "
            f"got instances of shape {list(x.shape[1:])}"
        )
    return x, top_k


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


# EXIF orientation -> the transpose that shows the picture as the camera saw it (EXIF 2.32)
_ORIENTATION = 0x0112
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _as_seen(im: Image.Image, filename: str) -> Image.Image:
    """`im` turned upright by its EXIF orientation (a phone's portrait photo is stored
    sideways). Not `ImageOps.exif_transpose`: it also rewrites the EXIF block, and raises on
    tags it cannot write back (struct.error), although only the orientation is needed here."""
    try:
        orientation = im.getexif().get(_ORIENTATION)
    except Exception as exc:  # Pillow's EXIF parser raises struct.error, KeyError, ...
        raise ProtocolError(
            f"{filename}: its EXIF metadata is unreadable ({type(exc).__name__}: {exc}); "
            "strip it (e.g. `exiftool -all= FILE`) and send the image again"
        ) from None
    method = _TRANSPOSE.get(orientation) if isinstance(orientation, int) else None
    return im.transpose(method) if method is not None else im


def decode_image(data: bytes, chw: tuple[int, int, int], filename: str = "image") -> np.ndarray:
    """A PNG/JPEG as uint8 `[C, H, W]`: converted to the model's channels, resized to its H x W."""
    c, h, w = chw
    if c not in (1, 3):
        raise ProtocolError(
            f"this model takes {c}-channel input, which no image format holds: "
            "send tensors to /v1/predict or /v2/models/{name}/infer"
        )
    mode = "L" if c == 1 else "RGB"
    try:
        im: Image.Image = Image.open(io.BytesIO(data))
        if im.format not in IMAGE_FORMATS:
            raise ProtocolError(
                f"{filename}: {im.format} images are not accepted: send PNG or JPEG", 415
            )
        if im.width * im.height > MAX_IMAGE_PIXELS:
            raise ProtocolError(
                f"{filename}: {im.width}x{im.height} pixels is too large "
                f"(limit {MAX_IMAGE_PIXELS:,})",
                413,
            )
        if im.format in ("JPEG", "MPO"):
            im.draft(mode, (w, h))  # let the JPEG decoder downscale by 2/4/8: far less work
        im.load()  # decoded first: a PNG's EXIF may follow its pixels, and a cut-short file
        im = _as_seen(im, filename)  # is a broken image, not broken EXIF
        if im.mode in ("I", "I;16", "I;16B", "I;16L"):
            # 16-bit grayscale PNG: Pillow's convert("L") clips at 255 instead of scaling.
            wide = np.asarray(im, dtype=np.float32)
            im = Image.fromarray(np.clip(np.rint(wide / 257), 0, 255).astype(np.uint8), "L")
        converted = im.convert(mode)
        if converted.size != (w, h):
            converted = converted.resize((w, h), Image.Resampling.BILINEAR)
        pixels = np.asarray(converted, dtype=np.uint8)
    except ProtocolError:
        raise
    except UnidentifiedImageError:  # its message names the buffer object: say it plainly
        raise ProtocolError(
            f"{filename}: not a readable PNG or JPEG image (unrecognised data)"
        ) from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ProtocolError(f"{filename}: not a readable PNG or JPEG image ({exc})") from None
    return pixels[None] if c == 1 else pixels.transpose(2, 0, 1)
