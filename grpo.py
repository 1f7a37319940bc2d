"""GRPO and DAPO objectives as small pure functions (no model code).

One training step samples G completions for each prompt, scores them, and turns the scores into
a per-token policy-gradient loss. Everything here works on plain tensors, so every formula can be
checked by hand (tests/test_grpo.py writes the arithmetic out).

Advantages (group-relative, no critic). For the G rewards r of one prompt:

    A_i = r_i - mean(r)                       scale "none"   (Dr. GRPO)
    A_i = (r_i - mean(r)) / (std(r) + 1e-4)   scale "group"  (GRPO; Bessel std of the group)
    A_i = (r_i - mean(r)) / (std(R) + 1e-4)   scale "batch"  (std of all rewards R in the batch)

A group whose rewards are all equal gets A = 0 and contributes no gradient: DAPO's dynamic
sampling drops such groups and samples more prompts instead (`fill_batch`; by default only in steps
where at least half of the first round's groups are such, where refilling pays for its rollouts).
Each round is one rollout, and a small model's rollout is latency-bound, so one larger round costs
little more than a small one: `round_size` over-samples each round from the share p of informative
groups (the previous step's for a first round, this step's so far for a refill; verl's DAPO uses a
fixed generation batch larger than the train batch, this one follows p), so that one round usually
fills the batch.

Per token t of completion i, with ratio ρ = exp(logp - old_logp) against the policy that sampled:

    ℓ_it = -min(ρ·A_i, clip(ρ, 1-ε_low, 1+ε_high)·A_i)  [· w_it]  + β·(exp(ref - logp) - (ref - logp) - 1)

The KL term is Schulman's k3 estimator of KL(π_θ ‖ π_ref), always ≥ 0. w_it is the optional
importance-sampling weight that corrects for the sampler (our paged-KV rollout, its kernels, AQN
noise) not computing exactly the probabilities of the training forward (Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training"; TRL's
`vllm_importance_sampling_mode`). With d_it = old_logp - sampler_logp, the ratio is per token,
ρ_it = exp(d_it), or one per sequence, ρ_i = exp(Σ_t d_it); ratios outside [C_min, C_max] are
either truncated to the range (`*_truncate`: TIS) or masked to 0 (`*_mask`: MIS), four modes in all
(IS_MODES); the fraction of tokens a mode touches is logged beside the mean weight.

Aggregation over the masked (B, T) token grid, the four definitions TRL's GRPOTrainer uses:

    grpo     mean over each sequence's tokens, then mean over sequences (length-biased)
    bnpo     token mean over the micro-batch
    dr_grpo  sum / (B · max_completion_len)                  (a constant: no length bias)
    dapo     sum / num_items, num_items = active completion tokens of the WHOLE generation batch

Only dapo's normaliser is global, so dapo's micro-batched gradients *sum* to the gradient of one
big batch as they are (the caller counts num_items once, before the first micro-batch). grpo, bnpo
and dr_grpo return the micro-batch's value, and `micro_batch_weight` scales it to its share of the
whole batch: rows / batch rows for the sequence means of grpo and dr_grpo (then the sum is exact),
1 / micro-batches for bnpo, as TRL does (not the big-batch token mean when micro-batches hold
different numbers of tokens). With several data-parallel ranks whose gradients are averaged,
pass num_items / world_size (TRL's convention); train.py sums the gradients instead and passes
the global num_items, which is the same update.

DAPO's other two pieces: overlong shaping adds a length penalty that ramps from 0 to -1 over the
last `cache_len` tokens before max_len (`overlong_penalty`), and overlong filtering drops
truncated completions from the loss (`completion_mask(..., truncated=...)`). Masks always come
from the sampler's recorded lengths and finish reasons, never from pad-token ids (a pad id can
be a real token, e.g. when pad == eos).

Left out: GSPO's sequence-level clipped ratio, CISPO/SAPO losses, entropy bonuses, reward
models. Test: python -m pytest tests/test_grpo.py
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4        # added to the std before dividing (TRL's constant)
DAPO_EPS_HIGH = 0.28  # DAPO's clip-higher upper bound
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


# -----------------------------------------------------------------------------
# config

@dataclass
class GRPOConfig:
    """Objective settings, each flag's default and help (flags.py builds train.py's command line from the
    fields; "flag" names the flag where it differs from the field). epsilon_high=None resolves to 0.28
    for dapo, to epsilon otherwise."""
    group_size: int = field(default=8, metadata={"help": "completions per prompt (G)"})
    loss_type: str = field(default="dapo", metadata={"help": "token aggregation (grpo.py)", "choices": LOSS_TYPES})
    epsilon: float = field(default=0.2, metadata={"help": "clip range ε (low side)"})     # ρ clipped below at 1 - ε
    epsilon_high: float | None = field(default=None, metadata={                          # ... above at 1 + ε_high
        "help": "clip ε high side (default: 0.28 for dapo, else --epsilon)"})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient to the adapter-disabled model"})   # k3 KL
    scale_rewards: str = field(default="group", metadata={"help": "advantage scaling", "choices": SCALE_REWARDS})
    updates_per_rollout: int = field(default=1, metadata={"help": "optimizer steps per generation batch (μ)"})
    max_completion_len: int = field(default=1024, metadata={    # L_max: the sampler's cap; dr_grpo's normaliser
        "flag": "max_new_tokens", "help": "completion length limit"})
    overlong_cache_len: int = field(default=0, metadata={      # L_cache of DAPO's overlong shaping
        "flag": "overlong_cache", "help": "DAPO overlong shaping window (0 = off)"})
    mask_truncated: bool = field(default=False, metadata={
        "help": "overlong filtering: no loss on truncated completions"})
    is_mode: str | None = field(default=None, metadata={       # one of IS_MODES, or None: no correction
        "flag": "importance_sampling", "choices": IS_MODES,
        "help": "correct for the sampler's log-probs differing from the trainer's (TRL's modes; default: none)"})
    is_max: float | None = field(default=3.0, metadata={       # None: no upper bound
        "flag": "importance_sampling_max", "help": "C_max of the correction"})
    is_min: float | None = field(default=None, metadata={      # None: no lower bound
        "flag": "importance_sampling_min", "help": "C_min of the correction (default: none)"})
    dynamic_sampling: bool = field(default=True, metadata={
        "help": "drop groups whose rewards are all equal (they carry no gradient) and sample more prompts, "
                "within --max-sampling-rounds rounds and as many batches of prompts a step (DAPO); it pays "
                "where the base model rarely solves the task (docs/usage.md)"})
    dynamic_sampling_threshold: float = field(default=0.5, metadata={
        "help": "refill a step only when at least this share of its first round's groups has no reward "
                "spread (0: every step, DAPO's rule)"})
    max_sampling_rounds: int = field(default=10, metadata={
        "help": "dynamic sampling's budget a step: at most this many rounds, and this many times "
                "--prompts-per-step prompts (verl's DAPO gives up after 10 generation batches)"})
    dynamic_sampling_tol: float = 1e-6   # rewards within this spread count as "all equal" (no flag)

    def __post_init__(self):
        if self.group_size < 2:
            raise ValueError(f"GRPOConfig.group_size must be >= 2 (advantages compare samples of one prompt), "
                             f"got {self.group_size}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"GRPOConfig.loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"GRPOConfig.scale_rewards must be one of {SCALE_REWARDS}, got {self.scale_rewards!r}")
        if not 0.0 < self.epsilon < 1.0:
            raise ValueError(f"GRPOConfig.epsilon must be in (0, 1), got {self.epsilon}")
        if self.epsilon_high is None:
            self.epsilon_high = DAPO_EPS_HIGH if self.loss_type == "dapo" else self.epsilon
        if not self.epsilon_high > 0.0:
            raise ValueError(f"GRPOConfig.epsilon_high must be > 0, got {self.epsilon_high}")
        if self.beta < 0.0:
            raise ValueError(f"GRPOConfig.beta must be >= 0, got {self.beta}")
        if self.updates_per_rollout < 1:
            raise ValueError(f"GRPOConfig.updates_per_rollout must be >= 1, got {self.updates_per_rollout}")
        if self.max_completion_len < 1:
            raise ValueError(f"GRPOConfig.max_completion_len must be >= 1, got {self.max_completion_len}")
        if not 0 <= self.overlong_cache_len < self.max_completion_len:
            raise ValueError(f"GRPOConfig.overlong_cache_len must be in [0, max_completion_len="
                             f"{self.max_completion_len}), got {self.overlong_cache_len}")
        if self.is_mode is not None and self.is_mode not in IS_MODES:
            raise ValueError(f"GRPOConfig.is_mode must be one of {IS_MODES} or None, got {self.is_mode!r}")
        for name in ("is_max", "is_min"):
            if getattr(self, name) is not None and not getattr(self, name) > 0.0:
                raise ValueError(f"GRPOConfig.{name} must be > 0 or None, got {getattr(self, name)}")
        if self.is_max is not None and self.is_min is not None and self.is_min > self.is_max:
            raise ValueError(f"GRPOConfig.is_min ({self.is_min}) must be <= is_max ({self.is_max})")
        if self.max_sampling_rounds < 1:
            raise ValueError(f"GRPOConfig.max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}")
        if not 0.0 <= self.dynamic_sampling_threshold <= 1.0:
            raise ValueError(f"GRPOConfig.dynamic_sampling_threshold must be in [0, 1], got "
                             f"{self.dynamic_sampling_threshold}")
        if self.dynamic_sampling_tol < 0.0:
            raise ValueError(f"GRPOConfig.dynamic_sampling_tol must be >= 0, got {self.dynamic_sampling_tol}")


# -----------------------------------------------------------------------------
# advantages and reward shaping

def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) -> (B/G, G) float32, checking that B is a whole number of groups."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (B,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}")
    return rewards.float().view(-1, group_size)


def advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """Group-relative advantages.

    rewards: (B,) with the G completions of each prompt contiguous (B = num_prompts · G).
    Returns (B,) float32: r - group mean, divided by (Bessel std + 1e-4) of the group ("group"),
    of the whole batch ("batch"), or not divided ("none"). Zero-variance groups give exactly 0.
    """
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale must be one of {SCALE_REWARDS}, got {scale!r}")
    r = _groups(rewards, group_size)                       # (P, G)
    centered = r - r.mean(dim=1, keepdim=True)             # (P, G)
    if scale == "group":
        if group_size < 2:
            raise ValueError("scale='group' needs group_size >= 2 (the std of one sample is undefined)")
        centered = centered / (r.std(dim=1, keepdim=True) + STD_EPS)
    elif scale == "batch":
        if rewards.numel() < 2:
            raise ValueError("scale='batch' needs at least 2 rewards")
        centered = centered / (r.std() + STD_EPS)
    return centered.reshape(-1)


def completion_mask(lengths: torch.Tensor, max_len: int, truncated: torch.Tensor | None = None) -> torch.Tensor:
    """Loss mask from the sampler's recorded completion lengths.

    lengths: (B,) int, tokens generated per completion (the EOS token included when one was
    sampled); max_len: T, the width of the padded (B, T) completion tensors. truncated: (B,) bool,
    True where the sampler stopped at the length cap; those rows are zeroed (DAPO's overlong
    filtering; pass it only when GRPOConfig.mask_truncated is on).
    Returns (B, T) float32 with 1 on positions t < lengths[b].
    """
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D (B,), got shape {tuple(lengths.shape)}")
    if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > max_len):
        raise ValueError(f"lengths must lie in [0, max_len={max_len}], got min {int(lengths.min())} "
                         f"max {int(lengths.max())}")
    pos = torch.arange(max_len, device=lengths.device)     # (T,)
    mask = pos[None, :] < lengths[:, None]                 # (B, T)
    if truncated is not None:
        if truncated.shape != lengths.shape:
            raise ValueError(f"truncated must have shape {tuple(lengths.shape)}, got {tuple(truncated.shape)}")
        mask = mask & ~truncated.bool()[:, None]
    return mask.float()


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the task reward.

    lengths: (B,) completion lengths L. With the soft limit S = max_len - cache_len:
        0                    if L <= S
        (S - L) / cache_len  if S < L <= max_len   (a ramp from 0 down to -1)
        -1                   if L > max_len
    Returns (B,) float32.
    """
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"cache_len must be in [0, max_len={max_len}], got {cache_len}")
    L = lengths.float()
    soft = max_len - cache_len
    if cache_len == 0:
        ramp = torch.zeros_like(L)
    else:
        ramp = torch.where(L <= soft, torch.zeros_like(L), (soft - L) / cache_len)
    return torch.where(L > max_len, torch.full_like(L, -1.0), ramp)


