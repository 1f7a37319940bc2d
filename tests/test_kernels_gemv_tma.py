"""The TMA-fed one-row GEMV (kernels/gemv_tma.py) and where gemm sends one row to it.

CPU: the route (gemv_tma_takes: the big weights only, interleaved, on sm_90) and the split rule
(shapes.gemv_tma_split) on Qwen2.5's shapes, with the device's answers patched in. GPU: the kernel
through gemm.matmul against the float64 reference on the 7B and 32B MLP shapes, with the LoRA update
folded, a bias, split-K summed in-kernel and SiLU·mul; SiLU·mul's bits against the plain launch
followed by fused_ops.silu_mul.
"""
import dataclasses

import pytest
import torch

from kernels import gemm, gemv_tma, launch, shapes, tuning
from marlin_kernel import reference_matmul
from nvfp4_cases import LaunchSpy, assert_close, check_silu_mul, random_weight

QWEN = {"7B qkv": (4608, 3584), "7B o": (3584, 3584), "7B gate_up": (37888, 3584), "7B down": (3584, 18944),
        "14B gate_up": (27648, 5120), "14B down": (5120, 13824),
        "32B qkv": (7168, 5120), "32B o": (5120, 5120), "32B gate_up": (55296, 5120), "32B down": (5120, 27648)}


def test_the_big_weights_take_it_on_sm90(monkeypatch):
    """At one row the weights of more than gemv_tma_weight elements (gate_up, 32B down) take the
    TMA-fed GEMV where Gluon runs and the weight is interleaved; the others keep gemv.py; a
    replaced threshold moves the route."""
    monkeypatch.setattr(gemm, "gluon_runs", lambda device, interleaved: interleaved)
    cpu = torch.device("cpu")
    takes = {name for name, (N, K) in QWEN.items() if gemm.gemv_tma_takes(N, K, cpu, True)}
    assert takes == {"7B gate_up", "14B gate_up", "32B gate_up", "32B down"}
    assert not gemm.gemv_tma_takes(*QWEN["7B gate_up"], cpu, False)           # the plain layout: gemv.py
    assert not gemm.gemv_tma_takes(37888, 3584 + 128, cpu, True)              # K not a multiple of 512
    with tuning.using(dataclasses.replace(tuning.current(), gemv_tma_weight=0)):
        assert gemm.gemv_tma_takes(*QWEN["7B o"], cpu, True)


def test_splits_stream_at_least_gemv_tma_steps(monkeypatch):
    """Each split streams >= gemv_tma_steps 512-k steps, all splits at most 8 programs an SM."""
    sms = 132
    assert shapes.gemv_tma_split(112, 18944, sms) == (4, 10)                   # 7B down: 37 steps
    assert shapes.gemv_tma_split(1184, 3584, sms) == (1, 7)                    # 7B gate_up: a wave of tiles
    assert shapes.gemv_tma_split(160, 27648, sms) == (6, 9)                    # 32B down: 54 steps
    assert shapes.gemv_tma_split(160, 13824, sms) == (3, 9)                    # 14B down: 27 steps
    assert shapes.gemv_tma_split(1000, 27648, sms) == (1, 54)                  # no room for a second split
    with tuning.using(dataclasses.replace(tuning.current(), gemv_tma_steps=4)):
        assert shapes.gemv_tma_split(112, 18944, sms) == (8, 5)


# ----------------------------------------------------------------------------------------------
# GPU: the kernel on real shapes

def _weights(N, K, seed):
    import nvfp4
    gen = torch.Generator().manual_seed(seed)
    packed, scale, gs = random_weight(N, K, gen, device="cuda")
    x = torch.randn(1, K, generator=gen).bfloat16().cuda()
    return x, (packed, scale, gs), nvfp4.interleave(packed, scale), gen


