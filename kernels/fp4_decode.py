"""NVFP4 inside a kernel: E2M1 codes and E4M3 scales to exact bf16 / fp32 operands, and the epilogue.

Every NVFP4 kernel (tiles.py, gemv.py, small_m.py, register_a*.py; gemm.py launches them) reads
the compressed-tensors bytes, in their own layout or in nvfp4.interleave's 16 x 128 tiles
(_tiled_offsets), and decodes them in registers. The pieces they share are here: @triton.jit
device functions (inlined into the kernels) and inline-PTX strings held as tl.constexpr (a jit
function may read no other module global). The bytes they take:

    packed        uint8  (N, K/2)   two E2M1 codes per byte, even k in the LOW nibble
    scale         uint8  (N, K/16)  E4M3 bits (the wrappers view float8_e4m3fn as uint8)
    global_scale  float32 (1,)
    W[n, k] = e2m1(code[n, k]) * scale[n, k // 16] / global_scale

E2M1 to bf16 (the hot spot: at M <= 64 it costs as much as reading the bytes). A code is
s|e e|m (sign, 2 exponent bits, 1 mantissa bit); its magnitudes are 0, .5, 1, 1.5, 2, 3, 4, 6.
Moving the three magnitude bits into bf16 bits 8..6 (the two lowest exponent bits and the top
mantissa bit) and the sign into bit 15 gives a bf16 whose value is exactly e2m1 · 2^-126: for
e >= 1 it is a normal number 2^(e-127)·(1+m/2), and for e = 0 the bf16 subnormal m·2^-1·2^-126,
which is why the E2M1 subnormal 0.5 needs no special case. On the GPU this is done by inline PTX
on four packed bytes at a time (prmt spreads bytes into 16-bit lanes, a shift and an and place the
bits of each nibble, 13 integer ops per 8 weights: _e2m1x4_to_bf16_ptx), followed by one bf16x2
multiply by scale·2^119, so the operand is w·scale·2^-7 (OPERAND_SHIFT): every value is a normal
bf16 and exact (2 significant bits times 4). The factor 2^7/global_scale (OPERAND_POST) is
applied to the fp32 accumulator in the epilogue (_finish).

E2M1 to fp16 pairs, for the CUDA-core GEMV (gemv.py): the magnitude bits on fp16 bits 9..11 and
the sign on bit 15 give exactly e2m1 · 2^-14 (±0.5 the fp16 subnormal 2^-15); nibbles j and j+4 of
a word share one shift, so a pair of codes costs three integer ops (gemv._gemv_row says how).

E4M3 to fp32 (_e4m3_to_f32): integer ops (sign, exponent + bias shift, mantissa, subnormal
branch) and a bitcast, exact, with any power of two folded into the exponent, so no float8 type
is needed inside Triton (the tile kernels' decode; the CUDA-core and fragment kernels use the
hardware's fp8 conversion on the GPU and this function only under the interpreter).

Under TRITON_INTERPRET=1 (CPU tests) inline PTX cannot run and the interpreter's bf16 tl.dot is
wrong (triton 3.9), so the wrappers pass INTERPRET=True: the codes are decoded with plain tl ops
to the same values (_e2m1x2_to_f32, _e2m1_f32) and the kernels run their dots on fp32
copies. _to_bf16 rounds to nearest even by hand there, since that interpreter truncates.

pdl_start, the first statement of every kernel, is the device side of programmatic dependent
launch; the host side (tuning's pdl switch, pdl_launch) is in launch.py, which says why.

Split-K in one launch (_last_split, _sum_splits; the CUDA-core kernel, the fragment kernel at
small M and the swapped tiles; paged_decode.py counts its partitions with _last_split too): every
split stores its fp32 partial tile, then counts itself in an int32 per output tile
(launch.split_counts: zeros, a row per CUDA stream). The contract: barrier, then one
release-acquire atomic add at GPU scope, so the split that counts last sees every partial; it reads
them through L2 (.cg), sums them in split order (the bits of _splitk_reduce_kernel), finishes the
tile, and sets its count back to 0 for the next launch on that stream.

The LoRA update in the epilogue (_lora_update, _lora_update_tile, _add_update): at decode a kernel
that stores a finished tile of y (the GEMV, the fragment kernel, the swapped tiles, the split-K
reduce) may add s · bf16(Σ_j hp[j]) · Bᵀ first (B an adapter's, or a group's compact B: _lora_part),
from the K-chunk partials hp of lora.lora_shrink that ran before it, so no expand kernel is launched
(gemm.folds_lora says where). The shrink's chunk
(_shrink_chunk) is shared by that launch and by a launch that carries the shrink in its first
programs (_carried_shrink: the reduce and expand kernels, lora.carries): each finished rank tile is
counted on one ready word, which the launch's other programs acquire before they read hp
(_await_shrink, the same barrier-and-atomic pattern as _last_split).

Leaves out: FP8 or FP4 activations (this is W4A16), a re-layout of the bits inside a byte.
Test: tests/test_kernels_fp4_decode.py: every byte value and E4M3 scales from subnormal to 448
decode exactly through each kernel (on the CPU the plain-tl branches, on the GPU the PTX); the
in-kernel split sum against the reduce kernel, bit for bit: tests/test_kernels_small_m.py
(test_in_kernel_split_reduce_equals_the_reduce_kernel); the folded LoRA update against float64:
test_kernels_fold_the_lora_update there.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# ----------------------------------------------------------------------------------------------
# constants

OPERAND_SHIFT = tl.constexpr(7)      # the MMA operand is w·scale·2^-7 (all normal bf16 numbers) ...
OPERAND_POST = tl.constexpr(128.0)   # ... so the epilogue multiplies by 2^7 / global_scale
LORA_CHUNK = tl.constexpr(32)        # LoRA ranks a folded update's MMA takes a step (_lora_update_tile)
SHRINK_READY = tl.constexpr(64)      # a carried shrink's flags: rank-tile counts below, then ready, readers
SHRINK_SPINS = tl.constexpr(1 << 24)  # loads of the ready word after which a reader traps (_await_shrink)


# ----------------------------------------------------------------------------------------------
# programmatic dependent launch, device side (the host side and why: launch.py)

@triton.jit
def pdl_start(USE_PDL: tl.constexpr, RELEASE: tl.constexpr = True):
    """The first statement of every kernel launched with pdl_launch(): wait until the previous
    kernel has finished and its writes are visible, then let the next one be scheduled. In this
    order at most one kernel waits ahead; releasing first would let every later kernel of a CUDA
    graph cascade onto the SMs and hold their slots while waiting. RELEASE=False leaves the release
    to a later pdl_release: the kernel after it then waits only through this one's tail (the GEMV's
    reason: launch.py).

    A kernel may load before pdl_start what was written two or more launches back (paged attention's
    first tile, RMSNorm's weight and residual, a matmul's first step of W): the kernel before it let
    it be scheduled only after its own wait, when every kernel before that one had finished. Its own
    predecessor's output must be read after. (W is written when a model is loaded or quantized; the
    one launch that writes it just before a matmul, the pad of an odd K, makes gemm launch that
    matmul without PDL.) So a matmul that folds a LoRA update (LATE_WAIT: the kernel before it is
    lora.lora_shrink, whose input x is the matmul's too) calls pdl_start after its main loop: the
    loop reads only x and the weights and writes nothing, and the shrink's partials, which only the
    epilogue reads, arrive while it streams the weights."""
    if USE_PDL:
        gdc_wait()
        if RELEASE:
            gdc_launch_dependents()


@triton.jit
def pdl_release(USE_PDL: tl.constexpr):
    """Let the next kernel be scheduled, in a kernel that began with pdl_start(USE_PDL, False)."""
    if USE_PDL:
        gdc_launch_dependents()


# ----------------------------------------------------------------------------------------------
# where a weight byte lives: the compressed-tensors layout, or 16 x 128 tiles (nvfp4.interleave)

@triton.jit
def _tiled_offsets(rows, cols, stride, TW: tl.constexpr, IL: tl.constexpr):
    """Offsets of element (rows, cols) of packed (TW = 64 bytes, or 16 where it is read as int32
    words) or scale (TW = 8), `stride` elements per weight row. IL (nvfp4.interleave): every
    16-row x 128-k tile is stored whole, its 16 rows of TW row-major, the tiles of a 16-row group
    one after another along K."""
    return _tile_offsets(rows, cols // TW, cols % TW, stride, TW, IL)


@triton.jit
def _tile_offsets(rows, tile, c, stride, TW: tl.constexpr, IL: tl.constexpr):
    """_tiled_offsets of column tile·TW + c (0 <= c < TW): a loop over K windows passes its window
    index as tile, so that no division of the loop variable is left in the loop (the signed
    divisions of _tiled_offsets(rows, win·16 + c) cost about two dozen SASS instructions a window
    in the fragment kernel)."""
    if IL:
        return ((rows // 16) * (stride // TW) + tile) * (16 * TW) + (rows % 16) * TW + c
    return rows * stride + tile * TW + c


# ----------------------------------------------------------------------------------------------
# E2M1 -> bf16 operand (inline PTX; the tile kernels and the fragment kernel)

# Four packed bytes b0..b3 -> lo = e2m1(low nibbles)·s, hi = e2m1(high nibbles)·s as bf16x2 pairs
# (lo b0, lo b1), (lo b2, lo b3), (hi b0, hi b1), (hi b2, hi b3). A high nibble has its sign on its
# byte's bit 7 and its magnitude on bits 4..6; so has a low nibble in the word shifted left by 4
# (w4 = w << 4: byte i's bits 4..7 are w's bits 8i..8i+3). prmt with the sign-replicate selector
# spreads two bytes of w or w4 into the 16-bit lanes with the byte's sign bit copied over the lane's
# high byte, z = [sx b1, b1, sx b0, b0]; z << 2 holds the sign at 15 (from bit 13) and the magnitude
# at 6..8, and one and keeps them. 13 integer ops a word. Every shift is a left shift, which ptxas
# issues as an IMAD on the FMA pipe, so the ALU pipe takes only the prmts and ands (8 of the 13): at
# decode the register-A kernel is bound by its pipes (Nsight Compute: math-pipe throttle), and a
# right shift or a lop3 would add to the busier one. The fma by the scale pair adds -0 (nz), so w·s
# keeps its sign.
# Needs the registers w4, t declared and nz = 0x80008000.
def _e2m1x4_to_bf16_ptx(word, s01, s23, lo01, lo23, hi01, hi23) -> list[str]:
    return [f"shl.b32 w4, {word}, 4;"] + [
        line for src, sel, s, out in (("w4", "0x9180", s01, lo01), ("w4", "0xB3A2", s23, lo23),
                                      (word, "0x9180", s01, hi01), (word, "0xB3A2", s23, hi23))
        for line in (f"prmt.b32 t, {src}, 0, {sel};", "shl.b32 t, t, 2;", "and.b32 t, t, 0x81C081C0;",
                     f"fma.rn.bf16x2 {out}, t, {s}, nz;")]


_DECODE_REGS = ".reg .b32 w4, t, nz; mov.b32 nz, 0x80008000;"
# $0,$1: lo of (b0,b1),(b2,b3); $2,$3: hi of the same; $4: the 4 bytes; $5,$6: scale pairs
_E2M1X4_TO_BF16_PTX = tl.constexpr("{ " + " ".join(
    [_DECODE_REGS] + _e2m1x4_to_bf16_ptx("$4", "$5", "$6", "$0", "$1", "$2", "$3")) + " }")


# ----------------------------------------------------------------------------------------------
# E4M3 scale -> fp32, E2M1 -> fp32 (the CUDA-core kernel; the plain-tl forms for the interpreter)

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


@triton.jit
def _e2m1x2_to_f32(p):
    """Packed bytes (uint8 tensor) -> (lo, hi) float32 e2m1·2^-126 of the low / high nibble, exact:
    the magnitude bits on fp32 bits 22..24, the sign on bit 31 (the tile kernels' emulation under
    the interpreter, of the bf16 decode's values before the scale)."""
    b = p.to(tl.int32)
    lo = ((b << 28) >> 6) & -0x7E400000             # -0x7E400000 == 0x81C00000
    hi = ((b << 24) >> 6) & -0x7E400000
    return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_f32(code):
    """E2M1 codes (int32 tensor, 0..15) -> float32 values (plain arithmetic: the emulation)."""
    mag = code & 7
    v = tl.where(mag < 2, mag * 0.5, tl.exp2(((mag >> 1) - 1).to(tl.float32)) * (1 + (mag & 1) * 0.5))
    return tl.where((code & 8) != 0, -v, v)


# ----------------------------------------------------------------------------------------------
# epilogue: fp32 sums -> bf16 y

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


# ----------------------------------------------------------------------------------------------
# Split-K summed by the split that finishes last (one launch instead of a kernel + a reduce)

@triton.jit
def _last_split(count_ptr, tile, nsplit):
    """Called by every split of an output tile after storing its fp32 partial: True for the one
    that counts last, which then sees every partial. Every thread's stores come first (barrier),
    then one release-acquire increment of the tile's count (CUTLASS's semaphore pattern); the last
    split sets the count back to 0 for the next launch. nsplit may be a run-time value (the paged
    attention kernel's partitions of one row and kv head)."""
    tl.debug_barrier()
    last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == nsplit - 1
    if last:
        tl.store(count_ptr + tile, 0)
    return last


@triton.jit
def _sum_splits(part_ptr, y_ptr, offs, mask, cols, N, stride_os, gs_ptr, bias_ptr, update,
                NSPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr):
    """y[offs] = _finish(sum over s in order of part[s, offs]): the bits of _splitk_reduce_kernel,
    then + update (fp32, or None: _add_update). offs, mask and cols (the output columns, for the
    bias) share one shape; .cg reads through L2, where the other programs' partials are."""
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, NSPLIT):
        acc += tl.load(part_ptr + s * stride_os + offs, mask=mask, other=0.0, cache_modifier=".cg")
    y = _finish(acc, gs_ptr, bias_ptr, cols, N, HAS_BIAS, INTERPRET)
    tl.store(y_ptr + offs, _add_update(y, update, INTERPRET), mask=mask)


# ----------------------------------------------------------------------------------------------
# The LoRA expand folded into the epilogue (lora.py owns the update; the GEMV, the fragment
# kernel, the swapped tiles and the split-K reduce apply it)

@triton.jit
def _lora_part(cols, N1, N2):
    """Which member of an adapter group output columns cols belong to. A group's B is compact
    (lora.group_casts): row n holds only its own member's RB ranks, B (N, RB), where h (M, R) holds
    every member's, member p's at [p·RB, +RB). Member 0's columns end at N1, member 1's at N2,
    member 2's at N; one adapter (or a block-diagonal B) has N1 = N2 = N and RB = R: one part. RB
    arrives as a kernel argument, so that Triton sees its divisibility and B's rows load as vectors."""
    return (cols >= N1).to(tl.int32) + (cols >= N2).to(tl.int32)


@triton.jit
def _lora_update(hp_ptr, lb_ptr, lora_scale, RB, N1, N2, m, cols, M, N, R, LSPLIT: tl.constexpr, LR: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """s · bf16(sum_j hp[j, m, :]) · B[cols, :]ᵀ in fp32, of the shape m and cols broadcast to:
    lora._lora_expand_kernel's update (h rounded as there) for the rows m of x and the
    output columns cols that a kernel finishing y holds. hp (LSPLIT, M, R) fp32 are the shrink's
    K-chunk partials, B (N, RB) bf16 a group's compact B (_lora_part: each column reads its own
    member's ranks of h); LR >= RB a power of two. A sum of RB products in fp32 per output (the
    expand kernel's MMA sums the same products in another order)."""
    r = tl.arange(0, LR)
    c1 = tl.expand_dims(cols, -1)
    h = _lora_h(hp_ptr, tl.expand_dims(m, -1), _lora_part(c1, N1, N2) * RB + r, M, R, LSPLIT, INTERPRET)
    b = tl.load(lb_ptr + c1 * RB + r, mask=(c1 < N) & (r < RB), other=0.0).to(tl.float32)
    return lora_scale * tl.sum(h * b, axis=-1)


@triton.jit
def _lora_update_tile(hp_ptr, lb_ptr, lora_scale, RB, N1, N2, offs_m, n0, BN: tl.constexpr, M, N, R,
                      LSPLIT: tl.constexpr, PARTS: tl.constexpr, INTERPRET: tl.constexpr):
    """_lora_update for a (BM, BN) tile (BM >= 16 rows offs_m, the BN columns from n0) as MMAs on bf16
    operands, h (BM, RB) · B (BN, RB)ᵀ: the expand kernel's own product (fp32 under the interpreter,
    whose bf16 dot is wrong). A group of PARTS members (a constexpr: one adapter compiles to the
    plain product) takes a product for each member whose columns the tile holds (one, but where it
    straddles two or three), B's other rows zero: the members unrolled, each behind a run-time test (a
    run-time loop over them compiles the split-K reduce to ~25% more registers). Which members the
    tile spans follows from its first and last column, scalars: a min and max over the tile's
    columns, a reduction across its threads, cost the 8-row fragment kernel 20 registers."""
    offs_n = n0 + tl.arange(0, BN)
    d = tl.zeros((offs_m.shape[0], BN), dtype=tl.float32)
    inside = offs_n < N
    if PARTS == 1:
        d = _member_product(d, hp_ptr, lb_ptr, RB, inside, 0, offs_m, offs_n, M, R, LSPLIT, INTERPRET)
    else:
        part = _lora_part(offs_n, N1, N2)                                               # (BN,)
        first, last = _lora_part(n0, N1, N2), _lora_part(n0 + BN - 1, N1, N2)     # past N: masked by inside
        for p in tl.static_range(PARTS):
            if (p >= first) & (p <= last):
                d = _member_product(d, hp_ptr, lb_ptr, RB, inside & (part == p), p, offs_m, offs_n, M, R, LSPLIT,
                                    INTERPRET)
    return lora_scale * d


@triton.jit
def _member_product(d, hp_ptr, lb_ptr, RB, rows, p, offs_m, offs_n, M, R, LSPLIT: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """d + h[:, member p's ranks] · B[offs_n where rows]ᵀ (BM, BN), a run-time loop over RB,
    LORA_CHUNK ranks a step, so that one chunk of h and of B's tile is in registers at a time: a
    kernel's register count is its peak, and the kernels that fold the update in are streaming loops
    that want every program an SM they can get (B's tile in one piece at RB = 128 would be 64 bf16 a
    thread of an 8-warp, 128-row fragment program, on top of what its loop holds)."""
    for r0 in range(0, RB, LORA_CHUNK):
        r = r0 + tl.arange(0, LORA_CHUNK)
        h = _lora_h(hp_ptr, offs_m[:, None], p * RB + r[None, :], M, R, LSPLIT, INTERPRET)      # (BM, CHUNK)
        b = tl.load(lb_ptr + offs_n[:, None] * RB + r[None, :],
                    mask=rows[:, None] & (r[None, :] < RB), other=0.0)                          # (BN, CHUNK)
        if INTERPRET:
            d = tl.dot(h, tl.trans(b.to(tl.float32)), d, input_precision="ieee")
        else:
            d = tl.dot(h.to(tl.bfloat16), tl.trans(b), d)
    return d


@triton.jit
def _lora_h(hp_ptr, m1, r1, M, R, LSPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    """h = bf16(sum_j hp[j, m, r]) as fp32 for rows m1 and ranks r1 (broadcast together); rows past M
    and r past R: 0. hp may also be a bf16 h (M, R) with LSPLIT = 1 (matmul's h form): its values come
    back unchanged, since rounding a bf16 value to bf16 is exact."""
    h_mask = (m1 < M) & (r1 < R)
    h = tl.load(hp_ptr + m1 * R + r1, mask=h_mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, LSPLIT):
        h += tl.load(hp_ptr + (j * M + m1) * R + r1, mask=h_mask, other=0.0)
    return _to_bf16(h, INTERPRET).to(tl.float32)


# ----------------------------------------------------------------------------------------------
# The shrink, alone (lora.lora_shrink) or carried by the launch that folds its update

@triton.jit
def _shrink_chunk(x_ptr, a_ptr, part_ptr, hp_ptr, count_ptr, i, j, M, R, K, stride_xm,
                  BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                  FP32_DOT: tl.constexpr, USE_PDL: tl.constexpr, WAIT: tl.constexpr):
    """K-chunk j (BK wide, one load) of rank tile i (BR rows of A) of h = x Aᵀ for every row of x:
    part[j, m, r] = x[m, K_j] · A[r, K_j] in fp32. The chunk that counts last for tile i sums the
    tile's partials in chunk order into hp (1, M, R) (_last_split: deterministic) and returns True,
    as does every program when SPLIT is 1 (it writes hp itself). A, a weight, is loaded before the
    PDL wait (pdl_start's rule); WAIT: the kernel just before wrote x, so wait before reading it."""
    offs_m = tl.arange(0, BM)
    offs_r = i * BR + tl.arange(0, BR)
    k = j * BK + tl.arange(0, BK)
    a = tl.load(a_ptr + offs_r[:, None] * K + k[None, :],
                mask=(offs_r[:, None] < R) & (k[None, :] < K), other=0.0)           # (BR, BK)
    if WAIT:
        pdl_start(USE_PDL)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)          # (BM, BK)
    if FP32_DOT:
        acc = tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
    else:
        acc = tl.dot(x, tl.trans(a))                                                # (BM, BR) fp32
    offs = offs_m[:, None] * R + offs_r[None, :]
    mask = (offs_m[:, None] < M) & (offs_r[None, :] < R)
    if SPLIT == 1:
        tl.store(hp_ptr + offs, acc, mask=mask)
        return True
    else:
        tl.store(part_ptr + j * M * R + offs, acc, mask=mask)
        last = _last_split(count_ptr, i, SPLIT)
        if last:
            h = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT):
                h += tl.load(part_ptr + s * M * R + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(hp_ptr + offs, h, mask=mask)
        return last


@triton.jit
def _carried_shrink(pid, NS: tl.constexpr, x_ptr, a_ptr, part_ptr, hp_ptr, flag_ptr, M, R, K, stride_xm,
                    BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                    FP32_DOT: tl.constexpr):
    """In a launch after a matmul whose first NS programs compute the shrink its other programs fold
    (NS = 0: none): True in those, after program pid's _shrink_chunk (rank tile pid % tiles, chunk
    pid // tiles, lora_shrink's order; the per-tile counts at flag_ptr[0, SHRINK_READY)), where the
    program that wrote a tile's hp counts it on the ready word flag_ptr[SHRINK_READY] (barrier, one
    release add: _last_split's pattern). They do not wait on the matmul before them: x was written
    before it, and a launch is scheduled only once the kernel two places ahead has finished
    (pdl_start). The caller returns on True and numbers its own programs from pid - NS."""
    took = False
    if NS > 0:
        took = pid < NS
        if took:
            tiles = tl.cdiv(R, BR)
            if _shrink_chunk(x_ptr, a_ptr, part_ptr, hp_ptr, flag_ptr, pid % tiles, pid // tiles, M, R, K,
                             stride_xm, BM, BR, BK, SPLIT, FP32_DOT, False, False):
                tl.debug_barrier()
                tl.atomic_add(flag_ptr + SHRINK_READY, 1, sem="release", scope="gpu")
    return took


@triton.jit
def _trap():
    """End the kernel with an error (PTX trap): the launch fails, and the host's next synchronising
    call raises a CUDA error, where waiting on would hang the stream for good. Never reached in the
    interpreter, which runs a launch's programs in id order (the carried ones first), so no wait there
    sees a flag unset."""
    tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _await_shrink(flag_ptr, R, BR: tl.constexpr, readers, SPINS: tl.constexpr = SHRINK_SPINS):
    """In each of the `readers` programs of a launch that read the hp its first programs write
    (_carried_shrink): wait until the ready word counts every rank tile (one thread's acquire load,
    then a barrier, so every thread's loads of hp come after it), then count this reader; the last
    sets both words back to 0 for the next launch that takes these flags. A wait longer than SPINS
    loads means the flags are wrong (the counters once lived in memory that another tensor reused:
    launch.counters): it traps (_trap), so the run stops with a CUDA error in seconds instead of a
    decode step that never ends. A wait is counted in loads, not in time, so that a launch paused
    while another process has the GPU does not trap. The reads of hp that follow
    are plain loads, as after a grid-wide barrier: the acquire at GPU scope orders them after every
    tile's release (the PTX memory model), and on sm_90 it invalidates the SM's L1 (CCTL.IVALL after
    the acquiring load in the SASS), so no line of hp cached before it is read, whether a load goes
    through L1 or Triton pipelines it into a cp.async. The carried programs have the lowest program
    ids, and the GPU hands out a 1-D launch's programs in id order (observed hardware behaviour, not
    a documented guarantee), so they are on the SMs before any reader waits."""
    spins = 0
    while tl.atomic_add(flag_ptr + SHRINK_READY, 0, sem="acquire", scope="gpu") < tl.cdiv(R, BR):
        spins += 1
        if spins == SPINS:
            _trap()
    tl.debug_barrier()
    if tl.atomic_add(flag_ptr + SHRINK_READY + 1, 1, sem="acq_rel", scope="gpu") == readers - 1:
        tl.store(flag_ptr + SHRINK_READY, 0)
        tl.store(flag_ptr + SHRINK_READY + 1, 0)


@triton.jit
def _add_update(y, update, INTERPRET: tl.constexpr):
    """bf16 y + fp32 update, rounded once more to bf16 (as the separate expand kernel adds it to
    the stored y); y itself where update is None."""
    if update is not None:
        y = _to_bf16(y.to(tl.float32) + update, INTERPRET)
    return y


@triton.jit
def silu_mul(g, u):
    """silu(g)·u for g, u in the activation dtype, as torch's F.silu(g) * u rounds it: silu in fp32
    rounded to the dtype, then the product in fp32 rounded. fused_ops' SiLU·mul kernel, and the
    GEMV's epilogue when it stores silu(gate)·up itself (gemv.py)."""
    gf = g.to(tl.float32)
    s = (gf / (1 + tl.exp(-gf))).to(g.dtype)
    return (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
