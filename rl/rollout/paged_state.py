"""``PagedState``: the model's ``AttentionState`` for one sequence, over the engine's paged pools.

Used for models with ``kda`` / ``gated_dsa`` layers (``ModelRunner`` runs them one sequence
per forward, through the model's own layers): keys/values of ``full`` and ``gated_dsa``
layers and the indexer keys of ``gated_dsa`` layers live in the runner's paged pools at the
sequence's block-table slots; the fixed-size KDA state (conv window [3NK, W-1] and delta
state [N, K, K] per layer) lives on the ``Sequence`` itself, so it travels with a session and
is dropped with it (its bytes do not grow with the context: ``model.state.state_layout``).
"""

from __future__ import annotations

import torch

from jointrl.rl.rollout.sequence import Sequence


class PagedState:
    def __init__(self, runner, seq: Sequence, num_new: int) -> None:
        self.runner, self.seq = runner, seq
        bs, c = runner.bs, seq.num_computed
        pos = torch.arange(c + num_new)
        self.slots_S = torch.tensor(seq.block_table)[pos // bs] * bs + pos % bs  # every position's slot
        self.new_slots = self.slots_S[c:]
        if c == 0:
            seq.recurrent = {}

    @property
    def batch(self) -> int:
        return 1

    @property
    def length(self) -> int:
        return self.seq.num_computed

    def update(self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv_PCHD = self.runner.kv_LPCHD[self.runner.pool_index[layer]]
        kv_PCHD.index_copy_(0, self.new_slots, torch.stack((k_BHTD[0], v_BHTD[0]), dim=0).permute(2, 0, 1, 3))
        kv_SCHD = kv_PCHD.index_select(0, self.slots_S)
        return kv_SCHD[None, :, 0].transpose(1, 2), kv_SCHD[None, :, 1].transpose(1, 2)

    def update_index(self, layer: int, k_BTD: torch.Tensor) -> torch.Tensor:
        ik_PD = self.runner.index_LPD[self.runner.index_pool[layer]]
        ik_PD.index_copy_(0, self.new_slots, k_BTD[0].to(ik_PD.dtype))
        return ik_PD.index_select(0, self.slots_S)[None]

    def recurrent(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.seq.recurrent.get(layer, (None, None))

    def set_recurrent(self, layer: int, conv_BCw: torch.Tensor, state_BNKV: torch.Tensor) -> None:
        self.seq.recurrent[layer] = (conv_BCw, state_BNKV)

    def advance(self, num_tokens: int) -> None:
        pass  # the engine advances Sequence.num_computed after the step
