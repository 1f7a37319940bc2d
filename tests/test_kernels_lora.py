"""Tests for kernels/lora.py: the LoRA update of the rollout path, y = base(x) + s·(x Aᵀ) Bᵀ. The shrink
+ expand kernels against float64 (in place, on row-strided outputs, with bad shapes); where each
piece runs (early shrink, folds); the in-place addmm; on the GPU lora_linear and the group update
against the torch path (F.linear and an addmm), folded into the NVFP4 GEMV, the fragment kernel and
the split-K reduce or not, and on Qwen2.5-7B's projections at decode against the expand kernel; the
expand with SiLU·mul in its launch (against float64, and bit for bit against the two launches). The
adapters are the trunk's lora.LoRALinear (the wing reads them by duck typing)."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import fused_ops, gemm, launch, tuning
from kernels import lora as kl
from kernels.lora import lora_delta_


def check_close(a, b, tol, what):
    err = (a.float() - b.float()).abs()
    assert err.max().item() <= tol, f"{what}: max err {err.max().item():.3e} mean {err.mean().item():.3e} > {tol}"


def _inputs(M, K, R, N, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x, A, B = torch.randn(M, K, generator=g), torch.randn(R, K, generator=g) / K ** 0.5, torch.randn(N, R, generator=g)
    y = torch.randn(M, N, generator=g)
    return (t.to(device, dtype) for t in (x, A, B, y))


@pytest.mark.interpreter
@pytest.mark.parametrize("M, K, R, N", [(1, 200, 8, 70), (5, 3000, 40, 129), (16, 1024, 96, 64), (3, 9000, 32, 40),
                                        (27, 600, 24, 80), (32, 300, 16, 33)])
def test_lora_delta_matches_float64(M, K, R, N):
    """fp32: K not a multiple of the shrink's chunk, 1 to 36 chunks summed in the kernel, R and N not
    multiples of the tiles, rows in a 16- or a 32-row tile; y is a column slice of a wider output
    (the stacked q/k/v case): its columns change in place, the neighbours' do not. Again: the same
    bits (the chunks are summed in order, and the last one left the counters at zero)."""
    x, A, B, y = _inputs(M, K, R, N, torch.float32)
    wide = torch.randn(M, N + 7)
    wide[:, 3:3 + N] = y
    before = wide.clone()
    want = y.double() + 0.5 * (x.double() @ A.double().t()) @ B.double().t()
    out = lora_delta_(x, A, B, wide[:, 3:3 + N], 0.5)
    assert out.data_ptr() == wide[:, 3:].data_ptr()
    torch.testing.assert_close(wide[:, 3:3 + N].double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, 3 + N:], before[:, 3 + N:])
    again = before.clone()
    lora_delta_(x, A, B, again[:, 3:3 + N], 0.5)
    assert torch.equal(again, wide)


@pytest.mark.interpreter
@pytest.mark.parametrize("M, K, R, N", [(2, 200, 8, 70), (5, 3000, 40, 129), (16, 1024, 96, 64), (32, 300, 16, 33)])
@pytest.mark.parametrize("silu", [False, True])
def test_expand_launch_carries_the_shrink(M, K, R, N, silu):
    """carried_shrink + the expand kernel (lora_expand_, expand_silu_mul) with the shrink in its first
    programs: against float64 (fp32), and bit for bit the shrink launch then the expand launch (the
    same chunks summed in the same order), again on every flag slot and on the first one a second time
    (each launch leaves its flags zero for the next)."""
    x, A, B, y = _inputs(M, K, R, 2 * N if silu else N, torch.float32, seed=M + K)
    expand = kl.expand_silu_mul if silu else kl.lora_expand_
    hp, carry = kl.carried_shrink(x, A, B)
    got = expand(hp, B, y.clone(), 0.5, carry)
    want = y.double() + 0.5 * (x.double() @ A.double().t()) @ B.double().t()
    if silu:
        want = want[:, :N] * torch.sigmoid(want[:, :N]) * want[:, N:]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, expand(kl.lora_shrink(x, A, B), B, y.clone(), 0.5))
    assert not carry.flags.any()
    for _ in range(launch.SHRINK_SLOTS):
        hp2, carry2 = kl.carried_shrink(x, A, B)
        assert torch.equal(expand(hp2, B, y.clone(), 0.5, carry2), got) and torch.equal(hp2, hp)
        assert not carry2.flags.any()
    assert launch.SHRINK_FLAGS >= kl.SHRINK_TILES + 2          # the rank tiles' counts, ready, readers
    with pytest.raises(ValueError, match="rank tiles"):
        kl.carried_shrink(x, torch.zeros(16 * kl.SHRINK_TILES + 1, K), torch.zeros(N, 16 * kl.SHRINK_TILES + 1))


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
    x, A, B, y = _inputs(tuning.current().lora_max_m + 1, 64, 8, 16, torch.float32)
    with pytest.raises(ValueError, match=f"M <= {tuning.current().lora_max_m}"):
        lora_delta_(x, A, B, y, 1.0)
    x, A, B, y = _inputs(2, 64, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        lora_delta_(x, A[:, :32], B, y, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        lora_delta_(x, A, B, torch.zeros(16, 2).t(), 1.0)


@pytest.mark.interpreter
@pytest.mark.parametrize("M, C, R, dtype", [(1, 200, 8, torch.float32), (1, 3000, 40, torch.float32),
                                            (2, 520, 96, torch.float32), (1, 264, 32, torch.bfloat16)])
def test_row_shrink_is_x_at_a_transposed(M, C, R, dtype, monkeypatch):
    """row_shrink (whole rows a program) against float64: C not a power of two, R not a multiple of
    anything; and shrink() takes it to tuning's row_shrink_max_m rows and ROW_SHRINK_MAX_C columns,
    lora_shrink's chunks beyond."""
    g = torch.Generator().manual_seed(C)
    x, A = torch.randn(M, C, generator=g).to(dtype), (torch.randn(R, C, generator=g) / C ** 0.5).to(dtype)
    want = x.double() @ A.double().t()
    got = kl.row_shrink(x, A)
    assert got.shape == (1, M, R) and got.dtype == torch.float32
    torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-5)
    B = torch.zeros(16, R, dtype=dtype)
    rows, real = [], kl.row_shrink
    monkeypatch.setattr(kl, "row_shrink", lambda *a: rows.append(1) or real(*a))
    for limit, took in ((M, [1]), (M - 1, [1])):
        with tuning.using(dataclasses.replace(tuning.current(), row_shrink_max_m=limit)):
            torch.testing.assert_close(kl.shrink(x, A, B).sum(0).double(), want, rtol=1e-5, atol=1e-5)
        assert rows == took
    monkeypatch.setattr(kl, "ROW_SHRINK_MAX_C", C - 1)                      # a row too wide for one program
    with tuning.using(dataclasses.replace(tuning.current(), row_shrink_max_m=M)):
        torch.testing.assert_close(kl.shrink(x, A, B).sum(0).double(), want, rtol=1e-5, atol=1e-5)
    assert rows == [1]
    with pytest.raises(ValueError, match="do not fit"):
        kl.row_shrink(x, A[:, 1:])


