"""A learner rank's checkpoints in the one format (``rl/checkpoint_format.py``), written in the
background.

``save`` copies this rank's part to host memory (``portable_checkpoint.host_part``) and returns;
a thread writes it to disk while training goes on. The ranks then agree, over a gloo group of
their own (the training collectives stay on the main thread's group), that every part is on disk,
and rank 0 commits the checkpoint (``topology.json``, ``latest``, pruning to ``keep``). A rank
whose write fails makes the whole checkpoint uncommitted; ``wait`` (called by the next ``save``,
by ``load`` and by the driver before it exits) raises that failure. One checkpoint is written at a
time: ``save`` waits for the previous one first.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from jointrl.rl.checkpoint_format import LATEST, commit, resolve, write_part
from jointrl.rl.learner.expert_parallel import expert_row_offsets
from jointrl.rl.learner.portable_checkpoint import host_part, load_into_rank

COMMIT_TIMEOUT = timedelta(hours=2)  # the slowest rank's write of its part, as the others wait for it


class Checkpointer:
    """Saves and loads one rank's part (every rank of the group calls together)."""

    def __init__(self, engine, rank: int, world_size: int, ep_size: int, zero_stage: int, keep: int) -> None:
        self.engine, self.rank, self.world_size, self.ep_size, self.zero_stage = engine, rank, world_size, ep_size, zero_stage
        self.keep = keep
        # collective on every rank at construction (like every group); used by the writer thread only
        self.group = dist.new_group(backend="gloo", timeout=COMMIT_TIMEOUT) if world_size > 1 else None
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, directory: str, step: int) -> None:
        """Copy this rank's part of ``directory/step_N`` to host memory and start writing it; returns
        before the write is on disk (``wait``)."""
        self.wait()
        part = host_part(self.engine.module, self.engine.optimizer, rank=self.rank, step=step,
                         row_offsets=expert_row_offsets(self.engine.module), zero_stage=self.zero_stage)
        topo = {"num_ranks": self.world_size, "ep_size": self.ep_size, "zero_stage": self.zero_stage, "step": step}
        self._writer = threading.Thread(target=self._write, args=(part, directory, step, topo),
                                        name=f"checkpoint-step-{step}")
        self._writer.start()

    def wait(self) -> None:
        """Block until the checkpoint being written is committed (or not: then raise why)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"learner rank {self.rank}: a checkpoint was not written (latest stays at the "
                               f"previous one): {error!r}") from error

    def _write(self, part: dict, directory: str, step: int, topo: dict) -> None:
        path = os.path.join(directory, f"step_{step}")
        try:
            write_part(part, path, self.rank)
            ok = 1
        except Exception as e:  # noqa: BLE001 -- the other ranks must still hear this rank failed
            self._error, ok = e, 0
        del part
        try:
            if self.group is not None:
                flag = torch.tensor([ok])
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
                ok = int(flag.item())
            if not ok:
                self._error = self._error or RuntimeError(f"another learner rank failed to write its part of {path}")
            elif self.rank == 0:
                commit(directory, step, topo, self.keep)
        except Exception as e:  # noqa: BLE001 -- raised by wait(), on the training thread
            self._error = self._error or e

    def load(self, directory: str) -> int | None:
        """Load the checkpoint ``directory/latest`` names, written by any ``num_ranks`` / ``ep_size``
        / ZeRO stage; the step it was saved at, or None without one."""
        self.wait()
        if not os.path.exists(os.path.join(directory, LATEST)):
            return None
        path = resolve(directory)  # ValueError for one written before this format, or incomplete
        step = load_into_rank(self.engine.module, self.engine.optimizer, path, expert_row_offsets(self.engine.module),
                              self.zero_stage, rank=self.rank, num_ranks=self.world_size, ep_size=self.ep_size)
        self.engine.global_steps = step  # DeepSpeed's own counter (its checkpoints restored it; we read none of it)
        return step
