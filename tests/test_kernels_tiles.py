"""Tests for kernels/tiles.py: the tile kernels, run through gemm's wrappers, against the float64
references marlin_kernel.reference_matmul / reference_dequantize (plain torch), on buffers poisoned
with NaN (conftest's `poisoned`): the backward-input product dx (nvfp4_matmul_dx), tile shapes and
split-K with the separate reduce kernel (_matmul / _matmul_dx with a TileConfig, swapped and not),
the medium-M unswapped launch (tuning's medium tiles), the large-M path (W dequantized to bf16
within one rounding, then cuBLAS) and the reduce kernel's LoRA update (from h, or from the shrink's
partials).

On the CPU the interpreter runs tiny shapes (the dots on fp32 copies); the real projection shapes
run through nvfp4_matmul / nvfp4_matmul_dx in test_kernels_gemm.py (test_real_shapes_gpu).
"""
import dataclasses

import pytest
import torch

import kernels
from kernels import gemm, tuning
from kernels.shapes import TileConfig
from marlin_kernel import reference_dequantize, reference_matmul
from nvfp4_cases import DEV, SMALL, assert_close, check_forward, random_weight


@pytest.mark.parametrize("M,N,K", SMALL)
def test_backward_input_matches_float64(M, N, K, poisoned):
    gen = torch.Generator().manual_seed(M * 7 + N * 3 + K)
    packed, scale, gs = random_weight(N, K, gen)
    dy = torch.randn(M, N, generator=gen).bfloat16().to(DEV)
    dx = kernels.nvfp4_matmul_dx(dy, packed, scale, gs)
    assert dx.shape == (M, K) and dx.dtype == torch.bfloat16
    ref = dy.double() @ reference_dequantize(packed, scale, gs)
    e = assert_close(dx, ref, f"dx M={M} N={N} K={K}")
    assert e < 4e-3, f"typical error too large: {e:.2e}"


@pytest.mark.parametrize("cfg", [TileConfig(16, 16, 64, split=4), TileConfig(16, 32, 128, split=2),
                                 TileConfig(32, 64, 64, split=1), TileConfig(16, 16, 16, split=2),
                                 TileConfig(16, 16, 64, split=4, swap=False),
                                 TileConfig(32, 64, 64, split=1, swap=False)])
