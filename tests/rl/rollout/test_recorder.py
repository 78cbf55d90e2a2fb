"""``ConversationStore``: generated turns re-enter the context as sampled, never re-tokenized."""

import json

from jointrl.envs.base import Message, ToolCall, ToolSpec
from jointrl.model.chat_template import ChatTemplate
from jointrl.rl.rollout.recorder import ConversationStore, read_trajectories
from jointrl.rl.types import GenerationOutput

TPL = ChatTemplate()
TOK = TPL.tok
TOOLS = [ToolSpec("calc", "", {"type": "object", "properties": {"expr": {"type": "string"}}})]
START = [Message(role="system", content="s"), Message(role="user", content="u")]


def turn(raw_call: str, forced_think: bool = False) -> GenerationOutput:
    """A turn with a tool call written in non-canonical JSON (no spaces) and, optionally, a forced </think>."""
    ids = [*TOK.encode("hm"), TOK.think_end_id, TOK.tool_call_id, *TOK.encode(raw_call), TOK.tool_call_end_id,
           TOK.im_end_id]
    sampled = [0 if (forced_think and i == TOK.think_end_id) else 1 for i in ids]
    return GenerationOutput(ids, [-0.5 * s for s in sampled], sampled, "stop", policy_version=3)


def reply(call_id: str) -> Message:
    return Message(role="assistant", reasoning="hm", tool_calls=[ToolCall("calc", {"expr": "1"}, call_id)])


def test_follow_up_reuses_generated_tokens_and_records_the_agent_loop_layout(tmp_path):
    store = ConversationStore(TPL, record_path=tmp_path / "rec.jsonl")
    prep = store.prepare(START, TOOLS)
    assert prep.prompt_ids == TPL.render(START, TOOLS)
    out = turn('{"name":"calc","arguments":{"expr":"1"}}', forced_think=True)
    conv = store.commit(prep, out, reply("c1"))
    follow = [*START, reply("c1"), Message(role="tool", content="1")]
    prep2 = store.prepare(follow, TOOLS)
    assert prep2.base is conv and prep2.reused_tokens == len(prep.prompt_ids) + len(out.token_ids)
    assert prep2.prompt_ids == prep.prompt_ids + out.token_ids + TPL.continuation([Message(role="tool", content="1")])
    assert prep2.prompt_ids != TPL.render(follow, TOOLS)  # a re-render would rewrite the JSON with spaces
    conv2 = store.commit(prep2, turn('{"name":"calc","arguments":{"expr":"1"}}'), reply("c2"))
    assert conv2.id == conv.id and conv2.num_turns == 2
    traj = store.finish(conv.id, reward=1.0)
    n0 = len(prep.prompt_ids)
    assert traj.loss_mask[:n0] == [0] * n0 and traj.loss_mask[n0:n0 + len(out.token_ids)] == out.sampled
    assert traj.policy_version[n0 + 2] == -1  # the forced </think>
    assert sum(traj.loss_mask) == sum(out.sampled) + len(out.token_ids)
    (recorded,) = read_trajectories(tmp_path / "rec.jsonl")
    assert recorded.token_ids == traj.token_ids and recorded.logprobs == traj.logprobs and recorded.reward == 1.0


def test_divergence_forks_and_a_cut_turn_is_not_reused():
    store = ConversationStore(TPL)
    prep = store.prepare(START, TOOLS)
    conv = store.commit(prep, turn('{"name":"calc","arguments":{"expr":"1"}}'), reply("c1"))
    edited = [*START, Message(role="assistant", content="other"), Message(role="user", content="again")]
    prep2 = store.prepare(edited, TOOLS)
    assert prep2.base is conv and prep2.matched == 2  # diverges at message 2
    other = GenerationOutput(TOK.encode("ab"), [-1.0, -1.0], [1, 1], "length", 0)  # cut by max_tokens
    fork = store.commit(prep2, other, Message(role="assistant", content="ab"))
    assert fork.id != conv.id and len(store) == 2 and fork.ends[-1] is None
    prep3 = store.prepare([*edited, Message(role="assistant", content="ab"), Message(role="user", content="x")], TOOLS)
    assert prep3.matched == len(edited)  # the cut turn is re-rendered, not reused
    assert json.loads(json.dumps(prep3.prompt_ids)) == prep3.prompt_ids


def test_harmony_follow_up_reuses_a_call_turn_ended_by_call(gpt_oss_dir):
    """Harmony (model/harmony.py): messages end at <|end|> / <|call|> / <|return|>, so a follow-up after a
    tool-call turn (which ends <|call|>, not im_end_id) reuses the sampled tokens."""
    from jointrl.model.harmony import HarmonyTemplate  # the harmony fixture's tokenizer, only in this test
    from jointrl.model.hf_tokenizer import HFTokenizer

    tpl = HarmonyTemplate(HFTokenizer(gpt_oss_dir))
    tok = tpl.tok
    store = ConversationStore(tpl)
    prep = store.prepare(START, TOOLS)
    ids = [*tok.encode("hm"), tok.think_end_id, *tok.encode_with_specials(
        '<|start|>assistant to=functions.calc<|channel|>commentary <|constrain|>json<|message|>{"expr": "1"}<|call|>')]
    out = GenerationOutput(ids, [-0.5] * len(ids), [1] * len(ids), "stop", policy_version=3)
    conv = store.commit(prep, out, reply("c1"))
    result = Message(role="tool", content="1", name="calc")  # the API names a result after its call
    prep2 = store.prepare([*START, reply("c1"), result], TOOLS)
    assert prep2.base is conv and prep2.reused_tokens == len(prep.prompt_ids) + len(ids)
    assert prep2.prompt_ids == prep.prompt_ids + ids + tpl.continuation([result])
