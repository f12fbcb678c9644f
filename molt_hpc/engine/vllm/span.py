"""A vLLM engine over several nodes (`engines.nodes_per_engine > 1`): each node's part and its flags.

vLLM's multi-node data parallelism without Ray: the engine's first node (its head) runs the serving
`vllm serve` with `--data-parallel-size` (all the engine's replicas), `--data-parallel-size-local`
(those on this node), `--data-parallel-address` and `--data-parallel-rpc-port` (where the others
reach it); every other node runs `vllm serve --headless` with the same flags and its
`--data-parallel-start-rank` (the first replica it hosts). Replicas are numbered node by node.
The head picks its RPC port at start and publishes it with its address in
`rendezvous/dp-head-<index>.json` (not `engine-*.json`: those are registrations); the other nodes wait
for that file, and leave (to be restarted by their pool) when it changes or goes, since a new head is
a new engine they must join again.
"""

import asyncio
import contextlib
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from molt_hpc.config.rollout import EnginesConfig
from molt_hpc.net import ALL_INTERFACES
from molt_hpc.rundir import RunDir, atomic_write


@dataclass(frozen=True)
class Span:
    """One node's part of a multi-node engine."""

    nodes: int
    """Nodes of the engine."""
    rank: int
    """This node's rank in the engine; 0 is the head (the HTTP server, the registration)."""
    data_parallel: int
    """Replicas of the whole engine."""
    address: str
    """The head's address, reachable from the engine's other nodes."""
    rpc_port: int
    """The head's data-parallel RPC port."""

    @property
    def head(self) -> bool:
        return self.rank == 0

    @property
    def local(self) -> int:
        """Replicas on this node."""
        return self.data_parallel // self.nodes

    @property
    def start_rank(self) -> int:
        """The first replica this node hosts."""
        return self.rank * self.local


def span_of(eng: EnginesConfig, rank: int, address: str, rpc_port: int) -> Span:
    return Span(eng.nodes_per_engine, rank, eng.data_parallel, address, rpc_port)


def head_address(host: str) -> str:
    """This node's address for the engine's other nodes, in numeric form: vLLM binds its handshake socket
    on it with ZeroMQ, which binds IP addresses and interface names, never host names."""
    if host not in ALL_INTERFACES:
        return host
    name = socket.gethostname()
    ips = [info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET)]
    routable = [ip for ip in ips if not ip.startswith("127.")]
    if not routable:
        raise RuntimeError(
            f"this node's hostname {name} resolves only to loopback ({', '.join(ips)}): the engine's other nodes "
            "could not reach it; make the hostname resolve to the node's network address"
        )
    return routable[0]


def span_flags(span: Span) -> list[str]:
    """The data-parallel flags of this node's `vllm serve` (vLLM 0.26's names)."""
    flags = ["--data-parallel-size", str(span.data_parallel), "--data-parallel-size-local", str(span.local)]
    flags += ["--data-parallel-address", span.address, "--data-parallel-rpc-port", str(span.rpc_port)]
    if span.head:
        return flags
    return ["--headless", *flags, "--data-parallel-start-rank", str(span.start_rank)]


def head_file(run: RunDir, index: int) -> Path:
    return run.rendezvous / f"dp-head-{index}.json"


def publish_head(run: RunDir, index: int, address: str, rpc_port: int) -> dict:
    """Write where engine `index`'s head listens; a fresh nonce tells its other nodes it is a new head."""
    record = {"address": address, "rpc_port": rpc_port, "pid": os.getpid(), "nonce": uuid.uuid4().hex}
    run.rendezvous.mkdir(parents=True, exist_ok=True)
    atomic_write(head_file(run, index), json.dumps(record))
    return record


def read_head(run: RunDir, index: int) -> dict | None:
    try:
        return json.loads(head_file(run, index).read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet (or being replaced)
        return None


async def wait_head(run: RunDir, index: int, timeout_s: float, stop: asyncio.Event) -> dict | None:
    """The head's record once it is published; None when a stop is asked first; raise after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        if (record := read_head(run, index)) is not None:
            return record
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"engine {index}'s first node did not publish {head_file(run, index)} within "
                f"engines.startup_timeout_s = {timeout_s}; see its engine-{index}.log"
            )
        with contextlib.suppress(TimeoutError):  # a second passed: look again
            await asyncio.wait_for(stop.wait(), 1.0)
    return None
