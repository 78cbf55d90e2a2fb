"""Hugging Face checkpoints: `load_hf` reads Qwen3-MoE, Mixtral, OLMoE and kimi_linear directories; `save_hf`
writes `tiny_moe`-shaped models as plain Qwen3-MoE (local files only, no hub).

A directory is what `transformers.AutoModelForCausalLM.from_pretrained(dir)` reads: `config.json`
plus `model.safetensors` (or sharded `model.safetensors.index.json`). Per architecture:

| model_type | attention q/k-norm        | router                          | checkpoint keys we rewrite        |
|------------|---------------------------|---------------------------------|-----------------------------------|
| qwen3_moe  | per head (`qk_norm=head`) | softmax, `norm_topk_prob`       | —                                 |
| mixtral    | none                      | softmax, always renormalised    | `block_sparse_moe.` → `mlp.`; w1/w3/w2 → gate/up/down_proj |
| olmoe      | over all heads (`full`)   | softmax, `norm_topk_prob`       | —                                 |
| kimi_linear| (KDA layers only)         | sigmoid + bias, groups, shared  | as mixtral; KDA: q/k/v_conv1d → conv1d, f_a/f_b/dt_bias/A_log → forget_gate |

kimi_linear's full-attention layers are MLA, which we do not implement: only all-KDA checkpoints
load (a `full_attention` layer is a ValueError naming `layer_types`).

transformers 5.x holds experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I])
but `save_pretrained` writes the hub's per-expert layout (`experts.{e}.{gate,up,down}_proj.weight`,
Mixtral's `experts.{e}.w1/w3/w2`); both load. A config field we do not implement is a ValueError
naming it; so are missing, unexpected or mis-shaped tensors. MXFP4 export is a later issue.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from jointrl.model.config import _HF_IGNORED_KEYS, MoEConfig
from jointrl.model.moe_transformer import MoETransformer

_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")

# Per model_type: HF key → MoEConfig field, MoEConfig fields the architecture implies, HF keys whose
# only supported value is the given one, and HF class defaults for keys a config.json may omit.
_ARCHS: dict[str, dict[str, dict[str, Any]]] = {
    "mixtral": {
        "rename": {"intermediate_size": "moe_intermediate_size", "num_local_experts": "num_experts"},
        "implied": {"norm_topk_prob": True, "qk_norm": "none"},
        "required": {"hidden_act": "silu", "sliding_window": None, "attention_dropout": 0.0,
                     "router_jitter_noise": 0.0, "rope_scaling": None},
        "defaults": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                     "num_experts_per_tok": 2, "num_local_experts": 8, "router_aux_loss_coef": 0.001},
    },
    "olmoe": {
        "rename": {"intermediate_size": "moe_intermediate_size"},
        "implied": {"qk_norm": "full"},
        "required": {"hidden_act": "silu", "attention_bias": False, "clip_qkv": None,
                     "attention_dropout": 0.0, "rope_scaling": None},
        "defaults": {"vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048,
                     "num_hidden_layers": 16, "num_attention_heads": 16, "max_position_embeddings": 4096,
                     "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "num_experts_per_tok": 8,
                     "num_experts": 64, "router_aux_loss_coef": 0.01, "norm_topk_prob": False},
    },
}
_KEY_REWRITES: dict[str, list[tuple[re.Pattern[str], str]]] = {
    "mixtral": [(re.compile(r"\.block_sparse_moe\."), ".mlp."),
                (re.compile(r"(\.experts\.\d+)\.w1\.weight$"), r"\1.gate_proj.weight"),
                (re.compile(r"(\.experts\.\d+)\.w3\.weight$"), r"\1.up_proj.weight"),
                (re.compile(r"(\.experts\.\d+)\.w2\.weight$"), r"\1.down_proj.weight")],
    "kimi_linear": [(re.compile(r"\.self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)\b"), r".self_attn.forget_gate.\1")],
}
_KEY_REWRITES["kimi_linear"] += _KEY_REWRITES["mixtral"]
_CONV = re.compile(r"^(model\.layers\.\d+\.self_attn)\.(q|k|v)_conv1d\.weight$")


def config_from_hf(d: dict[str, Any]) -> MoEConfig:
    """MoEConfig from a config.json dict of a supported `model_type` (see the module docstring)."""
    model_type = d.get("model_type")
    if model_type == "qwen3_moe":
        return MoEConfig.from_hf_dict(d)
    if model_type == "kimi_linear":
        return _kimi_linear_config(d)
    if model_type not in _ARCHS:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {['qwen3_moe', 'kimi_linear', *_ARCHS]}")
    arch = _ARCHS[model_type]
    d = {**arch["defaults"], **{k: v for k, v in d.items() if k != "model_type"}}
    for key, allowed in arch["required"].items():
        value = d.pop(key, allowed)
        if value != allowed:
            raise ValueError(f"unsupported {model_type} config field {key}={value!r}; allowed: {allowed!r}")
    rope = d.pop("rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or set(rope) - {"rope_type", "rope_theta"}:
        raise ValueError(f"unsupported {model_type} config field rope_parameters={rope!r}; "
                         "allowed: {'rope_type': 'default', 'rope_theta': float}")
    d["rope_theta"] = rope.get("rope_theta", d["rope_theta"])
    if d.get("num_key_value_heads") is None:
        d["num_key_value_heads"] = d["num_attention_heads"]
    head_dim = d["hidden_size"] // d["num_attention_heads"]  # HF's fallback when head_dim is absent
    if d.get("head_dim") is None:
        d["head_dim"] = head_dim
    elif model_type == "olmoe" and d["head_dim"] != head_dim:  # its q_norm is sized hidden_size
        raise ValueError(f"unsupported olmoe config field head_dim={d['head_dim']}; allowed: hidden_size // "
                         f"num_attention_heads = {head_dim}")
    fields: dict[str, Any] = {arch["rename"].get(k, k): v for k, v in d.items()}
    names = set(MoEConfig.__dataclass_fields__) - {"intermediate_size"}
    unknown = sorted(k for k, v in d.items() if arch["rename"].get(k, k) not in names and k not in _HF_IGNORED_KEYS)
    if unknown:
        raise ValueError(f"unsupported {model_type} config field(s) {unknown}")
    fields = {k: v for k, v in fields.items() if k in names}
    fields.update(arch["implied"])
    # The dense-MLP width is unused (every layer is MoE); record the active expert width.
    fields["intermediate_size"] = fields["num_experts_per_tok"] * fields["moe_intermediate_size"]
    return MoEConfig(**fields)


# kimi_linear config.json key (hub or transformers name) → MoEConfig field.
_KIMI_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size", "moe_intermediate_size": "moe_intermediate_size",
    "num_experts": "num_experts", "num_local_experts": "num_experts",
    "num_experts_per_token": "num_experts_per_tok", "num_experts_per_tok": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts", "n_shared_experts": "n_shared_experts",
    "num_expert_group": "n_group", "n_group": "n_group", "topk_group": "topk_group",
    "moe_renormalize": "norm_topk_prob", "norm_topk_prob": "norm_topk_prob",
    "routed_scaling_factor": "routed_scaling_factor", "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings", "initializer_range": "initializer_range",
    "router_aux_loss_coef": "router_aux_loss_coef", "model_max_length": "max_position_embeddings",
    "max_position_embeddings": "max_position_embeddings", "linear_num_heads": "linear_num_heads",
    "linear_head_dim": "linear_head_dim", "linear_conv_kernel_dim": "linear_conv_kernel_dim",
}
# Fields only full-attention (MLA) layers read; meaningless in an all-KDA model.
_KIMI_MLA_KEYS = frozenset({"kv_lora_rank", "q_lora_rank", "qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim",
                            "v_head_dim", "head_dim", "rope_parameters", "rope_theta", "rope_scaling",
                            "mla_use_nope"})


def _kimi_linear_config(d: dict[str, Any]) -> MoEConfig:
    """An all-KDA kimi_linear config: KDA layers, sigmoid router with groups, shared and dense layers."""
    d = {k: v for k, v in d.items() if k != "model_type"}
    for key, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("attention_dropout", 0.0),
                         ("pretraining_tp", 1), ("moe_router_activation_func", "sigmoid"), ("moe_layer_freq", 1)):
        value = d.pop(key, allowed)
        if value != allowed and value is not None:
            raise ValueError(f"unsupported kimi_linear config field {key}={value!r}; allowed: {allowed!r}")
    linear = dict(d.pop("linear_attn_config", None) or {})
    for key, field in (("num_heads", "linear_num_heads"), ("head_dim", "linear_head_dim"),
                       ("short_conv_kernel_size", "linear_conv_kernel_dim")):
        if key in linear:
            d.setdefault(field, linear[key])
    L = d["num_hidden_layers"]
    kinds = d.pop("layer_types", None)
    if kinds is None and "kda_layers" in linear:  # the hub lists 1-indexed layers
        kinds = ["linear_attention" if i + 1 in linear["kda_layers"] else "full_attention" for i in range(L)]
    if kinds is None or any(k != "linear_attention" for k in kinds):
        raise ValueError(f"unsupported kimi_linear config field layer_types={kinds!r}: full_attention layers "
                         "are MLA, which jointrl does not implement; allowed: every layer 'linear_attention'")
    mlp = d.pop("mlp_layer_types", None)
    k_dense = d.pop("first_k_dense_replace", 1) if mlp is None else mlp.count("dense")
    if mlp is not None and mlp != ["dense"] * k_dense + ["sparse"] * (L - k_dense):
        raise ValueError(f"unsupported kimi_linear config field mlp_layer_types={mlp!r}; allowed: "
                         "'dense' for the first layers, then 'sparse'")
    unknown = sorted(k for k in d if k not in _KIMI_FIELDS and k not in _KIMI_MLA_KEYS and k not in _HF_IGNORED_KEYS)
    if unknown:
        raise ValueError(f"unsupported kimi_linear config field(s) {unknown}")
    fields = {_KIMI_FIELDS[k]: v for k, v in d.items() if k in _KIMI_FIELDS}
    if fields.get("num_key_value_heads") is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    fields.update(layer_types=("kda",) * L, scoring_func="sigmoid", first_k_dense_replace=k_dense,
                  head_dim=2 * max(1, fields["hidden_size"] // fields["num_attention_heads"] // 2))  # unused: no full layers
    return MoEConfig(**fields)


def _fuse_kda_conv(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """kimi_linear's `q_conv1d`, `k_conv1d`, `v_conv1d` [NK, 1, W] → our `conv1d` [3NK, 1, W] (q, k, v)."""
    convs: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        m = _CONV.match(key)
        if m is None:
            out[key] = tensor
        else:
            convs.setdefault(m[1], {})[m[2]] = tensor
    for prefix, parts in convs.items():
        if set(parts) != {"q", "k", "v"}:
            raise ValueError(f"{prefix}: q/k/v_conv1d weights are incomplete")
        out[f"{prefix}.conv1d.weight"] = torch.cat((parts["q"], parts["k"], parts["v"]))
    return out


