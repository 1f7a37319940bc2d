"""Tests for ops.py, the seam: each pure-torch reference against an independent formula (float64
arithmetic written out here), on the CPU, where every op takes its reference. That the fast kernels
compute the same functions is checked in tests/test_kernels_*.py."""

import pytest
import torch
import torch.nn as nn

import kernels
import marlin_kernel as mk
import nvfp4
import ops
from nvfp4_cases import DEV, LaunchSpy, random_weight, rel_err
from ops import add_update


def check_close(a, b, tol, what):
    err = (a.double() - b.double()).abs()
    assert err.max().item() <= tol, f"{what}: max err {err.max().item():.3e} mean {err.mean().item():.3e} > {tol}"


def test_rms_norm_and_the_residual_sum_match_float64():
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, 5, 64, generator=g), torch.randn(3, 5, 64, generator=g)
    w = 1 + 0.1 * torch.randn(64, generator=g)
    s = x.double() + r.double()
    want = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    y, total = ops.rms_norm(x, w, 1e-6, residual=r)
    check_close(total, s, 1e-6, "residual sum")
    check_close(y, want, 1e-5, "norm(x + r)")
    check_close(ops.rms_norm(x, w, 1e-6), x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
                * w.double(), 1e-5, "norm(x)")
    yb, tb = ops.rms_norm(x.bfloat16(), w, 1e-6, residual=r.bfloat16())
    assert yb.dtype == tb.dtype == torch.bfloat16 and torch.equal(tb, x.bfloat16() + r.bfloat16())


