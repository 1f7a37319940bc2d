"""The decode-time kernel for a few rows of x: y = x·Wᵀ at 2 <= M <= 16 on mma.sync fragments.

At decode time M is the batch, a few rows of x against a weight of millions of elements: the
product is memory-bound, and an MMA tile of 16 rows or more would spend most of its work on
padding. What is left to win is the instruction count per weight of the decode, so the kernel
keeps the weights in registers from load to multiply, never through shared memory. gemm.route
chooses it (one row goes to the CUDA-core GEMV, gemv.py); gemm._mma launches it with shapes.py's
MmaConfig.

The fragment kernel, _nvfp4_mma_kernel (M <= 16 and K a multiple of 128), decodes the weights straight
into the A registers of mma.sync.m16n8k16 (the bf16 decode of fp4_decode.py) and lets each lane own the
k of its own 16-byte loads, so no bits need to move inside a byte: about 3.5 SASS instructions per
weight in the loop for any M <= 8. The comment above _decode_mma_ptx gives the register maps. A loop
step loads U windows (U = 1, 2 or 4: _mma_step_weights, _mma_step_x) before it decodes any (_mma_step):
short programs (a few windows, the small weights) are a chain of load latencies, and two windows in
flight a warp shorten it. At 5 to 8 rows (shapes.mma_ahead) a program also loads its next step before it
decodes this one (AHEAD), so each warp has a step in flight while it decodes one; at other row counts
the registers and instructions that costs do not pay. Where it finishes y (unsplit, or its last split
summing the others) it folds the LoRA expand in too (LORA: _mma_update, the update as one small MMA per
program in the epilogue, re-laid out to the fragments' layout); a split launch that leaves the sum to
the reduce kernel leaves the update to it as well. It reads either layout of W (IL: nvfp4.interleave,
where its warp loads are 512 contiguous bytes).

    x2       int32 (M, K/2)      x viewed as bf16 pairs
    packed   uint8 (N, K/2)      read as int32 words, (N, K/8)
    scale    uint8 (N, K/16)     E4M3 bits
    out      bf16 (M, N), or fp32 partial sums (split, M, N) that the split finishing last for its
             rows adds up into y (REDUCE: fp4_decode._last_split / _sum_splits), or else
             tiles._splitk_reduce_kernel does: deterministic either way.

M is not specialized (do_not_specialize, as in tiles.py). Under the interpreter (INTERPRET) the PTX
is replaced by plain-tl emulations of the same sums (_mma_emulate).
Test: tests/test_kernels_small_m.py through gemm's wrappers: the fragment kernel (and the GEMV)
against float64 (CPU: the index maps, through the emulation; GPU: the PTX, on the real projection
shapes too), the in-kernel split sum, the folded LoRA update and SiLU·mul; the routing:
tests/test_kernels_gemm.py. Benchmark: python bench/kernel.py.
"""
import triton
import triton.language as tl

from .fp4_decode import (OPERAND_SHIFT, _DECODE_REGS, _e2m1_f32, _e2m1x4_to_bf16_ptx, _e4m3_to_f32, _finish,
                         _last_split, _lora_update_tile, _add_update, _sum_splits, _tile_offsets, pdl_start)

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
# then a plain 16-byte load (of either layout: fp4_decode._tiled_offsets), and a
# decoded pair goes straight into an A register (no shared memory, no barrier, no layout change).
# The decode (_e2m1x4_to_bf16_ptx, as in the wgmma kernel) turns a word of 4 bytes b0..b3 into the pairs
# (lo b0, lo b1), (hi b0, hi b1), (lo b2, lo b3), (hi b2, hi b3) = physical k (0, 2), (1, 3),
# (4, 6), (5, 7) of the word; the x words (x0, x1), (x2, x3), ... of the same k are re-paired by
# prmt into (x0, x2), (x1, x3), ... once per window (_X_PAIRS_PTX). Per lane and 16-row tile, a
# 128-k window is 2 x 16 bytes of W, 4 scales, 8 mma.sync: ~3.5 SASS instructions per weight
# for any M <= 8 (tokens are the MMA's n = 8; M <= 16 issues a second mma per step), fewer than
# the CUDA-core kernel's ~4 and the tile kernels' ~7 plus a shared-memory round trip.

