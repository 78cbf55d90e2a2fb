"""The device paths on CUDA (``pytest -m gpu``; skipped with the reason without a GPU: tests/conftest.py).
tests/gpu/check.sh runs these on the lent GPU machine where pytest is installed."""

import dataclasses

import pytest
import torch

from jointrl.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from jointrl.rl.build import build_model
from jointrl.rl.config import Config, DomainConfig, EnvsConfig, ModelConfig
from jointrl.rl.device import HOST, rank_device
from jointrl.rl.learner.batch import TrainBatch
from jointrl.rl.learner.objective import build_objective
from jointrl.rl.learner.setup import setup_local_rank
from jointrl.rl.learner.step import TrainStep
from jointrl.rl.weight_sync import apply_bundle, build_bundle, is_routed_expert

pytestmark = pytest.mark.gpu


def _cfg(dtype: str = "bfloat16") -> Config:  # built in code: the GPU machine has no Hydra
    return Config(model=ModelConfig(name="tiny", dtype=dtype, hidden_size=64, num_experts=4),
                  envs=EnvsConfig(domains={"terminal": DomainConfig()}))


def test_model_built_on_the_gpu_equals_the_host_build():
    cfg, device = _cfg(), rank_device()
    gpu, host = build_model(cfg, device).state_dict(), build_model(cfg, HOST).state_dict()
    for k in host:
        assert gpu[k].device == device and torch.equal(gpu[k].to(HOST), host[k]), k


def test_push_is_quantized_on_the_gpu_and_lands_as_the_round_trip():
    cfg, device = _cfg(), rank_device()
    src, dst = build_model(cfg, device), build_model(dataclasses.replace(cfg, seed=5), device)
    bundle = build_bundle(src.state_dict(), 1, device=None)
    assert {e.data.device for b in bundle.buckets for e in b.entries} == {device}
    apply_bundle(dst, bundle, expected_version=1)
    for k, w in src.state_dict().items():
        want = dequantize_mxfp4(*quantize_mxfp4(w), dtype=w.dtype) if is_routed_expert(k, w) else w
        assert torch.equal(dst.state_dict()[k], want), k


def test_local_learner_step_stays_on_the_gpu():
    cfg, device = _cfg(), rank_device()
    objective = build_objective(cfg)
    setup = setup_local_rank(cfg, objective, device)
    step = TrainStep(cfg, setup, objective, world_size=1)
    batch = TrainBatch([[1, 2, 3, 4, 5], [1, 2, 6]], [[0, 0, 1, 1, 1], [0, 0, 1]], [[0.0, 0.0, -1.0, -1.2, -0.9],
                                                                                     [0.0, 0.0, -2.0]], [1.0, -1.0])
    metrics = step.train_step(batch, batch.num_loss_tokens, batch.num_loss_seqs)
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    assert all(p.device == device for p in setup.engine.module.parameters())
    assert all(v.device == device for st in setup.engine.optimizer.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)
