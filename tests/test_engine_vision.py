"""Images through the engines: the builtin engine (a real process serving `builtin:tiny-vl`), multi-turn
image observations through the env runner, and the vLLM front's render → features translation.

Log-prob checks compare the engine's processed log-probs with one teacher-forced forward of the model
over the whole trace with its pixel values (CPU, fp32, 1e-5). vLLM needs a GPU; the front is tested in
front of a named stand-in for vLLM's render and generate routes (`VllmRenderStandIn`) that answers in
vLLM's shapes and hands the translated request to the real builtin engine.
"""

import asyncio
import base64
import hashlib
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import aiohttp
import pytest
import torch
from aiohttp import web

from molt_hpc.actor.batch import policy_logprobs
from molt_hpc.actor.vision import ImageInputs
from molt_hpc.agents import StepEnvRunner, load_agent
from molt_hpc.agents.env_workers import EnvWorkerPool
from molt_hpc.algorithm import make_experience
from molt_hpc.config import load_config
from molt_hpc.data import PromptDataset
from molt_hpc.engine.batch import Row
from molt_hpc.engine.client import EngineHTTPError, generate
from molt_hpc.engine.sampling import SamplingParams
from molt_hpc.engine.scheduler import Scheduler
from molt_hpc.engine.vision import ImageCache, VisionRunner, row_images
from molt_hpc.engine.vllm.front import Front, build_front
from molt_hpc.engine.vllm.main import vllm_command
from molt_hpc.models import load_causal_lm, load_tokenizer
from molt_hpc.trajectory import TraceImage, Trajectory
from molt_hpc.vision.images import image_bytes
from molt_hpc.vision.processor import Vision
from molt_hpc.vision.rope import rope_positions
from tests.conftest import ROOT
from tests.test_engine_procs import arun, make_run, start_engines
from tests.test_vllm_engine import flags


@pytest.fixture(scope="module")
def vl(tmp_path_factory, tiny_vl_dir):
    run = make_run(tmp_path_factory.mktemp("vl-engine"), "vl", tiny_vl_dir, "engines.max_batch=8")
    [proc] = start_engines(run, [0])
    yield run, proc.url, Vision(tiny_vl_dir), load_causal_lm(tiny_vl_dir)
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def prompts(tiny_vl_dir):
    cfg = load_config(ROOT / "configs" / "tiny_vl_cpu.toml").data
    cfg = cfg.model_copy(update={"path": str(ROOT / cfg.path)})
    return PromptDataset.load(cfg, load_tokenizer(tiny_vl_dir), vision=Vision(tiny_vl_dir), max_images=2).prompts


def forced_logprobs(model, vision: Vision, traj: Trajectory) -> torch.Tensor:
    """Log-probs of every action token of `traj` from one forward over it with its images."""
    kw = {}
    if traj.images:
        pixels, grids = vision.pixels([im.data for im in traj.images])
        kw = {"pixel_values": pixels, "image_grid_thw": grids}
    pos = rope_positions(len(traj.tokens), traj.images, vision.spec.merge)[0][:, None]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([traj.tokens]), position_ids=pos, **kw).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    idx = torch.tensor([t for s, e in traj.action_ranges for t in range(s, e)])
    return logp[idx - 1].gather(-1, torch.tensor(traj.tokens)[idx][:, None]).view(-1)


def _traj(prompt, out) -> Trajectory:
    n, k = len(prompt.token_ids), len(out.token_ids)
    return Trajectory(
        prompt.token_ids + out.token_ids, n, [(n, n + k)], out.logprobs, [0] * k, images=list(prompt.images)
    )


