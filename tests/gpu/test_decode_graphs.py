"""CUDA-graph decode on a GPU (``pytest -m gpu``; skipped with the reason without CUDA: tests/conftest.py):
``DecodeGraphs`` captures and replays ``ModelRunner.decode_step`` on the ``triton`` table and gives the eager
step's logits; the engine with ``decode_graphs`` gives the engine's tokens without, before and after an MXFP4
weight push (the graphs dropped and captured again, the experts MXFP4-resident) and over a sequence growing
past 1024 positions (the RoPE table built once, never rebuilt). tests/gpu/check.sh runs these on the lent
GPU machine where pytest is installed; the host runs the same paths eagerly (tests/rl/rollout/test_cuda_graphs.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from jointrl.model import MoEConfig, MoETransformer
from jointrl.rl.device import rank_device
from jointrl.rl.rollout.cuda_graphs import DecodeGraphs
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.rollout.model_runner import ModelRunner
from jointrl.rl.types import SamplingParams
from jointrl.rl.weight_sync import build_bundle

pytestmark = pytest.mark.gpu

BS = 16


def _model(seed: int, device) -> MoETransformer:
    return MoETransformer.from_config(MoEConfig(initializer_range=0.1), dtype=torch.float32, seed=seed,
                                      device=device, kernels="triton")


def _steps(step, device, B: int = 3, steps: int = 40) -> tuple[torch.Tensor, list[list[int]]]:
    """B rows fed token by token through ``step`` (``decode_step``'s arguments) → (logits [steps, B, V], tokens)."""
    M = steps // BS + 1
    table_BM = torch.arange(1, B * M + 1, device=device).view(B, M).flip(1)
    tokens, logits = [[5 + b, 17, 33][: b + 1] for b in range(B)], []
    for t in range(steps):
        pos_B = torch.full((B,), t, device=device)
        logits_BV = step(torch.tensor([tok[t] for tok in tokens], device=device), pos_B,
                         table_BM[:, t // BS] * BS + t % BS, table_BM[:, : t // BS + 1], pos_B + 1).clone()
        logits.append(logits_BV)
        for b, tok in enumerate(tokens):
            if len(tok) == t + 1:
                tok.append(int(logits_BV[b].argmax()))
    return torch.stack(logits), tokens


def test_captured_decode_replays_the_eager_step():
    device = rank_device()
    model = _model(3, device)
    eager = ModelRunner(model, num_blocks=64, block_size=BS)
    want_logits, want_tokens = _steps(eager.decode_step, device)
    runner = ModelRunner(model, num_blocks=64, block_size=BS, decode_graphs=True)
    graphs = DecodeGraphs(runner, max_blocks=8, buckets=(4, 8))
    got_logits, got_tokens = _steps(graphs, device)
    assert graphs.capture and graphs._buckets and all(b.graph is not None for b in graphs._buckets.values())
    assert got_tokens == want_tokens
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-4)
    scratch = runner.scratch_slot  # the pad row (3 rows in a bucket of 4) wrote only the scratch slot
    assert runner.kv_LPCHD[:, scratch].ne(0).any() and eager.kv_LPCHD[:, scratch].eq(0).all()
    torch.testing.assert_close(runner.kv_LPCHD[:, :scratch], eager.kv_LPCHD[:, :scratch], rtol=0, atol=1e-4)


def _generate(engine: LLMEngine, prompts, max_tokens: int):
    return engine.generate_batch(prompts, [SamplingParams(max_tokens=max_tokens, temperature=0)] * len(prompts))


def _same(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)


def test_engine_with_graphs_across_a_push_and_past_1024_positions():
    device = rank_device()
    cfg = EngineConfig(num_blocks=256, block_size=BS, max_num_batched_tokens=512)
    engines = {g: LLMEngine(_model(3, device), config=dataclasses.replace(cfg, decode_graphs=g)) for g in (False, True)}
    runner = engines[True].runner
    rope = runner._rope_table
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 12, 30)]
    _same(_generate(engines[True], prompts, 24), _generate(engines[False], prompts, 24))
    assert any(b.graph is not None for b in runner.graphs._buckets.values())
    new = _model(4, device)
    for engine in engines.values():  # the default push: routed experts in MXFP4, held so on the triton table
        engine.update_weights(1, build_bundle(new.state_dict(), 1))
    assert runner.model.model.layers[0].mlp.experts.mxfp4_gate_up_blocks is not None
    assert not runner.graphs._buckets
    _same(_generate(engines[True], prompts, 24), _generate(engines[False], prompts, 24))
    long = [torch.randint(0, 256, (1000,), generator=g).tolist()]  # decodes positions 1000..1063
    _same(_generate(engines[True], long, 64), _generate(engines[False], long, 64))
    assert runner._rope_table is rope
