"""Network helpers every process kind shares."""

import asyncio
import contextlib
import os
import random
import signal
import socket
from pathlib import Path

ALL_INTERFACES = ("0.0.0.0", "::")
"""Bind addresses that listen everywhere: others reach such a server at this node's name."""
LOOPBACK = ("127.0.0.1", "localhost", "::1")
"""Addresses no other node reaches."""
LOOPBACK_ENV = "MOLT_LOOPBACK_ONLY"
"""Set to 1 by local mode for every process of the run: each listener then binds 127.0.0.1."""


def loopback_only() -> bool:
    """Whether this process belongs to a local-mode run (nothing may listen beyond loopback)."""
    return os.environ.get(LOOPBACK_ENV) == "1"


def listen_fd(port: int = 0) -> int:
    """A listening TCP socket's file descriptor for a `TCPStore` server (`master_listen_fd`), which
    otherwise binds every interface: 127.0.0.1 in a local-mode run, all interfaces otherwise (other
    nodes connect). The caller's store owns the descriptor."""
    sock = socket.socket()
    sock.bind(("127.0.0.1" if loopback_only() else "0.0.0.0", port))
    sock.listen(512)
    return sock.detach()


def public_host(host: str) -> str:
    """The address others use for a server bound to `host`: `host`, or this node's hostname when it
    listens on all interfaces."""
    return socket.gethostname() if host in ALL_INTERFACES else host


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIRST_CHOSEN_PORT = 10_000


def free_port(host: str = "") -> int:
    """A TCP port free on `host` right now (`""`: every interface) for a server that binds it next (a
    rendezvous endpoint, a child's port). Chosen below the kernel's ephemeral range where there is room: a
    port from that range (what binding port 0 gives) can be taken before the server binds it by any outgoing
    connection of the host, of which a busy one opens thousands, and a torchrun rendezvous whose endpoint
    another socket holds waits out its whole timeout."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux, or no procfs: the kernel's choice
        low = 0
    rng = random.SystemRandom()
    for _ in range(64 if low > FIRST_CHOSEN_PORT else 0):
        port = rng.randrange(FIRST_CHOSEN_PORT, low)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:  # in use: another
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


async def serve_until_signal(runner, registration: Path, log, before_stop=None) -> None:
    """Serve until SIGTERM or SIGINT, then unregister (remove `registration`), await `before_stop()` (if
    given) and stop `runner` (an aiohttp `AppRunner`): a client that reads the rendezvous no longer finds a
    server that is going away."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    keep_stopping()
    log.info("stopping")
    with contextlib.suppress(FileNotFoundError):  # already removed: nothing to unregister
        os.unlink(registration)
    if before_stop is not None:
        await before_stop()
    await runner.cleanup()


def keep_stopping() -> None:
    """Once a stop began, a further SIGTERM changes nothing. An extra pool's engine on Slurm gets the job's
    SIGTERM and its supervisor's; one that came after the event loop closed (closing puts the default action
    back) would end the orderly exit as -15."""
    asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
