"""Triton FP4 x BF16 matmuls for NVFP4 weights: y = x·Wᵀ (+bias) and dx = dy·W.

Hopper has no FP4 tensor cores, so these kernels read the 4.5-bit weights from memory, turn them
into bf16 in registers and issue ordinary bf16 MMAs with fp32 accumulation ("Marlin-style"
mixed-input GEMM, written in Triton).

The weight format is the standard compressed-tensors NVFP4 layout, untouched (nvfp4.py owns it):

    packed        uint8          (N, K/2)   two E2M1 codes per byte, even k in the LOW nibble
    scale         float8_e4m3fn  (N, K/16)  one scale per 16 consecutive k of a row
    global_scale  float32        (1,)
    W[n, k] = e2m1(code[n, k]) * scale[n, k // 16] / global_scale

The math of one output tile, written transposed ("swap AB") so that the big operand, the weight,
is the MMA's left operand (it may then live in registers, and a 16-row weight tile is a legal MMA
even when M is 1):

    acc[BN, BM] = 0                                        # fp32
    for k0 in range(k_start, k_end, BK):
        w  = e2m1(packed[n-tile, k0:k0+BK]) * scale · 2^-7  # (BN, BK) bf16, exact
        acc += w @ x[m-tile, k0:k0+BK]ᵀ                     # bf16 MMA, fp32 accumulate
    y[m-tile, n-tile] = (acc · 2^7 / global_scale + bias)ᵀ  # bf16

dx = dy·W is the same loop with the reduction over N: acc[BK, BM] += wᵀ @ dy[m-tile, n0:n0+BN]ᵀ.

Decoding E2M1 (the hot spot: at M <= 64 it costs as much as reading the bytes). A code is
s|e e|m (sign, 2 exponent bits, 1 mantissa bit); its magnitudes are 0, .5, 1, 1.5, 2, 3, 4, 6.
Moving the three magnitude bits into bf16 bits 8..6 (the two lowest exponent bits and the top
mantissa bit) and the sign into bit 15 gives a bf16 whose value is exactly e2m1 · 2^-126: for
e >= 1 it is a normal number 2^(e-127)·(1+m/2), and for e = 0 the bf16 subnormal m·2^-1·2^-126,
which is why the E2M1 subnormal 0.5 needs no special case. On the GPU this is done by inline PTX
on four packed bytes at a time (prmt spreads bytes into 16-bit lanes, then shift/and/lop3 place
the bits of both nibbles, ~2 integer ops per weight), followed by one bf16x2 multiply by
scale·2^119, so the operand is w·scale·2^-7: every value is a normal bf16 and exact (2 significant
bits times 4). The factor 2^7/global_scale is applied to the fp32 accumulator in the epilogue.
The scale's E4M3 bits are decoded with integer ops too (sign, exponent + bias shift, mantissa,
subnormal branch), so no float8 dtype is needed inside Triton.

Under TRITON_INTERPRET=1 (CPU tests) inline PTX cannot run and the interpreter's bf16 tl.dot is
wrong (triton 3.9), so the wrapper sets INTERPRET: the codes are decoded with plain tl ops to the
same bf16 operand and the dot runs on fp32 copies.

The CUDA-core kernel (M <= 2, no tensor cores: an MMA tile of 16 rows would waste >= 3/4 of its
work on padding) uses the same bit trick in fp32: magnitude bits to fp32 bits 22..24, sign to bit
31 gives exactly e2m1 · 2^-126 (±0.5 is an fp32 subnormal, kept since nothing runs with .ftz;
~2.4 integer ops per weight, _E2M1X4_TO_F32_PTX). x is multiplied by 2^64 so that the products
stay normal (|x| < 2^64 assumed), and per row of x

    acc[BN, K/16] += (sum over each 16-weight block of w·x) · scale    # fp32: a chain of 16 FMAs
    y[m, n-tile] = sum(acc) · 2^62/global_scale (+ bias)                 # and one FMA per block

so the scale (E4M3 -> fp32 by the hardware's fp8 conversion) costs one FMA per 16 weights. Each
thread owns 16 bytes (32 weights) of each of its rows per step; x is read as int32 words, each
the bf16 pair (x[2j], x[2j+1]) that meets byte j of W (low nibble = even k), and every warp loads
the 16 words its threads need straight into registers in the weights' layout (_gemv_x): no
shared memory and no barrier in the loop, ~4.1 SASS instructions per weight at M = 1.
Deterministic: one program owns its rows over all of K (or writes fp32 partials for the reduce).

Paths the wrapper chooses from (M = rows of x; tile shapes from an H100 sweep, bench/NOTES.md):
  * M <= 2 (batch-1/2 decode): the CUDA-core kernel, 16-32 weight rows x 1024-2048 k per step.
  * M <= 8 (decode; K a multiple of 128): the fragment kernel, mma.sync on weights decoded straight
    into its A registers (see the comment above _decode_mma_ptx), 64 weight rows per program.
  * M <= 64 (decode, memory-bound): BM = 16..64 rows of x (padded; extra rows never stored), 64
    weight rows per program, split-K until there are >= 4 programs per SM; the fp32 partial sums
    are reduced (with scale, bias, cast) by a second small kernel: deterministic, no atomics.
  * 64 < M < 512: the same kernel not swapped, acc[BM, BN] += x·wᵀ with 128 x 128 tiles: the
    decoded W is the MMA's B operand, stored once to shared memory (no round trip back to
    registers), and x is re-read from L2 N/128 times instead of N/64. 0.8-0.9x cuBLAS at M = 128
    on the big weights (the MMA still waits on each decode: bench/NOTES.md v5).
  * M >= 512 (compute-bound; M >= 128 for weights under 20M elements): the fused kernel reaches only
    ~45% of cuBLAS, so W is dequantized to bf16 once (one pass over the weight, a transient bf16
    copy) and cuBLAS multiplies: 0.76-0.84x of cuBLAS bf16 at M = 1024, ~0.97x from M = 4096.
Measured on an H100 (fwd, bench/NOTES.md): M = 1 1.6-3.2x over cuBLAS bf16 (1.0-2.6 TB/s of NVFP4
weights), M = 2 1.2-2.5x, M = 4..8 1.4-2.7x, M = 16 1.2-1.9x, M = 128 0.5-0.95x.

What it leaves out: activation quantization (this is W4A16), a Marlin-style re-layout of the
weights (the fragment kernel gets the same register-only decode from a k-permutation instead),
a warp-specialized schedule. q/k/v and gate/up arrive as one weight each (model.StackedLinear).
Test: pytest tests/test_marlin_kernel.py (CPU: interpreter, tiny shapes; GPU: real shapes);
benchmark: python bench/kernel.py.
"""
import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# ----------------------------------------------------------------------------------------------
# constants

BLOCK = 16               # NVFP4 scale block along K
MIN_RED = 64             # reduction tiles are >= 64 wide (16-wide ones decoded wrong on the H100);
                         # a reduction dim that is not a multiple of 64 is zero-padded
DEQUANT_MIN_M = 512      # from this M on: dequantize W to bf16 once, then cuBLAS (use_dequant)
GEMV_MAX_M = 2           # up to this M: the CUDA-core kernel (no tensor cores; it takes <= 4 rows)
FRAGMENT_MAX_M = 8       # up to this M: the fragment kernel (one mma.sync token tile; K % 128 == 0)
OPERAND_SHIFT = tl.constexpr(7)      # the MMA operand is w·scale·2^-7 (all normal bf16 numbers) ...
OPERAND_POST = tl.constexpr(128.0)   # ... so the epilogue multiplies by 2^7 / global_scale
X_SCALE = tl.constexpr(2.0 ** 64)    # the CUDA-core kernel multiplies x by 2^64 (weights are ·2^-126),
GEMV_POST = tl.constexpr(2.0 ** 55)  # so its sums are ·2^-62: ·2^55 brings them to the MMA's ·2^-7


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Programmatic dependent launch (Hopper and later). A kernel launched with launch_pdl=True may be
# scheduled while the kernel before it in the stream is still running; it calls gdc_wait()
# (griddepcontrol.wait: the previous grid has finished and its writes are visible) before it reads
# anything an earlier kernel wrote. Results are unchanged; the launch latency and the prologue
# (address math, loads of the constant weights) overlap the previous kernel's tail, which matters
# in a decode step of ~500 small kernels. Every kernel in such a chain must wait before reading:
# a kernel that skipped the wait could overtake its predecessor.
PDL = True       # bench/rollout.py and bench/kernel.py switch it off to measure what it buys


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    return torch.cuda.get_device_capability(index)


