"""The terminal domain's entry in ``jointrl.envs.registry``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jointrl.envs.base import Env, Task
from jointrl.envs.sandbox.pool import shared_pool
from jointrl.envs.sandbox.settings import sandbox_settings
from jointrl.envs.terminal.env import TerminalEnv
from jointrl.envs.terminal.tasks import load_tasks as load


def load_tasks(task_dir: Path | None, backend: str = "bwrap") -> list[Task]:
    """On bwrap, tasks that need their own Docker image are left out (one warning names them)."""
    return load(task_dir, backend=backend)


def make_env(envs_cfg: Any) -> Env:
    s = sandbox_settings(envs_cfg)
    # One warm pool per env-worker process and config: reset takes a started sandbox (docker: of
    # the domain's image, made at the first task without its own image).
    pool = shared_pool(s.config, s.warm) if s.backend == "bwrap" else None
    return TerminalEnv(s.config, pool=pool, backend=s.backend, compact=getattr(envs_cfg, "prompt", "full") == "compact",
                       verifier_network=s.verifier_network, warm=s.warm)
