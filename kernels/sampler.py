"""Sampling the next token on the GPU without top-k / top-p: two Triton kernels, and the kernel
that fills in the tokens of the step in flight.

sampling.py (the trunk) owns the math and the torch path: logits / T, then top-k, then top-p,
renormalised; the token is a draw by the exponential race, its logprob recorded under the sampling
distribution; temperature 0 is greedy. Without top-k / top-p (GRPO samples at temperature 1 from
the full distribution) these two kernels replace ~10 torch ones (a one-block softmax over 152k
logits alone is slow). The exponential race is the Gumbel-max trick in disguise: with U uniform,
E = -log U ~ Exp(1), and argmax(logp - log E) = argmax(z + g) with z = logits / T and
g = -log(-log U) a standard Gumbel draw (logp and z differ by the constant log-sum-exp). So:

    _sample_chunk_kernel, program (b, c), chunk logits of row b:
        z = logits[b, chunk] / T;  m_c = max z;  s_c = sum e^(z - m_c)
        best_c, i_c = max, argmax of z + g, g from Philox (tl.rand) keyed by row b's key, counter v
    _sample_pick_kernel, program b, over the chunks of row b:
        lse = M + log sum_c s_c e^(m_c - M)   (M = max_c m_c)
        token = i_c of the chunk with the largest best_c;  logprob = z[token] - lse

Greedy (T = 0) is the same pair with g = 0 and no temperature. Ties go to the lowest index, as in
torch.argmax. Each row draws with its own 64-bit Philox key, read from a (B,) device tensor, and
logit v's counter is v: the engine (rollout.py) derives a row's key from the call's seed, the
sequence and the position being sampled, so a sequence's draws do not depend on which rows it
shares a step with (preemption, another cache size, another batch). Without keys, this call's
keys are one draw from the generator plus the row index (no host sync). Logits a program
(default_chunk): drawing a Philox uniform per logit makes a drawing program longer, so it takes
fewer logits than a greedy one, and fewer still at small batches, where the programs are few.

fill_tokens: a decode step captured in a CUDA graph reads its input tokens from a device buffer;
those of the step still in flight (never on the host) are copied in by one small kernel,
meta[0, i] = prev[meta[4, i]] where meta[4, i] >= 0 (rollout.Runner's meta layout); B, the rows, is not
specialized, so every batch bucket runs one binary.

Left out: top-k / top-p (the torch path), min-p, penalties.
Tests: tests/test_kernels_sampler.py (the kernels under TRITON_INTERPRET=1: greedy across chunks with
ties, logprobs against float64, frequencies, a row's draws set by its key alone, fill_tokens against
the torch ops; GPU-marked: frequencies of 200,000 draws at a 152k vocabulary).
"""
import torch
import triton
import triton.language as tl

from . import launch, tuning
from .fp4_decode import pdl_start


def default_chunk(rows: int, temperature: float) -> int:
    """Logits a program of the chunk kernel (tuning's sample_chunk*, see the module docstring)."""
    t = tuning.current()
    if temperature == 0:
        return t.sample_chunk
    return t.sample_chunk_small if rows <= t.sample_small_rows else t.sample_chunk_large


def fits(filtered: bool, shape, device) -> bool:
    """Can sample() draw from logits of this (B, V) shape on this device: CUDA, no top-k / top-p?"""
    return torch.device(device).type == "cuda" and not filtered


# ----------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _sample_chunk_kernel(
    logits_ptr, stride_b, V, inv_t,          # logits (B, V), rows stride_b apart; 1 / temperature
    key_ptr,                                 # (B,) int64: each row's Philox key
    stat_ptr, idx_ptr, NUM_CHUNKS,           # out: (B, NUM_CHUNKS, 3) fp32, (B, NUM_CHUNKS) int32
    CHUNK: tl.constexpr, GREEDY: tl.constexpr, USE_PDL: tl.constexpr,
):
    """stat[b, c] = (max z, sum e^(z - max z), max z + g), idx[b, c] = argmax of z + g."""
    pdl_start(USE_PDL)
    b, c = tl.program_id(0), tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)                                   # (CHUNK,)
    mask = offs < V
    z = tl.load(logits_ptr + b.to(tl.int64) * stride_b + offs, mask=mask, other=float("-inf"))
    z = z.to(tl.float32) * inv_t
    m = tl.max(z, 0)
    s = tl.sum(tl.exp(z - tl.where(m > float("-inf"), m, 0.0)), 0)         # an all -inf chunk: 0
    if GREEDY:
        score = z
    else:
        u = tl.rand(tl.load(key_ptr + b), offs)                               # [0, 1), Philox
        score = tl.where(mask, z - tl.log(-tl.log(u)), float("-inf"))        # z + Gumbel
    best, i = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
    row = b * NUM_CHUNKS + c
    tl.store(stat_ptr + row * 3, m)
    tl.store(stat_ptr + row * 3 + 1, s)
    tl.store(stat_ptr + row * 3 + 2, best)
    tl.store(idx_ptr + row, c * CHUNK + i)


