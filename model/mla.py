"""Multi-head latent attention (MLA) as Kimi-Linear's full-attention layers: transformers' `KimiLinearAttention`.

Per token x (H hidden), Hq heads, R = `kv_lora_rank`, Dn/Dr/Dv = `qk_nope_head_dim` / `qk_rope_head_dim` /
`v_head_dim`:

    q        = q_proj(x)                                   or q_b_proj(RMSNorm(q_a_proj(x)))  (`q_lora_rank`)
             → per head [q_nope (Dn); q_rot (Dr)]
    [c; kr]  = kv_a_proj_with_mqa(x),  c ∈ R^R, kr ∈ R^Dr;  c ← kv_a_layernorm(c)
    latent   = [c; kr] ∈ R^{R+Dr}                          what the cache keeps per token (`update_latent`)
    [k_nope; v] per head = kv_b_proj(c),  key = [k_nope; kr] (kr shared by every head)
    out      = o_proj(softmax(q·keyᵀ / √(Dn+Dr) + mask) · v)

Kimi-Linear's MLA is NoPE: `kr` is the "decoupled RoPE" part by its name and shape (DeepSeek's layout),
but neither transformers nor the hub checkpoint (`mla_use_nope: true`) rotates it, so neither do we.
The two RMSNorms use eps 1e-6 (transformers builds them with its RMSNorm default, not `rms_norm_eps`).

Two exact forms of the same attention, chosen per forward by their cost (`absorbed_pays`):
- expanded: kv_b_proj expands every cached latent into per-head keys and values, then SDPA;
- absorbed (decode): W_UK, W_UV = kv_b_proj's key and value rows per head; q_lat = q_nope·W_UK ∈ R^R, the
  scores are [q_lat; q_rot]·latent and the output is (softmax · c)·W_UVᵀ, so the S cached latents are
  read as one shared key/value head and never expanded.

Parameter names and layout equal transformers', so its weights copy over unchanged.
Shapes: B batch, T new tokens, S keys (cached + new), H hidden, Hq heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jointrl.model.attention import AttentionBatch
from jointrl.model.config import MoEConfig
from jointrl.model.norm import RMSNorm
from jointrl.model.state import StateSpec

MLA_NORM_EPS = 1e-6  # transformers' KimiLinearAttention: q_a_layernorm / kv_a_layernorm at the RMSNorm default


def absorbed_pays(T: int, S: int, R: int, Dn: int, Dr: int, Dv: int) -> bool:
    """Whether the absorbed form takes fewer multiply-adds per head than the expanded one for T queries over S
    keys: expanded S·R·(Dn+Dv) + T·S·(Dn+Dr+Dv), absorbed T·R·(Dn+Dv) + T·S·(2R+Dr). Decode (T ≪ S) picks
    absorbed; a prefill or training forward (T = S) picks expanded unless 2R < Dn + Dv."""
    expanded = S * R * (Dn + Dv) + T * S * (Dn + Dr + Dv)
    absorbed = T * R * (Dn + Dv) + T * S * (2 * R + Dr)
    return absorbed < expanded


class MultiHeadLatentAttention(nn.Module):
    """One `mla` layer (see the module docstring); its cache keeps the latent, R + Dr values per token."""

    def __init__(self, config: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        H, Hq = config.hidden_size, config.num_attention_heads
        self.num_heads, self.rank, self.q_rank = Hq, config.kv_lora_rank, config.q_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        qk = self.nope_dim + self.rope_dim
        # Registration order = transformers' (q_proj | q_a_proj, q_a_layernorm, q_b_proj; kv_a..., o_proj).
        if self.q_rank is None:
            self.q_proj = nn.Linear(H, Hq * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, self.q_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_rank, MLA_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_rank, Hq * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, MLA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, Hq * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(Hq * self.v_dim, H, bias=False)
        self.scale = qk ** -0.5
        self.state_spec = StateSpec(latent_dim=self.rank + self.rope_dim)

    def forward(self, x_BTH: torch.Tensor, batch: AttentionBatch, absorbed: bool | None = None) -> torch.Tensor:
        """→ y [B, T, H]; the new latents are appended to `batch.cache` (when given) first. `absorbed`: force
        the form (True / False); None chooses by `absorbed_pays`."""
        B, T, _ = x_BTH.shape
        Hq, R, Dn, Dr, Dv = self.num_heads, self.rank, self.nope_dim, self.rope_dim, self.v_dim
        q = self.q_proj(x_BTH) if self.q_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTH)))
        q_BHTQ = q.view(B, T, Hq, Dn + Dr).transpose(1, 2)
        c_BTR, kr_BTD = self.kv_a_proj_with_mqa(x_BTH).split((R, Dr), dim=-1)
        latent_BTL = torch.cat((self.kv_a_layernorm(c_BTR), kr_BTD), dim=-1)
        if batch.cache is not None:
            latent_BTL = batch.cache.update_latent(self.layer_idx, latent_BTL)
        S = latent_BTL.shape[1]
        mask = batch.mask()
        if absorbed if absorbed is not None else absorbed_pays(T, S, R, Dn, Dr, Dv):
            w_HQR = self.kv_b_proj.weight.view(Hq, Dn + Dv, R)
            q_lat_BHTR = torch.einsum("bhtd,hdr->bhtr", q_BHTQ[..., :Dn], w_HQR[:, :Dn])
            # one shared key/value head: the Hq·T queries as the rows of one head (row h·T + t), which CPU
            # SDPA runs ~20x faster than enable_gqa's broadcast over heads at 32K keys
            q_B1NL = torch.cat((q_lat_BHTR, q_BHTQ[..., Dn:]), dim=-1).reshape(B, 1, Hq * T, R + Dr)
            kv_B1SL = latent_BTL[:, None]
            o_B1NR = F.scaled_dot_product_attention(q_B1NL, kv_B1SL, kv_B1SL[..., :R], attn_mask=mask.repeat(1, 1, Hq, 1),
                                                    scale=self.scale)
            out_BHTV = torch.einsum("bhtr,hvr->bhtv", o_B1NR.view(B, Hq, T, R), w_HQR[:, Dn:])
        else:
            c_BSR, kr_BSD = latent_BTL.split((R, Dr), dim=-1)
            kv_BHSQ = self.kv_b_proj(c_BSR).view(B, S, Hq, Dn + Dv).transpose(1, 2)
            k_BHSQ = torch.cat((kv_BHSQ[..., :Dn], kr_BSD[:, None].expand(B, Hq, S, Dr)), dim=-1)
            out_BHTV = F.scaled_dot_product_attention(q_BHTQ, k_BHSQ, kv_BHSQ[..., Dn:], attn_mask=mask,
                                                      scale=self.scale)
        return self.o_proj(out_BHTV.transpose(1, 2).reshape(B, T, Hq * Dv))
