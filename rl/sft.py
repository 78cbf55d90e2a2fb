"""``jointrl sft [overrides]``: a supervised warm start on the domains' oracle transcripts.

    each train-split task's scripted oracle (envs.registry.scripted_policy), played once through
    the chat template, the agent loop and the real env (rl/eval.play) -> the transcripts it solved
    -> algo.total_steps learner steps, algo.prompts_per_step transcripts each (a seeded shuffle,
       cycled; or, with recipe.sft_domain_weights, each row's domain drawn by weight: demo_draws),
       loss on the assistant tokens only (the agent loop's loss_mask; SFTLoss)
    -> checkpoints in the driver's format (<output_dir>/checkpoints: jointrl train resume=true,
       jointrl eval checkpoint=..., jointrl export read them)

``recipe.sft_data=PATH`` replaces the oracles by a user's own transcripts, a chat-messages
datasets file (``rl/sft_data.py``: tokenized with the run's chat template, loss on the assistant
turns); the rest of the stage is the same.

``recipe.sft_demos`` sets which scripted policy demonstrates each task: ``{oracle: 1.0}`` (the
default) imitates the oracles; ``{oracle: 0.5, wrong: 0.5}`` gives each task the oracle or its
plausible slip (the generated families' ``wrong`` policy: ``grep -ci`` for ``grep -c``, ``s/a/b/``
for ``s/a/b/g``, an off-by-one patch ...), drawn per task from a seeded hash -- demonstrations of
mixed quality, as real SFT data is, which the verifiable reward can then sort out. A slip is kept
when its episode ended normally (it is not solved, by design); an oracle only when it solved its task.
``recipe.sft_demo_style`` picks a domain's style of both (``{code_repo: shell}``: its edits made from
one ``bash`` call, ``oracle_shell`` / ``wrong_shell``, instead of ``view_file`` + ``str_replace``).

The batches are GRPO's (``TrainBatch``: the same token ids the policy would sample, never
re-tokenized); only the loss differs, so ``algo.name`` is set to ``sft`` here. Oracle turns are
generated under ``rollout.max_tokens_per_turn`` and ``rollout.max_context`` as a sampled turn
would be: a demonstration that does not fit (and so is not solved) is left out and counted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import pickle
import random
import zlib
from collections.abc import Iterator
from pathlib import Path

import hydra
import ray
from omegaconf import DictConfig, OmegaConf

from jointrl.envs.registry import scripted_policy
from jointrl.rewards.base import succeeded
from jointrl.rl.build import build_template
from jointrl.rl.checkpoint_format import write_atomic
from jointrl.rl.config import Algorithm, Config, register_schemas, to_config
from jointrl.rl.eval import EvalSpec, eval_tasks, play
from jointrl.rl.learner.batch import TrainBatch
from jointrl.rl.learner.group import LearnerGroup
from jointrl.rl.placement import Placement
from jointrl.rl.sft_data import read_transcripts
from jointrl.rl.rollout.scripted import ScriptedEngine
from jointrl.rl.tracking import RunTracker
from jointrl.rl.train import _start_ray
from jointrl.rl.types import FinishReason, Trajectory


def demo_policy(cfg: Config, task_id: str) -> str:
    """The role that demonstrates ``task_id`` under ``cfg.recipe.sft_demos`` (seeded by ``cfg.seed``):
    ``oracle`` or ``wrong``."""
    names, weights = zip(*sorted(cfg.recipe.sft_demos.items()))
    u = zlib.crc32(f"{cfg.seed}/{task_id}".encode()) / 2 ** 32
    return random.Random(u).choices(names, weights)[0] if len(names) > 1 else names[0]


def demo_draws(demos: list[Trajectory], weights: dict[str, float], seed: int) -> Iterator[Trajectory]:
    """The SFT stream of demonstrations. Without ``weights`` (``recipe.sft_domain_weights``), every
    demonstration once per epoch, in a seeded shuffle: each domain gets its share of the
    demonstrations. With them, each row's domain is drawn by weight, then that domain's next
    demonstration (its own seeded epochs); a domain of weight 0 gets none."""
    if not weights:
        return _epochs(demos, random.Random(seed))
    have = sorted({t.domain for t in demos})
    unnamed, empty = sorted(set(have) - set(weights)), sorted(d for d, w in weights.items() if w > 0 and d not in have)
    if unnamed or empty:
        raise ValueError(f"recipe.sft_domain_weights must weigh every domain with demonstrations ({have}) and "
                         f"only those; missing {unnamed}, without demonstrations {empty}")
    names = [d for d in have if weights[d] > 0]
    streams = {d: _epochs([t for t in demos if t.domain == d], random.Random(f"{seed}/{d}")) for d in names}
    return _by_weight(streams, [weights[d] for d in names], random.Random(seed))


def _by_weight(streams: dict[str, Iterator], weights: list[float], rng: random.Random) -> Iterator:
    names = list(streams)
    while True:
        yield next(streams[rng.choices(names, weights)[0]])


def _epochs(items: list, rng: random.Random) -> Iterator:
    """``items`` forever, each once per epoch, every epoch in a new shuffle of ``rng``."""
    while True:
        order = rng.sample(range(len(items)), len(items))
        while order:
            yield items[order.pop()]


def policy_name(cfg: Config, domain: str, role: str) -> str:
    """The scripted policy that plays ``role`` for ``domain``: ``recipe.sft_demo_style`` may name a style
    (``{code_repo: shell}`` -> ``oracle_shell``)."""
    style = cfg.recipe.sft_demo_style.get(domain)
    return f"{role}_{style}" if style else role


def oracle_transcripts(cfg: Config, limit: int = 0, split: str = "train",
                       mixed: bool = True) -> tuple[list[Trajectory], int]:
    """(the demonstrations of every configured domain's ``split`` -- its first ``limit`` tasks by
    id, 0: all -- by ``demo_policy`` (``mixed=False``: all oracles), how many were left out: an
    oracle that did not solve its task, a slip that did not end with a stop)."""
    spec = EvalSpec(tiers=("low",), k=1, split=split, limit=limit)
    policy = (lambda task_id: demo_policy(cfg, task_id)) if mixed else (lambda task_id: "oracle")  # noqa: E731
    template = build_template(cfg)  # the run's (a checkpoint's own with model.path)
    demo = lambda task, _: ScriptedEngine(scripted_policy(task, policy_name(cfg, task.domain, policy(task.id))),  # noqa: E731
                                          template)
    trajs = asyncio.run(play(cfg, eval_tasks(cfg, spec), spec, demo))
    kept = [t for t in trajs if (succeeded(t.reward_info) if policy(t.task_id) == "oracle"
                                 else t.finish_reason == FinishReason.STOP)]
    return kept, len(trajs) - len(kept)


def heldout_fit(learner, held: list[Trajectory]) -> dict[str, float]:
    """How well the current weights imitate held-out oracle transcripts, per domain, without playing
    an episode: ``nll`` (mean per assistant token) and ``oracle_prob`` (the mean over transcripts of
    the probability that sampling at ``rollout.temperature`` reproduces every assistant token of the
    oracle: with deterministic envs a lower bound on that domain's held-out pass@1), and
    ``sure_tokens`` (the share of assistant tokens given probability > 1/2: greedy picks them)."""
    logps = learner.logprobs([t.token_ids for t in held])
    per: dict[str, list[tuple[float, int, int]]] = {}
    for t, lp in zip(held, logps):
        mine = [lp[i] for i, m in enumerate(t.loss_mask) if m]  # lp[i]: log p(token i | tokens before it)
        per.setdefault(t.domain, []).append((sum(mine), len(mine), sum(x > -math.log(2) for x in mine)))
    out = {}
    for dom, rows in sorted(per.items()):
        tokens = sum(n for _, n, _ in rows)
        out[f"sft/heldout/{dom}/nll"] = -sum(s for s, _, _ in rows) / max(tokens, 1)
        out[f"sft/heldout/{dom}/oracle_prob"] = sum(math.exp(s) for s, _, _ in rows) / len(rows)
        out[f"sft/heldout/{dom}/sure_tokens"] = sum(c for _, _, c in rows) / max(tokens, 1)
    return out


def sft_batch(trajs: list[Trajectory]) -> TrainBatch:
    """Transcripts as a learner batch: every assistant token trains, with weight 1 (screenshots
    ride along as in GRPO's batch)."""
    return TrainBatch([t.token_ids for t in trajs], [t.loss_mask for t in trajs], [t.logprobs for t in trajs],
                      [1.0] * len(trajs), image_patches=[t.image_patches for t in trajs])


def sft(cfg: Config) -> dict[str, float]:
    """``cfg.algo.total_steps`` SFT steps on the oracle transcripts; returns the last step's metrics.

    A checkpoint every ``checkpoint_every`` steps and at the last. With ``resume=true`` the run continues
    after ``<output_dir>/checkpoints``' latest step (weights, optimizer, the lr schedule's clock) on the
    demonstrations it played before (``<output_dir>/demos.pkl``), drawing the rows the uninterrupted run
    would have drawn."""
    cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, name=Algorithm.sft))
    out_dir = Path(cfg.output_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), out_dir / "config.yaml")
    cache = out_dir / "demos.pkl"  # the played demonstrations, so that a resumed run does not play them again
    if cfg.resume and cache.is_file():
        demos, unsolved = pickle.loads(cache.read_bytes())
    elif cfg.recipe.sft_data:
        demos, unsolved = read_transcripts(cfg.recipe.sft_data, build_template(cfg), cfg.recipe.sft_data_split), 0
        if not demos:
            raise ValueError(f"recipe.sft_data={cfg.recipe.sft_data}: the file holds no transcripts")
    else:
        demos, unsolved = oracle_transcripts(cfg)
        write_atomic(cache, lambda f: pickle.dump((demos, unsolved), f))
    if not demos:
        raise ValueError(f"no oracle transcript solved its task within rollout.max_context={cfg.rollout.max_context} "
                         f"and rollout.max_tokens_per_turn={cfg.rollout.max_tokens_per_turn}; raise them")
    source = cfg.recipe.sft_data or dict(cfg.recipe.sft_demos)
    print(f"sft: {len(demos)} demonstrations {source} ({unsolved} left out), "
          f"{sum(sum(t.loss_mask) for t in demos)} assistant tokens", flush=True)
    rc = cfg.recipe
    draws = demo_draws(demos, rc.sft_domain_weights, cfg.seed)
    held = oracle_transcripts(cfg, rc.sft_heldout_limit, "heldout", mixed=False)[0] if rc.sft_heldout_every else []
    _start_ray(cfg)
    # the learner ranks hold cluster.learner_bundle, as in GRPO (its GPU on a GPU cluster, its CPUs as torch threads)
    placement = Placement(cfg, learner_only=True)
    learner = LearnerGroup(cfg, [placement.learner(r) for r in range(cfg.learner.num_ranks)])
    tracker = RunTracker(cfg, out_dir)
    per_step = min(cfg.algo.prompts_per_step, len(demos))
    start = (learner.load_checkpoint(str(out_dir / "checkpoints")) or 0) if cfg.resume else 0
    if start:  # the draws the finished steps took, skipped: the resumed run sees the rows the whole run would
        print(f"sft: resuming after step {start} from {out_dir / 'checkpoints'}", flush=True)
        for _ in range(start * per_step):
            next(draws)
    metrics: dict[str, float] = {}
    for step in range(start + 1, cfg.algo.total_steps + 1):
        batch = [next(draws) for _ in range(per_step)]
        # By domain, then shortest first: the learner cuts consecutive micro-batches, each padded
        # to its longest row and forwarding the system prompt its rows share once (batch.
        # collate_shared), so one domain's transcripts of like lengths share one (terminal ~1 K
        # tokens, code_repo ~2.4 K). The loss is normalised over the whole batch: nothing else changes.
        batch.sort(key=lambda t: (t.domain, len(t.token_ids)))
        metrics = {f"sft/{k}": v for k, v in learner.train_step(sft_batch(batch)).items()}
        if held and (step % rc.sft_heldout_every == 0 or step == cfg.algo.total_steps):
            metrics |= heldout_fit(learner, held)
        if tracker.run is not None:
            tracker.run.log(metrics, step=step)
        print(f"sft step {step:4d} | loss {metrics['sft/loss']:.4f} | nll {metrics.get('sft/nll', 0.0):.4f} "
              f"| tokens {int(metrics.get('sft/tokens', 0))} | {metrics['sft/time_s']:.1f}s", flush=True)
        if any(k.startswith("sft/heldout/") for k in metrics):
            print("    held-out oracles: " + " | ".join(
                f"{d} nll {metrics[f'sft/heldout/{d}/nll']:.3f} sure {metrics[f'sft/heldout/{d}/sure_tokens']:.3f} "
                f"p(oracle) {metrics[f'sft/heldout/{d}/oracle_prob']:.3f}"
                for d in sorted({k.split('/')[2] for k in metrics if k.startswith('sft/heldout/')})), flush=True)
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.algo.total_steps:
            learner.save_checkpoint(str(out_dir / "checkpoints"), step)
    tracker.finish()
    learner.shutdown()
    return metrics


register_schemas()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(raw: DictConfig) -> None:
    try:
        sft(to_config(raw))
    finally:
        ray.shutdown()
