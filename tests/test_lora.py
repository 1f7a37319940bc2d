"""lora.py against PEFT: forward, adapter files both ways, merge, freezing, switching, errors.

The reference is PEFT (get_peft_model / PeftModel.from_pretrained / merge_and_unload) on a tiny
transformers model; our apply_lora works on the same module tree because names mirror HF's.
"""
import json
import os

import pytest
import torch
import torch.nn as nn
from conftest import make_tiny_hf
from peft import LoraConfig, PeftModel, get_peft_model

from lora import (LoRAConfig, LoRALinear, adapters_disabled, apply_lora, keep_bases, load_adapter, lora_modules,
                  lora_parameters, merge_lora, merged_sampling, save_adapter)

# ---------------------------------------------------------------------------------------------
# helpers


def ids(seed=1, B=2, T=12, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g)


def peft_lora(path, module):
    """The PEFT LoraLayer at our `path` inside a PeftModel."""
    return module.get_submodule("base_model.model." + path)


def randomize_adapters(model, seed=0, scale=0.1):
    """Non-zero random A and B (B starts at zero, which would hide every bug in the B path)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    with torch.no_grad():
        for path, m in lora_modules(model).items():
            m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * scale)
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * scale)
            out[path] = (m.lora_A.clone(), m.lora_B.clone())
    return out


def copy_into_peft(pm, adapters):
    with torch.no_grad():
        for path, (A, B) in adapters.items():
            layer = peft_lora(path, pm)
            layer.lora_A["default"].weight.copy_(A)
            layer.lora_B["default"].weight.copy_(B)


def peft_config(cfg: LoRAConfig):
    return LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, use_rslora=cfg.use_rslora,
                      target_modules=list(cfg.target_modules), task_type="CAUSAL_LM")


def logits(model, x):
    with torch.no_grad():
        out = model(x)
    return out.logits if hasattr(out, "logits") else out


def check_close(a, b, tol, what):
    err = (a.float() - b.float()).abs()
    assert err.max().item() <= tol, f"{what}: max err {err.max().item():.3e} mean {err.mean().item():.3e} > {tol}"


CASES = [
    ("qwen2", LoRAConfig(r=8, alpha=16)),
    ("llama", LoRAConfig(r=4, alpha=32, use_rslora=True, target_modules=("q_proj", "v_proj", "down_proj"))),
]

# ---------------------------------------------------------------------------------------------
# forward


@pytest.mark.parametrize("arch,cfg", CASES)
def test_forward_matches_peft(arch, cfg):
    ours, ref = make_tiny_hf(arch, seed=3), make_tiny_hf(arch, seed=3)
    apply_lora(ours, cfg)
    pm = get_peft_model(ref, peft_config(cfg))
    copy_into_peft(pm, randomize_adapters(ours))
    x = ids()
    a, b = logits(ours, x), logits(pm, x)
    assert not torch.allclose(a, logits(make_tiny_hf(arch, seed=3), x)), "adapters changed nothing"
    check_close(a, b, 1e-5, f"{arch} LoRA logits vs PEFT")


def test_init_matches_peft_default():
    # B = 0 (the adapted model is the base model at step 0); A ~ kaiming-uniform(a=sqrt(5)):
    # U(-1/sqrt(in), 1/sqrt(in)), the bound nn.Linear uses.
    m = make_tiny_hf("qwen2")
    base = logits(m, ids())
    apply_lora(m, LoRAConfig(r=8, alpha=16), generator=torch.Generator().manual_seed(0))
    check_close(logits(m, ids()), base, 0.0, "fresh adapters must not change the output")
    for m_ in lora_modules(m).values():
        assert torch.count_nonzero(m_.lora_B) == 0
        bound = 1 / m_.in_features ** 0.5
        assert m_.lora_A.abs().max() <= bound and m_.lora_A.abs().max() > 0.8 * bound


def test_only_adapters_trainable_and_fp32():
    m = make_tiny_hf("qwen2")
    apply_lora(m, LoRAConfig(r=4, alpha=8))
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    expected = {f"{path}.{w}" for path in lora_modules(m) for w in ("lora_A", "lora_B")}
    assert trainable == expected
    assert len(expected) == 2 * 7 * 2  # 2 layers x 7 projections x (A, B)
    assert {id(p) for p in lora_parameters(m)} == {id(p) for n, p in m.named_parameters() if p.requires_grad}
    ref = get_peft_model(make_tiny_hf("qwen2"), peft_config(LoRAConfig(r=4, alpha=8)))
    n_peft = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    assert sum(p.numel() for p in lora_parameters(m)) == n_peft
    assert all(p.dtype == torch.float32 for p in lora_parameters(m))


def test_bf16_model_stays_bf16_and_grads_fp32():
    m = make_tiny_hf("qwen2").to(torch.bfloat16)
    apply_lora(m, LoRAConfig(r=4, alpha=8))
    randomize_adapters(m)
    out = m(ids()).logits
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    for p in lora_parameters(m):
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
        assert p.grad.abs().sum() > 0
    assert all(p.grad is None for n, p in m.named_parameters() if "lora_" not in n)


def test_gradients_match_peft():
    cfg = LoRAConfig(r=4, alpha=8)
    ours, ref = make_tiny_hf("qwen2"), make_tiny_hf("qwen2")
    apply_lora(ours, cfg)
    pm = get_peft_model(ref, peft_config(cfg))
    copy_into_peft(pm, randomize_adapters(ours))
    x = ids()
    ours(x).logits.square().mean().backward()
    pm(x).logits.square().mean().backward()
    for path, m in lora_modules(ours).items():
        layer = peft_lora(path, pm)
        check_close(m.lora_A.grad, layer.lora_A["default"].weight.grad, 1e-6, f"{path} dA")
        check_close(m.lora_B.grad, layer.lora_B["default"].weight.grad, 1e-6, f"{path} dB")


def test_dropout_only_on_adapter_path():
    m = make_tiny_hf("qwen2")
    base = logits(m, ids())
    apply_lora(m, LoRAConfig(r=4, alpha=8, dropout=0.5))
    randomize_adapters(m)
    m.eval()
    a = logits(m, ids())
    m.train()
    b = logits(m, ids())
    assert not torch.equal(a, b), "dropout did nothing in train mode"
    with adapters_disabled(m):
        check_close(logits(m, ids()), base, 0.0, "dropout leaked into the base path")


def test_adapters_disabled_gives_base_logits():
    m = make_tiny_hf("llama", tie=True)
    x = ids()
    base = logits(m, x)
    apply_lora(m, LoRAConfig(r=4, alpha=8))
    randomize_adapters(m)
    adapted = logits(m, x)
    with adapters_disabled(m):
        check_close(logits(m, x), base, 0.0, "adapters_disabled")
    check_close(logits(m, x), adapted, 0.0, "adapters back on after the context")
    with pytest.raises(RuntimeError):
        with adapters_disabled(m):
            raise RuntimeError("boom")
    assert all(mod.enabled for mod in lora_modules(m).values()), "an exception left adapters disabled"


# ---------------------------------------------------------------------------------------------
# adapter files


@pytest.mark.parametrize("arch,cfg", CASES)
def test_our_adapter_loads_in_peft(arch, cfg, tmp_path):
    ours = make_tiny_hf(arch, seed=5)
    apply_lora(ours, cfg)
    randomize_adapters(ours)
    save_adapter(ours, str(tmp_path), base_model_name_or_path="org/tiny")
    assert sorted(os.listdir(tmp_path)) == ["adapter_config.json", "adapter_model.safetensors"]
    pm = PeftModel.from_pretrained(make_tiny_hf(arch, seed=5), str(tmp_path))
    x = ids()
    check_close(logits(ours, x), logits(pm, x), 1e-5, f"{arch}: our adapter in PEFT")
    assert json.load(open(tmp_path / "adapter_config.json"))["base_model_name_or_path"] == "org/tiny"


@pytest.mark.parametrize("arch,cfg", CASES)
def test_peft_adapter_loads_in_ours(arch, cfg, tmp_path):
    pm = get_peft_model(make_tiny_hf(arch, seed=6), peft_config(cfg))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)  # B non-zero
    pm.save_pretrained(str(tmp_path))
    # Into a plain model (adapters created from the file's config) ...
    fresh = load_adapter(make_tiny_hf(arch, seed=6), str(tmp_path))
    x = ids()
    check_close(logits(fresh, x), logits(pm, x), 1e-5, f"{arch}: PEFT adapter in ours")
    # ... and into a model that already has matching adapters.
    again = apply_lora(make_tiny_hf(arch, seed=6), cfg)
    load_adapter(again, str(tmp_path))
    check_close(logits(again, x), logits(pm, x), 1e-5, f"{arch}: PEFT adapter into existing adapters")


def test_save_load_roundtrip_is_exact(tmp_path):
    cfg = LoRAConfig(r=4, alpha=6, dropout=0.1, use_rslora=True)
    a = apply_lora(make_tiny_hf("qwen2"), cfg)
    randomize_adapters(a, seed=9)
    save_adapter(a, str(tmp_path))
    for b in (apply_lora(make_tiny_hf("qwen2"), cfg), make_tiny_hf("qwen2")):  # with / without adapters
        load_adapter(b, str(tmp_path))
        for (pa, ma), (pb, mb) in zip(lora_modules(a).items(), lora_modules(b).items(), strict=True):
            assert pa == pb and torch.equal(ma.lora_A, mb.lora_A) and torch.equal(ma.lora_B, mb.lora_B)
            assert (mb.r, mb.alpha, mb.use_rslora, mb.scaling, mb.lora_dropout.p) == (4, 6, True, 3.0, 0.1)
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f], "temporary files left behind"


# ---------------------------------------------------------------------------------------------
# merge


def test_merge_matches_peft_merge_and_unload():
    cfg = LoRAConfig(r=8, alpha=16, use_rslora=True)
    ours = apply_lora(make_tiny_hf("qwen2", seed=2), cfg)
    pm = get_peft_model(make_tiny_hf("qwen2", seed=2), peft_config(cfg))
    copy_into_peft(pm, randomize_adapters(ours))
    ref = pm.merge_and_unload().state_dict()
    merged = merge_lora(ours, dtype=torch.float32)
    assert set(merged) == set(ref), f"key sets differ: {sorted(set(merged) ^ set(ref))[:6]}"
    for k, v in ref.items():
        check_close(merged[k], v, 1e-6, f"merged {k}")
    merged_bf16 = merge_lora(ours)
    for k, v in ref.items():
        assert merged_bf16[k].dtype == torch.bfloat16
        assert torch.equal(merged_bf16[k], v.to(torch.bfloat16)), k
    # Merging does not modify the adapted model.
    assert all(isinstance(m, LoRALinear) for m in lora_modules(ours).values())


def test_merged_sampling_holds_peft_merge_adapter_and_restores_the_weights():
    """lora.merged_sampling, a bf16 run's sampler, against PEFT's merge_adapter (what TRL applies before
    it hands vLLM the weights): inside, every adapted weight is PEFT's merged weight bit for bit and
    the adapters are off, so the model computes what it computes with them on, to bf16 rounding; after,
    every weight is bitwise what it was and the adapters are on, also after a merge cut short by an
    error. Without kept bases it merges nothing."""
    cfg = LoRAConfig(r=8, alpha=16)
    ours = apply_lora(make_tiny_hf("qwen2", seed=2).to(torch.bfloat16), cfg)
    pm = get_peft_model(make_tiny_hf("qwen2", seed=2).to(torch.bfloat16), peft_config(cfg))
    copy_into_peft(pm, randomize_adapters(ours))
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    x = ids()
    want = logits(ours, x)                                           # the update computed apart
    with merged_sampling(ours):
        assert all(m.enabled for m in lora_modules(ours).values()) and torch.equal(logits(ours, x), want)
    keep_bases(ours, True)
    pm.merge_adapter()
    with merged_sampling(ours):
        assert not any(m.enabled for m in lora_modules(ours).values())
        for path, m in lora_modules(ours).items():
            assert torch.equal(m.base_layer.weight, peft_lora(path, pm).base_layer.weight), path
        got = logits(ours, x)
    with adapters_disabled(ours):
        plain = logits(ours, x)
    scale = want.float().abs().max().item()
    check_close(got, want, 0.02 * scale, "merged against the adapted forward")
    assert (plain.float() - want.float()).abs().max().item() > 0.1 * scale, "the adapters must matter here"
    assert all(m.enabled for m in lora_modules(ours).values())
    assert all(torch.equal(v, before[k]) for k, v in ours.state_dict().items())
    assert torch.equal(logits(ours, x), want)

    def out_of_memory():
        raise RuntimeError("out of memory")
    list(lora_modules(ours).values())[4].delta_weight = out_of_memory      # a merge cut short, four merged
    with pytest.raises(RuntimeError, match="out of memory"), merged_sampling(ours):
        pass
    assert all(m.enabled for m in lora_modules(ours).values())
    assert all(torch.equal(v, before[k]) for k, v in ours.state_dict().items())


def test_merge_tied_embeddings_appear_once():
    m = apply_lora(make_tiny_hf("llama", tie=True), LoRAConfig(r=4, alpha=8))
    merged = merge_lora(m)
    assert "model.embed_tokens.weight" in merged and "lm_head.weight" not in merged


# ---------------------------------------------------------------------------------------------
# errors


def test_config_validation_names_the_field():
    for kwargs, field in [(dict(r=0), "r"), (dict(alpha=-1), "alpha"), (dict(dropout=1.0), "dropout"),
                          (dict(target_modules=()), "target_modules"), (dict(target_modules="q_proj"), "target_modules"),
                          (dict(use_rslora=1), "use_rslora")]:
        with pytest.raises((ValueError, TypeError), match=field):
            LoRAConfig(**kwargs)
    assert LoRAConfig(r=16, alpha=32).scaling == 2.0
    assert LoRAConfig(r=16, alpha=32, use_rslora=True).scaling == 8.0


def test_wrong_target_is_a_clear_error():
    with pytest.raises(ValueError, match="qq_proj"):
        apply_lora(make_tiny_hf("qwen2"), LoRAConfig(target_modules=("q_proj", "qq_proj")))
    with pytest.raises(ValueError, match="not a linear"):
        apply_lora(make_tiny_hf("qwen2"), LoRAConfig(target_modules=("mlp",)))
    m = apply_lora(make_tiny_hf("qwen2"), LoRAConfig(r=4, alpha=8))
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(m, LoRAConfig(r=4, alpha=8))


def test_load_errors(tmp_path):
    src = apply_lora(make_tiny_hf("qwen2"), LoRAConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj")))
    save_adapter(src, str(tmp_path), base_model_name_or_path="Qwen/Qwen2.5-7B-Instruct")
    with pytest.raises(ValueError, match="rank mismatch.*r=4.*r=8"):
        load_adapter(apply_lora(make_tiny_hf("qwen2"), LoRAConfig(r=8, alpha=16)), str(tmp_path))
    with pytest.raises(ValueError, match="target mismatch"):
        load_adapter(apply_lora(make_tiny_hf("qwen2"), LoRAConfig(r=4, alpha=8)), str(tmp_path))
    with pytest.raises(ValueError, match="scaling mismatch"):
        load_adapter(apply_lora(make_tiny_hf("qwen2"), LoRAConfig(r=4, alpha=16, target_modules=("q_proj", "v_proj"))),
                     str(tmp_path))
    with pytest.raises(ValueError, match="Qwen2.5-7B-Instruct.*Llama-3.1-8B"):
        load_adapter(make_tiny_hf("qwen2"), str(tmp_path), base_model_name_or_path="meta-llama/Llama-3.1-8B")
    # Same model by a local path: accepted.
    load_adapter(make_tiny_hf("qwen2"), str(tmp_path), base_model_name_or_path="/models/Qwen2.5-7B-Instruct/")
    # A tensor of the wrong width (same names and rank): edit the file by hand.
    from safetensors.torch import load_file, save_file
    wpath = str(tmp_path / "adapter_model.safetensors")
    t = load_file(wpath)
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    t[key] = torch.zeros(4, 32)
    save_file(t, wpath)
    with pytest.raises(ValueError, match="shape mismatch for .*layers.1.self_attn.v_proj.lora_A"):
        load_adapter(make_tiny_hf("qwen2"), str(tmp_path))
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_adapter(make_tiny_hf("qwen2"), str(tmp_path / "nope"))
    os.remove(tmp_path / "adapter_model.safetensors")
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors"):
        load_adapter(make_tiny_hf("qwen2"), str(tmp_path))


# ---------------------------------------------------------------------------------------------
# our model.py (bf16 and NVFP4 bases) against transformers + PEFT


def nvfp4_roundtrip_linears(hf_model):
    """The reference for an NVFP4 base: every decoder projection W replaced by dequant(quant(W)),
    q/k/v and gate/up with one global scale, the smallest of theirs (llm-compressor's fused layers)."""
    nvfp4 = pytest.importorskip("nvfp4")
    groups = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
    with torch.no_grad():
        for name, mod in hf_model.named_modules():
            for group in groups:
                if not all(hasattr(mod, n) for n in group):
                    continue
                linears = [getattr(mod, n) for n in group]
                g = min(nvfp4.compute_global_scale(m.weight) for m in linears)
                for m in linears:
                    m.weight.copy_(nvfp4.dequantize(*nvfp4.quantize(m.weight, g), torch.float32))
    return hf_model


@pytest.mark.parametrize("arch,quant", [("qwen2", "bf16"), ("llama", "nvfp4"), ("qwen2", "nvfp4")])
def test_our_model_with_lora_matches_transformers_peft(tiny_hf_dir, arch, quant, tmp_path):
    from checkpoint import load_model
    path, hf = tiny_hf_dir(arch, tie=arch == "llama", seed=7)
    cfg = LoRAConfig(r=8, alpha=16)
    ours = apply_lora(load_model(path, quant=quant, dtype=torch.float32, device="cpu"), cfg)
    if quant == "nvfp4":
        base = ours.model.layers[0].self_attn.q_proj.base_layer
        assert hasattr(base, "weight_packed"), f"expected an NVFP4 base, got {type(base).__name__}"
        nvfp4_roundtrip_linears(hf)
    pm = get_peft_model(hf, peft_config(cfg))
    copy_into_peft(pm, randomize_adapters(ours))
    x = ids()
    a, b = logits(ours, x), logits(pm, x)
    check_close(a, b, 1e-4, f"{arch}/{quant}: our model + LoRA vs transformers + PEFT")
    with adapters_disabled(ours):
        with pm.disable_adapter():
            check_close(logits(ours, x), logits(pm, x), 1e-4, f"{arch}/{quant}: adapters disabled")
    # Our adapter file, read by PEFT on the transformers model, gives the same logits.
    save_adapter(ours, str(tmp_path / "ad"), base_model_name_or_path=path)
    pm2 = PeftModel.from_pretrained(pm.unload(), str(tmp_path / "ad"))
    check_close(logits(pm2, x), a, 1e-4, f"{arch}/{quant}: our adapter file in PEFT")
    # Merged export: dequantized base + scaling·B A, same as PEFT's merge_and_unload.
    ref = pm2.merge_and_unload().state_dict()
    merged = merge_lora(ours, dtype=torch.float32)
    if arch == "llama":  # tied: HF's state_dict lists lm_head.weight too, HF's save drops it
        ref.pop("lm_head.weight")
    assert set(merged) == set(ref), f"key sets differ: {sorted(set(merged) ^ set(ref))[:6]}"
    for k, v in ref.items():
        check_close(merged[k], v, 1e-6, f"{arch}/{quant}: merged {k}")


def test_partial_targets_roundtrip_through_peft(tmp_path):
    # Adapters on one layer only: the config must name the exact modules, or PEFT adapts them all.
    cfg = LoRAConfig(r=4, alpha=8, target_modules=("model.layers.1.self_attn.q_proj", "layers.0.mlp.down_proj"))
    ours = apply_lora(make_tiny_hf("qwen2"), cfg)
    assert sorted(lora_modules(ours)) == ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"]
    randomize_adapters(ours)
    save_adapter(ours, str(tmp_path))
    pm = PeftModel.from_pretrained(make_tiny_hf("qwen2"), str(tmp_path))
    n_peft = sum(1 for n, _ in pm.named_modules() if n.endswith("lora_A"))
    assert n_peft == 2, f"PEFT adapted {n_peft} modules"
    check_close(logits(ours, ids()), logits(pm, ids()), 1e-5, "partial targets in PEFT")
    back = load_adapter(make_tiny_hf("qwen2"), str(tmp_path))
    check_close(logits(back, ids()), logits(ours, ids()), 0.0, "partial targets back in ours")


@pytest.mark.gpu
def test_lora_on_nvfp4_cuda_bf16_matches_cpu_fp32(tiny_hf_dir):
    """The GPU path (Triton NVFP4 kernel, bf16 activations, fp32 adapters) against our CPU fp32
    path, which the tests above tie to transformers + PEFT."""
    from checkpoint import load_model
    path, _ = tiny_hf_dir("qwen2", seed=8)
    cfg = LoRAConfig(r=8, alpha=16)
    gpu = apply_lora(load_model(path, quant="nvfp4", device="cuda", dtype=torch.bfloat16), cfg)
    cpu = apply_lora(load_model(path, quant="nvfp4", device="cpu", dtype=torch.float32), cfg)
    adapters = randomize_adapters(cpu)
    with torch.no_grad():
        for p, m in lora_modules(gpu).items():
            m.lora_A.copy_(adapters[p][0])
            m.lora_B.copy_(adapters[p][1])
    x = ids()
    a, b = gpu(x.cuda()), cpu(x)
    assert a.dtype == torch.bfloat16
    scale = b.abs().max().item()
    check_close(a.float().cpu() / scale, b / scale, 3e-2, "cuda bf16 vs cpu fp32 logits (relative to max)")
    a.float().square().mean().backward()
    b.square().mean().backward()
    for (p, mg), mc in zip(lora_modules(gpu).items(), lora_modules(cpu).values()):
        for pg, pc in ((mg.lora_A, mc.lora_A), (mg.lora_B, mc.lora_B)):
            assert pg.grad.dtype == torch.float32
            rel = (pg.grad.cpu() - pc.grad).norm() / pc.grad.norm()
            assert rel < 5e-2, f"{p}: grad relative error {rel:.3e}"


def _bf16_linear_with_adapter(device):
    torch.manual_seed(0)
    m = LoRALinear(nn.Linear(32, 48, dtype=torch.bfloat16).to(device), r=4, alpha=8)
    with torch.no_grad():
        m.lora_B.normal_()
    return m


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_sampling_cast_cache_follows_in_place_updates(mode):
    """Without autograd the bf16 casts of A and B are kept; each eager call must refresh them, so an
    optimizer-style in-place update is seen at once, and the result equals the autograd path's."""
    m = _bf16_linear_with_adapter("cpu")
    x = torch.randn(3, 5, 32).to(torch.bfloat16)
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    for step in range(3):
        with ctx():
            fast = m(x)
        slow = m(x).detach()                                 # grad enabled: fresh casts every call
        check_close(fast, slow, 0.0, f"step {step}: cached casts vs autograd path")
        with torch.no_grad():
            m.lora_A.add_(0.1 * torch.randn_like(m.lora_A))  # what AdamW does, in place
            m.lora_B.mul_(1.5)
    with ctx():
        assert m._casts is not None and m._casts[1].dtype == torch.bfloat16
        assert not torch.equal(m(x), fast)


@pytest.mark.gpu
def test_gpu_graph_replay_reads_casts_refreshed_by_an_eager_call():
    """A graph captured under ops.casts_kept (a decode step's) reads the kept casts as they are: it
    sees an in-place update of B only after an eager call refreshed them. A graph captured without
    it (a prefill graph's) recorded the refresh and sees the update at its next replay."""
    import ops
    m = _bf16_linear_with_adapter("cuda")
    x = torch.randn(4, 32, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        m(x)                                                 # eager: creates and fills the casts
        kept, refreshing = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with ops.casts_kept(), torch.cuda.graph(kept):
            out = m(x)
        with torch.cuda.graph(refreshing):
            out_refreshing = m(x)
    with torch.no_grad():
        m.lora_B.mul_(-2.0)
    want = m(x).detach()                                     # autograd path: fresh casts
    with torch.inference_mode():
        kept.replay()
        stale = out.clone()
        m(x)                                                 # an eager call (rollout's prefill) refreshes
        kept.replay()
    assert not torch.equal(stale, want), "the replay before the refresh should still see the old B"
    check_close(out, want, 0.0, "graph replay after the eager refresh")
    with torch.no_grad():
        m.lora_B.mul_(-2.0)
    want = m(x).detach()
    with torch.inference_mode():
        refreshing.replay()
    check_close(out_refreshing, want, 0.0, "a graph that records the refresh, at its next replay")
