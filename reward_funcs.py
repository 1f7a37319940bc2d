r"""Reward functions: the built-in correctness check and the user's own, weighted and summed.

    python train.py ... --reward correctness --reward my_rewards:brevity --reward-weights 1.0,0.2

A reward term is `correctness` (rewards.reward: the guarded check of the gold answer, numeric or
math-verify, plus --format-weight for a complete \boxed{}) or `module:function`, a function importable
from the current directory or the Python path, called the way TRL's GRPOTrainer calls its reward_funcs:

    fn(prompts=[...], completions=[...], completion_ids=[...], **columns) -> list[float | None]

with one entry per completion of the batch. prompts are the dataset's prompts (a string, or the list of
messages of a conversational dataset), completions the sampled texts (for a conversational prompt, a
list holding one assistant message), completion_ids their token ids, and every other column of the
dataset comes by its own name, one value per completion. A function gets the keywords it names (all
of them if it takes **kwargs). None is "no opinion": the term is left out of that completion's sum.
A completion's reward is Σ_i weight_i · r_i over the terms (--reward-weights, default all 1).

The guard. The built-in check scores 0, and counts, whatever goes wrong with a completion (rewards.py).
A user function is the user's code: its failure stops the run with one line that names it, rather than
train on zeros. That is an exception (and the file and line where it was raised), a call longer than
--reward-timeout, a result of the wrong length, or an entry that is neither a finite number nor None.
The deadline is rewards.deadline's SIGALRM timer in the main thread, which interrupts Python code; C
code that holds the GIL cannot be interrupted, and its overrun is reported when the call returns. A
function runs in the training process, not in a worker (it may hold a reward model on the GPU, and its
arguments need not be serializable). Functions are imported at parse time and their parameters checked
against the dataset's columns before the model loads (`check`).

Test: tests/test_reward_funcs.py; tests/test_train.py (a custom reward and a conversational dataset
through one training step).
"""
from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from numbers import Real
from typing import Callable

import rewards

BUILTIN = "correctness"
RESERVED = ("prompts", "completions", "completion_ids")   # the arguments every function may take
TIMEOUT_S = 120.0                                         # --reward-timeout's default: one call on a batch


class RewardError(Exception):
    """A user reward function failed: it raised, overran, or returned something that is not one
    finite number (or None) per completion. The message names the function; train.py stops on it."""


@dataclass(frozen=True)
class RewardFunc:
    """One term of the reward: spec as given to --reward, fn None for the built-in correctness check."""
    spec: str
    fn: Callable | None
    weight: float = 1.0

    @property
    def name(self) -> str:
        """The term's name in the metrics (rewards/<name>/mean), TRL's: the function's __name__."""
        return BUILTIN if self.fn is None else getattr(self.fn, "__name__", self.spec)


# ----------------------------------------------------------------------------------------------
# loading and checking (before any model loads)


