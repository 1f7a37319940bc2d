r"""Rewards: answer extraction, the checkers, and the guard that keeps a reward from hurting the run.

The model is asked to put its final answer in \boxed{} (tasks.py's system prompt).
`extract_answer` takes the last complete \boxed{...} (nested braces allowed), else the last number
in the text; `reward(example, completion)` scores it with the example's checker.

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

Test: python -m pytest tests/test_rewards.py; self-check: python tasks.py ../shared/data/gsm8k test
"""
from __future__ import annotations

import logging
import math
import re
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

DEFAULT_TIMEOUT_S = 5.0

# A number: thousands-grouped (1,000.5) or plain (1000.5, .5), optionally negative.
NUMBER_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")


# -----------------------------------------------------------------------------
# answer extraction

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


def reward(example, completion: str, stats: RewardStats | None = None, *,
           timeout_s: float | None = DEFAULT_TIMEOUT_S, format_weight: float = 0.0) -> float:
    """Correctness (0/1, guarded) of a tasks.Example's completion, plus format_weight · format_reward."""
    fn = gsm8k_reward if example.kind == "numeric" else math_reward
    r = guarded(fn, completion, example.answer, stats=stats, timeout_s=timeout_s)
    if format_weight:
        r += format_weight * format_reward(completion)
    return r


def rewards(examples: list, completions: list[str], stats: RewardStats | None = None, **kw) -> list[float]:
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
