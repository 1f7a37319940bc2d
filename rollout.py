"""Paged KV-cache sampler: one engine for GRPO rollouts and evaluation.

The training model itself (NVFP4 base + live LoRA + AQN noise on the norms) samples: there is no
second copy of the weights and no weight sync. This file turns `model.forward` into a batched,
continuously-scheduled generator in four layers, as nano-vllm splits it:

    Sequence      plain state of one completion: its tokens, logprobs and block table
    BlockManager  pure Python: fixed-size KV blocks, reference counts, a free list
    Scheduler     pure Python: waiting / running queues, prefill first, then decode steps,
                  preemption by recompute when blocks run out (never an out-of-memory crash)
    Runner        all tensor work: the KV cache, packed prefill, paged decode, CUDA graphs

KV cache layout. One tensor per K and V of shape (L, num_blocks, block_size, Hkv, D). A token at
position t of a sequence lives in slot `block_table[t // block_size] * block_size + t % block_size`.
The model never sees this: each layer calls `attn_ctx.attend(layer, q, k, v)` with RoPE already
applied, and the context object (PrefillContext / DecodeContext below, passed explicitly, no
module globals) stores k, v in the cache and returns the attention output. Decode on the Triton
backend sets `rope_in_store`: the model then hands it q, k unrotated with cos/sin, and one kernel
rotates q in place and k on its way into the cache (RoPE and the KV store in one launch).

    prefill: all new prompts packed into one row (1, sum T_i); attention is causal within each
             prompt (cu_seqlens); the lm_head runs on the last position of each prompt only.
    decode:  one token per sequence (B, 1); attention reads K/V through the block tables
             (Triton kernel on GPU, torch reference on CPU); split over the context into
             partitions (32·B tokens, 16..512) merged by log-sum-exp (flash-decoding), so batch 1
             still fills the GPU.

GRPO sharing. The n samples of one prompt are prefilled once: the first sample allocates the
prompt's blocks, the others `fork` it (reference count + 1). Full blocks are never written again;
the partial last block is copied on write when a sample first appends to it.

Sampling. logits / T, then top-k, then top-p, renormalised: `logp`. The token is
argmax(logp - log E) with E ~ Exp(1) (the exponential race: P(argmax = i) = p_i), with no
host sync inside the sampler; temperature 0 takes the explicit greedy branch. The recorded logprob
of each token is `logp[token]`, i.e. under the sampling distribution after temperature/top-k/top-p
(under greedy: the plain log-softmax of the logits).

One step late. The Python scheduler needs the sampled tokens (stop tokens end sequences), but
waiting for them after every step would leave the GPU idle while Python prepares the next one.
So the engine queues step t+1 first and only then reads step t's tokens (one asynchronous copy per
step): the scheduler works with lengths, each new token is a placeholder (-1) until its value
lands, and the next step takes that token straight from the GPU tensor of the step before. The
price: a sequence that sampled its stop token at step t is still decoded at t+1 (a spare row,
whose output is dropped). Before a prefill (new prompts, or a recompute after preemption) the
step in flight is drained, so prefills only ever see real tokens.

Preemption by recompute. When a decode step needs a block and none is free, the most recently
admitted sequence is evicted (its blocks freed) and later re-prefilled from prompt + its tokens
so far; the oldest running sequence always makes progress, so nothing hangs. A sequence whose
prompt + max_tokens alone exceeds the whole cache is rejected up front with a ValueError.

Left out: prefix caching across calls, chunked prefill, speculative decoding, tensor parallelism.
Tests: tests/test_rollout.py (CPU: greedy == transformers' generate, logprobs == a dense forward,
block manager / scheduler units, Triton kernels under TRITON_INTERPRET=1; GPU-marked: kernels and
CUDA graphs vs the CPU reference). Benchmark: bench/rollout.py.
"""
import os
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    from marlin_kernel import pdl_launch, pdl_start
    from model import rope_head
except ImportError:  # the torch reference path works without triton
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# ----------------------------------------------------------------------------------------------
# Sampling parameters and outputs

