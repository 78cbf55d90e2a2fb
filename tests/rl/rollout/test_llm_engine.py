"""The fast engine against a plain full-recompute decode of the same model, in float64:
greedy tokens equal and log-probs within 1e-10 across chunked prefill, sessions, shared
prefill, preemption, eviction and weight updates; plus the memory accounting behind them."""

import asyncio

import pytest
import torch

from jointrl.model import MoEConfig, MoETransformer
from jointrl.rl.learner.batch import token_logprobs
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.types import ROUTE_DTYPE, SamplingParams
from jointrl.rl.weight_sync import build_bundle

GREEDY = SamplingParams(max_tokens=12, temperature=0)
IM_END = 258


def make_model(seed: int = 1) -> MoETransformer:
    return MoETransformer.from_config(MoEConfig(initializer_range=0.1), dtype=torch.float64, seed=seed)


@pytest.fixture(scope="module")
def model():
    return make_model()


def reference(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy decode recomputing the whole sequence every token (no cache at all)."""
    ids, out, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits_V = model(torch.tensor([ids])).logits[0, -1].double()
            t = int(logits_V.argmax())
            out.append(t)
            lps.append(float(torch.log_softmax(logits_V, -1)[t]))
            ids.append(t)
            if t == IM_END:
                break
    return out, lps


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def assert_matches(model, prompt, out, max_tokens=GREEDY.max_tokens):
    ref_ids, ref_lps = reference(model, prompt, max_tokens)
    assert out.token_ids == ref_ids
    assert out.logprobs == pytest.approx(ref_lps, abs=1e-10)


def engine(model, **kw) -> LLMEngine:
    kw = {"num_blocks": 128, "block_size": 4, "max_num_batched_tokens": 16, **kw}
    return LLMEngine(model, config=EngineConfig(**kw))


def test_batch_with_chunked_prefill_equals_full_recompute(model):
    eng = engine(model)
    ps = prompts(1, 5, 17, 40, 3)
    for p, out in zip(ps, eng.generate_batch(ps, [GREEDY] * len(ps))):
        assert_matches(model, p, out)
    assert eng.block_manager.num_free + sum(len(s.block_table) for s in eng.scheduler.idle.values()) == 128


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_projections_equal_f_linear(dtype):
    """The runner's dense projections through kernels/linear_cpu (a few rows) against its F.linear path:
    the same sampled tokens, log-probs within summation order (float64: 1e-10, float32: 1e-4)."""
    from jointrl.kernels import linear_cpu

    if linear_cpu.load_kernel() is None:
        pytest.skip("no C++ toolchain here")
    model = MoETransformer.from_config(MoEConfig(initializer_range=0.1), dtype=dtype, seed=2)
    ps = prompts(3, 9, 20, 1, seed=4)
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=i) for i in range(len(ps))]
    outs = {}
    for packed in (True, False):
        eng = engine(model, max_num_batched_tokens=64)
        assert eng.runner.packed_linear
        eng.runner.packed_linear = packed
        outs[packed] = eng.generate_batch(ps, params)
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-10 if dtype == torch.float64 else 1e-4)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float64, "auto"), (torch.float32, "auto"),
                                            (torch.float32, "bfloat16")])
def test_planned_decode_equals_the_general_path_across_weight_changes(dtype, kv_dtype):
    """Pure decode steps through ``ModelRunner._decode_plan`` (the C++ calls straight from a per-layer plan)
    against the general per-layer path: the same tokens, log-probs and routed experts bit for bit, before and
    after an in-place weight update and a parameter replaced by assignment (the plan must see both); with
    the model's dtype in the cache and with a bfloat16 cache under float32."""
    from jointrl.kernels import linear_cpu

    if linear_cpu.load_kernel() is None:
        pytest.skip("no C++ toolchain here")
    ps = prompts(3, 9, 20, 1, seed=5)
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=i) for i in range(len(ps))]
    new = make_model(seed=7).to(dtype)
    outs = {}
    for planned in (True, False):
        model = make_model(seed=2).to(dtype)
        eng = engine(model, max_num_batched_tokens=64, return_routed_experts=True, kv_dtype=kv_dtype)
        if not planned:
            eng.runner._plan_refs = []  # the general path
        runs = [eng.generate_batch(ps, params)]
        eng.update_weights(1, build_bundle(new.state_dict(), 1, is_quantized=lambda n, t: False))
        runs.append(eng.generate_batch(ps, params))
        head = model.model.layers[1].self_attn.o_proj
        head.weight = torch.nn.Parameter(head.weight.detach() * 0.5)
        runs.append(eng.generate_batch(ps, params))
        assert (eng.runner._plan is not None) == planned
        outs[planned] = runs
    for run_a, run_b in zip(outs[True], outs[False]):
        for a, b in zip(run_a, run_b):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and torch.equal(a.routed_experts, b.routed_experts)


