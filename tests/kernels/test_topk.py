"""Top-k selection: the torch reference against torch.topk and the model's tie rule; input
checks; dispatch. The Triton kernel is compared with the reference id for id in
tests/kernels/interpreted/test_topk.py and compiled for sm_90 in test_compile_sm90.py."""

from __future__ import annotations

import pytest
import torch

from jointrl.kernels import dispatch
from jointrl.kernels.topk import _select_topk_torch, select_topk


def test_reference_equals_torch_topk_without_ties():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 8, 64, generator=g, dtype=torch.float64)
    visible = torch.ones(8, 64, dtype=torch.bool).tril(56)[None].expand(3, 8, 64)
    ids = _select_topk_torch(scores, visible, 16)
    want = torch.topk(scores.masked_fill(~visible, float("-inf")), 16, dim=-1).indices.sort(-1).values
    assert torch.equal(ids, want.to(torch.int32))


def test_ties_go_to_the_most_recent_key_and_signed_zeros_tie():
    scores = torch.tensor([[[0.0, -0.0, 1.0, 0.0, -0.0, 0.5]]])
    visible = torch.ones(1, 1, 6, dtype=torch.bool)
    assert _select_topk_torch(scores, visible, 3).tolist() == [[[2, 4, 5]]]  # 1.0, 0.5, then the latest zero
    visible[..., 4:] = False
    assert _select_topk_torch(scores, visible, 6).tolist() == [[[0, 1, 2, 3, -1, -1]]]


def test_input_validation_names_the_problem():
    scores = torch.zeros(1, 2, 5)
    with pytest.raises(ValueError, match="bool visible mask"):
        select_topk(scores, torch.ones(1, 2, 5), 2)
    with pytest.raises(ValueError, match="same shape"):
        select_topk(scores, torch.ones(1, 2, 4, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="k must be >= 0"):
        select_topk(scores, torch.ones(1, 2, 5, dtype=torch.bool), -1)


def test_cpu_takes_the_reference_under_auto():
    scores = torch.arange(10.0).view(1, 1, 10)
    with dispatch.backend("auto"):
        assert select_topk(scores, torch.ones(1, 1, 10, dtype=torch.bool), 2).tolist() == [[[8, 9]]]
