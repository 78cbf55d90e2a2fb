"""``LearnerWorker``: one DeepSpeed data-parallel rank (a Ray actor; gloo on CPU, NCCL on GPU).

The driver creates ``learner.num_ranks`` of these (``LearnerGroup``) and hands each its shard of
the step's ``TrainBatch``. The actor only holds its parts, each built once in ``start``, one
concern per module:

    setup.py       process group, model (+ critic, expert shards, reference), AdamW, DeepSpeed
    objective.py   the loss, mismatch correction, behaviour log-probs, advantage estimator
    step.py        TrainStep: micro-batches -> loss -> backward -> one clipped update; log-probs
    push.py        WeightPusher: this rank's part of the weight push
    checkpoint.py  Checkpointer: this rank's part of a checkpoint, written in the background; load
"""

from __future__ import annotations

import os
import socket

import ray

from jointrl.rl.actor_resources import ActorResources, claim
from jointrl.rl.config import Config
from jointrl.rl.learner.batch import TrainBatch
from jointrl.rl.learner.checkpoint import Checkpointer
from jointrl.rl.learner.objective import build_objective
from jointrl.rl.learner.push import WeightPusher
from jointrl.rl.learner.setup import join_process_group, setup_rank
from jointrl.rl.learner.step import TrainStep
from jointrl.rl.weight_sync import WeightBundle


class LearnerWorker:
    def __init__(self, cfg: Config, rank: int, world_size: int, master_addr: str | None = None,
                 master_port: int | None = None) -> None:
        """With ``master_addr`` / ``master_port`` the rank joins the process group now; without, it
        waits for ``start`` (``LearnerGroup``: rank 0's ``rendezvous_address`` first, so the group
        meets on rank 0's node, wherever Ray placed it)."""
        self._resources = claim("learner", rank)  # torch threads = the bundle's CPUs, before any torch work
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        if master_addr is not None:
            self.start(master_addr, master_port)

    def rendezvous_address(self) -> tuple[str, int]:
        """This actor's node IP (as Ray sees it) and a port free on it: where rank 0 hosts the
        process group's store."""
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def start(self, master_addr: str, master_port: int) -> int:
        """Join the learners' process group at rank 0's ``master_addr:master_port``; build the model,
        the optimizer, the DeepSpeed engine and the parts that use them. → this rank."""
        cfg = self.cfg
        join_process_group(self.rank, self.world_size, master_addr, master_port)
        objective = build_objective(cfg)
        self.setup = setup_rank(cfg, self.rank, self.world_size, objective)
        self.engine = self.setup.engine
        self.step = TrainStep(cfg, self.setup, objective, self.world_size)
        self.pusher = WeightPusher(cfg, self.engine.module, self.rank)
        self.checkpointer = Checkpointer(self.engine, self.rank, self.world_size, cfg.learner.ep_size,
                                         self.setup.zero_stage, cfg.learner.checkpoint_keep)
        return self.rank

    def ready(self) -> int:
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    def resources(self) -> ActorResources:
        return self._resources

    def train_step(self, shard: TrainBatch, num_tokens_global: int, num_seqs_global: int | None = None
                   ) -> dict[str, float]:
        """One optimizer update over this rank's shard (``TrainStep.train_step``). → rank-local metrics."""
        return self.step.train_step(shard, num_tokens_global, num_seqs_global)

    def logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        return self.step.logprobs(token_ids)

    def weight_bundle(self, version: int) -> WeightBundle | None:
        return self.pusher.bundle(version)

    # rollout.weight_transport=dist (rl/weight_transport.py): open -> join (with the receivers) -> push
    def open_weight_group(self, num_receivers: int, backend: str, timeout_s: float) -> tuple[str, int]:
        return self.pusher.open(num_receivers, backend, timeout_s)

    def join_weight_group(self) -> None:
        self.pusher.join()

    def push_weights(self, version: int) -> dict[str, float]:
        return self.pusher.push(version)

    def save_checkpoint(self, directory: str, step: int) -> None:
        """Copy this rank's part to host memory and write it in the background (``Checkpointer.save``)."""
        self.checkpointer.save(directory, step)

    def wait_checkpoint(self) -> None:
        """Until the checkpoint being written is committed; raises if it was not (``Checkpointer.wait``)."""
        self.checkpointer.wait()

    def load_checkpoint(self, directory: str) -> int | None:
        """The latest checkpoint in ``directory`` (``Checkpointer.load``); the lr schedule resumes at its step."""
        step = self.checkpointer.load(directory)
        self.step.steps_done = step or 0
        return step