@pytest.mark.parametrize("planned", [True, False])
def test_packed_weights_follow_parameters_replaced_layer_after_layer(planned):
    """o_proj (and every other round the experts) replaced by assignment in every layer, round after round: a
    new parameter often gets a freed one's id and its freed memory (same address, version 0), so the
    packed-weight cache must not match on id, address and version alone (it handed a layer another layer's
    old o_proj); and replaced weights' packed copies do not pile up. Fresh prompts each round: prefix-cached blocks would hold the old weights' keys."""
    from jointrl.kernels import linear_cpu

    if linear_cpu.load_kernel() is None:
        pytest.skip("no C++ toolchain here")
    model = MoETransformer.from_config(MoEConfig(initializer_range=0.1, num_hidden_layers=4), dtype=torch.float64,
                                       seed=2)
    eng = engine(model, max_num_batched_tokens=64)
    if not planned:
        eng.runner._plan_refs = []  # the general path
    eng.generate_batch(prompts(3, 9, 20, seed=5), [GREEDY] * 3)
    for r in range(4):
        for i, layer in enumerate(model.model.layers):
            o_proj, ex = layer.self_attn.o_proj, layer.mlp.experts
            o_proj.weight = torch.nn.Parameter(o_proj.weight.detach() * (0.5 + 0.1 * i))
            if r % 2:  # the routed experts too (their packed copy, moe_cpu.pack_experts)
                ex.down_proj = torch.nn.Parameter(ex.down_proj.detach() * (0.5 + 0.1 * i))
                ex.gate_up_proj = torch.nn.Parameter(ex.gate_up_proj.detach().flip(0))
        ps = prompts(3, 9, 20, seed=10 + r)
        for p, out in zip(ps, eng.generate_batch(ps, [GREEDY] * len(ps))):
            assert_matches(model, p, out)
        assert (eng.runner._plan is not None) == planned
    # packed: q|k|v, o, the router and the experts of each layer, and the head -- none left of replaced weights
    assert sum(isinstance(k, tuple) for k in eng.runner._fused) == 4 * len(model.model.layers) + 1


def test_sessions_prefill_only_new_tokens(model):
    eng = engine(model)
    p = prompts(13)[0]
    out1 = eng.generate_batch([p], [GREEDY])[0]
    before = eng.stats.computed_tokens
    turn2 = p + out1.token_ids + [257, 7, 8, 9]
    out2 = eng.generate_batch([turn2], [GREEDY])[0]
    assert_matches(model, turn2, out2)
    # 4 observation tokens + the last sampled token (never fed) + one decode per new token but the last
    assert eng.stats.computed_tokens - before == 5 + len(out2.token_ids) - 1


