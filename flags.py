"""train.py's command line: every flag with its help and default, a config file, --resume, and the
checks that run before anything loads.

Every flag is a field of a config dataclass, which holds its default and its help text:
lora.LoRAConfig (--lora-*), aqn.AQNConfig (--aqn, --sigma-*, --aqn-*), grpo.GRPOConfig (the objective,
dynamic sampling, --group-size, --max-new-tokens, --updates-per-rollout) and TrainConfig here (the run,
model, data, reward, sampling, optimization and records). build_parser lays them out in --help's
SECTIONS, and to_config(args, cls) turns the parsed flags back into the dataclass train.py builds on.

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
import dataclasses
import difflib
import importlib.util
import json
import math
import os
import typing
from dataclasses import dataclass, field

import torch

import aqn
import grpo
import lora
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
# the flags: fields of the config dataclasses


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


@dataclass
class TrainConfig:
    """The flags train.py reads itself (args.<field>): the run, the model, the data, the reward, sampling,
    optimization and the records. With the fields of lora.LoRAConfig, aqn.AQNConfig and grpo.GRPOConfig
    they are the whole command line: a field's metadata holds its help and, where the type does not say
    it all, argparse's choices, metavar, type, action or nargs. The values come checked by check()
    (FLAG_RANGES and the rules between flags), whose messages name the flags."""
    # ---- run
    config: str | None = field(default=None, metadata={"metavar": "FILE", "help": (
        "JSON or YAML file of flags (keys: flag names); the command line overrides it (default: none)")})
    resume: bool | str = field(default=False, metadata={"nargs": "?", "const": True, "metavar": "RUN_DIR", "help": (
        "continue RUN_DIR (or --output-dir) from its newest checkpoint, with its recorded flags")})
    output_dir: str = field(default="runs/qerl", metadata={"help": "the run directory (run_dir.py)"})
    seed: int = field(default=0, metadata={"help": "seeds data order, adapter init, AQN noise and sampling"})
    # ---- model
    model: str | None = field(default=None, metadata={
        "help": "Hugging Face hub id or local checkpoint directory (required)"})
    random_init: bool = field(default=False, metadata={"help": (
        "random weights of --model's shape (checkpoint.SHAPES: qwen2.5-7b|14b|32b, qwen3-8b|32b; "
        "or a dir with config.json): benchmarks")})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer hub id or directory (default: --model)"})
    quant: str = field(default="nvfp4", metadata={"choices": ("nvfp4", "bf16"),
                                                  "help": "base weights: 4-bit NVFP4 or bf16"})
    dtype: str = field(default="bfloat16", metadata={"choices": ("bfloat16", "float32"),
                                                     "help": "activations and adapters"})
    device: str | None = field(default=None, metadata={
        "help": "default: cuda if available, else cpu (torchrun: cuda:LOCAL_RANK)"})
    # ---- data
    dataset: str = field(default="gsm8k", metadata={"help": (
        "gsm8k | math500 | addition | multiplication | a Hub dataset id | a .jsonl/.csv/.parquet file | a directory "
        "(<split>.<ext> files or a datasets.save_to_disk directory)")})
    dataset_config: str | None = field(default=None, metadata={"help": (
        "the Hub dataset's configuration, e.g. main for openai/gsm8k (default: its only or default one)")})
    dataset_split: str = field(default="train", metadata={"help": "the training split"})
    eval_dataset: str | None = field(default=None, metadata={
        "help": "evaluation dataset, as --dataset (default: --dataset)"})
    eval_dataset_config: str | None = field(default=None, metadata={
        "help": "its Hub configuration (default: --dataset-config when --eval-dataset is not given)"})
    eval_split: str = field(default="test", metadata={"help": "the evaluation split"})
    prompt_column: str | None = field(default=None, metadata={"help": (
        f"column holding the prompt, a string or a list of messages (default: the first of "
        f"{', '.join(tasks.PROMPT_COLUMNS)})")})
    answer_column: str | None = field(default=None, metadata={
        "help": "column holding the gold answer (default: answer, if present)"})
    eval_limit: int = field(default=500, metadata={"help": "evaluation questions (0 = no evaluation)"})
    max_prompt_len: int = field(default=512, metadata={"help": "longer prompts are dropped (counted)"})
    system_prompt: str = field(default=tasks.SYSTEM_PROMPT, metadata={
        "help": "put before every prompt without a system message of its own ('' for none)"})
    chat_template_kwargs: dict | None = field(default=None, metadata={
        "type": tasks.parse_chat_template_kwargs, "metavar": "JSON",
        "help": """extra chat-template variables, a JSON object: '{"enable_thinking": false}' (Qwen3); """
                "default: none"})
    # ---- reward
    reward: list[str] = field(default_factory=lambda: [reward_funcs.BUILTIN], metadata={
        "action": Append, "metavar": "NAME|MODULE:FN", "help": (
            "a reward term, repeatable: 'correctness' (the gold answer's guarded check) or "
            "module:function called as TRL's reward_funcs (reward_funcs.py)")})
    reward_weights: list[float] | None = field(default=None, metadata={
        "type": reward_funcs.parse_weights, "metavar": "W1,W2,...",
        "help": "one weight per --reward (default: 1 each)"})
    format_weight: float = field(default=0.0, metadata={
        "help": "added to correctness for a complete \\boxed{} answer"})
    reward_timeout: float = field(default=reward_funcs.TIMEOUT_S, metadata={
        "help": "seconds a user reward function may take on one batch before the run stops"})
    # ---- rollout
    prompts_per_step: int = field(default=16, metadata={"help": "prompts per optimizer step (all ranks)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass"})
    gpu_memory_utilization: float = field(default=0.5, metadata={"help": "share of free memory for the KV cache"})
    # ---- optimization
    lr: float = field(default=1e-5, metadata={"help": "AdamW learning rate"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warm-up steps"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm"})
    micro_batch: int | None = field(default=None, metadata={
        "help": "completions per training forward (default: as many as free GPU memory holds, plan.py)"})
    logprob_chunk: int = field(default=1024, metadata={"help": "tokens per lm_head chunk"})
    grad_checkpointing: bool | None = field(default=None, metadata={
        "help": "recompute each layer in the backward (default: only where memory needs it, plan.py)"})
    max_steps: int = field(default=200, metadata={"help": "the run's length (sets the AQN schedule)"})
    stop_at: int | None = field(default=None, metadata={
        "help": "checkpoint and exit after this step (default: --max-steps)"})
    # ---- evaluation, checkpoints and records
    eval_every: int = field(default=0, metadata={"help": "steps between evaluations (0 = only at the end)"})
    eval_max_new_tokens: int | None = field(default=None, metadata={"help": "default: --max-new-tokens"})
    save_every: int = field(default=50, metadata={"help": "steps between checkpoints"})
    keep_checkpoints: int = field(default=2, metadata={"help": "checkpoints kept (oldest removed)"})
    log_every: int = field(default=10, metadata={"help": "steps between progress lines (0 = the bar only)"})
    log_completions: int = field(default=4, metadata={
        "help": "completions of each step written to completions.jsonl (prompt, completion, reward)"})
    report_to: str = field(default="none", metadata={"choices": tuple(REPORTERS),
                                                     "help": "also send the metrics there"})


CONFIGS = (TrainConfig, lora.LoRAConfig, aqn.AQNConfig, grpo.GRPOConfig)

# --help's sections and the place of each flag in them (each flag's default, type and help: its field).
SECTIONS = {
    "run": ("config", "resume", "output_dir", "seed"),
    "model": ("model", "random_init", "tokenizer", "quant", "dtype", "device"),
    "data": ("dataset", "dataset_config", "dataset_split", "eval_dataset", "eval_dataset_config", "eval_split",
             "prompt_column", "answer_column", "eval_limit", "max_prompt_len", "system_prompt", "chat_template_kwargs"),
    "reward": ("reward", "reward_weights", "format_weight", "reward_timeout"),
    "LoRA": ("lora_rank", "lora_alpha", "lora_dropout"),
    "AQN (adaptive quantization noise)": ("aqn", "sigma_start", "sigma_end", "aqn_stages", "aqn_rollout_only"),
    "rollout": ("group_size", "prompts_per_step", "max_new_tokens", "temperature", "top_p", "gpu_memory_utilization"),
    "objective": ("loss_type", "epsilon", "epsilon_high", "beta", "scale_rewards", "dynamic_sampling",
                  "dynamic_sampling_threshold", "max_sampling_rounds", "overlong_cache", "mask_truncated",
                  "importance_sampling", "importance_sampling_max", "importance_sampling_min"),
    "optimization": ("lr", "warmup_steps", "weight_decay", "max_grad_norm", "updates_per_rollout", "micro_batch",
                     "logprob_chunk", "grad_checkpointing", "max_steps", "stop_at"),
    "evaluation, checkpoints and records": ("eval_every", "eval_max_new_tokens", "save_every", "keep_checkpoints",
                                            "log_every", "log_completions", "report_to"),
}


def flag_name(f: dataclasses.Field) -> str:
    """The flag's dest (--kebab-case on the command line): metadata["flag"], else the field's name."""
    return f.metadata.get("flag", f.name)


# dest -> (the field that declares the flag, its type): every field with a help text is a flag.
FLAGS = {flag_name(f): (f, typing.get_type_hints(cls)[f.name])
         for cls in CONFIGS for f in dataclasses.fields(cls) if "help" in f.metadata}


def add_flags(g, names) -> None:
    """Add the flags `names` (dests) to the parser or group g, as their fields declare them. The type is
    the field's where the metadata names no type, action or nargs: int and float parse as such, a bool
    is --flag (store_true) where it defaults to False, else --flag / --no-flag."""
    for name in names:
        f, hint = FLAGS[name]
        kw = {k: v for k, v in f.metadata.items() if k != "flag"}
        kw["default"] = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        if "choices" in kw:
            kw["choices"] = list(kw["choices"])
        base = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
        if not kw.keys() & {"type", "action", "nargs"}:
            if base is bool:
                kw["action"] = "store_true" if kw["default"] is False else argparse.BooleanOptionalAction
            elif base in (int, float):
                kw["type"] = base
        g.add_argument("--" + name.replace("_", "-"), **kw)


def add_precision_flags(g) -> None:
    """--quant and --dtype: how the base weights are stored and what the activations are (train.py, eval.py)."""
    add_flags(g, ("quant", "dtype"))


def add_column_flags(g) -> None:
    """--prompt-column and --answer-column: which dataset columns hold the prompt and the gold answer."""
    add_flags(g, ("prompt_column", "answer_column"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="GRPO/DAPO post-training with NVFP4 weights, LoRA and AQN (QeRL)",
                                usage="%(prog)s --model MODEL [--dataset DATASET] [flags] (--help lists them)",
                                formatter_class=HelpFormatter)
    for title, names in SECTIONS.items():
        add_flags(p.add_argument_group(title), names)
    return p


def to_config(args, cls):
    """The config dataclass cls (lora.LoRAConfig, aqn.AQNConfig, grpo.GRPOConfig) of the parsed flags
    args: each field that is a flag takes the flag's value, the others keep their defaults."""
    return cls(**{f.name: getattr(args, flag_name(f)) for f in dataclasses.fields(cls) if "help" in f.metadata})


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