def _decode_mma_ptx(nt: int) -> str:
    """Inline PTX for one lane, one 16-row tile, one 128-k window, nt token tiles of 8.
    Operands: $0.. acc out (4 per token tile); then acc in (4 per tile), W rows g and g+8 (4 words
    each), the scales (4 bf16 = 2 registers: (g, block 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1), each
    ·2^119), the re-paired x words (16 per token tile)."""
    acc_in = 4 * nt
    w0, w1, s = 8 * nt, 8 * nt + 4, 8 * nt + 8
    xp = 8 * nt + 10
    lines = [_DECODE_REGS, ".reg .b32 sa0, sa1, sb0, sb1, l01, l23, h01, h23, m01, m23, k01, k23;",
             f"prmt.b32 sa0, ${s}, 0, 0x1010;", f"prmt.b32 sa1, ${s}, 0, 0x3232;",
             f"prmt.b32 sb0, ${s + 1}, 0, 0x1010;", f"prmt.b32 sb1, ${s + 1}, 0, 0x3232;"]
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
def _mma_x(x2_ptr, tok, stride_x2m, word0, M, valid, T, Q, WP, j: tl.constexpr, INTERPRET: tl.constexpr):
    """x words 16t + 4j .. +3 of the window for token `tok` (rows past M, or not valid, read 0): (4, 8, W, 1, 4)
    int32, one copy per warp; re-paired for the B fragment on the GPU (the emulation reads k in
    order)."""
    ptrs = x2_ptr + tok * stride_x2m + word0 + 16 * T + 4 * j + Q + 0 * WP
    x = tl.load(ptrs, mask=(tok < M) & valid, other=0)
    if not INTERPRET:
        x = tl.inline_asm_elementwise(_X_PAIRS_PTX, "=r,=r,=r,=r,r,r,r,r", [x], dtype=tl.int32,
                                      is_pure=True, pack=4)
    return x


@triton.jit
def _mma_xs(x2_ptr, tok, stride_x2m, word0, M, valid, T, Q, WP, INTERPRET: tl.constexpr):
    """The four _mma_x groups of a window for token `tok`: the x words of one token tile."""
    return (_mma_x(x2_ptr, tok, stride_x2m, word0, M, valid, T, Q, WP, 0, INTERPRET),
            _mma_x(x2_ptr, tok, stride_x2m, word0, M, valid, T, Q, WP, 1, INTERPRET),
            _mma_x(x2_ptr, tok, stride_x2m, word0, M, valid, T, Q, WP, 2, INTERPRET),
            _mma_x(x2_ptr, tok, stride_x2m, word0, M, valid, T, Q, WP, 3, INTERPRET))


@triton.jit
def _mma_emulate_rows(words, s, h: tl.constexpr, xv, W: tl.constexpr, R: tl.constexpr):
    """(8 g, 8 token, W, R): sum over the window of W[row g + 8h of tile (w, r), k] · x[token, k]."""
    J = tl.arange(0, 4)[None, None, None, None, :, None]
    Q = tl.arange(0, 4)[None, None, None, None, :]
    s_lo = tl.sum(tl.where(Q == 2 * h, s, 0.0), axis=4)[:, :, :, :, None, None]    # block 2t'
    s_hi = tl.sum(tl.where(Q == 2 * h + 1, s, 0.0), axis=4)[:, :, :, :, None, None]  # block 2t'+1
    codes = (words[:, :, :, :, :, None] >> (4 * tl.arange(0, 8)[None, None, None, None, None, :])) & 15
    wv = tl.reshape(_e2m1_f32(codes) * tl.where(J < 2, s_lo, s_hi), (4, 8, 1, W, R, 32))  # [t', g, ., w, r, k]
    return tl.sum(tl.sum(wv * xv, axis=5), axis=0)


