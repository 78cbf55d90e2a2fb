"""What a bwrap sandbox looks like from inside: bwrap's argument list and the rlimits.

The view: new namespaces of every kind (no network), no capabilities, no nested user
namespaces; the host's ``/usr`` and ``/etc`` (and the ``/bin``-style dirs or their symlinks)
read-only, or those of ``config.rootfs`` (a directory holding a Debian-style root, e.g. built
by ``mmdebstrap``: ``.ci/setup.d/rootfs.sh``) when it is set; a fresh ``/proc``, ``/dev`` and
size-bounded ``/tmp``; the episode's host work dir at ``/work``; the caller's extra mounts;
the root remounted read-only; a clean environment.

The rlimits (RLIMIT_NPROC where it counts only the episode's processes, RLIMIT_FSIZE,
RLIMIT_CPU, and RLIMIT_AS where no memory cgroup exists) are set soft = hard, so no sandboxed
process can raise them. A bash we start sets them itself, first thing (``ulimit_prefix``): no
extra exec on the start path. Any other command runs under ``prlimit`` (``prlimit_argv``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from jointrl.envs.sandbox.base import SandboxConfig

SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
RESERVED_DESTS = ("/", "/work", "/usr", "/etc", "/proc", "/dev", "/tmp") + SYSTEM_DIRS
DEFAULT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8", "TERM": "dumb"}
LIMIT_FAILED_EXIT_CODE = 125  # a bash whose ``ulimit`` failed exits with this before running anything


def bwrap_argv(config: SandboxConfig, workdir: Path, mounts: Iterable[tuple[str, Path, bool]],
               env: dict[str, str], cmd: list[str], *, status_fd: int | None, block_fd: int | None,
               ids: tuple[int, int] | None = None) -> list[str]:
    """bwrap's argv for ``cmd``; ``mounts`` are (sandbox path, host path, writable).

    bwrap reports its child's pid and the command's exit code on ``status_fd`` and starts
    nothing inside the sandbox until a byte arrives on ``block_fd`` (None: no such fd; the
    benchmark's bare bwrap). ``ids``: the (uid, gid) the sandbox's processes see (default:
    bwrap's own, which is right unless bwrap runs as root of an outer user namespace).
    """
    # --unshare-all only *tries* a user namespace; we require one (--disable-userns needs it).
    argv = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL"]  # fmt: skip
    if config.nested_userns:
        argv.remove("--disable-userns")
    if ids is not None:
        argv += ["--uid", str(ids[0]), "--gid", str(ids[1])]
    argv += system_binds(config.rootfs)
    argv += ["--proc", "/proc", "--dev", "/dev"]
    if config.max_disk_bytes:
        argv += ["--size", str(config.max_disk_bytes)]
    argv += ["--tmpfs", "/tmp", "--bind", str(workdir), "/work"]
    for dest, host, writable in mounts:
        argv += ["--bind" if writable else "--ro-bind", str(host), dest]
    argv += ["--remount-ro", "/", "--chdir", "/work", "--clearenv"]
    for k, v in env.items():
        argv += ["--setenv", k, v]
    if block_fd is not None:
        argv += ["--block-fd", str(block_fd)]
    if status_fd is not None:
        argv += ["--json-status-fd", str(status_fd)]
    return argv + cmd


def system_binds(rootfs: str | None) -> list[str]:
    """``/usr``, ``/etc`` and the ``/bin``-style dirs (or their symlinks) read-only, from ``rootfs`` or the host."""
    base = rootfs.rstrip("/") if rootfs else ""
    argv = ["--ro-bind", f"{base}/usr", "/usr"]
    for d in SYSTEM_DIRS:
        if os.path.islink(base + d):
            argv += ["--symlink", os.readlink(base + d), d]
        elif os.path.isdir(base + d):
            argv += ["--ro-bind", base + d, d]
    return argv + ["--ro-bind", f"{base}/etc", "/etc"]


def check_rootfs(rootfs: str) -> None:
    """A rootfs must be an absolute directory with ``usr/bin/bash`` and ``etc`` in it."""
    p = Path(rootfs)
    if not p.is_absolute() or not (p / "usr" / "bin" / "bash").exists() or not (p / "etc").is_dir():
        raise ValueError(f"envs.sandbox.rootfs {rootfs!r} must be an absolute directory holding usr/bin/bash and etc/ "
                         "(build one with .ci/setup.d/rootfs.sh)")


def ulimit_prefix(config: SandboxConfig, *, memory_cgroup: bool, nproc: bool = True) -> str:
    """Bash that sets the rlimits before anything else runs (RLIMIT_FSIZE and RLIMIT_AS in KiB).

    The host cannot ``prlimit(2)`` another uid's process without ``CAP_SYS_RESOURCE`` (which
    root in this container lacks), and a ``prlimit`` wrapper costs an exec per start.
    ``nproc=False`` leaves RLIMIT_NPROC unset (rootless on a kernel that counts it per uid).
    """
    c = config
    cmd = f"ulimit -f {max(1, c.max_file_bytes // 1024)} -t {c.cpu_seconds}"
    if nproc:
        cmd += f" -u {c.max_processes}"
    if not memory_cgroup:  # RLIMIT_AS breaks Chromium / OCP: only where no memory cgroup exists
        cmd += f" -v {max(1, c.max_memory_bytes // 1024)}"
    return f"{cmd} || exit {LIMIT_FAILED_EXIT_CODE}"


def prlimit_argv(config: SandboxConfig, *, memory_cgroup: bool, nproc: bool = True) -> list[str]:
    """``prlimit`` and its options, to put in front of a command that is not one of our bashes.

    ``nproc=False`` (rootless: ``prlimit`` runs outside the episode's user namespace, where
    RLIMIT_NPROC would count the job's own processes) leaves RLIMIT_NPROC unset.
    """
    c = config
    argv = ["prlimit", f"--fsize={c.max_file_bytes}", f"--cpu={c.cpu_seconds}"]
    if nproc:
        argv.append(f"--nproc={c.max_processes}")
    if not memory_cgroup:
        argv.append(f"--as={c.max_memory_bytes}")
    return argv + ["--"]


def check_dest(dest: str) -> None:
    """A mount point must be a normalized absolute path clear of the sandbox's own mounts."""
    p = PurePosixPath(dest)
    if not p.is_absolute() or ".." in p.parts or str(p) != dest.rstrip("/") or dest == "/":
        raise ValueError(f"sandbox mount point {dest!r} must be a normalized absolute path")
    for reserved in RESERVED_DESTS:
        if p == PurePosixPath(reserved) or (reserved != "/" and p.is_relative_to(reserved)):
            raise ValueError(f"sandbox mount point {dest!r} overlaps the reserved {reserved!r}")


def check_world_readable(src: str) -> None:
    """A tool mount is read by the episode's uid: every ancestor must be o+x and it o+r."""
    p = Path(src)
    if not p.is_absolute() or not p.exists():
        raise ValueError(f"tool_mounts source {src!r} must be an existing absolute path")
    for anc in [*reversed(p.parents), p]:
        mode = os.stat(anc).st_mode
        need = 0o005 if (anc == p and stat.S_ISDIR(mode)) or anc != p else 0o004
        if mode & need != need:
            raise ValueError(f"tool_mounts source {src!r} is not world-readable ({str(anc)!r} has mode {oct(mode & 0o777)})")
