"""grpo.py against hand-computed values: every number below is written out from small tensors."""
import math

import pytest
import torch

from grpo import (GRPOConfig, advantages, completion_mask, dynamic_sampling_filter, fill_batch,
                  micro_batch_weight, overlong_penalty, policy_loss, round_size)

E = math.exp
NAN, INF = float("nan"), float("inf")


def close(got, want, tol=1e-6, what=""):
    got = float(got.detach()) if torch.is_tensor(got) else float(got)
    err = abs(got - want)
    assert err <= tol * max(1.0, abs(want)), f"{what}: got {got!r}, want {want!r}, err {err:.3g}"


# -----------------------------------------------------------------------------
# config

def test_config_defaults_and_epsilon_high_resolution():
    assert GRPOConfig().epsilon_high == 0.28                       # dapo: clip-higher
    assert GRPOConfig(loss_type="grpo").epsilon_high == 0.2        # grpo: symmetric
    assert GRPOConfig(loss_type="bnpo", epsilon=0.1).epsilon_high == 0.1
    assert GRPOConfig(loss_type="grpo", epsilon_high=0.3).epsilon_high == 0.3


@pytest.mark.parametrize("kwargs, field", [
    (dict(loss_type="ppo"), "loss_type"), (dict(scale_rewards="rank"), "scale_rewards"),
    (dict(epsilon=0.0), "epsilon"), (dict(epsilon_high=-0.1), "epsilon_high"), (dict(beta=-1.0), "beta"),
    (dict(updates_per_rollout=0), "updates_per_rollout"), (dict(max_completion_len=0), "max_completion_len"),
    (dict(max_completion_len=8, overlong_cache_len=8), "overlong_cache_len"), (dict(is_mode="token"), "is_mode"), (dict(is_max=0.0), "is_max"),
    (dict(is_min=2.0, is_max=1.0), "is_min"),
    (dict(max_sampling_rounds=0), "max_sampling_rounds"), (dict(dynamic_sampling_tol=-1.0), "dynamic_sampling_tol"),
    (dict(dynamic_sampling_threshold=1.5), "dynamic_sampling_threshold"), (dict(group_size=1), "group_size"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GRPOConfig(**kwargs)


# -----------------------------------------------------------------------------
# advantages

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])   # two groups of G = 4


def test_advantages_group_scaling_by_hand():
    # group 1: mean 0.5, Bessel std sqrt(4 · 0.25 / 3) = sqrt(1/3); group 2: all equal -> exactly 0
    s = math.sqrt(1 / 3) + 1e-4
    want = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0]
    got = advantages(REWARDS, 4, "group")
    for g, w in zip(got.tolist(), want):
        close(g, w, what="group advantage")
    assert got.dtype == torch.float32 and (got[4:] == 0).all()


def test_advantages_batch_and_none_by_hand():
    # batch std over all 8 rewards: mean 0.75, var = (6 · 0.25² + 2 · 0.75²) / 7 = 1.5 / 7
    s = math.sqrt(1.5 / 7) + 1e-4
    for g, w in zip(advantages(REWARDS, 4, "batch").tolist(), [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0]):
        close(g, w, what="batch advantage")
    assert advantages(REWARDS, 4, "none").tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]


def test_advantages_errors():
    with pytest.raises(ValueError, match="multiple of group_size"):
        advantages(torch.ones(6), 4)
    with pytest.raises(ValueError, match="group_size >= 2"):
        advantages(torch.ones(3), 1, "group")
    with pytest.raises(ValueError, match="scale"):
        advantages(torch.ones(4), 2, "rank")


# -----------------------------------------------------------------------------
# masks and overlong shaping

def test_completion_mask_from_lengths_and_truncation():
    lengths = torch.tensor([3, 0, 4, 1])
    m = completion_mask(lengths, 4)
    assert m.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    m = completion_mask(lengths, 4, truncated=torch.tensor([False, False, True, False]))
    assert m.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
    with pytest.raises(ValueError, match="max_len=4"):
        completion_mask(torch.tensor([5]), 4)


def test_overlong_penalty_at_the_boundaries():
    # max_len 20, cache 4: soft limit 16; the ramp is (16 - L) / 4
    L = torch.tensor([0, 15, 16, 17, 18, 20, 21])
    assert overlong_penalty(L, 20, 4).tolist() == [0, 0, 0, -0.25, -0.5, -1, -1]
    assert overlong_penalty(L, 20, 0).tolist() == [0, 0, 0, 0, 0, 0, -1]         # no window
    for g, w in zip(overlong_penalty(torch.tensor([1, 2, 3]), 3, 3).tolist(), [-1 / 3, -2 / 3, -1]):
        close(g, w, what="cache == max_len")
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(L, 20, 21)


