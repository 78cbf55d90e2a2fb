"""Colocated mode in one process: the rollout engine and a learner rank share one device.

    rollout (engine awake)  →  engine.sleep()  →  learner forward / backward / AdamW
        →  MXFP4 push built on the device  →  engine.update_weights  →  engine.wake_up()

The learner is ``setup_local_rank`` (one rank, no DeepSpeed, no process group) with the same
``TrainStep`` the Ray learner runs; the engine is the own ``LLMEngine`` on the same device, holding
its own copy of the policy (built on the meta device from the same config and seed, so it starts
equal to the learner's). The push is ``WeightPusher.bundle(device=None)``: routed experts quantized
to MXFP4 where the learner's weights are (the Triton kernel on a GPU), every payload left on the
device, decoded into the engine's weights in place. Nothing of a push leaves the device but its
checksums (hashed from host copies). While the learner steps, the engine holds no KV pool
(``rollout/sleep.py``; ``offload_weights`` also moves its weights to the host).

Guarantee (tested on the host, ``tests/rl/test_colocate.py``): after a step the engine's tokens and
log-probs equal those of a fresh engine built from the pushed weights alone; its weights equal the
learner's, routed experts as their MXFP4 round trip.
"""

from __future__ import annotations

import torch

from jointrl.rl.build import build_model, build_tokenizer
from jointrl.rl.config import Config
from jointrl.rl.device import as_device
from jointrl.rl.learner.batch import TrainBatch
from jointrl.rl.learner.objective import build_objective
from jointrl.rl.learner.push import WeightPusher
from jointrl.rl.learner.setup import setup_local_rank
from jointrl.rl.learner.step import TrainStep
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.types import GenerationOutput, SamplingParams
from jointrl.rl.weight_sync import WeightBundle


def train_batch(prompts: list[list[int]], outputs: list[GenerationOutput], advantages: list[float]) -> TrainBatch:
    """A ``TrainBatch`` of each prompt and its completion: the loss on the sampled tokens, their
    engine log-probs as the behaviour policy's."""
    if not len(prompts) == len(outputs) == len(advantages):
        raise ValueError(f"{len(prompts)} prompts, {len(outputs)} outputs, {len(advantages)} advantages")
    return TrainBatch([p + o.token_ids for p, o in zip(prompts, outputs)],
                      [[0] * len(p) + list(o.sampled) for p, o in zip(prompts, outputs)],
                      [[0.0] * len(p) + list(o.logprobs) for p, o in zip(prompts, outputs)], list(advantages))


class Colocated:
    """One learner rank and one engine on ``device`` (None: ``rl/device.rank_device()``)."""

    def __init__(self, cfg: Config, engine_config: EngineConfig | None = None,
                 device: torch.device | str | None = None, offload_weights: bool = False) -> None:
        self.device = as_device(device)
        self.offload_weights = offload_weights
        objective = build_objective(cfg)
        self.setup = setup_local_rank(cfg, objective, self.device)
        self.learner = TrainStep(cfg, self.setup, objective, world_size=1)
        self.pusher = WeightPusher(cfg, self.setup.engine.module, rank=0)
        self.engine = LLMEngine(build_model(cfg, self.device), build_tokenizer(cfg), engine_config, device=self.device)
        self.version = 0
        self.last_push: WeightBundle | None = None

    def rollout(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationOutput]:
        return self.engine.generate_batch(prompts, params)

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """Engine asleep → one learner update over ``batch`` → push version + 1 → engine awake.
        → the learner's metrics."""
        self.engine.sleep(self.offload_weights)
        metrics = self.learner.train_step(batch, batch.num_loss_tokens, batch.num_loss_seqs)
        self.version += 1
        self.last_push = self.pusher.bundle(self.version, device=None)  # built and kept on the device
        self.engine.update_weights(self.version, self.last_push)
        self.engine.wake_up()
        return metrics
