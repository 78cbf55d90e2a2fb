"""The terminal domain: a shell in a bubblewrap sandbox, tools ``bash`` and ``submit``.

One ``TerminalEnv`` hosts one episode at a time: ``reset(task)`` opens a sandbox whose
``/work`` holds the task's ``environment/`` files; each ``bash`` call runs in it with the
configured wall-clock limit; ``submit`` ends the episode. For the verifier (``verifier.py``),
``verify_sandbox`` (before ``close()``) or ``await final_files()`` (a snapshot that outlives
``close()``) become ``Episode.verify_sandbox``.

Errors: a malformed call (unknown tool, missing / extra / mistyped argument) returns
``Observation(is_error=True)`` naming the problem and the episode goes on; a sandbox that
cannot start or dies raises ``EnvError``.
"""

from __future__ import annotations

import asyncio

from jointrl.envs.base import EnvError, Message, Observation, Task, ToolCall, ToolSpec
from jointrl.envs.base import validate_call as validate_against_schema
from jointrl.envs.sandbox.base import ExecResult, SandboxConfig
from jointrl.envs.sandbox.bwrap import BwrapSandbox
from jointrl.envs.terminal.verifier import FinalFiles

BASH = ToolSpec(
    name="bash",
    description=(
        "Run a shell command with `bash -c` in /work and return its stdout, stderr and exit code. "
        "Each call starts a fresh shell: files persist between calls, the working directory, "
        "variables and background processes do not."
    ),
    parameters={
        "type": "object",
        "properties": {"command": {"type": "string", "description": "the shell command to run"}},
        "required": ["command"],
        "additionalProperties": False,
    },
)
SUBMIT = ToolSpec(
    name="submit",
    description="Declare the task done. Ends the episode; your files in /work are then checked.",
    parameters={"type": "object", "properties": {}, "additionalProperties": False},
)


def system_prompt(config: SandboxConfig) -> str:
    return (
        "You are an agent working in a Linux shell sandbox. Your working directory is /work; "
        "only /work (and a scratch /tmp) is writable, and there is no network. "
        f"Use the `bash` tool to run commands (each is limited to {config.timeout_s:g} s; "
        f"output beyond {config.max_output_bytes} bytes per stream is cut). "
        "When the task is complete, call `submit`."
    )


def validate_call(call: ToolCall) -> str | None:
    """The problem with ``call``'s name or arguments, or ``None`` if it is well formed."""
    problem = validate_against_schema(call, [BASH, SUBMIT])
    if problem is None and "\x00" in call.arguments.get("command", ""):
        return "bash: argument 'command' contains a NUL byte"
    return problem


def format_result(result: ExecResult, timeout_s: float) -> str:
    """stdout, then stderr under a ``[stderr]`` header, then the exit code or the timeout."""
    parts = []
    if result.stdout:
        parts.append(result.stdout if result.stdout.endswith("\n") else result.stdout + "\n")
    if result.stderr:
        body = result.stderr if result.stderr.endswith("\n") else result.stderr + "\n"
        parts.append("[stderr]\n" + body)
    if result.timed_out:
        parts.append(f"[timed out after {timeout_s:g} s; the command and its children were killed]")
    else:
        parts.append(f"[exit code: {result.exit_code}]")
    return "".join(parts)


class TerminalEnv:
    """``Env`` for terminal tasks. ``config`` sets the sandbox limits (per-command timeout etc.)."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.tools: list[ToolSpec] = [BASH, SUBMIT]
        self.task: Task | None = None
        self.sandbox: BwrapSandbox | None = None
        self.done = False
        self.num_tool_errors = 0  # malformed calls that reached the env (the parser counts its own)

    async def reset(self, task: Task) -> list[Message]:
        """Open a fresh sandbox with the task's ``environment/`` in ``/work`` (closing any previous one)."""
        if task.root is None or not (task.root / "tests" / "test.sh").is_file():
            raise ValueError(f"terminal task {task.id!r} needs a root folder with tests/test.sh")
        await self.close()
        setup = task.root / "environment"
        try:
            self.sandbox = await asyncio.to_thread(BwrapSandbox, self.config, setup if setup.is_dir() else None)
        except OSError as e:
            raise EnvError(f"cannot open a sandbox for task {task.id!r}: {e}") from e
        self.task, self.done, self.num_tool_errors = task, False, 0
        return [Message(role="system", content=system_prompt(self.config)), Message(role="user", content=task.prompt)]

    async def step(self, call: ToolCall) -> Observation:
        if self.sandbox is None:
            raise RuntimeError("TerminalEnv.step() called before reset()")
        if self.done:
            self.num_tool_errors += 1
            return Observation("The episode is over: submit was already called.", done=True, is_error=True)
        problem = validate_call(call)
        if problem is not None:
            self.num_tool_errors += 1
            return Observation(f"Error: {problem}", is_error=True)
        if call.name == "submit":
            self.done = True
            return Observation("Submitted.", done=True)
        try:
            result = await asyncio.to_thread(self.sandbox.exec, call.arguments["command"])
        except OSError as e:
            raise EnvError(f"sandbox failed while running a command: {e}") from e
        return Observation(format_result(result, self.config.timeout_s))

    def verify_sandbox(self) -> BwrapSandbox:
        """A fresh verification sandbox over a copy of ``/work`` as it is now (see ``verifier.py``).

        For ``Episode.verify_sandbox`` when rewards are computed before ``close()``; the caller
        closes the returned sandbox. Raises ``EnvError`` if it cannot be opened.
        """
        if self.sandbox is None or self.task is None or self.task.root is None:
            raise RuntimeError("TerminalEnv.verify_sandbox() called before reset() or after close()")
        final = FinalFiles.take(self.sandbox, self.task.root / "tests", self.config)
        try:
            return final()
        finally:
            final.discard()

    async def final_files(self) -> FinalFiles:
        """Snapshot ``/work`` now; the result opens fresh verification sandboxes (``Episode.verify_sandbox``)."""
        if self.sandbox is None or self.task is None or self.task.root is None:
            raise RuntimeError("TerminalEnv.final_files() called before reset()")
        try:
            return await asyncio.to_thread(FinalFiles.take, self.sandbox, self.task.root / "tests", self.config)
        except OSError as e:
            raise EnvError(f"cannot snapshot the final files of task {self.task.id!r}: {e}") from e

    async def close(self) -> None:
        """Close the episode's sandbox (snapshots taken by ``final_files`` survive). Idempotent."""
        if self.sandbox is not None:
            sandbox, self.sandbox = self.sandbox, None
            await asyncio.to_thread(sandbox.close)
