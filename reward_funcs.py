r"""Reward functions: the built-in correctness check and the user's own, weighted and summed.

    python train.py ... --reward correctness --reward my_rewards.py:brevity --reward-weights 1.0,0.2

A reward term is `correctness` (rewards.reward: the guarded check of the gold answer, numeric or
math-verify, plus --format-weight for a complete \boxed{}) or a function of the user's, named as

    path/to/file.py:function     a file, found where the path says (relative to the current directory)
    package.module:function      a module on the Python path (PYTHONPATH, installed packages)

Nothing else is searched: the current directory is not added to the Python path, so a module that
merely sits where train.py is started (say, inside a run directory) is never imported by accident.
From Python (flags.config's reward=), a function itself may stand in a spec's place (`spec_of`): one
defined at the top level of a file, a script's included, is named by its file and runs in a worker like
any spec (a script must then keep its training under `if __name__ == "__main__":`, as multiprocessing
asks too, since the worker imports it; train.train refuses to start inside a worker). Anything a worker
cannot import by name (a lambda, a closure, a bound method, a callable object) runs in this process
(`InProcess`, recorded as "python:<module>.<qualname>"), with a note: the same checks of what it
returns, but an exception is all it can be stopped by (no timeout kill, and a crash ends the run).
The function is called the way TRL's GRPOTrainer calls its reward_funcs:

    fn(prompts=[...], completions=[...], completion_ids=[...], **columns) -> list[float | None]

with one entry per completion of the batch. prompts are the dataset's prompts (a string, or the list of
messages of a conversational dataset), completions the sampled texts (for a conversational prompt, a
list holding one assistant message), completion_ids their token ids, and every other column of the
dataset comes by its own name, one value per completion. A function gets the keywords it names (all
of them if it takes **kwargs). None is "no opinion": the term is left out of that completion's sum.
A completion's reward is Σ_i weight_i · r_i over the terms (--reward-weights, default all 1).

The worker. Each user function runs in a process of its own (reward_worker.py: what a process
boundary buys, and what it costs), started when the spec is loaded and kept for the run (`_WORKERS`).

The guard. The built-in check scores 0, and counts, whatever goes wrong with a completion (rewards.py).
A user function is the user's code: its failure stops the run with one line that names it, rather than
train on zeros. That is an exception (and the file and line where it was raised), an exit or crash of
its worker, a call longer than --reward-timeout, a result that is not a list (or tuple, or 1-D array)
of one entry per completion, or an entry that is neither a finite number within ±MAX_ABS_REWARD nor
None. Functions are loaded at parse time and their parameters checked against the dataset's columns
before the model loads (`check`). Over a run, `RewardWatch` says on screen when a term has returned
None for every completion, or every completion got the same reward, for many steps in a row: the
policy learns nothing then, and nothing else would say so.

Provenance. `record` gives, for each user function, the file that holds it and that file's sha256,
computed without running it; a resumed run compares them with `source_changes` before importing
anything, so a spec that now resolves to another file (another directory, another PYTHONPATH) or to
an edited one is refused. A file inside a run directory (any directory up the tree holding a
run_config.json) is never loaded: a run directory is data, and anyone may have written it.

Test: tests/test_reward_funcs.py; tests/test_probes.py (hostile reward functions and run directories);
tests/test_train.py (a custom reward and a conversational dataset through one training step).
"""
from __future__ import annotations

import atexit
import hashlib
import importlib.machinery
import inspect
import math
import os
import sys
import time
from dataclasses import dataclass, field

import rewards
from reward_worker import RewardError, Worker, as_reply, fitted, parameters, search_path, what_raised  # noqa: F401 (RewardError: this module's too)

