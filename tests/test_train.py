"""train.py and eval.py end to end on a tiny random model (CPU), plus the pieces they own.

The tiny model is a random 2-layer Llama written by transformers, with the real SmolLM2 tokenizer
(so chat templates and decoding are the real thing). References: a dense full-vocab log-softmax
for the chunked log-probs; one big batch for the micro-batched gradient.
"""
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import eval as qeval
import lora
import reward_funcs
import run_dir
import train
from checkpoint import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A random model's rewards are all 0: dynamic sampling would keep no group. --lora-rank stays last.
FAST = ["--no-dynamic-sampling", "--dataset", "addition", "--group-size", "4", "--prompts-per-step", "2",
        "--max-new-tokens", "8", "--eval-limit", "4", "--dtype", "float32", "--micro-batch", "4", "--lora-rank", "4"]


def make_tiny_model(tokenizer_dir: str, path: str) -> str:
    """Write a random 2-layer Llama (SmolLM2's vocab and tokenizer) to path; return path."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(tokenizer_dir, f)):
            shutil.copy(os.path.join(tokenizer_dir, f), path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_model(smollm2_tokenizer, tmp_path_factory):
    return make_tiny_model(smollm2_tokenizer, str(tmp_path_factory.mktemp("tiny") / "model"))


def make_groups(n_groups: int, seed: int) -> list:
    """n_groups fake rollout groups of G = 4 random completions (lengths 2..5, the last one truncated),
    without rewards (with_rewards gives them theirs)."""
    from rollout import Completion
    torch.manual_seed(seed)
    groups = []
    for g in range(n_groups):
        prompt = torch.randint(0, 49152, (4 + g,)).tolist()
        comps = [Completion(g, i, torch.randint(0, 49152, (2 + i,)).tolist(), [-1.0] * (2 + i),
                            "length" if i == 3 else "stop") for i in range(4)]
        groups.append(train.Group(None, prompt, comps, None))
    return groups


def with_rewards(groups: list, rewards) -> list:
    """The groups, each with its G = 4 of rewards (P·G,)."""
    return [dataclasses.replace(g, rewards=rewards[4 * i:4 * (i + 1)]) for i, g in enumerate(groups)]


def tiny_policy(model, optimizer, gcfg, micro_batch: int, device="cpu") -> train.Policy:
    """A train.Policy around a test's model and optimizer: a constant schedule, default AQN, no sampler,
    micro-batches of micro_batch completions."""
    import aqn
    import plan
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    step_plan = plan.StepPlan(micro_batch, None, False, False, False, 0, "pinned by the test")
    return train.Policy(model, optimizer, sched, gcfg, aqn.AQNConfig(), None, step_plan, torch.device(device))


def adapted_model(model_dir: str, quant: str = "nvfp4", seed: int = 0):
    """The tiny model (fp32, CPU) with r=4 LoRA adapters whose B is random, so they matter."""
    model = load_model(model_dir, quant=quant, dtype=torch.float32, device="cpu")
    lora.apply_lora(model, lora.LoRAConfig(r=4, alpha=8), generator=torch.Generator().manual_seed(seed))
    for m in lora.lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B, generator=torch.Generator().manual_seed(seed + 1), std=0.05)
    return model


def lora_update(model_dir: str, groups: list, rewards, loss_type: str, micro_batch: int,
                device="cpu") -> tuple[list, dict]:
    """One train_step (SGD, lr 1, no clipping) from a fixed adapter: (parameter change = gradient, metrics)."""
    import argparse
    import grpo
    torch.manual_seed(3)
    model = adapted_model(model_dir, quant="bf16").to(device)
    params = lora.lora_parameters(model)
    opt = torch.optim.SGD(params, lr=1.0)
    before = [p.detach().clone() for p in params]
    args = argparse.Namespace(temperature=1.0, logprob_chunk=5, max_grad_norm=1e9)
    gcfg = grpo.GRPOConfig(group_size=4, loss_type=loss_type, max_completion_len=8)
    policy = tiny_policy(model, opt, gcfg, micro_batch, device)
    met = train.train_step(policy, with_rewards(groups, rewards), {}, 0, args)
    return [(b - p.detach()).cpu() for b, p in zip(before, params)], met


def read_metrics(out):
    with open(os.path.join(out, run_dir.METRICS)) as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------------------------
# end to end


def test_train_resume_then_eval(tiny_model, tmp_path, capsys):
    out = str(tmp_path / "run")
    run = ["--model", tiny_model, "--output-dir", out, "--max-steps", "3", "--save-every", "1", *FAST]
    train.main([*run, "--stop-at", "2"])
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    assert open(os.path.join(out, run_dir.LATEST)).read() == "checkpoint-000002"
    first = read_metrics(out)
    for key in ("reward", "loss", "entropy", "grad_norm", "completions/mean_length", "aqn/sigma",
                "sampling/sampling_logp_difference/mean", "clip_ratio/region_mean", "time/rollout",
                "time/forward_backward"):
        assert key in first[1], f"metric {key} missing: {sorted(first[1])}"
    # fp32 CPU: the sampler's log-probs and the trainer's agree to rounding (one engine, one model)
    assert first[0]["sampling/sampling_logp_difference/mean"] < 1e-4, first[0]

    train.main([*run, "--resume"])
    rows = read_metrics(out)
    assert [m["step"] for m in rows] == [1, 2, 3]
    assert rows[:2] == first, "resume must not rewrite the steps before the checkpoint"
    assert os.path.exists(os.path.join(out, "plots.png"))
    ckpt = os.path.join(out, "checkpoint-000003")
    state = torch.load(os.path.join(ckpt, run_dir.TRAINER_STATE), weights_only=True)
    assert state["step"] == 3 and state["data_pos"] == 3 * 2

    # The adapter is a real PEFT adapter: load it into a fresh model and evaluate with eval.py.
    capsys.readouterr()
    metrics = qeval.main(["--model", tiny_model, "--adapter", ckpt, "--dataset", "addition", "--limit", "3",
                          "--max-new-tokens", "8", "--dtype", "float32", "--output", str(tmp_path / "pred.jsonl")])
    assert metrics["n_questions"] == 3 and 0.0 <= metrics["accuracy"] <= 1.0
    assert "gsm8k_strict_match" not in metrics, "lm-eval's GSM8K matchers mean nothing on addition"
    assert "accuracy" in capsys.readouterr().out
    preds = [json.loads(x) for x in open(tmp_path / "pred.jsonl")]
    assert len(preds) == 3 and all(len(p["completions"]) == 1 for p in preds)


@pytest.mark.parametrize("dynamic", [False, True])
def test_resumed_run_equals_uninterrupted_run(tiny_model, tmp_path, monkeypatch, dynamic):
    """Seeds derive from (seed, step): 2 steps + resume 1 step == 3 steps straight (adapter bits).

    A random model never solves addition, so the reward is replaced by one that varies with the
    completion (its length parity): the advantages are non-zero and the adapters really move. With
    dynamic sampling the reward is spread_on_even_answers, which leaves about half the groups without
    a spread, so step 2, the first after the resume, over-samples by the keep rate step 1 measured and
    the checkpoint carried."""
    monkeypatch.setattr(train.rewards, "rewards", lambda exs, texts, stats=None, **kw: [float(len(t) % 2) for t in texts])
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    common = ["--model", tiny_model, "--save-every", "1", "--eval-limit", "0", "--lr", "1e-2",
              "--lora-dropout", "0.1", "--max-steps", "3", *FAST]
    if dynamic:
        common += ["--dynamic-sampling", "--dynamic-sampling-threshold", "0",
                   "--reward", "reward_examples:spread_on_even_answers"]
    train.main([*common, "--output-dir", a])
    train.main([*common, "--output-dir", b, "--stop-at", "2"])
    train.main([*common, "--output-dir", b, "--resume"])
    from safetensors.torch import load_file
    wa = load_file(os.path.join(a, "checkpoint-000003", lora.ADAPTER_WEIGHTS))
    wb = load_file(os.path.join(b, "checkpoint-000003", lora.ADAPTER_WEIGHTS))
    assert wa.keys() == wb.keys()
    assert any(v.abs().max() > 0 for k, v in wa.items() if "lora_B" in k), "the adapters never moved"
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    ra, rb = read_metrics(a), read_metrics(b)
    keys = ("reward", "sampling/rounds", "sampling/prompts", "sampling/keep_rate")
    assert [[r.get(k) for k in keys] for r in ra] == [[r.get(k) for k in keys] for r in rb]
    states = [torch.load(os.path.join(d, "checkpoint-000003", run_dir.TRAINER_STATE), weights_only=True)
              for d in (a, b)]
    assert states[0]["data_pos"] == states[1]["data_pos"] == sum(r["sampling/prompts"] for r in ra)
    assert states[0]["keep_rate"] == states[1]["keep_rate"]
    if dynamic:  # the answers in data order (even: a spread), the budget 10 · 2 = 20 prompts a step:
        # step 0, rate 1: 128 137 (1 of 2), then round_size(1, 1/2, 18) = 4: 52 122 100 144 -> 6 prompts, 5 informative
        # step 1, rate 5/6: round_size(2, 5/6, 20) = 4 (n = 3: 2.5 - 0.65 < 2): 23 117 155 192 (1 of 4), then
        #   round_size(1, 1/4, 16) = 10 (n = 9: 2.25 - 1.30 < 1; n = 10: 2.5 - 1.37 >= 1):
        #   88 117 142 120 91 40 154 85 155 58 (6) -> 14 prompts, 7 informative
        # step 2, after the resume, rate 1/2: round_size(2, 1/2, 20) = 7 (n - √n >= 4): 66 100 112 98 87 145 94
        assert [(r["sampling/keep_rate"], r["sampling/prompts"], r["sampling/rounds"]) for r in ra] == \
            [(1.0, 6, 2), (pytest.approx(5 / 6), 14, 2), (0.5, 7, 1)], ra
    else:
        assert states[0]["data_pos"] == 3 * 2 and "sampling/keep_rate" not in ra[0]


def test_gptq_run_trains_and_resumes_on_its_saved_base(tiny_model, tmp_path, capsys):
    """GPTQ, the default quantizer of an NVFP4 run: the base, quantized with the run's first training prompts, is saved in the run
    directory; a resumed run, eval.py and export.py load it rather than quantize again, and 2 steps + resume
    1 step == 3 steps straight, bit for bit. The saved codes are GPTQ's: they differ from round-to-nearest's."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    common = ["--model", tiny_model, "--save-every", "1", "--eval-limit", "0", "--max-steps", "3", *FAST]
    train.main([*common, "--output-dir", a])
    assert json.load(open(os.path.join(a, run_dir.RUN_CONFIG)))["quantizer"] == "gptq"
    train.main([*common, "--output-dir", b, "--stop-at", "2"])
    capsys.readouterr()
    train.main([*common, "--output-dir", b, "--resume"])
    base = os.path.join(b, run_dir.BASE)
    assert f"the base: {base} (saved by this run)" in capsys.readouterr().out
    from safetensors.torch import load_file
    wa, wb = (load_file(os.path.join(d, "checkpoint-000003", lora.ADAPTER_WEIGHTS)) for d in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    saved = load_model(base, quant="nvfp4", dtype=torch.float32).state_dict()
    rtn = load_model(tiny_model, quant="nvfp4", dtype=torch.float32).state_dict()
    packed = [k for k in saved if k.endswith("weight_packed")]
    assert packed and any(not torch.equal(saved[k], rtn[k]) for k in packed)
    qeval.main(["--model", tiny_model, "--adapter", os.path.join(b, "checkpoint-000003"), "--dataset", "addition",
                "--limit", "2", "--max-new-tokens", "4", "--dtype", "float32"])
    assert f"loading {base} (nvfp4, gptq, saved by the run)" in capsys.readouterr().out
    import export   # the NVFP4 export of the run is the base it trained on, code for code
    export.main(["--adapter", b, "--out", str(tmp_path / "exported"), "--formats", "nvfp4"])
    exported = load_model(str(tmp_path / "exported" / "nvfp4"), quant="nvfp4", dtype=torch.float32).state_dict()
    assert all(torch.equal(exported[k], saved[k]) for k in packed)


@pytest.mark.parametrize("device,steps", [("cpu", 2), pytest.param("cuda", 20, marks=pytest.mark.gpu)])
def test_deterministic_run_repeats_its_metrics_bit_for_bit(tiny_model, tmp_path, device, steps):
    """--deterministic (PyTorch's deterministic algorithms; an op without one would stop the run) trains,
    and two runs of one seed write the same metrics.jsonl, times aside: on the CPU, and for 20 steps on a
    GPU, where the default mode need not repeat itself."""
    runs = []
    try:
        for name in ("a", "b"):
            out = str(tmp_path / name)
            train.main(["--model", tiny_model, "--output-dir", out, "--max-steps", str(steps), "--eval-limit", "0",
                        "--device", device, "--deterministic", "--lr", "1e-2", *FAST])
            runs.append([{k: v for k, v in r.items() if not k.startswith(("time", "memory")) and
                          k not in ("step_time", "rollout/tokens_per_s")} for r in read_metrics(out)])
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(runs[0]) == steps and runs[0] == runs[1]


def test_custom_reward_on_a_conversational_jsonl_dataset(tiny_model, tmp_path, monkeypatch):
    rows = [{"prompt": [{"role": "user", "content": f"Say {i} twice."}], "answer": str(i), "difficulty": i % 3}
            for i in range(6)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "run")
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("QERL_TEST_CALLS", str(calls))   # the reward's worker starts with it (and ends below)
    reward_funcs.close_workers()
    train.main(["--model", tiny_model, "--output-dir", out, "--max-steps", "1", *FAST, "--dataset", str(data),
                "--eval-limit", "0", "--reward", "reward_examples:length_mod_3", "--log-completions", "3"])
    reward_funcs.close_workers()
    (call,) = [json.loads(line) for line in calls.read_text().splitlines()]
    n = 2 * 4                                                   # --prompts-per-step 2 × --group-size 4
    assert len(call["completions"]) == len(call["prompts"]) == len(call["completion_ids"]) == n
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in call["completions"])
    by_prompt = {r["prompt"][0]["content"]: r for r in rows}
    for p, d, ans in zip(call["prompts"], call["difficulty"], call["kwargs"]["answer"]):
        assert by_prompt[p[0]["content"]]["difficulty"] == d and by_prompt[p[0]["content"]]["answer"] == ans
    (m,) = read_metrics(out)
    want = sum(call["returned"]) / n
    assert m["reward"] == pytest.approx(want) and m["rewards/length_mod_3/mean"] == pytest.approx(want)
    logged = [json.loads(x) for x in open(os.path.join(out, run_dir.COMPLETIONS))]
    assert len(logged) == 3 and all(r["step"] == 1 for r in logged)
    returned = {c[0]["content"]: v for c, v in zip(call["completions"], call["returned"])}
    for r in logged:
        assert r["reward"] == pytest.approx(returned[r["completion"]]) == r["rewards/length_mod_3"]
        assert r["prompt"][0]["content"] in by_prompt


