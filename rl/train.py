"""The driver: ``python -m jointrl.rl.train [hydra overrides]`` (or ``jointrl train ...``).

One linear loop, as in docs/architecture.md:

    sample tasks -> rollouts (+ rewards, in the env workers) -> advantages -> learner step
    -> weight push -> log -> checkpoint

The advantage estimator is chosen once from ``algo.name`` (``rl/advantages.build_estimator``).
Group-relative: groups whose rewards all agree carry no signal and are dropped; the step then
samples fresh groups (up to ``algo.max_refill_attempts`` rounds) until it has
``algo.prompts_per_step`` informative ones (DAPO's dynamic sampling). GAE (PPO) keeps every
scored trajectory.

Synchronous by default: each stage waits for the previous one; ``rollout.mode=async`` starts the
next ``rollout.async_steps_ahead`` steps' rollouts before the learner step. ``resume=true``
continues from the latest checkpoint in ``<output_dir>/checkpoints`` at the step after it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import hydra
import ray
from omegaconf import DictConfig, OmegaConf

from jointrl.envs.sandbox.userns import preflight
from jointrl.rl.actor_resources import placement_table
from jointrl.rl.advantages import AdvantageResult, GAE, GroupRelative, build_estimator
from jointrl.rl.config import Algorithm, Config, RolloutBackend, RolloutMode, register_schemas, to_config
from jointrl.rl.env_worker import spawn_env_workers
from jointrl.rl.joint_sampler import JointSampler
from jointrl.rl.learner.batch import TrainBatch
from jointrl.rl.learner.group import LearnerGroup
from jointrl.rl.metrics import StepRecord, staleness, step_metrics
from jointrl.rl.placement import Placement
from jointrl.rl.preemption import REQUEUE_EXIT_CODE, PreemptionFlag
from jointrl.rl.rollout.router import spawn_router
from jointrl.rl.rollout.worker import RolloutWorker
from jointrl.rl.tracking import RunTracker
from jointrl.rl.types import FinishReason, Task, Trajectory
from jointrl.rl.weight_transport import WeightPush


def train(cfg: Config) -> dict[str, float]:
    """Run ``cfg.algo.total_steps`` steps of the loop (module docstring); returns the last step's metrics."""
    if cfg.algo.name is Algorithm.sft:
        raise ValueError("algo.name=sft trains on oracle transcripts, not on rollouts: run `jointrl sft [overrides]`")
    if (why := preflight(cfg.envs.sandbox)) is not None:  # issue 33: one line before Ray, not a stream of env_errors
        raise SystemExit(why)
    out_dir = Path(cfg.output_dir).resolve()
    ckpt_dir = out_dir / "checkpoints"
    out_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), out_dir / "config.yaml")  # the resolved config (jointrl export reads it)
    _start_ray(cfg)
    placement = Placement(cfg)
    learner = LearnerGroup(cfg, [placement.learner(r) for r in range(cfg.learner.num_ranks)])
    # a rollout worker that dies is restarted by Ray; the router re-admits it once it holds the pushed weights
    rollout = [ray.remote(max_concurrency=1000, max_restarts=-1)(RolloutWorker).options(**placement.rollout(i))
               .remote(cfg, i) for i in range(cfg.rollout.num_workers)]
    router = spawn_router(len(rollout))
    sampler = JointSampler.from_config(cfg.envs.domains, cfg.seed, cfg.envs.sandbox.backend)
    rollouts = Rollouts(cfg, sampler, spawn_env_workers(cfg, rollout, router, placement))
    placed = ray.get([w.resources.remote() for w in (*learner.workers, *rollout, *rollouts.env_workers)])
    print(placement_table(placed), flush=True)
    pids = {role: [r.pid for r in placed if r.role == role] for role in ("learner", "rollout", "env")}
    print(f"processes: learner ranks {pids['learner']} rollout workers {pids['rollout']} env workers {pids['env']}",
          flush=True)
    start = _resume(cfg, learner, ckpt_dir)
    push = WeightPush(cfg.rollout.weight_transport, learner.senders, rollout, cfg.rollout.weight_dist_backend)
    push(start)
    # colocated, the rollout engine (own or vLLM) sleeps through each learner step and push: its device memory
    # is the learner's meanwhile (the simple sampler holds no KV pool: it stays as it is)
    sleeps = cfg.cluster.colocate and cfg.rollout.backend is not RolloutBackend.simple
    tracker, preempt = RunTracker(cfg, out_dir), PreemptionFlag().install()
    metrics: dict[str, float] = {}
    for step in range(start + 1, cfg.algo.total_steps + 1):
        t0 = time.perf_counter()
        rec = rollouts.collect(step)  # sample tasks -> rollouts (+ rewards) -> advantages, dropped groups refilled
        rollouts.launch_ahead(step)  # rollout.mode=async: the next steps' rollouts run during the learner step
        t1 = time.perf_counter()
        slept = _call_live(rollout, "sleep") if sleeps else 0.0
        if len(rec.adv.kept) >= cfg.learner.num_ranks:
            rec.learner = learner.train_step(train_batch(rec.adv, cfg.learner.routing_replay))
            check_mismatch(step, rec.learner, cfg.rollout.max_mismatch_kl)
        t2 = time.perf_counter()
        rec.push, rec.push_retries = push(step), push.retries
        t3 = time.perf_counter()
        woke = _call_live(rollout, "wake_up") if sleeps else 0.0
        router.revive.remote(push.live)
        rec.times = {"rollout": t1 - t0, "learner": t2 - t1 - slept, "push": t3 - t2,
                     **({"rollout_sleep": slept, "rollout_wake": woke} if sleeps else {})}
        rec.routing = ray.get(router.stats.remote())
        metrics, histograms = step_metrics(rec, rollouts.sampler.realized_mix(rec.groups), rollouts.sampler.target_mix)
        tracker.log(step, metrics, rec.trajs, histograms=histograms)
        stop = preempt.requested  # read once: a signal after this stops the run after the next step
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.algo.total_steps or stop:
            # written in the background (the driver exits only once it is committed: wait, shutdown)
            learner.save_checkpoint(str(ckpt_dir), step, wait=stop)
            print(f"checkpoint step {step} -> {ckpt_dir}", flush=True)
        if stop and step < cfg.algo.total_steps:
            print(f"{preempt.signal_name}: stopping after step {step} for requeue", flush=True)
            tracker.finish()
            raise SystemExit(REQUEUE_EXIT_CODE)
    tracker.finish()
    ray.get([w.close.remote() for w in rollout])
    learner.shutdown()
    return metrics


