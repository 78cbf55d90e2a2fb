"""The environment contract: typed records and the ``Env`` protocol.

An environment hosts one episode of one task. The agent loop (``jointrl.rl.agent_loop``)
calls ``reset`` once, then ``step`` once per parsed tool call, then ``close``.
Environments speak text; the agent loop owns all tokenization.

Nothing here imports from ``jointrl.model`` or ``jointrl.rl`` (docs/architecture.md). The chat
records (``Message``, ``ToolCall``, ``ToolSpec``, ``Role``) live in the leaf module ``jointrl.messages``,
which the model's chat template also reads; they are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from jointrl.messages import Message, Role, ToolCall, ToolSpec  # re-exported: the records envs speak

Tier = Literal["low", "high", "max"]
TIERS: tuple[str, ...] = ("low", "high", "max")


@dataclass(frozen=True, slots=True)
class Observation:
    """What a tool call returns to the model. ``done`` ends the episode (e.g. ``submit``)."""

    text: str
    done: bool = False
    is_error: bool = False  # the call itself was at fault (bad arguments, unknown tool)
    image: bytes | None = None


@dataclass(frozen=True, slots=True)
class DatasetSource:
    """Where a domain's records come from when they are a dataset: a local parquet / arrow /
    JSONL file or a ``save_to_disk`` directory, its split, field -> column renames, and (docker
    backend) the template of each record's image."""

    path: str
    split: str = "train"
    columns: dict[str, str] = field(default_factory=dict)
    image: str = ""  # a template naming each record's Docker image (code_repo/images.py); "": its image_name


@dataclass(frozen=True, slots=True)
class Task:
    """One task of one domain.

    ``root`` is the task's folder (setup files, tests, oracle), when it has one; ``reward``
    names the reward modules and weights that score it (``{"tests_pass": 1.0}``).
    """

    id: str
    domain: str
    prompt: str
    tier: Tier = "low"
    max_turns: int = 8
    root: Path | None = None
    reward: dict[str, float] = field(default_factory=lambda: {"tests_pass": 1.0})
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"task {self.id!r}: tier must be one of {TIERS}, got {self.tier!r}")
        if self.max_turns < 1:
            raise ValueError(f"task {self.id!r}: max_turns must be >= 1, got {self.max_turns}")


class EnvError(RuntimeError):
    """An infrastructure failure (sandbox died, checker crashed): retried, then ``env_error``.

    Never raised for the policy's own mistakes; those become error observations.
    """


@runtime_checkable
class Env(Protocol):
    """One episode of one task. Implementations live in ``envs/<domain>/``."""

    tools: list[ToolSpec]

    async def reset(self, task: Task) -> list[Message]:
        """Prepare the episode (sandbox, files) and return the opening messages."""
        ...

    async def step(self, call: ToolCall) -> Observation:
        """Run one tool call. Bad arguments return ``Observation(is_error=True)``."""
        ...

    async def close(self) -> None:
        """Release the episode's resources. Safe to call twice."""
        ...


@runtime_checkable
class Verifiable(Protocol):
    """An ``Env`` whose final state a reward checks in a fresh sandbox (``Episode.verify_sandbox``).

    After the last step and before ``close``, the agent loop passes the bound method
    ``env.verify_sandbox`` as ``Episode.verify_sandbox``.
    """

    def verify_sandbox(self) -> Any:
        """Open a fresh sandbox over a copy of the episode's current files; the caller closes it."""
        ...


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,), "null": (type(None),),
}


def refuse(env: Any, problem: str | None, final_tool: str) -> Observation | None:
    """The refusals every env's ``step`` starts with, each counted in ``env.num_tool_errors``:
    after the episode's final tool (``final_tool``, e.g. ``submit``) nothing runs, and a malformed
    call (``problem``, from ``validate_call`` and the env's own checks) becomes an error
    observation to the model. None: go on with the call."""
    if env.done:
        env.num_tool_errors += 1
        return Observation(f"The episode is over: {final_tool} was already called.", done=True, is_error=True)
    if problem is not None:
        env.num_tool_errors += 1
        return Observation(f"Error: {problem}", is_error=True)
    return None


def validate_call(call: ToolCall, tools: list[ToolSpec]) -> str | None:
    """The problem with ``call`` against the tools' JSON schemas, or None if it is valid.

    Checks the tool name, required arguments, unknown arguments and top-level types (a JSON
    boolean is not an integer). Envs call this in ``step`` and return the message as an
    error observation.
    """
    spec = next((t for t in tools if t.name == call.name), None)
    if spec is None:
        return f"unknown tool {call.name!r}; available: {[t.name for t in tools]}"
    if not isinstance(call.arguments, dict):
        return f"{call.name}: arguments must be a JSON object, got {type(call.arguments).__name__}"
    props: dict[str, Any] = spec.parameters.get("properties", {})
    missing = [k for k in spec.parameters.get("required", []) if k not in call.arguments]
    if missing:
        return f"{call.name}: missing required argument(s) {missing}"
    for key, value in call.arguments.items():
        if key not in props:
            return f"{call.name}: unknown argument {key!r}; allowed: {sorted(props)}"
        want = props[key].get("type")
        types = _JSON_TYPES.get(want) if isinstance(want, str) else None
        bad_bool = isinstance(value, bool) and want in ("integer", "number")
        if types is not None and (not isinstance(value, types) or bad_bool):
            return f"{call.name}: argument {key!r} must be {want}, got {type(value).__name__}"
    return None
