"""Attention over the paged KV cache at decode: the KV store and the split paged-decode kernels.

The trunk's attention.py owns the KV slot layout and the torch references (store_kv_ref,
paged_attention_ref, causal_attention); these kernels compute the same on CUDA and are tested
against them. rollout.py's decode context calls store_kv and paged_attention; the model never does.

KV cache layout. One tensor per K and V of shape (L, num_blocks, block_size, Hkv, D); the functions
here take one layer's (num_blocks, block_size, Hkv, D). A token at position t of a sequence lives
in slot `block_table[t // block_size] * block_size + t % block_size`. Slot -1 means "write
nothing": the padding rows of a CUDA graph.

Where the caches lie. The kernels do not take the caches' addresses as arguments: they load them
from the layer's row of a cache table (cache_table, filled by place_caches whenever the caches are
allocated). A CUDA graph replays its kernels with the arguments of its capture, so a decode graph
that held the addresses would die with the cache, which a training step frees for its backward
pass; one that holds the table's row replays against whatever cache was allocated since, and the
sampler captures each batch bucket once a run instead of once a step.

    store:   k, v (N, Hkv, D) into their slots (store_kv).
    decode:  one token per sequence, q (B, Hq, D); attention reads K/V through the block tables,
             split over the context into partitions merged by log-sum-exp (flash-decoding), so
             batch 1 still fills the GPU. paged_attention picks the partition size (tuning's
             partition_tokens a row of the batch, 16..512, at least max_model_len / 64 so that no
             context needs more than 64 partitions) and a partition count fixed per engine, so a
             captured CUDA graph stays valid for every context length.
    RoPE:    with rope=(k, v, cos, sin, slots) the kernel takes q and k unrotated, rotates q in
             registers and k on its way into the cache, and attends, the new token's k and v taken
             from registers (RoPE, the KV store and attention in one launch, with
             fused_ops.rotate_halves's math).

Split decode. One program per (sequence b, kv head h, partition p) runs the G = Hq / Hkv query
heads that share h as one (G, D) tile (padded to 16 rows for the MMA) through an online softmax
over the partition's positions, and writes the partition's normalised output out_p and log-sum-exp
lse_p (fp32). The merge, out = sum_p e^(lse_p - M) out_p / sum_p e^(lse_p - M) (M the max lse),
takes one of two ways, chosen per launch:
  * up to tuning's merge_max_parts partitions: in the same kernel. A context of one partition is
    written directly; otherwise each program bumps a counter of (b, h) with one atomic
    (release-acquire, after a barrier: every thread's stores come first; fp4_decode._last_split, as
    the split-K kernels count their splits), and the program that finishes last merges them,
    merge_chunk at a time, and sets the counter back to 0 for the next call (the caller owns the
    counters: attention_counts). No second launch.
  * more partitions (small batches): _paged_decode_merge_kernel, one program per (b, q head) reading
    all of them at once, which is faster there than one program merging G heads.
An empty context (a padding row) gives zeros. With PDL (launch.py) the context length and, for tiles
of at most early_max_tile positions, the first K/V tile are loaded before the wait: the kernel just
before (the qkv matmul) does not write them. Under TRITON_INTERPRET=1 the dot operands are upcast
to fp32 (the interpreter's bf16 tl.dot is wrong); fp32 caches use fp32 dots too.

Left out: attention from the cache during prefill (prefix caching and chunked prefill would need
it), sliding windows, ALiBi, FP8 KV.
Tests: tests/test_kernels_paged_decode.py (CPU: the kernels under TRITON_INTERPRET=1 against
attention.py's references, GQA, scattered block tables, empty rows; with RoPE, the cache and the
output against fused_ops.rope + store + attention bit for bit; GPU-marked: bf16 at 7B head shapes).
"""
import torch
import triton
import triton.language as tl

from . import launch, tuning
from .fp4_decode import _last_split, pdl_start
from .fused_ops import rotate_halves

