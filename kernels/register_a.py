"""wgmma with the decoded NVFP4 weights as its register A operand: y = x·Wᵀ for 16 < M <= 1024
(and from M = 2 on the big weights; where gemm.route says: Hopper with triton 3.6 only; written
in Gluon, Triton's layout-explicit dialect).

Why. Above the decode batch the product is still mostly memory-bound, but the tile kernels
(tiles.py) pay for their decode twice: W is decoded into registers, stored to shared memory and
read back by tl.dot, and the MMA waits on each decode. Hopper's wgmma can take its A operand (64
rows x 16 k per warpgroup) from registers, as Marlin and Machete do on the H100: decode straight
into the registers the instruction reads. A tl.dot cannot be told that a register tensor already
has the operand's layout; Gluon can, and checks it (convert_layout(..., assert_trivial=True) fails
to compile where data would move).

The product is computed swapped, acc[BN weight rows, BT tokens] += decode(W)[BN, 128] · xpᵀ[128, BT]
per 128-k window: the weight rows are wgmma's M (16 per warp, 64 per warpgroup of 4 warps), the
tokens its N (BT = 8 .. 256).

The fragment mapping. In nvfp4.interleave's layout a 16-row x 128-k tile is 16 rows of 16 int32
words (8 codes each). Lane (g = lane // 4, t = lane % 4) of a warp loads words 4t .. 4t+3 of rows
g and g+8 of its warp's 16 rows (word_layout): codes k = 32t .. 32t+31 of both rows. The decode
(fp4_decode._e2m1x4_to_bf16_ptx, scale multiply included) turns word j into four bf16x2 registers,
(lo b0, lo b1), (hi b0, hi b1), (lo b2, lo b3), (hi b2, hi b3) for its bytes b0..b3. Index the 8
values as (p1, p0, e): p1 the byte pair, p0 low or high nibble, e the byte within the pair; the
value is the weight of k = 32t + 8j + 4p1 + 2e + p0. wgmma's register operand (k_width 2) for the
16-k step s holds, in lane t, the pairs (2t, 2t+1) and (2t+8, 2t+9) of that step, rows g and g+8.
So calling value (j, p1, p0, e) of lane t the operand's column

    c = e + 2t + 8·p0 + 16·p1 + 32·j        (of the 128-column window)

makes the decoded registers *be* the operand: _decode_operand reshapes and permutes the tensor to
say so, and the convert_layout that follows moves nothing (SASS: 8 HGMMA a window reading A from
the decode's registers, no shared-memory traffic for W). Column c of the operand then holds the
weight of k(c) = 32t + 8j + 4p1 + 2e + p0, so x must come permuted the same way:
xp[:, c] = x[:, k(c)] in every window (_fragment_order_kernel, one pass over x before the GEMM;
fragment_order_index is the same map in torch).

The pipeline, two kernels for the same product. _wgmma_ring_kernel: a ring of S = 3 stages in
shared memory, each holding one window's W words (BN x 64 bytes), scales (BN x 8 bytes) and xp tile
(BT x 128 bf16, 128-byte swizzle: wgmma's B), filled by cp.async two windows ahead. Per window:
wait for the oldest copy group, barrier, words and scales into registers in the fragment layout,
decode, one wgmma (8 instructions of 16 k), wait for it, refill the stage just read. A wgmma kept in
flight across windows (warpgroup_mma_wait(1) with the previous A registers alive) gave wrong
results and was no faster, and decoding window i+1 under wgmma i is serialized by ptxas, which
reuses A's registers. _wgmma_ws_kernel (from tuning's ws_min_bt tokens a program:
shapes.warp_specialized): the same ring and the same per-window work (_mma_window),
warp-specialized: one producer warp fills the stages by TMA and a pair of mbarriers per stage says
full / free, so the consumer warps neither issue copies nor wait at a barrier for each other; its x
tiles must be whole (fragment_order pads them). Below that many tokens a program the producer's
warpgroup of registers would halve the programs an SM holds, hence two kernels. From M = 129
(shapes.wgmma_config) a program takes 256 tokens and 128 weight rows with two consumer warpgroups,
each in a partition of its own so that one decodes while the other's wgmma runs: the decode (about
three instructions a weight in the loop) is paid once per 256 tokens, and 128 accumulators a
thread fit in the 168 registers of one program an SM.
The warp-specialized kernel stores its tiles through shared memory by TMA (_finish_tile: 2-byte
stores straight from the accumulators are slow), and where a launch's tiles would leave the last
wave part-empty shapes.wgmma_launches gives the rows left to a second launch (smaller tiles, or
split along K with the pieces summing themselves: _sum_split_tile).
The scales are E4M3 bytes: the hardware's fp8 -> fp32 conversion, times 2^119, as bf16 pairs, so
the operand is w·scale·2^-7 exactly as in the other kernels (fp4_decode.OPERAND_SHIFT).

Split-K: a weight with few 64-row tiles (7B down: N = 3584) splits its windows among programs (up
to one wave of them, part of one at <= 16 tokens: shapes.wgmma_split), which write fp32 partials
that tiles._splitk_reduce_kernel sums in order with scale and bias. Summed in the launch by the
split that counts last it is slower (one SM pulls every piece through L2; at <= 16 tokens it is
faster alone but slower inside the decode graph); only a tail launch's long pieces sum themselves,
where the reduce kernel would need the rows' strides.
Programmatic dependent launch as in every other kernel (pdl_start's two instructions as inline
PTX): without it, a split launch after a PDL chain waits for the whole chain.

Gluon's API moves between Triton releases (3.9 removed async_copy_global_to_shared and
thread_barrier; warp_specialize changed its signature), so gemm routes here only on the release
this file is written for and tested on, triton 3.6 (gemm.GLUON_TRITON); elsewhere the tile kernels
serve these M.

Shapes: x (M, K) bf16 rows contiguous; W interleaved, N a multiple of 16, K of 128. Weight rows past
N are wrapped (loads stay unmasked), token rows past M masked; neither is stored.
Leaves out: the plain (not interleaved) layout, sm_100's tcgen05.

Test: tests/test_kernels_register_a.py (GPU: against float64 at odd M, N at its minimum, every
split, bias on and off, poisoned output; CPU: the x permutation against a derivation of the map
from the PTX ISA's fragment). Benchmark: python bench/kernel.py (the route gemm chooses).
"""
import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .fp4_decode import _DECODE_REGS, OPERAND_POST, OPERAND_SHIFT, _e2m1x4_to_bf16_ptx, pdl_start

