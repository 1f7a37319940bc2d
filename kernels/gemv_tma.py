"""The one-row GEMV on the big weights, its weights streamed by a TMA producer warp (Gluon, sm_90).

gemv.py's loop holds the next step's weights in registers: 72 a thread, so 7 programs an SM, and
its warps wait on their loads in 43% of their issue gaps (Nsight Compute, 7B gate/up; kernels/README
has the numbers). Here the bytes in flight live in shared memory instead. A program takes 32 rows
(two 16-row groups of the interleaved layout) and has five warps:

  * the producer warp copies one 512-k step a stage by TMA: for each of the step's four 128-k
    windows, each group's 1 KB of words and 128 bytes of scales (16 copies), into a ring of S
    stages; an mbarrier pair a stage (ready: its bytes landed; free: the consumers took them);
  * the four consumer warps take one window each of every step. A thread holds rows g, g + 8,
    g + 16, g + 24 of its 16-byte lane t: four words and their two scales, read from the stage into
    registers once the stage is ready, which frees the stage at once. It then runs gemv.py's own
    x prep and lane sum on them (the same inline PTX, so the same sum a lane), and the warps' sums
    meet in the epilogue (gemv.py sums the lanes in another order: the fp32 bits of a row may
    differ in the last place).

So a thread keeps one step of words, not two, and 48 registers allow 8 programs an SM with two
stages (18 KB) each. The biggest weights take it at one row (gemm.gemv_tma_takes: gate/up, and 32B's
down), where it is the faster; on the others (q/k/v, o, 7B and 14B down) gemv.py's lighter programs,
which split K more finely, start and finish sooner.

The epilogue is gemv.py's: scale, bias, bf16; the LoRA update from the shrink's partials
(fp4_decode._lora_update's sums, h rounded to bf16) added and rounded again; SiLU·mul for a stacked
gate/up weight (the program takes gate rows j and up rows I + j: its first and second group);
split-K partials summed in order by the split that counts last (fp4_decode._last_split's
contract). PDL as gemv.py: the consumers wait on the kernel before them before they read x, or
after the main loop where the kernel before is the LoRA shrink (its partials are read only in the
epilogue); the producer never waits, since it reads only the weights. The next kernel is released
after the main loop, or at the wait by the gate/up launch (launch.py says why).

    x2      int32 (1, K/2)        x as bf16 pairs
    W       interleaved words and scale bytes (register_a.weight_descriptors, 16-row boxes)
    out     bf16 (1, N) (SILU: (1, N/2)); partials fp32 (split, 1, N)

Needs K a multiple of 512 and N of 32 (gemv_tma_takes checks both). Leaves out: the CPU
interpreter (Gluon and TMA do not run there; CPU runs take gemv.py).
Test: tests/test_kernels_gemv_tma.py (GPU: against float64 on the 7B and 32B MLP shapes with the
LoRA update, a bias, split-K and SiLU·mul, whose bits are the plain launch's followed by
fused_ops.silu_mul; CPU: the route and the split rule).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from . import gemv, register_a

BN = gl.constexpr(32)   # rows a program: two 16-row groups
STAGES = 2              # ring stages (18 KB a program): a deeper ring costs programs an SM
REGS = 48               # registers a thread: 8 programs an SM (40 spills; 56 fits 7)
_LOAD_X = gl.constexpr(gemv._LOAD_X_PTX.value)
_X_F16 = gl.constexpr(gemv._X_F16_PTX.value)
_LANE_SUM = gl.constexpr(gemv._LANE_SUM_PTX.value)
_LOAD_X_C = gl.constexpr(gemv._LOAD_X_CONSTRAINTS.value)
_X_F16_C = gl.constexpr(gemv._X_F16_CONSTRAINTS.value)
_LANE_SUM_C = gl.constexpr(gemv._LANE_SUM_CONSTRAINTS.value)
_PREFETCH_L2 = gl.constexpr(gemv._PREFETCH_L2_PTX.value)
_POST = gl.constexpr(register_a._POST.value)


@gluon.jit
def _producer(w_desc, s_desc, ws, ss, ready, free, ga, gb, step_start, step_end):
    """Fill stage i % S with step i's words and scales (slot 2w + h: window w of group ga or gb)
    once the consumers have freed it."""
    nbytes: gl.constexpr = 8 * (w_desc.block_type.nbytes + s_desc.block_type.nbytes)
    for step in range(step_start, step_end):
        stage = register_a.claim_stage(step - step_start, ready, free, nbytes)
        for w in gl.static_range(4):
            for h in gl.static_range(2):
                g = ga + h * (gb - ga)
                tma.async_copy_global_to_shared(w_desc, [g, (step * 4 + w) * 256], ready.index(stage),
                                                ws.index(stage).slice(2 * w + h, 1))
                tma.async_copy_global_to_shared(s_desc, [g, (step * 4 + w) * 128], ready.index(stage),
                                                ss.index(stage).slice(2 * w + h, 1))


@gluon.jit
def _main_loop(ws, ss, ready, free, x2_ptr, step_start, step_end, LS: gl.constexpr):
    """The (4, BN, 4) fp32 sums (window, row, lane) of this program's steps."""
    S: gl.constexpr = ws.type.shape[0]
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 8, 4], [4, 1, 1], [2, 1, 0])     # (window, row, word)
    P3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    wi = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, LS)))
    ti = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LS)))
    xo = (wi * 64)[:, None, None] + (ti * 16)[None, None, :]                  # (4, 1, 4): a lane's first x word
    acc = gl.zeros([4, BN, 4], gl.float32, LS)
    for step in range(step_start, step_end):
        i = step - step_start
        stage = i % S
        x = gl.inline_asm_elementwise(_LOAD_X, _LOAD_X_C, [x2_ptr + (step * 256 + xo), (xo >= 0).to(gl.int32)],
                                      dtype=(gl.int32,) * 16, is_pure=False, pack=1)
        q = gl.inline_asm_elementwise(_X_F16, _X_F16_C, [x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8], x[9],
                                                         x[10], x[11], x[12], x[13], x[14], x[15]],
                                      dtype=(gl.int32,) * 16 + (gl.float32,), is_pure=True, pack=1)
        mbarrier.wait(ready.index(stage), (i // S) & 1)
        words = ws.index(stage)._reinterpret(gl.int32, [4, BN, 16], P3).load(L3)
        sc = ss.index(stage)._reinterpret(gl.int16, [4, BN, 4], P3).load(LS).to(gl.int32)   # a lane's 2 scales
        fence_async_shared()
        mbarrier.arrive(free.index(stage), count=1)
        a, b = gl.split(gl.reshape(words, [4, BN, 4, 2, 2]))                   # word j = 2·j_hi + j_lo
        w0, w2 = gl.split(a)
        w1, w3 = gl.split(b)
        w0 = gl.convert_layout(w0, LS, assert_trivial=True)
        w1 = gl.convert_layout(w1, LS, assert_trivial=True)
        w2 = gl.convert_layout(w2, LS, assert_trivial=True)
        w3 = gl.convert_layout(w3, LS, assert_trivial=True)
        acc += gl.inline_asm_elementwise(
            _LANE_SUM, _LANE_SUM_C,
            [w0, w1, w2, w3, sc, q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], q[12],
             q[13], q[14], q[15], q[16]], dtype=gl.float32, is_pure=True, pack=1)
    return acc


@gluon.jit
def _update(hp_ptr, lb_ptr, lora_scale, RB, N1, N2, rows, N, R, LSPLIT: gl.constexpr, LR: gl.constexpr):
    """s · bf16(sum_j hp[j, 0, ranks]) · B[rows, :]ᵀ (fp32, (BN,)): fp4_decode._lora_update at one row,
    each row reading its own member's RB ranks of h (B a group's compact B: fp4_decode._lora_part)."""
    UL: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [4, 1], [1, 0])
    r = gl.arange(0, LR, layout=gl.SliceLayout(0, UL))[None, :]                 # (1, LR)
    n = gl.convert_layout(rows, gl.SliceLayout(1, UL))[:, None]                 # (BN, 1)
    ranks = ((n >= N1).to(gl.int32) + (n >= N2).to(gl.int32)) * RB + r         # (BN, LR): h's ranks of row n
    h = gl.load(hp_ptr + ranks, mask=ranks < R, other=0.0).to(gl.float32)
    for j in gl.static_range(1, LSPLIT):
        h += gl.load(hp_ptr + j * R + ranks, mask=ranks < R, other=0.0)
    h = h.to(gl.bfloat16).to(gl.float32)
    b = gl.load(lb_ptr + n * RB + r, mask=(n < N) & (r < RB), other=0.0)
    return gl.convert_layout(lora_scale * gl.sum(h * b.to(gl.float32), axis=1), rows.type.layout)


