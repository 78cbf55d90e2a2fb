"""A persistent shell: one ``bash`` per episode, so cwd and environment persist across commands.

The sandbox backend starts the process (``bash --noprofile --norc`` reading its script from a
pipe, stdout/stderr on pipes, one extra *control* pipe) and gives it to ``PersistentShell``
with two callbacks: ``kill_others`` (SIGKILL every process of the sandbox but the shell) and
``kill_all``. Per command the host writes::

    IFS= read -r -d '' __jrl_c        # the shell reads the command text up to a NUL ...
    <command>\\0                       # ... so no quoting of the command is ever needed
    { eval "$__jrl_c"
    } </dev/null 60>&- 61>&- 62>&-; <report status, cwd and `export -p` on the control fd>

and reads stdout / stderr up to an unguessable per-command marker and the status from the
control fd (which the command itself cannot write: it is closed for it). Semantics:

- cwd, shell variables, functions and exported variables persist, as in one terminal;
- background processes do **not** outlive the command: once it returns, every process of
  the sandbox but the shell is killed (their stray output after the marker is discarded);
- each command has its own timeout: at the deadline every process but the shell is killed,
  which ends a foreground child (`sleep`, a pipeline, a subshell) and keeps the shell and its
  state. A command that keeps *the shell itself* busy (a builtin loop such as
  ``while :; do :; done``) cannot be stopped that way: then the whole shell is killed and
  ``ExecResult.shell_restarted`` is set; the next command starts a new shell in the last
  known cwd with the last known exported variables (shell-only variables and functions are
  lost). The same happens when a command ends the shell (``exit 3``, ``exec prog``): its
  exit code is reported and the next command gets a new shell.
"""

from __future__ import annotations

import os
import secrets
import selectors
import shlex
import subprocess
import time
from collections.abc import Callable

from jointrl.envs.sandbox.base import ExecResult
from jointrl.envs.sandbox.output import Marked

TIMEOUT_EXIT_CODE = 124
_START_TIMEOUT_S = 15.0
_STUCK_GRACE_S = 0.5  # after killing the children, how long the shell may take to report
_EXIT_GRACE_S = 5.0  # after the shell ended, how long the sandbox process may take to exit
_MAX_STATE_BYTES = 1 << 20  # a larger cwd + environment dump is not kept for a restart

# -> (process, our control fd, its number in the shell, other fds of ours to close with the shell)
Spawn = Callable[[], tuple[subprocess.Popen, int, int, tuple[int, ...]]]


