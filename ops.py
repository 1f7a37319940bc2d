"""The seam: every place where the trunk may hand an op to a fast kernel.

The trunk (model.py, lora.py, rollout.py, sampling.py) computes in plain PyTorch. A few of its ops
run many thousands of times in a rollout, where a decode step is ~500 tiny launches and the torch
ops would cost more GPU time than the 4-bit matmuls: an RMSNorm is ~7 kernels, a RoPE call 8, a LoRA
update two GEMMs and an add. For those, the `kernels/` package (the speed wing) has Triton kernels
that compute the same function. Each function below is the pure-torch reference of one such op,
plus one line that uses the fast kernel where `kernels` says it can run. The trunk knows nothing of
launch shapes, routes or fusions; the wing knows nothing of RL.

When does the fast path run? `kernels.runs(x)`: Triton is present, x is on a CUDA device, and
autograd is off, i.e. on the rollout's forwards (sampling, scoring). Training forwards, every CPU
run and anything the kernels do not cover take the reference below, so autograd never meets a
hand-written kernel and a reader can check every formula here against model.py's docstring. On a
CUDA training pass the norm, RoPE and SiLU·mul references are handed to `kernels.compiled`, which
runs that same function compiled by torch.compile: one fused kernel forward and one backward where
eager autograd launches ~10 each. The NVFP4 matmul itself is the other hand-off (nvfp4.linear ->
marlin_kernel.nvfp4_matmul -> kernels).

The ops:

    rms_norm(x, w, eps, residual)     x / sqrt(mean_c(x²) + ε) ⊙ w; with residual: (norm(x + r), x + r)
    apply_rope / rope(q, k, cos, sin)  (x1, x2) -> (x1·cos - x2·sin, x2·cos + x1·sin) on channel halves
    embed_rope(ids, pos, E, inv_freq)  E[ids] and cos, sin of pos·inv_freq
    project(parent, names, x)         [parent.<name>(x) for name in names]: q/k/v share x
    gated_mlp_input(parent, x)        silu(gate_proj(x)) ⊙ up_proj(x)
    lora_linear(x, base, A, B, s)     base(x) + s · (x Aᵀ) Bᵀ
    logits(hidden, head)              head(hidden), fp32
    logprob_stats / logprob_grad      log π(target), entropy and log Z of logit rows; their gradient
    dense_weight(layer, dtype)        an NVFP4 layer's dequantized weight (training passes: plan.py)
    refresh_casts(t) / casts_kept()   when the adapters' kept bf16 casts of A and B are refreshed

The references keep the rounding the kernels reproduce: the norm and RoPE compute in fp32 and cast
back to the activation dtype once; the residual sum is rounded to the activation dtype as torch's
add rounds it. So a fused decode step and a torch one give the same logits to the last bit where
the kernels promise it (tests/test_model.py and the kernel tests check).

Test: tests/test_ops.py (each reference against an independent formula); the fast paths are
checked against these references by tests/test_kernels_*.py.
"""
import contextlib
import contextvars

import torch
import torch.nn.functional as F

import kernels


# ----------------------------------------------------------------------------------------------
# the decoder's small ops

def rms_norm(x, weight, eps, residual=None):
    """x (..., C), weight (C,) fp32 -> norm(x) in x.dtype; with residual: (norm(x + residual), x + residual).
    The fast kernel may read residual before the kernel launched just before it has finished, so
    residual must be the stream, never the output of the op just before (a decoder layer's is)."""
    if kernels.runs(x):
        return kernels.rms_norm(x, weight, eps, residual)
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
    back to back (kernels.prepare builds the stacks after loading), then the adapters' updates."""
    if kernels.runs(x):
        return kernels.project(parent, names, x)
    return [getattr(parent, n)(x) for n in names]


def gated_mlp_input(parent, x):
    """silu(gate_proj(x)) ⊙ up_proj(x), the input of down_proj. Fast path: the stacked gate/up matmul,
    at one decode row with SiLU·mul in the matmul's own epilogue."""
    if kernels.runs(x):
        return kernels.project(parent, ("gate_proj", "up_proj"), x, silu_mul=True)
    gate, up = parent.gate_proj(x), parent.up_proj(x)     # both before the SiLU: the backward sums dx
    return kernels.compiled(_silu_mul, x)(gate, up)        # in this graph's order, the same bits each run


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
    if kernels.runs(x):
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


def dense_weight(layer, dtype=torch.bfloat16):
    """An nvfp4.NVFP4Linear's weight dequantized, (N, K) in dtype: one Triton pass on the GPU for bf16
    (the very numbers the kernels' large-M route multiplies by), nvfp4.dequantize elsewhere."""
    if dtype == torch.bfloat16 and kernels.gemm_runs(layer.weight_packed) and layer.in_features % 64 == 0:
        return kernels.dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale, layer.interleaved)
    return layer.dequantized_weight(dtype)
