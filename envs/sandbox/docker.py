"""The docker sandbox backend: one container per episode, over the Docker Python SDK.

For tasks that bring their own image (a Harbor ``environment/Dockerfile``, a Terminal-Bench 1
``Dockerfile``, ``[environment] docker_image``) and hosts where a daemon is reachable. Same
contract as ``BwrapSandbox`` (``exec``, ``run``, ``read_file``, ``write_file``, ``populate``,
``copy_workdir_to``, ``close``; tests/envs/sandbox/test_contract.py) and the same limits from
``SandboxConfig``. Harbor's semantics: commands run as the image's ``USER`` (root when it names
none) in its ``WORKDIR`` (``/work`` when it names none), over a *writable* image filesystem,
so ``apt-get install`` in a command or a ``tests/test.sh`` works as in Harbor.

What it protects against:

- **Network**: ``network_mode="none"`` (only loopback), unless the caller asks for a network
  (a task marked ``allow_internet`` on a host that permits it: ``envs.sandbox.verifier_network``).
- **The host and other episodes**: a container per episode, from the image: nothing an
  episode writes (in its WORKDIR, ``/usr``, anywhere) is seen by another container. Reduced
  capabilities (``cap_drop=ALL`` plus the few a root package install needs: chown, dac_override,
  fowner, fsetid, kill, setuid, setgid, net_bind_service, sys_chroot), ``no-new-privileges``.
- **Disk**: the WORKDIR is a tmpfs volume of ``max_disk_bytes`` (``storage_mb`` of a task),
  filled at start with the image's own WORKDIR content; ``/tmp`` a tmpfs of the same size,
  exec allowed as on bwrap (``ENOSPC`` past them). Writes elsewhere go to the container's writable layer, bounded per
  file by RLIMIT_FSIZE only (a size quota there needs overlay2 on xfs with pquota).
- **Memory, processes, CPU**: the container's memory cgroup (``mem_limit`` =
  ``memswap_limit``), pids cgroup (``pids_limit``), ``nano_cpus`` for a task's ``cpus``;
  RLIMIT FSIZE / CPU per process (not NPROC: it is per host uid, shared by every container).
- **Runaway commands**: each command runs under ``timeout -s KILL`` and then, in the same exec,
  the user's own ``kill -9 -1`` (it reaches only this container's pid namespace); where that
  wrapper did not finish (killed, timed out) a watchdog and a sweep
  (``kill -9 -1`` as root inside the container: everything but pid 1, an
  idle bash that reaps them; from the host when a fork bomb leaves no pid to start the sweep
  with) end the command's children, so no background process outlives its command.
  Output is capped at ``max_output_bytes`` per stream as it streams in.

What it does not protect against: kernel or runtime exploits (a container shares the host
kernel); without ``dockerd --userns-remap`` the container's root is the host's uid 0 (with the
reduced capabilities above); a verifier that runs agent code as root can change anything in
*its* container (the tests were copied in after the agent, but code they import runs with them).

Files: ``write_file`` / ``populate`` / ``ro_binds`` go in through the daemon's archive API
(``put_archive``), which sees the WORKDIR volume and the writable layer (not tmpfs mounts:
``rw_dirs`` and ``ro_binds`` are plain directories of the writable layer). Paths resolve *inside*
the container; a link out of the WORKDIR is refused. The persistent shell is *emulated*: each
``run`` is a fresh ``bash`` that first restores the cwd and exported variables the previous one
saved (``/.jointrl-shell``); shell-only variables and functions do not persist.
"""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import shutil
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from jointrl.envs.base import EnvError
from jointrl.envs.sandbox.base import ExecResult, SandboxConfig
from jointrl.envs.sandbox.kill import sigkill
from jointrl.envs.sandbox.output import Capped

