"""Office benchmark: an episode's reset and steps and its reward (``office_checks``), with the
warm LibreOffice of ``envs/office/recalc.py`` against a LibreOffice start per recalculation.

Not collected by pytest; run as ``python tests/bench/bench_office.py`` (root, bubblewrap, LibreOffice,
``python3-uno``, the office tool venv). Each round plays one workbook task's oracle both ways,
cold then warm, in this process, so a loaded host moves both alike; wall and CPU seconds (this
process and every descendant: sandboxes, LibreOffice, the warm server) are medians over the
rounds. The warm server is started once before the rounds (a worker's first episode pays it). CPU
seconds come from a cgroup v1 ``cpuacct`` group of this process (``rl/cpu_clock.py``), which counts
the sandboxes' processes too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from jointrl.envs.office import OfficeEnv, load_tasks
from jointrl.envs.office.recalc import shared_server
from jointrl.envs.office.tasks import load_policy
from jointrl.rewards import Episode, combine
from jointrl.rl.cpu_clock import CpuClock

cpu_s = CpuClock("jointrl-bench")


def play(task, warm: bool) -> dict[str, float]:
    """Wall / CPU seconds of the episode's steps (reset included) and of its reward."""
    os.environ["JOINTRL_OFFICE_RECALC"] = "warm" if warm else "cold"

    async def go():
        env = OfficeEnv(recalc=True if warm else None)
        w0, c0 = time.perf_counter(), cpu_s()
        try:
            await env.reset(task)
            answer = None
            for turn in load_policy(task, "oracle"):
                for call in turn:
                    obs = await env.step(call)
                    assert not obs.is_error, obs.text
                    answer = obs.text if call.name == "answer" else answer
            w1, c1 = time.perf_counter(), cpu_s()
            result = await asyncio.to_thread(combine, task.reward, task,
                                             Episode(messages=[], final_answer=answer, verify_sandbox=env.verify_sandbox))
            w2, c2 = time.perf_counter(), cpu_s()
        finally:
            await env.close()
        assert result.score == 1.0, result.info
        return {"steps_wall": w1 - w0, "steps_cpu": c1 - c0, "reward_wall": w2 - w1, "reward_cpu": c2 - c1}

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--task", default="add-cost-line-0", help="a shipped task whose checks read workbook cells")
    args = ap.parse_args()
    task = next(t for t in load_tasks() if t.id == args.task)
    server = shared_server()
    assert server is not None, "the warm server needs python3-uno (.ci/setup.d/office.sh)"
    t0, c0 = time.perf_counter(), cpu_s()
    server.recalc((task.root / "files" / next(p.name for p in (task.root / "files").iterdir()
                                              if p.suffix == ".xlsx")).read_bytes())
    start = (time.perf_counter() - t0, cpu_s() - c0)
    rows: dict[str, dict[str, list[float]]] = {"cold": {}, "warm": {}}
    for _ in range(args.rounds):
        for mode in ("cold", "warm"):
            for k, v in play(task, mode == "warm").items():
                rows[mode].setdefault(k, []).append(v)
    print(f"task {task.id} (oracle: {sum(len(t) for t in load_policy(task, 'oracle'))} tool calls), "
          f"median of {args.rounds} alternated rounds; warm server start {start[0]:.2f} s wall / {start[1]:.2f} CPU-s "
          f"(once per env worker), {server.starts} start(s) in all")
    print("| measurement | cold: wall s | cold: CPU s | warm: wall s | warm: CPU s | warm / cold CPU |\n|---|---|---|---|---|---|")
    for what, label in (("steps", "reset + the oracle's steps"), ("reward", "reward (office_checks)")):
        cw, cc = (statistics.median(rows["cold"][f"{what}_{x}"]) for x in ("wall", "cpu"))
        ww, wc = (statistics.median(rows["warm"][f"{what}_{x}"]) for x in ("wall", "cpu"))
        print(f"| {label} | {cw:.2f} | {cc:.2f} | {ww:.2f} | {wc:.2f} | {wc / cc:.2f} |")
    server.close()
    cpu_s.close()


if __name__ == "__main__":
    main()
