"""More browser tasks than the shipped seeds: a task folder naming ``(kind, seed)`` pairs.

    python -m jointrl.envs.browser.generate --out DIR --seeds 30 [--split heldout]
    # then envs.domains.browser.task_dir=DIR

Browser tasks are generated at load time (``tasks.make_task(kind, seed)``: the seed makes the
world, about 1 ms a task), so a task folder is one file, ``tasks.jsonl``, one ``{"kind", "seed"}``
per line. ``--seeds N`` writes every kind for seeds ``0..N-1`` (only ``--split``'s, by the
stable hash of the task id ``<kind>-<seed>``, ``envs/splits.py``): 30 seeds hold
``heldout_count(30)`` = 114 held-out tasks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jointrl.envs.base import Task
from jointrl.envs.browser.tasks import KINDS, make_task
from jointrl.envs.splits import SPLITS, select

TASKS_FILE = "tasks.jsonl"


def tasks(seeds: int, split: str = "all") -> list[Task]:
    """Every kind for seeds ``0..seeds-1``, only ``split``'s, sorted by id."""
    return sorted(select([make_task(k, s) for s in range(seeds) for k in KINDS], split), key=lambda t: t.id)


def heldout_count(seeds: int) -> int:
    return len(tasks(seeds, "heldout"))


def write(out: Path, seeds: int, split: str = "all") -> list[Task]:
    """Write ``out/tasks.jsonl`` naming ``tasks(seeds, split)``; returns them."""
    chosen = tasks(seeds, split)
    out.mkdir(parents=True, exist_ok=True)
    (out / TASKS_FILE).write_text("".join(json.dumps({"kind": t.metadata["kind"], "seed": t.metadata["seed"]}) + "\n"
                                          for t in chosen))
    return chosen


def load(task_dir: Path) -> list[Task]:
    """The tasks ``task_dir/tasks.jsonl`` names, sorted by id. Raises ``ValueError`` naming a bad line."""
    path = Path(task_dir) / TASKS_FILE
    if not path.is_file():
        raise ValueError(f"browser task folder {str(task_dir)!r} has no {TASKS_FILE} "
                         "(python -m jointrl.envs.browser.generate --out DIR --seeds N writes one)")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            kind, seed = rec["kind"], rec["seed"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: needs a JSON object with 'kind' and 'seed' ({e})") from e
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"{path}:{n}: seed must be an integer, got {seed!r}")
        out.append(make_task(kind, seed))
    if len({t.id for t in out}) != len(out):
        raise ValueError(f"{path}: tasks are named twice")
    return sorted(out, key=lambda t: t.id)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write a browser task folder (kind, seed pairs).")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, required=True, help="seeds 0..N-1 of every kind")
    p.add_argument("--split", default="all", choices=SPLITS, help="only this split's tasks (envs/splits.py)")
    a = p.parse_args(argv)
    print(f"{len(write(a.out, a.seeds, a.split))} tasks in {a.out}")


if __name__ == "__main__":
    main()
