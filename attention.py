"""Attention for the sampler: the paged KV-cache layout and the torch references.

The training forward attends densely (model.py: causal SDPA over each row's T tokens). The sampler
(rollout.py) keeps every sequence's keys and values in a paged cache instead, so that sequences of
any length share one pool of memory and the G samples of a prompt share its prompt's blocks. These
are the three operations on that cache, in plain torch; rollout.py's attention contexts call them
on the CPU, and their Triton versions (kernels/paged_decode.py, one launch that also applies
RoPE) on the GPU. They are the oracle of those kernels' tests.

KV cache layout. One tensor per K and V of shape (L, num_blocks, block_size, Hkv, D); the functions
here take one layer's (num_blocks, block_size, Hkv, D). A token at position t of a sequence lives in

    slot = block_table[t // block_size] · block_size + t % block_size

(block tables come from scheduler.py's BlockManager). Slot -1 means "write nothing": the padding
rows of a CUDA graph, captured for a fixed batch size and replayed for fewer sequences.

    store:   k, v (N, Hkv, D) into their slots.
    prefill: all new prompts packed into one row (1, Σ T_i); attention is causal within each prompt,
             on the fresh k, v, so a prefill never reads the cache (packed_causal_attention: one
             varlen flash-attention launch on CUDA, SDPA per prompt elsewhere).
    decode:  one token per sequence, q (B, Hq, D); each query attends to the first context_lens[b]
             positions of its own sequence through its block table, in fp32. Query head j reads kv
             head j // (Hq / Hkv) (grouped-query attention).

A row with context length 0 (graph padding) attends to nothing and gives zeros, with no host sync:
a CUDA graph can hold these ops.

Left out: attention from the cache during prefill (prefix caching, chunked prefill), sliding windows,
ALiBi, an FP8 cache. Test: tests/test_attention.py (against a dense causal attention in float64).
"""
import inspect

import torch
import torch.nn.functional as F

try:                                             # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None
# the causal window arrived after torch 2.10's first form of the function; flash attention shares KV
# heads itself, and later torch versions ask for enable_gqa to allow it
_KEYWORDS = set(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else set()
VARLEN = "window_size" in _KEYWORDS


def store_kv_ref(k_cache, v_cache, k, v, slots):
    """k_cache, v_cache (num_blocks, bs, Hkv, D); k, v (N, Hkv, D); slots (N,) int, -1 = skip."""
    keep = slots >= 0
    k_cache.view(-1, *k_cache.shape[2:])[slots[keep]] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots[keep]] = v[keep].to(v_cache.dtype)


def paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale):
    """q (B, Hq, D); block_tables (B, nb) int; context_lens (B,) int -> (B, Hq, D) in q's dtype."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    k = k_cache[block_tables.long()].flatten(1, 2).float()                  # (B, nb*bs, Hkv, D)
    v = v_cache[block_tables.long()].flatten(1, 2).float()
    k, v = k.repeat_interleave(Hq // Hkv, dim=2), v.repeat_interleave(Hq // Hkv, dim=2)  # (B, nb*bs, Hq, D)
    s = torch.einsum("bhd,bnhd->bhn", q.float(), k) * scale                 # (B, Hq, nb*bs)
    pos = torch.arange(k.shape[1], device=q.device)
    s = s.masked_fill(pos >= context_lens[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)                            # an empty row: 0
    return torch.einsum("bhn,bnhd->bhd", p, v).to(q.dtype)


def causal_attention(q, k, v):
    """One prompt's prefill: q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D), causal, GQA. SDPA gets
    (1, heads, T, D) and shares the KV heads itself (3-D inputs with repeated heads send it to its
    slow math path)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def varlen_runs(device, dtype, head_dim: int) -> bool:
    """Does flash attention take such inputs: torch's causal varlen_attn exists, bf16/fp16 on an
    sm_80+ GPU, head size <= 256 (flash attention's limits)? Asked once per runner (rollout.Runner.varlen)."""
    device = torch.device(device)
    return (VARLEN and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and head_dim <= 256
            and torch.cuda.get_device_capability(device) >= (8, 0))


def packed_causal_attention(q, k, v, cu_seqlens, cu=None, longest=None):
    """Prompts packed in one row: q (N, Hq, D), k/v (N, Hkv, D), prompt i at rows cu_seqlens[i] to
    cu_seqlens[i+1] (a host list) -> (N, Hq, D), causal within each prompt. With cu, the same
    offsets as an int32 CUDA tensor where varlen_runs holds, and longest, the longest prompt: one
    varlen flash-attention launch (torch.nn.attention.varlen), where SDPA per prompt costs a launch
    per prompt and layer (a GRPO prefill of 16 prompts on a 7B model: 448 launches, host time the
    GPU waits for). Else SDPA per prompt."""
    if cu is not None:
        gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] and "enable_gqa" in _KEYWORDS else {}
        return varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0), **gqa)
    out = torch.empty_like(q)
    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        out[s:e] = causal_attention(q[s:e], k[s:e], v[s:e])
    return out
