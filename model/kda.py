"""Kimi Delta Attention (KDA): a gated delta-rule linear attention with channel-wise decay.

Per head (key dim K = value dim V = `linear_head_dim`), with q̂, k̂ L2-normalised and q scaled by 1/√K:

    S_t = (I − β_t k̂_t k̂_tᵀ) · diag(exp(g_t)) · S_{t−1} + β_t k̂_t v_tᵀ        S ∈ R^{K×V}
    o_t = S_tᵀ q̂_t

g_t = −exp(A_log)·softplus(f(x_t) + dt_bias) ∈ R^K (per channel, ≤ 0), or with `linear_lower_bound`
lb < 0 the safe gate g_t = lb·sigmoid(exp(A_log)·(f(x_t) + dt_bias)) ∈ (lb, 0); β_t = sigmoid(b(x_t)).
q, k, v come from one short causal depthwise conv + SiLU over [q; k; v] projections. The output is a
per-head RMSNorm gated by sigmoid(g_b(g_a(x))), then o_proj. Parameter names and layout equal
transformers' `KimiLinearDeltaAttention` (5.x), so its KDA weights copy over unchanged.

Two exact forms of the recurrence: `kda_recurrent` (token by token: decode) and `kda_chunked`
(chunks of C tokens with the WY representation: training and prefill). Both run in float32 (float64
for a float64 model) and return the final state, so a prefill can be continued by decode steps.

Shapes: B batch, T tokens, N heads, K key dim, V value dim, C chunk, H hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jointrl.model.attention import AttentionBatch
from jointrl.model.config import MoEConfig
from jointrl.model.norm import compute_dtype


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σ x² + eps) over the last dim (fla's and transformers' form: eps inside the sqrt)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_recurrent(q_BTNK: torch.Tensor, k_BTNK: torch.Tensor, v_BTNV: torch.Tensor, g_BTNK: torch.Tensor,
                  beta_BTN: torch.Tensor, state_BNKV: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule token by token. q, k already L2-normalised; q is scaled by K^-1/2 here.

    Returns (o [B, T, N, V], final state [B, N, K, V]), both in the compute dtype of the inputs.
    """
    B, T, N, K = k_BTNK.shape
    V = v_BTNV.shape[-1]
    q_BTNK = q_BTNK * K ** -0.5
    S_BNKV = (torch.zeros(B, N, K, V, dtype=v_BTNV.dtype, device=v_BTNV.device)
              if state_BNKV is None else state_BNKV.to(v_BTNV.dtype))
    outs = []
    for t in range(T):
        k_BNK = k_BTNK[:, t]
        S_BNKV = S_BNKV * g_BTNK[:, t].exp()[..., None]
        pred_BNV = (S_BNKV * k_BNK[..., None]).sum(-2)
        delta_BNV = (v_BTNV[:, t] - pred_BNV) * beta_BTN[:, t, :, None]
        S_BNKV = S_BNKV + k_BNK[..., None] * delta_BNV[..., None, :]
        outs.append((S_BNKV * q_BTNK[:, t, ..., None]).sum(-2))
    o_BTNV = torch.stack(outs, dim=1) if outs else v_BTNV.new_zeros(B, 0, N, V)
    return o_BTNV, S_BNKV


# Largest log-decay span Γ_first − Γ_last of a block for which `_decayed_products` factorises
# exp(Γ_i − Γ_j) around the block's middle: the factors stay within exp(±span/2) and every product
# within exp(±span), far from overflow.
_FACTORED_SPAN = {torch.float32: 80.0, torch.float64: 600.0}
_DIRECT_BLOCK = 8  # blocks this small that still span too much take the direct form


