"""The process `run_cli` forks its `python -m lightship` processes from.

A fresh interpreter spends about 3 s of a 4 s refused command importing torch and Lightning;
this one imports them once and forks a child per command. The child is a process of its own,
like the one `subprocess.run` starts: its own working directory, environment, stdin
(/dev/null), stdout and stderr (files) and exit code, and the interpreter's usual exit. It runs
`lightship` as `python -m lightship` would, with sys.path[0] its working directory. What this
process imported is imported in the child, so `run_cli` starts a fresh interpreter where that
shows: an environment variable read at import time other than PYTHONPATH (the child puts its
folders on sys.path), or a test that asks for one (lightship imported from another folder).

Protocol, one line each way per command: a JSON request {"argv", "cwd", "env", "out", "err"}
on stdin; "pid N" once the child is forked, then "exit CODE" (a signal: minus its number).
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import os
import runpy
import sys
from typing import Any, NoReturn


def _child(request: dict[str, Any]) -> NoReturn:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # what `python -m` puts first, then PYTHONPATH's folders (made absolute, as `site` does)
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:1] = [os.getcwd(), *extra]
    importlib.invalidate_caches()  # modules written since this process started
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115  (this process's stdin was the requests)
    sys.argv = ["lightship", *request["argv"]]
    try:
        runpy.run_module("lightship", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:  # how `python -m lightship` ends
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # The interpreter's exit without its C++ teardown: a thread pool torch started here
    # before the fork waits there for threads the child does not have, for good.
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    # what every stage imports: the cost paid here once
    import pytorch_lightning  # noqa: F401
    import torch  # noqa: F401

    import lightship.cli
    import lightship.export.core
    import lightship.quantize.core
    import lightship.report.core
    import lightship.serve.command
    import lightship.train.fit  # noqa: F401

    reply = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        reply.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(f"pid {pid}", file=reply, flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(status)}", file=reply, flush=True)


if __name__ == "__main__":
    main()
