"""A GRPO group's prompt forwarded once (``collate_shared`` + ``learner_forward(prefix=...)``) gives
the unshared forward's log-probs and, through real DeepSpeed, the unshared update (float64)."""

import pytest
import torch

from jointrl.model import MoEConfig, MoETransformer
from jointrl.rl.build import build_model
from jointrl.rl.config import load_config
from jointrl.rl.learner.batch import TrainBatch, collate, collate_shared, logprobs_from_logits, micro_batches
from jointrl.rl.learner.forward import learner_forward, token_entropy
from jointrl.rl.learner.worker import LearnerWorker

_PORT = [29850]
BASE = ["model.dtype=float64", "learner.eps=1.0", "learner.grad_clip=0.0"]


def _batch() -> TrainBatch:
    """Two groups (prompts of 5 and 8 tokens, 3 completions each, ragged) around a lone sequence,
    one completion ending in untrained tokens (a tool observation)."""
    g = torch.Generator().manual_seed(7)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    p5, p8 = rand(5), rand(8)
    seqs = [p5 + rand(4), p8 + rand(9), p5 + rand(7), rand(3) + rand(6), p8 + rand(2), p5 + rand(5), p8 + rand(6)]
    starts = [5, 8, 5, 3, 8, 5, 8]
    masks = [[0] * p + [1] * (len(s) - p) for s, p in zip(seqs, starts)]
    masks[2][-2:] = [0, 0]
    old = [[0.0 if m == 0 else -5.5 + 0.05 * i for i, m in enumerate(mk)] for mk in masks]
    return TrainBatch(seqs, masks, old, [1.0, -0.5, 0.25, -1.0, 0.5, -0.75, 1.5])


def test_collate_shared_groups_equal_prompts():
    batch = _batch()
    mb = collate_shared(batch, 0, torch.float64)
    assert mb.prefix.ids.shape == (3, 8) and mb.prefix.row_group.tolist() == [0, 1, 0, 2, 1, 0, 1]
    assert mb.prefix.real.sum(1).tolist() == [5, 8, 3]
    assert mb.input_ids[0, 0] == batch.token_ids[0][4] and mb.pos[1, :3].tolist() == [7, 8, 9]
    assert mb.loss_mask.sum() == batch.num_loss_tokens
    assert collate_shared(batch.select([0, 1, 3]), 0, torch.float64) is None  # nothing shared
    assert collate_shared(TrainBatch([[1, 2], [1, 3]], [[0, 0], [0, 1]], [[0.0] * 2] * 2, [0.0, 0.0]), 0,
                          torch.float64) is None  # a sequence without loss tokens


HYBRID = ["model=tiny_hybrid", "model.index_topk=4", "model.kda_chunk_size=4", "model.dsa_query_chunk=5"]
# Kimi-Linear's shape: 3 KDA : 1 MLA (latent cache, q through q_lora_rank), dense first MLP, shared expert
KIMI = ["model=tiny_hybrid", "model.kda_chunk_size=4", "model.layer_types=[kda,kda,kda,mla]",
        "model.first_k_dense_replace=1", "model.q_lora_rank=12"]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("model", [[], ["model.first_k_dense_replace=1", "model.n_shared_experts=1"], HYBRID, KIMI],
                         ids=["moe", "dense_first", "hybrid", "kimi_linear"])
