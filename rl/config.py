"""Typed configuration: the schema every Hydra config in ``conf/`` is validated against.

``conf/config.yaml`` composes one file per group (model, algo, rollout, envs, learner,
cluster, logger) on top of ``Config`` (registered in Hydra's ConfigStore as
``config_schema``), so an unknown key or a wrongly typed value fails at composition with the
key's name. ``load_config`` then builds the dataclasses, whose ``__post_init__`` checks
values and names the allowed ones. Decide once, here; the hot loop never branches on strings.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from jointrl.envs.base import TIERS
from jointrl.envs.splits import SPLITS
from jointrl.kernels.dispatch import default_backend
from jointrl.model.config import LAYER_TYPES, QK_NORMS, ROPE_TYPES, SCORING_FUNCS, MoEConfig
from jointrl.rl.losses.common import Aggregation, KLEstimator
from jointrl.rl.losses.mismatch import MismatchMode
from jointrl.model.pretrained import fill_shape

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


# Every config choice is a StrEnum whose member names equal their values (OmegaConf reads a YAML
# string as a member *name*), so a bad value fails at composition naming the key and the allowed
# values, and a member still compares equal to its string. The losses' own choices live with their
# math (``Aggregation``, ``KLEstimator`` in rl/losses/common.py; ``MismatchMode`` in mismatch.py).
def _choice(name: str, values: tuple[str, ...], doc: str) -> type[enum.StrEnum]:
    """A StrEnum ``name`` with one member per value (for choices whose list lives elsewhere)."""
    cls = enum.StrEnum(name, {v: v for v in values}, module=__name__, qualname=name)
    cls.__doc__ = doc
    return cls


LayerType = _choice("LayerType", LAYER_TYPES, "A decoder layer's attention kind (model/config.LAYER_TYPES).")
ScoringFunc = _choice("ScoringFunc", SCORING_FUNCS, "The router's scoring function (model/config.SCORING_FUNCS).")
QKNorm = _choice("QKNorm", QK_NORMS, "Where attention normalises q and k (model/config.QK_NORMS).")
RopeType = _choice("RopeType", ROPE_TYPES, "How RoPE scales its frequencies (model/config.ROPE_TYPES).")


class ModelDtype(enum.StrEnum):
    """The policy's weights and forward (learner and rollout): ``rl/build.DTYPES``."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float64 = "float64"  # exactness tests


class KernelBackend(enum.StrEnum):
    """``model.kernels``: which implementation every kernel op runs (``kernels/dispatch``), chosen once when
    the model is built and handed to its layers and the engine (``kernels/ops.Kernels``). Its default is
    ``$JOINTRL_KERNEL_BACKEND``, else auto."""

    auto = "auto"      # Triton on CUDA; the C++ kernels on CPU where they build, else torch
    torch = "torch"    # the torch references (one per op)
    cpu = "cpu"        # the C++ CPU kernels (kernels/csrc) where an op has one
    triton = "triton"  # the Triton kernels (CUDA; on CPU only under TRITON_INTERPRET=1, for tests)


def _default_kernels() -> KernelBackend:
    return KernelBackend(default_backend())


class DSAMode(enum.StrEnum):
    """gated_dsa attention: the indexer's top-k keys (sparse), or every key (dense; a reference)."""

    sparse = "sparse"
    dense = "dense"


class Algorithm(enum.StrEnum):
    """``algo.name``: the policy loss (rl/losses/) and its advantage estimator (rl/advantages.py)."""

    grpo = "grpo"  # group-relative advantages, token-level clipped ratio
    gspo = "gspo"  # group-relative advantages, sequence-level ratio
    ppo = "ppo"  # a critic and GAE
    sft = "sft"  # `jointrl sft` on oracle transcripts (rl/sft.py); `jointrl train` refuses it


class BehaviourLogprobs(enum.StrEnum):
    """The ratio's denominator: the engine's sampled log-probs, or the learner's own before the update."""

    rollout = "rollout"
    learner = "learner"


class RolloutBackend(enum.StrEnum):
    engine = "engine"  # rl/rollout/llm_engine.py: paged KV, continuous batching
    simple = "simple"  # the skeleton's SimpleSampler
    vllm = "vllm"  # rl/rollout/vllm/: vLLM in its own venv and process (model=hf model.path=...)


RolloutMode = _choice("RolloutMode", ("sync", "async"),
                      "sync: each step's rollouts, then its learner step; async: the next steps' rollouts run "
                      "while the learner trains (``rollout.async_steps_ahead``, ``rollout.max_staleness``).")


class WeightTransport(enum.StrEnum):
    ray = "ray"  # the object store
    dist = "dist"  # torch.distributed broadcast (rl/weight_transport.py)


class DistBackend(enum.StrEnum):
    gloo = "gloo"  # CPU
    nccl = "nccl"  # CUDA


class LiveSessions(enum.StrEnum):
    """What a weight update does to the engine's open sessions' KV caches."""

    keep = "keep"
    reprefill = "reprefill"


