"""``rollout.batch_invariant``: a seeded request's tokens and log-probs are the same bits whatever
shares its steps (other requests, their arrival, the prefill chunk budget) -- what a resumed run
needs to replay its rollouts (tests/rl/test_scale_out.py's driver kill)."""

import pytest
import torch

from jointrl.model import MoEConfig, MoETransformer
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.types import SamplingParams

SAMPLED = SamplingParams(max_tokens=24, temperature=1.0, seed=11)


@pytest.fixture(scope="module")
def model():  # float32, as rollouts run: float sums there depend on the order they are taken in
    return MoETransformer.from_config(MoEConfig(initializer_range=0.1), dtype=torch.float32, seed=3)


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def run(model, invariant: bool, budget: int, others: list[list[int]], late: list[list[int]] = ()):
    """The probe request (first) with ``others`` in the same steps, and ``late`` ones joining after
    three steps; → the probe's output."""
    eng = LLMEngine(model, config=EngineConfig(num_blocks=256, block_size=4, max_num_batched_tokens=budget,
                                               batch_invariant=invariant))
    probe = prompts(45, seed=9)[0]
    seqs = [eng.add_request(probe, SAMPLED)]
    seqs += [eng.add_request(p, SamplingParams(max_tokens=20, temperature=1.0, seed=i)) for i, p in enumerate(others)]
    for _ in range(3):
        eng.step()
    seqs += [eng.add_request(p, SamplingParams(max_tokens=8, temperature=1.0, seed=50 + i)) for i, p in enumerate(late)]
    while any(s.out.finish_reason == "length" and len(s.out.token_ids) < s.params.max_tokens for s in seqs):
        eng.step()
    return seqs[0].out


def test_a_request_replays_bit_for_bit_whatever_shares_its_batch(model):
    alone = run(model, True, budget=16, others=[])
    crowded = run(model, True, budget=96, others=prompts(30, 7, 61, 3), late=prompts(20, 5, seed=4))
    assert len(alone.token_ids) == SAMPLED.max_tokens or alone.finish_reason == "stop"
    assert crowded.token_ids == alone.token_ids
    assert crowded.logprobs == alone.logprobs  # the same floats, not merely close


def test_it_computes_the_model(model):
    """The invariant path (tiled projections, every query through the decode kernel) is still the
    model: greedy tokens and log-probs equal a full recompute without any cache, in float64."""
    m64 = MoETransformer.from_config(MoEConfig(initializer_range=0.1), dtype=torch.float64, seed=3)
    eng = LLMEngine(m64, config=EngineConfig(num_blocks=256, block_size=4, max_num_batched_tokens=16,
                                             batch_invariant=True))
    ps = prompts(1, 23, 40, seed=5)
    outs = eng.generate_batch(ps, [SamplingParams(max_tokens=10, temperature=0)] * len(ps))
    for p, out in zip(ps, outs):
        ids, lps = list(p), []
        with torch.no_grad():
            for t in out.token_ids:
                logits_V = m64(torch.tensor([ids])).logits[0, -1]
                assert t == int(logits_V.argmax())
                lps.append(float(torch.log_softmax(logits_V, -1)[t]))
                ids.append(t)
        assert out.logprobs == pytest.approx(lps, abs=1e-10)


def test_without_it_float_sums_follow_the_batch(model):
    """The control: the default engine gives the same request different log-prob bits in a crowd
    (BLAS sums a row differently by the row count), which is why the option exists."""
    alone = run(model, False, budget=16, others=[])
    crowded = run(model, False, budget=96, others=prompts(30, 7, 61, 3), late=prompts(20, 5, seed=4))
    n = min(len(alone.logprobs), len(crowded.logprobs))
    assert alone.logprobs[:n] != crowded.logprobs[:n]


def test_hybrid_models_are_refused():
    hybrid = MoETransformer.from_config(MoEConfig(layer_types=["kda", "full"], num_hidden_layers=2), dtype=torch.float32)
    with pytest.raises(ValueError, match="batch_invariant supports full-attention models only"):
        LLMEngine(hybrid, config=EngineConfig(batch_invariant=True))
