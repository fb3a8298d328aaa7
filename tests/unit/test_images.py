"""`lightship.data.images.decode` on images past a caller's pixel limit and past Pillow's.

Pillow warns past `Image.MAX_IMAGE_PIXELS` (~89 MP) and refuses past twice that; a small
limit stands for it here, as in test_data, without the slow huge files.
"""

from __future__ import annotations

import io
import struct
import sys
import threading
import warnings

import pytest
from PIL import Image

from lightship.data import images

PILLOWS_LIMIT = 1000  # warns past 1,000 pixels, refuses past 2,000


def png(side: int) -> bytes:
    buf = io.BytesIO()
    Image.new("1", (side, side)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("side", "message"),
    [
        (30, "big.png: 30x30 pixels is too large (limit 800)"),  # under Pillow's: its own check
        (40, "big.png: 40x40 pixels is too large (limit 800)"),  # Pillow warns: said once
        (50, "big.png: 2,500 pixels is too large (limit 800)"),  # Pillow refuses to open it
    ],
)
def test_a_callers_limit_is_the_one_said_and_pillow_warns_nothing(
    monkeypatch: pytest.MonkeyPatch, side: int, message: str
) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", PILLOWS_LIMIT)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(images.ImageError) as refused:
            images.decode(png(side), (1, 8, 8), "big.png", max_pixels=800)
    assert str(refused.value) == message and refused.value.problem == "size"
    assert [w.message for w in seen] == []  # the server's log gets no DecompressionBombWarning


def test_past_pillows_limit_the_lower_limit_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", PILLOWS_LIMIT)
    with pytest.raises(images.ImageError) as refused:
        images.decode(png(50), (1, 8, 8), "big.png", max_pixels=10**6)
    # Pillow opens nothing larger than twice its limit: that is the limit said
    assert str(refused.value) == "big.png: 2,500 pixels is too large (limit 2,000)"
    # between Pillow's two limits, under the caller's: decoded, without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pixels, _ = images.decode(png(40), (1, 8, 8), "big.png", max_pixels=10**6)
    assert pixels.shape == (1, 8, 8)


@pytest.mark.parametrize("side", [40, 50])  # over Pillow's warning size, and over twice it
def test_without_a_limit_of_its_own_pillows_stands(
    monkeypatch: pytest.MonkeyPatch, side: int
) -> None:
    """Training passes no limit and makes Pillow's warning an error (data/sources.py): its
    images past Pillow's limit are refused with that limit, and what to do."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", PILLOWS_LIMIT)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(images.ImageError) as refused:
            images.decode(png(side), (1, 8, 8), "cat/huge.png")
    limit = PILLOWS_LIMIT if side == 40 else 2 * PILLOWS_LIMIT
    assert str(refused.value) == (
        f"cat/huge.png: {side * side:,} pixels is over Pillow's decompression-bomb limit of "
        f"{limit:,}: downscale it (a few thousand pixels a side is far more than a classifier "
        "uses)"
    )
    assert refused.value.problem == "size"


def test_threads_decoding_at_once_leave_the_warning_filters_as_they_were() -> None:
    # the server decodes uploads in threads: each decode swaps the process's warning filters
    # (catch_warnings), and without taking turns one could leave Pillow's warning ignored
    data, before, interval = png(8), list(warnings.filters), sys.getswitchinterval()

    def decode_many() -> None:
        for _ in range(300):
            images.decode(data, (1, 8, 8), "x.png", max_pixels=10**6)

    sys.setswitchinterval(1e-6)  # threads switch often: the race, if there is one, shows
    try:
        for _ in range(3):
            threads = [threading.Thread(target=decode_many) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert warnings.filters == before
    finally:
        sys.setswitchinterval(interval)


def jpeg(width: int, height: int, **options: object) -> bytes:
    buf = io.BytesIO()
    Image.linear_gradient("L").resize((width, height)).convert("RGB").save(buf, "JPEG", **options)
    return buf.getvalue()


def one_component_first_scan(data: bytes) -> bytes:
    """A sequential JPEG whose first scan holds one of its three components (its later scans the
    others, were they written): its decoder holds every coefficient, as a progressive one's."""
    at = data.index(b"\xff\xda")
    length = struct.unpack_from(">H", data, at + 2)[0]
    scan = data[at : at + 2 + length]
    one = b"\xff\xda" + struct.pack(">H", 8) + b"\x01" + scan[5:7] + scan[-3:]
    return data[:at] + one + data[at + len(scan) :]


