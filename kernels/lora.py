"""The LoRA update on the rollout path: y = base(x) + s · (x Aᵀ) Bᵀ, with as few launches as it takes.

Why. A GRPO rollout samples with the adapters live (rollout.py runs the training model itself), so
every projection of every decode step adds s · (x Aᵀ) Bᵀ to its base output. In torch that is a GEMM
and an addmm per adapter: two cuBLAS launches per adapted linear that take no part in programmatic
dependent launch, and at batch 1 each costs more than its few megabytes of A and B. So:

  * up to tuning's lora_max_m rows (decode steps of up to 32 sequences) two Triton kernels do it,
    launched with PDL like the rest of the step, every row of x in one MMA tile of 16, 32 or 64:

        shrink, program (r-tile i, k-chunk j):   part[j, :, i] = x[:, K_j] · A[i, K_j]ᵀ        fp32
                                                 the last of row i's chunks: hp[:, i] = Σ_j part[j]
                (at one row, program (m, r):     hp[m, r] = x[m, :] · A[r, :]   whole rows: row_shrink)
        expand, program (n-tile):                h = bf16(hp)               (M, R)
                                                 y[:, n] = y[:, n] + s · h · B[n, :]ᵀ       in place

    h is rounded to the activation dtype before the expand, as F.linear's output is on the torch
    path (training computes the same update that way), so the two paths differ only in summation
    order. The shrink is latency, not bytes (A is a few hundred KB): each program takes one chunk
    of tuning's lora_shrink_k in one load, issued before its programmatic-dependent-launch wait
    (A is a weight: fp4_decode.pdl_start's rule), so the loads overlap the kernel before; the
    chunk that finishes last sums the row tile's partials in chunk order (deterministic) into hp.
    At one row (tuning's row_shrink_max_m) a program takes a whole row of x and of A instead (the
    norm + shrink launch below without its norm), so no partials wait for a last program to sum them.
  * on an NVFP4 base the shrink runs before the base matmul (early_shrink: it reads x only), and
    whatever finishes y adds the update as it stores y (fold_expand, gemm.folds_lora): the GEMV (1
    row), the fragment kernel (2 to 16 rows: unsplit, or its last split summing the others) or the
    swapped tiles, else the split-K reduce kernel after a split fragment or register-A launch. No
    expand launch, except beside a register-A launch that does not split K (7B gate_up from 2
    rows), whose kernel stores y itself: the expand follows it there, and for gate/up it applies
    SiLU·mul in the same launch (expand_silu_mul: the SiLU·mul kernel's work, gate and up never
    written back). On a bf16 base both kernels follow cuBLAS (the gate/up expand with SiLU·mul
    too). (Measured on an H200, 7B, train.py's adapters: the shrink first beside the fragment
    kernel too, and PDL after it, decode 8 and 16 sequences 8-9% faster than both kernels after it
    without PDL; bench/ab.py.)
  * where a launch after the NVFP4 matmul adds the update (the reduce kernel after a split launch,
    the expand kernel after gate/up's), that launch computes the shrink as well, from 2 rows
    (carries, carried_shrink): its first programs run lora_shrink's chunks and sums (x was written
    before the matmul, so they need not wait for it) while the matmul streams, and its other programs
    wait for their flag (fp4_decode._carried_shrink / _await_shrink) before they add the update.
    No shrink launch then stands between x's producer and the matmul.
  * where the group's input comes from an RMSNorm (q/k/v, gate/up) at up to tuning's
    norm_shrink_max_m rows, the shrink runs inside the norm's launch instead (norm_shrink): under
    PDL a launch is scheduled only once the kernel two places ahead has finished, so a shrink
    launched between the norm and the matmul keeps the matmul off the SMs until the norm is done,
    where without it the matmul is resident and streaming its first weights during the norm. Each
    program of that launch normalizes its whole row (the norm kernel's own device functions, so y
    has its bits), stores a share of it, and dots it with whole rows of A: h needs no partial sums
    and the launch takes one round trip after its wait, as the norm alone does. The matmul then
    waits before it reads x (gemm.Fold's x_fresh).
  * beyond lora_max_m rows (prefill, and the log-prob pass) the shrink is F.linear, and where the NVFP4 matmul's
    register-A route splits K its reduce kernel adds s·h·Bᵀ (fold_in_reduce: qkv, o and down);
    elsewhere one addmm (a group's compact B: one a member, on its columns), in place on the fresh base
    output without autograd (a copy of y first would cost more than the addmm).

The adapters of a stacked group (q/k/v, gate/up: stacked.py) update together: their A's stacked
(Σr, in) and their B's as one (Σ out, r), each row holding its own member's r ranks, with the
columns where the members end (group_casts: a third of the block-diagonal (Σ out, Σr) for q/k/v,
half for gate/up; every kernel that adds the update reads each column's ranks of h by
fp4_decode._lora_part), two kernels for the group. Those stacked
copies are kept between calls, as the trunk keeps each adapter's cast copies: every call refreshes
them in place, and a decode graph's capture reads them as they are (the caller says which:
`refresh`), so a graphed decode step has no cast or copy kernels; the prefill that starts every
generate() call refreshes them (eagerly, or as a prefill graph whose capture recorded the copies).

The adapters arrive by duck typing (the wing imports nothing of the trunk): an adapter has base_layer,
lora_A (r, in) and lora_B (out, r) fp32, scaling, enabled, lora_dropout, training, r; an NVFP4
base has weight_packed, weight_scale, weight_global_scale, bias, interleaved and in_features.

Shapes: x (M, K) rows with a stride, A (R, K) and B (N, R) (a compact group's: (N, R / members))
contiguous, y (M, N) contiguous rows, all in one dtype. M is not specialized (do_not_specialize, as
in small_m.py): one binary for every batch bucket, rather than one each for M = 1, M a multiple of
16 and the rest, compiled whenever a run first reaches such a bucket. Under TRITON_INTERPRET=1 the
dots run in fp32 (the interpreter's bf16 tl.dot is wrong), as in the other kernels.
Tests: tests/test_kernels_lora.py (interpreter: the kernels against float64 with odd sizes, K-splits
and row-strided x and y, the expand launches carrying the shrink, bf16 rounding of h, bad input, the
in-place addmm, where the expand folds;
GPU: one adapter and a q/k/v group against the torch path, folded into the NVFP4
GEMV, the fragment kernel and the reduce kernel or not; 7B's q/k/v, gate/up and down at decode, folded
against the expand kernel); the folded update itself: tests/test_kernels_small_m.py, the reduce
kernel's: tests/test_kernels_tiles.py.
"""
import functools
import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

