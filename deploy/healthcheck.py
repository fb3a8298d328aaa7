#!/usr/bin/env python3
"""The serving images' HEALTHCHECK: exit 0 when the server in this container is ready.

It asks the port the server really listens on, found as `lightship serve` finds it: `--port N`
or `--port=N` on the container's command line, else LIGHTSHIP_PORT, else 8000. The command line
is PID 1's: `docker run IMAGE --port 9000` appends to the ENTRYPOINT, and under `docker run
--init` PID 1 is the init, whose arguments hold lightship's. The images install this file as
`lightship-healthcheck` in their virtualenv; only the standard library is used.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

CMDLINE = Path("/proc/1/cmdline")
DEFAULT_PORT = "8000"  # lightship.serve.settings.ServeSettings.port


def server_port(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """The port a server started with ARGV and ENV listens on (the last --port wins, as in
    click)."""
    port = None
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            port = argv[i + 1]
        elif arg.startswith("--port="):
            port = arg.partition("=")[2]
    return port or env.get("LIGHTSHIP_PORT") or DEFAULT_PORT


def container_argv() -> list[str]:
    try:
        return CMDLINE.read_bytes().decode(errors="replace").split("\0")
    except OSError:  # not Linux, or /proc hidden: the environment still tells
        return []


def main() -> int:
    url = f"http://127.0.0.1:{server_port(container_argv(), os.environ)}/v2/health/ready"
    try:
        with urllib.request.urlopen(url, timeout=2):
            return 0
    except (OSError, ValueError) as exc:  # refused, 503 while starting or draining, a bad port
        print(f"not ready: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
