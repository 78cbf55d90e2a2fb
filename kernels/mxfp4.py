"""MXFP4 quantize / dequantize (OCP Microscaling Formats (MX) v1.0, MXFP4).

Format. A tensor ``x[..., K]`` is cut into blocks of 32 consecutive elements along its LAST
dim. Each block stores one shared E8M0 scale byte ``b`` (scale ``2^(b - 127)``, ``b = 0xFF``
is NaN) and 32 E2M1 elements: a sign bit (bit 3) and a magnitude code 0..7 standing for
``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``. Two elements share a byte: element ``2j`` in the low nibble,
``2j + 1`` in the high nibble. A block decodes to ``E2M1(code) * 2^(b - 127)``.

Scale rules (which one produced a tensor travels with it; see ``rl/weight_sync.py``):

* ``floor`` (OCP default): shared exponent ``e = floor(log2(amax)) - 2`` (2 = emax of E2M1),
  so ``amax / 2^e`` lies in ``[4, 8)`` and the top of the block may saturate to 6 (clip).
* ``ceil`` (``triton_kernels``' default): ``e`` is the smallest integer with
  ``amax <= 6 * 2^e``, i.e. ``2^ceil(log2(amax / 6))`` computed exactly rather than through
  the rounded float ``amax / 6``: with ``amax = m * 2^E``, ``m in [1, 2)``,
  ``e = E - 2`` if ``m <= 1.5`` else ``E - 1``. Never clips. (For normal fp32 ``amax`` this
  equals ``triton_kernels``' round-up of the fp32 quotient ``amax / 6``: that quotient is
  never rounded across a power of two.)

Both rules take exponents from the bits of the float representation (never through
``float8_e8m0fnu`` casts, which round), then clamp ``e`` to the E8M0 range ``[-127, 127]``.
Consequences of the clamp, by design of the format:

* a block whose ``amax`` is 0 (or below ``2^-124``, e.g. fp32 subnormals) gets ``e = -127``
  (scale byte 0); an all-zero block decodes to zeros;
* only float64 inputs can exceed ``6 * 2^127``: they saturate to ``±6 * 2^127``.

Elements: ``x / 2^e`` (exact: multiplying by a power of two) is rounded to the nearest E2M1
value, ties to even (even = mantissa bit 0: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
2.5 -> 2, 3.5 -> 4, 5 -> 4), saturating at ±6. The sign is kept, so ``-0.0`` and negative
values that round to zero encode as ``0x8`` (E2M1 negative zero), which decodes to ``-0.0``.

Non-finite inputs: a block containing NaN or ±inf gets scale byte ``0xFF`` and all its
element nibbles 0; it decodes to 32 NaNs. MX has no infinity, and saturating an inf to
``±6 * scale`` would hide a diverged weight behind a plausible number.

Precision: float64 inputs are processed in float64; every other float dtype (bf16, fp16,
fp32, fp8) is converted to float32 first, which is exact. Dequantizing to float32 or bf16
is exact except that ``6 * 2^127`` overflows to inf (only reachable from float64 inputs
or hand-made scales); dequantizing to fp16 overflows/underflows outside fp16's range.

Layout of this file (kernels/ convention): constants and bit helpers, then the plain-torch
reference (``_quantize_mxfp4_torch``, ``_dequantize_mxfp4_torch``), then a faster quantizer
for CPU in torch (``_quantize_mxfp4_cpu``: the reference's bits for every dtype but float64),
then C++ CPU kernels for float32 / bfloat16 (``_quantize_mxfp4_cpp``, ``_dequantize_mxfp4_cpp``:
the Triton kernels' integer rounding and a byte -> element-pair table, one pass over the data,
``csrc/mxfp4.cpp``, built by ``kernels/build``; where it cannot be built the torch paths run),
then the Triton kernels and their launchers, then the public functions, which validate their
inputs and dispatch (``kernels/dispatch.py``: Triton on CUDA, the reference elsewhere -- on CPU
the C++ kernels where the dtype allows, else the fast torch quantizer -- either one forced by
``set_backend``). The kernels give the reference's bits exactly for float32, bfloat16 and
float16 (in and out; the C++ ones for float32 and bfloat16); float64 and fp8 never take a
kernel. The reference stays the ground truth the other paths' tests compare against.
Timings of the CPU paths: tests/bench/results.md (bench_mxfp4, and "C++ CPU kernels").
"""

