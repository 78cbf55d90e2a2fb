"""CPU seconds of this process and everything it starts -- sandboxes included.

A sandboxed command runs in its own pid namespace and is reaped there, so its CPU time never reaches
this process's rusage (``children_user``): summing ``psutil`` over our live descendants misses every
sandbox that has already ended (measured: a 1 CPU-s command in a ``BwrapSandbox`` added 0.0). Where the
host has cgroup v1's ``cpuacct`` controller and we may write it (root), :class:`CpuClock` moves this
process into a ``cpuacct`` group of its own before anything starts: every descendant inherits it -- Ray's
processes, env workers, sandboxes (the sandboxes move only into memory / pids groups) -- and
``cpuacct.usage`` counts them all, finished ones included. Elsewhere it falls back to the psutil sum
(``exact`` is False then, and the numbers are a lower bound).
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

import psutil

CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class CpuClock:
    """``clock()``: CPU seconds so far; ``exact``: whether sandboxed processes are counted."""

    def __init__(self, name: str = "jointrl") -> None:
        self.group: Path | None = CPUACCT / f"{name}-{os.getpid()}"
        try:
            self.group.mkdir()
            (self.group / "cgroup.procs").write_text(str(os.getpid()))
            atexit.register(self.close)
        except OSError:
            self.group = None
        self.exact = self.group is not None

    def __call__(self) -> float:
        if self.group is not None:
            return int((self.group / "cpuacct.usage").read_text()) / 1e9
        me, total = psutil.Process(), 0.0
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.Error:  # exited in between: its time is in its parent's children_*
                continue
            total += t.user + t.system + t.children_user + t.children_system
        return total

    def close(self) -> None:
        """Move this process back to the root group and remove ours (once its last member has left)."""
        if self.group is None:
            return
        group, self.group = self.group, None
        try:
            (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            return
        for _ in range(50):
            try:
                group.rmdir()
                return
            except OSError:  # a descendant still in it, exiting
                time.sleep(0.1)
