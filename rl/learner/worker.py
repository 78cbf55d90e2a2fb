"""``LearnerWorker``: one DeepSpeed data-parallel rank (a Ray actor; gloo on CPU, NCCL on GPU).

The driver creates ``learner.num_ranks`` of these, all holding the same model, and hands
each its shard of the step's ``TrainBatch``. ZeRO-2 partitions gradients and optimizer
state across ranks; parameters stay whole on every rank, so rank 0 builds the weight push.

Gradient accumulation is caller-owned (DeepSpeed's ``managed_gradient_accumulation:
false``): every micro-batch only accumulates, one ``step()`` per RL step reduces and
updates, so ranks may hold different numbers of micro-batches. Normalisation: each
micro-batch's loss is ``sum of token losses / N_global * world_size``; DeepSpeed averages
gradients over ranks, so the update equals the token-mean over the whole global batch,
however it is split (DAPO token-mean; tested for micro-batch invariance).

Precision: the forward and the loss run in the model's dtype (float64 in exactness tests),
but ZeRO's optimizer keeps fp32 master weights, so updates land with fp32 rounding.
"""

from __future__ import annotations

import os
import time

import torch

from jointrl.model.tokenizer import ByteTokenizer
from jointrl.rl.build import DTYPES, build_model
from jointrl.rl.config import Config
from jointrl.rl.learner.batch import TrainBatch, logprobs_from_logits, micro_batches, position_ids, token_logprobs
from jointrl.rl.losses import GRPOLoss


def deepspeed_config(cfg: Config) -> dict:
    lc = cfg.learner
    return {
        "train_micro_batch_size_per_gpu": lc.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": lc.grad_clip,
        "zero_optimization": {"stage": lc.zero_stage, "overlap_comm": False, "contiguous_gradients": True},
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class LearnerWorker:
    def __init__(self, cfg: Config, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.tok = ByteTokenizer()
        self.loss_fn = GRPOLoss(cfg.algo.clip_low, cfg.algo.clip_high)
        self.dtype = DTYPES[cfg.model.dtype]
        model = build_model(cfg)
        lc = cfg.learner
        opt = torch.optim.AdamW(model.parameters(), lr=lc.lr, betas=tuple(lc.betas), eps=lc.eps, weight_decay=lc.weight_decay)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=deepspeed_config(cfg))
        self.temperature = cfg.rollout.temperature or 1.0

    def ready(self) -> int:
        return self.rank

    def train_step(self, shard: TrainBatch, num_tokens_global: int) -> dict[str, float]:
        """One optimizer update over this rank's shard. Returns rank-local metrics."""
        t0 = time.perf_counter()
        self.engine.train()
        metrics: dict[str, float] = {"loss": 0.0, "clip_frac": 0.0, "approx_kl": 0.0, "aux_loss": 0.0}
        mbs = micro_batches(shard, self.cfg.learner.micro_batch_size, self.tok.pad_id, self.dtype)
        tokens = 0
        for mb in mbs:
            out = self.engine(mb.input_ids, position_ids=position_ids(mb.attention_mask), attention_mask=mb.attention_mask)
            logp = logprobs_from_logits(out.logits, mb.input_ids, self.temperature)
            old = logp.detach() if self.cfg.algo.behaviour_logprobs == "learner" else mb.old_logprobs
            loss, m = self.loss_fn(logp, old, mb.advantages, mb.loss_mask, num_tokens_global / self.world_size)
            if self.cfg.learner.aux_loss_coef:
                loss = loss + self.cfg.learner.aux_loss_coef * out.aux_loss * len(mb.advantages) / max(len(shard), 1)
            self.engine.backward(loss)
            metrics["loss"] += loss.item()
            metrics["aux_loss"] += out.aux_loss.item() / len(mbs)
            for k in ("clip_frac", "approx_kl"):
                metrics[k] += m[k] * m["tokens"]
            tokens += m["tokens"]
        self.engine.step()
        for k in ("clip_frac", "approx_kl"):
            metrics[k] /= max(tokens, 1)
        metrics["tokens"] = tokens
        metrics["grad_norm"] = float(self.engine.get_global_grad_norm() or 0.0)
        metrics["time_s"] = time.perf_counter() - t0
        return metrics

    @torch.no_grad()
    def logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Per-token log-probs of the given sequences under the current weights."""
        self.engine.eval()
        batch = TrainBatch(token_ids, [[0] * len(s) for s in token_ids], [[0.0] * len(s) for s in token_ids],
                           [0.0] * len(token_ids))
        out = []
        for mb in micro_batches(batch, self.cfg.learner.micro_batch_size, self.tok.pad_id, self.dtype):
            lp = token_logprobs(self.engine.module, mb.input_ids, mb.attention_mask, self.temperature)
            out += [lp[b, : int(mb.attention_mask[b].sum())].tolist() for b in range(lp.shape[0])]
        return out

    def weight_bundle(self, version: int):
        from jointrl.rl.weight_sync import build_bundle, is_routed_expert

        quantize = is_routed_expert if self.cfg.rollout.quantize_experts else (lambda name, t: False)
        state = {k: v.detach() for k, v in self.engine.module.state_dict().items()}
        return build_bundle(state, version=version, is_quantized=quantize)

    def save_checkpoint(self, directory: str, step: int) -> None:
        self.engine.save_checkpoint(directory, tag=f"step_{step}", client_state={"step": step})

    def load_checkpoint(self, directory: str) -> int | None:
        """Load the latest checkpoint in ``directory``; the step it was saved at, or None."""
        if not os.path.exists(os.path.join(directory, "latest")):
            return None
        path, client = self.engine.load_checkpoint(directory)
        return None if path is None else int(client["step"])

