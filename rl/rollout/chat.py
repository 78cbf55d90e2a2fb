"""``ChatService``: one chat turn for the HTTP APIs, shared by the OpenAI and Anthropic shapes.

    request (API-neutral ChatRequest) -> ConversationStore.prepare (reuse recorded tokens)
    -> context check -> generate_turn(engine, prompt_ids, SamplingParams, budget) -> parse_turn
    -> ConversationStore.commit -> ChatReply

Both APIs render through the same chat template (``model/chat_template.py``) and call the
engine only through the ``RolloutEngine`` protocol, so any backend serves. The thinking
budget is a per-turn token count (``max_think_tokens``), enforced by ``generate_turn`` as in
the agent loop; the APIs map their own knobs onto it (OpenAI ``thinking_budget`` tier ->
``rollout.thinking_budget``; Anthropic ``thinking.budget_tokens``).

Errors a client caused raise ``RequestError`` (an HTTP 4xx, naming the field); a prompt that
does not leave room for one token under ``max_context`` is a 400 on ``messages``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from jointrl.envs.base import Message, ToolSpec
from jointrl.model.chat_template import ChatTemplate
from jointrl.rl.parser import CallError, parse_turn
from jointrl.rl.rollout.engine import RolloutEngine
from jointrl.rl.rollout.recorder import Conversation, ConversationStore
from jointrl.rl.rollout.turn import generate_turn
from jointrl.rl.types import GenerationOutput, SamplingParams


class RequestError(ValueError):
    """A client's mistake: ``status`` (4xx), the offending ``param`` and a message naming it."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """One chat turn, API-neutral. ``tool_choice``: ``auto`` | ``none`` | ``required`` | a tool name
    (``none`` hides the tools from the model; the others cannot be enforced without constrained
    decoding and are validated only)."""

    messages: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: str = "auto"
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_think_tokens: int | None | str = "default"  # None: unlimited; "default": the server's tier
    stream: bool = False
    conversation_id: str | None = None  # match only this recorded conversation


def request_field(obj: dict, key: str, types: type | tuple, where: str, required: bool = False,
                  default: Any = None) -> Any:
    """``obj[key]`` checked against ``types`` (a bool is no int), or ``default``; errors name ``where + key``."""
    if key not in obj or obj[key] is None:
        if required:
            raise RequestError(f"missing required field '{where}{key}'", f"{where}{key}")
        return default
    value = obj[key]
    allowed = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        names = " or ".join(t.__name__ for t in allowed)
        raise RequestError(f"'{where}{key}' must be {names}, got {type(value).__name__}", f"{where}{key}")
    return value


def think_tokens(raw: Any, tiers: dict[str, int | None], param: str) -> int | None | str:
    """A tier name or a token count -> per-turn thinking tokens; ``"default"`` when absent."""
    if raw is None:
        return "default"
    if isinstance(raw, str):
        if raw not in tiers:
            raise RequestError(f"'{param}' must be one of {sorted(tiers)} or a token count, got {raw!r}", param)
        return tiers[raw]
    if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
        return raw
    raise RequestError(f"'{param}' must be one of {sorted(tiers)} or a token count >= 0, got {raw!r}", param)


def chat_request(body: dict, *, messages: list[Message], tools: list[ToolSpec], tool_choice: str,
                 max_tokens: int | None, max_think_tokens: int | None | str, max_temperature: float,
                 stop_key: str) -> ChatRequest:
    """The fields both APIs share (sampling, ``seed``, ``stream``, ``conversation_id``), checked,
    around what each API parsed its own way. ``stop_key`` names the API's (refused) stop strings."""
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"'max_tokens' must be >= 1, got {max_tokens}", "max_tokens")
    temperature = request_field(body, "temperature", (int, float), "", default=None)
    if temperature is not None and not 0 <= temperature <= max_temperature:
        raise RequestError(f"'temperature' must be in [0, {max_temperature:g}], got {temperature}", "temperature")
    top_p = request_field(body, "top_p", (int, float), "", default=None)
    if top_p is not None and not 0 < top_p <= 1:
        raise RequestError(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = request_field(body, "top_k", int, "", default=None)
    if top_k is not None and top_k < 0:
        raise RequestError(f"'top_k' must be >= 0, got {top_k}", "top_k")
    if body.get(stop_key):
        raise RequestError(f"'{stop_key}' is not supported: the engine stops at the end of the turn", stop_key)
    return ChatRequest(messages=messages, tools=tools, tool_choice=tool_choice, max_tokens=max_tokens,
                       temperature=temperature, top_p=top_p, top_k=top_k,
                       seed=request_field(body, "seed", int, "", default=None), max_think_tokens=max_think_tokens,
                       stream=request_field(body, "stream", bool, "", default=False),
                       conversation_id=request_field(body, "conversation_id", str, "", default=None))


@dataclass(frozen=True, slots=True)
class ChatReply:
    message: Message  # content, reasoning and well-formed tool calls (ids unique per server)
    call_errors: list[CallError]  # malformed calls the model wrote (not returned as tool calls)
    output: GenerationOutput  # the turn's tokens, log-probs and sampled mask
    finish_reason: str  # "stop" | "length" (the engine's)
    prompt_tokens: int
    reused_tokens: int  # prompt tokens taken from the recorded conversation
    reasoning_tokens: int
    conversation_id: str


@dataclass(frozen=True, slots=True)
class ServiceLimits:
    max_context: int = 2048
    default_max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


class ChatService:
    def __init__(self, engine: RolloutEngine, template: ChatTemplate, store: ConversationStore,
                 limits: ServiceLimits, default_think_tokens: int | None = None) -> None:
        self.engine, self.template, self.store, self.limits = engine, template, store, limits
        self.default_think_tokens = default_think_tokens
        self._call_counter = 0

    async def complete(self, req: ChatRequest) -> ChatReply:
        tools = [] if req.tool_choice == "none" else req.tools
        try:
            prep = self.store.prepare(req.messages, tools, req.conversation_id)
        except KeyError:
            raise RequestError(f"'conversation_id' {req.conversation_id!r} names no open conversation",
                               "conversation_id", 404, "not_found_error") from None
        room = self.limits.max_context - len(prep.prompt_ids)
        if room < 1:
            raise RequestError(f"the conversation renders to {len(prep.prompt_ids)} tokens, over this server's "
                               f"context limit of {self.limits.max_context} tokens; shorten 'messages'", "messages")
        want = req.max_tokens if req.max_tokens is not None else self.limits.default_max_tokens
        lim = self.limits
        params = SamplingParams(
            max_tokens=min(want, room),
            temperature=lim.temperature if req.temperature is None else req.temperature,
            top_p=lim.top_p if req.top_p is None else req.top_p,
            top_k=lim.top_k if req.top_k is None else req.top_k,
            seed=req.seed)
        budget = self.default_think_tokens if req.max_think_tokens == "default" else req.max_think_tokens
        out = await generate_turn(self.engine, prep.prompt_ids, params, budget, self.template.tok)
        turn = parse_turn(out.token_ids, self.template.tok)
        calls, errors = [], []
        for c in turn.calls:
            if isinstance(c, CallError):
                errors.append(c)
            else:
                self._call_counter += 1
                calls.append(dataclasses.replace(c, id=f"call_{self._call_counter}_{prep_id(prep.prompt_ids)}"))
        reply = Message(role="assistant", content=turn.content, reasoning=turn.reasoning,
                        tool_calls=calls if req.tool_choice != "none" else [])
        conv: Conversation = self.store.commit(prep, out, reply)
        return ChatReply(reply, errors, out, out.finish_reason, len(prep.prompt_ids), prep.reused_tokens,
                         out.think_tokens, conv.id)


def prep_id(ids: list[int]) -> str:
    """A short tag that makes call ids differ between servers and conversations."""
    return f"{(hash(tuple(ids[-64:])) & 0xFFFFFFFF):08x}"


