"""Tests for lora_kernels.py: the decode-time LoRA update y += s·(x Aᵀ) Bᵀ (shrink + expand kernels)
against float64 and against lora.py's torch path; in place, on row-strided outputs, with bad shapes."""
import pytest
import torch

import lora
from lora_kernels import MAX_M, lora_delta_, pdl_for


def _inputs(M, K, R, N, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x, A, B = torch.randn(M, K, generator=g), torch.randn(R, K, generator=g) / K ** 0.5, torch.randn(N, R, generator=g)
    y = torch.randn(M, N, generator=g)
    return (t.to(device, dtype) for t in (x, A, B, y))


@pytest.mark.interpreter
@pytest.mark.parametrize("M, K, R, N", [(1, 200, 8, 70), (5, 3000, 40, 129), (16, 1024, 96, 64), (3, 9000, 32, 40)])
def test_lora_delta_matches_float64(M, K, R, N):
    """fp32: K not a multiple of the 128-wide step, 1..8 K-chunks, R and N not multiples of the tiles;
    y is a column slice of a wider output (the stacked q/k/v case): its columns change in place, the
    neighbours' do not."""
    x, A, B, y = _inputs(M, K, R, N, torch.float32)
    wide = torch.randn(M, N + 7)
    wide[:, 3:3 + N] = y
    before = wide.clone()
    want = y.double() + 0.5 * (x.double() @ A.double().t()) @ B.double().t()
    out = lora_delta_(x, A, B, wide[:, 3:3 + N], 0.5)
    assert out.data_ptr() == wide[:, 3:].data_ptr()
    torch.testing.assert_close(wide[:, 3:3 + N].double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, 3 + N:], before[:, 3 + N:])