def test_resume_with_no_other_flag_continues_the_run(tiny_model, tmp_path, capsys):
    out = str(tmp_path / "run")
    train.main(["--model", tiny_model, "--output-dir", out, "--max-steps", "3", "--save-every", "1", *FAST,
                "--eval-limit", "0", "--stop-at", "1"])
    config = open(os.path.join(out, run_dir.RUN_CONFIG)).read()
    capsys.readouterr()
    train.main(["--resume", out])
    assert "at step 1" in capsys.readouterr().out
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
    assert open(os.path.join(out, run_dir.LATEST)).read() == "checkpoint-000003"
    assert open(os.path.join(out, run_dir.RUN_CONFIG)).read() == config


# ----------------------------------------------------------------------------------------------
# bad input


def test_output_dir_with_another_run_is_refused(tiny_model, tmp_path, capsys):
    out = str(tmp_path / "run")
    train.main(["--model", tiny_model, "--output-dir", out, "--max-steps", "1", *FAST])
    before = sorted(os.listdir(out))
    with pytest.raises(SystemExit, match="already holds a run"):
        train.main(["--model", tiny_model, "--output-dir", out, "--max-steps", "1", *FAST])
    with pytest.raises(SystemExit):
        train.main(["--model", tiny_model, "--output-dir", out, "--max-steps", "1", "--resume",
                    *FAST[:-2], "--lora-rank", "8"])
    assert "--lora-rank 8 differs from the run's 4" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == before, "a refused run must not touch the directory"
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not empty"):
        train.main(["--model", tiny_model, "--output-dir", str(other), "--max-steps", "1", *FAST])
    assert (other / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "0"], "temperature must be > 0"),
    (["--importance-sampling", "token_mask", "--top-p", "0.9"], "importance-sampling needs --top-p 1"),
    (["--save-every", "0"], "save-every must be >= 1"),
    (["--group-size", "1"], "group-size must be >= 2"),
])
def test_bad_flags_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "x", *flags])
    assert message in capsys.readouterr().err


