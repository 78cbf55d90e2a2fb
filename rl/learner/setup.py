"""A learner rank's construction: the process group, the model (its critic, expert shards and
reference copy), the optimizer and the DeepSpeed engine, and the choices a step runs under.

ZeRO-1/2 partitions optimizer state (and gradients) across ranks. With ``learner.ep_size > 1``
each layer's routed experts are sharded over the expert-parallel group (``expert_parallel.py``;
all-to-all dispatch) and DeepSpeed reduces expert gradients over the expert-data-parallel group;
everything else is replicated. Device: the rank's own (``rl/device.rank_device``: its GPU, else
the host); the model is built on the meta device and allocated there once, NCCL or gloo and
DeepSpeed's accelerator follow from it. ``setup_local_rank`` is the same rank without DeepSpeed
or a process group (one process: the colocated step, ``rl/colocate.py``). Precision: the forward and the loss run in the model's dtype
(float64 in exactness tests), but ZeRO's optimizer keeps fp32 master weights, so updates land
with fp32 rounding.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from jointrl.kernels.cpu_extension import _libc
from jointrl.rl.build import build_model
from jointrl.rl.checkpoint_format import read_policy
from jointrl.rl.config import Config, ModelDtype
from jointrl.rl.device import as_device, choose_accelerator, dist_backend, rank_device
from jointrl.rl.learner.expert_parallel import shard_experts
from jointrl.rl.learner.forward import check_packable, flat_shareable
from jointrl.rl.learner.objective import Objective
from jointrl.rl.learner.value_head import attach_value_head


def zero_stage(cfg: Config, world_size: int) -> int:
    """The ZeRO stage DeepSpeed runs. One rank has nothing to partition: in fp32 / fp64 it runs
    ZeRO-0 whatever ``learner.zero_stage`` says (the same update, to fp32 rounding: tested; ZeRO-1/2
    would keep a flat fp32 copy of every weight and gradient and copy each micro-batch's gradients
    into it, ~0.1-0.2 CPU-s per bench_moe step); in bf16 ZeRO-1 (its fp32 master weights), ZeRO-2
    included. Checkpoints load across the two (``portable_checkpoint``)."""
    stage = cfg.learner.zero_stage
    if world_size == 1:
        return 1 if cfg.model.dtype is ModelDtype.bfloat16 and stage else 0
    return stage


def own_clip(cfg: Config, world_size: int) -> bool:
    """One rank under ZeRO-0 in fp32 / fp64: the learner clips the gradient norm itself (``clip_grad_norm``:
    torch's foreach kernels, the same rule: g *= min(1, clip / (‖g‖ + 1e-6))), instead of
    DeepSpeed's per-parameter loop, its one-rank all-reduce of the norm, and its missing norm in
    ``get_global_grad_norm``. More ranks average gradients inside ``engine.step()``, after any clip here."""
    return (world_size == 1 and zero_stage(cfg, world_size) == 0 and cfg.learner.grad_clip > 0
            and cfg.model.dtype is not ModelDtype.bfloat16)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse in this process: blocks up to 32 MiB come from the heap
    instead of their own mmap (unmapped again on free), and up to 1 GiB free at the heap's top is kept instead
    of trimmed. A learner step allocates and frees the same large activations and gradients every time; returned
    to the OS, each comes back as fresh pages, one fault per 4 KiB (bench_moe under ``learner.autocast``: 6-9 K
    faults a step, ~400 with this). The memory a step needs stays mapped between steps, as a caching allocator
    would keep it. → whether it took effect (False off glibc)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def deepspeed_config(cfg: Config, world_size: int) -> dict:
    """DeepSpeed's config, at ``zero_stage(cfg, world_size)``. Gradient accumulation is the
    caller's (``managed_gradient_accumulation: false``): one ``step()`` per RL step."""
    lc = cfg.learner
    return {
        "train_micro_batch_size_per_gpu": max(lc.micro_batch_size, 1),
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": 0.0 if own_clip(cfg, world_size) else lc.grad_clip,
        "zero_optimization": {"stage": zero_stage(cfg, world_size), "overlap_comm": False, "contiguous_gradients": True,
                              "reduce_scatter": True},
        "bf16": {"enabled": cfg.model.dtype is ModelDtype.bfloat16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


@dataclass
class RankSetup:
    """A constructed rank: its engine and what its steps decide from the model and config once."""

    engine: object  # deepspeed.DeepSpeedEngine
    ref_model: nn.Module | None  # the initial policy, frozen (KL term); None when algo.kl_coef = 0
    zero_stage: int
    own_clip: bool
    topk: tuple[int, int]  # (MoE layers, experts per token): the shape of a replayed route
    image: tuple[int, int] | None  # (image token id, patch dim): screenshot slots, None without
    has_router_bias: bool
    share_prefix: bool  # a group's shared prompt forwarded once per micro-batch (forward.py)


def join_process_group(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """DeepSpeed's process group over the learner ranks: NCCL when this rank computes on a GPU,
    gloo on the host (``rl/device.py``); DeepSpeed's accelerator is the same device's."""
    device = rank_device()
    choose_accelerator(device)  # before DeepSpeed's first use picks one itself
    import deepspeed

    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend=dist_backend(device))


class LocalEngine:
    """The part of ``DeepSpeedEngine`` a ``TrainStep`` uses, for one rank in one process without a
    process group: ``backward`` accumulates, ``step`` runs AdamW and clears the gradients (what
    DeepSpeed's ZeRO-0 does on one rank, without its fp32 master copy: the update lands in the
    model's dtype). The gradient norm is ``TrainStep``'s own clip (``RankSetup.own_clip``)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def get_global_grad_norm(self) -> None:
        return None


@dataclass
class _RankModel:
    model: nn.Module
    ref_model: nn.Module | None
    groups: list[dict] = field(default_factory=list)


def _build_rank_model(cfg: Config, rank: int, objective: Objective, device: torch.device) -> _RankModel:
    """The model on ``device`` (from ``cfg.checkpoint``'s weights when set), its reference copy, expert
    shards and critic, and the optimizer's parameter groups: what every kind of rank builds alike."""
    lc, algo = cfg.learner, cfg.algo
    model = build_model(cfg, device)
    if cfg.checkpoint:
        model.load_state_dict(read_policy(cfg, cfg.checkpoint)[0].state_dict())
    if lc.pack_sequences:
        check_packable(model.config)
    ref_model = None
    if algo.kl_coef > 0:  # KL to the initial policy; nothing is built when the KL term is off
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if lc.fake_quant_experts:  # the same function as the initial policy (kept whole: no all-to-all)
            shard_experts(ref_model, 1, 0, fake_quant=True)
    if lc.ep_size > 1 or lc.fake_quant_experts:
        shard_experts(model, lc.ep_size, rank % lc.ep_size, fake_quant=lc.fake_quant_experts)
    if objective.estimator.needs_critic:
        attach_value_head(model)
    groups = [{"params": [p for p in model.parameters() if p.requires_grad], "name": "dense"}]
    return _RankModel(model, ref_model, groups)


def _adamw(cfg: Config, groups: list[dict]) -> torch.optim.AdamW:
    """AdamW over ``groups``: fused kernels on the host and on CUDA alike."""
    lc = cfg.learner
    return torch.optim.AdamW(groups, lr=lc.lr, betas=tuple(lc.betas), eps=lc.eps, weight_decay=lc.weight_decay,
                             fused=True)


def setup_rank(cfg: Config, rank: int, world_size: int, objective: Objective) -> RankSetup:
    """Build the model on this rank's device (from ``cfg.checkpoint``'s weights when set; the optimizer
    starts fresh), its critic when the estimator needs one, the reference copy, the expert shards,
    AdamW and the DeepSpeed engine."""
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    lc = cfg.learner
    if lc.keep_freed_memory:
        keep_freed_memory()
    device = rank_device()
    built = _build_rank_model(cfg, rank, objective, device)
    model, groups = built.model, built.groups
    if lc.ep_size > 1:
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    opt = _adamw(cfg, groups)
    stage = zero_stage(cfg, world_size)
    if rank == 0 and stage != lc.zero_stage:
        print(f"learner: {world_size} rank(s) in {cfg.model.dtype} run ZeRO-{stage}, not learner.zero_stage="
              f"{lc.zero_stage} (nothing to partition on one rank: rl/learner/setup.zero_stage)", flush=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=deepspeed_config(cfg, world_size))
    if world_size == 1 and stage == 0:  # its all-reduce over one rank flattens and copies back every gradient
        engine.enable_backward_allreduce = False
    return _rank_setup(cfg, engine, model, built.ref_model, stage, own_clip(cfg, world_size), objective)


def setup_local_rank(cfg: Config, objective: Objective, device: torch.device | str | None = None) -> RankSetup:
    """One learner rank in this process, without DeepSpeed or a process group (``LocalEngine``), on
    ``device`` (None: ``rank_device()``): the model built as ``setup_rank`` builds it. It clips the
    gradient norm itself (``learner.grad_clip``); expert parallelism needs ranks, so ``ep_size`` 1 only.

    Raises:
        ValueError: ``learner.ep_size`` > 1.
    """
    if cfg.learner.ep_size > 1:
        raise ValueError(f"setup_local_rank: learner.ep_size={cfg.learner.ep_size} needs a process group; use setup_rank")
    device = as_device(device)
    built = _build_rank_model(cfg, 0, objective, device)
    engine = LocalEngine(built.model, _adamw(cfg, built.groups))
    return _rank_setup(cfg, engine, built.model, built.ref_model, 0, cfg.learner.grad_clip > 0, objective)


def _rank_setup(cfg: Config, engine, model: nn.Module, ref_model: nn.Module | None, stage: int, clip: bool,
                objective: Objective) -> RankSetup:
    """The choices a step runs under, decided once from the model and config."""
    lc = cfg.learner
    mc = model.config
    image = (mc.image_token_id, mc.image_patch_dim) if mc.image_patch_dim else None
    has_router_bias = any(getattr(m, "e_score_correction_bias", None) is not None for m in model.modules())
    # A shared prompt (a GRPO group's; an SFT micro-batch's common system prompt) forwarded once for
    # all rows that continue it: the same update up to float summation order, where the rows are
    # neither packed nor recomputed (checkpointing), nor expert-parallel, and no critic values
    # prompt tokens. Plain full attention (forward._forward_shared) counts a prompt's tokens once, so
    # not with the balance loss or the router-bias update; other models (prefix_cache: hybrids, sinks)
    # weight them by their rows. Tested against the unshared step.
    counts_once = flat_shareable(model)
    share_prefix = (image is None and not objective.estimator.needs_critic and not lc.pack_sequences
                    and not lc.gradient_checkpointing and lc.ep_size == 1
                    and not (counts_once and (lc.aux_loss_coef or (has_router_bias and lc.router_bias_rate > 0))))
    return RankSetup(engine, ref_model, stage, clip, (mc.num_moe_layers, mc.num_experts_per_tok),
                     image, has_router_bias, share_prefix)
