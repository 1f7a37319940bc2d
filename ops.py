"""The seam: the one face through which the trunk reaches the fast kernels.

The trunk (model.py, nvfp4.py, lora.py, rollout.py, ...) computes in plain PyTorch. A few of its ops
run many thousands of times in a rollout, where a decode step is ~500 tiny launches and the torch
ops would cost more GPU time than the 4-bit matmuls: an RMSNorm is ~7 kernels, a RoPE call 8, a LoRA
update two GEMMs and an add. For those, the `kernels/` package (the speed wing) has Triton kernels
that compute the same function. Each entry below is the pure-torch reference of one such op (or a
call of the trunk's own reference: attention.py, sampling.py, the layer's dequantized weight), plus
the line that uses the fast kernel where `kernels` says it can run. No other trunk file imports
`kernels`; the wing imports nothing of the trunk and reads the trunk's objects by their attributes.

When does the fast path run? `runs(x)`: Triton is present, x is on a CUDA device, and autograd is
off, i.e. on the rollout's forwards (sampling, scoring). Training forwards, every CPU run and
anything the kernels do not cover take the reference, so autograd never meets a hand-written
kernel (but for the NVFP4 matmul, whose backward is the dx kernel) and a reader can check every
formula here against model.py's docstring. On a CUDA training pass the norm, RoPE and SiLU·mul
references are handed to `kernels.compiled`, which runs that same function compiled by
torch.compile: one fused kernel forward and one backward where eager autograd launches ~10 each.

The teaching kernel. `QERL_MATMUL=teaching` (in the environment when the model loads and runs)
routes every NVFP4 matmul of the trunk through marlin_kernel.matmul, the one Triton GEMM written to
be read, on the plain compressed-tensors layout; the fused paths that multiply NVFP4 weights inside
the wing (stacked q/k/v and gate/up, folded LoRA updates) then take their references, and the other
kernels (norms, attention, sampling) stay. So an edit of marlin_kernel.py shows in a real run,
slower. Nothing else reads the variable.

The ops:

    nvfp4_linear(layer, x)            x·W'ᵀ + b for an NVFP4 layer, W' its dequantized weight
    dense_weight(layer, dtype)        W' itself (training passes: plan.py)
    rms_norm(x, w, eps, residual, feeds)  x / sqrt(mean_c(x²) + ε) ⊙ w; with residual: (norm(x + r), x + r)
    apply_rope / rope(q, k, cos, sin)  (x1, x2) -> (x1·cos - x2·sin, x2·cos + x1·sin) on channel halves
    embed_rope(ids, pos, E, inv_freq)  E[ids] and cos, sin of pos·inv_freq
    project(parent, names, x)         [parent.<name>(x) for name in names]: q/k/v share x
    gated_mlp_input(parent, x)        silu(gate_proj(x)) ⊙ up_proj(x)
    lora_linear(x, base, A, B, s)     base(x) + s · (x Aᵀ) Bᵀ
    refresh_casts(t) / casts_kept()   when the adapters' kept bf16 casts of A and B are refreshed
    logits(hidden, head)              head(hidden), fp32
    logprob_stats / logprob_grad      log π(target), entropy and log Z of logit rows; their gradient
    cache_table / place_caches        where the KV caches lie, which the attention kernels read
    store_kv / paged_attention        the KV cache's store and decode attention (attention.py's references)
    fill_tokens(meta, prev)           the tokens of the step in flight into the next step's inputs
    sample(logits, params, ...)       tokens and their logprobs (sampling.py's reference)

and the questions the trunk asks of the wing: runs, interleaves, attention_kernels, sampler_runs,
describe (the start-up line) and kernel_settings (what a CUDA graph's key must include).

The references keep the rounding the kernels reproduce: the norm and RoPE compute in fp32 and cast
back to the activation dtype once; the residual sum is rounded to the activation dtype as torch's
add rounds it. So a fused decode step and a torch one give the same logits to the last bit where
the kernels promise it (tests/test_model.py and the kernel tests check).

Test: tests/test_ops.py (each reference against an independent formula, the teaching route); the
fast paths are checked against these references by tests/test_kernels_*.py; tests/test_layout.py
checks that the imports run one way.
"""
import contextlib
import contextvars
import os

import torch
import torch.nn.functional as F

import kernels
import sampling
from attention import paged_attention_ref, store_kv_ref

TEACHING = os.environ.get("QERL_MATMUL") == "teaching"    # the teaching kernel multiplies NVFP4 weights


# ----------------------------------------------------------------------------------------------
# where the kernels run

