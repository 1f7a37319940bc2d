"""kernels/stacked.py with the trunk's model.Stack: q/k/v and gate/up in one allocation and one
matmul on the sampling path give the training forward's logits (one linear at a time, torch ops),
with and without LoRA; the stack ends where a member moves; the loader stacks every layer's groups.

The models come from the trunk (checkpoint.load_model / build_model, lora.apply_lora); the sampling
path is forced on the CPU by making kernels.runs true without autograd (the kernels then run in the
Triton interpreter).
"""
import os

import pytest
import torch
import torch.nn as nn

import kernels
from checkpoint import GROUPS, build_model, load_model
from conftest import batch, rel_err
from kernels import lora as kl
from kernels import stacked


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("quant", ["bf16", "nvfp4"])
def test_stacked_projections_match_one_by_one(tiny_hf_dir, quant, monkeypatch):
    """q/k/v and gate/up share one allocation (each linear a row slice of it: the state dict and
    the training forward are unchanged) and the sampling path multiplies once per group, then adds
    the group's LoRA update: the logits equal the training forward's (torch ops, one linear at a
    time)."""
    from lora import LoRAConfig, adapters_disabled, apply_lora, lora_modules
    path, _ = tiny_hf_dir("qwen2")
    model = load_model(path, quant=quant, device="cpu", dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    assert attn.stacked is not None and model.model.layers[1].mlp.stacked is not None
    key = "weight_packed" if quant == "nvfp4" else "weight"
    q, k = getattr(attn.q_proj, key), getattr(attn.k_proj, key)
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr(), "not one allocation"
    assert k.data_ptr() == q.data_ptr() + q.nbytes, "not back to back"
    apply_lora(model, LoRAConfig(r=4, alpha=8))
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)
    calls, groups = [], []
    real_call, real_group = stacked.matmul, kl.group_update
    monkeypatch.setattr(stacked, "matmul", lambda stack, x, *a, **kw: calls.append(1) or real_call(stack, x, *a, **kw))
    monkeypatch.setattr(kl, "group_update", lambda *a: groups.append(1) or real_group(*a))
    # the sampling path on the CPU: Triton kernels in the interpreter (conftest)
    monkeypatch.setattr(kernels, "runs", lambda x: not torch.is_grad_enabled())
    ids, pos = batch()
    with torch.no_grad():
        sampled = model(ids, pos)
    assert len(calls) == len(groups) == 2 * model.config.num_layers
    with torch.enable_grad():
        trained = model(ids, pos)                  # one linear at a time, torch ops
    assert rel_err(sampled, trained) < 1e-5
    with torch.no_grad():                          # an optimizer step in place: the group's stacked
        for m in lora_modules(model).values():     # copies of A and B follow (an eager call)
            m.lora_B.mul_(-2.0)
        sampled = model(ids, pos)
        with adapters_disabled(model):
            base = model(ids, pos)
    with torch.enable_grad():
        trained = model(ids, pos)
        with adapters_disabled(model):
            base_trained = model(ids, pos)
    assert rel_err(sampled, trained) < 1e-5 and rel_err(base, base_trained) < 1e-5
    assert rel_err(base, trained) > 1e-3           # the adapters matter here
    calls.clear()
    # a member that no longer lives in the stack (a reload that rebinds it) turns the stack off
    base = attn.k_proj.base_layer
    if key in base._parameters:
        base._parameters[key] = nn.Parameter(base.weight.detach().clone(), requires_grad=False)
    else:
        base._buffers[key] = base.weight_packed.clone()
    with torch.no_grad():
        again = model(ids, pos)
    assert attn.stacked is None and len(calls) == 2 * model.config.num_layers - 1
    assert rel_err(again, trained) < 1e-5


