"""One GRPO step end to end -- rollout, learner update, weight push -- jointrl vs TRL's ``GRPOTrainer``.

Run: ``python tests/bench/bench_grpo_step.py [--steps 10] [--warmup 2] [--threads 1] [--quick]``
(needs ``pip install -e ".[bench]"`` for TRL).

The same work on both sides: ``bench_moe`` (conf/model; for TRL the same weights as
transformers' ``Qwen3MoeForCausalLM``, written by ``model/hf.save_hf``), float32, 2 prompts
x 8 completions of exactly 64 tokens (EOS ignored: our engine's ``ignore_eos``, TRL's
``min_new_tokens``), temperature 1, no top-k / top-p, the same reward function
(``reward``: the share of lowercase ASCII letters in the completion, so every group has
variance), GRPO with beta = 0, token-mean loss, clip 0.2 / 0.28, one optimizer update per
batch, AdamW lr 1e-3, grad clip 1, the same torch thread count. Each side runs in its own
spawned process, and the sides take turns a step at a time (every side's step 1, then every side's
step 2, ...: ``Turns``), so a change in the machine's speed during the run (a noisy neighbour, the
host's clock) reaches every side alike instead of the side that happened to run then; medians over
``--steps`` steady steps after ``--warmup``. (Until 2026-12-01 the sides ran one after the other,
and the ratio moved with the machine between them: 2.45-3.58x in four runs of one day.)

jointrl, in-process (one process holds the three real pieces, as a one-node user's
``rollout``/``learner`` actors would, minus Ray's object store between them):

* rollout: ``LLMEngine.generate_batch`` (rl/rollout; engine settings from ``conf/rollout/engine``)
  over the 16 requests, the reward, ``grpo_advantages``, the ``TrainBatch``;
* learner: ``LearnerWorker.train_step`` (rl/learner: DeepSpeed over gloo, one rank, where it runs
  without ZeRO partitioning whatever ``learner.zero_stage`` says (``setup.zero_stage``);
  micro-batches cut by ``learner.micro_batch_size`` / ``learner.max_tokens_per_micro_batch`` -- by
  default one here, 16 x 116 tokens -- a group's shared prompt forwarded once per micro-batch): the
  policy-gradient loss over all 16 sequences, one AdamW update of every weight;
* push: ``LearnerWorker.weight_bundle`` (rl/weight_sync: routed experts to MXFP4, XXH3 digests) and
  ``LLMEngine.update_weights`` (verify, dequantize straight into the engine's weights).

TRL: ``GRPOTrainer`` on CPU without vLLM (its only CPU path): rollout is
``_generate_and_score_completions`` (``model.generate``, the reward, advantages; with one
update per batch it computes no old log-probs), learner is the rest of the step (forward,
loss, backward, optimizer), and there is no push: TRL samples from the model it trains.

Reported as one table of per-phase medians (wall seconds) and CPU seconds per step
(``time.process_time``, all threads of the process: steadier than wall time on a shared
machine), with the ratio TRL / jointrl. ``--variants`` adds rows for configuration changes on
our side, each a set of overrides a user passes as is (``VARIANTS``): the learner's micro-batches
of 4 sequences (the default until 2026-11-30 15:00), and
``learner.micro_batch_size=16 rollout.quantize_experts=false``: one micro-batch per step, as the
defaults now cut it, and a dense fp32 push, so the rollout samples from the learner's exact weights
as TRL does; and ``learner.autocast=bfloat16``, the learner's forward matmuls in bfloat16 under
``torch.autocast`` (float32 weights, gradients and AdamW), beside TRL with ``bf16=True`` (its mixed
precision: autocast over the same float32 model); with autocast, ``learner.keep_freed_memory=false`` (glibc
returns freed memory to the OS, as before 2026-12-01) and ``rollout.kv_dtype=bfloat16`` (the engine's KV cache
in bfloat16). The ratios are all against TRL's default float32 row.
(Until 2026-11-30 it also said ``learner.zero_stage=0``, which one rank now runs by default.)
Reports; never asserts.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

PROMPTS_PER_STEP, GROUP, NEW_TOKENS = 2, 8, 64
LR, CLIP_LOW, CLIP_HIGH = 1e-3, 0.2, 0.28
# name -> extra conf overrides for our side (first: the defaults)
VARIANTS = {
    "jointrl (defaults)": [],
    # the learner's micro-batches before 2026-11-30 15:00: 4 sequences, no token budget
    "jointrl, micro-batches of 4": ["learner.micro_batch_size=4", "learner.max_tokens_per_micro_batch=0"],
    # + a dense fp32 push (no MXFP4 round trip: the rollout then runs the learner's exact expert
    # weights, as TRL's does)
    "jointrl, mb 16 + fp32 push": ["learner.micro_batch_size=16", "rollout.quantize_experts=false"],
    # the learner's forward matmuls in bfloat16 under torch.autocast (float32 weights, gradients and AdamW;
    # router, norms, attention and logits float32); its peer row is TRL with bf16=True
    "jointrl, learner.autocast=bfloat16": ["learner.autocast=bfloat16"],
    # the same with glibc returning freed memory to the OS (the default before 2026-12-01)
    "jointrl, autocast, keep_freed_memory=false": ["learner.autocast=bfloat16", "learner.keep_freed_memory=false"],
    # autocast and the rollout's KV cache in bfloat16 (opt-in: the sampled log-probs move by bfloat16's rounding)
    "jointrl, autocast + rollout.kv_dtype=bfloat16": ["learner.autocast=bfloat16", "rollout.kv_dtype=bfloat16"],
}
# name -> GRPOConfig(bf16=...) for TRL's side (first: the default, float32)
TRL_VARIANTS = {"TRL GRPOTrainer": False, "TRL GRPOTrainer, bf16=True": True}


def reward(completion_ids: list[int]) -> float:
    """Share of the completion's tokens that are lowercase ASCII letters (byte ids 97..122).

    >>> reward([97, 98, 32, 256])
    0.5
    """
    return sum(97 <= t <= 122 for t in completion_ids) / max(len(completion_ids), 1)


def trl_reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
    return [reward(ids) for ids in completion_ids]


def prompts(n: int) -> list[str]:
    """``n`` distinct plain-text prompts of equal length (bytes = token ids on both sides)."""
    return [f"Task {i:04d}: answer in lowercase letters only, please." for i in range(n)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _phases(t0, t1, t2, t3) -> dict[str, float]:
    """Wall and CPU seconds of rollout (t0..t1), learner (t1..t2), push (t2..t3), total."""
    out = {}
    for i, clock in enumerate(("", "cpu_")):
        out |= {f"{clock}rollout": t1[i] - t0[i], f"{clock}learner": t2[i] - t1[i], f"{clock}push": t3[i] - t2[i],
                f"{clock}total": t3[i] - t0[i]}
    return out


class Turns:
    """One side's end of the round robin: ``wait`` blocks until the driver gives this side its next step,
    ``done`` hands the step's timings back (and the turn to the next side)."""

    def __init__(self, ctx) -> None:
        self.go, self.back = ctx.Queue(), ctx.Queue()

    def wait(self) -> None:
        self.go.get(timeout=3600)

    def done(self, row: dict) -> None:
        self.back.put(row)


