"""``TrainBatch``: what the driver hands the learner, and packing it into micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TrainBatch:
    """Sequences to train on, one entry per trajectory (ragged lists, token space)."""

    token_ids: list[list[int]]
    loss_mask: list[list[int]]
    old_logprobs: list[list[float]]  # engine log-probs of sampled tokens (0 elsewhere)
    advantages: list[float]

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.old_logprobs) == len(self.advantages) == n):
            raise ValueError("TrainBatch fields need one entry per sequence")

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(sum(m) for m in self.loss_mask)

    def select(self, idx: list[int]) -> TrainBatch:
        return TrainBatch([self.token_ids[i] for i in idx], [self.loss_mask[i] for i in idx],
                          [self.old_logprobs[i] for i in idx], [self.advantages[i] for i in idx])

    def shard(self, rank: int, world_size: int) -> TrainBatch:
        """Sequences for one data-parallel rank, balanced by length (longest first, greedy)."""
        loads = [0] * world_size
        owner = [0] * len(self)
        for i in sorted(range(len(self)), key=lambda i: -len(self.token_ids[i])):
            r = loads.index(min(loads))
            owner[i] = r
            loads[r] += len(self.token_ids[i])
        return self.select([i for i in range(len(self)) if owner[i] == rank])


@dataclass(slots=True)
class MicroBatch:
    """Right-padded tensors, all [B, T]; ``attention_mask`` True on real tokens."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor  # [B]


def micro_batches(batch: TrainBatch, size: int, pad_id: int, dtype: torch.dtype) -> list[MicroBatch]:
    out = []
    for start in range(0, len(batch), size):
        part = batch.select(list(range(start, min(start + size, len(batch)))))
        B, T = len(part), max(len(s) for s in part.token_ids)
        ids = torch.full((B, T), pad_id, dtype=torch.long)
        attn = torch.zeros((B, T), dtype=torch.bool)
        lmask = torch.zeros((B, T), dtype=dtype)
        old = torch.zeros((B, T), dtype=dtype)
        for b in range(B):
            n = len(part.token_ids[b])
            ids[b, :n] = torch.tensor(part.token_ids[b])
            attn[b, :n] = True
            lmask[b, :n] = torch.tensor(part.loss_mask[b], dtype=dtype)
            old[b, :n] = torch.tensor(part.old_logprobs[b], dtype=dtype)
        out.append(MicroBatch(ids, attn, lmask, old, torch.tensor(part.advantages, dtype=dtype)))
    return out


def logprobs_from_logits(logits_BTV: torch.Tensor, ids_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(token_t | tokens_<t) under ``softmax(logits / temperature)``; [B, T], 0 at t = 0.

    The sampler (``jointrl.rl.rollout.sampler``) uses the same convention, so on the same
    weights and tokens the two agree (tested in float64). bf16 logits are upcast to fp32.
    """
    if temperature not in (0.0, 1.0):
        logits_BTV = logits_BTV / temperature
    if logits_BTV.dtype == torch.bfloat16:
        logits_BTV = logits_BTV.float()
    picked_BT = torch.log_softmax(logits_BTV[:, :-1], -1).gather(-1, ids_BT[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked_BT[:, :1]), picked_BT], dim=1)


def position_ids(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only (0 at each row's first real token)."""
    return (attention_mask_BT.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """``logprobs_from_logits`` of one forward pass of ``model``; [B, T]."""
    logits_BTV = model(input_ids_BT, position_ids=position_ids(attention_mask_BT), attention_mask=attention_mask_BT).logits
    return logprobs_from_logits(logits_BTV, input_ids_BT, temperature)
