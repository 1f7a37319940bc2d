"""Tests for marlin_kernel.py: the Triton NVFP4 matmuls against a float64 reference.

On CPU the kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET=1), so shapes
are tiny; the `gpu` tests use the real Qwen2.5 projection shapes. Every test draws fresh random
codes and scales (all 16 E2M1 codes, E4M3 scales from subnormal to large) and poisons every
buffer the wrappers allocate with NaN, so an element the kernel forgets to write fails.

The kernels marlin_kernel.py launches live in small_m_kernels.py and tile_kernels.py, their shared
decode in fp4_decode.py; all three are tested here, through marlin_kernel's wrappers: small_m_kernels
by the _gemv / _mma tests, tile_kernels by the _matmul / _matmul_dx / dequantize ones, fp4_decode by
every exact-decode test.
"""
import dataclasses

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


@pytest.fixture
def poisoned(monkeypatch):
    """Every torch.empty in marlin_kernel returns a NaN-filled float tensor."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(mk.torch, "empty", empty)


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


# ----------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU: small shapes, every path

SMALL = [(1, 16, 16), (3, 32, 64), (5, 48, 80), (17, 64, 32), (2, 16, 272), (4, 128, 320)]


@pytest.mark.parametrize("M,N,K", SMALL)
@pytest.mark.parametrize("has_bias", [False, True])
def test_forward_matches_float64(M, N, K, has_bias, poisoned):
    check_forward(mk.nvfp4_matmul, M, N, K, has_bias, M * 1000 + N + K + has_bias, f"fwd M={M} N={N} K={K}")


@pytest.mark.parametrize("M,N,K", SMALL)
def test_backward_input_matches_float64(M, N, K, poisoned):
    gen = torch.Generator().manual_seed(M * 7 + N * 3 + K)
    packed, scale, gs = random_weight(N, K, gen)
    dy = torch.randn(M, N, generator=gen).bfloat16().to(DEV)
    dx = mk.nvfp4_matmul_dx(dy, packed, scale, gs)
    assert dx.shape == (M, K) and dx.dtype == torch.bfloat16
    ref = dy.double() @ mk.reference_dequantize(packed, scale, gs)
    e = assert_close(dx, ref, f"dx M={M} N={N} K={K}")
    assert e < 4e-3, f"typical error too large: {e:.2e}"


@pytest.mark.parametrize("cfg", [mk.TileConfig(16, 16, 64, split=4), mk.TileConfig(16, 32, 128, split=2),
                                 mk.TileConfig(32, 64, 64, split=1), mk.TileConfig(16, 16, 16, split=2),
                                 mk.TileConfig(16, 16, 64, split=4, swap=False),
                                 mk.TileConfig(32, 64, 64, split=1, swap=False)])
def test_split_and_tile_variants_agree(cfg, poisoned):
    """Split-K (fp32 partials + reduce kernel) and different tiles compute the same function."""
    gen = torch.Generator().manual_seed(11)
    M, N, K = 5, 144, 256
    packed, scale, gs = random_weight(N, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    dy = torch.randn(M, N, generator=gen).bfloat16().to(DEV)
    bias = torch.randn(N, generator=gen).bfloat16().to(DEV)
    assert_close(mk._matmul(x, packed, scale, gs, bias, cfg),
                 mk.reference_matmul(x, packed, scale, gs, bias), f"fwd {cfg}")
    assert_close(mk._matmul_dx(dy, packed, scale, gs, cfg),
                 dy.double() @ mk.reference_dequantize(packed, scale, gs), f"dx {cfg}")


@pytest.mark.parametrize("path,M,N,K,cfg", [
    ("gemv", 1, 48, 1056, mk.GemvConfig(bn=16, bk=64, split=3)),
    ("gemv", 2, 64, 512, mk.GemvConfig(bn=32, bk=64, split=4)),
    ("fragment", 3, 80, 512, mk.MmaConfig(warps=1, split=2)),
    ("fragment", 4, 64, 384, mk.MmaConfig(warps=2, tiles=2, split=3))])
def test_in_kernel_split_reduce_equals_the_reduce_kernel(path, M, N, K, cfg, monkeypatch, poisoned):
    """Split-K summed by each tile's last split (atomic counts) gives the bits of the separate reduce
    kernel (same order of the partials), on the CUDA-core and fragment (M <= 4) kernels, for several
    tiles and splits, and leaves the counts at zero."""
    run = {"gemv": mk._gemv, "fragment": mk._mma}[path]
    name = {"gemv": "_nvfp4_gemv_kernel", "fragment": "_nvfp4_mma_kernel"}[path]
    launched = []
    monkeypatch.setattr(mk, name, LaunchSpy(getattr(mk, name), launched))
    monkeypatch.setattr(mk, "_SPLIT_COUNTS", {})
    gen = torch.Generator().manual_seed(M + N + K)
    packed, scale, gs = random_weight(N, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    bias = torch.randn(N, generator=gen).bfloat16().to(DEV)
    got = run(x, packed, scale, gs, bias, cfg)
    assert [(kw["REDUCE"], kw["NSPLIT"] > 1) for _, kw in launched] == [(True, True)]
    assert len(mk._SPLIT_COUNTS) == 1 and not next(iter(mk._SPLIT_COUNTS.values())).any()
    monkeypatch.setattr(mk, "REDUCE_IN_KERNEL", False)
    assert torch.equal(got, run(x, packed, scale, gs, bias, cfg))
    assert_close(got, mk.reference_matmul(x, packed, scale, gs, bias), f"in-kernel reduce {path} M={M} {cfg}")


@pytest.mark.parametrize("M,N,K", [(1, 16, 16), (3, 16, 32), (4, 48, 80), (2, 32, 272), (1, 64, 1056)])
@pytest.mark.parametrize("cfg", [mk.GemvConfig(), mk.GemvConfig(bn=16, bk=64, split=3), mk.GemvConfig(bn=32, bk=32)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_cuda_core_gemv_matches_float64(M, N, K, cfg, has_bias, poisoned):
    """The CUDA-core kernel (M <= 4): odd M, minimum N and K, a K tail, split-K and single pass."""
    check_forward(lambda *a: mk._gemv(*a, cfg), M, N, K, has_bias, M * 1000 + N + K + cfg.bk + has_bias,
                  f"gemv M={M} N={N} K={K} {cfg}")


@pytest.mark.parametrize("M,N,K", [(1, 16, 16), (67, 48, 80), (130, 144, 256)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_medium_m_unswapped_kernel_matches_float64(M, N, K, has_bias, poisoned):
    """The medium-M launch (x·Wᵀ, decoded W as the MMA's shared-memory operand, MEDIUM_CONFIG's
    128 x 128 tiles): odd M, minimum N and K (K padded to 64), N and M not multiples of the tile,
    two m-tiles, a single pass and split-K."""
    for cfg in (mk.MEDIUM_CONFIG, dataclasses.replace(mk.MEDIUM_CONFIG, split=2)):
        check_forward(lambda *a: mk._matmul(*a, cfg), M, N, K, has_bias, M * 1000 + N + K + has_bias,
                      f"medium M={M} N={N} K={K} {cfg}")


@pytest.mark.parametrize("M,N,K", [(1, 16, 128), (3, 48, 256), (8, 64, 384), (9, 80, 128), (16, 32, 256), (6, 16, 640)])
@pytest.mark.parametrize("cfg", [mk.MmaConfig(), mk.MmaConfig(warps=2, tiles=2, split=2), mk.MmaConfig(warps=1, tiles=4, split=1)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_fragment_kernel_matches_float64(M, N, K, cfg, has_bias, poisoned):
    """The fragment kernel (mma.sync on registers decoded in place; M <= 16, K a multiple of 128):
    one and two token tiles, odd M, N not a multiple of the program's rows (wrapped rows must not
    be stored), several windows, a single pass and split-K. On the CPU the PTX is replaced by its
    plain-fp32 emulation, so this checks the index maps; the GPU run checks the PTX itself."""
    check_forward(lambda *a: mk._mma(*a, cfg), M, N, K, has_bias, M * 1000 + N + K + cfg.tiles + has_bias,
                  f"mma M={M} N={N} K={K} {cfg}")


@pytest.mark.parametrize("M", [4, 13])
def test_fragment_kernel_decodes_every_code_exactly(M):
    """Rows of the identity M at a time: y = Wᵀ within one bf16 rounding for every byte value and
    E4M3 scales from subnormal to max (through both token tiles at M = 13)."""
    K = 128
    packed = torch.arange(256, dtype=torch.uint8).reshape(4, 64).repeat(4, 1).to(DEV)     # (16, 64)
    scale = torch.tensor([2.0 ** -9, 2.0 ** -7, 0.375, 448.0, 1.0, 2.0 ** -6, 96.0, 0.0078125])
    scale, gs = scale.repeat(16, 1).to(torch.float8_e4m3fn).to(DEV), torch.tensor([3.0], device=DEV)
    eye = torch.eye(K, dtype=torch.bfloat16, device=DEV)
    y = torch.cat([mk._mma(eye[k:k + M], packed, scale, gs, None, mk.MmaConfig()) for k in range(0, K, M)])
    W = mk.reference_dequantize(packed, scale, gs)
    err = (y.double().t() - W).abs()
    assert (err <= 2.0 ** -8 * W.abs()).all(), f"decode off by {err.max():.3e}"


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


def test_cuda_core_gemv_decodes_every_code_exactly():
    """x = 4 rows of the identity at a time: y = Wᵀ within one bf16 rounding, code 1 (0.5, an fp32
    subnormal inside the kernel) included."""
    K = 32
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16).repeat(1, K // 32).to(DEV)
    scale = torch.tensor([2.0 ** -9, 2.0 ** -7, 0.375, 448.0]).repeat(16, 1)[:, :K // 16]
    scale, gs = scale.to(torch.float8_e4m3fn).to(DEV), torch.tensor([3.0], device=DEV)
    eye = torch.eye(K, dtype=torch.bfloat16, device=DEV)
    y = torch.cat([mk._gemv(eye[k:k + 4], packed, scale, gs, None, mk.GemvConfig()) for k in range(0, K, 4)])
    W = mk.reference_dequantize(packed, scale, gs)
    err = (y.double().t() - W).abs()
    assert (err <= 2.0 ** -8 * W.abs()).all(), f"decode off by {err.max():.3e}"


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


@pytest.mark.parametrize("M", [1, 2])
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


@pytest.mark.parametrize("M,K,fragment", [(3, 128, True), (8, 256, True), (9, 128, False), (4, 192, False)])
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
    assert mk.GEMV_MAX_M < 3 and mk.FRAGMENT_MAX_M == 8


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


@pytest.mark.parametrize("has_bias", [False, True])
def test_large_m_dequantize_then_matmul_path(has_bias, monkeypatch, poisoned):
    """From DEQUANT_MIN_M rows on, W is dequantized to bf16 once and cuBLAS does the product."""
    monkeypatch.setattr(mk, "DEQUANT_MIN_M", 4)
    assert mk.use_dequant(4, 48, 192) and not mk.use_dequant(3, 48, 192) and not mk.use_dequant(9, 48, 200)
    gen = torch.Generator().manual_seed(21)
    M, N, K = 9, 48, 192
    packed, scale, gs = random_weight(N, K, gen)
    W = mk.reference_dequantize(packed, scale, gs)
    wb = mk._dequantize_bf16(packed, scale, gs)
    assert wb.dtype == torch.bfloat16 and wb.shape == (N, K)
    assert ((wb.double() - W).abs() <= 2.0 ** -8 * W.abs()).all(), "dequantize is off by more than bf16 rounding"
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    bias = torch.randn(N, generator=gen).bfloat16().to(DEV) if has_bias else None
    assert_close(mk.nvfp4_matmul(x, packed, scale, gs, bias),
                 x.double() @ W.t() + (bias.double() if has_bias else 0), "fwd large-M path")
    dy = torch.randn(M, N, generator=gen).bfloat16().to(DEV)
    assert_close(mk.nvfp4_matmul_dx(dy, packed, scale, gs), dy.double() @ W, "dx large-M path")


def test_every_code_and_scale_decodes_exactly():
    """x = identity gives y = Wᵀ: each element within one bf16 rounding of e2m1·scale/gs."""
    gen = torch.Generator().manual_seed(3)
    K = 32
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)           # every byte value
    packed = codes.repeat(1, K // 32)                                      # (16, K/2)
    scale = torch.tensor([2.0 ** -9, 2.0 ** -7, 0.375, 448.0]).repeat(16, 1)[:, :K // 16]
    scale = scale.to(torch.float8_e4m3fn)                                  # subnormal..max
    gs = torch.tensor([3.0])
    packed, scale, gs = packed.to(DEV), scale.to(DEV), gs.to(DEV)
    y = mk.nvfp4_matmul(torch.eye(K, dtype=torch.bfloat16, device=DEV), packed, scale, gs)  # (K, 16)
    W = mk.reference_dequantize(packed, scale, gs)                         # (16, K) float64
    err = (y.double().t() - W).abs()
    assert (err <= 2.0 ** -8 * W.abs()).all(), f"decode off by {err.max():.3e}"
    del gen


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


# ----------------------------------------------------------------------------------------------
# GPU: real shapes (Qwen2.5-7B / 32B projections)

@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4608, 3584), (3584, 18944), (55296, 5120)])
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


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4608, 3584), (3584, 18944), (55296, 5120)])
@pytest.mark.parametrize("M", [1, 4, 5, 8, 13, 16])          # M <= 4: the in-kernel split-K sum
@pytest.mark.parametrize("cfg", [mk.MmaConfig(4, 1), mk.MmaConfig(4, 2), mk.MmaConfig(8, 2, split=1)])
def test_fragment_kernel_real_shapes_gpu(N, K, M, cfg, poisoned):
    gen = torch.Generator().manual_seed(N + K + M)
    packed, scale, gs = random_weight(N, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().cuda()
    bias = torch.randn(N, generator=gen).bfloat16().cuda()
    assert_close(mk._mma(x, packed, scale, gs, bias, cfg), mk.reference_matmul(x, packed, scale, gs, bias),
                 f"mma {N}x{K} M={M} {cfg}")
