"""The engine-facing attention state: what a forward reads and writes per layer, and what it costs.

A sequence's state has two parts, by layer kind:

- `full` and `gated_dsa` layers keep **per-token** keys and values (post-norm, post-RoPE), which a
  paged engine stores in fixed-size blocks; `gated_dsa` also keeps one indexer key per token.
- `mla` layers keep one **per-token latent** of `kv_lora_rank + qk_rope_head_dim` values (the normed
  compressed key-value latent and the shared key part), not the expanded heads (model/mla.py).
- `kda` layers keep a **fixed-size** state: the conv window (the last W−1 projected [q; k; v] inputs)
  and the delta-rule matrix S per head, whatever the context length.

Bytes per sequence of T tokens (b = bytes of the model dtype, s = bytes of the state dtype, float32
for a bf16/fp32 model; `state_bytes_per_sequence` computes it):

    Σ_{full, gated_dsa layers} T · 2·Hkv·D·b  +  Σ_{gated_dsa layers} T · Di·b  +  Σ_{mla layers} T · (R + Dr)·b
  + Σ_{kda layers} (3·N·K·(W−1)·b + N·K·K·s)

with Hkv/D the key-value heads and head dim, Di the indexer head dim, R/Dr MLA's `kv_lora_rank` and
`qk_rope_head_dim`, N/K the KDA heads and head
dim, W the conv width. A paged engine rounds T up to its block size for the per-token part.

`AttentionState` is the protocol the layers call; `model.kv_cache.KVCache` implements it with
growing contiguous tensors (the skeleton sampler and the exactness tests). A paged store for the
engine (issue #5) implements the same methods over its block tables and state slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from jointrl.model.config import MoEConfig
from jointrl.model.norm import compute_dtype


@dataclass(frozen=True, slots=True)
class StateSpec:
    """What one layer kind keeps per sequence (its token mixer's ``state_spec``), and so which of
    ``AttentionState``'s methods it calls: a cache (``KVCache``, the engine's paged state) provides the
    parts each layer declares, and the engine sizes its pools from the declarations, not from kind names.
    A new kind (a sliding window, attention sinks, another recurrence) declares its parts and calls only
    those methods; a window or sinks are the layer's own masking over the keys ``update`` returns."""

    keys_values: bool = False  # per-token keys and values: ``update``
    index_dim: int = 0         # per-token indexer keys of this width: ``update_index``
    latent_dim: int = 0        # per-token latent of this width (MLA): ``update_latent``
    fixed: bool = False        # a fixed-size state (tensors of any shapes, batch first): ``recurrent`` / ``set_recurrent``
    # the kind runs on the engine's flat, ragged batch (every sequence's new tokens in one call, its
    # ``paged(h_NH, step)`` method, model/paged.py) over the engine's pools; else the engine runs it per
    # sequence through its ``forward`` over a ``PagedState``
    ragged: bool = False


class AttentionState(Protocol):
    """Per-layer state for one batch of sequences; layers call it in layer order during a forward."""

    @property
    def batch(self) -> int:
        """Sequences held (the forward's B)."""

    @property
    def length(self) -> int:
        """Tokens already consumed (the position of the next token), read before a forward."""

    def update(self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' keys/values; return all of them, [B, Hkv, S, D] each."""

    def update_index(self, layer: int, k_BTD: torch.Tensor) -> torch.Tensor:
        """Append the new tokens' indexer keys; return all of them, [B, S, Di]."""

    def update_latent(self, layer: int, c_BTD: torch.Tensor) -> torch.Tensor:
        """Append the new tokens' latents (MLA: [normed kv latent; shared key part]); return all, [B, S, Dl]."""

    def recurrent(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """The layer's fixed-size state as it last stored it (each tensor batch first), or None before its
        first store (the layer starts from zeros). KDA's: (conv window [B, 3NK, W−1], delta state [B, N, K, K])."""

    def set_recurrent(self, layer: int, *state: torch.Tensor) -> None:
        """Store the layer's fixed-size state after the new tokens (each tensor batch first)."""

    def advance(self, num_tokens: int) -> None:
        """Called once by the model after every layer consumed `num_tokens` new tokens."""


@dataclass(frozen=True, slots=True)
class StateBytes:
    """A sequence's attention state: `per_token` bytes grow with its length, `fixed` bytes do not."""

    per_token: int
    fixed: int

    def total(self, num_tokens: int) -> int:
        return self.per_token * num_tokens + self.fixed


def state_layout(config: MoEConfig, dtype: torch.dtype = torch.bfloat16) -> StateBytes:
    """The formula of the module docstring, for a model run in `dtype`."""
    b = torch.empty((), dtype=dtype).element_size()
    s = torch.empty((), dtype=compute_dtype(dtype)).element_size()
    per_token = fixed = 0
    for kind in config.kinds:
        if kind in ("full", "gated_dsa", "sliding"):  # sliding: kept whole (the window is a mask)
            per_token += 2 * config.num_key_value_heads * config.head_dim * b
        if kind == "gated_dsa":
            per_token += config.index_head_dim * b
        if kind == "mla":
            per_token += (config.kv_lora_rank + config.qk_rope_head_dim) * b
        if kind == "kda":
            N, K, W = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
            fixed += 3 * N * K * (W - 1) * b + N * K * K * s
    return StateBytes(per_token=per_token, fixed=fixed)


def state_bytes_per_sequence(config: MoEConfig, num_tokens: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of attention state one sequence of `num_tokens` tokens holds (see the module docstring)."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return state_layout(config, dtype).total(num_tokens)