def test_split_and_tile_variants_agree(cfg, poisoned):
    """Split-K (fp32 partials + reduce kernel) and different tiles compute the same function."""
    gen = torch.Generator().manual_seed(11)
    M, N, K = 5, 144, 256
    packed, scale, gs = random_weight(N, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    dy = torch.randn(M, N, generator=gen).bfloat16().to(DEV)
    bias = torch.randn(N, generator=gen).bfloat16().to(DEV)
    assert_close(gemm._matmul(x, packed, scale, gs, bias, cfg),
                 reference_matmul(x, packed, scale, gs, bias), f"fwd {cfg}")
    assert_close(gemm._matmul_dx(dy, packed, scale, gs, cfg),
                 dy.double() @ reference_dequantize(packed, scale, gs), f"dx {cfg}")


@pytest.mark.parametrize("M,N,K", [(1, 16, 16), (67, 48, 80), (130, 144, 256)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_medium_m_unswapped_kernel_matches_float64(M, N, K, has_bias, poisoned):
    """The medium-M launch (x·Wᵀ, decoded W as the MMA's shared-memory operand, tuning's 128 x 128
    medium tiles): odd M, minimum N and K (K padded to 64), N and M not multiples of the tile, two
    m-tiles, a single pass and split-K."""
    medium = tuning.current().medium
    for cfg in (medium, dataclasses.replace(medium, split=2)):
        check_forward(lambda *a: gemm._matmul(*a, cfg), M, N, K, has_bias, M * 1000 + N + K + has_bias,
                      f"medium M={M} N={N} K={K} {cfg}")


@pytest.mark.parametrize("has_bias", [False, True])
def test_large_m_dequantize_then_matmul_path(has_bias, poisoned):
    """From dequant_min_m rows on, W is dequantized to bf16 once and cuBLAS does the product."""
    with tuning.using(dataclasses.replace(tuning.current(), dequant_min_m=4)):
        assert gemm.use_dequant(4, 48, 192) and not gemm.use_dequant(3, 48, 192) and not gemm.use_dequant(9, 48, 200)
        gen = torch.Generator().manual_seed(21)
        M, N, K = 9, 48, 192
        packed, scale, gs = random_weight(N, K, gen)
        W = reference_dequantize(packed, scale, gs)
        wb = gemm.dequantize_bf16(packed, scale, gs)
        assert wb.dtype == torch.bfloat16 and wb.shape == (N, K)
        assert ((wb.double() - W).abs() <= 2.0 ** -8 * W.abs()).all(), "dequantize is off by more than bf16 rounding"
        x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
        bias = torch.randn(N, generator=gen).bfloat16().to(DEV) if has_bias else None
        assert gemm.route(M, N, K, x.device, False) == "dequant+cublas"
        assert_close(kernels.nvfp4_matmul(x, packed, scale, gs, bias),
                     x.double() @ W.t() + (bias.double() if has_bias else 0), "fwd large-M path")
        dy = torch.randn(M, N, generator=gen).bfloat16().to(DEV)
        assert_close(kernels.nvfp4_matmul_dx(dy, packed, scale, gs), dy.double() @ W, "dx large-M path")


@pytest.mark.parametrize("M,N,R,split,has_bias,partials,cols", [
    (5, 48, 16, 3, True, 0, 32), (70, 130, 96, 2, False, 0, 32), (1, 16, 7, 4, True, 0, 32),  # h (M, R) bf16
    (16, 130, 96, 3, True, 1, 32), (5, 48, 24, 2, False, 3, 32),                      # hp (partials, M, R) fp32
    (16, 130, 96, 3, True, 1, 128), (21, 200, 32, 2, False, 2, 16)])                 # ... other column tiles
def test_split_k_reduce_adds_the_lora_update(M, N, R, split, has_bias, partials, cols, poisoned):
    """_reduce with a LoRA update in either of matmul's forms: lora = (h, B, s), h bf16 (the
    register-A route's fold at the GRPO batch, reduce_folds_lora), or (hp, B, s), the shrink's fp32
    K-chunk partials (decode, folds_lora: after a split fragment or register-A launch), summed and
    rounded to bf16 in the kernel as the expand kernel rounds them. The sum of the fp32 partials
    rounded to y as without the update, then bf16(y + s·h·Bᵀ) against float64; tiles past M and N
    (70 x 130 in the h form's 16 x 128 tiles; the hp form's in Tuning.reduce_lora_cols columns, which
    bench/ab.py varies), ranks that are not powers of two."""
    gen = torch.Generator().manual_seed(M * 31 + N + R + partials)
    part = torch.randn(split, M, N, generator=gen).to(DEV)
    gs = torch.tensor([0.37], device=DEV)
    bias = torch.randn(N, generator=gen).bfloat16().to(DEV) if has_bias else None
    if partials:
        first = torch.randn(partials, M, R, generator=gen).to(DEV)
        h = sum(first.unbind(0)).bfloat16()                     # in order, as the kernel sums them
    else:
        first = h = torch.randn(M, R, generator=gen).bfloat16().to(DEV)
    B = (torch.randn(N, R, generator=gen) * 0.1).bfloat16().to(DEV)
    plain = gemm._reduce(part, gs, bias, torch.empty(M, N, device=DEV, dtype=torch.bfloat16))
    with tuning.using(dataclasses.replace(tuning.current(), reduce_lora_cols=cols)):
        got = gemm._reduce(part, gs, bias, torch.empty(M, N, device=DEV, dtype=torch.bfloat16), (first, B, 0.5))
    base = part.double().sum(0) * 128 / gs.double() + (bias.double() if has_bias else 0)
    assert ((plain.double() - base).abs() <= 2.0 ** -8 * base.abs() + 1e-30).all()     # y: one rounding
    want = plain.double() + 0.5 * h.double() @ B.double().t()
    assert ((got.double() - want).abs() <= 2.0 ** -8 * want.abs() + 1e-6).all(), (got.double() - want).abs().max()
