r"""Tasks: datasets and prompts.

A task is a list of `Example`s (question, gold answer, which checker scores it). Sources:

    load_task("gsm8k", "test")            hub openai/gsm8k (config "main"), gold = the `#### N` line
    load_task("math500", "test")          hub HuggingFaceH4/MATH-500 (one split: test)
    load_task("addition", "train")        synthetic two-digit a + b, seeded train/test split (CPU runs)
    load_task("path/to/file.jsonl")       any JSONL with question/answer or problem/answer fields
    load_task("path/to/dir", "test")      <dir>/test.jsonl (e.g. ../shared/data/gsm8k)

A file that cannot be used (bytes that are not UTF-8, bad JSON, missing fields, no examples at all)
raises DatasetError naming the file and line; `source_problem` is the check made at parse time.

The model is asked (system prompt) to reason and put its final answer in \boxed{}; the prompt goes
through the tokenizer's own chat template. rewards.py scores what comes back.

Test: python -m pytest tests/test_tasks.py; self-check: python tasks.py ../shared/data/gsm8k test
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import dataclass

from rewards import RewardStats, reward, to_number

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
HUB = {"gsm8k": ("openai/gsm8k", "main"), "math500": ("HuggingFaceH4/MATH-500", None)}
KINDS = ("numeric", "math")
ADDITION_TEST_SIZE = 1000   # of the 90 · 90 = 8100 two-digit pairs


# -----------------------------------------------------------------------------
# examples and loading

@dataclass(frozen=True)
class Example:
    question: str
    answer: str          # gold final answer: "18" (GSM8K), LaTeX "\frac{1}{2}" (MATH)
    kind: str            # "numeric" -> gsm8k_reward, "math" -> math_reward
    solution: str = ""   # the worked gold solution when the source has one

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Example.kind must be one of {KINDS}, got {self.kind!r}")


def example_from_record(rec: dict, where: str = "record") -> Example:
    """One JSON object -> Example. question+answer (GSM8K style: the gold is after the last
    `####` when present) or problem+answer (MATH style, optional solution)."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    qkey = "problem" if "problem" in rec else "question"
    missing = [k for k in (qkey, "answer") if k not in rec]
    if missing:
        names = " and ".join(repr(k) for k in missing)
        raise ValueError(f"{where}: missing field(s) {names} (need question+answer or problem+answer)")
    question, answer = rec[qkey], rec["answer"]
    if not isinstance(question, str):
        raise ValueError(f"{where}: field {qkey!r} must be a string, got {type(question).__name__}")
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise ValueError(f"{where}: field 'answer' must be a string or number, got {type(answer).__name__}")
    answer = str(answer)
    if qkey == "problem":
        return Example(question, answer.strip(), "math", str(rec.get("solution", "")))
    if "####" in answer:
        return Example(question, answer.split("####")[-1].strip(), "numeric", answer)
    gold = answer.strip()
    return Example(question, gold, "numeric" if to_number(gold) is not None else "math")


class DatasetError(ValueError):
    """A dataset that cannot be used as it is (bad bytes, bad JSON, missing fields, no examples):
    the message names the file and line; train.py and eval.py print it as one line."""


def read_jsonl(path: str) -> list[Example]:
    """Every non-blank line of a JSONL file as an Example; errors name the file and line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such JSONL file: {path}")
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            try:
                out.append(example_from_record(rec, where))
            except ValueError as e:
                raise DatasetError(str(e)) from None
    if not out:
        raise DatasetError(f"{path}: the dataset is empty (no JSON lines)")
    return out


def addition_task(split: str, seed: int = 0) -> list[Example]:
    """Synthetic a + b for two-digit a, b: a fixed seeded shuffle of all 8100 pairs, the first
    1000 are the test split, the rest train (disjoint for any seed)."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    chosen = pairs[:ADDITION_TEST_SIZE] if split == "test" else pairs[ADDITION_TEST_SIZE:]
    return [Example(f"What is {a} + {b}?", str(a + b), "numeric") for a, b in chosen]


def _load_hub(name: str, split: str) -> list[Example]:
    from datasets import load_dataset  # imported here: only hub tasks need it
    repo, config = HUB[name]
    rows = load_dataset(repo, config, split=split) if config else load_dataset(repo, split=split)
    return [example_from_record(dict(r), f"{repo}[{split}][{i}]") for i, r in enumerate(rows)]


