"""Head-to-head with TRL's GRPOTrainer: the same GRPO run through qerl and through TRL, on one GPU.

What a user choosing between the two would compare: time per step and what the model learned. Both
runs use the same model, task, batch, adapter, optimizer and loss:

    model      --model (a local directory: the real SmolLM2-135M-Instruct on the GPU machine)
    task       two-digit addition (tasks.arithmetic_task: the same seeded train / held-out split),
               the same chat-formatted prompt (tasks.SYSTEM_PROMPT), reward = rewards.reward
    batch      8 prompts × 8 samples a step, 24 new tokens, temperature 1
    LoRA       r 16, alpha 32, on q/k/v/o/gate/up/down, dropout 0
    optimizer  AdamW lr 2e-4, betas (0.9, 0.99), no decay, constant schedule, grad-norm clip 1
    loss       DAPO (ε 0.2 / 0.28, β = 0, rewards scaled by the group's std)

Each side runs at its defaults and at its best settings for this shape, so that a ratio is honest:

    qerl             train.py's defaults otherwise: NVFP4 base, AQN, the step plan of plan.py, dynamic
                     sampling (rounds sized from the share of groups with a reward spread, while half of
                     them lack one)
    qerl_one_round   the same with one sampling round a step (--no-dynamic-sampling)
    qerl_equal_work  bf16 base, one round a step: the work TRL does, on TRL's base
    trl              GRPOTrainer at its defaults for this batch: 8 micro-batches of 8 (gradient
                     accumulation), gradient checkpointing as it comes
    trl_best         one micro-batch of all 64 completions, gradient checkpointing off: the fastest of
                     the settings its documentation offers that fit this model (no vLLM on the machine)

Each runs in its own process; TRL on the bf16 model with transformers' generate. TRL is a
benchmark-only dependency (not in requirements.txt): install it beside (`pip install trl`; on the
GPU machine it travels as wheels). Time per step is taken over the steps after the first two (the
first compile and capture), two ways: the median, a typical step, and the mean, which also counts the
steps that pay for something once (a kernel compiled or a CUDA graph captured for a shape first seen
mid-run); a run of these 48 steps takes the mean's time. Held-out accuracy is eval.py's, greedy, on
--eval-limit addition problems, each adapter on the base it was trained with (quant_of: an arm's --quant flag, NVFP4 by
default; TRL's on bf16), and each base untrained for reference. The summary gives qerl's speed-up
over TRL's best arm, and over its defaults beside it, by the median and by the mean.

    python bench/peer.py --model /root/smol --steps 50 --out /tmp/peer     # table on stdout, peer.json
    python bench/peer.py --model /root/smol --only ours --seeds 1,2 --train-args "--max-sampling-rounds 3"
    python bench/peer.py --model /root/smol --only trl                      # both TRL arms
    python bench/peer.py --model /root/smol --only ours --arms qerl         # one qerl arm
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

PROMPTS, GROUP, NEW, RANK, ALPHA, LR = 8, 8, 24, 16, 32, 2e-4
OURS = {"qerl": [], "qerl_one_round": ["--no-dynamic-sampling"],
        "qerl_equal_work": ["--quant", "bf16", "--no-dynamic-sampling"]}      # arm -> train.py flags
TRL = {"trl": dict(per_device_train_batch_size=GROUP, gradient_accumulation_steps=PROMPTS),
       "trl_best": dict(per_device_train_batch_size=PROMPTS * GROUP, gradient_accumulation_steps=1,
                        gradient_checkpointing=False)}                         # arm -> GRPOConfig settings


def quant_of(flags: list[str]) -> str:
    """The base a qerl arm trains on: the value after its last --quant, else train.py's default."""
    return next((flags[i + 1] for i in range(len(flags) - 2, -1, -1) if flags[i] == "--quant"), "nvfp4")


def ours_command(model: str, steps: int, out: str, extra: list[str]) -> list[str]:
    """A qerl arm's command line: train.py as a user types it, plus extra flags."""
    return [sys.executable, os.path.join(ROOT, "train.py"), "--model", model, "--dataset", "addition",
            "--prompts-per-step", str(PROMPTS), "--group-size", str(GROUP), "--max-new-tokens", str(NEW),
            "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--lr", str(LR), "--loss-type", "dapo",
            "--max-steps", str(steps), "--save-every", str(steps), "--eval-limit", "0", "--output-dir", out, *extra]


def run_ours(model: str, steps: int, out: str, extra: list[str]) -> dict:
    """A qerl arm (ours_command); its metrics.jsonl gives the step times, split into rollout and
    training (time/rollout, time/train), so that a slow step says which half it was."""
    t0 = time.perf_counter()
    subprocess.run(ours_command(model, steps, out, extra), check=True)
    wall = time.perf_counter() - t0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(ln) for ln in f if ln.strip()]
    return dict(step_s=[r["step_time"] for r in rows], rollout_s=[r.get("time/rollout") for r in rows],
                train_s=[r.get("time/train") for r in rows], wall_s=wall, adapter=os.path.join(out, f"checkpoint-{steps:06d}"),
                reward=[r.get("reward") for r in rows], rounds=[r.get("sampling/rounds") for r in rows],
                prompts=[r.get("sampling/prompts") for r in rows], flags=extra, quant=quant_of(extra))


