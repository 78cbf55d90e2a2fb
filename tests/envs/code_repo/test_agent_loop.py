"""Code-repository instances through the real template, parser, agent loop and bwrap sandboxes.

Every instance's oracle (reward 1), no-op and plausible-but-wrong policy (reward 0): a fast
subset, one instance per repository, in the default tier; all of them in the slow tier.
"""

import asyncio
import os
import shutil

import pytest

from jointrl.envs.code_repo import CodeRepoEnv, load_policy, load_tasks
from jointrl.envs.sandbox import SandboxConfig
from jointrl.model.chat_template import ChatTemplate
from jointrl.envs.registry import load_tasks as registry_load_tasks
from jointrl.rl.agent_loop import AgentConfig, run_episode
from jointrl.rl.config import load_config
from jointrl.rl.joint_sampler import JointSampler
from jointrl.rl.rollout.scripted import ScriptedEngine
from jointrl.rl.types import FinishReason, SamplingParams

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bwrap") is None, reason="needs root and bubblewrap")

TASKS = load_tasks()
TPL = ChatTemplate()
PARAMS = SamplingParams(max_tokens=8192)
CFG = AgentConfig(max_context=32768)
FAST = {"unitconv-1", "intervals-3", "texttable-5"}  # three repositories; one- and multi-hunk patches
EXPECTED = (("oracle", 1.0), ("noop", 0.0), ("wrong", 0.0))


def play(task, turns):
    async def go():
        env = CodeRepoEnv(SandboxConfig(timeout_s=30))
        try:
            return await run_episode(env, ScriptedEngine(turns, TPL), task, TPL, PARAMS, CFG, group_id="g")
        finally:
            await env.close()

    return asyncio.run(go())


def check(task):
    for policy, expected in EXPECTED:
        traj = play(task, load_policy(task, policy))
        info = {k: v for k, v in traj.reward_info.items() if k != "swe_tests/output"}
        assert traj.reward == expected, (task.id, policy, info, traj.reward_info.get("swe_tests/output"))
        assert traj.finish_reason == FinishReason.STOP and traj.num_tool_errors == 0, (task.id, policy)
        if policy != "oracle":
            assert traj.reward_info["swe_tests/failed"], (task.id, policy)  # names what failed


def test_ships_twenty_instances_over_four_repositories():
    assert len(TASKS) >= 20 and len({t.metadata["swe"]["repo"] for t in TASKS}) >= 4
    assert FAST <= {t.id for t in TASKS}


def test_joint_config_mixes_terminal_and_code_repo():
    cfg = load_config(["envs=joint"])
    domains = cfg.envs.domains
    assert set(domains) == {"terminal", "code_repo"} and domains["code_repo"].reward == {"swe_tests": 1.0, "format": 0.1}
    sampler = JointSampler({d: registry_load_tasks(d, dc.task_dir) for d, dc in domains.items()}, domains, seed=0)
    assert set(JointSampler.realized_mix(sampler.sample(step=1, n=32))) == {"terminal", "code_repo"}


@pytest.mark.parametrize("task", [t for t in TASKS if t.id in FAST], ids=lambda t: t.id)
def test_oracle_noop_wrong_fast_subset(task):
    check(task)


@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.id)
def test_oracle_noop_wrong_every_instance(task):
    check(task)
