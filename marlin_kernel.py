"""Triton FP4 x BF16 matmuls for NVFP4 weights: y = x·Wᵀ (+bias) and dx = dy·W.

Hopper has no FP4 tensor cores, so these kernels read the 4.5-bit weights from memory, turn them
into bf16 (or fp32) in registers and multiply with fp32 accumulation ("Marlin-style" mixed-input
GEMM, written in Triton).

The weight format is the standard compressed-tensors NVFP4 layout, untouched (nvfp4.py owns it):

    packed        uint8          (N, K/2)   two E2M1 codes per byte, even k in the LOW nibble
    scale         float8_e4m3fn  (N, K/16)  one scale per 16 consecutive k of a row
    global_scale  float32        (1,)
    W[n, k] = e2m1(code[n, k]) * scale[n, k // 16] / global_scale

This file is the entry point the rest of the project imports: the float64 reference, the launch
shapes and the routing between kernels, the input checks and the wrappers that allocate and
launch. The kernels live in four files that nothing but this one and their tests import (hence
their underscore names):

    fp4_decode.py       the in-kernel number format: E2M1 / E4M3 bit decoding (PTX and its plain-tl
                        emulation for the interpreter), the epilogue, pdl_start
    small_m_kernels.py  _nvfp4_gemv_kernel (CUDA cores) and _nvfp4_mma_kernel (mma.sync fragments)
    register_a_kernel.py  _wgmma_ring_kernel, _wgmma_ws_kernel (Gluon: wgmma on weights decoded into its A registers)
                        and the permutation of x it reads
    tile_kernels.py     _nvfp4_mm_kernel (wgmma, swapped or not), _nvfp4_mm_dx_kernel,
                        _splitk_reduce_kernel, _nvfp4_dequant_kernel

Weight layout. Every wrapper takes W in the compressed-tensors layout, or with interleaved=True in
nvfp4.interleave's 16 x 128 tiles (K a multiple of 128), which NVFP4Linear holds on CUDA: a warp's
16-byte-per-lane load of 8 rows then reads 512 contiguous bytes instead of 8 scattered pieces
(fp4_decode._tiled_offsets addresses both; the fragment kernel gains 10-25%,
bench/NOTES.md v15). The bits of y do not depend on the layout, except where the register-A
kernel runs (it reads the interleaved layout only, and sums in its own order).

Paths the wrapper chooses from (M = rows of x; tile shapes from an H100 sweep, bench/NOTES.md):
  * M = 1 (batch-1 decode): the CUDA-core kernel, 32 weight rows x 512-1024 k per step, split
    along K until ~8 programs per SM exist (with 1024-k steps: one wave of them, _gemv_split).
  * M <= 16 (decode; K a multiple of 128): the fragment kernel, mma.sync on weights decoded straight
    into its A registers, 64 or 128 weight rows per program.
  * 16 < M <= 1024 (M <= 128 on weights of <= 20M elements: 7B qkv, o; above 512 where its waves
    are >= 80% full), and on the big weights from M = 2 (wide ones, N >= 16384: gate_up) or M = 9
    (down, 32B qkv / o), interleaved, on an H100 with triton 3.6: the register-A wgmma kernel
    (register_a_kernel.py), x permuted first; 7B gate_up M = 64 1.9x cuBLAS, M = 128 1.1x, where
    the tiles below reach 1.26x and 0.79x (bench/NOTES.md v17); 32B gate_up M = 2 3.2x, where the
    fragment kernel reaches 2.8x (v18); M = 1024 0.90-0.99x on 7B gate_up / down, 32B qkv /
    gate_up, where dequantize + cuBLAS reaches 0.77-0.80x (v26).
  * M <= 64 (decode, memory-bound; where the register-A kernel does not run: the plain layout,
    other GPUs or Triton releases, the interpreter): the tile kernel swapped (W·xᵀ, W from
    registers), BM = 16..64 rows of x, 64 weight rows per program, split-K until there are >= 4
    programs per SM.
  * 64 < M < 512: the same kernel not swapped, x·Wᵀ with 128 x 128 tiles (MEDIUM_CONFIG): 0.8-0.9x
    cuBLAS at M = 128 on the big weights (the MMA still waits on each decode: bench/NOTES.md v5).
  * M >= 512 elsewhere (compute-bound; M >= 128 for weights under 20M elements): the tile kernels
    reach ~45% of cuBLAS, so W is dequantized to bf16 once (one pass over the weight, a transient
    bf16 copy) and cuBLAS multiplies: 0.76-0.84x of cuBLAS bf16 at M = 1024, ~0.97x from M = 4096.
Split-K: each split writes fp32 partial sums; on the CUDA-core kernel, the fragment kernel at
M <= 4 (M <= 8 where a step loads several windows: fragment_sums_in_kernel) and the swapped tiles
the last split of each output tile to finish (an atomic count per tile, fp4_decode._last_split)
sums them in order with scale, bias and cast (deterministic, one launch); elsewhere (the fragment
kernel's other launches, medium tiles, the register-A kernel) _splitk_reduce_kernel does, which
measured faster there (bench/NOTES.md v9, v10, v30, v33 item 4).
dx = dy·W takes the tile kernel, or the dequantized weight where use_dequant says so.
Measured on an H100 (fwd, bench/NOTES.md v9): M = 1 1.6-3.4x over cuBLAS bf16 (1.1-2.6 TB/s of
NVFP4 weights), M = 2 1.2-2.5x, M = 4..8 1.4-2.2x, M = 16 1.0-1.9x; M = 64 / 128 (v17)
0.91-1.91x / 0.79-1.32x (7B o the lowest, 7B gate_up and 32B down the highest).

Every kernel starts with pdl_start (the register-A one with the same two instructions) and is
launched with pdl_launch's keywords: programmatic dependent launch on Hopper, switched off by
setting marlin_kernel.PDL = False (the benchmarks do).
fused_ops.py, paged_attention.py and lora_kernels.py use the same pair for their own kernels.

What it leaves out: activation quantization (this is W4A16), a re-layout of the bits inside a byte
(the fragment kernel gets its register-only decode from a k-permutation instead), a
warp-specialized schedule. q/k/v and gate/up arrive as one weight each
(stacked_linear.StackedLinear).
Test: pytest tests/test_marlin_kernel.py (routing, input checks, end to end on every route) and the
kernels' own tests/test_fp4_decode.py, test_small_m_kernels.py, test_tile_kernels.py (CPU:
interpreter, tiny shapes; GPU: real shapes); benchmark: python bench/kernel.py.
"""
import functools
import os
from dataclasses import dataclass, replace

import torch
import triton

import register_a_dx as rad
import register_a_kernel as rak
from fp4_decode import pdl_start  # noqa: F401 (public here: fused_ops, paged_attention, lora_kernels)
from small_m_kernels import _nvfp4_gemv_kernel, _nvfp4_mma_kernel
from tile_kernels import (_nvfp4_dequant_kernel, _nvfp4_mm_dx_kernel, _nvfp4_mm_kernel, _splitk_reduce_kernel,
                          _splitk_reduce_lora_kernel)

# ----------------------------------------------------------------------------------------------
# constants

BLOCK = 16               # NVFP4 scale block along K
MIN_RED = 64             # reduction tiles are >= 64 wide (16-wide ones decoded wrong on the H100);
                         # a reduction dim that is not a multiple of 64 is zero-padded