@gluon.jit
def _pairs(v):
    """(BN,) -> (BN/2, 2): element j pairs v[j] with v[BN/2 + j], both in one thread."""
    PL: gl.constexpr = gl.BlockedLayout([1, 2], [32, 1], [4, 1], [1, 0])
    return gl.convert_layout(gl.permute(gl.reshape(v, [2, BN // 2]), [1, 0]), PL)


@gluon.jit
def _finish(acc, rows, gs_ptr, bias_ptr, hp_ptr, lb_ptr, lora_scale, RB, N1, N2, out_ptr, N, R,
            HAS_BIAS: gl.constexpr, LORA: gl.constexpr, LSPLIT: gl.constexpr, LR: gl.constexpr, SILU: gl.constexpr):
    """Store y[rows] from the fp32 sums acc: times 2^7/global_scale, + bias, bf16, + the LoRA update
    (rounded again), and with SILU silu(gate)·up of the two groups (fp4_decode.silu_mul's math)."""
    y = acc * (_POST / gl.load(gs_ptr))
    if HAS_BIAS:
        y += gl.load(bias_ptr + rows).to(gl.float32)
    y = y.to(gl.bfloat16)
    if LORA:
        y = (y.to(gl.float32) + _update(hp_ptr, lb_ptr, lora_scale, RB, N1, N2, rows, N, R, LSPLIT, LR)).to(gl.bfloat16)
    if SILU:
        g, u = gl.split(_pairs(y))                                             # gate rows j, up rows I + j
        _, cols = gl.split(_pairs(rows - N // 2))
        gf = g.to(gl.float32)
        s = (gf / (1 + gl.exp(-gf))).to(gl.bfloat16)
        gl.store(out_ptr + cols, (s.to(gl.float32) * u.to(gl.float32)).to(gl.bfloat16))
    else:
        gl.store(out_ptr + rows, y)


@gluon.jit
def _consumer(ws, ss, ready, free, x2_ptr, gs_ptr, bias_ptr, part_ptr, y_ptr, count_ptr, hp_ptr, lb_ptr, lora_scale,
              RB, N1, N2, rows, N, R, step_start, step_end, pid_n, pid_k, NSPLIT, stride_os, HAS_BIAS: gl.constexpr,
              PARTIAL: gl.constexpr, LORA: gl.constexpr, LSPLIT: gl.constexpr, LR: gl.constexpr,
              SILU: gl.constexpr, LATE_WAIT: gl.constexpr, USE_PDL: gl.constexpr, PREFETCH_B: gl.constexpr):
    """The main loop, then the epilogue of a row tile (or its partial, and the sum by the last split)."""
    LS: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 8, 4], [4, 1, 1], [2, 1, 0])     # (window, row, lane)
    if LORA and PREFETCH_B:
        if pid_k == 0:                           # the rows of B the epilogue reads (gemv._prefetch_lora_b)
            for c in range(0, RB, 64):
                gl.inline_asm_elementwise(_PREFETCH_L2, "=r,l,r", [lb_ptr + rows * RB + c, (rows < N).to(gl.int32)],
                                          dtype=gl.int32, is_pure=False, pack=1)
    if USE_PDL and not LATE_WAIT:
        register_a.grid_wait()
        if SILU:
            register_a.grid_release()
    acc = _main_loop(ws, ss, ready, free, x2_ptr, step_start, step_end, LS)
    if USE_PDL:
        if LATE_WAIT:
            register_a.grid_wait()
        if LATE_WAIT or not SILU:
            register_a.grid_release()
    y = gl.convert_layout(gl.sum(gl.sum(acc, axis=2), axis=0), rows.type.layout)   # (BN,)
    if PARTIAL:
        gl.store(part_ptr + pid_k * stride_os + rows, y)
        if register_a.last_split(count_ptr, pid_n, NSPLIT):
            total = gl.load(part_ptr + rows, cache_modifier=".cg")
            for sp in range(1, NSPLIT):
                total += gl.load(part_ptr + sp * stride_os + rows, cache_modifier=".cg")
            _finish(total, rows, gs_ptr, bias_ptr, hp_ptr, lb_ptr, lora_scale, RB, N1, N2, y_ptr, N, R, HAS_BIAS, LORA,
                    LSPLIT, LR, SILU)
    else:
        _finish(y, rows, gs_ptr, bias_ptr, hp_ptr, lb_ptr, lora_scale, RB, N1, N2, y_ptr, N, R, HAS_BIAS, LORA, LSPLIT,
                LR, SILU)


@gluon.jit
def _gemv_tma_kernel(x2_ptr, w_desc, s_desc, gs_ptr, bias_ptr, part_ptr, y_ptr, count_ptr, hp_ptr, lb_ptr, lora_scale,
                     RB, N1, N2, N, R, NSTEP, STEP_SPLIT, NSPLIT, stride_os,
                     HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr, LORA: gl.constexpr, LSPLIT: gl.constexpr,
                     LR: gl.constexpr, SILU: gl.constexpr, LATE_WAIT: gl.constexpr, USE_PDL: gl.constexpr,
                     PREFETCH_B: gl.constexpr, S: gl.constexpr, num_warps: gl.constexpr):
    """Program (pid_n, pid_k): rows of groups ga and gb (2·pid_n and 2·pid_n + 1, or with SILU gate
    group pid_n and up group N/32 + pid_n), steps [pid_k·STEP_SPLIT, +STEP_SPLIT) of NSTEP."""
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    if SILU:
        ga = pid_n
        gb = N // 32 + pid_n
    else:
        ga = 2 * pid_n
        gb = ga + 1
    YL: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    i = gl.arange(0, BN, layout=YL)
    rows = gl.where(i < 16, ga * 16 + i, gb * 16 + i - 16)                     # (BN,): W's rows of the tile
    ws = gl.allocate_shared_memory(gl.int32, [S, 8, 256], w_desc.layout)      # slot 2w + h: window w, group h
    ss = gl.allocate_shared_memory(gl.uint8, [S, 8, 128], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(S):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(free.index(st), count=1)
    step_start = pid_k * STEP_SPLIT
    step_end = gl.minimum(NSTEP, step_start + STEP_SPLIT)
    gl.warp_specialize([
        (_consumer, (ws, ss, ready, free, x2_ptr, gs_ptr, bias_ptr, part_ptr, y_ptr, count_ptr, hp_ptr, lb_ptr,
                     lora_scale, RB, N1, N2, rows, N, R, step_start, step_end, pid_n, pid_k, NSPLIT, stride_os,
                     HAS_BIAS, PARTIAL, LORA, LSPLIT, LR, SILU, LATE_WAIT, USE_PDL, PREFETCH_B)),
        (_producer, (w_desc, s_desc, ws, ss, ready, free, ga, gb, step_start, step_end)),
    ], [1], [register_a.LOADER_REGS])
