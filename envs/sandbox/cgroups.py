"""Per-sandbox memory and pids cgroups, where the host lets us create them.

Why: rlimits are per process (RLIMIT_AS bounds one process's address space, not an episode's
total memory, and breaks Chromium / OCP), so a memory bomb split over 50 processes passes
them. A cgroup bounds the whole episode: the kernel OOM-kills inside it, the host and other
episodes keep their memory. The pids controller bounds the process count even for a uid
whose RLIMIT_NPROC is shared.

Checked on the development host (kernel 6.18, root in a container): cgroup **v1** memory
and pids hierarchies are writable (mkdir, ``memory.limit_in_bytes``, ``pids.max``, moving a
process by pid), the v2 mount has no memory controller. Both layouts are handled:

- v1: ``<memory mount>/<our own memory cgroup>/jointrl-uid-<uid>`` and
  ``<pids mount>/<our own pids cgroup>/jointrl-uid-<uid>``;
- v2 (unified, untested here: no such host): ``/sys/fs/cgroup/<our cgroup>/jointrl-uid-<uid>``,
  which needs ``memory`` and ``pids`` in our cgroup's ``subtree_control`` (delegation); where
  our own cgroup holds processes (the kernel then refuses controllers in its subtree), its
  parent, if that one is delegated to us (Slurm's ``job_<id>/step_<id>/user/``, a systemd
  ``Delegate=yes`` unit).

Without root (rootless mode) the same layouts apply wherever the directories are ours: a
Slurm job cgroup or systemd user slice delegated to the job's uid (v1: our memory and pids
cgroups writable by us; moving our own processes needs no more). ``probe()`` says which
applies or why none does; callers fall back to rlimits and say so. In root mode the cgroup is
named after the sandbox's leased uid, so a crashed holder's cgroup is found and removed by the
next holder of that uid (whose lease already killed every process of it); rootless sandboxes
name theirs after their private dir.
"""

from __future__ import annotations

import functools
import os
import secrets
import threading
import time
from pathlib import Path

from jointrl.envs.sandbox.kill import sigkill

_V1_ROOT = Path("/sys/fs/cgroup")
_V2_ROOT = Path("/sys/fs/cgroup")


def _own_path(controller: str) -> str | None:
    """Our own cgroup path in the hierarchy of ``controller`` ('' for v2), from /proc/self/cgroup."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return None


_PROBE_LOCK = threading.Lock()


def probe() -> tuple[str, dict[str, Path]] | tuple[None, str]:
    """``("v1" | "v2", {"memory": parent dir, "pids": parent dir})``, or ``(None, why not)``: found once per
    process, under a lock (the first sandboxes of a process start in threads at once; the answer is kept)."""
    with _PROBE_LOCK:
        return _probe()


@functools.cache
def _probe() -> tuple[str, dict[str, Path]] | tuple[None, str]:
    v1 = {}
    for ctl in ("memory", "pids"):
        own = _own_path(ctl)
        mount = _V1_ROOT / ctl
        if own is not None and (mount / "cgroup.procs").exists():
            v1[ctl] = mount / own.lstrip("/")
    if len(v1) == 2 and all(_can_create(p) for p in v1.values()):
        return "v1", v1
    own = _own_path("")
    why = "no writable memory+pids cgroup (v1 or delegated v2) on this host"
    if own is not None and (_V2_ROOT / "cgroup.controllers").exists():
        own_dir = _V2_ROOT / own.lstrip("/")
        for parent in dict.fromkeys((own_dir, own_dir.parent)):  # ours, else the delegated one above it
            try:
                enabled = (parent / "cgroup.subtree_control").read_text().split()
                if {"memory", "pids"} - set(enabled):
                    (parent / "cgroup.subtree_control").write_text("+memory +pids")
            except OSError as e:
                why = f"cgroup v2 without memory/pids delegation to {parent}: {e}"
                continue
            if _can_create(parent):
                return "v2", {"memory": parent, "pids": parent}
    return None, why


def _can_create(parent: Path) -> bool:
    """Whether we may make a cgroup under ``parent``: one made and removed, under a name no other probe
    uses at the same time (sandboxes of one process reset in threads at once; a shared name made one of
    them see EEXIST and run without a cgroup)."""
    test = parent / f"jointrl-probe-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        test.mkdir()
        test.rmdir()
        return True
    except OSError:
        return False


class Cgroup:
    """The memory + pids cgroup(s) of one sandbox. ``Cgroup.create`` returns None without support."""

    def __init__(self, version: str, dirs: list[Path]) -> None:
        self.version, self.dirs = version, dirs

    @classmethod
    def create(cls, owner: int | str, memory_bytes: int, max_pids: int) -> Cgroup | None:
        """``owner``: the sandbox's leased uid (root mode) or a name unique to it (rootless)."""
        found = probe()
        if found[0] is None:
            return None
        version, parents = found
        name = f"jointrl-uid-{owner}" if isinstance(owner, int) else owner
        dirs = list(dict.fromkeys(parents[c] / name for c in ("memory", "pids")))
        for d in dirs:
            _remove(d)  # a crashed holder of this uid left it (its processes are dead by now)
            d.mkdir()
        cg = cls(version, dirs)
        try:
            if version == "v1":
                (dirs[0] / "memory.limit_in_bytes").write_text(str(memory_bytes))
                (dirs[1] / "pids.max").write_text(str(max_pids))
            else:
                (dirs[0] / "memory.max").write_text(str(memory_bytes))
                swap = dirs[0] / "memory.swap.max"
                if swap.exists():
                    swap.write_text("0")
                (dirs[0] / "pids.max").write_text(str(max_pids))
        except OSError:
            cg.remove()
            raise
        return cg

    def add(self, pid: int) -> None:
        """Move process ``pid`` (not its existing children) into the cgroup(s)."""
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        """Every process in the pids cgroup: all of the sandbox's (none can leave it: no /sys inside)."""
        return [int(x) for x in (self.dirs[-1] / "cgroup.procs").read_text().split()]

    def kill_all(self, keep: frozenset[int] = frozenset(), timeout_s: float = 10.0) -> None:
        """SIGKILL every process in the cgroup but ``keep`` until none is left (a forking one is caught
        next round). A killed process leaves the cgroup only once the kernel has reaped it, which on a
        loaded machine can take far longer than a few rounds: the limit is time, not rounds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pids = [p for p in self.pids() if p not in keep]
            if not pids:
                return
            sigkill(pids)
            time.sleep(0.002)
        raise OSError(f"processes survive SIGKILL in {self.dirs[-1]}: {sorted(set(self.pids()) - keep)}")

    def oom_kills(self) -> int:
        """How many processes the kernel OOM-killed in this cgroup so far."""
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        try:
            for line in (self.dirs[0] / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0

    def remove(self) -> None:
        for d in self.dirs:
            _remove(d)


def _remove(d: Path) -> None:
    """rmdir a cgroup; its processes may take a moment to leave after SIGKILL."""
    for _ in range(200):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.005)
    d.rmdir()