IMAGES_DIR = Path(__file__).resolve().parent.parent / "images"
TIMEOUT_EXIT_CODE = 124
DEFAULT_WORKDIR = "/work"  # an image without WORKDIR
_STATE = "/.jointrl-shell"  # the emulated shell's state: outside /tmp, so a full /tmp cannot break the shell
_SELF_SWEEP = 'timeout -s KILL "$@"; rc=$?; kill -9 -1 2>/dev/null; exit $rc'
_CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETUID", "SETGID", "NET_BIND_SERVICE", "SYS_CHROOT"]
_PID1 = ["bash", "-c", "mkfifo /tmp/.jointrl-idle; exec 3<>/tmp/.jointrl-idle; while :; do read -r -u 3; done"]
# pid 1: an idle bash that blocks in a builtin (no child to show in ps) and reaps the orphans the
# sweep kills (a non-reaping pid 1 would keep them as zombies); the kernel ignores SIGKILL to it.


def _shell_wrapper(workdir: str) -> str:
    return (f'__s={_STATE}; [ -f $__s/env ] && . $__s/env; cd "$(cat $__s/cwd 2>/dev/null || echo {workdir})" '
            f'2>/dev/null || cd {workdir}; '
            '__c=$JOINTRL_CMD; unset JOINTRL_CMD; eval "$__c"; __rc=$?; '
            'mkdir -p $__s && export -p > $__s/env && pwd > $__s/cwd; exit $__rc')


@dataclass(frozen=True, slots=True)
class Resources:
    """A task's declared resources (Harbor ``[environment]``): each overrides the config's bound."""

    cpus: float | None = None
    memory_bytes: int | None = None
    disk_bytes: int | None = None


def unavailable_reason() -> str | None:
    """Why the docker backend cannot run here (no SDK, no daemon), or None if it can."""
    try:
        import docker
    except ImportError as e:
        return f"the docker Python SDK is not installed ({e})"
    try:
        docker.from_env(timeout=5).ping()
    except Exception as e:  # noqa: BLE001  (any failure means: no usable daemon)
        host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        return f"no Docker daemon reachable at {host} ({type(e).__name__}: {str(e)[:200]})"
    return None


_HOST = os.uname().nodename
_SWEPT = threading.Event()


def client(timeout: float = 120):
    reason = unavailable_reason()
    if reason is not None:
        raise EnvError(f"docker sandbox unavailable: {reason}")
    import docker

    cli = docker.from_env(timeout=timeout)
    if not _SWEPT.is_set():
        _SWEPT.set()
        remove_stale(cli)
    return cli


