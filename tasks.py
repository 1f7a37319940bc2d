r"""Tasks: datasets as Examples, and the prompts the model sees.

A task is a list of `Example`s (a prompt, a gold answer, which checker scores it, the row's other
columns). Sources (`load_task(source, split, config=..., columns=...)`):

    "gsm8k", "math500"          hub openai/gsm8k (config "main"), HuggingFaceH4/MATH-500 (one split: test)
    "addition"                  synthetic a + b, two-digit a and b, seeded train/test split (no download)
    "multiplication"            synthetic a * b, two-digit a, one-digit b > 1: harder for a small model,
                                which learns it more slowly than addition (README's learning figures)
    "org/name" (+ config)       any Hub dataset, through `datasets` (data.py)
    "file.jsonl|.csv|.parquet"  a local file; "dir/": dir/<split>.<ext> or a datasets.save_to_disk directory
    data.Rows(rows)             rows in memory: a list of dicts or a datasets.Dataset (flags.config's dataset=)

Columns. The prompt is the --prompt-column, else the first of PROMPT_COLUMNS a row has; the gold answer
the --answer-column, else `answer` when the first row has it (then every row needs one). A prompt is TRL's "standard" format, a string (the
user's turn), or its "conversational" format, a list of {"role", "content"} messages. A gold answer
with a `####` line (GSM8K) is the text after its last `####`; a prompt column named `problem` marks
MATH style (math-verify checks it, the `solution` column is the worked solution); any other answer is
checked as a number when it is one, else by math-verify. A dataset without an answer column trains
only with reward functions of the user's (rewards.py) and cannot be evaluated for accuracy. Every
column but the prompt rides along in `Example.columns`: TRL hands them to reward functions.

Bad data (bytes that are not UTF-8, bad JSON, missing columns, no examples at all) raises
DatasetError naming the file and line or row; so does a row that cannot train: an empty prompt, a
conversation without a user message that says something, a gold answer that is empty, empty after its
`####`, NaN (a CSV or Parquet cell left empty) or null: its reward would be 0 forever, and nothing
would say so. `source_problem` is the check made at parse time; `model_problem` and
`tokenizer_problem` check a local model directory the same way (config.json, a tokenizer) before it
loads. A chat template that fails (it is code: Jinja) raises PromptError, one line.

The model sees its prompt through the tokenizer's own chat template, after the system prompt (which
asks it to reason and put its final answer in \boxed{}) unless the conversation brings its own.
rewards.py scores what comes back.

Test: python -m pytest tests/test_tasks.py tests/test_data.py; self-check: python tasks.py tests/data/gsm8k test
"""
from __future__ import annotations

import json
import math
import operator
import os
import random
import sys
import time
from dataclasses import dataclass, field

import data
from data import DatasetError
from rewards import RewardStats, reward, to_number

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
HUB = {"gsm8k": ("openai/gsm8k", "main"), "math500": ("HuggingFaceH4/MATH-500", None)}
# name: (sign, its function, first operands, second operands, test-split size)
ARITHMETIC = {"addition": ("+", operator.add, range(10, 100), range(10, 100), 1000),
              "multiplication": ("*", operator.mul, range(10, 100), range(2, 10), 200)}
BUILTIN = (*HUB, *ARITHMETIC)
KINDS = ("numeric", "math")
PROMPT_COLUMNS = ("prompt", "problem", "question")   # tried in this order when --prompt-column is not given


# -----------------------------------------------------------------------------
# examples


@dataclass(frozen=True)
class Example:
    question: str              # the user's turn: a string prompt, or a conversation's last user message
    answer: str | None         # gold final answer: "18" (GSM8K), LaTeX "\frac{1}{2}" (MATH); None: no gold
    kind: str | None           # "numeric" -> gsm8k_reward, "math" -> math_reward; None without a gold
    solution: str = ""         # the worked gold solution when the source has one
    messages: tuple = ()       # a conversational prompt (TRL's format); () for a string prompt
    # The row's other columns, for reward functions. Payload, not identity: equality ignores it.
    columns: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if (self.answer is None) != (self.kind is None) or (self.kind is not None and self.kind not in KINDS):
            raise ValueError(f"Example.kind must be one of {KINDS} with a gold answer and None without one, "
                             f"got kind {self.kind!r} with answer {self.answer!r}")

    @property
    def prompt(self):
        """The prompt as the dataset gives it: the message list, or the string."""
        return list(self.messages) if self.messages else self.question


class PromptError(ValueError):
    """The tokenizer's chat template failed on a prompt: train.py and eval.py print it as one line."""


@dataclass(frozen=True)
class Columns:
    """Which columns hold the prompt and the gold answer (None: found by name, see the module docstring)."""
    prompt: str | None = None
    answer: str | None = None


