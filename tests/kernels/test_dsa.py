"""DSA torch references: sparse attention against dense SDPA with the selection as a mask;
the indexer and top-k against the model's reference layer (model/dsa.py) where it exists.

The Triton kernels are compared with these references in tests/kernels/interpreted/ and
compiled for sm_90 in test_compile_sm90.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jointrl.kernels import dispatch, dsa


def test_sparse_reference_equals_masked_dense_attention():
    g = torch.Generator().manual_seed(0)
    B, T, S, Hq, Hkv, D = 2, 5, 12, 4, 2, 8
    q = torch.randn(B, T, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.stack([torch.randperm(S, generator=g)[:6] for _ in range(T)]) for _ in range(B)])
    ids[0, 1, 3:] = -1
    with dispatch.backend("torch"):
        o = dsa.sparse_attention(q, k, v, ids)
    mask = torch.zeros(B, T, S, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            mask[b, t, ids[b, t][ids[b, t] >= 0]] = True
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask[:, None], enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(o, want, rtol=1e-12, atol=1e-12)


def test_indexer_and_topk_equal_their_definitions():
    """The indexer reference (matmuls, the 1/√Di after the head sum) equals its formula written out; the
    kernel form of the selection (``select_topk``) picks the keys of the layer's rule (``topk.topk_mask``)."""
    from jointrl.kernels.topk import topk_mask

    g = torch.Generator().manual_seed(1)
    B, T, S, n, Di = 2, 7, 11, 3, 16
    q, w, k = torch.randn(B, T, n, Di, generator=g), torch.randn(B, T, n, generator=g), torch.randn(B, S, Di, generator=g)
    want = torch.einsum("btn,btns->bts", w, F.relu(torch.einsum("btnd,bsd->btns", q, k) * Di**-0.5))
    with dispatch.backend("torch"):
        scores = dsa.indexer_scores(q, w, k)
    torch.testing.assert_close(scores, want, rtol=1e-6, atol=1e-6)
    scores = scores.round(decimals=1)  # plenty of ties: the tie rule matters
    visible = torch.rand(B, T, S, generator=g) < 0.6
    for topk in (3, 20):
        ids = dsa.select_topk(scores, visible, topk)
        chosen = torch.zeros(B, T, S + 1, dtype=torch.bool).scatter_(-1, ids.long() % (S + 1), True)[..., :S]
        assert torch.equal(chosen, topk_mask(scores, visible, topk))
        assert ids.shape == (B, T, topk)


def test_input_validation():
    q, kv = torch.zeros(1, 2, 4, 8), torch.zeros(1, 5, 3, 8)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        dsa.sparse_attention(q, kv, kv, torch.zeros(1, 2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="ids"):
        dsa.sparse_attention(q, kv[:, :, :2], kv[:, :, :2], torch.zeros(1, 3, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="indexer_scores"):
        dsa.indexer_scores(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 4), torch.zeros(1, 5, 8))
