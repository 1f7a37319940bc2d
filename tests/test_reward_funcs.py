"""reward_funcs.py: loading module:function specs, the checks made before the model loads, TRL's
calling convention, weights and None, and the guard (exceptions, overruns, bad results stop the run
naming the function).

The reward functions are defined here and loaded back by their spec (`test_reward_funcs:<name>`), as a
user's would be; the expected totals are computed from the values they return.
"""
import time

import pytest

import reward_funcs
import rewards
from reward_funcs import RewardError, RewardFunc, check, load, score
from tasks import Example

SEEN = []


def length_reward(completions, **kwargs):
    SEEN.append(kwargs)
    return [len(c if isinstance(c, str) else c[0]["content"]) / 10 for c in completions]


def picky(prompts, completions, level):   # no **kwargs: gets only what it names
    return [None if lv == 0 else float(lv) for lv in level]


def needs_secret(completions, secret):
    return [0.0] * len(completions)


def raises(completions, **kw):
    return {}["missing"]


def slow(completions, **kw):
    time.sleep(30)


def wrong_length(completions, **kw):
    return [1.0]


def nan_reward(completions, **kw):
    return [float("nan")] * len(completions)


EXAMPLES = [Example("1 + 1?", "2", "numeric", columns={"answer": "2", "level": 0}),
            Example("x", "3", "numeric", messages=({"role": "user", "content": "x"},), columns={"answer": "3", "level": 2})]


def test_load_specs_and_their_errors():
    assert load("correctness") == RewardFunc("correctness", None)
    f = load("test_reward_funcs:length_reward", 0.5)
    assert f.fn is length_reward and f.weight == 0.5 and f.name == "length_reward"
    with pytest.raises(ValueError, match="want 'correctness' or 'module:function'"):
        load("length_reward")
    with pytest.raises(ValueError, match="no module 'no_such_module_qerl'"):
        load("no_such_module_qerl:f")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        load("test_reward_funcs:nope")


def test_score_follows_trl_convention_with_weights_and_none():
    SEEN.clear()
    funcs = [load("test_reward_funcs:length_reward", 2.0), load("test_reward_funcs:picky", 0.5)]
    totals, terms = score(funcs, EXAMPLES, ["abcd", "ab"], completion_ids=[[1, 2], [3]])
    assert terms == {"length_reward": [0.4, 0.2], "picky": [None, 2.0]}
    assert totals == pytest.approx([2.0 * 0.4, 2.0 * 0.2 + 0.5 * 2.0])
    (kw,) = SEEN
    assert kw["prompts"] == ["1 + 1?", [{"role": "user", "content": "x"}]]
    assert kw["completion_ids"] == [[1, 2], [3]] and kw["answer"] == ["2", "3"] and kw["level"] == [0, 2]


def test_score_adds_the_builtin_correctness(monkeypatch):
    calls = []
    monkeypatch.setattr(rewards, "rewards", lambda exs, texts, stats=None, **kw: calls.append(kw) or [1.0, 0.0])
    totals, terms = score([load("correctness", 3.0)], EXAMPLES, ["a", "b"], format_weight=0.25)
    assert totals == [3.0, 0.0] and terms == {"correctness": [1.0, 0.0]} and calls == [{"format_weight": 0.25}]


def test_check_refuses_before_the_model_loads():
    check([load("test_reward_funcs:picky")], EXAMPLES)                     # level is a column: fine
    with pytest.raises(ValueError, match=r"needs argument\(s\) \['secret'\]"):
        check([load("test_reward_funcs:needs_secret")], EXAMPLES)
    with pytest.raises(ValueError, match=r"column\(s\) \['completions'\]"):
        check([load("correctness")], [Example("q", "1", "numeric", columns={"completions": 1})])
    with pytest.raises(ValueError, match="correctness reward needs a gold answer, and 1 of 1"):
        check([load("correctness")], [Example("q", None, None)])


@pytest.mark.parametrize("name, message", [
    ("raises", r"reward test_reward_funcs:raises raised KeyError: 'missing' \(at .*test_reward_funcs\.py:\d+\)"),
    ("slow", r"took more than --reward-timeout 0.2 s on 2 completions"),
    ("wrong_length", r"returned 1 values for 2 completions"),
    ("nan_reward", r"returned nan for completion 0: want a finite number or None"),
])
def test_a_failing_user_function_stops_the_run_naming_it(name, message):
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=message):
        score([load(f"test_reward_funcs:{name}")], EXAMPLES, ["a", "b"], timeout_s=0.2)
    assert time.monotonic() - t0 < 5, "the deadline must interrupt the call"


def test_parse_weights():
    assert reward_funcs.parse_weights("1,0.5") == [1.0, 0.5]
    for bad in ("1,x", "inf"):
        with pytest.raises(Exception, match="weight|numbers"):
            reward_funcs.parse_weights(bad)
