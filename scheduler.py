"""Sequence, BlockManager, Scheduler: the pure-Python half of the paged sampler (rollout.py).

No tensors here, no torch import: these three decide *what* the next step computes; the Runner in
rollout.py does all the tensor work. The split is nano-vllm's:

    Sequence      plain state of one completion: its tokens, logprobs and block table
    BlockManager  fixed-size KV blocks, reference counts, a free list; it returns copy orders
                  (src, dst) and never touches the cache itself
    Scheduler     waiting / running queues, prefill first, then decode steps, preemption by
                  recompute when blocks run out (never an out-of-memory crash)

Blocks. The KV cache is cut into blocks of block_size positions; a sequence's block table maps its
position t to slot `block_table[t // block_size] * block_size + t % block_size` (the cache layout
itself is in paged_attention.py).

GRPO sharing. The n samples of one prompt are prefilled once: the first sample allocates the
prompt's blocks, the others `fork` it (reference count + 1). Full blocks are never written again;
the partial last block is copied on write when a sample first appends to it.

Preemption by recompute. When a decode step needs a block and none is free, the most recently
admitted sequence is evicted (its blocks freed) and later re-prefilled from prompt + its tokens
so far; the oldest running sequence always makes progress, so nothing hangs. (The engine rejects
up front a sequence whose prompt + max_tokens alone exceeds the whole cache.)

One step late. The engine reads each step's sampled tokens only after it has queued the next
step (rollout.py explains why), so a new token is a placeholder (-1) here until its value lands:
the scheduler works with lengths, and a sequence whose last allowed token is still in flight is
not decoded again (it keeps its blocks until `finish`).

Tests: tests/test_scheduler.py (fork and copy on write, prefill once then decode, preemption and
recompute, in-flight last tokens); the engine tests in tests/test_rollout.py run it end to end.
"""
from collections import deque


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
