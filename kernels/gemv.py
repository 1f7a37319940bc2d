"""The batch-1 decode GEMV: y = x·Wᵀ for one row of x on CUDA cores, in fp16x2 fused multiply-adds.

At one row a projection streams its weight once and does two flops a weight, so the kernel is
bound by how many bytes the SMs keep in flight and how fast they turn them into sums. Both
depend on the instructions a weight: every one of them is issue time, and the shifts and logic
ops of the decode run on the ALU pipe at half rate. This kernel decodes a pair of E2M1 codes
into one fp16x2 register with three integer ops and multiplies it into x with one HFMA2, about
half the instructions of an fp32 decode and FMA per weight (kernels/README.md has the counts and
the timings). Cutting further does not pay: 8% fewer instructions leave the kernels' times as they
are (kernels/README.md), since the loop then waits on its loads and its fp16 chains, not on issue.
gemm.route sends M = 1 here; gemm._gemv launches it with shapes.py's GemvConfig.

Layout. A program owns BN rows of W; a loop step covers BK k (BK/2 bytes of each row), and lane l
of the step owns bytes [16l, 16l + 16) of every row: 32 codes, two 16-k scale blocks. Triton holds
the (BN, L = BK/32) tile as one element per (row, lane), each thread a few rows of one lane, and
the loads (16 bytes of W, the two scale bytes, the lane's 16 x words), the x prep and the block
sums are inline PTX on those elements (_gemv_w, _gemv_s, _gemv_x, _x_block_f16, _lane_sum): no
tensor is split or re-laid out in the loop, which in Triton costs a shared-memory round trip and
barriers every step. The next step's loads are issued before this step's sums (ptxas places them
in the last part of the loop body, where they overlap its tail); the first step's W and scales
go out before the PDL wait, x after it.

The lane sum (_gemv_row has the derivation). A lane's 32 k of a step (two 16-k blocks) take one
power of two 2^c, so that |x·2^c| < 2^16 and every x·2^c is an exact fp16; the codes decode to
fp16 values e2m1·2^-14 exactly; each block's 16 products are summed in two fp16 chains of 8 FMAs
(no overflow: each chain stays below 192), the chains times their block's E4M3 scale·2^-4 and the
two blocks added in fp16 pairs, the pair's halves in fp32, times 2^(11-c), into an fp32
accumulator per (row, lane) that _finish scales by 2^7/global_scale like the MMA kernels' sums. So
the rounding inside a step is fp16's (11 bits), not fp32's: well inside the bf16 output's own
rounding. A row with |x| >= 2^30 anywhere gives NaN; a lane's 32 k whose largest |x| is below
2^-122 count as 0.

Two epilogue folds save a launch each: the LoRA expand (LORA: fp4_decode._lora_update) and, for a
stacked gate/up weight, SiLU·mul (SILU: the program takes gate rows and the same up rows and stores
silu(gate)·up). The GEMV releases the next kernel after its main loop (pdl_release), except the
gate/up one (launch.py says why); with LORA it also waits there, as the fragment kernel does
(LATE_WAIT: fp4_decode.pdl_start). Split-K launches sum their partials in-kernel (REDUCE:
fp4_decode._last_split / _sum_splits) or leave them to tiles._splitk_reduce_kernel.

    x2       int32 (1, K/2)      x viewed as bf16 pairs: word j is (x[2j], x[2j+1]), the pair byte j meets
    packed   uint8 (N, K/2)      read 16 bytes a lane, either layout (IL: nvfp4.interleave)
    scale    uint8 (N, K/16)     E4M3 bits
    out      bf16 (1, N) (with SILU (1, N/2)), or fp32 partial sums (split, 1, N)

Under the interpreter (INTERPRET) the PTX is replaced by plain-tl emulations of the same sums
(each fp16 chain's exact sum rounded to fp16 once, where the GPU rounds after every FMA).
Leaves out: more than one row (from two rows the fragment kernel, small_m.py, is faster).

Test: tests/test_kernels_small_m.py through gemm._gemv: against float64 (CPU: the index maps and
the scaling, through the emulation; GPU: the PTX, on the real projection shapes too), x over a
wide range of magnitudes and the NaN and zero rules, the in-kernel split sum, the folded LoRA
update and SiLU·mul; the routing: tests/test_kernels_gemm.py. Benchmark: python bench/kernel.py.
"""
import triton
import triton.language as tl

