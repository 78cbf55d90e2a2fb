"""parse_turn on a Qwen3-style turn in the ids of a BPE tokenizer trained in the test
(tests/conftest.py): the turn opens <think> itself, calls are <tool_call>\\n{json}\\n</tool_call>."""

from __future__ import annotations

from jointrl.envs.base import Message, ToolCall
from jointrl.model.hf_chat_template import PROBE_TOOLS, HFChatTemplate
from jointrl.model.hf_tokenizer import HFTokenizer
from jointrl.rl.parser import CallError, parse_turn


def _generated(tpl: HFChatTemplate, turn: Message) -> list[int]:
    """The ids the model would write for ``turn``: its canonical rendering, through the end token."""
    history = [Message(role="user", content="list files")]
    prompt = tpl.render(history, PROBE_TOOLS)
    full = tpl.render(history + [turn], PROBE_TOOLS, add_generation_prompt=False)
    return full[len(prompt): full.index(tpl.tok.im_end_id, len(prompt)) + 1]


def test_qwen3_turn_parses_into_its_calls(qwen3_dir):
    tpl = HFChatTemplate(HFTokenizer(qwen3_dir))
    calls = [ToolCall("run", {"command": "ls -la"}), ToolCall("run", {"command": "cat a.txt"})]
    ids = _generated(tpl, Message(role="assistant", reasoning="two calls", content="On it.", tool_calls=calls))
    assert ids[0] == tpl.tok.think_id and ids[-1] == tpl.tok.im_end_id
    p = parse_turn(ids, tpl.tok)
    assert p.ended and p.closed_thinking and p.reasoning.strip() == "two calls"
    assert [(c.name, c.arguments) for c in p.calls] == [(c.name, c.arguments) for c in calls]
    assert p.content.strip() == "On it."


def test_tags_as_text_are_not_calls(qwen3_dir):
    tok = HFTokenizer(qwen3_dir)
    body = tok.encode('<tool_call>{"name": "run", "arguments": {}}</tool_call>')
    ids = [tok.think_id, *tok.encode("hm"), tok.think_end_id, *body, tok.im_end_id]
    p = parse_turn(ids, tok)
    assert p.calls == [] and p.content == '<tool_call>{"name": "run", "arguments": {}}</tool_call>'
    broken = [tok.think_id, tok.think_end_id, tok.tool_call_id, *tok.encode("{not json"), tok.tool_call_end_id]
    assert isinstance(parse_turn(broken, tok).calls[0], CallError)