def save_hf(model: MoETransformer, directory: str | Path) -> Path:
    """Write `config.json` + `model.safetensors` (the model's dtype; tied lm_head stored once).

    Only Qwen3-MoE-shaped configs: `MoEConfig.to_hf_dict` names any field Qwen3-MoE cannot hold."""
    out = Path(directory)
    config = model.config.to_hf_dict()
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    config["dtype"] = str(state["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def load_hf(directory: str | Path, dtype: torch.dtype | None = None,
            device: torch.device | str | None = None) -> MoETransformer:
    """Load a Qwen3-MoE, Mixtral, OLMoE or (all-KDA) kimi_linear checkpoint directory; `dtype` None keeps the stored dtype.

    Raises ValueError naming an unsupported model_type or config field, or missing/unexpected keys.
    """
    src = Path(directory)
    raw = json.loads((src / "config.json").read_text())
    config = config_from_hf(raw)
    state = _read_safetensors(src)
    for pattern, replacement in _KEY_REWRITES.get(raw.get("model_type"), []):
        state = {pattern.sub(replacement, k): v for k, v in state.items()}
    state = _fuse_kda_conv(_fuse_per_expert(state))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        if "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = MoETransformer(config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint {src} does not match MoEConfig: missing {missing}, unexpected {unexpected}")
    for key, shape in ((k, v.shape) for k, v in model.state_dict().items()):
        if state[key].shape != shape:
            raise ValueError(f"checkpoint {src}: {key} has shape {tuple(state[key].shape)}, expected {tuple(shape)}")
    if dtype is None:
        dtype = state["model.embed_tokens.weight"].dtype
    # The selection bias stays at least float32 (see TopKRouter._apply), as transformers keeps it.
    state = {k: v.to(device=device, dtype=torch.promote_types(dtype, torch.float32)
                     if k.endswith("e_score_correction_bias") else dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _read_safetensors(src: Path) -> dict[str, torch.Tensor]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(src / shard))
        return state
    single = src / "model.safetensors"
    if not single.exists():
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {src}")
    return load_file(single)


def _fuse_per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`experts.{e}.gate/up/down_proj.weight` → `experts.gate_up_proj` [E, 2I, H] (gate rows first)
    and `experts.down_proj` [E, H, I]; other keys unchanged."""
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    fused: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        m = _PER_EXPERT.match(key)
        if m is None:
            fused[key] = tensor
        else:
            groups.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = tensor
    for prefix, parts in groups.items():
        n = len(parts.get("gate", {}))
        if any(sorted(parts.get(p, {})) != list(range(n)) for p in ("gate", "up", "down")):
            raise ValueError(f"{prefix}: per-expert gate/up/down weights are incomplete")
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat((parts["gate"][e], parts["up"][e])) for e in range(n)])
        fused[f"{prefix}.down_proj"] = torch.stack([parts["down"][e] for e in range(n)])
    return fused
