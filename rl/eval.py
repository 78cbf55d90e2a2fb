"""``jointrl eval checkpoint=<dir>|null envs=<group> tier=low,high,max k=4 [split=heldout] [unseen=true] [limit=N] [out=<dir>]``.

How often a policy solves tasks it was not trained on. Every task of the chosen domains'
``split`` (``heldout`` by default, ``envs/splits.py``) is played ``k`` times at each thinking
``tier``, through the rollout engine ``jointrl serve`` builds (``rollout.backend``; the
checkpoint's weights go in through the weight push, MXFP4 experts as in training) and the
domain's real env (sandboxes, reward modules) by the agent loop -- in this process, episodes
running concurrently (``envs.max_concurrent_episodes``) so the engine batches their turns.

``checkpoint``: a run's ``.../checkpoints`` (its ``latest``), ``.../checkpoints/step_N`` or an
HF directory; ``null`` evaluates the untrained ``model`` from config. The model's shape is the
run's (its ``config.yaml`` beside ``checkpoints/``) when there is one, else ``model=``'s.
``policy=oracle`` (or ``noop``, ``wrong``) plays each task's scripted policy
(``registry.scripted_policy``) instead of a model, through the same episodes: the ceiling every
held-out task must reach. It lifts the model's token limits (``scripted_limits``), so with the
defaults the oracle scores 1.0. Other ``key=value``s are config overrides (``envs=joint``, ...).
With held-out families (``envs.domains.<d>.heldout_families``), ``split=heldout`` also plays every
task of those families (rows ``split: unseen``); ``unseen=false`` plays the held-out seeds alone.

A task is solved when every outcome reward module reaches its success threshold
(``rewards.base.succeeded``): 1 for the pass/fail modules (tests, checks, answers, app state),
and for CAD's continuous scores ``cad_iou`` >= 0.995 and ``cad_chamfer`` >= 0.95
(``rewards/cad_geometry.py`` gives the measurements behind them).
Per task, with c of n = k samples solved, pass@j is the unbiased estimator of Chen et al. 2021
(HumanEval), 1 - C(n-c, j) / C(n, j): pass@1 = c/n, pass@k = [c > 0]. Rows average it over
the tasks of one (domain, tier). Output: a table on the console, ``<out>/eval.json`` (the rows
and every episode's reward and success), ``<out>/episodes.jsonl`` (the trajectories) and wandb
(``logger.wandb_mode``; ``eval/<domain>/<tier>/pass@1`` etc. and an ``eval`` table).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import zlib
from collections.abc import Callable
from math import comb
from pathlib import Path

from omegaconf import OmegaConf

from jointrl.envs.base import TIERS, Task
from jointrl.envs.registry import dataset_source, load_tasks, make_env, scripted_policy
from jointrl.envs.splits import SPLITS
from jointrl.rewards.base import succeeded
from jointrl.rl.agent_loop import run_episode_with_retries
from jointrl.rl.build import build_template
from jointrl.rl.config import Config, load_config
from jointrl.rl.env_worker import episode_setup, sampling_params
from jointrl.rl.preflight import EVAL_ARGS
from jointrl.rl.rollout.engine import RolloutEngine
from jointrl.rl.rollout.scripted import ScriptedEngine
from jointrl.rl.types import FinishReason, Trajectory

ARGS = EVAL_ARGS  # the command's own; every other key=value overrides the config
USAGE = ("usage: jointrl eval checkpoint=<run>/checkpoints|null [envs=<group>] [tier=low,high,max] [k=4] "
         "[split=heldout] [unseen=true|false] [limit=0] [out=<dir>] [policy=model|oracle|noop|wrong] [key=value ...]")


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    tiers: tuple[str, ...] = TIERS
    k: int = 4  # samples per (task, tier)
    split: str = "heldout"
    limit: int = 0  # tasks per domain, the first by id (0: all)
    unseen: bool = True  # split=heldout: also play every task of the held-out families (rows split=unseen)

    def __post_init__(self) -> None:
        for tier in self.tiers:
            if tier not in TIERS:
                raise ValueError(f"jointrl eval: tier={tier!r} is not allowed; allowed values: {list(TIERS)} "
                                 "(comma-separated for several)")
        if self.split not in SPLITS:
            raise ValueError(f"jointrl eval: split={self.split!r} is not allowed; allowed values: {list(SPLITS)}")
        if self.k < 1 or self.limit < 0:
            raise ValueError(f"jointrl eval: k must be >= 1 and limit >= 0, got k={self.k}, limit={self.limit}")


def pass_at(n: int, c: int, j: int) -> float:
    """Probability that at least one of ``j`` samples, drawn without replacement from ``n`` with
    ``c`` correct, is correct (Chen et al. 2021, eq. 1)."""
    if not 1 <= j <= n or not 0 <= c <= n:
        raise ValueError(f"pass@{j} needs 1 <= j <= n and 0 <= c <= n, got n={n}, c={c}")
    return 1.0 - comb(n - c, j) / comb(n, j)


def eval_tasks(cfg: Config, spec: EvalSpec) -> list[Task]:
    """The split's tasks of every configured domain (the first ``limit`` by id), each scored by the
    domain's configured reward weights, as in training."""
    tasks: list[Task] = []
    for domain, dc in cfg.envs.domains.items():
        if spec.split == "unseen" and not dc.heldout_families:
            continue  # no held-out family in this domain: nothing unseen to play
        chosen = sorted(load_tasks(domain, dc.task_dir, spec.split, cfg.envs.sandbox.backend, dataset_source(dc),
                                   dc.heldout_families), key=lambda t: t.id)
        chosen = chosen[: spec.limit] if spec.limit else chosen
        tasks += [dataclasses.replace(t, reward=dict(dc.reward)) if dc.reward else t for t in chosen]
    return tasks


