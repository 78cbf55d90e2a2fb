"""Where the actors run: Ray placement groups sized by ``conf/cluster/`` (``local``, ``single_node``, ``slurm``).

One placement group holds a bundle per learner rank, another a bundle per rollout worker
(``cluster.learner_bundle`` / ``cluster.rollout_bundle``, e.g. ``{CPU: 4, GPU: 1}``), each
placed with ``cluster.placement_strategy`` (``PACK`` keeps a group on as few nodes as
possible: the learner ranks' collectives stay on one node's links when they fit). A bundle's
``GPU: auto`` means one GPU when the Ray cluster has any, none otherwise (so one config serves
a GPU cluster and the CPU shim test). Env workers hold no bundle: they are spread over the
nodes (``SPREAD``) beside the sandboxes they start. Actors get exactly their bundle's
resources, so Ray refuses to start a run the cluster cannot hold instead of oversubscribing.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jointrl.rl.config import Config


def resolve_bundle(bundle: dict, cluster_gpus: float) -> dict[str, float]:
    """``GPU: auto`` -> 1 if the cluster has GPUs else 0; zero entries dropped."""
    out = {}
    for k, v in bundle.items():
        if v == "auto":
            v = 1 if cluster_gpus > 0 else 0
        if float(v) > 0:
            out[k] = float(v)
    return out


class Placement:
    """The run's placement groups; ``learner(i)`` / ``rollout(i)`` / ``env_worker()`` are the
    ``.options(...)`` of each actor."""

    def __init__(self, cfg: Config, timeout_s: float = 300.0) -> None:
        cc = cfg.cluster
        gpus = ray.cluster_resources().get("GPU", 0.0)
        self.learner_bundle = resolve_bundle(cc.learner_bundle, gpus)
        self.rollout_bundle = resolve_bundle(cc.rollout_bundle, gpus)
        self.groups = {
            "learner": placement_group([self.learner_bundle] * cfg.learner.num_ranks, strategy=cc.placement_strategy,
                                       name=f"{cfg.run_name}-learner"),
            "rollout": placement_group([self.rollout_bundle] * cfg.rollout.num_workers, strategy=cc.placement_strategy,
                                       name=f"{cfg.run_name}-rollout"),
        }
        for name, pg in self.groups.items():
            if not pg.wait(timeout_s):
                bundle = self.learner_bundle if name == "learner" else self.rollout_bundle
                raise RuntimeError(f"the Ray cluster cannot hold the {name} placement group ({len(pg.bundle_specs)} x "
                                   f"{bundle}, {cc.placement_strategy}); resources: {ray.cluster_resources()} "
                                   "(cluster.learner_bundle / cluster.rollout_bundle)")

    def _options(self, group: str, bundle: dict[str, float], index: int) -> dict:
        return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0),
                "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.groups[group], placement_group_bundle_index=index)}

    def learner(self, rank: int) -> dict:
        return self._options("learner", self.learner_bundle, rank)

    def rollout(self, index: int) -> dict:
        return self._options("rollout", self.rollout_bundle, index)

    @staticmethod
    def env_worker() -> dict:
        return {"num_cpus": 0, "scheduling_strategy": "SPREAD"}

    def remove(self) -> None:
        for pg in self.groups.values():
            remove_placement_group(pg)