def pdl_launch(device) -> dict:
    """Launch keywords for a kernel that starts with pdl_start(USE_PDL): programmatic dependent
    launch where the device has it (Hopper and later, not under the interpreter)."""
    on = PDL and device.type == "cuda" and not _interpreting() and _capability(device.index or 0)[0] >= 9
    return dict(USE_PDL=on, launch_pdl=on)


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """The first statement of every kernel launched with pdl_launch(): wait until the previous
    kernel has finished and its writes are visible, then let the next one be scheduled. In this
    order at most one kernel waits ahead; releasing first let every later kernel of a CUDA graph
    cascade onto the SMs and hold their slots while waiting (H100: batch-4 decode 724 tok/s
    against 1124 without PDL)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


# ----------------------------------------------------------------------------------------------
# pure-torch reference (float64; used by tests and benchmarks)

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def reference_dequantize(packed, scale, global_scale, dtype=torch.float64):
    """(N, K/2) u8, (N, K/16) e4m3, (1,) f32 -> W (N, K) in dtype (independent of nvfp4.py)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=packed.device)
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long()   # (N, K)
    s = scale.to(torch.float64).repeat_interleave(BLOCK, dim=-1)                  # (N, K)
    return (lut[codes] * s / global_scale.to(torch.float64)).to(dtype)


def reference_matmul(x, packed, scale, global_scale, bias=None):
    """float64 y = x·Wᵀ (+bias)."""
    y = x.double() @ reference_dequantize(packed, scale, global_scale).t()
    return y if bias is None else y + bias.double()


# ----------------------------------------------------------------------------------------------
# decoding helpers (inlined into both matmul kernels)

# Four packed bytes b0..b3 -> lo = e2m1(low nibbles)·s, hi = e2m1(high nibbles)·s as bf16x2 pairs
# (lo b0, lo b1), (lo b2, lo b3), (hi b0, hi b1), (hi b2, hi b3). After prmt each 16-bit lane holds
# byte<<8: the high nibble's sign is already at bit 15 and its magnitude (bits 12..14) moves to 6..8
# by >>6; the low nibble's sign (bit 11) moves up by 4 and its magnitude (bits 8..10) down by 2.
# lop3 0xEA computes (a & b) | c; the fma by the scale pair adds -0 (nz), so w·s keeps its sign.
# Needs the registers y01, y23, t, u, sg declared and nz = 0x80008000.
def _e2m1x4_to_bf16_ptx(word, s01, s23, lo01, lo23, hi01, hi23) -> list[str]:
    return [f"prmt.b32 y01, {word}, 0, 0x1404;", f"prmt.b32 y23, {word}, 0, 0x3424;"] + [
        line for y, s, lo, hi in (("y01", s01, lo01, hi01), ("y23", s23, lo23, hi23)) for line in (
            f"shr.b32 t, {y}, 2;", f"shl.b32 u, {y}, 4;", "and.b32 sg, u, nz;",
            "lop3.b32 t, t, 0x01C001C0, sg, 0xEA;", f"fma.rn.bf16x2 {lo}, t, {s}, nz;",
            f"shr.b32 t, {y}, 6;", f"and.b32 sg, {y}, nz;",
            "lop3.b32 t, t, 0x01C001C0, sg, 0xEA;", f"fma.rn.bf16x2 {hi}, t, {s}, nz;")]


_DECODE_REGS = ".reg .b32 y01, y23, t, u, sg, nz; mov.b32 nz, 0x80008000;"
# $0,$1: lo of (b0,b1),(b2,b3); $2,$3: hi of the same; $4: the 4 bytes; $5,$6: scale pairs
_E2M1X4_TO_BF16_PTX = tl.constexpr("{ " + " ".join(
    [_DECODE_REGS] + _e2m1x4_to_bf16_ptx("$4", "$5", "$6", "$0", "$1", "$2", "$3")) + " }")


@triton.jit
def _e4m3_to_f32(bits, EXP_SHIFT: tl.constexpr):
    """E4M3 bits (uint8 tensor) -> float32 value · 2^EXP_SHIFT, exact (no float8 type needed)."""
    b = bits.to(tl.int32)
    sub = (b & 0x78) == 0                                # exponent field 0: subnormal m·2^-9
    mag = (b & 0x7F) | tl.where(sub, 8, 0)               # ... decoded as if e = 1: 2^-6·(1 + m/8)
    # fp32 exponent = e - 7 + 127 (+ EXP_SHIFT); E4M3's 3 mantissa bits go to the top of fp32's 23
    v = ((mag << 20) + ((120 + EXP_SHIFT) << 23)).to(tl.float32, bitcast=True)
    implicit = tl.full([], (8 << 20) + ((120 + EXP_SHIFT) << 23), tl.int32).to(tl.float32, bitcast=True)
    v = tl.where(sub, v - implicit, v)                   # remove the implicit 2^-6: exact
    return tl.where((b & 0x80) != 0, -v, v)


# Four packed bytes -> eight fp32 e2m1·2^-126 ($0..$3: low nibbles of bytes 0..3, $4..$7: high
# nibbles; $8: the 4 bytes = nibbles n0..n7 from bit 0). Two words first gather four nibbles each
# with the magnitude at bits p..p+2 and the sign at p+9, p = 2, 6, 18, 22 (lop3 0xE4 = a where
# c is set, else b): za from w<<2 (magnitudes) and w<<8 (signs) holds n0, n1, n4, n5; zb from
# w>>6 and w holds n2, n3, n6, n7. Each output is then (z << (22 - p)) & 0x81C00000: the
# magnitude on bits 22..24, the sign on bit 31. 19 integer ops per 8 weights.
_E2M1X4_TO_F32_PTX = tl.constexpr(
    "{ .reg .b32 a, b, za, zb; shl.b32 a, $8, 2; shl.b32 b, $8, 8; lop3.b32 za, a, b, 0x01DC01DC, 0xE4; "
    "shr.b32 a, $8, 6; lop3.b32 zb, a, $8, 0x01DC01DC, 0xE4; " + " ".join(
        f"shl.b32 a, {z}, {22 - p}; and.b32 ${i}, a, 0x81C00000;" for i, (z, p) in enumerate(
            (("za", 2), ("zb", 2), ("za", 18), ("zb", 18), ("za", 6), ("zb", 6), ("za", 22), ("zb", 22)))) + " }")


