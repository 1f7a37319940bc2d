"""train.py: GRPO / DAPO post-training of an NVFP4 + LoRA policy with Adaptive Quantization Noise.

    python train.py --model Qwen/Qwen2.5-7B-Instruct --dataset gsm8k --output-dir runs/gsm8k

    import flags, train                                      # the same run from Python
    train.train(flags.config(model="Qwen/Qwen2.5-7B-Instruct", dataset=rows, reward=[my_reward]),
                callbacks=[MyCallback()])

One optimizer step (QeRL, arXiv 2510.11696, with the losses of grpo.py):

    σ_step  = aqn.sigma_at(step)                     noise level of this step's stage
    z       ~ N(0, σ_step²) per norm channel         drawn once, used by rollout and training
    rollout : P prompts × G samples from the model itself (rollout.py; NVFP4 base + live LoRA + z)
    reward  : Σ weight · term over the reward terms (reward_funcs.py: the guarded correctness check,
              functions of the user's) + DAPO overlong shaping; DAPO dynamic sampling drops groups
              whose G rewards are all equal and samples more prompts, each round over-sampled from the
              share of informative groups (grpo.round_size), so that one rollout usually fills P
    A       = grpo.advantages(r)                     one advantage per completion
    train   : log π_θ(completion) through the same model in micro-batches (gradient checkpointing,
              lm_head in chunks, never a (tokens × vocab) fp32 tensor for the whole batch), the
              clipped surrogate (+ k3 KL to the adapter-disabled model when β > 0), backward into
              the LoRA parameters only, μ AdamW steps per rollout

One model in memory: the sampler and the trainer are the same modules, so there is no weight sync, and
the only sampler/trainer mismatch is numerics (logged as `sampling/sampling_logp_difference/mean`): decode
vs dense attention, and on a bf16 base, where the plan keeps copies of the adapted weights, the adapters
merged into the weights while sampling (lora.merged_sampling, as TRL hands vLLM merged weights). The KV
cache is released before backward.

build_policy turns the flags into a `Policy`: the model with its adapters, AdamW and its schedule, the
grpo.GRPOConfig and aqn.AQNConfig of the flags, the sampler and the step plan. Each step
(`optimizer_step`) reads as the method's stages: the AQN noise of its stage, `rollout_step` (sample and
score the generation batch: `Group`s, one prompt with its G completions and their rewards), `train_step`
(advantages, the training forward and backward in micro-batches, AdamW); `train_loop` then evaluates,
and `end_step` logs, tells the callbacks and checkpoints. Steps count from 1 on screen, in metrics.jsonl
and in the checkpoints' names alike. Everything that can be refused (flags, datasets, reward functions)
is, before the model loads. `train(args, callbacks)` is the run for the command line (`main`) and for
Python (flags.config: the settings as keywords, rows in memory, reward functions; `Callback`).

What a run says rather than do silently: RewardWatch's warning when the rewards carry no signal for
steps on end; a step whose every update was skipped (a gradient not finite), and a stop after
MAX_IDLE_STEPS of them in a row, the last checkpoint intact; the updates applied beside the steps in
its last line; on Ctrl-C, where it stopped and how to continue; a run without progress for
--stall-timeout seconds (a GPU kernel or a collective that never returns), the last checkpoint, every
thread's stack and exit status 75 (watchdog.py); a finished run resumed, that it has nothing to do (a larger --max-steps extends it, its AQN schedule kept: --aqn-steps).

Around the loop: flags.py (the flags, --config, --resume, config()), checks.py (what each setting must
be), run_data.py (the checked datasets, prompts and reward functions), report.py (the progress line,
sampled completions, trackers, callbacks),
logprobs.py (the batch as training tensors, the chunked log-probs), plan.py (how a step uses the GPU's
memory: micro-batch sizes, recomputation, what stays resident), run_dir.py (run_config.json,
metrics.jsonl, plots.png, crash-safe checkpoints that --resume continues from) and distributed.py
(`torchrun --nproc-per-node N train.py ...`: ranks as replicas of one policy). Every random draw (data
order, AQN noise, sampling) is seeded from (seed, step), and a checkpoint carries the data position and
dynamic sampling's keep rate, so a resumed run samples what the uninterrupted run would have.

Left out here: a learning-rate decay schedule.
Tests: tests/test_train.py (2 steps, resume, eval on a tiny random model; a SIGKILL mid-run; the
Python API, callbacks, an extended run); tests/test_distributed.py (2 CPU processes over gloo give the
single-process update; two machines without a shared disk, killed and resumed); tests/test_probes.py
(Ctrl-C, skipped updates, bad flags and run files).
"""
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass

# The KV cache is freed before each backward and re-allocated for the next rollout: with the
# default allocator those differently sized blocks fragment the reserved memory (32B: 62.7 GiB
# reserved for 53.5 allocated). Expandable segments grow one mapping instead. Set before torch
# touches the GPU; an explicit setting in the environment wins.
if "PYTORCH_ALLOC_CONF" not in os.environ and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"