def test_shared_forward_equals_unshared(model, fused, monkeypatch):
    """Every trained token's log-prob and entropy, and the gradients, equal the unshared forward's
    (also with a dense first layer and a shared expert; and for the hybrid, whose KDA and DSA layers
    continue from a cache of the prompts: top-4 keys, 4-token KDA chunks, so the rows' queries
    select among prompt keys and the KDA state is handed over mid-chunk); with the C++ norm / q/k-norm
    + RoPE kernel and with the modules' own (``fused=False``: no compiler)."""
    if not fused:
        monkeypatch.setattr("jointrl.kernels.norm_rope_cpu.usable", lambda x: False)
    torch.manual_seed(0)
    model = build_model(load_config(["model.dtype=float64", *model]))
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    batch = _batch()
    outs = []
    for mb in (collate(batch, False, 0, torch.float64), collate_shared(batch, 0, torch.float64)):
        model.zero_grad()
        fwd = learner_forward(model, mb.input_ids, mb.pos, mb.seg, prefix=mb.prefix)
        lp = logprobs_from_logits(fwd.logits_BTV, mb.input_ids)
        ent = token_entropy(fwd.logits_BTV)
        (lp * mb.loss_mask * mb.adv).sum().backward()
        sel = mb.loss_mask > 0  # row-major: the same tokens in the same order either way
        outs.append((lp[sel], ent[sel], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (lp0, ent0, g0), (lp1, ent1, g1) = outs
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=1e-12)
    assert g1.keys() == g0.keys()  # the hybrid's indexer gets none either way (no indexer loss here)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-9, atol=1e-12, msg=n)


def _update(share: bool, *overrides):
    cfg = load_config([*BASE, *overrides])
    _PORT[0] += 1
    lw = LearnerWorker(cfg, 0, 1, "127.0.0.1", _PORT[0])
    assert lw.setup.share_prefix
    lw.setup.share_prefix = share
    init = build_model(cfg).state_dict()
    batch = _batch()
    m = lw.train_step(batch, batch.num_loss_tokens, batch.num_loss_seqs)
    return m, {k: v - init[k] for k, v in lw.engine.module.state_dict().items()}


@pytest.mark.parametrize("overrides", [["learner.micro_batch_size=3"],
                                       ["learner.micro_batch_size=0", "algo.aggregation=seq_mean", "algo.kl_coef=0.1"],
                                       # the router-bias update, the balance loss and gated_dsa's indexer
                                       # loss (learner.indexer_loss_coef = 1) count prompt tokens per row
                                       [*HYBRID, "learner.micro_batch_size=3", "learner.aux_loss_coef=0.01"]])
def test_update_equals_unshared(overrides):
    ref_m, ref = _update(False, *overrides)
    m, d = _update(True, *overrides)
    assert ("indexer_kl" in m) == ("indexer_kl" in ref_m) == ("model=tiny_hybrid" in overrides)
    for key in ("loss", "clip_frac", "approx_kl", "entropy", "indexer_kl"):
        if key not in ref_m:
            continue
        assert m[key] == pytest.approx(ref_m[key], rel=1e-9, abs=1e-12), key
    for k in ref:
        torch.testing.assert_close(d[k], ref[k], rtol=1e-4, atol=2.5e-7, msg=k)


def test_distinct_prompts_share_their_common_prefix():
    """SFT transcripts of one domain have distinct instructions but one system prompt: the rows
    share that (one group), their own instructions go in the rows, and for the hybrid every
    trained token's log-prob and every gradient equal the unshared forward's."""
    g = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    system = rand(40)
    prompts = [system + rand(n) for n in (3, 6, 2)]
    seqs = [p + rand(n) for p, n in zip(prompts, (5, 9, 4))]
    masks = [[0] * len(p) + [1] * (len(s) - len(p)) for p, s in zip(prompts, seqs)]
    batch = TrainBatch(seqs, masks, [[0.0] * len(s) for s in seqs], [1.0, 1.0, 1.0])
    mb = collate_shared(batch, 0, torch.float64)
    assert mb.prefix.ids.shape == (1, 40) and mb.prefix.row_group.tolist() == [0, 0, 0]
    assert mb.loss_mask.sum() == batch.num_loss_tokens
    assert collate_shared(TrainBatch([s[30:] for s in seqs], [m[30:] for m in masks], [[0.0] * 40] * 3,
                                     [1.0] * 3), 0, torch.float64) is None  # 10 common tokens: not worth it
    torch.manual_seed(0)
    model = build_model(load_config(["model.dtype=float64", *HYBRID]))
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    outs = []
    for m in (collate(batch, False, 0, torch.float64), mb):
        model.zero_grad()
        lp = logprobs_from_logits(learner_forward(model, m.input_ids, m.pos, m.seg, prefix=m.prefix).logits_BTV, m.input_ids)
        (lp * m.loss_mask).sum().backward()
        outs.append((lp[m.loss_mask > 0], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (lp0, g0), (lp1, g1) = outs
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-12)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-9, atol=1e-12, msg=n)


def test_micro_batches_do_not_straddle_system_prompts():
    """An SFT step's transcripts, ordered by domain: 3 of one system prompt, then 5 of another, in
    micro-batches of 4 -> [3], [4], [1] (not [3 + 1], [4]: a mixed micro-batch shares nothing), the
    sequences' order kept."""
    g = torch.Generator().manual_seed(5)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    sys_a, sys_b = rand(50), rand(40)
    seqs = [sys_a + rand(10 + i) for i in range(3)] + [sys_b + rand(5 + i) for i in range(5)]
    masks = [[0] * (len(s) - 4) + [1] * 4 for s in seqs]
    batch = TrainBatch(seqs, masks, [[0.0] * len(s) for s in seqs], [1.0] * 8)
    mbs = micro_batches(batch, 4, 0, torch.float64, share_prefix=True)
    assert [mb.num_seqs for mb in mbs] == [3, 4, 1]
    assert [mb.prefix.ids.shape[1] if mb.prefix is not None else 0 for mb in mbs] == [50, 40, 0]
    assert [mb.num_seqs for mb in micro_batches(batch, 4, 0, torch.float64)] == [4, 4]


def test_hybrid_one_token_prompts_share_an_empty_cache():
    """Prompts of one token leave nothing to cache (P0 = 0: the prompt's last token is each row's
    column 0); the rows then run from an empty cache and everything, the indexer loss included,
    equals the unshared forward's."""
    g = torch.Generator().manual_seed(9)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    p, q = rand(1), rand(1)
    seqs = [p + rand(6), p + rand(9), q + rand(3), q + rand(5)]
    batch = TrainBatch(seqs, [[0] + [1] * (len(s) - 1) for s in seqs], [[0.0] * len(s) for s in seqs],
                       [1.0, -1.0, 0.5, 0.25])
    torch.manual_seed(0)
    model = build_model(load_config(["model.dtype=float64", *HYBRID]))
    for prm in model.parameters():
        prm.data.normal_(0, 0.05)
    outs = []
    for mb in (collate(batch, False, 0, torch.float64), collate_shared(batch, 0, torch.float64)):
        model.zero_grad()
        fwd = learner_forward(model, mb.input_ids, mb.pos, mb.seg, prefix=mb.prefix, indexer_loss=True)
        lp = logprobs_from_logits(fwd.logits_BTV, mb.input_ids)
        ((lp * mb.loss_mask * mb.adv).sum() + fwd.indexer_loss).backward()
        outs.append((lp[mb.loss_mask > 0], fwd.indexer_loss.detach(),
                     {n: prm.grad.clone() for n, prm in model.named_parameters() if prm.grad is not None}))
    assert collate_shared(batch, 0, torch.float64).prefix.ids.shape == (2, 1)
    (lp0, il0, g0), (lp1, il1, g1) = outs
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-12)
    torch.testing.assert_close(il1, il0, rtol=1e-9, atol=1e-15)
    assert g1.keys() == g0.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-9, atol=1e-12, msg=n)