def _call_live(workers: list, method: str) -> float:
    """``method`` on every rollout worker, waited for; a dead one is skipped (Ray restarts it, awake).
    → the seconds it took."""
    t0 = time.perf_counter()
    for ref in [getattr(w, method).remote() for w in workers]:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            pass
    return time.perf_counter() - t0


class Rollouts:
    """A step's trajectories and advantages: sample tasks, play them on the env workers (which also
    score them), drop stale ones, estimate advantages, refill dropped groups."""

    def __init__(self, cfg: Config, sampler: JointSampler, env_workers: list) -> None:
        a = cfg.algo
        self.sampler, self.env_workers = sampler, env_workers
        self.estimator: GroupRelative | GAE = build_estimator(a)
        self.prompts, self.group_size, self.total_steps = a.prompts_per_step, a.group_size, a.total_steps
        self.refills = a.max_refill_attempts if self.estimator.refills else 0
        self.max_staleness = cfg.rollout.max_staleness
        self.steps_ahead = cfg.rollout.async_steps_ahead if cfg.rollout.mode is RolloutMode("async") else 0
        self.ahead: dict[int, tuple[list, list]] = {}  # step -> (groups, rollouts in flight)

    def collect(self, step: int) -> StepRecord:
        groups, refs = self.ahead.pop(step, None) or self._launch(self.sampler.sample(step, self.prompts), step)
        trajs, stale = _drop_stale(_gather(refs, self.group_size), step - 1, self.max_staleness)
        if trajs and all(t.finish_reason == FinishReason.ENV_ERROR for t in trajs):  # stop, not skip steps forever
            raise SystemExit(f"step {step}: all {len(trajs)} episodes ended in env_error, so no learner step can run "
                             f"(first error: {str(trajs[0].reward_info.get('error'))[:300]})")
        adv = self.estimator.select(trajs)
        for attempt in range(1, self.refills + 1):
            missing = self.prompts - len({t.group_id for t in adv.kept})
            if missing <= 0:
                break
            more = self.sampler.sample(step, missing, attempt)
            groups += more
            trajs += _gather(self._launch(more, step)[1], self.group_size)
            adv = self.estimator.select(trajs)
        adv.stats["refill_groups"] = len(groups) - self.prompts
        return StepRecord(step, groups, trajs, adv, stale, times={})

    def launch_ahead(self, step: int) -> None:
        """Start the rollouts of steps ``step + 1 .. step + steps_ahead`` not yet in flight (none in sync mode)."""
        for nxt in range(step + 1, min(step + self.steps_ahead, self.total_steps) + 1):
            if nxt not in self.ahead:
                self.ahead[nxt] = self._launch(self.sampler.sample(nxt, self.prompts), nxt)

    def _launch(self, groups: list[tuple[Task, str]], step: int) -> tuple[list, list]:
        """Split the groups over env workers and start them: (groups, [(ObjectRef, its groups)])."""
        n = len(self.env_workers)
        shares = [groups[i::n] for i in range(n)]
        return groups, [(w.run_groups.remote(share, self.group_size, step), share)
                        for w, share in zip(self.env_workers, shares) if share]


