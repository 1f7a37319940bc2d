"""The tile kernels: y = x·Wᵀ and dx = dy·W with bf16 tensor-core MMAs (tl.dot), the split-K
reduce and the dequantize pass.

Hopper has no FP4 tensor cores, so each program decodes a (BN, BK) tile of the 4.5-bit weight
into bf16 in registers (fp4_decode.py) and issues ordinary bf16 MMAs with fp32 accumulation
("Marlin-style" mixed-input GEMM, written in Triton). The math of one output tile, written
transposed ("swap AB") so that the big operand, the weight, is the MMA's left operand (it may then
live in registers, and a 16-row weight tile is a legal MMA even when M is 1):

    acc[BN, BM] = 0                                        # fp32
    for k0 in range(k_start, k_end, BK):
        w  = e2m1(packed[n-tile, k0:k0+BK]) * scale · 2^-7  # (BN, BK) bf16, exact
        acc += w @ x[m-tile, k0:k0+BK]ᵀ                     # bf16 MMA, fp32 accumulate
    y[m-tile, n-tile] = (acc · 2^7 / global_scale + bias)ᵀ  # bf16

dx = dy·W is the same loop with the reduction over N: acc[BK, BM] += wᵀ @ dy[m-tile, n0:n0+BN]ᵀ
(_nvfp4_mm_dx_kernel). The forward kernel, _nvfp4_mm_kernel, has two schedules
(shapes.TileConfig.swap):

  * swapped, M <= 64 (memory-bound): BM = 16..64 rows of x (padded; extra rows never stored), 64
    weight rows per program, W from registers, split-K until there are >= 4 programs per SM.
  * not swapped, 64 < M (tuning's medium tiles): acc[BM, BN] += x·wᵀ with 128 x 128 tiles: the
    decoded W is the MMA's B operand, stored once to shared memory (no round trip back to
    registers), and x is re-read from L2 N/128 times instead of N/64.

A split launch writes fp32 partial sums (split, M, N). Swapped, the split of a tile that finishes
last (counted by an atomic per tile in a zeroed int32 buffer, which it sets back to zero) adds them
up in order with the epilogue (scale, bias, cast): one launch, and the same bits as the reduce
kernel (fp4_decode._last_split / _sum_splits, shared with gemv.py and small_m.py). Otherwise
_splitk_reduce_kernel does it: deterministic, no atomics. It also serves the fragment kernel's
split launches at larger M (small_m.py) and the register-A kernel's (register_a.py);
_splitk_reduce_lora_kernel is the same sum in 2-D tiles that also adds a LoRA update s·h·Bᵀ (MMAs of
the tile's rows of h and B): h from F.linear at the GRPO batch, in place of an addmm after the
matmul, or summed from the shrink's partials at decode, in place of the expand kernel.

At large M (tuning's dequant_min_m) the fused kernel is compute-bound and slower than cuBLAS, so
_nvfp4_dequant_kernel writes W once as bf16 (N, K) and cuBLAS multiplies (gemm.use_dequant).

    x, dy    bf16  (M, K), (M, N)   innermost stride 1
    packed   uint8 (N, K/2), scale uint8 (N, K/16) E4M3 bits, global_scale fp32 (1,)
    BK divides K (and BN divides N for dx): the wrappers zero-pad odd reductions to 64 (MIN_RED)

Rows past N or M are wrapped rather than masked, so loads stay unmasked and vectorized; they are
never stored. M is not specialized (do_not_specialize): Triton would otherwise compile a separate
M == 1 kernel, which runs slower than the general one. Under the interpreter (INTERPRET) the dots
run on fp32 copies.
Leaves out: a pipelined producer / consumer schedule (the register-A kernel has one).

Test: tests/test_kernels_tiles.py through gemm's wrappers (dx against float64, split and tile
variants, the medium tiles, the dequantize path, the reduce kernel's LoRA update);
tests/test_kernels_gemm.py runs them on the routes that reach them; the folded LoRA update:
tests/test_kernels_small_m.py (test_kernels_fold_the_lora_update).
"""
import triton
import triton.language as tl

from .fp4_decode import (OPERAND_POST, OPERAND_SHIFT, _E2M1X4_TO_BF16_PTX, _add_update, _await_shrink,
                         _carried_shrink, _e2m1x2_to_f32, _e4m3_to_f32, _finish, _last_split, _lora_update_tile,
                         _sum_splits, _tiled_offsets, _to_bf16, pdl_start)

# ----------------------------------------------------------------------------------------------
# the weight tile

