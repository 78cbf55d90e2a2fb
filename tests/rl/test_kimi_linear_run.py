"""A run started from a Kimi-Linear directory (model=hf model.path=DIR: a tiny random `KimiLinearForCausalLM`, 3 KDA
+ 1 MLA layers, dense first MLP, shared expert, with Kimi's tokenizer files as tests/conftest.save_kimi_tokenizer
writes them: tiktoken.model + tokenizer_config.json with Kimi's chat template, no tokenizer.json): the learner and
the rollout engine agree on log-probs in float64 over a conversation with a tool call in Kimi's format, `jointrl
train` runs two GRPO steps, and the oracles' calls, written in Kimi's format, parse by id and solve their tasks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jointrl.envs.base import Message, ToolCall, ToolSpec
from jointrl.model.hf_chat_template import HFChatTemplate
from jointrl.model.hf_tokenizer import HFTokenizer
from jointrl.rl.build import build_template, build_tokenizer
from jointrl.rl.config import load_config
from jointrl.rl.types import SamplingParams


TOOL = ToolSpec("run", "run a shell command", {"type": "object", "properties": {"command": {"type": "string"}}})


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory, kimi_files) -> Path:
    import torch
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    save_tokenizer, _ = kimi_files
    d = save_tokenizer(tmp_path_factory.mktemp("kimi_linear"))
    vocab = HFTokenizer(d).vocab_size
    torch.manual_seed(11)
    config = KimiLinearConfig(
        vocab_size=(vocab + 63) // 64 * 64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, num_local_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.0, kv_lora_rank=24, q_lora_rank=20,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3,
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4},
        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    hf = KimiLinearForCausalLM(config).eval()
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    hf.save_pretrained(str(d))
    return d


def test_learner_logprobs_equal_engine_logprobs(kimi_dir, hf_run):
    cfg = load_config(["model=hf", f"model.path={kimi_dir}", "model.dtype=float64", "rollout.quantize_experts=false"])
    assert cfg.model.layer_types == ["kda", "kda", "kda", "mla"] and cfg.model.kv_lora_rank == 24
    tok, template = build_tokenizer(cfg), build_template(cfg)
    assert tok.kimi and isinstance(template, HFChatTemplate)
    lw, engine = hf_run.learner_and_engine(cfg, port=29741)
    call = ToolCall("run", {"command": "ls"}, id="functions.run:0")
    prompts = [template.render([Message(role="user", content="list the files"),
                                Message(role="assistant", content="On it.", tool_calls=[call]),
                                Message(role="tool", content="a.txt", tool_call_id=call.id)], [TOOL]),
               template.render([Message(role="system", content="Be brief."), Message(role="user", content="hi")])]
    assert tok.special_ids["<|tool_call_argument_begin|>"] in prompts[0]
    outs = asyncio.run(_generate(engine, prompts))
    assert hf_run.assert_learner_logprobs_match(lw, prompts, outs) >= 10


async def _generate(engine, prompts):
    return await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=12, seed=s))
                                  for s, p in enumerate(prompts, start=1)))


@pytest.mark.slow
def test_train_runs_two_grpo_steps_on_kimi_linear(kimi_dir, tmp_path, hf_run):
    trajs = hf_run.train_two_grpo_steps(kimi_dir, tmp_path)
    assert len(trajs) == 8 and all(t["finish_reason"] != "env_error" for t in trajs)
    tok = HFTokenizer(kimi_dir)  # every prompt is Kimi's rendering, opening with the env's tools declared
    declare = [tok.special_ids["<|im_system|>"], *tok.encode("tool_declare"), tok.special_ids["<|im_middle|>"]]
    assert all(t["token_ids"][:len(declare)] == declare for t in trajs)


@pytest.mark.slow
def test_eval_oracle_solves_terminal_tasks_in_kimis_format(kimi_dir, tmp_path):
    """`jointrl eval policy=oracle model=hf model.path=DIR`: the oracles' calls, written by Kimi's template in
    the tiktoken tokenizer's ids (a tool-calls section per turn), parse by id and solve their tasks."""
    from jointrl.rl.eval import main as eval_main

    def run(policy: str) -> dict:
        return eval_main(["envs=terminal", f"policy={policy}", "tier=low", "k=1", "limit=3", f"out={tmp_path / policy}",
                          "logger.wandb_mode=disabled", "model=hf", f"model.path={kimi_dir}",
                          "rollout.max_tokens_per_turn=65536", "rollout.max_context=262144"])

    result = run("oracle")
    (row,) = result["rows"]
    assert row["tasks"] == 3 and row["env_error"] == 0
    assert row["pass@1"] == 1.0, [e for e in result["episodes"] if not e["success"]]
    assert run("noop")["rows"][0]["pass@1"] == 0.0  # the oracles' calls, not the tasks, solved them