def test_generate_with_images_matches_the_model(vl, prompts) -> None:
    """A batch mixing image rows (of different colours) and a text-only row: every token's log-prob is the
    teacher-forced one with the row's own pixels. Greedy: the random model's output is fixed and holds no
    vision token (a sampled one would end the sample, see `test_vision.py`)."""
    run, url, vision, model = vl
    picked = [prompts[0], prompts[30], prompts[60]]
    sp = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}

    async def go():
        async with aiohttp.ClientSession() as s:
            calls = [generate(s, url, p.token_ids, {**sp, "seed": i}, token=run.token(), images=list(p.images))
                     for i, p in enumerate(picked)]  # fmt: skip
            calls.append(generate(s, url, [2, 40, 41, 3, 2], {**sp, "seed": 9}, token=run.token()))
            return await asyncio.gather(*calls)

    outs = arun(go())
    assert all(vision.spec.media_token_ids.isdisjoint(out.token_ids) for out in outs)
    for p, out in zip(picked, outs, strict=False):
        got = torch.tensor(out.logprobs)
        assert torch.allclose(got, forced_logprobs(model, vision, _traj(p, out)), atol=1e-5)
    assert len(outs[3].token_ids) == 6


def test_bad_image_requests_are_refused(vl, prompts) -> None:
    run, url, vision, _ = vl
    p = prompts[0]
    [im] = p.images
    uri = "data:image/png;base64," + base64.b64encode(im.data).decode()

    async def post(body):
        async with aiohttp.ClientSession() as s:
            with pytest.raises(EngineHTTPError) as err:
                await _raw_generate(s, url, run.token(), body)
            return err.value

    short = arun(post({"token_ids": p.token_ids, "mm": {"images": [uri], "spans": [[im.offset, im.length - 1]]}}))
    assert short.status == 400 and f"needs {im.length} placeholder tokens" in short.message
    shifted = arun(post({"token_ids": p.token_ids, "mm": {"images": [uri], "spans": [[im.offset - 1, im.length]]}}))
    assert shifted.status == 400 and "not the image pad" in shifted.message
    missing = arun(post({"token_ids": p.token_ids}))
    assert missing.status == 400 and "the request has no images" in missing.message
    stray = arun(post({"token_ids": [*p.token_ids, vision.spec.image_token_id],
                       "mm": {"images": [uri], "spans": [[im.offset, im.length]]}}))  # fmt: skip
    assert stray.status == 400 and "outside mm.spans" in stray.message
    with pytest.raises(ValueError, match="serves a text model"):
        row_images({"images": [uri], "spans": [[0, 1]]}, [1], None)


async def _raw_generate(s: aiohttp.ClientSession, url: str, token: str, body: dict):
    from molt_hpc.engine.client import request_json

    body = {"sampling_params": {"max_tokens": 2}, **body}
    return await request_json(s, "POST", url + "/inference/v1/generate", token=token, json=body)


def test_reprefill_places_features_at_the_spans_only(tiny_vl_dir, prompts) -> None:
    """The re-prefill after a refit (a context with generated tokens, one of them an image pad) gives the
    logits the decode steps gave: features fill the prompt's spans, a generated pad keeps its embedding."""
    vision = Vision(tiny_vl_dir)
    runner = VisionRunner(load_causal_lm(tiny_vl_dir), torch.device("cpu"), vision.spec.merge)
    p = prompts[5]
    uri = "data:image/png;base64," + base64.b64encode(p.images[0].data).decode()
    images = row_images({"images": [uri], "spans": [[p.images[0].offset, p.images[0].length]]}, p.token_ids, vision)
    generated = [40, vision.spec.image_token_id, 41]
    logits, cache = runner.prefill([p.token_ids], [images])
    steps = [logits[0]]
    context = list(p.token_ids)
    for tok in generated:
        context.append(tok)
        steps.append(runner.decode(cache, [tok], [len(context) - 1 + images.rope_delta])[0])
    again, _ = runner.prefill([context], [images])
    assert torch.allclose(again[0], steps[-1], atol=1e-5)


def mm_of(prompt) -> dict:
    uris = ["data:image/png;base64," + base64.b64encode(im.data).decode() for im in prompt.images]
    return {"images": uris, "spans": [[im.offset, im.length] for im in prompt.images]}


