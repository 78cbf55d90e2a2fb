"""Full (global) GQA attention with q/k-norm and RoPE, as transformers' Qwen3MoeAttention.

Tensor names carry their shape: B batch, T new tokens, S keys (cached + new), H hidden,
Hq/Hkv query/key-value heads, D head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jointrl.model.config import MoEConfig
from jointrl.model.kv_cache import KVCache
from jointrl.model.norm import qk_norm
from jointrl.model.rope import apply_rope


def build_attention_mask(past: int, T: int, key_mask_BS: torch.Tensor | None,
                         device: torch.device) -> torch.Tensor:
    """Boolean SDPA mask, True = attend: [B, 1, T, S] (or [1, 1, T, S] without `key_mask_BS`).

    New token t sits at cache slot past+t and sees slots s <= past+t that are real tokens. Its own
    slot is always visible, so a padding query (left padding masks every earlier key) attends to
    itself instead of producing NaN; real queries are unaffected, their own slot being causal anyway.
    """
    S = past + T
    q_slot_T1 = torch.arange(past, S, device=device)[:, None]
    k_slot_1S = torch.arange(S, device=device)[None, :]
    causal_TS = k_slot_1S <= q_slot_T1
    if key_mask_BS is None:
        return causal_TS[None, None]
    if key_mask_BS.shape[1] != S:
        raise ValueError(f"attention_mask must cover past + new tokens = {S} positions, "
                         f"got shape {tuple(key_mask_BS.shape)}")
    mask_BTS = causal_TS[None] & key_mask_BS.to(device=device, dtype=torch.bool)[:, None, :]
    return (mask_BTS | (k_slot_1S == q_slot_T1)[None])[:, None]


class Attention(nn.Module):
    """softmax(q kᵀ / √D + mask) v over grouped heads; q, k RMS-normed per head before RoPE."""

    def __init__(self, config: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        H, D = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        self.q_norm = qk_norm(config.qk_norm, self.num_heads, D, config.rms_norm_eps)
        self.k_norm = qk_norm(config.qk_norm, self.num_kv_heads, D, config.rms_norm_eps)

    def forward(self, x_BTH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask_B1TS: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        B, T, _ = x_BTH.shape
        q_BHTD = self.q_norm(self.q_proj(x_BTH).view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        k_BHTD = self.k_norm(self.k_proj(x_BTH).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v_BHTD = self.v_proj(x_BTH).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q_BHTD, k_BHTD = apply_rope(q_BHTD, cos, sin), apply_rope(k_BHTD, cos, sin)
        if cache is not None:
            k_BHTD, v_BHTD = cache.update(self.layer_idx, k_BHTD, v_BHTD)
        out_BHTD = F.scaled_dot_product_attention(
            q_BHTD, k_BHTD, v_BHTD, attn_mask=mask_B1TS, scale=self.head_dim ** -0.5,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out_BHTD.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))
