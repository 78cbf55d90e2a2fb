"""``cpu_extension``: a load survives a killed loader's lock; ``zeros_huge_pages``: a zeroed, contiguous
tensor of the asked shape and dtype, 2 MiB-aligned when it spans a huge page and the OS takes the advice
(Linux); a plain ``torch.zeros`` otherwise."""

import pytest
import torch

from jointrl.kernels import cpu_extension
from jointrl.kernels.cpu_extension import zeros_huge_pages


@pytest.mark.parametrize("shape,dtype", [((3, 5), torch.bfloat16), ((2, 700, 2, 2, 64), torch.float32),
                                         ((1, 300, 2, 2, 64), torch.float64),
                                         # past 2 MiB (the aligned view into a larger buffer), odd sizes
                                         ((3, 1000, 2, 4, 64), torch.float32), ((1, 2049, 1023), torch.bfloat16),
                                         ((5, 3, 69911), torch.float64)])
def test_zeros_of_the_shape_and_dtype(shape, dtype):
    a, b = zeros_huge_pages(shape, dtype), zeros_huge_pages(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.is_contiguous() and not a.any()
    a.fill_(1)  # two buffers never share memory
    assert not b.any()
    if a.numel() * a.element_size() >= 2 << 20 and cpu_extension._libc() is not None:
        assert a.data_ptr() % (2 << 20) == 0


def test_without_libc_a_plain_tensor(monkeypatch):
    monkeypatch.setattr(cpu_extension, "_libc", lambda: None)
    t = zeros_huge_pages((2, 700, 2, 2, 64), torch.float32)
    assert t.shape == (2, 700, 2, 2, 64) and not t.any() and t.untyped_storage().nbytes() == t.numel() * 4


def test_a_load_killed_mid_way_does_not_block_the_next_one():
    """A process SIGKILLed while loading an extension leaves torch's ``lock`` file behind; the next
    load must remove it and finish, not wait forever (in a subprocess: the old behaviour hangs)."""
    import os
    import subprocess
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    from jointrl.kernels.mxfp4 import load_cpu_kernel

    if load_cpu_kernel() is None:
        pytest.skip("no C++ toolchain here")
    stale = os.path.join(_get_build_directory("jointrl_mxfp4_cpu", verbose=False), "lock")
    open(stale, "w").close()  # what a killed loader leaves
    code = ("from jointrl.kernels.cpu_extension import load_cpu_extension\n"
            "from jointrl.kernels.mxfp4 import _CPU_SOURCE\n"
            "assert load_cpu_extension('jointrl_mxfp4_cpu', _CPU_SOURCE, ['quantize', 'dequantize']) is not None\n")
    try:
        subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    finally:
        if os.path.exists(stale):
            os.remove(stale)
            pytest.fail("the stale lock was left in place")
