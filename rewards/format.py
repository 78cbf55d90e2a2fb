"""``format``: did the policy end cleanly, with every tool call well formed?"""

from __future__ import annotations

from jointrl.envs.base import Task
from jointrl.rewards.base import Episode, RewardResult, register


@register("format")
def format_reward(task: Task, episode: Episode) -> RewardResult:
    """1.0 iff the model ended its last turn itself (``finished``) and made no malformed call.

    >>> from jointrl.envs.base import Task
    >>> t = Task(id="t", domain="terminal", prompt="p")
    >>> format_reward(t, Episode(messages=[], finished=True)).score
    1.0
    >>> format_reward(t, Episode(messages=[], finished=True, num_tool_errors=1)).score
    0.0
    >>> format_reward(t, Episode(messages=[], finished=False)).score
    0.0
    """
    ok = episode.finished and episode.num_tool_errors == 0
    return RewardResult(score=1.0 if ok else 0.0, info={"num_tool_errors": episode.num_tool_errors})
