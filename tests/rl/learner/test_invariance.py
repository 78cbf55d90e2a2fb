"""The update does not depend on how the batch is cut: sequences per micro-batch, token-budget
packing (several sequences per row) or gradient checkpointing (real DeepSpeed, one rank)."""

import pytest
import torch

from jointrl.rl.build import build_model
from jointrl.rl.config import load_config
from jointrl.rl.learner.batch import TrainBatch, plan_micro_batches
from jointrl.rl.learner.step import clip_grad_norm
from jointrl.rl.learner.worker import LearnerWorker
from jointrl.rl.types import ROUTE_DTYPE

_PORT = [29750]
BASE = ["model.dtype=float64", "learner.eps=1.0", "learner.grad_clip=0.0"]


def _batch() -> TrainBatch:
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 5, 12, 7, 3, 10, 6, 8)]
    masks = [[0] * 2 + [1] * (len(s) - 2) for s in seqs]
    old = [[0.0 if m == 0 else -5.5 + 0.05 * i for i, m in enumerate(mk)] for mk in masks]
    return TrainBatch(seqs, masks, old, [1.0, -0.5, 0.25, -1.0, 0.5, -0.75, 1.5, -0.25])


def _update(*overrides):
    cfg = load_config([*BASE, *overrides])
    _PORT[0] += 1
    lw = LearnerWorker(cfg, 0, 1, "127.0.0.1", _PORT[0])
    init = build_model(cfg).state_dict()
    batch = _batch()
    m = lw.train_step(batch, batch.num_loss_tokens, batch.num_loss_seqs)
    return m, {k: v - init[k] for k, v in lw.engine.module.state_dict().items()}


def test_plan_respects_token_budget():
    assert plan_micro_batches([9, 5, 12, 7], max_tokens=16, max_seqs=0, pack=True) == [[0, 1], [2], [3]]
    # padded cost: rows x longest; [9, 5] costs 18, [12, 7] would cost 24
    assert plan_micro_batches([9, 5, 12, 7], max_tokens=20, max_seqs=0, pack=False) == [[0, 1], [2], [3]]
    assert plan_micro_batches([5, 5, 5], max_tokens=10, max_seqs=0, pack=False) == [[0, 1], [2]]
    assert plan_micro_batches([30, 2], max_tokens=10, max_seqs=0, pack=True) == [[0], [1]]  # too long: alone


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_update_invariant_to_micro_batching_packing_and_checkpointing(agg):
    """Batch 8 x accumulation 1 vs 1 x 8, packed rows under a 24-token budget, and packed with
    gradient checkpointing: the same loss and, to fp32 master-weight rounding, the same update."""
    ref_m, ref = _update("learner.micro_batch_size=8", f"algo.aggregation={agg}")
    for overrides in (["learner.micro_batch_size=1"],
                      ["learner.micro_batch_size=0", "learner.pack_sequences=true", "learner.max_tokens_per_micro_batch=24"],
                      ["learner.micro_batch_size=0", "learner.pack_sequences=true", "learner.max_tokens_per_micro_batch=24",
                       "learner.gradient_checkpointing=true"]):
        m, d = _update(*overrides, f"algo.aggregation={agg}")
        assert m["loss"] == pytest.approx(ref_m["loss"], rel=1e-9), overrides
        for k in ref:
            torch.testing.assert_close(d[k], ref[k], rtol=1e-4, atol=2.5e-7, msg=f"{overrides}: {k}")


def test_every_objective_option_runs_through_deepspeed():
    """GSPO, and PPO with its critic + KL to a reference + entropy + TIS + fake-quantized experts
    + routing replay, each take a finite step and report their metrics."""
    batch = _batch()
    batch.rewards = [1.0, 0.0, 1.0, 0.0, 0.5, 0.0, 1.0, 0.0]
    batch.routed_experts = [torch.tensor([[[t % 4, (t + 1) % 4]] * 2 for t in range(len(s))], dtype=ROUTE_DTYPE)
                           for s in batch.token_ids]
    for overrides in (["algo.name=gspo", "algo.clip_low=3e-4", "algo.clip_high=4e-4"],
                      ["algo.name=ppo", "algo.kl_coef=0.05", "algo.entropy_coef=0.01", "algo.behaviour_logprobs=learner",
                       "algo.mismatch=tis", "learner.fake_quant_experts=true", "learner.routing_replay=true"]):
        cfg = load_config(["model.dtype=float64", *overrides])
        _PORT[0] += 1
        lw = LearnerWorker(cfg, 0, 1, "127.0.0.1", _PORT[0])
        m = lw.train_step(batch, batch.num_loss_tokens, batch.num_loss_seqs)
        assert all(v == v for v in m.values()), m  # no NaN
        assert {"loss", "clip_frac", "approx_kl", "entropy", "ratio_max", "adv_mean", "mismatch/kl_k3",
                "experts/dead_total", "grad_norm"} <= set(m)
        if cfg.algo.name == "ppo":
            assert {"vf_loss", "kl_ref", "value_mean"} <= set(m) and m["kl_ref"] == pytest.approx(0.0, abs=1e-12)
            assert "value_head.weight" not in {e.name for b in lw.weight_bundle(1).buckets for e in b.entries}


def test_update_invariant_to_zero_stage_on_one_rank(monkeypatch):
    """One rank: ZeRO-1 (what one rank ran before ``setup.zero_stage`` made it ZeRO-0; forced here)
    and ZeRO-0 (no all-reduce at all), which every ``learner.zero_stage`` now runs on one rank in
    fp32 / fp64, take the same update."""
    import jointrl.rl.learner.setup as setup_mod

    with monkeypatch.context() as m:
        m.setattr(setup_mod, "zero_stage", lambda cfg, world_size: 1)
        ref_m, ref = _update("learner.micro_batch_size=3")
    for stage in (0, 1, 2):
        m, d = _update("learner.micro_batch_size=3", f"learner.zero_stage={stage}")
        assert m["loss"] == pytest.approx(ref_m["loss"], rel=1e-12), stage
        for k in ref:
            torch.testing.assert_close(d[k], ref[k], rtol=1e-4, atol=2.5e-7, msg=f"stage {stage}: {k}")


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3, float("nan")])
def test_clip_grad_norm_equals_torch(scale):
    """The learner's own clip equals ``torch.nn.utils.clip_grad_norm_`` bit for bit: within the
    bound (no multiply), above it, and with a NaN gradient."""
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(shape, generator=g) * scale for shape in ((7, 5), (11,), (3, 4, 2))]
    ours, ref = ([torch.nn.Parameter(torch.zeros_like(t)) for t in grads] for _ in range(2))
    for a, b, t in zip(ours, ref, grads):
        a.grad, b.grad = t.clone(), t.clone()
    norm = clip_grad_norm(ours, 1.0)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0, foreach=True)
    torch.testing.assert_close(norm, ref_norm, rtol=0, atol=0, equal_nan=True)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, equal_nan=True)