from . import gemm, launch, tuning
from .fp4_decode import (SHRINK_READY, _await_shrink, _carried_shrink, _lora_part, _shrink_chunk, pdl_start,
                         silu_mul as silu_mul_math)
from .fused_ops import norm_inputs, norm_row

ROW_SHRINK_MAX_C = 32768   # columns a row_shrink program holds whole (its row and a row of A, 16 warps)
SHRINK_TILES = SHRINK_READY.value   # rank tiles a carried shrink counts (its flags: launch.shrink_flags)

# ----------------------------------------------------------------------------------------------
# where each piece runs


def _nvfp4(base) -> bool:
    return hasattr(base, "weight_packed")


def early_shrink(base) -> bool:
    """Run the shrink before the base matmul (it reads x only)? On an NVFP4 base: its A loads then
    overlap the matmul before it, and the matmul may fold the expand in (fold_expand). On a bf16 base
    cuBLAS runs first and both kernels follow it (with PDL, as everywhere)."""
    return _nvfp4(base)


def fold_expand(base, x2, B) -> bool:
    """After an early shrink, let the base matmul add the update instead of the expand kernel? For
    bf16 rows x2 (M, K) and an NVFP4 base, where gemm.folds_lora holds for the product the update
    lands on, (M, N = B's rows, K), which is a stack's for a group: whoever stores a tile of y (the
    GEMV, the fragment kernel, the swapped tiles, or the reduce kernel after a split launch) adds
    s·h·Bᵀ first (fp4_decode._lora_update, _lora_update_tile), one launch per adapter group fewer."""
    return (_nvfp4(base) and x2.dtype == torch.bfloat16
            and gemm.folds_lora(x2.shape[0], B.shape[0], x2.shape[1], x2.device, base.interleaved))


def fold_in_reduce(base, h, B) -> bool:
    """Let the base matmul's split-K reduce add s·h·Bᵀ (h = x Aᵀ bf16 from F.linear, B (N, r))
    instead of the addmm after it? Beyond lora_max_m rows, without autograd, on an NVFP4 base whose
    register-A launch splits K (gemm.reduce_folds_lora: the GRPO batch's qkv, o and down; gate/up
    does not split)."""
    rows = h.numel() // h.shape[-1]
    return (_nvfp4(base) and h.is_cuda and h.dtype == torch.bfloat16 and not torch.is_grad_enabled()
            and rows > tuning.current().lora_max_m
            and gemm.reduce_folds_lora(rows, B.shape[0], base.in_features, h.device, base.interleaved))


# ----------------------------------------------------------------------------------------------
# the kernels

@triton.jit(do_not_specialize=["M"])
def _lora_shrink_kernel(x_ptr, a_ptr, part_ptr, h_ptr, count_ptr, M, R, K, stride_xm,
                        BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                        FP32_DOT: tl.constexpr, USE_PDL: tl.constexpr):
    """h[0, m, r] = sum over k of x[m, k] · A[r, k] for BR rows r; program (i, j) takes the k-chunk j
    (BK wide, one load). Each split stores its partial, and the one that counts last sums them in
    split order (fp4_decode._shrink_chunk): deterministic, one launch."""
    _shrink_chunk(x_ptr, a_ptr, part_ptr, h_ptr, count_ptr, tl.program_id(0), tl.program_id(1), M, R, K, stride_xm,
                  BM, BR, BK, SPLIT, FP32_DOT, USE_PDL, True)


