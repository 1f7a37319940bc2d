"""Qwen3 dense models end to end: model.py, checkpoint.py, lora.py, rollout.py and the chat-template
switch of train.py / eval.py, each against an independent reference.

Qwen3 differs from Qwen2 in small, checkable ways: an RMSNorm over each head of q and of k before
RoPE (q_norm, k_norm), no q/k/v bias, head_dim given in the config (the tiny model here has heads of
32 on a hidden size of 64 with 4 heads, so q_proj is 64 -> 128), and a chat template with a thinking
switch (enable_thinking). References: transformers' own Qwen3ForCausalLM (fp32 logits, its generate,
its meta-device parameter count), PEFT on it for the adapters, a hand-written Jinja template (the
shape of Qwen3's) for the chat-template kwargs. The tiny checkpoints come from conftest.make_tiny_hf,
with random norm weights (q_norm / k_norm included); the CPU sampler's greedy test is
tests/test_rollout.py's, run on qwen3 too.
"""
import json
import math
import os

import pytest
import torch

import aqn
import checkpoint as C
import eval as qeval
import kernels
import lora
import model as M
import nvfp4
import tasks
import train
from conftest import (against_hf, assert_greedy_like_hf, assert_same_completions, batch, hf_logits, load32,
                      make_tiny_hf, random_prompts, rel_err)
from rollout import LLMEngine, SamplingParams

QWEN3_TINY_HEAD_DIM = 32     # conftest's Qwen3: 4 heads of 32 on a hidden size of 64


def dequantize_into(hf, ours):
    """Give transformers' model our NVFP4 weights, dequantized, so the two compare exactly."""
    with torch.no_grad():
        for name, mod in ours.named_modules():
            if isinstance(mod, nvfp4.NVFP4Linear):                  # under LoRA: <path>.base_layer
                target = hf.get_submodule(name.removesuffix(".base_layer"))
                target.weight.copy_(mod.dequantized_weight(torch.float32))
    return hf


# ----------------------------------------------------------------------------------------------
# model.py: logits equal transformers' Qwen3


@pytest.mark.parametrize("tie", [False, True])
def test_qwen3_logits_match_transformers_fp32(tiny_hf_dir, tie):
    path, hf = tiny_hf_dir("qwen3", tie)
    model = load32(path)
    cfg, attn = model.config, model.model.layers[0].self_attn
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and not cfg.attention_bias
    assert cfg.head_dim == QWEN3_TINY_HEAD_DIM != cfg.hidden_size // cfg.num_heads
    assert (attn.q_proj.in_features, attn.q_proj.out_features) == (64, 128) and attn.q_proj.bias is None
    assert (attn.o_proj.in_features, attn.o_proj.out_features) == (128, 64) and attn.o_proj.bias is None
    assert torch.equal(attn.q_norm.weight, hf.model.layers[0].self_attn.q_norm.weight)
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (QWEN3_TINY_HEAD_DIM,)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    ours, _, (err, err_h, err0) = against_hf(model, hf)
    print(f"qwen3 tie={tie}: logits rel err {err:.2e}, hidden {err_h:.2e}, default positions {err0:.2e}")
    assert ours.shape == (3, 24, 256) and err < 1e-5 and err_h < 1e-5 and err0 < 1e-5


def test_qwen3_q_norm_and_k_norm_are_applied_before_rope(tiny_hf_dir):
    """Changing one layer's q_norm (k_norm) weight changes the logits as it changes transformers'
    (so the norms are used, with the right weight each), and the logits still match."""
    path, hf = tiny_hf_dir("qwen3")
    model = load32(path)
    ids, pos = batch(seed=2)
    with torch.no_grad():
        before = model(ids, pos)
        for which in ("q_norm", "k_norm"):
            w = torch.linspace(0.5, 1.5, QWEN3_TINY_HEAD_DIM)
            getattr(model.model.layers[1].self_attn, which).weight.copy_(w)
            getattr(hf.model.layers[1].self_attn, which).weight.copy_(w)
            ours, ref = model(ids, pos), hf_logits(hf, ids, pos)
            assert rel_err(ours, ref) < 1e-5, which
            assert rel_err(ours, before) > 1e-3, f"{which} changed nothing"
            before = ours


