import json

from jointrl.model.tokenizer import ByteTokenizer
from jointrl.rl.parser import parse_turn

tok = ByteTokenizer()

def turn(*parts) -> list[int]:
    ids = []
    for p in parts:
        ids += tok.encode(p) if isinstance(p, str) else [p]
    return ids


def call(obj) -> list:
    return [tok.tool_call_id, json.dumps(obj) if not isinstance(obj, str) else obj, tok.tool_call_end_id]


def test_calls_after_thinking_in_order():
    ids = turn("plan", tok.think_end_id, "text ", *call({"name": "bash", "arguments": {"command": "ls"}}),
               *call({"name": "submit", "arguments": {}}), tok.im_end_id)
    p = parse_turn(ids, tok)
    assert (p.reasoning, p.content, p.ended) == ("plan", "text ", True)
    assert [c.name for c in p.calls] == ["bash", "submit"]
    assert p.calls[0].arguments == {"command": "ls"}


def test_tool_call_inside_thinking_is_not_a_call():
    ids = turn("think ", *call({"name": "bash", "arguments": {"command": "ls"}}), tok.think_end_id, "done", tok.im_end_id)
    p = parse_turn(ids, tok)
    assert p.calls == [] and p.content == "done"


def test_tool_call_written_as_plain_text_is_text():
    ids = turn(tok.think_end_id, '<tool_call>{"name": "bash", "arguments": {}}</tool_call>', tok.im_end_id)
    p = parse_turn(ids, tok)
    assert p.calls == [] and p.content.startswith("<tool_call>")


def test_malformed_calls_become_errors_in_place():
    ids = turn(tok.think_end_id, *call("{not json"), *call({"name": "bash", "arguments": {"command": "ls"}}),
               *call({"name": "bash", "arguments": "ls"}), *call([1, 2]), tok.tool_call_id, "{", tok.im_end_id)
    p = parse_turn(ids, tok)
    kinds = [type(c).__name__ for c in p.calls]
    assert kinds == ["CallError", "ToolCall", "CallError", "CallError", "CallError"]
    assert "not valid JSON" in p.calls[0].message
    assert "must be a JSON object" in p.calls[2].message
    assert "not closed" in p.calls[4].message
    assert p.num_errors == 4


def test_unterminated_turn():
    p = parse_turn(turn("still thinking"), tok)
    assert not p.ended and not p.closed_thinking and p.reasoning == "still thinking"
