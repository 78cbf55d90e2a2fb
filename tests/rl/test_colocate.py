"""Colocated mode in one process (rl/colocate.py, rl/rollout/sleep.py): engine → learner → MXFP4 push →
engine, on the host through the code that targets a GPU."""

import asyncio

import pytest
import torch

from jointrl.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from jointrl.model import MoETransformer
from jointrl.rl.build import DTYPES, build_model, build_tokenizer, model_config
from jointrl.rl.colocate import Colocated, train_batch
from jointrl.rl.config import load_config
from jointrl.rl.device import HOST, materialise
from jointrl.rl.learner.push import WeightPusher
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.types import GenerationOutput, SamplingParams
from jointrl.rl.weight_sync import apply_bundle, is_routed_expert

ENGINE = EngineConfig(num_blocks=64, block_size=16, max_num_seqs=8)
PROMPTS = [[257, 10, 20, 30, 259], [257, 99, 259], [257, 1, 2, 3, 4, 5, 6, 7, 259]]


def _params():
    return [SamplingParams(max_tokens=8, seed=s) for s in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def stepped():
    """A colocated pair after one rollout and one learner step (lr large enough to move every weight)."""
    cfg = load_config(["seed=1", "learner.lr=1e-2", "learner.grad_clip=0"])
    col = Colocated(cfg, ENGINE, device=HOST)
    outs = col.rollout(PROMPTS, _params())
    before = {k: v.clone() for k, v in col.setup.engine.module.state_dict().items()}
    metrics = col.train(train_batch(PROMPTS, outs, [1.0, -1.0, 0.5]))
    return cfg, col, before, metrics


def test_engine_after_the_push_equals_a_fresh_engine_from_the_push(stepped):
    cfg, col, before, metrics = stepped
    learner = col.setup.engine.module.state_dict()
    assert col.engine.version == 1 and not col.engine.asleep and metrics["tokens"] > 0
    assert any(not torch.equal(before[k], learner[k]) for k in learner)  # the step moved the weights
    # a fresh engine: a meta model given other random weights, then only the push
    with torch.device("meta"):
        fresh_model = MoETransformer(model_config(cfg))
    fresh_model = materialise(fresh_model, HOST, DTYPES[cfg.model.dtype], seed=99)
    apply_bundle(fresh_model, col.last_push, expected_version=1)
    fresh = LLMEngine(fresh_model, build_tokenizer(cfg), ENGINE)
    got, want = col.rollout(PROMPTS, _params()), fresh.generate_batch(PROMPTS, _params())
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    # the engine's weights: the learner's, routed experts as their MXFP4 round trip
    engine = col.engine.model.state_dict()
    quantized = [k for k in learner if is_routed_expert(k, learner[k])]
    assert quantized
    for k, w in learner.items():
        want_k = dequantize_mxfp4(*quantize_mxfp4(w), dtype=w.dtype) if k in quantized else w
        assert torch.equal(engine[k], want_k), k


def test_the_push_stays_where_the_weights_are(stepped):
    _, col, _, _ = stepped
    devices = {t.device for b in col.last_push.buckets for e in b.entries for t in (e.data, e.scales) if t is not None}
    assert devices == {col.device}


def test_sleep_releases_the_pool_and_refuses_work_until_wake_up():
    cfg = load_config(["seed=2"])
    engine = LLMEngine(build_model(cfg, HOST), build_tokenizer(cfg), ENGINE, device=HOST)
    want = engine.generate_batch(PROMPTS, _params())
    engine.sleep(offload_weights=True)
    assert engine.asleep and engine.runner is None and engine.scheduler is None
    assert engine.sleep_state.pool_bytes > 0 and engine.kv_cache_bytes == 0  # no pool tensor left alive
    with pytest.raises(RuntimeError, match="asleep"):
        engine.step()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate_batch(PROMPTS, _params())
    with pytest.raises(RuntimeError, match="asleep"):
        engine.sleep()
    engine.wake_up()
    with pytest.raises(RuntimeError, match="awake"):
        engine.wake_up()
    got = engine.generate_batch(PROMPTS, _params())  # a fresh pool: every prompt prefilled again
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="in flight"):
        engine.sleep()


def test_train_batch_masks_the_prompt_and_checks_lengths():
    out = GenerationOutput([5, 6], [-0.5, -1.0], [1, 0], "stop", 0)
    batch = train_batch([[1, 2, 3]], [out], [2.0])
    assert batch.token_ids == [[1, 2, 3, 5, 6]] and batch.loss_mask == [[0, 0, 0, 1, 0]]
    assert batch.old_logprobs == [[0.0, 0.0, 0.0, -0.5, -1.0]] and batch.advantages == [2.0]
    with pytest.raises(ValueError, match="2 prompts"):
        train_batch([[1], [2]], [out], [1.0])