@triton.jit(do_not_specialize=["M"])
def _norm_shrink_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, a_ptr, h_ptr, M, R, C, eps,
                        NORM: tl.constexpr, HAS_RES: tl.constexpr, BR: tl.constexpr, BLOCK_C: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """Program (m, i): row m's RMSNorm whole (fused_ops.norm_row: the norm kernel's bits), its i-th
    share of the columns stored, and h[m, ranks of tile i] = y · A[tile i]ᵀ over all of C in fp32;
    without NORM, y is row m of x itself (the shrink alone: row_shrink). A program holds its row and
    BR whole rows of A, so no program waits on another and h needs no partial sums: one round trip
    to L2 after the wait, as in the norm alone. A (read in full before the wait), the norm's weight
    and the residual stream were written two or more launches back."""
    m, i = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = tl.arange(0, BLOCK_C)
    inside = cols < C
    offs_r = i * BR + tl.arange(0, BR)
    a = tl.load(a_ptr + offs_r[:, None] * C + cols[None, :], mask=(offs_r[:, None] < R) & inside[None, :],
                other=0.0)                                                          # (BR, BLOCK_C)
    if NORM:
        w, r = norm_inputs(w_ptr, res_ptr + m * C, cols, inside, HAS_RES)
    pdl_start(USE_PDL)
    if NORM:
        y, s = norm_row(x_ptr + m * C, r, w, cols, inside, C, eps, HAS_RES)         # (BLOCK_C,)
        mine = inside & (cols // tl.cdiv(C, tl.num_programs(1)) == i)
        tl.store(out_ptr + m * C + cols, y, mask=mine)
        if HAS_RES:
            tl.store(sum_ptr + m * C + cols, s, mask=mine)
    else:
        y = tl.load(x_ptr + m * C + cols, mask=inside, other=0.0)
    h = tl.sum(a.to(tl.float32) * y.to(tl.float32)[None, :], axis=1)              # (BR,)
    tl.store(h_ptr + m * R + offs_r, h, mask=offs_r < R)


@triton.jit(do_not_specialize=["M"])
def _lora_expand_kernel(hp_ptr, b_ptr, y_ptr, sx_ptr, sa_ptr, spart_ptr, sflag_ptr, SK, stride_sxm,
                        M, N, R, RB, N1, N2, stride_ym, scale,
                        SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, RB_PAD: tl.constexpr,
                        PARTS: tl.constexpr, FP32_DOT: tl.constexpr, USE_PDL: tl.constexpr,
                        NS: tl.constexpr, SBM: tl.constexpr, SBR: tl.constexpr, SBK: tl.constexpr,
                        SSPLIT: tl.constexpr, SFP32: tl.constexpr):
    """y[m, n] += scale · bf16(Σ_j hp[j, m, ranks of n]) · B[n, :] for BN columns n, in place (B (N,
    RB): an adapter's, or a group's compact B cut at N1 and N2, fp4_decode._lora_part). With NS, the
    first NS programs compute hp themselves (gemm.shrink_args: the carried shrink)."""
    pid = tl.program_id(0)
    if _carried_shrink(pid, NS, sx_ptr, sa_ptr, spart_ptr, hp_ptr, sflag_ptr, M, R, SK, stride_sxm,
                       SBM, SBR, SBK, SSPLIT, SFP32):
        return
    pid -= NS
    offs_m = tl.arange(0, BM)
    offs_n = pid * BN + tl.arange(0, BN)
    b = _b_rows(b_ptr, offs_n, N, RB, RB_PAD)                                     # (BN, RB_PAD)
    pdl_start(USE_PDL)                               # B is a weight: loaded before the wait, hp and y after it
    if NS > 0:
        _await_shrink(sflag_ptr, R, SBR, tl.num_programs(0) - NS)
    y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ys = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    y = tl.load(ys, mask=y_mask, other=0.0)
    d = _group_product(hp_ptr, b, offs_m, offs_n, M, N, R, RB, N1, N2, SPLIT, y_ptr.dtype.element_ty, FP32_DOT,
                       PARTS)
    tl.store(ys, (y.to(tl.float32) + scale * d).to(y.dtype), mask=y_mask)


@triton.jit
def _b_rows(b_ptr, offs_n, N, RB, RB_PAD: tl.constexpr):
    """B's rows offs_n (BN, RB_PAD), zero past N and RB."""
    offs_r = tl.arange(0, RB_PAD)
    return tl.load(b_ptr + offs_n[:, None] * RB + offs_r[None, :],
                   mask=(offs_n[:, None] < N) & (offs_r[None, :] < RB), other=0.0)


@triton.jit
def _group_product(hp_ptr, b, offs_m, offs_n, M, N, R, RB, N1, N2, SPLIT: tl.constexpr, dtype: tl.constexpr,
                   FP32_DOT: tl.constexpr, PARTS: tl.constexpr):
    """h·Bᵀ (BM, BN) in fp32 for B's rows b (BN, RB_PAD) at columns offs_n of a group of PARTS
    members: a product for each member whose columns the tile holds, h that member's ranks, B's
    other rows zero (fp4_decode._lora_part, _lora_update_tile's pattern), so that a column's sum is
    its own member's alone. The members spanned come from a min and max over the columns, where
    _lora_update_tile takes them from its first and last column: here that form compiles to more
    registers (72 against 64 for 7B's q/k/v group on sm_90)."""
    d = tl.zeros((offs_m.shape[0], offs_n.shape[0]), tl.float32)
    if PARTS == 1:
        d = _member_dot(d, hp_ptr, b, 0, offs_m, M, R, RB, SPLIT, dtype, FP32_DOT)
    else:
        part = _lora_part(offs_n, N1, N2)                                         # (BN,)
        first, last = tl.min(part, 0), tl.max(tl.where(offs_n < N, part, 0), 0)
        for p in tl.static_range(PARTS):
            if (p >= first) & (p <= last):
                bp = tl.where((part == p)[:, None], b, tl.zeros_like(b))
                d = _member_dot(d, hp_ptr, bp, p, offs_m, M, R, RB, SPLIT, dtype, FP32_DOT)
    return d


@triton.jit
def _member_dot(d, hp_ptr, b, p, offs_m, M, R, RB, SPLIT: tl.constexpr, dtype: tl.constexpr,
                FP32_DOT: tl.constexpr):
    """d + h[:, member p's ranks] · bᵀ, b (BN, RB_PAD) the rows of B member p holds (the others zero)."""
    h = _summed_h(hp_ptr, offs_m, p * RB + tl.arange(0, b.shape[1]), M, R, SPLIT, dtype)   # (BM, RB_PAD)
    if FP32_DOT:
        return tl.dot(h.to(tl.float32), tl.trans(b.to(tl.float32)), d, input_precision="ieee")
    return tl.dot(h, tl.trans(b), d)                                            # (BM, BN)


@triton.jit
def _summed_h(hp_ptr, offs_m, offs_r, M, R, SPLIT: tl.constexpr, dtype: tl.constexpr):
    """h = Σ_j hp[j] (BM, ranks offs_r), rounded to the activations' dtype as F.linear's h is."""
    h_mask = (offs_m[:, None] < M) & (offs_r[None, :] < R)
    h = tl.zeros((offs_m.shape[0], offs_r.shape[0]), tl.float32)
    for j in tl.static_range(SPLIT):                  # unrolled: the loads go out together
        h += tl.load(hp_ptr + (j * M + offs_m[:, None]) * R + offs_r[None, :], mask=h_mask, other=0.0)
    return h.to(dtype)


@triton.jit(do_not_specialize=["M"])
def _expand_silu_kernel(hp_ptr, b_ptr, y_ptr, out_ptr, sx_ptr, sa_ptr, spart_ptr, sflag_ptr, SK, stride_sxm,
                        M, I, R, RB, stride_ym, scale,
                        SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, RB_PAD: tl.constexpr,
                        UP: tl.constexpr, FP32_DOT: tl.constexpr, USE_PDL: tl.constexpr,
                        NS: tl.constexpr, SBM: tl.constexpr, SBR: tl.constexpr, SBK: tl.constexpr,
                        SSPLIT: tl.constexpr, SFP32: tl.constexpr):
    """out[m, n] = silu(g)·u for BN columns n of I, where g and u are y's gate column n and up column
    I + n after the expand (_lora_expand_kernel's arithmetic); with NS, the carried shrink in the
    first NS programs, as there. Gate's columns are one member and up's another, so each takes one
    product, no test of which member a column is: UP is up's member, 1 where B (2I, RB) is the group's
    compact B (h's ranks [RB, 2RB)), 0 where B holds all of h's ranks in every row (RB = R)."""
    pid = tl.program_id(0)
    if _carried_shrink(pid, NS, sx_ptr, sa_ptr, spart_ptr, hp_ptr, sflag_ptr, M, R, SK, stride_sxm,
                       SBM, SBR, SBK, SSPLIT, SFP32):
        return
    pid -= NS
    offs_m = tl.arange(0, BM)
    offs_n = pid * BN + tl.arange(0, BN)                                        # (BN,) columns of I
    up = tl.where(offs_n < I, I + offs_n, 2 * I)                                # up's columns; past I: none
    b_g = _b_rows(b_ptr, offs_n, I, RB, RB_PAD)                                 # (BN, RB_PAD)
    b_u = _b_rows(b_ptr, up, 2 * I, RB, RB_PAD)
    pdl_start(USE_PDL)                               # B is a weight: loaded before the wait, hp and y after it
    if NS > 0:
        _await_shrink(sflag_ptr, R, SBR, tl.num_programs(0) - NS)
    y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < I)
    ys = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    g = tl.load(ys, mask=y_mask, other=0.0)
    u = tl.load(ys + I, mask=y_mask, other=0.0)
    d0 = tl.zeros((BM, BN), tl.float32)
    d_g = _member_dot(d0, hp_ptr, b_g, 0, offs_m, M, R, RB, SPLIT, dtype, FP32_DOT)
    d_u = _member_dot(d0, hp_ptr, b_u, UP, offs_m, M, R, RB, SPLIT, dtype, FP32_DOT)
    g = (g.to(tl.float32) + scale * d_g).to(dtype)
    u = (u.to(tl.float32) + scale * d_u).to(dtype)
    tl.store(out_ptr + offs_m[:, None] * I + offs_n[None, :], silu_mul_math(g, u), mask=y_mask)


