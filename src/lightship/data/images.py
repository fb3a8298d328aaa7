"""One PNG/JPEG decoder for training and serving, so that a file gives the model the same pixels
in both: the image folder loader and the server's image upload both call `decode`.

numpy and Pillow only: the server imports this beside an ONNX model, without torch.
"""

from __future__ import annotations

import contextlib
import io
import re
import struct
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, UnidentifiedImageError

# MPO: a JPEG with extra pictures appended (many phone cameras); the first is the photo.
FORMATS = ("PNG", "JPEG", "MPO")
# .jfif and .jpe: JPEG files as some browsers save them
SUFFIXES = (".png", ".jpg", ".jpeg", ".jfif", ".jpe")
# Modes without colour; "I;16*" and "I" are 16-bit grayscale PNGs.
GRAY_MODES = {"1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N"}
WIDE_MODES = {"I", "I;16", "I;16B", "I;16L", "I;16N"}

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

Problem = Literal["unreadable", "format", "size", "exif"]


class ImageError(Exception):
    """A file that does not decode. `problem`: unreadable (corrupt, cut short, not an image),
    format (an image, but not PNG or JPEG), size (over the pixel limit) or exif (metadata)."""

    def __init__(self, name: str, reason: str, problem: Problem = "unreadable") -> None:
        super().__init__(f"{name}: {reason}")
        self.name, self.reason, self.problem = name, reason, problem


@contextlib.contextmanager
def _exif_damage() -> Iterator[list[str]]:
    """Pillow's warnings of damaged EXIF tags (it skips them) as they are parsed, collected
    instead of written to the log: raw, one line for each kind of damage, a client could add
    lines to the server's log at will. Other warnings go on as they were. Under `_OPENING`
    (catch_warnings swaps the process's filters)."""
    damage: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("always", category=UserWarning, module=r"PIL\.TiffImagePlugin")
            yield damage
    finally:
        for w in caught:
            if w.category is UserWarning and w.filename.endswith("TiffImagePlugin.py"):
                damage.append(str(w.message))
            else:
                key = (w.category, w.filename, w.lineno)
                if key not in _PASSED_ON:
                    _PASSED_ON.add(key)
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


# Where the warnings `_exif_damage` passed on came from, each passed on once (bounded by the
# places in Pillow that warn): inside catch_warnings Python's own once-only registry is reset
# every time, and a malformed MPO index was two raw log lines an upload
_PASSED_ON: set[tuple[type[Warning], str, int]] = set()


def _as_seen(im: Image.Image, name: str, damage: list[str]) -> Image.Image:
    """`im` turned upright by its EXIF orientation (a phone's portrait photo is stored
    sideways). Not `ImageOps.exif_transpose`: it also rewrites the EXIF block, and raises on
    tags it cannot write back (struct.error), although only the orientation is needed here.
    `damage`: Pillow's warnings of the EXIF tags it skipped (a JPEG's EXIF is parsed as it
    opens); a skipped orientation is refused, as an EXIF block that does not parse is."""
    fix = "strip it (e.g. `exiftool -all= FILE`) and use the image again"
    try:
        with _OPENING, _exif_damage() as more:  # a PNG's EXIF is parsed here
            orientation = im.getexif().get(_ORIENTATION)
    except Exception as exc:  # Pillow's EXIF parser raises struct.error, KeyError, ...
        raise ImageError(
            name, f"its EXIF metadata is unreadable ({type(exc).__name__}: {exc}); {fix}", "exif"
        ) from None
    said = (*damage, *more)
    if orientation is None and said and _lists_orientation(_exif_block(im)) is not False:
        message = " ".join(said[0].split())  # Pillow's double and trailing spaces
        raise ImageError(name, f"its EXIF orientation is unreadable ({message}); {fix}", "exif")
    method = _TRANSPOSE.get(orientation) if isinstance(orientation, int) else None
    return im.transpose(method) if method is not None else im


def _exif_block(im: Image.Image) -> bytes | None:
    """The image's EXIF block as Pillow's `getexif` reads it: a JPEG's APP1 or a PNG's eXIf
    chunk, or ImageMagick's hex "Raw profile type exif" text chunk in a PNG; None: it has none
    (Pillow's damage warnings then came from elsewhere, an MPO's index)."""
    raw = im.info.get("exif")
    if isinstance(raw, bytes):
        return raw
    profile = im.info.get("Raw profile type exif")
    if not isinstance(profile, str):
        return None
    try:
        return bytes.fromhex("".join(profile.split("\n")[3:]))
    except ValueError:
        return b""  # there, and unreadable


