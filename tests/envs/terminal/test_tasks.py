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

from jointrl.envs.sandbox import SandboxConfig
from jointrl.envs.sandbox.pool import SandboxPool
from jointrl.envs.terminal import load_policy, load_tasks, replay
from jointrl.rewards import Episode, combine

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None, reason="needs root and bubblewrap"
)

TASKS = load_tasks()


async def oracle_score(task, pool=None):
    played = await replay(task, load_policy(task, "oracle"), pool.config if pool else None, pool)
    episode = Episode(messages=played.messages, verify_sandbox=played.final_files, finished=True)
    try:
        return (await asyncio.to_thread(combine, task.reward, task, episode)).score
    finally:
        played.final_files.discard()


def test_oracles_run_concurrently():
    """Many episodes at once, as an env worker runs them: distinct uids, no cross-talk."""

    async def all_oracles():
        return await asyncio.gather(*(oracle_score(t) for t in TASKS))

    assert asyncio.run(all_oracles()) == [1.0] * len(TASKS)


@pytest.mark.slow
def test_64_concurrent_episodes_from_one_warm_pool():
    """The acceptance load of issue #7: 64 episodes at once on this 2-core host, their sandboxes from
    one env worker's warm pool, each scored by its verifier: none fails and every oracle scores 1."""
    pool = SandboxPool(SandboxConfig(timeout_s=120), size=8)

    async def sixty_four():
        return await asyncio.gather(*(oracle_score(TASKS[i % len(TASKS)], pool) for i in range(64)))

    try:
        assert asyncio.run(sixty_four()) == [1.0] * 64
    finally:
        pool.close()
