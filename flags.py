"""train.py's settings: every flag with its help and default, a config file (with TRL's names), --resume,
and the same settings from Python (`config`), each checked (checks.py) before anything loads.

Every flag is a field of a config dataclass, which holds its default and its help text:
lora.LoRAConfig (--lora-*), aqn.AQNConfig (--aqn, --sigma-*, --aqn-*), grpo.GRPOConfig (the objective,
dynamic sampling, --group-size, --max-new-tokens, --updates-per-rollout) and TrainConfig here (the run,
model, data, reward, sampling, optimization and records). build_parser lays them out in --help's
SECTIONS, and to_config(args, cls) turns the parsed flags back into the dataclass train.py builds on.

Three sources, in rising precedence: the defaults, a --config file (JSON, or YAML with PyYAML; its keys
are the flag names, with dashes or underscores, or TRL's names for the same settings, TRL_NAMES; a key
that is neither is refused by name), and the command line. From Python, `config(**settings)` takes the
keywords of the call in the command line's place (the same names; beyond it, a dataset may be rows in
memory and a reward a Python function). Every value is parsed as its flag's command-line value would
be, so it meets the same types and choices.

--resume RUN_DIR (or --resume with --output-dir) reads the run's run_config.json: every setting comes
from there, so `python train.py --resume runs/x` continues the run with no other flag. The file is
checked as a config file is, more strictly: it is the one the run's checkpoints were written with (its
sha256 is in each manifest), every flag is there with a value of its type (a flag added since has the
value runs used before it existed: RECORDED_BEFORE), and each reward function still resolves to the file
the run used, unchanged (reward_funcs.source_changes), before any of them is imported. A flag given again
must equal the recorded value, or the run is refused naming each flag that differs: a resumed run is the
same run. Only the flags of RESUMABLE may change, as they change where and how fast the run goes, how
long it runs and what it reports, never what a step computes (a longer --max-steps extends a finished
run; the AQN schedule keeps its length, --aqn-steps).

Then checks.py checks every value (its range, the rules that tie flags together, the data, the reward
functions, the model, the device, the output directory), so that a bad value is one line (exit code 2;
a ConfigError from `config`) before a model or a dataset is read.

Test: tests/test_flags.py (help, --config, TRL's names, --resume, config()); tests/test_integrity.py and
tests/test_probes.py (bad flags and run files are refused at parse time, by name).
"""
import argparse
import dataclasses
import difflib
import json
import os
import sys
import typing
from dataclasses import dataclass, field

import aqn
import data
import grpo
import lora
import reward_funcs
import tasks
from checks import REPORTERS, check, range_problem
from run_dir import RUN_CONFIG, config_problem

# Flags a resumed run may change: where it runs, its speed and memory, how long it runs (a larger
# --max-steps extends a finished run; the AQN schedule keeps its --aqn-steps), when it saves and
# evaluates, and what it reports. Every other flag must equal the run's recorded value.
RESUMABLE = {"resume", "config", "output_dir", "device", "stop_at", "max_steps", "save_every", "keep_checkpoints",
             "eval_every", "micro_batch", "grad_checkpointing", "gpu_memory_utilization", "logprob_chunk", "log_every",
             "log_completions", "report_to", "reward_timeout", "stall_timeout"}

# Flags of one invocation only: a resumed run does not take them from the run's record.
PER_INVOCATION = {"resume", "config", "stop_at"}
REPEATABLE = {"reward"}   # the Append flags: a list in a --config file is their values

# What train.py records in run_config.json beside the flags (flags.record and train.py's run facts).
NOT_FLAGS = {"world_size", "step_plan", "reward_sources"}

