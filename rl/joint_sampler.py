"""The joint sampler: which tasks (domain, tier) make up each step's batch.

Domains are drawn by their configured weights, tasks uniformly within a domain, and a
domain's tier mix (when configured) overrides the task's own tier. Draws depend only on
``(seed, step)``, so a resumed run samples the same batches it would have sampled.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

from jointrl.envs.base import Task
from jointrl.envs.registry import dataset_source, load_tasks
from jointrl.envs.splits import family_of
from jointrl.rl.config import DomainConfig


class JointSampler:
    def __init__(self, tasks: dict[str, list[Task]], domains: dict[str, DomainConfig], seed: int) -> None:
        for name in domains:
            if not tasks.get(name):
                raise ValueError(f"domain {name!r} has no tasks to sample from")
        self.tasks, self.domains, self.seed = tasks, domains, seed
        total = sum(d.weight for d in domains.values())
        self.target_mix = {name: d.weight / total for name, d in domains.items()}

    def sample(self, step: int, n: int, attempt: int = 0) -> list[tuple[Task, str]]:
        """``n`` (task, group_id) pairs for ``step``; group ids are unique within the run.
        ``attempt > 0``: a refill round of the same step (fresh draws, distinct group ids)."""
        rng = random.Random(f"{self.seed}:{step}" if attempt == 0 else f"{self.seed}:{step}:refill{attempt}")
        names = list(self.domains)
        out = []
        for i, domain in enumerate(rng.choices(names, weights=[self.domains[d].weight for d in names], k=n)):
            task = rng.choice(self.tasks[domain])
            tiers = self.domains[domain].tiers
            if tiers:
                task = dataclasses.replace(task, tier=rng.choices(list(tiers), weights=list(tiers.values()))[0])
            if self.domains[domain].reward:
                task = dataclasses.replace(task, reward=dict(self.domains[domain].reward))
            out.append((task, f"s{step}-g{i}-{task.id}" if attempt == 0 else f"s{step}-r{attempt}-g{i}-{task.id}"))
        return out

    @classmethod
    def from_config(cls, domains: dict[str, DomainConfig], seed: int, backend: str = "bwrap") -> JointSampler:
        """Over each domain's configured tasks (``task_dir``) of its configured ``split`` that run on
        ``backend`` (``envs.sandbox.backend``), less its ``heldout_families``."""
        tasks = {d: [t for t in load_tasks(d, dc.task_dir, dc.split, backend, dataset_source(dc), dc.heldout_families)
                     if family_of(t) not in dc.heldout_families]  # never a held-out family, whatever the split
                 for d, dc in domains.items()}
        return cls(tasks, domains, seed)

    @staticmethod
    def realized_mix(batch: list[tuple[Task, str]]) -> dict[str, float]:
        counts = Counter(task.domain for task, _ in batch)
        return {d: c / len(batch) for d, c in counts.items()}
