"""Associative recall: does gated DSA's top-k find the one key that matters in a long context?

Task (multi-query associative recall, as Zoology's MQAR, byte vocabulary): a context of
`context_len` tokens holds `num_pairs` key–value pairs (k v, adjacent) at random places among
filler tokens; then `SEP` and every key once more in a random order, each followed by its value:

    … f f k₁ v₁ f … f k₂ v₂ f f … SEP  k₂ v₂  k₁ v₁ …
                                        ^^     ^^      loss / accuracy on these value tokens

Keys, values and fillers come from disjoint id ranges, so a value is recoverable only by finding
where its key sat in the context: attention must reach back across ≥ 8 × top-k tokens.

Experiment (`run`): one `tiny_hybrid`-shaped model trained with dense gated-DSA attention (the
indexer's warm-up mode: the LM loss trains the model, the KL loss trains the indexer, its input
detached), and evaluated every `eval_every` steps twice, with the same weights: dense (every key)
and sparse (the indexer's top-k only). Sparse within a few points of dense means the indexer picks
the keys attention needs. `python -m jointrl.model.associative_recall` prints both curves.

Training follows a length curriculum (`phases`): the recall circuit (a previous-token feature at
each value, then a key match from the query) forms only after a plateau at chance, which costs
fewer CPU-seconds on short contexts; the last phase trains at the evaluated context. The task, the
model and the evaluation (context 8 x top-k, sparse vs dense) are unchanged by it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from jointrl.model.config import MoEConfig
from jointrl.model.moe_transformer import MoETransformer
from jointrl.model.pretrain import target_accuracy, train_curriculum

KEYS = range(65, 97)     # 32 key ids ('A'..'`')
VALUES = range(97, 129)  # 32 value ids ('a'..)
FILLER = range(0, 64)    # 64 filler ids
SEP = 255


def make_batch(batch: int, context_len: int, num_pairs: int, gen: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (ids [B, context_len + 1 + 2·num_pairs], target mask [B, same] True on the queried values).

    Predict token t+1 from position t: a value is scored where its query key is the input.
    """
    if num_pairs > len(KEYS) or 2 * num_pairs > context_len:
        raise ValueError(f"num_pairs={num_pairs} must be <= {len(KEYS)} and fit twice into context_len={context_len}")
    T = context_len + 1 + 2 * num_pairs
    ids = torch.tensor(FILLER)[torch.randint(0, len(FILLER), (batch, T), generator=gen)]
    target = torch.zeros(batch, T, dtype=torch.bool)
    for b in range(batch):
        keys = torch.tensor(KEYS)[torch.randperm(len(KEYS), generator=gen)[:num_pairs]]
        values = torch.tensor(VALUES)[torch.randint(0, len(VALUES), (num_pairs,), generator=gen)]
        # Non-overlapping pair slots: choose num_pairs of the context_len // 2 even offsets.
        slots = torch.randperm(context_len // 2, generator=gen)[:num_pairs] * 2
        ids[b, slots], ids[b, slots + 1] = keys, values
        ids[b, context_len] = SEP
        order = torch.randperm(num_pairs, generator=gen)
        q0 = context_len + 1
        ids[b, q0::2], ids[b, q0 + 1::2] = keys[order], values[order]
        target[b, q0 + 1::2] = True
    return ids, target


@dataclass(slots=True)
class RecallResult:
    steps: list[int]
    dense_acc: list[float]   # accuracy on queried values, dense attention
    sparse_acc: list[float]  # same weights, the indexer's top-k only
    indexer_kl: list[float]  # training indexer loss at each eval point
    seconds: float           # wall
    cpu_seconds: float = 0.0  # this process's CPU time (all threads)


def run(config: MoEConfig | None = None, phases: tuple[tuple[int, int], ...] = ((1000, 16), (700, 64), (300, 256)),
        batch: int = 32, num_pairs: int = 8, lr: float = 3e-3, warmup: int = 50, eval_every: int = 100,
        eval_batch: int = 64, seed: int = 0, log: bool = False) -> RecallResult:
    """Train dense (plain torch AdamW), evaluate dense and sparse; see the module docstring.

    phases: (steps, context_len) in order, a length curriculum: most steps on short contexts (a
        16-token context holds the 8 pairs and no filler; a step there costs ~1/10 of one at 256),
        then the context the task is about. Evaluation always uses the last phase's context_len,
        which must be >= 8 x the DSA top-k; only those accuracies count.
    lr: AdamW peak, linear warm-up over `warmup` steps, then cosine decay to lr/10 at the end.

    The default config is `tiny_hybrid` with KDA chunks of 32 (a speed knob only: chunked KDA is exact
    for any chunk size).
    """
    config = config or MoEConfig.preset("tiny_hybrid", kda_chunk_size=32)
    context_len = phases[-1][1]
    if context_len < 8 * config.index_topk:
        raise ValueError(f"the last phase's context_len={context_len} must be >= 8 x index_topk={config.index_topk}")
    steps = sum(n for n, _ in phases)
    torch.manual_seed(seed)
    model = MoETransformer.from_config(dataclasses.replace(config, dsa_mode="dense"), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    eval_ids, eval_target = make_batch(eval_batch, context_len, num_pairs, torch.Generator().manual_seed(seed + 1))
    result = RecallResult([], [], [], [], 0.0)

    def evaluate(step: int, ctx: int, losses: dict[str, float]) -> dict[str, float]:
        dense = target_accuracy(model, eval_ids, eval_target, sparse=False)
        sparse = target_accuracy(model, eval_ids, eval_target, sparse=True)
        result.steps.append(step)
        result.dense_acc.append(dense)
        result.sparse_acc.append(sparse)
        result.indexer_kl.append(losses["indexer_kl"])
        return {"lm": losses["lm"], "indexer KL": losses["indexer_kl"], f"acc@{context_len} dense": dense,
                f"acc@{context_len} sparse": sparse}

    run_ = train_curriculum(model, lambda ctx: make_batch(batch, ctx, num_pairs, gen), phases, lr=lr, warmup=warmup,
                            eval_every=eval_every, evaluate=evaluate, log=log)
    result.seconds, result.cpu_seconds = run_.seconds, run_.cpu_seconds
    return result


if __name__ == "__main__":
    run(log=True)
