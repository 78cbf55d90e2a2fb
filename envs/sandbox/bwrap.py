"""The bubblewrap sandbox backend: one private work dir, one host uid, one cgroup per episode.

Commands run two ways: ``run`` in the episode's persistent shell (``shell.py``: cwd and
environment persist; started once, in a long-lived spawner thread) and ``exec``, one-shot,
a fresh bwrap + ``bash -c`` per command (the verifier's way). What it protects against:

- **Network**: ``--unshare-all`` gives every command an empty network namespace (no loopback
  service of the host, no internet).
- **Writes outside the episode**: the host's ``/usr`` and ``/etc`` are mounted read-only, the
  root is remounted read-only, ``/tmp`` is a private size-bounded tmpfs, and the only host
  directory mounted writable is the episode's own ``/work`` (plus the ``rw_dirs`` asked for).
- **Other episodes**: each live sandbox runs under its own unprivileged *host* uid leased from
  ``config.uid_range`` (``uids.py``), and its host directory is mode 0700 owned by that uid,
  so even a process that escaped its mount namespace cannot read another episode's files.
  No capabilities (``--cap-drop ALL``), no nested user namespaces (``--disable-userns``).
  The host-side file tools (``read_file`` / ``write_file``) never follow a symlink out of
  ``/work`` (``files.py``).
- **Memory and process bombs**: where the host lets us (``cgroups.py``; v1 here), every
  process of the sandbox is in its own memory cgroup (``max_memory_bytes`` for the whole
  episode; the kernel OOM-kills inside it) and pids cgroup (``max_processes``). bwrap is
  started with ``--block-fd`` and moved into the cgroup before it runs anything, so no
  process of the sandbox starts outside it. Without cgroups, RLIMIT_AS per process is the
  memory backstop and RLIMIT_NPROC (per uid: meaningful because the uid is unique) the
  process bound. RLIMIT_NPROC, RLIMIT_FSIZE and RLIMIT_CPU are set either way, soft = hard,
  before any command runs (``bwrap_argv.py``).
- **Disk**: ``/work`` is a tmpfs of ``max_disk_bytes`` mounted on the host (``disk.py``)
  and ``/tmp`` a bwrap tmpfs of the same size: the episode cannot write more than that to
  either (``ENOSPC``), and the pages count against its memory cgroup. Without the mount
  (``max_disk_bytes=0`` or no ``CAP_SYS_ADMIN``) only RLIMIT_FSIZE bounds each file.
- **Runaway commands**: each command has a wall-clock timeout; then every process of the
  sandbox's uid (but the idle shell) is SIGKILLed and the result says ``timed_out``. After
  every command the same sweep runs, so no background process outlives its command, and
  ``close`` kills everything of the uid: nothing outlives the episode. Output is read
  concurrently from both pipes, capped at ``max_output_bytes`` per stream with a marker.

What it does not protect against: kernel exploits (the namespaces are the boundary); reads of
the host's world-readable ``/usr`` and ``/etc`` (and of ``tool_mounts``); CPU contention
(RLIMIT_CPU bounds each process's CPU time, not the episode's share of the host); memory
beyond RLIMIT_AS per process where cgroups are unavailable; disk filling where the tmpfs
cannot be mounted (then RLIMIT_FSIZE caps each file, not the number of files).

It needs root on the host (to switch to the leased uid, with util-linux's ``setpriv``) and
``bwrap`` with unprivileged user namespaces. The parts: ``bwrap_argv.py`` (the sandbox's view and limits), ``bwrap_proc.py``
(starting bwrap blocked, moving it into the cgroup, reading a command to its end),
``host_dirs.py`` (the private dirs), ``uids.py``, ``cgroups.py``, ``disk.py``, ``files.py``,
``shell.py``; this module ties them into one sandbox's lifecycle.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time
import weakref
from pathlib import Path, PurePosixPath

from jointrl.envs.base import EnvError
from jointrl.envs.sandbox.base import ExecResult, SandboxConfig
from jointrl.envs.sandbox.bwrap_argv import (
    DEFAULT_ENV,
    bwrap_argv,
    check_dest,
    check_world_readable,
    prlimit_argv,
    ulimit_prefix,
)
from jointrl.envs.sandbox.bwrap_proc import KILL_GRACE_S, SPAWNER, parse_status, pump, spawn
from jointrl.envs.sandbox.cgroups import Cgroup
from jointrl.envs.sandbox.disk import mount_tmpfs
from jointrl.envs.sandbox.files import copy_tree, read_regular, resolve_inside, write_regular
from jointrl.envs.sandbox.host_dirs import (
    SANDBOX_ROOT,
    make_owned_dir,
    remove_private_dir,
    remove_stale_dirs,
    sandbox_root,
    stage,
)
from jointrl.envs.sandbox.output import Capped
from jointrl.envs.sandbox.shell import TIMEOUT_EXIT_CODE, PersistentShell
from jointrl.envs.sandbox.uids import UidLease, acquire_uid, children_of, kill_uid

__all__ = ["SANDBOX_ROOT", "TIMEOUT_EXIT_CODE", "BwrapSandbox", "sandbox_root"]


class BwrapSandbox:
    """One episode's sandbox: a private ``/work`` on the host, run under a leased host uid.

    ``workdir_from``: a host directory whose contents are copied into ``/work`` (task setup;
    ``populate`` does the same later, for a sandbox taken from a warm pool).
    ``ro_binds``: host path -> absolute sandbox path, mounted read-only; merged over
    ``config.ro_binds``. Each source is *copied* into the sandbox's private dir first (so it
    is readable by the leased uid wherever it lives on the host): keep them small. Large
    read-only trees that are world-readable (a domain's tool venv) go in ``config.tool_mounts``:
    bound directly, never copied.
    ``rw_dirs``: absolute sandbox paths that get fresh, empty, writable directories (e.g. a
    verifier's ``/logs/verifier``); ``read_file`` reads inside them by absolute path.
    ``env``: extra environment variables over the default ``PATH``, ``HOME=/work``, ``LANG``.
    ``shell``: start the persistent shell now (it doubles as the start probe); else it starts
    on the first ``run`` and the first ``exec`` is the probe.

    The constructor raises ``EnvError`` if the sandbox cannot start. ``exec``, ``run``,
    ``read_file``, ``write_file`` and ``close`` are thread-safe (serialized).
    """

    def __init__(
        self,
        config: SandboxConfig | None = None,
        workdir_from: Path | None = None,
        ro_binds: dict[str, str] | None = None,
        *,
        rw_dirs: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        shell: bool = True,
    ) -> None:
        self.config = c = config or SandboxConfig()
        if os.geteuid() != 0:
            raise EnvError("BwrapSandbox needs root on the host to run each episode under its own uid")
        binds = {**c.ro_binds, **(ro_binds or {})}
        for dest in [*binds.values(), *c.tool_mounts.values(), *rw_dirs]:
            check_dest(dest)
        for src in binds:
            if not Path(src).exists():
                raise ValueError(f"ro_binds source {src!r} does not exist")
        for src in c.tool_mounts:
            check_world_readable(src)
        if workdir_from is not None and not Path(workdir_from).is_dir():
            raise ValueError(f"workdir_from {str(workdir_from)!r} is not a directory")
        self.env = {**DEFAULT_ENV, **(env or {})}
        self._lock = threading.Lock()
        self._closed = False
        root = sandbox_root()
        self._lease: UidLease = acquire_uid(c.uid_range, root / ".locks")
        self.uid = self._lease.uid
        if not self._lease.inherited_clean:
            remove_stale_dirs(root, self.uid)
        self.private_dir = root / f"sb-{secrets.token_hex(8)}"
        self.workdir = self.private_dir / "work"
        self.cgroup: Cgroup | None = None
        self._shell = PersistentShell(self._spawn_shell, self._kill_others, self._kill_all, c.max_output_bytes)
        self._shell_pids: frozenset[int] = frozenset()
        self._finalizer = weakref.finalize(self, _cleanup, self._lease, self.private_dir, self._shell, None)
        try:
            make_owned_dir(self.private_dir, self.uid)
            make_owned_dir(self.workdir, self.uid)
            self.limits: dict[str, str] = {}  # which bound holds, for each resource (reported by the bench)
            why = mount_tmpfs(self.workdir, c.max_disk_bytes, self.uid) if c.max_disk_bytes else "max_disk_bytes=0"
            self.limits["disk"] = f"tmpfs {c.max_disk_bytes} B" if why is None else f"RLIMIT_FSIZE per file ({why})"
            if c.use_cgroup:
                self.cgroup = Cgroup.create(self.uid, c.max_memory_bytes, c.max_processes)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _cleanup, self._lease, self.private_dir, self._shell, self.cgroup)
            self.limits["memory"] = f"cgroup {self.cgroup.version}" if self.cgroup else "RLIMIT_AS per process"
            if workdir_from is not None:
                copy_tree(Path(workdir_from), self.workdir, owner=self.uid, into=True)
            self._mounts: list[tuple[str, Path, bool]] = []  # (sandbox path, host path, writable)
            for i, (src, dest) in enumerate(binds.items()):
                staged = self.private_dir / f"ro-{i}"
                stage(Path(src), staged, owner=self.uid)
                self._mounts.append((dest, staged, False))
            for src, dest in c.tool_mounts.items():
                self._mounts.append((dest, Path(src), False))
            self.rw_dirs: dict[str, Path] = {}
            for i, dest in enumerate(rw_dirs):
                host = self.private_dir / f"rw-{i}"
                make_owned_dir(host, self.uid)
                self._mounts.append((dest, host, True))
                self.rw_dirs[str(PurePosixPath(dest))] = host
            if shell:
                self._shell.start()
        except OSError as e:
            self.close()
            raise EnvError(f"cannot start a bwrap sandbox: {e}") from e
        except BaseException:
            self.close()
            raise

    # -- commands ---------------------------------------------------------------------------

    def exec(self, cmd: str, timeout: float | None = None) -> ExecResult:
        """Run ``cmd`` with ``bash -c`` in ``/work``, one-shot; ``timeout`` defaults to ``config.timeout_s``.

        The command's own failures (non-zero exit, timeout, signals) are results; ``EnvError``
        means the sandbox itself failed (bwrap could not start, or died without reporting).
        """
        timeout = self._check_cmd(cmd, timeout)
        with self._lock:
            self._check_open()
            return self._run_once(cmd, timeout)

    def run(self, cmd: str, timeout: float | None = None) -> ExecResult:
        """Run ``cmd`` in the episode's persistent shell (``shell.py`` for its semantics)."""
        timeout = self._check_cmd(cmd, timeout)
        with self._lock:
            self._check_open()
            try:
                return self._shell.run(cmd, timeout)
            except OSError as e:
                raise EnvError(f"the sandbox shell failed: {e}") from e

    @property
    def shell_pids(self) -> frozenset[int]:
        """Host pids of the idle persistent shell (bwrap, its init, bash); empty when none runs."""
        if not self._shell.alive:
            return frozenset()
        if len(self._shell_pids) == 2:  # bash itself, learnt once it runs (init's only child then)
            self._shell_pids |= frozenset(children_of(self._shell_init, self.uid)[:1])
        return self._shell_pids

    def _check_cmd(self, cmd: str, timeout: float | None) -> float:
        if not isinstance(cmd, str):
            raise TypeError(f"cmd must be a str, got {type(cmd).__name__}")
        if "\0" in cmd:
            raise ValueError("cmd contains a NUL byte")
        timeout = self.config.timeout_s if timeout is None else timeout
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        return timeout

    def _spawn(self, argv_cmd: list[str], *, stdin: int, fds: tuple[int, ...] = (),
               limits_set: bool = False) -> tuple[subprocess.Popen, int, bytes, int]:
        """Start bwrap running ``argv_cmd``, inside the cgroup before it runs anything (``bwrap_proc.spawn``).

        ``limits_set``: ``argv_cmd`` is a bash of ours that sets the rlimits itself, first thing
        (``ulimit_prefix``); any other command runs under ``prlimit``.
        Returns (process, read end of the json status pipe, what was read of it, child pid).
        """
        prefix = [] if limits_set else prlimit_argv(self.config, memory_cgroup=self.cgroup is not None)

        def argv(status_fd: int, block_fd: int) -> list[str]:
            return prefix + bwrap_argv(self.config, self.workdir, self._mounts, self.env, argv_cmd,
                                       status_fd=status_fd, block_fd=block_fd)

        return spawn(argv, uid=self.uid, cgroup=self.cgroup, stdin=stdin, fds=fds)

    def start_process(self, argv_cmd: list[str], *, stdin: int = subprocess.PIPE,
                      fds: tuple[int, ...] = ()) -> tuple[subprocess.Popen, int]:
        """Start a long-lived process in this sandbox (a domain's page driver or warm interpreter)
        under the sandbox's limits and cgroup, from the spawner thread so that it lives as long as
        the sandbox, not the calling thread. ``fds`` stay open in it. Returns (process, read end of
        bwrap's status pipe: keep it open while the process runs, close it after)."""
        proc, status_r, _, _ = SPAWNER.submit(self._spawn, argv_cmd, stdin=stdin, fds=fds).result()
        return proc, status_r

    def _spawn_shell(self) -> tuple[subprocess.Popen, int, int, tuple[int, ...]]:
        return SPAWNER.submit(self._spawn_shell_here).result()

    def _spawn_shell_here(self) -> tuple[subprocess.Popen, int, int, tuple[int, ...]]:
        ctl_r, ctl_w = os.pipe()
        try:
            proc, status_r, _, init = self._spawn(["/bin/bash", "--noprofile", "--norc"], stdin=subprocess.PIPE,
                                                  fds=(ctl_w,), limits_set=True)
        except BaseException:
            os.close(ctl_r)
            raise
        finally:
            os.close(ctl_w)
        proc.stdin.write(f"{self._ulimit()}\n".encode())  # the shell runs it before anything sent later
        self._shell_init = init
        self._shell_pids = frozenset({proc.pid, init})
        # status_r stays open (bwrap writes the exit code there; a closed pipe would SIGPIPE it).
        return proc, ctl_r, ctl_w, (status_r,)

    def _kill_others(self) -> None:
        """Kill every process of the sandbox but the idle shell: the leftovers of a command."""
        keep = self.shell_pids
        if self.cgroup is not None:  # fast path: the cgroup lists exactly the sandbox's processes
            try:
                self.cgroup.kill_all(keep, timeout_s=0.1)
                return
            except OSError:
                pass  # a fork storm outran the sweep: the uid sweep below gets the rest
        kill_uid(self.uid, keep=keep)

    def _kill_all(self) -> None:
        self._shell_pids = frozenset()
        kill_uid(self.uid)

    def _run_once(self, cmd: str, timeout: float) -> ExecResult:
        try:
            # Same line as the command: its line numbers in bash's messages stay as written.
            proc, status_r, first, _ = self._spawn(["/bin/bash", "-c", f"{self._ulimit()}; {cmd}"],
                                                   stdin=subprocess.DEVNULL, limits_set=True)
        except OSError as e:
            raise EnvError(f"cannot start bwrap: {e}") from e
        cap = self.config.max_output_bytes
        out, err, status = Capped(cap), Capped(cap), Capped(1 << 16)
        status.add(first)
        streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, status_r: status}
        timed_out = False
        try:
            timed_out = pump(proc, streams, status, time.monotonic() + timeout, self._kill_others)
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        finally:
            proc.stdout.close()
            proc.stderr.close()
            os.close(status_r)
            # The pid namespace dies with the command, but its last members may still be exiting
            # when bwrap reports: sweep the uid so that nothing of this exec outlives it.
            self._kill_others()
        reports = parse_status(bytes(status.data))
        truncated = bool(out.dropped or err.dropped)
        if timed_out:
            return ExecResult(out.text(), err.text(), TIMEOUT_EXIT_CODE, True, truncated)
        if "exit-code" not in reports:  # bwrap reports it whenever the command itself ran to its end
            raise EnvError(f"bwrap failed (exit {proc.returncode}) before the command finished: {err.text()[-2000:]!r}")
        return ExecResult(out.text(), err.text(), int(reports["exit-code"]), False, truncated)

    def _ulimit(self) -> str:
        return ulimit_prefix(self.config, memory_cgroup=self.cgroup is not None)

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

    def populate(self, src: Path) -> None:
        """Copy the host directory ``src`` into ``/work`` (a warm sandbox receiving its task's files)."""
        if not Path(src).is_dir():
            raise ValueError(f"populate source {str(src)!r} is not a directory")
        with self._lock:
            self._check_open()
            copy_tree(Path(src), self.workdir, owner=self.uid, into=True)

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


def _cleanup(lease: UidLease, private_dir: Path, shell: PersistentShell, cgroup: Cgroup | None) -> None:
    """Runs once, from ``close`` or when the sandbox is garbage-collected without it."""
    if not lease.held:
        return
    clean = False
    try:
        if cgroup is not None:  # every process of the sandbox is in it (moved before it ran anything)
            cgroup.kill_all()
        else:
            kill_uid(lease.uid)
        shell.stop()
        if cgroup is not None:
            cgroup.remove()
        remove_private_dir(private_dir)
        clean = not private_dir.exists()
    finally:
        lease.release(clean=clean)  # only once nothing of the uid is left for the next holder to inherit
