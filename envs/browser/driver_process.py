"""The host's end of the page driver (``web/driver.py``): start it in a sandbox, send requests.

The driver is one long-lived process of the episode's bwrap sandbox -- its own namespaces,
uid and cgroup, so its sites' loopback is private to the episode -- started the way the
sandbox starts its shell (``BwrapSandbox.start_process``: from the sandbox's spawner thread, so that
``--die-with-parent`` holds until ``close``). The browser sandbox never runs shell commands:
the sweep that follows a ``run`` / ``exec`` would kill the driver.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import threading
import time
from pathlib import Path

from jointrl.envs.base import EnvError
from jointrl.envs.sandbox.base import SandboxConfig
from jointrl.envs.sandbox.bwrap import BwrapSandbox

WEB_DIR = Path(__file__).parent / "web"
WEB_MOUNT = "/opt/jointrl-browser/web"
DEFAULT_VENV = "/opt/jointrl/venvs/browser"  # made by .ci/setup.d/browser.sh
STATE_FILE = "site/state.json"  # under /work: the sites' app state, read by the app_state reward
START_TIMEOUT_S = 60.0  # Chromium's first start on a loaded machine
_STDERR_TAIL = 4000
_EXIT_GRACE_S = 5.0  # for the driver to end on EOF (closing Chromium) before it is killed


def venv_path() -> str:
    return os.environ.get("JOINTRL_BROWSER_VENV", DEFAULT_VENV)


def check_venv(mode: str) -> None:
    """Raise ``EnvError`` saying how to install what is missing for ``mode``."""
    venv = Path(venv_path())
    if not (venv / "bin" / "python").exists():
        raise EnvError(f"the browser tool venv {str(venv)!r} is missing: run .ci/setup.d/browser.sh "
                       "(or set JOINTRL_BROWSER_VENV)")
    if mode == "image" and not Path("/usr/bin/chromium").exists():
        raise EnvError("image mode needs Debian's Chromium at /usr/bin/chromium: apt-get install chromium "
                       "(.ci/setup.d/browser.sh does it)")


class DriverProcess:
    """One driver in a fresh ``BwrapSandbox``; ``request`` sends one action, ``close`` ends both."""

    def __init__(self, config: SandboxConfig, seed: int, mode: str) -> None:
        check_venv(mode)
        venv = venv_path()
        # The venv is bound as is (large, world-readable under /opt); web/ (~100 KB) is copied in
        # as a read-only bind, so a checkout under a private directory (mktemp -d) works too.
        config = _with_mounts(config, tool_mounts={venv: venv}, ro_binds={str(WEB_DIR): WEB_MOUNT})
        env = {"HOME": "/tmp", "PYTHONPATH": str(Path(WEB_MOUNT).parent), "PYTHONDONTWRITEBYTECODE": "1"}
        self.sandbox = BwrapSandbox(config, env=env, shell=False)
        argv = [f"{venv}/bin/python", "-m", "web.driver", "--seed", str(seed), "--mode", mode,
                "--state", f"/work/{STATE_FILE}"]
        try:
            self.proc, self._status_r = self.sandbox.start_process(argv)
        except BaseException as err:
            self.sandbox.close()
            raise EnvError(f"cannot start the page driver: {err}") from err
        self._stderr = bytearray()
        threading.Thread(target=self._drain_stderr, daemon=True, name="browser-driver-stderr").start()
        self._buf = b""
        try:
            ready = self._read_line(time.monotonic() + START_TIMEOUT_S)
            if not ready.get("ready"):
                raise EnvError(f"the page driver did not start: {ready!r}")
        except BaseException:
            self.close()
            raise

    def request(self, op: str, args: dict, timeout: float) -> dict:
        """Run one browser action; ``EnvError`` if the driver dies, hangs or breaks."""
        try:
            self.proc.stdin.write((json.dumps({"op": op, "args": args}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as err:
            raise EnvError(f"the page driver is gone: {err}; stderr: {self.stderr_tail()!r}") from err
        reply = self._read_line(time.monotonic() + timeout)
        if reply.get("fatal"):
            raise EnvError(f"{reply.get('text')}; stderr: {self.stderr_tail()!r}")
        return reply

    def _read_line(self, deadline: float) -> dict:
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(timeout=left):
                    raise EnvError(f"the page driver did not answer in time; stderr: {self.stderr_tail()!r}")
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise EnvError(f"the page driver exited ({self.proc.poll()}); stderr: {self.stderr_tail()!r}")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError as err:
            raise EnvError(f"the page driver wrote a malformed reply: {line[:200]!r}") from err

    def _drain_stderr(self) -> None:
        for chunk in iter(lambda: self.proc.stderr.read1(65536), b""):
            self._stderr += chunk
            del self._stderr[:-_STDERR_TAIL]

    def stderr_tail(self) -> str:
        return self._stderr.decode("utf-8", "replace")

    def close(self) -> None:
        """End the driver (EOF on its stdin, then SIGKILL), reap it, close the sandbox. Idempotent.

        The driver is reaped before the sandbox's cgroup sweep, so that sweep never waits on it.
        """
        for stream in (self.proc.stdin,):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=_EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # bwrap; its pid 1 dies with it (--die-with-parent)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.proc.stdout.close()
        if self._status_r >= 0:
            os.close(self._status_r)
            self._status_r = -1
        self.sandbox.close()


def _with_mounts(config: SandboxConfig, *, tool_mounts: dict[str, str], ro_binds: dict[str, str]) -> SandboxConfig:
    from dataclasses import replace

    return replace(config, tool_mounts={**config.tool_mounts, **tool_mounts},
                   ro_binds={**config.ro_binds, **ro_binds})