def test_a_groups_samples_share_their_images_and_prefill(tiny_vl_dir, prompts) -> None:
    """Eight samples each of two image prompts (the cache gives a sample the images its group's first request
    checked) prefill in one forward of the two prompts, with one pass of their images through the vision
    tower, and every token's log-prob is still the teacher-forced one with the row's own pixels."""
    vision = Vision(tiny_vl_dir)
    model = load_causal_lm(tiny_vl_dir)
    runner = VisionRunner(model, torch.device("cpu"), vision.spec.merge)
    cache, picked = ImageCache(vision, size=4), [prompts[3], prompts[40]]
    assert picked[0].images[0].data != picked[1].images[0].data
    forwarded, tower = [], []
    prefill, features = runner.prefill, model.get_image_features
    runner.prefill = lambda contexts, images: (forwarded.append(len(contexts)), prefill(contexts, images))[1]
    model.get_image_features = lambda pixels, grids: (tower.append(len(grids)), features(pixels, grids))[1]
    sched = Scheduler(runner, eos_ids=set(), max_batch=16, max_model_len=160, seed=0)
    rows = []
    for p in picked:
        for _ in range(8):
            row = Row(list(p.token_ids), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), Future())
            row.images = cache.get(mm_of(p), p.token_ids)
            row.rope_delta = row.images.rope_delta
            rows.append(row)
            sched.submit(row)
    assert rows[0].images is rows[7].images and rows[0].images.key != rows[8].images.key
    assert cache.get(json.loads(json.dumps(mm_of(picked[0]))), picked[0].token_ids) is rows[0].images
    while sched.rows or sched.waiting:
        sched._step()
    assert forwarded == [2] and tower == [sum(len(p.images) for p in picked)], (forwarded, tower)
    for p, row in zip([q for q in picked for _ in range(8)], rows, strict=True):
        want = forced_logprobs(model, vision, _traj(p, SimpleNamespace(token_ids=row.tokens, logprobs=row.logprobs)))
        assert torch.allclose(torch.tensor(row.logprobs), want, atol=1e-5)


def test_the_image_cache_keeps_only_checked_requests_and_forgets_the_oldest(tiny_vl_dir, prompts) -> None:
    cache = ImageCache(Vision(tiny_vl_dir), size=2)
    a, b, c = prompts[1], prompts[2], prompts[3]
    bad = {**mm_of(a), "spans": [[0, 1]]}
    for _ in range(2):  # refused each time, never kept
        with pytest.raises(ValueError, match="placeholder tokens"):
            cache.get(bad, a.token_ids)
    with pytest.raises(ValueError, match="must be a data URI"):  # unhashable: checked, not cached
        cache.get({"images": [["not", "hashable"]], "spans": [[0, 1]]}, a.token_ids)
    first = cache.get(mm_of(a), a.token_ids)
    cache.get(mm_of(b), b.token_ids)
    assert cache.get(mm_of(a), a.token_ids) is first  # a is now the newest
    cache.get(mm_of(c), c.token_ids)  # b, the oldest, goes
    assert cache.get(mm_of(a), a.token_ids) is first and len(cache._kept) == 2
    assert cache.get(mm_of(b), b.token_ids) is not None and len(cache._kept) == 2


def test_twins_arriving_together_are_checked_once(tiny_vl_dir, prompts, monkeypatch) -> None:
    """Eight samples of one prompt asking at once: one `row_images` call, its result handed to all eight; a
    bad request's twins all get its error, and nothing stays pending. The first call waits a moment for a
    second caller, which only a cache without the twins' wait would let in."""
    import molt_hpc.engine.vision as engine_vision

    real, calls, second = engine_vision.row_images, [], threading.Event()

    def slow_row_images(mm, token_ids, vision):
        calls.append(1)
        if len(calls) > 1:
            second.set()
        second.wait(timeout=0.5)
        return real(mm, token_ids, vision)

    monkeypatch.setattr(engine_vision, "row_images", slow_row_images)
    cache, p = ImageCache(Vision(tiny_vl_dir)), prompts[7]
    for mm, n in ((mm_of(p), 8), ({**mm_of(p), "spans": [[0, 1]]}, 4)):
        calls.clear()
        start = threading.Barrier(n)

        def ask(mm=mm, start=start):
            start.wait()
            try:
                return cache.get(mm, p.token_ids)
            except ValueError as err:
                return err

        with ThreadPoolExecutor(n) as pool:
            got = list(pool.map(lambda _: ask(), range(n)))
        assert not cache._pending
        if n == 8:  # a twin later than the check finds it kept: one call, whatever the timing
            assert len(calls) == 1 and all(g is got[0] for g in got) and isinstance(got[0], engine_vision.RowImages)
        else:  # a bad one is never kept: a twin later than the check checks again, and fails the same way
            assert all(isinstance(g, ValueError) and "placeholder tokens" in str(g) for g in got), got


