"""The teaching kernel: y = x·Wᵀ with W in NVFP4, one Triton GEMM written to be read.

Hopper (H100) has tensor cores for bf16 and fp8 but none for FP4, so a W4A16 matmul cannot hand
the 4-bit codes to the MMA unit. It loads the 4.5-bit weights from memory, decodes them to bf16 in
registers and issues ordinary bf16 MMA with fp32 accumulation: a "mixed-input" GEMM, the scheme of
the Marlin kernels. Memory traffic is that of the 4-bit weight (what a generation step, reading
the whole weight for a few tokens, is bound by); the arithmetic is a bf16 GEMM's plus a few
integer operations per weight for the decode.

The weight is the compressed-tensors NVFP4 layout that nvfp4.py writes (one linear of out_features
N and in_features K, both multiples of 16):

    packed        uint8          (N, K/2)   two E2M1 codes per byte, even k in the LOW nibble
    scale         float8_e4m3fn  (N, K/16)  one scale per 16 consecutive k of a row
    global_scale  float32        (1,)
    W[n, k] = e2m1(code[n, k]) * scale[n, k // 16] / global_scale

Both codes are small floats of one kind, sign | exponent e | mantissa m of `mb` bits, and one
function decodes both with integer arithmetic (_minifloat_to_f32):

    value = ±(1 + m / 2^mb) · 2^(e - bias)      e > 0 (normal)
    value = ±(m / 2^mb) · 2^(1 - bias)          e = 0 (subnormal)
    E2M1  s|ee|m      bias 1   magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
    E4M3  s|eeee|mmm  bias 7   magnitudes 2^-9 (the smallest subnormal) ... 448

A product e2m1 · scale has at most 2 + 4 significant bits and lies in 2^-10 .. 2688, so it is
exact in bf16 (8 significant bits): the MMA sees the weight without rounding, and the global
scale, one fp32 number, divides the fp32 sums once at the end.

The blocked algorithm is the one of Triton's matmul tutorial with a decode in the middle:

    # in parallel: one program per output tile
    for m in range(0, M, BLOCK_M):
      for n in range(0, N, BLOCK_N):
        acc = zeros((BLOCK_M, BLOCK_N), float32)
        for k in range(0, K, BLOCK_K):
          a = x[m : m+BLOCK_M, k : k+BLOCK_K]                             # bf16
          p = packed[n : n+BLOCK_N, k/2 : (k+BLOCK_K)/2]                   # 2 codes a byte
          s = scale[n : n+BLOCK_N, k/16 : (k+BLOCK_K)/16]                  # E4M3 bits
          w = e2m1(nibbles of p) * e4m3(s), each scale on its 16 k        # (BLOCK_N, BLOCK_K) bf16
          acc += dot(a, wᵀ)
        y[m : m+BLOCK_M, n : n+BLOCK_N] = acc / global_scale (+ bias[n : n+BLOCK_N])

Programs are numbered so that GROUP_M row tiles of y sweep the column tiles together: the group
reads the same weight rows while they are still in L2 (the tutorial's "L2 cache optimizations").
Loads past an edge are masked to zero (zero codes and zero scales decode to 0), so any M works,
including M = 1 (a decode step) and M = 0.

Under TRITON_INTERPRET=1 (the CPU tests) the interpreter's tl.dot on bf16 operands returns wrong
numbers and its fp32 -> bf16 cast truncates. There the wrapper passes FP32_DOT (both dot operands
in fp32, the same values exactly) and has the kernel write fp32, which torch rounds to bf16.

Where the speed is: the `kernels/` package. This kernel is correct for every M and simple, not
fast; the trunk's NVFP4 matmul (ops.nvfp4_linear) runs the fast kernels, and which one runs at
which M is kernels/README.md's business. Their tests take this file's float64 reference and this
kernel as the oracle. To run this kernel in a real training run instead (to see an edit of it at
work), set QERL_MATMUL=teaching (ops.py). The file imports nothing of the project: a leaf.

What it leaves out: activation quantization (W4A16 only); a dx kernel (dx = dy·W falls back to
dequantize + matmul; the fast path has its own); the interleaved layout of nvfp4.interleave (under
QERL_MATMUL=teaching the loaders keep the plain one); split-K for the few programs of a small M; autotuning;
epilogue fusions (LoRA, SiLU·mul); NaN scales (compressed-tensors never writes them).

Test: pytest tests/test_marlin_kernel.py (against float64 on random codes and scales at many
shapes, the exact decode of every byte and scale, the input checks; on a GPU the fast path against
this kernel on Qwen2.5 shapes); tests/test_ops.py runs it through QERL_MATMUL=teaching. Demo: python marlin_kernel.py (no GPU: prefix
TRITON_INTERPRET=1).
"""
import os

import torch
import triton
import triton.language as tl

# ----------------------------------------------------------------------------------------------
# constants