@dataclass
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0                # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0                    # keep the k most likely tokens; 0 = off
    max_tokens: int = 256             # new tokens per completion (also cut at the context length)
    stop_token_ids: tuple | None = None  # None: the model's eos ids
    n: int = 1                        # samples per prompt (the GRPO group size)
    seed: int | None = None           # same seed + same inputs + same engine settings = same output

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.n, int) and self.n >= 1):
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.stop_token_ids is not None:
            self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    token_ids: list        # generated tokens, the stop token included
    logprobs: list         # one float per token, under the sampling distribution
    finish_reason: str     # "stop" (a stop token was sampled) | "length" (max_tokens or context)


# ----------------------------------------------------------------------------------------------
# Sequence, BlockManager, Scheduler: pure Python, no tensors

class Sequence:
    def __init__(self, seq_id, prompt_index, sample_index, prompt, max_tokens):
        self.seq_id, self.prompt_index, self.sample_index = seq_id, prompt_index, sample_index
        self.token_ids = list(prompt)           # prompt + completion so far
        self.num_prompt_tokens = len(prompt)
        self.max_tokens = max_tokens            # already cut to the context length
        self.logprobs = []
        self.block_table = []                   # KV block ids, one per block_size positions
        self.finish_reason = None

    def __len__(self):
        return len(self.token_ids)

    @property
    def at_max_tokens(self):
        """Has the last allowed token been sampled (it may still be on the GPU)?"""
        return len(self) - self.num_prompt_tokens >= self.max_tokens

    @property
    def completion_ids(self):
        return self.token_ids[self.num_prompt_tokens:]


