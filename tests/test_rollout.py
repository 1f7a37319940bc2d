"""Tests for rollout.py: the sampler against transformers' generate and a dense forward, the pure
Python block manager and scheduler, the Triton kernels (interpreter on CPU) against the torch
reference, bad input, and GPU-marked checks of the CUDA paths (kernels, CUDA graphs)."""
import math
import os
import random

import pytest
import torch

import rollout
from rollout import (BlockManager, LLMEngine, Scheduler, SamplingParams, Sequence, generate,
                     paged_attention_ref, sample, store_kv_ref)

# ----------------------------------------------------------------------------------------------
# SamplingParams validation


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
])
def test_sampling_params_reject_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


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


# ----------------------------------------------------------------------------------------------
# Sampler

def test_sample_greedy_top_k_top_p_and_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    tok, lp = sample(logits, SamplingParams(temperature=0))
    assert torch.equal(tok, logits.argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0])
    # top_k=1 and a tiny top_p both collapse to greedy with logprob 0
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6)):
        tok, lp = sample(logits, params)
        assert torch.equal(tok, logits.argmax(-1)) and torch.all(lp == 0)


def test_sample_draws_from_the_filtered_distribution():
    """Empirical frequencies of the exponential race match softmax(logits/T) restricted by top-k/p."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9, seed=0)
    p = torch.softmax(logits / 0.7, -1)
    p[4:] = 0                                            # top-k 4
    p /= p.sum()
    keep = (torch.cumsum(p, 0) - p) < 0.9                # top-p
    p = torch.where(keep, p, 0)
    p /= p.sum()
    g = torch.Generator().manual_seed(0)
    tok, lp = sample(logits.expand(200_000, -1), params, g)
    freq = torch.bincount(tok, minlength=6).double() / tok.numel()
    assert (freq - p.double()).abs().max() < 5e-3, f"freq {freq} vs p {p}"
    torch.testing.assert_close(lp, p.log()[tok], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Triton kernels (TRITON_INTERPRET=1 on CPU) against the torch reference

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
@pytest.mark.parametrize("partition, tile", [(32, 16), (32, 64), (64, 64), (48, 64)])
def test_paged_attention_triton_matches_reference(dtype, partition, tile):
    # GQA 6/2 (G=3, padded to 16), contexts spanning 1..4 partitions, one empty row; tiles of one
    # block, of several blocks, and (48, 64 -> 32) not dividing the partition
    ctx = [1, 17, 40, 0, 97]
    q, kc, vc, tables, lens = _random_paged(5, 6, 2, 16, 16, 48, ctx, dtype)
    ref = paged_attention_ref(q, kc, vc, tables, lens, 0.25)
    out = rollout.paged_attention_triton(q, kc, vc, tables, lens, 0.25, num_parts=-(-128 // partition),
                                         partition_size=partition, tile=tile)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (out.float() - ref.float()).abs()
    assert err.max() < tol, f"max err {err.max():.2e} mean {err.mean():.2e}"
    assert torch.all(out[3] == 0)


@pytest.mark.interpreter
def test_store_kv_triton_matches_reference():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(6, 2, 16, generator=g)[:, :, :]
    v = torch.randn(6, 2, 16, generator=g)
    slots = torch.tensor([5, 0, -1, 17, 31, 8])
    caches = [torch.randn(4, 8, 2, 16, generator=g) for _ in range(2)]
    ref = [c.clone() for c in caches]
    store_kv_ref(ref[0], ref[1], k, v, slots)
    rollout.store_kv_triton(caches[0], caches[1], k, v, slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])
    # a non-contiguous view (k sliced out of a fused qkv row) also works
    qkv = torch.randn(6, 2, 48, generator=g)
    rollout.store_kv_triton(caches[0], caches[1], qkv[..., 16:32], qkv[..., 32:], slots)
    store_kv_ref(ref[0], ref[1], qkv[..., 16:32], qkv[..., 32:], slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv_triton_matches_rope_then_store(dtype):
    """Decode's one kernel for RoPE + KV store: q rotated in place, k rotated into the cache, v
    beside it, slot -1 skipped, against model.apply_rope + store_kv_ref. q, k, v are column slices
    of one row per sequence, as the stacked q/k/v matmul leaves them."""
    from model import apply_rope
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"        # on CPU: the Triton interpreter
    B, Hq, Hkv, D = 5, 6, 2, 16
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, generator=g).to(dev, dtype)
    q, k, v = (t.view(B, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], -1))   # (B, H*, D)
    angles = torch.rand(B, D // 2, generator=g).to(dev) * 300
    cos, sin = angles.cos(), angles.sin()                                               # (B, D/2)
    slots = torch.tensor([5, -1, 17, 31, 0], device=dev)
    caches = [torch.randn(4, 8, Hkv, D, generator=g).to(dev, dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    want_q, want_k = (apply_rope(x[:, None], cos[:, None, None], sin[:, None, None])[:, 0] for x in (q, k))
    store_kv_ref(want[0], want[1], want_k, v, slots)
    k_v_before = qkv[:, Hq * D:].clone()
    out = rollout.rope_store_kv_triton(q, k, v, cos, sin, caches[0], caches[1], slots)
    # fp32: the same fp32 math; bf16: one rounding step apart (the interpreter truncates to bf16)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2e-2)
    assert out.data_ptr() == q.data_ptr(), "q must be rotated in place"
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(caches[0], want[0], **tol)
    assert torch.equal(caches[1], want[1]), "v is copied as is, to the slots only"
    assert torch.equal(qkv[:, Hq * D:], k_v_before), "k and v themselves stay unrotated"


# ----------------------------------------------------------------------------------------------
# The engine on real model code (model.py), CPU fp32, against transformers

def _load(path, device="cpu", dtype=torch.float32):
    from model import load_model
    return load_model(path, quant="bf16", device=device, dtype=dtype)


def _prompts(lengths, vocab=256, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _hf_greedy(hf, prompt, max_new):
    out = hf.generate(torch.tensor([prompt], device=hf.device), max_new_tokens=max_new, do_sample=False,
                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=hf.device))
    return out[0, len(prompt):].tolist()


def _dense_logits(model, prompt, completion):
    ids = torch.tensor([prompt + completion], device=next(model.parameters()).device)
    with torch.no_grad():
        return model(ids)[0, len(prompt) - 1:-1].double()        # (len(completion), V)


@pytest.mark.parametrize("arch, tie, num_blocks", [("qwen2", False, None), ("llama", True, None),
                                                    ("qwen2", False, 12)])
def test_greedy_matches_hf_generate_tiny(tiny_hf_dir, arch, tie, num_blocks):
    """Prompts of different lengths in one batch, 2 samples each sharing the prompt's blocks;
    num_blocks=12 (4-token blocks) cannot hold the batch at once and forces preemption."""
    path, hf = tiny_hf_dir(arch, tie)
    model = _load(path)
    prompts = _prompts([3, 11, 20, 6])
    engine = LLMEngine(model, block_size=4, num_blocks=num_blocks)
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, n=2, stop_token_ids=()))
    if num_blocks is not None:
        assert engine.stats["preemptions"] > 0, engine.stats
    for p, comps in zip(prompts, out):
        ref = _hf_greedy(hf, p, 24)
        for c in comps:
            assert c.token_ids == ref, f"prompt len {len(p)}: ours {c.token_ids} vs HF {ref}"
            assert c.finish_reason == "length" and len(c.logprobs) == 24


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.8, 20, 0.9)])
def test_sampled_logprobs_match_dense_forward(tiny_hf_dir, temperature, top_k, top_p):
    """The recorded logprob of each sampled token equals log softmax of a dense forward of the
    finished sequence, after the same temperature / top-k / top-p filter (float64 reference)."""
    path, _ = tiny_hf_dir("qwen2")
    model = _load(path)
    prompts = _prompts([5, 13, 2], seed=1)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=20, n=3,
                            seed=0, stop_token_ids=())
    out = LLMEngine(model, block_size=4).generate(prompts, params)
    errs = []
    for p, comps in zip(prompts, out):
        for c in comps:
            logits = _dense_logits(model, p, c.token_ids) / temperature
            if top_k:
                kth = logits.topk(top_k, -1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, -math.inf)
            probs = torch.softmax(logits, -1)
            if top_p < 1:
                sp, order = probs.sort(-1, descending=True)
                drop = (sp.cumsum(-1) - sp) >= top_p
                probs = probs.scatter(1, order, sp.masked_fill(drop, 0))
                probs = probs / probs.sum(-1, keepdim=True)
            ref = probs.log().gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            errs.append((ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item())
    assert len({tuple(c.token_ids) for c in out[0]}) > 1, "the 3 samples of a prompt should differ"
    assert max(errs) < 1e-4, f"max logprob error {max(errs):.2e}"


def test_seed_makes_sampling_reproducible(tiny_hf_dir):
    model = _load(tiny_hf_dir("llama")[0])
    prompts = _prompts([4, 9], seed=2)
    params = SamplingParams(max_tokens=12, n=2, seed=123, stop_token_ids=())
    engine = LLMEngine(model, block_size=4)
    a, b = engine.generate(prompts, params), engine.generate(prompts, params)
    assert [[c.token_ids for c in cs] for cs in a] == [[c.token_ids for c in cs] for cs in b]


def test_stop_token_ends_completion_with_reason_stop(tiny_hf_dir):
    path, hf = tiny_hf_dir("qwen2")
    model = _load(path)
    prompt = _prompts([7], seed=3)[0]
    ref = _hf_greedy(hf, prompt, 12)
    stop = ref[4]
    first = ref.index(stop)
    (c,), = LLMEngine(model, block_size=4).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))
    assert c.token_ids == ref[:first + 1] and c.finish_reason == "stop"


def test_stops_at_different_steps_with_preemption_match_hf(tiny_hf_dir):
    """Results reach the host one step late (the next step is already queued), so a sequence that
    stops leaves a spare row behind. With early stops at different steps, 2 samples per prompt and a
    cache small enough to preempt, each completion must still be HF's greedy one cut at its first
    stop token, with a real logprob per token; generate() itself asserts that no KV block leaks."""
    path, hf = tiny_hf_dir("qwen2")
    model = _load(path)
    prompts = _prompts([3, 11, 20, 6], seed=4)
    refs = [_hf_greedy(hf, p, 24) for p in prompts]
    stops = {refs[0][2], refs[1][9], refs[3][15]}
    engine = LLMEngine(model, block_size=4, num_blocks=12)
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, n=2, stop_token_ids=stops))
    assert engine.stats["preemptions"] > 0, engine.stats
    cuts = []
    for ref, comps in zip(refs, out):
        cut = next((i + 1 for i, t in enumerate(ref) if t in stops), len(ref))
        cuts.append(cut)
        for c in comps:
            assert c.token_ids == ref[:cut], (c.token_ids, ref[:cut])
            assert c.finish_reason == ("stop" if ref[cut - 1] in stops else "length")
            assert len(c.logprobs) == cut and all(math.isfinite(x) for x in c.logprobs)
    assert len(set(cuts)) >= 3, f"stops should end completions at different steps: {cuts}"


def test_length_is_cut_at_the_context(tiny_hf_dir):
    model = _load(tiny_hf_dir("qwen2")[0])
    (c,), = generate(model, [list(range(1, 13))], SamplingParams(temperature=0, max_tokens=50, stop_token_ids=()),
                     block_size=4, max_model_len=16)            # the one-shot function form
    assert len(c.token_ids) == 4 and c.finish_reason == "length"


def test_bad_input_gives_clear_errors(tiny_hf_dir):
    model = _load(tiny_hf_dir("qwen2")[0])
    engine = LLMEngine(model, block_size=4, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=8)
    for prompts, match in [([], "non-empty"), ([[1, 2], []], "prompt 1 is empty"),
                           ([list(range(64))], "prompt 0 has 64 tokens"), ([[1, 256]], "token id")]:
        with pytest.raises(ValueError, match=match):
            engine.generate(prompts, params)
    # one sequence larger than the whole cache: an error up front, never a hang
    with pytest.raises(ValueError, match="KV blocks"):
        LLMEngine(model, block_size=4, num_blocks=3).generate([[1, 2, 3, 4, 5]], params)
    with pytest.raises(ValueError, match="block_size"):
        LLMEngine(model, block_size=0)


def test_batch_larger_than_cache_runs_in_waves(tiny_hf_dir):
    """40 sequences, a cache that holds ~3 at once: a defined result, equal to an ample cache."""
    model = _load(tiny_hf_dir("llama")[0])
    prompts = _prompts([5, 8, 3, 10, 6] * 4, seed=4)
    params = SamplingParams(temperature=0, max_tokens=10, n=2, stop_token_ids=())
    small = LLMEngine(model, block_size=4, num_blocks=15)
    big = LLMEngine(model, block_size=4)
    a, b = small.generate(prompts, params), big.generate(prompts, params)
    assert [[c.token_ids for c in cs] for cs in a] == [[c.token_ids for c in cs] for cs in b]
    assert small.stats["prefill_steps"] > 1


def test_free_cache_releases_and_the_engine_reallocates(tiny_hf_dir):
    model = _load(tiny_hf_dir("qwen2")[0])
    engine = LLMEngine(model, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=())
    a = engine.generate([[1, 2, 3]], params)
    engine.free_cache()
    assert engine.runner.k_cache is None and engine.runner.v_cache is None
    assert engine.generate([[1, 2, 3]], params)[0][0].token_ids == a[0][0].token_ids


@pytest.mark.interpreter
def test_triton_backend_matches_torch_backend_on_cpu(tiny_hf_dir):
    """The Triton store + paged-decode kernels (interpreter) inside the engine: 16-token blocks,
    16-token partitions, so contexts span several partitions."""
    model = _load(tiny_hf_dir("qwen2")[0])
    prompts = _prompts([14, 30], seed=5)
    params = SamplingParams(temperature=0, max_tokens=6, n=2, stop_token_ids=())
    ref = LLMEngine(model, block_size=16, attn_backend="torch").generate(prompts, params)
    for partition in (16, None):                         # None: the batch-size-dependent default
        out = LLMEngine(model, block_size=16, attn_backend="triton", partition_size=partition).generate(
            prompts, params)
        for rc, oc in zip(ref, out):
            for r, o in zip(rc, oc):
                assert o.token_ids == r.token_ids
                torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)


@pytest.mark.interpreter
def test_decode_with_rope_in_the_kv_store_matches_the_torch_backend(tiny_hf_dir, monkeypatch):
    """The rollout path's kernels on the CPU (model.fused on, Triton interpreter): every decode
    layer hands RoPE to DecodeContext's one kernel; tokens and logprobs equal the torch backend's
    with torch ops (fp32)."""
    import model as M
    model = _load(tiny_hf_dir("llama")[0])
    prompts = _prompts([14, 30], seed=5)
    params = SamplingParams(temperature=0, max_tokens=6, n=2, stop_token_ids=())
    ref = LLMEngine(model, block_size=16, attn_backend="torch").generate(prompts, params)
    calls, real = [], rollout.rope_store_kv_triton
    monkeypatch.setattr(rollout, "rope_store_kv_triton", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(M, "fused", lambda x: not torch.is_grad_enabled())
    engine = LLMEngine(model, block_size=16, attn_backend="triton")
    out = engine.generate(prompts, params)
    assert len(calls) == engine.stats["decode_steps"] * model.config.num_layers > 0
    for rc, oc in zip(ref, out):
        for r, o in zip(rc, oc):
            assert o.token_ids == r.token_ids
            torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)


def test_greedy_matches_hf_generate_smollm2(smollm2_path):
    """The real SmolLM2-135M-Instruct (Llama, tied, 9/3 heads), prompts of different lengths."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    model = _load(smollm2_path)
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a small village at the edge of a dark forest, there lived a"]
    prompts = [tok(t)["input_ids"] for t in texts]
    out = LLMEngine(model, block_size=16, max_model_len=256).generate(
        prompts, SamplingParams(temperature=0, max_tokens=16))
    for p, (c,) in zip(prompts, out):
        ref = _hf_greedy(hf, p, 16)
        assert c.token_ids == ref, f"ours {tok.decode(c.token_ids)!r} vs HF {tok.decode(ref)!r}"


