"""The CAD domain's entry in ``jointrl.envs.registry``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jointrl.envs.base import Env, Task
from jointrl.envs.cad.env import CadEnv
from jointrl.envs.cad.interpreter import CadConfig
from jointrl.envs.cad.tasks import load_tasks as load
from jointrl.envs.sandbox.settings import sandbox_settings


def load_tasks(task_dir: Path | None) -> list[Task]:
    return load(task_dir)


def make_env(envs_cfg: Any) -> Env:
    return CadEnv(CadConfig(call_timeout_s=sandbox_settings(envs_cfg).config.timeout_s))
