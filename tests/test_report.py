"""report.py: the progress line, the seeded choice of logged completions, and what a tracker is sent.

The trackers are stood in for by recording fakes put in sys.modules under the real package names, so
the test checks the calls train.py's Tracker makes (init with the run's name and config, one log per
step with its step number, finish; several at once), not the trackers themselves.
"""
import sys
import types

import pytest

import report


def test_progress_line_shows_what_the_step_has():
    m = {"step": 11, "reward": 0.3125, "reward/kept": 0.5, "loss": 0.00412, "grad_norm": 0.2104, "aqn/sigma": 0.0069, "step_time": 14.23,
         "eval/accuracy": 0.285}
    assert report.progress_line(m, 50) == ("step 11/50 | reward 0.312 | kept 0.500 | loss 0.0041 | grad_norm 0.21 | σ 6.9e-03 | "
                                           "14.2 s/step | eval 0.285")
    assert report.progress_line({"step": 1, "aqn/sigma": 0.0, "skipped": True, "step_time": 2.0}, 3) == \
        "step 1/3 | σ 0.0e+00 | 2.0 s/step | skipped: no group with a reward spread"


def test_completion_rows_are_a_seeded_sample_of_the_step():
    samples = [{"prompt": f"p{i}", "completion": f"c{i}", "reward": float(i)} for i in range(16)]
    rows = report.completion_rows(5, samples, 4, seed=0)
    assert len(rows) == 4 and all(r["step"] == 5 for r in rows)
    assert all(r["completion"] == f"c{int(r['reward'])}" for r in rows), "a row keeps its own completion and reward"
    assert rows == report.completion_rows(5, samples, 4, seed=0), "the same (seed, step): the same rows"
    picks = {tuple(r["prompt"] for r in report.completion_rows(step, samples, 4, seed=0)) for step in range(5)}
    assert len(picks) > 1, "each step draws its own rows"
    assert len(report.completion_rows(0, samples[:2], 4, seed=0)) == 2


class FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, metrics, step=None):
        self.calls.append(("log", metrics, step))

    def finish(self):
        self.calls.append(("finish",))


@pytest.mark.parametrize("kind", ["wandb", "trackio"])
def test_tracker_sends_each_step_then_finishes(kind, monkeypatch, tmp_path):
    calls = []
    fake = types.ModuleType(kind)
    if kind == "wandb":
        fake.init = lambda **kw: calls.append(("init", kw)) or FakeRun(calls)
    else:
        run = FakeRun(calls)
        fake.init = lambda **kw: calls.append(("init", kw))
        fake.log, fake.finish = run.log, run.finish
    monkeypatch.setitem(sys.modules, kind, fake)
    out = tmp_path / "my-run"
    t = report.Tracker(kind, str(out), {"lr": 1e-5})
    t.log({"step": 3, "reward": 0.5, "skipped": True, "note": "x", "eval/accuracy": 0.25}, 3)
    t.close()
    assert calls[0][0] == "init" and calls[0][1]["name"] == "my-run" and calls[0][1]["config"] == {"lr": 1e-5}
    assert calls[1:] == [("log", {"reward": 0.5, "eval/accuracy": 0.25}, 3), ("finish",)]


def test_tracker_none_does_nothing(tmp_path):
    t = report.Tracker("none", str(tmp_path), {})
    t.log({"step": 0, "reward": 1.0}, 0)
    t.close()
    assert t.runs == {} and list(tmp_path.iterdir()) == []


def test_tensorboard_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    t = report.Tracker("tensorboard", str(tmp_path), {"lr": 1e-5})
    t.log({"step": 0, "reward": 1.0}, 0)
    t.close()
    assert any(f.name.startswith("events.out.tfevents") for f in (tmp_path / "tensorboard").iterdir())


def test_several_trackers_each_get_every_step(monkeypatch, tmp_path):
    """--report-to wandb,trackio: both receive the step's numbers, and both are closed."""
    calls = {"wandb": [], "trackio": []}
    wandb, trackio = types.ModuleType("wandb"), types.ModuleType("trackio")
    wandb.init = lambda **kw: FakeRun(calls["wandb"])
    run = FakeRun(calls["trackio"])
    trackio.init, trackio.log, trackio.finish = (lambda **kw: None), run.log, run.finish
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    t = report.Tracker("wandb,trackio", str(tmp_path), {"lr": 1e-5})
    t.log({"step": 1, "reward": 0.5}, 1)
    t.close()
    assert calls["wandb"] == calls["trackio"] == [("log", {"reward": 0.5}, 1), ("finish",)] and t.runs == {}