def test_qwen3_bf16_model_keeps_per_head_norms_fp32_and_aqn_leaves_them_alone(tiny_hf_dir):
    path, hf = tiny_hf_dir("qwen3")
    model = C.load_model(path, quant="bf16", device="cpu")
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.dtype == attn.k_norm.weight.dtype == torch.float32
    assert attn.q_proj.weight.dtype == torch.bfloat16
    noisy = aqn.noisy_norms(model)
    assert len(noisy) == 2 * model.config.num_layers
    assert not [n for n in noisy if n.endswith(("q_norm", "k_norm"))]
    noise = aqn.sample_noise(model, 1e-2, torch.Generator().manual_seed(0))
    q_norms = {n: p.clone() for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n}
    ids, pos = batch()
    with torch.no_grad():
        clean = model(ids, pos)
        with aqn.noise_applied(model, noise):
            for n, p in model.named_parameters():
                if n in q_norms:
                    assert torch.equal(p, q_norms[n]), f"AQN touched {n}"
            noisy_out = model(ids, pos)
        err = rel_err(clean, hf_logits(hf, ids, pos))
    assert not torch.equal(clean, noisy_out), "AQN noise on input/post_attention_layernorm must change the logits"
    print(f"qwen3 bf16 vs fp32 transformers: rel err {err:.2e}")
    assert err < 3e-2


@pytest.mark.parametrize("tie", [False, True])
def test_qwen3_nvfp4_logits_match_transformers_with_dequantized_weights(tiny_hf_dir, tie):
    path, hf = tiny_hf_dir("qwen3", tie)
    model = load32(path, quant="nvfp4")
    attn = model.model.layers[0].self_attn
    assert type(attn.q_norm.weight) is torch.nn.Parameter and attn.q_norm.weight.dtype == torch.float32
    with torch.no_grad():  # reference: transformers with each target weight replaced by dequant(quant(W))
        for name, mod in hf.named_modules():
            if name.rpartition(".")[2] in M.QUANTIZED:
                ours = model.get_submodule(name)
                assert isinstance(ours, nvfp4.NVFP4Linear), name
                group = [hf.get_submodule(n).weight for n in C.group_of(name)]   # q/k/v share one scale
                amax = max(w.double().abs().max().item() for w in group)
                assert ours.weight_global_scale.item() == pytest.approx(448 * 6 / amax, rel=1e-6), name
                packed, scale, g = nvfp4.quantize(mod.weight, ours.weight_global_scale)
                assert torch.equal(ours.weight_packed, packed) and torch.equal(ours.weight_scale, scale)
                mod.weight.copy_(nvfp4.dequantize(packed, scale, g))
    ids, pos = batch()
    with torch.no_grad():
        err = rel_err(model(ids, pos), hf_logits(hf, ids, pos))
    print(f"nvfp4 qwen3 tie={tie}: logits rel err vs dequantized transformers {err:.2e}")
    assert err < 1e-5


def test_qwen3_gradient_checkpointing_changes_no_bit(tiny_hf_dir):
    path, _ = tiny_hf_dir("qwen3")
    model = load32(path, quant="nvfp4")
    model.model.embed_tokens.weight.requires_grad_(True)
    ids, pos = batch()
    with torch.no_grad():
        ref = model(ids, pos)
    model.gradient_checkpointing = True
    out = model(ids, pos)
    assert torch.equal(out.detach(), ref)
    out.logsumexp(-1).mean().backward()
    assert model.model.embed_tokens.weight.grad.abs().max() > 0


# ----------------------------------------------------------------------------------------------
# ModelConfig: transformers' config.json both ways, sliding windows refused