# TRL's names (GRPOConfig and its TrainingArguments, trl.ModelConfig, trl's ScriptArguments, GRPOTrainer's
# arguments) for settings that mean the same here -> the flag. A --config file or config() may use either;
# the names that are the same in both (beta, epsilon, epsilon_high, loss_type, scale_rewards, temperature,
# top_p, max_steps, seed, output_dir, warmup_steps, weight_decay, max_grad_norm, report_to, reward_weights,
# chat_template_kwargs, lora_alpha, lora_dropout, lora_target_modules, dataset_config, eval_dataset) need
# no entry. docs/usage.md has the table.
TRL_NAMES = {"learning_rate": "lr", "num_generations": "group_size", "max_completion_length": "max_new_tokens",
             "num_iterations": "updates_per_rollout", "mask_truncated_completions": "mask_truncated",
             "logging_steps": "log_every", "save_steps": "save_every", "save_total_limit": "keep_checkpoints",
             "eval_steps": "eval_every", "gradient_checkpointing": "grad_checkpointing",
             "model_name_or_path": "model", "lora_r": "lora_rank", "dataset_name": "dataset",
             "dataset_train_split": "dataset_split", "dataset_test_split": "eval_split",
             "train_dataset": "dataset", "reward_funcs": "reward"}
# TRL's names for settings that differ here: each is refused with what to use instead.
TRL_DIFFERENT = {
    "per_device_train_batch_size": "TRL's counts completions per device; here a step is --prompts-per-step "
                                   "prompts x --group-size completions",
    "gradient_accumulation_steps": "a step here is one generation batch, trained in micro-batches sized to the "
                                   "memory (--micro-batch)",
    "generation_batch_size": "here a step samples --prompts-per-step prompts x --group-size",
    "max_prompt_length": "TRL cuts longer prompts; here --max-prompt-len drops them",
    "lr_scheduler_type": "the schedule here is a linear warm-up (--warmup-steps), then constant: TRL's "
                         "constant_with_warmup",
    "num_train_epochs": "a run here is --max-steps steps long",
    "bf16": "--dtype (activations and adapters) and --quant (the base weights)",
    "use_vllm": "qerl samples with its own engine, on the same weights",
}


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


def parse_reporters(text: str) -> str:
    """--report-to: one or more of REPORTERS, comma-separated ('tensorboard,wandb'), or 'none' alone (so is
    nothing at all: TRL's report_to []; an argparse type)."""
    names = [n.strip() for n in text.split(",") if n.strip()] or ["none"]
    if any(n not in REPORTERS for n in names) or ("none" in names and len(names) > 1):
        raise argparse.ArgumentTypeError(f"{text!r}: want 'none', or one or more of "
                                         f"{', '.join(r for r in REPORTERS if r != 'none')}, comma-separated")
    return ",".join(dict.fromkeys(names))


