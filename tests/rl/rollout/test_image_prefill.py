"""Screenshots through generation and training (float64): the engine and the simple sampler
prefill each sequence's patches into its ``<image>`` slots, the learner feeds the same patches
into the same slots, and their log-probs agree within 1e-10; the prefix cache and sessions never
hand one screenshot's keys/values to a sequence with the same ids but another screenshot."""

import pytest
import torch

from jointrl.envs.base import Message
from jointrl.model import MoEConfig, MoETransformer
from jointrl.model.chat_template import ChatTemplate
from jointrl.rl.learner.batch import TrainBatch, logprobs_from_logits, micro_batches
from jointrl.rl.learner.forward import learner_forward
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.rollout.sampler import SimpleSampler
from jointrl.rl.types import SamplingParams

SLOTS, DIM = 6, 12  # <image> slots per screenshot, features per patch
TEMPLATE = ChatTemplate(image_tokens=SLOTS)
IMAGE_ID = TEMPLATE.tok.special_ids["<image>"]
PARAMS = SamplingParams(max_tokens=8, temperature=1.0, seed=5)


@pytest.fixture(scope="module")
def model():
    cfg = MoEConfig(initializer_range=0.1, image_patch_dim=DIM)
    return MoETransformer.from_config(cfg, dtype=torch.float64, seed=3)


@pytest.fixture(scope="module")
def hybrid():
    """KDA + gated DSA layers: the engine runs them through the model's own forward, per sequence."""
    cfg = MoEConfig.preset("tiny_hybrid", initializer_range=0.1, image_patch_dim=DIM)
    return MoETransformer.from_config(cfg, dtype=torch.float64, seed=3)


def screenshot(seed: int) -> torch.Tensor:
    return torch.rand(SLOTS, DIM, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def prompt(text: str = "page") -> list[int]:
    """A task, then a tool observation carrying a screenshot (its slots open the message)."""
    return TEMPLATE.render([Message("user", "find the price"),
                            Message("tool", text, name="goto", image=b"png")])


def learner_logprobs(model, seqs: list[list[int]], patches: list, pack: bool) -> list[list[float]]:
    batch = TrainBatch(seqs, [[0] * len(s) for s in seqs], [[0.0] * len(s) for s in seqs], [0.0] * len(seqs),
                       image_patches=patches)
    out = []
    for mb in micro_batches(batch, 8, TEMPLATE.tok.pad_id, torch.float64, pack=pack, image=(IMAGE_ID, DIM)):
        with torch.no_grad():
            fwd = learner_forward(model, mb.input_ids, mb.pos, mb.seg, image_patches=mb.images)
        lp = logprobs_from_logits(fwd.logits_BTV, mb.input_ids)
        out += [[0.0] + lp[mb.seg == i][1:].tolist() for i in range(mb.num_seqs)]  # packed: nothing predicts a first token
    return out


def direct_logprobs(model, ids: list[int], patches) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids]), image_patches=patches).logits
    return logprobs_from_logits(logits, torch.tensor([ids]))[0].tolist()


@pytest.mark.parametrize("pack", [False, True])
def test_learner_feeds_each_sequence_its_own_screenshot(model, pack):
    a, b = prompt("red page"), prompt("blue page, longer")
    shot_a, shot_b = screenshot(1), screenshot(2)
    got = learner_logprobs(model, [a, b], [shot_a, shot_b], pack)
    assert got[0] == pytest.approx(direct_logprobs(model, a, shot_a), abs=1e-10)
    assert got[1] == pytest.approx(direct_logprobs(model, b, shot_b), abs=1e-10)
    blank = learner_logprobs(model, [a], [torch.zeros(SLOTS, DIM, dtype=torch.float64)], pack)[0]
    first = a.index(IMAGE_ID)
    assert blank[:first + 1] == pytest.approx(got[0][:first + 1], abs=1e-12)  # before the screenshot: same
    assert max(abs(x - y) for x, y in zip(blank[first + 1:], got[0][first + 1:])) > 1e-3  # after it: it matters


