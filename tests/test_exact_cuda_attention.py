"""The fused GPU attention of `engines.exact` (`models.exact_cuda_attention`): what runs on the CPU here is
how a mask becomes each query's run of keys; the kernel itself runs in `tests/test_exact_gpu.py`."""

import pytest
import torch

from molt_hpc.models.exact_cuda_attention import key_ranges, runs
from tests.test_exact_blocks import _causal_left_padded, _documents


def _runs_by_hand(allowed: torch.Tensor) -> tuple[list, list]:
    firsts, counts = [], []
    for row in allowed[:, 0].tolist():
        keys = [[j for j, a in enumerate(query) if a] for query in row]
        firsts.append([q[0] if q else 0 for q in keys])
        counts.append([len(q) for q in keys])
    return firsts, counts


def test_engine_rows_and_packed_documents_become_one_run_of_keys_per_query() -> None:
    for allowed in (_causal_left_padded([0, 3, 9], nq=4, nk=12), _causal_left_padded([2], nq=12, nk=12),
                    _documents([[3, 5], [8], [1, 1, 6]], t=10)):  # fmt: skip
        first, count = key_ranges(allowed)
        assert (first.tolist(), count.tolist()) == _runs_by_hand(allowed)
    first, count = key_ranges(_causal_left_padded([5], nq=8, nk=8))
    assert count[0, :5].tolist() == [0] * 5 and count[0, 5:].tolist() == [1, 2, 3], "queries on padding: no keys"


def test_a_mask_that_is_not_one_run_per_query_is_refused() -> None:
    holes = _documents([[4, 4]], t=8).clone()
    holes[0, 0, 6, 1] = True  # a query of the second document also sees a key of the first: two runs
    assert key_ranges(holes) is None
    per_head = _documents([[4, 4]], t=8).expand(1, 3, 8, 8)
    assert key_ranges(per_head) is None


def test_runs_are_kept_per_mask_and_a_mask_changed_in_place_is_seen() -> None:
    mask = _documents([[4, 4]], t=8).clone()
    first = runs(mask)
    assert runs(mask) is first, "the same unchanged mask: the kept runs"
    mask[0, 0, 5, 4] = False
    mask[0, 0, 5, :2] = True  # query 5 now sees keys 0, 1 (of the other document) and 5: not one run
    with pytest.raises(ValueError, match="one run of consecutive keys"):
        runs(mask)
    with torch.inference_mode():
        frozen = _documents([[3, 5]], t=8)
        kept = runs(frozen)
        assert runs(frozen) is kept and [t.tolist() for t in kept] == [t.tolist() for t in key_ranges(frozen)]
