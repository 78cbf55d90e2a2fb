"""CadQuery in the sandbox: the CAD tool venv, the episode's warm interpreter, one-shot builds.

CadQuery (with OCP and VTK, ~1.8 GB) lives in its own venv, ``/opt/jointrl/venvs/cad``
(``.ci/setup.d/cad.sh``), built with the host's ``/usr/bin/python3`` -- the same Debian
Python the sandbox sees read-only -- and bound read-only into every CAD sandbox at the same
path (``SandboxConfig.tool_mounts``). ``sandbox_runner.py`` is copied in beside it.

- :class:`CadSandbox` is a ``BwrapSandbox`` that also hosts one long-lived process, the
  episode's **warm interpreter** (``sandbox_runner.py serve``): CadQuery is imported once
  (~3 s), then each ``run_cadquery`` call costs only its own geometry. The persistent shell of
  a plain sandbox cannot host it (every process but the shell is killed after each command),
  so it is spawned like that shell: by bwrap, inside the sandbox's memory and pids cgroups
  before it runs anything, from one long-lived thread (``--die-with-parent`` watches the
  spawning thread). A call past its timeout, or a crash (the memory cgroup's OOM kill, an
  ``os._exit``), kills every process of the sandbox; the next call starts a fresh interpreter.
- :func:`build_stl` runs code once, in a fresh process of a given sandbox, and returns the
  binary STL of its solid: the reward's path (``rewards/cad_geometry.py``).

Memory is bounded by the sandbox's cgroup, never RLIMIT_AS (OCP breaks under it; the bwrap
backend falls back to it only on hosts without cgroups). The summary a call returns is for
the model only: code that writes to the reply pipe itself can only mislead itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jointrl.envs.base import EnvError
from jointrl.envs.sandbox.base import SandboxConfig
from jointrl.envs.sandbox.bwrap import BwrapSandbox
from jointrl.envs.sandbox.bwrap_proc import read_json_line

VENV = os.environ.get("JOINTRL_CAD_VENV", "/opt/jointrl/venvs/cad")
RUNNER = Path(__file__).with_name("sandbox_runner.py")
RUNNER_MOUNT = "/opt/jointrl-cad/runner.py"
_MAX_REPLY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class CadConfig:
    """Limits of CAD sandboxes. ``call_timeout_s`` bounds one ``run_cadquery`` call (a call
    past it kills the warm interpreter); ``start_timeout_s`` bounds the CadQuery import;
    ``build_timeout_s`` one reward build (import included). Memory is per sandbox (cgroup)."""

    venv: str = VENV
    call_timeout_s: float = 30.0
    start_timeout_s: float = 120.0
    build_timeout_s: float = 120.0
    max_memory_bytes: int = 4 << 30
    cpu_seconds: int = 3600  # RLIMIT_CPU of the warm interpreter: the whole episode's CPU time
    env: dict[str, str] = field(default_factory=lambda: {"OMP_NUM_THREADS": "1"})

    def __post_init__(self) -> None:
        for name in ("call_timeout_s", "start_timeout_s", "build_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CadConfig.{name} must be > 0, got {getattr(self, name)}")

    @property
    def python(self) -> str:
        return f"{self.venv}/bin/python"

    def sandbox_config(self) -> SandboxConfig:
        if not Path(self.python).is_file():
            raise EnvError(f"the CAD tool venv is missing ({self.python}): run .ci/setup.d/cad.sh")
        return SandboxConfig(timeout_s=self.build_timeout_s, max_memory_bytes=self.max_memory_bytes,
                             cpu_seconds=self.cpu_seconds, use_cgroup=True,
                             ro_binds={str(RUNNER): RUNNER_MOUNT}, tool_mounts={self.venv: self.venv})


@dataclass(frozen=True, slots=True)
class Reply:
    """What one warm-interpreter call gave: the runner's JSON summary, or a failure of the call."""

    summary: dict[str, Any]
    timed_out: bool = False
    crashed: str = ""  # why the interpreter died, when it did; it restarts on the next call


