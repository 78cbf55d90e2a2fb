"""Kimi Delta Attention (KDA): a gated delta-rule linear attention with channel-wise decay.

Per head (key dim K = value dim V = `linear_head_dim`), with q̂, k̂ L2-normalised and q scaled by 1/√K:

    S_t = (I − β_t k̂_t k̂_tᵀ) · diag(exp(g_t)) · S_{t−1} + β_t k̂_t v_tᵀ        S ∈ R^{K×V}
    o_t = S_tᵀ q̂_t

g_t = −exp(A_log)·softplus(f(x_t) + dt_bias) ∈ R^K (per channel, ≤ 0), or with `linear_lower_bound`
lb < 0 the safe gate g_t = lb·sigmoid(exp(A_log)·(f(x_t) + dt_bias)) ∈ (lb, 0); β_t = sigmoid(b(x_t)).
q, k, v come from one short causal depthwise conv + SiLU over [q; k; v] projections. The output is a
per-head RMSNorm gated by sigmoid(g_b(g_a(x))), then o_proj. Parameter names and layout equal
transformers' `KimiLinearDeltaAttention` (5.x), so its KDA weights copy over unchanged.

The recurrence itself is a kernel op (`kernels/kda.py`): `kda_recurrent` (token by token: decode) and
`kda_chunk` (chunks with the WY representation: training and prefill), each with its one torch
reference and its Triton kernel; the layer calls them through the op table its model hands it
(`self.kernels`, `kernels/ops.Kernels`). Both run in float32 (float64 for a float64 model) and return
the final state, so a prefill can be continued by decode steps.

Shapes: B batch, T tokens, N heads, K key dim, V value dim, C chunk, H hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jointrl.kernels.norm_rope_cpu import rms_norm_torch
from jointrl.kernels.ops import Kernels, kernels_for
from jointrl.model.attention import AttentionBatch
from jointrl.model.config import MoEConfig
from jointrl.model.norm import compute_dtype
from jointrl.model.state import StateSpec


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σ x² + eps) over the last dim (fla's and transformers' form: eps inside the sqrt)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x_BCT: torch.Tensor, weight_CW: torch.Tensor, state_BCw: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time, continuing from the previous W−1 inputs (`state`, zeros when
    None), then SiLU. Returns (y [B, C, T], new state [B, C, W−1] = the last W−1 inputs)."""
    B, Ch, T = x_BCT.shape
    W = weight_CW.shape[-1]
    if state_BCw is None:
        state_BCw = x_BCT.new_zeros(B, Ch, W - 1)
    full = torch.cat((state_BCw.to(x_BCT.dtype), x_BCT), dim=-1)
    if T == 0:  # an empty step: nothing to convolve, the window is unchanged
        return x_BCT, full
    # y[b, c, t] = Σ_w weight[c, w] · full[b, c, t + w]: a depthwise conv written as W shifted
    # multiply-adds, because F.conv1d with groups = channels falls to a per-channel slow path in
    # float64 on CPU (and an unfold + einsum is a per-channel batched matmul, ~2.5x slower).
    w_CW = weight_CW.to(full.dtype)
    y = full[:, :, :T] * w_CW[:, 0, None]
    for i in range(1, W):
        y = y + full[:, :, i:i + T] * w_CW[:, i, None]
    return F.silu(y), full[:, :, full.shape[-1] - (W - 1):]


