"""The FP4 x BF16 GEMM's entry point: y = x·Wᵀ (+bias) and dx = dy·W on NVFP4 weights.

Hopper has no FP4 tensor cores, so every kernel here reads the 4.5-bit weights, turns them into
bf16 (or fp32) in registers and multiplies with fp32 accumulation ("Marlin-style" mixed-input
GEMM). The weight format is the standard compressed-tensors NVFP4 layout (nvfp4.py owns it):

    packed        uint8          (N, K/2)   two E2M1 codes per byte, even k in the LOW nibble
    scale         float8_e4m3fn  (N, K/16)  one scale per 16 consecutive k of a row
    global_scale  float32        (1,)
    W[n, k] = e2m1(code[n, k]) * scale[n, k // 16] / global_scale

or, with interleaved=True, nvfp4.interleave's 16 x 128 tiles of the same bytes (K a multiple of
128; what NVFP4Linear holds on CUDA): a warp's 16-byte-per-lane load of 8 rows then reads 512
contiguous bytes instead of 8 scattered pieces. The bits of y do not depend on the layout, except
where the register-A kernel or the TMA-fed GEMV runs (they read the interleaved layout only, and sum
in their own order).

This file holds the input checks, the one function that decides which kernel computes a product
(`route`), and the wrappers that allocate and launch. At M rows of x (the thresholds are
tuning.py's fields; the launch shapes shapes.py's):

    route            forward y = x·Wᵀ                                  kernel
    "gemv"           M = 1 (batch-1 decode)                             gemv._nvfp4_gemv_kernel;
                                                                        gemv_tma (sm_90, interleaved)
                                                                        on gate_up, 32B down
    "fragment"       2 <= M <= 16, K a multiple of 128                  small_m._nvfp4_mma_kernel
    "wgmma"          16 < M <= 128 on every weight, to 512 on big ones, register_a (sm_90, triton 3.6,
                     above where its waves fill; on big weights from     interleaved weights only)
                     M = 2 (gate_up, down, 14B / 32B qkv / o)
    "tiles"          the rest below dequantize: swapped tiles to M = 64, tiles._nvfp4_mm_kernel
                     128 x 128 tiles above
    "dequant+cublas" M >= 512 (>= 128 on narrow weights)                tiles._nvfp4_dequant_kernel,
                                                                         then F.linear
    route(dx=True)   dx = dy·W
    "wgmma"          64 < M <= 256 on big weights (to 512 on the        register_a_dx
                     widest where the waves fill)
    "dequant+cublas" dequantize's M, and big weights above 256          as above, then dy @ W
    "tiles"          the rest                                           tiles._nvfp4_mm_dx_kernel

Split-K: at decode a launch has few output tiles, so it splits K and each split writes fp32
partial sums. The GEMV, the swapped tiles and the fragment kernel at small M (fragment_sums_in_kernel)
sum them in the launch: the split that counts last for a tile adds them in order with scale, bias
and cast (fp4_decode._last_split). Elsewhere (the fragment kernel's other launches, the medium
tiles, the register-A kernel) tiles._splitk_reduce_kernel does, which is faster there. Either way
the sum runs in split order: deterministic.

Folds. Two launches that follow a matmul on the rollout path can run inside it instead (the
wing's lora.py and stacked.py ask for them through `matmul`'s lora= and silu_mul=):
  * a LoRA update s·(x Aᵀ)Bᵀ: at decode (to tuning's lora_max_m rows) from the shrink kernel's
    partials, added by whatever finishes y (folds_lora): the GEMV, the fragment kernel or the
    swapped tiles as they store it, else the reduce kernel after a split fragment or register-A
    launch (not where the register-A launch is unsplit: 7B gate_up); beyond, from h = x Aᵀ, where
    the register-A kernel splits K (reduce_folds_lora), by its reduce kernel. Where the reduce kernel
    adds it, it may compute the shrink as well (Fold.shrink, carries_shrink).
  * SiLU·mul of a stacked gate/up weight at one row (folds_silu): the GEMV stores silu(gate)·up.

Leaves out: activation quantization (this is W4A16), a re-layout of the bits inside a byte (the
fragment kernel gets its register-only decode from a k-permutation instead), autotuning.
Test: tests/test_kernels_gemm.py (routing, input checks, end to end on every route, interleaved bits);
the kernels' own tests/test_kernels_{fp4_decode,small_m,tiles,register_a}.py (CPU: interpreter, tiny
shapes; GPU: real shapes). The oracle is marlin_kernel.reference_matmul (float64). Benchmark:
python bench/kernel.py.
"""
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton

from . import gemv_tma, launch, shapes, tuning
from . import register_a as rak
from . import register_a_dx as rad
from .shapes import GEMV_ROWS, MIN_RED, cdiv, fragment_rows
from .gemv import _nvfp4_gemv_kernel
from .small_m import _nvfp4_mma_kernel
from .tiles import (_nvfp4_dequant_kernel, _nvfp4_mm_dx_kernel, _nvfp4_mm_kernel, _splitk_reduce_kernel,
                    _splitk_reduce_lora_kernel)

BLOCK = 16               # NVFP4 scale block along K
GLUON_TRITON = "3.6."    # the Triton release register_a*.py's Gluon is written for


class Shrink(NamedTuple):
    """The LoRA shrink h = x Aᵀ that the launch folding its update computes in its first programs
    (fp4_decode._carried_shrink; lora.py says where), instead of a launch of its own before the
    matmul: fp32 K-chunk partials `part` (split, M, R), summed by each rank tile's last chunk into
    the Fold's h (1, M, R) (part is h itself where one chunk spans K); flags: launch.shrink_flags;
    BM, BR, BK, fp32: lora.lora_shrink's launch shape and dot precision for these operands."""
    x: torch.Tensor
    A: torch.Tensor
    part: torch.Tensor
    flags: torch.Tensor
    BM: int
    BR: int
    BK: int
    fp32: bool


