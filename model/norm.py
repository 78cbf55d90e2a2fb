"""RMSNorm, computed as transformers' Qwen3MoeRMSNorm (so bf16 results match bit for bit): the op is
``kernels.rms_norm`` (one torch reference, ``kernels/norm_rope_cpu.rms_norm_torch``, and its C++ kernel)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from jointrl.kernels.ops import Kernels, kernels_for


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision for reductions and softmaxes: float32, or float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


def outside_autocast(x: torch.Tensor):
    """A context with ``torch.autocast`` off on x's device where it is on (``learner.autocast``: the parts kept
    in x's precision -- the router's logits, the learner's attention on CPU and its head), else a no-op."""
    device = x.device.type
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x², -1) + eps)), the normalisation in float32 (float64 for fp64), through
    the model's kernel table (``kernels/ops``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels: Kernels = kernels_for("torch")  # MoETransformer.set_kernels hands down the model's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``kernels.rms_norm``: the reference ``kernels/norm_rope_cpu.rms_norm_torch``, or its C++ kernel."""
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class HeadsRMSNorm(RMSNorm):
    """RMSNorm of [..., heads, D] projections over all heads at once (OLMoE's q/k-norm): weight
    [heads·D]; the per-head norm (Qwen3) is plain `RMSNorm(D)` over the last dim."""

    def __init__(self, num_heads: int, head_dim: int, eps: float) -> None:
        super().__init__(num_heads * head_dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(-2)).view_as(x)


def qk_norm(kind: str, num_heads: int, head_dim: int, eps: float) -> nn.Module:
    """The q- or k-norm of `MoEConfig.qk_norm`: "head" (Qwen3), "full" (OLMoE), "none" (Mixtral:
    an Identity, so no `q_norm.weight` in the state dict)."""
    if kind == "head":
        return RMSNorm(head_dim, eps)
    if kind == "full":
        return HeadsRMSNorm(num_heads, head_dim, eps)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"qk_norm must be 'head', 'full' or 'none', got {kind!r}")