async def play(cfg: Config, tasks: list[Task], spec: EvalSpec,
               engine_for: Callable[[Task, int], RolloutEngine]) -> list[Trajectory]:
    """``spec.k`` episodes of every task at every tier; ``engine_for(task, sample)`` is the policy
    (one shared engine, or a fresh scripted one per episode). Sampling seeds depend only on
    (``cfg.seed``, domain, task, tier, sample), so a rerun replays the same draws."""
    template, agent_cfg = episode_setup(cfg)
    limit = asyncio.Semaphore(cfg.envs.max_concurrent_episodes)

    async def one(task: Task, tier: str, sample: int) -> Trajectory:
        task = dataclasses.replace(task, tier=tier)
        seed = cfg.seed + zlib.crc32(f"{task.domain}/{task.id}/{tier}/{sample}".encode())
        async with limit:
            return await run_episode_with_retries(lambda: make_env(task.domain, cfg.envs), engine_for(task, sample),
                                                  task, template, sampling_params(cfg, seed), agent_cfg,
                                                  f"eval-{task.domain}-{task.id}-{tier}")

    return list(await asyncio.gather(*(one(t, tier, i) for t in tasks for tier in spec.tiers for i in range(spec.k))))


def table(trajs: list[Trajectory], k: int, split: str = "heldout") -> list[dict]:
    """One row per (domain, tier): tasks, episodes, pass@1, pass@k, mean reward, env errors, each
    marked with ``split`` (the tasks' split). An episode that ended in ``env_error`` counts as
    unsolved (and is counted)."""
    by_task: dict[tuple[str, str, str], list[Trajectory]] = {}
    for t in trajs:
        by_task.setdefault((t.domain, t.tier, t.task_id), []).append(t)
    rows = []
    for domain, tier in sorted({(d, tier) for d, tier, _ in by_task}):
        groups = [g for (d, ti, _), g in by_task.items() if (d, ti) == (domain, tier)]
        assert all(len(g) == k for g in groups), "every task is played k times"
        solved = [sum(succeeded(t.reward_info) for t in g) for g in groups]
        episodes = [t for g in groups for t in g]
        rows.append({"domain": domain, "tier": tier, "split": split, "tasks": len(groups), "episodes": len(episodes),
                     "pass@1": sum(pass_at(k, c, 1) for c in solved) / len(groups),
                     f"pass@{k}": sum(pass_at(k, c, k) for c in solved) / len(groups),
                     "reward": sum(t.reward for t in episodes) / len(episodes),
                     "env_error": sum(t.finish_reason == FinishReason.ENV_ERROR for t in episodes)})
    return rows


