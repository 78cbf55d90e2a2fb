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

**Held-out families** (``envs.domains.<d>.heldout_families``): whole task families kept out of
training, to measure generalization to kinds of task never seen, beside new seeds of trained
ones. A task's family is :func:`family_of` it. With held-out families, ``train`` and ``heldout``
hold only the other families' tasks (split by the hash as above) and ``unseen`` every task of the
held-out families, whichever side of the hash it falls on (none was ever trained on); ``all`` is
everything. Training (``JointSampler``) never samples a held-out family, whatever its split says.
"""

from __future__ import annotations

import hashlib
import re

from jointrl.envs.base import Task

SPLITS: tuple[str, ...] = ("train", "heldout", "unseen", "all")
HELDOUT_FRACTION = 0.25
_SEEDED = re.compile(r"^(?P<family>.+?)-s?\d+(?:-\d+)?$")  # family-s3, family-3, family-s0-0012


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


def family_of(task: Task) -> str:
    """The task's family: ``metadata["family"]`` (office, generated tasks), else ``metadata["kind"]``
    (browser), else its id without the seed suffix (``count-matches-s5``, ``intervals-1``,
    ``plate-holes-s0-0012``), else its id (a hand-written task is a family of one).

    >>> [family_of(Task(id=i, domain="d", prompt="")) for i in ("count-matches-s5", "intervals-1", "plate-holes-s0-0012", "base64-decode")]
    ['count-matches', 'intervals', 'plate-holes', 'base64-decode']
    """
    own = task.metadata.get("family") or task.metadata.get("kind")
    if isinstance(own, str) and own:
        return own
    m = _SEEDED.match(task.id)
    return m["family"] if m else task.id


def families(tasks: list[Task]) -> list[str]:
    """The families present in ``tasks``, sorted."""
    return sorted({family_of(t) for t in tasks})


def check_families(tasks: list[Task], heldout_families, domain: str) -> None:
    """``ValueError`` naming a held-out family that none of ``tasks`` belongs to (a typo would
    otherwise hold out nothing), or every family held out (nothing left to train on)."""
    present = families(tasks)
    unknown = sorted(set(heldout_families) - set(present))
    if unknown:
        raise ValueError(f"heldout_families names {unknown}, not a family of domain {domain!r}'s tasks "
                         f"(its families: {present})")
    if present and set(present) <= set(heldout_families):
        raise ValueError(f"heldout_families holds out every family of domain {domain!r}: nothing left to train on")


def select(tasks: list[Task], split: str, heldout_families=()) -> list[Task]:
    """The tasks of ``split`` (``train``, ``heldout``, ``unseen`` or ``all``), in their given order;
    ``heldout_families``: the families that only ``unseen`` (and ``all``) holds."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not allowed; allowed values: {list(SPLITS)}")
    if split == "all":
        return list(tasks)
    held = frozenset(heldout_families)
    if split == "unseen":
        return [t for t in tasks if family_of(t) in held]
    return [t for t in tasks if task_split(t) == split and family_of(t) not in held]


def seeded_id(family: str, seed: int) -> str:
    """A procedurally generated task's id: its family and seed (the generators' shared naming)."""
    return f"{family}-s{seed}"


def seeded_ids(domain: str, families, seeds: int, split: str = "all", first_seed: int = 0) -> list[str]:
    """The ids a generator writes for seeds ``first_seed..first_seed+seeds-1`` of ``families`` (only
    ``split``'s), without building anything: a generated task's split follows from its id alone."""
    every = [Task(id=seeded_id(f, s), domain=domain, prompt="") for s in range(first_seed, first_seed + seeds)
             for f in families]
    return [t.id for t in select(every, split)]
