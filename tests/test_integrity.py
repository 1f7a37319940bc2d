"""The run directory under abuse, end to end on the tiny model of test_train.py: two runs at once, a
`latest` that is lost, misdirected or names a garbled checkpoint, kill -9 at random instants
(including while the first run_config.json is written), and bad input to train.py and eval.py.

The reference for every resume is the same run left alone: its adapter bits and its metrics.
A random model never solves addition, so the reward is replaced (as in test_train.py) by one that
varies with the completion (its length's parity): the advantages are non-zero and the adapters move.
"""
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import eval as qeval
import lora
import run_dir
import train
from test_run_dir import garble, tree
from test_train import FAST, make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARITY = "lambda exs, texts, stats=None, **kw: [float(len(t) % 2) for t in texts]"


def parity_rewards(exs, texts, stats=None, **kw):  # PARITY, in this process
    return [float(len(t) % 2) for t in texts]

# train.py with the parity reward, as a process (what a kill -9 needs)
RUNNER = f"import sys, train; train.rewards.rewards = {PARITY}; train.main(sys.argv[1:])"


@pytest.fixture(scope="module")
def tiny_model(smollm2_tokenizer, tmp_path_factory):
    return make_tiny_model(smollm2_tokenizer, str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture
def parity(monkeypatch):
    monkeypatch.setattr(train.rewards, "rewards", parity_rewards)


def common(model, steps):
    return ["--model", model, "--save-every", "1", *FAST, "--eval-limit", "0", "--lr", "1e-2", "--lora-dropout", "0.1",
            "--max-steps", str(steps)]


def adapter(ckpt):
    return load_file(os.path.join(ckpt, lora.ADAPTER_WEIGHTS))


def assert_same_adapter(a, b):
    wa, wb = adapter(a), adapter(b)
    assert wa.keys() == wb.keys()
    bad = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not bad, f"{len(bad)} adapter tensors differ from the uninterrupted run's, e.g. {bad[0]}"


def metrics_lines(out):
    with open(os.path.join(out, run_dir.METRICS)) as f:
        return f.read().splitlines()


def rows(out):
    return [json.loads(x) for x in metrics_lines(out)]


def ck(out, step):
    return os.path.join(str(out), f"checkpoint-{step:06d}")


# ----------------------------------------------------------------------------------------------
# one writer


def test_a_second_run_on_a_live_directory_refuses_at_once(tiny_model, tmp_path, parity):
    out, solo = str(tmp_path / "run"), str(tmp_path / "solo")
    flags = common(tiny_model, 5)
    first = subprocess.Popen([sys.executable, "-c", RUNNER, *flags, "--output-dir", out], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lock = os.path.join(out, run_dir.LOCK)
    while not (os.path.exists(lock) and f"pid {first.pid} " in open(lock).read()):
        assert first.poll() is None, first.stderr.read()[-2000:]
        time.sleep(0.02)
    for extra in ([], ["--resume"]):
        t0 = time.monotonic()
        with pytest.raises(SystemExit, match=rf"in use by another run \(pid {first.pid} on host {socket.gethostname()}"):
            train.main([*flags, "--output-dir", out, *extra])
        assert time.monotonic() - t0 < 5.0, "the refusal must come before any model or data loads"
    assert first.wait() == 0, first.stderr.read()[-2000:]
    train.main([*flags, "--output-dir", solo])   # the same run, alone
    assert [r["step"] for r in rows(out)] == list(range(1, 6))
    assert [r["reward"] for r in rows(out)] == [r["reward"] for r in rows(solo)]
    assert_same_adapter(ck(out, 5), ck(solo, 5))
    assert all(run_dir.verify_checkpoint(ck(out, s)) is None for s in (4, 5))


# ----------------------------------------------------------------------------------------------
# `latest` is a hint


@pytest.mark.slow
def test_resume_when_latest_is_lost_misdirected_or_names_a_garbled_checkpoint(tiny_model, tmp_path, parity, capsys):
    flags = common(tiny_model, 6) + ["--keep-checkpoints", "6"]
    ref, base = str(tmp_path / "ref"), str(tmp_path / "base")
    train.main([*flags, "--output-dir", ref])                   # uninterrupted: checkpoints 1..6
    train.main([*flags, "--output-dir", base, "--stop-at", "4"])
    capsys.readouterr()

    def scenario(name, damage, stop_at):
        out = str(tmp_path / name)
        shutil.copytree(base, out)
        damage(out)
        before = tree(out)
        train.main([*flags, "--output-dir", out, "--resume", "--stop-at", str(stop_at)])
        return out, before, capsys.readouterr().out

    # latest removed: the newest verified checkpoint, and it says so
    out, _, said = scenario("lost", lambda o: os.remove(os.path.join(o, run_dir.LATEST)), 5)
    assert "resuming from checkpoint-000004" in said and "at step 4" in said
    assert metrics_lines(out)[:4] == metrics_lines(base)[:4] and len(metrics_lines(out)) == 5
    assert_same_adapter(ck(out, 5), ck(ref, 5))

    # latest pointing outside the run: ignored
    out, _, said = scenario("outside", lambda o: open(os.path.join(o, run_dir.LATEST), "w").write(
        "../ref/checkpoint-000006"), 5)
    assert "not a checkpoint of this run: ignored" in said and "at step 4" in said
    assert_same_adapter(ck(out, 5), ck(ref, 5))

    # latest names a checkpoint with 64 garbled adapter bytes, and the one before has a garbled trainer_state
    def garble_two(o):
        garble(os.path.join(ck(o, 4), lora.ADAPTER_WEIGHTS))
        garble(os.path.join(ck(o, 3), run_dir.TRAINER_STATE))
    out, before, said = scenario("garbled", garble_two, 3)
    assert "at step 2" in said and "checkpoint-000004 is not a complete checkpoint" in said
    assert {k: v for k, v in tree(out).items() if k.startswith("checkpoint-000004/")} == \
        {k: v for k, v in before.items() if k.startswith("checkpoint-000004/")}, "a newer checkpoint was touched"
    assert metrics_lines(out)[:2] == metrics_lines(base)[:2]
    assert_same_adapter(ck(out, 3), ck(ref, 3))                 # step 3 recomputed exactly
    assert any(d.startswith("checkpoint-000003.unverified-") for d in os.listdir(out))

    # every checkpoint garbled: refused with the reasons, nothing changed
    out = str(tmp_path / "all")
    shutil.copytree(base, out)
    for s in range(1, 5):
        garble(os.path.join(ck(out, s), lora.ADAPTER_WEIGHTS), seed=s)
    before = tree(out)
    with pytest.raises(SystemExit, match="no checkpoint in .* verifies"):
        train.main([*flags, "--output-dir", out, "--resume"])
    assert tree(out) == before


# ----------------------------------------------------------------------------------------------
# kill -9 at random instants


def kill_and_resume(model, tmp_path, steps, kills, seed):
    """kills × (start train.py --resume, SIGKILL it at a random instant), then let it finish; the
    result must be the uninterrupted run's, bit for bit. The directory starts as a kill during the
    first run_config.json write leaves it: only a half-written run_config.json.tmp."""
    flags = common(model, steps)
    ref = str(tmp_path / "ref")
    train.main([*flags, "--output-dir", ref])
    out = str(tmp_path / "killed")
    os.makedirs(out)
    with open(os.path.join(out, run_dir.RUN_CONFIG + ".tmp"), "w") as f:
        f.write('{"max_steps": %d, "mod' % steps)
    cmd = [sys.executable, "-c", RUNNER, *flags, "--output-dir", out, "--resume"]
    metrics = os.path.join(out, run_dir.METRICS)
    rng, seen = random.Random(seed), []
    for i in range(kills):
        done = len(open(metrics).readlines()) if os.path.exists(metrics) else 0
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if i % 2 == 0:  # any instant from the start: imports, loading, the run_config write, a step
            time.sleep(rng.uniform(0.2, 5.0))
        else:           # an instant once it trains: mid-step, mid-save, mid-rotation, between
            while proc.poll() is None and not (os.path.exists(metrics) and len(open(metrics).readlines()) > done):
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 1.0))
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
        assert proc.returncode in (0, -signal.SIGKILL), err.decode()[-2000:]
        seen.append(max([0] + [step for step, _ in run_dir.checkpoints(out)]))
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert [r["step"] for r in rows(out)] == list(range(1, steps + 1)), [r["step"] for r in rows(out)]
    assert [r["reward"] for r in rows(out)] == [r["reward"] for r in rows(ref)]
    assert_same_adapter(ck(out, steps), ck(ref, steps))
    assert not [d for d in os.listdir(out) if d.startswith(".tmp-")]
    return seen


