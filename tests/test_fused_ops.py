"""fused_ops.py: the Triton add + RMSNorm, RoPE and SiLU·mul kernels against the torch ops that
training uses (model.RMSNorm's torch path, model.apply_rope, F.silu(g) * u).

On CPU the kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET=1), on a GPU on
CUDA; fresh random inputs each run, with masked tails and the strided layouts the stacked q/k/v and
gate/up outputs leave.
"""
import os

import pytest
import torch

from fused_ops import rms_norm_triton, rope_triton, silu_mul_triton, token_stride
from model import RMSNorm, apply_rope


@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_match_the_torch_ops(dtype, early, monkeypatch):
    import marlin_kernel                  # the norm's weight and residual loaded before the PDL wait or after
    monkeypatch.setattr(marlin_kernel, "EARLY_LOADS", early)
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"   # on CPU: the Triton interpreter
    x, r = (torch.randn(3, 5, 96, generator=g).to(dev, dtype) for _ in range(2))  # C=96: masked tail
    norm = RMSNorm(96, 1e-6).to(dev)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(96, generator=g))
    want_h, want_sum = norm(x, residual=r)         # grad enabled: the torch path
    got_h, got_sum = rms_norm_triton(x, norm.weight, 1e-6, residual=r)
    # fp32: only the order of the norm's sum differs; bf16: at most one rounding step (the
    # interpreter truncates fp32 -> bf16 instead of rounding to nearest; the GPU rounds)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2e-2)
    if dtype == torch.float32 or dev == "cuda":
        assert torch.equal(got_sum, want_sum)      # x + residual rounds as torch's add does
    torch.testing.assert_close(got_sum, want_sum, **tol)
    torch.testing.assert_close(got_h, want_h, **tol)
    torch.testing.assert_close(rms_norm_triton(x, norm.weight, 1e-6), norm(x), **tol)
    q, k = torch.randn(2, 3, 4, 32, generator=g).to(dev, dtype), torch.randn(2, 3, 2, 32, generator=g).to(dev, dtype)
    angles = torch.rand(2, 3, 16, generator=g).to(dev) * 50
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    got_q, got_k = rope_triton(q.clone(), k.clone(), cos, sin)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    # column slices of one stacked output (StackedLinear): strided token rows, prefill-like (T = 3)
    # and decode-like (T = 1, where view gives the size-1 dim a stride that is not the row's)
    for T in (3, 1):
        qkv = torch.randn(2, T, 8 * 32, generator=g).to(dev, dtype)
        q, k = qkv[..., :128].view(2, T, 4, 32), qkv[..., 128:192].view(2, T, 2, 32)
        assert token_stride(q) == 8 * 32 and not q.is_contiguous()
        c, s_ = cos[:, :T], sin[:, :T]
        want_q, want_k = apply_rope(q, c, s_), apply_rope(k, c, s_)
        before = qkv[..., 192:].clone()
        rope_triton(q, k, c, s_)
        torch.testing.assert_close(q, want_q, **tol)
        torch.testing.assert_close(k, want_k, **tol)
        assert torch.equal(qkv[..., 192:], before)     # v untouched
    a, b = torch.randn(3, 1500, generator=g).to(dev, dtype), torch.randn(3, 1500, generator=g).to(dev, dtype)
    two_roundings = tol if dtype == torch.float32 else dict(rtol=2 ** -5, atol=2e-2)  # silu, then the product
    torch.testing.assert_close(silu_mul_triton(a, b), torch.nn.functional.silu(a) * b, **two_roundings)
    gu = torch.randn(2, 3, 3000, generator=g).to(dev, dtype)
    a, b = gu[..., :1500], gu[..., 1500:]
    torch.testing.assert_close(silu_mul_triton(a, b), torch.nn.functional.silu(a) * b, **two_roundings)
