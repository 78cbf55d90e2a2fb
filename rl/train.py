"""The driver: ``python -m jointrl.rl.train [hydra overrides]`` (or ``jointrl train ...``).

One linear loop, as in docs/architecture.md:

    sample tasks -> rollouts (+ rewards, in the env workers) -> advantages -> learner step
    -> weight push -> log -> checkpoint

Groups whose rewards all agree carry no signal and are dropped; the step then samples fresh
groups (up to ``algo.max_refill_attempts`` rounds) until it has ``algo.prompts_per_step``
informative ones (DAPO's dynamic sampling). PPO keeps every scored trajectory.

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
from omegaconf import DictConfig, OmegaConf

from jointrl.rewards.base import succeeded
from jointrl.rl.advantages import AdvantageResult, grpo_advantages, normalize_rewards_by_domain
from jointrl.rl.config import Config, register_schemas, to_config
from jointrl.rl.env_worker import spawn_env_workers
from jointrl.rl.joint_sampler import JointSampler
from jointrl.rl.learner.batch import TrainBatch
from jointrl.rl.learner.group import LearnerGroup
from jointrl.rl.placement import Placement
from jointrl.rl.preemption import REQUEUE_EXIT_CODE, PreemptionFlag
from jointrl.rl.rollout.router import spawn_router
from jointrl.rl.rollout.worker import RolloutWorker
from jointrl.rl.tracking import RunTracker
from jointrl.rl.types import FinishReason, Task, Trajectory
from jointrl.rl.weight_transport import WeightPush


def train(cfg: Config) -> dict[str, float]:
    """Run ``cfg.algo.total_steps`` GRPO steps; returns the last step's metrics."""
    if cfg.algo.name == "sft":
        raise ValueError("algo.name=sft trains on oracle transcripts, not on rollouts: run `jointrl sft [overrides]`")
    out_dir = Path(cfg.output_dir).resolve()
    ckpt_dir = out_dir / "checkpoints"
    out_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), out_dir / "config.yaml")  # the resolved config (jointrl export reads it)
    _start_ray(cfg)
    sampler = JointSampler.from_config(cfg.envs.domains, cfg.seed)
    placement = Placement(cfg)
    learner = LearnerGroup(cfg, [placement.learner(r) for r in range(cfg.learner.num_ranks)])
    # a rollout worker that dies is restarted by Ray; the router re-admits it once it holds the pushed weights
    rollout = [ray.remote(max_concurrency=1000, max_restarts=-1)(RolloutWorker).options(**placement.rollout(i)).remote(cfg)
               for i in range(cfg.rollout.num_workers)]
    router = spawn_router(len(rollout))
    env_workers = spawn_env_workers(cfg, rollout, router)
    print(f"processes: learner ranks {ray.get([w.pid.remote() for w in learner.workers])} rollout workers "
          f"{ray.get([w.pid.remote() for w in rollout])} env workers {ray.get([w.pid.remote() for w in env_workers])}",
          flush=True)

    start = (learner.load_checkpoint(str(ckpt_dir)) if cfg.resume else None) or 0
    if cfg.resume:
        print(f"resuming after step {start} from {ckpt_dir}" if start else f"no checkpoint in {ckpt_dir}; starting fresh",
              flush=True)
    push = WeightPush(cfg.rollout.weight_transport, learner.senders, rollout,
                      cfg.rollout.weight_dist_backend)
    push(start)
    tracker = RunTracker(cfg, out_dir)
    preempt = PreemptionFlag().install()
    metrics: dict[str, float] = {}
    ahead: dict[int, tuple[list, list]] = {}  # rollout.mode=async: step -> (groups, rollouts in flight)
    for step in range(start + 1, cfg.algo.total_steps + 1):
        t0 = time.perf_counter()
        groups, refs = ahead.pop(step, None) or _launch(env_workers, sampler.sample(step, cfg.algo.prompts_per_step),
                                                        cfg.algo.group_size, step)
        trajs, stale = _drop_stale(_gather(refs, cfg.algo.group_size), step - 1, cfg.rollout.max_staleness)
        adv = _advantages(cfg, trajs)
        for attempt in range(1, cfg.algo.max_refill_attempts + 1):  # refill dropped groups
            missing = cfg.algo.prompts_per_step - len({t.group_id for t in adv.kept})
            if missing <= 0 or cfg.algo.name == "ppo":
                break
            more = sampler.sample(step, missing, attempt)
            groups += more
            trajs += _gather(_launch(env_workers, more, cfg.algo.group_size, step)[1], cfg.algo.group_size)
            adv = _advantages(cfg, trajs)
        adv.stats["refill_groups"] = len(groups) - cfg.algo.prompts_per_step
        if cfg.rollout.mode == "async":  # the next steps' rollouts run while the learner trains on this one
            for nxt in range(step + 1, min(step + cfg.rollout.async_steps_ahead, cfg.algo.total_steps) + 1):
                if nxt not in ahead:
                    ahead[nxt] = _launch(env_workers, sampler.sample(nxt, cfg.algo.prompts_per_step),
                                         cfg.algo.group_size, nxt)
        t1 = time.perf_counter()
        learner_metrics = {}
        if len(adv.kept) >= cfg.learner.num_ranks:
            learner_metrics = learner.train_step(_train_batch(cfg, adv))
        t2 = time.perf_counter()
        push_times = push(step)
        router.revive.remote(push.live)
        t3 = time.perf_counter()
        metrics = _step_metrics(trajs, adv.stats, learner_metrics, sampler, groups,
                                {"rollout": t1 - t0, "learner": t2 - t1, "push": t3 - t2})
        metrics.update({f"weight_sync/{k}_s": v for k, v in push_times.items()})
        metrics["weight_sync/retries"] = float(push.retries)
        if learner_metrics:
            metrics["perf/learner_tokens_per_s"] = sum(len(t.token_ids) for t in adv.kept) / max(t2 - t1, 1e-9)
        routing = ray.get(router.stats.remote())
        metrics.update({f"rollout/{k}": float(routing[k]) for k in ("rerouted", "worker_deaths")})
        metrics["rollout/dead_workers"] = float(len(routing["dead"]))
        staleness = [_staleness(t, step - 1) for t in trajs if t.finish_reason != FinishReason.ENV_ERROR]
        metrics.update({"staleness/mean": sum(staleness) / max(len(staleness), 1), "staleness/max": float(max(staleness, default=0)),
                        "staleness/dropped": float(stale)})
        tracker.log(step, metrics, trajs, histograms={"staleness/histogram": staleness})
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


