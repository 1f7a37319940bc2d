"""aqn.py: the σ schedule against a float64 formula, the noise on a real transformers model,
bit-exact restore, determinism, and the identity "norm-weight noise = scaled linear columns".
"""
import copy
import math
from fractions import Fraction

import pytest
import torch
import torch.nn as nn
from conftest import make_tiny_hf

from aqn import AQNConfig, noise_applied, noisy_norms, sample_noise, sigma_at
from lora import LoRAConfig, apply_lora

# ---------------------------------------------------------------------------------------------
# helpers


def ids(seed=1, B=2, T=12, vocab=256):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    with torch.no_grad():
        out = model(x)
    return out.logits if hasattr(out, "logits") else out


def snapshot(model):
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def assert_same_state(model, snap, what):
    for n, t in model.state_dict().items():
        assert torch.equal(t, snap[n]), f"{what}: {n} changed (max diff {(t.float() - snap[n].float()).abs().max():.3e})"


# ---------------------------------------------------------------------------------------------
# schedule


def test_schedule_defaults_every_stage():
    cfg = AQNConfig()
    assert (cfg.sigma_start, cfg.sigma_end, cfg.stages, cfg.rollout_only) == (1e-2, 5e-4, 10, False)
    # Stage k >= 1: 1e-2 * 0.05 ** ((k - 1) / 8), written out by hand (float64, from math.pow).
    hand = [0.0] + [0.01 * math.pow(0.05, (k - 1) / 8) for k in range(1, 10)]
    assert hand[1] == 0.01 and abs(hand[9] - 5e-4) < 1e-18
    assert abs(hand[5] - math.sqrt(0.01 * 5e-4)) < 1e-15  # the middle stage is the geometric mean
    for total in (100, 95, 7, 1000):
        for step in range(total + 3):
            # k = floor(step / (total / K)) computed exactly with fractions, clamped to K-1.
            k = min(math.floor(Fraction(step) / Fraction(total, 10)), 9)
            got = sigma_at(step, total, cfg)
            assert got == pytest.approx(hand[k], rel=1e-12, abs=0), f"step {step}/{total}: {got} vs stage {k} {hand[k]}"
    # Ten stages of ten steps each, decaying geometrically by 0.05 ** (1/8) ≈ 0.6877 per stage.
    stages = [sigma_at(10 * k, 100, cfg) for k in range(10)]
    assert stages[0] == 0.0
    for a, b in zip(stages[1:], stages[2:]):
        assert b / a == pytest.approx(0.05 ** 0.125, rel=1e-12)


def test_schedule_edges_and_validation():
    cfg = AQNConfig(stages=2)
    assert sigma_at(0, 10, cfg) == 0.0 and sigma_at(5, 10, cfg) == cfg.sigma_start
    assert all(sigma_at(step, 10, AQNConfig(enabled=False)) == 0.0 for step in range(10)), "--no-aqn: no added noise"
    with pytest.raises(ValueError, match="total_steps"):
        sigma_at(0, 0, AQNConfig())
    with pytest.raises(ValueError, match="step"):
        sigma_at(-1, 10, AQNConfig())
    for kwargs, field in [(dict(sigma_start=0), "sigma_start"), (dict(sigma_end=-1e-3), "sigma_end"),
                          (dict(stages=1), "stages"), (dict(rollout_only="yes"), "rollout_only"),
                          (dict(enabled=1), "enabled")]:
        with pytest.raises((ValueError, TypeError), match=field):
            AQNConfig(**kwargs)


# ---------------------------------------------------------------------------------------------
# noise on a model