def test_fork_shares_the_prompt_prefill(model):
    eng = engine(model, max_num_batched_tokens=64)
    p = prompts(30)[0]
    outs = eng.generate_batch([p] * 4, [GREEDY] * 4)
    for out in outs:
        assert_matches(model, p, out)
    first = 30 + GREEDY.max_tokens - 1
    # the other 3 recompute only the tail after the last full shared block (30 = 7·4 + 2: 2 tokens, or
    # 4 + 2 when the whole prompt would be shared, since the last prompt token must run for its logits)
    assert eng.stats.computed_tokens == first + 3 * (2 + GREEDY.max_tokens - 1)
    assert eng.scheduler.num_dropped == 0


def test_preemption_under_a_tiny_budget_keeps_outputs_exact(model, capsys):
    eng = engine(model, num_blocks=14, session_ttl_s=0)
    ps = prompts(10, 20, 15, 9, 12)
    outs = eng.generate_batch(ps, [GREEDY] * len(ps))
    assert eng.scheduler.num_preempted > 1 and eng.scheduler.num_dropped >= eng.scheduler.num_preempted
    for p, out in zip(ps, outs):
        assert_matches(model, p, out)
    assert eng.block_manager.num_free == 14
    # the pool ran out: one line says so (at most one a minute, however many preemptions), with what to raise
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("engine: KV pool full (14 blocks x 4 = 56 token slots)") and "raise rollout.num_blocks" in line


def test_idle_sessions_evicted_by_memory_pressure_and_ttl_are_reprefilled(model):
    eng = engine(model, num_blocks=24)
    a, b, c = prompts(20, 21, 22)
    outs = eng.generate_batch([a, b], [GREEDY] * 2)
    assert len(eng.scheduler.idle) == 2
    eng.generate_batch([c], [GREEDY])  # needs blocks the idle sessions hold
    assert eng.scheduler.num_evicted >= 1 and eng.scheduler.num_dropped == eng.scheduler.num_evicted
    assert eng.scheduler.dropped_tokens >= 20 + GREEDY.max_tokens - 1  # an evicted session's computed tokens
    turn2 = a + outs[0].token_ids + [257, 1, 2]
    assert_matches(model, turn2, eng.generate_batch([turn2], [GREEDY])[0])
    eng.scheduler.session_ttl_s = 1e-9  # every idle session is now past its TTL
    evicted = eng.scheduler.num_evicted
    turn2b = b + outs[1].token_ids + [257, 3]
    assert_matches(model, turn2b, eng.generate_batch([turn2b], [GREEDY])[0])
    assert eng.scheduler.num_evicted > evicted and len(eng.scheduler.idle) == 1  # only the new turn


def test_weight_updates_repack_in_place_and_yield_the_new_model():
    """``update_weights`` copies into the same parameters: the runner refills its packed panels in place (the
    same tensors, no new memory) and decodes with the new weights (greedy, against full recompute); a GRPO
    group's members after the shared prompt's full blocks prefill as decode rows (``SHORT_PREFILL``)."""
    from jointrl.kernels import linear_cpu

    if linear_cpu.load_kernel() is None:
        pytest.skip("no C++ toolchain here")
    eng = engine(make_model(), max_num_batched_tokens=64, session_ttl_s=0)
    p = prompts(30)[0]
    eng.generate_batch([p] * 3, [GREEDY] * 3)
    panels = {k: v[1] for k, v in eng.runner._fused.items() if isinstance(k, tuple)}
    for version, seed in ((1, 7), (2, 8)):
        new = make_model(seed=seed)
        eng.update_weights(version, build_bundle(new.state_dict(), version, is_quantized=lambda n, t: False))
        q = prompts(30, seed=version)[0]
        for out in eng.generate_batch([q] * 3, [GREEDY] * 3):
            assert_matches(new, q, out)
    after = {k: v[1] for k, v in eng.runner._fused.items() if isinstance(k, tuple)}
    assert after.keys() == panels.keys()
    assert all(a is b for k in panels for a, b in zip(after[k], panels[k]) if isinstance(a, torch.Tensor))