def _messages(value, where: str, column: str) -> tuple:
    """A conversational prompt, checked: a non-empty list of {"role": str, "content": str} with a user
    message that says something (a system prompt alone, or blank turns, give the model nothing to answer)."""
    ok = value and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in value)
    if not ok:
        raise ValueError(f"{where}: column {column!r} is a list but not a conversation (want a non-empty list of "
                         f'{{"role": ..., "content": ...}} with string values)')
    if not any(m["role"] == "user" and m["content"].strip() for m in value):
        raise ValueError(f"{where}: the conversation in column {column!r} has no user message with any text "
                         f"(roles {[m['role'] for m in value]}): there is nothing to answer")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def resolve_columns(rec, columns: Columns = Columns()) -> Columns:
    """The prompt and answer columns of a record, found by name where not given."""
    if not isinstance(rec, dict):
        return columns
    return Columns(columns.prompt or next((k for k in PROMPT_COLUMNS if k in rec), None),
                   columns.answer or ("answer" if "answer" in rec else None))


def example_from_record(rec: dict, where: str = "record", columns: Columns = Columns()) -> Example:
    """One record (a JSON object, a dataset row) -> Example, by the column rules of the module docstring."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    found = resolve_columns(rec, columns)
    pkey, akey = found.prompt, found.answer
    if pkey is None:
        raise ValueError(f"{where}: missing a prompt column (one of {list(PROMPT_COLUMNS)}, or --prompt-column); "
                         f"the columns are {sorted(rec)}")
    missing = [k for k in (pkey, akey) if k is not None and k not in rec]
    if missing:
        raise ValueError(f"{where}: missing {' and '.join(map(repr, missing))}; the columns are {sorted(rec)}")
    value = rec[pkey]
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: the prompt (column {pkey!r}) is empty: there is nothing to answer")
        question, messages = value, ()
    elif isinstance(value, list):
        messages = _messages(value, where, pkey)
        question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
    else:
        raise ValueError(f"{where}: column {pkey!r} must be a string or a list of messages, got {type(value).__name__}")
    extra = {k: v for k, v in rec.items() if k != pkey}
    if akey is None:
        return Example(question, None, None, messages=messages, columns=extra)
    answer = rec[akey]
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise ValueError(f"{where}: column {akey!r} (the answer) must be a string or number, got {type(answer).__name__}")
    if isinstance(answer, float) and not math.isfinite(answer):   # a CSV or Parquet cell left empty reads as NaN
        raise ValueError(f"{where}: the answer (column {akey!r}) is {answer}, not a gold answer (an empty cell?)")
    answer = str(answer)
    gold = answer.split("####")[-1].strip() if "####" in answer and pkey != "problem" else answer.strip()
    if not gold:   # no completion could ever match it: the reward would be 0 forever, without an error
        raise ValueError(f"{where}: the answer (column {akey!r}) is {'empty after its ####' if '####' in answer else 'empty'}: "
                         f"no completion can match it")
    if pkey == "problem":
        return Example(question, gold, "math", str(rec.get("solution") or ""), messages, extra)
    if "####" in answer:
        return Example(question, gold, "numeric", answer, messages, extra)
    return Example(question, gold, "numeric" if to_number(gold) is not None else "math", "", messages, extra)


def examples_from_rows(found: list[tuple[object, str]], source: str, columns: Columns = Columns()) -> list[Example]:
    """[(record, where)] -> Examples; a record that does not fit raises DatasetError naming where it is.
    Gold answers are all or none: when the first record has an answer column, every record needs it."""
    if found and columns.answer is None:
        columns = Columns(columns.prompt, resolve_columns(found[0][0]).answer)
    out = []
    for rec, where in found:
        try:
            out.append(example_from_record(rec, where, columns))
        except ValueError as e:
            raise DatasetError(str(e)) from None
    if not out:
        raise DatasetError(f"{source}: the dataset is empty (no rows)")
    return out


def read_jsonl(path: str, columns: Columns = Columns()) -> list[Example]:
    """Every non-blank line of a JSONL file as an Example; errors name the file and line."""
    return examples_from_rows(data.read_jsonl_records(path), path, columns)


def arithmetic_task(name: str, split: str, seed: int = 0) -> list[Example]:
    """A synthetic ARITHMETIC task: a fixed seeded shuffle of every operand pair; the first
    test-size pairs are the test split, the rest train (disjoint for any seed). Addition has
    90 · 90 = 8100 pairs (1000 test), multiplication 90 · 8 = 720 (200 test)."""
    sign, fn, firsts, seconds, test_size = ARITHMETIC[name]
    pairs = [(a, b) for a in firsts for b in seconds]
    random.Random(seed).shuffle(pairs)
    chosen = pairs[:test_size] if split == "test" else pairs[test_size:]
    examples = []
    for a, b in chosen:
        answer = str(fn(a, b))
        examples.append(Example(f"What is {a} {sign} {b}?", answer, "numeric", columns={"answer": answer}))
    return examples


# -----------------------------------------------------------------------------
# loading


def load_task(source: str, split: str = "train", *, limit: int | None = None, seed: int = 0,
              config: str | None = None, columns: Columns = Columns()) -> list[Example]:
    """Examples of a built-in task, a Hub dataset or a local file / directory (the module docstring).

    The built-in names take precedence over paths, and a local path over a Hub id; config is a Hub
    dataset's configuration; limit keeps the first N. Refusals are source_problem's, as DatasetError."""
    problem = source_problem(source, split, config, columns)
    if problem:
        raise DatasetError(problem)
    if isinstance(source, data.Rows):
        examples = examples_from_rows(source.records(), source.label, columns)
    elif source in ARITHMETIC:
        examples = arithmetic_task(source, split, seed)
    elif source in HUB:
        repo, cfg = HUB[source]
        examples = examples_from_rows(data.hub_rows(repo, split, cfg), repo)
    elif os.path.exists(source):
        examples = examples_from_rows(data.file_rows(source, split), source, columns)
    else:
        examples = examples_from_rows(data.hub_rows(source, split, config), source, columns)
    return examples[:limit] if limit is not None else examples


def source_problem(source: str, split: str, config: str | None = None, columns: Columns = Columns()) -> str | None:
    """What load_task would refuse before reading a row, else None: the check train.py and eval.py make
    at parse time, before any model loads (a Hub dataset's existence is known only when it is read; rows in
    memory are all read here, they are at hand)."""
    if isinstance(source, data.Rows):
        if config:
            return "rows in memory: --dataset-config is for Hub datasets"
        try:
            examples_from_rows(source.records(), source.label, columns)
        except DatasetError as e:
            return str(e)
        return None
    if source in BUILTIN:
        if config or columns != Columns():
            return f"{source} is built in, with its own configuration and columns: --dataset-config, " \
                   f"--prompt-column and --answer-column are for Hub and local datasets"
        if source == "math500" and split != "test":
            return f"math500 has only the 'test' split, not {split!r}"
        if source in ARITHMETIC and split not in ("train", "test"):
            return f"the {source} task has splits 'train' and 'test', not {split!r}"
        return None
    if os.path.exists(source):
        if config:
            return f"{source} is a local file or directory: --dataset-config is for Hub datasets"
        return data.local_problem(source, split)
    if data.looks_like_hub_id(source):
        return None
    return (f"unknown task {source!r}: not a built-in task ({', '.join(BUILTIN)}), an existing file or directory, "
            f"or a Hub dataset id (org/name)")


def local_path_missing(name_or_path: str) -> bool:
    """True for a model path that can only be local (absolute, ./, ../, ~, or more than one '/':
    a hub id is 'name' or 'org/name') and does not exist."""
    local = name_or_path.startswith(("/", "./", "../", "~")) or name_or_path.count("/") > 1
    return local and not os.path.exists(os.path.expanduser(name_or_path))


# A tokenizer directory holds at least one of these (fast, sentencepiece, BPE or WordPiece vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")


def model_problem(name_or_path: str) -> str | None:
    """Why a local model directory cannot be loaded, found from its config.json alone before anything
    loads (else None; a Hub id is checked when it is fetched): no such directory, no config.json, one
    that is not JSON, or one model.ModelConfig refuses (an architecture qerl lacks, 0 heads, ...)."""
    path = os.path.expanduser(name_or_path)
    if local_path_missing(name_or_path):
        return f"{name_or_path} does not exist (and is not a Hugging Face hub id)"
    if not os.path.isdir(path):
        return None
    from model import ModelConfig
    config = os.path.join(path, "config.json")
    try:
        with open(config, encoding="utf-8") as f:
            ModelConfig.from_hf(json.load(f))
    except FileNotFoundError:
        return f"{path} has no config.json: not a Hugging Face model directory"
    except (OSError, ValueError) as e:   # ValueError: bad JSON, or a config ModelConfig refuses
        return f"{config}: {' '.join(str(e).split())[:300]}"
    except (KeyError, TypeError, AttributeError) as e:
        return f"{config} lacks or garbles a field ({type(e).__name__}: {e})"
    return None


def load_problem(name_or_path: str, e: Exception) -> str:
    """A model or tokenizer's failure to load, in one line; the offline hint only for a Hub id."""
    local = os.path.isdir(os.path.expanduser(name_or_path))
    return data.one_line(e) + ("" if local else "; pass a local directory, or set HF_HUB_OFFLINE=1 to use a "
                                                "cached copy")