# -----------------------------------------------------------------------------
# the policy loss

def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token mean of x (B, T) over mask (B, T) float, detached (a metric, never a loss)."""
    return ((x.detach().float() * mask).sum() / mask.sum().clamp(min=1.0))


def importance_weights(gap: torch.Tensor, cfg: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """gap (B, T) = old_logp - sampler_logp, 0 off the mask -> (weights, touched) (B, T), no gradient:
    the ratio per token, or per sequence (exp of the sequence's summed gap, on each of its tokens),
    truncated to [is_min, is_max] or masked to 0 outside it; touched is 1 where that changed it."""
    d = gap.sum(-1, keepdim=True) if cfg.is_mode.startswith("sequence") else gap      # (B, 1) or (B, T)
    ratio = torch.exp(d.detach())
    lo = cfg.is_min if cfg.is_min is not None else 0.0
    hi = cfg.is_max if cfg.is_max is not None else math.inf
    out = (ratio < lo) | (ratio > hi)
    w = ratio.clamp(lo, hi) if cfg.is_mode.endswith("truncate") else ratio.masked_fill(out, 0.0)
    return w.expand_as(gap), out.float().expand_as(gap)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    sampler_logp: torch.Tensor | None = None,
    num_items: int | float | torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate + k3 KL, aggregated per cfg.loss_type.

    logp:         (B, T) log π_θ(token) from the training forward (requires grad).
    old_logp:     (B, T) log-probs of the policy that generated the data, recomputed by the training
                  forward before the first update; None means logp.detach() (μ = 1: ratio ≡ 1).
    advantages:   (B,) one advantage per completion.
    mask:         (B, T) 1 on completion tokens that count (see completion_mask); padding positions
                  of the other tensors may hold anything (even inf/nan): they never reach the loss.
    ref_logp:     (B, T) reference log-probs (adapter disabled); required when cfg.beta > 0.
    sampler_logp: (B, T) log-probs the sampler reported: the mismatch metric, and the
                  importance-sampling correction where cfg.is_mode is set.
    num_items:    dapo only: active completion tokens in the whole generation batch (all
                  micro-batches, all ranks; divide by world size under gradient averaging,
                  keep it whole when gradients are summed across ranks as train.py does).
                  None = this call is the whole batch.
    entropy:      (B, T) optional per-token entropy, only logged.
    Returns (loss: 0-dim tensor, metrics: dict of detached 0-dim tensors).
    """
    B, T = logp.shape
    for name, t in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp),
                    ("sampler_logp", sampler_logp), ("entropy", entropy)):
        if t is not None and t.shape != (B, T):
            raise ValueError(f"{name} must have the shape of logp {(B, T)}, got {tuple(t.shape)}")
    if advantages.shape != (B,):
        raise ValueError(f"advantages must have shape {(B,)}, got {tuple(advantages.shape)}")
    if cfg.beta > 0 and ref_logp is None:
        raise ValueError("ref_logp is required when GRPOConfig.beta > 0")

    on = mask.bool()                                       # (B, T)
    m = on.float()                                         # (B, T)
    zero = torch.zeros((), device=logp.device)
    logp = logp.float()
    old = logp.detach() if old_logp is None else old_logp.float()

    # Differences are zeroed off the mask *before* exp, so garbage in padding cannot turn into
    # inf * 0 = nan in the forward or the backward pass.
    log_ratio = torch.where(on, logp - old, zero)          # (B, T)
    ratio = torch.exp(log_ratio)                           # (B, T)
    A = advantages.float()[:, None]                        # (B, 1)
    clipped = torch.clamp(ratio, 1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high)
    per_token = -torch.min(ratio * A, clipped * A)         # (B, T)

    metrics: dict[str, torch.Tensor] = {}
    if sampler_logp is not None:
        # log π_old - log π_sampler: how far the sampler's numbers are from the trainer's.
        gap = torch.where(on, old.detach() - sampler_logp.float(), zero)   # (B, T)
        metrics["logprob_mismatch"] = _masked_mean(gap.abs(), m)
        if cfg.is_mode is not None:
            w, touched = importance_weights(gap, cfg)                     # (B, T) each, constants
            per_token = per_token * w
            metrics["is_weight_mean"] = _masked_mean(w, m)
            metrics["is_touched_frac"] = _masked_mean(touched, m)

    if ref_logp is not None:
        d = torch.where(on, ref_logp.float() - logp, zero)  # (B, T) log π_ref - log π_θ
        kl = torch.exp(d) - d - 1.0                         # k3 estimator, >= 0
        metrics["kl"] = _masked_mean(kl, m)
        if cfg.beta > 0:
            per_token = per_token + cfg.beta * kl

    loss = aggregate(per_token * m, m, cfg, num_items)     # per_token * m: exactly 0 off the mask
    metrics.update(clip_metrics(ratio.detach(), A, m, cfg))
    if entropy is not None:
        metrics["entropy"] = _masked_mean(torch.where(on, entropy.float(), zero), m)
    metrics["num_tokens"] = m.sum().detach()
    return loss, metrics


