"""Benchmark and GPU check of the NVFP4 x BF16 kernels (marlin_kernel.py) against cuBLAS bf16.

For the Qwen2.5-7B and -32B projection shapes (ANCHORS.md) and M in 1..16384 it times, in the
same run: ours y = x·Wᵀ and cuBLAS bf16 x @ w.t() (forward), ours dx = dy·W and cuBLAS dy @ w
(backward-input). Timing: triton.testing.do_bench_cudagraph median (GPU time of graph replays, so
Python launch cost is out; rollout runs under CUDA graphs), and the weights rotate among copies
that together exceed twice the L2, so no call finds its weight cached. Rows at M=1 also report
eager timings (do_bench, L2 flushed before each call, Python launch cost in).
Reported per row: ms, effective weight bandwidth (NVFP4 counts 4.5 bits per weight, bf16 16),
and speedup = cuBLAS time / our time.

    python bench/kernel.py                    # check + benchmark, table + bench/kernel.json
    python bench/kernel.py --check            # GPU correctness on the real shapes only
    python bench/kernel.py --sweep            # try several tile configs per (shape, M)
    python bench/kernel.py --sweep-gemv --no-bench   # launch shapes of the CUDA-core kernel (M <= 4)
    python bench/kernel.py --ms 1,2,4,8,16 --fwd-only   # a subset; "old" = pre-v4 tensor-core path
    python bench/kernel.py --medium-variants --no-check --no-bench   # M = 64..512: pre-v5 vs v5 tiles
    python bench/kernel.py --small-variants --no-check --no-bench    # M = 1..16: route vs launch shapes (plain layout)
    python bench/kernel.py --once "7B gate_up:1,7B down:16"   # one call each, for ncu (NOTES.md v11)
    python bench/kernel.py --floor            # what no kernel reading the weight can beat (see floor())
    python bench/kernel.py --split-cost --no-bench --no-check   # M = 2..16: the fragment route's split-K sum
    python bench/kernel.py --out DIR          # where the JSON and log go

The weights are random codes and random E4M3 scales (the kernel's speed does not depend on the
values; the correctness check uses fresh random data against a float64 reference).
"""
import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch
import triton
import triton.language as tl
import triton.testing