def test_eval_adapter_of_another_rank_is_refused(tiny_model, tmp_path):
    model = load_model(tiny_model, quant="bf16", dtype=torch.float32, device="cpu")
    lora.apply_lora(model, lora.LoRAConfig(r=4, alpha=8))
    lora.save_adapter(model, str(tmp_path / "ad"), tiny_model)
    fresh = load_model(tiny_model, quant="bf16", dtype=torch.float32, device="cpu")
    lora.apply_lora(fresh, lora.LoRAConfig(r=8, alpha=8))
    with pytest.raises(ValueError, match="rank mismatch"):
        lora.load_adapter(fresh, str(tmp_path / "ad"), tiny_model)


# ----------------------------------------------------------------------------------------------
# the pieces


def test_completion_logprobs_match_dense_log_softmax(tiny_model):
    torch.manual_seed(1)
    model = adapted_model(tiny_model)
    prompt_lens, comp_lens = torch.tensor([5, 3, 7]), torch.tensor([4, 6, 1])
    T = int((prompt_lens + comp_lens).max())
    ids = torch.randint(0, model.config.vocab_size, (3, T))
    temp = 0.7
    logp, ent = train.completion_logprobs(model, ids, prompt_lens, comp_lens, temp, chunk=3)
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).double() / temp, dim=-1)              # (B, T, V) float64
    for b in range(3):
        for j in range(int(comp_lens[b])):
            t = int(prompt_lens[b]) + j
            want = ref[b, t - 1, ids[b, t]]
            want_ent = -(ref[b, t - 1].exp() * ref[b, t - 1]).sum()
            assert abs(logp[b, j].item() - want.item()) < 1e-4, (b, j, logp[b, j].item(), want.item())
            assert abs(ent[b, j].item() - want_ent.item()) < 1e-3
        assert (logp[b, int(comp_lens[b]):] == 0).all()
    # Gradient through the chunked, checkpointed path equals the dense one.
    params = lora.lora_parameters(model)
    g1 = torch.autograd.grad(logp.sum(), params)
    dense = torch.log_softmax(model(ids).float() / temp, dim=-1)
    tot = sum(dense[b, int(prompt_lens[b]) + j - 1, ids[b, int(prompt_lens[b]) + j]]
              for b in range(3) for j in range(int(comp_lens[b])))
    g2 = torch.autograd.grad(tot, params)
    err = max((a - b).abs().max().item() / (b.abs().max().item() + 1e-12) for a, b in zip(g1, g2))
    assert err < 1e-4, f"chunked vs dense gradient: max rel err {err:.2e}"


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_micro_batches_give_the_whole_batch_gradient(tiny_model, loss_type):
    """train_step's reweighting: micro-batch 2 and micro-batch 8 give the same LoRA update."""
    groups, rewards = make_groups(2, seed=2), torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    grads = [lora_update(tiny_model, groups, rewards, loss_type, mb)[0] for mb in (8, 2)]
    err = max((a - b).abs().max().item() / (b.abs().max().item() + 1e-12) for a, b in zip(*grads))
    assert err < 1e-4, f"{loss_type}: micro-batch vs whole-batch update, max rel err {err:.2e}"


