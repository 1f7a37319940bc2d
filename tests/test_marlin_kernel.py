"""Tests for marlin_kernel.py: the teaching kernel against float64, its exact decode of every byte
and scale, its input checks, the float64 reference against nvfp4.dequantize, and the dispatch
(the fast path where kernels.gemm_runs, else the teaching kernel; dx: dequantize + matmul).

Tensors live on DEV (tests/nvfp4_cases.py): on a GPU the kernel runs its bf16 MMA path on CUDA
tensors; without one, conftest sets TRITON_INTERPRET=1 and it runs in the Triton interpreter on
CPU tensors (its fp32-dot branch), so the shapes are small. Every test draws fresh random codes
and scales (all 16 E2M1 codes, E4M3 scales from subnormal to large) and poisons the buffers the
wrapper allocates with NaN (conftest's `poisoned`): an element the kernel forgets to write fails.
The `gpu` test compares the fast kernels (kernels.nvfp4_matmul, interleaved weights) with this
kernel and with float64 on the real Qwen2.5-7B projection shapes.
"""
import pytest
import torch

import kernels
import marlin_kernel as mk
import nvfp4
from nvfp4_cases import DEV, LaunchSpy, random_weight, rel_err

M_CASES = [0, 1, 2, 5, 17, 64, 130]           # empty, decode, odd, one tile and a bit, several tiles
NK_CASES = [(16, 16), (48, 80), (80, 272), (272, 48)]   # N, K multiples of 16, not of the 64 tiles


def float64(x, packed, scale, gs, bias=None):
    """(y, mag): the float64 product and |x|·|W|ᵀ + |bias|, the size of fp32's summation error."""
    W = mk.reference_dequantize(packed, scale, gs)                   # (N, K) float64
    mag = x.double().abs() @ W.abs().t()                             # (M, N)
    if bias is not None:
        mag = mag + bias.double().abs()
    return mk.reference_matmul(x, packed, scale, gs, bias), mag


def assert_rounded_once(y, ref, mag, what):
    """y (bf16) is the float64 ref rounded once: every element finite (written) and within half a
    bf16 ulp (2^-8 of its size) plus a hair of fp32 summation error (2^-14 of mag)."""
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape, f"{what}: {y.dtype} {tuple(y.shape)}"
    assert torch.isfinite(y).all(), f"{what}: non-finite output (an element was not written?)"
    err = (y.double() - ref).abs()
    bound = ref.abs() * 2**-8 + mag * 2**-14
    bad = (err > bound).sum().item()
    assert bad == 0, (f"{what}: {bad} elements past the bound; max |err| {err.max():.3e}, "
                      f"mean {err.mean():.3e}, relative {rel_err(y, ref):.2e}")


# ----------------------------------------------------------------------------------------------
# the teaching kernel against float64

