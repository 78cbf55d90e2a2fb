"""``rl/learner/step.py``'s update and log-probs (DeepSpeed over gloo, one rank in this process)
against the sampler and against the GRPO formula computed by hand; the lr schedule, autocast and
gated_dsa's indexer loss."""

import asyncio
import math

import pytest
import torch

from jointrl.model.tokenizer import ByteTokenizer
from jointrl.rl.config import load_config
from jointrl.rl.learner.batch import TrainBatch, token_logprobs
from jointrl.rl.learner.worker import LearnerWorker
from jointrl.rl.build import build_model
from jointrl.rl.rollout.sampler import SimpleSampler
from jointrl.rl.rollout.turn import generate_turn
from jointrl.rl.types import SamplingParams

_PORT = [29650]


def learner(*overrides):
    cfg = load_config(["model.dtype=float64", *overrides])
    _PORT[0] += 1
    return cfg, LearnerWorker(cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=_PORT[0])


@pytest.fixture(scope="module")
def fp64_learner():
    return learner("rollout.quantize_experts=false")  # the push sends the weights as they are


def test_learner_logprobs_equal_sampler_logprobs_fp64(fp64_learner):
    """Same weights (pushed through the weight bundle, unquantized), same tokens: the learner's
    log-probs equal the engine's, in float64, within 1e-10."""
    cfg, lw = fp64_learner
    sampler = SimpleSampler(build_model(cfg), ByteTokenizer())
    with torch.no_grad():
        for p in sampler.model.parameters():
            p.add_(0.1)  # the push must overwrite every weight
    sampler.update_weights(1, lw.weight_bundle(1))
    prompts = [[257, 10, 20, 30, 259], [257, 99, 259], [257, 1, 2, 3, 4, 5, 6, 7, 259]]

    async def turns():  # thinking budget 4, enforced by the turn (a forced </think> is not sampled)
        try:
            return await asyncio.gather(*(generate_turn(sampler, p, SamplingParams(max_tokens=12, seed=s), 4, sampler.tok)
                                          for s, p in enumerate(prompts)))
        finally:
            await sampler.close()

    outs = asyncio.run(turns())
    learner_lp = lw.logprobs([p + o.token_ids for p, o in zip(prompts, outs)])
    for p, o, lp in zip(prompts, outs, learner_lp):
        for i, (tok_lp, sampled) in enumerate(zip(o.logprobs, o.sampled)):
            if sampled:
                assert lp[len(p) + i] == pytest.approx(tok_lp, abs=1e-10)
        if 260 not in o.token_ids[:4]:  # thinking budget 4: the 5th token is a forced </think>
            assert (o.token_ids[4], o.sampled[4], o.logprobs[4]) == (260, 0, 0.0)


def _fixed_batch():
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 5, 12, 7)]
    masks = [[0] * 3 + [1] * (len(s) - 3) for s in seqs]
    old = [[0.0 if m == 0 else -5.5 + 0.1 * i for i, m in enumerate(mk)] for mk in masks]
    return TrainBatch(seqs, masks, old, [1.0, -0.5, 0.25, -1.0])


def test_grpo_step_matches_hand_computed_loss():
    cfg, lw = learner("learner.micro_batch_size=3", "learner.grad_clip=0.0")
    batch = _fixed_batch()
    reference = build_model(cfg)  # the learner's initial weights
    n = batch.num_loss_tokens
    expected = 0.0
    for seq, mask, old, adv in zip(batch.token_ids, batch.loss_mask, batch.old_logprobs, batch.advantages):
        ids = torch.tensor([seq])
        lp = token_logprobs(reference, ids, torch.ones_like(ids, dtype=torch.bool))[0].tolist()
        for t, m in enumerate(mask):
            if m:
                ratio = math.exp(lp[t] - old[t])
                expected -= min(ratio * adv, min(max(ratio, 0.8), 1.28) * adv) / n
    metrics = lw.train_step(batch, n)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert metrics["tokens"] == n
    # and the update moved the weights
    moved = [not torch.equal(a, b) for a, b in zip(reference.state_dict().values(), lw.engine.module.state_dict().values())]
    assert any(moved)


