"""Paged KV-cache sampler: one engine for GRPO rollouts and evaluation.

The training model itself (NVFP4 base + live LoRA + AQN noise on the norms) samples: there is no
second copy of the weights and no weight sync. The sampler turns `model.forward` into a batched,
continuously-scheduled generator in layers, as nano-vllm splits its engine; this file holds the
public API and the tensor half, the others one concern each:

    scheduler.py        Sequence (plain state of one completion), BlockManager (fixed-size KV
                        blocks, reference counts, a free list), Scheduler (waiting / running
                        queues, prefill first, then decode steps, preemption by recompute when
                        blocks run out, never an out-of-memory crash): pure Python, no tensors
    attention.py        the KV cache's slot layout, and the store and attention over it in torch
                        (their one-launch Triton version, which also applies RoPE, is the wing's)
    sampling.py         logits -> tokens and their logprobs (temperature, top-k, top-p; no host sync)
    graphs.py           CUDA graphs of a decode step or a short prefill, and their static buffers
    rollout.py          SamplingParams, Completion, LLMEngine and generate (the public API); the
                        attention contexts the model's layers call; the Runner: all tensor work
                        (the KV cache, packed prefill, paged decode)

The fast kernels (attention, sampling, the matmuls) come through ops.py, the seam; the files here
hold the torch references.

KV cache. One tensor per K and V of shape (L, num_blocks, block_size, Hkv, D), held by the Runner;
attention.py describes the slots. The model never sees it: each layer calls
`attn_ctx.attend(layer, q, k, v, cos, sin)` with q, k not yet rotated, and the context object
(PrefillContext / DecodeContext below, passed explicitly, no module globals) applies RoPE, stores
k, v in the cache and returns the attention output. On the GPU ("triton" backend) a decode step does
all three in one kernel launch per layer.

    prefill: all new prompts packed into one row (1, sum T_i); attention is causal within each
             prompt (cu_seqlens); the lm_head runs on the last position of each prompt only.
             On the GPU a short prefill is one CUDA-graph replay (graphs.py), padded to a bucket;
             it stores K/V in staging rows that one index_copy then moves into the cache, so the
             graph outlives the cache and every training step replays what the first captured.
    logits:  ops.logits (a GEMV on the GPU for one or two rows, else the lm_head's matmul).
    decode:  one token per sequence (B, 1); attention reads K/V through the block tables
             (Triton kernel on GPU, split over the context into partitions merged by log-sum-exp,
             so batch 1 still fills the GPU; torch reference on CPU). CUDA graphs (graphs.py): one
             per batch-size bucket, padded rows write nothing; a graph also fills in the tokens of
             the step in flight (ops.fill_tokens), and where sampling is the kernels' path (no
             top-k / top-p) it runs the lm_head and the sampler too (one graph per temperature): a
             step is then two small copies in (three after a prefill), one replay and one copy of
             the step's record (tokens and logprobs in one buffer) out. The kernels find the cache
             through the runner's cache_table (ops.cache_table), so these graphs outlive it too.
    draws:   a sequence's random draws depend only on (the call's seed, the sequence, the position
             sampled): row keys = seed + seq_id · 2^24 + position (ROW_KEY), each row drawing from
             its own key. So preemption, a smaller KV cache or another batch composition sample
             the same tokens (up to the logits' rounding), and a resumed run samples what the
             uninterrupted one did.

GRPO sharing. The n samples of one prompt are prefilled once and share the prompt's KV blocks,
copied on write (scheduler.py). Sampling records each token's logprob under the sampling
distribution (sampling.py).

One step late. The Python scheduler needs the sampled tokens (stop tokens end sequences), but
waiting for them after every step would leave the GPU idle while Python prepares the next one.
So the engine queues step t+1 first and only then reads step t's tokens (one asynchronous copy per
step): the scheduler works with lengths, each new token is a placeholder (-1) until its value
lands, and the next step takes that token straight from the GPU tensor of the step before. The
price: a sequence that sampled its stop token at step t is still decoded at t+1 (a spare row,
whose output is dropped). Before a prefill (new prompts, or a recompute after preemption) the
step in flight is drained, so prefills only ever see real tokens.

Preemption by recompute (scheduler.py) means a full cache never crashes or hangs; a sequence whose
prompt + max_tokens alone exceeds the whole cache is rejected up front here, with a ValueError.

Left out: prefix caching across calls, chunked prefill, speculative decoding, tensor parallelism.
Tests: tests/test_rollout.py (CPU: greedy == transformers' generate, logprobs == a dense forward,
stops and preemption, the Triton backend under TRITON_INTERPRET=1 == the torch backend; GPU-marked:
CUDA graphs, PDL, bf16 logprobs vs a dense forward); each layer's own units in
tests/test_scheduler.py, tests/test_attention.py, tests/test_sampling.py. Benchmark:
bench/rollout.py.
"""
import time
from dataclasses import dataclass