def test_qwen3_config_round_trips_with_transformers():
    from transformers import Qwen3Config
    hf = Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
                     rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096,
                     architectures=["Qwen3ForCausalLM"])
    d5 = hf.to_dict()                                     # transformers 5: rope_parameters, layer_types
    assert "rope_parameters" in d5 and d5["layer_types"] == ["full_attention"] * 3
    cfg = M.ModelConfig.from_hf(d5)
    assert (cfg.head_dim, cfg.rope_theta, cfg.tie_word_embeddings, cfg.attention_bias) == (32, 1e6, True, False)
    assert M.ModelConfig.from_hf(cfg.to_hf()) == cfg
    back = Qwen3Config(**cfg.to_hf())                     # what transformers reads from our config.json
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
              "max_position_embeddings", "layer_types", "sliding_window"):
        assert getattr(back, k) == getattr(hf, k), k
    assert back.rope_parameters["rope_theta"] == 1e6 and back.model_type == "qwen3"
    # a transformers-4 config.json (Qwen3-8B's spelling): rope_theta on top, rope_scaling null
    d4 = {k: v for k, v in d5.items() if k not in ("rope_parameters", "layer_types")}
    d4.update(rope_theta=1000000, rope_scaling=None, use_sliding_window=False, sliding_window=None,
              max_window_layers=3)
    assert M.ModelConfig.from_hf(d4) == cfg
    # no architectures, model_type only; a missing head_dim is transformers' Qwen3 default, 128
    d = {k: v for k, v in d4.items() if k not in ("architectures", "head_dim")}
    assert M.ModelConfig.from_hf(d).head_dim == Qwen3Config(**d).head_dim == 128


def test_qwen3_config_with_sliding_windows_is_refused():
    from transformers import Qwen3Config
    d = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, use_sliding_window=True, sliding_window=64,
                    max_window_layers=2).to_dict()
    assert "sliding_attention" in d["layer_types"]
    with pytest.raises(ValueError, match="sliding-window attention"):
        M.ModelConfig.from_hf(d)
    d.pop("use_sliding_window")                           # transformers 5: layer_types alone says it
    with pytest.raises(ValueError, match=r"sliding-window.*sliding_attention"):
        M.ModelConfig.from_hf(d)
    d["layer_types"] = ["full_attention"] * 4             # the window defined but used by no layer: fine
    assert M.ModelConfig.from_hf(d).num_layers == 4


# ----------------------------------------------------------------------------------------------
# checkpoint.py: SHAPES, save / load


@pytest.mark.parametrize("name,params,published", [("qwen3-8b", 8_190_735_360, 8.19e9),
                                                   ("qwen3-32b", 32_762_123_264, 32.8e9)])
