"""The LoRA update of a decode step in two Triton kernels: shrink, then expand in place.

Why. A GRPO rollout samples with the adapters live (rollout.py runs the training model itself), so
every projection of every decode step adds s · (x Aᵀ) Bᵀ to its base output. In torch that is a
GEMM and an addmm per adapter group (lora.LoRALinear.add_delta / add_group_delta): 8 cuBLAS
launches per layer, none of which takes part in programmatic dependent launch, and at batch 1 they
cost more than their few megabytes of A and B: on the H100, rank 32 on all seven projections took
7B NVFP4 batch-1 decode from 365 to 234 tok/s (bench/NOTES.md v9). For M <= 16 rows these two
kernels replace them, launched with PDL like the rest of the decode step:

    shrink, program (r-tile i, k-split j):   hp[j, :, i] = x[:, K_j] · A[i, K_j]ᵀ          fp32
    expand, program (n-tile):                h = bf16(Σ_j hp[j])        (M, R)
                                             y[:, n] = y[:, n] + s · h · B[n, :]ᵀ       in place

h is rounded to the activation dtype before the expand, as F.linear's output is on the torch path
(training computes the same update that way), so the two paths differ only in summation order.
The K-split (at most 8 chunks of >= 1024) gives the shrink enough programs to stream A at batch 1
without atomics: the expand sums the partials (deterministic). Ranks and output widths of a
stacked group (q/k/v, gate/up) arrive as one A (Σr, K) and one block-diagonal B (Σ out, Σr).

Shapes: x (M, K) rows with a stride, A (R, K) and B (N, R) contiguous, y (M, N) contiguous rows,
all in one dtype; M <= 16 (one MMA tile of rows). Launched with programmatic dependent launch except
beside the small-M NVFP4 kernels, where it measured slower (pdl_for), unless the shrink runs before
the base matmul (early_shrink: the GEMV and tile rows of an NVFP4 base, both kernels with PDL).
Where the NVFP4 GEMV (1 row) or the swapped tiles (up to 16 rows where K is not a multiple of 128,
else the fragment kernel runs) compute y, they also do the expand's work as they store y, from the
shrink's partials (fold_expand; fp4_decode._lora_update): H100, 7B rank 32, against the expand
kernel: batch 1 +10.5-11.6%, batch 2 +9.4%, batch 16 +3.0% (bench/NOTES.md v13, when the GEMV took
2 rows and the tiles 9-16).
Under TRITON_INTERPRET=1 the dots run in fp32 (the interpreter's bf16 tl.dot is wrong), as in the
other kernels.
Tests: tests/test_lora_kernels.py (interpreter: against float64 with odd sizes, K-splits and
row-strided x and y, bf16 rounding of h, bad input; GPU: one adapter and a q/k/v group's
block-diagonal B against lora.py's torch path, folded into the NVFP4 GEMV or not); the folded update
itself: tests/test_small_m_kernels.py; the graphed decode with adapters: tests/test_rollout.py.
"""

import torch

try:
    import triton
    import triton.language as tl
    from marlin_kernel import folds_lora, fragment_rows, interpreting, pdl_launch, pdl_start, reduce_folds_lora
except ImportError:  # lora.py's torch path needs no triton
    triton = None

MAX_M = 16          # rows of x the kernels take (one MMA tile); more rows: lora.py's torch path
BR, BK, BN = 16, 128, 64
PDL_BESIDE_NVFP4 = False  # see pdl_for (bench/ab.py's lora_pdl_nvfp4 switch turns it on)
EARLY_SHRINK = True       # see early_shrink (bench/ab.py's lora_early switch turns it off)
FOLD_EXPAND = True        # see fold_expand (bench/ab.py's lora_fold switch turns it off)


def pdl_for(base) -> bool:
    """Launch the two kernels with programmatic dependent launch? Yes on a bf16 base (H100, 7B
    decode with rank-32 adapters: +7-8% with PDL against +3-5% without). Not on an NVFP4 base (it
    has weight_packed): at the <= MAX_M rows the kernels take, the matmul before them sums its own
    split-K partials (the GEMV, the fragment kernel at M <= 4, the swapped tiles), and there PDL
    made batch 1 9% slower than cuBLAS, and batch 16 8% slower than the same kernels without PDL
    (bench/NOTES.md v9, v10). The pattern: a PDL launch right after a kernel whose last programs sum
    its partials costs; after the separate reduce kernel it paid (+8.8% at 16 rows). v21 found a
    likely mechanism (a kernel scheduled early waits on the SMs through the whole kernel before it;
    marlin_kernel's PDL comment), not yet re-tried here."""
    return PDL_BESIDE_NVFP4 or not hasattr(base, "weight_packed")