def run_trl(model: str, steps: int, out: str, settings: dict) -> dict:
    """GRPOTrainer on the bf16 model with the settings of the module docstring and an arm's (this process)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import rewards
    import tasks
    gpu = torch.cuda.is_available()                            # the CPU only for a smoke test
    train = tasks.arithmetic_task("addition", "train", seed=0)
    data = Dataset.from_list([{"prompt": [{"role": "system", "content": tasks.SYSTEM_PROMPT},
                                          {"role": "user", "content": e.question}], "answer": e.answer} for e in train])

    def correctness(completions, answer, **kw):
        return [rewards.reward(tasks.Example("", a, "numeric"), c[-1]["content"]) for c, a in zip(completions, answer)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.t = [], None

        def on_step_begin(self, args, state, control, **kw):
            if gpu:
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if gpu:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t)

    cfg = GRPOConfig(output_dir=out, max_steps=steps, **settings, num_generations=GROUP, max_completion_length=NEW, temperature=1.0, learning_rate=LR,
                     lr_scheduler_type="constant", adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0,
                     loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0, scale_rewards="group",
                     bf16=gpu, use_cpu=not gpu, model_init_kwargs={"dtype": torch.bfloat16 if gpu else torch.float32},
                     logging_steps=1, report_to="none",
                     save_strategy="no", seed=0)
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=correctness, args=cfg, train_dataset=data, peft_config=lora,
                          callbacks=[clock])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    adapter = os.path.join(out, "adapter")
    trainer.save_model(adapter)
    reward = [h.get("reward") for h in trainer.state.log_history if "reward" in h]
    return dict(step_s=clock.times, wall_s=wall, adapter=adapter, reward=reward, quant="bf16")


def evaluate(model: str, adapter: str | None, quant: str, limit: int) -> float:
    """Held-out greedy accuracy through eval.py (its last JSON line)."""
    cmd = [sys.executable, os.path.join(ROOT, "eval.py"), "--model", model, "--dataset", "addition", "--limit", str(limit),
           "--quant", quant, "--max-new-tokens", str(NEW), "--max-model-len", "512"]
    out = subprocess.run(cmd + (["--adapter", adapter] if adapter else []), check=True, capture_output=True, text=True)
    metrics = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith('{"accuracy"')]
    return metrics[-1]["accuracy"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a local model directory (SmolLM2-135M-Instruct)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--eval-limit", type=int, default=200)
    ap.add_argument("--only", choices=["ours", "trl"], default=None, help="run one side (its JSON merges into --out)")
    ap.add_argument("--seeds", default="0", help="comma-separated --seed values for qerl's arms (TRL runs seed 0); "
                                                "arms of seed s > 0 are named with the suffix _s<s>")
    ap.add_argument("--arms", default=",".join(OURS), help=f"comma-separated qerl arms to run, of {', '.join(OURS)}")
    ap.add_argument("--train-args", default="",
                    help="more train.py flags for qerl's arms, e.g. \"--max-sampling-rounds 3\"")
    ap.add_argument("--out", default="/tmp/peer")
    ap.add_argument("--worker", help=argparse.SUPPRESS)          # a TRL arm's name: run it in this process
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    if not set(arms) <= set(OURS):
        ap.error(f"--arms: unknown {sorted(set(arms) - set(OURS))}; the qerl arms are {', '.join(OURS)}")
    os.makedirs(args.out, exist_ok=True)
    if args.worker in TRL:
        res = run_trl(args.model, args.steps, os.path.join(args.out, args.worker), TRL[args.worker])
        json.dump(res, open(os.path.join(args.out, f"{args.worker}.json"), "w"))
        return
    path = os.path.join(args.out, "peer.json")
    res = json.load(open(path)) if os.path.exists(path) else {}
    for seed in (int(s) for s in args.seeds.split(",")) if args.only in (None, "ours") else ():
        suffix = f"_s{seed}" if seed else ""
        for arm in arms:
            extra = ["--seed", str(seed), *args.train_args.split(), *OURS[arm]]
            res[arm + suffix] = run_ours(args.model, args.steps, os.path.join(args.out, arm + suffix), extra)
    for arm in TRL if args.only in (None, "trl") else ():
        subprocess.run([sys.executable, os.path.abspath(__file__), "--model", args.model, "--steps", str(args.steps),
                        "--out", args.out, "--worker", arm], check=True)
        res[arm] = json.load(open(os.path.join(args.out, f"{arm}.json")))
    for name, r in res.items():
        if "accuracy" not in r:
            r["accuracy"] = evaluate(args.model, r["adapter"], r["quant"], args.eval_limit)
            r["accuracy_untrained"] = evaluate(args.model, None, r["quant"], args.eval_limit)
        timed = r["step_s"][2:] or r["step_s"]
        r["median_step_s"], r["mean_step_s"] = statistics.median(timed), statistics.mean(timed)
    json.dump(res, open(path, "w"), indent=1)
    print(summary(res))


def summary(res: dict) -> str:
    """The table, and each qerl arm's speed-up a step over TRL's best arm (and its defaults beside it),
    by the median step and by the mean one."""
    lines = [f"{'':17} {'base':5} {'steps':>5} {'median s/step':>13} {'mean s/step':>11} {'wall s':>7} "
             f"{'held-out acc (untrained)':>25}"]
    for name, r in res.items():
        lines.append(f"{name:17} {r['quant']:5} {len(r['step_s']):5d} {r['median_step_s']:13.3f} {r['mean_step_s']:11.3f} "
                     f"{r['wall_s']:7.1f} {100 * r['accuracy']:14.1f}% ({100 * r['accuracy_untrained']:.1f}%)")
    for name in [n for n in res if n.startswith("qerl")]:
        ratios = [f"{res[t]['median_step_s'] / res[name]['median_step_s']:.2f}x (median), "
                  f"{res[t]['mean_step_s'] / res[name]['mean_step_s']:.2f}x (mean) faster a step than {t}"
                  for t in ("trl_best", "trl") if t in res]
        if ratios:
            lines.append(f"{name}: " + "; ".join(ratios))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
