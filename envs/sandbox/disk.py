"""A size-bounded tmpfs as a sandbox's ``/work``: the disk bound that holds.

Why: RLIMIT_FSIZE caps each file, not how many files an episode writes, so on a plain host
directory an agent can fill the host's disk with many capped files. A tmpfs mounted on the
host at the sandbox's work dir, with ``size=``, bounds everything the episode writes to
``/work`` (``ENOSPC`` past it). Its pages are RAM, charged to the writer's memory cgroup, so
the sandbox's memory limit bounds them as well. ``/tmp`` inside the sandbox is bwrap's own
tmpfs with the same size bound.

Mounting needs ``CAP_SYS_ADMIN`` on the host (checked here: root in this container can).
Where it cannot, ``mount_tmpfs`` returns the reason and the work dir stays a plain directory:
then only RLIMIT_FSIZE (per file) bounds the disk, and the sandbox's docstring says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

_MNT_DETACH = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def mount_tmpfs(path: Path, size_bytes: int, uid: int) -> str | None:
    """Mount a tmpfs of ``size_bytes`` on the existing dir ``path``, root dir owned by ``uid``, mode 0700.

    Returns None on success, else why it could not (the dir is left as it was).
    """
    if size_bytes <= 0:
        raise ValueError(f"tmpfs size must be > 0, got {size_bytes}")
    opts = f"size={size_bytes},mode=0700,uid={uid},gid={uid}".encode()
    flags = 0x2 | 0x4  # MS_NOSUID | MS_NODEV
    if _libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", flags, opts) != 0:
        err = ctypes.get_errno()
        return f"mount tmpfs on {path}: {os.strerror(err)}"
    return None


def unmount(path: Path) -> None:
    """Lazily detach whatever is mounted on ``path`` (no error if nothing is)."""
    _libc.umount2(str(path).encode(), _MNT_DETACH)


def is_mount(path: Path) -> bool:
    try:
        return os.path.ismount(path)
    except OSError:
        return False
