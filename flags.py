"""train.py's command line: every flag, its default and help, and the checks that run before
anything loads.

Flags are grouped as train.py's stages use them (model, data, LoRA, AQN, rollout, objective,
optimization, bookkeeping), in --kebab-case, each with its default shown by --help. parse_args
checks every value against its accepted range (FLAG_RANGES, the range stated in the message), the
rules that tie flags together, the dataset sources, local paths and the output directory, so that
a bad value is one line and exit code 2 before a model or a dataset is read.

Test: tests/test_integrity.py (every bad flag is refused at parse time, by name).
"""
import argparse
import math
import os

import torch

import grpo
import tasks
from checkpoint import random_init_config

# The accepted range of every numeric flag (an unset optional one, None, is not checked):
# name -> (the range as the error states it, the test). Floats must also be finite.
FLAG_RANGES = {
    **dict.fromkeys(("prompts_per_step", "max_new_tokens", "micro_batch", "max_steps", "lora_rank", "max_prompt_len",
                     "keep_checkpoints", "logprob_chunk", "save_every", "eval_max_new_tokens", "stop_at",
                     "max_sampling_rounds", "updates_per_rollout"), (">= 1", lambda v: v >= 1)),
    **dict.fromkeys(("eval_limit", "eval_every", "warmup_steps", "overlong_cache", "weight_decay", "beta"),
                    (">= 0", lambda v: v >= 0)),
    **dict.fromkeys(("lr", "lora_alpha", "epsilon_high", "importance_sampling_max", "importance_sampling_min"),
                    ("> 0", lambda v: v > 0)),
    **dict.fromkeys(("sigma_start", "sigma_end"), ("> 0 (the AQN schedule is geometric)", lambda v: v > 0)),
    "group_size": (">= 2: GRPO advantages compare samples of one prompt", lambda v: v >= 2),
    "aqn_stages": (">= 2: stage 0 is noise-free, the others carry the noise", lambda v: v >= 2),
    "temperature": ("> 0: training log-probs are taken under logits / temperature", lambda v: v > 0),
    "max_grad_norm": ("> 0 (clipping to <= 0 reverses or zeroes every update)", lambda v: v > 0),
    "top_p": ("in (0, 1]", lambda v: 0 < v <= 1),
    "gpu_memory_utilization": ("in (0, 1]", lambda v: 0 < v <= 1),
    "epsilon": ("in (0, 1)", lambda v: 0 < v < 1),
    "lora_dropout": ("in [0, 1)", lambda v: 0 <= v < 1),
    "seed": ("in [0, 2**63)", lambda v: 0 <= v < 2 ** 63),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="GRPO/DAPO post-training with NVFP4 weights, LoRA and AQN (QeRL)")
    # model
    p.add_argument("--model", required=True, help="Hugging Face hub id or local checkpoint directory")
    p.add_argument("--random-init", action="store_true",
                   help="random weights of --model's shape (checkpoint.SHAPES: qwen2.5-7b|14b|32b, qwen3-8b|32b; "
                        "or a dir with config.json): benchmarks")
    p.add_argument("--tokenizer", default=None, help="default: --model")
    p.add_argument("--quant", choices=["nvfp4", "bf16"], default="nvfp4")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu (torchrun: cuda:LOCAL_RANK)")
    # data
    p.add_argument("--dataset", default="gsm8k", help="gsm8k | math500 | addition | path to JSONL (file or dir)")
    p.add_argument("--eval-dataset", default=None, help="default: the test split of --dataset")
    p.add_argument("--eval-limit", type=int, default=500, help="0 = no evaluation")
    p.add_argument("--max-prompt-len", type=int, default=512, help="longer prompts are dropped (counted)")
    p.add_argument("--system-prompt", default=tasks.SYSTEM_PROMPT)
    p.add_argument("--chat-template-kwargs", type=tasks.parse_chat_template_kwargs, default=None, metavar="JSON",
                   help="""extra chat-template variables, a JSON object: '{"enable_thinking": false}' (Qwen3)""")
    # LoRA
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--lora-alpha", type=float, default=64.0)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    # AQN
    p.add_argument("--aqn", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--sigma-start", type=float, default=1e-2)
    p.add_argument("--sigma-end", type=float, default=5e-4)
    p.add_argument("--aqn-stages", type=int, default=10)
    p.add_argument("--aqn-rollout-only", action="store_true", help="noise in rollout only (the reference code)")
    # rollout
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="share of free memory for the KV cache")
    # objective
    p.add_argument("--loss-type", choices=list(grpo.LOSS_TYPES), default="dapo")
    p.add_argument("--epsilon", type=float, default=0.2)
    p.add_argument("--epsilon-high", type=float, default=None, help="default: 0.28 for dapo, else --epsilon")
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--scale-rewards", choices=list(grpo.SCALE_REWARDS), default="group")
    p.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--max-sampling-rounds", type=int, default=3)
    p.add_argument("--overlong-cache", type=int, default=0, help="DAPO overlong shaping window (0 = off)")
    p.add_argument("--mask-truncated", action="store_true", help="overlong filtering: no loss on truncated completions")
    p.add_argument("--importance-sampling", choices=list(grpo.IS_MODES), default=None,
                   help="correct for the sampler's log-probs differing from the trainer's (TRL's modes; default: none)")
    p.add_argument("--importance-sampling-max", type=float, default=3.0, help="C_max of the correction")
    p.add_argument("--importance-sampling-min", type=float, default=None, help="C_min of the correction")
    # optimization
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--updates-per-rollout", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=None,
                   help="completions per training forward (default: as many as free GPU memory holds, plan.py)")
    p.add_argument("--logprob-chunk", type=int, default=1024, help="tokens per lm_head chunk")
    p.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="recompute each layer in the backward (default: only where memory needs it, plan.py)")
    p.add_argument("--max-steps", type=int, default=200, help="the run's length (sets the AQN schedule)")
    p.add_argument("--stop-at", type=int, default=None, help="checkpoint and exit after this step (resume later)")
    # bookkeeping
    p.add_argument("--eval-every", type=int, default=0, help="0 = only at the end")
    p.add_argument("--eval-max-new-tokens", type=int, default=None, help="default: --max-new-tokens")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--keep-checkpoints", type=int, default=2)
    p.add_argument("--output-dir", default="runs/qerl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue the run in --output-dir from its latest checkpoint")
    args = p.parse_args(argv)
    # Every flag is checked here, before any model or data loads: one line and exit 2 (argparse's).
    for name, (rule, ok) in FLAG_RANGES.items():
        v = getattr(args, name)
        if v is not None and not (math.isfinite(v) and ok(v)):
            p.error(f"--{name.replace('_', '-')} must be {rule}, got {v}")
    if args.overlong_cache >= args.max_new_tokens:
        p.error(f"--overlong-cache must be < --max-new-tokens ({args.max_new_tokens}), got {args.overlong_cache}")
    if None not in (args.importance_sampling_min, args.importance_sampling_max) and \
            args.importance_sampling_min > args.importance_sampling_max:
        p.error(f"--importance-sampling-min ({args.importance_sampling_min}) must be <= --importance-sampling-max "
                f"({args.importance_sampling_max})")
    if args.importance_sampling is not None and args.top_p < 1:
        p.error("--importance-sampling needs --top-p 1: with top-p the sampler's log-probs are of a truncated "
                "distribution")
    for flag, source, split in (("--dataset", args.dataset, "train"),
                                ("--eval-dataset", args.eval_dataset or args.dataset, "test")):
        problem = tasks.source_problem(source, split) if split == "train" or args.eval_limit else None
        if problem:
            p.error(f"{flag}: {problem}" + ("" if split == "train" or args.eval_dataset else
                                            " (the default: --dataset's test split; --eval-limit 0 skips evaluation)"))
    if args.random_init:
        try:
            random_init_config(args.model)
        except ValueError as e:
            p.error(f"--model: {e}")
    for flag, path in (("--model", None if args.random_init else args.model), ("--tokenizer", args.tokenizer)):
        if path and tasks.local_path_missing(path):
            p.error(f"{flag}: {path} does not exist (and is not a Hugging Face hub id)")
    try:
        torch.device(args.device or "cpu")
    except (RuntimeError, ValueError) as e:
        p.error(f"--device: {e}")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        p.error(f"--output-dir: {args.output_dir} is a file, not a directory")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's
    if args.prompts_per_step % world:
        p.error(f"--prompts-per-step ({args.prompts_per_step}, the global count) must divide by the "
                f"number of processes ({world})")
    return args
