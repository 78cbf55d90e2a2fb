"""Routed experts as one ``[tokens, layers, top_k]`` int tensor from the engine to the learner:
recorded by both backends through the agent loop (a turn split by its thinking budget
included), kept exactly through the trajectory JSONL, replayed by ``collate``."""

import asyncio
import json
import math

import pytest
import torch

from jointrl.envs.base import Message, Task
from jointrl.model import MoEConfig, MoETransformer
from jointrl.model.chat_template import ChatTemplate
from jointrl.rl.agent_loop import AgentConfig, run_episode
from jointrl.rl.learner.batch import TrainBatch, collate
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.rollout.recorder import read_trajectories
from jointrl.rl.rollout.sampler import SimpleSampler
from jointrl.rl.types import ROUTE_DTYPE, SamplingParams, merge_routes, tensor_from_json, tensor_to_json

TPL = ChatTemplate()
TASK = Task(id="r", domain="r", prompt="Route me.", tier="low", max_turns=1, reward={"format": 1.0})
BACKENDS = {
    "engine": lambda m: LLMEngine(m, TPL.tok, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16,
                                                            return_routed_experts=True)),
    "simple": lambda m: SimpleSampler(m, TPL.tok, record_routes=True),
}


class QuietEnv:
    tools = []

    async def reset(self, task: Task) -> list[Message]:
        return [Message(role="user", content=task.prompt)]

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def model():
    return MoETransformer.from_config(MoEConfig(initializer_range=0.1), dtype=torch.float64, seed=4).eval()


def episode(engine):
    async def go():
        try:
            return await run_episode(QuietEnv(), engine, TASK, TPL, SamplingParams(max_tokens=9, temperature=0),
                                     AgentConfig(max_context=512, thinking_budget={"low": 2}), group_id="g")
        finally:
            await engine.close()
    return asyncio.run(go())


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_trajectory_routes_are_the_full_forwards_top_k(model, backend):
    """A turn of two engine calls (reasoning, then the rest after the forced ``</think>``) still
    records every position once: the learner's own top-k, and -1 on the last token."""
    traj = episode(BACKENDS[backend](model))
    assert 0 in traj.loss_mask  # the budget forced a close: the turn was two engine calls
    cfg = model.config
    routes = traj.routed_experts
    assert routes.dtype == ROUTE_DTYPE
    assert routes.shape == (len(traj.token_ids), cfg.num_moe_layers, cfg.num_experts_per_tok)
    with torch.no_grad():
        ref = model(torch.tensor([traj.token_ids])).topk_ids[0]
    assert torch.equal(routes[:-1].long(), ref[:-1]) and (routes[-1] == -1).all()


def test_jsonl_round_trip_is_exact_and_compact(model, tmp_path):
    traj = episode(BACKENDS["engine"](model))
    path = tmp_path / "step.jsonl"
    line = json.dumps(traj.to_json())
    path.write_text(line + "\n")
    (back,) = read_trajectories(path)
    assert back.routed_experts.dtype == ROUTE_DTYPE and torch.equal(back.routed_experts, traj.routed_experts)
    assert back.token_ids == traj.token_ids and back.loss_mask == traj.loss_mask
    data = json.loads(line)["routed_experts"]["data"]  # 2 bytes an expert id, in base64: 8/3 characters
    assert len(data) == 4 * math.ceil(2 * traj.routed_experts.numel() / 3)


@pytest.mark.parametrize("t", [torch.tensor([[[0, 3], [-1, 32767]]], dtype=torch.int16),
                               torch.arange(24, dtype=torch.uint8).reshape(2, 3, 4),
                               torch.zeros(0, 2, 2, dtype=torch.int16)])
def test_tensor_json_keeps_dtype_shape_and_values(t):
    back = tensor_from_json(json.loads(json.dumps(tensor_to_json(t))))
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


def test_merge_keeps_the_first_recording_and_marks_gaps():
    old = torch.tensor([[[1, 2]], [[-1, -1]], [[3, 4]]], dtype=ROUTE_DTYPE)  # positions 2, 3, 4
    new = torch.tensor([[[7, 7]], [[8, 8]], [[9, 9]]], dtype=ROUTE_DTYPE)  # positions 4, 5, 6
    merged, start = merge_routes(old, 2, new, 4)
    assert start == 2 and merged[:, 0].tolist() == [[1, 2], [-1, -1], [3, 4], [8, 8], [9, 9]]
    merged, start = merge_routes(new, 4, old, 0)
    assert start == 0 and merged[:, 0].tolist() == [[1, 2], [-1, -1], [3, 4], [-1, -1], [7, 7], [8, 8], [9, 9]]


def test_collate_replays_recorded_rows_and_fills_unrecorded_ones():
    routes = torch.tensor([[[2, 1]], [[0, 3]], [[-1, -1]]], dtype=ROUTE_DTYPE)  # L = 1, k = 2
    batch = TrainBatch([[5, 6, 7], [8, 9]], [[0, 1, 1], [0, 1]], [[0.0] * 3, [0.0] * 2], [1.0, 1.0],
                       routed_experts=[routes, torch.tensor([[[3, 2]], [[-1, -1]]], dtype=ROUTE_DTYPE)])
    mb = collate(batch, True, 0, torch.float64, (1, 2))
    assert mb.replay.dtype == torch.long
    assert mb.replay[0, :, 0].tolist() == [[2, 1], [0, 3], [0, 1], [3, 2], [0, 1]]
    with pytest.raises(ValueError, match="routed_experts must be"):
        TrainBatch([[5, 6, 7]], [[0, 1, 1]], [[0.0] * 3], [1.0], routed_experts=[routes[:2]])
