"""The register-A wgmma kernel for the backward-input product dx = dy·W (dy (M, N), W NVFP4 (N, K)),
reading the same interleaved weights as the forward kernel (register_a.py; Hopper, Gluon, triton 3.6
only: gemm.route sends dx here at 64 < M <= 256 on the big weights, to 512 on the widest).

Why. The tile kernel for dx (tiles.py) decodes W into shared memory for tl.dot and runs well below
cuBLAS bf16 at M = 128..256 on the big weights; dequantizing W and calling cuBLAS pays a pass over
2.56 bytes a weight. Here W is decoded in registers as wgmma's A operand, as in the forward kernel,
and nothing but the 4.5-bit weights is read. At M = 1024 it stays short of dequantize + cuBLAS,
which keeps that M (gemm.route): the decode is twice the forward's per MMA (a consumer decodes 128 k
x 128 n for a 128 x 128 x 128 wgmma), and its programs leave some SMs idle.

The product is computed swapped, dxᵀ[k, token] += Wᵀ[k, n]·dyᵀ[n, token]: the output columns k are
wgmma's M (128 a consumer warpgroup, two m64 instructions), the tokens its N (BT = 128), the
reduction runs over n in windows of 128. The difficulty: the interleaved layout keeps 8 codes of
one row n in an int32 word (8 k), but wgmma's A fragment gives a lane 2 columns (n) per register.

The fragment mapping. Accumulator row i = g + 8h + 16w + 64r (lane (g, t) of warp w, h and r
register bits, the m16 fragment's rows) holds output column k(i) = 8·wi + 4·p1 + 2·e + nib of the
consumer's 128-k window, with g = (p1, wi0, wi1), w = (wi2, wi3), h = nib, r = e: word wi of the
window, its byte pair p1, the byte e of the pair, the nibble. So a lane needs, of each word it
reads, the two bytes of its pair p1 (lanes differing only in p1 read the same word). Columns (n of
the 128-n window) are those of the forward kernel's x columns with t moved below the top bit:
operand column C = e' + 2t + 8·p0' + 16·p1' + 32·j0 + 64·h holds n = 64h + 16t + 8j0 + 4p1' + 2e' +
p0' (dy permuted so: register_a.fragment_order(dx=True)). A lane's 16 rows n of a half
window (h) come as 4 quads n = 4q + (0, 2, 1, 3) -> a, b, c, d, the operand's columns 2t, 2t+1,
2t+8, 2t+9 of one 16-k step. Four prmt put byte 2p1 + e of a, b, c, d into one word (_SYNTH), and
the forward kernel's decode of that word yields (lo a, lo b), (hi a, hi b), (lo c, lo d), (hi c,
hi d): the operand's register pairs for rows nib = 0 / 1, with a scale pair (s_a, s_b) / (s_c,
s_d) each (_DECODE8_DX). _decode_operand_dx reshapes and permutes the result to say so; the
convert_layout to wgmma's operand layout moves nothing (assert_trivial).

Gluon cannot give two lanes one element (the lanes of p1 read the same word; a join and a
convert_layout to such a layout moved data by shuffles), so the words are read as 16-bit halves,
lane p1 reading half p1 (ldmatrix.trans in the SASS), and the scale bytes by a load that the p1
and wi0 lanes share, then expand_dims and broadcast, which move nothing. The scales sit in shared
memory 128-byte swizzled by TMA: unswizzled, the lanes of a warp would read rows 16 apart in one
bank (16-way conflicts).

The pipeline is the forward's warp-specialized one: a producer warp fills a ring by TMA (per
128-n window: the dy tile as two 64-column boxes, and each consumer's 128-k window of words and
scales of the window's 128 rows), two consumer warpgroups (the 256 k of a program) decode a half
window (64 n, 32 registers) at a time and issue its wgmma. The tile is stored through shared
memory by one TMA store (k(i) undone by a register permutation), or, split along n (PARTIAL,
where the programs are few), as fp32 sums for gemm's reduce kernel.

Shapes: dy (M, N) bf16, N a multiple of 128, padded to whole token tiles; W interleaved, K a
multiple of 128; dx (M, K) bf16. The tile (BT, BK) is shapes.DX_BT / DX_BK, which the host's
launch arithmetic shares.

Test: tests/test_kernels_register_a.py (GPU: against float64 at odd M, K past the last tile,
unequal splits, real shapes, poisoned output; CPU: the dy permutation against the map derived
from the fragment, and the routes). Benchmark: python bench/kernel.py (dx rows).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .fp4_decode import _DECODE_REGS, _e2m1x4_to_bf16_ptx
from .shapes import DX_BK, DX_BT
from .register_a import (_POST, _SCALE_TO_OPERAND, _X_SMEM, CONSUMER_REGS, LOADER_REGS, _pdl_start, claim_stage,
                               weight_descriptors)

BT = gl.constexpr(DX_BT)  # tokens a program (128)
BK = gl.constexpr(DX_BK)  # output columns k a program (256): two consumers of 128
STAGES = gl.constexpr(4)  # ring stages of 50 KB (dy 32 KB, words 2 x 8 KB, scales 2 x 1 KB)
_Y_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
_W_HALVES = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])   # a words box read as 16-bit halves
# the scales swizzled in shared memory, so that the lanes reading rows 16 apart (t) hit different
# banks (unswizzled: 16-way conflicts)
_S_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)

# bytes e = 0, 1 of the 16-bit halves a, b, c, d ($2..$5) into one word each ($0, $1)
_SYNTH = gl.constexpr("{ .reg .b32 t0, t1; mov.b32 t0, {$2, $3}; mov.b32 t1, {$4, $5}; "
                      "prmt.b32 $0, t0, t1, 0x6420; prmt.b32 $1, t0, t1, 0x7531; }")
# the forward decode, with the scale pairs (s_a, s_b) in $12 and (s_c, s_d) in $14
_DECODE8_DX = gl.constexpr("{ " + " ".join(
    [_DECODE_REGS] + _e2m1x4_to_bf16_ptx("$4", "$12", "$14", "$0", "$2", "$1", "$3")) + " }")
_DECODE8_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 12))


@gluon.constexpr_function
def operand_layout():
    """A half window's (64 n, 16 wi, 2 p1) values: the words' 16-bit halves (lane (g, t) of warp w
    reads half p1 = g0 of word wi = (g1, g2, w0, w1)), or the scale of each: rows n over the 16
    registers and lanes t (module docstring)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0, 0], [2, 0, 0], [4, 0, 0], [8, 0, 0]],
        lane_bases=[[16, 0, 0], [32, 0, 0], [0, 0, 1], [0, 1, 0], [0, 2, 0]],
        warp_bases=[[0, 4, 0], [0, 8, 0]], block_bases=[], shape=[64, 16, 2])


