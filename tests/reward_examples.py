"""Reward functions of a user's, for the tests that train with `--reward reward_examples:<name>`.

They run in reward_funcs.py's worker process, so this module stays light (no torch, no qerl imports:
the worker imports it), and a function that reports what it was given writes it to a file (the
worker's memory is not the test's): the JSON-lines file named by $QERL_TEST_CALLS.
"""
import json
import os


def spread_on_even_answers(completions, answer, **kwargs):
    """A reward with a spread (0, 1, 0, 1 by position; G is even) in the groups of even answers and none
    (all 0) in those of odd ones: dynamic sampling keeps about half of what it draws, whatever the
    random model writes, and which groups it keeps follows from the data order alone."""
    return [0.0 if int(a) % 2 else float(i % 2) for i, a in enumerate(answer)]


def length_mod_3(prompts, completions, completion_ids, difficulty, **kwargs):
    """A user's reward function (TRL's convention): records its arguments and what it returned."""
    out = [len(c[0]["content"]) % 3 / 2 for c in completions]
    with open(os.environ["QERL_TEST_CALLS"], "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                            "difficulty": difficulty, "kwargs": kwargs, "returned": out}) + "\n")
    return out