BUILTIN = "correctness"
RESERVED = ("prompts", "completions", "completion_ids")   # the arguments every function may take
TIMEOUT_S = 120.0        # --reward-timeout's default: one call on a batch; also a module's import
# The largest |reward| taken. Advantages are computed in float32, whose spacing at 1e6 is 1/16: past
# it two rewards 0.1 apart may become equal, and a group's spread is lost. Real rewards are O(1) to
# O(100); a value past 1e6 is a sentinel (-1e9 for "invalid"), a float max or an unscaled count.
MAX_ABS_REWARD = 1e6
PATIENCE = 5             # RewardWatch: steps in a row without signal before it says so
IN_PROCESS = "python:"   # the label's start of a function that runs in this process (InProcess)


@dataclass(frozen=True)
class Source:
    """Where a user function's code is: the file (absolute), its sha256, and how to import it."""
    spec: str
    module: str | None     # dotted module name on the Python path; None for a file spec
    file: str
    attr: str              # the function (a dotted attribute path inside the module)
    sha256: str


@dataclass(frozen=True, eq=False)
class InProcess:
    """A Python reward function that no worker can import by name (a lambda, a closure, a bound method,
    a callable object): it runs in this process. `label` is what run_config.json records of it."""
    fn: object

    @property
    def label(self) -> str:
        qual = getattr(self.fn, "__qualname__", type(self.fn).__qualname__)
        return f"{IN_PROCESS}{getattr(self.fn, '__module__', None) or '?'}.{qual}"

    def __str__(self) -> str:
        return self.label


@dataclass(frozen=True)
class RewardFunc:
    """One term of the reward: the built-in correctness check (spec BUILTIN), a function in its worker
    (source: where its code is) or one in this process (fn). name is the term's name in the metrics
    (rewards/<name>/mean), TRL's: the function's __name__; params the function's (name, kind, has a
    default) as inspect.signature saw them (None: it has none)."""
    spec: str
    weight: float = 1.0
    source: Source | None = None
    name: str = BUILTIN
    params: tuple | None = None
    fn: object = field(default=None, compare=False)


# ----------------------------------------------------------------------------------------------
# finding a function's file, without running any of it


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _module_file(module: str, spec: str) -> str:
    """The file of a dotted module name, found by the import system's finders (sys.meta_path over
    search_path()) one package at a time, without executing any package's __init__."""
    search, parts, found = None, module.split("."), None
    for i in range(len(parts)):
        name = ".".join(parts[:i + 1])
        for finder in sys.meta_path:   # a top-level name: PathFinder looks in search_path(), not in ''
            path = search_path() if search is None and finder is importlib.machinery.PathFinder else search
            found = finder.find_spec(name, path) if hasattr(finder, "find_spec") else None
            if found is not None:
                break
        if found is None:
            where = "the Python path" if i == 0 else f"package {'.'.join(parts[:i])}"
            raise ValueError(f"{spec!r}: no module {name!r} on {where} (the current directory is not searched: "
                             f"name a file, e.g. ./{parts[-1]}.py:function, or add its directory to PYTHONPATH)")
        if i < len(parts) - 1:
            search = found.submodule_search_locations
            if not search:
                raise ValueError(f"{spec!r}: {name} is a module, not a package holding {parts[i + 1]!r}")
    if not found.has_location or not found.origin or not os.path.isfile(found.origin):
        raise ValueError(f"{spec!r}: {module} is not a file of its own (built into Python, or a directory "
                         f"without __init__.py)")
    return found.origin


def _run_dir_above(path: str) -> str | None:
    """The nearest directory holding path (or above it) that holds a run_config.json: a run directory."""
    from run_dir import RUN_CONFIG   # here, not at the top: a worker never imports run_dir (nor torch)
    d = os.path.dirname(path)
    while True:
        if os.path.isfile(os.path.join(d, RUN_CONFIG)):
            return d
        if os.path.dirname(d) == d:
            return None
        d = os.path.dirname(d)


