"""Full (global) GQA attention with q/k-norm and RoPE, as transformers' Qwen3MoeAttention, with an
optional sigmoid output gate; and `AttentionBatch`, what every token mixer of one forward reads.

Tensor names carry their shape: B batch, T new tokens, S keys (cached + new), H hidden,
Hq/Hkv query/key-value heads, D head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from jointrl.kernels import norm_rope_cpu
from jointrl.model import paged
from jointrl.model.config import MoEConfig
from jointrl.model.norm import RMSNorm, qk_norm
from jointrl.model.rope import apply_rope
from jointrl.model.state import AttentionState, StateSpec


@dataclass(slots=True)
class AttentionBatch:
    """Built once per model forward and passed to every layer's token mixer."""

    rope: tuple[torch.Tensor, torch.Tensor]               # cos, sin [B, T, head_dim]
    index_rope: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin [B, T, index_head_dim] (gated_dsa)
    # bool SDPA mask [B|1, 1, T, S], True = attend. None: built from `past` and `key_mask_BS` on first
    # use by a `full` layer; `gated_dsa` builds only its query chunk's rows, so prefill memory stays
    # linear in S. An explicit mask (e.g. the learner's block-diagonal packing mask) is used as given.
    mask_B1TS: torch.Tensor | None
    token_mask_BT: torch.Tensor | None                    # bool, False at padding among the new tokens
    cache: AttentionState | None
    # gated_dsa layers append (Σ over real queries of KL(attention ‖ indexer), number of real queries)
    # when the caller asked for the indexer loss; None: not asked, the indexer runs without grad.
    indexer_losses: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    past: int = 0                                         # cached tokens before the new ones
    key_mask_BS: torch.Tensor | None = None               # bool [B, past + T], False at padding keys
    # gated_dsa's indexer loss: each new query's weight [B, T] (None: token_mask_BT). A prompt forwarded
    # once for several rows (learner/prefix_cache.py) weights its queries by the rows that continue it.
    query_weight_BT: torch.Tensor | None = None
    # new tokens of several parts in one flat stream x [N, H] whose attention is not one masked SDPA (the
    # learner's shared prompts, rl/learner/forward.py); full-attention layers only. None: x is [B, T, H].
    layout: FlatLayout | None = None

    def mask(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The mask of all new tokens, or of new tokens a..b-1 only ([B|1, 1, b-a, S])."""
        if self.mask_B1TS is not None:
            return self.mask_B1TS if rows is None else self.mask_B1TS[:, :, rows[0]:rows[1]]
        T, device = self.rope[0].shape[1], self.rope[0].device
        if rows is not None:
            return build_attention_mask(self.past, T, self.key_mask_BS, device, rows)
        self.mask_B1TS = build_attention_mask(self.past, T, self.key_mask_BS, device)
        return self.mask_B1TS


class FlatLayout(Protocol):
    """How a flat stream's parts attend (``AttentionBatch.layout``): a full-attention layer computes q, k, v of
    every token in one pass (the per-token projections, q/k-norm and RoPE), hands them here, and goes on
    with the rows ``rows`` keeps (a layout may drop rows no later layer reads)."""

    def attend(self, layer: int, q_NhD: torch.Tensor, k_NhD: torch.Tensor, v_NhD: torch.Tensor, scale: float,
               enable_gqa: bool) -> torch.Tensor:
        """q [N, Hq, D], k, v [N, Hkv, D] → the kept rows' attention outputs [M, Hq·D], in ``rows``' order."""

    def rows(self, layer: int, x_NF: torch.Tensor) -> torch.Tensor:
        """The rows of ``x_NF`` [N, ·] that go on after layer ``layer``'s attention ([M, ·]; x itself: all)."""


def build_attention_mask(past: int, T: int, key_mask_BS: torch.Tensor | None,
                         device: torch.device, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Boolean SDPA mask, True = attend: [B, 1, T, S] (or [1, 1, T, S] without `key_mask_BS`).

    New token t sits at cache slot past+t and sees slots s <= past+t that are real tokens. Its own
    slot is always visible, so a padding query (left padding masks every earlier key) attends to
    itself instead of producing NaN; real queries are unaffected, their own slot being causal anyway.
    `rows=(a, b)`: only new tokens a..b-1, [B, 1, b-a, S] (query-chunked layers stay linear in S).
    """
    S = past + T
    a, b = (0, T) if rows is None else rows
    q_slot_T1 = torch.arange(past + a, past + b, device=device)[:, None]
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
    """softmax(q kᵀ / √D + mask) v over grouped heads; q, k RMS-normed per head before RoPE.

    With `output_gate` (config `attn_output_gate`; always on in gated DSA) the per-head output is
    multiplied by sigmoid(gate_proj(x)) before o_proj, as in Qwen3-Next's gated attention.
    """

    def __init__(self, config: MoEConfig, layer_idx: int, output_gate: bool | None = None) -> None:
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
        gated = config.attn_output_gate if output_gate is None else output_gate
        self.gate_proj = nn.Linear(H, self.num_heads * D, bias=False) if gated else None
        # what a cache keeps for this layer (model/state.py); it runs on the engine's ragged batch (``paged``)
        self.state_spec = StateSpec(keys_values=True, ragged=True)

    def qkv(self, x_BTH: torch.Tensor, batch: AttentionBatch
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """→ q [B, Hq, T, D], and k, v [B, Hkv, S, D] including the cached ones (cache appended)."""
        B, T, _ = x_BTH.shape
        q_BHTD = self.q_norm(self.q_proj(x_BTH).view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        k_BHTD = self.k_norm(self.k_proj(x_BTH).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v_BHTD = self.v_proj(x_BTH).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = batch.rope
        q_BHTD, k_BHTD = apply_rope(q_BHTD, cos, sin), apply_rope(k_BHTD, cos, sin)
        if batch.cache is not None:
            k_BHTD, v_BHTD = batch.cache.update(self.layer_idx, k_BHTD, v_BHTD)
        return q_BHTD, k_BHTD, v_BHTD

    def output(self, x_BTH: torch.Tensor, out_BHTD: torch.Tensor) -> torch.Tensor:
        """Heads → hidden: o_proj(out ⊙ sigmoid(gate_proj(x))) (no gate without gate_proj)."""
        B, T, _ = x_BTH.shape
        out_BTF = out_BHTD.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        if self.gate_proj is not None:
            out_BTF = out_BTF * torch.sigmoid(self.gate_proj(x_BTH))
        return self.o_proj(out_BTF)

    def qkv_flat(self, x_NH: torch.Tensor, batch: AttentionBatch
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv`` of one flat stream (no cache) → q [N, Hq, D], k, v [N, Hkv, D]. On the ``cpu`` kernel
        backend with per-head ``RMSNorm`` q/k-norms, each of q's and k's norm + RoPE is one C++ pass, forward
        and backward (``kernels/norm_rope_cpu``; contiguous results). Under autocast the projections run in
        its dtype and come back widened to x's, so the norms, RoPE and attention stay in x's precision."""
        qn, kn = self.q_norm, self.k_norm
        if type(qn) is RMSNorm and type(kn) is RMSNorm and qn.kernels.cpp and norm_rope_cpu.usable(x_NH):
            N, D = x_NH.shape[0], self.head_dim
            cos_ND, sin_ND = batch.rope[0][0], batch.rope[1][0]
            q_NhD = norm_rope_cpu.qk_norm_rope(self.q_proj(x_NH).to(x_NH.dtype).view(N, self.num_heads, D),
                                               qn.weight, qn.eps, cos_ND, sin_ND)
            k_NhD = norm_rope_cpu.qk_norm_rope(self.k_proj(x_NH).to(x_NH.dtype).view(N, self.num_kv_heads, D),
                                               kn.weight, kn.eps, cos_ND, sin_ND)
            return q_NhD, k_NhD, self.v_proj(x_NH).to(x_NH.dtype).view(N, self.num_kv_heads, D)
        return tuple(t[0].transpose(0, 1) for t in self.qkv(x_NH[None], batch))

    def fused_decode(self) -> bool:
        """Whether the engine's one-call decode layer (``kernels/decode_cpu``'s ``decode_layer`` from a
        ``model.paged.LayerPlan``) covers this layer's attention: plain ``Attention`` (no subclass), per-head
        ``RMSNorm`` q/k-norms of one eps or none, no output gate, bias-free projections."""
        qn, kn = self.q_norm, self.k_norm
        qk_ok = ((type(qn) is RMSNorm and type(kn) is RMSNorm and qn.eps == kn.eps and qn.weight.dim() == 1)
                 or paged.no_qk_norm(self))
        return (type(self) is Attention and qk_ok and self.gate_proj is None
                and all(p.bias is None for p in (self.q_proj, self.k_proj, self.v_proj, self.o_proj)))

    def paged(self, h_NH: torch.Tensor, step: paged.PagedStep) -> torch.Tensor:
        """``forward`` over the engine's flat, ragged batch [N, H], keys/values in its pools (``model/paged.py``)."""
        return paged.attention_forward(self, h_NH, step)

    def forward(self, x_BTH: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        if batch.layout is not None:  # a flat stream x [N, H]: q, k, v in one pass, the layout's attention
            layout = batch.layout
            out_MF = layout.attend(self.layer_idx, *self.qkv_flat(x_BTH, batch), scale=self.head_dim ** -0.5,
                                   enable_gqa=self.num_heads != self.num_kv_heads)
            if self.gate_proj is not None:
                out_MF = out_MF * torch.sigmoid(self.gate_proj(layout.rows(self.layer_idx, x_BTH)))
            return self.o_proj(out_MF)
        q_BHTD, k_BHSD, v_BHSD = self.qkv(x_BTH, batch)
        out_BHTD = F.scaled_dot_product_attention(
            q_BHTD, k_BHSD, v_BHSD, attn_mask=batch.mask(), scale=self.head_dim ** -0.5,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return self.output(x_BTH, out_BHTD)
