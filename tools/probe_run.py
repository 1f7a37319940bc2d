"""tools/probe_run.py: the probes of tools/probe_integrity.py that start train.py: flags and a resumed
run's record that it must refuse before anything loads (`flags`: run_config.json edited, of the wrong
type or naming reward code that changed since, steps that cannot be taken, a model, device or output
directory that cannot be used), and runs that go wrong on the way (`train`: a model that does not load,
rewards without signal, gradients that are not finite, Ctrl-C).
"""
import json
import os
import signal
import subprocess
import sys
import time

from probe_files import CKPT, ROOT, Bench, Probe, remanifest, truncate   # (which puts qerl on the path)

import torch

import flags
import reward_funcs
import run_dir
import train

REWARD = "def fn(completions, **kw):\n    return [float(len(c) % 2) for c in completions]\n"


def edit_record(out: str, edit, manifest: bool = True) -> None:
    """Edit a copy's run_config.json (edit(dict) in place); rewrite its checkpoint's manifest to match
    unless manifest is False: then only the sha256 check can see the edit."""
    path = os.path.join(out, run_dir.RUN_CONFIG)
    record = json.load(open(path))
    edit(record)
    open(path, "w").write(json.dumps(record))
    if manifest:
        remanifest(os.path.join(out, CKPT))


def with_reward(bench: Bench, out: str, name: str, edit_after=None) -> str:
    """A copy whose run recorded the reward file <work>/<name>.py:fn and its reward_sources row, then
    edit_after(path) done to the file: what --resume must check before importing it."""
    path = os.path.join(bench.work, f"{name}.py")
    open(path, "w").write(REWARD)
    spec = f"{path}:fn"
    row = reward_funcs.record([reward_funcs.RewardFunc(spec, source=reward_funcs.resolve(spec))])
    edit_record(out, lambda r: r.update(reward=["correctness", spec], reward_sources=row))
    if edit_after:
        edit_after(path)
    return out


def small_run(bench: Bench, out: str, *extra) -> list[str]:
    """train.py's flags for a few quick steps of the model. Its base is bf16: these probes test the loop, not
    the base's format, and a real model's NVFP4 steps on a CPU (its matmuls emulated) outlast their limits."""
    return ["--model", bench.model, "--output-dir", out, "--dataset", "addition", "--quant", "bf16", "--lora-rank",
            "4", "--dtype", "float32", "--max-new-tokens", "4", "--eval-limit", "0", "--no-dynamic-sampling",
            "--group-size", "2", "--prompts-per-step", "2", "--micro-batch", "4", "--log-every", "0", *extra]


# ----------------------------------------------------------------------------------------------
# flags: refused at parse time (or before the model loads)


def flag_probes(bench: Bench) -> list[Probe]:
    def resumed(change, *argv, run=flags.parse_args):
        def go():
            out = bench.fresh()
            change(out)
            return run(["--resume", out, *argv])
        return go

    def set_key(key, value):
        return lambda out: edit_record(out, lambda r: r.update({key: value}))

    def drop_key(key):
        return lambda out: edit_record(out, lambda r: r.pop(key))

    def untokenized():
        model = bench.fresh("model")
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if os.path.exists(os.path.join(model, f)):
                os.remove(os.path.join(model, f))
        return model

    slow = os.path.join(bench.work, "slow_import.py")
    open(slow, "w").write("import time\ntime.sleep(60)\n" + REWARD)
    fresh_out = lambda: os.path.join(bench.work, f"new-{time.monotonic_ns()}")   # noqa: E731
    cases = {
        "run_config.json: lr a string, manifest rewritten": resumed(set_key("lr", "1e-05")),
        "run_config.json: lora_rank 4.0, manifest rewritten": resumed(set_key("lora_rank", 4.0)),
        "run_config.json: lr null, manifest rewritten": resumed(set_key("lr", None)),
        "run_config.json: lr -1, manifest rewritten": resumed(set_key("lr", -1.0)),
        "run_config.json: quant int3, manifest rewritten": resumed(set_key("quant", "int3")),
        "run_config.json: lora_rank missing, manifest rewritten": resumed(drop_key("lora_rank")),
        "run_config.json: an unknown key, manifest rewritten": resumed(set_key("lr_decay", 0.5)),
        "run_config.json: lr edited, manifest as it was": resumed(
            lambda out: edit_record(out, lambda r: r.update(lr=1e-3), manifest=False)),
        "reward file edited since the run started": resumed(
            lambda out: with_reward(bench, out, "edited_reward", lambda p: open(p, "a").write("# edited\n"))),
        "reward file deleted since the run started": resumed(
            lambda out: with_reward(bench, out, "deleted_reward", os.remove)),
        "reward_sources without the run's reward file": resumed(
            lambda out: (with_reward(bench, out, "unrecorded_reward"),
                         edit_record(out, lambda r: r.update(reward_sources=[])))),
        "--stop-at at the step the run resumes from": resumed(lambda out: None, "--stop-at", "3", run=train.main),
        "--output-dir ''": lambda: flags.parse_args(small_run(bench, "")),
        "--device cuda:99": lambda: flags.parse_args(small_run(bench, fresh_out(), "--device", "cuda:99")),
        "--model: a directory without config.json": lambda: flags.parse_args(small_run(bench, fresh_out(), "--model", bench.work)),
        "--model: a directory without a tokenizer": lambda: flags.parse_args(small_run(bench, fresh_out(), "--model", untokenized())),
        "--tokenizer: a path that is not there": lambda: flags.parse_args(small_run(
            bench, fresh_out(), "--tokenizer", os.path.join(bench.work, "nowhere"))),
        "--reward-timeout 1, a reward module that sleeps at import": lambda: flags.parse_args(small_run(
            bench, fresh_out(), "--reward", f"{slow}:fn", "--reward-timeout", "1")),
        "--lora-target-modules lm_head": lambda: flags.parse_args(small_run(bench, fresh_out(), "--lora-target-modules", "lm_head")),
        "--report-to tensorboard,bogus": lambda: flags.parse_args(small_run(bench, fresh_out(), "--report-to", "tensorboard,bogus")),
    }
    probes = [Probe("flags", name, run, limit_s=20) for name, run in cases.items()]
    probes += [
        Probe("flags", "the pristine run resumes", resumed(lambda out: None), expect="accept",
              check=lambda a: None if (a.lora_rank, a.max_steps) == (4, 200) else f"{a.lora_rank}, {a.max_steps}"),
        Probe("flags", "the run with its reward file unchanged resumes",
              resumed(lambda out: with_reward(bench, out, "kept_reward")), expect="accept",
              check=lambda a: None if len(a.reward) == 2 else f"reward {a.reward}"),
        Probe("flags", "a finished run resumed (--max-steps at its step): nothing to do, said, nothing loaded",
              resumed(lambda out: None, "--max-steps", "3", run=train.main), expect="accept",
              check=lambda s: None if s == {"step": 3, "updates": None, "output_dir": s["output_dir"]} else f"{s}"),
        Probe("flags", "a larger --max-steps extends the run, its AQN schedule kept", resumed(
            lambda out: None, "--max-steps", "400"), expect="accept",
              check=lambda a: None if (a.max_steps, a.aqn_steps) == (400, 200) else f"{a.max_steps}, {a.aqn_steps}"),
    ]
    return probes


