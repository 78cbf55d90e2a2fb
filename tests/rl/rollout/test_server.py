"""``jointrl serve`` as a subprocess on loopback, driven by the real ``openai`` and ``anthropic`` clients.

The served policy is ``tiny_moe`` overfit on one calculator conversation (``calc_policy.py``),
so greedy decoding calls tools deterministically: two parallel ``calc`` calls, one call, then
the answer. Under the ``low`` tier (8 thinking tokens here) the turn (``generate_turn``) forces ``</think>``
after 8 tokens and the policy, trained on that too, still completes the conversation.
"""

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import calc_policy as cp  # noqa: E402

from jointrl.envs.base import ToolCall  # noqa: E402
from jointrl.model.chat_template import ChatTemplate  # noqa: E402
from jointrl.rl.agent_loop import AgentConfig, run_episode  # noqa: E402
from jointrl.rl.config import load_config  # noqa: E402
from jointrl.rl.rollout.recorder import read_trajectories  # noqa: E402
from jointrl.rl.rollout.server import build_engine  # noqa: E402
from jointrl.rl.types import SamplingParams  # noqa: E402

OVERRIDES = ["rollout.backend=simple", "rollout.thinking_budget.low=8", "rollout.temperature=0", "rollout.quantize_experts=false",
             "rollout.max_context=2048", "serve.default_max_tokens=256"]


@pytest.fixture(scope="module")
def policy():
    return cp.policy_dir()


@pytest.fixture(scope="module")
def server(policy, tmp_path_factory):
    record = tmp_path_factory.mktemp("serve") / "recorded.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(["jointrl", "serve", f"checkpoint={policy}", "serve.port=0",
                             f"serve.record_path={record}", *OVERRIDES],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 120
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "listening on" in line or proc.poll() is not None:
            break
    assert "listening on" in line, f"server did not start: {line!r}"
    url = line.split("listening on ")[1].split()[0]
    yield url, record
    proc.terminate()
    proc.wait(timeout=30)


def _calc(name: str, args: dict) -> str:
    return asyncio.run(cp.CalcEnv().step(ToolCall(name, args))).text


def openai_conversation(url: str, tier: str, stream: bool, seed: int | None = None, temperature: float = 0.0,
                        pin: bool = False):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "system", "content": cp.SYSTEM}, {"role": "user", "content": cp.USER}]
    turns, conv = [], None
    for _ in range(4):  # bounded: the script has three turns
        kw = dict(model="jointrl", messages=msgs, tools=[cp.CALC.to_openai()], temperature=temperature, seed=seed,
                  max_tokens=256, extra_body={"thinking_budget": tier, **({"conversation_id": conv} if pin and turns else {})})
        if stream:
            reasoning, content, calls, finish, conv = "", "", {}, None, None
            for chunk in client.chat.completions.create(stream=True, **kw):
                conv = chunk.model_extra.get("conversation_id", conv)
                d = chunk.choices[0].delta
                reasoning += (d.model_extra or {}).get("reasoning_content") or ""
                content += d.content or ""
                for tc in d.tool_calls or []:
                    calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                    calls[tc.index]["arguments"] += tc.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            calls = [calls[i] for i in sorted(calls)]
        else:
            r = client.chat.completions.create(**kw)
            m, finish, conv = r.choices[0].message, r.choices[0].finish_reason, r.model_extra["conversation_id"]
            reasoning, content = m.model_extra["reasoning_content"], m.content or ""
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []]
        turns.append((reasoning, content, [(c["name"], json.loads(c["arguments"])) for c in calls], finish))
        msgs.append({"role": "assistant", "content": content, "reasoning_content": reasoning,
                     "tool_calls": [{"id": c["id"], "type": "function",
                                     "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]})
        if not calls:
            break
        for c in calls:
            msgs.append({"role": "tool", "tool_call_id": c["id"], "content": _calc(c["name"], json.loads(c["arguments"]))})
    return turns, conv


def expected_turns(budget: int | None):
    tok = ChatTemplate().tok
    return [(r if budget is None else tok.decode(tok.encode(r)[:budget]), x, [(c.name, c.arguments) for c in calls],
             "tool_calls" if calls else "stop") for r, calls, x in cp.SCRIPT]


@pytest.mark.parametrize("stream", [pytest.param(False, marks=pytest.mark.slow), True], ids=["plain", "stream"])
def test_openai_client_multi_turn_tool_calls(server, stream):
    url, _ = server
    turns, _ = openai_conversation(url, "max", stream)
    assert turns == expected_turns(None)
    low, _ = openai_conversation(url, "low", stream)
    assert low == expected_turns(cp.LOW_BUDGET)  # 8 thinking tokens per turn, then a forced </think>
    assert all(len(r.encode()) == cp.LOW_BUDGET for r, *_ in low)


@pytest.mark.parametrize("stream", [pytest.param(False, marks=pytest.mark.slow), True], ids=["plain", "stream"])
def test_anthropic_client_multi_turn_tool_use(server, stream):
    url, _ = server
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    for budget in (None, cp.LOW_BUDGET):
        msgs, got = [{"role": "user", "content": cp.USER}], []
        for _ in range(4):
            kw = dict(model="jointrl", max_tokens=256, system=cp.SYSTEM, messages=msgs,
                      tools=[{"name": cp.CALC.name, "description": cp.CALC.description, "input_schema": cp.CALC.parameters}],
                      thinking={"type": "enabled", "budget_tokens": budget} if budget else anthropic.NOT_GIVEN)
            if stream:
                with client.messages.stream(**kw) as s:
                    msg = s.get_final_message()
            else:
                msg = client.messages.create(**kw)
            blocks = [b.model_dump(exclude_none=True) for b in msg.content]
            think = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
            text = "".join(b["text"] for b in blocks if b["type"] == "text")
            uses = [b for b in blocks if b["type"] == "tool_use"]
            got.append((think, text, [(u["name"], u["input"]) for u in uses],
                        {"tool_use": "tool_calls", "end_turn": "stop"}[msg.stop_reason]))
            msgs.append({"role": "assistant", "content": blocks})
            if not uses:
                break
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": u["id"],
                                                      "content": _calc(u["name"], u["input"])} for u in uses]})
        assert got == expected_turns(budget)


