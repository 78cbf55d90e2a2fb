"""The ``RolloutEngine`` protocol: what the agent loop and the trainer need from an engine.

Any backend -- the skeleton's ``SimpleSampler``, the fast engine, a vLLM/SGLang adapter --
implements this. The agent loop talks only to this protocol, in process or through Ray
actors (``rl/rollout/router.RoutedEngineClient``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from jointrl.rl.types import GenerationOutput, SamplingParams


@runtime_checkable
class RolloutEngine(Protocol):
    @property
    def version(self) -> int:
        """Policy version of the weights generating now."""
        ...

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        """Continue ``prompt_ids`` by one assistant turn (until a stop token or max_tokens).

        Engines that read screenshots (``LLMEngine``, ``SimpleSampler``) also take
        ``image_patches=`` [P, patch_dim]: one row per ``<image>`` id of ``prompt_ids``
        (``rl/image_inputs.slot_patches``); the agent loop passes it only when there are images."""
        ...

    def update_weights(self, version: int, bundle: Any) -> None:
        """Load a ``jointrl.rl.weight_sync.WeightBundle``; called between batches."""
        ...

