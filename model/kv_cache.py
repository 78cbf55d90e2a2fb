"""`KVCache`: a growing per-layer key/value store for batched sampling on one device.

Keys are stored after q/k-norm and RoPE, in the model dtype, as [B, kv_heads, S, head_dim].
The store grows by concatenation: simple and autograd-safe, O(S²) copies over a generation,
which is fine at test and CPU scale; the rollout engine's paged cache replaces it at scale.
Which cached positions are padding is the caller's business: pass `attention_mask` [B, S]
(past + new tokens) to every forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jointrl.model.config import MoEConfig


@dataclass(slots=True)
class KVCache:
    keys: list[torch.Tensor]    # per layer [B, kv_heads, S, head_dim]
    values: list[torch.Tensor]  # per layer [B, kv_heads, S, head_dim]

    @classmethod
    def empty(cls, config: MoEConfig, batch: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> KVCache:
        shape = (batch, config.num_key_value_heads, 0, config.head_dim)
        n = config.num_hidden_layers
        return cls(keys=[torch.empty(shape, dtype=dtype, device=device) for _ in range(n)],
                   values=[torch.empty(shape, dtype=dtype, device=device) for _ in range(n)])

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def length(self) -> int:
        """Number of cached positions S (read before a forward appends; layers grow in turn)."""
        return self.keys[0].shape[2]

    def update(self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys/values for `layer`; return the full [B, kv_heads, S+T, D] pair."""
        if k_BHTD.shape[0] != self.batch or k_BHTD.dtype != self.keys[layer].dtype:
            raise ValueError(f"KVCache holds batch {self.batch} in {self.keys[layer].dtype}; got keys of "
                             f"batch {k_BHTD.shape[0]} in {k_BHTD.dtype}")
        self.keys[layer] = torch.cat((self.keys[layer], k_BHTD), dim=2)
        self.values[layer] = torch.cat((self.values[layer], v_BHTD), dim=2)
        return self.keys[layer], self.values[layer]
