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
        best_c, i_c = max, argmax of z + g, g from Philox (tl.rand) keyed by a per-step seed
    _sample_pick_kernel, program b, over the chunks of row b:
        lse = M + log sum_c s_c e^(m_c - M)   (M = max_c m_c)
        token = i_c of the chunk with the largest best_c;  logprob = z[token] - lse

Greedy (T = 0) is the same pair with g = 0 and no temperature. Ties go to the lowest index, as in
torch.argmax. The per-step seed is drawn on the device from the generator (no host sync), or read
from a device tensor that the pick kernel then advances by one (`seed=`: the engine uses that so
that a CUDA graph can capture sampling, each replay drawing with the next key); the Philox counter
of logit (b, v) is b·V + v, so every logit of a step gets its own uniform. Logits a program
(default_chunk): drawing a Philox uniform per logit makes a drawing program longer, so it takes
fewer logits than a greedy one, and fewer still at small batches, where the programs are few.

fill_tokens: a decode step captured in a CUDA graph reads its input tokens from a device buffer;
those of the step still in flight (never on the host) are copied in by one small kernel,
meta[0, i] = prev[meta[4, i]] where meta[4, i] >= 0 (rollout.Runner's meta layout).

Left out: top-k / top-p (the torch path), min-p, penalties.
Tests: tests/test_kernels_sampler.py (the kernels under TRITON_INTERPRET=1: greedy across chunks with
ties, logprobs against float64, frequencies, the seed tensor's key and advance, fill_tokens against
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
    """Can sample() draw from logits of this (B, V) shape on this device: CUDA, no top-k / top-p,
    B·V < 2^31 (the Philox counters are int32)?"""
    B, V = shape
    return torch.device(device).type == "cuda" and not filtered and B * V < 2 ** 31


# ----------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _sample_chunk_kernel(
    logits_ptr, stride_b, V, inv_t,          # logits (B, V), rows stride_b apart; 1 / temperature
    seed_ptr,                                # (1,) int64: this step's Philox key
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
        u = tl.rand(tl.load(seed_ptr), b * V + offs)                          # [0, 1), Philox
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
    seed_ptr, C_PAD: tl.constexpr, ADVANCE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """token[b] = idx of the chunk with the best score; logp[b] = z[token] - log-sum-exp of z.
    ADVANCE: program 0 adds one to the seed. After pdl_start's wait, so the whole chunk kernel has
    read it: the store must stay below the wait."""
    pdl_start(USE_PDL)
    b = tl.program_id(0)
    if ADVANCE:
        if b == 0:
            tl.store(seed_ptr, tl.load(seed_ptr) + 1)
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


@triton.jit
def _fill_tokens_kernel(meta_ptr, prev_ptr, stride_meta, B, BLOCK: tl.constexpr):
    """meta[0, i] = prev[meta[4, i]] for the rows i < B with meta[4, i] >= 0 (fill_tokens)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    src = tl.load(meta_ptr + 4 * stride_meta + i, mask=i < B, other=-1)
    token = tl.load(prev_ptr + tl.maximum(src, 0), mask=src >= 0, other=0)
    tl.store(meta_ptr + i, token.to(tl.int32), mask=src >= 0)


# ----------------------------------------------------------------------------------------------
# wrappers


def sample(logits, temperature, generator=None, chunk=None, seed=None, out=None):
    """sampling.sample without top-k / top-p, in two kernels: logits (B, V) with B·V < 2^31 -> tokens (B,)
    long, logprobs (B,) fp32. temperature 0 is greedy (logprobs of the plain log-softmax).
    chunk: logits per program of the chunk kernel (default: default_chunk). seed: None draws this call's
    Philox key from `generator`; a (1,) int64 tensor on the device is the key, advanced by one in
    place (a CUDA graph can capture the call). out: (tokens (B,) int64, logprobs (B,) fp32) to
    write into, e.g. views of one buffer that a single copy takes to the host."""
    B, V = logits.shape
    if B * V >= 2 ** 31:
        raise ValueError(f"sample: {B} x {V} logits; the Philox counters b·V + v are int32")
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
    advance = seed is not None
    if seed is None:
        seed = torch.randint(2 ** 62, (1,), device=dev, generator=generator)  # a 64-bit Philox key
    elif not (seed.shape == (1,) and seed.dtype == torch.int64 and seed.device == dev):
        raise ValueError(f"sample: seed must be a (1,) int64 tensor on {dev}, got "
                         f"{tuple(seed.shape)} {seed.dtype} on {seed.device}")
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    _sample_chunk_kernel[(B, num_chunks)](logits, logits.stride(0), V, inv_t, seed, stat, idx, num_chunks,
                                          CHUNK=chunk, GREEDY=temperature == 0, **launch.pdl_launch(dev))
    _sample_pick_kernel[(B,)](logits, logits.stride(0), inv_t, stat, idx, num_chunks, tokens, logprobs, V,
                              seed, C_PAD=triton.next_power_of_2(num_chunks), ADVANCE=advance, **launch.pdl_launch(dev))
    return tokens, logprobs


def fill_tokens(meta, prev_tokens):
    """meta[0] = prev_tokens[meta[4]] where meta[4] >= 0, in one launch: meta (5, B) int32 with rows
    stride(0) apart, prev_tokens (n,) int64 on the same device."""
    B = meta.shape[1]
    _fill_tokens_kernel[(triton.cdiv(B, 512),)](meta, prev_tokens, meta.stride(0), B, BLOCK=512)
