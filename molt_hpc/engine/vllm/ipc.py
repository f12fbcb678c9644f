"""Inside `vllm serve`'s GPU workers: where the worker runs, and the engine side of the shared-memory refit.

vLLM 0.26's own IPC weight transfer takes its handles over HTTP only as a pickle (and only with
`VLLM_ALLOW_INSECURE_SERIALIZATION=1`). Instead `vllm serve --worker-extension-cls
molt_hpc.engine.vllm.ipc.MoltWorkerExtension` mixes these methods into each worker, and the trainer
calls them through vLLM's dev route `POST /collective_rpc` (behind our front, which forwards only
`molt_*` methods), each with one JSON string argument that `refit.ipc` validates field by field:

    molt_place()                    → where this worker's GPU is (`handles.place`)
    molt_ipc_init(json init_info)   → map the trainer's slots (CUDA IPC handles, same fields as the builtin engine)
    molt_ipc_update(json update_info) → copy each bucket out of its slot into the model, as the trainer posts it

Loading goes through the model's own `load_weights` (vLLM's name mapping, fused QKV and gate-up
projections), one bucket at a time; the device is synchronised before a slot is handed back. vLLM's
native start/finish session is not used here: its layerwise reload keeps references to loaded
tensors until a layer completes, which a reused slot would overwrite.
"""

import contextlib
import json
from typing import Any

import torch

from molt_hpc.refit.buckets import metas_from_info, plan_buckets, unpack
from molt_hpc.refit.handles import place
from molt_hpc.refit.ipc import IpcInbox


class MoltWorkerExtension:
    """Methods vLLM adds to its GPU worker class (`self` is the worker: `device`, `get_model()`)."""

    def molt_place(self) -> dict[str, Any]:
        return place(self.device)

    def molt_ipc_init(self, init_info: str) -> dict[str, Any]:
        info = json.loads(init_info)
        spec = info.get("ipc") if isinstance(info, dict) else None
        if not isinstance(spec, dict):
            raise ValueError("molt_ipc_init needs {'ipc': <the trainer's slot handles>, 'timeout_s': ...}")
        old = getattr(self, "_molt_inbox", None)
        if old is not None:
            old.close()
        with _on(self.device):
            self._molt_inbox = IpcInbox(spec, float(info.get("timeout_s", 600.0)))
        return {"transport": "ipc", "slots": len(self._molt_inbox.buffers)}

    def molt_ipc_update(self, update_info: str) -> dict[str, Any]:
        info = json.loads(update_info)
        inbox = getattr(self, "_molt_inbox", None)
        if inbox is None:
            raise ValueError("no shared slots: call molt_ipc_init before molt_ipc_update")
        first, bucket_bytes = info.get("ipc_first"), info.get("bucket_bytes")
        if not isinstance(first, int) or not isinstance(bucket_bytes, int) or first < 0 or bucket_bytes <= 0:
            raise ValueError("update_info needs integers ipc_first >= 0 and bucket_bytes > 0")
        plan = plan_buckets(metas_from_info(info), bucket_bytes)
        model = self.get_model()  # the worker's model (unwrapped from CUDA-graph wrappers)
        loaded: set[str] = set()
        with _on(self.device), torch.no_grad():
            for k, bucket in enumerate(plan):
                g = first + k
                if bucket.nbytes > inbox.slot(g).numel():
                    raise ValueError(f"refit bucket {k} ({bucket.nbytes} bytes) does not fit the shared slots")
                inbox.wait_posted(g)
                loaded |= set(model.load_weights(list(unpack(inbox.slot(g), bucket))) or ())
                if self.device.type == "cuda":  # every copy out of the slot has run, whatever its stream
                    torch.cuda.synchronize(self.device)
                inbox.consumed(g)
        sent = sum(len(b.metas) for b in plan)
        if sent and not loaded:
            raise ValueError(f"vLLM's load_weights took none of the {sent} tensors sent: do the names match the model?")
        return {"loaded": sent, "parameters": len(loaded)}


def _on(device: torch.device):
    """`device` as the current CUDA device (vLLM workers run on a GPU; a CPU test worker has none)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