def test_weight_update_reprefill_yields_the_new_model(model):
    eng = engine(make_model(), live_sessions="reprefill")
    p = prompts(11)[0]
    out1 = eng.generate_batch([p], [GREEDY])[0]
    new = make_model(seed=7)
    eng.update_weights(1, build_bundle(new.state_dict(), 1, is_quantized=lambda n, t: False))
    turn2 = p + out1.token_ids + [257, 5]
    out2 = eng.generate_batch([turn2], [GREEDY])[0]
    assert out2.policy_version == 1
    assert_matches(new, turn2, out2)
    assert_matches(new, p, eng.generate_batch([p], [GREEDY])[0])


def test_weight_update_keep_policy_continues_old_caches(model):
    eng = engine(make_model())
    p = prompts(11)[0]
    out1 = eng.generate_batch([p], [GREEDY])[0]
    assert out1.policy_version == 0
    new = make_model(seed=7)
    eng.update_weights(1, build_bundle(new.state_dict(), 1, is_quantized=lambda n, t: False))
    before = eng.stats.computed_tokens
    out2 = eng.generate_batch([p + out1.token_ids + [257, 5]], [GREEDY])[0]
    assert out2.policy_version == 1
    assert eng.stats.computed_tokens - before == 2 + len(out2.token_ids)  # the session's cache was kept
    assert_matches(new, p, eng.generate_batch([p], [GREEDY])[0])  # new prompts: new weights, no stale prefix


def test_logprobs_equal_the_learner_forward(model):
    eng = engine(model)
    ps = prompts(6, 19)
    params = [SamplingParams(max_tokens=10, temperature=t, seed=3) for t in (1.0, 0.7)]
    outs = eng.generate_batch(ps, params)
    for p, out, sp in zip(ps, outs, params):
        ids = torch.tensor([p + out.token_ids])
        lp = token_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool), temperature=sp.temperature)[0]
        assert lp[len(p):].tolist() == pytest.approx(out.logprobs, abs=1e-10)


def test_requests_join_the_running_batch_between_steps(model):
    eng = engine(model)
    long_p, short_p = prompts(9, 7)

    async def run():
        first = asyncio.ensure_future(eng.generate(long_p, SamplingParams(max_tokens=30, temperature=0)))
        while eng.stats.steps < 5:
            await asyncio.sleep(0.001)
        second = await eng.generate(short_p, SamplingParams(max_tokens=3, temperature=0))
        joined_at = eng.stats.steps
        out_first = await first
        await eng.close()
        return out_first, second, joined_at

    out_first, second, joined_at = asyncio.run(run())
    assert not eng.scheduler.running  # both done
    assert joined_at < 30  # the short request finished while the long one was still decoding
    assert_matches(model, long_p, out_first, 30)
    assert_matches(model, short_p, second, 3)


def test_routed_experts_equal_the_full_forward_across_turns(model):
    eng = engine(model, return_routed_experts=True)
    p = prompts(9)[0]
    out1 = eng.generate_batch([p], [GREEDY])[0]
    turn2 = p + out1.token_ids + [257, 4, 5]
    out2 = eng.generate_batch([turn2], [GREEDY])[0]
    with torch.no_grad():
        ref = model(torch.tensor([turn2 + out2.token_ids])).topk_ids[0].to(ROUTE_DTYPE)
    assert (out1.routed_from, len(out1.routed_experts)) == (0, len(p) + len(out1.token_ids) - 1)
    assert out1.routed_experts.dtype == ROUTE_DTYPE and torch.equal(out1.routed_experts, ref[:len(out1.routed_experts)])
    # turn 2 ran only its new positions: the last sampled token of turn 1 onwards
    assert out2.routed_from == len(p) + len(out1.token_ids) - 1
    assert torch.equal(out2.routed_experts, ref[out2.routed_from:len(turn2) + len(out2.token_ids) - 1])


def test_bad_requests_name_the_input(model):
    eng = engine(model, num_blocks=4)
    with pytest.raises(ValueError, match="num_blocks=4"):
        eng.generate_batch([[1] * 10], [SamplingParams(max_tokens=10)])
    with pytest.raises(ValueError, match="prompt_ids"):
        eng.generate_batch([[]], [GREEDY])
    with pytest.raises(ValueError, match="live_sessions"):
        EngineConfig(live_sessions="sometimes")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)


