"""bench/kernel.py's --split-cost (CPU under the interpreter, or the GPU): which fragment launches
it times, and the switch that leaves a launch's split-K partials unsummed, then puts the route back."""
import importlib.util
import os

import pytest
import torch

from kernels import gemm, shapes, tuning
from marlin_kernel import reference_matmul
from nvfp4_cases import DEV, random_weight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_bench(name):
    """bench/<name>.py as a module (bench/rollout.py's name would clash with the top-level rollout.py)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("M,step,sums", [(1, 1, True), (4, 1, True), (5, 1, False), (8, 1, False),
                                         (5, 2, True), (8, 4, True), (9, 2, False), (16, 1, False)])
def test_fragment_sums_in_kernel_by_rows_and_step(M, step, sums):
    """The last split sums its launch's partials at M <= 4, and to M = 8 where a step loads several
    windows (fragment_reduce_max_m = 4, pair_reduce_max_m = 8); above 8 rows the reduce kernel does."""
    assert gemm.fragment_sums_in_kernel(M, step) is sums


def test_unsummed_splits_leaves_partials_then_restores_the_route():
    """Inside the switch a split launch returns y without its split-K sum (so not the product);
    after it, even one left by an exception, the same call is right again."""
    bench = load_bench("kernel")
    gen = torch.Generator().manual_seed(3)
    packed, scale, gs = random_weight(32, 512, gen)
    x = torch.randn(2, 512, generator=gen).bfloat16().to(DEV)
    reduce_fn = gemm._reduce
    cfg = shapes.MmaConfig(warps=2, split=2)                   # 2 splits of 2 windows, summed in-kernel
    ref = reference_matmul(x, packed, scale, gs)
    with pytest.raises(RuntimeError, match="inside"):
        with bench.unsummed_splits():
            y = gemm._mma(x, packed, scale, gs, None, cfg)
            assert tuning.current().reduce_in_kernel is False
            raise RuntimeError("inside")
    assert not torch.allclose(y.double(), ref, rtol=0.1, atol=0.1)
    assert tuning.current().reduce_in_kernel is True and gemm._reduce is reduce_fn
    err = ((gemm._mma(x, packed, scale, gs, None, cfg).double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, err


def test_main_needs_a_gpu_and_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the bench would run")
    with pytest.raises(SystemExit, match="CUDA"):
        load_bench("kernel").main(["--check"])


@pytest.mark.parametrize("cuts", [None, (40, 48)])
@pytest.mark.parametrize("M,folds", [(1, True), (4, True), (1, False)])
def test_lora_calls_each_give_the_projection_with_its_update(M, folds, cuts):
    """bench/kernel.py --lora-cost times lora_calls' sequences: the plain matmul gives x·Wᵀ, and each
    sequence with the adapter gives x·Wᵀ + s·bf16(x·Aᵀ)·Bᵀ (float64, within bf16 rounding): the fold
    where gemm.folds_lora holds, else the expand kernel (without the in-kernel split sum the GEMV
    cannot fold). With cuts, a group of three rank-8 members (40, 8 and 16 columns) with a compact B,
    as bench.lora_operands builds q/k/v's: the reference is its block-diagonal B."""
    import dataclasses
    import nvfp4
    bench = load_bench("kernel")
    gen = torch.Generator().manual_seed(6)
    packed, scale, gs = random_weight(64, 256, gen)
    w = (*nvfp4.interleave(packed, scale), gs)
    x = torch.randn(M, 256, generator=gen).bfloat16().to(DEV)
    A = (torch.randn(24, 256, generator=gen) / 16).bfloat16().to(DEV)
    B = torch.randn(64, 24 if cuts is None else 8, generator=gen).bfloat16().to(DEV)
    dense = B.double()
    if cuts is not None:                     # member p's rows hold ranks [8p, 8p + 8) of the block-diagonal
        dense = torch.block_diag(dense[:40], dense[40:48], dense[48:])
    base = reference_matmul(x, packed, scale, gs)
    full = base + 0.5 * (x.double() @ A.double().t()).bfloat16().double() @ dense.t()
    with tuning.using(dataclasses.replace(tuning.current(), reduce_in_kernel=folds)):
        calls = bench.lora_calls(x, w, A, B, cuts, 0.5)
        want_names = {"plain", "fold, h given", "shrink + fold"} if folds else {"plain", "shrink + expand"}
        assert set(calls) == want_names
        for what, fn in calls.items():
            want = base if what == "plain" else full
            err = (fn().double() - want).abs().max() / want.abs().max()
            assert err < 2 ** -7, (what, err.item())


def test_trace_timings_measures_from_each_norms_end():
    """bench/kernel.py --lora-trace's reading of a profiled chain: per [norm, ...] iteration, each
    part's start and end from that norm's end (a matmul that starts before it, under PDL, reads
    negative; a matmul of two kernels spans both), the last end, and the norm-to-norm period;
    medians over the iterations, by hand."""
    bench = load_bench("kernel")

    def chain(n, shrink):
        events, t = [], 0.0
        for i in range(n):
            events.append(dict(name="_rms_norm_kernel", ts=t, dur=1.0))                 # ends at t + 1
            if shrink:
                events.append(dict(name="_lora_shrink_kernel", ts=t + 0.5, dur=3.0))    # -0.5 .. 2.5 from the norm's end
            events.append(dict(name="_fragment_order_kernel", ts=t + (2.0 if shrink else 0.5), dur=1.0))
            events.append(dict(name="_wgmma_ws_kernel", ts=t + 3.0, dur=3.5 + i))       # the matmul: both
            t += 10.0 + i
        return events[::-1]                                                           # any order in

    plain = bench.trace_timings(chain(3, False))
    assert plain == {"matmul start": -0.5, "matmul end": 6.5, "done": 6.5, "period": 10.5}
    lora = bench.trace_timings(chain(3, True))
    assert lora == {"shrink start": -0.5, "shrink end": 2.5, "matmul start": 1.0, "matmul end": 6.5,
                    "done": 6.5, "period": 10.5}
    fused = [dict(e, name="_norm_shrink_kernel") if "rms_norm" in e["name"] else e for e in chain(3, False)]
    assert bench.trace_timings(fused) == plain                                       # the norm's launch
    with pytest.raises(ValueError, match="iterations"):
        bench.trace_timings(chain(1, True))
