"""Tests for small_m_kernels.py: the CUDA-core GEMV (M <= 4) and the mma.sync fragment kernel
(M <= 16, K a multiple of 128), run through marlin_kernel's _gemv / _mma with a given GemvConfig /
MmaConfig, against the float64 reference marlin_kernel.reference_matmul (plain torch), on buffers
poisoned with NaN (conftest's `poisoned`).

On the CPU the interpreter runs tiny shapes, the fragment kernel's PTX replaced by its plain-fp32
emulation (so the index maps are checked); the `gpu` test runs the PTX on the real Qwen2.5 projection
shapes. Split-K summed inside the kernel (fp4_decode._last_split / _sum_splits) must give the bits
of the separate reduce kernel. Exact decoding of every code: test_fp4_decode.py; the wrappers'
routing to these kernels: test_marlin_kernel.py.
"""
import pytest
import torch

import marlin_kernel as mk
from test_marlin_kernel import DEV, LaunchSpy, assert_close, check_forward, random_weight


# ----------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU: small shapes

@pytest.mark.parametrize("path,M,N,K,cfg", [
    ("tile", 5, 144, 512, mk.TileConfig(bm=16, bn=64, bk=64, warps=4, stages=2, split=3)),
    ("tile", 16, 200, 1024, mk.TileConfig(bm=16, bn=64, bk=64, warps=4, stages=2, split=8)),
    ("tile", 33, 64, 256, mk.TileConfig(bm=16, bn=64, bk=64, warps=4, stages=2, split=2)),
    ("gemv", 1, 48, 1056, mk.GemvConfig(bn=16, bk=64, split=3)),
    ("gemv", 2, 64, 512, mk.GemvConfig(bn=32, bk=64, split=4)),
    ("fragment", 3, 80, 512, mk.MmaConfig(warps=1, split=2)),
    ("fragment", 4, 64, 384, mk.MmaConfig(warps=2, tiles=2, split=3)),
    ("fragment", 7, 48, 640, mk.MmaConfig(warps=2, split=2, windows=2))])    # M <= 8: two windows a step
def test_in_kernel_split_reduce_equals_the_reduce_kernel(path, M, N, K, cfg, monkeypatch, poisoned):
    """Split-K summed by each tile's last split (atomic counts) gives the bits of the separate reduce
    kernel (same order of the partials), on the CUDA-core, fragment (M <= 4, or <= 8 at two windows
    a step) and swapped tile kernels, for several tiles and splits, and leaves the counts at zero."""
    run = {"gemv": mk._gemv, "fragment": mk._mma, "tile": mk._matmul}[path]
    name = {"gemv": "_nvfp4_gemv_kernel", "fragment": "_nvfp4_mma_kernel", "tile": "_nvfp4_mm_kernel"}[path]
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


@pytest.mark.parametrize("M,N,K,R,cfg", [
    (1, 48, 1056, 24, mk.GemvConfig(bn=16, bk=64, split=3)),    # the last split adds the update
    (2, 64, 512, 16, mk.GemvConfig(bn=32, bk=64, split=1)),     # one pass: every program adds it
    (2, 32, 272, 40, mk.GemvConfig()),
    (9, 144, 512, 24, mk.TileConfig(bm=16, bn=64, bk=64, warps=4, stages=2, split=3)),   # swapped tiles
    (16, 64, 256, 96, mk.TileConfig(bm=16, bn=64, bk=64, warps=4, stages=2, split=1))])
