"""Routing replay (R3): the rollout records each token's experts; the learner replays them.

The sampler runs perturbed weights (as a quantized rollout would): without replay the
learner routes some tokens differently, with replay it routes every token as the rollout
did, and the router still receives gradient."""

import copy

import torch

from jointrl.model.tokenizer import ByteTokenizer
from jointrl.rl.agent_loop import _record_routes
from jointrl.rl.build import build_model
from jointrl.rl.config import load_config
from jointrl.rl.learner.batch import TrainBatch, collate, logprobs_from_logits
from jointrl.rl.learner.forward import learner_forward
from jointrl.rl.rollout.sampler import SimpleSampler
from jointrl.rl.types import ROUTE_DTYPE, SamplingParams, Trajectory


def _episode(model, seed=0) -> Trajectory:
    """Two engine turns with an observation between them, routes recorded as the agent loop does."""
    sampler = SimpleSampler(model, ByteTokenizer(), record_routes=True)
    prompt = [257, 10, 20, 30, 40, 259]
    traj = Trajectory(list(prompt), [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt), "d", "t", "g",
                      routed_experts=None)
    for turn in range(2):
        out = sampler.generate_batch([traj.token_ids], [SamplingParams(max_tokens=10, seed=seed + turn)])[0]
        assert len(out.routed_experts) == len(traj.token_ids) + len(out.token_ids) - 1
        traj.token_ids += out.token_ids
        traj.loss_mask += out.sampled
        traj.logprobs += out.logprobs
        traj.policy_version += [0] * len(out.token_ids)
        _record_routes(traj, out)
        if turn == 1:
            break
        obs = [258, 7, 7, 7, 259]  # an observation: never sampled, routed by the next turn's prefill
        traj.token_ids += obs
        traj.loss_mask += [0] * len(obs)
        traj.logprobs += [0.0] * len(obs)
        traj.policy_version += [-1] * len(obs)
    missing = len(traj.token_ids) - len(traj.routed_experts)  # the last token: never an input
    traj.routed_experts = torch.cat([traj.routed_experts, traj.routed_experts.new_full((missing, *traj.routed_experts.shape[1:]), -1)])
    return traj


def _forward(model, traj, replay: bool, grad=False):
    cfg = model.config
    batch = TrainBatch([traj.token_ids], [traj.loss_mask], [traj.logprobs], [1.0], routed_experts=[traj.routed_experts])
    mb = collate(batch, False, ByteTokenizer().pad_id, torch.float64, (cfg.num_moe_layers, cfg.num_experts_per_tok))
    with torch.set_grad_enabled(grad):
        return mb, learner_forward(model, mb.input_ids, mb.pos, mb.seg, mb.replay if replay else None)


def test_recorded_routes_align_with_tokens():
    """Same weights: the recorded experts equal the learner's own top-k at every token but the
    last (which the engine never ran), and the engine's log-probs are reproduced."""
    model = build_model(load_config(["model.dtype=float64"]))
    traj = _episode(model)
    assert traj.routed_experts.dtype == ROUTE_DTYPE
    assert (traj.routed_experts[-1] == -1).all() and (traj.routed_experts[:-1] >= 0).all()
    mb, fwd = _forward(model, traj, replay=False)
    assert torch.equal(fwd.topk_ids_BTLk[0, :-1], traj.routed_experts[:-1].long())
    lp = logprobs_from_logits(fwd.logits_BTV, mb.input_ids)[0]
    sampled = [i for i, m in enumerate(traj.loss_mask) if m]
    torch.testing.assert_close(lp[sampled], torch.tensor(traj.logprobs, dtype=torch.float64)[sampled], rtol=0, atol=1e-10)


def test_replay_reproduces_perturbed_rollout_routes_and_router_gets_gradient():
    cfg = load_config(["model.dtype=float64"])
    learner = build_model(cfg)
    rollout = copy.deepcopy(learner)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in rollout.named_parameters():
            if "mlp.gate" in name:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.03)
    traj = _episode(rollout)
    recorded = traj.routed_experts[:-1].long()
    _, own = _forward(learner, traj, replay=False)
    assert (own.topk_ids_BTLk[0, :-1].sort(-1).values != recorded.sort(-1).values).any(-1).any(-1).sum() > 0
    mb, fwd = _forward(learner, traj, replay=True, grad=True)
    assert torch.equal(fwd.topk_ids_BTLk[0, :-1], recorded)  # every token, every layer
    logprobs_from_logits(fwd.logits_BTV, mb.input_ids)[0][mb.loss_mask[0] > 0].sum().backward()
    for layer in learner.model.layers:
        assert layer.mlp.gate.weight.grad is not None and layer.mlp.gate.weight.grad.abs().sum() > 0
