"""bench/gap.py on a tiny random model (CPU). In float32 the sampler, the training forward and the
fp32 reference compute the same numbers up to fp32 summation order, so every gap is ~0; each bf16
op of the reference moves log-probs measurably; the JSON holds every row the docstring names."""
import json

from test_step_bench import load_bench
from test_train import make_tiny_model


def test_fp32_engines_agree_and_each_bf16_op_moves_the_logprobs(smollm2_tokenizer, tmp_path):
    gap = load_bench("gap")
    model = make_tiny_model(smollm2_tokenizer, str(tmp_path / "model"))
    out = tmp_path / "gap.json"
    gap.main(["--model", model, "--quants", "bf16,nvfp4", "--prompts", "2", "--group", "2", "--max-new-tokens", "5",
              "--dtype", "float32", "--out", str(out)])
    table = json.loads(out.read_text())["table"]
    for quant in ("bf16", "nvfp4"):
        fp32, bf16 = table[quant]["logits fp32"], table[quant]["logits bf16"]
        assert fp32["tokens"] == 2 * 2 * 5 and bf16["tokens"] == fp32["tokens"]
        for side in ("sampler-trainer", "sampler-fp32", "trainer-fp32"):
            assert fp32[side]["mean"] < 1e-4, (quant, side, fp32[side])
        for op in ("linear", "attention", "norm", "lm_head"):
            assert fp32[f"bf16 {op}-fp32"]["mean"] > 1e-4, (quant, op)
        assert bf16["sampler-fp32"]["mean"] > 1e-4               # the bf16-rounded logits are off fp32
