"""Network helpers every process kind shares."""

import socket


def free_port(host: str = "") -> int:
    """A TCP port free on `host` right now (`""`: every interface) for a server that binds it next."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
