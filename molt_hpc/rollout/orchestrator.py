"""The rollout orchestrator: groups in flight through the router, finished groups into the buffer.

The loop: issue groups while admission allows, take them back in completion order (never
waiting for the slowest), shape and filter them (over-long penalty, dynamic sampling), `put` the
survivors into the replay buffer (blocking while it is full), count everything, repeat.

Staleness admission (`admission.py`) keeps rollout from running ahead of training: a new group is
issued only while `accepted + in_flight < (engine_version + max_staleness + 1) × actor.groups_per_step`
(the groups in flight at the kept share under `rollout.admission = "kept_share"`), with max_staleness
0 under `run.sync` (one batch per policy version). The durable state (`state.py`) is written at most every
half second; SIGTERM, `control/stop` or `control/done` end the loop without starting anything new, and a
restart re-issues what never reached the buffer (or finds it there)."""

import asyncio
import signal
import threading
import time
from typing import Any

from molt_hpc import checkpoint as ck
from molt_hpc.algorithm.filters import apply_overlong_penalty, has_signal
from molt_hpc.config import MoltConfig
from molt_hpc.data import Cursor, Position, PromptDataset
from molt_hpc.fault import fail
from molt_hpc.log import MetricsWriter, StallReport, get_logger, log_tail
from molt_hpc.rollout.admission import KeptShare, admits, lands_stale
from molt_hpc.rollout.engines import EngineLink
from molt_hpc.rollout.evaluation import evaluate
from molt_hpc.rollout.group import GroupOutcome, Runner, run_group
from molt_hpc.rollout.metrics import RolloutStats
from molt_hpc.rollout.state import StateFile
from molt_hpc.rundir import RunDir, atomic_write
from molt_hpc.trajectory import FINISHED_REWARDS, Group

POLL_S = 0.25
IDLE_FIRST_S = 0.005
"""An idle orchestrator's first look for a refit: the looks then double up to `POLL_S`, so the refit that
ends a synchronous step is seen within a few ms of the trainer's push (a fixed `POLL_S` cost such a step
up to 250 ms), and a long idle costs a look every `POLL_S`."""
FAILURE_RECORD_S = 10.0
"""While groups fail, a rollout record goes out at least this often, so the console counts the errors."""


async def beat_while_running(stall: StallReport) -> None:
    """Beat while the event loop turns: only a loop frozen by code holding the GIL lets the report fire."""
    while True:
        stall.beat()
        await asyncio.sleep(1.0)


def shape_group(outcome: GroupOutcome, cfg: MoltConfig, over_budget: bool = False) -> tuple[Group | None, str | None]:
    """(the group to put, None) with the over-long penalty applied, or (None, why it is dropped). An
    equal-reward group is dropped under dynamic sampling unless the drop budget is spent (`over_budget`)."""
    if outcome.group is None:
        return None, outcome.failure
    alg, ro = cfg.algorithm, cfg.rollout
    group = outcome.group
    if alg.overlong_buffer > 0:
        cap = ro.max_new_tokens if ro.max_turns == 1 else None  # one turn: the response cap is per turn
        group = apply_overlong_penalty(group, ro.max_total_tokens, alg.overlong_buffer, alg.overlong_penalty, cap)
    # with a teacher every group carries a per-token signal (molt_hpc.algorithm.distill): none is dropped
    if alg.dynamic_sampling and cfg.distill is None and not over_budget and not has_signal(group):
        return None, "equal_rewards"
    return group, None


def over_drop_budget(dropped: int, accepted: int, budget: float, groups_per_step: int) -> bool:
    """Whether `dropped` groups exceed `budget` per accepted group (one step's worth of slack at the start)."""
    return dropped >= budget * (accepted + groups_per_step)


class Stopping(Exception):
    """The orchestrator was asked to stop while waiting."""


def engine_log_line(run: RunDir) -> str:
    """The last line the first engine logged, as the likely cause of engines that never became healthy."""
    logs = sorted(run.logs.glob("engine-*.log"))
    if not logs:
        return "no engine wrote a log (see logs/pool.log)"
    last = next((line for line in reversed(log_tail(logs[0], 5).splitlines()) if line.strip()), "(empty)")
    return f"last line of {logs[0].name}: {last.strip()}"


