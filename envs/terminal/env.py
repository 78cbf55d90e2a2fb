"""The terminal domain: a persistent shell in a sandbox, tools ``bash`` and ``submit``.

One ``TerminalEnv`` hosts one episode at a time: ``reset(task)`` takes a sandbox (from the
worker's warm pool when one is given, else started cold) whose ``/work`` holds the task's
``environment/`` files and runs ``environment/setup.sh`` there if the task has one; each
``bash`` call runs in the episode's persistent shell (cwd and environment persist) with the
configured per-command wall-clock limit; ``submit`` ends the episode. A task that needs its
own Docker image (``environment/Dockerfile``, built once per content of ``environment/``) runs
with ``backend="docker"``: its episode and its verifier in fresh containers of that image, as the
image's USER in its WORKDIR, with the task's declared resources (``task.toml`` ``[environment]``);
on bwrap ``reset`` raises ``TaskNeedsImage`` (a ``ValueError``) saying so. For the verifier (``verifier.py``),
``verify_sandbox`` (before ``close()``) or ``await final_files()`` (a snapshot that outlives
``close()``) become ``Episode.verify_sandbox``.

Errors: a malformed call (unknown tool, missing / extra / mistyped argument) returns
``Observation(is_error=True)`` naming the problem and the episode goes on; a sandbox that
cannot start or dies raises ``EnvError``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from jointrl.envs.base import EnvError, Message, Observation, Task, ToolCall, ToolSpec, refuse
from jointrl.envs.base import validate_call as validate_against_schema
from jointrl.envs.sandbox import BACKENDS, Sandbox, make_sandbox
from jointrl.envs.sandbox.base import ExecResult, SandboxConfig
from jointrl.envs.sandbox.bwrap import BwrapSandbox
from jointrl.envs.sandbox.pool import SandboxPool, shared_pool
from jointrl.envs.terminal.verifier import FinalFiles

SETUP_SCRIPT = "setup.sh"  # in environment/: run once in /work at reset, then removed

BASH = ToolSpec(
    name="bash",
    description=(
        "Run a shell command in this episode's bash shell and return its stdout, stderr and exit "
        "code. The shell persists between calls: the working directory, shell and environment "
        "variables and files carry over (it starts in /work). Background processes do not: they "
        "are killed when the call returns. Each call has its own time limit; a command that "
        "times out is killed and the shell stays as it was, unless the shell itself had to be "
        "restarted, which the result then says."
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


# ``envs.prompt=compact``: the same tools and rules in a few words, for a byte-level model whose
# every training and rollout token re-reads the system turn (~750 tokens instead of ~1,550).
BASH_COMPACT = ToolSpec("bash", "Run a shell command.",
                        {**BASH.parameters, "properties": {"command": {"type": "string"}}})
SUBMIT_COMPACT = ToolSpec("submit", "End the episode.", SUBMIT.parameters)


def system_prompt(config: SandboxConfig, compact: bool = False, workdir: str = "/work") -> str:
    if compact:
        return f"A Linux shell in {workdir}, no network, {config.timeout_s:g} s per command. Call submit when done."
    where = ("only /work (and a scratch /tmp) is writable" if workdir == "/work"
             else "your files there are what is checked when you submit")
    return (
        f"You are an agent working in a Linux shell sandbox. Your working directory is {workdir}; "
        f"{where}, and there is no network. "
        f"Use the `bash` tool to run commands in a persistent shell (each is limited to {config.timeout_s:g} s; "
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
    if result.shell_restarted:
        parts.append("\n[the shell ended; the next command runs in a new shell, in the last working "
                     "directory, with the exported variables restored]")
    return "".join(parts)


class TaskNeedsImage(ValueError):
    """The task builds its own Docker image; the bwrap backend cannot run it."""


def docker_kwargs(task: Task) -> dict:
    """``DockerSandbox`` arguments for a task with its own image: the Dockerfile (built) or image
    name (used as is), its declared resources and build timeout (``tasks._environment``)."""
    from jointrl.envs.sandbox.docker import Resources  # lazy: the docker SDK only for docker tasks

    image, m = task.metadata["docker_image"], task.metadata
    mb = lambda key: int(m[key] * (1 << 20)) if key in m else None  # noqa: E731
    return {**({"dockerfile": Path(image)} if Path(image).is_file() else {"image": image}),
            "resources": Resources(cpus=m.get("cpus"), memory_bytes=mb("memory_mb"), disk_bytes=mb("storage_mb")),
            **({"build_timeout_s": m["build_timeout_s"]} if "build_timeout_s" in m else {})}


class TerminalEnv:
    """``Env`` for terminal tasks. ``config`` sets the sandbox limits (per-command timeout etc.);
    ``pool``, a warm ``SandboxPool`` of the same config, makes ``reset`` cheap; ``backend`` is
    ``"bwrap"`` or ``"docker"`` (``envs/sandbox/``); on docker ``warm`` > 0 makes the worker's
    pool of domain-image containers at the first task without its own image (none is warmed for
    a task set whose tasks all bring their images)."""

    def __init__(self, config: SandboxConfig | None = None, pool: SandboxPool | None = None,
                 backend: str = "bwrap", compact: bool = False, verifier_network: bool = False,
                 warm: int = 0) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown sandbox backend {backend!r}; allowed: {list(BACKENDS)}")
        self.config = config or SandboxConfig()
        self.pool, self.backend = pool, backend
        self.verifier_network = verifier_network  # a task marked allow_internet verifies with a network (docker)
        self.warm = warm  # docker: the worker's pool of domain-image containers, made at the first task without an image
        self._backend_kwargs: dict = {}
        self.compact = compact  # the short system prompt and tool descriptions (envs.prompt=compact)
        self.tools: list[ToolSpec] = [BASH_COMPACT, SUBMIT_COMPACT] if compact else [BASH, SUBMIT]
        self.task: Task | None = None
        self.sandbox: Sandbox | None = None
        self.done = False
        self.num_tool_errors = 0  # malformed calls that reached the env (the parser counts its own)

    async def reset(self, task: Task) -> list[Message]:
        """Open a fresh sandbox with the task's ``environment/`` in ``/work`` (closing any previous one)."""
        if task.root is None or not (task.root / "tests").is_dir():
            raise ValueError(f"terminal task {task.id!r} needs a root folder with tests/")
        image = task.metadata.get("docker_image")
        if image and self.backend == "bwrap":
            raise TaskNeedsImage(
                f"terminal task {task.id!r} needs its own Docker image ({task.metadata['docker_image']}); "
                "the bwrap backend cannot build it: run it on the docker backend (envs/sandbox/docker.py)")
        await self.close()
        setup = task.root / "environment"
        files = setup if setup.is_dir() else None
        self._backend_kwargs = {}
        if self.backend == "docker" and image:
            self._backend_kwargs = docker_kwargs(task)
            files = files if files is not None and not (files / "Dockerfile").is_file() else None  # a build context
        try:
            if self.backend == "docker" and not image and self.pool is None and self.warm:
                self.pool = shared_pool(self.config, self.warm, "docker")
            if self.backend == "docker" and (image or self.pool is None):
                self.sandbox = await asyncio.to_thread(make_sandbox, "docker", self.config, workdir_from=files,
                                                       **self._backend_kwargs)
            elif self.pool is not None:
                self.sandbox = await asyncio.to_thread(self.pool.acquire, files)
            else:
                self.sandbox = await asyncio.to_thread(BwrapSandbox, self.config, files)
            if files is not None and (files / SETUP_SCRIPT).is_file():
                r = await asyncio.to_thread(self.sandbox.run, f"bash {SETUP_SCRIPT}; rm -f {SETUP_SCRIPT}", 120.0)
                if not r.ok:
                    raise EnvError(f"setup of task {task.id!r} failed: exit {r.exit_code}: {r.stderr[-1000:]!r}")
        except OSError as e:
            raise EnvError(f"cannot open a sandbox for task {task.id!r}: {e}") from e
        self.task, self.done, self.num_tool_errors = task, False, 0
        workdir = str(self.sandbox.workdir) if self.backend == "docker" else "/work"
        return [Message(role="system", content=system_prompt(self.config, self.compact, workdir)),
                Message(role="user", content=task.prompt)]

    async def step(self, call: ToolCall) -> Observation:
        if self.sandbox is None:
            raise RuntimeError("TerminalEnv.step() called before reset()")
        problem = validate_call(call)
        if (refused := refuse(self, problem, "submit")) is not None:
            return refused
        if call.name == "submit":
            self.done = True
            return Observation("Submitted.", done=True)
        try:
            result = await asyncio.to_thread(self.sandbox.run, call.arguments["command"])
        except OSError as e:
            raise EnvError(f"sandbox failed while running a command: {e}") from e
        return Observation(format_result(result, self.config.timeout_s))

    def verify_sandbox(self) -> Sandbox:
        """A fresh verification sandbox over a copy of ``/work`` as it is now (see ``verifier.py``).

        For ``Episode.verify_sandbox`` when rewards are computed before ``close()``; the caller
        closes the returned sandbox. Raises ``EnvError`` if it cannot be opened.
        """
        if self.sandbox is None or self.task is None or self.task.root is None:
            raise RuntimeError("TerminalEnv.verify_sandbox() called before reset() or after close()")
        final = FinalFiles.take(self.sandbox, self.task.root / "tests", self.config, self._verifier_mounts(),
                                self.backend, self._verifier_kwargs())
        try:
            return final()
        finally:
            final.discard()

    async def final_files(self) -> FinalFiles:
        """Snapshot ``/work`` now; the result opens fresh verification sandboxes (``Episode.verify_sandbox``)."""
        if self.sandbox is None or self.task is None or self.task.root is None:
            raise RuntimeError("TerminalEnv.final_files() called before reset()")
        try:
            return await asyncio.to_thread(FinalFiles.take, self.sandbox, self.task.root / "tests", self.config,
                                           self._verifier_mounts(), self.backend, self._verifier_kwargs())
        except OSError as e:
            raise EnvError(f"cannot snapshot the final files of task {self.task.id!r}: {e}") from e

    def _verifier_kwargs(self) -> dict:
        """The episode's image, and a network where the task allows one and the host permits it."""
        assert self.task is not None
        if self.backend != "docker":
            return dict(self._backend_kwargs)
        network = self.verifier_network and bool(self.task.metadata.get("allow_internet"))
        return {**self._backend_kwargs, "seed_workdir": False, "network": network}

    def _verifier_mounts(self) -> dict[str, str]:
        assert self.task is not None
        return dict(self.task.metadata.get("verifier_mounts", {}))

    async def close(self) -> None:
        """Close the episode's sandbox (snapshots taken by ``final_files`` survive). Idempotent."""
        if self.sandbox is not None:
            sandbox, self.sandbox = self.sandbox, None
            await asyncio.to_thread(sandbox.close)