def _advantages(cfg: Config, trajs: list[Trajectory]) -> AdvantageResult:
    """Group-relative advantages (GRPO, GSPO) or, for PPO, every scored trajectory (its critic and
    GAE give per-token advantages in the learner); rewards standardised per domain if configured."""
    scored = normalize_rewards_by_domain(trajs) if cfg.algo.normalize_rewards_by_domain else trajs
    if cfg.algo.name == "ppo":
        kept = [t for t in scored if t.finish_reason != FinishReason.ENV_ERROR]
        return AdvantageResult(kept, [0.0] * len(kept), {"env_error": len(scored) - len(kept), "trajectories_kept": len(kept)})
    return grpo_advantages(scored, scale_by_std=cfg.algo.scale_adv_by_std)


def _train_batch(cfg: Config, adv: AdvantageResult) -> TrainBatch:
    kept = adv.kept
    routes = [t.routed_experts for t in kept] if cfg.learner.routing_replay else None
    if routes is not None and any(r is None for r in routes):
        raise ValueError("learner.routing_replay=true but the rollout recorded no routed experts "
                         "(the rollout backend must record them: rollout.backend=simple)")
    return TrainBatch([t.token_ids for t in kept], [t.loss_mask for t in kept], [t.logprobs for t in kept],
                      adv.advantages, rewards=[t.reward for t in kept], routed_experts=routes,
                      image_patches=[t.image_patches for t in kept])


