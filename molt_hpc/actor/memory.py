"""Peak memory of each training step, for `metrics.jsonl` (so every run checks the memory plan).

A step here is the whole iteration: the update, and the refit and checkpoint when they ran in it.

- `mem_peak_allocated_gb`, `mem_peak_reserved_gb` (GPU trainers only): `torch.cuda.max_memory_allocated`
  and `max_memory_reserved` since the step began, the largest over ranks. A CPU trainer has no
  caching allocator whose counters mean the same, so it reports neither.
- `mem_peak_host_rss_gb` (every trainer): the process's resident set high-water mark during the step
  (`VmHWM`, reset through `/proc/self/clear_refs` before the step), the largest over ranks: the host
  memory a node must have per rank, offloaded state included. Omitted where the kernel does not let a
  process reset its mark (it would be the peak since the process started, not of the step).

GB here is 10^9 bytes.
"""

import re

import torch
import torch.distributed as dist

GB = 1e9


def reset_host_peak() -> bool:
    """Restart this process's resident-set high-water mark from its current size; False where impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def host_peak_bytes() -> int:
    """This process's resident-set high-water mark (since start or the last reset), in bytes."""
    with open("/proc/self/status") as f:
        match = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


class StepMemory:
    """Resets the peak counters at the start of a step and reads them (max over ranks) at its end."""

    def __init__(self, device: torch.device):
        self.device = device
        self.host = False

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.host = reset_host_peak()

    def peaks(self) -> dict[str, float]:
        """The step's peaks in GB, the largest over ranks (a collective: every rank calls it)."""
        cuda = self.device.type == "cuda"
        alloc = torch.cuda.max_memory_allocated(self.device) if cuda else 0
        reserved = torch.cuda.max_memory_reserved(self.device) if cuda else 0
        # the same collective on every rank; the last entry is 1 where a rank could not reset its host mark
        t = torch.tensor([alloc, reserved, host_peak_bytes(), 0.0 if self.host else 1.0], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out = {}
        if cuda:
            out = {
                "mem_peak_allocated_gb": round(t[0].item() / GB, 4),
                "mem_peak_reserved_gb": round(t[1].item() / GB, 4),
            }
        if t[3].item() == 0.0:
            out["mem_peak_host_rss_gb"] = round(t[2].item() / GB, 4)
        return out
