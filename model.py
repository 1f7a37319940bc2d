"""The policy network: a Qwen2 / Qwen3 / Llama decoder in plain PyTorch.

The decoder
-----------
A batch of token ids x (B, T) at positions p (B, T) goes through L identical layers. With
RMSNorm(h) = h / sqrt(mean_c(h²) + ε) ⊙ w (statistics over the H channels of one token):

    h⁰      = E[x]                                     embed_tokens                       (B, T, H)
    a       = RMSNorm(hˡ; w₁)                          input_layernorm
    q, k, v = a·W_qᵀ + b_q, a·W_kᵀ + b_k, a·W_vᵀ + b_v  Hq query heads, Hkv key/value heads (B, T, H*, D)
    q, k    = RMSNorm(q; w_q), RMSNorm(k; w_k)         Qwen3 only: q_norm, k_norm over each head's D channels
    q, k    = RoPE(q, p), RoPE(k, p)                   rotate channel pairs (i, i+D/2) by p·θ^(-2i/D)
    o_t     = Σ_{s≤t} softmax_s(q_t·k_s/√D) v_s        causal; query head j reads kv head j // (Hq/Hkv)
    h'      = hˡ + o·W_oᵀ
    m       = RMSNorm(h'; w₂)                          post_attention_layernorm
    hˡ⁺¹    = h' + (silu(m·W_gateᵀ) ⊙ m·W_upᵀ)·W_downᵀ
    logits  = RMSNorm(hᴸ; w_f)·W_headᵀ                 model.norm, lm_head (W_head = E when tied)

Qwen2 has biases on q/k/v only; Llama and Qwen3 have none unless `attention_bias` (then o_proj too).
Qwen3 normalizes each head of q and k (weights of size D, the layers' ε) before RoPE, and its head_dim
is given, not H / Hq (Qwen3-0.6B: H 1024, 16 heads of 128, so q_proj maps 1024 -> 2048). Llama 3.1
"llama3" RoPE divides the low frequencies by `factor` and interpolates the middle band.

Precision. Linears, embeddings and activations are in `dtype` (bf16). Norm weights are fp32: AQN adds
noise of σ = 5e-4 to them, below bf16's spacing near 1 (2^-8). (Qwen3's q_norm / k_norm are fp32 too,
and noise-free: the paper's noise is on each layer's two norms only, aqn.NOISY_NORMS.) The norm
computes in fp32 and casts its output to the activation dtype; RoPE angles, cos/sin and the rotation
itself are fp32 as well.

Residual adds (vLLM's fused add + RMSNorm). Each `h + ...` above is done by the norm that reads the
sum: a layer returns the pair (MLP(m), h') instead of hˡ⁺¹ = h' + MLP(m), and the next
input_layernorm (or model.norm) computes the sum and its norm together, which is one kernel on the
sampler's fast path instead of an add and a norm. The sum is rounded to the activation dtype as the
add in each layer would round it, so the logits are bit-identical.

The seam. The norms, RoPE, the embedding lookup and the projections that share an input (q/k/v,
gate/up) go through ops.py: plain torch here, fused Triton kernels on the sampler's no-grad CUDA
forwards. The linears are nn.Linear (bf16) or nvfp4.NVFP4Linear (4-bit, quant="nvfp4"); lora.py
wraps them. Nothing in this file knows which kernel runs.

Names. Module paths are Hugging Face's (`model.layers.3.self_attn.q_proj`, `lm_head`), so a state
dict key is the checkpoint key, a quantized linear's buffers are compressed-tensors' keys
(`...q_proj.weight_packed / weight_scale / weight_global_scale`, see nvfp4.py), and LoRA adapter keys
come out as PEFT's. checkpoint.py loads and saves them.

The attention hook. `forward(ids, positions, attn_ctx)`: with attn_ctx=None each layer runs dense
causal SDPA over its T tokens (training, scoring). Otherwise layer i calls

    attn_ctx.attend(i, q (B,T,Hq,D), k (B,T,Hkv,D), v (B,T,Hkv,D), cos, sin) -> (B,T,Hq,D)

with q, k not yet rotated (Qwen3's already normed) and cos/sin (B, T, 1, D/2) at `positions`: the
context applies RoPE, stores k, v in its paged cache and attends over everything cached (rollout.py:
packed prefill, paged decode, where one kernel does all three). The model never imports the
sampler, and the same weights, LoRA adapters and AQN noise serve both paths.

Training. `model.gradient_checkpointing = True` keeps only each layer's input and recomputes the
layer in the backward pass (torch.utils.checkpoint, use_reentrant=False). The recomputation reads
the weights as they are at backward time, so AQN noise must stay applied across forward and backward.

Left out: KV cache (rollout.py owns it), sliding-window attention (such configs are refused), RoPE
types other than default and llama3, MLP biases, dropout. Tests: tests/test_model.py and
tests/test_qwen3.py compare logits with transformers in fp32.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import nvfp4
import ops

SUPPORTED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUPS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}  # share an input
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# ----------------------------------------------------------------------------------------------
# Config


@dataclass
class ModelConfig:
    """Shapes and constants of one decoder; `from_hf` reads a transformers config.json dict."""
    architecture: str                     # "Qwen2ForCausalLM" | "Qwen3ForCausalLM" | "LlamaForCausalLM"
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
    attention_bias: bool | None = None    # None: True for Qwen2 (q/k/v), False for Qwen3 and Llama
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
    def o_bias(self) -> bool:  # Llama's and Qwen3's attention_bias covers o_proj too; Qwen2's never does
        return self.attention_bias and self.architecture != "Qwen2ForCausalLM"

    @property
    def qk_norm(self) -> bool:  # Qwen3: an RMSNorm over each head of q and k, before RoPE
        return self.architecture == "Qwen3ForCausalLM"

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        arch = (d.get("architectures") or [MODEL_TYPES.get(d.get("model_type"), f"model_type={d.get('model_type')!r}")])[0]
        if arch not in SUPPORTED:
            raise ValueError(f"unsupported architecture {arch}: qerl supports {', '.join(SUPPORTED)}")
        if d.get("hidden_act", "silu") != "silu" or d.get("mlp_bias"):
            raise ValueError("unsupported config: needs hidden_act='silu' and no mlp_bias")
        # transformers 5 also writes layer_types: all "full_attention" when the window is off
        windowed = sorted({t for t in d.get("layer_types") or () if t != "full_attention"})
        if d.get("use_sliding_window") or windowed:
            raise ValueError(f"unsupported config: sliding-window attention (use_sliding_window="
                             f"{d.get('use_sliding_window')}, layer_types {windowed or 'all full'}); qerl's "
                             f"attention is full causal in every layer")
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
                   # transformers' Qwen3Config defaults head_dim to 128, not hidden / heads
                   head_dim=d.get("head_dim", 128 if arch == "Qwen3ForCausalLM" else None),
                   rms_norm_eps=d.get("rms_norm_eps", 1e-6),
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
        if self.architecture == "Qwen3ForCausalLM":
            d.update(attention_bias=self.attention_bias, use_sliding_window=False, sliding_window=None)
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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))  # fp32: AQN noise must be representable
        self.feeds = None   # (parent, names): the group that projects the output next (Block sets it)

    def forward(self, x, residual=None):
        """(..., C) -> norm(x) in x.dtype; with residual: (norm(x + residual), x + residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual, self.feeds)


