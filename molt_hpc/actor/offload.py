"""`actor.offload = "optimizer"`: AdamW's state lives in pinned host memory between steps.

The moments (`exp_avg`, `exp_avg_sq`: 8 bytes per trained parameter, sharded) are copied to the
GPU just before `optimizer.step()` and back right after it, through the optimizer's own step hooks,
so the training step's code does not change. While the forward and backward run, their GPU memory
is free. The copies run on the current stream (ordered with the update itself); after the copy back
the stream is synchronised, so anything that reads the host copies between steps (a checkpoint)
reads finished values. `"full"` offload is FSDP2's `CPUOffloadPolicy` instead (see `parallelize`).

A DTensor state keeps its sharding spec; only its local tensor changes device (FSDP2's CPU offload
holds its parameters the same way), so checkpoints save and restore it unchanged.
"""

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _rewrap(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    # DTensor.from_local would move `local` back to the mesh's device; the constructor keeps it where it is
    return DTensor(local, like._spec, requires_grad=False) if isinstance(like, DTensor) else local


class OptimizerOffload:
    """Moves `optimizer`'s tensor state to host memory after each step and to `device` before the next."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer, self.device = optimizer, torch.device(device)
        self.pin = self.device.type == "cuda"
        self.host: dict[tuple[int, str], torch.Tensor] = {}  # reused host buffers, one per state tensor
        self.on_host = False
        optimizer.register_step_pre_hook(lambda *_: self.to_device())
        optimizer.register_step_post_hook(lambda *_: self.to_host())

    def _tensors(self):
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if key != "step" and torch.is_tensor(value):  # the step count is a scalar: not worth moving
                    yield id(param), state, key, value

    def to_host(self) -> None:
        for pid, state, key, value in list(self._tensors()):
            local = _local(value)
            buf = self.host.get((pid, key))
            if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                buf = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=self.pin)
                self.host[(pid, key)] = buf
            buf.copy_(local, non_blocking=self.pin)
            state[key] = _rewrap(value, buf)
        if self.pin:
            torch.cuda.current_stream(self.device).synchronize()
        self.on_host = True

    def to_device(self) -> None:
        if not self.on_host:  # the first step, or state just restored from a checkpoint: already there
            return
        for _, state, key, value in list(self._tensors()):
            local = _local(value).to(self.device, non_blocking=self.pin, copy=True)
            state[key] = _rewrap(value, local)
        self.on_host = False

    def host_bytes(self) -> int:
        """Bytes of host memory holding the state."""
        return sum(b.numel() * b.element_size() for b in self.host.values())
