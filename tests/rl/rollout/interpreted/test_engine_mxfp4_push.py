"""An engine on the ``triton`` kernel backend keeps a push's routed experts MXFP4-resident
(``weight_sync.hold_mxfp4_experts``) and runs them through the MXFP4 MoE kernel, giving the greedy tokens of
the torch backend (which decodes the same push into its dense experts) and its log-probs within float32
rounding."""

from __future__ import annotations

import pytest
import torch

from jointrl.kernels import dispatch, moe_matmul
from jointrl.model import MoEConfig, MoETransformer
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.types import SamplingParams
from jointrl.rl.weight_sync import build_bundle


def test_a_push_runs_on_the_mxfp4_moe_kernel_on_the_triton_backend(monkeypatch):
    config = MoEConfig(initializer_range=0.1)
    learner = MoETransformer.from_config(config, dtype=torch.float32, seed=7, kernels="torch")
    bundle = build_bundle(learner.state_dict(), version=1)
    calls = []  # the dtype of the expert weights each grouped Triton launch read (uint8: MXFP4 blocks)
    real = moe_matmul._moe_swiglu_triton
    monkeypatch.setattr(moe_matmul, "_moe_swiglu_triton", lambda *a: calls.append(a[2].dtype) or real(*a))
    assert dispatch.interpreting(moe_matmul._moe_swiglu_kernel)
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 11)]
    outs = {}
    for backend in ("torch", "triton"):
        model = MoETransformer.from_config(config, dtype=torch.float32, seed=3, kernels=backend)  # other weights
        engine = LLMEngine(model, config=EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16))
        engine.update_weights(1, bundle)
        held = [layer.mlp.experts.mxfp4_gate_up_blocks is not None for layer in model.model.layers]
        assert all(held) if backend == "triton" else not any(held)
        outs[backend] = engine.generate_batch(prompts, [SamplingParams(max_tokens=4, temperature=0)] * len(prompts))
    assert calls and set(calls) == {torch.uint8}  # the triton engine's experts ran on the MXFP4 kernel only
    for want, got in zip(outs["torch"], outs["triton"], strict=True):
        assert got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=2e-5)
