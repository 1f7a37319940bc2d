"""plan.py: the micro-batch packing rule, the decisions from given measurements (numbers worked out
by hand below), and the dense weight copies against the NVFP4 path they replace."""
import pytest
import torch

import checkpoint
import lora
import plan
from conftest import fake_gpu_memory
from plan import StepPlan, decide, micro_batches

MIB, G = 2 ** 20, 2 ** 30
P7, P32 = 7.6e9, 32.8e9      # parameters of Qwen2.5-7B and -32B (ANCHORS.md)


def test_micro_batches_pack_consecutive_sequences_under_the_token_budget():
    lens = [100, 300, 200, 50, 400, 10]
    # count · longest <= 600: [100, 300] (2·300 = 600), [200, 50] (400; + 400 would be 3·400), [400, 10] (800?)
    spans = micro_batches(lens, StepPlan(None, 600, False, False, False, 0, ""))
    assert spans == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert all((e - s) * max(lens[s:e]) <= 600 or e - s == 1 for s, e in spans)
    assert micro_batches(lens, StepPlan(None, 10, False, False, False, 0, "")) == [(i, i + 1) for i in range(6)]  # one at least
    assert micro_batches(lens, StepPlan(None, None, False, False, False, 0, "")) == [(0, 6)]   # no budget: the whole batch
    assert micro_batches(lens, StepPlan(4, None, False, False, False, 0, "")) == [(0, 4), (4, 6)]   # pinned count
    assert micro_batches([], StepPlan(None, 600, False, False, False, 0, "")) == []


def test_decisions_from_measurements():
    """free 40 GiB -> budget 0.85 · 40 = 34 GiB. Without recomputation a token keeps 6 MiB and 2 GiB are
    fixed: (34 GiB - 2 GiB) / 6 MiB = 5461 tokens; with it 0.5 MiB / token."""
    p = decide(40 * G, 2 * G, 6 * MIB, 2 * G, 0.5 * MIB, 1280, P7, None, None, True)
    assert not p.grad_checkpointing and p.micro_tokens == 5461 and p.dense_weights
    assert p.keep_cache_bytes == int(0.1 * 32 * G)
    # a sequence of 8000 tokens does not fit without recomputation: recompute, budget 65536 tokens
    # (under the FLOP cap, 10^15 / (2 · 7.6e9) = 65789)
    p = decide(40 * G, 2 * G, 6 * MIB, 2 * G, 0.5 * MIB, 8000, P7, None, None, False)
    assert p.grad_checkpointing and p.micro_tokens == 65536
    # pinned choices win; a budget below one sequence still takes one sequence
    p = decide(40 * G, 2 * G, 6 * MIB, 2 * G, 0.5 * MIB, 1280, P7, 8, True, False)
    assert p.grad_checkpointing and p.micro_batch == 8 and p.micro_tokens is None
    assert decide(3 * G, 2.5 * G, 6 * MIB, 2.5 * G, 6 * MIB, 1280, P7, None, False, False).micro_tokens == 1280


