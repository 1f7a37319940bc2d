"""rewards.py: answer extraction, the checkers, the guard, the lm-eval GSM8K matchers.

The guard's tests feed the completions that hung or stalled the trainer before it had limits and a
worker process (exponents like 1e999999999, power towers, 1 MB strings, 10k nested braces, 140 KB of
\\boxed{), from the main thread and from a worker thread, and time them. References: the quadratic
scan for the last \\boxed{ that rewards.py used before (kept here), and MATH500's gold answers, which
every limit must let through."""
import gc
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import rewards as rw
from rewards import (RewardStats, extract_answer, format_reward, gsm8k_flexible_extract, gsm8k_flexible_match,
                     gsm8k_reward, gsm8k_strict_extract, gsm8k_strict_match, guarded, math_reward, reward, rewards,
                     to_number)
from tasks import Example


# -----------------------------------------------------------------------------
# extraction

@pytest.mark.parametrize("text, want", [
    (r"first \boxed{1}, on reflection \boxed{2}.", "2"),                 # several boxed: the last
    (r"so $x = \boxed{\frac{1}{2}}$", r"\frac{1}{2}"),                    # nested braces
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
    (r"\boxed{\text{(C)}} and \boxed{\frac{1}{", r"\text{(C)}"),           # the last one is cut off
    (r"the answer is \boxed 7 indeed", "7"),
    (r"\fbox{5}", "5"),
    ("It costs $1,000 in total.", "1,000"),                              # last number, grouped
    ("He pays $18.00.", "18.00"),                                        # trailing period is prose
    ("from 3 to -4.5 degrees", "-4.5"),
    ("12 eggs, 3/4 of them", "4"),                                       # no boxed: just the last number
    ("no answer here", None),
    ("", None),
])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


@pytest.mark.parametrize("s, want", [
    ("1,000", 1000), ("$18.00", 18), ("18.", 18), ("18", 18), (r"\$18", 18), ("-7", -7), ("50%", 50),
    (r"\frac{3}{4}", 0.75), (r"-\dfrac{1}{2}", -0.5), ("3/4", 0.75), (r"1{,}000", 1000),
    (r"\text{18}", 18), ("18 apples", 18), ("apples", None), (None, None), (r"\frac{1}{0}", None),
])
def test_to_number(s, want):
    got = to_number(s)
    assert (got is None) if want is None else (got == want), f"{s!r} -> {got}"


def test_gsm8k_reward_numeric_equality():
    assert gsm8k_reward(r"Total: \boxed{18.00}", "18") == 1.0                   # 18 == 18.00
    assert gsm8k_reward(r"\boxed{\$1,000.}", "1000") == 1.0
    assert gsm8k_reward("so she makes $18.", "18") == 1.0                       # last number
    assert gsm8k_reward(r"\boxed{18} ... \boxed{19}", "18") == 0.0              # the last box counts
    assert gsm8k_reward("I don't know", "18") == 0.0
    assert gsm8k_reward(r"\boxed{0.1}", "0.10") == 1.0
    assert gsm8k_reward(r"\boxed{17.99}", "18") == 0.0                          # exact, not rounded
    with pytest.raises(ValueError, match="not a number"):
        gsm8k_reward("5", "five")


def test_math_reward_uses_equivalence():
    assert math_reward(r"so \boxed{0.5}", r"\frac{1}{2}") == 1.0
    assert math_reward(r"\boxed{\dfrac12}", r"\frac{1}{2}") == 1.0
    assert math_reward(r"\boxed{(3, \pi/2)}", r"\left( 3, \frac{\pi}{2} \right)") == 1.0
    assert math_reward(r"\boxed{\frac{1}{3}}", r"\frac{1}{2}") == 0.0
    assert math_reward(r"\boxed{\frac{1}{2}} or maybe \boxed{3}", r"\frac{1}{2}") == 0.0
    assert math_reward("no idea", "2") == 0.0
    assert math_reward(r"\boxed{10\%}", r"10\%") == 1.0


def test_format_reward():
    assert format_reward(r"answer \boxed{4}") == 1.0
    assert format_reward("answer 4") == 0.0
    assert format_reward(r"answer \boxed{4") == 0.0
    ex = Example("q", "4", "numeric")
    assert reward(ex, r"\boxed{4}", format_weight=0.1) == pytest.approx(1.1)
    assert reward(ex, "4", format_weight=0.1) == 1.0


# -----------------------------------------------------------------------------
# the guard

def test_guard_scores_failures_zero_and_counts_them():
    stats = RewardStats()
    assert guarded(lambda: 1 / 0, stats=stats) == 0.0
    assert guarded(lambda: float("nan"), stats=stats) == 0.0
    assert guarded(lambda: 0.5, stats=stats) == 0.5
    assert (stats.calls, stats.errors, stats.timeouts) == (3, 2, 0)
    assert "not finite" in stats.last_error   # the last failure: the nan


def _spin():
    while True:
        pass


