"""Checkpoints of several learner ranks on real Ray actors, DeepSpeed and gloo (rl/checkpoint_format.py):
their size on the bench model in each layout, and the commit that needs every rank's part."""

import time

import pytest
import ray
import torch

from jointrl.rl.build import build_model
from jointrl.rl.config import load_config
from jointrl.rl.learner.group import LearnerGroup

from .test_reshard import _batch  # the same ragged 4-sequence batch

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("ranks,ep", [(1, 1), (2, 1), (2, 2)], ids=["1 rank", "ZeRO-2 x2", "ep 2"])
def test_checkpoint_is_the_masters_and_moments_once(cluster, tmp_path, ranks, ep):
    """On bench_moe (fp32, ~10 M parameters) a checkpoint is the fp32 master and Adam's two moments,
    each element once over all ranks: <= 1.5 x (fp32 weights + moments), whatever the layout."""
    cfg = load_config(["model=bench_moe", "learner.micro_batch_size=2", f"learner.num_ranks={ranks}",
                       f"learner.ep_size={ep}", "learner.zero_stage=2"])
    group = LearnerGroup(cfg)
    group.train_step(_batch(1))
    t0 = time.perf_counter()
    group.save_checkpoint(str(tmp_path), 1)
    t1 = time.perf_counter()
    group.wait_checkpoint()
    t2 = time.perf_counter()
    group.shutdown()
    files = sorted((tmp_path / "step_1").iterdir())
    assert [f.name for f in files] == [f"part_{r:03d}.pt" for r in range(ranks)] + ["topology.json"]
    size = sum(f.stat().st_size for f in files)
    params = sum(p.numel() for p in build_model(cfg).parameters() if p.requires_grad)
    ratio = size / (params * 4 * 3)
    print(f"\n{ranks} rank(s), ep_size {ep}: checkpoint {size / 2**20:.1f} MiB = {ratio:.3f} x (fp32 weights + "
          f"Adam moments, {params * 12 / 2**20:.1f} MiB); save (host copy) {t1 - t0:.3f} s, then the write "
          f"{t2 - t1:.3f} s in the background")
    assert ratio <= 1.5


def test_a_rank_that_fails_its_write_keeps_latest_on_every_rank(cluster, tmp_path):
    """Rank 1 cannot place its part of step 2; rank 0 wrote its own: the checkpoint is not committed
    (``latest`` stays at step 1, no topology), both ranks report it, and step 1 resumes."""
    cfg = load_config(["model.dtype=float64", "learner.micro_batch_size=1", "learner.num_ranks=2"])
    group = LearnerGroup(cfg)
    group.train_step(_batch(1))
    group.save_checkpoint(str(tmp_path), 1, wait=True)
    at_1 = _weights(group)
    group.train_step(_batch(2))
    (tmp_path / "step_2" / "part_001.pt").mkdir(parents=True)
    group.save_checkpoint(str(tmp_path), 2)
    errors = []
    for w in group.workers:
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            ray.get(w.wait_checkpoint.remote())
        errors.append(str(e.value))
    assert "IsADirectoryError" in errors[1] and "another learner rank failed" in errors[0], errors
    assert (tmp_path / "latest").read_text() == "step_1"
    assert (tmp_path / "step_2" / "part_000.pt").is_file() and not (tmp_path / "step_2" / "topology.json").exists()
    for w in group.workers:
        ray.kill(w)

    resumed = LearnerGroup(cfg)
    assert resumed.load_checkpoint(str(tmp_path)) == 1
    for n, t in _weights(resumed).items():
        assert torch.equal(t, at_1[n]), n
    resumed.shutdown()


def _weights(group: LearnerGroup) -> dict[str, torch.Tensor]:
    """Rank 0's model weights (whole without expert parallelism)."""
    return ray.get(group.workers[0].__ray_call__.remote(
        lambda w: {n: p.detach().clone() for n, p in w.engine.module.named_parameters()}))