def test_train_step_with_kl_reference_and_two_updates(tiny_model):
    """β > 0 takes the KL to the adapter-disabled model; μ = 2 reuses the stored old log-probs."""
    import argparse
    import aqn
    import grpo
    model, groups = adapted_model(tiny_model, seed=4), make_groups(1, seed=4)
    params = lora.lora_parameters(model)
    before = [p.detach().clone() for p in params]
    args = argparse.Namespace(temperature=1.0, logprob_chunk=4, max_grad_norm=1.0)
    gcfg = grpo.GRPOConfig(group_size=4, loss_type="grpo", beta=0.1, updates_per_rollout=2, max_completion_len=5)
    policy = tiny_policy(model, torch.optim.AdamW(params, lr=1e-3), gcfg, micro_batch=2)
    noise = aqn.sample_noise(model, 1e-2, torch.Generator().manual_seed(0))
    out = train.train_step(policy, with_rewards(groups, torch.tensor([1.0, 0.0, 0.0, 1.0])), noise, 0, args)
    assert out["kl"] > 0 and all(map(lambda v: v == v, out.values())), out   # no NaN anywhere
    assert policy.scheduler.last_epoch == 2, "one schedule step per optimizer step"
    assert any(not torch.equal(b, p) for b, p in zip(before, params))