def _side(n) -> int:
    """An MMA tile side holding n: a power of two, at least 16. A shrink / expand program holds all
    M rows in one (16, 32 or 64: tuning.LORA_MAX_ROWS, so a decode step's programs each read their A
    or B once), and an expand all of B's ranks."""
    return max(16, triton.next_power_of_2(n))


def lora_delta_(x, A, B, y, scale, cuts=None):
    """y += scale · (x Aᵀ) Bᵀ in place and return y: x (M, K), A (R, K), B (N, R), y (M, N), one
    dtype, M <= lora_max_m (with cuts, a group's stacked A and compact B: group_casts). Two launches:
    shrink over chunks of K (summed by its last chunk), then expand, with programmatic dependent
    launch where the device has it."""
    return lora_expand_(lora_shrink(x, A, B), B, y, scale, cuts=cuts)


def lora_shrink(x, A, B):
    """The first half of lora_delta_: -> hp (1, M, R) fp32, x Aᵀ summed over K. It reads x only, so it
    may run before the base matmul that y comes from (early_shrink)."""
    hp, s = _shrink_plan(x, A, B)
    (M, K), R = s.x.shape, s.A.shape[0]
    split, tiles = triton.cdiv(K, s.BK), triton.cdiv(R, s.BR)
    _lora_shrink_kernel[(tiles, split)](s.x, s.A, s.part, hp, launch.split_counts(x.device, tiles), M, R, K,
                                        s.x.stride(0), BM=s.BM, BR=s.BR, BK=s.BK, SPLIT=split, FP32_DOT=s.fp32,
                                        **launch.pdl_launch(x.device))
    return hp


