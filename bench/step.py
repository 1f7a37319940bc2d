"""One GRPO step at the paper's shapes: where the time and the memory of a training step go.

A configuration is (model shape, base-weight format, completion length). For each one this builds
a random-init Qwen2.5 model (checkpoint.SHAPES: no checkpoint, no network) through train.build_policy,
i.e. with train.py's defaults: LoRA r32 α64 on every linear, AdamW, DAPO loss, the step plan
(plan.py: micro-batches sized from free memory, recomputation only where it is needed, a bf16 base
sampled with the adapters merged in where memory allows), lm_head log-probs in chunks, AQN noise on
(σ of stage 1, 1e-2). Then it runs train.py's step on synthetic data:

    prompts   P random-token prompts of prompt-len tokens (default 16 x 256)
    rollout   engine.generate(prompts, n=G) under the step's AQN noise, with no stop token, so every
              completion runs to exactly `completion` tokens (1024 or 2048: the worst case of a step);
              the KV cache freed before the backward unless the plan keeps it, as train.py does
    reward    uniform random in [0, 1), seeded: every group has a spread, so every advantage is
              non-zero and the backward moves the adapters (grad_norm > 0)
    train     train.train_step: collate, advantages, log-prob pass, forward+backward, AdamW

It reports the step time split as train.py logs it: rollout (time/rollout), logprob pass (collate,
advantages and the no-grad passes that β > 0 or μ > 1 need: ~0 with the defaults), forward+backward
(time/forward_backward) and optimizer (clip + AdamW); rollout tok/s = generated tokens / rollout
seconds (the warm-up step captured the CUDA graphs; the timed one replays them); peak GPU memory,
allocated and reserved, of the whole step and of its rollout and train halves; the time to build.
A warm-up step comes first, by default the timed step itself: it pays what a run pays once (Triton
JIT, CUDA-graph captures, cuBLAS and cuDNN plans, the allocator's first growth, and torch.compile of the
training pass's small ops, which compiles only from a micro-batch of tuning's compile_min_numel
elements on, so a shorter warm-up can leave that compilation inside the timed step).
--warmup-tokens shortens it where one more long step costs too much (72B); the JSON has both steps,
the table the timed one.

Each configuration runs in its own Python process, so one's peak memory, OOM or leftover cache never
touches the next. Before building, the process applies checkpoint.check_fits's rule (checkpoint.load_bytes:
weights + the bf16 weights in flight, vs free memory); a model that fails it is reported "does not fit" with both numbers
and never built. That rule is necessary, not sufficient: bf16 32B (61 GiB of weights) passes it on an
80 GB H100, and whether the KV cache, adapters, optimizer and activations fit too is found by running
it, where an out-of-memory error is caught and reported ("oom", with the phase it hit).
--available-gib replaces the free memory in the check and, on a GPU, caps what the process may allocate
(torch.cuda.set_per_process_memory_fraction): a smaller card, emulated (the step plan and the KV cache
are sized within that cap: plan.free_memory), and the CPU test. --force skips the
check and checkpoint.check_fits itself, to watch the allocation fail for real.

    python bench/step.py --models 7b --quants nvfp4,bf16 --completion 1024       # ~2.5 min on an H100
    python bench/step.py --models 7b --quants nvfp4,nvfp4-eager --completion 1024  # compiled vs eager small ops
    python bench/step.py --models 7b --quants bf16,bf16-unmerged --prompts 1 --group 8 --completion 2048
    python bench/step.py --models 32b --quants bf16 --completion 1024     # passes check_fits; does the step?
    python bench/step.py --models 32b --quants bf16 --completion 1024 --available-gib 60 --force  # OOM, for real
    python bench/step.py --models 72b --quants nvfp4 --prompts 1 --group 8 --completion 2048 \\
        --available-gib 76 --warmup-tokens 16      # the paper's 32B recipe on 72B within an 80 GB card's 76 GiB
    python bench/step.py --models tiny --device cpu --dtype float32 --prompts 2 --group 2 \\
        --prompt-len 8 --completion 4 --micro-batch 2 --out /tmp/step.json            # CPU smoke test
Results merge into --out by (model, quant, completion), so runs split over several device calls
add up to one table. Test: tests/test_step_bench.py (the tiny run and the "does not fit" path on CPU).
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

import aqn
import checkpoint as qckpt
import lora
import model as qmodel
import rollout
import train
from kernels import tuning

# ----------------------------------------------------------------------------------------------
# configurations

MODELS = {"7b": qckpt.SHAPES["qwen2.5-7b"], "14b": qckpt.SHAPES["qwen2.5-14b"],
          "32b": qckpt.SHAPES["qwen2.5-32b"], "72b": qckpt.SHAPES["qwen2.5-72b"], "qwen3-8b": qckpt.SHAPES["qwen3-8b"],
          "tiny": dict(qckpt.SHAPES["qwen2.5-7b"], vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)}  # a smoke test
# -eager: the training pass's small ops not compiled; -unmerged: the sampler computes the adapters' update
# instead of decoding with them merged in (the plan keeps no copies: lora.merged_sampling)
QUANTS = ("nvfp4", "bf16", "nvfp4-eager", "bf16-eager", "bf16-unmerged")
KEY = ("model", "quant", "completion")
GIB = 2 ** 30


def base_quant(spec: dict) -> str:
    """"nvfp4-eager" -> "nvfp4", "bf16-unmerged" -> "bf16": the base-weight format of an arm."""
    return spec["quant"].removesuffix("-eager").removesuffix("-unmerged")


def needed_bytes(cfg: dict, quant: str, dtype) -> tuple[int, int]:
    """(weight bytes, checkpoint.load_bytes): exact bytes of the meta model, and + the bf16 weights in flight."""
    with torch.device("meta"):
        meta = qmodel.Transformer(qmodel.ModelConfig.from_hf(cfg), quant, dtype)
    return qckpt.weight_bytes(meta), qckpt.load_bytes(meta)


def train_args(spec: dict, model_dir: str):
    """train.py's flags for this configuration: every other setting is train.py's default, but for
    --quantizer rtn: a step's speed does not depend on which codes were chosen, and GPTQ's one-time cost
    at load is bench/quant.py's to measure."""
    return train.parse_args(["--model", model_dir, "--random-init", "--quant", base_quant(spec), "--quantizer", "rtn",
                             "--dtype", spec["dtype"],
                             "--prompts-per-step", str(spec["prompts"]), "--group-size", str(spec["group"]),
                             "--max-prompt-len", str(spec["prompt_len"]), "--max-new-tokens", str(spec["completion"]),
                             "--eval-limit", "0", "--gpu-memory-utilization", str(spec["gpu_memory_utilization"]),
                             *(["--micro-batch", str(spec["micro_batch"])] if spec["micro_batch"] else []),
                             *({True: ["--grad-checkpointing"], False: ["--no-grad-checkpointing"]}
                               .get(spec["grad_checkpointing"], []))])


