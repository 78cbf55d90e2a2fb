"""The bubblewrap sandbox backend: one private work dir, one host uid (root mode), one cgroup per episode.

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
  No capabilities (``--cap-drop ALL``), no nested user namespaces (``--disable-userns``; the one
  exception is ``SandboxConfig.nested_userns``, the CAD reward builder's server: ``envs/cad/builder.py``).
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

Root mode (``SandboxConfig.mode="root"``, or ``auto`` as root) is all of the above; it needs root
on the host (to switch to the leased uid, with util-linux's ``setpriv``) and ``bwrap`` with
unprivileged user namespaces.

**Rootless mode** (``mode="rootless"``, or ``auto`` as an ordinary user, e.g. a Slurm job on a
shared node; ``rootless.py``): bwrap runs as the job's own uid, every episode still in its own
user, pid, mount, network, IPC and UTS namespaces. What holds, as in root mode: no network;
writes only to ``/work``, ``/tmp`` and the ``rw_dirs`` (the system read-only, the host's other
dirs not mounted); no capabilities, no nested user namespaces; ``kill -9 -1`` reaches only the
episode's own pid namespace; no process outlives its command or its episode (each bwrap's pid 1
is held by a pidfd and killing it ends its pid namespace: never a sweep by uid, which would hit
the job's Ray workers); ``/work`` and ``/tmp`` are size-bounded tmpfs (``/work`` mounted in a
keeper's namespace, ``rootless.Keeper``); output capped; wall-clock timeouts. Memory and pids:
a cgroup per sandbox under a subtree delegated to the job (a Slurm job cgroup or a systemd
user slice: ``cgroups.probe``, v1 or v2), else RLIMIT_AS per process and RLIMIT_NPROC, which
since Linux 5.14 counts per (user namespace, uid), i.e. only the episode's own processes
(before 5.14 it would count the job's too and is left unset: no process bound then).
**Differences from root mode**: every episode runs as the job's uid, so the uid is no second
wall: a process that escaped its namespaces (a kernel bug) could read other episodes' files and
signal the job's processes, where in root mode it would be a uid of its own; without a
delegated cgroup, memory is bounded per process only (several processes may each take
``max_memory_bytes``), and ``start_process`` commands (not a bash of ours) get no RLIMIT_NPROC;
CPU time is RLIMIT_CPU per process in both modes. ``rootfs`` (either mode) takes ``/usr``,
``/etc`` and ``/bin``, ``/lib*`` from a directory instead of the host, e.g. a Debian tree
built by ``.ci/setup.d/rootfs.sh`` (``mmdebstrap``) on a node without the domains' tools.

The parts: ``bwrap_argv.py`` (the sandbox's view and limits), ``bwrap_proc.py``
(starting bwrap blocked, moving it into the cgroup, reading a command to its end),
``host_dirs.py`` (the private dirs), ``uids.py``, ``cgroups.py``, ``disk.py``, ``files.py``,
``shell.py``, ``rootless.py``; this module ties them into one sandbox's lifecycle.
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
    check_rootfs,
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
from jointrl.envs.sandbox.rootless import Keeper, NsInit, children, kill_ns_members, resolve_mode, userns_nproc
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
        self.rootless = resolve_mode(c.mode)
        if not self.rootless and os.geteuid() != 0:
            raise EnvError("envs.sandbox.mode=root needs root on the host (each episode runs under its own uid); "
                           "set envs.sandbox.mode=rootless (or auto)")
        if c.rootfs is not None:
            check_rootfs(c.rootfs)
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
        token = secrets.token_hex(8)
        self.private_dir = root / f"sb-{token}"
        self.workdir = self._host_work = self.private_dir / "work"  # rootless + tmpfs: the keeper's view of it
        self.cgroup: Cgroup | None = None
        self._shell = PersistentShell(self._spawn_shell, self._kill_others, self._kill_all, c.max_output_bytes)
        self._shell_pids: frozenset[int] = frozenset()
        self._shell_init = 0
        self._held = held = _Held(self.private_dir, self._shell)
        if self.rootless:  # the job's own uid; everything below is ours (no chown)
            self.uid, self._owner, self._nproc = os.getuid(), None, userns_nproc()
        else:
            held.lease = acquire_uid(c.uid_range, root / ".locks")
            self.uid = self._owner = held.lease.uid
            self._nproc = True
            if not held.lease.inherited_clean:
                remove_stale_dirs(root, self.uid)
        self._finalizer = weakref.finalize(self, _cleanup, held)
        try:
            make_owned_dir(self.private_dir, self._owner)
            make_owned_dir(self._host_work, self._owner)
            self.limits: dict[str, str] = {}  # which bound holds, for each resource (reported by the bench)
            if not c.max_disk_bytes:
                why = "max_disk_bytes=0"
            elif self.rootless:
                held.keeper = Keeper(self._host_work, c.max_disk_bytes)
                self.workdir, why = held.keeper.view(self._host_work), None
            else:
                why = mount_tmpfs(self.workdir, c.max_disk_bytes, self.uid)
            self.limits["disk"] = f"tmpfs {c.max_disk_bytes} B" if why is None else f"RLIMIT_FSIZE per file ({why})"
            if c.use_cgroup:
                held.cgroup = self.cgroup = Cgroup.create(f"jointrl-sb-{token}" if self.rootless else self.uid,
                                                          c.max_memory_bytes, c.max_processes)
            self.limits["memory"] = f"cgroup {self.cgroup.version}" if self.cgroup else "RLIMIT_AS per process"
            self.limits["processes"] = (f"pids cgroup {self.cgroup.version}" if self.cgroup else
                                        "RLIMIT_NPROC" if self._nproc else "none (RLIMIT_NPROC would count the job's)")
            if workdir_from is not None:
                copy_tree(Path(workdir_from), self.workdir, owner=self._owner, into=True)
            self._mounts: list[tuple[str, Path, bool]] = []  # (sandbox path, host path, writable)
            for i, (src, dest) in enumerate(binds.items()):
                staged = self.private_dir / f"ro-{i}"
                stage(Path(src), staged, owner=self._owner)
                self._mounts.append((dest, staged, False))
            for src, dest in c.tool_mounts.items():
                self._mounts.append((dest, Path(src), False))
            self.rw_dirs: dict[str, Path] = {}
            for i, dest in enumerate(rw_dirs):
                host = self.private_dir / f"rw-{i}"
                make_owned_dir(host, self._owner)
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
            kids = children(self._shell_init) if self.rootless else children_of(self._shell_init, self.uid)
            self._shell_pids |= frozenset(kids[:1])
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
        prefix = [] if limits_set else prlimit_argv(self.config, memory_cgroup=self.cgroup is not None,
                                                    nproc=not self.rootless)
        keeper = self._held.keeper
        if keeper is not None:  # rootless: bwrap starts inside the keeper's namespace, where /work is its tmpfs
            prefix = prefix + keeper.enter_argv()
        ids = (os.getuid(), os.getgid()) if keeper is not None else None  # we are root of the keeper's namespace

        def argv(status_fd: int, block_fd: int) -> list[str]:
            return prefix + bwrap_argv(self.config, self._host_work, self._mounts, self.env, argv_cmd,
                                       status_fd=status_fd, block_fd=block_fd, ids=ids)

        return spawn(argv, uid=None if self.rootless else self.uid, cgroup=self.cgroup, stdin=stdin, fds=fds,
                     on_child=self._held.track if self.rootless else None)

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
        if self.rootless:  # never by uid: that is the job's own; the shell's pid namespace holds the rest
            init = self._held.inits.get(self._shell_init)
            if init is not None:
                kill_ns_members(init, keep)
            return
        kill_uid(self.uid, keep=keep)

    def kill_processes(self) -> None:
        """SIGKILL every process of the sandbox (root: of its uid; rootless: of every pid namespace it
        started, never by uid, which is the job's own). The sandbox stays open: the next command starts anew."""
        if not self.rootless:
            kill_uid(self.uid)
            return
        with self._held._lock:
            inits, self._held.inits = list(self._held.inits.values()), {}
        for init in inits:
            init.kill()

    def _kill_all(self) -> None:
        self._shell_pids = frozenset()
        if self.rootless:
            self._held.end(self._shell_init)
        else:
            kill_uid(self.uid)

    def _run_once(self, cmd: str, timeout: float) -> ExecResult:
        try:
            # Same line as the command: its line numbers in bash's messages stay as written.
            proc, status_r, first, init = self._spawn(["/bin/bash", "-c", f"{self._ulimit()}; {cmd}"],
                                                      stdin=subprocess.DEVNULL, limits_set=True)
        except OSError as e:
            raise EnvError(f"cannot start bwrap: {e}") from e
        # Rootless, the command's pid namespace is all of it: ending its init ends everything it started.
        end = (lambda: self._held.end(init)) if self.rootless else self._kill_others
        cap = self.config.max_output_bytes
        out, err, status = Capped(cap), Capped(cap), Capped(1 << 16)
        status.add(first)
        streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, status_r: status}
        timed_out = False
        try:
            timed_out = pump(proc, streams, status, time.monotonic() + timeout, end)
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
            # when bwrap reports: sweep the uid (rootless: end the namespace) so that nothing of this exec outlives it.
            end()
        reports = parse_status(bytes(status.data))
        truncated = bool(out.dropped or err.dropped)
        if timed_out:
            return ExecResult(out.text(), err.text(), TIMEOUT_EXIT_CODE, True, truncated)
        if "exit-code" not in reports:  # bwrap reports it whenever the command itself ran to its end
            raise EnvError(f"bwrap failed (exit {proc.returncode}) before the command finished: {err.text()[-2000:]!r}")
        return ExecResult(out.text(), err.text(), int(reports["exit-code"]), False, truncated)

    def _ulimit(self) -> str:
        return ulimit_prefix(self.config, memory_cgroup=self.cgroup is not None, nproc=self._nproc)

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
            write_regular(host, data, root=root, owner=self._owner)

    def populate(self, src: Path) -> None:
        """Copy the host directory ``src`` into ``/work`` (a warm sandbox receiving its task's files)."""
        if not Path(src).is_dir():
            raise ValueError(f"populate source {str(src)!r} is not a directory")
        with self._lock:
            self._check_open()
            copy_tree(Path(src), self.workdir, owner=self._owner, into=True)

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
        """Kill every process of the sandbox (root: of its uid; rootless: its pid namespaces), delete
        the private dir, free the uid or end the keeper. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._finalizer()

    def __enter__(self) -> BwrapSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Held:
    """What one sandbox holds on the host, released once by ``_cleanup`` (``close`` or garbage collection)."""

    def __init__(self, private_dir: Path, shell: PersistentShell) -> None:
        self.private_dir, self.shell = private_dir, shell
        self.lease: UidLease | None = None  # root mode
        self.cgroup: Cgroup | None = None
        self.keeper: Keeper | None = None  # rootless with a disk bound
        self.inits: dict[int, NsInit] = {}  # rootless: the pid 1 of every live bwrap of the sandbox, by pid
        self._lock = threading.Lock()

    def track(self, pid: int) -> None:
        """Hold a new bwrap's pid 1 (called while it is blocked: ``bwrap_proc.spawn``); forget the dead."""
        with self._lock:
            for dead in [p for p, init in self.inits.items() if not init.alive]:
                self.inits.pop(dead).kill()
            self.inits[pid] = NsInit(pid)

    def end(self, pid: int) -> None:
        """End the pid namespace whose init is ``pid`` (no-op for one already ended)."""
        with self._lock:
            init = self.inits.pop(pid, None)
        if init is not None:
            init.kill()


def _cleanup(held: _Held) -> None:
    """Runs once, from ``close`` or when the sandbox is garbage-collected without it."""
    if held.lease is None:
        _cleanup_rootless(held)
        return
    lease, cgroup = held.lease, held.cgroup
    if not lease.held:
        return
    clean = False
    try:
        if cgroup is not None:  # every process of the sandbox is in it (moved before it ran anything)
            cgroup.kill_all()
        else:
            kill_uid(lease.uid)
        held.shell.stop()
        if cgroup is not None:
            cgroup.remove()
        remove_private_dir(held.private_dir)
        clean = not held.private_dir.exists()
    finally:
        lease.release(clean=clean)  # only once nothing of the uid is left for the next holder to inherit


def _cleanup_rootless(held: _Held) -> None:
    """End every pid namespace of the sandbox, then its keeper (and tmpfs), cgroup and private dir."""
    try:
        with held._lock:
            inits, held.inits = list(held.inits.values()), {}
        for init in inits:
            init.kill()
        if held.cgroup is not None:
            held.cgroup.kill_all()
        held.shell.stop()
    finally:
        if held.keeper is not None:
            held.keeper.close()
        if held.cgroup is not None:
            held.cgroup.remove()
        remove_private_dir(held.private_dir)
