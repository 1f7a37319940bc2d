"""Tests for kernels/gemm.py: the route of each product, the input checks, and nvfp4_matmul /
nvfp4_matmul_dx end to end on every route.

On CPU the kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET=1), so shapes
are tiny; the `gpu` tests use the real Qwen2.5 projection shapes. Every test draws fresh random
codes and scales (all 16 E2M1 codes, E4M3 scales from subnormal to large) and poisons every
buffer the wrappers allocate with NaN (conftest's `poisoned`), so an element the kernel forgets to
write fails. References: marlin_kernel.reference_matmul / reference_dequantize (float64, plain
torch); the kernel a wrapper launched is recorded by LaunchSpy.

The kernels themselves are tested in test_kernels_fp4_decode.py (exact decoding of every code and
scale), test_kernels_small_m.py (the GEMV and the fragment kernel), test_kernels_tiles.py (tile,
medium-M, dx, split-K reduce, dequantize) and test_kernels_register_a.py (the Gluon kernels).
"""
import dataclasses

import pytest
import torch

import kernels
from kernels import gemm, shapes, tuning
from marlin_kernel import reference_matmul
from nvfp4_cases import DEV, SMALL, LaunchSpy, assert_close, check_forward, random_weight


def _replaced(**kw):
    return tuning.using(dataclasses.replace(tuning.current(), **kw))


# ----------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU: small shapes, every path

@pytest.mark.parametrize("M,N,K", SMALL)
@pytest.mark.parametrize("has_bias", [False, True])
def test_forward_matches_float64(M, N, K, has_bias, poisoned):
    check_forward(kernels.nvfp4_matmul, M, N, K, has_bias, M * 1000 + N + K + has_bias, f"fwd M={M} N={N} K={K}")


@pytest.mark.parametrize("M", [1])
def test_wrapper_picks_cuda_core_path_for_tiny_m(M, monkeypatch):
    """nvfp4_matmul must run the CUDA-core kernel (and not the MMA one) for the GEMV's one row."""
    launched = []
    monkeypatch.setattr(gemm, "_nvfp4_gemv_kernel", LaunchSpy(gemm._nvfp4_gemv_kernel, launched))
    monkeypatch.setattr(gemm, "_nvfp4_mm_kernel", LaunchSpy(gemm._nvfp4_mm_kernel, launched))
    gen = torch.Generator().manual_seed(M)
    packed, scale, gs = random_weight(32, 64, gen)
    x = torch.randn(M, 64, generator=gen).bfloat16().to(DEV)
    assert_close(kernels.nvfp4_matmul(x, packed, scale, gs), reference_matmul(x, packed, scale, gs), f"M={M}")
    assert launched and all(k is gemm._nvfp4_gemv_kernel.kernel for k, _ in launched), "MMA kernel used"
    assert M <= shapes.GEMV_ROWS and isinstance(shapes.fwd_config(M, 32, 64), shapes.GemvConfig)
    assert not isinstance(shapes.fwd_config(shapes.GEMV_ROWS + 1, 32, 64), shapes.GemvConfig)
    assert gemm.route(M, 32, 64, x.device, False) == "gemv"


