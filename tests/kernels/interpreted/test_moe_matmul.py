"""MXFP4 MoE Triton kernels == dequantize-then-torch (interpreter; see conftest).

Stated bounds (relative Frobenius error against the torch reference): fp32 activations 1e-5
(both sides accumulate exact products in fp32, only the summation order differs); bf16
activations 2e-2, because the interpreter converts fp32 -> bf16 by truncation, not
round-to-nearest-even as the GPU does (h is rounded to bf16 between the two matmuls).
"""

from __future__ import annotations

import pytest
import torch

from jointrl.kernels import moe_matmul as mm
from jointrl.kernels.mxfp4 import quantize_mxfp4

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _problem(n_tokens, k, E, H, I, seed, empty_expert=True):
    g = torch.Generator().manual_seed(seed)
    gate_up = quantize_mxfp4(torch.randn(E, 2 * I, H, generator=g) * H**-0.5)
    down = quantize_mxfp4(torch.randn(E, H, I, generator=g) * I**-0.5)
    x = torch.randn(n_tokens, H, generator=g)
    pool = E - 1 if empty_expert else E  # with empty_expert, expert 1 gets no token
    ids = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(n_tokens)]) if n_tokens else \
        torch.zeros(0, k, dtype=torch.long)
    if empty_expert:
        ids = ids + (ids >= 1).long()
    weights = torch.softmax(torch.randn(n_tokens, k, generator=g), -1)
    return x, ids, weights, gate_up, down


