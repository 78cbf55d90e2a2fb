"""Colocated mode: the engine gives its device memory to the learner between rollouts.

``sleep(engine)`` (``LLMEngine.sleep``) waits for the current step, then releases the runner with
its KV and index pools, the block manager and the scheduler: every cached key/value, prefix-cache
block and idle session is dropped (nothing of them is kept: after ``wake_up`` every prompt is
prefilled again). With ``offload_weights`` the weights also move to host memory (vLLM's sleep
level 1 keeps them there; level 2 would drop them). ``wake_up`` moves the weights back to the
device they were on and builds a fresh runner, block manager and scheduler at the engine's
version. A weight push may land while the engine sleeps (``update_weights`` writes into the
weights wherever they are). While asleep, ``step`` and new requests raise ``RuntimeError``.

What is not protected: requests in flight. ``sleep`` refuses (``RuntimeError``) while any request
is queued or running; idle sessions are dropped, so their next turn prefills from scratch. Behind the
async front (``LLMEngine.sleep_when_idle`` / ``wake_up_and_serve``, the Ray rollout worker's) requests
are not refused: new ones are held from the sleep request on, the ones in flight finish first, and the
held ones run after ``wake_up`` on whatever version was pushed meanwhile (vLLM's server does the same).

The release is measured, not assumed: ``sleep`` keeps weak references to the pool tensors and
``pool_bytes_held`` sums those still alive (0 once nothing else holds them; ``kv_cache_bytes`` of a
sleeping engine).
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import torch

from jointrl.rl.device import HOST

# ``engine`` below is an ``LLMEngine`` (not imported: the engine imports this module)


@dataclass(frozen=True, slots=True)
class SleepState:
    device: torch.device  # where the weights go back to
    offloaded: bool       # the weights were moved to the host
    pool_bytes: int       # the runner's tensors' bytes (its KV / index / latent pools) at the sleep
    pools: tuple          # (weakref to a pool tensor, its bytes), one per pool


def pool_bytes_held(state: SleepState) -> int:
    """Bytes of the released pools still referenced somewhere (0: all of them freed)."""
    return sum(n for ref, n in state.pools if ref() is not None)


def check_awake(engine) -> None:
    if engine._sleep is not None:
        raise RuntimeError("LLMEngine is asleep (colocated mode): call wake_up() before requests or steps")


def sleep(engine, offload_weights: bool = False) -> None:
    """Release the engine's caches (and its weights to the host with ``offload_weights``).

    Raises:
        RuntimeError: a request is queued or running, or the engine is already asleep.
    """
    with engine._lock:
        check_awake(engine)
        if engine._inbox or engine.scheduler.has_work():
            raise RuntimeError(f"LLMEngine.sleep with requests in flight ({len(engine._inbox)} queued, "
                               f"{len(engine.scheduler.waiting) + len(engine.scheduler.running)} scheduled)")
        device = next(engine.model.parameters()).device
        runner = engine.runner
        # every tensor the runner holds: its KV / index / latent pools (named by none of their fields, so a
        # pool added to the runner is counted too)
        pools = tuple((weakref.ref(t), t.numel() * t.element_size())
                      for t in vars(runner).values() if isinstance(t, torch.Tensor))
        engine.runner = engine.block_manager = engine.scheduler = runner = None
        state = SleepState(device, offload_weights, sum(n for _, n in pools), pools)
        if pool_bytes_held(state):  # a reference cycle may still hold them: collect it
            gc.collect()
        if offload_weights:
            engine.model.to(HOST)
        engine._sleep = state
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the pool's memory back to the learner, not kept in torch's cache


def wake_up(engine) -> None:
    """Weights back on their device, a fresh runner (KV pool), block manager and scheduler.

    Raises:
        RuntimeError: the engine is awake.
    """
    with engine._lock:
        state = engine._sleep
        if state is None:
            raise RuntimeError("LLMEngine.wake_up: the engine is awake")
        if state.offloaded:
            engine.model.to(state.device)
        engine._build_caches()
        engine._sleep = None