@pytest.mark.parametrize("M,K,padded", [(1, 64, False), (1, 48, True), (3, 64, False), (3, 48, True)])
def test_a_padded_launch_runs_without_pdl(M, K, padded, monkeypatch):
    """The GEMV and the tiles load W (and, folding an update, x) before their PDL wait; where K needs
    a pad, the pad writes what they read just before them, so that launch goes without PDL (a plain
    stream-ordered launch). PDL is stood in for here (the interpreter has none): the launch keywords
    are recorded, then the kernel runs without it."""
    from kernels import launch
    seen = []
    monkeypatch.setattr(launch, "pdl_launch", lambda device: dict(USE_PDL=True, launch_pdl=True))
    for name in ("_nvfp4_gemv_kernel", "_nvfp4_mm_kernel"):
        kernel = getattr(gemm, name)

        class Spy:
            def __getitem__(self, grid, kernel=kernel):
                def run(*args, **kw):
                    seen.append(kw["USE_PDL"])
                    return kernel[grid](*args, **dict(kw, **launch.NO_PDL))
                return run
        monkeypatch.setattr(gemm, name, Spy())
    gen = torch.Generator().manual_seed(M + K)
    packed, scale, gs = random_weight(32, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    assert_close(kernels.nvfp4_matmul(x, packed, scale, gs), reference_matmul(x, packed, scale, gs), f"M={M} K={K}")
    assert seen == [not padded], seen


@pytest.mark.parametrize("M,K,fragment", [(2, 128, True), (8, 256, True), (16, 128, True), (4, 192, False),
                                         (2, 192, False), (17, 128, False)])
def test_wrapper_routes_small_m_to_fragment_kernel(M, K, fragment, monkeypatch):
    """nvfp4_matmul runs the fragment kernel for 1 < M <= FRAGMENT_MAX_M when K is a multiple of
    128, and the swapped tile kernel otherwise."""
    launched = []
    mma, mm = gemm._nvfp4_mma_kernel, gemm._nvfp4_mm_kernel
    monkeypatch.setattr(gemm, "_nvfp4_mma_kernel", LaunchSpy(mma, launched))
    monkeypatch.setattr(gemm, "_nvfp4_mm_kernel", LaunchSpy(mm, launched))
    gen = torch.Generator().manual_seed(M + K)
    packed, scale, gs = random_weight(32, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    assert_close(kernels.nvfp4_matmul(x, packed, scale, gs), reference_matmul(x, packed, scale, gs), f"M={M}")
    used = {k for k, _ in launched}
    assert used == {mma if fragment else mm}, used
    assert gemm.route(M, 32, K, x.device, False) == ("fragment" if fragment else "tiles")
    assert shapes.GEMV_ROWS == 1 and shapes.FRAGMENT_MAX_M == 16


@pytest.mark.parametrize("M,swapped", [(64, True), (65, False), (97, False)])
def test_wrapper_routes_medium_m_to_unswapped_kernel(M, swapped, monkeypatch):
    """nvfp4_matmul runs the MMA kernel with SWAP_AB=False (tuning's medium tiles) exactly for 64 < M,
    up to where dequantize + cuBLAS takes over; M <= 64 stays swapped."""
    launched = []
    monkeypatch.setattr(gemm, "_nvfp4_mm_kernel", LaunchSpy(gemm._nvfp4_mm_kernel, launched))
    gen = torch.Generator().manual_seed(M)
    packed, scale, gs = random_weight(16, 64, gen)
    x = torch.randn(M, 64, generator=gen).bfloat16().to(DEV)
    assert_close(kernels.nvfp4_matmul(x, packed, scale, gs), reference_matmul(x, packed, scale, gs), f"M={M}")
    mm = [kw for k, kw in launched if k is gemm._nvfp4_mm_kernel.kernel]
    t = tuning.current()
    assert len(mm) == 1 and mm[0]["SWAP_AB"] == swapped, f"launches: {mm}"
    assert mm[0]["BM"] == (64 if swapped else t.medium.bm)
    for m in (65, 128, 256, t.dequant_min_m - 1):       # a 7B gate_up-sized weight: never dequantized
        assert not gemm.use_dequant(m, 37888, 3584) and shapes.fwd_config(m, 37888, 3584) == t.medium
    assert gemm.use_dequant(t.dequant_min_m, 37888, 3584)


def test_routes_on_this_device_follow_the_table():
    """Without the register-A kernel (CPU, the plain layout): the GEMV at M = 1, the fragment kernel
    to 16 (K % 128 == 0), the tiles, and dequantize + cuBLAS from dequant_min_m (from
    dequant_narrow_min_m on narrow weights); dx: tiles, then dequantize + cuBLAS (above 256 on big
    weights already)."""
    cpu = torch.device("cpu")
    t = tuning.current()
    fwd = {M: gemm.route(M, 37888, 3584, cpu, False) for M in (1, 2, 16, 17, 511, 512)}
    assert fwd == {1: "gemv", 2: "fragment", 16: "fragment", 17: "tiles", 511: "tiles", 512: "dequant+cublas"}
    assert [gemm.route(M, 4608, 3584, cpu, False) for M in (127, 128)] == ["tiles", "dequant+cublas"]
    assert [gemm.route(M, 7168, 5120, cpu, False, dx=True) for M in (256, 257, 512)] == [
        "tiles", "dequant+cublas", "dequant+cublas"]
    assert t.dequant_min_m == 512 and t.dequant_narrow_min_m == 128


def test_nvfp4_matmul_on_nvfp4_quantize_weights():
    """The kernels read the format the way nvfp4.py writes it: y on nvfp4.quantize's bytes against
    float64 with nvfp4.dequantize's W."""
    import nvfp4
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(32, 64, generator=gen)
    packed, scale, gs = nvfp4.quantize(w)
    theirs = nvfp4.dequantize(packed, scale, gs, dtype=torch.float64)
    x = torch.randn(3, 64, generator=gen).bfloat16().to(DEV)
    y = kernels.nvfp4_matmul(x, packed.to(DEV), scale.to(DEV), gs.to(DEV))
    assert_close(y, x.double() @ theirs.to(DEV).t(), "fwd on nvfp4.quantize weights")


# ----------------------------------------------------------------------------------------------
# bad input

def test_bad_inputs_raise_clear_errors():
    gen = torch.Generator().manual_seed(0)
    packed, scale, gs = random_weight(32, 64, gen)
    x = torch.randn(2, 64).bfloat16().to(DEV)
    with pytest.raises(TypeError, match="bfloat16"):
        kernels.nvfp4_matmul(x.float(), packed, scale, gs)
    with pytest.raises(TypeError, match="uint8"):
        kernels.nvfp4_matmul(x, packed.to(torch.int8), scale, gs)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        kernels.nvfp4_matmul(x, packed, scale.float(), gs)
    with pytest.raises(TypeError, match="global_scale"):
        kernels.nvfp4_matmul(x, packed, scale, gs.double())
    with pytest.raises(ValueError, match="columns"):
        kernels.nvfp4_matmul(torch.randn(2, 48).bfloat16().to(DEV), packed, scale, gs)
    with pytest.raises(ValueError, match="2-D"):
        kernels.nvfp4_matmul(x[None], packed, scale, gs)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.nvfp4_matmul(torch.randn(64, 2).bfloat16().to(DEV).t(), packed, scale, gs)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.nvfp4_matmul(x, packed.t().contiguous().t(), scale, gs)
    with pytest.raises(ValueError, match="multiples of 16"):
        kernels.nvfp4_matmul(torch.randn(2, 56).bfloat16().to(DEV), packed[:, :28], scale[:, :3], gs)
    with pytest.raises(ValueError, match="multiples of 16"):
        kernels.nvfp4_matmul(x, packed[:24], scale[:24], gs)
    with pytest.raises(ValueError, match="scale must have shape"):
        kernels.nvfp4_matmul(x, packed, scale[:, :2].contiguous(), gs)
    with pytest.raises(ValueError, match="bias"):
        kernels.nvfp4_matmul(x, packed, scale, gs, torch.randn(31).bfloat16().to(DEV))
    with pytest.raises(ValueError, match="columns"):
        kernels.nvfp4_matmul_dx(torch.randn(2, 64).bfloat16().to(DEV), packed, scale, gs)
    with pytest.raises(ValueError, match="TileConfig.bk"):
        shapes.TileConfig(16, 16, 24)
    with pytest.raises(ValueError, match="GemvConfig.bn/bk"):
        shapes.GemvConfig(bk=48)


def test_fragment_kernel_refuses_what_it_cannot_do():
    gen = torch.Generator().manual_seed(0)
    packed, scale, gs = random_weight(16, 128, gen)
    with pytest.raises(ValueError, match="M <= 16"):
        gemm._mma(torch.zeros(17, 128, dtype=torch.bfloat16, device=DEV), packed, scale, gs, None, shapes.MmaConfig())
    packed, scale, gs = random_weight(16, 64, gen)
    with pytest.raises(ValueError, match="multiple of 128"):
        gemm._mma(torch.zeros(2, 64, dtype=torch.bfloat16, device=DEV), packed, scale, gs, None, shapes.MmaConfig())
    with pytest.raises(ValueError, match="MmaConfig"):
        shapes.MmaConfig(tiles=3)


def test_gemv_takes_one_row_only():
    """The CUDA-core kernel is written for one row of x: more is a clear error, not a wrong y."""
    gen = torch.Generator().manual_seed(1)
    packed, scale, gs = random_weight(32, 64, gen)
    with pytest.raises(ValueError, match="one row"):
        gemm._gemv(torch.zeros(2, 64, dtype=torch.bfloat16, device=DEV), packed, scale, gs, None, shapes.GemvConfig())


# ----------------------------------------------------------------------------------------------
# the interleaved layout

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
        y = kernels.nvfp4_matmul(x, pi, si, gs, interleaved=True)
        assert torch.equal(y, kernels.nvfp4_matmul(x, packed, scale, gs)), f"fwd M={M}"
        assert_close(y, reference_matmul(x, packed, scale, gs), f"fwd M={M}")
        dy = torch.randn(M, N, generator=gen).bfloat16().to(DEV)
        assert torch.equal(kernels.nvfp4_matmul_dx(dy, pi, si, gs, interleaved=True),
                           kernels.nvfp4_matmul_dx(dy, packed, scale, gs)), f"dx M={M}"
    with pytest.raises(ValueError, match="multiple of 128"):
        p2, s2, g2 = random_weight(16, 192, gen)
        kernels.nvfp4_matmul(torch.zeros(1, 192, dtype=torch.bfloat16, device=DEV), p2, s2, g2, interleaved=True)


# ----------------------------------------------------------------------------------------------
# GPU: real shapes (Qwen2.5-7B / 32B projections)

@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4608, 3584), (3584, 18944), (55296, 5120), (5120, 27648)])
@pytest.mark.parametrize("M", [1, 7, 16, 33, 100, 256, 1000])
def test_real_shapes_gpu(N, K, M, poisoned):
    from marlin_kernel import reference_dequantize
    gen = torch.Generator().manual_seed(N + K + M)
    packed, scale, gs = random_weight(N, K, gen)
    W = reference_dequantize(packed, scale, gs)
    x = torch.randn(M, K, generator=gen).bfloat16().cuda()
    bias = torch.randn(N, generator=gen).bfloat16().cuda()
    assert_close(kernels.nvfp4_matmul(x, packed, scale, gs, bias), x.double() @ W.t() + bias.double(),
                 f"fwd {N}x{K} M={M}")
    dy = torch.randn(M, N, generator=gen).bfloat16().cuda()
    assert_close(kernels.nvfp4_matmul_dx(dy, packed, scale, gs), dy.double() @ W, f"dx {N}x{K} M={M}")


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4608, 3584), (37888, 3584), (3584, 18944), (5120, 27648)])
def test_interleaved_weights_real_shapes_gpu(N, K, poisoned):
    """The same on the real projection shapes (the routes' launch shapes differ there: 128-row
    fragment programs for the wide weights, split-K sums in-kernel and by the reduce kernel). Where
    the register-A wgmma kernel or the TMA-fed GEMV takes the interleaved weight (they read no other
    layout; their sums run in another order) the bits differ: there both are checked against float64."""
    import nvfp4
    gen = torch.Generator().manual_seed(N + K)
    packed, scale, gs = random_weight(N, K, gen, "cuda")
    pi, si = nvfp4.interleave(packed, scale)
    for M in (1, 2, 4, 8, 9, 16, 64, 128):
        x = torch.randn(M, K, generator=gen).bfloat16().cuda()
        y, y_plain = kernels.nvfp4_matmul(x, pi, si, gs, interleaved=True), kernels.nvfp4_matmul(x, packed, scale, gs)
        if gemm.route(M, N, K, x.device, True) == "wgmma" or (M == 1 and gemm.gemv_tma_takes(N, K, x.device, True)):
            ref = reference_matmul(x, packed, scale, gs)
            assert_close(y, ref, f"M={M}")
            assert_close(y_plain, ref, f"plain M={M}")
        else:
            assert torch.equal(y, y_plain), M
