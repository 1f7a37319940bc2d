"""Does it learn, and does 4-bit help? The learning curves of QeRL's claim, on a real model.

QeRL's claim: the NVFP4 rounding of the frozen weights raises the policy's entropy early in RL and
helps exploration, so NVFP4 + LoRA (+ AQN) grows reward at least as fast as 16-bit LoRA. This runs
the four arms of that comparison with train.py as a user would, several seeds each:

    nvfp4+aqn   --quantizer rtn --aqn        (NVFP4 rounded to nearest, llm-compressor's codes)
    nvfp4       --quantizer rtn --no-aqn     (quantization noise alone)
    bf16+aqn    --quant bf16  --aqn
    bf16        --quant bf16  --no-aqn       (plain LoRA)
    mse+aqn     --quantizer mse --aqn        (NVFP4, each block's scale searched)
    gptq+aqn    --quantizer gptq --aqn       (qerl's default: NVFP4, GPTQ on the run's first training prompts)

Every other flag is shared (--train-args, appended to each run); a seed gives every arm the same
data order and the same adapter initialisation (train.py derives both from --seed alone). Each run
evaluates greedily on --eval-limit held-out problems every --eval-every steps (train.py's
eval/accuracy), and logs its train reward and policy entropy each step. The figure has three panels
against step: held-out accuracy, train reward, entropy; each arm's mean over seeds as a line and its
min..max as a band. Each arm's verdict: its runs' held-out accuracy at the start and at the end, and
how many did not learn (ended below their own start + LEARNED). Runs whose metrics.jsonl already covers --steps are reused, so an interrupted
sweep continues where it stopped.

    python bench/learn.py --model <SmolLM2 dir> --dataset addition --seeds 0,1,2 --steps 100 --out runs/learn
    python bench/learn.py ... --arms nvfp4+aqn,bf16                     # two arms only
    python bench/learn.py ... --jobs 4 --train-args "... --gpu-memory-utilization 0.1"   # 4 runs at once
It runs on a CPU too (slowly: SmolLM2-135M takes ~1 min a step there). Writes OUT/learn.json (the
per-step means and ranges) and OUT/learn.png. Test: tests/test_learn_bench.py (a tiny model, CPU).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ARMS = {"nvfp4+aqn": ["--quant", "nvfp4", "--quantizer", "rtn", "--aqn"],
        "nvfp4": ["--quant", "nvfp4", "--quantizer", "rtn", "--no-aqn"],
        "bf16+aqn": ["--quant", "bf16", "--aqn"], "bf16": ["--quant", "bf16", "--no-aqn"],
        "mse+aqn": ["--quant", "nvfp4", "--quantizer", "mse", "--aqn"],
        "gptq+aqn": ["--quant", "nvfp4", "--quantizer", "gptq", "--aqn"]}
LEARNED = 0.05   # a run learned if its last held-out accuracy is at least its own start + 5 points
CURVES = {"eval/accuracy": "held-out greedy accuracy", "reward": "train reward", "entropy": "policy entropy"}


def run(arm: str, seed: int, args) -> list[dict]:
    """One train.py run (reused if its metrics already reach --steps) -> its metric rows. With --jobs > 1
    its output goes to OUT/<arm>-seed<seed>.log instead of the terminal."""
    out = os.path.join(args.out, f"{arm}-seed{seed}")
    metrics = os.path.join(out, "metrics.jsonl")
    if not (os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= args.steps):
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--model", args.model, "--dataset", args.dataset,
               "--max-steps", str(args.steps), "--eval-every", str(args.eval_every), "--eval-limit",
               str(args.eval_limit), "--seed", str(seed), "--save-every", str(args.steps), "--output-dir", out,
               *(["--resume"] if os.path.exists(os.path.join(out, "run_config.json")) else []),
               *ARMS[arm], *args.train_args.split()]
        if args.jobs == 1:
            subprocess.run(cmd, check=True)
        else:
            with open(f"{out}.log", "w") as log:
                subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    with open(metrics) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def curve(rows: list[dict], key: str) -> dict[int, float]:
    """{step: value}, steps counted from 1 as metrics.jsonl counts them; eval accuracy also at 0, before
    training."""
    pts = {0: r["eval/accuracy_initial"] for r in rows if "eval/accuracy_initial" in r} if key == "eval/accuracy" else {}
    return pts | {r["step"]: r[key] for r in rows if key in r}


def summarise(runs: dict[str, list[list[dict]]]) -> dict:
    """{arm: {curve: {x: (mean, min, max)}}} over the seeds that have the point."""
    out = {}
    for arm, seeds in runs.items():
        out[arm] = {}
        for key in CURVES:
            per_seed = [curve(rows, key) for rows in seeds]
            xs = sorted(set().union(*per_seed))
            out[arm][key] = {x: (statistics.mean(v), min(v), max(v))
                             for x in xs for v in [[c[x] for c in per_seed if x in c]]}
    return out


def verdict(seeds: list[list[dict]]) -> dict:
    """One arm's runs -> their held-out accuracy at the start and at the last evaluation, and how many
    did not learn (ended below start + LEARNED)."""
    ends = [(c[min(c)], c[max(c)]) for c in (curve(rows, "eval/accuracy") for rows in seeds) if c]
    return {"start": [a for a, _ in ends], "end": [b for _, b in ends],
            "not_learned": sum(b < a + LEARNED for a, b in ends)}


def plot(summary: dict, path: str, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(CURVES), figsize=(15, 3.8))
    for ax, (key, label) in zip(axes, CURVES.items()):
        for arm, curves in summary.items():
            pts = sorted(curves[key].items())
            if not pts:
                continue
            xs = [x for x, _ in pts]
            line, = ax.plot(xs, [m for _, (m, _, _) in pts], label=arm, marker="." if len(xs) < 30 else None)
            ax.fill_between(xs, [lo for _, (_, lo, _) in pts], [hi for _, (_, _, hi) in pts],
                            color=line.get_color(), alpha=0.2)
        ax.set(title=label, xlabel="step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a local model directory or Hub id")
    ap.add_argument("--dataset", default="addition")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-limit", type=int, default=200)
    ap.add_argument("--train-args", default="--prompts-per-step 8 --group-size 8 --max-new-tokens 24 --lora-rank 16 "
                    "--lr 2e-4", help="train.py flags every run shares")
    ap.add_argument("--out", default="runs/learn")
    ap.add_argument("--jobs", type=int, default=1, help="train.py runs at once: a small model leaves most of a GPU "
                    "idle (give each run a share of memory: --train-args '... --gpu-memory-utilization 0.1')")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    bad = [a for a in arms if a not in ARMS]
    if bad:
        ap.error(f"unknown arm(s) {bad}: choose from {', '.join(ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    os.makedirs(args.out, exist_ok=True)
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    with ThreadPoolExecutor(args.jobs) as pool:
        jobs = {arm: [pool.submit(run, arm, seed, args) for seed in seeds] for arm in arms}
        runs = {arm: [j.result() for j in js] for arm, js in jobs.items()}
    summary, verdicts = summarise(runs), {arm: verdict(seeds) for arm, seeds in runs.items()}
    with open(os.path.join(args.out, "learn.json"), "w") as f:
        json.dump({"args": vars(args), "summary": {a: {k: {str(x): v for x, v in c.items()} for k, c in s.items()}
                                                   for a, s in summary.items()}, "verdicts": verdicts}, f, indent=1)
    plot(summary, os.path.join(args.out, "learn.png"),
         f"{os.path.basename(os.path.normpath(args.model))}, {args.dataset}, {len(seeds)} seeds: mean and range")
    for arm in arms:
        acc, v = summary[arm]["eval/accuracy"], verdicts[arm]
        last = max(acc) if acc else None
        print(f"{arm:10s} held-out accuracy {100 * acc[0][0]:.1f}% -> {100 * acc[last][0]:.1f}% at step {last} "
              f"(range {100 * acc[last][1]:.1f}..{100 * acc[last][2]:.1f}); {v['not_learned']} of {len(v['end'])} "
              f"runs did not learn" if acc else f"{arm:10s} no evaluation")
    print(f"wrote {os.path.join(args.out, 'learn.png')}")


if __name__ == "__main__":
    main()