def _ours(args, overrides: list[str], turns: Turns) -> None:
    torch.set_num_threads(args.threads)
    from jointrl.model.tokenizer import ByteTokenizer
    from jointrl.rl.advantages import grpo_advantages
    from jointrl.rl.build import build_model
    from jointrl.rl.config import load_config
    from jointrl.rl.learner.batch import TrainBatch
    from jointrl.rl.learner.worker import LearnerWorker
    from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
    from jointrl.rl.types import SamplingParams, Trajectory

    cfg = load_config(["model=bench_moe", "rollout=engine", "learner.num_ranks=1", f"learner.lr={LR}",
                       "learner.grad_clip=1.0", "learner.weight_decay=0.0", "algo.kl_coef=0.0",
                       f"algo.clip_low={CLIP_LOW}", f"algo.clip_high={CLIP_HIGH}", "algo.scale_adv_by_std=true",
                       f"algo.group_size={GROUP}", f"algo.prompts_per_step={PROMPTS_PER_STEP}", *overrides])
    learner = LearnerWorker(cfg, 0, 1, "127.0.0.1", _port())
    r = cfg.rollout
    engine = LLMEngine(build_model(cfg), ByteTokenizer(), EngineConfig(
        num_blocks=r.num_blocks, block_size=r.block_size, max_num_seqs=r.max_batch,
        max_num_batched_tokens=r.max_num_batched_tokens, session_ttl_s=0.0, ignore_eos=True, kv_dtype=r.kv_dtype,
        batch_invariant=r.batch_invariant))
    engine.update_weights(0, learner.weight_bundle(0))
    tok = ByteTokenizer()
    texts = prompts(PROMPTS_PER_STEP * (args.warmup + args.steps))
    for step in range(1, args.warmup + args.steps + 1):
        turns.wait()
        t0 = _clock()
        ids = [tok.encode(p) for p in texts[(step - 1) * PROMPTS_PER_STEP: step * PROMPTS_PER_STEP]]
        reqs = [p for p in ids for _ in range(GROUP)]
        outs = engine.generate_batch(reqs, [SamplingParams(max_tokens=NEW_TOKENS, temperature=r.temperature,
                                                           seed=step * 1000 + i) for i in range(len(reqs))])
        trajs = []
        for i, (p, o) in enumerate(zip(reqs, outs)):
            assert len(o.token_ids) == NEW_TOKENS, len(o.token_ids)
            trajs.append(Trajectory(p + o.token_ids, [0] * len(p) + [1] * NEW_TOKENS, [0.0] * len(p) + o.logprobs,
                                    [-1] * len(p) + [o.policy_version] * NEW_TOKENS, "bench", f"t{i // GROUP}",
                                    f"{step}-{i // GROUP}", reward=reward(o.token_ids)))
        adv = grpo_advantages(trajs, scale_by_std=cfg.algo.scale_adv_by_std)
        batch = TrainBatch([t.token_ids for t in adv.kept], [t.loss_mask for t in adv.kept],
                           [t.logprobs for t in adv.kept], adv.advantages, rewards=[t.reward for t in adv.kept])
        assert len(batch.token_ids) == PROMPTS_PER_STEP * GROUP, adv.stats
        t1 = _clock()
        learner.train_step(batch, batch.num_loss_tokens, batch.num_loss_seqs)
        t2 = _clock()
        engine.update_weights(step, learner.weight_bundle(step))
        t3 = _clock()
        turns.done(_phases(t0, t1, t2, t3))