@gluon.constexpr_function
def halves_layout():
    """The same values as loaded from a half window's (4 groups, 16 rows, 32 halves) of shared memory."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0]],
        lane_bases=[[1, 0, 0], [2, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
        warp_bases=[[0, 0, 8], [0, 0, 16]], block_bases=[], shape=[4, 16, 32])


@gluon.constexpr_function
def scale_layout(expanded: bool):
    """A window's scale bytes as loaded, (8 groups, 128 = 16 rows x 8 blocks), one copy shared by
    the lanes of p1 and wi0 (word wi's block is wi // 2) (expanded=False); or a half window's, (64 n,
    8 blocks, 2 wi0, 2 p1), after expand_dims and broadcast (expanded)."""
    if expanded:
        return gl.DistributedLinearLayout(
            reg_bases=[[1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0], [8, 0, 0, 0]],
            lane_bases=[[16, 0, 0, 0], [32, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0]],
            warp_bases=[[0, 2, 0, 0], [0, 4, 0, 0]], block_bases=[], shape=[64, 8, 2, 2])
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 8], [0, 16], [0, 32], [0, 64], [4, 0]],
        lane_bases=[[1, 0], [2, 0], [0, 0], [0, 0], [0, 1]],
        warp_bases=[[0, 2], [0, 4]], block_bases=[], shape=[8, 128])


@gluon.jit
def _quads(v):
    """(64 n, 16, 2) -> the (16 q, 16, 2) values of rows 4q + (0, 2, 1, 3): a, b, c, d."""
    v = gl.permute(gl.reshape(v, [16, 4, 16, 2]), [0, 2, 3, 1])
    v = gl.reshape(v, [16, 16, 2, 2, 2])                     # (q, wi, p1, half = n bit 1, cd = n bit 0)
    ab, cd = gl.split(v)
    a, b = gl.split(ab)
    c, d = gl.split(cd)
    return a, b, c, d


@gluon.jit
def _decode_operand_dx(halves, sb, DL: gl.constexpr):
    """A half window's words as 16-bit halves (64 n, 16 wi, 2 p1) and scale bytes (64 n, 8 blocks) ->
    the (128 k-rows, 64 n-columns) bf16 A operand in DL (module docstring: the fragment mapping)."""
    a, b, c, d = _quads(halves)
    syn0, syn1 = gl.inline_asm_elementwise(_SYNTH, "=r,=r,h,h,h,h", [a, b, c, d], dtype=(gl.int32, gl.int32),
                                           is_pure=True, pack=1)
    syn = gl.join(syn0, syn1)                                                    # (q, wi, p1, e)
    syn = gl.join(syn, syn)
    syn = gl.join(syn, syn)
    syn = gl.join(syn, syn)
    P4: gl.constexpr = scale_layout(True)
    sc = (sb.to(gl.float8e4nv, bitcast=True).to(gl.float32) * _SCALE_TO_OPERAND).to(gl.bfloat16)
    sc = gl.convert_layout(sc, gl.SliceLayout(2, gl.SliceLayout(3, P4)), assert_trivial=True)
    two = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, P4))))
    sc = gl.broadcast(gl.expand_dims(sc, 2), two[None, None, :])[0]              # (n, block, wi0)
    two = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, P4))))
    sc = gl.broadcast(gl.expand_dims(sc, 3), two[None, None, None, :])[0]        # (n, block, wi0, p1)
    sc = gl.convert_layout(gl.reshape(sc, [64, 16, 2]), halves.type.layout, assert_trivial=True)
    sa, sb_, sc_, sd = _quads(sc)
    sa = gl.join(sa, sa)                                                         # (q, wi, p1, e)
    sb_ = gl.join(sb_, sb_)
    sc_ = gl.join(sc_, sc_)
    sd = gl.join(sd, sd)
    s0 = gl.join(sa, sc_)                                                        # (..., e, cd)
    s1 = gl.join(sb_, sd)
    s8 = gl.join(gl.join(s0, s0), gl.join(s1, s1))                               # (..., e, cd, nib, half)
    v = gl.inline_asm_elementwise(_DECODE8_DX, _DECODE8_CONSTRAINTS, [syn, s8], dtype=gl.bfloat16,
                                  is_pure=True, pack=8)                          # (q, wi, p1, e, cd, nib, half)
    v = gl.reshape(v, [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])  # (t1, t0, j0, p1', wi3, wi2, wi1, wi0, p1, e, cd, nib, half)
    v = gl.permute(v, [9, 4, 5, 11, 6, 7, 8, 2, 3, 10, 0, 1, 12])  # rows (r, w, h, g), columns C
    return gl.convert_layout(gl.reshape(v, [128, 64]), DL, assert_trivial=True)


@gluon.jit
def _load_partition(y_desc, w_desc, s_desc, ys, ws, ss, ready, empty, tok0, kwin0, w_start, w_end):
    """The producer (one warp): per 128-n window, once its stage is free, by TMA: the dy tile (two
    64-column boxes) and each consumer's 128-k window of the window's words and scales."""
    nbytes: gl.constexpr = 2 * (y_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes)
    for win in range(w_start, w_end):
        stage = claim_stage(win - w_start, ready, empty, nbytes)
        for h in gl.static_range(2):
            tma.async_copy_global_to_shared(y_desc, [tok0, win * 128 + h * 64], ready.index(stage),
                                            ys.index(stage * 2 + h))
        for c in gl.static_range(2):
            tma.async_copy_global_to_shared(w_desc, [win * 8, (kwin0 + c) * 256], ready.index(stage),
                                            ws.index(stage * 2 + c))
            tma.async_copy_global_to_shared(s_desc, [win * 8, (kwin0 + c) * 128], ready.index(stage),
                                            ss.index(stage * 2 + c))


@gluon.jit
def _mma_partition(ys, ws, ss, ready, empty, done, c, w_start, w_end, o_desc, gs_ptr, part_ptr, M, K, tok0, k0, pid_k,
                   PARTIAL: gl.constexpr, num_warps: gl.constexpr):
    """Consumer c (4 warps, output columns k0 + 128c ..): per window and half window, the operand
    decoded from its words and scales (_decode_operand_dx) times the dy half tile; then, once both
    consumers are past the ring, the tile scaled, its rows put back in k order and stored by TMA
    through ring stage c's dy buffers; or (PARTIAL, split-K) its fp32 sums stored to part_ptr[pid_k]
    for gemm's reduce kernel."""
    S: gl.constexpr = ready.type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BT, 16])
    DL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    acc = gl.zeros([128, BT], gl.float32, mma)
    for win in range(w_start, w_end):
        i = win - w_start
        stage = i % S
        mbarrier.wait(ready.index(stage), (i // S) & 1)
        # the words box (8 groups, 16 rows x 16 words) as 16-bit halves; the scales (8, 16 rows x 8)
        wsc = ws.index(stage * 2 + c)._reinterpret(gl.int16, [8, 16, 32], _W_HALVES)
        sb = gl.reshape(ss.index(stage * 2 + c).load(scale_layout(False)), [2, 4, 16, 8])   # (h, t, row, block)
        sb0, sb1 = gl.split(gl.permute(sb, [1, 2, 3, 0]))
        for h in gl.static_range(2):
            halves = gl.reshape(wsc.slice(4 * h, 4).load(halves_layout()), [64, 16, 2])
            sbh = gl.reshape(sb0 if h == 0 else sb1, [64, 8])
            a = _decode_operand_dx(gl.convert_layout(halves, operand_layout(), assert_trivial=True), sbh, DL)
            acc = warpgroup_mma(a, ys.index(stage * 2 + h).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        fence_async_shared()               # our reads of the stage before the next TMA write to it
        mbarrier.arrive(empty.index(stage), count=1)
    if PARTIAL:
        i = gl.arange(0, 128, layout=gl.SliceLayout(1, mma))      # row i holds k(i) (module docstring)
        k = k0 + 128 * c + 64 * ((i >> 5) & 1) + 32 * ((i >> 4) & 1) + 16 * ((i >> 2) & 1) + 8 * ((i >> 1) & 1) \
            + 4 * (i & 1) + 2 * ((i >> 6) & 1) + ((i >> 3) & 1)
        toks = tok0 + gl.arange(0, BT, layout=gl.SliceLayout(0, mma))
        gl.store(part_ptr + pid_k * M * K + toks[None, :] * K + k[:, None], acc,
                 mask=(k < K)[:, None] & (toks < M)[None, :])
        return
    mbarrier.arrive(done, count=1)         # the ring is free once both consumers are past it
    mbarrier.wait(done, 0)
    y = acc * (_POST / gl.load(gs_ptr))
    y = gl.reshape(y, [2, 2, 2, 2, 2, 2, 2, BT])               # rows (e, wi3, wi2, nib, wi1, wi0, p1)
    y = gl.reshape(gl.permute(y, [1, 2, 4, 5, 6, 0, 3, 7]), [2, 64, BT])     # k = 8wi + 4p1 + 2e + nib
    buf = ys._reinterpret(gl.bfloat16, [S, BT, 2, 64], _Y_SMEM).index(c)
    buf.store(gl.permute(y.to(gl.bfloat16), [2, 0, 1]))
    fence_async_shared()                   # the stores above before the TMA engine reads buf
    tma.async_copy_shared_to_global(o_desc, [tok0, (k0 + 128 * c) // 64, 0], buf)
    tma.store_wait(0)


@gluon.jit
def _dx_kernel(y_desc, w_desc, s_desc, o_desc, gs_ptr, part_ptr, M, K, NWIN, WIN_SPLIT, PARTIAL: gl.constexpr,
               USE_PDL: gl.constexpr, num_warps: gl.constexpr):
    """dx = dy·W for the tile (BK = 256 output columns of program 0, BT tokens of program 1), the
    reduction over the windows [pid2·WIN_SPLIT, +WIN_SPLIT) of NWIN windows of 128 n: one producer
    warp (_load_partition), two consumer warpgroups (_mma_partition). y_desc: dy permuted
    (fragment_order(dx=True)), box (BT, 64); w_desc: the words as int32 (N/16, K/8·16), box (8, 256);
    s_desc: the scale bytes (N/16, K), box (8, 128), swizzled; o_desc: dx as (M, K/64, 64), box (BT,
    2, 64) (dx_descriptors). PARTIAL: split-K, fp32 sums to part_ptr (split, M, K) instead."""
    _pdl_start(USE_PDL)
    tok0 = gl.program_id(1) * BT
    kwin0 = gl.program_id(0) * 2
    pid_k = gl.program_id(2)
    w_start = pid_k * WIN_SPLIT
    w_end = gl.minimum(NWIN, w_start + WIN_SPLIT)
    ys = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES] + y_desc.block_type.shape, y_desc.layout)
    ws = gl.allocate_shared_memory(gl.int32, [2 * STAGES] + w_desc.block_type.shape, w_desc.layout)
    ss = gl.allocate_shared_memory(gl.uint8, [2 * STAGES] + s_desc.block_type.shape, s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=2)       # each consumer releases a stage
    mbarrier.init(done, count=2)
    k0 = kwin0 * 128
    gl.warp_specialize([
        (_mma_partition, (ys, ws, ss, ready, empty, done, 0, w_start, w_end, o_desc, gs_ptr, part_ptr, M, K, tok0, k0,
                          pid_k, PARTIAL, num_warps)),
        (_mma_partition, (ys, ws, ss, ready, empty, done, 1, w_start, w_end, o_desc, gs_ptr, part_ptr, M, K, tok0, k0,
                          pid_k, PARTIAL, num_warps)),
        (_load_partition, (y_desc, w_desc, s_desc, ys, ws, ss, ready, empty, tok0, kwin0, w_start, w_end)),
    ], [num_warps, 1], [CONSUMER_REGS, LOADER_REGS])


def dx_descriptors(dyp, packed, scale, dx):
    """The kernel's TMA descriptors: dyp (MP, N) bf16 in (BT, 64) boxes, 128-byte swizzle (wgmma's
    B); the interleaved codes as the forward kernel's for 128 rows (8 row groups x one 128-k
    window); the scale bytes (N/16, K) in (8, 128) boxes, swizzled; dx (M, K) as (M, K/64, 64) in
    (BT, 2, 64) boxes."""
    M, K = dx.shape
    y_desc = TensorDescriptor.from_tensor(dyp, [BT.value, 64], _X_SMEM)
    w_desc, s_desc = weight_descriptors(packed, scale, 128, _S_SMEM)
    o_desc = TensorDescriptor.from_tensor(dx.view(M, K // 64, 64), [BT.value, 2, 64], _Y_SMEM)
    return y_desc, w_desc, s_desc, o_desc
