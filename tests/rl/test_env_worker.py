"""Env-worker actors under real Ray: a killed actor is restarted and its episodes retried."""

import os
import signal
import time

import ray

from jointrl.envs.registry import load_tasks
from jointrl.rl.config import load_config
from jointrl.rl.env_worker import spawn_env_workers
from jointrl.rl.rollout.router import spawn_router
from jointrl.rl.rollout.worker import RolloutWorker
from jointrl.rl.types import FinishReason


def test_killed_env_worker_is_restarted_and_its_episodes_retried(cluster):
    # episodes still running 0.3 s in, whatever the engine's speed: the untrained model's turns run up to
    # 4096 tokens, but it may sample <|im_end|> sooner (~1,800 tokens in runs seen, well under a second
    # each), so a group of 6 makes it very unlikely that all of them are done by then
    cfg = load_config(["envs.num_workers=1", "rollout.max_context=8192", "rollout.max_tokens_per_turn=4096"])
    rollout = [ray.remote(num_cpus=0, max_concurrency=100)(RolloutWorker).remote(cfg)]
    router = spawn_router(1)  # the driver holds the router: env workers come and go
    (worker,) = spawn_env_workers(cfg, rollout, router)
    task = load_tasks("terminal")[0]
    first_pid = ray.get(worker.pid.remote())
    ref = worker.run_groups.remote([(task, "g0")], 6, 1)
    time.sleep(0.3)  # let the episodes start
    assert not ray.wait([ref], timeout=0)[0], "the call must still be running when the actor dies"
    os.kill(first_pid, signal.SIGKILL)
    trajs = ray.get(ref, timeout=300)
    assert len(trajs) == 6
    assert all(t.finish_reason != FinishReason.ENV_ERROR and t.num_turns >= 1 for t in trajs)
    assert ray.get(worker.pid.remote()) != first_pid  # a new process served the retry
