"""DSA Triton kernels == the torch references, forward and backward (interpreter; see conftest).

Stated bounds (relative Frobenius error): fp32 1e-5 for scores, outputs and every gradient;
bf16 indexer scores 2e-2.
"""

from __future__ import annotations

import pytest
import torch

from jointrl.kernels import dsa
from jointrl.kernels.topk import _select_topk_torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_scores_match_reference(dtype, rel):
    g = torch.Generator().manual_seed(0)
    B, T, S, n, Di = 2, 65, 70, 3, 32
    q = torch.randn(B, T, n, Di, generator=g).to(dtype)
    w = torch.randn(B, T, n, generator=g).to(dtype)
    k = torch.randn(B, S, Di, generator=g).to(dtype)
    got = dsa._indexer_scores_triton(q, w, k)
    assert got.dtype == torch.float32
    assert rel(got, dsa.indexer_scores_torch(q, w, k)) < (1e-5 if dtype == torch.float32 else 2e-2)


def _selection(B, T, S, k, seed):
    """Causal top-k of random scores: early tokens see fewer than k keys (-1 slots), token 0 of
    batch 1 sees none."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, T, S, generator=g)
    pos = torch.arange(T)[:, None] + (S - T)
    visible = (torch.arange(S)[None, :] <= pos).expand(B, T, S).clone()
    visible[1, 0] = False
    return _select_topk_torch(scores, visible, k)  # the kernel is tested in test_topk.py


def test_sparse_attention_forward_and_backward_match_reference(rel):
    g = torch.Generator().manual_seed(1)
    B, T, S, Hq, Hkv, D, topk = 2, 9, 40, 6, 2, 24, 36  # top-k spans two key blocks of 32
    ids = _selection(B, T, S, topk, seed=2)
    assert (ids < 0).any() and (ids[1, 0] < 0).all()
    q = torch.randn(B, T, Hq, D, generator=g, requires_grad=True)
    k = torch.randn(B, S, Hkv, D, generator=g, requires_grad=True)
    v = torch.randn(B, S, Hkv, D, generator=g, requires_grad=True)
    do = torch.randn(B, T, Hq, D, generator=g)

    o = dsa.sparse_attention(q, k, v, ids)
    grads = torch.autograd.grad(o, (q, k, v), do)
    o_ref = dsa._sparse_attention_torch(q, k, v, ids, D**-0.5)
    grads_ref = torch.autograd.grad(o_ref, (q, k, v), do)
    assert torch.equal(o[1, 0], torch.zeros(Hq, D))  # no key: zeros
    assert rel(o, o_ref) < 1e-5
    for name, got, want in zip("qkv", grads, grads_ref):
        assert rel(got, want) < 1e-5, name