# -----------------------------------------------------------------------------
# policy loss: one small batch, every loss type by hand

# Two completions, T = 3. Row 1 has length 2: its last position is padding and holds garbage
# (nan / inf) in every tensor, which must not reach the loss or the metrics.
LOGP = [[-1.0, -2.0, -0.5], [-1.5, -0.3, NAN]]
OLD = [[-1.0, -2.5, -0.2], [-1.0, -0.3, NAN]]
ADV = [1.0, -2.0]
MASK = completion_mask(torch.tensor([3, 2]), 3)


def _inputs():
    logp = torch.tensor(LOGP, requires_grad=True)
    return logp, torch.tensor(OLD), torch.tensor(ADV)


def _hand_per_token(eps_high):
    """-min(ρA, clip(ρ)A) per active token, written out.

    row 0, A = +1: ρ = e^0 = 1 -> -1; ρ = e^0.5 = 1.6487 > 1+ε_high -> -(1+ε_high) (high clip);
                   ρ = e^-0.3 = 0.7408 < 0.8 but A > 0, so the unclipped -0.7408 is the min.
    row 1, A = -2: ρ = e^-0.5 = 0.6065 < 0.8 -> min(-1.2131, -1.6) = -1.6 -> +1.6 (low clip);
                   ρ = 1 -> +2.
    """
    return [[-1.0, -(1 + eps_high), -E(-0.3)], [0.8 * 2, 2.0]]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_policy_loss_every_type_by_hand(loss_type):
    cfg = GRPOConfig(loss_type=loss_type, max_completion_len=4)
    eps_high = 0.28 if loss_type == "dapo" else 0.2
    (a, b, c), (d, e) = _hand_per_token(eps_high)
    want = {
        "grpo": ((a + b + c) / 3 + (d + e) / 2) / 2,   # per-sequence means, then mean over sequences
        "bnpo": (a + b + c + d + e) / 5,               # token mean
        "dr_grpo": (a + b + c + d + e) / (2 * 4),      # B · max_completion_len
        "dapo": (a + b + c + d + e) / 5,               # num_items=None: this batch's 5 tokens
    }[loss_type]
    logp, old, adv = _inputs()
    loss, metrics = policy_loss(logp, old, adv, MASK, cfg)
    close(loss, want, what=loss_type)
    if loss_type == "dapo":
        loss10, _ = policy_loss(logp, old, adv, MASK, cfg, num_items=10)
        close(loss10, (a + b + c + d + e) / 10, what="dapo num_items=10")
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[1, 2] == 0, "padding leaked into the gradient"
    # clip metrics (TRL's definition): of 5 tokens, one low-clipped (row 1 tok 0), one high (row 0 tok 1)
    close(metrics["clip_ratio/low_mean"], 0.2, what="low clip")
    close(metrics["clip_ratio/high_mean"], 0.2, what="high clip")
    close(metrics["clip_ratio/region_mean"], 0.4, what="region clip")
    assert metrics["num_tokens"] == 5 and "kl" not in metrics


def test_policy_loss_gradient_is_the_clipped_policy_gradient():
    # bnpo, d loss / d logp = -A·ρ/N where the clip is inactive, 0 where it cuts (N = 5 tokens)
    logp, old, adv = _inputs()
    loss, _ = policy_loss(logp, old, adv, MASK, GRPOConfig(loss_type="bnpo"))
    loss.backward()
    want = [[-1 * 1 / 5, 0.0, -1 * E(-0.3) / 5], [0.0, 2 * 1 / 5, 0.0]]
    for g, w in zip(logp.grad.flatten().tolist(), sum(want, [])):
        close(g, w, what="gradient")


def test_old_logp_none_means_ratio_one():
    logp, _, adv = _inputs()
    loss, m = policy_loss(logp, None, adv, MASK, GRPOConfig(loss_type="dapo"))
    close(loss, (-1 * 3 + 2 * 2) / 5, what="ratio 1: -mean(A) over tokens")
    assert m["clip_ratio/region_mean"] == 0