def runs(x: torch.Tensor) -> bool:
    """Does the rollout fast path take x: Triton, CUDA, no autograd (kernels.runs)?"""
    return kernels.runs(x)


def _fused_matmuls(x) -> bool:
    """The fast paths that multiply NVFP4 weights inside the wing (stacks, folded LoRA): off under
    the teaching kernel, whose matmul they would bypass."""
    return kernels.runs(x) and not TEACHING


def interleaves(t: torch.Tensor) -> bool:
    """Do NVFP4 weights on t's device go into the fast kernels' layout (nvfp4.interleave)? On CUDA,
    unless the teaching kernel, which reads the plain layout, multiplies them."""
    return t.is_cuda and not TEACHING


def attention_kernels(device) -> bool:
    """Can the paged-attention kernels run on this device (the sampler's "triton" backend)?"""
    return kernels.available and (torch.device(device).type == "cuda" or kernels.interpreting())


def describe(device) -> tuple[str, list[str]]:
    """(the start-up line naming the fast paths that run on device, warnings for any that cannot)."""
    line, warnings = kernels.describe(device)
    return (line + " (NVFP4 matmuls: the teaching kernel, QERL_MATMUL=teaching)" if TEACHING else line), warnings


def kernel_settings():
    """The kernels' settings now (kernels.current(), hashable): a CUDA graph records the launches
    they chose, so its key includes them."""
    return kernels.current()


# ----------------------------------------------------------------------------------------------
# the NVFP4 matmul

def nvfp4_linear(layer, x):
    """x (..., K) -> x·W'ᵀ + b (..., N) in x.dtype for an NVFP4 layer (nvfp4.NVFP4Linear, read by
    its attributes). Reference: W' dequantized (layer.dequantized_weight) and F.linear, with autograd
    through it. Fast, on bf16 CUDA activations: a kernel reads the 4-bit weight as it is, and where x
    needs a gradient (the training pass) the backward is dy·W' by the dx kernel: W' is frozen, so
    the gradient flows to x (and to the bias, if unfrozen) only."""
    x2 = x.reshape(-1, x.shape[-1])                                       # (M, K)
    bias = layer.bias
    if not _fp4_kernel_runs(x2):
        y = F.linear(x2, layer.dequantized_weight(x.dtype), bias.to(x.dtype) if bias is not None else None)
    elif torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        y = _FP4Matmul.apply(x2, bias, layer)
    else:
        y = _fp4_matmul(x2, bias, layer)                                  # no autograd (rollout)
    return y.view(*x.shape[:-1], y.shape[-1])                             # (..., N)


def _fp4_kernel_runs(x2) -> bool:
    """Does a kernel multiply x2 by an NVFP4 weight: bf16 activations on CUDA, Triton present?"""
    return x2.is_cuda and x2.dtype == torch.bfloat16 and kernels.available


def _fp4_matmul(x2, bias, layer):
    """y (M, N) bf16 on a kernel: the wing's route, or the teaching kernel (plain layout only)."""
    b = bias.to(torch.bfloat16) if bias is not None else None
    args = (x2.contiguous(), layer.weight_packed, layer.weight_scale, layer.weight_global_scale, b)
    if not TEACHING:
        return kernels.nvfp4_matmul(*args, interleaved=layer.interleaved)
    if layer.interleaved:
        raise ValueError("QERL_MATMUL=teaching: this NVFP4 layer holds the fast kernels' layout; set the "
                         "variable before the model loads, so that its weights stay in the plain one")
    import marlin_kernel                  # here, not above: it needs Triton, and the trunk runs without it
    return marlin_kernel.matmul(*args)


class _FP4Matmul(torch.autograd.Function):
    """_fp4_matmul with the gradient flowing to x (and an unfrozen bias) only: W' is frozen."""

    @staticmethod
    def forward(ctx, x2, bias, layer):
        ctx.layer = layer
        return _fp4_matmul(x2, bias, layer)

    @staticmethod
    def backward(ctx, dy):                                                # dy (M, N) -> dx (M, K)
        w = ctx.layer
        if TEACHING:                      # the teaching kernel has no dx twin: the reference
            dx = dy @ w.dequantized_weight(dy.dtype)
        else:
            dx = kernels.nvfp4_matmul_dx(dy.contiguous(), w.weight_packed, w.weight_scale, w.weight_global_scale,
                                         interleaved=w.interleaved)
        return dx, (dy.sum(0) if ctx.needs_input_grad[1] else None), None


