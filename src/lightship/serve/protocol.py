"""The server's HTTP/1.1 protocol: uvicorn's (httptools), answering the tensor routes itself.

uvicorn makes every request an ASGI scope, a task that runs the app through each of its
middleware layers (uvicorn's proxy headers, Starlette's and FastAPI's error, telemetry and body
limit layers, lightship's metrics and body limit), and a message for each piece of body and
answer. For a small model that machinery cost more than everything else its request does: the
digits model's binary requests spent ~85 µs of the event loop each with no model at all (the
benchmark's same-path endpoint), where the same decoding and encoding take ~10. So POST to a
tensor route (V2 infer, /v1/predict) is answered here, without ASGI (`_TensorCycle`), by the
same `TensorRoutes` object that the ASGI app answers them with (`app.py`): the same handlers,
body limit, deadlines, error table and metrics. Every other request, and any request this
protocol does not answer itself, goes to uvicorn's ASGI cycle as before.

Beyond that, seven things that uvicorn's protocol does not do: a request it cannot parse, or
whose head breaks a rule of RFC 9112 that llhttp does not enforce (`_head_refusal`), is
answered with a JSON body, a request head over MAX_HEAD_BYTES is refused, and one that has not
arrived whole by the server's request deadline is answered 408 (`_head_late`), what is written
during one turn of the event loop leaves in one write (`_CoalescingTransport`), a
connection closed while the client is still sending its request lingers until the client has
read the answer (`LightshipProtocol._close`), a request asking to upgrade to another
protocol than a WebSocket (`curl --http2` asks for h2c) is answered over HTTP/1.1 with its
body (`LightshipProtocol._ignore_upgrade`), and a WebSocket handshake is refused in JSON (the
server has no WebSocket routes; uvicorn's WebSocket protocol answered a GET with a bare 403).
And the connection is still read while a request waits behind another (`_HeldFlow`), so that a
client leaving is seen leaving.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect

from lightship.serve.batcher import ClientGone
from lightship.serve.metrics import ARRIVED, CLIENT_CLOSED, LEFT, REFUSED
from lightship.serve.v2 import HEADER_LENGTH, error_body

if TYPE_CHECKING:
    from lightship.serve.app import Abandonable, Head, TensorRoutes

log = logging.getLogger(__name__)

# A request's URL and headers together; more is answered 431 (uvicorn's h11 protocol: 16 KiB)
MAX_HEAD_BYTES = 64 * 1024
# How long a request's head may take to arrive when the server has no deadline of its own to
# give it (no tensor routes); with them, the server's request deadline (--timeout-ms)
HEAD_TIMEOUT_S = 10.0
# A timer that would close a connection or refuse its request acts this long after it comes
# due (`_LookFirst`, `LightshipProtocol.timeout_keep_alive_handler`): after the event loop
# stalls, uvloop runs the timers that came due before it reads the sockets, and a request
# waiting in the kernel's buffer met a timer that took it for never sent
LOOK_S = 0.001
# How long a connection closed before its request arrived whole (a 413 by its length, a body
# still arriving at its deadline, a 431 or a head that does not parse) reads and discards what
# the client still sends, so that the client reads the answer (`LightshipProtocol._close`).
LINGER_S = 5.0
# On SIGTERM, how long a kept-alive connection with no request under way stays open for one:
# closed at once, a request the client had sent already (or sent as it closed) met a reset and
# no answer (6 of 10 runs of 16 pooled clients lost up to 11). One that comes is answered with
# `Connection: close`, as is every request under way, and its client reconnects elsewhere.
DRAIN_IDLE_S = 0.5
# The answer to a request that met a bug: JSON, as tritonclient reads every error.
BUG = "internal server error (a bug: see the server's log)"
# While the parser is held back (a request pipelined behind one not yet answered, an ASGI body
# not yet taken), what arrives is kept up to this many bytes before the socket itself is paused
# (`_HeldFlow`): uvicorn's own high-water mark for a body.
READ_AHEAD_BYTES = 64 * 1024
# Requests read and waiting behind the one being answered, on one connection: the next is
# refused (429, after the answers ahead of it) and the connection closed. llhttp parses every
# request of a read, and a client pipelining without reading queued 182,000 (560 MiB) in 3 s
# (uvicorn's own protocol: 218,000); gone, it left the server hundreds of thousands to drop in
# one turn of the loop (3.9 s).
MAX_PIPELINED = 128
# Scope key: BodyLimit's call that answers a body still arriving once the server is stopping
STOP_BODY = "lightship.stop_body"
# In the scope of an ASGI request whose body the drain stopped before BodyLimit began: whether
# the body is still arriving, when BodyLimit begins
BODY_STOPPED = "lightship.body_stopped"
# A tensor route's query string, among its path parameters (a key no path parameter has)
QUERY = "?"
# How long an answer may wait for its client to read what was written before it (the socket's
# buffers full): past it the connection is dropped (`write_timeout`). Waited for without end,
# a client that never read held its connection and the answers queued on it (50 connections
# pipelining 128 requests each: 720 MB), as nginx's send_timeout (60 s) prevents.
WRITE_TIMEOUT_S = 30.0


def _answering(cycle: Any) -> bool:
    """Whether `cycle`'s answer has begun (its head written) or is done: a `_TensorCycle`
    writes its answer whole; uvicorn's cycle says `response_started` at its head."""
    return bool(cycle.response_complete or getattr(cycle, "response_started", False))


