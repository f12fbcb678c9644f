"""The router's ring: consistent hashing moves ~1/N of the keys per membership change; bounded loads."""

import math
import random

import pytest

from molt_hpc.router.ring import HashRing, capacity, choose

KEYS = [f"session-{i}" for i in range(6000)]


def owners(ring: HashRing) -> dict[str, str]:
    return {k: ring.lookup(k) for k in KEYS}


@pytest.mark.parametrize("n", [2, 4, 8])
def test_adding_or_removing_one_engine_moves_about_one_nth(n: int) -> None:
    ring = HashRing(160)
    ring.set_nodes({f"engine-{i}" for i in range(n)})
    before = owners(ring)
    ring.set_nodes({f"engine-{i}" for i in range(n + 1)})
    after = owners(ring)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == f"engine-{n}" for k in moved), "keys only move to the new engine"
    assert abs(len(moved) / len(KEYS) - 1 / (n + 1)) < 0.35 / (n + 1), len(moved) / len(KEYS)
    ring.set_nodes({f"engine-{i}" for i in range(n + 1)} - {"engine-0"})
    removed = owners(ring)
    moved = [k for k in KEYS if after[k] != removed[k]]
    assert all(after[k] == "engine-0" for k in moved), "only the removed engine's keys move"
    assert abs(len(moved) / len(KEYS) - 1 / (n + 1)) < 0.35 / (n + 1)


def test_virtual_nodes_spread_keys_evenly() -> None:
    ring = HashRing(160)
    ring.set_nodes({f"engine-{i}" for i in range(4)})
    counts: dict[str, int] = {}
    for owner in owners(ring).values():
        counts[owner] = counts.get(owner, 0) + 1
    assert len(counts) == 4 and all(abs(c / len(KEYS) - 0.25) < 0.06 for c in counts.values()), counts


def test_walk_visits_every_node_once_starting_at_the_owner() -> None:
    ring = HashRing(8)
    ring.set_nodes({"a", "b", "c"})
    for key in KEYS[:50]:
        order = list(ring.walk(key))
        assert sorted(order) == ["a", "b", "c"] and order[0] == ring.lookup(key)


def test_bounded_loads_cap_a_hot_key_and_keep_everyone_else_home() -> None:
    """Half the traffic is one session: no engine ever holds more than ceil(c·(in-flight+1)/N), and the
    other sessions stay on their own engine as long as it is under the bound."""
    ring = HashRing(160)
    nodes = {f"engine-{i}" for i in range(4)}
    ring.set_nodes(nodes)
    loads = dict.fromkeys(nodes, 0)
    rng = random.Random(0)
    kept = total_cold = 0
    for i in range(400):
        key = "hot" if i % 2 == 0 else rng.choice(KEYS)
        cap = capacity(loads, 1.25)
        node = choose(ring, key, loads, 1.25)
        assert cap == math.ceil(1.25 * (sum(loads.values()) + 1) / 4)
        assert loads[node] < cap, "the chosen engine is under the bound"
        owner = ring.lookup(key)
        if key != "hot":
            total_cold += 1
            kept += node == owner
            if loads[owner] < cap:
                assert node == owner, "affinity holds while the owner has room"
        loads[node] += 1
        if i % 3 == 2:  # requests also finish
            busiest = max(loads, key=loads.get)
            loads[busiest] -= 1
    assert max(loads.values()) <= math.ceil(1.25 * sum(loads.values()) / 4) + 1
    assert kept / total_cold > 0.5


def test_choose_only_considers_eligible_engines() -> None:
    ring = HashRing(16)
    ring.set_nodes({"a", "b", "c"})
    for key in KEYS[:100]:
        assert choose(ring, key, {"b": 0}, 1.25) == "b"
    assert choose(ring, "x", {}, 1.25) is None