def resolve(spec: str) -> Source:
    """The Source of a 'module:function' or 'file.py:function' spec; ValueError naming what is wrong."""
    if spec.startswith(IN_PROCESS):
        raise ValueError(f"{spec!r} is a Python function that ran in the process that started the run "
                         f"(flags.config's reward=): resume the run from Python, with the same function")
    target, _, attr = spec.rpartition(":")
    if not target or not attr or not all(p.isidentifier() for p in attr.split(".")):
        raise ValueError(f"{spec!r}: want '{BUILTIN}', 'module:function' (e.g. my_rewards:brevity) or "
                         f"'path/to/file.py:function'")
    if target.endswith(".py") or os.sep in target:
        module, file = None, os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(file):
            raise ValueError(f"{spec!r}: no file {file}")
    elif all(p.isidentifier() for p in target.split(".")):
        module, file = target, os.path.abspath(_module_file(target, spec))
    else:
        raise ValueError(f"{spec!r}: {target!r} is neither a module name nor a .py file")
    run = _run_dir_above(os.path.realpath(file))
    if run is not None:
        raise ValueError(f"{spec!r}: {file} is inside {run}, a run directory (it holds a run_config.json): "
                         f"code is never loaded from a run directory, which anyone may have written; keep "
                         f"reward functions elsewhere")
    return Source(spec, module, file, attr, _sha256(file))


def spec_of(fn) -> str | InProcess:
    """A Python reward function as a --reward term. One defined at the top level of a module's file (a
    script's too) is named by it, 'package.module:name' where that name resolves to the same file, else
    'path/file.py:name': it runs in its worker, as any spec does. Anything a worker cannot import by name
    (a lambda, a closure, a bound method, a callable object, a function typed into the REPL) is InProcess."""
    qual = getattr(fn, "__qualname__", "")
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    file = getattr(module, "__file__", None)
    if not (inspect.isfunction(fn) and qual.isidentifier() and file and getattr(module, qual, None) is fn):
        return InProcess(fn)
    if fn.__module__ != "__main__":
        try:
            if resolve(f"{fn.__module__}:{qual}").file == os.path.abspath(file):
                return f"{fn.__module__}:{qual}"
        except ValueError:   # not importable by that name from the Python path: by its file
            pass
    return f"{os.path.abspath(file)}:{qual}"


def record(funcs: list[RewardFunc]) -> list[dict]:
    """What run_config.json keeps of the user functions: [{spec, file, sha256}] (the built-in has none)."""
    return [{"spec": f.source.spec, "file": f.source.file, "sha256": f.source.sha256} for f in funcs if f.source]


def source_changes(recorded: list[dict]) -> list[str]:
    """For a resumed run: why each recorded function (record's rows) no longer resolves to the file the
    run used, unchanged; [] when all do. Nothing is imported."""
    problems = []
    for row in recorded:
        spec = row.get("spec") if isinstance(row, dict) else None
        if not isinstance(spec, str) or not {"file", "sha256"} <= set(row):
            problems.append(f"a recorded reward source {row!r} is not a {{spec, file, sha256}} record")
            continue
        try:
            now = resolve(spec)
        except ValueError as e:
            problems.append(str(e))
            continue
        if now.file != row["file"]:
            problems.append(f"--reward {spec} resolves to {now.file}, not to {row['file']}, the file the run used")
        elif now.sha256 != row["sha256"]:
            problems.append(f"--reward {spec}: {now.file} has changed since the run started (sha256 {now.sha256[:12]}, "
                            f"recorded {row['sha256'][:12]})")
    return problems


# ----------------------------------------------------------------------------------------------
# the workers


_WORKERS: dict[tuple, Worker] = {}   # (file, sha256) -> its worker: flags.py and run_data.py share one


def _worker(source: Source, timeout_s: float) -> Worker:
    key = (source.file, source.sha256)
    if key not in _WORKERS or not _WORKERS[key].usable():
        _WORKERS[key] = Worker(source.spec, source.module, source.file, timeout_s)
    return _WORKERS[key]