def train_batch(adv: AdvantageResult, routing_replay: bool) -> TrainBatch:
    kept = adv.kept
    routes = [t.routed_experts for t in kept] if routing_replay else None
    if routes is not None and any(r is None for r in routes):
        raise ValueError("learner.routing_replay=true but the rollout recorded no routed experts "
                         "(the rollout backend must record them: rollout.backend=engine or simple, not vllm)")
    return TrainBatch([t.token_ids for t in kept], [t.loss_mask for t in kept], [t.logprobs for t in kept],
                      adv.advantages, rewards=[t.reward for t in kept], routed_experts=routes,
                      image_patches=[t.image_patches for t in kept])


def check_mismatch(step: int, learner_metrics: dict[str, float], limit: float | None) -> None:
    """Print the step's learner-vs-rollout mismatch KL (k3 over its loss tokens, the learner's log-probs
    before the update against the engine's); above ``rollout.max_mismatch_kl`` stop the run before
    this update is pushed or checkpointed: the rollout sampled from another policy than the learner's."""
    kl = learner_metrics.get("mismatch/kl_k3")
    if kl is None:
        return
    print(f"step {step}: mismatch KL(rollout || learner) k3 {kl:.3e}, k1 {learner_metrics.get('mismatch/kl_k1', 0.0):+.3e}",
          flush=True)
    if limit is not None and kl > limit:
        raise SystemExit(f"step {step}: the learner-vs-rollout mismatch KL {kl:.4g} exceeds rollout.max_mismatch_kl="
                         f"{limit:g}: the rollout engine is not sampling from the learner's policy (stale or wrongly "
                         "loaded weights, another dtype or kernel); stopping before this update is pushed or saved")


def _resume(cfg: Config, learner: LearnerGroup, ckpt_dir: Path) -> int:
    """``resume=true``: load the latest checkpoint → the step it was saved at (0 without one, or without resume)."""
    if not cfg.resume:
        return 0
    start = learner.load_checkpoint(str(ckpt_dir)) or 0
    print(f"resuming after step {start} from {ckpt_dir}" if start else f"no checkpoint in {ckpt_dir}; starting fresh",
          flush=True)
    return start


def _start_ray(cfg: Config) -> None:
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # address None means a new local instance: never attach to a cluster `ray start` left behind
    # no accelerator forced here: each learner rank picks DeepSpeed's from its own device (rl/device.py)
    ray.init(address=cfg.cluster.ray_address or "local", num_cpus=cfg.cluster.num_cpus, include_dashboard=False,
             log_to_driver=True)


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


def _drop_stale(trajs: list[Trajectory], policy_version: int, max_staleness: int) -> tuple[list[Trajectory], int]:
    """Async mode's bound: trajectories sampled more than ``max_staleness`` versions ago are dropped
    (their groups then have fewer members, or are refilled); returns (kept, number dropped)."""
    kept = [t for t in trajs if staleness(t, policy_version) <= max_staleness]
    return kept, len(trajs) - len(kept)


register_schemas()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(raw: DictConfig) -> None:
    try:
        train(to_config(raw))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