import torch

import graphs
import lora
import ops
import plan
import watchdog
from attention import packed_causal_attention, paged_attention_ref, store_kv_ref, varlen_runs
from graphs import new_record, split_record
from scheduler import BlockManager, Scheduler, Sequence


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
# Attention contexts: the explicit object the model's layers call (no module globals)

class PrefillContext:
    """New prompts packed in one row: q (1, N, Hq, D). Each prompt attends causally to itself: host
    offsets cu_seqlens, or (varlen_runs) cu, their int32 tensor, and longest, a bound on the longest.
    K/V go to the cache at slots (N,), or, inside a prefill graph, to the staging rows stage = (k, v),
    each (L, N, Hkv, D), from which the runner scatters them into the cache after the replay."""

    def __init__(self, runner, cu_seqlens, cu, longest, slots=None, stage=None):
        self.runner, self.cu_seqlens, self.cu, self.longest = runner, cu_seqlens, cu, longest
        self.slots, self.stage = slots, stage

    def attend(self, layer, q, k, v, cos, sin):
        r = self.runner
        q, k = ops.rope(q, k, cos, sin)
        if self.stage is None:
            r.store_kv(layer, k[0], v[0], self.slots)
        else:
            self.stage[0][layer].copy_(k[0])
            self.stage[1][layer].copy_(v[0])
        return packed_causal_attention(q[0], k[0], v[0], self.cu_seqlens, self.cu, self.longest)[None]


class DecodeContext:
    """One new token per sequence: q (B, 1, Hq, D); K/V come from the cache via block tables."""

    def __init__(self, runner, slots, block_tables, context_lens):
        self.runner, self.slots = runner, slots                     # (B,) int32
        self.block_tables, self.context_lens = block_tables, context_lens  # (B, nb) / (B,) int32

    def attend(self, layer, q, k, v, cos, sin):
        """cos, sin (B, 1, 1, D/2). On the Triton backend's fast path one kernel rotates q and k,
        stores k and v, and attends (taking the new token's k and v from registers)."""
        r = self.runner
        meta = (self.block_tables, self.context_lens, q.shape[-1] ** -0.5)
        if r.attn_backend == "triton" and ops.runs(q):
            cos, sin = (t[:, 0, 0] for t in (cos, sin))              # (B, D/2)
            return r.paged_attention(layer, q[:, 0], *meta, rope=(k[:, 0], v[:, 0], cos, sin, self.slots))[:, None]
        q, k = ops.rope(q, k, cos, sin)
        r.store_kv(layer, k[:, 0], v[:, 0], self.slots)
        return r.paged_attention(layer, q[:, 0], *meta)[:, None]


# ----------------------------------------------------------------------------------------------
# Runner: the KV cache, packed prefill, paged decode (graphs.py captures its steps)