class _LookFirst:
    """A timer whose callback runs LOOK_S after it comes due: a turn of the loop later, once
    the loop has read its sockets, so that what arrived in time is read before it is judged
    missing. One handle to cancel, whichever of the two is pending."""

    __slots__ = ("_handle",)

    def __init__(
        self, loop: asyncio.AbstractEventLoop, when: float, callback: Callable[[], None]
    ) -> None:
        self._handle: asyncio.Handle = loop.call_at(when, self._look, loop, callback)

    def _look(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        self._handle = loop.call_later(LOOK_S, callback)

    def cancel(self) -> None:
        self._handle.cancel()


def body_stop_after_s(drain_s: float) -> float:
    """How long after SIGTERM a body still arriving may take before it is answered 503: what
    is left of uvicorn's drain (`drain_s`, after which it cancels the request unanswered)
    once the answer's lingering close and a second of margin are kept for. A slow upload
    within its allowance (`app.body_allowed_until`) may take minutes; the drain does not."""
    return max(drain_s - LINGER_S - 1.0, 0.0)


# Headers a request may hold once: a repeated line was read as its last (`_head_refusal`)
_ONE_LINE = {b"content-encoding": "Content-Encoding", HEADER_LENGTH.lower().encode(): HEADER_LENGTH}
# llhttp's refusals of a version (HTTP/1.2, 3.0) and of the HTTP/2 preface (`PRI * HTTP/2.0`:
# `curl --http2-prior-knowledge`), answered 505 as the versions it takes and this server does
# not (0.9, 2.0) are; by the version the message names
_VERSION_ERRORS = {
    "Invalid HTTP version": "the request's HTTP version",
    "Pause on PRI/Upgrade": "HTTP/2",
}


class _Refused(Exception):
    """Raised by a parser callback that refused the request: llhttp stops reading, so nothing
    after the head (its body, a request pipelined behind it) is taken as a request."""


def _version_refused(version: str) -> tuple[bytes, str]:
    return (
        b"505 HTTP Version Not Supported",
        f"{version} is not supported, only HTTP/1.1 and 1.0: send HTTP/1.1 (curl: --http1.1)",
    )


class _CoalescingTransport:
    """A transport that joins the writes of one event-loop turn into one `write()`.

    uvicorn writes a response's head and its body with a `write()` each: two system calls and
    two TCP segments, each waking the client, for every answer (strace of a server under wrk:
    8,532 writes for 4,258 requests). Held here until the end of the turn, they leave as one,
    as aiohttp sends a head with the first piece of its body. Measured on the Xeon at 16
    connections, the same wrk cells with and without (4 rounds, medians): digits int8 +2 %
    binary and +3 % JSON requests per second, ResNet-18 int8 +3 % binary (JSON within the
    noise). Nothing waits longer than the current turn, and close() sends what is held first.
    An answer written whole (`write_now`) leaves at once, after what is held. close() is the
    protocol's to decide (`closer`: a lingering close); `close_now` closes at once.
    """

    __slots__ = ("_closer", "_eof", "_loop", "_pending", "_transport", "closed_here")

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        closer: Callable[[], None] | None = None,
    ) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._closer = closer
        self._eof = False  # this side is shut: nothing more is written
        self.closed_here = False  # the server closed the connection (not its client)

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def write_now(self, data: bytes) -> None:
        if self._pending:
            self._pending.append(data)
            self.flush()  # the turn's own flush then finds nothing left
        elif not self.is_closing():
            self._transport.write(data)

    def writelines(self, lines: Iterable[bytes]) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Write what this turn holds now (its end's call finds nothing left)."""
        pending, self._pending = self._pending, []
        if pending and not self.is_closing():  # a closed peer reads nothing more
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def is_closing(self) -> bool:
        return self._eof or self._transport.is_closing()

    def write_eof(self) -> None:
        self.flush()
        self._eof = True
        self._transport.write_eof()

    def close(self) -> None:
        if self._closer is None:
            self.close_now()
        else:
            self.flush()
            self._closer()

    def close_now(self) -> None:
        self.closed_here = True
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self.closed_here = True
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:  # everything else is the transport's own
        return getattr(self._transport, name)


class _NoEvent:
    """uvicorn's protocol sets its cycle's `message_event` when the connection is lost; a
    `_TensorCycle` learns that from `lost()` instead."""

    def set(self) -> None:
        pass


class _TensorCycle:
    """One POST to a tensor route, answered without ASGI.

    It stands where uvicorn's protocol keeps a request's `RequestResponseCycle`, with what the
    protocol reads of one (`response_complete`, `disconnected`, `keep_alive`, `message_event`,
    and `run_asgi`, which uvicorn starts as the request's task: at once, or after the requests
    pipelined before it have been answered). The parser's callbacks hand it the body (`feed`,
    `complete`) and a lost connection (`lost`), which abandons the request in the queue at once.
    """

    __slots__ = (
        "_arrived",
        "_client",
        "_data",
        "_expect_100",
        "_head",
        "_left",
        "_name",
        "_over",
        "_params",
        "_protocol",
        "_routes",
        "_seen",
        "_stopped",
        "_target",
        "_ticket",
        "_version",
        "_waiter",
        "disconnected",
        "keep_alive",
        "more_body",
        "refused",
        "response_complete",
    )
    message_event = _NoEvent()

    def __init__(
        self,
        protocol: Any,  # the LightshipProtocol that read it
        routes: TensorRoutes,
        name: str,
        params: dict[str, str],
        head: Head,
        target: str,  # path and query, for the access log
        version: str,
        keep_alive: bool,
        expect_100: bool,
        client: tuple[str, int] | None = None,  # for the access log: behind a proxy, its client
    ) -> None:
        self._protocol = protocol
        self._client = client
        self._routes = routes
        self._name = name
        self._params = params
        self._head = head
        self._target = target
        self._version = version
        self._expect_100 = expect_100
        # the body so far: the piece it came in whole (not copied), or a bytearray once a
        # second came. Kept as pieces, a body sent in 2-byte chunks took ~20x its size
        # (an object and a list slot a piece): 16 MiB held 300 MB.
        self._data: bytes | bytearray = b""
        self._seen = 0  # body bytes received
        self._over = False  # the body went past the limit
        self._stopped = False  # the server is stopping and cannot wait for the rest of the body
        self._ticket: Abandonable | None = None
        self._waiter: asyncio.Future[None] | None = None  # while run_asgi waits for the body
        self.keep_alive = keep_alive
        self.more_body = True
        self.disconnected = False
        self._left = False  # the connection was lost by its client's leaving (`lost`)
        self.response_complete = False
        self.refused: int | None = None  # the status the protocol answered it with (`_refuse`)
        self._arrived: float | None = None  # read pipelined: when (`metrics.ARRIVED`)

    # -- the parser's callbacks, in data_received -----------------------------------------

    def feed(self, body: bytes) -> None:
        if self.response_complete or self._over:
            return
        self._seen += len(body)
        if self._seen > self._routes.body_limit:
            self._over = True
            self._data = b""
            self._wake()
        elif not (data := self._data):
            self._data = body
        elif isinstance(data, bytearray):
            data += body
        else:
            self._data = bytearray(data)
            self._data += body

    def complete(self) -> None:
        self.more_body = False
        self._wake()

    def lost(self, left: bool = True) -> None:
        """The connection is gone: its client `left` it, or the server closed it."""
        if self.response_complete:
            return
        self.disconnected = True
        self._left = left
        if self._ticket is not None:
            self._ticket.abandon()
        self._wake()

    def stop_body(self) -> None:
        """The server is stopping and its drain cannot wait for the rest of the body: answered
        at once (503, `routes.body_stopped`), not cut off without an answer when the drain ends."""
        if self.more_body and not self.response_complete:
            self._stopped = True
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the request's task -----------------------------------------------------------------

    def watch(self, ticket: Abandonable) -> Callable[[], None]:
        """The request's `Watch`: a lost connection abandons its queued ticket."""
        if self.disconnected:
            ticket.abandon()
        else:
            self._ticket = ticket
        return self._unwatch

    def _unwatch(self) -> None:
        self._ticket = None

    async def run_asgi(self, app: object) -> None:
        """Answer the request (uvicorn's name for its task; no ASGI app is called)."""
        routes, name = self._routes, self._name
        start = self._arrived or time.perf_counter()
        status = 500  # if the task is cancelled (shutdown's timeout): counted as uvicorn's
        try:
            if self._head.too_large:
                response = routes.too_large_by_length()
            else:
                try:
                    body = await self._body()
                    content, headers = await routes.answer(
                        name, self._params, self._head, body, self.watch
                    )
                except Exception as exc:
                    response = routes.error(exc) or routes.bug(exc)
                else:
                    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
                    raw.append((b"content-length", b"%d" % len(content)))
                    status = 200 if await self._send(200, raw, content) else self._undelivered()
                    return
            status = response.status_code
            await self._send(status, response.raw_headers, bytes(response.body))
        finally:
            routes.count(name, self.refused or status, time.perf_counter() - start)

    async def _body(self) -> bytes:
        """The whole body, once it has arrived; the errors BodyLimit raises otherwise."""
        if self.more_body and not (self._over or self.disconnected):
            protocol = self._protocol
            transport = protocol.transport
            if self._expect_100 and not (transport.is_closing() or self._stopped):
                # what the path and headers alone refuse (an unknown model's 404, a bad
                # deadline or encoding) is answered now, not after a 100 and the body it asked
                # for; and closes, the body never read
                try:
                    self._routes.check_head(self._name, self._params, self._head)
                except Exception:
                    self.keep_alive = False
                    raise
                transport.write_now(b"HTTP/1.1 100 Continue\r\n\r\n")  # not before a 503
            loop = protocol.loop
            # BodyLimit's deadline, counted from the head's arrival in the loop's clock, and
            # past it the body's allowance (`body_allowed_until`)
            clock = loop.time() - time.monotonic()
            deadline = clock + self._head.deadline
            looked = False
            while self.more_body and not (self._over or self.disconnected):
                if self._stopped:
                    raise self._routes.body_stopped(self._seen)
                self._waiter = loop.create_future()
                try:
                    async with asyncio.timeout_at(deadline):
                        await self._waiter
                except TimeoutError:
                    later = clock + self._routes.body_allowed_until(self._head, self._seen)
                    if later > loop.time():
                        deadline = later
                    elif not looked:
                        # One turn of the loop first, to read what came in time: after a
                        # stall (a 2-core machine under overload) uvloop runs its due timers
                        # before it reads the sockets, and a body that had arrived in the
                        # kernel's buffer was answered 408, "0 bytes arrived"
                        looked = True
                        await asyncio.sleep(0)
                    else:
                        raise self._routes.body_timeout(self._head, self._seen) from None
                finally:
                    self._waiter = None
            if not (self._over or self.disconnected):
                self._routes.body_arrived(self._head)
        if self.disconnected:
            if self.refused is not None:  # the server refused the body (a malformed chunk) and
                raise ClientGone()  # closed: counted as refused, not as a client that left
            if self.more_body or not self._left:  # cut short: a 499, `disconnected`, as uvicorn's
                raise ClientDisconnect()  # way in counts it
            # whole, and waiting to be parsed (pipelined behind another) when its client left
            self._routes.metrics.rejected("disconnected")
            raise ClientGone()
        if self._over:
            raise self._routes.too_large(whole=not self.more_body)
        # handed over, not kept: the answered cycle stays the connection's until its next
        # request, and a pooled client's idle connection held its last body (up to the body
        # limit) for the keep-alive's seconds
        data, self._data = self._data, b""
        return bytes(data) if isinstance(data, bytearray) else data

    def _undelivered(self) -> int:
        """The status to count for an answer made and not written: 499 and `disconnected` where
        the client left (its batch ran, or the answer was made, after it went), as where the
        client's leaving was seen first; the answer's own where the server closed."""
        # the connection lost (uvicorn closes it after, setting `closed_here`), or only closing
        protocol = self._protocol
        left = (
            self._left
            if self.disconnected
            else (not protocol.transport.closed_here or protocol._dropped)
        )
        if not left:
            return 200
        self._routes.metrics.rejected("disconnected")
        return CLIENT_CLOSED

    async def _send(self, status: int, headers: list[tuple[bytes, bytes]], content: bytes) -> bool:
        """Write the answer; False where the connection went first and nobody reads it."""
        protocol = self._protocol
        if protocol.flow.write_paused and not self.disconnected:
            await protocol.flow.drain()  # a client that reads slowly: as uvicorn waits
        transport = protocol.transport
        if self.disconnected or transport.is_closing():
            self.response_complete = True
            return False
        close = not self.keep_alive
        parts = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status]
        for key, value in (*protocol.server_state.default_headers, *headers):
            if key == b"connection" and value.lower() == b"close":
                close = True
                continue
            parts += (key, b": ", value, b"\r\n")
        if close:
            parts.append(b"connection: close\r\n")
        parts += (b"\r\n", content)
        transport.write_now(b"".join(parts))
        self.response_complete = True
        if protocol.access_log:
            client = self._client
            # uvicorn's own five arguments: its AccessFormatter unpacks them by position
            protocol.access_logger.info(
                '%s - "%s %s HTTP/%s" %d',
                f"{client[0]}:{client[1]}" if client else "",
                "POST",
                self._target,
                self._version,
                status,
            )
        if close:
            self.keep_alive = False
            transport.close()
        protocol.on_response_complete()
        return True