def test_update_is_invariant_to_micro_batching():
    """Batch 4 x 1 micro-batch vs 1 x 4: the same token-mean loss and gradient, so the same update.

    Adam's first step is ~lr * sign(g), which turns rounding-level gradient differences on
    near-zero entries into visible ones; a large eps makes the update linear in g instead.
    ZeRO keeps fp32 master weights even for a float64 model, so updated weights carry fp32
    rounding (one ulp of a weight ~1 is 1.2e-7); the updates themselves are ~1e-3.
    """
    batch = _fixed_batch()
    results = []
    for mbs in (4, 1):
        cfg, lw = learner(f"learner.micro_batch_size={mbs}", "learner.eps=1.0", "learner.grad_clip=0.0")
        init = build_model(cfg).state_dict()
        m = lw.train_step(batch, batch.num_loss_tokens)
        results.append((m, {k: v - init[k] for k, v in lw.engine.module.state_dict().items()}))
    (m4, d4), (m1, d1) = results
    assert m4["loss"] == pytest.approx(m1["loss"], rel=1e-9)
    assert m4["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-6)
    for k in d4:
        torch.testing.assert_close(d4[k], d1[k], rtol=1e-4, atol=2.5e-7, msg=k)


@pytest.mark.parametrize("coef", [1.0, 0.0])
def test_hybrid_learner_trains_the_dsa_indexer_by_its_own_loss(coef):
    """gated_dsa's indexer gets no gradient from the policy loss (top-k is not differentiable, its
    input is detached), so without ``learner.indexer_loss_coef`` it would keep its random initial
    weights and pick keys at random for the whole run. With it, one step moves the indexer
    (and reports the KL); at 0 the indexer stays as built."""
    cfg, lw = learner("model=tiny_hybrid", "model.index_topk=4", f"learner.indexer_loss_coef={coef}")
    init = {k: v.clone() for k, v in lw.engine.module.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (30, 22)]
    batch = TrainBatch(seqs, [[0] * 4 + [1] * (len(s) - 4) for s in seqs],
                       [[0.0] * 4 + [-5.5] * (len(s) - 4) for s in seqs], [1.0, -1.0])
    m = lw.train_step(batch, batch.num_loss_tokens)
    after = lw.engine.module.state_dict()
    moved = {k for k in init if ".indexer." in k and not torch.equal(init[k], after[k])}
    if coef:
        assert m["indexer_kl"] > 0
        assert {k.split(".indexer.")[1] for k in moved} >= {"wq.weight", "wk.weight", "weights_proj.weight"}
    else:
        assert "indexer_kl" not in m and not moved


def test_autocast_learner_follows_the_float32_learner_within_bfloat16_rounding():
    """``learner.autocast=bfloat16`` (float32 weights, the forward's matmuls in bfloat16): on the same
    weights its log-probs are within 0.02 of the float32 learner's (the router, norms, attention and
    logits stay float32), and one step moves the weights the same way (Adam with a large eps, so the
    update is linear in the gradient: cosine > 0.99 between the two updates; the loss within 1 %).
    Measured here: 0.002, cosine 1.0000, loss 3e-4 relative."""
    batch = _fixed_batch()
    runs = []
    for amp in ([], ["learner.autocast=bfloat16"]):
        cfg, lw = learner("model.dtype=float32", "learner.eps=1.0", "learner.grad_clip=0.0", *amp)
        init = build_model(cfg).state_dict()
        lp = lw.logprobs(batch.token_ids)
        m = lw.train_step(batch, batch.num_loss_tokens)
        delta = torch.cat([(v - init[k]).flatten() for k, v in lw.engine.module.state_dict().items()])
        runs.append((lp, m, delta))
    (lp32, m32, d32), (lp16, m16, d16) = runs
    dev = max(abs(a - b) for r32, r16 in zip(lp32, lp16) for a, b in zip(r32, r16))
    assert 0 < dev < 0.02
    assert m16["loss"] == pytest.approx(m32["loss"], rel=1e-2)
    assert torch.nn.functional.cosine_similarity(d16, d32, dim=0) > 0.99


def test_cosine_lr_schedule_decays_over_total_steps_and_resumes(tmp_path):
    """``learner.lr_schedule=cosine``: update k of ``algo.total_steps`` runs at lr · (1 + cos(πk/T)) / 2 (what
    the optimizer's groups hold), the default keeps lr, and a learner resumed from a checkpoint continues
    the schedule where the saved one stopped."""
    batch = _fixed_batch()
    cfg, lw = learner("learner.lr_schedule=cosine", "algo.total_steps=4", "learner.lr=0.01")
    want = [0.01 * (1 + math.cos(math.pi * k / 4)) / 2 for k in range(4)]
    got = []
    for k in range(2):
        got.append(lw.train_step(batch, batch.num_loss_tokens)["lr"])
        assert all(g["lr"] == pytest.approx(want[k]) for g in lw.engine.optimizer.param_groups)
    lw.save_checkpoint(str(tmp_path), 2)
    lw.wait_checkpoint()
    _, resumed = learner("learner.lr_schedule=cosine", "algo.total_steps=4", "learner.lr=0.01")
    assert resumed.load_checkpoint(str(tmp_path)) == 2
    got += [resumed.train_step(batch, batch.num_loss_tokens)["lr"] for _ in range(2)]
    assert got == pytest.approx(want)
    _, constant = learner("algo.total_steps=4", "learner.lr=0.01")
    assert [constant.train_step(batch, batch.num_loss_tokens)["lr"] for _ in range(2)] == [0.01, 0.01]
