"""How a training step spends the GPU: micro-batch sizes, recomputation, and what stays resident.

A GRPO step samples P·G completions, then runs the policy forward and backward over all of them
(train.train_step). That pass is the larger half of a step, and how fast it runs depends on three
choices that trade memory for speed, none of which changes the math:

  * micro-batches: the P·G sequences go through forward + backward a few at a time. Each launch of
    the ~100 kernels of a layer costs the same whatever its size, so one big micro-batch is much
    cheaper than many small ones (a 135M model's micro-batch is mostly launches), and the GPU only
    reaches its matmul rate on thousands of tokens at once.
  * recomputation (gradient checkpointing) keeps each layer's input only and runs the layer again
    in the backward: a third more work, in exchange for ~1/10 of the activation memory.
  * resident state between steps: the sampler's KV cache (its CUDA graphs stay whether it does or
    not: they reach it through a table of where it lies, so a run captures each batch bucket once;
    their memory pool, about one decode step's activations at the largest bucket used, stays beside
    the training pass, in the share of free memory the budget leaves), for the training pass a bf16
    copy of the NVFP4 weights (one dequantization per step instead of one per matmul call and
    micro-batch), and for a bf16 base's sampler a copy of the adapted weights, so that it decodes
    with the adapters merged in (lora.merged_sampling).

Free memory is what this process may still reserve (free_memory): the device's free memory, capped by
a per-process limit where one is set (torch.cuda.set_per_process_memory_fraction, as bench/step.py's
--available-gib emulates an 80 GB card on a larger one); the KV cache and checkpoint.check_fits read it too.

So the plan measures, once at start-up, what a token costs: a forward + backward over one and two
synthetic sequences of PROBE_TOKENS tokens, recomputation off and on, gives the peak memory above
the baseline as a + b·tokens (b: what a token keeps for the backward; a: the lm_head chunk and the
rest that does not grow). vLLM sizes its KV cache the same way, by measurement, not by formula. The
two-sequence pass runs only where twice the one-sequence peak stays within the budget below; else the
one-sequence peak counts as all per-token (an overestimate of b): at 72B on 80 GB the pass without
recomputation keeps ~40 MiB a token, and its probe, not the step, would otherwise set the peak on a
tighter card (bench/memory.py's probe column). Then

    budget   = BUDGET_SHARE · free memory after weights, adapters, optimizer state and dense copies
    recompute only where one sequence of the longest possible length does not fit without it
    tokens   = max(min((budget - a) / b, MICRO_FORWARD_FLOP / (2 · parameters)), longest sequence)
               per micro-batch; a micro-batch takes consecutive sequences while count · longest <= tokens
    dense    = a bf16 copy of each NVFP4 weight during the training pass where those copies take at
               most DENSE_SHARE of the free memory (7B: yes; 32B on 80 GB: no)
    merged   = a copy of each adapted bf16 weight, kept for the run, where the copies take at most
               DENSE_SHARE of the free memory (bf16 7B on 80 GB: yes; 14B: no); the sampler then
               merges the adapters in for each rollout and restores the weights from the copies
    KV cache = kept across steps where it takes at most KEEP_CACHE_SHARE of the token budget

The FLOP cap: past ~10^15 FLOP of forward work (a 32B model's 15k tokens, a 7B model's 66k) a micro-
batch runs its GEMMs at their rate and pays its fixed costs (a layer's ~100 launches, the lm_head
chunks' set-up) a few percent of its time, so more memory buys no more speed. The memory stays free
instead: a 32B model's training pass then peaks below its rollout, where filling the budget took
more than the rollout did. Small models never reach the cap: their micro-batch is all the memory allows.

The user may still pin --micro-batch (completions) and --[no-]grad-checkpointing. Without a GPU
there is no memory to measure: the whole batch is one micro-batch, without recomputation, and a
bf16 (or fp32) base samples merged (its copies in host memory beside the model's). The
losses do not depend on the grouping (grpo, dr_grpo and dapo normalise over the whole batch), except
bnpo, whose token mean is per micro-batch by definition (TRL: per device batch).

Test: tests/test_plan.py (the packing rule, the decisions from given measurements, the probe on CPU).
"""
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

import lora
import ops

PROBE_TOKENS = 256      # tokens of one synthetic probe sequence (two are measured: 1 and 2 sequences)
BUDGET_SHARE = 0.85     # of the free memory the training pass may take (the allocator fragments)
DENSE_SHARE = 0.25      # dense bf16 weight copies are made where they take at most this share of free
KEEP_CACHE_SHARE = 0.1  # the KV cache stays between steps where it is at most this share of the budget
MICRO_FORWARD_FLOP = 1e15  # a micro-batch's forward work past which bigger buys no speed (see above)
GIB = 2 ** 30


