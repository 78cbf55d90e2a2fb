"""Running code as an ordinary user, as a Slurm job would: ``Unprivileged`` (the ``unprivileged`` fixture).

The test process is root; the code under test must run as a non-root uid from its first
instruction (imports included). ``Unprivileged.argv`` wraps a command so that it runs:

- as ``uid`` (65534, ``nobody``) with no supplementary groups and no capabilities (``setpriv``);
- in a private mount namespace of its own where ``/root`` is an empty tmpfs holding only the
  Python install (``/root/.pyenv``, bound read-only): ``/root`` is mode 0700 on this machine,
  and the test changes no permission of the host's;
- optionally inside a cgroup subtree delegated to that uid (``delegate=True``): created here
  as root under our own memory and pids cgroups (v1) or our v2 cgroup, chowned to the uid,
  with the command's process moved into it, as Slurm does for a job.

HOME, TMPDIR and the caches point into a directory the uid owns (``home``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from jointrl.envs.sandbox.kill import sigkill

UID = 65534
PYENV = Path("/root/.pyenv")


def _cgroup_dirs() -> list[Path]:
    """Our own memory and pids cgroup dirs (v1), or our v2 cgroup; [] where neither is writable."""
    dirs = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctls, path = line.split(":", 2)
        for ctl in ("memory", "pids"):
            if ctl in ctls.split(","):
                dirs.append(Path("/sys/fs/cgroup") / ctl / path.lstrip("/"))
    if len(dirs) == 2:
        return dirs
    v2 = [line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::")]
    return [Path("/sys/fs/cgroup") / v2[0].lstrip("/")] if v2 else []


class Unprivileged:
    def __init__(self) -> None:
        self.uid = UID
        # Not under pytest's tmp_path: /tmp/pytest-of-root is mode 0700.
        self.base = base = Path(tempfile.mkdtemp(prefix="jointrl-as-user-", dir="/tmp"))
        self.home = base / "home"
        self.home.mkdir(parents=True)
        for sub in ("tmp", ".cache"):
            (self.home / sub).mkdir()
        for p in (self.home, self.home / "tmp", self.home / ".cache"):
            os.chown(p, UID, UID)
        os.chmod(base, 0o755)
        self.short = Path(tempfile.mkdtemp(prefix="jr-", dir="/tmp"))  # Ray's sockets need a short path
        os.chown(self.short, UID, UID)
        self.delegated: list[Path] = []

    def delegate(self) -> list[Path]:
        """Create the delegated cgroup subtree (once); [] where this host has none to give."""
        if not self.delegated:
            for parent in _cgroup_dirs():
                d = parent / f"jointrl-test-job-{os.getpid()}-{time.monotonic_ns()}"
                try:
                    d.mkdir()
                except OSError:
                    continue
                self.delegated.append(d)
                for p in [d, *d.iterdir()]:
                    os.chown(p, UID, UID)
        return self.delegated

    def env(self, **extra: str) -> dict[str, str]:
        home = str(self.home)
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": home,
               "TMPDIR": f"{home}/tmp", "XDG_CACHE_HOME": f"{home}/.cache", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "LANG": "C.UTF-8",
               "JOINTRL_SANDBOX_ROOT": f"{home}/tmp/sandboxes"}
        return {**env, **extra}

    def argv(self, cmd: list[str], *, delegate: bool = False) -> list[str]:
        """``cmd`` run as the uid, in the private ``/root`` view, in the delegated cgroup if asked."""
        join = "".join(f"echo $$ > {shlex.quote(str(d))}/cgroup.procs && " for d in (self.delegate() if delegate else []))
        hold = self.home.parent / "pyenv-hold"
        hold.mkdir(exist_ok=True)
        script = (f"mount --bind -o ro {PYENV} {hold} && mount -t tmpfs -o mode=0755,size=1m tmpfs /root && "
                  f"mkdir /root/.pyenv && mount --move {hold} /root/.pyenv && {join}"
                  f'exec setpriv --reuid={UID} --regid={UID} --clear-groups -- "$@"')
        return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script, "as-user", *cmd]

    def cleanup(self) -> None:
        for d in self.delegated:
            _remove_cgroup(d)
        for d in (self.short, self.base):
            shutil.rmtree(d, ignore_errors=True)


def _remove_cgroup(d: Path) -> None:
    """Kill what is left in ``d`` and below (only the test's own processes can be there), then rmdir them."""
    for child in [c for c in d.iterdir() if c.is_dir()] if d.exists() else []:
        _remove_cgroup(child)
    for _ in range(1000):
        try:
            pids = [int(x) for x in (d / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return
        if not pids:
            d.rmdir()
            return
        sigkill(pids)
        time.sleep(0.01)


@pytest.fixture
def unprivileged():
    u = Unprivileged()
    yield u
    u.cleanup()