@pytest.mark.interpreter
@pytest.mark.parametrize("M, I, R, split, dtype", [(1, 70, 8, 1, torch.float32), (5, 129, 40, 3, torch.float32),
                                                   (16, 64, 96, 1, torch.float32), (3, 200, 64, 2, torch.bfloat16),
                                                   (20, 90, 32, 1, torch.bfloat16)])
def test_expand_silu_mul_is_the_expand_then_silu_mul(M, I, R, split, dtype):
    """expand_silu_mul(hp, B, y, s) = silu(g)·u of y = [g, u] after y += s·(Σ hp)·Bᵀ: 1 to 3 partials
    of h summed, I and R not multiples of the tiles, y's rows wider than N (a strided view); y is not
    written. fp32 against float64 within 1e-5. bf16 (h, g and u rounded, silu rounded, the product
    rounded) has the bits of the two launches it replaces, lora_expand_ then fused_ops.silu_mul: a
    float64 reference cannot be tight there, as one bf16 step of a negative g moves silu(g) by that
    step relative."""
    gen = torch.Generator().manual_seed(M)
    hp = torch.randn(split, M, R, generator=gen)
    B = torch.randn(2 * I, R, generator=gen).to(dtype)
    wide = torch.randn(M, 2 * I + 5, generator=gen).to(dtype)
    y = wide[:, :2 * I]
    before = wide.clone()
    got = kl.expand_silu_mul(hp, B, y, 0.5)
    assert got.shape == (M, I) and got.dtype == dtype and torch.equal(wide, before)
    if dtype == torch.float32:
        gu = y.double() + 0.5 * hp.sum(0).double() @ B.double().t()
        torch.testing.assert_close(got.double(), gu[:, :I] * torch.sigmoid(gu[:, :I]) * gu[:, I:],
                                   rtol=1e-5, atol=1e-5)
    else:
        gu = kl.lora_expand_(hp, B, y.clone(), 0.5)
        assert torch.equal(got, fused_ops.silu_mul(gu[:, :I], gu[:, I:]))
    with pytest.raises(ValueError, match="do not fit"):
        kl.expand_silu_mul(hp, B[:-1], y[:, :-1], 0.5)
    with pytest.raises(ValueError, match="one dtype"):
        kl.expand_silu_mul(hp, B.double(), y, 0.5)


@pytest.mark.interpreter
@pytest.mark.parametrize("M, R, cuts, N", [(1, 24, (40, 56), 72), (5, 64, (70, 140), 140), (16, 96, (64, 80), 96),
                                           (3, 48, (8, 100), 129)])
