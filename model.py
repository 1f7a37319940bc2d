"""The policy network: a Qwen2 / Llama decoder in plain PyTorch, loaded from Hugging Face checkpoints.

The decoder
-----------
A batch of token ids x (B, T) at positions p (B, T) goes through L identical layers. With
RMSNorm(h) = h / sqrt(mean_c(h²) + ε) ⊙ w (statistics over the H channels of one token):

    h⁰      = E[x]                                     embed_tokens                       (B, T, H)
    a       = RMSNorm(hˡ; w₁)                          input_layernorm
    q, k, v = a·W_qᵀ + b_q, a·W_kᵀ + b_k, a·W_vᵀ + b_v  Hq query heads, Hkv key/value heads (B, T, H*, D)
    q, k    = RoPE(q, p), RoPE(k, p)                   rotate channel pairs (i, i+D/2) by p·θ^(-2i/D)
    o_t     = Σ_{s≤t} softmax_s(q_t·k_s/√D) v_s        causal; query head j reads kv head j // (Hq/Hkv)
    h'      = hˡ + o·W_oᵀ
    m       = RMSNorm(h'; w₂)                          post_attention_layernorm
    hˡ⁺¹    = h' + (silu(m·W_gateᵀ) ⊙ m·W_upᵀ)·W_downᵀ
    logits  = RMSNorm(hᴸ; w_f)·W_headᵀ                 model.norm, lm_head (W_head = E when tied)

Qwen2 has biases on q/k/v only; Llama has none unless `attention_bias` (then o_proj too). Llama 3.1
"llama3" RoPE divides the low frequencies by `factor` and interpolates the middle band.

Precision. Linears, embeddings and activations are in `dtype` (bf16). Norm weights are fp32: AQN adds
noise of σ = 5e-4 to them, below bf16's spacing near 1 (2^-8). The norm computes in fp32 and casts its
output to the activation dtype; RoPE angles, cos/sin and the rotation itself are fp32 as well.

Residual adds (vLLM's fused add + RMSNorm). Each `h + ...` above is done by the norm that reads the
sum: a layer returns the pair (MLP(m), h') instead of hˡ⁺¹ = h' + MLP(m), and the next
input_layernorm (or model.norm) computes the sum and its norm together: one Triton kernel on the
rollout path instead of an add and a norm (fused_ops.py). The sum is rounded to the activation dtype as the add
in each layer would round it, so the logits are bit-identical.

Names. Module paths are Hugging Face's (`model.layers.3.self_attn.q_proj`, `lm_head`), so a state
dict key is the checkpoint key, a quantized linear's buffers are compressed-tensors' keys
(`...q_proj.weight_packed / weight_scale / weight_global_scale`, see nvfp4.py), and LoRA adapter keys
come out as PEFT's.

The attention hook. `forward(ids, positions, attn_ctx)`: with attn_ctx=None each layer runs dense
causal SDPA over its T tokens (training, scoring). Otherwise layer i calls

    attn_ctx.attend(i, q (B,T,Hq,D), k (B,T,Hkv,D), v (B,T,Hkv,D)) -> (B,T,Hq,D)

with RoPE already applied at `positions`; the context stores k/v in its paged cache and attends over
everything cached (rollout.py: packed prefill, paged decode). A context with `rope_in_store = True`
(rollout's decode on the Triton backend) is called on the fused path (fused_ops.fused) as
attend(i, q, k, v, rope=(cos, sin)) with q, k not yet rotated: the attention kernel rotates them,
writes k, v to the cache and attends in one launch. The model never imports the sampler, and the
same weights, LoRA adapters and AQN noise serve both paths.

Training. `model.gradient_checkpointing = True` keeps only each layer's input and recomputes the
layer in the backward pass (torch.utils.checkpoint, use_reentrant=False). The recomputation reads
the weights as they are at backward time, so AQN noise must stay applied across forward and backward.

Loading. `load_model` builds the module tree on the meta device (no memory), checks every checkpoint
key and shape against it from the safetensors headers alone, then streams tensors one at a time with
`safe_open` onto the target device. A q/k/v/o/gate/up/down weight is quantized right there
(nvfp4.quantize) and its bf16 copy dropped before the next tensor is read, so peak device memory is
the final footprint plus one bf16 matrix and quantize's temporaries for it (H100, Qwen2.5-7B shapes:
5.45 GiB final, +1.1 GiB peak, nearly all of it quantize's fp32 work on gate_proj). Embeddings, lm_head,
norms and biases stay unquantized, as in QeRL. A compressed-tensors NVFP4 checkpoint is assigned as
is. Base weights come back frozen (requires_grad=False); LoRA adds the trainable parameters.
The files themselves (a Hub id resolved, shards listed, `save_pretrained`) are hf_checkpoint.py's.

Next to this file. fused_ops.py: the Triton kernels that replace the norm, RoPE and SiLU·mul torch ops
on the rollout path (`fused(x)`: CUDA, no autograd). stacked_linear.py: q/k/v and gate/up as one
matmul on that path (`project`), each linear still its own module; loading gives a group one NVFP4
global scale (quantize_group). hf_checkpoint.py: checkpoint directories on disk.

Left out: KV cache (rollout.py owns it), sliding-window attention, RoPE types other than default and
llama3, MLP biases, dropout. Tests: tests/test_model.py compares logits with transformers in fp32.
"""
import json
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from torch.utils.checkpoint import checkpoint

