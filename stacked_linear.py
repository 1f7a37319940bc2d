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
linear at a time. On the rollout path (fused_ops.fused(x)) `project` computes y = x·Wᵀ (..., Σ N_i)
with one matmul and then each member's LoRA update on its column block (lora.LoRALinear.
add_group_delta: two kernels for the whole group). For the MLP, `project(..., silu_mul=True)` goes
one step further at a decode row of batch 1: the gate/up GEMV stores silu(gate)·up itself
(marlin_kernel.folds_silu), so neither the (1, 2I) product nor the SiLU·mul launch exists.

NVFP4 members must share one global scale (the kernel applies one per matmul): model.py's loader
gives a group one (quantize_group, the smallest of the members' scales), as llm-compressor does for
checkpoints meant to be served fused. A group that cannot share (mixed kinds, biases, scales) gets no
stack and runs one linear at a time.

A member whose tensor no longer lives in the stack (.to(), a reload that rebinds a parameter) ends
the stack: `holds` compares data pointers, and project then drops it and falls back for good.

Tests: tests/test_stacked_linear.py (one allocation, one matmul per group, logits equal to the
training forward's with and without LoRA, the fallback; on the GPU, the GEMV's SiLU·mul against
the kernel after it, bit for bit); tests/test_model.py's GPU test runs it with the NVFP4 kernel.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import nvfp4
from fused_ops import fused, silu_mul_triton

GROUPS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def group_of(linear_name: str) -> list[str]:
    """The linears quantized with one shared global scale: q/k/v and gate/up (GROUPS), else itself."""
    parent, _, name = linear_name.rpartition(".")
    names = GROUPS.get(parent.rpartition(".")[2], ())
    return [f"{parent}.{n}" for n in names] if name in names else [linear_name]


# ----------------------------------------------------------------------------------------------
# The stack


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
        """x (..., K) -> (..., Σ N): the members' outputs side by side (with a LoRA update folded
        in: NVFP4 stacks only, nvfp4.linear); silu_mul (gate/up, where folds_silu): silu(gate)·up."""
        t = self.tensors
        if self.global_scale is None:
            if lora is not None or silu_mul:
                raise ValueError("StackedLinear: a folded LoRA update or SiLU·mul needs an NVFP4 stack")
            return F.linear(x, t["weight"], t.get("bias"))
        return nvfp4.linear(x, t["weight_packed"], t["weight_scale"], self.global_scale, t.get("bias"), lora,
                            self.interleaved, silu_mul)

    def folds_silu(self, x) -> bool:
        """Can this stack (gate/up) apply SiLU·mul in its matmul's epilogue at x's rows?"""
        return self.global_scale is not None and len(self.sizes) == 2 and self.sizes[0] == self.sizes[1] \
            and nvfp4.folds_silu(x)


# ----------------------------------------------------------------------------------------------
# Using it: the layers' projections, and stacking a loaded model


def project(parent: nn.Module, names, x, silu_mul=False):
    """[parent.<name>(x) for each name], or with silu_mul (gate/up) silu(gate(x))·up(x): on the
    rollout path one matmul over the stacked weights, then the members' LoRA updates
    (lora.LoRALinear.add_group_delta: two kernels for the group), then fused_ops.silu_mul_triton.
    Where the stack's matmul finishes its rows itself (StackedLinear.folds_silu: the GEMV) and
    every update is folded into it too, or there is none, its epilogue applies SiLU·mul instead."""
    mods = [getattr(parent, n) for n in names]
    stack = parent.stacked
    if stack is not None and fused(x):
        if stack.holds([getattr(m, "base_layer", m) for m in mods]):     # through a LoRA wrapper
            group = getattr(type(mods[0]), "add_group_delta", None)
            fold_silu = silu_mul and stack.folds_silu(x)
            silu_done = []

            def base(lora=None):        # the stack's matmul, given the update to fold in, or not
                silu_done.append(fold_silu and (group is None or lora is not None))
                return stack(x, lora, silu_mul=silu_done[-1])            # (..., Σ N), or (..., N/2)
            with_lora = group(mods, x, base) if group is not None else None
            y = base() if with_lora is None else with_lora
            if silu_done[-1]:
                return y
            outs = y.split(stack.sizes, -1)
            if with_lora is None:
                outs = [m.add_delta(x, o) if hasattr(m, "add_delta") else o for m, o in zip(mods, outs)]
            return silu_mul_triton(*outs) if silu_mul else outs
        parent.stacked = None                   # the members moved: use them one by one, free the stack
    outs = [m(x) for m in mods]
    return silu_mul_triton(*outs) if silu_mul else outs


def stack_groups(model: nn.Module) -> None:
    """Give every layer's q/k/v and gate/up a StackedLinear where they can share one (model: a
    model.Transformer; its layers' self_attn and mlp hold the groups)."""
    for layer in model.model.layers:
        for attr, names in GROUPS.items():
            parent = getattr(layer, attr)
            mods = [getattr(parent, n) for n in names]
            parent.stacked = StackedLinear(mods) if StackedLinear.can_stack(mods) else None
