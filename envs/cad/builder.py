"""One warm CadQuery builder per env-worker process: the reward's rebuild without an import per part.

``cad_iou`` / ``cad_chamfer`` rebuild each submission in a fresh process (``build_stl``), and 2 of
its ~2.3 s go to importing CadQuery (OCP and VTK). A :class:`CadBuilder` keeps one process that
has imported it, in a bwrap sandbox of its own that no policy gets a command in
(``sandbox_runner.py forkserve``), and forks it once per build: ~0.1-0.3 s a part.

Reward integrity (docs/architecture.md) -- what a fork of a warm process may and may not carry:

- **The server never runs or reads model code.** The host writes the submission to
  ``/work/part.py``; the forked build reads it, and writes ``/work/part.stl`` and
  ``/work/summary.json``, which the host reads. The server only forks, waits and cleans, so its
  memory -- what every build is a copy of -- holds no earlier submission, output or mesh.
- **No build can reach the server or a later build.** One build at a time (a lock). Before each,
  the server SIGKILLs every other process of its sandbox and empties ``/work`` and ``/tmp`` (the
  only writable dirs); after each, it SIGKILLs every process the build left. The build closes
  every inherited fd (the server's request and reply pipes) before it reads the code, and the
  server is not dumpable, so a build cannot ptrace it or open its ``/proc`` files.
- **What a build can still do**, and what follows: signal or stop the server (same uid), exhaust
  the sandbox's memory or pids, or write any STL or summary of its own. A dead, stopped or
  misbehaving server raises ``EnvError`` and :func:`rewards.cad_geometry` rebuilds that submission
  one-shot in its fresh verification sandbox, as without the builder, so the outcome is the one-shot
  outcome; the builder starts afresh on its next build. A self-written STL is an answer like any
  other: the host compares it with the target (the one-shot ``build`` allows the same).
- **Bounded lifetime**: the sandbox is replaced after ``max_builds`` builds, any failure, and ``close``.

``JOINTRL_CAD_BUILD=cold`` turns it off (:func:`shared_builder` returns None: every reward build is
one-shot in the verification sandbox, the old path; ``tests/bench/bench_cad.py`` compares both).
"""

from __future__ import annotations

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

_RESET_TIMEOUT_S = 60.0  # ending a build's processes and emptying /work and /tmp
_GRACE_S = 30.0  # past a build's own timeout, before the server counts as stuck


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
            self._request({"op": "reset"}, _RESET_TIMEOUT_S)
            sandbox.write_file("part.py", code)
            self.builds += 1
            done = self._request({"op": "build", "timeout": self.cad.build_timeout_s},
                                 self.cad.build_timeout_s + _GRACE_S)
            if done.get("timed_out"):
                return None, timed_out_summary(self.cad)
            if done.get("exit") == SETUP_FAILED:
                self._stop()
                raise EnvError("the warm CAD builder could not set up a build")
            try:
                try:  # past the one-shot path's stdout cap it has no summary either
                    too_big = done.get("summary_bytes", 0) > self.cad.sandbox_config().max_output_bytes
                    summary = None if too_big else json.loads(sandbox.read_file("summary.json"))
                except (FileNotFoundError, ValueError):
                    summary = None
                return built_part(sandbox, summary, f"the build died (exit {done.get('exit')})")
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
        self._sandbox = BwrapSandbox(self.cad.sandbox_config(), env=self.cad.env, shell=False)
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