from .fp4_decode import (_e2m1_f32, _e4m3_to_f32, _finish, _last_split, _lora_update, _add_update, _sum_splits,
                         _tiled_offsets, pdl_release, pdl_start, silu_mul)

# ----------------------------------------------------------------------------------------------
# inline PTX on one element of the (BN, L) tile: a row and a lane (module docstring)

# one lane's 16 bytes of W (weights: not written while a decode runs, so read non-coherently)
_LOAD_W_PTX = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $5, 0; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; "
                           "mov.b32 $3, 0; @p ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4]; }")
# ask L2 for the line at $1 where $2 != 0 (the rows of B a folded LoRA update reads: _prefetch_lora_b)
_PREFETCH_L2_PTX = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }")
# one lane's two scale bytes (E4M3), low byte = the first block's; 0 past kb_end
_LOAD_S_PTX = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.nc.u16 $0, [$1]; }")
# one lane's 16 x words (bf16 pairs), written by the kernel before: read after the PDL wait
_LOAD_X_PTX = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $17, 0; " + " ".join(f"mov.b32 ${i}, 0;" for i in range(16))
                           + " " + " ".join(f"@p ld.global.v4.u32 {{${4 * j}, ${4 * j + 1}, ${4 * j + 2}, ${4 * j + 3}}}, "
                                            f"[$16+{16 * j}];" for j in range(4)) + " }")