@atexit.register
def close_workers() -> None:
    """End every worker (at exit; also for a test that wants a fresh import)."""
    for w in _WORKERS.values():
        w.close()
    _WORKERS.clear()


# ----------------------------------------------------------------------------------------------
# loading and checking (before any model loads)


_NOTED = set()   # labels of the InProcess functions whose note has been printed


def _in_process(f: InProcess, weight: float) -> RewardFunc:
    if f.label not in _NOTED:
        _NOTED.add(f.label)
        print(f"note: reward {f.label} runs in this process (a worker cannot import it by name): what it returns is "
              f"checked, but --reward-timeout cannot stop it and a crash ends the run; define it at the top level of "
              f"a file to run it in a worker", file=sys.stderr)
    params = parameters(f.fn)
    params = params and tuple(map(tuple, params))
    name = getattr(f.fn, "__name__", type(f.fn).__name__)
    return RewardFunc(f.label, weight, None, name, params, f.fn)


def load(spec, weight: float = 1.0, timeout_s: float = TIMEOUT_S) -> RewardFunc:
    """'correctness', a function spec or an InProcess function -> RewardFunc, a spec's worker started (its
    module imported there); ValueError naming what is wrong with spec, or with its import."""
    if isinstance(spec, InProcess):
        return _in_process(spec, weight)
    if spec == BUILTIN:
        return RewardFunc(spec, weight)
    source = resolve(spec)
    name, params = _worker(source, timeout_s).describe(source.attr, timeout_s, spec)
    return RewardFunc(spec, weight, source, name, params)


