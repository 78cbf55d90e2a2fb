"""Each actor of a run sets its torch threads from the CPUs its bundle holds and sees exactly
its GPUs: the real learner-rank, rollout-worker and env-worker actors, placed by ``Placement``
on a local Ray instance with 8 logical CPUs and 4 logical GPUs (no CUDA here: the actors' tensors
stay on CPU while Ray sets ``CUDA_VISIBLE_DEVICES``)."""

import pytest
import ray

from jointrl.rl.actor_resources import placement_table, threads_for
from jointrl.rl.config import load_config
from jointrl.rl.env_worker import spawn_env_workers
from jointrl.rl.learner.worker import LearnerWorker
from jointrl.rl.placement import Placement
from jointrl.rl.rollout.router import spawn_router
from jointrl.rl.rollout.worker import RolloutWorker


@pytest.fixture(scope="module")
def gpu_cluster():
    ray.init(address="local", num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_threads_for_rounds_down_and_keeps_one():
    assert [threads_for(c) for c in (0, 0.25, 1, 1.5, 2, 3.0)] == [1, 1, 1, 1, 2, 3]


def test_each_actor_gets_its_bundles_threads_and_gpus(gpu_cluster):
    cfg = load_config(["learner.num_ranks=2", "rollout.num_workers=2", "rollout.backend=simple", "run_name=placed",
                       "cluster.learner_bundle={CPU: 2, GPU: auto}", "cluster.rollout_bundle={CPU: 1, GPU: auto}",
                       "cluster.env_worker_cpus=2"])
    placement = Placement(cfg)
    assert placement.learner_bundle == {"CPU": 2.0, "GPU": 1.0} and placement.rollout_bundle == {"CPU": 1.0, "GPU": 1.0}
    learners = [ray.remote(LearnerWorker).options(**placement.learner(r)).remote(cfg, r, 2) for r in range(2)]
    rollout = [ray.remote(RolloutWorker).options(**placement.rollout(i)).remote(cfg, i) for i in range(2)]
    env = spawn_env_workers(cfg, rollout, spawn_router(2), placement)[:1]
    placed = ray.get([w.resources.remote() for w in (*learners, *rollout, *env)])
    assert [(r.role, r.index) for r in placed] == [("learner", 0), ("learner", 1), ("rollout", 0), ("rollout", 1),
                                                   ("env", 0)]
    assert [r.cpus for r in placed] == [2, 2, 1, 1, 2]
    assert [r.threads for r in placed] == [2, 2, 1, 1, 2]  # torch.get_num_threads() inside each actor
    gpus = [r.gpu_ids for r in placed[:4]]
    assert all(len(g) == 1 for g in gpus) and len({g[0] for g in gpus}) == 4, gpus  # one distinct GPU each
    assert [r.cuda_visible_devices for r in placed[:4]] == [g[0] for g in gpus]  # exactly its own GPU
    assert placed[4].gpu_ids == () and placed[4].cuda_visible_devices in (None, "")
    for group, rows in (("learner", placed[:2]), ("rollout", placed[2:4])):  # on the node of its bundle
        bundle_nodes = ray.util.placement_group_table(placement.groups[group])["bundles_to_node_id"]
        assert [r.node_id for r in rows] == [bundle_nodes[i] for i in range(2)]
    table = placement_table(placed)
    for r in placed:
        assert f"{r.role} {r.index}" in table
    for w in (*learners, *rollout, *env):
        ray.kill(w)
    placement.remove()


def test_colocated_rollout_worker_shares_its_learner_ranks_gpu(gpu_cluster):
    cfg = load_config(["learner.num_ranks=2", "rollout.num_workers=2", "rollout.backend=simple", "run_name=coloc",
                       "cluster.learner_bundle={CPU: 2, GPU: auto}", "cluster.rollout_bundle={CPU: 1, GPU: auto}",
                       "cluster.colocate=true"])
    placement = Placement(cfg)
    assert list(placement.groups) == ["learner"]
    assert ray.util.placement_group_table(placement.groups["learner"])["bundles"][0] == {"CPU": 3.0, "GPU": 1.0}
    learners = [ray.remote(LearnerWorker).options(**placement.learner(r)).remote(cfg, r, 2) for r in range(2)]
    rollout = [ray.remote(RolloutWorker).options(**placement.rollout(i)).remote(cfg, i) for i in range(2)]
    placed = ray.get([w.resources.remote() for w in (*learners, *rollout)])
    assert [r.threads for r in placed] == [2, 2, 1, 1]
    for i in range(2):  # rank i and worker i: the same single GPU; ranks 0 and 1: different ones
        assert placed[i].cuda_visible_devices == placed[2 + i].cuda_visible_devices == placed[i].gpu_ids[0]
    assert placed[0].gpu_ids != placed[1].gpu_ids
    for w in (*learners, *rollout):
        ray.kill(w)
    placement.remove()


def test_sft_placement_gives_each_learner_rank_its_whole_bundle(gpu_cluster):
    """``learner_only`` (``jointrl sft``): one group, a learner bundle per rank, nothing reserved for
    rollout workers and no GPU split with one even where the run colocates them."""
    cfg = load_config(["learner.num_ranks=2", "rollout.num_workers=2", "run_name=sftplaced", "cluster.colocate=true",
                       "cluster.learner_bundle={CPU: 2, GPU: auto}", "cluster.rollout_bundle={CPU: 1, GPU: auto}"])
    placement = Placement(cfg, learner_only=True)
    assert list(placement.groups) == ["learner"]
    assert ray.util.placement_group_table(placement.groups["learner"])["bundles"] == {0: {"CPU": 2.0, "GPU": 1.0},
                                                                                       1: {"CPU": 2.0, "GPU": 1.0}}
    learners = [ray.remote(LearnerWorker).options(**placement.learner(r)).remote(cfg, r, 2) for r in range(2)]
    placed = ray.get([w.resources.remote() for w in learners])
    assert [(r.cpus, r.threads, len(r.gpu_ids)) for r in placed] == [(2, 2, 1), (2, 2, 1)]
    assert placed[0].gpu_ids != placed[1].gpu_ids
    for w in learners:
        ray.kill(w)
    placement.remove()


def test_colocate_needs_a_learner_rank_per_rollout_worker(gpu_cluster):
    cfg = load_config(["learner.num_ranks=1", "rollout.num_workers=2", "cluster.colocate=true"])
    with pytest.raises(ValueError, match="rollout.num_workers"):
        Placement(cfg)


def test_a_vllm_worker_bundle_spans_its_tensor_parallel_gpus(gpu_cluster):
    """``GPU: auto`` gives a vLLM rollout worker tensor_parallel_size x data_parallel_size GPUs (one
    bundle, so one node); a bundle that names fewer is refused before anything is placed."""
    over = ["learner.num_ranks=1", "rollout.num_workers=1", "rollout.backend=vllm", "rollout.vllm.tensor_parallel_size=2",
            "cluster.learner_bundle={CPU: 1, GPU: auto}"]
    placement = Placement(load_config([*over, "cluster.rollout_bundle={CPU: 2, GPU: auto}"]))
    assert placement.rollout_bundle == {"CPU": 2.0, "GPU": 2.0}
    assert ray.util.placement_group_table(placement.groups["rollout"])["bundles"][0] == {"CPU": 2.0, "GPU": 2.0}
    placement.remove()
    with pytest.raises(ValueError, match="tensor_parallel_size x data_parallel_size = 2"):
        Placement(load_config([*over, "cluster.rollout_bundle={CPU: 2, GPU: 1}"]))