def test_two_turn_episode_carries_both_images(vl, prompts, tiny_vl_dir) -> None:
    """The env shows a second image (`Result.images`): it joins the trace with its tokens after the first
    answer, the second turn's request sends both images, and the trainer's log-probs over the whole
    trace equal the engine's. The env runs in a worker process (`rollout.env_workers`, its images pickled
    across) and in the orchestrator's threads, with the same trace."""
    run, url, vision, model = vl
    cfg = load_config(ROOT / "configs" / "tiny_vl_cpu.toml", ["rollout.max_turns=2"])
    spec = str(ROOT / "envs" / "color_two_turn.py")
    sent: list[int] = []

    async def go(workers: int):
        pool = EnvWorkerPool(spec, workers, cfg.rollout.env_timeout_s) if workers else None
        try:
            async with aiohttp.ClientSession() as s:

                async def gen(ids, sp, session, images=None):
                    sent.append(len(images or []))
                    return await generate(s, url, ids, sp, token=run.token(), session_id=session, images=images)

                runner = StepEnvRunner(load_agent(spec), load_tokenizer(tiny_vl_dir), cfg.rollout, gen,
                                       vision=vision, envs=pool)  # fmt: skip
                return await runner.run(prompts[7], rollout_id="r0", overrides={"temperature": 0.0})  # greedy
        finally:
            if pool is not None:
                await pool.close()

    traj = arun(go(1))
    assert arun(go(0)) == traj, "the same trace whether the env runs in a worker process or in a thread"
    assert sent == [1, 2, 1, 2]
    assert len(traj.action_ranges) == 2 and traj.info["turns"] == 2.0
    first, second = traj.images
    assert first == prompts[7].images[0]
    assert traj.action_ranges[0][1] <= second.offset < traj.action_ranges[1][0]
    assert traj.tokens[second.offset : second.end] == [vision.spec.image_token_id] * second.length
    want = forced_logprobs(model, vision, traj)
    assert torch.allclose(torch.tensor(traj.action_logprobs), want, atol=1e-5)
    exp = make_experience([traj], max_len=cfg.rollout.max_total_tokens, vision=vision.spec)
    with torch.no_grad():
        logp, _ = policy_logprobs(model, exp, 1.0, 8, images=ImageInputs(vision))
    assert torch.allclose(logp[exp.action_mask], torch.tensor(traj.action_logprobs), atol=1e-5)


