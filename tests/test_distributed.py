"""train.py's data parallelism on CPU: 2 processes over gloo, checked against 1 process.

The reference is the single-process train_step on the whole generation batch: with 2 ranks, each
runs the forward/backward on its half of the groups and the summed gradient must give the same
LoRA update (fp32, to rounding) for every loss type, and the two replicas must stay bit-identical.
The tiny model, the fake rollout groups and the one-step update come from test_train.py.
"""
import os
import socket
import subprocess
import sys

import pytest
import torch

import distributed
import run_dir
import train
from test_train import FAST, ROOT, lora_update, make_groups, make_tiny_model, read_metrics

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")
# 4 groups of G = 4 (2 per rank), mixed rewards so that every group has a non-zero advantage.
REWARDS = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1])


@pytest.fixture(scope="module")
def tiny_model(smollm2_tokenizer, tmp_path_factory):
    return make_tiny_model(smollm2_tokenizer, str(tmp_path_factory.mktemp("tiny") / "model"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, model_dir: str, out_dir: str, device: str) -> None:
    """One rank: torchrun's environment, distributed.dist_setup, then one update per loss type."""
    torch.set_num_threads(1)
    # As under torchrun, the rendezvous store lives outside the ranks (here: in the test process), so
    # no rank takes it down while the other is still tearing its process group down.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True")
    rank_, world_, dev = distributed.dist_setup(device)   # gloo on CPU, nccl on cuda:<rank>
    assert (rank_, world_) == (rank, world)
    for loss_type in LOSS_TYPES:
        update, metrics = lora_update(model_dir, make_groups(4, seed=5), REWARDS, loss_type, micro_batch=2, device=dev)
        torch.save((update, metrics), os.path.join(out_dir, f"{loss_type}-{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # Results are on disk: leave without C++ static teardown, where gloo's threads have been seen to
    # abort the process ("terminate called without an active exception") after the work was done.
    os._exit(0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_two_ranks_give_the_single_process_update(tiny_model, tmp_path, device):
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    torch.multiprocessing.spawn(_worker, args=(2, port, tiny_model, str(tmp_path), device), nprocs=2, join=True)
    del store
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: the CPU matmul blocking (and so the rounding) depends on it
    try:
        reference = {lt: lora_update(tiny_model, make_groups(4, seed=5), REWARDS, lt, micro_batch=2, device=device)
                     for lt in LOSS_TYPES}
    finally:
        torch.set_num_threads(threads)
    for loss_type, (want, want_met) in reference.items():
        (got, met), (got1, _) = [torch.load(tmp_path / f"{loss_type}-{r}.pt", weights_only=True) for r in (0, 1)]
        assert all(torch.equal(a, b) for a, b in zip(got, got1)), f"{loss_type}: the replicas differ"
        assert any(g.abs().max() > 0 for g in want), "the update is zero: nothing is tested"
        err = max((a - b).abs().max().item() / (b.abs().max().item() + 1e-12) for a, b in zip(got, want))
        print(f"{device} {loss_type}: 2 ranks vs 1 process, LoRA update max rel err {err:.2e}")
        assert err < 1e-4, f"{loss_type}: 2 ranks vs 1 process, LoRA update max rel err {err:.2e}"
        for k in ("loss", "grad_norm", "num_tokens", "entropy", "clip_ratio/region_mean"):
            assert met[k] == pytest.approx(want_met[k], rel=1e-4, abs=1e-6), (loss_type, k, met[k], want_met[k])


def test_torchrun_two_processes_end_to_end(tiny_model, tmp_path):
    """`torchrun --nproc-per-node 2 train.py` on CPU: rank 0 logs and checkpoints, both resume. Each step
    fills its batch by dynamic sampling over both ranks (the reward leaves the groups of odd answers
    without a spread): every rank must agree on the rounds and their sizes, a round of one prompt
    included (rank 1 draws none), and the resumed step sizes its round from the checkpoint's keep rate."""
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "train.py"), "--model", tiny_model, "--output-dir", out, "--device", "cpu",
           "--max-steps", "4", "--save-every", "1", *FAST, "--eval-limit", "3", "--dynamic-sampling",
           "--prompts-per-step", "4", "--max-sampling-rounds", "2", "--dynamic-sampling-threshold", "0",
           "--reward", "reward_examples:spread_on_even_answers"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "tests")}
    res = subprocess.run([*cmd, "--stop-at", "2"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    res = subprocess.run([*cmd, "--resume"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("resumed from") == 1, "only rank 0 prints"
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and "eval/accuracy" in rows[3], rows
    assert all("loss" in r for r in rows), rows
    # The data order's answers (even: a spread), a budget of 2 rounds · 4 = 8 prompts a step.
    # step 0, rate 1: 128 137 52 122 (3 of 4), then round_size(1, 3/4, 4) = 3 (n = 2: 1.5 - 0.61 < 1):
    #   100 144 23 -> 7 prompts, 5 informative
    # step 1, rate 5/7: round_size(4, 5/7, 8) = 8 (n = 7: 5 - 1.20 < 4): 117 155 192 88 117 142 120 91 (4)
    # step 2 (resumed), rate 1/2: round_size(4, 1/2, 8) = the budget: 40 154 85 155 58 66 100 112 (6)
    # step 3, rate 3/4: round_size(4, 3/4, 8) = 7 (n = 6: 4.5 - 1.06 < 4): 98 87 145 94 132 101 163 (3),
    #   then the one prompt left, 102: rank 1 draws none
    assert [(r["sampling/keep_rate"], r["sampling/prompts"], r["sampling/rounds"]) for r in rows] == \
        [(1.0, 7, 2), (pytest.approx(5 / 7), 8, 1), (0.5, 8, 1), (0.75, 8, 2)], rows
    state = torch.load(os.path.join(out, "checkpoint-000004", run_dir.TRAINER_STATE), weights_only=True)
    assert state["data_pos"] == sum(r["sampling/prompts"] for r in rows), "a round's prompts are the global count"
    with open(os.path.join(out, run_dir.RUN_CONFIG)) as f:
        assert '"world_size": 2' in f.read()


# ----------------------------------------------------------------------------------------------
# bad input


def test_prompts_not_divisible_by_world_size_are_refused(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "x", "--prompts-per-step", "3"])
    assert "--prompts-per-step (3, the global count) must divide by the number of processes (2)" in capsys.readouterr().err


def test_more_processes_than_gpus_are_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit, match="4 processes per node asked for, but 2 CUDA devices visible"):
        distributed.dist_setup("cuda")
    assert not torch.distributed.is_initialized()
