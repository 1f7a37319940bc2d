"""Benchmark and GPU check of the NVFP4 x BF16 kernels (kernels/gemm.py) against cuBLAS bf16.

For the Qwen2.5-7B and -32B projection shapes (ANCHORS.md) and M in 1..16384 it times, in the
same run: ours y = x·Wᵀ and cuBLAS bf16 x @ w.t() (forward), ours dx = dy·W and cuBLAS dy @ w
(backward-input). Timing: triton.testing.do_bench_cudagraph median (GPU time of graph replays, so
Python launch cost is out; rollout runs under CUDA graphs), and the weights rotate among copies
that together exceed twice the L2, so no call finds its weight cached. Rows at M=1 also report
eager timings (do_bench, L2 flushed before each call, Python launch cost in).
Reported per row: time, effective weight bandwidth (NVFP4 counts 4.5 bits per weight, bf16 16),
speedup = cuBLAS time / our time, and the route (gemm.route) of the forward and of dx.

    python bench/kernel.py                    # check + benchmark, table + bench/kernel.json
    python bench/kernel.py --check            # GPU correctness on the real shapes only
    python bench/kernel.py --ms 1,2,4,8,16 --fwd-only   # a subset
    python bench/kernel.py --floor            # what no kernel reading the weight can beat (see floor())
    python bench/kernel.py --scaling --no-bench --no-check     # one row: time against bytes, cold and hot
    python bench/kernel.py --split-cost --no-bench --no-check   # M = 2..16: the fragment route's split-K sum
    python bench/kernel.py --lora-cost --no-bench --no-check --shapes "7B qkv,7B o,7B gate_up,7B down" --ms 1,8,16
    python bench/kernel.py --lora-trace --no-bench --no-check --shapes "7B qkv,7B o,7B gate_up,7B down" --ms 1,8
    python bench/kernel.py --once "7B gate_up:1,7B down:16"   # one call each, for ncu
    python bench/kernel.py --out DIR          # where the JSON and log go

The weights are random codes and random E4M3 scales (the kernel's speed does not depend on the
values; the correctness check uses fresh random data against a float64 reference). To compare two
trees' kernels in one process: bench/kernel_ab.py; to vary tuning.py's fields in the decode graph:
bench/ab.py.
"""
import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch
import triton
import triton.language as tl
import triton.testing

import nvfp4
from kernels import fused_ops, gemm, launch, shapes, tuning
from kernels import lora as kl
from kernels.fp4_decode import pdl_start
from marlin_kernel import reference_dequantize

# ----------------------------------------------------------------------------------------------
# shapes (N, K) from ANCHORS.md

SHAPES = {
    "7B qkv": (4608, 3584), "7B o": (3584, 3584), "7B gate_up": (37888, 3584), "7B down": (3584, 18944),
    "32B qkv": (7168, 5120), "32B o": (5120, 5120), "32B gate_up": (55296, 5120), "32B down": (5120, 27648),
}
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 16384)


