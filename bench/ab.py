"""Same-run A/B of the sampler's switches: one engine, the variants in turn, the whole sequence twice.

Why. Kernel timings taken alone mispredicted the decode graph (bench/NOTES.md v8: a routing that won
every isolated shape lost 3.6% of 32B batch-16 decode), and a shared machine drifts by a few percent
between runs. So a change to the decode step is judged here: one model, one LLMEngine, each
variant's switches applied in turn (the CUDA graphs freed and recaptured for each), every workload
of bench/rollout.py timed per variant, and the sequence repeated (--reps) so a difference that does
not repeat is seen as noise.

Switches (name=value, comma-separated; one argument per variant; unnamed switches keep their
defaults, which are what ships):
    pdl=0|1               marlin_kernel.PDL: programmatic dependent launch of every Triton kernel
    late=0|1              marlin_kernel.GEMV_LATE_RELEASE: the M = 1 GEMV (but gate/up) schedules the
                          next kernel after its main loop, not at its start
    gemv_wave=0|1         marlin_kernel.GEMV_ONE_WAVE: the M = 1 GEMV's split fills one wave of programs
                          where its steps are 1024 k (0: ~8 programs an SM everywhere, as before v32)
    frag_late=0|1|2       marlin_kernel.FRAGMENT_LATE_RELEASE: the same for the fragment kernel (M = 2..16):
                          never, always, or where no reduce kernel follows it
    early=0|1             marlin_kernel.EARLY_LOADS: paged attention's first cache tile and RMSNorm's
                          weight and residual loaded before the PDL wait
    reduce=0|1            marlin_kernel.REDUCE_IN_KERNEL: split-K summed by the last split in-kernel
    merge=N               paged_attention.MERGE_MAX_PARTS: up to N partitions merged in the attention
                          kernel (0: always the merge kernel)
    mchunk=N              paged_attention.MERGE_CHUNK: partitions per pass of that in-kernel merge
    part=N                rollout.PARTITION_TOKENS: decode attention partitions of N·B positions
                          (16..512, at least max_model_len/64)
    lora_kernels=0|1      lora_kernels.py's decode update (0: lora.py's cuBLAS GEMM + addmm)
    lora_pdl_nvfp4=0|1    lora_kernels.PDL_BESIDE_NVFP4: PDL for them on an NVFP4 base too
    lora_early=0|1        lora_kernels.EARLY_SHRINK: x Aᵀ before the base matmul where early_shrink says
    lora_fold=0|1         lora_kernels.FOLD_EXPAND: the update added by the NVFP4 GEMV where fold_expand says
    lora_reduce=0|1       marlin_kernel.REDUCE_FOLDS_LORA: beyond 16 rows, the update added by the register-A
                          route's split-K reduce where lora_kernels.fold_in_reduce says
    sampler=triton|torch  sampling.py's GPU path (torch: the ~10-op reference path)
    lm_gemv=0|1           rollout.LM_HEAD_GEMV: the lm_head of <= 2 rows by fused_ops.gemv_triton
                          (0: nn.Linear, i.e. cuBLAS)
    wgmma=N               marlin_kernel.WGMMA_MAX_M: the register-A wgmma kernel up to M = N rows
                          (0: never; the tile kernels instead)
    wgmma_min=N           marlin_kernel.WGMMA_MIN_M: ... from M = N + 1 rows (16: above the fragment kernel)
    wgmma_small=0|1       marlin_kernel.WGMMA_SMALL: ... and at M <= 16 on the big weights (wgmma_rows) ...
    wgmma_small_min=N     marlin_kernel.WGMMA_SMALL_MIN_M: ... above M = N on those that are not wide
                          (16: the fragment kernel to M = 16 there, with the launch shapes of
                          fwd_config; NOTES v30 item 9 tried it with others)
    dwave=F               marlin_kernel.WGMMA_DECODE_WAVE: ... split-K at <= 16 tokens up to F of a wave
                          (1.0: as before v32)
    long_ring=N           marlin_kernel.LONG_RING_WINDOWS: ... with a 4-stage ring for one-wave launches of
                          programs of >= N windows where it is free (999: never, as before v32)
    fit_stages=0|1        marlin_kernel.WGMMA_FIT_STAGES: ... with fewer ring stages where that fits its
                          programs in one wave (32B gate_up at M = 9..16; 0: as before v32)
    ws_min_bt=N           marlin_kernel.WS_MIN_BT: the register-A kernel warp-specialized from N tokens
                          a program (256: never; the cp.async ring kernel at every tile)
    pair=N                marlin_kernel.PAIR_WINDOWS: fragment programs of <= N windows (2N at M <= 4)
                          load two windows a step (0, with long_run=999: one a step, as before v30)
    frag_reduce=N         marlin_kernel.FRAGMENT_REDUCE_MAX_M: the fragment kernel's split-K partials summed
                          in-kernel to M = N at any windows a step
    long_run=N            marlin_kernel.LONG_RUN_WINDOWS: fragment programs of >= N windows at M = 5..8 cut
                          to runs of LONG_RUN_CUT at two windows a step (999: never, as before v31)
    pair_reduce=N         marlin_kernel.PAIR_REDUCE_MAX_M: ... and sum their split-K partials in-kernel to
                          M = N (4: as at one window a step)

    python bench/ab.py --models 7b --workloads batch1,batch16 --variants reduce=1 reduce=0
    python bench/ab.py --models 7b --lora --workloads batch1,batch16 --variants lora_kernels=1 lora_kernels=0
    python bench/ab.py --models 32b --workloads batch16 --variants wgmma_small_min=16 wgmma_small_min=8 --profile 16
Prints a line per run and writes OUT/ab.json: rows (model, rep, variant, workload, tok/s: decode
tok/s for batchB, total tok/s for grpo); with --profile, OUT/profile.txt: per variant the kernels of
one decode step on its critical path (bench/rollout.py's profile). --lora adds train.py's default
adapters (rank 32 on all seven projections) to every variant: the rollout a GRPO step runs.
"""
import argparse
import contextlib
import functools
import gc
import importlib.util
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch

