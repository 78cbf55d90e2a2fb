"""The code-repository domain's entry in ``jointrl.envs.registry``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jointrl.envs.base import DatasetSource, Env, Task


def load_tasks(task_dir: Path | None, dataset: DatasetSource | None = None) -> list[Task]:
    """``task_dir``'s (default: the shipped) ``instances.jsonl``, or the records of ``dataset``
    (``code_repo/dataset.py``; bundles in ``task_dir/repos``, default beside the dataset)."""
    from jointrl.envs.code_repo.records import load_tasks as load, to_task

    if dataset is None:
        return load(task_dir)
    from jointrl.envs.code_repo.dataset import read_dataset

    records = read_dataset(dataset.path, task_dir, dataset.split, dataset.columns)
    return sorted((to_task(r) for r in records), key=lambda t: t.id)


def make_env(envs_cfg: Any) -> Env:
    from jointrl.envs.code_repo.env import CodeRepoEnv
    from jointrl.envs.sandbox.settings import sandbox_settings

    return CodeRepoEnv(sandbox_settings(envs_cfg).config,
                       compact=getattr(envs_cfg, "prompt", "full") == "compact")
