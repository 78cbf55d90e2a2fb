from jointrl.envs.sandbox.base import ExecResult, Sandbox, SandboxConfig

__all__ = ["ExecResult", "Sandbox", "SandboxConfig"]