class PersistentShell:
    """One long-lived ``bash`` in a sandbox. Not thread-safe: the sandbox serializes calls.

    ``spawn`` starts a fresh shell process and returns it with the read end of its control
    pipe and that pipe's fd number *inside* the shell.
    """

    def __init__(self, spawn: Spawn, kill_others: Callable[[], None], kill_all: Callable[[], None],
                 max_output_bytes: int) -> None:
        self._spawn, self.ctl_fd = spawn, -1
        self._kill_others, self._kill_all = kill_others, kill_all
        self.max_output_bytes = max_output_bytes
        self.proc: subprocess.Popen | None = None
        self._ctl, self._extra_fds = -1, ()
        self.cwd, self.env_dump = "/work", b""
        self.restarts = 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start a shell (restoring the last cwd and exported variables). Raises ``OSError`` on failure."""
        self.stop()
        self.proc, self._ctl, self.ctl_fd, self._extra_fds = self._spawn()
        restore = b""
        if self.env_dump:
            restore = self.env_dump + b"\n"
        # Fixed high fds, whatever numbers the pipes got: 60 control, 61/62 the real stdout/stderr.
        move = "" if self.ctl_fd == 60 else f"60>&{self.ctl_fd} {self.ctl_fd}>&- "
        script = (f"exec {move}61>&1 62>&2\n".encode() + restore
                  + f"cd -- {shlex.quote(self.cwd)} 2>/dev/null || cd /work\n".encode()
                  + b"printf 'ready\\0' >&60\n")
        self._write(script)
        got = self._read_ctl_until(b"ready\0", time.monotonic() + _START_TIMEOUT_S)
        if not got:
            code = self.proc.poll()
            self.stop()
            raise OSError(f"the sandbox shell did not start (exit {code})")

    def run(self, cmd: str, timeout: float) -> ExecResult:
        if not self.alive:
            if self.proc is not None:
                self.restarts += 1
            self.start()
        self._drain()
        token = secrets.token_hex(16)
        marker = b"\x1e" + token.encode() + b"\n"  # printf's \036
        script = (
            b"IFS= read -r -d '' __jrl_c\n" + cmd.encode() + b"\0"
            + f'{{ eval "$__jrl_c"\n}} </dev/null 60>&- 61>&- 62>&-; __jrl_rc=$?; disown -a; '
              f"printf '\\036{token}\\n' >&61; printf '\\036{token}\\n' >&62; "
              f"{{ printf '{token} %d\\0' \"$__jrl_rc\"; pwd; printf '\\0'; export -p; printf '\\0'; }} >&60\n".encode()
        )
        out, err = Marked(self.max_output_bytes, marker), Marked(self.max_output_bytes, marker)
        ctl = bytearray()
        try:
            self._write(script)
        except OSError:  # the shell died while idle (e.g. RLIMIT_CPU): one fresh try
            self.restarts += 1
            self.start()
            self._write(script)
        done = self._pump(out, err, ctl, token, time.monotonic() + timeout)
        # A closed control pipe means the shell itself ended (``exit 3``): not a timeout, even if
        # the sandbox process is still tearing down when we look.
        timed_out = done is False and self.alive
        if timed_out:
            self._kill_others()  # ends a foreground child; the shell then reports
            done = self._pump(out, err, ctl, token, time.monotonic() + _STUCK_GRACE_S)
        self._kill_others()  # background processes never outlive their command
        truncated = bool(out.dropped or err.dropped)
        if done is True:
            code = self._parse_state(ctl, token)
            if timed_out:
                return ExecResult(out.text(), err.text(), TIMEOUT_EXIT_CODE, True, truncated)
            return ExecResult(out.text(), err.text(), code, False, truncated)
        # The shell is gone (the command ended it) or stuck in a builtin: kill it, restart lazily.
        if done is None:  # the shell ended: give the sandbox a moment to exit with its code
            try:
                self.proc.wait(timeout=_EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        if self.alive:
            self._kill_all()
        code = self.proc.wait()
        out.flush()
        err.flush()
        result = ExecResult(out.text(), err.text(), TIMEOUT_EXIT_CODE if timed_out else code, timed_out,
                            truncated, shell_restarted=True)
        self.stop()
        return result

    def _pump(self, out: Marked, err: Marked, ctl: bytearray, token: str, deadline: float) -> bool | None:
        """Read until both markers and the full status arrived (True), the deadline (False), or
        the shell ended (None: its control pipe closed before the status was complete)."""
        assert self.proc is not None
        streams = {self.proc.stdout.fileno(): out, self.proc.stderr.fileno(): err}
        sel = selectors.DefaultSelector()
        for fd in (*streams, self._ctl):
            sel.register(fd, selectors.EVENT_READ)
        prefix = token.encode() + b" "
        shell_gone = False
        try:
            while True:
                if out.seen and err.seen and ctl.startswith(prefix) and ctl.count(b"\0") >= 3:
                    return True
                now = time.monotonic()
                if not sel.get_map() or now >= deadline:
                    return None if shell_gone else False
                for key, _ in sel.select(timeout=deadline - now):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        sel.unregister(key.fd)
                        if key.fd == self._ctl:  # the shell is gone: read what it left, briefly
                            shell_gone = True
                            deadline = min(deadline, time.monotonic() + 1.0)
                    elif key.fd == self._ctl:
                        if len(ctl) < _MAX_STATE_BYTES:
                            ctl += chunk
                    else:
                        streams[key.fd].add(chunk)
        finally:
            sel.close()

    def _parse_state(self, ctl: bytearray, token: str) -> int:
        head, cwd, env, _ = bytes(ctl).split(b"\0", 3)
        code = int(head[len(token) + 1 :])
        self.cwd = cwd.decode(errors="replace").rstrip("\n") or "/work"
        if len(ctl) < _MAX_STATE_BYTES:
            self.env_dump = env
        return code

    def _read_ctl_until(self, want: bytes, deadline: float) -> bool:
        buf = b""
        while want not in buf:
            now = time.monotonic()
            if now >= deadline:
                return False
            sel = selectors.DefaultSelector()
            sel.register(self._ctl, selectors.EVENT_READ)
            try:
                if not sel.select(timeout=deadline - now):
                    return False
            finally:
                sel.close()
            chunk = os.read(self._ctl, 4096)
            if not chunk:
                return False
            buf += chunk
        return True

    def _drain(self) -> None:
        """Discard what a killed background process wrote after the previous marker."""
        assert self.proc is not None
        for f in (self.proc.stdout, self.proc.stderr):
            os.set_blocking(f.fileno(), False)
            try:
                while os.read(f.fileno(), 1 << 16):
                    pass
            except BlockingIOError:
                pass
            finally:
                os.set_blocking(f.fileno(), True)

    def _write(self, data: bytes) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def stop(self) -> None:
        """Kill and reap the shell process (its state stays for the next ``start``). Idempotent."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            self._kill_all()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except OSError:
                pass
        for fd in (self._ctl, *self._extra_fds):
            if fd >= 0:
                os.close(fd)
        self._ctl, self._extra_fds = -1, ()