import torch
from tqdm import tqdm

import aqn
import checks
import grpo
import lora
import ops
import plan
import flags
import report
import reward_funcs
import reward_worker
import rewards
import rollout
import tasks
import watchdog
from checkpoint import build_model, load_model, random_init_config, save_pretrained
from report import Callback, notify  # noqa: F401 (Callback: train.Callback, the API's)
from run_data import PromptStream, load_prompts, step_seed
from eval import evaluate  # eval.py imports nothing from here
from flags import parse_args
from logprobs import collate, completion_logprobs, micro_batches
from distributed import (all_reduce_grads, barrier, check_ranks, dist_setup, from_rank0, gather, rank_times,
                         rank_world)
from run_dir import (BASE, CALIBRATION_PROMPTS, COMPLETIONS, METRICS, RUN_CONFIG, base_problem, last_checkpoint,
                     load_checkpoint, plot_metrics, prepare_output_dir, save_base, save_checkpoint, truncate_rows,
                     unlock_run_dir, write_atomic)

# ----------------------------------------------------------------------------------------------
# constants

MAX_IDLE_STEPS = 3   # steps in a row whose every update was skipped (non-finite gradients) before the run stops

# grpo.policy_loss metric -> the name TRL logs it under.
METRIC_NAMES = {"logprob_mismatch": "sampling/sampling_logp_difference/mean",
                "is_weight_mean": "sampling/importance_sampling_ratio/mean",
                "is_touched_frac": "sampling/importance_sampling_touched/mean"}


def clock(device) -> float:
    """Wall time after the device's queued work is done (honest step-time splits on CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def log(line: str) -> None:
    """A line above the progress bar, from rank 0 only."""
    if rank_world()[0] == 0:
        tqdm.write(line)


# ----------------------------------------------------------------------------------------------
# what a step works on


@dataclass
class Group:
    """One prompt and its G completions: the unit that advantages and dynamic sampling compare within."""
    example: object               # the tasks.Example the prompt came from (None for synthetic prompts)
    prompt_ids: list[int]
    completions: list             # G rollout.Completion: token ids, the sampler's log-probs, finish reason
    rewards: torch.Tensor         # (G,) float32: the weighted reward terms + DAPO overlong shaping


@dataclass
class Policy:
    """The policy being trained and everything a step needs to sample from it and update it (build_policy)."""
    model: torch.nn.Module        # the frozen base (NVFP4 or bf16) with trainable LoRA adapters
    optimizer: torch.optim.Optimizer                  # AdamW over the adapters
    scheduler: torch.optim.lr_scheduler.LRScheduler   # linear warm-up, then constant
    grpo_cfg: grpo.GRPOConfig     # the objective, group size and dynamic sampling
    aqn_cfg: aqn.AQNConfig        # the noise schedule
    engine: rollout.LLMEngine     # the sampler over the same modules: no weight sync
    step_plan: plan.StepPlan      # micro-batches, recomputation, what stays resident (plan.py)
    device: torch.device


@dataclass
class Rollout:
    """A step's generation batch and what was said of it: rollout_step's result."""
    groups: list                  # [Group] of every rank: the batch train_step trains on
    metrics: dict                 # time, tokens, sampling rounds, each reward term's mean, ...
    samples: list                 # this rank's completions as completions.jsonl rows: prompt, completion, reward, terms
    totals: list                  # reward_funcs.score's total for each completion of the step (every round, every rank)
    terms: dict                   # {term: its value for each of those completions (None: no opinion)}


# ----------------------------------------------------------------------------------------------
# the policy


def load_base(args, device, calibration: list | None):
    """The frozen base, quantized by --quantizer. GPTQ's codes depend on its calibration prompts
    (`calibration`: the run's first training prompts), so rank 0 saves that base in the run directory
    (run_dir.save_base), and a resumed run loads it from there, bit for bit, where its manifest records the
    same model and calibration; eval.py and export.py load an adapter's base from there too."""
    dtype = getattr(torch, args.dtype)
    fields = {}
    if args.quantizer == "gptq":
        fields = {"model": args.model, "quantizer": args.quantizer,
                  "calibration": hashlib.sha256(json.dumps(calibration).encode()).hexdigest()}
        if base_problem(args.output_dir, **fields) is None:
            log(f"the base: {os.path.join(args.output_dir, BASE)} (saved by this run)")
            return load_model(os.path.join(args.output_dir, BASE), quant="nvfp4", device=device,
                              dtype=dtype)
    kw = {"quant": args.quant, "device": device, "dtype": dtype, "quantizer": args.quantizer,
          "calibration": calibration}
    if args.random_init:
        model = build_model(random_init_config(args.model), seed=args.seed, **kw)
    else:
        model = load_model(args.model, **kw)
    if fields and rank_world()[0] == 0:
        log(f"the base saved: {save_base(args.output_dir, lambda d: save_pretrained(model, d), **fields)}")
    return model


def build_policy(args, device, calibration: list | None = None) -> Policy:
    """The flags -> the Policy: the model with LoRA adapters, AdamW, the schedule, the objective's and the
    noise's configs, the sampler and the step plan. calibration: GPTQ's token ids (--quantizer gptq).
    bench/step.py builds its policy here too, so it measures the step this file runs. The plan (plan.py)
    measures what a token of the training pass costs on this device."""
    gcfg, acfg = flags.to_config(args, grpo.GRPOConfig), flags.to_config(args, aqn.AQNConfig)
    try:
        model = load_base(args, device, calibration)
    except (OSError, ValueError) as e:  # offline, a damaged checkpoint, a model that does not fit
        raise SystemExit(f"error: --model: {tasks.load_problem(args.model, e)}") from None
    try:
        lora.apply_lora(model, flags.to_config(args, lora.LoRAConfig), generator=torch.Generator().manual_seed(args.seed))
    except ValueError as e:  # a target name that matches no linear of this model
        raise SystemExit(f"error: --lora-target-modules: {e}") from None
    params = lora.lora_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1)))
    eval_new = args.eval_max_new_tokens or args.max_new_tokens
    # as many sequences at once as the largest decode graph takes: an over-sampled round decodes in one wave
    engine = rollout.LLMEngine(model, max_model_len=args.max_prompt_len + max(args.max_new_tokens, eval_new),
                               gpu_memory_utilization=args.gpu_memory_utilization,
                               max_num_seqs=rollout.MAX_GRAPH_BATCH)

    def fwd_bwd(ids, prompt_lens, comp_lens):  # the training pass on one micro-batch, for the memory probe
        completion_logprobs(model, ids, prompt_lens, comp_lens, args.temperature, args.logprob_chunk)[0].sum().backward()
    model.train()
    step_plan = plan.make_plan(model, fwd_bwd, args.max_prompt_len + args.max_new_tokens, args.micro_batch,
                               args.grad_checkpointing, sum(p.numel() for p in params), device)
    model.eval()
    return Policy(model, optimizer, scheduler, gcfg, acfg, engine, step_plan, device)


