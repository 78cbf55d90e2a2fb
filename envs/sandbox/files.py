"""Host-side file operations on directories a sandboxed process controlled.

These run as root over trees the agent wrote, so they never follow a symlink on the host:
a link ``/work/x -> /etc/shadow`` must not make the host read its own ``/etc/shadow``. They
assume no sandboxed process runs meanwhile (``BwrapSandbox`` serializes them with ``exec``,
and every sandboxed process dies with its ``exec``), so there is no check-then-use race.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path, PurePosixPath

_MAX_SYMLINKS = 40  # the kernel's own limit on links followed in one lookup
_SAFE_MODE_BITS = 0o777  # setuid, setgid and sticky bits are dropped on every copy


def resolve_inside(root: Path, rel: str, *, mount: str = "/work") -> Path:
    """Resolve sandbox path ``rel`` (relative to ``mount``) to a host path under ``root``.

    Symlinks are followed the way the kernel would inside the sandbox, where ``root`` is
    mounted at ``mount``: a relative target continues from the link's directory, an absolute
    one must lie under ``mount``. Raises ``ValueError`` when ``..`` climbs above ``mount``, a
    link points outside it, or links nest deeper than 40. The result contains no symlink
    component, except that a missing final component is returned as is.
    """
    parts = list(PurePosixPath(rel).parts)
    if parts and parts[0] == "/":
        raise ValueError(f"path {rel!r} must be relative to {mount}")
    real: list[str] = []  # resolved components below root, none of them a symlink
    links = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not real:
                raise ValueError(f"path {rel!r} escapes {mount} through '..'")
            real.pop()
            continue
        candidate = root.joinpath(*real, part)
        if not candidate.is_symlink():
            real.append(part)
            continue
        links += 1
        if links > _MAX_SYMLINKS:
            raise ValueError(f"path {rel!r}: too many levels of symbolic links")
        target = PurePosixPath(os.readlink(candidate))
        if target.is_absolute():
            mount_parts = PurePosixPath(mount).parts
            if target.parts[: len(mount_parts)] != mount_parts:
                raise ValueError(f"path {rel!r}: symlink {part!r} points outside {mount} (to {str(target)!r})")
            real, parts = [], list(target.parts[len(mount_parts) :]) + parts
        else:
            parts = list(target.parts) + parts
    return root.joinpath(*real)


def read_regular(path: Path) -> bytes:
    """Read a regular file without following a final symlink or blocking on a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path.name!r} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def write_regular(path: Path, data: bytes, *, root: Path, owner: int | None) -> None:
    """Write ``data`` to ``path`` (under ``root``), creating missing parent dirs, all owned by ``owner``."""
    missing = []
    parent = path.parent
    while not parent.exists() and parent != root:
        missing.append(parent)
        parent = parent.parent
    if parent.is_symlink() or not parent.is_dir():
        raise ValueError(f"cannot create {path.name!r}: {parent.name!r} is not a directory")
    for d in reversed(missing):
        os.mkdir(d, 0o755)
        if owner is not None:
            os.lchown(d, owner, owner)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path.name!r} is not a regular file")
        os.ftruncate(fd, 0)
        if owner is not None:
            os.fchown(fd, owner, owner)
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(data)
    finally:
        os.close(fd)


def copy_tree(src: Path, dst: Path, *, owner: int | None, into: bool = False) -> None:
    """Copy directory ``src`` to new directory ``dst``; everything in ``dst`` is owned by ``owner``.

    Guarantees: symlinks are copied as links and never followed; FIFOs, sockets and device
    nodes are skipped; setuid/setgid/sticky bits are dropped; file mtimes are kept. ``dst``
    itself is created with mode 0700. Iterative, so a very deep tree cannot exhaust the stack.
    ``owner=None`` keeps the copy owned by the caller (root). ``into=True``: ``dst`` exists
    (an empty work dir) and keeps its own mode and owner.
    """
    if not into:
        os.mkdir(dst, 0o700)
        if owner is not None:
            os.lchown(dst, owner, owner)
    stack = [(src, dst)]
    while stack:
        s_dir, d_dir = stack.pop()
        with os.scandir(s_dir) as entries:
            for entry in entries:
                s, d = Path(entry.path), d_dir / entry.name
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(s), d)
                elif stat.S_ISDIR(st.st_mode):
                    os.mkdir(d, st.st_mode & _SAFE_MODE_BITS)
                    stack.append((s, d))
                elif stat.S_ISREG(st.st_mode):
                    _copy_file(s, d, st)
                else:
                    continue
                if owner is not None:
                    os.lchown(d, owner, owner)


def _copy_file(src: Path, dst: Path, st: os.stat_result) -> None:
    sfd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(sfd, "rb", closefd=False) as fin, os.fdopen(dfd, "wb", closefd=False) as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
            os.fchmod(dfd, st.st_mode & _SAFE_MODE_BITS)
            os.utime(dfd, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
