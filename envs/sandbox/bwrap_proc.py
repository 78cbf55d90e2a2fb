"""Starting a bwrap process and reading it to its end: the host side of one sandboxed command.

``spawn`` starts bwrap as the sandbox's uid (root mode; rootless: as ourselves), blocked on
``--block-fd``: it moves bwrap and its child (the sandbox's pid 1) into the sandbox's cgroup, then lets it go, so no process of the
sandbox ever runs outside the cgroup. bwrap reports on its ``--json-status-fd``: first the
child's pid, at the end the command's exit code (``parse_status``). ``pump`` reads a command's
streams to their end, capped, killing everything at the deadline.

``--die-with-parent`` ties a sandbox to the *thread* that spawned it: long-lived processes
(persistent shells, a browser driver) are spawned by ``SPAWNER``, one thread that lives as
long as the process (asyncio.to_thread's workers may not).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from jointrl.envs.sandbox.cgroups import Cgroup
from jointrl.envs.sandbox.output import Capped

START_TIMEOUT_S = 15.0  # bwrap must report its child's pid within this
KILL_GRACE_S = 5.0  # after a timeout kill, how long to wait for the pipes to close
SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jointrl-shell-spawner")


def spawn(make_argv: Callable[[int, int], list[str]], *, uid: int | None, cgroup: Cgroup | None, stdin: int,
          fds: tuple[int, ...] = (), on_child: Callable[[int], None] | None = None,
          ) -> tuple[subprocess.Popen, int, bytes, int]:
    """Start bwrap as ``uid`` (None: as ourselves) with ``make_argv(status_fd, block_fd)``, move it
    into ``cgroup``, let it go. ``on_child(pid)`` runs while the sandbox's pid 1 is still blocked
    (it cannot have exited: a pidfd opened then is its own).

    Returns (process, read end of the json status pipe, what was read of it, the sandbox's pid 1);
    the caller reads the command's exit code from that pipe and closes it.
    """
    status_r, status_w = os.pipe()
    block_r, block_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [*(_as_uid(uid) if uid is not None else []), *make_argv(status_w, block_r)], stdin=stdin, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, pass_fds=(status_w, block_r, *fds),
            start_new_session=True,  # our own process group, killed as a whole on timeout
            env={"PATH": "/usr/bin:/bin"},
        )
    except BaseException:
        for fd in (status_r, status_w, block_r, block_w):
            os.close(fd)
        raise
    os.close(status_w)
    os.close(block_r)
    try:
        if cgroup is not None:
            # Moved at once: the first move into a v1 cgroup waits for an RCU grace period
            # (milliseconds), which then overlaps bwrap's own setup instead of following it.
            _add_or_report(cgroup, proc)
        status = _read_first_status(status_r, time.monotonic() + START_TIMEOUT_S)
        child = parse_status(status).get("child-pid")
        if child is None:
            raise OSError(f"bwrap did not start (exit {proc.poll()}): {proc.stderr.read1(4096)!r}")
        if cgroup is not None:
            cgroup.add(child)  # bwrap may have cloned it before its own move
        if on_child is not None:
            on_child(child)
        os.write(block_w, b"go")
    except BaseException:
        os.close(status_r)
        kill_proc(proc)
        raise
    finally:
        os.close(block_w)
    return proc, status_r, status, child


def _as_uid(uid: int) -> list[str]:
    """``setpriv`` switching to ``uid`` (its own group, no supplementary ones, no capabilities left).

    Not ``Popen(user=...)``: that makes Python ``fork()`` (``vfork`` is unsafe across a uid
    change), whose cost grows with the caller's memory: 55 ms per start in a process the size
    of an env worker (torch + Ray imported, 264 MB) against 15 ms for a ``vfork`` + this exec,
    at the same load (load average 10).
    """
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


def pump(proc: subprocess.Popen, streams: dict[int, Capped], status: Capped, deadline: float,
         kill_others: Callable[[], None]) -> bool:
    """Read every stream to EOF; at ``deadline`` kill bwrap, its pid 1 and (``kill_others``) the rest.

    Returns whether it timed out. ``status`` (one of ``streams``) is bwrap's status pipe.
    """
    sel = selectors.DefaultSelector()
    for fd in streams:
        sel.register(fd, selectors.EVENT_READ)
    timed_out, grace_end = False, 0.0
    try:
        while sel.get_map():
            now = time.monotonic()
            if not timed_out and now >= deadline:
                timed_out, grace_end = True, now + KILL_GRACE_S
                kill_proc(proc, parse_status(bytes(status.data)).get("child-pid"), wait=False)
                kill_others()
            if timed_out and now >= grace_end:
                break  # something still holds the pipes open; the uid sweep after the exec gets it
            for key, _ in sel.select(timeout=max(0.0, (grace_end if timed_out else deadline) - now)):
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    streams[key.fd].add(chunk)
                else:
                    sel.unregister(key.fd)
    finally:
        sel.close()
    return timed_out


def kill_proc(proc: subprocess.Popen, child_pid: int | None = None, *, wait: bool = True) -> None:
    """SIGKILL bwrap's process group and the sandbox's pid 1 (ending its pid namespace)."""
    for kill, target in ((os.killpg, proc.pid), (os.kill, child_pid)):
        if target:
            try:
                kill(target, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if wait:
        proc.wait()


def parse_status(raw: bytes) -> dict[str, int]:
    """Merge bwrap's ``--json-status-fd`` documents (one per line) that arrived completely."""
    merged: dict[str, int] = {}
    for line in raw.split(b"\n")[:-1]:  # the last piece is empty or an incomplete document
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        merged.update({k: v for k, v in doc.items() if k in ("child-pid", "exit-code")})
    return merged


def _add_or_report(cgroup: Cgroup, proc: subprocess.Popen) -> None:
    """Move bwrap into ``cgroup``; if it already died, say why it did (its stderr) instead."""
    try:
        cgroup.add(proc.pid)
    except OSError as e:
        if proc.poll() is None:
            raise
        raise OSError(f"bwrap did not start (exit {proc.returncode}): {proc.stderr.read1(4096)!r}") from e


def _read_first_status(fd: int, deadline: float) -> bytes:
    """Read bwrap's json status until its first document (the child's pid) is complete."""
    buf = b""
    while b"\n" not in buf:
        now = time.monotonic()
        sel = selectors.DefaultSelector()
        sel.register(fd, selectors.EVENT_READ)
        try:
            ready = sel.select(timeout=max(0.0, deadline - now))
        finally:
            sel.close()
        if not ready:
            raise OSError("bwrap did not report its child within the start timeout")
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    return buf


def read_json_line(fd: int, buffer: bytes, deadline: float, max_bytes: int,
                   chunk: int = 1 << 16) -> tuple[dict | bool | None, bytes]:
    """The next JSON object (one per line) a sandboxed server writes on pipe ``fd``, reading past
    ``buffer`` (what earlier calls read beyond their line) → (reply, the new buffer). The reply is
    False at ``deadline`` (``time.monotonic()``), None at the pipe's end, past ``max_bytes``
    buffered, or for a line that is not a JSON object: the caller's server is then not to be
    trusted and is restarted. Never blocks past the deadline."""
    while b"\n" not in buffer:
        now = time.monotonic()
        if now >= deadline:
            return False, buffer
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            if not sel.select(timeout=deadline - now):
                return False, buffer
        data = os.read(fd, chunk)
        if not data or len(buffer) > max_bytes:
            return None, buffer
        buffer += data
    line, buffer = buffer.split(b"\n", 1)
    try:
        reply = json.loads(line)
    except ValueError:
        return None, buffer
    return (reply if isinstance(reply, dict) else None), buffer
