"""One warm CadQuery builder per env-worker process: the reward's rebuild without an import per part.

``cad_iou`` / ``cad_chamfer`` rebuild each submission in a fresh process (``build_stl``), and 2 of
its ~2.3 CPU-s go to importing CadQuery (OCP and VTK). A :class:`CadBuilder` keeps one process that
has imported it, in a bwrap sandbox of its own that no policy gets a command in
(``sandbox_runner.py forkserve``), and forks it once per build: ~0.2 CPU-s a part.

Reward integrity (docs/architecture.md) -- what a fork of a warm process may and may not carry:

- **Each build gets namespaces of its own** (user, mount, pid, IPC, network, UTS), entered by the
  fork before any model code runs: its own job folder as ``/work`` (the host writes ``part.py``
  there and reads ``part.stl`` and ``summary.json`` back), fresh tmpfs on ``/tmp`` and ``/dev/shm``,
  ``/dev`` read-only, a ``/proc`` showing only its own processes (it is pid 1 of its pid namespace:
  everything it starts dies with it), no capabilities, no new namespaces and no keyring or IPC
  objects (seccomp), no inherited fd. It cannot name, signal, ptrace or ``prlimit`` the server or
  another build, nor see another build's files, sockets or kernel objects.
- **The server carries nothing from one build to the next.** It never reads a submission, its
  output, its mesh or a file name a build chose (a short-lived fork removes earlier job folders),
  so every build is forked from the memory the import left; it is not dumpable; one build at a
  time (a lock), and after each it SIGKILLs every process left in its sandbox.
- **What is still shared**, and why it does not matter for a score: the read-only view and the
  sandbox's memory and pids cgroups (a build that exhausts them fails, as it would one-shot), the
  inode counter of the tmpfs holding the job folders (a few bits of timing-like information, no
  content), and CPU time.
- **Any failure falls back to the one-shot path**: a build that kills the server or cannot be set
  up, a server that dies, times out or answers out of turn raises ``EnvError``, and
  ``rewards.cad_geometry`` rebuilds that submission in its fresh verification sandbox, so the outcome
  is the one-shot outcome; the builder starts afresh on its next build. A self-written STL is an
  answer like any other (the one-shot ``build`` allows the same): the host compares it with the target.
- **One difference from one-shot builds**: ``build_timeout_s`` bounds the build alone, where a
  one-shot build spends 2-13 s of it importing CadQuery.
- **Bounded lifetime**: the sandbox is replaced after ``max_builds`` builds, any failure, and ``close``.

The server's sandbox allows nested user namespaces (``SandboxConfig.nested_userns``; every other
sandbox has ``--disable-userns``): the server needs them for its builds, and the builds' seccomp
filter refuses them to model code. Where they are unavailable the server refuses to start and every
build is one-shot. ``JOINTRL_CAD_BUILD=cold`` turns the builder off (:func:`shared_builder` returns
None); ``tests/bench/bench_cad.py`` compares both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import threading
import time
from typing import Any

from jointrl.envs.base import EnvError
from jointrl.envs.cad.interpreter import RUNNER_MOUNT, CadConfig, built_part, timed_out_summary
from jointrl.envs.cad.sandbox_runner import SETUP_FAILED
from jointrl.envs.sandbox.bwrap import BwrapSandbox
from jointrl.envs.sandbox.bwrap_proc import read_json_line

_GRACE_S = 90.0  # past a build's own timeout (removing earlier job folders first), before the server counts as stuck


class CadBuilder:
    """A sandbox hosting one warm CadQuery process that forks each build; thread-safe (one build at a time)."""

    def __init__(self, cad: CadConfig | None = None, max_builds: int = 500) -> None:
        if max_builds < 1:
            raise ValueError(f"max_builds must be >= 1, got {max_builds}")
        self.cad = cad or CadConfig()
        self.max_builds = max_builds
        self._lock = threading.Lock()
        self._sandbox: BwrapSandbox | None = None
        self._proc: subprocess.Popen | None = None
        self._fds: tuple[int, ...] = ()
        self._buffer = b""
        self.builds = 0  # by the current sandbox
        self.starts = 0  # sandboxes (CadQuery imports) so far

    def build(self, code: str) -> tuple[bytes | None, dict[str, Any]]:
        """What ``interpreter.build_stl`` returns for ``code``: ``(binary STL or None, summary)``.
        Raises ``EnvError`` when the server fails (then the caller builds one-shot)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None or self.builds >= self.max_builds:
                self._restart()
            sandbox = self._sandbox
            assert sandbox is not None
            job = f"job-{secrets.token_hex(8)}"
            sandbox.write_file(f"{job}/part.py", code)
            self.builds += 1
            limits = sandbox.config
            done = self._request({"op": "build", "job": job, "timeout": self.cad.build_timeout_s,
                                  "nproc": limits.max_processes, "disk": limits.max_disk_bytes or 1 << 30},
                                 self.cad.build_timeout_s + _GRACE_S)
            if done.get("timed_out"):
                return None, timed_out_summary(self.cad)
            if done.get("exit") == SETUP_FAILED:
                self._stop()
                raise EnvError("the warm CAD builder could not set up a build")
            try:
                try:  # past the one-shot path's stdout cap it has no summary either
                    text = sandbox.read_file(f"{job}/summary.json")
                    summary = json.loads(text) if len(text) <= limits.max_output_bytes else None
                except (FileNotFoundError, ValueError, RecursionError):
                    summary = None
                return built_part(sandbox, summary, f"the build died (exit {done.get('exit')})", f"{job}/part.stl")
            except OSError as e:  # e.g. a file the build made unreadable: let the one-shot path judge it
                self._stop()
                raise EnvError(f"the warm CAD builder's output is unreadable: {e}") from e

    def _request(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdin is not None
        nonce = secrets.token_hex(8)
        try:
            self._proc.stdin.write(json.dumps({**request, "nonce": nonce}).encode() + b"\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: the read below sees the end of its pipe
        reply = self._read(time.monotonic() + timeout)
        if not isinstance(reply, dict) or reply.get("nonce") != nonce or not reply.get("ok"):
            self._stop()
            why = "timed out" if reply is False else f"failed ({reply!r:.200})"
            raise EnvError(f"the warm CAD builder {why} on {request['op']!r}")
        return reply

    def _restart(self) -> None:
        self._stop()
        config = dataclasses.replace(self.cad.sandbox_config(), nested_userns=True)
        self._sandbox = BwrapSandbox(config, env=self.cad.env, shell=False)
        reply_r, reply_w = os.pipe()
        try:
            self._proc, status_r = self._sandbox.start_process(
                [self.cad.python, "-I", RUNNER_MOUNT, "forkserve", str(reply_w)], fds=(reply_w,))
        except BaseException:
            os.close(reply_r)
            self._stop()
            raise
        finally:
            os.close(reply_w)
        self._fds, self._buffer, self.builds = (reply_r, status_r), b"", 0
        self.starts += 1
        ready = self._read(time.monotonic() + self.cad.start_timeout_s)
        if not isinstance(ready, dict) or not ready.get("ready"):
            self._stop()
            why = ready.get("error") if isinstance(ready, dict) else "timed out" if ready is False else "died"
            raise EnvError(f"the warm CAD builder did not start: {why}")

    def _read(self, deadline: float) -> dict | bool | None:
        """The server's next JSON line; False at the deadline; None at the pipe's end or garbage."""
        reply, self._buffer = read_json_line(self._fds[0], self._buffer, deadline, 1 << 16, 1 << 16)
        return reply

    def _stop(self) -> None:
        """Close the sandbox (every process in it) and our pipe ends. Idempotent."""
        sandbox, proc, fds = self._sandbox, self._proc, self._fds
        self._sandbox, self._proc, self._fds, self._buffer = None, None, (), b""
        if sandbox is not None:
            sandbox.close()
        if proc is not None:
            proc.wait()
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if f is not None:
                    f.close()
        for fd in fds:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            self._stop()


_SHARED: CadBuilder | None = None
_SHARED_LOCK = threading.Lock()


def shared_builder() -> CadBuilder | None:
    """This process's builder (one per env worker), started on first use; None when
    ``JOINTRL_CAD_BUILD=cold``, or without bubblewrap or the CAD tool venv (then rewards build one-shot)."""
    global _SHARED
    if os.environ.get("JOINTRL_CAD_BUILD", "warm") == "cold":
        return None
    with _SHARED_LOCK:
        if _SHARED is None:
            if shutil.which("bwrap") is None or not os.path.isfile(CadConfig().python):
                return None
            _SHARED = CadBuilder()
        return _SHARED
