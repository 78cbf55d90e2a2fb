"""The CPU paged decode-attention kernel against its torch reference and against plain SDPA on
contiguous keys: awkward shapes (a 1-token context, contexts not a multiple of the block size,
shuffled blocks, GQA groups of 1 to 8), float64 and float32. The head shapes reach every pass shape
of the AVX2 path (1, 2, 4 or 8 keys per pass by the group size; head_dim 64 and 128 compiled as
constants, 24 and 32 not, 60 and 8 off the float vector width: the fallback loops). The prefill-chunk
kernel against causal attention over each chunk's gathered keys in float64."""

import pytest
import torch
import torch.nn.functional as F

from jointrl.kernels.paged_attention_cpu import paged_decode, paged_decode_torch, paged_prefill, paged_prefill_torch


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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rows_sharing_prefix_blocks_get_the_bits_of_private_copies(dtype):
    """The samples of a GRPO group read their prompt's keys from the same cache blocks (forked, copy on
    write), and the kernel streams each shared tile once for the whole group: a row's result must not
    change by that -- the same bits as when every row reads a private copy of the same keys -- also for
    groups larger than the kernel's group size, contexts ending inside the shared span or right after it,
    and rows of different groups interleaved in the batch."""
    g = torch.Generator().manual_seed(3)
    Hq, Hkv, D, bs = 4, 2, 64, 16
    prefix_blocks = [3, 3, 1]  # three prompts, shared by 20, 5 and 2 samples
    sizes = [20, 5, 2]
    kv_PCHD = torch.zeros(4096 * bs // 4, 2, Hkv, D, dtype=dtype)
    free = iter(torch.randperm(kv_PCHD.shape[0] // bs, generator=g).tolist())
    shared_tables, private_tables, ctx = [], [], []
    def fill(block, src=None):
        rows = slice(block * bs, (block + 1) * bs)
        kv_PCHD[rows] = torch.randn(bs, 2, Hkv, D, generator=g, dtype=dtype) if src is None else kv_PCHD[
            src * bs:(src + 1) * bs]

    for n_pre, size in zip(prefix_blocks, sizes):
        pre = [next(free) for _ in range(n_pre)]
        for b in pre:
            fill(b)
        for _ in range(size):
            n = n_pre * bs + int(torch.randint(-bs, 3 * bs, (1,), generator=g))  # some end inside the prefix
            own = [next(free) for _ in range(-(-n // bs) - n_pre)]
            copy = [next(free) for _ in pre]  # the same keys in blocks of its own
            for b_copy, b_pre in zip(copy, pre):
                fill(b_copy, b_pre)
            for b in own:
                fill(b)
            shared_tables.append(pre + own)
            private_tables.append(copy + own)
            ctx.append(n)
    order = torch.randperm(len(ctx), generator=g)  # groups interleaved

    def slots(tables):
        S = max(ctx)
        out = torch.full((len(ctx), S), -1, dtype=torch.long)
        for b, (table, n) in enumerate(zip(tables, ctx)):
            t = torch.arange(n)
            out[b, :n] = torch.tensor(table)[t // bs] * bs + t % bs
        return out[order].contiguous()

    q_BHD = torch.randn(len(ctx), Hq, D, generator=g, dtype=dtype)
    ctx_B = torch.tensor(ctx)[order].contiguous()
    shared = paged_decode(q_BHD, kv_PCHD, slots(shared_tables), ctx_B, D ** -0.5)
    private = paged_decode(q_BHD, kv_PCHD, slots(private_tables), ctx_B, D ** -0.5)
    assert torch.equal(shared, private)
    ref = paged_decode_torch(q_BHD, kv_PCHD, slots(shared_tables).clamp_min(0), ctx_B, D ** -0.5)
    assert (shared - ref).abs().max() < (1e-12 if dtype == torch.float64 else 1e-5)


def _chunks(g, chunks, P, bs):
    """Key slots for chunks [(start, count)]: each chunk's blocks drawn at random from a pool of P slots,
    entries past start + count left at -7 (never read)."""
    slots_CS = torch.full((len(chunks), max(c + n for c, n in chunks)), -7, dtype=torch.long)
    for j, (c, n) in enumerate(chunks):
        blocks = torch.randperm(P // bs, generator=g)[:-(-(c + n) // bs)]
        t = torch.arange(c + n)
        slots_CS[j, :c + n] = blocks[t // bs] * bs + t % bs
    rows = torch.tensor([0] + [n for _, n in chunks]).cumsum(0)[:-1] + 3  # rows 0..2: decode rows, not written
    return slots_CS, torch.tensor([c for c, _ in chunks]), rows, torch.tensor([n for _, n in chunks])


@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 64), (8, 1, 64), (4, 4, 32), (6, 2, 16), (2, 1, 128), (12, 2, 24)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_equals_causal_attention_over_each_chunks_keys(Hq, Hkv, D, kv_dtype):
    """Chunks at every kind of start (a first chunk, one past a partial block, a long history), of one to 70
    queries, in one call: each query attends to its sequence's keys up to its own position. The float32
    kernel against the float64 reference within 1e-5; rows outside the chunks are left as they were."""
    g = torch.Generator().manual_seed(2)
    bs, P = 16, 4096
    chunks = [(0, 1), (0, 37), (5, 3), (17, 70), (300, 65), (64, 16)]
    kv = torch.randn(P, 2, Hkv, D, generator=g).to(kv_dtype)
    slots_CS, start_C, row0_C, count_C = _chunks(g, chunks, P, bs)
    N = 3 + int(count_C.sum())
    q = torch.randn(N, Hq, D, generator=g)
    out = torch.full_like(q, 5.0)
    paged_prefill(q, kv, slots_CS, start_C, row0_C, count_C, D ** -0.5, out)
    ref = paged_prefill_torch(q.double(), kv.double(), slots_CS, start_C, row0_C, count_C, D ** -0.5,
                              torch.full_like(q, 5.0, dtype=torch.float64))
    assert torch.equal(out[:3], torch.full_like(q[:3], 5.0))
    assert (out.double() - ref).abs().max() < 1e-5
    # one chunk by hand: plain softmax attention with a causal mask over its gathered keys
    c, n, r0 = 17, 70, int(row0_C[3])
    kv_SCHD = kv[slots_CS[3, :c + n]].double()
    k_SHD, v_SHD = (x.repeat_interleave(Hq // Hkv, dim=1) for x in (kv_SCHD[:, 0], kv_SCHD[:, 1]))
    scores_HTS = torch.einsum("thd,shd->hts", q[r0:r0 + n].double(), k_SHD) * D ** -0.5
    visible_TS = torch.arange(c + n)[None, :] <= torch.arange(c, c + n)[:, None]
    p_HTS = scores_HTS.masked_fill(~visible_TS, -torch.inf).softmax(-1)
    assert (out[r0:r0 + n].double() - torch.einsum("hts,shd->thd", p_HTS, v_SHD)).abs().max() < 1e-5


def test_paged_prefill_of_a_float64_model_is_the_reference():
    """float64 (the exactness tests' dtype) runs the torch reference: the same bits as SDPA per chunk."""
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(512, 2, 2, 16, generator=g, dtype=torch.float64)
    slots_CS, start_C, row0_C, count_C = _chunks(g, [(9, 20), (0, 4)], 512, 16)
    q = torch.randn(3 + 24, 4, 16, generator=g, dtype=torch.float64)
    a = paged_prefill(q, kv, slots_CS, start_C, row0_C, count_C, 0.25, torch.zeros_like(q))
    b = paged_prefill_torch(q, kv, slots_CS, start_C, row0_C, count_C, 0.25, torch.zeros_like(q))
    assert torch.equal(a, b)


@pytest.mark.parametrize("window", [None, 1, 6, 40])
def test_sinks_and_window_equal_gpt_oss_attention_on_dense_keys(window):
    """The references with ``sinks_H`` and ``window`` == gpt-oss's own attention (``model.gpt_oss.sink_attention``
    with ``window_mask``) on each sequence's keys laid out densely, in float64: prefill chunks after a history
    (the window crossing block boundaries), GQA 3:1; a decode row is the last query of its sequence. On the cpu
    table the same calls route to the references (the C++ kernels have no sinks): the same bits."""
    from jointrl.model.gpt_oss import sink_attention, window_mask  # the model's math, the oracle here

    g = torch.Generator().manual_seed(4)
    Hq, Hkv, D, bs, P = 6, 2, 16, 4, 1024
    chunks = [(0, 9), (13, 30), (45, 1)]
    kv = torch.randn(P, 2, Hkv, D, generator=g, dtype=torch.float64)
    sinks_H = torch.randn(Hq, generator=g, dtype=torch.float64) * 3
    slots_CS, start_C, row0_C, count_C = _chunks(g, chunks, P, bs)
    q = torch.randn(3 + int(count_C.sum()), Hq, D, generator=g, dtype=torch.float64)
    out = paged_prefill_torch(q, kv, slots_CS, start_C, row0_C, count_C, 0.3, torch.zeros_like(q), sinks_H, window)
    assert torch.equal(paged_prefill(q, kv, slots_CS, start_C, row0_C, count_C, 0.3, torch.zeros_like(q), sinks_H,
                                     window), out)
    for j, (c, n) in enumerate(chunks):
        r0 = int(row0_C[j])
        kv_SCHD = kv[slots_CS[j, :c + n]]
        mask = (torch.arange(c + n)[None, :] <= torch.arange(c, c + n)[:, None])[None, None]
        if window is not None:
            mask = mask & window_mask(c, n, c + n, window, q.device)
        want_1HTD = sink_attention(q[r0:r0 + n].transpose(0, 1)[None], kv_SCHD[None, :, 0].transpose(1, 2),
                                   kv_SCHD[None, :, 1].transpose(1, 2), mask, sinks_H, 0.3)
        torch.testing.assert_close(out[r0:r0 + n], want_1HTD[0].transpose(0, 1), rtol=1e-12, atol=1e-12)
        # the chunk's last query as a decode row over its c + n keys
        ctx = torch.tensor([c + n])
        dec = paged_decode_torch(q[r0 + n - 1][None], kv, slots_CS[j:j + 1, :c + n], ctx, 0.3, sinks_H, window)
        assert torch.equal(paged_decode(q[r0 + n - 1][None], kv, slots_CS[j:j + 1, :c + n], ctx, 0.3, sinks_H,
                                        window), dec)
        torch.testing.assert_close(dec[0], want_1HTD[0, :, -1], rtol=1e-12, atol=1e-12)


def test_sinks_and_window_none_keep_the_kernels_results():
    """``sinks_H=None, window=None`` passed explicitly: the same bits as the calls without them (the C++ path)."""
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(256, 2, 2, 16, generator=g)
    slots_CS, start_C, row0_C, count_C = _chunks(g, [(9, 20), (0, 4)], 256, 16)
    q = torch.randn(3 + 24, 4, 16, generator=g)
    a = paged_prefill(q, kv, slots_CS, start_C, row0_C, count_C, 0.25, torch.zeros_like(q))
    b = paged_prefill(q, kv, slots_CS, start_C, row0_C, count_C, 0.25, torch.zeros_like(q), None, None)
    assert torch.equal(a, b)
    ctx = torch.tensor([29, 4])
    assert torch.equal(paged_decode(q[:2], kv, slots_CS, ctx, 0.25), paged_decode(q[:2], kv, slots_CS, ctx, 0.25,
                                                                                   None, None))