import nvfp4
from fused_ops import embed_rope_triton, fused, rms_norm_triton, rope_triton, token_stride
from hf_checkpoint import checkpoint_files, resolve
from stacked_linear import GROUPS, group_of, project, stack_groups

SUPPORTED = ("Qwen2ForCausalLM", "LlamaForCausalLM")
MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
INIT_STD = 0.02  # build_model's random weights (transformers' initializer_range)

# ----------------------------------------------------------------------------------------------
# Config


@dataclass
class ModelConfig:
    """Shapes and constants of one decoder; `from_hf` reads a transformers config.json dict."""
    architecture: str                     # "Qwen2ForCausalLM" | "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None           # None: hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None      # llama3 RoPE: a dict with LLAMA3_KEYS; None: plain RoPE
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None    # None: True for Qwen2 (q/k/v), False for Llama
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None

    def __post_init__(self):
        if self.architecture not in SUPPORTED:
            raise ValueError(f"ModelConfig.architecture: {self.architecture!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        self.head_dim = self.head_dim or self.hidden_size // self.num_heads
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError("ModelConfig.rms_norm_eps and ModelConfig.rope_theta must be > 0")
        qwen2 = self.architecture == "Qwen2ForCausalLM"
        self.attention_bias = qwen2 if self.attention_bias is None else self.attention_bias
        if qwen2 and not self.attention_bias:
            raise ValueError("ModelConfig.attention_bias: Qwen2 always has q/k/v biases")
        if self.rope_scaling is not None and set(LLAMA3_KEYS) - set(self.rope_scaling):
            raise ValueError(f"ModelConfig.rope_scaling (llama3) needs keys {LLAMA3_KEYS}, got {self.rope_scaling}")

    @property
    def o_bias(self) -> bool:  # Llama's attention_bias covers o_proj too; Qwen2's o_proj never has one
        return self.attention_bias and self.architecture == "LlamaForCausalLM"

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        arch = (d.get("architectures") or [MODEL_TYPES.get(d.get("model_type"), f"model_type={d.get('model_type')!r}")])[0]
        if arch not in SUPPORTED:
            raise ValueError(f"unsupported architecture {arch}: qerl supports {', '.join(SUPPORTED)}")
        if d.get("hidden_act", "silu") != "silu" or d.get("mlp_bias") or d.get("use_sliding_window"):
            raise ValueError("unsupported config: needs hidden_act='silu', no mlp_bias, no sliding window")
        # transformers 4 keeps rope_theta at the top and scaling in rope_scaling; 5 puts both in rope_parameters
        rope = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            rope.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
            scaling = {k: rope[k] for k in LLAMA3_KEYS}
        elif rope_type != "default":
            raise ValueError(f"unsupported rope type {rope_type!r}: qerl supports 'default' and 'llama3'")
        return cls(architecture=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                   intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
                   num_heads=d["num_attention_heads"],
                   num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                   head_dim=d.get("head_dim"), rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))), rope_scaling=scaling,
                   tie_word_embeddings=d.get("tie_word_embeddings", False),
                   attention_bias=True if arch == "Qwen2ForCausalLM" else d.get("attention_bias", False),
                   max_position_embeddings=d.get("max_position_embeddings", 32768),
                   bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"))

    def to_hf(self) -> dict:
        """A config.json dict that both transformers 4 (rope_theta) and 5 (rope_parameters) read."""
        rope = {"rope_type": "llama3" if self.rope_scaling else "default", "rope_theta": self.rope_theta,
                **(self.rope_scaling or {})}
        d = dict(architectures=[self.architecture],
                 model_type={v: k for k, v in MODEL_TYPES.items()}[self.architecture],
                 vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                 intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
                 num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                 head_dim=self.head_dim, hidden_act="silu", rms_norm_eps=self.rms_norm_eps,
                 rope_theta=self.rope_theta, rope_parameters=rope,
                 max_position_embeddings=self.max_position_embeddings,
                 tie_word_embeddings=self.tie_word_embeddings,
                 bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id)
        if self.architecture == "LlamaForCausalLM":
            d.update(attention_bias=self.attention_bias, mlp_bias=False)
        if self.rope_scaling:
            d["rope_scaling"] = rope
        return d