# ----------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _caches(place_ptr, anchor_ptr, ALIGN: tl.constexpr):
    """The K and V caches of a layer, from its row of the cache table (place_ptr: two int64
    offsets, in cache elements, from anchor_ptr, the row's own address in the cache's dtype):
    anchor + offset keeps the alignment that 16-byte loads need (a loaded int64 cast to a pointer
    would not, and its loads would go scalar)."""
    k_off = tl.multiple_of(tl.load(place_ptr), ALIGN)
    v_off = tl.multiple_of(tl.load(place_ptr + 1), ALIGN)
    return anchor_ptr + k_off, anchor_ptr + v_off


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, stride_k, stride_v,        # new k, v rows: (N, Hkv*D)
    place_ptr, anchor_ptr,                   # the caches (num_slots, Hkv*D), contiguous: _caches
    slot_ptr,                                # (N,) int32 or int64, -1 = skip
    ROW: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr, USE_PDL: tl.constexpr,
):
    """for i in range(N): if slot[i] >= 0: k_cache[slot[i]] = k[i]; v_cache[slot[i]] = v[i]"""
    k_cache_ptr, v_cache_ptr = _caches(place_ptr, anchor_ptr, ALIGN)
    pdl_start(USE_PDL)
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(k_ptr + i * stride_k + offs, mask=mask)
        v = tl.load(v_ptr + i * stride_v + offs, mask=mask)
        dst = slot.to(tl.int64) * ROW + offs
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_rotated(src, mask, cos_ptr, sin_ptr, D: tl.constexpr):
    """Rows src (..., 1) of D elements, rotated as apply_rope does (fused_ops.rotate_halves'
    math, so the bits of fused_ops.rope): element d pairs with d ± D/2, loaded a second time."""
    d = tl.arange(0, D)
    x = tl.load(src + d, mask=mask, other=0.0)
    partner = tl.load(src + (d + D // 2) % D, mask=mask, other=0.0)
    cos, sin = tl.load(cos_ptr + d % (D // 2)), tl.load(sin_ptr + d % (D // 2))
    first, _ = rotate_halves(x, partner, cos, sin)          # d < D/2: x1·cos - x2·sin
    _, second = rotate_halves(partner, x, cos, sin)         # d >= D/2: x2·cos + x1·sin
    return tl.where(d < D // 2, first, second)


@triton.jit
def _load_new_kv(k_src, v_src, cos_ptr, sin_ptr, D: tl.constexpr):
    """The new token's k (rotated, as q) and v of one kv head, at k_src, v_src: (1, D) rows."""
    one = tl.zeros((1, 1), tl.int32)                                  # one row of D
    k = _load_rotated(k_src + one, one == 0, cos_ptr, sin_ptr, D)
    return k, tl.load(v_src + one + tl.arange(0, D)[None, :])


@triton.jit
def _merge_partitions(part_out_ptr, part_lse_ptr, out_ptr, head0, num_parts, n_parts,
                      G: tl.constexpr, G_M: tl.constexpr, D: tl.constexpr, P_CHUNK: tl.constexpr):
    """out[head0 + g] = sum_p e^(lse_p - M) out_p / sum_p e^(lse_p - M) for the G heads, reading
    P_CHUNK partitions at a time (online, as the attention itself: M grows chunk by chunk)."""
    offs_g = tl.arange(0, G_M)
    offs_c = tl.arange(0, P_CHUNK)
    offs_d = tl.arange(0, D)
    head = head0 + offs_g                                                    # (G_M,)
    mx = tl.full([G_M], float("-inf"), tl.float32)
    den = tl.zeros([G_M], tl.float32)
    o = tl.zeros([G_M, D], tl.float32)
    for p0 in range(0, n_parts, P_CHUNK):
        rows = head[:, None] * num_parts + (p0 + offs_c)[None, :]           # (G_M, P_CHUNK)
        ok = (offs_g < G)[:, None] & (p0 + offs_c < n_parts)[None, :]
        # .cg: read through L2, where the other programs' partials are (never a stale L1 line)
        lse = tl.load(part_lse_ptr + rows, mask=ok, other=float("-inf"), cache_modifier=".cg")
        po = tl.load(part_out_ptr + rows[:, :, None] * D + offs_d[None, None, :], mask=ok[:, :, None],
                     other=0.0, cache_modifier=".cg")                       # (G_M, P_CHUNK, D)
        mx_new = tl.maximum(mx, tl.max(lse, 1))
        safe = tl.where(mx_new > float("-inf"), mx_new, 0.0)                # padded heads: no inf - inf
        w = tl.exp(lse - safe[:, None])                                      # (G_M, P_CHUNK)
        alpha = tl.exp(mx - safe)
        den = den * alpha + tl.sum(w, 1)
        o = o * alpha[:, None] + tl.sum(po * w[:, :, None], 1)
        mx = mx_new
    tl.store(out_ptr + head[:, None] * D + offs_d[None, :],
             (o / tl.where(den > 0, den, 1.0)[:, None]).to(out_ptr.dtype.element_ty),
             mask=(offs_g < G)[:, None])


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, tok0, end, h, HKV: tl.constexpr, D: tl.constexpr,
             BS: tl.constexpr, TILE: tl.constexpr):
    """K, V (TILE, D) of positions tok0 .. tok0 + TILE - 1 of one kv head, gathered through the
    block table row bt_row; positions >= end are masked (valid) and read as zeros."""
    pos = tok0 + tl.arange(0, TILE)                                          # (TILE,)
    valid = pos < end
    block = tl.load(bt_row + pos // BS, mask=valid, other=0).to(tl.int64)
    kv_off = ((block * BS + pos % BS)[:, None] * HKV + h) * D + tl.arange(0, D)[None, :]  # (TILE, D)
    k = tl.load(k_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
    v = tl.load(v_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
    return k, v, valid


@triton.jit
def _attend_tile(q, k, v, valid, m, l, acc, scale, FP32_DOT: tl.constexpr):
    """One online-softmax step of q (G, D) over a tile k, v (TILE, D) with at least one valid
    position: -> the running max m, denominator l and output acc."""
    if FP32_DOT:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")  # (G_PAD, TILE)
    else:
        s = tl.dot(q, tl.trans(k))                                   # bf16 MMA
    s = tl.where(valid[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    pr = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(pr, 1)
    if FP32_DOT:
        acc = acc * alpha[:, None] + tl.dot(pr, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
    return m_new, l, acc


@triton.jit
def _paged_decode_kernel(
    q_ptr, stride_qb, stride_qh,             # q (B, Hq, D), last dim contiguous
    place_ptr, anchor_ptr,                   # the caches (num_blocks, BS, Hkv, D), contiguous: _caches
    block_table_ptr, stride_bt,              # (B, max_blocks) int32
    ctx_len_ptr,                             # (B,) int32
    part_out_ptr, part_lse_ptr,              # (B, Hq, P, D) fp32, (B, Hq, P) fp32
    count_ptr, out_ptr,                      # (B, Hkv) int32, 0 between calls; out (B, Hq, D)
    new_k_ptr, new_v_ptr, stride_nk, stride_nv,   # with ROPE: this step's k, v (B, Hkv, D), k unrotated
    cos_ptr, sin_ptr, slot_ptr,              # (B, D/2) fp32 at the new position; (B,) slots, -1 = skip
    scale, num_parts,
    HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, G_M: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, PARTITION: tl.constexpr, TILE: tl.constexpr, P_CHUNK: tl.constexpr,
    MERGE: tl.constexpr, ROPE: tl.constexpr, FP32_DOT: tl.constexpr, EARLY: tl.constexpr, ALIGN: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program = (sequence b, kv head h, partition p): the G query heads of h attend to
    positions [p*PARTITION, min((p+1)*PARTITION, ctx)) with an online softmax.

    with ROPE: q is rotated in registers and position ctx - 1 (the new token) is not read from
    the cache: every program loads its k (rotated) and v with q, and the program of its
    partition (n_parts - 1) stores them in the cache slot for later steps and adds them to its
    softmax from registers after its tiles (one launch where RoPE, the store and attention
    took two)

    for each tile j of TILE positions (gathered from TILE / BS cache blocks) of the partition:
        s = q @ K_j^T * scale             (G, TILE), masked beyond the partition
        m' = max(m, rowmax s); l = l*e^(m-m') + rowsum e^(s-m'); acc = acc*e^(m-m') + e^(s-m') @ V_j
    out_p = acc / l, lse_p = m + log l to memory for _paged_decode_merge_kernel; or with MERGE,
    out = acc / l if the context has one partition, else the program that finishes last for
    (b, h) (an atomic count) merges them all.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2)
    # ---- loaded before waiting on the kernel before (pdl_start): where the caches lie, the context
    # length, and with EARLY the first tile's block table entries and older K/V, all written before
    # this layer began; their latency then passes under that kernel's tail
    k_cache_ptr, v_cache_ptr = _caches(place_ptr, anchor_ptr, ALIGN)
    ctx = tl.load(ctx_len_ptr + b)
    # a context past num_parts * PARTITION breaks the contract (its tail is left out), but must
    # not leave a count that never reaches n_parts, shared by every later call
    n_parts = tl.minimum((ctx + PARTITION - 1) // PARTITION, num_parts)
    start = p * PARTITION
    end = tl.minimum(start + PARTITION, ctx - 1 if ROPE else ctx)   # ROPE: the new token comes last
    bt_row = block_table_ptr + b * stride_bt
    if EARLY:
        k0, v0, valid0 = _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, start, end, h, HKV, D, BS, TILE)
    pdl_start(USE_PDL)
    HALF: tl.constexpr = D // 2
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < G
    head = b * HKV * G + h * G + offs_g                                      # (G_PAD,) rows of out
    if start < ctx:
        # ---- the G query heads that share kv head h, padded to a dot-friendly G_PAD
        q_src = q_ptr + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh        # (G_PAD, 1)
        if ROPE:   # q rotated, and the new token's k (rotated) and v, loaded first: nothing waits late
            q = _load_rotated(q_src, g_mask[:, None], cos_ptr + b * HALF, sin_ptr + b * HALF, D)
            k_new, v_new = _load_new_kv(new_k_ptr + b * stride_nk + h * D, new_v_ptr + b * stride_nv + h * D,
                                        cos_ptr + b * HALF, sin_ptr + b * HALF, D)   # (1, D) each
        else:
            q = tl.load(q_src + offs_d[None, :], mask=g_mask[:, None], other=0.0)   # (G_PAD, D)
        if FP32_DOT:  # the interpreter's bf16 tl.dot is wrong; fp32 caches want full fp32
            q = q.to(tl.float32)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        # ---- walk the partition TILE positions (TILE / BS cache blocks) at a time
        first = start
        if EARLY:
            if start < end:
                m, l, acc = _attend_tile(q, k0, v0, valid0, m, l, acc, scale, FP32_DOT)
            first = start + TILE
        for tok0 in range(first, end, TILE):
            k, v, valid = _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, tok0, end, h, HKV, D, BS, TILE)
            m, l, acc = _attend_tile(q, k, v, valid, m, l, acc, scale, FP32_DOT)
        if ROPE and p == n_parts - 1:        # the new token: into the cache, and from registers
            slot = tl.load(slot_ptr + b)
            if slot >= 0:                    # -1: a padding row, nothing written
                dst = (slot.to(tl.int64) * HKV + h) * D + offs_d[None, :]
                tl.store(k_cache_ptr + dst, k_new.to(k_cache_ptr.dtype.element_ty))
                tl.store(v_cache_ptr + dst, v_new.to(v_cache_ptr.dtype.element_ty))
            s = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale        # (G_PAD,)
            m_new = tl.maximum(m, s)
            alpha = tl.exp(m - m_new)
            pr = tl.exp(s - m_new)
            l = l * alpha + pr
            pv = pr if FP32_DOT else pr.to(v_new.dtype).to(tl.float32)   # as the tiles' dot rounds it
            acc = acc * alpha[:, None] + pv[:, None] * v_new.to(tl.float32)
            m = m_new
        if MERGE and n_parts == 1:           # the whole context in one partition: done
            tl.store(out_ptr + head[:, None] * D + offs_d[None, :],
                     (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        else:
            # ---- this partition's normalised output and log-sum-exp, then count it
            row = head * num_parts + p                                       # (G_PAD,)
            tl.store(part_out_ptr + row[:, None] * D + offs_d[None, :], acc / l[:, None],
                     mask=g_mask[:, None])
            tl.store(part_lse_ptr + row, m + tl.log(l), mask=g_mask)
        if MERGE and n_parts > 1:
            # the partition that counts last for (b, h) sees all partials (and resets the count)
            if _last_split(count_ptr, b * HKV + h, n_parts):
                _merge_partitions(part_out_ptr, part_lse_ptr, out_ptr, b * HKV * G + h * G,
                                  num_parts, n_parts, G, G_M, D, P_CHUNK)
    elif MERGE and p == 0:                   # an empty context (CUDA-graph padding): zeros
        tl.store(out_ptr + head[:, None] * D + offs_d[None, :],
                 tl.zeros([G_PAD, D], out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _paged_decode_merge_kernel(
    part_out_ptr, part_lse_ptr,              # (B, Hq, P, D), (B, Hq, P) fp32
    ctx_len_ptr, out_ptr,                    # (B,) int32; out (B, Hq, D) contiguous
    HQ: tl.constexpr, D: tl.constexpr, PARTITION: tl.constexpr,
    NUM_PARTS: tl.constexpr, P_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    """out = sum_p e^(lse_p - M) out_p / sum_p e^(lse_p - M) over the partitions that exist."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    ctx = tl.load(ctx_len_ptr + b)      # written before the layer began: loaded before the wait
    pdl_start(USE_PDL)
    n_parts = tl.minimum((ctx + PARTITION - 1) // PARTITION, NUM_PARTS)
    offs_p = tl.arange(0, P_PAD)
    offs_d = tl.arange(0, D)
    p_mask = offs_p < n_parts
    row = (b * HQ + hq) * NUM_PARTS + offs_p
    lse = tl.load(part_lse_ptr + row, mask=p_mask, other=float("-inf"))
    mx = tl.where(n_parts > 0, tl.max(lse, 0), 0.0)   # an empty (padding) row: no -inf - -inf
    w = tl.exp(lse - mx)                                                     # (P_PAD,)
    o = tl.load(part_out_ptr + row[:, None] * D + offs_d[None, :], mask=p_mask[:, None], other=0.0)
    denom = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)        # (D,); 0 if empty
    tl.store(out_ptr + (b * HQ + hq) * D + offs_d, out.to(out_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------------------------
# wrappers


def cache_table(layers: int, device) -> torch.Tensor:
    """(layers, 2) int64 zeros: where each layer's K and V caches lie (place_caches fills it). The
    kernels read and write a cache through its layer's row, so a CUDA graph, which holds the row's
    address, stays valid when the caches are freed and allocated again elsewhere."""
    return torch.zeros(layers, 2, dtype=torch.int64, device=device)


def place_caches(table, k_caches, v_caches):
    """table[l] = where k_caches[l] and v_caches[l] ((L, num_blocks, bs, Hkv, D), contiguous) lie:
    offsets in cache elements from the row's own address (_caches says why), stream-ordered after
    any kernel still reading the old places."""
    L = table.shape[0]
    if len(k_caches) != L or len(v_caches) != L or v_caches.dtype != k_caches.dtype:
        raise ValueError(f"place_caches: K and V caches of {L} layers and one dtype needed, got "
                         f"{len(k_caches)} of {k_caches.dtype} and {len(v_caches)} of {v_caches.dtype}")
    rows = [[c[l].data_ptr() - table[l].data_ptr() for c in (k_caches, v_caches)] for l in range(L)]
    if any(o % 16 for r in rows for o in r):
        raise ValueError("place_caches: the caches must be 16-byte aligned (the kernels load 16 bytes at once)")
    table.copy_(torch.tensor([[o // k_caches.element_size() for o in r] for r in rows], dtype=torch.int64))


def _place_args(place, k_cache, v_cache):
    """The kernels' (place_ptr, anchor_ptr) and ALIGN for a layer's caches at its table row `place`."""
    if place.dtype != torch.int64 or place.shape != (2,) or not place.is_contiguous() or place.device != k_cache.device:
        raise ValueError(f"place must be a layer's row of cache_table ((2,) int64 on {k_cache.device}), got "
                         f"{place.dtype} {tuple(place.shape)} on {place.device}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or v_cache.dtype != k_cache.dtype:
        raise ValueError("the caches must be contiguous, of one dtype")
    return (place, place.view(k_cache.dtype)), 16 // k_cache.element_size()


def store_kv(k_cache, v_cache, k, v, slots, place):
    """k_cache (num_blocks, bs, Hkv, D) contiguous, at the table row place (cache_table); k (N, Hkv,
    D); slots (N,) int, -1 = skip (graph padding): attention.store_kv_ref's contract."""
    N, Hkv, D = k.shape
    assert slots.dtype in (torch.int32, torch.int64)
    at, align = _place_args(place, k_cache, v_cache)
    k, v = k.reshape(N, Hkv * D), v.reshape(N, Hkv * D)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _store_kv_kernel[(N,)](k, v, k.stride(0), v.stride(0), *at, slots, ROW=Hkv * D,
                           BLOCK=triton.next_power_of_2(Hkv * D), ALIGN=align, **launch.pdl_launch(k.device))


def attention_counts(rows: int, num_kv_heads: int, device) -> torch.Tensor:
    """The in-kernel merge's counters: (rows, Hkv) int32 zeros, reused by every call of up to `rows`
    sequences (each call leaves them zero). A captured CUDA graph reads them by address."""
    return torch.zeros(rows, num_kv_heads, dtype=torch.int32, device=device)


def partition(rows: int, block_size: int, max_model_len: int) -> int:
    """Positions a partition at `rows` sequences: tuning's partition_tokens a row, a power of two
    within 16..512 (at least a cache block), and at least max_model_len / 64, so that a context
    has at most 64 partitions."""
    tokens = tuning.current().partition_tokens * rows
    return max(block_size, min(512, triton.next_power_of_2(tokens)), triton.next_power_of_2(-(-max_model_len // 64)))


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale, *, place, max_model_len, counts,
                    partition_size=None, rope=None):
    """attention.paged_attention_ref's contract (q (B, Hq, D); block_tables (B, nb) int32;
    context_lens (B,) int32 -> (B, Hq, D)) on the kernels, split into partitions of partition_size
    positions (default: partition(B, block_size, max_model_len)), ceil(max_model_len / size) of them.
    place: the caches' row of a cache_table; counts: attention_counts of >= B rows; rope: as in attend."""
    part = partition_size or partition(q.shape[0], k_cache.shape[1], max_model_len)
    return attend(q, k_cache, v_cache, block_tables, context_lens, scale, num_parts=-(-max_model_len // part),
                  counts=counts, place=place, partition_size=part, rope=rope)


def attend(q, k_cache, v_cache, block_tables, context_lens, scale, num_parts, counts, place,
           partition_size=256, tile=None, merge_in_kernel=None, warps=4, rope=None):
    """paged_attention with every launch parameter given. The kernel reads and writes the caches
    where their table row `place` says (cache_table); k_cache and v_cache give their shape and
    dtype. num_parts * partition_size >= every context
    length; fixed per engine (not per step) so that a captured CUDA graph stays valid. counts: (>= B,
    Hkv) int32 zeros, reused by every call (the kernel leaves it zero again). Each program reads
    `tile` positions (a power of 2, several cache blocks; default tuning's attention_tile) a step,
    Triton pipelining those loads attention_stages deep.
    merge_in_kernel (default: num_parts <= tuning's merge_max_parts): the last program of each (row,
    kv head) merges the partitions (one launch); else a second kernel merges them, one program per
    q head.

    rope: None (q comes rotated, k and v are in the cache), or decode's (k, v, cos, sin, slots):
    q and k (B, Hkv, D) unrotated, cos/sin (B, D/2) fp32 at the new token's position ctx - 1, and
    its slots (B,) (-1: write nothing). The kernel rotates q (apply_rope's math), stores the
    rotated k and v as store_kv does, and takes the new token's k and v from registers."""
    t = tuning.current()
    B, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    if q.stride(-1) != 1:
        q = q.contiguous()
    if D & (D - 1) or BS < 16 or BS & (BS - 1) or partition_size % BS:
        raise ValueError(f"Triton paged attention needs a power-of-2 head_dim (got {D}), a power-of-2 "
                         f"block_size >= 16 (got {BS}) dividing partition_size (got {partition_size})")
    if counts.dtype != torch.int32 or counts.shape[0] < B or counts.shape[1] != Hkv or not counts.is_contiguous():
        raise ValueError(f"counts must be contiguous int32 zeros of shape (>= {B}, {Hkv}), got "
                         f"{counts.dtype} {tuple(counts.shape)}")
    merge = num_parts <= t.merge_max_parts if merge_in_kernel is None else merge_in_kernel
    tile = max(BS, min(tile or t.attention_tile, 1 << (partition_size.bit_length() - 1)))
    part_out = torch.empty(B, Hq, num_parts, D, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(B, Hq, num_parts, device=q.device, dtype=torch.float32)
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    at, align = _place_args(place, k_cache, v_cache)
    if rope is not None:
        k, v, cos, sin, slots = rope
        if slots.dtype not in (torch.int32, torch.int64):
            raise ValueError("rope: slots must be int32 or int64")
        k, v = (x if x.stride(-1) == 1 and x.stride(-2) == D else x.contiguous() for x in (k, v))
        rope_args = (k, v, k.stride(0), v.stride(0), cos.contiguous(), sin.contiguous(), slots)
    else:
        rope_args = (q, q, 0, 0, q, q, q)                               # unused
    _paged_decode_kernel[(B, Hkv, num_parts)](
        q, q.stride(0), q.stride(1), *at, block_tables, block_tables.stride(0),
        context_lens, part_out, part_lse, counts, out, *rope_args, scale, num_parts,
        HKV=Hkv, G=G, G_PAD=max(16, triton.next_power_of_2(G)), G_M=triton.next_power_of_2(G), D=D, BS=BS,
        PARTITION=partition_size, TILE=tile, P_CHUNK=min(t.merge_chunk, triton.next_power_of_2(num_parts)),
        MERGE=merge, ROPE=rope is not None, FP32_DOT=launch.interpreting() or k_cache.dtype == torch.float32,
        EARLY=tile <= t.early_max_tile, ALIGN=align, num_warps=warps, num_stages=t.attention_stages,
        **launch.pdl_launch(q.device))
    if not merge:
        _paged_decode_merge_kernel[(B, Hq)](
            part_out, part_lse, context_lens, out, HQ=Hq, D=D, PARTITION=partition_size,
            NUM_PARTS=num_parts, P_PAD=triton.next_power_of_2(num_parts), **launch.pdl_launch(q.device))
    return out
