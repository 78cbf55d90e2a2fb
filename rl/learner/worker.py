"""``LearnerWorker``: one DeepSpeed data-parallel rank (a Ray actor; gloo on CPU, NCCL on GPU).

The driver creates ``learner.num_ranks`` of these and hands each its shard of the step's
``TrainBatch``. ZeRO-1/2 partitions optimizer state (and gradients) across ranks. With
``learner.ep_size > 1`` each layer's routed experts are sharded over the expert-parallel
group (``expert_parallel.py``; all-to-all dispatch) and DeepSpeed reduces expert gradients
over the expert-data-parallel group; everything else is replicated.

Gradient accumulation is caller-owned (DeepSpeed's ``managed_gradient_accumulation:
false``): every micro-batch only accumulates, one ``step()`` per RL step. Micro-batches are
cut by sequence count and token budget, optionally packing several sequences per row; the
sequences of a micro-batch that continue one prompt (a GRPO group) share one forward of it
where that is exact (``share_prefix``; forward.py).
Normalisation: each micro-batch's loss is ``Σ per-token (or per-sequence) losses / (N_global
/ world_size)``; DeepSpeed averages gradients over ranks, so the update is the loss over the
whole global batch however it is split (tested: micro-batching, packing, 2 EP ranks vs 1).
Ranks of an expert-parallel group run the same number of micro-batches (empty ones pad the
shorter ranks) because every forward and backward exchanges tokens with all of them.

Precision: the forward and the loss run in the model's dtype (float64 in exactness tests),
but ZeRO's optimizer keeps fp32 master weights, so updates land with fp32 rounding.
DeepSpeed's gradient norm with ``ep_size > 1`` counts each rank's own experts only, so
``grad_clip`` is not ep-invariant; the invariance tests run without clipping.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time
from pathlib import Path

import torch

from jointrl.model.routing import update_router_bias
from jointrl.model.tokenizer import ByteTokenizer
from jointrl.rl.advantages import token_gae
from jointrl.rl.build import DTYPES, build_model
from jointrl.rl.config import Config
from jointrl.rl.learner.batch import MicroBatch, TrainBatch, collate, logprobs_from_logits, micro_batches
from jointrl.rl.learner.expert_parallel import expert_row_offsets, shard_experts
from jointrl.rl.learner.forward import check_packable, learner_forward, token_entropy
from jointrl.rl.learner.objective import build_loss, build_mismatch
from jointrl.rl.learner.value_head import VALUE_HEAD_PREFIX, attach_value_head, values
from jointrl.rl.losses import LossInputs


def zero_stage(cfg: Config, world_size: int) -> int:
    """The ZeRO stage DeepSpeed runs. One rank has nothing to partition: in fp32 / fp64 it runs
    ZeRO-0 whatever ``learner.zero_stage`` says (the same update, to fp32 rounding: tested; ZeRO-1/2
    would keep a flat fp32 copy of every weight and gradient and copy each micro-batch's gradients
    into it, ~0.1-0.2 CPU-s per bench_moe step); in bf16 ZeRO-1 (its fp32 master weights), ZeRO-2
    included. Checkpoints load across the two (``portable_checkpoint``)."""
    stage = cfg.learner.zero_stage
    if world_size == 1:
        return 1 if cfg.model.dtype == "bfloat16" and stage else 0
    return stage


def own_clip(cfg: Config, world_size: int) -> bool:
    """One rank under ZeRO-0 in fp32 / fp64: the learner clips the gradient norm itself (``clip_grad_norm``:
    torch's foreach kernels, the same rule: g *= min(1, clip / (‖g‖ + 1e-6))), instead of
    DeepSpeed's per-parameter loop, its one-rank all-reduce of the norm, and its missing norm in
    ``get_global_grad_norm``. More ranks average gradients inside ``engine.step()``, after any clip here."""
    return (world_size == 1 and zero_stage(cfg, world_size) == 0 and cfg.learner.grad_clip > 0
            and cfg.model.dtype != "bfloat16")


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)``, bit for bit, without its
    multiply by 1.0 when the norm is within ``max_norm`` (the usual case: a pass over every gradient
    saved). → the total 2-norm of the gradients."""
    grads = [p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if not bool(max_norm / (norm + 1e-6) >= 1.0):  # torch's coefficient, in its dtype; NaN multiplies too
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse in this process: blocks up to 32 MiB come from the heap
    instead of their own mmap (unmapped again on free), and up to 1 GiB free at the heap's top is kept instead
    of trimmed. A learner step allocates and frees the same large activations and gradients every time; returned
    to the OS, each comes back as fresh pages, one fault per 4 KiB (bench_moe under ``learner.autocast``: 6-9 K
    faults a step, ~400 with this). The memory a step needs stays mapped between steps, as a caching allocator
    would keep it. → whether it took effect (False off glibc)."""
    from jointrl.kernels.cpu_extension import _libc

    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def deepspeed_config(cfg: Config, world_size: int) -> dict:
    """DeepSpeed's config, at ``zero_stage(cfg, world_size)``."""
    lc = cfg.learner
    stage = zero_stage(cfg, world_size)
    return {
        "train_micro_batch_size_per_gpu": max(lc.micro_batch_size, 1),
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": 0.0 if own_clip(cfg, world_size) else lc.grad_clip,
        "zero_optimization": {"stage": stage, "overlap_comm": False, "contiguous_gradients": True,
                              "reduce_scatter": True},
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def merge_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Token-weighted means; ``*_max`` / ``*_min`` keys by max / min; ``tokens`` summed."""
    out: dict[str, float] = {}
    total = sum(p.get("tokens", 0.0) for p in parts)
    for key in {k for p in parts for k in p}:
        vals = [(p[key], p.get("tokens", 0.0)) for p in parts if key in p]
        if key == "tokens":
            out[key] = total
        elif key.endswith("_max"):
            out[key] = max(v for v, _ in vals)
        elif key.endswith("_min"):
            out[key] = min(v for v, _ in vals)
        else:
            out[key] = sum(v * n for v, n in vals) / total if total else 0.0
    return out


class LearnerWorker:
    def __init__(self, cfg: Config, rank: int, world_size: int, master_addr: str | None = None,
                 master_port: int | None = None) -> None:
        """With ``master_addr`` / ``master_port`` the rank joins the process group now; without, it
        waits for ``start`` (``LearnerGroup``: rank 0's ``rendezvous_address`` first, so the group
        meets on rank 0's node, wherever Ray placed it)."""
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        if master_addr is not None:
            self.start(master_addr, master_port)

    def rendezvous_address(self) -> tuple[str, int]:
        """This actor's node IP (as Ray sees it) and a port free on it: where rank 0 hosts the
        process group's store."""
        import socket

        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def start(self, master_addr: str, master_port: int) -> int:
        """Join the learners' process group at rank 0's ``master_addr:master_port``; build the model,
        the optimizer and the DeepSpeed engine. → this rank."""
        cfg, rank, world_size = self.cfg, self.rank, self.world_size
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        import deepspeed
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
        lc, algo = cfg.learner, cfg.algo
        if lc.keep_freed_memory:
            keep_freed_memory()
        self.tok = ByteTokenizer()
        self.loss_fn, self.mismatch = build_loss(cfg), build_mismatch(cfg)
        self.is_ppo = algo.name == "ppo"
        self.dtype = DTYPES[cfg.model.dtype]
        model = build_model(cfg)
        if cfg.checkpoint:  # start from a run's weights (e.g. jointrl sft's); the optimizer starts fresh
            from jointrl.rl.export import load_deepspeed

            model.load_state_dict(load_deepspeed(cfg, cfg.checkpoint)[0].state_dict())
        if lc.pack_sequences:
            check_packable(model.config)
        self.ref_model = None
        if algo.kl_coef > 0:  # KL to the initial policy; nothing is built when the KL term is off
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
            if lc.fake_quant_experts:  # the same function as the initial policy (kept whole: no all-to-all)
                shard_experts(self.ref_model, 1, 0, fake_quant=True)
        self.sharded = lc.ep_size > 1 or lc.fake_quant_experts
        if self.sharded:
            shard_experts(model, lc.ep_size, rank % lc.ep_size, fake_quant=lc.fake_quant_experts)
        if self.is_ppo:
            attach_value_head(model)
        groups = [{"params": [p for p in model.parameters() if p.requires_grad], "name": "dense"}]
        if lc.ep_size > 1:
            groups = split_params_into_different_moe_groups_for_optimizer(groups)
        opt = torch.optim.AdamW(groups, lr=lc.lr, betas=tuple(lc.betas), eps=lc.eps, weight_decay=lc.weight_decay, fused=True)
        self.zero_stage = zero_stage(cfg, world_size)
        if rank == 0 and self.zero_stage != lc.zero_stage:
            print(f"learner: {world_size} rank(s) in {cfg.model.dtype} run ZeRO-{self.zero_stage}, not learner.zero_stage="
                  f"{lc.zero_stage} (nothing to partition on one rank: rl/learner/worker.zero_stage)", flush=True)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=deepspeed_config(cfg, world_size))
        if world_size == 1 and self.zero_stage == 0:  # its all-reduce over one rank flattens and copies back every gradient
            self.engine.enable_backward_allreduce = False
        self.own_clip = own_clip(cfg, world_size)
        self.temperature = cfg.rollout.temperature or 1.0
        mc = model.config
        self.topk = (mc.num_moe_layers, mc.num_experts_per_tok)  # replay when a batch carries routed experts
        self.image = (mc.image_token_id, mc.image_patch_dim) if mc.image_patch_dim else None  # screenshot slots
        self.has_router_bias = any(getattr(m, "e_score_correction_bias", None) is not None for m in model.modules())
        # A shared prompt (a GRPO group's; an SFT micro-batch's common system prompt) forwarded once for
        # all rows that continue it: the same update up to float summation order, where the rows are
        # neither packed nor recomputed (checkpointing), nor expert-parallel, and no critic values
        # prompt tokens. Full attention (forward._forward_shared) counts a prompt's tokens once, so
        # not with the balance loss or the router-bias update; hybrid models (prefix_cache) weight
        # them by their rows. Tested against the unshared step.
        counts_once = set(mc.kinds) == {"full"}
        self.share_prefix = (self.image is None and not self.is_ppo and not lc.pack_sequences
                             and not lc.gradient_checkpointing and lc.ep_size == 1
                             and not (counts_once and (lc.aux_loss_coef or (self.has_router_bias and lc.router_bias_rate > 0))))
        self.master_addr = master_addr
        self.steps_done = 0  # optimizer updates so far (restored by load_checkpoint): the lr schedule's clock
        return rank

    def ready(self) -> int:
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    def _micro_batches(self, batch: TrainBatch, topk: tuple[int, int] | None) -> list[MicroBatch]:
        lc = self.cfg.learner
        mbs = micro_batches(batch, lc.micro_batch_size, self.tok.pad_id, self.dtype,
                            max_tokens=lc.max_tokens_per_micro_batch, pack=lc.pack_sequences, topk=topk,
                            image=self.image, share_prefix=self.share_prefix and topk is None)
        if lc.ep_size > 1:  # every rank of the expert-parallel group runs the same number of passes
            import torch.distributed as dist

            n = torch.tensor([len(mbs)])
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            empty = TrainBatch([[self.tok.pad_id]], [[0]], [[0.0]], [0.0], [0.0],
                               None if topk is None else [torch.full((1, *topk), -1)])  # -1: no recorded routes
            mbs += [collate(empty, False, self.tok.pad_id, self.dtype, topk, self.image) for _ in range(int(n) - len(mbs))]
        return mbs

    def train_step(self, shard: TrainBatch, num_tokens_global: int, num_seqs_global: int | None = None
                   ) -> dict[str, float]:
        """One optimizer update over this rank's shard. Returns rank-local metrics."""
        t0 = time.perf_counter()
        lc, algo = self.cfg.learner, self.cfg.algo
        self.engine.train()
        if num_seqs_global is None:
            num_seqs_global = shard.num_loss_seqs
        count = num_seqs_global if self.loss_fn.per_sequence else num_tokens_global
        norm = max(count, 1) / self.world_size
        parts, load_LE, loss_sum, aux_sum = [], None, 0.0, 0.0
        mbs = self._micro_batches(shard, self.topk if shard.routed_experts is not None else None)
        # gated_dsa's indexer learns from its own KL (DeepSeek-V3.2's L_I): it never gets the policy's gradient
        train_indexer = lc.indexer_loss_coef > 0 and "gated_dsa" in self.engine.module.config.kinds
        for mb in mbs:
            with self._autocast():
                fwd = learner_forward(self.engine.module, mb.input_ids, mb.pos, mb.seg, mb.replay,
                                      lc.gradient_checkpointing, mb.images, mb.prefix, indexer_loss=train_indexer)
            logp = logprobs_from_logits(fwd.logits_BTV, mb.input_ids, self.temperature)
            inp = self._loss_inputs(mb, fwd, logp, norm)
            loss, m = self.loss_fn(inp)
            if lc.aux_loss_coef:
                loss = loss + lc.aux_loss_coef * fwd.aux_loss * mb.num_seqs / max(len(shard), 1)
            if train_indexer:
                loss = loss + lc.indexer_loss_coef * fwd.indexer_loss * mb.num_seqs / max(len(shard), 1)
                m = {**m, "indexer_kl": fwd.indexer_loss.item()}
            self.engine.backward(loss)
            _, mm = self.mismatch(logp.detach(), mb.old_logprobs, mb.loss_mask, mb.seg.clamp(min=0), mb.num_seqs)
            parts.append({**m, **mm})
            loss_sum += loss.item()
            aux_sum += fwd.aux_loss.item() / len(mbs)
            load_LE = fwd.expert_load_LE if load_LE is None else load_LE + fwd.expert_load_LE
        grad_norm = None
        lr = self._scheduled_lr()
        if self.own_clip:
            grad_norm = clip_grad_norm([p for p in self.engine.module.parameters() if p.grad is not None], lc.grad_clip)
        self.engine.step()
        self.steps_done += 1
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()
        metrics = merge_metrics(parts)
        metrics["lr"] = lr
        # each rank's loss is scaled by world_size (gradients are averaged): its share of the global loss is / world_size
        metrics.update(loss=loss_sum / self.world_size, aux_loss=aux_sum, grad_norm=float(grad_norm or 0.0))
        metrics.update(self._expert_load(load_LE))
        metrics["time_s"] = time.perf_counter() - t0
        return metrics

    def _scheduled_lr(self) -> float:
        """Set this update's learning rate (``learner.lr_schedule`` at ``steps_done`` of ``algo.total_steps``)
        on every parameter group → it."""
        lc = self.cfg.learner
        lr = lc.lr
        if lc.lr_schedule == "cosine":
            total = max(self.cfg.algo.total_steps, 1)
            lr = lc.lr * 0.5 * (1.0 + math.cos(math.pi * min(self.steps_done, total) / total))
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _autocast(self):
        """``learner.autocast``: the forward under ``torch.autocast`` in that dtype (the backward follows the
        forward's dtypes; the loss, the log-probs and the optimizer stay float32), else a no-op."""
        dtype = self.cfg.learner.autocast
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(next(self.engine.module.parameters()).device.type, dtype=DTYPES[dtype])

    def _loss_inputs(self, mb: MicroBatch, fwd, logp: torch.Tensor, norm: float) -> LossInputs:
        algo = self.cfg.algo
        seq = mb.seg.clamp(min=0)
        old = logp.detach() if algo.behaviour_logprobs == "learner" else mb.old_logprobs
        weight = None
        if algo.mismatch != "none":
            weight, _ = self.mismatch(logp.detach(), mb.old_logprobs, mb.loss_mask, seq, mb.num_seqs)
        entropy = None
        if algo.entropy_coef:
            entropy = token_entropy(fwd.logits_BTV, self.temperature)
        else:
            with torch.no_grad():
                entropy = token_entropy(fwd.logits_BTV.detach(), self.temperature)
        ref = None
        if self.ref_model is not None:
            with torch.no_grad(), self._autocast():
                ref_fwd = learner_forward(self.ref_model, mb.input_ids, mb.pos, mb.seg, mb.replay, image_patches=mb.images,
                                         prefix=mb.prefix)
                ref = logprobs_from_logits(ref_fwd.logits_BTV, mb.input_ids, self.temperature)
        adv = mb.adv
        v = old_v = ret = None
        if self.is_ppo:
            v = values(self.engine.module, fwd.hidden_BTH)
            old_v = v.detach()
            adv, ret = self._gae(mb, old_v)
        return LossInputs(logp, old, adv, mb.loss_mask, seq, mb.num_seqs, norm, weight, ref, entropy, v, old_v, ret)

    def _gae(self, mb: MicroBatch, values_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token GAE advantages and returns over each sequence's loss tokens."""
        if mb.rewards is None:
            raise ValueError("algo.name=ppo needs TrainBatch.rewards")
        adv_BT, ret_BT = torch.zeros_like(values_BT), torch.zeros_like(values_BT)
        for i in range(mb.num_seqs):
            sel = (mb.seg == i) & (mb.loss_mask > 0)
            if sel.any():
                a, r = token_gae(mb.rewards[i], values_BT[sel], self.cfg.algo.gamma, self.cfg.algo.lam)
                adv_BT[sel], ret_BT[sel] = a, r
        return adv_BT, ret_BT

    def _expert_load(self, load_LE: torch.Tensor | None) -> dict[str, float]:
        """Global (all-ranks) expert load per layer; the aux-loss-free bias update when the model has one."""
        if load_LE is None:
            return {}
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(load_LE)
        out: dict[str, float] = {}
        mean_L = load_LE.mean(-1).clamp_min(1e-12)
        for layer, (row, mean) in enumerate(zip(load_LE, mean_L)):
            out[f"experts/layer{layer}_max_over_mean"] = float(row.max() / mean)
            out[f"experts/layer{layer}_dead"] = float((row == 0).sum())
        out["experts/dead_total"] = float((load_LE == 0).sum())
        if self.has_router_bias and self.cfg.learner.router_bias_rate > 0:
            out.update(update_router_bias(self.engine.module, load_LE, self.cfg.learner.router_bias_rate))
        return out

    @torch.no_grad()
    def logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Per-token log-probs of the given sequences under the current weights (every rank of an
        expert-parallel group must be called with the same sequences)."""
        self.engine.eval()
        batch = TrainBatch(token_ids, [[0] * len(s) for s in token_ids], [[0.0] * len(s) for s in token_ids],
                           [0.0] * len(token_ids))
        out = []
        for mb in self._micro_batches(batch, None):
            with self._autocast():
                logits_BTV = learner_forward(self.engine.module, mb.input_ids, mb.pos, mb.seg,
                                             image_patches=mb.images).logits_BTV
            lp = logprobs_from_logits(logits_BTV, mb.input_ids, self.temperature)
            for b in range(lp.shape[0]):
                for i in sorted(set(mb.seg[b][mb.seg[b] >= 0].tolist())):
                    out.append(lp[b][mb.seg[b] == i].tolist())
        return out[:len(token_ids)]

    def weight_bundle(self, version: int):
        """This rank's part of the push (``_push_state``) as one bundle; None when it has nothing to send."""
        from jointrl.rl.weight_sync import build_bundle

        state, kw = self._push_state()
        return build_bundle(state, version=version, **kw) if state else None

    def _push_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """What this rank sends -- rank 0 the shared parameters and its experts, every other
        expert-parallel rank its experts only, replicas nothing -- and the bucket arguments."""
        from jointrl.rl.weight_sync import is_routed_expert

        rc = self.cfg.rollout
        quantize = is_routed_expert if rc.quantize_experts else (lambda name, t: False)
        offsets = expert_row_offsets(self.engine.module)
        state = {k: v.detach() for k, v in self.engine.module.state_dict().items() if not k.startswith(VALUE_HEAD_PREFIX)}
        if self.cfg.learner.ep_size > 1:
            if self.rank >= self.cfg.learner.ep_size:  # a replica of an expert shard rank < ep_size sends
                state = {}
            elif self.rank > 0:
                state = {k: v for k, v in state.items() if k in offsets}
        return state, {"is_quantized": quantize, "row_offsets": offsets, "bucket_bytes": int(rc.weight_bucket_mb * 2**20)}

    # rollout.weight_transport=dist (rl/weight_transport.py): open -> join (with the receivers) -> push
    def open_weight_group(self, num_receivers: int, backend: str, timeout_s: float) -> tuple[str, int]:
        from jointrl.rl.weight_transport import WeightSender

        if getattr(self, "sender", None) is not None:  # rebuilt groups: leave the old one first
            self.sender.close()
        self.sender = WeightSender(num_receivers, backend, timeout_s)
        return self.sender.address

    def join_weight_group(self) -> None:
        self.sender.connect()

    def push_weights(self, version: int) -> dict[str, float]:
        state, kw = self._push_state()
        return self.sender.send(state, version, **kw)

    def save_checkpoint(self, directory: str, step: int) -> None:
        """``directory/step_N``: DeepSpeed's files (or, with expert parallelism, ``ep_rank_*.pt``) that
        load exactly into the same ``num_ranks`` / ``ep_size``, and ``portable/`` that loads into
        any (``portable_checkpoint.py``)."""
        from jointrl.rl.learner.portable_checkpoint import save_portable

        save_portable(self.engine.module, self.engine.optimizer, os.path.join(directory, f"step_{step}"), rank=self.rank,
                      num_ranks=self.world_size, ep_size=self.cfg.learner.ep_size, step=step,
                      row_offsets=expert_row_offsets(self.engine.module),
                      zero_stage=self.zero_stage)
        if self.cfg.learner.ep_size > 1:
            return self._save_ep_checkpoint(directory, step)
        self.engine.save_checkpoint(directory, tag=f"step_{step}", client_state={"step": step})

    def load_checkpoint(self, directory: str) -> int | None:
        """``_load_checkpoint``, and the lr schedule resumes at the step it returns."""
        step = self._load_checkpoint(directory)
        self.steps_done = step or 0
        return step

    def _load_checkpoint(self, directory: str) -> int | None:
        """Load the latest checkpoint in ``directory``; the step it was saved at, or None. Saved by
        another ``num_ranks`` / ``ep_size``, or with ZeRO partitioning where this rank runs without
        (or the other way round: one rank in fp32 runs ZeRO-0 since 2026-11-30, ZeRO-1 before): from
        its portable copy."""
        from jointrl.rl.learner.portable_checkpoint import load_portable, topology

        if not os.path.exists(os.path.join(directory, "latest")):
            return None
        with open(os.path.join(directory, "latest")) as f:
            path = os.path.join(directory, f.read().strip())
        saved = topology(path)
        if saved is None and self.zero_stage == 0 and any(Path(path).glob("zero_pp_rank_*")):
            raise ValueError(f"checkpoint {path} holds ZeRO optimizer files and no portable copy (written before "
                             "checkpoints had one); one learner rank now runs without ZeRO and cannot read them: "
                             "resume it with the code that wrote it, or start from its weights with a fresh "
                             f"optimizer (checkpoint={path})")
        here = (self.world_size, self.cfg.learner.ep_size, self.zero_stage > 0)
        # written before topologies named the stage: with ZeRO (ZeRO-0 could not write a checkpoint then)
        if saved is not None and (saved["num_ranks"], saved["ep_size"], saved.get("zero_stage", 1) > 0) != here:
            return load_portable(self.engine.module, self.engine.optimizer, path, expert_row_offsets(self.engine.module),
                                 self.zero_stage)
        if self.cfg.learner.ep_size > 1:
            return self._load_ep_checkpoint(directory)
        path, client = self.engine.load_checkpoint(directory)
        return None if path is None else int(client["step"])

    # DeepSpeed's own MoE checkpoint files assume its expert naming (deepspeed_moe.experts.*), so with
    # expert parallelism each rank writes its module (its experts) and its ZeRO partition itself; these
    # load into the same num_ranks / ep_size only (another topology reads the portable copy).
    def _save_ep_checkpoint(self, directory: str, step: int) -> None:
        import torch.distributed as dist

        path = os.path.join(directory, f"step_{step}")
        os.makedirs(path, exist_ok=True)
        torch.save({"module": self.engine.module.state_dict(), "optimizer": self.engine.optimizer.state_dict(),
                    "step": step, "world_size": self.world_size}, os.path.join(path, f"ep_rank_{self.rank:03d}.pt"))
        dist.barrier()
        if self.rank == 0:
            with open(os.path.join(directory, "latest"), "w") as f:
                f.write(f"step_{step}")

    def _load_ep_checkpoint(self, directory: str) -> int:
        with open(os.path.join(directory, "latest")) as f:
            tag = f.read().strip()
        sd = torch.load(os.path.join(directory, tag, f"ep_rank_{self.rank:03d}.pt"), weights_only=False)
        if sd["world_size"] != self.world_size:
            raise ValueError(f"checkpoint {tag} was saved by {sd['world_size']} learner ranks with expert "
                             f"parallelism; it loads into the same learner.num_ranks only (now {self.world_size})")
        self.engine.module.load_state_dict(sd["module"])
        self.engine.optimizer.load_state_dict([sd["optimizer"]] * self.world_size)  # ZeRO reads this rank's entry
        return int(sd["step"])