def _lists_orientation(raw: bytes | None) -> bool | None:
    """Whether the first IFD of the EXIF block `raw` (TIFF, maybe behind "Exif\\0\\0") has an
    entry for the orientation; None where its table of entries cannot be read that far. Pillow
    skips a damaged tag with a warning, or stops at damage after the last entry (a missing
    next-IFD offset): only an orientation listed, or a table cut short, is lost. No block at
    all lists none."""
    if raw is None:
        return False
    tiff = raw[6:] if raw.startswith(b"Exif\x00\x00") else raw
    order = {b"II": "<", b"MM": ">"}.get(tiff[:2])
    if order is None or len(tiff) < 8:
        return None
    (start,) = struct.unpack_from(order + "I", tiff, 4)
    if start + 2 > len(tiff):
        return None
    (count,) = struct.unpack_from(order + "H", tiff, start)
    for entry in range(start + 2, start + 2 + 12 * count, 12):
        if entry + 2 > len(tiff):
            return None
        if struct.unpack_from(order + "H", tiff, entry)[0] == _ORIENTATION:
            return True
    return False


def _is_colour(im: Image.Image) -> bool:
    if im.mode in ("P", "PA"):  # a palette of grays is a gray image
        palette = np.asarray(im.getpalette() or [], dtype=np.uint8).reshape(-1, 3)
        return bool((palette != palette[:, :1]).any())
    return im.mode not in GRAY_MODES


def _too_large(exc: Exception, max_pixels: int | None) -> str:
    """Pillow's refusal of an image past its limit, said as the caller's own limit says it."""
    pixels = re.search(r"\((\d+) pixels\)", str(exc))
    if pixels is None:
        return str(exc).rstrip(".")
    if max_pixels is None:  # training data: Pillow's limit, said with what to do
        pillows = re.search(r"limit of (\d+) pixels", str(exc))
        pillows_limit = f" of {int(pillows.group(1)):,}" if pillows else ""
        return (
            f"{int(pixels.group(1)):,} pixels is over Pillow's decompression-bomb "
            f"limit{pillows_limit}: "
            "downscale it (a few thousand pixels a side is far more than a classifier uses)"
        )
    limit = max_pixels
    if isinstance(exc, Image.DecompressionBombError) and Image.MAX_IMAGE_PIXELS:
        limit = min(limit, 2 * Image.MAX_IMAGE_PIXELS)  # Pillow opens nothing larger
    return f"{int(pixels.group(1)):,} pixels is too large (limit {limit:,})"


_OPENING = threading.Lock()


# JPEG markers a sequential Huffman JPEG holds before its first scan: APPn, COM, DQT, DHT,
# DRI and the frame header (SOF0 baseline, SOF1 extended); then its start of scan (SOS)
_SOF_SEQUENTIAL = (0xC0, 0xC1)
_BEFORE_SCAN = frozenset((*range(0xE0, 0xF0), 0xFE, 0xDB, 0xC4, 0xDD, *_SOF_SEQUENTIAL))
_SOS = 0xDA


def jpeg_frame(source: bytes) -> tuple[int, int] | None:
    """(width, height) of the JPEG `source` if libjpeg decodes it a row of blocks at a time,
    shrunk as drafted as it goes: a sequential frame whose first scan holds every component
    (libjpeg's `has_multiple_scans` false); else None. Any other it holds whole as coefficients
    before a row comes out: progressive (40 MP, 122 MB), or a scan a component (179 bytes
    declaring 2.5 GP: 720 MB). Read from the markers before the first scan, and only the ones
    such a file holds: libjpeg passes over bytes it does not take for a marker (FF 00), where a
    frame read here as any marker with a length hid another (1.4 KB declaring 89 MP: 736 MB)."""
    if source[:2] != b"\xff\xd8":
        return None
    at, frame = 2, None
    while at + 4 <= len(source):
        if source[at] != 0xFF:
            return None
        marker = source[at + 1]
        if marker == 0xFF:  # fill byte before a marker
            at += 1
            continue
        if marker not in _BEFORE_SCAN and marker != _SOS:
            return None
        (length,) = struct.unpack_from(">H", source, at + 2)
        segment = source[at + 4 : at + 2 + length]
        if length < 2 or len(segment) != length - 2:
            return None
        if marker in _SOF_SEQUENTIAL:
            if frame is not None or len(segment) < 6 or len(segment) < 6 + 3 * segment[5]:
                return None  # a second frame header (libjpeg refuses it), or one cut short
            height, width = struct.unpack_from(">HH", segment, 1)
            frame = (width, height, segment[5])
        if marker == _SOS:
            if frame is None or not frame[2] or segment[:1] != bytes([frame[2]]):
                return None
            return frame[0], frame[1]
        at += 2 + length
    return None


def jpeg_streams(source: bytes, im: Image.Image) -> bool:
    """Whether `im`, opened from the JPEG `source`, decodes shrunk a row at a time
    (`jpeg_frame`): the frame read here is the one Pillow opened, and not progressive."""
    if im.format not in ("JPEG", "MPO") or im.info.get("progressive"):
        return False
    return jpeg_frame(source) == im.size


