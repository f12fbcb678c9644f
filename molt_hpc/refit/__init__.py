"""The weight refit: trainer rank 0 pushes full weights to every engine as flat buckets.

    buckets.py   tensor metadata and the deterministic bucket plan both ends compute; pack/unpack
    group.py     the dedicated refit communicator (gloo on CPU, NCCL on GPUs) on a prefixed TCPStore
    handles.py   who shares the trainer's GPU or host; shared buffers as JSON fields (CUDA IPC, /dev/shm)
    ipc.py       the shared slots and their hand-off, for engines NCCL cannot reach (same GPU) or need not
    sender.py    `RefitSender`: the trainer side (picks each engine's transport, drives the HTTP routes)
    receiver.py  `RefitReceiver`: the engine side (joins the group or maps the slots, loads by name)
    shared_params.py  refit with no copy on the trainer's side: an engine on the trainer's GPU reads its
                      parameters in place
    calls.py     the HTTP side of a refit: the same call to every engine at once, one error naming every failure
    experts.py   per-expert HF names for the fused expert weights of transformers 5 MoE layers
    vllm_sender.py  `VllmRefitSender`: the trainer side for `vllm serve` engines (vLLM's own helpers)
    vllm_lora.py    `VllmAdapterSender`: a LoRA run's refit into `vllm serve` engines, the adapters as a
                    file loaded by name

The protocol follows vLLM's native weight-transfer API (init → start → update → finish, packed
buckets, one rank offset per engine), so a `vllm serve` engine can take the same refit.
"""

from molt_hpc.refit.sender import RefitSender, RefitStats

__all__ = ["RefitSender", "RefitStats"]