ROW_KEY = 1 << 24      # a draw's key: the call's seed + sequence id · ROW_KEY + position (positions < 2^24)
MAX_GRAPH_BATCH = graphs.BUCKETS[-1]   # the most sequences one decode graph takes


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
        if attn_backend == "triton" and not ops.attention_kernels(self.device):
            raise ValueError(f"attn_backend='triton' needs triton installed and a CUDA device (or the "
                             f"interpreter), got {self.device}")
        self.partition_size, self.attn_backend = partition_size, attn_backend
        self.k_cache = self.v_cache = None
        # where the caches lie, for the kernels (ops.cache_table): graphs hold its rows, not the caches
        self.cache_table = ops.cache_table(self.num_layers, self.device) if attn_backend == "triton" else None
        self.attn_counts = None             # (rows, Hkv) int32 zeros: the attention kernel's merge counters
        self.varlen = varlen_runs(self.device, self.dtype, self.head_dim)   # a packed prefill: one flash launch
        # graphs need the sync-free kernel path (the torch reference reads lengths on the host); prefill
        # graphs need varlen attention too (one launch for all prompts)
        on = cuda_graphs and self.device.type == "cuda" and attn_backend == "triton"
        self.graphs = graphs.Graphs(self, graphs.prefill_cap(cfg, self.dtype) if self.varlen else 0) if on else None
        self.seed = torch.zeros(1, dtype=torch.int64, device=self.device)  # the call's key (row_keys)

    def reseed(self, generator=None):
        """A new key for this generate() call's draws (graphs read it in place)."""
        self.seed.random_(0, 2 ** 62, generator=generator)

    def row_keys(self, seq_ids, positions):
        """(B,) int64 on the device: each draw's key, seed + seq_id · ROW_KEY + position, from
        tensors (inside a graph: the static meta rows) or host lists."""
        if not torch.is_tensor(seq_ids):
            seq_ids, positions = self._tensor(seq_ids, torch.int64), self._tensor(positions, torch.int64)
        return self.seed + seq_ids.long() * ROW_KEY + positions.long()

    def store_kv(self, layer, k, v, slots):
        """k, v (N, Hkv, D) into layer's cache at slots (N,) (-1: skip)."""
        if self.attn_backend == "torch":
            return store_kv_ref(self.k_cache[layer], self.v_cache[layer], k, v, slots)
        ops.store_kv(self.k_cache[layer], self.v_cache[layer], k, v, slots, place=self.cache_table[layer])

    def paged_attention(self, layer, q, block_tables, context_lens, scale, rope=None):
        """q (B, Hq, D) attending to layer's cache -> (B, Hq, D); rope: as in ops.paged_attention (the
        kernels only). On the kernels, with the counters their partitions merge by; the partitioning
        is fixed per batch size (not per step), so captured CUDA graphs stay valid."""
        caches = (self.k_cache[layer], self.v_cache[layer], block_tables, context_lens, scale)
        if self.attn_backend == "torch":
            return paged_attention_ref(q, *caches)
        if self.attn_counts is None or self.attn_counts.shape[0] < q.shape[0]:
            # never during a capture (a key's first capture warms up eagerly); graphs read the counts
            # by address, so a larger eager batch (> the biggest bucket) drops them before the old
            # buffer is freed
            self.drop_graphs()
            self.attn_counts = ops.attention_counts(max(q.shape[0], MAX_GRAPH_BATCH), self.num_kv_heads,
                                                    self.device)
        return ops.paged_attention(q, *caches, place=self.cache_table[layer], max_model_len=self.max_model_len,
                                   counts=self.attn_counts, partition_size=self.partition_size, rope=rope)

    # ---- cache
    def bytes_per_block(self):
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def allocate_cache(self, num_blocks):
        if self.k_cache is not None and self.k_cache.shape[1] == num_blocks:
            return
        self.free_cache(keep_warm=True)                 # the same model: its graphs stay
        shape = (self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        if self.cache_table is not None:
            ops.place_caches(self.cache_table, self.k_cache, self.v_cache)

    def free_cache(self, keep_warm=False):
        """Drop the KV cache, e.g. before backward. keep_warm: the model and kernel settings are
        unchanged (a training step: only values changed in place), so the graphs stay: they reach
        the cache through cache_table, which the next allocate_cache points at the new one
        (graphs.py). Without it every graph goes too."""
        self.k_cache = self.v_cache = None
        if self.graphs is not None and not keep_warm:
            self.graphs.drop(prefill=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def drop_graphs(self):
        """Drop the decode graphs and the record of warmed keys (a buffer they read moved)."""
        if self.graphs is not None:
            self.graphs.drop()

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

    def logits(self, hidden):
        """(rows, H) -> (rows, V) fp32 logits (ops.logits): sample() reads them as they are."""
        return ops.logits(hidden, self.model.lm_head)

    def sample(self, logits, params, keys, record=None):
        """logits (B, V), keys (>= B,) int64 (row_keys) -> the step's record (graphs.split_record): the
        sampled tokens and their logprobs in its first B rows. record: a buffer of >= B rows to fill
        (default: a new one of B rows)."""
        B = logits.shape[0]
        record = new_record(B, logits.device) if record is None else record
        tokens, logprobs = split_record(record)
        ops.sample(logits, params, keys=keys[:B], out=(tokens[:B], logprobs[:B]))
        return record

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
        key = self.graphs.prefill_key(len(ids), len(groups)) if self.graphs is not None else None
        if key is not None:
            return self.graphs.prefill(key, ids, pos, slots, cu)
        hidden = self.packed_forward(self._tensor(ids, torch.int64), self._tensor(pos, torch.int64), cu,
                                     self._tensor(cu, torch.int32) if self.varlen else None,
                                     max(e - s for s, e in zip(cu[:-1], cu[1:])), slots=self._tensor(slots, torch.int64))
        return self.logits(hidden[[c - 1 for c in cu[1:]]])

    def packed_forward(self, ids, pos, cu_seqlens, cu, longest, *, slots=None, stage=None):
        """The model over prompts packed in one row: ids, pos (N,) -> final hidden states (N, H),
        K/V into the cache at slots or into the staging rows (PrefillContext)."""
        ctx = PrefillContext(self, cu_seqlens, cu, longest, slots=slots, stage=stage)
        return self.model(ids[None], pos[None], attn_ctx=ctx, return_hidden=True)[0]

    # ---- decode: one token per sequence
    def decode_inputs(self, seqs, rows, src_rows):
        """-> (6, rows) int32 [token, position, KV slot, context length, source row, sequence id] and (rows, width)
        block tables, built on the host in one tensor each. A token still on the GPU (sampled by the
        step in flight) is 0 here and its row in that step's output is the source row (else -1).
        Rows past len(seqs) are padding that writes no KV (slot -1) and attends to nothing (length 0)."""
        pad = rows - len(seqs)
        meta = torch.tensor([[max(s.token_ids[-1], 0) for s in seqs] + [0] * pad,
                             [len(s) - 1 for s in seqs] + [0] * pad,
                             [self._slot(s, len(s) - 1) for s in seqs] + [-1] * pad,
                             [len(s) for s in seqs] + [0] * pad,
                             list(src_rows) + [-1] * pad,
                             [s.seq_id for s in seqs] + [0] * pad], dtype=torch.int32)
        width = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
                              + [[0] * width] * pad, dtype=torch.int32)
        if self.device.type == "cuda":
            meta, tables = meta.pin_memory(), tables.pin_memory()
        return meta, tables

    @torch.inference_mode()
    def decode(self, seqs, src_rows, prev_tokens, params):
        """-> the step's record (graphs.split_record), the next token of each sequence in its first B
        rows; src_rows/prev_tokens: see above; params: as in sample(). A graph replay where graphs run."""
        B = len(seqs)
        if self.graphs is not None and B <= MAX_GRAPH_BATCH:
            return self.graphs.decode(seqs, src_rows, prev_tokens, params)
        meta, tables = (t.to(self.device, non_blocking=True) for t in self.decode_inputs(seqs, B, src_rows))
        hidden = self.run_decode(meta, tables, prev_tokens)[:, 0]                      # (B, H)
        return self.sample(self.logits(hidden), params, self.row_keys(meta[5], meta[1]))

    def run_decode(self, meta, tables, prev_tokens):
        """meta (6, B), tables (B, width) on the device, prev_tokens: the step in flight's tokens
        (or None), filled into meta's tokens first -> final hidden states (B, 1, H)."""
        if prev_tokens is not None:
            ops.fill_tokens(meta, prev_tokens)
        ctx = DecodeContext(self, meta[2], tables, meta[3])
        return self.model(meta[0][:, None], meta[1][:, None], attn_ctx=ctx, return_hidden=True)


# ----------------------------------------------------------------------------------------------
# Engine: the public API

def activation_reserve(cfg, prefill_tokens: int, rows: int) -> int:
    """Bytes a generate() call leaves free beside its KV cache: prefill activations (a few (N, hidden) and
    (N, intermediate) bf16 tensors, counted at 4 bytes) and the sampler's fp32 (B, V) temporaries for
    `rows` sequences decoded at once, plus 512 MiB of slack (the decode graphs' pool among it)."""
    return (prefill_tokens * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * 4
            + rows * cfg.vocab_size * 16 + (1 << 29))


class LLMEngine:
    """engine = LLMEngine(model); engine.generate(prompts, SamplingParams(...)); engine.free_cache()

    num_blocks: fixed cache size; None sizes it to what the call needs, capped on GPU at
    gpu_memory_utilization of the free memory (minus a reserve for prefill activations).
    CUDA graphs read the parameters in place, so in-place updates (optimizer steps, AQN noise, a
    merge: lora.merged_sampling) are seen; after rebinding a parameter (e.g. load_adapter), call
    free_cache() to recapture. A graph replays the kernels its capture ran, the adapters' among them,
    so a call that finds other adapters on than the last one did (lora.adapters_disabled or
    merged_sampling around some calls only) drops every graph first (_adapters_changed)."""

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
        attn_backend = attn_backend or ("triton" if device.type == "cuda" and ops.attention_kernels(device) else "torch")
        self.model, self.block_size, self.num_blocks = model, block_size, num_blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len, self.gpu_memory_utilization = max_model_len, gpu_memory_utilization
        self.runner = Runner(model, block_size, max_model_len, attn_backend, cuda_graphs, partition_size)
        eos = getattr(cfg, "eos_token_ids", None) or getattr(cfg, "eos_token_id", None)
        self.eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        self.stats = {}
        self.adapters_on = None      # which adapters were on in the last call (None: no call yet)

    def free_cache(self, keep_warm=False):
        """Drop the KV cache. keep_warm: nothing but parameter values changed in place since the last
        generate() (a training step: the same modules, tensors, adapters and tuning), so the CUDA
        graphs stay and the next call replays them on its new cache. Anything else (a reloaded
        adapter, another dtype) needs free_cache() without it, which drops every graph."""
        self.runner.free_cache(keep_warm)

    def cache_bytes(self) -> int:
        """Bytes the KV cache holds now (0 when freed)."""
        k = self.runner.k_cache
        return 0 if k is None else 2 * k.numel() * k.element_size()

    def _cache_blocks(self, need, prefill_tokens, rows):
        """How many blocks to allocate for a call that needs `need` (no sharing assumed) and decodes at
        most `rows` sequences at once."""
        if self.num_blocks is not None:
            return self.num_blocks
        r = self.runner
        if r.device.type != "cuda":
            return need
        held = 0 if r.k_cache is None else 2 * r.k_cache.numel() * r.k_cache.element_size()
        cached = torch.cuda.memory_reserved(r.device) - torch.cuda.memory_allocated(r.device)
        free = plan.free_memory(r.device) + cached + held - activation_reserve(self.model.config, prefill_tokens, rows)
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

    def _launch(self, kind, batch, copies, pending, params):
        """Queue one step on the GPU: forward, sampling, and an asynchronous copy of the tokens and
        logprobs to the host. Each sequence gets a placeholder token (-1) at once, so the scheduler
        sees its true length while the value is still on the GPU. -> the step: a dict of its
        sequences, their token slots, the record's tokens on the device, its host copy, an event."""
        r = self.runner
        if kind == "prefill":
            assert pending is None, "a prefill reads every token on the host: drain the step in flight first"
            seqs = [s for g in batch for s in g]
            logits = r.prefill(batch)                                        # (groups, V)
            keys = r.row_keys([s.seq_id for s in seqs], [len(s) - 1 for s in seqs])
            record = r.sample(logits[[i for i, g in enumerate(batch) for _ in g]], params, keys)
        else:
            seqs = batch
            r.copy_blocks(copies)
            rows = {id(s): i for i, s in enumerate(pending["seqs"])} if pending else {}
            src = [rows[id(s)] if s.token_ids[-1] < 0 else -1 for s in seqs]
            record = r.decode(seqs, src, pending["tokens"] if pending else None, params)
        host = torch.empty(record.shape, dtype=record.dtype, pin_memory=record.is_cuda)
        host.copy_(record, non_blocking=True)
        event = torch.cuda.Event() if record.is_cuda else None
        if event is not None:
            event.record()
        index = []
        for seq in seqs:
            index.append(len(seq))
            seq.token_ids.append(-1)
            seq.logprobs.append(float("nan"))
        return dict(seqs=seqs, index=index, tokens=split_record(record)[0], host=host, event=event)

    def _apply(self, step, sched, stop, done):
        """Wait for a launched step's tokens; fill the placeholders; finish sequences that sampled a
        stop token or reached max_tokens, dropping whatever was sampled after that."""
        if step["event"] is not None:
            step["event"].synchronize()
        B = len(step["seqs"])
        tokens, logprobs = (t[:B].tolist() for t in split_record(step["host"]))
        for seq, i, tok, lp in zip(step["seqs"], step["index"], tokens, logprobs):
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

    def _schedule(self, prompts, params):
        """The call's KV cache (allocated to fit) and a Scheduler holding its n sequences a prompt."""
        bs = self.block_size
        max_new = [min(params.max_tokens, self.max_model_len - len(p)) for p in prompts]
        seq_blocks = [-(-(len(p) + m) // bs) for p, m in zip(prompts, max_new)]
        num_blocks = self._cache_blocks(sum(b * params.n for b in seq_blocks),
                                         min(self.max_num_batched_tokens, sum(map(len, prompts))),
                                         min(self.max_num_seqs, len(prompts) * params.n))
        i = max(range(len(prompts)), key=lambda j: seq_blocks[j])
        if seq_blocks[i] > num_blocks:
            raise ValueError(f"prompt {i} ({len(prompts[i])} tokens) + max_tokens {max_new[i]} needs "
                             f"{seq_blocks[i]} KV blocks of {bs} tokens, but the cache has {num_blocks}: "
                             f"lower max_tokens or give the cache more memory")
        r = self.runner
        if r.k_cache is None or r.k_cache.shape[1] < num_blocks:
            r.allocate_cache(num_blocks)
        sched = Scheduler(BlockManager(r.k_cache.shape[1], bs), self.max_num_seqs, self.max_num_batched_tokens)
        for pi, p in enumerate(prompts):
            sched.add([Sequence(pi * params.n + j, pi, j, p, max_new[pi]) for j in range(params.n)])
        return sched

    @torch.inference_mode()
    def generate(self, prompts, params: SamplingParams):
        """prompts: list of token-id lists -> completions[prompt_index][sample_index]."""
        t0 = time.perf_counter()
        # time to first token, on the GPU: from an event at the call to one after the first step's
        # sampling (work queued before the call is not counted). The host reads those tokens one
        # step later (first_read_s), after queuing the next step and capturing its graph.
        r, cuda = self.runner, self.runner.device.type == "cuda"
        start, first = (torch.cuda.Event(enable_timing=True) for _ in range(2)) if cuda else (None, None)
        if cuda:
            start.record()
        self._check_prompts(prompts, params)
        if self._adapters_changed():
            self.free_cache()
        sched = self._schedule(prompts, params)
        stop = set(params.stop_token_ids if params.stop_token_ids is not None else self.eos_ids)
        r.reseed(None if params.seed is None else torch.Generator(device=r.device).manual_seed(params.seed))
        was_training = self.model.training
        self.model.eval()                                  # LoRA dropout off while sampling
        done, steps, first_read = [], {"prefill": 0, "decode": 0}, None
        pending = None                     # the step in flight: its tokens are not on the host yet

        def take(step):                    # its tokens into the sequences (waits for the GPU)
            nonlocal first_read
            self._apply(step, sched, stop, done)
            watchdog.beat("a sampler step")
            first_read = first_read if first_read is not None else time.perf_counter() - t0

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
                step = self._launch(kind, batch, copies, pending, params)
                if not any(steps.values()):                # the first step's samples are queued
                    first_host = time.perf_counter() - t0      # on the CPU, computed: it runs synchronously
                    if cuda:
                        first.record()
                steps[kind] += 1
                if pending:                            # the GPU runs `step` while the host reads this
                    take(pending)
                pending = step
            if pending:                                # only rows of finished sequences are left
                take(pending)
        finally:
            self.model.train(was_training)
        assert sched.bm.num_free() == sched.bm.num_blocks, "KV blocks leaked"
        self.stats = dict(num_blocks=r.k_cache.shape[1], preemptions=sched.num_preemptions,
                          prefill_steps=steps["prefill"], decode_steps=steps["decode"], first_read_s=first_read,
                          ttft_s=start.elapsed_time(first) / 1e3 if cuda else first_host,
                          total_s=time.perf_counter() - t0,
                          new_tokens=sum(len(s) - s.num_prompt_tokens for s in done))
        return self._completions(done, len(prompts), params.n)

    def _adapters_changed(self) -> bool:
        """Are other adapters on than in the last call? (Notes this call's.)"""
        on = tuple(m.enabled for m in lora.lora_modules(self.model).values())
        changed, self.adapters_on = self.adapters_on is not None and on != self.adapters_on, on
        return changed

    @staticmethod
    def _completions(done, prompts, n):
        """The finished sequences as completions[prompt_index][sample_index]."""
        out = [[None] * n for _ in range(prompts)]
        for s in done:
            out[s.prompt_index][s.sample_index] = Completion(
                s.prompt_index, s.sample_index, s.completion_ids, s.logprobs, s.finish_reason)
        return out


def generate(model, prompts, params: SamplingParams, **engine_kwargs):
    """One-shot: build an engine, generate, free the cache. Hold an LLMEngine to reuse graphs."""
    engine = LLMEngine(model, **engine_kwargs)
    try:
        return engine.generate(prompts, params)
    finally:
        engine.free_cache()
