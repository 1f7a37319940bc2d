r"""Tasks: datasets, prompts, answer extraction and rewards.

A task is a list of `Example`s (question, gold answer, which checker scores it). Sources:

    load_task("gsm8k", "test")            hub openai/gsm8k (config "main"), gold = the `#### N` line
    load_task("math500", "test")          hub HuggingFaceH4/MATH-500 (one split: test)
    load_task("addition", "train")        synthetic two-digit a + b, seeded train/test split (CPU runs)
    load_task("path/to/file.jsonl")       any JSONL with question/answer or problem/answer fields
    load_task("path/to/dir", "test")      <dir>/test.jsonl (e.g. ../shared/data/gsm8k)

The model is asked (system prompt) to reason and put its final answer in \boxed{}; the prompt
goes through the tokenizer's own chat template. `extract_answer` takes the last complete
\boxed{...} (nested braces allowed), else the last number in the text.

Checkers. Numeric tasks (GSM8K, addition) compare numbers exactly after dropping thousands
commas, `$`, `%` and a trailing period, so `1,000` == 1000 and `$18.00` == 18 (Fractions, not
floats). MATH answers are LaTeX with many spellings of one value (\frac12, 0.5, \dfrac{1}{2};
\left( 3, \frac{\pi}{2} \right); intervals, sets, matrices, 10\%): string matching undercounts
badly, so `math_reward` uses math-verify, HuggingFace's checker (used by lighteval and open-r1),
which parses LaTeX into sympy (through latex2sympy2_extended) and tests equivalence, gold first:
verify(parse(gold), parse(pred)). That is why math-verify is a dependency. Scoring the gold
solutions against their own gold answers gives 100% on GSM8K test and on MATH500 here.

Every reward call is guarded: an exception or a call longer than `timeout_s` scores 0 and is
counted in a `RewardStats`; the run never crashes on a reward. math-verify's own timeouts use
signal.alarm and raise ValueError off the main thread, and an inner alarm would cancel an outer
one, so we switch its timeouts off and run one deadline of our own around the whole call: a
SIGALRM interval timer in the main thread (the exception derives from BaseException so that no
`except Exception` inside sympy or math-verify can swallow it). Off the main thread no signal
can be used; there a call that overruns is scored 0 and counted once it returns. C code that
never returns to the interpreter cannot be interrupted either way.

For eval.py there are also lm-evaluation-harness's GSM8K matchers: "strict" (the first
`#### N`) and "flexible" (the last number), with its exact-match normalisation.

Test: python -m pytest tests/test_tasks.py; self-check: python tasks.py ../shared/data/gsm8k test
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
HUB = {"gsm8k": ("openai/gsm8k", "main"), "math500": ("HuggingFaceH4/MATH-500", None)}
KINDS = ("numeric", "math")
DEFAULT_TIMEOUT_S = 5.0
ADDITION_TEST_SIZE = 1000   # of the 90 · 90 = 8100 two-digit pairs

# A number: thousands-grouped (1,000.5) or plain (1000.5, .5), optionally negative.
NUMBER_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")


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


def read_jsonl(path: str) -> list[Example]:
    """Every non-blank line of a JSONL file as an Example; errors name the file and line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such JSONL file: {path}")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            out.append(example_from_record(rec, where))
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


# -----------------------------------------------------------------------------
# prompts and answer extraction

