"""Synthetic pretraining on a length curriculum: the loop, and the copy task the recipe warms up on.

``train_curriculum`` trains any ``MoETransformer`` on batches a task makes for a given context
length, through ``phases`` ((steps, context), in order), with dense gated-DSA attention and the
indexer's KL loss (the indexer's warm-up mode: the LM loss trains the model, the KL loss the
indexer, its input detached), AdamW with a linear warm-up and a cosine to lr/10 over the whole
run, gradients clipped at 1.0. The loss is cross-entropy on the target positions only. Two
tasks use it: associative recall (``model/associative_recall.py``, a slow test) and ``copy``
below.

**Copy** (``copy_batch``): rows of random printable bytes (32..126) in which ``spans`` spans of
3-12 bytes each appear a second time, later in the row; the loss and the accuracy are on the
repeat's bytes after its first (the first is not predictable). What it trains is the induction
circuit a policy needs to put an argument of its question into a tool call (a word, a number, a
cell): the recipe's from-scratch byte models never learned it from SFT transcripts, where such
bytes are a handful among thousands (docs/recipe.md, the copy probe). ``copy_warmup`` runs it
as the recipe's first stage (``recipe.copy_warmup``); no task, prompt or transcript of any
domain enters it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from jointrl.model.moe_transformer import MoETransformer

PRINTABLE = (32, 127)  # byte ids of ' '..'~' (the byte tokenizer's ids for them)


@dataclass(slots=True)
class CurriculumResult:
    steps: list[int] = field(default_factory=list)      # the steps evaluated
    evals: list[dict[str, float]] = field(default_factory=list)  # evaluate()'s metrics at each
    seconds: float = 0.0      # wall
    cpu_seconds: float = 0.0  # this process's CPU time (all threads)


def set_sparse(model: MoETransformer, sparse: bool) -> None:
    """Switch every gated_dsa layer between its indexer's top-k (True) and all keys (False)."""
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "sparse"):
            layer.self_attn.sparse = sparse


def target_accuracy(model: MoETransformer, ids: torch.Tensor, target: torch.Tensor, sparse: bool) -> float:
    """Greedy next-token accuracy on the ``target`` positions (token t+1 predicted at t)."""
    set_sparse(model, sparse)
    with torch.no_grad():
        pred = model(ids[:, :-1]).logits.argmax(-1)
    return (pred == ids[:, 1:])[target[:, 1:]].float().mean().item()


def train_curriculum(model: MoETransformer, make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                     phases: tuple[tuple[int, int], ...] | list, *, lr: float, warmup: int = 50, eval_every: int = 0,
                     evaluate: Callable[[int, int, dict[str, float]], dict[str, float]] | None = None,
                     log: bool = False) -> CurriculumResult:
    """Train ``model`` in place (see the module docstring); leaves it in eval mode with dense attention.

    make_batch(context) -> (ids [B, T], target [B, T] bool): the positions whose token is scored.
    evaluate(step, context, {"lm", "indexer_kl"}) -> metrics, called every ``eval_every`` steps
    (0: only at the last) and at the last step, with the model in eval mode."""
    steps = sum(n for n, _ in phases)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    coef = model.config.router_aux_loss_coef
    result = CurriculumResult()
    start, cpu_start = time.monotonic(), time.process_time()
    contexts = [ctx for n, ctx in phases for _ in range(n)]
    device = next(model.parameters()).device
    for step, ctx in enumerate(contexts, start=1):
        ids, target = (t.to(device) for t in make_batch(ctx))
        model.train()
        set_sparse(model, False)
        out = model(ids[:, :-1], return_indexer_loss=True)
        lm = F.cross_entropy(out.logits[target[:, 1:]], ids[:, 1:][target[:, 1:]])
        loss = lm + coef * out.aux_loss + (out.indexer_loss if out.indexer_loss is not None else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if evaluate is not None and ((eval_every and step % eval_every == 0) or step == steps):
            model.eval()
            losses = {"lm": lm.item(), "indexer_kl": None if out.indexer_loss is None else out.indexer_loss.item()}
            result.steps.append(step)
            result.evals.append(evaluate(step, ctx, losses))
            if log:
                shown = " | ".join(f"{k} {v:.3f}" for k, v in result.evals[-1].items() if v is not None)
                print(f"step {step:5d} (context {ctx}) | {shown} | {time.monotonic() - start:.0f}s", flush=True)
    model.eval()
    set_sparse(model, False)
    result.seconds = time.monotonic() - start
    result.cpu_seconds = time.process_time() - cpu_start
    return result


def copy_batch(batch: int, context_len: int, gen: torch.Generator, spans: int = 4, tries: int = 8
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (ids [B, context_len], target [B, context_len] bool): random printable bytes in which up to
    ``spans`` spans of 3-12 bytes each appear a second time later in the row; target marks each
    repeat's bytes after its first. A span's source and repeat never overlap another span's (each
    span takes the first of ``tries`` draws that fits; a short row holds fewer), so every marked
    byte is a copy of the byte a fixed distance before it."""
    lo, hi = PRINTABLE
    ids = torch.randint(lo, hi, (batch, context_len), generator=gen)
    target = torch.zeros(batch, context_len, dtype=torch.bool)
    for b in range(batch):
        used = torch.zeros(context_len, dtype=torch.bool)
        for _ in range(spans):
            for _ in range(tries):
                n = int(torch.randint(3, 13, (1,), generator=gen))
                if 2 * n + 1 > context_len:
                    continue
                src = int(torch.randint(0, context_len - 2 * n, (1,), generator=gen))
                dst = int(torch.randint(src + n + 1, context_len - n + 1, (1,), generator=gen))
                if used[src:src + n].any() or used[dst:dst + n].any():
                    continue
                ids[b, dst:dst + n] = ids[b, src:src + n]
                target[b, dst + 1:dst + n] = True
                used[src:src + n] = used[dst:dst + n] = True
                break
    return ids, target


def copy_warmup(model: MoETransformer, phases: list[tuple[int, int]] | list[list[int]], *, lr: float = 1e-3,
                batch: int = 32, seed: int = 0, eval_every: int = 0, log: bool = False) -> CurriculumResult:
    """Train ``model`` in place on the copy task through ``phases``; evaluated on 32 rows of 64 and
    of the last phase's context, dense and sparse (``acc@<T>``, ``acc@<T>_sparse``), from a
    generator of ``seed + 1`` (the training rows come from ``seed``'s). Deterministic for a seed
    on one thread. Leaves the model's gated_dsa layers sparse again where its config says so."""
    phases = [(int(n), int(t)) for n, t in phases]
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    held = {t: tuple(x.to(device) for x in copy_batch(32, t, torch.Generator().manual_seed(seed + 1)))
            for t in sorted({64, phases[-1][1]})}

    def evaluate(step: int, ctx: int, losses: dict[str, float]) -> dict[str, float]:
        metrics = {"lm": losses["lm"]}
        for t, (ids, target) in held.items():
            metrics[f"acc@{t}"] = target_accuracy(model, ids, target, sparse=False)
            metrics[f"acc@{t}_sparse"] = target_accuracy(model, ids, target, sparse=True)
        return metrics

    result = train_curriculum(model, lambda ctx: copy_batch(batch, ctx, gen), phases, lr=lr,
                              eval_every=eval_every, evaluate=evaluate, log=log)
    set_sparse(model, model.config.dsa_mode == "sparse")
    return result
