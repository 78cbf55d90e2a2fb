"""One warm CadQuery builder per env-worker process: the reward's rebuild without an import per part.

``cad_iou`` / ``cad_chamfer`` rebuild each submission in a fresh process (``build_stl``), and 2 of
its ~2.3 CPU-s go to importing CadQuery (OCP and VTK). A :class:`CadBuilder` keeps one process that
has imported it, in a bwrap sandbox of its own that no policy gets a command in
(``sandbox_runner.py forkserve``), and forks it once per build: ~0.2 CPU-s a part.

Reward integrity (docs/architecture.md) -- what a fork of a warm process may and may not carry:

- **Each build gets namespaces of its own** (user, mount, pid, IPC, network, UTS), entered before
  any model code runs: a fresh tmpfs as ``/work`` holding a copy of ``part.py``, fresh tmpfs on
  ``/tmp`` and ``/dev/shm``, a devpts instance of its own, ``/dev`` read-only, a ``/proc`` showing
  only its own processes (it is pid 1 of its pid namespace: everything it starts dies with it),
  its own session, no capabilities, no new namespaces and no keyring or IPC objects (seccomp), no
  inherited fd. It cannot name, signal, ptrace or ``prlimit`` the server or another build, nor see
  another build's files, sockets or kernel objects.
- **Nothing a build chose reaches the server or the next build.** A trusted process between the
  two copies ``part.stl`` and ``summary.json`` out of the build's ``/work`` (regular files, capped)
  into the job folder on the server's ``/work``, where the host reads them and then deletes the
  folder; that folder only ever holds those files and ``part.py``. Each request is handled in a
  fork of the server (it removes earlier job folders, times the build, replies), so the server --
  what every build is forked from -- never holds a submission, an outcome, a mesh or a file name;
  it is not dumpable, serves one build at a time (a lock) and SIGKILLs whatever is left after each.
- **What is still shared**: the read-only view; the sandbox's memory and pids cgroups (a build that
  exhausts them fails, as it would one-shot); CPU time; and one counter, accepted: a build's processes
  use up pid numbers of the server's sandbox too, and the server's heap keeps freed numbers of earlier
  workers, so a later build scanning its own memory could recover up to ~22 bits that an earlier
  build chose -- nothing about any target, which no build ever sees. ``tests/envs/cad/test_builder.py``
  checks the channels three reviews found in earlier versions (bwrap's pid 1, ``prlimit`` on the
  server, file names and outcomes in the server's memory, loopback TCP state, xattrs, the tmpfs inode
  counter, a self-stopping build, a link loop in the outputs); a build filling ``/work`` fills only
  its own tmpfs.
- **Any failure falls back to the one-shot path**: a build whose setup fails, a server that dies,
  times out or answers out of turn raises ``EnvError``, and ``rewards.cad_geometry`` rebuilds that
  submission in its fresh verification sandbox, so the outcome is the one-shot outcome; the builder
  starts afresh on its next build. A self-written STL is an answer like any other (the one-shot
  ``build`` allows the same): the host compares it with the target.
- **Time limits as one-shot**: a one-shot build spends ``build_timeout_s`` on the import and the
  build, so a warm build gets ``build_timeout_s`` less the server's own import time (measured at its
  start). CPU time (RLIMIT_CPU, an hour) starts from zero in both.
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
import threading
import time
from typing import Any

from jointrl.envs.base import EnvError
from jointrl.envs.cad.interpreter import RUNNER_MOUNT, CadConfig, built_part, timed_out_summary
from jointrl.envs.cad.sandbox_runner import SETUP_FAILED
from jointrl.envs.sandbox.server import SandboxServer

_GRACE_S = 30.0  # past a build's own timeout, before the server counts as stuck


class CadBuilder:
    """A sandbox hosting one warm CadQuery process that forks each build; thread-safe (one build at a time)."""

    def __init__(self, cad: CadConfig | None = None, max_builds: int = 500) -> None:
        if max_builds < 1:
            raise ValueError(f"max_builds must be >= 1, got {max_builds}")
        self.cad = cad or CadConfig()
        self.max_builds = max_builds
        self._lock = threading.Lock()
        self._server = SandboxServer("the warm CAD builder", 1 << 16)
        self.builds = 0  # by the current sandbox
        self._timeout = self.cad.build_timeout_s  # the build's share of it: minus the server's import

    @property
    def starts(self) -> int:
        """Sandboxes (CadQuery imports) so far."""
        return self._server.starts

    def build(self, code: str) -> tuple[bytes | None, dict[str, Any]]:
        """What ``interpreter.build_stl`` returns for ``code``: ``(binary STL or None, summary)``.
        Raises ``EnvError`` when the server fails (then the caller builds one-shot)."""
        with self._lock:
            server = self._server
            if not server.alive or self.builds >= self.max_builds:
                config = dataclasses.replace(self.cad.sandbox_config(), nested_userns=True)
                ready = server.start(config, self.cad.env, [self.cad.python, "-I", RUNNER_MOUNT, "forkserve"],
                                     self.cad.start_timeout_s)
                # A one-shot build spends its import inside build_timeout_s: so does a warm one.
                self._timeout = max(0.1, self.cad.build_timeout_s - float(ready.get("import_s", 0.0)))
                self.builds = 0
            sandbox = server.sandbox
            assert sandbox is not None
            job = f"job-{secrets.token_hex(8)}"
            limits, nonce = sandbox.config, secrets.token_hex(8)
            try:
                sandbox.write_file(f"{job}/part.py", code)
            except OSError as e:  # its /work full or broken: a fresh sandbox next time
                server.stop()
                raise EnvError(f"the warm CAD builder cannot take a build: {e}") from e
            self.builds += 1
            server.send({"op": "build", "job": job, "timeout": self._timeout, "nonce": nonce,
                         "nproc": limits.max_processes, "disk": limits.max_disk_bytes or 1 << 30,
                         "summary_limit": limits.max_output_bytes})
            done = server.read(time.monotonic() + self.cad.build_timeout_s + _GRACE_S)
            if not isinstance(done, dict) or done.get("nonce") != nonce or not done.get("ok"):
                server.stop()
                why = "timed out" if done is False else f"failed ({done!r:.200})"
                raise EnvError(f"the warm CAD builder {why}")
            try:
                if done.get("timed_out"):
                    return None, timed_out_summary(self.cad)
                if done.get("exit") == SETUP_FAILED:
                    server.stop()
                    raise EnvError("the warm CAD builder could not set up a build")
                try:  # the server copied it only under the one-shot path's stdout cap: past it, no summary
                    summary = json.loads(sandbox.read_file(f"{job}/summary.json"))
                except (FileNotFoundError, ValueError, RecursionError):
                    summary = None
                return built_part(sandbox, summary, f"the build died (exit {done.get('exit')})", f"{job}/part.stl")
            except OSError as e:
                server.stop()
                raise EnvError(f"the warm CAD builder's output is unreadable: {e}") from e
            finally:
                shutil.rmtree(sandbox.workdir / job, ignore_errors=True)  # three files of the server's, no more

    def close(self) -> None:
        with self._lock:
            self._server.stop()


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
