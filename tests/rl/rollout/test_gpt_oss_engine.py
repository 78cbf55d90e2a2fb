"""gpt-oss (attention sinks, sliding-window layers with a window of 4, biased projections, clamped SwiGLU experts)
in the rollout engine's ragged layer loop: ``SinkAttention.paged`` through the kernel table's paged ops with its
sinks and window. Chunked prefill (chunks past the window, crossing block boundaries) and batched decode give
the tokens and log-probs of a full recompute through the model's own forward (float64)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from jointrl.model.hf import load_hf
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.rollout.model_runner import ModelRunner
from jointrl.rl.types import SamplingParams


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_gpt_oss_runs_the_ragged_loop_and_equals_a_full_recompute(gpt_oss_dir, kernels, greedy_reference):
    model = load_hf(gpt_oss_dir, dtype=torch.float64).eval()
    model.set_kernels(kernels)
    assert [layer.self_attn.window for layer in model.model.layers] == [4, None]  # sliding, full
    engine = LLMEngine(model, config=EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16,
                                                  ignore_eos=True))  # the reference does not stop either
    assert not engine.runner.hybrid  # every layer in the ragged loop, none per sequence
    seen = []  # the (sinks given, window) of every paged attention call the engine made
    table = engine.runner.kernels
    engine.runner.kernels = dataclasses.replace(table, **{
        name: lambda *a, _real=getattr(table, name): seen.append((a[-2] is not None, a[-1])) or _real(*a)
        for name in ("paged_decode", "paged_prefill")})
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (5, 19, 9, 2)]
    params = SamplingParams(max_tokens=6, temperature=0)
    outs = engine.generate_batch(prompts, [params] * len(prompts))
    for prompt, out in zip(prompts, outs, strict=True):
        want_ids, want_lps = greedy_reference(model, prompt, params.max_tokens)
        assert out.token_ids == want_ids
        assert out.logprobs == pytest.approx(want_lps, abs=1e-10)
    assert {(True, 4), (True, None)} <= set(seen)  # both layers' sinks, the sliding layer's window
    assert engine.stats.steps > len(prompts) + 1  # chunked prefill and batched decode steps both ran


def test_batch_invariant_and_decode_graphs_are_refused_with_a_reason(gpt_oss_dir):
    """Batch invariance rests on the C++ paged kernels, which have no sinks or window; the static decode step
    gathers plain SwiGLU experts, not gpt-oss's clamped ones: clear errors at construction."""
    model = load_hf(gpt_oss_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="sinks or sliding window"):
        ModelRunner(model, num_blocks=8, block_size=4, batch_invariant=True)
    with pytest.raises(ValueError, match="plain SwiGLU experts"):
        ModelRunner(model, num_blocks=8, block_size=4, decode_graphs=True)