import lora
import lora_kernels
import marlin_kernel
import paged_attention
import rollout
import sampling

# ----------------------------------------------------------------------------------------------
# the switches: (module, attribute, value of the argument string)

SWITCHES = {
    "pdl": (marlin_kernel, "PDL", lambda v: bool(int(v))),
    "late": (marlin_kernel, "GEMV_LATE_RELEASE", lambda v: bool(int(v))),
    "gemv_wave": (marlin_kernel, "GEMV_ONE_WAVE", lambda v: bool(int(v))),
    "fit_stages": (marlin_kernel, "WGMMA_FIT_STAGES", lambda v: bool(int(v))),
    "dwave": (marlin_kernel, "WGMMA_DECODE_WAVE", float),
    "long_ring": (marlin_kernel, "LONG_RING_WINDOWS", int),
    "frag_late": (marlin_kernel, "FRAGMENT_LATE_RELEASE", int),
    "early": (marlin_kernel, "EARLY_LOADS", lambda v: bool(int(v))),
    "reduce": (marlin_kernel, "REDUCE_IN_KERNEL", lambda v: bool(int(v))),
    "merge": (paged_attention, "MERGE_MAX_PARTS", int),
    "mchunk": (paged_attention, "MERGE_CHUNK", int),
    "part": (rollout, "PARTITION_TOKENS", int),
    "lora_kernels": (lora, "_decode_kernels", lambda v: lora._decode_kernels if int(v) else (lambda x2: False)),
    "lora_pdl_nvfp4": (lora_kernels, "PDL_BESIDE_NVFP4", lambda v: bool(int(v))),
    "lora_early": (lora_kernels, "EARLY_SHRINK", lambda v: bool(int(v))),
    "lora_fold": (lora_kernels, "FOLD_EXPAND", lambda v: bool(int(v))),
    "lora_reduce": (marlin_kernel, "REDUCE_FOLDS_LORA", lambda v: bool(int(v))),
    "sampler": (sampling, "triton", lambda v: sampling.triton if v == "triton" else None),
    "lm_gemv": (rollout, "LM_HEAD_GEMV", lambda v: bool(int(v))),
    "wgmma": (marlin_kernel, "WGMMA_MAX_M", int),
    "wgmma_min": (marlin_kernel, "WGMMA_MIN_M", int),
    "wgmma_small": (marlin_kernel, "WGMMA_SMALL", lambda v: bool(int(v))),
    "wgmma_small_min": (marlin_kernel, "WGMMA_SMALL_MIN_M", int),
    "ws_min_bt": (marlin_kernel, "WS_MIN_BT", int),
    "pair": (marlin_kernel, "PAIR_WINDOWS", int),
    "pair_reduce": (marlin_kernel, "PAIR_REDUCE_MAX_M", int),
    "long_run": (marlin_kernel, "LONG_RUN_WINDOWS", int),
    "frag_reduce": (marlin_kernel, "FRAGMENT_REDUCE_MAX_M", int),
}


