"""The browser env's behaviour: observations, the policy's mistakes as error observations,
the app state the reward reads, and the episode's isolation (its own loopback)."""

import asyncio
import http.server
import socket
import threading
import urllib.error
import urllib.request

import pytest

from jointrl.envs.base import EnvError, Task, ToolCall
from jointrl.envs.browser.env import BrowserEnv
from jointrl.envs.browser.tasks import make_task, policy
from jointrl.envs.browser.web.sites import PORTS, base_url
from jointrl.envs.browser.web.sites.world import make_world
from jointrl.model.chat_template import ChatTemplate
from jointrl.rl.agent_loop import AgentConfig, run_episode
from jointrl.rl.rollout.scripted import ScriptedEngine
from jointrl.rl.types import SamplingParams

TPL = ChatTemplate()


def task(seed=1):
    return Task(id=f"t{seed}", domain="browser", prompt="browse", metadata={"seed": seed})


async def opened(seed=1):
    env = BrowserEnv()
    await env.reset(task(seed))
    return env


def test_pages_are_markdown_with_numbered_elements_and_forms_work():
    world = make_world(1)
    country = sorted(world.countries)[0]

    async def go():
        env = await opened()
        try:
            home = await env.step(ToolCall("goto", {"url": base_url("wiki") + "/"}))
            assert home.text.startswith(f"URL: {base_url('wiki')}/") and "# Wiki" in home.text
            assert '[6: text "q" = ""]' in home.text and '[7: button "Search"]' in home.text
            await env.step(ToolCall("type", {"id": 6, "text": country}))
            page = await env.step(ToolCall("press", {"key": "Enter"}))  # search: an exact title redirects
            assert f"# {country}" in page.text and "| Capital |" in page.text
            found = await env.step(ToolCall("find", {"text": "currency"}))
            assert "1 line(s) match" in found.text and world.countries[country].currency in found.text
            back = await env.step(ToolCall("back", {}))
            assert back.text.startswith(f"URL: {base_url('wiki')}/\n")
            long = await env.step(ToolCall("goto", {"url": "/search?q=a"}))  # relative to the page
            assert "Search results for 'a'" in long.text and "scroll down for more]" in long.text
            down = await env.step(ToolCall("scroll", {"direction": "down"}))  # to the end, at most a screen
            last = long.text.splitlines()[-2]
            assert "# Search results" not in down.text and "scroll up for more]" in down.text
            assert last in down.text and down.text.splitlines()[-2] not in long.text
            up = await env.step(ToolCall("press", {"key": "Home"}))
            assert up.text == long.text
            return up
        finally:
            await env.close()

    assert not asyncio.run(go()).is_error


BAD_CALLS = [
    (ToolCall("click", {"id": 999}), "no element [999]"),
    (ToolCall("click", {"id": "3"}), "must be integer"),
    (ToolCall("click", {"id": True}), "must be integer"),
    (ToolCall("type", {"id": 1}), "missing required argument"),
    (ToolCall("type", {"id": 1, "text": "x"}), "not a text field or select"),
    (ToolCall("press", {"key": "F13"}), "unsupported key"),
    (ToolCall("scroll", {"direction": "sideways"}), "scroll direction"),
    (ToolCall("goto", {"url": "file:///etc/passwd"}), "only http(s)"),
    (ToolCall("goto", {"url": "http://127.0.0.1:8001/", "new_tab": True}), "unknown argument"),
    (ToolCall("launch_missiles", {}), "unknown tool"),
]


def test_bad_calls_are_error_observations_and_the_episode_goes_on():
    async def go():
        env = await opened()
        try:
            await env.step(ToolCall("goto", {"url": base_url("wiki") + "/"}))
            results = []
            for call, _ in BAD_CALLS:
                results.append((await env.step(call), await env.step(ToolCall("click", {"id": 1}))))
            return results, env.num_tool_errors
        finally:
            await env.close()

    results, errors = asyncio.run(go())
    for (bad, after), (call, message) in zip(results, BAD_CALLS):
        assert bad.is_error and message in bad.text and bad.text.startswith("Error"), (call, bad.text)
        assert not after.is_error and "# Wiki" in after.text
    assert errors == len(BAD_CALLS)


