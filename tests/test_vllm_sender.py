"""The trainer side of a vLLM refit, what runs without a GPU: rank layout, the update_info vLLM reads,
the metadata check, the error when vLLM is missing, and the shared-memory refit's worker extension
against a stand-in worker. (The transfers themselves: tests/test_vllm_gpu.py.)"""

import importlib.util

import pytest
import torch

from molt_hpc.refit.buckets import TensorMeta
from molt_hpc.refit.vllm_sender import NUM_BUFFERS, _checked, import_vllm_transfer, rank_offsets, vllm_update_info


def test_rank_offsets_follow_engine_sizes() -> None:
    # trainer = rank 0; engines of TP 2, 1 and 4 take ranks 1-2, 3, 4-7
    assert rank_offsets([2, 1, 4]) == [1, 3, 4]
    assert rank_offsets([1] * 3) == [1, 2, 3]


def test_update_info_has_vllm_field_names() -> None:
    metas = [TensorMeta("a.weight", "bfloat16", (4, 3)), TensorMeta("b", "float32", (5,))]
    info = vllm_update_info(metas, 1 << 20)
    assert info == {
        "names": ["a.weight", "b"],
        "dtype_names": ["bfloat16", "float32"],
        "shapes": [[4, 3], [5]],
        "packed": True,
        "packed_buffer_size_bytes": 1 << 20,
        "packed_num_buffers": NUM_BUFFERS,
    }


def test_checked_refuses_a_tensor_that_differs_from_its_announcement() -> None:
    metas = [TensorMeta("a", "bfloat16", (2, 2)), TensorMeta("b", "bfloat16", (3,))]
    good = [("a", torch.zeros(2, 2)), ("b", torch.zeros(3))]
    assert [name for name, _ in _checked(iter(good), metas)] == ["a", "b"]
    for bad in ([("a", torch.zeros(2, 2)), ("b", torch.zeros(4))], [("b", torch.zeros(3)), ("a", torch.zeros(2, 2))]):
        with pytest.raises(ValueError, match="does not match its announced metadata"):
            list(_checked(iter(bad), metas))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_missing_vllm_names_the_extra() -> None:
    with pytest.raises(ValueError, match=r"molt-hpc\[gpu\]"):
        import_vllm_transfer()


class StandInWorker:
    """Stands in for vLLM's GPU worker, which cannot run here: a device and a model whose `load_weights`
    copies each (HF name, tensor) into the parameter of that name, as vLLM's default loader does."""

    def __init__(self, model: torch.nn.Module):
        self.device = torch.device("cpu")
        self.model = model
        self.model.load_weights = self._load  # vLLM models carry their own load_weights

    def get_model(self) -> torch.nn.Module:
        return self.model

    def _load(self, weights) -> set[str]:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)
        return {name for name, _ in weights}


def test_worker_extension_loads_what_the_slot_writer_posts(tiny_model_dir) -> None:
    """The engine side that runs inside vLLM's worker (engine/vllm/ipc.py) against the trainer side
    VllmRefitSender uses (SlotWriter), over real shared slots: JSON in, each bucket loaded as posted."""
    import json
    import threading

    from molt_hpc.engine.vllm.ipc import MoltWorkerExtension
    from molt_hpc.models import load_causal_lm
    from molt_hpc.refit.buckets import plan_buckets, update_info
    from molt_hpc.refit.ipc import IpcChannel, SlotWriter

    class Worker(StandInWorker, MoltWorkerExtension):
        pass

    engine, trainer = load_causal_lm(tiny_model_dir), load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.1)
    worker = Worker(engine)
    assert worker.molt_place()["device_uuids"] == []
    metas = [TensorMeta.of(n, p) for n, p in trainer.named_parameters()]
    plan = plan_buckets(metas, 64 << 10)  # many buckets through 2 slots
    channel = IpcChannel(torch.device("cpu"), max(b.nbytes for b in plan), consumers=1, timeout_s=30)
    try:
        assert worker.molt_ipc_init(json.dumps({"ipc": channel.init_info(0), "timeout_s": 30}))["slots"] == 2
        for version in (1, 2):  # the same slots twice: the channel's bucket count goes on
            info = {**update_info(metas, 64 << 10, version), "ipc_first": channel.posted}
            answer: dict = {}
            receive = threading.Thread(target=lambda i=info, a=answer: a.update(worker.molt_ipc_update(json.dumps(i))))
            receive.start()
            writer = SlotWriter(channel, plan, check=lambda: None)
            for _, tensor in trainer.named_parameters():
                writer.add(tensor)
            receive.join(timeout=60)
            assert writer.done() and answer["loaded"] == len(metas) and len(plan) > 4
            for (name, got), want in zip(engine.named_parameters(), trainer.parameters(), strict=True):
                assert torch.equal(got, want), name
        with pytest.raises(ValueError, match="ipc_first"):
            worker.molt_ipc_update(json.dumps(update_info(metas, 64 << 10, 3)))
    finally:
        channel.close()
