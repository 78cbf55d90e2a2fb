"""Shipped terminal tasks replayed at the env level (``TerminalEnv.reset/step`` + ``tests_pass``).

Every task's oracle / no-op / wrong scores are checked through the whole stack (chat
template, parser, agent loop, sandbox) in tests/rl/test_agent_loop.py; here, many oracles
run at once, as in an env worker.
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

TASKS = load_tasks()


def test_oracles_run_concurrently():
    """Many episodes at once, as an env worker runs them: distinct uids, no cross-talk."""

    async def oracle_score(task):
        played = await replay(task, load_policy(task, "oracle"))
        episode = Episode(messages=played.messages, verify_sandbox=played.final_files, finished=True)
        return (await asyncio.to_thread(combine, task.reward, task, episode)).score

    async def all_oracles():
        return await asyncio.gather(*(oracle_score(t) for t in TASKS))

    assert asyncio.run(all_oracles()) == [1.0] * len(TASKS)