def dense_weight(layer, dtype=torch.bfloat16):
    """An NVFP4 layer's weight dequantized, (N, K) in dtype: one Triton pass on the GPU for bf16
    (the very numbers the kernels' large-M route multiplies by), layer.dequantized_weight elsewhere."""
    if dtype == torch.bfloat16 and kernels.gemm_runs(layer.weight_packed) and layer.in_features % 64 == 0:
        return kernels.dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, layer.interleaved)
    return layer.dequantized_weight(dtype)


# ----------------------------------------------------------------------------------------------
# the decoder's small ops

def rms_norm(x, weight, eps, residual=None, feeds=None):
    """x (..., C), weight (C,) fp32 -> norm(x) in x.dtype; with residual: (norm(x + residual), x + residual).
    The fast kernel may read residual before the kernel launched just before it has finished, so
    residual must be the stream, never the output of the op just before (a decoder layer's is).
    feeds = (parent, names): the group that projects the result next (q/k/v, gate/up); the fast path
    may begin that group's LoRA update in the norm's launch, which project then finishes."""
    if kernels.runs(x):
        group = _group(*feeds) if feeds is not None and _fused_matmuls(x) else None
        if group is not None:
            group = (*group, refresh_casts(x))                            # (stack, members, refresh)
        return kernels.rms_norm(x, weight, eps, residual, group)
    return kernels.compiled(_rms_norm, x)(x, weight, eps, residual)


