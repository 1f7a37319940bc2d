"""bench/peer.py's arms and summary on CPU (its runs need a GPU and TRL): each qerl arm is evaluated on
the base it trains on, TRL's best arm is one micro-batch of the whole batch without recomputation, and
the summary's ratios are against TRL's best arm, with its defaults beside. On a GPU with the real
SmolLM2, the qerl arm runs its 50 steps to the end."""
import subprocess

import pytest
from test_step_bench import load_bench
from test_train import read_metrics


def test_each_arm_trains_and_is_evaluated_on_its_own_base():
    peer = load_bench("peer")
    assert {arm: peer.quant_of(flags) for arm, flags in peer.OURS.items()} == {
        "qerl": "nvfp4", "qerl_one_round": "nvfp4", "qerl_equal_work": "bf16"}
    assert "--no-dynamic-sampling" in peer.OURS["qerl_equal_work"]
    assert peer.quant_of(["--quant", "bf16", "--seed", "1", "--quant", "nvfp4"]) == "nvfp4"     # the last one wins
    best = peer.TRL["trl_best"]
    assert best["per_device_train_batch_size"] == peer.PROMPTS * peer.GROUP and best["gradient_accumulation_steps"] == 1
    assert best["gradient_checkpointing"] is False
    assert peer.TRL["trl"]["per_device_train_batch_size"] * peer.TRL["trl"]["gradient_accumulation_steps"] == 64


def test_summary_ratios_are_against_trl_at_its_best():
    peer = load_bench("peer")

    def arm(quant, median, mean):
        return dict(quant=quant, step_s=[5.0, 5.0, median, median], wall_s=60.0, accuracy=0.5,
                    accuracy_untrained=0.0, median_step_s=median, mean_step_s=mean)
    text = peer.summary({"qerl": arm("nvfp4", 0.4, 0.8), "trl": arm("bf16", 4.0, 4.0), "trl_best": arm("bf16", 1.2, 1.2)})
    assert ("qerl: 3.00x (median), 1.50x (mean) faster a step than trl_best; "
            "10.00x (median), 5.00x (mean) faster a step than trl") in text
    assert "qerl              nvfp4" in text


def test_an_unknown_arm_is_refused_before_any_run(tmp_path, capsys):
    peer = load_bench("peer")
    with pytest.raises(SystemExit):
        peer.main(["--model", "m", "--only", "ours", "--arms", "qerl,qerl_fast", "--out", str(tmp_path)])
    assert "unknown ['qerl_fast']" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())                    # nothing written, nothing run


@pytest.mark.gpu
def test_gpu_the_qerl_arm_runs_its_50_steps_on_smollm2(smollm2_path, tmp_path):
    """bench/peer.py's qerl arm (train.py's defaults, the round-to-nearest quantizer) on the real
    SmolLM2 runs to its end: with dynamic sampling its decode batches shrink through the CUDA-graph
    buckets from 64 rows down in every step, captured and replayed step after step: a path where the
    carried shrink's readers, which wait on other programs of their launch, hang a run while every
    kernel test passes if their counters live in a graph's pool (kernels/README.md). A hang fails at
    the time limit rather than stall the suite; and the mean reward of the last ten steps is above the
    first ten's by more than 0.2."""
    peer = load_bench("peer")
    out = str(tmp_path / "qerl")
    res = subprocess.run(peer.ours_command(smollm2_path, 50, out, ["--quantizer", "rtn"]),
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 51))
    first, last = (sum(r["reward"] for r in rows[i:i + 10]) / 10 for i in (0, 40))
    assert last > first + 0.2, (first, last)
