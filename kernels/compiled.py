"""The training pass's small ops, forward and backward, fused by torch.compile.

The sampler runs the decoder's small ops (RMSNorm with its residual add, RoPE, SiLU·mul) as the
hand-written kernels of fused_ops.py, which have no backward. The training pass runs them with
autograd on, where each is its torch reference in ops.py: an RMSNorm is ~7 kernels forward and ~10
backward, each one pass over (tokens × channels) in memory. At a GRPO micro-batch of thousands of
tokens those passes cost as much GPU time as the matmuls, and as much host time again in launches.

Inductor (torch.compile) turns one such function into a single Triton kernel for the forward and one
for the backward that AOTAutograd derives from the same formula, so the training pass reads and
writes each activation about once. What is compiled is the trunk's own reference function, passed
in by ops.py: the formula a reader checks there is the one that runs, not a second copy of it.

    compiled(fn, x)   fn compiled, where it pays: x on CUDA with autograd on (the training forward and
                      its recomputation; or training=True: the log-prob head's own forward and
                      backward) and at least tuning's compile_min_numel elements in x; fn
                      itself elsewhere (the CPU, no-grad passes, small micro-batches of small models,
                      where a compiled call's fixed host cost exceeds what it saves)

Each fn compiles once per process and call pattern (rank, dtype, residual or not) with dynamic
shapes (`dynamic=True`): a micro-batch of another (B, T) reuses the kernels instead of compiling
again. Past torch._dynamo's recompile limit (8 patterns per function, only reached by a process that
trains several models, as the tests do) a call runs the function eagerly: same values, slower. The first training step pays the compilation
(tens of seconds, cached on disk by Inductor for the next run). `emulate_precision_casts` makes
Inductor round each bf16 intermediate where eager torch rounds it (the residual sum is cast to bf16
before the norm reads it), so the compiled ops give eager's values, not merely close ones.

Test: tests/test_kernels_compiled.py (the compiled ops and their gradients against the eager
references on the GPU; the CPU and no-grad paths are the references themselves).
"""
import importlib.util

import torch

from .tuning import current

_COMPILED = {}
_INDUCTOR_GPU = importlib.util.find_spec("triton") is not None     # Inductor writes Triton kernels


def compiled(fn, x: torch.Tensor, training: bool | None = None):
    """fn, or fn compiled by Inductor when x is a CUDA tensor on the training path (module docstring).
    training: whether the call is on that path; default: autograd is on (a custom autograd Function,
    whose forward and backward run with it off, says so itself)."""
    training = torch.is_grad_enabled() if training is None else training
    if not (_INDUCTOR_GPU and x.is_cuda and training and x.numel() >= current().compile_min_numel):
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True, options={"emulate_precision_casts": True})
    return _COMPILED[fn]