@dataclass
class StepPlan:
    micro_batch: int | None       # completions per micro-batch (pinned), or None: by micro_tokens
    micro_tokens: int | None      # padded tokens per micro-batch (count · longest), or None: unbounded
    grad_checkpointing: bool
    dense_weights: bool           # bf16 copies of the NVFP4 weights during the training pass
    merged_sampling: bool         # the sampler decodes with the adapters merged into bf16 weights
    keep_cache_bytes: int         # the sampler's KV cache stays between steps up to this size
    why: str                      # the measurements behind it, for the start-up line and run_config.json

    def as_dict(self) -> dict:
        return asdict(self)


def micro_batches(seq_lens: list[int], plan: StepPlan) -> list[tuple[int, int]]:
    """[(start, end)] over sequences of these lengths, in order: plan.micro_batch at a time, or as
    many as keep count · longest within plan.micro_tokens (always at least one)."""
    if plan.micro_batch:
        return [(s, min(s + plan.micro_batch, len(seq_lens))) for s in range(0, len(seq_lens), plan.micro_batch)]
    out, start, longest = [], 0, 0
    for i, n in enumerate(seq_lens):
        longest = max(longest, n)
        if plan.micro_tokens is not None and i > start and (i - start + 1) * longest > plan.micro_tokens:
            out.append((start, i))
            start, longest = i, n
    return out + [(start, len(seq_lens))] if seq_lens else out


def nvfp4_layers(model) -> list:
    """The model's NVFP4 linears (the modules holding weight_packed)."""
    return [m for m in model.modules() if hasattr(m, "weight_packed")]


def nvfp4_weights(model) -> int:
    """Elements of the NVFP4 weights, out x in each (buffers, not parameters)."""
    return sum(m.out_features * m.in_features for m in nvfp4_layers(model))


@contextmanager
def dense_weights(model, on: bool):
    """While inside, every NVFP4 linear of model multiplies by a bf16 copy of its dequantized weight
    (ops.dense_weight; the same bf16 numbers the kernels' large-M route computes per call)."""
    layers = nvfp4_layers(model) if on else []
    try:
        for m in layers:
            m.dense = ops.dense_weight(m, model.dtype)                        # (N, K) in the activation dtype
        yield
    finally:
        for m in layers:
            m.dense = None


def copies_fit(nbytes: int, free: float) -> bool:
    """Whether copies of nbytes stay resident: there are some, and they take at most DENSE_SHARE of
    free memory (the rule for the dense weights and for the merged sampler's kept bases alike)."""
    return 0 < nbytes <= DENSE_SHARE * free


def free_memory(device) -> int:
    """Bytes this process may still reserve on a CUDA device: the device's free memory, or less where a
    per-process limit is set (torch.cuda.set_per_process_memory_fraction: an 80 GB card emulated on a
    larger one, bench/step.py's --available-gib), less what PyTorch's allocator holds already. What the
    allocator holds but has not handed out (cached) is not counted: callers that can reuse it add it."""
    device = torch.device(device)
    index = torch.cuda.current_device() if device.index is None else device.index   # "cuda": the current one
    free, total = torch.cuda.mem_get_info(index)
    limit = torch.cuda.get_per_process_memory_fraction(index) * total - torch.cuda.memory_reserved(index)
    return int(max(0, min(free, limit)))


def second_probe_fits(first_peak: float, limit: float) -> bool:
    """Whether the probe's two-sequence pass may run: its peak, a + 2·b·PROBE_TOKENS, is at most twice
    the one-sequence pass's a + b·PROBE_TOKENS, so that pass's peak, doubled, must stay within limit."""
    return 2 * first_peak <= limit


def _probe(fwd_bwd, model, vocab: int, ckpt: bool, device, limit: float) -> tuple[float, float]:
    """Peak bytes above the baseline of fwd_bwd over 1 and 2 synthetic sequences of PROBE_TOKENS:
    -> (a, b) of peak = a + b·tokens. The gradients it leaves are dropped. Where the two-sequence pass
    could pass `limit` (second_probe_fits; a 72B model's pass without recomputation keeps ~40 MiB a
    token) it is not run, and the one-sequence peak counts as all per-token: (0, peak / PROBE_TOKENS),
    an overestimate of b, which errs toward recomputation and smaller micro-batches."""
    model.gradient_checkpointing = ckpt
    gen = torch.Generator(device).manual_seed(0)
    peaks = []
    for rows in (1, 2):
        if rows == 2 and not second_probe_fits(peaks[0], limit):
            break
        ids = torch.randint(0, vocab, (rows, PROBE_TOKENS), device=device, generator=gen)
        prompt = torch.full((rows,), PROBE_TOKENS // 4, device=device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fwd_bwd(ids, prompt, PROBE_TOKENS - prompt)
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device) - base)
    for p in model.parameters():
        p.grad = None
    if len(peaks) == 1:
        return 0.0, peaks[0] / PROBE_TOKENS
    b = max(peaks[1] - peaks[0], 1) / PROBE_TOKENS
    return max(peaks[0] - b * PROBE_TOKENS, 0.0), b


