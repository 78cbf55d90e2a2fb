"""The thinking budget through the real agent loop, over the fast engine and the simple sampler:
an untrained float64 model that thinks past its budget gets a forced ``</think>`` (loss mask 0,
log-prob 0.0, version -1) from the loop, the same on both backends, with the sampled tokens'
log-probs equal to the learner's and the continuation served from the same session."""

import asyncio

import pytest
import torch

from jointrl.envs.base import Message, Task
from jointrl.model import MoEConfig, MoETransformer
from jointrl.model.chat_template import ChatTemplate
from jointrl.rl.agent_loop import AgentConfig, run_episode
from jointrl.rl.learner.batch import token_logprobs
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.rollout.sampler import SimpleSampler
from jointrl.rl.types import SamplingParams

TPL = ChatTemplate()
TOK = TPL.tok
BUDGET = 3
TASK = Task(id="think", domain="think", prompt="Think about it.", tier="high", max_turns=2, reward={"format": 1.0})
CFG = AgentConfig(max_context=512, thinking_budget={"low": 1, "high": BUDGET, "max": None})
BACKENDS = {
    "engine": lambda m: LLMEngine(m, TOK, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=32)),
    "simple": lambda m: SimpleSampler(m, TOK),
}


class QuietEnv:
    """An ``Env`` with no tools: the episode is the prompt and the policy's one turn."""

    tools = []

    async def reset(self, task: Task) -> list[Message]:
        return [Message(role="user", content=task.prompt)]

    async def step(self, call):
        raise AssertionError("no tool exists to call")

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def model():
    return MoETransformer.from_config(MoEConfig(initializer_range=0.1), dtype=torch.float64, seed=3).eval()


def episode(engine, params: SamplingParams, cfg: AgentConfig = CFG):
    async def go():
        try:
            return await run_episode(QuietEnv(), engine, TASK, TPL, params, cfg, group_id="g")
        finally:
            await engine.close()
    return asyncio.run(go())


def test_forced_close_is_loss_masked_and_the_same_on_every_backend(model):
    greedy = SamplingParams(max_tokens=10, temperature=0)
    trajs = {}
    for name, make in BACKENDS.items():
        engine = make(model)
        trajs[name] = traj = episode(engine, greedy)
        P = len(TPL.render([Message(role="user", content=TASK.prompt)], []))
        turn = slice(P, len(traj.token_ids))
        assert traj.token_ids[P - 1] == TOK.think_id and len(traj.token_ids) - P == greedy.max_tokens
        assert TOK.think_end_id not in traj.token_ids[P:P + BUDGET]  # this model thinks past its budget
        forced = P + BUDGET
        assert traj.token_ids[forced] == TOK.think_end_id
        assert (traj.loss_mask[forced], traj.logprobs[forced], traj.policy_version[forced]) == (0, 0.0, -1)
        assert traj.loss_mask[turn] == [1] * BUDGET + [0] + [1] * (greedy.max_tokens - BUDGET - 1)
        assert all(v == 0 for v, m in zip(traj.policy_version[turn], traj.loss_mask[turn]) if m)
        assert traj.think_tokens == BUDGET and traj.finish_reason == "length"
        if name == "engine":  # the continuation adopted the session: no position was computed twice
            assert engine.stats.computed_tokens == len(traj.token_ids) - 1
        ids = torch.tensor([traj.token_ids])
        with torch.no_grad():
            learner = token_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool))[0]
        sampled = [i for i, m in enumerate(traj.loss_mask) if m]
        torch.testing.assert_close(learner[sampled], torch.tensor(traj.logprobs, dtype=torch.float64)[sampled],
                                   rtol=0, atol=1e-10)
    assert trajs["engine"].token_ids == trajs["simple"].token_ids
    assert trajs["engine"].loss_mask == trajs["simple"].loss_mask


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_seeded_episodes_with_a_forced_close_replay_exactly(model, backend):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11)
    a, b = (episode(BACKENDS[backend](model), params) for _ in range(2))
    assert (a.token_ids, a.logprobs, a.loss_mask) == (b.token_ids, b.logprobs, b.loss_mask)
    assert 0 in a.loss_mask[-12:] and a.think_tokens == BUDGET


def test_the_tier_picks_the_budget_and_an_unknown_tier_is_refused(model):
    traj = episode(BACKENDS["engine"](model), SamplingParams(max_tokens=6, temperature=0),
                   AgentConfig(max_context=512, thinking_budget={"high": 1}))
    assert traj.think_tokens == 1 and traj.loss_mask[-6:] == [1, 0, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="tier 'high'"):
        episode(BACKENDS["engine"](model), SamplingParams(max_tokens=6), AgentConfig(thinking_budget={"low": 1}))
