"""``ScriptedEngine``: a ``RolloutEngine`` that plays a scripted policy instead of a model.

Each call to ``generate`` emits the next scripted assistant turn, rendered by the chat
template exactly as a model would have to write it (the template's ``assistant_turn``: with
the byte template ``<think>`` is already open in the prompt, so a turn is
``{reasoning}</think>{text}<tool_call>...</tool_call><|im_end|>``; a checkpoint's template
writes its own form, e.g. Qwen3's ``<think>\n...</think>\n\n<tool_call>\n{...}\n</tool_call>``).
Used to replay every task's oracle, no-op and plausible-but-wrong policies through the real
template, parser, agent loop and sandbox; log-probs are 0 (a deterministic policy). A prompt
that does not extend the previous one starts a new episode, and the script starts over (so
an episode retried on a fresh env replays the same policy).

Like any engine it stops after a stop token (``<|im_end|>`` or ``params.stop_token_ids``) or
``max_tokens``, so the turn's thinking budget (``rl/rollout/turn.generate_turn``) drives it as
it drives a model: a call whose prompt is exactly the last prompt plus what was emitted continues
the current scripted turn; one that adds a ``</think>`` the script did not write (the budget
forced it) continues after the script's own ``</think>``.
"""

from __future__ import annotations

from jointrl.envs.base import Message, ToolCall
from jointrl.model.chat_template import ChatTemplate
from jointrl.model.hf_chat_template import HFChatTemplate
from jointrl.rl.types import GenerationOutput, SamplingParams

Turn = list[ToolCall] | list[int]  # tool calls to render, or raw token ids (to script malformed output)


class ScriptedEngine:
    def __init__(self, turns: list[Turn], template: ChatTemplate | HFChatTemplate | None = None,
                 reasoning: str = "") -> None:
        self.template = template or ChatTemplate()
        self.turns, self.reasoning = list(turns), reasoning
        self.prompts: list[list[int]] = []  # what the engine was shown at the start of each turn
        self.images: list = []  # the image_patches it was given then, per turn (None: none)
        self._next = 0  # index of the next scripted turn
        self._calls = 0  # calls rendered so far in this episode (Kimi's call ids count them)
        self._rest: list[int] = []  # the current scripted turn's tokens not emitted yet
        self._context: list[int] = []  # the last call's prompt and what it emitted
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, version: int, bundle=None) -> None:
        self._version = version

    def render_turn(self, calls: list[ToolCall], calls_before: int = 0) -> list[int]:
        """The template's canonical assistant turn with these calls (``assistant_turn``), after
        ``calls_before`` calls of the episode."""
        return self.template.assistant_turn(Message(role="assistant", reasoning=self.reasoning, tool_calls=calls),
                                            calls_before)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, image_patches=None) -> GenerationOutput:
        think_end = self.template.tok.think_end_id
        if self._rest and prompt_ids == self._context:
            pass  # the rest of the current turn
        elif self._rest and prompt_ids == [*self._context, think_end] and think_end in self._rest:
            self._rest = self._rest[self._rest.index(think_end) + 1:]  # reasoning cut by the budget
        else:
            if not self.prompts or prompt_ids[: len(self.prompts[-1])] != self.prompts[-1]:
                self._next, self._calls = 0, 0  # a new episode
            self.prompts.append(list(prompt_ids))
            self.images.append(image_patches)
            self._rest = self._next_turn()
            if prompt_ids[-1] == think_end and think_end in self._rest:  # a zero budget closed it already
                self._rest = self._rest[self._rest.index(think_end) + 1:]
        stops = {self.template.tok.im_end_id, *params.stop_token_ids}
        n = next((i + 1 for i, t in enumerate(self._rest) if t in stops), len(self._rest))
        finish = "stop" if n <= params.max_tokens else "length"  # a stop token, or the scripted turn's end
        ids, self._rest = self._rest[:min(n, params.max_tokens)], self._rest[min(n, params.max_tokens):]
        self._context = [*prompt_ids, *ids]
        return GenerationOutput(ids, [0.0] * len(ids), [1] * len(ids), finish, self._version)

    def _next_turn(self) -> list[int]:
        if self._next >= len(self.turns):  # the script is over: end the turn without a call
            return self.render_turn([])
        turn = self.turns[self._next]
        self._next += 1
        if turn and isinstance(turn[0], int):
            return list(turn)
        self._calls += len(turn)
        return self.render_turn(turn, self._calls - len(turn))
