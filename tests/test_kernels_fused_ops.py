"""kernels/fused_ops.py: the Triton add + RMSNorm, RoPE and SiLU·mul kernels against the torch ops that
training uses (model.RMSNorm's torch path, the rotation of the RoPE pairs in fp32, F.silu(g) * u, the
embedding and angle ops of the model's forward); the few-row GEMV (the sampler's lm_head) against
float64.

On CPU the kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET=1), on a GPU on
CUDA; fresh random inputs each run, with masked tails and the strided layouts the stacked q/k/v and
gate/up outputs leave.
"""
import os

import pytest
import torch

import kernels
from kernels.fused_ops import embed_rope, gemv, rms_norm, rope, silu_mul, token_stride
from model import ModelConfig, RMSNorm, rope_inv_freq


def apply_rope(x, cos, sin):
    """The torch reference: pairs (i, i + D/2) rotated in fp32, rounded back once."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_match_the_torch_ops(dtype):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"   # on CPU: the Triton interpreter
    x, r = (torch.randn(3, 5, 96, generator=g).to(dev, dtype) for _ in range(2))  # C=96: masked tail
    norm = RMSNorm(96, 1e-6).to(dev)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(96, generator=g))
    want_h, want_sum = norm(x, residual=r)         # grad enabled: the torch path
    got_h, got_sum = rms_norm(x, norm.weight, 1e-6, residual=r)
    # fp32: only the order of the norm's sum differs; bf16: at most one rounding step (the
    # interpreter truncates fp32 -> bf16 instead of rounding to nearest; the GPU rounds)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2e-2)
    if dtype == torch.float32 or dev == "cuda":
        assert torch.equal(got_sum, want_sum)      # x + residual rounds as torch's add does
    torch.testing.assert_close(got_sum, want_sum, **tol)
    torch.testing.assert_close(got_h, want_h, **tol)
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-6), norm(x), **tol)
    q, k = torch.randn(2, 3, 4, 32, generator=g).to(dev, dtype), torch.randn(2, 3, 2, 32, generator=g).to(dev, dtype)
    angles = torch.rand(2, 3, 16, generator=g).to(dev) * 50
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    got_q, got_k = rope(q.clone(), k.clone(), cos, sin)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    # column slices of one stacked output (StackedLinear): strided token rows, prefill-like (T = 3)
    # and decode-like (T = 1, where view gives the size-1 dim a stride that is not the row's)
    for T in (3, 1):
        qkv = torch.randn(2, T, 8 * 32, generator=g).to(dev, dtype)
        q, k = qkv[..., :128].view(2, T, 4, 32), qkv[..., 128:192].view(2, T, 2, 32)
        assert token_stride(q) == 8 * 32 and not q.is_contiguous() and kernels.rope_fits(q, k)
        c, s_ = cos[:, :T], sin[:, :T]
        want_q, want_k = apply_rope(q, c, s_), apply_rope(k, c, s_)
        before = qkv[..., 192:].clone()
        rope(q, k, c, s_)
        torch.testing.assert_close(q, want_q, **tol)
        torch.testing.assert_close(k, want_k, **tol)
        assert torch.equal(qkv[..., 192:], before)     # v untouched
    a, b = torch.randn(3, 1500, generator=g).to(dev, dtype), torch.randn(3, 1500, generator=g).to(dev, dtype)
    two_roundings = tol if dtype == torch.float32 else dict(rtol=2 ** -5, atol=2e-2)  # silu, then the product
    torch.testing.assert_close(silu_mul(a, b), torch.nn.functional.silu(a) * b, **two_roundings)
    gu = torch.randn(2, 3, 3000, generator=g).to(dev, dtype)
    a, b = gu[..., :1500], gu[..., 1500:]
    torch.testing.assert_close(silu_mul(a, b), torch.nn.functional.silu(a) * b, **two_roundings)


def test_rope_fits_only_one_token_stride_and_a_power_of_two():
    """rope_fits: heads contiguous and one stride between tokens, D a power of two."""
    q, k = torch.zeros(2, 3, 4, 32), torch.zeros(2, 3, 2, 32)
    assert kernels.rope_fits(q, k)
    assert not kernels.rope_fits(q.transpose(1, 2).contiguous().transpose(1, 2), k)     # tokens not one stride
    assert not kernels.rope_fits(torch.zeros(2, 3, 4, 48), torch.zeros(2, 3, 2, 48))     # D = 48


def _check_gemv(M, N, K, dtype, dev, g):
    """gemv against float64: fp32 logits whatever the inputs' dtype (never rounded to bf16), within one
    fp32 rounding plus the fp32 sum's error bound (K·2^-24 of Σ|x·w|), every element written (the
    output is fresh each call)."""
    x = torch.randn(M, K, generator=g).to(dev, dtype)
    w = (torch.randn(N, K, generator=g) * 0.05).to(dev, dtype)
    y = gemv(x, w)
    assert y.shape == (M, N) and y.dtype == torch.float32
    ref = x.double() @ w.double().t()
    bound = ref.abs() * 2 ** -23 + K * 2 ** -24 * (x.double().abs() @ w.double().abs().t())
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"M={M} {dtype}: worst {(err / bound).max():.2f} of the bound"


def test_embed_rope_matches_the_torch_ops():
    """The gather and the RoPE angles of the model's torch path: x = E[ids] bit for bit; cos / sin
    of float(p)·θ (int32 decode positions and int64 prefill ones, up to 32k) bit for bit on the GPU
    (libdevice is CUDA's cosf), within an fp32 ulp under the interpreter (numpy's cos); head_dim 96
    (D/2 = 48, not a power of two) masks its tail; an id outside the vocabulary reads zeros, not past
    the table."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for head_dim in (64, 96):
        cfg = ModelConfig("Qwen2ForCausalLM", 300, 72, 128, 1, 2, 1, head_dim=head_dim, rope_theta=1e6)
        inv_freq = rope_inv_freq(cfg).to(dev)
        emb = torch.randn(300, 72, generator=g).to(dev, torch.bfloat16)
        for dtype in (torch.int32, torch.int64):
            ids = torch.randint(0, 300, (3, 5), generator=g).to(dev, dtype)
            pos = torch.randint(0, 32768, (3, 5), generator=g).to(dev, dtype)
            x, cos, sin = embed_rope(ids, pos, emb, inv_freq)
            angles = pos[..., None].float() * inv_freq
            assert torch.equal(x, emb[ids.long()]) and cos.shape == sin.shape == (3, 5, 1, head_dim // 2)
            check = torch.equal if dev == "cuda" else lambda a, b: torch.allclose(a, b, rtol=0, atol=2e-7)
            assert check(cos[:, :, 0], angles.cos()) and check(sin[:, :, 0], angles.sin())
    ids[0, 0] = 300
    assert torch.equal(embed_rope(ids, pos, emb, inv_freq)[0][0, 0], torch.zeros(72, dtype=emb.dtype, device=dev))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 2])
