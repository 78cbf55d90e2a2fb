"""The fast engine vs transformers' Qwen3MoeForCausalLM on the same weights (bench_moe).

Run: ``python tests/bench/bench_engine.py`` (``--quick`` for a smaller run). One process,
both sides on the same thread count (default 1: on a shared 2-core machine two threads
spin-wait on each other), float32, EOS ignored on both sides. Reports, never asserts:

Every row also gives the ratio in CPU seconds (``time.process_time``, all threads of this
process): on a machine shared with other jobs, wall-clock ratios swing with their load, the CPU
time each side spent does much less (agentic: wall time is the target, it overlaps env delays).

1. fixed batch: batch 1, 8, 32; 256-token prompts; exactly 128 new tokens. Generated tok/s,
   ms per decode step, and two floors of a decode step as fractions of the engine's step:
   arithmetic (its FLOPs at this machine's measured GEMM rate) and memory (the weights plus
   every cached key/value read once, at the measured copy bandwidth).
2. GRPO rollout: 16 prompts x 8 samples, 256-token prompts, per-request max_tokens drawn
   (seeded) from [16, 512]; the engine takes all 128 at once, HF runs static batches of 32
   (4 prompts x 8), each to its longest request. Tok/s counts requested tokens only.
3. agentic: 64 trajectories x 8 turns; each turn generates 32 tokens, then a 64-token
   observation arrives after an env delay drawn from [50, 500] ms. The engine serves each
   trajectory as it returns (sessions: only new tokens are prefilled); HF runs each turn
   as one static batch over all trajectories, re-prefilling every history, and the batch
   waits for its slowest env. Reports wall time, generated tok/s, the engine's share of
   step time in the model forward, and tokens computed / tokens in the final contexts, for
   a small KV budget (idle sessions get evicted) and a large one.
4. long context (``--only long``): one session on ``tiny_hybrid`` (3 KDA : 1 gated DSA) grown to
   1K then 32K tokens, beside the same shape with every layer full attention: decode ms per
   token at each length, KV pool bytes (fixed at start: the budget), blocks in use, and the
   KDA state bytes held by the session against ``model.state.state_layout``'s formula.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import tempfile
import time

import torch

from jointrl.model import MoEConfig, MoETransformer
from jointrl.model.hf import save_hf
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.types import SamplingParams


def bench_config() -> MoEConfig:
    try:
        return MoEConfig.preset("bench_moe")
    except ValueError:  # before the model issue adds the preset: the same shape
        return MoEConfig(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=2)


def rand_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


def engine(model, num_blocks: int, **kw) -> LLMEngine:
    return LLMEngine(model, config=EngineConfig(num_blocks=num_blocks, max_num_seqs=256, ignore_eos=True,
                                                max_num_batched_tokens=kw.pop("chunk", 1024), **kw))


@torch.no_grad()
def hf_generate(hf, prompts: list[list[int]], new_tokens: int, sample: bool) -> None:
    S = max(map(len, prompts))
    ids = torch.zeros(len(prompts), S, dtype=torch.long)
    mask = torch.zeros(len(prompts), S, dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding
        ids[b, S - len(p):] = torch.tensor(p)
        mask[b, S - len(p):] = 1
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      do_sample=sample, temperature=1.0 if sample else None, top_p=None, top_k=None,
                      eos_token_id=None, pad_token_id=0)
    assert out.shape[1] == S + new_tokens


def gemm_gflops() -> float:
    a, b = torch.randn(256, 256), torch.randn(256, 4096)
    torch.mm(a, b)
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mm(a, b)
    return 20 * 2 * 256 * 256 * 4096 / (time.perf_counter() - t0) / 1e9


def stream_gbps() -> float:
    """Read + write bandwidth of a 64 MiB copy (out of cache)."""
    a = torch.randn(16 * 2**20)
    b = a.clone()
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    return 5 * 2 * a.numel() * 4 / (time.perf_counter() - t0) / 1e9


def decode_bytes(model, batch: int, context: int) -> int:
    """Bytes a decode step must read: every weight but the embedding table (routed experts: the
    expected share of them that ``batch`` uniformly routed tokens hit), and the KV cache."""
    cfg = model.config
    active = 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch
    weights = sum(p.numel() * (active if ".experts." in n else 1)
                  for n, p in model.named_parameters() if "embed_tokens" not in n) * 4
    return weights + batch * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4


def clock() -> tuple[float, float]:
    """(wall, CPU) seconds."""
    return time.perf_counter(), time.process_time()


def decode_flops(cfg: MoEConfig, batch: int, context: int) -> float:
    H, L, D = cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim
    attn_proj = H * D * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    experts = cfg.num_experts_per_tok * 3 * H * cfg.moe_intermediate_size
    per_token = 2 * (L * (attn_proj + experts + H * cfg.num_experts) + H * cfg.vocab_size)
    attention = 2 * 2 * L * cfg.num_attention_heads * D * context
    return batch * (per_token + attention)


def fixed_batch(model, hf, cfg, batches, prompt_len, new) -> list[str]:
    rows, gflops, gbps = [], gemm_gflops(), stream_gbps()
    for B in batches:
        ps = rand_prompts(B, prompt_len, seed=B)
        eng = engine(model, num_blocks=B * (prompt_len + new) // 16 + 8, chunk=2048)
        seqs = [eng.add_request(p, SamplingParams(max_tokens=new, temperature=0)) for p in ps]
        (t0, c0) = clock()
        while eng.stats.computed_tokens < B * prompt_len:  # the prefill steps
            eng.step()
        (t1, c1) = clock()
        while eng.scheduler.has_work():
            eng.step()
        (t2, c2) = clock()
        assert all(len(s.out.token_ids) == new for s in seqs)
        eng_tps, eng_step, eng_cpu = B * new / (t2 - t0), (t2 - t1) / (new - 1), c2 - c0
        (t0, c0) = clock()
        hf_generate(hf, ps, 1, False)
        (t1, c1) = clock()
        hf_generate(hf, ps, new, False)
        (t2, c2) = clock()
        hf_tps, hf_step, hf_cpu = B * new / (t2 - t1), ((t2 - t1) - (t1 - t0)) / (new - 1), c2 - c1
        flop_floor = decode_flops(cfg, B, prompt_len + new // 2) / (gflops * 1e9)
        mem_floor = decode_bytes(model, B, prompt_len + new // 2) / (gbps * 1e9 / 2)  # reads: half the copy traffic
        rows.append(f"| fixed batch {B:>2} | {eng_tps:8.0f} | {hf_tps:8.0f} | {eng_tps / hf_tps:5.1f}x | "
                    f"{hf_cpu / eng_cpu:5.1f}x | step {eng_step * 1e3:.2f} ms vs HF {hf_step * 1e3:.2f} ms; floors: "
                    f"arithmetic {flop_floor * 1e3:.2f} ms ({flop_floor / eng_step:.0%} reached, GEMM {gflops:.0f} "
                    f"GFLOP/s), memory {mem_floor * 1e3:.2f} ms ({mem_floor / eng_step:.0%}, copy {gbps:.1f} GB/s) |")
        print(rows[-1], flush=True)
    return rows


def grpo(model, hf, prompts_n, group, prompt_len, lo, hi) -> list[str]:
    rng = random.Random(0)
    ps = rand_prompts(prompts_n, prompt_len, seed=1)
    reqs = [(p, rng.randint(lo, hi)) for p in ps for _ in range(group)]
    wanted = sum(m for _, m in reqs)
    eng = engine(model, num_blocks=len(reqs) * (prompt_len + hi) // 16 + 64)
    (t0, c0) = clock()
    eng.generate_batch([p for p, _ in reqs],
                       [SamplingParams(max_tokens=m, temperature=1.0, seed=i) for i, (_, m) in enumerate(reqs)])
    (t1, c1) = clock()
    eng_s, eng_cpu = t1 - t0, c1 - c0
    (t0, c0) = clock()
    for i in range(0, len(reqs), 32):
        chunk = reqs[i:i + 32]
        hf_generate(hf, [p for p, _ in chunk], max(m for _, m in chunk), True)
    (t1, c1) = clock()
    hf_s, hf_cpu = t1 - t0, c1 - c0
    ratio = eng.stats.computed_tokens / (len(reqs) * prompt_len + wanted)
    row = (f"| GRPO {prompts_n}x{group} | {wanted / eng_s:8.0f} | {wanted / hf_s:8.0f} | {hf_s / eng_s:5.1f}x | "
           f"{hf_cpu / eng_cpu:5.1f}x | "
           f"engine {eng_s:.1f} s, HF {hf_s:.1f} s; engine computed {ratio:.2f} of prompt+generated tokens |")
    print(row, flush=True)
    return [row]


def agentic_engine(model, n_traj, turns, prompt_len, gen, obs, delays, num_blocks):
    eng = engine(model, num_blocks=num_blocks, session_ttl_s=600.0)
    ps = rand_prompts(n_traj, prompt_len, seed=2)
    obs_ids = rand_prompts(n_traj * turns, obs, seed=3)

    async def trajectory(i: int) -> int:
        ids = list(ps[i])
        for t in range(turns):
            out = await eng.generate(ids, SamplingParams(max_tokens=gen, temperature=1.0, seed=i * turns + t))
            ids += out.token_ids
            if t < turns - 1:
                await asyncio.sleep(delays[i * turns + t])
                ids += obs_ids[i * turns + t]
        return len(ids)

    async def run():
        try:
            return await asyncio.gather(*(trajectory(i) for i in range(n_traj)))
        finally:
            await eng.close()

    (t0, c0) = clock()
    lengths = asyncio.run(run())
    (t1, c1) = clock()
    return t1 - t0, c1 - c0, eng.stats, sum(lengths), eng.scheduler.num_evicted, eng.scheduler.num_preempted


def agentic_hf(hf, n_traj, turns, prompt_len, gen, obs, delays):
    ids = rand_prompts(n_traj, prompt_len, seed=2)
    obs_ids = rand_prompts(n_traj * turns, obs, seed=3)
    (t0, c0) = clock()
    for t in range(turns):
        S = max(map(len, ids))
        x = torch.tensor(ids)
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=gen, min_new_tokens=gen,
                              do_sample=True, temperature=1.0, top_p=None, top_k=None, eos_token_id=None, pad_token_id=0)
        ids = [row[:] for row in out.tolist()]
        assert all(len(r) == S + gen for r in ids)
        if t < turns - 1:
            time.sleep(max(delays[i * turns + t] for i in range(n_traj)))
            ids = [r + obs_ids[i * turns + t] for i, r in enumerate(ids)]
    (t1, c1) = clock()
    return t1 - t0, c1 - c0


def agentic(model, hf, n_traj, turns, prompt_len, gen, obs, budgets) -> list[str]:
    rng = random.Random(0)
    delays = [rng.uniform(0.05, 0.5) for _ in range(n_traj * turns)]
    generated = n_traj * turns * gen
    hf_s, hf_cpu = agentic_hf(hf, n_traj, turns, prompt_len, gen, obs, delays)
    rows = []
    for name, blocks in budgets:
        wall, cpu, st, final_tokens, evicted, preempted = agentic_engine(model, n_traj, turns, prompt_len, gen, obs,
                                                                         delays, blocks)
        rows.append(f"| agentic {n_traj}x{turns}, {name} budget ({blocks} blocks) | {generated / wall:8.0f} | "
                    f"{generated / hf_s:8.0f} | {hf_s / wall:5.1f}x | {hf_cpu / cpu:5.1f}x | "
                    f"wall {wall:.1f} s vs HF {hf_s:.1f} s; "
                    f"forward {st.forward_s / st.step_s:.0%} of step time; computed / final context "
                    f"{st.computed_tokens / final_tokens:.2f}; {evicted} sessions evicted, {preempted} preempted |")
        print(rows[-1], flush=True)
    return rows


def long_context(lengths=(1024, 32768), decode=16) -> list[str]:
    from jointrl.model.state import state_layout

    hybrid = MoEConfig.preset("tiny_hybrid")
    full = dataclasses.replace(hybrid, layer_types=("full",) * hybrid.num_hidden_layers)
    rows = []
    for name, cfg in (("tiny_hybrid", hybrid), ("same shape, all full attention", full)):
        model = MoETransformer.from_config(cfg, dtype=torch.float32, seed=0).eval()
        eng = engine(model, num_blocks=(max(lengths) + 4 * decode) // 16 + 8, chunk=2048, session_ttl_s=3600.0)
        ids: list[int] = []
        for length in lengths:
            ids += rand_prompts(1, length - len(ids), seed=length)[0]
            seq = eng.add_request(ids, SamplingParams(max_tokens=decode, temperature=0))
            t0 = time.perf_counter()
            while seq.num_computed < len(ids):
                eng.step()
            t1 = time.perf_counter()
            while len(seq.out.token_ids) < decode:
                eng.step()
            t2 = time.perf_counter()
            ids = ids + seq.out.token_ids
            state = sum(t.numel() * t.element_size() for pair in seq.recurrent.values() for t in pair)
            used = eng.block_manager.num_blocks - eng.block_manager.num_free
            rows.append(f"| {name} @ {length} tokens | decode {(t2 - t1) / (decode - 1) * 1e3:.1f} ms/token | "
                        f"prefill of new tokens {t1 - t0:.1f} s | KV pool {eng.kv_cache_bytes / 2**20:.1f} MiB "
                        f"(fixed), {used}/{eng.block_manager.num_blocks} blocks | KDA state {state} B "
                        f"(formula {state_layout(cfg, torch.float32).fixed} B) |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    parser.add_argument("--only", default="fixed,grpo,agentic", help="comma list of fixed, grpo, agentic, long")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import Qwen3MoeForCausalLM

    from jointrl.kernels.paged_attention_cpu import load_kernel

    load_kernel()  # compiled (first run) or loaded before anything is timed

    cfg = bench_config()
    model = MoETransformer.from_config(cfg, dtype=torch.float32, seed=0).eval()
    with tempfile.TemporaryDirectory() as d:
        save_hf(model, d)
        hf = Qwen3MoeForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    q = args.quick
    print(f"bench_moe: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, float32, "
          f"{args.threads} thread(s)\n")
    print("| workload | engine tok/s | HF tok/s | ratio | ratio in CPU s | notes |\n|---|---|---|---|---|---|")
    if "fixed" in args.only:
        fixed_batch(model, hf, cfg, (1, 8) if q else (1, 8, 32), 256, 32 if q else 128)
    if "grpo" in args.only:
        grpo(model, hf, 4 if q else 16, 8, 256, 16, 128 if q else 512)
    if "agentic" in args.only:
        n = 16 if q else 64
        agentic(model, hf, n, 4 if q else 8, 256, 32, 64,
                [("small", n * 1024 // 16 // 4), ("large", n * 1024 // 16 + 64)])
    if "long" in args.only:
        long_context((1024, 4096) if q else (1024, 32768))


if __name__ == "__main__":
    main()