DEQUANT_MIN_M = 512      # from this M on: dequantize W to bf16 once, then cuBLAS (use_dequant)
GEMV_MAX_M = 1           # up to this M: the CUDA-core kernel (no tensor cores; it takes <= 4 rows)
GEMV_WAVE = 5            # CUDA-core GEMV programs an SM holds at once (96 registers x 128 threads) ...
GEMV_ONE_WAVE = True     # ... and with 1024-k steps its split fills one such wave (_gemv_split)
FRAGMENT_MAX_M = 16      # up to this M: the fragment kernel (mma.sync, K % 128 == 0); else tiles
FRAGMENT_REDUCE_MAX_M = 4  # to this M the fragment kernel's last split sums the partials (_mma) ...
PAIR_REDUCE_MAX_M = 8    # ... and to this M where a step loads several windows; else the reduce kernel
PAIR_WINDOWS = 4         # fragment programs of <= this many 128-k windows (<= 2x at M <= 4) load two
                         # windows a step (_mma_launch; 0 with LONG_RUN_WINDOWS = 999: one everywhere) ...
LONG_RUN_WINDOWS = 12    # ... and at M 5..8 programs of >= this many are cut to LONG_RUN_CUT, two a step
LONG_RUN_CUT = 8
WGMMA_DECODE_WAVE = 0.75 # register-A split-K at <= 16 tokens: up to this share of a wave (_wgmma_split)
WGMMA_FIT_STAGES = True  # fewer ring stages where that fits a register-A launch in one wave (_fit_stages)
LONG_RING_WINDOWS = 32   # one-wave register-A programs of >= this many windows take a 4-stage ring
                         # where it costs no programs an SM (_deeper_ring; 999: never)
WIDE_N = 16384           # a wide weight (gate_up): N >= this (launch shapes and routes differ)
WGMMA_MIN_M = 16         # above this M (and where the route holds, in place of the two above) ...
WGMMA_SMALL = True       # ... and on the big weights (> WGMMA_NARROW elements) above GEMV_MAX_M where
WGMMA_SMALL_MIN_M = 8    # wide, else above this M (down, 32B qkv / o) (bench/NOTES.md v18) ...
WGMMA_MAX_M = 1024       # ... to this M: the register-A wgmma kernel (sm_90) ...
WGMMA_FILL_M = 512       # ... above this M only where its programs fill their waves to WAVE_FILL ...
WAVE_FILL = 0.6         # (v27: 7B down, 32B qkv at 64% full 0.76-0.79x of cuBLAS, dequantize 0.72-0.73x)
WGMMA_NARROW_MAX_M = 128 # ... and on weights of <= 20M elements (7B qkv, o) to this M and above
WGMMA_NARROW = 20_000_000  # WGMMA_FILL_M (dequantize + cuBLAS wins between, wgmma_rows)
SMEM_PER_SM = 228 * 1024 # H100 shared memory per SM (1 KB of it reserved per program)
GLUON_TRITON = "3.6."    # the Triton release register_a_kernel.py's Gluon is written for
WS_MIN_BT = 64           # from this many tokens a program the register-A kernel is the warp-specialized one
TAIL_BT = 64             # tokens a program in the small tiles of a part-empty last wave (_wgmma_launches) ...
TAIL_MIN_WINDOWS = 32    # ... where it does not split into pieces of >= this many 128-k windows
DX_WGMMA_MIN_M = 64      # above this M, on the big weights, dx = dy·W by the register-A kernel on Wᵀ ...
DX_WGMMA_FULL_M = 256    # ... to this M, and to DX_WGMMA_MAX_M where its programs fill their waves
DX_WGMMA_MAX_M = 512     # to DX_WAVE_FILL (dx_wgmma_rows)
DX_WAVE_FILL = 0.8
DX_WIDE = 64_000_000     # above DX_WGMMA_FULL_M only on weights of more elements (dx_route)


