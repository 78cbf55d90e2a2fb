"""Learner throughput: tokens/s of DeepSpeed RL steps on ``bench_moe`` (CPU, gloo; one rank runs
without ZeRO partitioning, two ranks ZeRO-2: ``rl/learner/setup.zero_stage``).

    python tests/bench/bench_learner.py [--steps 3] [--seqs 16] [--threads-per-rank 1]

One table: the same global batch (ragged sequences, GRPO token-mean) trained by 1 rank
(ep_size 1), by 1 rank with packing, and by 2 ranks with ep_size 2 (experts sharded, all-to-all
over gloo). Each rank runs ``--threads-per-rank`` torch threads (default 1: on a shared,
loaded 2-core machine two intra-op threads per process thrashed, 42 s/step against 3.5 s with
one), so the ep_size 2 row uses twice the cores of the 1-rank rows. tokens/s counts every
token forwarded and backpropagated (prompt and response). Reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(n: int):
    from jointrl.rl.learner.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(64, 257, (n,), generator=g).tolist()
    seqs = [torch.randint(0, 256, (L,), generator=g).tolist() for L in lens]
    masks = [[0] * 32 + [1] * (L - 32) for L in lens]
    old = [[-5.5 if m else 0.0 for m in mk] for mk in masks]
    adv = [(-1.0) ** i * 0.5 for i in range(n)]
    return TrainBatch(seqs, masks, old, adv)


def _rank(rank: int, world: int, port: int, overrides: list[str], steps: int, n: int, threads: int, out: str) -> None:
    from jointrl.rl.config import load_config
    from jointrl.rl.learner.worker import LearnerWorker

    torch.set_num_threads(threads)
    cfg = load_config(["model=bench_moe", f"learner.num_ranks={world}", *overrides])
    worker = LearnerWorker(cfg, rank, world, "127.0.0.1", port)
    batch = _batch(n)
    shard = batch.shard(rank, world)
    worker.train_step(shard, batch.num_loss_tokens, batch.num_loss_seqs)  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        worker.train_step(shard, batch.num_loss_tokens, batch.num_loss_seqs)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "tokens": sum(len(s) for s in batch.token_ids),
                                         "params": sum(p.numel() for p in worker.engine.module.parameters()) * (1 if world == 1 else 0)}))


def run(world: int, overrides: list[str], steps: int, n: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = f"{d}/result.json"
        ctx = mp.get_context("spawn")
        port = _port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, overrides, steps, n, threads, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise RuntimeError(f"bench ranks failed: {[p.exitcode for p in procs]}")
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--threads-per-rank", dest="threads", type=int, default=1)
    args = ap.parse_args()
    rows = [
        ("1 rank (no ZeRO), ep_size 1", 1, ["learner.micro_batch_size=4"]),
        ("1 rank (no ZeRO), ep_size 1, packed 1024 tok", 1, ["learner.micro_batch_size=0", "learner.pack_sequences=true",
                                                          "learner.max_tokens_per_micro_batch=1024"]),
        ("ZeRO-2, 2 ranks, ep_size 2", 2, ["learner.micro_batch_size=4", "learner.ep_size=2"]),
    ]
    print(f"bench_moe learner step, {args.seqs} sequences of 64..256 tokens, {args.threads} torch thread(s) per rank, "
          f"median of {args.steps} steps after a warm-up")
    print(f"{'configuration':<46} {'tokens/step':>11} {'s/step':>8} {'tokens/s':>9}")
    for name, world, overrides in rows:
        r = run(world, overrides, args.steps, args.seqs, args.threads)
        t = sorted(r["times"])[len(r["times"]) // 2]
        print(f"{name:<46} {r['tokens']:>11} {t:>8.2f} {r['tokens'] / t:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
