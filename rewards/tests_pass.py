"""``tests_pass``: the task's own verifier, run in a fresh sandbox over the episode's final files.

The verification sandbox (``Episode.verify_sandbox()``, e.g. ``envs/terminal/verifier.py``)
holds a copy of the final ``/work``, the task's tests read-only at ``/tests`` and a fresh,
empty, writable ``/logs/verifier`` the agent never had. The verifier is
``bash /tests/test.sh`` (or the task's ``metadata["verifier_command"]``: a Terminal-Bench 1
task runs its ``run-tests.sh`` and the loader adds the reward line).

Score 1.0 iff, within the timeout, the verifier exits 0 **and** ``/logs/verifier/reward.txt``
exists and holds the number 1 (or, without it, ``/logs/verifier/reward.json`` holds
``{"reward": 1}``, Harbor's other form); else 0.0. Requiring both means neither alone can be forged:
the agent's own ``reward.txt`` (in ``/work`` or anywhere it could write) is never read, and
agent code the verifier runs can write the reward file but cannot make a failing test exit 0.
A verifier that times out scores 0 (the agent's code hung: a policy result). A sandbox that
cannot start or dies raises ``EnvError`` (infrastructure, retried; never scored 0), and so does
a failed verifier whose output says it lacked the network (a ``test.sh`` that fetches a tool:
``network_failure``), unless its sandbox had one (a task marked ``allow_internet`` on docker with
``envs.sandbox.verifier_network``). Agent code that prints such a line while failing turns its
episode into an excluded ``env_error`` instead of a 0: no reward is gained that way.
The timeout is ``task.metadata["verifier_timeout_s"]`` (default 60 s).
"""

from __future__ import annotations

import json

from jointrl.envs.base import EnvError, Task
from jointrl.envs.terminal.verifier import REWARD_FILE, REWARD_JSON, TESTS_MOUNT
from jointrl.rewards.base import Episode, RewardResult, register

DEFAULT_TIMEOUT_S = 60.0
TEST_COMMAND = f"bash {TESTS_MOUNT}/test.sh"
_OUTPUT_TAIL = 2000  # characters of the verifier's output kept in ``info`` for debugging


@register("tests_pass")
def tests_pass(task: Task, episode: Episode) -> RewardResult:
    if episode.verify_sandbox is None:
        raise ValueError(f"tests_pass needs episode.verify_sandbox (task {task.id!r})")
    timeout = float(task.metadata.get("verifier_timeout_s", DEFAULT_TIMEOUT_S))
    try:
        sandbox = episode.verify_sandbox()
    except OSError as e:
        raise EnvError(f"cannot open the verification sandbox of task {task.id!r}: {e}") from e
    try:
        result = sandbox.exec(str(task.metadata.get("verifier_command", TEST_COMMAND)), timeout=timeout)
        reward_text = _read(sandbox, REWARD_FILE)
        if reward_text is None:
            reward_text = _from_json(_read(sandbox, REWARD_JSON))
    except OSError as e:
        raise EnvError(f"verification sandbox of task {task.id!r} failed: {e}") from e
    finally:
        sandbox.close()
    passed = result.ok and _is_one(reward_text)
    if not passed and not getattr(sandbox, "network", False) and (line := network_failure(result.stdout + result.stderr)):
        raise EnvError(f"the verifier of task {task.id!r} needs the network, which it does not have: "
                       f"{str(task.metadata.get('verifier_command', TEST_COMMAND))!r} printed {line!r} (mark the task "
                       "[environment] allow_internet = true and run it with envs.sandbox.backend=docker "
                       "envs.sandbox.verifier_network=true)")
    info = {
        "exit_code": result.exit_code,
        "timed_out": result.timed_out,
        "reward_file": reward_text,
        "output": (result.stdout + result.stderr)[-_OUTPUT_TAIL:],
    }
    return RewardResult(score=1.0 if passed else 0.0, info=info)


_NO_NETWORK = ("could not resolve host", "temporary failure in name resolution", "temporary failure resolving",
               "name or service not known", "network is unreachable", "no address associated with hostname",
               "failed to establish a new connection", "getaddrinfo failed", "unable to resolve host")


def network_failure(output: str) -> str | None:
    r"""The first output line that says a name lookup or connection failed for want of a network.

    >>> network_failure("ok\ncurl: (6) Could not resolve host: astral.sh\n")
    'curl: (6) Could not resolve host: astral.sh'
    >>> network_failure("1 failed, 2 passed") is None
    True
    """
    for line in output.splitlines():
        if any(s in line.lower() for s in _NO_NETWORK):
            return line.strip()[:200]
    return None


def _read(sandbox, path: str) -> str | None:
    try:
        return sandbox.read_file(path).decode("utf-8", errors="replace").strip()
    except (FileNotFoundError, ValueError):  # absent, or not a regular file inside /logs/verifier
        return None


def _from_json(text: str | None) -> str | None:
    """The ``reward`` of a Harbor ``reward.json``, as text.

    >>> [_from_json(t) for t in ('{"reward": 1.0}', '{"reward": 0}', '[1]', 'x', None)]
    ['1.0', '0', None, None, None]
    """
    try:
        doc = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return str(doc["reward"]) if isinstance(doc, dict) and "reward" in doc else None


def _is_one(text: str | None) -> bool:
    """Whether the reward file holds the number 1 ("1", "1.0", ...).

    >>> [_is_one(t) for t in ("1", "1.0", " 1 ", "0", "", None, "yes")]
    [True, True, True, False, False, False, False]
    """
    try:
        return text is not None and float(text) == 1.0
    except ValueError:
        return False