class Fold(NamedTuple):
    """A LoRA update for matmul's lora= (a plain (h, B, scale) tuple reads as one with x_fresh False).
    x_fresh: the launch just before the matmul wrote x as well as h (lora.norm_shrink), or wrote x
    and the launch computes h itself (shrink), so the kernel must wait on it before it reads x; else
    the launch before is lora.lora_shrink, which only read x, and the kernel streams x and W before
    its wait (LATE_WAIT). shrink: h's shrink, carried by whichever launch folds the update. cuts:
    for an adapter group's compact B (N, RB) (lora.group_casts), the columns where its first two
    members end (fp4_decode._lora_part); None: one part, B (N, R) (one adapter, or a group's
    block-diagonal B)."""
    h: torch.Tensor
    B: torch.Tensor
    scale: float
    x_fresh: bool = False
    shrink: Shrink = None
    cuts: tuple = None


def lora_cuts(cuts, N: int) -> tuple:
    """(N1, N2) of a Fold's cuts (N1, N2), or (N, N) for one adapter (B's N rows); a group of two has N2 = N."""
    return tuple(cuts) if cuts is not None else (N, N)


def lora_parts(cuts, N: int) -> int:
    """The group members a compact B of N rows cut at cuts holds: 1 (one adapter), 2 or 3."""
    n1, n2 = lora_cuts(cuts, N)
    return 1 + (n1 < N) + (n2 < N)