def tokenizer_problem(name_or_path: str) -> str | None:
    """Why a local directory holds no tokenizer (else None; a Hub id is checked when it is fetched)."""
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return f"{path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the base model's tokenizer files there"
    return None


# -----------------------------------------------------------------------------
# prompts

def parse_chat_template_kwargs(text: str) -> dict:
    """--chat-template-kwargs (TRL's name): a JSON object of extra variables for the chat template,
    e.g. '{"enable_thinking": false}' (Qwen3's thinking switch). An argparse type: a bad value fails
    at parse time, and argparse names the flag."""
    import argparse
    want = """a JSON object such as '{"enable_thinking": false}'"""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e.msg} at column {e.colno}): want {want}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is a JSON {type(value).__name__}: want {want}")
    taken = sorted(set(value) & {"conversation", "tokenize", "add_generation_prompt"})
    if taken:
        raise argparse.ArgumentTypeError(f"{taken} are set by tasks.build_prompt, not template variables")
    return value


def conversation(prompt, system_prompt: str = SYSTEM_PROMPT) -> list[dict]:
    """The messages of a prompt: a string is the user's turn; a conversation is kept as it is. The system
    prompt goes first unless the conversation has a system message of its own (or it is empty)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def build_prompt(tokenizer, prompt, system_prompt: str = SYSTEM_PROMPT, chat_template_kwargs: dict | None = None) -> str:
    """The chat-formatted prompt text, ending where the assistant's answer starts. prompt: a string
    (the user's turn) or a list of messages (TRL's conversational format), as `conversation` reads them.

    Uses the tokenizer's chat template, with chat_template_kwargs as extra template variables
    (e.g. enable_thinking=False); a tokenizer without one gets a plain "<system>\\n\\nQuestion: ...\\nAnswer:"
    fallback (tiny test tokenizers; a conversation's turns as "role: content" lines), where they do nothing.
    """
    messages = conversation(prompt, system_prompt)
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 **(chat_template_kwargs or {}))
        except Exception as e:  # the template is code of its own (Jinja): it may raise anything, even on purpose
            raise PromptError(f"the tokenizer's chat template failed on the prompt {str(prompt)[:80]!r} "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
        if not isinstance(text, str):
            raise PromptError(f"the tokenizer's chat template gave a {type(text).__name__}, not text")
        return text
    if isinstance(prompt, str):
        return f"{system_prompt}\n\nQuestion: {prompt}\nAnswer:"
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"


def _jinja(value) -> str:
    """A JSON value as a Jinja literal (true, none, "text", [..], {..})."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "none"}[value]
    if isinstance(value, list):
        return "[" + ", ".join(map(_jinja, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_jinja(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)   # a string (escapes Jinja reads as Python's) or a number


def template_with_defaults(template: str, system_prompt: str, chat_template_kwargs: dict | None = None) -> str:
    """A chat template that renders a caller's messages as build_prompt does with this system prompt and
    these template variables: the system message goes first unless the messages hold one (as
    `conversation` does; none when system_prompt is empty), and each variable is set unless the caller
    sets it. export.py writes it into the exported tokenizers, so that a server applying the model's own
    template to a user's messages prompts it as training did."""
    head = []
    for key, value in (chat_template_kwargs or {}).items():
        if not str(key).isidentifier():
            raise ValueError(f"chat template variable {key!r} is not a name a template can read")
        head.append(f"{{%- if {key} is not defined %}}{{%- set {key} = {_jinja(value)} %}}{{%- endif %}}")
    if system_prompt:
        head.append("{%- if messages | selectattr('role', 'equalto', 'system') | list | length == 0 %}"
                    f"{{%- set messages = [{{'role': 'system', 'content': {_jinja(system_prompt)}}}] + messages %}}"
                    "{%- endif %}")
    return "".join(head) + template


def encode_prompt(tokenizer, prompt, system_prompt: str = SYSTEM_PROMPT, chat_template_kwargs: dict | None = None) -> list[int]:
    """build_prompt as token ids (the template already holds its special tokens: none added)."""
    text = build_prompt(tokenizer, prompt, system_prompt, chat_template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# -----------------------------------------------------------------------------

if __name__ == "__main__":
    # Self-check: score each gold solution against its own gold answer.
    name = sys.argv[1] if len(sys.argv) > 1 else "addition"
    split = sys.argv[2] if len(sys.argv) > 2 else "test"
    examples = load_task(name, split)
    stats = RewardStats()
    t0 = time.time()
    scores = [reward(e, e.solution or f"\\boxed{{{e.answer}}}", stats) for e in examples]
    print(f"{name} [{split}]: {len(examples)} examples, gold-vs-gold {100 * sum(scores) / len(examples):.2f}% "
          f"in {time.time() - t0:.1f} s, {stats.as_dict()}")
