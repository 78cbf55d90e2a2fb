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
is queued or running; idle sessions are dropped, so their next turn prefills from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jointrl.rl.device import HOST

# ``engine`` below is an ``LLMEngine`` (not imported: the engine imports this module)


@dataclass(frozen=True, slots=True)
class SleepState:
    device: torch.device  # where the weights go back to
    offloaded: bool       # the weights were moved to the host


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
        engine.runner = engine.block_manager = engine.scheduler = None
        if offload_weights:
            engine.model.to(HOST)
        engine._sleep = SleepState(device, offload_weights)
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
