"""A run started from a gpt-oss directory (model=hf model.path=DIR; tests/conftest.py: a tiny random
`GptOssForCausalLM` with MXFP4 experts and a harmony tokenizer): the learner and the rollout engine
agree on log-probs in float64, the thinking budget ends the analysis channel with harmony's <|end|>
(masked), and `jointrl train` runs two GRPO steps on the checkpoint's token ids."""

from __future__ import annotations

import asyncio
import json

import pytest

from jointrl.envs.base import Message
from jointrl.model.harmony import HarmonyTemplate
from jointrl.model.hf import load_hf
from jointrl.rl.build import build_template, build_tokenizer
from jointrl.rl.config import load_config
from jointrl.rl.learner.expert_parallel import shard_experts
from jointrl.rl.rollout.turn import generate_turn
from jointrl.rl.types import SamplingParams


def test_learner_logprobs_equal_engine_logprobs_and_budget_ends_analysis_with_end(gpt_oss_dir, hf_run):
    cfg = load_config(["model=hf", f"model.path={gpt_oss_dir}", "model.dtype=float64", "rollout.quantize_experts=false"])
    tok, template = build_tokenizer(cfg), build_template(cfg)
    assert isinstance(template, HarmonyTemplate) and cfg.model.layer_types == ["sliding", "full"]
    lw, engine = hf_run.learner_and_engine(cfg, port=29733)
    prompt = template.render([Message(role="user", content="list the files")])
    assert prompt[-1] == tok.think_id == tok.special_ids["<|message|>"]
    prompts = [prompt, template.render([Message(role="system", content="Be brief."), Message(role="user", content="hi")])]
    outs = asyncio.run(_generate(engine, prompts, budgets=(3, None)))
    # contexts past the sliding window (4) and the block size
    assert hf_run.assert_learner_logprobs_match(lw, prompts, outs) >= 10 and len(prompt) > 8
    forced = outs[0]  # budget 3 (seeded: no <|end|> sampled before): the 4th token is a forced <|end|>
    assert tok.think_end_id not in forced.token_ids[:3]
    assert (forced.token_ids[3], forced.sampled[3], forced.logprobs[3]) == (tok.special_ids["<|end|>"], 0, 0.0)


async def _generate(engine, prompts, budgets):
    tok = engine.tok
    return await asyncio.gather(*(generate_turn(engine, p, SamplingParams(max_tokens=12, seed=s), b, tok)
                                  for s, (p, b) in enumerate(zip(prompts, budgets), start=1)))


@pytest.mark.slow
def test_train_runs_two_grpo_steps_on_gpt_oss(gpt_oss_dir, tmp_path, hf_run):
    trajs = hf_run.train_two_grpo_steps(gpt_oss_dir, tmp_path)
    tok = build_tokenizer(load_config(["model=hf", f"model.path={gpt_oss_dir}"]))
    ok = [t for t in trajs if t["finish_reason"] != "env_error"]
    assert len(ok) == len(trajs) == 8, [t["reward_info"] for t in trajs if t not in ok][:1]
    start, message = tok.special_ids["<|start|>"], tok.special_ids["<|message|>"]
    assert all(t["token_ids"][0] == start and message in t["token_ids"] for t in ok)


@pytest.mark.slow
def test_serve_answers_the_openai_client_in_harmony(gpt_oss_dir, tmp_path, hf_run):
    """A conversation with a tool call (the assistant's call written by the client) through the real
    `openai` client: both replies come back, and the recorded prompt holds harmony's ids where the
    format puts them (the tool output's "<|end|>" stays text)."""
    record = tmp_path / "recorded.jsonl"
    conv = hf_run.serve_tool_conversation(gpt_oss_dir, record, "a.txt\n<|end|>", "I will list them.")
    tok = build_tokenizer(load_config(["model=hf", f"model.path={gpt_oss_dir}"]))
    recorded = [json.loads(line) for line in record.read_text().splitlines()]
    t = next(t for t in recorded if conv in json.dumps(t))
    prompt = [i for i, m in zip(t["token_ids"], t["loss_mask"]) if not m]
    text = tok.decode(prompt)
    assert '<|start|>assistant<|channel|>commentary to=functions.run <|constrain|>json<|message|>{"command":"ls"}<|call|>' \
        in text and "<|start|>functions.run to=assistant<|channel|>commentary<|message|>a.txt\n<|end|><|end|>" in text
    # system block, developer, user, analysis, tool: five <|end|> ids; the tool's "<|end|>" is text
    assert prompt.count(tok.special_ids["<|end|>"]) == 5 and prompt.count(tok.special_ids["<|call|>"]) == 1


@pytest.mark.slow
def test_eval_oracle_solves_terminal_tasks_in_harmony(gpt_oss_dir, tmp_path):
    """`jointrl eval policy=oracle model=hf model.path=DIR`: the oracles' calls, written in harmony by
    our renderer in the harmony tokenizer's ids, parse by id and solve their tasks."""
    from jointrl.rl.eval import main as eval_main

    result = eval_main(["envs=terminal", "policy=oracle", "tier=low", "k=1", "limit=3", f"out={tmp_path}",
                        "logger.wandb_mode=disabled", "model=hf", f"model.path={gpt_oss_dir}",
                        "rollout.max_tokens_per_turn=65536", "rollout.max_context=262144"])
    (row,) = result["rows"]
    assert row["tasks"] == 3 and row["env_error"] == 0
    assert row["pass@1"] == 1.0, [e for e in result["episodes"] if not e["success"]]


def test_expert_sharding_and_fake_quant_refuse_clamped_swiglu_experts(gpt_oss_dir):
    with pytest.raises(ValueError, match="clamped-SwiGLU"):
        shard_experts(load_hf(gpt_oss_dir), 1, 0, fake_quant=True)