# ----------------------------------------------------------------------------------------------
# from Python


# FAST as flags.config's keywords
FAST_CONFIG = dict(dynamic_sampling=False, group_size=4, prompts_per_step=2, max_new_tokens=8, eval_limit=4,
                   dtype="float32", micro_batch=4, lora_rank=4)


def test_train_from_python_with_rows_a_lambda_and_callbacks(tiny_model, tmp_path, capsys):
    """train.train on flags.config: rows in memory (recorded by their label), a lambda reward (run in this
    process, said in a note) that reads a dataset column, callbacks told of every step, evaluation and save
    with the step numbers of metrics.jsonl; a resume from Python must be handed the same rows."""
    import flags
    rows = [{"prompt": f"What is {a} + 1?", "answer": str(a + 1), "tag": a % 2} for a in range(10, 30)]
    heard = []

    class Hear(train.Callback):
        def on_step_end(self, step, metrics):
            heard.append(("step", step, metrics["step"]))

        def on_evaluate(self, step, metrics):
            heard.append(("eval", step, sorted(metrics)))

        def on_save(self, step, checkpoint):
            heard.append(("save", step, os.path.basename(checkpoint)))

    out = str(tmp_path / "run")
    settings = dict(model=tiny_model, output_dir=out, train_dataset=rows[:16], eval_dataset=rows[16:], max_steps=3,
                    reward_funcs=[lambda prompts, completions, tag, **kw: [float(t) for t in tag]], save_steps=2,
                    eval_steps=2, **FAST_CONFIG)
    result = train.train(flags.config(**settings), callbacks=[Hear()])
    assert "runs in this process" in capsys.readouterr().err
    assert heard == [("eval", 0, ["eval/accuracy"]), ("step", 1, 1), ("step", 2, 2),
                     ("eval", 2, ["eval/accuracy", "eval/updates"]), ("save", 2, "checkpoint-000002"),
                     ("step", 3, 3), ("eval", 3, ["eval/accuracy", "eval/updates"]), ("save", 3, "checkpoint-000003")]
    assert (result["step"], result["updates"], result["eval/step"]) == (3, 3, 3)
    rows_metrics = read_metrics(out)
    assert [m["step"] for m in rows_metrics] == [1, 2, 3] and "rewards/<lambda>/mean" in rows_metrics[0]
    record = json.load(open(os.path.join(out, run_dir.RUN_CONFIG)))
    assert record["dataset"].startswith("python: 16 rows, sha256 ") and record["reward"][0].startswith("python:")

    with pytest.raises(flags.ConfigError, match="--dataset python: 15 rows, .* differs from the run's python: 16"):
        flags.config(**{**settings, "train_dataset": rows[:15], "resume": True})
    again = train.train(flags.config(**settings, resume=True))   # a finished run: said, nothing loaded
    assert again == {"step": 3, "updates": None, "output_dir": out}
    assert "has done 3 steps, and --max-steps is 3: nothing to do" in capsys.readouterr().out


