"""bench/quant.py on a tiny random model (CPU): every quantizer's row has what the docstring names,
the KL is a finite non-negative mean over every held-out token, and the mse scales lower the weight
error of rtn's."""
import json
import math

from test_step_bench import load_bench
from test_train import make_tiny_model


def test_every_quantizer_gets_kl_weight_error_and_load_time(smollm2_tokenizer, tmp_path):
    bench = load_bench("quant")
    model = make_tiny_model(smollm2_tokenizer, str(tmp_path / "model"))
    data = tmp_path / "data"
    data.mkdir()
    for split, n in (("train", 3), ("test", 2)):
        rows = [{"question": f"Tom has {i} apples and buys {i + 2} more. How many now?",
                 "answer": f"He has {i} + {i + 2} = {2 * i + 2} apples.\n#### {2 * i + 2}"} for i in range(n)]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "quant.json"
    bench.main(["--model", model, "--data", str(data), "--eval-rows", "2", "--calib-rows", "3",
                "--shapes", "16x64", "--out", str(out)])
    result = json.loads(out.read_text())
    table = result["table"]
    assert set(table) == {"rtn", "mse", "gptq"} and result["calibration_tokens"] > 0
    for name, row in table.items():
        assert row["tokens"] == result["held_out_tokens"] > 0, name
        assert math.isfinite(row["kl_mean"]) and 0 <= row["kl_mean"] <= row["kl_max"], (name, row)
        assert 0 < row["weight_rel_err"] < 0.2 and row["load_seconds"] > 0, (name, row)
    assert table["mse"]["weight_rel_err"] < table["rtn"]["weight_rel_err"]
    assert set(result["quantize_seconds"]) == {"16x64 absmax", "16x64 mse"}


def test_random_init_times_each_quantizer(tmp_path):
    """--random-init builds a random model of a config.json per quantizer and records its seconds (a CPU
    has no peak memory to report); no KL, no tokenizer needed."""
    bench = load_bench("quant")
    shape = tmp_path / "shape"
    shape.mkdir()
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
    (shape / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "time.json"
    bench.main(["--random-init", str(shape), "--calib-rows", "2", "--calib-len", "8", "--out", str(out)])
    rows = json.loads(out.read_text())["random_init"][str(shape)]
    assert set(rows) == {"rtn", "mse", "gptq"}
    assert all(r["seconds"] > 0 and r["peak_gib"] is None for r in rows.values()), rows