def _trl(args, bf16: bool, turns: Turns) -> None:
    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from jointrl.model.hf import save_hf
    from jointrl.model.hf_tokenizer import save_tokenizer
    from jointrl.rl.build import build_model
    from jointrl.rl.config import load_config

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = _clock()
            out = super()._generate_and_score_completions(inputs)
            assert out["completion_mask"].sum(1).eq(NEW_TOKENS).all(), out["completion_mask"].sum(1)
            self._rollout_end = _clock()
            return out

    class StepClock(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            turns.wait()
            self.t0 = _clock()

        def on_step_end(self, args_, state, control, **kw):
            t = _clock()
            assert torch.get_num_threads() == args.threads, torch.get_num_threads()
            turns.done(_phases(self.t0, trainer._rollout_end, t, t))  # no push: TRL samples from the trained model

    with tempfile.TemporaryDirectory() as d:
        save_hf(build_model(load_config(["model=bench_moe"])), d)
        save_tokenizer(d)
        model = Qwen3MoeForCausalLM.from_pretrained(d, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(d)
        steps = args.warmup + args.steps
        data = Dataset.from_dict({"prompt": prompts(PROMPTS_PER_STEP * steps)})
        config = GRPOConfig(
            output_dir=f"{d}/out", use_cpu=True, bf16=bf16, report_to="none", save_strategy="no",
            logging_steps=10**6, disable_tqdm=True, seed=0, max_steps=steps, shuffle_dataset=False,
            per_device_train_batch_size=PROMPTS_PER_STEP * GROUP, num_generations=GROUP,
            gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
            max_completion_length=NEW_TOKENS, generation_kwargs={"min_new_tokens": NEW_TOKENS},
            temperature=1.0, top_p=1.0, top_k=0, beta=0.0, loss_type="dapo", scale_rewards="group",
            epsilon=CLIP_LOW, epsilon_high=CLIP_HIGH, learning_rate=LR, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, dataloader_num_workers=0)
        trainer = Timed(model=model, reward_funcs=trl_reward, args=config, train_dataset=data, processing_class=tok,
                        callbacks=[StepClock()])
        trainer.train()


def _run_in_turns(sides: dict[str, tuple], steps: int) -> dict[str, list[dict]]:
    """Start every side (name -> (target, *args)) in its own spawned process, then give them ``steps`` steps in
    turns, one side at a time → each side's rows (warm-up included)."""
    ctx = mp.get_context("spawn")
    turns = {name: Turns(ctx) for name in sides}
    procs = {name: ctx.Process(target=target, args=(*a, turns[name]))
             for name, (target, *a) in sides.items()}
    for p in procs.values():
        p.start()
    rows: dict[str, list[dict]] = {name: [] for name in sides}
    try:
        for _ in range(steps):
            for name, t in turns.items():
                t.go.put(None)
                while True:  # a side that died answers never: check while waiting
                    try:
                        rows[name].append(t.back.get(timeout=5))
                        break
                    except queue.Empty:
                        if not procs[name].is_alive():
                            raise RuntimeError(f"{name} exited with {procs[name].exitcode}") from None
    finally:
        for p in procs.values():
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="steady steps measured per side")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    ap.add_argument("--variants", action="store_true", help="also time cheap configuration changes on our side")
    ap.add_argument("--quick", action="store_true", help="--steps 5 --warmup 1, no variants")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.variants = 5, 1, False
    sys.path.insert(0, str(Path(__file__).resolve().parents[2].parent))  # spawned children import jointrl alike

    sides = {name: (_trl, args, bf16) for name, bf16 in list(TRL_VARIANTS.items())[: len(TRL_VARIANTS) if args.variants else 1]}
    sides |= {name: (_ours, args, overrides) for name, overrides in list(VARIANTS.items())[: len(VARIANTS) if args.variants else 1]}
    results = {name: rows[args.warmup:] for name, rows in _run_in_turns(sides, args.warmup + args.steps).items()}
    med = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in results.items()}
    trl = med["TRL GRPOTrainer"]
    print(f"one GRPO step, bench_moe fp32, {PROMPTS_PER_STEP} prompts x {GROUP} completions x {NEW_TOKENS} tokens, "
          f"{args.threads} torch thread(s), median of {args.steps} steps after {args.warmup} warm-up, sides in turns; "
          f"seconds per phase, wall | CPU (process time); load average {os.getloadavg()[0]:.1f}")
    phases = ("rollout", "learner", "push", "total")
    print(f"{'side':<34}" + "".join(f"{p:>9}" for p in phases) + " |" + "".join(f"{p:>9}" for p in phases)
          + f"{'TRL/ours wall':>15}{'TRL/ours CPU':>13}")
    for name, m in med.items():
        cells = ["n/a" if p == "push" and name.startswith("TRL") else f"{m[clock + p]:.3f}"
                 for clock in ("", "cpu_") for p in phases]
        print(f"{name:<34}" + "".join(f"{c:>9}" for c in cells[:4]) + " |" + "".join(f"{c:>9}" for c in cells[4:])
              + f"{trl['total'] / m['total']:>14.2f}x{trl['cpu_total'] / m['cpu_total']:>12.2f}x", flush=True)


if __name__ == "__main__":
    main()
