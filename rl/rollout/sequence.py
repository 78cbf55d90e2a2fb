"""``Sequence``: one request's token stream and its place in the paged KV cache.

A sequence lives across the turns of a trajectory (a *session*): when a turn ends it goes
idle with its blocks still held, and the next turn -- a prompt that extends its tokens --
adopts it and prefills only the new tokens. ``num_computed`` counts the leading positions
whose keys/values are in the cache; the tokens after it are prefilled (in chunks) or, for
the last sampled token, fed by the next decode step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from jointrl.rl.types import GenerationOutput, SamplingParams


class Status(enum.Enum):
    WAITING = enum.auto()   # queued for (re-)prefill: holds no blocks
    RUNNING = enum.auto()   # holds blocks, scheduled every step
    IDLE = enum.auto()      # a finished turn keeping its blocks for the session's next turn


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    stops: frozenset[int]
    gen: torch.Generator | None
    out: GenerationOutput
    waiter: Any = None                 # what the engine resolves with ``out`` when the turn ends
    status: Status = Status.WAITING
    num_computed: int = 0              # positions with keys/values in the cache
    block_table: list[int] = field(default_factory=list)
    chain: list[int] = field(default_factory=list)  # content hash of each full block (prefix chain)
    num_registered: int = 0            # leading full blocks offered to the prefix cache
    cache_version: int = 0             # weights that computed block 0 (the prefix-cache key's root)
    last_used: float = 0.0             # monotonic time the session went idle
    routed: torch.Tensor | None = None  # [capacity, L, k] ROUTE_DTYPE expert ids per position (-1: not run here)
    routed_from: int = -1              # first position this turn ran through the model
    recurrent: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)  # layer -> its fixed-size state
    images: torch.Tensor | None = None  # [P, patch_dim]: a row per <image> id of the prompt (slot_patches' rule)
    image_keys: dict[int, int] = field(default_factory=dict)  # position of an <image> id -> digest of its row

    def __len__(self) -> int:
        return len(self.token_ids)

    def record_routes(self, routes_nLk: torch.Tensor) -> None:
        """Store the experts of the n positions this step ran (from ``num_computed`` on) in
        ``routed``, grown by doubling (amortised O(1) a token); earlier positions keep theirs."""
        start, end = self.num_computed, self.num_computed + len(routes_nLk)
        if self.routed is None or len(self.routed) < end:
            have = 0 if self.routed is None else len(self.routed)
            grown = routes_nLk.new_full((max(end, 2 * have, len(self.token_ids)), *routes_nLk.shape[1:]), -1)
            if self.routed is not None:
                grown[:have] = self.routed
            self.routed = grown
        self.routed[start:end] = routes_nLk
        self.routed_from = start if self.routed_from < 0 else min(self.routed_from, start)

    @property
    def num_new(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.token_ids) - self.num_computed
