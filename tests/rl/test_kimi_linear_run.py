"""A run started from a Kimi-Linear directory (model=hf model.path=DIR: a tiny random `KimiLinearForCausalLM`, 3 KDA
+ 1 MLA layers, dense first MLP, shared expert, with the Qwen3-style BPE tokenizer of tests/conftest.py; Kimi's own
tokenizer and chat template are not read yet): the learner and the rollout engine agree on log-probs in float64,
and `jointrl train` runs two GRPO steps."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from jointrl.envs.base import Message
from jointrl.rl.build import build_template
from jointrl.rl.config import load_config
from jointrl.rl.types import SamplingParams


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory, qwen3_files) -> Path:
    import torch
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    save_tokenizer, _ = qwen3_files
    d = save_tokenizer(tmp_path_factory.mktemp("kimi_linear"))
    vocab = 1 + max(t["id"] for t in json.loads((d / "tokenizer.json").read_text())["added_tokens"])
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
    template = build_template(cfg)
    lw, engine = hf_run.learner_and_engine(cfg, port=29741)
    prompts = [template.render([Message(role="user", content="list the files")]),
               template.render([Message(role="system", content="Be brief."), Message(role="user", content="hi")])]
    outs = asyncio.run(_generate(engine, prompts))
    assert hf_run.assert_learner_logprobs_match(lw, prompts, outs) >= 10


async def _generate(engine, prompts):
    return await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=12, seed=s))
                                  for s, p in enumerate(prompts, start=1)))


@pytest.mark.slow
def test_train_runs_two_grpo_steps_on_kimi_linear(kimi_dir, tmp_path, hf_run):
    trajs = hf_run.train_two_grpo_steps(kimi_dir, tmp_path)
    assert len(trajs) == 8 and all(t["finish_reason"] != "env_error" for t in trajs)

