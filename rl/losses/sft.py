"""Supervised fine-tuning on demonstrations: the negative log-likelihood of the loss tokens.

Per loss token t (the assistant's tokens of a demonstration transcript, ``loss_mask`` = 1)::

    l_t = -log π_θ(y_t | y_<t)  (+ Regularizers, optional)        loss = Aggregation(l)

The batch is a GRPO batch (same token ids and loss masks from the agent loop); behaviour
log-probs and advantages are ignored. With ``token_mean`` (default) this is the usual
cross-entropy averaged over every assistant token of the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from jointrl.rl.losses.common import Aggregation, LossInputs, Regularizers, aggregate, masked_mean


@dataclass(frozen=True, slots=True)
class SFTLoss:
    aggregation: Aggregation = Aggregation.token_mean
    regularizers: Regularizers = field(default_factory=Regularizers)

    def __post_init__(self) -> None:
        object.__setattr__(self, "aggregation", Aggregation(self.aggregation))

    @property
    def per_sequence(self) -> bool:
        """Whether ``LossInputs.norm`` counts sequences (else loss tokens)."""
        return self.aggregation.per_sequence

    def __call__(self, inp: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        nll_BT = -inp.logp_BT
        metrics = {"nll": masked_mean(nll_BT.detach(), inp.mask_BT.to(nll_BT.dtype)), "tokens": inp.tokens}
        loss_BT = self.regularizers(nll_BT, inp, metrics)
        return aggregate(loss_BT, inp, self.aggregation), metrics
