"""Rotary position embedding, non-interleaved (`rotate_half`), as transformers' Qwen3-MoE."""

from __future__ import annotations

import torch
from torch import nn

from jointrl.model.norm import compute_dtype


def position_ids(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """RoPE positions [B, T] (int64) counted over real tokens only: 0 at each row's first real token,
    +1 per real token after it; a padding slot repeats its row's last position (0 before the first).
    The sampler (``rl/rollout``) and the learner (``rl/learner``) both take positions from here."""
    return (attention_mask_BT.long().cumsum(-1) - 1).clamp(min=0)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions: freqs_j = pos · θ^(-2j/D), duplicated over both halves of D."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def inv_freq(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # Recomputed per call (head_dim/2 numbers), not a buffer: `model.to(bfloat16)` would round a
        # buffer, and HF's float32 formula must hold for parity (float64 for a float64 model).
        return 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=dtype, device=device) / self.head_dim))

    def forward(self, position_ids_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] → (cos, sin), each [B, T, head_dim] in `dtype`."""
        cdt = compute_dtype(dtype)
        freqs_BTd = position_ids_BT[..., None].to(cdt) * self.inv_freq(cdt, position_ids_BT.device)
        emb_BTD = torch.cat((freqs_BTd, freqs_BTd), dim=-1)
        return emb_BTD.cos().to(dtype), emb_BTD.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] rotated by position: x·cos + rotate_half(x)·sin."""
    cos, sin = cos_BTD.unsqueeze(1), sin_BTD.unsqueeze(1)
    return x_BHTD * cos + rotate_half(x_BHTD) * sin