# ----------------------------------------------------------------------------------------------
# GPU: the Triton kernels in bf16 and CUDA graphs, against the torch reference

@pytest.mark.gpu
def test_gpu_kernels_match_reference_bf16():
    # Qwen2.5-7B head layout (28/4, D=128), 16-token blocks, contexts over several partitions
    ctx = [1, 255, 256, 257, 1000, 0, 37]
    q, kc, vc, tables, lens = _random_paged(7, 28, 4, 128, 16, 600, ctx, torch.bfloat16, "cuda")
    ref = paged_attention_ref(q, kc, vc, tables, lens, 128 ** -0.5)
    out = rollout.paged_attention_triton(q, kc, vc, tables, lens, 128 ** -0.5, num_parts=8,
                                         partition_size=128)
    err = (out.float() - ref.float()).abs()
    assert err.max() < 2e-2, f"max err {err.max():.2e} mean {err.mean():.2e}"
    k, v = torch.randn(2, 9, 4, 128, device="cuda", dtype=torch.bfloat16).unbind(0)
    slots = torch.tensor([0, 5, -1, 17, 31, 8, 900, 2000, 40], device="cuda")
    a, b = kc.clone(), vc.clone()
    store_kv_ref(a, b, k, v, slots)
    rollout.store_kv_triton(kc, vc, k, v, slots)
    assert torch.equal(a, kc) and torch.equal(b, vc)
    # decode's RoPE + store kernel gives the very bits of model.rope_triton, then store_kv_triton
    from model import rope_triton
    qkv = torch.randn(9, 1, 36 * 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.view(9, 1, -1, 128) for t in qkv.split([28 * 128, 4 * 128, 4 * 128], -1))
    angles = torch.rand(9, 1, 1, 64, device="cuda") * 3000
    cos, sin = angles.cos(), angles.sin()
    want_q, want_k = rope_triton(q.clone(), k.clone(), cos, sin)
    unfused = kc.clone(), vc.clone()
    rollout.store_kv_triton(*unfused, want_k[:, 0], v[:, 0], slots)
    got_q = rollout.rope_store_kv_triton(q[:, 0], k[:, 0], v[:, 0], cos[:, 0, 0], sin[:, 0, 0], kc, vc, slots)
    assert torch.equal(got_q, want_q[:, 0]) and torch.equal(kc, unfused[0])
    assert torch.equal(vc, unfused[1])


