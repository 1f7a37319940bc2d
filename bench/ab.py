"""Same-run A/B of the kernel wing's tuning: one engine, the variants in turn, the whole sequence twice.

Why. Kernel timings taken alone can mispredict the decode graph (a routing that wins every isolated
shape can lose a few percent of a batch-16 decode step), and a shared machine drifts by a few
percent between runs. So a change to the decode step is judged here: one model, one LLMEngine, each
variant applied in turn (the CUDA graphs freed and recaptured for each), every workload of
bench/rollout.py timed per variant, and the sequence repeated (--reps) so a difference that does
not repeat is seen as noise.

A variant is a comma-separated list of `field=value` of kernels.tuning.Tuning (one argument per
variant; fields left out keep their defaults, which are what ships). The value is parsed by the
field's type: bool as 0 / 1 (or false / true), int, float; a field of another type (a launch-shape
dataclass, a tuple) is varied in code with dataclasses.replace, not here. Each variant runs inside
tuning.using(dataclasses.replace(tuning.current(), **fields)). `python bench/ab.py --fields` lists
the fields with their defaults; their reasons are in kernels/tuning.py.

    python bench/ab.py --models 7b --workloads batch1,batch16 --variants reduce_in_kernel=1 reduce_in_kernel=0
    python bench/ab.py --models 7b --lora --workloads batch1,batch16 --variants fused=1 fused=0
    python bench/ab.py --models 7b --lora --workloads batch8 --replay 200 --variants pdl=1 pdl=0
    python bench/ab.py --models 7b --lora --workloads batch8:2048 --max-model-len 2304 --replay 200 --variants pdl=1 pdl=0
    python bench/ab.py --models 32b --workloads batch16 --variants wgmma_small_min_m=16 wgmma_small_min_m=8 --profile 16

Each timed run follows a warm-up run of 2 new tokens under the same variant (it compiles, warms every
graph bucket, captures the graphs); it is bench/rollout.py's timed_calls: TIMED_CALLS calls, each
after a free_cache(keep_warm=True), which keeps the graphs, so each replays them on a new KV cache,
as every train.py step after a run's first does, and the median call's rate (each call's in the
JSON). --replay N also times N back-to-back replays of the decode graph after the last call: the
step's GPU time alone, the sharpest view of a kernel change.

Prints a line per run and writes OUT/ab.json: rows (model, rep, variant, workload, tok/s: decode tok/s
for batchB, total tok/s for grpo; replay_ms with --replay); with --profile, OUT/profile.txt: per variant
the kernels of one decode step on its critical path (bench/rollout.py's profile). --lora adds train.py's
default adapters (rank 32 on all seven projections) to every variant: the rollout a GRPO step runs.
"""
import argparse
import dataclasses
import functools
import gc
import importlib.util
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch

import graphs as graphs_mod
import lora
import rollout
from kernels import tuning

# ----------------------------------------------------------------------------------------------
# variants: field=value of kernels.tuning.Tuning

FIELDS = {f.name: f for f in dataclasses.fields(tuning.Tuning)}


def _value(name: str, text: str):
    """text as a value of Tuning.<name>, by the field's type."""
    kind = FIELDS[name].type
    if kind is bool:
        if text.lower() not in ("0", "1", "false", "true"):
            raise ValueError(f"{name} is a bool: use 0 or 1, got {text!r}")
        return text.lower() in ("1", "true")
    if kind in (int, float):
        return kind(text)
    raise ValueError(f"{name} is a {getattr(kind, '__name__', kind)}: vary it in code with dataclasses.replace")


def parse_variant(text: str) -> dict:
    """'pdl=0,merge_max_parts=8' -> {'pdl': False, 'merge_max_parts': 8}; an unknown name is an error
    that lists the fields."""
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or name not in FIELDS:
            raise ValueError(f"bad field {item!r} in variant {text!r}: use name=value with names {sorted(FIELDS)}")
        out[name] = _value(name, value)
    return out


def tuned(variant: dict):
    """The context in which a parsed variant's fields are current (restored on exit)."""
    return tuning.using(dataclasses.replace(tuning.current(), **variant))