@triton.jit
def _load_weight_tile(packed_ptr, scale_ptr, offs_n, k0, stride_pn, stride_sn,
                      BN: tl.constexpr, BK: tl.constexpr, IL: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows offs_n (all valid), columns k0..k0+BK (BK divides K) of W as bf16 w·scale·2^-7
    (IL: W interleaved, nvfp4.interleave)."""
    offs_b = k0 // 2 + tl.arange(0, BK // 2)             # byte columns
    offs_s = k0 // 16 + tl.arange(0, BK // 16)           # scale columns
    p = tl.load(packed_ptr + _tiled_offsets(offs_n[:, None], offs_b[None, :], stride_pn, 64, IL))   # (BN, BK/2) u8
    sb = tl.load(scale_ptr + _tiled_offsets(offs_n[:, None], offs_s[None, :], stride_sn, 8, IL))     # (BN, BK/16) u8
    # scale·2^119 times the pseudo-value e2m1·2^-126 = e2m1·scale·2^-7 (exact in bf16)
    s = _e4m3_to_f32(sb, 126 - OPERAND_SHIFT)
    if INTERPRET:
        s = tl.broadcast_to(s[:, :, None], (BN, BK // 16, 8)).reshape(BN, BK // 2)
        lo, hi = _e2m1x2_to_f32(p)
        lo, hi = (lo * s).to(tl.bfloat16), (hi * s).to(tl.bfloat16)
    else:
        s = tl.broadcast_to(s.to(tl.bfloat16)[:, :, None], (BN, BK // 16, 8)).reshape(BN, BK // 2)
        lo, hi = tl.inline_asm_elementwise(
            _E2M1X4_TO_BF16_PTX, "=r,=r,=r,=r,r,r,r", [p, s],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return tl.join(lo, hi).reshape(BN, BK)               # (BN, BK): even k from the low nibble


# ----------------------------------------------------------------------------------------------
# kernels

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
    y_ptr, count_ptr,          # with REDUCE: y (M, N) bf16, and one int32 count per tile (zero)
    hp_ptr, lb_ptr, lora_scale,  # with LORA: y += s·bf16(Σ hp)·Bᵀ (fp4_decode._lora_update_tile)
    lora_rb, lora_n1, lora_n2,   # B's ranks a row, the group's cuts (fp4_decode._lora_part)
    # sizes: x (M, K), W (N, K); each program of split pid_k reduces k in [pid_k·K_SPLIT, +K_SPLIT)
    M, N, K, K_SPLIT, R_LORA,
    # strides (the innermost stride of every tensor is 1)
    stride_xm, stride_pn, stride_sn, stride_om, stride_os,
    # meta
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,     # PARTIAL: write fp32 partial sums (split-K)
    REDUCE: tl.constexpr, NSPLIT: tl.constexpr,        # REDUCE: the tile's last split sums them
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
    SWAP_AB: tl.constexpr,     # True: acc = W·xᵀ (BN, BM), W from registers; False: x·Wᵀ (BM, BN)
    IL: tl.constexpr,          # W interleaved (nvfp4.interleave)
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,     # launched with pdl_launch(): see pdl_start
    LORA: tl.constexpr, LSPLIT: tl.constexpr,   # the folded LoRA expand
    LPARTS: tl.constexpr,      # the group members B holds (gemm.lora_parts)
    LATE_WAIT: tl.constexpr,   # the kernel before is lora_shrink: wait after the main loop (pdl_start)
):
    """y[m, n] = sum_k x[m, k] · W[n, k]; one (BM, BN) tile of y per program. With LORA, whoever
    finishes the tile adds the LoRA update before storing it (the expand kernel's work)."""
    if not LATE_WAIT:
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
                              BN, BK, IL, INTERPRET)                               # (BN, BK)
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
    if LATE_WAIT:
        pdl_start(USE_PDL)                               # the shrink's partials are read from here on

    # ---- epilogue: the y tile (or an fp32 partial sum for the split-K reduce)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if PARTIAL:
        ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(ptrs, acc, mask=mask)
        if REDUCE:
            if _last_split(count_ptr, pid_m * tl.cdiv(N, BN) + pid_n, NSPLIT):
                upd = None
                if LORA:
                    upd = _lora_update_tile(hp_ptr, lb_ptr, lora_scale, lora_rb, lora_n1, lora_n2, offs_m, pid_n * BN,
                                            BN, M, N, R_LORA, LSPLIT, LPARTS, INTERPRET)
                _sum_splits(out_ptr, y_ptr, offs_m[:, None] * stride_om + offs_n[None, :], mask, offs_n[None, :],
                            N, stride_os, gs_ptr, bias_ptr, upd, NSPLIT, HAS_BIAS, INTERPRET)
    else:
        y = _finish(acc, gs_ptr, bias_ptr, offs_n[None, :], N, HAS_BIAS, INTERPRET)
        if LORA:
            upd = _lora_update_tile(hp_ptr, lb_ptr, lora_scale, lora_rb, lora_n1, lora_n2, offs_m, pid_n * BN, BN, M,
                                    N, R_LORA, LSPLIT, LPARTS, INTERPRET)
            y = _add_update(y, upd, INTERPRET)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=mask)


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
    IL: tl.constexpr,          # W interleaved (nvfp4.interleave)
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
                              BN, BK, IL, INTERPRET)                               # (BN, BK)
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
    """out (R, C) bf16 = sum_s part[s] (R, C) fp32 · 2^7/global_scale (+ bias (C,)), the sums of
    fp4_decode._sum_splits. Its own loop over a runtime SPLIT (one compiled kernel for every split),
    not _sum_splits' unrolled loop over a constexpr one, which is slower here."""
    pdl_start(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _finish(acc, gs_ptr, bias_ptr, offs % C, C, HAS_BIAS, INTERPRET), mask=mask)


