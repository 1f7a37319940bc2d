"""Can NVFP4's large-M dequantization hide behind the GEMMs? The 7B prefill's weight traffic, timed.

At large M an NVFP4 linear dequantizes its weight to bf16 (ops.dense_weight: one Triton pass) and
multiplies with cuBLAS (kernels/README.md's route table: every weight above 1,024 rows), so a 7B
prefill of the GRPO batch (16 prompts × 256 = 4,096 tokens) pays the bf16 GEMMs plus the
dequantization. Each weight's dequantization depends on nothing but the
weight, so it could run on a second stream while the GEMM before it runs. This times, over the four
projections of a Qwen2.5-7B layer (stacked q/k/v, o, stacked gate/up, down) × 28 layers at M rows
(random NVFP4 weights in the interleaved layout the kernels read):

    bf16 GEMMs only       torch.mm on dense weights dequantized beforehand (the bf16 model's work)
    dequant only          ops.dense_weight for each weight
    sequential            dequantize, then multiply, weight after weight (what a prefill does)
    overlapped            the next weight dequantized on a second stream while this one multiplies

Each is the mean of 5 runs after 2 warm-up runs. Overlapped = GEMMs + dequantization means it hides
nothing; overlapped = GEMMs would mean it all hides.

    python bench/dequant_overlap.py              # one line on stdout (CUDA only)
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

import ops
from nvfp4 import NVFP4Linear

SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]   # (N, K): qkv, o, gate_up, down
LAYERS, M = 28, 4096


def timed(f, *args):
    for _ in range(2):
        f(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        f(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 5 * 1e3


def main():
    torch.manual_seed(0)
    weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for N, K in SHAPES]
    layers = [NVFP4Linear.from_weight(w).to("cuda").interleave_() for w in weights]
    xs = {K: torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _, K in SHAPES}   # (M, K)
    seq = layers * LAYERS
    dense = [ops.dense_weight(lin) for lin in layers] * LAYERS
    side = torch.cuda.Stream()

    def gemms():
        for lin, w in zip(seq, dense):
            torch.mm(xs[lin.in_features], w.t())

    def dequant():
        for lin in seq:
            ops.dense_weight(lin)

    def sequential():
        for lin in seq:
            torch.mm(xs[lin.in_features], ops.dense_weight(lin).t())

    def overlapped():
        main_stream = torch.cuda.current_stream()
        nxt, ready = ops.dense_weight(seq[0]), None
        side.wait_stream(main_stream)
        for i, lin in enumerate(seq):
            w = nxt
            if ready is not None:
                main_stream.wait_event(ready)
            if i + 1 < len(seq):
                with torch.cuda.stream(side):
                    nxt, ready = ops.dense_weight(seq[i + 1]), torch.cuda.Event()
                    ready.record(side)
                nxt.record_stream(main_stream)
            torch.mm(xs[lin.in_features], w.t())

    with torch.inference_mode():
        print(f"{torch.cuda.get_device_name()}, M = {M}: bf16 GEMMs only {timed(gemms):.1f} ms; dequant only "
              f"{timed(dequant):.1f} ms; sequential {timed(sequential):.1f} ms; overlapped {timed(overlapped):.1f} ms")


if __name__ == "__main__":
    main()
