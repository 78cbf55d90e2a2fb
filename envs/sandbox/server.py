"""A long-lived helper process in a bwrap sandbox of its own, answering JSON lines on a pipe.

The plumbing shared by the warm servers that rewards and tools keep per env-worker process (the
office recalculation server, ``envs/office/recalc.py``; the CAD reward builder, ``envs/cad/builder.py``):
start the process in a fresh sandbox with a reply pipe of its own, wait for its ``ready`` line,
send requests on its stdin, read one JSON object per line back with a deadline, and throw the
whole sandbox away on ``stop``. What the process does and which requests it takes is the caller's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from jointrl.envs.base import EnvError
from jointrl.envs.sandbox.base import SandboxConfig
from jointrl.envs.sandbox.bwrap import BwrapSandbox
from jointrl.envs.sandbox.bwrap_proc import read_json_line


class SandboxServer:
    """One server process in its own sandbox; not thread-safe (callers hold a lock around its use).

    ``argv`` is the command, to which the reply pipe's fd number is appended; the process must write
    ``{"ready": true}`` (or ``{"error": ...}``) on that fd first, then one JSON object per request.
    """

    def __init__(self, name: str, max_reply_bytes: int, chunk: int = 1 << 16) -> None:
        self.name = name  # for error messages ("the warm LibreOffice")
        self.max_reply_bytes, self.chunk = max_reply_bytes, chunk
        self.sandbox: BwrapSandbox | None = None
        self._proc: subprocess.Popen | None = None
        self._fds: tuple[int, ...] = ()
        self._buffer = b""
        self.starts = 0  # sandboxes started so far

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, config: SandboxConfig, env: dict[str, str], argv: list[str], timeout_s: float) -> dict:
        """Stop any running one, start afresh and wait for ``ready``; returns that line. Raises ``EnvError``.
        A process found dead is reported on stderr (its exit code and the end of what it wrote there)."""
        if self._proc is not None and self._proc.poll() is not None:
            print(f"{self.name}: the server had exited ({self._death_note()}); starting a new one",
                  file=sys.stderr, flush=True)
        self.stop()
        self.sandbox = BwrapSandbox(config, env=env, shell=False)
        reply_r, reply_w = os.pipe()
        try:
            self._proc, status_r = self.sandbox.start_process([*argv, str(reply_w)], fds=(reply_w,))
        except BaseException:
            os.close(reply_r)
            self.stop()
            raise
        finally:
            os.close(reply_w)
        self._fds, self._buffer = (reply_r, status_r), b""  # status_r stays open: bwrap writes its exit code there
        self.starts += 1
        ready = self.read(time.monotonic() + timeout_s)
        if not isinstance(ready, dict) or not ready.get("ready"):
            self.stop()
            why = ready.get("error") if isinstance(ready, dict) else "timed out" if ready is False else "died"
            raise EnvError(f"{self.name} did not start: {why}")
        return ready

    def _death_note(self) -> str:
        assert self._proc is not None and self._proc.stderr is not None
        os.set_blocking(self._proc.stderr.fileno(), False)
        tail = (self._proc.stderr.read() or b"")[-1500:].decode(errors="replace").strip()
        return f"exit {self._proc.returncode}" + (f": {tail}" if tail else "")

    def send(self, request: dict[str, Any]) -> None:
        """Write one request line (a dead process shows as the end of its pipe on the next ``read``)."""
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass

    def read(self, deadline: float) -> dict | bool | None:
        """The next JSON line; False at the deadline; None at the pipe's end or garbage (``read_json_line``)."""
        reply, self._buffer = read_json_line(self._fds[0], self._buffer, deadline, self.max_reply_bytes, self.chunk)
        return reply

    def stop(self) -> None:
        """Close the sandbox (every process in it) and our pipe ends. Idempotent."""
        sandbox, proc, fds = self.sandbox, self._proc, self._fds
        self.sandbox, self._proc, self._fds, self._buffer = None, None, (), b""
        if sandbox is not None:
            sandbox.close()
        if proc is not None:
            proc.wait()
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if f is not None:
                    f.close()
        for fd in fds:
            os.close(fd)
