"""Kernels vs their torch references and vs the device's own ceilings. Run:
``python tests/bench/bench_kernels.py`` (about 2 minutes on an H100/H200; ``--quick`` for less).

On CUDA, first measures two ceilings: copy bandwidth (``dst.copy_(src)`` of 2 GiB, counting
read + write) and bf16 matmul throughput (8192³). Then, for each Triton kernel at a
production shape, it checks the kernel against its torch reference (MXFP4: bit for bit;
MoE matmul, paged decode and prefill attention: relative Frobenius error below a stated bound; a miss is
reported as FAIL and makes the exit status 1) and times it: median of ``--repeats`` runs with
CUDA events after warm-up. Reported: ms, achieved GB/s (bytes the kernel must move, listed
per row) as a share of the copy ceiling, and TFLOP/s where the kernel does matmul work.
Targets (printed beside the result, not asserted): MXFP4 quantize/dequantize >= 70% of copy
bandwidth; decode-shaped MXFP4 MoE matmul >= 50% of copy bandwidth on the weight bytes.

On CPU (no GPU), it runs only the torch references on smaller shapes and says so: Triton
kernels need CUDA (or the interpreter, which is a correctness tool, not a benchmark).
``--dry`` (needs ``TRITON_INTERPRET=1`` set before Python starts): every check of the CUDA run, on
the host through Triton's interpreter at tiny shapes, one timing each (wall clock: not a
measurement): ``tests/gpu/check.sh --dry`` runs it so the GPU run is known to work beforehand.

KDA chunk (forward, and forward + backward) is checked against ``kernels.kda.kda_chunk_torch`` (the
model's torch chunked form, through autograd for the gradients) and timed beside it and, when
``fla`` is importable, beside fla's ``chunk_kda`` (target: no slower than fla at T = 8192,
H = 16, d = 128). The DSA top-k kernel is checked id for id against its torch reference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from jointrl.kernels import (dispatch, dsa, kda, moe_experts, moe_matmul, mxfp4, paged_attention, paged_attention_cpu,
                             topk)


def _median_ms(fn: Callable[[], object], repeats: int, cuda: bool) -> float:
    fn()  # warm-up (compiles on first call)
    fn()
    times = []
    for _ in range(repeats):
        if cuda and torch.cuda.is_available():  # --dry runs the kernels interpreted on the host
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


class Report:
    def __init__(self, copy_gbs: float | None) -> None:
        self.copy_gbs = copy_gbs
        self.failed = False
        print(f"{'op':<50}{'check':>14}{'ms':>10}{'GB/s':>9}{'%copy':>7}{'TFLOP/s':>9}  target")

    def row(self, name: str, check: str, ms: float, nbytes: float, flops: float = 0.0, target: str = "") -> None:
        gbs = nbytes / ms / 1e6
        pct = f"{100 * gbs / self.copy_gbs:6.0f}%" if self.copy_gbs else f"{'-':>7}"
        tf = f"{flops / ms / 1e9:9.3f}" if flops else f"{'-':>9}"
        print(f"{name:<50}{check:>14}{ms:>10.3f}{gbs:>9.2f}{pct}{tf}  {target}")


def _check(report: Report, ok: bool, text: str) -> str:
    report.failed |= not ok
    return text if ok else f"FAIL {text}"


def ceilings(dev: torch.device, repeats: int) -> tuple[float, float]:
    src = torch.empty(2**30, dtype=torch.int16, device=dev).random_()
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), repeats, True)
    copy_gbs = 2 * src.numel() * 2 / ms / 1e6
    del src, dst
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ms = _median_ms(lambda: a @ b, repeats, True)
    tflops = 2 * 8192**3 / ms / 1e9
    print(f"ceilings: copy {copy_gbs:.0f} GB/s (2 GiB, read+write), bf16 matmul {tflops:.0f} TFLOP/s (8192^3)")
    return copy_gbs, tflops


def bench_mxfp4(report: Report, dev: torch.device, cuda: bool, repeats: int, rows: int, cols: int) -> None:
    x = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
    n = x.numel()
    packed_bytes = n // 2 + n // 32
    for rule in ("floor", "ceil"):
        want = mxfp4._quantize_mxfp4_torch(x, mxfp4.ScaleRule(rule))
        if cuda:
            got = mxfp4._quantize_mxfp4_triton(x, mxfp4.ScaleRule(rule))
            ok = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            ms = _median_ms(lambda: mxfp4._quantize_mxfp4_triton(x, mxfp4.ScaleRule(rule)), repeats, cuda)
            report.row(f"mxfp4 quantize bf16 [{rows},{cols}] {rule}", _check(report, ok, "bit-exact"), ms,
                       2 * n + packed_bytes, target=">=70% copy")
        ms = _median_ms(lambda: mxfp4._quantize_mxfp4_torch(x, mxfp4.ScaleRule(rule)), repeats, cuda)
        report.row(f"  torch ref: quantize [{rows},{cols}] {rule}", "-", ms, 2 * n + packed_bytes)
    blocks, scales = want
    ref = mxfp4._dequantize_mxfp4_torch(blocks, scales, torch.bfloat16)
    if cuda:
        got = mxfp4._dequantize_mxfp4_triton(blocks, scales, torch.bfloat16)
        ok = torch.equal(got.view(torch.int16), ref.view(torch.int16))
        ms = _median_ms(lambda: mxfp4._dequantize_mxfp4_triton(blocks, scales, torch.bfloat16), repeats, cuda)
        report.row(f"mxfp4 dequantize -> bf16 [{rows},{cols}]", _check(report, ok, "bit-exact"), ms,
                   packed_bytes + 2 * n, target=">=70% copy")
    ms = _median_ms(lambda: mxfp4._dequantize_mxfp4_torch(blocks, scales, torch.bfloat16), repeats, cuda)
    report.row(f"  torch ref: dequantize [{rows},{cols}]", "-", ms, packed_bytes + 2 * n)


def bench_moe(report: Report, dev: torch.device, cuda: bool, repeats: int, E: int, H: int, I: int, k: int,
              tokens: list[int]) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    gub, gus = mxfp4.quantize_mxfp4(torch.randn(E, 2 * I, H, device=dev, generator=g) * H**-0.5)
    db, ds = mxfp4.quantize_mxfp4(torch.randn(E, H, I, device=dev, generator=g) * I**-0.5)
    per_expert_bytes = (2 * I * H + H * I) * (0.5 + 1 / 32)
    gu_d, dn_d = mxfp4.dequantize_mxfp4(gub, gus, torch.bfloat16), mxfp4.dequantize_mxfp4(db, ds, torch.bfloat16)
    for n in tokens:
        x = torch.randn(n, H, device=dev, dtype=torch.bfloat16, generator=g)
        ids = torch.rand(n, E, device=dev, generator=g).argsort(-1)[:, :k]
        w = torch.softmax(torch.randn(n, k, device=dev, generator=g), -1).to(torch.bfloat16)
        touched = int(torch.unique(ids).numel())
        nbytes = touched * per_expert_bytes + 2 * n * H * 2
        flops = 2 * n * k * 3 * H * I
        label = f"moe mxfp4 E{E} H{H} I{I} k{k} N={n}"
        with dispatch.backend("torch"):
            want = moe_matmul.moe_experts_mxfp4(x, ids, w, gub, gus, db, ds)
            ms_ref = _median_ms(lambda: moe_matmul.moe_experts_mxfp4(x, ids, w, gub, gus, db, ds), repeats, cuda)
        if cuda:
            with dispatch.backend("triton"):
                got = moe_matmul.moe_experts_mxfp4(x, ids, w, gub, gus, db, ds)
                ms = _median_ms(lambda: moe_matmul.moe_experts_mxfp4(x, ids, w, gub, gus, db, ds), repeats, cuda)
            err = _rel(got, want)
            target = ">=50% copy (weights)" if n * k <= 16 * E else ""
            report.row(label, _check(report, err < 1e-2, f"rel {err:.1e}"), ms, nbytes, flops, target)
        report.row(f"  torch ref: N={n} (dequantize + matmul)", "-", ms_ref, nbytes, flops)
        # the same experts dense in bf16 (the triton table's moe_experts): grouped kernels vs RoutedSwiGLU
        nbytes_d = touched * 3 * I * H * 2 + 2 * n * H * 2
        want_d = moe_experts.moe_experts_torch(x, ids, w, gu_d, dn_d)
        ms_ref_d = _median_ms(lambda: moe_experts.moe_experts_torch(x, ids, w, gu_d, dn_d), repeats, cuda)
        if cuda:
            got_d = moe_matmul.moe_experts_dense_triton(x, ids, w, gu_d, dn_d)
            ms_d = _median_ms(lambda: moe_matmul.moe_experts_dense_triton(x, ids, w, gu_d, dn_d), repeats, cuda)
            err = _rel(got_d, want_d)
            target = ">=50% copy (weights)" if n * k <= 16 * E else ""
            report.row(f"moe bf16 E{E} H{H} I{I} k{k} N={n}", _check(report, err < 2e-2, f"rel {err:.1e}"), ms_d,
                       nbytes_d, flops, target)
        report.row(f"  torch ref: N={n} (bf16 RoutedSwiGLU)", "-", ms_ref_d, nbytes_d, flops)


def bench_paged(report: Report, dev: torch.device, cuda: bool, repeats: int, B: int, ctx: int, Hq: int, Hkv: int,
                D: int, block_size: int) -> None:
    g = torch.Generator(device=dev).manual_seed(1)
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = B * blocks_per_seq + 7
    kv = torch.randn(num_blocks * block_size, 2, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
    kv5 = kv.view(num_blocks, block_size, 2, Hkv, D)
    k_cache, v_cache = kv5[:, :, 0], kv5[:, :, 1]
    table = torch.randperm(num_blocks, device=dev, generator=g)[: B * blocks_per_seq].view(B, blocks_per_seq)
    table = table.to(torch.int32)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
    nbytes = 2 * B * ctx * Hkv * D * 2
    flops = 4 * B * Hq * ctx * D
    label = f"paged decode B{B} ctx{ctx} Hq{Hq}/Hkv{Hkv} D{D} bs{block_size}"
    with dispatch.backend("torch"):
        want = paged_attention.paged_attention_decode(q, k_cache, v_cache, table, lens)
        ms_ref = _median_ms(lambda: paged_attention.paged_attention_decode(q, k_cache, v_cache, table, lens),
                            max(1, repeats // 5), cuda)
    if cuda:
        with dispatch.backend("triton"):
            got = paged_attention.paged_attention_decode(q, k_cache, v_cache, table, lens)
            ms = _median_ms(lambda: paged_attention.paged_attention_decode(q, k_cache, v_cache, table, lens),
                            repeats, cuda)
        err = _rel(got, want)
        report.row(label, _check(report, err < 1e-2, f"rel {err:.1e}"), ms, nbytes, flops)
    report.row(f"  torch ref: {label[13:]}", "-", ms_ref, nbytes, flops)


def bench_paged_prefill(report: Report, dev: torch.device, cuda: bool, repeats: int, chunks: int, cached: int,
                        new: int, Hq: int, Hkv: int, D: int, block_size: int) -> None:
    """The engine's prefill step (``paged_prefill_triton``): ``chunks`` chunks of ``new`` queries after
    ``cached`` cached tokens each, one launch over the [P, 2, Hkv, D] pool read through each chunk's
    slots, against ``paged_attention_cpu.paged_prefill_torch`` (SDPA per chunk on gathered keys)."""
    g = torch.Generator(device=dev).manual_seed(4)
    ctx = cached + new
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = chunks * blocks_per_seq + 7
    kv = torch.randn(num_blocks * block_size, 2, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
    table = torch.randperm(num_blocks, device=dev, generator=g)[: chunks * blocks_per_seq].view(chunks, blocks_per_seq)
    t = torch.arange(ctx, device=dev)
    slots = table[:, t // block_size] * block_size + t % block_size
    start = torch.full((chunks,), cached, device=dev)
    count = torch.full((chunks,), new, device=dev)
    row0 = torch.arange(chunks, device=dev) * new
    q = torch.randn(chunks * new, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
    out = torch.zeros_like(q)
    nbytes = chunks * (2 * ctx * Hkv * D + 2 * new * Hq * D) * 2  # keys, values once; q in, out
    flops = 4 * chunks * Hq * D * new * (cached + (new + 1) / 2)  # causal: the visible keys only
    label = f"paged prefill {chunks}x{new} after {cached} Hq{Hq}/Hkv{Hkv} D{D}"
    want = paged_attention_cpu.paged_prefill_torch(q, kv, slots, start, row0, count, D**-0.5, torch.zeros_like(q))
    ms_ref = _median_ms(lambda: paged_attention_cpu.paged_prefill_torch(q, kv, slots, start, row0, count, D**-0.5, out),
                        max(1, repeats // 5), cuda)
    if cuda:
        got = paged_attention.paged_prefill_triton(q, kv, slots, start, row0, count, D**-0.5, torch.zeros_like(q))
        ms = _median_ms(lambda: paged_attention.paged_prefill_triton(q, kv, slots, start, row0, count, D**-0.5, out),
                        repeats, cuda)
        err = _rel(got, want)
        report.row(label, _check(report, err < 1e-2, f"rel {err:.1e}"), ms, nbytes, flops)
    report.row(f"  torch ref: {label[14:]}", "-", ms_ref, nbytes, flops)

def bench_kda_decode(report: Report, dev: torch.device, cuda: bool, repeats: int, B: int, N: int, K: int) -> None:
    g = torch.Generator(device=dev).manual_seed(2)
    q, k = (torch.nn.functional.normalize(torch.randn(B, 1, N, K, device=dev, generator=g), dim=-1).to(torch.bfloat16)
            for _ in range(2))
    v = torch.randn(B, 1, N, K, device=dev, generator=g).to(torch.bfloat16)
    gate = (-torch.rand(B, 1, N, K, device=dev, generator=g) * 0.1).to(torch.bfloat16)
    beta = torch.rand(B, 1, N, device=dev, generator=g).to(torch.bfloat16)
    s0 = torch.randn(B, N, K, K, device=dev, generator=g)
    nbytes = 2 * s0.numel() * 4  # the fp32 state, read and written
    label = f"kda decode step B{B} N{N} K=V={K}"
    with dispatch.backend("torch"):
        want = kda.kda_recurrent(q, k, v, gate, beta, s0)
        ms_ref = _median_ms(lambda: kda.kda_recurrent(q, k, v, gate, beta, s0), repeats, cuda)
    if cuda:
        with dispatch.backend("triton"):
            got = kda.kda_recurrent(q, k, v, gate, beta, s0)
            ms = _median_ms(lambda: kda.kda_recurrent(q, k, v, gate, beta, s0), repeats, cuda)
        err = max(_rel(got[0], want[0]), _rel(got[1], want[1]))
        report.row(label, _check(report, err < 1e-4, f"rel {err:.1e}"), ms, nbytes)
    report.row(f"  torch ref: {label}", "-", ms_ref, nbytes)


def _fla_chunk_kda():
    """fla's ``chunk_kda`` if fla is installed (it is not a dependency), else None."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda


def bench_kda_chunk(report: Report, dev: torch.device, cuda: bool, repeats: int, B: int, T: int, N: int, K: int
                    ) -> None:
    g = torch.Generator(device=dev).manual_seed(4)
    bf = torch.bfloat16
    q, k = (F.normalize(torch.randn(B, T, N, K, device=dev, generator=g), dim=-1).to(bf) for _ in range(2))
    v = torch.randn(B, T, N, K, device=dev, generator=g).to(bf)
    gate = -0.1 * F.softplus(torch.randn(B, T, N, K, device=dev, generator=g))  # fp32, the model's gate form
    beta = torch.rand(B, T, N, device=dev, generator=g).to(bf)
    do = torch.randn(B, T, N, K, device=dev, generator=g)
    xs = [x.requires_grad_() for x in (q, k, v, gate, beta)]
    nbytes = 2 * B * T * N * (3 * K + 1) + 4 * B * T * N * 2 * K  # read q, k, v, beta (bf16), g; write o (fp32)
    label = f"kda chunk B{B} T{T} N{N} K=V={K}"

    def ref(*inputs):
        return kda.kda_chunk_torch(*(x.float() for x in inputs), None, chunk=64)

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(*xs)[0], xs, do)

    with torch.no_grad():
        o_ref, s_ref = ref(*xs)
    g_ref = fwd_bwd(ref)()
    with torch.no_grad():
        ms_ref_f = _median_ms(lambda: ref(*xs), max(1, repeats // 5), cuda)
    ms_ref_fb = _median_ms(fwd_bwd(ref), max(1, repeats // 5), cuda)
    if cuda:
        with dispatch.backend("triton"):
            with torch.no_grad():
                o, s = kda.kda_chunk(*xs)
                ms_f = _median_ms(lambda: kda.kda_chunk(*xs), repeats, cuda)
            grads = fwd_bwd(kda.kda_chunk)()
            ms_fb = _median_ms(fwd_bwd(kda.kda_chunk), repeats, cuda)
        err_f = max(_rel(o, o_ref), _rel(s, s_ref))
        err_b = max(_rel(a, b) for a, b in zip(grads, g_ref))
        fla = _fla_chunk_kda()
        target = "<= fla chunk_kda" if fla is not None else "fla not importable: no comparison"
        report.row(label + " fwd", _check(report, err_f < 1e-3, f"rel {err_f:.1e}"), ms_f, nbytes, target=target)
        report.row(label + " fwd+bwd", _check(report, err_b < 1e-3, f"rel {err_b:.1e}"), ms_fb, 3 * nbytes)
        if fla is not None:
            def fla_fn(*inputs):
                return fla(*inputs, scale=K**-0.5, output_final_state=True)
            try:  # an optional peer whose signature changes between versions: report, don't abort
                with torch.no_grad():
                    err = _rel(fla_fn(*xs)[0], o_ref)
                    ms = _median_ms(lambda: fla_fn(*xs), repeats, cuda)
                report.row(f"  fla chunk_kda fwd (ours/fla {ms_f / ms:.2f}x)", f"rel {err:.1e}", ms, nbytes)
                ms = _median_ms(fwd_bwd(fla_fn), repeats, cuda)
                report.row(f"  fla chunk_kda fwd+bwd (ours/fla {ms_fb / ms:.2f}x)", "-", ms, 3 * nbytes)
            except Exception as e:  # noqa: BLE001
                print(f"  fla chunk_kda did not run: {type(e).__name__}: {e}")
    report.row("  torch ref: kernels.kda.kda_chunk_torch fwd", "-", ms_ref_f, nbytes)
    report.row("  torch ref: kernels.kda.kda_chunk_torch fwd+bwd", "-", ms_ref_fb, 3 * nbytes)


def bench_topk(report: Report, dev: torch.device, cuda: bool, repeats: int, T: int, k: int) -> None:
    g = torch.Generator(device=dev).manual_seed(5)
    scores = torch.relu(torch.randn(1, T, T, device=dev, generator=g))  # ReLU-like: many exact zeros (ties)
    visible = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None]
    nbytes = 5 * T * T  # scores (fp32) and the mask (1 byte), each read once
    label = f"dsa top-k T=S={T} k={k} (causal)"
    want = topk._select_topk_torch(scores, visible, k)
    ms_ref = _median_ms(lambda: topk._select_topk_torch(scores, visible, k), max(1, repeats // 5), cuda)
    if cuda:
        got = topk._select_topk_triton(scores, visible, k)
        ms = _median_ms(lambda: topk._select_topk_triton(scores, visible, k), repeats, cuda)
        report.row(label, _check(report, torch.equal(got, want), "ids equal"), ms, nbytes)
    report.row(f"  torch ref: topk_mask top-k T={T}", "-", ms_ref, nbytes)


def bench_dsa(report: Report, dev: torch.device, cuda: bool, repeats: int, T: int, Hq: int, Hkv: int, D: int,
              topk: int, n_idx: int) -> None:
    g = torch.Generator(device=dev).manual_seed(3)
    bf = torch.bfloat16
    iq = torch.randn(1, T, n_idx, 128, device=dev, generator=g).to(bf)
    iw = torch.randn(1, T, n_idx, device=dev, generator=g).to(bf)
    ik = torch.randn(1, T, 128, device=dev, generator=g).to(bf)
    label = f"dsa indexer T=S={T} n{n_idx} Di128"
    flops = 2 * T * T * n_idx * 128
    with dispatch.backend("torch"):
        want = dsa.indexer_scores(iq, iw, ik)
        ms_ref = _median_ms(lambda: dsa.indexer_scores(iq, iw, ik), max(1, repeats // 5), cuda)
    if cuda:
        with dispatch.backend("triton"):
            got = dsa.indexer_scores(iq, iw, ik)
            ms = _median_ms(lambda: dsa.indexer_scores(iq, iw, ik), repeats, cuda)
        err = _rel(got, want)
        report.row(label, _check(report, err < 1e-2, f"rel {err:.1e}"), ms, 4 * T * T, flops)
    report.row(f"  torch ref: {label}", "-", ms_ref, 4 * T * T, flops)

    visible = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None]
    ids = dsa.select_topk(want, visible, topk)
    q = torch.randn(1, T, Hq, D, device=dev, generator=g).to(bf).requires_grad_()
    k = torch.randn(1, T, Hkv, D, device=dev, generator=g).to(bf).requires_grad_()
    v = torch.randn(1, T, Hkv, D, device=dev, generator=g).to(bf).requires_grad_()
    do = torch.randn(1, T, Hq, D, device=dev, generator=g).to(bf)
    n_sel = int((ids >= 0).sum())
    flops = 4 * n_sel * Hq * D
    label = f"dsa sparse attn T={T} top{topk} Hq{Hq}/Hkv{Hkv} D{D}"

    def fwd_bwd():
        torch.autograd.grad(dsa.sparse_attention(q, k, v, ids), (q, k, v), do)

    with dispatch.backend("torch"):
        o_ref = dsa.sparse_attention(q, k, v, ids)
        g_ref = torch.autograd.grad(o_ref, (q, k, v), do)
        ms_ref = _median_ms(fwd_bwd, max(1, repeats // 5), cuda)
    if cuda:
        with dispatch.backend("triton"):
            o = dsa.sparse_attention(q, k, v, ids)
            grads = torch.autograd.grad(o, (q, k, v), do)
            ms_f = _median_ms(lambda: dsa.sparse_attention(q.detach(), k.detach(), v.detach(), ids), repeats, cuda)
            ms_fb = _median_ms(fwd_bwd, repeats, cuda)
        err = max([_rel(o, o_ref)] + [_rel(a, b) for a, b in zip(grads, g_ref)])
        report.row(label + " fwd", _check(report, err < 2e-2, f"rel {err:.1e}"), ms_f, 0, flops)
        report.row(label + " fwd+bwd", "(same)", ms_fb, 0, 3.5 * flops)
    report.row(f"  torch ref: fwd+bwd", "-", ms_ref, 0, 3.5 * flops)


def dry_run() -> int:
    """Every kernel against its reference, interpreted on the host at tiny shapes (``--dry``)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise SystemExit("--dry needs TRITON_INTERPRET=1 set before Python starts (Triton reads it at import)")
    print("device: host, Triton interpreted (--dry: checks only; times are not measurements)")
    report, dev = Report(None), torch.device("cpu")
    bench_mxfp4(report, dev, True, 1, 64, 128)
    bench_moe(report, dev, True, 1, E=4, H=64, I=32, k=2, tokens=[3])
    bench_paged(report, dev, True, 1, B=2, ctx=40, Hq=4, Hkv=2, D=32, block_size=16)
    bench_paged_prefill(report, dev, True, 1, chunks=2, cached=21, new=19, Hq=4, Hkv=2, D=32, block_size=16)
    bench_kda_decode(report, dev, True, 1, B=2, N=2, K=16)
    bench_dsa(report, dev, True, 1, T=32, Hq=2, Hkv=1, D=32, topk=8, n_idx=2)
    bench_topk(report, dev, True, 1, T=32, k=8)
    bench_kda_chunk(report, dev, True, 1, B=1, T=40, N=1, K=16)
    if report.failed:
        print("FAILED: a kernel disagreed with its reference (rows marked FAIL)")
    return int(report.failed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    parser.add_argument("--dry", action="store_true", help="the Triton kernels interpreted on the host, tiny shapes")
    args = parser.parse_args()
    if args.dry:
        return dry_run()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    small = args.quick or not cuda
    if cuda:
        print(f"device: {torch.cuda.get_device_name()}; median of {args.repeats} runs (CUDA events)")
        copy_gbs, _ = ceilings(dev, args.repeats)
    else:
        print(f"device: CPU ({torch.get_num_threads()} threads): no GPU, so the Triton kernels are not run; "
              "timing the torch references only (wall clock), on smaller shapes")
        copy_gbs = None
    report = Report(copy_gbs)
    repeats = args.repeats if cuda else 3
    bench_mxfp4(report, dev, cuda, repeats, *((1024, 4096) if small else (16384, 8192)))
    if small:
        bench_moe(report, dev, cuda, repeats, E=16, H=512, I=256, k=4, tokens=[8, 256])
        bench_paged(report, dev, cuda, repeats, B=4, ctx=1000, Hq=8, Hkv=2, D=64, block_size=16)
        bench_paged_prefill(report, dev, cuda, repeats, chunks=2, cached=200, new=100, Hq=8, Hkv=2, D=64, block_size=16)
        bench_kda_decode(report, dev, cuda, repeats, B=4, N=4, K=64)
        bench_dsa(report, dev, cuda, repeats, T=256, Hq=4, Hkv=1, D=64, topk=64, n_idx=4)
        bench_topk(report, dev, cuda, repeats, T=256, k=64)
        bench_kda_chunk(report, dev, cuda, repeats, B=1, T=200, N=2, K=64)
    else:  # Qwen3-30B-A3B-shaped experts; decode (64 tokens) and prefill (4096 tokens)
        bench_moe(report, dev, cuda, repeats, E=128, H=2048, I=768, k=8, tokens=[64, 4096])
        bench_paged(report, dev, cuda, repeats, B=64, ctx=4096, Hq=32, Hkv=4, D=128, block_size=16)
        bench_paged_prefill(report, dev, cuda, repeats, chunks=8, cached=2048, new=512, Hq=32, Hkv=4, D=128,
                            block_size=16)
        bench_kda_decode(report, dev, cuda, repeats, B=64, N=16, K=128)
        bench_dsa(report, dev, cuda, repeats, T=2048, Hq=32, Hkv=4, D=128, topk=1024, n_idx=16)
        bench_topk(report, dev, cuda, repeats, T=8192, k=2048)
        bench_kda_chunk(report, dev, cuda, repeats, B=1, T=8192, N=16, K=128)
    if report.failed:
        print("FAILED: a kernel disagreed with its reference (rows marked FAIL)")
    return int(report.failed)


if __name__ == "__main__":
    sys.exit(main())
