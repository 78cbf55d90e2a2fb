"""Paged decode attention Triton kernel == the torch reference (interpreter; see conftest).

Stated bounds (relative Frobenius error): fp32 1e-5; bf16 2e-2 (bf16 inputs, p rounded to bf16
before the p·V dot as on the GPU, and the interpreter's fp32 -> bf16 truncation).
"""

from __future__ import annotations

import pytest
import torch

from jointrl.kernels import paged_attention as pa

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _cache(context_lens, hq, hkv, d, block_size, seed, dtype=torch.float32):
    """Engine-shaped fused cache [slots, 2, Hkv, D] viewed as strided k/v caches, and a block
    table whose rows use scattered physical blocks and hold -1 past each sequence's blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(need) + 3  # spare blocks stay unused
    kv = torch.randn(num_blocks * block_size, 2, hkv, d, generator=g).to(dtype)
    kv5 = kv.view(num_blocks, block_size, 2, hkv, d)
    k_cache, v_cache = kv5[:, :, 0], kv5[:, :, 1]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(context_lens), max(need) + 2), -1, dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    q = torch.randn(len(context_lens), hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor(context_lens, dtype=torch.int32)


@pytest.mark.parametrize(("hq", "hkv", "d", "block_size", "dtype"), [
    (6, 2, 40, 16, torch.float32),  # GQA 3:1, head_dim not a power of two
    (4, 4, 32, 5, torch.float32),  # MHA, a block size that is no power of two
    (16, 1, 64, 16, torch.bfloat16),  # MQA, 16 query heads on one kv head
])
def test_decode_matches_reference(hq, hkv, d, block_size, dtype, rel):
    lens = [63, 0, 1, 65, 16]
    q, k_cache, v_cache, table, ctx = _cache(lens, hq, hkv, d, block_size, seed=hq + d, dtype=dtype)
    out = pa._paged_attention_triton(q, k_cache, v_cache, table, ctx, d**-0.5)
    want = pa._paged_attention_torch(q, k_cache, v_cache, table, ctx, d**-0.5)
    assert out.dtype == dtype
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # empty context -> zeros, not NaN
    assert rel(out, want) < TOL[dtype]


def test_public_function_runs_the_kernel(monkeypatch, rel):
    q, k_cache, v_cache, table, ctx = _cache([17, 40], 4, 2, 32, 8, seed=1)
    want = pa._paged_attention_torch(q, k_cache, v_cache, table, ctx, 0.3)
    monkeypatch.setattr(pa, "_paged_attention_torch", None)
    assert rel(pa.paged_attention_decode(q, k_cache, v_cache, table, ctx, scale=0.3), want) < 1e-5
