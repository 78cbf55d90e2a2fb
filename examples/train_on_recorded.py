"""A few GRPO steps on trajectories an external agent recorded through ``jointrl serve``.

    python examples/train_on_recorded.py runs/serve/recorded.jsonl algo.total_steps=2 learner.lr=1e-3

Reads the recorder's JSONL (``rl/rollout/recorder.read_trajectories``), groups trajectories by
``group_id`` (the agent sets it when it finishes a conversation), computes group-relative
advantages (``grpo_advantages``: zero-variance groups are dropped) and takes
``algo.total_steps`` learner steps on the same batch (``LearnerGroup``, DeepSpeed over gloo),
starting from ``checkpoint=`` if given (a training run's checkpoints dir), and
saves a checkpoint to ``<output_dir>/checkpoints`` that ``jointrl serve checkpoint=...`` serves.
"""

from __future__ import annotations

import sys
from pathlib import Path

import ray

from jointrl.rl.advantages import grpo_advantages
from jointrl.rl.config import load_config
from jointrl.rl.learner.batch import TrainBatch
from jointrl.rl.learner.group import LearnerGroup
from jointrl.rl.rollout.recorder import read_trajectories


def main() -> None:
    path, overrides = sys.argv[1], sys.argv[2:]
    cfg = load_config(overrides)
    trajs = [t for t in read_trajectories(path) if t.token_ids]
    adv = grpo_advantages(trajs, scale_by_std=cfg.algo.scale_adv_by_std)
    print(f"{len(trajs)} trajectories, {len(adv.kept)} kept for training: {adv.stats}")
    if len(adv.kept) < cfg.learner.num_ranks:
        sys.exit("no group with reward variance: record more samples per group_id")
    ray.init(num_cpus=cfg.cluster.num_cpus, include_dashboard=False)  # each rank picks its device: rl/device.py
    try:
        learner = LearnerGroup(cfg)
        if cfg.checkpoint:
            learner.load_checkpoint(cfg.checkpoint)
        batch = TrainBatch([t.token_ids for t in adv.kept], [t.loss_mask for t in adv.kept],
                           [t.logprobs for t in adv.kept], adv.advantages)
        for step in range(1, cfg.algo.total_steps + 1):
            m = learner.train_step(batch)
            print(f"step {step} | loss {m['loss']:+.4f} | clip_frac {m['clip_frac']:.3f} | tokens {m['tokens']:.0f}",
                  flush=True)
        out = Path(cfg.output_dir).resolve() / "checkpoints"
        learner.save_checkpoint(str(out), cfg.algo.total_steps)
        print(f"checkpoint -> {out}")
        learner.shutdown()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
