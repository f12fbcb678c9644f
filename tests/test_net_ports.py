"""`free_port`: a port a server can bind next, outside the range the kernel hands to outgoing connections."""

import socket
from pathlib import Path

from molt_hpc.net import FIRST_CHOSEN_PORT, free_port

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def test_a_chosen_port_binds_and_lies_below_the_ephemeral_range() -> None:
    low = int(RANGE.read_text().split()[0]) if RANGE.exists() else 0
    for host in ("127.0.0.1", ""):
        ports = [free_port(host) for _ in range(20)]
        for port in ports:
            with socket.socket() as sock:
                sock.bind((host, port))  # free when chosen
            if low > FIRST_CHOSEN_PORT:  # outgoing connections take ports from [low, high]: none of these
                assert FIRST_CHOSEN_PORT <= port < low, (port, low)


def test_a_port_in_use_is_not_chosen() -> None:
    """Ports held by listening servers are skipped (each candidate is bound before it is returned)."""
    held = []
    try:
        for _ in range(30):
            sock = socket.socket()
            sock.bind(("127.0.0.1", free_port("127.0.0.1")))
            sock.listen()
            held.append(sock)
        taken = {s.getsockname()[1] for s in held}
        assert len(taken) == len(held)
        assert all(free_port("127.0.0.1") not in taken for _ in range(50))
    finally:
        for sock in held:
            sock.close()
