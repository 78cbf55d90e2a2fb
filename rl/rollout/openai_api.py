"""The OpenAI Chat Completions shape: request parsing, responses, stream chunks, errors.

``parse_request(body, tiers)`` turns a ``/v1/chat/completions`` JSON body into a
``ChatRequest`` or raises ``RequestError`` naming the field (``messages[2].tool_call_id``).
Accepted: ``messages`` (system/developer/user/assistant/tool; string or text-part content;
assistant ``tool_calls`` and ``reasoning_content``; tool results must answer a call made
earlier), ``tools``, ``tool_choice``, ``max_tokens`` / ``max_completion_tokens``,
``temperature``, ``top_p``, ``top_k``, ``seed``, ``n`` (1 only), ``stream``,
``stream_options.include_usage``, ``logprobs``, ``top_logprobs``, ``conversation_id`` (the
recorded conversation to continue, ``recorder.py``) and ``thinking_budget``
(``low`` / ``high`` / ``max`` -> the configured per-turn limit, or a token count; the
articles' ``extra_body={"thinking_budget": "max"}``). ``stop`` strings are refused (400):
the engine stops on token ids only. Other fields are ignored, as OpenAI-compatible servers do.

Thinking comes back as ``message.reasoning_content``; a client that sends it back gets it in
context exactly as generated (``recorder.py``). Errors: ``{"error": {"message", "type",
"param", "code"}}``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from jointrl.envs.base import Message, ToolCall, ToolSpec
from jointrl.model.tokenizer import ByteTokenizer
from jointrl.rl.rollout.chat import ChatReply, ChatRequest, RequestError, chat_request, think_tokens
from jointrl.rl.rollout.chat import request_field as _field

ROLES = ("system", "developer", "user", "assistant", "tool")


def error_body(err: RequestError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": None}}


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise RequestError(f"'{where}[{j}]' must be a text part {{\"type\": \"text\", \"text\": ...}}",
                                   f"{where}[{j}]")
            parts.append(p["text"])
        return "".join(parts)
    raise RequestError(f"'{where}' must be a string or a list of text parts, got {type(content).__name__}", where)


def _messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty list", "messages")
    out: list[Message] = []
    open_calls: dict[str, str] = {}  # call id -> tool name, of the preceding assistant message
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"'{where}' must be an object, got {type(m).__name__}", where)
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"'{where}.role' must be one of {list(ROLES)}, got {role!r}", f"{where}.role")
        content = _text(m.get("content"), f"{where}.content")
        if role == "assistant":
            reasoning = _field(m, "reasoning_content", str, f"{where}.", default="")
            calls = []
            for j, c in enumerate(_field(m, "tool_calls", list, f"{where}.", default=[])):
                w = f"{where}.tool_calls[{j}]"
                if not isinstance(c, dict):
                    raise RequestError(f"'{w}' must be an object", w)
                cid = _field(c, "id", str, f"{w}.", required=True)
                fn = _field(c, "function", dict, f"{w}.", required=True)
                name = _field(fn, "name", str, f"{w}.function.", required=True)
                args = _field(fn, "arguments", (str, dict), f"{w}.function.", default="{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError as e:
                        raise RequestError(f"'{w}.function.arguments' is not valid JSON: {e.msg}",
                                           f"{w}.function.arguments") from None
                if not isinstance(args, dict):
                    raise RequestError(f"'{w}.function.arguments' must encode a JSON object", f"{w}.function.arguments")
                calls.append(ToolCall(name=name, arguments=args, id=cid))
            open_calls = {c.id: c.name for c in calls}
            out.append(Message(role="assistant", content=content, reasoning=reasoning, tool_calls=calls))
        elif role == "tool":
            cid = _field(m, "tool_call_id", str, f"{where}.", required=True)
            if cid not in open_calls:
                raise RequestError(f"'{where}.tool_call_id' {cid!r} answers no tool call of the preceding assistant "
                                   "message (or answers it twice)", f"{where}.tool_call_id")
            called = open_calls.pop(cid)  # the result names its call's tool (harmony renders the name)
            out.append(Message(role="tool", content=content, name=_field(m, "name", str, f"{where}.", default="") or called,
                               tool_call_id=cid))
        else:
            out.append(Message(role="system" if role == "developer" else role, content=content))
    return out


def _tools(raw: Any) -> list[ToolSpec]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError(f"'tools' must be a list, got {type(raw).__name__}", "tools")
    out = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise RequestError(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
        fn = _field(t, "function", dict, f"{where}.", required=True)
        out.append(ToolSpec(name=_field(fn, "name", str, f"{where}.function.", required=True),
                            description=_field(fn, "description", str, f"{where}.function.", default=""),
                            parameters=_field(fn, "parameters", dict, f"{where}.function.",
                                              default={"type": "object", "properties": {}})))
    return out


def _tool_choice(raw: Any, tools: list[ToolSpec]) -> str:
    if raw is None:
        return "auto"
    if raw in ("auto", "none", "required"):
        return raw
    if isinstance(raw, dict) and isinstance(raw.get("function"), dict) and isinstance(raw["function"].get("name"), str):
        name = raw["function"]["name"]
        if name not in {t.name for t in tools}:
            raise RequestError(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
        return name
    raise RequestError("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"function\": "
                       "{\"name\": ...}}", "tool_choice")


def parse_request(body: Any, tiers: dict[str, int | None]) -> tuple[ChatRequest, dict[str, Any]]:
    """(the request, response options: ``logprobs``, ``include_usage``, ``model``)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    messages = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    max_tokens = _field(body, "max_completion_tokens", int, "", default=None)
    max_tokens = _field(body, "max_tokens", int, "", default=max_tokens)
    if _field(body, "n", int, "", default=1) != 1:
        raise RequestError("'n' must be 1: send one request per sample", "n")
    top_logprobs = _field(body, "top_logprobs", int, "", default=0)
    if not 0 <= top_logprobs <= 20:
        raise RequestError(f"'top_logprobs' must be in [0, 20], got {top_logprobs}", "top_logprobs")
    stream_options = _field(body, "stream_options", dict, "", default={})
    req = chat_request(body, messages=messages, tools=tools, tool_choice=_tool_choice(body.get("tool_choice"), tools),
                       max_tokens=max_tokens, max_think_tokens=think_tokens(body.get("thinking_budget"), tiers,
                                                                            "thinking_budget"),
                       max_temperature=2.0, stop_key="stop")
    opts = {"logprobs": _field(body, "logprobs", bool, "", default=False),
            "include_usage": bool(stream_options.get("include_usage", False)),
            "model": _field(body, "model", str, "", default="")}
    return req, opts


