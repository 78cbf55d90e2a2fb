"""Part 2 of the prepared GPU check (``tests/gpu/check.sh``): the own engine on the device against
Hugging Face ``generate`` on the same device, then one colocated step, in one process without Ray,
DeepSpeed or Hydra (the lent GPU machine has none of them).

Model: random weights, Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query / 4 KV heads of 128, 128
experts of width 768, top-8, vocabulary 151936) and 4 layers, bfloat16, on the ``triton`` kernel backend
(``model.kernels``: the engine's decode and prefill attention through ``kernels/paged_attention``'s kernels;
each section asserts its engine's op table is Triton's). ``--dry``: the same code on the host at tiny
shapes, the kernels in Triton's interpreter (check.sh sets ``TRITON_INTERPRET=1``; a check that the script
works, not a measurement).

1. engine vs HF ``generate`` (greedy-free sampling, EOS ignored on both sides), generated tok/s and
   their ratio: *fixed* (one batch, equal prompts, exactly N new tokens), *GRPO* (groups of samples
   of each prompt, per-request max_tokens drawn from a range; HF runs each group as a static batch to
   its longest request), *agentic* (trajectories of several turns, each turn a generation then an
   observation appended; the engine keeps each trajectory's session, HF prefills every history again).
2. decode graphs: the engine with ``decode_graphs`` (pure decode steps replayed from CUDA graphs per bucket,
   ``rl/rollout/cuda_graphs.py``; eager through the same padded buffers on the host) against the same engine
   without, greedy: asserts equal tokens, prints tok/s of both and the largest log-prob difference.
3. colocated step (``rl/colocate.py``): engine rollout → learner forward/backward/AdamW → MXFP4 push
   built on the device → engine; asserts every parameter, optimizer state, KV pool and push payload is
   on the device, and prints the log-prob mismatch (engine vs learner on the sampled tokens after the
   push).

Each section reports FAIL with its error and the others still run; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
import traceback

import torch

from jointrl.rl.build import build_model, build_tokenizer
from jointrl.rl.colocate import Colocated, train_batch
from jointrl.rl.config import Config, DomainConfig, EnvsConfig, LearnerConfig, ModelConfig
from jointrl.rl.device import HOST, rank_device
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.types import SamplingParams

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, rope_theta=1e6,
                     max_position_embeddings=40960)
TINY = dict(vocab_size=264, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
# (fixed: batch, prompt, new), (GRPO: prompts, samples, prompt, min new, max new), (agentic: trajectories, turns, gen, obs)
SIZES = {"gpu": ((32, 256, 128), (8, 8, 256, 16, 256), (16, 4, 32, 64)),
         "dry": ((2, 8, 4), (2, 2, 8, 2, 6), (2, 2, 3, 4))}


def config(dry: bool) -> Config:
    """The check's config, built in code (no Hydra on the GPU machine)."""
    shape = TINY if dry else QWEN3_30B_A3B
    return Config(model=ModelConfig(name="check", dtype="bfloat16", num_hidden_layers=4, kernels="triton", **shape),
                  envs=EnvsConfig(domains={"terminal": DomainConfig()}),
                  learner=LearnerConfig(lr=1e-5, grad_clip=1.0))


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def hf_generate(hf, batch: list[list[int]], new: int, device: torch.device) -> None:
    S = max(map(len, batch))
    ids = torch.zeros(len(batch), S, dtype=torch.long)
    mask = torch.zeros(len(batch), S, dtype=torch.long)
    for b, p in enumerate(batch):  # left padding
        ids[b, S - len(p):], mask[b, S - len(p):] = torch.tensor(p), 1
    hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new, do_sample=True,
                top_p=None, top_k=None, eos_token_id=None, pad_token_id=0)


