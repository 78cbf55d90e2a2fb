"""RMSNorm, computed as transformers' Qwen3MoeRMSNorm (so bf16 results match bit for bit)."""

from __future__ import annotations

import torch
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision for reductions and softmaxes: float32, or float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x², -1) + eps)), the normalisation in float32 (float64 for fp64)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_f = x.to(compute_dtype(x.dtype))
        x_f = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_f.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