def test_expand_of_a_compact_group_reads_each_members_ranks(M, R, cuts, N):
    """lora_expand_ and expand_silu_mul with a group's compact B (N, R / parts) and its cuts: column n
    gets h's ranks of its own member only, the sum of block_diagonal(B)'s products, against float64
    (fp32, tiles straddling members, a member smaller than a tile, two members with N2 = N); a B whose
    width does not share h's ranks evenly over the parts is refused."""
    from nvfp4_cases import block_diagonal
    gen = torch.Generator().manual_seed(M + R)
    hp = torch.randn(2, M, R, generator=gen)
    B = torch.randn(N, R // gemm.lora_parts(cuts, N), generator=gen)
    y = torch.randn(M, N, generator=gen)
    want = y.double() + 0.5 * hp.sum(0).double() @ block_diagonal(B, cuts, R).double().t()
    got = kl.lora_expand_(hp, B, y.clone(), 0.5, cuts=cuts)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    if N % 2 == 0 and cuts[0] == N // 2:                                  # gate/up: two members, halves
        I = N // 2
        silu = kl.expand_silu_mul(hp, B, y, 0.5, cuts=cuts)
        torch.testing.assert_close(silu.double(), want[:, :I] * torch.sigmoid(want[:, :I]) * want[:, I:],
                                   rtol=1e-5, atol=1e-5)
    elif N % 2 == 0:                                                     # members that are not gate and up
        with pytest.raises(ValueError, match="gate's and up's halves"):
            kl.expand_silu_mul(hp, B, y, 0.5, cuts=cuts)
    with pytest.raises(ValueError, match="does not fit"):
        kl.lora_expand_(hp, B[:, :-1], y.clone(), 0.5, cuts=cuts)


def test_group_casts_are_compact_where_the_members_share_a_rank():
    """group_casts: members of one rank give A stacked and B (Σ out, r), each member's rows its own
    lora_B, with the cuts where the first two end; members of different ranks give the block-diagonal
    B and no cuts. The torch path of group_update (no kernels: the CPU) with either adds each member's
    own update, against float64 of each adapter apart."""
    import lora
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, generator=gen)
    for ranks, compact in (((4, 4, 4), True), ((4, 8, 4), False), ((4, 4), True)):
        bases = [torch.nn.Linear(32, n, bias=False) for n in (24, 8, 16)[:len(ranks)]]
        mods = [lora.LoRALinear(b, r=r, alpha=2 * r) for b, r in zip(bases, ranks)]   # one scaling
        for m in mods:
            torch.nn.init.normal_(m.lora_B, std=0.5, generator=gen)
            m.eval()
        holder = type("Holder", (), {"lora_casts": None})()
        with torch.no_grad():
            A, B, cuts = kl.group_casts(holder, mods, x)
            y0 = torch.cat([b(x) for b in bases], -1)
            got = kl.group_update(holder, mods, x, lambda: y0.clone())
        assert torch.equal(A, torch.cat([m.lora_A for m in mods]))
        if compact:
            assert B.shape == (sum(b.out_features for b in bases), 4)
            assert torch.equal(B, torch.cat([m.lora_B for m in mods]))
            assert cuts == (24, 32)
        else:
            assert cuts is None and torch.equal(B, torch.block_diag(*[m.lora_B for m in mods]))
        want = torch.cat([(b(x) + m.scaling * (x @ m.lora_A.t()) @ m.lora_B.t()).double()
                          for b, m in zip(bases, mods)], -1)
        check_close(got, want, 1e-5, f"group_update, ranks {ranks}")


