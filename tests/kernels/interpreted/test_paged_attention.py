"""Paged decode and prefill-chunk attention Triton kernels == their torch references (interpreter; see
conftest): decode against ``paged_attention._paged_attention_torch``, prefill against
``paged_attention_cpu.paged_prefill_torch`` (the one reference the C++ kernel is tested against too).

Stated bounds (relative Frobenius error): fp32 1e-5; bf16 2e-2 (bf16 inputs, p rounded to bf16
before the p·V dot as on the GPU, and the interpreter's fp32 -> bf16 truncation).
"""

from __future__ import annotations

import pytest
import torch

from jointrl.kernels import ops, paged_attention_cpu
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


def _chunks(chunks, hq, hkv, d, block_size, seed, dtype=torch.float32, kv_dtype=None, decode_rows=3):
    """A step's prefill chunks [(start, count)] over the engine's fused pool [P, 2, Hkv, D]: each
    sequence's blocks drawn at random from the pool, its block table expanded to slots (entries past
    start + count hold -7: never read), rows ``0 .. decode_rows`` of q standing for the step's decode rows."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in chunks) + 5
    kv = torch.randn(num_blocks * block_size, 2, hkv, d, generator=g).to(kv_dtype or dtype)
    slots = torch.full((len(chunks), max(c + n for c, n in chunks) + 2), -7, dtype=torch.long)
    for j, (c, n) in enumerate(chunks):
        blocks = torch.randperm(num_blocks, generator=g)[:-(-(c + n) // block_size)]
        t = torch.arange(c + n)
        slots[j, :c + n] = blocks[t // block_size] * block_size + t % block_size
    counts = torch.tensor([n for _, n in chunks])
    row0 = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)[:-1]]) + decode_rows
    q = torch.randn(decode_rows + int(counts.sum()), hq, d, generator=g).to(dtype)
    return q, kv, slots, torch.tensor([c for c, _ in chunks]), row0, counts


RAGGED = [(0, 1), (0, 37), (5, 3), (17, 70), (130, 65), (64, 16)]  # first chunks, mid-block starts, long history


@pytest.mark.parametrize(("hq", "hkv", "d", "block_size", "dtype", "kv_dtype"), [
    (6, 2, 40, 16, torch.float32, torch.float32),  # GQA 3:1 (tiles straddle queries), head_dim no power of two
    (4, 4, 32, 5, torch.float32, torch.bfloat16),  # MHA, block size 5, a bfloat16 pool under float32 queries
    (16, 1, 64, 16, torch.bfloat16, torch.bfloat16),  # MQA: 16 query heads on one kv head
    (8, 2, 16, 4, torch.bfloat16, torch.bfloat16),  # GQA 4:1, tiny blocks
])
def test_prefill_matches_reference(hq, hkv, d, block_size, dtype, kv_dtype, rel):
    q, kv, slots, start, row0, count = _chunks(RAGGED, hq, hkv, d, block_size, seed=hq + d, dtype=dtype,
                                               kv_dtype=kv_dtype)
    out = torch.full_like(q, 5.0)
    got = pa.paged_prefill_triton(q, kv, slots, start, row0, count, d**-0.5, out)
    want = paged_attention_cpu.paged_prefill_torch(q.double(), kv.double(), slots, start, row0, count, d**-0.5,
                                                   torch.full_like(q, 5.0, dtype=torch.float64))
    assert got is out and out.dtype == dtype
    assert torch.equal(out[:3], torch.full_like(out[:3], 5.0))  # the decode rows are not written
    assert rel(out[3:], want[3:]) < TOL[dtype]
    for j in range(len(RAGGED)):  # every chunk on its own bound (a short one would hide in the total)
        rows = slice(int(row0[j]), int(row0[j] + count[j]))
        assert rel(out[rows], want[rows]) < TOL[dtype], j


def test_prefill_chunk_equals_decode_of_each_query():
    """A chunk's query i is the decode of a sequence of start + i + 1 tokens: the two kernels agree."""
    q, kv, slots, start, row0, count = _chunks([(9, 12)], 4, 2, 32, 4, seed=5, decode_rows=0)
    out = pa.paged_prefill_triton(q, kv, slots, start, row0, count, 0.2, torch.empty_like(q))
    dec = ops.paged_decode_triton(q, kv, slots[:, :21].expand(12, 21), torch.arange(10, 22), 0.2)
    torch.testing.assert_close(out, dec, rtol=1e-5, atol=1e-5)


def test_triton_table_prefill_runs_the_kernel(monkeypatch, rel):
    """The triton op table's ``paged_prefill`` is the kernel, fed as the engine feeds it: q a view of the
    fused q|k projection, start / row0 / count the columns of one [C, 3] tensor (strided)."""
    q, kv, slots, start, row0, count = _chunks([(3, 20), (0, 9)], 4, 2, 32, 8, seed=1)
    want = paged_attention_cpu.paged_prefill_torch(q, kv, slots, start, row0, count, 0.3, torch.zeros_like(q))
    q_view = torch.cat([q, torch.randn(q.shape[0], 2, 32)], dim=1)[:, :4]
    start_s, row0_s, count_s = torch.stack([start, row0, count], dim=1).T
    assert not (q_view.is_contiguous() or start_s.is_contiguous())
    monkeypatch.setattr(paged_attention_cpu, "paged_prefill_torch", None)
    table = ops.kernels_for("triton")
    got = table.paged_prefill(q_view, kv, slots, start_s, row0_s, count_s, 0.3, torch.zeros_like(q))
    assert rel(got, want) < 1e-5


