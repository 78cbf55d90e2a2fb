"""The sandbox contract shared by every backend (``bwrap`` here, ``docker`` where a daemon runs).

A sandbox is one isolated working directory plus a way to run shell commands in it.
Each backend's docstring states what it protects against and what it does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class ExecResult:
    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    """Limits applied to every command of one sandbox."""

    timeout_s: float = 30.0  # default wall-clock limit per command
    max_output_bytes: int = 16_384  # per stream; the rest is replaced by a marker
    max_processes: int = 64  # RLIMIT_NPROC of the episode's own host uid
    max_file_bytes: int = 64 << 20  # RLIMIT_FSIZE
    max_memory_bytes: int = 2 << 30  # RLIMIT_AS backstop (never for Chromium / OCP)
    cpu_seconds: int = 120  # RLIMIT_CPU
    uid_range: tuple[int, int] = (20000, 20999)  # host uids handed out one per live sandbox
    ro_binds: dict[str, str] = field(default_factory=dict)  # host path -> sandbox path, read-only

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"sandbox timeout_s must be > 0, got {self.timeout_s}")
        lo, hi = self.uid_range
        if not 0 < lo <= hi:
            raise ValueError(f"sandbox uid_range must be 0 < lo <= hi, got {self.uid_range}")


@runtime_checkable
class Sandbox(Protocol):
    workdir: Path  # the host directory that is the sandbox's writable /work

    def exec(self, cmd: str, timeout: float | None = None) -> ExecResult: ...

    def read_file(self, path: str) -> bytes: ...

    def write_file(self, path: str, data: bytes | str) -> None: ...

    def close(self) -> None: ...
