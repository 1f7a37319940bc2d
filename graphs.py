"""CUDA graphs for the sampler: a decode step, or a short prefill, as one replay.

Why. A 7B decode step is ~500 kernel launches; from Python each costs several µs of host time, more
than the GPU needs for many of them at a small batch. Captured once in a CUDA graph, the step is one
replay. The catch: a graph replays the same kernels on the same addresses. So everything a step
reads or writes lives in static buffers at fixed addresses, and the host fills them before each
replay (nano-vllm's scheme; it does its graphs in one function, these need a few more rules).

Decode graphs (`Graphs.decode`): one per (batch bucket, temperature), captured lazily and sharing one
memory pool. A step of B sequences runs the graph of the smallest bucket >= B (BUCKETS), its padding
rows writing no KV (slot -1) and attending to nothing. The graphs reach the KV cache through the
runner's cache table (kernels/paged_decode.py: where the caches lie), not through their addresses,
so they outlive the cache, which every training step frees before its backward pass: a run captures
each bucket once, and its pool stays allocated beside the training pass. The graph reads

    meta    (6·n,) int32    rows [token, position, KV slot, context length, source row, sequence id]
    tables  (n, width)      the block tables
    record  (12·n,) uint8   the step's samples: tokens (int64) then logprobs (fp32), one buffer so
                            that one copy takes them to the host; its tokens are also the tokens of
                            the step in flight, which the next graph fills into meta[0] itself

and, where sampling is the kernels' path (no top-k / top-p), runs the lm_head and the sampler too.
Otherwise it stops at the final hidden states and the runner samples eagerly. A graph reads the
adapters' kept casts as they are (ops.casts_kept): the prefill that starts every generate() call
has refreshed them.

Prefill graphs (`Graphs.prefill`): one per (token bucket, prompt bucket) up to a token budget (its
activations stay under PREFILL_GRAPH_BYTES, as its pool outlives the KV cache). The prompts are
packed in one row of tb tokens: the N real ones, then padding, which forms pb - g extra prompts (pb
the prompt bucket, g the real prompts) of one token each, the last taking the rest; causal attention
keeps the padding out of every real row. One buffer holds the graph's inputs, filled by one copy:
[ids (tb) | positions (tb) | prompt offsets (pb + 1) | KV slots (N, then unused) | each prompt's
last row (g, then unused)]. The graph stores K/V in staging rows, not in the cache: the cache is
freed before every backward pass, the graph is not, so a training step replays what an earlier step
captured, and one index_copy per K and V moves the N real rows into the cache after the replay.

Warm-up. A key's first capture runs its body once eagerly, outside the capture (a Triton kernel
cannot load its binary while a stream captures); the record of warmed keys, with the kernel
settings they ran under, lets a later capture of the key skip it. A decode key's first capture also
warms every smaller bucket at once, on padding rows (`_warm_below`): a batch shrinks through them as
its sequences finish, and each compiles kernels of its own. A training step's free_cache(keep_warm=True)
keeps the graphs and the record (the model is the same and only its values changed in place); any
other free_cache, and a replaced static buffer, drop both.

Tests: tests/test_rollout.py (GPU-marked: graphs against eager steps, the prefill graph's cache
contents, tokens and logprobs under three padding layouts, prefill and decode graphs outliving
free_cache(keep_warm) and replaying on a cache allocated elsewhere).
"""
import torch

import ops

META_ROWS = 6          # decode inputs a row: token, position, KV slot, context length, source row, sequence id
PREFILL_GRAPH_BYTES = 1 << 28   # activations a prefill graph may hold: its pool outlives the KV cache
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)   # decode rows
PREFILL_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096)                                       # prefill tokens


def new_record(rows, device):
    """A step's record: one uint8 buffer of 12 bytes a row holding the sampled tokens (int64) and
    then their logprobs (fp32), so that one copy takes a step's samples to the host."""
    return torch.empty(12 * rows, dtype=torch.uint8, device=device)


def split_record(record):
    """A record (12·n,) uint8 -> its views tokens (n,) int64, logprobs (n,) fp32."""
    n = record.numel() // 12
    return record[:8 * n].view(torch.int64), record[8 * n:].view(torch.float32)


