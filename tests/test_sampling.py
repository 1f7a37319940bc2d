"""Tests for sampling.py: greedy and its logprobs, top-k / top-p collapsing to greedy, and the
exponential race's empirical frequencies against the filtered softmax; the Triton path (Gumbel-max
over chunks) against argmax, float64 log-softmax and softmax frequencies. The engine's recorded
logprobs against a dense forward are checked in tests/test_rollout.py."""
import pytest
import torch

from rollout import SamplingParams
from sampling import sample, sample_triton

# ----------------------------------------------------------------------------------------------
# Sampler

def test_sample_greedy_top_k_top_p_and_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    tok, lp = sample(logits, SamplingParams(temperature=0))
    assert torch.equal(tok, logits.argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0])
    # top_k=1 and a tiny top_p both collapse to greedy with logprob 0
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6)):
        tok, lp = sample(logits, params)
        assert torch.equal(tok, logits.argmax(-1)) and torch.all(lp == 0)


def test_sample_draws_from_the_filtered_distribution():
    """Empirical frequencies of the exponential race match softmax(logits/T) restricted by top-k/p."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9, seed=0)
    p = torch.softmax(logits / 0.7, -1)
    p[4:] = 0                                            # top-k 4
    p /= p.sum()
    keep = (torch.cumsum(p, 0) - p) < 0.9                # top-p
    p = torch.where(keep, p, 0)
    p /= p.sum()
    g = torch.Generator().manual_seed(0)
    tok, lp = sample(logits.expand(200_000, -1), params, g)
    freq = torch.bincount(tok, minlength=6).double() / tok.numel()
    assert (freq - p.double()).abs().max() < 5e-3, f"freq {freq} vs p {p}"
    torch.testing.assert_close(lp, p.log()[tok], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# The Triton path (sample_triton: no top-k / top-p): interpreter on CPU, real sizes on the GPU

def _logp64(logits, temperature=1.0):
    return torch.log_softmax(logits.double() / temperature, -1)


def _draws_match(tokens, p, sigmas=4.5):
    """Every token's empirical frequency within `sigmas` binomial standard deviations of p; tokens
    expected fewer than 10 times are pooled into one bucket first (the normal approximation of a
    count does not hold for them: 2 draws of a p = 2e-4 token among 600 are a 0.6% event)."""
    n = tokens.numel()
    freq = torch.bincount(tokens.cpu(), minlength=p.numel()).double() / n
    rare = p * n < 10
    freq = torch.cat([freq[~rare], freq[rare].sum()[None]])
    p = torch.cat([p[~rare], p[rare].sum()[None]])
    sd = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= sigmas * sd + 1e-12).all(), f"freq {freq} vs p {p}"


@pytest.mark.interpreter
def test_sample_triton_greedy_across_chunks_with_ties_and_logprobs():
    """Greedy over 5 chunks of 1024: the argmax, the lowest index on a tie across chunks (torch's
    rule), and logprobs = float64 log-softmax of the row, for fp32 and bf16 logits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5000, generator=g) * 3
    logits[1, 4000] = logits[1, 100] = 50.0          # a tie in chunks 0 and 3
    logits[2, 4999] = 40.0                           # the last logit of a partial chunk
    for x in (logits, logits.bfloat16()):
        tok, lp = sample_triton(x, 0.0, chunk=1024)
        assert tok.tolist() == [int(x[0].float().argmax()), 100, 4999]
        want = _logp64(x).gather(1, tok[:, None])[:, 0]
        torch.testing.assert_close(lp.double(), want, rtol=0, atol=1e-5)


@pytest.mark.interpreter
def test_sample_triton_draws_from_the_softmax_across_chunks():
    """Gumbel-max over 3 chunks of 8 logits: frequencies of 600 draws against softmax(z / 0.7),
    the recorded logprobs against float64, and a seeded generator repeats its draws."""
    z = torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0, 0.0, -2.0, 1.5] * 3) + torch.arange(24) % 5 * 0.1
    params = SamplingParams(temperature=0.7, seed=0)
    x = z.expand(600, -1)
    tok, lp = sample_triton(x, params.temperature, torch.Generator().manual_seed(1), chunk=8)
    p = torch.softmax(z.double() / 0.7, -1)
    _draws_match(tok, p)
    torch.testing.assert_close(lp.double(), p.log()[tok], rtol=0, atol=1e-5)
    again, _ = sample_triton(x[:50], 0.7, torch.Generator().manual_seed(1), chunk=8)
    assert torch.equal(again, tok[:50])