# ----------------------------------------------------------------------------------------------
# one configuration, in its own process


def memory(device, key: str) -> float | None:
    return getattr(torch.cuda, key)(device) / GIB if device.type == "cuda" else None


def grpo_step(policy, args, device, prompts, step: int, new_tokens: int) -> dict:
    """train.py's step on the given prompts, random rewards and forced-length completions."""
    model, engine, G = policy.model, policy.engine, policy.grpo_cfg.group_size
    sigma = aqn.sigma_at(step, args.max_steps, policy.aqn_cfg)
    noise = aqn.sample_noise(model, sigma, torch.Generator().manual_seed(train.step_seed(args.seed, step, "aqn")))
    sp = rollout.SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=new_tokens,
                                n=G, seed=train.step_seed(args.seed, step, "sample"), stop_token_ids=())
    mem = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = train.clock(device)
    with aqn.noise_applied(model, noise), lora.merged_sampling(model):     # as train.rollout_step samples
        comps = engine.generate(prompts, sp)                                   # [P][G] Completion
    kv = dict(kv_blocks=engine.stats["num_blocks"], preemptions=engine.stats["preemptions"])
    if engine.cache_bytes() > policy.step_plan.keep_cache_bytes:            # as train.rollout_step does
        engine.free_cache(keep_warm=True)
    t_rollout = train.clock(device) - t0
    if device.type == "cuda":
        mem = {"rollout_peak_gib": memory(device, "max_memory_allocated"),
               "rollout_reserved_gib": memory(device, "max_memory_reserved")}
        torch.cuda.reset_peak_memory_stats(device)
    rewards = torch.rand(len(prompts) * G, generator=torch.Generator().manual_seed(step))   # (P·G,)
    groups = [train.Group(None, p, cs, rewards[i * G:(i + 1) * G]) for i, (p, cs) in enumerate(zip(prompts, comps))]
    m = train.train_step(policy, groups, noise, 0, args)
    step_s = train.clock(device) - t0
    lens = [len(c.token_ids) for cs in comps for c in cs]
    out = dict(step_s=step_s, rollout_s=t_rollout, logprob_pass_s=m["time/logprob_pass"],
               backward_s=m["time/forward_backward"], optimizer_s=m["time/optimizer"],
               rollout_tok_s=sum(lens) / t_rollout, new_tokens=sum(lens), completion_len_min=min(lens),
               completion_len_max=max(lens), forced=all(n == new_tokens for n in lens),
               loss=m["loss"], grad_norm=m["grad_norm"], aqn_sigma=sigma, micro_batches=m["micro_batches"], **kv, **mem)
    if device.type == "cuda":
        out.update(train_peak_gib=memory(device, "max_memory_allocated"),
                   train_reserved_gib=memory(device, "max_memory_reserved"))
        out["peak_allocated_gib"] = max(out["rollout_peak_gib"], out["train_peak_gib"])
        out["peak_reserved_gib"] = max(out["rollout_reserved_gib"], out["train_reserved_gib"])
    return out


