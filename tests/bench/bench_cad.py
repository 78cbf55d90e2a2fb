"""CAD benchmark: a ``run_cadquery`` call in the episode's warm interpreter against a cold one
(a fresh process importing CadQuery), the reward's rebuild of a submission by the warm builder
(``envs/cad/builder.py``, a fork) against the one-shot build in a fresh verification sandbox, and
the reward's host-side geometry. Not collected by pytest; run as ``python tests/bench/bench_cad.py``
(root, bubblewrap, the CAD tool venv). Prints one table; each warm/cold pair alternates round by
round, so a loaded host moves both alike. The ratio is warm / cold; CPU seconds count the sandboxes'
processes too (a cgroup v1 ``cpuacct`` group of this process, ``rl/cpu_clock.py``). The reference-part
rows alternate a build (cache file removed) with a read of the cached STL, in-memory cache cleared.
"""

from __future__ import annotations

import argparse
import statistics
import time

from jointrl.envs.cad import CadConfig, CadSandbox, load_tasks
from jointrl.envs.cad.builder import CadBuilder
from jointrl.envs.cad.interpreter import build_stl
from jointrl.envs.sandbox.bwrap import BwrapSandbox
from jointrl.rewards import cad_geometry
from jointrl.rewards.cad_geometry import chamfer, iou, mesh_from_stl, normalized
from jointrl.rl.cpu_clock import CpuClock

cpu_s = CpuClock("jointrl-bench")


def rebuilds(code: str, cad: CadConfig, rounds: int) -> tuple[dict[str, list[float]], tuple[float, float]]:
    """Wall and CPU seconds of the reward's rebuild of ``code``: one-shot in a fresh verification
    sandbox (opened, built in, closed) and by the warm builder, alternated; and the builder's start."""
    builder = CadBuilder(cad)
    t, c = time.perf_counter(), cpu_s()
    assert builder.build("result = cq.Workplane().box(1, 1, 1)")[0] is not None  # the start: once per env worker
    start = (time.perf_counter() - t, cpu_s() - c)
    rows: dict[str, list[float]] = {}
    for _ in range(rounds):
        t, c = time.perf_counter(), cpu_s()
        with BwrapSandbox(cad.sandbox_config(), env=cad.env, shell=False) as sandbox:
            cold = build_stl(sandbox, code, cad)
        t1, c1 = time.perf_counter(), cpu_s()
        warm = builder.build(code)
        t2, c2 = time.perf_counter(), cpu_s()
        assert warm == cold and warm[0] is not None
        for key, value in (("cold_wall", t1 - t), ("cold_cpu", c1 - c), ("warm_wall", t2 - t1), ("warm_cpu", c2 - c1)):
            rows.setdefault(key, []).append(value)
    builder.close()
    return rows, start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cad = CadConfig()
    code = load_tasks()[2].metadata["reference"]  # a flange: bolt-circle holes, a hub, a bore
    warm, cold, stl = [], [], b""
    with CadSandbox(cad) as sandbox:
        sandbox.call("result = cq.Workplane().box(1, 1, 1)")  # the import, once
        for _ in range(args.rounds):
            t = time.perf_counter()
            assert sandbox.call(code, stl="warm.stl").summary["ok"]
            warm.append(time.perf_counter() - t)
            t = time.perf_counter()
            stl, summary = build_stl(sandbox, code, cad)  # a fresh process (and it ends the warm one)
            assert stl is not None, summary
            cold.append(time.perf_counter() - t)
            sandbox.call("result = cq.Workplane().box(1, 1, 1)")  # warm again, outside the timing
    rebuilt, start = rebuilds(code, cad, args.rounds)
    # The reward's reference part in a new process: built (a fresh sandbox) or read from the disk cache.
    cache = cad_geometry.target_cache_dir() / f"{cad_geometry.target_key(code)}.stl"
    built, read = [], []
    for _ in range(args.rounds):
        cache.unlink(missing_ok=True)
        cad_geometry._target.cache_clear()
        t = time.perf_counter()
        cad_geometry._target(code)
        built.append(time.perf_counter() - t)
        cad_geometry._target.cache_clear()
        t = time.perf_counter()
        cad_geometry._target(code)
        read.append(time.perf_counter() - t)
    mesh = normalized(mesh_from_stl(stl), mesh_from_stl(stl), "target")
    geometry = {}
    for name, fn in (("IoU (manifold3d)", iou), ("Chamfer, 2 x 4096 samples (libigl)", chamfer)):
        t = time.perf_counter()
        fn(mesh, mesh)
        geometry[name] = time.perf_counter() - t
    w, c = statistics.median(warm), statistics.median(cold)
    print(f"| measurement (median of {args.rounds}) | seconds | ratio |\n|---|---|---|")
    print(f"| run_cadquery (with the STL), warm interpreter | {w:.3f} | {w / c:.2f} |")
    print(f"| the same code, cold process (import + build + STL) | {c:.3f} | 1.00 |")
    cw, cc, ww, wc = (statistics.median(rebuilt[f"{m}_{x}"]) for m in ("cold", "warm") for x in ("wall", "cpu"))
    print(f"| reward's rebuild of the submission: one-shot, fresh verification sandbox | {cw:.3f} ({cc:.3f} CPU-s) | 1.00 |")
    print(f"| the same, warm builder (a fork; its start: {start[0]:.2f} s, {start[1]:.2f} CPU-s, once per worker) "
          f"| {ww:.3f} ({wc:.3f} CPU-s) | {wc / cc:.2f} (CPU) |")
    b, r = statistics.median(built), statistics.median(read)
    print(f"| reward's reference part, first use in a process: built (fresh sandbox) | {b:.3f} | 1.00 |")
    print(f"| the same, read from the disk cache (cad_geometry.target_cache_dir) | {r:.3f} | {r / b:.3f} |")
    for name, seconds in geometry.items():
        print(f"| reward geometry: {name}, {len(mesh.faces)} triangles | {seconds:.3f} | |")
    cpu_s.close()


if __name__ == "__main__":
    main()