def test_micro_batch_runs_keep_the_batch_order():
    """``LearnerWorker.logprobs`` reads sequences back in micro-batch order: system prompts that
    alternate (A, B, A) make three runs, not two, and the sequences come out in the batch's order."""
    g = torch.Generator().manual_seed(6)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    sys_a, sys_b = rand(40), rand(40)
    seqs = [s + rand(5 + i) for i, s in enumerate((sys_a, sys_a, sys_b, sys_b, sys_a, sys_a))]
    masks = [[0] * (len(s) - 3) + [1] * 3 for s in seqs]
    batch = TrainBatch(seqs, masks, [[0.0] * len(s) for s in seqs], [1.0] * 6)
    mbs = micro_batches(batch, 4, 0, torch.float64, share_prefix=True)
    assert [mb.num_seqs for mb in mbs] == [2, 2, 2]
    got = [mb.input_ids[b, 1:int((mb.seg[b] >= 0).sum())].tolist() for mb in mbs for b in range(mb.num_seqs)]
    assert got == [s[40:] for s in seqs]


def test_grpo_groups_of_alternating_domains_keep_full_micro_batches():
    """Whole-prompt groups (GRPO) are planned as they come, whatever their system prompts: 2 tasks
    x 4 completions from two domains, alternating, in micro-batches of 8 -> one micro-batch."""
    g = torch.Generator().manual_seed(9)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    prompts = [rand(40) + rand(5), rand(40) + rand(6)]
    seqs = [prompts[i % 2] + rand(3 + i) for i in range(8)]
    masks = [[0] * len(prompts[i % 2]) + [1] * (len(s) - len(prompts[i % 2])) for i, s in enumerate(seqs)]
    batch = TrainBatch(seqs, masks, [[0.0] * len(s) for s in seqs], [1.0] * 8)
    mbs = micro_batches(batch, 8, 0, torch.float64, share_prefix=True)
    assert [mb.num_seqs for mb in mbs] == [8] and mbs[0].prefix.ids.shape[0] == 2


