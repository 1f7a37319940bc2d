"""Benchmark of the paged sampler (rollout.py) on random-init Qwen2.5 shapes, against HF generate.

Engines, on the same random weights (checkpoint.build_model, real Qwen2.5 config values, ANCHORS.md):
    ours-nvfp4   LLMEngine over the NVFP4 model (Triton FP4 x BF16 linears), CUDA graphs
    ours-bf16    LLMEngine over the bf16 model, CUDA graphs
    hf-bf16      transformers' generate on a Qwen2ForCausalLM that shares the bf16 weights (7B only)
    *-nopdl      (e.g. ours-nvfp4-nopdl) Triton kernels launched without programmatic dependent launch
                 (the Tuning field pdl=False, kernels/tuning.py): what PDL buys
    *-lora       (e.g. ours-nvfp4-lora) with train.py's default adapters (rank 32 on q/k/v/o/gate/up/down,
                 B = 0 as initialised): the rollout a GRPO step actually runs, live adapters included
    *-unfused    (e.g. ours-nvfp4-unfused) every op of ops.py as its torch reference (fused=False):
                 norms, RoPE and SiLU·mul as plain torch ops, q/k/v and gate/up one linear at a time,
                 LoRA updates as torch GEMMs: what the fast path of the seam buys
Workloads (every sequence runs to its full length: no stop tokens; sampling at temperature 1):
    batchB   B = 1, 2, 4, ..., 64 prompts of 256 random tokens, 512 new each:
             decode tok/s = B·(new - 1) / (total - TTFT)
    batchB:N the same with N new tokens each: batch8:2048 is the QeRL paper's operating point
             (--max-model-len must hold 256 + N; an error says so before any model is built)
    grpo     16 prompts x 8 samples, prompt 256, 1024 new: total tok/s = new tokens / wall time,
             time to first token (all prompts prefilled and first tokens sampled), peak memory
Each workload is timed after a warm-up on the same prompts with 2 new tokens (Triton compiles its
kernels for those shapes once per process, and the engine captures the CUDA graphs of the batch).
The timed call then runs TIMED_CALLS times, each after the KV cache is freed as train.py frees it
before each backward (free_cache(keep_warm=True)): the graphs stay, as they do between training
steps, so every timed call replays them on a new cache, as every step after a run's first does.
The row is the median call (the JSON keeps each call's rate): the first call after the warm-up can
run measurably faster than the ones after it, which are what a run's steps see (kernels/README.md,
"Which call is timed"). TTFT is the engine's: from the call to the first tokens sampled on the GPU
(an event); the JSON also has first_read_s, when the host reads them, one step later (after queuing
the first decode step).

    python bench/rollout.py                                   # 7B: ours-nvfp4, ours-bf16, hf-bf16
    python bench/rollout.py --models 32b --engines ours-nvfp4,ours-bf16
    python bench/rollout.py --workloads batch1 --out DIR      # table on stdout, DIR/rollout.json
    python bench/rollout.py --models tiny --engines ours-nvfp4,ours-bf16   # a 1-minute smoke test
    python bench/rollout.py --engines ours-nvfp4 --profile    # + per-kernel GPU time, OUT/profile.txt
Each model is built, measured and freed in turn; results merge into the JSON by (model, engine,
workload), so separate invocations (e.g. under a 10-minute limit) add up to one table.
"""
import argparse
import dataclasses
import functools
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

import attention
import lora
import rollout
from checkpoint import SHAPES, build_model
from kernels import tuning

# ----------------------------------------------------------------------------------------------
# Qwen2.5 and Qwen3 shapes (checkpoint.SHAPES, ANCHORS.md)

CONFIGS = {"7b": SHAPES["qwen2.5-7b"], "14b": SHAPES["qwen2.5-14b"], "32b": SHAPES["qwen2.5-32b"],
           "qwen3-8b": SHAPES["qwen3-8b"],
           "tiny": dict(SHAPES["qwen2.5-7b"], hidden_size=512, intermediate_size=1024,   # a smoke test
                        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)}