def test_kl_term_k3_by_hand():
    ref = torch.tensor([[-1.2, -2.0, -0.1], [-1.0, -0.5, INF]])
    d = [-0.2, 0.0, 0.4, 0.5, -0.2]                     # ref - logp on the 5 active tokens
    k3 = [E(x) - x - 1 for x in d]
    logp, old, adv = _inputs()
    cfg = GRPOConfig(loss_type="bnpo", beta=0.1)
    loss, metrics = policy_loss(logp, old, adv, MASK, cfg, ref_logp=ref)
    per_token = sum(_hand_per_token(0.2), [])
    close(loss, sum(p + 0.1 * k for p, k in zip(per_token, k3)) / 5, what="loss with KL")
    close(metrics["kl"], sum(k3) / 5, what="kl metric")
    # beta = 0: the KL is still reported when ref_logp is given, but stays out of the loss
    loss0, m0 = policy_loss(logp, old, adv, MASK, GRPOConfig(loss_type="bnpo"), ref_logp=ref)
    close(loss0, sum(per_token) / 5, what="beta=0 loss")
    close(m0["kl"], sum(k3) / 5, what="beta=0 kl metric")
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, adv, MASK, cfg)


@pytest.mark.parametrize("mode, w, touched", [
    # old - sampler on the active tokens: row 0 [0.1, 0, 0], row 1 [-0.1, 0]; caps [0.95, 1.05]
    ("token_truncate", [1.05, 1.0, 1.0, 0.95, 1.0], [1, 0, 0, 1, 0]),          # e^0.1 > 1.05, e^-0.1 < 0.95
    ("token_mask", [0.0, 1.0, 1.0, 0.0, 1.0], [1, 0, 0, 1, 0]),
    # per sequence: row 0 e^(0.1 + 0 + 0) = 1.1052 on all its tokens, row 1 e^-0.1 = 0.9048
    ("sequence_truncate", [1.05] * 3 + [0.95] * 2, [1] * 5),
    ("sequence_mask", [0.0] * 5, [1] * 5),
])
def test_importance_sampling_modes_by_hand(mode, w, touched):
    sampler = torch.tensor([[-1.1, -2.5, -0.2], [-0.9, -0.3, NAN]])
    per_token = sum(_hand_per_token(0.2), [])
    logp, old, adv = _inputs()
    cfg = GRPOConfig(loss_type="bnpo", is_mode=mode, is_min=0.95, is_max=1.05)
    loss, m = policy_loss(logp, old, adv, MASK, cfg, sampler_logp=sampler)
    close(loss, sum(p * x for p, x in zip(per_token, w)) / 5, what=f"{mode} loss")
    close(m["logprob_mismatch"], 0.2 / 5, what="mismatch")
    close(m["is_weight_mean"], sum(w) / 5, what=f"{mode} weight mean")
    close(m["is_touched_frac"], sum(touched) / 5, what=f"{mode} touched")
    # wide caps touch nothing: the weights are the plain ratios
    loss_w, m_w = policy_loss(logp, old, adv, MASK, GRPOConfig(loss_type="bnpo", is_mode=mode, is_max=10.0),
                              sampler_logp=sampler)
    ratios = [E(0.1), 1.0, 1.0, E(-0.1), 1.0] if mode.startswith("token") else [E(0.1)] * 3 + [E(-0.1)] * 2
    close(loss_w, sum(p * x for p, x in zip(per_token, ratios)) / 5, what=f"{mode} uncapped loss")
    close(m_w["is_touched_frac"], 0.0, what="uncapped touched")
    # without a mode: the mismatch is reported, the loss is unweighted
    loss_plain, m2 = policy_loss(logp, old, adv, MASK, GRPOConfig(loss_type="bnpo"), sampler_logp=sampler)
    close(loss_plain, sum(per_token) / 5, what="no correction")
    assert "is_weight_mean" not in m2 and "logprob_mismatch" in m2


def test_entropy_metric_is_a_masked_mean():
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, NAN]])
    logp, old, adv = _inputs()
    _, m = policy_loss(logp, old, adv, MASK, GRPOConfig(), entropy=ent)
    close(m["entropy"], 15 / 5, what="entropy")


