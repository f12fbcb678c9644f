"""An engine over two nodes on a real local Slurm cluster: which node runs which part of it.

The stand-in pool (`tests/slurm_standin_engine.py`) records the children the real pool code would
start on its node, from the run's config and the node's `SLURM_NODEID` in the engine het group.
"""

import pytest

from tests.slurm_support import events, submit

pytest_plugins = ["tests.slurm_cluster"]
pytestmark = pytest.mark.slurm


def test_a_two_node_engine_runs_its_serving_part_and_its_headless_part_on_its_nodes(
    slurm_cluster, tmp_path, tiny_model_dir
) -> None:
    span = ["engines.kind=vllm", "engines.device=cuda", "engines.host=0.0.0.0", "engines.nodes_per_engine=2",
            "engines.data_parallel=2", "slurm.engines.nodes=2", "run.steps=3"]  # fmt: skip
    job, run = submit(tmp_path, tiny_model_dir, "span", *span)
    assert slurm_cluster.wait_end(job, 120) == "COMPLETED"
    actor_node, engine_nodes = slurm_cluster.component_nodes(job)
    starts = sorted(events(run, "engine", "start"), key=lambda e: e["node"])
    assert [s["node"] for s in starts] == expand_nodes(slurm_cluster, engine_nodes) and len(starts) == 2
    head, headless = sorted(starts, key=lambda e: int(e["procid"]))  # procid: the node's index in the het group
    assert head["engines"] == [["--index", "0"]] and head["services"] == ["router", "orchestrator"]
    assert headless["engines"] == [["--index", "0", "--engine-node", "1"]] and headless["services"] == []
    assert head["node"] != headless["node"] and actor_node not in (head["node"], headless["node"])


def expand_nodes(cluster, nodelist: str) -> list[str]:
    return sorted(cluster.slurm("scontrol", "show", "hostnames", nodelist).split())