@triton.jit
def _e2m1x2_to_f32(p, INTERPRET: tl.constexpr):
    """Packed bytes (uint8 tensor) -> (lo, hi) float32 e2m1·2^-126 of the low / high nibble, exact:
    the magnitude bits on fp32 bits 22..24, the sign on bit 31 (module docstring). Code ±1 (±0.5)
    becomes an fp32 subnormal, which the GPU keeps (our PTX has no .ftz; bench/kernel.py checks)."""
    if INTERPRET:
        b = p.to(tl.int32)
        lo = ((b << 28) >> 6) & -0x7E400000             # -0x7E400000 == 0x81C00000
        hi = ((b << 24) >> 6) & -0x7E400000
        lo, hi = lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)
    else:
        lo, hi = tl.inline_asm_elementwise(
            _E2M1X4_TO_F32_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [p],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _to_bf16(y, INTERPRET: tl.constexpr):
    """fp32 -> bf16, round to nearest even. (The triton 3.9 interpreter truncates instead, so
    there the rounding is done on the bits first; finite values only.)"""
    if INTERPRET:
        b = y.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        y = b.to(tl.float32, bitcast=True)
    return y.to(tl.bfloat16)


@triton.jit
def _finish(acc, gs_ptr, bias_ptr, cols, N, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr):
    """The epilogue of every kernel: acc (fp32 sums of w·scale·2^-7 times x) -> y in bf16, times
    2^7/global_scale, plus bias[cols] (cols broadcasts against acc; columns past N add 0)."""
    y = acc * (OPERAND_POST / tl.load(gs_ptr))
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    return _to_bf16(y, INTERPRET)


@triton.jit
def _load_weight_tile(packed_ptr, scale_ptr, offs_n, k0, stride_pn, stride_sn,
                      BN: tl.constexpr, BK: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows offs_n (all valid), columns k0..k0+BK (BK divides K) of W as bf16 w·scale·2^-7."""
    offs_b = k0 // 2 + tl.arange(0, BK // 2)             # byte columns
    offs_s = k0 // 16 + tl.arange(0, BK // 16)           # scale columns
    p = tl.load(packed_ptr + offs_n[:, None] * stride_pn + offs_b[None, :])    # (BN, BK/2) u8
    sb = tl.load(scale_ptr + offs_n[:, None] * stride_sn + offs_s[None, :])    # (BN, BK/16) u8
    # scale·2^119 times the pseudo-value e2m1·2^-126 = e2m1·scale·2^-7 (exact in bf16)
    s = _e4m3_to_f32(sb, 126 - OPERAND_SHIFT)
    if INTERPRET:
        s = tl.broadcast_to(s[:, :, None], (BN, BK // 16, 8)).reshape(BN, BK // 2)
        lo, hi = _e2m1x2_to_f32(p, INTERPRET)
        lo, hi = (lo * s).to(tl.bfloat16), (hi * s).to(tl.bfloat16)
    else:
        s = tl.broadcast_to(s.to(tl.bfloat16)[:, :, None], (BN, BK // 16, 8)).reshape(BN, BK // 2)
        lo, hi = tl.inline_asm_elementwise(
            _E2M1X4_TO_BF16_PTX, "=r,=r,=r,=r,r,r,r", [p, s],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return tl.join(lo, hi).reshape(BN, BK)               # (BN, BK): even k from the low nibble


# ----------------------------------------------------------------------------------------------
# kernels

# M is not specialized: Triton would otherwise compile a separate M == 1 kernel, which ran
# 3-28% slower than the general one at M = 2 on the H100 (bench/NOTES.md).
@triton.jit
def _grouped_order(pid, num_pid_w, num_pid_m, GROUP: tl.constexpr):
    """Program id -> (weight tile, m tile), GROUP weight tiles swept over every m tile together,
    so a weight tile is read from HBM once and reused from L2 (the Triton tutorial's swizzle)."""
    num_pid_in_group = GROUP * num_pid_m
    first = (pid // num_pid_in_group) * GROUP
    group_size = min(num_pid_w - first, GROUP)
    return first + (pid % num_pid_in_group) % group_size, (pid % num_pid_in_group) // group_size


@triton.jit(do_not_specialize=["M"])
def _nvfp4_mm_kernel(
    # pointers
    x_ptr, packed_ptr, scale_ptr, gs_ptr, bias_ptr, out_ptr,
    # sizes: x (M, K), W (N, K); each program of split pid_k reduces k in [pid_k·K_SPLIT, +K_SPLIT)
    M, N, K, K_SPLIT,
    # strides (the innermost stride of every tensor is 1)
    stride_xm, stride_pn, stride_sn, stride_om, stride_os,
    # meta
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,     # PARTIAL: write fp32 partial sums (split-K)
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
    SWAP_AB: tl.constexpr,     # True: acc = W·xᵀ (BN, BM), W from registers; False: x·Wᵀ (BM, BN)
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,     # launched with pdl_launch(): see pdl_start
):
    """y[m, n] = sum_k x[m, k] · W[n, k]; one (BM, BN) tile of y per program."""
    pdl_start(USE_PDL)
    # ---- grouped program order: GROUP weight tiles are swept over all m-tiles together (L2)
    pid_n, pid_m = _grouped_order(tl.program_id(0), tl.cdiv(N, BN), tl.cdiv(M, BM), GROUP)
    pid_k = tl.program_id(1)

    # rows past N or M are clamped (wrapped) instead of masked: loads stay unmasked and
    # vectorized, and those rows of the result are never stored
    offs_n = (pid_n * BN + tl.arange(0, BN)) % N
    offs_m = (pid_m * BM + tl.arange(0, BM)) % M
    k_start = pid_k * K_SPLIT
    n_iter = tl.cdiv(min(K - k_start, K_SPLIT), BK)      # BK divides K and K_SPLIT

    # ---- main loop: dequantize a (BN, BK) weight tile in registers, bf16 MMA with x (BM, BK).
    # Swapped (small M): W is the MMA's A operand, taken from registers, so BN = 64 weight rows
    # are a legal tile at M = 1. Not swapped (medium M): the decoded W is the B operand, which
    # the MMA reads from shared memory: it is stored there once and the MMA runs asynchronously.
    acc = tl.zeros((BN, BM) if SWAP_AB else (BM, BN), dtype=tl.float32)
    for it in range(0, n_iter):
        k0 = tl.multiple_of(k_start + it * BK, BK)
        w = _load_weight_tile(packed_ptr, scale_ptr, offs_n, k0, stride_pn, stride_sn,
                              BN, BK, INTERPRET)                                   # (BN, BK)
        offs_k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :])        # (BM, BK)
        if INTERPRET:
            w, x = w.to(tl.float32), x.to(tl.float32)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc)                                      # (BN, BM)
        else:
            acc = tl.dot(x, tl.trans(w), acc)                                      # (BM, BN)
    if SWAP_AB:
        acc = tl.trans(acc)                                                        # (BM, BN)

    # ---- epilogue: the y tile (or an fp32 partial sum for the split-K reduce)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if PARTIAL:
        ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(ptrs, acc, mask=mask)
    else:
        y = _finish(acc, gs_ptr, bias_ptr, offs_n[None, :], N, HAS_BIAS, INTERPRET)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=mask)