def test_one_token_completions():
    """Every row of a micro-batch one token past its prompt (T = 2: the rows have no column
    between the prompt's last token and the dropped last column, S = 0): the shared forward runs
    and its log-probs and gradients equal the unshared forward's."""
    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    p, q = rand(5), rand(3)
    seqs = [p + rand(1), p + rand(1), q + rand(1), q + rand(1)]
    starts = [5, 5, 3, 3]
    batch = TrainBatch(seqs, [[0] * s + [1] for s in starts], [[0.0] * len(s) for s in seqs], [1.0, -1.0, 0.5, -0.5])
    torch.manual_seed(0)
    model = build_model(load_config(["model.dtype=float64"]))
    for prm in model.parameters():
        prm.data.normal_(0, 0.05)
    outs = []
    for mb in (collate(batch, False, 0, torch.float64), collate_shared(batch, 0, torch.float64)):
        model.zero_grad()
        lp = logprobs_from_logits(learner_forward(model, mb.input_ids, mb.pos, mb.seg, prefix=mb.prefix).logits_BTV,
                                  mb.input_ids)
        (lp * mb.loss_mask * mb.adv).sum().backward()
        outs.append((lp[mb.loss_mask > 0], {n: prm.grad.clone() for n, prm in model.named_parameters() if prm.grad is not None}))
    assert collate_shared(batch, 0, torch.float64).input_ids.shape == (4, 2)
    (lp0, g0), (lp1, g1) = outs
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-12)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-9, atol=1e-12, msg=n)


def test_sink_attention_shares_prompts_through_the_cache():
    """gpt-oss-shaped layers (``full`` kind with attention sinks and biases, ``SinkAttention``) have no flat
    shared-prompt form (their sinks are outside ``_SharedLayout``'s attention): they share prompts through the
    prompts' cache, and every trained token's log-prob equals the unshared forward's (float64)."""
    cfg = MoEConfig(layer_types=("full", "full"), num_hidden_layers=2, attention_sinks=True, attention_bias=True,
                    vocab_size=264)
    model = MoETransformer.from_config(cfg, dtype=torch.float64, seed=1)
    for name, p in model.named_parameters():
        if name.endswith("sinks"):  # sinks that matter (0 at init)
            p.data.normal_(0, 1.0)
    batch = _batch()
    lps = []
    for mb in (collate(batch, False, 0, torch.float64), collate_shared(batch, 0, torch.float64)):
        fwd = learner_forward(model, mb.input_ids, mb.pos, mb.seg, prefix=mb.prefix)
        lps.append(logprobs_from_logits(fwd.logits_BTV, mb.input_ids)[mb.loss_mask > 0])
    torch.testing.assert_close(lps[1], lps[0], rtol=0, atol=1e-12)
