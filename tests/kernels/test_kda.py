"""KDA: the torch references (recurrent and chunked) against the matrix form of the delta rule and
against each other.

The Triton kernel is compared with this reference in tests/kernels/interpreted/ and compiled
for sm_90 in test_compile_sm90.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jointrl.kernels import dispatch
from jointrl.kernels.kda import kda_chunk, kda_chunk_torch, kda_recurrent, kda_recurrent_torch


def _inputs(B, T, N, K, V, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, N, K, generator=g, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, T, N, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, N, V, generator=g, dtype=dtype)
    gate = -torch.rand(B, T, N, K, generator=g, dtype=dtype) * 0.5
    beta = torch.rand(B, T, N, generator=g, dtype=dtype)
    s0 = torch.randn(B, N, K, V, generator=g, dtype=dtype)
    return q, k, v, gate, beta, s0


def test_reference_equals_the_matrix_form():
    B, T, N, K, V = 2, 5, 3, 6, 4
    q, k, v, gate, beta, s0 = _inputs(B, T, N, K, V, seed=0)
    with dispatch.backend("torch"):
        o, s = kda_recurrent(q, k, v, gate, beta, s0)
    for b in range(B):
        for n in range(N):
            S = s0[b, n]
            for t in range(T):
                kt = k[b, t, n][:, None]
                S = (torch.eye(K, dtype=S.dtype) - beta[b, t, n] * kt @ kt.T) @ torch.diag(gate[b, t, n].exp()) @ S \
                    + beta[b, t, n] * kt @ v[b, t, n][None, :]
                torch.testing.assert_close(o[b, t, n], S.T @ q[b, t, n] * K**-0.5, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(s[b, n], S, rtol=1e-12, atol=1e-12)


def test_chunked_reference_equals_the_recurrent_one():
    """The two torch forms (one reference per op: ``kda_recurrent_torch`` token by token, ``kda_chunk_torch``
    in WY chunks) agree, for chunks that divide T and that do not."""
    q, k, v, gate, beta, s0 = _inputs(2, 9, 2, 8, 8, seed=1)
    o, s = kda_recurrent_torch(q, k, v, gate, beta, s0)
    for chunk in (4, 64):
        o_c, s_c = kda_chunk_torch(q, k, v, gate, beta, s0, chunk)
        torch.testing.assert_close(o, o_c, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(s, s_c, rtol=1e-10, atol=1e-10)


def test_public_chunk_on_torch_has_the_recurrent_references_gradients():
    """``kda_chunk`` on the torch backend (the WY form through autograd) has the gradients of the token
    loop the chunked backward kernel is tested against."""
    xs = [x.requires_grad_() for x in _inputs(1, 21, 2, 8, 6, seed=4)]
    g = torch.Generator().manual_seed(5)
    w_o = torch.randn(1, 21, 2, 6, generator=g, dtype=torch.float64)
    w_s = torch.randn(1, 2, 8, 6, generator=g, dtype=torch.float64)
    with dispatch.backend("torch"):
        o, s = kda_chunk(*xs, chunk=8)
    got = torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), xs)
    o_m, s_m = kda_recurrent_torch(*xs)
    want = torch.autograd.grad((o_m * w_o).sum() + (s_m * w_s).sum(), xs)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


def test_input_validation():
    q, k, v, gate, beta, s0 = _inputs(1, 2, 2, 4, 4, seed=2)
    with pytest.raises(ValueError, match="beta"):
        kda_recurrent(q, k, v, gate, beta[..., :1])
    with pytest.raises(ValueError, match="state"):
        kda_recurrent(q, k, v, gate, beta, s0[:, :1])