def format_table(rows: list[dict]) -> str:
    cols = list(rows[0]) if rows else ["domain", "tier", "tasks", "episodes", "pass@1", "reward", "env_error"]
    cells = [[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    line = lambda vals: " | ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(cols), "-+-".join("-" * w for w in widths), *map(line, cells)])


def write_results(cfg: Config, out: Path, rows: list[dict], trajs: list[Trajectory], meta: dict,
                  splits: list[str] | None = None) -> dict:
    """``eval.json``, ``episodes.jsonl`` and the wandb run under ``out``; returns the JSON.
    ``splits``: each trajectory's split (default: ``meta["split"]`` for all)."""
    out.mkdir(parents=True, exist_ok=True)
    splits = splits or [meta["split"]] * len(trajs)
    result = {**meta, "rows": rows,
              "episodes": [{"domain": t.domain, "task_id": t.task_id, "tier": t.tier, "split": sp, "sample": i % meta["k"],
                            "reward": t.reward, "success": succeeded(t.reward_info), "finish_reason": str(t.finish_reason)}
                           for i, (t, sp) in enumerate(zip(trajs, splits))]}  # play's order: task, tier, sample
    (out / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
    with open(out / "episodes.jsonl", "w") as f:
        for t in trajs:
            f.write(json.dumps(t.to_json()) + "\n")
    if cfg.logger.wandb_mode != "disabled":
        from jointrl.rl.tracking import RunTracker  # lazy: wandb only when the eval logs to it

        tracker = RunTracker(dataclasses.replace(cfg, run_name=f"{cfg.run_name}-eval"), out)
        import wandb

        scalars = {f"eval/{row_name(r)}/{r['tier']}/{c}": r[c] for r in rows for c in r if c.startswith("pass@")}
        cols = list(rows[0]) if rows else []
        tracker.run.log({**scalars, "eval": wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows])},
                        step=meta["policy_version"])
        tracker.finish()
    return result


def row_name(row: dict) -> str:
    """``<domain>`` for a row of trained families, ``<domain>/unseen`` for one of held-out families."""
    return f"{row['domain']}/unseen" if row.get("split") == "unseen" else row["domain"]


def evaluate(cfg: Config, spec: EvalSpec, out: Path,
             engine_for: Callable[[Task, int], RolloutEngine] | None = None, policy: str = "model") -> dict:
    """Play, tabulate, write. ``engine_for`` None: the engine over ``cfg.checkpoint`` (or the
    untrained model), shared by every episode; else ``policy`` names what it plays.

    ``split=heldout`` with held-out families configured (``envs.domains.<d>.heldout_families``) also
    plays every task of those families, in the same run: their rows say ``split: unseen``, apart from
    the held-out seeds of the trained families (``split: heldout``); ``spec.unseen`` False leaves them out."""
    tasks = eval_tasks(cfg, spec)
    unseen = []
    if spec.split == "heldout" and spec.unseen and any(dc.heldout_families for dc in cfg.envs.domains.values()):
        unseen = eval_tasks(cfg, dataclasses.replace(spec, split="unseen"))
    engine = None
    if engine_for is None:
        from jointrl.rl.rollout.server import build_engine  # lazy: the server's aiohttp only for a model policy

        engine = build_engine(cfg, cfg.checkpoint)
        engine_for = lambda task, sample: engine  # noqa: E731

    async def run() -> list[Trajectory]:
        try:
            return await play(cfg, tasks + unseen, spec, engine_for)
        finally:
            if engine is not None:
                await engine.close()

    trajs = asyncio.run(run())
    n = len(tasks) * len(spec.tiers) * spec.k  # play's order: the split's tasks first, then the unseen ones
    rows = table(trajs[:n], spec.k, spec.split) + table(trajs[n:], spec.k, "unseen")
    splits = [spec.split] * n + ["unseen"] * (len(trajs) - n)
    version = engine.version if engine is not None else 0
    meta = {"policy": policy, "checkpoint": cfg.checkpoint if engine is not None else None, "policy_version": version,
            "split": spec.split, "k": spec.k, "tiers": list(spec.tiers), "domains": list(cfg.envs.domains)}
    print(f"eval: {f'checkpoint {cfg.checkpoint} (policy version {version})' if engine is not None else policy}, "
          f"split {spec.split}, k={spec.k}", flush=True)
    print(format_table(rows), flush=True)
    return write_results(cfg, out, rows, trajs, meta, splits)


def eval_config(overrides: list[str]) -> Config:
    """``conf/`` with ``overrides``; the model's shape from the checkpoint's run, when it has a config.yaml."""
    cfg = load_config(overrides)
    if cfg.checkpoint:
        ckpt = Path(cfg.checkpoint)
        for d in (ckpt, ckpt.parent, ckpt.parent.parent):
            if (d / "config.yaml").is_file():
                run = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(d / "config.yaml")))
                return dataclasses.replace(cfg, model=run.model)
    return cfg