def test_rope_rotates_channel_pairs_as_complex_numbers():
    """RoPE as complex multiplication: (x_i + i·x_{i+D/2}) · e^{i·p·θ_i}, in float64."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 7, 4, 16, generator=g), torch.randn(2, 7, 2, 16, generator=g)
    pos = torch.randint(0, 500, (2, 7), generator=g)
    inv = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)      # (8,)
    ang = pos[..., None].double() * inv                                           # (2, 7, 8)
    cos, sin = ang.cos().float()[:, :, None], ang.sin().float()[:, :, None]
    rq, rk = ops.rope(q, k, cos, sin)
    for x, got in ((q, rq), (k, rk)):
        z = torch.complex(x[..., :8].double(), x[..., 8:].double()) * torch.exp(1j * ang)[:, :, None]
        check_close(got, torch.cat((z.real, z.imag), -1), 1e-5, "rope")


def test_embed_rope_gathers_rows_and_angles():
    emb = nn.Embedding(50, 12)
    ids, pos = torch.tensor([[3, 49, 0]]), torch.tensor([[0, 7, 1000]])
    inv = torch.tensor([1.0, 0.1, 0.01])
    x, cos, sin = ops.embed_rope(ids, pos, emb, inv)
    assert torch.equal(x[0, 1], emb.weight[49].detach()) and cos.shape == sin.shape == (1, 3, 1, 3)
    check_close(cos[0, 2, 0], torch.cos(1000 * inv.double()), 1e-4, "cos")
    check_close(sin[0, 1, 0], torch.sin(7 * inv.double()), 1e-6, "sin")


def test_projections_lora_and_logits_references():
    g = torch.Generator().manual_seed(2)
    parent = nn.Module()
    parent.gate_proj, parent.up_proj = nn.Linear(8, 6, bias=False), nn.Linear(8, 6, bias=False)
    x = torch.randn(4, 8, generator=g)
    gate, up = (x.double() @ m.weight.double().t() for m in (parent.gate_proj, parent.up_proj))
    with torch.no_grad():
        check_close(ops.gated_mlp_input(parent, x), gate / (1 + torch.exp(-gate)) * up, 1e-5, "silu(gate)·up")
        outs = ops.project(parent, ("gate_proj", "up_proj"), x)
        check_close(outs[0], gate, 1e-6, "project")
        A, B = torch.randn(3, 8, generator=g), torch.randn(6, 3, generator=g)
        want = gate + 0.5 * (x.double() @ A.double().t()) @ B.double().t()
        check_close(ops.lora_linear(x, parent.gate_proj, A, B, 0.5), want, 1e-5, "lora_linear")
        check_close(ops.logits(x, parent.up_proj), up, 1e-6, "logits")


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_update_without_autograd_is_in_place_on_fresh_outputs(mode):
    """ops.add_update adds s·h Bᵀ into y itself without autograd where y's rows are one view (a
    2-D output, or a contiguous one; a column block of a stacked 2-D output too), and out of place
    for a 3-D column block (its rows are not one view) or with autograd; every result against float64."""
    g = torch.Generator().manual_seed(3)
    stacked = torch.randn(6, 40, generator=g)
    h, B = torch.randn(6, 4, generator=g), torch.randn(24, 4, generator=g)
    want = stacked[:, 8:32].double() + 0.5 * h.double() @ B.double().t()
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    for y, in_place in ((stacked[:, 8:32].clone(), True), (stacked.clone()[:, 8:32], True),
                        (stacked.clone().view(2, 3, 40)[..., 8:32], False)):
        before = y.clone()
        with ctx():
            out = add_update(y, h.view(*y.shape[:-1], 4), B, 0.5)
        check_close(out.reshape(6, 24), want, 1e-5, f"in place {in_place}")
        assert (out is y) == in_place and torch.equal(y, out if in_place else before)
    y = stacked[:, 8:32].clone().requires_grad_()
    out = add_update(y, h, B, 0.5)
    assert out is not y and out.grad_fn is not None
    check_close(out.detach(), want, 1e-5, "autograd")


def test_logprob_stats_and_grad_match_float64():
    """log π(t), entropy and log Z of logit rows against float64 log_softmax; the gradient of
    Σ g·log π(t) against float64 autograd (an independent route to onehot - softmax)."""
    g = torch.Generator().manual_seed(5)
    logits, target = torch.randn(6, 50, generator=g) * 4, torch.randint(0, 50, (6,), generator=g)
    w = torch.randn(6, generator=g)
    logp, ent, logz = ops.logprob_stats(logits, target)
    z = logits.double().requires_grad_()
    ls = z.log_softmax(-1)
    check_close(logp, ls.gather(1, target[:, None])[:, 0].detach(), 2e-5, "log π(t)")   # fp32 sums of ~16
    check_close(ent, -(ls.exp() * ls).sum(-1).detach(), 2e-5, "entropy")
    check_close(logz, z.logsumexp(-1).detach(), 2e-5, "log Z")
    (ls.gather(1, target[:, None])[:, 0] * w.double()).sum().backward()
    grad = ops.logprob_grad(logits, logz, target, w, torch.float32)
    assert grad.dtype == torch.float32 and grad.shape == logits.shape
    check_close(grad, z.grad, 1e-6, "d/dlogits")


# ----------------------------------------------------------------------------------------------
# the NVFP4 matmul: the reference, the fast kernels, the teaching kernel


def _layer(N, K, gen, bias=True, device=DEV):
    """An NVFP4Linear on random codes and scales (plain layout), with a bf16 bias."""
    layer = nvfp4.NVFP4Linear(K, N, bias=bias, device=device)
    layer.weight_packed, layer.weight_scale, layer.weight_global_scale = random_weight(N, K, gen, device)
    if bias:
        layer.bias.data = torch.randn(N, generator=gen).bfloat16().to(device)
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_linear_reference_is_the_dequantized_weight(dtype):
    """Where no kernel runs (here: CPU tensors), y = x·W'ᵀ + b with W' = nvfp4.dequantize, in x's
    dtype, and the gradient reaching x is dy·W' (float64 formula), for (B, T, K) inputs."""
    gen = torch.Generator().manual_seed(3)
    layer = _layer(48, 128, gen, device="cpu")
    W = mk.reference_dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale)   # float64
    x = torch.randn(2, 3, 128, generator=gen).to(dtype).requires_grad_()
    y = ops.nvfp4_linear(layer, x)
    assert y.shape == (2, 3, 48) and y.dtype == dtype
    assert rel_err(y, x.double() @ W.t() + layer.bias.double()) < 1e-2
    dy = torch.randn(2, 3, 48, generator=gen).to(dtype)
    y.backward(dy)
    assert rel_err(x.grad, dy.double() @ W) < 1e-2


