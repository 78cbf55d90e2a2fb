"""A checkpoint's own chat template (its Jinja, rendered by ``apply_chat_template``) in token
space, with ``ChatTemplate``'s interface (``tok``, ``image_tokens``, ``render``,
``continuation``, ``generation_prompt``), so the agent loop takes either.

Token ids. The template's own text (role headers, ``<|im_end|>``, ``<tool_call>`` around a
call, ...) is encoded with special-token strings matched (``HFTokenizer.encode_with_specials``);
the text of system, user and tool messages is encoded plain (``HFTokenizer.encode``), so an
observation containing ``<|im_end|>`` cannot end a turn. To tell them apart, those contents are
rendered as sentinels (private-use characters) and encoded separately; a template that
transforms message content (strips or escapes it) is refused at load, because the sentinel
rendering would then differ from the real one.

Kimi's template (model/kimi.py) writes each call's id (``functions.NAME:INDEX``, as its models
write them): a call without one (a scripted policy's, a transcript's) gets ``functions.{name}:{k}``,
k counting every call of the conversation before it (Kimi-K2's ids number calls across the
conversation, as vLLM's ``kimi_k2`` serving does from its history count), so each ``## Return of``
line names one call; a tool result's ``tool_call_id`` is its call's (``rl/agent_loop``).

Token-in/token-out: the agent loop never re-tokenizes what the model generated. It appends
the generated ids, then ``continuation(new messages)``: the ids the template writes after a
turn's end token (``tok.im_end_id``) up to the next generation prompt. ``check_prefix_property``
(run by the constructor) renders a fixed probe conversation and checks

    render(history + [turn] + results) == render(history) + generated + continuation(results)

where ``generated`` is the canonical rendering of ``turn`` ending at the end token. Templates
that drop earlier turns' reasoning once a new user query follows (Qwen3) break this on the next
user turn; the rule we follow there: **the generated tokens are kept as they were** (the loop's
history holds each turn's reasoning; the template's rendering would drop it). The check
accepts exactly that difference (earlier turns' ``<think>``...``</think>`` and the whitespace
after it) and logs the rule once; any other difference is a ValueError naming the first
differing position.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from jointrl.messages import Message, ToolCall, ToolSpec
from jointrl.model.hf_tokenizer import HFTokenizer

log = logging.getLogger(__name__)

_SLOT = re.compile("\ue000(\\d+)\ue001")
_MARK = "\ue002"  # content of the stand-in turn that ``continuation`` renders after

PROBE_TOOLS = [ToolSpec("run", "run a shell command", {"type": "object", "properties": {
    "command": {"type": "string"}}, "required": ["command"]})]


class HFChatTemplate:
    """``tok``: the checkpoint's ``HFTokenizer`` (its ``hf.chat_template`` is the Jinja used).
    ``image_tokens`` must be 0 (image slots are the byte template's; not wired for HF templates)."""

    def __init__(self, tokenizer: HFTokenizer, image_tokens: int = 0, check: bool = True) -> None:
        if image_tokens:
            raise ValueError(f"HFChatTemplate: image_tokens={image_tokens}; images are not supported with a "
                             "checkpoint's chat template yet")
        if not tokenizer.hf.chat_template:
            raise ValueError("HFChatTemplate: the tokenizer has no chat_template (chat_template.jinja or "
                             "tokenizer_config.json's chat_template)")
        self.tok, self.image_tokens = tokenizer, 0
        self.drops_reasoning = False  # set by check_prefix_property
        if check:
            check_prefix_property(self)

    # -- rendering -------------------------------------------------------------------------------
    def _text(self, messages: list[Message], tools: list[ToolSpec], add_generation_prompt: bool,
              slots: list[str] | None, calls_before: int = 0) -> str:
        """The Jinja's text; with ``slots``, system/user/tool contents become sentinels appended there.
        Kimi: an id-less call's index counts from ``calls_before`` (the calls ahead of ``messages``)."""
        dicts: list[dict[str, Any]] = []
        calls = calls_before  # calls of the conversation so far (Kimi's ids count them)
        for m in messages:
            if m.role not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"message role must be one of system/user/assistant/tool, got {m.role!r}")
            d = m.to_openai()
            for c in d.get("tool_calls", []) if self.tok.kimi else []:
                c["id"] = c["id"] or f"functions.{c['function']['name']}:{calls}"  # Kimi's template shows ids
                calls += 1
            if slots is not None and m.role != "assistant" and m.content != _MARK:
                d["content"] = f"\ue000{len(slots)}\ue001"
                slots.append(m.content)
            dicts.append(d)
        return self.tok.hf.apply_chat_template(dicts, tools=[t.to_openai() for t in tools] or None, tokenize=False,
                                               add_generation_prompt=add_generation_prompt)

    def _ids(self, text: str, slots: list[str]) -> list[int]:
        parts = _SLOT.split(text)  # template text, slot index, template text, ...
        ids: list[int] = []
        for k, part in enumerate(parts):
            if k % 2:
                ids += self.tok.encode(slots[int(part)])
            elif part:
                ids += self.tok.encode_with_specials(part)
        return ids

    def render(self, messages: list[Message], tools: list[ToolSpec] = (),
               add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a whole conversation, as the checkpoint's template writes it."""
        slots: list[str] = []
        return self._ids(self._text(list(messages), list(tools), add_generation_prompt, slots), slots)

    def generation_prompt(self) -> list[int]:
        """What the template appends for ``add_generation_prompt`` (Qwen3: ``<|im_start|>assistant\\n``)."""
        probe = [Message(role="user", content="hi")]
        with_prompt = self._text(probe, [], True, None)
        without = self._text(probe, [], False, None)
        assert with_prompt.startswith(without), "the generation prompt is not a suffix"
        return self.tok.encode_with_specials(with_prompt[len(without):])

    def assistant_turn(self, m: Message, calls_before: int = 0) -> list[int]:
        """The ids a model writes for assistant message ``m`` after the generation prompt, through
        the end token: the template's rendering of it after a one-message history. ``calls_before``:
        the conversation's calls before ``m`` (Kimi numbers an id-less call from it)."""
        history = [Message(role="user", content="hi")]
        prompt = self.render(history)
        slots: list[str] = []
        full = self._ids(self._text(history + [m], [], False, slots, calls_before), slots)
        assert full[:len(prompt)] == prompt, "checked at load (check_prefix_property)"
        return full[len(prompt): full.index(self.tok.im_end_id, len(prompt)) + 1]

    def continuation(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """Ids that follow a generated assistant turn (which ends at ``tok.im_end_id``): the
        template's text after that end token up to and including the next generation prompt."""
        slots: list[str] = []
        probe = [Message(role="user", content="hi"), Message(role="assistant", content=_MARK)]
        text = self._text(probe + list(messages), [], add_generation_prompt, slots)
        end = self.tok.decode([self.tok.im_end_id])
        cut = text.index(end, text.index(_MARK)) + len(end)
        return self._ids(text[cut:], slots)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _fail(tpl: HFChatTemplate, what: str, ours: list[int], theirs: list[int]) -> None:
    i = _first_difference(ours, theirs)

    def ctx(ids: list[int]) -> str:
        return repr(tpl.tok.decode(ids[max(0, i - 8): i + 8]))

    raise ValueError(f"chat template: {what} at token {i} (ours {ctx(ours)}, the template's {ctx(theirs)}); "
                     "the agent loop appends generated tokens and continuations, so the template must render "
                     "a conversation as their concatenation")


def _drop_reasoning(tpl: HFChatTemplate, ids: list[int], turns: list[tuple[int, int]]) -> list[int]:
    """``ids`` with each [start, end) turn's ``<think>``...``</think>`` and the whitespace after removed."""
    t, out, prev = tpl.tok, [], 0
    for start, end in turns:
        span = ids[start:end]
        if t.think_id not in span or t.think_end_id not in span:
            continue
        a = start + span.index(t.think_id)
        b = start + span.index(t.think_end_id) + 1
        while b < end and not t.decode([ids[b]]).strip():
            b += 1
        out += ids[prev:a]
        prev = b
    return out + ids[prev:]


def check_prefix_property(tpl: HFChatTemplate) -> None:
    """Render a probe conversation both ways (see the module docstring); ValueError on a
    difference the written rule does not cover; sets ``tpl.drops_reasoning``."""
    t = tpl.tok
    history = [Message(role="system", content="You are a probe."), Message(role="user", content="List the files.")]
    call = Message(role="assistant", reasoning="I will call run.", tool_calls=[ToolCall("run", {"command": "ls"})])
    results = [Message(role="tool", content="a.txt\n<|im_end|>", name="run")]
    answer = Message(role="assistant", reasoning="It is a.txt.", content="There is a.txt.")
    follow_up = [Message(role="user", content=" Thanks. And <think>pwd</think>?\n")]
    for m in history + results + follow_up:  # contents must reach the text unchanged
        slots: list[str] = []
        sentinel = tpl._text(history + [m], PROBE_TOOLS, True, slots)
        if _SLOT.sub(lambda g: slots[int(g[1])], sentinel) != tpl._text(history + [m], PROBE_TOOLS, True, None):
            raise ValueError(f"chat template: it transforms the content of a {m.role} message (strips or escapes "
                             "it); the loop encodes message contents as given")

    def generated(before: list[Message], turn: Message) -> list[int]:
        prompt = tpl.render(before, PROBE_TOOLS)
        full = tpl.render(before + [turn], PROBE_TOOLS, add_generation_prompt=False)
        if full[:len(prompt)] != prompt:
            _fail(tpl, "rendering an assistant turn changes the generation prompt before it", prompt, full)
        if t.im_end_id not in full[len(prompt):]:
            raise ValueError("chat template: an assistant turn does not end with the end token "
                             f"{t.decode([t.im_end_id])!r}")
        return full[len(prompt): full.index(t.im_end_id, len(prompt)) + 1]

    ours = tpl.render(history, PROBE_TOOLS)
    turns = []
    for before, turn, after in ((history, call, results), (history + [call] + results, answer, follow_up)):
        gen = generated(before, turn)
        turns.append((len(ours), len(ours) + len(gen)))
        ours = ours + gen + tpl.continuation(after)
        theirs = tpl.render(before + [turn] + after, PROBE_TOOLS)
        if ours == theirs:
            continue
        if after is not follow_up:
            _fail(tpl, "render(history + turn + tool results) != render(history) + turn + continuation", ours, theirs)
        dropped = _drop_reasoning(tpl, ours, turns)
        if dropped != theirs:
            _fail(tpl, "after a new user turn, the template's rendering differs from the loop's history "
                  "(beyond dropping earlier turns' reasoning)", dropped, theirs)
        tpl.drops_reasoning = True
        log.info("chat template drops earlier turns' reasoning after a new user turn; the agent loop keeps "
                 "the generated tokens as they were (its history holds each turn's reasoning)")
