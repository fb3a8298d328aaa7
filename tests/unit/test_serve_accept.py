"""The listening socket takes every waiting connection at a turn of the loop (`Acceptor`)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from typing import Any, cast

import pytest
import uvloop

from lightship.serve.accept import Acceptor

WAITING = 100


class Counted(asyncio.Protocol):
    made: list[int]
    turn: list[int]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made.append(self.turn[0])
        cast(asyncio.Transport, transport).write(b"hello")


def listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


async def turns_to_accept(
    serve: Callable[[socket.socket, Callable[[], asyncio.Protocol]], Coroutine[Any, Any, Any]],
) -> list[int]:
    """The loop turns it took to make a protocol for each of WAITING connections that were
    in the kernel's accept queue before the server started."""
    loop = asyncio.get_running_loop()
    turn, made = [0], list[int]()
    sock = listening()
    sock.listen(2 * WAITING)  # connections complete in the kernel, unaccepted
    clients = [socket.create_connection(sock.getsockname(), timeout=5) for _ in range(WAITING)]

    def tick() -> None:
        turn[0] += 1
        if len(made) < WAITING and turn[0] < 10 * WAITING:
            loop.call_soon(tick)

    Counted.made, Counted.turn = made, turn
    server = await serve(sock, Counted)
    loop.call_soon(tick)
    while len(made) < WAITING and turn[0] < 10 * WAITING:
        await asyncio.sleep(0)
    server.close()
    await server.wait_closed()
    for client in clients:
        assert client.recv(5) == b"hello"  # each one served, by a transport of this loop
        client.close()
    return made


async def with_acceptor(sock: socket.socket, factory: Callable[[], asyncio.Protocol]) -> Acceptor:
    return Acceptor(asyncio.get_running_loop(), sock, factory, backlog=2048)


async def with_loops_server(
    sock: socket.socket, factory: Callable[[], asyncio.Protocol]
) -> asyncio.AbstractServer:
    return await asyncio.get_running_loop().create_server(factory, sock=sock)


@pytest.mark.parametrize("runner", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_every_waiting_connection_is_taken_within_a_few_turns(runner: Any) -> None:
    # Under uvloop (the server's loop) libuv's own server took one connection a turn: 100
    # waiting took 100 turns, and under load a turn is tens of ms (probes waited 5-9 s)
    made = runner(turns_to_accept(with_acceptor))
    assert len(made) == WAITING and max(made) <= 3, made


def test_uvloops_own_server_is_what_took_one_a_turn() -> None:
    # why Acceptor exists; should libuv ever take several a turn again, it may go
    made = uvloop.run(turns_to_accept(with_loops_server))
    assert len(made) == WAITING and max(made) >= WAITING // 2, made


def test_a_closed_acceptor_takes_no_more_and_its_connections_stay() -> None:
    async def main() -> tuple[bytes, bool]:
        loop = asyncio.get_running_loop()
        sock = listening()
        made: list[asyncio.Transport] = []

        class Echo(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                made.append(cast(asyncio.Transport, transport))  # uvloop's is no subclass

            def data_received(self, data: bytes) -> None:
                made[0].write(data.upper())

        acceptor = Acceptor(loop, sock, Echo, backlog=16)
        address = sock.getsockname()
        reader, writer = await asyncio.open_connection(*address)
        for _ in range(500):
            if made:
                break
            await asyncio.sleep(0.01)
        acceptor.close()
        await acceptor.wait_closed()
        assert not acceptor.is_serving() and acceptor.sockets == ()
        writer.write(b"still here")  # the connection made before close() stays open
        answer = await asyncio.wait_for(reader.readexactly(10), 10)
        writer.close()
        try:
            await asyncio.open_connection(*address)
            refused = False
        except OSError:
            refused = True
        return answer, refused

    assert uvloop.run(main()) == (b"STILL HERE", True)
