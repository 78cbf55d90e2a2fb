"""One warm LibreOffice per env-worker process: workbook recalculation without a start per call.

Before this module every recalculation (a read after an edit, and the checker's pass over every
workbook) started a headless LibreOffice in the sandbox at hand, 1-8 s each. A
:class:`RecalcServer` keeps one running instead, in a bwrap sandbox of its own that no policy ever
gets a command in: ``tool/recalc_server.py`` (Debian's Python with ``python3-uno``) drives a
headless ``soffice`` over a private UNO pipe. :meth:`RecalcServer.recalc` takes a workbook's
bytes and returns them recalculated (``calculateAll``, saved by LibreOffice, so every formula
carries its computed value): ~0.05-0.2 s instead of a start.

Reward integrity (docs/architecture.md) -- what the warm process may and may not carry:

- **It never runs policy code.** A policy reaches it only through a workbook's content, which it
  wrote through ``edit_document`` (openpyxl: cell values and formulas, no macros, no raw bytes).
  Documents load with ``MacroExecutionMode=NEVER_EXECUTE`` and ``UpdateDocMode=NO_UPDATE``, and the
  profile disables macros and link updates; the sandbox has no network (``WEBSERVICE`` fails).
- **No document outlives its request.** One request at a time (a lock); each workbook goes to
  ``/work/<random name>/`` and that folder is deleted before the reply, so a formula naming another
  file (an external reference) finds no other episode's workbook; each document is closed after use.
- **Bounded lifetime.** The sandbox (LibreOffice, its profile, its ``/tmp``) is thrown away and
  started anew after ``max_jobs`` recalculations, after any timeout or crash, and on ``close``.
- **The checker still reads facts in a fresh verification sandbox** (``rewards/office_checks.py``):
  the workbooks of the episode's final snapshot are recalculated here and written back into that
  sandbox, then ``office_tool.py facts`` reads them there, as before.

What it does not guard against: a LibreOffice bug that a crafted formula could exploit to keep state
inside ``soffice`` across documents (the same engine and the same inputs as the one-shot path, but
a process shared by up to ``max_jobs`` documents instead of one).

``JOINTRL_OFFICE_RECALC=cold`` turns it off (:func:`shared_server` returns None: every recalculation
starts LibreOffice in the sandbox at hand, the old path; ``tests/bench/bench_office.py`` compares both).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import os
import secrets
import shutil
import subprocess
import threading
import time
from pathlib import Path

from jointrl.envs.base import EnvError
from jointrl.envs.sandbox.base import SandboxConfig
from jointrl.envs.sandbox.server import SandboxServer

SERVER = Path(__file__).parent / "tool" / "recalc_server.py"
SERVER_MOUNT = "/opt/jointrl-office-recalc/recalc_server.py"
PYTHON = "/usr/bin/python3"  # Debian's, for python3-uno (the tool venv does not see it)
_MAX_REPLY_BYTES = 256 << 20


@functools.cache
def available() -> bool:
    """Whether this host can run the server: bubblewrap, LibreOffice and Debian's Python with the UNO
    bridge (``python3-uno``, ``.ci/setup.d/office.sh``)."""
    if shutil.which("bwrap") is None or shutil.which("soffice") is None or not Path(PYTHON).is_file():
        return False
    return subprocess.run([PYTHON, "-I", "-c", "import uno"], capture_output=True).returncode == 0


@dataclasses.dataclass(frozen=True, slots=True)
class RecalcConfig:
    """``max_jobs``: recalculations before the sandbox is replaced; ``call_timeout_s`` one
    recalculation (past it the sandbox is replaced and ``EnvError`` raised); ``start_timeout_s``
    LibreOffice's start."""

    max_jobs: int = 200
    call_timeout_s: float = 120.0
    start_timeout_s: float = 180.0
    max_memory_bytes: int = 2 << 30

    def sandbox_config(self) -> SandboxConfig:
        # RLIMIT_CPU is per process: soffice lives max_jobs recalculations, so give it the time of all of them.
        return SandboxConfig(timeout_s=self.call_timeout_s, max_memory_bytes=self.max_memory_bytes,
                             cpu_seconds=int(self.max_jobs * self.call_timeout_s), max_processes=64,
                             max_output_bytes=1 << 16, ro_binds={str(SERVER): SERVER_MOUNT})


class RecalcServer:
    """A sandbox hosting one warm LibreOffice; thread-safe (one recalculation at a time)."""

    def __init__(self, config: RecalcConfig | None = None) -> None:
        self.config = config or RecalcConfig()
        self._lock = threading.Lock()
        self._server = SandboxServer("the warm LibreOffice", _MAX_REPLY_BYTES, 1 << 20)
        self.jobs = 0  # recalculations by the current sandbox

    @property
    def starts(self) -> int:
        """Sandboxes (LibreOffice starts) so far."""
        return self._server.starts

    def recalc(self, data: bytes) -> bytes:
        """``data`` (an .xlsx) with every formula recalculated by LibreOffice. ``ValueError`` when
        LibreOffice cannot open it (the document's fault); ``EnvError`` when the server fails."""
        with self._lock:
            server = self._server
            if not server.alive or self.jobs >= self.config.max_jobs:
                server.start(self.config.sandbox_config(), {"HOME": "/tmp"}, [PYTHON, "-I", SERVER_MOUNT, "serve"],
                             self.config.start_timeout_s)
                self.jobs = 0
            assert server.sandbox is not None
            job = f"job-{secrets.token_hex(8)}"
            server.sandbox.write_file(f"{job}/in.xlsx", data)
            self.jobs += 1
            server.send({"job": job})
            reply = server.read(time.monotonic() + self.config.call_timeout_s)
            if not isinstance(reply, dict) or "ok" not in reply:
                server.stop()
                why = "timed out" if reply is False else "died"
                raise EnvError(f"the warm LibreOffice {why} recalculating a workbook")
            if not reply["ok"]:
                if "soffice exited" in reply["error"]:
                    server.stop()
                    raise EnvError(f"the warm LibreOffice failed: {reply['error']}")
                raise ValueError(f"LibreOffice cannot recalculate the workbook: {reply['error']}")
            return base64.b64decode(reply["data"])

    def close(self) -> None:
        with self._lock:
            self._server.stop()


_SHARED: RecalcServer | None = None
_SHARED_LOCK = threading.Lock()


def shared_server() -> RecalcServer | None:
    """This process's server (one per env worker), started on first use; None when
    ``JOINTRL_OFFICE_RECALC=cold`` or ``python3-uno`` is missing (then the tools recalculate in place)."""
    global _SHARED
    if os.environ.get("JOINTRL_OFFICE_RECALC", "warm") == "cold":
        return None
    with _SHARED_LOCK:
        if _SHARED is None:
            if not available():
                return None
            _SHARED = RecalcServer()
        return _SHARED