SCRIPTED_TOKENS = 1 << 20


def scripted_limits(cfg: Config) -> Config:
    """``cfg`` with the token limits lifted (``rollout.max_tokens_per_turn``, ``rollout.max_context``):
    a scripted policy's turns are the task's own text, not samples, so a model's per-turn budget
    would only cut them (the default 96 tokens cut every oracle's first command)."""
    rollout = dataclasses.replace(cfg.rollout, max_tokens_per_turn=SCRIPTED_TOKENS, max_context=SCRIPTED_TOKENS)
    return dataclasses.replace(cfg, rollout=rollout)


def main(argv: list[str] | None = None) -> dict:
    args = list(sys.argv[1:] if argv is None else argv)
    if any("=" not in a and not a.startswith("~") for a in args):  # ~key: a Hydra deletion, as for train
        raise SystemExit(USAGE)
    mine = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if a.split("=", 1)[0] in ARGS}
    overrides = [a for a in args if a.split("=", 1)[0] not in ARGS]
    try:
        unseen = mine.get("unseen", "true")
        if unseen not in ("true", "false"):
            raise ValueError(f"jointrl eval: unseen={unseen!r} is not allowed; allowed values: ['true', 'false']")
        spec = EvalSpec(tiers=tuple(mine.get("tier", ",".join(TIERS)).split(",")), k=int(mine.get("k", 4)),
                        split=mine.get("split", "heldout"), limit=int(mine.get("limit", 0)), unseen=unseen == "true")
    except ValueError as e:
        raise SystemExit(f"{e}\n{USAGE}") from None
    cfg = eval_config(overrides)
    policy, engine_for = mine.get("policy", "model"), None
    if policy != "model":  # a scripted policy through the same episodes: the ceiling (oracle) or a floor
        cfg = scripted_limits(cfg)
        template = build_template(cfg)  # the run's (a checkpoint's own with model.path)
        engine_for = lambda task, _: ScriptedEngine(scripted_policy(task, policy), template)  # noqa: E731
    return evaluate(cfg, spec, Path(mine.get("out", Path(cfg.output_dir) / "eval")), engine_for, policy)