def pixels_to_decode(source: bytes, chw: tuple[int, int, int]) -> int:
    """The pixels `decode` would decode of the PNG/JPEG `source`, read from its header only (a
    small file can declare a huge canvas); 0 for a file that does not open, which `decode`
    refuses with the reason. A JPEG counts shrunk only where its decoder streams it
    (`jpeg_streams`): else it holds and works through every coefficient at full size
    whatever the shrink (a progressive 40 MP: 122 MB, 0.12 s), and 64 of them fit a
    request's budget counted shrunk."""
    try:
        with _OPENING, warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(source))
        with im:
            if jpeg_streams(source, im):
                # shrunk as it decodes, as `decode` asks it to
                side = max(chw[1], chw[2])
                im.draft({1: "L", 3: "RGB"}.get(chw[0], "RGB"), (side, side))
            return int(im.width * im.height)
    except Exception:  # anything that does not open: decode says why
        return 0


def decode(
    source: bytes | Path,
    chw: tuple[int, int, int],
    name: str = "image",
    max_pixels: int | None = None,
) -> tuple[np.ndarray, bool]:
    """A PNG/JPEG (its bytes or its file) as uint8 `[C, H, W]` with C 1 (gray) or 3 (RGB),
    upright by its EXIF orientation, 16-bit scaled to 8, resized to H x W; and whether the
    file holds colour. Raises ImageError naming `name`."""
    c, h, w = chw
    mode = {1: "L", 3: "RGB"}[c]
    if (len(source) if isinstance(source, bytes) else source.stat().st_size) == 0:
        raise ImageError(name, "empty file (0 bytes): not a readable PNG or JPEG image")
    try:
        # catch_warnings swaps the process's filters, so threads decoding at once take turns
        # (opening reads only the header); unguarded, one could leave the filter on for good
        with _OPENING, _exif_damage() as damage:
            if max_pixels is not None:
                # Checked below: past Pillow's own limit (89 MP) its warning would say so
                # again, in the server's log.
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
        with im:
            if im.format not in FORMATS:
                raise ImageError(
                    name, f"{im.format} images are not accepted: use PNG or JPEG", "format"
                )
            limit = max_pixels
            if limit is not None and isinstance(source, bytes) and jpeg_streams(source, im):
                # decoded shrunk a row at a time (a 48 MP photo: 0.09 s, no memory to speak
                # of): up to Pillow's limit, as the image folder reads it for training
                limit = max(limit, Image.MAX_IMAGE_PIXELS or 0)
            if limit is not None and im.width * im.height > limit:
                pillows = Image.MAX_IMAGE_PIXELS or 0
                # a progressive JPEG (or one scan per component) past the server's limit: a
                # baseline one of the same size would be taken
                baseline = (
                    f"; a baseline JPEG may have up to {pillows:,}, save it so"
                    if im.format in ("JPEG", "MPO") and limit < im.width * im.height <= pillows
                    else ""
                )
                raise ImageError(
                    name,
                    f"{im.width}x{im.height} pixels is too large (limit {limit:,}{baseline})",
                    "size",
                )
            colour = _is_colour(im)
            if im.format in ("JPEG", "MPO"):
                # The JPEG decoder downscales by 2/4/8 at far less work (a 1000x1000 photo to
                # 28x28: 2.6 ms, not 5.9). A square box: the EXIF turn below may swap W and H.
                im.draft(mode, (max(w, h), max(w, h)))
            im.load()  # decoded first: a PNG's EXIF may follow its pixels, and a cut-short
            seen = _as_seen(im, name, damage)  # file is a broken image, not broken EXIF
            if seen.mode in WIDE_MODES:
                # 16-bit grayscale PNG: Pillow's convert("L") clips at 255 instead of scaling.
                wide = np.asarray(seen, dtype=np.float32)
                seen = Image.fromarray(np.clip(np.rint(wide / 257), 0, 255).astype(np.uint8), "L")
            converted = seen.convert(mode)
            if converted.size != (w, h):
                converted = converted.resize((w, h), Image.Resampling.BILINEAR)
            pixels = np.asarray(converted, dtype=np.uint8)
    except ImageError:
        raise
    except UnidentifiedImageError:  # its message names the buffer object: say it plainly
        raise ImageError(name, "not a readable PNG or JPEG image (unrecognised data)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # past Pillow's limit (a warning, unless the caller made it an error): a small file
        # can declare gigapixels
        raise ImageError(name, _too_large(exc, max_pixels), "size") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(name, f"not a readable PNG or JPEG image ({exc})") from None
    return (pixels[None] if c == 1 else pixels.transpose(2, 0, 1)), colour