def test_malformed_turns_through_the_agent_loop_then_the_oracle_still_scores():
    t = make_task("buy_quantity", 1)
    tok = TPL.tok
    broken_json = [tok.think_end_id, tok.tool_call_id, *tok.encode('{"name": "goto", "arguments": {'),
                   tok.tool_call_end_id, tok.im_end_id]
    turns = [broken_json, [ToolCall("click", {"id": 1})], [ToolCall("type", {"text": "2"})], *policy(t, "oracle")]

    async def go():
        env = BrowserEnv()
        try:
            return await run_episode(env, ScriptedEngine(turns, TPL), t, TPL, SamplingParams(max_tokens=4096),
                                     AgentConfig(max_context=1 << 16), "g")
        finally:
            await env.close()

    traj = asyncio.run(go())
    tool = [m.content for m in traj.messages if m.role == "tool"]
    assert "not valid JSON" in tool[0] and "no page is open" in tool[1] and "missing required" in tool[2]
    assert traj.num_tool_errors == 3 and traj.reward == 1.0


def test_answer_ends_the_episode_and_is_the_final_answer():
    async def go():
        env = await opened()
        try:
            end = await env.step(ToolCall("answer", {"text": "Zoë, 1,733 m"}))
            late = await env.step(ToolCall("goto", {"url": base_url("wiki") + "/"}))
            return end, late
        finally:
            await env.close()

    end, late = asyncio.run(go())
    assert end.done and end.text == "Zoë, 1,733 m" and late.is_error and "over" in late.text


def _get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def test_each_episode_has_its_own_sites_unreachable_from_the_host_and_other_episodes():
    a_world = make_world(1)
    a_country = sorted(a_world.countries)[0]
    sku = next(p.sku for p in a_world.products.values() if p.stock)

    async def go():
        a, b = await opened(1), await opened(2)  # both serve on the same loopback ports
        try:
            seen_a = await a.step(ToolCall("goto", {"url": f"{base_url('wiki')}/wiki/{a_country}"}))
            seen_b = await b.step(ToolCall("goto", {"url": f"{base_url('wiki')}/wiki/{a_country}"}))
            await a.step(ToolCall("goto", {"url": f"{base_url('shop')}/product/{sku}"}))
            await a.step(ToolCall("click", {"id": 8}))  # Add to cart (one)
            cart_b = await b.step(ToolCall("goto", {"url": f"{base_url('shop')}/cart"}))
            try:  # the host's own loopback, while both episodes serve
                host_view = _get(f"{base_url('wiki')}/wiki/{a_country}")
            except (urllib.error.URLError, OSError) as err:
                host_view = f"unreachable: {err}"
            state_a = a.verify_sandbox()
            try:
                cart_a = state_a.read_file("site/state.json").decode()
            finally:
                state_a.close()
            return seen_a, seen_b, cart_b, host_view, cart_a
        finally:
            await a.close()
            await b.close()

    seen_a, seen_b, cart_b, host_view, cart_a = asyncio.run(go())
    assert f"# {a_country}" in seen_a.text and "| Capital |" in seen_a.text
    assert "Not found" in seen_b.text  # episode b's wiki is another world: a's page is not there
    assert "Your cart is empty" in cart_b.text and f'"{sku}": 1' in cart_a
    assert "| Capital |" not in host_view and a_world.countries[a_country].capital not in host_view


def _host_ip():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outgoing interface
            return s.getsockname()[0]
        except OSError:
            return None