class KVDtype(enum.StrEnum):
    auto = "auto"  # the model's dtype
    bfloat16 = "bfloat16"  # float32 full-attention models; not exact


ThinkingTier = _choice("ThinkingTier", TIERS, "A task's reasoning tier (envs/base.TIERS), each with a token "
                       "budget (``rollout.thinking_budget``).")
Split = _choice("Split", SPLITS, "Which of a domain's tasks a run reads (envs/splits.SPLITS).")


class PromptStyle(enum.StrEnum):
    full = "full"  # each domain's own system prompt and tool descriptions
    compact = "compact"  # one-line system prompt and tool descriptions, same tools and schemas


class AutocastDtype(enum.StrEnum):
    bfloat16 = "bfloat16"


class LRSchedule(enum.StrEnum):
    """The learning rate over a run's updates (rl/learner/step.py: ``LR_SCHEDULES``)."""

    constant = "constant"
    cosine = "cosine"  # lr -> 0 over algo.total_steps (HF's cosine schedule without warm-up)


class PlacementStrategy(enum.StrEnum):
    """Ray placement-group strategies (rl/placement.py)."""

    PACK = "PACK"
    SPREAD = "SPREAD"
    STRICT_PACK = "STRICT_PACK"
    STRICT_SPREAD = "STRICT_SPREAD"


class LoggerMode(enum.StrEnum):
    """wandb's ``mode``; ``disabled`` makes no wandb run at all."""

    offline = "offline"
    online = "online"
    disabled = "disabled"


class DemoPolicy(enum.StrEnum):
    """The scripted policies an SFT stage imitates (rl/sft.py)."""

    oracle = "oracle"
    wrong = "wrong"  # each family's plausible slip


class DemoStyle(enum.StrEnum):
    """A domain's style of demonstration (envs/code_repo/policies.py)."""

    shell = "shell"
    sed = "sed"


def _check_choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"config key {key!r} = {value!r} is not allowed; allowed values: {list(allowed)}")


