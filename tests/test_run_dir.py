"""run_dir.py on a toy LoRA model: the lock, the manifest, which checkpoint --resume takes, rotation,
non-finite values, metrics.jsonl.

References: a second process (the lock is the kernel's, so the holder is a real other process), bytes
flipped on disk (the manifest must notice every one), and snapshots of the directory's bytes
(refusals must change nothing).
"""
import argparse
import hashlib
import json
import os
import random
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import lora
import run_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Toy(nn.Module):
    """Two blocks with q_proj / v_proj linears: what apply_lora adapts."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"q_proj": nn.Linear(16, 16), "v_proj": nn.Linear(16, 8)})
                                    for _ in range(2))


def toy(seed: int = 0):
    """(model with r=2 adapters, AdamW with state, schedule): one real step from random gradients."""
    torch.manual_seed(seed)
    model = Toy()
    lora.apply_lora(model, lora.LoRAConfig(r=2, alpha=4, target_modules=("q_proj", "v_proj")),
                    generator=torch.Generator().manual_seed(seed))
    params = lora.lora_parameters(model)
    opt = torch.optim.AdamW(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    sched.step()
    return model, opt, sched


def args_for(out, resume=False):
    return argparse.Namespace(output_dir=str(out), resume=resume, max_steps=10, model="toy", quant="bf16",
                              dataset="addition", lora_rank=2, lora_alpha=4.0, group_size=2, prompts_per_step=2, seed=0)


def make_run(out, steps=(1, 2, 3, 4), keep=10):
    """A run directory with run_config.json, one metrics row per step and a checkpoint at each of steps."""
    os.makedirs(out, exist_ok=True)
    run_dir.write_atomic(os.path.join(out, run_dir.RUN_CONFIG), json.dumps(vars(args_for(out))))
    model, opt, sched = toy()
    with open(os.path.join(out, run_dir.METRICS), "w") as f:
        f.writelines(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(1, max(steps) + 1))
    for s in steps:
        with torch.no_grad():
            for p in lora.lora_parameters(model):
                p.add_(0.01 * s)
        run_dir.save_checkpoint(str(out), s, model, opt, sched, data_pos=2 * s, base_model="toy", keep=keep)
    return model, opt, sched


def tree(out, skip=(run_dir.LOCK,)) -> dict:
    """{relative path: sha256} of every file under out (the lock file's pid line excepted)."""
    got = {}
    for dirpath, _, files in os.walk(out):
        for f in files:
            p = os.path.join(dirpath, f)
            if f not in skip:
                got[os.path.relpath(p, out)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return got


def garble(path, n=64, seed=0):
    """Overwrite n bytes at a random offset with different bytes."""
    data = bytearray(open(path, "rb").read())
    at = random.Random(seed).randrange(0, len(data) - n)
    data[at:at + n] = bytes((b + 1) % 256 for b in data[at:at + n])
    open(path, "wb").write(bytes(data))


def ck(out, step):
    return os.path.join(str(out), f"checkpoint-{step:06d}")


# ----------------------------------------------------------------------------------------------
# the lock


def test_a_held_lock_refuses_a_second_run_naming_pid_and_host_then_frees_on_kill(tmp_path):
    out = tmp_path / "run"
    make_run(out)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, run_dir; run_dir.lock_run_dir(sys.argv[1]); "
                               "print('locked', flush=True); sys.stdin.read()", str(out)],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = tree(out, skip=())
        for resume in (False, True):
            with pytest.raises(SystemExit, match=rf"in use by another run \(pid {holder.pid} on host "
                                                 rf"{socket.gethostname()}"):
                run_dir.prepare_output_dir(args_for(out, resume))
        assert tree(out, skip=()) == before, "a refused run must not touch the directory"
    finally:
        holder.kill()  # a crash: the kernel drops the lock with the process
        holder.wait()
    assert run_dir.prepare_output_dir(args_for(out, resume=True)) == ck(out, 4)
    assert f"pid {os.getpid()} " in open(out / run_dir.LOCK).read()
    run_dir.unlock_run_dir(str(out))


def test_a_half_written_first_run_config_is_recoverable(tmp_path):
    for resume in (False, True):
        out = tmp_path / f"run{resume}"
        out.mkdir()
        (out / (run_dir.RUN_CONFIG + ".tmp")).write_text('{"max_steps": 10, "mod')   # killed mid-write
        (out / run_dir.LOCK).write_text("pid 1 on host gone\n")
        assert run_dir.prepare_output_dir(args_for(out, resume)) is None
        run_dir.unlock_run_dir(str(out))


# ----------------------------------------------------------------------------------------------
# manifests and the checkpoint --resume takes


@pytest.mark.parametrize("victim", [lora.ADAPTER_WEIGHTS, run_dir.TRAINER_STATE, lora.ADAPTER_CONFIG])
def test_manifest_catches_64_garbled_bytes(tmp_path, victim):
    make_run(tmp_path, steps=(1,))
    assert run_dir.verify_checkpoint(ck(tmp_path, 1)) is None
    garble(os.path.join(ck(tmp_path, 1), victim), n=min(64, os.path.getsize(os.path.join(ck(tmp_path, 1), victim)) - 1))
    assert f"{victim} does not match its sha256" in run_dir.verify_checkpoint(ck(tmp_path, 1))
    with open(os.path.join(ck(tmp_path, 1), victim), "ab") as f:
        f.write(b"x")
    assert "bytes, the manifest says" in run_dir.verify_checkpoint(ck(tmp_path, 1))
    os.remove(os.path.join(ck(tmp_path, 1), run_dir.MANIFEST))
    assert "no manifest.json" in run_dir.verify_checkpoint(ck(tmp_path, 1))


def test_resume_takes_the_newest_verified_checkpoint_inside_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    make_run(out)
    other = tmp_path / "other"
    make_run(other, steps=(5,))
    resume = lambda: run_dir.resume_checkpoint(str(out))  # noqa: E731

    os.remove(out / run_dir.LATEST)                                       # latest missing
    assert resume() == ck(out, 4) and "latest is missing" in capsys.readouterr().out
    (out / run_dir.LATEST).write_text("../other/checkpoint-000005")       # latest outside the run
    assert resume() == ck(out, 4) and "not a checkpoint of this run: ignored" in capsys.readouterr().out
    (out / run_dir.LATEST).write_text("checkpoint-000002")                # latest behind (killed before it moved)
    assert resume() == ck(out, 4) and "latest names checkpoint-000002" in capsys.readouterr().out
    os.symlink(ck(other, 5), ck(out, 5))                                  # a checkpoint linking outside
    assert resume() == ck(out, 4) and "links outside the run" in capsys.readouterr().out
    os.remove(ck(out, 5))
    garble(os.path.join(ck(out, 4), lora.ADAPTER_WEIGHTS))                # the newest garbled
    garble(os.path.join(ck(out, 3), run_dir.TRAINER_STATE))
    assert resume() == ck(out, 2)
    said = capsys.readouterr().out
    assert "checkpoint-000004 is not a complete checkpoint (adapter_model.safetensors" in said
    assert "checkpoint-000003 is not a complete checkpoint (trainer_state.pt" in said


def test_resume_refuses_when_no_checkpoint_verifies_and_changes_nothing(tmp_path):
    out = tmp_path / "run"
    make_run(out, steps=(1, 2))
    garble(os.path.join(ck(out, 1), lora.ADAPTER_WEIGHTS))
    os.remove(os.path.join(ck(out, 2), run_dir.MANIFEST))
    before = tree(out)
    with pytest.raises(SystemExit, match=r"no checkpoint in .* verifies.*nothing was changed.*checkpoint-000002: "
                                         r"no manifest.json.*checkpoint-000001: adapter_model.safetensors"):
        run_dir.prepare_output_dir(args_for(out, resume=True))
    assert tree(out) == before


def test_rotation_keeps_newer_checkpoints_and_sets_a_failed_one_aside(tmp_path):
    out = tmp_path / "run"
    model, opt, sched = make_run(out, steps=(2, 4, 6))
    garble(os.path.join(ck(out, 6), lora.ADAPTER_WEIGHTS))
    kept6 = tree(ck(out, 6))
    run_dir.save_checkpoint(str(out), 3, model, opt, sched, 6, "toy", keep=1)   # resumed from 2, now at 3
    assert [d for _, d in run_dir.checkpoints(str(out))] == ["checkpoint-000003", "checkpoint-000004",
                                                              "checkpoint-000006"]
    assert tree(ck(out, 6)) == kept6, "a checkpoint newer than the resumed one must stay as it is"
    run_dir.save_checkpoint(str(out), 6, model, opt, sched, 12, "toy", keep=1)  # the step again: set aside
    aside = [d for d in os.listdir(out) if d.startswith("checkpoint-000006.unverified-")]
    assert len(aside) == 1 and tree(out / aside[0]) == kept6
    assert run_dir.verify_checkpoint(ck(out, 6)) is None and open(out / run_dir.LATEST).read() == "checkpoint-000006"


def test_the_checkpoint_carries_the_keep_rate_and_an_older_one_resumes_with_one(tmp_path):
    """trainer_state.pt holds dynamic sampling's keep rate next to the data position; a checkpoint
    written before it was kept loads with 1.0, the rate a fresh run starts from."""
    out = tmp_path / "run"
    model, opt, sched = make_run(out, steps=(1,))
    run_dir.save_checkpoint(str(out), 2, model, opt, sched, 7, "toy", keep=3, keep_rate=0.375)
    state = run_dir.load_checkpoint(ck(out, 2), *toy(seed=1), "toy")
    assert (state["step"], state["data_pos"], state["keep_rate"]) == (2, 7, 0.375)
    path = os.path.join(ck(out, 2), run_dir.TRAINER_STATE)
    older = torch.load(path, weights_only=True)
    del older["keep_rate"]
    torch.save(older, path)
    assert run_dir.load_checkpoint(ck(out, 2), *toy(seed=1), "toy")["keep_rate"] == 1.0


# ----------------------------------------------------------------------------------------------
# non-finite values


@pytest.mark.parametrize("where", ["adapter", "optimizer"])
def test_nonfinite_values_are_not_saved_and_the_tensor_is_named(tmp_path, where):
    out = tmp_path / "run"
    model, opt, sched = make_run(out, steps=(1,))
    before = tree(out)
    q = lora.lora_modules(model)["layers.1.v_proj"]
    with torch.no_grad():
        (q.lora_B if where == "adapter" else opt.state[q.lora_B]["exp_avg_sq"])[0, 0] = float("nan")
    want = "layers.1.v_proj.lora_B holds NaN" if where == "adapter" else \
        "optimizer exp_avg_sq of layers.1.v_proj.lora_B holds NaN"
    with pytest.raises(SystemExit, match=rf"at step 2 {want}; the checkpoint is not written"):
        run_dir.save_checkpoint(str(out), 2, model, opt, sched, 4, "toy", keep=2)
    assert tree(out) == before


def test_nonfinite_values_are_not_loaded(tmp_path):
    out = tmp_path / "run"
    make_run(out, steps=(1,))
    from safetensors.torch import load_file, save_file
    path = os.path.join(ck(out, 1), lora.ADAPTER_WEIGHTS)
    w = load_file(path)
    key = sorted(w)[0]
    w[key][0, 0] = float("inf")
    save_file(w, path, metadata={"format": "pt"})
    model, opt, sched = toy(seed=1)
    with pytest.raises(SystemExit, match=rf"cannot resume from .*{key} holds NaN or Inf"):
        run_dir.load_checkpoint(ck(out, 1), model, opt, sched, "toy")
    make_run(tmp_path / "b", steps=(1,))
    state_path = os.path.join(ck(tmp_path / "b", 1), run_dir.TRAINER_STATE)
    state = torch.load(state_path, weights_only=True)
    state["optimizer"]["state"][3]["exp_avg"][0, 0] = float("nan")
    torch.save(state, state_path)
    with pytest.raises(SystemExit, match=r"trainer_state.pt: optimizer exp_avg of parameter #3 holds NaN"):
        run_dir.load_checkpoint(ck(tmp_path / "b", 1), model, opt, sched, "toy")


# ----------------------------------------------------------------------------------------------
# metrics.jsonl, completions.jsonl


@pytest.mark.parametrize("name", [run_dir.METRICS, run_dir.COMPLETIONS])
def test_truncate_rows_keeps_earlier_rows_byte_for_byte(tmp_path, name):
    path = tmp_path / name
    rows = [json.dumps({"step": s, "reward": 0.1 * s, "note": "é"}, ensure_ascii=False) + "\n" for s in range(1, 6)]
    path.write_text("".join(rows) + '{"step": 6, "rew', encoding="utf-8")   # the last line cut by a kill
    run_dir.truncate_rows(str(tmp_path), name, 3)
    assert path.read_text(encoding="utf-8") == "".join(rows[:3])
    ino = os.stat(path).st_ino
    run_dir.truncate_rows(str(tmp_path), name, 3)                          # nothing to drop: not rewritten
    assert os.stat(path).st_ino == ino


@pytest.mark.parametrize("bad, message", [(b'{"step": 1, "x": "\xff"}', r"metrics.jsonl:2: not UTF-8 \(byte 0xff"),
                                          (b'{"step": 1, ', r"metrics.jsonl:2: malformed JSON")])
def test_a_bad_metrics_line_stops_with_file_and_line(tmp_path, bad, message):
    path = tmp_path / run_dir.METRICS
    data = b'{"step": 1}\n' + bad + b'\n{"step": 3}\n'
    path.write_bytes(data)
    with pytest.raises(SystemExit, match=message):
        run_dir.truncate_rows(str(tmp_path), run_dir.METRICS, 1)
    assert path.read_bytes() == data