def test_a_finished_run_extends_with_its_aqn_schedule_kept(tiny_model, tmp_path, capsys):
    """A 3-step run resumed with --max-steps 5 takes steps 4 and 5 in the last AQN stage (its schedule spans
    the first 3 steps: --aqn-steps), and its run_config.json stays the one its checkpoints were written with."""
    import aqn
    out = str(tmp_path / "run")
    run = ["--model", tiny_model, "--output-dir", out, "--save-every", "1", *FAST, "--eval-limit", "0"]
    train.main([*run, "--max-steps", "3"])
    config = open(os.path.join(out, run_dir.RUN_CONFIG)).read()
    train.main(["--resume", out, "--max-steps", "5"])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    schedule = [aqn.sigma_at(s, 3, aqn.AQNConfig()) for s in range(5)]
    assert [r["aqn/sigma"] for r in rows] == schedule and schedule[3] == schedule[4] == aqn.AQNConfig().sigma_end
    assert open(os.path.join(out, run_dir.RUN_CONFIG)).read() == config
    capsys.readouterr()
    assert train.main(["--resume", out])["step"] == 5   # its record's --max-steps is 3: nothing to do, and said
    assert "has done 5 steps, and --max-steps is 3: nothing to do (a larger --max-steps extends it" in \
        capsys.readouterr().out