def test_behind_the_async_front_requests_in_flight_finish_and_new_ones_wait_for_the_wake():
    """``sleep_when_idle`` (the Ray worker's sleep): the request in flight completes on the old weights,
    the pool is released (no tensor of it left alive), a request sent while asleep waits, a push lands
    in the sleeping weights, and after ``wake_up_and_serve`` the held request runs on the pushed version."""
    cfg = load_config(["seed=2"])
    engine = LLMEngine(build_model(cfg, HOST), build_tokenizer(cfg), ENGINE, device=HOST)
    params = _params()
    before = [engine.generate_batch([p], [sp])[0] for p, sp in zip(PROMPTS, params)]
    bundle = WeightPusher(cfg, build_model(load_config(["seed=4"]), HOST), rank=0).bundle(1)

    async def colocated_step():
        in_flight = asyncio.ensure_future(engine.generate(PROMPTS[2], params[2]))
        await asyncio.sleep(0)  # queued in the engine
        assert engine._inbox or engine.scheduler.has_work()
        await engine.sleep_when_idle()
        assert engine.asleep and engine.kv_cache_bytes == 0
        finished = await asyncio.wait_for(in_flight, 30.0)  # served before the sleep: nothing serves now
        held = asyncio.ensure_future(engine.generate(PROMPTS[0], params[0]))
        await asyncio.sleep(0.05)
        assert not held.done()
        engine.update_weights(1, bundle)
        await engine.wake_up_and_serve()
        out = await held
        await engine.close()
        return finished, out

    finished, held = asyncio.run(colocated_step())
    assert (finished.token_ids, finished.logprobs, finished.policy_version) == (
        before[2].token_ids, before[2].logprobs, 0)
    again = engine.generate_batch([PROMPTS[0]], [params[0]])[0]  # awake, on the push
    assert held.policy_version == 1 and (held.token_ids, held.logprobs) == (again.token_ids, again.logprobs)
    assert held.logprobs != before[0].logprobs
    assert engine.kv_cache_bytes == engine.runner.cache_bytes > 0


def test_a_failed_offload_leaves_the_engine_awake_and_serving():
    """A sleep whose weight offload raises (here a real failure: the target ``cuda:999`` exists on no host)
    changes nothing: the error propagates, the engine is awake with its runner, pool and scheduler and its
    weights where they were, and the request held while the sleep was tried runs, equal to before."""
    cfg = load_config(["seed=2"])
    engine = LLMEngine(build_model(cfg, HOST), build_tokenizer(cfg), ENGINE, device=HOST)
    params = _params()
    want = engine.generate_batch([PROMPTS[0]], [params[0]])[0]
    runner, pool_bytes = engine.runner, engine.kv_cache_bytes
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}

    async def failed_sleep():
        in_flight = asyncio.ensure_future(engine.generate(PROMPTS[2], params[2]))
        await asyncio.sleep(0)  # queued in the engine
        held = asyncio.ensure_future(engine.generate(PROMPTS[0], params[0]))  # sent as the sleep starts: held
        with pytest.raises(Exception) as err:  # torch's own error for an unusable device
            await engine.sleep_when_idle(offload_weights=True, offload_to="cuda:999")
        assert not engine.asleep
        # the request in flight was run to its end by the serve loop (its result is delivered on the loop's next
        # turns: the step that finished it returns from the executor thread first)
        assert len((await asyncio.wait_for(in_flight, 30.0)).token_ids) == params[2].max_tokens
        out = await asyncio.wait_for(held, 30.0)  # served again
        await engine.close()
        return err.value, out

    err, out = asyncio.run(failed_sleep())
    assert not isinstance(err, AssertionError) or "CUDA" in str(err)
    assert engine.runner is runner and engine.scheduler is not None and engine.kv_cache_bytes == pool_bytes
    assert all(t.device == HOST for t in engine.model.state_dict().values())
    assert all(torch.equal(v, weights[k]) for k, v in engine.model.state_dict().items())
    assert (out.token_ids, out.logprobs) == (want.token_ids, want.logprobs)
    with pytest.raises(Exception):
        engine.sleep(offload_weights=True, offload_to="cuda:999")  # the plain call: the same
    assert not engine.asleep and engine.runner is runner
    del runner
    engine.sleep(offload_weights=True)  # and a sleep that can succeed still does
    assert engine.asleep and engine.kv_cache_bytes == 0


def _storage_bytes(*xs) -> int:
    """Bytes of the distinct storages of the tensors in ``xs`` (nested tuples / lists / dicts)."""
    seen, stack = {}, list(xs)
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return sum(seen.values())


def test_sleep_measures_the_derived_weights_and_decode_buffers_it_releases():
    """``sleep`` counts every tensor of the runner's state, not only its pools: after decoding through
    ``DecodeGraphs`` (eager on the host, its static buffers allocated) with packed weights (``_fused``) and a
    rope table, the released bytes are exactly pools + decode buffers + derived weights + rope table (no
    model weight among them), and none of them is left alive after the sleep."""
    cfg = load_config(["seed=2"])
    engine = LLMEngine(build_model(cfg, HOST), build_tokenizer(cfg),
                       EngineConfig(num_blocks=64, block_size=16, max_num_seqs=8, decode_graphs=True), device=HOST)
    engine.generate_batch(PROMPTS, _params())
    r = engine.runner
    pools = r.cache_bytes
    buffers = _storage_bytes([vars(b) for b in r.graphs._buckets.values()])
    fused, rope = _storage_bytes(r._fused), _storage_bytes(r._rope_table)
    assert buffers > 0 and fused > 0 and rope > 0
    del r
    engine.sleep()
    assert engine.sleep_state.pool_bytes == pools + buffers + fused + rope
    assert engine.kv_cache_bytes == 0
    engine.wake_up()
    assert engine.runner.graphs is not None and engine.kv_cache_bytes == engine.runner.cache_bytes
