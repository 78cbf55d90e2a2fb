"""Sandboxes: the contract (``base``) and its backends; ``make_sandbox`` picks one by name."""

from __future__ import annotations

from typing import Any

from jointrl.envs.sandbox.base import ExecResult, Sandbox, SandboxConfig

BACKENDS = ("bwrap",)  # docker: planned (envs/images/), not built yet


def make_sandbox(backend: str = "bwrap", config: SandboxConfig | None = None, **kwargs: Any) -> Sandbox:
    """Open a sandbox of the named backend; ``kwargs`` go to the backend's constructor.

    Raises ``ValueError`` naming the allowed backends for an unknown ``backend``.
    """
    if backend == "bwrap":
        from jointrl.envs.sandbox.bwrap import BwrapSandbox

        return BwrapSandbox(config, **kwargs)
    raise ValueError(f"unknown sandbox backend {backend!r}; allowed: {list(BACKENDS)}")


__all__ = ["BACKENDS", "ExecResult", "Sandbox", "SandboxConfig", "make_sandbox"]