@pytest.mark.slow
def test_the_python_example_trains_and_tells_its_callbacks(tiny_model, tmp_path):
    """examples/train_from_python.py for 2 steps of the tiny model, in a process of its own: its reward
    function runs in a worker that imports the script; the callbacks hear the evaluations before training
    and after step 2 and the save of step 2; the metrics are written, TRL's names are said as read."""
    out = str(tmp_path / "run")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_from_python.py"), "--model",
                          tiny_model, "--max-steps", "2", "--output-dir", out], cwd=tmp_path, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    heard = [ln.strip().split(": eval accuracy")[0] for ln in res.stdout.splitlines() if ln.strip().startswith("callback:")]
    assert heard == ["callback: step 0", "callback: step 2", f"callback: step 2: saved {out}/checkpoint-000002"], heard
    assert "TRL's names read as qerl's flags: model_name_or_path as --model" in res.stderr
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and "rewards/ends_with_the_sum/mean" in rows[0]
    assert rows[1]["eval/accuracy"] >= 0 and "eval/accuracy_initial" in rows[0]
    record = json.load(open(os.path.join(out, run_dir.RUN_CONFIG)))
    script = os.path.join(ROOT, "examples", "train_from_python.py")
    assert record["reward"] == [f"{script}:ends_with_the_sum"] and record["reward_sources"][0]["file"] == script


