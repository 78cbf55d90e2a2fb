"""Building the small C++ CPU kernels (``paged_attention_cpu``, ``moe_cpu``) at first use.

``load_cpu_extension`` compiles a source with ``torch.utils.cpp_extension.load_inline`` (about
a minute the first time, cached in ``~/.cache/torch_extensions``) and returns the module, or
None without a toolchain -- callers then fall back to their torch reference. ``PRELUDE`` is the
common head of every source: headers and, on x86-64 glibc, the declarations of libmvec's
vector ``exp`` variants (<= 4 ulp), so that ``omp simd`` loops calling ``exp_`` run 8 (float) /
4 (double) lanes at a time instead of one libm call per element. The flags let the compiler
reorder sums (vectorized reductions), never fast-math's finite-only rules.
"""

from __future__ import annotations

import platform
import warnings

PRELUDE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GLIBC__)
extern "C" {
#pragma omp declare simd notinbranch
float expf(float) noexcept;
#pragma omp declare simd notinbranch
double exp(double) noexcept;
}
#endif

template <typename T>
static inline T exp_(T x) {
  if constexpr (std::is_same_v<T, float>) return expf(x);
  else return exp(x);
}
"""

_LIBMVEC = platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc"
_CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
           "-fno-trapping-math"]


def load_cpu_extension(name: str, source: str, functions: list[str]):
    """The compiled module of ``PRELUDE + source``, or None when it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(name=name, cpp_sources=PRELUDE + source, functions=functions, extra_cflags=_CFLAGS,
                           extra_ldflags=["-lmvec"] if _LIBMVEC else [], verbose=False)
    except Exception as e:  # no toolchain: the torch reference still works
        warnings.warn(f"{name}: C++ kernel unavailable, using the torch reference ({e})")
        return None
