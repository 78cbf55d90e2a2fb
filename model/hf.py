"""Hugging Face checkpoints: `load_hf` reads Qwen3-MoE, Mixtral, OLMoE and kimi_linear directories; `save_hf`
writes `tiny_moe`-shaped models as plain Qwen3-MoE, sharded with an index (local files only, no hub).

A directory is what `transformers.AutoModelForCausalLM.from_pretrained(dir)` reads: `config.json`
plus `model.safetensors` (or sharded `model.safetensors.index.json`). Per architecture:

| model_type | attention q/k-norm        | router                          | checkpoint keys we rewrite        |
|------------|---------------------------|---------------------------------|-----------------------------------|
| qwen3_moe  | per head (`qk_norm=head`) | softmax, `norm_topk_prob`       | —                                 |
| mixtral    | none                      | softmax, always renormalised    | `block_sparse_moe.` → `mlp.`; w1/w3/w2 → gate/up/down_proj |
| olmoe      | over all heads (`full`)   | softmax, `norm_topk_prob`       | —                                 |
| kimi_linear| none (KDA and MLA layers)  | sigmoid + bias, groups, shared  | as mixtral; KDA: q/k/v_conv1d → conv1d, f_a/f_b/dt_bias/A_log → forget_gate |
| gpt_oss    | none (sinks, sliding)     | softmax + bias over top-k       | router → gate; experts: MXFP4 blocks+scales, gate/up de-interleaved (model/hf_gpt_oss.py) |

kimi_linear's `full_attention` layers are MLA (model/mla.py, NoPE as Kimi-Linear's; `mla_use_nope` False is a
ValueError); `save_kimi_linear` writes a kda / mla model back as kimi_linear.

transformers 5.x holds experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I])
but `save_pretrained` writes the hub's per-expert layout (`experts.{e}.{gate,up,down}_proj.weight`,
Mixtral's `experts.{e}.w1/w3/w2`); both load. A config field we do not implement is a ValueError
naming it; so are missing, unexpected or mis-shaped tensors. MXFP4 export: `rl/export.py`, through
`save_hf`'s `tensors` hook.
"""

from __future__ import annotations

import json
import mmap
import re
from pathlib import Path
from collections.abc import Callable, Iterable
from typing import Any

import torch
from safetensors.torch import save_file

from jointrl.model import hf_gpt_oss
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
    if model_type == "gpt_oss":
        return hf_gpt_oss.config_from_gpt_oss(d)
    if model_type not in _ARCHS:
        raise ValueError(f"unsupported model_type {model_type!r}; "
                         f"supported: {['qwen3_moe', 'kimi_linear', 'gpt_oss', *_ARCHS]}")
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


SHARD_BYTES = 4 << 30  # save_hf's default shard payload bound (transformers' default is 5 GB)


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
_KIMI_FIELDS.update({k: k for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                     "v_head_dim")})
# Derived or unused by Kimi-Linear's NoPE MLA (model/mla.py): qk_head_dim = nope + rope dims, head_dim =
# rope dim in transformers' config; the RoPE keys are in the hub's config.json but nothing rotates.
_KIMI_IGNORED = frozenset({"qk_head_dim", "head_dim", "rope_parameters", "rope_theta", "rope_scaling"})
_KIMI_KINDS = {"linear_attention": "kda", "full_attention": "mla"}


