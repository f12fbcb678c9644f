"""The trainer side of a vLLM refit, what runs without a GPU: rank layout, the update_info vLLM reads,
the metadata check, and the error when vLLM is missing. (The transfer itself: tests/test_vllm_gpu.py.)"""

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
