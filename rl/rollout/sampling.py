"""Choosing the next token of every row of a step, with the log-prob the learner will compare.

Convention (the learner's, ``rl/learner/batch.logprobs_from_logits``): the log-prob of the
sampled token under ``log_softmax(logits / T)`` in float64, *before* top-k / top-p filtering;
``T = 1`` for greedy rows (``temperature == 0``). Greedy rows are decided in one batched
argmax; sampled rows each draw from their own generator (a per-request seed reproduces).
"""

from __future__ import annotations

import torch

from jointrl.rl.types import SamplingParams


def sample_rows(logits_RV: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
                ) -> tuple[list[int], list[float]]:
    """→ (token per row, its log-prob). ``logits_RV`` in any float dtype."""
    logits_RV = logits_RV.double()
    greedy = [i for i, sp in enumerate(params) if sp.temperature == 0]
    tokens, logprobs = [0] * len(params), [0.0] * len(params)
    if greedy:
        g_RV = logits_RV[greedy] if len(greedy) < len(params) else logits_RV
        tok_R = g_RV.argmax(-1)
        lp_R = torch.log_softmax(g_RV, -1).gather(1, tok_R[:, None])[:, 0]
        for i, t, lp in zip(greedy, tok_R.tolist(), lp_R.tolist()):
            tokens[i], logprobs[i] = t, lp
    for i, sp in enumerate(params):
        if sp.temperature != 0:
            tokens[i], logprobs[i] = sample_one(logits_RV[i], sp, gens[i])
    return tokens, logprobs


def sample_one(logits_V: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None) -> tuple[int, float]:
    """Temperature, then top-k, then top-p (the smallest prefix of the sorted distribution
    reaching ``top_p``), then one draw from ``gen``."""
    logp_V = torch.log_softmax(logits_V / sp.temperature, -1)
    filtered_V = logp_V.clone()
    if 0 < sp.top_k < filtered_V.numel():
        kth = torch.topk(filtered_V, sp.top_k).values[-1]
        filtered_V[filtered_V < kth] = -torch.inf
    if sp.top_p < 1.0:
        sorted_V, order = torch.sort(filtered_V, descending=True)
        drop = sorted_V.exp().cumsum(-1) - sorted_V.exp() >= sp.top_p
        filtered_V[order[drop]] = -torch.inf
    token = int(torch.multinomial(torch.softmax(filtered_V, -1).float(), 1, generator=gen))
    return token, float(logp_V[token])
