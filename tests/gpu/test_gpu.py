"""The device paths on CUDA (``pytest -m gpu``; skipped with the reason without a GPU: tests/conftest.py).
tests/gpu/check.sh runs these on the lent GPU machine where pytest is installed."""

import dataclasses

import pytest
import torch

from jointrl.kernels import paged_attention, paged_attention_cpu
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


@pytest.mark.parametrize(("dtype", "kv_dtype", "bound"), [(torch.bfloat16, torch.bfloat16, 1e-2),
                                                          (torch.float32, torch.bfloat16, 1e-5)])
def test_paged_prefill_kernel_on_the_gpu_equals_the_reference(dtype, kv_dtype, bound):
    """The compiled prefill kernel (not the interpreter) at Qwen3-30B-A3B's attention shape: ragged chunks
    over a pool of scattered blocks, against the float64 reference; rows outside the chunks untouched."""
    device = rank_device()
    g = torch.Generator(device=device).manual_seed(0)
    Hq, Hkv, D, bs = 32, 4, 128, 16
    chunks = [(0, 300), (517, 1), (1000, 64), (33, 129)]  # (cached, new)
    P = 4096 * bs
    kv = torch.randn(P, 2, Hkv, D, device=device, generator=g).to(kv_dtype)
    slots = torch.full((len(chunks), max(c + n for c, n in chunks)), -1, dtype=torch.long, device=device)
    for j, (c, n) in enumerate(chunks):
        blocks = torch.randperm(P // bs, device=device, generator=g)[:-(-(c + n) // bs)]
        t = torch.arange(c + n, device=device)
        slots[j, :c + n] = blocks[t // bs] * bs + t % bs
    count = torch.tensor([n for _, n in chunks], device=device)
    row0 = torch.cumsum(count, 0) - count + 2  # rows 0, 1: decode rows
    start = torch.tensor([c for c, _ in chunks], device=device)
    q = torch.randn(2 + int(count.sum()), Hq, D, device=device, generator=g).to(dtype)
    out = paged_attention.paged_prefill_triton(q, kv, slots, start, row0, count, D ** -0.5, torch.zeros_like(q))
    want = paged_attention_cpu.paged_prefill_torch(q.double(), kv.double(), slots, start, row0, count, D ** -0.5,
                                                   torch.zeros_like(q, dtype=torch.float64))
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    err = ((out[2:].double() - want[2:]).norm() / want[2:].norm()).item()
    assert err < bound, err


@pytest.mark.parametrize("window", [None, 128])
def test_paged_kernels_with_sinks_and_window_on_the_gpu_equal_the_reference(window):
    """The compiled decode and prefill kernels with gpt-oss's attention sinks and sliding window (its 120b
    shape: 64 query heads on 8 kv heads, head_dim 64, window 128) against the float64 references: contexts
    and chunks longer than the window, bfloat16."""
    from jointrl.kernels import ops  # the triton table's decode launcher on the fused pool

    device = rank_device()
    g = torch.Generator(device=device).manual_seed(1)
    Hq, Hkv, D, bs = 64, 8, 64, 16
    chunks = [(0, 300), (517, 1), (1000, 64), (33, 129)]  # (cached, new)
    P = 1024 * bs
    kv = torch.randn(P, 2, Hkv, D, device=device, generator=g).to(torch.bfloat16)
    slots = torch.zeros((len(chunks), max(c + n for c, n in chunks)), dtype=torch.long, device=device)
    for j, (c, n) in enumerate(chunks):
        blocks = torch.randperm(P // bs, device=device, generator=g)[:-(-(c + n) // bs)]
        t = torch.arange(c + n, device=device)
        slots[j, :c + n] = blocks[t // bs] * bs + t % bs
    sinks = torch.randn(Hq, device=device, generator=g) * 2
    count = torch.tensor([n for _, n in chunks], device=device)
    row0 = torch.cumsum(count, 0) - count
    start = torch.tensor([c for c, _ in chunks], device=device)
    q = torch.randn(int(count.sum()), Hq, D, device=device, generator=g).to(torch.bfloat16)
    out = paged_attention.paged_prefill_triton(q, kv, slots, start, row0, count, D ** -0.5, torch.zeros_like(q),
                                               sinks_H=sinks, window=window)
    want = paged_attention_cpu.paged_prefill_torch(q.double(), kv.double(), slots, start, row0, count, D ** -0.5,
                                                   torch.zeros_like(q, dtype=torch.float64), sinks.double(), window)
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < 1e-2, err
    ctx = start + count  # each chunk's last query as a decode row
    dec = ops.paged_decode_triton(q[row0 + count - 1], kv, slots, ctx, D ** -0.5, sinks, window)
    err = ((dec.double() - want[row0 + count - 1]).norm() / want[row0 + count - 1].norm()).item()
    assert err < 1e-2, err
