"""``EnvWorker``: a Ray actor that runs many episodes concurrently, one asyncio task each.

It owns no model: every turn goes to a rollout worker through ``RoutedEngineClient`` (the
least-loaded worker for an episode's first turn, the same one after; ``rl/rollout/router.py``). Episodes
are scored here (reward modules run beside the sandbox they verify). Infrastructure
failures are retried on a fresh env (``run_episode_with_retries``); the actor itself is
restarted by Ray if it dies (``max_restarts``), and the driver marks what it still cannot
finish ``env_error``.
"""

from __future__ import annotations

import asyncio
import os

import ray

from jointrl.envs.base import Task
from jointrl.envs.registry import make_env
from jointrl.model.chat_template import ChatTemplate
from jointrl.model.hf_chat_template import HFChatTemplate
from jointrl.rl.actor_resources import ActorResources, claim
from jointrl.rl.build import build_template
from jointrl.rl.agent_loop import AgentConfig, run_episode_with_retries
from jointrl.rl.image_inputs import ImageInputs
from jointrl.rl.config import Config
from jointrl.rl.placement import Placement
from jointrl.rl.rollout.router import RoutedEngineClient
from jointrl.rl.types import SamplingParams, Trajectory


def sampling_params(cfg: Config, seed: int | None) -> SamplingParams:
    rc = cfg.rollout
    return SamplingParams(max_tokens=rc.max_tokens_per_turn, temperature=rc.temperature, top_p=rc.top_p,
                          top_k=rc.top_k, seed=seed)


def episode_setup(cfg: Config) -> tuple[ChatTemplate | HFChatTemplate, AgentConfig]:
    """The chat template and agent-loop settings of a run's episodes (training and eval alike).
    A model with image input (``model.image_patch_dim`` > 0) gets image-mode observations'
    screenshots as patches in its ``<image>`` slots (``rl/image_inputs.py``). Each episode's
    thinking budget is its task tier's ``rollout.thinking_budget`` (the agent loop enforces it)."""
    images = ImageInputs.for_patch_dim(cfg.model.image_patch_dim)
    template = build_template(cfg, image_tokens=images.num_tokens if images else 0)
    return template, AgentConfig(max_context=cfg.rollout.max_context, episode_timeout_s=cfg.envs.episode_timeout_s,
                                 max_env_retries=cfg.envs.max_env_retries, images=images,
                                 thinking_budget=dict(cfg.rollout.thinking_budget))


class EnvWorker:
    def __init__(self, cfg: Config, rollout_handles: list, router, index: int = 0) -> None:
        self._resources = claim("env", index)  # torch threads = the CPUs it holds (reward modules may use torch)
        self.cfg = cfg
        self.rollout_handles, self.router = rollout_handles, router
        self.template, self.agent_cfg = episode_setup(cfg)
        self.limit = asyncio.Semaphore(cfg.envs.max_concurrent_episodes)

    async def run_groups(self, groups: list[tuple[Task, str]], group_size: int, step: int) -> list[Trajectory]:
        """``group_size`` episodes of each task; trajectories in group order."""
        jobs = [self._one(task, gid, i, step * 1_000_003 + g * 1_009 + i)
                for g, (task, gid) in enumerate(groups) for i in range(group_size)]
        return list(await asyncio.gather(*jobs))

    async def _one(self, task: Task, group_id: str, member: int, seed: int) -> Trajectory:
        async with self.limit:
            engine = RoutedEngineClient(self.rollout_handles, self.router, session=f"{group_id}#{member}")
            params = sampling_params(self.cfg, seed + self.cfg.seed)
            make = lambda: make_env(task.domain, self.cfg.envs)  # noqa: E731
            try:
                return await run_episode_with_retries(make, engine, task, self.template, params, self.agent_cfg, group_id)
            finally:
                await engine.close()

    def pid(self) -> int:
        return os.getpid()

    def resources(self) -> ActorResources:
        return self._resources


def spawn_env_workers(cfg: Config, rollout_handles: list, router, placement: Placement | None = None) -> list:
    """``cfg.envs.num_workers`` env-worker actors placed by ``placement.env_worker(i)`` (CPU only:
    on the CPU-only nodes where the cluster has them, else spread over all). A dead actor is
    restarted and its in-flight ``run_groups`` call retried by Ray (twice); after that the
    driver marks those episodes ``env_error``."""
    actor = ray.remote(max_restarts=2, max_task_retries=2, max_concurrency=1000)(EnvWorker)
    options = placement.env_worker if placement is not None else lambda i: Placement.spread(0)
    return [actor.options(**options(i)).remote(cfg, rollout_handles, router, i) for i in range(cfg.envs.num_workers)]