def hidden_behind_junk(hidden: bytes, shown: bytes) -> bytes:
    """`hidden`'s frame and scans behind FF 00, which libjpeg and Pillow pass over as junk and
    a parser taking every FF xx for a marker with a length skips, then `shown`'s: each reads
    the other's picture."""
    inner = hidden[2:]
    return b"\xff\xd8\xff\x00" + struct.pack(">H", len(inner) + 2) + inner + shown[2:]


def test_which_jpegs_decode_shrunk_a_row_at_a_time_is_read_from_their_markers() -> None:
    gray = io.BytesIO()
    Image.new("L", (64, 48)).save(gray, "JPEG")
    assert images.jpeg_frame(jpeg(64, 48)) == (64, 48)  # baseline, one scan of Y, Cb and Cr
    assert images.jpeg_frame(gray.getvalue()) == (64, 48)
    assert images.jpeg_frame(b"\xff\xd8\xff" + jpeg(64, 48)[2:]) == (64, 48)  # a fill byte
    for held in (
        jpeg(64, 48, progressive=True),
        one_component_first_scan(jpeg(64, 48)),
        png(8),
        hidden_behind_junk(jpeg(96, 96, progressive=True), jpeg(64, 48)),
    ):
        assert images.jpeg_frame(held) is None
    for cut in (b"", b"\xff\xd8", jpeg(64, 48)[:100], b"\xff\xd8" + b"\xff" * 64):
        assert images.jpeg_frame(cut) is None


def test_a_frame_hidden_from_the_marker_reader_is_not_taken_as_streaming() -> None:
    """A progressive frame behind FF 00, a baseline one after it: what the decoder reads is
    the progressive one (1.4 KB declaring 89 MP held 736 MB as it decoded)."""
    data = hidden_behind_junk(jpeg(96, 96, progressive=True), jpeg(64, 48))
    with Image.open(io.BytesIO(data)) as im:
        assert im.size == (96, 96) and im.info.get("progressive")  # what Pillow reads
        assert not images.jpeg_streams(data, im)
    assert images.pixels_to_decode(data, (3, 8, 8)) == 96 * 96
    with pytest.raises(images.ImageError, match="96x96 pixels is too large"):
        images.decode(data, (3, 8, 8), "x.jpg", max_pixels=5000)
    # a scan a component hidden so, the same size as the frame shown: sequential to Pillow
    data = hidden_behind_junk(one_component_first_scan(jpeg(64, 48)), jpeg(64, 48))
    with Image.open(io.BytesIO(data)) as im:
        assert im.size == (64, 48) and not im.info.get("progressive")
        assert not images.jpeg_streams(data, im)
    assert images.pixels_to_decode(data, (3, 8, 8)) == 64 * 48


def test_a_jpeg_decoded_a_row_at_a_time_is_taken_up_to_pillows_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server's 40 MP refused a 45 MP phone photo that training reads (to Pillow's 89 MP):
    one decoded shrunk a row at a time costs no more than a small one. A JPEG whose decoder
    holds every coefficient at full size keeps the server's limit."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 40_000)  # warns past 200x200
    photo = jpeg(240, 160)
    pixels, _ = images.decode(photo, (3, 8, 8), "photo.jpg", max_pixels=20_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        trained, _ = images.decode(photo, (3, 8, 8), "photo.jpg")  # as the image folder reads
    assert (pixels == trained).all() and pixels.std() > 10
    for name, data, pixels_said in [
        ("big.jpg", jpeg(240, 200), "240x200"),  # past Pillow's limit too
        ("p.jpg", jpeg(240, 160, progressive=True), "240x160"),
        ("scans.jpg", one_component_first_scan(photo), "240x160"),
    ]:
        with pytest.raises(images.ImageError) as refused:
            images.decode(data, (3, 8, 8), name, max_pixels=20_000)
        # past the server's limit only: a baseline JPEG of its size would be taken
        limit = (
            "40,000"
            if name == "big.jpg"
            else "20,000; a baseline JPEG may have up to 40,000, save it so"
        )
        assert str(refused.value) == f"{name}: {pixels_said} pixels is too large (limit {limit})"
    # a request's budget counts it shrunk, as it decodes: 240x160 to 8x8, by 8 a side
    assert images.pixels_to_decode(photo, (3, 8, 8)) == 30 * 20
    for held in (jpeg(240, 160, progressive=True), one_component_first_scan(photo)):
        assert images.pixels_to_decode(held, (3, 8, 8)) == 240 * 160
