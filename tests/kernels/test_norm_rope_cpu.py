"""``kernels/norm_rope_cpu``: the C++ RMSNorm and q/k-norm + RoPE equal their torch references
(the model's arithmetic through autograd) in values and gradients, float64 and float32, on
awkward shapes (one row, odd row counts, head_dim 2)."""

import pytest
import torch

from jointrl.kernels import norm_rope_cpu as K

pytestmark = pytest.mark.skipif(K.load_kernel() is None, reason="no C++ toolchain")

TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-5)}


def _grads(fn, inputs, dy):
    leaves = [t.clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(1, 8), (7, 64), (3, 5, 256), (130, 2)])
def test_rms_norm_equals_torch(dtype, shape):
    g = torch.Generator().manual_seed(shape[0])
    x, w = torch.randn(*shape, generator=g, dtype=dtype), torch.randn(shape[-1], generator=g, dtype=dtype)
    dy = torch.randn(*shape, generator=g, dtype=dtype)
    ref = _grads(lambda x, w: K.rms_norm_torch(x, w, 1e-6), (x, w), dy)
    got = _grads(lambda x, w: K.rms_norm(x, w, 1e-6), (x, w), dy)
    for r, o, name in zip(ref, got, ("y", "dx", "dw")):
        torch.testing.assert_close(o, r, **TOL[dtype], msg=name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("N,heads,D", [(1, 1, 2), (5, 4, 64), (67, 2, 8)])
def test_qk_norm_rope_equals_torch(dtype, N, heads, D):
    g = torch.Generator().manual_seed(N * heads + D)
    x, w = torch.randn(N, heads, D, generator=g, dtype=dtype), torch.randn(D, generator=g, dtype=dtype)
    angle = torch.randn(N, D // 2, generator=g, dtype=dtype).repeat(1, 2)
    dy = torch.randn(N, heads, D, generator=g, dtype=dtype)
    ref = _grads(lambda x, w: K.qk_norm_rope_torch(x, w, 1e-6, angle.cos(), angle.sin()), (x, w), dy)
    got = _grads(lambda x, w: K.qk_norm_rope(x, w, 1e-6, angle.cos(), angle.sin()), (x, w), dy)
    for r, o, name in zip(ref, got, ("y", "dx", "dw")):
        torch.testing.assert_close(o, r, **TOL[dtype], msg=name)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 2, 4, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    angle = torch.randn(3, 2, generator=g, dtype=torch.float64).repeat(1, 2)
    assert torch.autograd.gradcheck(lambda x, w: K.qk_norm_rope(x, w, 1e-6, angle.cos(), angle.sin()),
                                    (x.requires_grad_(), w.requires_grad_()))
    assert torch.autograd.gradcheck(lambda x, w: K.rms_norm(x, w, 1e-6), (x, w))