def test_truncated_completion_is_masked_out():
    # overlong filtering: row 1 truncated -> only row 0's tokens count
    mask = completion_mask(torch.tensor([3, 2]), 3, truncated=torch.tensor([False, True]))
    (a, b, c), _ = _hand_per_token(0.2)
    logp, old, adv = _inputs()
    loss, m = policy_loss(logp, old, adv, mask, GRPOConfig(loss_type="grpo"))
    close(loss, ((a + b + c) / 3 + 0) / 2, what="grpo, masked row still counts in the mean (as TRL)")
    loss, m = policy_loss(logp, old, adv, mask, GRPOConfig(loss_type="bnpo"))
    close(loss, (a + b + c) / 3, what="bnpo")
    loss.backward()
    assert (logp.grad[1] == 0).all() and m["num_tokens"] == 3
    close(m["clip_ratio/low_mean"], 0.0, what="the low clip was on the masked row")


def test_shape_errors():
    logp, old, adv = _inputs()
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, adv[:1], MASK, GRPOConfig())
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(logp, old[:, :2], adv, MASK, GRPOConfig())
    with pytest.raises(ValueError, match="num_items"):
        policy_loss(logp, old, adv, MASK, GRPOConfig(), num_items=0)


# -----------------------------------------------------------------------------
# micro-batching: dapo's gradients sum to the big-batch gradient, the others' do not

def _toy_batch(B=6, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-3 * torch.rand(B, T, generator=g)).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    lengths = torch.tensor([7, 1, 3, 5, 2, 6])[:B]
    return logp, old, adv, completion_mask(lengths, T)


def _grad(loss_type, slices, num_items=None, divide=False):
    logp, old, adv, mask = _toy_batch()
    cfg = GRPOConfig(loss_type=loss_type, max_completion_len=7)
    for s in slices:
        loss, _ = policy_loss(logp[s], old[s], adv[s], mask[s], cfg, num_items=num_items)
        (loss / len(slices) if divide else loss).backward()
    return logp.grad.clone()


def _maxdiff(a, b):
    return (a - b).abs().max().item()


def test_dapo_micro_batch_gradient_equals_big_batch():
    _, _, _, mask = _toy_batch()
    n = int(mask.sum())                                  # 24 active tokens in the generation batch
    big = _grad("dapo", [slice(0, 6)], num_items=n)
    micro = _grad("dapo", [slice(0, 2), slice(2, 3), slice(3, 6)], num_items=n)
    assert _maxdiff(big, micro) < 1e-7, f"dapo: max |Δgrad| {_maxdiff(big, micro):.3g}"
    # without the global count, each micro-batch normalises by its own tokens: a different gradient
    local = _grad("dapo", [slice(0, 2), slice(2, 3), slice(3, 6)], divide=True)
    assert _maxdiff(big, local) > 1e-3


def test_other_losses_under_micro_batching():
    # grpo weights each sequence equally: equal-size micro-batches averaged reproduce the big batch...
    big = _grad("grpo", [slice(0, 6)])
    assert _maxdiff(big, _grad("grpo", [slice(0, 3), slice(3, 6)], divide=True)) < 1e-7
    # ...unequal ones do not (the 1-sequence micro-batch gets weight 1/2 instead of 1/6)
    assert _maxdiff(big, _grad("grpo", [slice(0, 1), slice(1, 6)], divide=True)) > 1e-3
    # bnpo: micro-batches with different token counts (11 vs 13) change the per-token weights
    assert _maxdiff(_grad("bnpo", [slice(0, 6)]), _grad("bnpo", [slice(0, 3), slice(3, 6)], divide=True)) > 1e-3
    # dr_grpo's normaliser is a constant per sequence: equal micro-batches reproduce it
    assert _maxdiff(_grad("dr_grpo", [slice(0, 6)]), _grad("dr_grpo", [slice(0, 3), slice(3, 6)], divide=True)) < 1e-7
    # grpo vs dapo on the same batch: per-token weights 1/(B·L_i) vs 1/N differ when lengths differ
    n = int(_toy_batch()[3].sum())
    assert _maxdiff(big, _grad("dapo", [slice(0, 6)], num_items=n)) > 1e-3


