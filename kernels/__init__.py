"""The kernel wing: every Triton kernel of qerl behind one seam, and "can this run here?".

The trunk reaches this package through one face, ops.py, whose every entry is a torch reference
or the call below where it can run; the trunk knows nothing of routes or launch shapes, and this
package knows nothing of RL and imports nothing of the trunk: it works on tensors, and on the
trunk's objects only by their attributes (duck typing). What is here:

    available                 Triton imports and the kernels are defined (False: every predicate
                              below is False, and `import kernels` still works)
    runs(x)                   the rollout fast path for x: available, CUDA, no autograd, tuning's fused
    describe(device)          the start-up line: which fast paths run here, and what an off one costs
    interpreting()            Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)

    FP4 x BF16 GEMM (gemm.py; ops.nvfp4_linear hands off here where gemm_runs(x))
        gemm_runs(x), nvfp4_matmul(x, packed, scale, global_scale, bias=None, interleaved=False),
        nvfp4_matmul_dx(dy, packed, scale, global_scale, interleaved=False), dequantize(...)
    the decoder's small ops (fused_ops.py)
        rms_norm (with the shrink of the group it feeds: lora.py), rope_fits, rope, embed_rope, silu_mul,
        lm_head_fits, lm_head
    q/k/v and gate/up as one matmul (stacked.py): project(stack, mods, x, silu_mul, refresh)
    LoRA (lora.py): lora_linear(x, base, A, B, scale)
    the training pass's small ops, forward and backward (compiled.py): compiled(fn, x)
    paged decode attention (paged_decode.py): store_kv, paged_attention, attention_counts
    sampling (sampler.py): sampler_runs(filtered, shape, device), sample, fill_tokens
    tuning (tuning.py): Tuning, current(), using(t)

Which kernel runs at which M, the current speed table and how to A/B a change: kernels/README.md.
Tests: tests/test_kernels_*.py.
"""
import torch

from . import tuning
from . import launch
from .compiled import compiled
from .launch import interpreting
from .tuning import Tuning, current, using

try:
    import triton  # noqa: F401

    from . import fused_ops, gemm, lora, paged_decode, sampler, stacked
    available = True
except ImportError:          # the trunk's torch paths need no triton
    available = False


def describe(device) -> tuple[str, list[str]]:
    """What runs on this device: (one start-up line, warnings for each fast path a version or the
    device turns off, with what it costs). The numbers behind the costs are kernels/README.md's."""
    device = torch.device(device)
    if not available:
        return "kernels: none (Triton is not installed): every op runs as its torch reference", [
            "Triton missing: NVFP4 matmuls dequantize the weight every call and the sampler runs ~10 torch "
            "ops a layer where one kernel would; install triton (pip install -r requirements.txt)"]
    if device.type != "cuda":
        return "kernels: the CPU runs the torch references (Triton kernels need a CUDA device)", []
    import triton
    cap = launch.capability(device.index or 0)
    on = ["FP4 GEMV and fragment kernels", "fused norms / RoPE / attention / LoRA / sampling"]
    warnings = []
    if cap >= (9, 0):
        on.append("programmatic dependent launch")
    else:
        warnings.append(f"sm_{cap[0]}{cap[1]}: no programmatic dependent launch (Hopper and later); each of a "
                        f"decode step's ~500 launches waits for the one before it")
    if gemm.gluon_runs(device, True):
        on.append(f"the register-A wgmma kernel and the TMA-fed GEMV (sm_90, triton {triton.__version__})")
    else:
        why = (f"triton {triton.__version__} (its Gluon is written for {gemm.GLUON_TRITON}x: pip install -c "
               f"constraints-gpu.txt)" if cap == (9, 0) else f"sm_{cap[0]}{cap[1]} (it needs sm_90)")
        warnings.append(f"register-A wgmma kernel off on {why}: NVFP4 matmuls at 2-1024 rows run on the tile "
                        f"kernels or dequantize + cuBLAS, 1.2-2x slower there (the GRPO rollout's batch); at one "
                        f"row gate/up runs on the register GEMV, 2-6% slower a batch-1 decode step")
    return f"kernels: {', '.join(on)} on {torch.cuda.get_device_name(device)}", warnings


def runs(x: torch.Tensor) -> bool:
    """Does the rollout fast path take x: the kernels exist, x is on CUDA, no autograd, and tuning
    says fused (bench/rollout.py's -unfused engines turn it off)?"""
    return available and x.is_cuda and not torch.is_grad_enabled() and current().fused


def gemm_runs(x: torch.Tensor) -> bool:
    """Does nvfp4_matmul take x (every CUDA tensor; CPU tensors under the interpreter)?"""
    return available and (x.is_cuda or interpreting())


# ----------------------------------------------------------------------------------------------
# the FP4 x BF16 GEMM

def nvfp4_matmul(x, packed, scale, global_scale, bias=None, interleaved=False):
    """y (M, N) bf16 = x (M, K) bf16 · dequant(W)ᵀ (+ bias (N,) bf16) on the kernel gemm.route picks."""
    return gemm.nvfp4_matmul(x, packed, scale, global_scale, bias, interleaved)