def load(spec: str, weight: float = 1.0) -> RewardFunc:
    """'correctness' or 'module:function' -> RewardFunc; ValueError naming what is wrong with spec."""
    if spec == BUILTIN:
        return RewardFunc(spec, None, weight)
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"{spec!r}: want '{BUILTIN}' or 'module:function' (e.g. my_rewards:brevity)")
    if os.getcwd() not in sys.path:  # `python train.py` puts the script's directory there, not the user's
        sys.path.append(os.getcwd())
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise ValueError(f"{spec!r}: no module {module!r} in the current directory or on the Python path") from None
        raise ValueError(f"{spec!r}: importing {module} failed: {type(e).__name__}: {e}") from None
    except Exception as e:  # the user's module raised while importing
        raise ValueError(f"{spec!r}: importing {module} failed: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise ValueError(f"{spec!r}: {module} has no function {attr!r}")
    return RewardFunc(spec, obj, weight)


def _takes_all(fn: Callable) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def check(funcs: list[RewardFunc], examples: list) -> None:
    """Refuse, naming the function or column, what would fail on the first batch: a dataset column
    named like a reserved argument, a parameter no argument fills, correctness without gold answers."""
    columns = sorted(examples[0].columns) if examples else []
    clash = sorted(set(columns) & set(RESERVED))
    if clash:
        raise ValueError(f"the dataset has column(s) {clash}, the names of reward function arguments: rename them")
    for f in funcs:
        if f.fn is None:
            unanswered = sum(e.answer is None for e in examples)
            if unanswered:
                raise ValueError(f"the {BUILTIN} reward needs a gold answer, and {unanswered} of {len(examples)} "
                                 f"examples have none (columns: {columns}): pass --answer-column, or score with "
                                 f"--reward module:function only")
            continue
        try:
            params = inspect.signature(f.fn).parameters.values()
        except (TypeError, ValueError):
            continue  # a builtin without a signature: found out on the first call
        offered = {*RESERVED, *columns}
        needed = [p.name for p in params if p.default is p.empty and (p.kind is p.POSITIONAL_ONLY or (
            p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in offered))]
        if needed:
            raise ValueError(f"reward {f.spec} needs argument(s) {needed}, which it is not given: it gets "
                             f"{list(RESERVED)} and the dataset's columns {columns}, by keyword")


def parse_weights(text: str) -> list[float]:
    """--reward-weights: comma-separated finite numbers (an argparse type)."""
    import argparse
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want comma-separated numbers, e.g. 1.0,0.5") from None
    if not all(math.isfinite(w) for w in weights):
        raise argparse.ArgumentTypeError(f"{text!r}: every weight must be finite")
    return weights


# ----------------------------------------------------------------------------------------------
# scoring


def arguments(examples: list, completions: list[str], completion_ids: list | None) -> dict:
    """TRL's keyword arguments for a batch: prompts, completions (a message list for a conversation),
    completion_ids and every dataset column, each a list aligned with the completions."""
    keys = sorted({k for e in examples for k in e.columns})
    return {"prompts": [e.prompt for e in examples],
            "completions": [[{"role": "assistant", "content": c}] if e.messages else c
                            for e, c in zip(examples, completions)],
            "completion_ids": completion_ids, **{k: [e.columns.get(k) for e in examples] for k in keys}}


def call(f: RewardFunc, kwargs: dict, n: int, timeout_s: float | None) -> list[float | None]:
    """One user function on one batch of n completions, under the guard of the module docstring."""
    if not _takes_all(f.fn):
        names = inspect.signature(f.fn).parameters
        kwargs = {k: v for k, v in kwargs.items() if k in names}
    t0, timed_out = time.monotonic(), False
    try:
        with rewards.deadline(timeout_s):
            out = f.fn(**kwargs)
    except rewards.RewardTimeout:
        timed_out = True
    except Exception as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        raise RewardError(f"reward {f.spec} raised {type(e).__name__}: {e} (at {frame.filename}:{frame.lineno})") from None
    elapsed = time.monotonic() - t0
    if timed_out or (timeout_s is not None and elapsed > timeout_s):  # off the main thread: found on return
        raise RewardError(f"reward {f.spec} took more than --reward-timeout {timeout_s:g} s on {n} completions "
                          f"({elapsed:.1f} s)")
    try:
        values = list(out)
    except TypeError:
        raise RewardError(f"reward {f.spec} returned {type(out).__name__}, not a list of {n} numbers") from None
    if len(values) != n:
        raise RewardError(f"reward {f.spec} returned {len(values)} values for {n} completions (one each, or None)")
    for i, v in enumerate(values):
        v = v.item() if hasattr(v, "item") else v   # numpy / torch scalars
        if v is not None and not (isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v)):
            raise RewardError(f"reward {f.spec} returned {v!r} for completion {i}: want a finite number or None")
        values[i] = None if v is None else float(v)
    return values


def score(funcs: list[RewardFunc], examples: list, completions: list[str], stats=None, *, completion_ids=None,
          timeout_s: float | None = TIMEOUT_S, format_weight: float = 0.0) -> tuple[list[float], dict]:
    """The reward of each completion (examples aligned with completions: repeat a prompt's example G
    times) -> (Σ weight · term, {term name: its values, None where it had no opinion})."""
    totals, terms = [0.0] * len(completions), {}
    kwargs = None
    for f in funcs:
        if f.fn is None:  # looked up at call time: tests replace rewards.rewards
            values = rewards.rewards(examples, completions, stats, format_weight=format_weight)
        else:
            kwargs = kwargs or arguments(examples, completions, completion_ids)
            values = call(f, kwargs, len(completions), timeout_s)
        terms[f.name] = values
        for i, v in enumerate(values):
            if v is not None:
                totals[i] += f.weight * v
    return totals, terms