def test_micro_batch_weight_turns_micro_batches_into_the_big_batch():
    """Unequal micro-batches (1 and 5 sequences of 6) weighted by micro_batch_weight: grpo's and dr_grpo's
    sum is the big batch's gradient, dapo's needs no weight; bnpo weighs each micro-batch alike."""
    logp, old, adv, mask = _toy_batch()
    n = int(mask.sum())
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        cfg = GRPOConfig(loss_type=loss_type, max_completion_len=7)
        grads = []
        for slices in ([slice(0, 6)], [slice(0, 1), slice(1, 6)]):
            x = logp.detach().clone().requires_grad_(True)
            for s in slices:
                w = micro_batch_weight(cfg, s.stop - s.start, 6, len(slices))
                (policy_loss(x[s], old[s], adv[s], mask[s], cfg, num_items=n)[0] * w).backward()
            grads.append(x.grad)
        assert _maxdiff(*grads) < 1e-7, f"{loss_type}: max |Δgrad| {_maxdiff(*grads):.3g}"
    assert micro_batch_weight(GRPOConfig(loss_type="dapo"), 1, 6, 2) == 1.0
    assert micro_batch_weight(GRPOConfig(loss_type="bnpo"), 1, 6, 4) == 0.25
    assert micro_batch_weight(GRPOConfig(loss_type="grpo"), 1, 6, 4) == 1 / 6


# -----------------------------------------------------------------------------
# dynamic sampling

def test_dynamic_sampling_filter():
    r = torch.tensor([1, 1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.5004])
    assert dynamic_sampling_filter(r, 3).tolist() == [False, True, False, True]
    assert dynamic_sampling_filter(r, 3, tol=1e-3).tolist() == [False, True, False, False]


@pytest.mark.parametrize("need, p, cap, want", [
    (8, 0.4, 100, 27),   # 0.4n - √(0.24n): n = 26 -> 10.4 - 2.50 = 7.90 < 8; n = 27 -> 10.8 - 2.55 = 8.25
    (8, 0.5, 100, 21),   # (n - √n)/2 >= 8: n = 20 -> 15.53/2 < 8; n = 21 -> 16.42/2 = 8.21
    (8, 0.8, 100, 12),   # 0.8n - 0.4√n: n = 11 -> 8.8 - 1.33 = 7.47; n = 12 -> 9.6 - 1.39 = 8.21
    (4, 0.8, 100, 7),    # n = 6 -> 4.8 - 0.98 = 3.82; n = 7 -> 5.6 - 1.06 = 4.54
    (2, 0.8, 100, 4),    # n = 3 -> 2.4 - 0.69 = 1.71; n = 4 -> 3.2 - 0.8 = 2.4
    (4, 0.5, 100, 12),   # (n - √n)/2 >= 4: n = 11 -> 7.68/2 < 4; n = 12 -> 8.54/2 = 4.27
    (8, 1.0, 100, 8),    # every group informative: exactly the need
    (8, 1.5, 100, 8),    # a rate above 1 counts as 1
    (8, 0.0, 24, 24),    # none informative: the whole budget
    (8, -0.2, 24, 24),
    (8, 0.4, 24, 24),    # the rule wants 27: the cap binds
    (8, 1.0, 5, 5),      # a cap below the need still binds
])
def test_round_size_by_hand(need, p, cap, want):
    assert round_size(need, p, cap) == want


def test_round_size_fills_in_one_round_at_least_five_times_in_six():
    """With the true rate p, P(Binomial(n, p) >= need) >= 5/6: exact binomial tails (math.comb)."""
    worst = 1.0
    for need in range(1, 33):
        for p in (0.05, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 0.99):
            n = round_size(need, p, 10_000)
            worst = min(worst, sum(math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(need, n + 1)))
    assert worst >= 5 / 6, f"one round fills the batch with probability {worst:.3f} at worst"


def _sampler(rounds_rewards):
    """A fake sampler: round k returns the first n of the given (·, G) rewards of round k, payloads
    'k:i'; .asked records the n of each call."""
    def sample_round(k, n):
        sample_round.asked.append(n)
        r = torch.tensor(rounds_rewards[k][:n], dtype=torch.float32)
        assert r.shape[0] == n, f"round {k}: asked for {n} groups, the script has {r.shape[0]}"
        return r.flatten(), [f"{k}:{i}" for i in range(n)]
    sample_round.asked = []
    return sample_round


def test_fill_batch_accumulates_until_full():
    """keep_rate 1 (no history): the first round draws exactly the 3 groups wanted and finds 1; the
    refill is sized from this step's rate so far, 1/3: round_size(2, 1/3, 12) = 11 (n - √(2n) >= 6:
    n = 10 gives 5.53, n = 11 gives 6.31), and keeps the first 2 of its 4 informative groups."""
    rounds = [[[1, 1], [0, 1], [0, 0]],
              [[0, 0], [1, 1], [1, 0], [0, 0], [1, 1], [0, 1], [1, 0], [0, 0], [0, 0], [1, 1], [0, 1]]]
    s = _sampler(rounds)
    out = fill_batch(s, target_groups=3, group_size=2, max_rounds=5)
    assert s.asked == [3, 11]
    assert out.full and out.rounds == 2 and out.sampled_groups == 14 and out.informative == 5
    assert out.groups == ["0:1", "1:2", "1:5"]
    assert out.rewards.tolist() == [0, 1, 1, 0, 0, 1]


