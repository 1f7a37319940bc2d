"""gptq.py against independent references: a float64 Optimal Brain Surgeon written out column by
column here (no Cholesky, no lazy blocks), the layer objective ‖XWᵀ − XŴᵀ‖ in float64, and
compressed-tensors' decompressor; and the loaders' `quantizer` argument (checkpoint.py): what each
quantizer writes, that GPTQ streams one layer's bf16 weights at a time, and the errors."""
import weakref

import pytest
import torch

import checkpoint
import gptq
import nvfp4
from conftest import TINY
from test_nvfp4 import E2M1, ct_decompress, needs_ct


def correlated_inputs(n, K, gen):
    """n rows of K correlated channels of uneven scale (what a layer's inputs look like), (n, K)."""
    mix = torch.randn(K, K, generator=gen) / K ** 0.5 + torch.eye(K)
    return (torch.randn(n, K, generator=gen) @ mix) * (0.2 + 2 * torch.rand(K, generator=gen))


def obs_f64(w, H, global_scale, damp=gptq.DAMP):
    """GPTQ in float64 as Optimal Brain Surgeon states it: quantize column k (its 16-block's absmax
    scale taken from the corrected weights when the block starts), spread its error over the columns
    left through H⁻¹, then eliminate k from H⁻¹. Returns W' (N, K) float64."""
    W, K = w.double().clone(), w.shape[1]
    H = H.double().clone()
    H.diagonal()[H.diagonal() == 0] = 1
    H.diagonal().add_(damp * H.diagonal().mean())
    Hinv, g = torch.linalg.inv(H), global_scale.double()
    grid = torch.tensor(E2M1, dtype=torch.float64)
    out = torch.zeros_like(W)
    for k in range(K):
        if k % 16 == 0:
            s = (g * W[:, k:k + 16].abs().amax(-1) / 6).to(torch.float8_e4m3fn).double()
            step = torch.where(s == 0, 0.125, s) / g
        x = (W[:, k] / step).clamp(-6, 6)
        out[:, k] = grid[(x.abs().unsqueeze(-1) - grid).abs().argmin(-1)] * x.sign() * step
        err = (W[:, k] - out[:, k]) / Hinv[k, k]
        W[:, k + 1:] -= err.unsqueeze(1) * Hinv[k, k + 1:]
        Hinv = Hinv - Hinv[:, k:k + 1] @ Hinv[k:k + 1, :] / Hinv[k, k]
    return out


def output_error(X, w, quantized):
    """‖X W'ᵀ − X Wᵀ‖ / ‖X Wᵀ‖ in float64."""
    d = nvfp4.dequantize(*quantized, torch.float64) - w.double()
    return ((X.double() @ d.T).norm() / (X.double() @ w.double().T).norm()).item()


# ----------------------------------------------------------------------------------------------
# one matrix


def test_gptq_matches_float64_optimal_brain_surgeon():
    """The Cholesky rows and lazy block updates give what column-by-column elimination gives, across
    three lazy blocks, with a channel the inputs never drive (H_kk = 0)."""
    gen = torch.Generator().manual_seed(0)
    X = correlated_inputs(256, 96, gen)
    X[:, 5] = 0
    w = torch.randn(32, 96, generator=gen) * 0.05
    H = X.T @ X / len(X)
    g = nvfp4.compute_global_scale(w)
    ours = nvfp4.dequantize(*gptq.quantize(w, H, g, scales="absmax", block_size=32), torch.float64)
    ref = obs_f64(w, H, g)
    off = ((ours - ref).abs() > 1e-6 * ref.abs().max()).float().mean().item()
    assert off < 0.01, f"{off:.2%} of the weights differ from the float64 elimination"
    e_ours, e_ref = output_error(X, w, gptq.quantize(w, H, g, scales="absmax", block_size=32)), \
        ((X.double() @ (ref - w.double()).T).norm() / (X.double() @ w.double().T).norm()).item()
    assert abs(e_ours - e_ref) <= 1e-4 * e_ref, (e_ours, e_ref)


