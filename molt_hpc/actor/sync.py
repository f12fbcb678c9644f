"""Refits from the trainer to the engines: gather full weights from the FSDP shards, send from rank 0.

Engines register at `RUN_DIR/rendezvous/engine-<i>.json` (`url`, `pid`, ...). Rank 0 watches the
registrations (by url and pid: a restarted engine is a new member); when they change it refits at
once, so a new engine never serves stale weights. A refit forms the group with the registered
engines that answer `/health` (a killed engine's file stays behind, and a group waits for every
member), re-forming it whenever that set changed; a failed push is retried after `RETRY_S`, since
the engines stay paused until a complete one. A refit that cannot work as configured (NCCL between
two ranks of one GPU, ...) stops the run at once, and refits that keep failing stop it once they
have failed for `refit.timeout_s`: one line with the cause and the fix (`RefitFailed`), never an
endless retry. Every rank takes part in each gather; only rank 0 sends, through `RefitSender`.
"""

import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from molt_hpc.actor import lora
from molt_hpc.actor.weights import full_tensor
from molt_hpc.actor.world import World, share
from molt_hpc.config import MoltConfig
from molt_hpc.log import get_logger
from molt_hpc.models.lora import ADAPTER
from molt_hpc.parallel.expert_gather import refit_metas, refit_split, refit_tensors
from molt_hpc.refit.buckets import TensorMeta
from molt_hpc.rundir import RunDir

RETRY_S = 5.0
Engine = tuple[int, str, int]
"""(index, url, pid) of one registered engine."""


class RefitFailed(ValueError):
    """The refit cannot succeed: the run stops (a `ValueError`: one line and exit code 2)."""


def refit_fix(error: str, cfg: MoltConfig) -> str:
    """What to change for a refit failing with `error` (a best guess from its text)."""
    if "Duplicate GPU" in error:
        return "trainer rank 0 and an engine share a GPU, which NCCL refuses: set refit.backend = 'auto' (CUDA IPC)"
    if "does not have" in error or "shape mismatch" in error:
        return "the engines serve another model than the trainer trains: give both the same model.path"
    if "init_weight_transfer_engine" in error or "did not form" in error:
        return (
            f"the engines could not join the refit group at refit.host = {cfg.refit.host!r}: set it to an address "
            "of trainer rank 0's node that the engine nodes reach (and check that no firewall blocks its port)"
        )
    return "see the engines' logs (logs/engine-*.log) for why they fail"


