"""tasks.py: loading, extraction, rewards, the guard, and the gold data scoring itself."""
import json
import os
import signal
import threading
import time

import pytest

import tasks
from tasks import (Example, RewardStats, build_prompt, extract_answer, format_reward, gsm8k_flexible_extract,
                   gsm8k_flexible_match, gsm8k_reward, gsm8k_strict_extract, gsm8k_strict_match, guarded,
                   load_task, math_reward, read_jsonl, reward, rewards, to_number)


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
# loading

def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_read_jsonl_gsm8k_and_math_records(tmp_path):
    p = _write(tmp_path / "mix.jsonl", [
        json.dumps({"question": "2+2?", "answer": "2+2=<<2+2=4>>4\n#### 4"}),
        "",
        json.dumps({"problem": "Half?", "answer": r"\frac{1}{2}", "solution": r"It is \boxed{\frac{1}{2}}."}),
        json.dumps({"question": "Name?", "answer": "Alice"}),
        json.dumps({"question": "Count?", "answer": 7}),
    ])
    ex = read_jsonl(p)
    assert ex[0] == Example("2+2?", "4", "numeric", "2+2=<<2+2=4>>4\n#### 4")
    assert ex[1] == Example("Half?", r"\frac{1}{2}", "math", r"It is \boxed{\frac{1}{2}}.")
    assert ex[2].kind == "math" and ex[3] == Example("Count?", "7", "numeric")


def test_malformed_jsonl_names_file_and_line(tmp_path):
    p = _write(tmp_path / "bad.jsonl", [json.dumps({"question": "a", "answer": "1"}), "", '{"question": "b", '])
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON"):
        read_jsonl(p)
    p = _write(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=r"list\.jsonl:1: expected a JSON object"):
        read_jsonl(p)


@pytest.mark.parametrize("rec, names", [
    ({"question": "q"}, "'answer'"),
    ({"problem": "p", "solution": "s"}, "'answer'"),
    ({"prompt": "p", "label": "1"}, "'question' and 'answer'"),
])
def test_missing_fields_are_named(tmp_path, rec, names):
    p = _write(tmp_path / "miss.jsonl", [json.dumps({"question": "ok", "answer": "1"}), json.dumps(rec)])
    with pytest.raises(ValueError, match=rf"miss\.jsonl:2: missing field\(s\) {names}"):
        read_jsonl(p)


def test_load_task_paths_and_errors(tmp_path, shared_data):
    gsm = load_task(os.path.join(shared_data, "gsm8k"), "test")
    assert len(gsm) == 1319 and gsm[0].answer == "18" and gsm[0].kind == "numeric"
    assert len(load_task(os.path.join(shared_data, "gsm8k", "test.jsonl"), limit=5)) == 5
    with pytest.raises(FileNotFoundError, match=r"validation\.jsonl not found"):
        load_task(os.path.join(shared_data, "math500"), "validation")
    with pytest.raises(FileNotFoundError, match="unknown task"):
        load_task(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="split"):
        load_task("addition", "dev")


def test_load_task_hub_names(monkeypatch):
    import datasets
    calls = []

    def fake_load_dataset(repo, config=None, split=None):
        calls.append((repo, config, split))
        if repo == "openai/gsm8k":
            return [{"question": "q", "answer": "x\n#### 1,234"}]
        return [{"problem": "p", "solution": r"\boxed{2}", "answer": "2", "subject": "Algebra", "level": 1}]
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_task("gsm8k", "train") == [Example("q", "1,234", "numeric", "x\n#### 1,234")]
    assert load_task("math500", "test")[0] == Example("p", "2", "math", r"\boxed{2}")
    assert calls == [("openai/gsm8k", "main", "train"), ("HuggingFaceH4/MATH-500", None, "test")]
    with pytest.raises(ValueError, match="only the 'test' split"):
        load_task("math500", "train")


def test_addition_task_is_seeded_and_split():
    train, test = load_task("addition", "train"), load_task("addition", "test")
    assert len(train) == 8100 - 1000 and len(test) == 1000
    assert not {e.question for e in train} & {e.question for e in test}
    assert load_task("addition", "test") == test and load_task("addition", "test", seed=1) != test
    for e in test[:50]:
        a, b = map(int, e.question.removeprefix("What is ").removesuffix("?").split(" + "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and e.answer == str(a + b) and e.kind == "numeric"


# -----------------------------------------------------------------------------
# prompts

def test_build_prompt_uses_the_chat_template(smollm2_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    p = build_prompt(tok, "What is 2 + 3?")
    want = tok.apply_chat_template([{"role": "system", "content": tasks.SYSTEM_PROMPT},
                                    {"role": "user", "content": "What is 2 + 3?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert p == want and r"\boxed{}" in p and p.endswith("<|im_start|>assistant\n")


def test_build_prompt_without_template():
    class Plain:
        chat_template = None
    assert build_prompt(Plain(), "Q?") == tasks.SYSTEM_PROMPT + "\n\nQuestion: Q?\nAnswer:"


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


# -----------------------------------------------------------------------------
# the gold data scores itself

def test_gsm8k_gold_solutions_score_100_percent(shared_data):
    data = load_task(os.path.join(shared_data, "gsm8k"), "test")
    stats = RewardStats()
    scores = rewards(data, [e.solution for e in data], stats)
    acc = 100 * sum(scores) / len(data)
    strict = 100 * sum(gsm8k_strict_match(e.solution, e.solution) for e in data) / len(data)
    flexible = 100 * sum(gsm8k_flexible_match(e.solution, e.solution) for e in data) / len(data)
    print(f"\nGSM8K test gold-vs-gold: reward {acc:.2f}%, lm-eval strict {strict:.2f}%, flexible {flexible:.2f}% "
          f"({len(data)} examples, {stats.as_dict()})")
    assert acc == 100.0 and strict == 100.0 and flexible == 100.0 and stats.errors == stats.timeouts == 0


def test_math500_gold_solutions_score_at_least_99_percent(shared_data):
    data = load_task(os.path.join(shared_data, "math500"), "test")
    assert len(data) == 500 and all(e.kind == "math" and e.solution for e in data)
    stats = RewardStats()
    scores = rewards(data, [e.solution for e in data], stats)
    acc = 100 * sum(scores) / len(data)
    print(f"\nMATH500 gold answer vs \\boxed{{}} of the gold solution: {acc:.2f}% ({stats.as_dict()})")
    misses = [e.answer for e, s in zip(data, scores) if s == 0][:10]
    assert acc >= 99.0, f"{acc:.2f}%; first misses: {misses}"
