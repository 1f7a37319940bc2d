"""Tests for kernels/sampler.py: the two sampling kernels (Gumbel-max over chunks) against argmax,
float64 log-softmax and softmax frequencies (interpreter on CPU, a 152k vocabulary on the GPU); the
chunk size and where the kernels run; fill_tokens against the torch ops. sampling.py's own math and
the engine's recorded logprobs: tests/test_sampling.py, tests/test_rollout.py."""
import dataclasses
import random

import pytest
import torch

import kernels
from kernels import tuning
from kernels.sampler import default_chunk, fill_tokens, sample


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
def test_sample_kernels_greedy_across_chunks_with_ties_and_logprobs():
    """Greedy over 5 chunks of 1024: the argmax, the lowest index on a tie across chunks (torch's
    rule), and logprobs = float64 log-softmax of the row, for fp32 and bf16 logits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5000, generator=g) * 3
    logits[1, 4000] = logits[1, 100] = 50.0          # a tie in chunks 0 and 3
    logits[2, 4999] = 40.0                           # the last logit of a partial chunk
    for x in (logits, logits.bfloat16()):
        tok, lp = sample(x, 0.0, chunk=1024)
        assert tok.tolist() == [int(x[0].float().argmax()), 100, 4999]
        want = _logp64(x).gather(1, tok[:, None])[:, 0]
        torch.testing.assert_close(lp.double(), want, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.interpreter
def test_sample_kernels_draws_from_the_softmax_across_chunks():
    """Gumbel-max over 3 chunks of 8 logits: frequencies of 600 draws against softmax(z / 0.7),
    the recorded logprobs against float64, and a seeded generator repeats its draws."""
    z = torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0, 0.0, -2.0, 1.5] * 3) + torch.arange(24) % 5 * 0.1
    x = z.expand(600, -1)
    tok, lp = sample(x, 0.7, torch.Generator().manual_seed(1), chunk=8)
    p = torch.softmax(z.double() / 0.7, -1)
    _draws_match(tok, p)
    torch.testing.assert_close(lp.double(), p.log()[tok], rtol=0, atol=1e-5)
    again, _ = sample(x[:50], 0.7, torch.Generator().manual_seed(1), chunk=8)
    assert torch.equal(again, tok[:50])


@pytest.mark.interpreter
def test_sample_kernels_row_keys_and_out_buffers():
    """keys=: each row draws from its own key alone. The same (row, key) draws the same token wherever
    the row sits in the batch and whatever rows share the call (the engine's preemption-proof draws);
    a row with another key draws otherwise; without keys, the rows of a call draw with one generator
    key plus the row index. out= receives the results (here views of one buffer, as the engine's step
    record). Bad keys / out: ValueError."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 40, generator=g)
    keys = torch.randint(2 ** 62, (6,), generator=g)
    buf = torch.zeros(6 * 12, dtype=torch.uint8)
    out = buf[:48].view(torch.int64), buf[48:].view(torch.float32)
    tok, lp = sample(x, 0.8, keys=keys, out=out, chunk=16)
    assert tok.data_ptr() == buf.data_ptr()
    perm = torch.tensor([3, 0, 5])                            # three of the rows, in another order, alone
    tok3, lp3 = sample(x[perm], 0.8, keys=keys[perm], chunk=16)
    assert torch.equal(tok3, tok[perm]) and torch.equal(lp3, lp[perm])
    draws = {int(sample(x[:1], 0.8, keys=torch.tensor([k]), chunk=16)[0]) for k in range(40)}
    assert len(draws) > 5, f"different keys must draw differently, got {draws}"
    k = int(torch.randint(2 ** 62, (1,), generator=torch.Generator().manual_seed(9)))
    want = sample(x, 0.8, keys=k + torch.arange(6), chunk=16)
    got = sample(x, 0.8, torch.Generator().manual_seed(9), chunk=16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="keys must be"):
        sample(x, 0.8, keys=keys.int())
    with pytest.raises(ValueError, match="out must be"):
        sample(x, 0.8, keys=keys, out=(out[0][:5], out[1][:5]))


@pytest.mark.gpu
def test_gpu_sample_dispatches_to_the_kernels_and_matches_the_softmax(monkeypatch):
    """On CUDA, ops.sample() without top-k/top-p runs the kernels: 200,000 draws over 6 logits and
    4,096 over a Qwen2.5-size vocabulary (bf16, 75 chunks of 2,048) follow softmax(z / T); logprobs vs
    float64."""
    import ops
    from rollout import SamplingParams
    calls = []
    monkeypatch.setattr(kernels, "sample", lambda *a, **k: calls.append(1) or sample(*a, **k))
    z = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0], device="cuda")
    tok, lp = ops.sample(z.expand(200_000, -1), SamplingParams(temperature=0.7, seed=0),
                         torch.Generator(device="cuda").manual_seed(0))
    p = torch.softmax(z.double() / 0.7, -1)
    _draws_match(tok, p.cpu())
    torch.testing.assert_close(lp.double(), p.log()[tok], rtol=0, atol=1e-5)
    g = torch.Generator(device="cuda").manual_seed(2)
    big = torch.randn(152064, device="cuda", generator=g)
    big[[7, 60_000, 152_063]] = torch.tensor([12.0, 11.5, 11.0], device="cuda")
    big = big.bfloat16()
    tok, lp = ops.sample(big.expand(4096, -1), SamplingParams(temperature=1.0), g)
    p = torch.softmax(big.double(), -1)
    top = torch.tensor([7, 60_000, 152_063], device="cuda")
    bucket = torch.where(tok[:, None] == top, torch.arange(3, device="cuda"), 3).min(1).values
    _draws_match(bucket, torch.cat([p[top], 1 - p[top].sum()[None]]).cpu())
    torch.testing.assert_close(lp.double(), p.log()[tok], rtol=0, atol=1e-4)
    assert len(calls) == 2
    nan = torch.full((2, 152064), float("nan"), device="cuda", dtype=torch.bfloat16)
    tok, _ = sample(nan, 1.0)       # a row of NaNs still picks a token inside the vocabulary
    assert ((tok >= 0) & (tok < 152064)).all()