@pytest.mark.interpreter
def test_adapters_the_group_update_cannot_serve_run_one_by_one(tiny_hf_dir, monkeypatch):
    """Adapters of different scalings in one group: no group update, the members run one at a time
    (their own forwards), and the logits still equal the training forward's; adapters switched off
    take the stack's product as it is."""
    from lora import LoRAConfig, adapters_disabled, apply_lora, lora_modules
    path, _ = tiny_hf_dir("qwen2")
    model = load_model(path, quant="bf16", device="cpu", dtype=torch.float32)
    apply_lora(model, LoRAConfig(r=4, alpha=8))
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.normal_(0, 0.1)
    model.model.layers[0].self_attn.k_proj.scaling = 3.0
    groups = []
    real_group = kl.group_update
    monkeypatch.setattr(kl, "group_update", lambda *a: groups.append(1) or real_group(*a))
    monkeypatch.setattr(kernels, "runs", lambda x: not torch.is_grad_enabled())
    ids, pos = batch()
    with torch.no_grad():
        sampled = model(ids, pos)
        with adapters_disabled(model):
            base = model(ids, pos)
    assert len(groups) == 2 * model.config.num_layers - 1           # layer 0's q/k/v: one by one
    with torch.enable_grad():
        trained = model(ids, pos)
        with adapters_disabled(model):
            base_trained = model(ids, pos)
    assert rel_err(sampled, trained) < 1e-5 and rel_err(base, base_trained) < 1e-5
    assert model.model.layers[0].self_attn.stacked is not None      # the stack stays


def test_the_loader_stacks_each_layers_groups():
    """The loader (model.stack_groups) gives every layer's q/k/v and gate/up a Stack (on the CPU: no
    interleave), each member a view of the stack's rows; stacking again leaves one per group."""
    from model import stack_groups
    cfg = dict(architectures=["Qwen2ForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = build_model(cfg, quant="nvfp4", device="cpu", dtype=torch.float32, seed=0)
    for layer in model.model.layers:
        for attr, names in GROUPS.items():
            parent = getattr(layer, attr)
            assert parent.stacked is not None and parent.stacked.holds([getattr(parent, n) for n in names])
            assert not getattr(parent, names[0]).interleaved
            stack = parent.stacked
            assert stack.linear.out_features == sum(getattr(parent, n).out_features for n in names)
            assert getattr(parent, names[-1]).weight_packed.data_ptr() > stack.linear.weight_packed.data_ptr()
    stack_groups(model)                              # members already stacked: a new stack over the same rows
    attn = model.model.layers[0].self_attn
    assert attn.stacked.holds([attn.q_proj, attn.k_proj, attn.v_proj])


@pytest.mark.gpu
@pytest.mark.parametrize("with_lora", [False, True])
def test_gpu_one_row_gets_silu_mul_from_the_gate_up_gemv(with_lora, monkeypatch):
    """At one row (decode at batch 1) the stacked gate/up GEMV stores silu(gate)·up itself, after
    the adapters' update folded in: the logits equal, bit for bit, the same forward with the
    SiLU·mul kernel after the GEMV (gemm.folds_silu off), and every layer took it."""
    from kernels import gemm
    from lora import LoRAConfig, apply_lora, lora_modules
    from model import ModelConfig
    from nvfp4_cases import LaunchSpy
    cfg = ModelConfig("Qwen2ForCausalLM", vocab_size=4096, hidden_size=1024, intermediate_size=4096,
                      num_layers=3, num_heads=16, num_kv_heads=4)
    model = build_model(cfg, "nvfp4", "cuda", seed=0)
    if with_lora:
        apply_lora(model, LoRAConfig(r=8, alpha=16))
        with torch.no_grad():
            for m in lora_modules(model).values():
                m.lora_B.normal_(0, 0.05)
    launched = []
    monkeypatch.setattr(gemm, "_nvfp4_gemv_kernel", LaunchSpy(gemm._nvfp4_gemv_kernel, launched))
    ids = torch.randint(0, 4096, (1, 1), device="cuda")
    with torch.no_grad():
        got = model(ids)
        assert sum(kw["SILU"] for _, kw in launched) == cfg.num_layers
        monkeypatch.setattr(gemm, "folds_silu", lambda rows: False)
        want = model(ids)
    assert torch.equal(got, want)