def test_qwen3_shapes_build_on_meta_with_the_real_parameter_count(name, params, published):
    """Qwen3-8B's model card: 8.2B parameters (6.95B without embeddings); Qwen3-32B's: 32.8B. The
    count and every tensor shape equal transformers' Qwen3ForCausalLM built from the same config."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    assert C.random_init_config(name) is C.SHAPES[name]
    with torch.device("meta"):
        ours = M.Transformer(M.ModelConfig.from_hf(C.SHAPES[name]), "bf16")
        hf = Qwen3ForCausalLM(Qwen3Config(**C.SHAPES[name]))
    n = sum(p.numel() for p in ours.parameters())              # parameters() yields a tied weight once
    assert n == sum(p.numel() for p in hf.parameters()) == params
    assert n == pytest.approx(published, rel=5e-3)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}
    cfg = ours.config
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.tie_word_embeddings) == (128, 8, 1e6, False)
    if name == "qwen3-8b":
        non_embedding = n - 2 * cfg.vocab_size * cfg.hidden_size
        assert non_embedding == pytest.approx(6.95e9, rel=5e-3)
        with torch.device("meta"):
            q = M.Transformer(cfg, "nvfp4")
        assert C.weight_bytes(q) / 2**30 < 0.4 * C.weight_bytes(ours) / 2**30


@pytest.mark.parametrize("quant", ["bf16", "nvfp4"])
def test_qwen3_build_model_runs_and_save_pretrained_loads_back(tmp_path, quant):
    """A random-init Qwen3 (checkpoint.build_model, tiny shape) saved by save_pretrained: transformers
    loads the bf16 one with the same logits; ours loads either back bit for bit (NVFP4 not
    re-quantized, the per-head norms full precision)."""
    from transformers import AutoModelForCausalLM
    cfg = dict(C.SHAPES["qwen3-8b"], vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    model = C.build_model(cfg, quant=quant, device="cpu", dtype=torch.float32, seed=0)
    with torch.no_grad():                                  # norms off 1 so that a dropped one shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.1)
    C.save_pretrained(model, str(tmp_path))
    ids, pos = batch()
    back = load32(str(tmp_path), quant=quant)
    with torch.no_grad():
        ref = model(ids, pos)
        assert torch.equal(back(ids, pos), ref)
    assert back.model.layers[1].self_attn.k_norm.weight.dtype == torch.float32
    if quant == "bf16":
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
        assert type(hf).__name__ == "Qwen3ForCausalLM"
        with torch.no_grad():
            err = rel_err(hf_logits(hf, ids, pos), ref)
        assert err < 1e-5, f"transformers reading our Qwen3 checkpoint: rel err {err:.2e}"


# ----------------------------------------------------------------------------------------------
# lora.py: adapters round-trip with PEFT on transformers' Qwen3, both ways


def randomize_adapters(model, seed=0, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora.lora_modules(model).values():
            m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * scale)
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * scale)


def peft_config(cfg: lora.LoRAConfig):
    from peft import LoraConfig
    return LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=0.0, use_rslora=cfg.use_rslora,
                      target_modules=list(cfg.target_modules), task_type="CAUSAL_LM")


@pytest.mark.parametrize("quant", ["bf16", "nvfp4"])
def test_qwen3_lora_adapter_round_trips_with_peft(tiny_hf_dir, tmp_path, quant):
    from peft import PeftModel, get_peft_model
    path, hf = tiny_hf_dir("qwen3", seed=5)
    cfg = lora.LoRAConfig(r=8, alpha=16)
    ids, pos = batch(B=2, T=12)
    ours = load32(path, quant)
    dequantize_into(hf, ours)                       # nvfp4: transformers gets the same (dequantized) weights
    lora.apply_lora(ours, cfg)
    randomize_adapters(ours)
    with torch.no_grad():
        a, base = ours(ids, pos), hf_logits(hf, ids, pos)
        with lora.adapters_disabled(ours):
            assert rel_err(ours(ids, pos), base) < 1e-5
    assert rel_err(a, base) > 1e-3, "the adapters changed nothing"
    # ours -> PEFT: our adapter file, read by PEFT on transformers' Qwen3, gives our logits
    lora.save_adapter(ours, str(tmp_path / "ours"), base_model_name_or_path=path)
    pm = PeftModel.from_pretrained(hf, str(tmp_path / "ours"))
    with torch.no_grad():
        err = rel_err(hf_logits(pm, ids, pos), a)
    print(f"qwen3 {quant}: our adapter in PEFT, rel err {err:.2e}")
    assert err < 1e-5
    # PEFT -> ours: PEFT's own adapter (random, B non-zero), saved by PEFT, loaded into ours
    hf2 = dequantize_into(make_tiny_hf("qwen3", seed=5), ours)
    cfg2 = lora.LoRAConfig(r=4, alpha=32, use_rslora=True, target_modules=("q_proj", "k_proj", "o_proj", "up_proj"))
    pm2 = get_peft_model(hf2, peft_config(cfg2))
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for n, p in pm2.named_parameters():
            if "lora_" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    pm2.save_pretrained(str(tmp_path / "peft"))
    back = lora.load_adapter(load32(path, quant), str(tmp_path / "peft"))
    names = [p.rpartition(".")[2] for p in lora.lora_modules(back)]
    assert len(names) == 8 and set(names) == {"q_proj", "k_proj", "o_proj", "up_proj"}
    with torch.no_grad():
        b, ref = back(ids, pos), hf_logits(pm2, ids, pos)
    err = rel_err(b, ref)
    print(f"qwen3 {quant}: PEFT's adapter in ours, rel err {err:.2e}")
    assert err < 1e-5 and rel_err(b, a) > 1e-3


# ----------------------------------------------------------------------------------------------
# rollout.py: the paged sampler on Qwen3 (its CPU greedy test against transformers' generate is
# tests/test_rollout.py's, parametrized over qwen3 with and without preemption)


def _count_head_norms(monkeypatch, head_dim):
    """Record the fused RMSNorm calls over head_dim-wide rows (q_norm, k_norm on the fast path)."""
    calls, real = [], kernels.rms_norm
    monkeypatch.setattr(kernels, "rms_norm", lambda x, w, eps, residual=None, group=None:
                        calls.append(w.numel() == head_dim) or real(x, w, eps, residual, group))
    return calls


@pytest.mark.slow
@pytest.mark.interpreter
def test_qwen3_triton_backend_matches_torch_backend_on_cpu(tiny_hf_dir):
    model = load32(tiny_hf_dir("qwen3")[0])
    prompts = random_prompts([14, 30], seed=5)
    params = SamplingParams(temperature=0, max_tokens=6, n=2, stop_token_ids=())
    ref = LLMEngine(model, block_size=16, attn_backend="torch").generate(prompts, params)
    out = LLMEngine(model, block_size=16, attn_backend="triton", partition_size=16).generate(prompts, params)
    assert_same_completions(ref, out)


@pytest.mark.interpreter
def test_qwen3_fused_decode_gets_normed_q_k_and_matches_the_torch_backend(tiny_hf_dir, monkeypatch):
    """The rollout path's kernels on the CPU (fused ops on, Triton interpreter): q_norm / k_norm run
    as the fused RMSNorm on the stacked q/k/v output, and every decode layer hands the normed q, k
    to the one kernel that rotates, stores k, v and attends; tokens and logprobs equal the torch
    backend's with torch ops (fp32)."""
    model = load32(tiny_hf_dir("qwen3")[0])
    prompts = random_prompts([14, 30], seed=5)
    params = SamplingParams(temperature=0, max_tokens=6, n=2, stop_token_ids=())
    ref = LLMEngine(model, block_size=16, attn_backend="torch").generate(prompts, params)
    rope_calls, real = [], kernels.paged_attention

    def paged_attention(*a, rope=None, **kw):
        rope_calls.append(rope is not None)
        return real(*a, rope=rope, **kw)
    monkeypatch.setattr(kernels, "paged_attention", paged_attention)
    norm_calls = _count_head_norms(monkeypatch, QWEN3_TINY_HEAD_DIM)
    monkeypatch.setattr(kernels, "runs", lambda x: not torch.is_grad_enabled())   # the fast path on CPU tensors
    engine = LLMEngine(model, block_size=16, attn_backend="triton")
    out = engine.generate(prompts, params)
    L = model.config.num_layers
    assert rope_calls.count(True) == len(rope_calls) == engine.stats["decode_steps"] * L > 0
    assert norm_calls.count(True) == 2 * L * (engine.stats["decode_steps"] + engine.stats["prefill_steps"])
    assert_same_completions(ref, out)