def check(funcs: list[RewardFunc], examples: list) -> None:
    """Refuse, naming the function or column, what would fail on the first batch: a dataset column
    named like a reserved argument, a parameter no argument fills, correctness without gold answers."""
    columns = sorted(examples[0].columns) if examples else []
    clash = sorted(set(columns) & set(RESERVED))
    if clash:
        raise ValueError(f"the dataset has column(s) {clash}, the names of reward function arguments: rename them")
    for f in funcs:
        if f.spec == BUILTIN:
            unanswered = sum(e.answer is None for e in examples)
            if unanswered:
                raise ValueError(f"the {BUILTIN} reward needs a gold answer, and {unanswered} of {len(examples)} "
                                 f"examples have none (columns: {columns}): pass --answer-column, or score with "
                                 f"--reward module:function only")
            continue
        offered = {*RESERVED, *columns}
        needed = [name for name, kind, has_default in f.params or () if not has_default and (
            kind == "POSITIONAL_ONLY" or (kind in ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY") and name not in offered))]
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
    """One user function on one batch of n completions, in its worker (or, InProcess, here), under the
    guard of the module docstring: its values, or a RewardError naming it."""
    if f.fn is not None:
        reply = _call_here(f, kwargs, n, timeout_s)
    else:
        worker = _worker(f.source, TIMEOUT_S if timeout_s is None else timeout_s)
        reply = worker.call(f.source.attr, kwargs, n, timeout_s, f.spec)
    if "error" in reply:
        raise RewardError(f"reward {f.spec} {reply['error']}")
    if "container" in reply:
        raise RewardError(f"reward {f.spec} returned {reply['container']}, not a list of {n} numbers")
    if "length" in reply:
        raise RewardError(f"reward {f.spec} returned {reply['length']} values for {n} completions (one each, or None)")
    values = reply["values"]
    for i, v in enumerate(values):
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v)):
            shown = v["bad"] if isinstance(v, dict) else repr(v)
            raise RewardError(f"reward {f.spec} returned {shown} for completion {i}: want a finite number or None")
        if v is not None and abs(v) > MAX_ABS_REWARD:
            raise RewardError(f"reward {f.spec} returned {v:g} for completion {i}: past ±{MAX_ABS_REWARD:g}, the "
                              f"largest reward taken (float32 advantages lose the spread of larger ones); scale it down")
    return values


def _call_here(f: RewardFunc, kwargs: dict, n: int, timeout_s: float | None) -> dict:
    """An InProcess function on one batch, its reply as a worker's would be (_reply); past timeout_s once
    it returns, an error: nothing here can stop it sooner."""
    t0 = time.monotonic()
    try:
        out = f.fn(**fitted(kwargs, f.params))
    except SystemExit as e:
        return {"error": f"called {what_raised(e)}: a reward function must return its values, not exit"}
    except Exception as e:
        return {"error": f"raised {what_raised(e)}"}
    took = time.monotonic() - t0
    if timeout_s is not None and took > timeout_s:
        return {"error": f"took {took:.1f} s on {n} completions, past --reward-timeout {timeout_s:g} s"}
    return as_reply(out, n)


def score(funcs: list[RewardFunc], examples: list, completions: list[str], stats=None, *, completion_ids=None,
          timeout_s: float | None = TIMEOUT_S, format_weight: float = 0.0) -> tuple[list[float], dict]:
    """The reward of each completion (examples aligned with completions: repeat a prompt's example G
    times) -> (Σ weight · term, {term name: its values, None where it had no opinion})."""
    totals, terms = [0.0] * len(completions), {}
    kwargs = None
    for f in funcs:
        if f.spec == BUILTIN:  # looked up at call time: tests replace rewards.rewards
            values = rewards.rewards(examples, completions, stats, format_weight=format_weight)
        else:
            kwargs = kwargs or arguments(examples, completions, completion_ids)
            values = call(f, kwargs, len(completions), timeout_s)
        terms[f.name] = values
        for i, v in enumerate(values):
            if v is not None:
                totals[i] += f.weight * v
    worst = max(range(len(totals)), key=lambda i: abs(totals[i]), default=None)
    if worst is not None and not abs(totals[worst]) <= MAX_ABS_REWARD:
        raise RewardError(f"the weighted reward of completion {worst} is {totals[worst]:g}, past ±{MAX_ABS_REWARD:g} "
                          f"(terms {({k: v[worst] for k, v in terms.items()})}, weights "
                          f"{[f.weight for f in funcs]}): lower the weights")
    return totals, terms


# ----------------------------------------------------------------------------------------------
# a run's rewards over many steps


class RewardWatch:
    """Says when the rewards carry no signal for `patience` steps in a row (and again every 10·patience):
    a term that returned None for every completion (it has no opinion on anything the policy writes),
    or every completion of the step got the same total (every advantage is zero: nothing is learned).
    Each step, train.py calls update(step, totals, terms) with score's results for the whole step and
    prints the lines it returns."""

    def __init__(self, patience: int = PATIENCE, tol: float = 1e-6):
        self.patience, self.tol, self.streaks = patience, tol, {}

    def _streak(self, key, flat: bool) -> int:
        self.streaks[key] = self.streaks.get(key, 0) + 1 if flat else 0
        k = self.streaks[key]
        return k if k == self.patience or (k and k % (10 * self.patience) == 0) else 0

    def update(self, step: int, totals: list[float], terms: dict) -> list[str]:
        """Warnings (lines) for this step; [] when there is nothing to say."""
        lines = []
        for name, values in terms.items():
            if k := self._streak(("none", name), all(v is None for v in values)):
                lines.append(f"warning: step {step}: reward {name} returned None for every completion of the last "
                             f"{k} steps, so it adds nothing: check that it recognises what the policy writes")
        flat = bool(totals) and max(totals) - min(totals) <= self.tol * max(1.0, abs(max(totals)))
        if k := self._streak("equal", flat):
            lines.append(f"warning: step {step}: every completion of the last {k} steps got the same reward "
                         f"({totals[0]:g}): the advantages are zero and the policy learns nothing; check the reward "
                         f"terms (rewards/<term>/mean in metrics.jsonl)")
        return lines
