"""The code-repository domain: fix an issue in a Python repository checked out in a sandbox.

One ``CodeRepoEnv`` hosts one episode: ``reset(task)`` opens a bubblewrap sandbox whose
``/work`` is the instance's repository at its base commit (a fresh one-commit git repository,
``RepoStore.workdir``) -- or, for a record that names a Docker image (``images.py``), a
container of that image (its runtime, the docker backend's limits) whose working dir
(``/testbed``) holds that same one-commit tree in place of the image's checkout; the tools are ``bash``, ``view_file``, ``str_replace``, ``create``,
``insert`` and ``submit`` (``tools.py``). The sandbox has Debian's ``/usr/bin/python3`` with
pytest, read-only, and no network. For the ``swe_tests`` reward, ``verify_sandbox`` (before
``close()``) or ``await final_files()`` (a snapshot that outlives ``close()``) open fresh
verification sandboxes over the final files (``verifier.py``).

Errors: a malformed call or one the tool cannot carry out returns
``Observation(is_error=True)`` naming the problem and the episode goes on; a sandbox that
cannot start or dies raises ``EnvError``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from jointrl.envs.base import EnvError, Message, Observation, Task, ToolCall, ToolSpec, refuse, validate_call
from jointrl.envs.code_repo import tools
from jointrl.envs.code_repo.images import open_sandbox
from jointrl.envs.code_repo.records import SweRecord
from jointrl.envs.code_repo.snapshot import RepoStore, default_store
from jointrl.envs.code_repo.verifier import FinalRepo
from jointrl.envs.sandbox.base import Sandbox, SandboxConfig
from jointrl.envs.terminal.env import format_result


def system_prompt(config: SandboxConfig, compact: bool = False) -> str:
    if compact:
        return "Fix the issue in the Python repository in /work (no network), then call submit."
    return (
        "Fix the issue in the Python repository in /work (a git checkout). Paths are relative to /work; "
        f"bash calls are limited to {config.timeout_s:g} s, with no network; /usr/bin/python3 has pytest. "
        "Call submit when done: hidden tests then run on your files; test-file changes are discarded."
    )


class CodeRepoEnv:
    """``Env`` (and ``Verifiable``) for ``code_repo`` tasks; ``config`` sets the sandbox limits."""

    def __init__(self, config: SandboxConfig | None = None, store: RepoStore | None = None,
                 compact: bool = False) -> None:
        """``compact``: the short system prompt and tool descriptions (``envs.prompt=compact``)."""
        self.config = config or SandboxConfig()
        self.store = store or default_store()
        self.compact = compact
        self.tools: list[ToolSpec] = list(tools.TOOLS_COMPACT if compact else tools.TOOLS)
        self.record: SweRecord | None = None
        self.sandbox: Sandbox | None = None
        self.done = False
        self.num_tool_errors = 0

    async def reset(self, task: Task) -> list[Message]:
        """Open a fresh sandbox with the repository at the base commit in ``/work``."""
        record = SweRecord.from_task(task)
        await self.close()
        try:
            workdir = await asyncio.to_thread(self.store.workdir, record)
            self.sandbox = await asyncio.to_thread(open_sandbox, record, self.config, workdir)
        except (OSError, RuntimeError, ValueError) as e:  # git failed, an image lacks the repo, no sandbox
            raise EnvError(f"cannot open a sandbox for instance {record.instance_id!r}: {e}") from e
        self.record, self.done, self.num_tool_errors = record, False, 0
        return [Message(role="system", content=system_prompt(self.config, self.compact)),
                Message(role="user", content=task.prompt)]

    async def step(self, call: ToolCall) -> Observation:
        if self.sandbox is None:
            raise RuntimeError("CodeRepoEnv.step() called before reset()")
        problem = validate_call(call, self.tools)
        if problem is None and any("\x00" in v for v in call.arguments.values() if isinstance(v, str)):
            problem = f"{call.name}: arguments must not contain NUL bytes"
        if (refused := refuse(self, problem, "submit")) is not None:
            return refused
        if call.name == "submit":
            self.done = True
            return Observation("Submitted.", done=True)
        try:
            return Observation(await asyncio.to_thread(self._run, call))
        except tools.ToolError as e:
            self.num_tool_errors += 1
            return Observation(f"Error: {e}", is_error=True)
        except OSError as e:
            raise EnvError(f"sandbox failed while running {call.name}: {e}") from e

    def _run(self, call: ToolCall) -> str:
        a: dict[str, Any] = call.arguments
        sb = self.sandbox
        if call.name == "bash":
            return format_result(sb.exec(a["command"]), self.config.timeout_s)
        if call.name == "view_file":
            return tools.view_file(sb, a["path"], a.get("start_line"), a.get("end_line"), self.config.max_output_bytes)
        if call.name == "str_replace":
            return tools.str_replace(sb, a["path"], a["old_str"], a["new_str"])
        if call.name == "create":
            return tools.create(sb, a["path"], a["content"])
        if call.name == "insert":
            return tools.insert(sb, a["path"], a["line"], a["text"])
        raise AssertionError(f"validated tool {call.name!r} has no handler")

    def verify_sandbox(self) -> Sandbox:
        """A fresh verification sandbox over a copy of ``/work`` as it is now; the caller closes it."""
        if self.sandbox is None or self.record is None:
            raise RuntimeError("CodeRepoEnv.verify_sandbox() called before reset() or after close()")
        final = self._take()
        try:
            return final()
        finally:
            final.discard()

    async def final_files(self) -> FinalRepo:
        """Snapshot ``/work`` now; the result opens fresh verification sandboxes (``Episode.verify_sandbox``)."""
        if self.sandbox is None or self.record is None:
            raise RuntimeError("CodeRepoEnv.final_files() called before reset()")
        return await asyncio.to_thread(self._take)

    def _take(self) -> FinalRepo:
        try:
            return FinalRepo.take(self.sandbox, self.store.canon(self.record), self.config, self.record)
        except (OSError, RuntimeError) as e:
            raise EnvError(f"cannot snapshot the final files of {self.record.instance_id!r}: {e}") from e

    async def close(self) -> None:
        """Close the episode's sandbox (snapshots taken by ``final_files`` survive). Idempotent."""
        if self.sandbox is not None:
            sandbox, self.sandbox = self.sandbox, None
            await asyncio.to_thread(sandbox.close)
