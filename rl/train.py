"""The driver: ``python -m jointrl.rl.train [hydra overrides]`` (or ``jointrl train ...``).

One linear loop, as in docs/architecture.md:

    sample tasks -> rollouts (+ rewards, in the env workers) -> advantages -> learner step
    -> weight push -> log -> checkpoint

Synchronous: each stage waits for the previous one. ``resume=true`` continues from the
latest checkpoint in ``<output_dir>/checkpoints`` at the step after it.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

import hydra
import ray
from omegaconf import DictConfig

from jointrl.envs.registry import load_tasks
from jointrl.rl.advantages import grpo_advantages
from jointrl.rl.config import Config, register_schemas, to_config
from jointrl.rl.env_worker import spawn_env_workers
from jointrl.rl.joint_sampler import JointSampler
from jointrl.rl.learner.batch import TrainBatch
from jointrl.rl.learner.group import LearnerGroup
from jointrl.rl.preemption import REQUEUE_EXIT_CODE, PreemptionFlag
from jointrl.rl.rollout.worker import RolloutWorker
from jointrl.rl.tracking import RunTracker
from jointrl.rl.types import FinishReason, Task, Trajectory


def train(cfg: Config) -> dict[str, float]:
    """Run ``cfg.algo.total_steps`` GRPO steps; returns the last step's metrics."""
    out_dir = Path(cfg.output_dir).resolve()
    ckpt_dir = out_dir / "checkpoints"
    out_dir.mkdir(parents=True, exist_ok=True)
    _start_ray(cfg)
    sampler = JointSampler({d: load_tasks(d, dc.task_dir) for d, dc in cfg.envs.domains.items()},
                           cfg.envs.domains, cfg.seed)
    learner = LearnerGroup(cfg)
    rollout = [ray.remote(num_cpus=0, max_concurrency=1000)(RolloutWorker).remote(cfg)
               for _ in range(cfg.rollout.num_workers)]
    env_workers = spawn_env_workers(cfg, rollout)

    start = (learner.load_checkpoint(str(ckpt_dir)) if cfg.resume else None) or 0
    if cfg.resume:
        print(f"resuming after step {start} from {ckpt_dir}" if start else f"no checkpoint in {ckpt_dir}; starting fresh",
              flush=True)
    _push(learner, rollout, version=start)
    tracker = RunTracker(cfg, out_dir)
    preempt = PreemptionFlag().install()
    metrics: dict[str, float] = {}
    for step in range(start + 1, cfg.algo.total_steps + 1):
        t0 = time.perf_counter()
        groups = sampler.sample(step, cfg.algo.prompts_per_step)
        trajs = _collect(env_workers, groups, cfg.algo.group_size, step)
        t1 = time.perf_counter()
        adv = grpo_advantages(trajs, scale_by_std=cfg.algo.scale_adv_by_std)
        learner_metrics = {}
        if len(adv.kept) >= cfg.learner.num_ranks:
            batch = TrainBatch([t.token_ids for t in adv.kept], [t.loss_mask for t in adv.kept],
                               [t.logprobs for t in adv.kept], adv.advantages)
            learner_metrics = learner.train_step(batch)
        t2 = time.perf_counter()
        _push(learner, rollout, version=step)
        t3 = time.perf_counter()
        metrics = _step_metrics(trajs, adv.stats, learner_metrics, sampler, groups,
                                {"rollout": t1 - t0, "learner": t2 - t1, "push": t3 - t2})
        tracker.log(step, metrics, trajs)
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.algo.total_steps \
                or preempt.requested:
            learner.save_checkpoint(str(ckpt_dir), step)
            print(f"checkpoint step {step} -> {ckpt_dir}", flush=True)
        if preempt.requested and step < cfg.algo.total_steps:
            print(f"{preempt.signal_name}: stopping after step {step} for requeue", flush=True)
            tracker.finish()
            raise SystemExit(REQUEUE_EXIT_CODE)
    tracker.finish()
    ray.get([w.close.remote() for w in rollout])
    learner.shutdown()
    return metrics


def _start_ray(cfg: Config) -> None:
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # address None means a new local instance: never attach to a cluster `ray start` left behind
    ray.init(address=cfg.cluster.ray_address or "local", num_cpus=cfg.cluster.num_cpus, include_dashboard=False,
             log_to_driver=True, runtime_env={"env_vars": {"DS_ACCELERATOR": "cpu"}})


def _push(learner: LearnerGroup, rollout: list, version: int) -> None:
    """Learner rank 0 -> every rollout worker: the versioned, MXFP4-quantized weight bundle."""
    bundle = learner.weight_bundle(version)
    ray.get([w.update_weights.remote(version, bundle) for w in rollout])


def _collect(env_workers: list, groups: list[tuple[Task, str]], group_size: int, step: int) -> list[Trajectory]:
    """Split the groups over env workers; a worker that stays dead turns its groups into env_error."""
    shares = [groups[i :: len(env_workers)] for i in range(len(env_workers))]
    refs = [(w.run_groups.remote(share, group_size, step), share) for w, share in zip(env_workers, shares) if share]
    trajs: list[Trajectory] = []
    for ref, share in refs:
        try:
            trajs += ray.get(ref)
        except ray.exceptions.RayError as e:
            trajs += [Trajectory([], [], [], [], task.domain, task.id, gid, tier=task.tier,
                                 finish_reason=FinishReason.ENV_ERROR, reward_info={"error": repr(e)[:500]})
                      for task, gid in share for _ in range(group_size)]
    return trajs


def _step_metrics(trajs: list[Trajectory], adv_stats: dict, learner_metrics: dict, sampler: JointSampler,
                  groups: list, times: dict[str, float]) -> dict[str, float]:
    ok = [t for t in trajs if t.finish_reason != FinishReason.ENV_ERROR]
    calls = sum(t.num_tool_calls for t in ok)
    sampled = sum(t.num_sampled for t in ok)
    m: dict[str, float] = {
        "reward/mean": sum(t.reward for t in ok) / max(len(ok), 1),
        "tool_error_rate": sum(t.num_tool_errors for t in ok) / max(calls, 1),
        "tool_calls_per_episode": calls / max(len(ok), 1),
        "env_error": len(trajs) - len(ok),
        "response_tokens_per_episode": sampled / max(len(ok), 1),
        "perf/rollout_tokens_per_s": sampled / max(times["rollout"], 1e-9),
        "time/reward_s": sum(t.reward_time_s for t in ok),  # summed over concurrent episodes
        **{f"time/{k}_s": v for k, v in times.items()},
        **{f"advantages/{k}": float(v) for k, v in adv_stats.items()},
        **{f"learner/{k}": float(v) for k, v in learner_metrics.items()},
    }
    by_domain: dict[str, list[Trajectory]] = defaultdict(list)
    for t in ok:
        by_domain[t.domain].append(t)
    for d, ts in by_domain.items():
        m[f"{d}/reward"] = sum(t.reward for t in ts) / len(ts)
        m[f"{d}/turns"] = sum(t.num_turns for t in ts) / len(ts)
    for reason in FinishReason:
        m[f"finish/{reason}"] = sum(t.finish_reason == reason for t in trajs)
    for d, share in sampler.realized_mix(groups).items():
        m[f"mix/{d}"] = share
    return m


register_schemas()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(raw: DictConfig) -> None:
    try:
        train(to_config(raw))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