def _whole(p: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return full_tensor(p, dtype)[0]


def one_line(text: str, limit: int = 600) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


def answers(url: str, token: str, timeout_s: float = 2.0) -> bool:
    """Whether the engine at `url` answers `/health` (a registration outlives a killed engine)."""
    req = urllib.request.Request(url.rstrip("/") + "/health", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:  # refused, reset or timed out: not an engine to form a group with now
        return False


class EngineSync:
    """The trainer's refit state: the registrations last seen, the engines the group was formed with,
    and the sender (rank 0)."""

    def __init__(self, cfg: MoltConfig, run_dir: Path, world: World):
        self.world = world
        self.run = RunDir(Path(run_dir))
        self.dtype = getattr(torch, cfg.model.dtype)
        self.seen: list[Engine] = []
        self.connected: list[Engine] = []
        self.retry_at: float | None = None
        self.failing_since: float | None = None
        """When the first of the refits failing in a row started (rank 0)."""
        self.timeout_s = cfg.refit.timeout_s
        self.cfg = cfg
        self.sender = None
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="refit-health")
        self._layout: tuple[tuple[int, ...], set[str], list] = ((), set(), [])
        """The parameters (ids) a refit's EP-split names and metadata were computed for, and those: walking
        the modules for them each refit costs milliseconds at hundreds of tensors."""
        self.adapter_root = self.run.path / "refit-adapters" if cfg.engines.kind == "vllm" and cfg.actor.lora else None
        """A LoRA run served by vLLM: each version's adapters are written here for the engines to load."""
        if world.is_main and self.adapter_root is not None:
            from molt_hpc.refit.vllm_lora import VllmAdapterSender

            self.sender = VllmAdapterSender(self.run.token(), cfg.refit.timeout_s)
        elif world.is_main and cfg.engines.kind == "vllm":
            from molt_hpc.refit.vllm_sender import VllmRefitSender

            self.sender = VllmRefitSender(cfg.refit, self.run.token(), device=world.device)
        elif world.is_main:
            from molt_hpc.refit import RefitSender

            self.sender = RefitSender(run_dir, cfg.refit, self.run.token(), device=world.device)

    def wants_refit(self) -> bool:
        """Rank 0: the registrations differ from those of the last refit (an engine came, restarted or
        left), or the last refit failed a while ago (engines stay paused until a complete push)."""
        if not self.world.is_main:
            return False
        retry = self.retry_at is not None and time.monotonic() >= self.retry_at
        return retry or registered_engines(self.run) not in ([], self.seen)

    def _live_engines(self) -> list[Engine]:
        self.seen = registered_engines(self.run)
        token = self.run.token()
        alive = list(self._pool.map(lambda e: answers(e[1], token), self.seen))
        return [e for e, ok in zip(self.seen, alive, strict=True) if ok]

    def refit(self, model: nn.Module, version: int) -> float | None:
        """Push `model`'s full weights as `version` to every live registered engine (a collective).

        Returns the seconds it took, or None when no engine answers or the push failed (then
        `wants_refit` asks for another try after `RETRY_S`). Raises `RefitFailed` on every rank when
        the refit cannot succeed.
        """
        engines = share(self._live_engines() if self.world.is_main else None)
        if not engines:
            return None
        t0 = time.perf_counter()
        # One full tensor in flight at a time. Several ranks gather shards cast to the wire dtype (fewer
        # bytes on the link); a world of one hands its fp32 weights over as they are and the sender casts
        # them while packing (one pass instead of two).
        dtype = self.dtype if self.world.size > 1 else None
        ok, fatal = True, None
        key = tuple(map(id, model.parameters()))
        lora_info = {"lora_scaling": lora.scaling(model)} if lora.has_adapters(model) else None
        if key != self._layout[0] and lora_info is None:
            split = refit_split(model)
            self._layout = (key, split, refit_metas(model, self.dtype, split))
        with torch.no_grad():  # plain views of the parameters (no autograd op per tensor)
            if lora_info is not None:  # LoRA: the adapters alone (the engines keep the base), whole and fp32
                adapters = lora.full_adapters(model, keep=self.world.is_main, host=self.adapter_root is not None)
                tensors, metas = iter(adapters.items()), [TensorMeta.of(n, t) for n, t in adapters.items()]
                if self.adapter_root is not None:  # vLLM loads them from a PEFT directory
                    lora_info["lora_path"] = str(self._write_adapters(model, adapters, version))
                    tensors = iter(())
            else:
                tensors = refit_tensors(model, dtype, _whole, self._layout[1])  # EP experts: per expert
                metas = self._layout[2]
            if self.sender is not None:
                try:
                    ok = self._push(engines, tensors, version, metas, lora_info)
                except RefitFailed as err:
                    ok, fatal = False, str(err)
            for _ in tensors:  # the other ranks (and rank 0 after a failed push) finish every gather
                pass
        ok, fatal = share((ok, fatal))
        if fatal is not None:
            raise RefitFailed(fatal)
        return time.perf_counter() - t0 if ok else None

    def _write_adapters(self, model: nn.Module, adapters: dict[str, torch.Tensor], version: int) -> Path:
        """Rank 0 writes `adapters` as version `version`'s PEFT directory for vLLM's engines (`refit/vllm_lora.py`)."""
        from molt_hpc.refit.vllm_lora import version_dir

        assert self.adapter_root is not None
        out = version_dir(self.adapter_root, version)
        if self.world.is_main:
            lora.write_adapter(out, adapters, model.peft_config[ADAPTER], Path(self.cfg.model.path))
        return out

    def _push(self, engines: list[Engine], tensors, version: int, metas, extra: dict | None) -> bool:
        assert self.sender is not None
        started = time.monotonic()
        try:
            if engines != self.connected:
                self.connected = []
                self.sender.connect([url for _, url, _ in engines])
                self.connected = engines
            # a world of one hands over its own parameters: engines on its GPU can read them in place
            if extra is not None:
                self.sender.push(tensors, version, metas=metas, extra=extra)
            else:
                self.sender.push(tensors, version, metas=metas, in_place=self.world.size == 1)
        except ValueError as err:  # cannot work as configured: no retry can help
            self.connected = []
            raise RefitFailed(f"refit v{version} cannot succeed: {one_line(str(err))}") from None
        except (RuntimeError, OSError) as err:  # an engine died, restarts or refused: form a new group soon
            self.connected = []
            self.failing_since = self.failing_since or started
            failing = time.monotonic() - self.failing_since
            if failing >= self.timeout_s:
                raise RefitFailed(
                    f"refits have failed for {failing:.0f} s (refit.timeout_s = {self.timeout_s:.0f}); last error: "
                    f"{one_line(str(err))} -- fix: {refit_fix(str(err), self.cfg)}"
                ) from None
            get_logger().warning("refit v%d failed; retrying in %.0f s: %s", version, RETRY_S, err)
            self.retry_at = time.monotonic() + RETRY_S
            return False
        self.retry_at = None
        self.failing_since = None
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        if self.sender is not None:
            self.sender.close()
