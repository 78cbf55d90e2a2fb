"""``app_state``: the sites' final state (cart, saved forms) against the task's expectation.

The state is the JSON file the sites rewrite on every change (the browser domain's
``/work/site/state.json``), read from a fresh verification sandbox over a copy of the episode's
``/work`` (``Episode.verify_sandbox()``). ``metadata["expected_state"]`` maps a part of the
state (``"cart"``, ``"profile"``, ...) to what it must hold; ``metadata["state_match"]`` says
per part whether that is ``"exact"`` (nothing else either: the cart holds exactly these items)
or ``"subset"`` (the default: these fields have these values). Score 1.0 iff every part
matches. A missing or unreadable state file is an infrastructure failure (``EnvError``).
"""

from __future__ import annotations

import json
from typing import Any

from jointrl.envs.base import EnvError, Task
from jointrl.rewards.base import Episode, RewardResult, register

STATE_FILE = "site/state.json"
MATCHES = ("exact", "subset")


def part_matches(have: Any, want: Any, how: str) -> bool:
    """Whether one part of the state matches.

    >>> part_matches({"KE-1": 2}, {"KE-1": 2}, "exact"), part_matches({"KE-1": 2, "LA-3": 1}, {"KE-1": 2}, "exact")
    (True, False)
    >>> part_matches({"name": "Zoë", "tz": "UTC"}, {"name": "Zoë"}, "subset")
    True
    """
    if how not in MATCHES:
        raise ValueError(f"state_match must be one of {MATCHES}, got {how!r}")
    if how == "exact" or not isinstance(want, dict):
        return have == want
    return isinstance(have, dict) and all(k in have and have[k] == v for k, v in want.items())


@register("app_state")
def app_state(task: Task, episode: Episode) -> RewardResult:
    expected = task.metadata.get("expected_state")
    if not isinstance(expected, dict) or not expected:
        raise ValueError(f"task {task.id!r} needs a non-empty metadata['expected_state'] dict")
    if episode.verify_sandbox is None:
        raise ValueError(f"app_state needs episode.verify_sandbox (task {task.id!r})")
    sandbox = episode.verify_sandbox()
    try:
        state = json.loads(sandbox.read_file(STATE_FILE))
    except (OSError, ValueError) as err:
        raise EnvError(f"cannot read the sites' state of task {task.id!r}: {err}") from err
    finally:
        sandbox.close()
    how = task.metadata.get("state_match", {})
    wrong = sorted(part for part, want in expected.items() if not part_matches(state.get(part), want, how.get(part, "subset")))
    return RewardResult(0.0 if wrong else 1.0, {"mismatched": wrong, "state": {k: state.get(k) for k in expected}})