@triton.jit
def _mma_emulate(acc, w0, w1, s, x0, x1, x2, x3, W: tl.constexpr, R: tl.constexpr):
    """What the PTX adds to acc, in plain fp32, for the interpreter: acc[t, g, w, r, 2h + p] +=
    sum over the window of W[row g + 8h of tile (w, r), k] · x[token 2t + p, k]. w0, w1: the words
    of rows g, g + 8 (lane t' holds k 32t' .. 32t' + 31); s: the scales·2^-7 (q = 2h + block) as
    fp32; x0..x3: the lanes' x words (natural pairs) of tokens g."""
    xw = tl.join(tl.join(x0, x1), tl.join(x2, x3))                   # (4, 8, W, 1, 4q, 2a, 2b)
    xw = tl.permute(xw, 0, 1, 2, 3, 6, 5, 4).reshape(4, 8, W, 1, 16)  # word 4j + q, j = 2b + a
    xv = tl.join((xw << 16).to(tl.float32, bitcast=True), (xw & -65536).to(tl.float32, bitcast=True))
    xv = tl.reshape(xv, (4, 1, 8, W, 1, 32))                          # [t', ., token, w, ., k]
    y = tl.join(_mma_emulate_rows(w0, s, 0, xv, W, R), _mma_emulate_rows(w1, s, 1, xv, W, R))
    y = y.reshape(8, 4, 2, W, R, 2)                                   # [g, t, p, w, r, h]
    return acc + tl.permute(y, 1, 0, 3, 4, 5, 2).reshape(4, 8, W, R, 4)


@triton.jit
def _mma_store(acc, tok, rows, out_ptr, gs_ptr, bias_ptr, M, N, stride_om, part_off, update,
               HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, INTERPRET: tl.constexpr):
    """acc[t, g, w, r, q] is y[tok, rows] (tok (4, 1, 1, 1, 4), rows (1, 8, W, R, 4)): store it
    (+ update, the LoRA update in acc's layout, or None: _add_update), or its fp32 partial sum."""
    mask = (tok < M) & (rows < N)
    if PARTIAL:
        tl.store(out_ptr + part_off + tok * stride_om + rows, acc, mask=mask)
    else:
        y = _finish(acc, gs_ptr, bias_ptr, rows, N, HAS_BIAS, INTERPRET)
        tl.store(out_ptr + tok * stride_om + rows, _add_update(y, update, INTERPRET), mask=mask)


@triton.jit
def _mma_update(hp_ptr, lb_ptr, lora_scale, lora_rb, lora_n1, lora_n2, pid_n, M, N, R_LORA, LSPLIT: tl.constexpr,
                LPARTS: tl.constexpr, W: tl.constexpr, R: tl.constexpr, INTERPRET: tl.constexpr):
    """The LoRA update of the program's rows of y, in the epilogue's layout: (u0, u1), each
    (4, 8, W, R, 4), u[t, g, w, r, q] the update of token 2t + q % 2 (+ 8 for u1) at row
    16·tile + g + 8·(q // 2). Computed as the swapped tiles compute theirs: MMAs of h (16 tokens,
    R_LORA) and the program's BN rows of B, over B's lora_rb ranks in chunks
    (fp4_decode._lora_update_tile, the expand kernel's own product), then re-laid out (Triton moves
    the (16, BN) result between lanes through shared memory, once per program). Why not in the
    epilogue's layout directly: a sum over the ranks at every (t, g, w, r, q) would broadcast B's
    rows to 4·R·lora_rb fp32 a thread (up to 512 at rank 128), where the MMA's result is 8·R fp32 a
    thread and one chunk of its operands is in registers at a time."""
    BN: tl.constexpr = 16 * W * R
    d = _lora_update_tile(hp_ptr, lb_ptr, lora_scale, lora_rb, lora_n1, lora_n2, tl.arange(0, 16),
                          pid_n * BN, BN, M, N, R_LORA, LSPLIT, LPARTS, INTERPRET)   # (16, BN)
    # token 8a + 2t + p, row 16·(w·R + r) + 8h + g  ->  [t, g, w, r, q = 2h + p, a]
    d = tl.reshape(d, (2, 4, 2, W, R, 2, 8))                                          # [a, t, p, w, r, h, g]
    d = tl.reshape(tl.permute(d, 1, 6, 3, 4, 5, 2, 0), (4, 8, W, R, 4, 2))
    return tl.split(d)