class BlockManager:
    """Fixed-size KV blocks with reference counts. Returns copy orders; never touches tensors."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks = deque(range(num_blocks))

    def num_free(self):
        return len(self.free_blocks)

    def blocks_for(self, num_tokens):
        return -(-num_tokens // self.block_size)

    def _take(self):
        block = self.free_blocks.popleft()
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq):
        """Blocks for all of seq's current tokens (a prefill)."""
        assert not seq.block_table, "allocate() on a sequence that already holds blocks"
        need = self.blocks_for(len(seq))
        if need > self.num_free():
            raise RuntimeError(f"allocate needs {need} blocks, {self.num_free()} free")
        seq.block_table = [self._take() for _ in range(need)]

    def fork(self, parent, child):
        """child shares all of parent's blocks (the GRPO samples of one prompt)."""
        child.block_table = list(parent.block_table)
        for block in child.block_table:
            self.ref_counts[block] += 1

    def free(self, seq):
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []

    def needs_block(self, seq):
        """Does writing the KV of seq's last token (position len-1) need a fresh block?"""
        pos = len(seq) - 1
        if pos // self.block_size >= len(seq.block_table):
            return True                                        # crossing into a new block
        return self.ref_counts[seq.block_table[pos // self.block_size]] > 1  # shared: copy on write

    def append_slot(self, seq):
        """Make position len-1 writable. Returns (src, dst) when a block must be copied, else None."""
        pos = len(seq) - 1
        idx = pos // self.block_size
        if idx >= len(seq.block_table):
            seq.block_table.append(self._take())
            return None
        old = seq.block_table[idx]
        if self.ref_counts[old] == 1:
            return None
        new = self._take()                                     # copy on write
        self.ref_counts[old] -= 1
        seq.block_table[idx] = new
        return (old, new)


class Scheduler:
    """Waiting items are groups: the n fresh samples of one prompt, or one preempted sequence."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting = deque()       # of lists of Sequence (all members share one token list)
        self.running = []            # admission order: the oldest first
        self.num_preemptions = 0

    def add(self, group):
        self.waiting.append(group)

    def done(self):
        return not self.waiting and not self.running

    def schedule(self):
        """-> ("prefill", [group, ...]) or ("decode", [seq, ...], [(src, dst) block copies])."""
        groups, num_tokens = [], 0
        while self.waiting:
            group = self.waiting[0]
            need = self.bm.blocks_for(len(group[0]))
            # keep one block per member for its first append, unless nothing else could run
            reserve = len(group) if (self.running or groups) else 0
            if groups and (num_tokens + len(group[0]) > self.max_num_batched_tokens):
                break
            if len(self.running) + len(group) > self.max_num_seqs and (self.running or groups):
                break
            if need + reserve > self.bm.num_free():
                break
            self.waiting.popleft()
            self.bm.allocate(group[0])
            for seq in group[1:]:
                self.bm.fork(group[0], seq)
            self.running.extend(group)
            groups.append(group)
            num_tokens += len(group[0])
        if groups:
            return "prefill", groups, []
        if not self.running and self.waiting:  # unreachable when the up-front size check passed
            raise RuntimeError("scheduler stuck: a waiting sequence can never fit in the KV cache")
        # a sequence whose last allowed token is still on the GPU (the engine reads results one
        # step late) is not decoded again; it keeps its blocks until that token arrives
        waiting_for_last = [s for s in self.running if s.at_max_tokens]
        scheduled, copies = [], []
        queue = deque(s for s in self.running if not s.at_max_tokens)
        while queue:
            seq = queue.popleft()
            while self.bm.needs_block(seq) and self.bm.num_free() == 0:
                self._preempt(queue.pop() if queue else seq)   # evict the newest first
                if seq.block_table == []:
                    break
            if seq.block_table:
                copy = self.bm.append_slot(seq)
                if copy is not None:
                    copies.append(copy)
                scheduled.append(seq)
        keep = {id(s) for s in scheduled + waiting_for_last}
        self.running = [s for s in self.running if id(s) in keep]   # admission order; preempted ones left
        return "decode", scheduled, copies

    def _preempt(self, seq):
        self.num_preemptions += 1
        self.bm.free(seq)
        self.waiting.appendleft([seq])   # re-prefilled from prompt + completion so far

    def finish(self, seq):
        """seq is done: free its blocks. It may be waiting, preempted after its last token was sampled."""
        self.bm.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting = deque(g for g in self.waiting if g != [seq])


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
        """Program (b, h) rotates head h of row b (model.rope_head: apply_rope's math): a q head
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
    (B, D/2) fp32 at each row's position. One launch for model.rope_triton + store_kv_triton."""
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


# ----------------------------------------------------------------------------------------------
# Attention contexts: the explicit object the model's layers call (no module globals)

class PrefillContext:
    """New prompts packed in one row: q (1, N, Hq, D). Each prompt attends causally to itself."""

    def __init__(self, runner, slots, cu_seqlens):
        self.runner, self.slots, self.cu_seqlens = runner, slots, cu_seqlens  # slots (N,); list

    def attend(self, layer, q, k, v):
        r = self.runner
        r.store_kv(r.k_cache[layer], r.v_cache[layer], k[0], v[0], self.slots)
        out = torch.empty_like(q[0])
        for s, e in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]):
            out[s:e] = causal_attention(q[0, s:e], k[0, s:e], v[0, s:e])
        return out[None]


class DecodeContext:
    """One new token per sequence: q (B, 1, Hq, D); K/V come from the cache via block tables.
    On the Triton backend it takes RoPE too (rope_in_store): see the module docstring."""

    def __init__(self, runner, slots, block_tables, context_lens):
        self.runner, self.slots = runner, slots                     # (B,) int32
        self.block_tables, self.context_lens = block_tables, context_lens  # (B, nb) / (B,) int32
        self.rope_in_store = runner.attn_backend == "triton"

    def attend(self, layer, q, k, v, rope=None):
        """rope: None when q, k come rotated, else their (cos, sin) (B, 1, 1, D/2)."""
        r = self.runner
        k_cache, v_cache = r.k_cache[layer], r.v_cache[layer]
        if rope is None:
            r.store_kv(k_cache, v_cache, k[:, 0], v[:, 0], self.slots)
            q = q[:, 0]
        else:
            cos, sin = (t[:, 0, 0] for t in rope)                   # (B, D/2)
            q = rope_store_kv_triton(q[:, 0], k[:, 0], v[:, 0], cos, sin, k_cache, v_cache, self.slots)
        out = r.paged_attention(q, k_cache, v_cache, self.block_tables, self.context_lens, q.shape[-1] ** -0.5)
        return out[:, None]


# ----------------------------------------------------------------------------------------------
# Sampling: exponential race, no host sync; explicit greedy branch

def sample(logits, params: SamplingParams, generator=None):
    """logits (B, V) fp32 -> tokens (B,) long, logprobs (B,) fp32 under the sampling distribution."""
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]             # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # drop a token when the mass strictly before it already reaches top_p (the first stays)
        drop = (torch.cumsum(probs, -1) - probs) >= params.top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    logp = torch.log_softmax(logits, -1)                                            # (B, V)
    e = torch.empty_like(logp).exponential_(generator=generator).clamp_min_(1e-30)  # no log(0)
    tokens = (logp - e.log()).argmax(-1)     # argmax p_i / E_i, E_i ~ Exp(1): a draw from p
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


