"""The docker sandbox backend: one container per episode, over the Docker Python SDK.

For tasks that need their own image (a Harbor ``environment/Dockerfile``, a Terminal-Bench 1
``Dockerfile``) and hosts where a daemon is reachable. Same contract as ``BwrapSandbox``
(``exec``, ``run``, ``read_file``, ``write_file``, ``populate``, ``copy_workdir_to``, ``close``)
and the same limits from ``SandboxConfig``. What it protects against:

- **Network**: ``network_mode="none"``.
- **Writes outside the episode**: the image's root filesystem is read-only; ``/work`` and
  ``/tmp`` are tmpfs of ``max_disk_bytes`` each (the disk bound); ``ro_binds`` are copied into
  root-owned tmpfs the command cannot write; ``rw_dirs`` are fresh tmpfs.
- **Other episodes and the host**: a container per episode, every command run as the
  unprivileged uid 1000 with ``cap_drop=ALL`` and ``no-new-privileges``; pid 1 is root's
  ``sleep``, which uid 1000 cannot signal, so ``kill -9 -1`` only ends the agent's own processes.
- **Memory and process bombs**: the container's memory cgroup (``mem_limit`` =
  ``memswap_limit`` = ``max_memory_bytes``) and pids cgroup (``pids_limit``); rlimits
  NPROC / FSIZE / CPU as backstop (no RLIMIT_AS).
- **Runaway commands**: each command runs under ``timeout -s KILL``; a watchdog kills every
  process of uid 1000 shortly after the deadline (children that escaped the timeout), and the
  same sweep runs after every command, so no background process outlives its command.
  Output is capped at ``max_output_bytes`` per stream as it streams in.

What it does not protect against: kernel exploits (a container shares the host kernel, like
bwrap); a daemon that is configured insecurely (e.g. ``--userns-remap`` off means the
container's root is the host's root, though no agent command runs as root).

The persistent shell is *emulated*: each ``run`` is a fresh ``bash`` that first restores the
cwd and the exported variables the previous one saved (``/tmp/.jointrl-shell``). Shell-only
variables and functions do not persist here, unlike bwrap's real persistent shell.

Tested by the shared contract suite (tests/envs/sandbox/test_contract.py) where a daemon is
reachable; skipped with the reason (``unavailable_reason()``) where not.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
import tarfile
import threading
import time
from pathlib import Path, PurePosixPath

from jointrl.envs.base import EnvError
from jointrl.envs.sandbox.base import ExecResult, SandboxConfig
from jointrl.envs.sandbox.output import Capped

IMAGES_DIR = Path(__file__).resolve().parent.parent / "images"
USER = "1000:1000"
TIMEOUT_EXIT_CODE = 124
_STATE = "/tmp/.jointrl-shell"
_SHELL_WRAPPER = (
    f'__s={_STATE}; [ -f $__s/env ] && . $__s/env; cd "$(cat $__s/cwd 2>/dev/null || echo /work)" 2>/dev/null || cd /work; '
    '__c=$JOINTRL_CMD; unset JOINTRL_CMD; eval "$__c"; __rc=$?; '
    'mkdir -p $__s && export -p > $__s/env && pwd > $__s/cwd; exit $__rc'
)


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


def client():
    reason = unavailable_reason()
    if reason is not None:
        raise EnvError(f"docker sandbox unavailable: {reason}")
    import docker

    return docker.from_env(timeout=120)


def ensure_image(cli, dockerfile: Path) -> str:
    """Build ``dockerfile`` (context: its folder) once; the tag is a hash of its text."""
    dockerfile = Path(dockerfile)
    if not dockerfile.is_file():
        raise ValueError(f"dockerfile {str(dockerfile)!r} does not exist")
    tag = f"jointrl-{dockerfile.stem.lower()}:{hashlib.sha256(dockerfile.read_bytes()).hexdigest()[:12]}"
    try:
        cli.images.get(tag)
    except Exception:  # noqa: BLE001  (docker.errors.ImageNotFound; build it)
        cli.images.build(path=str(dockerfile.parent), dockerfile=dockerfile.name, tag=tag, rm=True)
    return tag


def domain_image(domain: str) -> Path:
    path = IMAGES_DIR / f"{domain}.Dockerfile"
    if not path.is_file():
        available = sorted(p.stem for p in IMAGES_DIR.glob("*.Dockerfile"))
        raise ValueError(f"no image for domain {domain!r}; available: {available}")
    return path


class DockerSandbox:
    """One episode's container: ``image`` by name, or built from ``dockerfile`` (a task's own), else
    from ``envs/images/<domain>.Dockerfile``. ``shell`` is accepted for the common constructor
    signature (the emulated shell needs no process)."""

    def __init__(self, config: SandboxConfig | None = None, workdir_from: Path | None = None,
                 ro_binds: dict[str, str] | None = None, *, rw_dirs: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, shell: bool = True, domain: str = "terminal",
                 dockerfile: Path | None = None, image: str | None = None) -> None:
        import docker.types

        self.config = c = config or SandboxConfig()
        self.cli = client()
        if image is None:  # a prebuilt image by name (Harbor's [environment] docker_image) is used as is
            image = ensure_image(self.cli, Path(dockerfile) if dockerfile else domain_image(domain))
        binds = {**c.ro_binds, **(ro_binds or {})}
        size = c.max_disk_bytes or (1 << 30)
        tmpfs = {"/work": f"size={size},uid=1000,gid=1000,mode=0700", "/tmp": f"size={size},mode=1777"}
        tmpfs.update({d: "size=67108864,mode=0755" for d in binds.values()})
        tmpfs.update({d: "size=67108864,uid=1000,gid=1000,mode=0700" for d in rw_dirs})
        self.rw_dirs = {str(PurePosixPath(d)): d for d in rw_dirs}
        self.env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8", "TERM": "dumb", **(env or {})}
        ulimits = [docker.types.Ulimit(name="nproc", soft=c.max_processes, hard=c.max_processes),
                   docker.types.Ulimit(name="fsize", soft=c.max_file_bytes, hard=c.max_file_bytes),
                   docker.types.Ulimit(name="cpu", soft=c.cpu_seconds, hard=c.cpu_seconds)]
        self._lock = threading.Lock()
        self._closed = False
        try:
            self.container = self.cli.containers.run(
                image, ["sleep", "infinity"], detach=True, user="0", network_mode="none", read_only=True,
                tmpfs=tmpfs, mem_limit=c.max_memory_bytes, memswap_limit=c.max_memory_bytes,
                pids_limit=c.max_processes, ulimits=ulimits, cap_drop=["ALL"], security_opt=["no-new-privileges"],
                working_dir="/work", environment=self.env, mounts=[
                    docker.types.Mount(t, s, type="bind", read_only=True) for s, t in c.tool_mounts.items()],
            )
        except Exception as e:  # noqa: BLE001  (docker.errors.*: the sandbox could not start)
            raise EnvError(f"cannot start a docker sandbox from {image}: {e}") from e
        self.workdir = Path("/work")  # inside the container; there is no host directory
        try:
            for src, dest in binds.items():
                self._put(Path(src), dest, uid=0)
            if workdir_from is not None:
                self.populate(Path(workdir_from))
            probe = self.exec("true", timeout=max(c.timeout_s, 10.0))
            if not probe.ok:
                raise EnvError(f"docker sandbox probe failed: {probe}")
        except BaseException:
            self.close()
            raise

    # -- commands ---------------------------------------------------------------------------

    def exec(self, cmd: str, timeout: float | None = None) -> ExecResult:
        """One-shot ``bash -c cmd`` in ``/work`` as uid 1000."""
        return self._command(["bash", "-c", cmd], cmd, timeout, {})

    def run(self, cmd: str, timeout: float | None = None) -> ExecResult:
        """The emulated persistent shell (see the module docstring)."""
        return self._command(["bash", "-c", _SHELL_WRAPPER], cmd, timeout, {"JOINTRL_CMD": cmd})

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
            return self._exec(["timeout", "-s", "KILL", f"{timeout}s", *argv], timeout, env)

    def _exec(self, argv: list[str], timeout: float, env: dict[str, str]) -> ExecResult:
        api = self.cli.api
        cap = self.config.max_output_bytes
        out, err = Capped(cap), Capped(cap)
        started = time.monotonic()
        try:
            exec_id = api.exec_create(self.container.id, argv, user=USER, workdir="/work",
                                      environment={**self.env, **env})["Id"]
            watchdog = threading.Timer(timeout + 1.0, self._kill_user_processes)
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
            self._kill_user_processes()  # background processes never outlive their command
        except Exception as e:  # noqa: BLE001  (docker.errors.*, connection loss: infrastructure)
            raise EnvError(f"docker sandbox failed while running a command: {e}") from e
        # `timeout -s KILL` exits 137 when it killed the command; an OOM kill is 137 too, but early.
        timed_out = code == 137 and time.monotonic() - started >= timeout
        truncated = bool(out.dropped or err.dropped)
        if timed_out:
            return ExecResult(out.text(), err.text(), TIMEOUT_EXIT_CODE, True, truncated)
        return ExecResult(out.text(), err.text(), int(code if code is not None else -1), False, truncated)

    def _kill_user_processes(self) -> None:
        try:
            self.cli.api.exec_start(self.cli.api.exec_create(self.container.id, ["kill", "-9", "-1"], user=USER)["Id"])
        except Exception:  # noqa: BLE001  (the container may be gone already)
            pass

    # -- files ------------------------------------------------------------------------------

    def _inside(self, path: str) -> str:
        """The absolute container path of ``path`` (relative to /work), refusing other mounts."""
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty str, got {path!r}")
        p = PurePosixPath("/work") / path
        if ".." in p.parts:
            raise ValueError(f"path {path!r} escapes through '..'")
        for mount in ("/work", *self.rw_dirs):
            if p.is_relative_to(mount):
                return str(p)
        raise ValueError(f"path {path!r} is outside /work and the sandbox's writable dirs")

    def _check_resolved(self, path: str, must_exist: bool) -> str:
        """Resolve symlinks *inside* the container and refuse a target outside the mount."""
        target = self._inside(path)
        flag = "-e" if must_exist else "-m"
        r = self.exec(f"realpath {flag} -- {_quote(target)}", timeout=30)
        if not r.ok:
            raise FileNotFoundError(path) if must_exist else ValueError(f"cannot resolve {path!r}")
        real = PurePosixPath(r.stdout.strip())
        if not any(real.is_relative_to(m) for m in ("/work", *self.rw_dirs)):
            raise ValueError(f"path {path!r} resolves outside the sandbox's writable dirs (to {str(real)!r})")
        return str(real)

    def read_file(self, path: str) -> bytes:
        real = self._check_resolved(path, must_exist=True)
        bits, _ = self.container.get_archive(real)
        with tarfile.open(fileobj=io.BytesIO(b"".join(bits))) as tar:
            member = tar.next()
            if member is None or not member.isfile():
                raise ValueError(f"{path!r} is not a regular file")
            return tar.extractfile(member).read()

    def write_file(self, path: str, data: bytes | str) -> None:
        if isinstance(data, str):
            data = data.encode()
        real = PurePosixPath(self._check_resolved(path, must_exist=False))
        self.exec(f"mkdir -p -- {_quote(str(real.parent))}", timeout=30)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(real.name)
            info.size, info.mode, info.uid, info.gid = len(data), 0o644, 1000, 1000
            tar.addfile(info, io.BytesIO(data))
        if not self.container.put_archive(str(real.parent), buf.getvalue()):
            raise EnvError(f"docker put_archive of {path!r} failed")

    def _put(self, src: Path, dest: str, *, uid: int) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            def owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
                info.uid = info.gid = uid
                info.mode &= 0o777  # no setuid / setgid / sticky
                return info
            if src.is_dir():
                for child in sorted(src.iterdir()):
                    tar.add(child, arcname=child.name, filter=owned)
            else:
                tar.add(src, arcname=src.name, filter=owned)
        if not self.container.put_archive(dest, buf.getvalue()):
            raise EnvError(f"docker put_archive into {dest!r} failed")

    def populate(self, src: Path) -> None:
        """Copy the host directory ``src`` into ``/work``, owned by uid 1000."""
        if not Path(src).is_dir():
            raise ValueError(f"populate source {str(src)!r} is not a directory")
        self._put(Path(src), "/work", uid=1000)

    def copy_workdir_to(self, dest: Path) -> None:
        """Snapshot ``/work`` into the new host directory ``dest``; links leaving it are dropped."""
        bits, _ = self.container.get_archive("/work")  # members are named work/...
        dest = Path(dest)
        tmp = Path(tempfile.mkdtemp(prefix=".snap-", dir=dest.parent))

        def safe(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
            try:
                return tarfile.data_filter(member, path)
            except tarfile.FilterError:
                return None  # an absolute or escaping link, a device: not copied

        try:
            with tarfile.open(fileobj=io.BytesIO(b"".join(bits))) as tar:
                tar.extractall(tmp, filter=safe)
            os.chmod(tmp / "work", 0o700)
            os.rename(tmp / "work", dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        container = getattr(self, "container", None)
        if container is not None:
            try:
                container.remove(force=True)
            except Exception:  # noqa: BLE001  (already gone)
                pass

    def __enter__(self) -> DockerSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"
