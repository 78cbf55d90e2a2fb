"""``ModelRunner.decode_step`` (a pure-tensor decode step) and ``cuda_graphs.DecodeGraphs`` on the host: rows
padded to a bucket, the block table padded to a fixed width, give the unpadded step's logits (bit for bit on
the ``cpu`` backend, within float64 summation order on ``torch``), the same tokens, the same cache bytes in
every sequence's slots (pad rows write only the scratch slot), and the full recompute's log-probs (float64);
the engine with ``decode_graphs`` gives the engine's tokens without; a push drops the graphs; the RoPE table
is built once. The CUDA capture and replay themselves: tests/gpu/test_decode_graphs.py (GPU tier)."""

from __future__ import annotations

import pytest
import torch

from jointrl.model import MoEConfig, MoETransformer
from jointrl.rl.rollout.cuda_graphs import DecodeGraphs
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.rollout.model_runner import ModelRunner
from jointrl.rl.types import SamplingParams

BS, M = 4, 6  # block size, blocks per sequence (the graphs' table width)
PROMPTS = ([5, 17, 33, 2, 250], [9, 8, 7, 6, 5, 4, 3, 2, 1], [100, 101])
STEPS = 16


def _decode(model, graphs: bool):
    """Every row fed token by token through decode steps (its prompt, then its greedy tokens) → (logits of
    each step [STEPS, B, V], each row's tokens, the cache)."""
    B = len(PROMPTS)
    runner = ModelRunner(model, num_blocks=B * M + 1, block_size=BS)
    step = DecodeGraphs(runner, M, buckets=(2, 4, 8)) if graphs else runner.decode_step
    table_BM = torch.arange(1, B * M + 1).view(B, M).flip(1)  # block 0 unused, blocks out of order
    tokens = [list(p) for p in PROMPTS]
    logits = []
    for t in range(STEPS):
        pos_B = torch.full((B,), t)
        ids_B = torch.tensor([tok[t] for tok in tokens])
        width = t // BS + 1  # the blocks this step reads: the unpadded step's table is no wider
        slot_B = table_BM[:, t // BS] * BS + t % BS
        logits_BV = step(ids_B, pos_B, slot_B, table_BM[:, :width], pos_B + 1)
        logits.append(logits_BV)
        for b, tok in enumerate(tokens):
            if len(tok) == t + 1:
                tok.append(int(logits_BV[b].argmax()))
    return torch.stack(logits), tokens, runner.kv_LPCHD.clone()


def _model(kernels: str) -> MoETransformer:
    if kernels == "cpu":
        from jointrl.kernels import decode_cpu, linear_cpu  # only to skip where the C++ kernels do not build

        if decode_cpu.load_kernel() is None or linear_cpu.load_kernel() is None:
            pytest.skip("no C++ toolchain here")
    return MoETransformer.from_config(MoEConfig(initializer_range=0.1), dtype=torch.float64, seed=3, kernels=kernels)


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_padded_static_decode_equals_unpadded_and_recompute(kernels):
    model = _model(kernels)
    ref_logits, ref_tokens, ref_kv = _decode(model, graphs=False)
    logits, tokens, kv = _decode(model, graphs=True)
    assert tokens == ref_tokens
    scratch = kv.shape[1] - 1  # ModelRunner.scratch_slot: the pad rows' (buckets of 4 for 3 rows), no sequence's
    assert ref_kv[:, scratch].eq(0).all() and kv[:, scratch].ne(0).any()
    kv, ref_kv = kv[:, :scratch], ref_kv[:, :scratch]
    if kernels == "cpu":  # every kernel keeps a row's sums to itself: bit for bit
        assert torch.equal(logits, ref_logits) and torch.equal(kv, ref_kv)
    else:
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-10)
        torch.testing.assert_close(kv, ref_kv, rtol=0, atol=1e-12)
    with torch.no_grad():  # the last step's logits against a full recompute of each row
        for b, tok in enumerate(tokens):
            full_V = model(torch.tensor([tok[:STEPS]])).logits[0, -1]
            torch.testing.assert_close(torch.log_softmax(logits[-1, b], -1), torch.log_softmax(full_V, -1),
                                       rtol=0, atol=1e-10)


