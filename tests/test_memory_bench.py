"""bench/memory.py: the memory table of a GRPO step by arithmetic, against a hand calculation for a tiny
shape, the verdict for Qwen2.5-72B at the paper's 32B recipe on 76 GiB, and the table against the one
measured step that recomputes (Qwen2.5-32B on an H100, bench/results/step_32b_nvfp4_2048_h100.json)."""
import json
import os

import pytest

import checkpoint
import lora
from test_step_bench import ROOT, load_bench

MIB, G = 2 ** 20, 2 ** 30
TINY = dict(checkpoint.SHAPES["qwen2.5-7b"], vocab_size=256, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)   # head_dim 16, untied, q/k/v bias


@pytest.fixture(scope="module")
def memory():
    return load_bench("memory")


def test_tiny_shape_by_hand(memory):
    """2 layers, hidden 64, intermediate 128, 4 heads of 16 (2 kv), vocab 256; 1 prompt x 2 of 16 + 16
    tokens, LoRA r4, lm_head chunks of 8 rows, 1 MiB a token without recomputation, 1 GiB."""
    recipe = memory.Recipe(prompts=1, group=2, prompt_len=16, completion=16, lora_rank=4, logprob_chunk=8)
    t = memory.memory_table(TINY, recipe, 1 * G, 1 * MIB, 0.0)
    # LoRA: r · (in + out) for q 64+64, k 64+32, v 64+32, o 64+64, gate/up 64+128, down 128+64; and as built
    n = 2 * 4 * (128 + 96 + 96 + 128 + 3 * 192)
    built = checkpoint.build_model(TINY, quant="nvfp4", device="cpu")
    lora.apply_lora(built, lora.LoRAConfig(r=4))
    assert t["lora_parameters"] == n == sum(p.numel() for p in lora.lora_parameters(built)) == 8192
    # weights: NVFP4 codes (1/2 B) and scales (1/16 B) of 2 · 36864 weights, 14 global scales; bf16
    # embedding and lm_head; fp32 norms (2 a layer + the final one); bf16 q/k/v biases; RoPE's 8 inv_freq
    weights = 73728 // 2 + 73728 // 16 + 14 * 4 + 2 * 256 * 64 * 2 + 5 * 64 * 4 + 2 * 128 * 2 + 8 * 4
    in_flight = 2 * max(64 * 3 * 128, 256 * 64)                   # checkpoint.load_bytes: gate/up or the embedding
    graphs = 2 * 2 * 4096 * 2 * 16 * 2 + 64 * (4 * 64 + 3 * 128) * 2   # prefill: staging for 4096 tokens, a 64-token bucket
    graphs += 2 * ((4 * 64 + 3 * 128) * 2 + 4 * 256)               # decode: a step of 2 rows and its fp32 logits
    steady = weights + (4 + 4 + 8 + 2) * n + graphs               # adapters, gradients, AdamW, bf16 copies
    dense = 2 * 73728                                              # 0.25 of the free memory allows them
    a = 8 * 256 * (4 + 2)                                          # one lm_head chunk: fp32 logits, bf16 gradient
    reserve = 16 * (4 * 64 + 3 * 128) * 4 + 2 * 256 * 16 + 2 ** 29     # rollout.activation_reserve
    kv = 2 * 2 * 16 * 2 * 16 * 2 * (2 * 2)                         # 2 sequences of 2 blocks, kept between steps
    assert t["kv_blocks"] == 4
    assert t["totals"] == {"load": weights + in_flight,
                           "probe": weights + 8 * n + dense + a + 2 * 256 * MIB,   # adapters, their gradients
                           "rollout": steady + kv + reserve,
                           "train": steady + dense + kv + a + 2 * 32 * MIB,   # both sequences, no recomputation
                           "optimizer": steady + kv + 4 * n}
    assert t["fits"] and not t["plan"].grad_checkpointing and t["micro_batch"] == 2
    # recomputation's floor for a probe that measured nothing: the layers' inputs and one layer again
    assert t["token_bytes"] == (1 * MIB, 2 * 64 * 2 + MIB / 2)

    # half a GiB: the rollout's reserve alone is that much; the probe's second pass would pass its limit
    t = memory.memory_table(TINY, recipe, 0.5 * G, 1 * MIB, 0.0)
    assert not t["fits"] and t["over"] == ["rollout"], t["totals"]
    assert t["totals"]["probe"] == weights + 8 * n + dense + a + 256 * MIB
    assert memory.longest_completion(TINY, recipe, 0.5 * G, 1 * MIB, 0.0) is None


