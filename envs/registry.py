"""Domains by name: how to load a domain's tasks and open one episode's env."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jointrl.envs.base import Env, Task

DOMAINS = ("terminal",)


def _check(domain: str) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; available: {list(DOMAINS)}")


def load_tasks(domain: str, task_dir: str | None = None) -> list[Task]:
    """The domain's shipped tasks, or those under ``task_dir``."""
    _check(domain)
    from jointrl.envs.terminal import load_tasks as load_terminal

    return load_terminal(Path(task_dir) if task_dir else None)


def make_env(domain: str, envs_cfg: Any) -> Env:
    """A fresh env for one episode. ``envs_cfg`` is ``jointrl.rl.config.EnvsConfig`` (duck-typed:
    envs may not import rl)."""
    _check(domain)
    from jointrl.envs.sandbox import SandboxConfig
    from jointrl.envs.terminal import TerminalEnv

    return TerminalEnv(SandboxConfig(timeout_s=envs_cfg.command_timeout_s))
