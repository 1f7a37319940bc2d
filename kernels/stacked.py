"""q/k/v and gate/up as one matmul when sampling, with each linear still its own module.

Why. At decode the 7B k and v projections are 512 x 3584: one launch each for about a microsecond of
weight traffic, and q/k/v (gate/up) read the same x. Multiplying a group once saves two launches per
layer for attention and one for the MLP, and lets the matmul kernel see one wider N.

Memory layout. `StackedLinear` lays a group's weights back to back in one allocation and makes each
member's tensor a row slice of it (N_i = the member's out_features, K its in_features):

    stacked weight         (Σ N_i, K)       bf16;  or, NVFP4:
    stacked weight_packed  (Σ N_i, K/2)     uint8
    stacked weight_scale   (Σ N_i, K/16)    float8_e4m3fn
    stacked bias           (Σ N_i,)         when the members have one
    member i's tensor    = rows [N_0 + ... + N_{i-1}, + N_i) of each: a view, no copy

So the state dict, the checkpoint keys, LoRA and the training forward see the members unchanged, one
linear at a time. On the rollout path `project` computes y = x·Wᵀ (..., Σ N_i) with one matmul and
then the members' LoRA updates on their column blocks as one group update (lora.group_update: two
kernels, or one fold, for the whole group). For the MLP, `project(..., silu_mul=True)` goes one step
further at a decode row of batch 1: the gate/up GEMV stores silu(gate)·up itself (gemm.folds_silu),
after the group's update folded into it too, so neither the (1, 2I) product nor the SiLU·mul launch
exists. Where one update cannot serve the group (adapters of different scalings, dropout active)
the members run one by one.

NVFP4 members must share one global scale (the kernel applies one per matmul): the trunk's loader
gives a group one (the smallest of the members' scales), as llm-compressor does for checkpoints
meant to be served fused. A group that cannot share (mixed kinds, biases, scales) gets no stack and
runs one linear at a time.

A member whose tensor no longer lives in the stack (.to(), a reload that rebinds a parameter) ends
the stack: `holds` compares data pointers, and project then drops it and falls back for good.

`prepare(model, groups)` is what the trunk's loader calls once a model is built: NVFP4 layers on
CUDA move into the kernels' interleaved layout (nvfp4.NVFP4Linear.interleave_), then each layer's
groups are stacked (groups: {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": (...)}, the
trunk's checkpoint.GROUPS). Stacking needs no Triton; project runs only where kernels.runs(x).

Tests: tests/test_kernels_stacked.py (one allocation, one matmul per group, logits equal to the
training forward's with and without LoRA, the fallback; on the GPU, the GEMV's SiLU·mul against
the kernel after it, bit for bit).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import nvfp4

try:
    from . import fused_ops, gemm
    from . import lora as lora_update
except ImportError:     # no triton: prepare still stacks; project is never called (kernels.runs is False)
    fused_ops = gemm = lora_update = None

# ----------------------------------------------------------------------------------------------
# the stack


class StackedLinear:
    """The linears `mods` (same input, same kind) over one stacked copy of their weights."""

    TENSORS = ("weight", "weight_packed", "weight_scale", "bias")

    @staticmethod
    def can_stack(mods) -> bool:
        first = mods[0]
        if type(first) not in (nn.Linear, nvfp4.NVFP4Linear) or not all(
                type(m) is type(first) and m.in_features == first.in_features
                and (m.bias is None) == (first.bias is None) for m in mods):
            return False
        return not isinstance(first, nvfp4.NVFP4Linear) or all(
            torch.equal(m.weight_global_scale, first.weight_global_scale) and m.interleaved == first.interleaved
            for m in mods)

    def __init__(self, mods):
        self.sizes = [m.out_features for m in mods]
        self.global_scale = getattr(mods[0], "weight_global_scale", None)   # None: bf16
        self.interleaved = getattr(mods[0], "interleaved", False)          # rows stack in either layout
        self.lora_casts = None                                             # lora.group_casts keeps them here
        self.tensors = {}
        for name in self.TENSORS:
            if getattr(mods[0], name, None) is None:
                continue
            stacked = torch.cat([getattr(m, name).detach() for m in mods])              # (sum N, ...)
            self.tensors[name] = stacked
            for m, rows in zip(mods, stacked.split(self.sizes)):
                if name in m._parameters:
                    m._parameters[name] = nn.Parameter(rows, requires_grad=False)
                else:
                    m._buffers[name] = rows
        self.ptrs = self._ptrs(mods)

    def _ptrs(self, mods):
        return [getattr(m, name).data_ptr() for m in mods for name in self.tensors]

    def holds(self, mods) -> bool:
        """Are the members' tensors still slices of the stack? (.to() or a reload ends that.)"""
        return self._ptrs(mods) == self.ptrs

    def __call__(self, x, lora=None, silu_mul=False):
        """x (..., K) -> (..., Σ N): the members' outputs side by side (with a LoRA update folded in:
        NVFP4 stacks only); silu_mul (gate/up, where folds_silu): silu(gate)·up (..., N/2)."""
        t = self.tensors
        if self.global_scale is None:
            if lora is not None or silu_mul:
                raise ValueError("StackedLinear: a folded LoRA update or SiLU·mul needs an NVFP4 stack")
            return F.linear(x, t["weight"], t.get("bias"))
        if lora is None and not silu_mul:
            return nvfp4.linear(x, t["weight_packed"], t["weight_scale"], self.global_scale, t.get("bias"),
                                interleaved=self.interleaved)
        return gemm.linear(x, t["weight_packed"], t["weight_scale"], self.global_scale, t.get("bias"),
                           self.interleaved, lora, silu_mul)

    def folds_silu(self, x) -> bool:
        """Can this stack (gate/up) apply SiLU·mul in its matmul's epilogue at x's rows?"""
        rows = x.numel() // x.shape[-1]
        return (self.global_scale is not None and len(self.sizes) == 2 and self.sizes[0] == self.sizes[1]
                and x.is_cuda and x.dtype == torch.bfloat16 and gemm.folds_silu(rows))


