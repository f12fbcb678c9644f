"""The vLLM engine process on a CPU: its `vllm serve` command line, the vLLM/torch checks, and its front.

vLLM needs a GPU, so `vllm serve` itself cannot run here. The front is tested in front of a REAL
upstream that speaks the same routes: our builtin engine (a real process on the tiny model) stands in
for `vllm serve`. The engine process's own lifecycle is in `test_vllm_engine_process.py`.
"""

import asyncio
import importlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import aiohttp
import pytest

from molt_hpc.config import load_config
from molt_hpc.engine.client import EngineHTTPError, generate, health
from molt_hpc.engine.vllm.front import normalise_generate, stamp_versions, upstream_message
from molt_hpc.engine.vllm.main import (
    check_vllm,
    check_vllm_torch,
    required_torch,
    serve_front,
    vllm_command,
    vllm_env,
)
from molt_hpc.net import free_port
from tests.conftest import ROOT
from tests.test_engine_procs import arun, make_run, start_engines

PROMPT = [5, 6, 7, 8]


def flags(cmd: list[str]) -> dict[str, str | None]:
    """`--flag value` pairs of a command line (a flag followed by another flag has the value None)."""
    out: dict[str, str | None] = {}
    for i, arg in enumerate(cmd):
        if arg.startswith("--"):
            nxt = cmd[i + 1] if i + 1 < len(cmd) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_vllm_command_follows_the_config(monkeypatch) -> None:
    extra = ["--enable-expert-parallel", "--max-num-batched-tokens", "4096"]
    cfg = load_config(
        None,
        [
            "engines.kind=vllm",
            "engines.device=cuda",
            "engines.tensor_parallel=4",
            "engines.max_model_len=2048",
            "engines.gpu_memory_utilization=0.6",
            "engines.max_batch=96",
            "engines.enforce_eager=true",
            "engines.prefix_caching=false",
            "engines.logprobs_mode=raw_logprobs",
            f"engines.extra_args={json.dumps(extra)}",
            "model.dtype=bfloat16",
            "model.path=/models/qwen",
            "run.seed=7",
        ],
    )
    cmd = vllm_command(cfg, "/cache/qwen-dir", 31337, index=3)
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[-len(extra) :] == extra, "extra_args come last, so they override"
    got = flags(cmd[: -len(extra)])
    want = {
        "--model": "/cache/qwen-dir",
        "--host": "127.0.0.1",
        "--port": "31337",
        "--served-model-name": cfg.model.path,
        "--dtype": cfg.model.dtype,
        "--tensor-parallel-size": str(cfg.engines.tensor_parallel),
        "--max-model-len": str(cfg.engines.max_model_len),
        "--gpu-memory-utilization": str(cfg.engines.gpu_memory_utilization),
        "--max-num-seqs": str(cfg.engines.max_batch),
        "--seed": str(cfg.run.seed * 1000 + 3),
        "--enforce-eager": None,
        "--no-enable-prefix-caching": None,
        "--logprobs-mode": "raw_logprobs",
        "--skip-tokenizer-init": None,
        "--generation-config": "vllm",
        "--weight-transfer-config": json.dumps({"backend": "nccl"}),
        "--worker-extension-cls": "molt_hpc.engine.vllm.ipc.MoltWorkerExtension",
        "--disable-uvicorn-access-log": None,
    }
    assert got == want
    module, _, name = got["--worker-extension-cls"].rpartition(".")
    extension = getattr(importlib.import_module(module), name)  # what vLLM's workers import by this name
    assert {m for m in vars(extension) if not m.startswith("__")} == {"molt_place", "molt_ipc_init", "molt_ipc_update"}
    assert json.loads(got["--weight-transfer-config"]) == {"backend": "nccl"}

    defaults = flags(vllm_command(load_config(None, ["engines.kind=vllm"]), "/m", 1, index=0))
    assert "--enforce-eager" not in defaults and "--enable-prefix-caching" in defaults
    assert "--no-enable-prefix-caching" not in defaults
    assert defaults["--logprobs-mode"] == "processed_logprobs"

    # The token travels in the environment: a command line is readable by every user of the node.
    monkeypatch.setenv("MOLT_TEST_KEPT", "yes")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    env = vllm_env("s3cret")
    assert "--api-key" not in cmd and not any("s3cret" in a for a in cmd)
    assert env["VLLM_API_KEY"] == "s3cret" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["MOLT_TEST_KEPT"] == "yes"
    assert env["PYTHONPATH"].split(os.pathsep)[-1] == str(ROOT), "vLLM's workers import the extension from here"


