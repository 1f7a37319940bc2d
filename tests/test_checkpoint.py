"""checkpoint.py: loading (streamed, quantized on the way, checked key by key), random init, the
directories we write (read back by transformers and compressed-tensors), errors and memory.

References are independent of our code: transformers' own Qwen2/Llama reading our files and writing
the (sharded) checkpoints we load (fp32 logits compared with a relative max-error bound), and
compressed-tensors' decompressor reading our NVFP4 linears.
"""
import json
import os
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpoint as C
import model as M
import nvfp4
from checkpoint import load_model, save_pretrained
from conftest import fake_gpu_memory, make_tiny_hf
from test_model import batch, hf_logits, load32, rel_err

# ----------------------------------------------------------------------------------------------
# NVFP4 checkpoints: our layout, read back without re-quantizing, read by compressed-tensors


def test_nvfp4_save_reload_without_requantizing(tiny_hf_dir, tmp_path, monkeypatch):
    path, _ = tiny_hf_dir("qwen2")
    model = load32(path, quant="nvfp4")
    out = str(tmp_path / "nvfp4")
    save_pretrained(model, out)
    config = json.load(open(os.path.join(out, "config.json")))
    assert nvfp4.is_nvfp4_checkpoint(config) and config["quantization_config"]["ignore"] == ["lm_head"]
    saved = load_file(os.path.join(out, "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    assert saved[f"{q}.weight_packed"].dtype == torch.uint8 and saved[f"{q}.weight_packed"].shape == (64, 32)
    assert saved[f"{q}.weight_scale"].dtype == torch.float8_e4m3fn and saved[f"{q}.weight_scale"].shape == (64, 4)
    assert saved[f"{q}.weight_global_scale"].shape == (1,) and f"{q}.bias" in saved and f"{q}.weight" not in saved
    assert "lm_head.weight" in saved

    def no_quantize(*a, **k):
        raise AssertionError("load_model re-quantized an NVFP4 checkpoint")
    monkeypatch.setattr(nvfp4, "quantize", no_quantize)
    again = load32(out, quant="nvfp4")
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:  # bitwise (float8 compared through its bytes)
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    ids, pos = batch()
    with torch.no_grad():
        assert torch.equal(model(ids, pos), again(ids, pos))
    with pytest.raises(ValueError, match="quant='nvfp4'"):
        load_model(out, quant="bf16", device="cpu")


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_compressed_tensors_reads_our_nvfp4_checkpoint(tiny_hf_dir, tmp_path):
    """transformers + compressed-tensors decompress each linear of our file to our dequantized weight."""
    pytest.importorskip("compressed_tensors")   # a test dependency (requirements.txt); the GPU box lacks it
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    path, _ = tiny_hf_dir("llama", tie=True)
    model = load32(path, quant="nvfp4")
    save_pretrained(model, str(tmp_path))
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                               quantization_config=CompressedTensorsConfig(dequantize=True))
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, nvfp4.NVFP4Linear):
            theirs, ours = ref.get_submodule(name).weight.float(), mod.dequantized_weight(torch.float32)
            # compressed-tensors decompresses to bf16; accept exact or exact-after-bf16-rounding
            assert torch.equal(theirs, ours) or torch.equal(theirs, ours.bfloat16().float()), name
            n += 1
    assert n == 14


# ----------------------------------------------------------------------------------------------
# sharded checkpoints, round trip through transformers


