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