@triton.jit
def _sample_pick_kernel(
    logits_ptr, stride_b, inv_t,             # as above
    stat_ptr, idx_ptr, NUM_CHUNKS,           # the chunk kernel's output
    token_ptr, logp_ptr, V,                  # out: (B,) int64, (B,) fp32
    C_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    """token[b] = idx of the chunk with the best score; logp[b] = z[token] - log-sum-exp of z."""
    pdl_start(USE_PDL)
    b = tl.program_id(0)
    offs = tl.arange(0, C_PAD)
    mask = offs < NUM_CHUNKS
    row = b * NUM_CHUNKS + offs                                              # (C_PAD,)
    m = tl.load(stat_ptr + row * 3, mask=mask, other=float("-inf"))
    s = tl.load(stat_ptr + row * 3 + 1, mask=mask, other=0.0)
    best = tl.load(stat_ptr + row * 3 + 2, mask=mask, other=float("-inf"))
    mx = tl.max(m, 0)
    lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), 0))
    _, c = tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)
    token = tl.sum(tl.where(offs == c, tl.load(idx_ptr + row, mask=mask, other=0), 0), 0)
    token = tl.minimum(token, V - 1)     # in range even for a row of NaNs (a graph's padding row)
    z = tl.load(logits_ptr + b.to(tl.int64) * stride_b + token).to(tl.float32) * inv_t
    tl.store(token_ptr + b, token.to(tl.int64))
    tl.store(logp_ptr + b, z - lse)


@triton.jit(do_not_specialize=["B"])
def _fill_tokens_kernel(meta_ptr, prev_ptr, stride_meta, B, BLOCK: tl.constexpr):
    """meta[0, i] = prev[meta[4, i]] for the rows i < B with meta[4, i] >= 0 (fill_tokens)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    src = tl.load(meta_ptr + 4 * stride_meta + i, mask=i < B, other=-1)
    token = tl.load(prev_ptr + tl.maximum(src, 0), mask=src >= 0, other=0)
    tl.store(meta_ptr + i, token.to(tl.int32), mask=src >= 0)


# ----------------------------------------------------------------------------------------------
# wrappers


def sample(logits, temperature, generator=None, chunk=None, keys=None, out=None):
    """sampling.sample without top-k / top-p, in two kernels: logits (B, V) -> tokens (B,) long,
    logprobs (B,) fp32. temperature 0 is greedy (logprobs of the plain log-softmax).
    chunk: logits per program of the chunk kernel (default: default_chunk). keys: (B,) int64 on the
    device, row b's Philox key (a CUDA graph can capture the call); None: one key drawn from
    `generator`, plus the row index. out: (tokens (B,) int64, logprobs (B,) fp32) to write into, e.g.
    views of one buffer that a single copy takes to the host."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    chunk = chunk or default_chunk(B, temperature)
    num_chunks = triton.cdiv(V, chunk)
    stat = torch.empty(B, num_chunks, 3, device=dev, dtype=torch.float32)
    idx = torch.empty(B, num_chunks, device=dev, dtype=torch.int32)
    if out is None:
        out = torch.empty(B, device=dev, dtype=torch.int64), torch.empty(B, device=dev, dtype=torch.float32)
    tokens, logprobs = out
    if not (tokens.shape == logprobs.shape == (B,) and tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
            and tokens.device == logprobs.device == dev and tokens.stride(0) == logprobs.stride(0) == 1):
        raise ValueError(f"sample: out must be ({B},) int64 and ({B},) fp32 tensors on {dev}, stride 1")
    if keys is None:
        keys = torch.randint(2 ** 62, (1,), device=dev, generator=generator) + torch.arange(B, device=dev)
    elif not (keys.shape == (B,) and keys.dtype == torch.int64 and keys.device == dev):
        raise ValueError(f"sample: keys must be a ({B},) int64 tensor on {dev}, got "
                         f"{tuple(keys.shape)} {keys.dtype} on {keys.device}")
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    _sample_chunk_kernel[(B, num_chunks)](logits, logits.stride(0), V, inv_t, keys, stat, idx, num_chunks,
                                          CHUNK=chunk, GREEDY=temperature == 0, **launch.pdl_launch(dev))
    _sample_pick_kernel[(B,)](logits, logits.stride(0), inv_t, stat, idx, num_chunks, tokens, logprobs, V,
                              C_PAD=triton.next_power_of_2(num_chunks), **launch.pdl_launch(dev))
    return tokens, logprobs


def fill_tokens(meta, prev_tokens):
    """meta[0] = prev_tokens[meta[4]] where meta[4] >= 0, in one launch: meta (>= 5, B) int32 with rows
    stride(0) apart, prev_tokens (n,) int64 on the same device."""
    B = meta.shape[1]
    _fill_tokens_kernel[(triton.cdiv(B, 512),)](meta, prev_tokens, meta.stride(0), B, BLOCK=512)