def _start_ray(cfg: Config) -> None:
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # address None means a new local instance: never attach to a cluster `ray start` left behind
    ray.init(address=cfg.cluster.ray_address or "local", num_cpus=cfg.cluster.num_cpus, include_dashboard=False,
             log_to_driver=True, runtime_env={"env_vars": {"DS_ACCELERATOR": "cpu"}})


def _launch(env_workers: list, groups: list[tuple[Task, str]], group_size: int, step: int) -> tuple[list, list]:
    """Split the groups over env workers and start them: (groups, [(ObjectRef, its groups)])."""
    shares = [groups[i :: len(env_workers)] for i in range(len(env_workers))]
    return groups, [(w.run_groups.remote(share, group_size, step), share) for w, share in zip(env_workers, shares) if share]


def _gather(refs: list, group_size: int) -> list[Trajectory]:
    """Wait for launched groups; a worker that stays dead turns its groups into env_error."""
    trajs: list[Trajectory] = []
    for ref, share in refs:
        try:
            trajs += ray.get(ref)
        except ray.exceptions.RayError as e:
            trajs += [Trajectory([], [], [], [], task.domain, task.id, gid, tier=task.tier,
                                 finish_reason=FinishReason.ENV_ERROR, reward_info={"error": repr(e)[:500]})
                      for task, gid in share for _ in range(group_size)]
    return trajs


def _staleness(t: Trajectory, policy_version: int) -> int:
    """Versions between the policy being trained and the oldest weights that sampled ``t``."""
    versions = [v for v, m in zip(t.policy_version, t.loss_mask) if m]
    return policy_version - min(versions) if versions else 0


def _drop_stale(trajs: list[Trajectory], policy_version: int, max_staleness: int) -> tuple[list[Trajectory], int]:
    """Async mode's bound: trajectories sampled more than ``max_staleness`` versions ago are dropped
    (their groups then have fewer members, or are refilled); returns (kept, number dropped)."""
    kept = [t for t in trajs if _staleness(t, policy_version) <= max_staleness]
    return kept, len(trajs) - len(kept)


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
        n, calls_d = len(ts), sum(t.num_tool_calls for t in ts)
        m[f"{d}/reward"] = sum(t.reward for t in ts) / n
        m[f"{d}/success"] = sum(succeeded(t.reward_info) for t in ts) / n
        m[f"{d}/turns"] = sum(t.num_turns for t in ts) / n
        m[f"{d}/tool_error_rate"] = sum(t.num_tool_errors for t in ts) / max(calls_d, 1)
        m[f"{d}/response_tokens"] = sum(t.num_sampled for t in ts) / n
    for d in {t.domain for t in trajs}:
        m[f"{d}/env_error"] = sum(t.domain == d and t.finish_reason == FinishReason.ENV_ERROR for t in trajs)
    for reason in FinishReason:
        m[f"finish/{reason}"] = sum(t.finish_reason == reason for t in trajs)
    for tier in sorted({t.tier for t in ok}):
        ts = [t for t in ok if t.tier == tier]
        m[f"thinking_tokens/{tier}"] = sum(_thinking_tokens(t) for t in ts) / len(ts)
    for d, share in sampler.realized_mix(groups).items():
        m[f"mix/{d}"] = share  # realized, beside the configured target
    for d, share in sampler.target_mix.items():
        m[f"mix_target/{d}"] = share
    return m


def _thinking_tokens(t: Trajectory) -> int:
    """Sampled reasoning tokens, as the turns counted them (``rl/rollout/turn.generate_turn``)."""
    return t.think_tokens


register_schemas()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(raw: DictConfig) -> None:
    try:
        train(to_config(raw))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
