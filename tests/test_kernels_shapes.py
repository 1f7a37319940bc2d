"""Tests for kernels/shapes.py: the launch arithmetic of the GEMM kernels on the real projection
shapes, on a pretend H100 of 132 SMs (launch.num_sms patched), counted by hand.

Pure Python: no kernel runs here (the kernels run these launches in test_kernels_small_m.py and
test_kernels_register_a.py). Each rule is also checked with its tuning field moved, where the field
names the other side of the rule.
"""
import dataclasses

import pytest
import torch

from kernels import launch, shapes, tuning
from kernels.shapes import GemvConfig, MmaConfig, WgmmaConfig


def _replaced(**kw):
    return tuning.using(dataclasses.replace(tuning.current(), **kw))


@pytest.fixture
def h100(monkeypatch):
    monkeypatch.setattr(launch, "num_sms", lambda device: 132)
    return torch.device("cpu")


@pytest.mark.parametrize("N,K,split", [(5120, 27648, 4), (7168, 5120, 2), (5120, 5120, 3), (3584, 18944, 13),
                                       (4608, 3584, 4), (37888, 3584, 1), (32, 2048, 1)])
def test_gemv_split_fills_one_wave_with_1024_k_steps(N, K, split, h100):
    """The CUDA-core GEMV's split on an H100's 132 SMs: with 1024-k steps (the 32B weights) as many
    splits as fill one wave of gemv_wave programs an SM (32B down: 160 tiles x 4 = 640 <= 660, not
    the ~8-an-SM rule's 7), with 512-k steps (the 7B weights) that rule (7B down 13). Counted by
    hand: 32B down 660 // 160 = 4 splits of 7 steps; 32B qkv 660 // 224 = 2 of 3 steps (5 steps in
    all); 32B o min(660 // 160, ceil(5 / 2)) = 3 (chunks of 2, 2, 1 steps); 7B down doubles to 16 >=
    1056 / 112, chunks of ceil(37 / 16) = 3 steps: 13 splits; one tile of 2 steps: 660 splits wanted,
    capped at half the steps, 1. Every split covers K once, none empty, each >= 1 step; SiLU·mul and
    a given split keep theirs."""
    cfg = shapes.fwd_config(1, N, K)
    bk, tiles = cfg.bk, -(-N // cfg.bn)
    got, k_split = shapes.gemv_split(cfg, tiles, K, bk, False, 132)
    assert got == split and k_split % bk == 0 and (got - 1) * k_split < K <= got * k_split
    assert shapes.gemv_split(cfg, tiles // 2, K, bk, True, 132)[0] == 1
    assert shapes.gemv_split(GemvConfig(bn=cfg.bn, bk=bk, split=2), tiles, K, bk, False, 132)[0] == 2
    with _replaced(gemv_wave=10):       # twice the programs an SM: twice the splits where the wave rule runs
        twice = shapes.gemv_split(cfg, tiles, K, bk, False, 132)[0]
    assert twice == split if bk < 1024 else twice >= split


@pytest.mark.parametrize("M", [2, 4, 8, 16])
@pytest.mark.parametrize("N,K", [(4608, 3584), (3584, 18944), (5120, 27648), (7168, 5120), (48, 640), (64, 512)])
def test_fragment_launch_covers_k_in_whole_steps(M, N, K, h100):
    """mma_launch on an H100's 132 SMs: the splits cover the K / 128 windows, none empty, in whole
    steps; more than one window a step only on short programs (<= pair_windows windows, twice that
    at M <= 4) or the long ones cut at M = 5..8 (32B down's), never on 32B down's long ones
    elsewhere; a given split is covered the same way at one window a step, and a given windows
    value is kept."""
    t = tuning.current()
    cfg, nwin, cpu = shapes.fwd_config(M, N, K), K // 128, h100
    tiles = -(-N // (16 * cfg.warps * cfg.tiles))
    split, per, step = shapes.mma_launch(cfg, M, tiles, K, cpu)
    assert (split - 1) * per < nwin <= split * per and step in (1, 2) and per % step == 0
    long_cut = 4 < M <= 8 and per == t.long_run_cut and step == 2      # the M = 5..8 long-run rule
    assert step == 1 or long_cut or per <= (2 * t.pair_windows if M <= 4 else t.pair_windows)
    if (N, K) == (5120, 27648):     # 32B down: 27-window runs at M = 5..8 cut to 8, else one a step
        assert long_cut if 4 < M <= 8 else step == 1
    if long_cut:                    # cut only where the split rule's runs were long
        assert shapes.split(0, tiles, K, 128, 4 * 132)[1] // 128 >= t.long_run_windows
    split, per, step = shapes.mma_launch(MmaConfig(warps=cfg.warps, split=3), M, tiles, K, cpu)
    assert (split - 1) * per < nwin <= split * per and split <= 3 and step == 1
    assert shapes.mma_launch(MmaConfig(warps=cfg.warps, windows=4), M, tiles, K, cpu)[2] == 4


def test_wgmma_configs():
    """The register-A kernel's tokens a program by M, its warps and ring stages; configs it cannot
    run are refused."""
    assert [shapes.wgmma_config(M).bt for M in (1, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 1024)] == [
        8, 8, 16, 16, 32, 32, 64, 64, 128, 128, 256, 256]
    assert [shapes.wgmma_config(M).warps for M in (128, 129)] == [4, 8]
    assert [shapes.wgmma_config(M).stages for M in (2, 16, 17)] == [4, 4, 3]
    with pytest.raises(ValueError, match="WgmmaConfig"):
        WgmmaConfig(bt=48)
    with pytest.raises(ValueError, match="WgmmaConfig"):
        WgmmaConfig(bt=64, bn=32)
    with pytest.raises(ValueError, match="WgmmaConfig"):
        WgmmaConfig(bt=256)                                       # 4 warps: too few registers


def test_fewer_stages_fit_a_launch_in_one_wave(h100):
    """fit_stages on an H100's 132 SMs: 32B gate_up at M = 9..16 (864 row tiles of 64; a 4-stage
    ring of 16-token tiles lets 6 programs an SM share its shared memory, 792 a wave, a 3-stage one
    8, 1,056) launches with 3 stages, unsplit; 7B gate_up (592 tiles) keeps 4; at M = 32 (3 stages
    already, 660 a wave) there are none fewer to take; a given split and the warp-specialized kernel
    (128-token tiles at M = 100: 200 row tiles of N = 12800, 132 a wave at 4 stages, 264 at 3) keep
    cfg."""
    cpu, g32, g7 = h100, (55296, 5120), (37888, 3584)
    c16 = shapes.wgmma_config(16)
    assert [shapes.wgmma_wave(WgmmaConfig(bt=16, stages=s), cpu) for s in (4, 3)] == [792, 1056]
    assert shapes.fit_stages(16, g32[0], c16, cpu) == WgmmaConfig(bt=16, stages=3)
    assert shapes.wgmma_launches(12, *g32, c16, cpu) == [(WgmmaConfig(bt=16, stages=3), 0, 864, 1, 40)]
    assert shapes.fit_stages(16, g7[0], c16, cpu) == c16
    assert shapes.fit_stages(32, g32[0], shapes.wgmma_config(32), cpu) == shapes.wgmma_config(32)
    assert shapes.fit_stages(16, g32[0], WgmmaConfig(bt=16, stages=4, split=2), cpu).stages == 4
    assert shapes.fit_stages(1024, g32[0], shapes.wgmma_config(1024), cpu) == shapes.wgmma_config(1024)
    ws4 = WgmmaConfig(bt=128, stages=4)
    assert shapes.warp_specialized(ws4) and [shapes.wgmma_wave(WgmmaConfig(bt=128, stages=st), cpu)
                                             for st in (4, 3)] == [132, 264]
    assert shapes.fit_stages(100, 12800, ws4, cpu) == ws4


@pytest.mark.parametrize("N,K,M,split,before", [(3584, 18944, 16, 10, 14), (7168, 5120, 12, 5, 7),
                                                  (5120, 5120, 9, 7, 8), (5120, 27648, 16, 7, 9),
                                                  (55296, 5120, 16, 1, 1), (3584, 18944, 64, 4, 4)])
def test_wgmma_split_at_decode_takes_part_of_a_wave(N, K, M, split, before, h100):
    """wgmma_split on an H100's 132 SMs (792 programs a wave for 16-token tiles, 4 stages): at <= 16
    tokens up to 3/4 of it, 594: 7B down 56 row tiles x 10 splits (594 // 56 = 10; one wave: 14),
    32B qkv 112 x 5 (of 40 windows: 8 each; 7 with a whole wave), 32B o 80 x 7 (6 windows each; 8),
    32B down 80 x 7 (31 windows; 9); gate_up unsplit either way; M = 64 left alone (7B down: 264 // 56
    = 4 splits of 37 windows, its 64-token tiles fill at 3 stages 2 an SM). Every split covers K's
    windows once, in runs of >= 4 (the last may be shorter)."""
    cpu, cfg, nwin = h100, shapes.wgmma_config(M), K // 128
    got, per = shapes.wgmma_split(M, N, K, cfg, cpu)
    assert got == split and (got - 1) * per < nwin <= got * per and (per >= 4 or got == 1)
    with _replaced(wgmma_decode_wave=1.0):
        assert shapes.wgmma_split(M, N, K, cfg, cpu)[0] == before


def test_long_runs_take_a_deeper_ring_where_it_is_free(h100):
    """deeper_ring on an H100's 132 SMs: 7B down at M = 64 (56 tiles x 4 splits of 37 windows, 224
    programs) and 32B down at M = 48 (80 x 3 of 72) run 4 stages, since 64-token tiles fit 2 an SM
    (264 a wave) at 3 or 4; 32B qkv at M = 64 (2 of 20 windows) keeps 3, and 32B gate_up (864
    unsplit programs of 40 windows: 3.3 waves); 7B down at M = 128 keeps 3 (a 4-stage ring of
    128-token tiles would cost programs an SM) and at M = 1024 (256-token tiles: 4 stages do not
    fit the shared memory); so does a given split, and a long_ring_windows above 7B down's 37."""
    cpu = h100
    stages = {(M, N, K): [c.stages for c, *_ in shapes.wgmma_launches(M, N, K, shapes.wgmma_config(M), cpu)]
              for M, N, K in ((64, 3584, 18944), (48, 5120, 27648), (64, 7168, 5120), (128, 3584, 18944),
                              (1024, 3584, 18944), (64, 55296, 5120))}
    assert stages == {(64, 3584, 18944): [4], (48, 5120, 27648): [4], (64, 7168, 5120): [3],
                      (128, 3584, 18944): [3], (1024, 3584, 18944): [3], (64, 55296, 5120): [3]}
    assert shapes.wgmma_split(64, 3584, 18944, shapes.wgmma_config(64), cpu) == (4, 37)
    given = WgmmaConfig(bt=64, split=4)
    assert [c.stages for c, *_ in shapes.wgmma_launches(64, 3584, 18944, given, cpu)] == [3]
    with _replaced(long_ring_windows=38):
        assert [c.stages for c, *_ in shapes.wgmma_launches(64, 3584, 18944, shapes.wgmma_config(64), cpu)] == [3]


def test_split_and_fit_helpers():
    """split doubles until the programs are there or the current chunks are shorter than min_blocks
    blocks, and covers the reduction in whole blocks; fit takes the largest power of two that divides."""
    assert shapes.split(0, 10, 4096, 128, 80) == (8, 512)
    assert shapes.split(0, 10, 1024, 128, 80) == (4, 256)          # 1024 < 4 blocks x 4 splits x 128
    assert shapes.split(3, 1, 1000, 128, 0) == (3, 384)            # a given split, the last chunk shorter
    assert [shapes.fit(128, n) for n in (3584, 18944, 80, 48)] == [128, 128, 16, 16]