class VllmRenderStandIn:
    """Stands in for `vllm serve`'s render and generate routes (vLLM needs a GPU): render answers vLLM's
    `GenerateRequest` shape for a message of images, placed in its own rendering; generate takes
    `features` and hands the request, turned back into our `mm`, to the real builtin engine, whose answer
    loses its weight versions, as vLLM's has none. The items' `kwargs_data` are the images' bytes (in
    vLLM, msgpack tensors: opaque to the front either way)."""

    def __init__(self, engine_url: str, token: str, vision: Vision):
        self.engine_url, self.token, self.vision = engine_url, token, vision
        self.seen: list[dict] = []
        self.rendered: list[dict] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions/render", self.render)
        app.router.add_post("/inference/v1/generate", self.generate)
        return app

    async def render(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.rendered.append(body)
        datas = [image_bytes(part["image_url"]["url"]) for part in body["messages"][0]["content"]]
        ids, places = [2, 9, 9], []
        for data in datas:
            n = self.vision.tokens(self.vision.grid(data))
            ids.append(4)
            places.append({"offset": len(ids), "length": n})
            ids += [self.vision.spec.image_token_id] * n + [5]
        features = {
            "mm_hashes": {"image": [hashlib.sha256(d).hexdigest() for d in datas]},
            "mm_placeholders": {"image": places},
            "kwargs_data": {"image": [base64.b64encode(d).decode() for d in datas]},
        }
        return web.json_response({"request_id": "r", "token_ids": ids, "features": features, "sampling_params": {}})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(dict(body))
        feats = body.pop("features")
        uris = ["data:image/png;base64," + item for item in feats["kwargs_data"]["image"]]
        spans = [[p["offset"], p["length"]] for p in feats["mm_placeholders"]["image"]]
        body["sampling_params"] = {k: v for k, v in body["sampling_params"].items() if k != "detokenize"}
        async with aiohttp.ClientSession() as s:
            hdr = {"Authorization": f"Bearer {self.token}"}
            async with s.post(self.engine_url + "/inference/v1/generate", headers=hdr,
                              json={**body, "mm": {"images": uris, "spans": spans}}) as r:  # fmt: skip
                answer = await r.json()
        # vLLM answers without weight versions: the front stamps them
        answer.pop("weight_version", None)
        for choice in answer.get("choices") or []:
            choice.pop("weight_versions", None)
        return web.json_response(answer, status=r.status)


def test_vllm_command_for_a_vision_language_model(tiny_vl_dir) -> None:
    """A VLM keeps vLLM's tokenizer (render applies the chat template), turns the processor cache off (its
    entries would outlive a refit) and accepts a trajectory's images per request."""
    cfg = load_config(None, ["engines.kind=vllm", "rollout.max_images=3"])
    got = flags(vllm_command(cfg, tiny_vl_dir, 1, index=0))
    assert "--skip-tokenizer-init" not in got
    assert got["--mm-processor-cache-gb"] == "0"
    assert json.loads(got["--limit-mm-per-prompt"]) == {"image": 3}


def test_vllm_front_renders_then_generates_with_our_spans(vl, prompts) -> None:
    run, url, vision, _ = vl
    stand_in = VllmRenderStandIn(url, run.token(), vision)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    upstream_runner, upstream = asyncio.run_coroutine_threadsafe(serve(stand_in.app()), loop).result()
    front = Front(upstream, run.token(), 1, version=3)
    front_runner, front_url = asyncio.run_coroutine_threadsafe(serve(build_front(front)), loop).result()
    p = prompts[12]
    sp = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}

    async def go():
        async with aiohttp.ClientSession() as s:
            direct = await generate(s, url, p.token_ids, sp, token=run.token(), images=list(p.images))
            fronted = await generate(s, front_url, p.token_ids, {**sp, "top_k": 0}, token=run.token(),
                                     images=list(p.images))  # fmt: skip
            im = p.images[0]
            bad = [TraceImage(im.data, im.offset, 3, (1, 2, 2))]  # a trace expanded by another processor config
            with pytest.raises(EngineHTTPError) as err:
                await generate(s, front_url, p.token_ids, sp, token=run.token(), images=bad)
            return direct, fronted, err.value

    try:
        direct, fronted, err = arun(go())
    finally:
        for r in (front_runner, upstream_runner):
            asyncio.run_coroutine_threadsafe(r.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
    assert fronted.token_ids == direct.token_ids and fronted.logprobs == pytest.approx(direct.logprobs, abs=1e-6)
    assert fronted.weight_version == 3 and fronted.weight_versions == [3] * 5
    # the chat-completions render request as vLLM 0.26 reads it (max_tokens is deprecated there)
    assert {k: v for k, v in stand_in.rendered[0].items() if k != "messages"} == {"max_completion_tokens": 1}
    [body] = stand_in.seen
    assert "mm" not in body and body["token_ids"] == p.token_ids, "our expanded ids, as they are"
    [im] = p.images
    assert body["features"]["mm_placeholders"] == {"image": [{"offset": im.offset, "length": im.length}]}
    assert body["features"]["mm_hashes"]["image"] == [hashlib.sha256(im.data).hexdigest() + "-v3"]
    assert err.status == 400 and "makes 4 tokens of it, the trace holds 3" in err.message