# ----------------------------------------------------------------------------------------------
# the two stages of a step: rollout_step, train_step


def rollout_step(step: int, policy: Policy, stream: PromptStream, noise: dict, tokenizer, args):
    """The step's generation batch: P prompts × G samples from the policy under the AQN noise, each
    completion scored (reward_funcs.score: the weighted reward terms, + DAPO overlong shaping). With
    dynamic sampling, groups whose G rewards are all equal are dropped and more prompts sampled
    (grpo.fill_batch): each round takes the next n prompts of the stream, n sized by grpo.round_size from
    the share of informative groups (for the first round stream.keep_rate, the previous step's: 1.0 at the
    first step; for a refill this step's so far), so that one round usually fills the batch; the stream
    then keeps this step's rate for the next. Each rank samples every world-th of a round's prompts (n
    need not divide by world); every rank returns the whole batch, and computes the next rate from the
    gathered rewards, so all size their rounds alike. The KV cache (and the CUDA graphs that point into
    it) stays for the next step where it takes at most the step plan's keep_cache_bytes, else it is
    freed for the training pass. -> a Rollout: the groups, the metrics, this rank's samples and the whole
    step's reward totals and terms (every round's, every rank's: what RewardWatch reads)."""
    rank, world = rank_world()
    per_rank = f"/rank{rank}" if world > 1 else ""   # the ranks' own streams (AQN noise is the same on all)
    gcfg, G = policy.grpo_cfg, policy.grpo_cfg.group_size
    stats, completions, samples, totals_all, terms_all = rewards.RewardStats(), [], [], [], {}

    def sample_prompts(r, idx):  # round r on this rank's prompts -> (their rewards (len(idx)·G,), groups)
        sp = rollout.SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_new_tokens,
                                    n=G, seed=step_seed(args.seed, step, f"sample{r}{per_rank}"))
        with aqn.noise_applied(policy.model, noise), lora.merged_sampling(policy.model):
            comps = policy.engine.generate([stream.ids[i] for i in idx], sp)
        flat = [c for cs in comps for c in cs]                                    # prompt-major, G per prompt
        texts = tokenizer.batch_decode([c.token_ids for c in flat], skip_special_tokens=True)
        examples = [stream.examples[i] for i, cs in zip(idx, comps) for _ in cs]
        with watchdog.paused("the rewards"):   # each call bounded by --reward-timeout instead
            totals, terms = reward_funcs.score(stream.funcs, examples, texts, stats,
                                               completion_ids=[c.token_ids for c in flat],
                                               timeout_s=args.reward_timeout, format_weight=args.format_weight)
        rs = torch.tensor(totals, dtype=torch.float32)                            # (len(idx)·G,)
        shaped = rs
        if gcfg.overlong_cache_len:  # DAPO overlong shaping: part of the reward, not of the filter
            lens = torch.tensor([len(c.token_ids) for c in flat])
            shaped = rs + grpo.overlong_penalty(lens, gcfg.max_completion_len, gcfg.overlong_cache_len)
        totals_all.extend(totals)
        for name, values in terms.items():
            terms_all.setdefault(name, []).extend(values)
        samples.extend({"prompt": e.prompt, "answer": e.answer, "completion": t, "reward": round(float(v), 6),
                        **{f"rewards/{name}": values[j] for name, values in terms.items()}}
                       for j, (e, t, v) in enumerate(zip(examples, texts, shaped)))
        return rs, [Group(stream.examples[i], stream.ids[i], cs, shaped[k * G:(k + 1) * G])
                    for k, (i, cs) in enumerate(zip(idx, comps))]

    def sample_round(r, n):  # this rank's share of the next n prompts; returns every rank's groups
        idx = stream.take(n)[rank::world]
        parts = gather(sample_prompts(r, idx) if idx else (torch.zeros(0), []))   # n < world: a rank may get none
        groups = [g for _, gs in parts for g in gs]
        completions.extend(c for g in groups for c in g.completions)
        return torch.cat([r for r, _ in parts]), groups

    t0 = time.perf_counter()
    rounds, prompts, sizing = 1, args.prompts_per_step, {}
    if gcfg.dynamic_sampling:
        filled = grpo.fill_batch(sample_round, args.prompts_per_step, G, gcfg.max_sampling_rounds,
                                 tol=gcfg.dynamic_sampling_tol, threshold=gcfg.dynamic_sampling_threshold,
                                 keep_rate=stream.keep_rate)
        groups, rounds, prompts = filled.groups, filled.rounds, filled.sampled_groups
        sizing, stream.keep_rate = {"sampling/keep_rate": stream.keep_rate}, filled.keep_rate  # this step's; the next's
    else:
        groups = sample_round(0, prompts)[1]
    if policy.engine.cache_bytes() > policy.step_plan.keep_cache_bytes:
        policy.engine.free_cache(keep_warm=True)  # the KV cache goes before the backward pass needs the memory
    t_rollout = time.perf_counter() - t0
    new_tokens = sum(len(c.token_ids) for c in completions)   # of all ranks
    parts = gather((totals_all, terms_all))  # every rank's scores, in rank order: the whole step's
    totals, terms = [t for p, _ in parts for t in p], {k: [v for _, p in parts for v in p[k]] for k in terms_all}
    metrics = {"time/rollout": t_rollout, "rollout/tokens_per_s": new_tokens / t_rollout, "sampling/rounds": rounds,
               "sampling/prompts": prompts, **sizing, **reward_metrics(stats, totals, terms, completions, G)}
    return Rollout(groups, metrics, samples, totals, terms)


