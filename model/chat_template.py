"""ChatML chat template in token space: full rendering and incremental encoding.

Layout of one conversation (``S(x)`` is a special token, everything else plain bytes)::

    S(<|im_start|>)system\n{system text}{tool block}S(<|im_end|>)\n
    S(<|im_start|>)user\n{text}S(<|im_end|>)\n
    S(<|im_start|>)assistant\nS(<think>){reasoning}S(</think>){text}
        S(<tool_call>){"name": ..., "arguments": {...}}S(</tool_call>) ... S(<|im_end|>)\n
    S(<|im_start|>)tool\n{result}S(<|im_end|>)\n          (one turn per call, in call order)
    S(<|im_start|>)assistant\nS(<think>)                  <- generation prompt

The generation prompt opens ``<think>``; the model writes its thinking, closes it, and ends
its turn with ``<|im_end|>`` (the engine's stop token). The full history, thinking
included, stays in context. ``continuation`` encodes what follows a generated turn, so the
agent loop never re-tokenizes text the model produced:

    render(msgs + [assistant, tools...], gen=True)
        == render(msgs, gen=True) + generated_ids + continuation(tools...)

whenever ``generated_ids`` is the canonical rendering of ``assistant`` (tested).
"""

from __future__ import annotations

import json

from jointrl.messages import Message, ToolSpec
from jointrl.model.tokenizer import ByteTokenizer

TOOL_INSTRUCTIONS = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query. "
    "Function signatures are given within <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "For each call, write <tool_call>{{\"name\": <function-name>, \"arguments\": <args-json-object>}}</tool_call>."
)


class ChatTemplate:
    def __init__(self, tokenizer: ByteTokenizer | None = None, image_tokens: int = 0) -> None:
        """``image_tokens``: ``<image>`` slots per message image (``rl/image_inputs.py``); 0 drops
        images (a text-only model reads only the message text)."""
        self.tok = tokenizer or ByteTokenizer()
        self.image_tokens = image_tokens

    def _turn(self, role: str, body: list[int]) -> list[int]:
        t = self.tok
        return [t.im_start_id, *t.encode(f"{role}\n"), *body, t.im_end_id, *t.encode("\n")]

    def _assistant_body(self, m: Message) -> list[int]:
        t = self.tok
        ids = [t.think_id, *t.encode(m.reasoning), t.think_end_id, *t.encode(m.content)]
        for call in m.tool_calls:
            payload = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
            ids += [t.tool_call_id, *t.encode(payload), t.tool_call_end_id]
        return ids

    def encode_message(self, m: Message) -> list[int]:
        if m.role == "assistant":
            return self._turn("assistant", self._assistant_body(m))
        if m.role in ("system", "user", "tool"):
            slots = [self.tok.special_ids["<image>"]] * self.image_tokens if m.image is not None else []
            return self._turn(m.role, slots + self.tok.encode(m.content))
        raise ValueError(f"message role must be one of system/user/assistant/tool, got {m.role!r}")

    def assistant_turn(self, m: Message, calls_before: int = 0) -> list[int]:
        """The ids a model writes for assistant message ``m`` after the generation prompt, through
        ``<|im_end|>``: its canonical rendering (what a scripted policy emits). ``calls_before`` is
        ``HFChatTemplate``'s (Kimi's call ids); this template writes no call ids and ignores it."""
        return self.encode_message(m)[len(self.generation_prompt()):-1]

    def generation_prompt(self) -> list[int]:
        t = self.tok
        return [t.im_start_id, *t.encode("assistant\n"), t.think_id]

    def render(self, messages: list[Message], tools: list[ToolSpec] = (), add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a whole conversation. Tools are described in the system turn."""
        messages = list(messages)
        if tools:
            block = TOOL_INSTRUCTIONS.format(tools="\n".join(json.dumps(s.to_openai()) for s in tools))
            if messages and messages[0].role == "system":
                first = messages[0]
                messages[0] = Message(role="system", content=first.content + block)
            else:
                messages.insert(0, Message(role="system", content=block.lstrip("\n")))
        ids: list[int] = []
        for m in messages:
            ids += self.encode_message(m)
        if add_generation_prompt:
            ids += self.generation_prompt()
        return ids

    def continuation(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """Ids that follow a generated assistant turn (which ends at ``<|im_end|>``)."""
        ids = self.tok.encode("\n")
        for m in messages:
            ids += self.encode_message(m)
        if add_generation_prompt:
            ids += self.generation_prompt()
        return ids
