"""parse_turn on Kimi turns in the ids of Kimi's tokenizer files built in the test (tests/conftest.py):
the tool-call section, call and argument markers are read by id; malformed sections are CallErrors."""

from __future__ import annotations

import pytest

from jointrl.envs.base import Message, ToolCall
from jointrl.model.hf_chat_template import HFChatTemplate
from jointrl.model.hf_tokenizer import HFTokenizer
from jointrl.rl.parser import CallError, parse_turn


@pytest.fixture(scope="module")
def tpl(tmp_path_factory, kimi_files) -> HFChatTemplate:
    return HFChatTemplate(HFTokenizer(kimi_files[0](tmp_path_factory.mktemp("kimi_parse"))))


def _ids(tok, *pieces) -> list[int]:
    """Strings are plain text; names in angle-bar form are the special ids."""
    out = []
    for p in pieces:
        out += [tok.special_ids[p]] if p in tok.special_ids else tok.encode(p)
    return out


def test_generated_turn_parses_into_its_calls_with_kimis_ids(tpl):
    tok = tpl.tok
    calls = [ToolCall("run", {"command": "ls -la"}), ToolCall("run", {"command": "cat a.txt"})]
    ids = tpl.assistant_turn(Message(role="assistant", content="On it.", tool_calls=calls))
    assert ids[-1] == tok.im_end_id and tok.special_ids["<|tool_calls_section_begin|>"] in ids
    p = parse_turn(ids, tok)
    assert p.ended and p.closed_thinking and p.reasoning == "" and p.content == "On it."
    assert [(c.name, c.arguments, c.id) for c in p.calls] == [
        ("run", {"command": "ls -la"}, "functions.run:0"), ("run", {"command": "cat a.txt"}, "functions.run:1")]
    # the parsed calls re-render as generated (the loop's history holds the same ids)
    assert tpl.assistant_turn(Message(role="assistant", content=p.content, tool_calls=p.calls)) == ids
    plain = parse_turn(tpl.assistant_turn(Message(role="assistant", content="Done.")), tok)
    assert plain.calls == [] and plain.content == "Done." and plain.ended


def test_markers_typed_as_text_are_not_calls(tpl):
    tok = tpl.tok
    text = '<|tool_calls_section_begin|><|tool_call_begin|>functions.run:0<|tool_call_argument_begin|>{}<|tool_call_end|>'
    p = parse_turn([*tok.encode(text), tok.im_end_id], tok)
    assert p.calls == [] and p.content == text


@pytest.mark.parametrize("pieces, error", [
    (("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.run:0", "<|tool_call_argument_begin|>",
      '{"command": "ls"}', "<|tool_call_end|>"), "section_begin|> was not closed"),
    (("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.run:0", '{"command": "ls"}',
      "<|tool_call_end|>", "<|tool_calls_section_end|>"), "<|tool_call_end|> without"),
    (("<|tool_call_begin|>", "functions.run:0", "<|tool_call_argument_begin|>", "{}", "<|tool_call_end|>"),
     "outside <|tool_calls_section_begin|>"),
    (("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "run", "<|tool_call_argument_begin|>", "{}",
      "<|tool_call_end|>", "<|tool_calls_section_end|>"), "must be functions.NAME:INDEX"),
    (("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.run:0", "<|tool_call_argument_begin|>",
      "{not json", "<|tool_call_end|>", "<|tool_calls_section_end|>"), "not valid JSON"),
    (("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.run:0", "<|tool_call_argument_begin|>",
      "[1]", "<|tool_call_end|>", "<|tool_calls_section_end|>"), "must be a JSON object"),
    (("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.run:0", "<|tool_call_argument_begin|>",
      "{}", "<|tool_calls_section_end|>"), "inside a call"),
    (("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.run:0", "<|tool_call_begin|>",
      "functions.run:1", "<|tool_call_argument_begin|>", "{}", "<|tool_call_end|>", "<|tool_calls_section_end|>"),
     "again before"),
    (("<|tool_calls_section_begin|>", "stray words", "<|tool_calls_section_end|>"), "text inside the tool-calls"),
    (("<|tool_calls_section_end|>",), "without <|tool_calls_section_begin|>"),
    (("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.run:0", "<|tool_call_argument_begin|>", "{}",
      "<|tool_call_argument_begin|>", "{}", "<|tool_call_end|>", "<|tool_calls_section_end|>"), "twice in one"),
])
def test_malformed_sections_are_call_errors(tpl, pieces, error):
    tok = tpl.tok
    p = parse_turn([*_ids(tok, "Let me look.", *pieces), tok.im_end_id], tok)
    errors = [c for c in p.calls if isinstance(c, CallError)]
    assert errors and error in errors[0].message, p.calls
    assert p.content.startswith("Let me look.")


_CALL = ("<|tool_call_begin|>", "functions.run:0", "<|tool_call_argument_begin|>", '{"command": "ls"}',
         "<|tool_call_end|>")