def _x_f16_ptx() -> str:
    """Inline PTX: a lane's 16 x words of a step (two 16-k blocks) -> its 16 fp16 pairs (x_k, x_k+4)·2^c
    and f = 2^(11-c) (_gemv_row). Operands: $0..$15 the pairs, $16 f, $17..$32 the words.
    E: the largest bf16 exponent field (max.u16x2 over the masked words, then of the two halves);
    c = 142 - E, so the bf16x2 multiplier 2^(c-112) = 2^(30-E) has exponent field 157 - E in each
    half (·0x00800080), and f = 2^(E-131) has fp32 exponent field E - 4 (0 below E = 5; NaN above
    E = 156, where 157 - E would leave the field). Each pair: prmt, the multiply, and + mad."""
    lines = [".reg .b32 a, b, t, e, mm, nz; .reg .pred big; mov.b32 nz, 0x80008000;",
             "and.b32 a, $17, 0x7F807F80;"]
    lines += [f"and.b32 b, ${i}, 0x7F807F80; max.u16x2 a, a, b;" for i in range(18, 33)]
    lines += ["shr.b32 t, a, 16; and.b32 a, a, 0xFFFF; max.u32 e, a, t; shr.b32 e, e, 7;",
              "sub.s32 t, 157, e; max.s32 t, t, 1; mul.lo.u32 mm, t, 0x00800080;",
              "sub.s32 t, e, 4; max.s32 t, t, 0; shl.b32 t, t, 23; setp.gt.u32 big, e, 156;",
              "selp.b32 $16, 0x7FC00000, t, big;"]
    words = [(0, 2), (0, 2), (1, 3), (1, 3), (4, 6), (4, 6), (5, 7), (5, 7)]
    for o in range(16):                      # pair o: block o // 8, word pair words[o % 8], low or high halves
        a, b = (17 + 8 * (o // 8) + w for w in words[o % 8])
        lines += [f"prmt.b32 t, ${a}, ${b}, {'0x7632' if o % 2 else '0x5410'}; fma.rn.bf16x2 t, t, mm, nz;",
                  f"and.b32 a, t, 0x7FFF7FFF; mad.lo.u32 ${o}, a, 7, t;"]
    return "{ " + " ".join(lines) + " }"


_X_F16_PTX = tl.constexpr(_x_f16_ptx())


def _lane_sum_ptx() -> str:
    """Inline PTX for one lane and row: its 4 words of codes (two blocks) against the blocks' fp16
    x pairs, each block in two fp16 chains of 8 FMAs, the chains times their block's scale·2^-4 and
    added in fp16 pairs, the two halves in fp32, times f.
    Operands: $0 out; $1..$4 the words, $5 the two scale bytes, $6..$21 the x pairs, $22 f."""
    lines = [".reg .b32 e, o, t, u, p, ta, tb, s2, sa, sb; .reg .b16 sc; .reg .f16 lo, hi; .reg .f32 fl, fh, r;"]
    for blk, acc in ((0, "ta"), (1, "tb")):
        first = True
        for w in (2 * blk + 1, 2 * blk + 2):
            q = 6 + 8 * blk + 4 * (w - 2 * blk - 1)
            lines += [f"and.b32 e, ${w}, 0x0F0F0F0F;", f"and.b32 o, ${w}, 0xF0F0F0F0;"]
            for i, (a, b) in enumerate((("shl.b32 t, e, 9;", "shl.b32 u, e, 12;"), ("shl.b32 t, o, 5;", "shl.b32 u, o, 8;"),
                                        ("shl.b32 t, e, 1;", "shl.b32 u, e, 4;"), ("shr.b32 t, o, 3;", "mov.b32 u, o;"))):
                lines += [a, b, "lop3.b32 p, t, u, 0x8E008E00, 0xA8;",
                          f"mul.rn.f16x2 {acc}, p, ${q + i};" if first else f"fma.rn.f16x2 {acc}, p, ${q + i}, {acc};"]
                first = False
    lines += ["cvt.u16.u32 sc, $5;", "cvt.rn.f16x2.e4m3x2 s2, sc;", "mov.b32 sa, 0x2C002C00;", "mul.rn.f16x2 s2, s2, sa;",
              "prmt.b32 sa, s2, 0, 0x1010;", "prmt.b32 sb, s2, 0, 0x3232;",
              "mul.rn.f16x2 t, ta, sa;", "fma.rn.f16x2 t, tb, sb, t;",
              "mov.b32 {lo, hi}, t;", "cvt.f32.f16 fl, lo;", "cvt.f32.f16 fh, hi;", "add.f32 r, fl, fh;",
              "mul.f32 $0, r, $22;"]
    return "{ " + " ".join(lines) + " }"


_LANE_SUM_PTX = tl.constexpr(_lane_sum_ptx())
_X_F16_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 17 + ["r"] * 16))
_LANE_SUM_CONSTRAINTS = tl.constexpr(",".join(["=f"] + ["r"] * 21 + ["f"]))
_LOAD_X_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 16 + ["l", "r"]))


@triton.jit
def _gemv_w(w_ptr, live, INTERPRET: tl.constexpr):
    """The 4 words (8 codes each) of each (row, lane) of the step: (BN, L) int32 x 4; 0 past kb_end.
    Loaded before the PDL wait for the first step, so the asm is not pure (it stays where it is)."""
    if INTERPRET:
        p4 = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        return (tl.load(p4, mask=live, other=0), tl.load(p4 + 1, mask=live, other=0),
                tl.load(p4 + 2, mask=live, other=0), tl.load(p4 + 3, mask=live, other=0))
    return tl.inline_asm_elementwise(_LOAD_W_PTX, "=r,=r,=r,=r,l,r", [w_ptr, live.to(tl.int32)],
                                     dtype=(tl.int32,) * 4, is_pure=False, pack=1)


