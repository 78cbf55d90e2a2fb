"""gpt-oss's layers (OpenAI gpt-oss-20b / 120b), as transformers' `GptOssForCausalLM` computes them.

Attention (`SinkAttention`, layer kinds "full" and "sliding" when `attention_sinks`): GQA with biased
q/k/v/o projections, no q/k-norm, RoPE (YaRN-scaled, model/rope.py), and per head h a learned logit
`sinks[h]` that joins every query's softmax denominator and attends to nothing:

    p_ts = exp(s_ts) / (Σ_s' exp(s_ts') + exp(sinks_h)),   s_ts = q_t·k_s / √D   (masked keys: -inf)
    out_t = Σ_s p_ts v_s

A "sliding" layer's query at cache slot i sees keys at slots j with i - attention_window < j <= i
(transformers' `sliding_window_overlay`; the layers alternate sliding / full in gpt-oss).

Experts (`ClampedSwiGLUExperts`, when `swiglu_limit` is set): with biases, and the clamped SwiGLU

    g = min(gate x + b_g, limit),  u = clip(up x + b_u, -limit, limit)
    y = down((u + 1) · g · σ(α g)) + b_d

The router (model/routing.py with `router_bias`): logits x Wᵀ + b; transformers takes softmax over the
top-k logits, which equals our softmax over all experts renormalised over the top-k (`norm_topk_prob`).

Our parameter layout keeps the rest of the project's: `experts.gate_up_proj` [E, 2I, H] gate rows first,
then up rows (transformers' gpt-oss interleaves them: gate = [..., ::2], up = [..., 1::2], and stores
[E, H, 2I]); `experts.gate_up_proj_bias` [E, 2I] alike; `down_proj` [E, H, I]; `mlp.gate.weight` /
`mlp.gate.bias` for transformers' `mlp.router.*`. model/hf.py maps checkpoints (incl. MXFP4 blocks and
scales) to it, `save_gpt_oss` back.

Shapes: B batch, T new tokens, S keys, Hq/Hkv heads, D head_dim, N tokens, E experts, k per token,
I expert width, H hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jointrl.model import paged
from jointrl.model.attention import Attention, AttentionBatch
from jointrl.model.config import MoEConfig
from jointrl.model.norm import compute_dtype
from jointrl.model.state import StateSpec


def window_mask(past: int, T: int, S: int, window: int, device: torch.device) -> torch.Tensor:
    """bool [1, 1, T, S]: True where new token t (slot past + t) is within `window` slots of key s
    (s > past + t - window); AND it with the causal mask."""
    q_T1 = torch.arange(past, past + T, device=device)[:, None]
    return (torch.arange(S, device=device)[None, :] > q_T1 - window)[None, None]


def sink_attention(q_BHTD: torch.Tensor, k_BhSD: torch.Tensor, v_BhSD: torch.Tensor, mask_B1TS: torch.Tensor,
                   sinks_H: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax over [q·k·scale (masked -inf), sink_h] with the sink column dropped, times v (module
    docstring); GQA: kv head j serves query heads j·g .. j·g+g-1. Softmax in float32 (float64 for a
    float64 model), as transformers' eager gpt-oss attention. → out [B, Hq, T, D] in q's dtype."""
    B, Hq, T, D = q_BHTD.shape
    g = Hq // k_BhSD.shape[1]
    cd = compute_dtype(q_BHTD.dtype)
    k_BHSD = k_BhSD.repeat_interleave(g, dim=1)
    v_BHSD = v_BhSD.repeat_interleave(g, dim=1)
    s_BHTS = torch.matmul(q_BHTD, k_BHSD.transpose(2, 3)).to(cd) * scale
    s_BHTS = s_BHTS.masked_fill(~mask_B1TS, float("-inf"))
    sink_BHT1 = sinks_H.to(cd).view(1, Hq, 1, 1).expand(B, Hq, T, 1)
    logits = torch.cat((s_BHTS, sink_BHT1), dim=-1)
    p_BHTS = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(p_BHTS.to(v_BHSD.dtype), v_BHSD)


