"""Sampling the next token from the logits: the last stage of each step of the sampler (rollout.py).

Math. logits / T, then top-k, then top-p, renormalised: `logp`. The token is argmax(logp - log E)
with E ~ Exp(1) (the exponential race: P(argmax = i) = p_i), with no host sync inside the sampler,
so the engine can queue the next step before this one's tokens reach the host; temperature 0 takes
the explicit greedy branch. The recorded logprob of each token is `logp[token]`, i.e. under the
sampling distribution after temperature/top-k/top-p (under greedy: the plain log-softmax of the
logits). train.py hands these to the loss as the sampler's logprobs (truncated importance sampling).

Shapes: logits (B, V) (bf16 or fp32), one row per sequence of the step -> tokens (B,) long,
logprobs (B,) fp32, both left on the logits' device. A seeded torch.Generator makes a draw
reproducible.

The GPU path without top-k / top-p (GRPO samples at temperature 1 from the full distribution) is
two Triton kernels instead of ~10 torch ones (a one-block softmax over 152k logits alone took 34 µs
per row on the H100). The exponential race is the Gumbel-max trick in disguise: with U uniform,
E = -log U ~ Exp(1), and argmax(logp - log E) = argmax(z + g) with z = logits / T and
g = -log(-log U) a standard Gumbel draw (logp and z differ by the constant log-sum-exp). So:

    _sample_chunk_kernel, program (b, c), CHUNK logits of row b:
        z = logits[b, chunk] / T;  m_c = max z;  s_c = sum e^(z - m_c)
        best_c, i_c = max, argmax of z + g, g from Philox (tl.rand) keyed by a per-step seed
    _sample_pick_kernel, program b, over the chunks of row b:
        lse = M + log sum_c s_c e^(m_c - M)   (M = max_c m_c)
        token = i_c of the chunk with the largest best_c;  logprob = z[token] - lse

Greedy (T = 0) is the same pair with g = 0 and no temperature. Ties go to the lowest index, as in
torch.argmax. The per-step seed is drawn on the device from the generator (no host sync), or read
from a device tensor that the pick kernel then advances by one (`seed=`: the sampler's engine uses
that so that a CUDA graph can capture sampling, each replay drawing with the next key); the Philox
counter of logit (b, v) is b·V + v, so every logit of a step gets its own uniform.

Top-p keeps the smallest prefix of the sorted distribution whose mass reaches top_p: a token is
dropped when the mass strictly before it already reaches top_p, so the most likely token always
stays. Ties at the top-k boundary are all kept (a `logits < kth` mask).

Left out: min-p, repetition / frequency penalties, per-sequence parameters within one batch.
Tests: tests/test_sampling.py (greedy and its logprobs, top-k 1 and a tiny top-p collapse to
greedy, empirical frequencies of 200,000 draws against the filtered softmax; the kernels under
TRITON_INTERPRET=1: greedy across chunks with ties, logprobs against float64, frequencies, the seed
tensor's key and advance; GPU-marked: frequencies of 200,000 draws at a 152k vocabulary); the engine
tests in tests/test_rollout.py check the recorded logprobs against a dense forward and the seeded
draws inside the decode graph.
"""
import torch

try:
    import triton
    import triton.language as tl
    from marlin_kernel import pdl_launch, pdl_start
except ImportError:  # the torch path needs no triton
    triton = None

CHUNK = 4096    # logits per program of the chunk kernel when greedy: 38 programs per row of 152k logits


def default_chunk(rows, temperature):
    """Logits per program: drawing a Philox uniform per logit makes the programs of a temperature > 0
    draw longer, so they take fewer logits. H100, Qwen2.5's 152k vocabulary, the two kernels in a
    CUDA graph (bench/NOTES.md v24): 1 row 5.5 us at 1024 against 11.1 at 4096, 16 rows 18.4 against
    21.8, 128 rows 109 at 2048 against 114 at 1024 and 136 at 4096; greedy within 0.3 us up to 8 rows
    and best at 4096 beyond."""
    if temperature == 0:
        return CHUNK
    return 1024 if rows <= 16 else 2048