def carried_shrink(x, A, B):
    """lora_shrink's work for the launch that folds the update to carry in its first programs:
    -> (hp (1, M, R) fp32, still unwritten, gemm.Shrink), the same chunks and sums (fp4_decode._shrink_chunk)."""
    t = tuning.current()
    if triton.cdiv(A.shape[0], t.lora_rank_rows) > SHRINK_TILES:
        raise ValueError(f"carried_shrink: {A.shape[0]} ranks make more than the {SHRINK_TILES} rank tiles of "
                         f"{t.lora_rank_rows} that a launch's flags count (launch.shrink_flags)")
    hp, s = _shrink_plan(x, A, B)
    return hp, s._replace(flags=launch.shrink_flags(x.device))


def _shrink_plan(x, A, B):
    """The shrink of x (M, K) by A (R, K), launched alone or carried: -> (hp (1, M, R) fp32, unwritten,
    gemm.Shrink without flags): its operands, the fp32 K-chunk partials (hp itself where one chunk
    spans K), and its launch shape and dot precision (all M rows in one tile, lora_rank_rows ranks
    and lora_shrink_k k a program; fp32 products under the interpreter and on fp32 activations)."""
    t = tuning.current()
    x, A = _shrink_operands(x, A, B)
    (M, K), R = x.shape, A.shape[0]
    hp = torch.empty(1, M, R, device=x.device, dtype=torch.float32)
    part = launch.partials(triton.cdiv(K, t.lora_shrink_k), hp[0])             # (split, M, R), or hp itself
    return hp, gemm.Shrink(x, A, part, None, _side(M), t.lora_rank_rows, t.lora_shrink_k,
                           launch.interpreting() or x.dtype == torch.float32)


def _shrink_operands(x, A, B):
    """x (M, K) with unit inner stride and A (R, K) contiguous for h = x Aᵀ, after the checks."""
    t = tuning.current()
    M, K = x.shape
    if not (M <= t.lora_max_m and A.shape[1] == K and A.shape[0] % B.shape[1] == 0):
        raise ValueError(f"lora_delta_: x {tuple(x.shape)}, A {tuple(A.shape)}, B {tuple(B.shape)} do not "
                         f"fit y (M, N) += (x Aᵀ) Bᵀ with M <= {t.lora_max_m}")
    if not x.dtype == A.dtype == B.dtype:
        raise ValueError(f"lora_delta_ needs one dtype, got x {x.dtype}, A {A.dtype}, B {B.dtype}")
    return (x if x.stride(-1) == 1 else x.contiguous()), A.contiguous()


def lora_expand_(hp, B, y, scale, shrink=None, cuts=None):
    """The second half: y += scale · bf16(Σ hp) Bᵀ in place, y (M, N) with contiguous rows. shrink
    (carried_shrink): the launch computes hp itself first. cuts: B is a group's compact B
    (group_casts), each column reading its own member's ranks of h."""
    t = tuning.current()
    split, M, R = hp.shape
    N = B.shape[0]
    RB, n1, n2 = _expand_check("lora_delta_", hp, B, y, cuts)
    if tuple(y.shape) != (M, N):
        raise ValueError(f"lora_delta_: B {tuple(B.shape)}, y {tuple(y.shape)} do not fit y (M, N) += h Bᵀ "
                         f"with h ({M}, {R})")
    BN = t.lora_expand_cols
    ptrs, meta = gemm.shrink_args(shrink, hp)
    _lora_expand_kernel[(meta["NS"] + triton.cdiv(N, BN),)](
        hp, B.contiguous(), y, *ptrs, M, N, R, RB, n1, n2, y.stride(0), scale, SPLIT=split, BM=_side(M), BN=BN,
        RB_PAD=_side(RB), PARTS=gemm.lora_parts(cuts, N), FP32_DOT=launch.interpreting() or y.dtype == torch.float32,
        **meta, **launch.pdl_launch(y.device))
    return y


def _expand_check(name, hp, B, y, cuts):
    """-> (RB, N1, N2) for an expand of h (hp's ranks R) by B (N, RB) into y, after the checks: one
    dtype, y's rows contiguous, B's RB the ranks of each part cuts make (gemm.check_lora_b)."""
    gemm.check_lora_b(B, cuts, hp.shape[-1], name)
    if y.dtype != B.dtype or y.stride(-1) != 1:
        raise ValueError(f"{name} needs one dtype and writes y in place, its rows contiguous: got B {B.dtype}, "
                         f"y {y.dtype} with strides {y.stride()}")
    return (B.shape[1], *gemm.lora_cuts(cuts, B.shape[0]))


