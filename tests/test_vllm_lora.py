"""A LoRA run's refit into vLLM engines: each version's adapter directory loaded by name, requests sent to it.

`vllm serve` cannot run here (it needs a GPU): a stand-in HTTP server on loopback answers vLLM's LoRA
routes (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`) and its generate route, refusing what vLLM
refuses (an adapter name it has not loaded, a directory that is not a PEFT adapter). In front of it runs
the real front (`engine/vllm/front.py`), and the trainer's real `VllmAdapterSender` loads adapter
directories written by `lora.write_adapter` from a peft-adapted tiny model. The same path with a real
vLLM is `tests/test_vllm_lora_gpu.py`.
"""

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web

from molt_hpc.config import load_config
from molt_hpc.engine.vllm.adapters import AdapterSlots
from molt_hpc.engine.vllm.front import Front, build_front
from molt_hpc.engine.vllm.main import vllm_command, vllm_env
from molt_hpc.net import free_port
from molt_hpc.refit.vllm_lora import VllmAdapterSender, version_dir
from tests.conftest import molt

pytest.importorskip("peft")
TOKEN = "t0ken"
HOLD = 99
"""A prompt starting with this token is held by the stand-in until the test releases it."""
GPU = ["engines.kind='vllm'", "actor.device='cuda'", "engines.device='cuda'"]


def lora_cfg(*sets: str):
    return load_config(None, [*GPU, "actor.lora.rank=16", *sets])


def test_vllm_serves_lora_runs_with_the_rank_it_needs() -> None:
    cmd = vllm_command(lora_cfg("actor.lora.rank=48"), "/m", 8000, 0)
    assert cmd[cmd.index("--max-lora-rank") + 1] == "64"  # the smallest of vLLM's ranks that holds 48
    assert cmd[cmd.index("--max-loras") + 1] == "2" and "--enable-lora" in cmd
    assert "--enable-lora" not in vllm_command(load_config(None, GPU), "/m", 8000, 0)
    assert vllm_env("t", lora=True)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in vllm_env("t")
    given = vllm_command(lora_cfg("engines.extra_args=['--max-lora-rank', '32']"), "/m", 8000, 0)
    assert given.count("--max-lora-rank") == 1 and given[given.index("--max-lora-rank") + 1] == "32"


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["actor.lora.rank=600"], "lower actor.lora.rank to at most 512"),
        (["actor.lora.rank=32", "engines.extra_args=['--max-lora-rank=16']"], "above vLLM's LoRA rank limit"),
        (["engines.extra_args=['--max-lora-rank', '24']"], "not 24"),
    ],
)
def test_a_rank_vllm_cannot_serve_is_a_config_error(sets, says) -> None:
    with pytest.raises(ValueError, match=says):
        lora_cfg(*sets)


def test_the_command_line_stops_on_a_rank_vllm_cannot_serve(tmp_path) -> None:
    sets = [*GPU, f"run.root={tmp_path}", "actor.lora.rank=32", "engines.extra_args=['--max-lora-rank', '16']"]
    proc = molt("run", "configs/tiny_cpu.toml", *(a for s in sets for a in ("--set", s)))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "raise --max-lora-rank in engines.extra_args" in lines[0], proc.stderr
    assert not (tmp_path / "tiny-cpu").exists()


def tiny_adapters(tmp_path: Path, seed: int) -> tuple[dict[str, torch.Tensor], object]:
    """The trainer's adapters of a peft-adapted tiny model (B drawn non-zero, so versions differ) and peft's config."""
    from transformers import AutoModelForCausalLM

    from molt_hpc.actor.lora import adapter_params
    from molt_hpc.models.lora import ADAPTER, inject, wire_name
    from molt_hpc.models.tiny_char import tiny_config

    cfg = lora_cfg()
    model = AutoModelForCausalLM.from_config(tiny_config(cfg.model.tiny))
    inject(model, cfg.actor.lora)
    gen = torch.Generator().manual_seed(seed)
    tensors = {wire_name(n): torch.randn(p.shape, generator=gen) for n, p in adapter_params(model)}
    return tensors, model.peft_config[ADAPTER]


