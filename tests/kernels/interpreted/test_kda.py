"""KDA recurrent Triton kernel == the torch reference (interpreter; see conftest).

Stated bound: relative Frobenius error 1e-5 on o and on the final state (fp32 both sides,
same order of operations; only reduction order differs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jointrl.kernels import kda


def _inputs(B, T, N, K, V, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, N, K, generator=g), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, N, K, generator=g), dim=-1).to(dtype)
    v = torch.randn(B, T, N, V, generator=g).to(dtype)
    gate = (-torch.rand(B, T, N, K, generator=g) * 0.3).to(dtype)
    beta = torch.rand(B, T, N, generator=g).to(dtype)
    return q, k, v, gate, beta, torch.randn(B, N, K, V, generator=g)


@pytest.mark.parametrize(("T", "K", "V", "dtype", "with_state"), [
    (1, 48, 40, torch.float32, True),  # the decode step; K, V no multiples of the tiles
    (63, 32, 32, torch.float32, False),  # a fused prefill from zeros
    (65, 16, 64, torch.bfloat16, True),
])
def test_recurrent_matches_reference(T, K, V, dtype, with_state, rel):
    q, k, v, gate, beta, s0 = _inputs(1 if T > 1 else 2, T, 2, K, V, seed=T + K, dtype=dtype)
    s0 = s0 if with_state else None
    o, s = kda._kda_recurrent_triton(q, k, v, gate, beta, s0)
    o_ref, s_ref = kda._kda_recurrent_torch(q, k, v, gate, beta, s0)
    assert o.dtype == s.dtype == torch.float32
    assert rel(o, o_ref) < 1e-5 and rel(s, s_ref) < 1e-5


def test_decode_steps_continue_a_prefill(rel):
    q, k, v, gate, beta, _ = _inputs(1, 6, 2, 32, 32, seed=3, dtype=torch.float32)
    o_all, s_all = kda.kda_recurrent(q, k, v, gate, beta)
    o_pre, s = kda.kda_recurrent(q[:, :4], k[:, :4], v[:, :4], gate[:, :4], beta[:, :4])
    outs = [o_pre]
    for t in (4, 5):
        o_t, s = kda.kda_recurrent(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], gate[:, t:t + 1], beta[:, t:t + 1], s)
        outs.append(o_t)
    assert rel(torch.cat(outs, 1), o_all) < 1e-6 and rel(s, s_all) < 1e-6


@pytest.mark.parametrize(("T", "K", "V", "with_state"), [
    (63, 32, 40, True),  # T not a multiple of the 16-token chunk, V not of the value block
    (17, 48, 32, False),
])
def test_chunk_forward_matches_reference(T, K, V, with_state, rel):
    q, k, v, gate, beta, s0 = _inputs(1, T, 2, K, V, seed=T * K, dtype=torch.float32)
    s0 = s0 if with_state else None
    o, s = kda._kda_chunk_triton(q, k, v, gate, beta, s0)
    o_ref, s_ref = kda._kda_recurrent_torch(q, k, v, gate, beta, s0)
    assert rel(o, o_ref) < 1e-5 and rel(s, s_ref) < 1e-5


def test_chunk_forward_falls_back_to_the_reference_under_autograd():
    q, k, v, gate, beta, _ = _inputs(1, 5, 1, 16, 16, seed=9, dtype=torch.float32)
    v.requires_grad_()
    o, _ = kda.kda_chunk_forward(q, k, v, gate, beta)
    assert o.grad_fn is not None  # the kernel path would have returned a leaf