WORKLOADS = {f"batch{b}": dict(prompts=b, n=1, prompt_len=256, new=512) for b in (1, 2, 4, 8, 16, 32, 64)}
WORKLOADS["grpo"] = dict(prompts=16, n=8, prompt_len=256, new=1024)
TIMED_CALLS = 3          # timed calls of a workload, each on a new KV cache: the median is reported


def workload(name: str) -> dict:
    """The workload called name: one of WORKLOADS, or batchB:N, batchB with N new tokens a sequence."""
    base, sep, new = name.partition(":")
    if base in WORKLOADS and (not sep or (base.startswith("batch") and new.isdigit() and int(new) >= 2)):
        return dict(WORKLOADS[base], **({"new": int(new)} if sep else {}))
    raise ValueError(f"unknown workload {name!r}: use one of {', '.join(WORKLOADS)}, or batchB:N for N >= 2 "
                     f"new tokens (batch8:2048)")


def workloads(names: str, max_model_len: int) -> dict:
    """{name: workload} for comma-separated names, each checked to fit max_model_len (prompt + new
    tokens), so that a bad name or a too-short --max-model-len stops the run before a model is built."""
    out = {name: workload(name) for name in names.split(",")}
    for name, w in out.items():
        need = w["prompt_len"] + w["new"]
        if need > max_model_len:
            raise ValueError(f"workload {name} needs {need} positions a sequence: "
                             f"pass --max-model-len {need} or more (got {max_model_len})")
    return out


def random_prompts(count, length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=g).tolist()


# ----------------------------------------------------------------------------------------------
# the engines

def run_ours(engine, prompts, n, new):
    params = rollout.SamplingParams(temperature=1.0, max_tokens=new, n=n, seed=0, stop_token_ids=())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for cs in out for c in cs)
    assert tokens == len(prompts) * n * new, "a sequence stopped early"
    return dict(total_s=total, ttft_s=engine.stats["ttft_s"], first_read_s=engine.stats["first_read_s"],
                new_tokens=tokens,
                preemptions=engine.stats["preemptions"], kv_blocks=engine.stats["num_blocks"])


def timed_calls(engine, prompts, wl, w, calls=TIMED_CALLS):
    """run_ours of workload wl (w its dict), `calls` times, each after free_cache(keep_warm=True) (a
    training step's free: the graphs stay, the cache is allocated again): the median call by wall
    time, with every call's rate (rate()) under "calls_tok_s"."""
    runs = []
    for _ in range(calls):
        engine.free_cache(keep_warm=True)
        runs.append(run_ours(engine, prompts, w["n"], w["new"]))
    median = sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2]
    return dict(median, calls_tok_s=[rate(wl, w, r) for r in runs])


def rate(wl, w, r):
    """The rate a run r of workload wl reports: total tok/s for grpo, decode tok/s for batchB."""
    return r["new_tokens"] / r["total_s"] if wl == "grpo" else decode_tok_s(w, r)


def decode_tok_s(w, r):
    """Decode tok/s of a batchB run r of workload w: every token after each sequence's first."""
    return w["prompts"] * (w["new"] - 1) / (r["total_s"] - r["ttft_s"])


def hf_from_ours(model, cfg, device="cuda"):
    """A transformers Qwen2ForCausalLM / Qwen3ForCausalLM whose linears and embeddings are our bf16
    tensors (no copy)."""
    import transformers
    arch = cfg["architectures"][0]
    hcfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(
        **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        hf = getattr(transformers, arch)(hcfg).to(torch.bfloat16)
    state = {k: (v.to(torch.bfloat16) if "norm" in k else v) for k, v in model.state_dict().items()
             if k in hf.state_dict()}
    missing, _ = hf.load_state_dict(state, strict=False, assign=True)
    assert not [k for k in missing if "rotary" not in k], missing
    with torch.device(device):                                            # inv_freq off the meta device
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hcfg)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.eval()


@torch.inference_mode()
def run_hf(hf, prompts, n, new):
    ids = torch.tensor(prompts, device=hf.device)                        # equal lengths: no padding
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=n,
              attention_mask=torch.ones_like(ids))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, **kw)         # a separate 1-token call: HF has no TTFT hook
    torch.cuda.synchronize()
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return dict(total_s=total, ttft_s=ttft, new_tokens=(out.shape[1] - ids.shape[1]) * out.shape[0])