@pytest.mark.gpu
def test_gpu_programmatic_dependent_launch_changes_no_bit(tiny_hf_dir, monkeypatch):
    """Sampling with the Triton kernels launched with PDL (sm_90+; each waits for its predecessor
    at its top) gives the very tokens and logprobs of plain launches: a kernel that read before
    its wait would race and, sooner or later, differ."""
    import marlin_kernel
    model = _load(tiny_hf_dir("llama")[0], device="cuda", dtype=torch.bfloat16)
    prompts, params = _prompts([5, 40, 17], seed=7), SamplingParams(max_tokens=40, n=2, seed=3, stop_token_ids=())
    runs = []
    for on in (True, False):
        monkeypatch.setattr(marlin_kernel, "PDL", on)
        runs.append([c for comps in LLMEngine(model).generate(prompts, params) for c in comps])
    assert [(c.token_ids, c.logprobs) for c in runs[0]] == [(c.token_ids, c.logprobs) for c in runs[1]]


@pytest.mark.gpu
def test_gpu_greedy_matches_hf_generate_fp32(tiny_hf_dir):
    """The Triton path (fp32 dots) inside the engine, with and without CUDA graphs."""
    path, hf = tiny_hf_dir("qwen2")
    hf = hf.cuda()
    model = _load(path, device="cuda")
    prompts = _prompts([3, 11, 20, 6])
    for graphs in (False, True):
        out = LLMEngine(model, cuda_graphs=graphs).generate(
            prompts, SamplingParams(temperature=0, max_tokens=24, n=2, stop_token_ids=()))
        for p, comps in zip(prompts, out):
            ref = _hf_greedy(hf, p, 24)
            assert all(c.token_ids == ref for c in comps), f"graphs={graphs}: {comps[0].token_ids} vs {ref}"


