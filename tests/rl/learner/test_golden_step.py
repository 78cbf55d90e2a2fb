"""The golden learner step: one float64 GRPO update of tiny_moe on a fixed batch (tokens, rewards and
old log-probs drawn from a fixed seed) whose loss, gradient norm and updated weights are pinned.

A refactor of the learner (the step, the objective, the estimator, micro-batching, DeepSpeed's
wiring) must reproduce these numbers; a change to what the update computes -- a loss coefficient,
the aggregation, the clip range -- must not (``test_golden_step_moves_with_the_objective``).
Adam's first update is ~lr · sign(g), blind to the gradient's scale, so ``learner.eps=1`` makes it
linear in g; ``grad_clip`` is far above the norm, so the learner computes the norm and never clips.
The pins are float64 on CPU; they hold to rounding (rel 1e-9) across thread counts.
"""

import random

import pytest
import torch

from jointrl.rl.advantages import build_estimator
from jointrl.rl.build import build_model
from jointrl.rl.config import load_config
from jointrl.rl.learner.batch import TrainBatch
from jointrl.rl.learner.worker import LearnerWorker
from jointrl.rl.types import Trajectory

_PORT = [29950]
GOLDEN_CONFIG = ["model.dtype=float64", "seed=0", "algo.entropy_coef=0.01", "learner.lr=0.01", "learner.eps=1.0",
                 "learner.grad_clip=1e6", "learner.micro_batch_size=3"]
# measured on the learner as split in issue 30; a commit that changes them must say why
GOLDEN = {"loss": 0.22871010946298695, "grad_norm": 2.285764953749313, "clip_frac": 0.14583333333333334,
          "weight_sum": 379.6858288098108, "update_sq": 0.00048562800557726385}


def golden_batch(cfg) -> TrainBatch:
    """2 prompts x 4 samples: a 4-token prompt per group, 3-10 sampled tokens, rewards in {0, 0.5, 1},
    old log-probs uniform in [-6, -5.2] (the policy's are ~ -5.6: ratios ~0.6-1.6, so
    the clip binds on some tokens, and moving either end of the range moves the update)."""
    rng = random.Random(1234)
    trajs = []
    for g in range(2):
        prompt = [int(rng.random() * 256) for _ in range(4)]
        for i in range(4):
            n = 3 + int(rng.random() * 8)
            trajs.append(Trajectory(prompt + [int(rng.random() * 256) for _ in range(n)], [0] * 4 + [1] * n,
                                    [0.0] * 4 + [-6.0 + 0.8 * rng.random() for _ in range(n)], [-1] * 4 + [0] * n,
                                    "golden", f"t{g}", f"g{g}", reward=[0.0, 0.5, 1.0][int(rng.random() * 3)]))
    adv = build_estimator(cfg.algo).select(trajs)
    assert len(adv.kept) == 8, adv.stats  # both groups' rewards differ
    return TrainBatch([t.token_ids for t in adv.kept], [t.loss_mask for t in adv.kept], [t.logprobs for t in adv.kept],
                      adv.advantages, rewards=[t.reward for t in adv.kept])


def golden_step(*overrides: str) -> dict[str, float]:
    cfg = load_config([*GOLDEN_CONFIG, *overrides])
    _PORT[0] += 1
    lw = LearnerWorker(cfg, 0, 1, "127.0.0.1", _PORT[0])
    init = build_model(cfg).state_dict()
    batch = golden_batch(cfg)
    m = lw.train_step(batch, batch.num_loss_tokens, batch.num_loss_seqs)
    after = lw.engine.module.state_dict()
    return {"loss": m["loss"], "grad_norm": m["grad_norm"], "clip_frac": m["clip_frac"],
            "weight_sum": float(sum(v.double().sum() for v in after.values())),
            "update_sq": float(sum(((after[k] - init[k]).double() ** 2).sum() for k in init))}


def test_golden_step_reproduces_the_pinned_update():
    got = golden_step()
    for key, want in GOLDEN.items():
        assert got[key] == pytest.approx(want, rel=1e-9, abs=1e-15), key


@pytest.mark.parametrize("change", ["algo.clip_high=0.1", "algo.clip_low=0.1", "algo.entropy_coef=0.02",
                                    "algo.aggregation=seq_mean"])
def test_golden_step_moves_with_the_objective(change):
    """Each change to the objective moves the loss and the update off the pins, by far more than rounding."""
    got = golden_step(change)
    assert got["loss"] != pytest.approx(GOLDEN["loss"], rel=1e-6), change
    assert got["update_sq"] != pytest.approx(GOLDEN["update_sq"], rel=1e-6), change