@pytest.fixture(scope="module")
def hybrid():
    cfg = MoEConfig.preset("tiny_hybrid", initializer_range=0.1)
    return MoETransformer.from_config(cfg, dtype=torch.float64, seed=1)


def test_hybrid_kda_dsa_model_equals_full_recompute_across_chunks_sessions_and_preemption(hybrid):
    from jointrl.model.state import state_layout

    eng = engine(hybrid, num_blocks=14, max_num_batched_tokens=8)
    ps = prompts(5, 40, 3)
    outs = eng.generate_batch(ps, [GREEDY] * 3)
    assert eng.scheduler.num_preempted > 0
    for p, out in zip(ps, outs):
        assert_matches(hybrid, p, out)
    turn2 = ps[0] + outs[0].token_ids + [257, 3, 4]
    assert_matches(hybrid, turn2, eng.generate_batch([turn2], [GREEDY])[0])
    session = eng.scheduler.idle[max(eng.scheduler.idle)]
    state_bytes = sum(t.numel() * t.element_size() for pair in session.recurrent.values() for t in pair)
    assert state_bytes == state_layout(hybrid.config, torch.float64).fixed


def test_batched_sampling_equals_sampling_each_row_alone():
    """A request's tokens and log-probs do not depend on the other rows of its step."""
    from jointrl.rl.rollout.sampling import sample_rows

    logits_RV = torch.randn(5, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=1),
              SamplingParams(temperature=1.0, top_k=5, seed=2), SamplingParams(temperature=1.3, top_p=0.8, seed=3),
              SamplingParams(temperature=1.0, top_k=1, seed=4)]
    gens = lambda: [None if sp.seed is None else torch.Generator().manual_seed(sp.seed) for sp in params]  # noqa: E731
    tokens, logprobs = sample_rows(logits_RV, params, gens())
    alone = [sample_rows(logits_RV[i:i + 1], [sp], [g]) for i, (sp, g) in enumerate(zip(params, gens()))]
    assert tokens == [t[0] for t, _ in alone]
    assert logprobs == [lp[0] for _, lp in alone]
    assert tokens[0] == int(logits_RV[0].argmax())
    assert tokens[4] == int(logits_RV[4].argmax())  # top-k 1 is greedy
    top5 = set(torch.topk(logits_RV[2], 5).indices.tolist())
    assert tokens[2] in top5
    for i, (sp, t) in enumerate(zip(params, tokens)):
        want = torch.log_softmax(logits_RV[i] / (sp.temperature or 1.0), -1)[t]
        assert logprobs[i] == pytest.approx(float(want), abs=1e-12)


def test_hybrid_decodes_run_as_one_batched_forward_equal_to_full_recompute(hybrid, monkeypatch):
    """Sequences of different lengths decode together (keys left-padded, KDA states stacked):
    greedy tokens, log-probs and routed experts equal the plain full-recompute forward."""
    import jointrl.rl.rollout.model_runner as model_runner

    sizes = []

    class Recording(model_runner.DecodeBatchState):
        def __init__(self, runner, seqs):
            super().__init__(runner, seqs)
            sizes.append(len(seqs))

    monkeypatch.setattr(model_runner, "DecodeBatchState", Recording)
    eng = engine(hybrid, max_num_batched_tokens=64, return_routed_experts=True)
    ps = prompts(3, 17, 40, 9, seed=3)
    outs = eng.generate_batch(ps, [GREEDY] * 4)
    assert max(sizes) == 4
    for p, out in zip(ps, outs):
        assert_matches(hybrid, p, out)
    with torch.no_grad():
        ref = hybrid(torch.tensor([ps[2] + outs[2].token_ids])).topk_ids[0].to(ROUTE_DTYPE)
    assert outs[2].routed_from == 0
    assert torch.equal(outs[2].routed_experts, ref[:len(ps[2]) + len(outs[2].token_ids) - 1])


