"""Local mode's GPU split between the actor pool and the engine pool (a pure function of the config)."""

from molt_hpc.config import load_config
from molt_hpc.launch.local import split_gpus


def cfg(*overrides: str):
    return load_config(None, list(overrides))


def test_disjoint_when_there_are_enough_gpus() -> None:
    c = cfg("actor.ranks=2", "engines.count=2")
    assert split_gpus(c, ["0", "1", "2", "3", "4"]) == (["0", "1"], ["2", "3"])
    c = cfg("actor.ranks=1", "engines.count=1", "engines.tensor_parallel=2", "slurm.engines.gpus_per_node=2")
    assert split_gpus(c, ["4", "5", "6"]) == (["4"], ["5", "6"])


def test_one_gpu_is_shared() -> None:
    assert split_gpus(cfg(), ["0"]) == (["0"], ["0"])


def test_cpu_sides_get_no_gpu() -> None:
    assert split_gpus(cfg("actor.device=cpu"), ["0", "1"]) == ([], ["0"])
    assert split_gpus(cfg("engines.device=cpu"), ["0", "1"]) == (["0"], [])
    assert split_gpus(cfg("actor.device=cpu", "engines.device=cpu"), ["0", "1"]) == ([], [])
    assert split_gpus(cfg(), []) == ([], [])


def test_the_resume_hint_appears_only_with_a_checkpoint_to_resume_from(tmp_path) -> None:
    from molt_hpc import checkpoint as ck
    from molt_hpc.launch.local import _resume_hint
    from molt_hpc.rundir import create_run_dir

    run = create_run_dir(tmp_path, "r", "")
    assert _resume_hint(run, "; continue from {name}: ") == ""  # a resume would start over: no promise
    tmp = ck.begin(run.checkpoints, 3)
    ck.write_json(tmp / ck.RUN_STATE, {"step": 3})
    ck.write_manifest(tmp)
    ck.publish(run.checkpoints, tmp, 3, keep_last=2)
    assert (
        _resume_hint(run, "; continue from {name}: ")
        == f"; continue from step_000003: molt-hpc run --resume {run.path}"
    )
