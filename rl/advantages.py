"""Advantages: group-relative (GRPO/GSPO), GAE (PPO), and per-domain reward normalisation.

One estimator per run, chosen from ``algo.name`` once (``build_estimator``), in two halves: the
driver's ``select`` (which trajectories train, with what sequence-level advantage) and the
learner's ``token_terms`` (the per-token advantages the loss sees and, for GAE, the critic's
values, given by the learner, and the returns). ``GroupRelative`` does its work in ``select``; ``GAE`` in ``token_terms``,
where the critic's values exist.

Group-relative, under the failure rule of docs/architecture.md.

For a group of samples of one task with rewards r_1..r_G::

    A_i = (r_i - mean(r)) / (std(r) + eps)      (scale_by_std=True; Shao et al. 2024, DeepSeekMath)
    A_i =  r_i - mean(r)                        (scale_by_std=False; Dr. GRPO, Liu et al. 2025)

``std`` is the population standard deviation. ``env_error`` members are excluded (not
scored 0); a group with fewer than 2 remaining members is dropped; a group whose rewards are
all equal carries no signal and is dropped (DAPO's dynamic sampling, Yu et al. 2025); the
driver refills the batch with fresh groups (``rl/train.py``).

GAE (PPO; Schulman et al. 2016) over the T sampled tokens of one trajectory, the reward
arriving at the last one (r_t = 0 before), V_T = 0 after it::

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}          returns R_t = A_t + V_t

Per-domain normalisation (joint batches): a domain's rewards are standardised over that
domain's trajectories in the step, r' = (r - mean_d) / (std_d + eps), so a domain with large
or offset rewards does not dominate; ``env_error`` trajectories are left out of the stats.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from jointrl.rl.config import AlgoConfig, Algorithm
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


def token_gae(reward: float, values_T: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_T, returns_T) for one trajectory's T sampled tokens (module docstring)."""
    if not (0 <= gamma <= 1 and 0 <= lam <= 1):
        raise ValueError(f"GAE needs gamma and lam in [0, 1], got gamma={gamma}, lam={lam}")
    T = values_T.shape[0]
    adv_T = torch.zeros_like(values_T)
    next_value, next_adv = 0.0, 0.0
    for t in range(T - 1, -1, -1):
        r = reward if t == T - 1 else 0.0
        delta = r + gamma * next_value - values_T[t]
        next_adv = delta + gamma * lam * next_adv
        adv_T[t] = next_adv
        next_value = values_T[t]
    return adv_T, adv_T + values_T


def normalize_rewards_by_domain(trajs: list[Trajectory], eps: float = 1e-6) -> list[Trajectory]:
    """Copies of ``trajs`` with each domain's rewards standardised (module docstring); the raw
    reward is kept in ``reward_info["raw_reward"]``. A domain with one trajectory gets 0."""
    by_domain: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        if t.finish_reason != FinishReason.ENV_ERROR:
            by_domain[t.domain].append(t.reward)
    stats = {}
    for d, r in by_domain.items():
        mean = sum(r) / len(r)
        stats[d] = (mean, (sum((x - mean) ** 2 for x in r) / len(r)) ** 0.5)
    out = []
    for t in trajs:
        if t.finish_reason == FinishReason.ENV_ERROR:
            out.append(t)
            continue
        mean, std = stats[t.domain]
        out.append(dataclasses.replace(t, reward=(t.reward - mean) / (std + eps),
                                       reward_info={**t.reward_info, "raw_reward": t.reward}))
    return out


class TokenBatch(Protocol):
    """What ``token_terms`` reads of a learner micro-batch (``rl/learner/batch.MicroBatch``)."""

    adv: Tensor  # [B, T] each sequence's advantage on its tokens
    seg: Tensor  # [B, T] sequence index per token, -1 on padding
    loss_mask: Tensor  # [B, T]
    rewards: Tensor | None  # [num_seqs]
    num_seqs: int


@dataclass(frozen=True, slots=True)
class TokenTerms:
    """Per-token inputs of the loss from the estimator, all ``[B, T]``; values/returns only with a critic."""

    adv_BT: Tensor
    values_BT: Tensor | None = None
    old_values_BT: Tensor | None = None
    returns_BT: Tensor | None = None


@dataclass(frozen=True, slots=True)
class GroupRelative:
    """GRPO / GSPO: ``grpo_advantages`` over the step's groups in the driver; the learner uses
    each sequence's advantage on its tokens as is. Dropped groups are refilled."""

    scale_by_std: bool = True
    by_domain: bool = False  # standardise rewards per domain first
    needs_critic = False
    refills = True

    def select(self, trajs: list[Trajectory]) -> AdvantageResult:
        return grpo_advantages(normalize_rewards_by_domain(trajs) if self.by_domain else trajs, self.scale_by_std)

    def token_terms(self, mb: TokenBatch, values_BT: Tensor | None) -> TokenTerms:
        return TokenTerms(mb.adv)


@dataclass(frozen=True, slots=True)
class GAE:
    """PPO: every scored trajectory trains (no groups to drop or refill); in the learner, the critic's
    values of the tokens (``rl/learner/value_head.values``) and GAE over each sequence's loss tokens."""

    gamma: float = 1.0
    lam: float = 0.95
    by_domain: bool = False
    needs_critic = True
    refills = False

    def select(self, trajs: list[Trajectory]) -> AdvantageResult:
        scored = normalize_rewards_by_domain(trajs) if self.by_domain else trajs
        kept = [t for t in scored if t.finish_reason != FinishReason.ENV_ERROR]
        return AdvantageResult(kept, [0.0] * len(kept), {"env_error": len(scored) - len(kept), "trajectories_kept": len(kept)})

    def token_terms(self, mb: TokenBatch, values_BT: Tensor | None) -> TokenTerms:
        """``values_BT``: the critic's, with gradient (the value loss trains it; GAE reads them detached)."""
        if mb.rewards is None:
            raise ValueError("algo.name=ppo needs TrainBatch.rewards")
        assert values_BT is not None, "GAE needs the critic's values (RankSetup attaches a value head)"
        v_BT, old_BT = values_BT, values_BT.detach()
        adv_BT, ret_BT = torch.zeros_like(old_BT), torch.zeros_like(old_BT)
        for i in range(mb.num_seqs):
            sel = (mb.seg == i) & (mb.loss_mask > 0)
            if sel.any():
                adv_BT[sel], ret_BT[sel] = token_gae(mb.rewards[i], old_BT[sel], self.gamma, self.lam)
        return TokenTerms(adv_BT, v_BT, old_BT, ret_BT)


def build_estimator(algo: AlgoConfig) -> GroupRelative | GAE:
    """``algo.name`` -> its estimator (PPO: GAE; every other algorithm: group-relative)."""
    if algo.name is Algorithm.ppo:
        return GAE(algo.gamma, algo.lam, algo.normalize_rewards_by_domain)
    return GroupRelative(algo.scale_adv_by_std, algo.normalize_rewards_by_domain)
