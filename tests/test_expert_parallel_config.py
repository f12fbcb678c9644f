"""Expert-parallel options: the trainer's and the engines' config errors, vLLM's EP command line, GPUs per engine."""

import json
import re
import sys

import pytest

from molt_hpc.config import ConfigError, load_config
from molt_hpc.engine.vllm.main import check_all2all, vllm_command
from molt_hpc.launch.local import prepare_run, split_gpus
from molt_hpc.launch.pool import engine_env
from molt_hpc.parallel.ep_check import check_ep, model_experts
from tests.test_vllm_engine import flags

VLLM = ["engines.kind=vllm", "engines.device=cuda", "actor.device=cuda"]
EP_DP = ["engines.expert_parallel=true", "engines.all2all_backend=deepep_high_throughput"]


def raises(exc: type[Exception], text: str):
    """`pytest.raises` whose message contains `text` literally."""
    return pytest.raises(exc, match=re.escape(text))


def test_ep_checks_name_the_fix() -> None:
    check_ep(1, 3, 3, None)  # ep = 1 fits anything
    check_ep(4, 8, 4, 128)
    cases = [
        ((2, 4, 4, None), "no MoE experts: set actor.ep = 1"),
        ((3, 6, 6, 8), "does not divide the model's 8 experts"),
        ((4, 6, 6, 8), "does not divide the 6 trainer ranks"),
        ((4, 8, 2, 8), "does not divide the 2 trainer ranks per node: expert parallelism stays inside a node"),
    ]
    for args, message in cases:
        with raises(ValueError, message):
            check_ep(*args)


def test_model_experts_reads_every_spelling(tmp_path) -> None:
    for key, value in (("num_experts", 8), ("num_local_experts", 16), ("n_routed_experts", 256)):
        (tmp_path / "config.json").write_text(json.dumps({key: value}))
        assert model_experts(tmp_path) == value
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_experts": 64}, "vision_config": {}}))
    assert model_experts(tmp_path) == 64
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert model_experts(tmp_path) is None


def test_actor_config_errors() -> None:
    assert load_config(None, ["actor.ep=4"]).actor.ep_dispatch == "all_to_all"
    with raises(ConfigError, "ep_dispatch = 'deep_ep' moves tokens between EP ranks: set actor.ep > 1"):
        load_config(None, ["actor.ep_dispatch=deep_ep"])
    with raises(ConfigError, "runs on GPUs only"):
        load_config(None, ["actor.ep=2", "actor.ep_dispatch=deep_ep", "actor.device=cpu"])
    with raises(ConfigError, "actor.ep_dispatch"):
        load_config(None, ["actor.ep=2", "actor.ep_dispatch=nccl"])
    with raises(ConfigError, "actor.ep = 3 does not divide slurm.actor.gpus_per_node = 4"):
        load_config(None, ["actor.ep=3", "slurm.actor.gpus_per_node=4", "slurm.actor.nodes=3"])
    load_config(None, ["actor.ep=4", "slurm.actor.gpus_per_node=8", "slurm.actor.nodes=2"])


def test_local_run_refuses_ep_on_a_dense_model(tmp_path) -> None:
    cfg = load_config(None, [f"run.root={tmp_path}", "actor.ep=2", "actor.ranks=2"])
    with raises(ValueError, "actor.ep = 2 but the model has no MoE experts"):
        prepare_run(cfg)


def test_deep_ep_absent_names_the_fix() -> None:
    pytest.importorskip("torch")
    from molt_hpc.parallel.expert import register

    if "deep_ep" in sys.modules or _importable("deep_ep"):
        pytest.skip("deep_ep is installed here")
    with pytest.raises(ValueError, match=r"deep_ep package does not import .* or set actor.ep_dispatch = 'all_to_all'"):
        register("deep_ep")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_vllm_expert_parallel_command_line() -> None:
    cfg = load_config(None, [*VLLM, "engines.tensor_parallel=2", "engines.data_parallel=4", *EP_DP])
    got = flags(vllm_command(cfg, "/m", 1, index=0))
    assert got["--tensor-parallel-size"] == "2" and got["--data-parallel-size"] == "4"
    assert "--enable-expert-parallel" in got and got["--enable-expert-parallel"] is None
    assert got["--all2all-backend"] == "deepep_high_throughput"
    tp_only = flags(
        vllm_command(
            load_config(None, [*VLLM, "engines.tensor_parallel=4", "engines.expert_parallel=true"]), "/m", 1, 0
        )
    )
    assert "--enable-expert-parallel" in tp_only and "--data-parallel-size" not in tp_only
    assert tp_only["--all2all-backend"] == "allgather_reducescatter"
    plain = flags(vllm_command(load_config(None, VLLM), "/m", 1, index=0))
    assert not {"--enable-expert-parallel", "--data-parallel-size", "--all2all-backend"} & set(plain)


def test_vllm_expert_parallel_config_errors() -> None:
    with raises(ConfigError, "engines.expert_parallel configure vLLM engines: set engines.kind = 'vllm'"):
        load_config(None, ["engines.expert_parallel=true", "engines.tensor_parallel=2"])
    with raises(ConfigError, "but it has one: raise engines.tensor_parallel or engines.data_parallel"):
        load_config(None, [*VLLM, "engines.expert_parallel=true"])
    with raises(ConfigError, "only with engines.expert_parallel = true and engines.data_parallel > 1"):
        load_config(None, [*VLLM, "engines.tensor_parallel=2", "engines.expert_parallel=true",
                           "engines.all2all_backend=deepep_low_latency"])  # fmt: skip
    with raises(ConfigError, "all2all_backend"):
        load_config(None, [*VLLM, "engines.all2all_backend=pplx"])  # removed in vLLM 0.26
    with raises(ConfigError, "not a multiple of engines.tensor_parallel × engines.data_parallel"):
        load_config(
            None, [*VLLM, "engines.tensor_parallel=2", "engines.data_parallel=2", "slurm.engines.gpus_per_node=6"]
        )


def test_deepep_engine_backend_without_deep_ep() -> None:
    cfg = load_config(None, [*VLLM, "engines.tensor_parallel=1", "engines.data_parallel=2", *EP_DP])
    if _importable("deep_ep"):
        pytest.skip("deep_ep is installed here")
    with pytest.raises(ValueError, match=r"deep_ep package is not installed .* 'allgather_reducescatter'"):
        check_all2all(cfg.engines)
    check_all2all(load_config(None, VLLM).engines)


def test_an_engine_takes_tensor_times_data_parallel_gpus(monkeypatch) -> None:
    cfg = load_config(None, [*VLLM, "engines.count=2", "engines.tensor_parallel=2", "engines.data_parallel=2"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert engine_env(cfg, 0)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert engine_env(cfg, 1)["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    one = load_config(None, [*VLLM, "engines.count=1", "engines.tensor_parallel=2", "engines.data_parallel=2",
                             "actor.ranks=2"])  # fmt: skip
    assert split_gpus(one, [str(i) for i in range(6)]) == (["0", "1"], ["2", "3", "4", "5"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with raises(ValueError, "engine 0 needs 4 GPUs"):
        engine_env(cfg, 0)
