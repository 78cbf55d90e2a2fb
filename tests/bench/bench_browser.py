"""Browser-domain benchmark: what an episode's reset and one action cost, text vs image mode.

Not collected by pytest; run as ``python tests/bench/bench_browser.py`` (root, bubblewrap, the
tool venv; Chromium for the image rows). Prints one table of medians; ratios are against a
cold ``BwrapSandbox`` running one ``true`` measured in the same run, interleaved round by round
so that a loaded host moves both sides alike. Then the size of every shipped task's oracle episode
context, ``envs.prompt=full`` against ``compact`` (``envs/browser/compact.py``). Reported, not asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from jointrl.envs.base import Task, ToolCall
from jointrl.envs.browser.env import BrowserEnv
from jointrl.envs.browser.tasks import load_tasks, policy
from jointrl.envs.browser.web.sites import base_url
from jointrl.envs.browser.web.sites.world import make_world
from jointrl.envs.sandbox.bwrap import BwrapSandbox

PEER = "cold bwrap sandbox, one `true`, close (peer)"
TASK = Task(id="bench", domain="browser", prompt="bench", metadata={"seed": 1})


def sandbox_start() -> float:
    t0 = time.perf_counter()
    sb = BwrapSandbox(shell=False)
    sb.exec("true")
    sb.close()
    return time.perf_counter() - t0


def episode(mode: str, actions: int) -> tuple[float, float]:
    """(reset + close seconds, median seconds of one goto to a wiki article)."""
    article = f"{base_url('wiki')}/wiki/{sorted(make_world(1).countries)[0]}"

    async def go() -> tuple[float, float]:
        env = BrowserEnv(mode=mode)
        t0 = time.perf_counter()
        await env.reset(TASK)
        took_reset = time.perf_counter() - t0
        steps = []
        try:
            for _ in range(actions):
                t = time.perf_counter()
                obs = await env.step(ToolCall("goto", {"url": article}))
                steps.append(time.perf_counter() - t)
                assert not obs.is_error, obs.text
        finally:
            t = time.perf_counter()
            await env.close()
            took_reset += time.perf_counter() - t
        return took_reset, statistics.median(steps)

    return asyncio.run(go())


def transcript_bytes(compact: bool, views: bool) -> list[int]:
    """Per shipped task: bytes of the oracle episode's context in text mode (system prompt, tool
    descriptions and schemas, task, every observation): a byte-level model's token count, near enough."""

    async def one(task) -> int:
        env = BrowserEnv(compact=compact, compact_views=views)
        try:
            messages = await env.reset(task)
            n = sum(len(m.content.encode()) for m in messages)
            n += sum(len(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters}))
                     for t in env.tools)
            for turn in policy(task, "oracle"):
                for call in turn:
                    n += len((await env.step(call)).text.encode())
            return n
        finally:
            await env.close()

    return [asyncio.run(one(t)) for t in load_tasks()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--actions", type=int, default=5)
    ap.add_argument("--no-image", action="store_true")
    args = ap.parse_args()
    modes = ["text"] + ([] if args.no_image else ["image"])
    rows: dict[str, list[float]] = {PEER: []}
    for m in modes:
        rows[f"{m}: reset + close (sandbox, sites, browser)"] = []
        rows[f"{m}: one action (goto a wiki article)"] = []
    for _ in range(args.rounds):
        rows[PEER].append(sandbox_start())
        for m in modes:
            reset, step = episode(m, args.actions)
            rows[f"{m}: reset + close (sandbox, sites, browser)"].append(reset)
            rows[f"{m}: one action (goto a wiki article)"].append(step)
    peer = statistics.median(rows[PEER])
    print(f"{'case':50} {'median ms':>10} {'x peer':>8}")
    for name, times in rows.items():
        ms = statistics.median(times) * 1e3
        print(f"{name:50} {ms:10.1f} {ms / (peer * 1e3):8.2f}")
    sizes = {"envs.prompt=full": transcript_bytes(False, False),
             "compact prompt, full observations (before)": transcript_bytes(True, False),
             "envs.prompt=compact: prompt and observations": transcript_bytes(True, True)}
    full = sum(sizes["envs.prompt=full"])
    print(f"\noracle episode context, text mode, {len(sizes['envs.prompt=full'])} shipped tasks, bytes")
    print(f"{'case':50} {'median':>8} {'max':>7} {'total':>8} {'x full':>7}")
    for name, n in sizes.items():
        print(f"{name:50} {statistics.median(n):8.0f} {max(n):7d} {sum(n):8d} {sum(n) / full:7.2f}")


if __name__ == "__main__":
    main()
