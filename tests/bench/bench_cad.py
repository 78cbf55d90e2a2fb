"""CAD benchmark: a ``run_cadquery`` call in the episode's warm interpreter against a cold one
(a fresh process importing CadQuery, as the reward's one-shot build does), and the reward's
host-side geometry. Not collected by pytest; run as ``python tests/bench/bench_cad.py`` (root,
bubblewrap, the CAD tool venv). Prints one table; the warm/cold rows alternate round by round in
the same sandbox, so a loaded host moves both alike. The ratio is warm / cold. The reference-part
rows alternate a build (cache file removed) with a read of the cached STL, in-memory cache cleared.
"""

from __future__ import annotations

import argparse
import statistics
import time

from jointrl.envs.cad import CadConfig, CadSandbox, load_tasks
from jointrl.envs.cad.interpreter import build_stl
from jointrl.rewards import cad_geometry
from jointrl.rewards.cad_geometry import chamfer, iou, mesh_from_stl, normalized


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
    b, r = statistics.median(built), statistics.median(read)
    print(f"| reward's reference part, first use in a process: built (fresh sandbox) | {b:.3f} | 1.00 |")
    print(f"| the same, read from the disk cache (cad_geometry.target_cache_dir) | {r:.3f} | {r / b:.3f} |")
    for name, seconds in geometry.items():
        print(f"| reward geometry: {name}, {len(mesh.faces)} triangles | {seconds:.3f} | |")


if __name__ == "__main__":
    main()
