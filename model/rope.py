"""Rotary position embedding, non-interleaved (`rotate_half`), as transformers' Qwen3-MoE; optionally
YaRN-scaled (gpt-oss), as transformers' `_compute_yarn_parameters`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from jointrl.model.norm import compute_dtype


def position_ids(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """RoPE positions [B, T] (int64) counted over real tokens only: 0 at each row's first real token,
    +1 per real token after it; a padding slot repeats its row's last position (0 before the first).
    The sampler (``rl/rollout``) and the learner (``rl/learner``) both take positions from here."""
    return (attention_mask_BT.long().cumsum(-1) - 1).clamp(min=0)


@dataclass(frozen=True, slots=True)
class Yarn:
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"): frequency j of D/2 is
    interpolated (divided by `factor`) below the ramp, kept above it, blended linearly between
    `low`/`high` = the dims that rotate `beta_fast` / `beta_slow` times over `original_max`
    positions; cos and sin are multiplied by 0.1·ln(factor) + 1."""

    factor: float
    original_max: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def attention_factor(self) -> float:
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def inv_freq(self, base: float, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers: no division by zero
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=dtype, device=device) / dim)
        ramp = ((torch.arange(dim // 2, dtype=dtype, device=device) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions: freqs_j = pos · θ^(-2j/D) (or YaRN's), duplicated over both halves of D."""

    def __init__(self, head_dim: int, theta: float, yarn: Yarn | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.yarn = yarn

    def inv_freq(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # Recomputed per call (head_dim/2 numbers), not a buffer: `model.to(bfloat16)` would round a
        # buffer, and HF's float32 formula must hold for parity (float64 for a float64 model).
        if self.yarn is not None:
            return self.yarn.inv_freq(self.theta, self.head_dim, dtype, device)
        return 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=dtype, device=device) / self.head_dim))

    def forward(self, position_ids_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] → (cos, sin), each [B, T, head_dim] in `dtype`."""
        cdt = compute_dtype(dtype)
        freqs_BTd = position_ids_BT[..., None].to(cdt) * self.inv_freq(cdt, position_ids_BT.device)
        emb_BTD = torch.cat((freqs_BTd, freqs_BTd), dim=-1)
        if self.yarn is None:
            return emb_BTD.cos().to(dtype), emb_BTD.sin().to(dtype)
        scale = self.yarn.attention_factor()
        return (emb_BTD.cos() * scale).to(dtype), (emb_BTD.sin() * scale).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] rotated by position: x·cos + rotate_half(x)·sin."""
    cos, sin = cos_BTD.unsqueeze(1), sin_BTD.unsqueeze(1)
    return x_BHTD * cos + rotate_half(x_BHTD) * sin