def check_lora_b(B, cuts, R: int, what: str) -> None:
    """A ValueError unless B (N, RB) fits h's R ranks with cuts: one part (RB = R) without cuts, else
    two or three parts of RB = R / parts ranks each, the cuts increasing (fp4_decode._lora_part)."""
    N = B.shape[0]
    n1, n2 = lora_cuts(cuts, N) if cuts is None or len(cuts) == 2 else (0, 0)
    parts = lora_parts((n1, n2), N)
    if not (0 < n1 <= n2 <= N and R % parts == 0 and B.shape[1] == R // parts):
        raise ValueError(f"{what}: B {tuple(B.shape)} with cuts {cuts} does not fit h's {R} ranks: cuts are two "
                         f"increasing columns (N1, N2) up to {N}, and B has R / parts ranks a row")


def shrink_args(shrink, dummy):
    """A folding kernel's carried-shrink arguments: (x, A, part, flags, K, x's row stride) and the
    constexprs NS (its programs; 0: none), SBM, SBR, SBK, SSPLIT, SFP32 (the Shrink's launch shape
    and dot precision); dummy stands in for the tensors where there is none."""
    if shrink is None:
        return (dummy,) * 4 + (0, 0), dict(NS=0, SBM=16, SBR=16, SBK=16, SSPLIT=1, SFP32=False)
    K, R = shrink.x.shape[1], shrink.A.shape[0]
    split = cdiv(K, shrink.BK)
    return ((shrink.x, shrink.A, shrink.part, shrink.flags, K, shrink.x.stride(0)),
            dict(NS=cdiv(R, shrink.BR) * split, SBM=shrink.BM, SBR=shrink.BR, SBK=shrink.BK, SSPLIT=split,
                 SFP32=shrink.fp32))

# ----------------------------------------------------------------------------------------------
# input checks


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


def _check_lora(lora, M, N, K, device, interleaved):
    """Check a LoRA update in either of matmul's forms, and where it folds; -> True for the h form
    (h (M, R) bf16), False for the partials form (hp (split, M, R) fp32)."""
    first, B, s = lora[:3]
    h_form = first.dim() == 2
    if h_form:
        if first.dtype != torch.bfloat16 or first.shape[0] != M or not first.is_contiguous():
            raise ValueError(f"lora: h must be a contiguous bf16 ({M}, R), got {first.dtype} {tuple(first.shape)}")
    elif first.dtype != torch.float32 or first.dim() != 3 or first.shape[1] != M or not first.is_contiguous():
        raise ValueError(f"lora: hp must be contiguous fp32 K-chunk partials (split, {M}, R), got "
                         f"{first.dtype} {tuple(first.shape)}")
    if B.dtype != torch.bfloat16 or B.dim() != 2 or B.shape[0] != N or not B.is_contiguous():
        raise ValueError(f"lora: B must be a contiguous bf16 ({N}, RB), got {B.dtype} {tuple(B.shape)}")
    check_lora_b(B, _cuts(lora), first.shape[-1], "lora")
    if first.device != device or B.device != device or not isinstance(s, float):
        raise ValueError(f"lora: {'h' if h_form else 'hp'} and B on the activations' device, and a float scale")
    if h_form and not reduce_folds_lora(M, N, K, device, interleaved):
        raise ValueError(f"lora in the h form folds only where the register-A kernel splits K "
                         f"(reduce_folds_lora), not at M={M}, N={N}, K={K}")
    if not h_form and not folds_lora(M, N, K, device, interleaved):
        raise ValueError(f"lora: the update folds into the matmul only where folds_lora holds, not at M={M}, "
                         f"N={N}, K={K} (route {route(M, N, K, device, interleaved)!r})")
    if _carried(lora) is not None and not carries_shrink(M, N, K, device, interleaved):
        raise ValueError(f"lora: a carried shrink rides only in the reduce launch after a split matmul "
                         f"(carries_shrink), not at M={M}, N={N}, K={K} "
                         f"(route {route(M, N, K, device, interleaved)!r})")
    return h_form


def _pad(t, dim, mult):
    """Zero-pad t along dim to a multiple of mult (zero codes and zero scales decode to 0)."""
    extra = -t.shape[dim] % mult
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
    return torch.nn.functional.pad(t, pad)


# ----------------------------------------------------------------------------------------------
# routes: which kernel computes a product at M rows


def route(M: int, N: int, K: int, device, interleaved: bool, dx: bool = False) -> str:
    """The kernel that computes y = x·Wᵀ at M rows of x ("gemv", "fragment", "wgmma", "tiles" or
    "dequant+cublas"), or with dx, dx = dy·W at M rows of dy ("wgmma", "dequant+cublas", "tiles").
    The module docstring has the table; the predicates below say why each holds where it does."""
    if dx:
        if dx_wgmma_rows(M, N, K, device, interleaved):
            return "wgmma"
        t = tuning.current()
        # the tiles run far below cuBLAS on the big weights once the register-A kernel stops
        if use_dequant(M, N, K) or (M > t.dx_wgmma_full_m and N * K > t.narrow_weight and K % MIN_RED == 0):
            return "dequant+cublas"
        return "tiles"
    if wgmma_rows(M, N, K, device, interleaved):
        return "wgmma"
    if use_dequant(M, N, K):
        return "dequant+cublas"
    if M <= GEMV_ROWS:
        return "gemv"
    if fragment_rows(M, K):
        return "fragment"
    return "tiles"


def use_dequant(M: int, N: int, K: int) -> bool:
    """Large M is compute-bound and the tile kernels reach under half of cuBLAS there, while
    dequantizing W once costs one pass over N·K·2.56 bytes: from dequant_min_m rows on (from
    dequant_narrow_min_m on narrow weights, whose fused launch has few tiles) W is dequantized to
    bf16 and cuBLAS multiplies, where the register-A kernel does not run (checked first). K must
    be a multiple of 64 (every real projection is)."""
    if K % MIN_RED:
        return False
    t = tuning.current()
    return M >= t.dequant_min_m or (M >= t.dequant_narrow_min_m and N * K <= t.narrow_weight)


def wgmma_rows(M: int, N: int, K: int, device, interleaved: bool) -> bool:
    """Does the register-A kernel compute y at M rows? Above wgmma_min_m on every weight to
    wgmma_narrow_max_m, on the big ones (more than narrow_weight elements) to wgmma_fill_m, and above
    that where one launch's programs fill their last wave to wave_fill or, on the big weights, where
    a second launch takes the rows of a part-empty wave (shapes.wgmma_launches); between, dequantize
    + cuBLAS wins on the narrow weights. On big weights it also takes the decode rows where it beats
    the fragment kernel: from M = 2 on wide ones (gate_up), above wgmma_small_min_m on the others
    (from M = 2 too as shipped).
    Interleaved weights (K a multiple of 128), on sm_90 with triton 3.6 only (gluon_runs)."""
    t = tuning.current()
    big = N * K > t.narrow_weight
    low = t.wgmma_min_m
    if big:
        low = min(low, GEMV_ROWS if N >= t.wide_n else t.wgmma_small_min_m)
    if not (low < M <= t.wgmma_max_m and gluon_runs(device, interleaved)):
        return False
    if M <= t.wgmma_narrow_max_m or (big and M <= t.wgmma_fill_m):
        return True
    if M <= t.wgmma_fill_m:
        return False
    launches = shapes.wgmma_launches(M, N, K, shapes.wgmma_config(M), device)
    if len(launches) > 1:
        return big
    return shapes.wave_fill(M, launches[0], device) >= t.wave_fill


def gluon_runs(device, interleaved: bool) -> bool:
    """Can the register-A kernels run: interleaved weights, sm_90 (wgmma), triton 3.6 (the Gluon they
    are written in), not under the interpreter?"""
    return (interleaved and device.type == "cuda" and not launch.interpreting()
            and launch.capability(device.index or 0) == (9, 0) and triton.__version__.startswith(GLUON_TRITON))


def dx_wgmma_rows(M: int, N: int, K: int, device, interleaved: bool) -> bool:
    """Does the register-A kernel on Wᵀ compute dx at M rows? On the big weights (N and K multiples
    of 128) above dx_wgmma_min_m to dx_wgmma_full_m, and to dx_wgmma_max_m on the widest (more than
    dx_wide elements: gate_up, down) where its programs fill their waves to dx_wave_fill; beyond,
    dequantize + cuBLAS is faster. Interleaved, sm_90, triton 3.6."""
    t = tuning.current()
    if not (t.dx_wgmma_min_m < M <= t.dx_wgmma_max_m and N * K > t.narrow_weight and N % 128 == 0
            and K % 128 == 0 and gluon_runs(device, interleaved)):
        return False
    if M <= t.dx_wgmma_full_m:
        return True
    if N * K <= t.dx_wide:
        return False
    tiles, n, _ = shapes.dx_launch(M, N, K, device)
    return shapes.fill(tiles * n, launch.num_sms(device)) >= t.dx_wave_fill


def fragment_sums_in_kernel(M: int, step: int) -> bool:
    """Does a split fragment launch of M rows, `step` windows a loop step, sum its own partials (its
    last split, see _mma) rather than leave them to the reduce kernel? At M <= fragment_reduce_max_m,
    and to pair_reduce_max_m where a step loads several windows; above, the one split that sums
    would read too many partials alone (it sums both token tiles where the thresholds are raised).
    What the sum costs where it runs: python bench/kernel.py --split-cost."""
    t = tuning.current()
    return M <= t.fragment_reduce_max_m or (step > 1 and M <= t.pair_reduce_max_m)


def folds_lora(M: int, N: int, K: int, device, interleaved: bool) -> bool:
    """Can matmul take a LoRA update in the partials form (hp, B, s) at M rows? Where whatever
    finishes y adds it before the store, so the expand kernel and its launch are not needed:
      * the GEMV (M = 1) and the swapped 16-row tiles (K not a multiple of 128), which sum their
        split-K partials themselves (tuning's reduce_in_kernel);
      * the fragment kernel (2..16 rows), on every launch: unsplit, each program finishes its rows;
        split with the sum in-kernel (fragment_sums_in_kernel), the last split; else the reduce kernel;
      * the register-A route at decode (gate_up from 2 rows, the big weights above
        wgmma_small_min_m, every weight above 16 rows) where its one launch splits K
        (wgmma_reduces): the reduce kernel. Where it does not (7B gate_up from 2 rows on an H100:
        its 592 row tiles leave no room in the decode wave for a second split), the kernel stores y
        itself, and the expand kernel stays.
    (Measured on an H200, 7B, train.py's adapters: decode at 8 and 16 sequences as fast as with the
    expand kernel, within the run's noise; ab_lora_7b_h200.json, `lora_fold_decode`.)"""
    t = tuning.current()
    if M > shapes.FRAGMENT_MAX_M:
        return reduce_folds_lora(M, N, K, device, interleaved)
    kernel = route(M, N, K, device, interleaved)
    if kernel in ("gemv", "tiles"):
        return t.reduce_in_kernel
    return kernel == "fragment" or wgmma_reduces(M, N, K, device)


def carries_shrink(M: int, N: int, K: int, device, interleaved: bool) -> bool:
    """Can the launch that folds a LoRA update at M rows (folds_lora) compute the update's shrink in
    its first programs too (Fold.shrink)? Where that launch is the reduce kernel after the matmul: a
    split fragment launch that leaves its sum to it, or a split register-A launch. Not where the
    matmul folds the update itself (the GEMV, the swapped tiles, a fragment launch that finishes y):
    there the carried programs take the matmul's own slots in its one wave (a fragment kernel
    carrying them makes the step slower at 2 and 8 rows than a shrink launch before it does)."""
    if not folds_lora(M, N, K, device, interleaved):
        return False
    kernel = route(M, N, K, device, interleaved)
    if kernel == "fragment":
        cfg = shapes.fwd_config(M, N, K)
        split, _, step = shapes.mma_launch(cfg, M, shapes.mma_tiles(N, cfg), K, device)
        return not fragment_finishes(M, split, step)
    return kernel == "wgmma"


def fragment_finishes(M: int, split: int, step: int) -> bool:
    """Does a fragment launch of M rows, `split` splits and `step` windows a loop step store y itself
    (unsplit, or its last split summing the others: tuning's reduce_in_kernel and
    fragment_sums_in_kernel), rather than leave the sum to the reduce kernel?"""
    return split == 1 or (tuning.current().reduce_in_kernel and fragment_sums_in_kernel(M, step))


def reduce_folds_lora(M: int, N: int, K: int, device, interleaved: bool) -> bool:
    """Can matmul take a LoRA update in the h form (h = x Aᵀ bf16 (M, R)) at M rows? Where the
    register-A kernel runs with split-K: the reduce kernel that sums its partials adds s·h·Bᵀ too,
    and the addmm after the matmul is not needed (the GRPO batch's qkv, o and down)."""
    return wgmma_rows(M, N, K, device, interleaved) and wgmma_reduces(M, N, K, device)


def wgmma_reduces(M: int, N: int, K: int, device) -> bool:
    """Does the register-A route's product at M rows end in the reduce kernel? Where it is one launch
    (shapes.wgmma_launches) that splits K; a second launch's pieces sum themselves, and an unsplit
    launch stores y itself. _wgmma folds a LoRA update only here."""
    launches = shapes.wgmma_launches(M, N, K, shapes.wgmma_config(M), device)
    return len(launches) == 1 and launches[0][3] > 1


def folds_silu(M: int) -> bool:
    """Can matmul apply SiLU·mul to a stacked gate/up product itself (silu_mul=True)? Where the GEMV
    runs, whose programs finish their rows in one pass: the gate rows and the same up rows go to
    one program, which stores silu(gate)·up."""
    return M <= GEMV_ROWS


# ----------------------------------------------------------------------------------------------
# the wrappers: allocate, launch


def dequantize_bf16(packed, scale, global_scale, il=False):
    """W (N, K) bf16 in one pass (K must be a multiple of 64): the large-M route feeds it to cuBLAS.
    il: W interleaved (nvfp4.interleave), as in every wrapper below."""
    N, K = packed.shape[0], packed.shape[1] * 2
    out = torch.empty((N, K), device=packed.device, dtype=torch.bfloat16)
    BN, BK = 64, shapes.fit(128, K)
    sb = scale.view(torch.uint8)
    _nvfp4_dequant_kernel[(cdiv(N, BN), K // BK)](
        packed, sb, global_scale, out, N, K, packed.stride(0), sb.stride(0),
        BN=BN, BK=BK, IL=il, INTERPRET=launch.interpreting(), num_warps=4, **launch.pdl_launch(packed.device))
    return out


def _split_targets(out, tiles, split, reduce):
    """What a kernel that can sum its own split-K partials takes after them: (y, counts) (out itself
    where unused) and its PARTIAL / REDUCE / NSPLIT constexprs."""
    counts = launch.split_counts(out.device, tiles) if reduce else out
    return (out, counts), dict(PARTIAL=split > 1, REDUCE=reduce, NSPLIT=split if reduce else 1)


def _reduce(part, global_scale, bias, out, lora=None):
    """out = sum of the partials (scaled, + bias); nothing to do if the launch wrote out itself.
    lora: also out += the LoRA update (tiles._splitk_reduce_lora_kernel), in either of matmul's
    forms: (h, B, s) with h (M, R) bf16, or (hp, B, s) with hp (split, M, R) fp32 partials (a
    Fold's cuts: a group's compact B)."""
    if part is out:
        return out
    if lora is not None:
        h, B, s = lora[:3]
        # decode (hp: the shrink's partials, to lora_max_m rows): narrow tiles, many programs
        # (Tuning.reduce_lora_cols); the GRPO batch (h from F.linear): 16 x 128 tiles, the shape its step
        # is measured with
        (M, N), BM, BN = out.shape, 16, tuning.current().reduce_lora_cols if h.dim() == 3 else 128
        shrink_ptrs, shrink_meta = shrink_args(_carried(lora), out)
        _splitk_reduce_lora_kernel[(shrink_meta["NS"] + cdiv(M, BM) * cdiv(N, BN),)](
            part, global_scale, bias if bias is not None else out, out, h, B, s, B.shape[1],
            *lora_cuts(_cuts(lora), N), *shrink_ptrs, M, N, h.shape[-1], part.shape[0],
            HAS_BIAS=bias is not None, BM=BM, BN=BN, LSPLIT=1 if h.dim() == 2 else h.shape[0],
            PARTS=_lora_members(lora),
            INTERPRET=launch.interpreting(), **shrink_meta, **launch.pdl_launch(out.device))
        return out
    numel = out.numel()
    BLOCK = 1024
    _splitk_reduce_kernel[(cdiv(numel, BLOCK),)](
        part, global_scale, bias if bias is not None else out, out, numel, out.shape[1],
        part.shape[0], HAS_BIAS=bias is not None, BLOCK=BLOCK, INTERPRET=launch.interpreting(),
        **launch.pdl_launch(out.device))
    return out


def _carried(lora):
    """The shrink a Fold carries (its h computed by the launch that folds it), or None."""
    return getattr(lora, "shrink", None)


def _cuts(lora):
    """Where a Fold's compact B cuts between its group's members (lora.group_casts), or None: one
    member, or a plain (h, B, s) tuple."""
    return getattr(lora, "cuts", None)


def _late_wait(lora) -> bool:
    """Does the kernel wait on the launch before it only after its main loop (LATE_WAIT)? Where it
    folds the partials of a shrink that did not write x (Fold)."""
    return lora is not None and not getattr(lora, "x_fresh", False)


def _lora_args(lora, out, split, reduce):
    """A launch's LoRA arguments: (hp, B, s, RB, N1, N2) (B's ranks a row and fp4_decode._lora_part's
    cuts), R (h's ranks) and the constexprs LORA, LSPLIT (dummies without lora); the kernels that
    fold it by MMAs take LPARTS too (_lora_members). The update folds in
    only where the kernel finishes its own tiles (one pass, or the split sum in-kernel): else a clear
    error."""
    if lora is not None and split > 1 and not reduce:
        raise ValueError("the LoRA update folds into a kernel only where it sums its own split-K partials "
                         "(tuning's reduce_in_kernel; see folds_lora)")
    if lora is None:
        return (out, out, 0.0, 1, 1, 1), 1, dict(LORA=False, LSPLIT=1)
    hp, lb, ls = lora[:3]
    return ((hp, lb, ls, lb.shape[1], *lora_cuts(_cuts(lora), lb.shape[0])), hp.shape[-1],
            dict(LORA=True, LSPLIT=hp.shape[0]))


def _gemv_fold_flags(lora, lora_ptrs) -> dict:
    """The one-row GEMVs' (gemv.py, gemv_tma.py) constexprs for the update they fold: LR, the ranks
    a row of B holds as a power of two (>= 16, a tile side), when they wait on the launch before
    (_late_wait), and whether they ask L2 for B's rows first (Tuning.lora_b_prefetch)."""
    return dict(LR=max(16, triton.next_power_of_2(lora_ptrs[3])), LATE_WAIT=_late_wait(lora),
                PREFETCH_B=tuning.current().lora_b_prefetch)


def _lora_members(lora) -> int:
    """The constexpr LPARTS of a launch that folds lora by MMAs (fp4_decode._lora_update_tile)."""
    return 1 if lora is None else lora_parts(_cuts(lora), lora[1].shape[0])


def _matmul(x, packed, scale, global_scale, bias, cfg, lora=None, il=False):
    """y = x·Wᵀ (+bias) (+ the LoRA update lora = (hp, B, s)) with the tile kernel in cfg's shape."""
    scale = scale.view(torch.uint8)          # E4M3 bits; decoded in-kernel
    pdl = launch.pdl_launch(x.device)
    if x.shape[1] % MIN_RED:               # odd K: pad the reduction (a copy; model shapes never), which
        x, packed, scale = _pad(x, 1, MIN_RED), _pad(packed, 1, MIN_RED // 2), _pad(scale, 1, MIN_RED // 16)
        pdl = launch.NO_PDL                # writes what the kernel reads: it runs after it, without PDL
    M, K = x.shape
    N = packed.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=torch.bfloat16)
    if M == 0:
        return out
    cfg = replace(cfg, bk=shapes.fit(max(cfg.bk, MIN_RED), K))
    tiles = cdiv(N, cfg.bn) * cdiv(M, cfg.bm)
    # swapped (small M, memory-bound): ~4 programs per SM; not swapped (one tile is ~8x more MMA
    # work, and 2 programs fit on an SM): ~1.5 per SM, so the fp32 partials stay small
    sms = launch.num_sms(x.device)
    split, k_split = shapes.split(cfg.split, tiles, K, cfg.bk, 4 * sms if cfg.swap else 3 * sms // 2)
    part = launch.partials(split, out)
    # the swapped tiles sum their own split-K partials; the 128 x 128 medium tiles do not (their last
    # split would read split x 64 KB alone)
    reduce = split > 1 and cfg.swap and tuning.current().reduce_in_kernel
    targets, flags = _split_targets(out, tiles, split, reduce)
    lora_ptrs, R, lora_flags = _lora_args(lora, out, split, reduce)
    _nvfp4_mm_kernel[(tiles, split)](
        x, packed, scale, global_scale, bias if bias is not None else out, part,
        *targets, *lora_ptrs,
        M, N, K, k_split, R,
        x.stride(0), packed.stride(0), scale.stride(0), N, M * N,
        HAS_BIAS=bias is not None, **flags, **lora_flags, LPARTS=_lora_members(lora), LATE_WAIT=_late_wait(lora),
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP=cfg.group, SWAP_AB=cfg.swap, IL=il,
        INTERPRET=launch.interpreting(), num_warps=cfg.warps, num_stages=cfg.stages, **pdl)
    return out if reduce else _reduce(part, global_scale, bias, out)


def _gemv(x, packed, scale, global_scale, bias, cfg, lora=None, il=False, silu_mul=False):
    """y = x·Wᵀ (+bias) (+ the LoRA update lora = (hp, B, s)) on CUDA cores for one row of x (K a
    multiple of 16; padded to 32 if odd); with silu_mul, silu(y[:, :N/2])·y[:, N/2:] (see matmul).
    Where gemv_tma_takes the weight, the TMA-fed GEMV computes it in its own launch shape (cfg
    unused); else gemv.py in cfg's."""
    M, K = x.shape
    N = packed.shape[0]
    if M > GEMV_ROWS:
        raise ValueError(f"the CUDA-core kernel takes one row of x, got {M}")
    out = torch.empty((M, N // 2 if silu_mul else N), device=x.device, dtype=torch.bfloat16)
    if M == 0:
        return out
    if gemv_tma_takes(N, K, x.device, il):
        return _gemv_tma(x, packed, scale, global_scale, bias, out, lora, silu_mul)
    pdl = launch.pdl_launch(x.device)
    if K % 32:                               # a weight row must be whole 16-byte loads; the pad writes
        x, packed, scale = _pad(x, 1, 32), _pad(packed, 1, 16), _pad(scale.view(torch.uint8), 1, 2)
        K, pdl = x.shape[1], launch.NO_PDL   # what the kernel reads before its wait: no PDL then
    bk = min(cfg.bk, triton.next_power_of_2(K))
    tiles = cdiv(out.shape[1], cfg.bn // 2 if silu_mul else cfg.bn)
    split, k_split = shapes.gemv_split(cfg, tiles, K, bk, silu_mul, launch.num_sms(x.device))
    part = launch.partials(split, out)
    reduce = split > 1 and tuning.current().reduce_in_kernel
    targets, flags = _split_targets(out, tiles, split, reduce)
    x2 = x.view(torch.int32)                 # (1, K/2): one bf16 pair per word
    sb = scale.view(torch.uint8)             # E4M3 bits; decoded in-kernel
    lora_ptrs, R, lora_flags = _lora_args(lora, out, split, reduce)
    _nvfp4_gemv_kernel[(tiles, split)](
        x2, packed, sb, global_scale, bias if bias is not None else out, part,
        *targets, *lora_ptrs,
        M, N, K // 2, k_split // 2, R,
        packed.stride(0), sb.stride(0), out.shape[1], M * N,
        HAS_BIAS=bias is not None, **flags, **lora_flags, **_gemv_fold_flags(lora, lora_ptrs), SILU=silu_mul,
        BN=cfg.bn, BK=bk, IL=il, INTERPRET=launch.interpreting(),
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl)
    return out if reduce else _reduce(part, global_scale, bias, out)


def gemv_tma_takes(N: int, K: int, device, interleaved: bool) -> bool:
    """Does the TMA-fed GEMV (gemv_tma.py) compute y at one row? On weights of more than
    gemv_tma_weight elements (gate_up; 32B down), K a multiple of 512 and N of 32, where Gluon runs
    (gluon_runs). The others keep gemv.py, faster there."""
    return (N * K > tuning.current().gemv_tma_weight and K % 512 == 0 and N % 32 == 0
            and gluon_runs(device, interleaved))


def _gemv_tma(x, packed, scale, global_scale, bias, out, lora, silu_mul):
    """_gemv's product on the TMA-fed GEMV: split as shapes.gemv_tma_split says (never with
    silu_mul), the split sum and the LoRA update in-kernel."""
    N, K = packed.shape[0], x.shape[1]
    tiles = N // gemv_tma.BN.value
    split, steps = (1, K // 512) if silu_mul else shapes.gemv_tma_split(tiles, K, launch.num_sms(x.device))
    part = launch.partials(split, out)
    counts = launch.split_counts(x.device, tiles) if split > 1 else out
    lora_ptrs, R, lora_flags = _lora_args(lora, out, split, True)
    gemv_tma._gemv_tma_kernel[(tiles, split)](
        x.view(torch.int32), *rak.weight_descriptors(packed, scale, 16), global_scale,
        bias if bias is not None else out, part, out, counts, *lora_ptrs, N, R, K // 512, steps, split, N,
        HAS_BIAS=bias is not None, PARTIAL=split > 1, **lora_flags, **_gemv_fold_flags(lora, lora_ptrs),
        SILU=silu_mul, S=gemv_tma.STAGES, num_warps=4, maxnreg=gemv_tma.REGS, **launch.pdl_launch(x.device))
    return out


def _mma(x, packed, scale, global_scale, bias, cfg, lora=None, il=False):
    """y = x·Wᵀ (+bias) (+ the LoRA update lora = (hp, B, s)) with the fragment kernel: M <= 16, K a
    multiple of 128. The update is added by the kernel where it finishes y (unsplit, or the split sum
    in-kernel), else by the reduce kernel after it: every launch folds it."""
    M, K = x.shape
    N = packed.shape[0]
    if M > shapes.FRAGMENT_MAX_M or K % 128:
        raise ValueError(f"the fragment kernel takes M <= 16 and K a multiple of 128, got M={M}, K={K}")
    out = torch.empty((M, N), device=x.device, dtype=torch.bfloat16)
    if M == 0:
        return out
    tiles = shapes.mma_tiles(N, cfg)
    split, per, step = shapes.mma_launch(cfg, M, tiles, K, x.device)
    part = launch.partials(split, out)
    finishes = fragment_finishes(M, split, step)       # the kernel stores y: it adds the update
    reduce = split > 1 and finishes
    targets, flags = _split_targets(out, tiles, split, reduce)
    if finishes and _carried(lora) is not None:
        raise ValueError("a fragment launch that stores y itself takes no carried shrink (carries_shrink)")
    lora_ptrs, R, lora_flags = _lora_args(lora if finishes else None, out, split, reduce)
    x2, p4, sb = x.view(torch.int32), packed.view(torch.int32), scale.view(torch.uint8)
    _nvfp4_mma_kernel[(tiles, split)](
        x2, p4, sb, global_scale, bias if bias is not None else out, part,
        *targets, *lora_ptrs,
        M, N, K // 128, per, R,
        x2.stride(0), p4.stride(0), sb.stride(0), N, M * N,
        HAS_BIAS=bias is not None, **flags, **lora_flags, LPARTS=_lora_members(lora if finishes else None),
        LATE_WAIT=_late_wait(lora), W=cfg.warps, R=cfg.tiles, NT=1 if M <= 8 else 2, IL=il, U=step,
        AHEAD=shapes.mma_ahead(M),
        INTERPRET=launch.interpreting(), num_warps=cfg.warps, num_stages=1, **launch.pdl_launch(x.device))
    return out if finishes else _reduce(part, global_scale, bias, out, lora)


def _wgmma(x, packed, scale, global_scale, bias, cfg, lora=None):
    """y = x·Wᵀ (+bias) with the register-A wgmma kernel: W interleaved, K a multiple of 128, sm_90
    with triton 3.6 (wgmma_rows). x is first permuted into the operand's k order (one pass), then
    shapes.wgmma_launches' launches. lora = (h, B, s) (h bf16 (M, R)) or (hp, B, s) (the shrink's
    partials, at decode): the split-K reduce also adds the update (wgmma_reduces)."""
    M, K = x.shape
    N = packed.shape[0]
    if K % 128:
        raise ValueError(f"the wgmma kernel takes interleaved weights, K a multiple of 128, got K={K}")
    out = torch.empty((M, N), device=x.device, dtype=torch.bfloat16)
    if M == 0:
        return out
    launches = shapes.wgmma_launches(M, N, K, cfg, x.device)
    if lora is not None and (len(launches) > 1 or launches[0][3] == 1):
        raise ValueError("a LoRA update folds into the register-A route only where its one launch splits K "
                         "(wgmma_reduces)")
    ws = shapes.warp_specialized(cfg)
    xp = rak.fragment_order(x, launch.pdl_launch(x.device), cdiv(M, cfg.bt) * cfg.bt if ws else 0)
    b = bias if bias is not None else out
    for c, tile0, nt, split, chunk in launches:
        C = c.warps // 4 if ws else 1        # consumer warpgroups of the warp-specialized kernel
        warps = c.warps // C
        mt = cdiv(M, c.bt)
        reduce = split > 1 and len(launches) > 1       # a tail's pieces sum themselves, in whole fp32 tiles
        part = (torch.empty((split, nt * mt, c.bn * c.bt), device=x.device, dtype=torch.float32) if reduce
                else launch.partials(split, out))
        meta = dict(LW=rak.word_layout(c.bn // C, warps), LS=rak.scale_layout(c.bn // C, warps), BN=c.bn, BT=c.bt,
                    S=c.stages, HAS_BIAS=bias is not None, PARTIAL=split > 1, num_warps=warps,
                    **launch.pdl_launch(x.device))
        if ws:
            rak._wgmma_ws_kernel[(nt, mt, split)](
                *rak.descriptors(xp, packed, scale, out, c.bn // C, c.bt), global_scale, b, part,
                launch.split_counts(x.device, nt * mt * C) if reduce else out, M, N, K // 128, chunk, tile0, N,
                M * N, C=C, REDUCE=reduce, maxnreg=shapes.MAX_REGS[c.warps], **meta)
        else:
            rak._wgmma_ring_kernel[(nt, mt, split)](
                xp, packed.view(torch.int32), scale.view(torch.uint8), global_scale, b, part, M, N, K // 128, chunk,
                xp.stride(0), N, M * N, **meta)
    return out if len(launches) > 1 else _reduce(part, global_scale, bias, out, lora)


def _matmul_dx(dy, packed, scale, global_scale, cfg, il=False):
    """dx = dy·W with the tile kernel in cfg's shape."""
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
    cfg = replace(cfg, bk=shapes.fit(max(cfg.bk, MIN_RED), K), bn=shapes.fit(max(cfg.bn, MIN_RED), N))
    tiles = cdiv(K, cfg.bk) * cdiv(M, cfg.bm)
    split, n_split = shapes.split(cfg.split, tiles, N, cfg.bn, 4 * launch.num_sms(dy.device))
    part = launch.partials(split, out)
    _nvfp4_mm_dx_kernel[(tiles, split)](
        dy, packed, scale, global_scale, part,
        M, N, K, n_split,
        dy.stride(0), packed.stride(0), scale.stride(0), K, M * K,
        PARTIAL=split > 1,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_K=cfg.group, IL=il, INTERPRET=launch.interpreting(),
        num_warps=cfg.warps, num_stages=cfg.stages, **launch.pdl_launch(dy.device))
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
    pdl = launch.pdl_launch(dy.device)
    BT, BK = shapes.DX_BT, shapes.DX_BK
    _, split, chunk = shapes.dx_launch(M, N, K, dy.device, split)
    part = launch.partials(split, out)
    dyp = rak.fragment_order(dy, pdl, cdiv(M, BT) * BT, dx=True)
    rad._dx_kernel[(cdiv(K, BK), cdiv(M, BT), split)](
        *rad.dx_descriptors(dyp, packed, scale, out), global_scale, part, M, K, N // 128, chunk, PARTIAL=split > 1,
        num_warps=4, maxnreg=shapes.MAX_REGS[8], **pdl)
    return _reduce(part, global_scale, None, out)


# ----------------------------------------------------------------------------------------------
# the entry points


def matmul(x, packed, scale, global_scale, bias=None, interleaved=False, lora=None, silu_mul=False):
    """y (M, N) bf16 = x (M, K) bf16 · dequant(W)ᵀ (+ bias (N,) bf16), fp32 accumulation, on the
    kernel route() picks. interleaved: packed and scale hold nvfp4.interleave's layout.
    lora = (hp, B, s), where folds_lora(M, N, K, ...): also y += s · bf16(Σ_j hp[j]) · Bᵀ, the update
    of lora.lora_expand_ (hp (split, M, R) fp32 from lora.lora_shrink, launched just before this call
    on this x, B (N, R) bf16, or (N, R / members) where a Fold's cuts make it a group's compact B):
    the kernel streams x and W before it waits on that launch (LATE_WAIT in
    fp4_decode.pdl_start), so nothing may write x between the two (a Fold with x_fresh: the
    launch before wrote x and hp, lora.norm_shrink, and the kernel waits first; a Fold with a shrink:
    the reduce launch after a split matmul computes hp itself, carries_shrink); or lora = (h, B, s) with
    h = x Aᵀ bf16 (M, R), where reduce_folds_lora: y += s · h · Bᵀ, added by the reduce
    kernel of the register-A route; elsewhere a ValueError, never a dropped update. silu_mul, where
    folds_silu(M): W stacks gate and up (N = 2I rows), and the result is silu(y[:, :I])·y[:, I:]
    (M, I), the bits of fused_ops.silu_mul on the two halves of y."""
    N, K = _check_weight(packed, scale, global_scale, x.device, interleaved)
    _check_act("x", x, K)
    M = x.shape[0]
    if silu_mul and (not folds_silu(M) or N % 32):
        raise ValueError(f"silu_mul needs M <= {GEMV_ROWS} (folds_silu) and N = 2I with I a multiple of 16, "
                         f"got M={M}, N={N}")
    if bias is not None:
        if bias.dtype != torch.bfloat16 or tuple(bias.shape) != (N,) or not bias.is_contiguous():
            raise ValueError(f"bias must be a contiguous bf16 tensor of shape ({N},), got "
                             f"{bias.dtype} {tuple(bias.shape)}")
    if lora is not None:       # every route that runs here folds it, or the check says no
        lora = Fold(*lora)
        _check_lora(lora, M, N, K, x.device, interleaved)
    kernel = route(M, N, K, x.device, interleaved)
    if kernel == "wgmma":
        return _wgmma(x, packed, scale, global_scale, bias, shapes.wgmma_config(M), lora)
    if kernel == "dequant+cublas":
        return F.linear(x, dequantize_bf16(packed, scale, global_scale, interleaved), bias)
    cfg = shapes.fwd_config(M, N, K)
    if kernel == "gemv":                     # every silu_mul
        return _gemv(x, packed, scale, global_scale, bias, cfg, lora, interleaved, silu_mul)
    if kernel == "fragment":
        return _mma(x, packed, scale, global_scale, bias, cfg, lora, interleaved)
    return _matmul(x, packed, scale, global_scale, bias, cfg, lora, interleaved)


def nvfp4_matmul(x, packed, scale, global_scale, bias=None, interleaved=False):
    """y (M, N) bf16 = x (M, K) bf16 · dequant(W)ᵀ (+ bias (N,) bf16): matmul without folds."""
    return matmul(x, packed, scale, global_scale, bias, interleaved)


def nvfp4_matmul_dx(dy, packed, scale, global_scale, interleaved=False):
    """dx (M, K) bf16 = dy (M, N) bf16 · dequant(W), fp32 accumulation (backward of y = x·Wᵀ)."""
    N, K = _check_weight(packed, scale, global_scale, dy.device, interleaved)
    _check_act("dy", dy, N)
    M = dy.shape[0]
    kernel = route(M, N, K, dy.device, interleaved, dx=True)
    if kernel == "wgmma":
        return _wgmma_dx(dy, packed, scale, global_scale)
    if kernel == "dequant+cublas":
        return dy @ dequantize_bf16(packed, scale, global_scale, interleaved)
    return _matmul_dx(dy, packed, scale, global_scale, shapes.dx_config(M, N, K), interleaved)


def linear(x, packed, scale, global_scale, bias=None, interleaved=False, lora=None, silu_mul=False):
    """matmul on x (..., K) bf16 with a bias of any float dtype (cast to bf16): y (..., N), or
    (..., N/2) with silu_mul. The wing's own call on an NVFP4Linear's buffers, where it folds a LoRA
    update or SiLU·mul into the matmul (lora.py, stacked.py)."""
    x2d = x.reshape(-1, x.shape[-1])                                      # (M, K)
    if lora is not None and lora[0].dim() == 3 and not x2d.is_contiguous():
        raise ValueError("linear: with lora partials, x must be contiguous: the kernel reads x before it waits "
                         "on the shrink (matmul), so no copy of x may run between them")
    b = bias.to(torch.bfloat16) if bias is not None else None
    y = matmul(x2d.contiguous(), packed, scale, global_scale, b, interleaved, lora, silu_mul)
    return y.view(*x.shape[:-1], y.shape[-1])                             # (..., N or N/2)
