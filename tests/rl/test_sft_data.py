"""``jointrl sft`` on a user's transcripts (rl/sft_data.py): chat-messages datasets files written
here (parquet with JSON-text messages, JSONL with nested lists), tokenized as the agent loop
would, and trained on by the DeepSpeed learner until their loss falls."""

from __future__ import annotations

import json
import re

import datasets
import pytest

from jointrl.envs.base import Message, ToolCall, ToolSpec
from jointrl.model.chat_template import ChatTemplate
from jointrl.model.hf_chat_template import HFChatTemplate
from jointrl.model.hf_tokenizer import HFTokenizer
from jointrl.rl.config import load_config
from jointrl.rl.learner.group import _free_port
from jointrl.rl.preflight import guard
from jointrl.rl.sft import sft_batch
from jointrl.rl.sft_data import parse_message, read_transcripts, to_trajectory

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]


def conversation(i: int) -> list[dict]:
    return [
        {"role": "system", "content": "You are a careful shell agent."},
        {"role": "user", "content": f"How many lines does notes{i}.txt have?"},
        {"role": "assistant", "content": "", "reasoning_content": "count them",
         "tool_calls": [{"id": f"c{i}", "type": "function",
                         "function": {"name": "bash", "arguments": json.dumps({"command": f"wc -l notes{i}.txt"})}}]},
        {"role": "tool", "content": f"{i + 3} notes{i}.txt", "name": "bash"},
        {"role": "assistant", "content": f"notes{i}.txt has {i + 3} lines."},
        {"role": "user", "content": "thanks"},  # after the last assistant turn: not rendered
    ]


@pytest.fixture
def files(tmp_path):
    rows = [{"messages": json.dumps(conversation(i)), "tools": json.dumps(TOOLS), "domain": "terminal"} for i in range(4)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "demos.parquet"))
    with open(tmp_path / "demos.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"messages": conversation(i), "tools": TOOLS}) + "\n")
    return tmp_path


def test_transcripts_tokenize_as_the_conversation_with_loss_on_the_assistant_turns(files):
    tpl = ChatTemplate()
    from_parquet = read_transcripts(files / "demos.parquet", tpl)
    from_jsonl = read_transcripts(files / "demos.jsonl", tpl)
    assert len(from_parquet) == len(from_jsonl) == 4
    for i, (t, u) in enumerate(zip(from_parquet, from_jsonl)):
        assert (t.token_ids, t.loss_mask) == (u.token_ids, u.loss_mask)
        assert (t.domain, u.domain, t.num_turns, t.num_tool_calls) == ("terminal", "transcripts", 2, 1)
        msgs = [parse_message(m, "m") for m in conversation(i)[:5]]
        specs = [ToolSpec("bash", TOOLS[0]["function"]["description"], TOOLS[0]["function"]["parameters"])]
        # the ids are the conversation's own rendering (through the last assistant turn's end token)
        assert t.token_ids == tpl.render(msgs, specs, add_generation_prompt=False)[:-1]
        trained = [tok for tok, m in zip(t.token_ids, t.loss_mask) if m]
        assert trained == tpl.assistant_turn(msgs[2]) + tpl.assistant_turn(msgs[4])
        assert tpl.tok.decode(trained).count("<|im_end|>") == 2 and "wc -l" in tpl.tok.decode(trained)
        assert f"{i + 3} notes{i}.txt" not in tpl.tok.decode(trained)  # the tool's output never trains


def test_a_row_without_an_assistant_turn_or_messages_names_the_row(tmp_path, capsys):
    datasets.Dataset.from_list([{"messages": json.dumps(conversation(0))},
                                {"messages": json.dumps(conversation(1)[:2])}]).to_parquet(str(tmp_path / "a.parquet"))
    with pytest.raises(ValueError, match=re.escape("row 1 has no assistant message")):
        read_transcripts(tmp_path / "a.parquet", ChatTemplate())
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # jointrl sft says so before Ray starts, in one line
        guard("sft", [f"recipe.sft_data={tmp_path / 'a.parquet'}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "recipe.sft_data: sft data" in err, err
    assert "row 1 has no assistant message" in err, err
    datasets.Dataset.from_list([{"text": "hi"}]).to_parquet(str(tmp_path / "b.parquet"))
    with pytest.raises(ValueError, match=r"no 'messages' column; its columns: \['text'\]"):
        read_transcripts(tmp_path / "b.parquet", ChatTemplate())


def test_sft_steps_on_the_transcripts_lower_their_loss(files):
    from jointrl.rl.learner.worker import LearnerWorker

    cfg = load_config(["algo.name=sft", "learner.lr=3e-3", f"recipe.sft_data={files / 'demos.parquet'}"])
    demos = read_transcripts(cfg.recipe.sft_data, ChatTemplate())
    lw = LearnerWorker(cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port())
    batch = sft_batch(demos)
    losses = [lw.train_step(batch, batch.num_loss_tokens, batch.num_loss_seqs)["loss"] for _ in range(5)]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.85 * losses[0], losses


@pytest.mark.slow
def test_jointrl_sft_trains_on_a_transcript_file(files, tmp_path, capfd):
    """The driver (Ray learner group) reads ``recipe.sft_data`` instead of playing oracles."""
    import ray

    from jointrl.rl.sft import sft

    cfg = load_config([f"output_dir={tmp_path / 'run'}", "algo.total_steps=4", "algo.prompts_per_step=4",
                       "checkpoint_every=0", "logger.wandb_mode=disabled", "learner.lr=3e-3",
                       f"recipe.sft_data={files / 'demos.jsonl'}"])
    try:
        sft(cfg)
    finally:
        ray.shutdown()
    out = capfd.readouterr().out
    assert "sft: 4 demonstrations" in out, out
    losses = [float(x) for x in re.findall(r"sft step +\d+ \| loss ([0-9.]+)", out)]
    assert len(losses) == 4 and losses[-1] < 0.85 * losses[0], out


def test_kimi_transcript_without_call_ids_numbers_them_across_the_conversation(tmp_path, kimi_files):
    """Each assistant turn is tokenized alone (``assistant_turn``); Kimi's id-less calls still count
    across the conversation, so the trajectory equals the conversation's rendering (:0, :1, not :0 twice)."""
    tpl = HFChatTemplate(HFTokenizer(kimi_files[0](tmp_path)))
    msgs = [Message(role="user", content="Count."),
            Message(role="assistant", content="", tool_calls=[ToolCall("run", {"command": "ls"})]),
            Message(role="tool", content="a", name="run"),
            Message(role="assistant", content="", tool_calls=[ToolCall("run", {"command": "wc -l a"})])]
    t = to_trajectory(msgs, [], tpl, "terminal", "t")
    full = tpl.render(msgs, add_generation_prompt=False)
    assert t.token_ids == full[:len(t.token_ids)] and len(t.token_ids) >= len(full) - 1
    assert "functions.run:1" in tpl.tok.decode(t.token_ids)