@pytest.mark.parametrize("M", M_CASES)
@pytest.mark.parametrize("N,K", NK_CASES)
@pytest.mark.parametrize("has_bias", [False, True])
def test_matmul_matches_float64(M, N, K, has_bias, poisoned):
    gen = torch.Generator().manual_seed(M * 1000 + N + K + has_bias)
    packed, scale, gs = random_weight(N, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    bias = torch.randn(N, generator=gen).bfloat16().to(DEV) if has_bias else None
    y = mk.matmul(x, packed, scale, gs, bias)
    assert_rounded_once(y, *float64(x, packed, scale, gs, bias), f"M={M} N={N} K={K} bias={has_bias}")


def test_grouped_order_covers_every_tile(poisoned):
    """More row tiles than GROUP_M (a full group and a short one) and several column tiles: every
    tile of y is computed once (a tile the grouping misses stays NaN)."""
    M, N, K = (mk.GROUP_M + 2) * mk.BLOCK_M - 7, 3 * mk.BLOCK_N - 16, 32
    gen = torch.Generator().manual_seed(1)
    packed, scale, gs = random_weight(N, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    assert_rounded_once(mk.matmul(x, packed, scale, gs), *float64(x, packed, scale, gs), f"M={M} N={N}")


def test_decode_is_exact_for_every_byte_and_scale(poisoned):
    """x = I makes y = Wᵀ: with global_scale 1 each e2m1 · scale is a bf16 number, so the kernel must
    return the float64 weight exactly, for all 256 bytes (both nibbles) and all 254 finite E4M3
    scales (the two NaN patterns stand in for 0 and -0)."""
    gen = torch.Generator().manual_seed(0)
    N = K = 64
    packed = torch.arange(256, dtype=torch.uint8).repeat(8)[torch.randperm(2048, generator=gen)]
    scale_bits = torch.arange(256, dtype=torch.uint8)[torch.randperm(256, generator=gen)]
    scale_bits[scale_bits == 0x7F], scale_bits[scale_bits == 0xFF] = 0x00, 0x80    # no NaN scales
    packed, scale = packed.view(N, K // 2).to(DEV), scale_bits.view(N, K // 16).view(torch.float8_e4m3fn).to(DEV)
    gs = torch.ones(1, device=DEV)
    y = mk.matmul(torch.eye(K, dtype=torch.bfloat16, device=DEV), packed, scale, gs)
    W = mk.reference_dequantize(packed, scale, gs)
    bad = (y.double() != W.t()).sum().item()
    assert bad == 0, f"{bad} of {W.numel()} weights decoded wrong, max |err| {(y.double() - W.t()).abs().max():.3e}"


def test_matmul_on_nvfp4_quantize_weights(poisoned):
    """The kernel reads what nvfp4.quantize writes (a Gaussian weight, as a checkpoint's)."""
    gen = torch.Generator().manual_seed(3)
    packed, scale, gs = nvfp4.quantize((torch.randn(96, 160, generator=gen) * 0.02).to(DEV))
    x = torch.randn(7, 160, generator=gen).bfloat16().to(DEV)
    W = nvfp4.dequantize(packed, scale, gs, torch.float64)
    assert_rounded_once(mk.matmul(x, packed, scale, gs), x.double() @ W.t(), x.double().abs() @ W.abs().t(),
                        "nvfp4.quantize weights")


# ----------------------------------------------------------------------------------------------
# the float64 reference against nvfp4.py (two independent readings of the format)

def test_reference_dequantize_agrees_with_nvfp4():
    # one byte by hand: 0x2F holds k = 0 in its low nibble (0xF: -6) and k = 1 in its high one (0x2: 1.0)
    packed = torch.full((1, 8), 0x2F, dtype=torch.uint8)
    scale = torch.tensor([[2.0]]).to(torch.float8_e4m3fn)
    W = mk.reference_dequantize(packed, scale, torch.tensor([4.0]))
    assert W[0, :2].tolist() == [-3.0, 0.5], W[0, :2]
    gen = torch.Generator().manual_seed(5)
    for packed, scale, gs in (random_weight(48, 96, gen, "cpu"), nvfp4.quantize(torch.randn(32, 64, generator=gen))):
        ours, theirs = mk.reference_dequantize(packed, scale, gs), nvfp4.dequantize(packed, scale, gs, torch.float64)
        err = ((ours - theirs).abs() / theirs.abs().clamp(min=1e-30)).max().item()
        assert err < 1e-6, f"format disagreement with nvfp4.dequantize: max relative error {err:.2e}"


# ----------------------------------------------------------------------------------------------
# input checks

def test_bad_inputs_raise_clear_errors():
    gen = torch.Generator().manual_seed(0)
    packed, scale, gs = random_weight(32, 64, gen)
    x = torch.randn(2, 64, generator=gen).bfloat16().to(DEV)
    cases = [
        (TypeError, "x must be bfloat16", (x.float(), packed, scale, gs)),
        (TypeError, "uint8", (x, packed.to(torch.int8), scale, gs)),
        (TypeError, "float8_e4m3fn", (x, packed, scale.float(), gs)),
        (TypeError, "global_scale", (x, packed, scale, gs.double())),
        (ValueError, "2-D", (x[None], packed, scale, gs)),
        (ValueError, "multiples of 16", (x, packed[:24], scale[:24], gs)),
        (ValueError, "multiples of 16", (x[:, :56].contiguous(), packed[:, :28].contiguous(),
                                         scale[:, :3].contiguous(), gs)),                  # K = 56
        (ValueError, r"scale must have shape \(N, K/16\)", (x, packed, scale[:, :2].contiguous(), gs)),
        (ValueError, "x has 48 columns", (x[:, :48].contiguous(), packed, scale, gs)),
        (ValueError, "bias must be", (x, packed, scale, gs, torch.randn(31).bfloat16().to(DEV))),
        (ValueError, "bias must be", (x, packed, scale, gs, torch.randn(32).to(DEV))),
        (ValueError, "x must be contiguous", (torch.randn(64, 2).bfloat16().to(DEV).t(), packed, scale, gs)),
        (ValueError, "packed must be contiguous", (x, packed.t().contiguous().t(), scale, gs)),
    ]
    if DEV == "cuda":
        cases.append((ValueError, "packed is on cpu", (x, packed.cpu(), scale, gs)))
    for error, message, args in cases:
        with pytest.raises(error, match=message):
            mk.matmul(*args)


# ----------------------------------------------------------------------------------------------
# GPU: the fast path against the teaching kernel on Qwen2.5-7B shapes

@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4608, 3584), (3584, 3584), (3584, 18944)])     # qkv, o, down
@pytest.mark.parametrize("M", [1, 16, 128, 1024])
def test_fast_path_equals_the_teaching_kernel_gpu(N, K, M, poisoned):
    """kernels.nvfp4_matmul on the interleaved weight (NVFP4Linear's layout on CUDA) and the teaching
    kernel on the plain one agree within bf16 rounding, and both with float64."""
    gen = torch.Generator().manual_seed(N + K + M)
    packed, scale, gs = random_weight(N, K, gen, "cuda")
    x = torch.randn(M, K, generator=gen).bfloat16().cuda()
    bias = torch.randn(N, generator=gen).bfloat16().cuda()
    assert kernels.gemm_runs(x)
    fast = kernels.nvfp4_matmul(x, *nvfp4.interleave(packed, scale), gs, bias=bias, interleaved=True)
    teach = mk.matmul(x, packed, scale, gs, bias)
    ref = mk.reference_matmul(x, packed, scale, gs, bias)
    for what, y, against in (("fast vs teaching", fast, teach.double()), ("fast vs float64", fast, ref),
                             ("teaching vs float64", teach, ref)):
        assert torch.isfinite(y).all(), f"{what} {N}x{K} M={M}: non-finite output"
        e, err = rel_err(y, against), (y.double() - against).abs()
        assert e < 1e-2, (f"{what} {N}x{K} M={M}: relative error {e:.2e}, max |err| {err.max():.3e}, "
                          f"mean {err.mean():.3e}")
