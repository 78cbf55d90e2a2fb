"""A learner rank's optimizer update: micro-batches -> forward -> the objective's loss -> backward,
then one clipped AdamW step (and the per-token log-probs of the current weights).

Gradient accumulation is caller-owned: every micro-batch only accumulates, one ``step()`` per RL
step. Micro-batches are cut by sequence count and token budget, optionally packing several
sequences per row; the sequences of a micro-batch that continue one prompt (a GRPO group) share
one forward of it where that is exact (``RankSetup.share_prefix``; forward.py).
Normalisation: each micro-batch's loss is ``Σ per-token (or per-sequence) losses / (N_global
/ world_size)``; DeepSpeed averages gradients over ranks, so the update is the loss over the
whole global batch however it is split (tested: micro-batching, packing, 2 EP ranks vs 1).
Ranks of an expert-parallel group run the same number of micro-batches (empty ones pad the
shorter ranks) because every forward and backward exchanges tokens with all of them.
DeepSpeed's gradient norm with ``ep_size > 1`` counts each rank's own experts only, so
``grad_clip`` is not ep-invariant; the invariance tests run without clipping.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from jointrl.model.routing import update_router_bias
from jointrl.rl.build import DTYPES, build_tokenizer
from jointrl.rl.config import Config, LRSchedule
from jointrl.rl.learner.batch import MicroBatch, TrainBatch, collate, micro_batches
from jointrl.rl.learner.forward import learner_forward
from jointrl.rl.learner.logprobs import chunked_logprobs
from jointrl.rl.learner.objective import Objective
from jointrl.rl.learner.setup import RankSetup
from jointrl.rl.learner.value_head import values
from jointrl.rl.losses import LossInputs
from jointrl.rl.types import ROUTE_DTYPE


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)``, bit for bit, without its
    multiply by 1.0 when the norm is within ``max_norm`` (the usual case: a pass over every gradient
    saved). → the total 2-norm of the gradients."""
    grads = [p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if not bool(max_norm / (norm + 1e-6) >= 1.0):  # torch's coefficient, in its dtype; NaN multiplies too
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


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


def constant_lr(lr: float, step: int, total: int) -> float:
    return lr


def cosine_lr(lr: float, step: int, total: int) -> float:
    """lr · (1 + cos(π k / T)) / 2 at update k of T (HF's cosine schedule without warm-up); lr 0 past T."""
    total = max(total, 1)
    return lr * 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))


LR_SCHEDULES: dict[LRSchedule, Callable[[float, int, int], float]] = {
    LRSchedule.constant: constant_lr, LRSchedule.cosine: cosine_lr}


def _no_critic(model: torch.nn.Module, hidden_BTH: torch.Tensor) -> None:
    return None


