"""The engine's decode step while the trainer trains on the same device, timed for `plan --calibrate`.

One device shared by the two pools (one GPU, or the CPU) runs both at once in an asynchronous run: the engine
decodes the next step's samples while the trainer trains on the last. Neither runs at its own speed then: on a
GPU the two processes' kernels take turns, on a CPU they share the cores. The speed model charges that with
`shared_decode_rate`, the fraction of its own speed the engine keeps while the trainer trains, measured here:

1. decode steps of the built-in engine's scheduler on the configured model (random weights, the engine's own
   runner: the slot cache and CUDA graphs on a GPU), every row decoding, for a few seconds: the engine alone;
2. a second process trains the config's own step (`train_step` on the trainer's models, synthetic groups of
   `actor.groups_per_step × rollout.n_samples` full-length samples) in a loop on the same device, timing
   its steps: first alone, then while the engine decodes beside it;
3. the same decode steps again while that process trains: the engine beside the trainer.

Each side has the torch threads a run gives it (`engines.threads`, else one; one a trainer rank). `plan
--calibrate` runs this on a GPU only (`calibrate.py` says why).

The rate is the mean decode step alone over the mean decode step beside the trainer (a decode step is timed
from its launch to its sampled tokens on the host; prefill steps are left out); the trainer's own slowdown
(its mean step beside the engine over alone) is reported with it.
"""

import os
import statistics
import time
from concurrent.futures import Future
from dataclasses import dataclass

from molt_hpc.config import MoltConfig

READY_TIMEOUT_S = 900.0
"""The trainer process builds its models and warms up (kernels picked, the optimizer's state made) first."""
ALONE_STEPS = 2
"""Trainer steps timed alone, after one warm-up step."""
WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Shared:
    """Decode-step and trainer-step seconds, each alone and beside the other pool."""

    decode_alone: list[float]
    decode_shared: list[float]
    train_alone: list[float]
    train_shared: list[float]

    @property
    def decode_rate(self) -> float:
        """The fraction of its own speed the engine keeps beside the trainer (at most 1)."""
        return min(1.0, statistics.fmean(self.decode_alone) / statistics.fmean(self.decode_shared))

    @property
    def train_slowdown(self) -> float | None:
        """The trainer's mean step beside the engine over alone (None: no step ran wholly beside it)."""
        if not self.train_shared:
            return None
        return statistics.fmean(self.train_shared) / statistics.fmean(self.train_alone)


def train_loop(cfg: MoltConfig, device_kind: str, decoding, stop, results) -> None:
    """The trainer process: the config's step in a loop on `device_kind`. Sends ("ready", step seconds alone)
    after a warm-up step and `ALONE_STEPS` timed ones, then ("beside", seconds) for each step that ran wholly
    while `decoding` was set, and ("done", None) once `stop` is set."""
    import torch

    from molt_hpc.actor.step import train_step
    from molt_hpc.actor.world import close_world, init_world
    from molt_hpc.plan.calibrate_train import random_model, shaped, synthetic_groups, trainer_models

    for key in WORLD_ENV:  # a world of its own, on a port of its own
        os.environ.pop(key, None)
    torch.set_num_threads(1)  # a run's trainer rank has one (`launch.local.actor_child`)
    device = torch.device(device_kind)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ro = cfg.rollout
    step_cfg = shaped(cfg, cfg.actor.groups_per_step, ro.n_samples, ro.max_total_tokens)
    world = init_world(step_cfg.actor.model_copy(update={"device": device.type}))
    try:
        model, _ = random_model(cfg, device)
        models = trainer_models(step_cfg, model, world)
        del model
        vocab = models.policy.model.config.get_text_config().vocab_size
        groups = synthetic_groups(cfg.actor.groups_per_step, ro.n_samples, ro.max_total_tokens, vocab)

        def step() -> tuple[float, bool]:
            beside = decoding.is_set()
            t0 = time.perf_counter()
            train_step(groups, step_cfg, models, world, pad_id=0)
            sync()
            return time.perf_counter() - t0, beside and decoding.is_set()

        step()
        results.put(("ready", [step()[0] for _ in range(ALONE_STEPS)]))
        while not stop.is_set():
            seconds, beside = step()
            if beside:
                results.put(("beside", seconds))
        results.put(("done", None))
    finally:
        close_world(barrier=False)


