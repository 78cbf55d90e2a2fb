"""Checks a ``jointrl`` command's configuration before anything heavy starts (Ray, a model).

``jointrl <command> key=value ...`` (``rl/cli.py``) runs :func:`guard` first: it composes the
config as the command will (``load_config``: unknown keys, wrong types, values out of range),
loads every configured domain's tasks as the command will (a missing ``task_dir``, a malformed
``task.toml``, a folder whose tasks all need Docker on the bwrap backend, a dataset record
missing a field), reads ``recipe.sft_data``'s transcripts when set, checks that a
``checkpoint=`` path exists, that ``rollout.backend=vllm`` has a checkpoint to load and is not asked for
``learner.routing_replay`` (vLLM's CPU build cannot record routes), that its venv's vLLM has sleep mode when
``cluster.colocate=true`` asks it to sleep through the learner steps (the venv is asked) and, for
``envs.sandbox.backend=docker``, that a daemon answers and
every domain can run there. The first problem is printed as one line, ``jointrl: error: ...``,
and the process exits with status 2 -- no traceback, unless ``--debug`` is given or
``HYDRA_FULL_ERROR=1`` is set (then the exception propagates). The checks are the same the
command makes later; they only move the failure before Ray's start (~20 s) and its traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

EXIT_USAGE = 2
CHECKED = ("train", "sft", "recipe", "eval", "serve")  # commands whose config is composed from conf/
EVAL_ARGS = ("tier", "k", "split", "unseen", "limit", "out", "policy")  # jointrl eval's own keys, not config ones


def check(overrides: list[str], split: str | None = None) -> None:
    """Compose the config with ``overrides`` and check it; raises on the first problem.

    ``split``: the split every domain is read at (``jointrl eval``'s); None: each domain's own.
    """
    # lazy: rl/cli.py imports this module for every command, and the config pulls in torch
    from jointrl.envs.registry import dataset_source, load_tasks
    from jointrl.rl.config import load_config  # lazy: as above

    cfg = load_config(overrides)
    if str(cfg.rollout.backend) == "vllm" and cfg.model.path is None:
        raise ValueError("rollout.backend=vllm needs a Hugging Face checkpoint for vLLM to load: model=hf model.path=<dir>")
    if str(cfg.rollout.backend) == "vllm" and cfg.learner.routing_replay:
        from jointrl.rl.rollout.vllm.engine import ROUTES_UNSUPPORTED  # lazy: as above

        raise ValueError(f"learner.routing_replay=true with rollout.backend=vllm: {ROUTES_UNSUPPORTED}; "
                         "use rollout.backend=engine for routing replay")
    if str(cfg.rollout.backend) == "vllm" and cfg.cluster.colocate:
        from jointrl.rl.rollout.vllm.engine import sleep_mode_unavailable  # lazy: as above

        if (why := sleep_mode_unavailable(cfg.rollout.vllm.venv)) is not None:
            raise ValueError(f"cluster.colocate=true with rollout.backend=vllm needs vLLM's sleep mode: {why}; "
                             "use cluster.colocate=false or rollout.backend=engine")
    backend = str(cfg.envs.sandbox.backend)
    if backend == "docker":
        from jointrl.envs.sandbox.docker import unavailable_reason  # lazy: the docker SDK only when chosen

        if (why := unavailable_reason()) is not None:
            raise ValueError(f"envs.sandbox.backend=docker: {why}")
    for domain, dc in cfg.envs.domains.items():
        if split == "unseen" and not dc.heldout_families:
            continue  # jointrl eval split=unseen plays only the domains that hold families out
        try:
            tasks = load_tasks(domain, dc.task_dir, split or dc.split, backend, dataset_source(dc), dc.heldout_families)
        except ValueError as e:
            raise ValueError(f"envs.domains.{domain}: {e}") from e
        if not tasks:
            raise ValueError(f"envs.domains.{domain}: no tasks under {dc.task_dir or 'the shipped set'!r}")
    if cfg.recipe.sft_data:  # jointrl sft's own transcripts: a bad row named now, not after Ray's start
        from jointrl.rl.build import build_template  # lazy: as above
        from jointrl.rl.sft_data import read_transcripts  # lazy: as above (it imports rl.types, torch)

        try:
            read_transcripts(cfg.recipe.sft_data, build_template(cfg), cfg.recipe.sft_data_split)
        except ValueError as e:
            raise ValueError(f"recipe.sft_data: {e}") from e
    if cfg.checkpoint and not Path(cfg.checkpoint).exists():
        raise ValueError(f"checkpoint={cfg.checkpoint} does not exist")


def overrides_of(command: str, args: list[str]) -> tuple[list[str], str | None] | None:
    """The config overrides in ``args`` and the split to check, or None when the command's
    arguments are not plain ``key=value`` overrides (Hydra flags: left to Hydra)."""
    if command not in CHECKED or any(a.startswith("-") for a in args):
        return None
    own = EVAL_ARGS if command == "eval" else ()
    pairs = [a for a in args if "=" in a and not a.startswith("~")]
    split = next((a.split("=", 1)[1] for a in pairs if a.startswith("split=")), "heldout") if command == "eval" else None
    return [a for a in pairs if a.split("=", 1)[0] not in own and not a.startswith("hydra.")], split


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 600 else text[:597] + "..."


def guard(command: str, argv: list[str]) -> list[str]:
    """Run the checks for ``command``; on a problem print one line and exit 2. Returns ``argv``
    without ``--debug`` (which makes a problem raise with its traceback instead)."""
    debug = "--debug" in argv or os.environ.get("HYDRA_FULL_ERROR") == "1"
    argv = [a for a in argv if a != "--debug"]
    plan = overrides_of(command, argv)
    if plan is None:
        return argv
    try:
        check(*plan)
    except Exception as e:  # noqa: BLE001  (Hydra / OmegaConf / our ValueErrors: all user-facing)
        if debug:
            raise
        print(f"jointrl: error: {one_line(e)}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    return argv