class Reporters(argparse.Action):
    """--report-to, repeatable: each use adds its backends to those of the uses before it (not to the default)."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        before = current if isinstance(current, str) and current is not self.default else None
        try:
            setattr(namespace, self.dest, parse_reporters(f"{before},{values}" if before else values))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentError(self, str(e)) from None


@dataclass
class TrainConfig:
    """The flags train.py reads itself (args.<field>): the run, the model, the data, the reward, sampling,
    optimization and the records. With the fields of lora.LoRAConfig, aqn.AQNConfig and grpo.GRPOConfig
    they are the whole command line: a field's metadata holds its help and, where the type does not say
    it all, argparse's choices, metavar, type, action or nargs. The values come checked by check()
    (checks.py), whose messages name the flags."""
    # ---- run
    config: str | None = field(default=None, metadata={"metavar": "FILE", "help": (
        "JSON or YAML file of flags (keys: flag names); the command line overrides it (default: none)")})
    resume: bool | str = field(default=False, metadata={"nargs": "?", "const": True, "metavar": "RUN_DIR", "help": (
        "continue RUN_DIR (or --output-dir) from its newest checkpoint, with its recorded flags")})
    output_dir: str = field(default="runs/qerl", metadata={"help": "the run directory (run_dir.py)"})
    seed: int = field(default=0, metadata={"help": "seeds data order, adapter init, AQN noise and sampling"})
    deterministic: bool = field(default=False, metadata={"help": (
        "bit-reproducible from --seed on one GPU: PyTorch's deterministic algorithms (attention's backward "
        "without atomics, cuBLAS with a fixed workspace); slower (docs/usage.md says how much)")})
    stall_timeout: float = field(default=600.0, metadata={"help": (
        "seconds without progress (a sampler step, a micro-batch, an update; rewards, callbacks and trackers "
        "not counted) after which the run prints every thread's stack and exits with status 75, to be "
        "resumed (watchdog.py); 0: never, as under a debugger")})
    # ---- model
    model: str | None = field(default=None, metadata={
        "help": "Hugging Face hub id or local checkpoint directory (required)"})
    random_init: bool = field(default=False, metadata={"help": (
        "random weights of --model's shape (checkpoint.SHAPES: qwen2.5-7b|14b|32b, qwen3-8b|32b; "
        "or a dir with config.json): benchmarks")})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer hub id or directory (default: --model)"})
    quant: str = field(default="nvfp4", metadata={"choices": ("nvfp4", "bf16"),
                                                  "help": "base weights: 4-bit NVFP4 or bf16"})
    quantizer: str | None = field(default=None, metadata={"choices": ("rtn", "mse", "gptq"), "help": (
        "how NVFP4's codes and scales are chosen (checkpoint.py): gptq (the default with --quant nvfp4), "
        "error compensation on the first 128 training prompts, the base saved in the run directory "
        "(base/); rtn, round to nearest with absmax scales (llm-compressor's); mse, each block's scale searched")})
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
        "action": Append, "metavar": "SPEC", "help": (
            "a reward term, repeatable: correctness | path/file.py:function | package.module:function (the current "
            "directory is not searched), called as TRL's reward_funcs (reward_funcs.py)")})
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
    max_steps: int = field(default=200, metadata={
        "help": "the run's length (a larger one on --resume extends a finished run)"})
    stop_at: int | None = field(default=None, metadata={
        "help": "checkpoint and exit after this step (default: --max-steps)"})
    aqn_steps: int | None = field(default=None, metadata={"help": (
        "steps the AQN schedule spans (default: the run's first --max-steps; steps past it stay in the last stage)")})
    # ---- evaluation, checkpoints and records
    eval_every: int = field(default=0, metadata={"help": "steps between evaluations (0 = only at the end)"})
    eval_max_new_tokens: int | None = field(default=None, metadata={"help": "default: --max-new-tokens"})
    save_every: int = field(default=50, metadata={"help": "steps between checkpoints"})
    keep_checkpoints: int = field(default=2, metadata={"help": "checkpoints kept (oldest removed)"})
    log_every: int = field(default=10, metadata={"help": "steps between progress lines (0 = the bar only)"})
    log_completions: int = field(default=4, metadata={
        "help": "completions of each step written to completions.jsonl (prompt, completion, reward)"})
    report_to: str = field(default="none", metadata={
        "type": parse_reporters, "action": Reporters, "metavar": "NAME[,NAME]",
        "help": f"also send the metrics there: {' | '.join(REPORTERS)}; several comma-separated or repeated"})


CONFIGS = (TrainConfig, lora.LoRAConfig, aqn.AQNConfig, grpo.GRPOConfig)

# --help's sections and the place of each flag in them (each flag's default, type and help: its field).
SECTIONS = {
    "run": ("config", "resume", "output_dir", "seed", "deterministic", "stall_timeout"),
    "model": ("model", "random_init", "tokenizer", "quant", "quantizer", "dtype", "device"),
    "data": ("dataset", "dataset_config", "dataset_split", "eval_dataset", "eval_dataset_config", "eval_split",
             "prompt_column", "answer_column", "eval_limit", "max_prompt_len", "system_prompt", "chat_template_kwargs"),
    "reward": ("reward", "reward_weights", "format_weight", "reward_timeout"),
    "LoRA": ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules"),
    "AQN (adaptive quantization noise)": ("aqn", "sigma_start", "sigma_end", "aqn_stages", "aqn_steps",
                                          "aqn_rollout_only"),
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
# the sources: command line, --config file, Python, the resumed run


class ConfigError(ValueError):
    """A setting config() refuses: the line the command line would print, raised instead of an exit."""


def given_flags(parser, argv) -> dict:
    """{dest: value} of the flags present in argv only (argparse fills in a default only where the
    namespace has no such attribute, so a namespace of markers shows which were given)."""
    unset = object()
    ns = argparse.Namespace(**{k: unset for k in vars(parser.parse_args([]))})
    parser.parse_args(argv, ns)
    return {k: v for k, v in vars(ns).items() if v is not unset}


def as_json(value):
    """A flag's value as run_config.json records it: rows in memory and in-process reward functions by
    their labels, tuples as lists."""
    if isinstance(value, (data.Rows, reward_funcs.InProcess)):
        return value.label
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    return value


def record(args) -> dict:
    """The flags as run_config.json records them (train.py writes it; trackers and the log show it)."""
    return {k: as_json(v) for k, v in vars(args).items()}


def _tokens(dest: str, value, defaults: dict) -> list[str] | None:
    """A value as the command-line tokens that give it; None where the value is set as it is (a
    store_true flag left off)."""
    flag = "--" + dest.replace("_", "-")
    if value is False and defaults[dest] is False:
        return None
    if dest == "scale_rewards" and isinstance(value, bool):   # TRL's True / False: group / none
        return [flag, "group" if value else "none"]
    if isinstance(value, bool):
        return [flag if value else f"--no-{dest.replace('_', '-')}"]
    if isinstance(value, list) and dest in REPEATABLE:
        return [t for v in value for t in (flag, str(v))]
    if isinstance(value, (list, tuple)):
        return [flag, ",".join(map(str, value))]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def read_values(p, where: str, values: dict, defaults: dict, strict: bool = False) -> dict:
    """{dest: value} of a mapping of flag names (or TRL's names for them, TRL_NAMES) to values, each value
    parsed as its flag's command-line value would be, so it meets the same types and choices; p.error
    naming `where` and the key on anything else. A list is a repeatable flag's values (--reward) or
    comma-separated ones (--reward-weights, --report-to, --lora-target-modules); null leaves a flag whose
    default is None unset and is refused for any other. strict (a run's record): each value must be of the
    type train.py writes, not merely text that parses as one. TRL names read are said in one line."""
    tokens, direct, given, renamed = [], {}, {}, []
    for key, value in values.items():
        name = str(key).replace("-", "_")
        dest = TRL_NAMES.get(name, name)
        if name in TRL_DIFFERENT:
            p.error(f"{where}: {key!r} is TRL's name for a setting that differs here: {TRL_DIFFERENT[name]}")
        if dest not in defaults or dest == "config":
            known = [d for d in [*defaults, *TRL_NAMES] if d != "config"]
            close = difflib.get_close_matches(name, known, n=1)
            p.error(f"{where}: unknown key {key!r} (not a train.py flag, nor TRL's name for one)"
                    + (f"; did you mean {close[0]!r}?" if close else ""))
        if dest in given:
            p.error(f"{where}: {given[dest]!r} and {key!r} both set --{dest.replace('_', '-')}")
        given[dest] = key
        if dest != name:
            renamed.append(f"{name} as --{dest.replace('_', '-')}")
        if value is None:
            if defaults[dest] is not None:
                p.error(f"{where}: {key!r} is null, and --{dest.replace('_', '-')} needs a value (leave the key "
                        f"out for its default, {defaults[dest]!r})")
            direct[dest] = None
            continue
        t = _tokens(dest, value, defaults)
        if t is None:
            direct[dest] = value
        else:
            tokens += t
    fp = build_parser()  # its errors carry where the values came from
    fp.error = lambda message: p.error(f"{where}: {message}")
    parsed = {**given_flags(fp, tokens), **direct}
    for dest, value in parsed.items() if strict else ():
        raw = values[given[dest]]
        if as_json(value) != raw or type(raw) is str and not isinstance(value, str):
            p.error(f"{where}: {given[dest]!r} holds {raw!r}, a {type(raw).__name__}, where train.py records "
                    f"{json.dumps(as_json(value))}: not as train.py writes it; restore it")
    if renamed:
        print(f"{where}: TRL's names read as qerl's flags: {', '.join(renamed)}", file=sys.stderr)
    return parsed


def read_config(p, path: str, defaults: dict) -> dict:
    """{dest: value} of a --config file (read_values); p.error naming the file and key on anything else."""
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
    return read_values(p, f"--config {path}", values, defaults)


def recorded_run(p, path: str) -> dict:
    """The JSON object of a run's run_config.json at path ({} when there is none yet)."""
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


def check_sources(p, where: str, raw: dict) -> None:
    """A resumed run's reward functions must be the code the run used: each user function of the record
    resolves to the file its reward_sources row names, with the same sha256 (nothing is imported)."""
    specs = [s for s in raw.get("reward") or () if isinstance(s, str) and s != reward_funcs.BUILTIN
             and not s.startswith(reward_funcs.IN_PROCESS)]
    rows = raw.get("reward_sources")
    if rows is None:
        if specs:
            print(f"warning: {where} records no reward sources (written before runs kept them): {specs} are not "
                  f"checked against the files the run used", file=sys.stderr)
        return
    if not isinstance(rows, list):
        p.error(f"{where}: reward_sources is a {type(rows).__name__}, not the list train.py writes; restore it")
    unrecorded = [s for s in specs if s not in {r.get("spec") for r in rows if isinstance(r, dict)}]
    problems = [f"it records no source (file and sha256) of --reward {s}" for s in unrecorded]
    problems += reward_funcs.source_changes(rows)
    if problems:
        p.error(f"{where}: " + "; ".join(problems) + ". A resumed run scores with the code it started with: "
                "restore it, or start a new --output-dir")


def resumed_flags(p, out: str, defaults: dict) -> dict:
    """The flags the run in `out` recorded ({} when it has none yet), the record checked before any of it is
    used: it is the run_config.json the run's checkpoints were written with (run_dir.config_problem), it holds
    every flag (RECORDED_BEFORE gives a flag added since the value runs used before it) and no unknown key,
    its reward functions are the code the run used (check_sources), and each value is of its flag's type
    and in its range. Every refusal names the file and the key."""
    path = os.path.join(out, RUN_CONFIG)
    raw = recorded_run(p, path)
    if not raw:
        return {}
    where = f"--resume: {path}"
    why = config_problem(out)
    if why:
        p.error(f"{where}: {why}")
    unknown = sorted(set(raw) - set(defaults) - NOT_FLAGS)
    if unknown:
        p.error(f"{where}: unknown key {unknown[0]!r} (train.py records no such flag); restore the file")
    missing = [k for k in defaults if k not in raw and k not in RECORDED_BEFORE and k not in PER_INVOCATION]
    if missing:
        p.error(f"{where} lacks {', '.join(map(repr, missing[:3]))}{' and more' if len(missing) > 3 else ''}: "
                f"not as train.py writes it; restore it")
    check_sources(p, where, raw)
    recorded = read_values(p, where, {k: v for k, v in raw.items() if k in defaults and k not in PER_INVOCATION},
                           defaults, strict=True)
    for name, value in recorded.items():
        problem = range_problem(name, value)
        if problem:
            p.error(f"{where}: {name!r} {problem}")
    return {**RECORDED_BEFORE, **recorded}


def resume_conflicts(chosen: dict, recorded: dict) -> list[str]:
    """'--flag given differs from the run's recorded' for each chosen flag outside RESUMABLE."""
    def show(v):
        v = as_json(v)
        return v if isinstance(v, str) and v else json.dumps(v)
    return [f"--{k.replace('_', '-')} {show(v)} differs from the run's {show(recorded[k])}"
            for k, v in sorted(chosen.items())
            if k not in RESUMABLE and k in recorded and as_json(v) != as_json(recorded[k])]


# Flags added after runs were recorded without them, with the value those runs used: a resumed run
# computes what it computed before, not what a new default would. aqn_steps None: the run's --max-steps.
# A flag of RESUMABLE, which changes nothing a step computes, takes its default (stall_timeout).
RECORDED_BEFORE = {"dynamic_sampling_threshold": 0.0, "aqn_steps": None, "lora_target_modules": lora.DEFAULT_TARGETS,
                   "quantizer": "rtn", "deterministic": False, "stall_timeout": TrainConfig.stall_timeout}


# ----------------------------------------------------------------------------------------------
# parse and check


def parse_args(argv=None):
    """train.py's command line -> its checked settings (an argparse.Namespace): one line and exit 2 on a refusal."""
    p = build_parser()
    defaults = vars(p.parse_args([]))
    chosen = given_flags(p, argv)
    if chosen.get("config"):
        chosen = {**read_config(p, chosen["config"], defaults), **chosen}   # the command line wins
    return resolve(p, chosen, defaults)


def config(**settings):
    """train.train's settings from Python, checked as the command line's are: keywords named as the flags
    (lr=1e-5, max_new_tokens=64) or as TRL names them (learning_rate, num_generations, ...: TRL_NAMES),
    each value parsed as its flag's. Beyond the command line, dataset (TRL: train_dataset) and eval_dataset
    may be rows in memory, a list of dicts or a datasets.Dataset in TRL's columns (data.Rows), and reward
    (TRL: reward_funcs) may list Python functions in TRL's signature beside the specs
    (reward_funcs.spec_of: a module-level function runs in its worker, any other callable in this process).
    Raises ConfigError, one line, on what the command line would refuse."""
    p = build_parser()

    def refuse(message):
        raise ConfigError(message)
    p.error = refuse
    defaults = vars(p.parse_args([]))
    both = [(name, trl) for trl, name in TRL_NAMES.items() if trl in settings and name in settings]
    if both:
        refuse(f"config(): {both[0][0]!r} and {both[0][1]!r} both set --{both[0][0].replace('_', '-')}")
    direct = {}
    try:
        for key in ("dataset", "train_dataset", "eval_dataset"):
            if settings.get(key) is not None and not isinstance(settings[key], str):
                direct[TRL_NAMES.get(key, key)] = data.Rows(settings.pop(key))
        for key in ("reward", "reward_funcs"):
            funcs = settings.get(key)
            funcs = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs] if funcs is not None else []
            if any(callable(f) for f in funcs):
                direct["reward"] = [reward_funcs.spec_of(f) if callable(f) else f for f in funcs]
                settings.pop(key)
    except ValueError as e:
        refuse(str(e))
    chosen = {**read_values(p, "config()", settings, defaults), **direct}
    return resolve(p, chosen, defaults)


def resolve(p, chosen: dict, defaults: dict):
    """The run's settings from the flags chosen and, with --resume, the run's record; then checked."""
    recorded = {}
    if chosen.get("resume"):
        out = chosen["resume"] if isinstance(chosen["resume"], str) else chosen.get("output_dir", defaults["output_dir"])
        if chosen.get("output_dir", out) != out:
            p.error(f"--resume {out} and --output-dir {chosen['output_dir']} name different directories")
        chosen.update(output_dir=out, resume=True)
        recorded = resumed_flags(p, out, defaults)
        conflicts = resume_conflicts(chosen, recorded)
        if conflicts:
            p.error("; ".join(conflicts) + f". A resumed run keeps its settings: drop "
                    f"{'these flags' if len(conflicts) > 1 else 'the flag'}, or start a new --output-dir")
    args = argparse.Namespace(**{**defaults, **recorded, **chosen})
    if args.aqn_steps is None:   # the schedule spans the run's first --max-steps, which its record keeps
        args.aqn_steps = recorded.get("max_steps", args.max_steps)
    if args.quantizer is None:   # GPTQ for an NVFP4 base (it keeps the model closest to bf16); bf16 has no codes
        args.quantizer = "gptq" if args.quant == "nvfp4" else "rtn"
    check(p, args)
    return args
