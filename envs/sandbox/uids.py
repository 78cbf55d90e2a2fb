"""A pool of unprivileged host uids, one per live sandbox, shared by every process on the host.

Why a pool: resource limits such as ``RLIMIT_NPROC`` count processes *per real uid* and are
not enforced for root, and a sandbox escape lands with the host uid the sandbox ran as. So
each live sandbox gets a uid no one else holds: its limits are its own, its files are
unreadable to other episodes, and "kill every process of this uid" is a complete cleanup.

Coordination is an exclusive ``fcntl.flock`` on one lock file per uid. ``flock`` locks belong
to an open file description, so two leases in the same process exclude each other just as
two processes do, and the kernel drops the lock when a crashed holder's fds close.

The lock file also says whether its last holder left the uid clean: a holder writes
``dirty`` when it takes the lease and ``clean`` only after it killed every process of the uid
and removed its files.
The next holder sweeps ``/proc`` for leftovers (about a millisecond per sandbox start, the
largest host-side cost of a cold start) only when the file does not say ``clean`` (after a
crash, or a lock file of an older version) and was not just created by itself.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import random
import time
from pathlib import Path

from jointrl.envs.base import EnvError
from jointrl.envs.sandbox.kill import sigkill


_CLEAN, _DIRTY = b"clean", b"dirty"


class UidLease:
    """Exclusive hold on one host uid until :meth:`release` (idempotent)."""

    __slots__ = ("uid", "_fd", "inherited_clean")

    def __init__(self, uid: int, fd: int, inherited_clean: bool) -> None:
        self.uid = uid
        self._fd: int | None = fd
        self.inherited_clean = inherited_clean  # the previous holder released it clean: nothing of it is left

    def release(self, *, clean: bool = False) -> None:
        """Free the uid; ``clean=True`` promises that nothing of it is left (the next holder skips its sweep)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                if clean:
                    os.pwrite(fd, _CLEAN, 0)
            finally:
                os.close(fd)  # closing the only fd of the description drops the flock

    @property
    def held(self) -> bool:
        return self._fd is not None


def acquire_uid(uid_range: tuple[int, int], lock_dir: Path) -> UidLease:
    """Lease a free uid from ``uid_range`` (inclusive), after killing any stale processes of it.

    Uids that have a passwd entry are skipped: the range must be reserved for sandboxes, and a
    named account's processes must never be killed by the sweep. Raises ``EnvError`` when every
    uid of the range is held.
    """
    lo, hi = uid_range
    if lo <= 0:
        raise ValueError(f"uid_range must not include root, got {uid_range}")
    n = hi - lo + 1
    start = random.randrange(n)  # spread concurrent acquirers over the range
    for i in range(n):
        uid = lo + (start + i) % n
        if _has_passwd_entry(uid):
            continue
        fd, created = _open_lock(lock_dir / f"uid-{uid}.lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            state = os.pread(fd, len(_CLEAN), 0)
            clean = state == _CLEAN or (created and not state)  # a file no holder ever wrote: never used
            if not clean:
                # A previous holder may have crashed with processes still running, or with a
                # spawn in flight: its ``setpriv`` still root, about to switch to ``uid``.
                kill_uid(uid, switching=True)
            os.pwrite(fd, _DIRTY, 0)  # until our own release says otherwise
        except BaseException:
            os.close(fd)
            raise
        return UidLease(uid, fd, clean)
    raise EnvError(f"no free sandbox uid in {uid_range}: every uid is leased")


def _open_lock(path: Path) -> tuple[int, bool]:
    """Open (creating it if missing) a uid's lock file -> (fd, whether this call created it)."""
    flags = os.O_RDWR | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600), True
    except FileExistsError:
        return os.open(path, flags), False


def _has_passwd_entry(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def pids_of_uid(uid: int) -> list[int]:
    """Live host pids whose real or effective uid is ``uid`` (from ``/proc/<pid>/status``).

    Zombies are left out: they hold no resources and only their parent can reap them.
    """
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}/status", os.O_RDONLY)
            try:
                data = os.read(fd, 4096)  # State: and Uid: are in the first lines
            finally:
                os.close(fd)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # the process exited while we looked
        state = data.find(b"\nState:")
        uids = data.find(b"\nUid:")
        if state < 0 or uids < 0 or data[state + 7 :].split(None, 1)[0] in (b"Z", b"X"):
            continue
        real, effective = (int(x) for x in data[uids + 5 :].split(None, 2)[:2])
        if uid in (real, effective):
            pids.append(int(name))
    return pids


def leftover_pids(uid: int, keep: frozenset[int] = frozenset(), settle_s: float = 10.0) -> set[int]:
    """The processes of ``uid`` outside ``keep`` once the dying ones are gone (waits up to ``settle_s``).

    A SIGKILLed process has left its cgroup, released its memory and closed its files before it
    becomes a zombie, and ``/proc`` shows it as running for that moment: checking right after a
    cleanup sees it (CI did once). A real leftover is still there ``settle_s`` later.
    """
    deadline = time.monotonic() + settle_s
    while True:
        extra = set(pids_of_uid(uid)) - keep
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.01)


def switching_to(uid: int) -> list[int]:
    """Pids of ``setpriv --reuid=<uid>`` processes that have not switched yet (still root).

    ``bwrap_proc.spawn`` starts every sandbox process this way. A holder killed while one was
    in flight leaves it running: it becomes ``uid`` a moment later, after a sweep by uid alone
    has already looked (bwrap then waits forever on its child's setup, a leftover of ``uid``).
    Killing a holder at random moments during spawns left such a leftover in 8 of 60 trials
    without this and in 1 of 120 with it: the rest is the child's last microseconds before it
    execs ``setpriv`` (its lock fd already closed, its argv still Python's). That stray waits,
    never running the command, until the next holder's ``close`` sweeps the uid.
    """
    flag = f"--reuid={uid}".encode()
    pids = []
    for pid in pids_of_uid(0):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read(4096).split(b"\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if argv[0].rsplit(b"/", 1)[-1] == b"setpriv" and flag in argv:
            pids.append(pid)
    return pids


def kill_uid(uid: int, *, keep: frozenset[int] = frozenset(), rounds: int = 50, switching: bool = False) -> None:
    """SIGKILL every process of ``uid`` but ``keep`` until none is left (a forking process is caught next round).

    ``switching``: also kill the processes about to become ``uid`` (``switching_to``), for the
    sweep after a crashed holder. Raises ``EnvError`` if processes survive ``rounds`` sweeps
    (which RLIMIT_NPROC should prevent).
    """
    if uid == 0 or uid == os.getuid():  # rootless sandboxes run as our own uid: that would kill the job
        raise ValueError(f"refusing to kill every process of uid {uid} (root or our own)")
    for _ in range(rounds):
        # switching_to first: a process that switches between the two scans is then seen by uid.
        pids = (switching_to(uid) if switching else []) + [p for p in pids_of_uid(uid) if p not in keep]
        if not pids:
            return
        sigkill(pids)
        time.sleep(0.005)  # let the kernel reap before we look again
    raise EnvError(f"processes of sandbox uid {uid} survive SIGKILL: {sorted(set(pids_of_uid(uid)) - keep)}")


def children_of(pid: int, uid: int) -> list[int]:
    """Pids of ``uid`` whose parent is ``pid`` (from ``/proc/<pid>/stat``)."""
    out = []
    for p in pids_of_uid(uid):
        try:
            stat = Path(f"/proc/{p}/stat").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid:  # the comm field may hold spaces
            out.append(p)
    return out
