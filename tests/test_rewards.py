"""rewards.py: answer extraction, the checkers, the guard, the lm-eval GSM8K matchers."""
import signal
import threading
import time

import pytest

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


def test_timeout_is_not_swallowed_by_except_exception(monkeypatch):
    import math_verify

    def stubborn_verify(*args, **kwargs):   # math-verify and sympy catch Exception in many places
        try:
            time.sleep(5)
        except Exception:
            return True
        return True
    monkeypatch.setattr(math_verify, "verify", stubborn_verify)
    stats = RewardStats()
    assert reward(Example("q", "2", "math"), r"\boxed{2}", stats, timeout_s=0.2) == 0.0
    assert stats.timeouts == 1


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
