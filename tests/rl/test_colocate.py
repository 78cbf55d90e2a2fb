"""Colocated mode in one process (rl/colocate.py, rl/rollout/sleep.py): engine → learner → MXFP4 push →
engine, on the host through the code that targets a GPU."""

import pytest
import torch

from jointrl.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from jointrl.model import MoETransformer
from jointrl.rl.build import DTYPES, build_model, build_tokenizer, model_config
from jointrl.rl.colocate import Colocated, train_batch
from jointrl.rl.config import load_config
from jointrl.rl.device import HOST, materialise
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