def test_chunk_and_where_the_kernels_run():
    """default_chunk: greedy programs take sample_chunk logits, drawing ones fewer (1024 to 16 rows,
    2048 beyond); a moved field moves it. sampler_runs: CUDA only, no top-k / top-p, any B·V (a
    logit's Philox counter is its index in the row)."""
    assert [default_chunk(r, t) for r, t in ((1, 0.0), (128, 0.0), (1, 1.0), (16, 1.0), (17, 1.0))] == [
        4096, 4096, 1024, 1024, 2048]
    with tuning.using(dataclasses.replace(tuning.current(), sample_small_rows=32)):
        assert default_chunk(17, 1.0) == 1024
    assert not kernels.sampler_runs(False, (4, 1000), "cpu")
    assert kernels.sampler_runs(False, (4, 1000), "cuda") == kernels.available
    assert not kernels.sampler_runs(True, (4, 1000), "cuda")
    assert kernels.sampler_runs(False, (2 ** 16, 2 ** 15), "cuda") == kernels.available


@pytest.mark.interpreter
def test_fill_tokens_kernel_matches_the_torch_ops():
    """fill_tokens (one Triton kernel, run here by the interpreter) on the view the graphs fill (meta
    (5, bucket) at the front of the flat static buffer) and on a strided slice (rows 512 apart): row
    i's token becomes prev[src] where src = meta[4, i] >= 0, every other entry, inside the view or
    past it, stays; the same as ops.fill_tokens' torch ops (its path for CPU tensors)."""
    import ops
    g = torch.Generator().manual_seed(int.from_bytes(random.randbytes(4), "little"))
    prev = torch.randint(0, 150000, (20,), generator=g)
    for view in (lambda t: t.view(-1)[:5 * 37].view(5, 37), lambda t: t[:, :37]):
        wide = torch.randint(0, 1000, (5, 512), generator=g, dtype=torch.int32)
        view(wide)[4] = torch.randint(-1, 20, (37,), generator=g, dtype=torch.int32)
        want = wide.clone()
        for i in range(37):
            if view(want)[4, i] >= 0:
                view(want)[0, i] = prev[view(want)[4, i]]
        ref = wide.clone()
        ops.fill_tokens(view(ref), prev)                                # the torch ops (CPU tensors)
        got = wide.clone()
        fill_tokens(view(got), prev)
        assert torch.equal(ref, want) and torch.equal(got, want) and not torch.equal(want, wide)