class StandIn:
    """vLLM's LoRA and generate routes, as far as the front uses them (a stand-in: vLLM needs a GPU)."""

    def __init__(self) -> None:
        self.loaded: dict[str, set[str]] = {}
        self.unloaded: list[str] = []
        self.models: list[str | None] = []
        self.release = asyncio.Event()

    async def load(self, request: web.Request) -> web.Response:
        from safetensors import safe_open

        body = await request.json()
        path = Path(body["lora_path"])
        if not (path / "adapter_config.json").exists():
            return web.json_response({"error": {"message": f"No adapter found for {path}"}}, status=404)
        json.loads((path / "adapter_config.json").read_text())["r"]  # vLLM's PEFTHelper reads the rank
        with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
            self.loaded[body["lora_name"]] = set(f.keys())
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        if self.loaded.pop(name, None) is None:
            return web.json_response({"error": {"message": f"The lora adapter '{name}' cannot be found."}}, status=404)
        self.unloaded.append(name)
        return web.Response(text="Success")

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        model = body.get("model")
        if model is not None and model not in self.loaded:
            return web.json_response({"error": {"message": f"The model `{model}` does not exist."}}, status=404)
        self.models.append(model)
        if body["token_ids"][0] == HOLD:
            await self.release.wait()
        content = [{"token": "token_id:7", "logprob": -0.5}]
        choice = {"index": 0, "token_ids": [7], "logprobs": {"content": content}, "finish_reason": "length"}
        return web.json_response({"request_id": "r", "choices": [choice]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)
        app.router.add_post("/inference/v1/generate", self.generate)
        return app


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port("127.0.0.1")
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def generate(session: aiohttp.ClientSession, url: str, first: int = 5) -> dict:
    body = {"token_ids": [first, 6], "sampling_params": {"max_tokens": 1}}
    async with session.post(url + "/inference/v1/generate", json=body,
                            headers={"Authorization": f"Bearer {TOKEN}"}) as resp:  # fmt: skip
        assert resp.status == 200, await resp.text()
        return await resp.json()


def test_each_version_loads_under_its_own_name_and_the_retired_one_goes_when_its_requests_end(tmp_path) -> None:
    asyncio.run(adapter_refits(tmp_path))


async def adapter_refits(tmp_path: Path) -> None:
    from molt_hpc.actor import lora

    standin = StandIn()
    up_runner, upstream = await serve(standin.app())
    front = Front(upstream, TOKEN, 0)
    front.adapters = AdapterSlots()
    front_runner, url = await serve(build_front(front))
    sender = VllmAdapterSender(TOKEN, timeout_s=30)
    root = tmp_path / "refit-adapters"

    async def push(version: int, seed: int) -> Path:
        tensors, config = tiny_adapters(tmp_path, seed)
        out = version_dir(root, version)
        lora.write_adapter(out, tensors, config, Path("/base"))
        await asyncio.to_thread(sender.push, iter(()), version, None, {"lora_scaling": 2.0, "lora_path": str(out)})
        assert standin.loaded[f"molt-v{version}"] == {lora.PEFT_PREFIX + k for k in tensors}
        return out

    try:
        async with aiohttp.ClientSession() as session:
            assert (await generate(session, url))["weight_version"] == 0 and standin.models == [None]  # the base
            sender.connect([url])
            first = await push(1, seed=1)
            answer = await generate(session, url)
            assert answer["weight_version"] == 1 and standin.models[-1] == "molt-v1"

            held = asyncio.create_task(generate(session, url, first=HOLD))  # runs under v1 across the next refit
            while standin.models[-1] != "molt-v1" or len(standin.models) < 3:
                await asyncio.sleep(0.01)
            await push(2, seed=2)
            assert not first.exists(), "the older version's directory goes once every engine loaded the new one"
            assert set(standin.loaded) == {"molt-v1", "molt-v2"}, "v1 still has a request in flight"
            assert (await generate(session, url))["weight_version"] == 2 and standin.models[-1] == "molt-v2"
            standin.release.set()
            done = await held
            assert done["weight_version"] == 2 and done["choices"][0]["weight_versions"] == [1]  # all from v1
            assert standin.unloaded == ["molt-v1"] and set(standin.loaded) == {"molt-v2"}

            await push(3, seed=3)  # nothing in flight under v2: unloaded at once
            assert standin.unloaded == ["molt-v1", "molt-v2"]
            with pytest.raises(RuntimeError, match="did not load the adapter"):
                await asyncio.to_thread(sender.push, iter(()), 4, None, {"lora_path": str(tmp_path / "none")})
            assert front.version == 3, "a failed load leaves the engine on its version"
            async with session.post(url + "/molt_load_adapter", json={"version": 4, "path": "x"}) as resp:
                assert resp.status == 401  # the run's token, as on every route
    finally:
        sender.close()
        await front_runner.cleanup()
        await up_runner.cleanup()


def test_a_front_without_adapters_refuses_an_adapter_refit(tmp_path) -> None:
    async def run() -> None:
        up_runner, upstream = await serve(StandIn().app())
        front_runner, url = await serve(build_front(Front(upstream, TOKEN, 0)))
        sender = VllmAdapterSender(TOKEN, timeout_s=30)
        sender.connect([url])
        try:
            with pytest.raises(RuntimeError, match="started without"):
                await asyncio.to_thread(sender.push, iter(()), 1, None, {"lora_path": str(tmp_path)})
        finally:
            sender.close()
            await front_runner.cleanup()
            await up_runner.cleanup()

    asyncio.run(run())
