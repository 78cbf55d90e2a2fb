"""Scripted policies of a CAD task, as tool calls (replayed through the agent loop in the tests).

- ``oracle``: run the task's reference program, then submit it (reward 1);
- ``noop``: submit an empty program at once (reward 0);
- ``wrong``: run and submit the task's plausible-but-wrong program (a misread axis, a forgotten
  shell...; reward well below the oracle's).
"""

from __future__ import annotations

from jointrl.envs.base import Task, ToolCall

Policy = list[list[ToolCall]]
_SOURCES = {"oracle": "reference", "wrong": "wrong"}  # policy -> the task metadata holding its program


def policy_names(task: Task) -> list[str]:
    return ["noop", *(p for p, key in _SOURCES.items() if isinstance(task.metadata.get(key), str))]


def load_policy(task: Task, name: str) -> Policy:
    """The named policy's turns. Raises ``ValueError`` naming the available ones."""
    if name not in policy_names(task):
        raise ValueError(f"CAD task {task.id!r} has no policy {name!r}; available: {policy_names(task)}")
    if name == "noop":
        return [[ToolCall(name="submit", arguments={"code": ""})]]
    code = task.metadata[_SOURCES[name]]
    return [[ToolCall(name="run_cadquery", arguments={"code": code})],
            [ToolCall(name="submit", arguments={"code": code})]]
