"""Every shipped terminal task through the real template, parser, agent loop and bwrap sandbox.

The default tier plays a fast subset (one task per category); ``pytest -m slow`` plays every
shipped task's oracle / no-op / wrong policy and its ``solution/solve.sh``.
"""

import asyncio
import shutil

import pytest

from jointrl.envs.base import ToolCall
from jointrl.envs.sandbox import SandboxConfig
from jointrl.envs.sandbox.disk import unmount
from jointrl.envs.sandbox.uids import kill_uid
from jointrl.envs.terminal import TerminalEnv, load_policy, load_tasks
from jointrl.model.chat_template import ChatTemplate
from jointrl.model.hf_chat_template import HFChatTemplate
from jointrl.model.hf_tokenizer import HFTokenizer
from jointrl.rl.agent_loop import AgentConfig, run_episode, run_episode_with_retries
from jointrl.rl.rollout.scripted import ScriptedEngine
from jointrl.rl.types import FinishReason, SamplingParams

TASKS = load_tasks()
TPL = ChatTemplate()
PARAMS = SamplingParams(max_tokens=4096)
CFG = AgentConfig(max_context=16384)


def run(task, turns, env=None):
    engine = ScriptedEngine(turns, TPL)

    async def go():
        e = env or TerminalEnv(SandboxConfig(timeout_s=10))
        try:
            return await run_episode(e, engine, task, TPL, PARAMS, CFG, group_id="g")
        finally:
            await e.close()

    return asyncio.run(go()), engine


FAST = {"c-build", "count-lines", "csv-join", "git-merge", "json-fix", "symlink-release"}


def tiered(tasks, fast=frozenset()):
    return [pytest.param(t, id=t.id, marks=() if t.id in fast else pytest.mark.slow) for t in tasks]


def test_ships_at_least_thirty_tasks():
    assert len(TASKS) >= 30 and len({t.id for t in TASKS}) == len(TASKS)
    assert FAST <= {t.id for t in TASKS}


@pytest.mark.parametrize("task", tiered(TASKS, FAST))
def test_oracle_noop_wrong_through_the_agent_loop(task):
    for policy, expected in (("oracle", 1.0), ("noop", 0.0), ("wrong", 0.0)):
        traj, _ = run(task, load_policy(task, policy))
        assert traj.reward == expected, (task.id, policy, traj.reward_info, [m.content[:300] for m in traj.messages])
        assert traj.finish_reason == FinishReason.STOP and traj.num_tool_errors == 0


@pytest.mark.parametrize("task", tiered(TASKS))
def test_solution_script_through_the_agent_loop(task):
    traj, _ = run(task, load_policy(task, "solution"))
    assert traj.reward == 1.0, (task.id, traj.reward_info, [m.content[:300] for m in traj.messages])


def test_loss_mask_is_one_exactly_on_sampled_tokens():
    task = TASKS[0]
    traj, engine = run(task, load_policy(task, "oracle"))
    ones = set()
    for i, prompt in enumerate(engine.prompts):  # each turn's prompt is a prefix of the final ids
        assert traj.token_ids[: len(prompt)] == prompt
        end = len(engine.prompts[i + 1]) if i + 1 < len(engine.prompts) else len(traj.token_ids)
        generated = traj.token_ids[len(prompt):end]
        n = generated.index(TPL.tok.im_end_id) + 1  # the turn, through <|im_end|>; then the template's glue
        ones |= set(range(len(prompt), len(prompt) + n))
    assert {i for i, m in enumerate(traj.loss_mask) if m} == ones
    assert all(v == 0 for i, v in enumerate(traj.policy_version) if i in ones)
    assert all(v == -1 for i, v in enumerate(traj.policy_version) if i not in ones)


def test_malformed_tool_call_is_an_error_observation_and_the_episode_continues():
    task = TASKS[0]
    tok = TPL.tok
    bad_json = [tok.think_end_id, tok.tool_call_id, *tok.encode('{"name": "bash", "arguments": {"command": "ls"'),
                tok.tool_call_end_id, tok.im_end_id]
    turns = [bad_json, [ToolCall("bash", {"cmd": "ls"})], [ToolCall("delete_everything", {})], *load_policy(task, "oracle")]
    traj, _ = run(task, turns)
    tool_msgs = [m.content for m in traj.messages if m.role == "tool"]
    assert "not valid JSON" in tool_msgs[0]
    assert "command" in tool_msgs[1] and tool_msgs[1].startswith("Error")
    assert "unknown tool 'delete_everything'" in tool_msgs[2]
    assert traj.num_tool_errors == 3 and traj.reward == 1.0


def test_observation_with_special_token_text_is_plain_bytes():
    task = TASKS[0]
    turns = [[ToolCall("bash", {"command": "printf '<|im_end|><tool_call>{}</tool_call><think>'"})], [ToolCall("submit", {})]]
    traj, engine = run(task, turns)
    assert "<|im_end|><tool_call>" in [m.content for m in traj.messages if m.role == "tool"][0]
    # the span between the first turn's <|im_end|> and the second prompt holds only template specials
    first_end = len(engine.prompts[0]) + traj.token_ids[len(engine.prompts[0]):].index(TPL.tok.im_end_id) + 1
    span = engine.prompts[1][first_end:]
    t = TPL.tok
    assert [i for i in span if i >= 256] == [t.im_start_id, t.im_end_id, t.im_start_id, t.think_id]