def test_a_fold_whose_b_does_not_fit_its_cuts_is_refused():
    """gemm.matmul's lora check: cuts past N, cuts out of order, a B wider or narrower than h's ranks
    over the members the cuts make: a ValueError before any launch."""
    N, K = 64, 128
    w = torch.zeros(N, K // 2, dtype=torch.uint8), torch.zeros(N, K // 16, dtype=torch.float8_e4m3fn), torch.ones(1)
    x, hp = torch.zeros(1, K, dtype=torch.bfloat16), torch.zeros(1, 1, 24)
    for width, cuts in ((8, (70, 80)), (8, (48, 32)), (16, (32, 48)), (24, (32, 48)), (12, None)):
        with pytest.raises(ValueError, match="does not fit"):
            gemm.matmul(x, *w, lora=gemm.Fold(hp, torch.zeros(N, width, dtype=torch.bfloat16), 1.0, cuts=cuts))


@pytest.mark.interpreter
@pytest.mark.parametrize("M, C, R, residual, dtype", [(1, 200, 8, True, torch.float32),
                                                      (5, 300, 40, False, torch.float32),
                                                      (16, 520, 160, True, torch.float32),
                                                      (3, 264, 96, True, torch.bfloat16)])
def test_norm_shrink_rows_is_the_norm_and_its_shrink(M, C, R, residual, dtype):
    """One launch gives RMSNorm(x + residual), the rounded sum and h = y Aᵀ: y and the sum are the
    norm kernel's bits (fused_ops.rms_norm) and within rounding of the trunk's torch norm
    (ops._rms_norm), h the float64 product of that y; rank rows in 16-row tiles, R not always a
    multiple of them, so the columns each program stores are uneven shares too. bf16: within a step
    or two (the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest)."""
    import ops
    g = torch.Generator().manual_seed(M)
    x, r = torch.randn(M, C, generator=g).to(dtype), torch.randn(M, C, generator=g).to(dtype)
    w = 1 + 0.1 * torch.randn(C, generator=g)                                  # fp32, as RMSNorm's weight
    A = (torch.randn(R, C, generator=g) / C ** 0.5).to(dtype)
    y, total, hp = kl.norm_shrink_rows(x, w, 1e-6, r if residual else None, A)
    kernel = fused_ops.rms_norm(x, w, 1e-6, r if residual else None)
    want = ops._rms_norm(x, w, 1e-6, r if residual else None)
    (kernel_y, kernel_sum), (want_y, want_sum) = (t if residual else (t, None) for t in (kernel, want))
    assert torch.equal(y, kernel_y)
    step = 2.0 ** -6 if dtype == torch.bfloat16 else 1e-6
    if residual:
        assert torch.equal(total, kernel_sum)
        assert torch.equal(total, want_sum) if dtype == torch.float32 else (
            (total.double() - want_sum.double()).abs() <= step * want_sum.double().abs()).all()
    else:
        assert total is None
    assert ((y.double() - want_y.double()).abs() <= step * want_y.double().abs() + 1e-7).all()
    assert hp.shape == (1, M, R)
    h = y.double() @ A.double().t()                                           # (M, R)
    check_close(hp[0], h, 1e-6 * h.abs().max().item(), "h = norm(x) Aᵀ")


@pytest.mark.interpreter
def test_decode_norms_run_their_groups_shrink(tiny_hf_dir, monkeypatch):
    """A decode forward of an NVFP4 model with adapters (the kernels' rows, on the CPU): the norm
    before q/k/v and the one before gate/up run their group's shrink (norm_shrink_rows), so the shrink
    runs for o and down alone (tuning's norm_shrink_max_m raised to the two rows), carried by the
    launch that adds the update (carried_shrink: here the expand kernel, as the activations are fp32);
    at tuning's defaults every shrink at two rows is carried, and with carry_shrink off each is a
    launch of its own. The logits of all three equal the training forward's."""
    from checkpoint import load_model
    from conftest import rel_err
    from lora import LoRAConfig, apply_lora, lora_modules
    model = load_model(tiny_hf_dir("qwen2")[0], quant="nvfp4", device="cpu", dtype=torch.float32)
    apply_lora(model, LoRAConfig(r=4, alpha=8))
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.normal_(0, 0.1)
    monkeypatch.setattr(kernels, "runs", lambda x: not torch.is_grad_enabled())
    monkeypatch.setattr(kl, "_decode_kernels", lambda x2: not torch.is_grad_enabled() and x2.shape[0] <= 16)
    launched = {"norm": 0, "shrink": 0, "carried": 0}
    for name, key in (("norm_shrink_rows", "norm"), ("lora_shrink", "shrink"), ("carried_shrink", "carried")):
        real = getattr(kl, name)
        monkeypatch.setattr(kl, name, lambda *a, _real=real, _key=key: launched.__setitem__(
            _key, launched[_key] + 1) or _real(*a))
    ids, pos = torch.tensor([[5], [9]]), torch.tensor([[3], [7]])             # two decode rows
    layers = model.config.num_layers
    with torch.no_grad():
        with tuning.using(dataclasses.replace(tuning.current(), norm_shrink_max_m=2)):
            fused = model(ids, pos)
        assert launched == {"norm": 2 * layers, "shrink": 0, "carried": 2 * layers}
        carried = model(ids, pos)                       # tuning's default: the norm's shrink at one row only
        assert launched == {"norm": 2 * layers, "shrink": 0, "carried": 6 * layers}
        with tuning.using(dataclasses.replace(tuning.current(), carry_shrink=False)):
            apart = model(ids, pos)
        assert launched == {"norm": 2 * layers, "shrink": 4 * layers, "carried": 6 * layers}
    with torch.enable_grad():
        trained = model(ids, pos)
    assert all(rel_err(out, trained) < 1e-5 for out in (fused, carried, apart))
    assert all(getattr(p, "stacked").lora_h is None for layer in model.model.layers
               for p in (layer.self_attn, layer.mlp))                         # every pending h was taken


def test_early_shrink_on_nvfp4_bases_and_where_the_expand_folds():
    """The shrink goes before the base matmul on an NVFP4 base (any rows), never on a dense base; the
    base kernel then folds the expand in for bf16 rows where gemm.folds_lora holds for the product
    (here, without the register-A kernel: every decode row; the fragment kernel's rows, 2..16 at K a
    multiple of 128), never for fp32 activations."""
    import nvfp4
    q, dense = nvfp4.NVFP4Linear(128, 32), torch.nn.Linear(64, 32)
    B = torch.zeros(32, 8, dtype=torch.bfloat16)
    assert kl.early_shrink(q) and kl.early_shrink(nvfp4.NVFP4Linear(64, 32)) and not kl.early_shrink(dense)
    rows = [torch.zeros(m, 128, dtype=torch.bfloat16) for m in (1, 2, 16, 17)]
    assert [kl.fold_expand(q, x2, B) for x2 in rows] == [True, True, True, False]
    assert kl.fold_expand(nvfp4.NVFP4Linear(64, 32), torch.zeros(2, 64, dtype=torch.bfloat16), B)
    assert not kl.fold_expand(q, torch.zeros(1, 128), B)                  # fp32 activations


def test_group_casts_follow_the_members_ranks_not_only_the_shapes():
    """group_casts on one holder: the group's stacked A and block-diagonal B; the members' ranks
    reshuffled with every shape alike (a rank pattern loaded anew) give the new block-diagonal, no
    block of the old one left in its zeros."""
    import lora
    gen = torch.Generator().manual_seed(0)
    x = torch.zeros(2, 32)
    holder = type("Holder", (), {"lora_casts": None})()
    bases = [torch.nn.Linear(32, 8, bias=False) for _ in range(3)]
    for ranks in ((4, 8, 4), (8, 4, 4)):
        mods = [lora.LoRALinear(b, r=r, alpha=2 * r) for b, r in zip(bases, ranks)]
        for m in mods:
            torch.nn.init.normal_(m.lora_B, std=0.5, generator=gen)
        A, B, cuts = kl.group_casts(holder, mods, x)
        assert cuts is None and torch.equal(A, torch.cat([m.lora_A for m in mods])), ranks
        assert torch.equal(B, torch.block_diag(*[m.lora_B for m in mods])), ranks


def test_lora_linear_off_the_kernels_is_base_plus_the_addmm():
    """Where the kernels do not run (the CPU here), lora_linear is base(x) + s·F.linear(x, A)Bᵀ: the
    torch path, against float64, on a 3-D x."""
    g = torch.Generator().manual_seed(4)
    base = torch.nn.Linear(32, 24)
    x, A, B = torch.randn(2, 3, 32, generator=g), torch.randn(4, 32, generator=g), torch.randn(24, 4, generator=g)
    with torch.no_grad():
        got = kernels.lora_linear(x, base, A, B, 0.5)
        want = base(x).double() + 0.5 * (x.double() @ A.double().t()) @ B.double().t()
    check_close(got, want, 1e-5, "lora_linear on the CPU")


def _adapters(bases, r=16, alpha=32):
    import lora
    mods = [lora.LoRALinear(b, r=r, alpha=alpha) for b in bases]
    for m in mods:
        torch.nn.init.normal_(m.lora_B, std=0.02)
        m.eval()
    return mods


def _group_ab(mods, dtype):
    """The group's stacked A and block-diagonal B, built here independently of group_casts."""
    A = torch.cat([m.lora_A.detach() for m in mods]).to(dtype)
    B = torch.block_diag(*[m.lora_B.detach() for m in mods]).to(dtype)
    return A, B


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 16, 32])
def test_gpu_lora_linear_kernels_match_the_torch_path(rows, monkeypatch):
    """bf16 on CUDA: a single adapter (lora_linear) and a q/k/v-like group (group_update, one stacked
    A and a compact B, group_casts) give the torch path's output within bf16 rounding, and use the kernels."""
    torch.manual_seed(0)
    mods = _adapters([torch.nn.Linear(512, n, bias=False).cuda().bfloat16() for n in (512, 128, 128)])
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(rows, 768, device="cuda", dtype=torch.bfloat16)
    A0, B0 = (t.detach().bfloat16() for t in (mods[0].lora_A, mods[0].lora_B))
    holder = type("Holder", (), {"lora_casts": None})()
    calls = []
    real = kl.lora_expand_
    monkeypatch.setattr(kl, "lora_expand_", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        got_fwd = kernels.lora_linear(x, mods[0].base_layer, A0, B0, mods[0].scaling)   # base, then shrink, expand
        got_group = kl.group_update(holder, mods, x, lambda: y.clone())
        monkeypatch.setattr(kl, "_decode_kernels", lambda x2: False)
        want_fwd = kernels.lora_linear(x, mods[0].base_layer, A0, B0, mods[0].scaling)
        want_group = kl.group_update(holder, mods, x, lambda: y.clone())
        A, B = _group_ab(mods, torch.bfloat16)
        exact = y.double() + mods[0].scaling * (x.double() @ A.double().t()) @ B.double().t()
    assert calls == [1, 1]                               # bf16 bases: the expand kernel after cuBLAS
    for got, want in ((got_fwd, want_fwd), (got_group, want_group)):
        assert (got.float() - want.float()).abs().max() <= 2 * want.float().abs().max() * 2 ** -8
    assert (got_group.double() - exact).abs().max() <= 2 * exact.abs().max() * 2 ** -8


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4, 16])
def test_gpu_nvfp4_base_folds_the_expand_into_the_base_kernel(rows, monkeypatch):
    """On an NVFP4 base the GEMV's row (1) gets the update from the base kernel itself (fold_expand:
    no expand launch), and so do the fragment kernel's rows (2..16 here, K = 512); a single adapter (lora_linear) and a q/k/v-like
    group over a model.Stack give the torch path within bf16 rounding on every route, and a
    non-contiguous x the same bits as a contiguous one (the matmul reads x before its wait on the shrink)."""
    import nvfp4
    from kernels import stacked
    from model import Stack
    torch.manual_seed(0)
    g = torch.tensor([448.0 * 6 / 0.2], device="cuda")                 # one global scale for the group
    bases = [nvfp4.NVFP4Linear.from_weight(torch.randn(n, 512, device="cuda", dtype=torch.bfloat16) * 0.05,
                                           torch.randn(n, device="cuda", dtype=torch.bfloat16), global_scale=g)
             for n in (512, 128, 128)]
    mods = _adapters(bases)
    stack = Stack(bases)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    A0, B0 = (t.detach().bfloat16() for t in (mods[0].lora_A, mods[0].lora_B))
    calls = []
    real = kl.lora_expand_
    monkeypatch.setattr(kl, "lora_expand_", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        got_fwd = kernels.lora_linear(x, bases[0], A0, B0, mods[0].scaling)
        got_group = kl.group_update(stack, mods, x, lambda **kw: stacked.matmul(stack, x, **kw))
        strided = torch.stack([x, torch.zeros_like(x)], -1)[..., 0]   # x's values, not contiguous
        got_strided = kernels.lora_linear(strided, bases[0], A0, B0, mods[0].scaling)
        monkeypatch.setattr(kl, "_decode_kernels", lambda x2: False)
        want_fwd = kernels.lora_linear(x, bases[0], A0, B0, mods[0].scaling)
        want_group = kl.group_update(stack, mods, x, lambda **kw: stacked.matmul(stack, x, **kw))
    assert not calls and not strided.is_contiguous() and torch.equal(got_strided, got_fwd)
    for got, want in ((got_fwd, want_fwd), (got_group, want_group)):
        assert (got.float() - want.float()).abs().max() <= 2 * want.float().abs().max() * 2 ** -8


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 8, 16, 32])
@pytest.mark.parametrize("name", ["qkv", "gate_up", "down"])
def test_gpu_7b_decode_folds_match_the_expand_kernel(name, rows, monkeypatch):
    """Qwen2.5-7B's adapted projections at decode, as train.py's rank-32 adapters run them: q/k/v as
    one group (4608 x 3584, R = 96), gate/up (37888 x 3584, R = 64), down alone (3584 x 18944, R = 32).
    Where gemm.folds_lora holds (the fragment kernel's last split or the reduce kernel after it, the
    register-A route's reduce) no expand kernel runs, elsewhere (gate_up beside an unsplit register-A
    launch) it does; either way the result is lora_delta_ on the unfolded matmul's y within one bf16
    step everywhere (both add the same fp32 update to the same bf16 y and round once)."""
    import nvfp4
    from kernels import stacked
    from model import Stack
    sizes, K = {"qkv": ((3584, 512, 512), 3584), "gate_up": ((18944, 18944), 3584), "down": ((3584,), 18944)}[name]
    torch.manual_seed(rows)
    g = torch.tensor([448.0 * 6 / 0.1], device="cuda")
    bases = [nvfp4.NVFP4Linear.from_weight(torch.randn(n, K, device="cuda", dtype=torch.bfloat16) * 0.02,
                                           global_scale=g) for n in sizes]
    mods = _adapters(bases, r=32, alpha=64)
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    A, B = _group_ab(mods, torch.bfloat16)                                # (R, K), (N, R)
    stack = Stack(bases) if len(bases) > 1 else None
    calls, real = [], kl.lora_expand_
    monkeypatch.setattr(kl, "lora_expand_", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        if stack is not None:
            got = kl.group_update(stack, mods, x, lambda **kw: stacked.matmul(stack, x, **kw))
            base = stacked.matmul(stack, x)                                # (rows, N): the unfolded matmul
        else:
            got = kernels.lora_linear(x, bases[0], A, B, mods[0].scaling)
            base = bases[0](x)
        assert calls == ([] if gemm.folds_lora(rows, B.shape[0], K, x.device, bases[0].interleaved) else [1])
        want = lora_delta_(x, A, B, base.clone(), mods[0].scaling)
    err = (got.double() - want.double()).abs()
    step = 2.0 ** -7 * torch.maximum(got.double().abs(), want.double().abs())    # one bf16 step of the larger
    assert (err <= step + 1e-6).all(), f"{name} rows={rows}: {(err > step + 1e-6).sum().item()} elements off"
    assert (got.double() - base.double()).abs().max() > 0.01, "the update is not zero"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 8, 16, 32])
