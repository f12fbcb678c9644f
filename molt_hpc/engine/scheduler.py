"""The scheduler thread: the only code that runs the model, one step at a time.

Everything else talks to it through `call(fn)`: `fn` runs on the scheduler thread between two
steps, so admission, pause/resume, cancellation and weight updates never see a half-done step.
One step = prefill the admitted newcomers (they sample their first token and join the batch),
then one decode step of the whole batch; finished rows leave between steps.

Pause modes follow vLLM: `abort` ends every in-flight request now (`finish_reason: abort`),
`wait` lets them finish, `keep` freezes them to continue after `resume`. Requests that arrive
while paused are held until `resume`; `resume(steps=n)` runs n steps and freezes them again (a
request held at a chosen token, whatever the caller's timing). A refit pauses with `keep` (`begin_refit`); `end_refit`
bumps the version and drops the KV cache: frozen rows are re-prefilled under the new weights, so
every token after the update is exactly what the new policy gives for its context.
"""

import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from molt_hpc.engine.batch import ModelRunner, Row, append_samples, sample_rows
from molt_hpc.engine.kvcache import BatchCache
from molt_hpc.engine.load import LoadMeter, load_line
from molt_hpc.engine.routing import RoutingRecorder
from molt_hpc.engine.slots import SlotCache
from molt_hpc.log import get_logger


def fill_holes(keep: list[int]) -> list[int]:
    """The old index of each new position when the rows `keep` (ascending) stay: rows already in the first
    `len(keep)` places stay put, the rest fill the holes in order."""
    m = len(keep)
    movers = iter(i for i in keep if i >= m)
    kept = set(keep)
    return [i if i in kept else next(movers) for i in range(m)]


