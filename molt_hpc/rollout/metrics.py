"""Rollout metrics: what the orchestrator did since its last record, as one `metrics.jsonl` line.

A record is written every `actor.groups_per_step` accepted groups (one training batch) and at
shutdown: `reward`, the mean env reward over every finished sample (kept, or dropped by dynamic
sampling: what other frameworks report), `reward_trained` and scores of the accepted samples,
response lengths and turns, the groups in flight (`in_flight_max`, the most at once; `in_flight_mean`, over
the window's time: the `in_flight` beside them is the count when the record is written, just after a
batch was accepted, admission's lowest point), groups the
filters dropped (`groups_filtered_<why>`: `equal_rewards`, `stale`) and groups that failed (`groups_failed_<why>`: env
errors drop theirs, engine failures are issued again), retries, `tokens_migrated` (generated on an
engine that failed, kept and continued on another) and `tokens_discarded` (thrown away by a sample
that started again), and throughput; with a reward model,
`env_reward_mean` and `rm_score_mean` (its raw score) over every finished sample it scored, beside
the reward (which is then the combination the samples train on).
"""

import statistics
import time
from collections import Counter
from typing import Any

from molt_hpc.rollout.group import GroupOutcome
from molt_hpc.trajectory import Group


class RolloutStats:
    """Accumulates one window of rollout activity."""

    def __init__(self) -> None:
        self.totals: Counter = Counter()
        """Counts since the orchestrator started (never reset)."""
        self.in_flight_now, self.in_flight_since = 0, time.monotonic()
        """Groups in flight since the last change, and when it came (they carry over from window to window)."""
        self._reset()

    def _reset(self) -> None:
        self.started = time.monotonic()
        self.rewards: list[float] = []
        """Rewards of the accepted samples (as trained)."""
        self.finished_rewards: list[float] = []
        """Env rewards of every finished sample, accepted or filtered."""
        self.scores: list[float] = []
        self.lengths: list[int] = []
        self.turns: list[float] = []
        self.counts: Counter = Counter()
        self.tokens = 0
        self.in_flight_max = self.in_flight_now
        """The most groups in flight at once (what admission let the engines hold)."""
        self.in_flight_area = 0.0
        """Groups in flight integrated over the window's seconds (for `in_flight_mean`)."""
        self.reward_parts: dict[str, list[float]] = {"env_reward": [], "rm_score": []}
        """With a reward model: the env's reward and the model's raw score of every finished sample it scored."""

    def finished(self, outcome: GroupOutcome) -> None:
        """Count a group that came back (accepted or not), with its retries and env errors."""
        self.counts["groups_finished"] += 1
        self.counts["samples_engine_retries"] += outcome.engine_retries
        self.counts["samples_env_retries"] += outcome.env_retries
        self.counts["samples_env_restarts"] += outcome.env_restarts
        self.counts["tokens_discarded"] += outcome.tokens_discarded
        for reason, n in outcome.env_errors.items():
            self.counts[f"env_errors_{reason}"] += n
        if outcome.failure is not None:
            self.counts[f"groups_failed_{outcome.failure}"] += 1
        if outcome.group is not None:
            for s in outcome.group.samples:
                self.tokens += s.num_action_tokens
                self.finished_rewards.append(s.reward)
                for key, values in self.reward_parts.items():
                    if key in s.info:
                        values.append(float(s.info[key]))

    def in_flight(self, n: int) -> None:
        """The groups in flight are now `n` (a group issued or taken back)."""
        now = time.monotonic()
        self.in_flight_area += self.in_flight_now * (now - max(self.in_flight_since, self.started))
        self.in_flight_now, self.in_flight_since = n, now
        self.in_flight_max = max(self.in_flight_max, n)

    def filtered(self, reason: str) -> None:
        self.counts[f"groups_filtered_{reason}"] += 1

    def accepted(self, group: Group) -> None:
        self.counts["groups_accepted"] += 1
        for s in group.samples:
            self.rewards.append(s.reward)
            self.scores.append(s.score if s.score is not None else s.reward)
            self.lengths.append(s.response_len)
            self.turns.append(float(s.info.get("turns", 1.0)))

    def record(self, **extra: Any) -> dict[str, Any]:
        """The window as a metrics record; starts a new window."""
        self.in_flight(self.in_flight_now)  # the level up to now into the window's area
        seconds = max(time.monotonic() - self.started, 1e-9)
        self.totals.update(self.counts)
        rec: dict[str, Any] = {**extra, **dict(self.counts)}
        rec["window_s"] = round(seconds, 3)
        rec["tokens_per_s"] = self.tokens / seconds
        rec["groups_per_s"] = self.counts["groups_accepted"] / seconds
        rec["in_flight_max"] = self.in_flight_max
        rec["in_flight_mean"] = self.in_flight_area / seconds
        if self.finished_rewards:
            rec["reward"] = statistics.fmean(self.finished_rewards)
            rec["reward_std"] = statistics.pstdev(self.finished_rewards)
            rec["samples_finished"] = len(self.finished_rewards)
        if self.rewards:
            rec["reward_trained"] = statistics.fmean(self.rewards)
            rec["score_mean"] = statistics.fmean(self.scores)
            rec["response_len_mean"] = statistics.fmean(self.lengths)
            rec["response_len_max"] = max(self.lengths)
            rec["turns_mean"] = statistics.fmean(self.turns)
        for key, values in self.reward_parts.items():
            if values:
                rec[f"{key}_mean"] = statistics.fmean(values)
        self._reset()
        return rec