def _sorted(x, ids, weights, E):
    k = ids.shape[1]
    order = torch.argsort(ids.reshape(-1), stable=True)
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.bincount(ids.reshape(-1), minlength=E), 0)
    return x[order // k], offsets, weights.reshape(-1)[order]


_CASES = [(n, dtype, cfg) for n in (63, 65) for dtype in (torch.float32, torch.bfloat16)
          for cfg in ("decode", "prefill")]
_DEFAULT = {(63, torch.float32, "decode"), (65, torch.float32, "prefill"), (65, torch.bfloat16, "decode")}


@pytest.mark.parametrize(("n_tokens", "dtype", "config"), [
    pytest.param(*case, marks=() if case in _DEFAULT else pytest.mark.slow, id=f"{case[0]}-{case[1]}-{case[2]}")
    for case in _CASES])
def test_swiglu_and_down_match_reference(n_tokens, dtype, config, rel):
    config = {"decode": mm.DECODE, "prefill": mm.PREFILL}[config]
    E, H, I = 5, 96, 96  # H not a multiple of block_k, I not a multiple of block_n or block_k
    x, ids, weights, (gub, gus), (db, ds) = _problem(n_tokens, 2, E, H, I, seed=n_tokens)
    x_AH, offsets, w_A = _sorted(x.to(dtype), ids, weights.to(dtype), E)
    assert offsets[2] == offsets[1]  # expert 1 has no assignment

    h = mm._moe_swiglu_triton(x_AH, offsets, gub, gus, config)
    h_ref = mm._moe_swiglu_torch(x_AH, offsets, gub, gus)
    assert h.dtype == dtype and rel(h, h_ref) < TOL[dtype]
    y = mm._moe_down_triton(h_ref, offsets, db, ds, w_A, config)
    y_ref = mm._moe_down_torch(h_ref, offsets, db, ds, w_A)
    assert y.dtype == dtype and rel(y, y_ref) < TOL[dtype]


def test_one_expert_takes_every_token_across_many_tiles(rel):
    E, H, I = 4, 64, 64
    x, ids, weights, (gub, gus), (db, ds) = _problem(70, 1, E, H, I, seed=3, empty_expert=False)
    ids[:] = 2
    x_AH, offsets, w_A = _sorted(x, ids, weights, E)
    h = mm._moe_swiglu_triton(x_AH, offsets, gub, gus, mm.DECODE)  # 5 tiles of 16 rows
    assert rel(h, mm._moe_swiglu_torch(x_AH, offsets, gub, gus)) < 1e-5
    y = mm._moe_down_triton(h, offsets, db, ds, w_A, mm.DECODE)
    assert rel(y, mm._moe_down_torch(h, offsets, db, ds, w_A)) < 1e-5


@pytest.mark.parametrize("n_tokens", [0, 1, 63])
def test_full_experts_ffn_matches_reference(n_tokens, rel):
    E, H, I = 8, 64, 96
    x, ids, weights, (gub, gus), (db, ds) = _problem(n_tokens, 2, E, H, I, seed=11)
    y = mm.moe_experts_mxfp4(x, ids, weights, gub, gus, db, ds)
    from jointrl.kernels import dispatch

    with dispatch.backend("torch"):
        y_ref = mm.moe_experts_mxfp4(x, ids, weights, gub, gus, db, ds)
    assert y.shape == (n_tokens, H)
    if n_tokens:
        assert rel(y, y_ref) < 1e-5


def test_nan_scale_poisons_only_its_expert():
    E, H, I = 4, 64, 64
    x, ids, weights, (gub, gus), (db, ds) = _problem(20, 1, E, H, I, seed=4, empty_expert=False)
    gus = gus.clone()
    gus[3, 5, 0] = 0xFF  # one NaN block in expert 3's gate rows
    x_AH, offsets, _ = _sorted(x, ids, weights, E)
    h = mm._moe_swiglu_triton(x_AH, offsets, gub, gus, mm.DECODE)
    lo, hi = offsets[3].item(), offsets[4].item()
    assert hi > lo and h[lo:hi, 5].isnan().all()
    assert not h[:lo].isnan().any() and not h[hi:].isnan().any() and not h[lo:hi, :5].isnan().any()


def _dense_problem(n_tokens, k, E, H, I, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * I**-0.5).to(dtype)
    x = torch.randn(n_tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(n_tokens)])
    ids = ids + (ids >= 1).long()  # expert 1 gets no token
    return x, ids, torch.softmax(torch.randn(n_tokens, k, generator=g), -1), gate_up, down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_experts_match_the_table_reference(dtype, rel):
    """The ``triton`` table's ``moe_experts`` (grouped kernels, ``MXFP4=False``) against the reference
    ``moe_experts_torch``; bf16 experts with fp32 tokens, compared in fp32 against the reference over the same
    (exactly widened) bf16 values, so both sides compute in fp32."""
    from jointrl.kernels import moe_experts as me

    E, H, I = 5, 96, 80  # neither a multiple of the blocks
    x, ids, weights, gate_up, down = _dense_problem(37, 2, E, H, I, seed=5, dtype=dtype)
    y = me.moe_experts_triton(x, ids, weights, gate_up.float(), down.float()) if dtype == torch.float32 else \
        mm.moe_experts_dense_triton(x, ids, weights, gate_up.float(), down.float())
    y_ref = me.moe_experts_torch(x, ids, weights, gate_up.float(), down.float())
    assert y.dtype == torch.float32 and rel(y, y_ref) < 1e-5
    # bf16 experts in their own dtype: h and y rounded to bf16 on both sides (truncation here, see TOL)
    yb = me.moe_experts_triton(x, ids, weights, gate_up, down)
    assert yb.dtype == torch.float32 and rel(yb, me.moe_experts_torch(x, ids, weights, gate_up, down)) < TOL[dtype]


def test_dense_experts_with_gradients_take_the_reference():
    from jointrl.kernels import moe_experts as me

    x, ids, weights, gate_up, down = _dense_problem(9, 2, 4, 64, 32, seed=6, dtype=torch.float32)
    gate_up.requires_grad_(True)
    y = me.moe_experts_triton(x, ids, weights, gate_up, down)
    assert y.grad_fn is not None and "RoutedSwiGLU" in type(y.grad_fn).__name__