def early_shrink(base, rows: int) -> bool:
    """Run the shrink before the base matmul (it reads x only) and both kernels with PDL? On an NVFP4
    base where the GEMV or the swapped tiles compute it (not the fragment kernel: marlin_kernel.
    fragment_rows): H100, 7B with rank-32 adapters, same run, against shrink and expand after the
    base without PDL: batch 1 260.0/258.4 vs 252.6/253.9 tok/s, batch 16 2966/2956 vs 2858/2877.
    Beside the fragment kernel (batch 4) it lost 16% (758 vs 897); that and bf16 bases keep
    pdl_for's order (bench/NOTES.md v12)."""
    return EARLY_SHRINK and hasattr(base, "weight_packed") and not fragment_rows(rows, base.in_features)


def fold_expand(base, x2) -> bool:
    """After an early shrink, let the base matmul add the update instead of the expand kernel? Where
    the NVFP4 kernel finishes the rows of y itself (marlin_kernel.folds_lora: the GEMV, and the
    swapped tiles where the fragment kernel does not run) and the activations are bf16: whoever
    stores a tile of y adds s·h·Bᵀ first (fp4_decode._lora_update), one launch per adapter group fewer."""
    return (FOLD_EXPAND and hasattr(base, "weight_packed") and x2.dtype == torch.bfloat16
            and folds_lora(*x2.shape))


def fold_in_reduce(base, h, B) -> bool:
    """Let the base matmul's split-K reduce add s·h·Bᵀ (h = x Aᵀ bf16 from F.linear, B (N, r))
    instead of lora.py's in-place addmm after it? Beyond MAX_M rows (lora.py's torch path), without
    autograd, on an NVFP4 base whose register-A launch splits K (marlin_kernel.reduce_folds_lora:
    the GRPO batch's qkv, o and down; gate/up does not split)."""
    rows = h.numel() // h.shape[-1]
    return (triton is not None and hasattr(base, "weight_packed") and h.is_cuda and h.dtype == torch.bfloat16
            and not torch.is_grad_enabled() and rows > MAX_M
            and reduce_folds_lora(rows, B.shape[0], base.in_features, h.device, base.interleaved))


