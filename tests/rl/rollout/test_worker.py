"""The rollout worker (rl/rollout/worker.py): where it puts the own engine (``engine_device``): on the
rank's GPU when ``model.kernels`` runs there, else on the host -- and it says which when it starts; and
how it sleeps through the learner step when colocated."""

from __future__ import annotations

import pytest
import torch

from jointrl.model import MoETransformer
from jointrl.rl.build import DTYPES, build_model, build_tokenizer, model_config
from jointrl.rl.config import load_config
from jointrl.rl.device import HOST, materialise
from jointrl.rl.learner.push import WeightPusher
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.rollout.worker import RolloutWorker, engine_device
from jointrl.rl.types import SamplingParams
from jointrl.rl.weight_sync import apply_bundle

GPU = torch.device("cuda", 0)  # named, not touched: the choice needs no CUDA runtime


@pytest.mark.parametrize(("kernels", "backend"), [("auto", "triton"), ("triton", "triton"), ("torch", "torch")])
def test_the_engine_goes_to_the_gpu_when_its_kernels_run_there(kernels, backend):
    device, why = engine_device(kernels, device=GPU)
    assert device == GPU
    assert repr(backend) in why and "cuda:0" in why


def test_the_cpu_kernels_and_batch_invariance_keep_the_engine_on_the_host():
    device, why = engine_device("cpu", device=GPU)
    assert device == HOST and "model.kernels=cpu" in why
    device, why = engine_device("auto", batch_invariant=True, device=GPU)
    assert device == HOST and "batch_invariant" in why


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the choice on a machine without a GPU")
def test_without_a_gpu_the_worker_builds_its_engine_on_the_host_and_says_so(capsys):
    assert engine_device("auto")[0] == HOST
    for backend in ("engine", "simple"):
        worker = RolloutWorker(load_config(["seed=5", f"rollout.backend={backend}"]))
        assert worker.device == HOST
        assert next(worker.engine.model.parameters()).device == HOST
        assert f"{backend} engine on cpu (no GPU visible" in capsys.readouterr().out


PROMPTS = [[257, 10, 20, 30, 259], [257, 99, 259]]


def test_colocated_worker_frees_its_pool_holds_requests_and_wakes_on_the_push(cluster):
    """The own engine as the Ray driver drives it with ``cluster.colocate=true`` (rl/train.py): asleep, the
    worker's KV pool is released (no tensor of it left alive), its weights are on the host, a request sent
    meanwhile is held, and a push lands in the sleeping weights; after ``wake_up`` the held request and
    the next ones are those of a fresh engine built from the pushed weights alone, bit for bit."""
    import ray

    cfg = load_config(["seed=3", "rollout.num_blocks=32", "cluster.colocate=true", "rollout.colocate_offload_weights=true"])
    worker = ray.remote(num_cpus=1, max_concurrency=100)(RolloutWorker).remote(cfg)
    params = [SamplingParams(max_tokens=6, seed=s) for s in range(len(PROMPTS))]
    before = ray.get([worker.generate.remote(p, sp) for p, sp in zip(PROMPTS, params)])
    pool = ray.get(worker.kv_cache_bytes.remote())
    assert pool > 0
    assert ray.get(worker.sleep.remote()) == 0 and ray.get(worker.kv_cache_bytes.remote()) == 0
    held = worker.generate.remote(PROMPTS[0], params[0])
    assert ray.wait([held], timeout=1.0)[1] == [held]  # not served while asleep

    pushed = build_model(load_config(["seed=11"]), HOST)  # other weights than the worker's
    bundle = WeightPusher(cfg, pushed, rank=0).bundle(1)  # routed experts as MXFP4, as the learner sends
    ray.get(worker.update_weights.remote(1, bundle))
    assert ray.wait([held], timeout=0.2)[1] == [held]
    ray.get(worker.wake_up.remote())
    assert ray.get(worker.kv_cache_bytes.remote()) == pool
    got = [ray.get(held), *ray.get([worker.generate.remote(p, sp) for p, sp in zip(PROMPTS[1:], params[1:])])]

    with torch.device("meta"):
        fresh_model = MoETransformer(model_config(cfg))
    fresh_model = materialise(fresh_model, HOST, DTYPES[cfg.model.dtype], seed=99)
    apply_bundle(fresh_model, bundle, expected_version=1)
    r = cfg.rollout
    fresh = LLMEngine(fresh_model, build_tokenizer(cfg), EngineConfig(
        num_blocks=r.num_blocks, block_size=r.block_size, max_num_seqs=r.max_batch,
        max_num_batched_tokens=r.max_num_batched_tokens))
    want = [fresh.generate_batch([p], [sp])[0] for p, sp in zip(PROMPTS, params)]  # one at a time, as served
    assert [o.policy_version for o in got] == [1, 1]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    assert [o.logprobs for o in got] != [o.logprobs for o in before]  # the push changed the policy
    ray.get(worker.close.remote())


def test_rollout_decode_graphs_reaches_the_engine_and_refuses_batch_invariance():
    worker = RolloutWorker(load_config(["seed=5", "rollout.decode_graphs=true"]))
    assert worker.engine.runner.graphs is not None  # pure decode steps go through cuda_graphs.DecodeGraphs
    assert RolloutWorker(load_config(["seed=5"])).engine.runner.graphs is None
    with pytest.raises(ValueError, match=r"^config keys 'rollout.decode_graphs' and 'rollout.batch_invariant'"):
        load_config(["rollout.decode_graphs=true", "rollout.batch_invariant=true"])