def test_config_refuses_vllm_on_cpu() -> None:
    with pytest.raises(ValueError, match=r"engines\.device = 'cuda'"):
        load_config(None, ["engines.kind=vllm", "engines.device=cpu"])
    assert load_config(None, ["engines.kind=vllm", "engines.device=auto"]).engines.startup_timeout_s == 900.0


def test_missing_vllm_names_the_fix() -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the not-installed branch cannot be reached")
    with pytest.raises(ValueError, match=r"molt-hpc\[gpu\]") as err:
        check_vllm()
    assert "engines.kind = 'builtin'" in str(err.value)


def test_torch_check() -> None:
    check_vllm_torch("0.26.0", "2.11.0", "2.11.0+cu130")  # the local part does not count
    check_vllm_torch("0.26.0", None, "2.13.0")  # no pin: nothing to compare
    with pytest.raises(ValueError, match=r"torch==2\.11\.0 .* torch 2\.13\.0\+cpu.*molt-hpc\[gpu\]"):
        check_vllm_torch("0.26.0", "2.11.0", "2.13.0+cpu")
    assert required_torch(["numpy>=1", "torch==2.11.0", "torchaudio==2.11.0"]) == "2.11.0"
    assert required_torch(["torch == 2.11.0 ; platform_system == 'Linux'"]) == "2.11.0"
    assert required_torch(["torch==2.9.0; extra == 'old'", "torchvision==0.26.0"]) is None
    assert required_torch(None) is None


def test_generate_body_normalised_for_vllm() -> None:
    body = {"token_ids": [1, 2], "sampling_params": {"top_k": 0, "max_tokens": 3}, "output_mode": "tokens"}
    out = normalise_generate(body)
    assert out == {
        "token_ids": [1, 2],
        "sampling_params": {"top_k": -1, "max_tokens": 3, "logprobs": 0, "detokenize": False},
    }
    assert body["sampling_params"] == {"top_k": 0, "max_tokens": 3}, "the caller's body is not modified"
    kept = normalise_generate({"token_ids": [1], "sampling_params": {"logprobs": 5, "top_k": 20}})
    assert kept["sampling_params"]["logprobs"] == 5 and kept["sampling_params"]["top_k"] == 20
    bare = normalise_generate({"token_ids": [1], "sampling_params": None})["sampling_params"]
    assert bare == {"logprobs": 0, "max_tokens": 16, "detokenize": False}, "the builtin engine's max_tokens default"
    assert normalise_generate({"token_ids": [1], "stream": True})["stream"] is True, "streamed bodies pass"
    with pytest.raises(ValueError, match="n = 1"):
        normalise_generate({"token_ids": [1], "sampling_params": {"n": 2}, "stream": True})
    with pytest.raises(ValueError, match="sampling_params"):
        normalise_generate({"token_ids": [1], "sampling_params": [1]})


def test_version_stamps_and_error_messages() -> None:
    data = {"choices": [{"token_ids": [4, 5, 6]}]}
    assert stamp_versions(data, start=2, now=3) == {
        "choices": [{"token_ids": [4, 5, 6], "weight_versions": [2] * 3}],
        "weight_version": 3,
    }
    assert upstream_message(b'{"error": {"message": "too long", "type": "BadRequestError", "code": 400}}') == "too long"
    assert upstream_message(b'{"detail": "Missing init_info"}') == "Missing init_info"
    assert upstream_message(b'{"error": "plain"}') == "plain"
    assert upstream_message(b"<html>bad gateway</html>") == "<html>bad gateway</html>"