@triton.jit
def _gemv_row(acc, lo, hi, s, x2_ptr, kb0, kb_end, W: tl.constexpr, R: tl.constexpr,
              BKB: tl.constexpr, INTERPRET: tl.constexpr):
    """acc (W, R, BKB/8) += (sum over each 16-weight block of w·x) · scale for one row of x: an
    in-thread chain of 16 FMAs per block (lo, hi interleaved in k order), one FMA with the scale.
    A thread holds bytes 16t..16t+15 of its rows, so it needs the x2 words 16t..16t+15 (each the
    bf16 pair x[2j], x[2j+1] that meets byte j). A load gives a thread 4 contiguous words, so they
    come as four loads (words 16t + 4r + 0..3) stacked in registers, a copy per warp (dim 1): no
    shared memory, no barrier. Words past kb_end read as 0."""
    chunk = kb0 + 16 * tl.arange(0, BKB // 16)[:, None, None]                   # (BKB/16, 1, 1)
    offs = tl.broadcast_to(chunk + tl.arange(0, 4)[None, None, :], (BKB // 16, W, 4))
    x0 = tl.load(x2_ptr + offs, mask=chunk < kb_end, other=0)
    x1 = tl.load(x2_ptr + offs + 4, mask=chunk < kb_end, other=0)
    x2 = tl.load(x2_ptr + offs + 8, mask=chunk < kb_end, other=0)
    x3 = tl.load(x2_ptr + offs + 12, mask=chunk < kb_end, other=0)
    xw = tl.join(tl.join(x0, x1), tl.join(x2, x3))           # (BKB/16, W, 4, 2, 2): [t, ., c, a, b]
    xw = xw.permute(1, 0, 4, 3, 2).reshape(W, BKB)           # word 16t + 4(a + 2b) + c
    # x·2^64, so that its products with e2m1·2^-126 stay normal; one bf16x2 multiply on the GPU
    if INTERPRET:
        xe = (xw << 16).to(tl.float32, bitcast=True) * X_SCALE
        xo = (xw & -65536).to(tl.float32, bitcast=True) * X_SCALE
    else:
        xe, xo = tl.inline_asm_elementwise(
            "{ .reg .b32 t, c, z; mov.b32 c, 0x5F805F80; mov.b32 z, 0x80008000; fma.rn.bf16x2 t, $2, c, z;"
            " shl.b32 $0, t, 16; and.b32 $1, t, 0xFFFF0000; }",
            "=r,=r,r", [xw], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    prod = tl.join(lo * xe[:, None, :], hi * xo[:, None, :])                  # (W, R, BKB, 2)
    return acc + tl.sum(prod.reshape(W, R, BKB // 8, 16), axis=3) * s


@triton.jit
def _gemv_scales(scale_ptr, rows, stride_sn, kb0, kb_end, W: tl.constexpr, R: tl.constexpr,
                 BKB: tl.constexpr, INTERPRET: tl.constexpr):
    """The (W, R, BKB/8) E4M3 scales of the tile as fp32. A thread's 16 bytes of a row hold two
    16-weight blocks, so it needs two scale bytes: they are loaded 2 at a time as a (BKB/16, W, R,
    2) tensor (threads along the blocks, like the bytes; a plain (W, R, BKB/8) load would give a
    thread 16 contiguous scales and need a shared-memory shuffle). Blocks past kb_end read as 0."""
    t = tl.arange(0, BKB // 16)[:, None, None, None]
    c = tl.arange(0, 2)[None, None, None, :]
    ptrs = scale_ptr + tl.permute(rows, 2, 0, 1)[:, :, :, None] * stride_sn + kb0 // 8 + 2 * t + c
    sb = tl.load(ptrs, mask=kb0 + 16 * t < kb_end, other=0)
    sb = sb.permute(1, 2, 0, 3).reshape(W, R, BKB // 8)                # (W, R, BKB/8) u8
    if INTERPRET:
        return _e4m3_to_f32(sb, 0)
    return sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _gemv_store(acc, m, offs_n, out_ptr, gs_ptr, bias_ptr, M, N, stride_om,
                HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, INTERPRET: tl.constexpr):
    """Row m of y (or of the fp32 partial sums) from its (W, R, BKB/8) accumulator."""
    y = tl.sum(acc, axis=2) * GEMV_POST                                           # (W, R)
    if not PARTIAL:
        y = _finish(y, gs_ptr, bias_ptr, offs_n, N, HAS_BIAS, INTERPRET)
    if m < M:
        tl.store(out_ptr + m * stride_om + offs_n, y, mask=offs_n < N)


@triton.jit(do_not_specialize=["M"])
def _nvfp4_gemv_kernel(
    # pointers (x2: x viewed as int32 words, one bf16 pair each)
    x2_ptr, packed_ptr, scale_ptr, gs_ptr, bias_ptr, out_ptr,
    # sizes: x (M, K), W (N, K), K2 = K/2 (bytes per row of W, words per row of x2);
    # each program of split pid_k reduces the bytes [pid_k·SPLIT2, +SPLIT2) of its rows
    M, N, K2, SPLIT2,
    # strides (the innermost stride of every tensor is 1)
    stride_x2m, stride_pn, stride_sn, stride_om, stride_os,
    # meta
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,     # PARTIAL: write fp32 partial sums (split-K)
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    W: tl.constexpr,                                   # = num_warps: warp w owns rows w·R .. w·R+R-1
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,     # launched with pdl_launch(): see pdl_start
):
    """y[m, n] = sum_k x[m, k] · W[n, k] on CUDA cores for M <= BM <= 4: BN rows of W per program
    as a (W, R = BN/W) tile (each warp owns R rows and loads its own copy of x), one fp32
    accumulator per row of x (rows 1..3 exist only when BM says so; rows past M are wrapped,
    computed and never stored)."""
    pdl_start(USE_PDL)
    R: tl.constexpr = BN // W                            # rows per warp
    BKB: tl.constexpr = BK // 2                          # bytes of a weight row per step
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + R * tl.arange(0, W)[:, None] + tl.arange(0, R)[None, :]   # (W, R)
    rows = (offs_n % N)[:, :, None]                      # rows past N wrapped, never stored
    kb_start = pid_k * SPLIT2
    kb_end = min(K2, kb_start + SPLIT2)                  # SPLIT2 is a multiple of BKB

    # ---- main loop over the bytes of the rows, BKB at a time; only the last step can be partial,
    # and its mask is constant over each thread's 16 bytes (K2 % 16 == 0), so loads stay vectorized
    acc0 = tl.zeros((W, R, BKB // 8), dtype=tl.float32)
    acc1 = tl.zeros((W, R, BKB // 8), dtype=tl.float32)
    acc2 = tl.zeros((W, R, BKB // 8), dtype=tl.float32)
    acc3 = tl.zeros((W, R, BKB // 8), dtype=tl.float32)
    for kb0 in range(kb_start, kb_end, BKB):
        kb0 = tl.multiple_of(kb0, BKB)
        offs_b = kb0 + tl.arange(0, BKB)[None, None, :]       # bytes past kb_end decode to some
        p = tl.load(packed_ptr + rows * stride_pn + offs_b, mask=offs_b < kb_end)   # finite w; x = 0
        lo, hi = _e2m1x2_to_f32(p, INTERPRET)                         # e2m1·2^-126, (W, R, BKB)
        s = _gemv_scales(scale_ptr, rows, stride_sn, kb0, kb_end, W, R, BKB, INTERPRET)
        acc0 = _gemv_row(acc0, lo, hi, s, x2_ptr, kb0, kb_end, W, R, BKB, INTERPRET)
        if BM > 1:
            acc1 = _gemv_row(acc1, lo, hi, s, x2_ptr + (1 % M) * stride_x2m, kb0, kb_end, W, R, BKB, INTERPRET)
        if BM > 2:
            acc2 = _gemv_row(acc2, lo, hi, s, x2_ptr + (2 % M) * stride_x2m, kb0, kb_end, W, R, BKB, INTERPRET)
            acc3 = _gemv_row(acc3, lo, hi, s, x2_ptr + (3 % M) * stride_x2m, kb0, kb_end, W, R, BKB, INTERPRET)

    # ---- epilogue: rows of y (or fp32 partial sums for the split-K reduce)
    out_ptr += pid_k * stride_os
    _gemv_store(acc0, 0, offs_n, out_ptr, gs_ptr, bias_ptr, M, N, stride_om, HAS_BIAS, PARTIAL, INTERPRET)
    if BM > 1:
        _gemv_store(acc1, 1, offs_n, out_ptr, gs_ptr, bias_ptr, M, N, stride_om, HAS_BIAS, PARTIAL, INTERPRET)
    if BM > 2:
        _gemv_store(acc2, 2, offs_n, out_ptr, gs_ptr, bias_ptr, M, N, stride_om, HAS_BIAS, PARTIAL, INTERPRET)
        _gemv_store(acc3, 3, offs_n, out_ptr, gs_ptr, bias_ptr, M, N, stride_om, HAS_BIAS, PARTIAL, INTERPRET)


# ----------------------------------------------------------------------------------------------
# The fragment kernel (M <= 16): mma.sync on weights decoded straight into the MMA's registers.
#
# One mma.sync.m16n8k16 multiplies a 16 x 16 tile of W (A, four bf16x2 registers per lane) by a
# 16 x 8 tile of xᵀ (B, two registers) into 16 x 8 fp32 (four registers). Lane l = 4g + t holds
# A rows g and g+8 at k-slots 2t, 2t+1 (registers 0, 1) and 2t+8, 2t+9 (registers 2, 3), B column
# (token) g at the same k-slots, and D rows g, g+8 at tokens 2t, 2t+1 (PTX ISA, "Matrix fragments
# for mma.m16n8k16"). A sum over k does not care which physical k a slot stands for, as long as A
# and B agree: so lane t takes the 32 consecutive k of its own 16-byte piece of each row,
# [32t, 32t + 32) of a 128-wide window, in whatever slot order its decode produces. Every load is
# then a plain 16-byte load of the compressed-tensors layout (no re-layout of the weights), and a
# decoded pair goes straight into an A register (no shared memory, no barrier, no layout change).
# The decode (_e2m1x4_to_bf16_ptx, as in the wgmma kernel) turns a word of 4 bytes b0..b3 into the pairs
# (lo b0, lo b1), (hi b0, hi b1), (lo b2, lo b3), (hi b2, hi b3) = physical k (0, 2), (1, 3),
# (4, 6), (5, 7) of the word; the x words (x0, x1), (x2, x3), ... of the same k are re-paired by
# prmt into (x0, x2), (x1, x3), ... once per window (_X_PAIRS_PTX). Per lane and 16-row tile, a
# 128-k window is 2 x 16 bytes of W, 4 scales, 8 mma.sync: 3.4-3.7 SASS instructions per weight
# for any M <= 8 (tokens are the MMA's n = 8; M <= 16 issues a second mma per step), against 4.1
# for the CUDA-core kernel at M = 1 and 6.7 + a shared-memory round trip for the wgmma kernel.

def _decode_mma_ptx(nt: int) -> str:
    """Inline PTX for one lane, one 16-row tile, one 128-k window, nt token tiles of 8.
    Operands: $0.. acc out (4 per token tile); then acc in (4 per tile), W rows g and g+8 (4 words
    each), the scales (4 bf16 = 2 registers: (g, block 2t), (g+8, 2t), (g, 2t+1), (g+8, 2t+1), each
    ·2^119), the re-paired x words (16 per token tile)."""
    acc_in = 4 * nt
    w0, w1, s = 8 * nt, 8 * nt + 4, 8 * nt + 8
    xp = 8 * nt + 10
    lines = [_DECODE_REGS, ".reg .b32 sa0, sa1, sb0, sb1, l01, l23, h01, h23, m01, m23, k01, k23;",
             f"prmt.b32 sa0, ${s}, 0, 0x1010;", f"prmt.b32 sb0, ${s}, 0, 0x3232;",
             f"prmt.b32 sa1, ${s + 1}, 0, 0x1010;", f"prmt.b32 sb1, ${s + 1}, 0, 0x3232;"]
    first = [True] * nt
    for j in range(4):                       # word j of the lane's 16 bytes: k 8j .. 8j+7
        sa, sb = ("sa1", "sb1") if j >= 2 else ("sa0", "sb0")
        lines += _e2m1x4_to_bf16_ptx(f"${w0 + j}", sa, sa, "l01", "l23", "h01", "h23")     # row g
        lines += _e2m1x4_to_bf16_ptx(f"${w1 + j}", sb, sb, "m01", "m23", "k01", "k23")     # row g + 8
        for n in range(nt):
            d = ", ".join(f"${4 * n + i}" for i in range(4))
            for a, xs in (("l01, m01, h01, k01", 0), ("l23, m23, h23, k23", 2)):
                c = ", ".join(f"${acc_in + 4 * n + i}" for i in range(4)) if first[n] else d
                x = f"${xp + 16 * n + 4 * j + xs}, ${xp + 16 * n + 4 * j + xs + 1}"
                lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{d}}}, {{{a}}}, {{{x}}}, {{{c}}};")
                first[n] = False
    return "{\n" + "\n".join(lines) + "\n}"


# x words (x0, x1), (x2, x3), (x4, x5), (x6, x7) -> (x0, x2), (x1, x3), (x4, x6), (x5, x7)
_X_PAIRS_PTX = tl.constexpr("prmt.b32 $0, $4, $5, 0x5410; prmt.b32 $1, $4, $5, 0x7632; "
                            "prmt.b32 $2, $6, $7, 0x5410; prmt.b32 $3, $6, $7, 0x7632;")
_DECODE_MMA_PTX_1 = tl.constexpr(_decode_mma_ptx(1))
_DECODE_MMA_PTX_2 = tl.constexpr(_decode_mma_ptx(2))
# outputs: the accumulators; inputs: accumulators (f32), W words, scales, x words (b32)
_MMA_CONSTRAINTS_1 = tl.constexpr(",".join(["=f"] * 4 + ["f"] * 4 + ["r"] * 26))
_MMA_CONSTRAINTS_2 = tl.constexpr(",".join(["=f"] * 8 + ["f"] * 8 + ["r"] * 42))
SCALE_TO_OPERAND = tl.constexpr(2.0 ** (126 - OPERAND_SHIFT.value))   # scale·2^119 · e2m1·2^-126 = w·scale·2^-7


@triton.jit
def _mma_x(x2_ptr, tok, stride_x2m, word0, M, T, Q, WP, j: tl.constexpr, INTERPRET: tl.constexpr):
    """x words 16t + 4j .. +3 of the window for token `tok` (rows past M read 0): (4, 8, W, 1, 4)
    int32, one copy per warp; re-paired for the B fragment on the GPU (the emulation reads k in
    order)."""
    ptrs = x2_ptr + tok * stride_x2m + word0 + 16 * T + 4 * j + Q + 0 * WP
    x = tl.load(ptrs, mask=tok < M, other=0)
    if not INTERPRET:
        x = tl.inline_asm_elementwise(_X_PAIRS_PTX, "=r,=r,=r,=r,r,r,r,r", [x], dtype=tl.int32,
                                      is_pure=True, pack=4)
    return x


@triton.jit
def _e2m1_f32(code):
    """E2M1 codes (int32 tensor, 0..15) -> float32 values (plain arithmetic: the emulation)."""
    mag = code & 7
    v = tl.where(mag < 2, mag * 0.5, tl.exp2(((mag >> 1) - 1).to(tl.float32)) * (1 + (mag & 1) * 0.5))
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def _mma_emulate_rows(words, s, h: tl.constexpr, xv, W: tl.constexpr, R: tl.constexpr):
    """(8 g, 8 token, W, R): sum over the window of W[row g + 8h of tile (w, r), k] · x[token, k]."""
    J = tl.arange(0, 4)[None, None, None, None, :, None]
    Q = tl.arange(0, 4)[None, None, None, None, :]
    s_lo = tl.sum(tl.where(Q == h, s, 0.0), axis=4)[:, :, :, :, None, None]        # block 2t'
    s_hi = tl.sum(tl.where(Q == 2 + h, s, 0.0), axis=4)[:, :, :, :, None, None]    # block 2t'+1
    codes = (words[:, :, :, :, :, None] >> (4 * tl.arange(0, 8)[None, None, None, None, None, :])) & 15
    wv = tl.reshape(_e2m1_f32(codes) * tl.where(J < 2, s_lo, s_hi), (4, 8, 1, W, R, 32))  # [t', g, ., w, r, k]
    return tl.sum(tl.sum(wv * xv, axis=5), axis=0)


@triton.jit
def _mma_emulate(acc, w0, w1, s, x0, x1, x2, x3, W: tl.constexpr, R: tl.constexpr):
    """What the PTX adds to acc, in plain fp32, for the interpreter: acc[t, g, w, r, 2h + p] +=
    sum over the window of W[row g + 8h of tile (w, r), k] · x[token 2t + p, k]. w0, w1: the words
    of rows g, g + 8 (lane t' holds k 32t' .. 32t' + 31); s: the scales·2^-7 (q = 2·block + h) as
    fp32; x0..x3: the lanes' x words (natural pairs) of tokens g."""
    xw = tl.join(tl.join(x0, x1), tl.join(x2, x3))                   # (4, 8, W, 1, 4q, 2a, 2b)
    xw = tl.permute(xw, 0, 1, 2, 3, 6, 5, 4).reshape(4, 8, W, 1, 16)  # word 4j + q, j = 2b + a
    xv = tl.join((xw << 16).to(tl.float32, bitcast=True), (xw & -65536).to(tl.float32, bitcast=True))
    xv = tl.reshape(xv, (4, 1, 8, W, 1, 32))                          # [t', ., token, w, ., k]
    y = tl.join(_mma_emulate_rows(w0, s, 0, xv, W, R), _mma_emulate_rows(w1, s, 1, xv, W, R))
    y = y.reshape(8, 4, 2, W, R, 2)                                   # [g, t, p, w, r, h]
    return acc + tl.permute(y, 1, 0, 3, 4, 5, 2).reshape(4, 8, W, R, 4)


@triton.jit
def _mma_store(acc, tok, rows, out_ptr, gs_ptr, bias_ptr, M, N, stride_om, part_off,
               HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, INTERPRET: tl.constexpr):
    """acc[t, g, w, r, q] is y[tok, rows] (tok (4, 1, 1, 1, 4), rows (1, 8, W, R, 4)): store it,
    or its fp32 partial sum."""
    mask = (tok < M) & (rows < N)
    if PARTIAL:
        tl.store(out_ptr + part_off + tok * stride_om + rows, acc, mask=mask)
    else:
        tl.store(out_ptr + tok * stride_om + rows, _finish(acc, gs_ptr, bias_ptr, rows, N, HAS_BIAS, INTERPRET),
                 mask=mask)


@triton.jit(do_not_specialize=["M"])
def _nvfp4_mma_kernel(
    # pointers (x2: x as int32 words, a bf16 pair each; p4: packed as int32 words, 8 codes each)
    x2_ptr, p4_ptr, scale_ptr, gs_ptr, bias_ptr, out_ptr,
    # sizes: x (M, K), W (N, K); NWIN = K / 128 windows, program pid_k takes [pid_k·SPLIT, +SPLIT)
    M, N, NWIN, SPLIT,
    # strides (the innermost stride of every tensor is 1)
    stride_x2m, stride_p4n, stride_sn, stride_om, stride_os,
    # meta
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,     # PARTIAL: write fp32 partial sums (split-K)
    W: tl.constexpr,        # = num_warps
    R: tl.constexpr,        # 16-row tiles per warp: a program owns 16·W·R rows of W
    NT: tl.constexpr,       # token tiles of 8: 1 for M <= 8, 2 for M <= 16
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,     # launched with pdl_launch(): see pdl_start
):
    """y[m, n] = sum_k x[m, k] · W[n, k] for M <= 16 with mma.sync on fragments decoded in
    registers (see the comment above). Every tensor is (4, 8, W, R, 4): lane bits 0-1 (t), lane
    bits 2-4 (g), warp, tile, 4 values in the lane: the loads' natural layouts already are the
    fragments, so Triton moves nothing between lanes."""
    pdl_start(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    T = tl.arange(0, 4)[:, None, None, None, None]
    G = tl.arange(0, 8)[None, :, None, None, None]
    WP = tl.arange(0, W)[None, None, :, None, None]
    Q = tl.arange(0, 4)[None, None, None, None, :]
    tile = (pid_n * W + WP) * R + tl.arange(0, R)[None, None, None, :, None]    # (1, 1, W, R, 1)
    row0 = (16 * tile + G) % N                 # rows g and g + 8 of each tile; past N: wrapped,
    row1 = (16 * tile + 8 + G) % N             # never stored
    srow = tl.where(Q % 2 == 0, row0, row1)    # scale q: (g, block 2t), (g+8, 2t), (g, 2t+1), (g+8, 2t+1)
    win_start = pid_k * SPLIT
    win_end = min(NWIN, win_start + SPLIT)

    acc0 = tl.zeros((4, 8, W, R, 4), dtype=tl.float32)        # tokens 0..7
    acc1 = tl.zeros((4, 8, W, R, 4), dtype=tl.float32)        # tokens 8..15 (NT = 2)
    for win in range(win_start, win_end):
        wo = win * 16 + 4 * T + Q                                               # lane t's 4 words
        w0 = tl.load(p4_ptr + row0 * stride_p4n + wo)                           # (4, 8, W, R, 4)
        w1 = tl.load(p4_ptr + row1 * stride_p4n + wo)
        sb = tl.load(scale_ptr + srow * stride_sn + win * 8 + 2 * T + Q // 2)    # E4M3 bits
        if INTERPRET:
            s = _e4m3_to_f32(sb, -OPERAND_SHIFT)                             # scale·2^-7
        else:   # scale·2^119 as bf16 (exact): the decode's fma makes the operand w·scale·2^-7
            s = (sb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * SCALE_TO_OPERAND).to(tl.bfloat16)
        word0 = win * 64
        xa0 = _mma_x(x2_ptr, G, stride_x2m, word0, M, T, Q, WP, 0, INTERPRET)
        xa1 = _mma_x(x2_ptr, G, stride_x2m, word0, M, T, Q, WP, 1, INTERPRET)
        xa2 = _mma_x(x2_ptr, G, stride_x2m, word0, M, T, Q, WP, 2, INTERPRET)
        xa3 = _mma_x(x2_ptr, G, stride_x2m, word0, M, T, Q, WP, 3, INTERPRET)
        if NT == 1:
            if INTERPRET:
                acc0 = _mma_emulate(acc0, w0, w1, s, xa0, xa1, xa2, xa3, W, R)
            else:
                acc0 = tl.inline_asm_elementwise(
                    _DECODE_MMA_PTX_1, _MMA_CONSTRAINTS_1,
                    [acc0, w0, w1, s, xa0, xa1, xa2, xa3], dtype=tl.float32, is_pure=True, pack=4)
        else:
            xb0 = _mma_x(x2_ptr, G + 8, stride_x2m, word0, M, T, Q, WP, 0, INTERPRET)
            xb1 = _mma_x(x2_ptr, G + 8, stride_x2m, word0, M, T, Q, WP, 1, INTERPRET)
            xb2 = _mma_x(x2_ptr, G + 8, stride_x2m, word0, M, T, Q, WP, 2, INTERPRET)
            xb3 = _mma_x(x2_ptr, G + 8, stride_x2m, word0, M, T, Q, WP, 3, INTERPRET)
            if INTERPRET:
                acc0 = _mma_emulate(acc0, w0, w1, s, xa0, xa1, xa2, xa3, W, R)
                acc1 = _mma_emulate(acc1, w0, w1, s, xb0, xb1, xb2, xb3, W, R)
            else:
                acc0, acc1 = tl.inline_asm_elementwise(
                    _DECODE_MMA_PTX_2, _MMA_CONSTRAINTS_2,
                    [acc0, acc1, w0, w1, s, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3],
                    dtype=(tl.float32, tl.float32), is_pure=True, pack=4)

    # ---- epilogue: acc[t, g, w, r, q] is y at token 2t + q % 2 (+ 8 for acc1), row g + 8·(q // 2)
    rows = 16 * tile + G + 8 * (Q // 2)                                         # (1, 8, W, R, 4)
    tok = 2 * T + Q % 2                                                         # (4, 1, 1, 1, 4)
    part_off = pid_k * stride_os
    _mma_store(acc0, tok, rows, out_ptr, gs_ptr, bias_ptr, M, N, stride_om, part_off,
               HAS_BIAS, PARTIAL, INTERPRET)
    if NT == 2:
        _mma_store(acc1, tok + 8, rows, out_ptr, gs_ptr, bias_ptr, M, N, stride_om, part_off,
                   HAS_BIAS, PARTIAL, INTERPRET)


@triton.jit(do_not_specialize=["M"])
def _nvfp4_mm_dx_kernel(
    # pointers
    dy_ptr, packed_ptr, scale_ptr, gs_ptr, out_ptr,
    # sizes: dy (M, N), W (N, K); each program of split pid_s reduces n in [pid_s·N_SPLIT, +N_SPLIT)
    M, N, K, N_SPLIT,
    # strides (the innermost stride of every tensor is 1)
    stride_dym, stride_pn, stride_sn, stride_om, stride_os,
    # meta
    PARTIAL: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,     # launched with pdl_launch(): see pdl_start
):
    """dx[m, k] = sum_n dy[m, n] · W[n, k]; one (BK, BM) tile of dxᵀ per program."""
    pdl_start(USE_PDL)
    # ---- grouped program order over (k-tile, m-tile)
    pid_k, pid_m = _grouped_order(tl.program_id(0), tl.cdiv(K, BK), tl.cdiv(M, BM), GROUP_K)
    pid_s = tl.program_id(1)

    k0 = tl.multiple_of(pid_k * BK, BK)                  # BK divides K: no tail in k
    offs_m = (pid_m * BM + tl.arange(0, BM)) % M         # rows past M wrapped, never stored
    n_start = pid_s * N_SPLIT
    n_iter = tl.cdiv(min(N - n_start, N_SPLIT), BN)      # BN divides N and N_SPLIT

    # ---- main loop over n: the same (BN, BK) weight tile, used transposed
    acc = tl.zeros((BK, BM), dtype=tl.float32)
    for it in range(0, n_iter):
        n0 = tl.multiple_of(n_start + it * BN, BN)
        offs_n = n0 + tl.arange(0, BN)
        w = _load_weight_tile(packed_ptr, scale_ptr, offs_n, k0, stride_pn, stride_sn,
                              BN, BK, INTERPRET)                                   # (BN, BK)
        dyt = tl.load(dy_ptr + offs_m[None, :] * stride_dym + offs_n[:, None])    # (BN, BM)
        if INTERPRET:
            acc = tl.dot(tl.trans(w.to(tl.float32)), dyt.to(tl.float32), acc)
        else:
            acc = tl.dot(tl.trans(w), dyt, acc)

    # ---- epilogue: dxᵀ tile -> dx (or an fp32 partial sum)
    offs_k = k0 + tl.arange(0, BK)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask = (offs_k < K)[:, None] & (offs_m < M)[None, :]
    if PARTIAL:
        ptrs = out_ptr + pid_s * stride_os + offs_m[None, :] * stride_om + offs_k[:, None]
        tl.store(ptrs, acc, mask=mask)
    else:
        y = _finish(acc, gs_ptr, gs_ptr, offs_k[:, None], K, False, INTERPRET)
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_k[:, None], y, mask=mask)


@triton.jit
def _splitk_reduce_kernel(part_ptr, gs_ptr, bias_ptr, out_ptr, numel, C, SPLIT,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
                          USE_PDL: tl.constexpr):
    """out (R, C) bf16 = sum_s part[s] (R, C) fp32 · 2^7/global_scale (+ bias (C,))."""
    pdl_start(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _finish(acc, gs_ptr, bias_ptr, offs % C, C, HAS_BIAS, INTERPRET), mask=mask)


@triton.jit
def _nvfp4_dequant_kernel(packed_ptr, scale_ptr, gs_ptr, out_ptr, N, K, stride_pn, stride_sn,
                          BN: tl.constexpr, BK: tl.constexpr, INTERPRET: tl.constexpr,
                          USE_PDL: tl.constexpr):
    """W (N, K) bf16 = e2m1 · scale / global_scale, one (BN, BK) tile per program (BK divides K)."""
    pdl_start(USE_PDL)
    pid_n = tl.program_id(0)
    k0 = tl.multiple_of(tl.program_id(1) * BK, BK)
    offs_n = (pid_n * BN + tl.arange(0, BN)) % N
    w = _load_weight_tile(packed_ptr, scale_ptr, offs_n, k0, stride_pn, stride_sn, BN, BK, INTERPRET)
    w = w.to(tl.float32) * (OPERAND_POST / tl.load(gs_ptr))
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = k0 + tl.arange(0, BK)
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], _to_bf16(w, INTERPRET),
             mask=(offs_n < N)[:, None])


# ----------------------------------------------------------------------------------------------
# tile configurations

@dataclass(frozen=True)
class TileConfig:
    """One launch shape. bm/bn/bk: tile sizes along M, N, K; split: programs along the reduction
    dim (0 = choose from the problem size); group: tiles swept together for L2 reuse; swap: the
    forward computes (W·xᵀ)ᵀ with W from registers (small M) instead of x·Wᵀ (medium M)."""
    bm: int
    bn: int
    bk: int
    warps: int = 4
    stages: int = 4
    split: int = 0
    group: int = 8
    swap: bool = True

    def __post_init__(self):
        for field in ("bm", "bn", "bk"):
            v = getattr(self, field)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TileConfig.{field} must be a power of two >= 16, got {v}")
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"TileConfig.warps must be 1, 2, 4, 8 or 16, got {self.warps}")
        if self.stages < 1 or self.split < 0 or self.group < 1:
            raise ValueError(f"TileConfig: stages >= 1, split >= 0, group >= 1 needed, got {self}")


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of the CUDA-core kernel (M <= GEMV_MAX_M). bn: weight rows per program (bn /
    warps per warp); bk: k per loop step (bk/2 bytes of each row: 16 per thread, in steps of 512
    per warp); split: programs along K (0 = choose: split until ~2 programs per SM exist)."""
    bn: int = 32
    bk: int = 1024
    warps: int = 4
    stages: int = 1
    split: int = 0

    def __post_init__(self):
        if self.bn < 1 or self.bn & (self.bn - 1) or self.bk < 32 or self.bk & (self.bk - 1):
            raise ValueError(f"GemvConfig.bn/bk must be powers of two (bk >= 32), got {self}")
        if self.warps not in (1, 2, 4, 8, 16) or self.bn % self.warps or self.stages < 1 or self.split < 0:
            raise ValueError(f"GemvConfig: warps in 1..16 (power of two) dividing bn, stages >= 1, "
                             f"split >= 0, got {self}")


@dataclass(frozen=True)
class MmaConfig:
    """Launch shape of the fragment kernel (M <= 16, K a multiple of 128). tiles: 16-row tiles per
    warp (a program owns 16·warps·tiles rows); split: programs along K (0 = choose: split until
    ~4 programs per SM exist)."""
    warps: int = 4
    tiles: int = 1
    split: int = 0

    def __post_init__(self):
        if self.warps not in (1, 2, 4, 8) or self.tiles not in (1, 2, 4, 8) or self.split < 0:
            raise ValueError(f"MmaConfig: warps and tiles in 1, 2, 4, 8, split >= 0, got {self}")


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _fit(block: int, n: int) -> int:
    """The largest power of two <= block that divides n (n is a multiple of 16): no tail tiles."""
    while n % block:
        block //= 2
    return block


def _split(split: int, tiles: int, red: int, block: int, programs: int):
    """(split, chunk): programs along a reduction of length red, each reducing chunk (a multiple of
    block). split = 0 chooses: double it until tiles·split >= programs or chunks get under 4 blocks."""
    if not split:
        split = 1
        while tiles * split < programs and red >= block * split * 4:
            split *= 2
    chunk = triton.cdiv(triton.cdiv(red, split), block) * block
    return triton.cdiv(red, chunk), chunk


def _partials(split: int, out):
    """Where a split launch writes: fp32 partial sums (split, *out.shape), or out if split is 1."""
    return torch.empty((split, *out.shape), device=out.device, dtype=torch.float32) if split > 1 else out


# 64 < M < 512: x·Wᵀ, so the decoded W is stored once into shared memory as the MMA's B
# operand; 128 x 128 tiles read x from L2 N/128 times (the swapped 128 x 64 tile: N/64 times)
MEDIUM_CONFIG = TileConfig(bm=128, bn=128, bk=64, warps=8, stages=4, swap=False)


def fwd_config(M: int, N: int, K: int):
    """Launch shape for y = x·Wᵀ: the sweep winners on an H100 (bench/NOTES.md)."""
    if M <= GEMV_MAX_M:          # CUDA cores; the fragment kernel wins from M = 3 (NOTES.md v7)
        # 8 rows per thread at M = 1 (x's decode amortized, 96 registers); at M = 2 4 rows (124
        # registers); a narrow weight (N <= 8192: qkv, o, down) has few programs, so it reads
        # 1 KB of each row per step instead of 512 B to keep more bytes in flight (NOTES.md v6)
        if M == 2:
            return GemvConfig(bn=16, bk=1024)
        return GemvConfig(bn=16, bk=2048) if N <= 8192 else GemvConfig(bn=32, bk=1024)
    if M <= FRAGMENT_MAX_M and K % 128 == 0:   # mma.sync on fragments decoded in registers
        return MmaConfig()
    if M <= 16:
        return TileConfig(bm=16, bn=64, bk=128, warps=4, stages=4)
    if M <= 32:
        return TileConfig(bm=32, bn=64, bk=128, warps=4, stages=4)
    if M <= 64:
        return TileConfig(bm=64, bn=128, bk=128, warps=8, stages=3)
    return MEDIUM_CONFIG


def dx_config(M: int, N: int, K: int) -> TileConfig:
    """Launch shape for dx = dy·W: the sweep winners on an H100 (bench/NOTES.md)."""
    if M <= 64:
        return TileConfig(bm=max(16, triton.next_power_of_2(M)), bn=64, bk=128, warps=4, stages=4)
    return TileConfig(bm=128, bn=64, bk=128, warps=8, stages=4)


def use_dequant(M: int, N: int, K: int) -> bool:
    """Large M is compute-bound and the fused kernel reaches only ~45% of cuBLAS there, while
    dequantizing W once costs one pass over N·K·2.56 bytes: from M = 512 on (M = 128 for weights
    under 20M elements, whose fused launch has few tiles: 7B qkv and o) W is dequantized to bf16
    and cuBLAS multiplies. K must be a multiple of 64 (every real projection is)."""
    if K % MIN_RED:
        return False
    return M >= DEQUANT_MIN_M or (M >= 128 and N * K <= 20_000_000)


# ----------------------------------------------------------------------------------------------
# wrappers

def _check_weight(packed, scale, global_scale, device):
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8 (two E2M1 codes per byte), got {packed.dtype}")
    if scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"scale must be float8_e4m3fn, got {scale.dtype}")
    if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
        raise TypeError(f"global_scale must be a float32 tensor of one element, got "
                        f"{global_scale.dtype} {tuple(global_scale.shape)}")
    if packed.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"packed and scale must be 2-D, got {tuple(packed.shape)}, {tuple(scale.shape)}")
    N, K = packed.shape[0], packed.shape[1] * 2
    if N % 16 or K % 16:
        raise ValueError(f"N and K must be multiples of 16, got N={N}, K={K}")
    if tuple(scale.shape) != (N, K // BLOCK):
        raise ValueError(f"scale must have shape (N, K/16) = {(N, K // BLOCK)}, got {tuple(scale.shape)}")
    for name, t in (("packed", packed), ("scale", scale), ("global_scale", global_scale)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the activations on {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    return N, K


def _check_act(name, t, cols):
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (M, {cols}), got shape {tuple(t.shape)}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be bfloat16, got {t.dtype}")
    if t.shape[1] != cols:
        raise ValueError(f"{name} has {t.shape[1]} columns, the weight needs {cols}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _pad(t, dim, mult):
    """Zero-pad t along dim to a multiple of mult (zero codes and zero scales decode to 0)."""
    extra = -t.shape[dim] % mult
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
    return torch.nn.functional.pad(t, pad)


def _dequantize_bf16(packed, scale, global_scale):
    """W (N, K) bf16 in one pass (K must be a multiple of 64): the large-M path feeds it to cuBLAS."""
    N, K = packed.shape[0], packed.shape[1] * 2
    out = torch.empty((N, K), device=packed.device, dtype=torch.bfloat16)
    BN, BK = 64, _fit(128, K)
    sb = scale.view(torch.uint8)
    _nvfp4_dequant_kernel[(triton.cdiv(N, BN), K // BK)](
        packed, sb, global_scale, out, N, K, packed.stride(0), sb.stride(0),
        BN=BN, BK=BK, INTERPRET=_interpreting(), num_warps=4, **pdl_launch(packed.device))
    return out


def _reduce(part, global_scale, bias, out):
    """out = sum of the partials (scaled, + bias); nothing to do if the launch wrote out itself."""
    if part is out:
        return out
    numel = out.numel()
    BLOCK = 1024
    _splitk_reduce_kernel[(triton.cdiv(numel, BLOCK),)](
        part, global_scale, bias if bias is not None else out, out, numel, out.shape[1],
        part.shape[0], HAS_BIAS=bias is not None, BLOCK=BLOCK, INTERPRET=_interpreting(), **pdl_launch(out.device))
    return out


def _matmul(x, packed, scale, global_scale, bias, cfg):
    scale = scale.view(torch.uint8)          # E4M3 bits; decoded in-kernel
    if x.shape[1] % MIN_RED:               # odd K: pad the reduction (a copy; model shapes never)
        x, packed, scale = _pad(x, 1, MIN_RED), _pad(packed, 1, MIN_RED // 2), _pad(scale, 1, MIN_RED // 16)
    M, K = x.shape
    N = packed.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=torch.bfloat16)
    if M == 0:
        return out
    cfg = replace(cfg, bk=_fit(max(cfg.bk, MIN_RED), K))
    tiles = triton.cdiv(N, cfg.bn) * triton.cdiv(M, cfg.bm)
    # swapped (small M, memory-bound): ~4 programs per SM; not swapped (one tile is ~8x more MMA
    # work, and 2 programs fit on an SM): ~1.5 per SM, so the fp32 partials stay small
    sms = _num_sms(x.device)
    split, k_split = _split(cfg.split, tiles, K, cfg.bk, 4 * sms if cfg.swap else 3 * sms // 2)
    part = _partials(split, out)
    _nvfp4_mm_kernel[(tiles, split)](
        x, packed, scale, global_scale, bias if bias is not None else out, part,
        M, N, K, k_split,
        x.stride(0), packed.stride(0), scale.stride(0), N, M * N,
        HAS_BIAS=bias is not None, PARTIAL=split > 1,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP=cfg.group, SWAP_AB=cfg.swap,
        INTERPRET=_interpreting(), num_warps=cfg.warps, num_stages=cfg.stages, **pdl_launch(x.device))
    return _reduce(part, global_scale, bias, out)


def _gemv(x, packed, scale, global_scale, bias, cfg):
    """y = x·Wᵀ (+bias) on CUDA cores for M <= 4 (K a multiple of 16; padded to 32 if odd)."""
    M, K = x.shape
    N = packed.shape[0]
    if M > 4:
        raise ValueError(f"the CUDA-core kernel takes at most 4 rows of x, got {M}")
    out = torch.empty((M, N), device=x.device, dtype=torch.bfloat16)
    if M == 0:
        return out
    if K % 32:                               # a weight row must be whole 16-byte loads
        x, packed, scale = _pad(x, 1, 32), _pad(packed, 1, 16), _pad(scale.view(torch.uint8), 1, 2)
        K = x.shape[1]
    bk = min(cfg.bk, triton.next_power_of_2(K))
    tiles = triton.cdiv(N, cfg.bn)
    split, k_split = _split(cfg.split, tiles, K, bk, 2 * _num_sms(x.device))
    part = _partials(split, out)
    x2 = x.view(torch.int32)                 # (M, K/2): one bf16 pair per word
    sb = scale.view(torch.uint8)             # E4M3 bits; decoded in-kernel
    _nvfp4_gemv_kernel[(tiles, split)](
        x2, packed, sb, global_scale, bias if bias is not None else out, part,
        M, N, K // 2, k_split // 2,
        x2.stride(0), packed.stride(0), sb.stride(0), N, M * N,
        HAS_BIAS=bias is not None, PARTIAL=split > 1,
        BM=triton.next_power_of_2(M), BN=cfg.bn, BK=bk, W=cfg.warps, INTERPRET=_interpreting(),
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl_launch(x.device))
    return _reduce(part, global_scale, bias, out)


def _mma(x, packed, scale, global_scale, bias, cfg):
    """y = x·Wᵀ (+bias) with the fragment kernel: M <= 16, K a multiple of 128."""
    M, K = x.shape
    N = packed.shape[0]
    if M > 16 or K % 128:
        raise ValueError(f"the fragment kernel takes M <= 16 and K a multiple of 128, got M={M}, K={K}")
    out = torch.empty((M, N), device=x.device, dtype=torch.bfloat16)
    if M == 0:
        return out
    rows = 16 * cfg.warps * cfg.tiles
    tiles = triton.cdiv(N, rows)
    split, k_split = _split(cfg.split, tiles, K, 128, 4 * _num_sms(x.device))
    part = _partials(split, out)
    x2, p4, sb = x.view(torch.int32), packed.view(torch.int32), scale.view(torch.uint8)
    _nvfp4_mma_kernel[(tiles, split)](
        x2, p4, sb, global_scale, bias if bias is not None else out, part,
        M, N, K // 128, k_split // 128,
        x2.stride(0), p4.stride(0), sb.stride(0), N, M * N,
        HAS_BIAS=bias is not None, PARTIAL=split > 1, W=cfg.warps, R=cfg.tiles, NT=1 if M <= 8 else 2,
        INTERPRET=_interpreting(), num_warps=cfg.warps, num_stages=1, **pdl_launch(x.device))
    return _reduce(part, global_scale, bias, out)


def _matmul_dx(dy, packed, scale, global_scale, cfg):
    K0 = packed.shape[1] * 2
    scale = scale.view(torch.uint8)          # E4M3 bits; decoded in-kernel
    if dy.shape[1] % MIN_RED or K0 % MIN_RED:   # odd shapes: pad N (the reduction) and K
        dx = _matmul_dx(_pad(dy, 1, MIN_RED), _pad(_pad(packed, 0, MIN_RED), 1, MIN_RED // 2),
                        _pad(_pad(scale, 0, MIN_RED), 1, MIN_RED // 16), global_scale, cfg)
        return dx[:, :K0].contiguous()
    M, N = dy.shape
    K = packed.shape[1] * 2
    out = torch.empty((M, K), device=dy.device, dtype=torch.bfloat16)
    if M == 0:
        return out
    cfg = replace(cfg, bk=_fit(max(cfg.bk, MIN_RED), K), bn=_fit(max(cfg.bn, MIN_RED), N))
    tiles = triton.cdiv(K, cfg.bk) * triton.cdiv(M, cfg.bm)
    split, n_split = _split(cfg.split, tiles, N, cfg.bn, 4 * _num_sms(dy.device))
    part = _partials(split, out)
    _nvfp4_mm_dx_kernel[(tiles, split)](
        dy, packed, scale, global_scale, part,
        M, N, K, n_split,
        dy.stride(0), packed.stride(0), scale.stride(0), K, M * K,
        PARTIAL=split > 1,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_K=cfg.group, INTERPRET=_interpreting(),
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl_launch(dy.device))
    return _reduce(part, global_scale, None, out)


def nvfp4_matmul(x, packed, scale, global_scale, bias=None):
    """y (M, N) bf16 = x (M, K) bf16 · dequant(W)ᵀ (+ bias (N,) bf16), fp32 accumulation."""
    N, K = _check_weight(packed, scale, global_scale, x.device)
    _check_act("x", x, K)
    if bias is not None:
        if bias.dtype != torch.bfloat16 or tuple(bias.shape) != (N,) or not bias.is_contiguous():
            raise ValueError(f"bias must be a contiguous bf16 tensor of shape ({N},), got "
                             f"{bias.dtype} {tuple(bias.shape)}")
    if use_dequant(x.shape[0], N, K):
        return torch.nn.functional.linear(x, _dequantize_bf16(packed, scale, global_scale), bias)
    cfg = fwd_config(x.shape[0], N, K)
    if isinstance(cfg, GemvConfig):
        return _gemv(x, packed, scale, global_scale, bias, cfg)
    if isinstance(cfg, MmaConfig):
        return _mma(x, packed, scale, global_scale, bias, cfg)
    return _matmul(x, packed, scale, global_scale, bias, cfg)


def nvfp4_matmul_dx(dy, packed, scale, global_scale):
    """dx (M, K) bf16 = dy (M, N) bf16 · dequant(W), fp32 accumulation (backward of y = x·Wᵀ)."""
    N, K = _check_weight(packed, scale, global_scale, dy.device)
    _check_act("dy", dy, N)
    if use_dequant(dy.shape[0], N, K):
        return dy @ _dequantize_bf16(packed, scale, global_scale)
    return _matmul_dx(dy, packed, scale, global_scale, dx_config(dy.shape[0], N, K))
