"""`MoEConfig`: the shape of the MoE transformer, with transformers' Qwen3-MoE field names.

Field names follow `transformers.Qwen3MoeConfig` so that `to_hf_dict()` / `from_hf_dict()` are a
rename-free round trip and a `tiny_moe`-shaped checkpoint loads in plain transformers. The hybrid's
attention fields take their names from transformers' `kimi_linear` (KDA: `linear_*`) and
`deepseek_v32` (indexer: `index_*`); they stay out of the Qwen3-MoE dict while every layer is `full`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# The byte tokenizer: 256 byte ids followed by the chat template's special tokens.
BYTE_VOCAB_SIZE = 256 + 8

LAYER_TYPES = ("full", "kda", "gated_dsa", "sliding", "mla")
# MoEConfig fields of the hybrid's attention: not Qwen3-MoE fields, so `to_hf_dict` leaves them out.
HYBRID_FIELDS = ("layer_types", "attn_output_gate", "linear_num_heads", "linear_head_dim",
                 "linear_conv_kernel_dim", "linear_lower_bound", "kda_chunk_size", "index_n_heads",
                 "index_head_dim", "index_topk", "dsa_mode", "dsa_query_chunk", "image_patch_dim",
                 "image_token_id", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim")
# gpt-oss's attention, FFN and RoPE options (model/gpt_oss.py), with the value that turns each off: a
# config with any other value is a gpt-oss-family model, exported by model/gpt_oss.save_gpt_oss.
GPT_OSS_VALUES: dict[str, Any] = {
    "attention_bias": False, "attention_sinks": False, "attention_window": None, "router_bias": False,
    "swiglu_limit": None, "swiglu_alpha": 1.702, "rope_type": "default", "rope_factor": 1.0,
    "rope_original_max_position_embeddings": 4096, "rope_beta_fast": 32.0, "rope_beta_slow": 1.0,
    "rope_truncate": True}
ROPE_TYPES = ("default", "yarn")

# MoE options beyond Qwen3-MoE, with the value that makes them Qwen3-MoE: `to_hf_dict` requires
# exactly these values and leaves the fields out; `from_hf_dict` rejects them as Qwen3-MoE fields.
# (`first_k_dense_replace` is Qwen3-MoE's `mlp_only_layers` = [0, ..., k-1].)
QWEN3_MOE_VALUES: dict[str, Any] = {
    "n_shared_experts": 0, "shared_expert_gate": False,
    "scoring_func": "softmax", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "qk_norm": "head"}
SCORING_FUNCS = ("softmax", "sigmoid")
QK_NORMS = ("head", "full", "none")

# Keys of a Hugging Face config.json that carry no model math (bookkeeping, generation defaults,
# fields of PreTrainedConfig that every model has). `from_hf_dict` ignores exactly these; any other
# key it does not map is an error, so a checkpoint feature we do not implement never loads silently.
_HF_IGNORED_KEYS = frozenset({
    "architectures", "auto_map", "transformers_version", "_name_or_path", "name_or_path",
    "dtype", "torch_dtype", "use_cache", "output_router_logits", "output_hidden_states",
    "output_attentions", "return_dict", "bos_token_id", "eos_token_id", "pad_token_id",
    "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
    "tokenizer_class", "max_window_layers", "sliding_window", "num_labels", "quantization_config",
    "generation_config", "task_specific_params", "finetuning_task", "prefix", "sep_token_id",
    "decoder_start_token_id", "tie_encoder_decoder", "add_cross_attention", "is_decoder",
})


@dataclass(slots=True)
class MoEConfig:
    """Decoder-only MoE transformer shaped like Qwen3-MoE.

    Every layer: pre-norm RMSNorm → GQA attention (q_norm/k_norm over head_dim before RoPE) →
    residual → RMSNorm → MoE FFN (softmax router over all experts, top-k, renormalised when
    `norm_topk_prob`; SwiGLU experts; no shared expert) → residual. No biases anywhere.
    """

    vocab_size: int = BYTE_VOCAB_SIZE
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    moe_intermediate_size: int = 32
    num_experts: int = 4
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = 0.001
    initializer_range: float = 0.02
    # ---- MoE FFN and router (model/moe.py, model/routing.py); DeepSeek-V3 field names ----
    intermediate_size: int = 64           # width of the dense SwiGLU MLP of the first layers (HF's name)
    first_k_dense_replace: int = 0        # layers 0..k-1 use that dense MLP instead of MoE (DeepSeek-V3)
    n_shared_experts: int = 0             # always-on SwiGLU expert of width n·moe_intermediate_size
    shared_expert_gate: bool = False      # shared output scaled by sigmoid(x·w_g) (Qwen2-MoE style)
    scoring_func: str = "softmax"         # router scores: "softmax" (Qwen3, Mixtral, OLMoE) or "sigmoid"
    n_group: int = 1                      # sigmoid routing picks experts only inside the best
    topk_group: int = 1                   #   topk_group of n_group expert groups (DeepSeek-V3)
    routed_scaling_factor: float = 1.0    # routed experts' weights times this (after norm_topk_prob)
    qk_norm: str = "head"                 # "head": RMSNorm per head (Qwen3); "full": over all heads (OLMoE); "none"
    # ---- hybrid attention (model/attention.py, kda.py, dsa.py) ----
    # One kind per layer: "full" (GQA + RoPE), "kda" (Kimi Delta Attention), "gated_dsa" (indexer
    # top-k sparse attention with a sigmoid output gate). None = every layer "full" (Qwen3-MoE).
    layer_types: tuple[str, ...] | None = None
    attn_output_gate: bool = False      # sigmoid output gate on "full" layers ("gated_dsa" always has one)
    linear_num_heads: int = 4           # KDA heads
    linear_head_dim: int = 16           # KDA key = value head dim
    linear_conv_kernel_dim: int = 4     # KDA short causal conv width
    linear_lower_bound: float | None = None  # KDA safe gate: g = lb·sigmoid(exp(A_log)·(f + dt_bias)), lb < 0
    kda_chunk_size: int = 64            # KDA chunked form: tokens per chunk
    index_n_heads: int = 4              # DSA lightning-indexer heads
    index_head_dim: int = 16            # DSA indexer head dim (RoPE over all of it)
    index_topk: int = 32                # DSA keys attended per query
    dsa_mode: str = "sparse"            # "sparse": attend the indexer's top-k; "dense": all keys (warm-up)
    dsa_query_chunk: int = 256          # DSA queries scored per chunk: prefill memory O(chunk · S)
    # "mla" layers (model/mla.py): Kimi-Linear's multi-head latent attention, transformers' field names.
    kv_lora_rank: int = 32              # width of the compressed key-value latent (what the cache keeps)
    q_lora_rank: int | None = None      # None: q_proj; else q_a_proj → RMSNorm → q_b_proj through this rank
    qk_nope_head_dim: int = 16          # per-head key/query part expanded from the latent
    qk_rope_head_dim: int = 8           # key part shared by all heads, stored beside the latent (no rotation: NoPE)
    v_head_dim: int = 16                # per-head value dim expanded from the latent
    # ---- optional image input (model/image.py): patch features → Linear → the <image> slots ----
    image_patch_dim: int = 0            # features per patch (C·p·p); 0 = text only, no image_proj
    image_token_id: int = BYTE_VOCAB_SIZE - 1  # the byte tokenizer's `<image>`
    # ---- gpt-oss (model/gpt_oss.py); the defaults (GPT_OSS_VALUES) turn each option off ----
    attention_bias: bool = False        # biases on q/k/v/o projections
    attention_sinks: bool = False       # a learned logit per head in every softmax denominator
    attention_window: int | None = None  # keys a "sliding" layer's query sees (itself included)
    router_bias: bool = False           # router logits x Wᵀ + b
    swiglu_limit: float | None = None   # experts: clamped SwiGLU with biases, (up+1)·g·σ(α g); None: plain SwiGLU
    swiglu_alpha: float = 1.702         #   its α
    rope_type: str = "default"          # "default" or "yarn" (NTK-by-parts, Peng et al. 2023)
    rope_factor: float = 1.0            # YaRN: context extension factor s
    rope_original_max_position_embeddings: int = 4096  # YaRN: the pre-extension context
    rope_beta_fast: float = 32.0        # YaRN: ramp bounds (rotations)
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True          # YaRN: round the ramp bounds to integers

    def __post_init__(self) -> None:
        if self.layer_types is not None:
            if isinstance(self.layer_types, str) or not all(isinstance(t, str) for t in self.layer_types):
                raise ValueError(f"MoEConfig.layer_types must be a list of strings, got {self.layer_types!r}")
            self.layer_types = tuple(self.layer_types)  # lists from YAML/JSON compare equal to presets
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"MoEConfig.layer_types has unknown kind(s) {bad}; allowed: {list(LAYER_TYPES)}")
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"MoEConfig.layer_types has {len(self.layer_types)} entries, "
                                 f"num_hidden_layers is {self.num_hidden_layers}")
        for name in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "kda_chunk_size",
                     "index_n_heads", "index_head_dim", "index_topk", "dsa_query_chunk", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        q = self.q_lora_rank
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1):
            raise ValueError(f"MoEConfig.q_lora_rank must be None or a positive int, got {q!r}")
        if self.index_head_dim % 2:
            raise ValueError(f"MoEConfig.index_head_dim must be even for RoPE, got {self.index_head_dim}")
        if self.linear_lower_bound is not None and (
                isinstance(self.linear_lower_bound, bool) or not self.linear_lower_bound < 0):
            raise ValueError(f"MoEConfig.linear_lower_bound must be None or < 0, got {self.linear_lower_bound!r}")
        if isinstance(self.image_patch_dim, bool) or not isinstance(self.image_patch_dim, int) or self.image_patch_dim < 0:
            raise ValueError(f"MoEConfig.image_patch_dim must be an int >= 0, got {self.image_patch_dim!r}")
        if self.image_patch_dim and not 0 <= self.image_token_id < self.vocab_size:
            raise ValueError(f"MoEConfig.image_token_id must be in 0..vocab_size-1, got {self.image_token_id!r}")
        if self.dsa_mode not in ("sparse", "dense"):
            raise ValueError(f"MoEConfig.dsa_mode must be 'sparse' or 'dense', got {self.dsa_mode!r}")
        if not isinstance(self.attn_output_gate, bool):
            raise ValueError(f"MoEConfig.attn_output_gate must be True or False, got {self.attn_output_gate!r}")
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts",
                    "num_experts_per_tok", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"MoEConfig.{name} must be a positive float, got {value!r}")
        if not isinstance(self.router_aux_loss_coef, (int, float)) or self.router_aux_loss_coef < 0:
            raise ValueError(
                f"MoEConfig.router_aux_loss_coef must be a float >= 0, got {self.router_aux_loss_coef!r}")
        for name in ("norm_topk_prob", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoEConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"MoEConfig.num_experts_per_tok must be in 1..num_experts={self.num_experts}, "
                f"got {self.num_experts_per_tok}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"MoEConfig.num_attention_heads={self.num_attention_heads} must be divisible by "
                f"num_key_value_heads={self.num_key_value_heads} (GQA groups)")
        if self.head_dim % 2:
            raise ValueError(f"MoEConfig.head_dim must be even for RoPE, got {self.head_dim}")
        self._check_moe_fields()
        self._check_gpt_oss_fields()

    def _check_gpt_oss_fields(self) -> None:
        for name in ("attention_bias", "attention_sinks", "router_bias", "rope_truncate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoEConfig.{name} must be True or False, got {getattr(self, name)!r}")
        w = self.attention_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"MoEConfig.attention_window must be None or a positive int, got {w!r}")
        if "sliding" in self.kinds and w is None:
            raise ValueError("MoEConfig.layer_types has 'sliding' layers but attention_window is None")
        if self.swiglu_limit is not None and (isinstance(self.swiglu_limit, bool) or not self.swiglu_limit > 0):
            raise ValueError(f"MoEConfig.swiglu_limit must be None or a float > 0, got {self.swiglu_limit!r}")
        if self.router_bias and self.scoring_func != "softmax":
            raise ValueError("MoEConfig.router_bias needs scoring_func='softmax' (the sigmoid router has its selection bias)")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"MoEConfig.rope_type must be one of {list(ROPE_TYPES)}, got {self.rope_type!r}")
        if self.rope_type == "yarn" and not self.rope_factor >= 1:
            raise ValueError(f"MoEConfig.rope_factor must be >= 1 for yarn, got {self.rope_factor!r}")
        if self.is_gpt_oss and self.is_hybrid:
            raise ValueError("MoEConfig: gpt-oss options (attention_sinks, swiglu_limit, ...) combine only with "
                             "'full' and 'sliding' layers, without attn_output_gate or image input")

    def _check_moe_fields(self) -> None:
        for name, allowed in (("scoring_func", SCORING_FUNCS), ("qk_norm", QK_NORMS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"MoEConfig.{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        for name, low in (("intermediate_size", 1), ("n_group", 1), ("topk_group", 1),
                          ("first_k_dense_replace", 0), ("n_shared_experts", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"MoEConfig.{name} must be an int >= {low}, got {value!r}")
        if not self.first_k_dense_replace < self.num_hidden_layers:
            raise ValueError(f"MoEConfig.first_k_dense_replace must be in 0..num_hidden_layers-1="
                             f"{self.num_hidden_layers - 1} (at least one MoE layer), got {self.first_k_dense_replace}")
        if not isinstance(self.shared_expert_gate, bool) or (self.shared_expert_gate and not self.n_shared_experts):
            raise ValueError(f"MoEConfig.shared_expert_gate must be True or False, and True needs "
                             f"n_shared_experts >= 1; got {self.shared_expert_gate!r}")
        if isinstance(self.routed_scaling_factor, bool) or not isinstance(self.routed_scaling_factor, (int, float)) \
                or not self.routed_scaling_factor > 0:
            raise ValueError(f"MoEConfig.routed_scaling_factor must be a float > 0, got {self.routed_scaling_factor!r}")
        if self.n_group > 1 and self.scoring_func != "sigmoid":
            raise ValueError(f"MoEConfig.n_group={self.n_group} (group-limited routing) needs scoring_func='sigmoid'")
        if self.num_experts % self.n_group or (self.n_group > 1 and self.num_experts // self.n_group < 2):
            raise ValueError(f"MoEConfig.n_group={self.n_group} must divide num_experts={self.num_experts} "
                             "into groups of >= 2 experts (a group scores by its top-2)")
        if self.topk_group > self.n_group:
            raise ValueError(f"MoEConfig.topk_group must be in 1..n_group={self.n_group}, got {self.topk_group}")
        if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"MoEConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds the "
                             f"{self.topk_group * (self.num_experts // self.n_group)} experts of topk_group="
                             f"{self.topk_group} groups")

    @property
    def num_moe_layers(self) -> int:
        """Layers with a routed MoE FFN: all but the first `first_k_dense_replace`."""
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def kinds(self) -> tuple[str, ...]:
        """The attention kind of every layer (`layer_types`, or all "full")."""
        return self.layer_types or ("full",) * self.num_hidden_layers

    @property
    def is_hybrid(self) -> bool:
        """True when a layer is not plain Qwen3-MoE attention (exported with remote code, not as qwen3_moe)."""
        return any(k not in ("full", "sliding") for k in self.kinds) or self.attn_output_gate or self.image_patch_dim > 0

    @property
    def is_gpt_oss(self) -> bool:
        """True when a gpt-oss option is on (exported by model/gpt_oss.save_gpt_oss, not as qwen3_moe)."""
        return "sliding" in self.kinds or any(getattr(self, k) != v for k, v in GPT_OSS_VALUES.items())

    # ---- presets -------------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> MoEConfig:
        """A named shape, e.g. `MoEConfig.preset("tiny_moe")`; keyword overrides replace fields."""
        if name not in PRESETS:
            raise ValueError(f"unknown MoEConfig preset {name!r}; known: {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    # ---- Hugging Face config.json --------------------------------------------------------------

    def to_hf_dict(self) -> dict[str, Any]:
        """Keyword arguments for `transformers.Qwen3MoeConfig(**d)` (also a valid config.json body)."""
        if self.is_hybrid:
            raise ValueError("to_hf_dict writes Qwen3-MoE configs; a config with layer_types "
                             f"{list(self.kinds)} / attn_output_gate exports through model.hf_hybrid")
        if self.is_gpt_oss:
            raise ValueError("to_hf_dict writes Qwen3-MoE configs; a gpt-oss config exports through "
                             "model.gpt_oss.save_gpt_oss")
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name != "rope_theta" and f.name not in HYBRID_FIELDS and f.name not in GPT_OSS_VALUES}
        for name, qwen3_value in QWEN3_MOE_VALUES.items():
            if getattr(self, name) != qwen3_value:
                raise ValueError(f"to_hf_dict writes Qwen3-MoE configs, which have no {name}="
                                 f"{getattr(self, name)!r}; allowed: {qwen3_value!r}")
            d.pop(name)
        d.pop("first_k_dense_replace")
        d.update(
            model_type="qwen3_moe",
            architectures=["Qwen3MoeForCausalLM"],
            rope_parameters={"rope_type": "default", "rope_theta": float(self.rope_theta)},
            hidden_act="silu",
            attention_bias=False,
            attention_dropout=0.0,
            use_sliding_window=False,
            decoder_sparse_step=1,
            mlp_only_layers=list(range(self.first_k_dense_replace)),  # dense SwiGLU of intermediate_size
        )
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> MoEConfig:
        """Read a Qwen3-MoE config dict (config.json); a ValueError names anything we do not implement."""
        d = dict(d)
        model_type = d.pop("model_type", None)
        if model_type != "qwen3_moe":
            raise ValueError(f"unsupported model_type {model_type!r}: MoEConfig reads only 'qwen3_moe'")
        if "num_local_experts" in d:  # Qwen3MoeConfig.to_dict() writes num_experts under this alias
            d.setdefault("num_experts", d.pop("num_local_experts"))
        # Fields whose only supported value is HF's default: reject anything else by name.
        required = {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
                    "decoder_sparse_step": 1, "attention_dropout": 0.0,
                    "rope_scaling": None}
        for key, allowed in required.items():
            if key in d:
                value = d.pop(key)
                if value != allowed:
                    raise ValueError(f"unsupported Qwen3-MoE config field {key}={value!r}; allowed: {allowed!r}")
        dense = d.pop("mlp_only_layers", None) or []
        if list(dense) != list(range(len(dense))):
            raise ValueError(f"unsupported Qwen3-MoE config field mlp_only_layers={dense!r}; allowed: "
                             "the first layers [0, 1, ..., k-1] (first_k_dense_replace=k)")
        rope = d.pop("rope_parameters", None)
        if rope is not None:
            if rope.get("rope_type", "default") != "default" or set(rope) - {"rope_type", "rope_theta"}:
                raise ValueError(f"unsupported Qwen3-MoE config field rope_parameters={rope!r}; "
                                 "allowed: {'rope_type': 'default', 'rope_theta': float}")
            if "rope_theta" in rope:
                d.setdefault("rope_theta", rope["rope_theta"])
        names = ({f.name for f in dataclasses.fields(cls)} - set(QWEN3_MOE_VALUES) - set(GPT_OSS_VALUES)
                 - {"first_k_dense_replace"})
        unknown = sorted(k for k in d if k not in names and k not in _HF_IGNORED_KEYS)
        if unknown:
            raise ValueError(f"unsupported Qwen3-MoE config field(s) {unknown}")
        if d.get("head_dim") is None and "hidden_size" in d and "num_attention_heads" in d:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]  # HF's fallback
        return cls(**{k: v for k, v in d.items() if k in names}, first_k_dense_replace=len(dense))


PRESETS: dict[str, MoEConfig] = {
    # Trains and samples on 2 CPU cores; H and I are multiples of 32 so experts quantize to MXFP4.
    "tiny_moe": MoEConfig(),
    # Qwen/Qwen3-30B-A3B's shape, for shape/memory arithmetic and HF import checks.
    "qwen3_30b_a3b": MoEConfig(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1_000_000.0,
        max_position_embeddings=40960, intermediate_size=6144),
    # ~10.8 M parameters, Qwen3-MoE-shaped: the engine's and the peer benchmarks' model.
    "bench_moe": MoEConfig(
        hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        moe_intermediate_size=128, num_experts=16, num_experts_per_tok=2, intermediate_size=256),
    # Kimi-K2's MoE shape (DeepSeek-V3 family: 1 dense layer, 384 experts top-8, 1 shared expert,
    # sigmoid router, scaling 2.827) with GQA in place of MLA. Arithmetic only, never instantiated:
    # tests/model/test_params.py checks num_parameters against hand-derived totals.
    "kimi_k2_gqa": MoEConfig(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=61, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, moe_intermediate_size=2048, num_experts=384,
        num_experts_per_tok=8, norm_topk_prob=True, rope_theta=50000.0, max_position_embeddings=131072,
        intermediate_size=18432, first_k_dense_replace=1, n_shared_experts=1, scoring_func="sigmoid",
        n_group=1, topk_group=1, routed_scaling_factor=2.827, qk_norm="none"),
    # The hybrid at test scale: 3 KDA : 1 gated DSA (top-32, so sparsity bites beyond 32 tokens),
    # one shared expert and the sigmoid router; trains and samples on 2 CPU cores.
    "tiny_hybrid": MoEConfig(
        num_hidden_layers=4, layer_types=("kda", "kda", "kda", "gated_dsa"), index_topk=32,
        n_shared_experts=1, scoring_func="sigmoid"),
}
