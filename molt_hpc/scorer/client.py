"""The orchestrator's side of the scorers: one batched classify request per group, in turn over the
registered scorers, waiting while none answers.

A score is never made up: a scorer that is down (refused connection, reset, timeout, a 5xx) is
skipped for the next one; when none answers the request waits (the pool restarts dead scorers) and
tries again, for as long as it takes, so a group waits for its scores and is never lost or trained on
a guess. A 4xx answer means the request itself is wrong (a sequence over `reward_model.max_model_len`),
which no retry fixes: it raises and stops the orchestrator with the scorer's message.
"""

import asyncio
import itertools
import time

import aiohttp

from molt_hpc.config.stages import RewardModelConfig
from molt_hpc.engine.client import EngineHTTPError, request_json
from molt_hpc.log import get_logger
from molt_hpc.rundir import RunDir
from molt_hpc.scorer.registry import scorer_urls

RETRY_MAX_S = 5.0
REPORT_S = 30.0


class ScorerClient:
    """Scores token sequences with the run's scorers."""

    def __init__(self, session: aiohttp.ClientSession, run: RunDir, token: str, cfg: RewardModelConfig):
        self.session, self.run, self.token, self.cfg = session, run, token, cfg
        self._turn = itertools.count()
        self.requests = 0
        self.failures = 0
        """Scoring calls that failed (and were tried again)."""

    async def score(self, sequences: list[list[int]]) -> list[float]:
        """The raw score of each sequence (one request to one scorer), once some scorer answers."""
        pause, waiting_since, reported = 0.2, None, 0.0
        while True:
            urls = scorer_urls(self.run)
            start = next(self._turn)
            for k in range(len(urls)):
                url = urls[(start + k) % len(urls)]
                try:
                    scores = await self._classify(url, sequences)
                except EngineHTTPError as err:
                    if err.status < 500:
                        raise
                    self._failed(url, err)
                except (aiohttp.ClientError, TimeoutError) as err:  # dead, restarting or stuck: the next one
                    self._failed(url, err)
                else:
                    if waiting_since is not None:
                        get_logger().info("reward model answers again after %.1f s", time.monotonic() - waiting_since)
                    return scores
            now = time.monotonic()
            waiting_since = now if waiting_since is None else waiting_since
            if now - reported >= REPORT_S:
                get_logger().warning("reward model: no scorer answers (%d registered); groups wait for one", len(urls))
                reported = now
            await asyncio.sleep(pause)
            pause = min(RETRY_MAX_S, pause * 2)

    def _failed(self, url: str, err: Exception) -> None:
        self.failures += 1
        get_logger().info("scorer %s failed (%s: %s); trying another", url, type(err).__name__, err)

    async def _classify(self, url: str, sequences: list[list[int]]) -> list[float]:
        self.requests += 1
        body = {"input": sequences, "use_activation": False}
        data = await request_json(
            self.session, "POST", url.rstrip("/") + "/classify", token=self.token, json=body, timeout=self.cfg.timeout_s
        )
        items = sorted(data["data"], key=lambda d: d["index"])
        if len(items) != len(sequences):
            raise EngineHTTPError(502, f"{len(items)} scores for {len(sequences)} sequences", url)
        return [float(d["probs"][0]) for d in items]
