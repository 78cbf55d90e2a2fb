"""`KVCache`: growing contiguous per-layer attention state for batched sampling on one device.

Implements `model.state.AttentionState` for every layer kind: keys/values (after q/k-norm and RoPE,
model dtype, [B, kv_heads, S, head_dim]) for `full` and `gated_dsa` layers, indexer keys [B, S, Di]
for `gated_dsa`, the latent [B, S, kv_lora_rank + qk_rope_head_dim] for `mla`, and the fixed-size conv window + delta state for `kda`. The per-token stores grow
by concatenation: simple and autograd-safe, O(S²) copies over a generation, which is fine at test
and CPU scale; the rollout engine's paged store replaces it at scale. Which cached positions are
padding is the caller's business: pass `attention_mask` [B, S] (past + new tokens) to every forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jointrl.model.config import MoEConfig
from jointrl.model.norm import compute_dtype


@dataclass(slots=True)
class KVCache:
    keys: list[torch.Tensor | None]    # per layer [B, kv_heads, S, head_dim]; None for kda layers
    values: list[torch.Tensor | None]  # per layer [B, kv_heads, S, head_dim]; None for kda layers
    index_keys: list[torch.Tensor | None]        # gated_dsa layers: [B, S, index_head_dim]
    conv_states: list[torch.Tensor | None]       # kda layers: [B, 3·N·K, W−1], model dtype
    recurrent_states: list[torch.Tensor | None]  # kda layers: [B, N, K, K], compute dtype
    batch: int
    latents: list[torch.Tensor | None] | None = None  # mla layers: [B, S, kv_lora_rank + qk_rope_head_dim]
    length: int = 0  # tokens consumed; advanced by the model once per forward

    @classmethod
    def empty(cls, config: MoEConfig, batch: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> KVCache:
        def per_kind(kinds: tuple[str, ...], shape: tuple[int, ...], dt: torch.dtype) -> list[torch.Tensor | None]:
            return [torch.zeros(shape, dtype=dt, device=device) if k in kinds else None for k in config.kinds]
        kv = (batch, config.num_key_value_heads, 0, config.head_dim)
        N, K, W = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
        return cls(keys=per_kind(("full", "gated_dsa", "sliding"), kv, dtype),
                   values=per_kind(("full", "gated_dsa", "sliding"), kv, dtype),
                   index_keys=per_kind(("gated_dsa",), (batch, 0, config.index_head_dim), dtype),
                   conv_states=per_kind(("kda",), (batch, 3 * N * K, W - 1), dtype),
                   recurrent_states=per_kind(("kda",), (batch, N, K, K), compute_dtype(dtype)),
                   batch=batch,
                   latents=per_kind(("mla",), (batch, 0, config.kv_lora_rank + config.qk_rope_head_dim), dtype))

    def update(self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys/values for `layer`; return the full [B, kv_heads, S+T, D] pair."""
        if self.keys[layer] is None:
            raise ValueError(f"layer {layer} keeps no keys/values (a kda or mla layer)")
        if k_BHTD.shape[0] != self.batch or k_BHTD.dtype != self.keys[layer].dtype:
            raise ValueError(f"KVCache holds batch {self.batch} in {self.keys[layer].dtype}; got keys of "
                             f"batch {k_BHTD.shape[0]} in {k_BHTD.dtype}")
        self.keys[layer] = torch.cat((self.keys[layer], k_BHTD), dim=2)
        self.values[layer] = torch.cat((self.values[layer], v_BHTD), dim=2)
        return self.keys[layer], self.values[layer]

    def update_index(self, layer: int, k_BTD: torch.Tensor) -> torch.Tensor:
        """Append this step's indexer keys for a gated_dsa `layer`; return all [B, S+T, Di]."""
        if self.index_keys[layer] is None:
            raise ValueError(f"layer {layer} keeps no indexer keys (not a gated_dsa layer)")
        self.index_keys[layer] = torch.cat((self.index_keys[layer], k_BTD.to(self.index_keys[layer].dtype)), dim=1)
        return self.index_keys[layer]

    def update_latent(self, layer: int, c_BTD: torch.Tensor) -> torch.Tensor:
        """Append this step's latents for an mla `layer`; return all [B, S+T, kv_lora_rank + qk_rope_head_dim]."""
        if self.latents is None or self.latents[layer] is None:
            raise ValueError(f"layer {layer} keeps no latent (not an mla layer)")
        self.latents[layer] = torch.cat((self.latents[layer], c_BTD.to(self.latents[layer].dtype)), dim=1)
        return self.latents[layer]

    def recurrent(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.conv_states[layer], self.recurrent_states[layer]

    def set_recurrent(self, layer: int, conv_BCw: torch.Tensor, state_BNKV: torch.Tensor) -> None:
        if self.conv_states[layer] is None:
            raise ValueError(f"layer {layer} keeps no recurrent state (not a kda layer)")
        self.conv_states[layer] = conv_BCw
        self.recurrent_states[layer] = state_BNKV

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens
