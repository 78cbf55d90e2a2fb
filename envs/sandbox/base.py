"""The sandbox contract shared by every backend (``bwrap`` here, ``docker`` where a daemon runs).

A sandbox is one isolated working directory plus two ways to run shell commands in it:
``exec`` (one-shot: a fresh ``bash -c`` per command, nothing but files persists) and
``run`` (the episode's persistent shell: cwd and environment persist, see ``shell.py``).
Each backend's docstring states what it protects against and what it does not.
tests/envs/sandbox/test_contract.py is the one contract suite every backend runs.
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
    shell_restarted: bool = False  # the persistent shell died or was killed; the next command gets a new one

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


MODES = ("auto", "root", "rootless")  # SandboxConfig.mode (envs.sandbox.mode): rootless.resolve_mode


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    """Limits applied to every command of one sandbox.

    ``max_memory_bytes`` is the episode's memory cgroup limit where the host allows one
    (``cgroups.py``), else an RLIMIT_AS backstop per process (never use that for Chromium /
    OCP: set ``use_cgroup`` and run where cgroups work). ``max_disk_bytes`` sizes the tmpfs
    that is ``/work`` (and ``/tmp``); 0 keeps a plain host directory, bounded per file only.
    ``tool_mounts`` (host path -> sandbox path) are bound read-only *without copying*: a
    domain's tool venv; they must be world-readable on the host (the episode's uid reads them).
    ``mode`` and ``rootfs`` are ``envs.sandbox.mode`` / ``envs.sandbox.rootfs`` (bwrap backend:
    ``bwrap.py``'s docstring states what each mode contains).
    """

    timeout_s: float = 30.0  # default wall-clock limit per command
    max_output_bytes: int = 16_384  # per stream; the rest is replaced by a marker
    max_processes: int = 64  # pids cgroup and RLIMIT_NPROC of the episode's own host uid
    max_file_bytes: int = 64 << 20  # RLIMIT_FSIZE
    max_memory_bytes: int = 2 << 30  # memory cgroup (RLIMIT_AS where there is none)
    max_disk_bytes: int = 1 << 30  # tmpfs size of /work and of /tmp; 0: plain dir
    cpu_seconds: int = 120  # RLIMIT_CPU, per process
    use_cgroup: bool = True
    uid_range: tuple[int, int] = (20000, 20999)  # host uids handed out one per live sandbox
    ro_binds: dict[str, str] = field(default_factory=dict)  # host path -> sandbox path, read-only copy
    tool_mounts: dict[str, str] = field(default_factory=dict)  # host path -> sandbox path, read-only bind
    mode: str = "auto"  # bwrap: root (a leased host uid per episode) | rootless (user namespaces) | auto
    rootfs: str | None = None  # bwrap: the sandbox's /usr, /etc (and /bin, /lib*) from this dir; None: the host's
    # bwrap: allow nested user namespaces (no --disable-userns). Only for a sandbox whose own trusted
    # process puts untrusted code in namespaces of its own and forbids it new ones (envs/cad/builder.py).
    nested_userns: bool = False

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"sandbox timeout_s must be > 0, got {self.timeout_s}")
        for name in ("max_output_bytes", "max_processes", "max_file_bytes", "max_memory_bytes", "cpu_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox {name} must be > 0, got {getattr(self, name)}")
        if self.max_disk_bytes < 0:
            raise ValueError(f"sandbox max_disk_bytes must be >= 0, got {self.max_disk_bytes}")
        if self.mode not in MODES:
            raise ValueError(f"envs.sandbox.mode must be one of {list(MODES)}, got {self.mode!r}")
        lo, hi = self.uid_range
        if not 0 < lo <= hi:
            raise ValueError(f"sandbox uid_range must be 0 < lo <= hi, got {self.uid_range}")


@runtime_checkable
class Sandbox(Protocol):
    workdir: Path  # the host directory that is the sandbox's writable /work

    def exec(self, cmd: str, timeout: float | None = None) -> ExecResult: ...

    def run(self, cmd: str, timeout: float | None = None) -> ExecResult:
        """Run ``cmd`` in the persistent shell (see ``Shell``); ``timeout`` as for ``exec``."""
        ...

    def read_file(self, path: str) -> bytes: ...

    def write_file(self, path: str, data: bytes | str) -> None: ...

    def close(self) -> None: ...