@functools.cache
def _choice_fields(cls: type) -> tuple[tuple[str, type[enum.StrEnum]], ...]:
    """(field, its StrEnum) for every field of the dataclass ``cls`` typed as a StrEnum or an Optional one."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        union = typing.get_origin(tp) in (typing.Union, types.UnionType)
        args = [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]
        if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], enum.StrEnum):
            out.append((name, args[0]))
    return tuple(out)


def _coerce_choices(self: Any, section: str) -> None:
    """A section built in code (not composed by Hydra, which checks these itself): each choice given
    as a plain string becomes its enum member, or a ValueError names the key and the allowed values."""
    for name, choices in _choice_fields(type(self)):
        value = getattr(self, name)
        if value is not None and not isinstance(value, choices):
            _check_choice(f"{section}.{name}", value, tuple(m.value for m in choices))
            setattr(self, name, choices(value))


def _check_positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"config key {key!r} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _check_model(self: Any) -> None:
    _coerce_choices(self, "model")
    shape = [f.name for f in dataclasses.fields(MoEConfig)]
    if self.path is not None:  # model=hf: unset shape fields come from the checkpoint (model/pretrained.py)
        for k, v in fill_shape({k: getattr(self, k) for k in shape}, self.path, self.tokenizer).items():
            setattr(self, k, list(v) if k == "layer_types" and v is not None else v)
    elif self.name == "hf":
        raise ValueError("config key 'model.path' is unset; model=hf starts from a checkpoint: model.path=DIR")
    elif self.tokenizer is not None:
        raise ValueError("config key 'model.tokenizer' needs model.path (the checkpoint it belongs to)")
    unset = [f.name for f in dataclasses.fields(MoEConfig) if getattr(self, f.name) is None and f.default is not None]
    if unset:
        raise ValueError(f"config key 'model.{unset[0]}' is unset; set it, or model.path to read it from a checkpoint")
    try:  # MoEConfig checks the rest (shapes, ranges); its message names the field
        MoEConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(MoEConfig)})
    except ValueError as e:
        raise ValueError(f"config key 'model': {str(e).replace('MoEConfig.', 'model.')}") from None


def _model_schema() -> type:
    """``ModelConfig``: ``name`` and ``dtype``, then every ``MoEConfig`` field with its default, so
    the Hydra schema never drifts from the model (YAML lists stand for ``layer_types``' tuple)."""
    hints = typing.get_type_hints(MoEConfig) | {"layer_types": typing.Optional[list[LayerType]],
                                                "scoring_func": ScoringFunc, "qk_norm": QKNorm, "dsa_mode": DSAMode,
                                                "rope_type": RopeType}
    fields = [("name", str, field(default="tiny_moe")), ("dtype", ModelDtype, field(default=ModelDtype.float32)),
              ("kernels", KernelBackend, field(default_factory=_default_kernels))]
    for f in dataclasses.fields(MoEConfig):  # Optional: model=hf leaves them unset (None), filled from model.path
        fields.append((f.name, typing.Optional[hints[f.name]], field(default=f.default)))
    # A Hugging Face checkpoint to start from (weights, shape, tokenizer, chat template); tokenizer: another dir's.
    fields += [("path", typing.Optional[str], field(default=None)), ("tokenizer", typing.Optional[str], field(default=None))]
    return dataclasses.make_dataclass(
        "ModelConfig", fields, namespace={"__post_init__": _check_model, "__module__": __name__,
                                          "__doc__": "MoE transformer shape: MoEConfig's fields (model/config.py); path: start from a checkpoint."})


ModelConfig = _model_schema()


@dataclass
class AlgoConfig:
    name: Algorithm = Algorithm.grpo
    total_steps: int = 4
    prompts_per_step: int = 4  # informative GRPO groups per step (zero-variance groups are refilled)
    group_size: int = 4  # samples per prompt
    max_refill_attempts: int = 2  # extra sampling rounds to replace dropped groups (0: never refill)
    clip_low: float = 0.2
    clip_high: float = 0.28
    aggregation: Aggregation = Aggregation.token_mean  # (GSPO is always per sequence)
    scale_adv_by_std: bool = True
    normalize_rewards_by_domain: bool = False  # standardise rewards per domain before advantages
    kl_coef: float = 0.0  # KL to the initial policy; 0 builds no reference model
    kl_estimator: KLEstimator = KLEstimator.k3
    entropy_coef: float = 0.0
    gamma: float = 1.0  # PPO / GAE
    lam: float = 0.95
    vf_coef: float = 0.5
    value_clip: float = 0.2
    behaviour_logprobs: BehaviourLogprobs = BehaviourLogprobs.rollout
    mismatch: MismatchMode = MismatchMode.none  # train/rollout correction (needs behaviour_logprobs=learner)
    tis_cap: float = 2.0
    mismatch_low: float = 0.5
    mismatch_high: float = 2.0

    def __post_init__(self) -> None:
        _coerce_choices(self, "algo")
        for k in ("total_steps", "prompts_per_step"):
            _check_positive(f"algo.{k}", getattr(self, k))
        for k in ("kl_coef", "entropy_coef", "vf_coef", "value_clip", "max_refill_attempts"):
            _check_positive(f"algo.{k}", getattr(self, k), allow_zero=True)
        if self.group_size < 2:
            raise ValueError(f"config key 'algo.group_size' must be >= 2 for group-relative advantages, got {self.group_size}")
        if self.mismatch is not MismatchMode.none and self.behaviour_logprobs is not BehaviourLogprobs.learner:
            raise ValueError(f"config key 'algo.mismatch' = {self.mismatch!r} corrects learner-vs-rollout log-probs; "
                             "it needs algo.behaviour_logprobs=learner (with 'rollout' the ratio already is against the engine)")


@dataclass
class VLLMRolloutConfig:
    """``rollout.vllm``: the vLLM backend's own settings (rl/rollout/vllm/engine.VLLMEngineConfig)."""

    venv: str = "/opt/jointrl/venvs/vllm"  # built by .ci/setup.d/vllm.sh
    kv_cache_mb: int = 512  # vLLM's KV cache per engine (on CPU: host memory)
    tensor_parallel_size: int = 1  # GPUs one vLLM instance spans (passed through; GPU only, untested here)
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    start_timeout_s: float = 900.0
    # cluster.colocate=true: vLLM sleeps during each learner step and push (rl/rollout/vllm/engine.py),
    # 1: weights to host memory and KV cache dropped, 2: both dropped (the push refills the weights)
    sleep_level: int = 1

    def __post_init__(self) -> None:
        for k in ("kv_cache_mb", "tensor_parallel_size", "data_parallel_size", "start_timeout_s"):
            _check_positive(f"rollout.vllm.{k}", getattr(self, k))
        _check_choice("rollout.vllm.sleep_level", self.sleep_level, (1, 2))


@dataclass
class RolloutConfig:
    backend: RolloutBackend = RolloutBackend.engine
    num_workers: int = 1
    max_batch: int = 64  # sequences decoded together
    max_tokens_per_turn: int = 96
    max_context: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    quantize_experts: bool = True  # push routed experts as MXFP4 (the rollout runs the quantized weights)
    # cluster.colocate=true, rollout.backend=engine: the engine's weights also go to host memory while it
    # sleeps through the learner step (its KV pool is always freed; rl/rollout/sleep.py)
    colocate_offload_weights: bool = False
    weight_transport: WeightTransport = WeightTransport.ray
    weight_dist_backend: DistBackend = DistBackend.gloo  # the dist transport's
    weight_bucket_mb: float = 32.0  # payload bound of one bucket of the push
    mode: RolloutMode = RolloutMode.sync
    async_steps_ahead: int = 1  # async: steps whose rollouts may be in flight beyond the current one
    max_staleness: int = 1  # trajectories sampled more than this many versions before the trained policy are dropped
    thinking_budget: dict[str, Any] = field(default_factory=lambda: {"low": 32, "high": 64, "max": None})
    # a step whose learner-vs-rollout mismatch KL (k3, on its batch) exceeds this stops the run (null: no limit)
    max_mismatch_kl: float | None = None
    vllm: VLLMRolloutConfig = field(default_factory=VLLMRolloutConfig)
    # engine backend only (rl/rollout/llm_engine.EngineConfig documents each)
    num_blocks: int = 4096  # KV memory budget: num_blocks x block_size token slots
    block_size: int = 16
    max_num_batched_tokens: int = 512  # tokens per forward (decodes + prefill chunks)
    session_ttl_s: float = 60.0  # idle sessions are evicted after this (and under memory pressure)
    live_sessions: LiveSessions = LiveSessions.keep  # on a weight update
    kv_dtype: KVDtype = KVDtype.auto
    batch_invariant: bool = False  # a seeded request's tokens independent of what shares its batch (exact replay)
    decode_graphs: bool = False  # pure decode steps captured in CUDA graphs per batch bucket (rl/rollout/cuda_graphs.py)

    def __post_init__(self) -> None:
        _coerce_choices(self, "rollout")
        _check_positive("rollout.weight_bucket_mb", self.weight_bucket_mb)
        _check_positive("rollout.async_steps_ahead", self.async_steps_ahead)
        _check_positive("rollout.max_staleness", self.max_staleness, allow_zero=True)
        for k in ("num_workers", "num_blocks", "block_size", "max_num_batched_tokens"):
            _check_positive(f"rollout.{k}", getattr(self, k))
        _check_positive("rollout.session_ttl_s", self.session_ttl_s, allow_zero=True)
        _check_positive("rollout.max_tokens_per_turn", self.max_tokens_per_turn)
        if self.max_mismatch_kl is not None:
            _check_positive("rollout.max_mismatch_kl", self.max_mismatch_kl, allow_zero=True)
        if self.decode_graphs and self.batch_invariant:
            raise ValueError("config keys 'rollout.decode_graphs' and 'rollout.batch_invariant' cannot both be true: "
                             "batch-invariant decode runs its own tiled path, which is not captured")
        if self.backend is RolloutBackend.vllm and (self.top_k != 0 or self.top_p != 1.0):
            raise ValueError(f"config keys 'rollout.top_k' = {self.top_k} / 'rollout.top_p' = {self.top_p}: "
                             "rollout.backend=vllm refuses top-k / top-p (its log-probs of a filtered distribution "
                             "are not defined as ours); allowed: top_k=0, top_p=1.0")
        if set(self.thinking_budget) != set(ThinkingTier):
            raise ValueError(f"config key 'rollout.thinking_budget' needs exactly the tiers ['low', 'high', 'max'], "
                             f"got {sorted(self.thinking_budget)}")


@dataclass
class DomainConfig:
    weight: float = 1.0  # share of the joint batch
    task_dir: str | None = None  # None: the tasks shipped with the domain
    tiers: dict[ThinkingTier, float] = field(default_factory=dict)  # override each task's tier by weight; {} keeps the task's own
    reward: dict[str, float] = field(default_factory=dict)  # override each task's reward weights; {} keeps them
    split: Split = Split.train  # jointrl eval reads heldout
    # whole families kept out of training (envs/splits.py family_of): eval reports them as <domain>/unseen
    heldout_families: list[str] = field(default_factory=list)
    # records through Hugging Face datasets (code_repo; envs/code_repo/dataset.py): a local parquet /
    # arrow / JSONL file or a save_to_disk directory; None: task_dir's (or the shipped) instances.jsonl
    dataset: str | None = None
    dataset_split: str = "train"  # a save_to_disk DatasetDict's split
    dataset_columns: dict[str, str] = field(default_factory=dict)  # field -> the dataset's column (FAIL_TO_PASS: fail_to_pass)
    # docker backend: each record's image, a template over {repo} {name} {instance_id} ("": its image_name column)
    dataset_image: str = ""


class SandboxBackend(enum.StrEnum):
    """Which sandbox runs an episode's commands (envs/sandbox/)."""

    bwrap = "bwrap"  # bubblewrap namespaces on the host (bwrap.py)
    docker = "docker"  # a container per episode on a Docker daemon (docker.py)


class SandboxMode(enum.StrEnum):
    """How the bwrap backend gets its isolation: as root (a private host uid per episode) or
    rootless (unprivileged user namespaces); ``auto`` picks rootless when not running as root."""

    auto = "auto"
    root = "root"
    rootless = "rootless"


@dataclass
class EnvSandboxConfig:
    """``envs.sandbox``: the sandbox backend every domain's episodes run in, and its limits."""

    backend: SandboxBackend = SandboxBackend.bwrap
    mode: SandboxMode = SandboxMode.auto
    rootfs: str | None = None  # the sandbox's /usr and /etc from this directory (null: the host's)
    # limits of every command (envs/sandbox/base.SandboxConfig); a task's task.toml may set its own resources
    timeout_s: float = 10.0  # wall clock per command (was envs.command_timeout_s, kept as an alias)
    max_output_bytes: int = 16_384  # per stream; the rest is replaced by a marker
    max_memory_mb: int = 2048  # the episode's memory cgroup
    max_processes: int = 64  # the episode's pids cgroup
    max_disk_mb: int = 1024  # tmpfs size of the working dir and of /tmp
    cpu_seconds: int = 120  # RLIMIT_CPU per process
    warm: int = 4  # warm sandboxes per env worker (envs/sandbox/pool.py); 0: cold starts
    verifier_network: bool = False  # docker: a task marked [environment] allow_internet verifies with a network

    def __post_init__(self) -> None:
        _coerce_choices(self, "envs.sandbox")
        for k in ("timeout_s", "max_output_bytes", "max_memory_mb", "max_processes", "max_disk_mb", "cpu_seconds"):
            _check_positive(f"envs.sandbox.{k}", getattr(self, k))
        _check_positive("envs.sandbox.warm", self.warm, allow_zero=True)


@dataclass
class EnvsConfig:
    # No default domain here: conf/envs/<group>.yaml names them, and a dict default would be
    # merged with (not replaced by) the chosen group's domains.
    domains: dict[str, DomainConfig] = field(default_factory=dict)
    num_workers: int = 2
    max_concurrent_episodes: int = 16  # per env worker
    max_env_retries: int = 2
    episode_timeout_s: float = 300.0
    command_timeout_s: float | None = None  # deprecated alias of envs.sandbox.timeout_s (one release)
    # full: each domain's own system prompt and tool descriptions; compact: a one-line system
    # prompt and one-line tool descriptions (terminal, code_repo, browser), same tools and schemas, for
    # small byte-level models that re-read the system turn with every token (docs/recipe.md)
    prompt: PromptStyle = PromptStyle.full
    sandbox: EnvSandboxConfig = field(default_factory=EnvSandboxConfig)

    def __post_init__(self) -> None:
        _coerce_choices(self, "envs")
        from jointrl.envs.registry import DOMAINS  # lazy: the registry imports every domain's module

        for name, d in self.domains.items():
            _check_choice("envs.domains", name, tuple(sorted(DOMAINS)))
            _coerce_choices(d, f"envs.domains.{name}")
            _check_positive(f"envs.domains.{name}.weight", d.weight)
        _check_positive("envs.num_workers", self.num_workers)
        if self.command_timeout_s is not None:  # the old key wins where a config still sets it
            _check_positive("envs.command_timeout_s", self.command_timeout_s)
            self.sandbox.timeout_s = self.command_timeout_s


@dataclass
class LearnerConfig:
    num_ranks: int = 1
    zero_stage: int = 2
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0
    micro_batch_size: int = 0  # sequences per micro-batch (0: no limit)
    max_tokens_per_micro_batch: int = 16384  # token budget per micro-batch, padding included (0: no limit)
    pack_sequences: bool = False  # several sequences per row (segment-causal attention)
    gradient_checkpointing: bool = False
    aux_loss_coef: float = 0.0  # weight of the router load-balancing loss in the RL step
    # weight of gated_dsa's indexer loss (KL of the head-mean attention to the indexer's scores,
    # DeepSeek-V3.2's L_I; it trains the indexer only); 0: the indexer keeps its initial weights
    indexer_loss_coef: float = 1.0
    ep_size: int = 1  # expert parallelism: ranks that share one layer's routed experts
    routing_replay: bool = False  # R3: replay the rollout's routed experts in the learner's forward
    fake_quant_experts: bool = False  # the learner's routed experts run through an MXFP4 round trip (STE)
    router_bias_rate: float = 1e-3  # aux-loss-free balancing (DeepSeek-V3) for models with a router bias
    # the forward's matmuls (projections, routed experts) in this dtype under torch.autocast, weights, gradients
    # and the optimizer in the model's float32; router, norms, attention and logits stay float32 (null: off)
    autocast: AutocastDtype | None = None
    # the learning rate over a run's algo.total_steps updates: constant, or cosine from lr to 0 (HF's
    # get_cosine_schedule_with_warmup without warm-up); a resumed run continues the schedule
    lr_schedule: LRSchedule = LRSchedule.constant
    # the learner's process keeps the memory it frees for its next step (glibc mallopt: no unmap of large
    # blocks, no trim) instead of returning it to the OS and page-faulting it back in: a bench_moe step under
    # learner.autocast took 6-9 K page faults, ~400 with it (rl/learner/setup.keep_freed_memory)
    keep_freed_memory: bool = True
    # the newest complete checkpoints kept in <output_dir>/checkpoints (older ones are removed once a newer one
    # is committed); 0 keeps all. Each is ~12 bytes per parameter (fp32 master + Adam's two moments: rl/checkpoint_format.py)
    checkpoint_keep: int = 2

    def __post_init__(self) -> None:
        _coerce_choices(self, "learner")
        _check_choice("learner.zero_stage", self.zero_stage, (0, 1, 2))
        _check_positive("learner.num_ranks", self.num_ranks)
        _check_positive("learner.micro_batch_size", self.micro_batch_size, allow_zero=True)
        _check_positive("learner.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, allow_zero=True)
        _check_positive("learner.lr", self.lr)
        _check_positive("learner.indexer_loss_coef", self.indexer_loss_coef, allow_zero=True)
        _check_positive("learner.ep_size", self.ep_size)
        _check_positive("learner.checkpoint_keep", self.checkpoint_keep, allow_zero=True)
        if self.num_ranks % self.ep_size:
            raise ValueError(f"config key 'learner.ep_size' = {self.ep_size} must divide learner.num_ranks = {self.num_ranks}")
        if self.ep_size > 1 and self.zero_stage == 0:
            raise ValueError("config key 'learner.ep_size' > 1 needs learner.zero_stage 1 or 2 (DeepSpeed's MoE groups)")


@dataclass
class ClusterConfig:
    ray_address: str | None = None  # None: start a local Ray instance
    num_cpus: int | None = None
    # placement groups (rl/placement.py): one bundle per learner rank / rollout worker; GPU "auto" = 1 if the cluster has GPUs
    learner_bundle: dict[str, Any] = field(default_factory=lambda: {"CPU": 0.25})
    rollout_bundle: dict[str, Any] = field(default_factory=lambda: {"CPU": 0.25})
    placement_strategy: PlacementStrategy = PlacementStrategy.PACK
    env_worker_cpus: float = 0.0  # CPUs each env worker reserves (its torch threads: max(1, floor)); never a GPU
    colocate: bool = False  # rollout worker i shares learner rank i's bundle and GPUs (rl/placement.py)

    def __post_init__(self) -> None:
        _coerce_choices(self, "cluster")
        if not (isinstance(self.env_worker_cpus, (int, float)) and self.env_worker_cpus >= 0):
            raise ValueError(f"config key 'cluster.env_worker_cpus' = {self.env_worker_cpus!r} must be a number >= 0")
        for key in ("learner_bundle", "rollout_bundle"):
            for res, v in getattr(self, key).items():
                if not (v == "auto" and res == "GPU") and not (isinstance(v, (int, float)) and v >= 0):
                    raise ValueError(f"config key 'cluster.{key}.{res}' = {v!r} must be a number >= 0 (GPU may be 'auto')")


@dataclass
class LoggerConfig:
    wandb_mode: LoggerMode = LoggerMode.offline
    project: str = "jointrl"
    dump_trajectories: bool = True
    table_rows: int = 4  # sampled transcripts per step in the wandb trajectory table (0: none)

    def __post_init__(self) -> None:
        _coerce_choices(self, "logger")


@dataclass
class ServeConfig:
    """``jointrl serve``: the HTTP server (rl/rollout/server.py). Context and per-tier thinking
    limits come from ``rollout`` (``max_context``, ``thinking_budget``)."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (printed at start)
    model_name: str = "jointrl"
    default_thinking_budget: ThinkingTier = ThinkingTier.max  # tier when a request names none
    default_max_tokens: int = 256  # per turn, when a request names none
    max_conversations: int = 1024  # token records kept (least recently used evicted)
    record_path: str | None = None  # JSONL of recorded Trajectories; None: no recording
    max_request_bytes: int = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        _coerce_choices(self, "serve")
        _check_positive("serve.default_max_tokens", self.default_max_tokens)
        _check_positive("serve.max_conversations", self.max_conversations)
        _check_positive("serve.port", self.port, allow_zero=True)


@dataclass
class RecipeConfig:
    """``jointrl recipe`` (rl/recipe.py): SFT warm start -> held-out eval -> GRPO -> held-out evals.
    The GRPO stage runs ``algo`` / ``learner``; the SFT stage overrides only what is named here."""

    # a first stage before SFT (model/pretrain.copy_warmup): the untrained model learns to copy spans of
    # random printable bytes through a length curriculum, [[steps, context], ...] in order ([]: none);
    # the SFT starts from its weights. No task data: a stand-in for the pretraining a from-scratch model lacks
    copy_warmup: list[list[int]] = field(default_factory=list)
    copy_warmup_lr: float = 1e-3
    copy_warmup_batch: int = 32  # rows per step
    sft_steps: int = 20
    sft_prompts_per_step: int = 8  # oracle transcripts per SFT step
    sft_lr: float = 3e-3
    sft_lr_schedule: LRSchedule = LRSchedule.constant  # the SFT stage's learner.lr_schedule (cosine: sft_lr -> 0)
    eval_k: int = 4  # samples per held-out task and tier
    eval_limit: int = 0  # held-out tasks per domain, the first by id (0: all)
    eval_tiers: list[ThinkingTier] = field(default_factory=lambda: [ThinkingTier.low])
    eval_every: int = 0  # GRPO steps between held-out evals of the saved checkpoints (0: only the last step)
    eval_init: bool = False  # also evaluate the untrained model (the curve's first point before SFT)
    # which scripted policy demonstrates each SFT task, by weight (rl/sft.py; jointrl sft reads it too):
    # {oracle: 1.0} imitates the oracles; {oracle: 0.5, wrong: 0.5} mixes in each family's plausible slip
    sft_demos: dict[DemoPolicy, float] = field(default_factory=lambda: {DemoPolicy.oracle: 1.0})
    # domain -> the style of its demonstrations: {code_repo: shell} plays code_repo's oracle_shell /
    # wrong_shell instead of oracle / wrong (the same edits from one bash call: envs/code_repo/policies.py),
    # {code_repo: sed} its oracle_sed / wrong_sed (the family's edit as one short sed -i; generated tasks)
    sft_demo_style: dict[str, DemoStyle] = field(default_factory=dict)
    # domain -> its weight in the SFT draw (rl/sft.demo_draws): each row's domain drawn by weight, then
    # that domain's next demonstration; {} (the default): every demonstration once per epoch, so each
    # domain gets its share of the demonstrations. Must weigh every domain that has demonstrations.
    sft_domain_weights: dict[str, float] = field(default_factory=dict)
    # every N SFT steps (0: never) score held-out oracle transcripts (the first sft_heldout_limit
    # tasks per domain) under the current weights: NLL, tokens greedy gets right, and the
    # probability of sampling the whole oracle (rl/sft.heldout_fit) -- no episodes played
    sft_heldout_every: int = 0
    sft_heldout_limit: int = 32
    # a user's own demonstrations instead of the oracles' (rl/sft_data.py): a chat-messages datasets
    # file (parquet / arrow / JSONL) or save_to_disk directory; None: play the scripted oracles
    sft_data: str | None = None
    sft_data_split: str = "train"  # a save_to_disk DatasetDict's split
    # domain -> the task folder the GRPO stage trains on (its train split) instead of
    # envs.domains.<d>.task_dir, which the SFT demonstrations and every held-out eval keep using:
    # e.g. fresh tasks, other seeds of the same generators that no demonstration showed (measured:
    # docs/recipe.md, eighth session)
    grpo_task_dirs: dict[str, str] = field(default_factory=dict)
    # the GRPO stage's sampling temperature (its rollouts, and the learner's log-probs of them);
    # null: rollout.temperature, which every held-out eval keeps: explore more in training than
    # the policy is measured at, as verl's rollout vs val_kwargs temperatures
    grpo_temperature: float | None = None
    # Comparisons (docs/recipe.md, the five-domain recipe): another run's output_dir whose SFT checkpoint
    # and step-0 eval this run reuses instead of its own SFT (the single-domain runs of joint vs single)
    sft_from: str | None = None
    # the domains the GRPO stage trains on and its evals play ([]: all); a subset runs algo.total_steps
    # x its weight share, so each domain gets the GRPO episodes the joint run gives it
    grpo_domains: list[str] = field(default_factory=list)
    grpo: bool = True  # false: no GRPO stage, the SFT checkpoint is the result (the SFT-only baseline)
    # another run's output_dir: this run's SFT takes the steps that run's SFT + GRPO CPU seconds buy at
    # that SFT's CPU seconds per step (its curves.json): the oracle-only SFT baseline at equal CPU
    match_cpu_of: str | None = None
    # the SFT and GRPO stages also checkpoint every N steps (0: SFT at its end only, GRPO at the eval
    # steps only), so a run stopped mid-stage resumes from its last checkpoint instead of the stage's start
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        _coerce_choices(self, "recipe")
        for k in ("sft_steps", "sft_prompts_per_step", "sft_lr", "eval_k", "copy_warmup_lr", "copy_warmup_batch"):
            _check_positive(f"recipe.{k}", getattr(self, k))
        for phase in self.copy_warmup:
            if len(phase) != 2 or min(phase) < 1:
                raise ValueError(f"recipe.copy_warmup must be [[steps, context], ...] of positive ints, got {list(self.copy_warmup)}")
            if phase[1] < 26:  # a 12-byte span twice, with a gap
                raise ValueError(f"recipe.copy_warmup: context {phase[1]} is too short to hold a copied span twice (>= 26)")
        for k in ("eval_limit", "eval_every", "sft_heldout_every", "sft_heldout_limit", "checkpoint_every"):
            _check_positive(f"recipe.{k}", getattr(self, k), allow_zero=True)
        if not self.sft_demos or "oracle" not in self.sft_demos:
            raise ValueError(f"recipe.sft_demos must give the oracle a weight, got {dict(self.sft_demos)}")
        for name, w in self.sft_demos.items():
            _check_positive(f"recipe.sft_demos.{name}", w)
        if self.grpo_temperature is not None:
            _check_positive("recipe.grpo_temperature", self.grpo_temperature)
        from jointrl.envs.registry import DOMAINS  # lazy: the registry imports every domain's module
        for domain in self.grpo_task_dirs:
            _check_choice("recipe.grpo_task_dirs", domain, tuple(DOMAINS))
        for domain, w in self.sft_domain_weights.items():
            _check_choice("recipe.sft_domain_weights", domain, tuple(DOMAINS))
            _check_positive(f"recipe.sft_domain_weights.{domain}", w, allow_zero=True)
        if self.sft_domain_weights and not any(self.sft_domain_weights.values()):
            raise ValueError(f"recipe.sft_domain_weights must give some domain a weight > 0, got {dict(self.sft_domain_weights)}")
        for domain in self.sft_demo_style:
            _check_choice("recipe.sft_demo_style", domain, tuple(DOMAINS))
        for domain in self.grpo_domains:
            _check_choice("recipe.grpo_domains", domain, tuple(DOMAINS))


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    envs: EnvsConfig = field(default_factory=EnvsConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    checkpoint: str | None = None  # the policy's weights (serve, eval: an HF dir or a run's checkpoints; train: a run's
    # checkpoints, e.g. jointrl sft's, as the initial and reference policy; resume=true takes precedence); None: untrained
    run_name: str = "default"
    output_dir: str = "runs/default"
    seed: int = 0
    resume: bool = False
    # learner steps between checkpoints (and the last step, and on SIGUSR1/SIGTERM); 0 disables. A 30B model's
    # checkpoint is ~360 GB (12 bytes per parameter), written in the background (rl/checkpoint_format.py)
    checkpoint_every: int = 10

    def __post_init__(self) -> None:
        _check_positive("checkpoint_every", self.checkpoint_every, allow_zero=True)
        if not self.envs.domains:  # checked here: the schema's EnvsConfig() is built empty
            from jointrl.envs.registry import DOMAINS  # lazy: the registry imports every domain's module

            raise ValueError("config key 'envs.domains' needs at least one domain; allowed: " + str(sorted(DOMAINS)))
        if self.rollout.backend is RolloutBackend.vllm and self.model.dtype is ModelDtype.float64:
            raise ValueError("config key 'rollout.backend' = 'vllm' needs model.dtype float32 or bfloat16 "
                             "(vLLM has no float64)")
        if self.cluster.colocate and self.rollout.mode is RolloutMode("async"):
            raise ValueError("config key 'rollout.mode' = 'async' cannot run with cluster.colocate=true: the engine "
                             "sleeps through every learner step, so no rollout can overlap it (use rollout.mode=sync)")
        if self.rollout.colocate_offload_weights and not (self.cluster.colocate
                                                           and self.rollout.backend is RolloutBackend.engine):
            raise ValueError("config key 'rollout.colocate_offload_weights' = true needs cluster.colocate=true and "
                             f"rollout.backend=engine (got cluster.colocate={str(self.cluster.colocate).lower()}, "
                             f"rollout.backend={self.rollout.backend.value}; vLLM's offload is rollout.vllm.sleep_level)")
        if self.learner.autocast is not None and self.model.dtype is not ModelDtype.float32:
            raise ValueError(f"config key 'learner.autocast' = {self.learner.autocast!r} needs model.dtype float32 "
                             f"(the weights autocast casts from), got model.dtype = {self.model.dtype!r}")


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore  # Hydra only where a config is composed: the GPU check has none

    ConfigStore.instance().store(name="config_schema", node=Config)


def _named(e: Exception) -> ValueError | None:
    """OmegaConf's validation error behind ``e`` (Hydra wraps an override's in its own) as a
    ValueError that names the key and the value and, for a choice, lists the allowed values."""
    from omegaconf.errors import KeyValidationError, ValidationError  # OmegaConf only where a config is composed

    err = e
    while err is not None and not isinstance(err, (ValidationError, KeyValidationError)):
        err = err.__cause__ or err.__context__
    if err is None:
        return None
    if isinstance(err, KeyValidationError) and err.full_key:  # a choice-keyed dict's key
        keys = typing.get_args(err.ref_type)[:1]
        allowed = [m.value for m in keys[0]] if keys and isinstance(keys[0], type) and issubclass(keys[0], enum.Enum) else None
        where = err.full_key.rsplit(".", 1)[0]
        return ValueError(f"config key {where!r} has key {err.key!r}, which is not allowed; allowed keys: {allowed}")
    choice = getattr(err.child_node, "enum_type", None)
    if choice is None:  # a list item or dict value: the container's element type
        kinds = [a for a in typing.get_args(err.ref_type) if isinstance(a, type) and issubclass(a, enum.Enum)]
        choice = kinds[-1] if kinds else None
    if err.full_key and choice is not None:
        return ValueError(f"config key {err.full_key!r} = {err.value!r} is not allowed; "
                          f"allowed values: {[m.value for m in choice]}")
    what = str(err).splitlines()[0]
    return ValueError(f"config key {err.full_key!r}: {what}" if err.full_key else f"{e}: {what}")


def to_config(cfg: DictConfig) -> Config:  # noqa: F821 -- omegaconf's, imported here only when used
    """Hydra's composed DictConfig -> validated ``Config`` (raises ValueError naming the key)."""
    from omegaconf import OmegaConf  # OmegaConf only where a config is composed: the GPU check has none
    from omegaconf.errors import ValidationError  # (same)

    # Through a plain container, so keys added with Hydra's `+` are checked against the schema too.
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra", None)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), plain))
    except ValidationError as e:
        raise (_named(e) or e) from None


def load_config(overrides: list[str] = ()) -> Config:
    """Compose ``conf/config.yaml`` with Hydra-style overrides, outside of ``@hydra.main``."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        try:
            composed = compose(config_name="config", overrides=list(overrides))
        except ConfigCompositionException as e:
            raise (_named(e) or e) from None
        return to_config(composed)
