"""Every shipped terminal task: its oracle scores 1, the no-op and its plausible-but-wrong policy 0.

The policies are replayed through ``TerminalEnv.reset/step`` and scored by ``tests_pass`` in a
fresh verification sandbox (tests/rl drives the same policies through the chat template,
parser and agent loop).
"""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from jointrl.envs.terminal import load_policy, load_tasks, replay
from jointrl.rewards import Episode, combine

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None, reason="needs root and bubblewrap"
)

EXPECTED = {"oracle": 1.0, "noop": 0.0, "wrong": 0.0}
TASKS = load_tasks()


@pytest.mark.parametrize("policy", sorted(EXPECTED))
@pytest.mark.parametrize("task", TASKS, ids=[t.id for t in TASKS])
def test_policy_scores(task, policy):
    played = asyncio.run(replay(task, load_policy(task, policy)))
    assert played.submitted and played.num_tool_errors == 0
    assert not any(o.is_error for o in played.observations)
    episode = Episode(messages=played.messages, verify_sandbox=played.final_files, finished=True,
                      num_turns=played.num_turns)
    result = combine(task.reward, task, episode)
    assert result.score == EXPECTED[policy], result.info
    played.final_files.discard()


def test_oracles_run_concurrently():
    """Many episodes at once, as an env worker runs them: distinct uids, no cross-talk."""

    async def oracle_score(task):
        played = await replay(task, load_policy(task, "oracle"))
        episode = Episode(messages=played.messages, verify_sandbox=played.final_files, finished=True)
        return (await asyncio.to_thread(combine, task.reward, task, episode)).score

    async def all_oracles():
        return await asyncio.gather(*(oracle_score(t) for t in TASKS))

    assert asyncio.run(all_oracles()) == [1.0] * len(TASKS)