def test_noise_targets_and_determinism():
    m = make_tiny_hf("qwen2")
    names = sorted(sample_noise(m, 1e-2, torch.Generator().manual_seed(0)))
    assert names == sorted(f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm"))
    assert "model.norm" not in names
    a = sample_noise(m, 1e-2, torch.Generator().manual_seed(0))
    b = sample_noise(m, 1e-2, torch.Generator().manual_seed(0))
    c = sample_noise(m, 1e-2, torch.Generator().manual_seed(1))
    for n in a:
        assert a[n].dtype == torch.float32 and a[n].shape == (64,)
        assert torch.equal(a[n], b[n]), f"{n}: same seed, different noise"
        assert not torch.equal(a[n], c[n]), f"{n}: different seeds, same noise"
    assert not torch.equal(a[names[0]], a[names[1]]), "norms must get independent noise"
    assert sample_noise(m, 0.0, torch.Generator().manual_seed(0)) == {}


def test_noise_std_matches_sigma():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(8192), nn.LayerNorm(8192)

    model = nn.Module()
    model.layers = nn.ModuleList(Layer() for _ in range(4))
    z = torch.cat(list(sample_noise(model, 3e-3, torch.Generator().manual_seed(0)).values()))  # 65536 draws
    assert abs(z.mean().item()) < 3e-3 * 0.02 and z.std().item() == pytest.approx(3e-3, rel=0.02)


def test_noise_changes_logits_and_restores_bit_exactly():
    m = make_tiny_hf("llama", tie=True)
    x = ids()
    before, snap = logits(m, x), snapshot(m)
    noise = sample_noise(m, 1e-2, torch.Generator().manual_seed(0))
    with noise_applied(m, noise):
        noisy = logits(m, x)
        for name, z in noise.items():
            w = m.get_submodule(name).weight
            assert torch.equal(w, snap[name + ".weight"] + z), f"{name}: weight is not w + z"
        assert torch.equal(m.model.norm.weight, snap["model.norm.weight"]), "the final norm got noise"
    diff = (noisy - before).abs().max().item()
    assert diff > 1e-3, f"noise barely changed the logits (max diff {diff:.2e})"
    assert_same_state(m, snap, "after noise_applied")
    assert torch.equal(logits(m, x), before)


def test_restore_on_exception():
    m = make_tiny_hf("qwen2")
    snap = snapshot(m)
    with pytest.raises(RuntimeError, match="boom"):
        with noise_applied(m, sample_noise(m, 1e-2, torch.Generator().manual_seed(0))):
            raise RuntimeError("boom")
    assert_same_state(m, snap, "after an exception")


def test_bad_noise_is_a_clear_error():
    m = make_tiny_hf("qwen2")
    with pytest.raises(ValueError, match="shape"):
        with noise_applied(m, {"model.layers.0.input_layernorm": torch.zeros(3)}):
            pass
    with pytest.raises(ValueError, match="model.layers.9.input_layernorm"):
        with noise_applied(m, {"model.layers.9.input_layernorm": torch.zeros(64)}):
            pass
    with pytest.raises(ValueError, match="sigma"):
        sample_noise(m, -1.0)
    with pytest.raises(ValueError, match="input_layernorm"):
        sample_noise(nn.Linear(4, 4), 1e-2)


def test_training_step_inside_the_context_and_backward_outside_fails_loudly():
    m = apply_lora(make_tiny_hf("qwen2"), LoRAConfig(r=4, alpha=8))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    x = ids()
    noise = sample_noise(m, 1e-2, torch.Generator().manual_seed(0))
    with noise_applied(m, noise):
        m(x).logits.square().mean().backward()  # forward and backward under the same z: fine
        loss = m(x).logits.square().mean()
    # The restore bumped the weights' version counters: autograd refuses stale saved tensors.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# ---------------------------------------------------------------------------------------------
# the identity behind AQN and the precision argument


def test_norm_noise_equals_scaled_linear_columns_float64():
    """RMSNorm(x)·(w + z) feeding W equals RMSNorm(x)·w feeding W·diag(1 + z/w)."""
    for arch in ("qwen2", "llama"):
        noisy = make_tiny_hf(arch, seed=4).double()
        scaled = copy.deepcopy(noisy)
        x = ids()
        base = logits(noisy, x)
        noise = sample_noise(noisy, 5e-2, torch.Generator().manual_seed(0))
        with noise_applied(noisy, noise):
            a = logits(noisy, x)
        with torch.no_grad():
            for name, z in noise.items():
                layer_path, _, norm = name.rpartition(".")
                layer = scaled.get_submodule(layer_path)
                w = layer.get_submodule(norm).weight                                     # (C,)
                factor = 1 + z.double() / w                                              # (C,)
                nexts = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj) \
                    if norm == "input_layernorm" else (layer.mlp.gate_proj, layer.mlp.up_proj)
                for lin in nexts:
                    lin.weight.mul_(factor)                                              # (N, C) * (C,)
        b = logits(scaled, x)
        err, effect = (a - b).abs().max().item(), (a - base).abs().max().item()
        assert err < 1e-10, f"{arch}: identity max err {err:.3e} (noise effect {effect:.3e})"
        assert effect > 1e-2, f"{arch}: noise effect {effect:.3e} too small to test the identity"