class Scheduler:
    """Continuous batching over one model: rows join and leave between decode steps."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        eos_ids: set[int],
        max_batch: int,
        max_model_len: int,
        seed: int,
        routing: RoutingRecorder | None = None,
        prefill_interval: int = 1,
    ):
        self.runner = runner
        self.routing = routing
        """Records the experts of every forwarded token (router replay); None: not captured."""
        self.eos_ids = eos_ids
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.prefill_interval = prefill_interval
        """Decode steps between two prefills while more than half the batch decodes (`engines.prefill_interval`)."""
        self._since_prefill = 0
        self._admit_s = 0.0  # the last step's seconds in `_admit`, for the load meter
        self.version = 0
        self.rows: list[Row] = []
        self.waiting: list[Row] = []  # admissible, not yet prefilled
        self.held: list[Row] = []  # arrived while paused; admitted on resume
        self.pause_mode: str | None = None  # None, "wait" (draining), "paused"
        self.steps_left: int | None = None
        """Steps until the scheduler pauses itself (`resume(steps=...)`); None: runs until paused."""
        self.refitting = False
        self.steps = 0
        self.on_tokens: Callable[[list[Row]], None] | None = None
        """Called on this thread once per step with the streamed rows (`Row.notify` set) still running: the
        server wakes their answers with one hand-over to its event loop, not one per row."""
        self._batch: BatchCache | SlotCache | None = None  # the runner's running batch
        self.load = LoadMeter()
        """This window's busy time and tokens, logged once per window."""
        self._drained: list[Future] = []
        self._finished: list[tuple[Row, str, int]] = []
        """Rows that ended in this step or command, answered by `_settle` once the counts are up to date."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._rng = random.Random(seed)  # the random bits of unseeded rows (`Row.bits`)
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the scheduler thread between steps; its result (or exception) lands in the future."""
        fut: Future = Future()
        self._inbox.put((fn, fut))
        return fut

    # -- commands (run on the scheduler thread) --------------------------------------------------

    def submit(self, row: Row) -> None:
        if self.routing is not None:
            row.routing = self.routing.new_row()
        (self.held if self._paused_for_new() else self.waiting).append(row)

    def cancel(self, row: Row) -> None:
        """The client went away: forget the row wherever it is."""
        for bucket in (self.waiting, self.held):
            if row in bucket:
                bucket.remove(row)
        if row in self.rows:
            self._drop([i for i, r in enumerate(self.rows) if r is not row])

    def pause(self, mode: str, done: Future) -> None:
        self.steps_left = None
        if mode == "abort":
            for row in self.rows + self.waiting + self.held:
                self._finish(row, "abort")
            self.waiting.clear()
            self.held.clear()
            self._drop([])
            self._settle()
        if mode == "wait" and (self.rows or self.waiting):
            self.pause_mode = "wait"
            self._drained.append(done)
            return
        self.pause_mode = "paused"
        done.set_result(self.status())

    def resume(self, steps: int | None = None) -> dict[str, Any]:
        """Continue frozen and held requests; with `steps`, freeze them again (as `keep`) after that many
        steps, so each running request advances by exactly that many tokens whatever the caller's timing."""
        assert steps is None or steps > 0
        self.steps_left = steps
        self.pause_mode = None
        self._resolve_drained()
        self.waiting.extend(self.held)
        self.held.clear()
        return self.status()

    def begin_refit(self) -> dict[str, Any]:
        self.refitting = True
        return self.status()

    def end_refit(self, version: int) -> dict[str, Any]:
        self.version = version
        self.refitting = False
        self._batch = None  # stale KV: the running rows are re-prefilled under the new weights
        self.runner.release()
        self.waiting[:0] = self.rows
        self.rows = []
        return self.status()

    def status(self) -> dict[str, Any]:
        return {
            "weight_version": self.version,
            "paused": self.pause_mode is not None,
            "refitting": self.refitting,
            "running": len(self.rows),
            "waiting": len(self.waiting) + len(self.held),
            "steps": self.steps,
        }

    def step(self) -> tuple[int, int]:
        """One step on the calling thread, for a scheduler whose thread was never started (the calibration
        times single decode steps this way); returns (rows prefilled, tokens the decode step sampled)."""
        assert not self._thread.is_alive(), "the scheduler thread steps this scheduler"
        return self._step()

    def drain(self) -> int:
        """Step on the calling thread until every submitted row has finished; the number of steps. For a
        scheduler whose thread was never started (calibration and benchmarks time its steps this way)."""
        assert not self._thread.is_alive(), "the scheduler thread steps this scheduler"
        start = self.steps
        while self.rows or self.waiting:
            self._step()
        return self.steps - start

    # -- the loop --------------------------------------------------------------------------------

    def _paused_for_new(self) -> bool:
        return self.pause_mode is not None

    def _can_step(self) -> bool:
        return self.pause_mode != "paused" and not self.refitting and bool(self.rows or self.waiting)

    def _loop(self) -> None:
        while True:
            try:
                item = self._inbox.get(block=not self._can_step())
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                fn, fut = item
                start = time.perf_counter()
                self._run_command(fn, fut)
                self.load.command_s += time.perf_counter() - start
                continue  # drain every pending command before the next step
            try:
                start = time.perf_counter()
                prefilled, decoded = self._step()
                self.load.add(time.perf_counter() - start, prefilled, decoded, self._admit_s)
                if (figures := self.load.take()) is not None:
                    get_logger().info(load_line(figures))
            except Exception as err:  # a failed step fails its requests, the engine keeps serving
                get_logger().exception("engine step failed")
                self._settle()  # rows that ended before the failure keep their answers
                for row in self.rows + self.waiting:
                    if not row.future.done():
                        row.future.set_exception(RuntimeError(f"engine step failed: {err}"))
                self.rows, self.waiting, self._batch = [], [], None
                self.runner.release()

    def _run_command(self, fn: Callable[[], Any], fut: Future) -> None:
        try:
            result = fn()
        except Exception as err:  # handed to the caller, who turns it into an HTTP error
            fut.set_exception(err)
            return
        if not fut.done():
            fut.set_result(result)

    @torch.inference_mode()
    def _step(self) -> tuple[int, int]:
        """One step; returns (rows prefilled, tokens the decode step sampled)."""
        start = time.perf_counter()
        prefilled = self._admit()
        self._admit_s = time.perf_counter() - start
        decoded = len(self.rows)
        if self.rows:
            self._decode()
        self.steps += 1
        self._settle()
        streamed = [row for row in self.rows if row.notify is not None]  # finished rows end by their future
        if streamed and self.on_tokens is not None:
            self.on_tokens(streamed)
        if self.pause_mode == "wait" and not (self.rows or self.waiting):
            self.pause_mode = "paused"
            self._resolve_drained()
        if self.steps_left is not None:
            self.steps_left -= 1
            if self.steps_left == 0:
                self.steps_left, self.pause_mode = None, "paused"
        return prefilled, decoded

    def _admit(self) -> int:
        """Prefill the newcomers that fit when a prefill is due; returns how many joined."""
        room = self.max_batch - len(self.rows)
        self._since_prefill += 1
        # Prefill when the interval is up, when nothing decodes, or at once when it would fill half the batch.
        big = 2 * min(room, len(self.waiting)) >= self.max_batch
        due = self._since_prefill >= self.prefill_interval or not self.rows or big
        if room <= 0 or not self.waiting or not due:
            return 0
        self._since_prefill = 0
        # The newcomers stay in `waiting` until they join `rows`: a prefill that raises then fails them with
        # the rest (a row in neither list would never answer), and `status` counts them meanwhile.
        newcomers = self.waiting[:room]
        logits, cache = self._prefill(newcomers)
        self._route_prefill(newcomers)
        self._append(newcomers, logits)
        self._batch = self.runner.join(self._batch, cache)
        self.rows.extend(newcomers)
        del self.waiting[: len(newcomers)]
        self._retire()
        return len(newcomers)

    def _prefill(self, rows: list[Row]):
        """Next-token logits and prefilled cache of `rows`; rows with the same context and images (a group's
        samples of one prompt) share one forward, their cache rows copied (not under router replay, whose
        recorder takes one routing per forwarded row)."""
        contexts, images = [r.context for r in rows], [r.images for r in rows]
        if self.routing is not None:
            return self.runner.prefill(contexts, images)
        first: dict[tuple, int] = {}
        index = [first.setdefault((tuple(r.context), r.images.key if r.images else None), len(first)) for r in rows]
        if len(first) == len(rows):
            return self.runner.prefill(contexts, images)
        lead = [index.index(k) for k in range(len(first))]  # each forwarded context's first row
        logits, cache = self.runner.prefill([contexts[i] for i in lead], [images[i] for i in lead])
        cache.keep(index)
        return logits[torch.tensor(index, device=logits.device)], cache

    def _decode(self) -> None:
        """One decode step of every running row."""
        assert self._batch is not None and self._batch.rows == len(self.rows)
        last = [r.tokens[-1] for r in self.rows]  # every running row has sampled at least once
        positions = [r.length - 1 for r in self.rows]
        rope = [p + r.rope_delta for p, r in zip(positions, self.rows, strict=True)]  # multimodal positions lag
        bits = [r.bits(self._rng) for r in self.rows]
        # Sampled inside the decode graph where it can be (no routing to record from Python hooks).
        sampled = None
        if self.routing is None:
            sampled = self.runner.decode_sampled(self._batch, self.rows, last, rope, bits)
        if sampled is None:
            logits = self.runner.decode(self._batch, last, rope)
            if self.routing is not None:
                for row, pos, experts in zip(self.rows, positions, self.routing.take(len(self.rows), 1), strict=True):
                    row.routing.write(pos, experts)
            self._append(self.rows, logits, bits)
        else:
            append_samples(self.rows, *sampled)
            for row in self.rows:
                row.versions.append(self.version)
        self._retire()

    def _route_prefill(self, rows: list[Row]) -> None:
        """Hand each prefilled row the routing of its context (left-padded to the longest)."""
        if self.routing is None:
            return
        width = max(r.length for r in rows)
        for row, experts in zip(rows, self.routing.take(len(rows), width), strict=True):
            row.routing.write(0, experts[width - row.length :])

    def _append(self, rows: list[Row], logits: torch.Tensor, bits: list[int] | None = None) -> None:
        sample_rows(rows, logits, [r.bits(self._rng) for r in rows] if bits is None else bits)
        for row in rows:
            row.versions.append(self.version)

    def _retire(self) -> None:
        """Finish rows that hit a stop token or a length cap and drop them from the batch."""
        keep = []
        for i, row in enumerate(self.rows):
            reason = self._finish_reason(row)
            if reason is None:
                keep.append(i)
            else:
                self._finish(row, reason)
        if len(keep) < len(self.rows):
            self._drop(keep)

    def _finish_reason(self, row: Row) -> str | None:
        tok, sp = row.tokens[-1], row.params
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_ids):
            return "stop"
        if len(row.tokens) >= (sp.max_tokens or self.max_model_len) or row.length >= self.max_model_len:
            return "length"
        return None

    def _drop(self, keep: list[int]) -> None:
        """Keep the rows at the (ascending) indices `keep`; the last rows move into the holes the others
        left, so a step in which a few rows finish moves a few rows' K/V, not every row after them."""
        order = fill_holes(keep)
        self.rows = [self.rows[i] for i in order]
        if not order:
            self._batch = None
            self.runner.release()
        elif self._batch is not None:
            self._batch.keep(order, max(r.length for r in self.rows))

    def _finish(self, row: Row, reason: str) -> None:
        self._finished.append((row, reason, self.version))

    def _settle(self) -> None:
        """Answer the rows that ended. Only now: a client answered while its row was still in `rows` or the
        step still uncounted could read a `/health` that shows the finished row running."""
        for row, reason, version in self._finished:
            if not row.future.done():
                row.future.set_result((reason, version))
        self._finished.clear()

    def _resolve_drained(self) -> None:
        for fut in self._drained:
            if not fut.done():
                fut.set_result(self.status())
        self._drained.clear()
