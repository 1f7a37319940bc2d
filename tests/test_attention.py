"""Tests for attention.py: the paged KV-cache references against a dense float64 attention written
out here (scores, causal mask, softmax, GQA by repeating kv heads). The Triton versions are checked
against these references in test_kernels_paged_attention.py, the engine in test_rollout.py."""
import torch

import pytest

import attention
from attention import causal_attention, packed_causal_attention, paged_attention_ref, store_kv_ref


def dense64(q, k, v, causal):
    """q (T, Hq, D), k/v (S, Hkv, D) -> (T, Hq, D) float64; causal: query t sees keys s <= t + S - T."""
    T, Hq, D = q.shape
    S = k.shape[0]
    k, v = (x.double().repeat_interleave(Hq // x.shape[1], dim=1) for x in (k, v))   # (S, Hq, D)
    s = torch.einsum("thd,shd->hts", q.double(), k) / D ** 0.5                     # (Hq, T, S)
    if causal:
        s = s.masked_fill(torch.arange(S)[None] > torch.arange(T)[:, None] + S - T, float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v)


def test_causal_attention_matches_float64_with_gqa():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(9, 6, 16, generator=g), torch.randn(9, 2, 16, generator=g), torch.randn(9, 2, 16, generator=g)
    out = causal_attention(q, k, v)
    err = (out.double() - dense64(q, k, v, causal=True)).abs().max()
    assert out.shape == (9, 6, 16) and err < 1e-5, f"max err {err:.2e}"


def _packed_prompts(device, dtype):
    """Three prompts of 5, 1 and 7 tokens packed in one row, GQA 6:2 -> q, k, v, cu_seqlens."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(13, 6, 64, generator=g)
    k, v = torch.randn(13, 2, 64, generator=g), torch.randn(13, 2, 64, generator=g)
    return *(x.to(device, dtype) for x in (q, k, v)), [0, 5, 6, 13]


def _check_packed(out, q, k, v, cu, tol):
    for s, e in zip(cu[:-1], cu[1:]):
        ref = dense64(q[s:e].cpu(), k[s:e].cpu(), v[s:e].cpu(), causal=True)
        err = (out[s:e].double().cpu() - ref).abs().max()
        assert err < tol, f"prompt at rows {s}:{e}: max err {err:.2e}"


def test_packed_causal_attention_keeps_each_prompt_to_itself():
    """The per-prompt path: each prompt's rows equal dense causal attention over that prompt alone."""
    q, k, v, cu = _packed_prompts("cpu", torch.float32)
    out = packed_causal_attention(q, k, v, cu)
    assert out.shape == q.shape
    _check_packed(out, q, k, v, cu, 1e-5)


@pytest.mark.gpu
def test_packed_causal_attention_one_varlen_launch_on_cuda():
    """bf16 on CUDA with the offsets on the device: the varlen flash-attention route (torch >= 2.11)
    keeps each prompt to itself, within bf16 rounding of float64. q, k, v are views of one
    (N, (Hq + 2·Hkv)·D) tensor, as the prefill's stacked q/k/v projection gives them."""
    q, k, v, cu = _packed_prompts("cuda", torch.bfloat16)
    assert attention.varlen_runs(q.device, q.dtype, 64), "this torch or GPU has no causal varlen_attn: SDPA per prompt"
    qkv = torch.cat([x.flatten(1) for x in (q, k, v)], 1)                          # (N, (6 + 2 + 2)·64)
    q, k, v = (t.unflatten(1, (-1, 64)) for t in qkv.split([6 * 64, 2 * 64, 2 * 64], 1))
    assert not q.is_contiguous()
    out = packed_causal_attention(q, k, v, cu, torch.tensor(cu, dtype=torch.int32, device="cuda"), 7)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    _check_packed(out, q.float(), k.float(), v.float(), cu, 2e-2)


def test_store_kv_writes_each_token_to_its_slot_and_skips_minus_one():
    k_cache, v_cache = torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)     # 4 blocks of 8 slots
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    store_kv_ref(k_cache, v_cache, k, v, torch.tensor([17, -1, 3]))
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(v_cache[0, 3], v[2])   # slot 17 = block 2, offset 1
    assert k_cache.count_nonzero() == 2 * 2 * 16, "slot -1 must write nothing"


def test_paged_decode_matches_dense_attention_over_scattered_blocks():
    """Three sequences stored token by token in shuffled blocks of 4; decode at the last position
    equals dense float64 attention over the sequence's keys; a context of 0 gives zeros."""
    g = torch.Generator().manual_seed(2)
    Hq, Hkv, D, bs, lens = 4, 2, 16, 4, [1, 7, 13]
    k_cache, v_cache = torch.zeros(16, bs, Hkv, D), torch.zeros(16, bs, Hkv, D)
    perm = torch.randperm(16, generator=g)
    tables = torch.stack([perm[4 * i:4 * i + 4] for i in range(3)] + [perm[12:16]])   # (4, 4) block ids
    seqs = []
    for b, n in enumerate(lens):
        k, v = torch.randn(n, Hkv, D, generator=g), torch.randn(n, Hkv, D, generator=g)
        slots = tables[b, torch.arange(n) // bs] * bs + torch.arange(n) % bs
        store_kv_ref(k_cache, v_cache, k, v, slots)
        seqs.append((k, v))
    q = torch.randn(4, Hq, D, generator=g)
    out = paged_attention_ref(q, k_cache, v_cache, tables, torch.tensor(lens + [0]), D ** -0.5)   # (4, Hq, D)
    for b, (k, v) in enumerate(seqs):
        want = dense64(q[b:b + 1], k, v, causal=True)[0]
        assert (out[b].double() - want).abs().max() < 1e-5, f"sequence {b}"
    assert torch.all(out[3] == 0), "an empty context (graph padding) must give zeros"
