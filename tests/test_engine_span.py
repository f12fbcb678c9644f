"""Engines over several nodes (`engines.nodes_per_engine`): config errors, each node's part and its
`vllm serve` command line, the head's rendezvous record, the pool's children."""

import asyncio
import re

import pytest

from molt_hpc.config import ConfigError, load_config
from molt_hpc.engine.vllm.main import vllm_command
from molt_hpc.engine.vllm.span import (
    Span,
    head_address,
    head_file,
    publish_head,
    read_head,
    span_flags,
    span_of,
    wait_head,
)
from molt_hpc.launch.local import run_local
from molt_hpc.launch.pool import check_pool_nodes, engine_env, node_engines, pool_children
from molt_hpc.rundir import RunDir
from tests.conftest import molt
from tests.test_vllm_engine import flags

VLLM = ["engines.kind=vllm", "engines.device=cuda", "actor.device=cuda", "engines.host=0.0.0.0"]
SPAN = [*VLLM, "engines.tensor_parallel=8", "engines.data_parallel=2", "engines.nodes_per_engine=2"]
SLURM = ["slurm.engines.gpus_per_node=8"]
API_SERVER = "vllm.entrypoints.openai.api_server"


def raises(text: str, exc: type[Exception] = ConfigError):
    return pytest.raises(exc, match=re.escape(text))


