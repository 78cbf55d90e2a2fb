"""``rl/metrics.py``: a step's metrics from what the step produced, counted by hand."""

import pytest

from jointrl.rl.advantages import AdvantageResult
from jointrl.rl.metrics import StepRecord, staleness, step_metrics
from jointrl.rl.types import FinishReason, Trajectory


def traj(domain, reward, tokens, mask, versions, finish=FinishReason.STOP, tier="low", calls=0, errors=0):
    return Trajectory(tokens, mask, [0.0] * len(tokens), versions, domain, "t", "g", tier=tier, finish_reason=finish,
                      reward=reward, num_tool_calls=calls, num_tool_errors=errors, num_turns=1)


def test_staleness_is_the_oldest_sampled_version():
    t = traj("a", 0, [1, 2, 3, 4], [0, 1, 1, 1], [-1, 3, 2, 4])
    assert staleness(t, 5) == 3 and staleness(traj("a", 0, [1], [0], [-1]), 5) == 0


def test_step_metrics_by_hand():
    a = traj("a", 1.0, [1, 2, 3], [0, 1, 1], [-1, 1, 1], calls=2, errors=1)
    b = traj("b", 0.0, [1, 2], [0, 1], [-1, 0], tier="high")
    a.think_tokens = 2  # as generate_turn counted them: the ids carry no <think>, so a rescan would say 0
    dead = traj("b", 0.0, [], [], [], finish=FinishReason.ENV_ERROR)
    rec = StepRecord(2, [], [a, b, dead], AdvantageResult([a, b], [0.5, -0.5], {"groups": 1}), stale=3,
                     times={"rollout": 2.0, "learner": 1.0, "push": 0.5}, learner={"loss": 0.25},
                     push={"total": 0.5}, push_retries=1, routing={"rerouted": 4, "worker_deaths": 0, "dead": [1]})
    m, hist = step_metrics(rec, {"a": 0.5, "b": 0.5}, {"a": 0.25, "b": 0.75})
    assert m["reward/mean"] == 0.5 and m["env_error"] == 1 and m["b/env_error"] == 1
    assert m["tool_error_rate"] == 0.5 and m["tool_calls_per_episode"] == 1.0
    assert m["perf/rollout_tokens_per_s"] == pytest.approx(3 / 2.0) and m["perf/learner_tokens_per_s"] == 5 / 1.0
    assert m["learner/loss"] == 0.25 and m["advantages/groups"] == 1 and m["weight_sync/total_s"] == 0.5
    assert m["weight_sync/retries"] == 1 and m["rollout/rerouted"] == 4 and m["rollout/dead_workers"] == 1
    assert m["mix/a"] == 0.5 and m["mix_target/b"] == 0.75 and m["finish/env_error"] == 1
    assert hist["staleness/histogram"] == [0, 1] and m["staleness/max"] == 1 and m["staleness/dropped"] == 3
    assert m["thinking_tokens/low"] == 2 and m["thinking_tokens/high"] == 0
    assert set(m) >= {"a/reward", "a/success", "b/turns", "time/push_s"}
