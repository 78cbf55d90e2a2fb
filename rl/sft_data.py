"""A user's own demonstrations for ``jointrl sft``: chat transcripts from a datasets file.

``recipe.sft_data=PATH`` (a local parquet / arrow / JSONL file or a ``save_to_disk`` directory,
``envs/dataset_files.load_rows``; ``recipe.sft_data_split`` picks a DatasetDict's split) holds one
transcript a row in the chat-messages layout most SFT sets use:

- ``messages``: a list of OpenAI-style messages ``{role, content, reasoning_content?,
  tool_calls?: [{id?, type, function: {name, arguments}}], name?}`` (``arguments`` a dict or
  its JSON text), or the JSON text of such a list (the trajectory parquet's encoding);
- ``tools`` (optional): the OpenAI tool specs offered, a list or its JSON text;
- ``domain`` (optional): the row's domain (``recipe.sft_domain_weights`` weighs it);
  default ``transcripts``.

Each row becomes a ``Trajectory`` tokenized as the agent loop would have produced it with the
run's chat template: the messages before the first assistant turn rendered with the tools and
the generation prompt (loss 0); each assistant message as ``template.assistant_turn`` (loss 1:
the tokens a policy writes, through its end token); the messages between two assistant turns as
``template.continuation`` up to the next generation prompt (loss 0). Messages after the last
assistant turn are not rendered: nothing after them trains. A row without an assistant message,
or with a malformed message, is a ``ValueError`` naming the row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jointrl.envs.base import Message, ToolCall, ToolSpec
from jointrl.envs.dataset_files import load_rows
from jointrl.rl.types import Trajectory

DEFAULT_DOMAIN = "transcripts"
ROLES = ("system", "user", "assistant", "tool")


def _json(value: Any, where: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is text but not JSON: {e}") from e
    return value


def parse_message(raw: Any, where: str) -> Message:
    """One OpenAI-style message dict as a ``Message``."""
    if not isinstance(raw, dict) or raw.get("role") not in ROLES:
        raise ValueError(f"{where} must be a message with a role in {list(ROLES)}, got {raw!r:.120}")
    calls = []
    for c in raw.get("tool_calls") or []:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}: a tool call must be {{'function': {{'name', 'arguments'}}}}, got {c!r:.120}")
        args = _json(fn.get("arguments") or {}, f"{where}: tool call {fn['name']!r} arguments")
        calls.append(ToolCall(fn["name"], args, c.get("id") or ""))
    return Message(role=raw["role"], content=raw.get("content") or "", reasoning=raw.get("reasoning_content") or "",
                   tool_calls=calls, name=raw.get("name") or "")


def to_trajectory(messages: list[Message], tools: list[ToolSpec], template: Any, domain: str,
                  task_id: str) -> Trajectory:
    """``messages`` tokenized by ``template`` as the agent loop writes an episode (module docstring)."""
    first = next(i for i, m in enumerate(messages) if m.role == "assistant")
    last = max(i for i, m in enumerate(messages) if m.role == "assistant")
    ids = list(template.render(messages[:first], tools))
    mask = [0] * len(ids)
    i = first
    while i <= last:
        turn = template.assistant_turn(messages[i], sum(len(m.tool_calls) for m in messages[:i]))
        ids += turn
        mask += [1] * len(turn)
        j = i + 1
        while j <= last and messages[j].role != "assistant":
            j += 1
        if j <= last:
            between = template.continuation(messages[i + 1:j])
            ids += between
            mask += [0] * len(between)
        i = j
    turns = sum(m.role == "assistant" for m in messages[:last + 1])
    return Trajectory(ids, mask, [0.0] * len(ids), [0] * len(ids), domain, task_id, task_id,
                      messages=messages[:last + 1], num_turns=turns,
                      num_tool_calls=sum(len(m.tool_calls) for m in messages[:last + 1]))


def read_transcripts(path: str | Path, template: Any, split: str = "train") -> list[Trajectory]:
    """Every row of the transcript file at ``path`` as a ``Trajectory`` (module docstring), in order."""
    rows, columns = load_rows(Path(path), split)
    if "messages" not in columns:
        raise ValueError(f"sft data {str(path)!r} has no 'messages' column; its columns: {columns}")
    out = []
    for n, row in enumerate(rows):
        where = f"sft data {str(path)!r} row {n}"
        raw = _json(row["messages"], f"{where} messages")
        if not isinstance(raw, list):
            raise ValueError(f"{where}: messages must be a list of messages, got {raw!r:.120}")
        messages = [parse_message(m, f"{where} message {k}") for k, m in enumerate(raw)]
        if not any(m.role == "assistant" for m in messages):
            raise ValueError(f"{where} has no assistant message: nothing to train on")
        specs = _json(row.get("tools") or [], f"{where} tools")
        tools = [ToolSpec(s["function"]["name"], s["function"].get("description", ""),
                          s["function"].get("parameters") or {}) for s in specs]
        out.append(to_trajectory(messages, tools, template, row.get("domain") or DEFAULT_DOMAIN, f"row{n}"))
    return out
