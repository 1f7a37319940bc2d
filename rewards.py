r"""Rewards: answer extraction, the checkers, and the guard that keeps a reward from hurting the run.

The model is asked to put its final answer in \boxed{} (tasks.py's system prompt).
`extract_answer` takes the last complete \boxed{...} (nested braces allowed), else the last number
in the text; `reward(example, completion)` scores it with the example's checker.

Checkers. Numeric tasks (GSM8K, addition) compare numbers exactly after dropping thousands
commas, `$`, `%` and a trailing period, so `1,000` == 1000 and `$18.00` == 18 (Fractions, not
floats). MATH answers are LaTeX with many spellings of one value (\frac12, 0.5, \dfrac{1}{2};
\left( 3, \frac{\pi}{2} \right); intervals, sets, matrices, 10\%): string matching undercounts
badly, so `math_equal` uses math-verify, HuggingFace's checker (used by lighteval and open-r1),
which parses LaTeX into sympy (through latex2sympy2_extended) and tests equivalence, gold first:
verify(parse(gold), parse(pred)). That is why math-verify is a dependency. Scoring the gold
solutions against their own gold answers gives 100% on GSM8K test and on MATH500 here.

The guard. A completion is text the policy wrote, so a reward must neither crash the run nor stall
it, whichever thread calls it. `reward` scores 0, and counts in a `RewardStats`, a call that raises,
overruns or is refused, in three layers:

  1. Limits before any parsing, each a linear scan: the completion's length, the extracted answer's
     length and bracket nesting, and the big-integer work a short answer can ask for (1e999999999,
     2^{99999999}, a power tower 2^2^2^..., 100000!): CPython does that arithmetic in C holding the
     GIL, where no timer and no other thread can stop it. Finding the last \boxed{ is one pass
     (a stack matches every brace), not a rescan per candidate.
  2. math-verify (sympy) runs in a worker process (`MathWorker`: one per process, started on the
     first MATH answer; a request and a reply over a private pipe pair (`Child`, which
     reward_funcs.py's workers for the user's reward functions use too), a small cost beside
     math-verify's own).
     A call past its deadline is ended by killing the worker, which works from any thread and stops
     C code too; a spare worker, kept started after the first kill, takes over at once. A process
     per call would pay sympy's import (hundreds of ms) each time; the persistent one costs what
     math-verify costs in-process.
  3. The numeric checker is bounded by the limits of (1) and runs in-process; `guarded` adds a
     deadline of its own for any function: a SIGALRM timer in the main thread (the exception derives
     from BaseException so that no `except Exception` inside a reward can swallow it), and off it an
     overrun is scored 0 once it returns.

Time per step: a call gets DEFAULT_TIMEOUT_S (an order of magnitude above the slowest MATH500 gold
check), and a `RewardStats` (one per training step) carries a budget: once its calls have spent
STEP_BUDGET_S, each further call gets MIN_TIMEOUT_S. The limits refuse the known pathological inputs at the cost of
one linear scan, so only inputs they do not foresee reach a deadline, and a step full of those costs
at most the budget plus MIN_TIMEOUT_S each (tests/test_rewards.py times both).

For eval.py there are also lm-evaluation-harness's GSM8K matchers: "strict" (the first
`#### N`) and "flexible" (the last number), with its exact-match normalisation.

Test: python -m pytest tests/test_rewards.py; self-check: python tasks.py tests/data/gsm8k test
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

DEFAULT_TIMEOUT_S = 2.0          # one reward call
STEP_BUDGET_S = 4.0              # reward seconds of one RewardStats before calls get MIN_TIMEOUT_S
MIN_TIMEOUT_S = 0.25
WORKER_START_TIMEOUT_S = 60.0    # the math-verify worker's start (an import of sympy)
MAX_COMPLETION_CHARS = 400_000   # ~100k tokens, past any --max-new-tokens: longer is refused
MAX_ANSWER_CHARS = 300           # the extracted answer (MATH500's longest gold answer: 53)
MAX_NESTING = 10                 # brackets { ( [ open at once in an answer (MATH500's gold: 2)
MAX_EXPONENT = 1_000             # 1e1000, 2^{1000}: a thousand digits at most
MAX_FACTORIAL = 1_000            # n! for n up to this

# A number: thousands-grouped (1,000.5) or plain (1000.5, .5), optionally negative.
NUMBER_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")
BOXED_RE = re.compile(r"\\(?:boxed|fbox)\b( *)")
BRACE_RE = re.compile(r"[{}]")
WORD_RE = re.compile(r"[^\s$]+")
SCI_EXPONENT_RE = re.compile(r"\d\s*[eE]\s*[-+]?\s*(\d+)")


# -----------------------------------------------------------------------------
# answer extraction

def matching_braces(text: str) -> dict[int, int]:
    """{index of "{": index of its "}"} for every brace that closes, in one pass (a stack)."""
    close, stack = {}, []
    for m in BRACE_RE.finditer(text):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:  # a "}" with nothing open is prose: skipped
            close[stack.pop()] = m.start()
    return close


def last_boxed(text: str) -> str | None:
    r"""Content of the last complete \boxed{...} or \fbox{...} (nested braces), or `\boxed 5`.
    One pass over the text: a \boxed{ that never closes (cut off) falls back to an earlier one."""
    boxes = list(BOXED_RE.finditer(text))
    close = matching_braces(text) if boxes else {}
    for m in reversed(boxes):
        i = m.end()
        if i < len(text) and text[i] == "{":
            if i in close:
                return text[i + 1:close[i]]
            continue                          # unbalanced (e.g. cut off): try an earlier one
        word = WORD_RE.match(text, i)
        if word and m.group(1):               # "\boxed 5": the next word (space required)
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
    "18 apples" -> 18 (the last number of non-numeric text); None when there is no number, and
    for an exponent past MAX_EXPONENT (1e999999999 would be a billion-digit integer)."""
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
    if any(len(e) > 5 or int(e) > MAX_EXPONENT for e in SCI_EXPONENT_RE.findall(t)):
        return None
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        pass
    nums = NUMBER_RE.findall(t)
    return Fraction(nums[-1].replace(",", "")) if nums else None


# -----------------------------------------------------------------------------
# limits: refuse, before parsing, what could take unbounded time

class Refused(ValueError):
    """An input past a limit: scored 0 and counted as an error, never parsed."""


def _literal_bound(expr: str) -> int:
    """An upper bound on the value of an exponent built from its integer literals with + - · /:
    the product of max(2, n) over them (digit runs longer than 6 count as past any limit)."""
    bound = 1
    for run in re.findall(r"\d+", expr):
        if len(run) > 6:
            return 10 ** 7
        bound *= max(2, int(run))
        if bound > 10 ** 7:
            break
    return bound


def check_completion(text: str) -> None:
    if len(text) > MAX_COMPLETION_CHARS:
        raise Refused(f"completion of {len(text)} characters > MAX_COMPLETION_CHARS={MAX_COMPLETION_CHARS}")


def check_answer(ans: str, kind: str = "math") -> None:
    r"""Refuse an extracted answer whose checking could take unbounded time: longer than
    MAX_ANSWER_CHARS (to_number's regexes backtrack on long digit runs); for MATH answers (sympy
    evaluates them) also brackets nested deeper than MAX_NESTING, a power tower (2^2^2, 9^{9^9}), an
    exponent (2^{...}, 1e...) past MAX_EXPONENT, a factorial past MAX_FACTORIAL or of a bracket.
    A numeric answer is only ever read as a Fraction, whose exponent to_number bounds itself."""
    if len(ans) > MAX_ANSWER_CHARS:
        raise Refused(f"answer of {len(ans)} characters > MAX_ANSWER_CHARS={MAX_ANSWER_CHARS}")
    if kind == "numeric":
        return
    depth = deepest = 0
    for ch in ans:
        depth += (ch in "{([") - (ch in "})]")
        deepest = max(deepest, depth)
    if deepest > MAX_NESTING:
        raise Refused(f"answer nests brackets {deepest} deep > MAX_NESTING={MAX_NESTING}")
    if any(len(e) > 5 or int(e) > MAX_EXPONENT for e in SCI_EXPONENT_RE.findall(ans)):
        raise Refused(f"answer has a scientific exponent > MAX_EXPONENT={MAX_EXPONENT}")
    close = matching_braces(ans)
    for m in re.finditer(r"\^\s*", ans):
        i = m.end()
        if i < len(ans) and ans[i] == "{":      # ^{...}: the group
            end = close.get(i, len(ans) - 1) + 1
        else:                                    # ^2, ^x, ^\pi: one character or one command
            word = re.match(r"\\[a-zA-Z]+|.", ans[i:i + 64], re.S)
            end = i + (len(word.group(0)) if word else 0)
        exponent = ans[i:end]
        if "^" in exponent or ans[end:].lstrip().startswith("^"):
            raise Refused("answer has a power tower (an exponent raised to a power)")
        if _literal_bound(exponent) > MAX_EXPONENT:
            raise Refused(f"answer has an exponent {exponent[:40]!r} that may exceed MAX_EXPONENT={MAX_EXPONENT}")
    for m in re.finditer(r"(?<!\\)!", ans):
        before = ans[:m.start()].rstrip()
        digits = re.search(r"\d+$", before[-8:])
        if digits and (len(digits.group(0)) > 6 or int(digits.group(0)) > MAX_FACTORIAL):
            raise Refused(f"answer has a factorial past MAX_FACTORIAL={MAX_FACTORIAL}")
        if before.endswith((")", "}", "]")):
            raise Refused("answer has a factorial of a bracketed expression")


# -----------------------------------------------------------------------------
# checkers (unguarded: call them through `reward`, which guards them)

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


def math_equal(pred: str, gold: str) -> bool:
    r"""math-verify's verdict on an extracted answer against the gold LaTeX. Both sides are wrapped
    in \boxed{} so that math-verify parses exactly the answer; its own signal-based timeouts are off
    (they raise off the main thread, and an inner alarm would cancel an outer one)."""
    from math_verify import parse, verify
    g = parse(_as_latex(gold), parsing_timeout=None)
    p = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    return bool(g) and bool(p) and bool(verify(g, p, timeout_seconds=None))


def math_reward(completion: str, gold: str) -> float:
    """1.0 when math-verify finds the extracted answer equivalent to the gold LaTeX, else 0.0.
    In this process, with no limits and no deadline: `reward` is the guarded way."""
    pred = extract_answer(completion)
    return 0.0 if pred is None else float(math_equal(pred, gold))


def format_reward(completion: str) -> float:
    r"""1.0 when the completion states its answer in a complete \boxed{...}, else 0.0."""
    return float(last_boxed(completion) is not None)


# -----------------------------------------------------------------------------
# the math-verify worker process

class Child:
    """A Python child process (`python -c code`) spoken to over a private pipe pair: requests go in on
    one pipe, replies come back one line each on another, so its stdout and stderr stay free for what
    the code prints (ours, or /dev/null when quiet); its stdin is /dev/null. The code finds its ends of
    the pipes with `child_pipes()`. Writes and reads take a deadline and never block past it."""

    def __init__(self, code: str, argv: tuple = (), quiet: bool = True):
        req_r, self.req = os.pipe()
        self.rep, rep_w = os.pipe()
        sink = subprocess.DEVNULL if quiet else None
        # close_fds (the default) keeps the run directory's lock and every other descriptor out of it
        self.proc = _from_lasting_thread(lambda: subprocess.Popen(
            [sys.executable, "-c", code, str(req_r), str(rep_w), *argv],
            stdin=subprocess.DEVNULL, stdout=sink, stderr=sink, pass_fds=(req_r, rep_w)))
        os.close(req_r)
        os.close(rep_w)
        os.set_blocking(self.req, False)
        self.pid, self.ready, self.buf, self.closed = os.getpid(), False, b"", False

    def usable(self) -> bool:  # not after a fork (the pipes are the parent's), not once it died
        return self.pid == os.getpid() and not self.closed and self.proc.poll() is None

    def send(self, data: bytes, deadline: float) -> bool:
        """Write all of data; False at the deadline or if the child is gone (it stopped reading)."""
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [self.req], [], None if math.isinf(left) else left)[1]:
                return False
            try:
                view = view[os.write(self.req, view[:1 << 16]):]
            except BlockingIOError:  # writable, yet full again: wait once more
                continue
            except BrokenPipeError:
                self.closed = True
                return False
        return True

    def read_line(self, deadline: float) -> bytes | None:
        """One line, or None at the deadline (math.inf: none) or if the child ended (then closed is set)."""
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.rep], [], [], None if math.isinf(left) else left)[0]:
                return None
            chunk = os.read(self.rep, 1 << 16)
            if not chunk:  # the child closed its end: it ended (a moment before the OS reaps it)
                self.closed = True
                return None
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def exit_status(self, wait_s: float = 1.0) -> str:
        """How the child ended, in words ('exit status 0', 'signal SIGKILL'), after up to wait_s for it."""
        try:
            code = self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"

    def kill(self):
        if self.pid == os.getpid():
            self.proc.kill()
            self.proc.wait()
            for fd in (self.req, self.rep):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.req = self.rep = -1