def timed(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def engine_vs_hf(cfg: Config, device: torch.device, dry: bool) -> list[str]:
    (fb, fp, fn), (gp, gs, gl, lo, hi), (at, turns, gen, obs) = SIZES["dry" if dry else "gpu"]
    model = build_model(cfg, device)
    engine = LLMEngine(model, build_tokenizer(cfg), EngineConfig(num_blocks=4096 if not dry else 64, block_size=16,
                                                                  max_num_seqs=256, max_num_batched_tokens=4096,
                                                                  ignore_eos=True), device=device)
    assert engine.runner.kernels.backend == "triton", engine.runner.kernels.backend
    try:
        from transformers import AutoModelForCausalLM

        from jointrl.model.hf import save_hf  # only with transformers: the HF side of the comparison
        with tempfile.TemporaryDirectory() as d:
            save_hf(model, d)
            hf = AutoModelForCausalLM.from_pretrained(d, dtype=model.lm_head.weight.dtype).to(device).eval()
    except ImportError as e:
        hf = None
        print(f"HF generate: not importable here ({e}): engine only")
    rows = []

    def row(name: str, tokens: int, engine_run, hf_run) -> None:
        t_e = timed(engine_run, device)
        t_h = timed(hf_run, device) if hf is not None else float("nan")
        rows.append(f"{name:<34}{tokens:>8}{tokens / t_e:>12.1f}{tokens / t_h:>12.1f}{t_h / t_e:>8.2f}")

    fixed = prompts(fb, fp, 0)
    row(f"fixed B{fb} prompt {fp} new {fn}", fb * fn,
        lambda: engine.generate_batch(fixed, [SamplingParams(max_tokens=fn, seed=i) for i in range(fb)]),
        lambda: hf_generate(hf, fixed, fn, device))
    g = torch.Generator().manual_seed(1)
    group = prompts(gp, gl, 1)
    lengths = [[int(torch.randint(lo, hi + 1, (), generator=g)) for _ in range(gs)] for _ in range(gp)]
    grpo_prompts = [p for p in group for _ in range(gs)]
    grpo_params = [SamplingParams(max_tokens=n, seed=i) for i, n in enumerate(x for ls in lengths for x in ls)]
    row(f"GRPO {gp}x{gs} prompt {gl} new {lo}-{hi}", sum(map(sum, lengths)),
        lambda: engine.generate_batch(grpo_prompts, grpo_params),
        lambda: [hf_generate(hf, [p] * gs, max(ls), device) for p, ls in zip(group, lengths)])
    histories = prompts(at, gl, 2)

    def agentic_engine() -> None:
        hist = [list(h) for h in histories]
        for t in range(turns):
            outs = engine.generate_batch(hist, [SamplingParams(max_tokens=gen, seed=i) for i in range(at)])
            for i, (h, o) in enumerate(zip(hist, outs)):
                h += o.token_ids + prompts(1, obs, 100 * t + i)[0]

    def agentic_hf() -> None:
        hist = [list(h) for h in histories]
        for t in range(turns):
            hf_generate(hf, hist, gen, device)  # the generated ids are not needed: the next prompt is random
            for i, h in enumerate(hist):
                h += [0] * gen + prompts(1, obs, 100 * t + i)[0]

    row(f"agentic {at} traj x {turns} turns, {gen}+{obs}", at * turns * gen, agentic_engine, agentic_hf)
    return [f"engine kernels: {engine.runner.kernels.backend} (paged decode and prefill attention: Triton)",
            f"{'engine vs HF generate':<34}{'tokens':>8}{'engine t/s':>12}{'HF t/s':>12}{'ratio':>8}", *rows]


def decode_graphs_on_off(cfg: Config, device: torch.device, dry: bool) -> list[str]:
    fb, fp, fn = SIZES["dry" if dry else "gpu"][0]
    model = build_model(cfg, device)
    base = EngineConfig(num_blocks=4096 if not dry else 64, block_size=16, max_num_seqs=256,
                        max_num_batched_tokens=4096, ignore_eos=True)
    batch = prompts(fb, fp, 5)
    params = [SamplingParams(max_tokens=fn, temperature=0)] * fb
    outs, rates = {}, {}
    for graphs in (False, True):
        engine = LLMEngine(model, build_tokenizer(cfg), dataclasses.replace(base, decode_graphs=graphs), device=device)
        assert engine.runner.kernels.backend == "triton", engine.runner.kernels.backend
        engine.generate_batch(batch, params)  # warm-up: kernels compiled, graphs captured
        outs[graphs] = engine.generate_batch(batch, params)
        rates[graphs] = fb * fn / timed(lambda: engine.generate_batch(batch, params), device)
        if graphs:
            buckets = engine.runner.graphs._buckets
            captured = sum(b.graph is not None for b in buckets.values())
            assert buckets and (captured == len(buckets) if device.type == "cuda" else captured == 0)
    same = sum(a.token_ids == b.token_ids for a, b in zip(outs[False], outs[True]))
    diff = max(abs(x - y) for a, b in zip(outs[False], outs[True]) for x, y in zip(a.logprobs, b.logprobs))
    assert same == fb, f"decode graphs changed the greedy tokens of {fb - same} of {fb} sequences"
    return [f"decode graphs (B{fb} prompt {fp} new {fn}, greedy): tokens equal in {same}/{fb}; {len(buckets)} buckets "
            f"({captured} captured); tok/s off {rates[False]:.1f}, on {rates[True]:.1f} (x{rates[True] / rates[False]:.2f}); "
            f"max |Δ log-prob| {diff:.3e}"]


def colocated_step(cfg: Config, device: torch.device, dry: bool) -> list[str]:
    col = Colocated(cfg, EngineConfig(num_blocks=512 if not dry else 64, block_size=16, max_num_seqs=64),
                    device=device, offload_weights=True)
    assert col.engine.runner.kernels.backend == "triton", col.engine.runner.kernels.backend
    batch_prompts = prompts(4, 16 if not dry else 6, 3)
    params = [SamplingParams(max_tokens=32 if not dry else 4, seed=i) for i in range(len(batch_prompts))]
    outs = col.rollout(batch_prompts, params)
    t = timed(lambda: col.train(train_batch(batch_prompts, outs, [1.0, -1.0, 0.5, -0.5])), device)
    outs = col.rollout(batch_prompts, params)
    learner = col.learner.logprobs([p + o.token_ids for p, o in zip(batch_prompts, outs)])
    diff = max(abs(a - b) for p, o, lp in zip(batch_prompts, outs, learner) for a, b in zip(o.logprobs, lp[len(p):]))
    tensors = {**{f"learner {k}": v for k, v in col.setup.engine.module.state_dict().items()},
               **{f"adamw {k}": v for st in col.setup.engine.optimizer.state.values() for k, v in st.items()
                  if isinstance(v, torch.Tensor) and v.dim() > 0},
               **{f"engine {k}": v for k, v in col.engine.model.state_dict().items()},
               "kv pool": col.engine.runner.kv_LPCHD, "index pool": col.engine.runner.index_LPD,
               **{f"push {e.name}": e.data for b in col.last_push.buckets for e in b.entries}}
    off = sorted(k for k, v in tensors.items() if v.device.type != device.type)
    assert not off, f"tensors off {device}: {off[:8]}"
    return [f"colocated step on {device}: {len(tensors)} tensors all on {device.type}; learner step + push "
            f"{t:.2f} s; push {col.last_push.total_bytes / 2**20:.1f} MiB; engine vs learner log-prob mismatch "
            f"max |Δ| {diff:.3e} over the sampled tokens after the push"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="on the host, tiny shapes")
    args = parser.parse_args()
    device = HOST if args.dry else rank_device()
    if not args.dry and device.type != "cuda":
        raise SystemExit("no GPU visible to torch: run with --dry on the host")
    torch.manual_seed(0)
    cfg = config(args.dry)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'host (--dry)'}; "
          f"model {cfg.model.num_hidden_layers} layers, hidden {cfg.model.hidden_size}, {cfg.model.num_experts} experts")
    failed = False
    for name, section in (("engine vs HF", engine_vs_hf), ("decode graphs", decode_graphs_on_off),
                          ("colocated step", colocated_step)):
        t0 = time.perf_counter()
        try:
            lines = section(cfg, device, args.dry)
        except Exception:  # noqa: BLE001 -- report the section and go on to the next
            failed = True
            lines = [f"FAIL {name}:", *traceback.format_exc().splitlines()[-12:]]
        print("\n".join(lines) + f"\n({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main())
