"""Strict parser for one generated assistant turn, in token space.

A turn is ``{reasoning} </think> {text} <tool_call>{json}</tool_call> ... <|im_end|>`` (the
byte template's generation prompt already opened ``<think>``; a turn that opens it itself, as
Qwen3's does, starts with ``<think>``, which is skipped). The ids are the ``Tokenizer``'s
(``model/tokenizer.py``: the byte tokenizer or a checkpoint's). Special tokens are recognised by id only, so
``<tool_call>`` typed as plain bytes is text, and a ``<tool_call>`` id *inside* the thinking
is not a call. Parsing is strict (no JSON repair): a malformed call becomes a
``CallError`` that the agent loop returns to the model as an error observation. Whether a
well-formed call names a real tool with valid arguments is the env's to judge
(``jointrl.envs.base.validate_call``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from jointrl.envs.base import ToolCall
from jointrl.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class CallError:
    """A tool call the model attempted but got wrong; ``message`` is shown to the model."""

    message: str
    raw: str = ""


@dataclass(slots=True)
class ParsedTurn:
    reasoning: str
    content: str
    calls: list[ToolCall | CallError] = field(default_factory=list)  # in the order written
    ended: bool = False  # the turn ended with <|im_end|>
    closed_thinking: bool = False

    @property
    def num_errors(self) -> int:
        return sum(isinstance(c, CallError) for c in self.calls)


def parse_turn(ids: list[int], tok: Tokenizer) -> ParsedTurn:
    ended = bool(ids) and ids[-1] == tok.im_end_id
    body = ids[:-1] if ended else ids
    if body and body[0] == tok.think_id:
        body = body[1:]
    if tok.think_end_id not in body:
        return ParsedTurn(reasoning=tok.decode(body), content="", ended=ended)
    cut = body.index(tok.think_end_id)
    turn = ParsedTurn(reasoning=tok.decode(body[:cut]), content="", ended=ended, closed_thinking=True)
    text: list[int] = []
    call: list[int] | None = None  # ids of the call being read, None outside a call
    n = 0
    for i in body[cut + 1 :]:
        if i == tok.tool_call_id:
            if call is not None:
                turn.calls.append(CallError("<tool_call> opened again before </tool_call>", tok.decode(call)))
            call = []
        elif i == tok.tool_call_end_id:
            if call is None:
                turn.calls.append(CallError("</tool_call> without a matching <tool_call>"))
            else:
                n += 1
                turn.calls.append(_parse_call(tok.decode(call), f"call_{n}"))
                call = None
        elif call is not None:
            call.append(i)
        else:
            text.append(i)
    if call is not None:
        turn.calls.append(CallError("<tool_call> was not closed with </tool_call>", tok.decode(call)))
    turn.content = tok.decode(text)
    return turn


def _parse_call(raw: str, call_id: str) -> ToolCall | CallError:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return CallError(f"tool call is not valid JSON ({e.msg} at char {e.pos})", raw)
    if not isinstance(obj, dict):
        return CallError(f"tool call must be a JSON object, got {type(obj).__name__}", raw)
    name, args = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        return CallError('tool call needs a string "name"', raw)
    if not isinstance(args, dict):
        return CallError(f'"arguments" of {name!r} must be a JSON object, got {type(args).__name__}', raw)
    extra = set(obj) - {"name", "arguments"}
    if extra:
        return CallError(f"tool call has unexpected keys {sorted(extra)}; allowed: name, arguments", raw)
    return ToolCall(name=name, arguments=args, id=call_id)
