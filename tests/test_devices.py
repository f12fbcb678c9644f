"""The launcher's and the plan's GPU count: torch's own count, with torch imported only where a driver is."""

import os
import subprocess
import sys

from molt_hpc.devices import DRIVER_NODES, device_gpu_count


def test_the_count_is_torchs_and_needs_torch_only_with_a_driver() -> None:
    import torch

    assert device_gpu_count() == torch.cuda.device_count()
    code = "import sys; from molt_hpc.devices import device_gpu_count as n; print(n(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) == torch.cuda.device_count()
    assert out[1] == str(any(os.path.exists(node) for node in DRIVER_NODES))