@pytest.mark.parametrize("has_bias", [False, True])
def test_kernels_fold_the_lora_update(M, N, K, R, cfg, has_bias, poisoned):
    """nvfp4_matmul's lora = (hp, B, s): the GEMV and the swapped tiles (folds_lora's routes) add
    s · bf16(Σ_j hp[j]) · Bᵀ to the rows they finish. Against float64 (the base, plus the update
    with h rounded to bf16 as the expand kernel rounds it), and element by element against the
    kernel's own base output plus the float64 update: one bf16 rounding of the sum (what
    lora_kernels.lora_expand_ does to a stored y), at most half a unit in the last place."""
    gen = torch.Generator().manual_seed(M + N + K + R + has_bias)
    packed, scale, gs = random_weight(N, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    bias = torch.randn(N, generator=gen).bfloat16().to(DEV) if has_bias else None
    hp = torch.randn(3, M, R, generator=gen).to(DEV)                     # three K-chunk partials
    B = (torch.randn(N, R, generator=gen) * 0.2).bfloat16().to(DEV)
    run = mk._gemv if isinstance(cfg, mk.GemvConfig) else mk._matmul
    got = run(x, packed, scale, gs, bias, cfg, (hp, B, 0.75))
    h = (hp[0] + hp[1] + hp[2]).bfloat16().double()
    want = mk.reference_matmul(x, packed, scale, gs, bias) + 0.75 * h @ B.double().t()
    assert_close(got, want, f"gemv + lora M={M} N={N} K={K} R={R} {cfg}")
    exact = run(x, packed, scale, gs, bias, cfg).double() + 0.75 * h @ B.double().t()
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()


def test_lora_update_only_where_it_folds(monkeypatch):
    """nvfp4_matmul takes a LoRA update only where folds_lora holds (the GEMV's and the swapped
    tiles' rows, partials summed in-kernel) and only well-formed: a clear error otherwise, never a
    silent unfolded result."""
    gen = torch.Generator().manual_seed(3)
    packed, scale, gs = random_weight(32, 64, gen)
    hp, B = torch.zeros(1, 1, 8, device=DEV), torch.zeros(32, 8, dtype=torch.bfloat16, device=DEV)
    x1 = torch.randn(1, 64, generator=gen).bfloat16().to(DEV)
    assert [m for m in range(1, 17) if mk.folds_lora(m, 128)] == [1]      # 2..16: the fragment kernel
    assert all(mk.folds_lora(m, 64) for m in range(1, 17)) and not mk.folds_lora(17, 64)
    with pytest.raises(ValueError, match="folds_lora"):
        p128, s128, g128 = random_weight(32, 128, gen)
        x3 = torch.randn(3, 128).bfloat16().to(DEV)
        mk.nvfp4_matmul(x3, p128, s128, g128, lora=(torch.zeros(1, 3, 8, device=DEV), B, 1.0))
    with pytest.raises(ValueError, match="fp32"):
        mk.nvfp4_matmul(x1, packed, scale, gs, lora=(hp.bfloat16(), B, 1.0))
    with pytest.raises(ValueError, match="B must be"):
        mk.nvfp4_matmul(x1, packed, scale, gs, lora=(hp, B[:16], 1.0))
    with pytest.raises(ValueError, match="reduce_folds_lora"):     # the h form: the register-A route only
        mk.nvfp4_matmul(x1, packed, scale, gs, lora=(hp[0].bfloat16(), B, 1.0))
    monkeypatch.setattr(mk, "REDUCE_IN_KERNEL", False)
    assert not mk.folds_lora(1, 64)
    with pytest.raises(ValueError, match="REDUCE_IN_KERNEL|folds_lora"):
        mk._gemv(x1, packed, scale, gs, None, mk.GemvConfig(bn=16, bk=32, split=2), (hp, B, 1.0))


@pytest.mark.parametrize("N,K,cfg,il", [
    (64, 1056, mk.GemvConfig(), False),                     # one program, a K tail
    (96, 512, mk.GemvConfig(bn=16, bk=64), False),          # 6 programs of 8 gate + 8 up rows
    (160, 384, mk.GemvConfig(bn=64, bk=128), True)])        # interleaved, I = 80: a part tile
@pytest.mark.parametrize("with_lora", [False, True])
def test_gemv_stores_silu_mul(N, K, cfg, il, with_lora, poisoned):
    """nvfp4_matmul's silu_mul at M = 1: W stacks gate and up (N = 2I), each GEMV program takes gate
    rows j and up rows I + j and stores silu(gate)·up (1, I). The bits of the plain GEMV followed by
    fused_ops.silu_mul_triton on its two halves (with a LoRA update folded in first, as the plain
    GEMV folds it), and float64 silu(g)·u within bf16 tolerance."""
    import nvfp4
    from fused_ops import silu_mul_triton
    gen = torch.Generator().manual_seed(N + K + with_lora)
    packed, scale, gs = random_weight(N, K, gen)
    x = torch.randn(1, K, generator=gen).bfloat16().to(DEV)
    hp, B = torch.randn(2, 1, 8, generator=gen).to(DEV), (torch.randn(N, 8, generator=gen) * 0.2).bfloat16().to(DEV)
    lora = (hp, B, 0.5) if with_lora else None
    w = nvfp4.interleave(packed, scale) if il else (packed, scale)
    got = mk._gemv(x, *w, gs, None, cfg, lora, il, silu_mul=True)
    y = mk._gemv(x, *w, gs, None, cfg, lora, il)                                          # (1, N)
    I = N // 2
    assert got.shape == (1, I) and torch.equal(got, silu_mul_triton(y[:, :I], y[:, I:]))
    ref = mk.reference_matmul(x, packed, scale, gs, None)
    if with_lora:
        ref = ref + 0.5 * (hp[0] + hp[1]).bfloat16().double() @ B.double().t()
    assert_close(got, torch.nn.functional.silu(ref[:, :I]) * ref[:, I:], f"silu_mul N={N} K={K} {cfg}")


def test_silu_mul_only_where_it_folds():
    """silu_mul runs on the GEMV's rows only (folds_silu: M <= GEMV_MAX_M) and on N = 2I with I a
    multiple of 16: a clear error otherwise, never a silent unfused result."""
    gen = torch.Generator().manual_seed(5)
    assert [m for m in range(1, 17) if mk.folds_silu(m)] == [1]
    packed, scale, gs = random_weight(64, 128, gen)
    with pytest.raises(ValueError, match="silu_mul"):
        mk.nvfp4_matmul(torch.randn(2, 128).bfloat16().to(DEV), packed, scale, gs, silu_mul=True)
    packed, scale, gs = random_weight(48, 128, gen)
    with pytest.raises(ValueError, match="silu_mul"):
        mk.nvfp4_matmul(torch.randn(1, 128).bfloat16().to(DEV), packed, scale, gs, silu_mul=True)


@pytest.mark.parametrize("M,N,K", [(1, 16, 128), (3, 48, 256), (8, 64, 384), (9, 80, 128), (16, 32, 256), (6, 16, 640)])
@pytest.mark.parametrize("cfg", [mk.MmaConfig(), mk.MmaConfig(warps=2, tiles=2, split=2),
                                 mk.MmaConfig(warps=1, tiles=4, split=1), mk.MmaConfig(warps=2, split=3, windows=2),
                                 mk.MmaConfig(warps=1, split=1, windows=4)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_fragment_kernel_matches_float64(M, N, K, cfg, has_bias, poisoned):
    """The fragment kernel (mma.sync on registers decoded in place; M <= 16, K a multiple of 128):
    one and two token tiles, odd M, N not a multiple of the program's rows (wrapped rows must not
    be stored), several windows, a single pass and split-K, one, two or four windows a step (a
    split's last step part past its windows: loads masked to zero). On the CPU the PTX is replaced
    by its plain-fp32 emulation, so this checks the index maps; the GPU run checks the PTX itself."""
    check_forward(lambda *a: mk._mma(*a, cfg), M, N, K, has_bias, M * 1000 + N + K + cfg.tiles + has_bias,
                  f"mma M={M} N={N} K={K} {cfg}")


@pytest.mark.parametrize("N,K,split,before", [(5120, 27648, 4, 7), (7168, 5120, 2, 3), (5120, 5120, 3, 3),
                                                (3584, 18944, 13, 13), (4608, 3584, 4, 4), (37888, 3584, 1, 1),
                                                (32, 2048, 1, 2)])
def test_gemv_split_fills_one_wave_with_1024_k_steps(N, K, split, before, monkeypatch):
    """The CUDA-core GEMV's split on an H100's 132 SMs: with 1024-k steps (the 32B weights) as many
    splits as fill one wave of GEMV_WAVE programs an SM (32B down: 160 tiles x 4 = 640 <= 660, not
    the ~8-an-SM rule's 7), with 512-k steps (the 7B weights) that rule (7B down 13). Counted by
    hand: 32B down 660 // 160 = 4 splits of 7 steps; 32B qkv 660 // 224 = 2 of 3 steps (5 steps in
    all); 32B o min(660 // 160, ceil(5 / 2)) = 3 (chunks of 2, 2, 1 steps); 7B down doubles to 16 >=
    1056 / 112, chunks of ceil(37 / 16) = 3 steps: 13 splits; one tile of 2 steps: 660 splits wanted,
    capped at half the steps, 1 (the rule of before: 2 of one step). Every split covers K once, none empty,
    each >= 1 step; SiLU·mul and a given split keep theirs; switched off, the rule of before
    (32B down 7, 32B qkv 3: doubled to 4, chunks of ceil(5 / 4) = 2 steps)."""
    monkeypatch.setattr(mk, "_num_sms", lambda device: 132)
    cfg = mk.fwd_config(1, N, K)
    bk, tiles = cfg.bk, -(-N // cfg.bn)
    got, k_split = mk._gemv_split(cfg, tiles, K, bk, False, 132)
    assert got == split and k_split % bk == 0 and (got - 1) * k_split < K <= got * k_split
    assert mk._gemv_split(cfg, tiles // 2, K, bk, True, 132)[0] == 1
    assert mk._gemv_split(mk.GemvConfig(bn=cfg.bn, bk=bk, split=2), tiles, K, bk, False, 132)[0] == 2
    monkeypatch.setattr(mk, "GEMV_ONE_WAVE", False)     # the ~8-an-SM rule everywhere, as before v32
    assert mk._gemv_split(cfg, tiles, K, bk, False, 132)[0] == before


@pytest.mark.parametrize("M", [1, 3])
def test_gemv_one_wave_split_is_right(M, monkeypatch, poisoned):
    """A GEMV launch through the one-wave split (1024-k steps on a pretend 1-SM device: 5 program
    slots over 2 tiles, 2 splits of 3 steps where the rule of before gives 3 of 2), summed
    in-kernel, against float64."""
    monkeypatch.setattr(mk, "_num_sms", lambda device: 1)
    launched = []
    monkeypatch.setattr(mk, "_nvfp4_gemv_kernel", LaunchSpy(mk._nvfp4_gemv_kernel, launched))
    gen = torch.Generator().manual_seed(M)
    packed, scale, gs = random_weight(64, 6144, gen)
    x = torch.randn(M, 6144, generator=gen).bfloat16().to(DEV)
    got = mk._gemv(x, packed, scale, gs, None, mk.GemvConfig(bn=32, bk=1024))
    assert [(kw["NSPLIT"], kw["REDUCE"]) for _, kw in launched] == [(2, True)]
    assert_close(got, mk.reference_matmul(x, packed, scale, gs, None), f"gemv M={M} one-wave split")


@pytest.mark.parametrize("M", [2, 4, 8, 16])
@pytest.mark.parametrize("N,K", [(4608, 3584), (3584, 18944), (5120, 27648), (7168, 5120), (48, 640), (64, 512)])
def test_fragment_launch_covers_k_in_whole_steps(M, N, K, monkeypatch):
    """_mma_launch on an H100's 132 SMs: the splits cover the K / 128 windows, none empty, in whole
    steps; more than one window a step only on short programs (<= PAIR_WINDOWS windows, twice that
    at M <= 4) or the long ones cut at M = 5..8 (32B down's: NOTES v31), never on 32B down's long
    ones elsewhere (measured slower there, NOTES v30); a given split is covered the same way at one
    window a step, and a given windows value is kept."""
    monkeypatch.setattr(mk, "_num_sms", lambda device: 132)
    cfg, nwin, cpu = mk.fwd_config(M, N, K), K // 128, torch.device("cpu")
    tiles = -(-N // (16 * cfg.warps * cfg.tiles))
    split, per, step = mk._mma_launch(cfg, M, tiles, K, cpu)
    assert (split - 1) * per < nwin <= split * per and step in (1, 2) and per % step == 0
    long_cut = 4 < M <= 8 and per == mk.LONG_RUN_CUT and step == 2      # the M = 5..8 long-run rule
    assert step == 1 or long_cut or per <= (2 * mk.PAIR_WINDOWS if M <= 4 else mk.PAIR_WINDOWS)
    if (N, K) == (5120, 27648):     # 32B down: 27-window runs at M = 5..8 cut to 8 (v31), else one a step
        assert long_cut if 4 < M <= 8 else step == 1
    if long_cut:                    # cut only where the split rule's runs were long
        assert mk._split(0, tiles, K, 128, 4 * 132)[1] // 128 >= mk.LONG_RUN_WINDOWS
    split, per, step = mk._mma_launch(mk.MmaConfig(warps=cfg.warps, split=3), M, tiles, K, cpu)
    assert (split - 1) * per < nwin <= split * per and split <= 3 and step == 1
    assert mk._mma_launch(mk.MmaConfig(warps=cfg.warps, windows=4), M, tiles, K, cpu)[2] == 4


@pytest.mark.parametrize("M", [6, 8])
def test_fragment_kernel_cuts_long_runs_at_one_token_tile(M, monkeypatch, poisoned):
    """At M = 5..8 a program the split rule leaves >= LONG_RUN_WINDOWS windows long is cut to runs
    of LONG_RUN_CUT at two windows a step, its partials summed in-kernel; y is right (on 4 CPU
    'SMs' 16 tiles of 16 rows need no split: 13 windows a program, cut to 2 splits of 8, the second
    split's last 3 windows past K, masked)."""
    monkeypatch.setattr(mk, "_num_sms", lambda device: 4)
    launched = []
    monkeypatch.setattr(mk, "_nvfp4_mma_kernel", LaunchSpy(mk._nvfp4_mma_kernel, launched))
    gen = torch.Generator().manual_seed(M)
    packed, scale, gs = random_weight(256, 13 * 128, gen)
    x = torch.randn(M, 13 * 128, generator=gen).bfloat16().to(DEV)
    got = mk._mma(x, packed, scale, gs, None, mk.MmaConfig(warps=1))
    assert [(kw["U"], kw["REDUCE"], kw["NSPLIT"]) for _, kw in launched] == [(2, True, 2)]
    assert_close(got, mk.reference_matmul(x, packed, scale, gs, None), f"mma M={M} long run cut")


@pytest.mark.parametrize("mode,late", [(0, [False] * 3), (1, [True] * 3), (2, [True, False, True])])
def test_fragment_kernel_late_release_modes(mode, late, monkeypatch):
    """FRAGMENT_LATE_RELEASE: 0 releases the next kernel at the start, 1 after the loop, 2 after the
    loop only where no reduce kernel follows: the launch that sums its own partials (M = 3, split 2)
    and the one that does not split (M = 12, split 1), not the one the reduce kernel follows (M = 12,
    split 2). The launch flag says which; y is right either way (on the CPU PDL is off, so the flag
    changes nothing there; the H200 A/B of NOTES v31 item 8 gave the same bits)."""
    monkeypatch.setattr(mk, "FRAGMENT_LATE_RELEASE", mode)
    monkeypatch.setattr(mk, "FRAGMENT_REDUCE_MAX_M", 4)
    monkeypatch.setattr(mk, "PAIR_REDUCE_MAX_M", 8)
    launched = []
    monkeypatch.setattr(mk, "_nvfp4_mma_kernel", LaunchSpy(mk._nvfp4_mma_kernel, launched))
    gen = torch.Generator().manual_seed(mode)
    packed, scale, gs = random_weight(48, 640, gen)
    for M, split in ((3, 2), (12, 2), (12, 1)):
        x = torch.randn(M, 640, generator=gen).bfloat16().to(DEV)
        assert_close(mk._mma(x, packed, scale, gs, None, mk.MmaConfig(warps=2, split=split)),
                     mk.reference_matmul(x, packed, scale, gs, None), f"mma M={M} split {split} late release {mode}")
    assert [(kw["REDUCE"], kw["PARTIAL"]) for _, kw in launched] == [(True, True), (False, True), (False, False)]
    assert [kw["LATE_RELEASE"] for _, kw in launched] == late


@pytest.mark.parametrize("M,cfg,reduce", [(12, mk.MmaConfig(warps=2, split=2, windows=2), True),
                                          (9, mk.MmaConfig(warps=2, split=3), True),
                                          (16, mk.MmaConfig(warps=2, split=3, windows=2), False)])
def test_fragment_kernel_sums_two_token_tiles_in_kernel(M, cfg, reduce, monkeypatch, poisoned):
    """At M > 8 (two token tiles) the kernel's last split sums both tiles' partials when the
    thresholds ask for it (FRAGMENT_REDUCE_MAX_M at any step, PAIR_REDUCE_MAX_M at two windows
    a step), else the reduce kernel does: the launch says which, and y is right either way (the
    poisoned output catches a token tile left unsummed)."""
    monkeypatch.setattr(mk, "FRAGMENT_REDUCE_MAX_M", 4 if M == 16 else 16)
    monkeypatch.setattr(mk, "PAIR_REDUCE_MAX_M", 8 if M == 16 else 16)
    launched = []
    monkeypatch.setattr(mk, "_nvfp4_mma_kernel", LaunchSpy(mk._nvfp4_mma_kernel, launched))
    gen = torch.Generator().manual_seed(M)
    packed, scale, gs = random_weight(48, 640, gen)
    x = torch.randn(M, 640, generator=gen).bfloat16().to(DEV)
    got = mk._mma(x, packed, scale, gs, None, cfg)
    assert [(kw["REDUCE"], kw["NT"]) for _, kw in launched] == [(reduce, 2)]
    assert_close(got, mk.reference_matmul(x, packed, scale, gs, None), f"mma M={M} {cfg}")


# ----------------------------------------------------------------------------------------------
# GPU: real shapes (Qwen2.5-7B / 32B projections)

@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4608, 3584), (3584, 18944), (55296, 5120)])
@pytest.mark.parametrize("M", [1, 4, 5, 8, 13, 16])          # M <= 4 (<= 8 at U > 1): the in-kernel sum
@pytest.mark.parametrize("cfg", [mk.MmaConfig(4, 1), mk.MmaConfig(4, 2), mk.MmaConfig(8, 2, split=1),
                                 mk.MmaConfig(8, 1, split=5, windows=2), mk.MmaConfig(4, 1, split=9, windows=4)])
def test_fragment_kernel_real_shapes_gpu(N, K, M, cfg, poisoned):
    gen = torch.Generator().manual_seed(N + K + M)
    packed, scale, gs = random_weight(N, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().cuda()
    bias = torch.randn(N, generator=gen).bfloat16().cuda()
    assert_close(mk._mma(x, packed, scale, gs, bias, cfg), mk.reference_matmul(x, packed, scale, gs, bias),
                 f"mma {N}x{K} M={M} {cfg}")
