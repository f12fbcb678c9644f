"""The GPUs this machine has for the processes a launcher starts, counted without importing torch where no GPU
driver is installed: the plan and the launcher ask before anything starts, and torch's import is seconds."""

import os

DRIVER_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")
"""NVIDIA's device nodes and driver directory, AMD's compute node (ROCm builds of torch answer through
`torch.cuda`), WSL's GPU node: with none of them present, torch finds no GPU either."""


def device_gpu_count() -> int:
    """`torch.cuda.device_count()`, or 0 without importing torch when no GPU driver is installed."""
    if not any(os.path.exists(node) for node in DRIVER_NODES):
        return 0
    import torch

    return torch.cuda.device_count()
