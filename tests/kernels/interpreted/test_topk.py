"""Top-k selection Triton kernel == the torch reference, id for id (interpreter; see conftest)."""

from __future__ import annotations

import pytest
import torch

from jointrl.kernels import topk


def _causal_scores(B, T, S, seed):
    """Scores with many exact ties (one decimal; zeros of both signs, as ReLU sums give) under a
    causal mask for the last T of S positions; row (0, 0) sees nothing, row (B-1, 1) has holes."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, T, S, generator=g).round(decimals=1)
    scores[..., ::5] = 0.0
    scores[..., 1::5] = -0.0
    pos = torch.arange(T)[:, None] + (S - T)
    visible = (torch.arange(S)[None, :] <= pos).expand(B, T, S).clone()
    visible[0, 0] = False
    visible[-1, 1, ::2] = False
    return scores, visible


@pytest.mark.parametrize(("k", "block_s"), [
    (7, topk.TOPK_CONFIG.block_s),  # ties decide the last slots
    (7, 16),  # several scan blocks per row
    (45, topk.TOPK_CONFIG.block_s),  # more than any row sees: -1 padding
])
def test_topk_matches_reference(k, block_s):
    scores, visible = _causal_scores(1, 4, 40, seed=k + block_s)
    config = topk.TopkConfig(block_s=block_s, num_warps=4)
    got = topk._select_topk_triton(scores, visible, k, config)
    assert torch.equal(got, topk._select_topk_torch(scores, visible, k))
    assert (got[0, 0] == -1).all()


def test_topk_equals_torch_topk_on_distinct_scores():
    g = torch.Generator().manual_seed(3)
    # distinct small integers (exact in bf16, which the kernel reads as is): one right answer
    scores = torch.stack([torch.randperm(50, generator=g) for _ in range(6)]).view(2, 3, 50).to(torch.bfloat16)
    visible = (torch.arange(50) < torch.tensor([20, 35, 50])[:, None]).expand(2, 3, 50)
    got = topk.select_topk(scores, visible, 10)
    want = torch.topk(scores.float().masked_fill(~visible, float("-inf")), 10, dim=-1).indices
    assert torch.equal(got, want.sort(dim=-1).values.to(torch.int32))


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 16, 100, 299, 300])
def test_topk_longer_rows(k):
    scores, visible = _causal_scores(2, 6, 300, seed=k)
    got = topk._select_topk_triton(scores, visible, k, topk.TopkConfig(block_s=64, num_warps=4))
    assert torch.equal(got, topk._select_topk_torch(scores, visible, k))