# decode of one word into 4 bf16x2 outputs $0..$3 = (lo b0, lo b1), (hi b0, hi b1), (lo b2, lo b3),
# (hi b2, hi b3); inputs $4..$11 the word, $12..$15 the scale pair (inline_asm_elementwise's pack=8
# hands every output register its own copy of the inputs, hence the joins in _decode_operand)
_DECODE8 = gl.constexpr("{ " + " ".join(
    [_DECODE_REGS] + _e2m1x4_to_bf16_ptx("$4", "$12", "$12", "$0", "$2", "$1", "$3")) + " }")
_DECODE8_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 12))
_SCALE_TO_OPERAND = gl.constexpr(2.0 ** (126 - OPERAND_SHIFT.value))  # decoded codes are e2m1·2^-126
_POST = gl.constexpr(OPERAND_POST.value)
LOADER_REGS = gl.constexpr(40)   # registers a thread of the one-warp TMA producer keeps (setmaxnreg)
CONSUMER_REGS = gl.constexpr(232)  # ... and of the second consumer warpgroup, where there are two
                                   # (the launch's maxnreg: shapes.MAX_REGS)
_X_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
_W_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
_S_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)


# ----------------------------------------------------------------------------------------------
# x in the operand's k order

@triton.jit
def _fragment_order_kernel(x_ptr, out_ptr, M, MP, K, stride_xm, BM: tl.constexpr, WINS: tl.constexpr,
                           DX: tl.constexpr, USE_PDL: tl.constexpr):
    """out (MP, K) = x with each 128-k window permuted: out[:, c] = x[:, k(c)] (module docstring; DX:
    register_a_dx's order, t below j's high bit h), for BM rows x WINS windows; rows M..MP-1 are
    zeros. Loads and stores are contiguous (16 B a lane); the permutation is a reshape and permute
    of the tile in registers, which Triton carries out through shared memory (a gather of 2-byte
    loads is several times slower)."""
    pdl_start(USE_PDL)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    k = tl.program_id(1) * (WINS * 128) + tl.arange(0, WINS * 128)
    v = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
    # k = 32t + 16h + 8j0 + 4p1 + 2e + p0 (DX: 64h + 16t + ...), c = e + 2t + 8p0 + 16p1 + 32j0 + 64h
    if DX:
        v = tl.permute(tl.reshape(v, [BM, WINS, 2, 4, 2, 2, 2, 2]), [0, 1, 2, 4, 5, 7, 3, 6])
    else:
        v = tl.permute(tl.reshape(v, [BM, WINS, 4, 2, 2, 2, 2, 2]), [0, 1, 3, 4, 5, 7, 2, 6])
    v = tl.reshape(v, [BM, WINS * 128])                      # c order (h, j0, p1, p0, t, e)
    tl.store(out_ptr + m[:, None] * K + k[None, :], v, mask=(m < MP)[:, None] & (k < K)[None, :])