def expand_silu_mul(hp, B, y, scale, shrink=None, cuts=None):
    """silu(g)·u (M, N/2) of y (M, N) = [g, u] after lora_expand_(hp, B, y, scale, shrink, cuts), in
    one launch that writes neither g nor u back: the gate/up group's update where its matmul stores y
    itself (register-A from 2 rows), with the SiLU·mul kernel's work, the same bits as the two launches."""
    t = tuning.current()
    split, M, R = hp.shape
    N = B.shape[0]
    RB = _expand_check("expand_silu_mul", hp, B, y, cuts)[0]
    if tuple(y.shape) != (M, N) or N % 2:
        raise ValueError(f"expand_silu_mul: B {tuple(B.shape)}, y {tuple(y.shape)} do not fit y (M, N) += h Bᵀ "
                         f"with h ({M}, {R}) and N even (gate and up)")
    I, BN = N // 2, t.lora_expand_cols
    if cuts is not None and tuple(cuts) != (I, N):
        raise ValueError(f"expand_silu_mul: cuts {tuple(cuts)} must be ({I}, {N}): gate's and up's halves, "
                         f"one member each")
    out = torch.empty(M, I, device=y.device, dtype=y.dtype)
    ptrs, meta = gemm.shrink_args(shrink, hp)
    _expand_silu_kernel[(meta["NS"] + triton.cdiv(I, BN),)](
        hp, B.contiguous(), y, out, *ptrs, M, I, R, RB, y.stride(0), scale, SPLIT=split, BM=_side(M),
        BN=BN, RB_PAD=_side(RB), UP=int(cuts is not None),
        FP32_DOT=launch.interpreting() or y.dtype == torch.float32, **meta,
        **launch.pdl_launch(y.device))
    return out


def norm_shrink(x, weight, eps, residual, holder, mods, refresh=True):
    """The RMSNorm before a stacked group (fused_ops.rms_norm's result: y, or (y, x + residual)) with
    the group's shrink y Aᵀ in the same launch, or None where that does not apply (norm_shrinks).
    h waits on holder (`lora_h`, with y) for the group's update (group_update), so the matmul that
    folds it waits on one launch that wrote both its x and its h."""
    holder.lora_h = None
    C = x.shape[-1]
    if not norm_shrinks(mods, x.reshape(-1, C)):
        return None
    A = group_casts(holder, mods, x, refresh)[0]
    y, total, hp = norm_shrink_rows(x.reshape(-1, C), weight, eps,
                                    residual.reshape(-1, C) if residual is not None else None, A)
    y = y.view(x.shape)
    holder.lora_h = (y, hp)
    return y if residual is None else (y, total.view(x.shape))


def norm_shrink_rows(x, weight, eps, residual, A):
    """One launch: y = RMSNorm(x [+ residual]) (M, C), the sum x + residual (None without one), and
    hp (1, M, R) fp32 = y Aᵀ, for rows x (M <= lora_max_m), weight (C,) fp32, A (R, C) in x's dtype."""
    t = tuning.current()
    M, C = x.shape
    if not (M <= t.lora_max_m and A.shape[1] == C and x.dtype == A.dtype):
        raise ValueError(f"norm_shrink: x {x.dtype} {tuple(x.shape)} and A {A.dtype} {tuple(A.shape)} do not fit "
                         f"h = norm(x) Aᵀ with at most {t.lora_max_m} rows and one dtype")
    x = x.contiguous()
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else out
    res = residual.contiguous() if residual is not None else x
    hp = _whole_rows(x, A, res, weight, out, total, eps, True, residual is not None)
    return out, total if residual is not None else None, hp