def test_72b_fits_the_papers_32b_recipe_in_76_gib(memory, capsys, tmp_path):
    out = str(tmp_path / "memory.json")
    t = memory.main(["--model", "qwen2.5-72b", "--prompts", "1", "--group", "8", "--prompt-len", "256",
                     "--completion", "2048", "--budget-gib", "76", "--out", out])
    text = capsys.readouterr().out
    assert t["fits"] and "fits: peak" in text and "of 76 GiB" in text, text
    assert t["lora_parameters"] == 80 * 32 * (2 * 16384 + 2 * 9216 + 3 * 37760)   # q, o; k, v; gate, up, down
    assert t["kv_blocks"] == 8 * 2304 // 16                                         # every sequence's blocks
    assert any(f"{2 * 80 * 8 * 128 * 2 // 1024} KiB a token" in label for label, _, _ in t["rows"])  # 320 KiB
    assert t["plan"].grad_checkpointing and not t["plan"].dense_weights and t["micro_batch"] == 2
    assert max(t["totals"].values()) < 76 * G and t["totals"]["load"] < t["totals"]["rollout"] < t["totals"]["train"]
    assert json.load(open(out))["fits"] is True

    # 50 GiB: the weights, adapters and AdamW (49.4 GiB) leave the rollout less than one sequence's KV
    # cache and the training pass no room, at any completion length
    t = memory.main(["--model", "qwen2.5-72b", "--budget-gib", "50"])
    assert not t["fits"] and t["kv_too_small"] and "train" in t["over"] and t["longest_completion"] is None
    text = capsys.readouterr().out
    assert "does not fit: " in text and "holds less than one sequence" in text and "no completion" in text


def test_the_table_matches_the_measured_32b_step(memory):
    """The one measured step with recomputation: 32B, 16 x 8, 256 + 2048, on an H100 with 78.7 GiB free;
    its plan saw 48.3 GiB (the allocator kept what the build freed). The table's training and rollout peaks
    and KV blocks come within 3% of the measured ones, with the same micro-batches."""
    with open(os.path.join(ROOT, "bench", "results", "step_32b_nvfp4_2048_h100.json")) as f:
        r = json.load(f)["rows"][0]
    cfg = memory.qmodel.ModelConfig.from_hf(checkpoint.SHAPES["qwen2.5-32b"])
    b_full, b_ckpt, _ = memory.token_bytes(cfg, memory.REFERENCE, None)
    recipe = memory.Recipe(prompts=16, group=8, prompt_len=256, completion=2048)
    t = memory.memory_table(checkpoint.SHAPES["qwen2.5-32b"], recipe, r["available_gib"] * G, b_full, b_ckpt,
                            plan_free=48.3 * G)
    assert t["plan"].grad_checkpointing and len(range(0, 128, t["micro_batch"])) == r["micro_batches"] == 22
    for got, want in ((t["totals"]["train"] / G, r["train_peak_gib"]),
                      (t["totals"]["rollout"] / G, r["rollout_peak_gib"]), (t["kv_blocks"], r["kv_blocks"])):
        print(f"table {got:.2f}, measured {want:.2f}")
        assert abs(got / want - 1) < 0.03, (got, want)


def test_scaling_by_layers_and_hidden_predicts_32b_from_7b(memory):
    """What a token keeps, measured on 7B (28 x 3584) and scaled by layers x hidden, comes within 4% of
    the 32B (64 x 5120) measurement: the rule bench/memory.py uses to go from 32B to 72B."""
    cfg32 = memory.qmodel.ModelConfig.from_hf(checkpoint.SHAPES["qwen2.5-32b"])
    from_7b = memory.token_bytes(cfg32, os.path.join(ROOT, "bench", "results", "step_7b_h100.json"), None)[0]
    measured = memory.reference_token_bytes(memory.REFERENCE)[1]
    assert abs(from_7b / measured - 1) < 0.04, (from_7b / MIB, measured / MIB)
