"""Typed records that cross actor boundaries in the RL loop.

Env-side records (``Task``, ``ToolCall``, ``Message``, ``Observation``) live in
``jointrl.envs.base`` and ``RewardResult`` in ``jointrl.rewards.base``, because those
packages may not import ``rl``; they are re-exported here so ``rl`` code has one place to
import records from.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from jointrl.envs.base import Message, Observation, Task, ToolCall, ToolSpec
from jointrl.rewards.base import RewardResult

__all__ = [
    "FinishReason", "GenerationOutput", "Message", "Observation", "RewardResult",
    "SamplingParams", "Task", "ToolCall", "ToolSpec", "Trajectory",
]


class FinishReason(enum.StrEnum):
    STOP = "stop"  # the model ended its turn without a tool call, or called ``submit``
    TOOL_LIMIT = "tool_limit"  # the task's max_turns ran out
    LENGTH = "length"  # a turn hit max_tokens without <|im_end|>
    CONTEXT_OVERFLOW = "context_overflow"  # the history no longer fits the context
    ENV_ERROR = "env_error"  # infrastructure failure after retries: excluded, counted
    TIMEOUT = "timeout"  # the episode's wall-clock budget ran out


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings. ``top_k=0`` and ``top_p=1`` disable those filters.

    ``max_think_tokens`` is the per-turn thinking budget (None: unlimited); at the limit the
    engine forces ``</think>`` (a forced token: loss-masked, its log-prob unused).
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    max_think_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_think_tokens is not None and self.max_think_tokens < 0:
            raise ValueError(f"max_think_tokens must be >= 0 or None, got {self.max_think_tokens}")


@dataclass(slots=True)
class GenerationOutput:
    """One engine turn: the new tokens, in order, as the engine produced them.

    ``sampled[i]`` is 1 for a token the policy sampled and 0 for a forced one (the
    budget-closing ``</think>``); ``logprobs[i]`` is the engine's log-prob of a sampled token
    (0.0 for forced ones). ``finish_reason`` is ``"stop"`` (a stop token, included in
    ``token_ids``) or ``"length"``.
    """

    token_ids: list[int]
    logprobs: list[float]
    sampled: list[int]
    finish_reason: str
    policy_version: int
    # routing replay: [token][moe layer][k] expert ids of every token the engine ran through the
    # model in this call, from prompt position `routed_from` on: the prompt part it prefilled, then
    # token_ids[:-1] (the last new token was never an input). None when not recorded.
    routed_experts: list[list[list[int]]] | None = None
    routed_from: int = 0


@dataclass(slots=True)
class Trajectory:
    """One episode in token space: exactly the ids the engine produced and saw.

    ``loss_mask[i]`` is 1 only on tokens the policy sampled; prompt, template glue, forced
    tokens and tool observations are 0. ``logprobs`` and ``policy_version`` are per token
    (0.0 / -1 where the token was not sampled).
    """

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    policy_version: list[int]
    domain: str
    task_id: str
    group_id: str
    tier: str = "low"
    finish_reason: FinishReason = FinishReason.STOP
    reward: float = 0.0
    reward_info: dict[str, Any] = field(default_factory=dict)
    messages: list[Message] = field(default_factory=list)
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    env_retries: int = 0
    reward_time_s: float = 0.0  # wall time spent in the reward modules
    # [token][moe layer][k]: the experts the engine's first forward over each token used (routing
    # replay); None for a token the engine never ran as input (the episode's last token: no log-prob
    # depends on it). The whole field is None when the engine does not record routes.
    routed_experts: list[list[list[int]] | None] | None = None
    # [P, patch_dim] float: one row per <image> id in token_ids, in order (rl/image_inputs.py;
    # an <image> the policy sampled gets a zero row); None when the episode ran without images
    image_patches: Any = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        assert len(self.loss_mask) == n and len(self.logprobs) == n and len(self.policy_version) == n, (
            "Trajectory per-token fields must have one entry per token"
        )

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["finish_reason"] = str(self.finish_reason)
        out["messages"] = [m.to_openai() for m in self.messages]
        out["image_patches"] = None if self.image_patches is None else list(self.image_patches.shape)
        return out
