"""The terminal domain's entry in ``jointrl.envs.registry``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jointrl.envs.base import Env, Task


def load_tasks(task_dir: Path | None) -> list[Task]:
    from jointrl.envs.terminal.tasks import load_tasks as load

    return load(task_dir, backend="bwrap")  # envs run on bwrap; a task needing its own image cannot


def make_env(envs_cfg: Any) -> Env:
    from jointrl.envs.sandbox import SandboxConfig
    from jointrl.envs.sandbox.pool import shared_pool
    from jointrl.envs.sandbox.rootless import mode_settings
    from jointrl.envs.terminal.env import TerminalEnv

    config = SandboxConfig(timeout_s=envs_cfg.command_timeout_s, **mode_settings(envs_cfg))
    # One warm pool per env-worker process and config: reset takes a started sandbox.
    return TerminalEnv(config, pool=shared_pool(config, getattr(envs_cfg, "warm_sandboxes", 4)),
                       compact=getattr(envs_cfg, "prompt", "full") == "compact")
