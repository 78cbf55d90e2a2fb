"""Every shipped office task through the real template, parser, agent loop, bwrap sandbox and checker.

The default tier plays a fast subset (one task per document kind: a workbook lookup, a report
edit, a deck lookup; no LibreOffice run: tests/envs/office/test_env.py covers recalculation and
the checker on workbooks); ``pytest -m slow`` plays every task's oracle (1.0), no-op (0.0) and
plausible-but-wrong (0.0) policy.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from jointrl.envs.base import ToolCall
from jointrl.envs.office import OfficeEnv, load_policy, load_tasks
from jointrl.envs.office.env import TOOL_VENV
from jointrl.model.chat_template import ChatTemplate
from jointrl.rl.agent_loop import AgentConfig, run_episode
from jointrl.rl.rollout.scripted import ScriptedEngine
from jointrl.rl.types import FinishReason, SamplingParams

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None or shutil.which("soffice") is None
    or not Path(TOOL_VENV, "bin", "python").exists(),
    reason="needs root, bubblewrap, LibreOffice and the office tool venv (.ci/setup.d/office.sh)")

TASKS = load_tasks()
TPL = ChatTemplate()
FAST = {"budget-lookup-0", "report-edit-0", "deck-lookup-0"}


def run(task, turns):
    async def go():
        env = OfficeEnv()
        try:
            return await run_episode(env, ScriptedEngine(turns, TPL), task, TPL, SamplingParams(max_tokens=4096),
                                     AgentConfig(max_context=32768), group_id="g")
        finally:
            await env.close()

    return asyncio.run(go())


@pytest.mark.parametrize("task", [pytest.param(t, id=t.id, marks=() if t.id in FAST else pytest.mark.slow)
                                  for t in TASKS])
def test_oracle_noop_wrong_through_the_agent_loop(task):
    for policy, expected in (("oracle", 1.0), ("noop", 0.0), ("wrong", 0.0)):
        traj = run(task, load_policy(task, policy))
        assert traj.reward == expected, (task.id, policy, traj.reward_info, [m.content[:300] for m in traj.messages])
        assert traj.finish_reason == FinishReason.STOP and traj.num_tool_errors == 0


def test_malformed_tool_calls_reach_the_model_as_errors_and_the_episode_goes_on():
    task = next(t for t in TASKS if t.id == "budget-lookup-0")
    tok = TPL.tok
    bad_json = [tok.think_end_id, tok.tool_call_id, *tok.encode('{"name": "read_document"'), tok.tool_call_end_id,
                tok.im_end_id]
    turns = [bad_json, [ToolCall("read_document", {"file": "budget.xlsx"})],
             [ToolCall("edit_document", {"path": "budget.xlsx", "op": "add_slide", "title": "x"})],
             *load_policy(task, "oracle")]
    traj = run(task, turns)
    assert traj.reward == 1.0 and traj.num_tool_errors == 3
    errors = [m.content for m in traj.messages if m.role == "tool" and m.content.startswith("Error:")]
    assert "not valid JSON" in errors[0] and "missing required argument(s) ['path']" in errors[1]
    assert "applies to ['.pptx'] documents" in errors[2]


def test_a_hedged_answer_scores_zero():
    task = next(t for t in TASKS if t.id == "budget-lookup-0")
    oracle = load_policy(task, "oracle")
    right = oracle[-1][0].arguments["text"]
    wrong = load_policy(task, "wrong")[-1][0].arguments["text"]
    traj = run(task, [*oracle[:-1], [ToolCall("answer", {"text": f"{wrong} or {right}"})]])
    assert traj.reward == 0.0 and traj.finish_reason == FinishReason.STOP


@pytest.mark.slow
def test_a_total_typed_in_behind_an_equals_sign_scores_zero():
    """add-cost-line's oracle, but the total written as ``=<number>``: right value, no live formula."""
    task = next(t for t in TASKS if t.id == "add-cost-line-0")
    oracle = load_policy(task, "oracle")
    total = next(c["equals"] for c in task.metadata["checks"] if c["type"] == "cell_value" and c["cell"] == "B2")
    fix = oracle[2][0]
    hack = [ToolCall("edit_document", {**fix.arguments, "value": f"={total}"})]
    traj = run(task, [*oracle[:2], hack, oracle[3]])
    assert traj.reward == 0.0 and traj.reward_info["office_checks/failed"] == ["#3 cell_formula"], traj.reward_info