def dequantize(packed, scale, global_scale, interleaved=False):
    """W (N, K) bf16 in one pass (K a multiple of 64): what the large-M route hands to cuBLAS."""
    return gemm.dequantize_bf16(packed, scale, global_scale, interleaved)


def nvfp4_matmul_dx(dy, packed, scale, global_scale, interleaved=False):
    """dx (M, K) bf16 = dy (M, N) bf16 · dequant(W): the backward of y = x·Wᵀ for x."""
    return gemm.nvfp4_matmul_dx(dy, packed, scale, global_scale, interleaved)


# ----------------------------------------------------------------------------------------------
# the decoder's small ops

def rms_norm(x, weight, eps, residual=None, group=None):
    """RMSNorm in one kernel: y, or with residual (y, x + residual) (fused_ops.rms_norm). group =
    (stack, mods, refresh), the stacked group that reads y (as project takes it): at decode rows its
    LoRA shrink runs in the norm's launch (lora.norm_shrink), one launch a group fewer."""
    out = lora.norm_shrink(x, weight, eps, residual, *group) if group is not None else None
    return fused_ops.rms_norm(x, weight, eps, residual) if out is None else out


def rope_fits(q, k) -> bool:
    """Can rope rotate q and k in place (one token stride each, D a power of two)?"""
    return available and fused_ops.rope_fits(q, k)


def rope(q, k, cos, sin):
    """apply_rope on q (B, T, Hq, D) and k (B, T, Hkv, D) in place, one launch."""
    return fused_ops.rope(q, k, cos, sin)


def embed_rope(ids, positions, weight, inv_freq):
    """x = weight[ids] and the RoPE cos, sin of positions·inv_freq, one launch."""
    return fused_ops.embed_rope(ids, positions, weight, inv_freq)


def silu_mul(g, u):
    """silu(g)·u, g and u rows possibly strided."""
    return fused_ops.silu_mul(g, u)


def lm_head_fits(hidden, head) -> bool:
    """Can lm_head compute head(hidden): a bias-free nn.Linear, at most tuning's lm_head_max_rows rows?"""
    return available and fused_ops.lm_head_fits(hidden, head)


def lm_head(hidden, head):
    """head(hidden) by the few-row GEMV."""
    return fused_ops.lm_head(hidden, head)


# ----------------------------------------------------------------------------------------------
# q/k/v and gate/up, LoRA

def project(stack, mods, x, silu_mul=False, refresh=True):
    """[m(x) for m in mods] through the group's stacked matmul and LoRA update (or silu(gate)·up with
    silu_mul), or None where one update cannot serve the group; see stacked.project."""
    return stacked.project(stack, mods, x, silu_mul, refresh)


def lora_linear(x, base, A, B, scale):
    """base(x) + scale · (x Aᵀ) Bᵀ with A, B in x.dtype; see lora.lora_linear."""
    return lora.lora_linear(x, base, A, B, scale)


# ----------------------------------------------------------------------------------------------
# attention, sampling

def cache_table(layers, device):
    """(layers, 2) int64: where each layer's K and V caches lie, the kernels' way to them
    (paged_decode.cache_table)."""
    return paged_decode.cache_table(layers, device)


def place_caches(table, k_caches, v_caches):
    """Point the cache table at the caches (L, num_blocks, bs, Hkv, D) (paged_decode.place_caches)."""
    return paged_decode.place_caches(table, k_caches, v_caches)


def store_kv(k_cache, v_cache, k, v, slots, place):
    """k, v (N, Hkv, D) into their cache slots (-1: skip), the caches where place (a table row) says."""
    return paged_decode.store_kv(k_cache, v_cache, k, v, slots, place)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale, *, place, max_model_len, counts,
                    partition_size=None, rope=None):
    """Decode attention over the paged cache, split into partitions (paged_decode.paged_attention)."""
    return paged_decode.paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale, place=place,
                                        max_model_len=max_model_len, counts=counts,
                                        partition_size=partition_size, rope=rope)


def attention_counts(rows, num_kv_heads, device):
    """int32 zeros (rows, Hkv): the attention kernel's merge counters."""
    return paged_decode.attention_counts(rows, num_kv_heads, device)


def sampler_runs(filtered: bool, shape, device) -> bool:
    """Can sample() draw from (B, V) logits on device (CUDA, no top-k / top-p)?"""
    return available and sampler.fits(filtered, shape, device)


def sample(logits, temperature, generator=None, chunk=None, keys=None, out=None):
    """tokens (B,) int64, logprobs (B,) fp32 drawn by the two sampling kernels, row b with Philox key
    keys[b] (sampler.sample)."""
    return sampler.sample(logits, temperature, generator, chunk=chunk, keys=keys, out=out)


def fill_tokens(meta, prev_tokens):
    """meta[0] = prev_tokens[meta[4]] where meta[4] >= 0, one launch (sampler.fill_tokens)."""
    return sampler.fill_tokens(meta, prev_tokens)
