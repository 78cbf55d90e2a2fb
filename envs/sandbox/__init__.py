"""Sandboxes: the contract (``base``) and its backends; ``make_sandbox`` picks one by name.

``bwrap`` (``bwrap.py``): bubblewrap + a leased host uid + cgroups, the default here.
``docker`` (``docker.py``): a container per episode, where a Docker daemon is reachable.
"""

from __future__ import annotations

from typing import Any

from jointrl.envs.sandbox.base import ExecResult, Sandbox, SandboxConfig

BACKENDS = ("bwrap", "docker")


def make_sandbox(backend: str = "bwrap", config: SandboxConfig | None = None, **kwargs: Any) -> Sandbox:
    """Open a sandbox of the named backend; ``kwargs`` go to the backend's constructor.

    Raises ``ValueError`` naming the allowed backends for an unknown ``backend``, and
    ``EnvError`` (with the reason) when the backend cannot run on this host.
    """
    if backend == "bwrap":
        from jointrl.envs.sandbox.bwrap import BwrapSandbox  # lazy: only the chosen backend's module loads

        return BwrapSandbox(config, **kwargs)
    if backend == "docker":
        from jointrl.envs.sandbox.docker import DockerSandbox  # lazy: the docker SDK only when chosen

        return DockerSandbox(config, **kwargs)
    raise ValueError(f"unknown sandbox backend {backend!r}; allowed: {list(BACKENDS)}")


__all__ = ["BACKENDS", "ExecResult", "Sandbox", "SandboxConfig", "make_sandbox"]