def test_gpu_7b_gate_up_expand_runs_silu_mul_in_its_launch(rows, monkeypatch):
    """Qwen2.5-7B's gate/up with train.py's rank-32 adapters at 2-16 decode rows, where the register-A
    matmul stores y itself: project(silu_mul=True) runs one expand_silu_mul launch and neither the
    expand kernel nor the SiLU·mul kernel, and its result has the bits of the two launches (the
    shrink, the unfolded matmul, lora_expand_, fused_ops.silu_mul)."""
    import nvfp4
    from kernels import stacked
    from model import Stack
    torch.manual_seed(rows)
    g = torch.tensor([448.0 * 6 / 0.1], device="cuda")
    bases = [nvfp4.NVFP4Linear.from_weight(torch.randn(18944, 3584, device="cuda", dtype=torch.bfloat16) * 0.02,
                                           global_scale=g).interleave_() for _ in range(2)]
    mods = _adapters(bases, r=32, alpha=64)
    stack = Stack(bases)
    x = torch.randn(rows, 3584, device="cuda", dtype=torch.bfloat16)
    A, B = _group_ab(mods, torch.bfloat16)
    if gemm.folds_lora(rows, B.shape[0], 3584, x.device, True):
        pytest.skip("gate/up folds its update into the matmul here: no expand launch to fuse")
    calls = []
    for name in ("lora_expand_", "expand_silu_mul"):
        real = getattr(kl, name)
        monkeypatch.setattr(kl, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    real_silu = fused_ops.silu_mul
    monkeypatch.setattr(fused_ops, "silu_mul", lambda *a: calls.append("silu_mul") or real_silu(*a))
    with torch.no_grad():
        got = kernels.project(stack, mods, x, True, True)
        assert calls == ["expand_silu_mul"]
        y = kl.lora_expand_(kl.lora_shrink(x, A, B), B, stacked.matmul(stack, x), mods[0].scaling)
        want = real_silu(*y.split(18944, -1))
    assert torch.equal(got, want)
    assert (got.double() - real_silu(*stacked.matmul(stack, x).split(18944, -1)).double()).abs().max() > 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8, 32])
