"""The ``RolloutEngine`` contract: what every backend must do, checked through the protocol
only (``version``, ``async generate``, ``update_weights``), in float64 against a plain
full-recompute decode. Parametrized over the fast engine and the skeleton's SimpleSampler;
a new backend (a vLLM / SGLang adapter) joins by adding a factory to ``BACKENDS``."""

import asyncio
import dataclasses

import pytest
import torch

from jointrl.model.tokenizer import ByteTokenizer
from jointrl.rl.learner.batch import token_logprobs
from jointrl.rl.rollout.engine import RolloutEngine
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.rollout.sampler import SimpleSampler
from jointrl.rl.rollout.turn import generate_turn
from jointrl.rl.types import GenerationOutput, SamplingParams
from jointrl.rl.weight_sync import build_bundle

from .test_llm_engine import make_model, prompts, reference

TOK = ByteTokenizer()
BACKENDS = {
    "engine": lambda m: LLMEngine(m, TOK, EngineConfig(num_blocks=96, block_size=4, max_num_batched_tokens=24)),
    "simple": lambda m: SimpleSampler(m, TOK),
}
GREEDY = SamplingParams(max_tokens=10, temperature=0)


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    return BACKENDS[request.param]


def run(engine, *calls):
    """Run (prompt, params) requests concurrently through ``engine.generate``."""
    async def go():
        try:
            return await asyncio.gather(*(engine.generate(p, sp) for p, sp in calls))
        finally:
            await engine.close()
    return asyncio.run(go())


def check_record(out: GenerationOutput, version: int) -> None:
    assert len(out.token_ids) == len(out.logprobs) == len(out.sampled)
    assert out.finish_reason in ("stop", "length") and out.policy_version == version


def test_implements_the_protocol(backend):
    engine = backend(make_model())
    assert isinstance(engine, RolloutEngine) and engine.version == 0


def test_concurrent_greedy_requests_equal_full_recompute(backend):
    model = make_model()
    engine = backend(model)
    ps = prompts(3, 17, 8, 25)
    outs = run(engine, *((p, GREEDY) for p in ps))
    for p, out in zip(ps, outs):
        check_record(out, 0)
        ref_ids, ref_lps = reference(model, p, GREEDY.max_tokens)
        assert out.token_ids == ref_ids and out.logprobs == pytest.approx(ref_lps, abs=1e-10)
        assert out.finish_reason == ("stop" if ref_ids[-1] == TOK.im_end_id else "length")


def test_multi_turn_continuation_equals_full_recompute(backend):
    model = make_model()
    engine = backend(model)
    p = prompts(14)[0]
    (out1,) = run(engine, (p, GREEDY))
    turn2 = p + out1.token_ids + [TOK.im_start_id, *TOK.encode("tool\nok"), TOK.im_end_id]
    (out2,) = run(engine, (turn2, GREEDY))
    assert out2.token_ids == reference(model, turn2, GREEDY.max_tokens)[0]


def test_seeded_sampling_reproduces_and_logprobs_match_the_learner(backend):
    model = make_model()
    engine = backend(model)
    p = prompts(12)[0]
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, top_k=50, seed=11)
    a, b = run(engine, (p, sp), (p, sp))
    assert a.token_ids == b.token_ids
    ids = torch.tensor([p + a.token_ids])
    lp = token_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool), temperature=0.8)[0, len(p):]
    assert lp.tolist() == pytest.approx(a.logprobs, abs=1e-10)


def test_top_k_1_is_greedy(backend):
    model = make_model()
    p = prompts(9)[0]
    (out,) = run(backend(model), (p, SamplingParams(max_tokens=8, top_k=1, seed=0)))
    assert out.token_ids == reference(model, p, 8)[0]


def test_stop_tokens_and_max_tokens(backend):
    model = make_model()
    p = prompts(10)[0]
    first = reference(model, p, 1)[0][0]
    stop, length = run(backend(model), (p, dataclasses.replace(GREEDY, stop_token_ids=(first,))),
                       (p, dataclasses.replace(GREEDY, max_tokens=3)))
    assert (stop.token_ids, stop.finish_reason) == ([first], "stop")
    assert len(length.token_ids) == 3 or length.finish_reason == "stop"


def test_thinking_budget_forces_think_end(backend):
    """The budget is the turn's (``generate_turn``), the same over every backend: the engine only
    stops at ``</think>`` and at ``max_tokens``."""
    model = make_model()
    engine = backend(model)
    p = prompts(6)[0] + [TOK.think_id]

    async def go():
        try:
            return await generate_turn(engine, p, SamplingParams(max_tokens=8, temperature=1.0, seed=2), 3, TOK)
        finally:
            await engine.close()

    out = asyncio.run(go())
    if TOK.think_end_id not in out.token_ids[:3] and TOK.im_end_id not in out.token_ids[:3]:
        assert (out.token_ids[3], out.sampled[3], out.logprobs[3]) == (TOK.think_end_id, 0, 0.0)
    assert sum(1 for s in out.sampled if s == 0) <= 1
    assert len(out.token_ids) <= 8 and out.think_tokens <= 3


def test_update_weights_switches_model_and_version(backend):
    engine = backend(make_model())
    p = prompts(11)[0]
    run(engine, (p, GREEDY))
    new = make_model(seed=5)
    engine.update_weights(3, build_bundle(new.state_dict(), 3, is_quantized=lambda n, t: False))
    assert engine.version == 3
    (out,) = run(engine, (p, GREEDY))
    check_record(out, 3)
    assert out.token_ids == reference(new, p, GREEDY.max_tokens)[0]
