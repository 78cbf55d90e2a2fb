"""``kernels/build`` and ``cpu_extension``: a planted compile error fails the build command with the
compiler's message and leaves no library; what a killed build leaves behind does not block the next; a
library's directory follows its sources; the variant follows the CPU's flags, and a forced ``avx2`` loads on
an AVX-512 machine and equals the torch references (and the ``avx512`` library where the CPU has it);
without a compiler the torch references run, and the logs say why.
``zeros_huge_pages``: a zeroed, contiguous tensor of the asked shape and dtype, 2 MiB-aligned when it spans a
huge page and the OS takes the advice (Linux); a plain ``torch.zeros`` otherwise."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from jointrl.kernels import build, cpu_extension
from jointrl.kernels.cpu_extension import pick_variant, zeros_huge_pages

needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler here")
VARIANT = build.default_variants()[0]  # avx2 on x86-64


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


@needs_cxx
def test_a_planted_compile_error_fails_the_build_with_the_compilers_message(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.cpp").write_text("int jointrl_ok() { return 1; }\n")
    (src / "planted.cpp").write_text("int jointrl_planted() { return planted_undeclared_name; }\n")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "jointrl.kernels.build", "--sources", str(src), "--out", str(out),
                           "--variant", VARIANT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "planted.cpp" in done.stderr and "error" in done.stderr and "planted_undeclared_name" in done.stderr
    assert not build.library_path(VARIANT, src, out).exists()
    assert [p.name for p in out.iterdir()] == [f"{build.library_path(VARIANT, src, out).parent.name}.lock"]


@needs_cxx
def test_what_a_killed_build_leaves_does_not_block_the_next_and_edits_rebuild(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "probe.cpp").write_text("int jointrl_probe() { return 1; }\n")
    lib = build.library_path(VARIANT, src, out)
    out.mkdir()
    (out / f"{lib.parent.name}.lock").touch()  # a killed builder leaves its lock file and its temporary directory
    (out / f"{lib.parent.name}.tmp-killed").mkdir()
    assert build.build(VARIANT, src, out) == lib and lib.exists()
    (src / "probe.cpp").write_text("int jointrl_probe() { return 2; }\n")
    assert build.library_path(VARIANT, src, out) != lib  # an edited source is another library
    assert build.library_path("avx512", src, out).parent != build.library_path("avx2", src, out).parent


AVX2 = frozenset({"avx2", "fma", "sse4_2"})
AVX512 = AVX2 | {"avx512f", "avx512vl", "avx512bw", "avx512dq", "avx512cd"}


@pytest.mark.skipif(not build.X86, reason="the avx2 / avx512 variants are x86-64's")
def test_the_variant_follows_the_cpu_flags_and_the_forced_one_must_run():
    assert pick_variant(AVX512, None) == "avx512"
    assert pick_variant(AVX2, None) == "avx2"
    assert pick_variant(AVX2 | {"avx512f"}, None) == "avx2"  # AVX-512 F alone is not the avx512 build's set
    assert pick_variant(frozenset({"sse4_2"}), None) == "base"
    assert pick_variant(AVX512, "avx2") == "avx2"
    with pytest.raises(ValueError, match="cannot run"):
        pick_variant(AVX2, "avx512")
    with pytest.raises(ValueError, match="JOINTRL_CPU_ISA='sse9'"):
        pick_variant(AVX512, "sse9")


_RUN_KERNELS = """
import json, sys, torch
from jointrl.kernels import cpu_extension, linear_cpu, paged_attention_cpu as pa
variant = cpu_extension.loaded_variant()
g = torch.Generator().manual_seed(0)
w, x = torch.randn(264, 256, generator=g), torch.randn(13, 256, generator=g)
y = linear_cpu.linear(x, linear_cpu.pack(w), 264)
kv, q = torch.randn(200, 2, 2, 64, generator=g), torch.randn(3, 4, 64, generator=g)
slots, ctx = torch.randperm(200, generator=g)[:180].view(3, 60), torch.tensor([60, 17, 33])
o = pa.paged_decode(q, kv, slots, ctx, 0.125)
err = [(y - torch.nn.functional.linear(x, w)).abs().max().item(),
       (o - pa.paged_decode_torch(q, kv, slots, ctx, 0.125)).abs().max().item()]
torch.save((y, o), sys.argv[1])
print(json.dumps({"variant": variant, "err": err}))
"""


def _run_forced(isa: str, out) -> dict:
    done = subprocess.run([sys.executable, "-c", _RUN_KERNELS, str(out)], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "JOINTRL_CPU_ISA": isa})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_cxx
@pytest.mark.skipif(not build.X86, reason="the avx2 / avx512 variants are x86-64's")
def test_forced_avx2_loads_and_equals_the_references_and_the_avx512_build(tmp_path):
    """In subprocesses (a process loads one variant). Built here first if ``.ci/setup`` did not."""
    got = _run_forced("avx2", tmp_path / "avx2.pt")
    assert got["variant"] == "avx2" and got["err"][0] < 1e-4 and got["err"][1] < 1e-5, got
    if pick_variant(cpu_extension.cpu_flags(), None) != "avx512":
        return
    got512 = _run_forced("avx512", tmp_path / "avx512.pt")
    assert got512["variant"] == "avx512" and got512["err"][0] < 1e-4 and got512["err"][1] < 1e-5, got512
    (y2, o2), (y5, o5) = torch.load(tmp_path / "avx2.pt"), torch.load(tmp_path / "avx512.pt")
    assert torch.equal(y2, y5)  # the panel loop is 8-float vectors in both builds: the same bits
    torch.testing.assert_close(o2, o5, rtol=1e-6, atol=1e-6)  # Vec16's sums: another order, the last bits


def test_without_a_compiler_the_references_run_and_the_logs_say_why(tmp_path):
    """No library in the cache and no compiler: one line says the build starts, a warning says why it failed,
    ``load_kernel()`` is None and the public functions run their torch references (in a subprocess: a
    process loads its library once)."""
    code = ("import torch\n"
            "from jointrl.kernels import decode_cpu, linear_cpu\n"
            "assert linear_cpu.load_kernel() is None and decode_cpu.load_kernel() is None\n"
            "x, w = torch.randn(3, 8), torch.randn(8)\n"
            "assert torch.equal(decode_cpu.rms_norm(x, w, 1e-6), decode_cpu.rms_norm_torch(x, w, 1e-6))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JOINTRL_KERNEL_CACHE": str(tmp_path), "CXX": str(tmp_path / "no-cxx")})
    assert done.returncode == 0, done.stderr
    assert "are not built" in done.stderr and "building them now" in done.stderr
    assert "using the torch references: no C++ compiler" in done.stderr