def reward_metrics(stats: rewards.RewardStats, totals: list, terms: dict, completions: list,
                   group_size: int) -> dict:
    """A rollout's reward records over all ranks: the mean reward of everything sampled (the reward
    functions' totals before overlong shaping, every round, kept or not; dynamic sampling keeps the groups
    with a spread, so their mean, optimizer_step's `reward/kept`, sits near the middle whether the policy
    solves 10% or 90% of its prompts), the groups' spread and the share of groups without one, the reward
    functions' errors and timeouts, each term's mean over the completions it scored (None: no opinion),
    the completions' mean length and the share cut at the length limit. stats are this rank's; totals
    (prompt-major, group_size a prompt), terms and completions are every rank's."""
    errors, timeouts = map(sum, zip(*gather((stats.errors, stats.timeouts))))
    found = {name: [v for v in values if v is not None] for name, values in terms.items()}
    rg = torch.tensor(totals, dtype=torch.float64).view(-1, group_size)                # (prompts, G)
    return {"reward": rg.mean().item(), "reward_std": rg.std(1).mean().item(),
            "frac_reward_zero_std": (rg.std(1) == 0).double().mean().item(),
            "reward_errors": errors, "reward_timeouts": timeouts,
            **{f"rewards/{name}/mean": sum(vs) / len(vs) for name, vs in found.items() if vs},
            "completions/mean_length": sum(len(c.token_ids) for c in completions) / len(completions),
            "completions/clipped_ratio": sum(c.finish_reason == "length" for c in completions) / len(completions)}