def test_an_image_token_the_policy_sampled_reads_a_zero_row_on_both_sides(model):
    ids = prompt() + [IMAGE_ID, 65, 66]  # a sampled <image>: no screenshot behind it
    got = learner_logprobs(model, [ids], [screenshot(1)], pack=False)[0]
    full = torch.cat([screenshot(1), torch.zeros(1, DIM, dtype=torch.float64)])
    assert got == pytest.approx(direct_logprobs(model, ids, full), abs=1e-10)


def engine(model, **kw) -> LLMEngine:
    return LLMEngine(model, config=EngineConfig(**{"num_blocks": 128, "block_size": 4, "max_num_batched_tokens": 16, **kw}))


def assert_engine_matches_learner(model, p, shot, out):
    lp = learner_logprobs(model, [p + out.token_ids], [shot], pack=False)[0]
    assert out.logprobs == pytest.approx(lp[len(p):], abs=1e-10)


@pytest.mark.parametrize("backend", ["engine", "simple", "engine_hybrid"])
def test_rollout_logprobs_with_a_screenshot_equal_the_learner(model, hybrid, backend):
    p = prompt()
    shots = [screenshot(1), screenshot(2)]
    if backend == "engine_hybrid":
        model = hybrid
        outs = engine(model, max_num_batched_tokens=32).generate_batch([p, p], [PARAMS, PARAMS], images=shots)
    elif backend == "engine":
        outs = engine(model).generate_batch([p, p], [PARAMS, PARAMS], images=shots)
    else:
        outs = SimpleSampler(model, TEMPLATE.tok).generate_batch([p, p], [PARAMS, PARAMS], images=shots)
    for shot, out in zip(shots, outs):
        assert_engine_matches_learner(model, p, shot, out)
    assert outs[0].logprobs[0] != pytest.approx(outs[1].logprobs[0], abs=1e-6)  # same ids, other screenshot


def test_prefix_cache_and_sessions_keep_screenshots_apart(model):
    """Same ids, other screenshot, on an engine whose prefix cache and idle sessions hold the
    first one's blocks: the second must be computed afresh (equal to a cold engine's output)."""
    eng, p = engine(model), prompt("a page long enough to fill several cache blocks")
    first = eng.generate_batch([p], [PARAMS], images=[screenshot(1)])[0]
    before = eng.stats.computed_tokens
    second = eng.generate_batch([p], [PARAMS], images=[screenshot(2)])[0]
    shared = p.index(IMAGE_ID) // 4 * 4  # full blocks before the first <image>: text alone, may be shared
    assert eng.stats.computed_tokens - before >= len(p) - shared  # nothing from the screenshot on is reused
    cold = engine(model).generate_batch([p], [PARAMS], images=[screenshot(2)])[0]
    assert (second.token_ids, second.logprobs) == (cold.token_ids, pytest.approx(cold.logprobs, abs=1e-10))
    assert_engine_matches_learner(model, p, screenshot(2), second)
    # the same screenshot again is a cache hit: only the last partial block is recomputed
    before = eng.stats.computed_tokens
    again = eng.generate_batch([p], [PARAMS], images=[screenshot(1)])[0]
    assert eng.stats.computed_tokens - before < len(p)
    assert again.logprobs == pytest.approx(first.logprobs, abs=1e-10)


def test_next_turn_adds_a_screenshot_to_the_session(model):
    eng, p = engine(model), prompt()
    out1 = eng.generate_batch([p], [PARAMS], images=[screenshot(1)])[0]
    turn2 = p + out1.token_ids + TEMPLATE.continuation([Message("tool", "next page", name="click", image=b"png")])
    shots2 = torch.cat([screenshot(1), torch.zeros(out1.token_ids.count(IMAGE_ID), DIM, dtype=torch.float64),
                        screenshot(3)])
    before = eng.stats.computed_tokens
    out2 = eng.generate_batch([turn2], [PARAMS], images=[shots2])[0]
    if IMAGE_ID not in out1.token_ids:
        assert eng.stats.computed_tokens - before < len(turn2)  # the session's cache was reused
    assert_engine_matches_learner(model, turn2, shots2, out2)


def test_bad_patches_are_refused(model):
    with pytest.raises(ValueError, match="image_patches must be"):
        engine(model).generate_batch([prompt()], [PARAMS], images=[torch.zeros(SLOTS - 1, DIM)])