def fragment_order_index(K: int, device=None, dx: bool = False) -> torch.Tensor:
    """k(c) for the K columns in torch: xp = x[:, index] (tests and reading; the wrapper launches the
    kernel). x's columns as (window, t, h, j0, p1, e, p0) read in the order (window, h, j0, p1, p0,
    t, e); dx: register_a_dx's, columns (window, h, t, j0, p1, e, p0)."""
    k = torch.arange(K, device=device).view(K // 128, *((2, 4) if dx else (4, 2)), 2, 2, 2, 2)
    return k.permute(0, 1, 3, 4, 6, 2, 5).reshape(K) if dx else k.permute(0, 2, 3, 4, 6, 1, 5).reshape(K)


def fragment_order(x: torch.Tensor, pdl: dict, rows: int = 0, dx: bool = False) -> torch.Tensor:
    """x (M, K) bf16 -> xp (max(M, rows), K), permuted for the kernel below (dx: for register_a_dx's,
    x then being dy) in one pass over x, rows past M zero; pdl: launch.pdl_launch's keywords.
    The warp-specialized kernels take whole token tiles: TMA boxes that cross the tensor's end
    are slower."""
    M, K = x.shape
    MP = max(M, rows)
    out = torch.empty((MP, K), device=x.device, dtype=x.dtype)
    BM, WINS = min(16, triton.next_power_of_2(MP)), 2
    _fragment_order_kernel[(triton.cdiv(MP, BM), triton.cdiv(K, WINS * 128))](
        x, out, M, MP, K, x.stride(0), BM=BM, WINS=WINS, DX=dx, num_warps=4, **pdl)
    return out


# ----------------------------------------------------------------------------------------------
# the GEMM

@gluon.jit
def _decode_operand(words, sc, BN: gl.constexpr, DL: gl.constexpr):
    """(BN, 16) int32 words and (BN, 16) bf16 scale·2^119 per word, in word_layout -> the (BN, 128)
    bf16 A operand of wgmma in DL, without moving data (module docstring: the fragment mapping)."""
    w2 = gl.join(words, words)
    w4 = gl.join(w2, w2)
    w8 = gl.join(w4, w4)
    s2 = gl.join(sc, sc)
    s4 = gl.join(s2, s2)
    s8 = gl.join(s4, s4)
    a = gl.inline_asm_elementwise(_DECODE8, _DECODE8_CONSTRAINTS, [w8, s8], dtype=gl.bfloat16, is_pure=True,
                                  pack=8)                    # (BN, 16, 8): word 4t + j, value 4p1 + 2p0 + e
    a = gl.reshape(a, [BN, 4, 4, 2, 2, 2])                   # (row, t, j, p1, p0, e)
    a = gl.permute(a, [0, 2, 3, 4, 1, 5])                    # (row, j, p1, p0, t, e): column c
    return gl.convert_layout(gl.reshape(a, [BN, 128]), DL, assert_trivial=True)


@gluon.jit
def grid_wait():
    """griddepcontrol.wait: the kernel before has finished and its writes are visible (Gluon has no
    builtin for it; launch.py has the PDL rules)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def grid_release():
    """griddepcontrol.launch_dependents: the next kernel may be scheduled."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _pdl_start(USE_PDL: gl.constexpr):
    """fp4_decode.pdl_start: wait, then release."""
    if USE_PDL:
        grid_wait()
        grid_release()


@gluon.jit
def last_split(count_ptr, slot, nsplit):
    """fp4_decode._last_split in Gluon: after every thread's partial store (barrier), one
    release-acquire count of the slot at GPU scope; True for the split that counts last, which sets
    the count back to 0."""
    gl.thread_barrier()
    last = gl.atomic_add(count_ptr + slot, 1, sem="acq_rel", scope="gpu") == nsplit - 1
    if last:
        gl.store(count_ptr + slot, 0)
    return last


@gluon.jit
def _mma_window(acc, xs, ws, ss, LW: gl.constexpr, LS: gl.constexpr, BN: gl.constexpr, DL: gl.constexpr):
    """acc += decode(W window)·xpᵀ from one ring stage: xs the (BT, 128) xp tile, ws the (BN, 16)
    int32 words, ss the (BN, 8) scale bytes; the words and scales go into registers in the fragment
    layout, decode, one wgmma (8 instructions of 16 k), waited for."""
    words = ws.load(LW)                                                        # (BN, 16) int32
    sb = ss.load(LS)                                                           # (BN, 8) scale bytes
    # each scale converted once, then given to both words of its block (converted after the join,
    # every scale was converted twice: 20 more instructions a window, sm_90 SASS)
    sc = (sb.to(gl.float8e4nv, bitcast=True).to(gl.float32) * _SCALE_TO_OPERAND).to(gl.bfloat16)
    sc = gl.convert_layout(gl.reshape(gl.join(sc, sc), [BN, 16]), LW, assert_trivial=True)  # word w: block w // 2
    a = _decode_operand(words, sc, BN, DL)
    acc = warpgroup_mma(a, xs.permute((1, 0)), acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=[acc])


@gluon.jit
def _scaled(acc, gs_ptr, bias_ptr, rows, N, HAS_BIAS: gl.constexpr):
    """The tile's y in fp32: the sums times 2^7 / global scale, plus bias[rows] (rows past N add 0)."""
    y = acc * (_POST / gl.load(gs_ptr))
    if HAS_BIAS:
        y += gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)[:, None]
    return y