def training_batch(groups: list[Group], gcfg: grpo.GRPOConfig, pad_id: int, device) -> tuple[dict, torch.Tensor, int]:
    """The generation batch as training tensors (logprobs.collate) with each completion's advantage `adv`
    (B,) and loss `mask` (B, L), cut to this rank's groups. -> (this rank's rows, the whole batch's active
    completion tokens (all ranks: dapo's num_items), B: the whole batch's completions)."""
    batch = collate(groups, pad_id, device)
    scores = torch.cat([g.rewards for g in groups])                                        # (B,)
    adv = grpo.advantages(scores, gcfg.group_size, gcfg.scale_rewards).to(device)          # (B,)
    L = int(batch["comp_lens"].max())
    mask = grpo.completion_mask(batch["comp_lens"], L, batch["truncated"] if gcfg.mask_truncated else None)
    batch["adv"], batch["mask"] = adv, mask
    rank, world = rank_world()
    lo, hi = (len(groups) * r // world * gcfg.group_size for r in (rank, rank + 1))       # this rank's groups
    return {k: v[lo:hi] for k, v in batch.items()}, mask.sum(), adv.shape[0]


def logprobs_no_grad(model, batch: dict, spans: list, args) -> dict:
    """{micro-batch start: log π (rows, L)} without a graph, once per rollout in eval mode (no dropout): the
    reference policy's (β > 0) or the policy that sampled (μ > 1)."""
    with torch.no_grad():
        return {s: completion_logprobs(model, mb["input_ids"], mb["prompt_lens"], mb["comp_lens"],
                                       args.temperature, args.logprob_chunk)[0]
                for s, mb in micro_batches(batch, spans)}


def train_step(policy: Policy, groups: list[Group], noise: dict, pad_id: int, args) -> dict:
    """Advantages, μ updates over micro-batches, AdamW steps. Returns the step's training metrics.
    groups: the whole generation batch (every rank's, as rollout_step returns it); each rank trains on its
    slice, in the micro-batches of the policy's step plan."""
    model, optimizer, gcfg, device = policy.model, policy.optimizer, policy.grpo_cfg, policy.device
    t0 = clock(device)
    times = {"time/logprob_pass": 0.0, "time/forward_backward": 0.0, "time/optimizer": 0.0}
    batch, tokens, B = training_batch(groups, gcfg, pad_id, device)
    num_items = tokens.clamp(min=1)  # DAPO: active tokens of the whole batch (all ranks)
    spans = plan.micro_batches((batch["prompt_lens"] + batch["comp_lens"]).tolist(), policy.step_plan)
    n_mb, world = len(spans), rank_world()[1]
    train_noise = {} if policy.aqn_cfg.rollout_only else noise
    sums, count, skipped, ref = {}, 0, 0, {}
    model.eval()
    if gcfg.beta > 0:  # the reference policy: the base model, adapters off, no AQN noise
        with lora.adapters_disabled(model):
            ref = logprobs_no_grad(model, batch, spans, args)
    with aqn.noise_applied(model, train_noise), plan.dense_weights(model, policy.step_plan.dense_weights):
        old = logprobs_no_grad(model, batch, spans, args) if gcfg.updates_per_rollout > 1 else {}  # the sampler's
        model.train()
        t1 = clock(device)
        times["time/logprob_pass"] = t1 - t0
        for _ in range(gcfg.updates_per_rollout):
            optimizer.zero_grad(set_to_none=True)
            for s, mb in micro_batches(batch, spans):
                Lm, rows = mb["sampler_logp"].shape[1], mb["adv"].shape[0]
                logp, ent = completion_logprobs(model, mb["input_ids"], mb["prompt_lens"], mb["comp_lens"],
                                                args.temperature, args.logprob_chunk)
                loss, met = grpo.policy_loss(logp, old.get(s), mb["adv"], mb["mask"][:, :Lm], gcfg,
                                             ref_logp=ref.get(s), sampler_logp=mb["sampler_logp"],
                                             num_items=num_items, entropy=ent)
                w = grpo.micro_batch_weight(gcfg, rows, B, n_mb * world)   # its share of the whole batch
                (loss * w).backward()
                met = {METRIC_NAMES.get(k, k): v for k, v in met.items() if k != "num_tokens"}
                for k, v in {"loss": loss.detach() * w, **met}.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * (1.0 if k == "loss" else rows / B)
                watchdog.beat("a training micro-batch")   # float(v) waited for its backward
            t2 = clock(device)
            times["time/forward_backward"] += t2 - t1
            all_reduce_grads(lora.lora_parameters(model))  # then every rank holds the same gradient
            grad_norm = torch.nn.utils.clip_grad_norm_(lora.lora_parameters(model), args.max_grad_norm)
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:  # never write NaN/Inf into the adapters: skip the update and say so
                skipped += 1
            policy.scheduler.step()
            count += 1
            watchdog.beat("an optimizer update")
            t1 = clock(device)
            times["time/optimizer"] += t1 - t2
    model.eval()
    keys = sorted(sums)  # each rank's metrics are its share of the global mean: sum them
    out = {k: sum(part) / count for k, part in zip(keys, zip(*gather([sums[k] for k in keys])))}
    out.update({"grad_norm": float(grad_norm), "learning_rate": policy.scheduler.get_last_lr()[0],
                "num_tokens": int(tokens), "skipped_nonfinite_updates": skipped, "micro_batches": n_mb,
                "time/train": clock(device) - t0, **times})
    return out


# ----------------------------------------------------------------------------------------------
# one step of the method


def optimizer_step(step: int, policy: Policy, stream: PromptStream, tokenizer, args) -> tuple[dict, Rollout]:
    """One step of the method (step counts from 0 here, in the seeds): the AQN noise of the step's stage,
    rollout_step, train_step (skipped when dynamic sampling kept fewer groups than there are ranks) ->
    (its metrics, the Rollout)."""
    world = rank_world()[1]
    per_rank = f"/rank{rank_world()[0]}" if world > 1 else ""
    torch.manual_seed(step_seed(args.seed, step, "torch" + per_rank))  # LoRA dropout: the same after a resume
    sigma = aqn.sigma_at(step, args.aqn_steps, policy.aqn_cfg)  # past --aqn-steps: the last stage's
    noise = aqn.sample_noise(policy.model, sigma, torch.Generator().manual_seed(step_seed(args.seed, step, "aqn")))
    try:
        ro = rollout_step(step, policy, stream, noise, tokenizer, args)
    except reward_funcs.RewardError as e:  # the user's reward function: its own line, no traceback
        raise SystemExit(f"error: at step {step + 1}: {e}") from None
    m = {"aqn/sigma": sigma, **ro.metrics}
    if len(ro.groups) < world:  # dynamic sampling kept no informative group (or fewer than ranks)
        return {**m, "skipped": True}, ro
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    m.update(train_step(policy, ro.groups, noise, pad_id, args))
    if policy.grpo_cfg.dynamic_sampling:  # what the loss trained on (without it, every group: reward)
        m["reward/kept"] = torch.cat([g.rewards for g in ro.groups]).mean().item()
    return m, ro


def evaluate_policy(policy: Policy, tokenizer, eval_set: list, args) -> dict:
    """Greedy accuracy on eval_set, each rank answering every world-th question."""
    rank, world = rank_world()
    params = rollout.SamplingParams(temperature=0.0, max_tokens=args.eval_max_new_tokens or args.max_new_tokens)
    with lora.merged_sampling(policy.model):
        _, recs = evaluate(policy.engine, tokenizer, eval_set[rank::world], params, system_prompt=args.system_prompt,
                           chat_template_kwargs=args.chat_template_kwargs, progress=rank == 0)
    hits = gather((sum(sum(r["scores"]) for r in recs), sum(len(r["scores"]) for r in recs)))
    return {"eval/accuracy": sum(h for h, _ in hits) / max(1, sum(n for _, n in hits))}


# ----------------------------------------------------------------------------------------------
# the run


@dataclass
class RunState:
    """Where a run stands and who hears of it: train_loop's state, which train reports from."""
    step: int                          # steps done (a resumed run starts at its checkpoint's)
    updates: int                       # optimizer updates applied: AdamW's own count, a skipped one not counted
    callbacks: list                    # [Callback]: told of step ends, evaluations and saves (rank 0)
    tracker: report.Tracker            # --report-to's trackers
    watch: reward_funcs.RewardWatch    # says when the rewards carry no signal, step after step
    idle: int = 0                      # steps in a row whose every update was skipped (a non-finite gradient)
    last_eval: dict | None = None      # the last evaluation: {"eval/accuracy", "eval/step", "eval/updates"}


def applied_updates(optimizer) -> int:
    """The optimizer updates applied so far: AdamW's count, which a checkpoint carries and a skipped update
    (a non-finite gradient) does not raise."""
    state = next(iter(optimizer.state.values()), None)
    return int(state["step"]) if state else 0


def train_loop(args, policy: Policy, stream: PromptStream, tokenizer, eval_set: list, state: RunState) -> None:
    """Steps state.step + 1 .. --max-steps (or --stop-at): each optimizer_step, then its evaluation when due,
    and end_step's records and checkpoint. The bar counts the steps done: it ends at N/N."""
    rank = rank_world()[0]
    initial = {}
    if eval_set and args.eval_every and state.step == 0:  # the starting point of the learning curve
        initial = {"eval/accuracy_initial": evaluate_policy(policy, tokenizer, eval_set, args)["eval/accuracy"]}
        log(f"eval accuracy before training: {initial['eval/accuracy_initial']:.4f} ({len(eval_set)} questions)")
        if rank == 0:
            with watchdog.paused("the first evaluation's callbacks"):
                notify(state.callbacks, "on_evaluate", 0, {"eval/accuracy": initial["eval/accuracy_initial"]})
    bar = tqdm(total=args.max_steps, initial=state.step, desc="train", disable=rank > 0)
    try:
        for step in range(state.step, args.max_steps):
            t_step = time.perf_counter()
            m, ro = optimizer_step(step, policy, stream, tokenizer, args)
            state.step, state.updates = step + 1, applied_updates(policy.optimizer)
            m = {"step": step + 1, **(initial if step == 0 else {}), **m}
            if eval_set and ((args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == args.max_steps):
                m.update(evaluate_policy(policy, tokenizer, eval_set, args), **{"eval/updates": state.updates})
                state.last_eval = {"eval/accuracy": m["eval/accuracy"], "eval/step": step + 1,
                                   "eval/updates": state.updates}
            m["step_time"] = time.perf_counter() - t_step
            m.update(rank_times(m))  # each rank's rollout, training and waiting time (distributed.py)
            if policy.device.type == "cuda":
                m["memory/peak_gib"] = torch.cuda.max_memory_allocated(policy.device) / 2 ** 30
                torch.cuda.reset_peak_memory_stats(policy.device)
            bar.update()
            bar.set_postfix(reward=f"{m.get('reward', float('nan')):.3f}", sigma=f"{m['aqn/sigma']:.1e}",
                            zero_std=f"{m.get('frac_reward_zero_std', float('nan')):.2f}")   # groups without signal
            if end_step(args, policy, stream, state, m, ro):
                break
    finally:
        bar.close()


def end_step(args, policy: Policy, stream: PromptStream, state: RunState, m: dict, ro: Rollout) -> bool:
    """A step's end: the reward watch's warnings and a step whose every update was skipped said on screen,
    the records and callbacks (rank 0), the checkpoint when due; MAX_IDLE_STEPS such steps in a row stop
    the run before it saves, the last checkpoint intact. -> whether the run stops after this step."""
    rank, world = rank_world()
    step, stop = m["step"], m["step"] in (args.max_steps, args.stop_at)
    for line in state.watch.update(step, ro.totals, ro.terms):
        log(line)
    if m.get("skipped_nonfinite_updates", 0) == policy.grpo_cfg.updates_per_rollout:
        state.idle += 1
        log(f"warning: step {step}: every update was skipped, the gradient not finite (NaN or Inf): the adapters "
            f"did not change")
    elif not m.get("skipped"):
        state.idle = 0
    if rank == 0:
        with watchdog.paused(f"step {step}'s records"):   # trackers and callbacks: not the run's own code
            report.record(args, m, ro.samples, state.tracker, stop)
            notify(state.callbacks, "on_step_end", step, m)
            if "eval/accuracy" in m:
                notify(state.callbacks, "on_evaluate", step, {k: v for k, v in m.items() if k.startswith("eval/")})
    if state.idle >= MAX_IDLE_STEPS:
        raise SystemExit(f"error: steps {step - MAX_IDLE_STEPS + 1}-{step} skipped every update, their gradients "
                         f"not finite (NaN or Inf), so the run stops; {last_checkpoint(args.output_dir)}. Lower "
                         f"--lr or --max-grad-norm, or look at the rewards and losses in metrics.jsonl")
    if (step % args.save_every == 0 or stop) and rank == 0:  # the replicas are identical
        path = save_checkpoint(args.output_dir, step, policy.model, policy.optimizer, policy.scheduler,
                               stream.position, args.model, args.keep_checkpoints, stream.keep_rate)
        with watchdog.paused(f"step {step}'s checkpoint"):
            notify(state.callbacks, "on_save", step, path)
    barrier()  # rank 0 has finished the checkpoint before any rank goes on
    return stop


def start_policy(args, device, resume_from: str | None, world: int) -> tuple:
    """The data, the policy, run_config.json (written once, by rank 0) and the checkpoint resumed from ->
    (tokenizer, the PromptStream, the eval examples, the Policy, the step the run starts after)."""
    tokenizer, stream, eval_set = load_prompts(args, log)
    t0 = time.perf_counter()
    log(f"loading {args.model} ({'random init, ' if args.random_init else ''}{args.quant}) on {device} ...")
    calibration = stream.first_ids(CALIBRATION_PROMPTS) if args.quantizer == "gptq" else None
    policy = build_policy(args, device, calibration)
    log(f"loaded in {time.perf_counter() - t0:.1f} s; {plan.describe(policy.step_plan)}")
    line, slow = ops.describe(device)                  # which fast paths run here, and any that cannot
    log(line)
    for w in slow:
        log(f"warning: {w}")
    if rank_world()[0] == 0 and not os.path.exists(os.path.join(args.output_dir, RUN_CONFIG)):
        record = {**flags.record(args), "world_size": world, "step_plan": policy.step_plan.as_dict(),
                  "reward_sources": reward_funcs.record(stream.funcs)}
        write_atomic(os.path.join(args.output_dir, RUN_CONFIG), json.dumps(record, indent=2))
    start = 0
    with from_rank0(resume_from) as ckpt:  # rank 0's checkpoint, sent to ranks on machines without its disk
        if ckpt:
            state = load_checkpoint(ckpt, policy.model, policy.optimizer, policy.scheduler, args.model)
            start, stream.position, stream.keep_rate = state["step"], state["data_pos"], state["keep_rate"]
            log(f"resumed from {resume_from} at step {start}")
    if rank_world()[0] == 0:
        for name in (METRICS, COMPLETIONS):
            truncate_rows(args.output_dir, name, start)
    return tokenizer, stream, eval_set, policy, start


def check_start(args, start: int) -> None:
    """A --stop-at at or below the step the run resumes after is refused before anything loads (the run
    would train on to --max-steps)."""
    if args.stop_at is not None and args.stop_at <= start:
        raise SystemExit(f"error: --stop-at {args.stop_at} is not after step {start}, where the run in "
                         f"{args.output_dir} resumes")


def deterministic() -> None:
    """--deterministic: every op that has a deterministic implementation uses it, and one without one is
    an error rather than a silent difference (torch.use_deterministic_algorithms; cuBLAS needs a fixed
    workspace, set before its first call). The rest of a step is deterministic already: every draw is
    seeded by (seed, step), and qerl's kernels sum their split-K partials in a fixed order. Without it, some
    of PyTorch's GPU ops (attention's backward among them) may add partial results with atomics, in
    whatever order the threads arrive: the same seed then gives runs that drift apart in the last bits,
    and RL's sampling turns those bits into other completions."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


def train(args, callbacks=()) -> dict:
    """Train as args says (flags.parse_args of a command line, or flags.config in Python); callbacks are
    Callback objects, told of step ends, evaluations and saves. -> {"step": steps done, "updates": optimizer
    updates applied, "output_dir", and the last evaluation's "eval/accuracy", "eval/step", "eval/updates"}.
    A resumed run that has done its --max-steps says so and returns at once, nothing loaded ("updates":
    None): resuming a finished run is safe to repeat. Ctrl-C says where the run stopped and how to
    continue it, then raises KeyboardInterrupt."""
    if os.environ.get(reward_worker.WORKER_ENV):
        raise SystemExit("error: train.train was called in a reward worker, which imported a script that defines "
                         "reward functions: keep the script's training under `if __name__ == \"__main__\":`")
    if args.deterministic:
        deterministic()
    rank, world, device = dist_setup(args.device)
    log(json.dumps(flags.record(args), indent=None))
    resume_from = prepare_output_dir(args, write=rank == 0)
    state = None
    try:
        start = check_ranks(flags.record(args), resume_from)  # same flags everywhere; rank 0's step
        check_start(args, start)
        if start >= args.max_steps:
            log(f"the run in {args.output_dir} has done {start} steps, and --max-steps is {args.max_steps}: nothing "
                f"to do (a larger --max-steps extends it; an extended run takes it again at each resume)")
            return {"step": start, "updates": None, "output_dir": args.output_dir}
        tokenizer, stream, eval_set, policy, start = start_policy(args, device, resume_from, world)
        tracker = report.Tracker(args.report_to if rank == 0 else "none", args.output_dir, flags.record(args))
        state = RunState(start, applied_updates(policy.optimizer), list(callbacks), tracker, reward_funcs.RewardWatch())
        try:
            with watchdog.watching(args.stall_timeout, lambda: how_to_continue(args.output_dir)):
                train_loop(args, policy, stream, tokenizer, eval_set, state)
        finally:
            tracker.close()
        if rank == 0:
            plot_metrics(args.output_dir)
    except (KeyboardInterrupt, torch.AcceleratorError) as e:  # Ctrl-C; a CUDA error (a kernel's trap among them)
        if rank == 0:
            at = f"during step {state.step + 1}" if state else "before training began"
            what = "interrupted" if isinstance(e, KeyboardInterrupt) else f"the GPU failed ({str(e).splitlines()[0]})"
            print(f"{what} {at}: {how_to_continue(args.output_dir)}", file=sys.stderr)
        raise
    finally:
        if rank == 0:
            unlock_run_dir(args.output_dir)  # the OS would at exit; a second run in this process may follow
    return finish(args, state, eval_set)


def how_to_continue(out: str) -> str:
    """The last checkpoint of the run in `out`, and the command that resumes from it."""
    return f"{last_checkpoint(out)}; continue with: python train.py --resume {out}"


def finish(args, state: RunState, eval_set: list) -> dict:
    """The run's last lines and its summary (train's result)."""
    if state.last_eval:
        e = state.last_eval
        log(f"eval accuracy after {e['eval/step']} steps ({e['eval/updates']} updates): {e['eval/accuracy']:.4f} "
            f"({len(eval_set)} questions of {checks.eval_source(args)[0]} [{args.eval_split}])")
    if state.updates == 0:
        log("warning: no update was applied (each step skipped): the adapters are as they started")
    log(f"done: {args.output_dir}")
    if rank_world()[1] > 1:
        torch.distributed.destroy_process_group()
    return {"step": state.step, "updates": state.updates, "output_dir": args.output_dir, **(state.last_eval or {})}


def main(argv=None):
    """The command line: its flags (flags.parse_args), then train. Ctrl-C ends it with exit code 130."""
    args = parse_args(argv)
    try:
        return train(args)
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
