"""Attention over the paged KV cache: the torch reference and the Triton kernels of the sampler.

rollout.py's attention contexts (PrefillContext, DecodeContext) call these functions; the model
never does. Each layer hands its context q, k, v, and the context stores k, v in the cache and
returns the attention output.

KV cache layout. One tensor per K and V of shape (L, num_blocks, block_size, Hkv, D); the functions
here take one layer's (num_blocks, block_size, Hkv, D). A token at position t of a sequence lives
in slot `block_table[t // block_size] * block_size + t % block_size` (block tables come from
scheduler.py's BlockManager). Slot -1 means "write nothing": the padding rows of a CUDA graph.

    store:   k, v (N, Hkv, D) into their slots (store_kv_ref, store_kv_triton).
    prefill: all new prompts packed into one row (1, sum T_i); attention is causal within each
             prompt (causal_attention: SDPA per prompt, on the fresh k, v, not the cache).
    decode:  one token per sequence, q (B, Hq, D); attention reads K/V through the block tables
             (paged_attention_triton on GPU, paged_attention_ref on CPU); split over the context
             into partitions (the Runner picks 32·B tokens, 16..512) merged by log-sum-exp
             (flash-decoding), so batch 1 still fills the GPU.
    RoPE:    decode on the Triton backend sets `rope_in_store`: the model then hands q, k
             unrotated with cos/sin, and rope_store_kv_triton rotates q in place and k on its way
             into the cache (RoPE and the KV store in one launch, with fused_ops.rope_head's math).

Split decode. One program per (sequence b, kv head h, partition p) runs the G = Hq / Hkv query
heads that share h as one (G, D) tile (padded to 16 rows for the MMA) through an online softmax
over the partition's positions; it writes the partition's normalised output out_p and log-sum-exp
lse_p (fp32). A second kernel merges: out = sum_p e^(lse_p - M) out_p / sum_p e^(lse_p - M), M the
max lse. An empty context (a padding row) gives zeros. Both kernels, and the stores, start with
marlin_kernel.pdl_start (programmatic dependent launch on Hopper). Under TRITON_INTERPRET=1 the dot
operands are upcast to fp32 (the interpreter's bf16 tl.dot is wrong); fp32 caches use fp32 dots too.

Left out: attention from the cache during prefill (prefix caching and chunked prefill would need
it), sliding windows, ALiBi, FP8 KV.
Tests: tests/test_paged_attention.py (CPU: the kernels under TRITON_INTERPRET=1 against the torch
reference, GQA, scattered block tables, empty rows, RoPE + store against model.apply_rope; GPU-marked:
bf16 at 7B head shapes, and rope_store_kv_triton bit for bit against fused_ops.rope_triton + store).
The engine tests in tests/test_rollout.py run them inside the sampler. Benchmark: bench/rollout.py
--attention.
"""
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    from fused_ops import rope_head
    from marlin_kernel import pdl_launch, pdl_start
except ImportError:  # the torch reference path works without triton
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# ----------------------------------------------------------------------------------------------
# Attention over the paged cache: torch reference (CPU, and the oracle for the kernels)

def store_kv_ref(k_cache, v_cache, k, v, slots):
    """k_cache (num_blocks, bs, Hkv, D); k (N, Hkv, D); slots (N,) int, -1 = skip (graph padding)."""
    keep = slots >= 0
    k_cache.view(-1, *k_cache.shape[2:])[slots[keep]] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots[keep]] = v[keep].to(v_cache.dtype)


def paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale):
    """q (B, Hq, D); block_tables (B, nb) int; context_lens (B,) int -> (B, Hq, D).

    Each query attends to the first context_lens[b] positions of its own sequence (fp32 math);
    a row with context 0 (CUDA-graph padding) gives zeros. No host sync."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    k = k_cache[block_tables.long()].flatten(1, 2).float()                  # (B, nb*bs, Hkv, D)
    v = v_cache[block_tables.long()].flatten(1, 2).float()
    k, v = k.repeat_interleave(Hq // Hkv, dim=2), v.repeat_interleave(Hq // Hkv, dim=2)
    s = torch.einsum("bhd,bnhd->bhn", q.float(), k) * scale                 # (B, Hq, nb*bs)
    pos = torch.arange(k.shape[1], device=q.device)
    s = s.masked_fill(pos >= context_lens[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)                            # empty rows: 0
    return torch.einsum("bhn,bnhd->bhd", p, v).to(q.dtype)


def causal_attention(q, k, v):
    """One prompt's prefill: q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D), causal, GQA. SDPA gets
    (1, heads, T, D) and shares the KV heads itself: 3-D inputs with repeated heads sent it to the
    math path (fp32 GEMMs, ~8 kernels per prompt and layer on the H100)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


# ----------------------------------------------------------------------------------------------
# Triton kernels: KV store and paged decode attention (GQA, split over the context). On Hopper
# they are launched with programmatic dependent launch (marlin_kernel.pdl_start).

