"""``LearnerGroup``: the driver's handle on all learner ranks (one Ray actor each)."""

from __future__ import annotations

import socket

import ray

from jointrl.rl.config import Config
from jointrl.rl.learner.batch import TrainBatch
from jointrl.rl.learner.worker import LearnerWorker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LearnerGroup:
    def __init__(self, cfg: Config) -> None:
        n = cfg.learner.num_ranks
        port = _free_port()
        actor = ray.remote(num_cpus=0)(LearnerWorker)
        self.workers = [actor.remote(cfg, rank, n, "127.0.0.1", port) for rank in range(n)]
        ray.get([w.ready.remote() for w in self.workers])

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        n = len(self.workers)
        if len(batch) < n:
            raise ValueError(f"a step needs at least one sequence per learner rank ({n}), got {len(batch)}")
        total = batch.num_loss_tokens
        results = ray.get([w.train_step.remote(batch.shard(r, n), total) for r, w in enumerate(self.workers)])
        merged = {k: sum(r[k] for r in results) for k in ("loss", "tokens")}
        for k in ("clip_frac", "approx_kl"):
            merged[k] = sum(r[k] * r["tokens"] for r in results) / max(merged["tokens"], 1)
        merged["grad_norm"] = results[0]["grad_norm"]
        merged["aux_loss"] = sum(r["aux_loss"] for r in results) / n
        return merged

    def logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        return ray.get(self.workers[0].logprobs.remote(token_ids))

    def weight_bundle(self, version: int):
        return self.workers[0].weight_bundle.remote(version)  # an ObjectRef: it goes to the rollout workers as is

    def save_checkpoint(self, directory: str, step: int) -> None:
        ray.get([w.save_checkpoint.remote(directory, step) for w in self.workers])

    def load_checkpoint(self, directory: str) -> int | None:
        steps = ray.get([w.load_checkpoint.remote(directory) for w in self.workers])
        assert len(set(steps)) == 1, f"learner ranks resumed at different steps: {steps}"
        return steps[0]

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