class FrontInThread:
    """`serve_front` (the vLLM engine's serving loop) on its own event loop in a thread."""

    def __init__(self, cfg, run, index: int, proc: subprocess.Popen, upstream: str):
        self.run, self.index = run, index
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.done = asyncio.run_coroutine_threadsafe(serve_front(cfg, run, index, proc, upstream, self.stop), self.loop)

    def record(self, timeout: float = 30) -> dict:
        path = self.run.rendezvous / f"engine-{self.index}.json"
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert not self.done.done(), self.done.result()
            assert time.monotonic() < deadline, "the front did not register"
            time.sleep(0.02)
        return json.loads(path.read_text())

    def finish(self, timeout: float = 30) -> int:
        """serve_front's exit code, after asking it to stop."""
        self.loop.call_soon_threadsafe(self.stop.set)
        code = self.done.result(timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        return code


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    """The builtin engine (index 0, standing in for `vllm serve`) and a vLLM front (index 1) in front of it."""
    run = make_run(tmp_path_factory.mktemp("vllm"), "vllm", tiny_model_dir, "engines.max_batch=4")
    [upstream] = start_engines(run, [0])
    cfg = load_config(run.config)
    front = FrontInThread(cfg, run, 1, upstream.proc, upstream.url)
    record = front.record()
    yield run, upstream.url, record
    assert front.finish() == 0
    assert not (run.rendezvous / "engine-1.json").exists(), "a clean stop unregisters the front"
    assert upstream.stop() == 0


def test_front_registers_and_checks_the_token(stack) -> None:
    run, _, record = stack
    assert record["kind"] == "vllm" and record["index"] == 1 and record["version"] == 0
    assert record["pid"] == os.getpid()

    async def go():
        async with aiohttp.ClientSession() as s:
            statuses = []
            routes = [("GET", "/health"), ("POST", "/inference/v1/generate"), ("POST", "/pause")]
            routes += [("POST", "/update_weights"), ("POST", "/finish_weight_update"), ("GET", "/v1/models")]
            for method, path in routes:
                for headers in ({}, {"Authorization": "Bearer wrong"}):
                    async with s.request(method, record["url"] + path, headers=headers, json={}) as r:
                        statuses.append(r.status)
            # With the token, the front's own token reaches the upstream, which checks it too.
            async with s.get(record["url"] + "/v1/models", headers=run.auth_headers()) as r:
                models = (r.status, await r.json())
            return statuses, models, await health(s, record["url"], token=run.token())

    statuses, (status, models), h = arun(go())
    assert statuses == [401] * len(statuses)
    assert status == 200 and models["data"][0]["id"] == load_config(run.config).model.path
    assert h == {"status": "ok", "index": 1, "kind": "vllm", "weight_version": 0}


def test_generate_through_the_front_matches_the_engine(stack) -> None:
    run, direct, record = stack
    sp = {"max_tokens": 9, "temperature": 0.0, "ignore_eos": True}

    async def go():
        async with aiohttp.ClientSession() as s:
            want = await generate(s, direct, PROMPT, sp, token=run.token())
            # top_k 0 and logprobs None are what our rollout sends; the front maps them for vLLM.
            got = await generate(s, record["url"], PROMPT, {**sp, "top_k": 0, "logprobs": None}, token=run.token())
            return want, got

    want, got = arun(go())
    assert got.token_ids == want.token_ids and len(got.token_ids) == 9
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-6)
    assert got.weight_version == 0 and got.weight_versions == [0] * 9


def test_upstream_errors_keep_their_status(stack) -> None:
    run, _, record = stack
    too_long = list(range(4, 100)) * 6  # 576 tokens > engines.max_model_len (512)

    async def go():
        async with aiohttp.ClientSession() as s:
            with pytest.raises(EngineHTTPError) as long_err:
                await generate(s, record["url"], too_long, {"max_tokens": 4}, token=run.token())
            async with s.post(record["url"] + "/pause?mode=bogus", headers=run.auth_headers()) as r:
                bad_mode = (r.status, await r.json())
            async with s.post(
                record["url"] + "/inference/v1/generate", headers=run.auth_headers(), data=b"{not json"
            ) as r:
                bad_json = (r.status, await r.json())
            return long_err.value, bad_mode, bad_json

    long_err, bad_mode, bad_json = arun(go())
    assert long_err.status == 400 and "max_model_len" in long_err.message
    assert bad_mode[0] == 400 and "bogus" in bad_mode[1]["error"], "query strings reach the upstream"
    assert bad_json[0] == 400 and "not valid JSON" in bad_json[1]["error"]