# ----------------------------------------------------------------------------------------------
# Runner: the KV cache, packed prefill, paged decode, CUDA graphs

class Runner:
    def __init__(self, model, block_size, max_model_len, attn_backend, cuda_graphs, partition_size):
        cfg = model.config
        self.model, self.block_size, self.max_model_len = model, block_size, max_model_len
        self.num_layers, self.num_kv_heads, self.head_dim = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        p = next(model.parameters())
        self.device = p.device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        if attn_backend not in ("triton", "torch"):
            raise ValueError(f"attn_backend must be 'triton' or 'torch', got {attn_backend!r}")
        if attn_backend == "triton" and triton is None:
            raise ValueError("attn_backend='triton' needs triton installed")
        self.partition_size, self.attn_backend = partition_size, attn_backend
        if attn_backend == "triton":
            self.store_kv, self.paged_attention = store_kv_triton, self._paged_attention_triton
        else:
            self.store_kv, self.paged_attention = store_kv_ref, paged_attention_ref
        # graphs need the sync-free Triton path (the torch reference reads lengths on the host)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda" and attn_backend == "triton"
        self.k_cache = self.v_cache = None
        self.graphs, self.graph_pool, self._static = {}, None, None

    def _paged_attention_triton(self, q, *args):
        # split the context finer for small batches so that batch 1 still fills the GPU, into at most
        # 64 partitions (the merge kernel holds them all); a partition count fixed per batch size
        # keeps captured CUDA graphs valid for every context length
        part = self.partition_size or max(self.block_size, min(512, triton.next_power_of_2(32 * q.shape[0])),
                                          triton.next_power_of_2(-(-self.max_model_len // 64)))
        return paged_attention_triton(q, *args, num_parts=-(-self.max_model_len // part), partition_size=part)

    # ---- cache
    def bytes_per_block(self):
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def allocate_cache(self, num_blocks):
        if self.k_cache is not None and self.k_cache.shape[1] == num_blocks:
            return
        self.free_cache()
        shape = (self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)

    def free_cache(self):
        """Drop the KV cache and the CUDA graphs (they point into it), e.g. before backward."""
        self.k_cache = self.v_cache = None
        self.graphs, self.graph_pool = {}, None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def copy_blocks(self, copies):
        """Copy-on-write: duplicate whole blocks (all layers) src -> dst."""
        if copies:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*copies))
            self.k_cache[:, dst] = self.k_cache[:, src]
            self.v_cache[:, dst] = self.v_cache[:, src]

    def _tensor(self, data, dtype):
        return torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda").to(
            self.device, non_blocking=True)

    def _slot(self, seq, pos):
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _logits(self, hidden):
        return self.model.lm_head(hidden).float()

    # ---- prefill: one packed row of all new tokens
    @torch.inference_mode()
    def prefill(self, groups):
        """groups: lists of Sequence sharing a token list (blocks allocated). -> (num_groups, V)"""
        ids, pos, slots, cu = [], [], [], [0]
        for group in groups:
            seq = group[0]
            ids += seq.token_ids
            pos += range(len(seq))
            slots += [self._slot(seq, t) for t in range(len(seq))]
            cu.append(cu[-1] + len(seq))
        ctx = PrefillContext(self, self._tensor(slots, torch.int64), cu)
        hidden = self.model(self._tensor([ids], torch.int64), self._tensor([pos], torch.int64),
                            attn_ctx=ctx, return_hidden=True)                      # (1, N, H)
        return self._logits(hidden[0, [c - 1 for c in cu[1:]]])

    # ---- decode: one token per sequence
    def _decode_inputs(self, seqs, rows, src_rows):
        """-> (5, rows) int32 [token, position, KV slot, context length, source row] and (rows, width)
        block tables, built on the host in one tensor each. A token still on the GPU (sampled by the
        step in flight) is 0 here and its row in that step's output is the source row (else -1).
        Rows past len(seqs) are padding that writes no KV (slot -1) and attends to nothing (length 0)."""
        pad = rows - len(seqs)
        meta = torch.tensor([[max(s.token_ids[-1], 0) for s in seqs] + [0] * pad,
                             [len(s) - 1 for s in seqs] + [0] * pad,
                             [self._slot(s, len(s) - 1) for s in seqs] + [-1] * pad,
                             [len(s) for s in seqs] + [0] * pad,
                             list(src_rows) + [-1] * pad], dtype=torch.int32)
        width = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
                              + [[0] * width] * pad, dtype=torch.int32)
        if self.device.type == "cuda":
            meta, tables = meta.pin_memory(), tables.pin_memory()
        return meta, tables

    @staticmethod
    def _fill_tokens(meta, prev_tokens):
        """meta[0] = prev_tokens[meta[4]] where meta[4] >= 0: tokens that never visited the host."""
        if prev_tokens is not None:
            src = meta[4].long()
            meta[0].copy_(torch.where(src >= 0, prev_tokens[src.clamp(min=0)].to(meta.dtype), meta[0]))

    @torch.inference_mode()
    def decode(self, seqs, src_rows, prev_tokens=None):
        """-> logits (B, V) for the next token of each sequence; src_rows/prev_tokens: see above."""
        B = len(seqs)
        if self.cuda_graphs and B <= self.BUCKETS[-1]:
            return self._logits(self._decode_graph(seqs, src_rows, prev_tokens)[:B])
        meta, tables = (t.to(self.device, non_blocking=True) for t in self._decode_inputs(seqs, B, src_rows))
        self._fill_tokens(meta, prev_tokens)
        return self._logits(self._run_decode(meta, tables)[:, 0])

    def _run_decode(self, meta, tables):
        """meta (5, B), tables (B, width) on the device -> final hidden states (B, 1, H)."""
        ctx = DecodeContext(self, meta[2], tables, meta[3])
        return self.model(meta[0][:, None], meta[1][:, None], attn_ctx=ctx, return_hidden=True)

    # ---- CUDA graphs: one per batch-size bucket, captured lazily, sharing one memory pool
    BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

    def _static_buffers(self):
        if self._static is None:
            n, d = self.BUCKETS[-1], self.device
            self._static = (torch.zeros(5, n, dtype=torch.int32, device=d),
                            torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32, device=d))
        return self._static

    def _capture(self, bucket):
        meta, tables = (t[..., :bucket] if i == 0 else t[:bucket] for i, t in enumerate(self._static_buffers()))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._run_decode(meta, tables)   # warm-up: autotuning and lazy inits happen outside capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            out = self._run_decode(meta, tables)                                    # (bucket, 1, H)
        self.graph_pool = graph.pool()
        self.graphs[bucket] = (graph, out[:, 0])

    def _decode_graph(self, seqs, src_rows, prev_tokens):
        bucket = next(b for b in self.BUCKETS if b >= len(seqs))
        meta, tables = self._decode_inputs(seqs, bucket, src_rows)
        static_meta, static_tables = self._static_buffers()
        static_meta[:, :bucket].copy_(meta, non_blocking=True)          # two host->device copies
        static_tables[:bucket, :tables.shape[1]].copy_(tables, non_blocking=True)
        self._fill_tokens(static_meta[:, :bucket], prev_tokens)
        if bucket not in self.graphs:
            self._capture(bucket)
        graph, out = self.graphs[bucket]
        graph.replay()
        return out


