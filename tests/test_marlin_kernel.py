"""Tests for marlin_kernel.py: the wrappers' choice of kernel, the input checks, the float64
reference and nvfp4_matmul / nvfp4_matmul_dx end to end.

On CPU the kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET=1), so shapes
are tiny; the `gpu` tests use the real Qwen2.5 projection shapes. Every test draws fresh random
codes and scales (all 16 E2M1 codes, E4M3 scales from subnormal to large) and poisons every
buffer the wrappers allocate with NaN (conftest's `poisoned`), so an element the kernel forgets to
write fails. References: float64 (reference_matmul / reference_dequantize, plain torch), itself
checked against nvfp4.dequantize; the kernel a wrapper launched is recorded by LaunchSpy.

The kernels marlin_kernel.py launches are tested in their own files, through marlin_kernel's
wrappers and with the helpers below (random_weight, assert_close, check_forward, LaunchSpy, SMALL,
DEV): test_fp4_decode.py (exact decoding of every code and scale), test_small_m_kernels.py (the
CUDA-core GEMV and the fragment kernel), test_tile_kernels.py (tile, medium-M, dx, split-K reduce,
dequantize).
"""
import pytest
import torch

import marlin_kernel as mk
from small_m_kernels import _nvfp4_gemv_kernel, _nvfp4_mma_kernel
from tile_kernels import _nvfp4_mm_kernel

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def random_weight(N, K, gen, device=DEV):
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen).to(device)
    s = torch.exp2(torch.rand(N, K // 16, generator=gen) * 20 - 12)       # 2^-12 .. 2^8
    scale = s.to(torch.float8_e4m3fn).to(device)                          # incl. E4M3 subnormals
    global_scale = torch.tensor([448.0 * 6 / (0.5 + torch.rand(1, generator=gen).item())], device=device)
    return packed, scale, global_scale


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def assert_close(out, ref, what, worst=1e-2):
    assert torch.isfinite(out).all(), f"{what}: non-finite output (an element was not written?)"
    e = rel_err(out, ref)
    assert e < worst, f"{what}: relative error {e:.2e} (max abs err {(out.double() - ref).abs().max():.3e})"
    return e


def check_forward(run, M, N, K, has_bias, seed, what):
    """run(x, packed, scale, global_scale, bias) on fresh random data against float64: shape, dtype,
    every element written (poisoned buffers), worst error < 1e-2 and typical < 4e-3 (bf16 output
    rounding is ~1.5e-3)."""
    gen = torch.Generator().manual_seed(seed)
    packed, scale, gs = random_weight(N, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    bias = torch.randn(N, generator=gen).bfloat16().to(DEV) if has_bias else None
    y = run(x, packed, scale, gs, bias)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    e = assert_close(y, mk.reference_matmul(x, packed, scale, gs, bias), what)
    assert e < 4e-3, f"{what}: typical error too large: {e:.2e}"


class LaunchSpy:
    """Stands in for a Triton kernel: records (kernel, launch keyword arguments), then launches.
    Installed under the name marlin_kernel's wrappers launch (mk._nvfp4_..._kernel)."""
    def __init__(self, kernel, launched):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append((self.kernel, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


# ----------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU: small shapes, every path

SMALL = [(1, 16, 16), (3, 32, 64), (5, 48, 80), (17, 64, 32), (2, 16, 272), (4, 128, 320)]


@pytest.mark.parametrize("M,N,K", SMALL)
@pytest.mark.parametrize("has_bias", [False, True])
def test_forward_matches_float64(M, N, K, has_bias, poisoned):
    check_forward(mk.nvfp4_matmul, M, N, K, has_bias, M * 1000 + N + K + has_bias, f"fwd M={M} N={N} K={K}")


@pytest.mark.parametrize("M", [1])
def test_wrapper_picks_cuda_core_path_for_tiny_m(M, monkeypatch):
    """nvfp4_matmul must run the CUDA-core kernel (and not the MMA one) for M <= GEMV_MAX_M."""
    launched = []
    monkeypatch.setattr(mk, "_nvfp4_gemv_kernel", LaunchSpy(_nvfp4_gemv_kernel, launched))
    monkeypatch.setattr(mk, "_nvfp4_mm_kernel", LaunchSpy(_nvfp4_mm_kernel, launched))
    gen = torch.Generator().manual_seed(M)
    packed, scale, gs = random_weight(32, 64, gen)
    x = torch.randn(M, 64, generator=gen).bfloat16().to(DEV)
    assert_close(mk.nvfp4_matmul(x, packed, scale, gs), mk.reference_matmul(x, packed, scale, gs), f"M={M}")
    assert launched and all(k is _nvfp4_gemv_kernel for k, _ in launched), "MMA kernel used"
    assert M <= mk.GEMV_MAX_M and isinstance(mk.fwd_config(M, 32, 64), mk.GemvConfig)
    assert not isinstance(mk.fwd_config(mk.GEMV_MAX_M + 1, 32, 64), mk.GemvConfig)


@pytest.mark.parametrize("M,K,fragment", [(2, 128, True), (8, 256, True), (16, 128, True), (4, 192, False),
                                         (2, 192, False), (17, 128, False)])
def test_wrapper_routes_small_m_to_fragment_kernel(M, K, fragment, monkeypatch):
    """nvfp4_matmul runs the fragment kernel for GEMV_MAX_M < M <= FRAGMENT_MAX_M when K is a
    multiple of 128, and the swapped wgmma kernel otherwise."""
    launched = []
    monkeypatch.setattr(mk, "_nvfp4_mma_kernel", LaunchSpy(_nvfp4_mma_kernel, launched))
    monkeypatch.setattr(mk, "_nvfp4_mm_kernel", LaunchSpy(_nvfp4_mm_kernel, launched))
    gen = torch.Generator().manual_seed(M + K)
    packed, scale, gs = random_weight(32, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    assert_close(mk.nvfp4_matmul(x, packed, scale, gs), mk.reference_matmul(x, packed, scale, gs), f"M={M}")
    kernels = {k for k, _ in launched}
    assert kernels == {_nvfp4_mma_kernel if fragment else _nvfp4_mm_kernel}, kernels
    assert mk.GEMV_MAX_M == 1 and mk.FRAGMENT_MAX_M == 16


@pytest.mark.parametrize("M,swapped", [(64, True), (65, False), (97, False)])
def test_wrapper_routes_medium_m_to_unswapped_kernel(M, swapped, monkeypatch):
    """nvfp4_matmul runs the MMA kernel with SWAP_AB=False (MEDIUM_CONFIG) exactly for 64 < M,
    up to where dequantize + cuBLAS takes over; M <= 64 stays swapped."""
    launched = []
    monkeypatch.setattr(mk, "_nvfp4_mm_kernel", LaunchSpy(_nvfp4_mm_kernel, launched))
    gen = torch.Generator().manual_seed(M)
    packed, scale, gs = random_weight(16, 64, gen)
    x = torch.randn(M, 64, generator=gen).bfloat16().to(DEV)
    assert_close(mk.nvfp4_matmul(x, packed, scale, gs), mk.reference_matmul(x, packed, scale, gs), f"M={M}")
    mm = [kw for k, kw in launched if k is _nvfp4_mm_kernel]
    assert len(mm) == 1 and mm[0]["SWAP_AB"] == swapped, f"launches: {mm}"
    assert mm[0]["BM"] == (64 if swapped else mk.MEDIUM_CONFIG.bm)
    for m in (65, 128, 256, mk.DEQUANT_MIN_M - 1):       # a 7B gate_up-sized weight: never dequantized
        assert not mk.use_dequant(m, 37888, 3584) and mk.fwd_config(m, 37888, 3584) == mk.MEDIUM_CONFIG
    assert mk.use_dequant(mk.DEQUANT_MIN_M, 37888, 3584)


def test_reference_agrees_with_nvfp4_dequantize():
    """Our float64 reference reads the format the same way as nvfp4.py (helper A's module)."""
    nvfp4 = pytest.importorskip("nvfp4")
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(32, 64, generator=gen)
    packed, scale, gs = nvfp4.quantize(w)
    ref = mk.reference_dequantize(packed, scale, gs)
    theirs = nvfp4.dequantize(packed, scale, gs, dtype=torch.float64)
    assert torch.allclose(ref, theirs, rtol=1e-6, atol=0), "format disagreement with nvfp4.dequantize"
    x = torch.randn(3, 64, generator=gen).bfloat16().to(DEV)
    y = mk.nvfp4_matmul(x, packed.to(DEV), scale.to(DEV), gs.to(DEV))
    assert_close(y, x.double() @ theirs.to(DEV).t(), "fwd on nvfp4.quantize weights")


# ----------------------------------------------------------------------------------------------
# bad input

def test_bad_inputs_raise_clear_errors():
    gen = torch.Generator().manual_seed(0)
    packed, scale, gs = random_weight(32, 64, gen)
    x = torch.randn(2, 64).bfloat16().to(DEV)
    with pytest.raises(TypeError, match="bfloat16"):
        mk.nvfp4_matmul(x.float(), packed, scale, gs)
    with pytest.raises(TypeError, match="uint8"):
        mk.nvfp4_matmul(x, packed.to(torch.int8), scale, gs)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        mk.nvfp4_matmul(x, packed, scale.float(), gs)
    with pytest.raises(TypeError, match="global_scale"):
        mk.nvfp4_matmul(x, packed, scale, gs.double())
    with pytest.raises(ValueError, match="columns"):
        mk.nvfp4_matmul(torch.randn(2, 48).bfloat16().to(DEV), packed, scale, gs)
    with pytest.raises(ValueError, match="2-D"):
        mk.nvfp4_matmul(x[None], packed, scale, gs)
    with pytest.raises(ValueError, match="contiguous"):
        mk.nvfp4_matmul(torch.randn(64, 2).bfloat16().to(DEV).t(), packed, scale, gs)
    with pytest.raises(ValueError, match="contiguous"):
        mk.nvfp4_matmul(x, packed.t().contiguous().t(), scale, gs)
    with pytest.raises(ValueError, match="multiples of 16"):
        mk.nvfp4_matmul(torch.randn(2, 56).bfloat16().to(DEV), packed[:, :28], scale[:, :3], gs)
    with pytest.raises(ValueError, match="multiples of 16"):
        mk.nvfp4_matmul(x, packed[:24], scale[:24], gs)
    with pytest.raises(ValueError, match="scale must have shape"):
        mk.nvfp4_matmul(x, packed, scale[:, :2].contiguous(), gs)
    with pytest.raises(ValueError, match="bias"):
        mk.nvfp4_matmul(x, packed, scale, gs, torch.randn(31).bfloat16().to(DEV))
    with pytest.raises(ValueError, match="columns"):
        mk.nvfp4_matmul_dx(torch.randn(2, 64).bfloat16().to(DEV), packed, scale, gs)
    with pytest.raises(ValueError, match="TileConfig.bk"):
        mk.TileConfig(16, 16, 24)
    with pytest.raises(ValueError, match="GemvConfig.bn/bk"):
        mk.GemvConfig(bk=48)


def test_fragment_kernel_refuses_what_it_cannot_do():
    gen = torch.Generator().manual_seed(0)
    packed, scale, gs = random_weight(16, 128, gen)
    with pytest.raises(ValueError, match="M <= 16"):
        mk._mma(torch.zeros(17, 128, dtype=torch.bfloat16, device=DEV), packed, scale, gs, None, mk.MmaConfig())
    packed, scale, gs = random_weight(16, 64, gen)
    with pytest.raises(ValueError, match="multiple of 128"):
        mk._mma(torch.zeros(2, 64, dtype=torch.bfloat16, device=DEV), packed, scale, gs, None, mk.MmaConfig())
    with pytest.raises(ValueError, match="MmaConfig"):
        mk.MmaConfig(tiles=3)


# ----------------------------------------------------------------------------------------------
# GPU: real shapes (Qwen2.5-7B / 32B projections)

@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4608, 3584), (3584, 18944), (55296, 5120), (5120, 27648)])
@pytest.mark.parametrize("M", [1, 7, 16, 33, 100, 256, 1000])
def test_real_shapes_gpu(N, K, M, poisoned):
    gen = torch.Generator().manual_seed(N + K + M)
    packed, scale, gs = random_weight(N, K, gen)
    W = mk.reference_dequantize(packed, scale, gs)
    x = torch.randn(M, K, generator=gen).bfloat16().cuda()
    bias = torch.randn(N, generator=gen).bfloat16().cuda()
    assert_close(mk.nvfp4_matmul(x, packed, scale, gs, bias), x.double() @ W.t() + bias.double(),
                 f"fwd {N}x{K} M={M}")
    dy = torch.randn(M, N, generator=gen).bfloat16().cuda()
    assert_close(mk.nvfp4_matmul_dx(dy, packed, scale, gs), dy.double() @ W, f"dx {N}x{K} M={M}")


def test_interleaved_weights_give_the_same_bits_on_every_route(poisoned):
    """nvfp4.interleave's layout (what NVFP4Linear holds on CUDA) read by every kernel: the GEMV
    (M = 1), the fragment kernel (2..16, both token tiles), the swapped tiles and the medium tiles,
    dequantize + matmul, and dx: bit for bit what the plain layout gives (itself checked against
    float64 above), and close to float64."""
    import nvfp4
    gen = torch.Generator().manual_seed(11)
    N, K = 48, 256
    packed, scale, gs = random_weight(N, K, gen)
    pi, si = nvfp4.interleave(packed, scale)
    assert not torch.equal(pi, packed)
    for M in (1, 2, 5, 16, 40, 130):
        x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
        y = mk.nvfp4_matmul(x, pi, si, gs, interleaved=True)
        assert torch.equal(y, mk.nvfp4_matmul(x, packed, scale, gs)), f"fwd M={M}"
        assert_close(y, mk.reference_matmul(x, packed, scale, gs), f"fwd M={M}")
        dy = torch.randn(M, N, generator=gen).bfloat16().to(DEV)
        assert torch.equal(mk.nvfp4_matmul_dx(dy, pi, si, gs, interleaved=True),
                           mk.nvfp4_matmul_dx(dy, packed, scale, gs)), f"dx M={M}"
    with pytest.raises(ValueError, match="multiple of 128"):
        p2, s2, g2 = random_weight(16, 192, gen)
        mk.nvfp4_matmul(torch.zeros(1, 192, dtype=torch.bfloat16, device=DEV), p2, s2, g2, interleaved=True)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4608, 3584), (37888, 3584), (3584, 18944), (5120, 27648)])
def test_interleaved_weights_real_shapes_gpu(N, K, poisoned):
    """The same on the real projection shapes (the routes' launch shapes differ there: 128-row
    fragment programs for the wide weights, split-K sums in-kernel and by the reduce kernel). Where
    the register-A wgmma kernel takes the interleaved weight (it reads no other layout; its sums run
    in another order) the bits differ: there both are checked against float64."""
    import nvfp4
    gen = torch.Generator().manual_seed(N + K)
    packed, scale, gs = random_weight(N, K, gen, "cuda")
    pi, si = nvfp4.interleave(packed, scale)
    for M in (1, 2, 4, 8, 9, 16, 64, 128):
        x = torch.randn(M, K, generator=gen).bfloat16().cuda()
        y, y_plain = mk.nvfp4_matmul(x, pi, si, gs, interleaved=True), mk.nvfp4_matmul(x, packed, scale, gs)
        if mk.wgmma_rows(M, N, K, x.device, True):
            ref = mk.reference_matmul(x, packed, scale, gs)
            assert_close(y, ref, f"M={M}")
            assert_close(y_plain, ref, f"plain M={M}")
        else:
            assert torch.equal(y, y_plain), M
