"""Scripted policies of a terminal task (``policies.json``) and an env-level replay.

A policy is a list of assistant turns, each a list of tool calls. Every shipped task has an
``oracle`` (reward 1), a plausible-but-``wrong`` one (reward 0) and the built-in ``noop``
(submit at once, reward 0). A task with a solution script (``solution/solve.sh``, or TB1's
``solution.sh``) also has ``solution``: one bash call running that script, then submit; it is
the oracle of a task without ``policies.json``. ``replay`` drives a policy through ``TerminalEnv.reset/step``
only; the agent loop replays the same calls through the chat template and parser.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from jointrl.envs.base import Message, Observation, Task, ToolCall
from jointrl.envs.sandbox.base import SandboxConfig
from jointrl.envs.sandbox.pool import SandboxPool
from jointrl.envs.terminal.env import TerminalEnv
from jointrl.envs.terminal.tasks import solution_script
from jointrl.envs.terminal.verifier import FinalFiles

Policy = list[list[ToolCall]]
NOOP: Policy = [[ToolCall(name="submit", arguments={})]]


def _read(task: Task) -> dict[str, Policy]:
    if task.root is None:
        raise ValueError(f"task {task.id!r} has no folder, hence no policies.json")
    path = task.root / "policies.json"
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{str(path)!r}: must map policy names to lists of turns")
    policies: dict[str, Policy] = {}
    for name, turns in raw.items():
        if not isinstance(turns, list) or not all(isinstance(t, list) for t in turns):
            raise ValueError(f"{str(path)!r}: policy {name!r} must be a list of turns (lists of calls)")
        policies[name] = []
        for turn in turns:
            calls = []
            for c in turn:
                if not (isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict)):
                    raise ValueError(f"{str(path)!r}: policy {name!r} has a malformed call {c!r}")
                calls.append(ToolCall(name=c["name"], arguments=c["arguments"]))
            policies[name].append(calls)
    return policies


def policy_names(task: Task) -> list[str]:
    """The task's policies, ``noop`` included."""
    extra = {"solution", "oracle"} if solution_script(task) is not None else set()
    return sorted({"noop", *extra, *_read(task)})


def solution_policy(task: Task) -> Policy:
    """Run the task's solution script in one bash call (a heredoc: its ``exit`` ends only it)."""
    script = solution_script(task)
    if script is None:
        raise ValueError(f"task {task.id!r} has no solution script")
    body = script.read_text()
    cmd = f"bash -s <<'__JOINTRL_SOLUTION__'\n{body.rstrip()}\n__JOINTRL_SOLUTION__"
    return [[ToolCall(name="bash", arguments={"command": cmd})], [ToolCall(name="submit", arguments={})]]


def render_solution(oracle: Policy) -> str:
    """``solution/solve.sh`` of a shipped task: the oracle's bash commands, in order, in one shell."""
    cmds = [c.arguments["command"] for turn in oracle for c in turn if c.name == "bash"]
    head = "#!/bin/bash\n# The oracle policy's bash commands (policies.json), in order, in one shell.\ncd /work\n"
    return head + "".join(c.rstrip("\n") + "\n" for c in cmds)


def load_policy(task: Task, name: str) -> Policy:
    """The named policy's turns. Raises ``ValueError`` naming the available ones."""
    if name == "noop":
        return NOOP
    policies = _read(task)
    if name == "solution" or (name == "oracle" and "oracle" not in policies and solution_script(task)):
        return solution_policy(task)
    if name not in policies:
        raise ValueError(f"task {task.id!r} has no policy {name!r}; available: {policy_names(task)}")
    return policies[name]


@dataclass(slots=True)
class Replay:
    """What a replayed episode left: the transcript and a snapshot of the final files."""

    messages: list[Message]
    final_files: FinalFiles
    observations: list[Observation] = field(default_factory=list)
    submitted: bool = False
    num_turns: int = 0
    num_tool_errors: int = 0


async def replay(task: Task, turns: Policy, config: SandboxConfig | None = None,
                 pool: SandboxPool | None = None, backend: str = "bwrap") -> Replay:
    """Run ``turns`` (at most ``task.max_turns`` of them) through a fresh ``TerminalEnv``.

    ``pool``: a warm pool of ``config`` to take the sandbox from, as an env worker does;
    ``backend``: the sandbox backend (``envs.sandbox.backend``).
    Stops after the turn in which a call ends the episode. Raises ``EnvError`` on an
    infrastructure failure, like the env itself.
    """
    env = TerminalEnv(config, pool=pool, backend=backend)
    try:
        messages = await env.reset(task)
        observations: list[Observation] = []
        submitted, num_turns = False, 0
        for calls in turns[: task.max_turns]:
            num_turns += 1
            messages.append(Message(role="assistant", tool_calls=list(calls)))
            for call in calls:
                obs = await env.step(call)
                observations.append(obs)
                messages.append(Message(role="tool", content=obs.text, name=call.name))
                if obs.done:
                    submitted = True
                    break
            if submitted:
                break
        final = await env.final_files()
        return Replay(messages, final, observations, submitted, num_turns, env.num_tool_errors)
    finally:
        await env.close()