# ----------------------------------------------------------------------------------------------
# --chat-template-kwargs: parse-time errors, and the kwarg reaches the template

# Qwen3's thinking switch, as its chat template writes it: with enable_thinking false the assistant
# turn opens with an empty think block.
TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")
NO_THINK = "<think>\n\n</think>\n\n"


def byte_tokenizer():
    """A byte-level tokenizer made here (no download): 256 byte tokens, then <|im_end|> (eos),
    <|endoftext|> (pad), <|im_start|>, with TEMPLATE as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = TEMPLATE
    return fast


@pytest.mark.parametrize("value, message", [
    ("[1, 2]", "JSON list"), ('"enable_thinking"', "JSON str"), ("{enable_thinking: false}", "not JSON"),
    ('{"tokenize": true}', "tokenize"),
])
@pytest.mark.parametrize("main", ["train", "eval"])
def test_bad_chat_template_kwargs_are_refused_by_name(main, value, message, capsys):
    argv = ["--model", "unused", "--chat-template-kwargs", value]
    with pytest.raises(SystemExit):
        train.parse_args(argv) if main == "train" else qeval.main(argv)
    err = capsys.readouterr().err
    assert "--chat-template-kwargs" in err and message in err, err


def test_chat_template_kwargs_reach_the_template():
    tok = byte_tokenizer()
    messages = [{"role": "system", "content": tasks.SYSTEM_PROMPT}, {"role": "user", "content": "What is 2 + 3?"}]
    args = train.parse_args(["--model", "m", "--chat-template-kwargs", '{"enable_thinking": false}'])
    kw = args.chat_template_kwargs
    assert kw == {"enable_thinking": False}
    assert train.parse_args(["--model", "m"]).chat_template_kwargs is None
    text = tasks.build_prompt(tok, "What is 2 + 3?", chat_template_kwargs=kw)
    ref = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text == ref
    assert text.endswith("<|im_start|>assistant\n" + NO_THINK)
    assert not tasks.build_prompt(tok, "What is 2 + 3?").endswith(NO_THINK)      # the default: thinking on
    thinking = tasks.build_prompt(tok, "What is 2 + 3?", chat_template_kwargs={"enable_thinking": True})
    assert not thinking.endswith(NO_THINK)
    ids = tasks.encode_prompt(tok, "What is 2 + 3?", chat_template_kwargs=kw)
    ref = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, enable_thinking=False)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref        # transformers 5: a BatchEncoding
    assert ids == list(ref)
    assert tok.decode(ids[-len(tok(NO_THINK)["input_ids"]):]) == NO_THINK


def test_train_and_eval_on_a_tiny_qwen3_pass_the_kwargs_to_every_prompt(tmp_path, monkeypatch):
    """train.py then eval.py end to end on a tiny random Qwen3 (CPU) with the byte tokenizer: every
    prompt either encodes (training, evaluation) was built with enable_thinking=False, and
    run_config.json records the flag."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    tok = byte_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model_dir = str(tmp_path / "qwen3")
    Qwen3ForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    texts, real = [], tasks.build_prompt
    monkeypatch.setattr(tasks, "build_prompt", lambda *a, **k: texts.append(real(*a, **k)) or texts[-1])
    flag = ["--chat-template-kwargs", '{"enable_thinking": false}']
    out = str(tmp_path / "run")
    train.main(["--model", model_dir, "--output-dir", out, "--max-steps", "1", "--dataset", "addition",
                "--group-size", "2", "--prompts-per-step", "2", "--max-new-tokens", "4", "--eval-limit", "2",
                "--dtype", "float32", "--micro-batch", "4", "--lora-rank", "4", "--save-every", "1",
                "--no-dynamic-sampling", *flag])     # a random model's rewards are all 0: keep the one round
    with open(os.path.join(out, "run_config.json")) as f:
        assert json.load(f)["chat_template_kwargs"] == {"enable_thinking": False}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert "loss" in json.loads(f.readline()), "the step trained"
    n_train = len(texts)
    assert n_train > 2 and all(t.endswith(NO_THINK) for t in texts)
    metrics = qeval.main(["--model", model_dir, "--dataset", "addition", "--limit", "3", "--max-new-tokens", "4",
                          "--dtype", "float32", *flag])
    # 3 questions, and the first once more: eval.py tries the chat template on it before the model loads
    assert metrics["n_questions"] == 3 and len(texts) == n_train + 1 + 3 and all(t.endswith(NO_THINK) for t in texts)
    assert math.isfinite(metrics["accuracy"])