def _kimi_linear_config(d: dict[str, Any]) -> MoEConfig:
    """A kimi_linear config: KDA and MLA layers, sigmoid router with groups, shared expert, dense first layers."""
    d = {k: v for k, v in d.items() if k != "model_type"}
    for key, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("attention_dropout", 0.0),
                         ("pretraining_tp", 1), ("moe_router_activation_func", "sigmoid"), ("moe_layer_freq", 1),
                         ("mla_use_nope", True)):
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
    if kinds is None:  # transformers' default: full attention every 4th layer from layer 4
        kinds = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(L)]
    if any(k not in _KIMI_KINDS for k in kinds):
        raise ValueError(f"unsupported kimi_linear config field layer_types={kinds!r}; allowed entries: "
                         f"{sorted(_KIMI_KINDS)}")
    mlp = d.pop("mlp_layer_types", None)
    k_dense = d.pop("first_k_dense_replace", 1) if mlp is None else mlp.count("dense")
    if mlp is not None and mlp != ["dense"] * k_dense + ["sparse"] * (L - k_dense):
        raise ValueError(f"unsupported kimi_linear config field mlp_layer_types={mlp!r}; allowed: "
                         "'dense' for the first layers, then 'sparse'")
    unknown = sorted(k for k in d if k not in _KIMI_FIELDS and k not in _KIMI_IGNORED and k not in _HF_IGNORED_KEYS)
    if unknown:
        raise ValueError(f"unsupported kimi_linear config field(s) {unknown}")
    fields = {_KIMI_FIELDS[k]: v for k, v in d.items() if k in _KIMI_FIELDS}
    if fields.get("num_key_value_heads") is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if "full_attention" in kinds and fields["num_key_value_heads"] != fields["num_attention_heads"]:
        raise ValueError(f"unsupported kimi_linear config field num_key_value_heads={fields['num_key_value_heads']}; "
                         f"allowed with full_attention (MLA) layers: num_attention_heads={fields['num_attention_heads']}")
    fields.update(layer_types=tuple(_KIMI_KINDS[k] for k in kinds), scoring_func="sigmoid",
                  first_k_dense_replace=k_dense,
                  head_dim=2 * max(1, fields["hidden_size"] // fields["num_attention_heads"] // 2))  # unused: no full layers
    return MoEConfig(**fields)


def kimi_linear_misfit(config: MoEConfig) -> str | None:
    """Why `config` cannot be written as a kimi_linear checkpoint (a layer kind other than kda / mla, softmax
    routing, a shared-expert gate, ...), or None when it can."""
    bad = sorted(set(config.kinds) - {"kda", "mla"})
    if bad:
        return f"layer_types has {bad}; Kimi-Linear holds only 'kda' and 'mla'"
    need = {"scoring_func": "sigmoid", "shared_expert_gate": False, "linear_lower_bound": None,
            "attn_output_gate": False, "image_patch_dim": 0}
    for name, value in need.items():
        if getattr(config, name) != value:
            return f"MoEConfig.{name}={getattr(config, name)!r}; allowed: {value!r}"
    if config.is_gpt_oss:
        return "gpt-oss options are set; Kimi-Linear has none"
    if "mla" in config.kinds and config.num_key_value_heads != config.num_attention_heads:
        return (f"MoEConfig.num_key_value_heads={config.num_key_value_heads}; MLA layers need it equal to "
                f"num_attention_heads={config.num_attention_heads} (transformers' KimiLinearAttention)")
    return None


def kimi_linear_hf_dict(config: MoEConfig) -> dict[str, Any]:
    """`config` as a kimi_linear config.json (transformers' `KimiLinearConfig` names); ValueError names what
    Kimi-Linear cannot hold (`kimi_linear_misfit`)."""
    misfit = kimi_linear_misfit(config)
    if misfit is not None:
        raise ValueError(f"kimi_linear export: {misfit}")
    L = config.num_hidden_layers
    return {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size, "num_hidden_layers": L,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size, "moe_intermediate_size": config.moe_intermediate_size,
        "num_local_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
        "n_shared_experts": config.n_shared_experts, "n_group": config.n_group, "topk_group": config.topk_group,
        "norm_topk_prob": config.norm_topk_prob, "routed_scaling_factor": config.routed_scaling_factor,
        "rms_norm_eps": config.rms_norm_eps, "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.initializer_range, "router_aux_loss_coef": config.router_aux_loss_coef,
        "max_position_embeddings": config.max_position_embeddings,
        "kv_lora_rank": config.kv_lora_rank, "q_lora_rank": config.q_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim, "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim, "linear_num_heads": config.linear_num_heads,
        "linear_head_dim": config.linear_head_dim, "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
        "layer_types": [{"kda": "linear_attention", "mla": "full_attention"}[k] for k in config.kinds],
        "mlp_layer_types": ["dense" if i < config.first_k_dense_replace else "sparse" for i in range(L)],
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }


def save_kimi_linear(model: MoETransformer, directory: str | Path, max_shard_bytes: int = SHARD_BYTES) -> Path:
    """Write a kda / mla model as a kimi_linear checkpoint (`kimi_linear_hf_dict` + sharded safetensors in
    transformers' in-memory names: fused experts, one KDA `conv1d`, `forget_gate.*`), which both
    `KimiLinearForCausalLM.from_pretrained` and `load_hf` read."""
    out = Path(directory)
    config = kimi_linear_hf_dict(model.config)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    config["dtype"] = str(state["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_shards(((k, v.detach().to("cpu").contiguous()) for k, v in state.items()
                  if not (model.config.tie_word_embeddings and k == "lm_head.weight")), out, max_shard_bytes)
    return out


def save_hf(model: MoETransformer, directory: str | Path, max_shard_bytes: int = SHARD_BYTES,
            tensors: Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]] | None = None,
            config_extra: dict[str, Any] | None = None) -> Path:
    """Write `config.json` + sharded safetensors with `model.safetensors.index.json` (the model's
    dtype; tied lm_head stored once). Tensors go to disk shard by shard: at most one shard's
    tensors (each at most `max_shard_bytes`, unless one tensor alone is larger) are held at once.

    `tensors(name, tensor)`: what to store for one state-dict entry (default: itself); the MXFP4
    export stores routed experts as per-expert packed tensors through it. `config_extra` is
    merged into config.json (e.g. `quantization_config`).

    Only Qwen3-MoE-shaped configs: `MoEConfig.to_hf_dict` names any field Qwen3-MoE cannot hold."""
    out = Path(directory)
    config = model.config.to_hf_dict()
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    config["dtype"] = str(state["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    config.update(config_extra or {})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    each = tensors or (lambda name, t: [(name, t)])
    items = ((k, v.detach().to("cpu").contiguous()) for name, t in state.items()
             if not (model.config.tie_word_embeddings and name == "lm_head.weight") for k, v in each(name, t))
    write_shards(items, out, max_shard_bytes)
    return out


def write_shards(items: Iterable[tuple[str, torch.Tensor]], out: Path, max_shard_bytes: int) -> list[str]:
    """Write `(name, tensor)`s in order into `model-0000i-of-0000n.safetensors` files of at most
    `max_shard_bytes` each plus `model.safetensors.index.json` (transformers' layout); returns the
    shard names. Earlier single-file or sharded weights in `out` are removed first."""
    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    names: list[str] = []
    weight_map: dict[str, int] = {}
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            names.append(f"model-{len(names) + 1:05d}.partial.safetensors")
            save_file(shard, out / names[-1], metadata={"format": "pt"})
            shard, size = {}, 0

    for name, t in items:
        n = t.numel() * t.element_size()
        if shard and size + n > max_shard_bytes:
            flush()
        shard[name], size, total = t, size + n, total + n
        weight_map[name] = len(names)
    flush()
    final = [f"model-{i + 1:05d}-of-{len(names):05d}.safetensors" for i in range(len(names))]
    for partial, name in zip(names, final, strict=True):
        (out / partial).rename(out / name)
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[i] for k, i in weight_map.items()}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return final


def load_hf(directory: str | Path, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
            ep_rank: int = 0, ep_size: int = 1, config: MoEConfig | None = None) -> MoETransformer:
    """Load a Qwen3-MoE, Mixtral, OLMoE, gpt-oss or kimi_linear checkpoint directory; `dtype` None
    keeps the stored dtype (gpt-oss's MXFP4 experts are dequantized into it, one tensor at a time).

    Streams: the model is built on the meta device, each tensor is then allocated once in its
    final dtype and device, and filled tensor by tensor from the `*.safetensors` files (read
    through `safe_open`, which maps them), so peak anonymous memory is about one copy of the
    weights plus the largest tensor read. Per-expert hub tensors go straight into their rows of
    the fused `gate_up_proj` / `down_proj`.

    `ep_size > 1`: the routed experts hold only this rank's rows `[ep_rank·E/ep_size,
    (ep_rank+1)·E/ep_size)` (the other experts are never read); the model then runs only under
    `rl/learner/expert_parallel.shard_experts`.

    `config`: build with this instead of config.json's (the run's, whose shape `model/pretrained.fill_shape`
    took from config.json; it may differ in training knobs such as `router_aux_loss_coef`).

    Raises ValueError naming an unsupported model_type or config field, missing/unexpected keys or
    a mis-shaped tensor.
    """
    src = Path(directory)
    raw = json.loads((src / "config.json").read_text())
    config = config_from_hf(raw) if config is None else config
    E = config.num_experts
    if ep_size < 1 or not 0 <= ep_rank < ep_size or E % ep_size:
        raise ValueError(f"load_hf: ep_rank={ep_rank}, ep_size={ep_size}: ep_size must divide num_experts={E}")
    lo, n_local = ep_rank * E // ep_size, E // ep_size
    shards = shard_files(src)
    rewrites = _KEY_REWRITES.get(raw.get("model_type"), [])
    gpt_oss = raw.get("model_type") == "gpt_oss"
    with torch.device("meta"):
        model = MoETransformer(config)
    if dtype is None:
        dtype = _stored_dtype(shards)
    targets = _materialise(model, dtype, device, n_local)
    filled = dict.fromkeys(targets, 0)
    unexpected: list[str] = []
    fetch = _fetcher(src, shards) if gpt_oss else None
    for shard in shards:
        with SafetensorsFile(shard) as f:
            for key, name, entry in _entries(f, rewrites, fetch, dtype):
                if config.tie_word_embeddings and name == "lm_head.weight":
                    continue
                place = _place(name, targets, config.moe_intermediate_size, lo, n_local)
                if place is None:
                    unexpected.append(name)
                    continue
                dest, index, rows = place
                if rows is None:
                    continue  # another rank's expert
                t = entry[rows]
                view = targets[dest][index]
                if t.shape != view.shape:
                    raise ValueError(f"checkpoint {src}: {key} has shape {tuple(t.shape)}, expected {tuple(view.shape)}")
                view.copy_(t)
                filled[dest] += t.numel()
    missing = sorted(k for k, n in filled.items() if n != targets[k].numel())
    if missing or unexpected:
        raise ValueError(f"checkpoint {src} does not match MoEConfig: missing {missing}, unexpected {sorted(unexpected)}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _entries(f: SafetensorsFile, rewrites: list[tuple[re.Pattern[str], str]],
             fetch: Callable[[str], torch.Tensor] | None, dtype: torch.dtype):
    """(checkpoint key, our name, tensor) for each entry of one shard: names rewritten; with `fetch`
    (gpt-oss) through `hf_gpt_oss.checkpoint_tensors`, which dequantizes MXFP4 experts into `dtype`."""
    for key in f.keys():
        if fetch is not None:
            for name, t in hf_gpt_oss.checkpoint_tensors(key, f.get(key), fetch, dtype):
                yield key, name, t
            continue
        name = key
        for pattern, replacement in rewrites:
            name = pattern.sub(replacement, name)
        yield key, name, f.get(key)


def _fetcher(src: Path, shards: list[Path]) -> Callable[[str], torch.Tensor]:
    """key → a copy of that tensor, from whichever shard holds it (the MXFP4 scales beside their blocks)."""
    index = src / "model.safetensors.index.json"
    where = ({k: src / v for k, v in json.loads(index.read_text())["weight_map"].items()} if index.exists()
             else dict.fromkeys(_keys(shards[0]), shards[0]))

    def fetch(key: str) -> torch.Tensor:
        with SafetensorsFile(where[key]) as g:
            return g.get(key).clone()
    return fetch


def _keys(shard: Path) -> list[str]:
    with SafetensorsFile(shard) as f:
        return f.keys()


def save_gpt_oss(model: MoETransformer, directory: str | Path, mxfp4: bool = True,
                 max_shard_bytes: int = SHARD_BYTES) -> Path:
    """Write a gpt-oss-shaped model in gpt-oss's checkpoint layout (model/hf_gpt_oss.py), sharded with an
    index: routed experts as MXFP4 `_blocks` + `_scales` with the hub's `quantization_config` (`mxfp4`),
    else transformers' unquantized [E, H, 2I] / [E, I, H]; everything else in the model's dtype."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = hf_gpt_oss.gpt_oss_hf_dict(model.config)
    state = model.state_dict()
    config["dtype"] = str(state["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    if mxfp4:
        config["quantization_config"] = hf_gpt_oss.quantization_config()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    items = ((k, v.detach().to("cpu").contiguous()) for name, t in state.items()
             if not (model.config.tie_word_embeddings and name == "lm_head.weight")
             for k, v in hf_gpt_oss.export_tensors(name, t, mxfp4))
    write_shards(items, out, max_shard_bytes)
    return out


def shard_files(src: Path) -> list[Path]:
    """The checkpoint's safetensors files: the index's shards in name order, else `model.safetensors`."""
    index = src / "model.safetensors.index.json"
    if index.exists():
        return [src / s for s in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = src / "model.safetensors"
    if not single.exists():
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {src}")
    return [single]


def _stored_dtype(shards: list[Path]) -> torch.dtype:
    for shard in shards:
        with SafetensorsFile(shard) as f:
            if "model.embed_tokens.weight" in f.keys():
                return f.get("model.embed_tokens.weight").dtype
    raise ValueError(f"no model.embed_tokens.weight in {[s.name for s in shards]}")


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class SafetensorsFile:
    """One `.safetensors` file, mapped privately: `get(key)` is a tensor viewing the mapped
    bytes (no copy; pages are read from the file when touched and count as file-backed, not
    anonymous, memory). Views must not outlive the `with` block."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> "SafetensorsFile":
        with open(self.path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            self.header = {k: v for k, v in json.loads(fh.read(n)).items() if k != "__metadata__"}
            self.start = 8 + n
            self.map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        return self

    def __exit__(self, *exc) -> None:
        self.map.close()

    def keys(self) -> list[str]:
        return list(self.header)

    def get(self, key: str) -> torch.Tensor:
        info = self.header[key]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: {key} has dtype {info['dtype']}, which load_hf does not read")
        dtype, (a, b) = _DTYPES[info["dtype"]], info["data_offsets"]
        if a == b:
            return torch.empty(info["shape"], dtype=dtype)
        flat = torch.frombuffer(self.map, dtype=dtype, count=(b - a) // dtype.itemsize, offset=self.start + a)
        return flat.view(info["shape"])


def _materialise(model: MoETransformer, dtype: torch.dtype, device, n_local: int) -> dict[str, torch.Tensor]:
    """Replace every meta parameter/buffer by an empty tensor (routed experts: `n_local` rows);
    returns state-dict name -> tensor (tied `lm_head.weight` left out)."""
    targets: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        shape = list(t.shape)
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            shape[0] = n_local
        # The selection bias stays at least float32 (see TopKRouter._apply), as transformers keeps it.
        kind = torch.promote_types(dtype, torch.float32) if name.endswith("e_score_correction_bias") else dtype
        new = torch.empty(shape, dtype=kind, device=device)
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(t, torch.nn.Parameter):
            setattr(module, attr, torch.nn.Parameter(new, requires_grad=t.requires_grad))
        else:
            module._buffers[attr] = new
        targets[name] = new
    return targets


def _place(name: str, targets: dict[str, torch.Tensor], inter: int, lo: int, n_local: int):
    """Where checkpoint tensor `name` goes: (param, index into it, rows to read) -- rows None: not
    this rank's expert; slice(None): the whole tensor. None: no such parameter."""
    m = _PER_EXPERT.match(name)
    if m is not None:
        e = int(m[2]) - lo
        if not 0 <= e < n_local:
            return f"{m[1]}.down_proj", (), None
        part = {"gate": (slice(0, inter),), "up": (slice(inter, 2 * inter),), "down": ()}[m[3]]
        dest = f"{m[1]}.{'down_proj' if m[3] == 'down' else 'gate_up_proj'}"
        return (dest, (e, *part), slice(None)) if dest in targets else None
    m = _CONV.match(name)
    if m is not None:
        dest = f"{m[1]}.conv1d.weight"
        if dest not in targets:
            return None
        k, n = "qkv".index(m[2]), targets[dest].shape[0] // 3
        return dest, (slice(k * n, (k + 1) * n),), slice(None)
    if name not in targets:
        return None
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # the fused 5.x layout
        return name, (), slice(lo, lo + n_local)
    return name, (), slice(None)
