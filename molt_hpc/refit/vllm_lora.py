"""The trainer side of a LoRA run's refit into `vllm serve` engines: the adapters as a file, loaded by name.

    sender = VllmAdapterSender(token, timeout_s)
    sender.connect(engine_urls)
    sender.push(iter(()), version, extra={"lora_scaling": s, "lora_path": dir})   # dir: a PEFT adapter directory

The trainer writes each version's adapters as a PEFT adapter directory under the run directory (which
every node of the job reads) and each engine's front loads it into vLLM under a name of its own
(`engine/vllm/adapters.py`): no weight-transfer group, no pause, and the base weights never move. Once
every engine loaded version v, the directories of older versions are removed (vLLM keeps what it loaded
in memory). vLLM's NCCL and shared-memory routes stay for full refits (`vllm_sender.py`): the adapters
are a few hundred MB at most, and vLLM's LoRA manager reads them from a directory.
"""

import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from molt_hpc.log import get_logger
from molt_hpc.refit.calls import EngineCalls
from molt_hpc.refit.sender import RefitStats

LOAD_PATH = "/molt_load_adapter"


def version_dir(root: Path, version: int) -> Path:
    """Where version `version`'s adapters are written for the engines to load."""
    return root / f"v{version:06d}"


def remove_older(root: Path, version: int) -> int:
    """Remove the adapter directories of versions before `version`; how many went."""
    gone = 0
    for path in sorted(root.glob("v*")):
        if path.is_dir() and path.name[1:].isdigit() and int(path.name[1:]) < version:
            shutil.rmtree(path, ignore_errors=True)
            gone += 1
    return gone


class VllmAdapterSender:
    """Loads each version's adapter directory into every vLLM engine (same interface as `RefitSender`)."""

    def __init__(self, token: str, timeout_s: float):
        self.urls: list[str] = []
        self._calls = EngineCalls(token, timeout_s)

    def connect(self, engine_urls: Sequence[str]) -> None:
        if not engine_urls:
            raise ValueError("connect() needs at least one engine URL")
        self.urls = list(engine_urls)

    def push(
        self,
        tensors: Iterable[Any],
        version: int,
        metas: Sequence[Any] | None = None,
        extra: dict[str, Any] | None = None,
        in_place: bool = False,
    ) -> RefitStats:
        """Every engine loads the adapters of `version` from `extra["lora_path"]` (written by the trainer);
        `tensors` are not streamed (the engines read the directory). A `RuntimeError` names each engine that
        failed (the trainer retries); on success the older versions' directories are removed."""
        assert extra is not None and "lora_path" in extra, "a vLLM LoRA refit loads an adapter directory"
        path = Path(extra["lora_path"])
        t0 = time.perf_counter()
        self._calls.round(self.urls, LOAD_PATH, {"version": version, "path": str(path)})
        seconds = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in path.iterdir())
        remove_older(path.parent, version)
        get_logger().info("refit v%d: %d engines loaded the adapters (%.1f MB) in %.2fs", version, len(self.urls),
                          size / 1e6, seconds)  # fmt: skip
        return RefitStats(version, seconds, size, 0, len(self.urls))

    def close(self) -> None:
        self._calls.close()