@triton.jit
def _splitk_reduce_lora_kernel(part_ptr, gs_ptr, bias_ptr, out_ptr, h_ptr, b_ptr, lora_scale, RB, N1, N2,
                               sx_ptr, sa_ptr, spart_ptr, sflag_ptr, SK, stride_sxm, M, N, R, SPLIT,
                               HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, LSPLIT: tl.constexpr,
                               PARTS: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr,
                               NS: tl.constexpr, SBM: tl.constexpr, SBR: tl.constexpr, SBK: tl.constexpr,
                               SSPLIT: tl.constexpr, SFP32: tl.constexpr):
    """_splitk_reduce_kernel for a (BM, BN) tile of out (M, N), plus a LoRA update: out = bf16(y +
    s · h Bᵀ) with y the reduce's bf16 result and B (N, RB) bf16 (RB = R, or a group's compact B cut
    at N1 and N2: fp4_decode._lora_part), the update an fp32 MMA
    added before the one rounding (the in-place addmm it replaces rounds the sum less exactly: by
    more than a bf16 step on some outputs). h comes in either of matmul's forms, read by one load
    (fp4_decode._lora_h): a bf16 h (M, R) from F.linear (LSPLIT = 1; the GRPO batch), or the
    shrink's fp32 K-chunk partials (LSPLIT, M, R), summed and rounded to bf16 here (decode). One row
    of programs, tiles along N fastest; with NS the first NS compute h (fp4_decode._carried_shrink:
    x was written before the matmul, so they start without waiting on it) and the others wait for it."""
    pid = tl.program_id(0)
    if _carried_shrink(pid, NS, sx_ptr, sa_ptr, spart_ptr, h_ptr, sflag_ptr, M, R, SK, stride_sxm,
                       SBM, SBR, SBK, SSPLIT, SFP32):
        return
    pid -= NS
    pdl_start(USE_PDL)
    nt = tl.cdiv(N, BN)
    offs_m = (pid // nt) * BM + tl.arange(0, BM)
    n0 = (pid % nt) * BN
    offs_n = n0 + tl.arange(0, BN)
    offs = offs_m[:, None] * N + offs_n[None, :]                                   # (BM, BN)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    if NS > 0:
        _await_shrink(sflag_ptr, R, SBR, tl.num_programs(0) - NS)
    update = _lora_update_tile(h_ptr, b_ptr, lora_scale, RB, N1, N2, offs_m, n0, BN, M, N, R, LSPLIT, PARTS,
                               INTERPRET)                                                       # (BM, BN)
    y = _finish(acc, gs_ptr, bias_ptr, offs_n[None, :], N, HAS_BIAS, INTERPRET)
    tl.store(out_ptr + offs, _add_update(y, update, INTERPRET), mask=mask)


@triton.jit
def _nvfp4_dequant_kernel(packed_ptr, scale_ptr, gs_ptr, out_ptr, N, K, stride_pn, stride_sn,
                          BN: tl.constexpr, BK: tl.constexpr, IL: tl.constexpr, INTERPRET: tl.constexpr,
                          USE_PDL: tl.constexpr):
    """W (N, K) bf16 = e2m1 · scale / global_scale, one (BN, BK) tile per program (BK divides K)."""
    pdl_start(USE_PDL)
    pid_n = tl.program_id(0)
    k0 = tl.multiple_of(tl.program_id(1) * BK, BK)
    offs_n = (pid_n * BN + tl.arange(0, BN)) % N
    w = _load_weight_tile(packed_ptr, scale_ptr, offs_n, k0, stride_pn, stride_sn, BN, BK, IL, INTERPRET)
    w = w.to(tl.float32) * (OPERAND_POST / tl.load(gs_ptr))
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = k0 + tl.arange(0, BK)
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], _to_bf16(w, INTERPRET),
             mask=(offs_n < N)[:, None])
