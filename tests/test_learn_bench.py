"""bench/learn.py on a tiny random model (CPU): every arm x seed runs train.py, the summary's mean and
range are those of the runs' own metrics.jsonl, a finished run is reused, and the figure is written."""
import importlib.util
import json
import os

import pytest

from test_train import ROOT, make_tiny_model


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_learn", os.path.join(ROOT, "bench", "learn.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_two_arms_two_seeds_summary_and_figure(smollm2_tokenizer, tmp_path, capsys):
    learn = load_bench()
    model = make_tiny_model(smollm2_tokenizer, str(tmp_path / "model"))
    out = str(tmp_path / "learn")
    argv = ["--model", model, "--arms", "nvfp4+aqn,bf16", "--seeds", "0,1", "--steps", "2", "--eval-every", "1",
            "--eval-limit", "3", "--out", out, "--jobs", "2", "--train-args",
            "--group-size 2 --prompts-per-step 2 --max-new-tokens 4 --dtype float32 --lora-rank 4 --no-dynamic-sampling"]
    learn.main(argv)
    assert os.path.exists(os.path.join(out, "learn.png"))
    assert "step" in open(os.path.join(out, "bf16-seed0.log")).read()     # --jobs 2: each run logs to its file
    summary = json.load(open(os.path.join(out, "learn.json")))["summary"]
    for arm, quant in (("nvfp4+aqn", "nvfp4"), ("bf16", "bf16")):
        runs = []
        for seed in (0, 1):
            run_dir = os.path.join(out, f"{arm}-seed{seed}")
            cfg = json.load(open(os.path.join(run_dir, "run_config.json")))
            assert cfg["quant"] == quant and cfg["aqn"] == (arm == "nvfp4+aqn") and cfg["seed"] == seed
            runs.append([json.loads(ln) for ln in open(os.path.join(run_dir, "metrics.jsonl"))])
        for step in (1, 2):                    # the summary is the mean and range over the seeds' own rows
            vals = [r[step - 1]["reward"] for r in runs]
            assert summary[arm]["reward"][str(step)] == [sum(vals) / 2, min(vals), max(vals)]
        assert set(summary[arm]["eval/accuracy"]) == {"0", "1", "2"}      # before training, after steps 1 and 2
        v = json.load(open(os.path.join(out, "learn.json")))["verdicts"][arm]
        ends = [(r[0]["eval/accuracy_initial"], r[-1]["eval/accuracy"]) for r in runs]
        assert (v["start"], v["end"]) == ([a for a, _ in ends], [b for _, b in ends])
        assert v["not_learned"] == sum(b < a + 0.05 for a, b in ends)
    mtime = os.path.getmtime(os.path.join(out, "bf16-seed0", "metrics.jsonl"))
    learn.main(argv)                                                     # finished runs are reused, not rerun
    assert os.path.getmtime(os.path.join(out, "bf16-seed0", "metrics.jsonl")) == mtime
    assert "held-out accuracy" in capsys.readouterr().out