# Status lines by code; 499 (nginx's, a client that left) is only ever counted, never sent.
_STATUS_LINES = {
    status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode("latin-1"))
    for status in HTTPStatus
}


@functools.cache
def _trusted_hosts(allowed: str | tuple[str, ...]) -> Any:
    from uvicorn.middleware.proxy_headers import _TrustedHosts

    return _TrustedHosts(list(allowed) if isinstance(allowed, tuple) else allowed)


def forwarded_client(
    client: tuple[str, int], headers: list[tuple[bytes, bytes]], allowed: str | list[str]
) -> tuple[str, int]:
    """The client the access log names, as uvicorn's proxy-headers middleware (which only ASGI
    requests pass) names it: from X-Forwarded-For when the connection comes from a trusted
    proxy (`--forwarded-allow-ips`, FORWARDED_ALLOW_IPS; uvicorn's default 127.0.0.1)."""
    trusted = _trusted_hosts(tuple(allowed) if isinstance(allowed, list) else allowed)
    if client[0] not in trusted:
        return client
    forwarded = [value for name, value in headers if name == b"x-forwarded-for"]
    if not forwarded:
        return client
    host, port = trusted.get_trusted_client_address(b", ".join(forwarded).decode("latin1"))
    return (host, port) if host else client


def http_protocol(routes: TensorRoutes | None = None) -> Any:
    """uvicorn's HTTP protocol (httptools) as this module describes it; `routes` are answered
    without ASGI. "auto" (uvicorn's h11 protocol, all through ASGI) without httptools."""
    try:
        import httptools
        from uvicorn.protocols.http.flow_control import FlowControl
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: uvicorn's h11 protocol and its text answers
        return "auto"

    head_timeout_s = routes.timeout_s if routes is not None else HEAD_TIMEOUT_S

    class _HeldFlow(FlowControl):
        """uvicorn's flow control, but pausing holds back the parser, not the socket: what
        arrives meanwhile is kept (`LightshipProtocol._hold`) and parsed once reading resumes,
        and only past READ_AHEAD_BYTES kept is the socket paused too. uvicorn pauses the socket
        while a request pipelined behind another waits its turn, and then did not see the
        client leave (its EOF unread): the first was computed for nobody and counted 200."""

        def __init__(self, transport: Any, protocol: Any) -> None:
            super().__init__(transport)
            self._protocol = protocol
            self.socket_paused = False

        def pause_reading(self) -> None:
            self.read_paused = True

        def resume_reading(self) -> None:
            if self.read_paused:
                self.read_paused = False
                self.resume_socket()
                self._protocol.release()

        def pause_socket(self) -> None:
            if not self.socket_paused:
                self.socket_paused = True
                self._transport.pause_reading()

        def resume_socket(self) -> None:
            if self.socket_paused:
                self.socket_paused = False
                self._transport.resume_reading()

        async def drain(self) -> None:
            """Until the client has read enough of what was written, WRITE_TIMEOUT_S at most:
            then the connection is dropped (what writes after finds it closing), unless a
            turn of the loop later (LOOK_S) it has: read as the loop stalled, in time."""
            protocol = self._protocol
            limit = WRITE_TIMEOUT_S
            if (at := protocol._writes_end_at) is not None:  # the server is stopping
                limit = min(limit, max(at - protocol.loop.time(), 0.0))
            try:
                async with asyncio.timeout(limit):
                    await super().drain()
            except TimeoutError:
                await asyncio.sleep(LOOK_S)
                if self.write_paused:
                    protocol.stalled()

    class LightshipProtocol(HttpToolsProtocol):
        flow: _HeldFlow
        # Bytes received since the last request's head ended: its URL and headers so far
        _head_bytes = 0
        _in_head = True
        _broken = False  # a head refused (431) or that did not parse (400): no request to read
        _linger: asyncio.TimerHandle | None = None  # closing: reading what still comes
        # Body bytes still to come of a request whose Upgrade (h2c, ...) is ignored: llhttp
        # hands everything after such a head to the new protocol, so they are read here
        _upgrade_body: int | None = None
        # Armed while a request's head is incomplete: uvicorn's keep-alive timer stops at the
        # first byte, so a head that never ends held its connection open for good
        _head_timer: _LookFirst | None = None
        # The answer to a request that could not be read, while those ahead of it are running
        _deferred_error: tuple[bytes, str] | None = None
        # Armed when a request answered before its body arrived (a 404, a GET with a body)
        # gets more of it: the body must end in time. uvicorn's keep-alive timer stops at
        # every read, and a client trickling a byte now and then held the connection for good
        _body_timer: _LookFirst | None = None
        # The request read before the one in `cycle`: answered last before it, where that one
        # is taken out of the pipeline (`_refuse`)
        _before: Any = None
        # The server is stopping (`shutdown`): every request is answered with Connection:
        # close; an idle connection closes after DRAIN_IDLE_S with no request (`_drain_timer`)
        _draining = False
        _stop_marked: Any = None  # the request the server marked to close with (`mark_closing`)
        _marked_after_head = False  # whose answer had begun when it was marked
        _handed_over = 0  # marks taken back for a request read after (`_take_back_close`)
        _drain_timer: _LookFirst | None = None
        _body_stop: _LookFirst | None = None  # a body still arriving at SIGTERM
        _stop_bodies_at: float | None = None  # when (loop time) `_body_stop` goes off
        # When (loop time) an answer still waiting for its client to read it is dropped, the
        # server stopping: a second before uvicorn's drain would cancel it, with a traceback
        _writes_end_at: float | None = None
        # Read while the parser is held back (`_HeldFlow`), parsed when it is let go
        # (`_feed_held`, scheduled as `_feeding`)
        _held: bytearray | None = None
        _feeding: asyncio.Handle | None = None
        # The cycle whose task was started last: those pipelined behind it wait in `pipeline`,
        # and a lost connection tells each of them (uvicorn told only the last one read)
        _running: Any = None
        _dropped = False  # by the server, its client reading none of its answers (`stalled`)

        def connection_made(self, transport: Any) -> None:
            # the protocol's own loop; every close() of the transport, uvicorn's too, is _close
            self._out = _CoalescingTransport(transport, self.loop, self._close)
            super().connection_made(self._out)  # type: ignore[arg-type]
            self.flow = _HeldFlow(self._out, self)
            # Idle until its first byte, as a connection between requests is: closed at the
            # keep-alive timeout, or the request deadline where that is longer. uvicorn arms
            # nothing, and a connection that never sent a byte was held for good; closed at a
            # short deadline (1.5 s), one of 48 client threads sharing 2 cores with the server
            # wrote its request to a closed connection
            self.timeout_keep_alive_task = self.loop.call_later(
                max(self.timeout_keep_alive, head_timeout_s), self.timeout_keep_alive_handler
            )

        def timeout_keep_alive_handler(self) -> None:
            """The keep-alive timer, whoever armed it (uvicorn does after every answer): its
            close of an idle connection LOOK_S later, for a request that came as the loop
            stalled, as `_LookFirst` does for the protocol's own timers."""
            self.timeout_keep_alive_task = self.loop.call_later(
                LOOK_S, HttpToolsProtocol.timeout_keep_alive_handler, self
            )

        def mark_closing(self, cycle: Any) -> None:
            """The server stops: `cycle`, the last request read, is answered with Connection:
            close. Remembered as the server's mark, which `_take_back_close` passes on; a
            client's own close is not the server's to take back."""
            if cycle.keep_alive:
                cycle.keep_alive = False
                self._stop_marked = cycle
                # its head gone out already (a streamed answer), saying keep-alive: the close
                # may be taken back whenever it is, that head said nothing of it
                self._marked_after_head = _answering(cycle)

        def _take_back_close(self) -> bool:
            """The close the server put on the request read last, taken back for what is read
            or answered after it (`_close_with`, a deferred refusal): where its answer has not
            begun, or began before the mark. Not past MAX_PIPELINED hand-overs, nor once the
            drain stops bodies: a client pipelining all through the drain held its connection
            to the end, and its request under way was then cancelled without an answer."""
            marked = self._stop_marked
            if marked is None or (_answering(marked) and not self._marked_after_head):
                return False
            at = self._stop_bodies_at
            if self._handed_over >= MAX_PIPELINED or (at is not None and self.loop.time() >= at):
                return False
            marked.keep_alive = True
            self._stop_marked = None
            self._handed_over += 1
            return True

        def _close_with(self, cycle: Any, previous: Any) -> None:
            """A request read while the server stops takes over the close from `previous`
            (`_take_back_close`). Left, a request pipelined after SIGTERM behind the one the
            signal marked was read, then lost when that one's answer closed the connection."""
            if previous is not None and previous is self._stop_marked:
                self._take_back_close()
            self.mark_closing(cycle)

        @property
        def closing_answers(self) -> bool:
            """Every answer closes its connection: the server got SIGTERM. Its state says so
            at once (`stopping`, set by `app._Server`); `shutdown` comes a grace later."""
            return self._draining or getattr(self.server_state, "stopping", False)

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            self._running = cycle
            HttpToolsProtocol._start_asgi_task(self, cycle, app)

        def _hold(self, data: bytes) -> None:
            held = self._held
            if held is None:
                self._held = held = bytearray(data)
            else:
                held += data
            # Also once let go, until `_feed_held` (which resumes it): uvloop reads a resumed
            # socket before the turn's callbacks, up to 32 reads of 256 KB while data comes
            if len(held) >= READ_AHEAD_BYTES:
                self.flow.pause_socket()

        def release(self) -> None:
            """The parser is let go (`_HeldFlow.resume_reading`): what was kept is parsed in
            the next turn of the loop, as a socket resumed is read then, not inside the answer
            that let it go."""
            if self._held is not None and self._feeding is None:
                self._feeding = self.loop.call_soon(self._feed_held)

        def _feed_held(self) -> None:
            self._feeding = None
            held = self._held
            if held is None or self.flow.read_paused:  # held back again meanwhile
                return
            self._held = None
            if not self.transport.is_closing():
                self.flow.resume_socket()  # whatever paused it, the parser reads on
                self.data_received(bytes(held))

        def _head_late(self) -> None:
            """The head has not arrived whole in time: answered 408."""
            self._head_timer = None
            head_begun = self._in_head and self._head_bytes
            if self._linger is not None or self._out.is_closing() or not head_begun:
                return
            self._refuse(
                "head_timeout",
                b"408 Request Timeout",
                f"request head incomplete after {head_timeout_s:g} s: send the request "
                "line and headers at once",
            )

        def _body_late(self) -> None:
            """The body of a request answered before it arrived is still coming: closed (the
            answer went out; there is no other to give)."""
            self._body_timer = None
            cycle = self.cycle
            if not self._in_head and cycle is not None and cycle.more_body:
                self._out.close_now()

        def on_message_begin(self) -> None:
            # A head whose first bytes came in the read that ended the request before it was
            # not counted there (`data_received`): timed all the same, as any other
            if self._in_head and not self._head_bytes:
                self._head_bytes = 1
            # a request begun: the connection is not idle, whatever armed its keep-alive timer
            # in the same read (a body that came after its answer, `on_message_complete`)
            self._unset_keepalive_if_required()
            HttpToolsProtocol.on_message_begin(self)

        def _close(self) -> None:
            """Close the connection: at once, or, while the client may still be sending the
            request just answered, with a lingering close, as nginx does. A socket closed with
            bytes unread makes the kernel reset the connection, and the client's kernel may
            then drop the answer unread: Python's http.client, which `requests` uses, sends a
            whole 64 MB body before it reads, and got ConnectionResetError instead of the 413.
            So the answer goes out with a FIN, what still comes is read and thrown away, and
            the connection closes when the client closes it, or after LINGER_S. Likewise
            where the client has pipelined more than the answer that closes (requests held
            back unread, a head under way), and whenever the server is stopping: its client
            kept the connection alive and may be sending its next request as it closes."""
            transport = self._out
            if self._linger is not None:
                return  # lingering already: its timer or the client closes it
            cycle = self.cycle
            unread = (
                self._broken
                or (cycle is not None and cycle.more_body)
                or bool(self.pipeline)
                or self._held is not None
                or self.flow.socket_paused
                or (self._in_head and self._head_bytes > 0)
                or self.closing_answers
            )
            if unread and not transport.is_closing():
                try:
                    half_close = transport.can_write_eof()
                except NotImplementedError:  # a transport that cannot: closed at once
                    half_close = False
                if half_close:
                    transport.closed_here = True  # the server closes: it waits for the client
                    transport.write_eof()
                    self._linger = self.loop.call_later(LINGER_S, transport.close_now)
                    self._held = None  # requests the close leaves unanswered: thrown away too
                    self.flow.resume_reading()  # paused for a long body or a pipelined request
                    self.flow.resume_socket()  # or paused by kept bytes not yet fed
                    return
            transport.close_now()

        def shutdown(self) -> None:
            """The server is stopping: a request under way is answered and the connection then
            closed (uvicorn's); an idle one stays open DRAIN_IDLE_S for a request already on
            its way, which is answered likewise (uvicorn closed it at once)."""
            if self._linger is not None:  # the server is stopping: no more patience
                self._out.close_now()
                return
            self._draining = True
            drain_s = self.config.timeout_graceful_shutdown  # None: uvicorn waits for good
            if drain_s is not None:  # bodies arriving are answered before the drain ends
                self._stop_bodies_at = self.loop.time() + body_stop_after_s(drain_s)
                self._writes_end_at = self.loop.time() + max(drain_s - 1.0, 0.0)
                _LookFirst(self.loop, self._writes_end_at, self._stalled_if_unsent)
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                self.mark_closing(cycle)
                self._arm_body_stop()
            elif not (self._in_head and self._head_bytes):  # no head arriving: idle
                self._drain_timer = self._look_first(DRAIN_IDLE_S, self._drain_idle)

        def _arm_body_stop(self) -> None:
            """While draining: a body under way, or one a request read since (a head that was
            arriving, a request on a kept-alive connection) is stopped at `_stop_bodies_at`."""
            at = self._stop_bodies_at
            if at is not None and self._body_stop is None:
                self._body_stop = _LookFirst(self.loop, max(at, self.loop.time()), self._stop_body)

        def _look_first(self, delay: float, callback: Callable[[], None]) -> _LookFirst:
            return _LookFirst(self.loop, self.loop.time() + delay, callback)

        def _stop_body(self) -> None:
            """A body still arriving when the drain stops bodies: answered 503."""
            self._body_stop = None
            cycle = self.cycle
            if cycle is None or not cycle.more_body:  # no body under way: nothing to stop
                return
            if isinstance(cycle, _TensorCycle):
                cycle.stop_body()
            elif callable(stop := cycle.scope.get(STOP_BODY)):
                stop()  # BodyLimit's, through ASGI
            else:  # queued behind another answer, or its first step not run: BodyLimit, not
                # begun, begins stopped if the body is still arriving then (before any 100).
                # Left so, it waited for its body to the drain's end, then was cancelled.
                cycle.scope[BODY_STOPPED] = lambda: cycle.more_body  # type: ignore[literal-required]

        def _drain_idle(self) -> None:
            self._drain_timer = None
            cycle = self.cycle
            idle = cycle is None or cycle.response_complete
            if idle and not (self._in_head and self._head_bytes) and not self._out.is_closing():
                self._out.close_now()

        def data_received(self, data: bytes) -> None:
            if self._linger is not None:
                return  # the rest of a request already answered: thrown away
            if self.flow.read_paused or self._held is not None:  # after what is kept already
                self._hold(data)
                return
            if self._upgrade_body is not None:
                data = self._upgraded_body(data)
                if not data:
                    return
            # httptools sets no limit on a request's head and joins its pieces by copying:
            # a 100 MB header held the event loop for seconds. Counted as it arrives, the
            # head is refused once past MAX_HEAD_BYTES (a chunk that also ends it is fine).
            # empty lines before a request line are ignored (RFC 9112 2.2): no head begun, the
            # connection still idle (its keep-alive timer runs on)
            blank = (
                self._in_head
                and not self._head_bytes
                and data[:1] in (b"\r", b"\n")  # strip() copies a read that ends in CR/LF
                and not data.strip(b"\r\n")
            )
            if self._in_head:
                self._head_bytes += 0 if blank else len(data)
            if not blank:
                self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
                if self._in_head and self._head_bytes and self._head_timer is None:
                    self._head_timer = self._look_first(head_timeout_s, self._head_late)
                cycle = self.cycle
                if (
                    not self._in_head
                    and self._body_timer is None
                    and cycle is not None
                    and cycle.response_complete
                    and cycle.more_body
                ):
                    self._body_timer = self._look_first(head_timeout_s, self._body_late)
            except httptools.HttpParserError as exc:
                if self._broken:  # refused at its head (`_Refused`)
                    return
                if (version := _VERSION_ERRORS.get(str(exc))) is not None:
                    self._refuse("bad_http", *_version_refused(version))
                    return
                if isinstance(exc, httptools.HttpParserCallbackError):  # ours raised: a bug
                    log.error("error in a callback of the HTTP parser", exc_info=exc.__context__)
                    self._send_error(b"500 Internal Server Error", BUG)
                    return
                # llhttp's reason ("Invalid header value char"), where uvicorn logged and
                # answered "Invalid HTTP request received." without saying from whom or why
                reason = str(exc) or "Invalid HTTP request received"
                host, port = self.client or ("an unknown client", None)
                self.logger.warning(
                    "malformed HTTP request from %s%s: %s (answered 400 and closed)",
                    host,
                    "" if port is None else f":{port}",
                    reason,
                )
                self.send_400_response(reason)
                return
            except httptools.HttpParserUpgrade as exc:
                if self._broken:  # refused at its head: a WebSocket's, say
                    return
                # an Upgrade ignored: llhttp stops after the head, and what follows is the
                # body, then HTTP again
                self.parser = httptools.HttpRequestParser(self)
                if self._upgrade_body == 0:  # no body: llhttp has ended the request
                    self._upgrade_body = None
                if rest := data[exc.args[0] :]:
                    self.data_received(rest)
                return
            over = self._in_head and self._head_bytes > MAX_HEAD_BYTES
            if over and not self.transport.is_closing():
                self._refuse_head_too_large()

        def _refuse_head_too_large(self) -> None:
            self._refuse(
                "head_too_large",
                b"431 Request Header Fields Too Large",
                f"request URL and headers over {MAX_HEAD_BYTES} bytes: send them shorter",
            )

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes = False, 0
            # a head that came in one read is counted here (`data_received` counts one that
            # spans reads): a 70 KB URL was a 500, "a bug", from uvicorn's URL parser
            size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
            if size > MAX_HEAD_BYTES:
                self._refuse_head_too_large()
                raise _Refused
            self._before = self.cycle
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            parser = self.parser
            version = parser.get_http_version()
            refusal = self._head_refusal(version)
            if refusal is not None:
                self._refuse("bad_http", *refusal)
                raise _Refused
            if len(self.pipeline) >= MAX_PIPELINED:
                self._refuse(
                    "pipeline_full",
                    b"429 Too Many Requests",
                    f"more than {MAX_PIPELINED} requests pipelined on one connection, their "
                    "answers unread: read answers before sending more (this request and those "
                    "after it were not read: send them again)",
                )
                raise _Refused
            if version == "1.0":  # RFC 9110 10.1.1: no 100 (Continue) to an HTTP/1.0 client
                self.expect_100_continue = False
            if parser.should_upgrade():
                if not self._should_upgrade():
                    self._ignore_upgrade()
                elif parser.get_method() != b"GET":  # uvicorn's WebSocket never answered
                    self._refuse(
                        "bad_http",
                        b"400 Bad Request",
                        "a WebSocket handshake is a GET (RFC 6455 4.1), and this server has no "
                        "WebSocket routes: send the request without Upgrade",
                    )
                else:  # uvicorn's WebSocket answered a bare 403 (RFC 6455 4.2.2's example)
                    self._refuse(
                        "bad_http",
                        b"403 Forbidden",
                        "this server has no WebSocket routes: send the request without Upgrade, "
                        "as plain HTTP",
                    )
                if self._broken:
                    return
            previous = self.cycle
            try:
                if routes is None or not self._answer_here(version):
                    HttpToolsProtocol.on_headers_complete(self)
                    queued = self.pipeline and self.pipeline[0][0] is self.cycle
                    if queued:  # its task starts at its turn: its latency counts from now
                        self.cycle.scope[ARRIVED] = time.perf_counter()  # type: ignore[literal-required]
            except httptools.HttpParserInvalidURLError:
                # a target llhttp takes and the URL parser does not (`http://x:99999/v2`, a
                # CONNECT's `host:443`) was a 500, "a bug", before a cycle was made for it
                said = self.url[:200].decode("latin-1")
                self._refuse(
                    "bad_http",
                    b"400 Bad Request",
                    f"malformed request target {said!r}: send a path, such as /v2/health/ready",
                )
                raise _Refused from None
            if self.closing_answers and self.cycle not in (None, previous):
                self._close_with(self.cycle, previous)  # answered, then closed
            if self._draining:  # a request read while the server stops: its body too
                self._arm_body_stop()

        def _head_refusal(self, version: str) -> tuple[bytes, str] | None:
            """The status line and message that refuse a head llhttp has taken, if RFC 9112
            does not let it be answered: a version but 1.1 and 1.0 (505), Host missing from an
            HTTP/1.1 request or repeated (3.2: 400), a Transfer-Encoding but chunked alone
            (6.1: 501 when chunked ends it, 6.3: 400 when not), and a repeated header that
            is read once (`_ONE_LINE`: 400). One pass over the headers."""
            if version != "1.1" and version != "1.0":  # llhttp takes HTTP/0.9 and HTTP/2.0
                return _version_refused(f"HTTP/{version}")
            hosts = 0
            codings = None
            once: list[bytes] = []
            for name, value in self.headers:
                if name == b"host":
                    hosts += 1
                elif name in _ONE_LINE:
                    once.append(name)
                elif name == b"transfer-encoding":
                    codings = value if codings is None else codings + b", " + value
            if hosts > 1:
                return b"400 Bad Request", f"{hosts} Host headers (RFC 9112 3.2): send one"
            if hosts == 0 and version == "1.1":
                return b"400 Bad Request", (
                    "no Host header, which an HTTP/1.1 request needs (RFC 9112 3.2): send one "
                    "naming the server and its port, as HTTP clients do"
                )
            if codings is not None:
                listed = [c for c in (c.strip(b" \t").lower() for c in codings.split(b",")) if c]
                if listed != [b"chunked"]:
                    said = codings.decode("latin-1")
                    if listed[-1:] != [b"chunked"]:
                        return b"400 Bad Request", (
                            f"Transfer-Encoding {said!r} does not end with chunked, so the "
                            "body has no known length (RFC 9112 6.3): send it with a "
                            "Content-Length, or chunked"
                        )
                    return b"501 Not Implemented", (
                        f"Transfer-Encoding {said!r} is not supported, only chunked alone: "
                        "send the body with a Content-Length, or chunked (compressed: "
                        "Content-Encoding gzip)"
                    )
            if len(once) > 1:
                for name, said in _ONE_LINE.items():
                    if (count := once.count(name)) > 1:
                        return b"400 Bad Request", f"{count} {said} headers: send one"
            return None

        def _ignore_upgrade(self) -> None:
            """A request asking for another protocol than a WebSocket (curl --http2 sends
            `Upgrade: h2c`) is answered over HTTP/1.1, as RFC 9110 7.8 lets a server do. llhttp
            reads no body after such a head: its Content-Length is read here
            (`_upgraded_body`). uvicorn lost the body, answered the request as empty and read
            a body sent later as the next request."""
            length, chunked = 0, False
            for name, value in self.headers:
                if name == b"content-length":
                    value = value.strip(b" \t")
                    length = int(value) if value.isdigit() else -1
                elif name == b"transfer-encoding":
                    chunked = True
            if chunked or length < 0:
                self._refuse(
                    "bad_http",
                    b"400 Bad Request",
                    "a request with Upgrade and a chunked body is not taken: send it with a "
                    "Content-Length, or without Upgrade (curl: --http1.1)",
                )
                return
            self._upgrade_body = length

        def _upgraded_body(self, data: bytes) -> bytes:
            """Hand the body of a request whose Upgrade is ignored to its cycle, end the
            request when it is whole; what comes after it, a request pipelined behind."""
            left = self._upgrade_body
            assert left  # > 0: a request without a body ended at its head
            body, data = data[:left], data[left:]
            self._upgrade_body = left = left - len(body)
            self.on_body(body)
            if left == 0:
                self._upgrade_body = None
                self.on_message_complete()
            return data

        def _answer_here(self, version: str) -> bool:
            """Start (or queue behind a pipelined one) a `_TensorCycle` for a POST to a
            tensor route; False for any other request, which goes to ASGI."""
            assert routes is not None
            parser = self.parser
            if (
                parser.get_method() != b"POST"
                or self.limit_concurrency is not None  # uvicorn's 503 for it: not set here
                or (routes.cors and any(k == b"origin" for k, _ in self.headers))
            ):
                return False
            url = httptools.parse_url(self.url)
            raw_path = url.path
            if b"%" in raw_path or not raw_path.isascii():  # uvicorn decodes those paths
                return False
            path = raw_path.decode("ascii")
            if (matched := routes.route(path)) is None:
                return False
            name, params = matched
            target = path
            if url.query:
                query = url.query.decode("latin-1")
                target, params = f"{path}?{query}", {**params, QUERY: query}
            client = self.client
            if self.access_log and client and self.config.proxy_headers:
                client = forwarded_client(client, self.headers, self.config.forwarded_allow_ips)
            cycle = _TensorCycle(
                self,
                routes,
                name,
                params,
                head=routes.read_head(self.headers),
                target=target,
                version=version,
                keep_alive=version != "1.0" and parser.should_keep_alive(),  # `_close_with`
                expect_100=self.expect_100_continue,
                client=client,
            )
            previous, self.cycle = self.cycle, cycle  # type: ignore[assignment]
            if previous is None or previous.response_complete:
                self._start_asgi_task(cycle, self.app)
            else:  # pipelined: answered in order, as uvicorn queues its own
                cycle._arrived = time.perf_counter()
                self.flow.pause_reading()
                self.pipeline.appendleft((cycle, self.app))  # type: ignore[arg-type]
            return True

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            if type(cycle) is _TensorCycle:
                cycle.feed(body)
            else:
                HttpToolsProtocol.on_body(self, body)

        def on_message_complete(self) -> None:
            if self._upgrade_body:  # llhttp ends it at its head: the body is still to come
                return
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            cycle = self.cycle
            if type(cycle) is _TensorCycle:
                cycle.complete()
            else:
                HttpToolsProtocol.on_message_complete(self)
                if cycle is not None:  # uvicorn leaves it set where the answer came first:
                    cycle.more_body = False  # a later head's 408 read as this body's error
            self._in_head = True
            if (
                cycle is not None
                and cycle.response_complete
                and not self.pipeline
                and self.timeout_keep_alive_task is None
                and not self._out.is_closing()
            ):
                # answered before its body ended (a 404, a 413), the connection is idle now:
                # its keep-alive timer, armed as the answer went and stopped by the body's
                # reads, runs again. Unarmed, 185 such connections left open took every file
                # descriptor, and the server accepted no one.
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )

        def eof_received(self) -> None:
            """The client's FIN, taken as its leaving (uvicorn's protocol returns None: the
            transport closes at once, and `connection_lost` follows a turn later). What was
            written this turn goes first: held for the turn's one write, an answer made before
            the FIN was read (a GET, answered as it was parsed) was dropped unsent, counted 200.
            An ASGI answer the app makes after it is written to no one: its request counts 499,
            as the tensor routes' `_undelivered` counts theirs."""
            self._out.flush()
            if not self._out.closed_here:
                self._mark_left()
            HttpToolsProtocol.eof_received(self)

        def _stalled_if_unsent(self) -> None:
            """The drain about to end, an answer still waits for its client to read it (one
            reading slowly had until now): dropped."""
            if self.flow.write_paused:
                self.stalled()

        def stalled(self) -> None:
            """Its client read none of its answers for WRITE_TIMEOUT_S (or, the server
            stopping, has one unread as the drain nears its end): dropped, `write_timeout`.
            The requests it still held unanswered (the one running, those pipelined behind)
            count 499 and `disconnected`, as where the client itself left: a client that reads
            nothing is gone too, and they were counted nowhere."""
            if not self._out.is_closing():
                if routes is not None:
                    routes.metrics.rejected("write_timeout")
                self._dropped = True
                self._out.abort()

        def _mark_left(self) -> None:
            """uvicorn's request cycles under way (the one running, the last one read), their
            client gone: the metrics middleware reads it in their scope (`LEFT`), since an
            answer the app makes now is written to no one."""
            for cycle in (self._running, self.cycle):
                uvicorns = cycle is not None and type(cycle) is not _TensorCycle
                if uvicorns and not cycle.response_complete:
                    scope: dict[str, Any] = cycle.scope  # type: ignore[assignment]
                    scope[LEFT] = True

        def connection_lost(self, exc: Exception | None) -> None:
            # the client closed it (uvicorn's close follows), or read nothing (`stalled`)
            left = not self._out.closed_here or self._dropped
            if left:
                self._mark_left()
            if self._drain_timer is not None:
                self._drain_timer.cancel()
            if self._body_stop is not None:
                self._body_stop.cancel()
            if self._linger is not None:
                self._linger.cancel()
            if self._head_timer is not None:
                self._head_timer.cancel()
            if self._body_timer is not None:
                self._body_timer.cancel()
            if self._feeding is not None:
                self._feeding.cancel()
            self._held = None
            cycle = self.cycle
            # the request running, where one read after it is the last (uvicorn told only that)
            running = self._running
            if running is not None and running is not cycle and not running.response_complete:
                if type(running) is _TensorCycle:
                    running.lost(left)
                else:  # uvicorn's, as its connection_lost tells the last one
                    running.disconnected = True
                    running.message_event.set()
            if type(cycle) is _TensorCycle:
                cycle.lost(left)
            HttpToolsProtocol.connection_lost(self, exc)
            # Tensor requests pipelined and never started, their client gone: started now, to
            # be counted 499 (at once, without compute), as a request started before its
            # client left is. An ASGI one is not run (a GET /metrics for nobody, thousands at
            # once from one client's write), only counted so. Nor those left when the server
            # closed (an answer with Connection: close): their client did not leave.
            pipeline = self.pipeline
            while pipeline:
                queued, app = pipeline.pop()
                if type(queued) is _TensorCycle and left:
                    queued.lost()
                    self._start_asgi_task(queued, app)
                elif left and routes is not None:
                    routes.count_gone(queued.scope)  # type: ignore[arg-type]

        def send_400_response(self, msg: str) -> None:
            message = f"malformed HTTP request: {msg.rstrip('.')}"
            self._refuse("bad_http", b"400 Bad Request", message)

        def on_response_complete(self) -> None:
            deferred = self._deferred_error
            if deferred is not None and self.cycle.response_complete:  # the last before it
                self.server_state.total_requests += 1
                self._deferred_error = None
                if not self._out.is_closing():  # unless that answer closed the connection
                    self._send_error(*deferred)
            else:
                HttpToolsProtocol.on_response_complete(self)
                if self._in_head and self._head_bytes:
                    # the next request's head is under way: uvicorn's keep-alive timer, for a
                    # connection with nothing to read, closed it mid-head; its own timer
                    # (`_head_late`) stands
                    self._unset_keepalive_if_required()

        def _refuse(self, reason: str, status: bytes, message: str) -> None:
            """Answer a request that cannot be read (`_send_error`), counted in the metrics'
            rejections by `reason`: it has no route to be counted under. Unless the error is
            in the body of the request in flight (a malformed chunk): not yet answered, it
            is counted under its route with this status when its task ends (`REFUSED`), not
            as the 499 (or whatever its route answered into the closed connection) it would
            count; answered already, the connection closes without a second answer."""
            cycle = self.cycle
            queued = bool(self.pipeline) and self.pipeline[0][0] is cycle
            if cycle is not None and cycle.more_body and queued:
                # queued behind a request not answered yet, its body broken (a malformed
                # chunk): it never starts, and is refused as a head that cannot be read is,
                # after the answers ahead of it, not in the place of the first
                self.pipeline.popleft()
                self.cycle = cycle = self._before
            if cycle is not None and cycle.more_body and cycle.response_complete:
                # answered before its body was read (a 404): a second answer would be one to
                # no request; the connection just closes
                self._broken = True
                self.transport.close()
                return
            if cycle is not None and cycle.more_body:
                if type(cycle) is _TensorCycle:
                    cycle.refused = int(status[:3])
                else:  # uvicorn's: the metrics middleware reads its scope
                    scope: dict[str, Any] = cycle.scope  # type: ignore[assignment]
                    scope[REFUSED] = int(status[:3])
            elif routes is not None and not self._broken:  # once a connection
                routes.metrics.rejected(reason)
            self._send_error(status, message)

        def _send_error(self, status: bytes, message: str) -> None:
            """Answer a request that cannot be read, and close: once the requests pipelined
            ahead of it are answered (`on_response_complete`), whose answers the close would
            otherwise cut off."""
            self._broken = True
            cycle = self.cycle
            # a request read whole and not yet answered: this error is a later request's (one
            # still arriving, a malformed chunked body say, is answered and closed at once)
            if cycle is not None and not (cycle.response_complete or cycle.more_body):
                if self._deferred_error is None:
                    self._deferred_error = (status, message)
                    self.flow.pause_reading()
                    if cycle is self._stop_marked:  # this error closes: the answer before it
                        self._take_back_close()  # closing would lose it (the server stopping)
                return
            body = error_body(message)
            head = [b"HTTP/1.1 " + status + b"\r\n"]
            head += [
                name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers
            ]
            head += [
                b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body),
                b"connection: close\r\n\r\n",
            ]
            self.transport.write(b"".join([*head, body]))
            self.transport.close()

    return LightshipProtocol
