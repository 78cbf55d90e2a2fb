"""The pieces of a bwrap sandbox run without root: the mode, the ``/work`` keeper, pid-namespace teardown.

As an ordinary user (a Slurm job on a shared node) there is no private host uid per episode,
no host mount and no ``/proc`` sweep by uid (it would kill the job's own Ray workers). Instead:

- **Disk**: ``Keeper`` is one small process per sandbox in a user + mount namespace of its own
  (util-linux ``unshare --map-root-user --mount``) that mounts a ``size=``-bounded tmpfs on the
  sandbox's work dir *in its namespace* and then waits on its stdin. Every command of the
  sandbox enters that namespace (``nsenter`` through ``/proc/<keeper>/ns/``: the keeper is our
  child and is reaped only by ``close``, so its pid cannot be reused meanwhile, and a dead
  keeper has no mount namespace left to enter) and starts bwrap there, so ``/work`` is that tmpfs; the host reads
  and writes it through ``/proc/<keeper>/root/...`` (same uid: allowed). The keeper exits when
  our end of its stdin closes, i.e. with the sandbox or with this process; its namespace and
  the tmpfs go with it.
- **Teardown**: every bwrap gets ``--unshare-pid``; its pid 1 is bwrap's own init, which exits
  when the command does, and the kernel then SIGKILLs everything left in the namespace: no
  process of an episode outlives its pid namespace, and no process outside it (the job's) is
  ever signalled. Each namespace's init is held by a pidfd (``pidfd_open`` while bwrap is
  still blocked on ``--block-fd``), so killing it can never hit a reused pid. Inside the
  persistent shell's namespace, ``kill_ns_members`` kills the leftovers of a command by
  walking the init's descendants (every process of a pid namespace descends from its init).
- **Processes**: ``RLIMIT_NPROC`` is counted per (user namespace, uid) since Linux 5.14
  (ucounts): set inside the episode's own user namespace it bounds the episode's processes and
  not the job's. On older kernels it would count every process of the job's uid, so it is
  left unset there (``userns_nproc``); a delegated pids cgroup bounds them where one exists.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from pathlib import Path

from jointrl.envs.base import EnvError
from jointrl.envs.sandbox.base import MODES
_KEEPER_START_S = 15.0


def resolve_mode(mode: str) -> bool:
    """``True`` for rootless: ``mode`` is ``rootless``, or ``auto`` and this process is not root."""
    if mode not in MODES:
        raise ValueError(f"envs.sandbox.mode must be one of {list(MODES)}, got {mode!r}")
    return mode == "rootless" or (mode == "auto" and os.geteuid() != 0)


def userns_nproc(release: str | None = None) -> bool:
    """Whether RLIMIT_NPROC set inside a user namespace counts only that namespace's processes (Linux >= 5.14)."""
    major, minor = (int(x) for x in (release or os.uname().release).split(".")[:2])
    return (major, minor) >= (5, 14)


class Keeper:
    """One sandbox's user + mount namespace holding a tmpfs of ``size_bytes`` on ``workdir`` (a host dir)."""

    def __init__(self, workdir: Path, size_bytes: int) -> None:
        if size_bytes <= 0:
            raise ValueError(f"tmpfs size must be > 0, got {size_bytes}")
        script = 'mount -t tmpfs -o "size=$1,mode=0700,nosuid,nodev" tmpfs "$2" && echo ready && read -r _'
        self.proc = subprocess.Popen(
            ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private", "--",
             "/bin/sh", "-c", script, "keeper", str(size_bytes), str(workdir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            env={"PATH": "/usr/bin:/bin"})  # fmt: skip
        try:
            ready, _, _ = select.select([self.proc.stdout], [], [], _KEEPER_START_S)
            if not ready or self.proc.stdout.readline() != b"ready\n":
                self.proc.kill()
                self.proc.wait()
                raise OSError(f"the /work keeper did not start: {self.proc.stderr.read(4096)!r}")
        except BaseException:
            self.close()
            raise
        self.pid = self.proc.pid  # unshare execs the shell: same pid, now inside the namespaces
        self.root = Path(f"/proc/{self.pid}/root")

    def view(self, path: Path) -> Path:
        """The host's path to ``path`` as the namespace sees it (the tmpfs at the work dir)."""
        return self.root / str(path).lstrip("/")

    def enter_argv(self) -> list[str]:
        """``nsenter`` into the namespace, keeping our uid (root of the namespace, by its map)."""
        ns = f"/proc/{self.pid}/ns"
        return ["nsenter", f"--user={ns}/user", f"--mount={ns}/mnt", "--preserve-credentials", "--"]

    def close(self) -> None:
        """End the keeper (its namespace and tmpfs go once no command runs in them). Idempotent."""
        if self.proc.returncode is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


class NsInit:
    """The pid 1 of one bwrap's pid namespace, held by a pidfd: killing it ends the namespace."""

    __slots__ = ("pid", "_fd")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = os.pidfd_open(pid)  # bwrap's child waits on --block-fd: it is alive here

    @property
    def alive(self) -> bool:
        if self._fd is None:
            return False
        return not select.select([self._fd], [], [], 0)[0]  # a pidfd turns readable when the process exits

    def kill(self) -> None:
        """SIGKILL the init (the kernel then kills every process of its namespace) and drop the pidfd."""
        if self._fd is None:
            return
        try:
            signal.pidfd_send_signal(self._fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(self._fd)
        self._fd = None


def children(pid: int) -> list[int]:
    """Host pids of ``pid``'s children, from ``/proc/<pid>/task/*/children`` (every thread's)."""
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out += [int(x) for x in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Host pids below ``pid``, parents before their children."""
    out, stack = [], [pid]
    while stack:
        kids = children(stack.pop())
        out += kids
        stack += kids
    return out


def kill_ns_members(init: NsInit, keep: frozenset[int] = frozenset(), timeout_s: float = 10.0) -> None:
    """SIGKILL every process of ``init``'s pid namespace but ``init`` and ``keep``, until none is left.

    A pid read from ``/proc`` is opened as a pidfd and its pid namespace checked *after* the
    open: the signal then goes to exactly the process that was checked, never to a process that
    took over its pid. Raises ``EnvError`` if processes survive ``timeout_s`` (a fork storm
    faster than the sweep; a pids limit prevents that).
    """
    try:
        ns = os.readlink(f"/proc/{init.pid}/ns/pid")
    except (FileNotFoundError, ProcessLookupError):
        return  # the namespace is gone, and everything in it
    deadline = time.monotonic() + timeout_s
    while True:
        targets = [p for p in descendants(init.pid) if p not in keep]
        if not targets:
            return
        if time.monotonic() > deadline:
            raise EnvError(f"processes of a sandbox pid namespace survive SIGKILL: {targets}")
        zombies = 0
        for pid in targets:
            try:
                fd = os.pidfd_open(pid)
            except (ProcessLookupError, OSError):
                continue
            try:
                if os.readlink(f"/proc/{pid}/ns/pid") != ns:
                    continue
                if _is_zombie(pid):  # killed already; its parent reaps it (and a zombie holds nothing)
                    zombies += 1
                    continue
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass
            finally:
                os.close(fd)
        if zombies == len(targets):
            return
        time.sleep(0.002)


def _is_zombie(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] in (b"Z", b"X")