def parse_variant(text: str) -> dict:
    """'pdl=0,merge=8' -> {'pdl': '0', 'merge': '8'}; an unknown name is an error that lists them."""
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or name not in SWITCHES:
            raise ValueError(f"bad switch {item!r} in variant {text!r}: use name=value with names {sorted(SWITCHES)}")
        out[name] = value
    return out


@contextlib.contextmanager
def switched(variant: dict):
    """Apply a parsed variant's switches, restore every one on exit."""
    saved = {name: getattr(SWITCHES[name][0], SWITCHES[name][1]) for name in variant}
    try:
        for name, value in variant.items():
            module, attr, convert = SWITCHES[name]
            setattr(module, attr, convert(value))
        yield
    finally:
        for name, value in saved.items():
            setattr(SWITCHES[name][0], SWITCHES[name][1], value)


def _bench_rollout():
    """bench/rollout.py as a module (its name clashes with the top-level rollout.py)."""
    spec = importlib.util.spec_from_file_location("bench_rollout", os.path.join(ROOT, "bench", "rollout.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="7b", help="comma-separated: 7b, 14b, 32b, tiny")
    ap.add_argument("--quant", default="nvfp4", choices=("nvfp4", "bf16"))
    ap.add_argument("--lora", action="store_true", help="add train.py's default LoRA adapters")
    ap.add_argument("--workloads", default="batch1,batch16", help="bench/rollout.py workloads")
    ap.add_argument("--variants", nargs="+", required=True, help='e.g. reduce=1 reduce=0 "pdl=0,merge=0"')
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--profile", default="", help="batch sizes (comma-separated) whose decode step is also "
                    "profiled per variant after the timed reps: OUT/profile.txt (bench/rollout.py's profile)")
    args = ap.parse_args()
    variants = {v: parse_variant(v) for v in args.variants}
    if not torch.cuda.is_available():
        sys.exit("bench/ab.py needs a CUDA GPU")
    br = _bench_rollout()
    rows = []
    for model_name in args.models.split(","):
        cfg = br.CONFIGS[model_name]
        model = br.build_model(cfg, quant=args.quant, device="cuda", dtype=torch.bfloat16, seed=0)
        if args.lora:
            lora.apply_lora(model, lora.LoRAConfig())
        engine = rollout.LLMEngine(model, max_model_len=args.max_model_len, max_num_seqs=256)
        for rep in range(args.reps):
            for name, variant in variants.items():
                with switched(variant):
                    for wl in args.workloads.split(","):
                        w = br.WORKLOADS[wl]
                        prompts = br.random_prompts(w["prompts"], w["prompt_len"], cfg["vocab_size"], 0)
                        engine.free_cache()                          # graphs of this variant's kernels
                        br.run_ours(engine, prompts, w["n"], 2)      # warm-up (compiles)
                        engine.free_cache()
                        r = br.run_ours(engine, prompts, w["n"], w["new"])
                        tok_s = r["new_tokens"] / r["total_s"] if wl == "grpo" else br.decode_tok_s(w, r)
                        rows.append(dict(model=model_name, rep=rep, variant=name, workload=wl, tok_s=tok_s))
                        print(f"{model_name} rep {rep} {name:24s} {wl:8s} {tok_s:9.1f} tok/s", flush=True)
        for batch in (int(b) for b in args.profile.split(",") if b):
            for name, variant in variants.items():
                with switched(variant):
                    engine.free_cache()
                    br.profile(functools.partial(br.run_ours, engine), cfg["vocab_size"], batch, 40,
                               os.path.join(args.out, "profile.txt"), f"{model_name} {name}")
        engine.free_cache()
        del engine, model
        gc.collect()
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ab.json")
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), args=vars(args), rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
