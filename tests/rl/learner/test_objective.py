"""``rl/learner/objective.py``: every algorithm and option resolves, once, to the objects a step calls."""

import pytest
import torch

from jointrl.rl.advantages import GAE, GroupRelative
from jointrl.rl.config import load_config
from jointrl.rl.learner.objective import build_objective
from jointrl.rl.losses import Aggregation, GRPOLoss, GSPOLoss, KLEstimator, MismatchMode, PPOLoss, SFTLoss


@pytest.mark.parametrize("name,loss,estimator", [("grpo", GRPOLoss, GroupRelative), ("gspo", GSPOLoss, GroupRelative),
                                                 ("ppo", PPOLoss, GAE), ("sft", SFTLoss, GroupRelative)])
def test_each_algorithm_builds_its_loss_and_estimator(name, loss, estimator):
    obj = build_objective(load_config([f"algo.name={name}", "algo.aggregation=seq_sum", "algo.kl_coef=0.1",
                                       "algo.kl_estimator=k1"]))
    assert type(obj.loss) is loss and type(obj.estimator) is estimator
    assert obj.estimator.needs_critic == (name == "ppo") and obj.estimator.refills == (name != "ppo")
    assert obj.loss.regularizers.kl_estimator is KLEstimator.k1 and obj.loss.regularizers.kl_coef == 0.1
    if name != "gspo":  # GSPO is per sequence whatever the aggregation
        assert obj.loss.aggregation is Aggregation.seq_sum
    assert obj.per_sequence


def test_behaviour_and_mismatch_choices():
    learner_BT, rollout_BT = torch.zeros(1, 3), torch.ones(1, 3)
    plain = build_objective(load_config())
    assert plain.behaviour(learner_BT, rollout_BT) is rollout_BT
    assert plain.correction.mode is MismatchMode.none and not plain.reweights
    tis = build_objective(load_config(["algo.behaviour_logprobs=learner", "algo.mismatch=tis"]))
    assert tis.behaviour(learner_BT, rollout_BT) is learner_BT
    assert tis.correction.mode is MismatchMode.tis and tis.reweights
