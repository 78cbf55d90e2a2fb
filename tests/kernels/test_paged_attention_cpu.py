"""The CPU paged decode-attention kernel against its torch reference and against plain SDPA on
contiguous keys: awkward shapes (a 1-token context, contexts not a multiple of the block size,
shuffled blocks, GQA groups of 1 to 8), float64 and float32. The head shapes reach every pass shape
of the AVX2 path (1, 2, 4 or 8 keys per pass by the group size; head_dim 64 and 128 compiled as
constants, 24 and 32 not, 60 and 8 off the float vector width: the fallback loops)."""

import pytest
import torch
import torch.nn.functional as F

from jointrl.kernels.paged_attention_cpu import paged_decode, paged_decode_torch


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 16), (4, 4, 8), (8, 2, 60), (8, 1, 64), (6, 2, 32), (12, 2, 24),
                                      (16, 2, 128)])
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


def test_paged_decode_reads_a_bfloat16_cache_as_its_float32_values():
    """A bfloat16 cache under a float32 query: each element widened exactly, so the result equals the
    float32 kernel over the same (bfloat16-rounded) values."""
    g = torch.Generator().manual_seed(1)
    Hq, Hkv, D, bs, ctx = 4, 2, 64, 16, [1, 16, 37, 80]
    kv_bf16 = torch.randn(8 * bs, 2, Hkv, D, generator=g).to(torch.bfloat16)
    q_BHD = torch.randn(len(ctx), Hq, D, generator=g)
    slots_BS = torch.randperm(8 * bs, generator=g)[:max(ctx)].repeat(len(ctx), 1).contiguous()
    ctx_B = torch.tensor(ctx)
    out = paged_decode(q_BHD, kv_bf16, slots_BS, ctx_B, D ** -0.5)
    assert out.dtype == torch.float32
    assert (out - paged_decode(q_BHD, kv_bf16.float(), slots_BS, ctx_B, D ** -0.5)).abs().max() < 1e-6
    assert (out - paged_decode_torch(q_BHD, kv_bf16, slots_BS, ctx_B, D ** -0.5)).abs().max() < 1e-5
    with pytest.raises(RuntimeError, match="bfloat16 for a float32 q"):
        paged_decode(q_BHD.double(), kv_bf16, slots_BS, ctx_B, D ** -0.5)
