"""Tests for scheduler.py: the pure-Python block manager (fork, copy on write, free) and scheduler
(a group prefilled once, preemption of the newest by recompute, sequences whose last token is still
in flight). No tensors, no model: the engine runs them end to end in tests/test_rollout.py."""
from scheduler import BlockManager, Scheduler, Sequence

# ----------------------------------------------------------------------------------------------
# BlockManager and Scheduler (pure Python)

def _seq(i, n_tokens, max_tokens=100):
    return Sequence(i, i, 0, list(range(1, n_tokens + 1)), max_tokens)


def test_block_manager_fork_shares_blocks_and_copies_partial_block_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child = _seq(0, 6), _seq(1, 6)
    bm.allocate(parent)                                  # 6 tokens -> 2 blocks
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and bm.num_free() == 6
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2]
    # both sample a token: position 6 lies in the shared partial block 1
    parent.token_ids.append(7)
    child.token_ids.append(9)
    assert bm.needs_block(parent)
    copy = bm.append_slot(parent)                        # parent copies, child keeps the original
    assert copy == (child.block_table[1], parent.block_table[1])
    assert parent.block_table[0] == child.block_table[0] != parent.block_table[1]
    assert not bm.needs_block(child) and bm.append_slot(child) is None   # now sole owner
    assert bm.num_free() == 5
    # crossing a block boundary allocates, freeing returns everything
    for t in (8, 9):
        parent.token_ids.append(t)
        bm.append_slot(parent)
    assert len(parent.block_table) == 3
    bm.free(parent)
    bm.free(child)
    assert bm.num_free() == 8 and all(c == 0 for c in bm.ref_counts)


def test_block_manager_full_prompt_block_needs_no_copy():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = _seq(0, 8), _seq(1, 8)
    bm.allocate(a)
    bm.fork(a, b)
    a.token_ids.append(1)
    b.token_ids.append(2)
    assert bm.append_slot(a) is None and bm.append_slot(b) is None  # new blocks, no copies
    assert a.block_table[:2] == b.block_table[:2] and a.block_table[2] != b.block_table[2]


def test_scheduler_prefills_group_once_then_decodes():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    group = [Sequence(j, 0, j, [5, 6, 7, 8, 9], 10) for j in range(3)]
    sched.add(group)
    kind, groups, _ = sched.schedule()
    assert kind == "prefill" and groups == [group]
    assert bm.num_free() == 14                           # 5 tokens -> 2 blocks, shared by 3
    for j, s in enumerate(group):
        s.token_ids.append(j)
    kind, seqs, copies = sched.schedule()
    assert kind == "decode" and seqs == group
    assert len(copies) == 2                              # two of three copy the partial block
    assert len({s.block_table[1] for s in group}) == 3


def _two_prefilled(num_blocks, max_a, max_b):
    """A scheduler (2-token blocks) that has just prefilled a = [1, 2] and b = [3, 4]."""
    bm = BlockManager(num_blocks=num_blocks, block_size=2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = Sequence(0, 0, 0, [1, 2], max_a), Sequence(1, 1, 0, [3, 4], max_b)
    sched.add([a])
    sched.add([b])
    kind, groups, _ = sched.schedule()
    assert kind == "prefill" and groups == [[a], [b]]
    return bm, sched, a, b


def test_scheduler_preempts_newest_and_resumes_by_recompute():
    bm, sched, a, b = _two_prefilled(3, 10, 10)
    assert bm.num_free() == 1
    a.token_ids.append(5)
    b.token_ids.append(6)
    kind, seqs, _ = sched.schedule()                     # both need a new block, one is free: b is evicted
    assert kind == "decode" and seqs == [a] and sched.num_preemptions == 1
    assert b.block_table == [] and list(sched.waiting) == [[b]]
    sched.finish(a)
    kind, groups, _ = sched.schedule()                   # b comes back with its 3 tokens
    assert kind == "prefill" and groups == [[b]] and len(b.block_table) == 2


def test_scheduler_skips_a_sequence_whose_last_token_is_in_flight_and_finishes_a_waiting_one():
    bm, sched, a, b = _two_prefilled(8, 1, 5)
    a.token_ids.append(-1)                               # a's one allowed token: still on the GPU
    b.token_ids.append(-1)
    kind, seqs, _ = sched.schedule()
    assert kind == "decode" and seqs == [b]              # a is not decoded past max_tokens ...
    assert a in sched.running and a.block_table          # ... and keeps its blocks until the token lands
    sched.finish(a)
    sched.finish(b)
    assert sched.done() and bm.num_free() == 8
    # preempted while its token is in flight, then that token turns out to be a stop token
    bm, sched, a, b = _two_prefilled(3, 5, 5)
    a.token_ids.append(-1)
    b.token_ids.append(-1)
    kind, seqs, _ = sched.schedule()                     # one free block: b is evicted
    assert seqs == [a] and list(sched.waiting) == [[b]]
    sched.finish(b)                                      # b's in-flight token was a stop
    assert not sched.waiting and sched.running == [a]
    sched.finish(a)
    assert sched.done() and bm.num_free() == 3