def test_refit_routes_and_versions_through_the_front(stack) -> None:
    """A request frozen by a pause while the weights change is stamped with its start version for
    every token; the new version reaches /health, the answer and the engine file."""
    run, direct, record = stack
    url, token = record["url"], run.token()
    hdr = run.auth_headers()

    async def go():
        async with aiohttp.ClientSession() as s:
            long = asyncio.create_task(
                generate(s, url, PROMPT, {"max_tokens": 400, "ignore_eos": True, "seed": 1}, token=token)
            )
            while (await health(s, direct, token=token))["running"] < 1:
                await asyncio.sleep(0.005)
            replies = {}
            for path in ("/pause?mode=keep", "/start_weight_update"):
                async with s.post(url + path, headers=hdr) as r:
                    replies[path] = (r.status, await r.json())
            assert not long.done(), "the request must be in flight across the update"
            async with s.get(url + "/is_paused", headers=hdr) as r:
                paused = await r.json()
            async with s.post(url + "/finish_weight_update", headers=hdr, json={"version": 7}) as r:
                finished = (r.status, await r.json())
            file_version = json.loads((run.rendezvous / "engine-1.json").read_text())["version"]
            async with s.post(url + "/resume", headers=hdr) as r:
                replies["/resume"] = (r.status, await r.json())
            return await long, replies, paused, finished, file_version, await health(s, url, token=token)

    res, replies, paused, finished, file_version, h = arun(go())
    assert all(status == 200 for status, _ in replies.values()), replies
    assert replies["/pause?mode=keep"][1]["mode"] == "keep" and paused == {"is_paused": True}
    assert finished[0] == 200 and finished[1]["weight_version"] == 7
    assert file_version == 7 and h["weight_version"] == 7
    assert len(res.token_ids) == 400 and res.weight_version == 7
    assert res.weight_versions == [0] * 400, "tokens of a request that straddled the update carry its start version"


def test_front_calls_only_the_extension_and_closes_only_native_sessions(stack) -> None:
    """`/collective_rpc` reaches our worker extension's `molt_*` methods only. A shared-memory refit
    opens no vLLM session (no `/start_weight_update`), so its finish stamps the version without
    calling vLLM's `/finish_weight_update` (which would refuse: nothing to finish)."""
    run, direct, record = stack
    url, hdr = record["url"], run.auth_headers()

    async def go():
        async with aiohttp.ClientSession() as s:
            before = (await health(s, direct, token=run.token()))["weight_version"]
            async with s.post(url + "/collective_rpc", headers=hdr, json={"method": "load_model"}) as r:
                refused = (r.status, await r.json())
            async with s.post(url + "/collective_rpc", headers=hdr, json={"method": "molt_place"}) as r:
                forwarded = r.status  # the stand-in has no /collective_rpc: its 404 comes back
            async with s.post(url + "/finish_weight_update", headers=hdr, json={"version": before + 5}) as r:
                finished = (r.status, await r.json())
            after = (await health(s, direct, token=run.token()))["weight_version"]
            return before, refused, forwarded, finished, after, await health(s, url, token=run.token())

    before, refused, forwarded, finished, after, front = arun(go())
    assert refused[0] == 403 and "molt_" in refused[1]["error"]
    assert forwarded == 404
    assert finished == (200, {"weight_version": before + 5})
    assert after == before, "no native session was open: vLLM's finish was not called"
    assert front["weight_version"] == before + 5


def test_front_with_vllm_down_and_vllm_dying(tmp_path, tiny_model_dir) -> None:
    """No upstream listening: /health is 503 and generate 502. The stand-in vLLM process dying ends
    the serving loop with 1 and unregisters."""
    run = make_run(tmp_path, "down", tiny_model_dir)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    front = FrontInThread(load_config(run.config), run, 0, sleeper, f"http://127.0.0.1:{free_port()}")
    record = front.record()

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(record["url"] + "/health", headers=run.auth_headers()) as r:
                h = (r.status, await r.json())
            with pytest.raises(EngineHTTPError) as err:
                await generate(s, record["url"], PROMPT, {"max_tokens": 2}, token=run.token())
            return h, err.value

    (status, body), err = arun(go())
    assert status == 503 and "not healthy" in body["error"]
    assert err.status == 502 and "not answering" in err.message
    sleeper.kill()
    sleeper.wait()
    assert front.done.result(10) == 1
    front.loop.call_soon_threadsafe(front.loop.stop)
    assert not (run.rendezvous / "engine-0.json").exists()
