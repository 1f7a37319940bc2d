"""Fused inference kernels for the decoder's small ops: add + RMSNorm, RoPE on q and k, SiLU·mul,
the embedding gather with the RoPE angles; and the lm_head's GEMV at decode (1-2 rows).

Why. A decode step runs every layer on one token per sequence, so the torch ops of model.py (about 7
small kernels per norm, 8 per RoPE call) cost more GPU time than the 4-bit matmuls at batch 1. On
the rollout path (kernels.runs(x): CUDA, no autograd, tuning's fused) one Triton kernel does each;
the math is the same fp32 math (only the order of the norm's sum differs). Training keeps torch ops,
so autograd never sees these kernels. On Hopper each is launched with programmatic dependent launch
(launch.py).

The ops, with the torch reference each one matches (model.py):

    rms_norm(x, w, eps)          y = x / sqrt(mean_c(x²) + ε) ⊙ w          RMSNorm.forward
    rms_norm(x, w, eps, r)       s = x + r (rounded to x.dtype); (norm(s), s)
    rope(q, k, cos, sin)         (x1, x2) -> (x1·cos - x2·sin, x2·cos + x1·sin)   apply_rope, in place
    silu_mul(g, u)               silu(g)·u, silu rounded to the dtype first       F.silu(g) * u
    embed_rope(ids, p, E, θ)     E[ids]; cos, sin of p·θ (fp32, libdevice = CUDA's cosf): the first
                                 lines of the model's forward (5 kernels: gather, cast, mul, cos, sin)
    gemv(x, w)                   x·Wᵀ for 1-2 rows of x, fp32 sums and output (the sampler's lm_head) F.linear(x, w)

Residual adds (vLLM's fused add + RMSNorm). A decoder layer hands the next norm the pair (MLP(m), h')
instead of their sum (model.py's docstring); the norm kernel adds them, writes the sum rounded to the
activation dtype exactly as torch's add rounds it, and normalizes it in fp32: one kernel instead of an
add and a norm, and the logits stay bit-identical. The kernel reads the weight and the residual
before its PDL wait: neither is the output of the kernel just before it (x may be).

Layouts. x (..., C) contiguous rows, one program per row, C padded to a power of two; w (C,) fp32
(AQN's noise lives there). q (B, T, Hq, D), k (B, T, Hkv, D) need contiguous heads and one stride
between tokens (`token_stride`): the column slices of a stacked q/k/v output have one, so RoPE
rotates them in place where the matmul left them, one program per (token, head), D a power of two
(rope_fits); cos/sin (B, T, 1, D/2) fp32. SiLU·mul reads g and u rows with their own strides (the
gate and up halves of one stacked output) and writes a fresh contiguous (..., n). The lm_head GEMV
streams a bf16 weight read once a call against 1-2 rows (lm_head_fits); at 3-4 rows the per-row
accumulators cost more than they save, and cuBLAS takes over.

`norm_inputs` and `norm_row` are the norm's device functions, shared with lora.py's norm + shrink
launch. `rotate_halves` is a device function shared with the paged decode kernel (paged_decode.py), which
rotates q and the new k itself at decode: its rotation gives the very bits of rope.

Tests: tests/test_kernels_fused_ops.py against the torch ops (CPU: Triton interpreter; GPU: CUDA).
"""
import torch
import torch.nn as nn
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import launch, tuning
from .fp4_decode import pdl_start
from .fp4_decode import silu_mul as silu_mul_math

# ----------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, C, eps, HAS_RES: tl.constexpr,
                     BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
    """Row `row`: (x + residual rounded, and) its norm in fp32 times w. The weight and the residual
    stream are loaded before the PDL wait (see rms_norm), x after it."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < C
    w, r = norm_inputs(w_ptr, res_ptr + row * C, offs, mask, HAS_RES)
    pdl_start(USE_PDL)
    y, s = norm_row(x_ptr + row * C, r, w, offs, mask, C, eps, HAS_RES)
    if HAS_RES:
        tl.store(sum_ptr + row * C + offs, s, mask=mask)
    tl.store(out_ptr + row * C + offs, y, mask=mask)


@triton.jit
def norm_inputs(w_ptr, res_row, offs, mask, HAS_RES: tl.constexpr):
    """-> the norm's weight and its row of the residual (the weight again without one)."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    r = tl.load(res_row + offs, mask=mask, other=0.0) if HAS_RES else w
    return w, r


@triton.jit
def norm_row(x_row, r, w, offs, mask, C, eps, HAS_RES: tl.constexpr):
    """One row's norm from norm_inputs' w and r: -> (y, s) in x's dtype, s = x + r rounded as
    torch's add rounds it (x itself without a residual) and y = s / sqrt(mean(s²) + ε) ⊙ w in fp32.
    Shared with lora.py's norm + shrink launch, whose y must be this kernel's bits."""
    x = tl.load(x_row + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / C + eps)
    return (h * w).to(x.dtype), x


