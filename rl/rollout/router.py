"""Routing episodes over several rollout workers: least-loaded first, sticky after, re-run on death.

``RolloutRouter`` (one Ray actor per run, shared by every env worker) tracks, per rollout
worker, the episodes ("sessions") it is serving. A new session goes to the live worker with
the fewest (lowest index on ties); every later turn of the session goes to the same worker, so
its KV cache and prefix cache are reused. ``RoutedEngineClient`` is the env worker's side: one
per episode, it asks the router once, then calls that worker directly.

A worker that dies (``RayActorError`` on a call) is marked dead; the client raises ``EnvError``,
so ``run_episode_with_retries`` re-runs the episode from its start on a fresh env -- and the
retry's first turn is routed to a live worker. A partial trajectory is never continued on
another worker: its tokens, log-probs and versions come from one engine. The driver revives
workers after they accepted a weight push (a restarted actor holds the initial weights until
then). Counts: ``stats()``.
"""

from __future__ import annotations

from typing import Any

import ray

from jointrl.envs.base import EnvError
from jointrl.rl.types import GenerationOutput, SamplingParams


class RolloutRouter:
    def __init__(self, num_workers: int) -> None:
        self.load = [0] * num_workers
        self.sessions: dict[str, int] = {}
        self.dead: set[int] = set()
        self.counts = {"sessions": 0, "rerouted": 0, "worker_deaths": 0}

    def acquire(self, session: str) -> int:
        """The worker serving ``session``: its own if it has one, else the least-loaded live one."""
        if session in self.sessions:
            return self.sessions[session]
        live = [i for i in range(len(self.load)) if i not in self.dead]
        if not live:
            raise EnvError("no live rollout worker")
        i = min(live, key=lambda j: (self.load[j], j))
        self.sessions[session] = i
        self.load[i] += 1
        self.counts["sessions"] += 1
        return i

    def release(self, session: str) -> None:
        i = self.sessions.pop(session, None)
        if i is not None:
            self.load[i] -= 1

    def mark_dead(self, index: int) -> None:
        """Worker ``index`` failed a call: no new sessions go there; its sessions are dropped (their
        episodes re-run and acquire again)."""
        if index not in self.dead:
            self.dead.add(index)
            self.counts["worker_deaths"] += 1
        lost = [s for s, i in self.sessions.items() if i == index]
        for s in lost:
            self.release(s)
        self.counts["rerouted"] += len(lost)

    def revive(self, indices: list[int]) -> None:
        self.dead -= set(indices)

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "load": list(self.load), "dead": sorted(self.dead)}


def spawn_router(num_workers: int):
    return ray.remote(num_cpus=0, max_restarts=-1)(RolloutRouter).remote(num_workers)


class RoutedEngineClient:
    """``RolloutEngine.generate`` for one episode, through the router (``session`` names it)."""

    def __init__(self, handles: list, router, session: str) -> None:
        self.handles, self.router, self.session = handles, router, session
        self.index: int | None = None

    async def generate(self, prompt_ids: list[int], params: SamplingParams, image_patches=None) -> GenerationOutput:
        if self.index is None:
            self.index = await self.router.acquire.remote(self.session)
        index = self.index
        try:
            return await self.handles[index].generate.remote(prompt_ids, params, image_patches)
        except ray.exceptions.RayActorError as e:
            self.index = None
            await self.router.mark_dead.remote(index)
            raise EnvError(f"rollout worker {index} died mid-episode; the episode re-runs elsewhere: {e!r}"[:500]) from e

    async def close(self) -> None:
        if self.index is not None:
            await self.router.release.remote(self.session)
            self.index = None