@pytest.mark.parametrize("pieces, error", [
    (_CALL, "outside <|tool_calls_section_begin|>"),  # no section at all
    (("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.run:0", *_CALL,
      "<|tool_calls_section_end|>"), "again before"),
    (("<|tool_calls_section_begin|>", "<|tool_calls_section_begin|>", *_CALL, "<|tool_calls_section_end|>"),
     "inside an open section"),
    (("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.run:0", "<|tool_call_argument_begin|>",
      "{}", "<|tool_call_argument_begin|>", '{"command": "ls"}', "<|tool_call_end|>", "<|tool_calls_section_end|>"),
     "twice in one"),
])
def test_no_call_runs_after_a_marker_out_of_place(tpl, pieces, error):
    """What follows a misplaced marker up to the next valid point is discarded: no ``ToolCall`` comes out."""
    tok = tpl.tok
    p = parse_turn([*_ids(tok, "hi ", *pieces), tok.im_end_id], tok)
    assert p.calls and all(isinstance(c, CallError) for c in p.calls), p.calls
    assert error in p.calls[0].message


def test_a_valid_call_after_the_discarded_one_still_runs(tpl):
    tok = tpl.tok
    p = parse_turn([*_ids(tok, "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.run:0", *_CALL,
                          *_CALL[:1], "functions.run:2", *_CALL[2:], "<|tool_calls_section_end|>"), tok.im_end_id],
                   tok)
    assert isinstance(p.calls[0], CallError) and "again before" in p.calls[0].message
    assert p.calls[1:] == [ToolCall("run", {"command": "ls"}, id="functions.run:2")]
    first = parse_turn([*_ids(tok, *_CALL, "<|tool_calls_section_begin|>", *_CALL, "<|tool_calls_section_end|>"),
                        tok.im_end_id], tok)  # a stray call, then the turn's one section
    assert isinstance(first.calls[0], CallError) and first.calls[1:] == [ToolCall("run", {"command": "ls"},
                                                                                    id="functions.run:0")]


def test_one_section_per_turn_and_nothing_after_it(tpl):
    """Kimi's template writes the content, then one section, then ``<|im_end|>``: a second section is an
    error and its calls are dropped; text after the section is an error beside the section's calls."""
    tok = tpl.tok
    section = ("<|tool_calls_section_begin|>", *_CALL, "<|tool_calls_section_end|>")
    two = parse_turn([*_ids(tok, "Ok.", *section, *section), tok.im_end_id], tok)
    assert two.calls[0] == ToolCall("run", {"command": "ls"}, id="functions.run:0")
    assert len(two.calls) == 2 and "a second <|tool_calls_section_begin|>" in two.calls[1].message
    tail = parse_turn([*_ids(tok, "Ok.", *section, " and more"), tok.im_end_id], tok)
    assert tail.content == "Ok." and tail.calls[0] == ToolCall("run", {"command": "ls"}, id="functions.run:0")
    assert len(tail.calls) == 2 and "text after <|tool_calls_section_end|>" in tail.calls[1].message
    assert tail.calls[1].raw.strip() == "and more"
    spaced = parse_turn([*_ids(tok, "Ok.", *section, "\n"), tok.im_end_id], tok)
    assert spaced.calls == [ToolCall("run", {"command": "ls"}, id="functions.run:0")]


def test_completed_calls_are_kept_beside_an_error(tpl):
    tok = tpl.tok
    ids = _ids(tok, "<|tool_calls_section_begin|>", "<|tool_call_begin|>", " functions.run:0 ",
               "<|tool_call_argument_begin|>", '{"command": "ls"}', "<|tool_call_end|>", "<|tool_call_begin|>",
               "functions.run:1", "<|tool_call_argument_begin|>", '{"command": ')  # cut by max_tokens
    p = parse_turn(ids, tok)
    assert not p.ended and p.calls[0] == ToolCall("run", {"command": "ls"}, id="functions.run:0")
    assert isinstance(p.calls[1], CallError) and "was not closed with <|tool_call_end|>" in p.calls[1].message
    assert p.num_errors == 2  # the section is open too


def test_thinking_vocabulary_reads_reasoning_first(tmp_path, kimi_files):
    tok = HFTokenizer(kimi_files[0](tmp_path, think=True))
    ids = _ids(tok, "<think>", "I will list.", "</think>", "Ok.", "<|tool_calls_section_begin|>",
               "<|tool_call_begin|>", "functions.run:0", "<|tool_call_argument_begin|>", "{}", "<|tool_call_end|>",
               "<|tool_calls_section_end|>", "<|im_end|>")
    p = parse_turn(ids, tok)
    assert p.closed_thinking and p.reasoning == "I will list." and p.content == "Ok."
    assert p.calls == [ToolCall("run", {}, id="functions.run:0")]
    unclosed = parse_turn(_ids(tok, "<think>", "still thinking <|tool_calls_section_begin|>"), tok)
    assert not unclosed.closed_thinking and unclosed.calls == []