if triton is not None:
    @triton.jit
    def _lora_shrink_kernel(x_ptr, a_ptr, hp_ptr, M, R, K, KC, stride_xm,
                            BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                            FP32_DOT: tl.constexpr, USE_PDL: tl.constexpr):
        """hp[j, m, r] = sum over k in chunk j (KC wide) of x[m, k] · A[r, k], for BR rows r."""
        pdl_start(USE_PDL)
        i, j = tl.program_id(0), tl.program_id(1)
        offs_m = tl.arange(0, BM)
        offs_r = i * BR + tl.arange(0, BR)
        offs_k = tl.arange(0, BK)
        acc = tl.zeros((BM, BR), tl.float32)
        for k0 in range(j * KC, tl.minimum(j * KC + KC, K), BK):
            k = k0 + offs_k
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                        mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)      # (BM, BK)
            a = tl.load(a_ptr + offs_r[:, None] * K + k[None, :],
                        mask=(offs_r[:, None] < R) & (k[None, :] < K), other=0.0)      # (BR, BK)
            if FP32_DOT:
                acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(a))
        tl.store(hp_ptr + (j * M + offs_m[:, None]) * R + offs_r[None, :], acc,
                 mask=(offs_m[:, None] < M) & (offs_r[None, :] < R))

    @triton.jit
    def _lora_expand_kernel(hp_ptr, b_ptr, y_ptr, M, N, R, stride_ym, scale,
                            SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, R_PAD: tl.constexpr,
                            FP32_DOT: tl.constexpr, USE_PDL: tl.constexpr):
        """y[m, n] += scale · bf16(Σ_j hp[j, m, :]) · B[n, :] for BN columns n, in place."""
        pdl_start(USE_PDL)
        offs_m = tl.arange(0, BM)
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        offs_r = tl.arange(0, R_PAD)
        h_mask = (offs_m[:, None] < M) & (offs_r[None, :] < R)
        h = tl.zeros((BM, R_PAD), tl.float32)
        for j in tl.static_range(SPLIT):                  # unrolled: the loads go out together
            h += tl.load(hp_ptr + (j * M + offs_m[:, None]) * R + offs_r[None, :], mask=h_mask, other=0.0)
        h = h.to(y_ptr.dtype.element_ty)                  # rounded as F.linear's h is
        b = tl.load(b_ptr + offs_n[:, None] * R + offs_r[None, :],
                    mask=(offs_n[:, None] < N) & (offs_r[None, :] < R), other=0.0)    # (BN, R_PAD)
        if FP32_DOT:
            d = tl.dot(h.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            d = tl.dot(h, tl.trans(b))                                                 # (BM, BN)
        y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        ys = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        y = tl.load(ys, mask=y_mask, other=0.0).to(tl.float32)
        tl.store(ys, (y + scale * d).to(y_ptr.dtype.element_ty), mask=y_mask)


def lora_delta_(x, A, B, y, scale, pdl=True):
    """y += scale · (x Aᵀ) Bᵀ in place and return y: x (M, K), A (R, K), B (N, R), y (M, N), one
    dtype, M <= MAX_M. Two launches: shrink over min(8, K / 1024) chunks of K, then expand; with
    programmatic dependent launch where the device has it, unless pdl=False (see pdl_for)."""
    return lora_expand_(lora_shrink(x, A, B, pdl), B, y, scale, pdl)


def lora_shrink(x, A, B, pdl=True):
    """The first half of lora_delta_: -> hp (split, M, R) fp32, the K-chunk partials of x Aᵀ. It
    reads x only, so it may run before the base matmul that y comes from (lora.LoRALinear does)."""
    M, K = x.shape
    R = A.shape[0]
    if not (M <= MAX_M and A.shape[1] == K and B.shape[1] == R):
        raise ValueError(f"lora_delta_: x {tuple(x.shape)}, A {tuple(A.shape)}, B {tuple(B.shape)} do not "
                         f"fit y (M, N) += (x Aᵀ) Bᵀ with M <= {MAX_M}")
    if not x.dtype == A.dtype == B.dtype:
        raise ValueError(f"lora_delta_ needs one dtype, got x {x.dtype}, A {A.dtype}, B {B.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    A = A.contiguous()
    split = max(1, min(8, K // 1024))
    kc = triton.cdiv(triton.cdiv(K, split), BK) * BK
    split = triton.cdiv(K, kc)
    hp = torch.empty(split, M, R, device=x.device, dtype=torch.float32)
    _lora_shrink_kernel[(triton.cdiv(R, BR), split)](x, A, hp, M, R, K, kc, x.stride(0), BM=MAX_M, BR=BR, BK=BK,
                                                     FP32_DOT=interpreting() or x.dtype == torch.float32,
                                                     **_launch(x.device, pdl))
    return hp


def lora_expand_(hp, B, y, scale, pdl=True):
    """The second half: y += scale · bf16(Σ hp) Bᵀ in place, y (M, N) with contiguous rows."""
    split, M, R = hp.shape
    N = B.shape[0]
    if tuple(y.shape) != (M, N) or B.shape[1] != R:
        raise ValueError(f"lora_delta_: B {tuple(B.shape)}, y {tuple(y.shape)} do not fit y (M, N) += h Bᵀ "
                         f"with h ({M}, {R})")
    if y.dtype != B.dtype:
        raise ValueError(f"lora_delta_ needs one dtype, got B {B.dtype}, y {y.dtype}")
    if y.stride(-1) != 1:
        raise ValueError("lora_delta_ writes y in place: its rows must be contiguous")
    _lora_expand_kernel[(triton.cdiv(N, BN),)](hp, B.contiguous(), y, M, N, R, y.stride(0), scale, SPLIT=split,
                                               BM=MAX_M, BN=BN, R_PAD=max(16, triton.next_power_of_2(R)),
                                               FP32_DOT=interpreting() or y.dtype == torch.float32,
                                               **_launch(y.device, pdl))
    return y


def _launch(device, pdl):
    return pdl_launch(device) if pdl else dict(USE_PDL=False, launch_pdl=False)
