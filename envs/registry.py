"""Domains by name: how to load a domain's tasks and open one episode's env."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jointrl.envs.base import Env, Task

DOMAINS = ("terminal", "code_repo")


def _check(domain: str) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; available: {list(DOMAINS)}")


def load_tasks(domain: str, task_dir: str | None = None) -> list[Task]:
    """The domain's shipped tasks, or those under ``task_dir``."""
    _check(domain)
    root = Path(task_dir) if task_dir else None
    if domain == "code_repo":
        from jointrl.envs.code_repo import load_tasks as load_code_repo

        return load_code_repo(root)
    from jointrl.envs.terminal import load_tasks as load_terminal

    return load_terminal(root, backend="bwrap")  # envs run on bwrap; a task needing its own image cannot


def make_env(domain: str, envs_cfg: Any) -> Env:
    """A fresh env for one episode. ``envs_cfg`` is ``jointrl.rl.config.EnvsConfig`` (duck-typed:
    envs may not import rl)."""
    _check(domain)
    from jointrl.envs.sandbox import SandboxConfig

    config = SandboxConfig(timeout_s=envs_cfg.command_timeout_s)
    if domain == "code_repo":
        from jointrl.envs.code_repo import CodeRepoEnv

        return CodeRepoEnv(config)
    from jointrl.envs.sandbox.pool import shared_pool
    from jointrl.envs.terminal import TerminalEnv

    # One warm pool per env-worker process and config: reset takes a started sandbox.
    return TerminalEnv(config, pool=shared_pool(config, getattr(envs_cfg, "warm_sandboxes", 4)))