def test_guard_timeout_interrupts_sleep_and_busy_loops():
    stats = RewardStats()
    t0 = time.monotonic()
    assert guarded(time.sleep, 5, stats=stats, timeout_s=0.2) == 0.0
    assert guarded(_spin, stats=stats, timeout_s=0.2) == 0.0
    assert stats.timeouts == 2 and stats.errors == 0 and time.monotonic() - t0 < 4.0


def test_timeout_is_not_swallowed_by_except_exception():
    def stubborn():   # math-verify and sympy catch Exception in many places
        try:
            time.sleep(5)
        except Exception:
            return 1.0
        return 1.0
    stats = RewardStats()
    t0 = time.monotonic()
    assert guarded(stubborn, stats=stats, timeout_s=0.2) == 0.0
    assert stats.timeouts == 1 and time.monotonic() - t0 < 2.0


def test_guard_restores_an_outer_timer():
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        guarded(lambda: 1.0, timeout_s=0.5)
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 29.0 < left <= 30.0, f"outer timer has {left} s left"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def test_rewards_in_a_worker_thread():
    # Off the main thread no signal can be used: math-verify must still work (its own alarms are
    # off) and an overrun is scored 0 after the fact.
    out = {}

    def work():
        stats = RewardStats()
        out["math"] = reward(Example("q", r"\frac{1}{2}", "math"), r"\boxed{0.5}", stats, timeout_s=60)
        out["slow"] = guarded(lambda: (time.sleep(0.3), 1.0)[1], stats=stats, timeout_s=0.1)
        out["stats"] = stats
    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert out["math"] == 1.0 and out["slow"] == 0.0
    assert (out["stats"].errors, out["stats"].timeouts) == (0, 1)


def test_rewards_list_and_length_check():
    ex = [Example("q", "4", "numeric")] * 2
    stats = RewardStats()
    assert rewards(ex, [r"\boxed{4}", "5"], stats) == [1.0, 0.0] and stats.calls == 2
    with pytest.raises(ValueError, match="2 examples but 1 completions"):
        rewards(ex, ["4"])


# -----------------------------------------------------------------------------
# lm-eval GSM8K matchers

def test_lmeval_matchers():
    gold = "She pays 9 * 2 = $18\n#### 1,018"
    assert gsm8k_strict_extract("so #### 1,018 and #### 5") == "1,018"          # the first
    assert gsm8k_strict_match("so #### 1,018.", gold) and gsm8k_strict_match("#### $1018", gold) is False
    assert gsm8k_strict_extract("the answer is 1018") == "[invalid]"
    assert gsm8k_flexible_extract("3 eggs, total $1,018.") == "$1,018."             # the last
    assert gsm8k_flexible_match("3 eggs, total $1,018.", gold)
    assert gsm8k_flexible_match("3 eggs, total 1018", "1018")
    assert not gsm8k_flexible_match("3 eggs, total 1017", gold)
    assert gsm8k_flexible_extract("no digits") == "[invalid]"


# -----------------------------------------------------------------------------
# the guard against pathological completions

def quadratic_last_boxed(text):
    """rw.last_boxed as it was: rescan from every \\boxed (140 KB of them took 177 s)."""
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
            continue
        word = re.match(r"[^\s$]+", text[i:])
        if word and i > m.end():
            return word.group(0)
    return None