def make_linear(in_features: int, out_features: int, bias: bool, quant: str, dtype) -> nn.Module:
    if quant == "nvfp4":
        return nvfp4.NVFP4Linear(in_features, out_features, bias=bias, dtype=dtype)
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, quant: str, dtype):
        super().__init__()
        self.layer_idx, self.n_heads, self.n_kv, self.head_dim = layer_idx, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qk_norm = cfg.qk_norm
        H, D, b = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = make_linear(H, self.n_heads * D, b, quant, dtype)
        self.k_proj = make_linear(H, self.n_kv * D, b, quant, dtype)
        self.v_proj = make_linear(H, self.n_kv * D, b, quant, dtype)
        self.o_proj = make_linear(self.n_heads * D, H, cfg.o_bias, quant, dtype)
        if cfg.qk_norm:  # Qwen3: one weight of size D shared by all heads of q (of k)
            self.q_norm, self.k_norm = RMSNorm(D, cfg.rms_norm_eps), RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attn_ctx=None):
        B, T, _ = x.shape
        q, k, v = ops.project(self, GROUPS["self_attn"], x)       # one stacked matmul on the fast path
        q = q.view(B, T, self.n_heads, self.head_dim)               # (B, T, Hq, D)
        k = k.view(B, T, self.n_kv, self.head_dim)                  # (B, T, Hkv, D)
        v = v.view(B, T, self.n_kv, self.head_dim)                  # (B, T, Hkv, D)
        if self.qk_norm:  # before RoPE: every attention path (SDPA, the sampler's kernels) gets them normed
            q, k = self.q_norm(q), self.k_norm(k)
        if attn_ctx is None:  # dense causal over the T tokens of each row; SDPA wants (B, heads, T, D)
            q, k = ops.rope(q, k, cos, sin)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=self.n_kv != self.n_heads)
            y = y.transpose(1, 2)                                     # (B, T, Hq, D)
        else:                 # the sampler's cache: it rotates q, k, stores k, v and attends
            y = attn_ctx.attend(self.layer_idx, q, k, v, cos, sin)    # (B, T, Hq, D)
        return self.o_proj(y.reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: str, dtype):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = make_linear(H, I, False, quant, dtype)
        self.up_proj = make_linear(H, I, False, quant, dtype)
        self.down_proj = make_linear(I, H, False, quant, dtype)

    def forward(self, x):  # (B, T, H) -> (B, T, H) through (B, T, I)
        return self.down_proj(ops.gated_mlp_input(self, x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, quant: str, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, quant, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, quant, dtype)
        # each norm feeds a group that shares its input (ops.rms_norm may begin the group's LoRA update)
        self.input_layernorm.feeds = (self.self_attn, GROUPS["self_attn"])
        self.post_attention_layernorm.feeds = (self.mlp, GROUPS["mlp"])

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
    """Qwen2ForCausalLM / Qwen3ForCausalLM / LlamaForCausalLM. Set `gradient_checkpointing = True` to
    recompute each layer in the backward pass (torch.utils.checkpoint, use_reentrant=False)."""

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
        x, cos, sin = ops.embed_rope(input_ids, positions, self.model.embed_tokens, self.inv_freq)  # (B, T, H)
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
# Stacks: the projections that share an input, stored back to back


class Stack:
    """The linears `mods` of one group (q/k/v, or gate/up: one input, one kind) over one allocation.

    `linear` is one linear of Σ N_i rows whose tensors are the members' stacked, and each member's
    tensor becomes a row slice of it (N_i its out_features, K its in_features):

        weight         (Σ N_i, K)       bf16;  or, NVFP4:
        weight_packed  (Σ N_i, K/2)     uint8
        weight_scale   (Σ N_i, K/16)    float8_e4m3fn
        bias           (Σ N_i,)         where the members have one
        member i       rows [N_0 + ... + N_{i-1}, + N_i) of each: a view, no copy

    So the state dict, checkpoints, LoRA and the training forward see the members unchanged, while
    the sampler's fast path (ops.project) multiplies a group once. NVFP4 members must share one
    global scale (a kernel applies one per matmul): the loader gives each group one, the smallest of
    the members' (checkpoint.quantize_group). A group that cannot share (mixed kinds, biases, scales)
    gets no stack. A member whose tensor no longer lives in the stack (.to(), a reload that rebinds a
    parameter) ends it: `holds` compares data pointers. `lora_casts` is where the kernels keep the
    group's adapter casts between calls."""

    TENSORS = ("weight", "weight_packed", "weight_scale", "bias")

    @staticmethod
    def can_stack(mods) -> bool:
        first = mods[0]
        if type(first) not in (nn.Linear, nvfp4.NVFP4Linear) or not all(
                type(m) is type(first) and m.in_features == first.in_features
                and (m.bias is None) == (first.bias is None) for m in mods):
            return False
        return not isinstance(first, nvfp4.NVFP4Linear) or all(
            torch.equal(m.weight_global_scale, first.weight_global_scale) and m.interleaved == first.interleaved
            for m in mods)

    def __init__(self, mods):
        first = mods[0]
        self.sizes = [m.out_features for m in mods]
        self.lora_casts = None
        shape = (first.in_features, sum(self.sizes), first.bias is not None)    # on meta: every tensor is bound below
        if isinstance(first, nvfp4.NVFP4Linear):
            self.linear = nvfp4.NVFP4Linear(*shape, device="meta")
            self.linear.weight_global_scale, self.linear.interleaved = first.weight_global_scale, first.interleaved
        else:
            self.linear = nn.Linear(*shape, device="meta")
        for name in self.TENSORS:
            if getattr(first, name, None) is None:
                continue
            stacked = torch.cat([getattr(m, name).detach() for m in mods])             # (Σ N, ...)
            self._bind(self.linear, name, stacked)
            for m, rows in zip(mods, stacked.split(self.sizes)):
                self._bind(m, name, rows)
        self.names = [n for n in self.TENSORS if getattr(first, n, None) is not None]
        self.ptrs = self._ptrs(mods)

    @staticmethod
    def _bind(module, name, t):
        """module.<name> = t, a frozen parameter where it is one, else a buffer."""
        if name in module._parameters:
            module._parameters[name] = nn.Parameter(t, requires_grad=False)
        else:
            module._buffers[name] = t

    def _ptrs(self, mods):
        return [getattr(m, name).data_ptr() for m in mods for name in self.names]

    def holds(self, mods) -> bool:
        """Are the members' tensors still slices of the stack? (.to() or a reload ends that.)"""
        return self._ptrs(mods) == self.ptrs


def stack_groups(model: nn.Module) -> nn.Module:
    """Give every layer's groups (GROUPS) a Stack where they can share one, else None (the
    `stacked` attribute of self_attn and mlp, which ops.project reads)."""
    for layer in model.model.layers:
        for attr, names in GROUPS.items():
            parent = getattr(layer, attr)
            mods = [getattr(parent, n) for n in names]
            parent.stacked = Stack(mods) if Stack.can_stack(mods) else None
    return model


# ----------------------------------------------------------------------------------------------

if __name__ == "__main__":  # python model.py: a tiny random Qwen2 decoder and one forward (checkpoint.py loads real ones)
    cfg = ModelConfig("Qwen2ForCausalLM", vocab_size=1000, hidden_size=128, intermediate_size=256,
                      num_layers=2, num_heads=4, num_kv_heads=2)
    model = Transformer(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():            # norms 1, the rest N(0, 0.02²)
            p.normal_(std=0.02) if p.ndim > 1 else p.fill_(1.0)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    print(model)
    print(f"logits {tuple(model(ids).shape)} for ids {tuple(ids.shape)}")
