"""Every browser task's oracle / no-op / wrong policy through the real template, parser, agent
loop, bwrap sandbox and loopback sites (text mode), and a few in image mode through Chromium.

The default tier plays one task per reward kind (oracle, no-op, wrong) and one image-mode oracle
whose screenshots are then fed to a model as image patches; ``pytest -m slow`` plays every task in
text mode and five more in image mode (oracle and wrong).
"""

import asyncio

import pytest
import torch

from jointrl.envs.base import EnvError
from jointrl.envs.browser.driver_process import check_venv
from jointrl.envs.browser.env import BrowserEnv
from jointrl.envs.browser.tasks import KINDS, SHIPPED_SEEDS, load_tasks, make_task, policy
from jointrl.model import MoEConfig, MoETransformer
from jointrl.model.chat_template import ChatTemplate
from jointrl.rl.agent_loop import AgentConfig, run_episode
from jointrl.rl.image_inputs import ImageInputs
from jointrl.rl.rollout.scripted import ScriptedEngine
from jointrl.envs.sandbox.base import SandboxConfig
from jointrl.rl.types import FinishReason, SamplingParams

TASKS = load_tasks()
TPL = ChatTemplate()
PARAMS = SamplingParams(max_tokens=4096)
CFG = AgentConfig(max_context=1 << 16)
FAST = {"city_population-1", "birth_country-2", "person_facts-3", "cheapest_rated-1", "profile_update-1"}
# image mode, all slow; the default tier plays city_population-2's oracle in image mode (the last test)
IMAGE = {"buy_quantity-2", "capital_elevation-1", "best_under_price-3", "notifications-2", "address_from_wiki-1"}


def _missing(mode):
    try:
        check_venv(mode)
    except Exception as err:  # noqa: BLE001
        return str(err)
    return None


needs_image = pytest.mark.skipif(_missing("image") is not None, reason=f"no image mode here: {_missing('image')}")


def play(task, turns, mode="text", template=TPL):
    async def go():
        env = BrowserEnv(mode=mode)
        try:
            return await run_episode(env, ScriptedEngine(turns, template), task, template, PARAMS, CFG, "g")
        finally:
            await env.close()

    return asyncio.run(go())


def tiered(ids, fast):
    by_id = {t.id: t for t in TASKS}
    return [pytest.param(by_id[i], id=i, marks=() if i in fast else pytest.mark.slow) for i in sorted(ids)]


def test_ships_at_least_forty_tasks_of_every_kind():
    assert len(TASKS) >= 40 and len({t.id for t in TASKS}) == len(TASKS)
    assert {t.metadata["kind"] for t in TASKS} == set(KINDS)
    assert {tuple(sorted(t.reward)) for t in TASKS} == {("answer_match",), ("answer_includes",), ("answer_number",),
                                                        ("app_state",)}
    assert FAST | IMAGE | {"city_population-2"} <= {t.id for t in TASKS}


def test_generator_is_deterministic_and_seeds_differ():
    assert make_task("birth_country", 1) == make_task("birth_country", 1)
    assert policy(make_task("cheapest_rated", 7), "oracle") == policy(make_task("cheapest_rated", 7), "oracle")
    prompts = {make_task("birth_country", s).prompt for s in range(10, 20)}
    assert len(prompts) == 10 and 10 not in SHIPPED_SEEDS
    with pytest.raises(ValueError, match="available"):
        make_task("no_such_kind", 1)


@pytest.mark.parametrize("task", tiered({t.id for t in TASKS}, FAST))
def test_oracle_noop_wrong_through_the_agent_loop(task):
    for name, expected in (("oracle", 1.0), ("noop", 0.0), ("wrong", 0.0)):
        traj = play(task, policy(task, name))
        assert traj.reward == expected, (task.id, name, traj.reward_info, [m.content[:300] for m in traj.messages])
        assert traj.finish_reason == FinishReason.STOP and traj.num_tool_errors == 0, (name, traj.messages[-2:])


@needs_image
@pytest.mark.parametrize("task", tiered(IMAGE, set()))
def test_image_mode_through_chromium(task):
    for name, expected in (("oracle", 1.0), ("wrong", 0.0)):
        traj = play(task, policy(task, name), mode="image")
        assert traj.reward == expected, (task.id, name, traj.reward_info, [m.content[:300] for m in traj.messages])
        assert traj.num_tool_errors == 0, traj.messages


def test_a_new_seed_plays_like_the_shipped_ones():
    task = make_task("source_currency", 1234)
    assert play(task, policy(task, "oracle")).reward == 1.0
    assert play(task, policy(task, "wrong")).reward == 0.0


@needs_image
def test_image_mode_oracle_scores_and_its_screenshots_reach_the_policy_as_image_patches():
    images = ImageInputs(patch=16, height=112, width=160)
    tpl = ChatTemplate(image_tokens=images.num_tokens)
    task = make_task("city_population", 2)
    engine = ScriptedEngine(policy(task, "oracle"), tpl)  # goto, type, press Enter, answer

    async def go():
        env = BrowserEnv(mode="image")
        try:
            traj = await run_episode(env, engine, task, tpl, PARAMS, CFG, "g")
            return traj, dict(env.driver.sandbox.limits)
        finally:
            await env.close()

    traj, limits = asyncio.run(go())
    assert traj.reward == 1.0 and traj.num_tool_errors == 0, (traj.reward_info, traj.messages)
    assert limits["memory"].startswith("cgroup")  # Chromium is bounded by the cgroup, never RLIMIT_AS
    shots = [m.image for m in traj.messages if m.image is not None]
    assert len(shots) == 3 and all(s.startswith(b"\x89PNG") for s in shots)
    slot = tpl.tok.special_ids["<image>"]
    prompt = engine.prompts[-1]  # what the policy was given for its last turn
    assert prompt.count(slot) == 3 * images.num_tokens
    patches = images.for_messages(traj.messages)
    n = images.num_tokens
    assert patches.shape == (3 * n, images.patch_dim)
    assert (patches[:n] - patches[2 * n:]).abs().max() > 0.1  # the wiki's home, then the city's page
    model = MoETransformer.from_config(MoEConfig.preset("tiny_moe", image_patch_dim=images.patch_dim), seed=0)
    first = prompt.index(slot)
    ids = torch.tensor([prompt[first - 8: first + n + 24]])  # the first screenshot and its context (CPU time)
    with torch.no_grad():
        seen = model(ids, image_patches=patches[:n]).logits
        blank = model(ids, image_patches=torch.zeros_like(patches[:n])).logits
    assert (seen[:, :8] - blank[:, :8]).abs().max() < 1e-5
    assert (seen[:, 8:] - blank[:, 8:]).abs().max() > 1e-4  # the screenshot's pixels change the policy


@needs_image
@pytest.mark.slow
def test_chromium_over_the_memory_cgroup_is_an_infrastructure_error():
    small = SandboxConfig(timeout_s=60, max_processes=1024, cpu_seconds=600, max_memory_bytes=96 << 20)

    async def go():
        env = BrowserEnv(small, mode="image")
        try:
            await env.reset(make_task("city_population", 1))
        finally:
            await env.close()

    with pytest.raises(EnvError, match="page driver"):
        asyncio.run(go())