@pytest.mark.interpreter
def test_lora_delta_reads_row_strided_x_and_rejects_mixed_dtypes():
    """x a column slice of a wider activation (rows stride_xm != K apart), against float64; mixed
    dtypes get a clear error."""
    x, A, B, y = _inputs(3, 300, 8, 50, torch.float32, seed=2)
    wide = torch.cat([torch.randn(3, 5), x, torch.randn(3, 9)], 1)
    want = y.double() + 1.5 * (x.double() @ A.double().t()) @ B.double().t()
    torch.testing.assert_close(lora_delta_(wide[:, 5:305], A, B, y, 1.5).double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one dtype"):
        lora_delta_(x, A, B, y.bfloat16(), 1.0)


@pytest.mark.interpreter
def test_lora_delta_bf16_rounds_h_like_the_torch_path():
    """bf16: h rounded to bf16 before the expand, as F.linear's h is; then y + s·h Bᵀ rounded once."""
    x, A, B, y = _inputs(4, 2048, 32, 96, torch.bfloat16, seed=1)
    h = (x.float() @ A.float().t()).bfloat16()
    want = (y.float() + 2.0 * (h.float() @ B.float().t())).bfloat16()
    got = lora_delta_(x, A, B, y.clone(), 2.0)
    assert (got.float() - want.float()).abs().max() <= 2 * want.float().abs().max() * 2 ** -8


@pytest.mark.interpreter
def test_lora_delta_rejects_what_it_cannot_do():
    x, A, B, y = _inputs(MAX_M + 1, 64, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="M <= 16"):
        lora_delta_(x, A, B, y, 1.0)
    x, A, B, y = _inputs(2, 64, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        lora_delta_(x, A[:, :32], B, y, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        lora_delta_(x, A, B, torch.zeros(16, 2).t(), 1.0)


def test_pdl_for_skips_pdl_only_beside_the_nvfp4_kernels():
    import nvfp4
    q = nvfp4.NVFP4Linear(64, 32)
    dense = torch.nn.Linear(64, 32)
    assert not pdl_for(q) and pdl_for(dense)


def test_early_shrink_only_beside_the_gemv_and_the_tiles(monkeypatch):
    """The shrink goes before the base matmul on an NVFP4 base at the rows where the GEMV (1) or
    the swapped tiles (K not a multiple of 128) compute it, never beside the fragment kernel (2..16
    where K is) or on a dense base."""
    import lora_kernels
    import nvfp4
    q, dense = nvfp4.NVFP4Linear(128, 32), torch.nn.Linear(64, 32)
    assert [m for m in range(1, MAX_M + 1) if lora_kernels.early_shrink(q, m)] == [1]
    assert all(lora_kernels.early_shrink(nvfp4.NVFP4Linear(64, 32), m) for m in range(1, MAX_M + 1))
    assert not any(lora_kernels.early_shrink(dense, m) for m in range(1, MAX_M + 1))
    monkeypatch.setattr(lora_kernels, "EARLY_SHRINK", False)
    assert not lora_kernels.early_shrink(q, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_gpu_lora_linear_kernels_match_the_torch_path(rows, monkeypatch):
    """bf16 on CUDA: a single adapter (add_delta) and a q/k/v-like group (add_group_delta, one stacked
    A and a block-diagonal B) give the torch path's output within bf16 rounding, and use the kernels."""
    torch.manual_seed(0)
    mods = [lora.LoRALinear(torch.nn.Linear(512, n, bias=False).cuda().bfloat16(), r=16, alpha=32).cuda()
            for n in (512, 128, 128)]
    for m in mods:
        torch.nn.init.normal_(m.lora_B, std=0.02)
        m.eval()
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(rows, 768, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = lora.lora_kernels.lora_expand_
    monkeypatch.setattr(lora.lora_kernels, "lora_expand_", lambda *a: calls.append(a[-1]) or real(*a))
    with torch.no_grad():
        got_one = mods[0].add_delta(x, y[:, :512].clone())
        got_fwd = mods[0](x)                             # x Aᵀ first, then the base matmul, then expand
        got_group = lora.LoRALinear.add_group_delta(mods, x, lambda: y.clone())
        monkeypatch.setattr(lora, "_decode_kernels", lambda x2: False)
        want_one = mods[0].add_delta(x, y[:, :512].clone())
        want_fwd = mods[0](x)
        want_group = lora.LoRALinear.add_group_delta(mods, x, y.clone())
    assert calls == [True, True, True]                   # bf16 bases: with PDL (pdl_for)
    for got, want in ((got_one, want_one), (got_fwd, want_fwd), (got_group, want_group)):
        assert (got.float() - want.float()).abs().max() <= 2 * want.float().abs().max() * 2 ** -8


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4, 16])
def test_gpu_nvfp4_base_folds_the_expand_into_the_base_kernel(rows, monkeypatch):
    """On an NVFP4 base the GEMV's row (1) gets the update from the base kernel itself
    (lora_kernels.fold_expand: no expand launch), the fragment kernel's rows (2..16 here, K = 512)
    from the expand kernel; a single adapter
    (forward) and a q/k/v-like group over a StackedLinear give lora.py's torch path within bf16
    rounding on every route."""
    import nvfp4
    import stacked_linear
    torch.manual_seed(0)
    g = torch.tensor([448.0 * 6 / 0.2], device="cuda")                 # one global scale for the group
    bases = [nvfp4.NVFP4Linear.from_weight(torch.randn(n, 512, device="cuda", dtype=torch.bfloat16) * 0.05,
                                           torch.randn(n, device="cuda", dtype=torch.bfloat16), global_scale=g)
             for n in (512, 128, 128)]
    mods = [lora.LoRALinear(b, r=16, alpha=32) for b in bases]
    for m in mods:
        torch.nn.init.normal_(m.lora_B, std=0.02)
        m.eval()
    stack = stacked_linear.StackedLinear(bases)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = lora.lora_kernels.lora_expand_
    monkeypatch.setattr(lora.lora_kernels, "lora_expand_", lambda *a: calls.append(a[-1]) or real(*a))
    with torch.no_grad():
        got_fwd = mods[0](x)
        got_group = lora.LoRALinear.add_group_delta(mods, x, lambda **kw: stack(x, **kw))
        monkeypatch.setattr(lora, "_decode_kernels", lambda x2: False)
        want_fwd = mods[0](x)
        want_group = lora.LoRALinear.add_group_delta(mods, x, stack(x))
    assert len(calls) == (0 if rows == 1 else 2)
    for got, want in ((got_fwd, want_fwd), (got_group, want_group)):
        assert (got.float() - want.float()).abs().max() <= 2 * want.float().abs().max() * 2 ** -8
