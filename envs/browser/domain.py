"""The browser domain's entry in ``jointrl.envs.registry``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jointrl.envs.base import Env, Task
from jointrl.envs.browser.env import BrowserEnv, default_config
from jointrl.envs.browser.generate import load as load_named
from jointrl.envs.browser.tasks import load_tasks as load


def load_tasks(task_dir: Path | None) -> list[Task]:
    """The shipped tasks (generated from ``tasks.SHIPPED_SEEDS``), or the ``(kind, seed)`` pairs
    ``task_dir/tasks.jsonl`` names (``generate.py`` writes one)."""

    return load() if task_dir is None else load_named(task_dir)


def make_env(envs_cfg: Any) -> Env:
    # text mode; a task with metadata["mode"] = "image" gets Chromium
    return BrowserEnv(default_config("text"), mode="text", compact=getattr(envs_cfg, "prompt", "full") == "compact")
