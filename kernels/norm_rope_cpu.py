"""The learner's RMSNorm and q/k-norm + RoPE on CPU, forward and backward, one C++ call each.

    rms_norm:       y_r = w ⊙ x_r · ρ_r,   ρ_r = 1 / sqrt(mean(x_r²) + eps)
                    dx_r = ρ_r (g_r ⊙ w − x̂_r · mean(g_r ⊙ w ⊙ x̂_r)),  x̂_r = x_r ρ_r;  dw = Σ_r g_r ⊙ x̂_r
    qk_norm_rope:   per token n and head h: t = rms_norm(x_nh) (weight w [D]), then RoPE
                    y = t ⊙ cos_n + rotate_half(t) ⊙ sin_n,   rotate_half(t) = [-t₂, t₁];
                    backward: dt = dy ⊙ cos_n + [dy₂ ⊙ sin₂, −dy₁ ⊙ sin₁] (rotate_half's transpose), then
                    rms_norm's backward

Why: in autograd the model's ``RMSNorm`` is 6 ops forward and about 12 backward, ``apply_rope`` 5 and
8, each a full pass over the activations (with its allocation); a bench_moe learner step runs 25
norms and 12 RoPEs over ~1,100 tokens. These do the same arithmetic in one pass forward and one
backward (two for ``dw``'s per-thread partial sums).

Equal to the torch references (``*_torch``: the model's ``RMSNorm`` / ``apply_rope`` arithmetic)
up to summation order: float64 to ~1e-15 relative, float32 to a few ulp, values and gradients
(tests/kernels/test_norm_rope_cpu.py). The C++ is ``csrc/norm_rope.cpp`` (``torch.ops.jointrl.norm_fwd``
/ ``norm_bwd``, built by ``kernels/build``); ``load_kernel()`` is None where it cannot be built, and
``rms_norm`` / ``qk_norm_rope`` then run the references through autograd.

Shapes: R rows, D the normalised width (hidden, or head_dim), N tokens, h heads.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from jointrl.kernels.cpu_extension import load_ops

__all__ = ["load_kernel", "rms_norm", "rms_norm_torch", "qk_norm_rope", "qk_norm_rope_torch", "usable"]

@functools.cache
def load_kernel():
    """The ops (``kernels/cpu_extension.load_ops``), or None where they cannot be built here."""
    return load_ops(["norm_fwd", "norm_bwd"])


def usable(x: Tensor) -> bool:
    """Whether ``rms_norm`` / ``qk_norm_rope`` run the C++ kernel for ``x``: CPU, float32/64, compiled."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and load_kernel() is not None


class _NormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, w_D, eps, cos_ND, sin_ND, heads):
        y_RD, rstd_R = load_kernel().norm_fwd(x_RD, w_D, eps, cos_ND, sin_ND, heads)
        ctx.save_for_backward(x_RD, w_D, rstd_R, cos_ND, sin_ND)
        ctx.heads = heads
        return y_RD

    @staticmethod
    def backward(ctx, dy_RD):
        x_RD, w_D, rstd_R, cos_ND, sin_ND = ctx.saved_tensors
        dx_RD, dw_D = load_kernel().norm_bwd(dy_RD.contiguous(), x_RD, w_D, rstd_R, cos_ND, sin_ND, ctx.heads)
        return dx_RD, dw_D, None, None, None, None


def rms_norm_torch(x: Tensor, w_D: Tensor, eps: float) -> Tensor:
    """The torch reference of RMSNorm, the one every norm of the model, the engine and the learner is
    (``model.norm.RMSNorm`` calls it; the C++ kernels are tested against it):
    ``w ⊙ (x / sqrt(mean(x², -1) + eps))``, normalised in float32 (float64 for a float64 x) and rounded
    back to x's dtype before the weight, as transformers' Qwen3MoeRMSNorm (bf16 equal bit for bit)."""
    x_f = x.to(torch.promote_types(x.dtype, torch.float32))
    x_f = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + eps)
    return w_D * x_f.to(x.dtype)


def rms_norm(x: Tensor, w_D: Tensor, eps: float) -> Tensor:
    """x [..., D], w [D] (x's dtype) → y [..., D], differentiable in x and w."""
    if not usable(x):
        return rms_norm_torch(x, w_D, eps)
    D = x.shape[-1]
    empty = x.new_empty(0)
    return _NormRope.apply(x.reshape(-1, D).contiguous(), w_D.contiguous(), eps, empty, empty, 1).view(x.shape)


def qk_norm_rope_torch(x_NhD: Tensor, w_D: Tensor, eps: float, cos_ND: Tensor, sin_ND: Tensor) -> Tensor:
    """``model.attention``'s per-head q/k-norm then ``apply_rope``, on [N, heads, D]."""
    t = rms_norm_torch(x_NhD, w_D, eps)
    x1, x2 = t.chunk(2, dim=-1)
    return t * cos_ND[:, None] + torch.cat((-x2, x1), dim=-1) * sin_ND[:, None]


def qk_norm_rope(x_NhD: Tensor, w_D: Tensor, eps: float, cos_ND: Tensor, sin_ND: Tensor) -> Tensor:
    """x [N, heads, D] (a projection's heads), w [D], cos/sin [N, D] → [N, heads, D] normed per head and
    rotated, differentiable in x and w."""
    if not usable(x_NhD):
        return qk_norm_rope_torch(x_NhD, w_D, eps, cos_ND, sin_ND)
    N, h, D = x_NhD.shape
    return _NormRope.apply(x_NhD.reshape(N * h, D).contiguous(), w_D.contiguous(), eps, cos_ND.contiguous(),
                           sin_ND.contiguous(), h).view(N, h, D)
