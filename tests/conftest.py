"""Shared test fixtures: tiny random Hugging Face checkpoints, the real SmolLM2 model, the GPU marker,
NaN-poisoned allocations for the kernel tests.

Every reference here is independent of the code under test: tiny checkpoints are written by
transformers itself, SmolLM2 by tools/get_smollm2.py.
"""
import os
import random

# Under pytest-xdist (pytest.ini's -n auto) each worker, and every process it starts, computes on one
# thread: workers of several OpenMP threads each (plus their train.py children) oversubscribe the
# cores, which slows the interpreter's kernel tests about twofold. It must be set before torch is
# imported; a value set outside the tests wins.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, Triton kernels run in the interpreter. This must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")   # tests/data: rows of GSM8K, MATH500
SMOLLM2_DEFAULT = os.path.expanduser("~/.cache/qerl/SmolLM2-135M-Instruct")

# Tiny configs: every linear's input dim is a multiple of 16 (the NVFP4 block), GQA 4/2 heads.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            rms_norm_eps=1e-6)


MAX_WORKERS = 4   # test processes at most: each holds a model or two and the Triton interpreter's state


def pytest_xdist_auto_num_workers(config):
    """pytest.ini's -n auto: without a GPU one test process per CPU core (CI's two), at most
    MAX_WORKERS; with one, a single process, because the GPU tests share the one device and size their
    KV caches and plans from the memory it has free. PYTEST_XDIST_AUTO_NUM_WORKERS still decides where set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 0 if torch.cuda.is_available() else min(cores, MAX_WORKERS)


def pytest_collection_modifyitems(config, items):
    """gpu tests need CUDA; interpreter tests run Triton kernels on CPU tensors, which only the
    interpreter can (on a GPU machine their checks are done by gpu-marked tests on CUDA tensors).

    Under pytest-xdist (pytest.ini's -n) the slow-marked tests are collected first, so that the workers
    start them at once and end on short tests, not on one long test while the other worker idles.
    The order is a stable sort, the same on every worker (xdist requires one collection)."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "interpreter" in item.keywords and not interpreting:
            item.add_marker(pytest.mark.skip(reason="runs Triton on CPU tensors: needs TRITON_INTERPRET=1"))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def make_tiny_hf(arch: str, tie: bool = False, seed: int = 0):
    """A tiny random transformers model: arch is "qwen2", "qwen3" or "llama". Qwen3's heads are 32
    wide, not hidden / heads = 16 (q_proj 64 -> 128), as a real Qwen3's head_dim is given, not derived."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)
    torch.manual_seed(seed)
    if arch == "qwen2":
        cfg = Qwen2Config(**TINY, rope_theta=1e6, tie_word_embeddings=tie)
        model = Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = Qwen3Config(**dict(TINY, head_dim=32), rope_theta=1e6, tie_word_embeddings=tie)
        model = Qwen3ForCausalLM(cfg)
    elif arch == "llama":
        cfg = LlamaConfig(**TINY, rope_theta=1e4, tie_word_embeddings=tie, attention_bias=False)
        model = LlamaForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # Random norms (not all ones; Qwen3's q_norm / k_norm too) so that a wrong norm weight cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


# ----------------------------------------------------------------------------------------------
# helpers shared by the model, sampler and Qwen3 tests


def rel_err(ours, ref):
    """Worst absolute error relative to the reference's largest magnitude."""
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def batch(B=3, T=24, vocab=256, seed=1):
    """Random ids at increasing positions with random start and random gaps of 1..3, so that absolute
    positions matter (a common shift of all positions would cancel in attention)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    pos = torch.randint(0, 300, (B, 1), generator=g) + torch.randint(1, 4, (B, T), generator=g).cumsum(1)
    return ids, pos  # (B, T), (B, T)


def hf_logits(hf, ids, pos):
    """transformers' logits at explicit positions. The all-ones mask stops it from reading position
    gaps as boundaries of packed sequences: plain causal attention, like ours."""
    return hf(ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits


def against_hf(model, hf):
    """Our model against transformers' on one batch(): -> (our logits, our last hidden state, and the
    worst relative errors of the logits at explicit positions, of the hidden state, and of the logits
    at the default positions 0..T-1)."""
    ids, pos = batch()
    with torch.no_grad():
        ours, ref = model(ids, pos), hf_logits(hf, ids, pos)
        hidden = model(ids, pos, return_hidden=True)
        ref_hidden = hf.model(ids, position_ids=pos, attention_mask=torch.ones_like(ids)).last_hidden_state
        ours0, ref0 = model(ids), hf(ids).logits
    return ours, hidden, (rel_err(ours, ref), rel_err(hidden, ref_hidden), rel_err(ours0, ref0))


def assert_same_completions(ref, out, atol=1e-5):
    """Two engines' generate() results: the same tokens and log-probs within atol, completion by
    completion of each prompt."""
    assert len(ref) == len(out)
    for rc, oc in zip(ref, out):
        assert len(rc) == len(oc)
        for r, o in zip(rc, oc):
            assert o.token_ids == r.token_ids
            torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(r.logprobs), atol=atol, rtol=0)


def load32(path, quant="bf16"):
    """Our model from a checkpoint directory, on the CPU in fp32."""
    from checkpoint import load_model
    return load_model(path, quant=quant, device="cpu", dtype=torch.float32)


def random_prompts(lengths, vocab=256, seed=0):
    """Token-id prompts of the given lengths."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def hf_greedy(hf, prompt, max_new):
    """transformers' greedy continuation of one prompt: the reference of the sampler tests."""
    out = hf.generate(torch.tensor([prompt], device=hf.device), max_new_tokens=max_new, do_sample=False,
                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=hf.device))
    return out[0, len(prompt):].tolist()


