"""train.py's command line: every flag with its help and default, a config file, --resume, and the
checks that run before anything loads.

Three sources, in rising precedence: the defaults, a --config file (JSON, or YAML with PyYAML; its
keys are the flag names, with dashes or underscores; a key that is no flag is refused by name), and the
command line. --resume RUN_DIR (or --resume with --output-dir) reads the run's run_config.json: every
setting comes from there, so `python train.py --resume runs/x` continues the run with no other flag. A
flag given again (on the command line or in a --config file) must equal the recorded value, or the run
is refused naming each flag that differs: a resumed run is the same run. Only the flags of RESUMABLE
may change, as they change where and how fast the run goes and what it reports, never what it
computes.

Then parse_args checks every value against its accepted range (FLAG_RANGES, the range stated in the
message), the rules that tie flags together, the dataset sources and columns, the reward functions
(imported here), local paths, the reporting packages and the output directory, so that a bad value is
one line and exit code 2 before a model or a dataset is read.

Test: tests/test_flags.py (help, --config, --resume); tests/test_integrity.py (every bad flag is
refused at parse time, by name).
"""
import argparse
import difflib
import importlib.util
import json
import math
import os

import torch

import grpo
import reward_funcs
import tasks
from checkpoint import random_init_config
from run_dir import RUN_CONFIG

