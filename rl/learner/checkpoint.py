"""A learner rank's checkpoints, and the policy read back out of a run's checkpoint.

``directory/step_N`` holds DeepSpeed's files (with expert parallelism, each rank's
``ep_rank_*.pt``), which load exactly into the same ``num_ranks`` / ``ep_size``, and ``portable/``
(``portable_checkpoint.py``), which loads into any. ``load_deepspeed`` builds the policy from
either layout (``jointrl export``, ``checkpoint=`` as a run's initial weights).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from jointrl.model.moe_transformer import MoETransformer
from jointrl.rl.build import build_model
from jointrl.rl.config import Config
from jointrl.rl.learner.expert_parallel import expert_row_offsets
from jointrl.rl.learner.portable_checkpoint import load_portable, save_portable, topology
from jointrl.rl.learner.value_head import VALUE_HEAD_PREFIX


def load_deepspeed(cfg: Config, checkpoint: str | Path) -> tuple[MoETransformer, int]:
    """(policy, step) from a DeepSpeed checkpoint directory, expert-sharded or not (no critic)."""
    path = Path(checkpoint)
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
    files = sorted(path.glob("mp_rank_*_model_states.pt")) or sorted(path.glob("ep_rank_*.pt"))
    if not files:
        raise ValueError(f"checkpoint {str(checkpoint)!r} has no DeepSpeed model states (latest, mp_rank_00_model_states.pt "
                         "or ep_rank_000.pt)")
    saved = [torch.load(f, map_location="cpu", weights_only=False) for f in files[:1]]
    model = build_model(cfg)
    want = model.state_dict()
    first = {k: v for k, v in saved[0]["module"].items() if not k.startswith(VALUE_HEAD_PREFIX)}
    sharded = [k for k, v in first.items() if k in want and v.shape != want[k].shape]
    if sharded:  # expert parallelism: ranks 0..ep_size-1 hold consecutive expert slices
        ep_size = want[sharded[0]].shape[0] // first[sharded[0]].shape[0]
        saved += [torch.load(f, map_location="cpu", weights_only=False) for f in files[1:ep_size]]
        for k in sharded:
            first[k] = torch.cat([s["module"][k] for s in saved])
    model.load_state_dict(first)
    step = saved[0].get("step")
    return model, int(step if step is not None else path.name.removeprefix("step_"))


class Checkpointer:
    """Saves and loads one rank's model and optimizer (every rank of the group calls together)."""

    def __init__(self, engine, rank: int, world_size: int, ep_size: int, zero_stage: int) -> None:
        self.engine, self.rank, self.world_size, self.ep_size, self.zero_stage = engine, rank, world_size, ep_size, zero_stage

    def save(self, directory: str, step: int) -> None:
        """``directory/step_N`` in this topology's layout, and its portable copy."""
        save_portable(self.engine.module, self.engine.optimizer, os.path.join(directory, f"step_{step}"), rank=self.rank,
                      num_ranks=self.world_size, ep_size=self.ep_size, step=step,
                      row_offsets=expert_row_offsets(self.engine.module), zero_stage=self.zero_stage)
        if self.ep_size > 1:
            return self._save_ep(directory, step)
        self.engine.save_checkpoint(directory, tag=f"step_{step}", client_state={"step": step})

    def load(self, directory: str) -> int | None:
        """Load the latest checkpoint in ``directory``; the step it was saved at, or None. Saved by
        another ``num_ranks`` / ``ep_size``, or with ZeRO partitioning where this rank runs without
        (or the other way round: a one-rank fp32 run is ZeRO-0, older one-rank checkpoints ZeRO-1):
        from its portable copy."""
        if not os.path.exists(os.path.join(directory, "latest")):
            return None
        with open(os.path.join(directory, "latest")) as f:
            path = os.path.join(directory, f.read().strip())
        saved = topology(path)
        if saved is None and self.zero_stage == 0 and any(Path(path).glob("zero_pp_rank_*")):
            raise ValueError(f"checkpoint {path} holds ZeRO optimizer files and no portable copy (written before "
                             "checkpoints had one); one learner rank now runs without ZeRO and cannot read them: "
                             "resume it with the code that wrote it, or start from its weights with a fresh "
                             f"optimizer (checkpoint={path})")
        here = (self.world_size, self.ep_size, self.zero_stage > 0)
        # written before topologies named the stage: with ZeRO (ZeRO-0 could not write a checkpoint then)
        if saved is not None and (saved["num_ranks"], saved["ep_size"], saved.get("zero_stage", 1) > 0) != here:
            return load_portable(self.engine.module, self.engine.optimizer, path, expert_row_offsets(self.engine.module),
                                 self.zero_stage)
        if self.ep_size > 1:
            return self._load_ep(directory)
        path, client = self.engine.load_checkpoint(directory)
        return None if path is None else int(client["step"])

    # DeepSpeed's own MoE checkpoint files assume its expert naming (deepspeed_moe.experts.*), so with
    # expert parallelism each rank writes its module (its experts) and its ZeRO partition itself; these
    # load into the same num_ranks / ep_size only (another topology reads the portable copy).
    def _save_ep(self, directory: str, step: int) -> None:
        path = os.path.join(directory, f"step_{step}")
        os.makedirs(path, exist_ok=True)
        torch.save({"module": self.engine.module.state_dict(), "optimizer": self.engine.optimizer.state_dict(),
                    "step": step, "world_size": self.world_size}, os.path.join(path, f"ep_rank_{self.rank:03d}.pt"))
        dist.barrier()
        if self.rank == 0:
            with open(os.path.join(directory, "latest"), "w") as f:
                f.write(f"step_{step}")

    def _load_ep(self, directory: str) -> int:
        with open(os.path.join(directory, "latest")) as f:
            tag = f.read().strip()
        sd = torch.load(os.path.join(directory, tag, f"ep_rank_{self.rank:03d}.pt"), weights_only=False)
        if sd["world_size"] != self.world_size:
            raise ValueError(f"checkpoint {tag} was saved by {sd['world_size']} learner ranks with expert "
                             f"parallelism; it loads into the same learner.num_ranks only (now {self.world_size})")
        self.engine.module.load_state_dict(sd["module"])
        self.engine.optimizer.load_state_dict([sd["optimizer"]] * self.world_size)  # ZeRO reads this rank's entry
        return int(sd["step"])
