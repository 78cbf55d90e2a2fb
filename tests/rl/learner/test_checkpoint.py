"""``Checkpointer`` (rl/learner/checkpoint.py) on one real DeepSpeed rank: the part is a snapshot
taken at ``save`` while the disk write runs beside the next step, and a write that fails leaves
``latest`` at the previous complete checkpoint, which is what a resume then reads."""

import socket

import pytest
import torch

from jointrl.rl.config import load_config
from jointrl.rl.learner.worker import LearnerWorker

from .test_reshard import _batch  # the same ragged 4-sequence batch


def _worker(*overrides: str) -> LearnerWorker:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return LearnerWorker(load_config(["learner.micro_batch_size=2", *overrides]), 0, 1, "127.0.0.1", port)


def _step(w: LearnerWorker, seed: int) -> None:
    b = _batch(seed)
    w.train_step(b, b.num_loss_tokens, b.num_loss_seqs)


def _weights(w: LearnerWorker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in w.engine.module.named_parameters()}


def test_the_part_is_the_state_at_save_while_the_next_step_runs(tmp_path):
    a = _worker()
    _step(a, 1)
    at_save = _weights(a)
    a.save_checkpoint(str(tmp_path), 1)
    _step(a, 2)  # changes the live weights and moments in place while the part may still be writing
    a.wait_checkpoint()
    assert any(not torch.equal(t, at_save[n]) for n, t in _weights(a).items())
    b = _worker()
    assert b.load_checkpoint(str(tmp_path)) == 1
    for n, t in _weights(b).items():
        assert torch.equal(t, at_save[n]), n


def test_a_failed_write_leaves_latest_at_the_previous_checkpoint(tmp_path):
    a = _worker("learner.checkpoint_keep=1")
    _step(a, 1)
    a.save_checkpoint(str(tmp_path), 1)
    a.wait_checkpoint()
    at_1 = _weights(a)
    _step(a, 2)
    blocker = tmp_path / "step_2" / "part_000.pt"
    blocker.mkdir(parents=True)  # the part cannot take its place: the write fails after writing the bytes
    a.save_checkpoint(str(tmp_path), 2)
    with pytest.raises(RuntimeError, match="checkpoint was not written.*latest stays"):
        a.wait_checkpoint()
    assert (tmp_path / "latest").read_text() == "step_1"
    assert not (tmp_path / "step_2" / "topology.json").exists()

    b = _worker()  # the resume reads the complete step 1
    assert b.load_checkpoint(str(tmp_path)) == 1
    for n, t in _weights(b).items():
        assert torch.equal(t, at_1[n]), n

    blocker.rmdir()
    a.save_checkpoint(str(tmp_path), 3)
    a.wait_checkpoint()
    # keep 1: step_1 goes once step_3 is committed, and so does step_2, a write that failed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_3"]
    assert b.load_checkpoint(str(tmp_path)) == 3
