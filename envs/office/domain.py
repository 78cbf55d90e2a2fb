"""The office domain's entry in ``jointrl.envs.registry``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jointrl.envs.base import Env, Task
from jointrl.envs.office.env import OfficeEnv, office_config
from jointrl.envs.office.tasks import load_tasks as load
from jointrl.envs.sandbox.pool import shared_pool
from jointrl.envs.sandbox.settings import sandbox_settings


def load_tasks(task_dir: Path | None) -> list[Task]:
    return load(task_dir)


def make_env(envs_cfg: Any) -> Env:
    settings = sandbox_settings(envs_cfg)
    config = office_config(settings.config)
    # One warm pool per env-worker process and config: reset takes a started sandbox.
    return OfficeEnv(config, pool=shared_pool(config, settings.warm))
