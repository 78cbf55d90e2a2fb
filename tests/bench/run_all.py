"""Every benchmark in one command: ``python tests/bench/run_all.py [--full] [--only a,b] [--out PATH]``.

Runs each ``tests/bench/bench_*.py`` as its own subprocess (with its quick flags unless
``--full``), one after the other, and writes ``tests/bench/results.md``: the machine (CPU
model, cores, RAM, torch and peer versions, date, git commit, load average) and, per
benchmark, the exact command, its wall time, the load average when it started, and the
table it printed. A benchmark that fails (a missing tool, a timeout) is recorded with its
exit status and the tail of its output; the others still run. Reports; never asserts.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# bench name -> (quick arguments, full arguments); a bench missing here runs with no arguments
ARGS: dict[str, tuple[list[str], list[str]]] = {
    "bench_engine": (["--quick"], []),
    "bench_grpo_step": (["--variants"], ["--variants"]),  # >= 10 steady steps even here
    "bench_kernels": (["--quick"], []),
    "bench_learner": (["--steps", "2"], []),
    "bench_mxfp4": (["--rows", "1024", "--repeats", "3"], []),
    "bench_sandbox": (["--n", "50", "--starts", "10"], []),
    "bench_weight_sync": (["--repeats", "3"], []),
    "bench_browser": (["--rounds", "1"], []),
    "bench_cad": (["--rounds", "2"], []),
}
# log lines that libraries print to stdout (not part of any table): dropped where a line contains one
NOISE = ("Warning", "WARNING", "warnings.warn", "[transformers]", "{'train_runtime'", "Loading weights",
         "built successfully", "[rank0]")


def machine() -> list[str]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
    versions = []
    for pkg in ("torch", "transformers", "deepspeed", "ray", "trl", "triton"):
        try:
            versions.append(f"{pkg} {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{pkg} (not installed)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return [
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}",
        f"- CPU: {cpu}, {os.cpu_count()} cores visible; RAM {mem_kb / 2**20:.1f} GiB; "
        f"{'a CUDA GPU' if _has_gpu() else 'no GPU'}",
        f"- Python {platform.python_version()}, " + ", ".join(versions),
        f"- git {commit}{' (with uncommitted changes in tracked files)' if dirty else ''}",
        f"- load average at start (1 / 5 / 15 min): {_load()}",
    ]


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def run_one(name: str, args: list[str], timeout_s: int) -> list[str]:
    cmd = [sys.executable, f"tests/bench/{name}.py", *args]
    shown = " ".join(["python", *cmd[1:]])
    load = _load()
    print(f"$ {shown}  (load {load})", flush=True)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                           env={**os.environ, "PYTHONWARNINGS": "ignore"})
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", _text(e.stdout), _text(e.stderr) + f"\n(killed after {timeout_s} s)"
    took = time.perf_counter() - t0
    table = [line for line in out.splitlines() if line.strip() and not any(n in line for n in NOISE)]
    print("\n".join(table) if rc == 0 else f"failed ({rc}):\n" + "\n".join((out + err).splitlines()[-15:]), flush=True)
    lines = [f"### {name}", "", f"`{shown}` -- {took:.0f} s, load average at start {load}", ""]
    if rc != 0:
        lines += [f"**failed** (exit {rc}); last lines of its output:", ""]
        table = (out + err).splitlines()[-15:]
    return lines + ["```", *table, "```", ""]


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="each bench's default (longer) settings, not its quick ones")
    ap.add_argument("--only", default="", help="comma list of bench names (bench_engine,...); default: all")
    ap.add_argument("--out", default=str(HERE / "results.md"))
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per bench")
    args = ap.parse_args()
    names = sorted(p.stem for p in HERE.glob("bench_*.py"))
    if args.only:
        wanted = [n.strip().removesuffix(".py") for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise ValueError(f"--only names unknown benchmarks {unknown}; there are {names}")
        names = wanted
    doc = ["# Benchmark results", "",
           f"Written by `python tests/bench/run_all.py{' --full' if args.full else ''}` "
           f"({'default' if args.full else 'quick'} settings of each bench). Each table compares against a peer "
           "measured in the same process run; ratios are what to read, absolute times move with the load "
           "of this shared machine.", "", "## Machine", "", *machine(), "", "## Benchmarks", ""]
    for name in names:
        quick, full = ARGS.get(name, ([], []))
        doc += run_one(name, full if args.full else quick, args.timeout)
    doc += [f"Load average at the end: {_load()}", ""]
    Path(args.out).write_text("\n".join(doc))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
