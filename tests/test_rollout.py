"""Tests for rollout.py: the sampler against transformers' generate and a dense forward, bad input,
the Triton backend (interpreter on CPU) against the torch backend, and GPU-marked checks of the
CUDA paths (PDL, CUDA graphs). The layers have their own files: tests/test_scheduler.py,
tests/test_attention.py, tests/test_sampling.py."""
import math

import pytest
import torch

import kernels
from conftest import assert_greedy_like_hf, assert_same_completions, hf_greedy, random_prompts
from rollout import LLMEngine, SamplingParams, generate

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
# The engine on real model code (model.py), CPU fp32, against transformers

def _load(path, device="cpu", dtype=torch.float32):
    from checkpoint import load_model
    return load_model(path, quant="bf16", device=device, dtype=dtype)


def _dense_logits(model, prompt, completion):
    ids = torch.tensor([prompt + completion], device=next(model.parameters()).device)
    with torch.no_grad():
        return model(ids)[0, len(prompt) - 1:-1].double()        # (len(completion), V)


@pytest.mark.parametrize("arch, tie, num_blocks", [("qwen2", False, None), ("llama", True, None),
                                                    ("qwen2", False, 12), ("qwen3", False, None),
                                                    ("qwen3", True, None), ("qwen3", False, 12)])
def test_greedy_matches_hf_generate_tiny(tiny_hf_dir, arch, tie, num_blocks):
    """Prompts of different lengths in one batch, 2 samples each sharing the prompt's blocks;
    num_blocks=12 (4-token blocks) cannot hold the batch at once and forces preemption."""
    path, hf = tiny_hf_dir(arch, tie)
    model = _load(path)
    prompts = random_prompts([3, 11, 20, 6])
    engine = LLMEngine(model, block_size=4, num_blocks=num_blocks)
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, n=2, stop_token_ids=()))
    if num_blocks is not None:
        assert engine.stats["preemptions"] > 0, engine.stats
    for p, comps in zip(prompts, out):
        ref = hf_greedy(hf, p, 24)
        for c in comps:
            assert c.token_ids == ref, f"prompt len {len(p)}: ours {c.token_ids} vs HF {ref}"
            assert c.finish_reason == "length" and len(c.logprobs) == 24


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampled_tokens_do_not_depend_on_the_cache_size(tiny_hf_dir, top_p):
    """A draw is keyed by (seed, sequence, position) only: at temperature 1 a full cache and one small
    enough to preempt (the batch runs in other groupings, preempted sequences are prefilled again)
    sample the same tokens; and a prompt sampled alone gets the tokens it gets in the batch."""
    model = _load(tiny_hf_dir("qwen2")[0])
    prompts = random_prompts([3, 11, 20, 6], seed=3)
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=20, n=2, seed=5, stop_token_ids=())
    full = LLMEngine(model, block_size=4).generate(prompts, params)
    small = LLMEngine(model, block_size=4, num_blocks=14)
    tight = small.generate(prompts, params)
    assert small.stats["preemptions"] > 0, small.stats
    tokens = lambda out: [[c.token_ids for c in comps] for comps in out]          # noqa: E731
    assert tokens(tight) == tokens(full)
    alone = LLMEngine(model, block_size=4).generate(prompts[:1], params)
    assert tokens(alone)[0] == tokens(full)[0]
    assert tokens(LLMEngine(model, block_size=4).generate(prompts, SamplingParams(**{**vars(params), "seed": 6}))) \
        != tokens(full), "another seed must sample otherwise"


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.8, 20, 0.9)])
def test_sampled_logprobs_match_dense_forward(tiny_hf_dir, temperature, top_k, top_p):
    """The recorded logprob of each sampled token equals log softmax of a dense forward of the
    finished sequence, after the same temperature / top-k / top-p filter (float64 reference)."""
    path, _ = tiny_hf_dir("qwen2")
    model = _load(path)
    prompts = random_prompts([5, 13, 2], seed=1)
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
    prompts = random_prompts([4, 9], seed=2)
    params = SamplingParams(max_tokens=12, n=2, seed=123, stop_token_ids=())
    engine = LLMEngine(model, block_size=4)
    a, b = engine.generate(prompts, params), engine.generate(prompts, params)
    assert [[c.token_ids for c in cs] for cs in a] == [[c.token_ids for c in cs] for cs in b]


def test_stop_token_ends_completion_with_reason_stop(tiny_hf_dir):
    path, hf = tiny_hf_dir("qwen2")
    model = _load(path)
    prompt = random_prompts([7], seed=3)[0]
    ref = hf_greedy(hf, prompt, 12)
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
    prompts = random_prompts([3, 11, 20, 6], seed=4)
    refs = [hf_greedy(hf, p, 24) for p in prompts]
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
    prompts = random_prompts([5, 8, 3, 10, 6] * 4, seed=4)
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