# ----------------------------------------------------------------------------------------------
# RoPE and the modules


def rope_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """θ^(-2i/D) for i < D/2, fp32 (D/2,), computed as transformers does so the angles match bit for bit.
    llama3 scaling (Meta's Llama 3.1 reference): wavelengths beyond old_len/low_freq_factor are
    stretched by `factor`, those below old_len/high_freq_factor kept, the band between interpolated."""
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D))
    if cfg.rope_scaling:
        factor, lo, hi, old_len = (cfg.rope_scaling[k] for k in LLAMA3_KEYS)
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - lo) / (hi - lo)  # 0 at the long-wavelength edge of the band, 1 at the short
        mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv,
                          torch.where(wavelen > old_len / lo, inv / factor, inv))
    return inv


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, D); cos/sin (B, T, 1, D/2) fp32. Rotates pairs (i, i + D/2), in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))  # fp32: AQN noise must be representable

    def forward(self, x, residual=None):
        """(..., C) -> norm(x) in x.dtype; with residual: (norm(x + residual), x + residual).
        The fused kernel may read residual before the kernel that ran just before it has finished
        (rms_norm_triton): residual is the stream, never the output of the op just before."""
        if fused(x):
            return rms_norm_triton(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = (h * self.weight).to(x.dtype)
        return h if residual is None else (h, x)


def rope(q, k, cos, sin):
    """apply_rope on q and k: one Triton launch on the rollout path when the layout allows, else torch ops."""
    D = q.shape[-1]
    if fused(q) and token_stride(q) and token_stride(k) and D & (D - 1) == 0:
        return rope_triton(q, k, cos, sin)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def make_linear(in_features: int, out_features: int, bias: bool, quant: str, dtype) -> nn.Module:
    if quant == "nvfp4":
        return nvfp4.NVFP4Linear(in_features, out_features, bias=bias, dtype=dtype)
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, quant: str, dtype):
        super().__init__()
        self.layer_idx, self.n_heads, self.n_kv, self.head_dim = layer_idx, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        H, D, b = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = make_linear(H, self.n_heads * D, b, quant, dtype)
        self.k_proj = make_linear(H, self.n_kv * D, b, quant, dtype)
        self.v_proj = make_linear(H, self.n_kv * D, b, quant, dtype)
        self.o_proj = make_linear(self.n_heads * D, H, cfg.o_bias, quant, dtype)
        self.stacked = None                                          # StackedLinear: see stacked_linear.py

    def forward(self, x, cos, sin, attn_ctx=None):
        B, T, _ = x.shape
        q, k, v = project(self, GROUPS["self_attn"], x)
        q = q.view(B, T, self.n_heads, self.head_dim)               # (B, T, Hq, D)
        k = k.view(B, T, self.n_kv, self.head_dim)                  # (B, T, Hkv, D)
        v = v.view(B, T, self.n_kv, self.head_dim)                  # (B, T, Hkv, D)
        if attn_ctx is None:  # dense causal over the T tokens of each row; SDPA wants (B, heads, T, D)
            q, k = rope(q, k, cos, sin)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=self.n_kv != self.n_heads)
            y = y.transpose(1, 2)                                     # (B, T, Hq, D)
        elif fused(q) and getattr(attn_ctx, "rope_in_store", False):  # it rotates q, k as it stores k, v
            y = attn_ctx.attend(self.layer_idx, q, k, v, rope=(cos, sin))   # (B, T, Hq, D)
        else:
            q, k = rope(q, k, cos, sin)
            y = attn_ctx.attend(self.layer_idx, q, k, v)              # (B, T, Hq, D)
        return self.o_proj(y.reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: str, dtype):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = make_linear(H, I, False, quant, dtype)
        self.up_proj = make_linear(H, I, False, quant, dtype)
        self.down_proj = make_linear(I, H, False, quant, dtype)
        self.stacked = None                                          # StackedLinear: see stacked_linear.py

    def forward(self, x):  # (B, T, H) -> (B, T, H) through (B, T, I)
        if fused(x):       # the rollout path: SiLU·mul in the gate/up GEMV's epilogue where it can be
            return self.down_proj(project(self, GROUPS["mlp"], x, silu_mul=True))
        g, u = project(self, GROUPS["mlp"], x)
        return self.down_proj(F.silu(g) * u)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, quant: str, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, quant, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, quant, dtype)

    def forward(self, x, residual, cos, sin, attn_ctx=None):
        """Input: the stream hˡ = x + residual (residual None: x alone, the embeddings). Output: the
        pair (MLP(m), h') whose sum is hˡ⁺¹ (module docstring); the next layer's input_layernorm, or
        model.norm, adds it."""
        if residual is None:
            a, residual = self.input_layernorm(x), x
        else:
            a, residual = self.input_layernorm(x, residual=residual)     # norm(hˡ), hˡ
        o = self.self_attn(a, cos, sin, attn_ctx)
        m, residual = self.post_attention_layernorm(o, residual=residual)   # norm(h'), h' = o + hˡ
        return self.mlp(m), residual


