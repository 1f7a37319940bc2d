"""bench/step.py on CPU: the tiny configuration's GRPO step end to end, and the "does not fit" report.

The bench runs each configuration in a child process; here a tiny random model takes one warm-up
and one timed step (train.py's step: forced-length rollout, random rewards, DAPO backward, AdamW),
and Qwen2.5-7B and -72B are checked against an injected 1 GiB of free memory, so they are reported and never built;
--force then runs a tiny configuration that fails the check.
"""
import importlib.util
import json
import math
import os

import pytest
import torch

import checkpoint as qckpt
import model as qmodel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--device", "cpu", "--dtype", "float32", "--prompts", "2", "--group", "4", "--prompt-len", "8",
         "--micro-batch", "4", "--available-gib", "1"]


def load_bench(name="step"):
    """bench/<name>.py as a module (bench/rollout.py's name would clash with the top-level rollout.py)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_tiny_step_record_and_does_not_fit(tmp_path, capsys):
    bench, out = load_bench(), str(tmp_path / "step.json")
    bench.main(["--models", "tiny,7b,72b", "--quants", "nvfp4", "--completion", "6", *SMALL, "--out", out])
    rows = {r["model"]: r for r in json.load(open(out))["rows"]}
    assert sorted(rows) == ["72b", "7b", "tiny"], rows

    r = rows["tiny"]
    assert r["status"] == "ok", r
    for key in ("device", "torch", "triton", "command", "build_s", "step_s", "rollout_s", "logprob_pass_s",
                "backward_s", "optimizer_s", "rollout_tok_s", "warmup", "needed_gib", "available_gib"):
        assert key in r, f"{key} missing from the record: {sorted(r)}"
    assert "--models tiny,7b" in r["command"] and r["device"] == "cpu"
    # the split is train.py's: everything but collate/metrics bookkeeping falls in one of the four parts
    parts = r["rollout_s"] + r["logprob_pass_s"] + r["backward_s"] + r["optimizer_s"]
    assert 0.75 * r["step_s"] <= parts <= r["step_s"], f"parts {parts:.4f} s vs step {r['step_s']:.4f} s"
    assert math.isclose(r["rollout_tok_s"], r["new_tokens"] / r["rollout_s"])
    # forced length: no stop token, every completion of both steps runs to max tokens
    for step in (r, r["warmup"]):
        assert step["forced"] and step["completion_len_min"] == step["completion_len_max"] == 6, step
        assert step["new_tokens"] == 2 * 4 * 6
    # a real backward through train.py's defaults: LoRA r32 α64, DAPO, AQN noise on
    assert r["grad_norm"] > 0 and math.isfinite(r["grad_norm"]) and r["aqn_sigma"] > 0, r
    assert r["train_flags"] == {**r["train_flags"], "lora_rank": 32, "lora_alpha": 64.0, "loss_type": "dapo",
                                "aqn": True}
    # the step plan (plan.py) as train.py makes it: the pinned micro-batch, no recomputation on a CPU
    assert r["step_plan"]["micro_batch"] == 4 and r["step_plan"]["grad_checkpointing"] is False, r["step_plan"]
    assert r["micro_batches"] == 2, "8 completions, 4 at a time"

    # does not fit: checkpoint.check_fits's need against the injected 1 GiB, reported before any build
    for name in ("7b", "72b"):
        r = rows[name]
        with torch.device("meta"):
            cfg = qmodel.ModelConfig.from_hf(qckpt.SHAPES[f"qwen2.5-{name}"])
            meta = qmodel.Transformer(cfg, "nvfp4", torch.float32)
        assert r["status"] == "does not fit" and r["available_gib"] == 1.0, r
        assert r["needed_gib"] > r["weights_gib"] == qckpt.weight_bytes(meta) / 2 ** 30, r
        assert "build_s" not in r and "step_s" not in r
    table = capsys.readouterr().out
    assert f"does not fit: needs {r['needed_gib']:.1f} GiB, 1.0 GiB free" in table and "| tiny | nvfp4 | 6 |" in table

    # --force runs a configuration that fails the check; a second run merges by (model, quant, completion)
    bench.main(["--models", "tiny", "--quants", "bf16", "--completion", "6", *SMALL, "--available-gib", "1e-4",
                "--force", "--out", out])
    rows = {(r["model"], r["quant"]): r for r in json.load(open(out))["rows"]}
    assert sorted(rows) == [("72b", "nvfp4"), ("7b", "nvfp4"), ("tiny", "bf16"), ("tiny", "nvfp4")], sorted(rows)
    r = rows["tiny", "bf16"]
    assert r["needed_gib"] > r["available_gib"] and r["status"] == "ok" and r["forced"], r
