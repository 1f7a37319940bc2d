"""bench/kernel.py's --split-cost (CPU under the interpreter, or the GPU): which fragment launches
it times, and the switch that leaves a launch's split-K partials unsummed, then puts the route back."""
import pytest
import torch

import marlin_kernel as mk
from test_marlin_kernel import DEV, random_weight
from test_step_bench import load_bench


@pytest.mark.parametrize("M,step,sums", [(1, 1, True), (4, 1, True), (5, 1, False), (8, 1, False),
                                         (5, 2, True), (8, 4, True), (9, 2, False), (16, 1, False)])
def test_fragment_sums_in_kernel_by_rows_and_step(M, step, sums):
    """The last split sums its launch's partials at M <= 4, and to M = 8 where a step loads several
    windows (FRAGMENT_REDUCE_MAX_M = 4, PAIR_REDUCE_MAX_M = 8); above 8 rows the reduce kernel does."""
    assert mk.fragment_sums_in_kernel(M, step) is sums


def test_unsummed_splits_leaves_partials_then_restores_the_route():
    """Inside the switch a split launch returns y without its split-K sum (so not the product);
    after it, even one left by an exception, the same call is right again."""
    bench = load_bench("kernel")
    gen = torch.Generator().manual_seed(3)
    packed, scale, gs = random_weight(32, 512, gen)
    x = torch.randn(2, 512, generator=gen).bfloat16().to(DEV)
    reduce_fn = mk._reduce
    cfg = mk.MmaConfig(warps=2, split=2)                   # 2 splits of 2 windows, summed in-kernel
    ref = mk.reference_matmul(x, packed, scale, gs)
    with pytest.raises(RuntimeError, match="inside"):
        with bench.unsummed_splits():
            y = mk._mma(x, packed, scale, gs, None, cfg)
            assert mk.REDUCE_IN_KERNEL is False
            raise RuntimeError("inside")
    assert not torch.allclose(y.double(), ref, rtol=0.1, atol=0.1)
    assert mk.REDUCE_IN_KERNEL is True and mk._reduce is reduce_fn
    err = ((mk._mma(x, packed, scale, gs, None, cfg).double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, err