def test_fill_batch_over_samples_and_fills_in_one_round():
    """keep_rate 0.8, 4 wanted: round_size(4, 0.8, 12) = 7 prompts; 5 of them informative, the 5th
    informative one is surplus."""
    s = _sampler([[[1, 0], [1, 1], [0, 1], [1, 0], [0, 0], [1, 0], [0, 1]]])
    out = fill_batch(s, target_groups=4, group_size=2, max_rounds=3, keep_rate=0.8)
    assert s.asked == [7]
    assert out.full and out.rounds == 1 and out.sampled_groups == 7 and out.informative == 5
    assert out.groups == ["0:0", "0:2", "0:3", "0:5"]
    assert out.rewards.tolist() == [1, 0, 0, 1, 1, 0, 1, 0]
    assert out.keep_rate == 5 / 7


def test_fill_batch_sizes_a_second_round_for_the_shortfall():
    """Round 0 draws 7 (keep_rate 0.8) and finds 2 informative; the refill is sized from this step's
    rate, 2/7: round_size(2, 2/7, 12 - 7) wants more than the 5 the budget leaves (n = 5: (10 - √50)/7
    < 2), so it draws 5, finds 3, keeps 2."""
    rounds = [[[1, 1], [0, 1], [0, 0], [1, 1], [1, 0], [0, 0], [1, 1]],
              [[0, 0], [1, 0], [0, 1], [1, 0], [1, 1]]]
    s = _sampler(rounds)
    out = fill_batch(s, target_groups=4, group_size=2, max_rounds=3, keep_rate=0.8)
    assert s.asked == [7, 5]
    assert out.full and out.rounds == 2 and out.sampled_groups == 12 and out.informative == 5
    assert out.groups == ["0:1", "0:4", "1:1", "1:2"]
    assert out.keep_rate == 5 / 12


def test_fill_batch_stops_at_max_rounds():
    """Budget 2 · 3 = 6: round 0 finds 1 of 3; the refill (rate 1/3) wants more than the 3 left, takes
    them and finds none."""
    rounds = [[[1, 1], [0, 1], [0, 0]], [[0, 0], [1, 1], [1, 1]], [[1, 0], [0, 1]]]
    s = _sampler(rounds)
    out = fill_batch(s, target_groups=3, group_size=2, max_rounds=2)
    assert s.asked == [3, 3]
    assert not out.full and out.rounds == 2 and out.groups == ["0:1"] and out.sampled_groups == 6
    empty = fill_batch(_sampler([[[1, 1]]]), target_groups=1, group_size=2, max_rounds=1)
    assert not empty.full and empty.groups == [] and empty.rewards.numel() == 0 and empty.informative == 0


def test_fill_batch_never_draws_more_than_max_rounds_times_target():
    """Budget 3 · 4 = 12 prompts. keep_rate 0.8: round 0 draws 7, none informative; the refill (rate 0
    so far) takes the 5 left; then the budget is spent with a round to spare."""
    rounds = [[[1, 1]] * 7, [[0, 0], [0, 1], [1, 1], [0, 0], [1, 1]], [[0, 1]] * 7]
    s = _sampler(rounds)
    out = fill_batch(s, target_groups=4, group_size=2, max_rounds=3, keep_rate=0.8)
    assert s.asked == [7, 5]
    assert not out.full and out.rounds == 2 and out.sampled_groups == 12 and out.groups == ["1:1"]
    # keep_rate 0.5 wants 12 for 4, budget 2 · 4 = 8: one round of 8; keep_rate 0 takes the budget too
    for rate, max_rounds in ((0.5, 2), (0.0, 3)):
        s = _sampler([[[0, 0]] * 7 + [[0, 1]] * 5])
        out = fill_batch(s, target_groups=4, group_size=2, max_rounds=max_rounds, keep_rate=rate)
        assert s.asked == [4 * max_rounds] and out.rounds == 1 and out.informative == 4 * max_rounds - 7


