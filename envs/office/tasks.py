"""Office task folders, their loader and their scripted policies.

A task folder (``envs/office/tasks/<id>/``, written by ``build_tasks.py``)::

    task.json   {"prompt", "checks", "policies": {"oracle": [turn, ...], "wrong": [...]},
                 "family", "seed", "max_turns", optional "tier" and "partial_credit"};
                a turn is a list of {"name": ..., "arguments": {...}} tool calls
    files/      the documents, copied into /work at reset

Every task is scored by ``office_checks`` (``rewards/office_checks.py``) over its ``checks``.
Policies: ``oracle`` (reward 1), plausible-but-``wrong`` (reward 0) and the built-in ``noop``
(answers at once with an empty answer and edits nothing: reward 0).
"""

from __future__ import annotations

import json
from pathlib import Path

from jointrl.envs.base import Task, ToolCall

DOMAIN = "office"
TASKS_DIR = Path(__file__).parent / "tasks"
REWARD = {"office_checks": 1.0}
Policy = list[list[ToolCall]]
NOOP: Policy = [[ToolCall(name="answer", arguments={"text": ""})]]
_KEYS = {"prompt", "checks", "policies", "family", "seed", "max_turns", "tier", "partial_credit"}


def load_task(folder: Path) -> Task:
    """Load one task folder. Raises ``ValueError`` naming the file and the problem."""
    folder = Path(folder)
    path = folder / "task.json"
    if not path.is_file() or not (folder / "files").is_dir():
        raise ValueError(f"office task folder {str(folder)!r} needs task.json and files/")
    try:
        spec = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{str(path)!r}: {e}") from e
    unknown = set(spec) - _KEYS
    if unknown:
        raise ValueError(f"{str(path)!r}: unknown keys {sorted(unknown)}; allowed {sorted(_KEYS)}")
    if not isinstance(spec.get("prompt"), str) or not isinstance(spec.get("checks"), list) or not spec["checks"]:
        raise ValueError(f"{str(path)!r}: needs a 'prompt' string and a non-empty 'checks' list")
    metadata = {k: spec[k] for k in ("checks", "family", "seed", "partial_credit") if k in spec}
    return Task(id=folder.name, domain=DOMAIN, prompt=spec["prompt"], tier=spec.get("tier", "low"),
                max_turns=int(spec.get("max_turns", 10)), root=folder.resolve(), reward=dict(REWARD),
                metadata=metadata)


def load_tasks(root: Path | None = None) -> list[Task]:
    """Every task folder under ``root`` (default: the shipped set), sorted by id."""
    root = TASKS_DIR if root is None else Path(root)
    if not root.is_dir():
        raise ValueError(f"office task root {str(root)!r} is not a directory")
    return [load_task(d) for d in sorted(root.iterdir()) if (d / "task.json").is_file()]


def _policies(task: Task) -> dict[str, Policy]:
    if task.root is None:
        raise ValueError(f"task {task.id!r} has no folder, hence no policies")
    raw = json.loads((task.root / "task.json").read_text()).get("policies", {})
    try:
        return {name: [[ToolCall(name=c["name"], arguments=dict(c["arguments"])) for c in turn] for turn in turns]
                for name, turns in raw.items()}
    except (KeyError, TypeError) as e:
        raise ValueError(f"task {task.id!r}: policies must map names to lists of turns of tool calls ({e})") from e


def policy_names(task: Task) -> list[str]:
    """The task's policies, ``noop`` included."""
    return sorted({"noop", *_policies(task)})


def load_policy(task: Task, name: str) -> Policy:
    """The named policy's turns. Raises ``ValueError`` naming the available ones."""
    if name == "noop":
        return NOOP
    policies = _policies(task)
    if name not in policies:
        raise ValueError(f"task {task.id!r} has no policy {name!r}; available: {policy_names(task)}")
    return policies[name]
