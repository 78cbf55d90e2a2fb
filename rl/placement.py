"""Where the actors run: Ray placement groups sized by ``conf/cluster/`` (``local``, ``single_node``, ``slurm``).

One placement group holds a bundle per learner rank, another a bundle per rollout worker
(``cluster.learner_bundle`` / ``cluster.rollout_bundle``, e.g. ``{CPU: 4, GPU: 1}``), each
placed with ``cluster.placement_strategy`` (``PACK`` keeps a group on as few nodes as
possible: the learner ranks' collectives stay on one node's links when they fit). Colocated
(``cluster.colocate``): one group only, bundle i holding learner rank i and rollout worker i,
which split its GPUs in half (both see the same ``CUDA_VISIBLE_DEVICES``; each keeps its own
CPUs); separate (the default): the two groups above, no GPU shared. A bundle's
``GPU: auto`` means one GPU when the Ray cluster has any, none otherwise (so one config serves
a GPU cluster and the CPU shim test). Env workers never hold a GPU: each reserves
``cluster.env_worker_cpus`` CPUs; where the Ray cluster has CPU-only nodes beside GPU nodes
they go to the CPU-only ones (round-robin, by node affinity), otherwise they are spread over the
nodes (``SPREAD``) beside the sandboxes they start. Actors get exactly their bundle's
resources, so Ray refuses to start a run the cluster cannot hold instead of oversubscribing;
each actor sets its torch threads from the CPUs it holds (``rl/actor_resources.py``).
"""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from jointrl.rl.config import Config, RolloutBackend


def resolve_bundle(bundle: dict, cluster_gpus: float, auto_gpus: int = 1) -> dict[str, float]:
    """``GPU: auto`` -> ``auto_gpus`` if the cluster has GPUs else 0; zero entries dropped."""
    out = {}
    for k, v in bundle.items():
        if v == "auto":
            v = auto_gpus if cluster_gpus > 0 else 0
        if float(v) > 0:
            out[k] = float(v)
    return out


def rollout_gpus(cfg: Config) -> int:
    """GPUs one rollout worker needs: its vLLM instance's ``tensor_parallel_size`` x
    ``data_parallel_size`` (expert parallelism spans those same GPUs); one for the own engine."""
    v = cfg.rollout.vllm
    return v.tensor_parallel_size * v.data_parallel_size if cfg.rollout.backend is RolloutBackend.vllm else 1


def cpu_only_nodes() -> list[str]:
    """Ids of the alive Ray nodes without GPUs, when some other alive node has GPUs; else []."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    cpu_only = [n["NodeID"] for n in alive if n["Resources"].get("GPU", 0) == 0]
    return cpu_only if len(cpu_only) < len(alive) else []


def _share_gpu(learner: dict[str, float], rollout: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """Colocated: the learner rank and the rollout worker each take half of the larger GPU count
    (the two processes see the same GPUs); CPUs and other resources stay each one's own."""
    gpus = max(learner.get("GPU", 0.0), rollout.get("GPU", 0.0))
    share = {"GPU": gpus / 2} if gpus else {}
    strip = lambda b: {k: v for k, v in b.items() if k != "GPU"}  # noqa: E731
    return {**strip(learner), **share}, {**strip(rollout), **share}


class Placement:
    """The run's placement groups; ``learner(i)`` / ``rollout(i)`` / ``env_worker(i)`` are the
    ``.options(...)`` of each actor."""

    def __init__(self, cfg: Config, timeout_s: float = 300.0, learner_only: bool = False) -> None:
        """``learner_only`` (SFT: no rollouts): only the learner group, each rank its whole
        ``cluster.learner_bundle`` (no GPU shared with a rollout worker, nothing reserved for one)."""
        cc = cfg.cluster
        gpus = ray.cluster_resources().get("GPU", 0.0)
        self.env_cpus, self.env_nodes = cc.env_worker_cpus, cpu_only_nodes()
        self.learner_bundle = resolve_bundle(cc.learner_bundle, gpus)
        self.rollout_bundle = resolve_bundle(cc.rollout_bundle, gpus, rollout_gpus(cfg))
        if 0 < self.rollout_bundle.get("GPU", 0) < rollout_gpus(cfg):
            raise ValueError(f"cluster.rollout_bundle has GPU: {self.rollout_bundle['GPU']:g}, but one vLLM instance spans "
                             f"rollout.vllm.tensor_parallel_size x data_parallel_size = {rollout_gpus(cfg)} GPUs "
                             "(GPU: auto sizes it)")
        self.colocate = cc.colocate and not learner_only
        if learner_only:
            specs = {"learner": [self.learner_bundle] * cfg.learner.num_ranks}
        elif self.colocate:
            if cfg.rollout.num_workers > cfg.learner.num_ranks:
                raise ValueError(f"cluster.colocate=true puts rollout worker i beside learner rank i: rollout.num_workers "
                                 f"({cfg.rollout.num_workers}) must be <= learner.num_ranks ({cfg.learner.num_ranks})")
            self.learner_bundle, self.rollout_bundle = _share_gpu(self.learner_bundle, self.rollout_bundle)
            merged = {k: self.learner_bundle.get(k, 0) + self.rollout_bundle.get(k, 0)
                      for k in {*self.learner_bundle, *self.rollout_bundle}}
            specs = {"learner": [merged] * cfg.learner.num_ranks}
        else:
            specs = {"learner": [self.learner_bundle] * cfg.learner.num_ranks,
                     "rollout": [self.rollout_bundle] * cfg.rollout.num_workers}
        self.groups = {name: placement_group(b, strategy=cc.placement_strategy, name=f"{cfg.run_name}-{name}")
                       for name, b in specs.items()}
        for name, pg in self.groups.items():
            if not pg.wait(timeout_s):
                raise RuntimeError(f"the Ray cluster cannot hold the {name} placement group ({len(pg.bundle_specs)} x "
                                   f"{specs[name][0]}, {cc.placement_strategy}); resources: {ray.cluster_resources()} "
                                   "(cluster.learner_bundle / cluster.rollout_bundle)")

    def _options(self, group: str, bundle: dict[str, float], index: int) -> dict:
        return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0),
                "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.groups[group], placement_group_bundle_index=index)}

    def learner(self, rank: int) -> dict:
        return self._options("learner", self.learner_bundle, rank)

    def rollout(self, index: int) -> dict:
        """Rollout worker ``index``: its own bundle, or colocated, a share of learner rank ``index``'s."""
        return self._options("learner" if self.colocate else "rollout", self.rollout_bundle, index)

    def env_worker(self, index: int) -> dict:
        """Env worker ``index``: ``cluster.env_worker_cpus`` CPUs, no GPU, on a CPU-only node
        (round-robin) where the cluster has them, else spread."""
        if not self.env_nodes:
            return self.spread(self.env_cpus)
        node = self.env_nodes[index % len(self.env_nodes)]
        return {"num_cpus": self.env_cpus, "num_gpus": 0,
                "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

    @staticmethod
    def spread(cpus: float) -> dict:
        return {"num_cpus": cpus, "num_gpus": 0, "scheduling_strategy": "SPREAD"}

    def remove(self) -> None:
        for pg in self.groups.values():
            remove_placement_group(pg)