@triton.jit
def _gemv_s(s_ptr, live, INTERPRET: tl.constexpr):
    """The two E4M3 scale bytes of each (row, lane) of the step, as one int32 (first block's low); 0
    past kb_end, so that garbage scales past the row (NaN codes) never meet x = 0."""
    if INTERPRET:
        return (tl.load(s_ptr, mask=live, other=0).to(tl.int32)
                | (tl.load(s_ptr + 1, mask=live, other=0).to(tl.int32) << 8))
    return tl.inline_asm_elementwise(_LOAD_S_PTX, "=r,l,r", [s_ptr, live.to(tl.int32)],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemv_x(x_ptr, live, INTERPRET: tl.constexpr):
    """The 16 x words (bf16 pairs (x[2j], x[2j+1]), j: the byte they meet) of each lane: (1, L) x 16;
    0 past kb_end. Not pure either: x is the kernel before's output, read only after the PDL wait."""
    if INTERPRET:
        return (tl.load(x_ptr, mask=live, other=0), tl.load(x_ptr + 1, mask=live, other=0),
                tl.load(x_ptr + 2, mask=live, other=0), tl.load(x_ptr + 3, mask=live, other=0),
                tl.load(x_ptr + 4, mask=live, other=0), tl.load(x_ptr + 5, mask=live, other=0),
                tl.load(x_ptr + 6, mask=live, other=0), tl.load(x_ptr + 7, mask=live, other=0),
                tl.load(x_ptr + 8, mask=live, other=0), tl.load(x_ptr + 9, mask=live, other=0),
                tl.load(x_ptr + 10, mask=live, other=0), tl.load(x_ptr + 11, mask=live, other=0),
                tl.load(x_ptr + 12, mask=live, other=0), tl.load(x_ptr + 13, mask=live, other=0),
                tl.load(x_ptr + 14, mask=live, other=0), tl.load(x_ptr + 15, mask=live, other=0))
    return tl.inline_asm_elementwise(_LOAD_X_PTX, _LOAD_X_CONSTRAINTS, [x_ptr, live.to(tl.int32)],
                                     dtype=(tl.int32,) * 16, is_pure=False, pack=1)


@triton.jit
def _x_step_f16(x, INTERPRET: tl.constexpr):
    """A lane's 16 x words of a step (a tuple) -> its 16 fp16 pairs (x_k, x_k+4)·2^c, 8 a 16-k block,
    and f = 2^(11-c) (_gemv_row)."""
    if INTERPRET:
        e = _x_exp(x[0])
        for i in tl.static_range(1, 16):
            e = tl.maximum(e, _x_exp(x[i]))
        m = ((269 - tl.maximum(e, 15)) << 23).to(tl.float32, bitcast=True)     # 2^(142 - e)
        f = tl.where(e > 156, float("nan"), tl.where(e >= 5, ((e - 4) << 23).to(tl.float32, bitcast=True), 0.0))
        return (_x_pair(x[0], x[2], 0, m), _x_pair(x[0], x[2], 1, m), _x_pair(x[1], x[3], 0, m),
                _x_pair(x[1], x[3], 1, m), _x_pair(x[4], x[6], 0, m), _x_pair(x[4], x[6], 1, m),
                _x_pair(x[5], x[7], 0, m), _x_pair(x[5], x[7], 1, m),
                _x_pair(x[8], x[10], 0, m), _x_pair(x[8], x[10], 1, m), _x_pair(x[9], x[11], 0, m),
                _x_pair(x[9], x[11], 1, m), _x_pair(x[12], x[14], 0, m), _x_pair(x[12], x[14], 1, m),
                _x_pair(x[13], x[15], 0, m), _x_pair(x[13], x[15], 1, m), f)
    return tl.inline_asm_elementwise(_X_F16_PTX, _X_F16_CONSTRAINTS,
                                     [x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8], x[9], x[10], x[11],
                                      x[12], x[13], x[14], x[15]],
                                     dtype=(tl.int32,) * 16 + (tl.float32,), is_pure=True, pack=1)


@triton.jit
def _x_exp(xw):
    """The larger bf16 exponent field of a word's pair (the emulation)."""
    return tl.maximum((xw >> 7) & 0xFF, (xw >> 23) & 0xFF)