# ----------------------------------------------------------------------------------------------
# Engine: the public API

class LLMEngine:
    """engine = LLMEngine(model); engine.generate(prompts, SamplingParams(...)); engine.free_cache()

    num_blocks: fixed cache size; None sizes it to what the call needs, capped on GPU at
    gpu_memory_utilization of the free memory (minus a reserve for prefill activations).
    CUDA graphs read the parameters in place, so in-place updates (optimizer steps, AQN noise)
    are seen; after rebinding a parameter (e.g. load_adapter), call free_cache() to recapture."""

    def __init__(self, model, *, block_size=16, num_blocks=None, max_num_seqs=256,
                 max_num_batched_tokens=16384, max_model_len=None, gpu_memory_utilization=0.9,
                 attn_backend=None, cuda_graphs=True, partition_size=None):
        cfg = model.config
        max_model_len = max_model_len or cfg.max_position_embeddings
        for name, val in dict(block_size=block_size, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              max_model_len=max_model_len, partition_size=partition_size or 1).items():
            if not (isinstance(val, int) and val >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        if num_blocks is not None and not (isinstance(num_blocks, int) and num_blocks >= 1):
            raise ValueError(f"num_blocks must be None or an int >= 1, got {num_blocks!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        device = next(model.parameters()).device
        attn_backend = attn_backend or ("triton" if device.type == "cuda" else "torch")
        self.model, self.block_size, self.num_blocks = model, block_size, num_blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len, self.gpu_memory_utilization = max_model_len, gpu_memory_utilization
        self.runner = Runner(model, block_size, max_model_len, attn_backend, cuda_graphs, partition_size)
        eos = getattr(cfg, "eos_token_ids", None) or getattr(cfg, "eos_token_id", None)
        self.eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        self.stats = {}

    def free_cache(self):
        self.runner.free_cache()

    def _cache_blocks(self, need, prefill_tokens):
        """How many blocks to allocate for a call that needs `need` (no sharing assumed)."""
        if self.num_blocks is not None:
            return self.num_blocks
        r = self.runner
        if r.device.type != "cuda":
            return need
        held = 0 if r.k_cache is None else 2 * r.k_cache.numel() * r.k_cache.element_size()
        cfg = self.model.config
        # prefill activations (a few (N, hidden) and (N, intermediate) bf16 tensors) and the sampler's
        # fp32 (B, V) temporaries, plus slack
        reserve = (prefill_tokens * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * 4
                   + self.max_num_seqs * cfg.vocab_size * 16 + (1 << 29))
        cached = torch.cuda.memory_reserved(r.device) - torch.cuda.memory_allocated(r.device)
        free = torch.cuda.mem_get_info(r.device)[0] + cached + held - reserve
        return max(1, min(need, int(self.gpu_memory_utilization * free) // r.bytes_per_block()))

    def _check_prompts(self, prompts, params):
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        V = self.model.config.vocab_size
        for i, p in enumerate(prompts):
            if not isinstance(p, (list, tuple)) or len(p) == 0:
                raise ValueError(f"prompt {i} is empty (or not a list of token ids)")
            if len(p) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the context (max_model_len) is "
                                 f"{self.max_model_len}, which leaves no room to generate")
            if not all(isinstance(t, int) and 0 <= t < V for t in p):
                raise ValueError(f"prompt {i} has a token id outside [0, {V}) or not an int")

    def _launch(self, kind, batch, copies, pending, params, gen):
        """Queue one step on the GPU: forward, sampling, and an asynchronous copy of the tokens and
        logprobs to the host. Each sequence gets a placeholder token (-1) at once, so the scheduler
        sees its true length while the value is still on the GPU. -> the step record."""
        r = self.runner
        if kind == "prefill":
            assert pending is None, "a prefill reads every token on the host: drain the step in flight first"
            seqs = [s for g in batch for s in g]
            logits = r.prefill(batch)                                        # (groups, V)
            logits = logits[[i for i, g in enumerate(batch) for _ in g]]     # a row per sample
        else:
            seqs = batch
            r.copy_blocks(copies)
            rows = {id(s): i for i, s in enumerate(pending["seqs"])} if pending else {}
            src = [rows[id(s)] if s.token_ids[-1] < 0 else -1 for s in seqs]
            logits = r.decode(seqs, src, pending["tokens"] if pending else None)   # (B, V)
        tokens, logprobs = sample(logits, params, gen)
        out = torch.stack([tokens.double(), logprobs.double()])                  # (2, B)
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=out.is_cuda)
        host.copy_(out, non_blocking=True)
        event = torch.cuda.Event() if out.is_cuda else None
        if event is not None:
            event.record()
        index = []
        for seq in seqs:
            index.append(len(seq))
            seq.token_ids.append(-1)
            seq.logprobs.append(float("nan"))
        return dict(seqs=seqs, index=index, tokens=tokens, host=host, event=event)

    def _apply(self, step, sched, stop, done):
        """Wait for a launched step's tokens; fill the placeholders; finish sequences that sampled a
        stop token or reached max_tokens, dropping whatever was sampled after that."""
        if step["event"] is not None:
            step["event"].synchronize()
        host = step["host"]
        for seq, i, tok, lp in zip(step["seqs"], step["index"], host[0].long().tolist(), host[1].tolist()):
            if seq.finish_reason:        # finished by an earlier step: this row was a spare
                continue
            seq.token_ids[i], seq.logprobs[i - seq.num_prompt_tokens] = tok, lp
            if tok in stop:
                seq.finish_reason = "stop"
            elif i + 1 - seq.num_prompt_tokens >= seq.max_tokens:
                seq.finish_reason = "length"
            if seq.finish_reason:
                del seq.token_ids[i + 1:], seq.logprobs[i + 1 - seq.num_prompt_tokens:]
                sched.finish(seq)
                done.append(seq)

    @torch.inference_mode()
    def generate(self, prompts, params: SamplingParams):
        """prompts: list of token-id lists -> completions[prompt_index][sample_index]."""
        t0 = time.perf_counter()
        self._check_prompts(prompts, params)
        bs = self.block_size
        max_new = [min(params.max_tokens, self.max_model_len - len(p)) for p in prompts]
        seq_blocks = [-(-(len(p) + m) // bs) for p, m in zip(prompts, max_new)]
        num_blocks = self._cache_blocks(sum(b * params.n for b in seq_blocks),
                                         min(self.max_num_batched_tokens, sum(map(len, prompts))))
        i = max(range(len(prompts)), key=lambda j: seq_blocks[j])
        if seq_blocks[i] > num_blocks:
            raise ValueError(f"prompt {i} ({len(prompts[i])} tokens) + max_tokens {max_new[i]} needs "
                             f"{seq_blocks[i]} KV blocks of {bs} tokens, but the cache has {num_blocks}: "
                             f"lower max_tokens or give the cache more memory")
        r = self.runner
        if r.k_cache is None or r.k_cache.shape[1] < num_blocks:
            r.allocate_cache(num_blocks)
        sched = Scheduler(BlockManager(r.k_cache.shape[1], bs), self.max_num_seqs,
                          self.max_num_batched_tokens)
        for pi, p in enumerate(prompts):
            sched.add([Sequence(pi * params.n + j, pi, j, p, max_new[pi]) for j in range(params.n)])
        stop = set(params.stop_token_ids if params.stop_token_ids is not None else self.eos_ids)
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=r.device).manual_seed(params.seed)
        was_training = self.model.training
        self.model.eval()                                  # LoRA dropout off while sampling
        done, steps, ttft = [], {"prefill": 0, "decode": 0}, None
        pending = None                     # the step in flight: its tokens are not on the host yet

        def take(step):                    # its tokens into the sequences (waits for the GPU)
            nonlocal ttft
            self._apply(step, sched, stop, done)
            ttft = ttft if ttft is not None else time.perf_counter() - t0

        try:
            while not sched.done():
                if pending and sched.waiting:          # a prefill (or a recompute) needs every token
                    take(pending)
                    pending = None
                kind, batch, copies = sched.schedule()
                if not batch:                          # everything running waits for its last token
                    take(pending)
                    pending = None
                    continue
                steps[kind] += 1
                step = self._launch(kind, batch, copies, pending, params, gen)
                if pending:                            # the GPU runs `step` while the host reads this
                    take(pending)
                pending = step
            if pending:                                # only rows of finished sequences are left
                take(pending)
        finally:
            self.model.train(was_training)
        assert sched.bm.num_free() == sched.bm.num_blocks, "KV blocks leaked"
        out = [[None] * params.n for _ in prompts]
        for s in done:
            out[s.prompt_index][s.sample_index] = Completion(
                s.prompt_index, s.sample_index, s.completion_ids, s.logprobs, s.finish_reason)
        self.stats = dict(num_blocks=r.k_cache.shape[1], preemptions=sched.num_preemptions,
                          prefill_steps=steps["prefill"], decode_steps=steps["decode"], ttft_s=ttft,
                          total_s=time.perf_counter() - t0,
                          new_tokens=sum(len(s) - s.num_prompt_tokens for s in done))
        return out


def generate(model, prompts, params: SamplingParams, **engine_kwargs):
    """One-shot: build an engine, generate, free the cache. Hold an LLMEngine to reuse graphs."""
    engine = LLMEngine(model, **engine_kwargs)
    try:
        return engine.generate(prompts, params)
    finally:
        engine.free_cache()
