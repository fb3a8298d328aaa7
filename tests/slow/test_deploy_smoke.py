"""`make docker-smoke` in the suite: the CPU image's install replayed, then served from (~90 s).

deploy/smoke.py builds the virtualenv with the Dockerfile's own RUN lines (only `.[serve]`,
pinned), starts `lightship serve` with the image's ENV, ENTRYPOINT, USER and HEALTHCHECK on a
handmade model whose logits are sum(pixels) and 100 - sum(pixels), and stops it with SIGTERM.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_deploy import smoke


@pytest.fixture
def image_root() -> Iterator[Path]:
    """Under /tmp, not pytest's private tmp_path: the server runs as the image's user (10001)."""
    root = Path(tempfile.mkdtemp(prefix="lightship-smoke-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_cpu_image_install_serves_exact_predictions_and_stops_cleanly(image_root: Path) -> None:
    report = smoke.smoke(image_root)
    # pixels [1, 2, 3, 4] sum to 10 and [255, 255, 255, 250] to 1015
    assert report["logits"] == [[10.0, 90.0], [1015.0, -915.0]]
    assert report["labels"] == ["dark", "bright"]
    assert report["exit_code"] == 0
    # the image's venv: pinned serve packages only (checked inside), small enough for an edge box
    assert report["venv_mib"] < 250
    assert report["not_replayed"] and all("useradd" in line for line in report["not_replayed"])
    if os.geteuid() == 0:
        assert report["ran_as"] == "10001:10001"