def _decayed_products(k: torch.Tensor, q: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, M) [.., C, C] with X[i, j] = Σ_d x_i[d] k_j[d] exp(Γ_i[d] − Γ_j[d]) for j ≤ i (x = k, q), 0 above.

    Γ is non-increasing along C (a cumulative sum of log-decays ≤ 0). Exact in every case, through
    three forms:
    - factored (two matmuls): exp(Γ_i − Γ_j) = exp(Γ_i − m) · exp(m − Γ_j), m the middle of the
      block's span, when no block spans more than `_FACTORED_SPAN` (so no factor can overflow);
    - halved, when some block spans more (a trained forget gate does: the step cost grew ~10x on
      the direct form over whole chunks before this existed). The lower-left quarter, rows i of the second half and
      columns j of the first, is again two matmuls around R = Γ at the end of the first half, with
      exp(Γ_i − R) ≤ 1 and exp(R − Γ_j) ≤ 1; the two diagonal quarters recurse, as one batch;
    - direct, for blocks of ≤ `_DIRECT_BLOCK` tokens that still span too much: only non-positive
      exponents, through a [.., C, C, K] tensor.
    Entries above the diagonal are dropped (`tril`, or never computed), not multiplied by 0, so a
    large value there never reaches a gradient.
    """
    C = G.shape[-2]
    span = (G[..., :1, :] - G[..., -1:, :]).max().item() if G.numel() else 0.0
    if G.dtype in _FACTORED_SPAN and span <= _FACTORED_SPAN[G.dtype]:
        mid = 0.5 * (G[..., :1, :] + G[..., -1:, :])
        k_right = (k * (mid - G).exp()).transpose(-1, -2)[..., None, :, :]  # [.., 1, K, C]
        left = torch.stack((k, q), dim=-3) * (G - mid).exp()[..., None, :, :]  # [.., 2, C, K]
        return (left @ k_right).tril().unbind(-3)
    if C > _DIRECT_BLOCK and C % 2 == 0:
        h = C // 2
        R = G[..., h - 1:h, :]
        k_right = (k[..., :h, :] * (R - G[..., :h, :]).exp()).transpose(-1, -2)[..., None, :, :]
        left = torch.stack((k[..., h:, :], q[..., h:, :]), dim=-3) * (G[..., h:, :] - R).exp()[..., None, :, :]
        lower_k, lower_q = (left @ k_right).unbind(-3)                      # [.., h, h]
        halves = [x.unflatten(-2, (2, h)) for x in (k, q, G)]               # [.., 2, h, K]
        diag_k, diag_q = _decayed_products(*halves)                          # [.., 2, h, h]
        zeros = diag_k.new_zeros(diag_k.shape[:-3] + (h, h))
        def assemble(diag: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
            top = torch.cat((diag[..., 0, :, :], zeros), dim=-1)
            return torch.cat((top, torch.cat((lower, diag[..., 1, :, :]), dim=-1)), dim=-2)
        return assemble(diag_k, lower_k), assemble(diag_q, lower_q)
    incl_CC1 = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()[..., None]
    k_decay = k[..., None, :, :] * (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~incl_CC1, float("-inf")).exp()
    return (k[..., :, None, :] * k_decay).sum(-1), (q[..., :, None, :] * k_decay).sum(-1)


def kda_chunked(q_BTNK: torch.Tensor, k_BTNK: torch.Tensor, v_BTNV: torch.Tensor, g_BTNK: torch.Tensor,
                beta_BTN: torch.Tensor, state_BNKV: torch.Tensor | None = None, chunk: int = 64
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence, C tokens at a time (exact up to rounding; T need not divide by C).

    Inside a chunk, with Γ_i = Σ_{j≤i} g_j (cumulative log-decay from the chunk start) and S the state
    entering the chunk, the delta rule unrolls to the WY form

        A[i, j] = β_i Σ_d k_i[d] k_j[d] exp(Γ_i[d] − Γ_j[d])        (j < i; 0 elsewhere)
        U = (I + A)⁻¹ (β ⊙ V),   W = (I + A)⁻¹ (β ⊙ k ⊙ exp(Γ))      (unit lower-triangular solve)
        Δ = U − W S                                                  (the chunk's corrected values)
        O = (q ⊙ exp(Γ)) S + M Δ,  M[i, j] = Σ_d q_i[d] k_j[d] exp(Γ_i[d] − Γ_j[d])   (j ≤ i)
        S' = exp(Γ_C) ⊙ S + (k ⊙ exp(Γ_C − Γ))ᵀ Δ

    Every exponent here is ≤ 0 (A and M: see `_decayed_products`). A, M, U, W depend on the chunk's own tokens only, so
    they are computed for all chunks at once (batched over chunks: few, large ops, which is what makes
    training on CPU affordable); only the state hand-over S → S' (two small matmuls per chunk) runs
    chunk by chunk, and the outputs are again one batched product over chunks. Memory is O(T·C·K) per
    head (the decayed products of every chunk). Returns (o [B, T, N, V], final state [B, N, K, V]).
    """
    B, T, N, K = k_BTNK.shape
    V = v_BTNV.shape[-1]
    C = chunk
    pad = (-T) % C
    # [B, N, n, C, ·]; padded tokens have k = v = β = g = 0, so they leave the state unchanged.
    def split(x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(1, 2)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))
        return x.reshape(B, N, -1, C, *x.shape[3:])
    q, k, v, g = (split(x) for x in (q_BTNK * K ** -0.5, k_BTNK, v_BTNV, g_BTNK))
    beta_BNnC1 = split(beta_BTN)[..., None]
    S = (torch.zeros(B, N, K, V, dtype=v.dtype, device=v.device)
         if state_BNKV is None else state_BNKV.to(v.dtype))
    if T == 0:
        return v_BTNV.new_zeros(B, 0, N, V), S
    G = g.cumsum(dim=-2)                                                   # [B, N, n, C, K]
    A, M = _decayed_products(k, q, G)
    A = A.tril(-1) * beta_BNnC1                                            # [B, N, n, C, C]
    rhs = torch.cat((beta_BNnC1 * v, beta_BNnC1 * k * G.exp()), dim=-1)
    UW = torch.linalg.solve_triangular(A + torch.eye(C, dtype=v.dtype, device=v.device), rhs,
                                       upper=False, unitriangular=True)
    U, W = UW.split((V, K), dim=-1)
    G_last = G[..., -1:, :]                                                # [B, N, n, 1, K]
    k_to_end_BNnKC = (k * (G_last - G).exp()).transpose(-1, -2)
    decay_end_BNnK1 = G_last.transpose(-1, -2).exp()
    states, deltas = [], []
    # unbind, not x[:, :, c] per chunk: each indexing's backward zero-fills a whole [B, N, n, ..]
    # gradient (quadratic in the chunk count; a third of a layer's forward + backward at 2.4 K tokens)
    for U_c, W_c, decay_c, k_to_end_c in zip(U.unbind(2), W.unbind(2), decay_end_BNnK1.unbind(2),
                                             k_to_end_BNnKC.unbind(2), strict=True):
        states.append(S)
        delta = U_c - W_c @ S
        deltas.append(delta)
        S = decay_c * S + k_to_end_c @ delta
    o = (q * G.exp()) @ torch.stack(states, dim=2) + M @ torch.stack(deltas, dim=2)   # [B, N, n, C, V]
    return o.reshape(B, N, -1, V)[:, :, :T].transpose(1, 2), S


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
        cdt = compute_dtype(x.dtype)
        x_f = x.to(cdt)
        x_f = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(cdt) * x_f * torch.sigmoid(gate.to(cdt))).to(x.dtype)


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

    def forward(self, x_BTH: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """The layer inside the model: state read from and written back to `batch.cache`."""
        conv, state = (None, None) if batch.cache is None else batch.cache.recurrent(self.layer_idx)
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
            o_BTNV, recurrent_state = kda_recurrent(l2norm(q), l2norm(k), v, g_BTNK, beta_BTN, recurrent_state)
        else:
            o_BTNV, recurrent_state = kda_chunked(l2norm(q), l2norm(k), v, g_BTNK, beta_BTN, recurrent_state,
                                                  chunk=self.chunk)
        gate_BTNK = self.g_b_proj(self.g_a_proj(x_BTH)).view(B, T, N, K)
        y_BTNK = self.o_norm(o_BTNV.to(x_BTH.dtype), gate_BTNK)
        return self.o_proj(y_BTNK.reshape(B, T, N * K)), conv_state, recurrent_state