@triton.jit
def _mma_weights(p4_ptr, scale_ptr, win, win_end, row0, row1, srow, T, Q, stride_p4n, stride_sn,
                 IL: tl.constexpr, INTERPRET: tl.constexpr):
    """The W half of a 128-k window (zeros from win_end on): the lane's words of rows g and g + 8,
    and its four scales as mma operands."""
    wo = 4 * T + Q                                                              # lane t's 4 words
    # a split's last step may pass its end; a tensor, since the interpreter takes no scalar masks
    valid = win + 0 * wo < win_end                                              # (4, 1, 1, 1, 4)
    # the weights are read once per call: evict them first, keep x and the partials in L2
    w0 = tl.load(p4_ptr + _tile_offsets(row0, win, wo, stride_p4n, 16, IL), mask=valid, other=0,
                 eviction_policy="evict_first")
    w1 = tl.load(p4_ptr + _tile_offsets(row1, win, wo, stride_p4n, 16, IL), mask=valid, other=0,
                 eviction_policy="evict_first")
    sb = tl.load(scale_ptr + _tile_offsets(srow, win, 2 * T + Q % 2, stride_sn, 8, IL), mask=valid, other=0)
    if INTERPRET:
        s = _e4m3_to_f32(sb, -OPERAND_SHIFT)                                 # scale·2^-7
    else:   # scale·2^119 as bf16 (exact): the decode's fma makes the operand w·scale·2^-7
        s = (sb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * SCALE_TO_OPERAND).to(tl.bfloat16)
    return w0, w1, s


@triton.jit
def _mma_xwords(x2_ptr, win, win_end, T, G, Q, WP, M, stride_x2m, NT: tl.constexpr, INTERPRET: tl.constexpr):
    """The x half of a 128-k window: the x words of token tile 0 and (NT = 2) tile 1, else tile 0
    twice."""
    valid = win + 0 * (4 * T + Q) < win_end
    xa = _mma_xs(x2_ptr, G, stride_x2m, win * 64, M, valid, T, Q, WP, INTERPRET)      # token tile 0
    xb = xa
    if NT == 2:
        xb = _mma_xs(x2_ptr, G + 8, stride_x2m, win * 64, M, valid, T, Q, WP, INTERPRET)  # token tile 1
    return xa + xb


@triton.jit
def _mma_step_x(x2_ptr, win, win_end, T, G, Q, WP, M, stride_x2m, NT: tl.constexpr, U: tl.constexpr,
                INTERPRET: tl.constexpr):
    """_mma_xwords of the U windows from win, as a tuple."""
    xs = ()
    for u in tl.static_range(U):
        xs = xs + (_mma_xwords(x2_ptr, win + u, win_end, T, G, Q, WP, M, stride_x2m, NT, INTERPRET),)
    return xs


@triton.jit
def _mma_run(acc0, acc1, weights, xs, NT: tl.constexpr, W: tl.constexpr, R: tl.constexpr, U: tl.constexpr,
             INTERPRET: tl.constexpr):
    """One loop step: each of its U windows (weights and xs: _mma_step_weights' and _mma_step_x's
    tuples) decoded and multiplied (_mma_step)."""
    for u in tl.static_range(U):
        acc0, acc1 = _mma_step(acc0, acc1, weights[u] + xs[u], NT, W, R, INTERPRET)
    return acc0, acc1


@triton.jit
def _mma_step_weights(p4_ptr, scale_ptr, win, win_end, row0, row1, srow, T, Q, stride_p4n, stride_sn,
                      IL: tl.constexpr, U: tl.constexpr, INTERPRET: tl.constexpr):
    """_mma_weights of the U windows from win, as a tuple."""
    ws = ()
    for u in tl.static_range(U):
        ws = ws + (_mma_weights(p4_ptr, scale_ptr, win + u, win_end, row0, row1, srow, T, Q, stride_p4n, stride_sn,
                                IL, INTERPRET),)
    return ws