def interpreting() -> bool:
    """Do Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)? Then inline PTX cannot run
    and bf16 tl.dot is wrong, so every kernel of the project takes its plain-tl / fp32-dot branch."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Programmatic dependent launch (Hopper and later). A kernel launched with launch_pdl=True may be
# scheduled while the kernel before it in the stream is still running; it calls gdc_wait()
# (griddepcontrol.wait: the previous grid has finished and its writes are visible) before it reads
# anything an earlier kernel wrote. Results are unchanged; the launch latency and the prologue
# (address math, loads of the constant weights) overlap the previous kernel's tail, which matters
# in a decode step of ~500 small kernels. Every kernel in such a chain must wait before reading:
# a kernel that skipped the wait could overtake its predecessor.
# pdl_start, the device side, is in fp4_decode.py.
#
# When is the next kernel scheduled? Every kernel releases it right after its own wait, except the
# CUDA-core GEMV (M = 1) that is not the gate/up one: it releases after its main loop
# (GEMV_LATE_RELEASE). The paged decode kernel comes right after the qkv GEMV; scheduled early, its
# programs waited on the SMs through the whole GEMV and cost the decode step ~3% (H100, 7B batch 1,
# same run: 369.0 / 367.0 tok/s against 379.9 / 380.1 released late; bench/NOTES.md v21). The down
# GEMV after gate/up is better scheduled early (-0.5% late).
PDL = True       # bench/rollout.py and bench/kernel.py switch it off to measure what it buys
# Loads of what the kernel before does not write, issued before pdl_start's wait (paged attention's
# first cache tile, RMSNorm's weight and residual; see fp4_decode.pdl_start): bench/ab.py's early=
EARLY_LOADS = True
GEMV_LATE_RELEASE = True   # bench/ab.py's late= switch
FRAGMENT_LATE_RELEASE = 0  # the fragment kernel's release after its loop too: 0 never, 1 always, 2 where no
                           # reduce kernel follows it (the next kernel is then a layer op);
                           # bench/ab.py's frag_late=. H100, 2: 7B decode batch 2 / 8 +0.8 / +0.9%, 32B
                           # -0.6..+1.3%; back to back alone 7B qkv M <= 8 10-17% slower, 7B o 7-10%,
                           # with a kernel between even (NOTES v32 item 1)
REDUCE_FOLDS_LORA = True   # see reduce_folds_lora (bench/ab.py's lora_reduce= switch)


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    return torch.cuda.get_device_capability(index)


def pdl_launch(device) -> dict:
    """Launch keywords for a kernel that starts with pdl_start(USE_PDL): programmatic dependent
    launch where the device has it (Hopper and later, not under the interpreter)."""
    on = PDL and device.type == "cuda" and not interpreting() and _capability(device.index or 0)[0] >= 9
    return dict(USE_PDL=on, launch_pdl=on)


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
    warps per warp); bk: k per loop step (bk/2 bytes of each row, 16 per thread); split: programs
    along K (0 = choose: _gemv_split)."""
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
    warp (a program owns 16·warps·tiles rows); split: programs along K (0 = choose: _mma_launch);
    windows: 128-k windows a loop step loads before it decodes any (0 = choose with the split; 1
    where split is given)."""
    warps: int = 4
    tiles: int = 1
    split: int = 0
    windows: int = 0

    def __post_init__(self):
        if self.warps not in (1, 2, 4, 8) or self.tiles not in (1, 2, 4, 8) or self.split < 0 \
                or self.windows not in (0, 1, 2, 4):
            raise ValueError(f"MmaConfig: warps and tiles in 1, 2, 4, 8, split >= 0, windows in 0, 1, 2, 4, "
                             f"got {self}")


@dataclass(frozen=True)
class WgmmaConfig:
    """Launch shape of the register-A wgmma kernel (register_a_kernel.py). bt: tokens per program
    (wgmma's N: 8 .. 256, a power of two); bn: weight rows per program (64 per warpgroup of 4 warps;
    the warp-specialized kernel runs 8 warps as two consumer warpgroups of bn/2 rows each); stages:
    the ring (the launch may take fewer or more: _fit_stages, _deeper_ring); split: programs along
    K (0 = choose: _wgmma_split)."""
    bt: int
    bn: int = 64
    warps: int = 4
    stages: int = 3
    split: int = 0

    def __post_init__(self):
        if self.bt not in (8, 16, 32, 64, 128, 256) or self.warps not in (4, 8) or self.bn % (16 * self.warps) \
                or self.bn & (self.bn - 1) or self.stages < 2 or self.split < 0 or (self.bt == 256 and self.warps < 8) \
                or (warp_specialized(self) and self.bn != 16 * self.warps):
            raise ValueError(f"WgmmaConfig: bt in 8..256 (power of two; 256 takes 8 warps: 128 accumulators a "
                             f"thread), 4 or 8 warps, bn a power-of-two multiple of 16·warps (from bt = "
                             f"{WS_MIN_BT}, warp-specialized: 64 rows a warpgroup), stages >= 2, split >= 0, "
                             f"got {self}")


def warp_specialized(cfg: WgmmaConfig) -> bool:
    """Does the register-A launch cfg run the warp-specialized kernel (rak._wgmma_ws_kernel), or
    the cp.async ring kernel? By tokens a program: WS_MIN_BT and up (NOTES v25)."""
    return cfg.bt >= WS_MIN_BT


TAIL_CONFIG = WgmmaConfig(bt=TAIL_BT)


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _fit(block: int, n: int) -> int:
    """The largest power of two <= block that divides n (n is a multiple of 16): no tail tiles."""
    while n % block:
        block //= 2
    return block


def _split(split: int, tiles: int, red: int, block: int, programs: int, min_blocks: int = 4):
    """(split, chunk): programs along a reduction of length red, each reducing chunk (a multiple of
    block). split = 0 chooses: double it until tiles·split >= programs or chunks would get under
    min_blocks blocks."""
    if not split:
        split = 1
        while tiles * split < programs and red >= block * split * min_blocks:
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
    if M <= GEMV_MAX_M:          # CUDA cores; on interleaved weights the fragment kernel wins from
        # M = 2 (NOTES.md v15). 8 rows per thread (x's decode amortized, 96 registers); a step
        # covers 512 k (256 B of each row) where K is not a multiple of 1024 (7B: 3584, 18944), so
        # that no step runs half masked (NOTES.md v11)
        return GemvConfig(bn=32, bk=1024 if K % 1024 == 0 else 512)
    if fragment_rows(M, K):      # mma.sync on fragments decoded in registers
        # 128 weight rows per program for the wide weights (gate_up: 8 warps, or 4 warps of two
        # tiles when each warp also runs two token tiles) and at M <= 4; else 64 (NOTES.md v15)
        wide = N >= WIDE_N
        if M <= 4 or (wide and M <= 8):
            return MmaConfig(warps=8)
        return MmaConfig(tiles=2) if wide else MmaConfig()
    if M <= 16:
        return TileConfig(bm=16, bn=64, bk=128, warps=4, stages=4)
    if M <= 32:
        return TileConfig(bm=32, bn=64, bk=128, warps=4, stages=4)
    if M <= 64:
        return TileConfig(bm=64, bn=128, bk=128, warps=8, stages=3)
    return MEDIUM_CONFIG


def wgmma_config(M: int) -> WgmmaConfig:
    """Launch shape of the register-A kernel: the H100 winners of bench/NOTES.md v16 (64 weight
    rows, 4 warps, 3 stages; tokens per program by M), v18 (M <= 16: 8 or 16 tokens, 4 stages) and
    v26 (M > 128: 256 tokens and 128 rows a program, two consumer warpgroups)."""
    if M <= 16:
        return WgmmaConfig(bt=8 if M <= 8 else 16, stages=4)
    if M > 128:
        return WgmmaConfig(bt=256, bn=128, warps=8)
    return WgmmaConfig(bt=32 if M <= 32 else 64 if M <= 64 else 128)


def dx_config(M: int, N: int, K: int) -> TileConfig:
    """Launch shape for dx = dy·W: the sweep winners on an H100 (bench/NOTES.md)."""
    if M <= 64:
        return TileConfig(bm=max(16, triton.next_power_of_2(M)), bn=64, bk=128, warps=4, stages=4)
    return TileConfig(bm=128, bn=64, bk=128, warps=8, stages=4)


def use_dequant(M: int, N: int, K: int) -> bool:
    """Large M is compute-bound and the tile kernels reach only ~45% of cuBLAS there, while
    dequantizing W once costs one pass over N·K·2.56 bytes: from M = 512 on (M = 128 for weights
    under 20M elements, whose fused launch has few tiles: 7B qkv and o) W is dequantized to bf16
    and cuBLAS multiplies, where the register-A kernel does not run (wgmma_rows, checked first).
    K must be a multiple of 64 (every real projection is)."""
    if K % MIN_RED:
        return False
    return M >= DEQUANT_MIN_M or (M >= 128 and N * K <= 20_000_000)


# ----------------------------------------------------------------------------------------------
# wrappers

def _check_weight(packed, scale, global_scale, device, interleaved=False):
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
    if interleaved and K % 128:
        raise ValueError(f"an interleaved weight needs K a multiple of 128, got K={K}")
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


def _dequantize_bf16(packed, scale, global_scale, il=False):
    """W (N, K) bf16 in one pass (K must be a multiple of 64): the large-M path feeds it to cuBLAS.
    il: W interleaved (nvfp4.interleave), as in every wrapper below."""
    N, K = packed.shape[0], packed.shape[1] * 2
    out = torch.empty((N, K), device=packed.device, dtype=torch.bfloat16)
    BN, BK = 64, _fit(128, K)
    sb = scale.view(torch.uint8)
    _nvfp4_dequant_kernel[(triton.cdiv(N, BN), K // BK)](
        packed, sb, global_scale, out, N, K, packed.stride(0), sb.stride(0),
        BN=BN, BK=BK, IL=il, INTERPRET=interpreting(), num_warps=4, **pdl_launch(packed.device))
    return out


REDUCE_IN_KERNEL = True   # split launches sum their own partials where it pays (tests and A/Bs turn it off)
SPLIT_COUNTS = 1 << 16    # tiles one split launch may have (GEMV: N <= 2^20 rows; fragment: 2^22)
_SPLIT_COUNTS = {}        # (device, stream) -> int32 zeros, see _split_counts


def _split_counts(device, tiles):
    """SPLIT_COUNTS int32 zeros for a kernel's in-kernel split-K reduce (each launch leaves them
    zero). One buffer per CUDA stream, as torch keeps cuBLAS workspaces: the launches of one stream
    run one after another, and two streams never share counts. Never replaced or freed, since
    captured CUDA graphs hold its address (the first use on a capture stream allocates it inside
    the capture: a memset node of that graph)."""
    if tiles > SPLIT_COUNTS:
        raise ValueError(f"a split launch of {tiles} tiles; the in-kernel reduce counts {SPLIT_COUNTS}")
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    if key not in _SPLIT_COUNTS:
        _SPLIT_COUNTS[key] = torch.zeros(SPLIT_COUNTS, dtype=torch.int32, device=device)
    return _SPLIT_COUNTS[key]


def _split_targets(out, tiles, split, reduce):
    """What a kernel that can sum its own split-K partials takes after them: (y, counts) (out itself
    where unused) and its PARTIAL / REDUCE / NSPLIT constexprs."""
    counts = _split_counts(out.device, tiles) if reduce else out
    return (out, counts), dict(PARTIAL=split > 1, REDUCE=reduce, NSPLIT=split if reduce else 1)


def _reduce(part, global_scale, bias, out, lora=None):
    """out = sum of the partials (scaled, + bias); nothing to do if the launch wrote out itself.
    lora = (h, B, s), h (M, R) bf16: also out += s·h·Bᵀ (tile_kernels._splitk_reduce_lora_kernel)."""
    if part is out:
        return out
    if lora is not None:
        h, B, s = lora
        # 16 x 128 tiles: as many programs as the flat reduce has blocks of 1024 (H100, 7B GRPO batch
        # with adapters: 13,967 / 13,989 tok/s, against 13,797 / 13,740 at 32 x 64 and 13,614 / 13,732
        # at 16 x 64; 64 x 64 lost to the addmm, bench/NOTES.md v21)
        (M, N), BM, BN = out.shape, 16, 128
        _splitk_reduce_lora_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
            part, global_scale, bias if bias is not None else out, out, h, B, s, M, N, h.shape[1], part.shape[0],
            HAS_BIAS=bias is not None, BM=BM, BN=BN, LR=max(16, triton.next_power_of_2(h.shape[1])),
            INTERPRET=interpreting(), **pdl_launch(out.device))
        return out
    numel = out.numel()
    BLOCK = 1024
    _splitk_reduce_kernel[(triton.cdiv(numel, BLOCK),)](
        part, global_scale, bias if bias is not None else out, out, numel, out.shape[1],
        part.shape[0], HAS_BIAS=bias is not None, BLOCK=BLOCK, INTERPRET=interpreting(), **pdl_launch(out.device))
    return out


def _lora_args(lora, out, split, reduce):
    """A launch's LoRA arguments: (hp, B, s), R and the constexprs LORA, LSPLIT, LR (dummies without
    lora). The update folds in only where the kernel finishes its own tiles (one pass, or the split
    sum in-kernel): else a clear error."""
    if lora is not None and split > 1 and not reduce:
        raise ValueError("the LoRA update folds into a kernel only where it sums its own split-K partials "
                         "(REDUCE_IN_KERNEL; see folds_lora)")
    hp, lb, ls = lora if lora is not None else (out, out, 0.0)
    R = lb.shape[1] if lora is not None else 1
    return (hp, lb, ls), R, dict(LORA=lora is not None, LSPLIT=hp.shape[0] if lora is not None else 1,
                                 LR=max(16, triton.next_power_of_2(R)))


def _matmul(x, packed, scale, global_scale, bias, cfg, lora=None, il=False):
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
    # the swapped tiles sum their own split-K partials (H100, 7B batch-16 decode +4.1%, bench/NOTES.md
    # v10); the 128 x 128 medium tiles do not (their last split would read SPLIT x 64 KB alone: GRPO
    # batch -7.4%, v9)
    reduce = split > 1 and cfg.swap and REDUCE_IN_KERNEL
    targets, flags = _split_targets(out, tiles, split, reduce)
    lora_ptrs, R, lora_flags = _lora_args(lora, out, split, reduce)
    _nvfp4_mm_kernel[(tiles, split)](
        x, packed, scale, global_scale, bias if bias is not None else out, part,
        *targets, *lora_ptrs,
        M, N, K, k_split, R,
        x.stride(0), packed.stride(0), scale.stride(0), N, M * N,
        HAS_BIAS=bias is not None, **flags, **lora_flags,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP=cfg.group, SWAP_AB=cfg.swap, IL=il,
        INTERPRET=interpreting(), num_warps=cfg.warps, num_stages=cfg.stages, **pdl_launch(x.device))
    return out if reduce else _reduce(part, global_scale, bias, out)


def _gemv_split(cfg, tiles, K, bk, silu_mul, sms):
    """(split, k per split) of a CUDA-core GEMV launch of tiles programs along N.

    ~8 programs per SM of >= 2 steps on average: the warps of a GEMV mostly wait on their loads
    (ncu: long-scoreboard stalls), so more of them in flight (NOTES.md v11). Where a step is 1024 k
    (K a multiple of 1024: the 32B weights), as many splits as fill one wave of GEMV_WAVE programs
    an SM instead, but not more than half the steps: 32B down 4 splits (640 programs) against 7
    (1,120: 1.7 waves), 34.4-34.8 -> 33.6-34.0 us alone (2.98 -> 3.05x cuBLAS), 32B batch-1 decode
    +0.8%. The 7B weights' 512-k steps keep the first rule: 7B down's one-wave split ran 19.2 vs
    19.4 us alone, yet 7B batch-1 decode lost 0.8% with it (H100, NOTES.md v32). SiLU·mul needs
    whole rows (the gate/up weights have programs enough: 7B 1184, 32B 1728)."""
    if silu_mul or cfg.split or bk < 1024 or not GEMV_ONE_WAVE:
        return _split(1 if silu_mul else cfg.split, tiles, K, bk, 8 * sms, min_blocks=2)
    split = min(GEMV_WAVE * sms // tiles, triton.cdiv(triton.cdiv(K, bk), 2))
    return _split(max(split, 1), tiles, K, bk, 0)


def _gemv(x, packed, scale, global_scale, bias, cfg, lora=None, il=False, silu_mul=False):
    """y = x·Wᵀ (+bias) (+ the LoRA update lora = (hp, B, s)) on CUDA cores for M <= 4 (K a
    multiple of 16; padded to 32 if odd); with silu_mul, silu(y[:, :N/2])·y[:, N/2:] (see
    nvfp4_matmul)."""
    M, K = x.shape
    N = packed.shape[0]
    if M > 4:
        raise ValueError(f"the CUDA-core kernel takes at most 4 rows of x, got {M}")
    out = torch.empty((M, N // 2 if silu_mul else N), device=x.device, dtype=torch.bfloat16)
    if M == 0:
        return out
    if K % 32:                               # a weight row must be whole 16-byte loads
        x, packed, scale = _pad(x, 1, 32), _pad(packed, 1, 16), _pad(scale.view(torch.uint8), 1, 2)
        K = x.shape[1]
    bk = min(cfg.bk, triton.next_power_of_2(K))
    tiles = triton.cdiv(out.shape[1], cfg.bn // 2 if silu_mul else cfg.bn)
    split, k_split = _gemv_split(cfg, tiles, K, bk, silu_mul, _num_sms(x.device))
    part = _partials(split, out)
    reduce = split > 1 and REDUCE_IN_KERNEL
    targets, flags = _split_targets(out, tiles, split, reduce)
    x2 = x.view(torch.int32)                 # (M, K/2): one bf16 pair per word
    sb = scale.view(torch.uint8)             # E4M3 bits; decoded in-kernel
    lora_ptrs, R, lora_flags = _lora_args(lora, out, split, reduce)
    _nvfp4_gemv_kernel[(tiles, split)](
        x2, packed, sb, global_scale, bias if bias is not None else out, part,
        *targets, *lora_ptrs,
        M, N, K // 2, k_split // 2, R,
        x2.stride(0), packed.stride(0), sb.stride(0), out.shape[1], M * N,
        HAS_BIAS=bias is not None, **flags, **lora_flags, SILU=silu_mul,
        LATE_RELEASE=GEMV_LATE_RELEASE and not silu_mul,
        BM=triton.next_power_of_2(M), BN=cfg.bn, BK=bk, W=cfg.warps, IL=il, INTERPRET=interpreting(),
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl_launch(x.device))
    return out if reduce else _reduce(part, global_scale, bias, out)


def mma_tiles(N: int, cfg) -> int:
    """Programs of a fragment launch along N: 16·warps·tiles weight rows each."""
    return triton.cdiv(N, 16 * cfg.warps * cfg.tiles)


def _mma_launch(cfg, M, tiles, K, device):
    """(split, windows a split, windows a step) of a fragment launch. The split as for the other
    split-K kernels (~4 programs an SM, >= 4 windows each). Where that leaves a program at most
    PAIR_WINDOWS windows (twice that at M <= 4), a step loads two windows before it decodes either,
    and the run is rounded up to one step (<= 2 windows) or a multiple of 4 (3 -> 4, 5 -> 8: 7B down
    ran 18.0 us at 8 windows, 19.6 at 6): such programs are a chain of load latencies more than a
    stream, and two windows in flight a warp shorten it. H100, same run (bench/NOTES.md v30): 7B
    qkv / o M = 2 -7%, 32B qkv / o M = 2 -5%, 7B down M = 2 (5 -> 8 windows) 19.3 -> 18.0 us; at
    M = 8 32B qkv with 8 windows a program lost 5% (so 4 there), and 32B down (14 windows) loses
    2-4%: its 61 registers allow 4 programs an SM, not 5. Except at M = 5..8 (one token tile, the
    split-K sum in-kernel with two windows a step): there a program of >= LONG_RUN_WINDOWS windows
    is cut to runs of LONG_RUN_CUT at two a step, 32B down M = 8 35.7 -> 34.1 us (27-window runs ->
    27 splits of 8; 7B down's 10-window runs stay: 20.2 us against 20.5 cut, NOTES v31). Where gate_up
    runs here (off the H100's routes) it is cut too: 7B gate_up M = 6 / 8 7-11% faster, 32B gate_up
    M = 8 2.6% slower. A given split keeps its windows, one a step unless cfg says more."""
    nwin = K // 128
    split, chunk = _split(cfg.split, tiles, K, 128, 4 * _num_sms(device))
    per = chunk // 128
    if cfg.split or cfg.windows:
        return split, per, cfg.windows or 1
    if 4 < M <= 8 and per >= LONG_RUN_WINDOWS:
        return triton.cdiv(nwin, LONG_RUN_CUT), LONG_RUN_CUT, 2
    if per > (2 * PAIR_WINDOWS if M <= 4 else PAIR_WINDOWS):
        return split, per, 1
    per = triton.cdiv(per, 4) * 4 if per > 2 else 2
    return triton.cdiv(nwin, per), per, 2


def _mma(x, packed, scale, global_scale, bias, cfg, il=False):
    """y = x·Wᵀ (+bias) with the fragment kernel: M <= 16, K a multiple of 128."""
    M, K = x.shape
    N = packed.shape[0]
    if M > 16 or K % 128:
        raise ValueError(f"the fragment kernel takes M <= 16 and K a multiple of 128, got M={M}, K={K}")
    out = torch.empty((M, N), device=x.device, dtype=torch.bfloat16)
    if M == 0:
        return out
    tiles = mma_tiles(N, cfg)
    split, per, step = _mma_launch(cfg, M, tiles, K, x.device)
    part = _partials(split, out)
    reduce = split > 1 and REDUCE_IN_KERNEL and fragment_sums_in_kernel(M, step)
    reduce_follows = split > 1 and not reduce           # the reduce kernel is the next launch
    targets, flags = _split_targets(out, tiles, split, reduce)
    x2, p4, sb = x.view(torch.int32), packed.view(torch.int32), scale.view(torch.uint8)
    _nvfp4_mma_kernel[(tiles, split)](
        x2, p4, sb, global_scale, bias if bias is not None else out, part,
        *targets,
        M, N, K // 128, per,
        x2.stride(0), p4.stride(0), sb.stride(0), N, M * N,
        HAS_BIAS=bias is not None, **flags,
        W=cfg.warps, R=cfg.tiles, NT=1 if M <= 8 else 2, IL=il, U=step,
        INTERPRET=interpreting(), num_warps=cfg.warps, num_stages=1,
        LATE_RELEASE=FRAGMENT_LATE_RELEASE == 1 or (FRAGMENT_LATE_RELEASE == 2 and not reduce_follows),
        **pdl_launch(x.device))
    return _reduce(part, global_scale, bias, out) if reduce_follows else out


def fragment_sums_in_kernel(M: int, step: int) -> bool:
    """Whether a split fragment launch of M rows, `step` windows a loop step, sums its own
    partials (its last split, see _mma) rather than leaving them to the reduce kernel: at M <= 4
    (H100, 7B decode, same run: batch 4 +4.3%, batch 8 -2.5% against the reduce kernel; bench/NOTES.md
    v9), and to M = 8 where a step loads several windows (7B qkv / o M = 8 -15% alone, v30; 32B qkv
    with one window a step and 7B qkv at M = 16 ran slower with it). Above M = 8 it sums both token
    tiles if the thresholds are raised: not by default (alone 7B o M = 16 4% faster, 7B qkv 40%
    slower; the 7B batch-16 graph 2% fewer tok/s, v31). What the sum costs where it runs: python
    bench/kernel.py --split-cost (v33: 0.7-1.2 us on 7B qkv / o)."""
    return M <= FRAGMENT_REDUCE_MAX_M or (step > 1 and M <= PAIR_REDUCE_MAX_M)


def _wgmma_wave(cfg, device) -> int:
    """Programs of a register-A launch that fit on the SMs at once: by shared memory (the ring of x
    tiles, words and scales) and, warp-specialized, by registers (the producer's warp takes a
    warpgroup's worth)."""
    per_sm = SMEM_PER_SM // (rak.ring_bytes(cfg.bn, cfg.bt, cfg.stages) + 1024)
    if warp_specialized(cfg):
        per_sm = min(per_sm, 65536 // (rak.MAX_REGS[cfg.warps] * 32 * (cfg.warps + 4)))
    return _num_sms(device) * max(1, per_sm)


def _wgmma_split(M, N, K, cfg, device):
    """(split, windows per split) of a register-A launch: split-K up to one wave of programs
    (_wgmma_wave), each >= 4 windows of 128 k; more waves measured slower (NOTES v17). With decode
    tiles (<= 16 tokens) up to WGMMA_DECODE_WAVE of a wave: each split adds M·N·8 bytes of fp32
    partials (stored, then read by the reduce kernel), at M = 16 17% of 7B down's weight bytes at
    its one-wave 14 splits. 3/4 of a wave, against one: 7B down at M = 9..16 (10 splits, not 14)
    5-8% faster, 32B qkv / o 3-5% (M = 9 on 32B o even), 32B down 0-1% slower; decode batch 16
    7B +1.1%, 32B +0.2% (1/2 a wave: 7B +2.0%, 32B -0.4%; H100, NOTES v32)."""
    nwin = K // 128
    tiles = triton.cdiv(N, cfg.bn) * triton.cdiv(M, cfg.bt)
    wave = _wgmma_wave(cfg, device)
    if cfg.bt <= 16:
        wave = int(wave * WGMMA_DECODE_WAVE)
    return _split(cfg.split or max(1, min(nwin // 4, wave // tiles)), tiles, nwin, 1, 0)


def _fit_stages(M, N, cfg, device):
    """cfg with fewer ring stages (3 at least) where that lets one wave hold every program of the
    launch, else cfg. A launch whose programs exceed a wave does not split (_wgmma_split) and runs
    a second, part-empty wave of programs that each read all of K: 32B gate_up at M = 9..16 has 864
    row tiles, 792 of which fit at 4 stages and 1,056 at 3: 75.7-75.9 -> 62.2-63.6 us at M = 9..16
    (2.61-2.62 -> 3.12-3.18x cuBLAS), 32B batch-16 decode +7.5%; 7B gate_up (592 tiles, one wave at
    4 stages) would be 3.9% slower at 3 (32.9 vs 34.2 us; H100, NOTES.md v32)."""
    tiles = triton.cdiv(N, cfg.bn) * triton.cdiv(M, cfg.bt)
    if not WGMMA_FIT_STAGES or cfg.split or warp_specialized(cfg) or tiles <= _wgmma_wave(cfg, device):
        return cfg
    for stages in range(cfg.stages - 1, 2, -1):
        fewer = replace(cfg, stages=stages)
        if tiles <= _wgmma_wave(fewer, device):
            return fewer
    return cfg


def _deeper_ring(cfg, programs, chunk, device):
    """cfg with a 4-stage ring where it has 3 (and no given split), its programs fit one wave and
    run >= LONG_RING_WINDOWS windows each, and the deeper ring leaves the programs an SM as they
    are. With 64-token tiles it does: shared memory would hold 3 programs an SM at 3 stages and 2
    at 4, but the warp-specialized kernel's registers allow 2 either way (65536 / (MAX_REGS 128 x
    32 lanes x 8 warps)). So the down weights at M = 33..64: 7B down 4-5% faster (M = 64 1.93 ->
    2.00x cuBLAS), 32B down 6-7%; the short runs of qkv / o gain nothing (1% slower), nor 32B
    gate_up's 3.3 waves of 40-window programs (1-4% slower; H100, NOTES.md v32)."""
    deeper, wave = replace(cfg, stages=4), _wgmma_wave(cfg, device)
    if (cfg.stages != 3 or cfg.split or chunk < LONG_RING_WINDOWS or programs > wave
            or SMEM_PER_SM < rak.ring_bytes(cfg.bn, cfg.bt, 4) + 1024 or _wgmma_wave(deeper, device) != wave):
        return cfg
    return deeper


def _wgmma_launches(M, N, K, cfg, device):
    """The launches of one register-A product: [(config, first weight-row tile, weight-row tiles,
    split, windows per split)]. One launch (_wgmma_split), except where cfg's tiles fill whole waves
    and then part of one (M = 1024 on 32B o / down: 160 tiles on 132 SMs): a launch of the whole
    waves' worth of weight-row tiles, then one for the rows left, which ends after a fraction of a
    tile: its windows split into at most a wave of pieces where each keeps >= TAIL_MIN_WINDOWS (the
    pieces sum themselves: their fp32 tiles' round trip through L2 costs ~10 us a launch), else the
    rows in TAIL_CONFIG's smaller tiles (bench/NOTES.md v27). cfg's ring may be made shallower
    (_fit_stages) or deeper (_deeper_ring) first."""
    cfg = _fit_stages(M, N, cfg, device)
    nt, mt, nwin = triton.cdiv(N, cfg.bn), triton.cdiv(M, cfg.bt), K // 128
    split, chunk = _wgmma_split(M, N, K, cfg, device)
    cfg = _deeper_ring(cfg, nt * mt * split, chunk, device)
    wave = _wgmma_wave(cfg, device)
    main = nt * mt // wave * wave // mt                         # weight-row tiles of whole waves
    single = [(cfg, 0, nt, split, chunk)]
    if split > 1 or main in (0, nt) or not warp_specialized(cfg) or cfg.split or cfg.bt <= TAIL_CONFIG.bt:
        return single
    pieces = min(wave // ((nt - main) * mt), nwin // TAIL_MIN_WINDOWS)
    if pieces > 1:
        return [(cfg, 0, main, 1, nwin), (cfg, main, nt - main, *_split(pieces, 1, nwin, 1, 0))]
    tail, rows = TAIL_CONFIG, N - main * cfg.bn
    if triton.cdiv(rows, tail.bn) * triton.cdiv(M, tail.bt) > _wgmma_wave(tail, device):
        return single
    return [(cfg, 0, main, 1, nwin), (tail, main * cfg.bn // tail.bn, triton.cdiv(rows, tail.bn), 1, nwin)]


def _wgmma(x, packed, scale, global_scale, bias, cfg, lora=None):
    """y = x·Wᵀ (+bias) with the register-A wgmma kernel: W interleaved, K a multiple of 128, sm_90
    with triton 3.6 (wgmma_rows). x is first permuted into the operand's k order (one pass), then
    _wgmma_launches' launches. lora = (h, B, s) (h bf16 (M, R)): the split-K reduce also adds s·h·Bᵀ
    (reduce_folds_lora)."""
    M, K = x.shape
    N = packed.shape[0]
    if K % 128:
        raise ValueError(f"the wgmma kernel takes interleaved weights, K a multiple of 128, got K={K}")
    out = torch.empty((M, N), device=x.device, dtype=torch.bfloat16)
    if M == 0:
        return out
    launches = _wgmma_launches(M, N, K, cfg, x.device)
    if lora is not None and (len(launches) > 1 or launches[0][3] == 1):
        raise ValueError("a LoRA update folds into the register-A route only where it splits K (reduce_folds_lora)")
    ws = warp_specialized(cfg)
    xp = rak.fragment_order(x, pdl_launch(x.device), triton.cdiv(M, cfg.bt) * cfg.bt if ws else 0)
    b = bias if bias is not None else out
    for c, tile0, nt, split, chunk in launches:
        C = c.warps // 4 if ws else 1        # consumer warpgroups of the warp-specialized kernel
        warps = c.warps // C
        mt = triton.cdiv(M, c.bt)
        reduce = split > 1 and len(launches) > 1       # a tail's pieces sum themselves, in whole fp32 tiles
        part = (torch.empty((split, nt * mt, c.bn * c.bt), device=x.device, dtype=torch.float32) if reduce
                else _partials(split, out))
        meta = dict(LW=rak.word_layout(c.bn // C, warps), LS=rak.scale_layout(c.bn // C, warps), BN=c.bn, BT=c.bt,
                    S=c.stages, HAS_BIAS=bias is not None, PARTIAL=split > 1, num_warps=warps, **pdl_launch(x.device))
        if ws:
            rak._wgmma_ws_kernel[(nt, mt, split)](
                *rak.descriptors(xp, packed, scale, out, c.bn // C, c.bt), global_scale, b, part,
                _split_counts(x.device, nt * mt * C) if reduce else out, M, N, K // 128, chunk, tile0, N, M * N,
                C=C, REDUCE=reduce, maxnreg=rak.MAX_REGS[c.warps], **meta)
        else:
            rak._wgmma_ring_kernel[(nt, mt, split)](
                xp, packed.view(torch.int32), scale.view(torch.uint8), global_scale, b, part, M, N, K // 128, chunk,
                xp.stride(0), N, M * N, **meta)
    return out if len(launches) > 1 else _reduce(part, global_scale, bias, out, lora)


def _matmul_dx(dy, packed, scale, global_scale, cfg, il=False):
    K0 = packed.shape[1] * 2
    scale = scale.view(torch.uint8)          # E4M3 bits; decoded in-kernel
    if dy.shape[1] % MIN_RED or K0 % MIN_RED:   # odd shapes: pad N (the reduction) and K
        dx = _matmul_dx(_pad(dy, 1, MIN_RED), _pad(_pad(packed, 0, MIN_RED), 1, MIN_RED // 2),
                        _pad(_pad(scale, 0, MIN_RED), 1, MIN_RED // 16), global_scale, cfg, il)
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
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_K=cfg.group, IL=il, INTERPRET=interpreting(),
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl_launch(dy.device))
    return _reduce(part, global_scale, None, out)


def _wgmma_dx(dy, packed, scale, global_scale, split=0):
    """dx = dy·W with the register-A kernel on W's transpose (register_a_dx.py): W interleaved, N and
    K multiples of 128, sm_90 with triton 3.6. dy is first permuted into the operand's n order and
    padded to whole token tiles (one pass). split (0: chosen): split-K over the 128-n windows up to
    one wave of programs, each >= 4 windows, summed by the reduce kernel."""
    M, N = dy.shape
    K = packed.shape[1] * 2
    if N % 128 or K % 128:
        raise ValueError(f"the register-A dx kernel needs N and K multiples of 128, got N={N}, K={K}")
    out = torch.empty((M, K), device=dy.device, dtype=torch.bfloat16)
    if M == 0:
        return out
    pdl = pdl_launch(dy.device)
    BT, BK = rad.BT.value, rad.BK.value
    _, split, chunk = _dx_launch(M, N, K, dy.device, split)
    part = _partials(split, out)
    dyp = rak.fragment_order(dy, pdl, triton.cdiv(M, BT) * BT, dx=True)
    rad._dx_kernel[(triton.cdiv(K, BK), triton.cdiv(M, BT), split)](
        *rad.dx_descriptors(dyp, packed, scale, out), global_scale, part, M, K, N // 128, chunk, PARTIAL=split > 1,
        num_warps=4, maxnreg=rak.MAX_REGS[8], **pdl)
    return _reduce(part, global_scale, None, out)


def fragment_rows(M: int, K: int) -> bool:
    """Does the fragment kernel compute y at M rows (K a multiple of 128 only)?"""
    return GEMV_MAX_M < M <= FRAGMENT_MAX_M and K % 128 == 0


def wgmma_rows(M: int, N: int, K: int, device, interleaved: bool) -> bool:
    """Does the register-A wgmma kernel compute y at M rows? 16 < M <= 1024: on every weight to M =
    128, on the big ones (> 20M elements) to 512 (H100, bench/NOTES.md v17: at M = 64..256 1.2-2.8x
    faster than the tiles or dequantize + cuBLAS on every shape, except 7B qkv and o at M = 256;
    about even with the tiles at M = 17..32), and above M = 512 where one launch's programs fill
    their last wave to WAVE_FILL or, on the big weights, where a second launch takes the rows of a
    part-empty wave (_wgmma_launches; v27: M = 1024 0.88-1.00x of cuBLAS bf16 on every big weight
    and 7B o, against 0.76-0.83x for dequantize + cuBLAS, which wins on 7B qkv's two launches and
    on 7B qkv / o at M = 129..512); with WGMMA_SMALL also from M = 2 on wide weights (N >=
    WIDE_N) and M = 9 on the other big ones, where it beat the fragment kernel by 4-16% (v18; on 7B
    down at M <= 8 and the small weights it lost); interleaved (K a multiple of 128), on sm_90
    (wgmma) with triton 3.6 (the Gluon it is written in; register_a_kernel.py)."""
    big = N * K > WGMMA_NARROW
    low = WGMMA_MIN_M
    if WGMMA_SMALL and big:
        low = min(low, GEMV_MAX_M if N >= WIDE_N else WGMMA_SMALL_MIN_M)
    if not (low < M <= WGMMA_MAX_M and _gluon_runs(device, interleaved)):
        return False
    if M <= WGMMA_NARROW_MAX_M or (big and M <= WGMMA_FILL_M):
        return True
    if M <= WGMMA_FILL_M:
        return False
    launches = _wgmma_launches(M, N, K, wgmma_config(M), device)
    if len(launches) > 1:
        return big
    return _wave_fill(M, launches[0], device) >= WAVE_FILL


def _gluon_runs(device, interleaved: bool) -> bool:
    """Can the register-A kernels run: interleaved weights, sm_90 (wgmma), triton 3.6 (the Gluon they
    are written in), not under the interpreter?"""
    return (interleaved and device.type == "cuda" and not interpreting() and _capability(device.index or 0) == (9, 0)
            and triton.__version__.startswith(GLUON_TRITON))


def _dx_launch(M: int, N: int, K: int, device, split: int = 0):
    """(tiles, split, windows per split) of a register-A dx launch: split-K over the 128-n windows,
    chosen (split = 0) up to one wave of programs, each >= 4 windows."""
    tiles, nwin = triton.cdiv(K, rad.BK.value) * triton.cdiv(M, rad.BT.value), N // 128
    return (tiles, *_split(split or max(1, min(nwin // 4, _num_sms(device) // tiles)), tiles, nwin, 1, 0))


def _fill(programs: int, wave: int) -> float:
    """How full a launch's waves are: programs / (waves · programs a wave)."""
    return programs / (triton.cdiv(programs, wave) * wave)


def dx_wgmma_rows(M: int, N: int, K: int, device, interleaved: bool) -> bool:
    """Does the register-A kernel on Wᵀ (register_a_dx.py) compute dx at M rows? On the big weights
    (> 20M elements; N and K multiples of 128) at 64 < M <= 256, and to M = 512 on those of > 64M
    elements (gate_up, down) where its programs fill their waves to DX_WAVE_FILL (H100, bench/NOTES.md
    v28: M = 128 / 256 0.47-1.38x of cuBLAS bf16 against 0.35-0.75x for the tiles; at M = 384 0.68-
    0.80x on gate_up / down against 0.56-0.61x for dequantize + cuBLAS, which wins on 32B qkv / o
    (0.61 / 0.59 against 0.54 / 0.46); at M = 512 ahead only where the waves are full; at M = 1024
    0.50-0.78x, behind dequantize + cuBLAS everywhere); interleaved, sm_90, triton 3.6."""
    if not (DX_WGMMA_MIN_M < M <= DX_WGMMA_MAX_M and N * K > WGMMA_NARROW and N % 128 == 0 and K % 128 == 0
            and _gluon_runs(device, interleaved)):
        return False
    if M <= DX_WGMMA_FULL_M:
        return True
    if N * K <= DX_WIDE:
        return False
    tiles, split, _ = _dx_launch(M, N, K, device)
    return _fill(tiles * split, _num_sms(device)) >= DX_WAVE_FILL


def _wave_fill(M, launch, device) -> float:
    """How full the waves of a register-A launch (_wgmma_launches' tuple) are: programs / (waves ·
    programs a wave)."""
    cfg, _, tiles, split, _ = launch
    return _fill(tiles * triton.cdiv(M, cfg.bt) * split, _wgmma_wave(cfg, device))


def folds_lora(M: int, K: int) -> bool:
    """Can nvfp4_matmul take a LoRA update at M rows? Where the kernel that runs finishes its own
    output tiles (it sums its split-K partials itself): the CUDA-core GEMV (M <= GEMV_MAX_M) and the
    swapped tiles (M <= 16 where the fragment kernel does not run: K not a multiple of 128). The
    update is added before y is stored, and the expand kernel (lora_kernels.lora_expand_) with its
    launch is not needed."""
    return REDUCE_IN_KERNEL and M <= 16 and not fragment_rows(M, K)


def reduce_folds_lora(M: int, N: int, K: int, device, interleaved: bool) -> bool:
    """Can nvfp4_matmul take a LoRA update in the h form (h = x Aᵀ bf16 (M, R), as F.linear gives
    it) at M rows? Where the register-A kernel runs with split-K: the reduce kernel that sums its
    partials adds s·h·Bᵀ too (tile_kernels._splitk_reduce_lora_kernel), and the in-place addmm that
    lora.py would run after the matmul is not needed (the GRPO batch's qkv, o and down)."""
    return (REDUCE_FOLDS_LORA and wgmma_rows(M, N, K, device, interleaved)
            and _wgmma_split(M, N, K, wgmma_config(M), device)[0] > 1)


def folds_silu(M: int) -> bool:
    """Can nvfp4_matmul apply SiLU·mul to a stacked gate/up product itself (silu_mul=True)? Where
    the CUDA-core GEMV runs, whose programs finish their rows in one pass: the gate rows and the
    same up rows go to one program, which stores silu(gate)·up (the SiLU·mul kernel's launch saved)."""
    return M <= GEMV_MAX_M


def _check_lora(lora, M, N, K, device, interleaved):
    """Check a LoRA update in either of nvfp4_matmul's forms, and where it folds; -> True for the
    h form (h (M, R) bf16), False for the partials form (hp (split, M, R) fp32)."""
    first, B, s = lora
    h_form = first.dim() == 2
    if h_form:
        if first.dtype != torch.bfloat16 or first.shape[0] != M or not first.is_contiguous():
            raise ValueError(f"lora: h must be a contiguous bf16 ({M}, R), got {first.dtype} {tuple(first.shape)}")
    elif first.dtype != torch.float32 or first.dim() != 3 or first.shape[1] != M or not first.is_contiguous():
        raise ValueError(f"lora: hp must be contiguous fp32 K-chunk partials (split, {M}, R), got "
                         f"{first.dtype} {tuple(first.shape)}")
    R = first.shape[-1]
    if B.dtype != torch.bfloat16 or tuple(B.shape) != (N, R) or not B.is_contiguous():
        raise ValueError(f"lora: B must be a contiguous bf16 ({N}, {R}), got {B.dtype} {tuple(B.shape)}")
    if first.device != device or B.device != device or not isinstance(s, float):
        raise ValueError(f"lora: {'h' if h_form else 'hp'} and B on the activations' device, and a float scale")
    if h_form and not reduce_folds_lora(M, N, K, device, interleaved):
        raise ValueError(f"lora in the h form folds only where the register-A kernel splits K "
                         f"(reduce_folds_lora), not at M={M}, N={N}, K={K}")
    if not h_form and not folds_lora(M, K):
        raise ValueError(f"lora: the update folds into the matmul only where folds_lora holds, not at M = {M}, K = {K}")
    return h_form


def nvfp4_matmul(x, packed, scale, global_scale, bias=None, lora=None, interleaved=False, silu_mul=False):
    """y (M, N) bf16 = x (M, K) bf16 · dequant(W)ᵀ (+ bias (N,) bf16), fp32 accumulation.
    lora = (hp, B, s), where folds_lora(M, K): also y += s · bf16(Σ_j hp[j]) · Bᵀ, the LoRA update of
    lora_kernels.lora_expand_ (hp (split, M, R) fp32 from lora_kernels.lora_shrink, B (N, R) bf16);
    or lora = (h, B, s) with h = x Aᵀ bf16 (M, R), where reduce_folds_lora: y += s · h · Bᵀ, added by
    the reduce kernel of the register-A route (lora.py's addmm, without its launch).
    interleaved: packed and scale hold nvfp4.interleave's layout (K a multiple of 128).
    silu_mul, where folds_silu(M): W stacks gate and up (N = 2I rows), and the result is
    silu(y[:, :I])·y[:, I:] (M, I), the bits of fused_ops.silu_mul_triton on the two halves of y."""
    N, K = _check_weight(packed, scale, global_scale, x.device, interleaved)
    _check_act("x", x, K)
    if silu_mul and (not folds_silu(x.shape[0]) or N % 32):
        raise ValueError(f"silu_mul needs M <= {GEMV_MAX_M} (folds_silu) and N = 2I with I a multiple of 16, "
                         f"got M={x.shape[0]}, N={N}")
    if bias is not None:
        if bias.dtype != torch.bfloat16 or tuple(bias.shape) != (N,) or not bias.is_contiguous():
            raise ValueError(f"bias must be a contiguous bf16 tensor of shape ({N},), got "
                             f"{bias.dtype} {tuple(bias.shape)}")
    if lora is not None:       # folds_lora: the GEMV or the swapped tiles below, never _mma or dequant
        if _check_lora(lora, x.shape[0], N, K, x.device, interleaved):     # the h form: reduce_folds_lora
            return _wgmma(x, packed, scale, global_scale, bias, wgmma_config(x.shape[0]), lora)
    elif wgmma_rows(x.shape[0], N, K, x.device, interleaved):
        return _wgmma(x, packed, scale, global_scale, bias, wgmma_config(x.shape[0]))
    elif use_dequant(x.shape[0], N, K):
        return torch.nn.functional.linear(x, _dequantize_bf16(packed, scale, global_scale, interleaved), bias)
    cfg = fwd_config(x.shape[0], N, K)
    if isinstance(cfg, GemvConfig):          # every M <= GEMV_MAX_M, so every silu_mul
        return _gemv(x, packed, scale, global_scale, bias, cfg, lora, interleaved, silu_mul)
    if isinstance(cfg, MmaConfig):
        return _mma(x, packed, scale, global_scale, bias, cfg, interleaved)
    return _matmul(x, packed, scale, global_scale, bias, cfg, lora, interleaved)


def nvfp4_matmul_dx(dy, packed, scale, global_scale, interleaved=False):
    """dx (M, K) bf16 = dy (M, N) bf16 · dequant(W), fp32 accumulation (backward of y = x·Wᵀ)."""
    N, K = _check_weight(packed, scale, global_scale, dy.device, interleaved)
    _check_act("dy", dy, N)
    route = dx_route(dy.shape[0], N, K, dy.device, interleaved)
    if route == "wgmma":
        return _wgmma_dx(dy, packed, scale, global_scale)
    if route == "dequant+cublas":
        return dy @ _dequantize_bf16(packed, scale, global_scale, interleaved)
    return _matmul_dx(dy, packed, scale, global_scale, dx_config(dy.shape[0], N, K), interleaved)


def dx_route(M: int, N: int, K: int, device, interleaved: bool) -> str:
    """Which kernel computes dx at M rows: "wgmma" (dx_wgmma_rows), "dequant+cublas" (use_dequant, and
    on the big weights above DX_WGMMA_FULL_M: at M = 384 0.56-0.61x of cuBLAS bf16 against 0.30-0.52x
    for the tiles on every big weight, NOTES v28) or "tiles"."""
    if dx_wgmma_rows(M, N, K, device, interleaved):
        return "wgmma"
    if use_dequant(M, N, K) or (M > DX_WGMMA_FULL_M and N * K > WGMMA_NARROW and K % MIN_RED == 0):
        return "dequant+cublas"
    return "tiles"
