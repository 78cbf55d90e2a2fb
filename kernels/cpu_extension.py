"""Loading the C++ CPU kernels (``kernels/csrc``, built by ``kernels/build``) as ``torch.ops.jointrl`` ops.

``load_ops(names)`` → a namespace of the named ops (``torch.ops.jointrl.<name>.default``, attributes of the
same names), or None where the library cannot be had -- callers then run their torch reference. The first
call in a process loads one shared library, the variant for this CPU: ``avx512`` where ``/proc/cpuinfo``
lists AVX-512 F / VL / BW / DQ (and AVX2 + FMA), else ``avx2`` where it lists AVX2 + FMA, else ``base``
(without ``/proc/cpuinfo``: ``torch.backends.cpu.get_cpu_capability()``). ``JOINTRL_CPU_ISA=avx2`` (or
``avx512`` / ``base``) forces one; forcing a variant the CPU cannot run raises ``ValueError`` rather than
dying on an illegal instruction. The two variants' results may differ in the last bits where a sum's order
follows the vector width (``paged_decode``'s 16-float path, the compiler's vectorized reductions); each
equals the torch references within the kernels' tested tolerances.

A call through the op registry costs ~1-2.5 µs more than the former pybind functions did (more with more
arguments; tests/bench/results.md): ~0.2 ms on a decode step's 56 calls, which batch-1 steps felt most,
until a plain layer's nine calls became one (``decode_cpu``'s ``decode_layer``): 8 per step now.

``.ci/setup`` builds the libraries (``python -m jointrl.kernels.build``). Where the variant is not built (a
machine set up without it, or sources edited since) it is built here, once, with a one-line log saying so
(a few minutes); where it cannot be built (no compiler, or a compiler error) a warning carries the reason
and every ``load_ops`` is None, so the torch references run -- the fallback the kernels always had.

The kernels' common head (vector types ``Vec<T>`` / ``Vec16``, libmvec's vector ``exp``, ``inv_rms``) is
``csrc/prelude.h``: libmvec's ``exp`` variants (<= 4 ulp) let ``omp simd`` loops calling ``exp_`` run a
vector of lanes at a time instead of one libm call per element; with AVX2 + FMA
(``JOINTRL_SIMD``), ``Vec<T>``: load / fma / store of 8 floats or 4 doubles, and ``sums``, the lane sums of a
full vector's count of accumulators as one vector -- so a kernel can keep one accumulator per dot product
and reduce them together (each sum in the same order whatever its slot); with AVX-512, ``Vec16``, the same
for 16 floats (half the instructions for the same FMAs); and ``inv_rms``, RMSNorm's scale.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import platform
import types
import warnings

import torch

from jointrl.kernels import build

log = logging.getLogger(__name__)

ISA_ENV = "JOINTRL_CPU_ISA"


def cpu_flags() -> frozenset[str] | None:
    """The CPU's flags from ``/proc/cpuinfo`` (Linux), or None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def pick_variant(flags: frozenset[str] | None, forced: str | None) -> str:
    """The library variant to load on a CPU with ``flags`` (None: ask torch), or ``forced`` (``JOINTRL_CPU_ISA``)
    when the CPU runs it. Raises ``ValueError`` for an unknown or unrunnable forced variant."""
    if not build.X86:
        runnable = ["base"]
    else:
        if flags is None:
            cap = torch.backends.cpu.get_cpu_capability()
            flags = build.VARIANTS["avx512"][0] if cap.startswith("AVX512") else (
                build.VARIANTS["avx2"][0] if cap == "AVX2" else frozenset())
        runnable = [v for v in ("avx512", "avx2") if build.VARIANTS[v][0] <= flags] + ["base"]
    if forced:
        if forced not in build.VARIANTS:
            raise ValueError(f"{ISA_ENV}={forced!r}: expected one of {sorted(build.VARIANTS)}")
        if forced not in runnable:
            raise ValueError(f"{ISA_ENV}={forced!r}: this CPU cannot run it (it runs {runnable})")
        return forced
    return runnable[0]


@functools.cache
def loaded_variant() -> str | None:
    """Load this process's library (module docstring) → its variant, or None where it cannot be built."""
    variant = pick_variant(cpu_flags(), os.environ.get(ISA_ENV) or None)
    path = build.library_path(variant)
    if not path.exists():
        log.warning("jointrl: the C++ CPU kernels (%s) are not built (.ci/setup runs `python -m "
                    "jointrl.kernels.build`); building them now, once (a few minutes)", variant)
        try:
            path = build.build(variant)
        except build.BuildError as e:
            warnings.warn(f"C++ CPU kernels unavailable, using the torch references: {e}")
            return None
    try:
        torch.ops.load_library(str(path))
    except OSError as e:  # a library built against another libtorch's symbols, say
        warnings.warn(f"C++ CPU kernels unavailable, using the torch references: {path} does not load ({e})")
        return None
    return variant


def load_ops(names: list[str], prefix: str = "") -> types.SimpleNamespace | None:
    """The ops ``torch.ops.jointrl.<prefix><name>`` as attributes ``<name>`` (each its default overload: one
    dispatch, no overload resolution), or None where the library cannot be built here."""
    if loaded_variant() is None:
        return None
    return types.SimpleNamespace(**{n: getattr(torch.ops.jointrl, prefix + n).default for n in names})


_HUGE = 2 << 20  # bytes of a transparent huge page (x86-64)
_MADV_HUGEPAGE = 14


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True) if platform.system() == "Linux" else None
    except OSError:
        return None


def zeros_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)``, its memory 2 MiB-aligned and advised for transparent huge pages
    (Linux ``madvise(MADV_HUGEPAGE)``, before the first touch) where it spans at least one: for a buffer a
    decode step streams through in scattered 16 KB pieces (the paged KV cache), 4 KB pages cost a TLB miss
    and page walk every 4 KB (measured: tests/bench/results.md, "C++ CPU kernels"). A plain ``torch.zeros``
    where the advice is refused or unavailable; a view into a slightly larger buffer otherwise (contiguous;
    its storage is the larger buffer)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    libc = _libc()
    if libc is None or nbytes < _HUGE:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(nbytes + _HUGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE
    span = (nbytes + _HUGE - 1) // _HUGE * _HUGE
    if libc.madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(min(span, raw.numel() - start)),
                    _MADV_HUGEPAGE) != 0:
        return torch.zeros(shape, dtype=dtype)
    return raw[start:start + nbytes].zero_().view(dtype).view(shape)