def _whole_rows(x, A, res, weight, out, total, eps, NORM, HAS_RES):
    """The launch of _norm_shrink_kernel over x (M, C) contiguous and A (R, C): program (m, i) a whole
    row and norm_shrink_ranks rows of A, num_warps as fused_ops.rms_norm takes. -> hp (1, M, R) fp32."""
    t = tuning.current()
    (M, C), R = x.shape, A.shape[0]
    BR, block = t.norm_shrink_ranks, triton.next_power_of_2(C)
    hp = torch.empty(1, M, R, device=x.device, dtype=torch.float32)
    _norm_shrink_kernel[(M, triton.cdiv(R, BR))](
        x, res, weight, out, total, A.contiguous(), hp, M, R, C, eps, NORM=NORM, HAS_RES=HAS_RES, BR=BR,
        BLOCK_C=block, num_warps=min(16, max(1, block // 256)), **launch.pdl_launch(x.device))
    return hp


def row_shrink(x, A):
    """hp (1, M, R) fp32 = x Aᵀ for rows x (M, C) and A (R, C) of one dtype, each program one whole
    row of x and norm_shrink_ranks whole rows of A (the norm + shrink launch without the norm): no
    partial sums, no program waits on another. lora_shrink's work at the rows shrink() gives it."""
    if not (A.shape[1] == x.shape[1] and x.dtype == A.dtype):
        raise ValueError(f"row_shrink: x {x.dtype} {tuple(x.shape)} and A {A.dtype} {tuple(A.shape)} do not fit "
                         f"h = x Aᵀ with one dtype")
    x = x.contiguous()
    return _whole_rows(x, A, x, x, x, x, 0.0, False, False)               # no norm: x's pointer for its operands


def norm_shrinks(mods, x2) -> bool:
    """Does the norm before the group mods run its shrink (norm_shrink), for rows x2 (M, C)? Where
    group_update would run an early shrink (the decode kernels, an NVFP4 base, one update for the
    group) and M <= tuning's norm_shrink_max_m."""
    return (is_adapter(mods[0]) and group_applies(mods) and _decode_kernels(x2)
            and early_shrink(mods[0].base_layer) and x2.shape[0] <= tuning.current().norm_shrink_max_m)


def _take_h(holder, x):
    """The shrink partials a norm computed for this group's input x (norm_shrink), or None; taken once."""
    pending, holder.lora_h = getattr(holder, "lora_h", None), None
    return pending[1] if pending is not None and pending[0] is x else None


# ----------------------------------------------------------------------------------------------
# the update of one adapter, and of a stacked group


def _base(base, x, lora=None):
    """base(x); with lora, the NVFP4 base's matmul with the update folded in (gemm.linear on its
    buffers, as nvfp4.linear would run it)."""
    if lora is None:
        return base(x)
    return gemm.linear(x, base.weight_packed, base.weight_scale, base.weight_global_scale, base.bias,
                       base.interleaved, lora=lora)


def _decode_kernels(x2) -> bool:
    """A no-grad CUDA forward of at most lora_max_m rows x2 (rows, in): the shrink / expand kernels,
    which add the update into the base output y in place."""
    return x2.is_cuda and not torch.is_grad_enabled() and x2.shape[0] <= tuning.current().lora_max_m


def _delta_kernels(x2, A, B, y, scale, base, hp=None, expand=None, cuts=None):
    """y + scale · (x Aᵀ) Bᵀ by the kernels, y a function computing the base output (given lora=,
    the update to fold in): where early_shrink says so, x Aᵀ runs before it (or ran in the norm's
    launch: hp given), and where fold_expand says so the base matmul adds the update itself (no
    expand kernel); otherwise both run after it. Where `carries` says so, no shrink launch runs:
    the launch that adds the update computes x Aᵀ in its first programs. expand(hp, B, y2, scale,
    shrink, cuts) -> (rows, n): the expand launch (lora_expand_ if None; expand_silu_mul where the
    caller wants SiLU·mul of the result). cuts: a group's compact B (group_casts)."""
    folds = early_shrink(base) and fold_expand(base, x2, B)
    carry = None
    if hp is None and carries(base, x2, A, B, folds):
        hp, carry = carried_shrink(x2, A, B)
        if folds:
            return y(lora=gemm.Fold(hp, B.contiguous(), float(scale), x_fresh=True, shrink=carry, cuts=cuts))
        y = y()
    elif early_shrink(base):
        fresh = hp is not None                # the launch just before wrote x too: the matmul waits first
        hp = hp if fresh else shrink(x2, A, B)
        if folds:
            return y(lora=gemm.Fold(hp, B.contiguous(), float(scale), x_fresh=fresh, cuts=cuts))
        y = y()
    else:
        y = y()
        hp = shrink(x2, A, B)
    y2 = y.reshape(-1, y.shape[-1])
    return (expand or lora_expand_)(hp, B, y2, scale, carry, cuts).view(*y.shape[:-1], -1)


def carries(base, x2, A, B, folds: bool) -> bool:
    """Does the launch after an NVFP4 base's matmul that adds the update (the reduce kernel where the
    matmul leaves its split-K sum to it: gemm.carries_shrink; the expand kernel where the matmul
    stores y itself, 7B gate/up) compute the shrink in its first programs (carried_shrink), instead
    of a shrink launch before the matmul? From tuning's row_shrink_max_m rows (one row has the
    whole-row shrinks) to lora_max_m, where tuning's carry_shrink holds. Why: under PDL a launch is
    scheduled only once the kernel two places ahead has finished, so a shrink launch between x's
    producer and the matmul keeps the matmul off the SMs until the producer is done; carried, the
    shrink runs beside the matmul and the matmul is resident and streaming during the producer. A
    matmul that folds the update itself carries none (gemm.carries_shrink says why), nor does a
    bf16 base: cuBLAS releases nothing early, so the carried programs start after it, and the expand
    launch that waits for them is slower than the two launches (ab_lora_7b_h200.json)."""
    t = tuning.current()
    M = x2.shape[0]
    if not (t.carry_shrink and early_shrink(base) and t.row_shrink_max_m < M <= t.lora_max_m
            and triton.cdiv(A.shape[0], t.lora_rank_rows) <= SHRINK_TILES):
        return False
    return not folds or gemm.carries_shrink(M, B.shape[0], x2.shape[1], x2.device, base.interleaved)


def shrink(x2, A, B):
    """x Aᵀ as partials hp, as decode runs it: whole rows a program to tuning's row_shrink_max_m rows
    where a row fits one program (ROW_SHRINK_MAX_C: 64 values a thread of 16 warps; row_shrink), else
    chunks of K whose last sums the others (lora_shrink)."""
    if x2.shape[0] <= tuning.current().row_shrink_max_m and x2.shape[1] <= ROW_SHRINK_MAX_C:
        return row_shrink(x2, A)
    return lora_shrink(x2, A, B)


def _update(y, h, B, scale, base, cuts=None):
    """y() + scale · h Bᵀ: folded into the base matmul's split-K reduce where fold_in_reduce says so
    (no addmm launch), else one addmm after it, in place on the fresh base output (no autograd here:
    a copy of y first would cost more than the addmm); for a group's compact B (cuts), an addmm for
    each member's columns with its own ranks of h."""
    h2 = h.reshape(-1, h.shape[-1])                                            # (rows, R)
    if fold_in_reduce(base, h, B):
        return y(lora=gemm.Fold(h2, B.contiguous(), float(scale), cuts=cuts))
    y = y()
    y2, RB = y.view(-1, y.shape[-1]), B.shape[1]                               # (rows, N)
    ends = (0, *gemm.lora_cuts(cuts, B.shape[0]), B.shape[0])
    for p, (n0, n1) in enumerate(zip(ends, ends[1:])):
        if n1 > n0:
            y2[:, n0:n1].addmm_(h2[:, p * RB:(p + 1) * RB], B[n0:n1].t(), alpha=scale)
    return y


def lora_linear(x, base, A, B, scale):
    """base(x) + scale · (x Aᵀ) Bᵀ for x (..., in), A (r, in), B (out, r) in x.dtype (the caller casts
    and checks that dropout is off): the kernels up to lora_max_m rows, the folds where they apply,
    else F.linear and the in-place addmm."""
    if _decode_kernels(x.reshape(-1, x.shape[-1])):
        x = x.contiguous()          # a folding matmul reads x before its wait on the shrink: no copy between
        return _delta_kernels(x.view(-1, x.shape[-1]), A, B, functools.partial(_base, base, x), scale, base)
    return _update(functools.partial(_base, base, x), F.linear(x, A), B, scale, base)   # h: (..., r)


def is_adapter(m) -> bool:
    return hasattr(m, "lora_A") and hasattr(m, "base_layer")


def group_applies(mods) -> bool:
    """Can one update serve the adapters mods (enabled, one scaling, dropout off or in eval mode)?"""
    first = mods[0]
    return not torch.is_grad_enabled() and all(
        is_adapter(m) and m.enabled and m.scaling == first.scaling
        and (isinstance(m.lora_dropout, nn.Identity) or not m.training) for m in mods)


def group_casts(holder, mods, x, refresh=True):
    """The group's A (Σr, in), B and cuts in x's dtype, kept on holder (the stack's lora_casts)
    between calls: refreshed in place by each call, except where refresh is False (a decode graph's
    capture, which reads them as they are). Where the members (at most three) share one rank r, B is
    compact, (Σ out, r): each row holds its own member's ranks alone, and cuts (N1, N2) say where the
    first two members' columns end (fp4_decode._lora_part); a q/k/v group's B is a third of the
    block-diagonal (Σ out, Σr) and gate/up's half, which the update would read at every decode step,
    zeros included. Otherwise B is that block-diagonal and cuts None. They are kept for the
    members' ranks and sizes, not only for the shapes: the members' ranks reshuffled (adapters loaded
    anew, every shape alike) would leave the old blocks in a block-diagonal B's zeros."""
    R, N, K = sum(m.r for m in mods), sum(m.out_features for m in mods), mods[0].in_features
    compact = len(mods) <= 3 and len({m.r for m in mods}) == 1
    RB = mods[0].r if compact else R
    ends = list(itertools.accumulate(m.out_features for m in mods))
    cuts = (ends[0], ends[1]) if compact and len(mods) > 1 else None
    layout = tuple((m.r, m.out_features) for m in mods)                       # B's shape and cuts follow
    casts = getattr(holder, "lora_casts", None)
    if (casts is None or casts[0].dtype != x.dtype or casts[0].device != x.device
            or tuple(casts[0].shape) != (R, K) or casts[2] != layout):
        with torch.inference_mode(False):   # plain tensors, writable outside inference mode too
            casts = holder.lora_casts = (torch.empty(R, K, dtype=x.dtype, device=x.device),
                                         torch.zeros(N, RB, dtype=x.dtype, device=x.device), layout)
    A, B = casts[:2]                                                           # (Σr, in), (Σout, RB)
    if refresh:
        r0 = n0 = 0
        for m in mods:
            c0 = 0 if compact else r0
            A[r0:r0 + m.r].copy_(m.lora_A)
            B[n0:n0 + m.out_features, c0:c0 + m.r].copy_(m.lora_B)
            r0, n0 = r0 + m.r, n0 + m.out_features
    return A, B, cuts


def group_update(holder, mods, x, y, refresh=True, expand=None):
    """y() + every adapter's update, for adapters mods (group_applies) that share the input x and
    whose base outputs are the column blocks of what y (the stacked matmul, given lora= to fold)
    returns: one shrink and one expand (or fold) for the group; refresh: as group_casts; expand:
    the expand launch where one runs (_delta_kernels)."""
    hp = _take_h(holder, x)
    A, B, cuts = group_casts(holder, mods, x, refresh and hp is None)         # the norm refreshed them
    first = mods[0]
    x2 = x.reshape(-1, x.shape[-1])                                            # (rows, in)
    if _decode_kernels(x2):
        return _delta_kernels(x2, A, B, y, first.scaling, first.base_layer, hp, expand, cuts)
    return _update(y, F.linear(x, A), B, first.scaling, first.base_layer, cuts)   # h: (..., Σr)
