"""A served policy whose multi-turn tool calls are known: ``tiny_moe`` overfit on one conversation.

An untrained model emits random bytes, so the server tests need a policy that calls tools
deterministically. This module defines a tiny calculator ``Env`` (tool ``calc``), the scripted
conversation (two parallel calls, one call, then a final answer, with reasoning every turn),
and trains the default ``tiny_moe`` on it until greedy decoding reproduces every sampled token
with a logit margin (teacher-forced argmax == target on every loss token, margin >= MARGIN).

The training set holds two renderings of the conversation: the full one, and one whose
reasoning is cut after ``LOW_BUDGET`` tokens by a forced ``</think>`` (loss-masked), so the
policy also completes the conversation under the ``low`` thinking budget. Both are built by the
real agent loop (``ScriptedEngine`` + ``run_episode``, the second with that budget), so the
tokens are exactly what the template renders and the budget cuts.

``policy_dir()`` trains it once (about 100 AdamW steps, ~20 s on one busy core) into a cache
directory named by the sha256 of the training tokens (a Hugging Face directory, loaded by
``model/hf.load_hf``), so a changed template or script retrains and an unchanged one reuses.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

from jointrl.envs.base import Message, Observation, Task, ToolCall, ToolSpec
from jointrl.model.chat_template import ChatTemplate
from jointrl.rl.agent_loop import AgentConfig, run_episode
from jointrl.rl.rollout.scripted import ScriptedEngine
from jointrl.rl.types import SamplingParams, Trajectory

LOW_BUDGET = 8  # thinking tokens under tier "low" in the tests (serve rollout.thinking_budget.low=8)
MARGIN = 2.0
SYSTEM = "You are a calculator agent."
USER = "Compute (17+25)*(2*3)."
CALC = ToolSpec(name="calc", description="Evaluate an integer expression.",
                parameters={"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]})
# (reasoning, tool calls, final text) per assistant turn
SCRIPT: list[tuple[str, list[ToolCall], str]] = [
    ("First both brackets.", [ToolCall("calc", {"expr": "17+25"}), ToolCall("calc", {"expr": "2*3"})], ""),
    ("Now multiply them.", [ToolCall("calc", {"expr": "42*6"})], ""),
    ("That is the answer.", [], "The answer is 252."),
]
TASK = Task(id="calc", domain="calc", prompt=USER, tier="max", max_turns=4, reward={"format": 1.0})


class CalcEnv:
    """``Env``: one tool, ``calc``, evaluating ``+ - *`` over integers (no eval of arbitrary code)."""

    tools = [CALC]

    async def reset(self, task: Task) -> list[Message]:
        return [Message(role="system", content=SYSTEM), Message(role="user", content=task.prompt)]

    async def step(self, call: ToolCall) -> Observation:
        expr = call.arguments.get("expr")
        if call.name != "calc" or not isinstance(expr, str) or not re.fullmatch(r"[0-9+*\- ]+", expr):
            return Observation(f"Error: cannot evaluate {call.name}({json.dumps(call.arguments)})", is_error=True)
        total = 0
        for term in expr.replace("-", "+-").split("+"):
            if term.strip():
                prod = 1
                for f in term.split("*"):
                    prod *= int(f)
                total += prod
        return Observation(str(total))

    async def close(self) -> None:
        pass


def turn_ids(tpl: ChatTemplate, reasoning: str, calls: list[ToolCall], text: str) -> list[int]:
    """One assistant turn as the model writes it (``<think>`` is already open in the prompt)."""
    t = tpl.tok
    ids = [*t.encode(reasoning), t.think_end_id, *t.encode(text)]
    for c in calls:
        ids += [t.tool_call_id, *t.encode(json.dumps({"name": c.name, "arguments": c.arguments})), t.tool_call_end_id]
    return ids + [t.im_end_id]


def training_trajectories(tpl: ChatTemplate | None = None) -> list[Trajectory]:
    """The full conversation and the one cut by the ``low`` budget (forced ``</think>`` masked)."""
    tpl = tpl or ChatTemplate()
    out = []
    for budget in (None, LOW_BUDGET):
        engine = ScriptedEngine([turn_ids(tpl, r, c, x) for r, c, x in SCRIPT], tpl)
        cfg = AgentConfig(max_context=4096, thinking_budget={TASK.tier: budget})
        out.append(asyncio.run(run_episode(CalcEnv(), engine, TASK, tpl, SamplingParams(max_tokens=512), cfg,
                                           group_id="calc")))
    return out


def data_hash(trajs: list[Trajectory]) -> str:
    return hashlib.sha256(json.dumps([[t.token_ids, t.loss_mask] for t in trajs]).encode()).hexdigest()


def _margins(model, trajs: list[Trajectory]) -> float:
    """Smallest (target logit - best other logit) over every loss token, teacher-forced."""
    worst = float("inf")
    with torch.no_grad():
        for t in trajs:
            logits = model(torch.tensor([t.token_ids])).logits[0, :-1].double()
            target = torch.tensor(t.token_ids[1:])
            keep = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
            tl = logits.gather(-1, target[:, None]).squeeze(-1)
            other = logits.scatter(-1, target[:, None], -torch.inf).max(-1).values
            worst = min(worst, float((tl - other)[keep].min()))
    return worst


def train(out_dir: Path, max_steps: int = 3000, log=print) -> Path:
    """Overfit the default ``tiny_moe`` (seed 0) until every loss token has margin >= MARGIN."""
    from jointrl.model.hf import save_hf
    from jointrl.rl.build import build_model
    from jointrl.rl.config import load_config
    from jointrl.rl.learner.batch import token_logprobs

    torch.set_num_threads(1)
    trajs = training_trajectories()
    model = build_model(load_config([])).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    T = max(len(t.token_ids) for t in trajs)
    ids = torch.zeros((len(trajs), T), dtype=torch.long)
    attn = torch.zeros((len(trajs), T), dtype=torch.bool)
    mask = torch.zeros((len(trajs), T))
    for b, t in enumerate(trajs):
        n = len(t.token_ids)
        ids[b, :n], attn[b, :n], mask[b, :n] = torch.tensor(t.token_ids), True, torch.tensor(t.loss_mask, dtype=torch.float)
    t0 = time.time()
    for step in range(1, max_steps + 1):
        loss = -(token_logprobs(model, ids, attn) * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            margin = _margins(model.eval(), trajs)
            model.train()
            log(f"step {step} loss {loss.item():.4f} margin {margin:.2f} ({time.time() - t0:.0f}s)")
            if margin >= MARGIN:
                break
    else:
        raise RuntimeError(f"calc policy did not reach margin {MARGIN} in {max_steps} steps")
    save_hf(model.eval(), out_dir)
    (out_dir / "meta.json").write_text(json.dumps({"data_sha256": data_hash(trajs), "steps": step,
                                                   "margin": margin}, indent=1) + "\n")
    return out_dir


def policy_dir() -> Path:
    """The policy trained on today's tokens: from the cache, or trained now into it."""
    want = data_hash(training_trajectories())
    d = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jointrl" / f"calc_policy_{want[:16]}"
    meta = d / "meta.json"
    if meta.is_file() and json.loads(meta.read_text())["data_sha256"] == want:
        return d
    print(f"calc policy: training into {d}", file=sys.stderr)
    return train(d)