class Orchestrator:
    def __init__(
        self,
        cfg: MoltConfig,
        run: RunDir,
        dataset: PromptDataset,
        runner: Runner,
        link: EngineLink,
        buffer: Any,
        eval_prompts: list | None = None,
        stop: asyncio.Event | None = None,
        scorer: Any = None,
        teacher: Any = None,
    ):
        self.cfg, self.run, self.runner, self.link, self.buffer = cfg, run, runner, link, buffer
        self.state_file = StateFile(run.path / "rollout" / "state.json")
        self.state = self.state_file.load()
        self.cursor = Cursor(dataset, cfg.data, cfg.run.seed)
        if self.state.cursor is not None:
            self.cursor.restore(self.state.cursor)
        self.reissue = list(self.state.in_flight)
        self.max_staleness = 0 if cfg.run.sync else cfg.buffer.max_staleness
        self.kept = KeptShare(cfg.actor.groups_per_step) if cfg.rollout.admission == "kept_share" else None
        """Under `kept_share` admission: the share of recent finished groups that were kept."""
        self.tasks: dict[asyncio.Task, Position] = {}
        self.eval_prompts = eval_prompts or []
        self.eval_task: asyncio.Task | None = None
        self.stats = RolloutStats()
        self.unreported = [0.0, 0]
        """[sum, count] of the rewards of samples in groups dropped since the last put (the next put reports them)."""
        self.metrics = MetricsWriter(run.metrics, source="rollout")
        self.eval_metrics = MetricsWriter(run.metrics, source="eval")
        self.stop = stop or asyncio.Event()
        self.scorer = scorer
        """A `molt_hpc.rollout.scoring.GroupScorer` when a reward model scores the groups."""
        self.teacher = teacher
        """A `molt_hpc.rollout.teacher.GroupTeacher` under `[distill]`: every group waits for its log-probs."""
        self.log = get_logger()
        self.failed_in_a_row = 0
        self.first_failure: str | None = None
        """The first failed group's cause in this start, quoted by every record and by the breaker."""
        self.last_record = time.monotonic()
        self.idle_s = IDLE_FIRST_S
        """The next idle look's wait (`idle`)."""

    # -- the loop ---------------------------------------------------------------------------------
    async def run_loop(self) -> None:
        if self.reissue:
            self.log.info("re-issuing %d group(s) that never reached the buffer", len(self.reissue))
        stall = StallReport(self.cfg.rollout.stall_report_s)
        heartbeat = asyncio.create_task(beat_while_running(stall))
        try:
            try:
                await self.wait_for_engines()
                await self.link.poll_version()
                while not self.should_stop():
                    while len(self.tasks) < self.cfg.rollout.groups_in_flight and self.admitted():
                        self.issue()
                    self.maybe_evaluate()
                    self.state_file.tick(self.state)  # a change not yet written, come due
                    if not self.tasks:
                        await self.idle()
                        continue
                    done, _ = await asyncio.wait(self.tasks, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        await self.complete(task, self.tasks.pop(task))
            except Stopping:
                pass
            if (self.run.path / "control" / "done").exists():
                await self.final_eval()
        finally:
            heartbeat.cancel()
            stall.stop()
            await self.shutdown()

    async def wait_for_engines(self) -> None:
        """Until the router has a healthy engine; past `engines.startup_timeout_s` the run stops (breaker)."""
        limit = self.cfg.engines.startup_timeout_s
        if not await self.link.wait_for_engines(self.stop, timeout_s=limit):
            if not self.stop.is_set():
                cause = engine_log_line(self.run)
                self.trip(f"no engine became healthy within {limit:g} s (engines.startup_timeout_s); {cause}")
            raise Stopping

    def trip(self, reason: str) -> None:
        """A circuit breaker: record why the run cannot go on, stop issuing; the trainer checkpoints and stops."""
        self.log.error("stopping the run: %s", reason)
        fail(self.run.path, reason, "rollout")
        self.stop.set()

    def count_failure(self, outcome: GroupOutcome, pos: Position) -> None:
        """The consecutive-failure breaker: a whole group that came back resets it, a failed one counts."""
        if outcome.failure is None:
            self.failed_in_a_row = 0
            return
        self.failed_in_a_row += 1
        if self.first_failure is None:
            self.first_failure = f"group {pos.group_id} (prompt {outcome.prompt.prompt_id}): {outcome.first_error}"
        limit = self.cfg.rollout.max_consecutive_failures
        if self.failed_in_a_row >= limit:
            self.trip(
                f"{self.failed_in_a_row} groups failed in a row (rollout.max_consecutive_failures = {limit}); "
                f"first failure: {self.first_failure}"
            )
        elif time.monotonic() - self.last_record >= FAILURE_RECORD_S:
            self.write_record()

    def should_stop(self) -> bool:
        control = self.run.path / "control"
        if not self.stop.is_set() and ((control / "stop").exists() or (control / "done").exists()):
            self.log.info("stop requested through %s", control)
            self.stop.set()
        return self.stop.is_set()

    def admitted(self) -> bool:
        gps, share = self.cfg.actor.groups_per_step, self.kept.share() if self.kept else 1.0
        return admits(self.state.groups_accepted, len(self.tasks), self.link.version, self.max_staleness, gps, share)

    async def idle(self) -> None:
        """Nothing in flight and admission closed: wait for a refit (poll the engines, soon at first) or a stop."""
        try:
            await asyncio.wait_for(self.stop.wait(), self.idle_s)
        except TimeoutError:
            self.idle_s = min(2 * self.idle_s, POLL_S)
            await self.link.poll_version()

    def issue(self) -> None:
        self.idle_s = IDLE_FIRST_S  # the next idle spell starts looking soon again
        if self.reissue:
            pos = self.reissue.pop(0)
            prompt = self.cursor.at(pos)
        else:
            prompt, pos = self.cursor.next()
            self.state.in_flight.append(pos)
            self.state.cursor = self.cursor.state()
        if self.buffer.was_put(pos.group_id):  # it reached the buffer just before a restart
            self.state.groups_accepted += 1
            self.state.in_flight.remove(pos)
        else:
            task = asyncio.create_task(self.rollout(prompt, pos))
            self.tasks[task] = pos
            self.stats.in_flight(len(self.tasks))
        self.state_file.save(self.state)

    async def rollout(self, prompt, pos: Position) -> GroupOutcome:
        """One group's samples, then its scores (a reward model) and its teacher's log-probs (`[distill]`): it
        waits for a scorer and a teacher, the others go on."""
        outcome = await run_group(self.runner, prompt, pos, self.cfg.rollout)
        if self.scorer is not None and outcome.group is not None:
            await self.scorer.score_group(outcome.group)
        if self.teacher is not None and outcome.group is not None:
            await self.teacher.teach(outcome.group)
        return outcome

    async def complete(self, task: asyncio.Task, pos: Position) -> None:
        outcome: GroupOutcome = task.result()  # anything but a sample failure is a bug: let it stop us
        self.stats.in_flight(len(self.tasks))  # taken back (popped from the tasks by the loop)
        self.stats.finished(outcome)
        self.count_failure(outcome, pos)
        raw = [s.reward for s in outcome.group.samples] if outcome.group is not None else []
        if outcome.failure == "engine":  # the pool is down, not the prompt: issue it again once engines are back
            self.log.warning("group %s failed on the engines; it will be issued again", pos.group_id)
            self.reissue.append(pos)
            await self.wait_for_engines()
            return
        alg, st = self.cfg.algorithm, self.state
        spent = over_drop_budget(
            st.groups_dropped, st.groups_accepted, alg.dynamic_sampling_budget, self.cfg.actor.groups_per_step
        )
        group, reason = shape_group(outcome, self.cfg, over_budget=spent)
        if self.kept is not None:
            self.kept.add(group is not None)
            if group is not None and lands_stale(st.groups_accepted, group.min_version, self.max_staleness,
                                                 self.cfg.actor.groups_per_step):  # fmt: skip
                group, reason = None, "stale"  # admitted on an estimate that proved low: never trained
        if group is None:
            self.log.info("group %s dropped: %s", pos.group_id, reason)
            if reason in ("equal_rewards", "stale"):
                self.stats.filtered(reason)
            self.state.groups_dropped += 1
            self.unreported = [self.unreported[0] + sum(raw), self.unreported[1] + len(raw)]
        else:
            if spent and alg.dynamic_sampling and not has_signal(group):
                self.stats.counts["groups_kept_over_drop_budget"] += 1
            group.meta["engine_version"] = self.link.version
            # The trainer's `reward` averages every finished sample: this group's, and the dropped ones'.
            group.meta[FINISHED_REWARDS] = [self.unreported[0] + sum(raw), self.unreported[1] + len(raw)]
            self.unreported = [0.0, 0]
            await self.put(group)
            self.state.groups_accepted += 1
            self.stats.accepted(group)
        self.state.in_flight.remove(pos)
        self.state_file.save(self.state)
        if self.stats.counts["groups_accepted"] >= self.cfg.actor.groups_per_step:
            self.write_record()

    async def put(self, group: Group) -> None:
        """`buffer.put` in a daemon thread (it blocks under backpressure), abandoned if a stop comes first."""
        done = asyncio.Event()
        errors: list[BaseException] = []
        loop = asyncio.get_running_loop()

        def work() -> None:
            try:
                self.buffer.put(group)
            except BaseException as err:  # re-raised in the event loop below
                errors.append(err)
            loop.call_soon_threadsafe(done.set)

        threading.Thread(target=work, name="buffer-put", daemon=True).start()
        while not done.is_set():
            if self.should_stop():
                raise Stopping  # the group stays in flight: a restart re-issues it, or finds it put
            try:
                await asyncio.wait_for(done.wait(), POLL_S)
            except TimeoutError:
                continue
        if errors:
            raise errors[0]

    # -- evaluation, metrics, shutdown --------------------------------------------------------------
    def maybe_evaluate(self) -> None:
        """Collect a finished evaluation; start one when a due version is served (it runs beside the rollouts:
        nothing waits for it)."""
        ev = self.cfg.eval
        if ev is None or not self.eval_prompts:
            return
        if self.eval_task is not None and self.eval_task.done():
            self.finish_eval(self.eval_task.result())
            self.eval_task = None
        version = self.link.version
        if self.eval_task is None and version // ev.every > self.state.last_eval_version // ev.every:
            self.start_eval(version)

    def start_eval(self, version: int) -> None:
        if self.cfg.eval.best_metric is not None:
            ck.pin(self.run.checkpoints, version)
        self.eval_task = asyncio.create_task(evaluate(self.runner, self.eval_prompts, version, self.cfg.eval))

    def finish_eval(self, record: dict[str, Any]) -> None:
        ev, version = self.cfg.eval, record["eval_version"]
        value = record.get(ev.metric_key) if ev.metric_key else None
        if value is not None and record["eval_version_min"] == record["eval_version_max"] == version:
            # `eval_best` only where a whole checkpoint of the version was there to compare (not version 0's)
            promoted = ck.promote_best(self.run.checkpoints, version, ev.best_metric, value)
            if promoted is not None:
                record["eval_best"] = promoted
        # The record first: killed between the two, a restart evaluates this version again, whereas
        # the state saved first would say it was evaluated and its record would never be written.
        self.eval_metrics.write(record)
        self.state.last_eval_version = version
        self.state_file.save(self.state, now=True)
        shown = " ".join(f"{k[5:]} {v:.3f}" for k, v in record.items() if k.startswith("eval_pass@") and v is not None)
        self.log.info("eval at version %d: %s reward %s", version, shown, record["eval_reward"])

    async def final_eval(self) -> None:
        """Training is done: evaluate the last version (engines serve it) before the orchestrator ends, then
        say so in `control/evaluated` (the launcher waits for it before it stops the engines)."""
        ev = self.cfg.eval
        try:
            if ev is not None and self.eval_prompts and not (self.run.path / "control" / "stop").exists():
                for task in self.tasks:  # no more training: the engines are the evaluation's alone
                    task.cancel()
                if self.eval_task is not None:
                    self.finish_eval(await self.eval_task)
                    self.eval_task = None
                await self.link.poll_version()
                if self.link.version != self.state.last_eval_version:
                    self.start_eval(self.link.version)
                    self.finish_eval(await self.eval_task)
                    self.eval_task = None
        finally:  # also when it failed: the launcher must not wait for an evaluation that will not come
            atomic_write(self.run.path / "control" / "evaluated", f"{self.state.last_eval_version}\n")

    def write_record(self) -> None:
        envs = getattr(self.runner, "envs", None)  # env mode: where the env runs, and what its workers went through
        env_stats = envs.stats() if envs is not None else {}
        extra = {"version": self.link.version, "in_flight": len(self.tasks), **self.buffer.stats(), **env_stats,
                 **self.link.take_counts()}  # fmt: skip
        if self.first_failure is not None:
            extra["first_failure"] = self.first_failure
        record = self.stats.record(**extra, groups_accepted_total=self.state.groups_accepted)
        self.last_record = time.monotonic()
        self.metrics.write(record)
        self.log.info(
            "version %d | accepted %d | reward %s (trained %s) | len %s | %.1f tok/s | %.2f groups/s",
            self.link.version,
            self.state.groups_accepted,
            f"{record['reward']:.3f}" if "reward" in record else "-",
            f"{record['reward_trained']:.3f}" if "reward_trained" in record else "-",
            f"{record['response_len_mean']:.1f}" if "response_len_mean" in record else "-",
            record["tokens_per_s"],
            record["groups_per_s"],
        )

    async def shutdown(self) -> None:
        pending = [*self.tasks, *([self.eval_task] if self.eval_task else [])]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self.state_file.save(self.state, now=True)
        self.write_record()
        self.metrics.close()
        self.eval_metrics.close()
        st = self.state
        self.log.info("stopped: %d groups accepted, %d dropped, %d left in flight for the next start",
                      st.groups_accepted, st.groups_dropped, len(st.in_flight))  # fmt: skip

    @staticmethod
    def install_stop_handlers(stop: asyncio.Event) -> None:
        """SIGTERM / SIGINT set `stop`: nothing new starts, the state is saved, the process exits 0."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
