"""Tests for kernels/register_a.py and register_a_dx.py: the register-A wgmma kernels (Gluon,
sm_90 + triton 3.6 only), the permutation of x they need, and their routes.

The kernels themselves cannot run in the interpreter, so they are tested on the GPU: against float64
(marlin_kernel.reference_matmul) at odd M, N at its minimum (16) and real shapes, every token tile,
split-K through the reduce kernel, bias on and off, poisoned buffers (conftest). On the CPU the
permutation of x is checked against the map derived independently below, from the facts it rests
on: the interleaved bytes, the decode's output order and the PTX ISA's wgmma register fragment; and
the routes (gemm.wgmma_rows, gemm.dx_wgmma_rows) on a pretend sm_90. Their launch arithmetic:
test_kernels_shapes.py.
"""
import dataclasses

import pytest
import torch

from kernels import gemm, launch, shapes, tuning
from kernels import register_a as rak
from kernels.shapes import WgmmaConfig
from marlin_kernel import reference_dequantize, reference_matmul
from nvfp4_cases import DEV, LaunchSpy, assert_close, random_weight


def operand_column_to_k():
    """For a 128-k window: which k the wgmma operand's column c holds, derived step by step.
    Lane t of a quad loads words 4t .. 4t+3 of a row; word 4t + j, byte b, nibble p0 (even k in the
    low nibble) holds k = 8(4t + j) + 2b + p0. The decode PTX writes its 8 values as bf16 pairs
    (lo b0, lo b1), (hi b0, hi b1), (lo b2, lo b3), (hi b2, hi b3): value v = 4(b // 2) + 2 p0 + b % 2.
    wgmma's A fragment (PTX ISA, m64nNk16, .bf16 from registers): in lane t, for the 16-k step s, the
    registers hold columns 16s + 2t, 16s + 2t + 1, then 16s + 2t + 8, 16s + 2t + 9; a lane's 32 values
    per row over the 8 steps of a window, in order, are (s, half, elem) -> 16s + 8·half + 2t + elem.
    The kernel hands value v of word j over as the lane's value 8j + v."""
    col_to_k = [None] * 128
    for t in range(4):
        for j in range(4):
            for b in range(4):
                for p0 in range(2):
                    r = 8 * j + 4 * (b // 2) + 2 * p0 + b % 2           # = 4s + 2·half + elem
                    col_to_k[16 * (r // 4) + 8 * (r // 2 % 2) + 2 * t + r % 2] = 8 * (4 * t + j) + 2 * b + p0
    assert sorted(col_to_k) == list(range(128))
    return col_to_k


def test_fragment_order_index_is_the_operand_map():
    K = 384
    idx = rak.fragment_order_index(K)
    expect = torch.tensor([128 * w + k for w in range(K // 128) for k in operand_column_to_k()])
    assert torch.equal(idx, expect)


def dx_operand_column_to_n():
    """For register_a_dx's 128-n window: which n the wgmma operand's column c holds, derived from its
    docstring's facts. Half window h (64 n) is 4 wgmma steps of 16 k; lane t holds, in step s,
    columns 16s + 2t, 16s + 2t + 1, 16s + 2t + 8, 16s + 2t + 9 (PTX ISA fragment); the kernel hands it
    the quads a, b, c, d of rows 64h + 16t + 4q + (0, 2, 1, 3), quad q = 2·j0 + p1 for step s = 4h + q
    (the quads in the order the lane's rows run: j0 above p1)."""
    col_to_n = [None] * 128
    for h in range(2):
        for t in range(4):
            for q in range(4):
                s = 4 * h + q
                for col, off in zip((2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9), (0, 2, 1, 3)):
                    col_to_n[16 * s + col] = 64 * h + 16 * t + 4 * q + off
    assert sorted(col_to_n) == list(range(128))
    return col_to_n


def test_fragment_order_index_dx_is_the_dx_operand_map():
    K = 384
    expect = torch.tensor([128 * w + n for w in range(K // 128) for n in dx_operand_column_to_n()])
    assert torch.equal(rak.fragment_order_index(K, dx=True), expect)


@pytest.mark.parametrize("M,K,rows", [(1, 128, 0), (3, 384, 0), (17, 256, 0), (40, 640, 0), (3, 256, 8),
                                      (33, 384, 64)])
@pytest.mark.parametrize("dx", [False, True])
def test_fragment_order_kernel_permutes_x(M, K, rows, dx, poisoned):
    """The one-pass kernel gives x[:, fragment_order_index(K)] (bits), every element written, and
    zeros in the rows it pads to (the warp-specialized kernels' whole token tiles); dx: the dx
    kernel's order."""
    x = torch.randn(M, K).bfloat16().to(DEV)
    xp = rak.fragment_order(x, launch.NO_PDL, rows, dx=dx)
    assert xp.shape == (max(M, rows), K)
    assert torch.equal(xp[:M], x[:, rak.fragment_order_index(K, x.device, dx=dx)])
    assert not xp[M:].any()


def _runs_here():
    return torch.cuda.is_available() and gemm.wgmma_rows(64, 37888, 3584, torch.device("cuda"), True)


gluon_gpu = pytest.mark.skipif(not _runs_here(), reason="the Gluon kernel needs sm_90 and triton 3.6")


def test_wgmma_route():
    """The route's conditions: 16 < M <= 1024 (on weights of <= 20M elements to 128, and above 512;
    above 512 where one launch's waves are >= 60% full: 7B qkv's 36 x 4 programs at M = 769..1024 are
    not, 144 on 132 SMs; or, on the big weights, where a second launch takes a part-empty wave's
    rows: 32B o at M = 769..1024), and from M = 2 on the big ones (wide, N >= 16384, and the others:
    tuning's wgmma_small_min_m); interleaved, sm_90 with triton 3.6; never on the CPU or under the interpreter."""
    big, down, qkv, o, o32 = (37888, 3584), (3584, 18944), (4608, 3584), (3584, 3584), (5120, 5120)
    assert not gemm.wgmma_rows(64, *big, torch.device("cpu"), True)
    if _runs_here():
        dev = torch.device("cuda")
        assert [M for M in range(1, 1100) if gemm.wgmma_rows(M, *big, dev, True)] == list(range(2, 1025))
        if launch.num_sms(dev) == 132:
            assert [M for M in range(1, 1100) if gemm.wgmma_rows(M, *down, dev, True)] == list(range(2, 1025))
            assert [M for M in range(1, 1100) if gemm.wgmma_rows(M, *qkv, dev, True)] == list(range(17, 129)) + list(
                range(513, 769))
            assert [M for M in range(1, 1100) if gemm.wgmma_rows(M, *o, dev, True)] == list(range(17, 129)) + list(
                range(513, 1025))
            assert [M for M in range(1, 1100) if gemm.wgmma_rows(M, *o32, dev, True)] == list(range(2, 1025))
        assert [M for M in range(1, 300) if gemm.wgmma_rows(M, *qkv, dev, True)] == list(range(17, 129))
        assert not gemm.wgmma_rows(64, *big, dev, False)               # the plain layout


def test_wgmma_route_on_a_pretend_h100(monkeypatch):
    """The same route on a pretend sm_90 of 132 SMs, so the CPU checks it too: the rows above, and a
    moved wgmma_small_min_m moves where down starts."""
    monkeypatch.setattr(gemm, "gluon_runs", lambda device, interleaved: interleaved)
    monkeypatch.setattr(launch, "num_sms", lambda device: 132)
    dev = torch.device("cuda")
    rows = lambda N, K: [M for M in range(1, 1100) if gemm.wgmma_rows(M, N, K, dev, True)]  # noqa: E731
    assert rows(37888, 3584) == list(range(2, 1025))
    assert rows(3584, 18944) == list(range(2, 1025))
    assert rows(4608, 3584) == list(range(17, 129)) + list(range(513, 769))
    assert rows(3584, 3584) == list(range(17, 129)) + list(range(513, 1025))
    assert rows(5120, 5120) == list(range(2, 1025))
    with tuning.using(dataclasses.replace(tuning.current(), wgmma_small_min_m=12)):
        assert rows(3584, 18944) == list(range(13, 1025))
    assert [gemm.route(M, 3584, 18944, dev, True) for M in (1, 2, 8)] == ["gemv", "wgmma", "wgmma"]
    with tuning.using(dataclasses.replace(tuning.current(), wgmma_small_min_m=8)):
        assert [gemm.route(M, 3584, 18944, dev, True) for M in (1, 8, 9)] == ["gemv", "fragment", "wgmma"]


@pytest.mark.gpu
@gluon_gpu
@pytest.mark.parametrize("M,N,K,bt,split", [(17, 16, 128, 32, 1), (33, 48, 384, 64, 1), (100, 80, 256, 128, 2),
                                            (130, 16, 1280, 128, 3), (64, 208, 2048, 64, 0), (5, 64, 128, 16, 1),
                                            (1, 16, 128, 8, 1), (7, 80, 640, 8, 2), (13, 48, 1024, 16, 0)])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("kernel", ["ring", "ws"])
def test_wgmma_kernel_matches_float64_gpu(M, N, K, bt, split, has_bias, kernel, poisoned):
    """_wgmma called directly (any shape), each of the two kernels at every token tile: tiny and odd
    N (rows past N: wrapped by the ring kernel, zero-filled by TMA), odd M (masked tokens), one
    window, splits of unequal length, bias; y against float64."""
    import nvfp4
    gen = torch.Generator().manual_seed(M * N + K + split)
    packed, scale, gs = random_weight(N, K, gen, "cuda")
    x = torch.randn(M, K, generator=gen).bfloat16().cuda()
    bias = torch.randn(N, generator=gen).bfloat16().cuda() if has_bias else None
    with tuning.using(dataclasses.replace(tuning.current(), ws_min_bt=8 if kernel == "ws" else 256)):
        y = gemm._wgmma(x, *nvfp4.interleave(packed, scale), gs, bias,
                        WgmmaConfig(bt=bt, split=split, stages=4 if bt <= 16 else 3))
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    e = assert_close(y, reference_matmul(x, packed, scale, gs, bias), f"M={M} N={N} K={K} split={split}")
    assert e < 4e-3, e


@pytest.mark.gpu
@gluon_gpu
@pytest.mark.parametrize("bt,M", [(8, 100), (64, 100), (128, 100), (256, 100), (256, 300)])
def test_wgmma_kernel_eight_warps_gpu(bt, M, poisoned):
    """128 weight rows a program (bt < 64: one 8-warp partition of the ring kernel; from 64 the
    warp-specialized kernel's two consumer warpgroups of 64 rows each, MAX_REGS[8]) against float64,
    N not a multiple of 128 (the last tile's second consumer reads rows past N), split-K chosen."""
    import nvfp4
    gen = torch.Generator().manual_seed(bt + M)
    packed, scale, gs = random_weight(208, 1024, gen, "cuda")
    x = torch.randn(M, 1024, generator=gen).bfloat16().cuda()
    y = gemm._wgmma(x, *nvfp4.interleave(packed, scale), gs, None, WgmmaConfig(bt=bt, bn=128, warps=8))
    e = assert_close(y, reference_matmul(x, packed, scale, gs, None), f"bt={bt} M={M}")
    assert e < 4e-3, e


@pytest.mark.gpu
@gluon_gpu
@pytest.mark.parametrize("N,K", [(37888, 3584), (3584, 18944), (55296, 5120), (4608, 3584), (5120, 27648)])
@pytest.mark.parametrize("M", [2, 9, 16, 17, 64, 100, 256, 300, 600, 1024])
def test_wgmma_route_real_shapes_gpu(N, K, M, poisoned, monkeypatch):
    """nvfp4_matmul on interleaved real weights launches the wgmma kernel where the route says so
    (and then nothing else but the x permutation and, split, the reduce) and matches float64."""
    import kernels
    import nvfp4
    launched, ring, ws = [], rak._wgmma_ring_kernel, rak._wgmma_ws_kernel
    monkeypatch.setattr(rak, "_wgmma_ring_kernel", LaunchSpy(ring, launched))
    monkeypatch.setattr(rak, "_wgmma_ws_kernel", LaunchSpy(ws, launched))
    monkeypatch.setattr(gemm, "_nvfp4_mm_kernel", LaunchSpy(gemm._nvfp4_mm_kernel, launched))
    gen = torch.Generator().manual_seed(N + K + M)
    packed, scale, gs = random_weight(N, K, gen, "cuda")
    x = torch.randn(M, K, generator=gen).bfloat16().cuda()
    bias = torch.randn(N, generator=gen).bfloat16().cuda()
    y = kernels.nvfp4_matmul(x, *nvfp4.interleave(packed, scale), gs, bias, interleaved=True)
    routed = gemm.route(M, N, K, x.device, True) == "wgmma"
    cfg = shapes.wgmma_config(M)
    launches = len(shapes.wgmma_launches(M, N, K, cfg, x.device))
    kernel = ws if shapes.warp_specialized(cfg) else ring
    assert [k for k, _ in launched] == ([kernel] * launches if routed else []), routed
    assert_close(y, reference_matmul(x, packed, scale, gs, bias), f"{N}x{K} M={M}")


B256 = WgmmaConfig(bt=256, bn=128, warps=8)
TAIL = shapes.tail_config()


@pytest.mark.gpu
@gluon_gpu
@pytest.mark.parametrize("cfg,sms,M,N,K,plan", [
    (B256, 4, 200, 592, 1024, [(B256, 0, 4, 1, 8), (TAIL, 8, 2, 1, 8)]),
    (WgmmaConfig(bt=128), 2, 100, 336, 1024, [(WgmmaConfig(bt=128), 0, 4, 1, 8), (TAIL, 4, 2, 1, 8)]),
    (B256, 4, 200, 592, 8192, [(B256, 0, 4, 1, 64), (B256, 4, 1, 2, 32)]),
    (B256, 3, 300, 208, 1024, [(B256, 0, 2, 1, 8)])])
@pytest.mark.parametrize("has_bias", [False, True])
def test_wgmma_tail_launches_gpu(cfg, sms, M, N, K, plan, has_bias, poisoned, monkeypatch):
    """Where the tiles fill whole waves and part of one, the weight rows of the whole waves run in
    cfg's tiles and the rest in a second launch, of smaller tiles or (long K) split along K with the
    pieces summed in the launch (on a pretend GPU of a few SMs, so that small shapes have waves; N
    not a multiple of 64: the last tile reads rows past N): y against float64, and the same bits on
    a second call (the split counts are left at zero)."""
    import nvfp4
    monkeypatch.setattr(launch, "num_sms", lambda device: sms)
    assert shapes.wgmma_launches(M, N, K, cfg, torch.device("cuda")) == plan
    gen = torch.Generator().manual_seed(M + N + sms + K)
    packed, scale, gs = random_weight(N, K, gen, "cuda")
    x = torch.randn(M, K, generator=gen).bfloat16().cuda()
    bias = torch.randn(N, generator=gen).bfloat16().cuda() if has_bias else None
    w = nvfp4.interleave(packed, scale)
    y = gemm._wgmma(x, *w, gs, bias, cfg)
    e = assert_close(y, reference_matmul(x, packed, scale, gs, bias), f"sms={sms} M={M} N={N} K={K}")
    assert torch.equal(gemm._wgmma(x, *w, gs, bias, cfg), y)
    assert e < 4e-3, e


def test_wgmma_tail_plans_on_a_pretend_gpu(monkeypatch):
    """The launch plans of the tail test above, checked on the CPU too (pure launch arithmetic)."""
    b128 = WgmmaConfig(bt=128)
    for cfg, sms, M, N, K, plan in ((B256, 4, 200, 592, 1024, [(B256, 0, 4, 1, 8), (TAIL, 8, 2, 1, 8)]),
                                    (b128, 2, 100, 336, 1024, [(b128, 0, 4, 1, 8), (TAIL, 4, 2, 1, 8)]),
                                    (B256, 4, 200, 592, 8192, [(B256, 0, 4, 1, 64), (B256, 4, 1, 2, 32)]),
                                    (B256, 3, 300, 208, 1024, [(B256, 0, 2, 1, 8)])):
        monkeypatch.setattr(launch, "num_sms", lambda device, sms=sms: sms)
        assert shapes.wgmma_launches(M, N, K, cfg, torch.device("cpu")) == plan


def test_dx_route(monkeypatch):
    """dx by the register-A kernel on Wᵀ: the big weights at 64 < M <= 256, and those of > 64M
    elements to 512 where its programs fill >= 80% of their waves (132 SMs: 7B gate_up and 32B down
    to 512, 7B down to 384: 222 programs at M = 385..512, 74% full); never the small weights, the
    plain layout, N or K off 128, the CPU; dequantize + cuBLAS on the big weights above 256 where
    the kernel does not run."""
    big, down, qkv, o = (37888, 3584), (3584, 18944), (4608, 3584), (3584, 3584)
    assert not gemm.dx_wgmma_rows(128, *big, torch.device("cpu"), True)
    monkeypatch.setattr(gemm, "gluon_runs", lambda device, interleaved: interleaved)
    monkeypatch.setattr(launch, "num_sms", lambda device: 132)
    dev = torch.device("cuda")
    routed = lambda N, K: [M for M in range(1, 1100) if gemm.dx_wgmma_rows(M, N, K, dev, True)]  # noqa: E731
    assert routed(*big) == list(range(65, 513))
    assert routed(*down) == list(range(65, 385))
    assert routed(7168, 5120) == routed(5120, 5120) == list(range(65, 257))
    assert routed(5120, 27648) == list(range(65, 513))
    assert routed(*qkv) == routed(*o) == []
    assert [gemm.route(M, 7168, 5120, dev, True, dx=True) for M in (64, 65, 256, 257, 511, 512)] == [
        "tiles", "wgmma", "wgmma", "dequant+cublas", "dequant+cublas", "dequant+cublas"]
    assert [gemm.route(M, *qkv, dev, True, dx=True) for M in (127, 128, 300)] == [
        "tiles", "dequant+cublas", "dequant+cublas"]
    assert not gemm.dx_wgmma_rows(128, *big, dev, False)
    assert not gemm.dx_wgmma_rows(128, 37888 + 16, 3584, dev, True)


@pytest.mark.gpu
@gluon_gpu
@pytest.mark.parametrize("M,N,K,split", [(1, 128, 256, 1), (77, 256, 128, 1), (128, 128, 256, 1), (300, 384, 640, 1),
                                         (257, 1280, 1152, 0), (77, 1280, 384, 3), (130, 1664, 640, 4),
                                         (1, 512, 128, 2), (256, 37888, 3584, 0), (1024, 3584, 3584, 0)])
def test_dx_kernel_matches_float64_gpu(M, N, K, split, poisoned):
    """_wgmma_dx called directly: odd M (masked tokens), K past the last 256-column tile (the second
    consumer's window outside W), splits of unequal length (the reduce kernel), real shapes; dx
    against float64."""
    import nvfp4
    gen = torch.Generator().manual_seed(M * N + K + split)
    packed, scale, gs = random_weight(N, K, gen, "cuda")
    dy = torch.randn(M, N, generator=gen).bfloat16().cuda()
    dx = gemm._wgmma_dx(dy, *nvfp4.interleave(packed, scale), gs, split)
    assert dx.shape == (M, K) and dx.dtype == torch.bfloat16
    ref = dy.double() @ reference_dequantize(packed, scale, gs)
    e = assert_close(dx, ref, f"M={M} N={N} K={K} split={split}")
    assert e < 4e-3, e
