"""``rl/learner/push.py``: which rank sends what (no critic, experts by their expert-parallel rank)."""

import torch

from jointrl.rl.build import build_model
from jointrl.rl.config import load_config
from jointrl.rl.learner.expert_parallel import expert_row_offsets, shard_experts
from jointrl.rl.learner.push import WeightPusher
from jointrl.rl.learner.value_head import attach_value_head
from jointrl.rl.weight_sync import is_routed_expert


def test_each_rank_sends_its_part_and_never_the_critic():
    cfg = load_config(["learner.num_ranks=4", "learner.ep_size=2", "rollout.quantize_experts=false"])
    sent = {}
    for rank in range(4):
        model = attach_value_head(build_model(cfg))
        shard_experts(model, 1, 0)  # the expert modules an expert-parallel rank holds (whole here: no process group)
        state, kw = WeightPusher(cfg, model, rank).state()
        sent[rank] = set(state)
        assert not kw["is_quantized"]("x", torch.zeros(1)) and kw["row_offsets"] == expert_row_offsets(model)
    experts = set(expert_row_offsets(model))
    assert experts and not any(k.startswith("value_head.") for k in sent[0])
    assert sent[0] > experts and sent[1] == experts and sent[2] == sent[3] == set()


def test_quantize_experts_marks_routed_experts():
    cfg = load_config()
    model = build_model(cfg)
    pusher = WeightPusher(cfg, model, 0)
    assert pusher.is_quantized is is_routed_expert
    assert pusher.bundle(3).version == 3
