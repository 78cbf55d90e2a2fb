"""The Anthropic Messages shape (``/v1/messages``): request parsing, responses, stream events, errors.

``parse_request(body, tiers)`` -> ``ChatRequest`` or ``RequestError`` naming the field.
Accepted: ``model``, ``max_tokens`` (required), ``system`` (string or text blocks),
``messages`` (user / assistant; string or content blocks: ``text``, assistant ``thinking``
and ``tool_use``, user ``tool_result`` answering a ``tool_use`` of the preceding assistant
message), ``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice``
(``auto`` / ``any`` / ``tool`` / ``none``), ``thinking`` (``{"type": "enabled",
"budget_tokens": n}`` -> n thinking tokens per turn; ``disabled`` -> 0, a ``</think>`` forced
at once), ``temperature``, ``top_p``, ``top_k``, ``stream``, ``conversation_id`` (``recorder.py``).
``stop_sequences`` are refused.

Mapping onto the chat template: a user message's ``tool_result`` blocks become ``tool`` turns
(in order) and its text a ``user`` turn after them; an assistant message's ``thinking`` blocks
are its reasoning, text blocks its content, ``tool_use`` blocks its tool calls. Thinking comes
back as a ``thinking`` block (``signature``: a digest of the text, not a secret) and, sent
back, re-enters the context as it was generated. Errors: ``{"type": "error", "error":
{"type", "message"}}``.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

from jointrl.envs.base import Message, ToolCall, ToolSpec
from jointrl.rl.rollout.chat import ChatReply, ChatRequest, RequestError, chat_request, think_tokens
from jointrl.rl.rollout.chat import request_field as _field


def error_body(err: RequestError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": err.kind, "message": err.message}}


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(f"'{where}' must be a string or a list of content blocks, got {type(content).__name__}", where)
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise RequestError(f"'{where}[{j}]' must be a content block with a 'type'", f"{where}[{j}]")
    return content


def _result_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    return "".join(b.get("text", "") if b["type"] == "text" else _bad(b, where) for b in _blocks(content, where))


def _bad(block: dict, where: str) -> str:
    raise RequestError(f"'{where}' holds a {block['type']!r} block; only text is supported there", where)


def _messages(system: Any, raw: Any) -> list[Message]:
    out: list[Message] = []
    if system is not None:
        text = "".join(b.get("text", "") if b["type"] == "text" else _bad(b, "system") for b in _blocks(system, "system"))
        out.append(Message(role="system", content=text))
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty list", "messages")
    open_calls: dict[str, str] = {}  # tool_use id -> tool name, of the preceding assistant message
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"'{where}' must be an object, got {type(m).__name__}", where)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise RequestError(f"'{where}.role' must be 'user' or 'assistant', got {role!r}", f"{where}.role")
        if "content" not in m:
            raise RequestError(f"missing required field '{where}.content'", f"{where}.content")
        blocks = _blocks(m["content"], f"{where}.content")
        if role == "assistant":
            reasoning, text, calls = [], [], []
            for j, b in enumerate(blocks):
                w = f"{where}.content[{j}]"
                if b["type"] == "thinking":
                    reasoning.append(_field(b, "thinking", str, f"{w}.", required=True))
                elif b["type"] == "text":
                    text.append(_field(b, "text", str, f"{w}.", required=True))
                elif b["type"] == "tool_use":
                    calls.append(ToolCall(name=_field(b, "name", str, f"{w}.", required=True),
                                          arguments=_field(b, "input", dict, f"{w}.", required=True),
                                          id=_field(b, "id", str, f"{w}.", required=True)))
                else:
                    raise RequestError(f"'{w}.type' {b['type']!r} is not supported in an assistant message", f"{w}.type")
            open_calls = {c.id: c.name for c in calls}
            out.append(Message(role="assistant", content="".join(text), reasoning="".join(reasoning), tool_calls=calls))
            continue
        text = []
        for j, b in enumerate(blocks):
            w = f"{where}.content[{j}]"
            if b["type"] == "tool_result":
                cid = _field(b, "tool_use_id", str, f"{w}.", required=True)
                if cid not in open_calls:
                    raise RequestError(f"'{w}.tool_use_id' {cid!r} answers no tool_use of the preceding assistant "
                                       "message (or answers it twice)", f"{w}.tool_use_id")
                called = open_calls.pop(cid)  # the result names its call's tool (harmony renders the name)
                out.append(Message(role="tool", content=_result_text(b.get("content"), f"{w}.content"), name=called,
                                   tool_call_id=cid))
            elif b["type"] == "text":
                text.append(_field(b, "text", str, f"{w}.", required=True))
            else:
                raise RequestError(f"'{w}.type' {b['type']!r} is not supported in a user message", f"{w}.type")
        open_calls = {}
        if text or not any(b["type"] == "tool_result" for b in blocks):
            out.append(Message(role="user", content="".join(text)))
    return out


def _tools(raw: Any) -> list[ToolSpec]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError(f"'tools' must be a list, got {type(raw).__name__}", "tools")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise RequestError(f"'tools[{i}]' must be an object", f"tools[{i}]")
        out.append(ToolSpec(name=_field(t, "name", str, f"tools[{i}].", required=True),
                            description=_field(t, "description", str, f"tools[{i}].", default=""),
                            parameters=_field(t, "input_schema", dict, f"tools[{i}].", required=True)))
    return out


def _tool_choice(raw: Any, tools: list[ToolSpec]) -> str:
    if raw is None:
        return "auto"
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(raw.get("name"), str):
        if raw["name"] not in {t.name for t in tools}:
            raise RequestError(f"'tool_choice.name' {raw['name']!r} is not in 'tools'", "tool_choice.name")
        return raw["name"]
    raise RequestError("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", "
                       "\"name\": ...}", "tool_choice")


def _thinking(raw: Any, tiers: dict[str, int | None], body: dict) -> int | None | str:
    if raw is None:
        return think_tokens(body.get("thinking_budget"), tiers, "thinking_budget")
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "disabled":
        return 0
    if kind == "enabled":
        n = _field(raw, "budget_tokens", int, "thinking.", required=True)
        if n < 0:
            raise RequestError(f"'thinking.budget_tokens' must be >= 0, got {n}", "thinking.budget_tokens")
        return n
    raise RequestError("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": n} or {\"type\": \"disabled\"}",
                       "thinking")


def parse_request(body: Any, tiers: dict[str, int | None]) -> tuple[ChatRequest, dict[str, Any]]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    max_tokens = _field(body, "max_tokens", int, "", required=True)
    messages = _messages(body.get("system"), body.get("messages"))
    tools = _tools(body.get("tools"))
    req = chat_request(body, messages=messages, tools=tools, tool_choice=_tool_choice(body.get("tool_choice"), tools),
                       max_tokens=max_tokens, max_think_tokens=_thinking(body.get("thinking"), tiers, body),
                       max_temperature=1.0, stop_key="stop_sequences")
    return req, {"model": _field(body, "model", str, "", default="")}


def _signature(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _content(reply: ChatReply) -> list[dict[str, Any]]:
    m = reply.message
    blocks: list[dict[str, Any]] = []
    if m.reasoning:
        blocks.append({"type": "thinking", "thinking": m.reasoning, "signature": _signature(m.reasoning)})
    if m.content:
        blocks.append({"type": "text", "text": m.content})
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in m.tool_calls]
    return blocks


def _stop_reason(reply: ChatReply) -> str:
    if reply.finish_reason != "stop":
        return "max_tokens"
    return "tool_use" if reply.message.tool_calls else "end_turn"


def _usage(reply: ChatReply) -> dict[str, int]:
    return {"input_tokens": reply.prompt_tokens - reply.reused_tokens, "cache_read_input_tokens": reply.reused_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": len(reply.output.token_ids)}


def response(reply: ChatReply, model: str) -> dict[str, Any]:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": _content(reply), "stop_reason": _stop_reason(reply), "stop_sequence": None,
            "usage": _usage(reply), "conversation_id": reply.conversation_id}


def stream_events(reply: ChatReply, model: str) -> list[tuple[str, dict[str, Any]]]:
    """The turn as Messages streaming events: ``(event name, data)``."""
    start = response(reply, model)
    start.update(content=[], stop_reason=None, usage={**_usage(reply), "output_tokens": 0})
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": start})]
    for i, block in enumerate(_content(reply)):
        kind = block["type"]
        empty = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                 "text": {"type": "text", "text": ""},
                 "tool_use": {**block, "input": {}}}[kind]
        events.append(("content_block_start", {"type": "content_block_start", "index": i, "content_block": empty}))
        deltas = {"thinking": [{"type": "thinking_delta", "thinking": block.get("thinking")},
                               {"type": "signature_delta", "signature": block.get("signature")}],
                  "text": [{"type": "text_delta", "text": block.get("text")}],
                  "tool_use": [{"type": "input_json_delta", "partial_json": json.dumps(block.get("input"))}]}[kind]
        events += [("content_block_delta", {"type": "content_block_delta", "index": i, "delta": d}) for d in deltas]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    events.append(("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": _stop_reason(reply), "stop_sequence": None},
                                     "usage": {"output_tokens": len(reply.output.token_ids)}}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events
