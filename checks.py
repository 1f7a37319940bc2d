"""What each of train.py's settings must be, checked before anything loads: the range of every
number (FLAG_RANGES, the range stated in the message), the rules that tie flags together, the dataset
sources and columns, the reward functions (loaded here: their modules imported in their workers), the
model and tokenizer directories, the device, the reporting packages and the output directory. A bad
value is one line through the parser's error (exit code 2; flags.config raises ConfigError) before a
model or a dataset is read.

flags.py calls check() on the settings it has gathered; range_problem also checks a resumed run's record.
Test: tests/test_flags.py, tests/test_integrity.py (every bad flag is refused at parse time, by name).
"""
import importlib.util
import math
import os

import torch

import data
import reward_funcs
import tasks
from checkpoint import random_init_config

# The accepted range of every numeric flag (an unset optional one, None, is not checked):
# name -> (the range as the error states it, the test). Floats must also be finite.
FLAG_RANGES = {
    **dict.fromkeys(("prompts_per_step", "max_new_tokens", "micro_batch", "max_steps", "lora_rank", "max_prompt_len",
                     "keep_checkpoints", "logprob_chunk", "save_every", "eval_max_new_tokens", "stop_at",
                     "max_sampling_rounds", "updates_per_rollout", "aqn_steps"), (">= 1", lambda v: v >= 1)),
    **dict.fromkeys(("eval_limit", "eval_every", "warmup_steps", "overlong_cache", "weight_decay", "beta",
                     "log_every", "log_completions", "format_weight", "stall_timeout"), (">= 0", lambda v: v >= 0)),
    **dict.fromkeys(("lr", "lora_alpha", "epsilon_high", "importance_sampling_max", "importance_sampling_min",
                     "reward_timeout"), ("> 0", lambda v: v > 0)),
    **dict.fromkeys(("sigma_start", "sigma_end"), ("> 0 (the AQN schedule is geometric)", lambda v: v > 0)),
    "group_size": (">= 2: GRPO advantages compare samples of one prompt", lambda v: v >= 2),
    "aqn_stages": (">= 2: stage 0 is noise-free, the others carry the noise", lambda v: v >= 2),
    "temperature": ("> 0: training log-probs are taken under logits / temperature", lambda v: v > 0),
    "max_grad_norm": ("> 0 (clipping to <= 0 reverses or zeroes every update)", lambda v: v > 0),
    "top_p": ("in (0, 1]", lambda v: 0 < v <= 1),
    "gpu_memory_utilization": ("in (0, 1]", lambda v: 0 < v <= 1),
    "epsilon": ("in (0, 1)", lambda v: 0 < v < 1),
    "lora_dropout": ("in [0, 1)", lambda v: 0 <= v < 1),
    "dynamic_sampling_threshold": ("in [0, 1]", lambda v: 0 <= v <= 1),
    "seed": ("in [0, 2**63)", lambda v: 0 <= v < 2 ** 63),
}

