"""CAD tasks: the shipped set (``data/tasks.jsonl``) and the seeded generator that made it.

A task record (one JSON line) holds ``id``, ``prompt``, ``reference`` (the CadQuery program
whose solid is the target), ``wrong`` (a plausible-but-wrong program, for the policy tests),
and optionally ``tier``, ``max_turns``, ``normalize`` and ``chamfer_tau`` (how
``rewards/cad_geometry.py`` scores it) and ``mode`` (``"image"``: tool results carry rendered
views). ``generate(seed, count)`` draws ``count`` parts,
cycling through the families of ``families.py``; the shipped file is
``python -m jointrl.envs.cad.tasks --seed 0 --count 48 --out envs/cad/data/tasks.jsonl``
(a test checks it still equals the generator's output). A larger training set::

    python -m jointrl.envs.cad.tasks --seed 1 --count 5000 --out /data/cad/tasks.jsonl
    # then envs.domains.cad.task_dir=/data/cad; --families plate-holes ... block disc picks families,
    # the easy ones (families.EASY_FAMILIES) included
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from jointrl.envs.base import Task
from jointrl.envs.cad.families import EASY_FAMILIES, FAMILIES

DATA = Path(__file__).parent / "data"
TASKS_FILE = "tasks.jsonl"
REWARD = {"cad_iou": 0.5, "cad_chamfer": 0.5}
_REQUIRED = ("id", "prompt", "reference")
_OPTIONAL = ("wrong", "tier", "max_turns", "normalize", "chamfer_tau", "mode")


def generate(seed: int, count: int, families=FAMILIES) -> list[dict]:
    """``count`` task records, deterministic in ``seed`` (each from its own ``Random``), cycling through
    ``families`` (default: the shipped ones, ``FAMILIES``)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    records = []
    for i in range(count):
        family = families[i % len(families)]
        part = family(random.Random(f"jointrl-cad-{seed}-{i}"))
        records.append({"id": f"{family.__name__.replace('_', '-')}-s{seed}-{i:04d}", "prompt": part.prompt,
                        "reference": part.reference, "wrong": part.wrong})
    return records


def task_from_record(record: dict, source: str) -> Task:
    if not isinstance(record, dict):
        raise ValueError(f"{source}: a task must be a JSON object, got {type(record).__name__}")
    missing = [k for k in _REQUIRED if not isinstance(record.get(k), str)]
    unknown = sorted(set(record) - set(_REQUIRED) - set(_OPTIONAL))
    if missing or unknown:
        raise ValueError(f"{source}: task {record.get('id')!r} lacks string key(s) {missing} or has unknown "
                         f"key(s) {unknown}; allowed: {list(_REQUIRED + _OPTIONAL)}")
    if record.get("mode", "text") not in ("text", "image"):
        raise ValueError(f"{source}: task {record['id']!r}: mode must be 'text' or 'image', got {record['mode']!r}")
    metadata = {k: record[k] for k in ("reference", "wrong", "normalize", "chamfer_tau", "mode") if k in record}
    return Task(id=record["id"], domain="cad", prompt=record["prompt"], tier=record.get("tier", "low"),
                max_turns=int(record.get("max_turns", 6)), reward=dict(REWARD), metadata=metadata)


def load_tasks(task_dir: Path | None = None) -> list[Task]:
    """The tasks of ``task_dir/tasks.jsonl`` (default: the shipped ones)."""
    path = Path(task_dir or DATA) / TASKS_FILE
    if not path.is_file():
        raise ValueError(f"CAD task file {str(path)!r} does not exist")
    tasks = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from e
            tasks.append(task_from_record(record, f"{path}:{n}"))
    if len({t.id for t in tasks}) != len(tasks):
        raise ValueError(f"{path}: task ids are not unique")
    return tasks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Generate CAD tasks (JSON lines) from a seed.")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    names = {f.__name__.replace("_", "-"): f for f in FAMILIES + EASY_FAMILIES}
    parser.add_argument("--families", nargs="*", choices=sorted(names),
                        help="cycle through these (default: the shipped families; the easy ones are named here)")
    args = parser.parse_args(argv)
    families = tuple(names[n] for n in args.families) if args.families else FAMILIES
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in generate(args.seed, args.count, families)))


if __name__ == "__main__":
    main()
