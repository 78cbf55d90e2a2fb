"""Build office task folders from the generator: ``python -m jointrl.envs.office.build_tasks``.

Writes ``SEEDS`` seeds of every family (``generate.FAMILIES``) to ``envs/office/tasks/`` (or
``--out DIR``; ``--seeds N`` for more, which is the procedural generator's use: the shipped set
is seeds 0..3; ``--split heldout`` renders only the held-out tasks -- by the stable hash of
the id ``<family>-<seed>``, ``envs/splits.py`` -- so ``--seeds 40 --split heldout`` builds 109 held-out
tasks, about 3 s each). Documents are written by ``tool/office_tool.py render`` on the tool venv's
Python (``.ci/setup.d/office.sh``), and workbooks are recalculated by LibreOffice, so they carry
computed values as a spreadsheet program would have saved them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from jointrl.envs.base import Task
from jointrl.envs.office.env import TOOL_DIR, TOOL_VENV
from jointrl.envs.office.generate import EASY_FAMILIES, FAMILIES, generate
from jointrl.envs.office.tasks import DOMAIN, TASKS_DIR
from jointrl.envs.splits import SPLITS, select

SEEDS = 4


def build(out: Path, seeds: int = SEEDS, families: list[str] | None = None, split: str = "all") -> list[str]:
    """Write ``seeds`` tasks of each family (only ``split``'s) under ``out`` (replacing them); returns their ids."""
    ids = []
    for family in families or list(FAMILIES):
        for seed in range(seeds):
            spec = generate(family, seed)
            if not select([Task(id=spec["id"], domain=DOMAIN, prompt="")], split):
                continue
            folder = out / spec["id"]
            shutil.rmtree(folder, ignore_errors=True)
            (folder / "files").mkdir(parents=True)
            task = {k: spec[k] for k in ("prompt", "checks", "policies", "family", "seed", "max_turns")}
            (folder / "task.json").write_text(json.dumps(task, indent=1) + "\n")
            with tempfile.TemporaryDirectory() as home:
                r = subprocess.run(
                    [f"{TOOL_VENV}/bin/python", "-I", str(TOOL_DIR / "office_tool.py"), "render",
                     json.dumps({"dir": str(folder / "files"), "files": spec["files"]})],
                    capture_output=True, text=True, env={"HOME": home, "PATH": "/usr/bin:/bin"}, timeout=600)
            result = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {"ok": False}
            if not result.get("ok"):
                raise RuntimeError(f"rendering {spec['id']} failed: {result.get('error')} {r.stderr[-2000:]}")
            ids.append(spec["id"])
    return ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=TASKS_DIR)
    p.add_argument("--seeds", type=int, default=SEEDS)
    p.add_argument("--families", nargs="*", choices=sorted({**FAMILIES, **EASY_FAMILIES}),
                   help="default: the shipped families (FAMILIES); the easy ones are named here")
    p.add_argument("--split", default="all", choices=SPLITS, help="only this split's tasks (envs/splits.py)")
    a = p.parse_args()
    print(f"{len(build(a.out, a.seeds, a.families, a.split))} tasks in {a.out}")


if __name__ == "__main__":
    main()
