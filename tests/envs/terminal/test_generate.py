"""Generated terminal tasks (envs/terminal/generate.py): deterministic, varied, and solved only by the oracle.

The default tier builds two seeds of every family and plays each task's oracle (reward 1),
no-op and plausible-but-wrong policy (reward 0) through the real template, parser, agent loop
and bwrap sandbox; ``pytest -m slow`` plays the oracle and the no-op of every held-out task of
the documented size (``--seeds 40 --split heldout``).
"""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from jointrl.envs.registry import load_tasks as registry_load_tasks
from jointrl.envs.sandbox import SandboxConfig
from jointrl.envs.terminal import TerminalEnv, load_policy, load_tasks
from jointrl.envs.terminal.generate import FAMILIES, build, generate, heldout_count, ids
from jointrl.envs.terminal.policies import render_solution
from jointrl.model.chat_template import ChatTemplate
from jointrl.rl.agent_loop import AgentConfig, run_episode
from jointrl.rl.rollout.scripted import ScriptedEngine
from jointrl.rl.types import FinishReason, SamplingParams

needs_bwrap = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bwrap") is None,
                                 reason="needs root and bubblewrap")
TPL = ChatTemplate()
HELDOUT_SEEDS = 40  # the documented size: 119 held-out tasks


def play_all(pairs, concurrency=8):
    """Play ``(task, policy name)`` pairs through the agent loop, a few at a time; their trajectories."""

    async def one(task, name, limit):
        async with limit:
            env = TerminalEnv(SandboxConfig(timeout_s=10))
            try:
                return await run_episode(env, ScriptedEngine(load_policy(task, name), TPL), task, TPL,
                                         SamplingParams(max_tokens=4096), AgentConfig(max_context=8192), group_id="g")
            finally:
                await env.close()

    async def go():
        limit = asyncio.Semaphore(concurrency)
        return await asyncio.gather(*(one(t, n, limit) for t, n in pairs))

    return asyncio.run(go())


def check(pairs):
    expected = {"oracle": 1.0, "noop": 0.0, "wrong": 0.0}
    for (task, name), traj in zip(pairs, play_all(pairs)):
        assert traj.reward == expected[name], (task.id, name, traj.reward_info, [m.content[-300:] for m in traj.messages])
        assert traj.finish_reason == FinishReason.STOP and traj.num_tool_errors == 0, (task.id, name)


def test_same_seed_same_task_other_seeds_other_answers():
    for family in FAMILIES:
        assert generate(family, 3) == generate(family, 3)
        answers = {generate(family, s).expected for s in range(20)}
        assert len(answers) >= 4, (family, answers)  # memorizing one seed's answer does not carry over


def test_every_slip_differs_from_the_answer_and_the_oracle_is_one_short_command():
    for family in FAMILIES:
        for seed in range(300):
            spec = generate(family, seed)  # asserts the wrong command's result differs from the answer
            assert len(spec.oracle) <= 60 and "\n" not in spec.oracle, (family, seed, spec.oracle)
    with pytest.raises(ValueError, match="unknown terminal family 'nope'"):
        generate("nope", 0)


def test_build_writes_harbor_folders_the_loader_reads(tmp_path):
    written = build(tmp_path, seeds=2)
    tasks = load_tasks(tmp_path)
    assert [t.id for t in tasks] == sorted(written) == sorted(ids(2)) and len(tasks) == 2 * len(FAMILIES)
    for t in tasks:
        oracle = load_policy(t, "oracle")
        assert [[c.name for c in turn] for turn in oracle] == [["bash"], ["submit"]]
        assert (t.root / "solution" / "solve.sh").read_text() == render_solution(oracle)
        assert t.metadata["family"] in FAMILIES and t.max_turns >= 2 and t.reward == {"tests_pass": 1.0}


def test_split_flag_builds_only_that_split_and_the_documented_size_holds_100_heldout(tmp_path):
    assert heldout_count(HELDOUT_SEEDS) >= 100
    written = build(tmp_path, seeds=HELDOUT_SEEDS, split="heldout")
    heldout = registry_load_tasks("terminal", str(tmp_path), "heldout")
    assert len(heldout) == len(written) == heldout_count(HELDOUT_SEEDS)
    with pytest.raises(ValueError, match="'train' split is empty"):
        registry_load_tasks("terminal", str(tmp_path), "train")


def test_first_seed_builds_fresh_seeds_for_grpo_beyond_the_sfts(tmp_path):
    from jointrl.envs.terminal.generate import main

    main(["--out", str(tmp_path), "--seeds", "3", "--first-seed", "40", "--split", "train"])
    fresh = {t.id for t in registry_load_tasks("terminal", str(tmp_path), "train")}
    assert fresh == set(ids(3, "train", first_seed=40)) and fresh
    assert {int(i.rsplit("-s", 1)[1]) for i in fresh} <= {40, 41, 42} and not fresh & set(ids(40))


@needs_bwrap
def test_two_seeds_of_every_family_oracle_noop_wrong_through_the_agent_loop(tmp_path):
    build(tmp_path, seeds=2)
    check([(t, name) for t in load_tasks(tmp_path) for name in ("oracle", "noop", "wrong")])


@needs_bwrap
@pytest.mark.slow
def test_every_heldout_task_of_the_documented_size_oracle_and_noop(tmp_path):
    build(tmp_path, seeds=HELDOUT_SEEDS, split="heldout")
    tasks = registry_load_tasks("terminal", str(tmp_path), "heldout")
    assert len(tasks) >= 100
    check([(t, name) for t in tasks for name in ("oracle", "noop")])