def remove_stale(cli) -> int:
    """Remove the sandbox containers and volumes that a dead process of this host left (a killed
    env worker); the first ``client()`` of each process calls it. Returns how many containers."""
    def dead(labels: dict) -> bool:
        if labels.get("jointrl.host") != _HOST or not labels.get("jointrl.pid", "").isdigit():
            return False
        try:
            os.kill(int(labels["jointrl.pid"]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    n = 0
    for c in cli.containers.list(all=True, filters={"label": "jointrl=sandbox"}):
        if dead(c.labels):
            c.remove(force=True)
            n += 1
    for v in cli.volumes.list(filters={"label": "jointrl=work"}):
        if dead(v.attrs.get("Labels") or {}):
            try:
                v.remove(force=True)
            except Exception:  # noqa: BLE001  (still in use by a container being removed)
                pass
    return n


class ImageBuildError(EnvError):
    """``docker build`` of a task's image failed: that task cannot run (the message says why)."""


_BUILD_LOCKS: dict[str, threading.Lock] = {}
_BUILD_FAILED: dict[str, str] = {}
_LOCKS_LOCK = threading.Lock()


def context_hash(context: Path, dockerfile: str = "Dockerfile") -> str:
    """sha256 over every file's relative path, mode and bytes under ``context`` (links by target)."""
    h = hashlib.sha256(dockerfile.encode() + b"\0")
    for p in sorted(context.rglob("*")):
        rel = p.relative_to(context).as_posix()
        if p.is_symlink():
            h.update(b"L" + rel.encode() + b"\0" + os.readlink(p).encode() + b"\0")
        elif p.is_file():
            h.update(b"F" + rel.encode() + b"\0" + oct(p.stat().st_mode & 0o777).encode() + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def ensure_image(cli, dockerfile: Path, *, whole_context: bool = True, build_timeout_s: float = 600.0) -> str:
    """Build ``dockerfile`` (context: its folder) once per content; returns the tag.

    The tag is a hash of the whole build context (``whole_context``: a task's ``environment/``)
    or of the Dockerfile alone (the shared ``envs/images`` folder). Concurrent callers in one
    process build once; a failed build raises ``ImageBuildError`` naming the Dockerfile and
    the build's last lines, and is not retried in this process.
    """
    dockerfile = Path(dockerfile).resolve()
    if not dockerfile.is_file():
        raise ValueError(f"dockerfile {str(dockerfile)!r} does not exist")
    digest = (context_hash(dockerfile.parent, dockerfile.name) if whole_context
              else hashlib.sha256(dockerfile.read_bytes()).hexdigest()[:16])
    name = (dockerfile.parent.parent.name if dockerfile.name == "Dockerfile" else dockerfile.stem).lower()
    tag = f"jointrl-{''.join(c if c.isalnum() or c in '-_.' else '-' for c in name)[:60]}:{digest}"
    with _LOCKS_LOCK:
        lock = _BUILD_LOCKS.setdefault(tag, threading.Lock())
    with lock:
        if tag in _BUILD_FAILED:
            raise ImageBuildError(_BUILD_FAILED[tag])
        try:
            cli.images.get(tag)
            return tag
        except Exception:  # noqa: BLE001  (docker.errors.ImageNotFound: build it)
            pass
        import docker

        try:
            docker.from_env(timeout=build_timeout_s).images.build(
                path=str(dockerfile.parent), dockerfile=dockerfile.name, tag=tag, rm=True, forcerm=True)
        except Exception as e:  # noqa: BLE001  (BuildError, APIError, a timeout)
            lines = [str(x.get("stream", x.get("error", ""))).strip() for x in getattr(e, "build_log", [])]
            tail = " | ".join(x for x in lines if x)[-400:] or str(e)[:400]
            _BUILD_FAILED[tag] = f"docker build of {str(dockerfile)!r} failed: {type(e).__name__}: {tail}"
            raise ImageBuildError(_BUILD_FAILED[tag]) from e
    return tag


def domain_image(domain: str) -> Path:
    path = IMAGES_DIR / f"{domain}.Dockerfile"
    if not path.is_file():
        available = sorted(p.stem for p in IMAGES_DIR.glob("*.Dockerfile"))
        raise ValueError(f"no image for domain {domain!r}; available: {available}")
    return path


_WORKDIR_TARS: dict[str, bytes] = {}


def _image_workdir_tar(cli, image_id: str, workdir: str) -> bytes:
    """The image's own ``workdir`` content as a tar (members ``<name>/...``), cached per image."""
    key = f"{image_id}:{workdir}"
    if key not in _WORKDIR_TARS:
        c = cli.containers.create(image_id, _PID1, entrypoint=[], network_mode="none")
        try:
            bits, _ = c.get_archive(workdir)
            data = b"".join(bits)
        except Exception:  # noqa: BLE001  (docker.errors.NotFound: the image has no such dir yet)
            data = b""
        finally:
            c.remove(force=True)
        _WORKDIR_TARS[key] = data
    return _WORKDIR_TARS[key]


class DockerSandbox:
    """One episode's container: ``image`` by name, or built from ``dockerfile`` (a task's own;
    its folder is the build context), else from ``envs/images/<domain>.Dockerfile``.

    ``network``: the container gets the daemon's default bridge network instead of none.
    ``resources``: a task's declared cpus / memory / disk, over ``config``'s bounds.
    ``seed_workdir``: fill the WORKDIR with the image's own content first (not for a verifier,
    whose ``workdir_from`` is the episode's final WORKDIR: what the agent deleted stays deleted).
    ``shell`` is accepted for the common constructor signature (the emulated shell needs no process).
    The constructor raises ``EnvError`` (``ImageBuildError`` for a failed build) if it cannot start.
    """

    def __init__(self, config: SandboxConfig | None = None, workdir_from: Path | None = None,
                 ro_binds: dict[str, str] | None = None, *, rw_dirs: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, shell: bool = True, domain: str = "terminal",
                 dockerfile: Path | None = None, image: str | None = None, network: bool = False,
                 resources: Resources | None = None, build_timeout_s: float = 600.0, seed_workdir: bool = True) -> None:
        import docker.types

        self.config = c = config or SandboxConfig()
        res = resources or Resources()
        binds = {**c.ro_binds, **(ro_binds or {})}
        for src in binds:
            if not Path(src).exists():
                raise ValueError(f"ro_binds source {src!r} does not exist")
        if workdir_from is not None and not Path(workdir_from).is_dir():
            raise ValueError(f"workdir_from {str(workdir_from)!r} is not a directory")
        self.cli = client()
        if image is None:  # a prebuilt image by name (Harbor's [environment] docker_image) is used as is
            if dockerfile is not None:
                image = ensure_image(self.cli, Path(dockerfile), build_timeout_s=build_timeout_s)
            else:
                image = ensure_image(self.cli, domain_image(domain), whole_context=False)
        try:
            info = self.cli.images.get(image).attrs
        except Exception as e:  # noqa: BLE001  (not found: there is no registry to pull from)
            raise EnvError(f"docker image {image!r} is not on this host ({type(e).__name__}); "
                           "build it or import it (no registry is pulled from)") from e
        cfg = info.get("Config") or {}
        self.image, self.user, self.network, self._seed = image, cfg.get("User") or "root", network, seed_workdir
        self.workdir = Path(cfg.get("WorkingDir") or DEFAULT_WORKDIR)  # inside the container; no host directory
        self.rw_dirs = tuple(str(PurePosixPath(d)) for d in rw_dirs)
        self.env = {"LANG": "C.UTF-8", "TERM": "dumb", **(env or {})}
        self._lock = threading.Lock()
        self._closed = False
        self.container = self.volume = None
        disk = res.disk_bytes or c.max_disk_bytes or (1 << 30)
        memory = res.memory_bytes or c.max_memory_bytes
        # No RLIMIT_NPROC: it counts every process of the *host* uid, and every container of an
        # image runs as the same uid, so one episode's fork bomb would starve the others (seen);
        # the container's pids cgroup bounds each episode alone.
        ulimits = [docker.types.Ulimit(name="fsize", soft=c.max_file_bytes, hard=c.max_file_bytes),
                   docker.types.Ulimit(name="cpu", soft=c.cpu_seconds, hard=c.cpu_seconds)]
        try:
            self.volume = self.cli.volumes.create(
                f"jointrl-{secrets.token_hex(8)}", driver="local",
                driver_opts={"type": "tmpfs", "device": "tmpfs", "o": f"size={disk}"}, labels=self._labels("work"))
            self.container = self.cli.containers.run(
                image, _PID1, entrypoint=[], detach=True, user="0", network_mode="bridge" if network else "none",
                tmpfs={"/tmp": f"size={disk},mode=1777,exec"}, mem_limit=memory, memswap_limit=memory,
                nano_cpus=int(res.cpus * 1e9) if res.cpus else None, pids_limit=c.max_processes, ulimits=ulimits,
                cap_drop=["ALL"], cap_add=_CAPS, security_opt=["no-new-privileges"], labels=self._labels("sandbox"),
                mounts=[docker.types.Mount(str(self.workdir), self.volume.name, type="volume"),
                        *(docker.types.Mount(t, s, type="bind", read_only=True) for s, t in c.tool_mounts.items())])
        except Exception as e:  # noqa: BLE001  (docker.errors.*: the sandbox could not start)
            self.close()
            raise EnvError(f"cannot start a docker sandbox from {image}: {e}") from e
        try:
            self._start(binds, workdir_from)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _labels(kind: str) -> dict[str, str]:
        return {"jointrl": kind, "jointrl.pid": str(os.getpid()), "jointrl.host": _HOST}

    def _start(self, binds: dict[str, str], workdir_from: Path | None) -> None:
        """The image's WORKDIR content, the run user's ids, ``rw_dirs``, ``ro_binds``, the task files."""
        ids = self._exec(["id", "-u", self.user], 30.0, {}, user="0")
        gid = self._exec(["id", "-g", self.user], 30.0, {}, user="0")
        if not (ids.ok and gid.ok):
            raise EnvError(f"docker sandbox probe failed (image {self.image}, user {self.user!r}): {ids} {gid}")
        self.uid, self.gid = int(ids.stdout), int(gid.stdout)
        seed = _image_workdir_tar(self.cli, self.image, str(self.workdir))
        if seed and not self._seed:  # only the WORKDIR itself: its owner and mode as in the image
            seed = _top_entry(seed)
        if seed and not self.container.put_archive(str(self.workdir.parent), seed):
            raise EnvError(f"docker put_archive of the image's {self.workdir} failed")
        mk = [*(f"mkdir -p {_quote(d)} && chown {self.uid}:{self.gid} {_quote(d)}" for d in (*self.rw_dirs, _STATE)),
              *(f"mkdir -p {_quote(d)}" for d in binds.values()), "true"]
        r = self._exec(["sh", "-c", " && ".join(mk)], 30.0, {}, user="0")
        if not r.ok:
            raise EnvError(f"docker sandbox setup failed: {r}")
        for src, dest in binds.items():
            self._put(Path(src), dest, uid=0, gid=0)
        if workdir_from is not None:
            self.populate(Path(workdir_from))

    # -- commands ---------------------------------------------------------------------------

    def exec(self, cmd: str, timeout: float | None = None) -> ExecResult:
        """One-shot ``bash -c cmd`` in the WORKDIR as the image's user."""
        return self._command(["bash", "-c", cmd], cmd, timeout, {})

    def run(self, cmd: str, timeout: float | None = None) -> ExecResult:
        """The emulated persistent shell (see the module docstring)."""
        return self._command(["bash", "-c", _shell_wrapper(_quote(str(self.workdir)))], cmd, timeout,
                             {"JOINTRL_CMD": cmd})

    def _command(self, argv: list[str], cmd: str, timeout: float | None, env: dict[str, str]) -> ExecResult:
        if not isinstance(cmd, str):
            raise TypeError(f"cmd must be a str, got {type(cmd).__name__}")
        if "\0" in cmd:
            raise ValueError("cmd contains a NUL byte")
        timeout = self.config.timeout_s if timeout is None else timeout
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        with self._lock:
            if self._closed:
                raise RuntimeError("sandbox is closed")
            # the command, then its own sweep (the user's ``kill -9 -1`` spares the wrapper, and
            # reaches only this container's pid namespace): one exec per command, not two
            return self._exec(["bash", "-c", _SELF_SWEEP, "jointrl", f"{timeout}s", *argv], timeout, env,
                              user=self.user, swept=True)

    def _exec(self, argv: list[str], timeout: float, env: dict[str, str], user: str,
              swept: bool = False) -> ExecResult:
        api = self.cli.api
        cap = self.config.max_output_bytes
        out, err = Capped(cap), Capped(cap)
        started = time.monotonic()
        try:
            exec_id = api.exec_create(self.container.id, argv, user=user, workdir=str(self.workdir),
                                      environment={**self.env, **env})["Id"]
            watchdog = threading.Timer(timeout + 1.0, self._sweep)
            watchdog.start()
            try:
                for o, e in api.exec_start(exec_id, stream=True, demux=True):
                    if o:
                        out.add(o)
                    if e:
                        err.add(e)
            finally:
                watchdog.cancel()
            code = api.exec_inspect(exec_id)["ExitCode"]
            if not swept or code not in range(0, 126) or code == TIMEOUT_EXIT_CODE:
                self._sweep()  # the wrapper did not finish its own sweep (killed, timed out): from root
        except Exception as e:  # noqa: BLE001  (docker.errors.*, connection loss: infrastructure)
            raise EnvError(f"docker sandbox failed while running a command: {e}") from e
        # `timeout -s KILL` exits 137 when it killed the command; an OOM kill is 137 too, but early.
        timed_out = code == 137 and time.monotonic() - started >= timeout
        truncated = bool(out.dropped or err.dropped)
        if timed_out:
            return ExecResult(out.text(), err.text(), TIMEOUT_EXIT_CODE, True, truncated)
        return ExecResult(out.text(), err.text(), int(code if code is not None else -1), False, truncated)

    def _sweep(self) -> None:
        """SIGKILL every process in the container but pid 1 (root's ``kill -1`` spares itself and init).

        The sweep is one process (``sh`` with its builtin ``kill``). When it cannot start -- a
        fork bomb holds every slot of the pids cgroup -- the processes are killed from the host
        instead (the daemon's local host: their host pids from ``docker top``), round after round
        until only pid 1 is left.
        """
        api = self.cli.api
        try:
            exec_id = api.exec_create(self.container.id, ["sh", "-c", "kill -9 -1 2>/dev/null; exit 0"], user="0")["Id"]
            api.exec_start(exec_id)
            if api.exec_inspect(exec_id)["ExitCode"] == 0:
                return
            self._host_kill()
        except Exception:  # noqa: BLE001  (the container may be gone already)
            pass

    def _host_kill(self, rounds: int = 50) -> None:
        init = self.cli.api.inspect_container(self.container.id)["State"]["Pid"]
        for _ in range(rounds):
            top = self.container.top()
            col = top["Titles"].index("PID")
            pids = [int(row[col]) for row in top["Processes"] or []] if top else []
            pids = [p for p in pids if p != init]
            if not pids:
                return
            sigkill(pids)

    # -- files ------------------------------------------------------------------------------

    def _mounts(self) -> tuple[PurePosixPath, ...]:
        return (PurePosixPath(self.workdir), *map(PurePosixPath, self.rw_dirs))

    def _inside(self, path: str) -> PurePosixPath:
        """The absolute container path of ``path`` (relative to the WORKDIR), refusing other places."""
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty str, got {path!r}")
        p = PurePosixPath(self.workdir) / path
        if ".." in p.parts:
            raise ValueError(f"path {path!r} escapes through '..'")
        if not any(p.is_relative_to(m) for m in self._mounts()):
            raise ValueError(f"path {path!r} is outside {self.workdir} and the sandbox's writable dirs")
        return p

    def _check_resolved(self, path: str, must_exist: bool) -> PurePosixPath:
        """Resolve symlinks *inside* the container and refuse a target outside the writable dirs."""
        target = self._inside(path)
        flag = "-e" if must_exist else "-m"
        with self._lock:
            if self._closed:
                raise RuntimeError("sandbox is closed")
            r = self._exec(["realpath", flag, "--", str(target)], 30.0, {}, user="0")
        if not r.ok:
            raise FileNotFoundError(path) if must_exist else ValueError(f"cannot resolve {path!r}")
        real = PurePosixPath(r.stdout.strip())
        if not any(real.is_relative_to(m) for m in self._mounts()):
            raise ValueError(f"path {path!r} resolves outside the sandbox's writable dirs (to {str(real)!r})")
        return real

    def read_file(self, path: str) -> bytes:
        real = self._check_resolved(path, must_exist=True)
        try:
            bits, _ = self.container.get_archive(str(real))
        except Exception as e:  # noqa: BLE001  (docker.errors.NotFound: gone meanwhile)
            raise FileNotFoundError(path) from e
        with tarfile.open(fileobj=io.BytesIO(b"".join(bits))) as tar:
            member = tar.next()
            if member is None or not member.isfile():
                raise ValueError(f"{path!r} is not a regular file")
            return tar.extractfile(member).read()

    def write_file(self, path: str, data: bytes | str) -> None:
        if isinstance(data, str):
            data = data.encode()
        real = self._check_resolved(path, must_exist=False)
        parent = real.parent
        with self._lock:
            r = self._exec(["sh", "-c", f"mkdir -p -- {_quote(str(parent))} && chown {self.uid}:{self.gid} "
                                        f"{_quote(str(parent))}"], 30.0, {}, user="0")
        if not r.ok:
            raise ValueError(f"cannot create the directory of {path!r}: {r.stderr.strip()[:200]}")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(real.name)
            info.size, info.mode, info.uid, info.gid = len(data), 0o644, self.uid, self.gid
            tar.addfile(info, io.BytesIO(data))
        if not self.container.put_archive(str(parent), buf.getvalue()):
            raise EnvError(f"docker put_archive of {path!r} failed")

    def _put(self, src: Path, dest: str, *, uid: int, gid: int) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            def owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
                info.uid, info.gid, info.uname, info.gname = uid, gid, "", ""
                info.mode &= 0o777  # no setuid / setgid / sticky
                return info
            if src.is_dir():
                for child in sorted(src.iterdir()):
                    tar.add(child, arcname=child.name, filter=owned)
            else:
                tar.add(src, arcname=src.name, filter=owned)
        try:
            ok = self.container.put_archive(dest, buf.getvalue())
        except Exception as e:  # noqa: BLE001  (docker.errors.APIError)
            raise EnvError(f"docker put_archive into {dest!r} failed: {e}") from e
        if not ok:
            raise EnvError(f"docker put_archive into {dest!r} failed")

    def populate(self, src: Path) -> None:
        """Copy the host directory ``src`` into the WORKDIR, owned by the run user."""
        if not Path(src).is_dir():
            raise ValueError(f"populate source {str(src)!r} is not a directory")
        self._put(Path(src), str(self.workdir), uid=self.uid, gid=self.gid)

    def copy_workdir_to(self, dest: Path) -> None:
        """Snapshot the WORKDIR into the new host directory ``dest``; links leaving it are dropped."""
        bits, _ = self.container.get_archive(str(self.workdir))  # members are named <basename>/...
        dest = Path(dest)
        tmp = Path(tempfile.mkdtemp(prefix=".snap-", dir=dest.parent))

        def safe(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
            try:
                kept = tarfile.data_filter(member, path)
            except tarfile.FilterError:
                return None  # an absolute or escaping link, a device: not copied
            if member.issym():
                return kept
            # the agent's own modes (data_filter drops a directory's), less setuid / setgid / sticky
            return kept.replace(mode=member.mode & 0o777, deep=False)

        try:
            with tarfile.open(fileobj=io.BytesIO(b"".join(bits))) as tar:
                tar.extractall(tmp, filter=safe)
            top = tmp / (self.workdir.name or "root")
            os.chmod(top, 0o700)
            os.rename(top, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for thing in (self.container, self.volume):
            if thing is not None:
                try:
                    thing.remove(force=True)
                except Exception:  # noqa: BLE001  (already gone)
                    pass

    def __enter__(self) -> DockerSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _top_entry(tar_bytes: bytes) -> bytes:
    """A tar of the first member of ``tar_bytes`` alone (a directory entry: owner, mode)."""
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        first = tar.next()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as out:
        if first is not None:
            out.addfile(first)
    return buf.getvalue()


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"
