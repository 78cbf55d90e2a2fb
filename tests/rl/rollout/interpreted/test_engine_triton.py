"""The engine on the ``triton`` kernel backend (``model.kernels: triton``) gives the torch backend's
greedy tokens, and its log-probs within float32 rounding: a full-attention model (decode and prefill-chunk
attention through ``kernels/paged_attention``'s kernels over the engine's paged pool) and a hybrid one (its KDA
layers' prefill and decode through ``kernels/kda``'s chunk and recurrent kernels), over chunked prefill
and a few decode steps of a batch."""

from __future__ import annotations

import pytest
import torch

from jointrl.kernels import dispatch, kda, paged_attention
from jointrl.model import MoEConfig, MoETransformer
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.types import SamplingParams

MODELS = {
    "full": MoEConfig(initializer_range=0.1),
    "hybrid": MoEConfig.preset("tiny_hybrid", initializer_range=0.1, kda_chunk_size=8),
}


def _generate(config: MoEConfig, backend: str, prompts: list[list[int]]):
    model = MoETransformer.from_config(config, dtype=torch.float32, seed=3, kernels=backend)
    engine = LLMEngine(model, config=EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16))
    assert engine.runner.kernels.backend == backend
    return engine.generate_batch(prompts, [SamplingParams(max_tokens=5, temperature=0)] * len(prompts))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_triton_backend_engine_equals_the_torch_backend(kind, monkeypatch):
    assert dispatch.interpreting(paged_attention._paged_decode_kernel)
    assert dispatch.interpreting(paged_attention._paged_prefill_kernel)
    assert dispatch.interpreting(kda._kda_recurrent_kernel) and dispatch.interpreting(kda._kda_chunk_fwd_kernel)
    calls = []  # the Triton launchers the engine reached
    for module, name in ((paged_attention, "_paged_attention_triton"), (paged_attention, "_paged_prefill_triton"),
                         (kda, "_kda_recurrent_triton"), (kda, "_kda_chunk_triton")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (6, 19)]
    want = _generate(MODELS[kind], "torch", prompts)
    assert not calls
    got = _generate(MODELS[kind], "triton", prompts)
    expected = {"_paged_attention_triton", "_paged_prefill_triton"} if kind == "full" else {"_kda_recurrent_triton", "_kda_chunk_triton"}
    assert set(calls) == expected
    for w, o in zip(want, got, strict=True):
        assert o.token_ids == w.token_ids
        assert o.logprobs == pytest.approx(w.logprobs, abs=2e-5)
