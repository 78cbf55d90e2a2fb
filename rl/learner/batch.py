"""``TrainBatch``: what the driver hands the learner, and packing it into micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jointrl.model.rope import position_ids
from jointrl.rl.image_inputs import slot_patches


@dataclass(slots=True)
class TrainBatch:
    """Sequences to train on, one entry per trajectory (ragged lists, token space).

    ``advantages`` are per sequence (GRPO/GSPO); PPO computes per-token GAE advantages from
    ``rewards`` and its critic. ``routed_experts[i]`` is the ``[T_i, L, k]`` int tensor of expert
    ids the rollout used for each token, -1 rows where it has none (the final token, which
    predicts nothing).
    ``image_patches[i]`` is the trajectory's ``[P, patch_dim]`` screenshot patches (one row per
    ``<image>`` id) or None.
    """

    token_ids: list[list[int]]
    loss_mask: list[list[int]]
    old_logprobs: list[list[float]]  # engine log-probs of sampled tokens (0 elsewhere)
    advantages: list[float]
    rewards: list[float] | None = None
    routed_experts: list[torch.Tensor | None] | None = None
    image_patches: list[torch.Tensor | None] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.old_logprobs) == len(self.advantages) == n):
            raise ValueError("TrainBatch fields need one entry per sequence")
        for name in ("rewards", "routed_experts", "image_patches"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise ValueError(f"TrainBatch.{name} needs one entry per sequence")
        for i, (ids, m) in enumerate(zip(self.token_ids, self.loss_mask)):
            if m and m[0]:
                raise ValueError(f"TrainBatch sequence {i}: the first token cannot be trained (nothing predicts it)")
            if len(m) != len(ids):
                raise ValueError(f"TrainBatch sequence {i}: loss_mask has {len(m)} entries for {len(ids)} tokens")
            routes = self.routed_experts[i] if self.routed_experts is not None else None
            if routes is not None and (routes.dim() != 3 or len(routes) != len(ids)):
                raise ValueError(f"TrainBatch sequence {i}: routed_experts must be [{len(ids)}, L, k], "
                                 f"got {tuple(routes.shape)}")

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(sum(m) for m in self.loss_mask)

    @property
    def num_loss_seqs(self) -> int:
        return sum(1 for m in self.loss_mask if any(m))

    def select(self, idx: list[int]) -> TrainBatch:
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
        return TrainBatch(pick(self.token_ids), pick(self.loss_mask), pick(self.old_logprobs),
                          pick(self.advantages), pick(self.rewards), pick(self.routed_experts),
                          pick(self.image_patches))

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
class SharedPrefix:
    """Prompts that several rows of a micro-batch continue, forwarded once (``collate_shared``).

    ``ids`` / ``real`` [G, P]: the G prompts, right-padded (``real`` False on padding);
    ``row_group`` [B]: the prompt row b continues. Row b's column 0 is its prompt's last token
    (whose logits predict the row's first own token), columns 1.. the row's own tokens."""

    ids: torch.Tensor
    real: torch.Tensor
    row_group: torch.Tensor


@dataclass(slots=True)
class MicroBatch:
    """Tensors [B, T] (one packed row, or right-padded rows). ``seg`` is each token's sequence
    index within the micro-batch (-1 on padding); ``pos`` restarts at 0 per sequence;
    ``adv`` is the sequence's advantage on each of its tokens; ``replay`` [B, T, L, k] or None;
    ``images`` [P, patch_dim]: a row per ``<image>`` id, row-major over [B, T], or None;
    ``prefix``: with a shared prefix, the rows hold only what follows it (``SharedPrefix``)."""

    input_ids: torch.Tensor
    pos: torch.Tensor
    seg: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    adv: torch.Tensor
    replay: torch.Tensor | None
    num_seqs: int
    rewards: list[float] | None = None
    images: torch.Tensor | None = None
    prefix: SharedPrefix | None = None

    @property
    def real(self) -> torch.Tensor:
        return self.seg >= 0

    def to(self, device: torch.device) -> MicroBatch:
        """This micro-batch with every tensor on ``device`` (collated on the host, computed on the rank's device)."""
        def move(t):
            return None if t is None else t.to(device, non_blocking=True)
        prefix = None if self.prefix is None else SharedPrefix(*(move(t) for t in (self.prefix.ids, self.prefix.real,
                                                                                    self.prefix.row_group)))
        return MicroBatch(move(self.input_ids), move(self.pos), move(self.seg), move(self.loss_mask),
                          move(self.old_logprobs), move(self.adv), move(self.replay), self.num_seqs, self.rewards,
                          move(self.images), prefix)


def plan_micro_batches(lengths: list[int], max_tokens: int, max_seqs: int, pack: bool) -> list[list[int]]:
    """Consecutive groups of sequence indices. A group holds at most ``max_seqs`` sequences (0:
    no limit) and at most ``max_tokens`` tokens (0: no limit), counted as the packed row's
    length when packing, else rows x the longest sequence (padding included). A sequence
    longer than the budget gets a group of its own."""
    groups: list[list[int]] = []
    cur: list[int] = []
    for i, n in enumerate(lengths):
        cand = cur + [i]
        cost = sum(lengths[j] for j in cand) if pack else len(cand) * max(lengths[j] for j in cand)
        if cur and ((max_tokens and cost > max_tokens) or (max_seqs and len(cand) > max_seqs)):
            groups.append(cur)
            cand = [i]
        cur = cand
    if cur:
        groups.append(cur)
    return groups


def collate(part: TrainBatch, pack: bool, pad_id: int, dtype: torch.dtype, topk: tuple[int, int] | None = None,
            image: tuple[int, int] | None = None) -> MicroBatch:
    """One micro-batch from ``part``: one packed row, or right-padded rows. ``topk = (L, k)``
    builds the replay tensor from ``part.routed_experts``; positions without recorded experts
    (padding, -1 rows: the final token) get experts 0..k-1, which no trained log-prob depends on.
    ``image = (image_token_id, patch_dim)`` (a model with image input) builds ``images`` from
    ``part.image_patches`` by ``slot_patches``' rule, in the rows' token order."""
    lens = [len(s) for s in part.token_ids]
    rows = [list(range(len(part)))] if pack else [[i] for i in range(len(part))]
    B, T = len(rows), (sum(lens) if pack else max(lens))
    ids, pos, seg, lmask, old, adv = _blank_rows(B, T, pad_id, dtype)
    replay = None
    if topk is not None:
        L, k = topk
        replay = torch.arange(k).repeat(B, T, L, 1)
    for b, members in enumerate(rows):
        at = 0
        for i in members:
            n = lens[i]
            sl = slice(at, at + n)
            ids[b, sl] = torch.tensor(part.token_ids[i])
            pos[b, sl] = torch.arange(n)
            seg[b, sl] = i
            lmask[b, sl] = torch.tensor(part.loss_mask[i], dtype=dtype)
            old[b, sl] = torch.tensor(part.old_logprobs[i], dtype=dtype)
            adv[b, sl] = part.advantages[i]
            if replay is not None:
                routes = part.routed_experts[i] if part.routed_experts is not None else None
                if routes is None:
                    raise ValueError("routing replay is on but a sequence carries no routed_experts")
                known = routes[:, 0, 0] >= 0
                replay[b, at:at + n][known] = routes[known].long()
            at += n
    images = None
    if image is not None:
        given = part.image_patches or [None] * len(part)
        images = torch.cat([slot_patches(part.token_ids[i], given[i], *image) for m in rows for i in m])
    return MicroBatch(ids, pos, seg, lmask, old, adv, replay, len(part), part.rewards, images)


def _blank_rows(B: int, T: int, pad_id: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A micro-batch's [B, T] tensors before any row is written: ids (padding), positions, segment
    ids (-1: padding), loss mask, old log-probs and advantages."""
    return (torch.full((B, T), pad_id, dtype=torch.long), torch.zeros((B, T), dtype=torch.long),
            torch.full((B, T), -1, dtype=torch.long), torch.zeros((B, T), dtype=dtype),
            torch.zeros((B, T), dtype=dtype), torch.zeros((B, T), dtype=dtype))


MIN_COMMON_PREFIX = 32  # tokens every row of a micro-batch must begin with for collate_shared to share them


def _common_prefix(seqs: list[list[int]], limit: int) -> int:
    """Length of the longest prefix all of ``seqs`` begin with, at most ``limit``."""
    n = 0
    for column in zip(*(s[:limit] for s in seqs)):
        if any(t != column[0] for t in column):
            break
        n += 1
    return n


def collate_shared(part: TrainBatch, pad_id: int, dtype: torch.dtype) -> MicroBatch | None:
    """One micro-batch whose sequences with the same untrained prompt (the tokens before the first
    loss token: a GRPO group's shared prompt) share one forward of it (``SharedPrefix``); when no
    two share a whole prompt, all share their common untrained prefix if it has at least
    ``MIN_COMMON_PREFIX`` tokens (SFT transcripts of one domain: its system prompt). None when
    neither holds or a sequence has no loss token (then ``collate``).

    Row i holds sequence i's prompt's last token at column 0 (loss mask 0) and the rest of the
    sequence after the prompt at columns 1..; positions continue the prompt's."""
    starts = [m.index(1) if 1 in m else 0 for m in part.loss_mask]
    if not all(starts):
        return None
    groups: dict[tuple[int, ...], int] = {}
    row_group = [groups.setdefault(tuple(ids[:p]), len(groups)) for ids, p in zip(part.token_ids, starts)]
    if len(groups) == len(part):
        # No two rows share a whole prompt (SFT: each task has its own instruction). Share what they
        # all begin with instead (the system prompt and tool list), when that is long enough to pay.
        common = _common_prefix(part.token_ids, min(starts))
        if len(part) < 2 or common < MIN_COMMON_PREFIX:
            return None
        starts, row_group = [common] * len(part), [0] * len(part)
        groups = {tuple(part.token_ids[0][:common]): 0}
    G, P = len(groups), max(len(k) for k in groups)
    prefix_ids = torch.full((G, P), pad_id, dtype=torch.long)
    prefix_real = torch.zeros((G, P), dtype=torch.bool)
    for g, key in enumerate(groups):
        prefix_ids[g, :len(key)] = torch.tensor(key)
        prefix_real[g, :len(key)] = True
    B, T = len(part), 1 + max(len(ids) - p for ids, p in zip(part.token_ids, starts))
    ids, pos, seg, lmask, old, adv = _blank_rows(B, T, pad_id, dtype)
    for i, p in enumerate(starts):
        n = len(part.token_ids[i]) - p + 1  # the prompt's last token, then the sequence's own
        ids[i, :n] = torch.tensor(part.token_ids[i][p - 1:])
        pos[i, :n] = torch.arange(p - 1, p - 1 + n)
        seg[i, :n] = i
        lmask[i, 1:n] = torch.tensor(part.loss_mask[i][p:], dtype=dtype)
        old[i, 1:n] = torch.tensor(part.old_logprobs[i][p:], dtype=dtype)
        adv[i, :n] = part.advantages[i]
    return MicroBatch(ids, pos, seg, lmask, old, adv, None, B, part.rewards,
                      prefix=SharedPrefix(prefix_ids, prefix_real, torch.tensor(row_group)))


def micro_batches(batch: TrainBatch, size: int, pad_id: int, dtype: torch.dtype, *, max_tokens: int = 0,
                  pack: bool = False, topk: tuple[int, int] | None = None,
                  image: tuple[int, int] | None = None, share_prefix: bool = False) -> list[MicroBatch]:
    """``plan_micro_batches`` then ``collate`` each group (``size``: sequences per micro-batch);
    ``share_prefix``: ``collate_shared`` where a group's sequences share a prompt (not with
    packing, routing replay or images), and no micro-batch mixes sequences whose first
    ``MIN_COMMON_PREFIX`` tokens differ (the order of the sequences is kept)."""
    if share_prefix and (pack or topk is not None or image is not None):
        raise ValueError("share_prefix works without packing, routing replay and image inputs only")
    lengths = [len(s) for s in batch.token_ids]
    prompts = [tuple(ids[:m.index(1)]) if 1 in m else None for ids, m in zip(batch.token_ids, batch.loss_mask)]
    if share_prefix and len(set(prompts)) == len(prompts):
        # No two sequences share a whole prompt (SFT): only a common prefix can be shared, so no
        # micro-batch may straddle two system prompts (domains). (GRPO groups are planned as they
        # come: splitting there would only cut their micro-batches smaller.)
        def head(i: int) -> tuple[int, ...] | None:  # what a common prefix would start with (None: too short)
            m = batch.loss_mask[i]
            short = len(m) < MIN_COMMON_PREFIX or any(m[:MIN_COMMON_PREFIX])
            return None if short else tuple(batch.token_ids[i][:MIN_COMMON_PREFIX])
        runs: list[list[int]] = []
        for i in range(len(batch)):
            if not runs or head(i) != head(runs[-1][-1]):
                runs.append([])
            runs[-1].append(i)
        plan = [[run[j] for j in g] for run in runs
                for g in plan_micro_batches([lengths[i] for i in run], max_tokens, size, pack)]
    else:
        plan = plan_micro_batches(lengths, max_tokens, size, pack)
    out = []
    for g in plan:
        part = batch.select(g)
        mb = collate_shared(part, pad_id, dtype) if share_prefix else None
        out.append(mb if mb is not None else collate(part, pack, pad_id, dtype, topk, image))
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
    return torch.cat([picked_BT.new_zeros(picked_BT.shape[0], 1), picked_BT], dim=1)


def token_logprobs(model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """``logprobs_from_logits`` of one forward pass of ``model``; [B, T]."""
    logits_BTV = model(input_ids_BT, position_ids=position_ids(attention_mask_BT), attention_mask=attention_mask_BT).logits
    return logprobs_from_logits(logits_BTV, input_ids_BT, temperature)