class Decoder(nn.Module):  # HF's `model.` prefix: embeddings, layers, final norm
    def __init__(self, cfg: ModelConfig, quant: str, dtype):
        super().__init__()
        # _weight skips nn.Embedding's random init (on meta it would import torch's decompositions)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(Block(cfg, i, quant, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """Qwen2ForCausalLM / LlamaForCausalLM. Set `gradient_checkpointing = True` to recompute each
    layer in the backward pass (torch.utils.checkpoint, use_reentrant=False)."""

    def __init__(self, cfg: ModelConfig, quant: str = "bf16", dtype=torch.bfloat16):
        super().__init__()
        if quant not in ("bf16", "nvfp4"):
            raise ValueError(f"quant must be 'nvfp4' or 'bf16', got {quant!r}")
        if quant == "nvfp4":  # NVFP4 blocks run along the input dim: 16 elements per FP8 scale
            bad = {n: k for n, k in (("q/k/v/gate/up_proj", cfg.hidden_size), ("o_proj", cfg.num_heads * cfg.head_dim),
                                     ("down_proj", cfg.intermediate_size)) if k % nvfp4.BLOCK}
            if bad:
                raise ValueError(f"NVFP4 needs each quantized linear's input dim to be a multiple of "
                                 f"{nvfp4.BLOCK}; got {bad} (use quant='bf16')")
        self.config, self.quant, self.dtype = cfg, quant, dtype
        self.gradient_checkpointing = False
        self.model = Decoder(cfg, quant, dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        self.tie_weights()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)  # (D/2,) fp32

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions=None, attn_ctx=None, return_hidden=False):
        """input_ids (B, T) long; positions (B, T) long (default 0..T-1). -> logits (B, T, V) in the model
        dtype, or the final-normed hidden states (B, T, H) when return_hidden (e.g. to take lm_head of
        a few rows only). attn_ctx: see the module docstring."""
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        if (fused(input_ids) and type(self.model.embed_tokens) is nn.Embedding and self.inv_freq.dtype == torch.float32
                and positions.shape == input_ids.shape):   # one kernel for the five below (ids inside the
            x, cos, sin = embed_rope_triton(input_ids, positions,   # vocabulary: one outside reads zeros)
                                            self.model.embed_tokens.weight, self.inv_freq)
        else:
            angles = positions[..., None].float() * self.inv_freq          # (B, T, D/2) fp32
            cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]  # (B, T, 1, D/2): broadcast over heads
            x = self.model.embed_tokens(input_ids)                          # (B, T, H)
        residual = None                                                     # Block: the pair (x, residual)
        for layer in self.model.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                # add the pair here: the checkpoint then keeps one tensor per layer, not two
                x = x if residual is None else x + residual
                x, residual = checkpoint(layer, x, None, cos, sin, attn_ctx, use_reentrant=False)
            else:
                x, residual = layer(x, residual, cos, sin, attn_ctx)
        x, _ = self.model.norm(x, residual=residual)                    # norm(hᴸ), hᴸ = x + residual
        return x if return_hidden else self.lm_head(x)


# ----------------------------------------------------------------------------------------------
# Loading: meta-device build, header checks, one tensor at a time


def _assign(model: nn.Module, key: str, value: torch.Tensor):
    """Replace the (meta) parameter or buffer `key` by `value`, cast to its declared dtype, frozen."""
    mod_name, _, attr = key.rpartition(".")
    mod = model.get_submodule(mod_name)
    if attr in mod._parameters:
        old = mod._parameters[attr]
        mod._parameters[attr] = nn.Parameter(value.to(old.dtype), requires_grad=False)
    else:
        mod._buffers[attr] = value.to(mod._buffers[attr].dtype)


def quantize_group(model, linear_names: list[str], weights: list[torch.Tensor]):
    """Quantize linears with one global scale, the smallest of theirs (= 448·6 / the largest amax),
    so that they can share a matmul (StackedLinear); a single linear gets its own."""
    global_scale = torch.cat([nvfp4.compute_global_scale(w) for w in weights]).min().reshape(1)
    for linear_name, weight in zip(linear_names, weights):
        packed, scale, gs = nvfp4.quantize(weight, global_scale, name=linear_name + ".weight")
        for attr, t in zip(("weight_packed", "weight_scale", "weight_global_scale"), (packed, scale, gs.clone())):
            _assign(model, f"{linear_name}.{attr}", t)


def _plan(model: Transformer, shapes: dict[str, tuple]) -> dict[str, str]:
    """Match checkpoint keys (with header shapes) against the meta model: {key: "copy"|"quantize"|"skip"}.
    Raises one ValueError listing every missing, unexpected and mis-shaped key."""
    expected = dict(model.state_dict(keep_vars=True))
    tied = model.config.tie_word_embeddings
    if tied:
        expected.pop("lm_head.weight")
    qlinears = {n: m for n, m in model.named_modules() if isinstance(m, nvfp4.NVFP4Linear)}
    plan, covered, unexpected, bad = {}, set(), [], []
    for key, shape in shapes.items():
        mod, _, attr = key.rpartition(".")
        if key in expected:
            plan[key], want = "copy", tuple(expected[key].shape)
            covered.add(key)
        elif attr == "weight" and mod in qlinears:  # a bf16 weight we quantize on load
            plan[key], want = "quantize", (qlinears[mod].out_features, qlinears[mod].in_features)
            covered |= {f"{mod}.weight_packed", f"{mod}.weight_scale", f"{mod}.weight_global_scale"}
        elif (tied and key == "lm_head.weight") or key.endswith(("rotary_emb.inv_freq", ".input_global_scale")):
            plan[key], want = "skip", shape  # a tied copy, a derived buffer, or a W4A4 activation scale
        else:
            unexpected.append(key)
            continue
        if tuple(shape) != want:
            bad.append(f"{key}: checkpoint {tuple(shape)} vs model {want}")
    missing = sorted(set(expected) - covered)
    if missing or unexpected or bad:
        show = lambda xs: f"{len(xs)} {xs[:8]}{' ...' if len(xs) > 8 else ''}"  # noqa: E731
        raise ValueError(f"checkpoint does not match {model.config.architecture} ({model.quant}): "
                         f"missing {show(missing)}; unexpected {show(sorted(unexpected))}; bad shapes {show(bad)}")
    return plan


def _finish(model: Transformer, device) -> Transformer:
    model.tie_weights()
    model.inv_freq = rope_inv_freq(model.config, device)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not left, f"tensors left on the meta device: {left}"
    for m in model.modules():
        if isinstance(m, nvfp4.NVFP4Linear) and m.weight_packed.is_cuda:
            m.interleave_()                      # the kernels' layout, before stacking
    stack_groups(model)
    return model.eval()


def _device(device) -> torch.device:
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def weight_bytes(model: Transformer) -> int:
    """Bytes the model's tensors take on the device (tied tensors once); exact on a meta model."""
    seen = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