@pytest.mark.slow
def test_kill_9_at_random_instants_many_times(smollm2_tokenizer, tiny_model, tmp_path, parity):
    seen = kill_and_resume(tiny_model, tmp_path, steps=16, kills=8, seed=1)
    print("checkpoints seen after each kill:", seen)
    assert len(set(seen)) > 3, f"the kills should land at different points of the run: {seen}"


# ----------------------------------------------------------------------------------------------
# bad input: one clear line, no traceback, nothing lost


@pytest.mark.parametrize("flags, message", [
    (["--max-grad-norm", "-1"], "--max-grad-norm must be > 0"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be > 0"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0, got -1"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--lr", "nan"], "--lr must be > 0, got nan"),
    (["--temperature", "inf"], "--temperature must be > 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--epsilon", "1"], "--epsilon must be in (0, 1)"),
    (["--epsilon-high", "0"], "--epsilon-high must be > 0"),
    (["--beta", "-0.1"], "--beta must be >= 0"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--sigma-start", "-1"], "--sigma-start must be > 0"),
    (["--sigma-end", "0"], "--sigma-end must be > 0"),
    (["--aqn-stages", "1"], "--aqn-stages must be >= 2"),
    (["--lora-alpha", "0"], "--lora-alpha must be > 0"),
    (["--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
    (["--importance-sampling-max", "0"], "--importance-sampling-max must be > 0"),
    (["--importance-sampling-min", "4"], "--importance-sampling-min (4.0) must be <= --importance-sampling-max"),
    (["--max-sampling-rounds", "0"], "--max-sampling-rounds must be >= 1"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1"),
    (["--logprob-chunk", "0"], "--logprob-chunk must be >= 1"),
    (["--eval-every", "-1"], "--eval-every must be >= 0"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0"),
    (["--stall-timeout", "-1"], "--stall-timeout must be >= 0"),
    (["--updates-per-rollout", "0"], "--updates-per-rollout must be >= 1"),
    (["--seed", "-1"], "--seed must be in [0, 2**63)"),
    (["--overlong-cache", "1024"], "--overlong-cache must be < --max-new-tokens (1024)"),
    (["--dataset", "no/such/file.jsonl"], "--dataset: unknown task"),
    (["--dataset", "math500"], "--dataset: math500 has only the 'test' split"),
    (["--model", "/no/such/model"], "--model: /no/such/model does not exist"),
    (["--tokenizer", "./nope"], "--tokenizer: ./nope does not exist"),
    (["--random-init", "--model", "qwen9-1b"], "--model: random init needs one of"),
    (["--device", "gpu0"], "--device:"),
])
def test_bad_train_flags_are_refused_at_parse_time(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--model", "x", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err
    assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1


def test_bad_input_to_train_py_is_one_line_without_traceback(tiny_model, tmp_path):
    bad_flag = subprocess.run([sys.executable, "train.py", "--model", "x", "--max-grad-norm", "-1"], cwd=ROOT,
                              capture_output=True, text=True)
    assert bad_flag.returncode == 2 and "--max-grad-norm must be > 0" in bad_flag.stderr
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"question": "1 + 1?", "answer": "2"}\n{"question": "caf\xe9?", "answer": "3"}\n')
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "train.py", "--model", tiny_model, "--dataset", str(data), "--eval-limit", "0",
                          "--output-dir", str(out), "--dtype", "float32"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 1, res.stderr[-2000:]
    assert f"error: --dataset: {data}:2: not UTF-8 (byte 0xe9 at column 18)" in res.stderr and "Traceback" not in res.stderr


def test_an_empty_dataset_and_a_garbled_metrics_line_are_named(tiny_model, tmp_path, parity):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(SystemExit, match="error: --dataset: .*empty.jsonl: the dataset is empty"):
        train.main(["--model", tiny_model, "--dataset", str(empty), "--eval-limit", "0", "--output-dir",
                    str(tmp_path / "e")])
    out = str(tmp_path / "run")
    flags = common(tiny_model, 3)
    train.main([*flags, "--output-dir", out, "--stop-at", "2"])
    path = os.path.join(out, run_dir.METRICS)
    lines = open(path, "rb").read().split(b"\n")
    lines[0] = lines[0].replace(b'"step"', b'"st\xffep"')
    open(path, "wb").write(b"\n".join(lines))
    before = tree(out)
    with pytest.raises(SystemExit, match=r"metrics.jsonl:1: not UTF-8 \(byte 0xff"):
        train.main([*flags, "--output-dir", out, "--resume"])
    assert tree(out) == before


def test_eval_refuses_bad_output_empty_data_and_a_nan_adapter(tiny_model, tmp_path, capsys):
    base = ["--model", tiny_model, "--dataset", "addition", "--limit", "2", "--max-new-tokens", "4", "--dtype", "float32"]
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for output, message in ((str(blocker / "pred.jsonl"), "--output: cannot write in"),
                            (str(tmp_path), "is a directory"), ("/proc/qerl-pred.jsonl", "--output: cannot write in")):
        with pytest.raises(SystemExit) as e:
            qeval.main([*base, "--output", output])
        assert e.value.code == 2 and message in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match="the dataset is empty"):
        qeval.main([*base[:2], "--dataset", str(empty)])
    with pytest.raises(SystemExit) as e:
        qeval.main([*base, "--adapter", str(tmp_path)])
    assert e.value.code == 2 and "has no adapter_config.json or adapter_model.safetensors" in capsys.readouterr().err

    from checkpoint import load_model
    model = load_model(tiny_model, quant="bf16", dtype=torch.float32, device="cpu")
    lora.apply_lora(model, lora.LoRAConfig(r=4, alpha=8))
    with torch.no_grad():
        next(iter(lora.lora_modules(model).values())).lora_B.fill_(float("nan"))   # a diverged run's adapter
    lora.save_adapter(model, str(tmp_path / "nan"), tiny_model)
    res = subprocess.run([sys.executable, "eval.py", *base, "--adapter", str(tmp_path / "nan")], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 1 and "holds NaN or Inf" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "accuracy" not in res.stdout
