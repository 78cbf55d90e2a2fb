"""A training step's metrics, assembled from what the step produced (the driver only passes it on).

Keys: ``reward/mean``, tool-call rates, per-domain reward / success / turns / tool errors /
response tokens / env errors, ``finish/<reason>``, ``thinking_tokens/<tier>``, the realized and
target domain mix, ``advantages/*`` and ``learner/*`` (the estimator's and the learner's own),
``time/<stage>_s``, ``perf/*`` throughput, ``weight_sync/*``, the router's ``rollout/*`` counts,
and ``staleness/*``. Means are over the step's trajectories that did not end in ``env_error``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from jointrl.rewards.base import succeeded
from jointrl.rl.advantages import AdvantageResult
from jointrl.rl.types import FinishReason, Task, Trajectory


def staleness(t: Trajectory, policy_version: int) -> int:
    """Versions between the policy being trained and the oldest weights that sampled ``t``."""
    versions = [v for v, m in zip(t.policy_version, t.loss_mask) if m]
    return policy_version - min(versions) if versions else 0


@dataclass
class StepRecord:
    """What one step produced, as the driver hands it over."""

    step: int
    groups: list[tuple[Task, str]]  # every group sampled, refills included
    trajs: list[Trajectory]  # every trajectory gathered (stale ones already dropped)
    adv: AdvantageResult
    stale: int  # trajectories dropped as too stale
    times: dict[str, float]  # stage -> wall seconds (rollout, learner, push)
    learner: dict[str, float] = field(default_factory=dict)  # empty when the step did not train
    push: dict[str, float] = field(default_factory=dict)  # the weight push's phases, seconds
    push_retries: int = 0
    routing: dict = field(default_factory=dict)  # RolloutRouter.stats()


def _episode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    ok = [t for t in trajs if t.finish_reason != FinishReason.ENV_ERROR]
    calls = sum(t.num_tool_calls for t in ok)
    m: dict[str, float] = {
        "reward/mean": sum(t.reward for t in ok) / max(len(ok), 1),
        "tool_error_rate": sum(t.num_tool_errors for t in ok) / max(calls, 1),
        "tool_calls_per_episode": calls / max(len(ok), 1),
        "env_error": len(trajs) - len(ok),
        "response_tokens_per_episode": sum(t.num_sampled for t in ok) / max(len(ok), 1),
        "time/reward_s": sum(t.reward_time_s for t in ok),  # summed over concurrent episodes
    }
    by_domain: dict[str, list[Trajectory]] = defaultdict(list)
    for t in ok:
        by_domain[t.domain].append(t)
    for d, ts in by_domain.items():
        n, calls_d = len(ts), sum(t.num_tool_calls for t in ts)
        m[f"{d}/reward"] = sum(t.reward for t in ts) / n
        m[f"{d}/success"] = sum(succeeded(t.reward_info) for t in ts) / n
        m[f"{d}/turns"] = sum(t.num_turns for t in ts) / n
        m[f"{d}/tool_error_rate"] = sum(t.num_tool_errors for t in ts) / max(calls_d, 1)
        m[f"{d}/response_tokens"] = sum(t.num_sampled for t in ts) / n
    for d in {t.domain for t in trajs}:
        m[f"{d}/env_error"] = sum(t.domain == d and t.finish_reason == FinishReason.ENV_ERROR for t in trajs)
    for reason in FinishReason:
        m[f"finish/{reason}"] = sum(t.finish_reason == reason for t in trajs)
    for tier in sorted({t.tier for t in ok}):
        ts = [t for t in ok if t.tier == tier]
        m[f"thinking_tokens/{tier}"] = sum(t.think_tokens for t in ts) / len(ts)  # as the turns counted them
    return m


def step_metrics(rec: StepRecord, realized_mix: dict[str, float], target_mix: dict[str, float]
                 ) -> tuple[dict[str, float], dict[str, list[float]]]:
    """-> (scalars, histograms) of one step (module docstring)."""
    ok_sampled = sum(t.num_sampled for t in rec.trajs if t.finish_reason != FinishReason.ENV_ERROR)
    m = _episode_metrics(rec.trajs)
    m["perf/rollout_tokens_per_s"] = ok_sampled / max(rec.times["rollout"], 1e-9)
    m.update({f"time/{k}_s": v for k, v in rec.times.items()})
    m.update({f"advantages/{k}": float(v) for k, v in rec.adv.stats.items()})
    m.update({f"learner/{k}": float(v) for k, v in rec.learner.items()})
    m.update({f"mix/{d}": share for d, share in realized_mix.items()})  # realized, beside the configured target
    m.update({f"mix_target/{d}": share for d, share in target_mix.items()})
    m.update({f"weight_sync/{k}_s": v for k, v in rec.push.items()})
    m["weight_sync/retries"] = float(rec.push_retries)
    if rec.learner:
        m["perf/learner_tokens_per_s"] = sum(len(t.token_ids) for t in rec.adv.kept) / max(rec.times["learner"], 1e-9)
    m.update({f"rollout/{k}": float(rec.routing[k]) for k in ("rerouted", "worker_deaths")})
    m["rollout/dead_workers"] = float(len(rec.routing["dead"]))
    stale = [staleness(t, rec.step - 1) for t in rec.trajs if t.finish_reason != FinishReason.ENV_ERROR]
    m.update({"staleness/mean": sum(stale) / max(len(stale), 1), "staleness/max": float(max(stale, default=0)),
              "staleness/dropped": float(rec.stale)})
    return m, {"staleness/histogram": stale}