@triton.jit
def _mma_step(acc0, acc1, window, NT: tl.constexpr, W: tl.constexpr, R: tl.constexpr, INTERPRET: tl.constexpr):
    """acc0 (acc1) += one window of W (_mma_weights' and _mma_xwords' values) times x's token tile
    0 (1): decode + mma.sync, or the emulation."""
    w0, w1, s, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3 = window
    if NT == 1:
        if INTERPRET:
            acc0 = _mma_emulate(acc0, w0, w1, s, xa0, xa1, xa2, xa3, W, R)
        else:
            acc0 = tl.inline_asm_elementwise(
                _DECODE_MMA_PTX_1, _MMA_CONSTRAINTS_1,
                [acc0, w0, w1, s, xa0, xa1, xa2, xa3], dtype=tl.float32, is_pure=True, pack=4)
    else:
        if INTERPRET:
            acc0 = _mma_emulate(acc0, w0, w1, s, xa0, xa1, xa2, xa3, W, R)
            acc1 = _mma_emulate(acc1, w0, w1, s, xb0, xb1, xb2, xb3, W, R)
        else:
            acc0, acc1 = tl.inline_asm_elementwise(
                _DECODE_MMA_PTX_2, _MMA_CONSTRAINTS_2,
                [acc0, acc1, w0, w1, s, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3],
                dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    return acc0, acc1


@triton.jit(do_not_specialize=["M"])
def _nvfp4_mma_kernel(
    # pointers (x2: x as int32 words, a bf16 pair each; p4: packed as int32 words, 8 codes each)
    x2_ptr, p4_ptr, scale_ptr, gs_ptr, bias_ptr, out_ptr,
    y_ptr, count_ptr,          # with REDUCE: y (M, N) bf16, and one int32 count per tile (zero)
    hp_ptr, lb_ptr, lora_scale,  # with LORA: y += s·bf16(Σ hp)·Bᵀ, hp (LSPLIT, M, R_LORA) fp32, B (N, lora_rb)
    lora_rb, lora_n1, lora_n2,   # B's ranks a row, the group's cuts (fp4_decode._lora_part)
    # sizes: x (M, K), W (N, K); NWIN = K / 128 windows, program pid_k takes [pid_k·SPLIT, +SPLIT)
    M, N, NWIN, SPLIT, R_LORA,
    # strides (the innermost stride of every tensor is 1)
    stride_x2m, stride_p4n, stride_sn, stride_om, stride_os,
    # meta
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,     # PARTIAL: write fp32 partial sums (split-K)
    REDUCE: tl.constexpr, NSPLIT: tl.constexpr,        # REDUCE: the tile's last split sums them
    W: tl.constexpr,        # = num_warps
    R: tl.constexpr,        # 16-row tiles per warp: a program owns 16·W·R rows of W
    NT: tl.constexpr,       # token tiles of 8: 1 for M <= 8, 2 for M <= 16
    IL: tl.constexpr,       # W interleaved (nvfp4.interleave)
    U: tl.constexpr,        # windows a loop step loads before it decodes any
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,     # launched with pdl_launch(): see pdl_start
    LORA: tl.constexpr, LSPLIT: tl.constexpr,   # the folded LoRA expand
    LPARTS: tl.constexpr,      # the group members B holds (gemm.lora_parts)
    LATE_WAIT: tl.constexpr,   # the kernel before is lora_shrink: wait after the main loop (pdl_start)
    AHEAD: tl.constexpr,       # the next step's loads go out before this step's decodes
):
    """y[m, n] = sum_k x[m, k] · W[n, k] for M <= 16 with mma.sync on fragments decoded in
    registers (see the comment above). Every tensor is (4, 8, W, R, 4): lane bits 0-1 (t), lane
    bits 2-4 (g), warp, tile, 4 values in the lane: the loads' natural layouts already are the
    fragments, so Triton moves nothing between lanes in the loop. With LORA, whoever finishes the
    rows (every program of an unsplit launch, the last split with REDUCE) adds the LoRA update
    (_mma_update) before storing them: the expand kernel's work, without its launch. A split launch
    without REDUCE leaves the update to the reduce kernel (gemm._mma)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    T = tl.arange(0, 4)[:, None, None, None, None]
    G = tl.arange(0, 8)[None, :, None, None, None]
    WP = tl.arange(0, W)[None, None, :, None, None]
    Q = tl.arange(0, 4)[None, None, None, None, :]
    tile = (pid_n * W + WP) * R + tl.arange(0, R)[None, None, None, :, None]    # (1, 1, W, R, 1)
    row0 = (16 * tile + G) % N                 # rows g and g + 8 of each tile; past N: wrapped,
    row1 = (16 * tile + 8 + G) % N             # never stored
    # scale q: (g, block 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1): a lane's two blocks of a row in one
    # 2-byte load, so that both loads are needed by the window's first word (4 byte loads, the last
    # two only by its third word, were issued after the first mma.sync: ptxas, sm_90)
    srow = tl.where(Q < 2, row0, row1)
    win_start = pid_k * SPLIT
    win_end = min(NWIN, win_start + SPLIT)

    acc0 = tl.zeros((4, 8, W, R, 4), dtype=tl.float32)        # tokens 0..7
    acc1 = tl.zeros((4, 8, W, R, 4), dtype=tl.float32)        # tokens 8..15 (NT = 2)
    # every load of a step's U windows first, then their decodes and mma.sync; the first step's
    # weights before the wait on the kernel before (they are not its output), its x after
    w = _mma_step_weights(p4_ptr, scale_ptr, win_start, win_end, row0, row1, srow, T, Q, stride_p4n, stride_sn,
                          IL, U, INTERPRET)
    if not LATE_WAIT:
        pdl_start(USE_PDL)
    if AHEAD:
        xs = _mma_step_x(x2_ptr, win_start, win_end, T, G, Q, WP, M, stride_x2m, NT, U, INTERPRET)
        for win in range(win_start, win_end, U):
            # the next step's loads go out before this step's decodes (masked past win_end)
            w_next = _mma_step_weights(p4_ptr, scale_ptr, win + U, win_end, row0, row1, srow, T, Q, stride_p4n,
                                       stride_sn, IL, U, INTERPRET)
            xs_next = _mma_step_x(x2_ptr, win + U, win_end, T, G, Q, WP, M, stride_x2m, NT, U, INTERPRET)
            acc0, acc1 = _mma_run(acc0, acc1, w, xs, NT, W, R, U, INTERPRET)
            w = w_next
            xs = xs_next
    else:
        acc0, acc1 = _mma_run(acc0, acc1, w, _mma_step_x(x2_ptr, win_start, win_end, T, G, Q, WP, M, stride_x2m, NT,
                                                         U, INTERPRET), NT, W, R, U, INTERPRET)
        for win in range(win_start + U, win_end, U):
            step = _mma_step_weights(p4_ptr, scale_ptr, win, win_end, row0, row1, srow, T, Q, stride_p4n, stride_sn,
                                     IL, U, INTERPRET)
            acc0, acc1 = _mma_run(acc0, acc1, step, _mma_step_x(x2_ptr, win, win_end, T, G, Q, WP, M, stride_x2m, NT,
                                                                U, INTERPRET), NT, W, R, U, INTERPRET)

    if LATE_WAIT:
        pdl_start(USE_PDL)                               # the shrink's partials are read from here on
    # ---- epilogue: acc[t, g, w, r, q] is y at token 2t + q % 2 (+ 8 for acc1), row g + 8·(q // 2)
    rows = 16 * tile + G + 8 * (Q // 2)                                         # (1, 8, W, R, 4)
    tok = 2 * T + Q % 2                                                         # (4, 1, 1, 1, 4)
    part_off = pid_k * stride_os
    upd0, upd1 = None, None                    # the LoRA update of tokens 0..7, 8..15 where y is finished here
    if LORA:
        if not PARTIAL:
            upd0, upd1 = _mma_update(hp_ptr, lb_ptr, lora_scale, lora_rb, lora_n1, lora_n2, pid_n, M, N, R_LORA, LSPLIT,
                                     LPARTS, W, R, INTERPRET)
    _mma_store(acc0, tok, rows, out_ptr, gs_ptr, bias_ptr, M, N, stride_om, part_off, upd0,
               HAS_BIAS, PARTIAL, INTERPRET)
    if NT == 2:
        _mma_store(acc1, tok + 8, rows, out_ptr, gs_ptr, bias_ptr, M, N, stride_om, part_off, upd1,
                   HAS_BIAS, PARTIAL, INTERPRET)
    if REDUCE:
        if _last_split(count_ptr, pid_n, NSPLIT):
            last0, last1 = None, None
            if LORA:
                last0, last1 = _mma_update(hp_ptr, lb_ptr, lora_scale, lora_rb, lora_n1, lora_n2, pid_n, M, N, R_LORA,
                                           LSPLIT, LPARTS, W, R, INTERPRET)
            _sum_splits(out_ptr, y_ptr, tok * stride_om + rows, (tok < M) & (rows < N), rows, N, stride_os,
                        gs_ptr, bias_ptr, last0, NSPLIT, HAS_BIAS, INTERPRET)
            if NT == 2:
                _sum_splits(out_ptr, y_ptr, (tok + 8) * stride_om + rows, (tok + 8 < M) & (rows < N), rows, N,
                            stride_os, gs_ptr, bias_ptr, last1, NSPLIT, HAS_BIAS, INTERPRET)