def random_weight(N, K, device, gen):
    """Random NVFP4 weight: every code, scales spread over E4M3's normal and subnormal range."""
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=device, generator=gen)
    s = torch.exp2(torch.rand(N, K // 16, device=device, generator=gen) * 16 - 8)   # 2^-8 .. 2^8
    scale = s.to(torch.float8_e4m3fn)
    global_scale = torch.tensor([448.0 * 6 / 3.0], device=device)
    return packed, scale, global_scale


def shipped_weight(N, K, device, gen):
    """random_weight in the layout NVFP4Linear holds on CUDA (nvfp4.interleave; every SHAPES has
    K % 128 == 0): what the table times."""
    packed, scale, global_scale = random_weight(N, K, device, gen)
    return (*nvfp4.interleave(packed, scale), global_scale)


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def poison_allocator(numel, device):
    """Fill a block with NaN and free it: the next torch.empty of that size reuses it, so an
    element the kernel forgets to write stays NaN."""
    torch.full((numel,), float("nan"), dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------------------------
# correctness on the GPU

def check(device, log):
    gen = torch.Generator(device=device).manual_seed(1234)
    ok = True
    # 1. every code and scale decodes right: x = I gives y = Wᵀ exactly (up to bf16 rounding)
    packed, scale, gs = random_weight(64, 256, device, gen)
    eye = torch.eye(256, device=device, dtype=torch.bfloat16)
    W = reference_dequantize(packed, scale, gs)                          # (64, 256) f64
    y = gemm.nvfp4_matmul(eye, packed, scale, gs)                        # (256, 64)
    bad = (y.double() - W.t()).abs() > 2.0 ** -8 * W.t().abs()           # > 1 bf16 rounding
    if bad.any():
        ok = False
        codes = torch.stack([packed & 15, packed >> 4], -1).flatten(-2).t()[bad]
        log(f"DECODE MISMATCH at {int(bad.sum())} elements; codes {sorted(set(codes.tolist()))}")
    else:
        log("decode: all codes exact")
    # the CUDA-core kernel (one row) decodes through fp32 subnormals (code 1 = 0.5): same check
    y = torch.cat([gemm._gemv(eye[k:k + 1], packed, scale, gs, None, shapes.GemvConfig()) for k in range(256)])
    bad = (y.double() - W.t()).abs() > 2.0 ** -8 * W.t().abs()
    ok &= not bad.any()
    log(f"gemv decode: {'all codes exact' if not bad.any() else f'MISMATCH at {int(bad.sum())} elements'}")
    # the fragment kernel (M <= 8) decodes inside its mma.sync PTX: same check, 8 rows at a time
    y = torch.cat([gemm._mma(eye[k:k + 8], packed, scale, gs, None, shapes.MmaConfig()) for k in range(0, 256, 8)])
    bad = (y.double() - W.t()).abs() > 2.0 ** -8 * W.t().abs()
    ok &= not bad.any()
    log(f"fragment decode: {'all codes exact' if not bad.any() else f'MISMATCH at {int(bad.sum())} elements'}")
    # 2. real shapes, odd M, bias on/off, against float64
    cases = [(m, name) for name in ("7B qkv", "7B down", "32B gate_up") for m in (1, 5, 7, 16, 33, 100, 300, 1000)]
    cases += [(4096, "7B o"), (1, (16, 16)), (3, (16, 32)), (5, (48, 80)), (129, (272, 176))]
    worst = 0.0
    for M, name in cases:
        N, K = SHAPES[name] if isinstance(name, str) else name
        packed, scale, gs = random_weight(N, K, device, gen)
        W = reference_dequantize(packed, scale, gs)                      # (N, K) f64
        for has_bias in (False, True):
            x = torch.randn(M, K, device=device, generator=gen).bfloat16()
            bias = torch.randn(N, device=device, generator=gen).bfloat16() if has_bias else None
            poison_allocator(max(M * N * 8, 1 << 20), device)
            y = gemm.nvfp4_matmul(x, packed, scale, gs, bias)
            ref = x.double() @ W.t() + (bias.double() if has_bias else 0)
            e = rel_err(y, ref)
            fin = bool(torch.isfinite(y).all())
            worst = max(worst, e)
            good = fin and e < 1e-2
            ok &= good
            log(f"fwd {str(name):>12} M={M:5d} bias={int(has_bias)} rel_err={e:.2e} finite={fin} {'ok' if good else 'FAIL'}")
        dy = torch.randn(M, N, device=device, generator=gen).bfloat16()
        poison_allocator(max(M * K * 8, 1 << 20), device)
        dx = gemm.nvfp4_matmul_dx(dy, packed, scale, gs)
        e = rel_err(dx, dy.double() @ W)
        fin = bool(torch.isfinite(dx).all())
        worst = max(worst, e)
        good = fin and e < 1e-2
        ok &= good
        log(f"dx  {str(name):>12} M={M:5d}        rel_err={e:.2e} finite={fin} {'ok' if good else 'FAIL'}")
        del W
    log(f"check: {'PASS' if ok else 'FAIL'} (worst rel err {worst:.2e})")
    return ok


# ----------------------------------------------------------------------------------------------
# timing

def bench_ms(fn, graph=True, rep=20):
    """Median ms per call. graph=True: CUDA-graph replay (GPU time, no Python launch cost);
    graph=False: eager calls, what an un-captured training step pays."""
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def copies_for(nbytes, device):
    """How many weight copies to rotate so that together they exceed twice the L2."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, min(16, math.ceil(2 * l2 / nbytes)))


class Rotating:
    def __init__(self, items):
        self.items, self.i = items, 0

    def next(self):
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


def time_shape(name, N, K, Ms, device, gen, eager_ms=(1,), fwd_only=False):
    q_bytes = N * K * 4.5 / 8
    b_bytes = N * K * 2
    qs = Rotating([shipped_weight(N, K, device, gen) for _ in range(copies_for(q_bytes, device))])
    ws = Rotating([torch.randn(N, K, device=device, generator=gen).bfloat16()
                   for _ in range(copies_for(b_bytes, device))])
    rows = []
    for M in Ms:
        x = torch.randn(M, K, device=device, generator=gen).bfloat16()
        dy = torch.randn(M, N, device=device, generator=gen).bfloat16()

        def ours_fwd():
            gemm.nvfp4_matmul(x, *qs.next(), interleaved=True)

        def ours_dx():
            gemm.nvfp4_matmul_dx(dy, *qs.next(), interleaved=True)

        r = dict(shape=name, N=N, K=K, M=M, path=gemm.route(M, N, K, x.device, True),
                 dx_path=gemm.route(M, N, K, x.device, True, dx=True))
        r["fwd_ms"] = bench_ms(ours_fwd)
        r["cublas_fwd_ms"] = bench_ms(lambda: x @ ws.next().t())
        r["dx_ms"] = float("nan") if fwd_only else bench_ms(ours_dx)
        r["cublas_dx_ms"] = float("nan") if fwd_only else bench_ms(lambda: dy @ ws.next())
        if M in eager_ms:
            r["eager_fwd_ms"] = bench_ms(ours_fwd, graph=False)
            r["eager_cublas_fwd_ms"] = bench_ms(lambda: x @ ws.next().t(), graph=False)
        r["fwd_speedup"] = r["cublas_fwd_ms"] / r["fwd_ms"]
        r["dx_speedup"] = r["cublas_dx_ms"] / r["dx_ms"]
        r["cublas_fwd_TBps"] = b_bytes / r["cublas_fwd_ms"] / 1e9
        r["fwd_TBps"] = q_bytes / r["fwd_ms"] / 1e9
        r["dx_TBps"] = q_bytes / r["dx_ms"] / 1e9
        r["fwd_TFLOPs"] = 2 * M * N * K / r["fwd_ms"] / 1e9
        r["cublas_fwd_TFLOPs"] = 2 * M * N * K / r["cublas_fwd_ms"] / 1e9
        rows.append(r)
    return rows


# ----------------------------------------------------------------------------------------------
# one call for a profiler

def once(device, cases):
    """One forward call of each "shape:M" case inside an NVTX range named after it, for a profiler,
    on the weights as NVFP4Linear holds them on CUDA (shipped_weight: the interleaved layout):
    ncu --clock-control none --nvtx --nvtx-include "regex:7B.*/" --section WarpStateStats ...
    python bench/kernel.py --once "7B gate_up:1,7B gate_up:16"."""
    gen = torch.Generator(device=device).manual_seed(0)
    for case in cases.split(","):
        name, _, M = case.rpartition(":")
        N, K = SHAPES[name]
        w, x = shipped_weight(N, K, device, gen), torch.randn(int(M), K, device=device, generator=gen).bfloat16()
        gemm.nvfp4_matmul(x, *w, interleaved=True)        # compile outside the range
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"{name} M={M}")
        gemm.nvfp4_matmul(x, *w, interleaved=True)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


# ----------------------------------------------------------------------------------------------
# floors: what the hardware allows under this file's timing

@triton.jit
def _stream_kernel(src_ptr, out_ptr, n_words, chunk, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Read words [pid·chunk, +chunk) of src, BLOCK a step, and store their xor (so that no load
    is dead): a weight's bytes read once, at full coalescing, with no decode and no arithmetic."""
    pdl_start(USE_PDL)
    start = tl.program_id(0) * chunk
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for off in range(start, start + chunk, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, axis=0))


STREAM_BLOCKS = (1024, 2048, 4096)       # int32 words a program loads per step
STREAM_WAVES = (1, 2, 4, 8, 16)          # programs per SM
STREAM_WARPS = (4, 8)


def floor(device, log, names):
    """Per shape, the fastest streaming read of its NVFP4 bytes (packed + scales: N·K·9/16 B) over
    a sweep of launch shapes, timed like the table (graph replays, PDL, copies rotated past the L2),
    and once more with one copy, hot in the L2; and the dequantize pass that the large-M route
    pays before cuBLAS. cuBLAS time / stream time bounds the speedup of any kernel that reads the
    weight once (the decode, the x loads and the output only add to it); cuBLAS / (cuBLAS +
    dequantize) bounds the dequantize route at large M."""
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []
    for name in names:
        N, K = SHAPES[name]
        nbytes = N * K * 9 // 16
        ms, cfg, hot = best_stream(nbytes, device, gen)
        qs = Rotating([shipped_weight(N, K, device, gen) for _ in range(copies_for(nbytes, device))])
        deq = bench_ms(lambda: gemm.dequantize_bf16(*qs.next(), il=True))
        rows.append(dict(shape=name, N=N, K=K, bytes=nbytes, stream_ms=ms, stream_TBps=nbytes / ms / 1e9,
                         stream_hot_ms=hot, block=cfg[0], waves=cfg[1], warps=cfg[2], dequant_ms=deq))
        log(f"floor {name:>11}: {nbytes / 1e6:6.1f} MB  stream {ms * 1e3:6.1f} us ({nbytes / ms / 1e9:4.2f} TB/s; "
            f"block {cfg[0]} words, {cfg[1]} programs/SM, {cfg[2]} warps), hot in L2 {hot * 1e3:5.1f} us, "
            f"dequantize {deq * 1e3:6.1f} us")
        del qs
        torch.cuda.empty_cache()
    return rows


def best_stream(nbytes, device, gen):
    """The fastest streaming read of nbytes (copies rotated past the L2) over STREAM_BLOCKS x
    STREAM_WAVES x STREAM_WARPS, and the same launch on one copy, hot in the L2.
    -> (ms, (block, waves, warps), hot ms)."""
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count
    words = nbytes // 4
    bufs = [torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device=device, generator=gen)
            for _ in range(copies_for(nbytes, device))]
    sink = torch.empty(16 * n_sm, dtype=torch.int32, device=device)
    best = (float("inf"), None, None)
    for block in STREAM_BLOCKS:
        for waves in STREAM_WAVES:
            chunk = triton.cdiv(triton.cdiv(words, waves * n_sm), block) * block
            for warps in STREAM_WARPS:
                def run(src, chunk=chunk, block=block, warps=warps):
                    _stream_kernel[(triton.cdiv(words, chunk),)](
                        src, sink, words, chunk, BLOCK=block, num_warps=warps, **launch.pdl_launch(device))
                rot = Rotating(bufs)
                ms = bench_ms(lambda: run(rot.next()))
                if ms < best[0]:
                    best = (ms, (block, waves, warps), run)
    ms, cfg, run = best
    return ms, cfg, bench_ms(lambda: run(bufs[0]))


SCALING = {"N grown, K 3584": [(n, 3584) for n in (3584, 4608, 7168, 14336, 18944, 37888, 75776)],
           "K grown, N 3584": [(3584, k) for k in (3584, 7168, 14336, 18944, 37888)]}


def size_scaling(device, log):
    """The one-row GEMV against the size of its weight, beside the streaming read of the same bytes,
    each fitted as t = c + bytes / rate: c is what a launch costs whatever its size (ramp-up, the
    last wave, the epilogue), rate its steady pace. The GEMV is timed cold (copies rotated past the
    L2, as the table) and, where one copy fits in half the L2, hot (one copy): if hot is no faster,
    the pace is set inside the SMs (instructions, their dependent chains), not by HBM."""
    gen = torch.Generator(device=device).manual_seed(1)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    out = {}
    for series, cases in SCALING.items():
        rows = []
        for N, K in cases:
            nbytes = N * K * 9 // 16
            qs = Rotating([shipped_weight(N, K, device, gen) for _ in range(copies_for(nbytes, device))])
            x = torch.randn(1, K, device=device, generator=gen).bfloat16()
            r = dict(N=N, K=K, MB=nbytes / 1e6,
                     gemv_us=1e3 * bench_ms(lambda: gemm.nvfp4_matmul(x, *qs.next(), interleaved=True)))
            if nbytes <= l2 // 2:
                w = qs.items[0]
                r["gemv_hot_us"] = 1e3 * bench_ms(lambda: gemm.nvfp4_matmul(x, *w, interleaved=True))
            r["stream_us"] = 1e3 * best_stream(nbytes, device, gen)[0]
            log(f"scaling {series}: N {N:6d} K {K:6d} {r['MB']:7.1f} MB  GEMV {r['gemv_us']:6.2f} us "
                f"(hot {r.get('gemv_hot_us', float('nan')):6.2f})  stream {r['stream_us']:6.2f} us")
            rows.append(r)
        fits = {}
        for key in ("gemv_us", "gemv_hot_us", "stream_us"):
            pts = [(r["MB"], r[key]) for r in rows if key in r]
            if len(pts) < 2:                 # hot in L2: no two sizes fit half this GPU's L2
                continue
            slope, c = statistics.linear_regression([p[0] for p in pts], [p[1] for p in pts])
            fits[key] = dict(fixed_us=c, TBps=1 / slope)
            log(f"scaling {series}: {key:11s} {c:5.2f} us + bytes at {1 / slope:4.2f} TB/s")
        out[series] = dict(rows=rows, fits=fits)
    return out


def floor_table(floors, rows, log):
    """Against the table's rows of the same run: the best speedup any kernel reading the weight
    once could reach at M <= 64 (cuBLAS / stream), ours as a share of the stream's speed, and at
    M >= 512 the dequantize route's bound (cuBLAS / (cuBLAS + dequantize))."""
    by = {f["shape"]: f for f in floors}
    log("# x = cuBLAS / ours; cap = cuBLAS / stream (M <= 64), cuBLAS / (cuBLAS + dequantize) (M >= 512)")
    log(f"{'shape':>11} {'M':>5} | {'ours x':>6} {'cap':>5} {'ours/stream':>11} | {'dx x':>5} {'dx cap':>6} | path")
    for r in rows:
        f = by.get(r["shape"])
        if f is None or 64 < r["M"] < 512:
            continue
        if r["M"] <= 64:
            cap, dcap = r["cublas_fwd_ms"] / f["stream_ms"], r["cublas_dx_ms"] / f["stream_ms"]
            share = f["stream_ms"] / r["fwd_ms"]
        else:
            cap = r["cublas_fwd_ms"] / (r["cublas_fwd_ms"] + f["dequant_ms"])
            dcap, share = r["cublas_dx_ms"] / (r["cublas_dx_ms"] + f["dequant_ms"]), float("nan")
        r["cap"], r["dx_cap"] = cap, dcap
        log(f"{r['shape']:>11} {r['M']:5d} | {r['fwd_speedup']:6.2f} {cap:5.2f} {share:11.2f} | "
            f"{r['dx_speedup']:5.2f} {dcap:6.2f} | {r['path']} / {r['dx_path']}")


@contextlib.contextmanager
def unsummed_splits():
    """The fragment route's split-K partials written and left unsummed (no in-kernel sum, no
    reduce kernel): y is wrong, so this is for timing only."""
    saved = gemm._reduce
    gemm._reduce = lambda part, global_scale, bias, out, lora=None: out
    try:
        with tuning.using(dataclasses.replace(tuning.current(), reduce_in_kernel=False)):
            yield
    finally:
        gemm._reduce = saved


def split_cost(device, log, names, Ms):
    """What the in-kernel split-K sum costs where the fragment kernel runs (the route's MmaConfig,
    M >= 2): cuBLAS, the shipped launch, and the same launch with its partials left unsummed, timed
    like the table. cuBLAS / unsummed bounds what any cheaper sum of the same launch could reach.
    Only launches whose last split sums (fragment_sums_in_kernel): where the reduce kernel follows
    instead, leaving it out also changes how back-to-back calls overlap under PDL, which this
    difference cannot separate."""
    gen = torch.Generator(device=device).manual_seed(2)
    rows = []
    log(f"{'shape':>11} {'M':>3} | {'cuBLAS':>7} {'route':>7} {'x':>5} | {'unsummed':>8} {'x':>5} | split sum us")
    for name in names:
        N, K = SHAPES[name]
        qs = Rotating([shipped_weight(N, K, device, gen) for _ in range(copies_for(N * K * 9 / 16, device))])
        ws = Rotating([torch.randn(N, K, device=device, generator=gen).bfloat16()
                       for _ in range(copies_for(N * K * 2, device))])
        for M in Ms:
            cfg = shapes.fwd_config(M, N, K)
            if gemm.route(M, N, K, device, True) != "fragment":
                continue
            split, _, step = shapes.mma_launch(cfg, M, shapes.mma_tiles(N, cfg), K, device)
            if split == 1 or not gemm.fragment_sums_in_kernel(M, step):
                continue
            x = torch.randn(M, K, device=device, generator=gen).bfloat16()
            cublas = bench_ms(lambda: x @ ws.next().t())
            route = bench_ms(lambda: gemm._mma(x, *qs.next(), None, cfg, il=True))
            with unsummed_splits():
                bare = bench_ms(lambda: gemm._mma(x, *qs.next(), None, cfg, il=True))
            rows.append(dict(shape=name, M=M, cublas_ms=cublas, route_ms=route, unsummed_ms=bare))
            log(f"{name:>11} {M:3d} | {cublas * 1e3:7.2f} {route * 1e3:7.2f} {cublas / route:5.2f} | "
                f"{bare * 1e3:8.2f} {cublas / bare:5.2f} | {(route - bare) * 1e3:5.2f}")
        del qs, ws
        torch.cuda.empty_cache()
    return rows


# the adapters train.py attaches at decode: rank 32 on each projection, q/k/v and gate/up each one
# group whose B is compact (lora.group_casts): a projection's members' output sizes
LORA_RANK = 32
LORA_MEMBERS = {"7B qkv": (3584, 512, 512), "7B gate_up": (18944, 18944),
                "32B qkv": (5120, 1024, 1024), "32B gate_up": (27648, 27648)}


def lora_calls(x, w, A, B, cuts, scale):
    """The decode sequences lora_cost compares for one projection (w shipped: interleaved), each a
    callable -> y: the base matmul alone; with the update folded in from an h computed once before
    (what the fold itself costs); the shrink launch and then the folding matmul, as decode runs
    where gemm.folds_lora holds, or else the shrink, the matmul and the expand kernel."""
    M, K = x.shape
    N = w[0].shape[0]
    calls = {"plain": lambda: gemm.matmul(x, *w, interleaved=True)}
    if gemm.folds_lora(M, N, K, x.device, True):
        hp = kl.shrink(x, A, B)
        calls["fold, h given"] = lambda: gemm.matmul(x, *w, interleaved=True, lora=gemm.Fold(hp, B, scale, cuts=cuts))
        calls["shrink + fold"] = lambda: adapted(x, w, A, B, cuts, scale)
    else:
        calls["shrink + expand"] = lambda: adapted(x, w, A, B, cuts, scale)
    return calls


def adapted(x, w, A, B, cuts, scale):
    """x·Wᵀ + s·(x Aᵀ)Bᵀ as decode runs it: the shrink, then the matmul folding the update where
    gemm.folds_lora holds, else the matmul and the expand kernel."""
    hp = kl.shrink(x, A, B)
    if gemm.folds_lora(x.shape[0], w[0].shape[0], x.shape[1], x.device, True):
        return gemm.matmul(x, *w, interleaved=True, lora=gemm.Fold(hp, B, scale, cuts=cuts))
    return kl.lora_expand_(hp, B, gemm.matmul(x, *w, interleaved=True), scale, cuts=cuts)


def lora_operands(name, device, gen):
    """(N, K, R, rotated shipped weights, A (R, K), B, cuts) of one SHAPES projection with train.py's
    adapters: rank LORA_RANK for each member (LORA_MEMBERS, else the projection alone), A the members'
    stacked, B (N, LORA_RANK) compact with the cuts where the first two members' columns end, as
    lora.group_casts keeps them; A scaled so that x Aᵀ stays O(1)."""
    N, K = SHAPES[name]
    ends = torch.tensor(LORA_MEMBERS.get(name, (N,))).cumsum(0).tolist()
    R = LORA_RANK * len(ends)
    cuts = (ends[0], ends[1]) if len(ends) > 1 else None
    qs = Rotating([shipped_weight(N, K, device, gen) for _ in range(copies_for(N * K * 9 / 16, device))])
    A = (torch.randn(R, K, device=device, generator=gen) / K ** 0.5).bfloat16()
    B = torch.randn(N, LORA_RANK, device=device, generator=gen).bfloat16()
    return N, K, R, qs, A, B, cuts


def lora_cost(device, log, names, Ms):
    """What train.py's adapters add to each projection at decode (LORA_RANKS, M rows): the times of
    lora_calls' sequences and of the shrink launch alone, timed like the table (graph replays,
    rotated weights; under PDL, as decode launches them). The difference between "shrink + fold"
    and "fold, h given" is what the shrink's launch costs the step."""
    gen = torch.Generator(device=device).manual_seed(4)
    rows = []
    for name in names:
        N, K, R, qs, A, B, cuts = lora_operands(name, device, gen)
        for M in Ms:
            x = torch.randn(M, K, device=device, generator=gen).bfloat16()
            sets = Rotating([lora_calls(x, w, A, B, cuts, 0.5) for w in qs.items])    # one per weight copy
            us = {what: bench_ms(lambda: sets.next()[what]()) * 1e3 for what in sets.items[0]}
            us["shrink alone"] = bench_ms(lambda: kl.shrink(x, A, B)) * 1e3
            rows.append(dict(shape=name, M=M, R=R, us=us, path=gemm.route(M, N, K, device, True)))
            log(f"lora {name:>11} M={M:2d} R={R:3d} | " + "  ".join(f"{k} {v:6.2f}" for k, v in us.items()))
        del qs
        torch.cuda.empty_cache()
    return rows


TRACE_REPS = 16      # [norm, projection] pairs a lora_trace graph chains


def lora_trace(device, log, names, Ms, out_dir):
    """Where the adapters' time goes in a chain of decode launches: a CUDA graph of TRACE_REPS x
    [RMSNorm, matmul], one of TRACE_REPS x [RMSNorm, shrink, folding matmul (or matmul and
    expand)] and, where the matmul folds, one of TRACE_REPS x [RMSNorm with the shrink in its launch
    (lora.norm_shrink_rows, as before q/k/v and gate/up), folding matmul], each profiled over replays
    (torch.profiler's kernel records), then trace_timings.
    The norm writes the projection's input, as in a decoder layer; weights rotate as in the table."""
    gen = torch.Generator(device=device).manual_seed(5)
    rows = []
    for name in names:
        N, K, R, qs, A, B, cuts = lora_operands(name, device, gen)
        norm_w = torch.ones(K, device=device)
        for M in Ms:
            x = torch.randn(M, K, device=device, generator=gen).bfloat16()
            folds = gemm.folds_lora(M, N, K, device, True)
            for kind in ("plain", "lora") + (("norm+shrink",) if folds else ()):
                def step():
                    if kind == "norm+shrink":
                        a, _, hp = kl.norm_shrink_rows(x, norm_w, 1e-6, None, A)
                        fold = gemm.Fold(hp, B, 0.5, x_fresh=True, cuts=cuts)
                        return gemm.matmul(a, *qs.next(), interleaved=True, lora=fold)
                    a = fused_ops.rms_norm(x, norm_w, 1e-6)
                    w = qs.next()
                    return gemm.matmul(a, *w, interleaved=True) if kind == "plain" else adapted(a, w, A, B, cuts, 0.5)
                stream = torch.cuda.Stream(device)
                with torch.cuda.stream(stream):                # compiles, and the split counts of this stream
                    step()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    for _ in range(TRACE_REPS):
                        step()
                graph.replay()
                torch.cuda.synchronize()
                path = os.path.join(out_dir, "lora_trace.json")
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        graph.replay()
                    torch.cuda.synchronize()
                prof.export_chrome_trace(path)
                with open(path) as f:
                    events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
                t = trace_timings(events)
                rows.append(dict(shape=name, M=M, R=R, kind=kind, us=t))
                log(f"trace {name:>11} M={M:2d} {kind:5s} | " + "  ".join(f"{k} {v:6.2f}" for k, v in t.items()))
        del qs
        torch.cuda.empty_cache()
    return rows


def trace_timings(events):
    """Kernel records (chrome-trace dicts: name, ts, dur in us) of chained [norm, ...] iterations ->
    medians over the iterations, in us from the end of the iteration's norm (RMSNorm's launch, or the
    norm's with the shrink in it, which counts as the norm): when the kernels of
    each part (shrink, expand, reduce, and matmul: every other one, such as the register-A route's
    reorder of x and its product) start and end (a kernel launched under PDL starts when it is
    scheduled, which may be well before its wait returns); `done`, when the last of them ends;
    `period`, from one norm's end to the next (what the pair costs a chain)."""
    its = []
    for e in sorted(events, key=lambda e: e["ts"]):
        if "rms_norm" in e["name"] or "norm_shrink" in e["name"]:
            its.append({"norm": e["ts"] + e["dur"]})
        elif its:
            key = next((k for k in ("shrink", "expand", "reduce") if k in e["name"]), "matmul")
            start, end = its[-1].get(key, (e["ts"], e["ts"] + e["dur"]))
            its[-1][key] = (min(start, e["ts"]), max(end, e["ts"] + e["dur"]))
    its = [it for it in its if len(it) > 1]
    if len(its) < 2:
        raise ValueError(f"trace_timings: {len(its)} [norm, ...] iterations in the trace, need 2 or more")
    out = {}
    for key in ("shrink", "matmul", "reduce", "expand"):
        have = [it for it in its if key in it]
        if have:
            out[key + " start"] = statistics.median(it[key][0] - it["norm"] for it in have)
            out[key + " end"] = statistics.median(it[key][1] - it["norm"] for it in have)
    out["done"] = statistics.median(max(v[1] for k, v in it.items() if k != "norm") - it["norm"] for it in its)
    out["period"] = statistics.median(b["norm"] - a["norm"] for a, b in zip(its, its[1:]))
    return out


# ----------------------------------------------------------------------------------------------
# main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="GPU correctness only")
    ap.add_argument("--no-check", action="store_true", help="skip the GPU correctness check")
    ap.add_argument("--no-bench", action="store_true", help="skip the main benchmark table")
    ap.add_argument("--shapes", default="all", help="comma-separated shape names, or all")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="comma-separated M values")
    ap.add_argument("--fwd-only", action="store_true", help="time the forward only (no dx)")
    ap.add_argument("--once", default="", help='only one call per "shape:M" case, e.g. "7B o:1,7B o:16" (for ncu)')
    ap.add_argument("--floor", action="store_true",
                    help="also time each shape's streaming-read and dequantize floors (floor())")
    ap.add_argument("--scaling", action="store_true",
                    help="the one-row GEMV's time against its weight's size, cold and hot (size_scaling())")
    ap.add_argument("--split-cost", action="store_true",
                    help="M = 2..16 on the fragment route: the split-K sum's cost (split_cost())")
    ap.add_argument("--lora-cost", action="store_true",
                    help="what train.py's adapters add to each projection at decode, M from --ms (lora_cost())")
    ap.add_argument("--lora-trace", action="store_true",
                    help="a profiled chain of [norm, projection] launches with and without the adapters (lora_trace())")
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernel.py needs a CUDA GPU")
    device = torch.device("cuda")
    if args.once:
        return once(device, args.once)
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "kernel_log.txt"), "a")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    props = torch.cuda.get_device_properties(device)
    log(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    log(f"# args: {vars(args)}")
    t0 = time.time()
    out = dict(device=props.name, torch=torch.__version__, triton=triton.__version__)
    if not args.no_check:
        out["check_pass"] = check(device, log)
        log(f"# check took {time.time() - t0:.0f} s")
    if args.check:
        return
    names = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    if args.floor:
        t1 = time.time()
        out["floor"] = floor(device, log, names)
        log(f"# floors took {time.time() - t1:.0f} s")
    if args.scaling:
        out["scaling"] = size_scaling(device, log)
    if args.split_cost:
        t1 = time.time()
        small = [m for m in map(int, args.ms.split(",")) if 1 < m <= 16]
        out["split_cost"] = split_cost(device, log, names, small)
        log(f"# split cost took {time.time() - t1:.0f} s")
    if args.lora_cost:
        t1 = time.time()
        out["lora_cost"] = lora_cost(device, log, names, [m for m in map(int, args.ms.split(",")) if m <= 16])
        log(f"# lora cost took {time.time() - t1:.0f} s")
    if args.lora_trace:
        Ms = [m for m in map(int, args.ms.split(",")) if m <= 16]
        out["lora_trace"] = lora_trace(device, log, names, Ms, args.out)
    if not args.no_bench:
        gen = torch.Generator(device=device).manual_seed(0)
        rows = []
        for name in names:
            try:
                rows += time_shape(name, *SHAPES[name], [int(m) for m in args.ms.split(",")], device, gen,
                                   fwd_only=args.fwd_only)
            except Exception as e:                               # keep the other shapes' rows
                log(f"bench {name}: ERROR {type(e).__name__}: {str(e)[:300]}")
            torch.cuda.empty_cache()
        out["rows"] = rows
        log(f"# total {time.time() - t0:.0f} s")
        log("# CUDA-graph timing (GPU time). TB/s: NVFP4 weight bytes (4.5 bit) / time; x = cuBLAS / ours")
        log(f"{'shape':>11} {'M':>5} | {'fwd us':>8} {'cuBLAS':>8} {'x':>5} {'TB/s':>5} | "
            f"{'dx us':>8} {'cuBLAS':>8} {'x':>5} | path")
        for r in rows:
            log(f"{r['shape']:>11} {r['M']:5d} | {r['fwd_ms'] * 1e3:8.1f} {r['cublas_fwd_ms'] * 1e3:8.1f} "
                f"{r['fwd_speedup']:5.2f} {r['fwd_TBps']:5.2f} | "
                f"{r['dx_ms'] * 1e3:8.1f} {r['cublas_dx_ms'] * 1e3:8.1f} {r['dx_speedup']:5.2f} | {r['path']} / {r['dx_path']}")
        for r in rows:
            if "eager_fwd_ms" in r:
                log(f"eager (no graph) {r['shape']:>11} M={r['M']}: ours {r['eager_fwd_ms'] * 1e3:.1f} us, "
                    f"cuBLAS {r['eager_cublas_fwd_ms'] * 1e3:.1f} us")
        if args.floor:
            floor_table(out["floor"], rows, log)
    with open(os.path.join(args.out, "kernel.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
