"""``RolloutWorker``: a Ray actor that owns one rollout engine and its weights."""

from __future__ import annotations

import torch

from jointrl.model.tokenizer import ByteTokenizer
from jointrl.rl.build import build_model
from jointrl.rl.config import Config
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.rollout.sampler import SimpleSampler
from jointrl.rl.types import GenerationOutput, SamplingParams


class RolloutWorker:
    """Async actor: concurrent ``generate`` calls from env workers are batched by the engine."""

    def __init__(self, cfg: Config) -> None:
        torch.manual_seed(cfg.seed)
        r = cfg.rollout
        if r.backend == "engine":
            self.engine = LLMEngine(build_model(cfg), ByteTokenizer(), EngineConfig(
                num_blocks=r.num_blocks, block_size=r.block_size, max_num_seqs=r.max_batch,
                max_num_batched_tokens=r.max_num_batched_tokens, session_ttl_s=r.session_ttl_s,
                live_sessions=r.live_sessions,
                return_routed_experts=getattr(cfg.learner, "routing_replay", False)))
        else:
            self.engine = SimpleSampler(build_model(cfg), ByteTokenizer(), max_batch=r.max_batch,
                                        record_routes=cfg.learner.routing_replay)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        return await self.engine.generate(prompt_ids, params)

    def update_weights(self, version: int, bundle) -> int:
        self.engine.update_weights(version, bundle)
        return version

    async def close(self) -> None:
        await self.engine.close()

    def version(self) -> int:
        return self.engine.version