def test_gpu_carried_shrinks_replay_in_a_cuda_graph(rows, monkeypatch):
    """Qwen2.5-7B's MLP at decode with train.py's rank-32 adapters, as a decode graph runs it: gate/up
    (the register-A matmul, then the expand launch with SiLU·mul carrying the group's shrink) and down
    (a split launch whose reduce carries its shrink), captured in one CUDA graph and replayed on fresh
    rows of x, each set twice: every replay has the bits of the eager call on the same rows (each launch
    leaves its flags zero for the next, and the graph's launches take the flag slots in turn)."""
    import nvfp4
    from model import Stack
    torch.manual_seed(rows)
    g = torch.tensor([448.0 * 6 / 0.1], device="cuda")

    def base(n, k):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        return nvfp4.NVFP4Linear.from_weight(w, global_scale=g).interleave_()

    gate_up, down = [base(18944, 3584) for _ in range(2)], base(3584, 18944)
    mods, (down_mod,) = _adapters(gate_up, r=32, alpha=64), _adapters([down], r=32, alpha=64)
    stack = Stack(gate_up)
    A, B = (t.detach().to(torch.bfloat16) for t in (down_mod.lora_A, down_mod.lora_B))
    carried, real = [], kl.carried_shrink
    monkeypatch.setattr(kl, "carried_shrink", lambda *a: carried.append(1) or real(*a))

    def mlp(x):
        h = kernels.project(stack, mods, x, True, False)                     # silu(gate)·up (rows, 18944)
        return kernels.lora_linear(h, down, A, B, down_mod.scaling)           # (rows, 3584)

    xs = [torch.randn(rows, 3584, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    with torch.no_grad():
        kernels.project(stack, mods, xs[0], True, True)                     # the group's casts, once
        carried.clear()
        want = [mlp(x) for x in xs]
        assert len(carried) == 2 * len(xs)                                  # gate/up's and down's shrinks
        x_in = xs[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            mlp(x_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mlp(x_in)
        for x, w in zip(xs + xs, want + want):
            x_in.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, w)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 8, 16])
@pytest.mark.parametrize("name", ["qkv", "gate_up"])
def test_gpu_norm_shrink_feeds_the_groups_fold(name, rows, monkeypatch):
    """Qwen2.5-7B's q/k/v and gate/up (SiLU·mul) after their norm at decode, with train.py's rank-32
    adapters: the norm's launch runs the group's shrink (kernels.rms_norm given the group; rows beyond
    tuning's default norm_shrink_max_m too, the kernel being the same), the
    matmul after it folds those partials, waiting before it reads x (gemm.Fold's x_fresh), and no
    shrink runs elsewhere. Against the norm kernel, then the group with its own shrink (a launch, or
    carried by the launch that folds: kernels.lora.carries): the sum and y
    have the same bits (the same sum of squares), and the group's output is within two bf16 steps of
    the larger (the update's partials are summed in another order)."""
    import nvfp4
    from model import Stack
    sizes, K = {"qkv": ((3584, 512, 512), 3584), "gate_up": ((18944, 18944), 3584)}[name]
    torch.manual_seed(rows)
    g = torch.tensor([448.0 * 6 / 0.1], device="cuda")
    bases = [nvfp4.NVFP4Linear.from_weight(torch.randn(n, K, device="cuda", dtype=torch.bfloat16) * 0.02,
                                           global_scale=g).interleave_() for n in sizes]
    mods = _adapters(bases, r=32, alpha=64)
    stack = Stack(bases)
    x, r = (torch.randn(rows, K, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = 1 + 0.1 * torch.randn(K, device="cuda")
    silu = name == "gate_up"
    shrinks = []
    for fn in ("shrink", "carried_shrink"):      # a shrink launch, or a shrink in the launch that folds
        monkeypatch.setattr(kl, fn, lambda *a, _real=getattr(kl, fn): shrinks.append(1) or _real(*a))
    with torch.no_grad(), tuning.using(dataclasses.replace(tuning.current(), norm_shrink_max_m=16)):
        y, total = kernels.rms_norm(x, w, 1e-6, r, group=(stack, mods, True))
        got = kernels.project(stack, mods, y, silu, True)
        assert not shrinks and stack.lora_h is None
        want_y, want_total = fused_ops.rms_norm(x, w, 1e-6, r)
        want = kernels.project(stack, mods, want_y, silu, True)
        assert shrinks == [1]
    got, want = (torch.cat(t, -1) if isinstance(t, list) else t for t in (got, want))
    assert torch.equal(total, want_total) and torch.equal(y, want_y)
    err = (got.double() - want.double()).abs()
    step = 2.0 ** -7 * torch.maximum(got.double().abs(), want.double().abs())
    assert (err <= 2 * step + 1e-3).all(), f"{name} rows={rows}: {(err > 2 * step + 1e-3).sum().item()} elements off"


@pytest.mark.gpu
@pytest.mark.parametrize("M", [64, 128])
def test_gpu_grpo_rows_fold_the_update_into_the_split_k_reduce(M, monkeypatch):
    """At the GRPO batch the register-A route (7B o_proj's shape) splits K, and its reduce kernel adds
    s·h·Bᵀ (fold_in_reduce): no addmm after the matmul, and it ran (a spy on gemm._reduce). Against
    float64 on the same base output and h: within one bf16 step everywhere (the update is added in
    fp32 and rounded once; the addmm path it replaces misses by more than a step on some outputs)."""
    from nvfp4 import NVFP4Linear
    torch.manual_seed(0)
    base = NVFP4Linear.from_weight(torch.randn(3584, 3584, device="cuda") * 0.02).interleave_()
    m = _adapters([base], r=32, alpha=64)[0]
    x = torch.randn(M, 3584, device="cuda", dtype=torch.bfloat16)
    if not gemm.reduce_folds_lora(M, 3584, 3584, x.device, True):
        pytest.skip("the register-A route does not run here (sm_90 with triton 3.6)")
    seen, real = [], gemm._reduce
    monkeypatch.setattr(gemm, "_reduce", lambda *a: seen.append(len(a) > 4 and a[4] is not None) or real(*a))
    A, B = (t.detach().bfloat16() for t in (m.lora_A, m.lora_B))
    with torch.inference_mode():
        got = kernels.lora_linear(x, base, A, B, m.scaling)
        want = base(x).double() + m.scaling * F.linear(x, A).double() @ B.double().t()
    assert seen == [True, False]
    err = (got.double() - want).abs()
    step = 2.0 ** -7 * torch.maximum(got.double().abs(), want.abs())      # one bf16 step of the larger
    assert (err <= step + 1e-6).all(), f"M={M}: {(err > step + 1e-6).sum().item()} elements off"
    assert (got.double() - base(x).double()).abs().max() > 0.1, "the update is not zero"


def test_tuning_moves_the_kernels_row_limit():
    """lora_max_m is where the kernels stop taking rows: a smaller one makes lora_delta_ refuse a
    batch it took."""
    x, A, B, y = _inputs(8, 64, 8, 16, torch.float32)
    with tuning.using(dataclasses.replace(tuning.current(), lora_max_m=4)):
        with pytest.raises(ValueError, match="M <= 4"):
            lora_delta_(x, A, B, y, 1.0)