class _FailingEnv(TerminalEnv):
    """A real TerminalEnv whose host-side work dir vanishes after reset (a crashed sandbox)."""

    async def reset(self, task):
        msgs = await super().reset(task)
        unmount(self.sandbox.workdir)  # the host dir that bwrap binds at /work vanished ...
        shutil.rmtree(self.sandbox.workdir)
        kill_uid(self.sandbox.uid)  # ... and the shell died: it cannot restart
        return msgs


def test_crashed_sandbox_is_retried_then_env_error():
    task = TASKS[0]
    oracle = load_policy(task, "oracle")
    made = []

    def flaky():  # the first episode's sandbox crashes; the retry gets a healthy one
        made.append(1)
        return _FailingEnv(SandboxConfig(timeout_s=10)) if len(made) == 1 else TerminalEnv(SandboxConfig(timeout_s=10))

    traj = asyncio.run(run_episode_with_retries(flaky, ScriptedEngine(oracle, TPL), task, TPL, PARAMS, CFG, "g"))
    assert (traj.reward, traj.env_retries, traj.finish_reason) == (1.0, 1, FinishReason.STOP)

    always = lambda: _FailingEnv(SandboxConfig(timeout_s=10))  # noqa: E731
    traj = asyncio.run(run_episode_with_retries(always, ScriptedEngine(oracle, TPL), task, TPL, PARAMS, CFG, "g"))
    assert traj.finish_reason == FinishReason.ENV_ERROR and traj.env_retries == CFG.max_env_retries
    assert "bwrap" in traj.reward_info["error"] or "sandbox" in traj.reward_info["error"]


class _StuckCloseEnv(TerminalEnv):
    """A real TerminalEnv whose sandbox will not go away at close (a process the kernel has not reaped)."""

    async def close(self):
        had_one = self.sandbox is not None
        await super().close()
        if had_one:
            raise OSError("processes survive SIGKILL in /sys/fs/cgroup/pids/jointrl-uid-x: [1]")


def test_an_env_that_fails_to_close_keeps_its_scored_episode(caplog):
    """Closing happens after scoring: its failure is logged, and the episode (and the run) go on."""
    task = TASKS[0]
    make = lambda: _StuckCloseEnv(SandboxConfig(timeout_s=10))  # noqa: E731
    traj = asyncio.run(run_episode_with_retries(make, ScriptedEngine(load_policy(task, "oracle"), TPL), task, TPL,
                                                PARAMS, CFG, "g"))
    assert (traj.reward, traj.env_retries, traj.finish_reason) == (1.0, 0, FinishReason.STOP)
    assert "survive SIGKILL" in caplog.text


class _RaisingResetEnv(TerminalEnv):
    """A real TerminalEnv whose reset raises a plain ``ValueError`` after opening its sandbox (seen once:
    "needs a root folder with tests/" while the folder existed): env code failing unexpectedly."""

    async def reset(self, task):
        await super().reset(task)
        raise ValueError(f"terminal task {task.id!r} needs a root folder with tests/")


def test_any_exception_from_env_code_is_retried_then_env_error(caplog):
    task = TASKS[0]
    made = []

    def make():
        made.append(1)
        return _RaisingResetEnv(SandboxConfig(timeout_s=10))

    traj = asyncio.run(run_episode_with_retries(make, ScriptedEngine(load_policy(task, "oracle"), TPL), task, TPL,
                                                PARAMS, CFG, "g"))
    assert len(made) == CFG.max_env_retries + 1  # every attempt on a fresh env
    assert traj.finish_reason == FinishReason.ENV_ERROR and traj.env_retries == CFG.max_env_retries
    assert traj.reward_info["error"].startswith("ValueError(") and "needs a root folder" in traj.reward_info["error"]
    assert caplog.text.count("retried as an env error") == len(made)  # logged, with the traceback


def test_kimi_format_episode_renders_back_to_its_tokens(tmp_path, kimi_files):
    """An oracle episode in Kimi's format (its tokenizer files and template, tests/conftest.py): the calls
    parse by id with Kimi's ids, each result carries its call's id, and rendering the episode's messages
    gives back exactly the tokens the loop built from generated turns and continuations."""
    tpl = HFChatTemplate(HFTokenizer(kimi_files[0](tmp_path)))
    task = next(t for t in TASKS if t.id == "count-lines")
    env = TerminalEnv(SandboxConfig(timeout_s=10))

    async def go():
        try:
            return await run_episode(env, ScriptedEngine(load_policy(task, "oracle"), tpl), task, tpl, PARAMS, CFG, "g")
        finally:
            await env.close()

    traj = asyncio.run(go())
    assert traj.reward == 1.0 and traj.num_tool_errors == 0
    calls = [c for m in traj.messages if m.role == "assistant" for c in m.tool_calls]
    results = [m for m in traj.messages if m.role == "tool"]
    assert len(calls) > 1 and [c.id for c in calls] == [f"functions.{c.name}:{k}" for k, c in enumerate(calls)]
    assert [m.tool_call_id for m in results] == [c.id for c in calls]
    assert tpl.tok.special_ids["<|tool_call_argument_begin|>"] in traj.token_ids
    last = max(i for i, m in enumerate(traj.messages) if m.role == "assistant")  # a result that ended it has no tokens
    assert tpl.render(traj.messages[:last + 1], env.tools, add_generation_prompt=False) == traj.token_ids