def clip_metrics(ratio: torch.Tensor, A: torch.Tensor, m: torch.Tensor, cfg: GRPOConfig) -> dict[str, torch.Tensor]:
    """TRL's clip metrics: the share of tokens (mask m (B, T)) where the clip is active and cuts the
    gradient, below (ratio (B, T) < 1 - ε with A (B, 1) < 0), above (> 1 + ε_high with A > 0), either."""
    low = (ratio < 1.0 - cfg.epsilon) & (A < 0)            # (B, T)
    high = (ratio > 1.0 + cfg.epsilon_high) & (A > 0)      # (B, T)
    return {"clip_ratio/low_mean": _masked_mean(low.float(), m),
            "clip_ratio/high_mean": _masked_mean(high.float(), m),
            "clip_ratio/region_mean": _masked_mean((low | high).float(), m)}


# -----------------------------------------------------------------------------
# aggregation, and what a micro-batch's loss weighs in the whole batch

def aggregate(tok: torch.Tensor, m: torch.Tensor, cfg: GRPOConfig,
              num_items: int | float | torch.Tensor | None) -> torch.Tensor:
    """The loss of the per-token terms tok (B, T), 0 off the mask m (B, T), per cfg.loss_type (the
    module docstring's table). num_items: dapo's normaliser, as policy_loss takes it."""
    B = tok.shape[0]
    if cfg.loss_type == "grpo":
        return (tok.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if cfg.loss_type == "bnpo":
        return tok.sum() / m.sum().clamp(min=1.0)
    if cfg.loss_type == "dr_grpo":
        return tok.sum() / (B * cfg.max_completion_len)
    if num_items is None:  # dapo
        num_items = m.sum().clamp(min=1.0)
    elif isinstance(num_items, (int, float)) and num_items <= 0:  # a tensor is not checked: no sync
        raise ValueError(f"num_items must be > 0, got {num_items}")
    return tok.sum() / num_items


def micro_batch_weight(cfg: GRPOConfig, rows: int, batch_rows: int, micro_batches: int) -> float:
    """What one micro-batch's loss is multiplied by, so that the micro-batches' gradients add up to the
    gradient of the whole generation batch. rows: the micro-batch's completions; batch_rows: the whole
    batch's and micro_batches: its number of micro-batches, both over all ranks.

        dapo     1                    its normaliser, num_items, is already the whole batch's
        bnpo     1 / micro_batches    a token mean per micro-batch: exact when they hold equal token counts
        grpo     rows / batch_rows    means over sequences: each micro-batch weighs its share of them
        dr_grpo  rows / batch_rows
    """
    if cfg.loss_type == "dapo":
        return 1.0
    if cfg.loss_type == "bnpo":
        return 1.0 / micro_batches
    return rows / batch_rows


# -----------------------------------------------------------------------------
# dynamic sampling (DAPO)

def dynamic_sampling_filter(rewards: torch.Tensor, group_size: int, tol: float = 1e-6) -> torch.Tensor:
    """Which groups carry signal. rewards (B,) -> (B/G,) bool: True where max - min > tol."""
    r = _groups(rewards, group_size)                       # (P, G)
    return (r.max(dim=1).values - r.min(dim=1).values) > tol


def round_size(need: int, keep_rate: float, cap: int) -> int:
    """How many prompts a sampling round draws to find `need` informative groups: the smallest
    n >= need with

        n·p - sqrt(n·p·(1-p)) >= need,        p = keep_rate clamped to [0, 1]

    i.e. the expected informative count minus one binomial standard deviation covers the need. If p
    is the true rate, one round then fills the batch in about 5 steps of 6 or more (the one-sided
    one-σ bound; the discrete binomial gives at least 86% for needs of 1 to 32), and a shortfall is
    small and refilled by a second round. The mean alone (n = need/p) would miss half the time; a
    wider margin would save few second rounds and discard more groups. p >= 1 gives n = need (no
    over-sampling, as after a step whose groups all carried signal); p <= 0, or no n up to cap
    satisfying the rule, gives cap, the prompts the step may still draw. Never more than cap, even
    where cap < need.
    """
    p = min(max(keep_rate, 0.0), 1.0)
    return next((n for n in range(need, cap + 1) if n * p - math.sqrt(n * p * (1 - p)) >= need), cap)


@dataclass
class FilledBatch:
    """What fill_batch gathered: the kept groups, in sampling order."""
    groups: list            # one caller-defined payload per kept group (at most target_groups)
    rewards: torch.Tensor   # (len(groups) · G,) their rewards
    rounds: int             # sampling rounds used
    sampled_groups: int     # groups (= prompts) drawn in total (kept + dropped + surplus)
    informative: int        # of those, groups with a reward spread (kept or not)
    full: bool              # True when target_groups groups were found

    @property
    def keep_rate(self) -> float:
        """The share of drawn groups that carried signal: the next step's fill_batch keep_rate."""
        return self.informative / self.sampled_groups


def fill_batch(
    sample_round: Callable[[int, int], tuple[torch.Tensor, Sequence[Any]]],
    target_groups: int,
    group_size: int,
    max_rounds: int,
    *,
    tol: float = 1e-6,
    threshold: float = 0.0,
    keep_rate: float = 1.0,
) -> FilledBatch:
    """Call sample_round until target_groups informative groups are kept or the budget is spent.

    sample_round(round_index, n) -> (rewards (n·G,), payloads: n objects, one per group) samples n
    fresh prompts × G completions (the caller owns prompts, the sampler and what a payload is). Each
    round draws round_size(need, p, left) prompts, need = target_groups - groups kept so far, p the
    expected share of informative groups: for the first round keep_rate (the previous step's
    FilledBatch.keep_rate; 1.0 without history, which draws exactly the need), for a refill the share
    this step's rounds have found so far (a first step on a hard task then refills its whole shortfall
    in one more round, not in many small ones). The budget is what max_rounds rounds of
    target_groups prompts would draw: at most max_rounds rounds and max_rounds · target_groups prompts
    in all (left is what remains of it). Groups whose rewards are all equal within tol are dropped;
    informative ones are kept in sampling order up to target_groups and the surplus discarded, as DAPO
    does. When the budget runs out, the partial batch comes back with full=False (possibly empty): the
    caller decides whether to train on it or skip the step.

    threshold: refill only where it pays. When fewer than this share of the first round's groups
    are uninformative, nothing more is sampled and the batch is that round's target_groups groups
    with the most signal: its informative groups, then its first zero-variance ones (as without
    dynamic sampling), in sampling order. Refilling buys an update more groups with signal at one more
    rollout each round; that matters where most groups have none (a base model that rarely solves the
    task, or a policy whose entropy has collapsed), and costs a rollout for little where most already
    have a spread. 0 refills every step (DAPO's rule). For the same reason the first round is
    over-sampled only where keep_rate predicts a refill (1 - keep_rate >= threshold): otherwise it
    draws target_groups, as it would come back unfiltered.
    """
    if target_groups < 1:
        raise ValueError(f"target_groups must be >= 1, got {target_groups}")
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
    budget = max_rounds * target_groups
    kept, kept_rewards, sampled, informative, rounds = [], [], 0, 0, 0
    while len(kept) < target_groups and rounds < max_rounds and sampled < budget:
        if rounds:                               # a refill: this step's own rate so far
            p = informative / sampled
        else:                                    # over-sample only where a refill is predicted
            p = keep_rate if 1 - keep_rate >= threshold else 1.0
        n = round_size(target_groups - len(kept), p, budget - sampled)
        rewards, payloads = sample_round(rounds, n)
        rounds += 1
        keep = dynamic_sampling_filter(rewards, group_size, tol)     # (n,)
        if (keep.numel(), len(payloads)) != (n, n):
            raise ValueError(f"sample_round was asked for {n} groups and returned {keep.numel()} groups of "
                             f"rewards and {len(payloads)} payloads")
        sampled += n
        informative += int(keep.sum())
        r = rewards.float().view(-1, group_size)                     # (n, G)
        if rounds == 1 and (~keep).float().mean().item() < threshold:  # enough signal: no refill
            flags = keep.tolist()
            picks = sorted(sorted(range(n), key=lambda i: not flags[i])[:target_groups])  # informative first
            return FilledBatch([payloads[i] for i in picks], r[picks].flatten(), 1, sampled, informative, True)
        for i in torch.nonzero(keep).flatten().tolist():
            if len(kept) == target_groups:
                break
            kept.append(payloads[i])
            kept_rewards.append(r[i])
    rew = torch.cat(kept_rewards) if kept_rewards else torch.zeros(0)
    return FilledBatch(kept, rew, rounds, sampled, informative, len(kept) == target_groups)
