"""Tests for sampling.py: greedy and its logprobs, top-k / top-p collapsing to greedy, and the
exponential race's empirical frequencies against the filtered softmax. The GPU path (sample() handing
the unfiltered case to the kernels) is tested in tests/test_kernels_sampler.py; the engine's recorded
logprobs against a dense forward in tests/test_rollout.py."""
import torch

from rollout import SamplingParams
from sampling import sample

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
