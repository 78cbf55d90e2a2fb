"""Group-relative advantages (GRPO) under the failure rule of docs/architecture.md.

For a group of samples of one task with rewards r_1..r_G::

    A_i = (r_i - mean(r)) / (std(r) + eps)      (scale_by_std=True; Shao et al. 2024, DeepSeekMath)
    A_i =  r_i - mean(r)                        (scale_by_std=False; Dr. GRPO, Liu et al. 2025)

``std`` is the population standard deviation. ``env_error`` members are excluded (not
scored 0); a group with fewer than 2 remaining members is dropped; a group whose rewards are
all equal carries no signal and is dropped (DAPO's dynamic sampling, Yu et al. 2025).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from jointrl.rl.types import FinishReason, Trajectory


@dataclass(slots=True)
class AdvantageResult:
    kept: list[Trajectory]  # trajectories that train, in input order
    advantages: list[float]  # one per kept trajectory
    stats: dict[str, float] = field(default_factory=dict)


def grpo_advantages(trajs: list[Trajectory], scale_by_std: bool = True, eps: float = 1e-6) -> AdvantageResult:
    groups: dict[str, list[int]] = defaultdict(list)
    n_env_error = 0
    for i, t in enumerate(trajs):
        if t.finish_reason == FinishReason.ENV_ERROR:
            n_env_error += 1
        else:
            groups[t.group_id].append(i)
    adv: dict[int, float] = {}
    dropped_small = dropped_flat = 0
    for members in groups.values():
        if len(members) < 2:
            dropped_small += 1
            continue
        r = [trajs[i].reward for i in members]
        mean = sum(r) / len(r)
        std = (sum((x - mean) ** 2 for x in r) / len(r)) ** 0.5
        if std == 0.0:
            dropped_flat += 1
            continue
        for i, x in zip(members, r):
            adv[i] = (x - mean) / (std + eps) if scale_by_std else x - mean
    kept = sorted(adv)
    return AdvantageResult(
        kept=[trajs[i] for i in kept],
        advantages=[adv[i] for i in kept],
        stats={"env_error": n_env_error, "groups": len(groups), "groups_dropped_small": dropped_small,
               "groups_dropped_zero_variance": dropped_flat, "trajectories_kept": len(kept)},
    )