# ----------------------------------------------------------------------------------------------
# train: runs that go wrong on the way


def _not_finite_grads(bench: Bench, out: str, steps: int, argv: list):
    """train.main with the gradient norm of the first `steps` updates reported as NaN (as a diverged step
    gives it): those updates are skipped."""
    real, calls = torch.nn.utils.clip_grad_norm_, []

    def clip(params, max_norm, *a, **k):
        norm = real(params, max_norm, *a, **k)
        calls.append(1)
        return torch.full_like(norm, float("nan")) if len(calls) <= steps else norm
    torch.nn.utils.clip_grad_norm_ = clip
    try:
        return train.main(small_run(bench, out, *argv))
    finally:
        torch.nn.utils.clip_grad_norm_ = real


def _ctrl_c(bench: Bench) -> object:
    """train.py in a process of its own (with a user reward function in its worker), sent SIGINT once its
    first checkpoint is written: one line that says where it stopped, exit 130, no traceback (the
    worker's neither)."""
    out = os.path.join(bench.work, f"ctrl-c-{bench.count}")
    bench.count += 1
    reward = os.path.join(bench.work, "ctrl_c_reward.py")
    open(reward, "w").write(REWARD)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"),
           *small_run(bench, out, "--max-steps", "500", "--save-every", "1", "--reward", f"{reward}:fn")]
    # SIGINT as a terminal delivers it, whatever this process inherited (an ignored SIGINT would be kept)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    latest = os.path.join(out, run_dir.LATEST)
    while not os.path.exists(latest) and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    try:
        err = proc.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:   # it trains on: stopped here, and counted as going on in silence
        proc.kill()
        return proc.communicate()[1]
    lines = [ln for ln in err.splitlines() if ln.strip() and "it/s]" not in ln and "s/it]" not in ln]
    said = [ln for ln in lines if ln.startswith("interrupted")]
    if proc.returncode == 130 and len(said) == 1 and "Traceback" not in err and "--resume" in said[0]:
        raise SystemExit(said[0])
    if proc.returncode == 0:
        return err   # it went on as if nothing happened
    raise RuntimeError(f"exit {proc.returncode}: {err[-400:]}")


def train_probes(bench: Bench) -> list[Probe]:
    def new_out():
        bench.count += 1
        return os.path.join(bench.work, f"train-{bench.count}")

    def cut_model():
        model = bench.fresh("model")
        truncate(os.path.join(model, "model.safetensors"), lambda n: n // 2)
        return train.main(small_run(bench, new_out(), "--model", model, "--max-steps", "1"))

    none_module = os.path.join(bench.work, "no_opinion.py")
    open(none_module, "w").write("def never(completions, **kw):\n    return [None] * len(completions)\n")
    return [
        Probe("train", "a model whose weights are cut in half", cut_model, limit_s=60),
        Probe("train", "a reward that has no opinion for 5 steps", lambda: train.main(small_run(
            bench, new_out(), "--max-steps", "5", "--reward", "correctness", "--reward", f"{none_module}:never")),
              expect="warn", limit_s=120),
        Probe("train", "every update skipped (gradient not finite) once", lambda: _not_finite_grads(
            bench, new_out(), 1, ["--max-steps", "2"]), expect="warn", limit_s=60),
        Probe("train", "every update skipped 3 steps in a row", lambda: _not_finite_grads(
            bench, new_out(), 3, ["--max-steps", "5", "--save-every", "1"]), limit_s=60),
        Probe("train", "Ctrl-C mid-run", lambda: _ctrl_c(bench), limit_s=240),
        Probe("train", "a 2-step run", lambda: train.main(small_run(bench, new_out(), "--max-steps", "2")),
              expect="accept", check=lambda s: None if (s["step"], s["updates"]) == (2, 2) else f"summary {s}"),
    ]
