"""Terminal task folders (a Harbor-like layout) and their loader.

One task is one folder ``<root>/<task_id>/``::

    task.toml         id, tier, max_turns, [reward] weights, [metadata] (free-form)
    instruction.md    the prompt, verbatim
    environment/      optional; copied into /work at reset
    tests/test.sh     the verifier: run as `bash /tests/test.sh` in a fresh sandbox over the
                      episode's final files with tests/ mounted read-only at /tests; on
                      success it writes 1 to /logs/verifier/reward.txt and exits 0
    policies.json     scripted policies: {"oracle": [turn, ...], "wrong": [turn, ...]}, each
                      turn a list of {"name": ..., "arguments": {...}} tool calls

The shipped set lives in ``envs/terminal/tasks/``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from jointrl.envs.base import Task

DOMAIN = "terminal"
TASKS_DIR = Path(__file__).parent / "tasks"
_TOML_KEYS = {"id", "tier", "max_turns", "reward", "metadata"}


def load_task(folder: Path) -> Task:
    """Load one task folder. Raises ``ValueError`` naming the file and the problem."""
    folder = Path(folder)
    toml_path = folder / "task.toml"
    for required in (toml_path, folder / "instruction.md", folder / "tests" / "test.sh"):
        if not required.is_file():
            raise ValueError(f"task folder {str(folder)!r} lacks {required.name!r} ({str(required)!r})")
    with open(toml_path, "rb") as f:
        try:
            spec = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{str(toml_path)!r}: {e}") from e
    unknown = set(spec) - _TOML_KEYS
    if unknown:
        raise ValueError(f"{str(toml_path)!r}: unknown keys {sorted(unknown)}; allowed {sorted(_TOML_KEYS)}")
    if spec.get("id") != folder.name:
        raise ValueError(f"{str(toml_path)!r}: id {spec.get('id')!r} must equal the folder name {folder.name!r}")
    reward = spec.get("reward", {"tests_pass": 1.0})
    if not isinstance(reward, dict) or not all(isinstance(w, int | float) for w in reward.values()):
        raise ValueError(f"{str(toml_path)!r}: [reward] must map reward names to numeric weights, got {reward!r}")
    return Task(
        id=spec["id"],
        domain=DOMAIN,
        prompt=(folder / "instruction.md").read_text().strip(),
        tier=spec.get("tier", "low"),
        max_turns=int(spec.get("max_turns", 8)),
        root=folder.resolve(),
        reward={k: float(w) for k, w in reward.items()},
        metadata=dict(spec.get("metadata", {})),
    )


def load_tasks(root: Path | None = None) -> list[Task]:
    """Every task folder under ``root`` (default: the shipped set), sorted by id."""
    root = TASKS_DIR if root is None else Path(root)
    if not root.is_dir():
        raise ValueError(f"task root {str(root)!r} is not a directory")
    return [load_task(d) for d in sorted(root.iterdir()) if d.is_dir() and (d / "task.toml").exists()]
