"""``RolloutWorker``: a Ray actor that owns one rollout engine and its weights."""

from __future__ import annotations

import torch

from jointrl.model.tokenizer import ByteTokenizer
from jointrl.rl.build import build_model
from jointrl.rl.config import Config
from jointrl.rl.rollout.sampler import SimpleSampler
from jointrl.rl.types import GenerationOutput, SamplingParams


class RolloutWorker:
    """Async actor: concurrent ``generate`` calls from env workers are batched by the engine."""

    def __init__(self, cfg: Config) -> None:
        torch.manual_seed(cfg.seed)
        self.engine = SimpleSampler(build_model(cfg), ByteTokenizer(), max_batch=cfg.rollout.max_batch)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        return await self.engine.generate(prompt_ids, params)

    def update_weights(self, version: int, bundle) -> int:
        self.engine.update_weights(version, bundle)
        return version

    async def close(self) -> None:
        await self.engine.close()

    def version(self) -> int:
        return self.engine.version
