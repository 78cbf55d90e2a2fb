"""``LearnerGroup``: the driver's handle on all learner ranks (one Ray actor each)."""

from __future__ import annotations

import socket

import ray

from jointrl.rl.config import Config
from jointrl.rl.learner.batch import TrainBatch
from jointrl.rl.learner.step import merge_metrics
from jointrl.rl.learner.worker import LearnerWorker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LearnerGroup:
    def __init__(self, cfg: Config, options: list[dict] | None = None) -> None:
        """``options``: per rank, the actor's ``.options`` (its placement bundle, ``rl/placement.py``)."""
        n = cfg.learner.num_ranks
        self.ep_size = cfg.learner.ep_size
        options = options or [{"num_cpus": 0}] * n
        actor = ray.remote(LearnerWorker)
        self.workers = [actor.options(**options[rank]).remote(cfg, rank, n) for rank in range(n)]
        # the process group meets on rank 0's node (its Ray node IP): ranks may sit on other nodes
        self.master_addr, self.master_port = ray.get(self.workers[0].rendezvous_address.remote())
        ray.get([w.start.remote(self.master_addr, self.master_port) for w in self.workers])

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        n = len(self.workers)
        if len(batch) < n:
            raise ValueError(f"a step needs at least one sequence per learner rank ({n}), got {len(batch)}")
        results = ray.get([w.train_step.remote(batch.shard(r, n), batch.num_loss_tokens, batch.num_loss_seqs)
                           for r, w in enumerate(self.workers)])
        merged = merge_metrics(results)
        merged["loss"] = sum(r["loss"] for r in results)  # each rank reports its share of the global loss
        merged["aux_loss"] = sum(r["aux_loss"] for r in results) / n
        for k, v in results[0].items():  # reduced over all ranks already, or rank 0's view
            if k.startswith(("experts/", "router/")) or k in ("grad_norm", "time_s"):
                merged[k] = v
        return merged

    def logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Log-probs under the current weights (with expert parallelism every rank takes part)."""
        workers = self.workers if self.ep_size > 1 else self.workers[:1]
        return ray.get([w.logprobs.remote(token_ids) for w in workers])[0]

    @property
    def senders(self) -> list:
        """The ranks that send a weight push (rl/weight_transport.py): 0..ep_size-1 (rank 0 the shared
        weights and its experts, the others their experts; replicas beyond ep_size send nothing)."""
        return self.workers[: self.ep_size]

    def save_checkpoint(self, directory: str, step: int, wait: bool = False) -> None:
        """Every rank's part of ``directory/step_N``: returns once each is in host memory (the disk
        write goes on in the background), or with ``wait`` once the checkpoint is committed."""
        ray.get([w.save_checkpoint.remote(directory, step) for w in self.workers])
        if wait:
            self.wait_checkpoint()

    def wait_checkpoint(self) -> None:
        """Until the checkpoint being written is committed (``latest`` names it); raises if it was not."""
        ray.get([w.wait_checkpoint.remote() for w in self.workers])

    def load_checkpoint(self, directory: str) -> int | None:
        steps = ray.get([w.load_checkpoint.remote(directory) for w in self.workers])
        assert len(set(steps)) == 1, f"learner ranks resumed at different steps: {steps}"
        return steps[0]

    def shutdown(self) -> None:
        """Stop the ranks, once the checkpoint being written (if any) is committed (or failed: raised
        after the ranks are stopped)."""
        try:
            self.wait_checkpoint()
        finally:
            for w in self.workers:
                ray.kill(w)