class ForgetGate(nn.Module):
    """g = −exp(A_log)·softplus(f_b(f_a(x)) + dt_bias), or lb·sigmoid(exp(A_log)·(…)) with a lower bound."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        N, K = config.linear_num_heads, config.linear_head_dim
        self.num_heads, self.head_dim = N, K
        self.lower_bound = config.linear_lower_bound
        self.f_a_proj = nn.Linear(config.hidden_size, K, bias=False)
        self.f_b_proj = nn.Linear(K, N * K, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(N * K))
        self.A_log = nn.Parameter(torch.zeros(1, 1, N, 1))  # transformers' kimi_linear layout

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        """→ g [B, T, N, K] in the compute dtype, every entry < 0."""
        cdt = compute_dtype(x_BTH.dtype)
        B, T, _ = x_BTH.shape
        f_BTNK = (self.f_b_proj(self.f_a_proj(x_BTH)).to(cdt) + self.dt_bias.to(cdt)).view(B, T, self.num_heads, self.head_dim)
        rate = self.A_log.to(cdt).exp()
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * f_BTNK)
        return -rate * F.softplus(f_BTNK)


class GatedRMSNorm(nn.Module):
    """y = weight · x / rms(x) · sigmoid(gate), over the last dim, in float32 (float64 for fp64)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        cdt = compute_dtype(x.dtype)  # the one RMSNorm reference, in the compute dtype, then the gate
        return (rms_norm_torch(x.to(cdt), self.weight.to(cdt), self.eps) * torch.sigmoid(gate.to(cdt))).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """The KDA token mixer of one layer (see the module docstring); state in and out for the engine.

    Its per-sequence state is fixed-size: the conv window [B, 3·N·K, W−1] (model dtype) and the delta
    state [B, N, K, V] (compute dtype), whatever the context length.
    """

    def __init__(self, config: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        N, K, H = config.linear_num_heads, config.linear_head_dim, config.hidden_size
        self.num_heads, self.head_dim, self.chunk = N, K, config.kda_chunk_size
        self.q_proj = nn.Linear(H, N * K, bias=False)
        self.k_proj = nn.Linear(H, N * K, bias=False)
        self.v_proj = nn.Linear(H, N * K, bias=False)
        W = config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(3 * N * K, 3 * N * K, W, groups=3 * N * K, padding=W - 1, bias=False)
        self.forget_gate = ForgetGate(config)
        self.b_proj = nn.Linear(H, N, bias=False)
        self.g_a_proj = nn.Linear(H, K, bias=False)
        self.g_b_proj = nn.Linear(K, N * K, bias=False)
        self.o_norm = GatedRMSNorm(K, config.rms_norm_eps)
        self.o_proj = nn.Linear(N * K, H, bias=False)
        self.kernels: Kernels = kernels_for("torch")  # MoETransformer.set_kernels hands down the model's
        self.state_spec = StateSpec(fixed=True)  # (conv window, delta state): recurrent / set_recurrent

    def forward(self, x_BTH: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """The layer inside the model: state read from and written back to `batch.cache`."""
        stored = None if batch.cache is None else batch.cache.recurrent(self.layer_idx)
        conv, state = (None, None) if stored is None else stored
        y_BTH, conv, state = self.step(x_BTH, batch.token_mask_BT, conv, state)
        if batch.cache is not None:
            batch.cache.set_recurrent(self.layer_idx, conv, state)
        return y_BTH

    def step(self, x_BTH: torch.Tensor, token_mask_BT: torch.Tensor | None = None,
             conv_state: torch.Tensor | None = None, recurrent_state: torch.Tensor | None = None,
             recurrent: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """→ (y [B, T, H], new conv state, new recurrent state), states explicit (None = zeros).

        token_mask_BT: False at padding; padding inputs are zeroed (k = v = 0), so a left-padded row
            reaches its first real token with a zero state, exactly as unpadded.
        recurrent: force the token-by-token form (True) or the chunked form (False); None picks the
            recurrent form for T == 1 (decode) and the chunked one otherwise.
        """
        B, T, _ = x_BTH.shape
        N, K = self.num_heads, self.head_dim
        if token_mask_BT is not None:
            x_BTH = x_BTH * token_mask_BT[..., None].to(x_BTH.dtype)
        qkv_BCT = torch.cat((self.q_proj(x_BTH), self.k_proj(x_BTH), self.v_proj(x_BTH)), dim=-1).transpose(1, 2)
        qkv_BCT, conv_state = causal_conv(qkv_BCT, self.conv1d.weight[:, 0], conv_state)
        cdt = compute_dtype(x_BTH.dtype)
        q, k, v = qkv_BCT.transpose(1, 2).to(cdt).view(B, T, 3, N, K).unbind(2)
        g_BTNK = self.forget_gate(x_BTH)
        beta_BTN = torch.sigmoid(self.b_proj(x_BTH).to(cdt))
        use_recurrent = T == 1 if recurrent is None else recurrent
        if use_recurrent:
            o_BTNV, recurrent_state = self.kernels.kda_recurrent(l2norm(q), l2norm(k), v, g_BTNK, beta_BTN,
                                                                 recurrent_state)
        else:
            o_BTNV, recurrent_state = self.kernels.kda_chunk(l2norm(q), l2norm(k), v, g_BTNK, beta_BTN,
                                                             recurrent_state, self.chunk)
        gate_BTNK = self.g_b_proj(self.g_a_proj(x_BTH)).view(B, T, N, K)
        y_BTNK = self.o_norm(o_BTNV.to(x_BTH.dtype), gate_BTNK)
        return self.o_proj(y_BTNK.reshape(B, T, N * K)), conv_state, recurrent_state