@gluon.jit
def _store_tile(acc, gs_ptr, bias_ptr, out_ptr, M, N, stride_om, stride_os, row0, tok0, pid_k,
                BN: gl.constexpr, BT: gl.constexpr, HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr,
                num_warps: gl.constexpr):
    """y[tok, row] of the (BN rows from row0, BT tokens from tok0) tile, scaled (+bias), or its fp32
    partial sums."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BT, 16])
    rows = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    toks = tok0 + gl.arange(0, BT, layout=gl.SliceLayout(0, mma))
    offs = toks[None, :] * stride_om + rows[:, None]
    mask = (rows < N)[:, None] & (toks < M)[None, :]
    if PARTIAL:
        gl.store(out_ptr + pid_k * stride_os + offs, acc, mask=mask)
    else:
        gl.store(out_ptr + offs, _scaled(acc, gs_ptr, bias_ptr, rows, N, HAS_BIAS).to(gl.bfloat16), mask=mask)


@gluon.jit
def _finish_tile(acc, buf, y_desc, gs_ptr, bias_ptr, N, row0, tok0, BN: gl.constexpr, BT: gl.constexpr,
                 HAS_BIAS: gl.constexpr, num_warps: gl.constexpr):
    """y[tok, row] of the (BN rows from row0, BT tokens from tok0) tile, scaled (+bias), through
    shared memory: the tile transposed into buf (BT, BN) and one TMA store, which drops what lies
    past M or N. Stored straight from the accumulator's layout, each lane would write 2-byte pieces
    of 8 rows (16 bytes) a token."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BT, 16])
    y = _scaled(acc, gs_ptr, bias_ptr, row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma)), N, HAS_BIAS)
    buf.store(gl.permute(y.to(gl.bfloat16), (1, 0)))
    fence_async_shared()                   # the stores above before the TMA engine reads buf
    tma.async_copy_shared_to_global(y_desc, [tok0, row0], buf)
    tma.store_wait(0)


