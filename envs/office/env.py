"""The office domain: Word, Excel and PowerPoint documents in a sandbox, read and edited by tools.

One ``OfficeEnv`` hosts one episode: ``reset(task)`` opens a bubblewrap sandbox whose ``/work``
holds the task's documents (``files/``); ``list_files``, ``read_document`` and
``edit_document`` each run ``tool/office_tool.py`` there, one-shot, on the read-only tool venv
(``TOOL_VENV``, mounted at the same path; ``.ci/setup.d/office.sh`` makes it), so no document
library runs on the host; ``answer`` ends the episode and its text is ``Episode.final_answer``.
The policy never gets a shell: documents change only through the edit operations.

Workbooks: openpyxl does not compute formulas and drops every cached value when it saves, so
before a workbook edited since its last recalculation is read, the host recalculates it in this
process's warm LibreOffice (``recalc.py``: a sandbox of its own, one start per env worker, not per
call) and writes it back.
Without that server (``JOINTRL_OFFICE_RECALC=cold``, or no ``python3-uno``), ``read_document`` of a
workbook with an uncomputed formula first recalculates it with a headless LibreOffice started in the
episode's sandbox. The checker (``rewards/office_checks.py``) recalculates every workbook of the
final snapshot again (the same server, else in the verification sandbox) before reading it there.

Errors: a malformed call, or one the document refuses (no such sheet, text not found), returns
``Observation(is_error=True)`` and the episode goes on; a sandbox that cannot start or dies,
or LibreOffice failing, raises ``EnvError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import posixpath
import shlex
from pathlib import Path
from typing import Any

from jointrl.envs.base import EnvError, Message, Observation, Task, ToolCall, ToolSpec, refuse
from jointrl.envs.office.recalc import RecalcServer, shared_server
from jointrl.envs.office.tools import MAX_ARGUMENT_CHARS, TOOLS, check_call
from jointrl.envs.sandbox.base import SandboxConfig
from jointrl.envs.sandbox.bwrap import BwrapSandbox
from jointrl.envs.sandbox.pool import SandboxPool
from jointrl.envs.terminal.verifier import FinalFiles

TOOL_DIR = Path(__file__).parent / "tool"
TOOL_MOUNT = "/opt/jointrl-office"
TOOL_VENV = "/opt/jointrl/venvs/office"
VERIFY_TOOL_MOUNT = "/tests"  # a verification sandbox has tool/ as its read-only tests dir (terminal.verifier)
TOOL_TIMEOUT_S = 300.0  # a call that recalculates starts LibreOffice (seconds here, more on a loaded host)
_MAX_OUTPUT = 64 << 10


def office_config(config: SandboxConfig | None = None) -> SandboxConfig:
    """``config`` with the tool script (read-only copy) and the tool venv (read-only bind) mounted.

    Raises ``EnvError`` naming the setup script when the venv is missing.
    """
    if not Path(TOOL_VENV, "bin", "python").exists():
        raise EnvError(f"the office tool venv {TOOL_VENV} is missing: run .ci/setup.d/office.sh")
    c = config or SandboxConfig()
    return dataclasses.replace(c, max_output_bytes=max(c.max_output_bytes, _MAX_OUTPUT),
                               ro_binds={**c.ro_binds, str(TOOL_DIR): TOOL_MOUNT},
                               tool_mounts={**c.tool_mounts, TOOL_VENV: TOOL_VENV})


def tool_command(command: str, args: dict[str, Any], script_dir: str | None = None) -> str:
    """The shell command that runs ``office_tool.py command args`` in ``/work`` of a sandbox."""
    return (f"cd /work && HOME=/tmp {TOOL_VENV}/bin/python -I {script_dir or TOOL_MOUNT}/office_tool.py "
            f"{command} {shlex.quote(json.dumps(args))}")


def run_tool(sandbox: BwrapSandbox, command: str, args: dict[str, Any], timeout_s: float = TOOL_TIMEOUT_S,
             script_dir: str | None = None) -> dict:
    """Run the tool script; its JSON result (``ok``, ``text`` / ``error``). ``EnvError`` if it broke.

    ``script_dir``: where the sandbox has ``tool/`` (default ``TOOL_MOUNT``; ``VERIFY_TOOL_MOUNT`` in a
    verification sandbox).
    """
    try:
        r = sandbox.exec(tool_command(command, args, script_dir), timeout=timeout_s)
    except OSError as e:
        raise EnvError(f"sandbox failed while running office_tool {command}: {e}") from e
    if r.timed_out:
        raise EnvError(f"office_tool {command} timed out after {timeout_s:g} s")
    try:
        result = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise EnvError(f"office_tool {command} crashed (exit {r.exit_code}): {(r.stdout + r.stderr)[-2000:]!r}") from None
    if result.get("infra"):
        raise EnvError(f"office_tool {command}: {result['error']}")
    return result


def system_prompt() -> str:
    return (
        "You work with office documents (.xlsx workbooks, .docx reports, .pptx decks) in a folder. "
        "Use list_files and read_document to look at them and edit_document to change them; formulas "
        "are recalculated when a workbook is read. Paths are relative to the folder. When you are done, "
        "call answer: with the answer to the question, or with a short note for an editing task."
    )


class OfficeEnv:
    """``Env`` (and ``Verifiable``) for office tasks; ``config`` sets the sandbox limits, ``pool``
    (a ``SandboxPool`` of ``office_config(config)``) makes ``reset`` cheap."""

    def __init__(self, config: SandboxConfig | None = None, pool: SandboxPool | None = None,
                 recalc: RecalcServer | None | bool = True) -> None:
        """``recalc``: the warm LibreOffice that recalculates edited workbooks (True: this process's
        ``shared_server()``; None / False: none, reads recalculate in the sandbox)."""
        self.config = office_config(config)
        self.pool = pool
        self.recalc = shared_server() if recalc is True else (recalc or None)
        self.tools: list[ToolSpec] = list(TOOLS)
        self.task: Task | None = None
        self.sandbox: BwrapSandbox | None = None
        self.done = False
        self.num_tool_errors = 0
        self.edited: set[str] = set()  # workbooks (normalized paths) edited since their last recalculation

    async def reset(self, task: Task) -> list[Message]:
        """Open a fresh sandbox with the task's ``files/`` in ``/work`` (closing any previous one)."""
        if task.root is None or not (task.root / "files").is_dir():
            raise ValueError(f"office task {task.id!r} needs a root folder with files/")
        await self.close()
        try:
            if self.pool is not None:
                self.sandbox = await asyncio.to_thread(self.pool.acquire, task.root / "files")
            else:
                self.sandbox = await asyncio.to_thread(BwrapSandbox, self.config, task.root / "files", shell=False)
        except OSError as e:
            raise EnvError(f"cannot open a sandbox for task {task.id!r}: {e}") from e
        self.task, self.done, self.num_tool_errors = task, False, 0
        self.edited.clear()
        return [Message(role="system", content=system_prompt()), Message(role="user", content=task.prompt)]

    async def step(self, call: ToolCall) -> Observation:
        if self.sandbox is None:
            raise RuntimeError("OfficeEnv.step() called before reset()")
        problem = check_call(call)
        if problem is None and len(json.dumps(call.arguments)) > MAX_ARGUMENT_CHARS:
            problem = f"{call.name}: arguments longer than {MAX_ARGUMENT_CHARS} characters"
        if (refused := refuse(self, problem, "answer")) is not None:
            return refused
        if call.name == "answer":
            self.done = True
            return Observation(call.arguments["text"], done=True)
        command = {"list_files": "list", "read_document": "read", "edit_document": "edit"}[call.name]
        args = {**call.arguments, "limit": self.config.max_output_bytes // 2}
        path = posixpath.normpath(args.get("path", ""))
        if command == "read" and path in self.edited:  # recalculated now, as the tool would (in a LibreOffice start)
            await asyncio.to_thread(self._recalculate, path)
        result = await asyncio.to_thread(run_tool, self.sandbox, command, args)
        if not result["ok"]:
            self.num_tool_errors += 1
            return Observation(f"Error: {result['error']}", is_error=True)
        if command == "edit" and self.recalc is not None and path.endswith(".xlsx"):
            self.edited.add(path)
        return Observation(result["text"])

    def _recalculate(self, path: str) -> None:
        """The edited workbook at ``path`` recalculated in the warm LibreOffice, written back (at its next
        read, not at each edit: several edits cost one recalculation, none if it is not read again). A workbook
        it cannot open stays as it is (a read then recalculates in the sandbox and reports the problem)."""
        assert self.sandbox is not None and self.recalc is not None
        self.edited.discard(path)
        try:
            self.sandbox.write_file(path, self.recalc.recalc(self.sandbox.read_file(path)))
        except ValueError:
            pass
        except OSError as e:
            raise EnvError(f"cannot recalculate {path!r} of task {self.task.id if self.task else '?'}: {e}") from e

    def verify_sandbox(self) -> BwrapSandbox:
        """A fresh verification sandbox over a copy of ``/work`` as it is now (``verifier.py``)."""
        if self.sandbox is None or self.task is None:
            raise RuntimeError("OfficeEnv.verify_sandbox() called before reset() or after close()")
        final = self._take()
        try:
            return final()
        finally:
            final.discard()

    async def final_files(self) -> FinalFiles:
        """Snapshot ``/work`` now; the result opens fresh verification sandboxes (outlives ``close``)."""
        if self.sandbox is None or self.task is None:
            raise RuntimeError("OfficeEnv.final_files() called before reset()")
        return await asyncio.to_thread(self._take)

    def _take(self) -> FinalFiles:
        try:
            # tool/ is the read-only tests dir, at VERIFY_TOOL_MOUNT: the checker runs the script from there.
            return FinalFiles.take(self.sandbox, TOOL_DIR, self.config)
        except OSError as e:
            raise EnvError(f"cannot snapshot the final files of task {self.task.id!r}: {e}") from e

    async def close(self) -> None:
        """Close the episode's sandbox (snapshots taken by ``final_files`` survive). Idempotent."""
        if self.sandbox is not None:
            sandbox, self.sandbox = self.sandbox, None
            await asyncio.to_thread(sandbox.close)
