"""An external agent: the plain ``openai`` client against ``jointrl serve``, a bash tool in a sandbox.

    jointrl serve serve.port=8000 serve.record_path=runs/serve/recorded.jsonl [checkpoint=...] &
    python examples/external_agent.py --task count-lines --samples 4 --url http://127.0.0.1:8000

Each episode: the terminal task's opening messages and tools (``envs/terminal``'s
``TerminalEnv``, a bubblewrap sandbox), then chat completions until the model stops calling
tools, submits or the turn limit; tool calls run in the sandbox and go back as ``tool``
messages (with the model's ``reasoning_content``, so its thinking stays in context, and the
returned ``conversation_id``, so the server continues this sample's tokens). The reward
modules, weighted as the trainer weighs them (``tests_pass`` + 0.1 ``format``), score the
final files; the agent then ends the conversation on the server (``POST
/v1/conversations/{id}/finish`` with the reward and a shared ``group_id``), which records it
as a ``Trajectory`` line: the tokens the built-in agent loop would have recorded. ``examples/train_on_recorded.py`` trains on the file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import urllib.request

import openai

from jointrl.envs.base import ToolCall
from jointrl.envs.terminal import TerminalEnv, load_tasks
from jointrl.rewards.base import Episode, combine
from jointrl.rl.config import load_config


async def episode(client: openai.OpenAI, url: str, task, group: str, seed: int, tier: str,
                  weights: dict[str, float]) -> float:
    env = TerminalEnv()
    try:
        msgs = [m.to_openai() for m in await env.reset(task)]
        tools = [t.to_openai() for t in env.tools]
        conv, turns, done, ended = None, 0, False, False
        for _ in range(task.max_turns):
            extra = {"thinking_budget": tier, **({"conversation_id": conv} if conv else {})}
            r = client.chat.completions.create(model="jointrl", messages=msgs, tools=tools, seed=seed, max_tokens=96,
                                               extra_body=extra)
            conv, m, turns = r.model_extra["conversation_id"], r.choices[0].message, turns + 1
            ended = r.choices[0].finish_reason != "length" and not r.model_extra.get("call_errors")
            msgs.append(m.model_dump(exclude_none=True))
            if not m.tool_calls:
                break
            for tc in m.tool_calls:
                obs = await env.step(ToolCall(tc.function.name, json.loads(tc.function.arguments), tc.id))
                msgs.append({"role": "tool", "tool_call_id": tc.id, "content": obs.text})
                done = done or obs.done
            if done:
                break
        result = combine(weights, task, Episode(messages=[], verify_sandbox=env.verify_sandbox, num_turns=turns,
                                                finished=ended))
        body = json.dumps({"reward": result.score, "task_id": task.id, "group_id": group, "domain": task.domain,
                           "tier": tier}).encode()
        urllib.request.urlopen(urllib.request.Request(f"{url}/v1/conversations/{conv}/finish", data=body,
                                                      method="POST"), timeout=60).close()
        return result.score
    finally:
        await env.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--task", default="count-lines")
    ap.add_argument("--samples", type=int, default=4, help="episodes of the task: one GRPO group")
    ap.add_argument("--tier", default="low", choices=["low", "high", "max"])
    args = ap.parse_args()
    task = next(t for t in load_tasks() if t.id == args.task)
    weights = load_config([]).envs.domains[task.domain].reward or task.reward  # as the trainer scores it
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key="unused", max_retries=0, timeout=300)
    for i in range(args.samples):
        print(f"{task.id} sample {i}: reward {asyncio.run(episode(client, args.url, task, task.id, i, args.tier, weights))}")


if __name__ == "__main__":
    main()