# ----------------------------------------------------------------------------------------------
# Sampling: exponential race, no host sync; explicit greedy branch

def uses_kernels(params, shape, device):
    """Whether sample() takes the Triton path for logits of this (B, V) shape and device."""
    B, V = shape
    filtered = 0 < params.top_k < V or params.top_p < 1
    return torch.device(device).type == "cuda" and triton is not None and not filtered and B * V < 2 ** 31


def sample(logits, params, generator=None, seed=None, out=None):
    """logits (B, V) -> tokens (B,) long, logprobs (B,) fp32 under the sampling distribution.
    params: a rollout.SamplingParams (only temperature, top_k and top_p are read here).
    seed, out: as in sample_triton (the torch path draws from `generator` and ignores seed)."""
    if uses_kernels(params, logits.shape, logits.device):
        return sample_triton(logits, params.temperature, generator, seed=seed, out=out)
    tokens, logprobs = _sample_torch(logits, params, generator)
    if out is None:
        return tokens, logprobs
    out[0].copy_(tokens)
    out[1].copy_(logprobs)
    return out


def _sample_torch(logits, params, generator):
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]             # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # drop a token when the mass strictly before it already reaches top_p (the first stays)
        drop = (torch.cumsum(probs, -1) - probs) >= params.top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    logp = torch.log_softmax(logits, -1)                                            # (B, V)
    e = torch.empty_like(logp).exponential_(generator=generator).clamp_min_(1e-30)  # no log(0)
    tokens = (logp - e.log()).argmax(-1)     # argmax p_i / E_i, E_i ~ Exp(1): a draw from p
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


# ----------------------------------------------------------------------------------------------
# The GPU path: Gumbel-max over chunks of the vocabulary, then one pick per row

if triton is not None:
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


def sample_triton(logits, temperature, generator=None, chunk=None, seed=None, out=None):
    """sample() without top-k / top-p, in two kernels: logits (B, V) with B·V < 2^31 -> tokens (B,)
    long, logprobs (B,) fp32. temperature 0 is greedy (logprobs of the plain log-softmax).
    chunk: logits per program of the chunk kernel (default: default_chunk). seed: None draws this call's
    Philox key from `generator`; a (1,) int64 tensor on the device is the key, advanced by one in
    place (a CUDA graph can capture the call). out: (tokens (B,) int64, logprobs (B,) fp32) to
    write into, e.g. views of one buffer that a single copy takes to the host."""
    B, V = logits.shape
    if B * V >= 2 ** 31:
        raise ValueError(f"sample_triton: {B} x {V} logits; the Philox counters b·V + v are int32")
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
        raise ValueError(f"sample_triton: out must be ({B},) int64 and ({B},) fp32 tensors on {dev}, stride 1")
    advance = seed is not None
    if seed is None:
        seed = torch.randint(2 ** 62, (1,), device=dev, generator=generator)  # a 64-bit Philox key
    elif not (seed.shape == (1,) and seed.dtype == torch.int64 and seed.device == dev):
        raise ValueError(f"sample_triton: seed must be a (1,) int64 tensor on {dev}, got "
                         f"{tuple(seed.shape)} {seed.dtype} on {seed.device}")
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    _sample_chunk_kernel[(B, num_chunks)](logits, logits.stride(0), V, inv_t, seed, stat, idx, num_chunks,
                                          CHUNK=chunk, GREEDY=temperature == 0, **pdl_launch(dev))
    _sample_pick_kernel[(B,)](logits, logits.stride(0), inv_t, stat, idx, num_chunks, tokens, logprobs, V,
                              seed, C_PAD=triton.next_power_of_2(num_chunks), ADVANCE=advance, **pdl_launch(dev))
    return tokens, logprobs
