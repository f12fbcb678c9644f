"""Network helpers every process kind shares."""

import asyncio
import contextlib
import os
import signal
import socket
from pathlib import Path


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
