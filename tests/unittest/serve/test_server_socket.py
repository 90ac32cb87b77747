"""The server's listening socket (`server.bind_socket`): its connections have Nagle's algorithm off, under asyncio and
under uvloop (the loop the server runs when it is installed)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from trtllm_glm.serve.server import bind_socket

pytestmark = pytest.mark.cpu_only


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_bound_socket_connections_have_nagle_off(loop_kind: str) -> None:
    """asyncio sets TCP_NODELAY on the connections of a socket whose protocol is TCP (`bind_socket`'s); uvloop on
    every TCP connection."""
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    nodelay: list[int] = []

    class Proto(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            s = transport.get_extra_info("socket")
            nodelay.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Proto, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            while not nodelay:
                await asyncio.sleep(0.01)
            writer.close()

    if loop_kind == "uvloop":
        loop = pytest.importorskip("uvloop", exc_type=ImportError).new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(main(), 10))
    finally:
        loop.close()
    assert sock.proto == socket.IPPROTO_TCP and nodelay == [1]