def test_fill_batch_refills_only_past_the_threshold():
    """threshold 0.5: a first round with 1 of 4 groups uninformative comes back whole (zero-variance
    group included, one round); with 3 of 4 uninformative it is refilled as DAPO does, by a round of
    the 8 left (rate 1/4 so far). With threshold 0 the first round's 3 informative groups are kept and
    round_size(1, 3/4, 8) = 3 more drawn (n = 2: 1.5 - 0.61 < 1; n = 3: 2.25 - 0.75 >= 1)."""
    mostly_signal = [[[1, 0], [0, 1], [1, 1], [1, 0]], [[0, 1], [1, 0], [0, 1], [1, 0]]]
    out = fill_batch(_sampler(mostly_signal), target_groups=4, group_size=2, max_rounds=3, threshold=0.5)
    assert out.full and out.rounds == 1 and out.groups == ["0:0", "0:1", "0:2", "0:3"]
    assert out.rewards.tolist() == [1, 0, 0, 1, 1, 1, 1, 0]
    mostly_none = [[[1, 1], [0, 0], [0, 0], [1, 0]], [[0, 1], [1, 0], [0, 1], [1, 0], [0, 0], [1, 1], [0, 1], [1, 0]]]
    out = fill_batch(_sampler(mostly_none), target_groups=4, group_size=2, max_rounds=3, threshold=0.5)
    assert out.full and out.rounds == 2 and out.groups == ["0:3", "1:0", "1:1", "1:2"]
    s = _sampler(mostly_signal)
    assert fill_batch(s, 4, 2, 3, threshold=0.0).groups == ["0:0", "0:1", "0:3", "1:0"] and s.asked == [4, 3]


@pytest.mark.parametrize("keep_rate, threshold, max_rounds, script, asked, informative, groups", [
    # 0.8 predicts 20% uninformative, under the threshold 0.5: the round draws the 4 it needs, not
    # round_size's 7, and with 1 of 4 uninformative comes back whole, unfiltered
    (0.8, 0.5, 3, [[1, 0], [1, 1], [0, 1], [1, 0], [0, 0], [1, 0], [0, 1]], 4, 3, [0, 1, 2, 3]),
    # 0.5 predicts a refill (1 - 0.5 >= 0.5): round_size(4, 0.5, 12) = 12 (n = 11: 5.5 - 1.66 < 4;
    # n = 12: 6 - 1.73 >= 4); 4 of 12 uninformative (< 0.5): no refill, the first 4 informative
    (0.5, 0.5, 3, [[1, 1], [0, 1], [0, 0], [1, 0], [1, 1], [0, 1], [1, 0], [0, 1], [1, 0], [1, 1], [0, 1], [1, 0]],
     12, 8, [1, 3, 5, 6]),
    # 0.05 draws the whole budget of 2 rounds x 4 at once; 5 of 8 uninformative is under 0.9: the 3
    # informative groups and the first zero-variance one, in sampling order
    (0.05, 0.9, 2, [[0, 0], [1, 0], [1, 1], [0, 0], [0, 1], [1, 1], [1, 0], [0, 0]], 8, 3, [0, 1, 4, 6]),
])
def test_fill_batch_threshold_over_samples_only_where_a_refill_is_predicted_and_keeps_signal_first(
        keep_rate, threshold, max_rounds, script, asked, informative, groups):
    """Where the first round has enough signal, the batch is its target groups with the most signal
    (informative first, then zero-variance ones), in sampling order; the first round is over-sampled
    only where keep_rate predicts a refill."""
    s = _sampler([script])
    out = fill_batch(s, target_groups=4, group_size=2, max_rounds=max_rounds, threshold=threshold, keep_rate=keep_rate)
    assert s.asked == [asked]
    assert out.full and out.rounds == 1 and out.sampled_groups == asked and out.informative == informative
    assert out.groups == [f"0:{i}" for i in groups]
    assert out.rewards.tolist() == [v for i in groups for v in script[i]]


def test_fill_batch_checks_payload_count():
    with pytest.raises(ValueError, match="payloads"):
        fill_batch(lambda k, n: (torch.tensor([0.0, 1.0]), ["a", "b"]), 1, 2, 1)
    with pytest.raises(ValueError, match="asked for 1 groups and returned 2"):
        fill_batch(lambda k, n: (torch.tensor([0.0, 1.0, 1.0, 1.0]), ["a", "b"]), 1, 2, 1)