def test_sharded_checkpoints_load_and_round_trip(tiny_hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    path, hf = tiny_hf_dir("qwen2")
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")  # sharded by transformers itself
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    model = load32(str(tmp_path / "hf"))
    ids, pos = batch()
    with torch.no_grad():
        ref = hf_logits(hf, ids, pos)
        err = rel_err(model(ids, pos), ref)
    ours = str(tmp_path / "ours")
    save_pretrained(model, ours, max_shard_size=40_000)  # our writer, sharded; transformers reads it
    shards = [f for f in os.listdir(ours) if f.startswith("model-")]
    back = AutoModelForCausalLM.from_pretrained(ours, dtype=torch.float32).eval()
    again = load32(ours)
    with torch.no_grad():
        err_hf, err_again = rel_err(hf_logits(back, ids, pos), ref), rel_err(again(ids, pos), ref)
    print(f"sharded: {len(shards)} shards; rel err ours {err:.1e}, transformers reading ours {err_hf:.1e}")
    assert len(shards) > 2 and not os.path.exists(os.path.join(ours, "model.safetensors"))
    assert err < 1e-5 and err_hf < 1e-5 and err_again < 1e-5
    save_pretrained(model, ours)  # back to one file: the stale index must go
    assert not os.path.exists(os.path.join(ours, "model.safetensors.index.json"))
    assert rel_err(load32(ours)(ids, pos).detach(), ref) < 1e-5


# ----------------------------------------------------------------------------------------------
# loading: streaming, build_model, errors, the Hub, memory


def test_loader_streams_one_dense_weight_at_a_time(tiny_hf_dir, monkeypatch):
    """A dense linear weight read from disk dies as soon as it is quantized: alone, or with the
    rest of its group (q/k/v, gate/up share a global scale), so at most one group's weights are
    alive when another tensor is read."""
    path, _ = tiny_hf_dir("llama")
    real_open, dense, bad, reads = C.safe_open, [], [], []
    group = lambda key: C.group_of(key.rpartition(".")[0])  # noqa: E731

    class Spy:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, key):
            return self.f.get_slice(key)

        def get_tensor(self, key):
            alive = [k for k, r in dense if r() is not None]                 # earlier weights
            if len({tuple(group(k)) for k in alive}) > 1:
                bad.append((alive, key))
            t = self.f.get_tensor(key)
            reads.append(key)
            if key.endswith("_proj.weight"):
                dense.append((key, weakref.ref(t)))
            return t

    monkeypatch.setattr(C, "safe_open", Spy)
    model = load32(path, quant="nvfp4")
    assert len(dense) == 14 and len(reads) == len(set(reads)), "each tensor is read exactly once"
    assert not bad and all(r() is None for _, r in dense), f"alive while reading the next: {bad[:4]}"
    assert all(isinstance(m, nvfp4.NVFP4Linear) for n, m in model.named_modules() if n.endswith("_proj"))


@pytest.mark.parametrize("quant", ["bf16", "nvfp4"])
def test_build_model_has_hf_names_shapes_and_finite_forward(quant):
    from conftest import make_tiny_hf
    hf = make_tiny_hf("qwen2")
    cfg = M.ModelConfig.from_hf(hf.config.to_dict())
    model = C.build_model(cfg, quant=quant, device="cpu", seed=1)
    ours, theirs = model.state_dict(), hf.state_dict()
    for key, t in theirs.items():
        mod = key.rpartition(".")[0]
        if quant == "nvfp4" and key.endswith("_proj.weight"):
            N, K = t.shape
            assert ours[f"{mod}.weight_packed"].shape == (N, K // 2) and ours[f"{mod}.weight_scale"].shape == (N, K // 16)
        else:
            assert ours[key].shape == t.shape, key
    ids, _ = batch()
    with torch.no_grad():
        out = model(ids)
    assert out.shape == (3, 24, 256) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert out.float().std() > 0


def _write_config(path, **overrides):
    os.makedirs(path, exist_ok=True)
    from conftest import make_tiny_hf
    d = {**make_tiny_hf("llama").config.to_dict(), **overrides}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f)