def test_the_browser_reaches_nothing_but_its_own_loopback():
    server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), http.server.SimpleHTTPRequestHandler)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ip = _host_ip()
    urls = [f"http://127.0.0.1:{port}/"] + ([f"http://{ip}:{port}/"] if ip and not ip.startswith("127.") else [])
    try:
        assert "Directory listing" in _get(urls[-1])  # the host server does serve, on the host

        async def go():
            env = await opened()
            try:
                return [await env.step(ToolCall("goto", {"url": u})) for u in urls]
            finally:
                await env.close()

        for obs in asyncio.run(go()):
            assert obs.is_error and "cannot load" in obs.text and "Directory listing" not in obs.text
    finally:
        server.shutdown()
    assert set(PORTS.values()).isdisjoint({port})


def test_a_missing_tool_venv_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("JOINTRL_BROWSER_VENV", str(tmp_path / "nowhere"))
    with pytest.raises(EnvError, match="setup.d/browser.sh"):
        asyncio.run(opened())


def test_a_checkout_under_a_private_directory_still_serves_pages(monkeypatch, tmp_path):
    """``mktemp -d`` makes a 0700 parent, which the episode's uid cannot traverse: ``web/`` is
    copied into the sandbox, so a clone there works (it failed before on a world-readable check)."""
    import shutil

    from jointrl.envs.browser import driver_process

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    shutil.copytree(driver_process.WEB_DIR, private / "web", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(driver_process, "WEB_DIR", private / "web")

    async def go():
        env = await opened()
        try:
            return await env.step(ToolCall("goto", {"url": base_url("wiki") + "/"}))
        finally:
            await env.close()
    home = asyncio.run(go())
    assert not home.is_error and "# Wiki" in home.text


def test_compact_prompt_keeps_the_tools_and_shrinks_the_system_turn():
    """``envs.prompt=compact`` (through the registry, as the env workers build envs): the same tool
    names and schemas, a shorter system turn, and calls still run."""
    from jointrl.envs.registry import make_env
    from jointrl.rl.config import EnvsConfig

    async def system_turn(env):
        try:
            messages = await env.reset(task())
            home = await env.step(ToolCall("goto", {"url": base_url("wiki") + "/"}))
            return TPL.render(messages[:1], env.tools), home
        finally:
            await env.close()

    full, compact = make_env("browser", EnvsConfig()), make_env("browser", EnvsConfig(prompt="compact"))
    assert [(s.name, s.parameters) for s in compact.tools] == [(s.name, s.parameters) for s in full.tools]
    (full_ids, _), (compact_ids, home) = asyncio.run(system_turn(full)), asyncio.run(system_turn(compact))
    assert len(compact_ids) < len(full_ids) - 500 and "# Wiki" in home.text  # ~600 fewer byte tokens per episode


@pytest.mark.parametrize("kind", ["best_under_price", "profile_update", "buy_quantity"])
def test_compact_observations_send_same_page_updates_as_their_changed_lines(kind):
    """The oracle through the agent loop, full views against compact ones (envs/browser/compact.py):
    the same reward, a shorter transcript, and a form field typed into comes back as its own line."""
    t = make_task(kind, 1)

    async def play(compact):
        env = BrowserEnv(compact=compact)
        try:
            return await run_episode(env, ScriptedEngine(policy(t, "oracle"), TPL), t, TPL,
                                     SamplingParams(max_tokens=4096), AgentConfig(max_context=1 << 16), "g")
        finally:
            await env.close()

    full, compact = asyncio.run(play(False)), asyncio.run(play(True))
    assert full.reward == compact.reward == 1.0
    full_obs = [m.content for m in full.messages if m.role == "tool"]
    compact_obs = [m.content for m in compact.messages if m.role == "tool"]
    assert len(full_obs) == len(compact_obs) and sum(map(len, compact_obs)) < 0.8 * sum(map(len, full_obs))
    for f, c in zip(full_obs, compact_obs):
        if c.startswith("Same page; changed:\n"):
            assert all(line in f.split("\n") for line in c.split("\n")[1:])  # only lines of the full view
        elif c != "Same page; nothing changed.":
            assert "Title: " not in c and "| --- |" not in c and c.split("\n")[0] == f.split("\n")[0]
    assert any(c.startswith("Same page; changed:") for c in compact_obs)