def assert_greedy_like_hf(model, hf, max_new=24):
    """The engine's greedy completions equal transformers' generate() (hf_greedy), with and without
    CUDA graphs, at batch 8 (4 prompts x 2) and at batch 1."""
    from rollout import LLMEngine, SamplingParams
    for prompts, n in ((random_prompts([3, 11, 20, 6]), 2), (random_prompts([9]), 1)):
        for graphs in (False, True):
            out = LLMEngine(model, cuda_graphs=graphs).generate(
                prompts, SamplingParams(temperature=0, max_tokens=max_new, n=n, stop_token_ids=()))
            for p, comps in zip(prompts, out):
                ref = hf_greedy(hf, p, max_new)
                assert all(c.token_ids == ref for c in comps), f"graphs={graphs}: {comps[0].token_ids} vs {ref}"


def fake_gpu_memory(monkeypatch, free_gib: float, total_gib: float, fraction: float = 1.0, reserved_gib: float = 0.0):
    """torch.cuda's memory queries answer for a GPU that does not exist: free and total device memory,
    the per-process limit (set_per_process_memory_fraction's) and the bytes this process reserved."""
    G = 2 ** 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free_gib * G), int(total_gib * G)))
    def per_process_fraction(device):  # as torch's: an index, or a device that has one ("cuda" is refused)
        if not (isinstance(device, int) or isinstance(device, torch.device) and device.index is not None):
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        return fraction
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", per_process_fraction)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int(reserved_gib * G))


@pytest.fixture
def tiny_hf_dir(tmp_path):
    """Factory: write a tiny random HF checkpoint (safetensors) and return (dir, hf_model)."""
    def make(arch="qwen2", tie=False, seed=0):
        model = make_tiny_hf(arch, tie, seed)
        path = tmp_path / f"{arch}-tie{int(tie)}-s{seed}"
        model.save_pretrained(path)
        return str(path), model
    return make


@pytest.fixture(scope="session")
def smollm2_path():
    """The real SmolLM2-135M-Instruct checkpoint built by tools/get_smollm2.py.

    Skips when it is absent, unless QERL_REQUIRE_SMOLLM2=1 (CI sets it), where absence fails."""
    path = os.environ.get("QERL_SMOLLM2", SMOLLM2_DEFAULT)
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        msg = (f"needs SmolLM2-135M-Instruct, not at {path}: build it with `python tools/get_smollm2.py` "
               f"(or point QERL_SMOLLM2 at a copy) to run these tests")
        if os.environ.get("QERL_REQUIRE_SMOLLM2") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(request):
    """A directory with SmolLM2's tokenizer files: QERL_TOKENIZER (e.g. on a GPU machine that has the
    tokenizer but not the weights), else the SmolLM2 checkpoint (smollm2_path's rules)."""
    path = os.environ.get("QERL_TOKENIZER")
    if path and os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    return request.getfixturevalue("smollm2_path")


@pytest.fixture(scope="session")
def test_data():
    """tests/data: the first 100 rows of GSM8K's test split and of MATH500, and MATH500's 500 gold answers
    (tests/data/README.md names their sources and licences)."""
    return DATA


@pytest.fixture
def poisoned(monkeypatch):
    """Every torch.empty (so every buffer marlin_kernel's wrappers allocate) returns a NaN-filled
    float tensor: an element a kernel forgets to write fails the test."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)
