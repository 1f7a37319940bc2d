"""The QeRL paper's speed table, side by side: NVFP4 + LoRA + AQN against bf16 LoRA at the paper's shapes.

The paper (arXiv 2510.11696, its speed table; ANCHORS.md) times one H100 at prompt 256 + completion
2048: the end-to-end speed-up of QeRL over 16-bit LoRA at batch 2, 4 and 8 (7B and 14B), and the
rollout tokens a second at batch 8 (7B, 14B, and 32B, whose 16-bit LoRA does not fit the GPU).

How "batch" is read here: the sequences a rollout decodes at once, prompts × samples. GRPO needs at
least two samples of a prompt, so batch 2, 4 and 8 are one prompt with 2, 4 and 8 samples, and batch
32 (not in the paper; GRPO's usual shape) is 4 prompts × 8. Each row is one bench/step.py
configuration, run in its own process: train.py's step (build_policy's defaults: LoRA r32 on every
linear, AdamW, DAPO, AQN on at its first noisy stage, the memory plan), every completion forced to
2048 tokens, after a warm-up step of the same shape (bench/step.py's default: a shorter one left the
first compile of the training pass inside the timed step of these one-prompt rows). The ratio is bf16's step (or rollout) time over NVFP4's,
both measured by this run on this GPU. bf16 runs twice: as train.py runs it, the adapters merged into
the weights for each rollout where memory allows (lora.merged_sampling; TRL hands vLLM merged weights
the same way), the faster peer, which NVFP4 cannot be; and unmerged (bench/step.py's bf16-unmerged: the
sampler computes the adapters' update, as the trainer does), which is where the plan keeps no copies.

    python bench/paper.py --out DIR                    # every row, each step run twice
    python bench/paper.py --models 7b --batches 2,8    # a part of it; rows merge into DIR/paper.json
    python bench/paper.py --models tiny --batches 2 --device cpu --dtype float32 --completion 4 \\
        --prompt-len 8 --out /tmp/paper                 # the CPU smoke test (tests/test_paper_bench.py)

Prints the table (ours next to the paper's) and writes DIR/paper.json: the bench/step.py records.
"""
import argparse
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# (prompts, samples) a batch of sequences is read as
BATCHES = {2: (1, 2), 4: (1, 4), 8: (1, 8), 32: (4, 8)}
# the paper's figures (one H100): end-to-end speed-up over 16-bit LoRA, and rollout tok/s at batch 8
PAPER_SPEEDUP = {("7b", 2): 1.5, ("7b", 4): 1.4, ("7b", 8): 1.2, ("14b", 2): 1.4, ("14b", 4): 1.2, ("14b", 8): 1.2}
PAPER_ROLLOUT = {"7b": (1641, 2092), "14b": (737, 1091), "32b": (344, 688)}      # (16-bit LoRA, QeRL) at batch 8


