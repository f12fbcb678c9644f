"""Network helpers every process kind shares."""

import asyncio
import contextlib
import os
import signal
import socket
from pathlib import Path

ALL_INTERFACES = ("0.0.0.0", "::")
"""Bind addresses that listen everywhere: others reach such a server at this node's name."""
LOOPBACK = ("127.0.0.1", "localhost", "::1")
"""Addresses no other node reaches."""


def public_host(host: str) -> str:
    """The address others use for a server bound to `host`: `host`, or this node's hostname when it
    listens on all interfaces."""
    return socket.gethostname() if host in ALL_INTERFACES else host


def free_port(host: str = "") -> int:
    """A TCP port free on `host` right now (`""`: every interface) for a server that binds it next."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


async def serve_until_signal(runner, registration: Path, log) -> None:
    """Serve until SIGTERM or SIGINT, then unregister (remove `registration`) and stop `runner` (an aiohttp
    `AppRunner`): a client that reads the rendezvous no longer finds a server that is going away."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping")
    with contextlib.suppress(FileNotFoundError):  # already removed: nothing to unregister
        os.unlink(registration)
    await runner.cleanup()
