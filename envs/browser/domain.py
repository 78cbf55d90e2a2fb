"""The browser domain's entry in ``jointrl.envs.registry``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jointrl.envs.base import Env, Task


def load_tasks(task_dir: Path | None) -> list[Task]:
    """The shipped tasks (generated from ``tasks.SHIPPED_SEEDS``); browser tasks have no folders."""
    from jointrl.envs.browser.tasks import load_tasks as load

    if task_dir is not None:
        raise ValueError(f"browser tasks are generated, not loaded from a folder (got task_dir={str(task_dir)!r}); "
                         "use jointrl.envs.browser.tasks.make_task(kind, seed) for more")
    return load()


def make_env(envs_cfg: Any) -> Env:
    from jointrl.envs.browser.env import BrowserEnv, default_config

    del envs_cfg  # text mode; a task with metadata["mode"] = "image" gets Chromium
    return BrowserEnv(default_config("text"), mode="text")
