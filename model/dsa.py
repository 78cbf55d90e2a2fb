"""Gated DSA: attention over the top-k past tokens chosen by a lightning indexer, output ⊙ sigmoid gate.

The lightning indexer (DeepSeek-V3.2) scores every visible key s for query t with n small heads and
one shared indexer key per token:

    I[t, s] = Σ_j w[t, j] · ReLU(q_j[t] · k[s] / √Di),   w = weights_proj(x) / √n,   k = LayerNorm(wk(x))

q_j and k carry RoPE over all Di dims (half-split, as the reference's indexer). The attention (GQA,
q/k-norm, RoPE, as `full`) then sees only the `index_topk` keys with the largest I[t, ·] among the
visible ones; with `dsa_mode="dense"` it sees every visible key (the indexer's warm-up stage).

Memory: queries are processed `dsa_query_chunk` at a time, so prefill holds O(chunk · S) scores,
never an S×S matrix; keys and values stay [B, Hkv, S, D].

Kernels: per chunk the scores, the top-k selection and the sparse attention are kernel ops called through
the op table the model hands down (`self.kernels.dsa_scores / dsa_select / dsa_attend`, `kernels/ops`):
one torch reference each (`kernels/dsa.py`, `kernels/topk.py`), the Triton kernels on the `triton` table.

Indexer loss (for the learner; `indexer_loss()` below): the indexer's input is detached, so it learns
only from
    L_I = Σ_t KL(p_t ‖ softmax(I[t, ·]))  over the attended set,
p_t = the main attention's probabilities, averaged over heads and detached (dense mode: over all
visible keys; sparse mode: over the selected keys, both distributions renormalised to that set).
The language-model loss never reaches the indexer (top-k is not differentiable), and L_I never
reaches the rest of the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jointrl.kernels.ops import Kernels, kernels_for
from jointrl.model.attention import Attention, AttentionBatch
from jointrl.model.config import MoEConfig
from jointrl.model.norm import compute_dtype
from jointrl.model.rope import apply_rope
from jointrl.model.state import StateSpec


class LightningIndexer(nn.Module):
    """Parameters as transformers' `DeepseekV32Indexer` (`wq` there is `wq_b`, fed by MLA's q latent;
    our layers have no MLA, so `wq` reads the hidden state)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        n, Di, H = config.index_n_heads, config.index_head_dim, config.hidden_size
        self.n_heads, self.head_dim = n, Di
        self.wq = nn.Linear(H, n * Di, bias=False)
        self.wk = nn.Linear(H, Di, bias=False)
        self.k_norm = nn.LayerNorm(Di, eps=1e-6)
        self.weights_proj = nn.Linear(H, n, bias=False)

    def keys(self, x_BTH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """→ k [B, T, Di] (LayerNorm, RoPE) in the model dtype."""
        cos, sin = rope
        return apply_rope(self.k_norm(self.wk(x_BTH))[:, None], cos, sin)[:, 0]

    def queries(self, x_BTH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (q [B, T, n, Di] with RoPE, w [B, T, n] = weights_proj(x)/√n in the compute dtype)."""
        B, T, _ = x_BTH.shape
        cos, sin = rope
        q_BnTD = apply_rope(self.wq(x_BTH).view(B, T, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)
        w_BTn = self.weights_proj(x_BTH).to(compute_dtype(x_BTH.dtype)) * self.n_heads ** -0.5
        return q_BnTD.transpose(1, 2), w_BTn



class GatedDSAAttention(Attention):
    """`full` attention restricted to the indexer's top-k keys per query, with a sigmoid output gate."""

    def __init__(self, config: MoEConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx, output_gate=True)
        self.indexer = LightningIndexer(config)
        self.topk = config.index_topk
        self.sparse = config.dsa_mode == "sparse"
        self.query_chunk = config.dsa_query_chunk
        self.state_spec = StateSpec(keys_values=True, index_dim=config.index_head_dim)
        self.kernels: Kernels = kernels_for("torch")  # MoETransformer.set_kernels hands down the model's

    def forward(self, x_BTH: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        B, T, _ = x_BTH.shape
        q_BHTD, k_BHSD, v_BHSD = self.qkv(x_BTH, batch)
        want_loss = batch.indexer_losses is not None
        with torch.set_grad_enabled(want_loss and torch.is_grad_enabled()):
            x_idx = x_BTH.detach()  # the indexer's input is detached: L_I trains the indexer only
            ik_BTD = self.indexer.keys(x_idx, batch.index_rope)
            ik_BSD = ik_BTD if batch.cache is None else batch.cache.update_index(self.layer_idx, ik_BTD)
            iq_BTnD, iw_BTn = self.indexer.queries(x_idx, batch.index_rope)
        outs, kl_sum = [], x_BTH.new_zeros((), dtype=compute_dtype(x_BTH.dtype))
        weight_BT = batch.token_mask_BT if batch.query_weight_BT is None else batch.query_weight_BT
        # split, not x[..., a:b] per chunk: a slice's backward zero-fills the whole tensor's gradient
        chunks = zip(q_BHTD.split(self.query_chunk, dim=2), iq_BTnD.split(self.query_chunk, dim=1),
                     iw_BTn.split(self.query_chunk, dim=1), strict=True)
        if self.sparse:  # keys/values as [B, S, Hkv, D] once per forward (every chunk gathers rows of them)
            k_BSKD, v_BSKD = (x.transpose(1, 2).contiguous() for x in (k_BHSD, v_BHSD))
        for a, (q_c, iq_c, iw_c) in zip(range(0, T, self.query_chunk), chunks, strict=True):
            b = min(a + self.query_chunk, T)
            # keys after the chunk's last query are never visible: score and mask only the first Sc
            # (half the indexer's work over a prefill); indices into them are indices into all S
            Sc = ik_BSD.shape[1] - T + b
            visible_BcS = batch.mask((a, b))[:, 0, :, :Sc].expand(B, b - a, -1)
            with torch.set_grad_enabled(want_loss and torch.is_grad_enabled()):
                scores_BcS = self.kernels.dsa_scores(iq_c, iw_c, ik_BSD[:, :Sc])
            real_Bc = None if weight_BT is None else weight_BT[:, a:b]
            if self.sparse:  # attend over the k gathered keys, not over a mask of all S
                idx_Bck, valid_Bck = self.kernels.dsa_select(scores_BcS.detach(), visible_BcS, self.topk)
                o_BHcD, probs_BHck = self.kernels.dsa_attend(q_c, k_BSKD, v_BSKD, idx_Bck, valid_Bck, want_loss)
                outs.append(o_BHcD)
                if want_loss:
                    kl_sum = kl_sum + indexer_kl(probs_BHck.detach().mean(1), scores_BcS.gather(-1, idx_Bck),
                                                 valid_Bck, real_Bc)
                continue
            if not want_loss:
                outs.append(F.scaled_dot_product_attention(
                    q_c, k_BHSD[:, :, :Sc], v_BHSD[:, :, :Sc], attn_mask=visible_BcS[:, None],
                    scale=self.head_dim ** -0.5, enable_gqa=self.num_heads != self.num_kv_heads))
                continue
            probs_BHcS = self._probs(q_c, k_BHSD[:, :, :Sc], visible_BcS)
            outs.append(self._weighted_values(probs_BHcS.to(v_BHSD.dtype), v_BHSD[:, :, :Sc]))
            kl_sum = kl_sum + indexer_kl(probs_BHcS.detach().mean(1), scores_BcS, visible_BcS, real_Bc)
        if want_loss:
            n_real = torch.tensor(float(B * T), device=x_BTH.device) if weight_BT is None else weight_BT.sum()
            batch.indexer_losses.append((kl_sum, n_real.to(kl_sum.dtype)))
        return self.output(x_BTH, torch.cat(outs, dim=2))

    def _probs(self, q_BHcD: torch.Tensor, k_BHSD: torch.Tensor, allowed_BcS: torch.Tensor) -> torch.Tensor:
        """softmax over allowed keys of q·k/√D, [B, Hq, c, S] in the compute dtype (GQA by grouping)."""
        B, Hq, c, D = q_BHcD.shape
        G = Hq // self.num_kv_heads
        q_BKGcD = (q_BHcD * D ** -0.5).view(B, self.num_kv_heads, G, c, D)  # scale q, not [.., c, S]
        logits = torch.einsum("bkgcd,bksd->bkgcs", q_BKGcD, k_BHSD).reshape(B, Hq, c, -1)
        logits = logits.to(compute_dtype(q_BHcD.dtype)).masked_fill(~allowed_BcS[:, None], float("-inf"))
        return torch.softmax(logits, dim=-1)

    def _weighted_values(self, probs_BHcS: torch.Tensor, v_BHSD: torch.Tensor) -> torch.Tensor:
        B, Hq, c, S = probs_BHcS.shape
        G = Hq // self.num_kv_heads
        p_BKGcS = probs_BHcS.view(B, self.num_kv_heads, G, c, S)
        return torch.einsum("bkgcs,bksd->bkgcd", p_BKGcS, v_BHSD).reshape(B, Hq, c, -1)


def indexer_kl(p_BcS: torch.Tensor, scores_BcS: torch.Tensor, allowed_BcS: torch.Tensor,
               real_Bc: torch.Tensor | None) -> torch.Tensor:
    """Σ over real queries of KL(p ‖ softmax(scores)) on the allowed keys; p is a distribution there.
    ``real_Bc``: bool, or float weights per query."""
    log_q = torch.log_softmax(scores_BcS.masked_fill(~allowed_BcS, float("-inf")), dim=-1)
    log_p = torch.log(p_BcS.clamp_min(torch.finfo(p_BcS.dtype).tiny))
    kl_Bc = torch.where(p_BcS > 0, p_BcS * (log_p - log_q.masked_fill(~allowed_BcS, 0.0)), 0.0).sum(-1)
    if real_Bc is not None:
        kl_Bc = kl_Bc * real_Bc.to(kl_Bc.dtype)
    return kl_Bc.sum()


def indexer_loss(losses: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
    """Mean over gated_dsa layers of the per-real-query mean KL; None without gated_dsa layers."""
    if not losses:
        return None
    return torch.stack([s / n.clamp_min(1) for s, n in losses]).mean()
