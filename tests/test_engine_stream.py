"""A streamed answer from a real engine process: its events carry the tokens of several decode steps when
`engines.stream_interval_ms` asks for it, and their tokens, log-probs and versions are the answer's own."""

import time

import aiohttp

from molt_hpc.engine.stream import Partial, events
from tests.test_engine_procs import arun, make_run, start_engines

NEW = 48


async def stream_events(url: str, token: str) -> tuple[list[dict], float]:
    """Every event of one streamed answer of NEW tokens, and the seconds from the request to its end."""
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": NEW, "ignore_eos": True}, "stream": True}
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s, s.post(f"{url}/inference/v1/generate", json=body,
                                                    headers={"Authorization": f"Bearer {token}"}) as resp:  # fmt: skip
        assert resp.status == 200, await resp.text()
        got = [e async for e in events(resp.content)]
    return got, time.monotonic() - t0


def test_a_stream_interval_puts_several_steps_in_one_event(tiny_model_dir, tmp_path) -> None:
    interval_s = 0.25
    run = make_run(tmp_path, "stream", tiny_model_dir, f"engines.stream_interval_ms={interval_s * 1e3}")
    (engine,) = start_engines(run, [0])
    try:
        got, seconds = arun(stream_events(engine.url, run.token()))
    finally:
        engine.stop()
    *deltas, final = got
    answer = final["choices"][0]
    partial = Partial()
    assert all(partial.add(d) for d in deltas)
    n = len(partial.token_ids)
    assert 0 < n <= NEW and partial.token_ids == answer["token_ids"][:n]
    assert partial.logprobs == [c["logprob"] for c in answer["logprobs"]["content"]][:n]
    assert partial.weight_versions == answer["weight_versions"][:n]
    # one event at the first token, then at most one per interval until the end
    assert len(deltas) <= 1 + seconds / interval_s + 1, (len(deltas), seconds)
    assert len(answer["token_ids"]) == NEW
