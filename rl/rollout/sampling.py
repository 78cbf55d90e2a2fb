"""Choosing the next token of every row of a step, with the log-prob the learner will compare.

Convention (the learner's, ``rl/learner/batch.logprobs_from_logits``): the log-prob of the
sampled token under ``log_softmax(logits / T)`` in float64, *before* top-k / top-p filtering;
``T = 1`` for greedy rows (``temperature == 0``).

Batched: one log-softmax over all rows (each divided by its own temperature), greedy rows by
one argmax, sampled rows by one inverse-CDF lookup -- each sampled row draws one uniform number
from its own generator (a per-request seed reproduces, whatever else shares the batch); only
rows that ask for top-k / top-p are filtered one by one.

Device: everything runs where ``logits_RV`` is (the engine's device); a row's generator must be a
generator of that device (``LLMEngine.make_sequence`` makes them there), an unseeded row draws from
the device's default generator. On the host the draws are those of a host generator, so CPU results
are unchanged; a seed gives other numbers on CUDA than on the host (another generator), the same ones
run after run. Only the chosen tokens and their log-probs come back to the host (one copy each).
"""

from __future__ import annotations

import torch

from jointrl.rl.types import SamplingParams


def sample_rows(logits_RV: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
                ) -> tuple[list[int], list[float]]:
    """→ (token per row, its log-prob). ``logits_RV`` in any float dtype.

    Runs once per decode step, so the common case -- every row sampled at temperature 1, no
    top-k / top-p -- skips the division, the argmax, the row gather and the scatter back (the same
    values: dividing by 1 and gathering every row are identities)."""
    R = len(params)
    if R == 0:
        return [], []
    logits_RV = logits_RV.double()
    temps = [sp.temperature or 1.0 for sp in params]
    if any(t != 1.0 for t in temps):
        logits_RV = logits_RV / torch.tensor(temps, dtype=torch.float64, device=logits_RV.device)[:, None]
    logp_RV = torch.log_softmax(logits_RV, -1)
    sampled = [i for i, sp in enumerate(params) if sp.temperature != 0]
    every = len(sampled) == R
    tok_R = None if every else logits_RV.argmax(-1)
    if sampled:
        filtered_SV = logp_RV if every else logp_RV[sampled]
        rows = [row for row, i in enumerate(sampled) if 0 < params[i].top_k < logp_RV.shape[1] or params[i].top_p < 1.0]
        if rows and every:
            filtered_SV = filtered_SV.clone()
        for row in rows:
            filter_top_k_top_p(filtered_SV[row], params[sampled[row]])
        cdf_SV = torch.softmax(filtered_SV, -1).cumsum(-1)
        dev = logits_RV.device
        u_S1 = torch.cat([torch.rand(1, dtype=torch.float64, generator=gens[i], device=dev) for i in sampled])[:, None]
        pick_S = torch.searchsorted(cdf_SV, u_S1 * cdf_SV[:, -1:], right=True)[:, 0].clamp_max(logp_RV.shape[1] - 1)
        if every:
            tok_R = pick_S
        else:
            tok_R[sampled] = pick_S
    lp_R = logp_RV.gather(1, tok_R[:, None])[:, 0]
    return tok_R.tolist(), lp_R.tolist()


def filter_top_k_top_p(logp_V: torch.Tensor, sp: SamplingParams) -> None:
    """In place: -inf outside the top-k, then outside the smallest prefix of the sorted
    distribution reaching ``top_p``."""
    if 0 < sp.top_k < logp_V.numel():
        kth = torch.topk(logp_V, sp.top_k).values[-1]
        logp_V[logp_V < kth] = -torch.inf
    if sp.top_p < 1.0:
        sorted_V, order = torch.sort(logp_V, descending=True)
        drop = sorted_V.exp().cumsum(-1) - sorted_V.exp() >= sp.top_p
        logp_V[order[drop]] = -torch.inf