def build_prompt(tokenizer, question: str, system_prompt: str = SYSTEM_PROMPT) -> str:
    """The chat-formatted prompt text, ending where the assistant's answer starts.

    Uses the tokenizer's chat template; a tokenizer without one gets a plain
    "<system>\\n\\nQuestion: ...\\nAnswer:" fallback (tiny test tokenizers).
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system_prompt}\n\nQuestion: {question}\nAnswer:"


def encode_prompt(tokenizer, question: str, system_prompt: str = SYSTEM_PROMPT) -> list[int]:
    """build_prompt as token ids (the template already holds its special tokens: none added)."""
    return tokenizer(build_prompt(tokenizer, question, system_prompt), add_special_tokens=False)["input_ids"]


def last_boxed(text: str) -> str | None:
    r"""Content of the last complete \boxed{...} or \fbox{...} (nested braces), or `\boxed 5`."""
    for m in reversed(list(re.finditer(r"\\(?:boxed|fbox)\b", text))):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1:j]
            continue                          # unbalanced (e.g. cut off): try an earlier one
        word = re.match(r"[^\s$]+", text[i:])
        if word and i > m.end():              # "\boxed 5": the next word (space required)
            return word.group(0)
    return None


def extract_answer(text: str) -> str | None:
    r"""The final answer: the last \boxed{...} content, else the last number, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    nums = NUMBER_RE.findall(text)
    return nums[-1] if nums else None


def to_number(s: str | None) -> Fraction | None:
    r"""Exact value of a numeric answer: "1,000" -> 1000, "$18.00" -> 18, "\frac{3}{4}" -> 3/4,
    "18 apples" -> 18 (the last number of non-numeric text); None when there is no number."""
    if s is None:
        return None
    t = s.strip()
    for junk in ("\\$", "$", "\\%", "%", "\\!", "{,}", "\\,", ","):
        t = t.replace(junk, "")
    t = re.sub(r"^\\text\{(.*)\}$", r"\1", t).strip().rstrip(".")
    frac = re.fullmatch(r"(-?)\\[dt]?frac\{?(\d+)\}?\{?(\d+)\}?", t) or re.fullmatch(r"(-?)(\d+)/(\d+)", t)
    if frac:
        sign, num, den = frac.groups()
        return None if int(den) == 0 else Fraction(int(num), int(den)) * (-1 if sign else 1)
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        pass
    nums = NUMBER_RE.findall(t)
    return Fraction(nums[-1].replace(",", "")) if nums else None


# -----------------------------------------------------------------------------
# rewards (unguarded: call them through `reward`, which guards them)

def gsm8k_reward(completion: str, gold: str) -> float:
    """1.0 when the extracted answer equals the gold number exactly, else 0.0."""
    g = to_number(gold)
    if g is None:
        raise ValueError(f"gold answer {gold!r} is not a number")
    p = to_number(extract_answer(completion))
    return float(p is not None and p == g)


def _silence_math_verify_timeout_warning():
    """math-verify logs a warning when its timeouts are off; ours is on, so drop exactly that one."""
    class _Drop(logging.Filter):
        def filter(self, record):
            return "Timeout is disabled" not in record.getMessage()
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_Drop())


_silence_math_verify_timeout_warning()


def _as_latex(s: str) -> str:
    return s if ("\\boxed" in s or s.lstrip().startswith("$")) else "\\boxed{" + s + "}"


def math_reward(completion: str, gold: str) -> float:
    r"""1.0 when math-verify finds the extracted answer equivalent to the gold LaTeX, else 0.0.

    Both sides are wrapped in \boxed{} so that math-verify parses exactly the answer (not other
    LaTeX in the text); its own signal-based timeouts are off (see the module docstring)."""
    from math_verify import parse, verify
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    g = parse(_as_latex(gold), parsing_timeout=None)
    p = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    return float(bool(g) and bool(p) and verify(g, p, timeout_seconds=None))


def format_reward(completion: str) -> float:
    r"""1.0 when the completion states its answer in a complete \boxed{...}, else 0.0."""
    return float(last_boxed(completion) is not None)


# -----------------------------------------------------------------------------
# the guard

class RewardTimeout(BaseException):
    """Raised by the deadline timer; a BaseException so `except Exception` cannot swallow it."""


@dataclass
class RewardStats:
    """Counters over reward calls, for logging: failures score 0 and are counted here."""
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    last_error: str = ""
    seconds: float = field(default=0.0, repr=False)

    def as_dict(self) -> dict:
        return {"reward/calls": self.calls, "reward/errors": self.errors, "reward/timeouts": self.timeouts,
                "reward/seconds": round(self.seconds, 3)}


