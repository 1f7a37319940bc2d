"""Tests for kernels/paged_decode.py: the Triton KV-store, RoPE + KV-store and paged-decode kernels
against attention.py's torch references (interpreter on CPU: GQA, scattered block tables, partitions
that tiles do not divide, an empty row, non-contiguous k/v), the partition choice, and GPU-marked bf16
checks at 7B head shapes. The kernels inside the engine are tested in tests/test_rollout.py."""
import dataclasses
import os

import pytest
import torch

import kernels
from attention import paged_attention_ref, store_kv_ref
from kernels import tuning
from kernels.fused_ops import rope
from kernels.paged_decode import attend, cache_table, partition, place_caches, store_kv


def apply_rope(x, cos, sin):
    """The torch reference: pairs (i, i + D/2) rotated in fp32, rounded back once."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernels (TRITON_INTERPRET=1 on CPU) against the torch reference

def _place(k_cache, v_cache):
    """The row of a one-layer cache table pointing at k_cache, v_cache (num_blocks, bs, Hkv, D)."""
    table = cache_table(1, k_cache.device)
    place_caches(table, k_cache[None], v_cache[None])
    return table[0]


def _random_paged(B, Hq, Hkv, D, bs, num_blocks, ctx_lens, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g).to(device, dtype)
    k_cache = torch.randn(num_blocks, bs, Hkv, D, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, bs, Hkv, D, generator=g).to(device, dtype)
    width = max(-(-n // bs) for n in ctx_lens)
    perm = torch.randperm(num_blocks, generator=g)        # scattered, non-contiguous block tables
    tables = perm[:B * width].view(B, width).to(device, torch.int32)
    return q, k_cache, v_cache, tables, torch.tensor(ctx_lens, dtype=torch.int32, device=device)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partition, tile, merge", [(32, 16, True), (32, 64, False), (64, 64, None),
                                                   (48, 64, True), (16, 16, True), (16, 16, False),
                                                   (256, 128, None)])
def test_paged_attention_kernel_matches_reference(dtype, partition, tile, merge):
    # GQA 6/2 (G=3, padded to 16), contexts spanning 1..9 partitions, one empty row; tiles of one
    # block, of several blocks, and (48, 64 -> 32) not dividing the partition; partitions merged by
    # the last program of each (row, kv head) (8 at a time: 9 partitions of 16 take two passes), which
    # leaves the counts at zero, or by the merge kernel; the first tile loaded before the PDL wait
    # (tiles up to tuning's early_max_tile: 16 and 64 here) or in the loop (128)
    ctx = [1, 17, 40, 0, 140]
    q, kc, vc, tables, lens = _random_paged(5, 6, 2, 16, 16, 48, ctx, dtype)
    ref = paged_attention_ref(q, kc, vc, tables, lens, 0.25)
    counts = torch.zeros(5, 2, dtype=torch.int32)
    out = attend(q, kc, vc, tables, lens, 0.25, num_parts=-(-160 // partition), counts=counts, place=_place(kc, vc),
                                 partition_size=partition, tile=tile, merge_in_kernel=merge)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (out.float() - ref.float()).abs()
    assert err.max() < tol, f"max err {err.max():.2e} mean {err.mean():.2e}"
    assert torch.all(out[3] == 0) and torch.all(counts == 0)


@pytest.mark.interpreter
def test_a_context_past_the_partitions_does_not_break_later_calls():
    """A context longer than num_parts * partition_size breaks the contract, but the counts must
    still come back to zero so that the next (valid) call merges correctly."""
    q, kc, vc, tables, lens = _random_paged(2, 4, 2, 16, 16, 16, [100, 20], torch.float32)
    counts = torch.zeros(2, 2, dtype=torch.int32)
    attend(q, kc, vc, tables, lens, 0.25, num_parts=2, counts=counts, place=_place(kc, vc), partition_size=16,
                           merge_in_kernel=True)                     # 100 > 2 x 16
    assert torch.all(counts == 0)
    ok = torch.tensor([30, 20], dtype=torch.int32)
    out = attend(q, kc, vc, tables, ok, 0.25, num_parts=2, counts=counts, place=_place(kc, vc), partition_size=16,
                                 merge_in_kernel=True)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, tables, ok, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_paged_attention_kernel_rejects_bad_counts():
    q, kc, vc, tables, lens = _random_paged(2, 4, 2, 16, 16, 8, [5, 9], torch.float32)
    for counts in (torch.zeros(1, 2, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int64),
                   torch.zeros(2, 3, dtype=torch.int32)):
        with pytest.raises(ValueError, match="counts"):
            attend(q, kc, vc, tables, lens, 0.25, num_parts=4, counts=counts, place=_place(kc, vc), partition_size=16)


@pytest.mark.interpreter
def test_store_kv_kernel_matches_reference():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(6, 2, 16, generator=g)[:, :, :]
    v = torch.randn(6, 2, 16, generator=g)
    slots = torch.tensor([5, 0, -1, 17, 31, 8])
    caches = [torch.randn(4, 8, 2, 16, generator=g) for _ in range(2)]
    ref = [c.clone() for c in caches]
    store_kv_ref(ref[0], ref[1], k, v, slots)
    store_kv(caches[0], caches[1], k, v, slots, _place(caches[0], caches[1]))
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])
    # a non-contiguous view (k sliced out of a fused qkv row) also works
    qkv = torch.randn(6, 2, 48, generator=g)
    store_kv(caches[0], caches[1], qkv[..., 16:32], qkv[..., 32:], slots, _place(caches[0], caches[1]))
    store_kv_ref(ref[0], ref[1], qkv[..., 16:32], qkv[..., 32:], slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])


@pytest.mark.interpreter
def test_the_kernels_reach_the_caches_through_the_table():
    """What a CUDA graph relies on: the kernels read and write the caches where the table row says,
    whatever tensors they are handed for the shape. With the row pointing at a second pair of
    caches (layer 1 of two, as the sampler's (L, ...) caches are laid out), the store lands there
    and attention reads there, against the torch reference on that pair; the first pair is left as
    it was."""
    q, kc, vc, tables, lens = _random_paged(3, 4, 2, 16, 16, 12, [5, 40, 17], torch.float32)
    other = tuple(torch.stack([torch.randn_like(c), torch.randn_like(c)]) for c in (kc, vc))   # (2, ...) each
    table = cache_table(2, "cpu")
    place_caches(table, *other)
    before = kc.clone(), vc.clone()
    k, v = torch.randn(2, 3, 2, 16).unbind(0)
    slots = torch.tensor([4, 39, -1])
    want = other[0][1].clone(), other[1][1].clone()
    store_kv_ref(*want, k, v, slots)
    store_kv(kc, vc, k, v, slots, table[1])
    assert torch.equal(other[0][1], want[0]) and torch.equal(other[1][1], want[1])
    counts = torch.zeros(3, 2, dtype=torch.int32)
    out = attend(q, kc, vc, tables, lens, 0.25, num_parts=4, counts=counts, place=table[1], partition_size=16)
    torch.testing.assert_close(out, paged_attention_ref(q, *want, tables, lens, 0.25), rtol=1e-5, atol=1e-5)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_place_caches_rejects_what_the_kernels_cannot_reach():
    """A table of another layer count, caches of two dtypes, or a cache off 16-byte alignment (the
    kernels load 16 bytes at once) is refused, naming the problem; so is a place that is not a table row."""
    kc = torch.zeros(2, 4, 16, 2, 16)
    with pytest.raises(ValueError, match="3 layers"):
        place_caches(cache_table(3, "cpu"), kc, kc.clone())
    with pytest.raises(ValueError, match="one dtype"):
        place_caches(cache_table(2, "cpu"), kc, kc.double())
    shifted = torch.zeros(kc.numel() + 1)[1:].view(kc.shape)                  # 4 bytes off
    with pytest.raises(ValueError, match="16-byte aligned"):
        place_caches(cache_table(2, "cpu"), shifted, kc)
    q, kc, vc, tables, lens = _random_paged(2, 4, 2, 16, 16, 8, [5, 9], torch.float32)
    with pytest.raises(ValueError, match="row of cache_table"):
        attend(q, kc, vc, tables, lens, 0.25, num_parts=4, counts=torch.zeros(2, 2, dtype=torch.int32),
               place=cache_table(2, "cpu"), partition_size=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partition, merge", [(16, True), (16, False), (64, None)])
def test_attention_with_rope_equals_rope_then_store_then_attention(dtype, partition, merge):
    """Decode's one launch, attend(rope=...): q rotated in registers, k rotated
    into its slot and v stored beside it by the program whose partition holds the new token,
    which adds them to its softmax from registers. Against fused_ops.rope, store_kv and the kernel
    without rope: the same cache bits, and the output within a rounding or two (the
    new token's score is summed in another order); against the torch rotation + the torch reference
    within tolerance. q, k, v are column slices of one row per sequence, as the stacked q/k/v
    matmul leaves them, and stay untouched; row 3 is CUDA-graph padding (context 0, slot -1)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"        # on CPU: the Triton interpreter
    seed = int.from_bytes(os.urandom(4), "little")
    B, Hq, Hkv, D, bs = 5, 6, 2, 16, 16
    ctx = [1, 17, 40, 0, 140]
    _, kc, vc, tables, lens = _random_paged(B, Hq, Hkv, D, bs, 48, ctx, dtype, dev, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(B, 1, (Hq + 2 * Hkv) * D, generator=g).to(dev, dtype)
    q, k, v = (t.view(B, 1, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], -1))     # (B, 1, H*, D)
    angles = torch.rand(B, 1, 1, D // 2, generator=g).to(dev) * 300
    cos, sin = angles.cos(), angles.sin()                                                  # (B, 1, 1, D/2)
    slots = torch.tensor([int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs if n else -1 for b, n in enumerate(ctx)],
                         device=dev)
    kw = dict(num_parts=-(-160 // partition), partition_size=partition, merge_in_kernel=merge)
    counts = torch.zeros(B, Hkv, dtype=torch.int32, device=dev)

    want_q, want_k = rope(q.clone(), k.clone(), cos, sin)
    want_kc, want_vc = kc.clone(), vc.clone()
    store_kv(want_kc, want_vc, want_k[:, 0], v[:, 0], slots, _place(want_kc, want_vc))
    want = attend(want_q[:, 0], want_kc, want_vc, tables, lens, 0.25, counts=counts,
                  place=_place(want_kc, want_vc), **kw)
    before = qkv.clone()
    got = attend(q[:, 0], kc, vc, tables, lens, 0.25, counts=counts, place=_place(kc, vc), **kw,
                                 rope=(k[:, 0], v[:, 0], cos[:, 0, 0], sin[:, 0, 0], slots))
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc), "the cache differs from rope + store"
    rel, abs_ = (1e-5, 1e-6) if dtype == torch.float32 else (2 ** -7, 2 ** -8)   # |v| ~ 1
    assert ((got.float() - want.float()).abs() <= rel * want.float().abs() + abs_).all()
    assert torch.equal(qkv, before) and torch.all(counts == 0) and torch.all(got[3] == 0)

    ref_q, ref_k = (apply_rope(x.float(), cos, sin)[:, 0] for x in (q, k))
    ref_kc, ref_vc = kc.float(), vc.float()
    store_kv_ref(ref_kc, ref_vc, ref_k, v[:, 0].float(), slots)
    ref = paged_attention_ref(ref_q, ref_kc, ref_vc, tables, lens, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got.float() - ref).abs().max() < tol


# ----------------------------------------------------------------------------------------------
# GPU: the Triton kernels in bf16 against the torch reference

@pytest.mark.gpu
def test_gpu_kernels_match_reference_bf16():
    # Qwen2.5-7B head layout (28/4, D=128), 16-token blocks, contexts over several partitions
    ctx = [1, 255, 256, 257, 1000, 0, 37]
    q, kc, vc, tables, lens = _random_paged(7, 28, 4, 128, 16, 600, ctx, torch.bfloat16, "cuda")
    ref = paged_attention_ref(q, kc, vc, tables, lens, 128 ** -0.5)
    counts = torch.zeros(7, 4, dtype=torch.int32, device="cuda")
    # 8 partitions of 128 and 63 of 16, merged by the merge kernel or 8 at a time by whichever
    # program ends last (atomic counts, on real concurrent programs), three calls in a row on the
    # same counts
    for part, num_parts, merge in ((128, 8, None), (16, 64, None), (16, 64, True), (16, 64, True), (16, 64, True)):
        out = attend(q, kc, vc, tables, lens, 128 ** -0.5, num_parts=num_parts, counts=counts, place=_place(kc, vc),
                                     partition_size=part, merge_in_kernel=merge)
        err = (out.float() - ref.float()).abs()
        assert err.max() < 2e-2, f"partition {part}: max err {err.max():.2e} mean {err.mean():.2e}"
        assert torch.all(out[5] == 0) and torch.all(counts == 0)
    k, v = torch.randn(2, 9, 4, 128, device="cuda", dtype=torch.bfloat16).unbind(0)
    slots = torch.tensor([0, 5, -1, 17, 31, 8, 900, 2000, 40], device="cuda")
    a, b = kc.clone(), vc.clone()
    store_kv_ref(a, b, k, v, slots)
    store_kv(kc, vc, k, v, slots, _place(kc, vc))
    assert torch.equal(a, kc) and torch.equal(b, vc)
    # decode's RoPE + store + attention in one launch gives the bits of rope, store and
    # attention, at the 7B head layout with 64 partitions of 16 and 8 of 128
    lens = torch.tensor([1, 255, 256, 257, 1000, 0, 37], dtype=torch.int32, device="cuda")
    slots = torch.tensor([int(tables[b, (n - 1) // 16]) * 16 + (n - 1) % 16 if n else -1
                          for b, n in enumerate(lens.tolist())], device="cuda")
    qkv = torch.randn(7, 1, 36 * 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.view(7, 1, -1, 128) for t in qkv.split([28 * 128, 4 * 128, 4 * 128], -1))
    angles = torch.rand(7, 1, 1, 64, device="cuda") * 3000
    cos, sin = angles.cos(), angles.sin()
    want_q, want_k = rope(q.clone(), k.clone(), cos, sin)
    for part, num_parts in ((16, 64), (128, 8)):
        want_kc, want_vc = kc.clone(), vc.clone()
        store_kv(want_kc, want_vc, want_k[:, 0], v[:, 0], slots, _place(want_kc, want_vc))
        want = attend(want_q[:, 0], want_kc, want_vc, tables, lens, 128 ** -0.5, num_parts=num_parts,
                      counts=counts, place=_place(want_kc, want_vc), partition_size=part)
        got = attend(q[:, 0], kc, vc, tables, lens, 128 ** -0.5, num_parts=num_parts, counts=counts,
                     place=_place(kc, vc), partition_size=part,
                     rope=(k[:, 0], v[:, 0], cos[:, 0, 0], sin[:, 0, 0], slots))
        assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
        assert ((got.float() - want.float()).abs() <= 2 ** -7 * want.float().abs() + 2 ** -8).all()


# ----------------------------------------------------------------------------------------------
# the partition choice (rollout's decode: kernels.paged_attention)

def test_partition_scales_with_the_batch_within_its_bounds():
    """partition_tokens positions a row of the batch, a power of two within 16..512 (at least a cache
    block), and at least max_model_len / 64: at 32 a row, batch 1 at 2048 gets 32 (64 partitions),
    batch 16 512 (4), a 64k context never more than 64 partitions; the default, 16 a row, gives batches
    4 to 16 partitions half as long, and batch 1 and 2 the 2048 / 64 floor."""
    with tuning.using(dataclasses.replace(tuning.current(), partition_tokens=32)):
        assert [partition(B, 16, 2048) for B in (1, 2, 4, 8, 16, 128)] == [32, 64, 128, 256, 512, 512]
        assert partition(1, 16, 65536) == 1024 and partition(1, 64, 2048) == 64
    with tuning.using(dataclasses.replace(tuning.current(), partition_tokens=64)):
        assert partition(1, 16, 2048) == 64
    assert [partition(B, 16, 2048) for B in (1, 2, 4, 8, 16, 128)] == [32, 32, 64, 128, 256, 512]


@pytest.mark.interpreter
def test_paged_attention_picks_the_partition_and_matches_reference():
    """kernels.paged_attention on a batch of 5 at max_model_len 160: a partition of 256 positions
    (5 x 32 rounded up to a power of two), written directly; with partition_size 16, ten merged by
    the merge kernel (more than merge_max_parts); both against the torch reference, the counts left at zero."""
    ctx = [1, 17, 40, 0, 140]
    q, kc, vc, tables, lens = _random_paged(5, 6, 2, 16, 16, 48, ctx, torch.float32)
    counts = kernels.attention_counts(5, 2, "cpu")
    assert counts.dtype == torch.int32 and counts.shape == (5, 2) and not counts.any()
    ref = paged_attention_ref(q, kc, vc, tables, lens, 0.25)
    for size in (None, 16):
        out = kernels.paged_attention(q, kc, vc, tables, lens, 0.25, place=_place(kc, vc), max_model_len=160,
                                      counts=counts, partition_size=size)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert torch.all(counts == 0)
