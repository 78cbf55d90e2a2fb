"""``generate_turn``: one assistant turn with its thinking budget, over any ``RolloutEngine``.

The thinking budget has this one owner, whatever the backend (the fast engine, the simple
sampler, a scripted policy, a vLLM adapter): engines know only ``max_tokens`` and stop ids.

    prompt ends with <think>:                                    (the chat template opens it)
        reasoning = engine.generate(prompt, max_tokens=min(budget, room), stop=+</think>)
        no </think> and no stop token after `budget` tokens:  append </think> (forced:
            sampled 0, log-prob 0.0; it counts against max_tokens)
        rest = engine.generate(prompt + reasoning + </think>, max_tokens=room left)
    prompt does not open it, a budget is set (Qwen3's template leaves <think> to the model):
        opening = engine.generate(prompt, stop=+<think>); if it stopped at <think>, the rest of
        the turn is budgeted as above from prompt + opening
    otherwise: one engine.generate(prompt, params)

The continuation extends the first call's tokens, so an engine with sessions (``LLMEngine``)
adopts the reasoning's cached keys/values and prefills only the closing token (and the
reasoning's last token, which no forward had taken as input yet). Guarantees:
``max_tokens`` bounds the whole turn; sampled tokens keep the engine's log-probs; the
continuation samples from a seed derived from the request's (``continuation_seed``), so a
seeded or greedy turn replays exactly; ``think_tokens`` counts the sampled reasoning tokens
(``</think>`` excluded). A ``<think>`` the model opens after its reasoning closed is not budgeted.

Harmony (gpt-oss, model/harmony.py) plays the same roles with its own tokens: the generation prompt
ends ``<|channel|>analysis<|message|>`` (``think_id``), the budget's forced close is ``<|end|>``
(``think_end_id``), after which the model writes its next message header itself; ``tok.turn_stop_ids``
(``<|call|>``) join the stop ids, beside the engine's ``im_end_id`` (``<|return|>``). A vocabulary
without reasoning tokens (Kimi-Linear-Instruct: ``think_id`` is ``model/kimi.NO_TOKEN``) has no budget:
one engine.generate.
"""

from __future__ import annotations

import dataclasses

import torch

from jointrl.model.tokenizer import Tokenizer
from jointrl.rl.rollout.engine import RolloutEngine
from jointrl.rl.types import GenerationOutput, SamplingParams, merge_routes

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio (splitmix64's increment)


def continuation_seed(seed: int | None) -> int | None:
    """The continuation's sampling seed: a splitmix64 step of ``seed`` (None stays None), so the
    rest of a turn draws numbers other than its reasoning's, and other than any other request's
    seed nearby (the env workers number seeds consecutively)."""
    if seed is None:
        return None
    z = (seed + _MIX) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1  # 63 bits: a valid torch seed everywhere


async def generate_turn(engine: RolloutEngine, prompt_ids: list[int], params: SamplingParams,
                        think_budget: int | None, tok: Tokenizer,
                        image_patches: torch.Tensor | None = None) -> GenerationOutput:
    """One assistant turn continuing ``prompt_ids``: at most ``think_budget`` sampled reasoning
    tokens (None: unlimited) when the prompt opens ``<think>``, ``params.max_tokens`` in all.
    ``image_patches`` [P, patch_dim]: a row per ``<image>`` id of the prompt (passed on only when
    given). Returns the turn as one ``GenerationOutput`` (module docstring)."""
    if think_budget is not None and think_budget < 0:
        raise ValueError(f"think_budget must be >= 0 or None, got {think_budget}")
    if any(i not in params.stop_token_ids for i in tok.turn_stop_ids):  # harmony's <|call|> ends a turn too
        params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *tok.turn_stop_ids))
    if tok.think_end_id in params.stop_token_ids:
        return await _generate(engine, prompt_ids, params, image_patches)
    if prompt_ids[-1] != tok.think_id:
        if think_budget is None or tok.think_id < 0 or tok.think_id in params.stop_token_ids:  # < 0: no <think>
            return await _generate(engine, prompt_ids, params, image_patches)
        opening = await _generate(engine, prompt_ids, dataclasses.replace(
            params, stop_token_ids=(*params.stop_token_ids, tok.think_id)), image_patches)
        room = params.max_tokens - len(opening.token_ids)
        if opening.finish_reason != "stop" or opening.token_ids[-1] != tok.think_id or room == 0:
            return opening
        rest = await generate_turn(engine, prompt_ids + opening.token_ids,
                                   dataclasses.replace(params, max_tokens=room, seed=continuation_seed(params.seed)),
                                   think_budget, tok, _sampled_images(image_patches, opening, tok))
        return _join(opening, rest)
    limit = params.max_tokens if think_budget is None else min(params.max_tokens, think_budget)
    turn = GenerationOutput([], [], [], "length", -1)
    if limit > 0:
        think = dataclasses.replace(params, max_tokens=limit, stop_token_ids=(*params.stop_token_ids, tok.think_end_id))
        turn = await _generate(engine, prompt_ids, think, image_patches)
        if turn.finish_reason == "stop" and turn.token_ids[-1] != tok.think_end_id:
            turn.think_tokens = len(turn.token_ids)  # the turn ended inside its reasoning
            return turn
    closed = bool(turn.token_ids) and turn.token_ids[-1] == tok.think_end_id
    turn.think_tokens = len(turn.token_ids) - closed
    if not closed and len(turn.token_ids) < params.max_tokens:  # the budget ran out: close it
        turn.token_ids.append(tok.think_end_id)
        turn.logprobs.append(0.0)
        turn.sampled.append(0)
    room = params.max_tokens - len(turn.token_ids)
    if room == 0:
        turn.finish_reason = "length"
        return turn
    rest = await _generate(engine, prompt_ids + turn.token_ids,
                           dataclasses.replace(params, max_tokens=room, seed=continuation_seed(params.seed)),
                           _sampled_images(image_patches, turn, tok))
    return _join(turn, rest)


def _sampled_images(image_patches: torch.Tensor | None, out: GenerationOutput, tok: Tokenizer) -> torch.Tensor | None:
    """The prompt's patch rows plus a zero row for each ``<image>`` the model sampled in ``out``
    (``slot_patches``' rule), for a call that continues it."""
    if image_patches is None:
        return None
    n = out.token_ids.count(tok.special_ids.get("<image>"))
    return torch.cat([image_patches, image_patches.new_zeros(n, image_patches.shape[1])])


async def _generate(engine: RolloutEngine, prompt_ids: list[int], params: SamplingParams,
                    image_patches: torch.Tensor | None) -> GenerationOutput:
    if image_patches is not None:
        return await engine.generate(prompt_ids, params, image_patches=image_patches)
    return await engine.generate(prompt_ids, params)


def _join(first: GenerationOutput, rest: GenerationOutput) -> GenerationOutput:
    """``first`` then ``rest`` as one turn: the first sampled token's version, both calls' routes."""
    routes, start = rest.routed_experts, rest.routed_from
    if first.routed_experts is not None and routes is not None:
        routes, start = merge_routes(first.routed_experts, first.routed_from, routes, start)
    elif first.routed_experts is not None:
        routes, start = first.routed_experts, first.routed_from
    version = first.policy_version if first.policy_version >= 0 else rest.policy_version
    return GenerationOutput(first.token_ids + rest.token_ids, first.logprobs + rest.logprobs,
                            first.sampled + rest.sampled, rest.finish_reason, version, routes, start,
                            first.think_tokens + rest.think_tokens)
