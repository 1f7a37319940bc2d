"""Sampling the next token from the logits: the last stage of each step of the sampler (rollout.py).

Math. logits / T, then top-k, then top-p, renormalised: `logp`. The token is argmax(logp - log E)
with E ~ Exp(1) (the exponential race: P(argmax = i) = p_i), with no host sync inside the sampler,
so the engine can queue the next step before this one's tokens reach the host; temperature 0 takes
the explicit greedy branch. The recorded logprob of each token is `logp[token]`, i.e. under the
sampling distribution after temperature/top-k/top-p (under greedy: the plain log-softmax of the
logits). train.py hands these to the loss as the sampler's logprobs (truncated importance sampling).

Shapes: logits (B, V) (bf16 or fp32), one row per sequence of the step -> tokens (B,) long,
logprobs (B,) fp32, both left on the logits' device. A seeded torch.Generator makes a draw
reproducible. With `keys` (B,) int64, row b draws from its own key alone, whatever rows share the
call: the engine keys a draw by (the call's seed, the sequence, the position being sampled), so
that preemption, a smaller KV cache or another batch composition sample the same tokens.

This file is the torch path. The GPU path without top-k / top-p (GRPO samples at temperature 1 from
the full distribution) is the kernel wing's (kernels/sampler.py, chosen by ops.sample): two Triton kernels instead of ~10 torch ones, the same
exponential race in its Gumbel-max form (with U uniform, E = -log U ~ Exp(1), and argmax(logp - log E)
= argmax(z + g) for z = logits / T and g = -log(-log U) a standard Gumbel draw), drawn from a per-step
key held in a device tensor that each draw advances, so that a CUDA graph can capture sampling.

Top-p keeps the smallest prefix of the sorted distribution whose mass reaches top_p: a token is
dropped when the mass strictly before it already reaches top_p, so the most likely token always
stays. Ties at the top-k boundary are all kept (a `logits < kth` mask).

Left out: min-p, repetition / frequency penalties, per-sequence parameters within one batch.
Tests: tests/test_sampling.py (greedy and its logprobs, top-k 1 and a tiny top-p collapse to
greedy, empirical frequencies of 200,000 draws against the filtered softmax); the kernels' own in
tests/test_kernels_sampler.py; the engine tests in tests/test_rollout.py check the recorded
logprobs against a dense forward and the seeded draws inside the decode graph.
"""
import torch

# ----------------------------------------------------------------------------------------------
# Sampling: exponential race, no host sync; explicit greedy branch

def sample(logits, params, generator=None, keys=None):
    """logits (B, V) -> tokens (B,) long, logprobs (B,) fp32 under the sampling distribution.
    params: a rollout.SamplingParams (only temperature, top_k and top_p are read here).
    keys: (B,) int64 on the logits' device, each row's random key (None: draw from `generator`)."""
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
    e = torch.empty_like(logp)
    if keys is None:
        e.exponential_(generator=generator)
    else:                   # one generator per row, seeded by its key (the keys' values reach the host)
        for row, key in zip(e, keys.tolist()):
            row.exponential_(generator=torch.Generator(e.device).manual_seed(key % 2 ** 63))
    e.clamp_min_(1e-30)                                                             # no log(0)
    tokens = (logp - e.log()).argmax(-1)     # argmax p_i / E_i, E_i ~ Exp(1): a draw from p
    return tokens, logp.gather(1, tokens[:, None])[:, 0]
