"""What one Ray actor holds, and the threads it runs with.

Every actor of a run (learner rank, rollout worker, env worker) calls ``claim(role, index)``
once at the start of its ``__init__``. It reads the resources Ray assigned to the actor (its
bundle's, for an actor in a placement group), sets torch's intra-op threads to the CPUs held
(at least 1; a fractional bundle such as the local cluster's ``CPU: 0.25`` gets one thread),
exports ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` with the same count for the processes the
actor starts, prints one line, and returns an ``ActorResources`` record that the driver
gathers into the placement table (``placement_table``).

What it guarantees: torch's thread count equals the CPUs Ray reserved for the actor, so actors
on one node do not oversubscribe it through their thread pools. What it does not: Ray does
not pin a process to particular cores, so threads still float over the node's cores.
GPUs: Ray sets ``CUDA_VISIBLE_DEVICES`` to the actor's GPU ids before the actor starts; the
record reports them as seen from inside the actor. On a machine without CUDA (the CPU tests
with logical GPUs) the variable is set but ``torch.cuda.is_available()`` stays False, and the
actors' tensors stay on CPU.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import ray
import torch


@dataclass(frozen=True)
class ActorResources:
    """One actor's placement, as seen from inside it."""

    role: str  # "learner" | "rollout" | "env"
    index: int
    node_ip: str
    node_id: str
    gpu_ids: tuple[str, ...]  # Ray's GPU ids for this actor
    cuda_visible_devices: str | None  # the process's CUDA_VISIBLE_DEVICES (None: unset)
    cpus: float  # CPUs Ray reserved for the actor (its bundle's)
    threads: int  # torch.get_num_threads() after ``claim``
    pid: int


def threads_for(cpus: float) -> int:
    """Intra-op threads for an actor holding ``cpus`` CPUs: ``floor(cpus)``, at least 1."""
    return max(1, math.floor(cpus + 1e-9))


def claim(role: str, index: int) -> ActorResources:
    """Set this actor's threads from the CPUs Ray assigned it; → its ``ActorResources``. Outside
    a Ray actor (``jointrl serve`` builds a ``RolloutWorker`` in its own process) nothing is set:
    the record reports the process as it is."""
    in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    if not in_actor:
        return ActorResources(role, index, "127.0.0.1", "", (), os.environ.get("CUDA_VISIBLE_DEVICES"),
                              float(os.cpu_count() or 1), torch.get_num_threads(), os.getpid())
    ctx = ray.get_runtime_context()
    cpus = float(ctx.get_assigned_resources().get("CPU", 0.0))
    n = threads_for(cpus)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)
    res = ActorResources(role, index, ray.util.get_node_ip_address(), ctx.get_node_id(),
                         tuple(str(g) for g in ray.get_gpu_ids()), os.environ.get("CUDA_VISIBLE_DEVICES"), cpus,
                         torch.get_num_threads(), os.getpid())
    print(f"{role} {index}: {res.threads} torch threads for {cpus:g} CPUs; GPUs {list(res.gpu_ids)} "
          f"(CUDA_VISIBLE_DEVICES={res.cuda_visible_devices}) on {res.node_ip}", flush=True)
    return res


def placement_table(rows: list[ActorResources]) -> str:
    """The driver's placement table: one line per actor, ``actor  node  GPUs  CPUs  threads``.
    Nodes are named by IP and the first 8 hex digits of Ray's node id (two Ray nodes may share an IP)."""
    head = f"{'actor':<12} {'node':<28} {'GPUs':<10} {'CPUs':>5} {'threads':>7}"
    lines = ["placement:", head]
    for r in rows:
        gpus = ",".join(r.gpu_ids) or "-"
        lines.append(f"{r.role + ' ' + str(r.index):<12} {r.node_ip + ' ' + r.node_id[:8]:<28} {gpus:<10} "
                     f"{r.cpus:>5g} {r.threads:>7}")
    return "\n".join(lines)
