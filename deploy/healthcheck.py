#!/usr/bin/env python3
"""The serving images' HEALTHCHECK: exit 0 when the server in this container is ready.

It asks the address and port the server really listens on, found as `lightship serve` finds
them: `--port N` or `--port=N` on the container's command line, else LIGHTSHIP_PORT, else 8000
(`--host`, LIGHTSHIP_HOST likewise; loopback for 0.0.0.0). The command line
is PID 1's: `docker run IMAGE --port 9000` appends to the ENTRYPOINT, and under `docker run
--init` PID 1 is the init, whose arguments hold lightship's. The images install this file as
`lightship-healthcheck` in their virtualenv; only the standard library is used.
"""

from __future__ import annotations

import http.client
import os
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

CMDLINE = Path("/proc/1/cmdline")
DEFAULT_PORT = "8000"  # lightship.serve.settings.ServeSettings.port


def _option(argv: Sequence[str], name: str) -> str | None:
    """The value of `--NAME V` or `--NAME=V` on the command line (the last wins, as in click)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(f"--{name}="):
            value = arg.partition("=")[2]
    return value


def server_port(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """The port a server started with ARGV and ENV listens on. A blank LIGHTSHIP_PORT, and
    the tcp://IP:PORT that Kubernetes sets for a Service named lightship, are not read by the
    server (`lightship.serve.settings.unread_variables`): nor here."""
    given = env.get("LIGHTSHIP_PORT", "").strip()
    if "://" in given:
        given = ""
    return _option(argv, "port") or given or DEFAULT_PORT


def server_host(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """Where to ask a server started with ARGV and ENV: the address it listens on, loopback
    for all of them (0.0.0.0, ::). A server given one address (LIGHTSHIP_HOST=10.0.0.5) was
    asked at 127.0.0.1, where nothing listened, and called unhealthy."""
    host = _option(argv, "host") or env.get("LIGHTSHIP_HOST", "").strip() or "127.0.0.1"
    if host == "0.0.0.0":
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def container_argv() -> list[str]:
    try:
        return CMDLINE.read_bytes().decode(errors="replace").split("\0")
    except OSError:  # not Linux, or /proc hidden: the environment still tells
        return []


def main() -> int:
    argv = container_argv()
    url = f"http://{server_host(argv, os.environ)}:{server_port(argv, os.environ)}/v2/health/ready"
    try:
        with urllib.request.urlopen(url, timeout=2):
            return 0
    # refused, 503 while starting or draining, a port that is no number (InvalidURL)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        print(f"not ready: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