@pytest.mark.slow
@pytest.mark.interpreter
def test_triton_backend_matches_torch_backend_on_cpu(tiny_hf_dir):
    """The Triton store + paged-decode kernels (interpreter) inside the engine: 16-token blocks,
    16-token partitions, so contexts span several partitions."""
    model = _load(tiny_hf_dir("qwen2")[0])
    prompts = random_prompts([14, 30], seed=5)
    params = SamplingParams(temperature=0, max_tokens=6, n=2, stop_token_ids=())
    ref = LLMEngine(model, block_size=16, attn_backend="torch").generate(prompts, params)
    for partition in (16, None):                         # None: the batch-size-dependent default
        out = LLMEngine(model, block_size=16, attn_backend="triton", partition_size=partition).generate(
            prompts, params)
        assert_same_completions(ref, out)


@pytest.mark.interpreter
def test_decode_with_rope_in_the_kv_store_matches_the_torch_backend(tiny_hf_dir, monkeypatch):
    """The rollout path's kernels on the CPU (fused ops on, Triton interpreter): every decode
    layer hands RoPE to the attention kernel (one launch rotates, stores k, v and attends); tokens
    and logprobs equal the torch backend's with torch ops (fp32)."""
    model = _load(tiny_hf_dir("llama")[0])
    prompts = random_prompts([14, 30], seed=5)
    params = SamplingParams(temperature=0, max_tokens=6, n=2, stop_token_ids=())
    ref = LLMEngine(model, block_size=16, attn_backend="torch").generate(prompts, params)
    calls, real = [], kernels.paged_attention
    monkeypatch.setattr(kernels, "paged_attention",
                        lambda *a, rope=None, **kw: calls.append(rope is not None) or real(*a, rope=rope, **kw))
    monkeypatch.setattr(kernels, "runs", lambda x: not torch.is_grad_enabled())   # the fast path on CPU tensors
    engine = LLMEngine(model, block_size=16, attn_backend="triton")
    out = engine.generate(prompts, params)
    assert calls.count(True) == len(calls) == engine.stats["decode_steps"] * model.config.num_layers > 0
    assert_same_completions(ref, out)


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
        ref = hf_greedy(hf, p, 16)
        assert c.token_ids == ref, f"ours {tok.decode(c.token_ids)!r} vs HF {tok.decode(ref)!r}"


# ----------------------------------------------------------------------------------------------
# GPU: the engine's CUDA paths (PDL, CUDA graphs) against plain launches, HF and a dense forward

@pytest.mark.gpu
def test_gpu_programmatic_dependent_launch_changes_no_bit(tiny_hf_dir, monkeypatch):
    """Sampling with the Triton kernels launched with PDL (sm_90+; each waits for its predecessor
    at its top) gives the very tokens and logprobs of plain launches: a kernel that read before
    its wait would race and, sooner or later, differ."""
    from dataclasses import replace
    from kernels import tuning
    model = _load(tiny_hf_dir("llama")[0], device="cuda", dtype=torch.bfloat16)
    prompts, params = random_prompts([5, 40, 17], seed=7), SamplingParams(max_tokens=40, n=2, seed=3, stop_token_ids=())
    runs = []
    for on in (True, False):
        with tuning.using(replace(tuning.current(), pdl=on)):
            runs.append([c for comps in LLMEngine(model).generate(prompts, params) for c in comps])
    assert [(c.token_ids, c.logprobs) for c in runs[0]] == [(c.token_ids, c.logprobs) for c in runs[1]]


@pytest.mark.gpu
def test_gpu_first_capture_warms_every_smaller_bucket_and_changes_no_sample(tiny_hf_dir, monkeypatch):
    """The first decode at a bucket (12 sequences: 16) runs each smaller bucket once on padding rows
    (graphs.Graphs._warm_below), so all of them are in the warmed record before any is reached; the
    tokens and logprobs equal those of the same engine without those warm-ups, bit for bit: they
    wrote no KV and the step in flight's tokens were put back."""
    import graphs
    model = _load(tiny_hf_dir("llama")[0], device="cuda", dtype=torch.bfloat16)
    prompts, params = random_prompts([5, 40, 17], seed=7), SamplingParams(max_tokens=24, n=4, seed=3, stop_token_ids=())
    runs, warmed = [], []
    for warm in (True, False):
        if not warm:
            monkeypatch.setattr(graphs.Graphs, "_warm_below", lambda self, *a: None)
        engine = LLMEngine(model)
        runs.append([(c.token_ids, c.logprobs) for comps in engine.generate(prompts, params) for c in comps])
        warmed.append({key[0] for (key, _) in engine.runner.graphs.warmed if key[0] != "prefill"})
    assert {1, 2, 4, 8, 16} <= warmed[0] and not {1, 2, 4, 8} <= warmed[1]
    assert runs[0] == runs[1]


