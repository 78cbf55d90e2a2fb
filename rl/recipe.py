"""``jointrl recipe +experiment=cpu_joint [overrides]``: the CPU learning recipe, end to end.

    warm-up        with recipe.copy_warmup: the untrained model on the synthetic copy
                   task (model/pretrain.copy_warmup); the SFT starts from it        -> <out>/warmup
    jointrl sft    recipe.sft_steps steps on the train split's oracle transcripts  -> <out>/sft
    jointrl eval   the SFT checkpoint on the held-out split (GRPO step 0)           -> <out>/eval/step_0
    jointrl train  checkpoint=<out>/sft/checkpoints: algo.total_steps GRPO steps    -> <out>/grpo
                   (on recipe.grpo_task_dirs' tasks where it names a domain: fresh seeds)
    jointrl eval   the GRPO checkpoint every recipe.eval_every steps and the last   -> <out>/eval/step_N
    curves         <out>/curves.json and <out>/curves.png: the training reward and success per
                   domain per GRPO step (from the step's trajectories), held-out pass@1 per domain
                   against the GRPO step; one wandb run ``<run_name>-recipe`` with both as scalars
                   and the PNG

Comparisons (``conf/experiment/cpu_joint5*.yaml``, docs/recipe.md): ``recipe.sft_from`` reuses another
run's SFT checkpoint and step-0 eval; ``recipe.grpo_domains`` trains (and evaluates) a subset of the
domains for ``algo.total_steps`` x their weight share (the episodes the joint run gives them);
``recipe.grpo=false`` stops after SFT; ``recipe.match_cpu_of`` sizes the SFT to another run's SFT + GRPO
CPU seconds.

Each stage is its command's own function (``rl/sft.py``, ``rl/eval.py``, ``rl/train.py``) in this
process, with the same config, so a stage can be rerun by hand with the command it names; Ray is
started by a stage that needs it and shut down after it. A stage whose output is complete (the
SFT / GRPO run's ``latest`` checkpoint at its last step, an eval's ``eval.json``) is reused, so a
rerun after a crash or with other plot settings continues where the last one stopped; with
``recipe.checkpoint_every`` the SFT and GRPO stages also resume mid-stage from their last checkpoint.
Every eval plays the same episodes (seeds from ``seed``, domain, task, tier and sample), so the
points of the held-out curve differ only by the policy.

CPU seconds per stage are those of this process and its descendants (Ray's processes and workers,
sandboxes), taken before the stage shuts Ray down: on a shared machine the wall time overstates
the cost, this does not. They come from a cpuacct cgroup of the recipe's own (``rl/cpu_clock.py``),
joined before the first stage starts anything; without one (no cgroup v1, not root) sandboxed
commands that have ended are missed and ``curves.json`` says ``cpu_exact: false``. Each stage's
seconds are summed over the invocations that ran it (``StageLedger``, ``<out>/stages.json``), a
killed one's included.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import threading
import time
from collections import defaultdict
from pathlib import Path

import hydra
import ray
import torch
from omegaconf import DictConfig, OmegaConf

from jointrl.model.pretrain import copy_warmup
from jointrl.rewards.base import succeeded
from jointrl.rl.build import build_model
from jointrl.rl.checkpoint_format import write_atomic, write_weights
from jointrl.rl.config import Config, register_schemas, to_config
from jointrl.rl.cpu_clock import CpuClock
from jointrl.rl.eval import EvalSpec, evaluate, row_name
from jointrl.rl.sft import sft
from jointrl.rl.train import train


_CLOCK: CpuClock | None = None


def _cpu_s() -> float:
    """CPU seconds of this process and everything it started: Ray's processes, their workers and their
    sandboxes (``rl/cpu_clock.py``: a cpuacct cgroup where the host has one, else a lower bound)."""
    global _CLOCK
    if _CLOCK is None:
        _CLOCK = CpuClock("jointrl-recipe")
    return _CLOCK()


class StageLedger:
    """Each stage's wall and CPU seconds summed over every invocation that ran it, kept in ``path``
    (``<output_dir>/stages.json``: ``{stage: {wall_s, cpu_s, runs, done}}``). While a stage runs, its
    running totals are written every ``tick_s`` seconds with ``done: false``, so a run killed mid-stage
    (a session's end, a preemption) still counts what it spent, to within ``tick_s``, once it is resumed:
    ``recipe.match_cpu_of`` reads these totals. A stage reused from its finished output adds the
    seconds it took to find that out."""

    def __init__(self, path: Path, tick_s: float = 30.0) -> None:
        self.path, self.tick_s = path, tick_s
        self.entries: dict[str, dict] = json.loads(path.read_text()) if path.is_file() else {}
        self._lock = threading.Lock()

    def run(self, name: str, fn, *args) -> dict:
        """``fn(*args)``, timed into ``name``'s entry → ``{wall_s, cpu_s}`` of this invocation and ``result``."""
        base = self.entries.get(name, {"wall_s": 0.0, "cpu_s": 0.0, "runs": 0})
        t0, c0 = time.perf_counter(), _cpu_s()
        stop = threading.Event()

        def record(done: bool) -> dict:
            spent = {"wall_s": time.perf_counter() - t0, "cpu_s": _cpu_s() - c0}  # before Ray's processes end
            with self._lock:
                self.entries[name] = {"wall_s": base["wall_s"] + spent["wall_s"], "cpu_s": base["cpu_s"] + spent["cpu_s"],
                                      "runs": base["runs"] + 1, "done": done}
                text = json.dumps(self.entries, indent=1) + "\n"
                write_atomic(self.path, lambda f: f.write(text.encode()))
            return spent

        def tick() -> None:
            while not stop.wait(self.tick_s):
                record(False)

        ticker = threading.Thread(target=tick, name=f"ledger-{name}", daemon=True)
        ticker.start()
        done = False
        try:
            result = fn(*args)
            done = True
        finally:
            stop.set()
            ticker.join()
            spent = record(done)
        return {**spent, "result": result}


def _latest_step(ckpt_dir: Path) -> int | None:
    """The step ``ckpt_dir/latest`` names (the newest complete checkpoint), None without one."""
    latest = ckpt_dir / "latest"
    return int(latest.read_text().strip().removeprefix("step_")) if latest.is_file() else None


def _finished(ckpt_dir: Path, step: int) -> bool:
    return _latest_step(ckpt_dir) == step


def eval_steps(total_steps: int, every: int) -> list[int]:
    """The GRPO steps whose checkpoints are evaluated (0 is the SFT checkpoint).

    >>> eval_steps(10, 4), eval_steps(3, 0)
    ([0, 4, 8, 10], [0, 3])
    """
    return sorted({0, total_steps, *range(every, total_steps, every or total_steps)})


def train_curves(traj_dir: Path) -> dict[str, dict[str, list[float]]]:
    """Per domain: ``step``, mean ``reward`` and ``success`` share of each GRPO step's scored
    trajectories (env errors excluded, as in the driver's ``<domain>/reward``), and ``episodes``,
    how many were scored."""
    per: dict[str, dict[int, list[tuple[float, bool]]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(traj_dir.glob("step_*.jsonl")):
        step = int(path.stem.split("_")[1])
        for line in path.read_text().splitlines():
            t = json.loads(line)
            if t["finish_reason"] != "env_error":
                per[t["domain"]][step].append((t["reward"], succeeded(t["reward_info"])))
    return {d: {"step": sorted(steps), "reward": [sum(r for r, _ in steps[s]) / len(steps[s]) for s in sorted(steps)],
                "success": [sum(ok for _, ok in steps[s]) / len(steps[s]) for s in sorted(steps)],
                "episodes": [len(steps[s]) for s in sorted(steps)]}
            for d, steps in sorted(per.items())}


def heldout_curves(evals: dict[int, dict]) -> dict[str, dict[str, list]]:
    """Per (domain, tier, split) row of the evals: ``step``, ``pass@1``, ``episodes``; named ``<domain>``
    (held-out seeds of trained families), ``<domain>/unseen`` (held-out families), ``/<tier>`` appended
    for a tier other than low."""
    curves: dict[str, dict[str, list]] = defaultdict(lambda: {"step": [], "pass@1": [], "episodes": []})
    for step in sorted(evals):
        for row in evals[step]["rows"]:
            c = curves[row_name(row) if row["tier"] == "low" else f"{row_name(row)}/{row['tier']}"]
            c["step"].append(step)
            c["pass@1"].append(row["pass@1"])
            c["episodes"].append(row["episodes"])
    return dict(sorted(curves.items()))


def summary(heldout: dict[str, dict[str, list]], init: dict | None) -> list[dict]:
    """One row per domain: held-out pass@1 of the untrained model (if evaluated), after SFT, after
    GRPO, and GRPO's gain over SFT in points."""
    rows = []
    for name, c in heldout.items():
        first = next((r["pass@1"] for r in (init or {}).get("rows", [])
                      if (row_name(r) if r["tier"] == "low" else f"{row_name(r)}/{r['tier']}") == name), None)
        sft, grpo = c["pass@1"][0], c["pass@1"][-1]
        rows.append({"domain": name, "episodes": c["episodes"][-1], "init": first, "sft": sft, "grpo": grpo,
                     "gain_points": 100 * (grpo - sft)})
    return rows


def plot(curves: dict, path: Path, title: str) -> None:
    """Two panels: training reward per domain against the GRPO step; held-out pass@1 per domain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_h) = plt.subplots(1, 2, figsize=(11, 4))
    for d, c in curves["train"].items():
        ax_r.plot(c["step"], c["reward"], marker=".", label=d)
    ax_r.set(xlabel="GRPO step", ylabel="mean reward (train split, sampled)", title="training reward")
    for d, c in curves["heldout"].items():
        ax_h.plot(c["step"], c["pass@1"], marker="o", label=f"{d} ({c['episodes'][-1]} ep.)")
    ax_h.set(xlabel="GRPO step (0 = SFT checkpoint)", ylabel="pass@1", title="held-out pass@1", ylim=(-0.02, 1.02))
    for ax in (ax_r, ax_h):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def grpo_envs(cfg: Config):
    """``cfg.envs`` with each domain of ``recipe.grpo_task_dirs`` training on that folder's tasks, and
    only ``recipe.grpo_domains`` when it names some."""
    for key in ("grpo_task_dirs", "grpo_domains"):
        extra = set(getattr(cfg.recipe, key)) - set(cfg.envs.domains)
        if extra:
            raise ValueError(f"recipe.{key} names {sorted(extra)}, not among envs.domains "
                             f"(allowed: {sorted(cfg.envs.domains)})")
    keep = cfg.recipe.grpo_domains or list(cfg.envs.domains)
    domains = {name: dataclasses.replace(d, task_dir=cfg.recipe.grpo_task_dirs.get(name, d.task_dir))
               for name, d in cfg.envs.domains.items() if name in keep}
    return dataclasses.replace(cfg.envs, domains=domains)


def eval_envs(cfg: Config):
    """``cfg.envs`` less the domains ``recipe.grpo_domains`` leaves out: a single-domain run's evals
    play its own domain only."""
    keep = cfg.recipe.grpo_domains or list(cfg.envs.domains)
    return dataclasses.replace(cfg.envs, domains={n: d for n, d in cfg.envs.domains.items() if n in keep})


def grpo_steps(cfg: Config) -> int:
    """GRPO steps: ``algo.total_steps`` for every domain; for ``recipe.grpo_domains`` a subset, that
    times the subset's share of the domain weights, so each domain draws the episodes it draws in the
    joint run (the joint sampler draws a batch's domains by weight).

    >>> from jointrl.rl.config import load_config
    >>> cfg = load_config(["+experiment=cpu_joint", "algo.total_steps=40", "recipe.grpo_domains=[code_repo]"])
    >>> grpo_steps(cfg)  # code_repo weighs 0.25 of 1.0
    10
    """
    if not cfg.recipe.grpo_domains:
        return cfg.algo.total_steps
    total = sum(d.weight for d in cfg.envs.domains.values())
    share = sum(cfg.envs.domains[n].weight for n in cfg.recipe.grpo_domains) / total
    return max(1, round(cfg.algo.total_steps * share))


def grpo_checkpoint_every(eval_every: int, every: int) -> int:
    """The GRPO stage's checkpoint interval: every eval step's checkpoint and, with ``recipe.checkpoint_every``,
    one at least that often (their gcd, so both sets of steps are saved).

    >>> grpo_checkpoint_every(45, 0), grpo_checkpoint_every(45, 5), grpo_checkpoint_every(15, 10)
    (45, 5, 5)
    """
    return math.gcd(eval_every, every) if every else eval_every


def matched_sft_steps(cfg: Config) -> int:
    """``recipe.sft_steps``, or with ``recipe.match_cpu_of`` the SFT steps that run's SFT + GRPO CPU
    seconds buy at its SFT's CPU seconds per step (its ``curves.json`` ``stages``)."""
    ref = cfg.recipe.match_cpu_of
    if not ref:
        return cfg.recipe.sft_steps
    path = Path(ref) / "curves.json"
    if not path.is_file():
        raise ValueError(f"recipe.match_cpu_of={ref}: no curves.json there (run that recipe first)")
    done = json.loads(path.read_text())
    stages = done["stages"]
    if "sft" not in stages or "grpo" not in stages:
        raise ValueError(f"recipe.match_cpu_of={ref}: its curves.json lacks the sft or grpo stage's CPU seconds "
                         f"(has: {sorted(stages)})")
    return round(done["sft_steps"] * (stages["sft"]["cpu_s"] + stages["grpo"]["cpu_s"]) / stages["sft"]["cpu_s"])


def grpo_rollout(cfg: Config):
    """``cfg.rollout`` at ``recipe.grpo_temperature`` (when set): the GRPO stage's sampling; the evals keep ``cfg.rollout``."""
    t = cfg.recipe.grpo_temperature
    return cfg.rollout if t is None else dataclasses.replace(cfg.rollout, temperature=t)


def warm_up(cfg: Config, directory: Path) -> dict:
    """The copy warm-up (``recipe.copy_warmup``'s phases) of the model ``cfg`` initialises, in this
    process on its device (``rl/device.rank_device``; on the host one torch thread, so that a seed's
    weights are the same on every run), saved as a weights-only checkpoint in ``directory``; → the
    last evaluation's copy accuracies (``model/pretrain.copy_warmup``)."""
    rc, model = cfg.recipe, build_model(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = copy_warmup(model, rc.copy_warmup, lr=rc.copy_warmup_lr, batch=rc.copy_warmup_batch, seed=cfg.seed,
                             eval_every=max(1, sum(n for n, _ in rc.copy_warmup) // 10), log=True)
    finally:
        torch.set_num_threads(threads)
    write_weights(model, directory)
    (directory.parent / "warmup.json").write_text(json.dumps({"steps": result.steps, "evals": result.evals}, indent=1))
    return result.evals[-1]


def _eval(cfg: Config, spec: EvalSpec, checkpoint: str | None, out: Path, label: str) -> dict:
    if (out / "eval.json").is_file():
        return json.loads((out / "eval.json").read_text())
    return evaluate(dataclasses.replace(cfg, checkpoint=checkpoint, run_name=f"{cfg.run_name}-{label}"), spec, out)


def recipe(cfg: Config) -> dict:
    """SFT -> eval -> GRPO -> evals -> curves; returns ``curves.json``'s content."""
    rc, out = cfg.recipe, Path(cfg.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), out / "config.yaml")
    spec = EvalSpec(tiers=tuple(rc.eval_tiers), k=rc.eval_k, split="heldout", limit=rc.eval_limit)
    ledger = StageLedger(out / "stages.json")

    def stage(name: str, fn, *args):
        try:
            spent = ledger.run(name, fn, *args)
        finally:
            ray.shutdown()
        print(f"recipe: {name} done in {spent['wall_s'] / 60:.1f} min wall, {spent['cpu_s'] / 60:.1f} CPU min"
              + (f" ({ledger.entries[name]['cpu_s'] / 60:.1f} over {ledger.entries[name]['runs']} runs)"
                 if ledger.entries[name]["runs"] > 1 else ""), flush=True)
        return spent["result"]

    init = stage("eval_init", _eval, cfg, spec, None, out / "eval" / "init", "eval-init") if rc.eval_init else None
    sft_steps = matched_sft_steps(cfg)
    sft_dir = Path(rc.sft_from).resolve() / "sft" if rc.sft_from else out / "sft"
    warm = out / "warmup" / "checkpoints" if rc.copy_warmup and not rc.sft_from else None
    if warm is not None and not (warm / "latest").is_file() and not (sft_dir / "checkpoints" / "latest").is_file():
        stage("warmup", warm_up, cfg, warm)
    if warm is not None and not (warm / "latest").is_file():
        warm = None  # an SFT begun before the warm-up was asked for resumes from its own checkpoint
    sft_cfg = dataclasses.replace(
        cfg, output_dir=str(sft_dir), run_name=f"{cfg.run_name}-sft", checkpoint=None if warm is None else str(warm),
        checkpoint_every=rc.checkpoint_every, resume=(sft_dir / "checkpoints" / "latest").is_file(),
        algo=dataclasses.replace(cfg.algo, total_steps=sft_steps, prompts_per_step=rc.sft_prompts_per_step),
        learner=dataclasses.replace(cfg.learner, lr=rc.sft_lr, lr_schedule=rc.sft_lr_schedule))
    if rc.sft_from:  # another run's SFT: its checkpoint, and its step-0 eval as this run's (the same episodes)
        # the steps that checkpoint was trained for (its ``latest``), not this config's recipe.sft_steps
        sft_steps = _latest_step(sft_dir / "checkpoints")
        if not (Path(rc.sft_from) / "eval" / "step_0" / "eval.json").is_file() or sft_steps is None:
            raise ValueError(f"recipe.sft_from={rc.sft_from}: needs that run's sft/checkpoints and eval/step_0 (run it first)")
        (out / "eval" / "step_0").mkdir(parents=True, exist_ok=True)
        if not (out / "eval" / "step_0" / "eval.json").is_file():
            shutil.copyfile(Path(rc.sft_from) / "eval" / "step_0" / "eval.json", out / "eval" / "step_0" / "eval.json")
    elif not _finished(sft_dir / "checkpoints", sft_steps):
        stage("sft", sft, sft_cfg)
    evals = {0: stage("eval_sft", _eval, cfg, spec, str(sft_dir / "checkpoints"), out / "eval" / "step_0", "eval-sft")}
    grpo_dir, total = out / "grpo", grpo_steps(cfg) if rc.grpo else 0
    steps = eval_steps(total, rc.eval_every) if total else [0]
    one = dataclasses.replace(cfg, envs=eval_envs(cfg))  # the GRPO evals: only the domains GRPO trains
    grpo_cfg = dataclasses.replace(cfg, envs=grpo_envs(cfg), rollout=grpo_rollout(cfg),
                                   algo=dataclasses.replace(cfg.algo, total_steps=max(total, 1)),
                                   output_dir=str(grpo_dir), run_name=f"{cfg.run_name}-grpo",
                                   checkpoint=str(sft_dir / "checkpoints"),
                                   checkpoint_every=grpo_checkpoint_every(rc.eval_every or total, rc.checkpoint_every),
                                   resume=(grpo_dir / "checkpoints" / "latest").is_file(),
                                   # every eval step's checkpoint is evaluated after training: keep them all
                                   learner=dataclasses.replace(cfg.learner, checkpoint_keep=0))
    if total and not _finished(grpo_dir / "checkpoints", total):
        stage("grpo", train, grpo_cfg)
    for s in steps[1:]:
        evals[s] = stage(f"eval_step_{s}", _eval, one, spec, str(grpo_dir / "checkpoints" / f"step_{s}"),
                         out / "eval" / f"step_{s}", f"eval-step{s}")
    if rc.grpo_domains:  # step 0 (maybe another run's) played every domain: keep the trained ones' rows
        evals[0] = {**evals[0], "rows": [r for r in evals[0]["rows"] if r["domain"] in rc.grpo_domains]}
    curves = {"train": train_curves(grpo_dir / "trajectories"), "heldout": heldout_curves(evals)}
    result = {"run_name": cfg.run_name, "seed": cfg.seed, "domains": list(eval_envs(cfg).domains), "eval_k": rc.eval_k,
              "grpo_steps": total, "sft_steps": sft_steps, "sft_from": rc.sft_from, "summary": summary(curves["heldout"], init),
              "cpu_exact": bool(_CLOCK and _CLOCK.exact),
              "stages": ledger.entries, **curves}
    (out / "curves.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(curves, out / "curves.png", f"{cfg.run_name}: seed {cfg.seed}, {sft_steps} SFT + {total} GRPO steps, "
                                     f"{cfg.model.name}, held-out k={rc.eval_k}")
    _log_wandb(cfg, out, curves)
    print(format_summary(result["summary"]), flush=True)
    print(f"recipe: {out / 'curves.png'}, {out / 'curves.json'}", flush=True)
    return result


def format_summary(rows: list[dict]) -> str:
    lines = ["domain            | episodes | init  | sft   | grpo  | gain (points)"]
    for r in rows:
        init = "  -  " if r["init"] is None else f"{r['init']:.3f}"
        lines.append(f"{r['domain']:<17} | {r['episodes']:>8} | {init} | {r['sft']:.3f} | {r['grpo']:.3f} "
                     f"| {r['gain_points']:+.1f}")
    return "\n".join(lines)


def _log_wandb(cfg: Config, out: Path, curves: dict) -> None:
    """The curves as per-step scalars (``recipe/train/<domain>/reward``, ``recipe/heldout/<domain>/pass@1``)
    and the PNG, in one run beside the stages' own."""
    if cfg.logger.wandb_mode == "disabled":
        return
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(project=cfg.logger.project, name=f"{cfg.run_name}-recipe", dir=str(out), mode=cfg.logger.wandb_mode,
                     config=dataclasses.asdict(cfg))
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    for d, c in curves["train"].items():
        for s, r, ok in zip(c["step"], c["reward"], c["success"]):
            by_step[s].update({f"recipe/train/{d}/reward": r, f"recipe/train/{d}/success": ok})
    for d, c in curves["heldout"].items():
        for s, p in zip(c["step"], c["pass@1"]):
            by_step[s][f"recipe/heldout/{d}/pass@1"] = p
    for s in sorted(by_step):
        run.log(by_step[s], step=s)
    run.log({"recipe/curves": wandb.Image(str(out / "curves.png"))}, step=max(by_step, default=0))
    run.finish()


register_schemas()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(raw: DictConfig) -> None:
    try:
        recipe(to_config(raw))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
