"""The bubblewrap sandbox backend: one private work dir, one host uid, one shell per command.

What it protects against (every ``exec``):

- **Network**: ``--unshare-all`` gives the command an empty network namespace (no loopback
  service of the host, no internet).
- **Writes outside the episode**: the host's ``/usr`` and ``/etc`` are mounted read-only, the
  root is remounted read-only, ``/tmp`` is a private tmpfs, and the only host directory
  mounted writable is the episode's own ``/work`` (plus the ``rw_dirs`` the caller asks for).
- **Other episodes**: each live sandbox runs under its own unprivileged *host* uid leased from
  ``config.uid_range`` (``uids.py``), and its host directory is mode 0700 owned by that uid,
  so even a process that escaped its mount namespace cannot read another episode's files.
  No capabilities (``--cap-drop ALL``), no nested user namespaces (``--disable-userns``).
- **Runaway commands**: a wall-clock timeout SIGKILLs the command's process group, the
  sandbox's pid-1 (which takes the whole pid namespace down with it) and, as a final sweep,
  every process of the sandbox's uid; ``exec`` then returns ``timed_out=True``, exit code 124.
  The uid sweep also runs after every command, so no process of an ``exec`` outlives it.
  Output is read concurrently from both pipes, capped at ``config.max_output_bytes`` per
  stream with a marker appended; the rest is read and discarded, so memory stays bounded.
- **Resource exhaustion, as a backstop**: ``prlimit`` sets RLIMIT_NPROC, FSIZE, CPU and AS on
  the command. RLIMIT_NPROC counts the processes of the *real uid*, is ignored for root, and
  is shared by every process of that uid: it means "at most N processes in this episode" only
  because the uid is non-root and unique to this live sandbox.

What it does not protect against: kernel exploits (the namespaces are the boundary); reads of
the host's world-readable ``/usr`` and ``/etc``; CPU and memory pressure on the host beyond
what rlimits bound (no cgroup here: RLIMIT_AS limits address space per process, not the
episode's total memory, and is wrong for Chromium / OCP); disk usage (RLIMIT_FSIZE caps each
file, not the number of files); background processes surviving an ``exec`` (none do: each
command gets a fresh pid namespace, so state lives in files only).

It needs root on the host (to switch to the leased uid) and ``bwrap`` with unprivileged user
namespaces. ``--die-with-parent`` ties the sandbox to the *thread* that spawned it.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import threading
import time
import weakref
from pathlib import Path, PurePosixPath

from jointrl.envs.base import EnvError
from jointrl.envs.sandbox.base import ExecResult, SandboxConfig
from jointrl.envs.sandbox.files import copy_tree, read_regular, resolve_inside, write_regular
from jointrl.envs.sandbox.uids import UidLease, acquire_uid, kill_uid

SANDBOX_ROOT = Path(os.environ.get("JOINTRL_SANDBOX_ROOT", "/tmp/jointrl-sandboxes"))
TIMEOUT_EXIT_CODE = 124  # what coreutils' `timeout` returns
_KILL_GRACE_S = 5.0  # after a timeout kill, how long to wait for the pipes to close
_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_RESERVED_DESTS = ("/", "/work", "/usr", "/etc", "/proc", "/dev", "/tmp") + _SYSTEM_DIRS
_DEFAULT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8", "TERM": "dumb"}


def sandbox_root() -> Path:
    """Create (once) and check the host directory holding every sandbox's private dir.

    It must be a real directory owned by us, because it lives in world-writable /tmp where
    anyone could have planted it first. Mode 0711: the leased uids may traverse it to reach
    their own dir (bwrap runs as them) but cannot list it.
    """
    SANDBOX_ROOT.mkdir(mode=0o711, parents=True, exist_ok=True)
    st = os.lstat(SANDBOX_ROOT)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise EnvError(f"{SANDBOX_ROOT} is not a directory owned by uid {os.geteuid()} and writable only by it")
    os.chmod(SANDBOX_ROOT, 0o711)
    (SANDBOX_ROOT / ".locks").mkdir(mode=0o700, exist_ok=True)
    return SANDBOX_ROOT


class _Capped:
    """Keeps the first ``cap`` bytes of a stream and counts the rest."""

    __slots__ = ("cap", "data", "dropped")

    def __init__(self, cap: int) -> None:
        self.cap, self.data, self.dropped = cap, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))

    def text(self) -> str:
        out = self.data.decode("utf-8", errors="replace")
        if self.dropped:
            out += f"\n[... output truncated: {self.dropped} bytes dropped ...]"
        return out


class BwrapSandbox:
    """One episode's sandbox: a private ``/work`` on the host, run under a leased host uid.

    ``workdir_from``: a host directory whose contents are copied into ``/work`` (task setup).
    ``ro_binds``: host path -> absolute sandbox path, mounted read-only; merged over
    ``config.ro_binds``. Each source is *copied* into the sandbox's private dir first (so it
    is readable by the leased uid wherever it lives on the host): keep them small.
    ``rw_dirs``: absolute sandbox paths that get fresh, empty, writable directories (e.g. a
    verifier's ``/logs/verifier``); ``read_file`` reads inside them by absolute path.
    ``env``: extra environment variables over the default ``PATH``, ``HOME=/work``, ``LANG``.

    The constructor runs a probe command and raises ``EnvError`` if the sandbox cannot start.
    ``exec``, ``read_file``, ``write_file`` and ``close`` are thread-safe (serialized).
    """

    def __init__(
        self,
        config: SandboxConfig | None = None,
        workdir_from: Path | None = None,
        ro_binds: dict[str, str] | None = None,
        *,
        rw_dirs: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.config = config or SandboxConfig()
        if os.geteuid() != 0:
            raise EnvError("BwrapSandbox needs root on the host to run each episode under its own uid")
        binds = {**self.config.ro_binds, **(ro_binds or {})}
        for dest in [*binds.values(), *rw_dirs]:
            _check_dest(dest)
        for src in binds:
            if not Path(src).exists():
                raise ValueError(f"ro_binds source {src!r} does not exist")
        if workdir_from is not None and not Path(workdir_from).is_dir():
            raise ValueError(f"workdir_from {str(workdir_from)!r} is not a directory")
        self.env = {**_DEFAULT_ENV, **(env or {})}
        self._lock = threading.Lock()
        self._closed = False
        root = sandbox_root()
        self._lease: UidLease = acquire_uid(self.config.uid_range, root / ".locks")
        self.uid = self._lease.uid
        _remove_stale_dirs(root, self.uid)
        self.private_dir = root / f"sb-{secrets.token_hex(8)}"
        self._finalizer = weakref.finalize(self, _cleanup, self._lease, self.private_dir)
        try:
            os.mkdir(self.private_dir, 0o700)
            os.chown(self.private_dir, self.uid, self.uid)
            self.workdir = self.private_dir / "work"
            if workdir_from is not None:
                copy_tree(Path(workdir_from), self.workdir, owner=self.uid)
            else:
                os.mkdir(self.workdir, 0o700)
                os.chown(self.workdir, self.uid, self.uid)
            self._mounts: list[tuple[str, Path, bool]] = []  # (sandbox path, host path, writable)
            for i, (src, dest) in enumerate(binds.items()):
                staged = self.private_dir / f"ro-{i}"
                _stage(Path(src), staged, owner=self.uid)
                self._mounts.append((dest, staged, False))
            self.rw_dirs: dict[str, Path] = {}
            for i, dest in enumerate(rw_dirs):
                host = self.private_dir / f"rw-{i}"
                os.mkdir(host, 0o700)
                os.chown(host, self.uid, self.uid)
                self._mounts.append((dest, host, True))
                self.rw_dirs[str(PurePosixPath(dest))] = host
            probe = self.exec("true", timeout=max(self.config.timeout_s, 10.0))
            if not probe.ok:
                raise EnvError(f"sandbox probe failed: exit {probe.exit_code}, stderr {probe.stderr!r}")
        except BaseException:
            self.close()
            raise

    # -- commands ---------------------------------------------------------------------------

    def exec(self, cmd: str, timeout: float | None = None) -> ExecResult:
        """Run ``cmd`` with ``bash -c`` in ``/work``; ``timeout`` defaults to ``config.timeout_s``.

        The command's own failures (non-zero exit, timeout, signals) are results; ``EnvError``
        means the sandbox itself failed (bwrap could not start, or died without reporting).
        """
        if not isinstance(cmd, str):
            raise TypeError(f"cmd must be a str, got {type(cmd).__name__}")
        timeout = self.config.timeout_s if timeout is None else timeout
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        with self._lock:
            self._check_open()
            return self._run(cmd, timeout)

    def _run(self, cmd: str, timeout: float) -> ExecResult:
        status_r, status_w = os.pipe()
        try:
            proc = subprocess.Popen(
                self._argv(cmd, status_w),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                user=self.uid,
                group=self.uid,
                extra_groups=[],
                start_new_session=True,  # our own process group, killed as a whole on timeout
                env={"PATH": "/usr/bin:/bin"},
            )
        except OSError as e:
            os.close(status_r)
            raise EnvError(f"cannot start bwrap: {e}") from e
        finally:
            os.close(status_w)
        cap = self.config.max_output_bytes
        out, err, status = _Capped(cap), _Capped(cap), _Capped(1 << 16)
        streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, status_r: status}
        timed_out = False
        try:
            timed_out = self._pump(proc, streams, status, time.monotonic() + timeout)
            try:
                proc.wait(timeout=_KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        finally:
            proc.stdout.close()
            proc.stderr.close()
            os.close(status_r)
            # The pid namespace dies with the command, but its last members may still be exiting
            # when bwrap reports: sweep the uid so that nothing of this exec outlives it.
            kill_uid(self.uid)
        reports = _parse_status(bytes(status.data))
        if timed_out:
            return ExecResult(out.text(), err.text(), TIMEOUT_EXIT_CODE, True, bool(out.dropped or err.dropped))
        if "exit-code" not in reports:  # bwrap reports it whenever the command itself ran to its end
            raise EnvError(f"bwrap failed (exit {proc.returncode}) before the command finished: {err.text()[-2000:]!r}")
        truncated = bool(out.dropped or err.dropped)
        return ExecResult(out.text(), err.text(), int(reports["exit-code"]), False, truncated)

    def _pump(self, proc: subprocess.Popen, streams: dict[int, _Capped], status: _Capped, deadline: float) -> bool:
        """Read every stream to EOF; on ``deadline`` kill everything. Returns whether it timed out."""
        sel = selectors.DefaultSelector()
        for fd in streams:
            sel.register(fd, selectors.EVENT_READ)
        timed_out, grace_end = False, 0.0
        try:
            while sel.get_map():
                now = time.monotonic()
                if not timed_out and now >= deadline:
                    timed_out, grace_end = True, now + _KILL_GRACE_S
                    self._kill(proc, _parse_status(bytes(status.data)).get("child-pid"))
                if timed_out and now >= grace_end:
                    break  # something still holds the pipes open; the uid sweep after the exec gets it
                for key, _ in sel.select(timeout=max(0.0, (grace_end if timed_out else deadline) - now)):
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        streams[key.fd].add(chunk)
                    else:
                        sel.unregister(key.fd)
        finally:
            sel.close()
        return timed_out

    def _kill(self, proc: subprocess.Popen, child_pid: int | None) -> None:
        """SIGKILL bwrap's process group, the sandbox's pid 1 (ending its pid namespace) and the uid."""
        for kill, target in ((os.killpg, proc.pid), (os.kill, child_pid)):
            if target:
                try:
                    kill(target, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        kill_uid(self.uid)

    def _argv(self, cmd: str, status_fd: int) -> list[str]:
        c = self.config
        argv = ["prlimit", f"--nproc={c.max_processes}", f"--fsize={c.max_file_bytes}",
                f"--cpu={c.cpu_seconds}", f"--as={c.max_memory_bytes}", "--"]  # fmt: skip
        # --unshare-all only *tries* a user namespace; we require one (--disable-userns needs it).
        argv += ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                 "--new-session", "--cap-drop", "ALL", "--ro-bind", "/usr", "/usr"]  # fmt: skip
        for d in _SYSTEM_DIRS:
            if os.path.islink(d):
                argv += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                argv += ["--ro-bind", d, d]
        argv += ["--ro-bind", "/etc", "/etc", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        argv += ["--bind", str(self.workdir), "/work"]
        for dest, host, writable in self._mounts:
            argv += ["--bind" if writable else "--ro-bind", str(host), dest]
        argv += ["--remount-ro", "/", "--chdir", "/work", "--clearenv"]
        for k, v in self.env.items():
            argv += ["--setenv", k, v]
        return argv + ["--json-status-fd", str(status_fd), "/bin/bash", "-c", cmd]

    # -- files ------------------------------------------------------------------------------

    def _host_path(self, path: str) -> tuple[Path, Path]:
        """Map a sandbox path (relative to /work, or absolute under /work or a rw dir) to (root, host path)."""
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty str, got {path!r}")
        p = PurePosixPath(path)
        if not p.is_absolute():
            return self.workdir, resolve_inside(self.workdir, path)
        for mount, host in {"/work": self.workdir, **self.rw_dirs}.items():
            if p.is_relative_to(mount):  # lexical: a '..' left in the rest is refused by resolve_inside
                return host, resolve_inside(host, str(p.relative_to(mount)), mount=mount)
        raise ValueError(f"path {path!r} is outside /work and the sandbox's writable dirs")

    def read_file(self, path: str) -> bytes:
        """Bytes of a regular file; symlinks are followed only while they stay inside the mount."""
        with self._lock:
            self._check_open()
            _, host = self._host_path(path)
            return read_regular(host)

    def write_file(self, path: str, data: bytes | str) -> None:
        """Create or replace a file (and missing parent dirs), owned by the sandbox's uid."""
        if isinstance(data, str):
            data = data.encode()
        with self._lock:
            self._check_open()
            root, host = self._host_path(path)
            if host == root:
                raise ValueError(f"path {path!r} names a directory, not a file")
            write_regular(host, data, root=root, owner=self.uid)

    def copy_workdir_to(self, dest: Path) -> None:
        """Snapshot ``/work`` into the new host directory ``dest`` (mode 0700, owned by root).

        Symlinks are copied as links; FIFOs, sockets and devices are skipped; setuid bits dropped.
        """
        with self._lock:
            self._check_open()
            copy_tree(self.workdir, Path(dest), owner=None)

    # -- lifecycle --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("sandbox is closed")

    def close(self) -> None:
        """Kill every process of the uid, delete the private dir, free the uid. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._finalizer()

    def __enter__(self) -> BwrapSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cleanup(lease: UidLease, private_dir: Path) -> None:
    """Runs once, from ``close`` or when the sandbox is garbage-collected without it."""
    if not lease.held:
        return
    try:
        kill_uid(lease.uid)
        shutil.rmtree(private_dir, ignore_errors=True)
    finally:
        lease.release()  # only once nothing of the uid is left for the next holder to inherit


def _remove_stale_dirs(root: Path, uid: int) -> None:
    """Delete private dirs a crashed holder of ``uid`` left behind (we hold its lease now)."""
    for entry in os.scandir(root):
        if not entry.name.startswith("sb-"):
            continue
        try:
            owner = entry.stat(follow_symlinks=False).st_uid
        except FileNotFoundError:  # another sandbox (another uid) closed meanwhile
            continue
        if owner == uid:
            shutil.rmtree(entry.path, ignore_errors=True)


def _check_dest(dest: str) -> None:
    p = PurePosixPath(dest)
    if not p.is_absolute() or ".." in p.parts or str(p) != dest.rstrip("/") or dest == "/":
        raise ValueError(f"sandbox mount point {dest!r} must be a normalized absolute path")
    for reserved in _RESERVED_DESTS:
        if p == PurePosixPath(reserved) or (reserved != "/" and p.is_relative_to(reserved)):
            raise ValueError(f"sandbox mount point {dest!r} overlaps the reserved {reserved!r}")


def _stage(src: Path, dest: Path, *, owner: int) -> None:
    if src.is_dir():
        copy_tree(src, dest, owner=owner)
    else:
        shutil.copyfile(src, dest)
        os.chmod(dest, 0o444)
        os.chown(dest, owner, owner)


def _parse_status(raw: bytes) -> dict[str, int]:
    """Merge bwrap's ``--json-status-fd`` documents (one per line) that arrived completely."""
    merged: dict[str, int] = {}
    for line in raw.split(b"\n")[:-1]:  # the last piece is empty or an incomplete document
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        merged.update({k: v for k, v in doc.items() if k in ("child-pid", "exit-code")})
    return merged
