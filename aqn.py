"""Adaptive Quantization Noise (AQN): exploration noise injected through the RMSNorm weights.

QeRL's observation: the NVFP4 rounding error of the frozen weights acts like a small parameter
perturbation that raises the policy's entropy early in RL and helps exploration. That noise is
fixed (it is the quantizer's), so AQN adds a controlled, decaying, random part on top of it.

Where the noise goes. A decoder layer computes, for each of its two norms,

    h = RMSNorm(x) ⊙ w        (w: the norm weight, one value per channel, shape (C,))
    y = h Wᵀ                  (W: the next linears, q/k/v after input_layernorm,
                                gate/up after post_attention_layernorm; shape (N, C))

Replacing w by w + z gives h' = RMSNorm(x) ⊙ (w + z) = h ⊙ (1 + z/w), hence

    y' = (h ⊙ (1 + z/w)) Wᵀ = h (W · diag(1 + z/w))ᵀ

the same as multiplying input column j of every following linear by (1 + z_j/w_j): a
multiplicative weight noise on the 4-bit weights at zero kernel cost (the quantized weights and
the kernel never change; C numbers per norm do). tests/test_aqn.py checks this identity in
float64 on a real transformers model.

Schedule. Training is cut into K stages, k = floor(step / (total_steps / K)). Stage 0 has no
added noise (quantization noise alone); stage k ≥ 1 uses z ~ N(0, σ_k²) per channel with

    σ_k = σ_start · (σ_end / σ_start) ^ ((k - 1) / (K - 2))

a geometric decay from σ_start (stage 1) to σ_end (stage K-1). Defaults σ_start = 1e-2,
σ_end = 5e-4, K = 10. One independent z per input_layernorm and post_attention_layernorm of every
decoder layer (not the final norm, which feeds lm_head), drawn once per optimizer step: the
rollout of the step samples under it and, by default, the training forward of the step uses the
same z, so the gradient is taken through the policy that produced the data (`rollout_only=True`
gives the reference code's behaviour: noise in the rollout only; train.py reads the flag).

Precision. The norm weights must be fp32 (model.py keeps them so). bf16 carries 8 significant
bits: its spacing is 2^-8 on [0.5, 1) and 2^-7 on [1, 2), so adding z to a bf16 weight near 1
rounds away every |z| below 2^-9 ≈ 0.00195 (or 2^-8 ≈ 0.0039 above 1). At σ_end = 5e-4 that
is 3.9σ (7.8σ): ~99.99% of the draws vanish, and at σ_start = 1e-2 about 15-30% do while the
rest snap to multiples of the spacing (tests/test_aqn.py measures 99.995% and 23% for weights
1 ± 0.1; `python aqn.py` prints the whole schedule). noise_applied warns on 16-bit norm weights.

Mechanics. `noise_applied` adds z to the weights in place (same storage, so CUDA graphs that
captured the weight pointers see the noise) under no_grad, and copies the saved weights back on
exit, bit-exactly, exception or not. Run the forward *and* the backward of a noisy training step
inside the context: the in-place update bumps the weights' version counters, so a backward
after the restore fails loudly instead of silently using the clean weights.
"""
import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn

# ---------------------------------------------------------------------------------------------
# constants

NOISY_NORMS = ("input_layernorm", "post_attention_layernorm")  # the per-layer norms; never model.norm

# ---------------------------------------------------------------------------------------------
# config


@dataclass
class AQNConfig:
    """The noise schedule. Each field is a train.py flag (flags.py builds the command line from the
    fields; "flag" names it where it differs from the field)."""
    enabled: bool = field(default=True, metadata={"flag": "aqn", "help": "noise on the RMSNorm weights"})
    sigma_start: float = field(default=1e-2, metadata={"help": "σ of the first noisy stage"})   # stage 1
    sigma_end: float = field(default=5e-4, metadata={"help": "σ of the last stage"})            # stage K-1
    stages: int = field(default=10, metadata={       # K: stage 0 is noise-free, 1..K-1 decay geometrically
        "flag": "aqn_stages", "help": "stages K over --aqn-steps (stage 0 is noise-free)"})
    rollout_only: bool = field(default=False, metadata={   # the reference code's choice
        "flag": "aqn_rollout_only", "help": "noise in rollout only (the reference code)"})

    def __post_init__(self):
        for name in ("sigma_start", "sigma_end"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"AQNConfig.{name} must be a positive finite number, got {v!r}")
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"AQNConfig.stages must be an int >= 2, got {self.stages!r}")
        for name in ("enabled", "rollout_only"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"AQNConfig.{name} must be a bool, got {getattr(self, name)!r}")


