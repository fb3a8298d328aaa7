"""`lightship.data.images.decode` on images past a caller's pixel limit and past Pillow's.

Pillow warns past `Image.MAX_IMAGE_PIXELS` (~89 MP) and refuses past twice that; a small
limit stands for it here, as in test_data, without the slow huge files.
"""

from __future__ import annotations

import io
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


def jpeg(width: int, height: int) -> bytes:
    """A JPEG of one gray: small and quick to write however large (8000x5700: 0.7 MB)."""
    buf = io.BytesIO()
    Image.new("L", (width, height), 200).save(buf, "JPEG")
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


def test_a_jpeg_is_judged_at_the_size_it_decodes_at() -> None:
    """The server's 40 MP limit is there so that no decode allocates a huge image: a 45 MP phone
    photo decodes shrunk by 8 (1000x713) for a small model, and is taken, as training takes it;
    it was refused by its declared size. The request's budget counts it the same."""
    photo = jpeg(8000, 5700)
    pixels, _ = images.decode(photo, (1, 224, 224), "photo.jpg", max_pixels=40_000_000)
    assert pixels.shape == (1, 224, 224) and pixels.min() == pixels.max() == 200
    assert images.pixels_to_decode(photo, (1, 224, 224)) == 1000 * 713


@pytest.mark.parametrize(
    ("side", "message"),
    [
        (80, None),  # drafted to 10x10 for 8x8: 100 pixels
        (400, "big.jpg: 400x400 pixels is too large (limit 800)"),  # still 50x50 at 1/8
        (2001, "big.png: 2001x2001 pixels is too large (limit 800)"),  # a PNG: as it declares
    ],
)
def test_the_callers_limit_on_the_pixels_decoded(side: int, message: str | None) -> None:
    data, name = (png(side), "big.png") if side == 2001 else (jpeg(side, side), "big.jpg")
    if message is None:
        pixels, _ = images.decode(data, (1, 8, 8), name, max_pixels=800)
        assert pixels.shape == (1, 8, 8)
        return
    with pytest.raises(images.ImageError) as refused:
        images.decode(data, (1, 8, 8), name, max_pixels=800)
    assert str(refused.value) == message and refused.value.problem == "size"


@pytest.mark.parametrize(
    ("side", "chw", "decoded", "limit"),
    [
        (40, (1, 8, 8), 100, None),  # 1,600 declared: over Pillow's warning size
        (100, (1, 8, 8), 169, None),  # 10,000: over twice it (Pillow's open refuses it)
        (70, (1, 35, 35), 1225, PILLOWS_LIMIT),  # shrunk by 2 at the most for 35x35
        (100, (1, 50, 50), 2500, 2 * PILLOWS_LIMIT),
    ],
)
def test_pillows_limit_on_the_pixels_a_jpeg_decodes(
    monkeypatch: pytest.MonkeyPatch,
    side: int,
    chw: tuple[int, int, int],
    decoded: int,
    limit: int | None,
) -> None:
    """Training (no limit of its own, Pillow's warning an error) takes a JPEG that its decoder
    shrinks under Pillow's limit, however large the size it declares: a 108 MP photo decodes at
    1.7 MP; one still over it as decoded is refused as a PNG is, said with its own size."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", PILLOWS_LIMIT)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        if limit is None:
            pixels, _ = images.decode(jpeg(side, side), chw, "cat/huge.jpg")
            assert pixels.shape == chw and pixels.min() == pixels.max() == 200
            assert images.pixels_to_decode(jpeg(side, side), chw) == decoded
            return
        with pytest.raises(images.ImageError) as refused:
            images.decode(jpeg(side, side), chw, "cat/huge.jpg")
    assert images.pixels_to_decode(jpeg(side, side), chw) == decoded
    assert str(refused.value) == (
        f"cat/huge.jpg: {side * side:,} pixels is over Pillow's decompression-bomb limit of "
        f"{limit:,}: downscale it (a few thousand pixels a side is far more than a classifier "
        "uses)"
    )


def test_a_jpeg_past_twice_pillows_limit_counts_for_the_server_as_it_decodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", PILLOWS_LIMIT)
    big = jpeg(100, 100)  # Pillow would not open it: 10,000 pixels, 13x13 decoded
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pixels, _ = images.decode(big, (1, 8, 8), "big.jpg", max_pixels=800)
    assert pixels.shape == (1, 8, 8) and [w.message for w in seen] == []
    assert images.pixels_to_decode(big, (1, 8, 8)) == 13 * 13
    assert images.pixels_to_decode(png(50), (1, 8, 8)) == 0  # a PNG stays refused: decode says
    with pytest.raises(images.ImageError) as refused:  # past twice Pillow's, under the caller's
        images.decode(big, (1, 50, 50), "big.jpg", max_pixels=10**6)
    assert str(refused.value) == "big.jpg: 10,000 pixels is too large (limit 2,000)"


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
