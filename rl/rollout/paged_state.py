"""``PagedState``: the model's ``AttentionState`` for one sequence, over the engine's paged pools.

Used for the layer kinds without a ragged form (``StateSpec.ragged`` false: ``ModelRunner`` runs each such
layer's own forward per sequence group over it, inside its one loop over the layers): each layer kind declares what it keeps (its mixer's ``state_spec``,
``model.state.StateSpec``) and calls only those methods, so a new kind plugs in without a change here
or in the runner. Per-token keys/values (``update``), indexer keys (``update_index``) and MLA latents
(``update_latent``) live in the runner's paged pools at the sequence's block-table slots; a fixed-size state (``recurrent`` /
``set_recurrent``: KDA's conv window [3NK, W-1] and delta state [N, K, K], or any tuple of batch-first
tensors a kind stores) lives on the ``Sequence`` itself, so it travels with a session and is dropped
with it (its bytes do not grow with the context: ``model.state.state_layout``).

``DecodeBatchState`` is the same store for B sequences that each decode one token, so a step's
decodes run as one batched forward: keys are gathered left-padded to the longest context
(``attention_mask`` marks the padding, which the model's full and gated-DSA layers mask out),
the fixed-size states are stacked in and split back out.
"""

from __future__ import annotations

import torch

from jointrl.rl.rollout.sequence import Sequence


class PagedState:
    def __init__(self, runner, seq: Sequence, num_new: int) -> None:
        self.runner, self.seq = runner, seq
        bs, c = runner.bs, seq.num_computed
        pos = torch.arange(c + num_new, device=runner.device)  # index tensors on the pools' device
        self.slots_S = torch.tensor(seq.block_table, device=runner.device)[pos // bs] * bs + pos % bs  # every position's slot
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

    def update_latent(self, layer: int, c_BTD: torch.Tensor) -> torch.Tensor:
        c_PD = self.runner.latent_LPD[self.runner.latent_pool[layer]]
        c_PD.index_copy_(0, self.new_slots, c_BTD[0].to(c_PD.dtype))
        return c_PD.index_select(0, self.slots_S)[None]

    def recurrent(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        return self.seq.recurrent.get(layer)

    def set_recurrent(self, layer: int, *state: torch.Tensor) -> None:
        self.seq.recurrent[layer] = state

    def advance(self, num_tokens: int) -> None:
        pass  # the engine advances Sequence.num_computed after the step


class DecodeBatchState:
    """``AttentionState`` for B decoding sequences (one new token each) at once; see the module docstring.

    ``attention_mask_BS`` [B, S] and ``position_ids_B1`` are what the model's forward needs with it;
    S = the longest context + 1, and ``length`` = S - 1 (the padded past)."""

    def __init__(self, runner, seqs: list[Sequence]) -> None:
        self.runner, self.seqs = runner, seqs
        bs, dev = runner.bs, runner.device  # index tensors on the pools' device
        ctx = [s.num_computed for s in seqs]
        S = max(ctx) + 1
        self.S = S
        pos_BS = torch.arange(S, device=dev)[None, :] - torch.tensor([S - 1 - c for c in ctx], device=dev)[:, None]  # left padding
        self.attention_mask_BS = pos_BS >= 0
        pos_BS = pos_BS.clamp_min(0)
        width = -(-S // bs)
        table_BM = torch.tensor([s.block_table[:width] + [0] * (width - len(s.block_table[:width])) for s in seqs],
                                device=dev)
        self.slots_BS = table_BM.gather(1, pos_BS // bs) * bs + pos_BS % bs  # padding reads slot of position 0
        self.new_slots_B = self.slots_BS[:, -1].contiguous()
        self.position_ids_B1 = torch.tensor(ctx, device=dev)[:, None]

    @property
    def batch(self) -> int:
        return len(self.seqs)

    @property
    def length(self) -> int:
        return self.S - 1

    def update(self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv_PCHD = self.runner.kv_LPCHD[self.runner.pool_index[layer]]
        kv_PCHD.index_copy_(0, self.new_slots_B, torch.stack((k_BHTD[:, :, 0], v_BHTD[:, :, 0]), dim=1))
        B, (_, _, H, D) = self.batch, kv_PCHD.shape
        kv_BSCHD = kv_PCHD.index_select(0, self.slots_BS.reshape(-1)).view(B, self.S, 2, H, D)
        return kv_BSCHD[:, :, 0].transpose(1, 2), kv_BSCHD[:, :, 1].transpose(1, 2)

    def update_index(self, layer: int, k_BTD: torch.Tensor) -> torch.Tensor:
        ik_PD = self.runner.index_LPD[self.runner.index_pool[layer]]
        ik_PD.index_copy_(0, self.new_slots_B, k_BTD[:, 0].to(ik_PD.dtype))
        return ik_PD.index_select(0, self.slots_BS.reshape(-1)).view(self.batch, self.S, -1)

    def update_latent(self, layer: int, c_BTD: torch.Tensor) -> torch.Tensor:
        c_PD = self.runner.latent_LPD[self.runner.latent_pool[layer]]
        c_PD.index_copy_(0, self.new_slots_B, c_BTD[:, 0].to(c_PD.dtype))
        return c_PD.index_select(0, self.slots_BS.reshape(-1)).view(self.batch, self.S, -1)

    def recurrent(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        states = [s.recurrent[layer] for s in self.seqs]  # decoding: every sequence has run this layer
        return tuple(torch.cat(parts) for parts in zip(*states, strict=True))

    def set_recurrent(self, layer: int, *state: torch.Tensor) -> None:
        for b, seq in enumerate(self.seqs):  # copies: a session keeps only its own state's bytes
            seq.recurrent[layer] = tuple(t[b:b + 1].clone() for t in state)

    def advance(self, num_tokens: int) -> None:
        pass
