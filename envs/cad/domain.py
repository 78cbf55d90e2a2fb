"""The CAD domain's entry in ``jointrl.envs.registry``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jointrl.envs.base import Env, Task


def load_tasks(task_dir: Path | None) -> list[Task]:
    from jointrl.envs.cad.tasks import load_tasks as load

    return load(task_dir)


def make_env(envs_cfg: Any) -> Env:
    from jointrl.envs.cad.env import CadEnv
    from jointrl.envs.cad.interpreter import CadConfig

    return CadEnv(CadConfig(call_timeout_s=envs_cfg.command_timeout_s))
