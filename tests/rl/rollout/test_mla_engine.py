"""Kimi-Linear (3 KDA + 1 MLA layers, dense first MLP, shared expert) in the rollout engine: the MLA layer's
paged pool holds its latent (kv_lora_rank + qk_rope_head_dim values per token, not expanded heads), and
chunked prefill + batched decode give the tokens and log-probs of a full recompute (float64)."""

from __future__ import annotations

import pytest
import torch

from jointrl.model import MoEConfig, MoETransformer
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.types import SamplingParams

IM_END = 258  # the byte tokenizer's <|im_end|>


def _kimi() -> MoETransformer:
    cfg = MoEConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                    layer_types=("kda", "kda", "kda", "mla"), first_k_dense_replace=1, n_shared_experts=1,
                    num_experts=8, scoring_func="sigmoid", n_group=2, topk_group=1, q_lora_rank=20,
                    kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, initializer_range=0.1)
    return MoETransformer.from_config(cfg, dtype=torch.float64, seed=5)


def test_kimi_linear_decodes_in_the_engine_from_a_latent_pool(greedy_reference):
    model = _kimi()
    engine = LLMEngine(model, config=EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16))
    runner = engine.runner
    assert runner.latent_pool == {3: 0} and runner.kv_LPCHD.shape[0] == 0
    assert runner.latent_LPD.shape == (1, 64 * 4, 24 + 8)  # the latent per token slot, not heads
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 19, 9)]
    params = SamplingParams(max_tokens=6, temperature=0)
    outs = engine.generate_batch(prompts, [params] * len(prompts))
    for prompt, out in zip(prompts, outs, strict=True):
        want_ids, want_lps = greedy_reference(model, prompt, params.max_tokens, IM_END)
        assert out.token_ids == want_ids and len(want_ids) == params.max_tokens
        assert out.logprobs == pytest.approx(want_lps, abs=1e-10)
    assert engine.stats.steps > len(prompts) + 1  # chunked prefill and batched decode steps both ran