# ----------------------------------------------------------------------------------------------
# GPU: the fused decode path and CUDA graphs on Qwen3


@pytest.mark.gpu
def test_gpu_qwen3_greedy_matches_hf_generate_fp32(tiny_hf_dir, monkeypatch):
    """The Triton path (fp32) inside the engine, with and without CUDA graphs, at batch 8 and 1:
    q_norm / k_norm run as the fused RMSNorm, the decode kernel rotates the normed q, k."""
    path, hf = tiny_hf_dir("qwen3")
    hf = hf.cuda()
    model = C.load_model(path, quant="bf16", device="cuda", dtype=torch.float32)
    norm_calls = _count_head_norms(monkeypatch, QWEN3_TINY_HEAD_DIM)
    assert_greedy_like_hf(model, hf)
    assert norm_calls.count(True) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,quant", [(torch.float32, "bf16"), (torch.bfloat16, "bf16"),
                                         (torch.bfloat16, "nvfp4")])
def test_gpu_qwen3_fused_forward_matches_the_training_forward(dtype, quant):
    """Qwen3-0.6B's attention shape (hidden 1024, 16 heads of 128: q_proj 1024 -> 2048), random
    q_norm / k_norm: the no-grad forward (stacked q/k/v, fused norms / RoPE) vs the torch-op forward."""
    cfg = M.ModelConfig("Qwen3ForCausalLM", vocab_size=4096, hidden_size=1024, intermediate_size=3072,
                        num_layers=4, num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1e6)
    model = C.build_model(cfg, quant, "cuda", dtype=dtype, seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.2)
    ids = torch.randint(0, 4096, (4, 64), device="cuda")
    with torch.no_grad():
        fused = model(ids).float()
    with torch.enable_grad():
        plain = model(ids).float()
    err = rel_err(fused, plain)
    print(f"qwen3 fused vs torch-op forward ({dtype}, {quant}): logits rel err {err:.2e}")
    assert err < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_qwen3_nvfp4_lora_sampler_logprobs_match_dense_forward(tiny_hf_dir, graphs):
    """NVFP4 base + LoRA (non-zero B) in bf16 on the GPU, eager and CUDA-graph decode: the sampler's
    logprobs equal a dense bf16 forward of the finished sequences within bf16 noise."""
    model = C.load_model(tiny_hf_dir("qwen3")[0], quant="nvfp4", device="cuda", dtype=torch.bfloat16)
    lora.apply_lora(model, lora.LoRAConfig(r=4, alpha=8))
    with torch.no_grad():
        for m in lora.lora_modules(model).values():
            m.lora_B.normal_(0, 0.05)
    prompts = random_prompts([5, 40, 17], seed=7)
    engine = LLMEngine(model, cuda_graphs=graphs)
    out = engine.generate(prompts, SamplingParams(max_tokens=40, n=4, seed=3, stop_token_ids=()))
    assert bool(engine.runner.graphs and engine.runner.graphs.decode_graphs) == graphs
    errs = []
    for p, comps in zip(prompts, out):
        for c in comps:
            ids = torch.tensor([p + c.token_ids], device="cuda")
            with torch.no_grad():
                logits = model(ids)[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids, device="cuda")[:, None])[:, 0]
            errs.append((ref.cpu() - torch.tensor(c.logprobs)).abs())
    errs = torch.cat(errs)
    assert errs.max() < 5e-2 and errs.mean() < 1e-2, f"max {errs.max():.2e} mean {errs.mean():.2e}"
