"""The TMA-fed fragment kernel (kernels/fragment_tma.py) and where gemm sends 2-8 rows to it.

CPU: the route (fragment_tma_takes: 2-8 rows, the big weights only, interleaved, on sm_90) and the
split rule (shapes.fragment_tma_split) on Qwen2.5's shapes, with the device's answers patched in.
GPU: the kernel through gemm.matmul against the float64 reference on the 7B and 32B MLP shapes at
2, 5 and 8 rows, unsplit (gate_up) and split (down, summed by the reduce kernel, with a LoRA update
folded there), a bias, and split runs of any length.
"""
import dataclasses

import pytest
import torch

from kernels import fragment_tma, gemm, launch, shapes, tuning
from marlin_kernel import reference_matmul
from nvfp4_cases import LaunchSpy, assert_close, random_weight
from test_kernels_gemv_tma import QWEN


def test_the_big_weights_take_it_at_2_to_8_rows_on_sm90(monkeypatch):
    """At 2-8 rows the weights of more than fragment_tma_weight elements (gate_up, down) take the
    TMA-fed fragment kernel where Gluon runs and the weight is interleaved; one row keeps the GEMV,
    9 rows and the smaller weights their routes; a replaced threshold moves the route."""
    monkeypatch.setattr(gemm, "gluon_runs", lambda device, interleaved: interleaved)
    cpu = torch.device("cpu")
    takes = {name for name, (N, K) in QWEN.items() if gemm.route(8, N, K, cpu, True) == "fragment_tma"}
    assert takes == {"7B gate_up", "7B down", "14B gate_up", "14B down", "32B gate_up", "32B down"}
    N, K = QWEN["7B down"]
    assert [gemm.route(M, N, K, cpu, True) for M in (1, 2, 8, 9)] == ["gemv", "fragment_tma", "fragment_tma",
                                                                       "wgmma"]
    assert gemm.route(8, N, K, cpu, False) == "fragment"                        # the plain layout
    assert gemm.route(8, N, K + 128, cpu, True) == "fragment"                   # K not a multiple of 512
    with tuning.using(dataclasses.replace(tuning.current(), fragment_tma_max_m=4)):
        assert [gemm.route(M, N, K, cpu, True) for M in (4, 5)] == ["fragment_tma", "fragment"]


def test_splits_stream_at_least_fragment_tma_steps(monkeypatch):
    """Each split streams >= fragment_tma_steps 512-k steps, all splits at most five programs an SM;
    the LoRA update folds (into the reduce kernel) exactly where the launch splits."""
    sms = 132
    assert shapes.fragment_tma_split(112, 18944, sms) == (5, 8)                 # 7B down: 37 steps, 5 splits of <= 8
    assert shapes.fragment_tma_split(1184, 3584, sms) == (1, 7)                 # 7B gate_up: more than a wave
    assert shapes.fragment_tma_split(160, 27648, sms) == (4, 14)                # 32B down: 54 steps
    with tuning.using(dataclasses.replace(tuning.current(), fragment_tma_steps=16)):
        assert shapes.fragment_tma_split(112, 18944, sms) == (2, 19)
    monkeypatch.setattr(gemm, "gluon_runs", lambda device, interleaved: interleaved)
    monkeypatch.setattr(launch, "num_sms", lambda device: sms)
    cpu = torch.device("cpu")
    assert gemm.folds_lora(8, *QWEN["7B down"], cpu, True) and gemm.carries_shrink(8, *QWEN["7B down"], cpu, True)
    assert not gemm.folds_lora(8, *QWEN["7B gate_up"], cpu, True)


# ----------------------------------------------------------------------------------------------
# GPU: the kernel on real shapes

def _spy(monkeypatch):
    launched = []
    monkeypatch.setattr(fragment_tma, "_fragment_tma_kernel", LaunchSpy(fragment_tma._fragment_tma_kernel, launched))
    return launched


def _case(M, N, K, seed):
    import nvfp4
    gen = torch.Generator().manual_seed(seed)
    packed, scale, gs = random_weight(N, K, gen, device="cuda")
    x = torch.randn(M, K, generator=gen).bfloat16().cuda()
    return x, (packed, scale, gs), nvfp4.interleave(packed, scale), gen


def _needs_gluon():
    if not gemm.gluon_runs(torch.device("cuda"), True):
        pytest.skip("the TMA-fed fragment kernel needs sm_90 and triton 3.6")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["7B gate_up", "7B down", "32B down"])
@pytest.mark.parametrize("M", [2, 5, 8])
@pytest.mark.parametrize("has_bias", [False, True])
def test_matches_float64_on_the_mlp_shapes_gpu(name, M, has_bias, monkeypatch, poisoned):
    """y = x·Wᵀ (+ bias) at M rows through gemm.matmul, which launches the TMA-fed fragment kernel
    (split on down, its partials summed by the reduce kernel), against float64; every element
    written (poisoned buffers), twice in a row."""
    _needs_gluon()
    N, K = QWEN[name]
    x, (packed, scale, gs), w, gen = _case(M, N, K, N + K + M)
    bias = torch.randn(N, generator=gen).bfloat16().cuda() if has_bias else None
    launched = _spy(monkeypatch)
    want = reference_matmul(x, packed, scale, gs, bias)
    for _ in range(2):
        assert_close(gemm.matmul(x, *w, gs, bias, interleaved=True), want, f"fragment_tma {name} M={M}")
    assert [kw["PARTIAL"] for _, kw in launched] == [name.endswith("down")] * 2


@pytest.mark.gpu
@pytest.mark.parametrize("M", [2, 8])
def test_the_reduce_adds_the_update_gpu(M, monkeypatch, poisoned):
    """7B down at M rows with a LoRA update in the partials form: the split launch, then the reduce
    kernel sums and adds s·bf16(Σ hp)·Bᵀ; against float64 with h rounded as the kernels round it."""
    _needs_gluon()
    N, K = QWEN["7B down"]
    x, (packed, scale, gs), w, gen = _case(M, N, K, 11 * M)
    hp = torch.randn(3, M, 32, generator=gen).cuda()
    B = (torch.randn(N, 32, generator=gen) * 0.2).bfloat16().cuda()
    launched = _spy(monkeypatch)
    got = gemm.matmul(x, *w, gs, interleaved=True, lora=(hp, B, 0.75))
    assert len(launched) == 1
    want = reference_matmul(x, packed, scale, gs, None) + 0.75 * hp.sum(0).bfloat16().double() @ B.double().t()
    assert_close(got, want, f"fragment_tma down M={M} with the update")


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [1, 3, 7])
def test_any_split_sums_to_the_same_gpu(steps, monkeypatch, poisoned):
    """7B gate_up's K (7 steps) on a 32-row slice of it, at least 1, 3 or 7 steps a split: 7 splits,
    3 (3 + 3 + 1 steps) or none, with room for every split. Against float64, twice."""
    _needs_gluon()
    x, (packed, scale, gs), w, _ = _case(8, 64 * 32, 3584, steps)
    launched = _spy(monkeypatch)
    monkeypatch.setattr(launch, "num_sms", lambda device: 1024)
    with tuning.using(dataclasses.replace(tuning.current(), fragment_tma_weight=0, fragment_tma_steps=steps)):
        for _ in range(2):
            assert_close(gemm.matmul(x, *w, gs, interleaved=True), reference_matmul(x, packed, scale, gs, None),
                         f"fragment_tma, {steps}-step splits")
    assert launched[0][1]["PARTIAL"] == (steps < 7)
