"""The code-repository domain's entry in ``jointrl.envs.registry``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jointrl.envs.base import DatasetSource, Env, Task
from jointrl.envs.code_repo.dataset import read_dataset
from jointrl.envs.code_repo.env import CodeRepoEnv
from jointrl.envs.code_repo.images import missing_images
from jointrl.envs.code_repo.records import load_tasks as load
from jointrl.envs.code_repo.records import to_task
from jointrl.envs.sandbox.settings import sandbox_settings


def load_tasks(task_dir: Path | None, backend: str = "bwrap", dataset: DatasetSource | None = None) -> list[Task]:
    """``task_dir``'s (default: the shipped) ``instances.jsonl``, or the records of ``dataset``
    (``code_repo/dataset.py``; on bwrap the bundles in ``task_dir/repos``, default beside the
    dataset; on docker each record's image, whose absence is reported once, here)."""
    if dataset is None:
        if backend == "docker":
            raise ValueError("code_repo on envs.sandbox.backend=docker runs records that name a Docker image: "
                             "set envs.domains.code_repo.dataset (with image_name, or dataset_image)")
        return load(task_dir)
    records = read_dataset(dataset.path, task_dir, dataset.split, dataset.columns,
                           dataset.image if backend == "docker" else None)
    if backend == "docker":
        by_image: dict[str, list[str]] = {}
        for r in records:
            by_image.setdefault(r.image, []).append(r.instance_id)
        missing_images(by_image)
    return sorted((to_task(r) for r in records), key=lambda t: t.id)


def make_env(envs_cfg: Any) -> Env:
    return CodeRepoEnv(sandbox_settings(envs_cfg).config,
                       compact=getattr(envs_cfg, "prompt", "full") == "compact")