def _spy(monkeypatch):
    launched = []
    monkeypatch.setattr(gemv_tma, "_gemv_tma_kernel", LaunchSpy(gemv_tma._gemv_tma_kernel, launched))
    return launched


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["7B gate_up", "7B down", "32B down", "32B gate_up"])
@pytest.mark.parametrize("with_lora,has_bias", [(False, False), (True, True)])
def test_matches_float64_on_the_mlp_shapes_gpu(name, with_lora, has_bias, monkeypatch, poisoned):
    """y = x·Wᵀ (+ bias) (+ s·bf16(Σ hp)·Bᵀ) at one row through gemm.matmul, which launches the TMA
    kernel (split-K on down: its last split sums), against float64 with h rounded as the expand
    kernel rounds it."""
    if not gemm.gluon_runs(torch.device("cuda"), True):
        pytest.skip("the TMA-fed GEMV needs sm_90 and triton 3.6")
    N, K = QWEN[name]
    x, (packed, scale, gs), w, gen = _weights(N, K, N + K + with_lora)
    bias = torch.randn(N, generator=gen).bfloat16().cuda() if has_bias else None
    hp = torch.randn(3, 1, 64, generator=gen).cuda()
    B = (torch.randn(N, 64, generator=gen) * 0.2).bfloat16().cuda()
    launched = _spy(monkeypatch)
    with tuning.using(dataclasses.replace(tuning.current(), gemv_tma_weight=0)):      # 7B down too
        got = gemm.matmul(x, *w, gs, bias, interleaved=True, lora=(hp, B, 0.75) if with_lora else None)
    (_, kw), = launched
    assert kw["LORA"] == with_lora and kw["PARTIAL"] == name.endswith("down")
    want = reference_matmul(x, packed, scale, gs, bias)
    if with_lora:
        want = want + 0.75 * (hp[0] + hp[1] + hp[2]).bfloat16().double() @ B.double().t()
    assert_close(got, want, f"gemv_tma {name} lora={with_lora} bias={has_bias}")


@pytest.mark.gpu
@pytest.mark.parametrize("with_lora", [None, "adapter", "group"])
def test_silu_mul_gpu(with_lora, monkeypatch, poisoned):
    """7B gate/up with silu_mul: the bits of the plain TMA launch followed by fused_ops.silu_mul on
    its halves, and float64 silu(g)·u within bf16 tolerance; the update of one adapter, or of the
    gate/up group's compact B (each program's rows from both members)."""
    if not gemm.gluon_runs(torch.device("cuda"), True):
        pytest.skip("the TMA-fed GEMV needs sm_90 and triton 3.6")
    N, K = QWEN["7B gate_up"]
    x, (packed, scale, gs), w, gen = _weights(N, K, 7 + len(with_lora or ""))
    hp, B = torch.randn(2, 1, 32, generator=gen).cuda(), (torch.randn(N, 16, generator=gen) * 0.2).bfloat16().cuda()
    lora = {None: None, "adapter": gemm.Fold(hp[..., :16].contiguous(), B, 0.5),
            "group": gemm.Fold(hp, B, 0.5, cuts=(N // 2, N))}[with_lora]
    launched = _spy(monkeypatch)
    got = gemm.matmul(x, *w, gs, interleaved=True, lora=lora, silu_mul=True)
    y = gemm.matmul(x, *w, gs, interleaved=True, lora=lora)
    assert [kw["SILU"] for _, kw in launched] == [True, False]
    check_silu_mul(got, y, x, packed, scale, gs, lora, f"gemv_tma silu_mul lora={with_lora}")


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [1, 3, 8])
def test_any_split_sums_to_the_same_gpu(steps, monkeypatch, poisoned):
    """7B o (7 steps) forced onto the TMA kernel (gemv_tma_weight 0), at least 1, 3 or 8 steps a
    split: 7 splits, 2 (4 + 3 steps) or none. Against float64, twice (the counts reset)."""
    if not gemm.gluon_runs(torch.device("cuda"), True):
        pytest.skip("the TMA-fed GEMV needs sm_90 and triton 3.6")
    N, K = QWEN["7B o"]
    x, (packed, scale, gs), w, _ = _weights(N, K, steps)
    launched = _spy(monkeypatch)
    with tuning.using(dataclasses.replace(tuning.current(), gemv_tma_weight=0, gemv_tma_steps=steps)):
        monkeypatch.setattr(launch, "num_sms", lambda device: 1024)           # room for every split
        for _ in range(2):
            assert_close(gemm.matmul(x, *w, gs, interleaved=True), reference_matmul(x, packed, scale, gs, None),
                         f"gemv_tma o, {steps}-step splits")
    assert launched[0][1]["PARTIAL"] == (steps < 7)
