"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

Each engine owns `virtual_nodes` points on a 64-bit ring; a key belongs to the first engine
clockwise from its hash, so adding or removing one of N engines moves only ~1/N of the keys. With
bounded loads an engine takes at most ceil(c · (in-flight + 1) / N) requests at once; a key whose
engine is full walks on to the next engine of the ring, so one hot session cannot swamp an
engine while every other session keeps its affinity. Nodes are names (`engine-3`), not URLs, so an
engine that restarts on a new port gets its old keys back.
"""

import bisect
import hashlib
import math
from collections.abc import Iterator


def hash64(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Points of every node on the ring, kept sorted."""

    def __init__(self, virtual_nodes: int = 160):
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        self.virtual_nodes = virtual_nodes
        self.nodes: set[str] = set()
        self._points: list[int] = []
        self._owners: list[str] = []

    def set_nodes(self, nodes: set[str]) -> None:
        if nodes == self.nodes:
            return
        self.nodes = set(nodes)
        points = sorted((hash64(f"{node}#{v}"), node) for node in self.nodes for v in range(self.virtual_nodes))
        self._points = [p for p, _ in points]
        self._owners = [n for _, n in points]

    def walk(self, key: str) -> Iterator[str]:
        """Every node once, in ring order starting at `key`'s position."""
        if not self._points:
            return
        start = bisect.bisect(self._points, hash64(key))
        seen: set[str] = set()
        for i in range(len(self._points)):
            node = self._owners[(start + i) % len(self._points)]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == len(self.nodes):
                    return

    def lookup(self, key: str) -> str | None:
        """The key's owner ignoring loads."""
        return next(self.walk(key), None)


def capacity(loads: dict[str, int], balance_factor: float) -> int:
    """Most in-flight requests one node may hold when one more arrives."""
    return math.ceil(balance_factor * (sum(loads.values()) + 1) / len(loads))


def choose(ring: HashRing, key: str, loads: dict[str, int], balance_factor: float) -> str | None:
    """The first node clockwise from `key` that is under capacity; `loads` names the eligible nodes.

    Some eligible node is always under capacity (they cannot all hold more than the average).
    """
    if not loads:
        return None
    cap = capacity(loads, balance_factor)
    for node in ring.walk(key):
        if node in loads and loads[node] < cap:
            return node
    raise AssertionError("bounded loads: every eligible node must be on the ring")