# ----------------------------------------------------------------------------------------------
# the table

def _critical_path(prof):
    """Kernels in stream order, each charged end - max(start, previous end): the charges add up to
    the GPU's busy time, and a kernel launched early by PDL (whose own duration includes its wait
    for the previous one) costs only what it adds. Idle time (no kernel running) is charged to the
    pair of kernels around it, so a gap can be traced to the launch that leaves it.
    -> ({name: (us, calls)}, {(before, after): (idle us, gaps)})"""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace
                     if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))
    cost, idle, last_end, last_name = {}, {}, kernels[0][0], kernels[0][2]
    for start, end, name in kernels:
        if start > last_end:
            us, gaps = idle.get((last_name, name), (0.0, 0))
            idle[(last_name, name)] = (us + start - last_end, gaps + 1)
        us, calls = cost.get(name, (0.0, 0))
        cost[name] = (us + max(0.0, end - max(start, last_end)), calls + 1)
        if end >= last_end:
            last_end, last_name = end, name
    return cost, idle


def _idle(gaps) -> float:
    """All the idle us of one run, from _critical_path's gaps."""
    return sum(us for us, _ in gaps.values())


def _per_step(long, short, steps):
    """{key: (us, count)} of the long run minus the short one, per extra decode step."""
    return {k: ((us - short.get(k, (0.0, 0))[0]) / steps, (n - short.get(k, (0.0, 0))[1]) / steps)
            for k, (us, n) in long.items()}


