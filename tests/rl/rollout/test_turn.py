"""``generate_turn``: the one owner of the thinking budget, driven here by a ``ScriptedEngine``
(an engine whose every token is known) and checked against the engines' sources: no backend
keeps budget logic of its own."""

import ast
import asyncio
from pathlib import Path

import pytest

from jointrl.model.chat_template import ChatTemplate
from jointrl.rl.rollout.scripted import ScriptedEngine
from jointrl.rl.rollout.turn import continuation_seed, generate_turn
from jointrl.rl.types import SamplingParams

TPL = ChatTemplate()
TOK = TPL.tok
PROMPT = [TOK.im_start_id, *TOK.encode("assistant\n"), TOK.think_id]
REASONING, TEXT = "abcdefgh", "ok"  # 8 reasoning tokens, then the answer
TURN = [*TOK.encode(REASONING), TOK.think_end_id, *TOK.encode(TEXT), TOK.im_end_id]
ROLLOUT = Path(__file__).parents[3] / "rl" / "rollout"


def turn(budget, max_tokens=64, prompt=PROMPT, script=TURN, **kw):
    engine = ScriptedEngine([list(script)], TPL)
    out = asyncio.run(generate_turn(engine, prompt, SamplingParams(max_tokens=max_tokens, **kw), budget, TOK))
    return out, engine


def test_budget_cut_forces_a_masked_close_and_continues_after_the_scripts_own():
    out, engine = turn(3)
    assert out.token_ids == [*TOK.encode("abc"), TOK.think_end_id, *TOK.encode(TEXT), TOK.im_end_id]
    assert out.sampled == [1, 1, 1, 0, 1, 1, 1] and out.logprobs[3] == 0.0
    assert (out.think_tokens, out.finish_reason) == (3, "stop")
    assert engine.prompts == [PROMPT]  # one scripted turn, continued in the same session


@pytest.mark.parametrize("budget", [None, 9, 100])
def test_reasoning_within_the_budget_is_all_sampled(budget):
    """The model closes its reasoning itself when ``</think>`` comes within the budget; at
    budget 8 its 9th token would be over it, and the close is forced (as the engines did)."""
    out, _ = turn(budget)
    assert out.token_ids == TURN and out.sampled == [1] * len(TURN)
    assert (out.think_tokens, out.finish_reason) == (8, "stop")


def test_budget_spent_exactly_forces_the_close():
    out, _ = turn(8)
    assert out.token_ids == TURN and out.sampled == [1] * 8 + [0] + [1] * 3 and out.think_tokens == 8


def test_zero_budget_closes_before_any_reasoning():
    out, _ = turn(0)
    assert out.token_ids == [TOK.think_end_id, *TOK.encode(TEXT), TOK.im_end_id]
    assert out.sampled == [0, 1, 1, 1] and out.think_tokens == 0


def test_max_tokens_bounds_the_whole_turn_forced_token_included():
    out, _ = turn(3, max_tokens=3)  # the budget is never reached: the turn is cut first
    assert (out.token_ids, out.finish_reason, out.think_tokens) == (TOK.encode("abc"), "length", 3)
    out, _ = turn(3, max_tokens=4)  # the forced close takes the last slot
    assert out.token_ids == [*TOK.encode("abc"), TOK.think_end_id]
    assert (out.sampled, out.finish_reason) == ([1, 1, 1, 0], "length")
    out, _ = turn(3, max_tokens=5)
    assert (len(out.token_ids), out.finish_reason) == (5, "length")


def test_a_turn_ended_inside_its_reasoning_is_not_continued():
    script = [*TOK.encode("ab"), TOK.im_end_id]
    out, _ = turn(5, script=script)
    assert (out.token_ids, out.sampled, out.finish_reason, out.think_tokens) == (script, [1, 1, 1], "stop", 3)


def test_a_prompt_that_does_not_open_think_is_one_plain_call():
    out, _ = turn(2, prompt=PROMPT[:-1])
    assert out.token_ids == TURN and out.sampled == [1] * len(TURN) and out.think_tokens == 0


def test_negative_budget_is_refused_by_name():
    with pytest.raises(ValueError, match="think_budget"):
        turn(-1)


def test_continuation_seed_is_deterministic_and_apart_from_its_neighbours():
    seeds = range(1000, 1100)
    mixed = [continuation_seed(s) for s in seeds]
    assert mixed == [continuation_seed(s) for s in seeds] and continuation_seed(None) is None
    assert len(set(mixed)) == len(mixed) and not set(mixed) & set(seeds)
    assert all(0 <= s < 2 ** 63 for s in mixed)


def _identifiers(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.arg)):
            names.add(node.name if isinstance(node, ast.FunctionDef) else node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


@pytest.mark.parametrize("module", ["llm_engine.py", "sampler.py", "sequence.py", "scheduler.py", "model_runner.py"])
def test_engines_hold_no_budget_code(module):
    """The budget lives in ``turn.py`` only: no engine module names ``<think>`` / ``</think>``
    (``think_id``, ``think_end_id``) or a thinking count (``max_think_tokens``, ``think_used``)."""
    assert not {n for n in _identifiers(ROLLOUT / module) if "think" in n.lower()}
