"""The refit channel: the bucket plan both ends compute, packing and unpacking, sender misuse."""

import time

import pytest
import torch

from molt_hpc.config.infra import RefitConfig
from molt_hpc.refit import RefitSender
from molt_hpc.refit.buckets import ALIGN, LARGE, CopyPlan, TensorMeta, pack_into, plan_buckets, unpack


def test_bucket_plan_is_deterministic_aligned_and_capped() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [
        ("a", torch.randn(3, 5, generator=gen)),
        ("b", torch.randn(7, generator=gen).bfloat16()),
        ("c", torch.randint(0, 9, (4, 4), generator=gen)),
        ("d", torch.rand(6, generator=gen) > 0.5),
        ("e", torch.randn(100, generator=gen)),  # 400 bytes: larger than the cap, a bucket of its own
        ("f", torch.randn(2, 2, generator=gen).half()),
    ]
    metas = [TensorMeta.of(n, t) for n, t in tensors]
    cap = 160
    plan = plan_buckets(metas, cap)
    assert plan == plan_buckets(list(metas), cap), "both ends compute the same plan"
    assert [m for b in plan for m in b.metas] == metas, "order is kept, nothing lost"
    for bucket in plan:
        assert bucket.nbytes <= cap or len(bucket.metas) == 1
        assert all(off % ALIGN == 0 for off in bucket.offsets)
        ends = [off + m.nbytes for off, m in zip(bucket.offsets, bucket.metas, strict=True)]
        assert all(end <= nxt for end, nxt in zip(ends, bucket.offsets[1:], strict=False)), "no overlap"
    # independent expectation: greedy fill, a new bucket when the aligned end would pass the cap
    sizes = [15 * 4, 7 * 2, 16 * 8, 6, 400, 4 * 2]
    expect, cur, used = [], [], 0
    for name, size in zip("abcdef", sizes, strict=True):
        start = -(-used // ALIGN) * ALIGN
        if cur and start + size > cap:
            expect.append(cur)
            cur, start = [], 0
        cur.append(name)
        used = start + size
    expect.append(cur)
    assert [[m.name for m in b.metas] for b in plan] == expect
    for bucket in plan:
        by_name = dict(tensors)
        buf = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        flat = pack_into(buf, bucket, [by_name[m.name] for m in bucket.metas])
        for name, view in unpack(flat.clone(), bucket):
            assert view.dtype == by_name[name].dtype and torch.equal(view, by_name[name])


def test_a_copy_plan_copies_and_casts_every_tensor_large_or_small() -> None:
    """Large tensors get a kernel each, the rest one multi-tensor copy: every target ends equal to its
    source cast to the target's dtype, whichever group it fell in."""
    gen = torch.Generator().manual_seed(1)
    sizes = [LARGE + 3, 5, LARGE, 1, LARGE - 1, 64]
    source = [torch.randn(n, generator=gen) for n in sizes]
    into = [torch.zeros(n, dtype=torch.bfloat16 if i % 2 else torch.float32) for i, n in enumerate(sizes)]
    plan = CopyPlan(into, source)
    assert [d.numel() for d, _ in plan.large] == [LARGE + 3, LARGE] and len(plan.small[0]) == 4
    plan.run()
    for dst, src in zip(into, source, strict=True):
        assert torch.equal(dst, src.to(dst.dtype))
    source[0].add_(1.0)  # a plan is kept across refits: it reads the sources as they are now
    plan.run()
    assert torch.equal(into[0], source[0])


def test_sender_refuses_misuse_with_clear_errors(tmp_path) -> None:
    sender = RefitSender(tmp_path, RefitConfig(host="127.0.0.1"), "token")
    with pytest.raises(ValueError, match="connect"):
        sender.push([("w", torch.zeros(2))], version=1)
    with pytest.raises(ValueError, match="at least one engine"):
        sender.connect([])
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([TensorMeta("w", "float32", (2,))], 0)
    sender.close()


def test_connect_fails_at_once_when_an_engine_cannot_join(tmp_path) -> None:
    (tmp_path / "rendezvous").mkdir()
    sender = RefitSender(tmp_path, RefitConfig(host="127.0.0.1", timeout_s=3), "token")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"127\.0\.0\.1:1"):
        sender.connect(["http://127.0.0.1:1"])  # nothing listens on port 1
    assert time.monotonic() - t0 < 2.5, "an engine that cannot join fails the connect before the group timeout"
    sender.close()
