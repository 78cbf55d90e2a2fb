"""Per-token log-probs and entropies from hidden states, in chunks over the tokens: the head's
``[B, T, V]`` logits (and their log-softmax) never exist at once.

For a large vocabulary (Qwen3: V = 151,936) the full logits dominate the learner's memory: a
``[B, T, V]`` float32 tensor, its log-softmax, and in backward the softmax again, each
``4·B·T·V`` bytes. Here the ``N = B·(T-1)`` predicting positions are cut into chunks of
``chunk`` tokens; each chunk's logits are computed, reduced to its log-probs and entropies, and
dropped. Each chunk runs under ``torch.utils.checkpoint``, so backward recomputes its logits
instead of keeping them: peak extra memory is about ``chunk·V`` values, plus the hidden states.

Math (temperature τ, per position t >= 1, z = W h_{t-1} / τ):

    logp_t = z[id_t] - logsumexp(z)            H_t = logsumexp(z) - Σ_v softmax(z)_v z_v

0 at t = 0, as ``batch.logprobs_from_logits`` and ``forward.token_entropy`` (which take the full
logits), whose values these equal up to float summation order (tested in float64).

Shapes: B rows, T tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from jointrl.model.norm import compute_dtype, outside_autocast

CHUNK_TOKENS = 1024


def _chunk(h_NH: torch.Tensor, weight_VH: torch.Tensor, ids_N: torch.Tensor, temperature: float,
           entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    with outside_autocast(h_NH):  # the head in the hidden state's precision, as forward._head
        z_NV = F.linear(h_NH, weight_VH)
    z_NV = z_NV.to(compute_dtype(z_NV.dtype))
    if temperature not in (0.0, 1.0):
        z_NV = z_NV / temperature
    lse_N = torch.logsumexp(z_NV, -1)
    logp_N = z_NV.gather(-1, ids_N[:, None]).squeeze(-1) - lse_N
    if not entropy:
        return logp_N, logp_N.new_zeros(())
    h_N = lse_N - (torch.softmax(z_NV, -1) * z_NV).sum(-1)
    return logp_N, h_N


def chunked_logprobs(hidden_BTH: torch.Tensor, weight_VH: torch.Tensor, ids_BT: torch.Tensor,
                     temperature: float = 1.0, chunk: int = CHUNK_TOKENS,
                     entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp_BT, entropy_BT or None) of ``ids_BT`` under ``softmax(hidden @ weight.T / temperature)``
    (see the module docstring); both [B, T], 0 at t = 0, in float32 (float64 for float64 inputs).
    Differentiable in ``hidden_BTH`` and ``weight_VH``; ``chunk`` tokens' logits exist at a time."""
    if chunk < 1:
        raise ValueError(f"chunked_logprobs: chunk must be >= 1, got {chunk}")
    B, T, H = hidden_BTH.shape
    h_NH = hidden_BTH[:, :-1].reshape(-1, H)
    ids_N = ids_BT[:, 1:].reshape(-1)
    grad = torch.is_grad_enabled() and (hidden_BTH.requires_grad or weight_VH.requires_grad)
    logps, ents = [], []
    for lo in range(0, max(h_NH.shape[0], 1), chunk):  # an empty chunk for T = 1 keeps the result in the graph
        args = (h_NH[lo:lo + chunk], weight_VH, ids_N[lo:lo + chunk], temperature, entropy)
        lp, h = checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args)
        logps.append(lp)
        ents.append(h)
    dtype = compute_dtype(hidden_BTH.dtype)
    zero = torch.zeros(B, 1, dtype=dtype, device=hidden_BTH.device)
    logp_BT = torch.cat([zero, torch.cat(logps).view(B, T - 1)], 1)
    if not entropy:
        return logp_BT, None
    return logp_BT, torch.cat([zero, torch.cat(ents).view(B, T - 1)], 1)
