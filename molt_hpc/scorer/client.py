"""The orchestrator's side of the scoring processes: one batched request per group (a reward model's
`/classify`, a teacher's `/logprobs`), in turn over the registered processes of that role, waiting while
none answers.

A score is never made up: a process that is down (refused connection, reset, timeout, a 5xx) is skipped
for the next one; when none answers the request waits (the pool restarts dead ones) and tries again, for
as long as it takes, so a group waits for its scores and is never lost or trained on a guess. A 4xx
answer means the request itself is wrong (a sequence over `reward_model.max_model_len`), which no retry
fixes: it raises and stops the orchestrator with the process's message.
"""

import asyncio
import itertools
import time
from typing import Any

import aiohttp

from molt_hpc.config.distill import DistillConfig
from molt_hpc.config.stages import RewardModelConfig
from molt_hpc.engine.client import EngineHTTPError, request_json
from molt_hpc.log import get_logger
from molt_hpc.rundir import RunDir
from molt_hpc.scorer.registry import Role, scorer_urls

RETRY_MAX_S = 5.0
REPORT_S = 30.0
WHAT = {"scorer": "reward model", "teacher": "distillation teacher"}


class ScorerClient:
    """Asks the run's scorers (or, `role="teacher"`, its teachers) about token sequences."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        run: RunDir,
        token: str,
        cfg: RewardModelConfig | DistillConfig,
        role: Role = "scorer",
    ):
        self.session, self.run, self.token, self.timeout_s, self.role = session, run, token, cfg.timeout_s, role
        self._turn = itertools.count()
        self.requests = 0
        self.failures = 0
        """Calls that failed (and were tried again)."""

    async def score(self, sequences: list[list[int]]) -> list[float]:
        """The raw score of each sequence (one request to one scorer), once some scorer answers."""
        body = {"input": sequences, "use_activation": False}
        data, url = await self.ask("/classify", body)
        items = sorted(data["data"], key=lambda d: d["index"])
        if len(items) != len(sequences):
            raise EngineHTTPError(502, f"{len(items)} scores for {len(sequences)} sequences", url)
        return [float(d["probs"][0]) for d in items]

    async def logprobs(
        self, sequences: list[list[int]], ranges: list[list[tuple[int, int]]], temperature: float, top_k: int = 0
    ) -> tuple[list[dict[str, list]], float]:
        """(per sequence `{"logprobs": [...]}`, the teacher's log-prob of every token in its `ranges` in order,
        with `top_ids` and `top_logprobs` rows per token when `top_k > 0`; the seconds the teacher's forwards
        took), from one request to one teacher, once some teacher answers."""
        body = {"input": sequences, "ranges": [[list(r) for r in rs] for rs in ranges], "temperature": temperature}
        data, url = await self.ask("/logprobs", {**body, "top_k": top_k} if top_k else body)
        items = sorted(data["data"], key=lambda d: d["index"])
        want = [sum(b - a for a, b in rs) for rs in ranges]
        got = [len(d["logprobs"]) for d in items]
        keys = ("logprobs", "top_ids", "top_logprobs") if top_k else ("logprobs",)
        if got != want or (top_k and any(len(d.get(k) or []) != n for d, n in zip(items, want, strict=True)
                                         for k in keys[1:])):  # fmt: skip
            raise EngineHTTPError(502, f"log-probs for {got} tokens, {want} asked (top_k {top_k})", url)
        return [{k: d[k] for k in keys} for d in items], float(data.get("seconds", 0.0))

    async def ask(self, route: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """(the answer, the URL that gave it) of `route` from the first process of the role that answers."""
        pause, waiting_since, reported = 0.2, None, 0.0
        while True:
            urls = scorer_urls(self.run, self.role)
            start = next(self._turn)
            for k in range(len(urls)):
                url = urls[(start + k) % len(urls)]
                try:
                    self.requests += 1
                    data = await request_json(self.session, "POST", url.rstrip("/") + route, token=self.token,
                                              json=body, timeout=self.timeout_s)  # fmt: skip
                except EngineHTTPError as err:
                    if err.status < 500:
                        raise
                    self._failed(url, err)
                except (aiohttp.ClientError, TimeoutError) as err:  # dead, restarting or stuck: the next one
                    self._failed(url, err)
                else:
                    if waiting_since is not None:
                        get_logger().info("%s answers again after %.1f s", WHAT[self.role],
                                          time.monotonic() - waiting_since)  # fmt: skip
                    return data, url
            now = time.monotonic()
            waiting_since = now if waiting_since is None else waiting_since
            if now - reported >= REPORT_S:
                get_logger().warning("%s: no %s answers (%d registered); groups wait for one", WHAT[self.role],
                                     self.role, len(urls))  # fmt: skip
                reported = now
            await asyncio.sleep(pause)
            pause = min(RETRY_MAX_S, pause * 2)

    def _failed(self, url: str, err: Exception) -> None:
        self.failures += 1
        get_logger().info("%s %s failed (%s: %s); trying another", self.role, url, type(err).__name__, err)