def test_nvfp4_linear_hands_off_to_the_fast_kernels(monkeypatch):
    """Where a kernel runs: the forward is kernels.nvfp4_matmul and the backward kernels.nvfp4_matmul_dx,
    each with the layer's tensors and layout; the bias reaches the kernel in bf16."""
    calls = []
    monkeypatch.setattr(ops, "_fp4_kernel_runs", lambda x: True)
    monkeypatch.setattr(kernels, "nvfp4_matmul", lambda *a, **kw: calls.append(("fwd", a, kw)) or a[0] @ a[0].new_ones(
        a[0].shape[1], a[1].shape[0]))
    monkeypatch.setattr(kernels, "nvfp4_matmul_dx", lambda *a, **kw: calls.append(("dx", a, kw)) or a[0].new_zeros(
        a[0].shape[0], 2 * a[1].shape[1]))
    layer = _layer(32, 128, torch.Generator().manual_seed(8), device="cpu")
    layer.interleaved = True                     # only passed on: the stand-in kernels read nothing
    x = torch.randn(3, 128).bfloat16().requires_grad_()
    ops.nvfp4_linear(layer, x).sum().backward()
    (f, fa, fkw), (d, da, dkw) = calls
    assert f == "fwd" and fa[1:] == (layer.weight_packed, layer.weight_scale, layer.weight_global_scale, layer.bias)
    assert fkw == {"interleaved": True} and torch.equal(fa[0], x.detach())
    assert d == "dx" and da[1:] == (layer.weight_packed, layer.weight_scale, layer.weight_global_scale)
    assert dkw == {"interleaved": True}


@pytest.mark.interpreter
def test_the_teaching_kernel_runs_on_request(monkeypatch, poisoned):
    """QERL_MATMUL=teaching (ops.TEACHING): an NVFP4 layer's matmul launches marlin_kernel's kernel and
    nothing of the wing's GEMM, gives the float64 product rounded once, and its gradient is dy·W'; the
    loaders keep the plain layout (ops.interleaves), and an interleaved layer is refused by name."""
    monkeypatch.setattr(ops, "TEACHING", True)
    monkeypatch.setattr(ops, "_fp4_kernel_runs", lambda x: True)         # CPU tensors: the interpreter
    monkeypatch.setattr(kernels, "nvfp4_matmul", None)                   # calling it would fail
    launched = []
    monkeypatch.setattr(mk, "_nvfp4_matmul_kernel", LaunchSpy(mk._nvfp4_matmul_kernel, launched))
    gen = torch.Generator().manual_seed(7)
    layer = _layer(32, 256, gen)
    W = mk.reference_dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale)
    x = torch.randn(5, 256, generator=gen).bfloat16().to(DEV).requires_grad_()
    y = ops.nvfp4_linear(layer, x)
    assert len(launched) == 1
    assert rel_err(y, x.double() @ W.t() + layer.bias.double()) < 1e-2
    dy = torch.randn(5, 32, generator=gen).bfloat16().to(DEV)
    y.backward(dy)
    assert torch.equal(x.grad, dy @ nvfp4.dequantize(layer.weight_packed, layer.weight_scale,
                                                     layer.weight_global_scale, torch.bfloat16))
    assert not ops.interleaves(torch.empty(1, device="meta")) and not ops.interleaves(x)
    layer.interleaved = True
    with pytest.raises(ValueError, match="teaching"):
        ops.nvfp4_linear(layer, x.detach())