def test_gptq_beats_rounding_on_correlated_inputs():
    """The layer error on the calibration inputs and on fresh ones from the same distribution: GPTQ
    with mse scales < mse scales alone < absmax scales (nvfp4.quantize); GPTQ with absmax < absmax."""
    gen = torch.Generator().manual_seed(1)
    X, X_new = correlated_inputs(1024, 128, gen).split(512)              # calibration, fresh
    w = (torch.randn(64, 128, generator=gen) * 0.05).bfloat16()
    H = X.T @ X / len(X)
    ways = {"rtn": nvfp4.quantize(w), "mse": nvfp4.quantize(w, scales="mse"),
            "gptq absmax": gptq.quantize(w, H, scales="absmax"), "gptq mse": gptq.quantize(w, H)}
    for inputs in (X, X_new):
        err = {k: output_error(inputs, w, q) for k, q in ways.items()}
        print({k: round(v, 4) for k, v in err.items()})
        assert err["gptq mse"] < err["mse"] < err["rtn"] and err["gptq absmax"] < err["rtn"], err
        assert err["gptq mse"] < 0.8 * err["rtn"], err


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["mse", "absmax"])
def test_graphed_blocks_give_the_eager_codes_bit_for_bit(scales):
    """GraphedBlock replays the eager column loop: the same codes and scales, for a matrix with full
    blocks (graphed, the first of a shape warmed up eagerly) and a tail block (eager), reused across
    two matrices of one shape."""
    gen = torch.Generator().manual_seed(7)
    X = correlated_inputs(2048, 400, gen).cuda()                          # K = 3 full blocks + 16
    graphs = {}
    for seed in (0, 1):
        w = (torch.randn(300, 400, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16().cuda()
        H = X.T @ X / len(X)
        eager = gptq.quantize(w, H, scales=scales)
        graphed = gptq.quantize(w, H, scales=scales, graphs=graphs)
        for e, g in zip(eager, graphed):
            assert torch.equal(e.view(torch.uint8) if e.dtype == torch.float8_e4m3fn else e,
                               g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g)
    assert list(graphs) == [(300, gptq.BLOCK_SIZE, scales, w.device)]


@needs_ct
def test_gptq_output_is_a_compressed_tensors_nvfp4_tensor():
    gen = torch.Generator().manual_seed(3)
    X = correlated_inputs(128, 64, gen)
    w = (torch.randn(24, 64, generator=gen) * 0.05).bfloat16()
    packed, scale, g = gptq.quantize(w, X.T @ X)
    assert packed.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn and g.dtype == torch.float32
    assert packed.shape == (24, 32) and scale.shape == (24, 4) and torch.equal(g, nvfp4.compute_global_scale(w))
    assert torch.equal(ct_decompress(packed, scale, g), nvfp4.dequantize(packed, scale, g, torch.bfloat16))
    with pytest.raises(ValueError, match=r"H \(K, K\), got W \(24, 64\) and H \(32, 32\)"):
        gptq.quantize(w, torch.eye(32))
    with pytest.raises(ValueError, match="not positive definite"):
        gptq.quantize(w, -torch.eye(64))


# ----------------------------------------------------------------------------------------------
# the loaders' quantizer argument


def tiny_checkpoint(path, layers=3):
    """A random transformers Qwen2 (q/k/v biases) with `layers` layers, saved to path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**dict(TINY, num_hidden_layers=layers), rope_theta=1e6)).save_pretrained(path)
    return str(path)


def random_ids(n, lo, hi, seed, vocab=TINY["vocab_size"]):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def test_rtn_and_mse_loads_are_nvfp4_quantize_with_the_group_global_scale(tmp_path):
    from safetensors.torch import load_file
    path = tiny_checkpoint(tmp_path / "m", layers=1)
    weights = load_file(f"{path}/model.safetensors")
    for quantizer, scales in (("rtn", "absmax"), ("mse", "mse")):
        model = checkpoint.load_model(path, "nvfp4", "cpu", torch.float32, quantizer=quantizer)
        for name in checkpoint.group_of("model.layers.0.self_attn.q_proj") + ["model.layers.0.mlp.down_proj"]:
            group = checkpoint.group_of(name)
            g = torch.cat([nvfp4.compute_global_scale(weights[n + ".weight"]) for n in group]).min().reshape(1)
            want = nvfp4.quantize(weights[name + ".weight"], g, scales=scales)
            got = model.get_submodule(name).state_dict()
            assert torch.equal(got["weight_packed"], want[0]) and torch.equal(got["weight_global_scale"], g), name
            assert torch.equal(got["weight_scale"].view(torch.uint8), want[1].view(torch.uint8)), name


def test_gptq_load_streams_one_layer_and_beats_rtn(tmp_path, monkeypatch):
    """Layers are quantized in order, each while only its own 7 bf16 weights are alive; micro-batches
    of padded calibration rows give the quantization one batch gives; the model's logits on fresh
    tokens are closer to the bf16 model's than with absmax or mse rounding."""
    path = tiny_checkpoint(tmp_path / "m")
    calibration = random_ids(24, 8, 48, seed=0)
    refs, seen = [], []
    real_add, real_layer = gptq.Layerwise.add, gptq.Layerwise.quantize_layer

    def add(self, names, weights):
        refs.extend((n, weakref.ref(w)) for n, w in zip(names, weights))
        return real_add(self, names, weights)

    def quantize_layer(self, block, prefix, weights):
        seen.append((prefix, sorted(n for n, r in refs if r() is not None)))
        return real_layer(self, block, prefix, weights)

    monkeypatch.setattr(gptq.Layerwise, "add", add)
    monkeypatch.setattr(gptq.Layerwise, "quantize_layer", quantize_layer)
    model = checkpoint.load_model(path, "nvfp4", "cpu", torch.float32, quantizer="gptq", calibration=calibration)
    assert [p for p, _ in seen] == [f"model.layers.{i}." for i in range(3)]
    for prefix, live in seen:
        assert len(live) == 7 and all(n.startswith(prefix) for n in live), (prefix, live)

    monkeypatch.setattr(gptq, "BATCH_TOKENS", 64)                         # 1-8 padded rows a forward
    small = checkpoint.load_model(path, "nvfp4", "cpu", torch.float32, quantizer="gptq", calibration=calibration)
    for (name, a), b in zip(model.state_dict().items(), small.state_dict().values()):
        if name.endswith("weight_packed"):
            assert (nvfp4.unpack_fp4(a) != nvfp4.unpack_fp4(b)).float().mean() < 0.01, name

    dense = checkpoint.load_model(path, "bf16", "cpu", torch.float32)
    ids = torch.tensor(random_ids(4, 32, 33, seed=1))
    with torch.no_grad():
        want = dense(ids)
        err = {q: (checkpoint.load_model(path, "nvfp4", "cpu", torch.float32, quantizer=q)(ids) - want).norm().item()
               for q in ("rtn", "mse")}
        err["gptq"] = (model(ids) - want).norm().item()
    print({k: round(v / want.norm().item(), 4) for k, v in err.items()})
    assert err["gptq"] < min(err["rtn"], err["mse"]), err


def test_build_model_draws_the_same_weights_for_every_quantizer():
    """Random init with GPTQ: the same draws (so the same global scales) as with rtn, other codes."""
    cfg = dict(TINY, architectures=["LlamaForCausalLM"], num_hidden_layers=2)
    rtn = checkpoint.build_model(cfg, "nvfp4", "cpu", torch.float32, seed=3)
    ours = checkpoint.build_model(cfg, "nvfp4", "cpu", torch.float32, seed=3, quantizer="gptq",
                                  calibration=random_ids(8, 8, 32, seed=2))
    a, b = rtn.state_dict(), ours.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if not k.endswith(("weight_packed", "weight_scale")))
    key = "model.layers.1.mlp.down_proj.weight_packed"
    assert not torch.equal(a[key], b[key])


def test_quantizer_errors_are_clear(tmp_path):
    path = tiny_checkpoint(tmp_path / "m", layers=1)
    with pytest.raises(ValueError, match="quantizer must be one of"):
        checkpoint.load_model(path, device="cpu", quantizer="awq")
    with pytest.raises(ValueError, match="calibration token ids go with quantizer='gptq'"):
        checkpoint.load_model(path, device="cpu", quantizer="gptq")
    with pytest.raises(ValueError, match="calibration token ids go with quantizer='gptq'"):
        checkpoint.load_model(path, device="cpu", quantizer="mse", calibration=[[1, 2]])
    with pytest.raises(ValueError, match=r"ids in \[0, 256\)"):
        checkpoint.load_model(path, device="cpu", quantizer="gptq", calibration=[[1, 256]])
    with torch.device("meta"):
        model = checkpoint.Transformer(checkpoint.ModelConfig.from_hf(dict(TINY, architectures=["LlamaForCausalLM"])),
                                       "nvfp4")
    with pytest.raises(ValueError, match="arrived while layer 0 is incomplete"):
        gptq.Layerwise(model, [[1, 2]]).add(["model.layers.1.mlp.down_proj"], [torch.zeros(64, 128)])
