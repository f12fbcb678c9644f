"""Refits from the trainer to the engines: gather full weights from the FSDP shards, send from rank 0.

Engines register at `RUN_DIR/rendezvous/engine-<i>.json` (`url`, `pid`, ...). Rank 0 watches the
set of registered engines (by url and pid: a restarted engine is a new member) and re-forms the
refit group whenever it changes, then pushes the current weights so a new engine never serves
stale ones. Every rank takes part in each gather; only rank 0 sends, through `RefitSender`.
"""

import json
import time
from pathlib import Path

import torch
from torch import nn

from molt_hpc.actor.weights import full_buckets
from molt_hpc.actor.world import World, share
from molt_hpc.config import MoltConfig
from molt_hpc.log import get_logger
from molt_hpc.refit.buckets import TensorMeta, dtype_name
from molt_hpc.rundir import RunDir

Engine = tuple[int, str, int]
"""(index, url, pid) of one registered engine."""


def registered_engines(run: RunDir) -> list[Engine]:
    """Engines whose registration file is complete, by index."""
    out = []
    for path in sorted(run.rendezvous.glob("engine-*.json")):
        try:
            rec = json.loads(path.read_text())
            out.append((int(rec["index"]), str(rec["url"]), int(rec["pid"])))
        except (FileNotFoundError, json.JSONDecodeError, KeyError, ValueError):  # being replaced: next look
            continue
    return sorted(out)


class EngineSync:
    """The trainer's refit state: the engines the group was formed with, and the sender (rank 0)."""

    def __init__(self, cfg: MoltConfig, run_dir: Path, world: World):
        self.world = world
        self.run = RunDir(Path(run_dir))
        self.dtype = getattr(torch, cfg.model.dtype)
        self.connected: list[Engine] = []
        self.sender = None
        if world.is_main:
            from molt_hpc.refit import RefitSender

            self.sender = RefitSender(run_dir, cfg.refit, self.run.token(), device=world.device)

    def engines_changed(self) -> bool:
        """Rank 0: engines registered that the group was not formed with (or some left)."""
        return self.world.is_main and registered_engines(self.run) not in ([], self.connected)

    def refit(self, model: nn.Module, version: int) -> float | None:
        """Push `model`'s full weights as `version` to every registered engine (a collective).

        Returns the seconds it took, or None when no engine is registered or the push failed (the
        group is then re-formed at the next refit).
        """
        engines = share(registered_engines(self.run) if self.world.is_main else None)
        if not engines:
            return None
        t0 = time.perf_counter()
        plan = [[name] for name, _ in model.named_parameters()]  # one full tensor in flight at a time
        gathered = full_buckets(model, plan, keep=self.world.is_main, dtype=self.dtype, device=self.world.device)
        tensors = (item for bucket in gathered for item in bucket.items())
        ok = True
        if self.sender is not None:
            ok = self._push(engines, model, tensors, version)
        for _ in tensors:  # the other ranks (and rank 0 after a failed push) finish every gather
            pass
        ok = share(ok)
        return time.perf_counter() - t0 if ok else None

    def _push(self, engines: list[Engine], model: nn.Module, tensors, version: int) -> bool:
        assert self.sender is not None
        metas = [TensorMeta(n, dtype_name(self.dtype), tuple(p.shape)) for n, p in model.named_parameters()]
        try:
            if engines != self.connected:
                self.connected = []
                self.sender.connect([url for _, url, _ in engines])
                self.connected = engines
            self.sender.push(tensors, version, metas=metas)
        except (RuntimeError, OSError, ValueError) as err:  # an engine died or refused: re-form the group next time
            get_logger().warning("refit v%d failed, the engines keep their weights: %s", version, err)
            self.connected = []
            return False
        return True

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
