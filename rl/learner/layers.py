"""What the learner's two forwards return: ``LearnerForward``.

``forward.learner_forward`` (packed rows, shared prompts through one flat stream) and
``prefix_cache.forward_with_prefix_cache`` (shared prompts through a cache, for KDA / gated_dsa
models) both run the model's own layer loop (``MoETransformer.run_layers``, which its ``forward``
runs too) and return a ``LearnerForward``; it lives here so that neither forward module imports the other.

Shapes: B rows, T tokens per row, H hidden, V vocab, L MoE layers, k experts per token, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LearnerForward:
    """What a learner forward returns for B rows of T tokens."""

    logits_BTV: torch.Tensor | None  # None when asked not to (logits=False: the caller reads hidden_BTH in chunks)
    hidden_BTH: torch.Tensor  # after the final norm (a value head reads this)
    topk_ids_BTLk: torch.Tensor  # experts each token was sent to (the replayed ones under replay), L = MoE layers
    aux_loss: torch.Tensor  # load-balancing loss over real tokens (unweighted)
    expert_load_LE: torch.Tensor  # real-token assignments per (MoE layer, expert), no grad
    indexer_loss: torch.Tensor | None = None  # gated_dsa's L_I (mean over layers and real queries), when asked