from __future__ import annotations

import enum
import functools
import sys
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from jointrl.kernels.cpu_extension import load_ops
from jointrl.kernels.dispatch import launcher, use_triton

__all__ = [
    "E2M1_VALUES",
    "E8M0_BIAS",
    "E8M0_NAN",
    "MXFP4_BLOCK",
    "ScaleRule",
    "dequantize_mxfp4",
    "mxfp4_roundtrip",
    "quantize_mxfp4",
]

MXFP4_BLOCK = 32  # elements per shared scale
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude code -> value
_E2M1_EMAX = 2  # floor(log2(6))
_EXP_MIN, _EXP_MAX = -127, 127  # shared exponents E8M0 can hold (0xFF is NaN)


class ScaleRule(enum.StrEnum):
    """How the shared exponent is chosen from a block's ``amax`` (module docstring)."""

    FLOOR = "floor"
    CEIL = "ceil"


# ---------------------------------------------------------------------------------------
# bit helpers
# ---------------------------------------------------------------------------------------

class _Bits(NamedTuple):
    int_dtype: torch.dtype  # same width as the float
    mbits: int  # mantissa field width
    bias: int  # exponent bias
    emask: int  # exponent field mask (after shifting out the mantissa)


_FLOAT_BITS = {
    torch.float32: _Bits(torch.int32, 23, 127, 0xFF),
    torch.float64: _Bits(torch.int64, 52, 1023, 0x7FF),
}


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every narrower float converts to float32 exactly."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _exp2_int(k: Tensor, dtype: torch.dtype) -> Tensor:
    """Exact ``2^k`` in ``dtype`` (float32 or float64) for integer ``k`` in [-127, 127].

    Built from bits so no ``pow``/``exp2`` rounding can creep in; ``2^-127`` is a float32
    subnormal (``1 << 22``).
    """
    int_dtype, mbits, bias, _ = _FLOAT_BITS[dtype]
    k = k.to(int_dtype)
    bits = (k + bias) << mbits
    if dtype == torch.float32:
        bits = torch.where(k >= -126, bits, torch.ones_like(k) << (k + 149).clamp(0, 22))
    return bits.view(dtype)


def _shared_exponent(amax: Tensor, rule: ScaleRule) -> Tensor:
    """Unclamped shared exponent per block from the bits of ``amax >= 0`` (finite entries).

    amax: float32/float64 [...] -> int64 [...]. Zero and subnormal ``amax`` report
    ``floor(log2) = -bias``, which the caller's clamp at -127 absorbs for either rule.
    """
    int_dtype, mbits, bias, emask = _FLOAT_BITS[amax.dtype]
    bits = amax.view(int_dtype).to(torch.int64)
    biased = (bits >> mbits) & emask
    floor_log2 = biased - bias
    if rule == ScaleRule.FLOOR:
        return floor_log2 - _E2M1_EMAX
    frac = bits & ((1 << mbits) - 1)
    above_1p5 = (frac > (1 << (mbits - 1))).to(torch.int64)  # mantissa m > 1.5
    return floor_log2 - _E2M1_EMAX + above_1p5


def _e2m1_boundaries(dtype: torch.dtype, device: torch.device) -> Tensor:
    """The 7 midpoints between E2M1 values, for ``bucketize`` (counts boundaries < y).

    A tie rounds up exactly when the upper neighbour has the even code (odd midpoint index:
    0.75, 1.75, 3.5). Lowering those three midpoints by one ulp turns "y >= t" into the
    strict "y > t'" that ``bucketize`` counts, so one pass gives round-half-to-even.
    """
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=dtype, device=device)
    odd = torch.tensor([1, 3, 5], device=device)
    t[odd] = torch.nextafter(t[odd], torch.zeros_like(t[odd]))
    return t


def _e2m1_byte_lut(dtype: torch.dtype, device: torch.device) -> Tensor:
    """float [256, 2]: the two decoded elements (low nibble, high nibble) of every byte."""
    mag = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    nibble = torch.cat([mag, -mag])  # code | sign << 3
    byte = torch.arange(256, device=device)
    return torch.stack([nibble[byte & 0xF], nibble[byte >> 4]], dim=-1)