def test_last_boxed_matches_the_quadratic_scan_on_random_text():
    rng = random.Random(0)
    pieces = ["\\boxed", "\\fbox", "\\boxedx", "{", "}", " ", "  ", "a", "12", "$", "\\{", "\n"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        assert rw.last_boxed(text) == quadratic_last_boxed(text), repr(text)


def pathological():
    """Completions that hung or stalled the trainer (name -> text); none holds the gold answer 7."""
    return {
        "exponent 1e999999999": r"so \boxed{1e999999999}",
        "exponent 1e-999999999": r"\boxed{1e-999999999}",
        "power tower 2^2^...": "\\boxed{" + "2^" * 30 + "2}",
        "braced tower 9^{9^{9}}": r"\boxed{9^{9^{9}}}",
        "nested tower 2^{2^{...}}": "\\boxed{" + "2^{" * 20 + "2" + "}" * 20 + "}",
        "exponent 2^{99999999}": r"\boxed{2^{99999999}}",
        "factorial 100000!": r"\boxed{100000!}",
        "1 MB of digits": "1 " * 500_000,
        "1 MB in a box": "\\boxed{" + "1+" * 500_000 + "1}",
        "10k nested braces": "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
        "10k open braces": "\\boxed{" + "{" * 10_000 + "1",
        "10k nested parens": "\\boxed{" + "(" * 10_000 + "1" + ")" * 10_000 + "}",
        "140 KB of \\boxed{": "\\boxed{" * 20_000,
        "deep \\log(": "\\boxed{" + "\\log(" * 40 + "2" + ")" * 40 + "}",
    }


# Per completion: half of rewards.DEFAULT_TIMEOUT_S, so a case that reached a checker and ran to its deadline
# fails, while a case the limits refuse passes even on a loaded 2-core CI machine (a refusal takes
# microseconds to tens of milliseconds on an idle one, several times that beside another test run).
BUDGET_S = rw.DEFAULT_TIMEOUT_S / 2


@pytest.mark.parametrize("kind", ["numeric", "math"])
def test_pathological_completions_score_zero_quickly(kind):
    rw.reward(Example("q", "2", kind), r"\boxed{2}")   # math: the worker is started, not timed
    for name, text in pathological().items():
        stats = RewardStats()
        gc.collect()   # a full collection owed to earlier tests' objects is not the reward's time
        t0 = time.monotonic()
        r = reward(Example("q", "7", kind), text, stats)
        dt = time.monotonic() - t0
        assert r == 0.0 and dt < BUDGET_S, f"{name}: reward {r} in {dt:.3f} s"
        assert stats.calls == 1 and stats.timeouts == 0


def test_pathological_completions_from_a_worker_thread():
    """In a child process (a hang there cannot hang pytest): every case from a thread, timed."""
    code = f"""
import json, sys, threading, time
sys.path[:0] = [{os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r}, {os.path.dirname(os.path.abspath(__file__))!r}]
import rewards, test_rewards
from tasks import Example
out = {{}}
def work():
    rewards.reward(Example("q", "2", "math"), r"\\boxed{{2}}")
    for kind in ("numeric", "math"):
        for name, text in test_rewards.pathological().items():
            t0 = time.monotonic()
            out[kind + ": " + name] = (rewards.reward(Example("q", "7", kind), text), time.monotonic() - t0)
t = threading.Thread(target=work)
t.start()
t.join()
print(json.dumps(out))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(out) == 2 * len(pathological())
    slow = {k: v for k, v in out.items() if v[0] != 0.0 or v[1] >= BUDGET_S}
    assert not slow, f"scored or timed past the budget: {slow}"


def test_limits_refuse_the_pathological_and_pass_every_math500_gold_answer(test_data):
    for text in ("1e999999999", "2^2^2", "9^{9^{9}}", "2^{99999999}", "x^{1001}", "100000!", "(3+4)!",
                 "{" * 11 + "1" + "}" * 11, "1" * 301):
        with pytest.raises(rw.Refused):
            rw.check_answer(text)
    with pytest.raises(rw.Refused, match="MAX_COMPLETION_CHARS"):
        rw.check_completion("1" * (rw.MAX_COMPLETION_CHARS + 1))
    golds = json.load(open(os.path.join(test_data, "math500", "answers.json"), encoding="utf-8"))
    assert len(golds) == 500
    for text in golds + ["2^{1000}", "1e100", "10! + 5!", r"\frac{\sqrt{3}}{2}", "x^5 - x^4", r"10,\!080"]:
        rw.check_answer(text)
    assert rw.to_number("1e999999999") is None and rw.to_number("1e3") == 1000


def test_math_worker_kills_an_overrun_from_a_thread():
    """Past the limits (called directly), 9^{9^{9}} is C-level big-integer work: only a kill stops it.
    The process stays responsive, and the next call gets a fresh worker."""
    out = {}

    def work():
        t0 = time.monotonic()
        try:
            rw.MATH_WORKER.call("9^{9^{9}}", "2", 0.5)
        except rw.RewardTimeout:
            out["timeout"] = time.monotonic() - t0
        out["next"] = rw.MATH_WORKER.call("0.5", r"\frac{1}{2}", 30)
    rw.MATH_WORKER.call("1", "1", 30)   # started
    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive() and out["timeout"] < 1.5 and out["next"] is True, out


def test_a_worker_started_from_a_thread_outlives_the_thread():
    """Linux kills a child that asked to die with its parent when the thread that started it ends
    (PR_SET_PDEATHSIG): a worker started from a caller's short-lived thread must still answer after."""
    worker = rw.MathWorker()
    t = threading.Thread(target=worker.call, args=("1", "1", 30))
    t.start()
    t.join()
    time.sleep(0.5)   # the kill, when there is one, lands a moment after the thread's join
    try:
        assert worker._child.usable(), worker._child.exit_status(0.1)
        assert worker.call("0.5", r"\frac{1}{2}", 30) is True
    finally:
        worker.close()


def test_a_spent_step_budget_shortens_each_call():
    stats = RewardStats(budget_s=0.0)
    assert stats.timeout(rw.DEFAULT_TIMEOUT_S) == rw.MIN_TIMEOUT_S
    assert RewardStats().timeout(rw.DEFAULT_TIMEOUT_S) == rw.DEFAULT_TIMEOUT_S
    rw.reward(Example("q", "2", "math"), r"\boxed{2}")
    t0 = time.monotonic()   # passes the limits, and math-verify takes seconds on it
    assert reward(Example("q", "3", "math"), r"\boxed{\binom{1000000}{500000}}", stats) == 0.0
    # ended before the default limit could have: the shortened one stopped it (plus the worker's kill
    # and restart, which a loaded CI machine can stretch past a second)
    assert stats.timeouts == 1 and time.monotonic() - t0 < rw.DEFAULT_TIMEOUT_S