def test_errors_architecture_paths_and_pickles(tmp_path):
    _write_config(tmp_path / "mistral", architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(ValueError, match="MistralForCausalLM.*Qwen2ForCausalLM"):
        C.load_model(str(tmp_path / "mistral"), device="cpu")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        C.load_model(str(tmp_path / "nowhere"), device="cpu")
    _write_config(tmp_path / "pickle")
    (tmp_path / "pickle" / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="never unpickles"):
        C.load_model(str(tmp_path / "pickle"), device="cpu")
    _write_config(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        C.load_model(str(tmp_path / "empty"), device="cpu")
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        M.ModelConfig.from_hf({**M.ModelConfig("LlamaForCausalLM", 64, 64, 64, 1, 4, 2).to_hf(),
                               "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("quant", ["bf16", "nvfp4"])
def test_errors_bad_tensors_are_named(tiny_hf_dir, quant):
    path, _ = tiny_hf_dir("qwen2")
    file = os.path.join(path, "model.safetensors")
    good = load_file(file)
    bad_key = "model.layers.1.mlp.down_proj.weight"
    sd = dict(good)
    sd[bad_key] = sd[bad_key].clone()
    sd[bad_key][3, 5] = float("nan")
    save_file(sd, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=bad_key.replace(".", r"\.")):
        C.load_model(path, quant=quant, device="cpu")
    sd = dict(good)
    del sd["model.layers.0.self_attn.k_proj.bias"]
    sd["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(sd, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 \['model\.layers\.0\.self_attn\.k_proj\.bias'\].*"
                                         r"unexpected 1 \['model\.layers\.0\.self_attn\.extra\.weight'\]"):
        C.load_model(path, quant=quant, device="cpu")


def test_hub_ids_go_through_snapshot_download(tiny_hf_dir, monkeypatch):
    import huggingface_hub
    path, _ = tiny_hf_dir("llama")
    seen = []

    def fake_download(repo_id, allow_patterns=None, **kw):  # no network in tests
        seen.append((repo_id, allow_patterns))
        return path
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    model = C.load_model("someone/tiny-llama", quant="bf16", device="cpu")
    assert seen[0][0] == "someone/tiny-llama" and "*.safetensors" in seen[0][1] and "*.bin" not in seen[0][1]
    assert model.config.architecture == "LlamaForCausalLM"


@pytest.mark.gpu
def test_gpu_nvfp4_model_matches_dequantized_bf16_and_loads_in_bounded_memory(tmp_path):
    cfg = M.ModelConfig("Qwen2ForCausalLM", vocab_size=4096, hidden_size=1024, intermediate_size=4096,
                        num_layers=4, num_heads=16, num_kv_heads=4)
    dense = C.build_model(cfg, "bf16", "cuda", seed=0)
    save_pretrained(dense, str(tmp_path))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    q = C.load_model(str(tmp_path), quant="nvfp4", device="cuda")
    final, peak = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
    matrix = 4096 * 1024 * 2  # the largest bf16 linear weight
    print(f"load: final {final / 2**20:.1f} MiB, peak - final {(peak - final) / 2**20:.1f} MiB "
          f"= {(peak - final) / matrix:.1f} bf16 matrices")
    # DESIGN.md: peak ≈ final + one bf16 matrix; quantize's row chunks add ≤ ~32 B per chunk weight.
    assert peak - final <= matrix + 32 * nvfp4.QUANT_CHUNK
    with torch.no_grad():  # reference: cuBLAS bf16 with the dequantized NVFP4 weights
        for name, m in q.named_modules():
            if isinstance(m, nvfp4.NVFP4Linear):
                dense.get_submodule(name).weight.copy_(m.dequantized_weight(torch.bfloat16))
    ids = torch.randint(0, 4096, (4, 128), device="cuda")
    with torch.no_grad():
        err = rel_err(q(ids), dense(ids))
    print(f"nvfp4 kernel model vs dequantized bf16 model: logits rel err {err:.2e}")
    assert err < 3e-2
    q.gradient_checkpointing = True  # the training path: backward through the dx kernel
    emb = q.model.embed_tokens.weight.requires_grad_(True)
    q(ids).float().logsumexp(-1).mean().backward()
    assert torch.isfinite(emb.grad).all() and emb.grad.abs().sum() > 0


@pytest.mark.parametrize("arch,tie,quant", [("qwen2", False, "nvfp4"), ("llama", True, "nvfp4"), ("qwen2", False, "bf16")])
def test_weight_bytes_of_the_meta_model_equal_the_built_model(arch, tie, quant):
    cfg = M.ModelConfig.from_hf(make_tiny_hf(arch, tie).config.to_dict())
    with torch.device("meta"):
        meta = M.Transformer(cfg, quant)
    built = C.build_model(cfg, quant, "cpu")
    tensors = {t.data_ptr(): t for t in list(built.parameters()) + list(built.buffers())}  # tied: once
    assert C.weight_bytes(meta) == sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("name,paper_gb", [("qwen2.5-7b", 5.9), ("qwen2.5-14b", 10.6), ("qwen2.5-32b", 20.7)])
def test_nvfp4_weight_memory_matches_the_paper(name, paper_gb):
    """QeRL reports 5.9 / 10.6 / 20.7 GB of NVFP4 weights (lm_head and embeddings in bf16)."""
    with torch.device("meta"):
        model = M.Transformer(M.ModelConfig.from_hf(C.SHAPES[name]), "nvfp4")
    gb = C.weight_bytes(model) / 1e9
    print(f"{name}: {gb:.2f} GB (paper {paper_gb})")
    assert abs(gb - paper_gb) / paper_gb < 0.015


def test_72b_shape_has_the_model_cards_parameter_count():
    """Qwen2.5-72B: 72.7 B parameters (its model card); in NVFP4, 80 layers of q/k/v/o/gate/up/down at
    4.5 bits a weight, the bf16 embedding and lm_head, fp32 norms, bf16 q/k/v biases and RoPE's inv_freq."""
    with torch.device("meta"):
        bf16 = M.Transformer(M.ModelConfig.from_hf(C.SHAPES["qwen2.5-72b"]), "bf16")
        nvfp4 = M.Transformer(M.ModelConfig.from_hf(C.SHAPES["qwen2.5-72b"]), "nvfp4")
    assert round(sum(p.numel() for p in bf16.parameters()) / 1e9, 1) == 72.7
    linear = 80 * 8192 * (8192 + 2 * 1024 + 8192 + 3 * 29568)           # per layer: q, k, v, o, gate, up, down
    rest = (2 * 2 * 152064 * 8192 + 4 * (2 * 80 + 1) * 8192               # bf16 embedding + lm_head; fp32 norms
            + 2 * 80 * (8192 + 2 * 1024) + 4 * 64)                        # bf16 q/k/v biases; inv_freq (D/2)
    assert C.weight_bytes(nvfp4) == linear // 2 + linear // 16 + 4 * 7 * 80 + rest  # codes, e4m3 scales, fp32 globals


def test_a_model_that_cannot_fit_fails_before_loading(monkeypatch):
    with torch.device("meta"):
        model = M.Transformer(M.ModelConfig.from_hf(C.SHAPES["qwen2.5-32b"]), "bf16")
    fake_gpu_memory(monkeypatch, 80, 80)
    C.check_fits(model, torch.device("cuda", 0))  # 61 GiB of bf16 weights fit in 80 GiB
    fake_gpu_memory(monkeypatch, 40, 80)
    with pytest.raises(ValueError, match=r"needs 62\.\d GiB .* has 40\.0 GiB free"):
        C.check_fits(model, torch.device("cuda", 0))
    fake_gpu_memory(monkeypatch, 130, 140, fraction=50 / 140)   # a 140 GiB card held to 50 GiB
    with pytest.raises(ValueError, match=r"needs 62\.\d GiB .* has 50\.0 GiB free"):
        C.check_fits(model, torch.device("cuda", 0))