def _sinks(hq: int, seed: int) -> torch.Tensor:
    """Per-head sink logits around the scores' scale, one far above them (the sink takes almost all the mass)."""
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0] = 30.0
    return sinks


# (sinks, window): a window smaller than most contexts, crossing block boundaries and the kernels' 64-key tiles
SINK_WINDOW = [(True, None), (False, 7), (True, 70), (True, 1)]


@pytest.mark.parametrize(("sinks", "window"), SINK_WINDOW)
@pytest.mark.parametrize(("hq", "hkv", "d", "block_size", "dtype"), [
    (6, 2, 40, 16, torch.float32),  # GQA 3:1
    (16, 1, 64, 5, torch.bfloat16),  # MQA, block size 5
])
def test_decode_sinks_window_match_reference(sinks, window, hq, hkv, d, block_size, dtype, rel):
    """The triton table's decode with sinks and a window == the reference (``paged_decode_torch``, float64);
    an empty context still gives zeros (the sink attends to nothing)."""
    lens = [63, 0, 1, 65, 150, 8]
    _, kv, slots, _, _, _ = _chunks([(0, n) for n in lens], hq, hkv, d, block_size, seed=hq + d, dtype=dtype)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    slots, ctx = slots.clamp_min(0), torch.tensor(lens)  # the reference gathers every entry: none negative
    sinks_H = _sinks(hq, hq) if sinks else None
    out = ops.paged_decode_triton(q, kv, slots, ctx, d**-0.5, sinks_H=sinks_H, window=window)
    want = paged_attention_cpu.paged_decode_torch(q.double(), kv.double(), slots, ctx, d**-0.5,
                                                  None if sinks_H is None else sinks_H.double(), window)
    assert out.dtype == dtype
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for b in range(len(lens)):
        if lens[b]:
            assert rel(out[b], want[b]) < TOL[dtype], b


@pytest.mark.parametrize(("sinks", "window"), SINK_WINDOW)
@pytest.mark.parametrize(("hq", "hkv", "d", "block_size", "dtype", "kv_dtype"), [
    (6, 2, 40, 16, torch.float32, torch.float32),  # GQA 3:1 (tiles straddle queries)
    (8, 2, 16, 4, torch.bfloat16, torch.bfloat16),  # GQA 4:1, tiny blocks
])
def test_prefill_sinks_window_match_reference(sinks, window, hq, hkv, d, block_size, dtype, kv_dtype, rel):
    """Ragged prefill chunks (long histories, mid-block starts) with sinks and a window == the reference
    (float64); the decode rows stay unwritten."""
    q, kv, slots, start, row0, count = _chunks(RAGGED, hq, hkv, d, block_size, seed=hq + d, dtype=dtype,
                                               kv_dtype=kv_dtype)
    sinks_H = _sinks(hq, d) if sinks else None
    out = torch.full_like(q, 5.0)
    pa.paged_prefill_triton(q, kv, slots, start, row0, count, d**-0.5, out, sinks_H=sinks_H, window=window)
    want = paged_attention_cpu.paged_prefill_torch(q.double(), kv.double(), slots, start, row0, count, d**-0.5,
                                                   torch.full_like(q, 5.0, dtype=torch.float64),
                                                   None if sinks_H is None else sinks_H.double(), window)
    assert torch.equal(out[:3], torch.full_like(out[:3], 5.0))
    for j in range(len(RAGGED)):
        rows = slice(int(row0[j]), int(row0[j] + count[j]))
        assert rel(out[rows], want[rows]) < TOL[dtype], j


def test_decode_reads_a_bfloat16_pool_under_float32_queries_in_place(monkeypatch, rel):
    """``ops.paged_decode_triton`` hands a bfloat16 pool to the kernel as it is (strided views of the engine's
    pool, widened tile by tile), not a float32 copy of the whole pool; the result is the reference's."""
    lens = [63, 0, 17]
    _, kv, slots, _, _, _ = _chunks([(0, n) for n in lens], 6, 2, 40, 16, seed=5, kv_dtype=torch.bfloat16)
    q = torch.randn(len(lens), 6, 40, generator=torch.Generator().manual_seed(3))
    seen = []
    real = pa._paged_attention_triton
    monkeypatch.setattr(pa, "_paged_attention_triton", lambda q_, k, v, *a, **kw: seen.append(
        (k.dtype, k.data_ptr() == kv.data_ptr())) or real(q_, k, v, *a, **kw))
    slots, ctx = slots.clamp_min(0), torch.tensor(lens)
    out = ops.paged_decode_triton(q, kv, slots, ctx, 40**-0.5)
    assert seen == [(torch.bfloat16, True)]  # the pool itself
    want = paged_attention_cpu.paged_decode_torch(q.double(), kv.double(), slots, ctx, 40**-0.5)
    for b in (0, 2):
        assert rel(out[b], want[b]) < TOL[torch.float32], b
