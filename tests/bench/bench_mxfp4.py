"""MXFP4 on CPU (what ``quantize_mxfp4`` dispatches to: the C++ kernels where a toolchain exists,
else the torch paths; ``kernels/mxfp4.py``) vs a plain memcpy. Run: ``python tests/bench/bench_mxfp4.py``.

Reports (never asserts) the median wall time of quantize, dequantize and quantize +
dequantize of a [4096, 4096] fp32 tensor, next to ``Tensor.clone()`` of the same tensor;
GB/s counts the fp32 tensor's bytes (64 MiB) once per operation.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from jointrl.kernels.mxfp4 import dequantize_mxfp4, load_cpu_kernel, quantize_mxfp4


def _median_seconds(cases: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time per case; rounds interleave the cases so load drift hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()  # warm-up: allocator, lazy init
    for _ in range(repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rule", default="floor", choices=["floor", "ceil"])
    args = parser.parse_args()

    x = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0))
    blocks, scales = quantize_mxfp4(x, args.rule)
    cases: dict[str, Callable[[], object]] = {
        "clone (memcpy)": x.clone,
        "quantize": lambda: quantize_mxfp4(x, args.rule),
        "dequantize -> fp32": lambda: dequantize_mxfp4(blocks, scales, torch.float32),
        "quantize + dequantize": lambda: dequantize_mxfp4(*quantize_mxfp4(x, args.rule), torch.float32),
    }
    nbytes = x.numel() * x.element_size()
    results = _median_seconds(cases, args.repeats)
    base = results["clone (memcpy)"]

    print(
        f"MXFP4 ({'C++ kernels' if load_cpu_kernel() is not None else 'torch paths'}), CPU, {torch.get_num_threads()} threads, x = [{args.rows}, {args.cols}] fp32 "
        f"({nbytes / 2**20:.0f} MiB), rule={args.rule}, median of {args.repeats}"
    )
    print(f"{'op':<24}{'ms':>10}{'GB/s':>10}{'x clone':>10}")
    for name, sec in results.items():
        print(f"{name:<24}{sec * 1e3:>10.1f}{nbytes / sec / 1e9:>10.2f}{sec / base:>10.1f}")


if __name__ == "__main__":
    main()