# The accepted range of every numeric flag (an unset optional one, None, is not checked):
# name -> (the range as the error states it, the test). Floats must also be finite.
FLAG_RANGES = {
    **dict.fromkeys(("prompts_per_step", "max_new_tokens", "micro_batch", "max_steps", "lora_rank", "max_prompt_len",
                     "keep_checkpoints", "logprob_chunk", "save_every", "eval_max_new_tokens", "stop_at",
                     "max_sampling_rounds", "updates_per_rollout"), (">= 1", lambda v: v >= 1)),
    **dict.fromkeys(("eval_limit", "eval_every", "warmup_steps", "overlong_cache", "weight_decay", "beta",
                     "log_every", "log_completions", "format_weight"), (">= 0", lambda v: v >= 0)),
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

# Flags a resumed run may change: where it runs, its speed and memory, when it stops, saves and
# evaluates, and what it reports. Every other flag must equal the run's recorded value.
RESUMABLE = {"resume", "config", "output_dir", "device", "stop_at", "save_every", "keep_checkpoints", "eval_every",
             "micro_batch", "grad_checkpointing", "gpu_memory_utilization", "logprob_chunk", "log_every",
             "log_completions", "report_to", "reward_timeout"}

# Flags of one invocation only: a resumed run does not take them from the run's record.
PER_INVOCATION = {"resume", "config", "stop_at"}
REPEATABLE = {"reward"}   # the Append flags: a list in a --config file is their values

# --report-to -> the package it needs (imported only when chosen).
REPORTERS = {"none": None, "tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


# ----------------------------------------------------------------------------------------------
# the parser


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each default, except None, whose meaning every such flag's help states in words."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


class Append(argparse.Action):
    """A repeatable flag: the first use replaces the default list, each further one adds a value (never
    argparse's append, which adds to the default list itself)."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, (current if isinstance(current, list) and current is not self.default
                                       else []) + [values])


def add_precision_flags(g) -> None:
    """--quant and --dtype: how the base weights are stored and what the activations are (train.py, eval.py)."""
    g.add_argument("--quant", choices=["nvfp4", "bf16"], default="nvfp4", help="base weights: 4-bit NVFP4 or bf16")
    g.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="activations and adapters")


def add_column_flags(g) -> None:
    """--prompt-column and --answer-column: which dataset columns hold the prompt and the gold answer."""
    g.add_argument("--prompt-column", default=None,
                   help=f"column holding the prompt, a string or a list of messages (default: the first of "
                        f"{', '.join(tasks.PROMPT_COLUMNS)})")
    g.add_argument("--answer-column", default=None, help="column holding the gold answer (default: answer, if present)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="GRPO/DAPO post-training with NVFP4 weights, LoRA and AQN (QeRL)",
                                usage="%(prog)s --model MODEL [--dataset DATASET] [flags] (--help lists them)",
                                formatter_class=HelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="JSON or YAML file of flags (keys: flag names); the command line overrides it (default: none)")
    g.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN_DIR",
                   help="continue RUN_DIR (or --output-dir) from its newest checkpoint, with its recorded flags")
    g.add_argument("--output-dir", default="runs/qerl", help="the run directory (run_dir.py)")
    g.add_argument("--seed", type=int, default=0, help="seeds data order, adapter init, AQN noise and sampling")
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="Hugging Face hub id or local checkpoint directory (required)")
    g.add_argument("--random-init", action="store_true",
                   help="random weights of --model's shape (checkpoint.SHAPES: qwen2.5-7b|14b|32b, qwen3-8b|32b; "
                        "or a dir with config.json): benchmarks")
    g.add_argument("--tokenizer", default=None, help="tokenizer hub id or directory (default: --model)")
    add_precision_flags(g)
    g.add_argument("--device", default=None, help="default: cuda if available, else cpu (torchrun: cuda:LOCAL_RANK)")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default="gsm8k",
                   help="gsm8k | math500 | addition | multiplication | a Hub dataset id | a .jsonl/.csv/.parquet file | a directory "
                        "(<split>.<ext> files or a datasets.save_to_disk directory)")
    g.add_argument("--dataset-config", default=None, help="the Hub dataset's configuration, e.g. main for openai/gsm8k (default: its only or default one)")
    g.add_argument("--dataset-split", default="train", help="the training split")
    g.add_argument("--eval-dataset", default=None, help="evaluation dataset, as --dataset (default: --dataset)")
    g.add_argument("--eval-dataset-config", default=None,
                   help="its Hub configuration (default: --dataset-config when --eval-dataset is not given)")
    g.add_argument("--eval-split", default="test", help="the evaluation split")
    add_column_flags(g)
    g.add_argument("--eval-limit", type=int, default=500, help="evaluation questions (0 = no evaluation)")
    g.add_argument("--max-prompt-len", type=int, default=512, help="longer prompts are dropped (counted)")
    g.add_argument("--system-prompt", default=tasks.SYSTEM_PROMPT,
                   help="put before every prompt without a system message of its own ('' for none)")
    g.add_argument("--chat-template-kwargs", type=tasks.parse_chat_template_kwargs, default=None, metavar="JSON",
                   help="""extra chat-template variables, a JSON object: '{"enable_thinking": false}' (Qwen3); """
                        "default: none")
    g = p.add_argument_group("reward")
    g.add_argument("--reward", action=Append, default=[reward_funcs.BUILTIN], metavar="NAME|MODULE:FN",
                   help="a reward term, repeatable: 'correctness' (the gold answer's guarded check) or "
                        "module:function called as TRL's reward_funcs (reward_funcs.py)")
    g.add_argument("--reward-weights", type=reward_funcs.parse_weights, default=None, metavar="W1,W2,...",
                   help="one weight per --reward (default: 1 each)")
    g.add_argument("--format-weight", type=float, default=0.0,
                   help="added to correctness for a complete \\boxed{} answer")
    g.add_argument("--reward-timeout", type=float, default=reward_funcs.TIMEOUT_S,
                   help="seconds a user reward function may take on one batch before the run stops")
    g = p.add_argument_group("LoRA")
    g.add_argument("--lora-rank", type=int, default=32, help="adapter rank r")
    g.add_argument("--lora-alpha", type=float, default=64.0, help="adapter scale α (the update is α/r · BA)")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapter's input")
    g = p.add_argument_group("AQN (adaptive quantization noise)")
    g.add_argument("--aqn", action=argparse.BooleanOptionalAction, default=True, help="noise on the RMSNorm weights")
    g.add_argument("--sigma-start", type=float, default=1e-2, help="σ of the first noisy stage")
    g.add_argument("--sigma-end", type=float, default=5e-4, help="σ of the last stage")
    g.add_argument("--aqn-stages", type=int, default=10, help="stages K over --max-steps (stage 0 is noise-free)")
    g.add_argument("--aqn-rollout-only", action="store_true", help="noise in rollout only (the reference code)")
    g = p.add_argument_group("rollout")
    g.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    g.add_argument("--prompts-per-step", type=int, default=16, help="prompts per optimizer step (all ranks)")
    g.add_argument("--max-new-tokens", type=int, default=1024, help="completion length limit")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="share of free memory for the KV cache")
    g = p.add_argument_group("objective")
    g.add_argument("--loss-type", choices=list(grpo.LOSS_TYPES), default="dapo", help="token aggregation (grpo.py)")
    g.add_argument("--epsilon", type=float, default=0.2, help="clip range ε (low side)")
    g.add_argument("--epsilon-high", type=float, default=None, help="clip ε high side (default: 0.28 for dapo, else --epsilon)")
    g.add_argument("--beta", type=float, default=0.0, help="KL coefficient to the adapter-disabled model")
    g.add_argument("--scale-rewards", choices=list(grpo.SCALE_REWARDS), default="group", help="advantage scaling")
    g.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=True,
                   help="drop groups whose rewards are all equal (they carry no gradient) and sample more prompts, "
                        "within --max-sampling-rounds rounds and as many batches of prompts a step (DAPO); it pays "
                        "where the base model rarely solves the task (docs/usage.md)")
    g.add_argument("--dynamic-sampling-threshold", type=float, default=0.5,
                   help="refill a step only when at least this share of its first round's groups has no reward "
                        "spread (0: every step, DAPO's rule)")
    g.add_argument("--max-sampling-rounds", type=int, default=10,
                   help="dynamic sampling's budget a step: at most this many rounds, and this many times "
                        "--prompts-per-step prompts (verl's DAPO gives up after 10 generation batches)")
    g.add_argument("--overlong-cache", type=int, default=0, help="DAPO overlong shaping window (0 = off)")
    g.add_argument("--mask-truncated", action="store_true", help="overlong filtering: no loss on truncated completions")
    g.add_argument("--importance-sampling", choices=list(grpo.IS_MODES), default=None,
                   help="correct for the sampler's log-probs differing from the trainer's (TRL's modes; default: none)")
    g.add_argument("--importance-sampling-max", type=float, default=3.0, help="C_max of the correction")
    g.add_argument("--importance-sampling-min", type=float, default=None, help="C_min of the correction (default: none)")
    g = p.add_argument_group("optimization")
    g.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    g.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm")
    g.add_argument("--updates-per-rollout", type=int, default=1, help="optimizer steps per generation batch (μ)")
    g.add_argument("--micro-batch", type=int, default=None,
                   help="completions per training forward (default: as many as free GPU memory holds, plan.py)")
    g.add_argument("--logprob-chunk", type=int, default=1024, help="tokens per lm_head chunk")
    g.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="recompute each layer in the backward (default: only where memory needs it, plan.py)")
    g.add_argument("--max-steps", type=int, default=200, help="the run's length (sets the AQN schedule)")
    g.add_argument("--stop-at", type=int, default=None, help="checkpoint and exit after this step (default: --max-steps)")
    g = p.add_argument_group("evaluation, checkpoints and records")
    g.add_argument("--eval-every", type=int, default=0, help="steps between evaluations (0 = only at the end)")
    g.add_argument("--eval-max-new-tokens", type=int, default=None, help="default: --max-new-tokens")
    g.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="checkpoints kept (oldest removed)")
    g.add_argument("--log-every", type=int, default=10, help="steps between progress lines (0 = the bar only)")
    g.add_argument("--log-completions", type=int, default=4,
                   help="completions of each step written to completions.jsonl (prompt, completion, reward)")
    g.add_argument("--report-to", choices=list(REPORTERS), default="none", help="also send the metrics there")
    return p


# ----------------------------------------------------------------------------------------------
# the sources: command line, --config file, the resumed run


def given_flags(parser, argv) -> dict:
    """{dest: value} of the flags present in argv only (argparse fills in a default only where the
    namespace has no such attribute, so a namespace of markers shows which were given)."""
    unset = object()
    ns = argparse.Namespace(**{k: unset for k in vars(parser.parse_args([]))})
    parser.parse_args(argv, ns)
    return {k: v for k, v in vars(ns).items() if v is not unset}


def read_config(p, path: str, defaults: dict) -> dict:
    """{dest: value} of a --config file, each value parsed as its flag's command-line value would be
    (so it meets the same types and choices); p.error naming the file and key on anything else.
    A list is a repeatable flag's values (--reward) or comma-separated ones (--reward-weights)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".json", ".yaml", ".yml"):
        p.error(f"--config {path}: want a .json, .yaml or .yml file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        p.error(f"--config {path}: {getattr(e, 'strerror', None) or e}")
    if ext == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            p.error(f"--config {path}: not valid JSON ({e})")
    else:
        try:
            import yaml
        except ImportError:
            p.error(f"--config {path}: reading YAML needs PyYAML (pip install pyyaml), or write the file as JSON")
        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as e:
            p.error(f"--config {path}: not valid YAML ({' '.join(str(e).split())})")
    if not isinstance(values, dict):
        p.error(f"--config {path}: want a mapping of flag names to values, got {type(values).__name__}")
    tokens, direct = [], {}
    for key, value in values.items():
        dest = str(key).replace("-", "_")
        if dest not in defaults or dest == "config":
            close = difflib.get_close_matches(dest, [d for d in defaults if d != "config"], n=1)
            p.error(f"--config {path}: unknown key {key!r} (not a train.py flag)"
                    + (f"; did you mean {close[0]!r}?" if close else ""))
        flag = "--" + dest.replace("_", "-")
        if value is None:
            continue
        if value is False and defaults[dest] is False:      # a store_true flag left off
            direct[dest] = False
        elif isinstance(value, bool):
            tokens.append(flag if value else f"--no-{dest.replace('_', '-')}")
        elif isinstance(value, list) and dest in REPEATABLE:
            tokens += [t for v in value for t in (flag, str(v))]
        elif isinstance(value, (list, dict)):
            tokens += [flag, ",".join(map(str, value)) if isinstance(value, list) else json.dumps(value)]
        else:
            tokens += [flag, str(value)]
    fp = build_parser()  # its errors carry the file's name
    fp.error = lambda message: p.error(f"--config {path}: {message}")
    return {**given_flags(fp, tokens), **direct}


def recorded_run(p, out: str) -> dict:
    """The flags a run recorded in its run_config.json ({} when there is none yet)."""
    path = os.path.join(out, RUN_CONFIG)
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            recorded = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        p.error(f"--resume: {path} is unreadable ({e}); it is the run's identity: restore it")
    if not isinstance(recorded, dict):
        p.error(f"--resume: {path} is not a JSON object; it is the run's identity: restore it")
    return recorded


def resume_conflicts(chosen: dict, recorded: dict) -> list[str]:
    """'--flag given differs from the run's recorded' for each chosen flag outside RESUMABLE."""
    def show(v):
        return v if isinstance(v, str) and v else json.dumps(v)
    return [f"--{k.replace('_', '-')} {show(v)} differs from the run's {show(recorded[k])}"
            for k, v in sorted(chosen.items()) if k not in RESUMABLE and k in recorded and v != recorded[k]]


# Flags added after runs were recorded without them, with the value those runs used: a resumed run
# computes what it computed before, not what a new default would.
RECORDED_BEFORE = {"dynamic_sampling_threshold": 0.0}


# ----------------------------------------------------------------------------------------------
# parse and check


def parse_args(argv=None):
    p = build_parser()
    defaults = vars(p.parse_args([]))
    chosen = given_flags(p, argv)
    if chosen.get("config"):
        chosen = {**read_config(p, chosen["config"], defaults), **chosen}   # the command line wins
    recorded = {}
    if chosen.get("resume"):
        out = chosen["resume"] if isinstance(chosen["resume"], str) else chosen.get("output_dir", defaults["output_dir"])
        if chosen.get("output_dir", out) != out:
            p.error(f"--resume {out} and --output-dir {chosen['output_dir']} name different directories")
        chosen.update(output_dir=out, resume=True)
        recorded = {k: v for k, v in recorded_run(p, out).items() if k in defaults and k not in PER_INVOCATION}
        recorded = {**RECORDED_BEFORE, **recorded} if recorded else recorded
        conflicts = resume_conflicts(chosen, recorded)
        if conflicts:
            p.error("; ".join(conflicts) + f". A resumed run keeps its settings: drop "
                    f"{'these flags' if len(conflicts) > 1 else 'the flag'}, or start a new --output-dir")
    args = argparse.Namespace(**{**defaults, **recorded, **chosen})
    check(p, args)
    return args


def check(p, args) -> None:
    """Every check that needs no model and no data read: p.error (one line, exit 2) on the first failure."""
    if not args.model:
        p.error("--model is required (or --resume RUN_DIR of a run, or a --config file that names it)")
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
    check_data(p, args)
    check_rewards(p, args)
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
    package = REPORTERS[args.report_to]
    if package and importlib.util.find_spec(package) is None:
        p.error(f"--report-to {args.report_to} needs the {package} package: pip install {package}")
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
            funcs.append(reward_funcs.load(spec))
        except ValueError as e:
            p.error(f"--reward: {e}")
    names = [f.name for f in funcs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        p.error(f"--reward: two terms are named {twice[0]!r}; the metrics need distinct names")