@contextmanager
def _deadline(seconds: float | None):
    """Raise RewardTimeout in this (main) thread after `seconds`; a no-op elsewhere."""
    usable = (seconds is not None and seconds > 0 and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield False
        return

    def on_alarm(signum, frame):
        raise RewardTimeout(f"reward exceeded {seconds} s")

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    t0 = time.monotonic()
    try:
        yield True
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:  # nested: an alarm landing just before the cancel must not skip the restore
            signal.signal(signal.SIGALRM, old_handler)
            if old_delay > 0:  # someone else's timer was running: put back what is left of it
                signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - t0), 1e-3), old_interval)


def guarded(fn: Callable[..., float], *args, stats: RewardStats | None = None,
            timeout_s: float | None = DEFAULT_TIMEOUT_S) -> float:
    """fn(*args) as a float; 0.0 (counted in stats) when it raises, overruns or is not finite."""
    stats = stats if stats is not None else RewardStats()
    stats.calls += 1
    t0 = time.monotonic()
    try:
        with _deadline(timeout_s) as interruptible:
            value = float(fn(*args))
        elapsed = time.monotonic() - t0
        if not interruptible and timeout_s is not None and timeout_s > 0 and elapsed > timeout_s:
            raise RewardTimeout(f"reward took {elapsed:.1f} s > {timeout_s} s")
        if not math.isfinite(value):
            raise ValueError(f"reward is not finite: {value}")
        return value
    except RewardTimeout:
        stats.timeouts += 1
        return 0.0
    except Exception as e:  # a reward must never crash the run: count it and score 0
        stats.errors += 1
        stats.last_error = f"{type(e).__name__}: {e}"[:500]
        return 0.0
    finally:
        stats.seconds += time.monotonic() - t0


def reward(example: Example, completion: str, stats: RewardStats | None = None, *,
           timeout_s: float | None = DEFAULT_TIMEOUT_S, format_weight: float = 0.0) -> float:
    """Correctness (0/1, guarded) plus format_weight · format_reward."""
    fn = gsm8k_reward if example.kind == "numeric" else math_reward
    r = guarded(fn, completion, example.answer, stats=stats, timeout_s=timeout_s)
    if format_weight:
        r += format_weight * format_reward(completion)
    return r


def rewards(examples: list[Example], completions: list[str], stats: RewardStats | None = None, **kw) -> list[float]:
    """reward() for aligned lists (repeat each example G times for G completions per prompt)."""
    if len(examples) != len(completions):
        raise ValueError(f"{len(examples)} examples but {len(completions)} completions")
    return [reward(e, c, stats, **kw) for e, c in zip(examples, completions)]


# -----------------------------------------------------------------------------
# lm-evaluation-harness GSM8K matchers (eval.py reports both)

# The gsm8k task's exact_match settings: these regexes are deleted from prediction and
# reference alike, then both are lower-cased and compared as strings.
_LMEVAL_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")


def _lmeval_norm(s: str) -> str:
    for pattern in _LMEVAL_IGNORE:
        s = re.sub(pattern, "", s)
    return s.lower()


def gsm8k_strict_extract(completion: str) -> str:
    """lm-eval "strict-match": the first `#### N`, or "[invalid]"."""
    found = re.findall(r"#### (\-?[0-9\.\,]+)", completion)
    return found[0].strip() if found else "[invalid]"


def gsm8k_flexible_extract(completion: str) -> str:
    """lm-eval "flexible-extract": the last number-like token, or "[invalid]"."""
    found = re.findall(r"(-?[$0-9.,]{2,})|(-?[0-9]+)", completion)
    if not found:
        return "[invalid]"
    return next(g for g in found[-1] if g).strip()


def gsm8k_strict_match(completion: str, gold: str) -> bool:
    """gold: the full GSM8K answer (with `#### N`) or just N."""
    return _lmeval_norm(gsm8k_strict_extract(completion)) == _lmeval_norm(gold)


def gsm8k_flexible_match(completion: str, gold: str) -> bool:
    return _lmeval_norm(gsm8k_flexible_extract(completion)) == _lmeval_norm(gold)


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