def load_step():
    """bench/step.py as a module (the worker processes are its own)."""
    spec = importlib.util.spec_from_file_location("bench_step", os.path.join(HERE, "step.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def configurations(models, batches) -> list:
    """(model, quant, batch) of every row: NVFP4 and both bf16 arms for 7B and 14B, NVFP4 alone for 32B
    (its bf16 weights alone are 62 GiB) and at batch 8 only, where the paper has a figure."""
    out = []
    for m in models:
        for b in batches:
            if m == "32b" and b != 8:
                continue
            out += [(m, q, b) for q in (("nvfp4",) if m == "32b" else ("nvfp4", "bf16", "bf16-unmerged"))]
    return out


def table(rows: list) -> str:
    """Markdown: per (model, batch) our step and rollout figures for NVFP4 and both bf16 arms, the
    ratios (bf16 / unmerged bf16 over NVFP4), the paper's."""
    by = {(r["model"], r["quant"], r["batch"]): r for r in rows if r.get("status") == "ok"}
    lines = ["| model | batch | NVFP4 step s | bf16 step s (unmerged) | step ratio (unmerged; paper) | "
             "NVFP4 rollout tok/s | bf16 rollout tok/s (unmerged) | rollout ratio (unmerged) | "
             "paper rollout tok/s (bf16 → QeRL) | NVFP4 peak GiB | bf16 peak GiB (unmerged) |",
             "|" + "---|" * 11]

    def cell(r, key, fmt):
        return format(r[key], fmt) if r and r.get(key) is not None else "–"

    def ratio(num, den, key):
        return f"{num[key] / den[key]:.2f}×" if num and den else "–"

    for model, batch in sorted({(r["model"], r["batch"]) for r in rows}, key=lambda k: (k[0], k[1])):
        q, b, m = (by.get((model, quant, batch)) for quant in ("nvfp4", "bf16", "bf16-unmerged"))
        paper = PAPER_SPEEDUP.get((model, batch))
        paper_roll = PAPER_ROLLOUT.get(model) if batch == 8 else None
        lines.append(f"| {model} | {batch} | {cell(q, 'step_s', '.2f')} | {cell(b, 'step_s', '.2f')} "
                     f"({cell(m, 'step_s', '.2f')}) | {ratio(b, q, 'step_s')} ({ratio(m, q, 'step_s')}"
                     f"{f'; {paper}×' if paper else ''}) | {cell(q, 'rollout_tok_s', '.0f')} | "
                     f"{cell(b, 'rollout_tok_s', '.0f')} ({cell(m, 'rollout_tok_s', '.0f')}) | "
                     f"{ratio(q, b, 'rollout_tok_s')} ({ratio(q, m, 'rollout_tok_s')}) | "
                     f"{f'{paper_roll[0]:,} → {paper_roll[1]:,}' if paper_roll else '–'} | "
                     f"{cell(q, 'peak_reserved_gib', '.1f')} | {cell(b, 'peak_reserved_gib', '.1f')} "
                     f"({cell(m, 'peak_reserved_gib', '.1f')}) |")
    failed = [r for r in rows if r.get("status") != "ok"]
    return "\n".join(lines + [f"{r['model']} {r['quant']} batch {r['batch']}: {r['status']}" for r in failed])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="7b,14b,32b", help="comma-separated: 7b, 14b, 32b (tiny: a smoke test)")
    ap.add_argument("--batches", default="2,4,8,32", help=f"comma-separated, of {sorted(BATCHES)}")
    ap.add_argument("--completion", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--out", default=HERE)
    args = ap.parse_args(argv)
    step = load_step()
    batches = [int(b) for b in args.batches.split(",")]
    bad = [b for b in batches if b not in BATCHES] + [m for m in args.models.split(",") if m not in step.MODELS]
    if bad:
        ap.error(f"unknown batch or model {bad}: batches {sorted(BATCHES)}, models {list(step.MODELS)}")
    path = os.path.join(args.out, "paper.json")
    rows = json.load(open(path))["rows"] if os.path.exists(path) else []
    os.makedirs(args.out, exist_ok=True)
    for model, quant, batch in configurations(args.models.split(","), batches):
        prompts, group = BATCHES[batch]
        spec = dict(model=model, quant=quant, completion=args.completion, prompts=prompts, group=group,
                    prompt_len=args.prompt_len, micro_batch=None, grad_checkpointing=None,
                    gpu_memory_utilization=0.5, warmup_tokens=None, available_gib=None,
                    force=False, device=args.device, dtype=args.dtype)
        print(f"---- {model} {quant} batch {batch} ({prompts} x {group}), {args.prompt_len} + {args.completion}",
              flush=True)
        rec = dict(step.spawn(spec), batch=batch, command=" ".join(["bench/paper.py", *(argv or sys.argv[1:])]))
        print(f"     {step.status_text(rec)}", flush=True)
        rows = [r for r in rows if (r["model"], r["quant"], r["batch"]) != (model, quant, batch)] + [rec]
        with open(path, "w") as f:       # after every row: a run cut by a time limit keeps what it measured
            json.dump({"rows": rows}, f, indent=1)
    print(table(rows))
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
