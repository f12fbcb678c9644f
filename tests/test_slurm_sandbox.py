"""The sandbox in a Slurm job: het group 2, a CPU node of its own, serving the engine pool's envs.

The pools are the stand-ins of `test_slurm_jobs.py`; the sandbox step is the real server (the stand-in
engine script becomes `jobs/engine.py --role sandboxes` there), so a request from this test runs code
on the sandbox's node through the run's token, and the driver's stop ends it with the job.
"""

import asyncio
import json

import pytest

from molt_hpc.sandbox.client import SandboxClient
from tests.conftest import molt
from tests.slurm_support import events, submit, trained_steps

pytest_plugins = ["tests.slurm_cluster"]
pytestmark = pytest.mark.slurm

BOX = ("sandbox.workers=1", "slurm.sandboxes.cpus_per_task=1")


def test_the_sandbox_runs_on_its_own_cpu_node_and_stops_with_the_job(slurm_cluster, tmp_path, tiny_model_dir):
    job, run = submit(tmp_path, tiny_model_dir, "boxed", "run.steps=100000", *BOX, env={"MOLT_STANDIN_HOLD": "0:3"})
    registered = run / "rendezvous" / "sandbox.json"
    slurm_cluster.wait_for(lambda: registered.exists() and len(trained_steps(run)) >= 3, 120, "the sandbox server")

    actor_node, engine_node, box_node = slurm_cluster.component_nodes(job)
    assert len({actor_node, engine_node, box_node}) == 3  # one node per het group
    [box] = events(run, "engine", "sandboxes")
    assert box["node"] == box_node
    [pool] = events(run, "engine", "start")
    assert pool["node"] == engine_node and pool["no_sandbox"] and "sandbox" not in pool["engines"]
    status = molt("status", str(run)).stdout
    assert f"nodes {actor_node} + {engine_node} + {box_node} (het groups 0 + 1 + 2)" in status
    assert "molt-sandbox on " + box_node in status

    result = asyncio.run(SandboxClient(run).run("print(sum(range(10)))"))
    assert (result.stdout, result.exit_code, result.timed_out) == ("45\n", 0, False)
    assert json.loads(registered.read_text())["pid"] > 0

    cancel = molt("cancel", str(run))
    assert cancel.returncode == 0 and f"job {job} ended after its checkpoint (CANCELLED)" in cancel.stdout
    assert not registered.exists()  # the server unregistered: a clean stop, not a kill
    assert "stopping" in (run / "logs" / "sandbox.log").read_text()
