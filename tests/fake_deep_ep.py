"""A fake of DeepEP's intranode `Buffer` (normal kernels) over gloo, for CPU tests of the DeepEP dispatch.

DeepEP needs Hopper GPUs and NVLink, so it cannot run here; this stand-in keeps its interface and
data layout as DeepEP documents them: `get_dispatch_layout`, `dispatch` (each token once to every
rank that holds one of its experts, top-k ids made local, −1 elsewhere, with its weights; or again
with a cached `handle`), `combine` (the ranks' rows of each token summed, and their top-k weights).
"""

import torch
import torch.distributed as dist


class FakeDeepEPBuffer:
    """DeepEP's `Buffer` semantics for one EP group, moved by `all_to_all_single` (a fake, named so)."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        self.group, self.ranks, self.experts = group, group.size(), num_experts

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        per_expert = torch.bincount(topk_idx[topk_idx >= 0].reshape(-1), minlength=num_experts)
        owner = torch.where(topk_idx >= 0, topk_idx // (num_experts // self.ranks), -1)
        in_rank = torch.stack([(owner == r).any(dim=1) for r in range(self.ranks)], dim=1)
        return in_rank.sum(0).int(), None, per_expert.int(), in_rank, None

    def _a2a(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=self.group)
        return out

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, is_token_in_rank=None, num_tokens_per_expert=None,
                 topk_idx=None, topk_weights=None, **_):  # fmt: skip
        if handle is None:
            in_rank = is_token_in_rank
            src = [torch.nonzero(in_rank[:, r]).reshape(-1) for r in range(self.ranks)]
            send = [len(s) for s in src]
            recv_t = torch.empty(self.ranks, dtype=torch.int64)
            dist.all_to_all_single(recv_t, torch.tensor(send, dtype=torch.int64), group=self.group)
            handle = (torch.cat(src), send, recv_t.tolist(), x.shape[0])
        order, send, recv, _ = handle
        recv_x = self._a2a(x[order], send, recv)
        if topk_idx is None:
            return recv_x, None, None, None, None, None
        local_n = self.experts // self.ranks
        owner = torch.cat([torch.full((n,), r) for r, n in enumerate(send)])
        idx = topk_idx[order]
        mine = (idx >= 0) & (idx // local_n == owner.unsqueeze(1))
        local_idx = torch.where(mine, idx - owner.unsqueeze(1) * local_n, -1)
        weights = torch.where(mine, topk_weights[order], 0.0)
        recv_idx, recv_w = self._a2a(local_idx, send, recv), self._a2a(weights, send, recv)
        counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=local_n).tolist()
        return recv_x, recv_idx, recv_w, counts, handle, None

    def combine(self, x, handle, topk_weights=None, **_):
        order, send, recv, tokens = handle
        back = self._a2a(x, recv, send)
        out = x.new_zeros((tokens, x.shape[1])).index_add(0, order, back)
        if topk_weights is None:
            return out, None, None
        w = self._a2a(topk_weights, recv, send)
        return out, topk_weights.new_zeros((tokens, w.shape[1])).index_add(0, order, w), None
