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

A failed sleep changes nothing: the weights are offloaded first, and if that raises they are moved
back to their device, the runner, pools and scheduler are kept and the engine stays awake (behind the async
front the held requests are admitted again); nothing is recorded before the offload succeeded.

The release is measured, not assumed: ``sleep`` keeps weak references to every tensor the runner's
state holds -- its KV / index / latent pools, the packed and fused weights it derived from the model's
(``_fused``), the rope table, and the decode graphs' static buffers (``DecodeGraphs``): found by walking
the runner's attributes through tuples, lists, dicts and objects of ``jointrl.rl.rollout``, one tensor per
storage, less any storage the model's own parameters or buffers use -- and ``pool_bytes_held`` sums those
still alive (0 once nothing else holds them; ``kv_cache_bytes`` of a sleeping engine). All of it is rebuilt
by ``wake_up`` with the fresh runner. Not measured: a CUDA graph's private memory pool (no tensor names
it; it goes with the graphs, and ``torch.cuda.empty_cache`` returns it to the device). Weight offload is
only exercised on a GPU: on the host the weights' device is the host, so ``offload_weights`` moves
nothing there (``offload_to`` names another target only where a test provokes a failed offload).
"""

from __future__ import annotations

import gc
import itertools
import weakref
from dataclasses import dataclass

import torch

from jointrl.rl.device import HOST

_OURS = __name__.rsplit(".", 1)[0] + "."  # jointrl.rl.rollout.: the runner's own records (DecodeGraphs, buckets)

# ``engine`` below is an ``LLMEngine`` (not imported: the engine imports this module)


@dataclass(frozen=True, slots=True)
class SleepState:
    device: torch.device  # where the weights go back to
    offloaded: bool       # the weights were moved off ``device``
    pool_bytes: int       # bytes of the runner's tensors (pools, derived weights, graph buffers) at the sleep
    pools: tuple          # (weakref to a tensor owning one storage, its storage's bytes), one per storage


def pool_bytes_held(state: SleepState) -> int:
    """Bytes of the released runner tensors still referenced somewhere (0: all of them freed)."""
    return sum(n for ref, n in state.pools if ref() is not None)


def check_awake(engine) -> None:
    if engine._sleep is not None:
        raise RuntimeError("LLMEngine is asleep (colocated mode): call wake_up() before requests or steps")


def runner_tensors(runner) -> tuple[tuple[weakref.ref, int], ...]:
    """(weakref, storage bytes) of each storage the runner's state holds that is not the model's (module
    docstring): its attributes walked through containers and objects of ``jointrl.rl.rollout``; a view
    is traced to its base, whose reference the view keeps alive."""
    weights = {(t.device, t.untyped_storage().data_ptr())
               for t in itertools.chain(runner.model.parameters(), runner.model.buffers())}
    found: dict[tuple, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [v for k, v in vars(runner).items() if k != "model"]
    while stack:
        x = stack.pop()
        if id(x) in seen or type(x) in weakref.ProxyTypes:  # DecodeGraphs holds its runner through a proxy
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            while x._base is not None:
                x = x._base
            key = (x.device, x.untyped_storage().data_ptr())
            if key not in weights and x.untyped_storage().nbytes():
                found.setdefault(key, x)
        elif isinstance(x, (tuple, list, set, frozenset)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif type(x).__module__.startswith(_OURS) and not isinstance(x, torch.nn.Module):
            stack.extend(getattr(x, "__dict__", {}).values())
            stack.extend(getattr(x, n) for n in getattr(type(x), "__slots__", ()) if hasattr(x, n))
    return tuple((weakref.ref(t), t.untyped_storage().nbytes()) for t in found.values())



def sleep(engine, offload_weights: bool = False, offload_to: torch.device | str = HOST) -> None:
    """Release the engine's caches (and its weights to ``offload_to``, the host, with ``offload_weights``).
    On any failure (the offload raising) the engine is left awake and whole, the error re-raised.

    Raises:
        RuntimeError: a request is queued or running, or the engine is already asleep.
    """
    with engine._lock:
        check_awake(engine)
        if engine._inbox or engine.scheduler.has_work():
            raise RuntimeError(f"LLMEngine.sleep with requests in flight ({len(engine._inbox)} queued, "
                               f"{len(engine.scheduler.waiting) + len(engine.scheduler.running)} scheduled)")
        device = next(engine.model.parameters()).device
        if offload_weights:  # first: a failure here leaves the runner, pools and scheduler as they were
            try:
                engine.model.to(offload_to)
            except BaseException:
                engine.model.to(device)  # whatever moved, back
                raise
        pools = runner_tensors(engine.runner)
        engine.runner = engine.block_manager = engine.scheduler = None
        state = SleepState(device, offload_weights, sum(n for _, n in pools), pools)
        if pool_bytes_held(state):  # a reference cycle may still hold them: collect it
            gc.collect()
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
