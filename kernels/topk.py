"""Top-k key selection for DeepSeek sparse attention: per query, the k visible keys with the
largest indexer scores, as a Triton kernel beside its torch reference.

``select_topk(scores_BTS, visible_BTS, k)`` → ids ``[B, T, k]`` (int32) in ascending position
order, padded with -1 after the last selected key when fewer than k keys are visible. Ties go
to the most recent key (the larger position), the rule of the reference ``topk_mask`` (the gated_dsa
layer's): ReLU makes exact ties (scores of 0) common, and a rule that depended on the query-chunk
shape would let a prefill and the same tokens decoded one by one select different keys. ``-0.0`` ties with
``+0.0``. Scores must be finite.

``select_keys_torch`` / ``select_keys_triton``: the op table's ``dsa_select`` (``kernels/ops``), the layer's
(indices, valid) form of the same selection.

The kernel, one program per query row, makes each (score, position) pair one distinct int64
key — the score's fp32 bits mapped to an order-preserving int32 in the high half, the position
in the low half — so "larger key" is exactly the reference's order, ties included. It finds the
k-th largest visible key τ by radix select (8 passes over the row, one byte of the key each,
most significant first: a 256-bin histogram of the byte among the keys that share τ's bytes so
far picks τ's next byte), then writes the positions of the visible keys ≥ τ in order (a prefix
sum gives each its slot). Keys are distinct, so exactly k are ≥ τ. No sort: the selection is a
threshold, and Triton's ``tl.sort`` takes seconds per call in the interpreter. Cost per row: 9
reads of the scores (L2-resident after the first for rows of a few thousand keys).

Layout (kernels/ convention): torch reference, Triton kernel, launcher, public function.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from jointrl.kernels.dispatch import launcher, use_triton

__all__ = ["TOPK_CONFIG", "select_keys_torch", "select_keys_triton", "select_topk", "selected_keys", "topk_mask"]


class TopkConfig(NamedTuple):
    block_s: int  # keys per scan step, at most (a power of two)
    num_warps: int


TOPK_CONFIG = TopkConfig(block_s=1024, num_warps=4)

_NONE = tl.constexpr(-(2**63))  # the key of an invisible or out-of-range position: below every real key


def _block_s(S: int, config: TopkConfig = TOPK_CONFIG) -> int:
    return max(16, min(config.block_s, triton.next_power_of_2(S)))


# ---------------------------------------------------------------------------------------
# plain-torch reference
# ---------------------------------------------------------------------------------------


def topk_mask(scores_BcS: Tensor, visible_BcS: Tensor, k: int) -> Tensor:
    """The reference (``model/dsa.py``'s gated_dsa layer selects with it): bool [B, c, S], the k visible keys
    with the largest scores per query (all visible ones if fewer).

    Ties go to the most recent key, deterministically: ReLU makes exact ties (scores of 0) common, and
    `topk` breaks them differently for different query-chunk shapes, which would make a prefill and
    the same tokens decoded one by one select different keys.
    """
    S = scores_BcS.shape[-1]
    k = min(k, S)
    masked = scores_BcS.masked_fill(~visible_BcS, float("-inf"))
    # The k-th largest value (a value, so how `topk` orders ties does not matter); every key above
    # it is in, and of the keys equal to it the most recent ones fill the rest. Equal to a stable
    # descending sort of the reversed row cut at k, without sorting S keys per query.
    kth_Bc1 = torch.topk(masked, k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above = masked > kth_Bc1
    tied = masked == kth_Bc1
    need_Bc1 = k - above.sum(-1, keepdim=True)
    small = torch.int16 if S < 2 ** 15 else torch.int32  # CPU cumsum is several times faster in int16
    from_the_end = tied.flip(-1).cumsum(-1, dtype=small).flip(-1)  # tied keys at or after each position
    return (above | (tied & (from_the_end <= need_Bc1))) & visible_BcS


def selected_keys(allowed_BcS: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(indices [B, c, k'] of the allowed keys, valid [B, c, k']) with k' = min(k, S): a row of
    ``topk_mask`` holds at most k allowed keys; where it holds fewer, the rest are padding (valid
    False, index of some disallowed key). Unordered."""
    S = allowed_BcS.shape[-1]
    k = min(k, S)
    rank = allowed_BcS * torch.arange(1, S + 1, dtype=torch.float32, device=allowed_BcS.device)
    idx_Bck = torch.topk(rank, k, dim=-1, sorted=False).indices
    return idx_Bck, allowed_BcS.gather(-1, idx_Bck)


def select_keys_torch(scores_BcS: Tensor, visible_BcS: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The op table's ``dsa_select`` reference: ``selected_keys(topk_mask(...))`` → (idx, valid) [B, c, min(k, S)]."""
    return selected_keys(topk_mask(scores_BcS, visible_BcS, k), k)


def select_keys_triton(scores_BcS: Tensor, visible_BcS: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``select_keys_torch``'s contract on the radix-select kernel (ids in position order; the padding slots
    index key 0 with valid False); float64 scores take the reference."""
    if scores_BcS.dtype == torch.float64:
        return select_keys_torch(scores_BcS, visible_BcS, k)
    ids = _select_topk_triton(scores_BcS.float(), visible_BcS, min(k, scores_BcS.shape[-1]))
    valid = ids >= 0
    return ids.clamp_min(0).long(), valid


def _select_topk_torch(scores_BTS: Tensor, visible_BTS: Tensor, k: int) -> Tensor:
    """``select_topk``'s form of the reference ``topk_mask``: the selected positions in ascending order, -1
    (none) after them, k slots."""
    S = scores_BTS.shape[-1]
    allowed = topk_mask(scores_BTS, visible_BTS, k) if S else visible_BTS
    pos = torch.arange(S, device=scores_BTS.device).expand_as(allowed)
    ids = torch.where(allowed, pos, S).sort(dim=-1).values[..., :k]  # S: a placeholder that sorts last
    ids = torch.where(ids < S, ids, -1).to(torch.int32)
    if ids.shape[-1] < k:
        ids = F.pad(ids, (0, k - ids.shape[-1]), value=-1)
    return ids


# ---------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------


@triton.jit
def _row_keys(scores_ptr, visible_ptr, row, s, S):
    """The int64 keys of positions s of one row (module docstring); _NONE where not visible."""
    ok = s < S
    vis = tl.load(visible_ptr + row * S + s, mask=ok, other=0) != 0
    x = tl.load(scores_ptr + row * S + s, mask=ok, other=0.0).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 → +0.0: the reference's sort sees them equal
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed-int order = float order
    return tl.where(vis & ok, (ordered.to(tl.int64) << 32) | s.to(tl.int64), _NONE)


@triton.jit
def _topk_kernel(scores_ptr, visible_ptr, ids_ptr, S, TOPK, BLOCK_S: tl.constexpr):
    """Program (b·T + t): scores [B·T, S] (any float dtype), visible [B·T, S] uint8 →
    ids int32 [B·T, TOPK] (module docstring)."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_S)
    bins = tl.arange(0, 256)
    # Radix select, most significant byte first: τ collects the bytes of the TOPK-th largest key;
    # `need` counts the keys still to take among those sharing τ's bytes so far.
    tau = tl.zeros([], tl.int64)
    need = tl.zeros([], tl.int32) + TOPK
    n_visible = tl.zeros([], tl.int32)
    for p in tl.static_range(8):
        shift = 56 - 8 * p
        hist = tl.zeros([256], tl.int32)
        for s0 in range(0, S, BLOCK_S):
            key = _row_keys(scores_ptr, visible_ptr, row, s0 + i, S)
            match = key != _NONE
            digit = ((key >> shift) & 0xFF).to(tl.int32)
            if p == 0:
                digit = digit ^ 0x80  # the sign byte: unsigned order = signed order
            else:
                match = match & ((key >> (shift + 8)) == (tau >> (shift + 8)))
            hist += tl.histogram(digit, 256, mask=match)
        at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys with this byte or larger
        if p == 0:
            n_visible = tl.sum(hist, axis=0)
        byte = tl.sum((at_least >= need).to(tl.int32), axis=0) - 1
        need -= tl.sum(tl.where(bins > byte, hist, 0), axis=0)
        if p == 0:
            byte = byte ^ 0x80
        tau = tau | ((byte & 0xFF).to(tl.int64) << shift)
    tau = tl.where(n_visible < TOPK, _NONE, tau)  # fewer than TOPK visible keys: take them all
    n_out = tl.zeros([], tl.int32)
    for s0 in range(0, S, BLOCK_S):
        key = _row_keys(scores_ptr, visible_ptr, row, s0 + i, S)
        take = (key != _NONE) & (key >= tau)
        slot = n_out + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(ids_ptr + row * TOPK + slot, (s0 + i).to(tl.int32), mask=take)
        n_out += tl.sum(take.to(tl.int32), axis=0)
    for j0 in range(0, TOPK, BLOCK_S):
        j = j0 + i
        tl.store(ids_ptr + row * TOPK + j, tl.full([BLOCK_S], -1, tl.int32), mask=(j >= n_out) & (j < TOPK))


# ---------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------


def _select_topk_triton(scores_BTS: Tensor, visible_BTS: Tensor, k: int, config: TopkConfig = TOPK_CONFIG
                        ) -> Tensor:
    B, T, S = scores_BTS.shape
    ids = torch.empty(B, T, k, dtype=torch.int32, device=scores_BTS.device)
    if B * T == 0 or k == 0:
        return ids
    kernel = launcher(_topk_kernel, scores_BTS.device)
    kernel[(B * T,)](scores_BTS.contiguous(), visible_BTS.contiguous().view(torch.uint8), ids, S, k,
                     BLOCK_S=_block_s(S, config), num_warps=config.num_warps)
    return ids


# ---------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------


def select_topk(scores_BTS: Tensor, visible_BTS: Tensor, k: int) -> Tensor:
    """Positions of the k visible keys with the largest scores (module docstring).

    Args:
        scores_BTS: ``[B, T, S]`` finite scores (the indexer's).
        visible_BTS: bool ``[B, T, S]``: which keys each query may select (causality, padding).
        k: keys per query, ≥ 0.

    Returns:
        int32 ``[B, T, k]``: the selected key positions in ascending order, then -1 in the slots
        past the number of visible keys. Float64 scores take the torch reference.
    """
    if scores_BTS.dim() != 3 or visible_BTS.shape != scores_BTS.shape or visible_BTS.dtype != torch.bool:
        raise ValueError(f"select_topk needs scores [B, T, S] and a bool visible mask of the same shape; got scores "
                         f"{tuple(scores_BTS.shape)}, visible {tuple(visible_BTS.shape)} {visible_BTS.dtype}")
    if k < 0:
        raise ValueError(f"select_topk: k must be >= 0, got {k}")
    if scores_BTS.dtype != torch.float64 and use_triton(scores_BTS.device):
        return _select_topk_triton(scores_BTS, visible_BTS, k)
    return _select_topk_torch(scores_BTS, visible_BTS, k)
