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

Harmony (``tok.harmony``, gpt-oss; model/harmony.py): the turn continues the generation prompt's
open analysis message and is a sequence of messages ``<|start|>{header}<|message|>{body}{end}``,
end one of <|end|>, <|return|> (final answer: the turn ended) or <|call|> (a tool call: the turn
ended). The header names the channel after <|channel|> and a recipient ``to=functions.NAME`` in the
role or channel part (both forms are published), optionally ``<|constrain|>json``. Analysis bodies
are the reasoning; the final body (else commentary preambles) the content; a ``functions.`` recipient
is a call whose body is its JSON arguments object (any other recipient, or a call not ended by
<|call|>, is a ``CallError``).

Kimi (``tok.kimi``; model/kimi.py): ``[<think>{reasoning}</think>] {text} <|tool_calls_section_begin|>
(<|tool_call_begin|>{call id}<|tool_call_argument_begin|>{JSON}<|tool_call_end|>)*
<|tool_calls_section_end|> <|im_end|>``, the markers read by id. The call id is ``functions.NAME:INDEX``
(``NAME:INDEX`` is accepted, as vLLM's ``kimi_k2`` parser does); the ``ToolCall`` keeps it as its ``id``,
so the template renders the call, and the result's ``## Return of`` line, as the model wrote them. A
vocabulary without ``<think>`` has no reasoning: the turn before the section is its content. Each of a
marker out of place, a section or call left open, an id not ``[functions.]NAME:INDEX`` and arguments
that are not a JSON object is a ``CallError``; calls completed before it are kept. After a marker out
of place the ids up to the next valid point are discarded, so no call in them runs: through the broken
call's ``<|tool_call_end|>`` (a call begun outside the section, or again inside an open call), or up to
the section's end (a nested or second section begin). One section per turn, as Kimi's template writes
it: a second section is a ``CallError`` and its calls are dropped (vLLM's ``kimi_k2`` parser would run
them); text after ``<|tool_calls_section_end|>`` is a ``CallError`` beside the section's calls (vLLM
drops it silently), and the content is the text before the section.
"""

from __future__ import annotations

import json
import re
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
    if tok.harmony:
        return parse_harmony_turn(ids, tok)
    ended = bool(ids) and ids[-1] == tok.im_end_id
    body = ids[:-1] if ended else ids
    if body and body[0] == tok.think_id:
        body = body[1:]
    if tok.kimi:
        return parse_kimi_turn(body, tok, ended)
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


def parse_harmony_turn(ids: list[int], tok: Tokenizer) -> ParsedTurn:
    """A harmony turn (module docstring), read by special-token ids."""
    sp = tok.special_ids
    start, message, end, ret, call = (sp[t] for t in ("<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"))
    turn = ParsedTurn(reasoning="", content="", ended=bool(ids) and ids[-1] in (ret, call))
    reasoning, finals, preambles = [], [], []
    header: list[int] | None = None  # None: in a body (the first: the prompt's analysis message)
    body: list[int] = []
    channel, recipient = "analysis", ""
    stray: list[int] = []

    def close(end_id: int | None) -> None:
        text = tok.decode(body)
        if recipient:
            if end_id != call:
                turn.calls.append(CallError(f"tool call to {recipient} must end with <|call|>", text))
            elif not recipient.startswith("functions."):
                turn.calls.append(CallError(f"unknown recipient {recipient!r}; call tools as to=functions.NAME", text))
            else:
                turn.calls.append(_parse_args(recipient.removeprefix("functions."), text, f"call_{len(turn.calls) + 1}"))
        elif channel == "analysis":
            reasoning.append(text)
            turn.closed_thinking = turn.closed_thinking or end_id is not None
        elif channel == "final":
            finals.append(text)
        else:
            preambles.append(text)

    for i in ids:
        if header is not None:
            if i == message:
                channel, recipient = _harmony_header(tok.decode(header))
                header, body = None, []
            else:
                header.append(i)
        elif body is not None:
            if i in (end, ret, call):
                close(i)
                body = None  # between messages
            else:
                body.append(i)
        elif i == start:
            header = []
        else:
            stray.append(i)
    if header is None and body is not None:
        close(None)  # the turn stopped inside a message (length)
    turn.reasoning = "\n".join(reasoning)
    turn.content = "\n".join(finals or preambles)
    if stray:
        turn.calls.append(CallError("text between harmony messages (after <|end|>, before <|start|>)", tok.decode(stray)))
    return turn


def _harmony_header(text: str) -> tuple[str, str]:
    """(channel, recipient) of a header such as ``assistant<|channel|>commentary to=functions.run <|constrain|>json``."""
    text = text.replace("<|constrain|>", " <|constrain|>")
    role_part, _, channel_part = text.partition("<|channel|>")
    words = role_part.split() + channel_part.split()
    recipient = next((w[3:] for w in words if w.startswith("to=")), "")
    channel = next((w for w in channel_part.split() if not w.startswith(("to=", "<|constrain|>"))), "")
    return channel, recipient


def _parse_args(name: str, raw: str, call_id: str) -> ToolCall | CallError:
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as e:
        return CallError(f"arguments of {name!r} are not valid JSON ({e.msg} at char {e.pos})", raw)
    if not isinstance(args, dict):
        return CallError(f"arguments of {name!r} must be a JSON object, got {type(args).__name__}", raw)
    return ToolCall(name=name, arguments=args, id=call_id)


_KIMI_CALL_ID = re.compile(r"(?:functions\.)?([^\s:]+):(\d+)")


def parse_kimi_turn(body: list[int], tok: Tokenizer, ended: bool) -> ParsedTurn:
    """A Kimi turn (module docstring) without its ``<|im_end|>`` and opening ``<think>``, read by id."""
    sp = tok.special_ids
    section, section_end, call, argument, call_end = (sp[t] for t in (
        "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>", "<|tool_call_end|>"))
    thinks = tok.think_end_id >= 0  # model/kimi.NO_TOKEN: a vocabulary without <think>
    turn = ParsedTurn(reasoning="", content="", ended=ended, closed_thinking=not thinks)
    if thinks and tok.think_end_id not in body:
        turn.reasoning = tok.decode(body)  # thinking never closed: all of it is reasoning
        return turn
    if thinks:
        cut = body.index(tok.think_end_id)
        turn.reasoning, turn.closed_thinking, body = tok.decode(body[:cut]), True, body[cut + 1:]
    text: list[int] = []
    stray: list[int] = []  # inside the section, between calls
    after: list[int] = []  # after the section closed
    in_section, sections = False, 0
    header: list[int] | None = None  # the call id being read
    args: list[int] | None = None  # the arguments being read
    skip_to: tuple[int, ...] = ()  # after a marker out of place: ids discarded up to one of these

    def error(message: str, raw: list[int] = ()) -> None:
        turn.calls.append(CallError(message, tok.decode(raw)))

    def pending() -> list[int]:  # the open call's ids so far
        return (header or []) + (args or [])

    for i in body:
        if skip_to:
            if i not in skip_to:
                continue
            skip_to = ()
            if i == call_end:
                continue  # the broken call's end: discarded with it
        if i == section:
            if in_section:
                error("<|tool_calls_section_begin|> inside an open section", pending())
                header, args, skip_to = None, None, (section_end,)
            elif sections:
                error("a second <|tool_calls_section_begin|> (Kimi's template writes one section per turn)")
                in_section, skip_to = True, (section_end,)
            else:
                in_section, sections = True, 1
        elif i == section_end:
            if not in_section:
                error("<|tool_calls_section_end|> without <|tool_calls_section_begin|>")
            elif header is not None or args is not None:
                error("<|tool_calls_section_end|> inside a call (<|tool_call_end|> missing)", pending())
            in_section, header, args = False, None, None
        elif i == call:
            if not in_section:
                error("<|tool_call_begin|> outside <|tool_calls_section_begin|>...<|tool_calls_section_end|>")
                skip_to = (call_end, section)
            elif header is not None or args is not None:
                error("<|tool_call_begin|> again before <|tool_call_end|>", pending())
                header, args, skip_to = None, None, (call_end, section_end)
            else:
                header, args = [], None
        elif i == argument:
            if header is None or args is not None:
                error("<|tool_call_argument_begin|> outside a call, or twice in one", pending())
                header, args, skip_to = None, None, (call_end, section_end)
            else:
                args = []
        elif i == call_end:
            if header is None or args is None:
                error("<|tool_call_end|> without <|tool_call_begin|>{id}<|tool_call_argument_begin|>", header or [])
            else:
                turn.calls.append(_kimi_call(tok.decode(header).strip(), tok.decode(args)))
            header, args = None, None
        elif args is not None:
            args.append(i)
        elif header is not None:
            header.append(i)
        elif in_section:
            stray.append(i)
        elif sections:
            after.append(i)
        else:
            text.append(i)
    if header is not None or args is not None:
        error("<|tool_call_begin|> was not closed with <|tool_call_end|>", pending())
    if in_section:
        error("<|tool_calls_section_begin|> was not closed with <|tool_calls_section_end|>")
    if tok.decode(stray).strip():
        error("text inside the tool-calls section outside <|tool_call_begin|>...<|tool_call_end|>", stray)
    if tok.decode(after).strip():
        error("text after <|tool_calls_section_end|> (Kimi's template writes the content before the section)",
              after)
    turn.content = tok.decode(text)
    return turn


def _kimi_call(call_id: str, raw: str) -> ToolCall | CallError:
    m = _KIMI_CALL_ID.fullmatch(call_id)
    if m is None:
        return CallError(f"tool call id {call_id!r} must be functions.NAME:INDEX", call_id + raw)
    return _parse_args(m[1], raw, call_id)