def test_bf16_norm_weights_would_lose_the_noise():
    """Why model.py keeps norm weights in fp32: bf16 spacing near 1 is 2^-8..2^-7."""
    g = torch.Generator().manual_seed(0)
    w = 1 + 0.1 * torch.randn(200_000, generator=g)                      # like real norm weights
    lost = {}
    for sigma in (5e-4, 1e-2):
        z = sigma * torch.randn(w.shape, generator=g)
        for dtype in (torch.bfloat16, torch.float32):
            wd = w.to(dtype)
            lost[sigma, dtype] = ((wd.float() + z).to(dtype) == wd).float().mean().item()
    # Round-to-nearest drops |z| < spacing/2 = 2^-9 (w < 1) or 2^-8 (w >= 1).
    assert lost[5e-4, torch.bfloat16] > 0.999, lost   # 3.9σ / 7.8σ: essentially all of it
    assert 0.15 < lost[1e-2, torch.bfloat16] < 0.35, lost
    assert lost[5e-4, torch.float32] < 1e-3 and lost[1e-2, torch.float32] < 1e-3, lost


# ---------------------------------------------------------------------------------------------
# our model.py: fp32 norm weights, so even σ_end reaches the logits


@pytest.mark.parametrize("quant", ["bf16", "nvfp4"])
def test_noise_on_our_model(tiny_hf_dir, quant):
    from checkpoint import load_model
    path, _ = tiny_hf_dir("qwen2", seed=3)
    m = load_model(path, quant=quant, device="cpu")  # bf16 activations, fp32 norm weights
    norms = noisy_norms(m)
    assert sorted(norms) == sorted(f"model.layers.{i}.{n}" for i in range(2)
                                   for n in ("input_layernorm", "post_attention_layernorm"))
    assert all(mod.weight.dtype == torch.float32 for mod in norms.values())
    x = ids()
    before, snap = logits(m, x), snapshot(m)
    noise = sample_noise(m, AQNConfig().sigma_end, torch.Generator().manual_seed(0))
    with noise_applied(m, noise):
        for name, z in noise.items():  # σ = 5e-4 survives in the fp32 weights, element by element
            changed = (m.get_submodule(name).weight != snap[name + ".weight"]).float().mean().item()
            assert changed > 0.95, f"{name}: only {changed:.0%} of the weights took the noise"
        noisy = logits(m, x)
    assert not torch.equal(noisy, before), "σ_end noise did not reach the logits"
    assert_same_state(m, snap, "after noise_applied")
    assert torch.equal(logits(m, x), before)


@pytest.mark.gpu
def test_noise_on_cuda_is_deterministic_and_restored(tiny_hf_dir):
    from checkpoint import load_model
    path, _ = tiny_hf_dir("llama", tie=True, seed=2)
    m = load_model(path, quant="nvfp4", device="cuda")
    x = ids().cuda()
    before, snap = logits(m, x), snapshot(m)
    a = sample_noise(m, 1e-2, torch.Generator("cuda").manual_seed(0))
    b = sample_noise(m, 1e-2, torch.Generator("cuda").manual_seed(0))
    assert all(torch.equal(a[k], b[k]) and a[k].is_cuda for k in a)
    with noise_applied(m, a):
        noisy = logits(m, x)
    assert not torch.equal(noisy, before)
    assert_same_state(m, snap, "cuda, after noise_applied")
    assert torch.equal(logits(m, x), before)


def test_warns_on_bf16_norm_weights():
    m = make_tiny_hf("qwen2").to(torch.bfloat16)
    with pytest.warns(UserWarning, match="float32"):
        with noise_applied(m, sample_noise(m, 1e-2, torch.Generator().manual_seed(0))):
            pass
