"""reward_funcs.py: loading module:function and file.py:function specs (never from the current directory
or a run directory), the checks made before the model loads, TRL's calling convention, weights and
None, the guard (exceptions, exits, overruns, bad results stop the run naming the function), the
provenance a resumed run compares, the watch over flat rewards, and what the worker costs.

The reward functions are defined here and loaded back by their spec (`test_reward_funcs:<name>`), as a
user's would be: each runs in the worker process, so one that reports what it was given writes it to
the file named by $QERL_TEST_SEEN. The expected totals are computed from the values they return.
(tests/test_probes.py runs the catalogue of hostile functions of tools/probe_integrity.py.)
"""
import json
import os
import random
import sys
import time

import pytest

import reward_funcs
import rewards
from reward_funcs import RewardError, RewardFunc, RewardWatch, check, load, score
from tasks import Example


def length_reward(completions, **kwargs):
    if os.environ.get("QERL_TEST_SEEN"):
        with open(os.environ["QERL_TEST_SEEN"], "a") as f:
            f.write(json.dumps(kwargs) + "\n")
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


def trivial(completions, **kw):
    return [1.0] * len(completions)


EXAMPLES = [Example("1 + 1?", "2", "numeric", columns={"answer": "2", "level": 0}),
            Example("x", "3", "numeric", messages=({"role": "user", "content": "x"},), columns={"answer": "3", "level": 2})]


def test_load_specs_and_their_errors(tmp_path, monkeypatch):
    assert load("correctness") == RewardFunc("correctness")
    f = load("test_reward_funcs:length_reward", 0.5)
    assert (f.name, f.weight, f.source.file) == ("length_reward", 0.5, os.path.abspath(__file__))
    assert ("completions", "POSITIONAL_OR_KEYWORD", False) in f.params
    with pytest.raises(ValueError, match="want 'correctness', 'module:function'"):
        load("length_reward")
    with pytest.raises(ValueError, match="no module 'no_such_module_qerl' on the Python path"):
        load("no_such_module_qerl:f")
    with pytest.raises(ValueError, match="test_reward_funcs has no function 'nope'"):
        load("test_reward_funcs:nope")
    # A file is named by its path; a module in the current directory is not found by its name.
    (tmp_path / "mine.py").write_text("def brevity(completions, **kw):\n    return [0.5] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and os.path.abspath(p) != str(tmp_path)])
    with pytest.raises(ValueError, match="the current directory is not searched: name a file, e.g. ./mine.py"):
        load("mine:brevity")
    f = load("mine.py:brevity")
    assert f.source.file == str(tmp_path / "mine.py") and score([f], EXAMPLES, ["a", "b"])[0] == [0.5, 0.5]
    with pytest.raises(ValueError, match="no file"):
        load("./missing.py:f")


def test_code_is_never_loaded_from_a_run_directory(tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / "sub").mkdir(parents=True)
    (run / "run_config.json").write_text("{}")
    marker = tmp_path / "ran"
    for path in (run / "reward.py", run / "sub" / "deep.py"):
        path.write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef fn(completions, **kw):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(run))
    for spec in (f"{run}/reward.py:fn", "reward:fn", f"{run}/sub/deep.py:fn"):
        with pytest.raises(ValueError, match="a run directory .* code is never loaded from a run directory"):
            load(spec)
    assert not marker.exists(), "the module ran"


def test_score_follows_trl_convention_with_weights_and_none(tmp_path, monkeypatch):
    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("QERL_TEST_SEEN", str(seen))
    reward_funcs.close_workers()   # a worker started by an earlier test has another environment
    funcs = [load("test_reward_funcs:length_reward", 2.0), load("test_reward_funcs:picky", 0.5)]
    totals, terms = score(funcs, EXAMPLES, ["abcd", "ab"], completion_ids=[[1, 2], [3]])
    assert terms == {"length_reward": [0.4, 0.2], "picky": [None, 2.0]}
    assert totals == pytest.approx([2.0 * 0.4, 2.0 * 0.2 + 0.5 * 2.0])
    (kw,) = [json.loads(line) for line in seen.read_text().splitlines()]
    assert kw["prompts"] == ["1 + 1?", [{"role": "user", "content": "x"}]]
    assert kw["completion_ids"] == [[1, 2], [3]] and kw["answer"] == ["2", "3"] and kw["level"] == [0, 2]
    reward_funcs.close_workers()


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
    ("slow", r"took more than --reward-timeout 0.5 s on 2 completions \(0.\d s\): stopped"),
    ("wrong_length", r"returned 1 values for 2 completions"),
    ("nan_reward", r"returned nan for completion 0: want a finite number or None"),
])
def test_a_failing_user_function_stops_the_run_naming_it(name, message):
    f = load(f"test_reward_funcs:{name}")
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=message):
        score([f], EXAMPLES, ["a", "b"], timeout_s=0.5)
    assert time.monotonic() - t0 < 5, "the deadline must stop the call"


