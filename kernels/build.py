"""Building the C++ CPU kernels (``kernels/csrc``) into one shared library per instruction-set variant.

    python -m jointrl.kernels.build                  # this machine's variants (.ci/setup runs it)
    python -m jointrl.kernels.build --variant avx2   # one variant

Every ``csrc/*.cpp`` is compiled (in parallel) and linked against torch into ``libjointrl_cpu.so``, whose
``TORCH_LIBRARY_FRAGMENT(jointrl, ...)`` blocks register the ``torch.ops.jointrl.*`` ops when it is loaded
(``kernels/cpu_extension``). On x86-64 two variants are built, whatever the CPU here (the compiler targets
either): ``avx2`` (AVX2 + FMA) and ``avx512`` (that, plus AVX-512 F / VL / BW / DQ); the ``Vec`` / ``Vec16``
types of ``csrc/prelude.h`` and the compiler's vectorized loops use nothing else. Elsewhere one ``base``
variant, with the compiler's default target (the kernels' plain loops). Never ``-march=native``: a library
depends on its variant, not on the machine that built it. Tuning is the compiler's generic one, which may
order a vectorized sum or contract a multiply-add differently from a ``-march=native`` build of the same
source (the last bits of a few outputs: ``qk_norm_rope_store``'s keys on Zen, where GCC 12's native tuning
is ``znver3``).

Each variant goes to ``<cache>/<variant>-torch<version>-<hash>/``, the hash over the sources, the compiler
command's flags and the variant, so a source edit, another torch or another variant never reuses a stale
library; ``<cache>`` is ``$JOINTRL_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/jointrl/kernels``, else
``~/.cache/jointrl/kernels`` -- outside the repository (an editable install keeps the sources there), and
the same path for every process of a user, Ray workers included. A build happens in a fresh temporary
directory beside its target, renamed into place when complete (atomic: a build killed midway leaves no
half-written library, and two concurrent builders both finish); an ``flock`` (dropped by the kernel when its
holder dies) lets the second wait for the first instead of repeating it. A compiler error raises
``BuildError`` carrying the compiler's message, and the command exits 1 printing it. Only public torch API
(``torch.utils.cpp_extension.include_paths`` / ``library_paths``); no torch build directory or lock.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

__all__ = ["BuildError", "SOURCE_DIR", "VARIANTS", "build", "cache_root", "default_variants", "library_path", "main"]

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
LIBRARY = "libjointrl_cpu.so"
X86 = platform.machine() in ("x86_64", "AMD64")
_LIBMVEC = X86 and platform.libc_ver()[0] == "glibc"

# The instruction sets each variant's code may use (CPU flags as /proc/cpuinfo names them, and the
# compiler flags that enable them).
VARIANTS: dict[str, tuple[frozenset[str], list[str]]] = {
    "avx2": (frozenset({"avx2", "fma"}), ["-mavx2", "-mfma"]),
    "avx512": (frozenset({"avx2", "fma", "avx512f", "avx512vl", "avx512bw", "avx512dq"}),
               ["-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq"]),
    "base": (frozenset(), []),
}
# The compiler may reorder sums (vectorized reductions), never use fast-math's finite-only rules.
CFLAGS = ["-fPIC", "-std=c++20", "-O3", "-fopenmp-simd", "-fno-math-errno", "-fassociative-math",
          "-fno-signed-zeros", "-fno-trapping-math"]


class BuildError(RuntimeError):
    """A variant did not build: no compiler, or the compiler's error (its message is this one's)."""


def default_variants() -> list[str]:
    """The variants ``.ci/setup`` builds here: ``avx2`` and ``avx512`` on x86-64, else ``base``."""
    return ["avx2", "avx512"] if X86 else ["base"]


def cache_root() -> Path:
    """Where built libraries live (module docstring)."""
    if os.environ.get("JOINTRL_KERNEL_CACHE"):
        return Path(os.environ["JOINTRL_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jointrl" / "kernels"


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _flags(variant: str) -> list[str]:
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: expected one of {sorted(VARIANTS)}")
    return CFLAGS + VARIANTS[variant][1]


def _sources(sources: Path) -> list[Path]:
    return sorted(p for p in sources.iterdir() if p.suffix in (".cpp", ".h"))


def library_path(variant: str, sources: Path = SOURCE_DIR, out: Path | None = None) -> Path:
    """The library ``build(variant, sources, out)`` writes (it may not exist yet)."""
    h = hashlib.sha256(" ".join([_compiler(), *_flags(variant), "-lmvec" if _LIBMVEC else ""]).encode())
    for p in _sources(sources):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return (out or cache_root()) / f"{variant}-torch{torch.__version__}-{h.hexdigest()[:16]}" / LIBRARY


def _run(cmd: list[str], what: str) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise BuildError(f"no C++ compiler: {cmd[0]!r} not found (set CXX)") from e
    if done.returncode != 0:
        raise BuildError(f"{what} failed ({cmd[0]} exit {done.returncode}):\n{done.stderr.strip()}")


def build(variant: str, sources: Path = SOURCE_DIR, out: Path | None = None, jobs: int | None = None) -> Path:
    """Compile and link ``variant`` from ``sources`` (every ``*.cpp``; ``*.h`` are their headers) unless its
    library is already there → its path. Raises ``BuildError`` with the compiler's message."""
    from torch.utils.cpp_extension import include_paths, library_paths

    target = library_path(variant, sources, out)
    if target.exists():
        return target
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent.parent / f"{target.parent.name}.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process building it: wait, then find it built
        if target.exists():
            return target
        cxx = _compiler()
        if shutil.which(cxx) is None:
            raise BuildError(f"no C++ compiler: {cxx!r} not found (set CXX)")
        tmp = Path(tempfile.mkdtemp(prefix=target.parent.name + ".tmp-", dir=target.parent.parent))
        try:
            cflags = _flags(variant) + [f"-isystem{p}" for p in include_paths()] + [f"-I{sources}"]
            cpps = [p for p in _sources(sources) if p.suffix == ".cpp"]
            objs = [tmp / f"{p.stem}.o" for p in cpps]
            with concurrent.futures.ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
                for f in [pool.submit(_run, [cxx, *cflags, "-c", str(p), "-o", str(o)],
                                      f"compiling {p.name} ({variant})") for p, o in zip(cpps, objs)]:
                    f.result()
            _run([cxx, "-shared", *map(str, objs), "-o", str(tmp / LIBRARY), *[f"-L{p}" for p in library_paths()],
                  "-lc10", "-ltorch_cpu", "-ltorch", *(["-lmvec"] if _LIBMVEC else [])], f"linking {variant}")
            for o in objs:
                o.unlink()
            os.rename(tmp, target.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jointrl.kernels.build", description=__doc__.split("\n")[0])
    p.add_argument("--variant", action="append", choices=sorted(VARIANTS),
                   help=f"repeatable; default: this platform's ({', '.join(default_variants())})")
    p.add_argument("--sources", type=Path, default=SOURCE_DIR, help="the .cpp / .h directory (default: csrc)")
    p.add_argument("--out", type=Path, default=None, help="the cache directory (default: cache_root())")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiler processes (default: CPU count)")
    args = p.parse_args(argv)
    for variant in args.variant or default_variants():
        t0 = time.monotonic()
        with contextlib.suppress(FileNotFoundError):
            if library_path(variant, args.sources, args.out).exists():
                print(f"jointrl C++ CPU kernels, {variant}: up to date")
                continue
        try:
            path = build(variant, args.sources, args.out, args.jobs)
        except BuildError as e:
            print(f"jointrl C++ CPU kernels, {variant}: {e}", file=sys.stderr)
            return 1
        print(f"jointrl C++ CPU kernels, {variant}: built {path} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