def test_cpu_plan_is_one_micro_batch():
    model = checkpoint.build_model(dict(checkpoint.SHAPES["qwen2.5-7b"], vocab_size=64, hidden_size=64,
                                        intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2), quant="bf16", device="cpu", dtype=torch.float32)
    p = plan.make_plan(model, None, 100, None, None, 10, "cpu")
    assert p.micro_batch is None and p.micro_tokens is None and not p.grad_checkpointing and not model.gradient_checkpointing
    assert "micro-batches of the whole batch" in plan.describe(p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_weights_give_the_nvfp4_layers_output_and_are_dropped_after(dtype):
    cfg = dict(checkpoint.SHAPES["qwen2.5-7b"], vocab_size=64, hidden_size=64, intermediate_size=128,
               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    model = checkpoint.build_model(cfg, quant="nvfp4", device="cpu", dtype=dtype)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        want = model(ids)
        with plan.dense_weights(model, True):
            layers = [m for m in model.modules() if hasattr(m, "weight_packed")]
            assert layers and all(m.dense is not None and m.dense.dtype == dtype for m in layers)
            got = model(ids)
    assert all(m.dense is None for m in layers)
    assert torch.equal(got, want), "the dense copy is the dequantized weight the CPU path multiplies by"


def test_recompute_floor_keeps_the_layer_inputs_and_one_layer_again():
    """32B (64 layers, 5120 wide, bf16) with b_full = 19.2 MiB and a probe that measured ~0: 64·5120·2 B
    of layer inputs + 19.2/64 MiB for the layer being recomputed; with it the plan cuts 48 GiB into
    micro-batches of ~44k tokens, where the ~0 would allow any number. 7B's measured 0.27 MiB, above
    its 28·3584·2 B of inputs, stands."""
    floor = plan.recompute_bytes(1 / 256, 19.2 * MIB, 64, 5120, 2)
    assert floor == 64 * 5120 * 2 + 19.2 * MIB / 64
    assert plan.recompute_bytes(0.27 * MIB, 6.06 * MIB, 28, 3584, 2) == 0.27 * MIB
    p = decide(48 * G, 2 * G, 19.2 * MIB, 2 * G, floor, 2304, 1e6, None, None, False)   # a model too small to cap
    assert p.grad_checkpointing and 40_000 < p.micro_tokens < 46_000


def test_flop_cap_bounds_a_large_models_micro_batch():
    """The same 32B measurements with its 32.8e9 parameters: 10^15 / (2 · 32.8e9) = 15243 tokens, where
    memory alone allows ~44k; a cap below one sequence still takes one sequence."""
    floor = plan.recompute_bytes(1 / 256, 19.2 * MIB, 64, 5120, 2)
    assert decide(48 * G, 2 * G, 19.2 * MIB, 2 * G, floor, 2304, P32, None, None, False).micro_tokens == 15243
    assert decide(48 * G, 2 * G, 19.2 * MIB, 2 * G, floor, 2304, P32, None, None, False, why="m").why == \
        "m; capped at 1e+15 FLOP of forward work: 15243 tokens"
    assert decide(48 * G, 2 * G, 19.2 * MIB, 2 * G, floor, 20000, P32, None, None, False).micro_tokens == 20000


@pytest.mark.parametrize("quant", ["nvfp4", "bf16"])
def test_parameters_count_each_nvfp4_weight_as_its_matrix(quant):
    """One layer, hidden 64, intermediate 128, 4 heads of 16 (2 kv), vocab 64, untied head: by hand,
    q 64·64 + k, v 2 · 32·64 + o 64·64 + gate, up 2 · 128·64 + down 64·128 + biases 64 + 32 + 32,
    two norms 2 · 64, final norm 64, embedding and head 2 · 64·64; the same whether bf16 or NVFP4."""
    cfg = dict(checkpoint.SHAPES["qwen2.5-7b"], vocab_size=64, hidden_size=64, intermediate_size=128,
               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = checkpoint.build_model(cfg, quant=quant, device="cpu", dtype=torch.float32)
    want = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64 + 128 + 3 * 64 + 2 * 64 * 64
    assert plan.parameters(model) == want


@pytest.mark.parametrize("quant", ["nvfp4", "bf16"])
def test_a_plain_base_keeps_its_adapted_weights_for_merged_sampling(quant):
    """make_plan without a GPU: a bf16 (here fp32) base gets a copy of each adapted weight, in its own
    storage, which lora.merged_sampling restores from, and the plan says it samples merged; an NVFP4
    base cannot merge and keeps nothing. The state dict (what checkpoints save) is unchanged."""
    cfg = dict(checkpoint.SHAPES["qwen2.5-7b"], vocab_size=64, hidden_size=64, intermediate_size=128,
               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    model = lora.apply_lora(checkpoint.build_model(cfg, quant=quant, device="cpu", dtype=torch.float32),
                            lora.LoRAConfig(r=4, alpha=8))
    keys = set(model.state_dict())
    p = plan.make_plan(model, None, 64, None, None, 0, "cpu")
    mods = list(lora.lora_modules(model).values())
    assert len(mods) == 7 and p.merged_sampling == (quant == "bf16")
    assert ("adapters merged for sampling on" in plan.describe(p)) == (quant == "bf16")
    assert all((m.kept is not None) == (quant == "bf16") for m in mods)
    if quant == "bf16":
        assert all(torch.equal(m.kept, m.base_layer.weight) and m.kept.data_ptr() != m.base_layer.weight.data_ptr()
                   for m in mods)
    assert set(model.state_dict()) == keys


def test_free_memory_honours_the_per_process_limit(monkeypatch):
    """What the plan, the KV cache and checkpoint.check_fits read: the device's free memory, or, under
    set_per_process_memory_fraction (an 80 GB card emulated on a 140 GiB one), the limit less what this
    process has reserved: 0.5 · 140 - 20 = 50 GiB of the 100 free."""
    cuda = torch.device("cuda", 0)
    fake_gpu_memory(monkeypatch, 100, 140, reserved_gib=20)
    assert plan.free_memory(cuda) == 100 * G
    fake_gpu_memory(monkeypatch, 100, 140, fraction=0.5, reserved_gib=20)
    assert plan.free_memory(cuda) == 50 * G
    fake_gpu_memory(monkeypatch, 100, 140, fraction=0.1, reserved_gib=20)
    assert plan.free_memory(cuda) == 0, "past its limit a process has nothing left, not a negative amount"
    fake_gpu_memory(monkeypatch, 100, 140, fraction=0.5, reserved_gib=20)
    assert plan.free_memory(torch.device("cuda")) == 50 * G, "train.py's --device cuda: the current device"


def test_probe_skips_the_two_sequence_pass_that_would_not_fit(monkeypatch):
    """The probe on made-up memory: a pass over T tokens peaks at a + b·T above the baseline (a = 3 MiB,
    b = 1 MiB, T = PROBE_TOKENS). With room for it, both passes run and (a, b) come back exactly; where
    twice the first peak passes the limit, the second never runs and b = (a + b·T) / T, a = 0."""
    T, a, b = plan.PROBE_TOKENS, 3 * MIB, 1 * MIB
    stats, passes = {"peak": 0}, []

    def fwd_bwd(ids, prompt_lens, comp_lens):
        passes.append(ids.numel())
        stats["peak"] = a + b * ids.numel()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: stats.update(peak=0))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: stats["peak"])
    model = torch.nn.Linear(2, 2)
    assert plan._probe(fwd_bwd, model, 64, False, "cpu", 2 * (a + b * T)) == (a, b) and passes == [T, 2 * T]
    passes.clear()
    assert plan._probe(fwd_bwd, model, 64, False, "cpu", 2 * (a + b * T) - 1) == (0.0, (a + b * T) / T)
    assert passes == [T], "the two-sequence pass ran past its limit"