def _finish(reply: ChatReply) -> str:
    if reply.finish_reason != "stop":
        return "length"
    return "tool_calls" if reply.message.tool_calls else "stop"


def _tool_calls(reply: ChatReply) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in reply.message.tool_calls]


def _usage(reply: ChatReply) -> dict[str, Any]:
    n = len(reply.output.token_ids)
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": n, "total_tokens": reply.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": reply.reused_tokens},
            "completion_tokens_details": {"reasoning_tokens": reply.reasoning_tokens}}


def _logprobs(reply: ChatReply, tok: ByteTokenizer) -> dict[str, Any]:
    out = reply.output
    return {"content": [{"token": tok.decode([t]), "logprob": lp, "bytes": list(tok.decode([t]).encode()),
                         "top_logprobs": [], "sampled": bool(s)}
                        for t, lp, s in zip(out.token_ids, out.logprobs, out.sampled)]}


def response(reply: ChatReply, opts: dict[str, Any], model: str, tok: ByteTokenizer) -> dict[str, Any]:
    m = reply.message
    message: dict[str, Any] = {"role": "assistant", "content": m.content or (None if m.tool_calls else ""),
                               "reasoning_content": m.reasoning}
    if m.tool_calls:
        message["tool_calls"] = _tool_calls(reply)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "conversation_id": reply.conversation_id,
            "choices": [{"index": 0, "message": message, "finish_reason": _finish(reply),
                         "logprobs": _logprobs(reply, tok) if opts["logprobs"] else None}],
            "usage": _usage(reply), "call_errors": [e.message for e in reply.call_errors]}


def stream_chunks(reply: ChatReply, opts: dict[str, Any], model: str, tok: ByteTokenizer) -> list[dict[str, Any]]:
    """The turn as ``chat.completion.chunk`` objects (reasoning, content, then each tool call)."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "conversation_id": reply.conversation_id}

    def chunk(delta: dict, finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}

    out = [chunk({"role": "assistant", "content": ""})]
    if reply.message.reasoning:
        out.append(chunk({"reasoning_content": reply.message.reasoning}))
    if reply.message.content:
        out.append(chunk({"content": reply.message.content}))
    for i, c in enumerate(_tool_calls(reply)):
        out.append(chunk({"tool_calls": [{"index": i, **c}]}))
    out.append(chunk({}, _finish(reply), logprobs=_logprobs(reply, tok) if opts["logprobs"] else None))
    if opts["include_usage"]:
        out.append({**base, "choices": [], "usage": _usage(reply)})
    return out