def prefill_cap(cfg, dtype) -> int:
    """The largest prefill token bucket whose activations (a few (T, hidden) and (T, intermediate)
    tensors) fit PREFILL_GRAPH_BYTES, or 0."""
    per_token = (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * dtype.itemsize
    fits = [t for t in PREFILL_TOKENS if t * per_token <= PREFILL_GRAPH_BYTES]
    return fits[-1] if fits else 0


# ----------------------------------------------------------------------------------------------

class Graphs:
    """The runner's CUDA graphs (module docstring). runner: the rollout.Runner whose steps they
    capture (its model, cache, inputs and sampler); cap: prefill_cap, or 0 for no prefill graphs."""

    def __init__(self, runner, cap: int):
        self.runner, self.prefill_cap = runner, cap
        self.decode_graphs, self.decode_pool, self.static = {}, None, None
        self.prefill_graphs, self.prefill_pool, self.stage = {}, None, None
        self.warmed = set()                 # (graph key, kernel settings) captured before (see _record)

    def drop(self, prefill=False):
        """Drop the decode graphs, their pool and the record of warmed keys, so that the next capture
        of each key warms up first (a buffer they read moved, or the model changed); with prefill
        the prefill graphs too."""
        self.decode_graphs, self.decode_pool, self.warmed = {}, None, set()
        if prefill:
            self.prefill_graphs, self.prefill_pool, self.stage = {}, None, None

    def _record(self, key, body, pool):
        """-> (graph, its output): body() captured in a CUDA graph sharing `pool`, after an eager
        warm-up where the key (with the kernel settings) has not run before (module docstring)."""
        warm = (key, ops.kernel_settings())
        if warm not in self.warmed:                  # kernels compile outside any capture
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                body()
            torch.cuda.current_stream().wait_stream(stream)
            self.warmed.add(warm)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = body()
        return graph, out

    # ---- prefill: one graph per (token bucket, prompt bucket), kept across training steps
    def prefill_key(self, tokens, prompts):
        """The graph a prefill of `tokens` tokens in `prompts` prompts replays, or None (eager):
        (token bucket, prompts rounded up to a power of two, kernel settings). The bucket leaves a
        token for each padding prompt, so that no prompt of the graph is empty."""
        if not self.prefill_cap:
            return None
        pb = 1 << (prompts - 1).bit_length()
        tb = next((t for t in PREFILL_TOKENS if t >= tokens + pb - prompts), None)
        return None if tb is None or tb > self.prefill_cap else (tb, pb, ops.kernel_settings())

    def prefill(self, key, ids, pos, slots, cu):
        """A prefill as one replay of key's graph, the cache filled after it -> (g, V) logits of
        each prompt's last token (module docstring: the padding and the input buffer)."""
        r, (tb, pb, _) = self.runner, key
        n, g = len(ids), len(cu) - 1
        offsets = cu[:g] + [n + i for i in range(pb - g)] + [tb]
        last = [c - 1 for c in cu[1:]]
        pad, spare = [0] * (tb - n), [0] * (pb - g)
        segments = [ids, pad, pos, pad, offsets, slots, pad, last, spare]    # tb | tb | pb + 1 | tb | pb
        host = torch.tensor([v for seg in segments for v in seg], dtype=torch.int64, pin_memory=True)
        entry = self.prefill_graphs.get(key)
        buf = entry[1] if entry else torch.empty(host.shape, dtype=torch.int64, device=r.device)
        buf.copy_(host, non_blocking=True)
        if entry is None:                      # captured on the real inputs (the warm-up runs them)
            entry = self.prefill_graphs[key] = self._capture_prefill(tb, pb, buf)
        graph, _, hidden = entry                                                  # hidden (tb, H)
        graph.replay()
        slots_t, last_t = buf[2 * tb + pb + 1:][:n], buf[3 * tb + pb + 1:][:g]
        for cache, stage in zip((r.k_cache, r.v_cache), self.stage):             # (L, blocks, bs, Hkv, D)
            cache.view(r.num_layers, -1, r.num_kv_heads, r.head_dim).index_copy_(1, slots_t, stage[:, :n])
        return r.logits(hidden[last_t])

    def _capture_prefill(self, tb, pb, buf):
        """-> (graph, buf, hidden (tb, H)): the model over buf's tokens, K/V into the staging rows
        (allocated once, outside the graphs' pool, for the largest bucket)."""
        r = self.runner
        if self.stage is None:
            shape = (r.num_layers, self.prefill_cap, r.num_kv_heads, r.head_dim)
            self.stage = tuple(torch.empty(shape, device=r.device, dtype=r.dtype) for _ in range(2))
        ids, pos, offsets = buf[:tb], buf[tb:2 * tb], buf[2 * tb:2 * tb + pb + 1]
        stage = tuple(s[:, :tb] for s in self.stage)                               # (L, tb, Hkv, D)

        def body():
            return r.packed_forward(ids, pos, None, offsets.to(torch.int32), tb, stage=stage)

        graph, hidden = self._record(("prefill", tb, pb), body, self.prefill_pool)
        self.prefill_pool = graph.pool()
        return graph, buf, hidden

    # ---- decode: one graph per batch bucket (and temperature), captured lazily, one pool
    def decode(self, seqs, src_rows, prev_tokens, params):
        """The step of rollout.Runner.decode as a replay -> its record."""
        r, B = self.runner, len(seqs)
        bucket = next(b for b in BUCKETS if b >= B)
        meta, tables = r.decode_inputs(seqs, bucket, src_rows)
        static_meta, static_tables, record = self._static_buffers(0 if prev_tokens is None else len(prev_tokens))
        static_meta[:META_ROWS * bucket].view(META_ROWS, bucket).copy_(meta, non_blocking=True)   # two host->device copies
        static_tables[:bucket, :tables.shape[1]].copy_(tables, non_blocking=True)
        prev = split_record(record)[0]
        if prev_tokens is not None and prev_tokens.data_ptr() != prev.data_ptr():
            prev[:len(prev_tokens)].copy_(prev_tokens)   # not from a graph: a prefill or an eager step
        key, in_graph = self._key(bucket, params)
        if key not in self.decode_graphs:
            self._warm_below(bucket, params, meta)
            self.decode_graphs[key] = self._capture(key, bucket, in_graph)
        graph, out = self.decode_graphs[key]
        graph.replay()
        if in_graph is not None:
            return out
        keys = r.row_keys([s.seq_id for s in seqs], [len(s) - 1 for s in seqs])
        return r.sample(r.logits(out[:B]), params, keys)

    def _key(self, bucket, params):
        """-> (graph key, params for the graph or None): the lm_head and the sampler join the graph
        where sampling is the kernels' path for this many rows."""
        r = self.runner
        if ops.sampler_runs(params, (bucket, r.model.lm_head.out_features), r.device):
            return (bucket, params.temperature), params
        return (bucket, None), None

    def _warm_below(self, bucket, params, meta):
        """The eager warm-up of every smaller bucket not warmed yet, on padding rows (KV slot -1,
        length 0: nothing written, nothing attended), then this step's inputs put back. A generate
        call's batch shrinks through the buckets as its sequences finish, and a bucket's first run
        compiles the Triton kernels its row count selects (attention partitions, sampler chunks, GEMV
        and LoRA variants, integer arguments specialized on 1 and on multiples of 16): seconds, paid
        here, when a larger bucket is first reached, rather than by whichever later step first
        shrinks to each size."""
        r = self.runner
        static_meta, static_tables, record = self._static_buffers()      # tables: unread by padding rows
        cold = [b for b in BUCKETS if b < bucket and (self._key(b, params)[0], ops.kernel_settings()) not in self.warmed]
        if not cold:
            return
        saved = record.clone()                      # the step in flight's tokens: the warm-ups overwrite them
        prev = split_record(record)[0]
        for b in cold:
            key, p = self._key(b, params)
            pad = torch.zeros(META_ROWS, b, dtype=torch.int32)
            pad[2], pad[4] = -1, -1                 # rollout.Runner.decode_inputs' padding rows
            m = static_meta[:META_ROWS * b].view(META_ROWS, b)
            m.copy_(pad)
            with ops.casts_kept():
                hidden = r.run_decode(m, static_tables[:b], prev)[:, 0]
                if p is not None:
                    r.sample(r.logits(hidden), p, r.row_keys(m[5], m[1]), record)
            self.warmed.add((key, ops.kernel_settings()))
        record.copy_(saved)
        static_meta[:META_ROWS * bucket].view(META_ROWS, bucket).copy_(meta)   # this step's rows again

    def _static_buffers(self, prev_rows=0):
        """[meta (6·n,), tables (n, width), record (12·n',)]: what the graphs read and write by address.
        A graph of b rows reads meta[:6·b] as (6, b), contiguous, so that its host copy is one plain
        copy (a strided view of a (6, n) tensor takes a copy kernel as well). A step with more rows
        than the record holds (a large prefill) replaces it and drops the graphs that use it."""
        r, n = self.runner, BUCKETS[-1]
        if self.static is None:
            self.static = [torch.zeros(META_ROWS * n, dtype=torch.int32, device=r.device),
                           torch.zeros(n, r.max_blocks_per_seq, dtype=torch.int32, device=r.device),
                           new_record(n, r.device)]
        if len(split_record(self.static[2])[0]) < prev_rows:   # new addresses, maybe another alignment
            self.drop()
            self.static[2] = new_record(prev_rows, r.device)
        return self.static

    def _capture(self, key, bucket, params):
        """A graph of the decode step for `bucket` rows: up to the final hidden states (params None),
        or through the lm_head and the sampler at params.temperature into the static record."""
        r = self.runner
        static_meta, static_tables, record = self._static_buffers()
        meta, tables = static_meta[:META_ROWS * bucket].view(META_ROWS, bucket), static_tables[:bucket]
        prev = split_record(record)[0]

        def step():
            hidden = r.run_decode(meta, tables, prev)[:, 0]                          # (bucket, H)
            if params is None:
                return hidden
            return r.sample(r.logits(hidden), params, r.row_keys(meta[5], meta[1]), record)

        warming = (key, ops.kernel_settings()) not in self.warmed
        saved = record.clone() if warming else None  # the warm-up samples: put back what it overwrites
        with ops.casts_kept():
            graph, out = self._record(key, step, self.decode_pool)
        if warming:
            record.copy_(saved)
        self.decode_pool = graph.pool()
        return graph, out
