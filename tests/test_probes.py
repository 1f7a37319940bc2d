"""tools/probe_integrity.py's probes, run in CI: corruptions of checkpoints, adapters, run directories
and model directories, rows that cannot train, hostile reward functions and modules, a run directory
that plants code for `train.py --resume .`, flags and run records train.py must refuse at once, and
runs that go wrong on the way (rewards without signal, gradients not finite, Ctrl-C). Nothing may be silently wrong, hang, end in a
traceback or run planted code, and every control must still work.

CI runs the whole catalogue but for the slowest duplicates (the forged adapters given to export.py as
well as eval.py, most adapters without a manifest, two of the four planted run directories, a
subprocess each): `python tools/probe_integrity.py --model DIR` runs all of it and prints the table.
"""
import os
import sys

import pytest

import reward_funcs
from test_train import make_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import probe_integrity  # noqa: E402

# (class, the start of a probe's name) left to the full run: each is a slower copy of a kept probe
LEFT_OUT = [("checkpoint", "export: forged"), ("checkpoint", "eval: a PEFT adapter without manifest, r"),
            ("checkpoint", "eval: a PEFT adapter without manifest, tensors"), ("checkpoint", "eval: forged, manifest rewritten: r"),
            ("checkpoint", "eval: forged, manifest rewritten: t"), ("checkpoint", "eval: forged, manifest rewritten: a"),
            ("run_dir", "train.py --resume . with the reward as an absolute"),
            ("run_dir", "train.py --resume . with the reward as a module in")]


@pytest.fixture(scope="module")
def tiny_model(smollm2_tokenizer, tmp_path_factory):
    return make_tiny_model(smollm2_tokenizer, str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.mark.slow
def test_nothing_is_silently_wrong_hangs_tracebacks_or_runs_from_a_run_dir(tiny_model, tmp_path, capsys):
    probes = [p for p in probe_integrity.build(probe_integrity.CLASSES, tiny_model, str(tmp_path))
              if not any(p.cls == c and p.name.startswith(n) for c, n in LEFT_OUT)]
    try:
        results = [probe_integrity.run_probe(p) for p in probes]
    finally:
        reward_funcs.close_workers()
    with capsys.disabled():
        print("\n" + probe_integrity.table(results))
    bad = [f"{r.verdict}: {r.cls}: {r.name}: {r.message}" for r in results
           if r.verdict not in ("refused", "accepted", "warned")]
    assert not bad, "\n".join(bad)
    count = lambda cls, expect="refuse": sum(p.cls == cls and p.expect == expect for p in probes)  # noqa: E731
    assert count("checkpoint") + count("resume") + count("model") >= 50, "the corruptions"
    assert count("rewards") >= 20 and count("run_dir") >= 2 and count("data") >= 10
    assert count("flags") >= 15 and count("train") >= 3
    assert count("checkpoint", "accept") and count("resume", "warn") and count("rewards", "accept")
    assert count("flags", "accept") and count("train", "warn") and count("train", "accept")
