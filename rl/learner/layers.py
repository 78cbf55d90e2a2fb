"""What the learner's two forwards share: the decoder-layer loop and the record they return.

``forward.learner_forward`` (packed rows, shared prompts through one flat stream) and
``prefix_cache.forward_with_prefix_cache`` (shared prompts through a cache, for KDA / gated_dsa
models) both run the model's decoder layers with ``run_layers`` and return a ``LearnerForward``;
they live here so that neither forward module imports the other.

Shapes: B rows, T tokens per row, H hidden, V vocab, L MoE layers, k experts per token, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from jointrl.model.attention import AttentionBatch


@dataclass(slots=True)
class LearnerForward:
    """What a learner forward returns for B rows of T tokens."""

    logits_BTV: torch.Tensor | None  # None when asked not to (logits=False: the caller reads hidden_BTH in chunks)
    hidden_BTH: torch.Tensor  # after the final norm (a value head reads this)
    topk_ids_BTLk: torch.Tensor  # experts each token was sent to (the replayed ones under replay), L = MoE layers
    aux_loss: torch.Tensor  # load-balancing loss over real tokens (unweighted)
    expert_load_LE: torch.Tensor  # real-token assignments per (MoE layer, expert), no grad
    indexer_loss: torch.Tensor | None = None  # gated_dsa's L_I (mean over layers and real queries), when asked


def run_layers(backbone: torch.nn.Module, x_BTH: torch.Tensor, batch: AttentionBatch, replay_BTLk: torch.Tensor | None,
               grad_checkpoint: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Every decoder layer of ``backbone`` over ``x_BTH`` [B, T, H] → (x_BTH, per-MoE-layer router
    probs [B·T, E], per-MoE-layer expert ids [B·T, k]). ``replay_BTLk`` [B, T, L_moe, k] forces each
    MoE layer's experts (routing replay); ``grad_checkpoint`` recomputes each layer in backward."""
    B, T = x_BTH.shape[:2]
    probs, ids = [], []
    for layer in backbone.layers:
        replay_Nk = None if replay_BTLk is None or not layer.is_moe else replay_BTLk[:, :, len(ids)].reshape(B * T, -1)
        if grad_checkpoint and torch.is_grad_enabled():
            x_BTH, routing = checkpoint(layer, x_BTH, batch, replay_Nk, use_reentrant=False)
        else:
            x_BTH, routing = layer(x_BTH, batch, replay_Nk)
        if routing is not None:
            probs.append(routing[1])
            ids.append(routing[2])
    return x_BTH, probs, ids