def _rms_norm(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual                                                  # rounded to x.dtype, as a layer's add
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = (h * weight).to(x.dtype)
    return h if residual is None else (h, x)


def apply_rope(x, cos, sin):
    """x (B, T, heads, D); cos/sin (B, T, 1, D/2) fp32. Rotates the pairs (i, i + D/2), in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope(q, k, cos, sin):
    """apply_rope on q (B, T, Hq, D) and k (B, T, Hkv, D): one launch, in place, where the layout allows."""
    if kernels.runs(q) and kernels.rope_fits(q, k):
        return kernels.rope(q, k, cos, sin)
    return kernels.compiled(_rope, q)(q, k, cos, sin)


def _rope(q, k, cos, sin):
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def embed_rope(ids, positions, embedding, inv_freq):
    """ids, positions (B, T) -> the embeddings E[ids] (B, T, H) and the RoPE cos, sin (B, T, 1, D/2)
    fp32 of the angles positions·inv_freq (five torch kernels, one fused launch)."""
    if (kernels.runs(ids) and type(embedding) is torch.nn.Embedding and inv_freq.dtype == torch.float32
            and positions.shape == ids.shape):
        return kernels.embed_rope(ids, positions, embedding.weight, inv_freq)
    angles = positions[..., None].float() * inv_freq                      # (B, T, D/2) fp32
    return embedding(ids), angles.cos()[:, :, None], angles.sin()[:, :, None]   # (B, T, 1, D/2): over heads


# ----------------------------------------------------------------------------------------------
# projections that share an input: q/k/v, gate/up

def project(parent, names, x):
    """[parent.<name>(x) for name in names]. Fast path: one matmul over the group's weights stacked
    back to back (model.Stack, built after loading), then the adapters' updates as one."""
    out = _stacked(parent, names, x, silu_mul=False) if _fused_matmuls(x) else None
    return [getattr(parent, n)(x) for n in names] if out is None else out


def gated_mlp_input(parent, x):
    """silu(gate_proj(x)) ⊙ up_proj(x), the input of down_proj. Fast path: the stacked gate/up matmul,
    at one decode row with SiLU·mul in the matmul's own epilogue; else one SiLU·mul kernel."""
    if kernels.runs(x):
        out = _stacked(parent, ("gate_proj", "up_proj"), x, silu_mul=True) if not TEACHING else None
        return kernels.silu_mul(parent.gate_proj(x), parent.up_proj(x)) if out is None else out
    gate, up = parent.gate_proj(x), parent.up_proj(x)     # both before the SiLU: the backward sums dx
    return kernels.compiled(_silu_mul, x)(gate, up)        # in this graph's order, the same bits each run


def _stacked(parent, names, x, silu_mul):
    """The group's projection by its stack (kernels.project), or None: no stack (_group), or adapters
    one update cannot serve."""
    group = _group(parent, names)
    return None if group is None else kernels.project(*group, x, silu_mul, refresh_casts(x))


def _group(parent, names):
    """(stack, members) of parent's group, or None: no stack, or a stack that no longer holds the
    members' tensors (they moved: .to(), a reload; the stack is dropped for good)."""
    stack = getattr(parent, "stacked", None)
    if stack is None:
        return None
    mods = [getattr(parent, n) for n in names]
    if not stack.holds([getattr(m, "base_layer", m) for m in mods]):     # through a LoRA wrapper
        parent.stacked = None
        return None
    return stack, mods


def _silu_mul(gate, up):
    return F.silu(gate) * up


# ----------------------------------------------------------------------------------------------
# LoRA and the lm_head

def add_update(y, h, B, scale):
    """y + scale · h Bᵀ (y (..., out), h (..., r), B (out, r)) as one addmm. Without autograd, on a y
    whose rows are one view, in place: y is a fresh output, and an out-of-place addmm would first copy
    it (at a GRPO batch 7B's gate/up output is ~10 MB a decode step)."""
    h2 = h.reshape(-1, h.shape[-1])
    if not torch.is_grad_enabled() and (y.dim() == 2 or y.is_contiguous()):
        y.view(-1, y.shape[-1]).addmm_(h2, B.t(), alpha=scale)
        return y
    return torch.addmm(y.reshape(-1, y.shape[-1]), h2, B.t(), alpha=scale).view(y.shape)


def lora_linear(x, base, A, B, scale):
    """base(x) + scale · (x Aᵀ) Bᵀ; A (r, in), B (out, r) in x's dtype. Fast path: at decode (<= 16
    rows) two small Triton kernels, the second folded into the NVFP4 matmul where it can add the
    update as it stores y; beyond, the update folded into the matmul's split-K sum where it has one."""
    if _fused_matmuls(x):
        return kernels.lora_linear(x, base, A, B, scale)
    h = F.linear(x, A)                                     # (..., r); before base(x), which fixes the
    return add_update(base(x), h, B, scale)                # order the backward sums x's gradients in


# ----------------------------------------------------------------------------------------------
# the adapters' kept casts and CUDA graphs

_CASTS_KEPT = contextvars.ContextVar("casts_kept", default=False)   # set while a decode graph is captured


@contextlib.contextmanager
def casts_kept():
    """While a decode step's CUDA graph is captured: the adapters' kept casts (LoRA's A and B in the
    activation dtype, lora.py) are read as they are, so a replay runs no cast kernel. That is safe
    because the prefill that starts every generate() call refreshes them, eagerly or as a graph
    replay whose capture recorded the refresh."""
    token = _CASTS_KEPT.set(True)
    try:
        yield
    finally:
        _CASTS_KEPT.reset(token)


def refresh_casts(t) -> bool:
    """Should a kept cast on t's device be refreshed now? Always, except while casts_kept() holds
    during a capture."""
    return not (_CASTS_KEPT.get() and t.is_cuda and torch.cuda.is_current_stream_capturing())


def logits(hidden, head):
    """head(hidden): (rows, H) -> (rows, V) fp32 logits. Fast path: a GEMV for the one or two rows of a
    small decode batch, which streams the bf16 vocabulary matrix faster than cuBLAS does at M <= 2."""
    if kernels.runs(hidden) and kernels.lm_head_fits(hidden, head):
        return kernels.lm_head(hidden, head)
    y = head_matmul(hidden, head.weight)
    return y if head.bias is None else y + head.bias


def head_matmul(h, w):
    """h (n, H) · w (V, H)ᵀ -> (n, V) fp32. On CUDA the GEMM's fp32 sums are kept, not rounded to bf16
    first: cuBLAS writes fp32 from bf16 inputs directly (torch.mm's out_dtype). A bf16 logit near 20
    is a multiple of 1/8; rounding there would put up to 1/16 of noise on every log-prob the sampler
    records and the trainer computes (the sampler's GEMV and the trainer's ChunkLogprobs both keep
    fp32). Elsewhere the product is taken in the inputs' dtype (fp32 on the CPU runs)."""
    if h.is_cuda and h.dtype in (torch.bfloat16, torch.float16) and w.dtype == h.dtype:
        return torch.mm(h, w.t(), out_dtype=torch.float32)
    return (h @ w.t()).float()


def logprob_stats(logits, target):
    """logits (n, V) fp32 at the sampling temperature, target (n,) -> log π(target), the entropy of π
    and log Z, each (n,) fp32. On the CUDA training path one fused kernel (kernels.compiled): eager
    torch reads and writes the (n, V) rows about eight times (logsumexp, the softmax, its product
    with the logits, the sum), a 152k vocabulary making each row 0.6 MB."""
    return kernels.compiled(_logprob_stats, logits, training=True)(logits, target)


def _logprob_stats(logits, target):
    logz = logits.logsumexp(-1)                                               # (n,)
    logp = logits.gather(1, target[:, None])[:, 0] - logz
    ent = logz - ((logits - logz[:, None]).exp() * logits).sum(-1)            # -Σ p log p
    return logp, ent, logz


def logprob_grad(logits, logz, target, g, dtype):
    """The gradient of Σ g · log π(target) with respect to the logits: g · (onehot(target) - π),
    (n, V) in dtype, from logits (n, V) fp32, logz, target, g (n,). Fused like logprob_stats."""
    return kernels.compiled(_logprob_grad, logits, training=True)(logits, logz, target, g, dtype)


def _logprob_grad(logits, logz, target, g, dtype):
    onehot = torch.arange(logits.shape[1], device=logits.device)[None] == target[:, None]   # (n, V)
    return ((onehot.float() - (logits - logz[:, None]).exp()) * g[:, None]).to(dtype)


# ----------------------------------------------------------------------------------------------
# the sampler: the KV cache, decode attention, the tokens in flight, sampling

def cache_table(layers, device):
    """(layers, 2) int64: where each layer's K and V caches lie, for the kernels (place_caches fills it).
    The kernels reach the caches through it, so a CUDA graph outlives the caches it ran on."""
    return kernels.cache_table(layers, device)


def place_caches(table, k_caches, v_caches):
    """Point the cache table at the caches, (L, num_blocks, bs, Hkv, D) each."""
    kernels.place_caches(table, k_caches, v_caches)


def store_kv(k_cache, v_cache, k, v, slots, *, place):
    """k, v (N, Hkv, D) into their cache slots (N,) (-1: skip): one kernel where it runs, which
    reaches the caches through place (their row of the cache table), else attention.store_kv_ref."""
    if attention_kernels(k.device):
        return kernels.store_kv(k_cache, v_cache, k, v, slots, place)
    return store_kv_ref(k_cache, v_cache, k, v, slots)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale, *, place, max_model_len, counts,
                    partition_size=None, rope=None):
    """Decode attention over the paged cache, q (B, Hq, D) -> (B, Hq, D). The kernel reaches the
    caches through place (their row of the cache table), splits the context into partitions it
    merges by log-sum-exp (counts: its (rows, Hkv) int32 counters, attention_counts) and, given rope
    = (k, v, cos, sin, slots), first rotates q and the new k and stores k, v, in the same launch.
    attention.paged_attention_ref is the reference (rope None)."""
    if attention_kernels(q.device):
        return kernels.paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale, place=place,
                                       max_model_len=max_model_len, counts=counts,
                                       partition_size=partition_size, rope=rope)
    if rope is not None:
        raise ValueError("paged_attention: the reference takes q and k rotated and k, v stored (rope=None)")
    return paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)


