"""gpt-oss checkpoints (`model_type: gpt_oss`): config.json ↔ `MoEConfig`, and checkpoint tensors ↔ our
state dict (model/gpt_oss.py gives the math and our layout). model/hf.py's `load_hf` / `save_gpt_oss` use these.

Checkpoint layout (OpenAI's hub files and transformers' `GptOssForCausalLM`):

| checkpoint key (`model.layers.N.` …)        | shape                 | ours                                      |
|---------------------------------------------|-----------------------|-------------------------------------------|
| `mlp.router.weight` / `.bias`               | [E, H] / [E]          | `mlp.gate.weight` / `.bias`               |
| `mlp.experts.gate_up_proj_blocks`           | uint8 [E, 2I, H/32, 16] | `mlp.experts.gate_up_proj` [E, 2I, H]   |
| `mlp.experts.gate_up_proj_scales`           | uint8 [E, 2I, H/32]   |   (E8M0, with the blocks)                 |
| `mlp.experts.gate_up_proj` (unquantized)    | [E, H, 2I]            |   (transposed)                            |
| `mlp.experts.gate_up_proj_bias`             | [E, 2I]               | `mlp.experts.gate_up_proj_bias`           |
| `mlp.experts.down_proj_blocks` / `_scales`  | uint8 [E, H, I/32, 16] / [E, H, I/32] | `mlp.experts.down_proj` [E, H, I] |
| `mlp.experts.down_proj` (unquantized)       | [E, I, H]             |   (transposed)                            |

The checkpoint's 2I axis interleaves gate and up (gate = rows 0, 2, 4, …; up = 1, 3, 5, …); ours holds
the I gate rows then the I up rows, so rows are permuted both ways. MXFP4 blocks run along the input
dim (H for gate_up, I for down), as ours do (kernels/mxfp4.py: 32 elements per E8M0 scale, element
2j in the low nibble): blocks are `quantize_mxfp4`'s [.., K/2] bytes viewed [.., K/32, 16]. Loading
dequantizes one tensor at a time into the model's dtype (no float copy on disk); saving quantizes with
the push's rule (`floor`), so a checkpoint our quantizer wrote comes back bit for bit (a block decoded
to floats and re-encoded keeps its bytes: its largest element decodes to 4·2^e or 6·2^e, which gives
the same shared exponent e).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from jointrl.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from jointrl.model.config import _HF_IGNORED_KEYS, MoEConfig

SCALE_RULE = "floor"  # the weight push's rule (rl/weight_sync.py)
_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
    "head_dim": "head_dim", "intermediate_size": "moe_intermediate_size", "num_local_experts": "num_experts",
    "num_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok", "experts_per_token": "num_experts_per_tok",
    "rms_norm_eps": "rms_norm_eps", "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings", "router_aux_loss_coef": "router_aux_loss_coef",
    "initializer_range": "initializer_range", "sliding_window": "attention_window", "swiglu_limit": "swiglu_limit",
    "swiglu_alpha": "swiglu_alpha", "attention_bias": "attention_bias",
}
# transformers' GptOssConfig defaults, for keys a config.json may omit.
_DEFAULTS = {"num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
             "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
             "sliding_window": 128, "tie_word_embeddings": False, "initializer_range": 0.02,
             "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_experts_per_tok": 4,
             "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001, "attention_bias": True}
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_ROPE_KEYS = {"rope_type", "rope_theta", "factor", "beta_fast", "beta_slow", "truncate", "original_max_position_embeddings"}
_KINDS = {"sliding_attention": "sliding", "full_attention": "full"}
_IGNORED = frozenset({"initial_context_length", "rope_theta", "rope_scaling", "rope_parameters", "layer_types"})


def config_from_gpt_oss(d: dict[str, Any]) -> MoEConfig:
    """MoEConfig of a gpt_oss config.json (hub or transformers 5.x spelling); a ValueError names any
    field we do not implement."""
    d = {**_DEFAULTS, **{k: v for k, v in d.items() if k != "model_type"}}
    for key, allowed in (("hidden_act", "silu"), ("attention_dropout", 0.0)):
        value = d.pop(key, allowed)
        if value != allowed:
            raise ValueError(f"unsupported gpt_oss config field {key}={value!r}; allowed: {allowed!r}")
    unknown = sorted(k for k in d if k not in _FIELDS and k not in _IGNORED and k not in _HF_IGNORED_KEYS)
    if unknown:
        raise ValueError(f"unsupported gpt_oss config field(s) {unknown}")
    L = d["num_hidden_layers"]
    kinds = d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    if any(k not in _KINDS for k in kinds):
        raise ValueError(f"unsupported gpt_oss config field layer_types={kinds!r}; allowed: {list(_KINDS)}")
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or _DEFAULT_ROPE)
    if set(rope) - _ROPE_KEYS or rope.get("rope_type", "default") not in ("default", "yarn"):
        raise ValueError(f"unsupported gpt_oss config field rope_parameters={rope!r}; allowed keys {sorted(_ROPE_KEYS)}, "
                         "rope_type 'default' or 'yarn'")
    fields = {_FIELDS[k]: v for k, v in d.items() if k in _FIELDS}
    yarn = rope.get("rope_type", "default") == "yarn"
    fields.update(
        layer_types=tuple(_KINDS[k] for k in kinds), rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 150000.0))),
        rope_type="yarn" if yarn else "default", qk_norm="none", norm_topk_prob=True, attention_sinks=True,
        router_bias=True, intermediate_size=fields["num_experts_per_tok"] * fields["moe_intermediate_size"])
    if "sliding" not in fields["layer_types"]:
        fields["attention_window"] = None
    if yarn:
        fields.update(rope_factor=float(rope["factor"]),
                      rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                      rope_beta_fast=float(rope.get("beta_fast") or 32.0), rope_beta_slow=float(rope.get("beta_slow") or 1.0),
                      rope_truncate=bool(rope.get("truncate", True)))
    if fields.get("num_key_value_heads") is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    return MoEConfig(**fields)


def gpt_oss_hf_dict(config: MoEConfig) -> dict[str, Any]:
    """config.json body (transformers' `GptOssConfig` fields) for a gpt-oss-shaped MoEConfig."""
    fixed = {"qk_norm": "none", "norm_topk_prob": True, "attention_sinks": True, "router_bias": True,
             "scoring_func": "softmax", "n_shared_experts": 0, "first_k_dense_replace": 0, "n_group": 1,
             "routed_scaling_factor": 1.0, "attn_output_gate": False, "image_patch_dim": 0}
    bad = {k: getattr(config, k) for k, v in fixed.items() if getattr(config, k) != v}
    if bad or config.swiglu_limit is None or any(k not in ("full", "sliding") for k in config.kinds):
        raise ValueError(f"not a gpt-oss-shaped MoEConfig: {bad or 'swiglu_limit None or other layer kinds'}")
    rope: dict[str, Any] = {"rope_type": config.rope_type, "rope_theta": float(config.rope_theta)}
    if config.rope_type == "yarn":
        rope.update(factor=config.rope_factor, beta_fast=config.rope_beta_fast, beta_slow=config.rope_beta_slow,
                    truncate=config.rope_truncate, original_max_position_embeddings=config.rope_original_max_position_embeddings)
    back = {v: k for k, v in _FIELDS.items() if k not in ("num_experts", "experts_per_token")}
    d = {hf: getattr(config, ours) for ours, hf in back.items()}
    d.update(model_type="gpt_oss", architectures=["GptOssForCausalLM"], hidden_act="silu", attention_dropout=0.0,
             layer_types=[{"sliding": "sliding_attention", "full": "full_attention"}[k] for k in config.kinds],
             rope_parameters=rope, sliding_window=config.attention_window)
    return d


def _deinterleave(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows g0 u0 g1 u1 … along `dim` → g0 g1 … u0 u1 …"""
    pairs = x.unflatten(dim, (-1, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim=dim)


def _interleave(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `_deinterleave`: g0 g1 … u0 u1 … → g0 u0 g1 u1 …"""
    gate, up = x.chunk(2, dim=dim)
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


def checkpoint_tensors(key: str, tensor: torch.Tensor, fetch: Callable[[str], torch.Tensor], dtype: torch.dtype
                       ) -> list[tuple[str, torch.Tensor]]:
    """One checkpoint entry → (our state-dict name, tensor in our layout) pairs (module docstring);
    `_scales` entries give none (read through `fetch(key)` with their blocks)."""
    if key.endswith("_scales"):
        return []
    head, _, leaf = key.rpartition(".")
    if head.endswith(".mlp.router"):
        return [(f"{head[:-len('router')]}gate.{leaf}", tensor)]
    if not head.endswith(".mlp.experts"):
        return [(key, tensor)]
    if leaf.endswith("_blocks"):
        proj = leaf.removesuffix("_blocks")
        blocks = tensor.flatten(-2)  # [E, out, K/32, 16] → [E, out, K/2]
        value = dequantize_mxfp4(blocks, fetch(f"{head}.{proj}_scales"), dtype=dtype)
        return [(f"{head}.{proj}", _deinterleave(value, 1) if proj == "gate_up_proj" else value)]
    if leaf == "gate_up_proj":
        return [(f"{head}.gate_up_proj", _deinterleave(tensor.transpose(1, 2), 1))]
    if leaf == "down_proj":
        return [(f"{head}.down_proj", tensor.transpose(1, 2))]
    if leaf == "gate_up_proj_bias":
        return [(f"{head}.gate_up_proj_bias", _deinterleave(tensor, 1))]
    return [(key, tensor)]


def export_tensors(name: str, tensor: torch.Tensor, mxfp4: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Inverse of `checkpoint_tensors`: our state-dict entry → the checkpoint's entries; experts as MXFP4
    blocks + scales (`mxfp4`) or transformers' unquantized [E, H, 2I] / [E, I, H]."""
    head, _, leaf = name.rpartition(".")
    if head.endswith(".mlp.gate"):
        yield f"{head[:-len('gate')]}router.{leaf}", tensor
    elif head.endswith(".mlp.experts") and leaf in ("gate_up_proj", "down_proj"):
        value = _interleave(tensor, 1) if leaf == "gate_up_proj" else tensor
        if mxfp4:
            blocks, scales = quantize_mxfp4(value.detach().to("cpu"), SCALE_RULE)
            yield f"{name}_blocks", blocks.unflatten(-1, (-1, 16))
            yield f"{name}_scales", scales
        else:
            yield name, value.transpose(1, 2)
    elif head.endswith(".mlp.experts") and leaf == "gate_up_proj_bias":
        yield name, _interleave(tensor, 1)
    else:
        yield name, tensor


def quantization_config() -> dict[str, Any]:
    """The hub's gpt-oss `quantization_config`: routed experts MXFP4, everything else unquantized."""
    return {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                 "model.embed_tokens", "lm_head"]}
