"""The code-repository domain's entry in ``jointrl.envs.registry``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jointrl.envs.base import Env, Task
from jointrl.envs.code_repo.env import CodeRepoEnv
from jointrl.envs.code_repo.records import load_tasks as load
from jointrl.envs.sandbox.settings import sandbox_settings


def load_tasks(task_dir: Path | None) -> list[Task]:
    return load(task_dir)


def make_env(envs_cfg: Any) -> Env:
    return CodeRepoEnv(sandbox_settings(envs_cfg).config,
                       compact=getattr(envs_cfg, "prompt", "full") == "compact")
