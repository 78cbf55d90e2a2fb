"""The MoE router: softmax or sigmoid + selection-bias scores, (group-limited) top-k, balance terms.

Two scoring rules, chosen once by `MoEConfig.scoring_func`:

  softmax (Qwen3-MoE, Mixtral, OLMoE):  p = softmax(x Wᵀ); ids = top-k(p); w = p[ids]
  sigmoid (DeepSeek-V3, Kimi-K2):       s = sigmoid(x Wᵀ); ids = top-k(s + b) inside the best
                                        `topk_group` of `n_group` groups (a group scores by the sum
                                        of its two best s + b); w = s[ids]

then w /= Σ w (+1e-20) when `norm_topk_prob`, and w *= `routed_scaling_factor`. The selection bias b
(`e_score_correction_bias`, a buffer, sigmoid only) changes which experts are chosen, never their
weights; it has no gradient and moves only through `update_router_bias` (DeepSeek-V3's
auxiliary-loss-free balancing). Parameter layout equals transformers': `gate.weight` [E, H], and
`gate.e_score_correction_bias` [E] as in `DeepseekV3TopkRouter`.

Shapes: N tokens, H hidden, E experts, k experts per token, G groups, L MoE layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from jointrl.model.config import MoEConfig
from jointrl.model.norm import compute_dtype, outside_autocast


class TopKRouter(nn.Module):
    """Scores, chosen experts and their weights for each token (see the module docstring)."""

    e_score_correction_bias: torch.Tensor | None

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.sigmoid = config.scoring_func == "sigmoid"
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        # gpt-oss: logits x Wᵀ + b (softmax scoring only; the sigmoid router's bias is the selection bias below)
        self.bias = nn.Parameter(torch.zeros(config.num_experts)) if config.router_bias else None
        bias = torch.zeros(config.num_experts) if self.sigmoid else None
        self.register_buffer("e_score_correction_bias", bias, persistent=True)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> TopKRouter:
        # The bias moves by steps of ~1e-3 (update_router_bias); in bfloat16 those steps round away,
        # so it stays at least float32 whatever the model's dtype (transformers keeps it fp32 too).
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        if bias is not None:
            moved = self.e_score_correction_bias
            keep = compute_dtype(moved.dtype) if moved.is_floating_point() else moved.dtype
            self.e_score_correction_bias = bias.to(device=moved.device, dtype=keep)
        return self

    def forward(self, x_NH: torch.Tensor, replay_ids_Nk: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """→ (logits_NE, probs_NE in compute dtype, ids_Nk int64, weights_Nk in x's dtype).

        logits_NE: x Wᵀ (model dtype for softmax, as HF's Qwen3; compute dtype for sigmoid, as HF's
            DeepSeek-V3, whose gate runs in float32).
        probs_NE: the distribution the balance loss uses: softmax p, or s / Σ_e s_e for sigmoid
            (DeepSeek-V3's normalised affinities, its eq. 19).
        With `replay_ids_Nk` those experts are used instead of the top-k; their weights are still
        the router's scores at those ids, so the router keeps its gradient (routing replay, R3).
        """
        cd = compute_dtype(x_NH.dtype)
        with outside_autocast(x_NH):  # routing decisions in x's precision, as the rollout engine's
            if self.sigmoid:
                logits_NE = F.linear(x_NH.to(cd), self.weight.to(cd))
                scores_NE = torch.sigmoid(logits_NE)
                probs_NE = scores_NE / scores_NE.sum(dim=-1, keepdim=True)
            else:
                logits_NE = F.linear(x_NH, self.weight, self.bias)
                scores_NE = probs_NE = torch.softmax(logits_NE, dim=-1, dtype=cd)
        if replay_ids_Nk is None:
            ids_Nk = self._select(scores_NE.detach())
        else:
            ids_Nk = replay_ids_Nk
        top_Nk = scores_NE.gather(1, ids_Nk)
        if self.norm_topk_prob:
            top_Nk = top_Nk / (top_Nk.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            top_Nk = top_Nk * self.routed_scaling_factor
        return logits_NE, probs_NE, ids_Nk, top_Nk.to(x_NH.dtype)

    def _select(self, scores_NE: torch.Tensor) -> torch.Tensor:
        """Top-k expert ids [N, k] by score (+ bias), restricted to the best groups."""
        if not self.sigmoid:
            return torch.topk(scores_NE, self.top_k, dim=-1).indices
        choice_NE = scores_NE + self.e_score_correction_bias.to(scores_NE.dtype)
        if self.n_group > 1:
            N, E = choice_NE.shape
            choice_NGe = choice_NE.view(N, self.n_group, E // self.n_group)
            group_NG = choice_NGe.topk(2, dim=-1).values.sum(dim=-1)
            best_NG = torch.zeros_like(group_NG, dtype=torch.bool).scatter_(
                1, torch.topk(group_NG, self.topk_group, dim=-1).indices, True)
            choice_NE = choice_NGe.masked_fill(~best_NG[..., None], float("-inf")).view(N, E)
        return torch.topk(choice_NE, self.top_k, dim=-1).indices


def expert_load(ids_Nk: torch.Tensor, num_experts: int, token_mask_N: torch.Tensor | None = None
                ) -> torch.Tensor:
    """load_E = number of (real token, slot) assignments routed to each expert, as float32."""
    weight_Nk = torch.ones(ids_Nk.shape, dtype=torch.float32, device=ids_Nk.device)
    if token_mask_N is not None:
        weight_Nk = weight_Nk * token_mask_N.to(device=ids_Nk.device, dtype=torch.float32)[:, None]
    return torch.zeros(num_experts, dtype=torch.float32, device=ids_Nk.device).index_add_(
        0, ids_Nk.reshape(-1), weight_Nk.reshape(-1))


def load_balancing_loss(probs_per_layer: list[torch.Tensor], ids_per_layer: list[torch.Tensor],
                        num_experts: int, token_mask_N: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer balance loss, pooled over layers exactly as HF's `load_balancing_loss_func`:

        f_e = (# assignments to e over all layers and real tokens) / (L · N_real)
        P_e = (Σ over layers and real tokens of probs_e) / (L · N_real)
        loss = E · Σ_e f_e · P_e          (= k when routing is perfectly uniform)

    For the softmax router probs = p (HF's loss exactly). For the sigmoid router probs = s / Σ s,
    DeepSeek-V3's normalised affinities (its complementary balance loss, eqs. 17-20, pooled over the
    batch instead of per sequence); f counts the experts chosen with the selection bias. `ids_per_layer`
    are the experts actually used (the replayed ids under routing replay). Padding (mask 0) is left out.
    """
    probs_LNE = torch.stack(probs_per_layer)
    ids_LNk = torch.stack(ids_per_layer)
    L, N, k = ids_LNk.shape
    if token_mask_N is None:
        token_mask_N = torch.ones(N, dtype=probs_LNE.dtype, device=probs_LNE.device)
    mask_LN = token_mask_N.to(probs_LNE.dtype).expand(L, N)
    counts_E = torch.zeros(num_experts, dtype=probs_LNE.dtype, device=probs_LNE.device).scatter_add_(
        0, ids_LNk.reshape(-1), mask_LN[..., None].expand(L, N, k).reshape(-1))
    prob_sum_E = (probs_LNE * mask_LN[..., None]).sum(dim=(0, 1))
    rows = mask_LN.sum().clamp_min(1)
    return num_experts * torch.sum((counts_E / rows) * (prob_sum_E / rows))


@torch.no_grad()
def update_router_bias(model: nn.Module, load_LE: torch.Tensor, rate: float) -> dict[str, float]:
    """DeepSeek-V3's auxiliary-loss-free balancing, applied after an optimizer step:

        b_e ← b_e + rate · sign(mean_e'(load_e') − load_e)        per MoE layer

    so overloaded experts become less likely to be chosen and idle ones more (the weights w never
    see b). `load_LE` [L, E] is `ModelOutput.expert_load` summed over the step's micro-batches, and
    across data-parallel ranks before the call, so every rank applies the same update. Routers are
    taken in `model.modules()` order, which is layer order. DeepSeek-V3 uses rate 1e-3.

    Returns {"router/max_violation": max over layers of (max_e load − mean) / mean} of `load_LE`,
    the paper's MaxVio (0 = perfectly balanced).
    """
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    if load_LE.dim() != 2 or load_LE.shape[0] != len(routers):
        raise ValueError(f"load_LE must be [num_moe_layers={len(routers)}, E], got {tuple(load_LE.shape)}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate!r}")
    for router, load_E in zip(routers, load_LE, strict=True):
        bias_E = router.e_score_correction_bias
        if bias_E is None:
            raise ValueError("update_router_bias needs scoring_func='sigmoid' (a softmax router has no bias)")
        load_E = load_E.to(device=bias_E.device, dtype=torch.float64)
        bias_E += (rate * torch.sign(load_E.mean() - load_E)).to(bias_E.dtype)
    mean_L1 = load_LE.double().mean(dim=-1, keepdim=True).clamp_min(1e-12)
    return {"router/max_violation": ((load_LE.double().amax(dim=-1, keepdim=True) - mean_L1) / mean_L1).max().item()}