def replay_ms(engine, rows: int, n: int) -> float:
    """GPU time of one decode step: n back-to-back replays of the decode graph the last generate()
    call ran for `rows` sequences (its inputs as the last step left them), timed by CUDA events.
    No host work and no capture: the kernels alone, so a kernel change shows without the few
    percent a whole call's time moves between runs."""
    graphs = engine.runner.graphs
    bucket = next(b for b in graphs_mod.BUCKETS if b >= rows)
    graph = next(g for key, (g, _) in graphs.decode_graphs.items() if key[0] == bucket)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def _bench_rollout():
    """bench/rollout.py as a module (its name clashes with the top-level rollout.py)."""
    spec = importlib.util.spec_from_file_location("bench_rollout", os.path.join(ROOT, "bench", "rollout.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="7b", help="comma-separated: 7b, 14b, 32b, tiny")
    ap.add_argument("--quant", default="nvfp4", choices=("nvfp4", "bf16"))
    ap.add_argument("--lora", action="store_true", help="add train.py's default LoRA adapters")
    ap.add_argument("--workloads", default="batch1,batch16", help="bench/rollout.py workloads (batch8:2048: 2048 "
                    "new tokens; --replay then times the step at that context)")
    ap.add_argument("--variants", nargs="+",
                    help='e.g. reduce_in_kernel=1 reduce_in_kernel=0 "pdl=0,merge_max_parts=0"')
    ap.add_argument("--fields", action="store_true", help="list the Tuning fields and their defaults, then exit")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--replay", type=int, default=0, help="also time this many back-to-back replays of each "
                    "batchB run's decode graph: the step's GPU time (replay_ms)")
    ap.add_argument("--profile", default="", help="batch sizes (comma-separated) whose decode step is also "
                    "profiled per variant after the timed reps: OUT/profile.txt (bench/rollout.py's profile)")
    args = ap.parse_args(argv)
    if args.fields:
        for name, f in FIELDS.items():
            print(f"{name:24s} {getattr(f.type, '__name__', f.type):10s} {getattr(tuning.current(), name)!r}")
        return
    if not args.variants:
        ap.error("--variants is required (or --fields)")
    variants = {v: parse_variant(v) for v in args.variants}
    br = _bench_rollout()
    try:
        wls = br.workloads(args.workloads, args.max_model_len)
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        sys.exit("bench/ab.py needs a CUDA GPU")
    rows = []
    for model_name in args.models.split(","):
        cfg = br.CONFIGS[model_name]
        model = br.build_model(cfg, quant=args.quant, device="cuda", dtype=torch.bfloat16, seed=0)
        if args.lora:
            lora.apply_lora(model, lora.LoRAConfig())
        engine = rollout.LLMEngine(model, max_model_len=args.max_model_len, max_num_seqs=256)
        for rep in range(args.reps):
            for name, variant in variants.items():
                with tuned(variant):
                    for wl, w in wls.items():
                        prompts = br.random_prompts(w["prompts"], w["prompt_len"], cfg["vocab_size"], 0)
                        engine.free_cache()                          # graphs of this variant's kernels
                        br.run_ours(engine, prompts, w["n"], 2)      # warm-up (compiles)
                        r = br.timed_calls(engine, prompts, wl, w)   # graphs kept, as between train.py's steps
                        row = dict(model=model_name, rep=rep, variant=name, workload=wl, tok_s=br.rate(wl, w, r),
                                   calls_tok_s=r["calls_tok_s"])
                        if args.replay and wl != "grpo":
                            row["replay_ms"] = replay_ms(engine, w["prompts"], args.replay)
                        rows.append(row)
                        print(f"{model_name} rep {rep} {name:24s} {wl:8s} {row['tok_s']:9.1f} tok/s"
                              + (f"  replay {row['replay_ms']:.4f} ms" if "replay_ms" in row else ""), flush=True)
        for batch in (int(b) for b in args.profile.split(",") if b):
            for name, variant in variants.items():
                with tuned(variant):
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