class CadSandbox(BwrapSandbox):
    """A sandbox for one CAD episode, hosting the warm interpreter (no persistent shell).

    ``exec`` still works (one-shot), but like every command of the bwrap backend it sweeps
    the sandbox's other processes afterwards: the warm interpreter then restarts on its next call.
    """

    def __init__(self, cad: CadConfig) -> None:
        super().__init__(cad.sandbox_config(), env=cad.env, shell=False)
        self.cad = cad
        self._proc: subprocess.Popen | None = None
        self._fds: tuple[int, ...] = ()  # our reply-pipe read end, bwrap's status pipe
        self._buffer = b""
        self.restarts = 0

    @property
    def interpreter_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start_interpreter(self) -> None:
        """Start the warm interpreter and wait for CadQuery's import. Raises ``EnvError``."""
        self.stop_interpreter()
        self._proc, self._fds = self._spawn_interpreter()
        reply = self._read_reply(time.monotonic() + self.cad.start_timeout_s)
        if reply is None or not reply.get("ready"):
            detail = (reply or {}).get("error") or self._stray_output()
            self.stop_interpreter()
            raise EnvError(f"the CAD interpreter did not start: {detail}")

    def warm(self) -> None:
        """Start the interpreter if none runs (``CadEnv.reset`` does it in the background, so the
        import overlaps the model's first turn). A failure here surfaces on the next ``call``."""
        with self._lock:
            if self._closed or self.interpreter_alive:
                return
            try:
                self.start_interpreter()
            except EnvError:
                pass

    def _spawn_interpreter(self) -> tuple[subprocess.Popen, tuple[int, ...]]:
        reply_r, reply_w = os.pipe()
        try:
            proc, status_r = self.start_process([self.cad.python, "-I", RUNNER_MOUNT, "serve", str(reply_w)],
                                                fds=(reply_w,))
        except BaseException:
            os.close(reply_r)
            raise
        finally:
            os.close(reply_w)
        self._buffer = b""
        return proc, (reply_r, status_r)  # status_r stays open: bwrap writes its exit code there

    def call(self, code: str, *, stl: str | None = None, step: str | None = None) -> Reply:
        """Run ``code`` in the warm interpreter (started or restarted as needed)."""
        with self._lock:
            self._check_open()
            if not self.interpreter_alive:
                if self._proc is not None:
                    self.restarts += 1
                self.start_interpreter()
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write(json.dumps({"code": code, "stl": stl, "step": step}).encode() + b"\n")
                self._proc.stdin.flush()
            except BrokenPipeError:
                pass  # it died while idle: the read below sees the end of its pipe
            reply = self._read_reply(time.monotonic() + self.cad.call_timeout_s)
            if isinstance(reply, dict) and "ok" in reply:
                return Reply(reply)
            timed_out = reply is False
            crashed = "" if timed_out else self._death_note()
            self.stop_interpreter()
            return Reply({}, timed_out=timed_out, crashed=crashed)

    def _read_reply(self, deadline: float) -> dict | bool | None:
        """The next JSON line on the reply pipe; False at the deadline; None at its end (or garbage)."""
        reply, self._buffer = read_json_line(self._fds[0], self._buffer, deadline, _MAX_REPLY_BYTES, 1 << 16)
        return reply

    def _death_note(self) -> str:
        assert self._proc is not None
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "its reply was unreadable"
        oom = " (killed: most likely it ran out of memory)" if code in (-9, 137) else ""
        return f"it exited with code {code}{oom}"

    def _stray_output(self) -> str:
        """The tail of what the interpreter wrote outside a call (import tracebacks), for errors."""
        if self._proc is None or self.interpreter_alive:
            return "timed out importing CadQuery"
        return (self._proc.stderr.read(4000) or b"").decode(errors="replace")

    def stop_interpreter(self) -> None:
        """Kill the warm interpreter (every process of the sandbox) and reap it. Idempotent."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        if proc.poll() is None:
            self.kill_processes()
        proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except OSError:
                pass
        for fd in self._fds:
            os.close(fd)
        self._fds, self._buffer = (), b""

    def interrupt(self) -> None:
        """Kill the interpreter now, even mid-call or mid-import (without waiting for the lock:
        the thread waiting on it sees it die and cleans up); the next ``call`` restarts it."""
        if self._proc is not None and not self._closed:
            self.kill_processes()

    def close(self) -> None:
        self.interrupt()  # ends a call or an import in progress now, instead of waiting for it
        with self._lock:
            if not self._closed:
                self.stop_interpreter()
        super().close()


def build_stl(sandbox: BwrapSandbox, code: str, cad: CadConfig) -> tuple[bytes | None, dict[str, Any]]:
    """Run ``code`` once in a fresh process of ``sandbox`` and export its solid.

    Returns ``(binary STL, summary)``; the STL is None when the code fails or yields no solid
    (the summary's ``error`` says why). Raises ``EnvError`` when the sandbox itself fails.
    ``builder.CadBuilder.build`` gives the same from a fork of a warm process.
    """
    sandbox.write_file("part.py", code)
    result = sandbox.exec(f"{cad.python} -I {RUNNER_MOUNT} build part.py part.stl", timeout=cad.build_timeout_s)
    if result.timed_out:
        return None, timed_out_summary(cad)
    try:
        summary = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError, RecursionError):  # RecursionError: a summary nested past the parser's depth
        summary = None
    return built_part(sandbox, summary, f"the build died (exit {result.exit_code}): {result.stderr[-500:]}")


def timed_out_summary(cad: CadConfig) -> dict[str, Any]:
    return {"ok": False, "error": f"building the part timed out after {cad.build_timeout_s:g} s"}


def built_part(sandbox: BwrapSandbox, summary: Any, died: str,
               stl: str = "part.stl") -> tuple[bytes | None, dict[str, Any]]:
    """A finished build's ``(STL, summary)``: ``stl`` (under /work) when the runner's ``summary`` says
    ok; ``died`` is the error when there is no summary (a dict) at all."""
    if not isinstance(summary, dict):
        return None, {"ok": False, "error": died}
    if not summary.get("ok"):
        return None, summary
    try:
        return sandbox.read_file(stl), summary
    except (FileNotFoundError, ValueError):
        return None, {**summary, "ok": False, "error": "the build wrote no mesh"}