@pytest.mark.interpreter
def test_sample_triton_seed_tensor_advances_and_out_buffers():
    """seed=: the key a CUDA graph reads by address. A call with key k draws what the generator path
    draws when its generator yields k, and leaves k + 1 behind, so the next call draws with k + 1;
    out= receives the results (here views of one buffer, as the engine's step record). Bad seed /
    out: ValueError."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 40, generator=g)
    k = int(torch.randint(2 ** 62, (1,), generator=torch.Generator().manual_seed(9)))
    want = [sample_triton(x, 0.8, torch.Generator().manual_seed(9), chunk=16)]
    seed = torch.tensor([k])
    buf = torch.zeros(6 * 12, dtype=torch.uint8)
    out = buf[:48].view(torch.int64), buf[48:].view(torch.float32)
    tok, lp = sample_triton(x, 0.8, seed=seed, out=out, chunk=16)
    assert tok.data_ptr() == buf.data_ptr() and int(seed) == k + 1
    assert torch.equal(tok, want[0][0]) and torch.equal(lp, want[0][1])
    again = sample_triton(x, 0.8, seed=seed, chunk=16)
    fresh = sample_triton(x, 0.8, seed=torch.tensor([k + 1]), chunk=16)
    assert torch.equal(again[0], fresh[0]) and not torch.equal(again[0], tok) and int(seed) == k + 2
    with pytest.raises(ValueError, match="seed must be"):
        sample_triton(x, 0.8, seed=torch.tensor([7], dtype=torch.int32))
    with pytest.raises(ValueError, match="out must be"):
        sample_triton(x, 0.8, seed=seed, out=(out[0][:5], out[1][:5]))


@pytest.mark.gpu
def test_gpu_sample_dispatches_to_triton_and_matches_the_softmax(monkeypatch):
    """On CUDA, sample() without top-k/top-p runs the kernels: 200,000 draws over 6 logits and 4,096
    over a Qwen2.5-size vocabulary (bf16, 75 chunks of 2,048) follow softmax(z / T); logprobs vs float64."""
    import sampling
    calls = []
    monkeypatch.setattr(sampling, "sample_triton", lambda *a, **k: calls.append(1) or sample_triton(*a, **k))
    z = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0], device="cuda")
    tok, lp = sample(z.expand(200_000, -1), SamplingParams(temperature=0.7, seed=0),
                     torch.Generator(device="cuda").manual_seed(0))
    p = torch.softmax(z.double() / 0.7, -1)
    _draws_match(tok, p.cpu())
    torch.testing.assert_close(lp.double(), p.log()[tok], rtol=0, atol=1e-5)
    g = torch.Generator(device="cuda").manual_seed(2)
    big = torch.randn(152064, device="cuda", generator=g)
    big[[7, 60_000, 152_063]] = torch.tensor([12.0, 11.5, 11.0], device="cuda")
    big = big.bfloat16()
    tok, lp = sample(big.expand(4096, -1), SamplingParams(temperature=1.0), g)
    p = torch.softmax(big.double(), -1)
    top = torch.tensor([7, 60_000, 152_063], device="cuda")
    bucket = torch.where(tok[:, None] == top, torch.arange(3, device="cuda"), 3).min(1).values
    _draws_match(bucket, torch.cat([p[top], 1 - p[top].sum()[None]]).cpu())
    torch.testing.assert_close(lp.double(), p.log()[tok], rtol=0, atol=1e-4)
    assert len(calls) == 2
    nan = torch.full((2, 152064), float("nan"), device="cuda", dtype=torch.bfloat16)
    tok, _ = sample_triton(nan, 1.0)       # a row of NaNs still picks a token inside the vocabulary
    assert ((tok >= 0) & (tok < 152064)).all()
