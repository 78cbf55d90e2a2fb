"""The ``envs.sandbox`` config group turned into what a domain opens its sandboxes with.

Every domain's ``make_env`` calls :func:`sandbox_settings` once (``envs/*/domain.py``), so the
backend choice and the limits are read in one place. ``envs_cfg`` is ``rl.config.EnvsConfig``
duck-typed (envs may not import rl); an object without a ``sandbox`` group (a test's
``SimpleNamespace(command_timeout_s=5)``) gets the defaults and its legacy keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jointrl.envs.sandbox.base import SandboxConfig

# Domains whose envs run on the docker backend (others run their tools from host venvs on bwrap).
DOCKER_DOMAINS = ("terminal", "code_repo")


@dataclass(frozen=True, slots=True)
class SandboxSettings:
    backend: str  # "bwrap" | "docker" (envs/sandbox/__init__.BACKENDS)
    config: SandboxConfig  # the limits of every command
    warm: int  # warm sandboxes per env worker (sandbox/pool.py); 0: every reset starts one
    verifier_network: bool  # a task marked allow_internet gets a network for its verifier (docker only)


def sandbox_settings(envs_cfg: Any, **overrides: Any) -> SandboxSettings:
    """``envs_cfg.sandbox`` as ``SandboxSettings``; ``overrides`` replace ``SandboxConfig`` fields."""
    sb = getattr(envs_cfg, "sandbox", None)
    if sb is None:  # legacy / duck-typed: only the old flat keys
        timeout = getattr(envs_cfg, "command_timeout_s", None)
        config = SandboxConfig(**({"timeout_s": timeout} if timeout else {}), **overrides)
        return SandboxSettings("bwrap", config, int(getattr(envs_cfg, "warm_sandboxes", 4)), False)
    config = SandboxConfig(timeout_s=sb.timeout_s, max_output_bytes=sb.max_output_bytes,
                           max_processes=sb.max_processes, max_memory_bytes=sb.max_memory_mb << 20,
                           max_disk_bytes=sb.max_disk_mb << 20, cpu_seconds=sb.cpu_seconds,
                           mode=str(sb.mode), rootfs=sb.rootfs, **overrides)
    return SandboxSettings(str(sb.backend), config, int(sb.warm), bool(sb.verifier_network))


def check_backend(domain: str, backend: str) -> None:
    """Raise ``ValueError`` when ``domain`` cannot run on ``backend``."""
    if backend == "docker" and domain not in DOCKER_DOMAINS:
        raise ValueError(f"domain {domain!r} runs on the bwrap backend only (its tools are host venvs); "
                         f"envs.sandbox.backend=docker supports {list(DOCKER_DOMAINS)}")
