"""model.py against transformers: logits, NVFP4 loading, streaming, the attention hook, errors, memory.

References are independent of model.py: transformers' own Qwen2/Llama (fp32, logits compared with a
relative max-error bound; with dequantized weights for NVFP4) and a float64 attention written out
below for the hook. What moved out of model.py is tested beside it: test_hf_checkpoint.py (the
checkpoints we write), test_fused_ops.py (the Triton norm/RoPE/SiLU·mul), test_stacked_linear.py.
"""
import json
import os
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import model as M
import nvfp4
from conftest import TINY, make_tiny_hf
from hf_checkpoint import save_pretrained

ARCHS = [("qwen2", False), ("qwen2", True), ("llama", False), ("llama", True)]


def rel_err(ours, ref):
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def batch(B=3, T=24, vocab=256, seed=1):
    """Random ids at increasing positions with random start and random gaps of 1..3, so that absolute
    positions matter (a common shift of all positions would cancel in attention)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    pos = torch.randint(0, 300, (B, 1), generator=g) + torch.randint(1, 4, (B, T), generator=g).cumsum(1)
    return ids, pos  # (B, T), (B, T)


def hf_logits(hf, ids, pos):
    """transformers' logits at explicit positions. The all-ones mask stops it from reading position
    gaps as boundaries of packed sequences: plain causal attention, like ours."""
    return hf(ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits


def load32(path, quant="bf16"):
    return M.load_model(path, quant=quant, device="cpu", dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# logits equal transformers


@pytest.mark.parametrize("arch,tie", ARCHS)
def test_logits_match_transformers_fp32(tiny_hf_dir, arch, tie):
    path, hf = tiny_hf_dir(arch, tie)
    model = load32(path)
    assert model.config.tie_word_embeddings == tie and model.config.attention_bias == (arch == "qwen2")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    ids, pos = batch()
    with torch.no_grad():
        ours, ref = model(ids, pos), hf_logits(hf, ids, pos)
        hidden = model(ids, pos, return_hidden=True)
        ref_hidden = hf.model(ids, position_ids=pos, attention_mask=torch.ones_like(ids)).last_hidden_state
        ours0, ref0 = model(ids), hf(ids).logits  # default positions 0..T-1
    err, err_h, err0 = rel_err(ours, ref), rel_err(hidden, ref_hidden), rel_err(ours0, ref0)
    print(f"{arch} tie={tie}: logits rel err {err:.2e}, hidden {err_h:.2e}, default positions {err0:.2e}")
    assert ours.shape == (3, 24, 256) and hidden.shape == (3, 24, 64)
    assert err < 1e-5 and err_h < 1e-5 and err0 < 1e-5


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    # head_dim 16, θ 5e5, original length 64: wavelengths 6 (kept), 32 (interpolated), ≥167 (divided)
    rope = dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY, rope_parameters=rope)).eval()
    hf.save_pretrained(tmp_path)
    model = load32(tmp_path)
    ref_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    assert torch.equal(model.inv_freq, ref_inv)
    ids, pos = batch()
    with torch.no_grad():
        err = rel_err(model(ids, pos), hf_logits(hf, ids, pos))
    print(f"llama3 rope: logits rel err {err:.2e}")
    assert err < 1e-5
    # the transformers-4 spelling of the same config parses to the same ModelConfig
    d4 = {k: v for k, v in M.ModelConfig.to_hf(model.config).items() if k != "rope_parameters"}
    d4["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    assert M.ModelConfig.from_hf(d4) == model.config


def test_smollm2_matches_transformers(smollm2_path):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    model = load32(smollm2_path)
    tok = M.load_tokenizer(smollm2_path)
    ids = torch.tensor([tok("The capital of France is Paris. The capital of Italy is")["input_ids"][:12]] * 2)
    pos = torch.tensor([[0], [37]]) + torch.arange(ids.shape[1]) * torch.tensor([[1], [3]])
    with torch.no_grad():
        ours, ref = model(ids, pos), hf_logits(hf, ids, pos)
    err = rel_err(ours, ref)
    print(f"SmolLM2-135M fp32: logits max abs err {(ours - ref).abs().max():.2e}, rel {err:.2e}")
    assert err < 1e-5
    assert model.config.num_layers == 30 and model.config.eos_token_id == 2


def test_bf16_model_keeps_norms_fp32(tiny_hf_dir):
    path, hf = tiny_hf_dir("qwen2")
    model = M.load_model(path, quant="bf16", device="cpu")
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if "norm" in name else torch.bfloat16), name
        assert not p.requires_grad, name
    ids, pos = batch()
    with torch.no_grad():
        out, ref = model(ids, pos), hf_logits(hf, ids, pos)
    err = rel_err(out, ref)
    print(f"bf16 vs fp32 transformers: rel err {err:.2e}")
    assert out.dtype == torch.bfloat16 and err < 3e-2


def add_in_each_layer_forward(model, ids, pos):
    """The decoder of model.py's docstring in plain torch ops, each residual added where it arises
    (h' = h + o·W_oᵀ, then h + m) and every op rounded as model.py's torch path rounds it: the oracle
    for folding those adds into the next norm, which must change no bit."""
    cfg, (B, T), D = model.config, ids.shape, model.config.head_dim

    def norm(h, w):
        f = h.float()
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w).to(h.dtype)

    def rope(x, cos, sin):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def linear(m, x):
        return F.linear(x, m.weight, m.bias)

    angles = pos[..., None].float() * M.rope_inv_freq(cfg)                  # (B, T, D/2)
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
    h = model.model.embed_tokens.weight[ids]                                  # (B, T, H)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        a = norm(h, layer.input_layernorm.weight)
        q, k, v = (linear(p, a).view(B, T, -1, D) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        o = F.scaled_dot_product_attention(rope(q, cos, sin).transpose(1, 2), rope(k, cos, sin).transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True,
                                           enable_gqa=cfg.num_kv_heads != cfg.num_heads).transpose(1, 2)
        h = h + linear(attn.o_proj, o.reshape(B, T, -1))
        m = norm(h, layer.post_attention_layernorm.weight)
        h = h + linear(mlp.down_proj, F.silu(linear(mlp.gate_proj, m)) * linear(mlp.up_proj, m))
    return F.linear(norm(h, model.model.norm.weight), model.lm_head.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("llama", True)])
def test_residual_adds_folded_into_norms_change_no_bit(tiny_hf_dir, arch, tie, dtype):
    """Block returns (MLP output, residual) and the next norm adds them: logits bit-identical to
    adding in each layer, in inference and under gradient checkpointing (which adds between layers)."""
    path, _ = tiny_hf_dir(arch, tie)
    model = M.load_model(path, quant="bf16", device="cpu", dtype=dtype)
    ids, pos = batch()
    with torch.no_grad():
        ref = add_in_each_layer_forward(model, ids, pos)
        ours, hidden = model(ids, pos), model(ids, pos, return_hidden=True)
    assert ours.dtype == dtype and torch.equal(ours, ref), f"max abs diff {(ours - ref).abs().max():.2e}"
    assert torch.equal(model.lm_head(hidden), ref)
    model.gradient_checkpointing = True
    model.model.embed_tokens.weight.requires_grad_(True)
    ckpt = model(ids, pos)
    assert torch.equal(ckpt.detach(), ref), f"checkpointed: max abs diff {(ckpt - ref).abs().max():.2e}"
    ckpt.float().logsumexp(-1).mean().backward()
    assert torch.isfinite(model.model.embed_tokens.weight.grad).all()


# ----------------------------------------------------------------------------------------------
# NVFP4


@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("llama", True)])
def test_nvfp4_logits_match_transformers_with_dequantized_weights(tiny_hf_dir, arch, tie):
    path, hf = tiny_hf_dir(arch, tie)
    model = load32(path, quant="nvfp4")
    with torch.no_grad():  # reference: transformers with each target weight replaced by dequant(quant(W))
        for name, mod in hf.named_modules():
            if name.rpartition(".")[2] in M.QUANTIZED:
                ours = model.get_submodule(name)
                assert isinstance(ours, nvfp4.NVFP4Linear), name
                # q/k/v and gate/up share one global scale: 448·6 / the largest amax of the group
                group = [hf.get_submodule(n).weight for n in M.group_of(name)]
                amax = max(w.double().abs().max().item() for w in group)
                assert ours.weight_global_scale.item() == pytest.approx(448 * 6 / amax, rel=1e-6), name
                packed, scale, g = nvfp4.quantize(mod.weight, ours.weight_global_scale)
                assert torch.equal(ours.weight_packed, packed) and torch.equal(ours.weight_scale, scale)
                mod.weight.copy_(nvfp4.dequantize(packed, scale, g))
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    ids, pos = batch()
    with torch.no_grad():
        err = rel_err(model(ids, pos), hf_logits(hf, ids, pos))
    print(f"nvfp4 {arch} tie={tie}: logits rel err vs dequantized transformers {err:.2e}")
    assert err < 1e-5


# ----------------------------------------------------------------------------------------------
# streaming: one tensor at a time


def test_loader_streams_one_dense_weight_at_a_time(tiny_hf_dir, monkeypatch):
    """A dense linear weight read from disk dies as soon as it is quantized: alone, or with the
    rest of its group (q/k/v, gate/up share a global scale), so at most one group's weights are
    alive when another tensor is read."""
    path, _ = tiny_hf_dir("llama")
    real_open, dense, bad, reads = M.safe_open, [], [], []
    group = lambda key: M.group_of(key.rpartition(".")[0])  # noqa: E731

    class Spy:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, key):
            return self.f.get_slice(key)

        def get_tensor(self, key):
            alive = [k for k, r in dense if r() is not None]                 # earlier weights
            if len({tuple(group(k)) for k in alive}) > 1:
                bad.append((alive, key))
            t = self.f.get_tensor(key)
            reads.append(key)
            if key.endswith("_proj.weight"):
                dense.append((key, weakref.ref(t)))
            return t

    monkeypatch.setattr(M, "safe_open", Spy)
    model = load32(path, quant="nvfp4")
    assert len(dense) == 14 and len(reads) == len(set(reads)), "each tensor is read exactly once"
    assert not bad and all(r() is None for _, r in dense), f"alive while reading the next: {bad[:4]}"
    assert all(isinstance(m, nvfp4.NVFP4Linear) for n, m in model.named_modules() if n.endswith("_proj"))


# ----------------------------------------------------------------------------------------------
# the attention hook and gradients


class DenseContext:
    """Records attend() calls and answers with causal attention in float64 (GQA by repetition)."""

    def __init__(self):
        self.calls = []

    def attend(self, layer_idx, q, k, v):
        self.calls.append((layer_idx, tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        B, T, Hq, D = q.shape
        k, v = (x.double().repeat_interleave(Hq // x.shape[2], dim=2) for x in (k, v))
        s = torch.einsum("bthd,bshd->bhts", q.double(), k) / D ** 0.5
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        return torch.einsum("bhts,bshd->bthd", s.softmax(-1), v).to(q.dtype)


def test_attention_hook_is_called_and_matches_dense(tiny_hf_dir):
    path, _ = tiny_hf_dir("qwen2")
    model = load32(path)
    ids, pos = batch()
    ctx = DenseContext()
    with torch.no_grad():
        dense, hooked = model(ids, pos), model(ids, pos, attn_ctx=ctx)
    err = rel_err(hooked, dense)
    print(f"attn_ctx (float64 reference attention) vs SDPA: rel err {err:.2e}")
    assert ctx.calls == [(i, (3, 24, 4, 16), (3, 24, 2, 16), (3, 24, 2, 16)) for i in range(2)]
    assert err < 1e-5

    class Zero:
        def attend(self, i, q, k, v):
            return torch.zeros_like(q)
    with torch.no_grad():
        assert rel_err(model(ids, pos, attn_ctx=Zero()), dense) > 1e-2, "the hook's output must be used"


def test_gradients_equal_with_and_without_checkpointing(tiny_hf_dir):
    path, _ = tiny_hf_dir("llama")
    model = load32(path, quant="nvfp4")
    emb = model.model.embed_tokens.weight.requires_grad_(True)
    g = torch.Generator().manual_seed(3)
    A = (0.1 * torch.randn(4, 64, generator=g)).requires_grad_(True)
    B = (0.1 * torch.randn(64, 4, generator=g)).requires_grad_(True)

    class LowRank(nn.Module):  # a LoRA-like trainable delta on layer 0's (frozen NVFP4) q_proj
        def __init__(self, base):
            super().__init__()
            self.base, self.calls = base, 0

        def forward(self, x):
            self.calls += 1
            return self.base(x) + x @ A.t() @ B.t()

    attn = model.model.layers[0].self_attn
    attn.q_proj = LowRank(attn.q_proj)
    ids, pos = batch()
    grads = {}
    for ckpt in (False, True):
        model.gradient_checkpointing, attn.q_proj.calls = ckpt, 0
        logp = model(ids, pos).log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])
        logp.mean().backward()
        grads[ckpt] = [p.grad.clone() for p in (emb, A, B)]
        assert attn.q_proj.calls == (2 if ckpt else 1), "checkpointing recomputes the layer in backward"
        for p in (emb, A, B):
            p.grad = None
    for name, off, on in zip(("embeddings", "A", "B"), grads[False], grads[True]):
        assert off.abs().max() > 0, f"no gradient reached {name}"
        assert torch.allclose(off, on, rtol=1e-5, atol=1e-8), f"{name}: {(off - on).abs().max():.2e}"


# ----------------------------------------------------------------------------------------------
# build_model


@pytest.mark.parametrize("quant", ["bf16", "nvfp4"])
def test_build_model_has_hf_names_shapes_and_finite_forward(quant):
    from conftest import make_tiny_hf
    hf = make_tiny_hf("qwen2")
    cfg = M.ModelConfig.from_hf(hf.config.to_dict())
    model = M.build_model(cfg, quant=quant, device="cpu", seed=1)
    ours, theirs = model.state_dict(), hf.state_dict()
    for key, t in theirs.items():
        mod = key.rpartition(".")[0]
        if quant == "nvfp4" and key.endswith("_proj.weight"):
            N, K = t.shape
            assert ours[f"{mod}.weight_packed"].shape == (N, K // 2) and ours[f"{mod}.weight_scale"].shape == (N, K // 16)
        else:
            assert ours[key].shape == t.shape, key
    ids, _ = batch()
    with torch.no_grad():
        out = model(ids)
    assert out.shape == (3, 24, 256) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert out.float().std() > 0


# ----------------------------------------------------------------------------------------------
# errors


def _write_config(path, **overrides):
    os.makedirs(path, exist_ok=True)
    from conftest import make_tiny_hf
    d = {**make_tiny_hf("llama").config.to_dict(), **overrides}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f)


def test_errors_architecture_paths_and_pickles(tmp_path):
    _write_config(tmp_path / "mistral", architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(ValueError, match="MistralForCausalLM.*Qwen2ForCausalLM"):
        M.load_model(str(tmp_path / "mistral"), device="cpu")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        M.load_model(str(tmp_path / "nowhere"), device="cpu")
    _write_config(tmp_path / "pickle")
    (tmp_path / "pickle" / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="never unpickles"):
        M.load_model(str(tmp_path / "pickle"), device="cpu")
    _write_config(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        M.load_model(str(tmp_path / "empty"), device="cpu")
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        M.ModelConfig.from_hf({**M.ModelConfig("LlamaForCausalLM", 64, 64, 64, 1, 4, 2).to_hf(),
                               "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("quant", ["bf16", "nvfp4"])
def test_errors_bad_tensors_are_named(tiny_hf_dir, quant):
    path, _ = tiny_hf_dir("qwen2")
    file = os.path.join(path, "model.safetensors")
    good = load_file(file)
    bad_key = "model.layers.1.mlp.down_proj.weight"
    sd = dict(good)
    sd[bad_key] = sd[bad_key].clone()
    sd[bad_key][3, 5] = float("nan")
    save_file(sd, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=bad_key.replace(".", r"\.")):
        M.load_model(path, quant=quant, device="cpu")
    sd = dict(good)
    del sd["model.layers.0.self_attn.k_proj.bias"]
    sd["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(sd, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 \['model\.layers\.0\.self_attn\.k_proj\.bias'\].*"
                                         r"unexpected 1 \['model\.layers\.0\.self_attn\.extra\.weight'\]"):
        M.load_model(path, quant=quant, device="cpu")


def test_nvfp4_needs_input_dims_multiple_of_16():
    cfg = M.ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=72,
                        num_layers=1, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"multiple of 16.*down_proj.*72"):
        M.build_model(cfg, quant="nvfp4", device="cpu")
    assert M.build_model(cfg, quant="bf16", device="cpu").model.layers[0].mlp.down_proj.in_features == 72


def test_hub_ids_go_through_snapshot_download(tiny_hf_dir, monkeypatch):
    import huggingface_hub
    path, _ = tiny_hf_dir("llama")
    seen = []

    def fake_download(repo_id, allow_patterns=None, **kw):  # no network in tests
        seen.append((repo_id, allow_patterns))
        return path
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    model = M.load_model("someone/tiny-llama", quant="bf16", device="cpu")
    assert seen[0][0] == "someone/tiny-llama" and "*.safetensors" in seen[0][1] and "*.bin" not in seen[0][1]
    assert model.config.architecture == "LlamaForCausalLM"


# ----------------------------------------------------------------------------------------------
# GPU: the Triton kernel path inside the model, and the loader's memory


@pytest.mark.gpu
def test_gpu_nvfp4_model_matches_dequantized_bf16_and_loads_in_bounded_memory(tmp_path):
    cfg = M.ModelConfig("Qwen2ForCausalLM", vocab_size=4096, hidden_size=1024, intermediate_size=4096,
                        num_layers=4, num_heads=16, num_kv_heads=4)
    dense = M.build_model(cfg, "bf16", "cuda", seed=0)
    save_pretrained(dense, str(tmp_path))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    q = M.load_model(str(tmp_path), quant="nvfp4", device="cuda")
    final, peak = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
    matrix = 4096 * 1024 * 2  # the largest bf16 linear weight
    print(f"load: final {final / 2**20:.1f} MiB, peak - final {(peak - final) / 2**20:.1f} MiB "
          f"= {(peak - final) / matrix:.1f} bf16 matrices")
    # DESIGN.md: peak ≈ final + one bf16 matrix; quantize's row chunks add ≤ ~32 B per chunk weight.
    assert peak - final <= matrix + 32 * nvfp4.QUANT_CHUNK
    with torch.no_grad():  # reference: cuBLAS bf16 with the dequantized NVFP4 weights
        for name, m in q.named_modules():
            if isinstance(m, nvfp4.NVFP4Linear):
                dense.get_submodule(name).weight.copy_(m.dequantized_weight(torch.bfloat16))
    ids = torch.randint(0, 4096, (4, 128), device="cuda")
    with torch.no_grad():
        err = rel_err(q(ids), dense(ids))
    print(f"nvfp4 kernel model vs dequantized bf16 model: logits rel err {err:.2e}")
    assert err < 3e-2
    q.gradient_checkpointing = True  # the training path: backward through the dx kernel
    emb = q.model.embed_tokens.weight.requires_grad_(True)
    q(ids).float().logsumexp(-1).mean().backward()
    assert torch.isfinite(emb.grad).all() and emb.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------
# GPU: the rollout path's fused kernels and stacked matmuls inside the model


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,quant", [(torch.float32, "bf16"), (torch.bfloat16, "bf16"), (torch.bfloat16, "nvfp4")])
def test_gpu_inference_forward_with_fused_kernels_matches_the_training_forward(dtype, quant):
    """Fused norm / RoPE / SiLU·mul and the stacked q/k/v, gate/up matmuls vs the training forward."""
    cfg = M.ModelConfig("Qwen2ForCausalLM", vocab_size=4096, hidden_size=1024, intermediate_size=4096,
                        num_layers=4, num_heads=16, num_kv_heads=4)
    model = M.build_model(cfg, quant, "cuda", dtype=dtype, seed=0)
    assert model.model.layers[0].self_attn.stacked is not None
    ids = torch.randint(0, 4096, (4, 64), device="cuda")
    with torch.no_grad():
        fused = model(ids).float()                 # Triton norm / RoPE / SiLU·mul
    with torch.enable_grad():
        plain = model(ids).float()                 # torch ops (the training forward)
    err = rel_err(fused, plain)
    print(f"fused vs torch-op forward ({dtype}, {quant}): logits rel err {err:.2e}")
    assert err < (1e-5 if dtype == torch.float32 else 2e-2)


# ----------------------------------------------------------------------------------------------
# memory: the footprint is known before loading, and a model that cannot fit fails early


@pytest.mark.parametrize("arch,tie,quant", [("qwen2", False, "nvfp4"), ("llama", True, "nvfp4"), ("qwen2", False, "bf16")])
def test_weight_bytes_of_the_meta_model_equal_the_built_model(arch, tie, quant):
    cfg = M.ModelConfig.from_hf(make_tiny_hf(arch, tie).config.to_dict())
    with torch.device("meta"):
        meta = M.Transformer(cfg, quant)
    built = M.build_model(cfg, quant, "cpu")
    tensors = {t.data_ptr(): t for t in list(built.parameters()) + list(built.buffers())}  # tied: once
    assert M.weight_bytes(meta) == sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("name,paper_gb", [("qwen2.5-7b", 5.9), ("qwen2.5-14b", 10.6), ("qwen2.5-32b", 20.7)])
def test_nvfp4_weight_memory_matches_the_paper(name, paper_gb):
    """QeRL reports 5.9 / 10.6 / 20.7 GB of NVFP4 weights (lm_head and embeddings in bf16)."""
    with torch.device("meta"):
        model = M.Transformer(M.ModelConfig.from_hf(M.SHAPES[name]), "nvfp4")
    gb = M.weight_bytes(model) / 1e9
    print(f"{name}: {gb:.2f} GB (paper {paper_gb})")
    assert abs(gb - paper_gb) / paper_gb < 0.015


def test_a_model_that_cannot_fit_fails_before_loading(monkeypatch):
    with torch.device("meta"):
        model = M.Transformer(M.ModelConfig.from_hf(M.SHAPES["qwen2.5-32b"]), "bf16")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * 2**30, 80 * 2**30))
    M.check_fits(model, torch.device("cuda", 0))  # 61 GiB of bf16 weights fit in 80 GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * 2**30, 80 * 2**30))
    with pytest.raises(ValueError, match=r"needs 62\.\d GiB .* has 40\.0 GiB free"):
        M.check_fits(model, torch.device("cuda", 0))
