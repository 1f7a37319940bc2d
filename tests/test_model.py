"""model.py against transformers: logits (bf16 and NVFP4 bases), the residual adds folded into the
norms, the attention hook, gradient checkpointing, config errors, the fused GPU forward.

References are independent of model.py: transformers' own Qwen2/Llama (fp32, logits compared with a
relative max-error bound; with dequantized weights for NVFP4), the decoder written out in torch ops
below, and a float64 attention for the hook. Loading itself is tested in test_checkpoint.py, the
fused kernels against ops.py's references in test_kernels_*.py.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import checkpoint as C
import model as M
import nvfp4
from conftest import TINY, against_hf, batch, hf_logits, load32, rel_err
from ops import apply_rope

ARCHS = [("qwen2", False), ("qwen2", True), ("llama", False), ("llama", True)]


# ----------------------------------------------------------------------------------------------
# logits equal transformers


@pytest.mark.parametrize("arch,tie", ARCHS)
def test_logits_match_transformers_fp32(tiny_hf_dir, arch, tie):
    path, hf = tiny_hf_dir(arch, tie)
    model = load32(path)
    assert model.config.tie_word_embeddings == tie and model.config.attention_bias == (arch == "qwen2")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    ours, hidden, (err, err_h, err0) = against_hf(model, hf)
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
    tok = C.load_tokenizer(smollm2_path)
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
    model = C.load_model(path, quant="bf16", device="cpu")
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
    model = C.load_model(path, quant="bf16", device="cpu", dtype=dtype)
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
                group = [hf.get_submodule(n).weight for n in C.group_of(name)]
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
# the attention hook and gradients


class DenseContext:
    """Records attend() calls and answers with causal attention in float64 (GQA by repetition)."""

    def __init__(self):
        self.calls = []

    def attend(self, layer_idx, q, k, v, cos, sin):
        self.calls.append((layer_idx, tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)            # the hook gets them unrotated
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
        def attend(self, i, q, k, v, cos, sin):
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
# errors


def test_nvfp4_needs_input_dims_multiple_of_16():
    cfg = M.ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=72,
                        num_layers=1, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"multiple of 16.*down_proj.*72"):
        C.build_model(cfg, quant="nvfp4", device="cpu")
    assert C.build_model(cfg, quant="bf16", device="cpu").model.layers[0].mlp.down_proj.in_features == 72


# ----------------------------------------------------------------------------------------------
# GPU: the rollout path's fused kernels and stacked matmuls inside the model


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,quant", [(torch.float32, "bf16"), (torch.bfloat16, "bf16"), (torch.bfloat16, "nvfp4")])
def test_gpu_inference_forward_with_fused_kernels_matches_the_training_forward(dtype, quant):
    """Fused norm / RoPE / SiLU·mul and the stacked q/k/v, gate/up matmuls vs the training forward."""
    cfg = M.ModelConfig("Qwen2ForCausalLM", vocab_size=4096, hidden_size=1024, intermediate_size=4096,
                        num_layers=4, num_heads=16, num_kv_heads=4)
    model = C.build_model(cfg, quant, "cuda", dtype=dtype, seed=0)
    ids = torch.randint(0, 4096, (4, 64), device="cuda")
    with torch.no_grad():
        fused = model(ids).float()                 # Triton norm / RoPE / SiLU·mul
    with torch.enable_grad():
        plain = model(ids).float()                 # the training forward (ops.py's references, compiled)
    err = rel_err(fused, plain)
    print(f"fused vs torch-op forward ({dtype}, {quant}): logits rel err {err:.2e}")
    assert err < (1e-5 if dtype == torch.float32 else 2e-2)