def load_bytes(model: Transformer) -> int:
    """What loading needs: the weights + what is in flight: the largest bf16 group quantized together
    (gate_proj and up_proj) and quantize's temporaries for one of them, or the embedding."""
    cfg = model.config
    return weight_bytes(model) + 2 * max(cfg.hidden_size * 3 * cfg.intermediate_size, cfg.vocab_size * cfg.hidden_size)


def check_fits(model: Transformer, device: torch.device) -> None:
    """Fail before loading anything when the weights (+ what loading holds in flight: load_bytes) cannot fit."""
    if device.type != "cuda":
        return
    need, free = load_bytes(model), torch.cuda.mem_get_info(device)[0]
    if need > free:
        raise ValueError(f"the {model.quant} model needs {need / 2**30:.1f} GiB for its weights (+ the bf16 "
                         f"weights in flight) but {device} has {free / 2**30:.1f} GiB free; try quant='nvfp4' or a larger GPU")


def load_model(name_or_path: str, quant: str = "nvfp4", device=None, dtype=torch.bfloat16) -> Transformer:
    """Hub id or directory (config.json + model.safetensors or sharded) -> Transformer on `device`."""
    path = resolve(name_or_path)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path}: no config.json")
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    cfg, device = ModelConfig.from_hf(hf), _device(device)
    if nvfp4.is_nvfp4_checkpoint(hf) and quant != "nvfp4":
        raise ValueError(f"{name_or_path} is an NVFP4 (compressed-tensors) checkpoint: load it with quant='nvfp4'")
    with torch.device("meta"):
        model = Transformer(cfg, quant, dtype)
    check_fits(model, device)
    by_file, shapes = {}, {}
    for key, file in checkpoint_files(path).items():
        by_file.setdefault(file, []).append(key)
    for file, keys in by_file.items():  # headers only: nothing is read yet
        with safe_open(file, framework="pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in keys})
    plan = _plan(model, shapes)
    pending = {}  # a group's first linear -> {linear: bf16 weight}: quantized once the group is read
    for file, keys in by_file.items():
        with safe_open(file, framework="pt", device=str(device)) as f:
            for key in keys:
                if plan[key] == "skip":
                    continue
                t = f.get_tensor(key)
                # a NaN/Inf makes the sum non-finite; the exact test runs only then (isfinite is slow on CPU)
                if t.is_floating_point() and t.element_size() > 1 and not torch.isfinite(t.sum()) \
                        and not torch.isfinite(t).all():
                    raise ValueError(f"{key}: checkpoint tensor has NaN or Inf values ({file})")
                if plan[key] == "quantize":
                    name = key.rpartition(".")[0]
                    group = [n for n in group_of(name) if plan.get(n + ".weight") == "quantize"]
                    got = pending.setdefault(group[0], {})
                    got[name] = t
                    if len(got) == len(group):
                        del pending[group[0]]
                        quantize_group(model, list(got), list(got.values()))
                        got.clear()  # the group's bf16 weights die here
                else:
                    _assign(model, key, t)
                del t  # a bf16 weight dies once its group is quantized, before the next reads
    assert not pending, f"groups never completed: {list(pending)}"
    model.name_or_path = name_or_path
    return _finish(model, device)


# Qwen2.5 config.json values (vocab, norms, RoPE, shapes), for random-init runs and benchmarks on
# machines without the weights: `build_model(SHAPES["qwen2.5-7b"])`, `train.py --random-init`.
_QWEN25 = dict(architectures=["Qwen2ForCausalLM"], vocab_size=152064, rms_norm_eps=1e-6, rope_theta=1e6,
               max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
               bos_token_id=151643, eos_token_id=151645)
SHAPES = {
    "qwen2.5-7b": dict(_QWEN25, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4),
    "qwen2.5-14b": dict(_QWEN25, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8),
    "qwen2.5-32b": dict(_QWEN25, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8),
}


def random_init_config(name_or_path: str) -> dict:
    """The config for a random-init model: a SHAPES name or a local directory with config.json."""
    if name_or_path.lower() in SHAPES:
        return SHAPES[name_or_path.lower()]
    path = os.path.join(os.path.expanduser(name_or_path), "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    raise ValueError(f"random init needs one of {sorted(SHAPES)} or a directory with config.json, "
                     f"got {name_or_path!r}")


def build_model(config, quant: str = "nvfp4", device=None, dtype=torch.bfloat16, seed: int = 0) -> Transformer:
    """Random weights (N(0, 0.02²), norms 1) with real shapes and no checkpoint: for benchmarks.
    Quantized linears are drawn and quantized one at a time, so peak ≈ final + one bf16 matrix."""
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
    device = _device(device)
    with torch.device("meta"):
        model = Transformer(cfg, quant, dtype)
    check_fits(model, device)
    gen = torch.Generator(device).manual_seed(seed)
    skip = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    for key, t in model.state_dict(keep_vars=True).items():
        mod, _, attr = key.rpartition(".")
        if key in skip or attr in ("weight_scale", "weight_global_scale"):
            continue  # the tied copy; scales come with weight_packed
        if attr == "weight_packed":
            group = group_of(mod)
            if mod != group[0]:
                continue  # drawn with the first of its group
            ms = [model.get_submodule(n) for n in group]
            ws = [torch.randn(m.out_features, m.in_features, generator=gen, device=device, dtype=dtype).mul_(INIT_STD)
                  for m in ms]
            quantize_group(model, group, ws)
            del ws
        elif isinstance(model.get_submodule(mod), RMSNorm):
            _assign(model, key, torch.ones(t.shape, device=device))
        else:
            _assign(model, key, torch.randn(t.shape, generator=gen, device=device, dtype=t.dtype).mul_(INIT_STD))
    model.name_or_path = None
    return _finish(model, device)


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(resolve(name_or_path))


# ----------------------------------------------------------------------------------------------

if __name__ == "__main__":  # python model.py <hub id or dir> "prompt": greedy, no KV cache (see rollout.py)
    path, prompt = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "The capital of France is"
    tok, model = load_tokenizer(path), load_model(path, quant="bf16")
    ids = torch.tensor([tok(prompt)["input_ids"]], device=model.lm_head.weight.device)
    with torch.inference_mode():
        for _ in range(24):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    print(tok.decode(ids[0]))
