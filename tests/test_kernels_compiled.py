"""kernels.compiled: the training pass's norm, RoPE and SiLU·mul compiled by Inductor.

Where it applies (CPU: only the routing). On the GPU each compiled op, forward and backward, is
measured against float64 math of its formula and must be as close to it as the eager torch op is;
and a whole training forward + backward with the compiled ops gives eager's loss and LoRA gradients.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import checkpoint as C
import kernels
import lora
import model as M
import ops
from kernels import tuning


ALWAYS = dataclasses.replace(tuning.current(), compile_min_numel=0)


def test_compiled_is_the_reference_itself_off_the_cuda_training_path():
    x = torch.randn(4, 8, requires_grad=True)
    with tuning.using(ALWAYS):
        assert kernels.compiled(ops._rms_norm, x) is ops._rms_norm      # CPU
    if torch.cuda.is_available():
        xc = x.detach().cuda()
        assert kernels.compiled(ops._rms_norm, xc) is ops._rms_norm      # 32 elements: below the default size
        with tuning.using(ALWAYS):
            with torch.no_grad():
                assert kernels.compiled(ops._rms_norm, xc) is ops._rms_norm   # no autograd: the sampler's
            assert kernels.compiled(ops._rms_norm, xc) is not ops._rms_norm


def _norm64(x, w, eps, r):
    h = (x.double() + r.double()) if r is not None else x.double()
    return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _rope64(x, cos, sin):
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = cos.double(), sin.double()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _grads(fn, inputs, upstream):
    """fn(*inputs) -> outputs; (outputs, d(Σ upstream·outputs)/d inputs) in float64."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward([o for o in outs], [u.to(o.dtype) for o, u in zip(outs, upstream)])
    return [o.detach().double() for o in outs], [t.grad.double() for t in leaves]


def _err(a, b):
    return ((a - b).norm() / b.norm()).item()


def _as_close_as_eager(compiled_fn, eager_fn, ref_fn, inputs, upstream):
    """The compiled op's outputs and input gradients are within 1.25x (+ a bf16 ulp's worth) of the
    eager op's distance to the float64 reference."""
    ref_out, ref_grad = _grads(ref_fn, [t.double() for t in inputs], upstream)
    c_out, c_grad = _grads(compiled_fn, inputs, upstream)
    e_out, e_grad = _grads(eager_fn, inputs, upstream)
    for c, e, r in list(zip(c_out, e_out, ref_out)) + list(zip(c_grad, e_grad, ref_grad)):
        ec, ee = _err(c, r), _err(e, r)
        print(f"compiled {ec:.2e}  eager {ee:.2e}")
        assert ec <= 1.25 * ee + 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True])
def test_gpu_compiled_rms_norm_forward_and_backward(residual):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 37, 512, device="cuda", generator=g).bfloat16()
    r = torch.randn(3, 37, 512, device="cuda", generator=g).bfloat16() if residual else None
    w = 1 + 0.1 * torch.randn(512, device="cuda", generator=g)                 # fp32, AQN-noised in training
    up = [torch.randn(3, 37, 512, device="cuda", generator=g).double() for _ in range(1 + residual)]
    inputs = [x, r] if residual else [x]
    with torch.enable_grad(), tuning.using(ALWAYS):
        compiled = kernels.compiled(ops._rms_norm, x.requires_grad_(True))
        assert compiled is not ops._rms_norm
        _as_close_as_eager(lambda *a: compiled(a[0], w, 1e-6, *a[1:]), lambda *a: ops._rms_norm(a[0], w, 1e-6, *a[1:]),
                           lambda *a: (_norm64(a[0], w, 1e-6, a[1]), a[0] + a[1]) if residual else _norm64(a[0], w, 1e-6, None),
                           [t.detach() for t in inputs], up)


