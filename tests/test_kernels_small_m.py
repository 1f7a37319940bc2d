"""Tests for the decode-time kernels: the CUDA-core GEMV (one row, kernels/gemv.py) and the mma.sync
fragment kernel (M <= 16, K a multiple of 128, kernels/small_m.py), run through gemm's _gemv / _mma
with a given GemvConfig / MmaConfig, against the float64 reference marlin_kernel.reference_matmul
(plain torch), on buffers poisoned with NaN (conftest's `poisoned`).

On the CPU the interpreter runs tiny shapes, the kernels' PTX replaced by plain-tl emulations (so
the index maps and the GEMV's block scaling are checked); the `gpu` test runs the PTX on the real Qwen2.5 projection
shapes. Split-K summed inside the kernel (fp4_decode._last_split / _sum_splits) must give the bits
of the separate reduce kernel. Exact decoding of every code: test_kernels_fp4_decode.py; the routing
to these kernels: test_kernels_gemm.py; their launch arithmetic: test_kernels_shapes.py.
"""
import dataclasses

import pytest
import torch

from kernels import gemm, launch, tuning
from kernels.shapes import GemvConfig, MmaConfig, TileConfig
from marlin_kernel import reference_matmul
from nvfp4_cases import (DEV, LaunchSpy, assert_close, block_diagonal, check_forward, check_silu_mul,
                         random_weight)


def _replaced(**kw):
    return tuning.using(dataclasses.replace(tuning.current(), **kw))


# ----------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU: small shapes

@pytest.mark.parametrize("path,M,N,K,cfg", [
    ("tile", 5, 144, 512, TileConfig(bm=16, bn=64, bk=64, warps=4, stages=2, split=3)),
    ("tile", 16, 200, 1024, TileConfig(bm=16, bn=64, bk=64, warps=4, stages=2, split=8)),
    ("tile", 33, 64, 256, TileConfig(bm=16, bn=64, bk=64, warps=4, stages=2, split=2)),
    ("gemv", 1, 48, 352, GemvConfig(bn=16, bk=64, split=3)),        # 3 splits of 2 steps, the last 1.5
    ("gemv", 1, 64, 512, GemvConfig(bn=32, bk=64, split=4)),
    ("fragment", 3, 80, 512, MmaConfig(warps=1, split=2)),
    ("fragment", 4, 64, 384, MmaConfig(warps=2, tiles=2, split=3)),
    ("fragment", 7, 48, 640, MmaConfig(warps=2, split=2, windows=2))])    # M <= 8: two windows a step