@gluon.jit
def _sum_split_tile(acc, buf, y_desc, gs_ptr, bias_ptr, work_ptr, count_ptr, N, row0, tok0, slot, nslots, pid_k,
                    nsplit, BN: gl.constexpr, BT: gl.constexpr, HAS_BIAS: gl.constexpr, num_warps: gl.constexpr):
    """Split-K in the launch (fp4_decode._last_split's contract): store this split's fp32 partial
    tile to its workspace slot, count it, and the split that counts last sums the partials in split
    order (the bits of the reduce kernel) and finishes the tile (_finish_tile)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BT, 16])
    offs = (gl.arange(0, BN, layout=gl.SliceLayout(1, mma))[:, None] * BT
            + gl.arange(0, BT, layout=gl.SliceLayout(0, mma))[None, :])
    gl.store(work_ptr + (pid_k * nslots + slot) * (BN * BT) + offs, acc)
    if last_split(count_ptr, slot, nsplit):
        total = gl.load(work_ptr + slot * (BN * BT) + offs, cache_modifier=".cg")
        for s in range(1, nsplit):
            total += gl.load(work_ptr + (s * nslots + slot) * (BN * BT) + offs, cache_modifier=".cg")
        _finish_tile(total, buf, y_desc, gs_ptr, bias_ptr, N, row0, tok0, BN, BT, HAS_BIAS, num_warps)


@gluon.jit
def _issue(xs, ws, ss, x_ptr, p4_ptr, s_ptr, x_offs, x_mask, w_offs, s_offs, win, stage):
    """cp.async of window win's xp tile, W words and scales into ring stage `stage`, one group."""
    cp.async_copy_global_to_shared(xs.index(stage), x_ptr + x_offs + win * 128, mask=x_mask)
    cp.async_copy_global_to_shared(ws.index(stage), p4_ptr + win * 256 + w_offs, eviction_policy="evict_first")
    cp.async_copy_global_to_shared(ss.index(stage), s_ptr + win * 128 + s_offs)
    cp.commit_group()