# ----------------------------------------------------------------------------------------------
# using it: the layers' projections, and stacking a loaded model


def project(parent: nn.Module, names, x, silu_mul=False):
    """[parent.<name>(x) for each name], or with silu_mul (gate/up) silu(gate(x))·up(x), on the
    rollout path: one matmul over the stacked weights, then the group's LoRA update (the members
    are the trunk's adapters, or plain linears, or adapters switched off), then fused_ops.silu_mul.
    Where the stack's matmul finishes its rows itself (StackedLinear.folds_silu: the GEMV) and the
    update is folded into it too, or there is none, its epilogue applies SiLU·mul instead."""
    mods = [getattr(parent, n) for n in names]
    stack = getattr(parent, "stacked", None)
    outs = None
    if stack is not None:
        if stack.holds([getattr(m, "base_layer", m) for m in mods]):     # through a LoRA wrapper
            outs = _stacked(stack, mods, x, silu_mul)
        else:
            parent.stacked = None               # the members moved: use them one by one, free the stack
    if outs is None:
        outs = [m(x) for m in mods]
    elif not isinstance(outs, list):            # silu(gate)·up from the GEMV's epilogue
        return outs
    return fused_ops.silu_mul(*outs) if silu_mul else outs


def _stacked(stack, mods, x, silu_mul):
    """The stack's product with the group's update: a list of the members' outputs, the SiLU·mul
    result itself where the GEMV applied it, or None where the members must run one by one. Over
    adapters the epilogue's SiLU·mul waits for the update to fold in first; adapters switched off
    (adapters_disabled) add nothing."""
    wrapped = lora_update.is_adapter(mods[0])
    grouped = wrapped and lora_update.group_applies(mods)
    if not grouped and any(lora_update.is_adapter(m) and m.enabled for m in mods):
        return None
    fold_silu = silu_mul and stack.folds_silu(x)
    silu_done = []

    def base(lora=None):        # the stack's matmul, given the update to fold in, or not
        silu_done.append(fold_silu and (not wrapped or lora is not None))
        return stack(x, lora, silu_mul=silu_done[-1])            # (..., Σ N), or (..., N/2)

    y = lora_update.group_update(stack, mods, x, base) if grouped else base()
    if silu_done[-1]:
        return y
    return list(y.split(stack.sizes, -1))


def stack_groups(model: nn.Module, groups: dict) -> None:
    """Give every layer's groups (model.model.layers[i].<attr>.<names>) a StackedLinear where they can
    share one, else None."""
    for layer in model.model.layers:
        for attr, names in groups.items():
            parent = getattr(layer, attr)
            mods = [getattr(parent, n) for n in names]
            parent.stacked = StackedLinear(mods) if StackedLinear.can_stack(mods) else None


def prepare(model: nn.Module, groups: dict) -> nn.Module:
    """After loading: NVFP4 layers on CUDA into the kernels' layout, then the groups stacked."""
    for m in model.modules():
        if isinstance(m, nvfp4.NVFP4Linear) and m.weight_packed.is_cuda:
            m.interleave_()                      # the kernels' layout, before stacking
    stack_groups(model, groups)
    return model