class TrainStep:
    """The update and the log-probs of one rank, under choices made once here."""

    def __init__(self, cfg: Config, setup: RankSetup, objective: Objective, world_size: int) -> None:
        lc = cfg.learner
        self.lc, self.setup, self.obj, self.world_size = lc, setup, objective, world_size
        self.engine = setup.engine
        self.tok = build_tokenizer(cfg)  # its pad id pads micro-batches
        self.dtype = DTYPES[cfg.model.dtype]
        self.temperature = cfg.rollout.temperature or 1.0
        self.lr_at = LR_SCHEDULES[lc.lr_schedule]
        self.total_steps = cfg.algo.total_steps
        self.entropy_grad = bool(cfg.algo.entropy_coef)  # else the entropy is only logged (detached)
        self.values = values if objective.estimator.needs_critic else _no_critic
        self.device = next(self.engine.module.parameters()).device  # micro-batches are collated on the host, moved here
        self.autocast = (contextlib.nullcontext if lc.autocast is None
                         else lambda: torch.autocast(self.device.type, dtype=DTYPES[lc.autocast]))
        # gated_dsa's indexer learns from its own KL (DeepSeek-V3.2's L_I): it never gets the policy's gradient
        self.train_indexer = lc.indexer_loss_coef > 0 and "gated_dsa" in self.engine.module.config.kinds
        self.bias_rate = lc.router_bias_rate if setup.has_router_bias else 0.0
        self.steps_done = 0  # optimizer updates so far (restored with a checkpoint): the lr schedule's clock

    def train_step(self, shard: TrainBatch, num_tokens_global: int, num_seqs_global: int | None = None
                   ) -> dict[str, float]:
        """One optimizer update over this rank's shard. Returns rank-local metrics."""
        t0 = time.perf_counter()
        lc = self.lc
        self.engine.train()
        if num_seqs_global is None:
            num_seqs_global = shard.num_loss_seqs
        norm = max(num_seqs_global if self.obj.per_sequence else num_tokens_global, 1) / self.world_size
        parts, load_LE, loss_sum, aux_sum = [], None, 0.0, 0.0
        mbs = self._micro_batches(shard, self.setup.topk if shard.routed_experts is not None else None)
        for mb in mbs:
            with self.autocast():
                fwd = learner_forward(self.engine.module, mb.input_ids, mb.pos, mb.seg, mb.replay,
                                      lc.gradient_checkpointing, mb.images, mb.prefix, indexer_loss=self.train_indexer,
                                      logits=False)
            # in chunks over the tokens: no [B, T, V] logits (learner/logprobs.py)
            logp, entropy = chunked_logprobs(fwd.hidden_BTH, self.engine.module.lm_head.weight, mb.input_ids,
                                             self.temperature, entropy=True)
            inp, mismatch = self._loss_inputs(mb, fwd, logp, entropy if self.entropy_grad else entropy.detach(), norm)
            loss, m = self.obj.loss(inp)
            if lc.aux_loss_coef:
                loss = loss + lc.aux_loss_coef * fwd.aux_loss * mb.num_seqs / max(len(shard), 1)
            if self.train_indexer:
                loss = loss + lc.indexer_loss_coef * fwd.indexer_loss * mb.num_seqs / max(len(shard), 1)
                m = {**m, "indexer_kl": fwd.indexer_loss.item()}
            self.engine.backward(loss)
            parts.append({**m, **mismatch})
            loss_sum += loss.item()
            aux_sum += fwd.aux_loss.item() / len(mbs)
            load_LE = fwd.expert_load_LE if load_LE is None else load_LE + fwd.expert_load_LE
        lr = self._set_lr()
        grad_norm = None
        if self.setup.own_clip:
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

    def _loss_inputs(self, mb: MicroBatch, fwd, logp: torch.Tensor, entropy: torch.Tensor, norm: float
                     ) -> tuple[LossInputs, dict[str, float]]:
        """The loss's inputs for one micro-batch, and the mismatch metrics (the correction runs once)."""
        seq = mb.seg.clamp(min=0)
        learner_old = logp.detach()
        weight, mismatch = self.obj.correction(learner_old, mb.old_logprobs, mb.loss_mask, seq, mb.num_seqs)
        ref = None
        if self.setup.ref_model is not None:
            with torch.no_grad(), self.autocast():
                ref_fwd = learner_forward(self.setup.ref_model, mb.input_ids, mb.pos, mb.seg, mb.replay,
                                          image_patches=mb.images, prefix=mb.prefix, logits=False)
                ref, _ = chunked_logprobs(ref_fwd.hidden_BTH, self.setup.ref_model.lm_head.weight, mb.input_ids,
                                          self.temperature)
        terms = self.obj.estimator.token_terms(mb, self.values(self.engine.module, fwd.hidden_BTH))
        inp = LossInputs(logp, self.obj.behaviour(learner_old, mb.old_logprobs), terms.adv_BT, mb.loss_mask, seq,
                         mb.num_seqs, norm, weight if self.obj.reweights else None, ref,
                         entropy, terms.values_BT, terms.old_values_BT,
                         terms.returns_BT)
        return inp, mismatch

    def _set_lr(self) -> float:
        """Set this update's learning rate (``learner.lr_schedule`` at ``steps_done`` of ``algo.total_steps``)
        on every parameter group → it."""
        lr = self.lr_at(self.lc.lr, self.steps_done, self.total_steps)
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _micro_batches(self, batch: TrainBatch, topk: tuple[int, int] | None) -> list[MicroBatch]:
        lc, pad = self.lc, self.tok.pad_id
        mbs = micro_batches(batch, lc.micro_batch_size, pad, self.dtype, max_tokens=lc.max_tokens_per_micro_batch,
                            pack=lc.pack_sequences, topk=topk, image=self.setup.image,
                            share_prefix=self.setup.share_prefix and topk is None)
        if lc.ep_size > 1:  # every rank of the expert-parallel group runs the same number of passes
            n = torch.tensor([len(mbs)], device=self.device)  # NCCL reduces device tensors only
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            empty = TrainBatch([[pad]], [[0]], [[0.0]], [0.0], [0.0],
                               None if topk is None else [torch.full((1, *topk), -1, dtype=ROUTE_DTYPE)])  # -1: no routes
            mbs += [collate(empty, False, pad, self.dtype, topk, self.setup.image) for _ in range(int(n) - len(mbs))]
        return [mb.to(self.device) for mb in mbs]

    def _expert_load(self, load_LE: torch.Tensor | None) -> dict[str, float]:
        """Global (all-ranks) expert load per layer; the aux-loss-free bias update when the model has one."""
        if load_LE is None:
            return {}
        if self.world_size > 1:
            dist.all_reduce(load_LE)
        out: dict[str, float] = {}
        mean_L = load_LE.mean(-1).clamp_min(1e-12)
        for layer, (row, mean) in enumerate(zip(load_LE, mean_L)):
            out[f"experts/layer{layer}_max_over_mean"] = float(row.max() / mean)
            out[f"experts/layer{layer}_dead"] = float((row == 0).sum())
        out["experts/dead_total"] = float((load_LE == 0).sum())
        if self.bias_rate > 0:
            out.update(update_router_bias(self.engine.module, load_LE, self.bias_rate))
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
            with self.autocast():
                hidden_BTH = learner_forward(self.engine.module, mb.input_ids, mb.pos, mb.seg,
                                             image_patches=mb.images, logits=False).hidden_BTH
            lp, _ = chunked_logprobs(hidden_BTH, self.engine.module.lm_head.weight, mb.input_ids, self.temperature)
            for b in range(lp.shape[0]):
                for i in sorted(set(mb.seg[b][mb.seg[b] >= 0].tolist())):
                    out.append(lp[b][mb.seg[b] == i].tolist())
        return out[:len(token_ids)]
