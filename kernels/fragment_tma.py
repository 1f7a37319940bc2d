"""The fragment kernel's product at 2 <= M <= 8 on the big weights, its weights streamed by a TMA
producer warp (Gluon, sm_90).

small_m.py's fragment kernel keeps a step of weights in flight in registers: 127 of them a thread
with the LoRA fold, 4 programs an SM, and its launches wait on their loads (Nsight Compute, 7B at 8
rows: no eligible warp in 45% of cycles on down; kernels/README has the numbers). The register-A
kernel that takes gate/up there runs a wave under two thirds full. This kernel is gemv_tma.py's
pipeline with the fragment kernel's arithmetic: the bytes in flight live in a shared-memory ring,
and the threads that compute hold one step of them. A program takes BN = 16·G rows (G 16-row
groups of the interleaved layout) and has five one-warp partitions:

  * the producer copies one 512-k step a stage by TMA: for each of the step's four 128-k windows,
    the G groups' words (1 KB a group) and scales (128 bytes) in one box each, into a ring of S
    stages; an mbarrier pair a stage (ready: its bytes landed; free: the four consumers took them);
  * consumer w takes window w of every step. Lane (g, t) reads words 4t .. 4t+3 of rows g and g + 8
    of each group and their four scales from the stage, then frees it, and its token g's 32 k of x
    (small_m's x pairs, loaded a step ahead), and runs small_m's decode + mma.sync on them (the same
    inline PTX, so the same operands a lane: the comment above small_m._decode_mma_ptx has the
    register maps). Tokens past M read x = 0.

The consumers are partitions of their own so that none waits on another within a step: as four
warps of one partition they met at a barrier twice a step (before the ready wait and before
freeing the stage), and that barrier was the largest stall (Nsight Compute, 7B gate/up at 8 rows).
Their four sums meet once, in shared memory, at the end: consumer 0 adds them and stores the
program's rows. acc[grp, g, t, q] is the sum for token 2t + q % 2 at row 16·grp + g + 8·(q // 2). A
split launch stores fp32 partials and leaves the sum, and a LoRA update, to the reduce kernel after
it (gemm._fragment_tma), as the register-A route does; an unsplit one stores y (gate/up, whose
update the expand kernel adds with SiLU·mul). PDL as gemv_tma.py: the consumers wait on the kernel
before them before they read x and release the next kernel after the main loop; the producer never
waits, since it reads only the weights.

    x2      int32 (M, K/2)        x as bf16 pairs, rows contiguous
    W       interleaved words and scale bytes (register_a.weight_descriptors, BN-row boxes)
    out     bf16 (M, N); partials fp32 (split, M, N)

Needs K a multiple of 512 and N of BN (gemm.fragment_tma_takes checks both). Leaves out: the CPU
interpreter (Gluon and TMA do not run there; CPU runs take small_m.py), M > 8 (one token tile).
Test: tests/test_kernels_fragment_tma.py (GPU: against float64 on the 7B and 32B MLP shapes at 2-8
rows, split and unsplit, through gemm.matmul with and without a LoRA update; CPU: the route).
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import register_a, small_m

G = 2          # 16-row groups a program ...
BN = 16 * G    # ... its rows
STAGES = 2     # ring stages (17 KB each: x, words, scales)
REGS = 48      # registers a thread at launch: 5 programs an SM (8 warps each) ...
CREGS = 72     # ... which the consumers take, the producer's warps giving theirs back (setmaxnreg)
_DECODE_MMA = gl.constexpr(small_m._DECODE_MMA_PTX_1.value)
_DECODE_MMA_C = gl.constexpr(small_m._MMA_CONSTRAINTS_1.value)
_X_PAIRS = gl.constexpr(small_m._X_PAIRS_PTX.value)
_SCALE_TO_OPERAND = gl.constexpr(small_m.SCALE_TO_OPERAND.value)
_POST = gl.constexpr(register_a._POST.value)
# (group, g, t, q): lane 4g + t of a one-warp partition, four values a lane (the mma operands' packs)
LA = gl.constexpr(gl.BlockedLayout([1, 1, 1, 4], [1, 8, 4, 1], [1, 1, 1, 1], [3, 2, 1, 0]))


@gluon.jit
def _producer(x_desc, w_desc, s_desc, xs, ws, ss, ready, free, group0, step_start, step_end, USE_PDL: gl.constexpr):
    """Fill stage i % S with step i's x, words and scales (slot 4·stage + w: window w; x's rows past
    M read 0) once the four consumers have freed it."""
    nbytes: gl.constexpr = 4 * (x_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes)
    for step in range(step_start, step_end):
        stage = register_a.claim_stage(step - step_start, ready, free, nbytes)
        for w in gl.static_range(4):
            tma.async_copy_global_to_shared(w_desc, [group0, (step * 4 + w) * 256], ready.index(stage),
                                            ws.index(4 * stage + w))
            tma.async_copy_global_to_shared(s_desc, [group0, (step * 4 + w) * 128], ready.index(stage),
                                            ss.index(4 * stage + w))
        if USE_PDL:
            if step == step_start:       # x is the kernel before's output: the first weights go out before
                register_a.grid_wait()
        for w in gl.static_range(4):
            tma.async_copy_global_to_shared(x_desc, [0, (step * 4 + w) * 64], ready.index(stage),
                                            xs.index(4 * stage + w))


@gluon.jit
def _along0(n: gl.constexpr):
    """arange(n) along dim 0 of LA, shaped (n, 1, 1, 1); _along1 .. _along3 the same along the others."""
    L: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LA)))
    return gl.arange(0, n, layout=L)[:, None, None, None]


@gluon.jit
def _along1(n: gl.constexpr):
    L: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LA)))
    return gl.arange(0, n, layout=L)[None, :, None, None]


@gluon.jit
def _along2(n: gl.constexpr):
    L: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LA)))
    return gl.arange(0, n, layout=L)[None, None, :, None]


@gluon.jit
def _along3(n: gl.constexpr):
    L: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LA)))
    return gl.arange(0, n, layout=L)[None, None, None, :]


@gluon.jit
def _x_pairs(x):
    """(8, 4, 4) x words (g, t, q) -> (1, 8, 4, 4) in LA, re-paired for the B fragment (small_m._mma_x)."""
    x = gl.expand_dims(gl.convert_layout(x, gl.SliceLayout(0, LA), assert_trivial=True), 0)
    return gl.inline_asm_elementwise(_X_PAIRS, "=r,=r,=r,=r,r,r,r,r", [x], dtype=gl.int32, is_pure=True, pack=4)


@gluon.jit
def _main_loop(xs, ws, ss, ready, free, w, step_start, step_end, GR: gl.constexpr):
    """The (GR, 8, 4, 4) fp32 sums (group, g, t, q) of window w of this program's steps."""
    S: gl.constexpr = ready.type.shape[0]
    # the stage's words (group, half, g, t, q) and scale bytes (group, half, g, t, p) of rows 8·half + g:
    # lane (g, t) takes both halves of its 16-byte piece t and blocks 2t, 2t + 1; and its token g's
    # x words (g, t, j, q): 16t + 4j + q of the window
    LW: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1, 4], [1, 1, 8, 4, 1], [1, 1, 1, 1, 1], [4, 1, 3, 2, 0])
    LB: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1, 2], [1, 1, 8, 4, 1], [1, 1, 1, 1, 1], [4, 1, 3, 2, 0])
    LX: gl.constexpr = gl.BlockedLayout([1, 1, 4, 4], [8, 4, 1, 1], [1, 1, 1, 1], [3, 2, 1, 0])
    P5: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[4, 3, 2, 1, 0])
    P4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[3, 2, 1, 0])
    acc = gl.zeros([GR, 8, 4, 4], gl.float32, LA)
    for step in range(step_start, step_end):
        i = step - step_start
        stage = i % S
        mbarrier.wait(ready.index(stage), (i // S) & 1)
        x = xs.index(4 * stage + w)._reinterpret(gl.int32, [8, 4, 4, 4], P4).load(LX)
        words = ws.index(4 * stage + w)._reinterpret(gl.int32, [GR, 2, 8, 4, 4], P5).load(LW)
        sb = ss.index(4 * stage + w)._reinterpret(gl.uint8, [GR, 2, 8, 4, 2], P5).load(LB)
        fence_async_shared()
        mbarrier.arrive(free.index(stage), count=1)
        xa, xb = gl.split(gl.reshape(gl.permute(x, [0, 1, 3, 2]), [8, 4, 4, 2, 2]))   # j = 2·jh + jl
        x0, x2 = gl.split(xa)
        x1, x3 = gl.split(xb)
        w0, w1 = gl.split(gl.permute(words, [0, 2, 3, 4, 1]))                   # rows g and g + 8
        w0 = gl.convert_layout(w0, LA, assert_trivial=True)
        w1 = gl.convert_layout(w1, LA, assert_trivial=True)
        sb = gl.reshape(gl.permute(sb, [0, 2, 3, 1, 4]), [GR, 8, 4, 4])          # q = 2·half + p
        sb = gl.convert_layout(sb, LA, assert_trivial=True)
        s = (sb.to(gl.float8e4nv, bitcast=True).to(gl.float32) * _SCALE_TO_OPERAND).to(gl.bfloat16)
        acc = gl.inline_asm_elementwise(_DECODE_MMA, _DECODE_MMA_C,
                                        [acc, w0, w1, s, _x_pairs(x0), _x_pairs(x1), _x_pairs(x2), _x_pairs(x3)],
                                        dtype=gl.float32, is_pure=True, pack=4)
    return acc


@gluon.jit
def _consumer(xs, ws, ss, ready, free, sums, done, gs_ptr, bias_ptr, out_ptr, M, N, stride_os, group0, w: gl.constexpr, step_start, step_end, pid_k, HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr,
              USE_PDL: gl.constexpr, GR: gl.constexpr):
    """Window w of every step; then the four windows' sums meet in shared memory, and consumer 0
    stores the program's rows: y, or its fp32 partial sums."""
    acc = _main_loop(xs, ws, ss, ready, free, w, step_start, step_end, GR)
    if USE_PDL:
        register_a.grid_release()
    sums.index(w).store(acc)
    mbarrier.arrive(done, count=1)
    if w == 0:
        mbarrier.wait(done, 0)
        y = sums.index(0).load(LA) + sums.index(1).load(LA) + sums.index(2).load(LA) + sums.index(3).load(LA)
        q = _along3(4)
        rows = (group0 + _along0(GR)) * 16 + _along1(8) + 8 * (q // 2)
        tok = 2 * _along2(4) + q % 2
        offs = tok * N + rows
        mask = (tok < M) & (rows < N)
        if PARTIAL:
            gl.store(out_ptr + pid_k * stride_os + offs, y, mask=mask)
        else:
            y = y * (_POST / gl.load(gs_ptr))
            if HAS_BIAS:
                y += gl.load(bias_ptr + rows).to(gl.float32)
            gl.store(out_ptr + offs, y.to(gl.bfloat16), mask=mask)


@gluon.jit
def _fragment_tma_kernel(x_desc, w_desc, s_desc, gs_ptr, bias_ptr, out_ptr, M, N, STEP_SPLIT, NSTEP, stride_os, HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr, USE_PDL: gl.constexpr,
                         S: gl.constexpr, CREGS: gl.constexpr, num_warps: gl.constexpr):
    """Program (pid_n, pid_k): the rows of groups [GR·pid_n, +GR), steps [pid_k·STEP_SPLIT, +STEP_SPLIT)
    of NSTEP. The launch's four warps are the producer (TMA copies are issued by one thread of
    them); the four consumers (CREGS registers) are one-warp partitions of their own."""
    GR: gl.constexpr = w_desc.block_type.shape[0]
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    xs = gl.allocate_shared_memory(gl.int32, [4 * S, 8, 64], x_desc.layout)      # slot 4·stage + window
    ws = gl.allocate_shared_memory(gl.int32, [4 * S, GR, 256], w_desc.layout)
    ss = gl.allocate_shared_memory(gl.uint8, [4 * S, GR, 128], s_desc.layout)
    sums = gl.allocate_shared_memory(gl.float32, [4, GR, 8, 4, 4], gl.SwizzledSharedLayout(1, 1, 1, order=[3, 2, 1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for st in gl.static_range(S):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(free.index(st), count=4)
    mbarrier.init(done, count=4)
    step_start = pid_k * STEP_SPLIT
    step_end = gl.minimum(NSTEP, step_start + STEP_SPLIT)
    group0 = pid_n * GR
    gl.warp_specialize([
        (_producer, (x_desc, w_desc, s_desc, xs, ws, ss, ready, free, group0, step_start, step_end, USE_PDL)),
        (_consumer, (xs, ws, ss, ready, free, sums, done, gs_ptr, bias_ptr, out_ptr, M, N, stride_os, group0, 0, step_start, step_end, pid_k, HAS_BIAS, PARTIAL, USE_PDL, GR)),
        (_consumer, (xs, ws, ss, ready, free, sums, done, gs_ptr, bias_ptr, out_ptr, M, N, stride_os, group0, 1, step_start, step_end, pid_k, HAS_BIAS, PARTIAL, USE_PDL, GR)),
        (_consumer, (xs, ws, ss, ready, free, sums, done, gs_ptr, bias_ptr, out_ptr, M, N, stride_os, group0, 2, step_start, step_end, pid_k, HAS_BIAS, PARTIAL, USE_PDL, GR)),
        (_consumer, (xs, ws, ss, ready, free, sums, done, gs_ptr, bias_ptr, out_ptr, M, N, stride_os, group0, 3, step_start, step_end, pid_k, HAS_BIAS, PARTIAL, USE_PDL, GR)),
    ], [1, 1, 1, 1], [CREGS, CREGS, CREGS, CREGS])


def x_descriptor(x):
    """x (M <= 8, K) bf16 as int32 words in (8, 64) boxes, one 128-k window of every token (rows past M
    read 0), unswizzled."""
    return TensorDescriptor.from_tensor(x.view(torch.int32), [8, 64], register_a._W_SMEM)