def recompute_bytes(b_ckpt: float, b_full: float, layers: int, hidden: int, itemsize: int) -> float:
    """What a token keeps with recomputation (bytes): the probe's b_ckpt, unless that is below every
    layer's input, which recomputation must keep. The probe's 1- and 2-sequence peaks can miss it:
    at a 32B model's few hundred probe tokens the peak is a token-independent transient (a layer's
    dequantized weight, ~0.3-0.6 GB) in both, so their difference says a token costs almost
    nothing, and the plan would put the whole batch in one micro-batch. For such a failed
    measurement the estimate is the layer inputs plus one layer's share of b_full while that layer
    runs again in the backward (an overestimate: not all of a layer's activations are live at once)."""
    inputs = layers * hidden * itemsize
    return b_ckpt if b_ckpt >= inputs else inputs + b_full / layers


def parameters(model) -> int:
    """The model's parameters, each NVFP4 weight counted as its out x in."""
    return nvfp4_weights(model) + sum(p.numel() for p in model.parameters())


def decide(free: float, a_full: float, b_full: float, a_ckpt: float, b_ckpt: float, max_seq_len: int,
           params: float, micro_batch: int | None, grad_checkpointing: bool | None, dense: bool,
           merged: bool = False, why: str = "") -> StepPlan:
    """The plan from measurements (bytes): free memory for the training pass, and peak = a + b·tokens
    without (full) and with (ckpt) recomputation; params: the model's parameters (the FLOP cap). The
    rules of the module docstring."""
    budget = BUDGET_SHARE * free
    fits_full = int((budget - a_full) // b_full)
    ckpt = fits_full < max_seq_len if grad_checkpointing is None else grad_checkpointing
    a, b = (a_ckpt, b_ckpt) if ckpt else (a_full, b_full)
    cap = int(MICRO_FORWARD_FLOP // (2 * params))
    tokens = max(min(int((budget - a) // b), cap), max_seq_len)
    if tokens == cap and not micro_batch:
        why += f"; capped at {MICRO_FORWARD_FLOP:.0e} FLOP of forward work: {cap} tokens"
    return StepPlan(micro_batch, None if micro_batch else tokens, ckpt, dense, merged,
                    max(0, int(KEEP_CACHE_SHARE * (budget - a))), why)


def make_plan(model, fwd_bwd, max_seq_len: int, micro_batch: int | None, grad_checkpointing: bool | None,
              trainable: int, device) -> StepPlan:
    """The plan for this model on this device (sets model.gradient_checkpointing, and keeps the
    adapted weights' copies where it merges: lora.keep_bases). fwd_bwd(ids, prompt_lens, comp_lens)
    runs the training forward and backward (train.py's); trainable: adapter parameters (fp32, with a
    gradient and AdamW's two states each)."""
    device = torch.device(device)
    merge_bytes = sum(m.base_layer.weight.nbytes for m in lora.mergeable(model))   # the copies' bytes
    if device.type != "cuda":
        model.gradient_checkpointing = bool(grad_checkpointing)
        lora.keep_bases(model, merge_bytes > 0)
        return StepPlan(micro_batch, None, model.gradient_checkpointing, False, merge_bytes > 0, 0,
                        "no GPU: one micro-batch, recomputation off unless asked for")
    free = free_memory(device) - 3 * 4 * trainable
    dense_bytes = 2 * nvfp4_weights(model)                                 # their bf16 copies
    dense, merged = copies_fit(dense_bytes, free), copies_fit(merge_bytes, free)
    lora.keep_bases(model, merged)                                         # held for the run: free less it
    with dense_weights(model, dense):
        free = free_memory(device) - 3 * 4 * trainable
        limit = BUDGET_SHARE * free
        a_full, b_full = _probe(fwd_bwd, model, model.config.vocab_size, False, device, limit)
        a_ckpt, b_ckpt = _probe(fwd_bwd, model, model.config.vocab_size, True, device, limit)
    b_ckpt = recompute_bytes(b_ckpt, b_full, model.config.num_layers, model.config.hidden_size, model.dtype.itemsize)
    why = (f"{free / GIB:.1f} GiB free for the training pass; a token keeps {b_full / 2**20:.2f} MiB "
           f"({b_ckpt / 2**20:.2f} with recomputation)")
    p = decide(free, a_full, b_full, a_ckpt, b_ckpt, max_seq_len, parameters(model), micro_batch,
               grad_checkpointing, dense, merged, why)
    model.gradient_checkpointing = p.grad_checkpointing
    return p


def describe(plan: StepPlan) -> str:
    """The start-up line."""
    size = f"{plan.micro_batch} completions" if plan.micro_batch else (
        f"up to {plan.micro_tokens} tokens" if plan.micro_tokens else "the whole batch")
    return (f"step plan: micro-batches of {size}, recomputation {'on' if plan.grad_checkpointing else 'off'}, "
            f"dense bf16 weights for training {'on' if plan.dense_weights else 'off'}, "
            f"adapters merged for sampling {'on' if plan.merged_sampling else 'off'}, KV cache kept between steps "
            f"up to {plan.keep_cache_bytes / GIB:.1f} GiB ({plan.why})")
