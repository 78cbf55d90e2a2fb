"""The chat records every layer speaks: a message, a tool call, a tool's schema.

A leaf module: it imports nothing of ours, so the environments (``jointrl.envs``, which
produce and consume messages), the model's chat template (``jointrl.model.chat_template``, which
renders them to tokens) and the trainer (``jointrl.rl``) may all import it without importing
each other (docs/architecture.md, "Layout and imports"). ``jointrl.envs.base`` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One tool, described as an OpenAI function schema (``parameters`` is JSON Schema)."""

    name: str
    description: str
    parameters: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call the model made: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    name: str
    arguments: dict[str, Any]
    id: str = ""


@dataclass(slots=True)
class Message:
    """One OpenAI-style chat message, for transcripts and the chat template."""

    role: Role
    content: str = ""
    reasoning: str = ""  # the <think> text of an assistant turn
    tool_calls: list[ToolCall] = field(default_factory=list)
    name: str = ""  # tool name, on tool messages
    tool_call_id: str = ""  # on tool messages: the id of the call answered (Kimi's template shows it)
    image: bytes | None = None  # a tool result's screenshot (PNG): <image> slots in the template

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.name:
            out["name"] = self.name
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out