# ---------------------------------------------------------------------------------------
# plain-torch reference
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def _quantize_mxfp4_torch(x: Tensor, rule: ScaleRule) -> tuple[Tensor, Tensor]:
    """x: float [..., K] (K % 32 == 0) -> (blocks uint8 [..., K/2], scales uint8 [..., K/32])."""
    *lead, k = x.shape
    work = _work_dtype(x.dtype)
    x_bn = x.to(work).contiguous().reshape(*lead, k // MXFP4_BLOCK, MXFP4_BLOCK)  # b = blocks, n = 32
    mag_bn = x_bn.abs()
    amax_b = mag_bn.amax(dim=-1)  # NaN propagates, inf stays inf
    bad_b = ~torch.isfinite(amax_b)

    exp_b = _shared_exponent(amax_b, rule).clamp_(_EXP_MIN, _EXP_MAX)
    exp_b = exp_b.masked_fill_(bad_b, 0)
    scales = (exp_b + E8M0_BIAS).to(torch.uint8).masked_fill_(bad_b, E8M0_NAN)

    y_bn = mag_bn.mul_(_exp2_int(-exp_b, work).unsqueeze(-1))  # exact: power-of-two scaling
    code_bn = torch.bucketize(y_bn, _e2m1_boundaries(work, x.device), out_int32=True)
    nib_bn = code_bn.to(torch.uint8) | (torch.signbit(x_bn).to(torch.uint8) << 3)
    nib_bn.masked_fill_(bad_b.unsqueeze(-1), 0)

    nib_pair = nib_bn.reshape(*lead, k // 2, 2)
    blocks = nib_pair[..., 0] | (nib_pair[..., 1] << 4)
    return blocks, scales


@torch.no_grad()
def _dequantize_mxfp4_torch(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """(blocks uint8 [..., K/2], scales uint8 [..., K/32]) -> dtype [..., K]."""
    *lead, half_k = blocks.shape
    k = 2 * half_k
    work = _work_dtype(dtype)
    byte_idx = blocks.reshape(-1).to(torch.int32)
    vals_pair = _e2m1_byte_lut(work, blocks.device).index_select(0, byte_idx)  # [N*K/2, 2]
    vals_bn = vals_pair.reshape(*lead, k // MXFP4_BLOCK, MXFP4_BLOCK)
    exp_b = scales.to(torch.int32) - E8M0_BIAS
    nan_b = scales == E8M0_NAN
    scale_b = _exp2_int(exp_b.masked_fill(nan_b, 0), work).masked_fill_(nan_b, float("nan"))
    return (vals_bn * scale_b.unsqueeze(-1)).reshape(*lead, k).to(dtype)


# ---------------------------------------------------------------------------------------
# CPU fast path (same bits as the reference; what CPU callers run)
# ---------------------------------------------------------------------------------------

_CPU_CHUNK_ROWS = 8192  # MXFP4 blocks per chunk: two 1 MiB scratch buffers, cache-resident
_NIB_SHIFT = 21  # an fp32 bit pattern's bits 21..31 (sign, exponent, 2 mantissa bits) pick its nibble


def _e2m1_nibble_lut(device: torch.device) -> Tensor:
    """uint8 [2048]: the reference's nibble (sign << 3 | E2M1 code) of fp32 ``y``, by ``idx(bits(y))``.

    ``idx(b) = ((b + 0x1FFFFF + bit22(b)) >> 21) & 0x7FF``. Every E2M1 midpoint has at most 2
    mantissa bits, so a midpoint is the first pattern of a 2^21-wide bucket ``k = b >> 21``
    (sign, exponent, top 2 mantissa bits) and the nibble is constant on the rest of a bucket.
    The rest of bucket ``k`` carries into ``k + 1``, so entry ``k + 1`` holds its nibble. A
    bucket's first pattern lands on ``k + bit22``: the midpoints that round down (0.25, 1.25,
    2.5, 5) have bit 22 clear and take bucket ``k - 1``'s (lower) nibble, those that round up
    (0.75, 1.75, 3.5) have it set and take bucket ``k``'s; a first pattern that is no
    midpoint has the same nibble as both neighbours. Entries 0 and 0x400, which would hold
    the NaN buckets 0x7FF and 0x3FF, instead hold ``+0.0``'s and ``-0.0``'s nibbles (0, 0x8).
    """
    bucket = torch.arange(-1, 2047, dtype=torch.int64).clamp_(min=0)  # entry i: bucket i - 1
    bits = (bucket << _NIB_SHIFT) | 1  # a pattern inside the bucket, as uint32
    y = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
    code = torch.bucketize(y.abs(), _e2m1_boundaries(torch.float32, y.device), out_int32=True)
    lut = code.to(torch.uint8) | (torch.signbit(y).to(torch.uint8) << 3)
    lut[0], lut[0x400] = 0x0, 0x8
    return lut.to(device)


_NIBBLE_LUT: dict[torch.device, Tensor] = {}


@torch.no_grad()
def _quantize_mxfp4_cpu(x: Tensor, rule: ScaleRule) -> tuple[Tensor, Tensor]:
    """Same contract and bits as ``_quantize_mxfp4_torch`` for every dtype but float64.

    x: float [..., K] (K % 32 == 0, not float64) -> (blocks uint8 [..., K/2], scales uint8 [..., K/32]).

    The reference allocates ~10 full-size temporaries (on CPU, each one page-faulted in anew)
    and binary-searches every element (``bucketize``). Here the scales come from the integer
    max of ``|x|``'s bits (as in the Triton kernel), and the elements go through cache-sized
    chunks of reused scratch: ``y = x * 2^-e`` (the reference's exact product, sign kept), a
    few integer ops on ``y``'s bits and a lookup in a 2048-entry table to the signed nibble
    (``_e2m1_nibble_lut``), and two nibbles packed per byte through an int16 view of the
    nibbles (little-endian hosts only; ``quantize_mxfp4`` checks).
    """
    *lead, k = x.shape
    n_blocks = x.numel() // MXFP4_BLOCK
    blocks = torch.empty(*lead, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(*lead, k // MXFP4_BLOCK, dtype=torch.uint8, device=x.device)
    if n_blocks == 0:
        return blocks, scales
    x_bn = x.contiguous().view(n_blocks, MXFP4_BLOCK)  # b = blocks, n = 32
    blocks_bh = blocks.view(n_blocks, MXFP4_BLOCK // 2)
    lut = _NIBBLE_LUT.get(x.device)
    if lut is None:
        lut = _NIBBLE_LUT[x.device] = _e2m1_nibble_lut(x.device)

    rows = min(_CPU_CHUNK_ROWS, n_blocks)
    # scratch reused by every chunk (c = chunk rows): f32 holds x (as fp32), then y = x * 2^-e,
    # then y's table index, then the packed pairs; tmp holds bit 22, then the nibbles
    f32_cn = torch.empty(rows, MXFP4_BLOCK, dtype=torch.float32, device=x.device)
    tmp_cn = torch.empty(rows, MXFP4_BLOCK, dtype=torch.int32, device=x.device)
    amax_b = torch.empty(n_blocks, dtype=torch.int32, device=x.device)

    def fp32_chunk(r0: int, r1: int) -> Tensor:
        src = x_bn[r0:r1]
        if src.dtype == torch.float32:
            return src
        return f32_cn[: r1 - r0].copy_(src)  # exact for every float narrower than fp32

    # pass 1: the bits of each block's largest |x| (finite floats order like their bit
    # patterns; NaN and inf sort above every finite value)
    for r0 in range(0, n_blocks, rows):
        r1 = min(r0 + rows, n_blocks)
        mag_cn = torch.bitwise_and(fp32_chunk(r0, r1).view(torch.int32), 0x7FFFFFFF, out=tmp_cn[: r1 - r0])
        torch.amax(mag_cn, dim=1, out=amax_b[r0:r1])

    bad_b = amax_b >= 0x7F800000
    exp_b = (amax_b >> 23) - (127 + _E2M1_EMAX)  # zero/subnormal amax: -129, clamped to -127
    if rule == ScaleRule.CEIL:
        exp_b += (amax_b & 0x7FFFFF) > 0x400000  # mantissa above 1.5: 6 * 2^e < amax
    exp_b.clamp_(_EXP_MIN, _EXP_MAX).masked_fill_(bad_b, 0)
    scales.view(n_blocks).copy_((exp_b + E8M0_BIAS).masked_fill_(bad_b, E8M0_NAN))
    # 2^-e from bits: e <= 126 for every finite fp32 amax, so 2^-e is a normal float
    inv_scale_b = ((E8M0_BIAS - exp_b) << 23).view(torch.float32)

    # pass 2: the elements
    for r0 in range(0, n_blocks, rows):
        r1 = min(r0 + rows, n_blocks)
        c = r1 - r0
        y_cn = torch.mul(fp32_chunk(r0, r1), inv_scale_b[r0:r1, None], out=f32_cn[:c])  # exact, sign kept
        idx_cn, bit22_cn = y_cn.view(torch.int32), tmp_cn[:c]
        torch.bitwise_right_shift(idx_cn, 22, out=bit22_cn).bitwise_and_(1)
        # the table index (NaN patterns may wrap around; their blocks are zeroed below)
        idx_cn.add_(bit22_cn).add_((1 << _NIB_SHIFT) - 1).bitwise_right_shift_(_NIB_SHIFT).bitwise_and_(0x7FF)
        nib_n = torch.index_select(lut, 0, idx_cn.view(-1), out=tmp_cn.view(-1).view(torch.uint8)[: c * MXFP4_BLOCK])
        # little-endian int16 pairs hold element 2j in the low byte and 2j + 1 in the high
        # one; (pair >> 4) | pair has the packed byte in its low byte
        pair_h = nib_n.view(torch.int16)
        packed_h = torch.bitwise_right_shift(pair_h, 4, out=idx_cn.view(-1).view(torch.int16)[: c * 16])
        blocks_bh[r0:r1].view(-1).copy_(packed_h.bitwise_or_(pair_h))
    if bad_b.any():
        blocks_bh.masked_fill_(bad_b.unsqueeze(-1), 0)
    return blocks, scales


# ---------------------------------------------------------------------------------------
# C++ CPU kernels (same bits as the reference; float32 / bfloat16 in and out)
# ---------------------------------------------------------------------------------------

_CPU_DTYPES = (torch.float32, torch.bfloat16)  # what the C++ kernels take in (quantize) and give out (dequantize)


@functools.cache
def load_cpu_kernel():
    """The C++ quantize / dequantize (``torch.ops.jointrl.mxfp4_*``), or None where they cannot be built here."""
    return load_ops(["quantize", "dequantize"], prefix="mxfp4_")


def _quantize_mxfp4_cpp(x: Tensor, rule: ScaleRule) -> tuple[Tensor, Tensor]:
    """Same contract and bits as ``_quantize_mxfp4_torch``; x float32 / bfloat16 on CPU."""
    *lead, k = x.shape
    blocks = torch.empty(*lead, k // 2, dtype=torch.uint8)
    scales = torch.empty(*lead, k // MXFP4_BLOCK, dtype=torch.uint8)
    if scales.numel():
        load_cpu_kernel().quantize(x.contiguous(), blocks, scales, rule == ScaleRule.CEIL)
    return blocks, scales


def _dequantize_mxfp4_cpp(blocks: Tensor, scales: Tensor, out: Tensor) -> Tensor:
    """Same bits as ``_dequantize_mxfp4_torch``, written into ``out`` (float32 / bfloat16, contiguous, CPU)."""
    if scales.numel():
        load_cpu_kernel().dequantize(blocks.contiguous(), scales.contiguous(), out)
    return out


# ---------------------------------------------------------------------------------------
# Triton kernels (same bits as the reference; float64 stays on the reference)
# ---------------------------------------------------------------------------------------

_TRITON_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRITON_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
QUANT_BLOCK_ROWS = 64  # MXFP4 blocks (of 32 elements) per program
DEQUANT_BLOCK_ROWS = 64


@triton.jit
def _quantize_mxfp4_kernel(
    x_ptr, blocks_ptr, scales_ptr, n_rows, CEIL: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK_ROWS: tl.constexpr
):
    """x [n_rows, 32] (one MXFP4 block a row) -> blocks uint8 [n_rows, 16], scales uint8 [n_rows].

    Integer-only: the shared exponent comes from the bits of the block's largest |x| (finite
    floats order like their bit patterns), and each element is rounded to E2M1 by shifting its
    24-bit significand right and rounding to nearest even with guard and sticky bits.
    ``BF16_BITS``: x is bf16 passed as int16 bits, widened to fp32 bits by a shift (exact; the
    interpreter's own bf16 -> fp32 conversion mangles subnormals).
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    cols = tl.arange(0, 32)
    offs = rows.to(tl.int64)[:, None] * 32 + cols[None, :]
    if BF16_BITS:
        bits = tl.load(x_ptr + offs, mask=row_ok[:, None], other=0).to(tl.int32) << 16
    else:
        bits = tl.load(x_ptr + offs, mask=row_ok[:, None], other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF  # |x| as bits: ordered like |x|; NaN and inf >= 0x7F800000

    amax = tl.max(mag, axis=1)
    bad = amax >= 0x7F800000  # block holds NaN or inf
    e = ((amax >> 23) - 127) - 2  # floor(log2 amax) - emax(E2M1); zero/subnormal give -129
    if CEIL:
        e += ((amax & 0x7FFFFF) > 0x400000).to(tl.int32)  # mantissa > 1.5: 6 * 2^e < amax
    e = tl.minimum(tl.maximum(e, -127), 127)
    e = tl.where(bad, 0, e)
    scale = tl.where(bad, 255, e + 127)

    # |x| = S * 2^(ex_n - 150) with a 24-bit significand S (no hidden bit for subnormals)
    ex = mag >> 23
    ex_n = tl.maximum(ex, 1)
    sig = (mag & 0x7FFFFF) | tl.where(ex > 0, 0x800000, 0)
    # exponent of y = |x| / 2^e (subnormal x: only its top mantissa bit can reach y >= 1)
    ty = ex_n - 127 - e[:, None] - (ex == 0).to(tl.int32)
    ty_pos = tl.maximum(ty, 0)
    # E2M1's step at y is 2^(max(ty, 0) - 1); shift S down to units of that step
    sh = ty_pos - 1 - (ex_n - 150) + e[:, None]
    sh = tl.minimum(sh, 25)  # sh >= 21 always; past 25 everything (guard included) is gone
    q = sig >> sh
    guard = (sig >> (sh - 1)) & 1
    sticky = (sig & ((1 << (sh - 1)) - 1)) != 0
    q += guard & (sticky.to(tl.int32) | (q & 1))
    code = tl.minimum(2 * ty_pos + q, 7)  # saturate at 6
    nib = code | ((bits >> 28) & 0x8)  # sign bit -> bit 3
    nib = tl.where(bad[:, None], 0, nib)

    lo, hi = tl.split(tl.reshape(nib, [BLOCK_ROWS, 16, 2]))
    byte = (lo | (hi << 4)).to(tl.uint8)
    boffs = rows.to(tl.int64)[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(blocks_ptr + boffs, byte, mask=row_ok[:, None])
    tl.store(scales_ptr + rows, scale.to(tl.uint8), mask=row_ok)


@triton.jit
def _e2m1_tile(byte, scale, ROWS: tl.constexpr, K: tl.constexpr):
    """Decode packed MXFP4: byte int32 [ROWS, K/2], scale int32 [ROWS, K/32] -> fp32 [ROWS, K].

    E2M1 code c decodes from bits (c >= 2: exponent c//2 - 1, mantissa bit c & 1; c == 1: 0.5),
    then multiplies by the scale 2^(s - 127) built from bits (2^-127 is a subnormal): exact,
    except that 4 * 2^127 and 6 * 2^127 overflow to inf. Scale byte 0xFF gives NaN.
    """
    nib = tl.reshape(tl.join(byte & 0xF, byte >> 4), [ROWS, K])  # element 2j = low nibble
    c = nib & 7
    vbits = tl.where(c >= 2, (((c >> 1) + 126) << 23) | ((c & 1) << 22), tl.where(c == 1, 126 << 23, 0))
    vbits |= (nib & 8) << 28
    val = tl.reshape(vbits.to(tl.float32, bitcast=True), [ROWS, K // 32, 32])
    sbits = tl.where(scale > 0, scale << 23, 1 << 22)
    mult = tl.where(scale == 255, float("nan"), sbits.to(tl.float32, bitcast=True))
    return tl.reshape(val * mult[:, :, None], [ROWS, K])


@triton.jit
def _dequantize_mxfp4_kernel(
    blocks_ptr, scales_ptr, out_ptr, n_rows, BF16_BITS: tl.constexpr, BLOCK_ROWS: tl.constexpr
):
    """blocks uint8 [n_rows, 16], scales uint8 [n_rows] -> out [n_rows, 32] (out's dtype).

    ``BF16_BITS``: out is bf16 passed as int16; every decoded value fits bf16 exactly (at most
    two significant bits, bf16 has fp32's exponent range), so its bits are the fp32 bits' top
    half (the interpreter's own fp32 -> bf16 conversion mangles subnormals).
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    boffs = rows.to(tl.int64)[:, None] * 16 + tl.arange(0, 16)[None, :]
    byte = tl.load(blocks_ptr + boffs, mask=row_ok[:, None], other=0).to(tl.int32)
    s = tl.load(scales_ptr + rows[:, None], mask=row_ok[:, None], other=127).to(tl.int32)
    out = _e2m1_tile(byte, s, BLOCK_ROWS, 32)
    if BF16_BITS:
        out = (out.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
    ooffs = rows.to(tl.int64)[:, None] * 32 + tl.arange(0, 32)[None, :]
    tl.store(out_ptr + ooffs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _quantize_mxfp4_triton(x: Tensor, rule: ScaleRule) -> tuple[Tensor, Tensor]:
    """Launcher: x float32/bf16/fp16 [..., K] -> (blocks [..., K/2], scales [..., K/32])."""
    *lead, k = x.shape
    x = x.contiguous()
    blocks = torch.empty(*lead, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(*lead, k // MXFP4_BLOCK, dtype=torch.uint8, device=x.device)
    n_rows = scales.numel()
    if n_rows:
        grid = (triton.cdiv(n_rows, QUANT_BLOCK_ROWS),)
        bf16 = x.dtype == torch.bfloat16
        launcher(_quantize_mxfp4_kernel, x.device)[grid](
            x.view(torch.int16) if bf16 else x, blocks, scales, n_rows,
            CEIL=rule == ScaleRule.CEIL, BF16_BITS=bf16, BLOCK_ROWS=QUANT_BLOCK_ROWS,
        )
    return blocks, scales


def _dequantize_mxfp4_triton(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """Launcher: (blocks [..., K/2], scales [..., K/32]) -> dtype [..., K], dtype fp32/bf16/fp16."""
    *lead, half_k = blocks.shape
    out = torch.empty(*lead, 2 * half_k, dtype=dtype, device=blocks.device)
    n_rows = scales.numel()
    if n_rows:
        grid = (triton.cdiv(n_rows, DEQUANT_BLOCK_ROWS),)
        bf16 = dtype == torch.bfloat16
        launcher(_dequantize_mxfp4_kernel, blocks.device)[grid](
            blocks.contiguous(), scales.contiguous(), out.view(torch.int16) if bf16 else out, n_rows,
            BF16_BITS=bf16, BLOCK_ROWS=DEQUANT_BLOCK_ROWS,
        )
    return out


# ---------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------


def _check_scale_rule(scale_rule: str) -> ScaleRule:
    try:
        return ScaleRule(scale_rule)
    except ValueError:
        raise ValueError(
            f"scale_rule must be one of {[r.value for r in ScaleRule]}, got {scale_rule!r}"
        ) from None


def quantize_mxfp4(x: Tensor, scale_rule: str = "floor") -> tuple[Tensor, Tensor]:
    """Quantize ``x`` to MXFP4 along its last dim (module docstring gives the exact rules).

    Args:
        x: floating tensor ``[..., K]`` (any leading shape, any float dtype, any device),
            ``K`` a multiple of 32.
        scale_rule: ``"floor"`` (OCP default, may clip the block max to 6 * scale) or
            ``"ceil"`` (never clips).

    Returns:
        ``(blocks, scales)``: ``blocks`` uint8 ``[..., K/2]`` (element ``2j`` in the low
        nibble, ``2j+1`` in the high nibble), ``scales`` uint8 ``[..., K/32]`` (E8M0,
        ``0xFF`` marks a block that held NaN or inf), both on ``x``'s device.

    Raises:
        TypeError: ``x`` is not a floating-point tensor.
        ValueError: ``x`` is 0-d, its last dim is not a multiple of 32, or the rule is unknown.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"quantize_mxfp4 expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"quantize_mxfp4 expects a floating-point tensor, got dtype {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % MXFP4_BLOCK != 0:
        raise ValueError(
            f"quantize_mxfp4 needs the last dim to be a multiple of {MXFP4_BLOCK}, "
            f"got shape {tuple(x.shape)}"
        )
    rule = _check_scale_rule(scale_rule)
    if x.dtype in _TRITON_IN_DTYPES and use_triton(x.device):
        return _quantize_mxfp4_triton(x, rule)
    if x.device.type == "cpu" and x.dtype != torch.float64 and sys.byteorder == "little":
        if x.dtype in _CPU_DTYPES and load_cpu_kernel() is not None:
            return _quantize_mxfp4_cpp(x, rule)
        return _quantize_mxfp4_cpu(x, rule)
    return _quantize_mxfp4_torch(x, rule)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16, *,
                     out: Tensor | None = None) -> Tensor:
    """Decode MXFP4 ``(blocks, scales)`` back to floats.

    Args:
        blocks: uint8 ``[..., K/2]`` packed E2M1 pairs (low nibble first).
        scales: uint8 ``[..., K/32]`` E8M0 scales; ``0xFF`` decodes its whole block to NaN.
        dtype: floating output dtype (ignored with ``out``: its dtype).
        out: write the result into this tensor (``[..., K]``, on ``blocks``' device), in place
            as ``out.copy_`` would (its version counter moves); on CPU in float32 / bfloat16,
            contiguous, the C++ kernel decodes straight into it.

    Returns:
        ``dtype [..., K]`` on ``blocks``' device (``out`` when given).

    Raises:
        TypeError: ``blocks``/``scales`` are not uint8, or ``dtype`` is not floating.
        ValueError: the shapes do not pair up (same leading dims, ``K/2 == 16 * (K/32)``), or
            ``out`` has another shape or device.
    """
    if out is not None:
        dtype = out.dtype
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if not dtype.is_floating_point:
        raise TypeError(f"dequantize_mxfp4 needs a floating output dtype, got {dtype}")
    if (
        blocks.dim() == 0
        or blocks.shape[:-1] != scales.shape[:-1]
        or blocks.shape[-1] != (MXFP4_BLOCK // 2) * scales.shape[-1]
    ):
        raise ValueError(
            f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up: "
            f"expected [..., K/2] and [..., K/32]"
        )
    if out is not None and (tuple(out.shape) != (*blocks.shape[:-1], 2 * blocks.shape[-1]) or out.device != blocks.device):
        raise ValueError(f"out {tuple(out.shape)} on {out.device} does not fit blocks {tuple(blocks.shape)} "
                         f"on {blocks.device}: expected [..., K] on the same device")
    if dtype in _TRITON_OUT_DTYPES and use_triton(blocks.device):
        value = _dequantize_mxfp4_triton(blocks, scales, dtype)
    elif (blocks.device.type == "cpu" and dtype in _CPU_DTYPES and sys.byteorder == "little"
          and load_cpu_kernel() is not None):
        # straight into out where copy_ would raise nothing and record no autograd step (else copy_ below says why)
        if (out is not None and out.is_contiguous() and not (out.requires_grad and torch.is_grad_enabled())
                and not (out.is_inference() and not torch.is_inference_mode_enabled())):
            _dequantize_mxfp4_cpp(blocks, scales, out)
            torch.autograd.graph.increment_version(out)  # what copy_ does: caches keyed on it see the change
            return out
        value = _dequantize_mxfp4_cpp(blocks, scales, torch.empty(*blocks.shape[:-1], 2 * blocks.shape[-1], dtype=dtype))
    else:
        value = _dequantize_mxfp4_torch(blocks, scales, dtype)
    return value if out is None else out.copy_(value)


def mxfp4_roundtrip(x: Tensor, scale_rule: str = "floor") -> Tensor:
    """``dequantize_mxfp4(*quantize_mxfp4(x, scale_rule), dtype=x.dtype)``: ``[..., K]`` -> same.

    The values the rollout engine sees for a weight the learner holds as ``x``. No gradient
    flows (see the learner's fake-quantization for a straight-through version).
    """
    blocks, scales = quantize_mxfp4(x, scale_rule)
    return dequantize_mxfp4(blocks, scales, dtype=x.dtype)