@pytest.mark.gpu
@pytest.mark.parametrize("graphs,lora", [(False, False), (True, False), (True, True)])
def test_gpu_bf16_sampler_logprobs_match_dense_forward(tiny_hf_dir, graphs, lora):
    """bf16 on GPU, eager and CUDA-graph decode (batch 12 padded into a 16 bucket): the recorded
    logprobs equal a dense bf16 forward of the finished sequences within bf16 noise. With LoRA
    (non-zero B, the group path of model.project): again after B changes in place between two
    generate() calls that reuse the captured graphs."""
    from lora import LoRAConfig, apply_lora, lora_modules
    model = _load(tiny_hf_dir("llama")[0], device="cuda", dtype=torch.bfloat16)
    adapters = []
    if lora:
        apply_lora(model, LoRAConfig(r=4, alpha=8))
        adapters = list(lora_modules(model).values())
        with torch.no_grad():
            for m in adapters:
                m.lora_B.normal_(0, 0.05)
    prompts = _prompts([5, 40, 17], seed=7)
    engine = LLMEngine(model, cuda_graphs=graphs)
    for round in range(2 if lora else 1):
        if round:
            with torch.no_grad():
                for m in adapters:
                    m.lora_B.mul_(-1.5)             # an optimizer step, in place
        out = engine.generate(prompts, SamplingParams(max_tokens=40, n=4, seed=3, stop_token_ids=()))
        assert bool(engine.runner.graphs) == graphs
        errs = []
        for p, comps in zip(prompts, out):
            for c in comps:
                ref = torch.log_softmax(_dense_logits(model, p, c.token_ids).float(), -1)
                ref = ref.gather(1, torch.tensor(c.token_ids, device="cuda")[:, None])[:, 0].cpu()
                errs.append((ref - torch.tensor(c.logprobs)).abs())
        errs = torch.cat(errs)
        assert errs.max() < 5e-2 and errs.mean() < 1e-2, f"round {round}: max {errs.max():.2e} mean {errs.mean():.2e}"
