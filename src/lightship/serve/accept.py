"""Accepting connections: every one waiting at each turn of the event loop, not one a turn.

libuv, under uvloop, accepts one connection a turn of the loop (libuv#3696) and counts on the
listening socket staying readable for the next. A turn of a server under load takes tens of
milliseconds (a few hundred requests read and answered), so a burst of new connections drained
at 20 a second: with 256 wrk connections answered 429, the kernel's accept queue held 215 and
took 10 s to empty, and a probe on a new connection (as the kubelet's are) waited 5-9 s for an
answer the server then made in 0.1 ms. `Acceptor` takes every waiting connection when the
socket is readable, as asyncio's own loop does, and hands each to the loop as an accepted
socket (`loop.connect_accepted_socket`, TCP_NODELAY set as for any uvloop transport).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# The kernel refused a new file or buffer: accepting again at once would spin on the same
# error, so the socket rests this long, as asyncio's loop does (the connections wait meanwhile).
REST_S = 1.0
RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Acceptor(asyncio.AbstractServer):
    """Serves `protocol_factory` on an already bound `sock`: uvicorn's `Server.servers` entry
    (it calls close() and wait_closed())."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol_factory: Callable[[], asyncio.Protocol],
        backlog: int,
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._factory = protocol_factory
        self._backlog = backlog
        self._tasks: set[asyncio.Task[Any]] = set()
        self._serving = False
        sock.listen(backlog)
        sock.setblocking(False)
        self._resume()

    def _resume(self) -> None:
        if self._sock.fileno() >= 0:  # not closed while it rested
            self._loop.add_reader(self._sock.fileno(), self._accept)
            self._serving = True

    def _accept(self) -> None:
        for _ in range(self._backlog):  # at most the queue's length a turn, as asyncio
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return  # none left
            except ConnectionAbortedError:
                continue  # reset by its client while it waited
            except OSError as exc:
                if exc.errno not in RESOURCES:
                    raise
                log.error(
                    "cannot accept a connection (%s): resting %g s; raise the open-file limit "
                    "(`ulimit -n`) if this repeats",
                    exc.strerror,
                    REST_S,
                )
                self._loop.remove_reader(self._sock.fileno())
                self._serving = False
                self._loop.call_later(REST_S, self._resume)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._connect(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError as exc:  # gone before its transport was made
            log.debug("accepted connection lost at once: %s", exc)
            conn.close()

    # -- asyncio.AbstractServer ------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting; connections already made stay open (the server drains them)."""
        if self._sock.fileno() >= 0:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
        self._serving = False

    async def wait_closed(self) -> None:
        if self._tasks:  # connections accepted, their transports not made yet
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._serving

    async def start_serving(self) -> None:
        """Serving from the start."""

    async def serve_forever(self) -> None:
        raise NotImplementedError("run by uvicorn's server, which owns the loop")

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return (self._sock,) if self._sock.fileno() >= 0 else ()
