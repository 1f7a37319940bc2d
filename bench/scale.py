"""Data-parallel scaling as users run it: train.py under torchrun on 1, 2, 4 ... GPUs, and where each
rank's time goes.

    python bench/scale.py --gpus 1,2,4 --tokenizer <any tokenizer dir> --out DIR

For each N this runs, as a user types it (the --dry-run flag prints these commands and stops):

    torchrun --standalone --nproc-per-node N train.py --model qwen2.5-7b --random-init --tokenizer T
        --dataset addition --prompts-per-step 16 --group-size 8 --max-new-tokens 1024 --dynamic-sampling
        --dynamic-sampling-threshold 0 --reward tests/reward_examples.py:spread_on_even_answers
        --max-steps 6 --eval-limit 0 --save-every 6 --output-dir DIR/gpus-N

the 7B step of the README (16 prompts x 8, 1024 new tokens) on random Qwen2.5-7B weights, with dynamic
sampling refilling every step (DAPO's rule). A random model never solves addition, so the reward is the
tests' spread_on_even_answers: the groups of even answers get a spread, the others none, so each step
keeps about half of a round and refills, in rounds whose prompts do not divide evenly over the ranks
(a rank may draw none). --prompts-per-step is the global batch, so N GPUs share the same work.

From each run's metrics.jsonl, the medians over the steps after --skip (Triton compiles and the first
graph captures): step time, rollout and training time, generated tokens a second (sampling/prompts x
group x mean completion length / step time) and its speed-up over the smallest N; per rank (train.py's
time/rank<r>/*, distributed.rank_times): its rollout and training time and the seconds it waited in
collectives (gathers of sampling rounds and metrics, the gradient all_reduce, the checkpoint barrier),
so the time lost to stragglers and to ranks without prompts is the waits' share of the step.

Prints one table, writes DIR/scale.json (the commands, the per-step rows, the summaries). Each N needs N
GPUs with a 7B model each (~7 GiB of weights and adapters, the KV cache and training pass on top).
--model and --train-args change the workload (e.g. a small model for a CPU smoke run: --device cpu).

Test: tests/test_scale_bench.py (the commands, the summary of made-up metrics).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD = os.path.join(ROOT, "tests", "reward_examples.py") + ":spread_on_even_answers"


def command(n: int, args, out: str) -> list[str]:
    """The torchrun command line of the run on n GPUs."""
    model = ["--model", args.model, "--random-init", "--tokenizer", args.tokenizer] if args.random_init else \
        ["--model", args.model] + (["--tokenizer", args.tokenizer] if args.tokenizer else [])
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
            os.path.join(ROOT, "train.py"), *model, "--dataset", "addition", "--prompts-per-step", str(args.prompts),
            "--group-size", str(args.group), "--max-new-tokens", str(args.new_tokens), "--dynamic-sampling",
            "--dynamic-sampling-threshold", "0", "--reward", REWARD, "--max-steps", str(args.steps),
            "--eval-limit", "0", "--save-every", str(args.steps), "--output-dir", out, *args.train_args.split()]


def summary(n: int, rows: list[dict], group: int, skip: int) -> dict:
    """Medians over the steps after `skip` of a run on n GPUs (its metrics.jsonl rows); per rank, each
    rank's rollout, training and waiting seconds (rank 0's own times in a single process)."""
    timed = [r for r in rows if r["step"] >= skip] or rows
    med = lambda key: statistics.median(r.get(key, 0.0) for r in timed)  # noqa: E731
    tokens = [r["sampling/prompts"] * group * r["completions/mean_length"] / r["step_time"] for r in timed]
    ranks = [{k: med(f"time/rank{i}/{k}") if n > 1 else med(f"time/{k}") * (k != "wait")
              for k in ("rollout", "train", "wait")} for i in range(n)]
    return dict(gpus=n, steps=len(timed), step_s=med("step_time"), rollout_s=med("time/rollout"),
                train_s=med("time/train"), tokens_per_s=statistics.median(tokens), wait_s=med("time/wait"),
                rounds=med("sampling/rounds"), prompts=med("sampling/prompts"), ranks=ranks)


def print_table(summaries: list[dict]) -> None:
    """One row per GPU count; speed-up and efficiency are against the first row's tokens a second."""
    base = summaries[0]
    print("| GPUs | step s | rollout s | train s | new tok/s | speed-up | efficiency | mean wait s | rounds | "
          "per rank: rollout / train / wait s |\n|---|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        ranks = "; ".join(f"{r['rollout']:.2f} / {r['train']:.2f} / {r['wait']:.2f}" for r in s["ranks"])
        speedup = s["tokens_per_s"] / base["tokens_per_s"]
        print(f"| {s['gpus']} | {s['step_s']:.2f} | {s['rollout_s']:.2f} | {s['train_s']:.2f} | "
              f"{s['tokens_per_s']:.0f} | {speedup:.2f}x | {speedup * base['gpus'] / s['gpus']:.0%} | "
              f"{s['wait_s']:.2f} | {s['rounds']:g} | {ranks} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", default="1,2,4", help="comma-separated process counts")
    ap.add_argument("--model", default="qwen2.5-7b", help="a checkpoint.SHAPES name (random init) or a model dir")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory (required with a random-init shape)")
    ap.add_argument("--prompts", type=int, default=16, help="--prompts-per-step (global)")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the medians")
    ap.add_argument("--train-args", default="", help="more train.py flags, one string")
    ap.add_argument("--out", default="runs/scale")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    args = ap.parse_args(argv)
    args.random_init = not os.path.isdir(args.model)
    if args.random_init and not args.tokenizer:
        ap.error("--tokenizer: a random-init --model needs a tokenizer directory")
    gpus = [int(g) for g in args.gpus.split(",")]
    outs = {n: os.path.join(args.out, f"gpus-{n}") for n in gpus}
    runs = {n: command(n, args, out) for n, out in outs.items()}
    if args.dry_run:
        print("\n".join(" ".join(cmd) for cmd in runs.values()))
        return runs
    taken = [out for out in outs.values() if os.path.exists(os.path.join(out, "run_config.json"))]
    if taken:
        ap.error(f"{taken[0]} holds a run already: choose another --out")
    results = []
    for n, cmd in runs.items():
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        with open(os.path.join(outs[n], "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        results.append(dict(command=" ".join(cmd), rows=rows, summary=summary(n, rows, args.group, args.skip)))
    print_table([r["summary"] for r in results])
    with open(os.path.join(args.out, "scale.json"), "w") as f:
        json.dump({"runs": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