# --report-to -> the package it needs (imported only when chosen).
REPORTERS = {"none": None, "tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def range_problem(name: str, value) -> str | None:
    """Why a numeric flag's value is out of FLAG_RANGES ('must be > 0, got -1'), else None (None is unset)."""
    rule, ok = FLAG_RANGES.get(name, (None, None))
    if rule is None or value is None or (math.isfinite(value) and ok(value)):
        return None
    return f"must be {rule}, got {value}"


# ----------------------------------------------------------------------------------------------


def check(p, args) -> None:
    """Every check that needs no model and no data read: p.error (one line, exit 2) on the first failure."""
    if not args.model:
        p.error("--model is required (or --resume RUN_DIR of a run, or a --config file that names it)")
    for name in FLAG_RANGES:
        problem = range_problem(name, getattr(args, name))
        if problem:
            p.error(f"--{name.replace('_', '-')} {problem}")
    if args.overlong_cache >= args.max_new_tokens:
        p.error(f"--overlong-cache must be < --max-new-tokens ({args.max_new_tokens}), got {args.overlong_cache}")
    if None not in (args.importance_sampling_min, args.importance_sampling_max) and \
            args.importance_sampling_min > args.importance_sampling_max:
        p.error(f"--importance-sampling-min ({args.importance_sampling_min}) must be <= --importance-sampling-max "
                f"({args.importance_sampling_max})")
    if args.importance_sampling is not None and args.top_p < 1:
        p.error("--importance-sampling needs --top-p 1: with top-p the sampler's log-probs are of a truncated "
                "distribution")
    if args.stop_at is not None and args.stop_at > args.max_steps:
        p.error(f"--stop-at {args.stop_at} is past --max-steps {args.max_steps}, where the run ends")
    check_data(p, args)
    check_rewards(p, args)
    check_model(p, args)
    check_run(p, args)


def check_model(p, args) -> None:
    """--model and --tokenizer name something that loads (a local directory's config.json and tokenizer
    files are read; a Hub id is checked when it is fetched), and --device is there."""
    if args.random_init:
        try:
            random_init_config(args.model)
        except ValueError as e:
            p.error(f"--model: {e}")
    else:
        problem = tasks.model_problem(args.model)
        if problem:
            p.error(f"--model: {problem}")
    if args.quant != "nvfp4" and args.quantizer != "rtn":
        p.error(f"--quantizer {args.quantizer} chooses NVFP4 codes, and --quant {args.quant} has none: drop it, "
                f"or pass --quant nvfp4")
    if args.tokenizer and tasks.local_path_missing(args.tokenizer):
        p.error(f"--tokenizer: {args.tokenizer} does not exist (and is not a Hugging Face hub id)")
    # a --random-init shape directory holds a config.json alone: bench/step.py builds its policy without a
    # tokenizer, and train.py refuses one that does not load before the model is built
    problem = tasks.tokenizer_problem(args.tokenizer or args.model) if args.tokenizer or not args.random_init else None
    if problem:
        p.error(f"--{'tokenizer' if args.tokenizer else 'model'}: {problem}")
    try:
        device = torch.device(args.device or "cpu")
    except (RuntimeError, ValueError) as e:
        p.error(f"--device: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device is visible here (torch.cuda.is_available() is False); "
                f"--device cpu runs on the CPU")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        p.error(f"--device {args.device}: there are {torch.cuda.device_count()} CUDA device(s)")


def check_run(p, args) -> None:
    """The reporting packages are installed, the output directory can be one, the batch divides by the
    processes."""
    for name in args.report_to.split(","):
        package = REPORTERS[name]
        if package and importlib.util.find_spec(package) is None:
            p.error(f"--report-to {name} needs the {package} package: pip install {package}")
    if not args.output_dir:
        p.error("--output-dir is empty: name the run directory")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        p.error(f"--output-dir: {args.output_dir} is a file, not a directory")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's
    if args.prompts_per_step % world:
        p.error(f"--prompts-per-step ({args.prompts_per_step}, the global count) must divide by the "
                f"number of processes ({world})")


def eval_source(args) -> tuple[str, str | None]:
    """(evaluation dataset, its Hub config): --eval-dataset's, else --dataset's."""
    if args.eval_dataset:
        return args.eval_dataset, args.eval_dataset_config
    return args.dataset, args.eval_dataset_config or args.dataset_config


def check_data(p, args) -> None:
    columns = tasks.Columns(args.prompt_column, args.answer_column)
    eval_set, eval_config = eval_source(args)
    checks = [("--dataset", args.dataset, args.dataset_split, args.dataset_config)]
    if args.eval_limit:
        checks.append(("--eval-dataset", eval_set, args.eval_split, eval_config))
    for flag, source, split, config in checks:
        if isinstance(source, str) and source.startswith(data.IN_MEMORY):   # a resumed run's rows in memory
            p.error(f"{flag}: the run trained on rows in memory ({source}): resume it from Python, handing "
                    f"flags.config the same rows")
        problem = tasks.source_problem(source, split, config, columns)
        if problem:
            p.error(f"{flag}: {problem}" + ("" if flag == "--dataset" or args.eval_dataset else
                                            " (the default: --dataset's --eval-split; --eval-limit 0 skips evaluation)"))


def check_rewards(p, args) -> None:
    weights = args.reward_weights
    if weights is not None and len(weights) != len(args.reward):
        p.error(f"--reward-weights has {len(weights)} weight(s) for {len(args.reward)} reward(s) ({args.reward})")
    funcs = []
    for spec in args.reward:
        try:
            funcs.append(reward_funcs.load(spec, timeout_s=args.reward_timeout))
        except ValueError as e:
            p.error(f"--reward: {e}")
    names = [f.name for f in funcs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        p.error(f"--reward: two terms are named {twice[0]!r}; the metrics need distinct names")