class SinkAttention(Attention):
    """gpt-oss attention: biased projections, sinks, and a sliding window on "sliding" layers."""

    def __init__(self, config: MoEConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx, output_gate=False)
        H, D, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None
        self.window = config.attention_window if config.kinds[layer_idx] == "sliding" else None
        # the engine runs it on its ragged batch (``paged``): sinks and window go to the kernel table's paged ops
        self.state_spec = StateSpec(keys_values=True, ragged=True)

    def paged(self, h_NH: torch.Tensor, step: paged.PagedStep) -> torch.Tensor:
        """``forward`` over the engine's flat, ragged batch [N, H], keys/values in its pools: the biased
        projections, RoPE, the paged decode / prefill ops with this layer's sinks and window
        (``model/paged.attention_forward``; ``kernels/paged_attention_cpu``'s references define them)."""
        return paged.attention_forward(self, h_NH, step, self.sinks, self.window)

    def forward(self, x_BTH: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        q_BHTD, k_BHSD, v_BHSD = self.qkv(x_BTH, batch)
        T, S = q_BHTD.shape[2], k_BHSD.shape[2]
        mask = batch.mask()
        if self.window is not None:
            mask = mask & window_mask(S - T, T, S, self.window, q_BHTD.device)
        if self.sinks is None:
            out_BHTD = F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, attn_mask=mask, scale=self.head_dim ** -0.5,
                                                      enable_gqa=self.num_heads != self.num_kv_heads)
        else:
            out_BHTD = sink_attention(q_BHTD, k_BHSD, v_BHSD, mask, self.sinks, self.head_dim ** -0.5)
        return self.output(x_BTH, out_BHTD)


def clamped_swiglu(h_AO: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[A, 2I] (gate columns first) → [A, I]: (clip(u, ±limit) + 1) · g · σ(α g), g = min(gate, limit)."""
    I = h_AO.shape[-1] // 2
    gate, up = h_AO[:, :I].clamp(max=limit), h_AO[:, I:].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ClampedSwiGLUExperts(nn.Module):
    """E experts y_e(x) = down_e(clamped_swiglu(gate_up_e x + b_e)) + c_e (module docstring), fused
    3-D tensors. Plain autograd: assignments sorted by expert, one matmul pair per active expert."""

    plain_swiglu = False  # not what the engine's C++ MoE ops compute: the engine runs this forward

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))
        self.down_proj_bias = nn.Parameter(torch.zeros(E, H))
        self.alpha, self.limit = float(config.swiglu_alpha), float(config.swiglu_limit)

    def forward(self, x_NH: torch.Tensor, ids_Nk: torch.Tensor, weights_Nk: torch.Tensor) -> torch.Tensor:
        """out_n = Σ_j weights[n, j] · y_{ids[n, j]}(x_n) → [N, H] in x's dtype."""
        N, k = ids_Nk.shape
        E = self.gate_up_proj.shape[0]
        ids_A = ids_Nk.reshape(-1)
        order_A = torch.argsort(ids_A, stable=True)
        token_A = order_A // k
        x_AH = x_NH.index_select(0, token_A)
        ys, start = [], 0
        for e, count in enumerate(torch.bincount(ids_A, minlength=E).tolist()):
            if count:
                h = F.linear(x_AH[start:start + count], self.gate_up_proj[e], self.gate_up_proj_bias[e])
                ys.append(F.linear(clamped_swiglu(h, self.alpha, self.limit), self.down_proj[e], self.down_proj_bias[e]))
                start += count
        y_AH = torch.cat(ys) if ys else x_AH.new_zeros(0, x_NH.shape[1])
        y_AH = y_AH * weights_Nk.reshape(-1)[order_A, None].to(y_AH.dtype)
        return torch.zeros_like(x_NH).index_add_(0, token_A, y_AH.to(x_NH.dtype))
