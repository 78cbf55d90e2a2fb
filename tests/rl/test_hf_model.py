"""A run started from a Hugging Face directory (model=hf model.path=DIR; tests/conftest.py: a tiny
random Qwen3-MoE, a BPE trained in the test, a Qwen3-style template): the learner and the rollout
engine agree on log-probs in float64, the budget closes thinking with the family's </think>, and
`jointrl train` runs end to end on the checkpoint's token ids."""

from __future__ import annotations

import asyncio
import json

import pytest

from jointrl.envs.base import Message
from jointrl.rl.build import build_template, build_tokenizer
from jointrl.rl.config import load_config
from jointrl.rl.rollout.turn import generate_turn
from jointrl.rl.types import SamplingParams


def test_learner_logprobs_equal_engine_logprobs_and_budget_closes_with_the_familys_token(qwen3_dir, hf_run):
    cfg = load_config(["model=hf", f"model.path={qwen3_dir}", "model.dtype=float64", "rollout.quantize_experts=false"])
    tok, template = build_tokenizer(cfg), build_template(cfg)
    assert tok.think_end_id > 264  # the BPE's </think>, not the byte tokenizer's
    lw, engine = hf_run.learner_and_engine(cfg, port=29731, block_size=16)
    prompt = template.render([Message(role="user", content="list the files")])
    prompts = [prompt, prompt + [tok.think_id]]  # the model opens <think> / the prompt already did
    outs = asyncio.run(_generate(engine, prompts))
    assert all(0 <= i < cfg.model.vocab_size for o in outs for i in o.token_ids)
    assert hf_run.assert_learner_logprobs_match(lw, prompts, outs) > 0
    forced = outs[1]  # budget 3 (seeded: no </think> sampled before): the 4th token is a forced </think>
    assert tok.think_end_id not in forced.token_ids[:3]
    assert (forced.token_ids[3], forced.sampled[3], forced.logprobs[3]) == (tok.think_end_id, 0, 0.0)


async def _generate(engine, prompts):
    tok = engine.tok
    return await asyncio.gather(*(generate_turn(engine, p, SamplingParams(max_tokens=10, seed=s), 3, tok)
                                  for s, p in enumerate(prompts, start=1)))


@pytest.mark.slow
def test_train_runs_two_steps_on_the_checkpoints_tokens(qwen3_dir, tmp_path, hf_run):
    trajs = hf_run.train_two_grpo_steps(qwen3_dir, tmp_path)
    tok = build_tokenizer(load_config(["model=hf", f"model.path={qwen3_dir}"]))
    ok = [t for t in trajs if t["finish_reason"] != "env_error"]
    assert len(ok) == len(trajs) == 8, [t["reward_info"] for t in trajs if t not in ok][:1]
    assert all(t["token_ids"][0] == tok.im_start_id and tok.im_end_id in t["token_ids"] for t in ok)
    assert any(i >= 264 and i not in tok.id_to_special for t in ok for i in t["token_ids"])  # BPE merges


@pytest.mark.slow
def test_serve_answers_the_openai_client_with_the_checkpoints_template(qwen3_dir, tmp_path, hf_run):
    """A scripted conversation with a tool call (the assistant's call written by the client), through
    the real `openai` client: both replies come back, and the recorded prompt holds the checkpoint's
    special ids exactly where its template puts them (the tool output's "<|im_end|>" stays text)."""
    record = tmp_path / "recorded.jsonl"
    conv = hf_run.serve_tool_conversation(qwen3_dir, record, "a.txt\n<|im_end|>", None, "rollout.backend=simple")
    tok = build_tokenizer(load_config(["model=hf", f"model.path={qwen3_dir}"]))
    recorded = {}
    for line in record.read_text().splitlines():
        t = json.loads(line)
        recorded[t["group_id"]] = t
    t = next(t for t in recorded.values() if conv in json.dumps(t))
    prompt = [i for i, m in zip(t["token_ids"], t["loss_mask"]) if not m]
    assert prompt[0] == tok.im_start_id
    assert prompt.count(tok.im_end_id) == 4  # system, user, assistant, tool responses; not the tool's text


@pytest.mark.slow
def test_eval_oracle_solves_terminal_tasks_through_the_checkpoints_template(qwen3_dir, tmp_path):
    """`jointrl eval policy=oracle model=hf model.path=DIR`: the oracles' calls, written in the
    Qwen3 template's form and the BPE's ids, parse and solve their tasks."""
    from jointrl.rl.eval import main as eval_main

    result = eval_main(["envs=terminal", "policy=oracle", "tier=low", "k=1", "limit=3", f"out={tmp_path}",
                        "logger.wandb_mode=disabled", "model=hf", f"model.path={qwen3_dir}",
                        "rollout.max_tokens_per_turn=65536", "rollout.max_context=262144"])
    (row,) = result["rows"]
    assert row["tasks"] == 3 and row["env_error"] == 0
    assert row["pass@1"] == 1.0, [e for e in result["episodes"] if not e["success"]]