def run_config(spec: dict) -> dict:
    """Measure one configuration: a record with status ok | does not fit | oom | error."""
    device = torch.device(spec["device"] or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg, dtype = MODELS[spec["model"]], getattr(torch, spec["dtype"])
    rec = {k: spec[k] for k in ("model", "quant", "completion", "prompts", "group", "prompt_len", "micro_batch")}
    rec.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               torch=torch.__version__, triton=getattr(sys.modules.get("triton"), "__version__", None))
    weights, need = needed_bytes(cfg, base_quant(spec), dtype)
    free, total = torch.cuda.mem_get_info(device) if device.type == "cuda" else (None, None)
    if spec["available_gib"] is not None:
        free = spec["available_gib"] * GIB
    rec.update(alloc_conf=os.environ.get("PYTORCH_ALLOC_CONF"),    # train.py's default: expandable segments
               weights_gib=weights / GIB, needed_gib=need / GIB, available_gib=None if free is None else free / GIB,
               device_total_gib=None if total is None else total / GIB)
    if spec["force"]:
        qckpt.check_fits = lambda *args, **kwargs: None  # let the allocation itself succeed or fail
    elif free is not None and need > free:
        return dict(rec, status="does not fit")
    if spec["available_gib"] is not None and device.type == "cuda":
        # allocations past it raise torch.OutOfMemoryError, as on a smaller card
        torch.cuda.set_per_process_memory_fraction(min(1.0, free / total),
                                                   torch.cuda.current_device() if device.index is None else device.index)
    if spec["quant"].endswith("-unmerged"):   # this worker's plan keeps no copies, so its sampler never merges
        lora.mergeable = lambda model: []
    phase = "build"
    try:
        with tempfile.TemporaryDirectory() as d:  # train.py's --random-init reads a shape from config.json
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(cfg, f)
            args = train_args(spec, d)
            t0 = train.clock(device)
            policy = train.build_policy(args, device)
            rec.update(build_s=train.clock(device) - t0, built_gib=memory(device, "memory_allocated"))
        print(f"     built in {rec['build_s']:.1f} s", flush=True)
        rec["train_flags"] = {k: getattr(args, k) for k in ("lora_rank", "lora_alpha", "loss_type", "logprob_chunk",
                                                            "aqn", "gpu_memory_utilization", "temperature")}
        rec["step_plan"] = policy.step_plan.as_dict()
        print(f"     {train.plan.describe(policy.step_plan)}", flush=True)
        prompts = torch.randint(0, cfg["vocab_size"], (spec["prompts"], spec["prompt_len"]),
                                generator=torch.Generator().manual_seed(args.seed)).tolist()
        step = args.max_steps // args.aqn_stages                 # the first noisy AQN stage
        phase = "warm-up step"
        warm = min(spec["warmup_tokens"] or spec["completion"], spec["completion"])
        rec["warmup"] = grpo_step(policy, args, device, prompts, step, warm)
        print(f"     warm-up step ({warm} new tokens) {rec['warmup']['step_s']:.1f} s", flush=True)
        phase = "timed step"
        rec.update(grpo_step(policy, args, device, prompts, step + 1, spec["completion"]), status="ok")
    except torch.OutOfMemoryError as e:
        rec.update(status="oom", phase=phase, error=str(e).split("\n")[0][:400],
                   peak_allocated_gib=memory(device, "max_memory_allocated"),
                   peak_reserved_gib=memory(device, "max_memory_reserved"))
    except Exception as e:  # e.g. a KV cache too small for one sequence: keep the message in the record
        traceback.print_exc()
        rec.update(status="error", phase=phase, error=f"{type(e).__name__}: {e}"[:400])
    return rec


# ----------------------------------------------------------------------------------------------
# the driver: one process per configuration, a table, the JSON


def spawn(spec: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "record.json")
        rc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec),
                             "--record", path]).returncode
        if rc != 0 or not os.path.exists(path):  # killed (host OOM), or an error other than CUDA OOM
            return dict({k: spec[k] for k in KEY}, status=f"crashed (exit code {rc})")
        with open(path) as f:
            return json.load(f)