def test_mxfp4_experts_decode_from_bfloat16_panels_bit_for_bit():
    """After an MXFP4 push every routed-expert weight is exactly a bfloat16, so a float32 model's runner packs
    its experts into bfloat16 panels (half the bytes a decode step streams) and samples bit for bit what
    float32 panels give: the same tokens and log-probs, sampled and batched, across two pushes. Weights that
    are not exact (the initial ones, a dense push) keep float32 panels."""
    from jointrl.kernels import moe_cpu

    if moe_cpu.load_kernel() is None:
        pytest.skip("no C++ toolchain here")
    model = MoETransformer.from_config(MoEConfig(initializer_range=0.1), dtype=torch.float32, seed=1)
    engines = [engine(model.__class__.from_config(model.config, dtype=torch.float32, seed=1), session_ttl_s=0)
               for _ in range(2)]
    engines[1].runner.bf16_expert_panels = False
    sampled = [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in range(4)]

    def panel_dtypes(eng):
        return {v[1][0].dtype for k, v in eng.runner._fused.items() if isinstance(k, tuple) and k[1] == "experts"}

    def generate(eng, version):
        return [(o.token_ids, o.logprobs) for o in eng.generate_batch(prompts(9, 30, 30, 17, seed=version), sampled)]

    assert generate(engines[0], 0) == generate(engines[1], 0)
    assert panel_dtypes(engines[0]) == {torch.float32}  # random weights: not bfloat16-exact
    for version, seed in ((1, 7), (2, 8)):
        new = MoETransformer.from_config(model.config, dtype=torch.float32, seed=seed)
        bundle = build_bundle(new.state_dict(), version)  # routed experts in MXFP4 (the default push)
        for eng in engines:
            eng.update_weights(version, bundle)
        assert generate(engines[0], version) == generate(engines[1], version)  # panels repacked at the first decode
        assert panel_dtypes(engines[0]) == {torch.bfloat16} and panel_dtypes(engines[1]) == {torch.float32}
    engines[0].update_weights(3, build_bundle(model.state_dict(), 3, is_quantized=lambda n, t: False))
    generate(engines[0], 3)
    assert panel_dtypes(engines[0]) == {torch.float32}  # a dense push: back to float32 panels


def test_mxfp4_resident_experts_are_what_the_cpu_engine_reads():
    """A layer holding its experts MXFP4-resident (``Experts.load_mxfp4``) is served from them on the ``cpu``
    backend too: the C++ paths over packed dense experts and the per-layer plan step aside, so the engine equals
    one whose dense experts are the dequantized blocks, while the dense parameters it still holds differ."""
    from jointrl.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    models = [MoETransformer.from_config(MoEConfig(initializer_range=0.1), dtype=torch.float32, seed=1, kernels="cpu")
              for _ in range(2)]
    g = torch.Generator().manual_seed(2)
    for held, dense in zip(*(m.model.layers for m in models)):
        gu = quantize_mxfp4(torch.randn(held.mlp.experts.gate_up_proj.shape, generator=g) * 0.1)
        dn = quantize_mxfp4(torch.randn(held.mlp.experts.down_proj.shape, generator=g) * 0.1)
        held.mlp.experts.load_mxfp4(*gu, *dn)
        with torch.no_grad():
            dense.mlp.experts.gate_up_proj.copy_(dequantize_mxfp4(*gu, dtype=torch.float32))
            dense.mlp.experts.down_proj.copy_(dequantize_mxfp4(*dn, dtype=torch.float32))
    params = [SamplingParams(max_tokens=8, temperature=0)] * 3
    got, want = (LLMEngine(m, config=EngineConfig(num_blocks=64, block_size=4)).generate_batch(
        prompts(5, 12, 3, seed=4), params) for m in models)
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