@triton.jit
def rotate_halves(x1, x2, cos, sin):
    """apply_rope's rotation of the two halves of a head (any shape that cos/sin broadcast to):
    (x1, x2) -> (x1·cos - x2·sin, x2·cos + x1·sin) in fp32, rounded back to x's dtype, each
    as one explicit fma (so no compiler's contraction choice can differ between kernels). Shared
    with the paged decode kernel (paged_decode.py), so decode's rotation gives these bits."""
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    return tl.fma(a, cos, -(b * sin)).to(x1.dtype), tl.fma(b, cos, a * sin).to(x1.dtype)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, stride_q, stride_k, HQ,
                 HALF: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (t, h) rotates head h of token t in place: a q head if h < HQ, else k head h - HQ."""
    pdl_start(USE_PDL)
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if h < HQ:
        src = q_ptr + t * stride_q + h * 2 * HALF
    else:
        src = k_ptr + t * stride_k + (h - HQ) * 2 * HALF
    offs = tl.arange(0, HALF)
    cos, sin = tl.load(cos_ptr + t * HALF + offs), tl.load(sin_ptr + t * HALF + offs)
    y1, y2 = rotate_halves(tl.load(src + offs), tl.load(src + HALF + offs), cos, sin)
    tl.store(src + offs, y1)
    tl.store(src + HALF + offs, y2)


@triton.jit
def _embed_rope_kernel(ids_ptr, pos_ptr, emb_ptr, inv_freq_ptr, x_ptr, cos_ptr, sin_ptr, V, H, stride_e,
                       HALF, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """Program t: x[t] = E[ids[t]] (zeros for an id outside [0, V): no read out of bounds),
    cos[t], sin[t] = cos, sin(float(pos[t]) · inv_freq), the fp32 math of torch's ops."""
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    tok = tl.load(ids_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    tok_b = offs * 0 + tok                  # the id broadcast to the block (the interpreter takes
    inside = (offs < H) & (tok_b >= 0) & (tok_b < V)    # no scalar in a mask): (BLOCK_H,)
    row = tl.load(emb_ptr + tok * stride_e + offs, mask=inside, other=0.0)
    tl.store(x_ptr + t * H + offs, row, mask=offs < H)
    j = tl.arange(0, BLOCK_D)
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + j, mask=j < HALF, other=0.0)
    if INTERPRET:   # numpy's cos / sin (the interpreter has no libdevice)
        cos, sin = tl.cos(angle), tl.sin(angle)
    else:
        cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    tl.store(cos_ptr + t * HALF + j, cos, mask=j < HALF)
    tl.store(sin_ptr + t * HALF + j, sin, mask=j < HALF)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, stride_g, stride_u,
                     BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < n
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * n + offs, silu_mul_math(g, u), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_PDL: tl.constexpr):
    """y[m, rows] = x[m] · W[rows]ᵀ for M <= BM <= 2 rows of x: BN rows of W a program, BK of
    k a step; fp32 products summed per (row, k lane), then across the lanes at the end. A
    second row of x past M is wrapped, computed and never stored."""
    pdl_start(USE_PDL)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    w_rows = w_ptr + (rows % N).to(tl.int64)[:, None] * stride_wn              # (BN, 1)
    acc0 = tl.zeros((BN, BK), dtype=tl.float32)
    acc1 = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        kmask = cols < K
        # W is read once a call: let it leave L2 first
        w = tl.load(w_rows + cols[None, :], mask=kmask[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)                 # (BN, BK)
        acc0 += w * tl.load(x_ptr + cols, mask=kmask, other=0.0).to(tl.float32)[None, :]
        if BM > 1:
            acc1 += w * tl.load(x_ptr + (1 % M) * stride_xm + cols, mask=kmask, other=0.0).to(tl.float32)[None, :]
    mask = rows < N
    tl.store(y_ptr + rows, tl.sum(acc0, 1).to(y_ptr.dtype.element_ty), mask=mask)
    if BM > 1 and 1 < M:
        tl.store(y_ptr + stride_ym + rows, tl.sum(acc1, 1).to(y_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# wrappers: check the layout, allocate, launch


def rms_norm(x, weight, eps, residual=None):
    """RMSNorm.forward in one kernel per row: x (..., C) contiguous, weight (C,) fp32; -> y, or with
    residual (y, x + residual). Under PDL the kernel reads weight and residual before waiting on the
    kernel launched before it, so neither may be that kernel's output: x may (in a decoder layer x
    is the block's output and residual the stream, written two or more launches back)."""
    C = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else out
    block = triton.next_power_of_2(C)
    _rms_norm_kernel[(x.numel() // C,)](x, residual.contiguous() if residual is not None else x, weight,
                                        out, total, C, eps, HAS_RES=residual is not None, BLOCK_C=block,
                                        **launch.pdl_launch(x.device), num_warps=min(16, max(1, block // 256)))
    return out if residual is None else (out, total)


def token_stride(t: torch.Tensor) -> int | None:
    """The one stride between consecutive tokens of t (B, T, H, D) with contiguous heads (a column
    slice of a stacked q/k/v output has one), or None. A size-1 dim's stride is arbitrary (view
    may set it to anything), so decode (T = 1) steps by the batch stride."""
    B, T, H, D = t.shape
    if t.stride(3) != 1 or (H > 1 and t.stride(2) != D):
        return None
    if T == 1:
        return t.stride(0)
    return t.stride(1) if B == 1 or t.stride(0) == T * t.stride(1) else None


def rope_fits(q, k) -> bool:
    """Can rope rotate q (B, T, Hq, D) and k (B, T, Hkv, D) in place: one token stride each, D a
    power of two?"""
    D = q.shape[-1]
    return bool(token_stride(q)) and bool(token_stride(k)) and D & (D - 1) == 0


def rope(q, k, cos, sin):
    """apply_rope on q (B,T,Hq,D) and k (B,T,Hkv,D) in place, one launch; cos/sin (B,T,1,D/2).
    q and k must have a token_stride (rope_fits)."""
    B, T, HQ, D = q.shape
    _rope_kernel[(B * T, HQ + k.shape[2])](q, k, cos.contiguous(), sin.contiguous(), token_stride(q),
                                           token_stride(k), HQ, D // 2, **launch.pdl_launch(q.device))
    return q, k


def silu_mul(g, u):
    """silu(g)·u for g, u (..., n) whose rows may be strided (gate and up slices of one output)."""
    n = g.shape[-1]
    g2, u2 = g.reshape(-1, n), u.reshape(-1, n)                        # views: rows keep their stride
    out = torch.empty(g.shape, device=g.device, dtype=g.dtype)
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, 1024))](g2, u2, out, n, g2.stride(0), u2.stride(0), BLOCK_N=1024,
                                                          **launch.pdl_launch(g.device))
    return out


def embed_rope(ids, positions, weight, inv_freq):
    """ids, positions (B, T) integer, weight (V, H), inv_freq (D/2,) fp32 -> x = weight[ids] (B, T, H)
    and cos, sin (B, T, 1, D/2) fp32 of the angles positions·inv_freq."""
    B, T = ids.shape
    V, H = weight.shape
    half = inv_freq.numel()
    if positions.shape != ids.shape or weight.stride(1) != 1 or inv_freq.dtype != torch.float32:
        raise ValueError(f"embed_rope: ids, positions of one (B, T) shape, weight rows contiguous, "
                         f"inv_freq fp32; got {tuple(ids.shape)}, {tuple(positions.shape)}, {inv_freq.dtype}")
    x = torch.empty(B, T, H, device=ids.device, dtype=weight.dtype)
    cos, sin = (torch.empty(B, T, 1, half, device=ids.device, dtype=torch.float32) for _ in range(2))
    if B * T:
        _embed_rope_kernel[(B * T,)](ids.reshape(-1), positions.reshape(-1), weight, inv_freq.contiguous(), x,
                                     cos, sin, V, H, weight.stride(0), half, BLOCK_H=triton.next_power_of_2(H),
                                     BLOCK_D=triton.next_power_of_2(half), INTERPRET=launch.interpreting(),
                                     **launch.pdl_launch(ids.device), num_warps=4)
    return x, cos, sin


def gemv(x, w):
    """F.linear(x, w) for a few rows: x (M, K) with M <= tuning's lm_head_max_rows, w (N, K), both bf16
    (or both fp32), fp32 sums; y (M, N) fp32 (logits are not rounded to bf16: ops.head_matmul). The
    sampler's lm_head at batch 1-2 is such a product: a 152k x 3.5k bf16 weight read once against one
    or two rows, which this streams faster than cuBLAS."""
    t = tuning.current()
    M, K = x.shape
    if M > t.lm_head_max_rows or w.shape[1] != K or w.dtype != x.dtype or w.stride(1) != 1:
        raise ValueError(f"gemv: x (M <= {t.lm_head_max_rows}, K) and w (N, K) of one dtype, w's rows "
                         f"contiguous; got x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}")
    x = x.contiguous()
    N = w.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=torch.float32)
    if M == 0:
        return y
    bn, bk = t.lm_head_tiles[M - 1]
    _gemv_kernel[(triton.cdiv(N, bn),)](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                        BM=M, BN=bn, BK=bk, **launch.pdl_launch(x.device), num_warps=4)
    return y


def lm_head_fits(hidden, head) -> bool:
    """Can lm_head compute head(hidden): a plain bias-free nn.Linear, at most lm_head_max_rows rows?"""
    return (type(head) is nn.Linear and head.bias is None
            and hidden.shape[0] <= tuning.current().lm_head_max_rows)


def lm_head(hidden, head):
    """head(hidden) by the GEMV (lm_head_fits), as fp32 logits."""
    return gemv(hidden, head.weight)
