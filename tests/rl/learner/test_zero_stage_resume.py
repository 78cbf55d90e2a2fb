"""One rank in fp32 / fp64 runs ZeRO-0 (``setup.zero_stage``); before, it ran ZeRO-1. A checkpoint
written under either resumes under the other and under its own (rl/checkpoint_format.py): the
weights and Adam's moments come along, so the next step takes the update the writer took (to the
fp32 rounding of ZeRO's master weights)."""

import pytest
import torch

import jointrl.rl.learner.setup as setup_mod
from jointrl.rl.config import load_config
from jointrl.rl.learner.setup import zero_stage
from jointrl.rl.learner.worker import LearnerWorker

from .test_reshard import _batch  # the same ragged 4-sequence batch

_PORT = [29850]
OVERRIDES = ["model.dtype=float64", "learner.micro_batch_size=2", "learner.eps=1.0", "learner.grad_clip=0.0"]


def _worker(monkeypatch, stage: int) -> LearnerWorker:
    """A one-rank learner running ZeRO-``stage`` (1: as every one-rank learner did before)."""
    if stage:
        monkeypatch.setattr(setup_mod, "zero_stage", lambda cfg, world_size: stage)
    else:
        monkeypatch.undo()
    _PORT[0] += 1
    w = LearnerWorker(load_config(OVERRIDES), 0, 1, "127.0.0.1", _PORT[0])
    assert (w.engine.zero_optimization_stage() if stage else 0) == stage
    monkeypatch.undo()
    return w


def _step(w: LearnerWorker, seed: int) -> None:
    b = _batch(seed)
    w.train_step(b, b.num_loss_tokens, b.num_loss_seqs)


def _weights(w: LearnerWorker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in w.engine.module.named_parameters()}


def test_one_rank_runs_zero_0_except_bf16():
    for dtype, stage, want in (("float32", 2, 0), ("float64", 1, 0), ("bfloat16", 2, 1), ("bfloat16", 0, 0)):
        cfg = load_config([f"model.dtype={dtype}", f"learner.zero_stage={stage}"])
        assert zero_stage(cfg, 1) == want, (dtype, stage)
        assert zero_stage(cfg, 2) == stage


@pytest.mark.parametrize("first,then", [(1, 0), (0, 1), (0, 0), (1, 1)])
def test_resume_across_zero_stages(monkeypatch, tmp_path, first, then):
    a = _worker(monkeypatch, first)
    _step(a, 1)
    a.save_checkpoint(str(tmp_path), 1)
    a.wait_checkpoint()
    saved = _weights(a)
    _step(a, 2)
    a_next = _weights(a)

    b = _worker(monkeypatch, then)
    assert b.load_checkpoint(str(tmp_path)) == 1
    for n, t in _weights(b).items():
        assert torch.equal(t, saved[n]), n
    _step(b, 2)
    for n, t in _weights(b).items():  # the same update: Adam's moments and step count came along
        torch.testing.assert_close(t - saved[n], a_next[n] - saved[n], rtol=1e-4, atol=2.5e-7, msg=n)


def test_checkpoint_of_deepspeed_files_only_names_the_way_out(monkeypatch, tmp_path):
    """A checkpoint as jointrl wrote them before parts (DeepSpeed's own files, ``latest``) does not
    resume: the error says what it is and what reads it, instead of a missing file deep in the load."""
    a = _worker(monkeypatch, 1)
    _step(a, 1)
    a.engine.save_checkpoint(str(tmp_path), tag="step_1", client_state={"step": 1})
    assert (tmp_path / "latest").read_text() == "step_1"
    b = _worker(monkeypatch, 0)
    with pytest.raises(ValueError, match="holds only DeepSpeed's own files.*jointrl version that wrote it"):
        b.load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("first,then", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_bf16_without_zero_checkpoints_and_resumes(tmp_path, first, then):
    """bfloat16 with ``learner.zero_stage=0`` (DeepSpeed's FP16_UnfusedOptimizer: fp32 masters beside the
    bf16 weights, torch's AdamW over the masters) writes a checkpoint, and it resumes without ZeRO and
    with it (and a ZeRO-1 one without): the masters and Adam's moments come along, the same next update."""
    def worker(stage: int) -> LearnerWorker:
        _PORT[0] += 1
        cfg = load_config(["model.dtype=bfloat16", "learner.micro_batch_size=2", "learner.grad_clip=0.0",
                           f"learner.zero_stage={stage}"])
        w = LearnerWorker(cfg, 0, 1, "127.0.0.1", _PORT[0])
        assert w.setup.zero_stage == stage
        return w

    a = worker(first)
    _step(a, 1)
    a.save_checkpoint(str(tmp_path), 1)
    a.wait_checkpoint()
    saved = _weights(a)
    _step(a, 2)
    a_next = _weights(a)
    b = worker(then)
    assert b.load_checkpoint(str(tmp_path)) == 1
    for n, t in _weights(b).items():
        assert torch.equal(t, saved[n]), n
    _step(b, 2)
    for n, t in _weights(b).items():
        assert torch.equal(t, a_next[n]), n
