"""watchdog.py: a stall ends the process with every thread's stack; a process that beats, or pauses,
goes on.

Each case runs in a process of its own (a firing watchdog ends its process). The references are
CPython's: a stall in Python code (time.sleep releases the GIL), a stall in C code that holds the GIL
(a libc sleep called through ctypes.PyDLL, which keeps the GIL, where ctypes.CDLL would release it),
and faulthandler's own header and stack format. Last, train.py stalled in its training pass: it exits
75 naming the last checkpoint, and --resume continues the run; train.py failed on the GPU names the same.
"""
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

import watchdog
from test_train import FAST, ROOT, make_tiny_model, read_metrics

LIMIT_S = 0.5


def run_script(body: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """Run `body` (after `import time, watchdog`) in a fresh Python at the repository root ->
    (the finished process, its wall time in s)."""
    code = "import time, watchdog\n" + textwrap.dedent(body)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return res, time.monotonic() - t0


def test_a_stall_in_python_exits_75_with_the_last_beat_and_the_stacks():
    res, wall = run_script(f"""
        def stuck_here():
            time.sleep(30)
        with watchdog.watching({LIMIT_S}, lambda: "resume it so"):
            watchdog.beat("step one")
            watchdog.beat("step two")
            stuck_here()
        print("not reached")
    """)
    assert res.returncode == watchdog.EXIT_STALLED, res.stderr
    assert "not reached" not in res.stdout
    assert re.search(r"error: no progress for 0\.[5-9] s \(the last: step two\)", res.stderr), res.stderr
    assert "resume it so" in res.stderr
    assert "in stuck_here" in res.stderr, res.stderr           # the main thread's frame, where it sleeps
    assert wall < 15, wall


def test_a_stall_that_holds_the_gil_is_ended_by_faulthandler():
    res, wall = run_script(f"""
        import ctypes
        libc = ctypes.PyDLL(None)           # PyDLL: the call keeps the GIL, so no Python thread runs
        def stuck_in_c():
            libc.sleep(30)
        with watchdog.watching({LIMIT_S}):
            for _ in range(30):             # the watching thread looks a few times (and arms the backstop)
                watchdog.beat("a step")
                time.sleep({LIMIT_S / 10})
            stuck_in_c()
        print("not reached")
    """)
    assert res.returncode == 1, res.stderr                        # faulthandler's exit, not EXIT_STALLED
    assert "not reached" not in res.stdout
    assert "Timeout (" in res.stderr and "in stuck_in_c" in res.stderr, res.stderr
    assert "error: no progress" not in res.stderr                 # the Python thread never ran again
    assert wall < 15, wall


def test_beats_and_pauses_keep_a_run_alive_and_the_watch_ends_with_its_block():
    res, _ = run_script(f"""
        import threading
        with watchdog.watching({LIMIT_S}):
            t = time.monotonic()
            while time.monotonic() - t < {4 * LIMIT_S}:
                watchdog.beat("a step")
                time.sleep({LIMIT_S / 10})
            with watchdog.paused("a slow reward"):
                time.sleep({3 * LIMIT_S})     # longer than the limit, but paused
            time.sleep({LIMIT_S / 2})         # the pause's end was a beat
            names = [th.name for th in threading.enumerate()]
        time.sleep({3 * LIMIT_S})             # after the block: no watchdog, no backstop
        with watchdog.watching(0):            # 0: no watchdog at all
            zero = [th.name for th in threading.enumerate()]
            time.sleep({3 * LIMIT_S})
        print("alive", "qerl-watchdog" in names, "qerl-watchdog" in zero, threading.active_count())
    """)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["alive", "True", "False", "1"], res.stdout


@pytest.mark.slow
def test_train_stalled_in_its_training_pass_exits_75_and_resumes(smollm2_tokenizer, tmp_path):
    """The second step's loss never returns: train.py ends with EXIT_STALLED, names the last checkpoint
    and the resume command; that command runs the run to its end."""
    model = make_tiny_model(smollm2_tokenizer, str(tmp_path / "model"))
    out = str(tmp_path / "run")
    argv = ["--model", model, "--output-dir", out, "--save-every", "1", "--max-steps", "3", "--eval-limit", "1", *FAST]
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import time, grpo, train
        calls, loss = [0], grpo.policy_loss
        def policy_loss(*a, **k):              # the second step's first micro-batch hangs
            calls[0] += 1
            if calls[0] == 2 + 1:              # 2 micro-batches a step (--micro-batch 4, 8 completions)
                time.sleep(600)
            return loss(*a, **k)
        grpo.policy_loss = policy_loss
        train.main({[*argv, "--stall-timeout", "5"]!r})
    """)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == watchdog.EXIT_STALLED, res.stderr[-3000:]
    assert re.search(r"error: no progress for [56]\.\d s \(the last: the rewards\)", res.stderr), res.stderr[-3000:]
    ckpt = os.path.join(out, "checkpoint-000001")
    assert f"{ckpt} (step 1) is the last checkpoint, intact; continue with: python train.py --resume {out}" \
        in res.stderr, res.stderr[-3000:]
    assert "in policy_loss" in res.stderr                      # the main thread's stack, where it hung
    assert [r["step"] for r in read_metrics(out)] == [1]
    res = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--resume", out], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout and "at step 1" in res.stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def test_train_failed_on_the_gpu_names_its_checkpoint_and_the_resume(smollm2_tokenizer, tmp_path, monkeypatch, capsys):
    """A CUDA error in the second step (torch.AcceleratorError: what a kernel's trap, fp4_decode._await_shrink,
    raises at the host's next synchronisation) propagates, and train.py first names the step, the error,
    the last checkpoint and the command that resumes from it."""
    import torch

    import train
    real, calls = train.train_step, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.AcceleratorError("CUDA error: unspecified launch failure\nmore lines")
        return real(*args, **kwargs)
    monkeypatch.setattr(train, "train_step", failing)
    out = str(tmp_path / "run")
    model = make_tiny_model(smollm2_tokenizer, str(tmp_path / "model"))
    with pytest.raises(torch.AcceleratorError):
        train.main(["--model", model, "--output-dir", out, "--max-steps", "3", "--save-every", "1", *FAST,
                    "--eval-limit", "0"])
    err = capsys.readouterr().err
    assert (f"the GPU failed (CUDA error: unspecified launch failure) during step 2: {out}/checkpoint-000001 (step 1) "
            f"is the last checkpoint, intact; continue with: python train.py --resume {out}") in err, err[-600:]


def test_eval_stalled_in_its_sampling_exits_75_and_writes_nothing(smollm2_tokenizer, tmp_path):
    """A prompt's encoding never returns (inside the watched evaluation): eval.py ends with EXIT_STALLED
    and leaves no --output behind; a negative limit is refused before the model loads."""
    model = make_tiny_model(smollm2_tokenizer, str(tmp_path / "model"))
    output = tmp_path / "eval.jsonl"
    argv = ["--model", model, "--dataset", "addition", "--limit", "2", "--max-new-tokens", "4", "--dtype", "float32",
            "--output", str(output), "--stall-timeout", "2"]
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import time, eval, tasks
        def encode_prompt(*a, **k):
            time.sleep(600)
        tasks.encode_prompt = encode_prompt
        eval.main({argv!r})
    """)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == watchdog.EXIT_STALLED, res.stderr[-3000:]
    assert re.search(r"no progress for 2\.\d s \(the last: the start of the watch\)", res.stderr), res.stderr[-3000:]
    assert "Nothing was written; run the command again." in res.stderr and "in encode_prompt" in res.stderr
    assert not output.exists()
    res = subprocess.run([sys.executable, "eval.py", *argv[:-1], "-1"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and "--stall-timeout must be >= 0 (0 = never), got -1.0" in res.stderr, res.stderr