@pytest.mark.gpu
def test_gpu_compiled_rope_and_silu_mul_forward_and_backward():
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 33, 8, 64, device="cuda", generator=g).bfloat16()
    k = torch.randn(2, 33, 2, 64, device="cuda", generator=g).bfloat16()
    ang = torch.arange(33, device="cuda")[None, :, None, None] * torch.rand(32, device="cuda", generator=g)
    cos, sin = ang.cos().expand(2, 33, 1, 32), ang.sin().expand(2, 33, 1, 32)
    up = [torch.randn_like(q, dtype=torch.float64), torch.randn_like(k, dtype=torch.float64)]
    with torch.enable_grad(), tuning.using(ALWAYS):
        rope = kernels.compiled(ops._rope, q.requires_grad_(True))
        _as_close_as_eager(lambda a, b: rope(a, b, cos, sin), lambda a, b: ops._rope(a, b, cos, sin),
                           lambda a, b: (_rope64(a, cos, sin), _rope64(b, cos, sin)), [q.detach(), k.detach()], up)
        gate = torch.randn(2, 33, 1024, device="cuda", generator=g).bfloat16()
        upv = torch.randn(2, 33, 1024, device="cuda", generator=g).bfloat16()
        silu_mul = kernels.compiled(ops._silu_mul, gate.requires_grad_(True))
        _as_close_as_eager(silu_mul, ops._silu_mul, lambda a, b: F.silu(a) * b, [gate.detach(), upv],
                           [torch.randn_like(gate, dtype=torch.float64)])


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["bf16", "nvfp4"])
def test_gpu_training_pass_with_compiled_ops_matches_eager(quant):
    """A Qwen2-shaped model with LoRA: loss and every LoRA gradient, compiled ops vs eager ops."""
    cfg = M.ModelConfig("Qwen2ForCausalLM", vocab_size=4096, hidden_size=1024, intermediate_size=2816,
                        num_layers=3, num_heads=16, num_kv_heads=4)
    ids = torch.randint(0, 4096, (4, 96), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    runs = {}
    for compiled in (True, False):
        model = C.build_model(cfg, quant, "cuda", seed=0)
        lora.apply_lora(model, lora.LoRAConfig(r=16, alpha=32), torch.Generator().manual_seed(0))
        for name, p in model.named_parameters():               # B = 0 at init: give the adapters a say
            if "lora_B" in name:
                p.data.normal_(0, 0.02, generator=torch.Generator(device="cuda").manual_seed(len(name)))
        with tuning.using(dataclasses.replace(tuning.current(), compile_min_numel=0 if compiled else 2 ** 62)):
            logits = model(ids).float()
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, 4096), ids[:, 1:].reshape(-1))
            loss.backward()
        runs[compiled] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (lc, gc), (le, ge) = runs[True], runs[False]
    assert abs(lc - le) < 1e-3 * abs(le)
    assert gc.keys() == ge.keys() and len(gc) == 3 * 7 * 2
    worst = max(_err(gc[n].double(), ge[n].double()) for n in gc)
    print(f"{quant}: loss {lc:.5f} vs {le:.5f}; worst LoRA grad rel diff {worst:.2e}")
    assert worst < 2e-2


@pytest.mark.gpu
def test_gpu_compiled_logprob_head_matches_eager():
    """logprobs.ChunkLogprobs with ops.logprob_stats / logprob_grad compiled (training=True, inside the
    Function's forward and backward) against the same pass eager: log π, entropy and dh of bf16 rows
    through a 32k-vocabulary head, each as close to float64 as eager's."""
    from logprobs import ChunkLogprobs
    g = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(300, 256, device="cuda", generator=g).bfloat16()
    W = (torch.randn(32768, 256, device="cuda", generator=g) * 0.1).bfloat16()
    t = torch.randint(0, 32768, (300,), device="cuda", generator=g)
    up = torch.randn(300, device="cuda", generator=g).double()
    assert kernels.compiled(ops._logprob_stats, torch.zeros(4, 2 ** 23, device="cuda"), training=True) \
        is not ops._logprob_stats                           # 2^25 elements: past the default threshold

    def head64(hh):
        ls = (hh.double() @ W.double().t() / 0.7).log_softmax(-1)
        return ls.gather(1, t[:, None])[:, 0], -(ls.exp() * ls).sum(-1)

    ref_out, ref_grad = _grads(head64, [h.double()], [up, torch.zeros_like(up)])
    for compiled in (True, False):
        with tuning.using(dataclasses.replace(tuning.current(), compile_min_numel=0 if compiled else 2 ** 62)):
            out, grad = _grads(lambda hh: ChunkLogprobs.apply(hh, W, t, 0.7), [h], [up, torch.zeros_like(up)])
        errs = [_err(a, b) for a, b in zip(out + grad, ref_out + ref_grad)]
        print(f"compiled={compiled}: log π {errs[0]:.2e} entropy {errs[1]:.2e} dh {errs[2]:.2e}")
        assert max(errs) < 2e-2