@triton.jit
def _x_pair(a, b, HI: tl.constexpr, m):
    """(half HI of a, half HI of b)·m as an fp16 pair in an int32 (the emulation)."""
    lo = (_bf16_half(a, HI) * m).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi = (_bf16_half(b, HI) * m).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return lo | (hi << 16)


@triton.jit
def _bf16_half(xw, HI: tl.constexpr):
    """One bf16 of a word as fp32 (the emulation)."""
    if HI:
        return (xw & -65536).to(tl.float32, bitcast=True)
    return (xw << 16).to(tl.float32, bitcast=True)


@triton.jit
def _lane_sum(w0, w1, w2, w3, sc, q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15, f,
              INTERPRET: tl.constexpr):
    """Σ over the lane's two blocks of (Σ e2m1·2^-14 · x·2^c) · scale · f, fp32 (_lane_sum_ptx)."""
    if INTERPRET:
        sa, sb = _e4m3_to_f32(sc & 255, -4), _e4m3_to_f32(sc >> 8, -4)       # scale·2^-4, exact in fp16
        return (_half_emulated(w0, w1, w2, w3, q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15,
                               sa, sb, 0)
                + _half_emulated(w0, w1, w2, w3, q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14,
                                 q15, sa, sb, 1)) * f
    return tl.inline_asm_elementwise(
        _LANE_SUM_PTX, _LANE_SUM_CONSTRAINTS,
        [w0, w1, w2, w3, sc, q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15, f],
        dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _half_emulated(w0, w1, w2, w3, q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15, sa, sb,
                   HI: tl.constexpr):
    """Half HI of a lane's two blocks before f: each block's fp16 chain (its exact sum rounded to fp16
    once; the GPU rounds after every FMA) times its scale·2^-4, the two summed in fp16 (the emulation)."""
    a = (_word_chain(w0, q0, q1, q2, q3, HI) + _word_chain(w1, q4, q5, q6, q7, HI)).to(tl.float16).to(tl.float32)
    b = (_word_chain(w2, q8, q9, q10, q11, HI) + _word_chain(w3, q12, q13, q14, q15, HI)).to(tl.float16)
    t = (a * sa).to(tl.float16).to(tl.float32)
    return (b.to(tl.float32) * sb + t).to(tl.float16).to(tl.float32)


@triton.jit
def _word_chain(w, q0, q1, q2, q3, HI: tl.constexpr):
    """Σ over nibbles j + 4·HI (j < 4) of a word of e2m1·2^-14 · the fp16 half HI of pair q_j (the emulation)."""
    return (_nibble_x(w, q0, 4 * HI, HI) + _nibble_x(w, q1, 1 + 4 * HI, HI)
            + _nibble_x(w, q2, 2 + 4 * HI, HI) + _nibble_x(w, q3, 3 + 4 * HI, HI))


@triton.jit
def _nibble_x(w, q, j: tl.constexpr, HI: tl.constexpr):
    """e2m1(nibble j of w)·2^-14 times the fp16 half HI of q, in fp32 (exact; the emulation)."""
    h = ((q >> (16 * HI)) & 0xFFFF).to(tl.int16)
    return _e2m1_f32((w >> (4 * j)) & 15) * h.to(tl.float16, bitcast=True).to(tl.float32) * (2.0 ** -14)


@triton.jit
def _gemv_row(acc, w, sc, x, INTERPRET: tl.constexpr):
    """acc (BN, L) += each lane's Σ over its two 16-k blocks of w·x·scale·2^-7, from the step's words
    w (a tuple of 4), scale bytes sc and x words x (a tuple of 16), for one row of x.

    x. A lane's 32 k of the step (two blocks) take one power of two 2^c, c = 142 - E where E is the
    largest bf16 exponent field among its 32 x, so |x·2^c| < 2^16: each x·2^c is an exact fp16 (an
    fp16 subnormal, rounded to 2^-21, for an x more than 2^29 below the largest; one 2^c for both
    blocks halves the exponent work, and a block that far below the other adds nothing to y). A bf16x2
    multiply by 2^(c-112) leaves the fp16 exponent field of x·2^c in the bf16 one (both are
    E_x + c - 112), so the fp16 pair is the bf16 pair's magnitude bits shifted up by 3 plus its sign
    bits: (t & 0x7FFF7FFF)·8 + (t & 0x80008000) = (t & 0x7FFF7FFF)·7 + t, one and and one IMAD.
    The pairs are (x_k, x_k+4), the order the codes decode in.
    W. A code s|e1 e0|m with e1 e0 m on fp16 bits 11..9 and s on 15 is exactly e2m1·2^-14 (e = 0:
    the fp16 subnormal m·2^-15). With the even nibbles of a word masked apart from the odd ones
    (0x0F0F0F0F, 0xF0F0F0F0), one shift puts nibbles j and j+4 on bits 11..9 and 27..25, another
    their signs on 15 and 31, and no other bit of the word lands on 0x8E008E00: a pair of codes costs
    two shifts and one lop3 (a | b) & c, and its two products one fp16x2 FMA.
    Sums. Each block is two chains of 8 FMAs in fp16 (|products| < 6·2^-14·2^16 = 24, chains < 192:
    no overflow). Each chain times its block's scale·2^-4 (exact in fp16: E4M3's 2^-9 .. 448 become
    2^-13 .. 28), the two blocks' chains added in fp16 pairs (< 2·192·28 = 10,752: no overflow), then fp32:
    (lo + hi)·f with f = 2^(11-c), so acc is Σ w·x·scale·2^-7, the MMA kernels' operand scale that
    _finish undoes. A step with |x| >= 2^30 gives f = NaN (y is NaN), one whose largest |x| is below
    2^-122 gives f = 0."""
    q = _x_step_f16(x, INTERPRET)
    return acc + _lane_sum(w[0], w[1], w[2], w[3], sc, q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9],
                           q[10], q[11], q[12], q[13], q[14], q[15], q[16], INTERPRET)


