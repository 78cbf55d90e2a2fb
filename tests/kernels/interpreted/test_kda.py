"""KDA Triton kernels == the torch reference (interpreter; see conftest).

Stated bounds (relative Frobenius error): 1e-5 on o and on the final state (fp32 both sides;
only reduction order differs). Chunked backward, against autograd through the float64
reference: 1e-12 on every gradient when the kernels also run in float64 (the algebra is exact:
only rounding differs), 1e-5 when they run in fp32 (measured: below 1e-6, also with strong decay).
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
    o_ref, s_ref = kda.kda_recurrent_torch(q, k, v, gate, beta, s0)
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
    o_ref, s_ref = kda.kda_recurrent_torch(q, k, v, gate, beta, s0)
    assert rel(o, o_ref) < 1e-5 and rel(s, s_ref) < 1e-5


def _chunk_grads(T, K, V, with_state, loss_on_state, dtype, seed, gate_scale=0.3, public=False):
    """Gradients of Σ o·do (+ Σ S_T·dS if loss_on_state) w.r.t. (q, k, v, g, β, state₀): the
    chunk kernels' (dtype) and autograd's through the float64 reference, both in float64."""
    q, k, v, gate, beta, s0 = _inputs(1, T, 2, K, V, seed=seed, dtype=dtype)
    gate = gate * (gate_scale / 0.3)
    xs = [q, k, v, gate, beta] + ([s0.to(dtype)] if with_state else [])
    g = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(1, T, 2, V, generator=g, dtype=torch.float64)
    ds = torch.randn(1, 2, K, V, generator=g, dtype=torch.float64)

    def grads(fn, inputs):
        inputs = [x.detach().requires_grad_() for x in inputs]
        o, s = fn(*inputs, *([] if with_state else [None]))
        loss = (o.double() * do).sum() + ((s.double() * ds).sum() if loss_on_state else 0.0)
        return [gr.double() for gr in torch.autograd.grad(loss, inputs)], [x.dtype for x in inputs]

    fn = kda.kda_chunk if public else kda._KDAChunk.apply
    got, _ = grads(fn, xs)
    want, _ = grads(kda.kda_recurrent_torch, [x.double() for x in xs])
    return got, want


@pytest.mark.parametrize(("T", "dtype", "with_state", "loss_on_state", "bound"), [
    (20, torch.float64, True, True, 1e-12),  # past one 16-token chunk; V = 40 spans a partial value block
    (17, torch.float32, False, False, 1e-5),  # through kda_chunk (the public op) from a zero state
])
def test_chunk_backward_matches_reference_autograd(T, dtype, with_state, loss_on_state, bound, rel):
    got, want = _chunk_grads(T, 32, 40, with_state, loss_on_state, dtype, seed=T, public=dtype == torch.float32)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), got, want):
        assert rel(a, b) < bound, name


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 15, 16, 33, 64, 65])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_backward_lengths(T, with_state, rel):
    got, want = _chunk_grads(T, 48, 32, with_state, with_state, torch.float32, seed=T + 100 * with_state)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), got, want):
        if b.abs().max() == 0:  # one token from a zero state: o does not depend on g at all
            assert a.abs().max() < 1e-6, name
        else:
            assert rel(a, b) < 1e-5, name


@pytest.mark.slow
def test_chunk_backward_float64_and_strong_decay(rel):
    got, want = _chunk_grads(63, 16, 64, True, True, torch.float64, seed=5)
    assert all(rel(a, b) < 1e-12 for a, b in zip(got, want))
    # log-decay down to -4 per token: a chunk forgets up to e^-64 per channel, near the fp32 limit
    got, want = _chunk_grads(40, 32, 32, True, True, torch.float32, seed=6, gate_scale=4.0)
    assert all(rel(a, b) < 1e-5 for a, b in zip(got, want))


def test_chunk_gradients_come_back_in_the_inputs_dtypes():
    q, k, v, gate, beta, s0 = _inputs(1, 3, 1, 16, 32, seed=9, dtype=torch.bfloat16)
    xs = [x.requires_grad_() for x in (q, k, v, gate, beta, s0)]
    o, s = kda.kda_chunk(*xs)
    assert o.dtype == s.dtype == torch.float32 and o.grad_fn is not None
    grads = torch.autograd.grad(o.sum() + s.sum(), xs)
    assert [gr.dtype for gr in grads] == [x.dtype for x in xs]
    assert all(torch.isfinite(gr.float()).all() for gr in grads)