def test_lora_target_modules_adapt_only_those_linears(tiny_model, tmp_path):
    """--lora-target-modules q_proj,v_proj: one step trains adapters on those two alone, and PEFT loads
    the checkpoint with the same targets."""
    from peft import PeftConfig
    out = str(tmp_path / "run")
    train.main(["--model", tiny_model, "--output-dir", out, "--max-steps", "1", *FAST, "--eval-limit", "0",
                "--lora-target-modules", "q_proj,v_proj"])
    ckpt = os.path.join(out, "checkpoint-000001")
    assert sorted(PeftConfig.from_pretrained(ckpt).target_modules) == ["q_proj", "v_proj"]
    from safetensors.torch import load_file
    assert {k.split(".")[-3] for k in load_file(os.path.join(ckpt, lora.ADAPTER_WEIGHTS))} == {"q_proj", "v_proj"}


def test_a_bf16_run_samples_with_the_adapters_merged(tiny_model, tmp_path, monkeypatch):
    """--quant bf16 (fp32 here): every generate() of the run, the evaluations' and the rollouts', finds the
    adapters off and each adapted weight equal to its kept base + delta_weight() rounded once, which after
    the first update is not the base (lora.merged_sampling); the training pass then sees the base again,
    so the sampler's log-probs match the trainer's to fp32 rounding."""
    import rollout
    seen, real = [], rollout.LLMEngine.generate

    def spy(self, prompts, params):
        mods = list(lora.lora_modules(self.model).values())
        seen.append((not any(m.enabled for m in mods),
                     all(torch.equal(m.base_layer.weight, (m.kept + m.delta_weight()).to(m.kept.dtype)) for m in mods),
                     any(bool(m.lora_B.detach().abs().sum()) for m in mods)))
        return real(self, prompts, params)
    monkeypatch.setattr(rollout.LLMEngine, "generate", spy)
    out = str(tmp_path / "run")
    reward_funcs.close_workers()
    train.main(["--model", tiny_model, "--output-dir", out, "--max-steps", "2", "--quant", "bf16", *FAST,
                "--reward", "reward_examples:spread_on_even_answers"])   # a spread: the first update moves B
    reward_funcs.close_workers()
    assert len(seen) == 3, seen                             # the evaluation before, two rollouts
    assert all(off and merged for off, merged, _ in seen), seen
    assert any(moved for *_, moved in seen), "no call sampled a trained adapter: the merge was not tested"
    assert all(m["sampling/sampling_logp_difference/mean"] < 1e-4 for m in read_metrics(out))


def test_eval_reports_lm_evals_matchers_on_gsm8k_style_data(tiny_model, test_data, capsys):
    metrics = qeval.main(["--model", tiny_model, "--dataset", os.path.join(test_data, "gsm8k", "test.jsonl"),
                          "--limit", "2", "--max-new-tokens", "4", "--dtype", "float32"])
    assert {"gsm8k_strict_match", "gsm8k_flexible_match"} <= set(metrics)
    assert "lm-eval strict" in capsys.readouterr().out


def test_a_run_without_updates_says_so(tiny_model, tmp_path, capsys):
    """Dynamic sampling on a random model: no group has a reward spread, so every step is skipped; the run
    counts 0 updates, its last line says so, and it warns that the adapters are as they started."""
    out = str(tmp_path / "run")
    result = train.main(["--model", tiny_model, "--output-dir", out, "--max-steps", "2", *FAST, "--dynamic-sampling",
                         "--max-sampling-rounds", "1"])
    said = capsys.readouterr().out
    assert (result["step"], result["updates"]) == (2, 0)
    assert "eval accuracy after 2 steps (0 updates)" in said and "warning: no update was applied" in said
    assert all(r.get("skipped") for r in read_metrics(out))
