"""The CPU paged decode-attention kernel against its torch reference and against plain SDPA on
contiguous keys: awkward shapes (a 1-token context, contexts not a multiple of the block size,
shuffled blocks, GQA groups of 1 and 4), float64 and float32."""

import pytest
import torch
import torch.nn.functional as F

from jointrl.kernels.paged_attention_cpu import paged_decode, paged_decode_torch


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 16), (4, 4, 8), (8, 2, 60)])
def test_paged_decode_equals_sdpa_on_gathered_keys(dtype, tol, Hq, Hkv, D):
    g = torch.Generator().manual_seed(0)
    bs, num_blocks = 4, 40
    ctx = [1, 5, 17, 33]
    perm = torch.randperm(num_blocks, generator=g)  # blocks in no particular order
    kv_PCHD = torch.randn(num_blocks * bs, 2, Hkv, D, generator=g, dtype=dtype)
    q_BHD = torch.randn(len(ctx), Hq, D, generator=g, dtype=dtype)
    S = max(ctx)
    slots_BS = torch.full((len(ctx), S), -7, dtype=torch.long)  # entries past the context are never read
    used = 0
    for b, n in enumerate(ctx):
        blocks = perm[used:used + -(-n // bs)]
        used += len(blocks)
        t = torch.arange(n)
        slots_BS[b, :n] = blocks[t // bs] * bs + t % bs
    out = paged_decode(q_BHD, kv_PCHD, slots_BS, torch.tensor(ctx), D ** -0.5)
    ref = paged_decode_torch(q_BHD, kv_PCHD, slots_BS.clamp_min(0), torch.tensor(ctx), D ** -0.5)
    assert (out - ref).abs().max() < tol
    for b, n in enumerate(ctx):
        kv_SCHD = kv_PCHD[slots_BS[b, :n]]
        sdpa = F.scaled_dot_product_attention(q_BHD[b][None, :, None], kv_SCHD[None, :, 0].transpose(1, 2),
                                              kv_SCHD[None, :, 1].transpose(1, 2), enable_gqa=Hq != Hkv)
        assert (out[b] - sdpa[0, :, 0]).abs().max() < tol


def test_paged_decode_names_bad_shapes():
    with pytest.raises(ValueError, match="slots"):
        paged_decode(torch.zeros(2, 4, 8), torch.zeros(16, 2, 2, 8), torch.zeros(3, 4, dtype=torch.long),
                     torch.ones(2, dtype=torch.long), 1.0)
