"""The `lightship` command's entry point: SIGTERM and SIGINT stop it from its first line.

As PID 1 of a container (the images have no init), a process drops every signal it has no
handler for: a server stopped while it started (a rollout superseded, a scale-down) ignored
SIGTERM until it was serving, and Kubernetes waited out the grace period to kill it. Importing
the CLI takes a quarter of a second on two idle cores (seconds under a CPU limit); this module
imports nothing that slow before it installs the handlers, and `cli.main` replaces them.
"""

from __future__ import annotations

import os
import signal
from types import FrameType


def _stop_now(signum: int, frame: FrameType | None) -> None:
    """Nothing is written yet: end at once, as the default action would (128 + signal)."""
    os._exit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _stop_now)
    signal.signal(signal.SIGINT, _stop_now)
    from lightship.cli import main as cli_main

    cli_main()