def test_gemv_matches_float64(M, dtype):
    """One and two rows, N not a multiple of the 8-row programs, K with a tail in both step widths
    (512 at M = 1, 256 at M = 2)."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    _check_gemv(M, 75, 600, dtype, "cuda" if torch.cuda.is_available() else "cpu", g)


def test_gemv_rejects_what_it_does_not_take():
    x, w = torch.randn(3, 64), torch.randn(16, 64)
    with pytest.raises(ValueError, match="M <= 2"):
        gemv(x, w)
    with pytest.raises(ValueError, match="one dtype"):
        gemv(x[:1], w.bfloat16())
    with pytest.raises(ValueError, match="contiguous"):
        gemv(x[:1], torch.randn(64, 16).t())
    assert gemv(x[:0], w).shape == (0, 16)


def test_lm_head_fits_a_bias_free_linear_at_one_or_two_rows():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    head = torch.nn.Linear(64, 32, bias=False).to(dev)
    assert kernels.lm_head_fits(torch.zeros(2, 64), head) and not kernels.lm_head_fits(torch.zeros(3, 64), head)
    assert not kernels.lm_head_fits(torch.zeros(1, 64), torch.nn.Linear(64, 32))
    x = torch.randn(2, 64, device=dev)
    torch.testing.assert_close(kernels.lm_head(x, head), head(x), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemv_lm_head_shape_gpu():
    """The 7B lm_head's K (3584) against a 32k-row weight, bf16, M = 1 and 2, on CUDA."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for M in (1, 2):
        _check_gemv(M, 32768, 3584, torch.bfloat16, "cuda", g)