_starter: tuple[int, queue.SimpleQueue] | None = None   # (the process it belongs to, its jobs)
_starter_lock = threading.Lock()


def _from_lasting_thread(start: Callable):
    """start() run on one daemon thread that lasts as long as the process. A child asks to die with
    its parent (`child_pipes`), and Linux means by that the thread that started it (prctl(2),
    PR_SET_PDEATHSIG): a child started from a caller's short-lived thread would be killed when that
    thread ends, mid-call or between calls. A forked process starts a thread of its own."""
    global _starter
    with _starter_lock:
        if _starter is None or _starter[0] != os.getpid():
            jobs = queue.SimpleQueue()
            threading.Thread(target=_start_jobs, args=(jobs,), name="qerl-child-starter", daemon=True).start()
            _starter = (os.getpid(), jobs)
        jobs = _starter[1]
    done = Future()
    jobs.put((start, done))
    return done.result()


def _start_jobs(jobs):
    while True:
        start, done = jobs.get()
        try:
            done.set_result(start())
        except BaseException as e:   # the caller's: raised in its thread by done.result()
            done.set_exception(e)


def child_pipes():
    """In a Child's code: (requests, replies) as binary files, after the process is set to die with its
    parent even mid-computation (Linux) and to leave Ctrl-C to the parent, which stops it."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return os.fdopen(int(sys.argv[1]), "rb"), os.fdopen(int(sys.argv[2]), "wb", buffering=0)


class MathWorker:
    """math_equal in a child process, from any thread: one request at a time (a lock), a reply
    within the deadline or the child is killed (SIGKILL: C code stops too). After the first kill a
    spare child is kept started, so a run of overruns does not wait ~0.3 s for each replacement."""

    def __init__(self):
        self._lock = threading.Lock()
        self._child = self._spare = None
        atexit.register(self.close)

    def call(self, pred: str, gold: str, timeout_s: float | None) -> bool:
        """math_equal(pred, gold) in the worker; RewardTimeout past timeout_s (None: no deadline;
        the worker's start is not counted)."""
        with self._lock:
            if self._child is None or not self._child.usable():
                spare, self._spare = self._spare, None
                self._child = spare if spare is not None and spare.usable() else _math_child()
            child = self._child
            if not child.ready:
                if child.read_line(time.monotonic() + WORKER_START_TIMEOUT_S) != b"ready":
                    self.close()
                    raise RuntimeError("the math-verify worker did not start (is math-verify installed?)")
                child.ready = True
            deadline = time.monotonic() + (math.inf if timeout_s is None else timeout_s)
            try:
                sent = child.send(json.dumps([pred, gold]).encode() + b"\n", deadline)
                line = child.read_line(deadline) if sent else None
            except BaseException:  # a caller's alarm or an interrupt mid-call: the reply would be stale
                self._replace()
                raise
            if line is None:
                dead = not child.usable()
                self._replace()
                if dead:
                    raise RuntimeError("the math-verify worker died (out of memory?)")
                raise RewardTimeout(f"math-verify exceeded {timeout_s} s")
            reply = json.loads(line)
            if "error" in reply:
                raise ValueError(reply["error"])
            return reply["equal"]

    def _replace(self):
        """Kill the child; the spare takes its place and a new spare starts (its import overlaps)."""
        self._child.kill()
        self._child, self._spare = self._spare, _math_child()

    def close(self):
        for c in (self._child, self._spare):
            if c is not None:
                c.kill()
        self._child = self._spare = None


def _math_child() -> Child:
    return Child(f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                 f"import rewards; rewards._serve()")


def _serve():
    """The worker's loop: a JSON [pred, gold] per line in, {"equal": bool} or {"error": str} out."""
    requests, out = child_pipes()
    math_equal("1", "1")  # the slow import and math-verify's first-call set-up, before "ready"
    out.write(b"ready\n")
    for line in requests:
        try:
            reply = {"equal": math_equal(*json.loads(line))}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"[:500]}
        out.write(json.dumps(reply).encode() + b"\n")


MATH_WORKER = MathWorker()


# -----------------------------------------------------------------------------
# the guard

class RewardTimeout(BaseException):
    """Raised by the deadline timer; a BaseException so `except Exception` cannot swallow it."""


@dataclass
class RewardStats:
    """Counters over reward calls, for logging: failures score 0 and are counted here. budget_s: the
    seconds these calls may spend before each further math-verify call gets only MIN_TIMEOUT_S."""
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    last_error: str = ""
    seconds: float = field(default=0.0, repr=False)
    budget_s: float | None = field(default=STEP_BUDGET_S, repr=False)

    def timeout(self, timeout_s: float | None) -> float | None:
        """The deadline of the next call: timeout_s, or MIN_TIMEOUT_S once the budget is spent."""
        if timeout_s is not None and self.budget_s is not None and self.seconds >= self.budget_s:
            return min(timeout_s, MIN_TIMEOUT_S)
        return timeout_s

    def as_dict(self) -> dict:
        return {"reward/calls": self.calls, "reward/errors": self.errors, "reward/timeouts": self.timeouts,
                "reward/seconds": round(self.seconds, 3)}


@contextmanager
def deadline(seconds: float | None):
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
        with deadline(timeout_s) as interruptible:
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


def _checked_gsm8k(completion: str, gold: str) -> float:
    check_completion(completion)
    pred = extract_answer(completion)
    if pred is not None:
        check_answer(pred, "numeric")
    return gsm8k_reward(completion, gold)


def _checked_math(completion: str, gold: str, timeout_s: float | None) -> float:
    check_completion(completion)
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    check_answer(pred)
    return float(MATH_WORKER.call(pred, gold, timeout_s))


def reward(example, completion: str, stats: RewardStats | None = None, *,
           timeout_s: float | None = DEFAULT_TIMEOUT_S, format_weight: float = 0.0) -> float:
    """Correctness (0/1, guarded) of a tasks.Example's completion, plus format_weight · format_reward.
    Numeric answers are checked here under `guarded`'s deadline; MATH answers in MATH_WORKER, whose
    deadline (the kill) works from any thread."""
    stats = stats if stats is not None else RewardStats()
    limit = stats.timeout(timeout_s)
    if example.kind == "numeric":
        r = guarded(_checked_gsm8k, completion, example.answer, stats=stats, timeout_s=limit)
    else:
        r = guarded(_checked_math, completion, example.answer, limit, stats=stats, timeout_s=None)
    if format_weight and len(completion) <= MAX_COMPLETION_CHARS:
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
