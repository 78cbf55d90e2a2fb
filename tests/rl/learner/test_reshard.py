"""Resuming with another number of learner ranks or ``ep_size`` (rl/learner/portable_checkpoint.py),
through ``LearnerGroup`` on real Ray actors, DeepSpeed and gloo: 2 ranks with ep_size 2 -> 1 rank,
and back. The resumed fp32 master weights equal the saved ones bit for bit, and the next step takes
the update the old topology took (up to fp32 summation order: Adam's moments came along); the one
rank runs without ZeRO (float64 weights and moments, ``setup.zero_stage``), the two with ZeRO-2.
The group's rendezvous is rank 0's Ray node IP, not loopback."""

import pytest
import ray
import torch

from jointrl.rl.config import load_config
from jointrl.rl.learner.batch import TrainBatch
from jointrl.rl.learner.group import LearnerGroup

pytestmark = pytest.mark.slow

OVERRIDES = ["model.dtype=float64", "learner.micro_batch_size=1", "learner.eps=1.0", "learner.grad_clip=0.0"]


def _cfg(ranks: int, ep: int):
    return load_config([*OVERRIDES, f"learner.num_ranks={ranks}", f"learner.ep_size={ep}"])


def _batch(seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 5, 12, 7)]
    masks = [[0] * 2 + [1] * (len(s) - 2) for s in seqs]
    old = [[0.0 if m == 0 else -5.5 + 0.1 * i for i, m in enumerate(mk)] for mk in masks]
    return TrainBatch(seqs, masks, old, [1.0, -0.5, 0.25, -1.0])


def _masters(group: LearnerGroup) -> dict[str, torch.Tensor]:
    """The whole master copy (ZeRO's fp32 one; one rank runs without ZeRO: its float64 weights),
    expert rows of every rank joined."""
    def local(worker):
        from deepspeed.utils import safe_get_full_fp32_param

        from jointrl.rl.learner.expert_parallel import expert_row_offsets

        offsets = expert_row_offsets(worker.engine.module)
        return {n: ((safe_get_full_fp32_param(p) if worker.setup.zero_stage else p).detach().clone(), offsets.get(n))
                for n, p in worker.engine.module.named_parameters()}

    parts = ray.get([w.__ray_call__.remote(local) for w in group.workers])  # collective: every rank at once
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for part in parts:
        for name, (t, offset) in part.items():
            pieces.setdefault(name, {})[offset or 0] = t
    return {n: torch.cat([rows[o] for o in sorted(rows)]) for n, rows in pieces.items()}


def test_resume_with_other_ranks_and_ep_size(cluster, tmp_path):
    a = LearnerGroup(_cfg(2, 2))
    assert a.master_addr == ray.util.get_node_ip_address() != "127.0.0.1"  # multi-node ready
    a.train_step(_batch(1))
    a.save_checkpoint(str(tmp_path / "ep2"), 1, wait=True)
    saved = _masters(a)
    # each rank wrote its own ZeRO fragments (no gather): the parts hold each master element once
    parts = [torch.load(f, weights_only=False) for f in sorted((tmp_path / "ep2" / "step_1").glob("part_*"))]
    assert len(parts) == 2
    held: dict[str, int] = {}
    for part in parts:
        for name, e in part["params"].items():
            held[name] = held.get(name, 0) + e["flat"][1]
    assert held == {k: v.numel() for k, v in saved.items()}
    assert all(any(e["row_offset"] is None for e in part["params"].values()) for part in parts)  # shared ones split
    a.train_step(_batch(2))
    a_next = _masters(a)
    a.shutdown()

    b = LearnerGroup(_cfg(1, 1))
    assert b.load_checkpoint(str(tmp_path / "ep2")) == 1
    resumed = _masters(b)
    assert set(resumed) == set(saved)
    for k in saved:
        assert torch.equal(resumed[k], saved[k].double()), k
    b.train_step(_batch(2))
    b_next = _masters(b)
    for k in saved:  # the same update: weights, fp32 masters, Adam's moments and step count all came along
        torch.testing.assert_close(b_next[k] - saved[k].double(), (a_next[k] - saved[k]).double(), rtol=1e-4, atol=2.5e-7,
                                   msg=k)
    b.save_checkpoint(str(tmp_path / "ep1"), 2)
    b.shutdown()

    c = LearnerGroup(_cfg(2, 2))  # and back: 1 rank -> 2 ranks with ep_size 2
    assert c.load_checkpoint(str(tmp_path / "ep1")) == 2
    back = _masters(c)
    for k in b_next:
        assert torch.equal(back[k], b_next[k].float()), k
    c.train_step(_batch(3))
    c.shutdown()
