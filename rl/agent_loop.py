"""The multi-turn agent loop, in token space: one episode of one task -> one ``Trajectory``.

    ids = template.render(env.reset(task), env.tools)        # loss_mask 0
    repeat up to task.max_turns:
        out = generate_turn(engine, ids, params, budget)     # loss_mask = out.sampled (0: a forced </think>)
        parse the turn's tool calls (strict), run each through env.step (or an error observation)
        ids += template.continuation(tool turns)             # loss_mask 0
    reward = weighted reward modules over the final state (fresh verification sandbox)

The learner trains on exactly these ids: text the model produced is never re-tokenized. The
thinking budget of the task's tier (``AgentConfig.thinking_budget``) is enforced by
``rl/rollout/turn.generate_turn``, the one place that enforces it for every backend; its
sampled reasoning tokens add up in ``Trajectory.think_tokens``.
Infrastructure failures (``EnvError``, a crashed sandbox, any unexpected exception) are retried on a fresh env by
``run_episode_with_retries``; the policy's own failures (bad calls, length, turn limit,
timeout) are results, scored and kept (docs/architecture.md, "Failures").
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from jointrl.envs.base import Env, EnvError, Message, Observation, Task
from jointrl.model.chat_template import ChatTemplate
from jointrl.rewards.base import Episode, combine
from jointrl.rl.image_inputs import ImageInputs
from jointrl.rl.parser import CallError, parse_turn
from jointrl.rl.rollout.engine import RolloutEngine
from jointrl.rl.rollout.turn import generate_turn
from jointrl.rl.types import FinishReason, GenerationOutput, SamplingParams, Trajectory, merge_routes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    max_context: int = 4096  # tokens; the history may not grow past this
    episode_timeout_s: float = 600.0  # wall clock for the whole episode (a policy result)
    max_env_retries: int = 2
    # screenshots as model inputs: the template's image_tokens must equal images.num_tokens
    images: ImageInputs | None = None
    # sampled thinking tokens per turn, by task tier (None: unlimited); empty: unlimited for every tier
    thinking_budget: dict[str, int | None] = dataclasses.field(default_factory=dict)

    def think_budget(self, tier: str) -> int | None:
        if self.thinking_budget and tier not in self.thinking_budget:
            raise ValueError(f"task tier {tier!r} has no thinking budget; AgentConfig.thinking_budget has "
                             f"{sorted(self.thinking_budget)}")
        return self.thinking_budget.get(tier)


async def run_episode(env: Env, engine: RolloutEngine, task: Task, template: ChatTemplate,
                      params: SamplingParams, cfg: AgentConfig, group_id: str) -> Trajectory:
    """One episode. Raises ``EnvError`` on infrastructure failure (the caller retries)."""
    tok = template.tok
    deadline = time.monotonic() + min(cfg.episode_timeout_s, task.metadata.get("agent_timeout_s", float("inf")))
    messages = await env.reset(task)
    ids = template.render(messages, env.tools)
    traj = Trajectory(token_ids=list(ids), loss_mask=[0] * len(ids), logprobs=[0.0] * len(ids),
                      policy_version=[-1] * len(ids), domain=task.domain, task_id=task.id,
                      group_id=group_id, tier=task.tier, messages=list(messages))
    _add_patches(traj, template, cfg, messages)
    finish, answer, ended = FinishReason.TOOL_LIMIT, None, False
    budget = cfg.think_budget(task.tier)
    for _ in range(task.max_turns):
        room = cfg.max_context - len(traj.token_ids)
        if room <= 0:
            finish = FinishReason.CONTEXT_OVERFLOW
            break
        if time.monotonic() > deadline:
            finish = FinishReason.TIMEOUT
            break
        turn_params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
        images = traj.image_patches if traj.image_patches is not None and len(traj.image_patches) else None
        out = await generate_turn(engine, traj.token_ids, turn_params, budget, tok, images)
        traj.think_tokens += out.think_tokens
        traj.token_ids += out.token_ids
        traj.loss_mask += out.sampled
        traj.logprobs += out.logprobs
        traj.policy_version += [out.policy_version if s else -1 for s in out.sampled]
        _record_routes(traj, out)
        _add_patches(traj, template, cfg, [], sampled=out.token_ids)
        traj.num_turns += 1
        turn = parse_turn(out.token_ids, tok)
        ended = turn.ended
        calls = [c for c in turn.calls if not isinstance(c, CallError)]
        traj.messages.append(Message(role="assistant", content=turn.content, reasoning=turn.reasoning, tool_calls=calls))
        if out.finish_reason != "stop":
            finish = FinishReason.CONTEXT_OVERFLOW if room <= params.max_tokens else FinishReason.LENGTH
            break
        if not turn.calls:
            finish = FinishReason.STOP
            break
        results, done = await _run_calls(env, turn.calls, traj)
        traj.messages += results
        if done:
            finish, answer = FinishReason.STOP, done.text
            break
        _add_patches(traj, template, cfg, results)
        cont = template.continuation(results)
        traj.token_ids += cont
        traj.loss_mask += [0] * len(cont)
        traj.logprobs += [0.0] * len(cont)
        traj.policy_version += [-1] * len(cont)
    traj.finish_reason = finish
    if traj.routed_experts is not None:  # a -1 row for each token no forward took as input (the last)
        routes = traj.routed_experts
        missing = routes.new_full((len(traj.token_ids) - len(routes), *routes.shape[1:]), -1)
        traj.routed_experts = torch.cat([routes, missing])
    episode = Episode(messages=traj.messages, final_answer=answer, verify_sandbox=getattr(env, "verify_sandbox", None),
                      num_turns=traj.num_turns, num_tool_errors=traj.num_tool_errors, finished=ended)
    t0 = time.perf_counter()
    result = combine(task.reward, task, episode)
    traj.reward, traj.reward_info, traj.reward_time_s = result.score, result.info, time.perf_counter() - t0
    return traj


def _add_patches(traj: Trajectory, template: ChatTemplate, cfg: AgentConfig, messages: list[Message],
                 sampled: list[int] = ()) -> None:
    """Keep ``traj.image_patches`` one row per ``<image>`` id: the new messages' screenshots, or a
    zero row for each ``<image>`` the policy sampled (``rl/image_inputs.slot_patches``' rule).
    Without ``cfg.images`` nothing is kept: the engine sees the slots' plain placeholder ids."""
    if cfg.images is None:
        return
    if template.image_tokens != cfg.images.num_tokens:
        raise ValueError(f"ChatTemplate.image_tokens={template.image_tokens} but AgentConfig.images "
                         f"takes {cfg.images.num_tokens} slots per image")
    rows = [] if traj.image_patches is None else [traj.image_patches]
    new = cfg.images.for_messages(messages)
    if new is not None:
        rows.append(new)
    n = list(sampled).count(template.tok.special_ids["<image>"])
    rows.append(torch.zeros(n, cfg.images.patch_dim))
    traj.image_patches = torch.cat(rows)


def _record_routes(traj: Trajectory, out: GenerationOutput) -> None:
    """Keep each token's first recorded routes (the ones its sampled successors were scored
    under); positions the engine has not run yet stay -1 until a later turn's prefill."""
    if out.routed_experts is None:
        return
    if traj.routed_experts is None:
        traj.routed_experts = out.routed_experts[:0]  # no position recorded yet
    traj.routed_experts, start = merge_routes(traj.routed_experts, 0, out.routed_experts, out.routed_from)
    assert start == 0


async def _run_calls(env: Env, calls, traj: Trajectory) -> tuple[list[Message], Observation | None]:
    """Run the turn's calls in order; malformed ones become error observations."""
    results: list[Message] = []
    for call in calls:
        traj.num_tool_calls += 1
        if isinstance(call, CallError):
            obs, name, cid = Observation(text=f"Error: {call.message}", is_error=True), "", ""
        else:  # the env judges tool names and arguments (an error observation if bad)
            obs, name, cid = await env.step(call), call.name, call.id
        traj.num_tool_errors += obs.is_error
        results.append(Message(role="tool", content=obs.text, name=name, image=obs.image, tool_call_id=cid))
        if obs.done:
            return results, obs
    return results, None


async def run_episode_with_retries(make_env: Callable[[], Env], engine: RolloutEngine, task: Task,
                                   template: ChatTemplate, params: SamplingParams, cfg: AgentConfig,
                                   group_id: str) -> Trajectory:
    """``run_episode`` on a fresh env, retried on infrastructure failure -- ``EnvError`` or any other
    exception from reset / step / verify (logged with its traceback) -- then ``env_error``."""
    last: Exception | None = None
    for attempt in range(cfg.max_env_retries + 1):
        env = make_env()
        try:
            traj = await run_episode(env, engine, task, template, params, cfg, group_id)
            traj.env_retries = attempt
            return traj
        except Exception as e:  # noqa: BLE001  (any exception from env code is infrastructure: retried, then env_error)
            last = e
            if not isinstance(e, EnvError):
                log.warning("episode %s (task %s), attempt %d: unexpected %r from the env; retried as an env error",
                            group_id, task.id, attempt + 1, e, exc_info=True)
        finally:
            try:
                await env.close()
            except (OSError, EnvError) as e:  # a sandbox that will not go away must not lose the episode
                log.warning("closing the env of %s (task %s) failed: %r", group_id, task.id, e)
    return Trajectory(token_ids=[], loss_mask=[], logprobs=[], policy_version=[], domain=task.domain,
                      task_id=task.id, group_id=group_id, tier=task.tier, finish_reason=FinishReason.ENV_ERROR,
                      reward_info={"error": repr(last)}, env_retries=cfg.max_env_retries)