BLOCK = 16                 # weights per E4M3 scale, along K
# code -> value; codes 8..15 are the negatives of 0..7 (code 8 is -0.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

BLOCK_M = 64               # output tile rows (fewer for a small M: the wrapper) ...
BLOCK_N = 64               # ... and columns
BLOCK_K = 64               # k per loop step: 32 packed bytes and 4 scales a weight row
GROUP_M = 8                # row tiles that sweep the column tiles together (L2 reuse)


# ----------------------------------------------------------------------------------------------
# float64 reference (plain torch, independent of nvfp4.py: the oracle of every kernel test)

def reference_dequantize(packed, scale, global_scale, dtype=torch.float64):
    """(N, K/2) u8, (N, K/16) e4m3, (1,) f32 -> W (N, K) in dtype (independent of nvfp4.py)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=packed.device)
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long()   # (N, K)
    s = scale.to(torch.float64).repeat_interleave(BLOCK, dim=-1)                  # (N, K)
    return (lut[codes] * s / global_scale.to(torch.float64)).to(dtype)


def reference_matmul(x, packed, scale, global_scale, bias=None):
    """float64 y = x·Wᵀ (+bias)."""
    y = x.double() @ reference_dequantize(packed, scale, global_scale).t()
    return y if bias is None else y + bias.double()


# ----------------------------------------------------------------------------------------------
# the kernel

@triton.jit
def _minifloat_to_f32(bits, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, BIAS: tl.constexpr):
    """sign | exponent | mantissa bits (int32) -> fp32 values, exact. E2M1 is (2, 1, 1), E4M3 (4, 3, 7)
    (E4M3's NaN pattern reads as 480 here: no scale is NaN)."""
    exp = (bits >> MAN_BITS) & ((1 << EXP_BITS) - 1)
    man = bits & ((1 << MAN_BITS) - 1)
    # the mantissa as an integer: |value| = (implicit + man) · 2^(max(exp, 1) - BIAS - MAN_BITS), with
    # implicit = 2^MAN_BITS for a normal number and 0 for a subnormal (exp == 0)
    implicit = tl.where(exp > 0, 1 << MAN_BITS, 0)
    # the power of two written straight into fp32's exponent field (bias 127): exact, no exp2
    pow2 = ((tl.maximum(exp, 1) - BIAS - MAN_BITS + 127) << 23).to(tl.float32, bitcast=True)
    mag = (implicit + man).to(tl.float32) * pow2
    return tl.where(((bits >> (EXP_BITS + MAN_BITS)) & 1) != 0, -mag, mag)        # the top bit: sign


@triton.jit
def _nvfp4_matmul_kernel(
        # pointers
        x_ptr, packed_ptr, scale_ptr, global_scale_ptr, bias_ptr, y_ptr,
        # sizes: y (M, N) = x (M, K) · W (N, K)ᵀ
        M, N, K,
        # row strides (within a row, elements are contiguous)
        stride_xm, stride_pn, stride_sn, stride_ym,
        # meta-parameters
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of y; the algorithm is in the module docstring."""
    # ------------------------------------------------------------------------------------------
    # which tile: grouped ordering, GROUP_M row tiles take the column tiles together
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)         # the last group may be short
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)             # (BLOCK_M,) rows of x and y
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)             # (BLOCK_N,) rows of W, columns of y
    mask_m, mask_n = offs_m < M, offs_n < N

    # ------------------------------------------------------------------------------------------
    # the K loop: load a step of x and of the 4-bit weight, decode the weight, multiply
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)                       # (BLOCK_K,) columns of x
        offs_b = k // 2 + tl.arange(0, BLOCK_K // 2)             # (BLOCK_K/2,) bytes of a packed row
        offs_s = k // 16 + tl.arange(0, BLOCK_K // 16)           # (BLOCK_K/16,) scales of a row
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & (offs_k[None, :] < K), other=0.0)       # (BM, BK) bf16
        p = tl.load(packed_ptr + offs_n[:, None] * stride_pn + offs_b[None, :],
                    mask=mask_n[:, None] & (offs_b[None, :] < K // 2), other=0)   # (BN, BK/2) u8
        s = tl.load(scale_ptr + offs_n[:, None] * stride_sn + offs_s[None, :],
                    mask=mask_n[:, None] & (offs_s[None, :] < K // 16), other=0)     # (BN, BK/16) u8

        # byte j of a row holds k = 2j in its low nibble and k = 2j + 1 in its high one: join
        # puts each pair side by side, (BN, BK/2, 2), and reshape reads them in k order
        codes = tl.join(p & 0xF, p >> 4).reshape(BLOCK_N, BLOCK_K)                  # (BN, BK)
        w = _minifloat_to_f32(codes.to(tl.int32), 2, 1, 1)                          # (BN, BK) E2M1
        scales = _minifloat_to_f32(s.to(tl.int32), 4, 3, 7)                          # (BN, BK/16) E4M3
        # each scale multiplies its 16 k: (BN, BK/16, 16) · (BN, BK/16, 1); the products are exact
        w = (w.reshape(BLOCK_N, BLOCK_K // 16, 16) * scales[:, :, None]).reshape(BLOCK_N, BLOCK_K)

        if FP32_DOT:      # the interpreter: fp32 operands (exact copies), its bf16 dot is wrong
            acc = tl.dot(a.to(tl.float32), tl.trans(w), acc)
        else:             # the GPU: w is exact in bf16, so the MMA is a plain bf16 one
            acc = tl.dot(a, tl.trans(w.to(tl.bfloat16)), acc)                     # (BM, BN) fp32

    # ------------------------------------------------------------------------------------------
    # epilogue: the global scale and the bias, in fp32; one rounding to y's dtype
    y = acc / tl.load(global_scale_ptr)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


# ----------------------------------------------------------------------------------------------
# the wrapper: check, allocate, launch

def _check(x, packed, scale, global_scale, bias):
    """-> (N, K), or an error that names the problem."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be bfloat16, got {x.dtype}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8 (two E2M1 codes per byte), got {packed.dtype}")
    if scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"scale must be float8_e4m3fn, got {scale.dtype}")
    if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
        raise TypeError(f"global_scale must be a float32 tensor of one element, got "
                        f"{global_scale.dtype} {tuple(global_scale.shape)}")
    if x.dim() != 2 or packed.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"x, packed and scale must be 2-D, got {tuple(x.shape)}, {tuple(packed.shape)}, "
                         f"{tuple(scale.shape)}")
    N, K = packed.shape[0], packed.shape[1] * 2
    if N % 16 or K % 16:
        raise ValueError(f"N and K must be multiples of 16, got N={N}, K={K}")
    if tuple(scale.shape) != (N, K // BLOCK):
        raise ValueError(f"scale must have shape (N, K/16) = {(N, K // BLOCK)}, got {tuple(scale.shape)}")
    if x.shape[1] != K:
        raise ValueError(f"x has {x.shape[1]} columns, the weight needs K = {K}")
    if bias is not None and (bias.dtype != torch.bfloat16 or tuple(bias.shape) != (N,)):
        raise ValueError(f"bias must be a bf16 tensor of shape ({N},), got {bias.dtype} {tuple(bias.shape)}")
    named = {"x": x, "packed": packed, "scale": scale, "global_scale": global_scale, "bias": bias}
    for name, t in named.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    return N, K


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def matmul(x, packed, scale, global_scale, bias=None):
    """y (M, N) bf16 = x (M, K) bf16 · W (N, K)ᵀ (+ bias (N,) bf16), fp32 accumulation, for any M.
    W in the plain compressed-tensors layout (module docstring)."""
    N, K = _check(x, packed, scale, global_scale, bias)
    M = x.shape[0]
    interpreting = _interpreting()
    # the interpreter's fp32 -> bf16 cast truncates: there the kernel writes fp32 and torch rounds
    y = torch.empty((M, N), device=x.device, dtype=torch.float32 if interpreting else torch.bfloat16)
    if M == 0:
        return y.to(torch.bfloat16)
    block_m = min(BLOCK_M, max(16, triton.next_power_of_2(M)))     # tl.dot takes >= 16 rows
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, BLOCK_N),)      # 1-D: the kernel groups the tiles
    scale_bits = scale.view(torch.uint8)                             # (N, K/16): the kernel decodes E4M3
    _nvfp4_matmul_kernel[grid](
        x, packed, scale_bits, global_scale, bias, y,
        M, N, K,
        x.stride(0), packed.stride(0), scale_bits.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
        HAS_BIAS=bias is not None, FP32_DOT=interpreting)
    return y.to(torch.bfloat16)                                      # no copy when y is bf16


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not _interpreting():
        raise SystemExit("no GPU: run it in Triton's interpreter, TRITON_INTERPRET=1 python marlin_kernel.py")
    torch.manual_seed(0)
    M, N, K = 5, 192, 320
    # random codes and E4M3 scales between 2^-3 and 2^4: any bytes are a valid weight
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=device)
    scale = torch.exp2(torch.randint(-3, 5, (N, K // BLOCK), device=device).float()).to(torch.float8_e4m3fn)
    gs = torch.tensor([448 * 6 / 0.05], device=device)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    y, ref = matmul(x, packed, scale, gs), reference_matmul(x, packed, scale, gs)
    err = (y.double() - ref).abs()
    print(f"y = x·Wᵀ on {device}: x ({M}, {K}) bf16, W ({N}, {K}) NVFP4 ({packed.numel() + scale.numel()} "
          f"bytes); against float64 max |err| {err.max():.2e}, mean {err.mean():.2e}, "
          f"relative {(err.norm() / ref.norm()).item():.2e}")
