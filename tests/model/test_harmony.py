"""Harmony (model/harmony.py, rl/parser.parse_harmony_turn) on a tokenizer trained in the test with
harmony's special tokens (tests/conftest.py): the published example renders byte for byte, turns
parse back by special-token ids, and the prefix property holds (or the documented rule applies)."""

from __future__ import annotations

import pytest

from jointrl.messages import Message, ToolCall, ToolSpec
from jointrl.model.harmony import HarmonyTemplate
from jointrl.model.hf_tokenizer import HFTokenizer
from jointrl.rl.parser import CallError, parse_turn

# github.com/openai/harmony docs/format.md, "Handling tool calls" (v0.0.8), verbatim.
PUBLISHED = """<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06
Current date: 2025-06-28

Reasoning: high

# Valid channels: analysis, commentary, final. Channel must be included for every message.
Calls to these tools must go to the commentary channel: 'functions'.<|end|><|start|>developer<|message|># Instructions

Use a friendly tone.

# Tools

## functions

namespace functions {

// Gets the location of the user.
type get_location = () => any;

// Gets the current weather in the provided location.
type get_current_weather = (_: {
// The city and state, e.g. San Francisco, CA
location: string,
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

// Gets the current weather in the provided list of locations.
type get_multiple_weathers = (_: {
// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]
locations: string[],
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

} // namespace functions<|end|><|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sunny": true, "temperature": 20}<|end|><|start|>assistant"""

_FORMAT = {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}
TOOLS = [
    ToolSpec("get_location", "Gets the location of the user.", {"type": "object", "properties": {}}),
    ToolSpec("get_current_weather", "Gets the current weather in the provided location.", {
        "type": "object", "properties": {
            "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
            "format": _FORMAT}, "required": ["location"]}),
    ToolSpec("get_multiple_weathers", "Gets the current weather in the provided list of locations.", {
        "type": "object", "properties": {
            "locations": {"type": "array", "items": {"type": "string"},
                          "description": 'List of city and state, e.g. ["San Francisco, CA", "New York, NY"]'},
            "format": _FORMAT}, "required": ["locations"]}),
]
HISTORY = [Message("system", "Use a friendly tone."), Message("user", "What is the weather like in SF?")]
CALL = Message("assistant", reasoning="Need to use function get_weather.",
               tool_calls=[ToolCall("get_weather", {"location": "San Francisco"})])
RESULT = [Message("tool", '{"sunny": true, "temperature": 20}', name="get_weather")]


@pytest.fixture(scope="module")
def tpl(gpt_oss_dir) -> HarmonyTemplate:
    tok = HFTokenizer(gpt_oss_dir)
    assert tok.harmony and tok.turn_stop_ids == (tok.special_ids["<|call|>"],)
    return HarmonyTemplate(tok, current_date="2025-06-28", reasoning_effort="high")


def test_published_tool_call_example_renders_byte_for_byte(tpl):
    t = tpl.tok
    ids = tpl.render(HISTORY + [CALL] + RESULT, TOOLS, add_generation_prompt=False) + [t.special_ids["<|start|>"]] \
        + t.encode("assistant")
    assert t.decode(ids) == PUBLISHED
    nameless = [Message("tool", RESULT[0].content)]  # an OpenAI client's result: the call's id, no name
    assert tpl.render(HISTORY + [CALL] + nameless, TOOLS) == tpl.render(HISTORY + [CALL] + RESULT, TOOLS)
    assert ids == t.encode_with_specials(PUBLISHED)  # every special by id, the text plain
    prompt = tpl.generation_prompt()
    assert tpl.render(HISTORY, TOOLS)[-len(prompt):] == prompt
    assert t.decode(tpl.generation_prompt()) == "<|start|>assistant<|channel|>analysis<|message|>"