@pytest.mark.gpu
def test_gpu_greedy_matches_hf_generate_fp32(tiny_hf_dir, monkeypatch):
    """The Triton path (fp32 dots) inside the engine, with and without CUDA graphs, at batch 8 and
    at batch 1 (where kernels.lm_head's GEMV computes the lm_head; the graphs' warm-up of the
    smaller buckets runs it at 2 rows too, its other row count)."""
    path, hf = tiny_hf_dir("qwen2")
    hf = hf.cuda()
    model = _load(path, device="cuda")
    gemv_rows, real = [], kernels.lm_head
    monkeypatch.setattr(kernels, "lm_head", lambda x, head: gemv_rows.append(x.shape[0]) or real(x, head))
    assert_greedy_like_hf(model, hf)
    assert 1 in gemv_rows and max(gemv_rows) <= kernels.current().lm_head_max_rows


@pytest.mark.gpu
@pytest.mark.parametrize("graphs,lora", [(False, False), (True, False), (True, True)])
def test_gpu_bf16_sampler_logprobs_match_dense_forward(tiny_hf_dir, graphs, lora):
    """bf16 on GPU, eager and CUDA-graph decode (batch 12 padded into a 16 bucket): the recorded
    logprobs equal a dense bf16 forward of the finished sequences within bf16 noise. With LoRA
    (non-zero B, the group path of kernels.project): again after B changes in place between two
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
    prompts = random_prompts([5, 40, 17], seed=7)
    engine = LLMEngine(model, cuda_graphs=graphs)
    for round in range(2 if lora else 1):
        if round:
            with torch.no_grad():
                for m in adapters:
                    m.lora_B.mul_(-1.5)             # an optimizer step, in place
        out = engine.generate(prompts, SamplingParams(max_tokens=40, n=4, seed=3, stop_token_ids=()))
        assert bool(engine.runner.graphs and engine.runner.graphs.decode_graphs) == graphs == bool(
            engine.runner.graphs and engine.runner.graphs.prefill_graphs)
        errs = []
        for p, comps in zip(prompts, out):
            for c in comps:
                ref = torch.log_softmax(_dense_logits(model, p, c.token_ids).float(), -1)
                ref = ref.gather(1, torch.tensor(c.token_ids, device="cuda")[:, None])[:, 0].cpu()
                errs.append((ref - torch.tensor(c.logprobs)).abs())
        errs = torch.cat(errs)
        assert errs.max() < 5e-2 and errs.mean() < 1e-2, f"round {round}: max {errs.max():.2e} mean {errs.mean():.2e}"


@pytest.mark.gpu
def test_gpu_graphs_follow_the_adapters_on_merged_and_off(tiny_hf_dir):
    """A CUDA graph replays the kernels its capture ran, the adapters' update among them. One engine
    generates with the adapters on, merged into the weights (lora.merged_sampling, twice: the second
    call replays the first's graphs), off, and on again: each call's tokens and logprobs equal a fresh
    engine's in the same state, bit for bit. Had the graphs captured with the adapters on been
    replayed under the merge, the update would count twice."""
    import contextlib
    from lora import LoRAConfig, adapters_disabled, apply_lora, keep_bases, lora_modules, merged_sampling
    model = _load(tiny_hf_dir("llama")[0], device="cuda", dtype=torch.bfloat16)
    apply_lora(model, LoRAConfig(r=4, alpha=8))
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.normal_(0, 0.05)
    keep_bases(model, True)
    states = {"on": contextlib.nullcontext, "merged": lambda: merged_sampling(model),
              "off": lambda: adapters_disabled(model)}
    prompts, params = random_prompts([5, 40, 17], seed=7), SamplingParams(max_tokens=24, n=4, seed=3, stop_token_ids=())
    engine, runs = LLMEngine(model), {}
    for name in ("on", "merged", "merged", "off", "on"):
        with states[name]():
            got = [(c.token_ids, c.logprobs) for comps in engine.generate(prompts, params) for c in comps]
            assert got == [(c.token_ids, c.logprobs) for comps in LLMEngine(model).generate(prompts, params)
                           for c in comps], name
        runs.setdefault(name, got)
    assert runs["on"] != runs["off"] and runs["merged"] != runs["off"], "the adapters must matter here"


@pytest.mark.gpu
def test_gpu_prefill_graph_matches_the_eager_prefill(tiny_hf_dir):
    """A prefill replayed as a CUDA graph (padded to its token bucket, the prompts to a power of two)
    writes the same K/V into the cache as the eager prefill and gives the same first tokens and
    logprobs, for: padding as an extra prompt (3 prompts in a bucket of 4), no padding at all (4 x 16
    tokens in the same graph, replayed), padding after the one prompt, and 5 prompts in a bucket of 8.
    The graphs outlive a training step's free_cache and write into the newly allocated cache."""
    model = _load(tiny_hf_dir("llama")[0], device="cuda", dtype=torch.bfloat16)
    graphed, eager = LLMEngine(model), LLMEngine(model, cuda_graphs=False)
    assert graphed.runner.graphs.prefill_cap >= 128 and eager.runner.graphs is None
    params = SamplingParams(max_tokens=1, n=2, seed=5, stop_token_ids=())
    for lengths in ([5, 40, 17], [16, 16, 16, 16], [100], [30, 2, 7, 1, 9]):
        prompts = random_prompts(lengths, seed=len(lengths))
        for _ in range(2):                                  # the second time after a training step's free
            outs = [e.generate(prompts, params) for e in (graphed, eager)]
            for a, b in zip(*outs):
                assert [c.token_ids for c in a] == [c.token_ids for c in b]
                torch.testing.assert_close(torch.tensor([c.logprobs for c in a]),
                                           torch.tensor([c.logprobs for c in b]), atol=2e-2, rtol=0)
            for name in ("k_cache", "v_cache"):
                torch.testing.assert_close(getattr(graphed.runner, name), getattr(eager.runner, name),
                                           atol=2e-2, rtol=2e-2)
            graphed.free_cache(keep_warm=True)
            eager.free_cache(keep_warm=True)
    assert {k[:2] for k in graphed.runner.graphs.prefill_graphs} == {(64, 4), (128, 1), (64, 8)}


@pytest.mark.gpu
def test_gpu_sampling_inside_the_graph_is_seeded_and_reproducible(tiny_hf_dir):
    """At temperature 1 without top-k/top-p the lm_head and the Triton sampler run inside the decode
    graph, each draw keyed by (the call's seed, the sequence, the position; the capture's warm-up undone):
    the same seed gives the same tokens and logprobs in the call that captures the graphs, in a call
    that replays them, and in a second engine that captured its graphs in another order (another
    seed first); another seed gives others. Stop tokens end sequences at different steps, so the
    batch moves down the buckets and graphs are captured while a graph step's tokens are in flight.
    After a training step's free_cache the graphs stay and replay on a cache allocated elsewhere
    (the old one kept alive and poisoned with NaN: a graph that still held its addresses would read
    it), and give the same, without a capture.
    With top-p the graph stops at the hidden states and sampling runs outside it (key temperature
    None), reproducible too."""
    model = _load(tiny_hf_dir("llama")[0], device="cuda", dtype=torch.bfloat16)
    prompts = random_prompts([5, 40, 17, 9], seed=7)

    def run(engine, seed, top_p=1.0):
        out = engine.generate(prompts, SamplingParams(max_tokens=80, n=4, seed=seed, top_p=top_p,
                                                      stop_token_ids=(3, 7, 11, 19)))
        return [(c.token_ids, c.logprobs) for comps in out for c in comps]

    engine = LLMEngine(model)
    first = run(engine, 11)
    assert {k[1] for k in engine.runner.graphs.decode_graphs} == {1.0} and len(engine.runner.graphs.decode_graphs) > 1
    assert len({len(t) for t, _ in first}) > 1, "the sequences should stop at different steps"
    other = LLMEngine(model)
    assert run(other, 12) != first
    assert run(engine, 11) == first and run(other, 11) == first
    assert set(engine.runner.graphs.decode_graphs) <= {key for key, _ in engine.runner.graphs.warmed}
    kept, old = dict(engine.runner.graphs.decode_graphs), (engine.runner.k_cache, engine.runner.v_cache)
    engine.free_cache(keep_warm=True)    # as before every backward: the graphs stay
    with torch.inference_mode():         # the caches were made there
        for cache in old:
            cache.fill_(float("nan"))
    assert run(engine, 11) == first and engine.runner.k_cache.data_ptr() != old[0].data_ptr()
    assert engine.runner.graphs.decode_graphs == kept and engine.runner.graphs.prefill_graphs
    nucleus = run(engine, 11, top_p=0.9)
    assert None in {k[1] for k in engine.runner.graphs.decode_graphs} and run(engine, 11, top_p=0.9) == nucleus