def load_task(name_or_path: str, split: str = "train", *, limit: int | None = None, seed: int = 0) -> list[Example]:
    """Examples of a named task or a local JSONL file/directory (see the module docstring).

    The names "gsm8k", "math500" and "addition" take precedence over paths; a directory is read
    as <dir>/<split>.jsonl, a file is read whole (split ignored). limit keeps the first N.
    """
    if split not in ("train", "test", "validation"):
        raise ValueError(f"split must be 'train', 'test' or 'validation', got {split!r}")
    if name_or_path == "addition":
        if split == "validation":
            raise ValueError("the addition task has splits 'train' and 'test'")
        examples = addition_task(split, seed)
    elif name_or_path in HUB:
        if name_or_path == "math500" and split != "test":
            raise ValueError(f"math500 has only the 'test' split, got {split!r}")
        examples = _load_hub(name_or_path, split)
    elif os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, f"{split}.jsonl")
        if not os.path.isfile(path):
            have = sorted(f for f in os.listdir(name_or_path) if f.endswith(".jsonl"))
            raise FileNotFoundError(f"{path} not found (split {split!r}); the directory has {have}")
        examples = read_jsonl(path)
    elif os.path.isfile(name_or_path):
        examples = read_jsonl(name_or_path)
    else:
        raise FileNotFoundError(f"unknown task {name_or_path!r}: use one of "
                                f"{sorted([*HUB, 'addition'])} or a path to a .jsonl file or directory")
    return examples[:limit] if limit is not None else examples


def source_problem(name_or_path: str, split: str) -> str | None:
    """What load_task(name_or_path, split) would refuse before reading a line, else None: the
    check train.py and eval.py make at parse time, before any model loads."""
    if name_or_path in HUB or name_or_path == "addition":
        if name_or_path == "math500" and split != "test":
            return f"math500 has only the 'test' split, not {split!r}"
        return None
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, f"{split}.jsonl")
        return None if os.path.isfile(path) else f"{path} not found (the {split} split of {name_or_path})"
    if os.path.isfile(name_or_path):
        return None
    return (f"unknown task {name_or_path!r}: use one of {sorted([*HUB, 'addition'])} or a path to a .jsonl file "
            f"or directory")


def local_path_missing(name_or_path: str) -> bool:
    """True for a model path that can only be local (absolute, ./, ../, ~, or more than one '/':
    a hub id is 'name' or 'org/name') and does not exist."""
    local = name_or_path.startswith(("/", "./", "../", "~")) or name_or_path.count("/") > 1
    return local and not os.path.exists(os.path.expanduser(name_or_path))


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


def build_prompt(tokenizer, question: str, system_prompt: str = SYSTEM_PROMPT,
                 chat_template_kwargs: dict | None = None) -> str:
    """The chat-formatted prompt text, ending where the assistant's answer starts.

    Uses the tokenizer's chat template, with chat_template_kwargs as extra template variables
    (e.g. enable_thinking=False); a tokenizer without one gets a plain
    "<system>\\n\\nQuestion: ...\\nAnswer:" fallback (tiny test tokenizers), where they do nothing.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
    return f"{system_prompt}\n\nQuestion: {question}\nAnswer:"


def encode_prompt(tokenizer, question: str, system_prompt: str = SYSTEM_PROMPT,
                  chat_template_kwargs: dict | None = None) -> list[int]:
    """build_prompt as token ids (the template already holds its special tokens: none added)."""
    text = build_prompt(tokenizer, question, system_prompt, chat_template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# -----------------------------------------------------------------------------

if __name__ == "__main__":
    # Self-check: score each gold solution against its own gold answer.
    name = sys.argv[1] if len(sys.argv) > 1 else "addition"
    split = sys.argv[2] if len(sys.argv) > 2 else "test"
    data = load_task(name, split)
    stats = RewardStats()
    t0 = time.time()
    scores = [reward(e, e.solution or f"\\boxed{{{e.answer}}}", stats) for e in data]
    print(f"{name} [{split}]: {len(data)} examples, gold-vs-gold {100 * sum(scores) / len(data):.2f}% "
          f"in {time.time() - t0:.1f} s, {stats.as_dict()}")