def test_recorded_conversation_equals_the_agent_loop(server, policy):
    """Same seed, sampling at temperature 0.5: the server's recording == rl/agent_loop.run_episode."""
    url, record = server
    seed = 1234
    turns, conv = openai_conversation(url, "max", stream=False, seed=seed, temperature=0.5, pin=True)
    req = urllib.request.Request(f"{url}/v1/conversations/{conv}/finish", method="POST",
                                 data=json.dumps({"reward": 1.0, "task_id": "calc"}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        assert json.load(r)["recorded"] is True
    recorded = next(t for t in read_trajectories(record) if t.group_id == conv)

    cfg = load_config(OVERRIDES)
    engine = build_engine(cfg, str(policy))
    params = SamplingParams(max_tokens=256, temperature=0.5, seed=seed)

    async def go():
        try:
            return await run_episode(cp.CalcEnv(), engine, cp.TASK, ChatTemplate(), params,
                                     AgentConfig(max_context=2048), group_id="g")
        finally:
            await engine.close()

    ref = asyncio.run(go())
    assert ref.num_turns == len(turns) >= 2
    assert recorded.token_ids == ref.token_ids
    assert recorded.loss_mask == ref.loss_mask
    assert recorded.logprobs == ref.logprobs
    assert recorded.policy_version == ref.policy_version
    assert recorded.reward == 1.0 and recorded.num_turns == ref.num_turns


def _post(url: str, path: str, body: bytes | str | dict, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
    req = urllib.request.Request(url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_twenty_malformed_requests_get_4xx_and_the_server_keeps_serving(server):
    url, _ = server
    ok_msgs = [{"role": "user", "content": "hi"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{\"expr\": \"1\"}"}}]}
    huge = [{"role": "user", "content": "x" * 5000}]
    cases = [  # (path, body, status, field named in the message)
        ("/v1/chat/completions", b"{not json", 400, "JSON"),
        ("/v1/chat/completions", "[1, 2]", 400, "JSON object"),
        ("/v1/chat/completions", {"model": "m"}, 400, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "tool", "tool_call_id": "c9", "content": "1"}]}, 400,
         "messages[0].tool_call_id"),
        ("/v1/chat/completions", {"model": "m", "messages": [*ok_msgs, call, {"role": "tool", "tool_call_id": "c2",
                                                                              "content": "1"}]}, 400, "tool_call_id"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        ("/v1/chat/completions", {"model": "m", "messages": ok_msgs, "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/chat/completions", {"model": "m", "messages": ok_msgs, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {"model": "m", "messages": ok_msgs, "temperature": 7}, 400, "temperature"),
        ("/v1/chat/completions", {"model": "m", "messages": ok_msgs, "thinking_budget": "extreme"}, 400, "thinking_budget"),
        ("/v1/chat/completions", {"model": "m", "messages": ok_msgs, "tools": {"calc": 1}}, 400, "tools"),
        ("/v1/chat/completions", {"model": "m", "messages": ok_msgs, "tools": [cp.CALC.to_openai()],
                                  "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
        ("/v1/chat/completions", {"model": "m", "messages": [*ok_msgs, {**call, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{bad"}}]}]}, 400, "arguments"),
        ("/v1/chat/completions", {"model": "m", "messages": huge * 1}, 400, "context limit"),
        ("/v1/messages", {"model": "m", "messages": ok_msgs}, 400, "max_tokens"),
        ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, 400,
         "messages[0].role"),
        ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "1"}]}]}, 400, "tool_use_id"),
        ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": ok_msgs, "thinking": {"type": "enabled"}}, 400,
         "budget_tokens"),
        ("/v1/conversations/conv-nope/finish", {}, 404, "conv-nope"),
    ]
    assert len(cases) >= 20
    for path, body, status, needle in cases:
        code, err = _post(url, path, body)
        assert code == status, (path, body, code, err)
        message = err["error"]["message"]
        assert needle in message, (needle, message)
        if path == "/v1/messages":
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        else:
            assert set(err["error"]) >= {"message", "type", "param"}
        code, good = _post(url, "/v1/chat/completions", {"model": "m", "messages": ok_msgs, "max_tokens": 4,
                                                          "logprobs": True})
        assert code == 200 and 1 <= good["usage"]["completion_tokens"] <= 4, good
        lps = good["choices"][0]["logprobs"]["content"]
        assert len(lps) == good["usage"]["completion_tokens"] and all(e["logprob"] <= 0 for e in lps)
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        assert json.load(r)["data"][0]["id"] == "jointrl"
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
        assert json.load(r)["status"] == "ok"
