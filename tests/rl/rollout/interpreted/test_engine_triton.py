"""The engine on the ``triton`` kernel backend (``model.kernels: triton``) gives the torch backend's
greedy tokens, and its log-probs within float32 rounding: a full-attention model (decode and prefill-chunk
attention through ``kernels/paged_attention``'s kernels over the engine's paged pool) and a hybrid one (its KDA
layers' prefill and decode through ``kernels/kda``'s chunk and recurrent kernels), over chunked prefill
and a few decode steps of a batch; and the CUDA-graph decode path (``cuda_graphs.DecodeGraphs``) run eagerly
on the triton backend; and gpt-oss (attention sinks, a sliding window of 4) through the same paged kernels."""

from __future__ import annotations

import pytest
import torch

from jointrl.kernels import dispatch, kda, moe_matmul, paged_attention
from jointrl.model import MoEConfig, MoETransformer
from jointrl.model.hf import load_hf
from jointrl.rl.rollout.cuda_graphs import DecodeGraphs
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.rollout.model_runner import ModelRunner
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
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
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


def _static_decode(backend: str, graphs: bool) -> tuple[torch.Tensor, list[list[int]]]:
    """Three rows fed token by token through ``decode_step`` (through ``DecodeGraphs``' padded bucket when
    ``graphs``; the MoE's experts through the kernel table) → (logits [steps, B, V], each row's tokens)."""
    model = MoETransformer.from_config(MODELS["full"], dtype=torch.float32, seed=3, kernels=backend)
    runner = ModelRunner(model, num_blocks=16, block_size=4)
    step = DecodeGraphs(runner, max_blocks=4, buckets=(4,)) if graphs else runner.decode_step
    table_BM = torch.arange(1, 13).view(3, 4)
    tokens, logits = [[7, 8, 9, 10, 11], [200, 3], [42]], []
    for t in range(8):
        pos_B = torch.full((3,), t)
        logits_BV = step(torch.tensor([tok[t] for tok in tokens]), pos_B, table_BM[:, t // 4] * 4 + t % 4,
                         table_BM[:, :t // 4 + 1], pos_B + 1)
        logits.append(logits_BV)
        for b, tok in enumerate(tokens):
            if len(tok) == t + 1:
                tok.append(int(logits_BV[b].argmax()))
    return torch.stack(logits), tokens


def test_padded_static_decode_on_the_triton_backend(monkeypatch):
    """``DecodeGraphs``' padded static step on the ``triton`` backend (what a CUDA graph would capture: paged
    decode through ``kernels/paged_attention``'s kernel over a zero-padded table, the experts through the grouped
    Triton matmuls, ``moe_matmul.moe_experts_dense_triton``, sync-free on CUDA) against the torch backend's
    unpadded ``decode_step``: the same tokens, logits within float32 rounding."""
    calls = []
    for module, name in ((paged_attention, "_paged_attention_triton"), (moe_matmul, "moe_experts_dense_triton")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    want_logits, want_tokens = _static_decode("torch", graphs=False)
    assert not calls
    got_logits, got_tokens = _static_decode("triton", graphs=True)
    assert set(calls) == {"_paged_attention_triton", "moe_experts_dense_triton"} and got_tokens == want_tokens
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=2e-5)


def test_triton_backend_engine_runs_gpt_oss_with_sinks_and_window(gpt_oss_dir, monkeypatch):
    """gpt-oss in the engine's ragged loop on the ``triton`` backend: its decode and prefill-chunk attention
    through the Triton paged kernels with the layers' sinks and the sliding layer's window; the torch backend's
    greedy tokens, log-probs within float32 rounding."""
    calls = set()  # (launcher, sinks given, window) the engine reached
    for name in ("_paged_attention_triton", "_paged_prefill_triton"):
        real = getattr(paged_attention, name)
        monkeypatch.setattr(paged_attention, name, lambda *a, _real=real, _name=name, **k: calls.add(
            (_name, k.get("sinks_H") is not None, k.get("window"))) or _real(*a, **k))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (6, 19)]
    outs = {}
    for backend in ("torch", "triton"):
        model = load_hf(gpt_oss_dir, dtype=torch.float32).eval()
        model.set_kernels(backend)
        engine = LLMEngine(model, config=EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16,
                                                      ignore_eos=True))
        assert not engine.runner.hybrid
        outs[backend] = engine.generate_batch(prompts, [SamplingParams(max_tokens=5, temperature=0)] * len(prompts))
    assert calls == {(name, True, window) for name in ("_paged_attention_triton", "_paged_prefill_triton")
                     for window in (4, None)}
    for w, o in zip(outs["torch"], outs["triton"], strict=True):
        assert o.token_ids == w.token_ids
        assert o.logprobs == pytest.approx(w.logprobs, abs=2e-5)