def test_config_errors_say_what_to_change() -> None:
    cases = [
        (["engines.nodes_per_engine=2"], "only vLLM engines do: set engines.kind = 'vllm'"),
        ([*VLLM, "engines.data_parallel=3", "engines.nodes_per_engine=2"], "make data_parallel a multiple of 2"),
        ([*SPAN, "engines.host=127.0.0.1"], "set engines.host = '0.0.0.0'"),
        ([*SPAN, *SLURM, "engines.count=3", "slurm.engines.nodes=4"], "set slurm.engines.nodes = 6"),
        ([*SPAN, "slurm.engines.nodes=2", "slurm.engines.gpus_per_node=4"], "make data_parallel × tensor_parallel = 8"),
    ]
    for overrides, message in cases:
        with raises(message):
            load_config(None, overrides)
    eng = load_config(None, [*SPAN, *SLURM, "engines.count=3", "slurm.engines.nodes=6"]).engines
    assert (eng.gpus_per_engine, eng.gpus_per_engine_node) == (8 * 2, 8 * 2 // 2)


def test_cli_refuses_a_bad_span_with_exit_code_2(tmp_path) -> None:
    result = molt("submit", "configs/405b_moe.toml", "--set", f"run.root={tmp_path}", "--set",
                  "engines.nodes_per_engine=2", "--dry-run", "--no-plan")  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "engines.data_parallel = 1 does not split evenly over engines.nodes_per_engine = 2" in result.stderr


def test_a_local_run_refuses_a_multi_node_engine(tmp_path) -> None:
    cfg = load_config(None, [*SPAN, "slurm.engines.nodes=2", f"run.root={tmp_path}"])
    with raises("a local run has one: submit it to Slurm", ValueError):
        run_local(cfg)
    assert not (tmp_path / cfg.run.name).exists()


@pytest.mark.parametrize("nodes, dp, tp", [(2, 2, 8), (4, 4, 8), (2, 16, 1), (4, 8, 4)])
def test_each_part_gets_vllm_multi_node_data_parallel_flags(nodes, dp, tp) -> None:
    cfg = load_config(None, [*VLLM, f"engines.tensor_parallel={tp}", f"engines.data_parallel={dp}",
                             f"engines.nodes_per_engine={nodes}", f"slurm.engines.nodes={nodes}",
                             "engines.expert_parallel=true"])  # fmt: skip
    local = dp // nodes
    for rank in range(nodes):
        span = span_of(cfg.engines, rank, "node-a", 13345)
        cmd = vllm_command(cfg, "/m", 8000, 7, span)
        got = flags(cmd)
        assert got["--data-parallel-size"] == str(dp) and got["--data-parallel-size-local"] == str(local)
        assert got["--data-parallel-address"] == "node-a" and got["--data-parallel-rpc-port"] == "13345"
        assert got["--tensor-parallel-size"] == str(tp) and "--enable-expert-parallel" in got
        assert got["--seed"] == str(cfg.run.seed * 1000 + 7)  # every part of an engine samples alike
        if rank == 0:  # the head serves HTTP on loopback for the front
            assert cmd[2] == API_SERVER and got["--port"] == "8000" and got["--host"] == "127.0.0.1"
            assert "--headless" not in got and "--data-parallel-start-rank" not in got
        else:  # `vllm serve --headless`: the first replica it hosts, no API server
            assert cmd[2:4] == ["vllm.entrypoints.cli.main", "serve"] and "--headless" in got
            assert got["--data-parallel-start-rank"] == str(rank * local)
            assert "--port" not in got and "--host" not in got


def test_span_flags_are_vllms_names() -> None:
    head, other = Span(2, 0, 4, "h", 5), Span(2, 1, 4, "h", 5)
    assert span_flags(head) == ["--data-parallel-size", "4", "--data-parallel-size-local", "2",
                                "--data-parallel-address", "h", "--data-parallel-rpc-port", "5"]  # fmt: skip
    assert span_flags(other) == ["--headless", *span_flags(head), "--data-parallel-start-rank", "2"]


def test_a_single_node_engine_keeps_its_command_line() -> None:
    cfg = load_config(None, [*VLLM, "engines.tensor_parallel=2", "engines.data_parallel=4"])
    got = flags(vllm_command(cfg, "/m", 1, index=0))
    assert got["--data-parallel-size"] == "4"
    assert not {"--data-parallel-size-local", "--data-parallel-address", "--headless"} & set(got)


def test_each_node_hosts_its_part_of_one_engine(tmp_path) -> None:
    cfg = load_config(None, [*SPAN, *SLURM, "engines.count=3", "slurm.engines.nodes=6"])
    run = RunDir(tmp_path)
    assert [node_engines(cfg, n) for n in range(6)] == [[(0, 0)], [(0, 1)], [(1, 0)], [(1, 1)], [(2, 0)], [(2, 1)]]
    for node in range(6):
        engines, services = pool_children(cfg, run, node)
        (child,) = engines
        index, part = divmod(node, 2)
        tail = child.cmd[child.cmd.index("--index") :]
        assert tail == (["--index", str(index)] if part == 0 else ["--index", str(index), "--engine-node", str(part)])
        assert child.log.name == (f"engine-{index}.log" if part == 0 else f"engine-{index}-node{part}.log")
        assert [s.name for s in services] == (["router", "orchestrator"] if node == 0 else [])
    single = load_config(None, [*VLLM, "engines.count=2", "engines.tensor_parallel=4"])
    assert node_engines(single, 3) == [(6, 0), (7, 0)]


def test_a_multi_node_engine_takes_every_gpu_of_its_node(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    cfg = load_config(None, [*SPAN, *SLURM, "slurm.engines.nodes=2"])
    assert engine_env(cfg, 0)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with raises("needs 16 GPUs but the node has 4", ValueError):
        engine_env(load_config(None, [*VLLM, "engines.tensor_parallel=8", "engines.data_parallel=4",
                                      "engines.nodes_per_engine=2", "slurm.engines.nodes=2"]), 0)  # fmt: skip


def test_the_pool_refuses_a_node_count_that_does_not_match() -> None:
    cfg = load_config(None, [*SPAN, *SLURM, "engines.count=2", "slurm.engines.nodes=4"])
    check_pool_nodes(cfg, "4")
    check_pool_nodes(cfg, None)  # not under Slurm: nothing to compare
    with raises("runs on 3 nodes but engines.count × engines.nodes_per_engine = 4", ValueError):
        check_pool_nodes(cfg, "3")


def test_head_record_round_trip(tmp_path) -> None:
    run = RunDir(tmp_path)
    stop = asyncio.Event()

    async def waits_then_reads():
        waiter = asyncio.create_task(wait_head(run, 1, 30.0, stop))
        await asyncio.sleep(1.2)
        assert not waiter.done()  # nothing published yet
        first = publish_head(run, 1, "node-a", 4242)
        return first, await waiter

    first, got = asyncio.run(waits_then_reads())
    assert got == first and (got["address"], got["rpc_port"]) == ("node-a", 4242)
    assert head_file(run, 1).name == "dp-head-1.json"  # not an engine registration (`engine-*.json`)
    assert publish_head(run, 1, "node-a", 4243)["nonce"] != first["nonce"]  # a new head is told apart
    assert read_head(run, 1)["rpc_port"] == 4243
    with raises("did not publish", RuntimeError):
        asyncio.run(wait_head(run, 2, 0.5, asyncio.Event()))


def test_the_head_publishes_a_numeric_address(monkeypatch) -> None:
    import socket

    assert head_address("10.1.2.3") == "10.1.2.3"
    resolved = [("127.0.1.1", 0), ("10.0.0.7", 0)]  # a Debian-style /etc/hosts line first, then the network
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a: [(socket.AF_INET, 1, 6, "", ip) for ip in resolved])
    assert head_address("0.0.0.0") == "10.0.0.7"
    resolved.pop()
    with raises("resolves only to loopback (127.0.1.1)", RuntimeError):
        head_address("0.0.0.0")