if triton is not None:
    @triton.jit
    def _store_kv_kernel(
        k_ptr, v_ptr, stride_k, stride_v,        # new k, v rows: (N, Hkv*D)
        k_cache_ptr, v_cache_ptr,                # (num_slots, Hkv*D), contiguous
        slot_ptr,                                # (N,) int32 or int64, -1 = skip
        ROW: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        """for i in range(N): if slot[i] >= 0: k_cache[slot[i]] = k[i]; v_cache[slot[i]] = v[i]"""
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
    def _rope_store_kv_kernel(
        q_ptr, k_ptr, v_ptr, stride_q, stride_k, stride_v,   # q (B, Hq, D), k, v (B, Hkv, D): heads contiguous
        cos_ptr, sin_ptr,                        # (B, D/2) fp32
        k_cache_ptr, v_cache_ptr,                # (num_slots, Hkv, D), contiguous
        slot_ptr,                                # (B,) int32 or int64, -1 = skip
        HQ, HKV, HALF: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        """Program (b, h) rotates head h of row b (fused_ops.rope_head: apply_rope's math): a q head
        (h < Hq) in place, a k head into k_cache[slot[b]], next to a copy of the v head in
        v_cache[slot[b]] (slot -1: skipped)."""
        pdl_start(USE_PDL)
        b, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs = tl.arange(0, HALF)
        src, y1, y2 = rope_head(q_ptr, k_ptr, cos_ptr, sin_ptr, stride_q, stride_k, b, h, HQ, HALF)
        if h < HQ:                               # q: rotated in place, for the attention kernel
            tl.store(src + offs, y1)
            tl.store(src + HALF + offs, y2)
        else:                                    # k: rotated straight into the cache
            slot = tl.load(slot_ptr + b)
            if slot >= 0:
                dst = (slot.to(tl.int64) * HKV + h - HQ) * 2 * HALF + offs
                v_src = v_ptr + b * stride_v + (h - HQ) * 2 * HALF + offs
                tl.store(k_cache_ptr + dst, y1.to(k_cache_ptr.dtype.element_ty))
                tl.store(k_cache_ptr + dst + HALF, y2.to(k_cache_ptr.dtype.element_ty))
                tl.store(v_cache_ptr + dst, tl.load(v_src).to(v_cache_ptr.dtype.element_ty))
                tl.store(v_cache_ptr + dst + HALF, tl.load(v_src + HALF).to(v_cache_ptr.dtype.element_ty))

    @triton.jit
    def _paged_decode_partial_kernel(
        q_ptr, stride_qb, stride_qh,             # q (B, Hq, D), last dim contiguous
        k_cache_ptr, v_cache_ptr,                # (num_blocks, BS, Hkv, D), contiguous
        block_table_ptr, stride_bt,              # (B, max_blocks) int32
        ctx_len_ptr,                             # (B,) int32
        part_out_ptr, part_lse_ptr,              # (B, Hq, P, D) fp32, (B, Hq, P) fp32
        scale, num_parts,
        HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
        BS: tl.constexpr, PARTITION: tl.constexpr, TILE: tl.constexpr, FP32_DOT: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """One program = (sequence b, kv head h, partition p): the G query heads of h attend to
        positions [p*PARTITION, min((p+1)*PARTITION, ctx)) with an online softmax.

        for each tile j of TILE positions (gathered from TILE / BS cache blocks) of the partition:
            s = q @ K_j^T * scale             (G, TILE), masked beyond the partition
            m' = max(m, rowmax s); l = l*e^(m-m') + rowsum e^(s-m'); acc = acc*e^(m-m') + e^(s-m') @ V_j
        out[p] = acc / l ; lse[p] = m + log l         (merged across partitions by the next kernel)
        """
        pdl_start(USE_PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        p = tl.program_id(2)
        ctx = tl.load(ctx_len_ptr + b)
        start = p * PARTITION
        if start < ctx:
            # ---- the G query heads that share kv head h, padded to a dot-friendly G_PAD
            offs_g = tl.arange(0, G_PAD)
            offs_d = tl.arange(0, D)
            offs_n = tl.arange(0, TILE)
            g_mask = offs_g < G
            q = tl.load(q_ptr + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                        mask=g_mask[:, None], other=0.0)                        # (G_PAD, D)
            if FP32_DOT:  # the interpreter's bf16 tl.dot is wrong; fp32 caches want full fp32
                q = q.to(tl.float32)
            m = tl.full([G_PAD], float("-inf"), tl.float32)
            l = tl.zeros([G_PAD], tl.float32)
            acc = tl.zeros([G_PAD, D], tl.float32)
            end = tl.minimum(start + PARTITION, ctx)
            # ---- walk the partition TILE positions (TILE / BS cache blocks) at a time
            for tok0 in range(start, end, TILE):
                pos = tok0 + offs_n                                                # (TILE,)
                valid = pos < end
                block = tl.load(block_table_ptr + b * stride_bt + pos // BS, mask=valid, other=0).to(tl.int64)
                kv_off = ((block * BS + pos % BS)[:, None] * HKV + h) * D + offs_d[None, :]  # (TILE, D)
                k = tl.load(k_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
                v = tl.load(v_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
                if FP32_DOT:
                    s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")  # (G_PAD, TILE)
                else:
                    s = tl.dot(q, tl.trans(k))                                   # bf16 MMA
                s = s * scale
                s = tl.where(valid[None, :], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, 1))
                alpha = tl.exp(m - m_new)
                pr = tl.exp(s - m_new[:, None])
                l = l * alpha + tl.sum(pr, 1)
                if FP32_DOT:
                    acc = acc * alpha[:, None] + tl.dot(pr, v.to(tl.float32), input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
                m = m_new
            # ---- this partition's normalised output and log-sum-exp
            row = (b * HKV * G + h * G + offs_g) * num_parts + p                 # (G_PAD,)
            tl.store(part_out_ptr + row[:, None] * D + offs_d[None, :], acc / l[:, None],
                     mask=g_mask[:, None])
            tl.store(part_lse_ptr + row, m + tl.log(l), mask=g_mask)

    @triton.jit
    def _paged_decode_merge_kernel(
        part_out_ptr, part_lse_ptr,              # (B, Hq, P, D), (B, Hq, P) fp32
        ctx_len_ptr, out_ptr,                    # (B,) int32; out (B, Hq, D) contiguous
        HQ: tl.constexpr, D: tl.constexpr, PARTITION: tl.constexpr,
        NUM_PARTS: tl.constexpr, P_PAD: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        """out = sum_p e^(lse_p - M) out_p / sum_p e^(lse_p - M) over the partitions that exist."""
        pdl_start(USE_PDL)
        b = tl.program_id(0)
        hq = tl.program_id(1)
        ctx = tl.load(ctx_len_ptr + b)
        n_parts = (ctx + PARTITION - 1) // PARTITION
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


def store_kv_triton(k_cache, v_cache, k, v, slots):
    """Same contract as store_kv_ref; k_cache must be contiguous."""
    N, Hkv, D = k.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slots.dtype in (torch.int32, torch.int64)
    k, v = k.reshape(N, Hkv * D), v.reshape(N, Hkv * D)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _store_kv_kernel[(N,)](k, v, k.stride(0), v.stride(0), k_cache, v_cache, slots,
                           ROW=Hkv * D, BLOCK=triton.next_power_of_2(Hkv * D), **pdl_launch(k.device))


def rope_store_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots):
    """Decode: q (B, Hq, D) rotated in place (returned; a copy if its heads are not contiguous),
    k (B, Hkv, D) rotated into the cache and v stored beside it as store_kv_ref does; cos/sin
    (B, D/2) fp32 at each row's position. One launch for fused_ops.rope_triton + store_kv_triton."""
    B, Hq, D = q.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slots.dtype in (torch.int32, torch.int64)
    q, k, v = (t if t.stride(-1) == 1 and t.stride(-2) == D else t.contiguous() for t in (q, k, v))
    _rope_store_kv_kernel[(B, Hq + k.shape[1])](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), cos.contiguous(), sin.contiguous(),
        k_cache, v_cache, slots, Hq, k.shape[1], HALF=D // 2, **pdl_launch(q.device))
    return q


def paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, num_parts,
                           partition_size=256, tile=128):
    """Same contract as paged_attention_ref. num_parts * partition_size >= every context length;
    it is fixed per engine (not per step) so that a captured CUDA graph stays valid. Each program
    reads `tile` positions (a power of 2, several cache blocks) per step: bigger loads, fewer steps."""
    B, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    if q.stride(-1) != 1:
        q = q.contiguous()
    if D & (D - 1) or BS < 16 or BS & (BS - 1) or partition_size % BS:
        raise ValueError(f"Triton paged attention needs a power-of-2 head_dim (got {D}), a power-of-2 "
                         f"block_size >= 16 (got {BS}) dividing partition_size (got {partition_size})")
    part_out = torch.empty(B, Hq, num_parts, D, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(B, Hq, num_parts, device=q.device, dtype=torch.float32)
    _paged_decode_partial_kernel[(B, Hkv, num_parts)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, block_tables, block_tables.stride(0),
        context_lens, part_out, part_lse, scale, num_parts,
        HKV=Hkv, G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BS=BS,
        PARTITION=partition_size, TILE=max(BS, min(tile, 1 << (partition_size.bit_length() - 1))),
        FP32_DOT=_INTERPRET or k_cache.dtype == torch.float32, **pdl_launch(q.device))
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    _paged_decode_merge_kernel[(B, Hq)](
        part_out, part_lse, context_lens, out, HQ=Hq, D=D, PARTITION=partition_size,
        NUM_PARTS=num_parts, P_PAD=triton.next_power_of_2(num_parts), **pdl_launch(q.device))
    return out
