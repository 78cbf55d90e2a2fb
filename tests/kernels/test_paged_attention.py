"""Paged decode attention: the torch reference against dense SDPA on contiguous keys/values.

The Triton kernel is compared with this reference in tests/kernels/interpreted/ and compiled
for sm_90 in test_compile_sm90.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jointrl.kernels import dispatch
from jointrl.kernels.paged_attention import paged_attention_decode


def test_reference_equals_dense_attention_over_the_unpaged_sequence():
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, bs = 3, 8, 2, 16, 4
    lens = [9, 1, 13]
    seqs_k = [torch.randn(n, Hkv, D, generator=g, dtype=torch.float64) for n in lens]
    seqs_v = [torch.randn(n, Hkv, D, generator=g, dtype=torch.float64) for n in lens]
    num_blocks = 12
    k_cache = torch.full((num_blocks, bs, Hkv, D), float("nan"), dtype=torch.float64)  # unused slots are NaN
    v_cache = k_cache.clone()
    table = torch.full((B, 5), -1, dtype=torch.int32)
    free = [11, 3, 7, 0, 5, 9, 2, 8]  # scattered physical blocks
    for b, n in enumerate(lens):
        for j in range(-(-n // bs)):
            table[b, j] = phys = free.pop(0)
            rows = slice(j * bs, min(n, (j + 1) * bs))
            k_cache[phys, : rows.stop - rows.start] = seqs_k[b][rows]
            v_cache[phys, : rows.stop - rows.start] = seqs_v[b][rows]
    q = torch.randn(B, Hq, D, generator=g, dtype=torch.float64)
    with dispatch.backend("torch"):
        out = paged_attention_decode(q, k_cache, v_cache, table, torch.tensor(lens))
    for b in range(B):
        k = seqs_k[b].repeat_interleave(Hq // Hkv, 1).transpose(0, 1)  # [Hq, n, D]
        v = seqs_v[b].repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        want = F.scaled_dot_product_attention(q[b][:, None], k, v)[:, 0]
        torch.testing.assert_close(out[b], want, rtol=1e-12, atol=1e-12)


def test_empty_context_gives_zeros():
    q = torch.randn(2, 2, 8)
    cache = torch.randn(4, 4, 2, 8)
    out = paged_attention_decode(q, cache, cache, torch.tensor([[1], [-1]]), torch.tensor([3, 0]))
    assert torch.equal(out[1], torch.zeros(2, 8)) and not out[0].isnan().any()


def test_input_validation():
    q, cache, table, lens = torch.zeros(2, 4, 8), torch.zeros(3, 4, 2, 8), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        paged_attention_decode(torch.zeros(2, 3, 8), cache, cache, table, lens)
    with pytest.raises(ValueError, match="block_table"):
        paged_attention_decode(q, cache, cache, table[:1], lens)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_decode(q, cache.transpose(2, 3).contiguous().transpose(2, 3), cache, table, lens)
