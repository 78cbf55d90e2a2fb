"""Domains by name: how to load a domain's tasks and open one episode's env.

Each domain is a package under ``envs/`` that exposes two functions, and one line in
``DOMAINS`` below names it:

- ``load_tasks(task_dir: pathlib.Path | None) -> list[Task]``: the shipped tasks, or those under ``task_dir``
  (a domain in ``sandbox.settings.DOCKER_DOMAINS`` also takes the backend: it leaves out what cannot run there);
- ``make_env(envs_cfg) -> Env``: a fresh env for one episode (``envs_cfg`` is
  ``jointrl.rl.config.EnvsConfig``, duck-typed: envs may not import rl).

A domain in ``DATASET_DOMAINS`` also loads its records from a Hugging Face ``datasets`` file or
directory (``envs.domains.<d>.dataset``, as a :class:`DatasetSource`): its ``load_tasks`` takes
``dataset=``.

Modules are imported on first use, so a domain's optional dependencies cost nothing to the others.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from jointrl.envs.base import DatasetSource, Env, Task, ToolCall
from jointrl.envs.sandbox.settings import DOCKER_DOMAINS, check_backend
from jointrl.envs.splits import check_families, select

# domain name -> module exposing load_tasks / make_env
DOMAINS: dict[str, str] = {
    "terminal": "jointrl.envs.terminal.domain",
    "code_repo": "jointrl.envs.code_repo.domain",
    "cad": "jointrl.envs.cad.domain",
    "office": "jointrl.envs.office.domain",
    "browser": "jointrl.envs.browser.domain",
}

# domains whose records may come from a datasets file or directory (envs.domains.<d>.dataset)
DATASET_DOMAINS = ("code_repo",)


def dataset_source(domain_cfg: Any) -> DatasetSource | None:
    """``envs.domains.<d>``'s dataset (``rl.config.DomainConfig``, duck-typed), or None."""
    path = getattr(domain_cfg, "dataset", None)
    if not path:
        return None
    return DatasetSource(str(path), str(domain_cfg.dataset_split), dict(domain_cfg.dataset_columns),
                         str(domain_cfg.dataset_image or ""))


# domain name -> "module:function(task, name)" giving a task's named scripted policy as turns of tool
# calls (``oracle`` solves the task; ``noop``, ``wrong`` do not): demonstrations for ``jointrl sft``
POLICIES: dict[str, str] = {
    "terminal": "jointrl.envs.terminal.policies:load_policy",
    "code_repo": "jointrl.envs.code_repo.policies:load_policy",
    "cad": "jointrl.envs.cad.policies:load_policy",
    "office": "jointrl.envs.office.tasks:load_policy",
    "browser": "jointrl.envs.browser.tasks:policy",
}


def _module(domain: str) -> Any:
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; available: {list(DOMAINS)}")
    return importlib.import_module(DOMAINS[domain])


def load_tasks(domain: str, task_dir: str | None = None, split: str = "all", backend: str = "bwrap",
               dataset: DatasetSource | None = None, heldout_families=()) -> list[Task]:
    """The domain's shipped tasks, or those under ``task_dir`` or in ``dataset``, that run on
    ``backend`` (``envs.sandbox.backend``); only ``split``'s (``train`` | ``heldout`` | ``unseen`` |
    ``all``, ``jointrl.envs.splits``, with ``heldout_families`` kept out of train / heldout). An
    empty split, or a held-out family the tasks do not have, is an error."""
    check_backend(domain, backend)
    path = Path(task_dir) if task_dir else None
    kwargs: dict[str, Any] = {"backend": backend} if domain in DOCKER_DOMAINS else {}
    if dataset is not None:
        if domain not in DATASET_DOMAINS:
            raise ValueError(f"domain {domain!r} does not load datasets (dataset={dataset.path!r}); "
                             f"those that do: {list(DATASET_DOMAINS)}")
        kwargs["dataset"] = dataset
    tasks = _module(domain).load_tasks(path, **kwargs)
    if heldout_families:
        check_families(tasks, heldout_families, domain)
    chosen = select(tasks, split, heldout_families)
    if tasks and not chosen:
        raise ValueError(f"domain {domain!r}: its {split!r} split is empty (all {len(tasks)} tasks are in the other "
                         f"split); set envs.domains.{domain}.split=all to use them")
    return chosen


def scripted_policy(task: Task, name: str) -> list[list[ToolCall]]:
    """``task``'s scripted policy ``name`` (e.g. ``oracle``), one list of tool calls per turn."""
    if task.domain not in POLICIES:
        raise ValueError(f"domain {task.domain!r} ships no scripted policies; those that do: {list(POLICIES)}")
    module, fn = POLICIES[task.domain].split(":")
    return getattr(importlib.import_module(module), fn)(task, name)


def make_env(domain: str, envs_cfg: Any) -> Env:
    """A fresh env for one episode."""
    return _module(domain).make_env(envs_cfg)