@triton.jit
def _gemv_store(acc, m, offs_n, out_ptr, gs_ptr, bias_ptr, M, N, stride_om, lora,
                HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, SILU: tl.constexpr, INTERPRET: tl.constexpr):
    """Row m of y (or of the fp32 partial sums) from its (BN, L) accumulator; lora: the (BN,) LoRA
    update of a finished row, or None. With SILU, row m of silu(gate)·up: rows 2j, 2j + 1 of the
    tile are gate row j and up row j (see the kernel), and y is (M, N/2)."""
    y = tl.sum(acc, axis=1)                                                       # (BN,)
    if not PARTIAL:
        y = _add_update(_finish(y, gs_ptr, bias_ptr, offs_n, N, HAS_BIAS, INTERPRET), lora, INTERPRET)
    if SILU:                                         # the bf16 gate and up that y would hold, then
        BN: tl.constexpr = y.shape[0]                # fused_ops.silu_mul's math
        g, u = tl.split(tl.reshape(y, (BN // 2, 2)))
        y = silu_mul(g, u)                                                        # (BN/2,)
        offs_n, _ = tl.split(tl.reshape(offs_n, (BN // 2, 2)))                    # j: y's column
        N = N // 2
    if m < M:
        tl.store(out_ptr + m * stride_om + offs_n, y, mask=offs_n < N)


@triton.jit
def _gemv_update(hp_ptr, lb_ptr, lora_scale, RB, N1, N2, m: tl.constexpr, offs_n, M, N, R, LSPLIT: tl.constexpr,
                 LR: tl.constexpr, INTERPRET: tl.constexpr):
    """The (BN,) LoRA update of row m of y (fp4_decode._lora_update)."""
    return _lora_update(hp_ptr, lb_ptr, lora_scale, RB, N1, N2, tl.full((1,), m, tl.int32), offs_n, M, N, R, LSPLIT,
                        LR, INTERPRET)


@triton.jit
def _prefetch_lora_b(lb_ptr, cols, N, RB, PREFETCH: tl.constexpr, INTERPRET: tl.constexpr):
    """Ask L2 for the rows cols of B (N, RB) bf16, one request per row and 64 ranks: nothing is held
    in a register or waited on. Issued before the main loop, the rows the LoRA fold reads in the
    epilogue arrive while the weights stream, and that read, at the program's tail, finds them in
    L2. Only the one-row GEMVs ask: the same request in the fragment kernel lengthened the 2- and
    8-row decode steps (kernels/README.md has the A/B). Nothing under the interpreter or without
    PREFETCH."""
    if PREFETCH and not INTERPRET:
        for c in range(0, RB, 64):
            tl.inline_asm_elementwise(_PREFETCH_L2_PTX, "=r,l,r", [lb_ptr + cols * RB + c, (cols < N).to(tl.int32)],
                                      dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["M"])
def _nvfp4_gemv_kernel(
    # pointers (x2: x viewed as int32 words, one bf16 pair each)
    x2_ptr, packed_ptr, scale_ptr, gs_ptr, bias_ptr, out_ptr,
    y_ptr, count_ptr,          # with REDUCE: y (M, N) bf16, and one int32 count per tile (zero)
    hp_ptr, lb_ptr, lora_scale,  # with LORA: y += s·bf16(Σ hp)·Bᵀ, hp (LSPLIT, M, R_LORA) fp32, B (N, lora_rb)
    lora_rb, lora_n1, lora_n2,   # B's ranks a row, the group's cuts (fp4_decode._lora_part)
    # sizes: x (M = 1, K), W (N, K), K2 = K/2 (bytes per row of W, words of x2);
    # each program of split pid_k reduces the bytes [pid_k·SPLIT2, +SPLIT2) of its rows
    M, N, K2, SPLIT2, R_LORA,
    # strides (the innermost stride of every tensor is 1)
    stride_pn, stride_sn, stride_om, stride_os,
    # meta
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,     # PARTIAL: write fp32 partial sums (split-K)
    REDUCE: tl.constexpr, NSPLIT: tl.constexpr,        # REDUCE: the tile's last split sums them
    BN: tl.constexpr, BK: tl.constexpr,                # BN rows a program, BK k a loop step
    IL: tl.constexpr,                                  # W interleaved (nvfp4.interleave)
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,     # launched with pdl_launch(): see pdl_start
    LORA: tl.constexpr, LSPLIT: tl.constexpr, LR: tl.constexpr,   # the folded LoRA expand (LR >= lora_rb)
    LATE_WAIT: tl.constexpr,   # the kernel before is lora_shrink: wait after the main loop (pdl_start)
    SILU: tl.constexpr,        # W = [gate; up] (N = 2I rows), out = silu(x·gateᵀ)·(x·upᵀ) (1, I)
    PREFETCH_B: tl.constexpr,  # with LORA: split 0 asks L2 for the tile's rows of B (_prefetch_lora_b)
):
    """y[0, n] = sum_k x[0, k] · W[n, k] on CUDA cores: BN rows of W per program, a (BN, L) tile of
    fp32 sums (one per row and lane; the warps of num_warps split the rows, and every thread loads
    its lane's x). With LORA, whoever finishes the row adds the LoRA update
    (fp4_decode._lora_update) before storing it: the expand kernel's work, without its launch. With
    SILU (no split), a program takes BN/2 gate rows and the same up rows, interleaved in its tile
    (rows 2j, 2j + 1: gate row j, up row I + j), and stores silu(gate)·up: the SiLU·mul kernel's
    work, without its launch or the (1, 2I) round trip. The next kernel is released after the main
    loop, except by the gate/up GEMV (SILU)."""
    BKB: tl.constexpr = BK // 2                          # bytes of a weight row per step
    L: tl.constexpr = BKB // 16                          # lanes: 16 bytes (32 codes) of each row a step
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    r = tl.arange(0, BN)
    if SILU:
        tl.static_assert(not PARTIAL)
        offs_n = pid_n * (BN // 2) + r // 2 + (r % 2) * (N // 2)                  # (BN,)
    else:
        offs_n = pid_n * BN + r                                                   # (BN,)
    rows = (offs_n % N)[:, None]                         # (BN, 1); rows past N wrapped, never stored
    w_rows = packed_ptr + _tiled_offsets(rows, 0, stride_pn, 64, IL)               # _tiled_offsets is a sum
    s_rows = scale_ptr + _tiled_offsets(rows, 0, stride_sn, 8, IL)                 # of a row and a column part
    lane = 16 * tl.arange(0, L)[None, :]                                          # (1, L): a lane's first byte
    kb_start = pid_k * SPLIT2
    kb_end = min(K2, kb_start + SPLIT2)                  # SPLIT2 is a multiple of BKB

    # ---- main loop over the bytes of the rows, BKB at a time. The first step's weights and scales
    # are loaded before the wait on the kernel before (they are not its output), so their latency
    # passes under that kernel's tail; x only after it.
    col = kb_start + lane
    live = col < kb_end
    w = _gemv_w(w_rows + _tiled_offsets(0, col, stride_pn, 64, IL), live, INTERPRET)
    sc = _gemv_s(s_rows + _tiled_offsets(0, col // 8, stride_sn, 8, IL), live, INTERPRET)
    if LORA:
        if pid_k == 0:
            _prefetch_lora_b(lb_ptr, offs_n, N, lora_rb, PREFETCH_B, INTERPRET)
    if not LATE_WAIT:
        pdl_start(USE_PDL, SILU)
    x = _gemv_x(x2_ptr + col, live, INTERPRET)
    acc = tl.zeros((BN, L), dtype=tl.float32)
    for kb0 in range(kb_start, kb_end, BKB):
        nxt = tl.multiple_of(kb0, BKB) + BKB + lane      # the next step's loads go out before this one's sums
        w_next = _gemv_w(w_rows + _tiled_offsets(0, nxt, stride_pn, 64, IL), nxt < kb_end, INTERPRET)
        sc_next = _gemv_s(s_rows + _tiled_offsets(0, nxt // 8, stride_sn, 8, IL), nxt < kb_end, INTERPRET)
        x_next = _gemv_x(x2_ptr + nxt, nxt < kb_end, INTERPRET)
        acc = _gemv_row(acc, w, sc, x, INTERPRET)
        w = w_next
        sc = sc_next
        x = x_next

    # ---- epilogue: the row of y (or fp32 partial sums for the split-K reduce)
    if LATE_WAIT:
        pdl_start(USE_PDL)                               # the shrink's partials are read from here on
    elif not SILU:
        pdl_release(USE_PDL)
    out_ptr += pid_k * stride_os
    update = None                                        # the LoRA update of a row finished here
    if LORA:
        if not PARTIAL:
            update = _gemv_update(hp_ptr, lb_ptr, lora_scale, lora_rb, lora_n1, lora_n2, 0, offs_n, M, N, R_LORA,
                                  LSPLIT, LR, INTERPRET)
    _gemv_store(acc, 0, offs_n, out_ptr, gs_ptr, bias_ptr, M, N, stride_om, update, HAS_BIAS, PARTIAL, SILU,
                INTERPRET)
    if REDUCE:
        if _last_split(count_ptr, pid_n, NSPLIT):
            m = tl.arange(0, 1)[:, None]                                          # (1, 1)
            upd_all = None
            if LORA:
                upd_all = _lora_update(hp_ptr, lb_ptr, lora_scale, lora_rb, lora_n1, lora_n2, m, offs_n[None], M, N,
                                       R_LORA, LSPLIT, LR, INTERPRET)
            _sum_splits(out_ptr - pid_k * stride_os, y_ptr, m * stride_om + offs_n[None], (m < M) & (offs_n < N)[None],
                        offs_n[None], N, stride_os, gs_ptr, bias_ptr, upd_all, NSPLIT, HAS_BIAS, INTERPRET)