def test_in_kernel_split_reduce_equals_the_reduce_kernel(path, M, N, K, cfg, monkeypatch, poisoned):
    """Split-K summed by each tile's last split (atomic counts) gives the bits of the separate reduce
    kernel (same order of the partials), on the CUDA-core, fragment (M <= 4, or <= 8 at two windows
    a step) and swapped tile kernels, for several tiles and splits, and leaves the counts at zero."""
    run = {"gemv": gemm._gemv, "fragment": gemm._mma, "tile": gemm._matmul}[path]
    name = {"gemv": "_nvfp4_gemv_kernel", "fragment": "_nvfp4_mma_kernel", "tile": "_nvfp4_mm_kernel"}[path]
    launched = []
    monkeypatch.setattr(gemm, name, LaunchSpy(getattr(gemm, name), launched))
    monkeypatch.setattr(launch, "_COUNTERS", {})
    gen = torch.Generator().manual_seed(M + N + K)
    packed, scale, gs = random_weight(N, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    bias = torch.randn(N, generator=gen).bfloat16().to(DEV)
    got = run(x, packed, scale, gs, bias, cfg)
    assert [(kw["REDUCE"], kw["NSPLIT"] > 1) for _, kw in launched] == [(True, True)]
    assert len(launch._COUNTERS) == 1 and not next(iter(launch._COUNTERS.values())).buffer.any()
    with _replaced(reduce_in_kernel=False):
        assert torch.equal(got, run(x, packed, scale, gs, bias, cfg))
    assert_close(got, reference_matmul(x, packed, scale, gs, bias), f"in-kernel reduce {path} M={M} {cfg}")


@pytest.mark.gpu
def test_gpu_counters_live_outside_every_graph_pool(monkeypatch):
    """The counters of in-launch sums are allocated by an eager launch, never by a CUDA-graph capture
    (in a capture's pool they fill with other tensors' values, and a carried shrink's readers wait on
    them forever): a device's first counting launch under capture is an error; after an eager one, a
    stream first seen inside a capture takes a row of the buffer allocated before it. Each stream's
    split counts and shrink slots are its own, zero, and the slots come in turn."""
    monkeypatch.setattr(launch, "_COUNTERS", {})
    dev = torch.device("cuda", torch.cuda.current_device())
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(RuntimeError, match="inside a CUDA-graph capture"):
            launch.split_counts(dev, 1)
    assert not launch._COUNTERS
    eager = launch.split_counts(dev, 1)
    buffer = launch._COUNTERS[dev].buffer
    side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        counts = launch.split_counts(dev, 1)
        slots = [launch.shrink_flags(dev).data_ptr() for _ in range(launch.SHRINK_SLOTS + 1)]
        counts.add_(0)                                       # a kernel, so that the graph is not empty
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * 4
    assert launch._COUNTERS[dev].buffer is buffer and start <= counts.data_ptr() < end
    assert counts.data_ptr() - eager.data_ptr() == buffer.stride(0) * 4             # the next row
    assert len(set(slots)) == launch.SHRINK_SLOTS and slots[-1] == slots[0]
    assert counts.data_ptr() + launch.SPLIT_COUNTS * 4 <= min(slots) and max(slots) < end
    assert not buffer.any()


_GEMV_CFGS = [GemvConfig(), GemvConfig(bn=16, bk=64, split=3), GemvConfig(bn=32, bk=32)]


# K = 1056 (two 1024-k steps, the second a 32-k tail) on the default config only: on the two small-step
# configs it repeats what K = 272 and 80 already run there (split-K, several steps a split, a tail in the
# last split for bk = 64, none for bk = 32) at 6 to 11 times the interpreter's time.
@pytest.mark.parametrize("M,N,K,cfg", [(1, N, K, cfg) for N, K in [(16, 16), (16, 32), (48, 80), (32, 272), (64, 1056)]
                                       for i, cfg in enumerate(_GEMV_CFGS) if K != 1056 or i == 0],
                         ids=lambda v: f"cfg{_GEMV_CFGS.index(v)}" if isinstance(v, GemvConfig) else None)
@pytest.mark.parametrize("has_bias", [False, True])
def test_cuda_core_gemv_matches_float64(M, N, K, cfg, has_bias, poisoned):
    """The CUDA-core kernel (one row): minimum N and K, a K tail, split-K and single pass."""
    check_forward(lambda *a: gemm._gemv(*a, cfg), M, N, K, has_bias, M * 1000 + N + K + cfg.bk + has_bias,
                  f"gemv M={M} N={N} K={K} {cfg}")


def test_gemv_scales_each_lane_step_of_x(poisoned):
    """The GEMV sums each lane's 32 k of a step in fp16 with one power of two (gemv._gemv_row): x at
    any magnitude from 2^-100 to 2^29, or spread over 2^-40 .. 2^20 block by block, matches float64
    as closely as x ~ 1 does; a 16-k block 2^120 below the other block of its 32 k adds exactly
    nothing; |x| >= 2^30 anywhere makes the row NaN (fp16 would overflow), and x = 0 gives 0."""
    N, K, cfg = 48, 512, GemvConfig(bn=16, bk=256)
    gen = torch.Generator().manual_seed(7)
    packed, scale, gs = random_weight(N, K, gen)
    sign = torch.where(torch.rand(1, K, generator=gen) < 0.5, -1.0, 1.0)
    base = sign * (0.5 + 0.5 * torch.rand(1, K, generator=gen))               # |x| in [0.5, 1)

    def run(x):
        x = x.bfloat16().to(DEV)
        return gemm._gemv(x, packed, scale, gs, None, cfg), reference_matmul(x, packed, scale, gs)

    for e in (-100, -60, -20, 0, 20, 29):
        y, ref = run(base * 2.0 ** e)
        assert assert_close(y, ref, f"|x| ~ 2^{e}") < 4e-3
    spread = 2.0 ** torch.randint(-40, 21, (K // 16,), generator=gen).repeat_interleave(16).float()
    y, ref = run(base * spread)
    assert assert_close(y, ref, "blocks 2^-40 .. 2^20") < 4e-3
    tiny = base.clone()
    tiny[0, 32:48] *= 2.0 ** -120                                             # k 48..63 sets its 2^c
    zeroed = base.clone()
    zeroed[0, 32:48] = 0
    assert torch.equal(run(tiny)[0], run(zeroed)[0])
    huge = base.clone()
    huge[0, 100] = 2.0 ** 30
    assert torch.isnan(run(huge)[0]).all()
    assert (run(torch.zeros(1, K))[0] == 0).all()


@pytest.mark.parametrize("M,N,K,R,cuts,cfg,il,tune,where", [
    (1, 48, 352, 24, (16, 32), GemvConfig(bn=16, bk=64, split=3), False, {}, "last split"),   # the last split 1.5 steps
    (1, 64, 512, 16, None, GemvConfig(bn=32, bk=64, split=1), False, {}, "kernel"),      # one pass: every program
    (1, 32, 272, 40, (20, 32), GemvConfig(), False, {}, "kernel"),
    (9, 144, 512, 24, (100, 120), TileConfig(bm=16, bn=64, bk=64, warps=4, stages=2, split=3), False, {}, "last split"),
    (16, 64, 256, 96, None, TileConfig(bm=16, bn=64, bk=64, warps=4, stages=2, split=1), False, {}, "kernel"),
    # the fragment kernel: one token tile (M <= 8) and two, unsplit, summed by its last split, or
    # followed by the reduce kernel; an odd rank and a q/k/v group's, the plain and interleaved layouts
    (2, 48, 256, 24, None, MmaConfig(warps=1, split=1), False, {}, "kernel"),
    (9, 64, 256, 96, (40, 48), MmaConfig(warps=2, split=1), True, {}, "kernel"),
    (5, 80, 512, 96, None, MmaConfig(warps=2, split=2, windows=2), True, {}, "last split"),
    (16, 48, 384, 24, (8, 24), MmaConfig(warps=1, tiles=2, split=3), False, dict(fragment_reduce_max_m=16),
     "last split"),
    (8, 64, 384, 40, (24, 64), MmaConfig(warps=2, split=3), True, {}, "reduce kernel"),
    (16, 48, 384, 96, (32, 40), MmaConfig(warps=1, tiles=2, split=3), False, {}, "reduce kernel")])
@pytest.mark.parametrize("has_bias", [False, True])
def test_kernels_fold_the_lora_update(M, N, K, R, cuts, cfg, il, tune, where, has_bias, monkeypatch, poisoned):
    """matmul's lora = Fold(hp, B, s, cuts): the GEMV, the swapped tiles and the fragment kernel
    (folds_lora's routes) add s · bf16(Σ_j hp[j]) · Bᵀ to the rows they finish (`where`: every program
    of an unsplit launch, the last split, or the reduce kernel after a split fragment launch; the
    launch records say which ran). With cuts, B is an adapter group's compact B (two or three members,
    tiles straddling them, N2 = N for two): each column takes its own member's ranks of h. Against
    float64 (the base, plus the update with h rounded to bf16 as the expand kernel rounds it, B laid
    out block-diagonal here), and element by element against the kernel's own base output plus the
    float64 update: one bf16 rounding of the sum (what lora.lora_expand_ does to a stored y), at most
    half a unit in the last place."""
    import nvfp4
    wrapper, kernel = {GemvConfig: ("_gemv", "_nvfp4_gemv_kernel"), TileConfig: ("_matmul", "_nvfp4_mm_kernel"),
                       MmaConfig: ("_mma", "_nvfp4_mma_kernel")}[type(cfg)]
    launched = []
    for name in (kernel, "_splitk_reduce_lora_kernel"):
        monkeypatch.setattr(gemm, name, LaunchSpy(getattr(gemm, name), launched))
    gen = torch.Generator().manual_seed(M + N + K + R + has_bias)
    packed, scale, gs = random_weight(N, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    bias = torch.randn(N, generator=gen).bfloat16().to(DEV) if has_bias else None
    hp = torch.randn(3, M, R, generator=gen).to(DEV)                     # three K-chunk partials
    B = (torch.randn(N, R // gemm.lora_parts(cuts, N), generator=gen) * 0.2).bfloat16().to(DEV)
    w = nvfp4.interleave(packed, scale) if il else (packed, scale)
    run = getattr(gemm, wrapper)
    with _replaced(**tune):
        got = run(x, *w, gs, bias, cfg, gemm.Fold(hp, B, 0.75, cuts=cuts), il)
        (_, kw), *after = launched
        assert where == ("reduce kernel" if len(after) == 1 and not kw["LORA"] else
                         "last split" if kw["LORA"] and kw["REDUCE"] else "kernel" if kw["LORA"] else "nowhere")
        plain = run(x, *w, gs, bias, cfg, None, il)
    h = (hp[0] + hp[1] + hp[2]).bfloat16().double()
    update = 0.75 * h @ block_diagonal(B, cuts, R).double().t()
    want = reference_matmul(x, packed, scale, gs, bias) + update
    assert_close(got, want, f"{wrapper} + lora M={M} N={N} K={K} R={R} {cfg}")
    exact = plain.double() + update
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()


@pytest.mark.parametrize("M,N,K,R,cfg,il", [
    (8, 64, 384, 40, MmaConfig(warps=2, split=3), True),
    (16, 48, 384, 96, MmaConfig(warps=1, tiles=2, split=3), False),
    (3, 32, 1024, 8, MmaConfig(warps=1, split=4), False)])
def test_reduce_launch_carries_the_shrink(M, N, K, R, cfg, il, monkeypatch, poisoned):
    """matmul's lora = Fold(hp, B, s, shrink=lora.carried_shrink(x, A, B)) on a split fragment launch
    that leaves its sum to the reduce kernel: the reduce launch computes h = x Aᵀ in its first programs
    (NS of them) and its other programs wait for it before they add the update. Against float64 (the
    base plus the update, h rounded to bf16), and bit for bit the same product with h from the shrink
    launch (the same chunk sums); the flags are left zero. A fragment launch that stores y itself
    refuses a carried shrink (it has no programs for it)."""
    import nvfp4
    from kernels import lora as kl
    launched = []
    monkeypatch.setattr(gemm, "_splitk_reduce_lora_kernel", LaunchSpy(gemm._splitk_reduce_lora_kernel, launched))
    gen = torch.Generator().manual_seed(M + N + K + R)
    packed, scale, gs = random_weight(N, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    A = (torch.randn(R, K, generator=gen) / K ** 0.5).bfloat16().to(DEV)
    B = (torch.randn(N, R, generator=gen) * 0.2).bfloat16().to(DEV)
    w = nvfp4.interleave(packed, scale) if il else (packed, scale)
    with _replaced(fragment_reduce_max_m=1, pair_reduce_max_m=1):       # the split sum to the reduce kernel
        hp, carry = kl.carried_shrink(x, A, B)
        got = gemm._mma(x, *w, gs, None, cfg, gemm.Fold(hp, B, 0.75, True, carry), il)
        assert len(launched) == 1 and launched[0][1]["NS"] == -(-R // 16) * -(-K // 256)
        apart = gemm._mma(x, *w, gs, None, cfg, gemm.Fold(kl.lora_shrink(x, A, B), B, 0.75), il)
    h = (x.double() @ A.double().t()).bfloat16().double()
    want = reference_matmul(x, packed, scale, gs, None) + 0.75 * h @ B.double().t()
    assert_close(got, want, f"carried shrink M={M} N={N} K={K} R={R} {cfg}")
    assert torch.equal(got, apart) and not carry.flags.any()
    hp, carry = kl.carried_shrink(x, A, B)
    with pytest.raises(ValueError, match="carried shrink"):
        gemm._mma(x, *w, gs, None, MmaConfig(warps=1, split=1), gemm.Fold(hp, B, 0.75, True, carry), il)


def test_lora_update_only_where_it_folds():
    """matmul takes a LoRA update in the partials form only where folds_lora holds, and only
    well-formed: a clear error otherwise, never a silent unfolded result. On this device's routes
    (no register-A kernel) every decode row folds: the GEMV's and the swapped tiles' (partials summed
    in-kernel: reduce_in_kernel), the fragment kernel's (K a multiple of 128, which
    the reduce kernel serves where the fragment launch does not sum in-kernel)."""
    gen = torch.Generator().manual_seed(3)
    packed, scale, gs = random_weight(32, 64, gen)
    hp, B = torch.zeros(1, 1, 8, device=DEV), torch.zeros(32, 8, dtype=torch.bfloat16, device=DEV)
    x1 = torch.randn(1, 64, generator=gen).bfloat16().to(DEV)

    def folds(K):
        return [m for m in range(1, 18) if gemm.folds_lora(m, 32, K, x1.device, False)]

    assert folds(128) == folds(64) == list(range(1, 17))
    with _replaced(reduce_in_kernel=False):
        assert folds(64) == [] and folds(128) == list(range(2, 17))
        with pytest.raises(ValueError, match="reduce_in_kernel|folds_lora"):
            gemm._gemv(x1, packed, scale, gs, None, GemvConfig(bn=16, bk=32, split=2), (hp, B, 1.0))
    with pytest.raises(ValueError, match="fp32"):
        gemm.matmul(x1, packed, scale, gs, lora=(hp.bfloat16(), B, 1.0))
    with pytest.raises(ValueError, match="B must be"):
        gemm.matmul(x1, packed, scale, gs, lora=(hp, B[:16], 1.0))
    with pytest.raises(ValueError, match="reduce_folds_lora"):     # the h form: the register-A route only
        gemm.matmul(x1, packed, scale, gs, lora=(hp[0].bfloat16(), B, 1.0))
    strided = torch.randn(1, 128, generator=gen).bfloat16().to(DEV)[:, ::2]     # (1, 64), not contiguous
    with pytest.raises(ValueError, match="contiguous"):           # a copy of x would land after the shrink
        gemm.linear(strided, packed, scale, gs, lora=(hp, B, 1.0))


def test_lora_folds_at_decode_on_the_7b_shapes(monkeypatch):
    """folds_lora on an H100 / H200 (132 SMs, the register-A kernel running: gluon_runs patched) for
    Qwen2.5-7B's interleaved projections at decode: everywhere but gate_up at 2..16 rows, whose
    register-A launch does not split K (its 592 row tiles take the decode share of a wave alone:
    wgmma_reduces), so its kernel stores y and the expand kernel stays; down from 2 rows folds into
    the register-A route's reduce kernel, which computes the shrink too (carries_shrink), as it does
    for every group at 16 and 32 rows. matmul refuses gate_up's update there rather than drop it."""
    monkeypatch.setattr(launch, "num_sms", lambda device: 132)
    monkeypatch.setattr(gemm, "gluon_runs", lambda device, interleaved: interleaved)
    cpu, rows = torch.device("cpu"), (1, 2, 4, 8, 16)
    qwen7b = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
    table = {name: [gemm.folds_lora(M, N, K, cpu, True) for M in rows] for name, (N, K) in qwen7b.items()}
    assert table == {"qkv": [True] * 5, "o": [True] * 5, "gate_up": [True] + [False] * 4, "down": [True] * 5}
    assert [gemm.route(M, *qwen7b["down"], cpu, True) for M in rows] == ["gemv"] + ["wgmma"] * 4
    assert [gemm.route(M, *qwen7b["gate_up"], cpu, True) for M in rows] == ["gemv"] + ["wgmma"] * 4
    # the reduce kernel carries the shrink where it adds the update: after down's split register-A
    # launch from 2 rows, after every split launch at 16 and 32
    carried = {name: [gemm.carries_shrink(M, N, K, cpu, True) for M in rows + (32,)] for name, (N, K) in qwen7b.items()}
    assert carried == {"qkv": [False] * 4 + [True] * 2, "o": [False] * 4 + [True] * 2,
                       "gate_up": [False] * 6, "down": [False] + [True] * 5}
    N, K = qwen7b["gate_up"]
    w = torch.zeros(N, K // 2, dtype=torch.uint8), torch.zeros(N, K // 16, dtype=torch.float8_e4m3fn), torch.ones(1)
    with pytest.raises(ValueError, match="folds_lora"):
        gemm.matmul(torch.zeros(8, K, dtype=torch.bfloat16), *w, interleaved=True,
                    lora=(torch.zeros(1, 8, 64), torch.zeros(N, 64, dtype=torch.bfloat16), 1.0))


@pytest.mark.parametrize("N,K,cfg,il", [
    (64, 1056, GemvConfig(), False),                     # one program, a K tail
    (96, 128, GemvConfig(bn=16, bk=64), False),          # 6 programs of 8 gate + 8 up rows, 2 steps each
    (160, 384, GemvConfig(bn=64, bk=128), True)])        # interleaved, I = 80: a part tile
@pytest.mark.parametrize("with_lora", [None, "adapter", "group"])
def test_gemv_stores_silu_mul(N, K, cfg, il, with_lora, poisoned):
    """matmul's silu_mul at M = 1: W stacks gate and up (N = 2I), each GEMV program takes gate rows
    j and up rows I + j and stores silu(gate)·up (1, I). The bits of the plain GEMV followed by
    fused_ops.silu_mul on its two halves (with a LoRA update folded in first, as the plain GEMV folds
    it: one adapter's B, or the gate/up group's compact B, each program's rows from both members),
    and float64 silu(g)·u within bf16 tolerance."""
    import nvfp4
    gen = torch.Generator().manual_seed(N + K + len(with_lora or ""))
    packed, scale, gs = random_weight(N, K, gen)
    x = torch.randn(1, K, generator=gen).bfloat16().to(DEV)
    hp, B = torch.randn(2, 1, 16, generator=gen).to(DEV), (torch.randn(N, 8, generator=gen) * 0.2).bfloat16().to(DEV)
    lora = {None: None, "adapter": gemm.Fold(hp[..., :8].contiguous(), B, 0.5),
            "group": gemm.Fold(hp, B, 0.5, cuts=(N // 2, N))}[with_lora]
    w = nvfp4.interleave(packed, scale) if il else (packed, scale)
    got = gemm._gemv(x, *w, gs, None, cfg, lora, il, silu_mul=True)
    y = gemm._gemv(x, *w, gs, None, cfg, lora, il)                                        # (1, N)
    check_silu_mul(got, y, x, packed, scale, gs, lora, f"silu_mul N={N} K={K} {cfg}")


def test_silu_mul_only_where_it_folds():
    """silu_mul runs on the GEMV's row only (folds_silu) and on N = 2I with I a multiple of 16: a
    clear error otherwise, never a silent unfused result."""
    gen = torch.Generator().manual_seed(5)
    assert [m for m in range(1, 17) if gemm.folds_silu(m)] == [1]
    packed, scale, gs = random_weight(64, 128, gen)
    with pytest.raises(ValueError, match="silu_mul"):
        gemm.matmul(torch.randn(2, 128).bfloat16().to(DEV), packed, scale, gs, silu_mul=True)
    packed, scale, gs = random_weight(48, 128, gen)
    with pytest.raises(ValueError, match="silu_mul"):
        gemm.matmul(torch.randn(1, 128).bfloat16().to(DEV), packed, scale, gs, silu_mul=True)


@pytest.mark.parametrize("M,N,K", [(1, 16, 128), (3, 48, 256), (8, 64, 384), (9, 80, 128), (16, 32, 256), (6, 16, 640)])
@pytest.mark.parametrize("cfg", [MmaConfig(), MmaConfig(warps=2, tiles=2, split=2),
                                 MmaConfig(warps=1, tiles=4, split=1), MmaConfig(warps=2, split=3, windows=2),
                                 MmaConfig(warps=1, split=1, windows=4)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_fragment_kernel_matches_float64(M, N, K, cfg, has_bias, poisoned):
    """The fragment kernel (mma.sync on registers decoded in place; M <= 16, K a multiple of 128):
    one and two token tiles, odd M, N not a multiple of the program's rows (wrapped rows must not
    be stored), several windows, a single pass and split-K, one, two or four windows a step (a
    split's last step part past its windows: loads masked to zero). On the CPU the PTX is replaced
    by its plain-fp32 emulation, so this checks the index maps; the GPU run checks the PTX itself."""
    check_forward(lambda *a: gemm._mma(*a, cfg), M, N, K, has_bias, M * 1000 + N + K + cfg.tiles + has_bias,
                  f"mma M={M} N={N} K={K} {cfg}")


def test_gemv_one_wave_split_is_right(monkeypatch, poisoned):
    """A GEMV launch through the one-wave split (1024-k steps on a pretend 1-SM device: 5 program
    slots over 2 tiles, 2 splits of 3 steps), summed in-kernel, against float64."""
    monkeypatch.setattr(launch, "num_sms", lambda device: 1)
    launched = []
    monkeypatch.setattr(gemm, "_nvfp4_gemv_kernel", LaunchSpy(gemm._nvfp4_gemv_kernel, launched))
    gen = torch.Generator().manual_seed(1)
    packed, scale, gs = random_weight(64, 6144, gen)
    x = torch.randn(1, 6144, generator=gen).bfloat16().to(DEV)
    got = gemm._gemv(x, packed, scale, gs, None, GemvConfig(bn=32, bk=1024))
    assert [(kw["NSPLIT"], kw["REDUCE"]) for _, kw in launched] == [(2, True)]
    assert_close(got, reference_matmul(x, packed, scale, gs, None), "gemv M=1 one-wave split")


@pytest.mark.parametrize("M", [6, 8])
def test_fragment_kernel_cuts_long_runs_at_one_token_tile(M, monkeypatch, poisoned):
    """At M = 5..8 a program the split rule leaves >= long_run_windows windows long is cut to runs
    of long_run_cut at two windows a step, its partials summed in-kernel; y is right (on 4 CPU
    'SMs' 16 tiles of 16 rows need no split: 13 windows a program, cut to 2 splits of 8, the second
    split's last 3 windows past K, masked)."""
    monkeypatch.setattr(launch, "num_sms", lambda device: 4)
    launched = []
    monkeypatch.setattr(gemm, "_nvfp4_mma_kernel", LaunchSpy(gemm._nvfp4_mma_kernel, launched))
    gen = torch.Generator().manual_seed(M)
    packed, scale, gs = random_weight(256, 13 * 128, gen)
    x = torch.randn(M, 13 * 128, generator=gen).bfloat16().to(DEV)
    got = gemm._mma(x, packed, scale, gs, None, MmaConfig(warps=1))
    assert [(kw["U"], kw["REDUCE"], kw["NSPLIT"]) for _, kw in launched] == [(2, True, 2)]
    assert_close(got, reference_matmul(x, packed, scale, gs, None), f"mma M={M} long run cut")


@pytest.mark.parametrize("M", [3, 8, 12])
def test_fragment_kernel_loads_ahead_or_not_with_the_same_result(M, monkeypatch, poisoned):
    """The loop that loads its next step before it decodes this one (AHEAD: by default at 5..8
    rows only) and the one that does not, each forced at one and two token tiles, against float64:
    three windows a split at two a step, so each split's last step is part past its windows and
    the step loaded ahead of the last one is wholly past them (masked to zero, never used)."""
    launched = []
    monkeypatch.setattr(gemm, "_nvfp4_mma_kernel", LaunchSpy(gemm._nvfp4_mma_kernel, launched))
    gen = torch.Generator().manual_seed(M)
    packed, scale, gs = random_weight(80, 640, gen)
    x = torch.randn(M, 640, generator=gen).bfloat16().to(DEV)
    want = reference_matmul(x, packed, scale, gs, None)
    gemm._mma(x, packed, scale, gs, None, MmaConfig(warps=2, split=2, windows=2))
    for ahead in (True, False):
        with _replaced(ahead_min_m=1 if ahead else 17, ahead_max_m=16):
            got = gemm._mma(x, packed, scale, gs, None, MmaConfig(warps=2, split=2, windows=2))
        assert_close(got, want, f"mma M={M} ahead={ahead}")
    assert [kw["AHEAD"] for _, kw in launched] == [4 < M <= 8, True, False]


def test_fragment_kernel_sums_in_kernel_or_leaves_it_to_the_reduce_kernel(monkeypatch):
    """Which fragment launches sum their own partials: the one of M = 3 (split 2), not the M = 12
    one the reduce kernel follows (split 2), and the unsplit M = 12 one writes y itself; y is
    right on each."""
    launched = []
    monkeypatch.setattr(gemm, "_nvfp4_mma_kernel", LaunchSpy(gemm._nvfp4_mma_kernel, launched))
    gen = torch.Generator().manual_seed(0)
    packed, scale, gs = random_weight(48, 640, gen)
    with _replaced(fragment_reduce_max_m=4, pair_reduce_max_m=8):
        for M, split in ((3, 2), (12, 2), (12, 1)):
            x = torch.randn(M, 640, generator=gen).bfloat16().to(DEV)
            assert_close(gemm._mma(x, packed, scale, gs, None, MmaConfig(warps=2, split=split)),
                         reference_matmul(x, packed, scale, gs, None), f"mma M={M} split {split}")
    assert [(kw["REDUCE"], kw["PARTIAL"]) for _, kw in launched] == [(True, True), (False, True), (False, False)]


@pytest.mark.parametrize("M,cfg,reduce", [(12, MmaConfig(warps=2, split=2, windows=2), True),
                                          (9, MmaConfig(warps=2, split=3), True),
                                          (16, MmaConfig(warps=2, split=3, windows=2), False)])
def test_fragment_kernel_sums_two_token_tiles_in_kernel(M, cfg, reduce, monkeypatch, poisoned):
    """At M > 8 (two token tiles) the kernel's last split sums both tiles' partials when the
    thresholds ask for it (fragment_reduce_max_m at any step, pair_reduce_max_m at two windows a
    step), else the reduce kernel does: the launch says which, and y is right either way (the
    poisoned output catches a token tile left unsummed)."""
    launched = []
    monkeypatch.setattr(gemm, "_nvfp4_mma_kernel", LaunchSpy(gemm._nvfp4_mma_kernel, launched))
    gen = torch.Generator().manual_seed(M)
    packed, scale, gs = random_weight(48, 640, gen)
    x = torch.randn(M, 640, generator=gen).bfloat16().to(DEV)
    with _replaced(fragment_reduce_max_m=4 if M == 16 else 16, pair_reduce_max_m=8 if M == 16 else 16):
        got = gemm._mma(x, packed, scale, gs, None, cfg)
    assert [(kw["REDUCE"], kw["NT"]) for _, kw in launched] == [(reduce, 2)]
    assert_close(got, reference_matmul(x, packed, scale, gs, None), f"mma M={M} {cfg}")


# ----------------------------------------------------------------------------------------------
# GPU: real shapes (Qwen2.5-7B / 32B projections)

@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4608, 3584), (3584, 18944), (55296, 5120)])
@pytest.mark.parametrize("M", [1, 4, 5, 8, 13, 16])          # M <= 4 (<= 8 at U > 1): the in-kernel sum
@pytest.mark.parametrize("cfg", [MmaConfig(4, 1), MmaConfig(4, 2), MmaConfig(8, 2, split=1),
                                 MmaConfig(8, 1, split=5, windows=2), MmaConfig(4, 1, split=9, windows=4)])
def test_fragment_kernel_real_shapes_gpu(N, K, M, cfg, poisoned):
    gen = torch.Generator().manual_seed(N + K + M)
    packed, scale, gs = random_weight(N, K, gen)
    x = torch.randn(M, K, generator=gen).bfloat16().cuda()
    bias = torch.randn(N, generator=gen).bfloat16().cuda()
    assert_close(gemm._mma(x, packed, scale, gs, bias, cfg), reference_matmul(x, packed, scale, gs, bias),
                 f"mma {N}x{K} M={M} {cfg}")
