"""Rollout routing over two real rollout-worker actors in placement-group bundles: least-loaded
first turns, sticky later turns, a dead worker's sessions re-routed; a run the cluster cannot
hold is refused by name."""

import asyncio

import pytest
import ray

from jointrl.envs.base import EnvError
from jointrl.rl.config import load_config
from jointrl.rl.placement import Placement
from jointrl.rl.rollout.router import RoutedEngineClient, spawn_router
from jointrl.rl.rollout.worker import RolloutWorker
from jointrl.rl.types import SamplingParams


def test_sessions_go_to_the_least_loaded_worker_stick_and_move_when_it_dies(cluster):
    cfg = load_config(["rollout.num_workers=2", "learner.num_ranks=2", "rollout.backend=simple", "run_name=routing"])
    placement = Placement(cfg)
    workers = [ray.remote(max_concurrency=100)(RolloutWorker).options(**placement.rollout(i)).remote(cfg)
               for i in range(2)]
    router = spawn_router(2)
    params = SamplingParams(max_tokens=4, seed=0)
    prompt = [257, 117, 10, 104, 105, 258, 10, 257, 97, 10, 259]

    async def scenario():
        clients = [RoutedEngineClient(workers, router, f"g0#{i}") for i in range(4)]
        await asyncio.gather(*(c.generate(prompt, params) for c in clients))
        assert sorted(c.index for c in clients) == [0, 0, 1, 1]  # least-loaded: two each
        first = {c.session: c.index for c in clients}
        await clients[1].close()  # one episode on worker first[g0#1] ends ...
        late = RoutedEngineClient(workers, router, "g1#0")
        await late.generate(prompt, params)
        assert late.index == first["g0#1"]  # ... so the next new episode goes there
        again = RoutedEngineClient(workers, router, "g0#0")  # a later turn of a live session
        await again.generate(prompt + [260, 258], params)
        assert again.index == first["g0#0"]

        victim = first["g0#0"]
        ray.kill(workers[victim], no_restart=True)
        with pytest.raises(EnvError, match=f"rollout worker {victim} died"):
            await clients[0].generate(prompt, params)
        out = await clients[0].generate(prompt, params)  # the re-run of the episode: the live worker
        assert clients[0].index == 1 - victim and len(out.token_ids) >= 1
        stats = await router.stats.remote()
        assert stats["dead"] == [victim] and stats["worker_deaths"] == 1 and stats["rerouted"] >= 1
        fresh = RoutedEngineClient(workers, router, "g2#0")
        await fresh.generate(prompt, params)
        assert fresh.index == 1 - victim  # nothing new goes to the dead worker

    asyncio.run(scenario())
    placement.remove()


def test_a_run_the_cluster_cannot_hold_is_refused_naming_the_bundle(cluster):
    cfg = load_config(["learner.num_ranks=2", "cluster.learner_bundle.CPU=8", "run_name=toobig"])
    with pytest.raises(RuntimeError, match=r"cannot hold the learner placement group \(2 x \{'CPU': 8.0\}"):
        Placement(cfg, timeout_s=5)
