"""Typed records that cross actor boundaries in the RL loop.

Env-side records (``Task``, ``ToolCall``, ``Message``, ``Observation``) live in
``jointrl.envs.base`` and ``RewardResult`` in ``jointrl.rewards.base``, because those
packages may not import ``rl``; they are re-exported here so ``rl`` code has one place to
import records from.
"""

from __future__ import annotations

import base64
import enum
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from jointrl.envs.base import Message, Observation, Task, ToolCall, ToolSpec
from jointrl.rewards.base import RewardResult

__all__ = [
    "FinishReason", "GenerationOutput", "Message", "Observation", "RewardResult",
    "SamplingParams", "Task", "ToolCall", "ToolSpec", "Trajectory", "ROUTE_DTYPE",
    "merge_routes", "tensor_from_json", "tensor_to_json",
]

# routed expert ids [tokens, moe layers, top_k] (the layout vLLM returns); -1 marks a token with
# no recorded routes. int16 holds expert ids of any model up to 32767 experts, a quarter of int64.
ROUTE_DTYPE = torch.int16


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

    A request ends at ``<|im_end|>``, at any of ``stop_token_ids`` (the stop token is returned)
    or after ``max_tokens``. The thinking budget is not an engine setting: the agent loop and the
    server enforce it through these two (``rl/rollout/turn.generate_turn``).
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass(slots=True)
class GenerationOutput:
    """One engine call, or one whole turn (``rl/rollout/turn.generate_turn``): the new tokens, in order.

    ``sampled[i]`` is 1 for a token the policy sampled and 0 for a forced one (the
    budget-closing ``</think>`` the turn appends; an engine samples every token it returns);
    ``logprobs[i]`` is the engine's log-prob of a sampled token (0.0 for forced ones).
    ``finish_reason`` is ``"stop"`` (a stop token, included in ``token_ids``) or ``"length"``.
    ``policy_version``: the weights that sampled the turn's first token.
    ``think_tokens``: sampled reasoning tokens before ``</think>`` (set by ``generate_turn``; an
    engine call leaves 0).
    """

    token_ids: list[int]
    logprobs: list[float]
    sampled: list[int]
    finish_reason: str
    policy_version: int
    # routing replay: [n, moe layers, k] ROUTE_DTYPE expert ids of the n positions the engine ran
    # through the model in this call, from prompt position `routed_from` on: the prompt part it
    # prefilled, then token_ids[:-1] (the last new token was never an input). None when not recorded.
    routed_experts: torch.Tensor | None = None
    routed_from: int = 0
    think_tokens: int = 0


@dataclass(slots=True)
class Trajectory:
    """One episode in token space: exactly the ids the engine produced and saw.

    ``loss_mask[i]`` is 1 only on tokens the policy sampled; prompt, template glue, forced
    tokens and tool observations are 0. ``logprobs`` and ``policy_version`` are per token
    (0.0 / -1 where the token was not sampled). ``think_tokens``: sampled reasoning tokens of
    all turns, as the turns counted them (``GenerationOutput.think_tokens``).
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
    think_tokens: int = 0
    # [tokens, moe layers, k] ROUTE_DTYPE: the experts the engine's first forward over each token
    # used (routing replay); rows of -1 for a token the engine never ran as input (the episode's
    # last token: no log-prob depends on it). None when the engine does not record routes.
    routed_experts: torch.Tensor | None = None
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
        out["routed_experts"] = None if self.routed_experts is None else tensor_to_json(self.routed_experts)
        return out


def tensor_to_json(t: torch.Tensor) -> dict[str, Any]:
    """An int/float tensor as JSON: ``{"dtype", "shape", "data"}``, data the base64 of its
    little-endian bytes (a ``[T, L, k]`` int16 route tensor: 2 bytes an id, 4/3 of that in text)."""
    arr = t.detach().cpu().contiguous().numpy()
    return {"dtype": str(arr.dtype), "shape": list(arr.shape),
            "data": base64.b64encode(arr.astype(arr.dtype.newbyteorder("<")).tobytes()).decode("ascii")}


def tensor_from_json(d: dict[str, Any]) -> torch.Tensor:
    """The tensor ``tensor_to_json`` wrote, exactly (dtype, shape, values)."""
    dtype = np.dtype(d["dtype"]).newbyteorder("<")
    arr = np.frombuffer(base64.b64decode(d["data"]), dtype=dtype).reshape(d["shape"])
    return torch.from_numpy(arr.astype(arr.dtype.newbyteorder("=")))


def merge_routes(old: torch.Tensor, old_from: int, new: torch.Tensor, new_from: int) -> tuple[torch.Tensor, int]:
    """Routes [n, L, k] for positions ``old_from ..`` and ``new_from ..`` -> one tensor over the
    span of both and its first position. Where both recorded a position, ``old`` (the first
    recording: the forward its sampled successors were scored under) is kept; -1 rows where
    neither did."""
    start = min(old_from, new_from)
    end = max(old_from + len(old), new_from + len(new))
    out_NLk = new.new_full((end - start, *new.shape[1:]), -1)
    out_NLk[new_from - start:new_from - start + len(new)] = new
    known = old[:, 0, 0] >= 0
    out_NLk[old_from - start:old_from - start + len(old)][known] = old[known]
    return out_NLk, start