def test_a_weighted_total_past_the_limit_is_refused():
    with pytest.raises(RewardError, match=r"weighted reward of completion 0 is 4e\+07, past ±1e\+06 .* lower the weights"):
        score([load("test_reward_funcs:length_reward", 1e8)], EXAMPLES, ["abcd", "ab"])


def test_a_resumed_run_refuses_a_function_that_moved_or_changed(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "mymod.py").write_text("def fn(completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(a))
    recorded = reward_funcs.record([load("correctness"), load("mymod:fn")])
    assert recorded == [{"spec": "mymod:fn", "file": str(a / "mymod.py"),
                         "sha256": reward_funcs.resolve("mymod:fn").sha256}]
    assert reward_funcs.source_changes(recorded) == []
    monkeypatch.syspath_prepend(str(b))                    # now another mymod.py comes first
    (problem,) = reward_funcs.source_changes(recorded)
    assert f"resolves to {b / 'mymod.py'}, not to {a / 'mymod.py'}, the file the run used" in problem
    (b / "mymod.py").unlink()
    (a / "mymod.py").write_text("def fn(completions, **kw):\n    return [2.0] * len(completions)\n")
    (problem,) = reward_funcs.source_changes(recorded)
    assert "has changed since the run started" in problem
    assert reward_funcs.source_changes([{"spec": 3}]) != []


def test_reward_watch_says_when_rewards_carry_no_signal():
    watch = RewardWatch(patience=3)
    said = [watch.update(s, [0.0, 0.0], {"correctness": [0.0, 0.0], "mine": [None, None]}) for s in range(31)]
    assert [s for s, lines in enumerate(said) if lines] == [2, 29]        # at 3 steps, then every 30
    assert "reward mine returned None for every completion of the last 3 steps" in said[2][0]
    assert "every completion of the last 3 steps got the same reward (0)" in said[2][1]
    assert watch.update(31, [0.0, 1.0], {"mine": [None, 1.0]}) == []      # a spread ends both streaks
    assert watch.update(32, [1.0, 1.0 + 1e-9], {}) == [] and watch.streaks["equal"] == 1


def test_the_worker_costs_little_per_call(capsys):
    """A trivial function on a batch of 64 distinct completions of 200 tokens (~800 characters): the
    worker's round trip (pickling the batch, the pipes, the JSON reply) against the same function
    called in this process. Printed: the number reward_funcs.py states."""
    n, rng = 64, random.Random(0)
    examples = [Example(f"What is {i} + {i}?", str(2 * i), "numeric") for i in range(n)]
    kwargs = reward_funcs.arguments(examples, ["".join(rng.choice("ab 1") for _ in range(800)) for _ in range(n)],
                                    [[rng.randrange(50000) for _ in range(200)] for _ in range(n)])
    f = load("test_reward_funcs:trivial")
    reward_funcs.call(f, kwargs, n, 10.0)                  # warm
    reps = 200
    t0 = time.perf_counter()
    for _ in range(reps):
        reward_funcs.call(f, kwargs, n, 10.0)
    worker_ms = (time.perf_counter() - t0) / reps * 1e3
    t0 = time.perf_counter()
    for _ in range(reps):
        trivial(**kwargs)
    inline_ms = (time.perf_counter() - t0) / reps * 1e3
    with capsys.disabled():
        print(f"\nreward worker: {worker_ms:.3f} ms a call on {n} completions ({inline_ms:.4f} ms in-process)")
    assert worker_ms < 20, f"the worker's round trip takes {worker_ms:.1f} ms"


def test_parse_weights():
    assert reward_funcs.parse_weights("1,0.5") == [1.0, 0.5]
    for bad in ("1,x", "inf"):
        with pytest.raises(Exception, match="weight|numbers"):
            reward_funcs.parse_weights(bad)
