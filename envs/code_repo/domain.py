"""The code-repository domain's entry in ``jointrl.envs.registry``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jointrl.envs.base import Env, Task


def load_tasks(task_dir: Path | None) -> list[Task]:
    from jointrl.envs.code_repo.records import load_tasks as load

    return load(task_dir)


def make_env(envs_cfg: Any) -> Env:
    from jointrl.envs.code_repo.env import CodeRepoEnv
    from jointrl.envs.sandbox.settings import sandbox_settings

    return CodeRepoEnv(sandbox_settings(envs_cfg).config,
                       compact=getattr(envs_cfg, "prompt", "full") == "compact")