def status_text(r: dict) -> str:
    if r["status"] == "does not fit":
        return f"does not fit: needs {r['needed_gib']:.1f} GiB, {r['available_gib']:.1f} GiB free"
    if r["status"] == "oom":
        return f"OOM in {r['phase']} (peak {r['peak_reserved_gib'] or 0:.1f} GiB reserved)"
    if r["status"] == "error":
        return f"error in {r['phase']}: {r['error']}"
    if r["status"] == "ok":
        return f"ok: step {r['step_s']:.2f} s, rollout {r['rollout_tok_s']:.0f} tok/s"
    return r["status"]


def print_table(rows: list) -> None:
    cols = ["model", "quant", "new", "build s", "step s", "rollout s", "logprob s", "fwd+bwd s", "optim s",
            "rollout tok/s", "preempt", "peak alloc GiB", "peak reserved GiB"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    order = list(MODELS)
    for r in sorted(rows, key=lambda r: (order.index(r["model"]), r["quant"], r["completion"])):
        head = [r["model"], r["quant"], str(r["completion"])]
        if r["status"] != "ok":
            print("| " + " | ".join(head + [status_text(r)] + [""] * (len(cols) - 4)) + " |")
            continue
        num = [r["build_s"], r["step_s"], r["rollout_s"], r["logprob_pass_s"], r["backward_s"], r["optimizer_s"]]
        mem = [r.get("peak_allocated_gib"), r.get("peak_reserved_gib")]
        print("| " + " | ".join(head + [f"{x:.2f}" for x in num] + [f"{r['rollout_tok_s']:.0f}", str(r["preemptions"])]
                                + ["-" if x is None else f"{x:.1f}" for x in mem]) + " |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="7b,14b,32b", help=f"comma-separated: {', '.join(MODELS)}")
    ap.add_argument("--quants", default="nvfp4,bf16", help="comma-separated: nvfp4, bf16; an -eager suffix "
                    "(nvfp4-eager) runs the training pass's norms / RoPE / SiLU·mul eagerly (kernels/compiled.py); "
                    "bf16-unmerged samples with the adapters' update computed apart, not merged into the weights")
    ap.add_argument("--completion", default="1024,2048", help="comma-separated completion lengths (forced)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=None, help="completions per training forward (default: "
                    "train.py's, sized from free memory)")
    ap.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                    help="default: train.py's (only where memory needs it)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="KV-cache share (train.py's flag)")
    ap.add_argument("--warmup-tokens", type=int, default=None, help="completion length of the warm-up step "
                    "(default: the timed step's)")
    ap.add_argument("--available-gib", type=float, default=None, help="free memory for the fit check (what-if)")
    ap.add_argument("--force", action="store_true", help="run configurations that do not fit (record the OOM)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "step.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)   # a spec (JSON): measure it in this process
    ap.add_argument("--record", help=argparse.SUPPRESS)   # where the worker writes its record
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        eager = spec["quant"].endswith("-eager")
        never = {"compile_min_numel": 2 ** 62} if eager else {}
        with tuning.using(dataclasses.replace(tuning.current(), **never)):
            rec = run_config(spec)
        with open(args.record, "w") as f:
            json.dump(rec, f)
        return
    print(json.dumps(vars(args)))
    bad = [m for m in args.models.split(",") if m not in MODELS] + \
        [q for q in args.quants.split(",") if q not in QUANTS]
    if bad:
        ap.error(f"unknown model or quant {bad}: models {list(MODELS)}, quants {', '.join(QUANTS)}")
    command = " ".join([os.path.relpath(os.path.abspath(__file__)), *(sys.argv[1:] if argv is None else argv)])
    base = {k: v for k, v in vars(args).items() if k not in ("models", "quants", "completion", "out", "worker",
                                                                "record")}
    rows = json.load(open(args.out))["rows"] if os.path.exists(args.out) else []
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for m in args.models.split(","):
        for q in args.quants.split(","):
            for c in map(int, args.completion.split(",")):
                print(f"---- {m} {q} completion {c}", flush=True)
                rec = dict(spawn(dict(base, model=m, quant=q, completion=c)), command=command)
                print(f"     {status_text(rec)}", flush=True)
                rows = [r for r in rows if tuple(r[k] for k in KEY) != tuple(rec[k] for k in KEY)] + [rec]
                with open(args.out, "w") as f:  # after every configuration: a run cut by a time limit keeps its rows
                    json.dump({"rows": rows}, f, indent=1)
    print_table(rows)
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
