"""Train / held-out splits of a domain's tasks: deterministic, and the same on every machine.

A task's split is ``task.metadata["split"]`` when its domain sets one (``"train"`` or
``"heldout"``: a generator that builds its held-out set from held-out seeds says so), else a
stable hash of ``"<domain>/<task id>"``: the first 8 bytes of its SHA-256 as a fraction of
2^64, held out below ``HELDOUT_FRACTION``. The hash depends on nothing but the id, so adding a
task never moves another one across the split, and a run, its resume and its evaluation agree
on which tasks are held out.

``split="all"`` selects every task (``jointrl eval split=all``, or tools that look at the
whole set); training samples ``envs.domains.<d>.split`` (``train`` by default) and
``jointrl eval`` the ``heldout`` split.
"""

from __future__ import annotations

import hashlib

from jointrl.envs.base import Task

SPLITS: tuple[str, ...] = ("train", "heldout", "all")
HELDOUT_FRACTION = 0.25


def task_split(task: Task) -> str:
    """``"train"`` or ``"heldout"``: the task's own ``metadata["split"]``, else its id's hash."""
    own = task.metadata.get("split")
    if own is not None:
        if own not in ("train", "heldout"):
            raise ValueError(f"task {task.id!r} of domain {task.domain!r}: metadata['split'] must be 'train' or "
                             f"'heldout', got {own!r}")
        return own
    digest = hashlib.sha256(f"{task.domain}/{task.id}".encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") / 2**64 < HELDOUT_FRACTION else "train"


def select(tasks: list[Task], split: str) -> list[Task]:
    """The tasks of ``split`` (``train``, ``heldout`` or ``all``), in their given order."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not allowed; allowed values: {list(SPLITS)}")
    return list(tasks) if split == "all" else [t for t in tasks if task_split(t) == split]


def seeded_id(family: str, seed: int) -> str:
    """A procedurally generated task's id: its family and seed (the generators' shared naming)."""
    return f"{family}-s{seed}"


def seeded_ids(domain: str, families, seeds: int, split: str = "all", first_seed: int = 0) -> list[str]:
    """The ids a generator writes for seeds ``first_seed..first_seed+seeds-1`` of ``families`` (only
    ``split``'s), without building anything: a generated task's split follows from its id alone."""
    every = [Task(id=seeded_id(f, s), domain=domain, prompt="") for s in range(first_seed, first_seed + seeds)
             for f in families]
    return [t.id for t in select(every, split)]