def profile(run, vocab, batch, new, path, label=""):
    """GPU time per decode step, two ways. The profiler's sum of kernel durations (torch.profiler
    sees the kernels inside graph replays) counts a kernel launched early by PDL while it waits.
    The critical path (_critical_path) does not; it is taken for `new` and for 8 new tokens, and the
    difference divided by the new - 8 extra steps, so prefill and capture drop out."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    prompts = random_prompts(batch, 256, vocab, 1)
    paths = []
    for n in (8, new):
        run(prompts, 1, n)                                          # capture this bucket first
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(prompts, 1, n)
        paths.append(_critical_path(prof))
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    (short, idle0), (long, idle1) = paths
    steps = new - 8
    per_step = _per_step(long, short, steps)
    gaps = _per_step(idle1, idle0, steps)
    busy = sum(us for us, _ in per_step.values())
    lines = [f"critical path per decode step ({steps} steps: {new} new tokens minus 8): "
             f"busy {busy:.1f} us, idle {(_idle(idle1) - _idle(idle0)) / steps:.1f} us"]
    for name, (us, calls) in sorted(per_step.items(), key=lambda kv: -kv[1][0])[:25]:
        lines.append(f"  {us:9.1f} us  {calls:6.1f} calls  {name[:90]}")
    lines.append("idle per decode step, by the kernels before and after the gap:")
    for (before, after), (us, n) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:8]:
        lines.append(f"  {us:9.1f} us  {n:6.1f} gaps  {before[:50]} -> {after[:50]}")
    critical = "\n".join(lines)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(f"\n## {label} batch {batch}, {new} new tokens ({new - 1} decode steps)\n{table}\n{critical}\n")
    print(table + "\n" + critical, flush=True)


def measure(model_name, engine_name, workloads, max_model_len, profile_path=None, profile_batches=(1, 16, 128)):
    cfg = CONFIGS[model_name]
    quant = "nvfp4" if engine_name.startswith("ours-nvfp4") else "bf16"
    variant = dataclasses.replace(tuning.current(), fused=not engine_name.endswith("-unfused"),
                                  pdl=not engine_name.endswith("-nopdl"))
    with tuning.using(variant):
        return _measure(model_name, engine_name, cfg, quant, workloads, max_model_len, profile_path, profile_batches)


def _measure(model_name, engine_name, cfg, quant, workloads, max_model_len, profile_path, profile_batches):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = build_model(cfg, quant=quant, device="cuda", dtype=torch.bfloat16, seed=0)
    if engine_name.endswith("-lora"):
        lora.apply_lora(model, lora.LoRAConfig())                    # train.py's defaults
    print(f"[{model_name} {engine_name}] built in {time.perf_counter() - t0:.0f}s, "
          f"weights {torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)
    rows = []
    if engine_name == "hf-bf16":
        engine = hf_from_ours(model, cfg)
        run = functools.partial(run_hf, engine)
    else:
        engine = rollout.LLMEngine(model, max_model_len=max_model_len, max_num_seqs=256)
        run = functools.partial(run_ours, engine)
    for wl, w in workloads.items():
        prompts = random_prompts(w["prompts"], w["prompt_len"], cfg["vocab_size"], 0)
        run(prompts, w["n"], 2)            # warm-up: Triton compiles for these shapes, once per process
        torch.cuda.reset_peak_memory_stats()
        r = run(prompts, w["n"], w["new"]) if engine_name == "hf-bf16" else timed_calls(engine, prompts, wl, w)
        r.update(model=model_name, engine=engine_name, workload=wl, **w,
                 peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30,
                 tok_s=r["new_tokens"] / r["total_s"])
        if wl.startswith("batch"):
            r["decode_tok_s"] = decode_tok_s(w, r)
        rows.append(r)
        print(f"  {wl}: {r['tok_s']:.1f} tok/s total, ttft {r['ttft_s'] * 1e3:.0f} ms, "
              f"peak {r['peak_mem_gib']:.1f} GiB", flush=True)
    if profile_path and engine_name != "hf-bf16":
        for batch in profile_batches:
            profile(run, cfg["vocab_size"], batch, 40, profile_path, f"{model_name} {engine_name}")
    if engine_name != "hf-bf16":
        engine.free_cache()
    del engine, run, model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def print_table(rows):
    head = f"{'model':5} {'engine':15} {'workload':11} {'tok/s':>9} {'decode tok/s':>12} {'TTFT ms':>8} {'peak GiB':>8}"
    print(head + "\n" + "-" * len(head))
    for r in sorted(rows, key=lambda r: (r["model"], r["prompts"] * r["n"], r["new"], r["engine"])):
        dec = f"{r['decode_tok_s']:.1f}" if "decode_tok_s" in r else "-"
        print(f"{r['model']:5} {r['engine']:15} {r['workload']:11} {r['tok_s']:9.1f} {dec:>12} "
              f"{r['ttft_s'] * 1e3:8.0f} {r['peak_mem_gib']:8.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="7b", help="comma-separated: 7b, 14b, 32b, qwen3-8b, tiny (a quick smoke test)")
    ap.add_argument("--engines", default="ours-nvfp4,ours-bf16,hf-bf16",
                    help="comma-separated: ours-nvfp4, ours-bf16, hf-bf16 (hf is skipped for 32b); "
                         "an -unfused suffix (ours-nvfp4-unfused) runs norms/RoPE/SiLU as plain torch ops, "
                         "a -nopdl suffix launches every Triton kernel without programmatic dependent launch, "
                         "a -lora suffix adds train.py's default LoRA adapters")
    ap.add_argument("--workloads", default="batch1,grpo", help="comma-separated: batch1, batch2, ..., batch64 (powers "
                    "of two), grpo; batchB:N for N new tokens (batch8:2048)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--profile", action="store_true", help="also write per-kernel GPU time to OUT/profile.txt")
    ap.add_argument("--profile-batches", default="1,16,128", help="batch sizes --profile runs")
    args = ap.parse_args()
    print(vars(args))
    try:
        wls = workloads(args.workloads, args.max_model_len)
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        sys.exit("bench/rollout.py needs a CUDA GPU")
    path = os.path.join(args.out, "rollout.json")
    old = json.load(open(path))["rows"] if os.path.exists(path) else []
    rows = []
    for m in args.models.split(","):
        for e in args.engines.split(","):
            if e == "hf-bf16" and m == "32b":
                continue
            rows += measure(m, e, wls, args.max_model_len,
                            os.path.join(args.out, "profile.txt") if args.profile else None,
                            tuple(int(b) for b in args.profile_batches.split(",")))
    keys = {(r["model"], r["engine"], r["workload"]) for r in rows}
    rows += [r for r in old if (r["model"], r["engine"], r["workload"]) not in keys]
    print_table(rows)
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "varlen_prefill": attention.VARLEN, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