# ---------------------------------------------------------------------------------------------
# schedule


def sigma_at(step: int, total_steps: int, cfg: AQNConfig) -> float:
    """σ for optimizer step `step` (0-based) of `total_steps`; 0.0 in stage 0, and at every step where
    AQN is off (cfg.enabled False: the quantization noise alone)."""
    if total_steps < 1:
        raise ValueError(f"sigma_at: total_steps must be >= 1, got {total_steps}")
    if step < 0:
        raise ValueError(f"sigma_at: step must be >= 0, got {step}")
    if not cfg.enabled:
        return 0.0
    K = cfg.stages
    # floor(step / (total_steps / K)) in exact integer arithmetic (no float rounding at stage edges),
    # clamped so that step == total_steps (and beyond) stays in the last stage.
    k = min(step * K // total_steps, K - 1)
    if k == 0:
        return 0.0
    t = (k - 1) / (K - 2) if K > 2 else 0.0  # K == 2: a single noisy stage at σ_start
    return cfg.sigma_start * (cfg.sigma_end / cfg.sigma_start) ** t


# ---------------------------------------------------------------------------------------------
# noise


def noisy_norms(model: nn.Module) -> dict[str, nn.Module]:
    """{path: module} for every input_layernorm / post_attention_layernorm, in model order."""
    return {name: m for name, m in model.named_modules() if name.rpartition(".")[2] in NOISY_NORMS}


def sample_noise(model: nn.Module, sigma: float, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Draw z ~ N(0, σ²) of shape (C,), fp32, for each per-layer norm; {} when σ == 0.

    Draws happen on the generator's device, in model order, so a seeded generator gives the same
    noise on every run; z is then moved to the weight's device."""
    if not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"sample_noise: sigma must be a finite number >= 0, got {sigma}")
    norms = noisy_norms(model)
    if not norms:
        raise ValueError(f"sample_noise: {type(model).__name__} has no module named "
                         f"{' or '.join(NOISY_NORMS)}")
    if sigma == 0:
        return {}
    noise = {}
    for name, m in norms.items():
        w = m.weight
        gen_device = generator.device if generator is not None else w.device
        z = torch.randn(w.shape, generator=generator, dtype=torch.float32, device=gen_device)  # (C,)
        noise[name] = (z * sigma).to(w.device)
    return noise


@contextmanager
def noise_applied(model: nn.Module, noise: dict[str, torch.Tensor]):
    """Add each z to its norm's weight for the duration of the block; restore bit-exactly on exit."""
    targets = []
    for name, z in noise.items():
        try:
            w = model.get_submodule(name).weight
        except AttributeError:
            raise ValueError(f"noise_applied: the model has no norm weight at {name!r}") from None
        if z.shape != w.shape:
            raise ValueError(f"noise_applied: noise for {name} has shape {tuple(z.shape)}, "
                             f"the weight {tuple(w.shape)}")
        if w.dtype in (torch.bfloat16, torch.float16):
            warnings.warn(f"noise_applied: {name}.weight is {w.dtype}; most noise below ~2e-3 rounds away "
                          "(keep norm weights in float32, as model.py does)", stacklevel=3)
        targets.append((w, z))
    saved = [w.detach().clone() for w, _ in targets]
    try:
        with torch.no_grad():
            for w, z in targets:
                acc = torch.promote_types(w.dtype, torch.float32)  # add in >= fp32, round once to w.dtype
                w.copy_(w.to(acc) + z.to(device=w.device, dtype=acc))
        yield model
    finally:
        with torch.no_grad():
            for (w, _), s in zip(targets, saved):
                w.copy_(s)


# ---------------------------------------------------------------------------------------------

if __name__ == "__main__":
    # The default schedule over 100 optimizer steps, and how much of it bf16 norm weights would keep.
    cfg = AQNConfig()
    g = torch.Generator().manual_seed(0)
    w = 1 + 0.1 * torch.randn(100_000, generator=g)  # norm weights near 1
    print(f"{'stage':>5} {'steps':>9} {'sigma':>10} {'noise lost in bf16':>19}")
    for k in range(cfg.stages):
        s = sigma_at(10 * k, 100, cfg)
        z = s * torch.randn(w.shape, generator=g)
        lost = ((w.bfloat16().float() + z).bfloat16() == w.bfloat16()).float().mean().item()
        print(f"{k:>5} {10 * k:>4}-{10 * k + 9:<4} {s:>10.2e} {f'{lost:.1%}' if s else '-':>19}")