def attention_counts(rows, num_kv_heads, device):
    """int32 zeros (rows, Hkv): the paged-attention kernel's merge counters (kept by the caller, so
    that CUDA graphs read them at one address)."""
    return kernels.attention_counts(rows, num_kv_heads, device)


def fill_tokens(meta, prev_tokens):
    """meta[0] = prev_tokens[meta[4]] where meta[4] >= 0, in place (meta: the (6, B) int32 decode
    inputs of rollout.py): the tokens of the step in flight, which never visit the host. One kernel
    on CUDA; the torch ops are its reference."""
    if meta.is_cuda and kernels.available:
        return kernels.fill_tokens(meta, prev_tokens)
    src = meta[4].long()
    meta[0].copy_(torch.where(src >= 0, prev_tokens[src.clamp(min=0)].to(meta.dtype), meta[0]))


def sampler_runs(params, shape, device) -> bool:
    """Does sample() take the kernels for (B, V) logits on device under params (no top-k / top-p)?"""
    filtered = 0 < params.top_k < shape[1] or params.top_p < 1
    return kernels.sampler_runs(filtered, shape, device)


def sample(logits, params, generator=None, keys=None, out=None):
    """logits (B, V) -> tokens (B,) long, logprobs (B,) fp32 under the sampling distribution
    (sampling.py: temperature, top-k, top-p). keys: (B,) int64, each row's random key (None: draw
    from `generator`); out: (tokens, logprobs) tensors to write into. Two kernels where sampler_runs,
    else sampling.sample."""
    if sampler_runs(params, logits.shape, logits.device):
        return kernels.sample(logits, params.temperature, generator, keys=keys, out=out)
    tokens, logprobs = sampling.sample(logits, params, generator, keys)
    if out is None:
        return tokens, logprobs
    out[0].copy_(tokens)
    out[1].copy_(logprobs)
    return out
