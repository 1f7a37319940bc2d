"""q/k/v and gate/up as one matmul when sampling, with each linear still its own module.

Why. At decode the 7B k and v projections are 512 x 3584: one launch each for about a microsecond of
weight traffic, and q/k/v (gate/up) read the same x. Multiplying a group once saves two launches per
layer for attention and one for the MLP, and lets the matmul kernel see one wider N.

What arrives. The trunk lays a group's weights back to back in one allocation after loading
(model.Stack): a stack has `linear`, one linear of Σ N_i rows whose tensors are the members' stacked
(an nn.Linear's weight (Σ N_i, K), or an NVFP4 layer's weight_packed (Σ N_i, K/2), weight_scale
(Σ N_i, K/16), one weight_global_scale, interleaved), `sizes` (each member's N_i, in order) and
`lora_casts`, a slot where this wing keeps the group's adapter casts between calls. Member i's
tensors are rows [N_0 + ... + N_{i-1}, + N_i) of the stack's: views, no copy. Everything is read by
duck typing: the wing imports nothing of the trunk.

What `project` does. y = x·Wᵀ (..., Σ N_i) with one matmul (`stack.linear(x)`, the trunk's own
product, whose NVFP4 matmul comes back here through the trunk's seam), then the members' LoRA
updates on their column blocks as one group update (lora.group_update: two kernels, or one fold,
for the whole group). For the MLP, `silu_mul=True` goes one step further at a decode row of batch 1:
the gate/up GEMV stores silu(gate)·up itself (gemm.folds_silu), after the group's update folded
into it too, so neither the (1, 2I) product nor the SiLU·mul launch exists; at 2 or more rows, where
the matmul stores y and the update's expand runs as a launch after it, that launch applies SiLU·mul
too (lora.expand_silu_mul: gate and up are not written back). Where one update cannot
serve the group (adapters of different scalings, dropout active) `project` returns None and the
caller runs the members one by one.

Tests: tests/test_kernels_stacked.py (one allocation, one matmul per group, logits equal to the
training forward's with and without LoRA, the fallback; on the GPU, the GEMV's SiLU·mul against
the kernel after it, bit for bit).
"""
import torch

from . import fused_ops, gemm
from . import lora as lora_update

# ----------------------------------------------------------------------------------------------
# the stack's product


def _nvfp4(stack) -> bool:
    return hasattr(stack.linear, "weight_packed")


def matmul(stack, x, lora=None, silu_mul=False):
    """x (..., K) -> (..., Σ N): the members' outputs side by side, with a LoRA update folded in
    (NVFP4 stacks only); silu_mul (gate/up, where folds_silu): silu(gate)·up (..., N/2)."""
    if lora is None and not silu_mul:
        return stack.linear(x)
    if not _nvfp4(stack):
        raise ValueError("stacked.matmul: a folded LoRA update or SiLU·mul needs an NVFP4 stack")
    w = stack.linear
    return gemm.linear(x, w.weight_packed, w.weight_scale, w.weight_global_scale, w.bias, w.interleaved,
                       lora, silu_mul)


def folds_silu(stack, x) -> bool:
    """Can this stack (gate/up) apply SiLU·mul in its matmul's epilogue at x's rows?"""
    rows = x.numel() // x.shape[-1]
    return (_nvfp4(stack) and len(stack.sizes) == 2 and stack.sizes[0] == stack.sizes[1]
            and x.is_cuda and x.dtype == torch.bfloat16 and gemm.folds_silu(rows))


# ----------------------------------------------------------------------------------------------
# the group's projection


def project(stack, mods, x, silu_mul=False, refresh=True):
    """[m(x) for m in mods], or with silu_mul (gate/up) silu(gate(x))·up(x), on the rollout path: one
    matmul over the stack, then the group's LoRA update (the members are the trunk's adapters, or
    plain linears, or adapters switched off), then fused_ops.silu_mul. Where the stack's matmul
    finishes its rows itself (folds_silu: the GEMV) and the update is folded into it too, or there is
    none, its epilogue applies SiLU·mul instead; where the update's expand is a launch of its own,
    that launch does (lora.expand_silu_mul). refresh: whether the adapters' kept casts are
    refreshed (lora.group_casts). -> the outputs, or None where one update cannot serve the group."""
    wrapped = lora_update.is_adapter(mods[0])
    grouped = wrapped and lora_update.group_applies(mods)
    if not grouped and any(lora_update.is_adapter(m) and m.enabled for m in mods):
        return None
    x = x.contiguous()              # a folding matmul reads x before its wait on the shrink: no copy between
    fold_silu = silu_mul and folds_silu(stack, x)
    silu_done = []

    def base(lora=None):        # the stack's matmul, given the update to fold in, or not
        silu_done.append(fold_silu and (not wrapped or lora is not None))
        return matmul(stack, x, lora, silu_mul=silu_done[-1])             # (..., Σ N), or (..., N/2)

    def expand(hp, B, y2, scale, shrink=None, cuts=None):   # the update's expand launch: SiLU·mul in it too
        silu_done.append(True)
        return lora_update.expand_silu_mul(hp, B, y2, scale, shrink, cuts)

    y = (lora_update.group_update(stack, mods, x, base, refresh, expand if silu_mul else None)
         if grouped else base())
    if silu_done[-1]:
        return y
    outs = list(y.split(stack.sizes, -1))
    return fused_ops.silu_mul(*outs) if silu_mul else outs