def decode_steps(runner, rows: int, context: int, seconds: float, sync, more=lambda: False) -> list[float]:
    """Seconds of each decode step of the engine's scheduler over `seconds` of rounds of `rows` rows (random
    prompts of `context` tokens, 32 new tokens each), the steps that prefilled left out; rounds go on past
    `seconds` while `more()` (for at most `READY_TIMEOUT_S`)."""
    import torch

    from molt_hpc.engine.batch import Row
    from molt_hpc.engine.sampling import SamplingParams
    from molt_hpc.engine.scheduler import Scheduler

    vocab = runner.model.config.get_text_config().vocab_size
    prompts = torch.randint(4, vocab, (rows, context), generator=torch.Generator().manual_seed(0)).tolist()
    out: list[float] = []
    start = time.perf_counter()
    while not out or (now := time.perf_counter() - start) < seconds or (more() and now < READY_TIMEOUT_S):
        sched = Scheduler(runner, eos_ids=set(), max_batch=rows, max_model_len=context + 40, seed=0)
        for p in prompts:
            sched.submit(Row(list(p), SamplingParams(max_tokens=32, ignore_eos=True, top_k=0), Future()))
        while sched.rows or sched.waiting:
            t0 = time.perf_counter()
            prefilled, _ = sched.step()
            sync()
            if not prefilled:
                out.append(time.perf_counter() - t0)
    return out


class TrainerProcess:
    """A process training the config's step in a loop on the same device (`train_loop`): `alone` holds its
    steps before anything ran beside it; between `beside(True)` and `beside(False)` the caller's work runs
    beside it, and `shared` collects its steps that ran wholly inside that span (`poll()`, `finish()`)."""

    def __init__(self, cfg: MoltConfig, device_kind: str):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.decoding, self.stop, self.results = ctx.Event(), ctx.Event(), ctx.Queue()
        self.proc = ctx.Process(target=train_loop, args=(cfg, device_kind, self.decoding, self.stop, self.results),
                                daemon=True)  # fmt: skip
        self.shared: list[float] = []
        self.proc.start()
        try:
            self.alone: list[float] = self.receive("ready")
        except BaseException:
            self.close()
            raise

    def _next(self, block_s: float):
        """The process's next message within `block_s` seconds (its "beside" steps collected), else None; a
        process that ended raises."""
        import queue

        try:
            got, value = self.results.get(timeout=block_s) if block_s > 0 else self.results.get_nowait()
        except queue.Empty:
            if not self.proc.is_alive():
                code = self.proc.exitcode
                raise RuntimeError(f"the calibration's trainer process ended (exit code {code})") from None
            return None
        if got == "beside":
            self.shared.append(value)
        return got, value

    def receive(self, kind: str):
        """The process's next `kind` message's value."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            message = self._next(1.0)
            if message is not None and message[0] == kind:
                return message[1]
        raise RuntimeError(f"the calibration's trainer process sent no {kind!r} in {READY_TIMEOUT_S:g} s")

    def poll(self) -> int:
        """How many of its steps so far ran wholly beside the caller's work."""
        while self._next(0.0) is not None:
            pass
        return len(self.shared)

    def beside(self, on: bool) -> None:
        (self.decoding.set if on else self.decoding.clear)()

    def finish(self) -> list[float]:
        """Stop the process; its steps that ran wholly beside the caller's work."""
        self.decoding.clear()
        self.stop.set()
        try:
            self.receive("done")
            return self.shared
        finally:
            self.close()

    def close(self) -> None:
        self.stop.set()
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()


def measure_shared(cfg: MoltConfig, model, device, sync, rows: int, seconds: float) -> Shared:
    """Decode steps of `model` (the engine's runner, `rows` rows) alone, then beside a trainer process training
    the config's step on the same device (over at least `seconds`, three of the trainer's steps alone and one
    of its steps wholly beside them); that process's steps alone and beside the decoding."""
    import torch

    from molt_hpc.engine.main import model_runner

    context = 64
    eng = cfg.engines.model_copy(update={"max_batch": rows, "max_model_len": context + 40})
    runner = model_runner(model.eval(), device, eng, None, graphs=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(eng.threads or 1)  # a run's engine process has these (`launch.pool.engine_env`)
    try:
        decode_steps(runner, rows, context, 0.0, sync)  # records the graphs, warms the allocator
        alone = decode_steps(runner, rows, context, seconds, sync)
        trainer = TrainerProcess(cfg, device.type)
        try:
            trainer.beside(True)
            window = max(seconds, 3 * max(trainer.alone))
            shared = decode_steps(runner, rows, context, window, sync, more=lambda: trainer.poll() < 1)
            trainer.beside(False)
        except BaseException:
            trainer.close()
            raise
        return Shared(alone, shared, trainer.alone, trainer.finish())
    finally:
        torch.set_num_threads(threads)