import marlin_kernel as mk
import nvfp4
from fp4_decode import pdl_start

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
    K % 128 == 0): what the table times. The sweeps and variants below take the plain layout."""
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
    W = mk.reference_dequantize(packed, scale, gs)                       # (64, 256) f64
    y = mk.nvfp4_matmul(eye, packed, scale, gs)                          # (256, 64)
    bad = (y.double() - W.t()).abs() > 2.0 ** -8 * W.t().abs()           # > 1 bf16 rounding
    if bad.any():
        ok = False
        codes = torch.stack([packed & 15, packed >> 4], -1).flatten(-2).t()[bad]
        log(f"DECODE MISMATCH at {int(bad.sum())} elements; codes {sorted(set(codes.tolist()))}")
    else:
        log("decode: all codes exact")
    # the CUDA-core kernel (M <= 4) decodes through fp32 subnormals (code 1 = 0.5): same check
    y = torch.cat([mk._gemv(eye[k:k + 4], packed, scale, gs, None, mk.GemvConfig()) for k in range(0, 256, 4)])
    bad = (y.double() - W.t()).abs() > 2.0 ** -8 * W.t().abs()
    ok &= not bad.any()
    log(f"gemv decode: {'all codes exact' if not bad.any() else f'MISMATCH at {int(bad.sum())} elements'}")
    # the fragment kernel (M <= 8) decodes inside its mma.sync PTX: same check, 8 rows at a time
    y = torch.cat([mk._mma(eye[k:k + 8], packed, scale, gs, None, mk.MmaConfig()) for k in range(0, 256, 8)])
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
        W = mk.reference_dequantize(packed, scale, gs)                   # (N, K) f64
        for has_bias in (False, True):
            x = torch.randn(M, K, device=device, generator=gen).bfloat16()
            bias = torch.randn(N, device=device, generator=gen).bfloat16() if has_bias else None
            poison_allocator(max(M * N * 8, 1 << 20), device)
            y = mk.nvfp4_matmul(x, packed, scale, gs, bias)
            ref = x.double() @ W.t() + (bias.double() if has_bias else 0)
            e = rel_err(y, ref)
            fin = bool(torch.isfinite(y).all())
            worst = max(worst, e)
            good = fin and e < 1e-2
            ok &= good
            log(f"fwd {str(name):>12} M={M:5d} bias={int(has_bias)} rel_err={e:.2e} finite={fin} {'ok' if good else 'FAIL'}")
        dy = torch.randn(M, N, device=device, generator=gen).bfloat16()
        poison_allocator(max(M * K * 8, 1 << 20), device)
        dx = mk.nvfp4_matmul_dx(dy, packed, scale, gs)
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


OLD_SMALL_M = mk.TileConfig(16, 64, 128)     # the tensor-core split-K config used for M <= 16 before v4


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
            mk.nvfp4_matmul(x, *qs.next(), interleaved=True)

        def ours_dx():
            mk.nvfp4_matmul_dx(dy, *qs.next(), interleaved=True)

        cfg = mk.fwd_config(M, N, K)
        path = ("wgmma" if mk.wgmma_rows(M, N, K, x.device, True) else "dequant+cublas" if mk.use_dequant(M, N, K)
                else "gemv" if isinstance(cfg, mk.GemvConfig) else "fragment" if isinstance(cfg, mk.MmaConfig)
                else "fused")
        r = dict(shape=name, N=N, K=K, M=M, path=path, dx_path=mk.dx_route(M, N, K, x.device, True))
        r["fwd_ms"] = bench_ms(ours_fwd)
        r["cublas_fwd_ms"] = bench_ms(lambda: x @ ws.next().t())
        if M <= 16:          # the pre-v4 tensor-core kernel, same run: honest old/new ratios
            r["old_fwd_ms"] = bench_ms(lambda: mk._matmul(x, *qs.next(), None, OLD_SMALL_M, il=True))
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
# sweep of tile configs (and of the dequantize + cuBLAS path at large M)

T = mk.TileConfig
SWEEP_FWD = {
    "small": [T(16, 16, 256), T(16, 32, 256), T(16, 64, 256), T(16, 64, 128), T(16, 128, 128),
              T(16, 32, 128), T(16, 32, 256, warps=2), T(16, 64, 128, split=1), T(16, 64, 128, split=2),
              T(16, 64, 128, split=4), T(16, 128, 128, split=1), T(16, 64, 256, stages=3)],
    "mid": [T(64, 64, 128), T(64, 128, 64, warps=8), T(64, 128, 128, warps=8, stages=3),
            T(64, 64, 256, stages=3), T(64, 64, 128, split=1), T(32, 64, 128), T(64, 128, 128, warps=8, stages=3, split=1)],
    "large": [T(128, 64, 64), T(64, 128, 64, warps=8), T(128, 128, 64, warps=8), T(256, 128, 64, warps=8, stages=4),
              T(64, 128, 128, warps=8, stages=3)],
}
SWEEP_DX = {
    "small": [T(16, 64, 128), T(16, 128, 64), T(16, 128, 128), T(16, 64, 256, stages=3), T(16, 256, 64),
              T(16, 64, 128, split=1), T(16, 64, 128, split=2)],
    "mid": [T(32, 128, 64), T(64, 64, 128), T(64, 128, 64), T(64, 64, 128, split=1)],
    "large": [T(128, 64, 128, warps=8), T(128, 128, 128, warps=8, stages=3), T(256, 64, 128, warps=8, stages=3),
              T(64, 64, 128, warps=8)],
}
G = mk.GemvConfig
SWEEP_GEMV = [G(16, 1024), G(16, 512), G(16, 2048, warps=8), G(8, 1024, warps=2), G(32, 1024, warps=8),
              G(16, 1024, split=1), G(16, 1024, split=2), G(16, 512, split=4), G(16, 1024, stages=2),
              G(64, 256, warps=4)]


def sweep_gemv(device, log, Ms=(1, 2, 4), budget_s=120.0):
    """Launch shapes of the CUDA-core kernel on every shape (weights rotated as in the table)."""
    gen = torch.Generator(device=device).manual_seed(8)
    results, t0 = [], time.time()
    for name, (N, K) in SHAPES.items():
        qs = Rotating([random_weight(N, K, device, gen) for _ in range(copies_for(N * K * 4.5 / 8, device))])
        for M in Ms:
            x = torch.randn(M, K, device=device, generator=gen).bfloat16()
            for cfg in SWEEP_GEMV:
                if time.time() - t0 > budget_s:
                    log(f"sweep_gemv: time budget of {budget_s:.0f} s spent, stopping")
                    return results
                ms = bench_ms(lambda: mk._gemv(x, *qs.next(), None, cfg))
                tbps = N * K * 4.5 / 8 / ms / 1e9
                results.append(dict(kind="gemv", shape=name, M=M, cfg=str(cfg), ms=ms, TBps=tbps))
                log(f"sweep gemv {name:>11} M={M} {str(cfg):60s} {ms * 1e3:7.1f} us {tbps:5.2f} TB/s")
        torch.cuda.empty_cache()
    return results


SWEEP_CASES = [("7B qkv", (1, 16, 64, 256, 1024)), ("7B o", (1, 16, 64)), ("7B gate_up", (1, 16, 64, 256, 1024)),
               ("7B down", (1, 16, 64)), ("32B gate_up", (1, 16, 64, 1024)), ("32B down", (1, 16, 64, 256, 1024)),
               ("32B qkv", (1, 16)), ("32B o", (1, 16))]


def sweep(device, log, budget_s=240.0):
    gen = torch.Generator(device=device).manual_seed(7)
    results = []
    t0 = time.time()
    for name, Ms in SWEEP_CASES:
        N, K = SHAPES[name]
        p, s, g = random_weight(N, K, device, gen)
        for M in Ms:
            if time.time() - t0 > budget_s:
                log(f"sweep: time budget of {budget_s:.0f} s spent, stopping")
                break
            cls = "small" if M <= 16 else "mid" if M <= 64 else "large"
            x = torch.randn(M, K, device=device, generator=gen).bfloat16()
            dy = torch.randn(M, N, device=device, generator=gen).bfloat16()
            for kind, table in (("fwd", SWEEP_FWD), ("dx", SWEEP_DX)):
                cands = [(str(c), c) for c in table[cls]]
                if M >= 256:
                    cands.append(("dequant+cublas", None))
                for label, cfg in cands:
                    try:
                        if kind == "fwd" and cfg is None:
                            fn = lambda: torch.nn.functional.linear(x, mk._dequantize_bf16(p, s, g))
                        elif kind == "fwd":
                            fn = lambda cfg=cfg: mk._matmul(x, p, s, g, None, cfg)
                        elif cfg is None:
                            fn = lambda: dy @ mk._dequantize_bf16(p, s, g)
                        else:
                            fn = lambda cfg=cfg: mk._matmul_dx(dy, p, s, g, cfg)
                        ms = bench_ms(fn)
                    except Exception as e:                       # a config that does not compile
                        log(f"sweep {kind} {name} M={M} {label}: ERROR {type(e).__name__}: {str(e)[:200]}")
                        continue
                    tbps = N * K * 4.5 / 8 / ms / 1e9
                    results.append(dict(kind=kind, shape=name, M=M, cfg=label, ms=ms, TBps=tbps))
                    log(f"sweep {kind:3s} {name:>11} M={M:5d} {label:70s} {ms * 1e3:9.1f} us {tbps:5.2f} TB/s")
    best = {}
    for r in results:
        key = (r["kind"], r["M"], r["shape"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    for key, r in sorted(best.items()):
        log(f"BEST {key[0]:3s} M={key[1]:5d} {key[2]:>11}: {r['cfg']:70s} {r['ms'] * 1e3:8.1f} us {r['TBps']:5.2f} TB/s")
    return results


# ----------------------------------------------------------------------------------------------
# medium M (rollout batches): the pre-v5 path against the v5 candidates, in one run

MEDIUM_MS = (64, 96, 128, 192, 256, 512)
PRE_V5_MEDIUM = mk.TileConfig(128, 64, 64)       # swapped 128 x 64 tiles: 64 < M < 512 before v5
MEDIUM_CANDIDATES = {                            # all but the last: x·Wᵀ, W from shared memory
    "v5 128x128x64 w8": mk.MEDIUM_CONFIG,
    "v5 128x128x128 w8": T(128, 128, 128, warps=8, stages=3, swap=False),
    "v5 128x256x64 w8": T(128, 256, 64, warps=8, stages=3, swap=False),
    "v5 256x128x64 w8": T(256, 128, 64, warps=8, stages=3, swap=False),
    "v5 64x128x64 w4": T(64, 128, 64, warps=4, stages=4, swap=False),
    "swap 128x128x64 w8": T(128, 128, 64, warps=8, stages=4),
}


def pre_v5_forward(x, p, s, g):
    """What nvfp4_matmul ran before v5 (dequantize + cuBLAS, or the swapped fused kernel)."""
    M, N, K = x.shape[0], p.shape[0], p.shape[1] * 2
    if mk.use_dequant(M, N, K):
        return torch.nn.functional.linear(x, mk._dequantize_bf16(p, s, g))
    return mk._matmul(x, p, s, g, None, mk.fwd_config(M, N, K) if M <= 64 else PRE_V5_MEDIUM)


def medium_candidates():
    return {"pre-v5": pre_v5_forward} | {
        label: (lambda x, p, s, g, cfg=cfg: mk._matmul(x, p, s, g, None, cfg)) for label, cfg in MEDIUM_CANDIDATES.items()}


# M <= 16: the route (plain layout) against each small-M kernel in several launch shapes: the CUDA-core
# kernel (M <= 2) and the fragment kernel (mma.sync on weights decoded into its registers)
SMALL_MS = (1, 2, 4, 8, 16)
GEMV = [mk.GemvConfig(32, 1024), mk.GemvConfig(32, 512), mk.GemvConfig(16, 2048), mk.GemvConfig(16, 1024)]
FRAGMENT = [mk.MmaConfig(4, 1), mk.MmaConfig(4, 2), mk.MmaConfig(8, 1)]


def _gemv(cfg):
    """The CUDA-core kernel in one launch shape, as a candidate for M <= GEMV_MAX_M only."""
    fn = functools.partial(mk._gemv, bias=None, cfg=cfg)
    fn.max_m = mk.GEMV_MAX_M
    return fn


def small_candidates():
    return ({"route": lambda x, p, s, g: mk.nvfp4_matmul(x, p, s, g)}
            | {f"gemv {c.bn}x{c.bk}": _gemv(c) for c in GEMV}
            | {f"mma w{c.warps}t{c.tiles}": (lambda x, p, s, g, cfg=c: mk._mma(x, p, s, g, None, cfg))
               for c in FRAGMENT})


def variants(device, log, Ms, candidates, budget_s=110.0):
    """Forward only, CUDA graphs, weights rotated: cuBLAS bf16 and every candidate per (shape, M);
    each candidate's output is also compared with float64 (rel_err; a check of the real kernels).
    A candidate with a max_m attribute is timed only up to that M."""
    gen = torch.Generator(device=device).manual_seed(5)
    rows, t0 = [], time.time()
    for name, (N, K) in sorted(SHAPES.items(), key=lambda kv: -kv[1][0] * kv[1][1]):   # big first
        qs = Rotating([random_weight(N, K, device, gen) for _ in range(copies_for(N * K * 4.5 / 8, device))])
        ws = Rotating([torch.randn(N, K, device=device, generator=gen).bfloat16()
                       for _ in range(min(4, copies_for(N * K * 2, device)))])
        for M in Ms:
            if time.time() - t0 > budget_s:
                log(f"variants: time budget of {budget_s:.0f} s spent, stopping")
                return rows
            x = torch.randn(M, K, device=device, generator=gen).bfloat16()
            ref = mk.reference_matmul(x, *qs.items[0])
            r = dict(shape=name, N=N, K=K, M=M, us={}, rel_err={})
            r["us"]["cublas"] = bench_ms(lambda: x @ ws.next().t(), rep=5) * 1e3
            for label, fn in candidates.items():
                if M > getattr(fn, "max_m", M):
                    continue
                try:
                    poison_allocator(max(M * N * 8, 1 << 20), device)
                    r["rel_err"][label] = rel_err(fn(x, *qs.items[0]), ref)
                    r["us"][label] = bench_ms(lambda fn=fn: fn(x, *qs.next()), rep=5) * 1e3
                except Exception as e:                       # a config that does not compile
                    log(f"variants {name} M={M} {label}: ERROR {type(e).__name__}: {str(e)[:200]}")
            del ref
            rows.append(r)
            log(f"variants {name:>11} M={M:4d} " + " ".join(f"{k}={v:.1f}" for k, v in r["us"].items())
                + f" max_rel_err={max(r['rel_err'].values(), default=float('nan')):.1e}")
        del qs, ws
        torch.cuda.empty_cache()
    return rows


def variants_table(rows, labels, log):
    """us per path and x = cuBLAS / path; * marks the fastest NVFP4 path of each row."""
    log("# forward, CUDA graphs: us (x = cuBLAS bf16 / path); * = fastest NVFP4 path")
    log(f"{'shape':>11} {'M':>4} {'cuBLAS':>7} | " + " | ".join(f"{l:>18}" for l in labels))
    for r in rows:
        us = r["us"]
        best = min((l for l in labels if l in us), key=us.get)
        cells = [f"{us[l]:7.1f} {us['cublas'] / us[l]:4.2f}{'*' if l == best else ' '}".rjust(18)
                 if l in us else f"{'-':>18}" for l in labels]
        log(f"{r['shape']:>11} {r['M']:4d} {us['cublas']:7.1f} | " + " | ".join(cells))


def once(device, cases):
    """One forward call of each "shape:M" case inside an NVTX range named after it, for a profiler:
    ncu --clock-control none --nvtx --nvtx-include "regex:7B.*/" --section WarpStateStats ...
    python bench/kernel.py --once "7B gate_up:1,7B gate_up:16" (bench/NOTES.md v11)."""
    gen = torch.Generator(device=device).manual_seed(0)
    for case in cases.split(","):
        name, _, M = case.rpartition(":")
        N, K = SHAPES[name]
        w, x = random_weight(N, K, device, gen), torch.randn(int(M), K, device=device, generator=gen).bfloat16()
        mk.nvfp4_matmul(x, *w)                            # compile outside the range
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"{name} M={M}")
        mk.nvfp4_matmul(x, *w)
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
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for name in names:
        N, K = SHAPES[name]
        nbytes = N * K * 9 // 16
        bufs = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=device, generator=gen)
                for _ in range(copies_for(nbytes, device))]
        sink = torch.empty(16 * n_sm, dtype=torch.int32, device=device)
        best = (float("inf"), None)
        for block in STREAM_BLOCKS:
            for waves in STREAM_WAVES:
                chunk = triton.cdiv(triton.cdiv(nbytes // 4, waves * n_sm), block) * block
                for warps in STREAM_WARPS:
                    def run(src, chunk=chunk, block=block, warps=warps):
                        _stream_kernel[(triton.cdiv(nbytes // 4, chunk),)](
                            src, sink, nbytes // 4, chunk, BLOCK=block, num_warps=warps, **mk.pdl_launch(device))
                    rot = Rotating(bufs)
                    ms = bench_ms(lambda: run(rot.next()))
                    if ms < best[0]:
                        best = (ms, (block, waves, warps), run)
        ms, cfg, run = best
        hot = bench_ms(lambda: run(bufs[0]))
        qs = Rotating([shipped_weight(N, K, device, gen) for _ in range(copies_for(nbytes, device))])
        deq = bench_ms(lambda: mk._dequantize_bf16(*qs.next(), il=True))
        rows.append(dict(shape=name, N=N, K=K, bytes=nbytes, stream_ms=ms, stream_TBps=nbytes / ms / 1e9,
                         stream_hot_ms=hot, block=cfg[0], waves=cfg[1], warps=cfg[2], dequant_ms=deq))
        log(f"floor {name:>11}: {nbytes / 1e6:6.1f} MB  stream {ms * 1e3:6.1f} us ({nbytes / ms / 1e9:4.2f} TB/s; "
            f"block {cfg[0]} words, {cfg[1]} programs/SM, {cfg[2]} warps), hot in L2 {hot * 1e3:5.1f} us, "
            f"dequantize {deq * 1e3:6.1f} us")
        del bufs, qs
        torch.cuda.empty_cache()
    return rows


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
    saved = mk.REDUCE_IN_KERNEL, mk._reduce
    mk.REDUCE_IN_KERNEL, mk._reduce = False, (lambda part, global_scale, bias, out, lora=None: out)
    try:
        yield
    finally:
        mk.REDUCE_IN_KERNEL, mk._reduce = saved


def split_cost(device, log, names, Ms):
    """What the in-kernel split-K sum costs where the fragment kernel runs (the route's MmaConfig,
    M >= 2): cuBLAS, the shipped launch, and the same launch with its partials left unsummed, timed
    like the table. cuBLAS / unsummed bounds what any cheaper sum of the same launch could reach.
    Only launches whose last split sums (fragment_sums_in_kernel): where the reduce kernel follows
    instead, leaving it out also changes how back-to-back calls overlap under PDL, and the
    difference came out negative as often as not (H100, bench/NOTES.md v33)."""
    gen = torch.Generator(device=device).manual_seed(2)
    rows = []
    log(f"{'shape':>11} {'M':>3} | {'cuBLAS':>7} {'route':>7} {'x':>5} | {'unsummed':>8} {'x':>5} | split sum us")
    for name in names:
        N, K = SHAPES[name]
        qs = Rotating([shipped_weight(N, K, device, gen) for _ in range(copies_for(N * K * 9 / 16, device))])
        ws = Rotating([torch.randn(N, K, device=device, generator=gen).bfloat16()
                       for _ in range(copies_for(N * K * 2, device))])
        for M in Ms:
            cfg = mk.fwd_config(M, N, K)
            if not isinstance(cfg, mk.MmaConfig):
                continue
            split, _, step = mk._mma_launch(cfg, M, mk.mma_tiles(N, cfg), K, device)
            if split == 1 or not mk.fragment_sums_in_kernel(M, step):
                continue
            x = torch.randn(M, K, device=device, generator=gen).bfloat16()
            cublas = bench_ms(lambda: x @ ws.next().t())
            route = bench_ms(lambda: mk._mma(x, *qs.next(), None, cfg, il=True))
            with unsummed_splits():
                bare = bench_ms(lambda: mk._mma(x, *qs.next(), None, cfg, il=True))
            rows.append(dict(shape=name, M=M, cublas_ms=cublas, route_ms=route, unsummed_ms=bare))
            log(f"{name:>11} {M:3d} | {cublas * 1e3:7.2f} {route * 1e3:7.2f} {cublas / route:5.2f} | "
                f"{bare * 1e3:8.2f} {cublas / bare:5.2f} | {(route - bare) * 1e3:5.2f}")
        del qs, ws
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------
# main

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="GPU correctness only")
    ap.add_argument("--sweep", action="store_true", help="also sweep tile configs")
    ap.add_argument("--sweep-budget", type=float, default=240.0, help="seconds the sweep may take")
    ap.add_argument("--no-bench", action="store_true", help="skip the main benchmark table")
    ap.add_argument("--shapes", default="all", help="comma-separated shape names, or all")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="comma-separated M values")
    ap.add_argument("--fwd-only", action="store_true", help="time the forward only (no dx)")
    ap.add_argument("--sweep-gemv", action="store_true", help="sweep the CUDA-core kernel's launch shapes")
    ap.add_argument("--medium-variants", action="store_true",
                    help="M = 64..512 forward: pre-v5 path vs the v5 candidates (< 2 min)")
    ap.add_argument("--small-variants", action="store_true",
                    help="M = 1..16 forward, plain layout: the route vs the small-M kernels' launch shapes")
    ap.add_argument("--small-ms", default=",".join(map(str, SMALL_MS)), help="M values of --small-variants")
    ap.add_argument("--no-check", action="store_true", help="skip the GPU correctness check")
    ap.add_argument("--once", default="", help='only one call per "shape:M" case, e.g. "7B o:1,7B o:16" (for ncu)')
    ap.add_argument("--floor", action="store_true",
                    help="also time each shape's streaming-read and dequantize floors (floor())")
    ap.add_argument("--split-cost", action="store_true",
                    help="M = 2..16 on the fragment route: the split-K sum's cost (split_cost())")
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    args = ap.parse_args()
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
    for flag, key, Ms, candidates in ((args.medium_variants, "medium", MEDIUM_MS, medium_candidates),
                                      (args.small_variants, "small", tuple(map(int, args.small_ms.split(","))),
                                       small_candidates)):
        if flag:
            t1 = time.time()
            cands = candidates()
            out[key] = variants(device, log, Ms, cands, budget_s=args.sweep_budget)
            variants_table(out[key], list(cands), log)
            log(f"# {key} variants took {time.time() - t1:.0f} s")
    if args.sweep_gemv:
        t1 = time.time()
        out["sweep_gemv"] = sweep_gemv(device, log, budget_s=args.sweep_budget)
        log(f"# gemv sweep took {time.time() - t1:.0f} s")
    if args.sweep:
        t1 = time.time()
        out["sweep"] = sweep(device, log, args.sweep_budget)
        log(f"# sweep took {time.time() - t1:.0f} s")
    names = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    if args.floor:
        t1 = time.time()
        out["floor"] = floor(device, log, names)
        log(f"# floors took {time.time() - t1:.0f} s")
    if args.split_cost:
        t1 = time.time()
        small = [m for m in map(int, args.ms.split(",")) if 1 < m <= 16]
        out["split_cost"] = split_cost(device, log, names, small)
        log(f"# split cost took {time.time() - t1:.0f} s")
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
        log(f"{'shape':>11} {'M':>5} | {'fwd us':>8} {'cuBLAS':>8} {'x':>5} {'TB/s':>5} {'old us':>7} {'old x':>5} | "
            f"{'dx us':>8} {'cuBLAS':>8} {'x':>5} | path")
        for r in rows:
            old = r.get("old_fwd_ms", float("nan"))
            log(f"{r['shape']:>11} {r['M']:5d} | {r['fwd_ms'] * 1e3:8.1f} {r['cublas_fwd_ms'] * 1e3:8.1f} "
                f"{r['fwd_speedup']:5.2f} {r['fwd_TBps']:5.2f} {old * 1e3:7.1f} {r['cublas_fwd_ms'] / old:5.2f} | "
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
