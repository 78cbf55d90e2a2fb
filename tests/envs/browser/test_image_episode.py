"""A browser episode in image mode, end to end into the policy's inputs: the agent loop keeps a
patch row per ``<image>`` id of the trajectory, hands the engine exactly the screenshots of each
turn's prompt, and the learner feeds them to the model in those slots (float64, 1e-10); the
DeepSpeed learner trains on what the engine saw (no log-prob mismatch with the screenshot)."""

import asyncio

import pytest
import torch

from jointrl.envs.base import Message
from jointrl.envs.browser.driver_process import check_venv
from jointrl.envs.browser.env import BrowserEnv
from jointrl.envs.browser.tasks import make_task, policy
from jointrl.model import MoEConfig, MoETransformer
from jointrl.model.chat_template import ChatTemplate
from jointrl.rl.agent_loop import AgentConfig, run_episode
from jointrl.rl.build import build_model
from jointrl.rl.config import load_config
from jointrl.rl.image_inputs import ImageInputs
from jointrl.rl.learner.batch import TrainBatch, logprobs_from_logits, micro_batches
from jointrl.rl.learner.forward import learner_forward
from jointrl.rl.learner.worker import LearnerWorker
from jointrl.rl.rollout.llm_engine import LLMEngine
from jointrl.rl.rollout.scripted import ScriptedEngine
from jointrl.rl.types import SamplingParams


def _missing() -> str | None:
    try:
        check_venv("image")
    except Exception as err:  # noqa: BLE001
        return str(err)
    return None


@pytest.mark.skipif(_missing() is not None, reason=f"no browser image mode here: {_missing()}")
def test_browser_screenshots_reach_the_engine_and_the_learner():
    images = ImageInputs(patch=16, height=32, width=48)  # 6 slots per screenshot: a small forward
    tpl = ChatTemplate(image_tokens=images.num_tokens)
    slot = tpl.tok.special_ids["<image>"]
    task = make_task("city_population", 2)
    engine = ScriptedEngine(policy(task, "oracle"), tpl)  # goto, type, press Enter, answer

    async def go():
        env = BrowserEnv(mode="image")
        try:
            return await run_episode(env, engine, task, tpl, SamplingParams(max_tokens=4096),
                                     AgentConfig(max_context=1 << 16, images=images), "g")
        finally:
            await env.close()

    traj = asyncio.run(go())
    assert traj.reward == 1.0, traj.reward_info
    assert torch.equal(traj.image_patches, images.for_messages(traj.messages))  # three screenshots, in order
    assert traj.image_patches.shape == (traj.token_ids.count(slot), images.patch_dim) == (3 * 6, images.patch_dim)
    for prompt, given in zip(engine.prompts, engine.images):  # each turn: the screenshots its prompt holds
        k = prompt.count(slot)
        assert (given is None) if k == 0 else torch.equal(given, traj.image_patches[:k])
    assert sum(g is not None for g in engine.images) == 3

    cfg = MoEConfig(initializer_range=0.1, image_patch_dim=images.patch_dim)
    model = MoETransformer.from_config(cfg, dtype=torch.float64, seed=0)

    def learner(patches):
        batch = TrainBatch([traj.token_ids], [traj.loss_mask], [traj.logprobs], [1.0], image_patches=[patches])
        (mb,) = micro_batches(batch, 1, tpl.tok.pad_id, torch.float64, image=(slot, images.patch_dim))
        with torch.no_grad():
            return logprobs_from_logits(learner_forward(model, mb.input_ids, mb.pos, mb.seg,
                                                        image_patches=mb.images).logits_BTV, mb.input_ids)[0]

    seen = learner(traj.image_patches)
    ids = torch.tensor([traj.token_ids])
    with torch.no_grad():
        direct = logprobs_from_logits(model(ids, image_patches=traj.image_patches.double()).logits, ids)[0]
    assert (seen - direct).abs().max() < 1e-10
    after = traj.token_ids.index(slot) + 1
    assert (seen[after:] - learner(None)[after:]).abs().max() > 1e-3  # blank slots: another policy


def test_the_deepspeed_learner_trains_on_what_the_engine_saw():
    """Engine and learner start from the same weights (``cfg.seed``); lr 1e-30 keeps them there. The
    learner's ratio to the engine's log-probs is 1 with the screenshot and not without it."""
    dim, slots = 12, 4
    cfg = load_config(["model.dtype=float64", f"model.image_patch_dim={dim}", "learner.lr=1e-30"])
    lw = LearnerWorker(cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=29781)
    tpl = ChatTemplate(image_tokens=slots)
    prompt = tpl.render([Message("user", "what does the page say?"), Message("tool", "page", name="goto", image=b"png")])
    shot = torch.rand(slots, dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = LLMEngine(build_model(cfg)).generate_batch([prompt], [SamplingParams(max_tokens=10, seed=1)], images=[shot])[0]
    n = len(out.token_ids)

    def kl(patches):
        batch = TrainBatch([prompt + out.token_ids], [[0] * len(prompt) + out.sampled], [[0.0] * len(prompt) + out.logprobs],
                           [1.0], image_patches=[patches])
        return lw.train_step(batch, n)["mismatch/kl_k1"]

    assert abs(kl(shot)) < 1e-10
    assert abs(kl(None)) > 1e-4  # blank slots: the learner would train another policy
