"""Sandbox benchmark: cold start and persistent-shell commands against a plain subprocess, and
64 concurrent episodes. Not collected by pytest; run as ``python tests/bench/bench_sandbox.py``
(root + bubblewrap). Prints one table; ratios are against ``subprocess.run(["true"])``
measured in the same run, so a loaded host moves both sides.

Targets (issue #7): cold sandbox start <= 3x the plain subprocess, a persistent-shell command
<= 1x, 64 concurrent episodes on 2 cores with no failure. They are reported, not asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import time

from jointrl.envs.sandbox import SandboxConfig
from jointrl.envs.sandbox.bwrap import BwrapSandbox
from jointrl.envs.sandbox.pool import SandboxPool
from jointrl.envs.terminal import TerminalEnv, load_policy, load_tasks
from jointrl.rewards import Episode, combine


def per_call_ms(fn, n: int) -> float:
    """Median of ``n`` timed calls, in ms (the median resists the shared host's spikes)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def cold_start_ms(n: int) -> tuple[float, float]:
    starts, closes = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = BwrapSandbox()
        t1 = time.perf_counter()
        sb.close()
        starts.append(t1 - t0)
        closes.append(time.perf_counter() - t1)
    return statistics.median(starts) * 1e3, statistics.median(closes) * 1e3


def pool_acquire_ms(n: int) -> float:
    pool = SandboxPool(SandboxConfig(), size=4)
    times = []
    try:
        for _ in range(n):
            pool.warm(timeout=60)
            t0 = time.perf_counter()
            sb = pool.acquire()
            times.append(time.perf_counter() - t0)
            sb.close()
    finally:
        pool.close()
    return statistics.median(times) * 1e3


def concurrent_episodes(n: int) -> tuple[float, int, int]:
    """``n`` oracle episodes at once (tasks cycled), each scored by its verifier. -> (wall s, failures, wrong scores)."""
    tasks = load_tasks(backend="bwrap")
    pool = SandboxPool(SandboxConfig(timeout_s=120), size=8)

    async def one(task):
        env = TerminalEnv(SandboxConfig(timeout_s=120), pool=pool)
        try:
            await env.reset(task)
            messages = []
            for turn in load_policy(task, "oracle"):
                for call in turn:
                    messages.append((await env.step(call)).text)
            final = await env.final_files()
        finally:
            await env.close()
        try:
            return (await asyncio.to_thread(combine, task.reward, task, Episode(messages=[], verify_sandbox=final))).score
        finally:
            final.discard()

    async def all_of_them():
        return await asyncio.gather(*(one(tasks[i % len(tasks)]) for i in range(n)), return_exceptions=True)

    t0 = time.perf_counter()
    try:
        results = asyncio.run(all_of_them())
    finally:
        pool.close()
    wall = time.perf_counter() - t0
    failures = sum(isinstance(r, BaseException) for r in results)
    wrong = sum(r != 1.0 for r in results if not isinstance(r, BaseException))
    for r in results:
        if isinstance(r, BaseException):
            print("failure:", repr(r)[:300])
    return wall, failures, wrong


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="timed calls per command measurement")
    ap.add_argument("--starts", type=int, default=30, help="cold starts to time")
    ap.add_argument("--episodes", type=int, default=64)
    args = ap.parse_args()

    plain = per_call_ms(lambda: subprocess.run(["true"]), args.n)
    start, close = cold_start_ms(args.starts)
    with BwrapSandbox() as sb:
        sb.run("true")
        shell = per_call_ms(lambda: sb.run("true"), args.n)
        shell_echo = per_call_ms(lambda: sb.run("echo hello; cd /tmp; cd /work"), args.n)
        one_shot = per_call_ms(lambda: sb.exec("true"), max(20, args.n // 10))
        limits = sb.limits
    acquire = pool_acquire_ms(20)
    plain_after = per_call_ms(lambda: subprocess.run(["true"]), args.n)
    wall, failures, wrong = concurrent_episodes(args.episodes)

    ref = (plain + plain_after) / 2
    rows = [
        ("plain subprocess.run(['true'])", f"{ref:.2f} ms", "1.00x", "", ""),
        ("cold sandbox start (uid, tmpfs, cgroup, shell)", f"{start:.2f} ms", f"{start / ref:.2f}x", "<= 3x",
         "yes" if start <= 3 * ref else "no"),
        ("sandbox close", f"{close:.2f} ms", f"{close / ref:.2f}x", "", ""),
        ("warm-pool acquire (reset)", f"{acquire:.2f} ms", f"{acquire / ref:.2f}x", "", ""),
        ("persistent-shell command: true", f"{shell:.2f} ms", f"{shell / ref:.2f}x", "<= 1x",
         "yes" if shell <= ref else "no"),
        ("persistent-shell command: echo; cd; cd", f"{shell_echo:.2f} ms", f"{shell_echo / ref:.2f}x", "", ""),
        ("one-shot exec: true (fresh bwrap)", f"{one_shot:.2f} ms", f"{one_shot / ref:.2f}x", "", ""),
        (f"{args.episodes} concurrent oracle episodes + verifier", f"{wall:.1f} s", "",
         "no failure", f"{failures} failed, {wrong} scored != 1"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    header = ("measurement", "median", "vs plain", "target", "met")
    widths = [max(w, len(h)) for w, h in zip(widths, header)]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(f"limits that held: {limits}")


if __name__ == "__main__":
    main()