def test_steps_past_the_largest_bucket_or_table_run_unpadded():
    model = _model("torch")
    runner = ModelRunner(model, num_blocks=16, block_size=BS)
    graphs = DecodeGraphs(runner, max_blocks=2, buckets=(1, 2))
    assert graphs.bucket_size(2) == 2 and graphs.bucket_size(3) is None
    ids_B, pos_B = torch.tensor([3, 4, 5]), torch.zeros(3, dtype=torch.long)
    table_BM = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    out = graphs(ids_B, pos_B, table_BM[:, 0] * BS, table_BM, pos_B + 1)  # 3 rows, 3 blocks: both too many
    assert out.shape == (3, model.config.vocab_size) and not graphs._buckets
    with pytest.raises(ValueError, match="buckets"):
        DecodeGraphs(runner, max_blocks=2, buckets=(2, 1))


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_engine_with_decode_graphs_equals_without(kernels):
    """``EngineConfig.decode_graphs``: the engine's pure decode steps through ``DecodeGraphs`` (eager on the host)
    give the same sampled tokens and log-probs as without (bit for bit on the ``cpu`` backend), over sequences of
    different lengths decoding together with chunked prefill in between."""
    model = _model(kernels)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 20, 6, 1)]
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=i) for i in range(len(prompts))]
    outs = {}
    for graphs in (False, True):
        eng = LLMEngine(model, config=EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16,
                                                   decode_graphs=graphs))
        assert (eng.runner.graphs is not None) == graphs
        outs[graphs] = eng.generate_batch(prompts, params)
        if graphs:
            assert eng.runner.graphs._buckets  # the pure decode steps went through its buckets
    for a, b in zip(outs[False], outs[True], strict=True):
        assert a.token_ids == b.token_ids
        if kernels == "cpu":
            assert a.logprobs == b.logprobs
        else:
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-10)


def test_rope_table_built_once_for_every_slot_with_decode_graphs():
    """With ``decode_graphs`` the RoPE table covers every slot's position from construction (captured graphs
    index it by address) and a step past 1024 positions does not rebuild it; without, it grows as before."""
    model = _model("torch")
    runner = ModelRunner(model, num_blocks=300, block_size=BS, decode_graphs=True)
    table = runner._rope_table
    assert table is not None and table[0].shape[0] == 300 * BS
    width = 1100 // BS + 1
    table_BM = torch.arange(width)[None]
    pos_B = torch.tensor([1100])
    runner.graphs(torch.tensor([7]), pos_B, table_BM[:, -1] * BS, table_BM, pos_B + 1)
    assert runner._rope_table is table
    plain = ModelRunner(model, num_blocks=300, block_size=BS)
    plain.decode_step(torch.tensor([7]), pos_B, table_BM[:, -1] * BS, table_BM, pos_B + 1)
    assert plain._rope_table[0].shape[0] == 2048


def test_update_weights_drops_the_graphs_and_serves_the_new_weights():
    """``LLMEngine.update_weights`` resets ``DecodeGraphs`` (buckets and pool: a captured graph would read the old
    derived copies), and the engine then decodes as a fresh one built from the pushed weights."""
    from jointrl.rl.weight_sync import build_bundle

    model = _model("torch")
    new = MoETransformer.from_config(MoEConfig(initializer_range=0.1), dtype=torch.float64, seed=4, kernels="torch")
    prompts = [[5, 17, 33], [9, 8, 7, 6, 5, 4]]
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=i) for i in range(len(prompts))]
    cfg = EngineConfig(num_blocks=32, block_size=4, decode_graphs=True)
    eng = LLMEngine(model, config=cfg)
    eng.generate_batch(prompts, params)
    graphs = eng.runner.graphs
    assert graphs._buckets
    eng.update_weights(1, build_bundle(new.state_dict(), 1, is_quantized=lambda n, t: False))
    assert eng.runner.graphs is graphs and not graphs._buckets and graphs._pool is None
    got = eng.generate_batch(prompts, params)
    want = LLMEngine(new, config=cfg).generate_batch(prompts, params)
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-10)
