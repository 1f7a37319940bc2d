"""bench/scale.py: the torchrun commands it runs on 1, 2 and 4 GPUs, and its summary of a run's
metrics.jsonl rows (made up here, the arithmetic by hand). The runs themselves need GPUs; train.py's
per-rank times under torchrun are tested by tests/test_distributed.py."""
import os
import sys

import pytest

from test_step_bench import ROOT, load_bench


def test_commands_on_1_2_4_gpus(capsys):
    scale = load_bench("scale")
    runs = scale.main(["--gpus", "1,2,4", "--tokenizer", "/tok", "--out", "/runs/scale", "--dry-run"])
    assert sorted(runs) == [1, 2, 4]
    lines = capsys.readouterr().out.splitlines()
    for n, line in zip((1, 2, 4), lines):
        assert line == " ".join([
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
            os.path.join(ROOT, "train.py"), "--model", "qwen2.5-7b", "--random-init", "--tokenizer", "/tok",
            "--dataset", "addition", "--prompts-per-step", "16", "--group-size", "8", "--max-new-tokens", "1024",
            "--dynamic-sampling", "--dynamic-sampling-threshold", "0",
            "--reward", os.path.join(ROOT, "tests", "reward_examples.py") + ":spread_on_even_answers",
            "--max-steps", "6", "--eval-limit", "0", "--save-every", "6", "--output-dir", f"/runs/scale/gpus-{n}"])
    with pytest.raises(SystemExit):
        scale.main(["--gpus", "2", "--dry-run"])            # a random-init shape needs a tokenizer


def test_summary_of_two_ranks():
    """Steps 0 and 1 are warm-up (--skip 2); of steps 2-4 the medians: step 10 s, 24 prompts x 8 of mean
    length 500 = 96,000 tokens / 10 s; rank 1, which drew fewer prompts, waited longer."""
    scale = load_bench("scale")
    rows = [{"step": s, "step_time": t, "time/rollout": 6.0, "time/train": 3.0, "sampling/prompts": 24,
             "sampling/rounds": 2, "completions/mean_length": 500.0, "time/wait": w,
             "time/rank0/rollout": 6.0, "time/rank0/train": 3.0, "time/rank0/wait": w - 0.5,
             "time/rank1/rollout": 6.0, "time/rank1/train": 3.0, "time/rank1/wait": w + 0.5}
            for s, t, w in ((0, 60.0, 9.0), (1, 30.0, 9.0), (2, 10.0, 1.0), (3, 12.0, 2.0), (4, 8.0, 1.5))]
    s = scale.summary(2, rows, 8, 2)
    assert (s["steps"], s["step_s"], s["tokens_per_s"], s["wait_s"]) == (3, 10.0, 24 * 8 * 500 / 10.0, 1.5)
    assert s["ranks"] == [{"rollout": 6.0, "train": 3.0, "wait": 1.0}, {"rollout": 6.0, "train": 3.0, "wait": 2.0}]
    one = scale.summary(1, [{k: v for k, v in r.items() if "rank" not in k and k != "time/wait"} for r in rows], 8, 2)
    assert one["ranks"] == [{"rollout": 6.0, "train": 3.0, "wait": 0.0}] and one["wait_s"] == 0.0