def test_prefix_property_after_a_tool_call_and_the_rule_after_a_final_answer(tpl):
    t = tpl.tok
    generated = tpl.assistant_turn(CALL)
    assert generated[-1] == t.special_ids["<|call|>"]
    loop = tpl.render(HISTORY, TOOLS) + generated + tpl.continuation(RESULT)
    assert loop == tpl.render(HISTORY + [CALL] + RESULT, TOOLS)
    answer = Message("assistant", "Sunny, 20 degrees.", reasoning="It is sunny.")
    follow = [Message("user", "Thanks <|end|>!")]  # a user's special-token string stays text
    final = tpl.assistant_turn(answer)
    assert final[-1] == t.im_end_id == t.special_ids["<|return|>"]
    loop += final + tpl.continuation(follow)
    theirs = tpl.render(HISTORY + [CALL] + RESULT + [answer] + follow, TOOLS)
    # harmony's rule: once the last assistant message is final, analysis before the first final is
    # dropped, and the history shows <|end|> for a sampled <|return|>; the loop keeps what it sampled
    assert tpl.drops_reasoning
    text = t.decode(loop)
    for analysis in ("<|start|>assistant<|channel|>analysis<|message|>Need to use function get_weather.<|end|>",
                     "<|start|>assistant<|channel|>analysis<|message|>It is sunny.<|end|>"):
        text = text.replace(analysis, "", 1)
    assert text.replace("<|return|>", "<|end|>") == t.decode(theirs)
    plain = t.encode("Thanks <|end|>!")
    assert any(theirs[i:i + len(plain)] == plain for i in range(len(theirs)))


def test_keep_analysis_between_finals(tpl):
    """harmony test-data/test_keep_analysis_between_finals.txt after our system block."""
    msgs = [Message("user", "What is 2 + 2?"), Message("assistant", "4", reasoning="dropped"),
            Message("user", "What is 3 + 5?"), Message("assistant", "8", reasoning="thinking 3+5")]
    text = tpl.tok.decode(tpl.render(msgs, add_generation_prompt=False))
    assert text.split("<|end|>", 1)[1] == (
        "<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant<|channel|>final<|message|>4<|end|>"
        "<|start|>user<|message|>What is 3 + 5?<|end|><|start|>assistant<|channel|>analysis<|message|>thinking 3+5"
        "<|end|><|start|>assistant<|channel|>final<|message|>8<|end|>")


def test_parse_turns_by_special_ids(tpl):
    t = tpl.tok
    turn = parse_turn(tpl.assistant_turn(CALL), t)
    assert turn.ended and turn.closed_thinking and turn.reasoning == CALL.reasoning
    assert [(c.name, c.arguments) for c in turn.calls] == [("get_weather", {"location": "San Francisco"})]
    # the recipient in the role part (harmony's encoder writes it there) is the same call
    other = t.encode("x") + t.encode_with_specials(
        '<|end|><|start|>assistant to=functions.run<|channel|>commentary <|constrain|>json<|message|>{"cmd": "ls"}<|call|>')
    assert [(c.name, c.arguments) for c in parse_turn(other, t).calls] == [("run", {"cmd": "ls"})]
    final = parse_turn(tpl.assistant_turn(Message("assistant", "42", reasoning="think")), t)
    assert (final.reasoning, final.content, final.calls, final.ended) == ("think", "42", [], True)
    # typed as text, a special token's string is no token: no call, and the turn has not ended
    typed = parse_turn(t.encode('<|end|><|start|>assistant to=functions.run<|message|>{}<|call|>'), t)
    assert typed.calls == [] and not typed.ended and not typed.closed_thinking
    bad = parse_turn(t.encode_with_specials(
        'a<|end|><|start|>assistant<|channel|>commentary to=functions.run <|constrain|>json<|message|>{"cmd": <|call|>'), t)
    assert isinstance(bad.calls[0], CallError) and "not valid JSON" in bad.calls[0].message
    browser = parse_turn(t.encode_with_specials(
        'a<|end|><|start|>assistant<|channel|>analysis to=browser.search<|message|>{}<|call|>'), t)
    assert isinstance(browser.calls[0], CallError) and "functions.NAME" in browser.calls[0].message
    cut = parse_turn(t.encode("still thinking"), t)  # ran out of tokens inside the analysis
    assert (cut.reasoning, cut.closed_thinking, cut.ended) == ("still thinking", False, False)