@gluon.jit
def _wgmma_ring_kernel(x_ptr, p4_ptr, s_ptr, gs_ptr, bias_ptr, out_ptr, M, N, NWIN, WIN_SPLIT,
                       stride_xm, stride_om, stride_os,
                       LW: gl.constexpr, LS: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr,
                       S: gl.constexpr, HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr,
                       USE_PDL: gl.constexpr, num_warps: gl.constexpr):
    """out = x·Wᵀ (+bias) for the tile (BN weight rows of program 0, BT tokens of program 1) over the
    windows [pid2·WIN_SPLIT, +WIN_SPLIT); PARTIAL: fp32 sums to out[pid2] (split-K) instead.
    x_ptr holds xp (fragment order), p4_ptr the interleaved codes as int32, s_ptr the scale bytes.
    Every warp copies (cp.async) and computes."""
    _pdl_start(USE_PDL)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BT, 16])
    DL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])   # copies of 16 B a lane
    WL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [num_warps, 1], [1, 0])
    SCL: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [num_warps, 1], [1, 0])  # 4 B a lane
    PS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])

    # copy offsets: a 16-row x 128-k tile is 256 words and 128 scale bytes, a 16-row group's tiles
    # follow one another along K (nvfp4.interleave); window w adds 256·w words, 128·w bytes
    r = (pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, WL))) % N
    w_offs = ((r // 16) * NWIN * 256 + (r % 16) * 16)[:, None] + gl.arange(0, 16, layout=gl.SliceLayout(0, WL))[None, :]
    r = (pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, SCL))) % N
    s_offs = ((r // 16) * NWIN * 128 + (r % 16) * 8)[:, None] + gl.arange(0, 8, layout=gl.SliceLayout(0, SCL))[None, :]
    toks = pid_m * BT + gl.arange(0, BT, layout=gl.SliceLayout(1, XL))
    x_offs = toks[:, None] * stride_xm + gl.arange(0, 128, layout=gl.SliceLayout(0, XL))[None, :]
    x_mask = (toks < M)[:, None]

    xs = gl.allocate_shared_memory(gl.bfloat16, [S, BT, 128], _X_SMEM)
    ws = gl.allocate_shared_memory(gl.int32, [S, BN, 16], PS)
    ss = gl.allocate_shared_memory(gl.uint8, [S, BN, 8], PS)
    acc = gl.zeros([BN, BT], gl.float32, mma)
    w_start = pid_k * WIN_SPLIT
    w_end = gl.minimum(NWIN, w_start + WIN_SPLIT)
    for st in gl.static_range(S - 1):      # a split shorter than the ring re-reads its last window
        _issue(xs, ws, ss, x_ptr, p4_ptr, s_ptr, x_offs, x_mask, w_offs, s_offs,
               gl.minimum(w_start + st, w_end - 1), st)
    for win in range(w_start, w_end):
        i = win - w_start
        stage = i % S
        cp.wait_group(S - 2)               # this window's group has landed (for this thread) ...
        gl.thread_barrier()                # ... and for every thread; stage i - 1 is free
        acc = _mma_window(acc, xs.index(stage), ws.index(stage), ss.index(stage), LW, LS, BN, DL)
        _issue(xs, ws, ss, x_ptr, p4_ptr, s_ptr, x_offs, x_mask, w_offs, s_offs,
               gl.minimum(win + S - 1, w_end - 1), (i + S - 1) % S)
    cp.wait_group(0)
    _store_tile(acc, gs_ptr, bias_ptr, out_ptr, M, N, stride_om, stride_os, pid_n * BN, pid_m * BT, pid_k,
                BN, BT, HAS_BIAS, PARTIAL, num_warps)


@gluon.jit
def claim_stage(i, ready, empty, nbytes: gl.constexpr):
    """A TMA producer's i-th turn at its ring (this kernel's, register_a_dx's, gemv_tma's): wait until
    the consumers have released stage i % S (a fresh barrier counts as released), then expect nbytes
    of copies on its ready barrier; -> the stage."""
    S: gl.constexpr = ready.type.shape[0]
    stage = i % S
    mbarrier.wait(empty.index(stage), ((i // S) & 1) ^ 1)
    mbarrier.expect(ready.index(stage), nbytes)
    return stage


@gluon.jit
def _load_partition(x_desc, w_desc, s_desc, xs, ws, ss, ready, empty, tok0, group0, w_start, w_end):
    """The producer (one warp): for each window, wait until its ring stage is free, then copy the
    xp tile and each consumer's W words and scales into it by TMA; their arrival completes the
    stage's ready barrier. Rows past N or M arrive as zeros (TMA fills outside the tensor)."""
    S: gl.constexpr = xs.type.shape[0]
    C: gl.constexpr = ws.type.shape[0] // S
    GC: gl.constexpr = w_desc.block_type.shape[0]       # 16-row groups a consumer's box holds
    nbytes: gl.constexpr = x_desc.block_type.nbytes + C * (w_desc.block_type.nbytes + s_desc.block_type.nbytes)
    for win in range(w_start, w_end):
        stage = claim_stage(win - w_start, ready, empty, nbytes)
        tma.async_copy_global_to_shared(x_desc, [tok0, win * 128], ready.index(stage), xs.index(stage))
        for c in gl.static_range(C):
            tma.async_copy_global_to_shared(w_desc, [group0 + c * GC, win * 256], ready.index(stage),
                                            ws.index(stage * C + c))
            tma.async_copy_global_to_shared(s_desc, [group0 + c * GC, win * 128], ready.index(stage),
                                            ss.index(stage * C + c))


@gluon.jit
def _mma_partition(xs, ws, ss, ready, empty, done, c, w_start, w_end, y_desc, gs_ptr, bias_ptr, part_ptr, count_ptr,
                   M, N, row0, tok0, pid_k, nsplit, tile, ntiles, stride_om, stride_os, LW: gl.constexpr,
                   LS: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, HAS_BIAS: gl.constexpr,
                   PARTIAL: gl.constexpr, REDUCE: gl.constexpr, num_warps: gl.constexpr):
    """Consumer c (num_warps warps, the BN rows from row0 + c·BN): per window, wait for its stage,
    _mma_window on the shared xp tile and its own words and scales, release the stage; then, once
    every consumer is done with the ring (the done barrier), finish its tile through ring stage c's
    x buffer (_finish_tile), or sum the split in the launch (REDUCE), or store fp32 partial sums
    for the reduce kernel."""
    S: gl.constexpr = xs.type.shape[0]
    C: gl.constexpr = ws.type.shape[0] // S
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BT, 16])
    DL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    PS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    acc = gl.zeros([BN, BT], gl.float32, mma)
    for win in range(w_start, w_end):
        i = win - w_start
        stage = i % S
        mbarrier.wait(ready.index(stage), (i // S) & 1)
        # the box's (BN/16, 256) words and (BN/16, 128) scale bytes are row-major (BN, 16) and (BN, 8)
        acc = _mma_window(acc, xs.index(stage), ws.index(stage * C + c)._reinterpret(gl.int32, [BN, 16], PS),
                          ss.index(stage * C + c)._reinterpret(gl.uint8, [BN, 8], PS), LW, LS, BN, DL)
        fence_async_shared()               # our reads of the stage before the next TMA write to it
        mbarrier.arrive(empty.index(stage), count=1)
    row0 = row0 + c * BN
    if PARTIAL and not REDUCE:
        _store_tile(acc, gs_ptr, bias_ptr, part_ptr, M, N, stride_om, stride_os, row0, tok0, pid_k,
                    BN, BT, HAS_BIAS, PARTIAL, num_warps)
    else:
        mbarrier.arrive(done, count=1)     # the ring is free once every consumer is past it
        mbarrier.wait(done, 0)
        buf = xs.index(c)._reinterpret(gl.bfloat16, [BT, BN], y_desc.layout)
        if PARTIAL:
            _sum_split_tile(acc, buf, y_desc, gs_ptr, bias_ptr, part_ptr, count_ptr, N, row0, tok0,
                            tile * C + c, ntiles * C, pid_k, nsplit, BN, BT, HAS_BIAS, num_warps)
        else:
            _finish_tile(acc, buf, y_desc, gs_ptr, bias_ptr, N, row0, tok0, BN, BT, HAS_BIAS, num_warps)


@gluon.jit
def _wgmma_ws_kernel(x_desc, w_desc, s_desc, y_desc, gs_ptr, bias_ptr, part_ptr, count_ptr, M, N, NWIN, WIN_SPLIT,
                     TILE0, stride_om, stride_os,
                     LW: gl.constexpr, LS: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr,
                     S: gl.constexpr, C: gl.constexpr, HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr,
                     REDUCE: gl.constexpr, USE_PDL: gl.constexpr, num_warps: gl.constexpr):
    """_wgmma_ring_kernel's product, warp-specialized: one producer warp copies by TMA
    (_load_partition); C consumers of num_warps warps each (1 or 2) decode and multiply their BN/C of
    the BN weight rows against the same xp tile (_mma_partition), each in a partition of its own, so
    that one decodes while the other's wgmma runs (in one partition of 8 warps, the barriers Triton
    puts around each window's shared-memory reads keep the two warpgroups in step); an mbarrier pair
    per ring stage between them. Program (n, m, k) takes weight rows from (TILE0 + n)·BN (a launch
    may cover only some of them: shapes.wgmma_launches). x_desc: TMA descriptor of xp
    (fragment order), box (BT, 128); w_desc: the interleaved codes as int32 (N/16, NWIN·256), box
    (BN/C/16, 256); s_desc: the scale bytes (N/16, NWIN·128), box (BN/C/16, 128); y_desc: y (M, N)
    bf16, box (BT, BN/C) (descriptors()). PARTIAL: split-K, the partials summed in the launch
    (REDUCE: part_ptr a workspace, count_ptr zeros) or by the reduce kernel (part_ptr (split, M, N))."""
    _pdl_start(USE_PDL)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    BNC: gl.constexpr = BN // C
    xs = gl.allocate_shared_memory(gl.bfloat16, [S] + x_desc.block_type.shape, x_desc.layout)
    ws = gl.allocate_shared_memory(gl.int32, [S * C] + w_desc.block_type.shape, w_desc.layout)
    ss = gl.allocate_shared_memory(gl.uint8, [S * C] + s_desc.block_type.shape, s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for st in gl.static_range(S):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=C)       # each consumer releases a stage
    mbarrier.init(done, count=C)
    w_start = pid_k * WIN_SPLIT
    w_end = gl.minimum(NWIN, w_start + WIN_SPLIT)
    tok0 = pid_m * BT
    row0 = (TILE0 + pid_n) * BN
    tile = pid_n * gl.num_programs(1) + pid_m
    ntiles = gl.num_programs(0) * gl.num_programs(1)
    nsplit = gl.num_programs(2)
    if C == 1:
        gl.warp_specialize([
            (_mma_partition, (xs, ws, ss, ready, empty, done, 0, w_start, w_end, y_desc, gs_ptr, bias_ptr, part_ptr,
                              count_ptr, M, N, row0, tok0, pid_k, nsplit, tile, ntiles, stride_om, stride_os, LW, LS,
                              BNC, BT, HAS_BIAS, PARTIAL, REDUCE, num_warps)),
            (_load_partition, (x_desc, w_desc, s_desc, xs, ws, ss, ready, empty, tok0, row0 // 16, w_start, w_end)),
        ], [1], [LOADER_REGS])
    else:
        gl.warp_specialize([
            (_mma_partition, (xs, ws, ss, ready, empty, done, 0, w_start, w_end, y_desc, gs_ptr, bias_ptr, part_ptr,
                              count_ptr, M, N, row0, tok0, pid_k, nsplit, tile, ntiles, stride_om, stride_os, LW, LS,
                              BNC, BT, HAS_BIAS, PARTIAL, REDUCE, num_warps)),
            (_mma_partition, (xs, ws, ss, ready, empty, done, 1, w_start, w_end, y_desc, gs_ptr, bias_ptr, part_ptr,
                              count_ptr, M, N, row0, tok0, pid_k, nsplit, tile, ntiles, stride_om, stride_os, LW, LS,
                              BNC, BT, HAS_BIAS, PARTIAL, REDUCE, num_warps)),
            (_load_partition, (x_desc, w_desc, s_desc, xs, ws, ss, ready, empty, tok0, row0 // 16, w_start, w_end)),
        ], [num_warps, 1], [CONSUMER_REGS, LOADER_REGS])


def descriptors(xp, packed, scale, y, BN: int, BT: int):
    """The kernel's TMA descriptors: xp (M, K) bf16 in (BT, 128) boxes, 128-byte swizzle (wgmma's B
    operand; Triton issues it as two 64-column copies); the interleaved codes as int32 (N/16,
    K/8·16) and the scale bytes (N/16, K) in one box of BN/16 row groups x one window, unswizzled;
    y (M, N) bf16 in (BT, BN) boxes, 128-byte swizzle (BN: one consumer's rows, 64; the producer
    copies a box per consumer)."""
    x_desc = TensorDescriptor.from_tensor(xp, [BT, 128], _X_SMEM)
    y_desc = TensorDescriptor.from_tensor(y, [BT, BN], _X_SMEM)
    return x_desc, *weight_descriptors(packed, scale, BN), y_desc


def weight_descriptors(packed, scale, BN: int, scale_smem=_S_SMEM):
    """TMA descriptors of the interleaved codes as int32 (N/16, K/8·16) and the scale bytes (N/16,
    K), in boxes of BN/16 row groups x one 128-k window; scale_smem: the scales' shared layout
    (register_a_dx swizzles them)."""
    N, K = packed.shape[0], packed.shape[1] * 2
    w_desc = TensorDescriptor.from_tensor(packed.view(torch.int32).view(N // 16, K * 2), [BN // 16, 256], _W_SMEM)
    s_desc = TensorDescriptor.from_tensor(scale.view(torch.uint8).view(N // 16, K), [BN // 16, 128], scale_smem)
    return w_desc, s_desc


@functools.lru_cache(maxsize=None)
def word_layout(BN: int, warps: int):
    """(Built once per shape: a layout object costs ~0.3 ms of Python, and every launch passes one.)
    The (BN, 16) int32 words of a window in registers: lane (g, t) of warp w holds words 4t..4t+3
    of rows 16w + g and 16w + g + 8 (and the same every 16·warps rows): wgmma's A fragment rows."""
    reps = BN // (16 * warps)
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]] + [[16 * warps << i, 0] for i in range(reps.bit_length() - 1)],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16 << i, 0] for i in range(warps.bit_length() - 1)], block_bases=[], shape=[BN, 16])


@functools.lru_cache(maxsize=None)
def scale_layout(BN: int, warps: int):
    """The (BN, 8) scale bytes: lane (g, t) holds blocks 2t, 2t+1 of word_layout's rows (the scale of
    word w is block w // 2, so join(sb, sb) reshaped is word_layout itself)."""
    lw = word_layout(BN, warps)
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1]] + lw.reg_bases[2:], lane_bases=[[0, 2], [0, 4]] + lw.lane_bases[2:],
        warp_bases=lw.warp_bases, block_bases=[], shape=[BN, 8])
